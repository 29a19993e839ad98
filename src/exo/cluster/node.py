"""One exo node of a cluster: its identity, gRPC server (service ``exo.v1.Node``), peers and instances.

Everything runs on the daemon's asyncio loop (the same loop as the HTTP API): the gRPC server and
clients are ``grpc.aio``, the runners are asyncio subprocesses, zeroconf is ``AsyncZeroconf``. The
node answers its peers from what it already knows (cached disk scans, the registry's last answers), so
no call waits on another node. A model (or pipeline stage) whose weights are not on its disk is
downloaded first when the node can (``fetching.InstanceFetcher``): the instance is listed meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc

from exo import system
from exo.cards import ModelCard, UnknownModelError
from exo.downloads import HubConfig
from exo.downloads.fetch import free_bytes
from exo.engine import ResolvedModel
from exo.engine.request import MTPSwitch
from exo.engine.resolve import ModelNotAvailableError
from exo.settings import Settings
from exo.wire.proto_gen import node_pb2 as pb
from exo.wire.proto_gen import node_pb2_grpc as pb_grpc

from .auth import AuthInterceptor, ClusterAuth
from .fetching import InstanceFetcher, node_downloads
from .identity import NodeIdentity
from .models import LocalModels
from .registry import CHANNEL_OPTIONS, Peer, PeerRegistry
from .supervisor import DownloadReport, InstanceFailedError, InstanceSupervisor, UnknownInstanceError

if TYPE_CHECKING:
    from exo.downloads import DownloadManager

log = logging.getLogger(__name__)

MODELS_REFRESH_S = 10.0


def new_instance_id() -> str:
    return "inst-" + uuid.uuid4().hex[:12]


class ClusterNode:
    """A node: call ``start()`` on the loop that serves the API, ``close()`` on the same loop."""

    def __init__(
        self,
        settings: Settings,
        models: LocalModels,
        *,
        version: str,
        mtp_switch: Callable[[], MTPSwitch],
        name: str | None = None,
        on_peer_lost: Callable[[Peer], None] | None = None,
        max_restarts: int = 2,
        downloads: DownloadManager | None = None,
    ) -> None:
        self.settings = settings
        self.downloads = downloads
        self.fetcher = (InstanceFetcher(downloads, lambda: models.catalog, self.offline)
                        if downloads is not None else None)
        self.models = models
        self.version = version
        self.mtp_switch = mtp_switch
        self.name = name or socket.gethostname()
        self.identity = NodeIdentity(settings.home)
        self.auth = ClusterAuth(settings.cluster_secret.get_secret_value() if settings.cluster_secret else None)
        # The runners of a pipeline prove the cluster secret to each other when their group forms (runner/group.py).
        secret = {"EXO_CLUSTER_SECRET": settings.cluster_secret.get_secret_value()} if settings.cluster_secret else {}
        self.supervisor = InstanceSupervisor(settings.home, node_id=lambda: self.identity.node_id,
                                             max_restarts=max_restarts, env=secret)
        self._on_peer_lost = on_peer_lost
        self.registry = PeerRegistry(
            self.identity,
            self.auth,
            settings.namespace,
            caller=self.caller,
            on_lost=self._peer_lost,
            on_id_changed=self._id_changed,
        )
        self.discovery = None
        self.grpc_port = settings.grpc_port
        self.started = time.monotonic()
        self._server: grpc.aio.Server | None = None
        self._models: list[pb.ModelAvailability] = []
        self._refresh_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._models = await asyncio.to_thread(self.models.available)
        server = grpc.aio.server(
            interceptors=[AuthInterceptor(self.auth)] if self.auth.enabled else None,
            options=CHANNEL_OPTIONS[:2],
        )
        pb_grpc.add_NodeServicer_to_server(NodeServicer(self), server)
        host = self.settings.api_host
        bind = f"[{host}]:{self.grpc_port}" if ":" in host else f"{host}:{self.grpc_port}"
        try:
            port = server.add_insecure_port(bind)
        except RuntimeError as e:
            raise OSError(f"cannot serve gRPC on {bind}: {e} (is --grpc-port in use?)") from e
        if port == 0:
            raise OSError(f"cannot serve gRPC on {bind} (is --grpc-port {self.grpc_port} in use?)")
        self.grpc_port = port
        await server.start()
        self._server = server
        for peer in self.settings.peers:
            host, _, port_text = peer.rpartition(":")
            self.registry.add_address(host.strip("[]"), int(port_text), "static")
        await self.registry.start()
        if self.settings.discovery:
            await self._start_discovery()
        self._refresh_task = asyncio.create_task(self._refresh_models(), name="exo-models-refresh")
        log.info(
            "node %s (%s) on gRPC port %d, namespace %s, cluster secret %s, discovery %s",
            self.node_id, self.name, self.grpc_port, self.settings.namespace,
            "on" if self.auth.enabled else "off", "on" if self.discovery is not None else "off",
        )

    async def _start_discovery(self) -> None:
        from .discovery import Discovery

        discovery = Discovery(
            node_id=self.node_id,
            namespace=self.settings.namespace,
            grpc_port=self.grpc_port,
            api_port=self.settings.api_port,
            version=self.version,
            on_found=lambda a: self.registry.add_address(a.host, a.grpc_port, "zeroconf"),
            on_lost=self._advert_lost,
            # Advertise the address the daemon listens on (wildcards: every interface).
            interfaces=None if self.settings.api_host in ("0.0.0.0", "::", "") else [self.settings.api_host],
        )
        try:
            await discovery.start()
        except Exception as e:  # noqa: BLE001 - static peers still work without multicast
            log.warning("zeroconf discovery is off: %s: %s (static peers still work)", type(e).__name__, e)
            return
        self.discovery = discovery

    def _advert_lost(self, node_id: str) -> None:
        peer = self.registry.get(node_id)
        if peer is not None:
            self.registry.remove_address(*peer.address, "zeroconf")

    async def close(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
        if self.discovery is not None:
            await self.discovery.close()
        await self.registry.close()
        await self.supervisor.close()
        if self._server is not None:
            await self._server.stop(1.0)
            self._server = None

    async def _refresh_models(self) -> None:
        while True:
            await asyncio.sleep(MODELS_REFRESH_S)
            try:
                self._models = await asyncio.to_thread(self.models.available)
            except Exception:  # noqa: BLE001 - keep the last good scan
                log.exception("scanning local models failed")

    def _peer_lost(self, peer: Peer) -> None:
        if self._on_peer_lost is not None:
            self._on_peer_lost(peer)

    def _id_changed(self, old: str) -> None:
        if self.discovery is not None:
            task = asyncio.get_running_loop().create_task(self.discovery.update_node_id(self.node_id))
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("re-advertising under the new node id failed: %s", task.exception())

    # -- what this node says about itself ----------------------------------------------------------------------
    def caller(self) -> pb.Caller:
        return pb.Caller(
            node_id=self.node_id,
            boot_nonce=self.identity.boot_nonce,
            grpc_port=self.grpc_port,
            api_port=self.settings.api_port,
            namespace=self.settings.namespace,
        )

    def local_models(self) -> list[pb.ModelAvailability]:
        return list(self._models)

    def offline(self) -> bool:
        """EXO_OFFLINE or HF_HUB_OFFLINE, as they are now: the node downloads nothing."""
        return HubConfig.from_env(offline=self.settings.offline).offline

    def info(self, challenge: str = "") -> pb.NodeInfo:
        mem = system.memory(self.settings.memory_budget_bytes)
        return pb.NodeInfo(
            node_id=self.node_id,
            name=self.name,
            version=self.version,
            namespace=self.settings.namespace,
            api_port=self.settings.api_port,
            grpc_port=self.grpc_port,
            boot_nonce=self.identity.boot_nonce,
            memory_total_bytes=mem.total_bytes,
            memory_available_bytes=mem.available_bytes,
            chip=system.chip(),
            backend=system.backend(),
            disk_free_bytes=system.disk_free(self.settings.home),
            instances=self.supervisor.list(),
            links=[
                pb.Link(node_id=p.node_id, host=p.address[0], grpc_port=p.address[1], rtt_ms=p.rtt_ms, source=p.source)
                for p in self.registry.peers()
            ],
            models=self._models,
            proof=self.auth.proof(challenge, self.node_id) if challenge else "",
            secured=self.auth.enabled,
            uptime_s=time.monotonic() - self.started,
            platform=f"{platform.system()} {platform.machine()}",
            cpu_count=os.cpu_count() or 0,
            downloads=node_downloads(self.downloads) if self.downloads is not None else [],
            offline=self.fetcher is None or self.offline(),
            hub_cache_free_bytes=free_bytes(HubConfig.from_env().cache_dir),
            decode_bytes_per_s=self.supervisor.decode_bytes_per_s,
        )

    # -- instances on this node -----------------------------------------------------------------------------
    async def load(self, request: pb.LoadInstanceRequest) -> pb.Instance:
        """Start an instance here (or return this node's live instance of that model), or this node's stage
        of a pipelined instance (or that stage, when it runs already). Weights that are not here are
        downloaded first, when they can be (a card's repo, and the node not offline)."""
        try:
            resolved = await asyncio.to_thread(self.models.resolve, request.model)
        except ModelNotAvailableError:
            card = self.fetcher.downloadable_card(request.model) if self.fetcher is not None else None
            if card is None:
                raise
            return await self._load_after_download(request, card)
        if request.stages:
            existing = self.supervisor.get(request.instance_id)
        else:
            existing = self.supervisor.live_for(resolved.model_id)
        if existing is not None:
            return existing
        instance_id = request.instance_id or new_instance_id()
        shard = request.shard if request.HasField("shard") else None
        return await self.supervisor.start(
            instance_id, resolved, shard, on_demand=request.on_demand, group_id=request.group_id,
            model_ref=request.model, stages=list(request.stages), owner_node=request.owner_node,
        )

    async def _load_after_download(self, request: pb.LoadInstanceRequest, card: ModelCard) -> pb.Instance:
        """An instance (or pipeline stage) of a model whose weights are not here: listed at once,
        downloading (a stage: only its files), then loading as usual."""
        fetcher = self.fetcher
        assert fetcher is not None
        existing = self.supervisor.get(request.instance_id) if request.stages else self.supervisor.live_for(card.id)
        if existing is not None:
            return existing
        shard = request.shard if request.HasField("shard") else None
        stage = fetcher.stage_of(card, shard) if request.stages else None

        async def fetch(report: DownloadReport) -> ResolvedModel:
            resolved = await fetcher.fetch(card, stage, report)
            if stage is None:  # the whole model is on this disk now: say so to placement at once
                self.models.rescan()
                self._models = await asyncio.to_thread(self.models.available)
            return resolved

        return await self.supervisor.fetch_and_start(
            request.instance_id or new_instance_id(), card.id, fetch, shard, on_demand=request.on_demand,
            group_id=request.group_id, model_ref=request.model, stages=list(request.stages),
            owner_node=request.owner_node,
        )

    def switch_pb(self) -> pb.NodeSwitch:
        switch = self.mtp_switch()
        return pb.NodeSwitch(enabled=switch.enabled, disabled_reason=switch.disabled_reason)

    def generate_local(self, request: pb.GenerateRequest, timeout: float | None) -> grpc.aio.UnaryStreamCall:
        """A generation on this node's instance (named, or the ready one of the model)."""
        instance_id = request.instance_id
        if not instance_id:
            live = self.supervisor.live_for(request.model)
            if live is None:
                raise UnknownInstanceError(f"no instance of {request.model} on node {self.node_id}")
            instance_id = live.instance_id
        relayed = pb.GenerateRequest()
        relayed.CopyFrom(request)
        relayed.instance_id = instance_id
        relayed.node_mtp.CopyFrom(self.switch_pb())  # the owner's switch decides
        return self.supervisor.generate(instance_id, relayed, timeout=timeout)


class NodeServicer(pb_grpc.NodeServicer):
    """``exo.v1.Node`` for peers (and ``exo cluster``-style tools); every handler answers from memory."""

    def __init__(self, node: ClusterNode) -> None:
        self.node = node

    async def GetNodeInfo(self, request: pb.NodeInfoRequest, context: grpc.aio.ServicerContext) -> pb.NodeInfo:
        caller = request.caller
        if caller.node_id and caller.grpc_port and caller.namespace == self.node.settings.namespace:
            host = _peer_host(context.peer())
            if host is not None and caller.boot_nonce != self.node.identity.boot_nonce:
                self.node.registry.add_address(host, caller.grpc_port, "inbound")
        return self.node.info(request.challenge)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthReply:
        ready = sum(1 for i in self.node.supervisor.list() if i.state == pb.INSTANCE_STATE_READY)
        return pb.HealthReply(
            node_id=self.node.node_id, status="ok", instances_ready=ready, uptime_s=time.monotonic() - self.node.started
        )

    async def LoadInstance(self, request: pb.LoadInstanceRequest, context: grpc.aio.ServicerContext) -> pb.Instance:
        try:
            return await self.node.load(request)
        except UnknownModelError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]) if e.args else str(e))
        except ModelNotAvailableError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e.args[0]) if e.args else str(e))
        raise AssertionError("unreachable")  # abort raises

    async def UnloadInstance(
        self, request: pb.UnloadInstanceRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadInstanceReply:
        return pb.UnloadInstanceReply(unloaded=await self.node.supervisor.stop(request.instance_id))

    async def GetInstance(self, request: pb.GetInstanceRequest, context: grpc.aio.ServicerContext) -> pb.Instance:
        instance = self.node.supervisor.get(request.instance_id)
        if instance is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no instance {request.instance_id} on this node")
        return instance

    async def ListInstances(self, request: pb.ListInstancesRequest, context: grpc.aio.ServicerContext) -> pb.InstanceList:
        return pb.InstanceList(instances=self.node.supervisor.list())

    async def JoinGroup(self, request: pb.JoinGroupRequest, context: grpc.aio.ServicerContext) -> pb.JoinGroupReply:
        try:
            accepted = await self.node.supervisor.join_group(request.instance_id, list(request.hosts))
        except UnknownInstanceError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, _text(e))
        except grpc.aio.AioRpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the stage's runner did not take the hosts: {e.details()}")
        return pb.JoinGroupReply(accepted=accepted)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        try:
            call = self.node.generate_local(request, timeout=request.timeout_s + 30.0 if request.timeout_s > 0 else None)
        except (UnknownInstanceError, InstanceFailedError) as e:
            yield pb.GenerateChunk(error=pb.GenerateError(type="model_unavailable", message=_text(e)))
            return
        async with contextlib.aclosing(relay_generation(call, request.model, context)) as chunks:
            async for chunk in chunks:  # (closed with this handler: the runner's generation is cancelled at once)
                yield chunk


async def relay_generation(call: grpc.aio.UnaryStreamCall, model: str,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
    """A runner's Generate stream relayed to a peer's call: every chunk, and an error chunk (never a silent end
    or a hang) when the runner goes away mid-generation. Two ways it does: its socket closes (the call fails),
    or its supervisor, seeing the process gone, closes the channel first. grpc.aio then raises
    ``asyncio.CancelledError`` from the read; were that to end this handler, gRPC's server would leave the
    peer's call open with nothing more to read (the peer's router gave up after ``STREAM_IDLE_S``)."""
    try:
        async for chunk in call:
            yield chunk
    except grpc.aio.AioRpcError as e:
        # The runner went away mid-generation (crashed, or killed with its pipeline group); a call cancelled
        # while our caller is still there was cancelled under us (the runner's channel closed as it died).
        if e.code() != grpc.StatusCode.CANCELLED or not context.cancelled():
            message = f"the runner of {model} failed: {e.code().name}: {e.details()}"
            yield pb.GenerateChunk(error=pb.GenerateError(type="model_unavailable", message=message))
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if context.cancelled() or (task is not None and task.cancelling()):
            raise  # our caller went away: this handler is what was cancelled
        # The call, not this handler, was cancelled: the runner's channel closed under it (its process ended).
        message = f"the runner of {model} went away mid-generation (its channel closed)"
        yield pb.GenerateChunk(error=pb.GenerateError(type="model_unavailable", message=message))
    finally:
        call.cancel()  # our caller went away (or we are done): stop the runner's generation


def _text(exc: BaseException) -> str:
    return str(exc.args[0]) if isinstance(exc, LookupError) and exc.args else str(exc)


def _peer_host(peer: str) -> str | None:
    """gRPC's peer string ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678") -> the host."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        host = rest.rpartition(":")[0]
        return host.strip("[]").replace("%25", "%")
    return None
