"""Placing instances and waiting for them: a model that no instance serves is placed (``placement``) and
loaded on demand, a request waiting for it bounded by the load timeout; an instance (or a pipeline's stage)
starts on a node through that node's ``LoadInstance``; a group (a pipeline's stages, a tensor group's members)
then forms in the background (``groups.PipelineGroups``). A model is split by layers unless asked otherwise
(``sharding``: "tensor", or "auto", the faster by placement's estimates). Also ``POST``/``DELETE /v1/instances``."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from exo.wire.proto_gen import node_pb2 as pb

from . import pipelines as pipes
from . import placement as pl
from .calls import CALL_TIMEOUT_S, POLL_READY_S, rpc_error
from .cluster_view import ClusterView
from .groups import PipelineGroups
from .node import ClusterNode, new_instance_id
from .registry import Peer
from .service import InstanceNotFoundError, ModelLoadTimeoutError, NodeUnavailableError
from .supervisor import InstanceFailedError
from .views import STATE_NAMES, Located

log = logging.getLogger(__name__)

PLACE_ATTEMPTS = 3  # looks for a placed instance that placement reports but the cluster view lacks


class Placer:
    """``max_loaded``: on-demand single-node instances this node keeps (the least recently used leaves);
    ``spawn``: runs a background task the service owns (cancelled when it closes)."""

    def __init__(self, view: ClusterView, node: ClusterNode, max_loaded: int,
                 spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]]) -> None:
        self.view = view
        self.node = node
        self.max_loaded = max(1, max_loaded)
        self.placing: dict[str, asyncio.Task[Located]] = {}  # model id -> its on-demand placement
        self.last_used: dict[str, float] = {}  # instance id -> when a generation last went there
        self.groups = PipelineGroups(view, node, self, spawn)

    async def acquire(self, model_id: str, timeout: float) -> None:
        """Make sure an instance of ``model_id`` is ready, placing one if none is live, waiting at most
        ``timeout`` (ModelLoadTimeoutError after it: the load goes on)."""
        view = self.view
        deadline = time.monotonic() + max(timeout, 0.0)
        live = view.live(model_id)
        if live is not None and live.instance.state == pb.INSTANCE_STATE_READY:
            view.routes[model_id] = live
            return
        task = self.placing.get(model_id)
        if task is None:
            task = self.placement_task(model_id, live)
        try:
            located = await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise ModelLoadTimeoutError(
                f"{model_id} is still loading after {timeout:.0f} s; the load goes on: retry shortly"
            ) from None
        view.routes[model_id] = located

    def placement_task(self, model_id: str, live: Located | None, excluding: frozenset[str] = frozenset(),
                       sharding: str = "pipeline") -> asyncio.Task[Located]:
        task = asyncio.get_running_loop().create_task(self.place_and_wait(model_id, live, excluding, sharding))
        self.placing[model_id] = task
        task.add_done_callback(lambda t: self.placing.pop(model_id, None) if self.placing.get(model_id) is t else None)
        return task

    async def place_and_wait(self, model_id: str, live: Located | None,
                             excluding: frozenset[str] = frozenset(), sharding: str = "pipeline") -> Located:
        view = self.view
        attempts = 0
        while live is None:
            try:
                plan = self._split_plan(model_id, excluding, sharding)
            except pl.AlreadyPlacedError as e:
                # Another placement of the model is live: wait for that one. The instance it names may have
                # gone between the two looks (its node left, it was deleted): look again, then place anew.
                live = view.find(e.existing.instance_id)
                if live is None:
                    attempts += 1
                    if attempts >= PLACE_ATTEMPTS:
                        raise NodeUnavailableError(
                            f"{model_id}: instance {e.existing.instance_id} on node {e.existing.node_id[:8]} is "
                            f"listed as {e.existing.state} but cannot be found; retry shortly"
                        ) from None
                    await asyncio.sleep(POLL_READY_S)
                continue
            if not plan.pipelined:
                await self._evict_for(plan.node_id)
            live = await self.place(plan, on_demand=True)
            view.routes[model_id] = live
        return await self.wait_ready(live.node_id, live.instance.instance_id, timeout=None)

    async def _evict_for(self, node_id: str) -> None:
        """Keep at most ``max_loaded`` on-demand single-node instances on this node (least recently used leaves)."""
        if node_id != self.view.node_id:
            return
        on_demand = [i for i in self.node.supervisor.list() if i.on_demand and not pipes.is_pipelined(i)]
        on_demand.sort(key=lambda i: self.last_used.get(i.instance_id, i.created_unix))
        for inst in on_demand[: max(0, len(on_demand) - self.max_loaded + 1)]:
            log.info("unloading on-demand instance %s (%s) to make room", inst.instance_id, inst.model_id)
            await self.node.supervisor.stop(inst.instance_id)

    async def place(self, plan: pl.Placement, *, on_demand: bool) -> Located:
        """Start what ``plan`` says: one runner, or one per stage (then the group forms in the background).
        Returns the instance (a pipeline: its leader stage) at once, loading."""
        if not plan.pipelined:
            return await self.load_on(plan.node_id, plan.model_id, on_demand=on_demand,
                                      reserved=plan.requirement.needed_bytes, shard=plan.shards[0])
        instance_id = new_instance_id()
        stages = pipes.stage_placements(plan)
        loads = [
            self.load_on(shard.node_id, plan.model_id, on_demand=on_demand, reserved=needed, shard=shard,
                         instance_id=instance_id, stages=stages, sharding=plan.sharding, backend=plan.backend)
            for shard, needed in zip(plan.shards, plan.stage_needed_bytes, strict=True)
        ]
        results = await asyncio.gather(*loads, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.groups.stop_stages(instance_id, stages)
            raise failed[0]
        if plan.sharding == "tensor":
            log.info("tensor group %s of %s (%s): %s", instance_id, plan.model_id, plan.backend,
                     ", ".join(f"member {s.rank} on {s.node_id[:8]}" for s in plan.shards))
        else:
            log.info("pipeline %s of %s: %s", instance_id, plan.model_id,
                     ", ".join(f"layers {s.start_layer}-{s.end_layer - 1} on {s.node_id[:8]}" for s in plan.shards))
        self.groups.form_later(instance_id, plan.model_id, stages)
        leader = results[-1]
        assert isinstance(leader, Located)
        return leader

    async def load_on(
        self, node_id: str, model_id: str, *, on_demand: bool, reserved: int = 0,
        shard: pl.ShardAssignment | None = None, instance_id: str | None = None,
        stages: list[pb.StagePlacement] | None = None, sharding: str = "pipeline", backend: str = "",
    ) -> Located:
        """Start an instance of ``model_id`` (or a pipeline's stage of it) on a node; returns it at once (loading)."""
        view = self.view
        request = pb.LoadInstanceRequest(
            instance_id=instance_id or new_instance_id(), model=model_id, on_demand=on_demand,
            group_id=instance_id if stages else "", stages=stages or [], owner_node=view.node_id if stages else "",
        )
        if shard is not None:
            request.shard.CopyFrom(
                pb.Shard(start_layer=shard.start_layer, end_layer=shard.end_layer, rank=shard.rank, world_size=shard.world_size,
                         sharding=sharding if shard.world_size > 1 else "", backend=backend if shard.world_size > 1 else "")
            )
        view.reserved[(request.instance_id, node_id)] = reserved
        if node_id == view.node_id:
            instance = await self.node.load(request)
        else:
            peer = view.peer(node_id)
            try:
                instance = await peer.stub.LoadInstance(
                    request, timeout=CALL_TIMEOUT_S, metadata=self.node.registry.metadata("/exo.v1.Node/LoadInstance")
                )
            except grpc.aio.AioRpcError as e:
                raise rpc_error(e, f"node {peer.info.name} ({node_id[:8]})") from None
        view.routed_at[instance.instance_id] = time.monotonic()
        log.info("instance %s of %s on node %s: %s", instance.instance_id, model_id, node_id[:8], instance.stage)
        located = Located(node_id, instance)
        if stages:
            view.recent[(node_id, instance.instance_id)] = located
        return located

    async def instance_on(self, node_id: str, instance_id: str) -> pb.Instance:
        """An instance as its node sees it now."""
        if node_id == self.view.node_id:
            inst = self.node.supervisor.get(instance_id)
            if inst is None:
                raise InstanceNotFoundError(f"instance {instance_id} is gone")
            return inst
        peer = self.view.peer(node_id)
        try:
            return await peer.stub.GetInstance(
                pb.GetInstanceRequest(instance_id=instance_id),
                timeout=CALL_TIMEOUT_S,
                metadata=self.node.registry.metadata("/exo.v1.Node/GetInstance"),
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise InstanceNotFoundError(f"instance {instance_id} is gone") from None
            raise rpc_error(e, f"node {peer.info.name} ({node_id[:8]})") from None

    async def wait_ready(self, node_id: str, instance_id: str, timeout: float | None) -> Located:
        view = self.view
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            inst = await self.instance_on(node_id, instance_id)
            if pipes.is_pipelined(inst) and inst.state != pb.INSTANCE_STATE_FAILED:
                # A stage that failed (or whose node left) fails the whole pipeline.
                p = next((p for p in view.instances()[1] if p.instance_id == instance_id), None)
                if p is not None and pipes.pipeline_state(p, view.alive())[0] == pb.INSTANCE_STATE_FAILED:
                    why = pipes.pipeline_state(p, view.alive())[1]
                    view.drop_reservations(instance_id)
                    raise InstanceFailedError(inst, f"pipeline {instance_id} of {inst.model_id} failed: {why}")
            if inst.state == pb.INSTANCE_STATE_READY:
                view.drop_reservations(instance_id)
                view.routed_at[instance_id] = time.monotonic()
                located = Located(node_id, inst)
                view.routes[inst.model_id] = located  # fresher than that node's last answer to our polls
                return located
            if inst.state == pb.INSTANCE_STATE_FAILED:
                view.drop_reservations(instance_id)
                raise InstanceFailedError(inst, failure_text(inst))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"instance {instance_id} is still {STATE_NAMES.get(inst.state)} ({inst.stage})")
            await asyncio.sleep(POLL_READY_S)

    # -- POST/DELETE /v1/instances ---------------------------------------------------------------------------
    def plan(self, model_id: str, node: str | None = None, *, min_nodes: int = 1,
             nodes: list[str] | None = None, replica: bool = False, sharding: str = "pipeline") -> pl.Placement:
        view = self.view
        return pl.placement(view.requirement(model_id), view.capacities(), view.existing(), node=node,
                            min_nodes=min_nodes, nodes_in_order=nodes, links=view.links(), replica=replica,
                            sharding=sharding, tensor_backend=view.settings.tensor_backend)

    def plan_options(self, model_id: str, node: str | None = None, *, min_nodes: int = 1,
                     nodes: list[str] | None = None, replica: bool = False) -> list[pl.PlacementOption]:
        """Both splits of the model (pipeline, tensor) as placement would make them now, estimated (the preview)."""
        view = self.view
        existing = [e for e in view.existing() if replica or e.model_id != model_id or e.state not in pl.LIVE_STATES]
        return pl.placement_options(view.requirement(model_id), view.capacities(), existing, node=node,
                                    nodes_in_order=nodes, min_nodes=min_nodes, links=view.links(),
                                    tensor_backend=view.settings.tensor_backend)

    def _split_plan(self, model_id: str, excluding: frozenset[str], sharding: str) -> pl.Placement:
        """An on-demand placement: ``sharding`` (a broken tensor group's is "tensor"), else the default split
        when that one cannot be placed any more (too few nodes left for a tensor group)."""
        view = self.view
        place = functools.partial(pl.placement, view.requirement(model_id), view.capacities(), view.existing(excluding),
                                  links=view.links(), tensor_backend=view.settings.tensor_backend)
        if sharding == "pipeline":
            return place()
        try:
            return place(sharding=sharding)
        except (pl.NoPlacementError, pl.InvalidPlacementRequest) as e:
            log.info("%s: no %s placement now (%s); placing it by default", model_id, sharding, e)
            return place()

    async def create_instance(self, model_id: str, node: str | None = None, *, min_nodes: int = 1,
                              nodes: list[str] | None = None, replica: bool = False,
                              sharding: str = "pipeline") -> tuple[Located, pl.Placement]:
        plan = self.plan(model_id, node, min_nodes=min_nodes, nodes=nodes, replica=replica, sharding=sharding)
        located = await self.place(plan, on_demand=False)
        self.view.routes[model_id] = located
        return located, plan

    async def delete_instance(self, instance_id: str) -> bool:
        view = self.view
        if view.gone.pop(instance_id, None) is not None:
            return True
        single, pipelines = view.instances()
        pipeline = next((p for p in pipelines if p.instance_id == instance_id), None)
        located = next((loc for loc in single if loc.instance.instance_id == instance_id), None)
        if located is None and pipeline is None:
            raise InstanceNotFoundError(f"no instance {instance_id!r} in the cluster; list them with GET /v1/instances")
        view.forget(instance_id)
        if pipeline is not None:
            self.groups.broken[instance_id] = time.monotonic()  # deleted on purpose: not for the watcher to re-place
            await self.groups.stop_stages(instance_id, pipeline.planned, grace=5.0)
            for peer in view.peers():
                forget_on(peer, instance_id)
            return True
        assert located is not None
        if located.node_id == view.node_id:
            return await self.node.supervisor.stop(instance_id)
        peer = view.peer(located.node_id)
        try:
            reply = await peer.stub.UnloadInstance(
                pb.UnloadInstanceRequest(instance_id=instance_id),
                timeout=30.0,
                metadata=self.node.registry.metadata("/exo.v1.Node/UnloadInstance"),
            )
        except grpc.aio.AioRpcError as e:
            raise rpc_error(e, f"node {peer.info.name} ({located.node_id[:8]})") from None
        forget_on(peer, instance_id)
        return reply.unloaded


def forget_on(peer: Peer, instance_id: str) -> None:
    """Our copy of a peer's instances is refreshed at its next poll; drop an instance it stopped now."""
    for i in reversed([i for i, inst in enumerate(peer.info.instances) if inst.instance_id == instance_id]):
        del peer.info.instances[i]


def failure_text(inst: pb.Instance) -> str:
    f = inst.failure
    detail = f.message or (f.stderr_tail[-1] if f.stderr_tail else "")
    code = f" (exit code {f.exit_code})" if inst.pid else ""  # no pid: no runner ran (its download failed)
    return f"instance {inst.instance_id} of {inst.model_id} failed{code}: {detail}"
