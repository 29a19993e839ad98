"""One model across several processes (machines) by tensor: every member holds a slice of every layer.

The members of a tensor group (``engine/sharding.py``: attention and GatedDeltaNet heads, MLP and expert
columns) run every step together, joined inside each layer by two all-reduces. The LAST member leads: it
holds the final norm, lm_head and the MTP head, runs the engine's one generation loop (``batch.py``, ``round.py``)
with a ``TensorForward`` as its backbone, and talks to the API. Every other member runs ``serve_tensor``, the
loop a pipeline's stages run (``pipeline.serve_member``) handed a ``TensorTransport``: it receives the leader's
step header (the same ``StepHeader`` and op records a pipeline's stages get: slots,
rollbacks, joins, filters, prefix-cache round trips), applies the cache operations to its own heads' caches,
and runs its slice of every layer on the step's ids, which it takes from the leader inside the step's graph
(``sharding.broadcast_ids``).

A round at depth K, N = 2::

    leader:   drafts d1..dK with the head (alone); sends the header (op records: the last round's rollback)
    member 0: applies the rollback to its own heads' KV and GatedDeltaNet state
    both:     ids = broadcast(pending, d1..dK); every layer on K + 1 rows, two all-reduces per layer
    leader:   final norm, logits, acceptance (alone); owes the rollback to the next header

The accept decision is the leader's alone and travels as the next header's ROLLBACK record, as in a
pipeline: only the leader computes logits (the other members hold no lm_head), so nothing else could decide,
and a decision sent is the same on every member by construction (logits computed on every member would have
to agree bit for bit on every machine for members deciding alone to stay in step). Each member rolls back its
own caches (``forward.keep_rows`` on its heads: attention KV trimmed, GatedDeltaNet state committed).

Per step what crosses the network: the 256-byte header to each member (a chain: leader -> 0 -> 1 ...), the ids
(B x rows int32, in a collective) and two all-reduces of [B, rows, H] per layer. The header goes out without
waiting for the ids (they are lazy: the drafts, the token a plain step samples), so the leader builds a step
while the previous one computes, as on one node.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx

from .forward import cache_rates, verify_call, verify_eval_every
from .models.backbone import SpeculativeBackbone
from .pipeline import (
    OP_GRAPH_FORWARD,
    OP_MEASURE,
    WIRE_GRAPH,
    WIRE_HOST,
    Link,
    PipelineForward,
    StageSlots,
    StageSpec,
    StepHeader,
    StepHeaderError,
    _one_exchange,
    _slot,
    _unpack_rates,
    serve_member,
)
from .prefix_cache import PrefixCache
from .sharding import broadcast_ids, collectives
from .verify import VerifyMode


class TensorGroupError(RuntimeError):
    """A member of the tensor group left (its doorbell closed): the group is formed anew."""


class TensorForward(PipelineForward):
    """The leader's (last member's) view of a tensor-sharded backbone: a ``Forward`` whose calls run every member.

    Cache lists carry a slot (``StageCaches``) and cache operations are owed to the other members in the next
    header, as ``PipelineForward`` does; a forward call sends its header, then builds this member's slice of the
    step (its collectives pair with every other member's) and starts evaluating it at once, so every member runs
    the same collectives in the same order whatever the loop does with the result.

    ``broken``: what a call raised, or a member's loss seen on its doorbell. A lost member first shows as an
    error of the collective (raised where the loop evaluates, outside any call): the device then asks
    ``broken``, which looks at the doorbells."""

    mode = "tensor"

    def __init__(self, model: SpeculativeBackbone, stage: StageSpec, link: Link,
                 verify: VerifyMode | None = None) -> None:
        share = getattr(model, "tensor_share", None)
        if share is None or not share.leader or share.size != stage.world_size:
            raise ValueError("TensorForward runs on the last member of a tensor group, its model sharded for it")
        super().__init__(model, stage, link, verify)
        self.wire, self.graph = WIRE_HOST, False  # its steps' inputs come in a collective (OP_GRAPH_FORWARD), not on a stage's wire

    @property
    def _watch_doorbells(self) -> bool:
        return True

    def _lost_error(self) -> BaseException:
        return TensorGroupError("a member of the tensor group left (its connection closed)")

    @_one_exchange
    def hidden(self, tokens: mx.array, cache: list[Any], *, verify: bool = False) -> mx.array:
        batch, rows = (int(n) for n in tokens.shape)
        if mx.default_device() == mx.cpu:
            # The other members would spin in the ids' collective while this one drafts (the ring backend's
            # receive polls): on a CPU the cores they take are the ones this member computes on.
            mx.eval(tokens)
        header = StepHeader.forward(self._next_step(), _slot(cache), batch, rows, self.verify if verify else None,
                                    self._take_ops(), invariant=self._invariant, op=OP_GRAPH_FORWARD)
        self._send_header(header)
        with collectives(self.model):
            ids = broadcast_ids(self.model, tokens, (batch, rows))
            if not verify:
                h = self.model.stage_hidden(ids, cache)
            else:
                with verify_call(self.model, cache, self.verify, batch * rows):
                    h = self.model.stage_hidden(ids, cache, eval_every=verify_eval_every())
        mx.async_eval(h)  # (a step the loop builds and drops, e.g. past a finished sequence, still runs everywhere)
        return h

    @_one_exchange
    def memory_rates(self) -> list[tuple[int, int]]:
        """Every member's (KV bytes per token, state bytes per sequence) of its slice, the leader's last."""
        self._send_header(StepHeader(OP_MEASURE, self._next_step(), ops=self._take_ops()))
        with collectives(self.model):
            mine = cache_rates(self.model)
        figures = self.link.recv((4 * (self.stages - 1),), mx.int32, self.stage.previous).tolist()
        return [*_unpack_rates(figures), mine]


class TensorTransport:
    """A tensor member's ``StepTransport``: the step's ids from the leader in a collective (``broadcast_ids``), the
    layers' own all-reduces on while they are built, nothing sent after (the leader has the sums already)."""

    member, group, forward_op = "tensor member", "tensor group", OP_GRAPH_FORWARD

    def __init__(self, model: SpeculativeBackbone) -> None:
        self.model = model

    @contextlib.contextmanager
    def layers(self, verify: VerifyMode | None) -> Iterator[None]:
        with collectives(self.model):
            yield

    def receive(self, header: StepHeader) -> mx.array:
        return broadcast_ids(self.model, None, (header.batch, header.rows))

    def outgoing(self, h: mx.array) -> mx.array:
        return h

    def send(self, h: mx.array) -> None:
        pass

    def send_op(self, h: mx.array, wire: int = WIRE_GRAPH) -> mx.array:
        raise StepHeaderError("a tensor group's steps never come on a stage's graph wire (OP_GRAPH_FORWARD)")


def serve_tensor(
    model: SpeculativeBackbone, member: StageSpec, link: Link, *, on_step: Callable[[], None] | None = None,
    slots: StageSlots | None = None, prefix_cache: PrefixCache | None = None,
) -> None:
    """A member of a tensor group that does not lead: ``serve_member`` (the loop a pipeline's stages run) with the
    step's ids in a collective, until the leader shuts the group down. ``prefix_cache``: this member's (its slice's
    part, under its own namespace). Raises what the link or a collective raises when a member is lost (the caller
    ends the process: the group is formed anew)."""
    serve_member(model, member, link, TensorTransport(model), on_step=on_step, slots=slots, prefix_cache=prefix_cache)
