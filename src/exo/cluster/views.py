"""The cluster's state as plain JSON-ready data: instances, nodes, placements (what ``/v1/cluster``,
``/v1/instances`` and the dashboard's events carry)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from exo.wire.proto_gen import node_pb2 as pb

from . import placement as pl


@dataclasses.dataclass(frozen=True)
class Located:
    """An instance (or a pipeline's stage) and the node that runs it."""

    node_id: str
    instance: pb.Instance


def progress_json(progress: pb.DownloadProgress) -> dict[str, Any]:
    """A download's progress as ``/v1/downloads`` shows it: bytes (done, total), files, speed, ETA."""
    return {
        "bytes_done": progress.bytes_done,
        "bytes_total": progress.bytes_total,
        "files_done": progress.files_done,
        "files_total": progress.files_total,
        "speed_bytes_per_s": round(progress.speed_bytes_per_s, 1),
        "eta_s": round(progress.eta_s, 1) if progress.HasField("eta_s") else None,
        "elapsed_s": round(progress.elapsed_s, 3),
    }


def download_json(item: pb.NodeDownload, node_id: str) -> dict[str, Any]:
    """A node's download in the shape of ``/v1/downloads``' objects (without its result), with its node."""
    stage = item.stage
    return {
        "id": item.download_id,
        "object": "download",
        "model": item.model_id,
        "repo": item.repo or None,
        "revision": item.revision,
        "status": item.progress.status,
        "progress": progress_json(item.progress),
        "options": {"stage": {"start": stage.start_layer, "end": stage.end_layer, "n_layers": stage.n_layers}
                    if item.HasField("stage") else None},
        "created_at": round(item.created_unix, 3),
        "result": None,
        "error": {"code": item.error_code, "message": item.error_message} if item.error_code else None,
        "node": node_id,
    }


def instance_download_json(inst: pb.Instance) -> dict[str, Any] | None:
    """The download that fetched (or fetches) an instance's weights: its id, status and progress."""
    if not inst.HasField("download"):
        return None
    return {"id": inst.download_id, "status": inst.download.status, **progress_json(inst.download)}


def downloading(inst: pb.Instance) -> bool:
    """Loading, and its weights are still on their way."""
    return (inst.state == pb.INSTANCE_STATE_LOADING and inst.HasField("download")
            and inst.download.status not in ("complete", "failed", "cancelled"))


def state_name(inst: pb.Instance) -> str:
    """loading | downloading (loading, its weights not there yet) | ready | failed | stopping."""
    return "downloading" if downloading(inst) else STATE_NAMES.get(inst.state, "failed")


STATE_NAMES = {
    pb.INSTANCE_STATE_LOADING: "loading",
    pb.INSTANCE_STATE_READY: "ready",
    pb.INSTANCE_STATE_FAILED: "failed",
    pb.INSTANCE_STATE_STOPPING: "stopping",
}


def instance_json(inst: pb.Instance, node_id: str, self_id: str) -> dict[str, Any]:
    failure = None
    if inst.HasField("failure"):
        f = inst.failure
        failure = {"exit_code": f.exit_code, "message": f.message, "stderr_tail": list(f.stderr_tail),
                   "at": f.at_unix}
    s = inst.model
    return {
        "id": inst.instance_id,
        "object": "instance",
        "model": inst.model_id,
        "model_ref": inst.model_ref,
        "node": node_id,
        "self": node_id == self_id,
        "state": state_name(inst),
        "progress": round(inst.progress, 4),
        "stage": inst.stage,
        "shard": {"start_layer": inst.shard.start_layer, "end_layer": inst.shard.end_layer,
                  "rank": inst.shard.rank, "world_size": inst.shard.world_size or 1},
        # How the instance is split over nodes: "none" (one node), "pipeline" (layers) or "tensor" (every layer's
        # slice on every member); a tensor group's collectives' backend (ring | nccl | jaccl), a pipeline's group's
        # where it is not the ring (nccl: a pipeline of two CUDA nodes, its steps on the collective wire); else null.
        "sharding": sharding_name(inst.shard),
        "backend": inst.shard.backend or None,
        "failure": failure,
        "restarts": inst.restarts,
        "pid": inst.pid,
        "created": inst.created_unix,
        "updated": inst.updated_unix,
        "on_demand": inst.on_demand,
        "queue_depth": inst.queue_depth,
        "running": inst.running,
        "native_mtp": {
            "available": s.mtp_available,
            "reason": s.mtp_reason or None,
            "default_k": s.default_k or None,
            "max_k": s.max_k or None,
        } if inst.HasField("model") else None,
        # The instance's stages in order (one for a single-node instance), each with its own state.
        "stages": [stage_json(inst, node_id)],
        # Its weights were not on the node: the download that fetches them (null: nothing was downloaded).
        "download": instance_download_json(inst),
        # Its prefix cache (null: none): the node card's figures for this instance alone, and how many cached
        # prefixes its summary lists to the routers (docs/prefix-cache.md).
        "prefix_cache": {**figures, "held_prefixes": len(inst.prefix_summary.positions)}
        if (figures := prefix_cache_json([inst])) is not None else None,
    }


def sharding_name(shard: pb.Shard) -> str:
    if shard.world_size <= 1:
        return "none"
    return shard.sharding or "pipeline"


def stage_json(inst: pb.Instance | None, node_id: str, spec: pb.StagePlacement | None = None,
               missing: str = "gone") -> dict[str, Any]:
    """One stage: where it runs, its layers and rank, and its runner's state."""
    if inst is None:
        assert spec is not None
        return {"node": spec.node_id, "start_layer": spec.start_layer, "end_layer": spec.end_layer,
                "rank": spec.rank, "state": missing, "stage": "", "progress": 0.0, "pid": 0, "failure": None,
                "download": None}
    shard = inst.shard
    failure = None
    if inst.HasField("failure"):
        failure = {"exit_code": inst.failure.exit_code, "message": inst.failure.message}
    return {
        "node": node_id,
        "start_layer": shard.start_layer,
        "end_layer": shard.end_layer,
        "rank": shard.rank,
        "state": state_name(inst),
        "stage": inst.stage,
        "progress": round(inst.progress, 4),
        "pid": inst.pid,
        "failure": failure,
        "download": instance_download_json(inst),
    }


def pipeline_json(planned: list[pb.StagePlacement], found: list[Located | None], state: str, why: str,
                  self_id: str) -> dict[str, Any]:
    """A pipelined instance as ONE instance: the leader's (last stage's) view, plus every stage."""
    leader = found[-1] or next(loc for loc in reversed(found) if loc is not None)
    view = instance_json(leader.instance, planned[-1].node_id, self_id)
    view["stages"] = [
        stage_json(loc.instance if loc is not None else None, spec.node_id, spec)
        for spec, loc in zip(planned, found, strict=True)
    ]
    view["state"] = state
    if state == "loading" and any(s["state"] == "downloading" for s in view["stages"]):
        view["state"] = "downloading"
    view["download"] = _pipeline_download(view["stages"])
    view["progress"] = round(min(s["progress"] if s["state"] != "ready" else 1.0 for s in view["stages"]), 4)
    view["pid"] = found[-1].instance.pid if found[-1] is not None else 0
    if why and state == "failed" and view["failure"] is None:
        view["failure"] = {"exit_code": 0, "message": why, "stderr_tail": [], "at": 0.0}
    view["pipeline_reason"] = why or None
    return view


def _pipeline_download(stages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A pipeline's downloads as one: bytes and files summed over its stages, the slowest stage's ETA."""
    parts = [s["download"] for s in stages if s["download"] is not None]
    if not parts:
        return None
    statuses = [p["status"] for p in parts]
    etas = [p["eta_s"] for p in parts]
    return {
        "id": None,
        "status": next((x for x in statuses if x not in ("complete",)), "complete"),
        "bytes_done": sum(p["bytes_done"] for p in parts),
        "bytes_total": sum(p["bytes_total"] for p in parts),
        "files_done": sum(p["files_done"] for p in parts),
        "files_total": sum(p["files_total"] for p in parts),
        "speed_bytes_per_s": round(sum(p["speed_bytes_per_s"] for p in parts), 1),
        "eta_s": None if any(e is None for e in etas) else max(etas),
        "elapsed_s": max(p["elapsed_s"] for p in parts),
        "stages": len(parts),
    }


def node_json(
    info: pb.NodeInfo, *, self_id: str, host: str | None, last_seen_s: float, rtt_ms: float, source: str
) -> dict[str, Any]:
    return {
        "id": info.node_id,
        "name": info.name,
        "self": info.node_id == self_id,
        "host": host,
        "api_port": info.api_port,
        "grpc_port": info.grpc_port,
        "version": info.version,
        "namespace": info.namespace,
        "memory_total_bytes": info.memory_total_bytes,
        "memory_available_bytes": info.memory_available_bytes,
        "chip": info.chip,
        "backend": info.backend,
        "disk_free_bytes": info.disk_free_bytes,
        "platform": info.platform,
        "cpu_count": info.cpu_count,
        "uptime_s": round(info.uptime_s, 3),
        "secured": info.secured,
        "models": [m.model_id for m in info.models],
        "instances": [i.instance_id for i in info.instances],
        "last_seen_s": round(last_seen_s, 3),
        "rtt_ms": round(rtt_ms, 3),
        "source": source,
        "offline": info.offline,
        "hub_cache_free_bytes": info.hub_cache_free_bytes,
        # Weight bytes a decode step reads per second here, as its runners measured it (null: not yet): the unit of
        # placement's speed estimates.
        "decode_bytes_per_s": round(info.decode_bytes_per_s) if info.decode_bytes_per_s else None,
        # Its downloads (running, and those that ended in the last minutes), as /v1/downloads shows them.
        "downloads": [download_json(d, info.node_id) for d in info.downloads],
        "prefix_cache": prefix_cache_json(info.instances),
    }


def prefix_cache_json(instances: Iterable[pb.Instance]) -> dict[str, Any] | None:
    """The prefix caches of a node's instances together (None: none has one): lookups, hits, prompt and
    restored tokens, the token hit rate, bytes held and budgets per tier."""
    caches = [i.prefix_cache for i in instances if i.HasField("prefix_cache")]
    if not caches:
        return None
    out = {f.name: sum(getattr(c, f.name) for c in caches) for f in pb.PrefixCacheFigures.DESCRIPTOR.fields}
    out["token_hit_rate"] = round(out["cached_tokens"] / out["prompt_tokens"], 4) if out["prompt_tokens"] else 0.0
    return out


def option_json(option: pl.PlacementOption) -> dict[str, Any]:
    """One split placement considered (the preview's ``options``): where it would go and how fast, or why not."""
    plan = option.placement
    return {
        "sharding": option.sharding,
        "placement_sharding": plan.sharding if plan is not None else None,
        "estimated_tokens_per_s": round(option.tokens_per_s, 2) if option.tokens_per_s is not None else None,
        "estimate_basis": option.basis or None,
        "nodes": [s.node_id for s in plan.shards] if plan is not None else [],
        "backend": plan.backend or None if plan is not None else None,
        "headroom_bytes": plan.headroom_bytes if plan is not None else None,
        "error": option.error,
    }


def placement_json(plan: pl.Placement, options: Iterable[pl.PlacementOption] | None = None) -> dict[str, Any]:
    """A placement (what POST /v1/instances placed, or the preview's); ``options``: every split considered (the
    preview: both; "auto": what it chose from), else the plan's own."""
    req = plan.requirement
    considered = list(options if options is not None else plan.options)
    chosen = next((o for o in considered if o.placement is not None and o.placement.shards == plan.shards), None)
    if chosen is None:  # the options were planned a moment apart: nodes' free memory may have reordered the members
        members = {s.node_id for s in plan.shards}
        chosen = next((o for o in considered if o.placement is not None and o.sharding == plan.sharding
                       and {s.node_id for s in o.placement.shards} == members), None)
    return {
        "model": plan.model_id,
        "node": plan.node_id,
        "sharding": plan.sharding,
        "backend": plan.backend or None,
        "estimated_tokens_per_s": round(chosen.tokens_per_s, 2) if chosen and chosen.tokens_per_s else None,
        "options": [option_json(o) for o in considered],
        "needed_bytes": req.needed_bytes,
        "weights_bytes": req.weights_bytes,
        "kv_bytes": req.kv_bytes,
        "context_tokens": req.context_tokens,
        "activation_bytes": req.activation_bytes,
        "node_free_bytes": plan.node_free_bytes,
        "headroom_bytes": plan.headroom_bytes,
        "shards": [dataclasses.asdict(s) for s in plan.shards],
        "stages": [
            {"node": s.node_id, "start_layer": s.start_layer, "end_layer": s.end_layer, "rank": s.rank,
             "free_bytes": free, "needed_bytes": needed, "download": download,
             "download_bytes": req.stage_weight_bytes(s.start_layer, s.end_layer) if download else 0}
            for s, free, needed, download in zip(
                plan.shards,
                plan.stage_free_bytes or (plan.node_free_bytes,),
                plan.stage_needed_bytes or (req.needed_bytes,),
                plan.stage_downloads or (False,) * len(plan.shards),
                strict=True,
            )
        ],
    }

