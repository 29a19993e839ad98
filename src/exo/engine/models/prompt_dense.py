"""A prompt chunk's quantized products on dequantized weights: the GPU's dense matrix units instead of MLX's
quantized tiles, where a call has enough rows to be bound by arithmetic.

MLX's quantized product dequantizes inside its tiles (``qmm_sm80`` on an H200): ~100-120 TFLOP/s on the 9B's
layers at 2,048-4,096 rows. The same weights dequantized for the call (``mx.dequantize``, the call's own
transient) and multiplied by cuBLAS reach 420-570 TFLOP/s: the 9B's linears of a 4,096-token chunk went from
479 ms to 120 ms (4.0x), and one 35B-A3B MoE layer's experts (256 experts, top-8) from 42.8 ms to 6.3 ms (6.8x)
through the sorted ``gather_mm`` on dequantized experts (bench/results/h200-mlx-cuda-prefill-linears-2026-11-29.txt;
``bench/prefill_linears.py``, ``bench/moe_experts.py``). A decode step, a verify call and a batch step have few
rows and keep MLX's quantized product (``qmv``): nothing they compute changes.

- ``DenseRows`` (``make_dense_rows`` gives a layer the class ``DenseRows<its class>``): a quantized linear layer whose calls of ``MIN_ROWS`` rows or more, on a layer with
  enough weights (``MIN_WORK``: rows x outputs x inputs; small layers lose to the dequantization's launch),
  run ``x @ dequantize(w).T``.
- ``experts_dense``: a MoE block's experts on ``MIN_ROWS`` rows or more (the 35B-A3B's top-8 experts at 512 rows,
  4,096 (row, expert) pairs: 1.21x; at 4,096 rows 6.8x): mlx-lm's sort by expert, then ``gather_mm`` on each
  projection's experts dequantized. ``use_prompt_dense`` compares it with the unsorted quantized path on the
  first block at that many pairs before any block uses it (MLX CUDA's sorted gathers have returned wrong products
  before: ``layers.check_expert_sort``; on the CPU the quantized path's own bfloat16 error, ~8% of the scale on the
  35B-A3B's expert shapes, fails the check), and keeps it off where
  one projection's dequantized experts would take more than ``HEADROOM_SHARE`` of the device memory left.

The rounding is a dense product's, not MLX's quantized one's: a prompt's logits differ from stock mlx-lm's in
the last bits (docs/architecture.md names the op). ``EXO_PROMPT_DENSE``: ``auto`` (default: on MLX CUDA),
``off``, ``on`` (any device: unmeasured on Apple GPUs, where MLX's Metal product may already be near the
hardware), ``on:ROWS`` (any device, from ROWS rows: the CPU tests).

A batch step of many sequences (``EXO_BATCH_DENSE``): a plain decode step of a batch, one row per sequence
(x [B, 1, D]), of enough sequences, on a layer of ``BATCH_MIN_WEIGHTS`` weights or more, runs dense too. Its rows
otherwise go through exo's quantized kernel in launches of 8 (``kernels.cuda_qgemv``, every row summed alone), which
read the weights once per launch and multiply on the GPU's scalar units: on an H200 the 9B's gate_up_proj took
0.128 ms at one row and 0.676 ms at 32 (5.3x), the lm_head 0.36 and 4.8 ms (13.4x), and a 32-sequence step 45 ms
against 6.9 ms for one (``bench/batch_step.py``, 2026-11-30). Never in a batch-invariant step (each row must round
as its solo step does: ``exact_batch``, ``batch_vectors``), a verify call (``exact_verify``, and its [B, K + 1, D]
shape) or a prompt (more than one row per sequence). A batch's rows already round unlike their solo steps outside
the batch-invariant mode; this changes which bits.

Two ways, measured on the 9B shape on an H200 (docs/performance.md):

- **held** (``keep``, and ``auto`` where it fits): each such layer's weight dequantized once at load and held
  (``DenseRows.dense_kept``, not a parameter: nothing saved or sharded changes), so a batch step (and a prompt
  chunk) reads the dense weight: two bytes a weight for the process's life (16 GiB beside the 9B's 5.5 GB of 4-bit
  weights). A 32-sequence step 11.6 ms against 44.8 quantized (3.9x), 8 sequences 9.1 against 13.9 (1.5x); 32
  clients through ``exo serve`` 10x one client.
- **per call** (``on``): the weight dequantized for the call. On MLX CUDA a step's graph is enqueued ahead of the
  GPU and a buffer goes back only once the kernel that read it has run, so every layer's dequantized weight is
  allocated at once (a step's peak 38 GiB against 24 held) and past half of ``memory.limit_buffer_cache``'s bound
  the runner hands MLX's cache back at nearly every step (``memory.keep_cache_room``): a 32-sequence step 27.8 ms,
  and 16 sequences lose (0.93x).

Values: ``auto`` (default: on MLX CUDA, held from ``KEEP_MIN_ROWS`` sequences, the largest layers first while the
dense weights take at most ``HOLD_SHARE`` of the device memory left after the load; a layer not held keeps its own
product), ``off``, ``keep`` (MLX CUDA, held, from
``KEEP_MIN_ROWS``), ``keep:ROWS`` (any device, held, from ROWS sequences), ``on`` (MLX CUDA, per call, from
``BATCH_MIN_ROWS``), ``on:ROWS`` (any device, per call). Off MLX CUDA the ``:ROWS`` forms take a layer of any size
(the CPU tests); unmeasured on Apple GPUs.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..memory import device_memory_bytes

MIN_ROWS = 512  # rows of a call from which a layer may run dense (H200: the 9B's large layers 1.4-2.2x at 512)
MIN_WORK = 2**33  # rows x outputs x inputs: 512 rows of a 16M-weight layer, 2,048 of a 4M one (both faster)
CHECK_TOLERANCE = 0.05  # relative, as layers.SORTED_EXPERTS_TOLERANCE: bfloat16 rounding of two paths ~6e-3
HEADROOM_SHARE = 0.125  # one projection's dequantized experts may take this share of the memory left
BATCH_MIN_ROWS = 24  # a batch step's sequences from which ``EXO_BATCH_DENSE=on`` (per call) pays (H200: 16 0.93x, 24 1.27x)
KEEP_MIN_ROWS = 8  # the same for held weights (H200: 8 sequences 1.52x; fewer unmeasured)
HOLD_SHARE = 0.25  # ``auto`` holds the dense weights where they take at most this share of the memory left
BATCH_MIN_WEIGHTS = 2**24  # outputs x inputs: a 4096 x 4096 layer or larger (smaller ones: the dequantization's launch)
NEVER = 2**62  # a row count no call reaches: the prompt rule off


_suspended = False  # ``suspended()``: a benchmark's same-model comparison with MLX's quantized products
_transient = False  # ``transient()``: a benchmark's comparison of held dense weights with dequantizing per call


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Within the block every layer and MoE block given the dense path takes MLX's quantized product (graphs
    built inside it). For benchmarks that compare both on one loaded model."""
    global _suspended
    before, _suspended = _suspended, True
    try:
        yield
    finally:
        _suspended = before


@contextlib.contextmanager
def transient() -> Iterator[None]:
    """Within the block a layer holding its dense weight (``keep``) dequantizes it for each call instead (graphs
    built inside it). For benchmarks."""
    global _transient
    before, _transient = _transient, True
    try:
        yield
    finally:
        _transient = before


def active() -> bool:
    return not _suspended


def state() -> tuple[bool, bool]:
    """(dense paths on, held dense weights used): what a compiled graph's key must tell apart."""
    return not _suspended, not _transient


def _on_rows(value: str) -> int | None:
    """ROWS of an ``on:ROWS`` value (a whole number above 0), else None."""
    head, _, rows = value.partition(":")
    return int(rows) if head == "on" and rows.isdigit() and int(rows) > 0 else None


def setting() -> tuple[str, int]:
    """``EXO_PROMPT_DENSE`` -> (where, min rows): ("cuda", MIN_ROWS) by default, ("off", 0), ("always", rows)."""
    value = os.environ.get("EXO_PROMPT_DENSE", "auto").strip().lower()
    if value in ("auto", ""):
        return "cuda", MIN_ROWS
    if value in ("off", "0"):
        return "off", 0
    if value in ("on", "1"):
        return "always", MIN_ROWS
    if (rows := _on_rows(value)) is not None:
        return "always", rows
    raise ValueError(f"EXO_PROMPT_DENSE must be auto, off, on or on:<rows>, not {value!r}")


def batch_setting() -> tuple[str, int, bool]:
    """``EXO_BATCH_DENSE`` -> (where, min sequences, weights held): ("auto", KEEP_MIN_ROWS, True) by default,
    ("off", 0, False), ("cuda", KEEP_MIN_ROWS, True) for ``keep``, ("always", ROWS, True) for ``keep:ROWS``,
    ("cuda", BATCH_MIN_ROWS, False) for ``on``, ("always", ROWS, False) for ``on:ROWS``."""
    value = os.environ.get("EXO_BATCH_DENSE", "auto").strip().lower()
    if value in ("auto", ""):
        return "auto", KEEP_MIN_ROWS, True
    if value in ("off", "0"):
        return "off", 0, False
    keep = value == "keep" or value.startswith("keep:")
    if keep:
        value = "on" + value[len("keep"):]
    if value in ("on", "1"):
        return "cuda", KEEP_MIN_ROWS if keep else BATCH_MIN_ROWS, keep
    if (rows := _on_rows(value)) is not None:
        return "always", rows, keep
    raise ValueError(f"EXO_BATCH_DENSE must be auto, off, keep, keep:<rows>, on or on:<rows>, not {value!r}")


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def dense_weight(module: nn.Module, dtype: mx.Dtype) -> mx.array:
    """A quantized layer's (or experts') weight dequantized to ``dtype``: [..., outputs, inputs]."""
    return mx.dequantize(module["weight"], module["scales"], module.get("biases"), group_size=module.group_size,
                         bits=module.bits, mode=module.mode, dtype=dtype)


class DenseRows:
    """Calls of ``dense_min_rows`` rows or more (and ``MIN_WORK``) run on the weight dequantized for the call, and
    a batch's plain decode step of ``dense_batch_rows`` sequences or more on a layer of ``dense_batch_weights``."""

    dense_min_rows = MIN_ROWS
    dense_min_work = MIN_WORK
    dense_batch_rows = 0  # 0: batch steps keep the layer's own product
    dense_batch_weights = BATCH_MIN_WEIGHTS
    dense_kept: mx.array | None = None  # the weight dequantized at load (``EXO_BATCH_DENSE=keep``), else None

    def _batch_step(self, x: mx.array, rows: int, n: int, k: int) -> bool:
        """A batch's plain decode step (one row per sequence) the batch rule takes: not a batch-invariant step's
        rows, not a verify call's."""
        return (0 < self.dense_batch_rows <= rows and x.ndim == 3 and x.shape[1] == 1
                and n * k >= self.dense_batch_weights
                and not (getattr(self, "exact_batch", False) or getattr(self, "exact_verify", False)
                         or getattr(self, "batch_vectors", False)))

    def __call__(self, x: mx.array) -> mx.array:
        k = x.shape[-1]
        rows = x.size // k if k else 0
        n = self["weight"].shape[0]  # type: ignore[index]
        prompt = rows >= self.dense_min_rows and rows * n * k >= self.dense_min_work
        if _suspended or not (prompt or self._batch_step(x, rows, n, k)):
            return super().__call__(x)  # type: ignore[misc]
        kept = self.dense_kept
        if (kept is not None and kept.dtype == x.dtype and not _transient
                and self.__dict__.get("dense_kept_of") is self["weight"]):  # type: ignore[index]
            w = kept
        else:  # (none held, or the weight replaced since, e.g. by load_weights: never a stale copy)
            w = dense_weight(self, x.dtype)  # type: ignore[arg-type]
        y = x @ w.T
        if "bias" in self:  # type: ignore[operator]
            y = y + self["bias"]  # type: ignore[index]
        return y


_DENSE_CLASSES: dict[type, type] = {}


def make_dense_rows(module: nn.QuantizedLinear, min_rows: int, min_work: int, batch_rows: int = 0,
                    batch_weights: int = BATCH_MIN_WEIGHTS) -> None:
    """Give a quantized linear layer (of whatever exo class it has) the dense path for large calls (``min_rows``:
    ``NEVER`` for none), and for batch steps of ``batch_rows`` sequences or more (0: none)."""
    cls = type(module)
    if not issubclass(cls, DenseRows):
        if cls not in _DENSE_CLASSES:
            _DENSE_CLASSES[cls] = type(f"DenseRows{cls.__name__}", (DenseRows, cls), {})
        module.__class__ = _DENSE_CLASSES[cls]
    module.dense_min_rows = min_rows  # type: ignore[attr-defined]
    module.dense_min_work = min_work  # type: ignore[attr-defined]
    module.dense_batch_rows = batch_rows  # type: ignore[attr-defined]
    module.dense_batch_weights = batch_weights  # type: ignore[attr-defined]


def experts_dense(switch: nn.Module, x: mx.array, indices: mx.array) -> mx.array:
    """mlx-lm's ``SwitchGLU`` forward (rows sorted by expert) with each projection a ``gather_mm`` on its experts
    dequantized for the call: x [..., D], indices [..., k] -> [..., k, D]."""
    k = indices.shape[-1]
    flat = mx.stop_gradient(indices).flatten()
    order = mx.argsort(flat)
    inverse = mx.argsort(order)
    rows = mx.expand_dims(x.reshape(-1, x.shape[-1]), -2)[order // k]
    idx = flat[order]

    dtype = x.dtype if mx.default_device() == mx.gpu else mx.float32  # MLX's CPU gather_mm takes float32 only

    def project(v: mx.array, layer: nn.Module) -> mx.array:
        w = dense_weight(layer, dtype).swapaxes(-1, -2)
        out = mx.gather_mm(v.astype(dtype), w, rhs_indices=idx, sorted_indices=True).astype(x.dtype)
        if "bias" in layer:
            out = out + mx.expand_dims(layer["bias"][idx], -2)
        return out

    up = project(rows, switch.up_proj)
    gate = project(rows, switch.gate_proj)
    y = project(switch.activation(up, gate), switch.down_proj).squeeze(-2)
    return y[inverse].reshape(*indices.shape, y.shape[-1])


def _quantized_experts(switch: nn.Module) -> bool:
    return all(hasattr(getattr(switch, name, None), "scales")
               for name in ("up_proj", "gate_proj", "down_proj"))


def check_experts(block: Any, pairs: int, reference: Callable[..., mx.array]) -> tuple[bool, str]:
    """Whether ``experts_dense`` computes what ``reference`` (the unsorted quantized path,
    ``layers.experts_unsorted``: layers imports this module) does on ``block``'s experts at ``pairs`` random
    (row, expert) pairs, and fits in memory: (ok, what was found)."""
    switch = block.switch_mlp
    down = switch.down_proj
    experts, dtype = down.num_experts, down.scales.dtype
    transient = experts * down.input_dims * down.output_dims * dtype.size  # one projection's dense experts
    total = device_memory_bytes()
    left = total - mx.get_active_memory()
    if total and transient > HEADROOM_SHARE * left:
        return False, f"one projection's dense experts ({transient / 2**30:.2f} GiB) exceed {HEADROOM_SHARE:.0%} " \
                      f"of the memory left ({left / 2**30:.1f} GiB)"
    top_k = min(block.top_k, experts)
    rows = max(2, -(-pairs // top_k))
    key = mx.random.key(20261129)
    x = (mx.random.normal((1, rows, switch.up_proj.input_dims), key=key) * 0.5).astype(dtype)
    order = mx.argsort(mx.random.uniform(shape=(1, rows, experts), key=mx.random.split(key)[0]), axis=-1)
    indices = order[..., :top_k].astype(mx.uint32)
    dense, want = experts_dense(switch, x, indices), reference(switch, x, indices)
    scale = mx.maximum(mx.abs(want.astype(mx.float32)).max(), 1e-6)
    difference = float((mx.abs(dense.astype(mx.float32) - want.astype(mx.float32)).max() / scale).item())
    if difference > CHECK_TOLERANCE:
        return False, f"the dense experts differ from the quantized ones by {difference:.3g} (relative)"
    return True, f"relative difference {difference:.2e} at {rows * top_k} pairs"


def _shape(leaf: nn.QuantizedLinear) -> tuple[int, int]:
    """A quantized linear layer's (outputs, inputs)."""
    return leaf.weight.shape[0], leaf.weight.shape[1] * 32 // leaf.bits


def _dense_bytes(leaf: nn.QuantizedLinear) -> int:
    """A quantized linear layer's weight dequantized to its scales' type, in bytes."""
    n, k = _shape(leaf)
    return n * k * leaf.scales.dtype.size


def _to_hold(layers: Sequence[nn.QuantizedLinear], hold_all: bool) -> tuple[set[int], str]:
    """The layers (``id``) whose dense weight is held, and why the others are not ("": all held). ``hold_all``
    (``keep``): every one. Else (``auto``) the largest first while they take at most ``HOLD_SHARE`` of the device
    memory left: the lm_head first, the layer a batch step's quantized rows cost most (13.4x one row at 32 on an
    H200), so a model too large to hold whole (the 27B beside an H200's 124 GiB left) still holds what pays most."""
    if hold_all:
        return {id(leaf) for leaf in layers}, ""
    total = device_memory_bytes()
    if not total:
        return set(), "the device's memory is unknown"
    left = total - mx.get_active_memory()
    budget, used, chosen = HOLD_SHARE * left, 0, set()
    for leaf in sorted(layers, key=_dense_bytes, reverse=True):
        if used + _dense_bytes(leaf) <= budget:
            chosen.add(id(leaf))
            used += _dense_bytes(leaf)
    if len(chosen) == len(layers):
        return chosen, ""
    whole = sum(_dense_bytes(leaf) for leaf in layers)
    return chosen, (f"{len(layers) - len(chosen)} of {len(layers)} layers not held: the dense weights "
                    f"({whole / 2**30:.2f} GiB) would take more than {HOLD_SHARE:.0%} of the memory left "
                    f"({left / 2**30:.1f} GiB)")


def use_prompt_dense(modules: Sequence[nn.Module], blocks: Sequence[Any],
                     reference: Callable[..., mx.array] | None = None, lazy: bool = False) -> dict[str, str]:
    """Give the quantized linear layers of ``modules`` (a backbone, the MTP head) the dense path for prompt-sized
    calls, and the quantized MoE ``blocks`` dense experts where ``check_experts`` passes against ``reference``.
    Returns what was done (``"dense 4096->12288 4-bit g64"`` -> ``"ok: from 512 rows"``); nothing unless
    ``setting`` allows it here. Where ``EXO_BATCH_DENSE`` holds weights (``auto``: those ``_to_hold`` chooses;
    ``keep``: all) the batch rule's layers hold their weight dequantized (evaluated here unless ``lazy``: then at its
    first use), and a layer not held keeps its own product in batch steps."""
    where, min_rows = setting()
    batch_where, batch_rows, keep = batch_setting()
    prompts = not (where == "off" or (where == "cuda" and not on_cuda()))
    batches = batch_where == "always" or (batch_where in ("cuda", "auto") and on_cuda())
    if not (prompts or batches):
        return {}
    min_work = MIN_WORK if where == "cuda" else 0
    batch_weights = BATCH_MIN_WEIGHTS if on_cuda() else 0  # (off MLX CUDA: any layer, for the CPU tests)
    leaves = [leaf for tree in modules for _, leaf in tree.named_modules()
              if isinstance(leaf, nn.QuantizedLinear) and leaf.weight.ndim == 2]
    large = [leaf for leaf in leaves if math.prod(_shape(leaf)) >= batch_weights]
    hold, why = _to_hold(large, batch_where != "auto") if batches and keep else (set(), "")
    found: dict[str, str] = {}
    shapes: dict[str, list[int]] = {}  # batch rule: shape -> [layers held or dense per call, layers]
    kept: list[mx.array] = []
    for leaf in leaves:
        n, k = _shape(leaf)
        name = f"{k}->{n} {leaf.bits}-bit g{leaf.group_size}"
        dense_batch = batches and n * k >= batch_weights and (not keep or id(leaf) in hold)
        if prompts or dense_batch:
            make_dense_rows(leaf, min_rows if prompts else NEVER, min_work, batch_rows if dense_batch else 0,
                            batch_weights)
        if prompts:
            smallest = max(min_rows, -(-min_work // (n * k)))
            found[f"dense {name}"] = f"ok: from {smallest} rows"
        if not batches:
            continue
        if n * k < batch_weights:
            found[f"dense batch {name}"] = f"not used: {n * k} weights, under {batch_weights}"
            continue
        if dense_batch and keep:  # (not a child module: no parameter, nothing saved)
            object.__setattr__(leaf, "dense_kept", dense_weight(leaf, leaf.scales.dtype))
            object.__setattr__(leaf, "dense_kept_of", leaf.weight)  # the weight it was dequantized from
            kept.append(leaf.dense_kept)
        count = shapes.setdefault(name, [0, 0])
        count[0] += dense_batch
        count[1] += 1
    for name, (dense, total) in shapes.items():
        how = ", held" if keep else ""
        found[f"dense batch {name}"] = (f"ok: from {batch_rows} sequences{how}" if dense == total
                                       else f"ok: from {batch_rows} sequences, {dense} of {total} held" if dense
                                       else "not used: not held (no room)")
    if kept:
        if not lazy:
            mx.eval(kept)
        found["dense weights held"] = (f"ok: {sum(w.nbytes for w in kept) / 2**30:.2f} GiB in {len(kept)} layers"
                                       + (f" ({why})" if why else ""))
    elif why:
        found["dense batch"] = f"not used: {why}"
    quantized = [b for b in blocks if _quantized_experts(b.switch_mlp)]
    if prompts and quantized and reference is not None:
        pairs = min_rows * quantized[0].top_k  # (row, expert) pairs of a call of min_rows rows
        passed, what = check_experts(quantized[0], pairs, reference)
        found[f"dense experts from {min_rows} rows"] = ("ok: " if passed else "not used: ") + what
        for block in quantized:
            block.dense_experts_from = min_rows * block.top_k if passed else 0
    return found
