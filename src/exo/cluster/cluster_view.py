"""The cluster as this node sees it: every instance and pipeline stage (ours, our peers' as of their last
answer, the ones we just started or routed to that a peer does not list yet), the nodes' capacities and
links, what a model needs, and the views ``/v1/cluster`` and ``/v1/instances`` show.

It belongs to the event loop's thread: ``located()`` prunes the routes and recent starts while the loop
reassigns them, so a worker thread asks through ``on_loop``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from exo.cards import Catalog, ModelCard, UnknownModelError
from exo.downloads.fetch import DEFAULT_RESERVE_BYTES
from exo.engine import ModelNotAvailableError
from exo.settings import Settings
from exo.wire.proto_gen import node_pb2 as pb

from . import pipelines as pipes
from . import placement as pl
from .models import LocalModels
from .node import ClusterNode
from .registry import Peer
from .service import InstanceNotFoundError, NodeUnavailableError
from .views import STATE_NAMES, Located, download_json, instance_json, node_json, pipeline_json

T = TypeVar("T")

GONE_KEPT_S = 600.0  # how long an instance that went away stays listed (state "gone")


class ClusterView:
    def __init__(self, settings: Settings, catalog: Catalog, models: LocalModels, node: ClusterNode) -> None:
        self.settings = settings
        self.catalog = catalog
        self.models = models
        self.node = node
        self.routes: dict[str, Located] = {}  # model id -> the instance acquire() found for it
        # (node id, instance id) -> a stage this node just started on a peer (listed until the peer lists it)
        self.recent: dict[tuple[str, str], Located] = {}
        self.routed_at: dict[str, float] = {}  # instance id -> when it was routed to
        self.reserved: dict[tuple[str, str], int] = {}  # (instance id, node id) -> bytes it will take loaded
        self.gone: dict[str, tuple[float, dict[str, Any]]] = {}  # instance id -> (when, its last view)
        self.loop: asyncio.AbstractEventLoop | None = None  # the one whose thread owns this view

    @property
    def node_id(self) -> str:
        return self.node.node_id

    def peers(self) -> list[Peer]:
        return self.node.registry.peers()

    def peer(self, node_id: str) -> Peer:
        peer = self.node.registry.get(node_id)
        if peer is None:
            raise NodeUnavailableError(f"node {node_id} is not in the cluster (any more)")
        return peer

    def alive(self) -> set[str]:
        return {self.node_id, *(p.node_id for p in self.peers())}

    def located(self) -> list[Located]:
        """Every instance (and pipeline stage) in the cluster: ours (current), our peers' (as of their last
        answer), and the ones this node started or found on a peer that its last answer does not show yet."""
        out = [Located(self.node_id, inst) for inst in self.node.supervisor.list()]
        for peer in self.peers():
            out.extend(Located(peer.node_id, inst) for inst in peer.info.instances)
        index = {(loc.node_id, loc.instance.instance_id): i for i, loc in enumerate(out)}
        for key, route in [*self.routes.items(), *self.recent.items()]:
            if route.node_id == self.node_id:
                continue
            i = index.get((route.node_id, route.instance.instance_id))
            if i is not None:
                if route.instance.updated_unix > out[i].instance.updated_unix:
                    out[i] = route  # we asked that node since its last answer
                else:
                    self.recent.pop(key, None)  # type: ignore[call-overload]  # its node lists it now
                continue
            peer = self.node.registry.get(route.node_id)
            if peer is None or peer.last_seen > self.routed_at.get(route.instance.instance_id, 0.0) + 1.0:
                self.routes.pop(key, None)  # type: ignore[call-overload]  # that node answered since, without it
                self.recent.pop(key, None)  # type: ignore[call-overload]
                continue
            index[(route.node_id, route.instance.instance_id)] = len(out)
            out.append(route)
        return out

    def instances(self) -> tuple[list[Located], list[pipes.Pipeline]]:
        """Single-node instances and pipelines, as this node sees them."""
        return pipes.group_stages(self.located())

    def find(self, instance_id: str) -> Located | None:
        """A single-node instance, or a pipeline's leader stage (with the pipeline's state)."""
        single, pipelines = self.instances()
        for loc in single:
            if loc.instance.instance_id == instance_id:
                return loc
        for p in pipelines:
            if p.instance_id == instance_id:
                return self.pipeline_located(p)
        return None

    def pipeline_located(self, p: pipes.Pipeline) -> Located:
        """A pipeline as one instance: its leader's stage, carrying the whole pipeline's state."""
        state, _ = pipes.pipeline_state(p, self.alive())
        leader = p.leader or next(loc for loc in p.found if loc is not None)  # group_stages found one
        inst = pb.Instance()
        inst.CopyFrom(leader.instance)
        inst.state = state  # type: ignore[assignment]
        return Located(p.planned[-1].node_id, inst)

    def live(self, model_id: str) -> Located | None:
        """An instance of the model that is ready (preferred; ours first) or loading; for a pipeline, its
        leader (which serves generations), ready when the whole pipeline is."""
        single, pipelines = self.instances()
        candidates = [loc for loc in single if loc.instance.model_id == model_id]
        candidates += [self.pipeline_located(p) for p in pipelines if p.model_id == model_id]
        candidates = [c for c in candidates if c.instance.state in (pb.INSTANCE_STATE_READY, pb.INSTANCE_STATE_LOADING)]
        candidates.sort(key=lambda c: (c.instance.state != pb.INSTANCE_STATE_READY, c.node_id != self.node_id))
        return candidates[0] if candidates else None

    def forget(self, instance_id: str) -> None:
        """Requests no longer go to ``instance_id`` (it broke, went away or was deleted)."""
        self.routes = {m: r for m, r in self.routes.items() if r.instance.instance_id != instance_id}

    def drop_reservations(self, instance_id: str) -> None:
        for key in [k for k in self.reserved if k[0] == instance_id]:
            del self.reserved[key]

    # -- what placement reads -------------------------------------------------------------------------------
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
                self.reserved.get((loc.instance.instance_id, loc.node_id), 0),
            )
            for loc in self.located()
            if loc.instance.instance_id not in excluding
        ]

    def requirement(self, model_id: str) -> pl.ModelRequirement:
        """What the model needs, from its card and its checkpoint on a node's disk (size, and per layer)."""
        sizes = [m for info in [self.node.info()] + [p.info for p in self.peers()] for m in info.models
                 if m.model_id == model_id]
        card = self.card(model_id)
        if card is None and not sizes:
            raise UnknownModelError(model_id, self.catalog.suggest(model_id))
        return model_requirement(model_id, card, sizes)

    def card(self, model_id: str) -> ModelCard | None:
        try:
            return self.catalog.get(model_id)
        except (UnknownModelError, LookupError):
            return None

    def model_id(self, ref: str) -> str:
        """A request's model reference -> a model id known somewhere in the cluster (may read the disk: callers
        run it in a worker thread; the part that reads the cluster's view runs on the loop)."""
        try:
            return self.models.resolve(ref).model_id
        except ModelNotAvailableError:
            card = self.card(ref)
            if card is not None:
                return card.id
            raise
        except UnknownModelError:
            found = self.on_loop(self._known_in_cluster, ref)
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

    def on_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the event loop's thread (at once when called there, or before the loop is known)."""
        loop = self.loop
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

    # -- what /v1/cluster and /v1/instances show ----------------------------------------------------------------
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
        self.gone = {k: v for k, v in self.gone.items() if now - v[0] < GONE_KEPT_S}
        views = self._views()
        listed = {instance_id for instance_id, _ in views}
        return [view for _, view in views] + [view for iid, (_, view) in self.gone.items() if iid not in listed]

    def instance_view(self, instance_id: str) -> dict[str, Any]:
        for iid, view in self._views():
            if iid == instance_id:
                return view
        if instance_id in self.gone:
            return self.gone[instance_id][1]
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
