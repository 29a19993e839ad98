"""Pipelined instances as the cluster sees them: one instance, one runner per stage on its stage's node.
A tensor group is one too (its members are its stages, each holding every layer's slice: ``Pipeline.sharding``).

Every stage's node lists its own stage (an ``Instance`` with the same id, its ``shard`` and the whole
``stages`` list), so any node can put the pipeline back together from what its peers report
(``group_stages``), tell its state (``pipeline_state``: ready when its leader is, failed when a stage
failed or its node left) and find its leader (the last stage, which serves generations). Pure functions:
the orchestration (``orchestration.py``) forms groups, tears broken ones down and places them anew.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from exo.wire.proto_gen import node_pb2 as pb

from . import placement as pl
from .views import Located

READY, LOADING, FAILED, STOPPING = (
    pb.INSTANCE_STATE_READY, pb.INSTANCE_STATE_LOADING, pb.INSTANCE_STATE_FAILED, pb.INSTANCE_STATE_STOPPING
)


def is_pipelined(inst: pb.Instance) -> bool:
    return len(inst.stages) > 1


def stage_placements(plan: pl.Placement) -> list[pb.StagePlacement]:
    return [pb.StagePlacement(node_id=s.node_id, start_layer=s.start_layer, end_layer=s.end_layer, rank=s.rank)
            for s in plan.shards]


@dataclass(frozen=True)
class Pipeline:
    """One pipelined instance: its planned stages and, per rank, the stage as its node reports it (None:
    that node does not list it, or left the cluster)."""

    instance_id: str
    model_id: str
    planned: tuple[pb.StagePlacement, ...]
    found: tuple[Located | None, ...]
    owner_node: str
    sharding: str = "pipeline"  # "tensor": a tensor group (every member a slice of every layer), kept as one

    @property
    def leader(self) -> Located | None:
        return self.found[-1]

    @property
    def world_size(self) -> int:
        return len(self.planned)

    def missing(self) -> list[pb.StagePlacement]:
        return [s for s, loc in zip(self.planned, self.found, strict=True) if loc is None]

    def nodes(self) -> list[str]:
        return [s.node_id for s in self.planned]


def group_stages(located: Iterable[Located]) -> tuple[list[Located], list[Pipeline]]:
    """Split the cluster's instances into single-node ones and pipelines (stages grouped by instance id)."""
    single: list[Located] = []
    stages: dict[str, dict[int, Located]] = {}
    first_seen: dict[str, pb.Instance] = {}
    for loc in located:
        inst = loc.instance
        if not is_pipelined(inst):
            single.append(loc)
            continue
        first_seen.setdefault(inst.instance_id, inst)
        stages.setdefault(inst.instance_id, {})[inst.shard.rank] = loc
    pipelines = []
    for instance_id, by_rank in stages.items():
        inst = first_seen[instance_id]
        planned = tuple(sorted(inst.stages, key=lambda s: s.rank))
        found = tuple(
            loc if (loc := by_rank.get(s.rank)) is not None and loc.node_id == s.node_id else None for s in planned
        )
        pipelines.append(Pipeline(instance_id, inst.model_id, planned, found, inst.owner_node,
                                  inst.shard.sharding or "pipeline"))
    return single, pipelines


def pipeline_state(p: Pipeline, alive: Collection[str]) -> tuple[int, str]:
    """(state, why) of the whole pipeline. FAILED (broken) as soon as a stage failed or its node left the
    cluster; STOPPING while a stage is being removed, or not listed by its (live) node: unloaded on
    purpose, or not reported yet; READY when its leader is (the leader is ready only after the group
    formed and it warmed up through every stage); else LOADING."""
    stopping = missing = ""
    for spec, loc in zip(p.planned, p.found, strict=True):
        if spec.node_id not in alive:
            return FAILED, f"stage {spec.rank}'s node {spec.node_id[:8]} left the cluster"
        if loc is not None and loc.instance.state == FAILED:
            why = loc.instance.failure.message or "failed"
            return FAILED, f"stage {spec.rank} on node {spec.node_id[:8]}: {why}"
        if loc is not None and loc.instance.state == STOPPING:
            stopping = stopping or f"stage {spec.rank} on node {spec.node_id[:8]} is stopping"
        if loc is None:
            missing = missing or f"stage {spec.rank} on node {spec.node_id[:8]} is not listed"
    forming = any(loc is not None and loc.instance.state == LOADING for loc in p.found)
    if stopping or (missing and not forming):
        return STOPPING, stopping or missing
    if missing:
        return LOADING, missing  # placed moments ago: its node has not listed the stage yet
    leader = p.leader
    assert leader is not None
    if leader.instance.state == READY:
        return READY, ""
    return LOADING, leader.instance.stage


def download_failed(p: Pipeline) -> bool:
    """A stage failed because its weights could not be downloaded (placing the pipeline anew at once would
    fetch from the same hub, onto the same disks)."""
    return any(loc is not None and loc.instance.state == FAILED and loc.instance.HasField("download")
               and loc.instance.download.status in ("failed", "cancelled") for loc in p.found)


def responsible_node(p: Pipeline, alive: Collection[str]) -> str | None:
    """Which node re-places a broken pipeline: the node that placed it while it is in the cluster, else the
    surviving stage node with the smallest id (every node computes the same answer from the same view)."""
    if p.owner_node and p.owner_node in alive:
        return p.owner_node
    survivors = sorted(n for n in p.nodes() if n in alive)
    return survivors[0] if survivors else None


def hosts_of(stages: Sequence[pb.StagePlacement], addresses: dict[str, str], ports: dict[str, int]) -> list[str]:
    """The ring's hosts file entries, by rank: the stage node's address and its runner's ring port."""
    out = []
    for s in stages:
        host = addresses[s.node_id]
        out.append(f"[{host}]:{ports[s.node_id]}" if ":" in host else f"{host}:{ports[s.node_id]}")
    return out
