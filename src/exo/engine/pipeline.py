"""One model across several processes (machines): pipeline stages, with native MTP.

Stage r of N holds layers [start_r, end_r). The LAST stage leads: it holds the final norm, lm_head, the
MTP head (and the embedding table the head needs), runs the engine's one generation loop
(``generate.py``) and talks to the API. Its ``PipelineForward`` is the loop's backbone: a forward call
sends a small step message to the first stage and receives the hidden states of the stage before it.
Every other stage runs ``serve_stage``: receive a step, roll back what the previous verify call did not
keep, run its layers, pass the hidden states on. That is ``serve_member``, the one loop every member that does
not lead runs (a tensor group's too: ``engine/tensor.py``), handed its ``StepTransport``: here send / recv
between neighbours (``StageTransport``).

A round at depth K, N = 3 stages::

    stage 2 (leader): drafts d1..dK with the head; sends [header, pending + d1..dK] -> stage 0
    stage 0: rolls back the previous round (header.kept), embeds, runs its layers -> [header, h] -> stage 1
    stage 1: rolls back, runs its layers -> h -> stage 2
    stage 2: its layers, final norm, logits; decides acceptance; rolls back its own caches and the head's

So what crosses a stage boundary per round is the decision (the header: kept rows of the previous
round, the row count, the verify flag) with K + 1 token ids on the way to the first stage, and the hidden
states [K + 1, H] between consecutive stages. Nothing is gathered to every stage, logits never leave the
leader. Every stage rolls back its own attention KV and GatedDeltaNet state (``forward.keep_rows``).

A batch (``engine/batch.py``) runs through the same calls with B sequences per step ([B, K + 1] ids, [B, K + 1, H]
hiddens). Every stage keeps its caches by slot (a sequence's, a batch's: ``StageSlots``), and the batch's cache
operations on the leader (a member joining, members leaving, per-member rollback) travel as op records in the
next message, which every stage applies to its own layers' caches before the step (``Op``, ``StepHeader``).

No sockets here: the stages talk through a ``Link`` (send / recv of MLX arrays between ranks), which the
runner builds on ``mx.distributed`` (ring backend over TCP: ``exo.runner.group.RingLink``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from .batch_cache import batch_cache, batch_row, keep_rows_per_sequence, prompt_row, prompt_rows
from .forward import MOE_MODES, cache_rates, keep_rows, verify_call
from .memory import keep_cache_room
from .models.backbone import SpeculativeBackbone
from .prefix_cache import PrefixCache, StagePrefix
from .verify import VerifyMode, probe

log = logging.getLogger(__name__)

# The step header: a fixed int32 [HEADER_LEN] message (``StepHeader``): HEADER_FIELDS named fields, then an inline
# area of INLINE ints. Every message names the cache slot it acts on (a stage holds one set of caches per slot:
# a solo sequence's, a batch's; the leader assigns the ids). Cache operations the leader did on its own layers
# since its last message (``Op``: a rollback, a member joining a batch, members leaving it, a slot dropped)
# travel with the next message as a variable-length list of records and every stage applies them in order
# before the message's own action; the records and then the step's token ids fill the inline area, and what
# does not fit follows the header (the records as an int32 message every stage passes on, the ids as a uint32
# message to the first stage only). ``version`` changes with the layout; ``step`` counts the leader's messages
# since the group formed, so a stage that misses or repeats one stops instead of computing on the wrong input.
OP_FORWARD, OP_END, OP_SHUTDOWN, OP_MEASURE = 1, 2, 3, 4
# OP_MEASURE: every stage measures its layers' cache rates (``forward.cache_rates``) and passes every stage's so far
# on to the next, as int32 [4 x stages before and itself] (each figure as high and low 30 bits): the leader gets
# each stage's memory per token and per sequence (a batch's admission counts every stage's memory; a stage whose
# node set room aside for a full batch's recurrent states reports 0 per sequence: ``serve_stage``'s ``states_room``).
# The prefix cache's round trips (``PipelineForward.prefix_lookup`` / ``prefix_begin``): the header is followed by an
# int32 [rows] payload that every stage reads, updates and passes on; the stage before the leader sends the leader
# the payload alone. LOOKUP: [n, tokens(n), m, candidates(m)], each stage sets the positions it does not hold to
# -1. BEGIN: [ok, position, has_group, group as 4 x 16 bits, e, edges(e)], each stage restores ``position`` into
# the slot's fresh caches (0: none) and clears ``ok`` if it cannot.
OP_PREFIX_LOOKUP, OP_PREFIX_BEGIN = 5, 6
# A tensor group's forward step (``engine/tensor.py``): every member runs its slice of every layer on the step's
# ids, which it takes from the leader inside the step's graph (a collective), not from the message.
OP_GRAPH_FORWARD = 7
FORWARD_OPS = (OP_FORWARD, OP_GRAPH_FORWARD)
HEADER_OPS = (OP_FORWARD, OP_END, OP_SHUTDOWN, OP_MEASURE, OP_PREFIX_LOOKUP, OP_PREFIX_BEGIN, OP_GRAPH_FORWARD)
HEADER_VERSION = 8  # 3: the prefix cache's ops; 4: STORE_END; 5: OP_GRAPH_FORWARD; 6: wire; 7: WIRE_COLLECTIVE;
# 8: PREFILL_ROWS
HEADER_NAMES = ("version", "op", "step", "slot", "batch", "rows", "verify", "moe", "per_row", "invariant", "wire",
                "ops")
HEADER_FIELDS = len(HEADER_NAMES)
INLINE = 52  # ints after the fields: a 64-int32 (256-byte) header
HEADER_LEN = HEADER_FIELDS + INLINE
INLINE_TOKENS = INLINE  # the most token ids a header carries (with no op records)
NO_ROLLBACK = -1
MAX_SLOT = 2**31 - 1

# Cache operations (``Op.code``); a record on the wire is [code, slot, n, *args] (n = len(args)):
ROLLBACK = 1  # args [rows, kept_0..kept_{B-1}]: the slot's last verify call of ``rows`` rows per sequence keeps kept_b of sequence b
JOIN = 2  # args [member]: slot ``member``'s (one sequence's) caches join batch ``slot`` as its last row (made from them when new); ``member`` is dropped
FILTER = 3  # args [i_0..i_{n-1}]: batch ``slot`` keeps these rows, in this order (n >= 1)
DROP = 4  # no args: the slot's caches are dropped (a request, or a batch, is over)
# args [row, *tokens]: a sequence ended normally; every stage stores its layers' part of the reply in its prefix cache
# (``StagePrefix.store_end``): ``tokens`` are what its caches hold past the prompt it knows (the sequence's row
# ``row`` of batch ``slot``, or the one-sequence slot itself when ``row`` is -1). Comes before the FILTER / DROP.
STORE_END = 5
# args [n_0..n_{B-1}, s_0..s_{B-1}]: the step on ``slot`` (new) is B prompts as rows of one call
# (``engine.batch_prefill``), right-padded to the longest: its caches are made with each row's length n_b (the
# padding leaves a row's states), and right after the step row b (its first n_b positions) becomes slot s_b's
# caches, a one-sequence slot (whatever it held is dropped) whose prefix cache goes on from there; ``slot`` is gone.
PREFILL_ROWS = 6
OP_CODES = (ROLLBACK, JOIN, FILTER, DROP, STORE_END, PREFILL_ROWS)

# How a forward step's input and output cross between stages (the header's ``wire``):
# WIRE_HOST: as messages the host sends and receives (``Link.send`` / ``Link.recv``): a stage reads its input
# before it builds its step's graph, and evaluates its output before it sends it, so every stage's host work
# (building the graph: ~3 ms a stage of a 9B on MLX CUDA) lies on the step's path, one stage after the other.
# WIRE_GRAPH: as ops of the step's graph (``GraphLink.recv_op`` / ``send_op``: MLX's distributed send and receive,
# run by a communication stream of their own): the header (host-known: slot, shape, ops) travels alone and at
# once, the stage builds its whole step on a receive that has not happened and hands it to the device, and the
# device waits for the bytes (MLX makes a GPU op wait on a CPU stream's output on the device), so a stage's
# host builds while the stages before it compute: a step's path is the stages' device work and the hops.
# WIRE_COLLECTIVE: as the graph wire, each transfer an all-sum of a group of two to which the receiver adds zeros
# (``GraphLink.collective_send`` / ``collective_recv``): what NCCL carries (it has no send and receive in MLX
# 0.32), on the GPU's own stream, device to device, no host and no socket on the step's path.
WIRE_HOST, WIRE_GRAPH, WIRE_COLLECTIVE = 0, 1, 2
WIRE_NAMES = {WIRE_HOST: "host", WIRE_GRAPH: "graph", WIRE_COLLECTIVE: "collective"}
# EXO_PIPELINE_WIRE: auto is the collective wire where the link has it (a pipeline of two over NCCL), else the graph
# wire on MLX CUDA, the host wire elsewhere
WIRES = ("auto", "graph", "host", "collective")


def pipeline_wire(link: Any, setting: str | None = None, *, cuda: bool | None = None) -> int:
    """How a pipeline's leader sends its steps (``WIRE_HOST``, ``WIRE_GRAPH`` or ``WIRE_COLLECTIVE``): what ``link``
    can carry (``graph_ops``: the ring backend's send and receive; ``collective_ops``: a group of two's all-sums)
    and ``setting`` (``EXO_PIPELINE_WIRE``: auto, graph, host, collective) asks for. "collective" falls back to the
    graph wire, "graph" to the host wire, where the link cannot. auto, on MLX CUDA (``cuda``: this process's device,
    None: look): the collective wire where the link's all-sums run on the device (``device_collectives``: NCCL),
    else the graph wire: on 2 x H200 (MLX 0.32.4) a 9B
    pipeline of 2 stages with compiled layers ran 0.764x one GPU on the graph wire against 0.760x on the host wire,
    K = 1 0.799x against 0.778x, and one GPU's graph-wire patterns ran where the first form's leader (its receive
    evaluated alone, a device wait on a CPU stream's output) stopped (bench/results/
    h200-mlx-cuda-compiled-layers-prompt-form-graph-wire-9b-2026-11-30.txt,
    h200x2-mlx-cuda-compiled-pipeline-tensor-no-graphs-2026-11-30.txt). Elsewhere the host wire: on a CPU the ring's
    receive polls a core while it waits, the core a stage computes on (exo-demo over 2 stages 0.45x one node on the
    graph wire, 0.66x on the host wire, on a 2-core AMD EPYC)."""
    setting = setting if setting is not None else os.environ.get("EXO_PIPELINE_WIRE", "auto")
    if setting not in WIRES:
        raise ValueError(f"EXO_PIPELINE_WIRE={setting!r}: one of {', '.join(WIRES)}")
    graph, collective = getattr(link, "graph_ops", False), getattr(link, "collective_ops", False)
    if setting == "host":
        return WIRE_HOST
    if setting == "auto":
        on_cuda = mx.cuda.is_available() and mx.default_device() == mx.gpu if cuda is None else cuda
        if not on_cuda:
            return WIRE_HOST
        setting = "collective" if getattr(link, "device_collectives", False) else "graph"
    if setting == "collective" and collective:
        return WIRE_COLLECTIVE
    return WIRE_GRAPH if graph else WIRE_HOST


def _pack_rates(rates: tuple[int, int]) -> list[int]:
    return [v for rate in rates for v in (rate >> 30, rate & ((1 << 30) - 1))]


def _unpack_rates(values: list[int]) -> list[tuple[int, int]]:
    numbers = [(values[i] << 30) | values[i + 1] for i in range(0, len(values), 2)]
    return [(numbers[i], numbers[i + 1]) for i in range(0, len(numbers), 2)]


class StepHeaderError(RuntimeError):
    """A step header this stage cannot act on (another version, a step out of order, an unknown op): the
    stages disagree about where they are, so the stage stops (its group is formed anew) rather than compute."""


class PipelineBrokenError(RuntimeError):
    """A call on a pipeline that failed before (``PipelineForward.broken``): its stages may be out of step, so
    nothing more crosses to them; the group is formed anew."""


def _one_exchange(method: Callable[..., Any]) -> Callable[..., Any]:
    """A ``PipelineForward`` call that acts on every stage: once one raised (a stage or the link to it lost, or
    anything else mid-call), where the other stages are is unknown, so the forward is ``broken`` and refuses
    every later call (``PipelineBrokenError``) rather than send into a pipeline that may be out of step."""

    @functools.wraps(method)
    def call(self: PipelineForward, *args: Any, **kwargs: Any) -> Any:
        if self.broken is not None:
            raise PipelineBrokenError(f"the pipeline failed earlier ({type(self.broken).__name__}: {self.broken}); "
                                      "its group is formed anew") from self.broken
        try:
            return method(self, *args, **kwargs)
        except BaseException as e:
            self.broken = e
            raise

    return call


@dataclass(frozen=True)
class Op:
    """One cache operation the leader did on its own layers, for every other stage to mirror on its own."""

    code: int
    slot: int
    args: tuple[int, ...] = ()

    def ints(self) -> list[int]:
        return [self.code, self.slot, len(self.args), *self.args]

    @staticmethod
    def parse(values: list[int]) -> tuple[Op, ...]:
        """Op records -> ops; ``StepHeaderError`` for an unknown code, a wrong length or arguments out of range."""
        ops, i = [], 0
        while i < len(values):
            if i + 3 > len(values):
                raise StepHeaderError(f"a truncated op record at {i} of {values}")
            code, slot, n = values[i : i + 3]
            args = tuple(values[i + 3 : i + 3 + n])
            if code not in OP_CODES or not 0 <= slot <= MAX_SLOT or n < 0 or len(args) != n:
                raise StepHeaderError(f"malformed op record {values[i : i + 3 + max(n, 0)]}")
            if (code == ROLLBACK and (n < 2 or any(not 0 <= k <= args[0] for k in args[1:]))
                    or code == JOIN and (n != 1 or not 0 <= args[0] <= MAX_SLOT or args[0] == slot)
                    or code == FILTER and (n < 1 or min(args) < 0 or len(set(args)) != n)
                    or code == DROP and n != 0
                    or code == STORE_END and (n < 2 or args[0] < -1 or min(args[1:]) < 0)
                    or code == PREFILL_ROWS and not _prefill_rows_ok(slot, args)):
                raise StepHeaderError(f"malformed op record {values[i : i + 3 + n]}")
            ops.append(Op(code, slot, args))
            i += 3 + n
        return tuple(ops)


def _prefill_rows_ok(slot: int, args: tuple[int, ...]) -> bool:
    lengths, owners = args[: len(args) // 2], args[len(args) // 2 :]
    return (len(args) >= 2 and len(args) % 2 == 0 and min(lengths) >= 1 and len(set(owners)) == len(owners)
            and all(0 <= s <= MAX_SLOT and s != slot for s in owners))


def _op_ints(ops: tuple[Op, ...]) -> list[int]:
    return [v for op in ops for v in op.ints()]


@dataclass(frozen=True)
class StepHeader:
    """What the leader decided for one step, as every stage reads it. ``slot``: the caches it runs on;
    ``batch`` x ``rows``: the step's rows (sequences x rows each); ``moe``: 0 for a plain step, else 1 + the
    index of the verify call's MoE mode in ``MOE_MODES``; ``invariant``: the batch-invariant layers
    (``EngineConfig.batch_invariant``); ``ops``: the cache operations to apply first; ``tokens``: the step's
    ids when they fit in the header (the first stage's input), else empty (they follow it)."""

    op: int
    step: int
    slot: int = 0
    batch: int = 1
    rows: int = 0
    verify: bool = False
    moe: int = 0
    per_row: bool = False
    invariant: bool = False
    ops: tuple[Op, ...] = ()
    tokens: tuple[int, ...] = ()
    version: int = HEADER_VERSION
    wire: int = WIRE_HOST

    @classmethod
    def forward(cls, step: int, slot: int, batch: int, rows: int, verify: VerifyMode | None,
                ops: tuple[Op, ...] = (), tokens: tuple[int, ...] = (), invariant: bool = False,
                op: int = OP_FORWARD, wire: int = WIRE_HOST) -> StepHeader:
        moe = 0 if verify is None else MOE_MODES.index(verify.moe) + 1
        return cls(op, step, slot, batch, rows, verify is not None, moe,
                   bool(verify is not None and verify.per_row_attention), invariant, ops, tokens, wire=wire)

    @property
    def ops_length(self) -> int:
        return sum(3 + len(op.args) for op in self.ops)

    @property
    def ops_inline(self) -> bool:
        """Whether the op records travel in the header (else in an int32 message right after it)."""
        return self.ops_length <= INLINE

    @property
    def tokens_inline(self) -> bool:
        """Whether the step's ids travel in the header (else a uint32 message to the first stage follows; on the
        graph wire always, as an op of the leader's graph)."""
        return (self.op == OP_FORWARD and self.wire == WIRE_HOST and self.ops_inline
                and self.ops_length + self.batch * self.rows <= INLINE)

    def fields(self) -> list[int]:
        return [self.version, self.op, self.step, self.slot, self.batch, self.rows, int(self.verify), self.moe,
                int(self.per_row), int(self.invariant), self.wire, self.ops_length]

    def encode(self, inline: mx.array | None = None) -> mx.array:
        """The int32 [HEADER_LEN] message. ``inline``: the step's ids as an array (kept lazy: the leader's
        drafts need not be read back to the host to be sent), instead of ``tokens``; it is used only when
        the ids fit (``tokens_inline``)."""
        parts = [mx.array(self.fields() + (_op_ints(self.ops) if self.ops_inline else []), dtype=mx.int32)]
        used = self.ops_length if self.ops_inline else 0
        if self.tokens_inline:
            ids = inline if inline is not None else mx.array(list(self.tokens), dtype=mx.int32)
            ids = ids.reshape(-1).astype(mx.int32)
            if ids.shape[0] != self.batch * self.rows:
                raise ValueError(f"{ids.shape[0]} token ids for a step of {self.batch} x {self.rows} rows")
            parts.append(ids)
            used += ids.shape[0]
        elif self.tokens:
            raise ValueError(f"{len(self.tokens)} token ids do not fit in the header: they follow it")
        parts.append(mx.zeros((INLINE - used,), dtype=mx.int32))
        return mx.concatenate(parts)

    def ops_message(self) -> mx.array | None:
        """The op records that do not fit in the header (sent right after it, passed on by every stage)."""
        return None if self.ops_inline else mx.array(_op_ints(self.ops), dtype=mx.int32)

    @classmethod
    def decode(cls, values: list[int], ops: list[int] | None = None) -> StepHeader:
        """A received message -> the header; ``ops``: the op records that followed it (when they did not fit).
        ``StepHeaderError`` for another version, an unknown op or fields out of range (never a guess)."""
        if len(values) != HEADER_LEN:
            raise StepHeaderError(f"a step header of {len(values)} int32, expected {HEADER_LEN}")
        version, op, step, slot, batch, rows, verify, moe, per_row, invariant, wire, ops_length = values[:HEADER_FIELDS]
        if version != HEADER_VERSION:
            raise StepHeaderError(f"step header version {version}, this stage speaks {HEADER_VERSION}: "
                                  "every stage of a pipeline must run the same exo version")
        if op not in HEADER_OPS:
            raise StepHeaderError(f"unknown step op {op} (step {step})")
        if (not 0 <= slot <= MAX_SLOT or ops_length < 0 or invariant not in (0, 1)
                or wire not in WIRE_NAMES or wire != WIRE_HOST and op != OP_FORWARD
                or op in (OP_PREFIX_LOOKUP, OP_PREFIX_BEGIN) and (rows < 1 or batch != 1)
                or op in FORWARD_OPS and (rows < 1 or batch < 1 or verify not in (0, 1) or not 0 <= moe <= len(MOE_MODES)
                                         or bool(verify) != (moe > 0) or per_row not in (0, 1))):
            raise StepHeaderError(f"malformed step header {values[:HEADER_FIELDS]}")
        area = values[HEADER_FIELDS:]
        inline_ops = ops_length <= INLINE
        if inline_ops:
            records = area[:ops_length]
        elif ops is None or len(ops) != ops_length:
            raise StepHeaderError(f"a step header announces {ops_length} ints of op records, "
                                  f"{'none' if ops is None else len(ops)} followed it")
        else:
            records = ops
        header = cls(op, step, slot, batch, rows, bool(verify), moe, bool(per_row), bool(invariant), Op.parse(records),
                     wire=wire)
        if header.tokens_inline:
            header = dataclasses.replace(header, tokens=tuple(area[ops_length : ops_length + batch * rows]))
        return header

    @staticmethod
    def ops_length_of(values: list[int]) -> int:
        """The op records' length a raw header announces (to receive them when they follow it)."""
        return values[HEADER_NAMES.index("ops")] if len(values) == HEADER_LEN else 0

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


class GraphLink(Link, Protocol):
    """A ``Link`` whose transfers can also be ops of a graph (``WIRE_GRAPH``): ``send_op`` returns the send, lazy
    (evaluating it sends, once ``x`` is computed), ``recv_op`` a lazy array that receives when evaluated. Every
    transfer of the link, host or graph, keeps one order per direction (one communication stream), so a peer
    receives them in the order they were issued. ``graph_ops``: whether this link can (the ring backend).

    ``collective_ops``: whether it can carry ``WIRE_COLLECTIVE`` (a group of two): ``collective_send`` is an all-sum
    of ``x``, ``collective_recv`` an all-sum of zeros (the peer's ``x``, the same bits: x + 0 is x but for the sign of
    a zero), both lazy; both ends issue them in the same order (the stage loop's order is the leader's)."""

    graph_ops: bool
    collective_ops: bool

    def send_op(self, x: mx.array, dst: int) -> mx.array: ...

    def recv_op(self, shape: tuple[int, ...], dtype: mx.Dtype, src: int) -> mx.array: ...

    def collective_send(self, x: mx.array) -> mx.array: ...

    def collective_recv(self, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array: ...


def hidden_dtype(model: SpeculativeBackbone) -> mx.Dtype:
    """The activations' dtype between stages: the dtype the layers compute in (their norms' weights)."""
    layer = model.stage_layers[0]
    return layer.input_layernorm.weight.dtype


class StageCaches(list):  # noqa: FURB189 - a list the loop and the batch use as any cache list
    """One slot's caches of this process's layers: the list the loop and a batch hold, with the slot id the
    other stages know the same sequence's (or batch's) caches by."""

    def __init__(self, caches: list[Any], slot: int) -> None:
        super().__init__(caches)
        self.slot = slot


def _slot(cache: list[Any]) -> int:
    slot = getattr(cache, "slot", None)
    if slot is None:
        raise ValueError("these caches were not made by this pipeline's forward (no slot)")
    return slot


class PipelineForward:
    """The leader's (last stage's) view of the backbone: a ``Forward`` whose calls run every stage.

    Every cache list it hands out (``new_cache``, ``join``) is a ``StageCaches`` with a slot id; the other
    stages keep their own layers' caches under the same id. Cache operations (a rollback, a join, a filter)
    run on the leader's layers at once and are owed to the other stages, which apply them, in order, when
    the next message arrives (no message of their own: a step stays one message each way).

    A call that raises breaks the forward for good (``broken``): the stages may be out of step. Anything that
    fails between calls (the leader's own evaluation, a consumer of the output) leaves them in step.

    On the graph wire (``graph``, ``pipeline_wire``) a forward call sends its header at once and returns the step
    built on a receive the device waits for, the ids sent as an op of the same graph: the call never waits for the
    other stages. A lost stage then shows as an error of the evaluation (outside any call): ``broken`` looks at
    the doorbells too, as a tensor group's leader does."""

    mode = "pipeline"

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
        self._ops: list[Op] = []  # owed to the other stages, sent with the next message
        self.bytes_sent = 0  # by this stage, for the benchmark's per-round figures
        self.bytes_received = 0
        self._step = 0  # the next step header's number: every stage expects them in order from 0
        self._slots = 0  # the next slot id
        self._invariant = False
        self.wire = pipeline_wire(link)  # how its steps cross the stages (WIRE_HOST, WIRE_GRAPH, WIRE_COLLECTIVE)
        self.graph = self.wire != WIRE_HOST  # as ops of the graphs (the graph or the collective wire)
        self._pending: mx.array | None = None  # the graph wire: the last step's receive (``_settle``)
        self._broken: BaseException | None = None  # what a call raised: the stages may be out of step since
        # EXO_PIPELINE_PHASES=1 on the graph and collective wires: the time from one step's header to the next
        self._note = getattr(link, "note", None) if getattr(link, "timed_receives", False) else None
        self._last_header: float | None = None

    @property
    def broken(self) -> BaseException | None:
        """What a call raised, or (where errors show outside calls: the graph wire, a tensor group) a neighbour's
        loss seen on its doorbell; None while the stages are in step."""
        if self._broken is None and self._watch_doorbells:
            lost = getattr(self.link, "peer_lost", None)
            if lost is not None and lost():
                self._broken = self._lost_error()
        return self._broken

    @broken.setter
    def broken(self, value: BaseException | None) -> None:
        self._broken = value

    @property
    def _watch_doorbells(self) -> bool:
        return self.graph

    def _lost_error(self) -> BaseException:
        return PipelineBrokenError("a stage of the pipeline left (its connection closed)")

    def new_cache(self) -> StageCaches:
        return StageCaches(self.model.make_cache(), self._new_slot())

    @_one_exchange
    def hidden(self, tokens: mx.array, cache: list[Any], *, verify: bool = False) -> mx.array:
        batch, rows = (int(n) for n in tokens.shape)
        header = StepHeader.forward(self._next_step(), _slot(cache), batch, rows, self.verify if verify else None,
                                    self._take_ops(), invariant=self._invariant,
                                    wire=self.wire)
        shape = (batch, rows, self.model.hidden_size)
        if self.graph:
            # The header now (the first stage builds its step on it while these ids are computed), then the ids
            # as an op: the ids in an evaluation of their own first, so that the send waits for them on the link's
            # stream (an event of the device's), not this thread. The hiddens' receive is left to the evaluation
            # of the step built on it: a device op fed by a CPU stream's output of an earlier evaluation would
            # wait for it in a kernel spinning on the device (MLX CUDA), one fed in the same evaluation waits on the
            # host. A receive the loop builds and never evaluates is evaluated before the next exchange
            # (``_settle``): the link's transfers run in the order they reach its stream, both ends alike.
            # On the collective wire both transfers are all-sums on the device's stream, in this order at both ends.
            self._send_header(header)
            if self._note is not None:
                now = time.perf_counter()
                if self._last_header is not None:
                    self._note("graph.period", now - self._last_header)
                self._last_header = now
            ids = tokens.reshape(-1).astype(mx.uint32)
            mx.async_eval(ids)
            if self.wire == WIRE_COLLECTIVE:
                mx.async_eval(self.link.collective_send(ids))
                h = self._pending = self.link.collective_recv(shape, self.dtype)
            else:
                mx.async_eval(self.link.send_op(ids, 0))
                h = self._pending = self.link.recv_op(shape, self.dtype, self.stage.previous)
            self.bytes_sent += 4 * batch * rows
        else:
            self._send_header(header, tokens if header.tokens_inline else None)
            if not header.tokens_inline:  # a prefill chunk's (or a wide batch's) ids follow the header
                self.link.send(tokens.reshape(-1).astype(mx.uint32), 0)
                self.bytes_sent += 4 * batch * rows
            h = self.link.recv(shape, self.dtype, self.stage.previous)
        self.bytes_received += batch * rows * self.model.hidden_size * self.dtype.size
        if not verify:
            return self.model.stage_hidden(h, cache)
        with verify_call(self.model, cache, self.verify, batch * rows):
            return self.model.stage_hidden(h, cache)

    @_one_exchange
    def rollback(self, cache: list[Any], rows: int, kept: int) -> None:
        keep_rows(cache, rows, kept)
        self._ops.append(Op(ROLLBACK, _slot(cache), (rows, kept)))

    @_one_exchange
    def rollback_per_sequence(self, cache: list[Any], rows: int, kept: Sequence[int]) -> None:
        keep_rows_per_sequence(cache, rows, kept)
        self._ops.append(Op(ROLLBACK, _slot(cache), (rows, *kept)))

    @_one_exchange
    def join(self, batch: list[Any] | None, member: list[Any]) -> list[Any]:
        theirs = [batch_cache(c) for c in member]
        if not batch:
            batch = StageCaches(theirs, self._new_slot())
        else:
            for mine, c in zip(batch, theirs, strict=True):
                mine.extend(c)
        self._ops.append(Op(JOIN, _slot(batch), (_slot(member),)))
        return batch

    @_one_exchange
    def filter(self, cache: list[Any], keep: Sequence[int]) -> None:
        index = mx.array(list(keep))
        for c in cache:
            c.filter(index)
        self._ops.append(Op(FILTER, _slot(cache), tuple(keep)))

    @_one_exchange
    def prompt_rows(self, lengths: Sequence[int], owners: Sequence[list[Any]]) -> StageCaches:
        """A new slot for one call of prompts as rows: the leader's layers' caches here, each row's length and owner
        owed to the other stages (a ``PREFILL_ROWS`` record: the call's header carries it)."""
        cache = StageCaches(prompt_rows(self.model.make_cache(), lengths), self._new_slot())
        self._ops.append(Op(PREFILL_ROWS, cache.slot, (*lengths, *(_slot(o) for o in owners))))
        return cache

    def split_rows(self, cache: list[Any], lengths: Sequence[int], owners: Sequence[list[Any]]) -> list[StageCaches]:
        """Row b as sequence b's caches under its own slot (every other stage did the same right after the step)."""
        return [StageCaches(prompt_row(cache, b, n), _slot(o)) for b, (n, o) in enumerate(zip(lengths, owners, strict=True))]

    @_one_exchange
    def store_end(self, cache: list[Any], row: int, tokens: Sequence[int]) -> None:
        """A sequence ended normally: every other stage stores its layers' part of the reply (``tokens``: what
        the caches hold past the prompt) from the sequence's caches, ``row`` of the batch ``cache`` (-1: ``cache``
        is the sequence's own). Owed, like a filter: it rides the next message, before the slot is filtered or
        dropped (the leader stores its own part itself: ``SequenceState.store_end``)."""
        self._ops.append(Op(STORE_END, _slot(cache), (row, *tokens)))

    def set_batch_invariant(self, on: bool) -> None:
        self.model.set_batch_invariant(on)
        self._invariant = on

    @_one_exchange
    def memory_rates(self) -> list[tuple[int, int]]:
        """Every stage's (KV bytes per token, state bytes per sequence), each measured by that stage on its own
        layers (``OP_MEASURE``), the leader's last."""
        self._send_header(StepHeader(OP_MEASURE, self._next_step(), ops=self._take_ops()))
        figures = self.link.recv((4 * (self.stages - 1),), mx.int32, self.stage.previous).tolist()
        return [*_unpack_rates(figures), cache_rates(self.model)]

    @_one_exchange
    def end(self, cache: list[Any]) -> None:
        """The slot's caches are dropped everywhere (a cache list without a slot, one a batch took over, has
        nothing to drop)."""
        slot = getattr(cache, "slot", None)
        if slot is None:
            return
        self._send_header(StepHeader(OP_END, self._next_step(), slot, ops=self._take_ops()))

    @_one_exchange
    def prefix_lookup(self, cache: list[Any], tokens: Sequence[int], candidates: Sequence[int]) -> list[int]:
        """Of ``candidates`` (prompt positions whose snapshot the leader holds), those every other stage
        holds too for ``tokens``, the prompt of the sequence of ``cache`` (its slot): every stage keeps the
        prompt for its own stores."""
        payload = [len(tokens), *tokens, len(candidates), *candidates]
        reply = self._round_trip(OP_PREFIX_LOOKUP, _slot(cache), payload)
        return [p for p in reply[2 + len(tokens):] if p >= 0]

    @_one_exchange
    def prefix_begin(self, cache: list[Any], position: int, edges: Sequence[int], group: str | None) -> bool:
        """Every other stage restores ``position`` (0: nothing) of the prompt its last ``prefix_lookup`` sent
        into the slot's fresh caches, and stores the prompt's blocks and its snapshots at ``edges`` (the
        leader's) after the prefill, in ``group``. False: some stage could not restore (the caller starts
        them all from 0)."""
        g = int(group, 16) if group else 0
        payload = [1, position, int(group is not None), *((g >> s) & 0xFFFF for s in (48, 32, 16, 0)),
                   len(edges), *edges]
        return self._round_trip(OP_PREFIX_BEGIN, _slot(cache), payload)[0] == 1

    def _round_trip(self, op: int, slot: int, payload: list[int]) -> list[int]:
        self._send_header(StepHeader(op, self._next_step(), slot, 1, len(payload), ops=self._take_ops()))
        self.link.send(mx.array(payload, dtype=mx.int32), 0)
        self.bytes_sent += 4 * len(payload)
        reply = self.link.recv((len(payload),), mx.int32, self.stage.previous)
        mx.eval(reply)
        self.bytes_received += 4 * len(payload)
        return reply.tolist()

    @_one_exchange
    def shutdown(self) -> None:
        """Tell the other stages to return from ``serve_stage`` (the group is closing)."""
        self._ops = []
        self._send_header(StepHeader(OP_SHUTDOWN, self._next_step()))

    def _settle(self) -> None:
        """The graph wire: the last step's receive is started if its step was not (a step built and dropped), so
        the other stages' sends and this link's later transfers stay in order."""
        if self._pending is not None:
            mx.async_eval(self._pending)
            self._pending = None

    def _send_header(self, header: StepHeader, inline: mx.array | None = None) -> None:
        self._settle()
        self.link.send(header.encode(inline), 0)
        self.bytes_sent += 4 * HEADER_LEN
        ops = header.ops_message()
        if ops is not None:
            self.link.send(ops, 0)
            self.bytes_sent += 4 * ops.shape[0]

    def _take_ops(self) -> tuple[Op, ...]:
        ops, self._ops = tuple(self._ops), []
        return ops

    def _new_slot(self) -> int:
        slot, self._slots = self._slots, (self._slots + 1) % (MAX_SLOT + 1)
        return slot

    def _next_step(self) -> int:
        step, self._step = self._step, self._step + 1
        return step


class StageSlots:
    """A serving stage's caches, by slot: one sequence's (``batch`` 1) or a batch's (``BatchKVCache`` rows)."""

    def __init__(self, model: SpeculativeBackbone, rank: int) -> None:
        self.model, self.rank = model, rank
        self.caches: dict[int, list[Any]] = {}
        self.sizes: dict[int, int] = {}  # a batch slot's sequences; absent: a one-sequence slot
        self.prompts: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # a PREFILL_ROWS slot: (lengths, owners)

    def _get(self, slot: int, what: str) -> list[Any]:
        cache = self.caches.get(slot)
        if cache is None:
            raise StepHeaderError(f"pipeline stage {self.rank}: {what} on slot {slot}, which it does not hold")
        return cache

    def apply(self, op: Op) -> None:
        if op.code == DROP:
            self.drop(op.slot)
        elif op.code == ROLLBACK:
            cache = self._get(op.slot, "a rollback")
            rows, kept = op.args[0], op.args[1:]
            size = self.sizes.get(op.slot)
            if len(kept) != (size or 1):
                raise StepHeaderError(f"pipeline stage {self.rank}: a rollback of {len(kept)} sequences on slot "
                                      f"{op.slot} of {size or 1}")
            if size is None:
                keep_rows(cache, rows, kept[0])
            else:
                keep_rows_per_sequence(cache, rows, kept)
        elif op.code == JOIN:
            member = op.args[0]
            if member in self.sizes:
                raise StepHeaderError(f"pipeline stage {self.rank}: slot {member} is a batch; only a sequence joins one")
            theirs = [batch_cache(c) for c in self._get(member, "a join")]
            del self.caches[member]
            if op.slot in self.caches:
                if op.slot not in self.sizes:
                    raise StepHeaderError(f"pipeline stage {self.rank}: a join into slot {op.slot}, not a batch")
                for mine, c in zip(self.caches[op.slot], theirs, strict=True):
                    mine.extend(c)
                self.sizes[op.slot] += 1
            else:
                self.caches[op.slot], self.sizes[op.slot] = theirs, 1
        elif op.code == FILTER:
            cache = self._get(op.slot, "a filter")
            size = self.sizes.get(op.slot)
            if size is None or max(op.args) >= size:
                raise StepHeaderError(f"pipeline stage {self.rank}: rows {list(op.args)} of slot {op.slot} "
                                      f"({'not a batch' if size is None else f'{size} sequences'})")
            index = mx.array(list(op.args))
            for c in cache:
                c.filter(index)
            self.sizes[op.slot] = len(op.args)
        elif op.code == STORE_END:
            self._row(op.slot, op.args[0])  # (checked here; the stage's prefix cache stores it: serve_stage)
        elif op.code == PREFILL_ROWS:
            if op.slot in self.caches:
                raise StepHeaderError(f"pipeline stage {self.rank}: prompts as rows on slot {op.slot}, which it holds")
            half = len(op.args) // 2
            self.caches[op.slot] = prompt_rows(self.model.make_cache(), op.args[:half])
            self.prompts[op.slot] = (op.args[:half], op.args[half:])

    def split_rows(self, slot: int) -> list[tuple[int, int, list[Any]]]:
        """After the step on a ``PREFILL_ROWS`` slot: each row becomes its owner's one-sequence slot; returns (owner,
        length, its caches) per row (none for any other slot)."""
        prompt = self.prompts.pop(slot, None)
        if prompt is None:
            return []
        cache = self.caches.pop(slot)
        out = []
        for b, (n, owner) in enumerate(zip(*prompt, strict=True)):
            self.drop(owner)
            self.caches[owner] = prompt_row(cache, b, n)
            out.append((owner, n, self.caches[owner]))
        return out

    def _row(self, slot: int, row: int) -> list[Any]:
        cache = self._get(slot, "a stored reply")
        size = self.sizes.get(slot)
        if (row == -1) != (size is None) or size is not None and row >= size:
            raise StepHeaderError(f"pipeline stage {self.rank}: row {row} of slot {slot} "
                                  f"({'not a batch' if size is None else f'{size} sequences'})")
        return cache

    def sequence(self, slot: int, row: int) -> list[Any]:
        """One sequence's caches: the one-sequence slot's own (``row`` -1), or row ``row`` of a batch slot (views)."""
        cache = self._row(slot, row)
        return cache if row == -1 else batch_row(cache, row)

    def forward_cache(self, header: StepHeader) -> list[Any]:
        cache = self.caches.get(header.slot)
        prompt = self.prompts.get(header.slot)
        if prompt is not None:
            if header.verify or header.batch != len(prompt[0]) or header.rows != max(prompt[0]):
                raise StepHeaderError(f"pipeline stage {self.rank}: a step of {header.batch} x {header.rows} rows on "
                                      f"slot {header.slot}, made for prompts of {list(prompt[0])}")
            return cache
        if cache is None:
            if header.batch != 1:
                raise StepHeaderError(f"pipeline stage {self.rank}: a step of {header.batch} sequences on a new slot")
            cache = self.caches[header.slot] = self.model.make_cache()
        elif header.batch != self.sizes.get(header.slot, 1):
            raise StepHeaderError(f"pipeline stage {self.rank}: a step of {header.batch} sequences on slot "
                                  f"{header.slot} of {self.sizes.get(header.slot, 1)}")
        return cache

    def drop(self, slot: int) -> None:
        """Nothing of the slot survives (a slot never used, or dropped already, is no error: a request may end
        before its first step)."""
        self.caches.pop(slot, None)
        self.sizes.pop(slot, None)
        self.prompts.pop(slot, None)


class StepTransport(Protocol):
    """What a member that does not lead does its own way in ``serve_member``: how a forward step's input reaches its
    layers and where their output goes. A pipeline's stage (``StageTransport``) receives the hidden states of the
    stage before it (the first stage: the ids) and sends its own to the next; a tensor group's member
    (``tensor.TensorTransport``) takes the ids from the leader in a collective, and its output goes nowhere (its
    layers' all-reduces carry it). Everything else (headers, op records, END, SHUTDOWN, the prefix cache's round
    trips, MEASURE, errors, exit) is ``serve_member``'s, the same code for both."""

    member: str  # what errors call this member ("pipeline stage", "tensor member")
    group: str  # and its group ("pipeline", "tensor group")
    forward_op: int  # the header op of this kind's forward step (the other kind's is a StepHeaderError)

    def layers(self, verify: VerifyMode | None) -> contextlib.AbstractContextManager[None]:
        """Around building anything on this member's layers: a forward step (``verify``: its verify mode, None
        for a plain step) or a measurement (None)."""
        ...

    def receive(self, header: StepHeader) -> mx.array:
        """The step's input to this member's layers (called inside ``layers``)."""
        ...

    def outgoing(self, h: mx.array) -> mx.array:
        """The step's output as this member evaluates it (then ``send``)."""
        ...

    def send(self, h: mx.array) -> None:
        """Pass the evaluated output on."""
        ...

    def send_op(self, h: mx.array, wire: int = WIRE_GRAPH) -> mx.array:
        """On the graph or the collective wire (``wire``): the send of the output, lazy (evaluated with the step).
        ``StepHeaderError`` where this member has no such wire."""
        ...


class StageTransport:
    """A pipeline stage's ``StepTransport``: send / recv between neighbours."""

    member, group, forward_op = "pipeline stage", "pipeline", OP_FORWARD

    def __init__(self, model: SpeculativeBackbone, stage: StageSpec, link: Link) -> None:
        self.stage, self.link = stage, link
        self.dtype = hidden_dtype(model)
        self.hidden_size = model.hidden_size

    def layers(self, verify: VerifyMode | None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def receive(self, header: StepHeader) -> mx.array:
        batch, rows = header.batch, header.rows
        if header.wire != WIRE_HOST:
            link = self._graph_link(header)
            shape, dtype = ((batch * rows,), mx.uint32) if self.stage.first else ((batch, rows, self.hidden_size), self.dtype)
            if header.wire == WIRE_COLLECTIVE:
                x = link.collective_recv(shape, dtype)
            else:
                x = link.recv_op(shape, dtype, self.stage.previous)
            return x.reshape(batch, rows) if self.stage.first else x
        if self.stage.first and header.tokens_inline:
            return mx.array(list(header.tokens), dtype=mx.uint32).reshape(batch, rows)
        if self.stage.first:
            return self.link.recv((batch * rows,), mx.uint32, self.stage.previous).reshape(batch, rows)
        return self.link.recv((batch, rows, self.hidden_size), self.dtype, self.stage.previous)

    def outgoing(self, h: mx.array) -> mx.array:
        # The wire carries ``dtype`` (every stage's receive expects it): a layer that computes in float32
        # (bfloat16 MoE experts on a CPU without bf16 gather_mm) would otherwise send twice the bytes.
        return h if h.dtype == self.dtype else h.astype(self.dtype)

    def send(self, h: mx.array) -> None:
        self.link.send(h, self.stage.next)

    def send_op(self, h: mx.array, wire: int = WIRE_GRAPH) -> mx.array:
        link = self._graph_link(None, wire)
        return link.collective_send(h) if wire == WIRE_COLLECTIVE else link.send_op(h, self.stage.next)

    def _graph_link(self, header: StepHeader | None, wire: int | None = None) -> GraphLink:
        wire = header.wire if header is not None else wire
        if not getattr(self.link, "collective_ops" if wire == WIRE_COLLECTIVE else "graph_ops", False):
            step = f" (step {header.step})" if header is not None else ""
            raise StepHeaderError(f"pipeline stage {self.stage.rank}: a step on the {WIRE_NAMES[wire]} wire{step}, "
                                  "which its link cannot carry (every stage of a pipeline must run the same exo "
                                  "version, on the same distributed backend)")
        return self.link  # type: ignore[return-value]


def serve_stage(
    model: SpeculativeBackbone, stage: StageSpec, link: Link, *, on_step: Callable[[], None] | None = None,
    slots: StageSlots | None = None, prefix_cache: PrefixCache | None = None, states_room: bool = False,
) -> None:
    """A pipeline stage that does not lead: ``serve_member`` over send / recv between neighbours. ``states_room``:
    its node set aside room for a full batch's recurrent states (``batch_memory.state_room``), so it reports
    its states as taking none of the KV budget (``OP_MEASURE``)."""
    serve_member(model, stage, link, StageTransport(model, stage, link), on_step=on_step, slots=slots,
                 prefix_cache=prefix_cache, states_room=states_room)


def serve_member(
    model: SpeculativeBackbone, member: StageSpec, link: Link, transport: StepTransport, *,
    on_step: Callable[[], None] | None = None, slots: StageSlots | None = None, prefix_cache: PrefixCache | None = None,
    states_room: bool = False,
) -> None:
    """A member of a group that does not lead (a pipeline's stage, a tensor group's member): run the leader's steps
    until it shuts the group down, ``transport`` bringing each forward step's input and taking its output.
    ``slots``: the table of caches it keeps (by default a new one; tests pass theirs to see what it holds).
    ``prefix_cache``: this member's (its layers' or its slice's, under its own namespace): the leader's LOOKUP and
    BEGIN messages restore from it and the prefill's steps store into it (``StagePrefix``, one per slot). A prefix
    cache that raises never ends the member: a failed lookup holds nothing, a failed restore answers "not
    restored" (the leader starts every member from 0), a failed store drops the sequence's ``StagePrefix`` (logged
    and counted: ``PrefixCache.note_failure``).

    Raises ``StepHeaderError`` for a header it cannot act on, and what the link (or a collective) raises when a
    member of the group is lost (the caller ends the process: the group is disposable and is formed anew).
    """
    if member.last:
        raise ValueError(f"the last {transport.member} leads; it does not serve steps")
    forward_header = member.next != member.world_size - 1  # the leader knows the header: it wrote it
    slots = slots if slots is not None else StageSlots(model, member.rank)
    prefixes: dict[int, StagePrefix] = {}  # slot -> its sequence's use of the prefix cache
    rows_of: dict[int, list[StagePrefix | None]] = {}  # a batch slot -> its rows' (for their replies)
    expected = 0  # the step number the next header must carry
    probed = False
    note = getattr(link, "note", None) if getattr(link, "timed_receives", False) else None  # (graph-wire phases)
    launched = None  # when this member's last graph-wire step was launched
    while True:
        keep_cache_room()  # (as the leader's device loop: engine/memory.py)
        header = _receive_header(link, member, expected, forward_header)
        arrived = time.perf_counter() if note is not None else 0.0
        expected += 1
        for op in header.ops:  # the cache operations the leader did since its last message, first
            slots.apply(op)
            _follow_prefixes(op, slots, prefixes, rows_of)
        if header.op == OP_SHUTDOWN:
            return
        if header.op == OP_END:
            slots.drop(header.slot)  # nothing of a request survives it
            prefixes.pop(header.slot, None)
            rows_of.pop(header.slot, None)
            continue
        if header.op in (OP_PREFIX_LOOKUP, OP_PREFIX_BEGIN):
            payload = link.recv((header.rows,), mx.int32, member.previous)
            mx.eval(payload)
            reply = _prefix_step(header, payload.tolist(), slots, prefixes, prefix_cache)
            link.send(mx.array(reply, dtype=mx.int32), member.next)
            continue
        if header.op == OP_MEASURE:
            before = link.recv((4 * member.rank,), mx.int32, member.previous).tolist() if not member.first else []
            with transport.layers(None):
                mine = cache_rates(model)
            if states_room:  # a full batch's states have room of their own here: none count against the KV budget
                mine = (mine[0], 0)
            link.send(mx.array(before + _pack_rates(mine), dtype=mx.int32), member.next)
            continue
        if header.op != transport.forward_op:
            raise StepHeaderError(f"{transport.member} {member.rank}: op {header.op} (step {header.step}) is not a "
                                  f"{transport.group}'s")
        cache = slots.forward_cache(header)
        verify = header.verify_mode
        if verify is not None and not probed:
            # Which linear layers this device computes a block of rows unlike one row (the leader probed its own):
            # this member's verify rows must round as its own decode steps do. Its own layers (a tensor member's
            # slice: the collectives off).
            probe(model, verify.moe)
            probed = True
        prefix = prefixes.get(header.slot)
        if prefix is not None and verify is None:
            prefix.arm(header.rows, cache)  # the leader's snapshot edges inside this prompt step
        with transport.layers(verify):
            if header.invariant:
                model.set_batch_invariant(True)
            try:
                x = transport.receive(header)
                if verify is None:
                    h = model.stage_hidden(x, cache)
                else:
                    with verify_call(model, cache, verify, x.shape[0] * x.shape[1]):
                        h = model.stage_hidden(x, cache)
            finally:
                if header.invariant:
                    model.set_batch_invariant(False)
        h = transport.outgoing(h)
        states = [c.state for c in cache if c.state is not None]
        prefix = prefixes.get(header.slot)
        if header.wire != WIRE_HOST:
            # Started, not waited for: the host reads the next header and builds the next step while the device
            # waits for this step's input, computes and sends (a prompt step the prefix cache snapshots is
            # waited for: its snapshots read the caches).
            mx.async_eval(transport.send_op(h, header.wire), *states)
            if note is not None:
                now = time.perf_counter()
                if launched is not None:
                    note("graph.wait", arrived - launched)
                note("graph.build", now - arrived)
                launched = now
            if prefix is not None and prefix.plan is not None:
                mx.eval(h, *states)
        else:
            mx.eval(h, *states)
            transport.send(h)
        if prefix is not None:
            prefix.step(header.rows, cache, h)
            if prefix.failed:  # its store raised (logged and counted): the sequence goes on without the cache
                del prefixes[header.slot]
        for b, (owner, n, row) in enumerate(slots.split_rows(header.slot)):  # prompts as rows: each one's own now
            mine = prefixes.get(owner)
            if mine is not None:  # as after its own prefill's step
                mine.step(n, row, h[b : b + 1, :n])
                if mine.failed:
                    del prefixes[owner]
        if on_step is not None:
            on_step()


def _receive_header(link: Link, stage: StageSpec, expected: int, forward_header: bool) -> StepHeader:
    """The leader's next message (a header, and its op records when they follow it), checked for order; passed on
    to the next member first when ``forward_header`` (it reads them while this one computes)."""
    message = link.recv((HEADER_LEN,), mx.int32, stage.previous)
    mx.eval(message)
    values = message.tolist()
    ops_message = None
    ops_length = StepHeader.ops_length_of(values)
    if ops_length > INLINE:
        ops_message = link.recv((ops_length,), mx.int32, stage.previous)
        mx.eval(ops_message)
    header = StepHeader.decode(values, ops_message.tolist() if ops_message is not None else None)
    if header.step != expected:
        raise StepHeaderError(f"pipeline stage {stage.rank}: step {header.step} arrived, expected step {expected} "
                              "(a message was lost or repeated)")
    if forward_header:
        link.send(message, stage.next)
        if ops_message is not None:
            link.send(ops_message, stage.next)
    return header


def _follow_prefixes(op: Op, slots: StageSlots, prefixes: dict[int, StagePrefix],
                     rows_of: dict[int, list[StagePrefix | None]]) -> None:
    """Keep each sequence's ``StagePrefix`` with its caches (applied after ``slots.apply(op)``): a member joining a
    batch takes its own along as its row, a filter reorders them, a drop ends them; STORE_END stores a reply."""
    if op.code == DROP:
        prefixes.pop(op.slot, None)
        rows_of.pop(op.slot, None)
    elif op.code == JOIN:
        member = prefixes.pop(op.args[0], None)
        if member is not None:
            member.plan = None  # its prefill is over once it joins a batch
        if slots.sizes[op.slot] == 1:
            rows_of[op.slot] = []
        rows_of.setdefault(op.slot, []).append(member)
    elif op.code == FILTER:
        rows = rows_of.get(op.slot, [])
        rows_of[op.slot] = [rows[i] if i < len(rows) else None for i in op.args]
    elif op.code == STORE_END:
        row, tokens = op.args[0], list(op.args[1:])
        if row == -1:
            prefix = prefixes.get(op.slot)
        else:
            rows = rows_of.get(op.slot, [])
            prefix = rows[row] if row < len(rows) else None
        if prefix is not None:
            prefix.store_end(tokens, slots.sequence(op.slot, row))
            if prefix.failed:  # its store raised (logged and counted): nothing more of it is stored
                if row == -1:
                    prefixes.pop(op.slot, None)
                else:
                    rows_of[op.slot][row] = None


def _prefix_step(header: StepHeader, values: list[int], slots: StageSlots, prefixes: dict[int, StagePrefix],
                 cache: PrefixCache | None) -> list[int]:
    """A stage's part of a LOOKUP or BEGIN round trip: the payload it passes on (``OP_PREFIX_LOOKUP``)."""
    try:
        if header.op == OP_PREFIX_LOOKUP:
            n = values[0]
            tokens, m = values[1 : 1 + n], values[1 + n]
            candidates = values[2 + n : 2 + n + m]
            if len(candidates) != m or len(values) != 2 + n + m:
                raise ValueError("lengths")
            prefix = prefixes[header.slot] = StagePrefix(cache)
            held = set(prefix.lookup(tokens, [p for p in candidates if p >= 0]))
            return values[: 2 + n] + [p if p in held else -1 for p in candidates]
        ok, position, has_group, *g, e = values[:8]
        edges = values[8:]
        if len(edges) != e or has_group not in (0, 1) or position < 0:
            raise ValueError("lengths")
        prefix = prefixes.get(header.slot)
        if ok != 1 or prefix is None:
            return [0, *values[1:]]  # (a BEGIN without its LOOKUP: the leader starts every stage from 0)
        group = f"{(g[0] << 48) | (g[1] << 32) | (g[2] << 16) | g[3]:016x}" if has_group else None
        slots.drop(header.slot)
        caches = slots.caches[header.slot] = slots.model.make_cache()
        restored = prefix.begin(caches, position, edges, group)
        if not restored:  # (a restore that failed touched nothing; fresh caches all the same, whatever failed)
            slots.caches[header.slot] = slots.model.make_cache()
        return [int(restored), *values[1:]]
    except (ValueError, IndexError):
        raise StepHeaderError(f"pipeline stage {slots.rank}: a malformed prefix payload of {len(values)} ints") from None
