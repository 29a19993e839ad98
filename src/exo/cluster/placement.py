"""Placement: which node runs a model, or which layers run on which nodes. A pure function of the model's
size and the nodes' memory (and the links between them).

A model fits on a node when its weights plus headroom fit in the node's available memory: the KV cache
of ``CONTEXT_BUDGET_TOKENS`` tokens of context (at most the model's context length; only the
full-attention layers grow with the context) and a fixed ``ACTIVATION_MARGIN_BYTES`` for activations
and the MTP head's cache. Memory promised to instances still loading on a node is not yet counted in
its available memory, so it is subtracted here. Among the nodes that hold the weights on disk and have
room, the one with the most free memory wins.

A model whose weights a node lacks can still go there when it can be downloaded (``downloadable``: a
card's Hugging Face repo) and the node can download it (``can_download``: not offline) with room on its
disk for what it would fetch (``download_room_bytes``: the free disk of its Hugging Face cache, less what
a download keeps free). Fewest nodes first, then the fewest nodes that must download, then memory: a
model that fits one node goes to a node that holds it if one has room, else to one that downloads it; a
pipeline takes as many holders as a split that fits allows. Each stage's node downloads only its stage's
files (``ModelRequirement.stage_weight_bytes`` estimates them).

When no node can hold the model (or ``min_nodes`` asks for more), it is pipelined over the fewest nodes
that hold it: the nodes with the most free memory, ordered along the fastest links (the last stage leads:
it talks to the API), contiguous layer ranges in proportion to what each node has left once the parts
that are not layers are counted (the embedding table on the first stage; the final norm, lm_head, the
MTP head and the embedding table, which the head needs, on the last; every stage's activation margin),
largest remainder, at least one layer each. ``nodes`` names the stages exactly, in order.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from exo.cards import ModelCard
from exo.cards.schema import ACTIVATION_MARGIN_BYTES, CONTEXT_BUDGET_TOKENS
from exo.wire.errors import (  # placement's errors live with the error table
    AlreadyPlacedError,
    InvalidPlacementRequest,
    ModelNotOnDiskError,
    NoDiskRoomError,
    NoPlacementError,
    PlacementError,
    TensorShardingRefusedError,
    TooFewNodesError,
    UnknownNodeError,
)

LIVE_STATES = frozenset({"loading", "ready"})
MAX_ORDERED_EXHAUSTIVELY = 7  # stages ordered by trying every order up to this many nodes, greedily beyond


@dataclass(frozen=True)
class ModelRequirement:
    model_id: str
    weights_bytes: int
    kv_bytes_per_token: int
    context_tokens: int
    activation_bytes: int = ACTIVATION_MARGIN_BYTES
    n_layers: int = 0
    # What a pipeline stage holds, when known from the checkpoint's tensors (else the weights are spread
    # evenly over the layers): each layer's weights, the embedding table, final norm + lm_head, MTP head.
    layer_bytes: tuple[int, ...] = ()
    embed_bytes: int = 0
    output_bytes: int = 0
    mtp_bytes: int = 0
    full_attention_interval: int = 4
    downloadable: bool = False  # the weights can be fetched (a card's Hugging Face repo)
    # Tensor sharding: the node counts the checkpoint's heads and widths allow (None: not known, as before a node
    # has read its config: any count the card allows, the runners check), and the card's refusal (None: allowed).
    tensor_node_counts: tuple[int, ...] | None = None
    tensor_refusal: str | None = None
    active_bytes: int = 0  # weight bytes a decode step reads (0: not known, take weights_bytes)

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.context_tokens

    @property
    def needed_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes

    @classmethod
    def from_card(
        cls,
        card: ModelCard,
        *,
        weights_bytes: int | None = None,
        context_budget: int = CONTEXT_BUDGET_TOKENS,
    ) -> ModelRequirement:
        """``weights_bytes``: the checkpoint's size on disk when known, else the card's storage_bytes. The parts
        that are not layers are estimated from the card (``estimate_parts``) until a node's checkpoint
        headers say what they are (``cluster_view.model_requirement`` then replaces them)."""
        kv = card.kv_bytes_per_token() if card.head_dim is not None else 0
        weights = weights_bytes if weights_bytes is not None else card.storage_bytes
        embed, output, mtp = estimate_parts(card, weights)
        refusal = None if card.tensor_sharding else (
            f"the model card of {card.id} forbids tensor sharding (tensor_sharding = false: exo's sharding rules do "
            "not cover its architecture); use \"sharding\": \"pipeline\"")
        return cls(
            model_id=card.id,
            weights_bytes=weights,
            kv_bytes_per_token=kv,
            context_tokens=min(card.context_length, context_budget),
            n_layers=card.n_layers,
            embed_bytes=embed,
            output_bytes=output,
            mtp_bytes=mtp,
            full_attention_interval=card.full_attention_interval,
            downloadable=card.repo is not None,
            tensor_refusal=refusal,
        )

    # -- a stage's share ----------------------------------------------------------------------------------
    def _layer_weights(self) -> list[float]:
        if self.layer_bytes and len(self.layer_bytes) == self.n_layers:
            return [float(b) for b in self.layer_bytes]
        rest = max(0, self.weights_bytes - self.embed_bytes - self.output_bytes - self.mtp_bytes)
        return [rest / max(1, self.n_layers)] * self.n_layers

    def _kv_per_attention_layer(self) -> float:
        attention_layers = self.n_layers // max(1, self.full_attention_interval)
        return self.kv_bytes / attention_layers if attention_layers else 0.0

    def layer_cost(self, layer: int) -> float:
        """Bytes layer ``layer`` needs: its weights and, for a full-attention layer, its KV cache."""
        attention = (layer + 1) % max(1, self.full_attention_interval) == 0
        return self._layer_weights()[layer] + (self._kv_per_attention_layer() if attention else 0.0)

    def fixed_bytes(self, first: bool, last: bool) -> int:
        """What a stage needs besides its layers."""
        total = self.activation_bytes
        if first or last:  # the last stage's MTP head embeds tokens too
            total += self.embed_bytes
        if last:
            total += self.output_bytes + self.mtp_bytes
        return total

    def stage_bytes(self, start: int, end: int) -> int:
        first, last = start == 0, end == self.n_layers
        return int(self.fixed_bytes(first, last) + sum(self.layer_cost(i) for i in range(start, end)))

    def tensor_member_bytes(self, members: int, leader: bool) -> int:
        """What a tensor group's member needs: its 1/members of every layer's weights and of the KV cache, the
        embedding table (every member embeds), the activation margin; the leader the output and MTP head too."""
        layers = max(0, self.weights_bytes - self.embed_bytes - self.output_bytes - self.mtp_bytes)
        total = (layers + self.kv_bytes) / members + self.embed_bytes + self.activation_bytes
        if leader:
            total += self.output_bytes + self.mtp_bytes
        return int(total)

    def stage_weight_bytes(self, start: int, end: int) -> int:
        """The weights a stage holds, about what its node downloads (shards are fetched whole)."""
        if (start, end) == (0, self.n_layers):
            return self.weights_bytes
        first, last = start == 0, end == self.n_layers
        total = sum(self._layer_weights()[start:end])
        if first or last:
            total += self.embed_bytes
        if last:
            total += self.output_bytes + self.mtp_bytes
        return int(total)


def estimate_parts(card: ModelCard, weights_bytes: int) -> tuple[int, int, int]:
    """(embedding, final norm + lm_head, MTP head) bytes of a checkpoint no node has read yet, from its card:
    the embedding and lm_head are vocab x hidden weights at the card's quantization (each counted: a tied
    lm_head only over-reserves), the MTP head its layers at the size of an average layer plus its input
    projection (2H x H). The layers share what is left of ``weights_bytes`` (the head counted among them);
    a card whose parts would take more than half the weights (an inconsistent card) has them scaled down
    to half."""
    per_weight = card.bytes_per_weight
    table = card.vocab * card.hidden_size * per_weight
    embed = table
    output = table + 2 * card.hidden_size
    mtp_layers = card.native_mtp.num_layers if card.native_mtp is not None else 0
    layer = max(0.0, weights_bytes - embed - output) / (card.n_layers + mtp_layers)
    mtp = mtp_layers * layer + (2 * card.hidden_size * card.hidden_size * per_weight if mtp_layers else 0.0)
    parts = embed + output + mtp
    if parts > weights_bytes / 2:
        scale = weights_bytes / 2 / parts
        embed, output, mtp = embed * scale, output * scale, mtp * scale
    return int(embed), int(output), int(mtp)


@dataclass(frozen=True)
class NodeCapacity:
    node_id: str
    memory_available_bytes: int
    memory_total_bytes: int
    name: str = ""
    models: frozenset[str] | None = None  # models whose weights are on the node's disk; None: unknown
    can_download: bool = False  # fetches missing weights from the hub (not offline)
    download_room_bytes: int = 0  # free disk for downloads, less what a download keeps free
    backend: str = ""  # MLX's: metal | cuda | cpu (a tensor group's collectives follow it)
    decode_bytes_per_s: float = 0.0  # measured by the node's runners (0: not yet): the speed estimates' unit


@dataclass(frozen=True)
class ExistingInstance:
    instance_id: str
    model_id: str
    node_id: str
    state: str  # loading | ready | failed | stopping | gone
    reserved_bytes: int = 0  # memory it will take that the node's available memory does not show yet


@dataclass(frozen=True)
class ShardAssignment:
    """One stage: layers [start_layer, end_layer) on ``node_id``, rank ``rank`` of ``world_size``."""

    node_id: str
    start_layer: int
    end_layer: int
    rank: int = 0
    world_size: int = 1


@dataclass(frozen=True)
class Placement:
    model_id: str
    node_id: str  # the node that serves the instance's generations (the last stage of a pipeline)
    requirement: ModelRequirement
    node_free_bytes: int  # the chosen node's free memory before this model
    shards: tuple[ShardAssignment, ...] = field(default=())
    # Per stage (in rank order): its node's free memory before this model, and what the stage needs.
    stage_free_bytes: tuple[int, ...] = ()
    stage_needed_bytes: tuple[int, ...] = ()
    # Per stage (in rank order): whether its node must download the weights (its stage's files) first.
    stage_downloads: tuple[bool, ...] = ()
    # How the model is split: "none" (one node), "pipeline" (by layers) or "tensor" (a slice of every layer on
    # every member: its shards all hold layers 0..n); a tensor group's collectives' backend (ring | nccl | jaccl), or a
    # pipeline's group's ("" the ring; nccl: two stages on CUDA nodes, ``pipeline_backend_for``).
    sharding: str = "none"
    backend: str = ""
    # What placement weighed (``sharding`` "auto", and the preview): every split it considered, estimated.
    options: tuple[PlacementOption, ...] = ()

    @property
    def headroom_bytes(self) -> int:
        if self.pipelined:
            return min(f - n for f, n in zip(self.stage_free_bytes, self.stage_needed_bytes, strict=True))
        return self.node_free_bytes - self.requirement.needed_bytes

    @property
    def pipelined(self) -> bool:
        """Spread over several nodes (a pipeline or a tensor group: one runner per member)."""
        return len(self.shards) > 1

    @property
    def stages(self) -> tuple[ShardAssignment, ...]:
        return self.shards


@dataclass(frozen=True)
class PlacementOption:
    """One way placement considered to split a model (``Placement.options``): its placement, or why it cannot
    be; its estimated decode speed (``estimate_tokens_per_s``)."""

    sharding: str  # "pipeline" (one node or a pipeline: what placement chooses by default) | "tensor"
    placement: Placement | None
    error: str | None = None
    tokens_per_s: float | None = None
    basis: str = ""  # "measured": every node's decode speed was measured; else "nominal" (docs/cluster.md)


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


SHARDINGS = ("pipeline", "tensor", "auto")
TENSOR_BACKENDS = ("auto", "ring", "nccl", "jaccl")


def placement(
    model: ModelCard | ModelRequirement,
    nodes: Sequence[NodeCapacity],
    existing: Sequence[ExistingInstance] = (),
    *,
    node: str | None = None,
    nodes_in_order: Sequence[str] | None = None,
    min_nodes: int = 1,
    links: Mapping[tuple[str, str], float] | None = None,
    replica: bool = False,
    sharding: str = "pipeline",
    tensor_backend: str = "auto",
) -> Placement:
    """Where ``model`` runs, or raises a ``PlacementError`` saying why it cannot.

    ``node``: only this node (an id). ``nodes_in_order``: exactly these nodes, as the pipeline's stages
    in this order. ``min_nodes``: spread over at least this many nodes even if fewer would do.
    ``existing``: the cluster's instances; one of the same model that is loading or ready means the model
    is already placed (AlreadyPlacedError). ``links``: round-trip times (ms) between node ids, to order
    the stages along the fastest links. ``replica``: place another instance of a model that has one (the
    memory the others take still counts).

    ``sharding``: "pipeline" (the default: one node when the model fits, else layers over the fewest nodes),
    "tensor" (a slice of every layer on each of at least two nodes, ``nodes_in_order`` or the fewest the model's
    heads allow) or "auto" (both estimated, ``estimate_tokens_per_s``: the faster; ``Placement.options`` says
    what each would do). ``tensor_backend``: a tensor group's collectives (auto: NCCL where every member is a CUDA
    node, else the TCP ring).
    """
    req = model if isinstance(model, ModelRequirement) else ModelRequirement.from_card(model)
    if sharding not in SHARDINGS:
        raise InvalidPlacementRequest(f"sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    if tensor_backend not in TENSOR_BACKENDS:
        raise InvalidPlacementRequest(f"the tensor backend must be one of {', '.join(TENSOR_BACKENDS)}, got {tensor_backend!r}")
    if node is not None and (nodes_in_order or min_nodes > 1):
        raise InvalidPlacementRequest("`node` places on one node; use `nodes` (or `min_nodes`) for a pipeline")
    if min_nodes < 1:
        raise InvalidPlacementRequest(f"min_nodes must be >= 1, got {min_nodes}")
    for inst in existing:
        if inst.model_id == req.model_id and inst.state in LIVE_STATES and not replica:
            raise AlreadyPlacedError(inst)
    known = [n.node_id for n in nodes]
    if node is not None and node not in known:
        raise UnknownNodeError(node, known)
    for node_id in nodes_in_order or ():
        if node_id not in known:
            raise UnknownNodeError(node_id, known)
    if sharding == "pipeline":
        return _by_layers(req, nodes, existing, node, nodes_in_order, min_nodes, links)
    if sharding == "tensor":
        return _tensor(req, nodes, existing, node, nodes_in_order, min_nodes, links, tensor_backend)
    options = placement_options(req, nodes, existing, node=node, nodes_in_order=nodes_in_order, min_nodes=min_nodes,
                                links=links, tensor_backend=tensor_backend)
    placed = [o for o in options if o.placement is not None]
    if not placed:
        return _by_layers(req, nodes, existing, node, nodes_in_order, min_nodes, links)  # (raises its reason)
    best = max(placed, key=lambda o: (o.tokens_per_s or 0.0, o.sharding == "pipeline"))
    assert best.placement is not None
    return dataclasses.replace(best.placement, options=tuple(options))


def placement_options(
    model: ModelCard | ModelRequirement, nodes: Sequence[NodeCapacity], existing: Sequence[ExistingInstance] = (),
    *, node: str | None = None, nodes_in_order: Sequence[str] | None = None, min_nodes: int = 1,
    links: Mapping[tuple[str, str], float] | None = None, tensor_backend: str = "auto",
) -> list[PlacementOption]:
    """Both ways to split ``model`` (what "pipeline" and "tensor" would place, or why they cannot), each with its
    estimated decode speed: what ``sharding`` "auto" chooses from and the preview shows. Errors of the request
    itself (an unknown node, a contradiction) are raised, not listed."""
    req = model if isinstance(model, ModelRequirement) else ModelRequirement.from_card(model)
    by_id = {n.node_id: n for n in nodes}
    out = []
    for kind in ("pipeline", "tensor"):
        try:
            if kind == "pipeline":
                plan = _by_layers(req, nodes, existing, node, nodes_in_order, min_nodes, links)
            else:
                plan = _tensor(req, nodes, existing, node, nodes_in_order, min_nodes, links, tensor_backend)
        except (UnknownNodeError, AlreadyPlacedError):
            raise
        except PlacementError as e:
            out.append(PlacementOption(kind, None, str(e)))
            continue
        speed, basis = estimate_tokens_per_s(plan, by_id, links)
        out.append(PlacementOption(kind, plan, None, speed, basis))
    return out


def _by_layers(req: ModelRequirement, nodes: Sequence[NodeCapacity], existing: Sequence[ExistingInstance],
               node: str | None, nodes_in_order: Sequence[str] | None, min_nodes: int,
               links: Mapping[tuple[str, str], float] | None) -> Placement:
    """One node when the model fits (and ``min_nodes`` is 1), else a pipeline: what placement did before tensor
    sharding, and still does by default."""
    known = [n.node_id for n in nodes]
    free = _free_memory(nodes, existing)
    if nodes_in_order:
        return _exact(req, nodes, free, list(nodes_in_order), min_nodes)
    if node is not None:
        nodes = [n for n in nodes if n.node_id == node]
        if not nodes:
            raise UnknownNodeError(node, known)
    holders = sorted((n for n in nodes if _holds(n, req)), key=lambda n: (-free[n.node_id], n.node_id))
    fetchers = sorted((n for n in nodes if not _holds(n, req) and _may_download(n, req)),
                      key=lambda n: (-free[n.node_id], n.node_id))
    if not holders and not fetchers:
        where = f"node {node}" if node is not None else "any node of the cluster"
        raise ModelNotOnDiskError(_not_on_disk(req, where, nodes), needed_bytes=req.needed_bytes)
    short_of_disk: list[str] = []
    if min_nodes == 1:
        for candidates, download in ((holders, False), (fetchers, True)):
            for n in candidates:  # most free memory first
                if free[n.node_id] < req.needed_bytes:
                    break
                if download and n.download_room_bytes < req.weights_bytes:
                    short_of_disk.append(_disk_short(n, req.weights_bytes))
                    continue
                shard = ShardAssignment(n.node_id, 0, req.n_layers, 0, 1)
                return Placement(req.model_id, n.node_id, req, free[n.node_id], (shard,), stage_downloads=(download,))
    ranked = sorted([*holders, *fetchers], key=lambda n: (-free[n.node_id], n.node_id))
    best = ranked[0]
    hold = "hold its weights" + (" or can download them" if fetchers else "")
    single_failure = _no_room_message(req, best, free[best.node_id])
    if node is not None or len(ranked) < 2 or req.n_layers < 2:
        if min_nodes > 1:
            raise TooFewNodesError(
                f"{req.model_id} was asked to spread over {min_nodes} nodes, but "
                f"{_count(len(ranked), 'node')} of the cluster {hold}",
                needed_bytes=req.needed_bytes,
            )
        _raise_if_short_of_disk(req, short_of_disk)
        raise NoPlacementError(single_failure, needed_bytes=req.needed_bytes, best_node=best.node_id,
                               best_free_bytes=free[best.node_id])
    if min_nodes > len(ranked) or min_nodes > req.n_layers:
        raise TooFewNodesError(
            f"{req.model_id} was asked to spread over {min_nodes} nodes, but "
            f"{_count(len(ranked), 'node')} of the cluster {hold}"
            + (f" and it has {req.n_layers} layers" if min_nodes > req.n_layers else ""),
            needed_bytes=req.needed_bytes,
        )
    for k in range(max(2, min_nodes), min(len(ranked), req.n_layers) + 1):
        # As many holders as possible: each node that downloads is time before the first token.
        for h in range(min(k, len(holders)), max(0, k - len(fetchers)) - 1, -1):
            picked = sorted([*holders[:h], *fetchers[: k - h]], key=lambda n: (-free[n.node_id], n.node_id))
            chosen = _order_along_links(picked, links)
            stages = _split(req, [free[n.node_id] for n in chosen])
            if stages is None:
                continue
            downloads = tuple(not _holds(n, req) for n in chosen)
            short = [_disk_short(n, req.stage_weight_bytes(a, b))
                     for n, (a, b), d in zip(chosen, stages, downloads, strict=True)
                     if d and n.download_room_bytes < req.stage_weight_bytes(a, b)]
            if short:
                short_of_disk += short
                continue
            return _pipeline(req, chosen, free, stages, downloads)
    _raise_if_short_of_disk(req, short_of_disk)
    total = sum(free[n.node_id] for n in ranked)
    spread_needed = req.needed_bytes + (len(ranked) - 1) * req.activation_bytes + req.embed_bytes
    raise NoPlacementError(
        f"{single_failure}; spread over all {_count(len(ranked), 'node')} that "
        f"{'hold it' if not fetchers else 'hold it or can download it'} "
        f"({gib(total)} free in all) it needs about {gib(spread_needed)}: add a node or free memory",
        needed_bytes=req.needed_bytes,
        best_node=best.node_id,
        best_free_bytes=free[best.node_id],
    )


def _holds(node: NodeCapacity, req: ModelRequirement) -> bool:
    return node.models is None or req.model_id in node.models


def _may_download(node: NodeCapacity, req: ModelRequirement) -> bool:
    return req.downloadable and node.can_download


def _not_on_disk(req: ModelRequirement, where: str, nodes: Sequence[NodeCapacity]) -> str:
    """Why no node can have the weights: nobody has them, and they cannot be downloaded (no repo) or the
    nodes are offline. Names what to run."""
    names = ", ".join(_label(n) for n in nodes) or "none"
    if req.downloadable:
        return (f"{req.model_id} is not on the disk of {where}, and the nodes are offline (EXO_OFFLINE / "
                f"HF_HUB_OFFLINE): run `exo pull {req.model_id}` where the hub can be reached, or unset them "
                f"(nodes: {names})")
    return (f"{req.model_id} is not on the disk of {where}: download it there first "
            f"(`exo pull {req.model_id}`) (nodes: {names})")


def _disk_short(node: NodeCapacity, needed: int) -> str:
    return f"node {_label(node)} has {gib(node.download_room_bytes)} of disk to download into, it needs {gib(needed)}"


def _raise_if_short_of_disk(req: ModelRequirement, short: list[str]) -> None:
    if short:
        raise NoDiskRoomError(
            f"{req.model_id} is not on the disk of the nodes with room for it, and they lack the disk to "
            f"download it: {'; '.join(dict.fromkeys(short))} (free disk, or point HF_HOME at a larger one)",
            needed_bytes=req.needed_bytes,
        )


def _free_memory(nodes: Sequence[NodeCapacity], existing: Sequence[ExistingInstance]) -> dict[str, int]:
    reserved: dict[str, int] = {}
    for inst in existing:
        if inst.state == "loading":
            reserved[inst.node_id] = reserved.get(inst.node_id, 0) + inst.reserved_bytes
    return {n.node_id: max(0, n.memory_available_bytes - reserved.get(n.node_id, 0)) for n in nodes}


def _exact(req: ModelRequirement, nodes: Sequence[NodeCapacity], free: dict[str, int], order: list[str],
           min_nodes: int) -> Placement:
    by_id = {n.node_id: n for n in nodes}
    for node_id in order:
        if node_id not in by_id:
            raise UnknownNodeError(node_id, by_id)
    if len(set(order)) != len(order):
        raise InvalidPlacementRequest(f"nodes lists a node twice: {', '.join(order)}")
    if len(order) < min_nodes:
        raise TooFewNodesError(
            f"min_nodes is {min_nodes} but nodes lists {_count(len(order), 'node')}", needed_bytes=req.needed_bytes
        )
    if len(order) > max(1, req.n_layers):
        raise TooFewNodesError(
            f"{req.model_id} has {req.n_layers} layers: it cannot be spread over {len(order)} nodes",
            needed_bytes=req.needed_bytes,
        )
    chosen = [by_id[i] for i in order]
    lacking = [n for n in chosen if not _holds(n, req) and not _may_download(n, req)]
    if lacking:
        where = ", ".join("node " + _label(n) for n in lacking)
        raise ModelNotOnDiskError(_not_on_disk(req, where, lacking), needed_bytes=req.needed_bytes)
    downloads = tuple(not _holds(n, req) for n in chosen)
    if len(chosen) == 1:
        n = chosen[0]
        if free[n.node_id] < req.needed_bytes:
            raise NoPlacementError(_no_room_message(req, n, free[n.node_id]), needed_bytes=req.needed_bytes,
                                   best_node=n.node_id, best_free_bytes=free[n.node_id])
        if downloads[0] and n.download_room_bytes < req.weights_bytes:
            _raise_if_short_of_disk(req, [_disk_short(n, req.weights_bytes)])
        return Placement(req.model_id, n.node_id, req, free[n.node_id], (ShardAssignment(n.node_id, 0, req.n_layers),),
                         stage_downloads=downloads)
    stages = _split(req, [free[n.node_id] for n in chosen])
    if stages is None:
        stages = _split(req, [free[n.node_id] for n in chosen], force=True)
        assert stages is not None
        short = [
            f"stage {rank} on node {_label(n)} needs {gib(req.stage_bytes(a, b))} "
            f"(layers {a}-{b - 1}) but has {gib(free[n.node_id])}"
            for rank, (n, (a, b)) in enumerate(zip(chosen, stages, strict=True))
            if req.stage_bytes(a, b) > free[n.node_id]
        ]
        raise NoPlacementError(
            f"{req.model_id} does not fit on {', '.join(order)}: " + "; ".join(short),
            needed_bytes=req.needed_bytes,
        )
    _raise_if_short_of_disk(req, [
        f"stage {rank}: " + _disk_short(n, req.stage_weight_bytes(a, b))
        for rank, (n, (a, b), d) in enumerate(zip(chosen, stages, downloads, strict=True))
        if d and n.download_room_bytes < req.stage_weight_bytes(a, b)
    ])
    return _pipeline(req, chosen, free, stages, downloads)


def _split(req: ModelRequirement, free: Sequence[int], force: bool = False) -> list[tuple[int, int]] | None:
    """Contiguous layer ranges, one per node in order, in proportion to what each node has left for
    layers (largest remainder, at least one layer each); None when some stage does not fit (``force``:
    the split anyway)."""
    n, k = req.n_layers, len(free)
    if k > n:
        return None
    room = [max(0.0, f - req.fixed_bytes(i == 0, i == k - 1)) for i, f in enumerate(free)]
    total = sum(room)
    if total <= 0:
        if not force:
            return None
        room, total = [1.0] * k, float(k)
    shares = [n * r / total for r in room]
    counts = [max(1, int(s)) for s in shares]
    while sum(counts) > n:  # the minimum of one layer took layers from the others
        i = max((i for i in range(k) if counts[i] > 1), key=lambda i: counts[i] - shares[i])
        counts[i] -= 1
    order = sorted(range(k), key=lambda i: (-(shares[i] - int(shares[i])), i))
    for i in itertools.islice(itertools.cycle(order), n - sum(counts)):
        counts[i] += 1
    stages, start = [], 0
    for c in counts:
        stages.append((start, start + c))
        start += c
    if not force and any(req.stage_bytes(a, b) > f for (a, b), f in zip(stages, free, strict=True)):
        return None
    return stages


def _order_along_links(nodes: list[NodeCapacity], links: Mapping[tuple[str, str], float] | None) -> list[NodeCapacity]:
    """The order of the stages: the path through the nodes with the smallest total round-trip time (a ring
    closes last -> first too: the leader sends each step to the first stage). Without link figures, or
    on ties, the order by free memory stands."""
    if not links or len(nodes) < 2:
        return nodes

    def rtt(a: NodeCapacity, b: NodeCapacity) -> float:
        return links.get((a.node_id, b.node_id), links.get((b.node_id, a.node_id), 0.0))

    def cost(path: Sequence[NodeCapacity]) -> float:
        return sum(rtt(a, b) for a, b in itertools.pairwise(path)) + rtt(path[-1], path[0])

    if len(nodes) <= MAX_ORDERED_EXHAUSTIVELY:
        return list(min(itertools.permutations(nodes), key=lambda p: (round(cost(p), 6), [n.node_id for n in p])))
    path, rest = [nodes[0]], nodes[1:]
    while rest:
        following = min(rest, key=lambda n: (rtt(path[-1], n), n.node_id))
        path.append(following)
        rest.remove(following)
    return path


def _pipeline(req: ModelRequirement, chosen: Sequence[NodeCapacity], free: dict[str, int],
              stages: list[tuple[int, int]], downloads: tuple[bool, ...]) -> Placement:
    k = len(chosen)
    shards = tuple(ShardAssignment(n.node_id, a, b, rank, k) for rank, (n, (a, b)) in enumerate(zip(chosen, stages, strict=True)))
    leader = chosen[-1]
    return Placement(
        req.model_id, leader.node_id, req, free[leader.node_id], shards,
        stage_free_bytes=tuple(free[n.node_id] for n in chosen),
        stage_needed_bytes=tuple(req.stage_bytes(a, b) for a, b in stages),
        stage_downloads=downloads,
        sharding="pipeline", backend=pipeline_backend_for(chosen),
    )


def pipeline_backend_for(nodes: Sequence[NodeCapacity], wire: str | None = None) -> str:
    """A pipeline's group backend: "nccl" for two stages on CUDA nodes, whose steps then cross on the collective wire
    (``engine.pipeline.WIRE_COLLECTIVE``: device to device; on 2 x H200 a 9B over 2 stages ran 0.76-1.00x one GPU on
    it against 0.50-0.63x on the graph wire, docs/performance.md), unless ``wire`` (``EXO_PIPELINE_WIRE`` of the placing
    daemon: None, look) asks for another wire; else "" (MLX's ring, every wire)."""
    wire = wire if wire is not None else os.environ.get("EXO_PIPELINE_WIRE", "auto")
    if wire in ("auto", "collective") and len(nodes) == 2 and all(n.backend == "cuda" for n in nodes):
        return "nccl"
    return ""


# -- tensor groups ---------------------------------------------------------------------------------------------
MAX_TENSOR_NODES = 8  # (as engine.sharding's: the node counts a checkpoint reports go up to it)


def _tensor(req: ModelRequirement, nodes: Sequence[NodeCapacity], existing: Sequence[ExistingInstance],
            node: str | None, nodes_in_order: Sequence[str] | None, min_nodes: int,
            links: Mapping[tuple[str, str], float] | None, tensor_backend: str) -> Placement:
    """A tensor group: ``nodes_in_order`` (the last leads), else the fewest nodes (at least two, at least
    ``min_nodes``, a count the model's heads allow) with room for a member each, holders of the weights first, in
    the order of the fastest ring with the node of most free memory leading (it holds the output and MTP head too).
    Every member reads (and a member without them downloads) the whole checkpoint."""
    if req.tensor_refusal:
        raise TensorShardingRefusedError(req.tensor_refusal)
    if node is not None:
        raise InvalidPlacementRequest("`node` places on one node; tensor sharding spreads over several (`nodes` or "
                                      "`min_nodes`)")
    counts = req.tensor_node_counts if req.tensor_node_counts is not None else tuple(range(2, MAX_TENSOR_NODES + 1))
    known = "" if req.tensor_node_counts is not None else " (as far as placement knows: the runners check the checkpoint)"
    free = _free_memory(nodes, existing)
    if nodes_in_order:
        by_id = {n.node_id: n for n in nodes}
        order = list(nodes_in_order)
        if len(set(order)) != len(order):
            raise InvalidPlacementRequest(f"nodes lists a node twice: {', '.join(order)}")
        if len(order) < 2:
            raise TensorShardingRefusedError("tensor sharding splits a model over two nodes or more; `nodes` lists one")
        if len(order) < min_nodes:
            raise TooFewNodesError(f"min_nodes is {min_nodes} but nodes lists {_count(len(order), 'node')}",
                                   needed_bytes=req.needed_bytes)
        if len(order) not in counts:
            raise TensorShardingRefusedError(_counts_message(req, len(order), counts))
        chosen = [by_id[i] for i in order]
        lacking = [n for n in chosen if not _holds(n, req) and not _may_download(n, req)]
        if lacking:
            where = ", ".join("node " + _label(n) for n in lacking)
            raise ModelNotOnDiskError(_not_on_disk(req, where, lacking), needed_bytes=req.needed_bytes)
        short = _tensor_short(req, chosen, free)
        if short:
            raise NoPlacementError(f"{req.model_id} split by tensor does not fit on {', '.join(order)}: {short}",
                                   needed_bytes=req.needed_bytes)
        _raise_if_short_of_disk(req, [_disk_short(n, req.weights_bytes) for n in chosen
                                      if not _holds(n, req) and n.download_room_bytes < req.weights_bytes])
        return _tensor_plan(req, chosen, free, tensor_backend)
    holders = sorted((n for n in nodes if _holds(n, req)), key=lambda n: (-free[n.node_id], n.node_id))
    fetchers = sorted((n for n in nodes if not _holds(n, req) and _may_download(n, req)),
                      key=lambda n: (-free[n.node_id], n.node_id))
    if not holders and not fetchers:
        raise ModelNotOnDiskError(_not_on_disk(req, "any node of the cluster", nodes), needed_bytes=req.needed_bytes)
    sizes = [k for k in sorted(counts) if k >= max(2, min_nodes)]
    if not sizes:
        raise TensorShardingRefusedError(_counts_message(req, max(2, min_nodes), counts))
    ranked = sorted([*holders, *fetchers], key=lambda n: (-free[n.node_id], n.node_id))
    if len(ranked) < sizes[0]:
        raise TooFewNodesError(
            f"{req.model_id} split by tensor needs {sizes[0]} nodes{known}, but {_count(len(ranked), 'node')} of the "
            "cluster hold its weights or can download them", needed_bytes=req.needed_bytes)
    short_of_disk: list[str] = []
    best_short = ""
    for k in (k for k in sizes if k <= len(ranked)):
        for h in range(min(k, len(holders)), max(0, k - len(fetchers)) - 1, -1):
            picked = sorted([*holders[:h], *fetchers[: k - h]], key=lambda n: (-free[n.node_id], n.node_id))
            short = _tensor_short(req, _lead_richest(_order_along_links(picked, links), free), free)
            if short:
                best_short = best_short or short
                continue
            lacking = [_disk_short(n, req.weights_bytes) for n in picked
                       if not _holds(n, req) and n.download_room_bytes < req.weights_bytes]
            if lacking:
                short_of_disk += lacking
                continue
            return _tensor_plan(req, _lead_richest(_order_along_links(picked, links), free), free, tensor_backend)
    _raise_if_short_of_disk(req, short_of_disk)
    raise NoPlacementError(f"{req.model_id} split by tensor does not fit on the nodes of the cluster: {best_short}",
                           needed_bytes=req.needed_bytes, best_node=ranked[0].node_id,
                           best_free_bytes=free[ranked[0].node_id])


def _counts_message(req: ModelRequirement, k: int, counts: Sequence[int]) -> str:
    allowed = ", ".join(map(str, counts)) or "none"
    return (f"{req.model_id} cannot be split over {k} nodes by tensor: its attention and GatedDeltaNet heads and its "
            f"MLP widths divide among {allowed} nodes")


def _lead_richest(order: list[NodeCapacity], free: Mapping[str, int]) -> list[NodeCapacity]:
    """The ring's order rotated (the same ring) so that the node with the most free memory is last: it leads."""
    richest = max(range(len(order)), key=lambda i: (free[order[i].node_id], order[i].node_id))
    return order[richest + 1 :] + order[: richest + 1]


def _tensor_short(req: ModelRequirement, order: Sequence[NodeCapacity], free: Mapping[str, int]) -> str:
    """Which members of a tensor group in ``order`` lack the memory (empty: every one has room)."""
    k = len(order)
    short = [f"member {rank} on node {_label(n)} needs {gib(req.tensor_member_bytes(k, rank == k - 1))} but has "
             f"{gib(free[n.node_id])}"
             for rank, n in enumerate(order) if req.tensor_member_bytes(k, rank == k - 1) > free[n.node_id]]
    return "; ".join(short)


def tensor_backend_for(nodes: Sequence[NodeCapacity], setting: str = "auto") -> str:
    """A tensor group's collectives: the setting when it names one, else NCCL where every member runs MLX on CUDA,
    else the TCP ring (CPUs, Macs: JACCL over Thunderbolt 5 RDMA is chosen only by the setting)."""
    if setting != "auto":
        return setting
    return "nccl" if nodes and all(n.backend == "cuda" for n in nodes) else "ring"


def _tensor_plan(req: ModelRequirement, order: Sequence[NodeCapacity], free: Mapping[str, int], backend: str) -> Placement:
    k = len(order)
    shards = tuple(ShardAssignment(n.node_id, 0, req.n_layers, rank, k) for rank, n in enumerate(order))
    leader = order[-1]
    return Placement(
        req.model_id, leader.node_id, req, free[leader.node_id], shards,
        stage_free_bytes=tuple(free[n.node_id] for n in order),
        stage_needed_bytes=tuple(req.tensor_member_bytes(k, rank == k - 1) for rank in range(k)),
        stage_downloads=tuple(not _holds(n, req) for n in order),
        sharding="tensor", backend=tensor_backend_for(order, backend),
    )


# -- speed estimates ---------------------------------------------------------------------------------------------
# A decode step's time on a node is what its runners measured (``NodeCapacity.decode_bytes_per_s``: a single-node
# instance times its plain steps at warm-up; the weight bytes a step reads over that time) for the bytes it reads
# there. Only part of it shrinks when a tensor group splits every layer: reading the weights. The rest (building and
# dispatching the step's ops, launching kernels: on MLX's CPU backend and on a host-bound GPU most of a small
# model's step) is the same on every member, which runs every layer's ops on its slice. So a step's bytes are
# counted at the node's measured speed, and of that time the part the backend's peak bandwidth would take
# (``PEAK_BYTES_PER_S``, nominal) is what the members share; the remainder each member pays whole. A pipeline
# stage pays its layers' share of both, plus the ring of hops (half a measured round trip each); a tensor group
# pays the 2 x layers + 1 all-reduces of a token (on the TCP ring each about (N - 1) round trips of the ring's
# slowest link; NCCL and JACCL are not seen by the registry's round trips: ``NOMINAL_COLLECTIVE_S``). A node not
# measured yet counts at half its backend's peak, and the estimate says so (``basis``). Figures to order the
# choices, not promises: docs/cluster.md, bench/tensor.py (which prints this estimate beside the measured ratio).
PEAK_BYTES_PER_S = {"cuda": 3.3e12, "metal": 4.0e11, "cpu": 2.0e10}
# An all-reduce as a decode step meets it. NCCL: what a step pays beyond its compute, measured on two H200s of one
# host, MLX 0.32.4 CUDA, members with compiled layers and without CUDA graphs (``sharding.member_process_settings``):
# the 9B shape's group step 17.6 ms over 65 all-reduces a token, the 27B's 27.3 ms over 129, against this model's
# compute from one GPU's measured speed (131.8 / 73.4 tok/s): 167 / 125 us each, though one timed alone takes 45-99
# us and one of a chain 22 (bench/results/h200x2-mlx-cuda-defaults-rounds-tensor-cached-serving-9b-27b-2026-11-30.txt;
# with CUDA graphs in the members it was 0.97 ms). JACCL: nominal, unmeasured.
NOMINAL_COLLECTIVE_S = {"nccl": 1.5e-4, "jaccl": 5.0e-5}
UNKNOWN_RTT_MS = 1.0  # a link the registry has no round trip for


def estimate_tokens_per_s(plan: Placement, nodes: Mapping[str, NodeCapacity],
                          links: Mapping[tuple[str, str], float] | None = None) -> tuple[float, str]:
    """(estimated plain decode tokens/s of ``plan``, "measured" or "nominal"): see the comment above."""
    req = plan.requirement
    active = float(req.active_bytes or req.weights_bytes)
    output = float(min(req.output_bytes, active))
    layers = max(0.0, active - output)
    members = [s.node_id for s in plan.shards]
    measured = all(nodes.get(m, NodeCapacity(m, 0, 0)).decode_bytes_per_s > 0 for m in members)

    def parts(node_id: str, nbytes: float) -> tuple[float, float]:
        """(seconds a split shares: reading ``nbytes``, seconds every member pays whole) of ``nbytes`` there."""
        n = nodes.get(node_id)
        peak = PEAK_BYTES_PER_S.get(n.backend if n is not None else "", PEAK_BYTES_PER_S["cpu"])
        rate = n.decode_bytes_per_s if n is not None and n.decode_bytes_per_s > 0 else peak / 2
        total = nbytes / rate
        shared = min(total, nbytes / peak)
        return shared, total - shared

    def rtt_s(a: str, b: str) -> float:
        table = links or {}
        return table.get((a, b), table.get((b, a), UNKNOWN_RTT_MS)) / 1000.0

    k = len(members)
    ring = [rtt_s(members[i], members[(i + 1) % k]) for i in range(k)] if k > 1 else []
    if plan.sharding == "tensor":
        compute = max(parts(m, layers)[0] / k + parts(m, layers)[1] for m in members) + sum(parts(members[-1], output))
        collective = NOMINAL_COLLECTIVE_S.get(plan.backend, (k - 1) * max(ring))
        seconds = compute + (2 * req.n_layers + 1) * collective + sum(ring[:-1]) / 2  # (the header: a chain)
    elif k > 1:
        n = max(1, req.n_layers)
        seconds = sum(sum(parts(s.node_id, layers * (s.end_layer - s.start_layer) / n)) for s in plan.shards)
        seconds += sum(parts(members[-1], output)) + sum(ring) / 2
    else:
        seconds = sum(parts(members[0], active))
    return (1.0 / seconds if seconds > 0 else 0.0), ("measured" if measured else "nominal")


def _no_room_message(req: ModelRequirement, best: NodeCapacity, free: int) -> str:
    return (
        f"{req.model_id} does not fit: it needs {gib(req.needed_bytes)} (weights {gib(req.weights_bytes)} "
        f"+ KV cache for {req.context_tokens} tokens {gib(req.kv_bytes)} + activations "
        f"{gib(req.activation_bytes)}), but the most free memory is {gib(free)} on node {_label(best)}: "
        f"{gib(req.needed_bytes - free)} missing"
    )


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _label(node: NodeCapacity) -> str:
    return f"{node.name} ({node.node_id[:8]})" if node.name else node.node_id
