"""``ClusterModelService``: the ``ModelService`` of an exo node in a cluster (what ``exo serve`` runs).

Every model runs as an instance: a runner subprocess on some node of the cluster. A request names a
model; if an instance of it exists anywhere in the cluster (ready, or loading), the request goes there;
otherwise the model is placed (``exo.cluster.placement``) and loaded on demand, and the request waits,
bounded by the load timeout. Generation on another node goes through that node's ``Generate`` stream
(gRPC), generation on this node straight to the local runner; either way the handler gets the engine's
chunks and stats exactly as the owning node produced them. Instances of a peer that dies are reported
``gone`` (and a stream from it ends with an error, never a hang).

A model that no node can hold is pipelined (``placement``): one runner per stage on its node, started
through each node's ``LoadInstance``; once every stage's runner has chosen its ring port, the placing
node hands them all the group's hosts (``JoinGroup``) and they join one ``mx.distributed`` ring. The
last stage leads: requests go to it. A pipeline whose stage fails or whose node leaves is torn down on
every node that still runs a stage of it (a stage waiting for a dead neighbour would wait forever) and
placed anew by the node that placed it (or the surviving stage node with the smallest id), unless a
stage failed because its weights could not be downloaded (placing it again would fetch from the same hub:
the next request does).

Weights on no node's disk are downloaded by the nodes placement picks (``fetching``): each stage's node
fetches its stage's files; the instance is ``downloading`` meanwhile, then loads as usual.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from mlx_lm.utils import load_tokenizer

from exo import __version__
from exo.cards import Catalog, ModelCard, UnknownModelError, load_catalog
from exo.downloads import DownloadManager
from exo.downloads.fetch import DEFAULT_RESERVE_BYTES
from exo.engine import (
    ModelNotAvailableError,
    ResolvedModel,
)
from exo.engine.prefix_cache import key_hash, message_starts
from exo.engine.prompt import prompt_tokens, tokenize
from exo.engine.resolve import DEFAULT_MODEL
from exo.metrics import Metrics
from exo.settings import Settings
from exo.wire.convert import chunk_from_pb, error_from_pb, generate_request, request_from_pb
from exo.wire.proto_gen import node_pb2 as pb

from . import pipelines as pipes
from . import placement as pl
from . import routing
from .listing import card_info, model_rows
from .models import LocalModels
from .node import ClusterNode, MTPSwitch, new_instance_id
from .registry import Peer
from .service import (
    DEADLINE_GRACE_S,
    BatchedStream,
    ClusterAuthError,
    Failed,
    GenerateParams,
    InstanceNotFoundError,
    ModelInfo,
    ModelLoadTimeoutError,
    NativeMTPInfo,
    NodeUnavailableError,
    Prompt,
    RequestTimeoutError,
    Started,
)
from .supervisor import InstanceFailedError, UnknownInstanceError
from .views import STATE_NAMES, Located, download_json, instance_json, node_json, pipeline_json

log = logging.getLogger(__name__)
T = TypeVar("T")

CALL_TIMEOUT_S = 5.0
POLL_READY_S = 0.2
# A generation stream that delivers nothing (runners send a heartbeat every 2 s) for this long means
# the node or its runner stopped answering.
STREAM_IDLE_S = 10.0
GONE_KEPT_S = 600.0
WATCH_S = 0.5  # how often this node checks the pipelines it knows of
PLACE_ATTEMPTS = 3  # looks for a placed instance that placement reports but the cluster view lacks
TOKENIZERS_KEPT = 4  # count_tokens' tokenizers kept in the API process (a few MB each), most recent first


class ClusterModelService:
    def __init__(
        self,
        settings: Settings,
        *,
        metrics: Metrics | None = None,
        catalog: Catalog | None = None,
        max_loaded: int = 1,
        default_model: str | None = None,
        name: str | None = None,
        max_restarts: int = 2,
    ) -> None:
        self.settings = settings
        self.catalog = catalog if catalog is not None else load_catalog(home=settings.home)
        self.metrics = metrics or Metrics()
        self.max_loaded = max(1, max_loaded)
        self.default_model = default_model or DEFAULT_MODEL
        self.models = LocalModels(self.catalog)
        self._mtp: tuple[bool, str] = (settings.native_mtp_enabled, "native MTP is disabled")
        # The node's downloads: /v1/downloads' and those of instances whose weights are missing (shared).
        self.downloads = DownloadManager.from_settings(settings)
        self.node = ClusterNode(
            settings,
            self.models,
            version=__version__,
            mtp_switch=lambda: MTPSwitch(*self._mtp),
            name=name,
            on_peer_lost=self._peer_lost,
            max_restarts=max_restarts,
            downloads=self.downloads,
        )
        self._gone: dict[str, tuple[float, dict[str, Any]]] = {}  # instance id -> (when, its last view)
        self._placing: dict[str, asyncio.Task[Located]] = {}  # model id -> its on-demand placement
        self._routes: dict[str, Located] = {}  # model id -> the instance acquire() found for it
        # (node id, instance id) -> a stage this node just started on a peer (listed until the peer lists it)
        self._recent: dict[tuple[str, str], Located] = {}
        self._routed_at: dict[str, float] = {}  # instance id -> when it was routed to
        self._reserved: dict[tuple[str, str], int] = {}  # (instance id, node id) -> bytes it will take loaded
        self._last_used: dict[str, float] = {}
        self._started = time.monotonic()
        self._streams: set[RemoteGenerationStream] = set()
        # Pipelines this node placed or found broken: instance id -> (model id, when it broke or None)
        self._broken: dict[str, float] = {}  # instance id -> when this node saw it broken
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the one whose thread owns the cluster's view
        # count_tokens' tokenizers: (model id, its directory) -> the tokenizer, loaded in this process
        self._tokenizers: OrderedDict[tuple[str, str], tuple[Any, threading.Lock]] = OrderedDict()
        self._tokenizers_lock = threading.Lock()
        self._recent_routes = routing.Recent()  # what this node's router sent where lately
        self._message_starts: dict[str, frozenset[int]] = {}  # model id -> its chat templates' message starts

    # -- lifecycle (the app's startup and cleanup hooks) ------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.node.start()
        self._watcher = asyncio.create_task(self._watch_pipelines(), name="exo-pipeline-watch")

    async def aclose(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        for stream in list(self._streams):
            stream.cancel()
        for task in [*self._placing.values(), *self._tasks]:
            task.cancel()
        await self.node.close()

    def close(self) -> None:
        """The ModelService hook (from a thread): the node closes on the loop through ``aclose``."""

    def register(self, resolved: ResolvedModel) -> str:
        """Serve a directory under its id on this node (``exo serve --model DIR``)."""
        return self.models.register(resolved)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s failed: %s", task.get_name(), task.exception())

    # -- the cluster as this node sees it -----------------------------------------------------------------------
    @property
    def node_id(self) -> str:
        return self.node.node_id

    def peers(self) -> list[Peer]:
        return self.node.registry.peers()

    def alive(self) -> set[str]:
        return {self.node_id, *(p.node_id for p in self.peers())}

    def located(self) -> list[Located]:
        """Every instance (and pipeline stage) in the cluster: ours (current), our peers' (as of their last
        answer), and the ones this node started or found on a peer that its last answer does not show yet."""
        out = [Located(self.node_id, inst) for inst in self.node.supervisor.list()]
        for peer in self.peers():
            out.extend(Located(peer.node_id, inst) for inst in peer.info.instances)
        index = {(loc.node_id, loc.instance.instance_id): i for i, loc in enumerate(out)}
        for key, route in [*self._routes.items(), *self._recent.items()]:
            if route.node_id == self.node_id:
                continue
            i = index.get((route.node_id, route.instance.instance_id))
            if i is not None:
                if route.instance.updated_unix > out[i].instance.updated_unix:
                    out[i] = route  # we asked that node since its last answer
                else:
                    self._recent.pop(key, None)  # type: ignore[call-overload]  # its node lists it now
                continue
            peer = self.node.registry.get(route.node_id)
            if peer is None or peer.last_seen > self._routed_at.get(route.instance.instance_id, 0.0) + 1.0:
                self._routes.pop(key, None)  # type: ignore[call-overload]  # that node answered since, without it
                self._recent.pop(key, None)  # type: ignore[call-overload]
                continue
            index[(route.node_id, route.instance.instance_id)] = len(out)
            out.append(route)
        return out

    def instances(self) -> tuple[list[Located], list[pipes.Pipeline]]:
        """Single-node instances and pipelines, as this node sees them."""
        return pipes.group_stages(self.located())

    def _find(self, instance_id: str) -> Located | None:
        """A single-node instance, or a pipeline's leader stage (with the pipeline's state)."""
        single, pipelines = self.instances()
        for loc in single:
            if loc.instance.instance_id == instance_id:
                return loc
        for p in pipelines:
            if p.instance_id == instance_id:
                return self._pipeline_located(p)
        return None

    def _pipeline_located(self, p: pipes.Pipeline) -> Located:
        """A pipeline as one instance: its leader's stage, carrying the whole pipeline's state."""
        state, _ = pipes.pipeline_state(p, self.alive())
        leader = p.leader or next(loc for loc in p.found if loc is not None)  # group_stages found one
        inst = pb.Instance()
        inst.CopyFrom(leader.instance)
        inst.state = state  # type: ignore[assignment]
        return Located(p.planned[-1].node_id, inst)

    def _live(self, model_id: str) -> Located | None:
        """An instance of the model that is ready (preferred; ours first) or loading; for a pipeline, its
        leader (which serves generations), ready when the whole pipeline is."""
        single, pipelines = self.instances()
        candidates = [loc for loc in single if loc.instance.model_id == model_id]
        candidates += [self._pipeline_located(p) for p in pipelines if p.model_id == model_id]
        candidates = [c for c in candidates if c.instance.state in (pb.INSTANCE_STATE_READY, pb.INSTANCE_STATE_LOADING)]
        candidates.sort(key=lambda c: (c.instance.state != pb.INSTANCE_STATE_READY, c.node_id != self.node_id))
        return candidates[0] if candidates else None

    def capacities(self) -> list[pl.NodeCapacity]:
        own = self.node.info()
        infos = [own] + [p.info for p in self.peers()]
        return [
            pl.NodeCapacity(
                node_id=info.node_id,
                memory_available_bytes=info.memory_available_bytes,
                memory_total_bytes=info.memory_total_bytes,
                name=info.name,
                models=frozenset(m.model_id for m in info.models),
                can_download=not info.offline,
                download_room_bytes=max(0, info.hub_cache_free_bytes - DEFAULT_RESERVE_BYTES),
                backend=info.backend,
                decode_bytes_per_s=info.decode_bytes_per_s,
            )
            for info in infos
        ]

    def links(self) -> dict[tuple[str, str], float]:
        """Round-trip times between nodes (ms): ours to our peers, and each peer's to its peers."""
        out = {(self.node_id, p.node_id): p.rtt_ms for p in self.peers()}
        for peer in self.peers():
            out.update({(peer.node_id, link.node_id): link.rtt_ms for link in peer.info.links})
        return out

    def existing(self, excluding: frozenset[str] = frozenset()) -> list[pl.ExistingInstance]:
        return [
            pl.ExistingInstance(
                loc.instance.instance_id,
                loc.instance.model_id,
                loc.node_id,
                STATE_NAMES.get(loc.instance.state, "failed"),
                self._reserved.get((loc.instance.instance_id, loc.node_id), 0),
            )
            for loc in self.located()
            if loc.instance.instance_id not in excluding
        ]

    def requirement(self, model_id: str) -> pl.ModelRequirement:
        """What the model needs, from its card and its checkpoint on a node's disk (size, and per layer)."""
        sizes = [m for info in [self.node.info()] + [p.info for p in self.peers()] for m in info.models
                 if m.model_id == model_id]
        card = self._card(model_id)
        if card is None and not sizes:
            raise UnknownModelError(model_id, self.catalog.suggest(model_id))
        return model_requirement(model_id, card, sizes)

    def _card(self, model_id: str) -> ModelCard | None:
        try:
            return self.catalog.get(model_id)
        except (UnknownModelError, LookupError):
            return None

    def model_id(self, ref: str) -> str:
        """A request's model reference -> a model id known somewhere in the cluster (may read the disk: callers
        run it in a worker thread). The cluster's view (``located()``, which also prunes ``_routes`` and
        ``_recent``, and the peers' answers) belongs to the event loop: that part runs there."""
        try:
            return self.models.resolve(ref).model_id
        except ModelNotAvailableError:
            card = self._card(ref)
            if card is not None:
                return card.id
            raise
        except UnknownModelError:
            found = self._on_loop(self._known_in_cluster, ref)
            if found is None:
                raise
            return found

    def _known_in_cluster(self, ref: str) -> str | None:
        for loc in self.located():
            if ref in (loc.instance.model_id, loc.instance.model_ref):
                return loc.instance.model_id
        for peer in self.peers():
            if any(m.model_id == ref for m in peer.info.models):
                return ref
        return None

    def _on_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the event loop's thread (at once when called there, or before the loop is known)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return fn(*args)
        try:
            if asyncio.get_running_loop() is loop:
                return fn(*args)
        except RuntimeError:  # a worker thread: no running loop
            pass
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                done.set_exception(e)

        loop.call_soon_threadsafe(run)
        return done.result()

    # -- ModelService ------------------------------------------------------------------------------------------
    def list_models(self) -> list[ModelInfo]:
        loaded: list[ModelInfo] = []
        seen: set[str] = set()
        single, pipelines = self.instances()
        ready = [loc.instance for loc in single if loc.instance.state == pb.INSTANCE_STATE_READY]
        ready += [p.leader.instance for p in pipelines
                  if p.leader is not None and pipes.pipeline_state(p, self.alive())[0] == pb.INSTANCE_STATE_READY]
        for inst in ready:
            if inst.model_id not in seen:
                seen.add(inst.model_id)
                loaded.append(self._loaded_info(inst))
        own = {m.model_id for m in self.node.local_models()}
        elsewhere: dict[str, ModelCard | None] = {}
        for peer in self.peers():
            for m in peer.info.models:
                if m.model_id not in own:
                    elsewhere[m.model_id] = self._card(m.model_id)
        return model_rows(self.catalog, loaded, self.models.registered(), self._mtp, elsewhere=elsewhere)

    def _loaded_info(self, inst: pb.Instance) -> ModelInfo:
        s = inst.model
        enabled, disabled_reason = self._mtp
        reason = disabled_reason if not enabled else (None if s.mtp_available else s.mtp_reason or "no MTP head")
        card = self._card(inst.model_id)
        base = card_info(card, self.catalog, "loaded", None) if card is not None else None
        return ModelInfo(
            id=inst.model_id,
            status="loaded",
            owned_by=s.owned_by or (base.owned_by if base else "local"),
            created=base.created if base else int(inst.created_unix),
            native_mtp=NativeMTPInfo(s.default_k or None, s.max_k or None, reason is None, reason),
            name=s.name or inst.model_id,
            arch=s.arch or None,
            context_length=s.context_length or None,
        )

    async def acquire(self, model: str | None, timeout: float) -> str:
        self._loop = asyncio.get_running_loop()
        ref = self.default_model if model is None else model
        model_id = await asyncio.to_thread(self.model_id, ref)
        deadline = time.monotonic() + max(timeout, 0.0)
        live = self._live(model_id)
        if live is not None and live.instance.state == pb.INSTANCE_STATE_READY:
            self._routes[model_id] = live
            return model_id
        task = self._placing.get(model_id)
        if task is None:
            task = self._placement_task(model_id, live)
        try:
            located = await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise ModelLoadTimeoutError(
                f"{model_id} is still loading after {timeout:.0f} s; the load goes on: retry shortly"
            ) from None
        self._routes[model_id] = located
        return model_id

    def _placement_task(self, model_id: str, live: Located | None, excluding: frozenset[str] = frozenset(),
                        sharding: str = "pipeline") -> asyncio.Task[Located]:
        task = asyncio.get_running_loop().create_task(self._place_and_wait(model_id, live, excluding, sharding))
        self._placing[model_id] = task
        task.add_done_callback(lambda t: self._placing.pop(model_id, None) if self._placing.get(model_id) is t else None)
        return task

    async def _place_and_wait(self, model_id: str, live: Located | None,
                              excluding: frozenset[str] = frozenset(), sharding: str = "pipeline") -> Located:
        attempts = 0
        while live is None:
            try:
                plan = self._split_plan(model_id, excluding, sharding)
            except pl.AlreadyPlacedError as e:
                # Another placement of the model is live: wait for that one. The instance it names may have
                # gone between the two looks (its node left, it was deleted): look again, then place anew.
                live = self._find(e.existing.instance_id)
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
            self._routes[model_id] = live
        return await self.wait_ready(live.node_id, live.instance.instance_id, timeout=None)

    async def _evict_for(self, node_id: str) -> None:
        """Keep at most ``max_loaded`` on-demand single-node instances on this node (least recently used leaves)."""
        if node_id != self.node_id:
            return
        on_demand = [i for i in self.node.supervisor.list() if i.on_demand and not pipes.is_pipelined(i)]
        on_demand.sort(key=lambda i: self._last_used.get(i.instance_id, i.created_unix))
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
            await self._stop_stages(instance_id, stages)
            raise failed[0]
        if plan.sharding == "tensor":
            log.info("tensor group %s of %s (%s): %s", instance_id, plan.model_id, plan.backend,
                     ", ".join(f"member {s.rank} on {s.node_id[:8]}" for s in plan.shards))
        else:
            log.info("pipeline %s of %s: %s", instance_id, plan.model_id,
                     ", ".join(f"layers {s.start_layer}-{s.end_layer - 1} on {s.node_id[:8]}" for s in plan.shards))
        self._spawn(self._form_group(instance_id, plan.model_id, stages), f"exo-form-group-{instance_id[:10]}")
        leader = results[-1]
        assert isinstance(leader, Located)
        return leader

    async def load_on(
        self, node_id: str, model_id: str, *, on_demand: bool, reserved: int = 0,
        shard: pl.ShardAssignment | None = None, instance_id: str | None = None,
        stages: list[pb.StagePlacement] | None = None, sharding: str = "pipeline", backend: str = "",
    ) -> Located:
        """Start an instance of ``model_id`` (or a pipeline's stage of it) on a node; returns it at once (loading)."""
        request = pb.LoadInstanceRequest(
            instance_id=instance_id or new_instance_id(), model=model_id, on_demand=on_demand,
            group_id=instance_id if stages else "", stages=stages or [], owner_node=self.node_id if stages else "",
        )
        if shard is not None:
            request.shard.CopyFrom(
                pb.Shard(start_layer=shard.start_layer, end_layer=shard.end_layer, rank=shard.rank, world_size=shard.world_size,
                         sharding=sharding if shard.world_size > 1 else "", backend=backend if sharding == "tensor" else "")
            )
        self._reserved[(request.instance_id, node_id)] = reserved
        if node_id == self.node_id:
            instance = await self.node.load(request)
        else:
            peer = self._peer(node_id)
            try:
                instance = await peer.stub.LoadInstance(
                    request, timeout=CALL_TIMEOUT_S, metadata=self.node.registry.metadata("/exo.v1.Node/LoadInstance")
                )
            except grpc.aio.AioRpcError as e:
                raise _rpc_error(e, f"node {peer.info.name} ({node_id[:8]})") from None
        self._routed_at[instance.instance_id] = time.monotonic()
        log.info("instance %s of %s on node %s: %s", instance.instance_id, model_id, node_id[:8], instance.stage)
        located = Located(node_id, instance)
        if stages:
            self._recent[(node_id, instance.instance_id)] = located
        return located

    # -- pipelines: forming the group, waiting for it, tearing it down -----------------------------------------
    async def _form_group(self, instance_id: str, model_id: str, stages: list[pb.StagePlacement]) -> None:
        """Once every stage's runner has chosen its ring port, hand every stage the group's hosts. A stage
        that fails meanwhile ends the pipeline (the watcher places it anew)."""
        ports: dict[str, int] = {}
        while len(ports) < len(stages):
            for s in stages:
                if s.node_id in ports:
                    continue
                inst = await self.instance_on(s.node_id, instance_id)
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
        if node_id == self.node_id:
            await self.node.supervisor.join_group(instance_id, hosts)
            return
        peer = self._peer(node_id)
        await peer.stub.JoinGroup(request, timeout=CALL_TIMEOUT_S,
                                  metadata=self.node.registry.metadata("/exo.v1.Node/JoinGroup"))

    def _ring_address(self, node_id: str, stages: list[pb.StagePlacement]) -> str:
        """The address the other stages reach ``node_id`` at: how this node reaches a peer; for this node,
        how its peers say they reach it (or the local address of the route to another stage)."""
        if node_id != self.node_id:
            return self._peer(node_id).address[0]
        for peer in self.peers():
            for link in peer.info.links:
                if link.node_id == self.node_id and link.host:
                    return link.host
        other = next(s.node_id for s in stages if s.node_id != self.node_id)
        target = self._peer(other).address[0]
        family = socket.AF_INET6 if ":" in target else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))  # no packet is sent: this only picks the route's source address
            return str(probe.getsockname()[0])

    async def _stop_stages(self, instance_id: str, stages: Sequence[pb.StagePlacement], grace: float = 0.0) -> None:
        """Stop every stage of a pipeline that is still somewhere (grace 0: kill; a stage blocked in a
        receive never runs a signal handler)."""

        async def stop(node_id: str) -> None:
            try:
                if node_id == self.node_id:
                    await self.node.supervisor.stop(instance_id, grace=grace)
                elif (peer := self.node.registry.get(node_id)) is not None:
                    await peer.stub.UnloadInstance(
                        pb.UnloadInstanceRequest(instance_id=instance_id), timeout=30.0,
                        metadata=self.node.registry.metadata("/exo.v1.Node/UnloadInstance"),
                    )
            except (grpc.aio.AioRpcError, OSError) as e:
                log.info("pipeline %s: stopping the stage on %s: %s", instance_id, node_id[:8], e)

        await asyncio.gather(*(stop(n) for n in {s.node_id for s in stages}))

    async def wait_ready(self, node_id: str, instance_id: str, timeout: float | None) -> Located:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            inst = await self.instance_on(node_id, instance_id)
            if pipes.is_pipelined(inst) and inst.state != pb.INSTANCE_STATE_FAILED:
                # A stage that failed (or whose node left) fails the whole pipeline.
                p = next((p for p in self.instances()[1] if p.instance_id == instance_id), None)
                if p is not None and pipes.pipeline_state(p, self.alive())[0] == pb.INSTANCE_STATE_FAILED:
                    why = pipes.pipeline_state(p, self.alive())[1]
                    self._drop_reservations(instance_id)
                    raise InstanceFailedError(inst, f"pipeline {instance_id} of {inst.model_id} failed: {why}")
            if inst.state == pb.INSTANCE_STATE_READY:
                self._drop_reservations(instance_id)
                self._routed_at[instance_id] = time.monotonic()
                located = Located(node_id, inst)
                self._routes[inst.model_id] = located  # fresher than that node's last answer to our polls
                return located
            if inst.state == pb.INSTANCE_STATE_FAILED:
                self._drop_reservations(instance_id)
                raise InstanceFailedError(inst, _failure_text(inst))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"instance {instance_id} is still {STATE_NAMES.get(inst.state)} ({inst.stage})")
            await asyncio.sleep(POLL_READY_S)

    def _drop_reservations(self, instance_id: str) -> None:
        for key in [k for k in self._reserved if k[0] == instance_id]:
            del self._reserved[key]

    async def _watch_pipelines(self) -> None:
        """Every ``WATCH_S``: tear down the stages this node runs of broken pipelines (a stage failed or its
        node left: the others would wait in a receive forever), and place anew the broken pipelines this
        node is responsible for, once every node of theirs has answered since (or left)."""
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                await self._check_pipelines()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the watcher must outlive any one failure
                log.exception("checking pipelines failed")

    async def _check_pipelines(self) -> None:
        _, pipelines = self.instances()
        alive = self.alive()
        now = time.monotonic()
        for p in pipelines:
            state, why = pipes.pipeline_state(p, self.alive())
            if state != pb.INSTANCE_STATE_FAILED or p.instance_id in self._broken:
                continue
            self._broken[p.instance_id] = now
            log.warning("pipeline %s of %s is broken: %s", p.instance_id, p.model_id, why)
            # A download that failed would fail again: such a pipeline stays listed (failed) until deleted.
            replace = not pipes.download_failed(p)
            if replace:
                self._remember_gone(p, why)
            else:
                self._routes = {m: r for m, r in self._routes.items() if r.instance.instance_id != p.instance_id}
            # Ours stays listed (failed) until the responsible node removes it: everyone sees the break.
            self.node.supervisor.kill(p.instance_id, f"its pipeline broke: {why}")
            if replace and pipes.responsible_node(p, alive) == self.node_id:
                self._spawn(self._replace(p, now), f"exo-replace-{p.instance_id[:10]}")
        self._broken = {k: v for k, v in self._broken.items() if now - v < GONE_KEPT_S}

    async def _replace(self, p: pipes.Pipeline, broken_at: float) -> None:
        """Place a broken pipeline's model anew on the nodes that are still there."""
        await self._stop_stages(p.instance_id, p.planned)
        # A node that neither answered since the failure nor left yet may be the dead one: wait it out.
        settle_until = broken_at + self.node.registry.expire_s + 1.0
        while time.monotonic() < settle_until:
            pending = [n for n in p.nodes() if n != self.node_id and (peer := self.node.registry.get(n)) is not None
                       and peer.last_seen < broken_at]
            if not pending:
                break
            await asyncio.sleep(POLL_READY_S)
        if self._live(p.model_id) is not None or p.model_id in self._placing:
            return  # placed again already (by a request)
        log.info("placing %s anew after its pipeline %s broke", p.model_id, p.instance_id)
        task = self._placement_task(p.model_id, None, excluding=frozenset({p.instance_id}), sharding=p.sharding)
        try:
            await task
        except Exception as e:  # noqa: BLE001 - requests get the reason when they place it themselves
            log.warning("%s could not be placed anew: %s", p.model_id, e)

    def _remember_gone(self, p: pipes.Pipeline, why: str) -> None:
        state, _ = pipes.pipeline_state(p, self.alive())
        view = pipeline_json(list(p.planned), list(p.found), "failed", why, self.node_id)
        view["state"] = "gone"
        view["gone_reason"] = why
        self._gone[p.instance_id] = (time.time(), view)
        self._routes = {m: r for m, r in self._routes.items() if r.instance.instance_id != p.instance_id}

    # -- routing a generation ------------------------------------------------------------------------------------
    async def instance_on(self, node_id: str, instance_id: str) -> pb.Instance:
        if node_id == self.node_id:
            inst = self.node.supervisor.get(instance_id)
            if inst is None:
                raise InstanceNotFoundError(f"instance {instance_id} is gone")
            return inst
        peer = self._peer(node_id)
        try:
            return await peer.stub.GetInstance(
                pb.GetInstanceRequest(instance_id=instance_id),
                timeout=CALL_TIMEOUT_S,
                metadata=self.node.registry.metadata("/exo.v1.Node/GetInstance"),
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise InstanceNotFoundError(f"instance {instance_id} is gone") from None
            raise _rpc_error(e, f"node {peer.info.name} ({node_id[:8]})") from None

    def _peer(self, node_id: str) -> Peer:
        peer = self.node.registry.get(node_id)
        if peer is None:
            raise NodeUnavailableError(f"node {node_id} is not in the cluster (any more)")
        return peer

    async def count_prompt_tokens_here(self, model: str | None, prompt: Prompt) -> int | None:
        """The prompt's tokens as a generation reads them (the chat template and tokenizer that the runner
        loads, through the same ``tokenize``), counted in this process when the model's files are on this
        node: no device, no runner, no queue. None when they are not here (the caller asks the owner)."""
        here = await asyncio.to_thread(self._tokenizer_here, self.default_model if model is None else model)
        if here is None:
            return None
        tokenizer, lock = here

        def count() -> int:
            with lock:  # a fast tokenizer is not safe to use from two threads at once
                return len(tokenize(
                    tokenizer, messages=prompt.messages, text=prompt.text, token_ids=prompt.token_ids,
                    template_kwargs=prompt.template_kwargs, tools=prompt.tools,
                ))

        return await asyncio.to_thread(count)

    def _tokenizer_here(self, ref: str) -> tuple[Any, threading.Lock] | None:
        """The model's tokenizer from this node's disk (cached, bounded) with the lock its users take, or None
        if its files are elsewhere (or unknown here: the generation path then answers as for any request)."""
        try:
            resolved = self.models.resolve(ref)
        except (ModelNotAvailableError, UnknownModelError):
            return None
        key = (resolved.model_id, str(resolved.path))
        with self._tokenizers_lock:  # one load at a time: a burst of counts loads a model's tokenizer once
            kept = self._tokenizers.get(key)
            if kept is not None:
                self._tokenizers.move_to_end(key)
                return kept
            try:
                tokenizer = load_tokenizer(resolved.path)  # as the runner's loader does (engine/loader.py)
            except Exception as e:  # noqa: BLE001 - files incomplete or unreadable here: the owner counts
                log.warning("count_tokens: %s's tokenizer did not load here (%s); asking its runner", ref, e)
                return None
            kept = self._tokenizers[key] = (tokenizer, threading.Lock())
            while len(self._tokenizers) > TOKENIZERS_KEPT:
                self._tokenizers.popitem(last=False)
            return kept

    def _candidates(self, model_id: str) -> list[routing.Candidate]:
        """The model's ready instances (pipelines: their leaders), with their load as last reported or as this
        node's own streams to them say, whichever is more."""
        single, pipelines = self.instances()
        ready = [loc for loc in single if loc.instance.model_id == model_id]
        ready += [self._pipeline_located(p) for p in pipelines if p.model_id == model_id]
        ready = [loc for loc in ready if loc.instance.state == pb.INSTANCE_STATE_READY]
        streams: dict[str, int] = {}
        for stream in self._streams:
            streams[stream.instance_id] = streams.get(stream.instance_id, 0) + 1
        return [routing.Candidate(loc, max(loc.instance.queue_depth + loc.instance.running,
                                           streams.get(loc.instance.instance_id, 0)), loc.node_id == self.node_id)
                for loc in ready]

    def _route(self, model_id: str, candidates: list[routing.Candidate], request: pb.GenerateRequest) -> Located:
        """Several ready instances: the one holding the prompt's longest cached prefix (``routing``). Runs in a
        worker thread (it tokenizes the prompt)."""
        tokens = None
        starts: frozenset[int] = frozenset()
        here = self._tokenizer_here(model_id)
        if here is not None:
            tokenizer, lock = here
            prompt, params = request_from_pb(request)  # as the runner reads it
            try:
                with lock:
                    tokens = prompt_tokens(tokenizer, prompt, params)
                    starts = self._message_starts.get(model_id) or self._message_starts.setdefault(
                        model_id, message_starts(tokenizer))
            except Exception:  # noqa: BLE001 - a prompt the owner will refuse: any instance answers that
                tokens = None
        key = request.prompt_cache_key or None
        choice = routing.choose(candidates, tokens, key, self._recent_routes)
        # Until its summary says so (~2.5 s), read what the chosen instance will store as held.
        reported = routing.summary_from_pb(choice.located.instance.prefix_summary)
        heads = routing.stored_heads(tokens, reported, starts, self.settings.prefix_cache_stride_tokens) if tokens else []
        self._recent_routes.add(choice.located.instance.instance_id, heads, key_hash(key) if key else None)
        log.debug("routed to %s on %s: %d cached tokens%s", choice.located.instance.instance_id,
                  choice.located.node_id[:8], choice.held_tokens, " (prompt_cache_key)" if choice.by_key else "")
        return choice.located

    def generate(
        self, model_id: str, prompt: Prompt, params: GenerateParams, *, timeout_s: float, arrived: float
    ) -> RemoteGenerationStream:
        candidates = self._candidates(model_id)
        if not candidates:
            raise NodeUnavailableError(f"no ready instance of {model_id} in the cluster (it went away)")
        remaining = max(0.001, arrived + timeout_s - time.monotonic())
        located = candidates[0].located
        request = generate_request(model_id, located.instance.instance_id, prompt, params, remaining)
        route = None
        if len(candidates) > 1:
            route = functools.partial(self._route, model_id, candidates, request)
        else:
            self._last_used[located.instance.instance_id] = time.monotonic()
        stream = RemoteGenerationStream(self, located, request, timeout_s=timeout_s, arrived=arrived, route=route)
        self._streams.add(stream)
        return stream

    def open_call(self, located: Located, request: pb.GenerateRequest, timeout: float) -> grpc.aio.UnaryStreamCall:
        if located.node_id == self.node_id:
            try:
                return self.node.generate_local(request, timeout=timeout)
            except (UnknownInstanceError, InstanceFailedError) as e:  # gone or restarting since acquire()
                message = str(e.args[0]) if isinstance(e, LookupError) and e.args else str(e)
                raise NodeUnavailableError(message) from None
        peer = self._peer(located.node_id)
        return peer.stub.Generate(
            request, timeout=timeout, metadata=self.node.registry.metadata("/exo.v1.Node/Generate")
        )

    def set_native_mtp(self, enabled: bool, disabled_reason: str) -> None:
        self._mtp = (enabled, disabled_reason)

    @property
    def native_mtp_enabled(self) -> bool:
        return self._mtp[0]

    def status(self) -> dict[str, Any]:
        ours = self.node.supervisor.list()
        return {
            "node_id": self.node_id,
            "models_loaded": [i.model_id for i in ours if i.state == pb.INSTANCE_STATE_READY],
            "queue_depth": sum(i.queue_depth for i in ours),
            "running": sum(i.running for i in ours),
            "uptime_s": round(time.monotonic() - self._started, 3),
            "peers": len(self.peers()),
        }

    # -- instances (POST/GET/DELETE /v1/instances) ---------------------------------------------------------------
    def plan(self, model_id: str, node: str | None = None, *, min_nodes: int = 1,
             nodes: list[str] | None = None, replica: bool = False, sharding: str = "pipeline") -> pl.Placement:
        return pl.placement(self.requirement(model_id), self.capacities(), self.existing(), node=node,
                            min_nodes=min_nodes, nodes_in_order=nodes, links=self.links(), replica=replica,
                            sharding=sharding, tensor_backend=self.settings.tensor_backend)

    def plan_options(self, model_id: str, node: str | None = None, *, min_nodes: int = 1,
                     nodes: list[str] | None = None, replica: bool = False) -> list[pl.PlacementOption]:
        """Both splits of the model (pipeline, tensor) as placement would make them now, estimated (the preview)."""
        existing = [e for e in self.existing() if replica or e.model_id != model_id or e.state not in pl.LIVE_STATES]
        return pl.placement_options(self.requirement(model_id), self.capacities(), existing, node=node,
                                    nodes_in_order=nodes, min_nodes=min_nodes, links=self.links(),
                                    tensor_backend=self.settings.tensor_backend)

    def _split_plan(self, model_id: str, excluding: frozenset[str], sharding: str) -> pl.Placement:
        """An on-demand placement: ``sharding`` (a broken tensor group's is "tensor"), else the default split
        when that one cannot be placed any more (too few nodes left for a tensor group)."""
        place = functools.partial(pl.placement, self.requirement(model_id), self.capacities(), self.existing(excluding),
                                  links=self.links(), tensor_backend=self.settings.tensor_backend)
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
        self._routes[model_id] = located
        return located, plan

    async def delete_instance(self, instance_id: str) -> bool:
        if self._gone.pop(instance_id, None) is not None:
            return True
        single, pipelines = self.instances()
        pipeline = next((p for p in pipelines if p.instance_id == instance_id), None)
        located = next((loc for loc in single if loc.instance.instance_id == instance_id), None)
        if located is None and pipeline is None:
            raise InstanceNotFoundError(f"no instance {instance_id!r} in the cluster; list them with GET /v1/instances")
        self._routes = {m: r for m, r in self._routes.items() if r.instance.instance_id != instance_id}
        if pipeline is not None:
            self._broken[instance_id] = time.monotonic()  # deleted on purpose: not for the watcher to re-place
            await self._stop_stages(instance_id, pipeline.planned, grace=5.0)
            for peer in self.peers():
                _forget(peer, instance_id)
            return True
        assert located is not None
        if located.node_id == self.node_id:
            return await self.node.supervisor.stop(instance_id)
        peer = self._peer(located.node_id)
        try:
            reply = await peer.stub.UnloadInstance(
                pb.UnloadInstanceRequest(instance_id=instance_id),
                timeout=30.0,
                metadata=self.node.registry.metadata("/exo.v1.Node/UnloadInstance"),
            )
        except grpc.aio.AioRpcError as e:
            raise _rpc_error(e, f"node {peer.info.name} ({located.node_id[:8]})") from None
        _forget(peer, instance_id)
        return reply.unloaded

    def _views(self) -> list[tuple[str, dict[str, Any]]]:
        single, pipelines = self.instances()
        out = [(loc.instance.instance_id, instance_json(loc.instance, loc.node_id, self.node_id)) for loc in single]
        for p in pipelines:
            state, why = pipes.pipeline_state(p, self.alive())
            view = pipeline_json(list(p.planned), list(p.found), STATE_NAMES.get(state, "failed"), why, self.node_id)
            out.append((p.instance_id, view))
        return out

    def instances_view(self) -> list[dict[str, Any]]:
        now = time.time()
        self._gone = {k: v for k, v in self._gone.items() if now - v[0] < GONE_KEPT_S}
        views = self._views()
        listed = {instance_id for instance_id, _ in views}
        return [view for _, view in views] + [view for iid, (_, view) in self._gone.items() if iid not in listed]

    def instance_view(self, instance_id: str) -> dict[str, Any]:
        for iid, view in self._views():
            if iid == instance_id:
                return view
        if instance_id in self._gone:
            return self._gone[instance_id][1]
        raise InstanceNotFoundError(f"no instance {instance_id!r} in the cluster; list them with GET /v1/instances")

    def cluster_view(self) -> dict[str, Any]:
        own = self.node.info()
        nodes = [node_json(own, self_id=self.node_id, host=None, last_seen_s=0.0, rtt_ms=0.0, source="self")]
        now = time.monotonic()
        for peer in self.peers():
            nodes.append(
                node_json(peer.info, self_id=self.node_id, host=peer.address[0],
                          last_seen_s=now - peer.last_seen, rtt_ms=peer.rtt_ms, source=peer.source)
            )
        links = [{"from": self.node_id, "to": p.node_id, "rtt_ms": round(p.rtt_ms, 3), "source": p.source}
                 for p in self.peers()]
        for peer in self.peers():
            links.extend(
                {"from": peer.node_id, "to": link.node_id, "rtt_ms": round(link.rtt_ms, 3), "source": link.source}
                for link in peer.info.links
            )
        return {
            "node_id": self.node_id,
            "namespace": self.settings.namespace,
            "nodes": nodes,
            "links": links,
            "instances": self.instances_view(),
        }

    def peer_downloads(self) -> list[dict[str, Any]]:
        """The downloads of the other nodes (as of their last answer), for ``GET /v1/downloads``."""
        return [download_json(d, peer.node_id) for peer in self.peers() for d in peer.info.downloads]

    def _peer_lost(self, peer: Peer) -> None:
        now = time.time()
        for inst in peer.info.instances:
            if pipes.is_pipelined(inst):
                continue  # the pipeline watcher reports it (and tears it down, and places it anew)
            view = instance_json(inst, peer.node_id, self.node_id)
            view["state"] = "gone"
            view["gone_reason"] = f"node {peer.info.name} ({peer.node_id[:8]}) left the cluster"
            self._gone[inst.instance_id] = (now, view)
            log.warning("instance %s (%s) is gone with node %s", inst.instance_id, inst.model_id, peer.node_id[:8])
        self._routes = {m: r for m, r in self._routes.items() if r.node_id != peer.node_id}
        # Stages of ours whose pipeline had a stage there wait in a receive that will never end: check now.
        self._spawn(self._check_pipelines(), "exo-pipeline-check")


def model_requirement(model_id: str, card: ModelCard | None, sizes: Sequence[pb.ModelAvailability]) -> pl.ModelRequirement:
    """A model's requirement from its card (if any) and what nodes report of its checkpoint on their disk."""
    detailed = max(sizes, key=lambda m: len(m.layer_bytes), default=None)
    parts: dict[str, Any] = {}
    if detailed is not None and detailed.layer_bytes:
        parts = dict(layer_bytes=tuple(detailed.layer_bytes), embed_bytes=detailed.embed_bytes,
                     output_bytes=detailed.output_bytes, mtp_bytes=detailed.mtp_bytes)
    # What a node that read the checkpoint's config says of tensor splits, and what a decode step reads.
    read = next((m for m in sizes if m.tensor_checked), None)
    if read is not None:
        parts.update(tensor_node_counts=tuple(read.tensor_node_counts), active_bytes=read.active_bytes)
    if card is not None:
        disk = max((m.weights_bytes for m in sizes), default=0)
        return dataclasses.replace(pl.ModelRequirement.from_card(card, weights_bytes=disk or None), **parts)
    m = detailed or sizes[0]
    return pl.ModelRequirement(
        model_id=model_id,
        weights_bytes=m.weights_bytes,
        kv_bytes_per_token=m.kv_bytes_per_token,
        context_tokens=min(m.context_length or pl.CONTEXT_BUDGET_TOKENS, pl.CONTEXT_BUDGET_TOKENS),
        n_layers=m.n_layers,
        full_attention_interval=m.full_attention_interval or 4,
        **parts,
    )


def _forget(peer: Peer, instance_id: str) -> None:
    """Our copy of a peer's instances is refreshed at its next poll; drop an instance it stopped now."""
    for i in reversed([i for i, inst in enumerate(peer.info.instances) if inst.instance_id == instance_id]):
        del peer.info.instances[i]


class RemoteGenerationStream(BatchedStream):
    """A generation on a runner (this node's or another's), with ``GenerationStream``'s interface."""

    def __init__(
        self,
        service: ClusterModelService,
        located: Located,
        request: pb.GenerateRequest,
        *,
        timeout_s: float,
        arrived: float,
        route: Callable[[], Located] | None = None,
    ) -> None:
        self.id = request.request_id
        self.service = service
        self.model_id = request.model
        self.instance_id = located.instance.instance_id
        self.timeout_s = timeout_s
        self.deadline = arrived + timeout_s
        self.finished = False
        self.tokens = 0
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._pending: list[Any] = []
        self._error = None
        self._request = request
        self._default = located
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._where = "this node"
        if route is None:
            self._open(located)
        self._task = asyncio.get_running_loop().create_task(self._pump(route))

    def _open(self, located: Located) -> None:
        self.instance_id = self._request.instance_id = located.instance.instance_id
        remaining = max(0.001, self.deadline - time.monotonic())
        self._call = self.service.open_call(located, self._request, remaining + DEADLINE_GRACE_S)
        self._where = "this node" if located.node_id == self.service.node_id else f"node {located.node_id[:8]}"

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._task.cancel()
        self.service._streams.discard(self)

    async def _pump(self, route: Callable[[], Located] | None = None) -> None:
        # The finish reason for the metrics, as a runner's job counts it: "rejected" only before the stream
        # started (the request never ran), "error" after, "cancelled" when the client went away (cancel()).
        finish, stats, started = "error", None, False
        try:
            if route is not None:  # several instances: the choice tokenizes the prompt, off the event loop
                located = self._default
                try:
                    located = await asyncio.to_thread(route)
                except Exception:  # noqa: BLE001 - routing is a hint: the default candidate serves
                    log.exception("routing failed; sending to the default instance")
                try:
                    self.service._last_used[located.instance.instance_id] = time.monotonic()
                    self._open(located)
                except Exception as e:  # noqa: BLE001 - what generate() would have raised: the handler's error
                    self._items.put_nowait(Failed(e))
                    finish = "rejected"
                    return
            assert self._call is not None
            while True:
                try:
                    async with asyncio.timeout(STREAM_IDLE_S):  # no task per read (unlike wait_for)
                        msg = await self._call.read()
                except TimeoutError:
                    self._items.put_nowait(
                        Failed(NodeUnavailableError(f"{self._where} stopped answering for {STREAM_IDLE_S:g} s"))
                    )
                    return
                if msg is grpc.aio.EOF:
                    self._items.put_nowait(Failed(NodeUnavailableError(f"{self._where} ended the stream early")))
                    return
                if msg.heartbeat:
                    continue
                if msg.HasField("error"):
                    self._items.put_nowait(Failed(error_from_pb(msg.error)))
                    finish = "error" if started else "rejected"
                    return
                if msg.HasField("started"):
                    started = True
                    s = msg.started
                    self._items.put_nowait(Started(s.prompt_tokens, s.max_tokens, s.queue_s, s.thinking))
                    continue
                chunk = chunk_from_pb(msg)
                self.tokens += len(chunk.token_ids)
                self._items.put_nowait(chunk)
                if chunk.finish_reason is not None:
                    finish, stats = chunk.finish_reason, chunk.stats
                    return
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._items.put_nowait(Failed(RequestTimeoutError(
                    f"the request exceeded the server's request timeout of {self.timeout_s:g} s")))
            elif e.code() != grpc.StatusCode.CANCELLED:
                self._items.put_nowait(Failed(_rpc_error(e, self._where)))
            finish = "cancelled" if e.code() == grpc.StatusCode.CANCELLED else "error"
        except asyncio.CancelledError:  # cancel(): the client went away
            finish = "cancelled"
            raise
        finally:
            self.service._streams.discard(self)
            if finish == "cancelled" and time.monotonic() > self.deadline:
                finish = "timeout"
            self.service.metrics.record_generation(self.model_id, finish, stats)

    def _put_back(self, items: list[Any]) -> None:
        self._pending = items + self._pending

    async def _take(self) -> list[Any]:
        if self._pending:
            items, self._pending = self._pending, []
            return items
        remaining = self.deadline + DEADLINE_GRACE_S - time.monotonic()
        try:
            items = [await asyncio.wait_for(self._items.get(), max(0.0, remaining))]
        except TimeoutError:
            self.cancel()
            raise RequestTimeoutError(
                f"the request exceeded the server's request timeout of {self.timeout_s:g} s"
            ) from None
        while not self._items.empty():
            items.append(self._items.get_nowait())
        return items


def _rpc_error(e: grpc.aio.AioRpcError, where: str) -> BaseException:
    code = e.code()
    if code == grpc.StatusCode.NOT_FOUND:
        return UnknownModelError(e.details() or "not found", [])
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return ModelNotAvailableError(e.details() or "not available there")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ClusterAuthError(f"{where} refused this node: {e.details()}")
    return NodeUnavailableError(f"{where} did not answer: {code.name}: {e.details()}")


def _failure_text(inst: pb.Instance) -> str:
    f = inst.failure
    detail = f.message or (f.stderr_tail[-1] if f.stderr_tail else "")
    code = f" (exit code {f.exit_code})" if inst.pid else ""  # no pid: no runner ran (its download failed)
    return f"instance {inst.instance_id} of {inst.model_id} failed{code}: {detail}"
