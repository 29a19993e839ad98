"""``ClusterModelService``: the ``ModelService`` of an exo node in a cluster (what ``exo serve`` runs), over its
pieces: the cluster as this node sees it (``cluster_view.ClusterView``), placing instances and waiting for
them (``placing.Placer``), pipelines' groups (``groups.PipelineGroups``), routing generations
(``router.Router``).

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
the next request does). A tensor group (``sharding="tensor"``: every member a slice of every layer, joined
by all-reduces) is placed, formed, torn down and placed anew the same way; its last member leads.

Weights on no node's disk are downloaded by the nodes placement picks (``fetching``): each stage's node
fetches its stage's files; the instance is ``downloading`` meanwhile, then loads as usual.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from exo import __version__
from exo.cards import Catalog, ModelCard, load_catalog
from exo.downloads import DownloadManager
from exo.engine import ResolvedModel
from exo.engine.resolve import DEFAULT_MODEL
from exo.metrics import Metrics
from exo.settings import Settings
from exo.wire.proto_gen import node_pb2 as pb

from . import pipelines as pipes
from . import placement as pl
from .cluster_view import ClusterView
from .listing import card_info, model_rows
from .models import LocalModels
from .node import ClusterNode, MTPSwitch
from .placing import Placer
from .registry import Peer
from .router import RemoteGenerationStream, Router
from .service import GenerateParams, ModelInfo, NativeMTPInfo, Prompt
from .views import Located, instance_json

log = logging.getLogger(__name__)


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
        self._started = time.monotonic()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self.view = ClusterView(settings, self.catalog, self.models, self.node)
        self.placer = Placer(self.view, self.node, max_loaded, self._spawn)
        self.router = Router(self.view, self.node, self.models, settings, self.metrics, self.placer.last_used)

    @property
    def node_id(self) -> str:
        return self.node.node_id

    # -- lifecycle (the app's startup and cleanup hooks) ------------------------------------------------------
    async def start(self) -> None:
        self.view.loop = asyncio.get_running_loop()
        await self.node.start()
        self._watcher = asyncio.create_task(self.placer.groups.watch(), name="exo-pipeline-watch")

    async def aclose(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        for stream in list(self.router.streams):
            stream.cancel()
        for task in [*self.placer.placing.values(), *self._tasks]:
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

    def _peer_lost(self, peer: Peer) -> None:
        now = time.time()
        for inst in peer.info.instances:
            if pipes.is_pipelined(inst):
                continue  # the pipeline watcher reports it (and tears it down, and places it anew)
            view = instance_json(inst, peer.node_id, self.node_id)
            view["state"] = "gone"
            view["gone_reason"] = f"node {peer.info.name} ({peer.node_id[:8]}) left the cluster"
            self.view.gone[inst.instance_id] = (now, view)
            log.warning("instance %s (%s) is gone with node %s", inst.instance_id, inst.model_id, peer.node_id[:8])
        self.view.routes = {m: r for m, r in self.view.routes.items() if r.node_id != peer.node_id}
        # Stages of ours whose pipeline had a stage there wait in a receive that will never end: check now.
        self._spawn(self.placer.groups.check(), "exo-pipeline-check")

    # -- ModelService ------------------------------------------------------------------------------------------
    def list_models(self) -> list[ModelInfo]:
        loaded: list[ModelInfo] = []
        seen: set[str] = set()
        single, pipelines = self.view.instances()
        ready = [loc.instance for loc in single if loc.instance.state == pb.INSTANCE_STATE_READY]
        ready += [p.leader.instance for p in pipelines
                  if p.leader is not None and pipes.pipeline_state(p, self.view.alive())[0] == pb.INSTANCE_STATE_READY]
        for inst in ready:
            if inst.model_id not in seen:
                seen.add(inst.model_id)
                loaded.append(self._loaded_info(inst))
        own = {m.model_id for m in self.node.local_models()}
        elsewhere: dict[str, ModelCard | None] = {}
        for peer in self.view.peers():
            for m in peer.info.models:
                if m.model_id not in own:
                    elsewhere[m.model_id] = self.view.card(m.model_id)
        return model_rows(self.catalog, loaded, self.models.registered(), self._mtp, elsewhere=elsewhere)

    def _loaded_info(self, inst: pb.Instance) -> ModelInfo:
        s = inst.model
        enabled, disabled_reason = self._mtp
        reason = disabled_reason if not enabled else (None if s.mtp_available else s.mtp_reason or "no MTP head")
        card = self.view.card(inst.model_id)
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

    def model_id(self, ref: str) -> str:
        """A request's model reference -> a model id known somewhere in the cluster (reads the disk: callers
        run it in a worker thread)."""
        return self.view.model_id(ref)

    async def acquire(self, model: str | None, timeout: float) -> str:
        self.view.loop = asyncio.get_running_loop()
        ref = self.default_model if model is None else model
        model_id = await asyncio.to_thread(self.model_id, ref)
        await self.placer.acquire(model_id, timeout)
        return model_id

    def generate(
        self, model_id: str, prompt: Prompt, params: GenerateParams, *, timeout_s: float, arrived: float
    ) -> RemoteGenerationStream:
        return self.router.generate(model_id, prompt, params, timeout_s=timeout_s, arrived=arrived)

    async def count_prompt_tokens_here(self, model: str | None, prompt: Prompt) -> int | None:
        """The prompt's tokens counted in this process when the model's files are on this node (None: they are
        not here; the caller asks the owner)."""
        return await self.router.count_prompt_tokens_here(self.default_model if model is None else model, prompt)

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
            "peers": len(self.view.peers()),
        }

    # -- instances (POST/GET/DELETE /v1/instances, /v1/cluster) ---------------------------------------------------
    def plan(self, model_id: str, node: str | None = None, *, min_nodes: int = 1,
             nodes: list[str] | None = None, replica: bool = False, sharding: str = "pipeline") -> pl.Placement:
        return self.placer.plan(model_id, node, min_nodes=min_nodes, nodes=nodes, replica=replica, sharding=sharding)

    def plan_options(self, model_id: str, node: str | None = None, *, min_nodes: int = 1,
                     nodes: list[str] | None = None, replica: bool = False) -> list[pl.PlacementOption]:
        """Both splits of the model (pipeline, tensor) as placement would make them now, estimated (the preview)."""
        return self.placer.plan_options(model_id, node, min_nodes=min_nodes, nodes=nodes, replica=replica)

    async def create_instance(self, model_id: str, node: str | None = None, *, min_nodes: int = 1,
                              nodes: list[str] | None = None, replica: bool = False,
                              sharding: str = "pipeline") -> tuple[Located, pl.Placement]:
        return await self.placer.create_instance(model_id, node, min_nodes=min_nodes, nodes=nodes, replica=replica,
                                                 sharding=sharding)

    async def delete_instance(self, instance_id: str) -> bool:
        return await self.placer.delete_instance(instance_id)

    async def wait_ready(self, node_id: str, instance_id: str, timeout: float | None) -> Located:
        return await self.placer.wait_ready(node_id, instance_id, timeout)

    def instances_view(self) -> list[dict[str, Any]]:
        return self.view.instances_view()

    def instance_view(self, instance_id: str) -> dict[str, Any]:
        return self.view.instance_view(instance_id)

    def cluster_view(self) -> dict[str, Any]:
        return self.view.cluster_view()

    def peer_downloads(self) -> list[dict[str, Any]]:
        """The downloads of the other nodes (as of their last answer), for ``GET /v1/downloads``."""
        return self.view.peer_downloads()
