"""Placement: which node runs a model. A pure function of the model's size and the nodes' memory.

A model fits on a node when its weights plus headroom fit in the node's available memory: the KV cache
of ``CONTEXT_BUDGET_TOKENS`` tokens of context (at most the model's context length; only the
full-attention layers grow with the context) and a fixed ``ACTIVATION_MARGIN_BYTES`` for activations
and the MTP head's cache. Memory promised to instances still loading on a node is not yet counted in
its available memory, so it is subtracted here. Among the nodes that hold the weights on disk and have
room, the one with the most free memory wins. One node per model for now; the placement keeps a list
of shards (layers per rank) so that a pipeline can span several nodes later.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from exo.cards import ModelCard

CONTEXT_BUDGET_TOKENS = 32768
ACTIVATION_MARGIN_BYTES = 512 << 20
LIVE_STATES = frozenset({"loading", "ready"})


@dataclass(frozen=True)
class ModelRequirement:
    model_id: str
    weights_bytes: int
    kv_bytes_per_token: int
    context_tokens: int
    activation_bytes: int = ACTIVATION_MARGIN_BYTES
    n_layers: int = 0

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
        """``weights_bytes``: the checkpoint's size on disk when known, else the card's storage_bytes."""
        kv = card.kv_bytes_per_token() if card.head_dim is not None else 0
        return cls(
            model_id=card.id,
            weights_bytes=weights_bytes if weights_bytes is not None else card.storage_bytes,
            kv_bytes_per_token=kv,
            context_tokens=min(card.context_length, context_budget),
            n_layers=card.n_layers,
        )


@dataclass(frozen=True)
class NodeCapacity:
    node_id: str
    memory_available_bytes: int
    memory_total_bytes: int
    name: str = ""
    models: frozenset[str] | None = None  # models whose weights are on the node's disk; None: unknown


@dataclass(frozen=True)
class ExistingInstance:
    instance_id: str
    model_id: str
    node_id: str
    state: str  # loading | ready | failed | stopping | gone
    reserved_bytes: int = 0  # memory it will take that the node's available memory does not show yet


@dataclass(frozen=True)
class ShardAssignment:
    node_id: str
    start_layer: int
    end_layer: int
    rank: int = 0
    world_size: int = 1


@dataclass(frozen=True)
class Placement:
    model_id: str
    node_id: str
    requirement: ModelRequirement
    node_free_bytes: int  # the chosen node's free memory before this model
    shards: tuple[ShardAssignment, ...] = field(default=())

    @property
    def headroom_bytes(self) -> int:
        return self.node_free_bytes - self.requirement.needed_bytes


class PlacementError(Exception):
    """The model cannot be placed as asked."""


class NoPlacementError(PlacementError):
    """No node has room (or the weights); the message says what is missing."""

    def __init__(self, message: str, *, needed_bytes: int = 0, best_node: str | None = None, best_free_bytes: int = 0):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.best_node = best_node
        self.best_free_bytes = best_free_bytes


class ModelNotOnDiskError(NoPlacementError):
    """No node (or not the asked one) has the model's weights on its disk."""


class AlreadyPlacedError(PlacementError):
    def __init__(self, existing: ExistingInstance) -> None:
        super().__init__(
            f"{existing.model_id} already has instance {existing.instance_id} ({existing.state}) on node "
            f"{existing.node_id}; delete it first to place it elsewhere"
        )
        self.existing = existing


class UnknownNodeError(PlacementError):
    def __init__(self, node_id: str, known: Iterable[str]) -> None:
        known = sorted(known)
        super().__init__(f"no node {node_id!r} in the cluster; nodes: {', '.join(known) or 'none'}")
        self.node_id = node_id


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def placement(
    model: ModelCard | ModelRequirement,
    nodes: Sequence[NodeCapacity],
    existing: Sequence[ExistingInstance] = (),
    *,
    node: str | None = None,
) -> Placement:
    """Where ``model`` runs, or raises a ``PlacementError`` saying why it cannot.

    ``node``: only this node (an id). ``existing``: the cluster's instances; one of the same model
    that is loading or ready means the model is already placed (AlreadyPlacedError).
    """
    req = model if isinstance(model, ModelRequirement) else ModelRequirement.from_card(model)
    for inst in existing:
        if inst.model_id == req.model_id and inst.state in LIVE_STATES:
            raise AlreadyPlacedError(inst)
    if node is not None:
        known = [n.node_id for n in nodes]
        nodes = [n for n in nodes if n.node_id == node]
        if not nodes:
            raise UnknownNodeError(node, known)
    holders = [n for n in nodes if n.models is None or req.model_id in n.models]
    if not holders:
        where = f"node {node}" if node is not None else "any node of the cluster"
        raise ModelNotOnDiskError(
            f"{req.model_id} is not on the disk of {where}: download it there first "
            f"(nodes: {', '.join(_label(n) for n in nodes) or 'none'})",
            needed_bytes=req.needed_bytes,
        )
    reserved: dict[str, int] = {}
    for inst in existing:
        if inst.state == "loading":
            reserved[inst.node_id] = reserved.get(inst.node_id, 0) + inst.reserved_bytes
    ranked = sorted(
        ((max(0, n.memory_available_bytes - reserved.get(n.node_id, 0)), n) for n in holders),
        key=lambda pair: (-pair[0], pair[1].node_id),
    )
    free, best = ranked[0]
    if free < req.needed_bytes:
        raise NoPlacementError(
            f"{req.model_id} does not fit: it needs {gib(req.needed_bytes)} (weights {gib(req.weights_bytes)} "
            f"+ KV cache for {req.context_tokens} tokens {gib(req.kv_bytes)} + activations "
            f"{gib(req.activation_bytes)}), but the most free memory is {gib(free)} on node {_label(best)}: "
            f"{gib(req.needed_bytes - free)} missing",
            needed_bytes=req.needed_bytes,
            best_node=best.node_id,
            best_free_bytes=free,
        )
    shard = ShardAssignment(best.node_id, 0, req.n_layers, 0, 1)
    return Placement(req.model_id, best.node_id, req, free, (shard,))


def _label(node: NodeCapacity) -> str:
    return f"{node.name} ({node.node_id[:8]})" if node.name else node.node_id
