"""One model across several processes (machines): pipeline stages, with native MTP.

Stage r of N holds layers [start_r, end_r). The LAST stage leads: it holds the final norm, lm_head, the
MTP head (and the embedding table the head needs), runs the engine's one generation loop
(``generate.py``) and talks to the API. Its ``PipelineForward`` is the loop's backbone: a forward call
sends a small step message to the first stage and receives the hidden states of the stage before it.
Every other stage runs ``serve_stage``: receive a step, roll back what the previous verify call did not
keep, run its layers, pass the hidden states on.

A round at depth K, N = 3 stages::

    stage 2 (leader): drafts d1..dK with the head; sends [header, pending + d1..dK] -> stage 0
    stage 0: rolls back the previous round (header.kept), embeds, runs its layers -> [header, h] -> stage 1
    stage 1: rolls back, runs its layers -> h -> stage 2
    stage 2: its layers, final norm, logits; decides acceptance; rolls back its own caches and the head's

So what crosses a stage boundary per round is the decision (the header: kept rows of the previous
round, the row count, the verify flag) with K + 1 token ids on the way to the first stage, and the hidden
states [K + 1, H] between consecutive stages. Nothing is gathered to every stage, logits never leave the
leader. Every stage rolls back its own attention KV and GatedDeltaNet state (``forward.keep_rows``).

No sockets here: the stages talk through a ``Link`` (send / recv of MLX arrays between ranks), which the
runner builds on ``mx.distributed`` (ring backend over TCP: ``exo.runner.group.RingLink``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from .forward import MOE_MODES, keep_rows, verify_call
from .models.backbone import SpeculativeBackbone
from .verify import VerifyMode

log = logging.getLogger(__name__)

# The step header: a fixed int32 [HEADER_LEN] message (``StepHeader``): 9 named fields, then up to INLINE_TOKENS
# token ids (a decode step's or a verify round's rows travel in the header itself: one message per step; a
# longer prefill chunk follows it). ``version`` changes with the layout; ``step`` counts the leader's messages
# since the group formed, so a stage that misses or repeats one stops instead of computing on the wrong input.
OP_FORWARD, OP_END, OP_SHUTDOWN = 1, 2, 3
HEADER_VERSION = 1
HEADER_FIELDS = 9
INLINE_TOKENS = 8
HEADER_LEN = HEADER_FIELDS + INLINE_TOKENS
NO_ROLLBACK = -1


class StepHeaderError(RuntimeError):
    """A step header this stage cannot act on (another version, a step out of order, an unknown op): the
    stages disagree about where they are, so the stage stops (its group is formed anew) rather than compute."""


@dataclass(frozen=True)
class StepHeader:
    """What the leader decided for one step, as every stage reads it. ``moe``: 0 for a plain step, else
    1 + the index of the verify call's MoE mode in ``MOE_MODES``; ``keep_rows``/``keep_kept``: the previous
    verify call's rows and how many of them to keep (``NO_ROLLBACK``: none owed); ``tokens``: the step's ids
    when ``rows <= INLINE_TOKENS`` (the first stage's input), else empty."""

    op: int
    step: int
    rows: int = 0
    verify: bool = False
    moe: int = 0
    per_row: bool = False
    keep_rows: int = NO_ROLLBACK
    keep_kept: int = NO_ROLLBACK
    tokens: tuple[int, ...] = ()
    version: int = HEADER_VERSION

    @classmethod
    def forward(cls, step: int, rows: int, verify: VerifyMode | None, rollback: tuple[int, int] | None,
                tokens: tuple[int, ...] = ()) -> StepHeader:
        keep, kept = rollback if rollback is not None else (NO_ROLLBACK, NO_ROLLBACK)
        moe = 0 if verify is None else MOE_MODES.index(verify.moe) + 1
        return cls(OP_FORWARD, step, rows, verify is not None, moe, bool(verify is not None and verify.per_row_attention),
                   keep, kept, tokens)

    def fields(self) -> list[int]:
        return [self.version, self.op, self.step, self.rows, int(self.verify), self.moe, int(self.per_row),
                self.keep_rows, self.keep_kept]

    def encode(self, inline: mx.array | None = None) -> mx.array:
        """The int32 [HEADER_LEN] message. ``inline``: the step's ids as an array (kept lazy: the leader's
        drafts need not be read back to the host to be sent), instead of ``tokens``."""
        if inline is None:
            inline = mx.array(list(self.tokens), dtype=mx.int32)
        inline = inline.reshape(-1).astype(mx.int32)
        if inline.shape[0] > INLINE_TOKENS:
            raise ValueError(f"{inline.shape[0]} token ids inline, at most {INLINE_TOKENS}")
        padding = mx.zeros((INLINE_TOKENS - inline.shape[0],), dtype=mx.int32)
        return mx.concatenate([mx.array(self.fields(), dtype=mx.int32), inline, padding])

    @classmethod
    def decode(cls, values: list[int]) -> StepHeader:
        """A received message -> the header; ``StepHeaderError`` for another version, an unknown op or fields
        out of range (never a guess)."""
        if len(values) != HEADER_LEN:
            raise StepHeaderError(f"a step header of {len(values)} int32, expected {HEADER_LEN}")
        version, op, step, rows, verify, moe, per_row, keep, kept = values[:HEADER_FIELDS]
        if version != HEADER_VERSION:
            raise StepHeaderError(f"step header version {version}, this stage speaks {HEADER_VERSION}: "
                                  "every stage of a pipeline must run the same exo version")
        if op not in (OP_FORWARD, OP_END, OP_SHUTDOWN):
            raise StepHeaderError(f"unknown step op {op} (step {step})")
        if op == OP_FORWARD and (rows < 1 or verify not in (0, 1) or not 0 <= moe <= len(MOE_MODES)
                                 or bool(verify) != (moe > 0) or per_row not in (0, 1)
                                 or (keep != NO_ROLLBACK and not 0 <= kept <= keep)):
            raise StepHeaderError(f"malformed forward step header {values[:HEADER_FIELDS]}")
        inline = values[HEADER_FIELDS : HEADER_FIELDS + rows] if op == OP_FORWARD and rows <= INLINE_TOKENS else []
        return cls(op, step, rows, bool(verify), moe, bool(per_row), keep, kept, tuple(inline), version)

    @property
    def verify_mode(self) -> VerifyMode | None:
        return VerifyMode(MOE_MODES[self.moe - 1], self.per_row) if self.verify else None


@dataclass(frozen=True)
class StageSpec:
    """Stage ``rank`` of ``world_size``: layers [start_layer, end_layer) of the model's ``num_layers``."""

    rank: int
    world_size: int
    start_layer: int
    end_layer: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a group of {self.world_size}")
        if not 0 <= self.start_layer < self.end_layer:
            raise ValueError(f"a stage holds at least one layer, got [{self.start_layer}, {self.end_layer})")

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def previous(self) -> int:
        """Where this stage's input comes from: the stage before, or (the first stage) the leader."""
        return (self.rank - 1) % self.world_size

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world_size


class Link(Protocol):
    """Point-to-point transfers between the ranks of a group.

    ``send`` transmits now (it evaluates ``x``); ``recv`` returns once the message is there (an array to
    evaluate, which then costs a copy, not a wait) and raises when the peer is gone.
    """

    def send(self, x: mx.array, dst: int) -> None: ...

    def recv(self, shape: tuple[int, ...], dtype: mx.Dtype, src: int) -> mx.array: ...


def hidden_dtype(model: SpeculativeBackbone) -> mx.Dtype:
    """The activations' dtype between stages: the dtype the layers compute in (their norms' weights)."""
    layer = model.stage_layers[0]
    return layer.input_layernorm.weight.dtype


class PipelineForward:
    """The leader's (last stage's) view of the backbone: a ``Forward`` whose calls run every stage."""

    def __init__(self, model: SpeculativeBackbone, stage: StageSpec, link: Link,
                 verify: VerifyMode | None = None) -> None:
        if not stage.last or stage.world_size < 2:
            raise ValueError("PipelineForward runs on the last stage of a pipeline of two or more")
        self.model = model
        self.stage = stage
        self.link = link
        self.verify = verify or VerifyMode()
        self.stages = stage.world_size
        self.dtype = hidden_dtype(model)
        self._rollback: tuple[int, int] | None = None  # owed to the other stages, sent with the next step
        self.bytes_sent = 0  # by this stage, for the benchmark's per-round figures
        self.bytes_received = 0
        self._step = 0  # the next step header's number: every stage expects them in order from 0

    def new_cache(self) -> list[Any]:
        return self.model.make_cache()

    def hidden(self, tokens: mx.array, cache: list[Any], *, verify: bool = False) -> mx.array:
        rows = int(tokens.shape[-1])
        inline = rows <= INLINE_TOKENS
        header = StepHeader.forward(self._next_step(), rows, self.verify if verify else None, self._rollback)
        self._rollback = None
        self.link.send(header.encode(tokens if inline else None), 0)
        if not inline:  # a prefill chunk's ids follow the header (the first stage reads the row count)
            self.link.send(tokens.reshape(-1).astype(mx.uint32), 0)
            self.bytes_sent += 4 * rows
        h = self.link.recv((1, rows, self.model.hidden_size), self.dtype, self.stage.previous)
        self.bytes_sent += 4 * HEADER_LEN
        self.bytes_received += rows * self.model.hidden_size * self.dtype.size
        if not verify:
            return self.model.stage_hidden(h, cache)
        with verify_call(self.model, cache, self.verify):
            return self.model.stage_hidden(h, cache)

    def rollback(self, cache: list[Any], rows: int, kept: int) -> None:
        keep_rows(cache, rows, kept)
        self._rollback = (rows, kept)

    def end(self, cache: list[Any]) -> None:
        self._rollback = None
        self.link.send(StepHeader(OP_END, self._next_step()).encode(), 0)

    def shutdown(self) -> None:
        """Tell the other stages to return from ``serve_stage`` (the group is closing)."""
        self.link.send(StepHeader(OP_SHUTDOWN, self._next_step()).encode(), 0)

    def _next_step(self) -> int:
        step, self._step = self._step, self._step + 1
        return step


def serve_stage(
    model: SpeculativeBackbone, stage: StageSpec, link: Link, *, on_step: Callable[[], None] | None = None
) -> None:
    """A stage that does not lead: run steps until the leader shuts the group down.

    Raises what the link raises when a member of the group is lost (the caller ends the process: the
    group is disposable and is formed anew).
    """
    if stage.last:
        raise ValueError("the last stage leads (PipelineForward); it does not serve steps")
    dtype = hidden_dtype(model)
    hidden_size = model.hidden_size
    forward_header = stage.next != stage.world_size - 1  # the leader knows the header: it wrote it
    cache = model.make_cache()
    expected = 0  # the step number the next header must carry
    while True:
        message = link.recv((HEADER_LEN,), mx.int32, stage.previous)
        mx.eval(message)
        header = StepHeader.decode(message.tolist())
        if header.step != expected:
            raise StepHeaderError(f"pipeline stage {stage.rank}: step {header.step} arrived, expected step {expected} "
                                  "(a message was lost or repeated)")
        expected += 1
        if header.op in (OP_END, OP_SHUTDOWN):
            if forward_header:
                link.send(message, stage.next)
            if header.op == OP_SHUTDOWN:
                return
            cache = model.make_cache()  # nothing of a request survives it
            continue
        rows = header.rows
        if header.keep_rows != NO_ROLLBACK:
            keep_rows(cache, header.keep_rows, header.keep_kept)
        if stage.first and rows <= INLINE_TOKENS:
            x = mx.array(list(header.tokens), dtype=mx.uint32)[None]
        elif stage.first:
            x = link.recv((rows,), mx.uint32, stage.previous)[None]
        else:
            x = link.recv((1, rows, hidden_size), dtype, stage.previous)
        verify = header.verify_mode
        if verify is not None:
            with verify_call(model, cache, verify):
                h = model.stage_hidden(x, cache)
        else:
            h = model.stage_hidden(x, cache)
        if forward_header:
            link.send(message, stage.next)  # the next stage reads it while this one computes
        # The wire carries ``dtype`` (every stage's receive expects it): a layer that computes in float32
        # (bfloat16 MoE experts on a CPU without bf16 gather_mm) would otherwise send twice the bytes.
        h = h if h.dtype == dtype else h.astype(dtype)
        mx.eval(h, *[c.state for c in cache if c.state is not None])
        link.send(h, stage.next)
        if on_step is not None:
            on_step()
