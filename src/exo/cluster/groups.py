"""Pipelines' groups: forming one once every stage's runner has chosen its ring port (``JoinGroup`` with the
group's hosts), and tearing down and placing anew the ones that break.

A pipeline whose stage fails or whose node leaves is torn down on every node that still runs a stage of it
(a stage waiting for a dead neighbour would wait forever) and placed anew by the node that placed it (or the
surviving stage node with the smallest id), unless a stage failed because its weights could not be
downloaded (placing it again would fetch from the same hub: the next request does)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from exo.wire.proto_gen import node_pb2 as pb

from . import pipelines as pipes
from .calls import CALL_TIMEOUT_S, POLL_READY_S
from .cluster_view import GONE_KEPT_S, ClusterView
from .node import ClusterNode
from .views import pipeline_json

if TYPE_CHECKING:
    from .placing import Placer

log = logging.getLogger(__name__)

WATCH_S = 0.5  # how often this node checks the pipelines it knows of


class PipelineGroups:
    """``placer``: what asks a stage's state and places a broken pipeline's model anew; ``spawn``: runs a
    background task the service owns."""

    def __init__(self, view: ClusterView, node: ClusterNode, placer: Placer,
                 spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]]) -> None:
        self.view = view
        self.node = node
        self.placer = placer
        self.spawn = spawn
        self.broken: dict[str, float] = {}  # instance id -> when this node saw it broken (or deleted it)

    def form_later(self, instance_id: str, model_id: str, stages: list[pb.StagePlacement]) -> None:
        self.spawn(self._form(instance_id, model_id, stages), f"exo-form-group-{instance_id[:10]}")

    async def _form(self, instance_id: str, model_id: str, stages: list[pb.StagePlacement]) -> None:
        """Once every stage's runner has chosen its ring port, hand every stage the group's hosts. A stage
        that fails meanwhile ends the pipeline (the watcher places it anew)."""
        ports: dict[str, int] = {}
        while len(ports) < len(stages):
            for s in stages:
                if s.node_id in ports:
                    continue
                inst = await self.placer.instance_on(s.node_id, instance_id)
                if inst.state in (pb.INSTANCE_STATE_FAILED, pb.INSTANCE_STATE_STOPPING):
                    log.warning("pipeline %s: stage %d failed before its group formed: %s", instance_id, s.rank,
                                inst.failure.message)
                    return
                if inst.ring_port:
                    ports[s.node_id] = inst.ring_port
            if len(ports) < len(stages):
                await asyncio.sleep(POLL_READY_S)
        addresses = {s.node_id: self._ring_address(s.node_id, stages) for s in stages}
        hosts = pipes.hosts_of(stages, addresses, ports)
        log.info("pipeline %s of %s: group %s", instance_id, model_id, ",".join(hosts))
        await asyncio.gather(*(self._join(s.node_id, instance_id, hosts) for s in stages))

    async def _join(self, node_id: str, instance_id: str, hosts: list[str]) -> None:
        request = pb.JoinGroupRequest(instance_id=instance_id, hosts=hosts)
        if node_id == self.view.node_id:
            await self.node.supervisor.join_group(instance_id, hosts)
            return
        peer = self.view.peer(node_id)
        await peer.stub.JoinGroup(request, timeout=CALL_TIMEOUT_S,
                                  metadata=self.node.registry.metadata("/exo.v1.Node/JoinGroup"))

    def _ring_address(self, node_id: str, stages: list[pb.StagePlacement]) -> str:
        """The address the other stages reach ``node_id`` at: how this node reaches a peer; for this node,
        how its peers say they reach it (or the local address of the route to another stage)."""
        view = self.view
        if node_id != view.node_id:
            return view.peer(node_id).address[0]
        for peer in view.peers():
            for link in peer.info.links:
                if link.node_id == view.node_id and link.host:
                    return link.host
        other = next(s.node_id for s in stages if s.node_id != view.node_id)
        target = view.peer(other).address[0]
        family = socket.AF_INET6 if ":" in target else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))  # no packet is sent: this only picks the route's source address
            return str(probe.getsockname()[0])

    async def stop_stages(self, instance_id: str, stages: Sequence[pb.StagePlacement], grace: float = 0.0) -> None:
        """Stop every stage of a pipeline that is still somewhere (grace 0: kill; a stage blocked in a
        receive never runs a signal handler)."""

        async def stop(node_id: str) -> None:
            try:
                if node_id == self.view.node_id:
                    await self.node.supervisor.stop(instance_id, grace=grace)
                elif (peer := self.node.registry.get(node_id)) is not None:
                    await peer.stub.UnloadInstance(
                        pb.UnloadInstanceRequest(instance_id=instance_id), timeout=30.0,
                        metadata=self.node.registry.metadata("/exo.v1.Node/UnloadInstance"),
                    )
            except (grpc.aio.AioRpcError, OSError) as e:
                log.info("pipeline %s: stopping the stage on %s: %s", instance_id, node_id[:8], e)

        await asyncio.gather(*(stop(n) for n in {s.node_id for s in stages}))

    async def watch(self) -> None:
        """Every ``WATCH_S``: tear down the stages this node runs of broken pipelines (a stage failed or its
        node left: the others would wait in a receive forever), and place anew the broken pipelines this
        node is responsible for, once every node of theirs has answered since (or left)."""
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the watcher must outlive any one failure
                log.exception("checking pipelines failed")

    async def check(self) -> None:
        view = self.view
        _, pipelines = view.instances()
        alive = view.alive()
        now = time.monotonic()
        for p in pipelines:
            state, why = pipes.pipeline_state(p, view.alive())
            if state != pb.INSTANCE_STATE_FAILED or p.instance_id in self.broken:
                continue
            self.broken[p.instance_id] = now
            log.warning("pipeline %s of %s is broken: %s", p.instance_id, p.model_id, why)
            # A download that failed would fail again: such a pipeline stays listed (failed) until deleted.
            replace = not pipes.download_failed(p)
            if replace:
                self._remember_gone(p, why)
            else:
                view.forget(p.instance_id)
            # Ours stays listed (failed) until the responsible node removes it: everyone sees the break.
            self.node.supervisor.kill(p.instance_id, f"its pipeline broke: {why}")
            if replace and pipes.responsible_node(p, alive) == view.node_id:
                self.spawn(self._replace(p, now), f"exo-replace-{p.instance_id[:10]}")
        self.broken = {k: v for k, v in self.broken.items() if now - v < GONE_KEPT_S}

    async def _replace(self, p: pipes.Pipeline, broken_at: float) -> None:
        """Place a broken pipeline's model anew on the nodes that are still there."""
        await self.stop_stages(p.instance_id, p.planned)
        # A node that neither answered since the failure nor left yet may be the dead one: wait it out.
        settle_until = broken_at + self.node.registry.expire_s + 1.0
        while time.monotonic() < settle_until:
            pending = [n for n in p.nodes() if n != self.view.node_id and (peer := self.node.registry.get(n)) is not None
                       and peer.last_seen < broken_at]
            if not pending:
                break
            await asyncio.sleep(POLL_READY_S)
        if self.view.live(p.model_id) is not None or p.model_id in self.placer.placing:
            return  # placed again already (by a request)
        log.info("placing %s anew after its pipeline %s broke", p.model_id, p.instance_id)
        task = self.placer.placement_task(p.model_id, None, excluding=frozenset({p.instance_id}), sharding=p.sharding)
        try:
            await task
        except Exception as e:  # noqa: BLE001 - requests get the reason when they place it themselves
            log.warning("%s could not be placed anew: %s", p.model_id, e)

    def _remember_gone(self, p: pipes.Pipeline, why: str) -> None:
        view = pipeline_json(list(p.planned), list(p.found), "failed", why, self.view.node_id)
        view["state"] = "gone"
        view["gone_reason"] = why
        self.view.gone[p.instance_id] = (time.time(), view)
        self.view.forget(p.instance_id)
