"""Backbone layers extended for speculative verification, by subclassing mlx-lm's own classes.

Two things plain decoding never needs and speculative decoding does:

- GatedDeltaNet state cannot be trimmed like a KV cache. During a verify call the layer records the
  conv window and the recurrent state after every row, so the round can commit exactly the accepted
  prefix (``RollbackArraysCache.commit``). The recurrence of a recorded call runs one row at a time,
  the same computation a decode step does, so the committed state equals plain decoding's.
- A batched MoE router (M > 1 rows) can choose other top-k experts than decode's M = 1 router on near
  ties, and then verification no longer reproduces sequential decoding. ``route_locked`` computes the
  (small) router row by row and runs the experts batched; ``safe`` runs the whole block row by row.

Parameter names are unchanged, so mlx-lm's ``sanitize`` and weight loading apply as they are.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import precise_swiglu, swiglu
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import ArraysCache, BatchKVCache
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk
from mlx_lm.models.qwen3_5 import GatedDeltaNet as Qwen35GatedDeltaNet
from mlx_lm.models.qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextGatedDeltaNet,
    Qwen3NextMLP,
    Qwen3NextRMSNormGated,
    Qwen3NextSparseMoeBlock,
)

from ..kernels import cuda_qgemv
from . import gated_delta_states_cuda as states_cuda
from . import long_attention, positions, prompt_dense
from .gated_delta_chunked import gated_delta_chunked_update
from .prompt_dense import experts_dense

MoEVerifyMode = Literal["route_locked", "batched", "safe"]


# -- norms fused on MLX's CPU backend ------------------------------------------------------------------
# MLX's CPU backend has no kernel for ``mx.fast.rms_norm``: each norm expands into ~10 elementwise ops
# around a reduction, every one dispatched on its own; a decode step runs one or two norms per layer, and on
# the CPU a small model's step costs mostly its ops' dispatch. Through ``mx.compile`` the elementwise ops
# around the reduction fuse: fewer ops a step, the same values bit for bit (tests/engine/test_layers.py;
# the ops and tokens/s saved: docs/performance.md, "The code's reasons": fused norms on the CPU). On a GPU the fused kernel runs as it is. ``cpu_compatible`` (loader) gives a model these classes on the CPU backend.


def _fused_on_cpu(fn: Any) -> Any:
    compiled = mx.compile(fn)

    def call(*args: Any) -> Any:
        return compiled(*args) if mx.default_device() == mx.cpu else fn(*args)

    call.__doc__, call.__name__ = fn.__doc__, fn.__name__
    return call


@_fused_on_cpu
def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm(x, weight, eps)``, fused on the CPU backend."""
    return mx.fast.rms_norm(x, weight, eps)


@_fused_on_cpu
def _gated_rms_norm(x: mx.array, gate: mx.array, weight: mx.array, eps: float) -> mx.array:
    return precise_swiglu(x, gate, mx.fast.rms_norm(x, weight, eps))  # Qwen3NextRMSNormGated with a gate


@_fused_on_cpu
def fused_normalize_qk(q: mx.array, k: mx.array, inv_scale: float, eps: float) -> tuple[mx.array, mx.array]:
    """mlx-lm's ``normalize_qk`` (GatedDeltaNet's q/k L2 norms), fused on the CPU backend."""
    return normalize_qk(q, k, inv_scale=inv_scale, eps=eps)


class FusedRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose norm is fused on the CPU backend (same parameters)."""

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


class FusedRMSNormGated(Qwen3NextRMSNormGated):
    """mlx-lm's gated RMSNorm (GatedDeltaNet's output norm), fused on the CPU backend (same parameters)."""

    def __call__(self, hidden_states: mx.array, gate: mx.array | None = None) -> mx.array:
        if gate is None:
            return super().__call__(hidden_states)
        return _gated_rms_norm(hidden_states, gate, self.weight, self.eps)


def fuse_norms(module: nn.Module) -> None:
    """Give ``module``'s RMSNorms (plain and gated) their fused class."""
    for _, leaf in module.named_modules():
        if type(leaf) is nn.RMSNorm:
            leaf.__class__ = FusedRMSNorm
        elif type(leaf) is Qwen3NextRMSNormGated:
            leaf.__class__ = FusedRMSNormGated


# -- linear layers through exo's CPU kernel --------------------------------------------------------------
# On MLX's CPU backend on x86-64, a bfloat16 matmul is simd_gemm, a scalar loop there: most of a small
# model's decode step, and its cost grows with every row of a batch (docs/performance.md, "The code's reasons": a bfloat16
# matmul on MLX's CPU backend). ``kernels.cpu_linear`` computes the same
# sums in the same order with AVX2 (bit-identical). ``cpu_compatible`` (loader) gives a model's bias-free
# linear layers and embedding tables (``as_linear``: a tied lm_head) these classes where the kernel is built.


def _kernel_applies(x: mx.array, weight: mx.array) -> bool:
    return x.dtype == mx.bfloat16 and weight.dtype == mx.bfloat16 and mx.default_device() == mx.cpu


class _Packed:
    """A weight packed for ``kernels.linear_packed`` and the weight it was packed from (a layer whose weight
    is replaced, e.g. by ``load_weights``, packs the new one at its next call)."""

    __slots__ = ("array", "weight")

    def __init__(self, weight: mx.array) -> None:
        from ..kernels import pack_linear

        self.weight = weight
        self.array = pack_linear(weight)
        mx.eval(self.array)


def _packed_product(module: nn.Module, x: mx.array, weight: mx.array) -> mx.array:
    packed = module.__dict__.get("_exo_packed")
    if packed is None or packed.weight is not weight:
        packed = _Packed(weight)
        object.__setattr__(module, "_exo_packed", packed)  # not a parameter: outside the module's tree
    return module.kernel(x, packed.array, weight.shape[0])


class CpuLinear(nn.Linear):
    """``nn.Linear`` without bias whose product runs on exo's CPU kernel (same parameters, same values; the
    kernel's packed copy of the weight is kept next to it)."""

    kernel: Any = None

    def __call__(self, x: mx.array) -> mx.array:
        if _kernel_applies(x, self["weight"]):
            return _packed_product(self, x, self["weight"])
        return super().__call__(x)


class CpuMLP(Qwen3NextMLP):
    """mlx-lm's dense MLP whose ``swiglu`` runs on exo's CPU kernel (``kernels.silu``, the same bits) for bfloat16:
    MLX's compiled swiglu calls libm's ``fmaf`` per coefficient of its exp there, a visible part of a batched
    step (docs/performance.md, "The code's reasons": exo's swiglu kernel)."""

    kernel: Any = None

    def gate_up(self, x: mx.array) -> tuple[mx.array, mx.array]:
        return self.gate_proj(x), self.up_proj(x)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_up(x)
        if gate.dtype == mx.bfloat16 and up.dtype == mx.bfloat16 and gate.shape == up.shape and mx.default_device() == mx.cpu:
            return self.down_proj(self.kernel(gate, up))
        return self.down_proj(swiglu(gate, up))


def _fused_gate_up(mlp: nn.Module, x: mx.array) -> tuple[mx.array, mx.array]:
    gate, up = mx.split(mlp.gate_up_proj(x), mlp.fused_inputs, axis=-1)
    return gate, up


class FusedMLP(Qwen3NextMLP):
    """mlx-lm's dense MLP whose gate and up projections are one product (``gate_up_proj``, split after it:
    ``models.fused_inputs``), the same values."""

    fused_inputs: tuple[int, ...] = ()

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(*_fused_gate_up(self, x)))


class FusedCpuMLP(CpuMLP):
    """``CpuMLP`` whose gate and up projections are one product (``models.fused_inputs``)."""

    fused_inputs: tuple[int, ...] = ()
    gate_up = _fused_gate_up


def _silu(layer: nn.Module, x: mx.array) -> mx.array:
    kernel = getattr(layer, "cpu_silu", None)  # exo's CPU kernel (``use_cpu_kernels``) where built
    if kernel is not None and x.dtype == mx.bfloat16 and mx.default_device() == mx.cpu:
        return kernel(x)
    return nn.silu(x)


class CpuEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (a tied lm_head) runs on exo's CPU kernel."""

    kernel: Any = None

    def as_linear(self, x: mx.array) -> mx.array:
        if _kernel_applies(x, self.weight):
            return _packed_product(self, x, self.weight)
        return super().as_linear(x)


def use_cpu_kernels(module: nn.Module) -> bool:
    """Give ``module``'s bias-free linear layers, embedding tables and dense MLPs their CPU-kernel class, and
    its GatedDeltaNet layers the CPU recurrence and conv activation; False (nothing changed) where the kernels do not apply or are
    not built (``kernels.status()`` says why)."""
    from ..kernels import cpu_gated_delta, cpu_linear, cpu_linear_packed, cpu_silu

    linear = cpu_linear_packed()
    if linear is None:
        return False
    CpuLinear.kernel = CpuEmbedding.kernel = staticmethod(linear)
    CpuMLP.kernel = staticmethod(cpu_silu())
    for _, leaf in module.named_modules():
        if type(leaf) is nn.Linear and "bias" not in leaf:
            leaf.__class__ = CpuLinear
        elif type(leaf) is nn.Embedding:
            leaf.__class__ = CpuEmbedding
        elif type(leaf) is Qwen3NextMLP:
            leaf.__class__ = CpuMLP
        elif isinstance(leaf, (GatedDeltaNet, NextGatedDeltaNet)):
            leaf.cpu_gated_delta = cpu_gated_delta()  # its recurrence (``_recurrence``)
            leaf.cpu_silu = cpu_silu()  # its conv's activation (``_mix``)
        elif isinstance(leaf, Qwen3NextAttention) and cpu_attention_matches():
            if type(leaf) is Qwen3NextAttention:
                leaf.__class__ = Attention  # (the MTP head's layer: the same parameters, exo's call)
            leaf.cpu_linear = cpu_linear()  # its attention's two products (``cpu_attention``)
        if type(leaf) in (CpuLinear, CpuEmbedding) and leaf.weight.dtype == mx.bfloat16 and leaf.weight.ndim == 2:
            object.__setattr__(leaf, "_exo_packed", _Packed(leaf.weight))  # packed now, not in a step
    return True


# -- quantized linear layers through exo's kernel on MLX CUDA --------------------------------------------
# MLX CUDA's one-row quantized product reads the weights at a fraction of the memory's bandwidth, and sums a block
# of rows by reading the weights again per row. ``kernels.cuda_qgemv`` computes 1-8 rows in one launch, each row's
# sums in an order that does not depend on the rows (so a verify call's rows round as their decode steps do, by
# construction), near the memory's bandwidth. ``use_qgemv`` (the loader, on MLX CUDA unless ``EXO_QGEMV=0``) gives
# the model's and the head's quantized linear layers and quantized embeddings (their ``as_linear``: a tied lm_head)
# these classes, shape by shape, where the kernel checks out on the device. Calls of more than ``CALL_ROWS`` rows (a
# prompt's chunks) keep MLX's product unless a verify call or a batch-invariant step needs every row exact.


QGEMV_ON = True  # benchmarks switch the installed kernel off and on within one process (A/B)


def _qgemv_takes(module: nn.Module, x: mx.array) -> bool:
    rows = x.size // x.shape[-1] if x.ndim else 0
    return (QGEMV_ON and x.dtype in cuda_qgemv.DTYPES and 0 < rows
            and (rows <= cuda_qgemv.CALL_ROWS or module.exact_verify or module.exact_batch))


class QGemvLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose decode-sized calls run exo's kernel (same parameters)."""

    exact_verify = False  # set on instances around a verify call: every row through the kernel
    exact_batch = False  # set on instances around a batch-invariant step

    def __call__(self, x: mx.array) -> mx.array:
        if _qgemv_takes(self, x):
            return cuda_qgemv.module_product(self, x)
        return super().__call__(x)


class QGemvEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied lm_head) runs exo's kernel for decode-sized calls."""

    exact_verify = False
    exact_batch = False

    def as_linear(self, x: mx.array) -> mx.array:
        if _qgemv_takes(self, x):
            return cuda_qgemv.module_product(self, x)
        return super().as_linear(x)


def use_qgemv(modules: Sequence[nn.Module]) -> dict[str, str]:
    """Give the quantized linear layers and embeddings of ``modules`` (a backbone, the MTP head) exo's kernel
    classes, for each distinct shape where ``kernels.cuda_qgemv.check`` passes on this device (else MLX's product
    stays for that shape). Returns what was found per shape (``"qgemv 4096->12288 4-bit g64 bfloat16"`` ->
    ``"ok: ..."`` or why not). Nothing where ``EXO_QGEMV=0``, or off MLX CUDA unless ``EXO_QGEMV=always``."""
    mode = cuda_qgemv.mode()
    if mode == "off" or (mode == "cuda" and not cuda_qgemv.on_cuda()):
        return {}
    shapes: dict[tuple[Any, ...], list[nn.Module]] = {}
    for tree in modules:
        for _, leaf in tree.named_modules():
            if type(leaf) in (nn.QuantizedLinear, nn.QuantizedEmbedding) and cuda_qgemv.supported(leaf):
                signature = (tuple(leaf["weight"].shape), leaf.bits, leaf.group_size, leaf["scales"].dtype)
                shapes.setdefault(signature, []).append(leaf)
    found: dict[str, str] = {}
    for (shape, bits, group, dtype), leaves in shapes.items():
        name = f"qgemv {shape[1] * 32 // bits}->{shape[0]} {bits}-bit g{group} {dtype}".replace("mlx.core.", "")
        passed, what = cuda_qgemv.check(leaves[0])
        found[name] = ("ok: " if passed else "not used: ") + what
        if passed:
            for leaf in leaves:
                leaf.__class__ = QGemvLinear if isinstance(leaf, nn.QuantizedLinear) else QGemvEmbedding
    return found


class _RowwiseLinear:
    """A linear layer whose multi-row calls compute each row alone while ``per_row`` is set: during a
    verify call, on a device whose kernel for this shape rounds a block of rows differently from one row
    (``verify.probe`` finds them; ``make_rowwise`` applies it).

    ``as_vectors``: all rows in ONE call of ``vector_matmul`` (a plain linear layer without bias only),
    which the probe chose only where it measured it equal to the one-row calls; otherwise one call per row."""

    per_row = False
    as_vectors = False
    batch_vectors = False  # every row (of every sequence of a batch) as a one-row product: batch-invariant steps

    def __call__(self, x: mx.array) -> mx.array:
        if self.batch_vectors and x.size > x.shape[-1]:
            return vector_matmul(x, self.weight)  # type: ignore[attr-defined]
        rows = x.shape[-2] if x.ndim >= 2 else 1
        if not self.per_row or rows == 1:
            return super().__call__(x)  # type: ignore[misc]
        if self.as_vectors:
            return vector_matmul(x, self.weight)  # type: ignore[attr-defined]
        call = super().__call__  # type: ignore[misc]
        return mx.concatenate([call(row) for row in mx.split(x, rows, axis=-2)], axis=-2)


def vector_matmul(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T`` for x [..., R, K], weight [N, K], with every row a matrix-vector product of its own,
    all in one call: each row rounds as a one-row call (a decode step) rounds, where a block of rows may not.

    MLX folds the rows of a batch of matrices times one shared weight into a single tall GEMM (in
    ``matmul`` itself, and again in the CUDA backend for contiguous row blocks), so the rows go as n
    one-row matrices laid out as transposed 1 x K blocks (strides (K, 1, 1)) against the weight broadcast
    over n (no copy): nothing folds them, and MLX CUDA runs its batched matrix-vector kernel, the
    arithmetic of a one-row call's ``gemv``, in one launch."""
    k, n_out = x.shape[-1], weight.shape[0]
    flat = mx.contiguous(x).reshape(-1, k)
    n = flat.shape[0]
    vectors = mx.as_strided(flat, (n, 1, k), (k, 1, 1))
    out = vectors @ mx.broadcast_to(weight.T, (n, k, n_out))
    return out.reshape(*x.shape[:-1], n_out)


def vectors_apply(module: nn.Module) -> bool:
    """Whether ``vector_matmul`` can stand in for this layer (a plain linear layer without bias)."""
    return isinstance(module, nn.Linear) and "bias" not in module


_ROWWISE_CLASSES: dict[type, type] = {}


def make_rowwise(module: nn.Module) -> None:
    """Give a Linear / QuantizedLinear the per-row verify path (weights and behaviour otherwise unchanged)."""
    cls = type(module)
    if issubclass(cls, _RowwiseLinear):
        return
    if cls not in _ROWWISE_CLASSES:
        _ROWWISE_CLASSES[cls] = type(f"Rowwise{cls.__name__}", (_RowwiseLinear, cls), {})
    module.__class__ = _ROWWISE_CLASSES[cls]


def _window(rows: mx.array) -> mx.array:
    """A decode-sized call's next conv window, cut from its small conv input: one sequence's rows are contiguous
    already (a view, no node beyond the slice: a step is the host's work per node on MLX CUDA); a batch's are
    copied contiguous."""
    return rows if rows.shape[0] == 1 else mx.contiguous(rows)


class RollbackArraysCache(ArraysCache):
    """GatedDeltaNet cache ([0] conv window, [1] recurrent state) that can keep a verified prefix."""

    def __init__(self) -> None:
        super().__init__(size=2)
        self.recording = False
        self._conv_input: mx.array | None = None
        self._states: list[mx.array] | None = None
        self._after: mx.array | None = None  # or the states after each row stacked [T, B, ...] (``record``'s ``after``)
        # A prompt chunk's snapshot edges inside it (offsets from the chunk's first row, ``arm``): the layer keeps
        # (conv window, recurrent state) after that many rows in ``captured`` (a prefix cache's snapshot there)
        self.capture_at: tuple[int, ...] = ()
        self.captured: dict[int, tuple[mx.array, mx.array]] = {}

    def arm(self, offsets: Sequence[int]) -> None:
        """The next call (a prompt chunk) keeps its state after each of ``offsets`` rows (0 < offset < rows)."""
        self.capture_at, self.captured = tuple(sorted(offsets)), {}

    def record(self, conv_input: mx.array, states: list[mx.array], after: mx.array | None = None) -> None:
        """``states[0]`` is the state before the call, ``states[t]`` the state after row t; or, with ``after``
        (the states after each row stacked, [T, B, ...], as exo's GatedDeltaNet kernel writes them), ``states``
        is ``[before]`` and the row a commit keeps is taken from ``after`` then: no graph node per row (on MLX
        CUDA a verify call is the host's work, per node)."""
        self._conv_input, self._states, self._after = conv_input, states, after

    def _recorded_rows(self) -> int:
        assert self._states is not None
        return len(self._states) - 1 if self._after is None else self._after.shape[0]

    def _state_after(self, r: int) -> mx.array:
        """The recorded state after the first ``r`` rows (a view of ``after``'s row where stacked)."""
        assert self._states is not None
        if self._after is None or r == 0:
            return self._states[r]
        return self._after[r - 1 : r].reshape(self._after.shape[1:])

    def commit(self, rows: int | Sequence[int]) -> None:
        """Keep the state after the first ``rows`` rows (0: as before) of the last recorded call; in a batch,
        ``rows`` may give each sequence (batch row) its own count: its state is gathered from that row."""
        if self._states is None or self._conv_input is None:
            raise RuntimeError("commit() without a recorded verify call")
        recorded_rows = self._recorded_rows()
        n_keep = self._conv_input.shape[1] - recorded_rows
        counts = [rows] if isinstance(rows, int) else list(rows)
        if any(not 0 <= r <= recorded_rows for r in counts):
            raise ValueError(f"commit({rows}) outside 0..{recorded_rows}")
        if isinstance(rows, int) or len(set(counts)) == 1:
            r = counts[0]
            self[0] = _window(self._conv_input[:, r : r + n_keep])
            self[1] = self._state_after(r)
        else:
            if len(counts) != self._conv_input.shape[0]:
                raise ValueError(f"commit() of {len(counts)} sequences, the call had {self._conv_input.shape[0]}")
            self[0] = mx.concatenate([self._conv_input[b : b + 1, r : r + n_keep] for b, r in enumerate(counts)])
            self[1] = mx.concatenate([self._state_after(r)[b : b + 1] for b, r in enumerate(counts)])
        self.discard()

    def commit_at(self, rows: mx.array) -> None:
        """``commit`` of one sequence with ``rows`` a device int32 scalar, 1 .. the recorded rows (a chained
        round's kept rows, ``engine.chain``: the host reads them later): the same window and state values, taken
        by index on the device."""
        if self._states is None or self._conv_input is None:
            raise RuntimeError("commit_at() without a recorded verify call")
        conv_input = self._conv_input
        recorded_rows = self._recorded_rows()
        n_keep = conv_input.shape[1] - recorded_rows
        start = positions.derived(rows, "index", lambda r: r.astype(mx.int32).reshape(1))  # (one node a round)
        self[0] = mx.slice(conv_input, start, axes=(1,), slice_size=(conv_input.shape[0], n_keep, *conv_input.shape[2:]))
        after = self._after if self._after is not None else mx.stack(self._states[1:])
        row = positions.derived(rows, "row", lambda r: r.astype(mx.int32).reshape(1) - 1)
        self[1] = mx.take(after, row, axis=0).reshape(after.shape[1:])
        self.discard()

    def discard(self) -> None:
        self._conv_input = self._states = self._after = None

    def pending_arrays(self) -> list[mx.array]:
        """Arrays of the recorded call (to evaluate together with the verify outputs)."""
        if self._states is None or self._conv_input is None:
            return []
        return [self._conv_input, *self._states, *([] if self._after is None else [self._after])]


# -- how a prompt's rows go through the recurrence ------------------------------------------------------
# ``auto``: on MLX CUDA a prompt chunk (T > 1 rows, not a recorded verify call) goes through exo's prompt kernel
# (``_prompt_rows``: the step kernel's rows, one launch a layer) where the loader's check passed; else the chunked
# (WY) form, where mlx-lm's loop is T tiny compiled steps per layer, host-bound (docs/performance.md, "The code's
# reasons": the chunked GatedDeltaNet prefill), its chunk-to-chunk state steps in exo's CUDA kernel where that
# passes its self-check (``states_kernel``);
# mlx-lm's Metal kernel on Apple GPUs and exo's kernel on the CPU stay (one fused pass over the rows there).
# ``chunked``: the chunked form for every such call on any device, its state steps in that kernel where usable
# and as MLX ops elsewhere (tests run it on the CPU; unmeasured on Metal); ``loop``: never. A one-row decode step and a verify call's recorded rows never take it, so they
# stay bit for bit what they were. Set per model by the engine (``EngineConfig.gdn_prefill``).
GdnPrefill = Literal["auto", "chunked", "loop"]


# ``auto`` on MLX CUDA takes the chunked form from this many rows: below, mlx-lm's per-row steps are faster (one
# 9B layer on an H200: 8 rows 1.27 ms by steps vs 1.86 ms chunked, 64 rows 7.4 vs 1.97 ms; ~0.16 ms a row against
# ~1.8 ms a call: h200-mlx-cuda-prefill-dense-2026-11-29.txt). A prompt's tail after a restore can be that short.
CHUNKED_MIN_ROWS = 12


def chunked_prefill(mode: GdnPrefill, rows: int, on_cuda: bool) -> bool:
    """Whether a non-recorded call of ``rows`` rows takes the chunked form."""
    return rows > 1 and (mode == "chunked" or (mode == "auto" and on_cuda and rows >= CHUNKED_MIN_ROWS))


def states_kernel(mode: GdnPrefill, dk: int, dv: int) -> bool:
    """Whether the chunked form's state steps run in exo's CUDA kernel (``gated_delta_states_cuda``): where it is
    usable (MLX CUDA, its head dims, its self-check passed); elsewhere MLX ops."""
    return mode in ("auto", "chunked") and states_cuda.usable(dk, dv)


def _recurrence(layer: Any, q, k, v, a, b, state, mask) -> tuple[mx.array, mx.array]:
    """The gated delta rule over the rows of one call: mlx-lm's ``gated_delta_update``, as stock decoding
    runs it (its Metal kernel on Apple GPUs; elsewhere its compiled step, which is faster than MLX's fused
    ``mx.fast.gated_delta_update`` on an H100: docs/performance.md, "The code's reasons"). On MLX's CPU backend
    with exo's kernel built, the same values in one call (``kernels.gated_delta``: mlx-lm's step runs ~10
    dispatched ops per row and layer; a prompt of T tokens ran T steps). A prompt chunk on MLX CUDA (or
    wherever ``gdn_prefill`` is ``chunked``): the chunked form (``gated_delta_chunked``), equal up to float32
    rounding."""
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    mode = getattr(layer, "gdn_prefill", "auto")
    if not layer.training and chunked_prefill(mode, q.shape[1], on_cuda):
        steps = states_cuda.chunk_states if states_kernel(mode, q.shape[-1], v.shape[-1]) else None
        return gated_delta_chunked_update(q, k, v, a, b, layer.A_log, layer.dt_bias, state, mask, steps=steps)
    kernel = getattr(layer, "cpu_gated_delta", None)  # exo's CPU kernel (``use_cpu_kernels``) where built
    if kernel is not None and mx.default_device() == mx.cpu and not layer.training:
        beta = mx.sigmoid(b)  # gated_delta_update's own inputs to its recurrence
        g = compute_g(layer.A_log, a, layer.dt_bias)
        if state is None:
            B, _, _, Dk = q.shape
            state = mx.zeros((B, *v.shape[-2:], Dk), dtype=mx.float32)
        if _gated_delta_fits(q, k, v, g, beta, state, mask):
            return kernel(q, k, v, g, beta, state, mask)
    if q.shape[1] == 1 and mask is None and not layer.training and not _on_metal():
        # one row (a batch's decode step) where mlx-lm runs its ops: the same values in fewer graph nodes
        if state is None:
            state = mx.zeros((q.shape[0], *v.shape[-2:], q.shape[-1]), dtype=mx.float32)
        return one_row_delta(q, k, v, a, b, layer.A_log, layer.dt_bias, state)
    return gated_delta_update(q, k, v, a, b, layer.A_log, layer.dt_bias, state, mask, use_kernel=not layer.training)


def _on_metal() -> bool:
    """Where mlx-lm's ``gated_delta_update`` runs its Metal kernel (exo keeps it there, as stock decodes)."""
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def _gated_delta_fits(q, k, v, g, beta, state, mask) -> bool:
    """Whether the CPU kernel takes these inputs (else mlx-lm's ops run them)."""
    io = (mx.bfloat16, mx.float32)
    return (
        q.dtype in io and k.dtype == q.dtype and v.dtype == q.dtype and beta.dtype in io
        and g.dtype == mx.float32 and g.ndim == 3 and state.dtype == mx.float32
        and q.shape[2] > 0 and v.shape[2] % q.shape[2] == 0
        and (mask is None or (mask.dtype == mx.bool_ and mask.shape == q.shape[:2]))
    )


def _conv(layer: Any, conv_input: mx.array, verify: bool, chunked: bool = False) -> mx.array:
    """The layer's short causal depthwise conv: mlx-lm's ``conv1d``, exactly as stock decoding runs it.

    A verify call convolves each row's own window (``conv_kernel_size`` inputs, one output): the shape a
    decode step convolves, so each row rounds as that decode step would, whatever a backend's conv
    kernel does with longer inputs (on the CPU the two are equal anyway: bench/op_invariance.py@3c719fd).
    A prompt chunk on the chunked path (``chunked``): ``_shifted_conv``.
    """
    taps = layer.conv_kernel_size
    rows = conv_input.shape[1] - taps + 1
    if chunked and rows > 1:
        return _shifted_conv(conv_input, layer.conv1d)
    if not verify or rows == 1:
        return layer.conv1d(conv_input)
    return mx.concatenate([layer.conv1d(conv_input[:, t : t + taps]) for t in range(rows)], axis=1)


def _shifted_conv(conv_input: mx.array, conv: nn.Module) -> mx.array:
    """The depthwise causal conv as a sum of its taps' shifted rows, in float32, rounded once: on an H200 MLX
    CUDA's grouped ``conv1d`` (cuDNN, a plan per input length) was a large part of a long 9B prefill with the
    chunked recurrence (docs/performance.md, "The code's reasons": the shifted-rows conv); a few elementwise passes do the same sums. Equal to ``conv1d`` up to the order of a few float32
    additions (one bfloat16 rounding at most)."""
    weight = conv.weight  # [channels, taps, 1]
    taps = weight.shape[1]
    rows = conv_input.shape[1] - taps + 1
    x = conv_input.astype(mx.float32)
    w = weight[:, :, 0].astype(mx.float32)
    out = x[:, 0:rows] * w[:, 0]
    for j in range(1, taps):
        out = out + x[:, j : j + rows] * w[:, j]
    if "bias" in conv:
        out = out + conv.bias.astype(mx.float32)
    return out.astype(conv_input.dtype)


# -- one GatedDeltaNet row as one compiled graph, on CUDA ------------------------------------------------
# A decode step of a GatedDeltaNet layer after its input projections is ~25 small ops (window concat, conv,
# silu, split, q/k norms, gate and beta, the recurrence step, the gated norm), each its own kernel launch;
# MLX CUDA on a fast GPU is bound by the host launching them (exo-demo: ~1100 kernels a step, 6 of its 8
# layers GatedDeltaNets). Every shape in that step is fixed (conv window, recurrent state), so
# ``mx.compile`` takes it as one graph and fuses its elementwise ops. A verify call (a recorded call) runs
# each of its rows through the same compiled graph, so each row rounds as a decode step does and greedy
# MTP stays token-identical to plain decoding. Metal keeps mlx-lm's path (its fused recurrence kernel;
# unmeasured here); the CPU has exo's kernels. ``EXO_GDN_COMPILED=0`` turns it off (A/B measurement);
# "always" runs it on any device (tests run it on the CPU).
COMPILED_ROWS = {"0": "off", "always": "always"}.get(os.environ.get("EXO_GDN_COMPILED", ""), "cuda")


def _capture_points(cache: Any, rows: int, mask: Any) -> tuple[int, ...]:
    """The armed offsets of a solo prompt chunk (``RollbackArraysCache.arm``), disarmed here: each call captures once."""
    points = getattr(cache, "capture_at", ())
    if not points:
        return ()
    cache.capture_at = ()
    if mask is not None or cache.lengths is not None:
        return ()  # a batch's padded rows: no capture (the prefix cache then keeps no snapshot inside the chunk)
    return tuple(o for o in points if 0 < o < rows)


def _recording(cache: Any) -> bool:
    return isinstance(cache, RollbackArraysCache) and cache.recording


def _compiled_rows_apply(layer: Any, rows: int, mask: Any, cache: Any) -> bool:
    """A decode step (one row) or a recorded call, solo (no mask, no per-sequence lengths), on the device."""
    if COMPILED_ROWS == "off" or cache is None or cache[0] is None or not (rows == 1 or _recording(cache)):
        return False
    on_device = COMPILED_ROWS == "always" or (mx.default_device() == mx.gpu and mx.cuda.is_available())
    return on_device and mask is None and cache.lengths is None and not layer.training and "bias" not in layer.conv1d


GDN_KERNEL_ON = True  # benchmarks switch the installed kernel off and on within one process (A/B)


def _kernel_rows_apply(layer: Any, rows: int, mask: Any, cache: Any) -> bool:
    """A decode step or a recorded call of at most ``cuda_gdn.MAX_ROWS`` rows, solo, as ``_compiled_rows_apply``
    (on whatever device ``use_gdn_kernel`` set the layer up for)."""
    from ..kernels.cuda_gdn import MAX_ROWS

    return (cache is not None and cache[0] is not None and (rows == 1 or _recording(cache)) and rows <= MAX_ROWS
            and mask is None and cache.lengths is None and not layer.training)


# The longest call the prompt kernel takes (None: every call; a longer one takes the chunked form). One 9B on an H200
# (``bench/prefill.py --phases model``, phase ``prefill9k``, both forms in one process): the kernel's second form
# (the default, ``cuda_gdn.PROMPT_VARIANT``) for every call of 2,048-row chunks prefilled 17,118 tok/s at 1,024
# tokens, 18,294 at 4,096 and 15,718 at 32,768, against the chunked form's 12,481 / 15,129 / 13,102; on one layer it
# beat the chunked form up to 16,384 rows (h200-mlx-cuda-compiled-layers-prompt-form-graph-wire-9b-2026-11-30.txt).
# The first form, slower in the whole model from 4,096 tokens, took calls up to 1,024 rows.
PROMPT_KERNEL_MAX_ROWS: int | None = None


def _prompt_kernel_apply(layer: Any, rows: int, mask: Any, cache: Any) -> bool:
    """A prompt's chunk of a solo sequence (or of rows of equal length: no mask) of 2 .. ``PROMPT_KERNEL_MAX_ROWS``
    (None: any number of) rows through ``kernels.cuda_gdn``'s prompt kernel: where the loader found it equal to the
    layer's decode steps (``gdn_prompt_kernel``), under ``gdn_prefill="auto"``; never a recorded (verify) call,
    which the step kernel takes."""
    return (getattr(layer, "gdn_prompt_kernel", False) and GDN_KERNEL_ON and 1 < rows
            and (PROMPT_KERNEL_MAX_ROWS is None or rows <= PROMPT_KERNEL_MAX_ROWS)
            and mask is None
            and getattr(layer, "gdn_prefill", "auto") == "auto" and not layer.training
            and (cache is None or (not _recording(cache) and cache.lengths is None)))


def _window_at(window: mx.array, qkv: mx.array, offset: int) -> mx.array:
    """The conv window before row ``offset`` of ``qkv`` (the rows ``offset`` .. ``offset + taps - 2`` of
    ``[window; qkv]``), without concatenating the whole chunk; a copy where it would be a view of ``qkv`` (``* 1``:
    exact), so a kept window does not keep the chunk's projections alive."""
    keep = window.shape[1]
    if offset == 0:
        return window
    if offset >= keep:
        return qkv[:, offset - keep : offset] * 1
    return mx.concatenate([window[:, offset:], qkv[:, :offset]], axis=1)


def _prompt_rows(layer: Any, mixed_qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, cache: Any) -> mx.array:
    """``_mix`` of a prompt's chunk through ``kernels.cuda_gdn.gdn_prompt``: one launch per layer for any number of
    rows (a piece per prefix-cache snapshot edge inside the chunk), each row the bits its decode step would give."""
    from ..kernels.cuda_gdn import gdn_prompt

    B, S, _ = mixed_qkv.shape
    window = cache[0] if cache is not None and cache[0] is not None else None
    if window is None:
        window = mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), dtype=mixed_qkv.dtype)
    state = cache[1] if cache is not None and cache[1] is not None else None
    if state is None:
        state = mx.zeros((B, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), dtype=mx.float32)
    points = _capture_points(cache, S, None) if cache is not None else ()
    outs, lo = [], 0
    for o in (*points, S):
        y, state = gdn_prompt(layer, _window_at(window, mixed_qkv, lo), mixed_qkv[:, lo:o], a[:, lo:o], b[:, lo:o],
                              state)
        outs.append(y)
        if o < S:
            cache.captured[o] = (_window_at(window, mixed_qkv, o), state)
        lo = o
    if cache is not None:
        cache[0] = _window_at(window, mixed_qkv, S)
        cache[1] = state
        cache.advance(S)
    out = layer.norm(outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1), z)
    return layer.out_proj(out.reshape(B, S, -1))


def one_row_delta(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array, A_log: mx.array,
                  dt_bias: mx.array, state: mx.array) -> tuple[mx.array, mx.array]:
    """mlx-lm's ``gated_delta_update`` for one row (q, k [B, 1, Hk, Dk], v [B, 1, Hv, Dv], a, b [B, 1, Hv], state
    [B, Hv, Dv, Dk] float32), value for value, in fewer graph nodes: its ops path slices each input out of the
    row (a slice and a squeeze each) and broadcasts with an expand per use, here one reshape each. Every
    arithmetic op is its op on the same values and shapes (tests/engine/test_layers.py: bit for bit). On MLX CUDA a
    decode step is the host's work, ~5.7 us per graph node evaluated (docs/performance.md): compiled, 23 nodes
    instead of mlx-lm's 29 at the 9B's shape."""
    B, _, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    beta = mx.sigmoid(b)
    g = compute_g(A_log, a, dt_bias)
    r = hv // hk

    def heads(x: mx.array) -> mx.array:  # [B, 1, Hk, Dk] -> [B, Hv, 1, Dk], each key head r times (mx.repeat's order)
        if r == 1:
            return x.reshape(B, hv, 1, dk)
        return mx.broadcast_to(x.reshape(B, hk, 1, 1, dk), (B, hk, r, 1, dk)).reshape(B, hv, 1, dk)

    q, k = heads(q), heads(k)
    state = state * g.reshape(B, hv, 1, 1)
    kv_mem = (state * k).sum(axis=-1)
    delta = (v.reshape(B, hv, dv) - kv_mem) * beta.reshape(B, hv, 1)
    state = state + k * delta.reshape(B, hv, dv, 1)
    y = (state * q).sum(axis=-1)
    return y.astype(q.dtype).reshape(B, 1, hv, dv), state


@cache
def _row_step(taps: int, key_dim: int, hk: int, hv: int, dk: int, dv: int, norm_eps: float) -> Callable[..., Any]:
    """The compiled row step for one layer shape: (conv window, qkv row, z, a, b, state, conv weight, A_log,
    dt_bias, norm weight) -> (gated-norm output, next conv window, next state). The same ops as ``_mix``
    with mlx-lm's ``conv1d``, ``normalize_qk``, ``gated_delta_update`` (as ``one_row_delta``) and
    ``Qwen3NextRMSNormGated``."""

    def step(window, qkv, z, a, b, state, conv_w, A_log, dt_bias, norm_w):  # noqa: ANN001, ANN202
        B = qkv.shape[0]
        conv_input = mx.concatenate([window, qkv], axis=1)
        conv_out = nn.silu(mx.conv1d(conv_input, conv_w, groups=conv_input.shape[-1]))
        q, k, v = mx.split(conv_out, [key_dim, 2 * key_dim], -1)
        q, k = normalize_qk(q.reshape(B, 1, hk, dk), k.reshape(B, 1, hk, dk), inv_scale=dk**-0.5, eps=1e-6)
        y, state = one_row_delta(q, k, v.reshape(B, 1, hv, dv), a, b, A_log, dt_bias, state)
        out = precise_swiglu(y, z, mx.fast.rms_norm(y, norm_w, norm_eps))
        return out, mx.contiguous(conv_input[:, 1:]), state

    return mx.compile(step)


def _rows(x: mx.array) -> list[mx.array]:
    """``x``'s rows (axis 1), each kept as a 1-row axis: the views ``x[:, t : t + 1]`` in one graph node (a split)
    rather than one slice node per row (on MLX CUDA a verify call is the host's work, per node)."""
    return [x] if x.shape[1] == 1 else mx.split(x, x.shape[1], axis=1)


def _compiled_rows(layer: Any, mixed_qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, cache: Any) -> mx.array:
    """``_mix`` through the compiled row step (``_compiled_rows_apply``): a decode step's one row, or a
    recorded call's rows one by one."""
    B, S, _ = mixed_qkv.shape
    step = _row_step(layer.conv_kernel_size, layer.key_dim, layer.num_k_heads, layer.num_v_heads,
                     layer.head_k_dim, layer.head_v_dim, float(layer.norm.eps))
    weights = (layer.conv1d.weight, layer.A_log, layer.dt_bias, layer.norm.weight)
    window, state = cache[0], cache[1]
    if state is None:
        state = mx.zeros((B, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), dtype=mx.float32)
    if not _recording(cache):  # a decode step
        out, window, state = step(window, mixed_qkv, z, a, b, state, *weights)
        cache[0], cache[1] = window, state
    else:  # a verify call: its rows one by one, every row's state recorded
        conv_input = mx.concatenate([window, mixed_qkv], axis=1)
        outs, states = [], [state]
        for qkv_t, z_t, a_t, b_t in zip(*(_rows(x) for x in (mixed_qkv, z, a, b)), strict=True):
            y, window, state = step(window, qkv_t, z_t, a_t, b_t, state, *weights)
            outs.append(y)
            states.append(state)
        out = mx.concatenate(outs, axis=1)
        cache.record(conv_input, states)
        cache[0], cache[1] = window, state
    cache.advance(S)
    return layer.out_proj(out.reshape(B, S, -1))


# -- a GatedDeltaNet step's T rows in one launch, on MLX CUDA ----------------------------------------------
# The compiled row graph is still a few launches per row, and a verify call runs it once per row.
# ``kernels.cuda_gdn`` computes a decode step (T = 1) and a verify call's T rows in one launch per layer, each
# row as alone by construction. ``use_gdn_kernel`` (the loader) sets it on the layers where it checks out on the
# device; it takes the calls the compiled rows would (``_compiled_rows_apply``) of at most ``MAX_ROWS`` rows.


def use_gdn_kernel(model: nn.Module) -> dict[str, str]:
    """Give ``model``'s GatedDeltaNet layers exo's step kernel where ``kernels.cuda_gdn.check`` passes on this
    device (one layer checked per shape); what was found per shape. Nothing where ``EXO_GDN_KERNEL=0``, or off
    MLX CUDA unless ``EXO_GDN_KERNEL=always``."""
    from ..kernels import cuda_gdn

    mode = cuda_gdn.mode()
    if mode == "off" or (mode in ("cuda", "force") and not cuda_gdn.on_cuda()):
        return {}
    shapes: dict[tuple[Any, ...], list[nn.Module]] = {}
    for _, leaf in model.named_modules():
        if isinstance(leaf, (GatedDeltaNet, NextGatedDeltaNet)) and cuda_gdn.supported(leaf):
            signature = (leaf.num_k_heads, leaf.num_v_heads, leaf.head_k_dim, leaf.head_v_dim,
                         leaf.conv_kernel_size, leaf.conv1d.weight.dtype)
            shapes.setdefault(signature, []).append(leaf)
    found: dict[str, str] = {}
    for (hk, hv, dk, dv, taps, dtype), leaves in shapes.items():
        name = f"gdn {hk}x{dk} keys {hv}x{dv} values conv {taps} {dtype}".replace("mlx.core.", "")
        passed, what = cuda_gdn.check(leaves[0])
        found[name] = ("ok: " if passed else "not used: ") + what
        prompt = False
        if passed:  # a prompt's rows in one launch, where they are the bits of the steps just checked
            prompt, what = cuda_gdn.check_prompt(leaves[0])
            found[name.replace("gdn ", "gdn prompt ", 1)] = ("ok: " if prompt else "not used: ") + what
        for leaf in leaves:
            leaf.gdn_kernel = passed
            leaf.gdn_prompt_kernel = prompt
    return found


ATTN_KERNEL_ON = True  # benchmarks switch the installed kernel off and on within one process (A/B)


def _attn_kernel_applies(cache: Any, mask: Any, batch: int, rows: int) -> bool:
    """A solo call of at most ``cuda_attn.MAX_ROWS`` rows (a decode step, a verify call, a short chunk) on a plain
    KV cache, causal: what ``cuda_attn.attend_rows`` computes."""
    from mlx_lm.models.cache import KVCache

    from ..kernels.cuda_attn import MAX_ROWS

    return (batch == 1 and rows <= MAX_ROWS and type(cache) is KVCache
            and (mask is None or (isinstance(mask, str) and mask == "causal")))


def use_attn_kernel(model: nn.Module | Sequence[nn.Module]) -> dict[str, str]:
    """Give the attention layers of ``model`` (or of each module: the backbone and the MTP head) exo's decode-attention
    kernel where ``kernels.cuda_attn.check`` passes on this device (one layer checked per shape); what was found per
    shape. ``EXO_ATTN_KERNEL``: ``1`` (default) on MLX CUDA, nothing elsewhere; ``0`` nothing; ``always`` its
    reference anywhere."""
    from ..kernels import cuda_attn

    mode = cuda_attn.mode()
    if mode == "off" or (mode == "cuda" and not cuda_attn.on_cuda()):
        return {}
    shapes: dict[tuple[Any, ...], list[nn.Module]] = {}
    modules = [model] if isinstance(model, nn.Module) else list(model)
    for _, leaf in (named for module in modules for named in module.named_modules()):
        if isinstance(leaf, Attention) and cuda_attn.supported(leaf):
            shapes.setdefault((leaf.num_attention_heads, leaf.num_key_value_heads, leaf.head_dim), []).append(leaf)
    found: dict[str, str] = {}
    for (hq, hkv, dim), leaves in shapes.items():
        passed, what = cuda_attn.check(leaves[0])
        found[f"attention {hq} heads {hkv} kv heads dim {dim}"] = ("ok: " if passed else "not used: ") + what
        for leaf in leaves:
            leaf.attn_kernel = passed
    return found


def use_long_attention(modules: Sequence[nn.Module]) -> tuple[int, int] | None:
    """Give the attention layers of ``modules`` (the backbone, the MTP head) the key-blocked path for a long
    context's prompt chunks where ``EXO_LONG_ATTENTION`` applies on this device (``models.long_attention``);
    returns (min keys, block), or None."""
    configured = long_attention.configured()
    set_long_attention(modules, configured)
    return configured


def set_long_attention(modules: Sequence[nn.Module], value: tuple[int, int] | None) -> None:
    """The attention layers of ``modules`` take the key-blocked path from ``value`` = (min keys, block), or never
    (None)."""
    for module in modules:
        for _, leaf in module.named_modules():
            if isinstance(leaf, Attention):
                object.__setattr__(leaf, "long_attention", value)  # not a child module: no parameters


def _kernel_rows(layer: Any, mixed_qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, cache: Any) -> mx.array:
    """``_mix`` through ``kernels.cuda_gdn``: a decode step's row or a recorded call's rows in one launch."""
    from ..kernels.cuda_gdn import gdn_rows

    B, S, _ = mixed_qkv.shape
    window, state = cache[0], cache[1]
    if state is None:
        state = mx.zeros((B, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), dtype=mx.float32)
    y, states = gdn_rows(layer, window, mixed_qkv, a, b, state)
    conv_input = mx.concatenate([window, mixed_qkv], axis=1)
    if _recording(cache):
        # The window and state stay the call's until its commit (every recorded call is committed, or restored
        # by ``engine.ahead``'s snapshots, before the layer runs again): no node per row, none for the state
        # after every row, which a commit keeping fewer rows never reads.
        cache.record(conv_input, [state], after=states)
    else:
        cache[0] = _window(conv_input[:, S:])
        cache[1] = states[S - 1 : S].reshape(states.shape[1:])  # a view (``states[S - 1]`` would gather a copy)
    cache.advance(S)
    out = layer.norm(y, z)
    return layer.out_proj(out.reshape(B, S, -1))


def _mix(layer: Any, mixed_qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, mask, cache) -> mx.array:
    """Conv + gated delta recurrence + gated norm + out projection, shared by Qwen3.5 and Qwen3-Next.

    Mirrors mlx-lm's GatedDeltaNet.__call__ after the input projections; a RollbackArraysCache in
    recording mode additionally gets the per-row states.
    """
    B, S, _ = mixed_qkv.shape
    if layer.gdn_kernel and GDN_KERNEL_ON and _kernel_rows_apply(layer, S, mask, cache):
        return _kernel_rows(layer, mixed_qkv, z, b, a, cache)
    if _prompt_kernel_apply(layer, S, mask, cache):
        return _prompt_rows(layer, mixed_qkv, z, b, a, cache)
    if _compiled_rows_apply(layer, S, mask, cache):
        return _compiled_rows(layer, mixed_qkv, z, b, a, cache)
    if cache is not None and cache[0] is not None:
        conv_state = cache[0]
    else:
        conv_state = mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), dtype=mixed_qkv.dtype)
    if mask is not None:
        mixed_qkv = mx.where(mask[..., None], mixed_qkv, 0)
    conv_input = mx.concatenate([conv_state, mixed_qkv], axis=1)
    n_keep = layer.conv_kernel_size - 1
    if cache is not None:
        if cache.lengths is not None:
            ends = mx.clip(cache.lengths, 0, S)
            positions = (ends[:, None] + mx.arange(n_keep))[..., None]
            cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
        else:
            cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    recording = _recording(cache)
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    chunked = not recording and not layer.training and chunked_prefill(getattr(layer, "gdn_prefill", "auto"), S, on_cuda)
    conv_out = _silu(layer, _conv(layer, conv_input, recording, chunked))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
            strict=True,
        )
    ]
    state = cache[1] if cache else None
    q, k = fused_normalize_qk(q, k, layer.head_k_dim**-0.5, 1e-6)
    if recording:
        if state is None:
            state = mx.zeros((B, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), dtype=mx.float32)
        outs, states = [], [state]
        for q_t, k_t, v_t, a_t, b_t in zip(*(_rows(x) for x in (q, k, v, a, b)), strict=True):
            y, state = _recurrence(layer, q_t, k_t, v_t, a_t, b_t, state, None)
            outs.append(y)
            states.append(state)
        out = mx.concatenate(outs, axis=1)
        cache.record(conv_input, states)
    else:
        points = _capture_points(cache, S, mask)
        if points:  # a prompt chunk with snapshot edges inside it: the recurrence stops at each, its state kept
            outs, lo = [], 0
            for o in (*points, S):
                y, state = _recurrence(layer, q[:, lo:o], k[:, lo:o], v[:, lo:o], a[:, lo:o], b[:, lo:o], state, None)
                outs.append(y)
                if o < S:  # conv_input holds the n_keep rows before the chunk: the window after o rows starts at o;
                    # a copy (``* 1``: exact), so the chunk's whole conv_input is not kept until the prompt is stored
                    cache.captured[o] = (conv_input[:, o : o + n_keep] * 1, state)
                lo = o
            out = mx.concatenate(outs, axis=1)
        else:
            out, state = _recurrence(layer, q, k, v, a, b, state, mask)
    if cache is not None:
        cache[1] = state
        cache.advance(S)
    out = layer.norm(out, z)
    return layer.out_proj(out.reshape(B, S, -1))


class GatedDeltaNet(Qwen35GatedDeltaNet):
    """Qwen3.5 / Qwen3.6 GatedDeltaNet with per-row state capture for rollback."""

    gdn_kernel = False  # its steps on ``kernels.cuda_gdn`` (``use_gdn_kernel``)
    gdn_prompt_kernel = False  # its prompts' rows too (``cuda_gdn.gdn_prompt``)
    fused_inputs: tuple[int, ...] | None = None  # ``in_proj_fused``'s split points (``models.fused_inputs``)

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        if self.sharding_group is not None:
            # A tensor-sharded layer (``engine/sharding.py``): mlx-lm's call, with its all-reduce
            return super().__call__(inputs, mask, cache)
        return _mix(self, *self.input_projections(inputs), mask, cache)

    def input_projections(self, inputs: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """(qkv, z [B, S, Hv, Dv], b, a): four products, or one fused (``models.fused_inputs``) split four ways."""
        B, S, _ = inputs.shape
        if self.fused_inputs is not None:
            qkv, z, b, a = mx.split(self.in_proj_fused(inputs), self.fused_inputs, axis=-1)
        else:
            qkv, z, b, a = (self.in_proj_qkv(inputs), self.in_proj_z(inputs), self.in_proj_b(inputs),
                            self.in_proj_a(inputs))
        return qkv, z.reshape(B, S, self.num_v_heads, self.head_v_dim), b, a


class NextGatedDeltaNet(Qwen3NextGatedDeltaNet):
    """Qwen3-Next GatedDeltaNet with per-row state capture for rollback."""

    gdn_kernel = False
    gdn_prompt_kernel = False
    fused_inputs: tuple[int, ...] | None = None  # ``in_proj_fused``'s split point (``models.fused_inputs``)

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        return _mix(self, *self.input_projections(inputs), mask, cache)

    def input_projections(self, inputs: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """(qkv, z, b, a) from ``in_proj_qkvz`` and ``in_proj_ba``, or from their fused product
        (``models.fused_inputs``) split in two."""
        B, S, _ = inputs.shape
        if self.fused_inputs is not None:
            qkvz, ba = mx.split(self.in_proj_fused(inputs), self.fused_inputs, axis=-1)
        else:
            qkvz, ba = self.in_proj_qkvz(inputs), self.in_proj_ba(inputs)
        q, k, v, z, b, a = self.fix_query_key_value_ordering(qkvz, ba)
        mixed_qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return mixed_qkv, z, b, a


class SparseMoeBlock(Qwen3NextSparseMoeBlock):
    """Qwen3.5-MoE / Qwen3-Next sparse MoE block whose multi-row routing can be locked to decode's."""

    verify_mode: MoEVerifyMode | None = None  # set by the engine around verify calls only
    sort_experts: bool = True  # False where ``check_expert_sort`` found the sorted expert kernels wrong
    unsorted_in_batch: bool = False  # batch-invariant batch steps (each row as alone)
    dense_experts_from: int = 0  # (row, expert) pairs from which the experts run dequantized (prompt_dense); 0: never
    fused_inputs: tuple[int, ...] | None = None  # ``gates_fused``'s split point: router | shared gate (fused_inputs)

    def _route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        inds, scores, _ = self._routed(x)
        return inds, scores

    def _routed(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array | None]:
        """The experts chosen per row and their scores; with the router and the shared expert's gate fused into
        one product (``models.fused_inputs``), that gate's logit too (None: ``shared_expert_gate`` computes it)."""
        router = self.gates_fused if self.fused_inputs is not None else self.gate
        if self.verify_mode == "route_locked" and x.shape[1] > 1:
            gates = mx.concatenate([router(row) for row in _rows(x)], axis=1)
        else:
            gates = router(x)
        shared = None
        if self.fused_inputs is not None:
            gates, shared = mx.split(gates, self.fused_inputs, axis=-1)
        gates = mx.softmax(gates, axis=-1, precise=True)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        return inds, scores, shared

    def _block(self, x: mx.array) -> mx.array:
        inds, scores, shared_logit = self._routed(x)
        if (self.dense_experts_from and inds.size >= self.dense_experts_from and not self.unsorted_in_batch
                and prompt_dense.active()):
            experts = experts_dense(self.switch_mlp, x, inds)
        elif self.sort_experts and not self.unsorted_in_batch:
            experts = self.switch_mlp(x, inds)
        else:
            experts = experts_unsorted(self.switch_mlp, x, inds)
        y = (experts * scores[..., None]).sum(axis=-2)
        if shared_logit is None:
            shared_logit = self.shared_expert_gate(x)
        shared = mx.sigmoid(shared_logit) * self.shared_expert(x)
        return y + shared

    def __call__(self, x: mx.array) -> mx.array:
        if self.sharding_group is not None:
            return super().__call__(x)
        if self.verify_mode == "safe" and x.shape[1] > 1:
            return mx.concatenate([self._block(row) for row in _rows(x)], axis=1)
        return self._block(x)


SORT_MIN_PAIRS = 64  # mlx-lm's SwitchGLU sorts the rows by expert from this many (row, expert) pairs on
SORTED_EXPERTS_TOLERANCE = 0.05  # relative: ~8x the bf16 rounding of the two paths (5.5e-3 to 6.6e-3 measured)


def experts_unsorted(switch: nn.Module, x: mx.array, indices: mx.array) -> mx.array:
    """mlx-lm's ``SwitchGLU`` forward without its sort of the rows by expert: each (row, expert) pair's
    gathered products in row order, the path mlx-lm itself takes below ``SORT_MIN_PAIRS`` pairs (a decode
    step). Every row computes what it computes alone (bit for bit on MLX CUDA, where a batch of decode steps
    then rounds as solo steps do)."""
    x = mx.expand_dims(x, (-2, -3))
    up = switch.up_proj(x, indices)
    gate = switch.gate_proj(x, indices)
    return switch.down_proj(switch.activation(up, gate), indices).squeeze(-2)


def check_expert_sort(blocks: list[SparseMoeBlock]) -> float:
    """Whether mlx-lm's sorted expert path computes on this device what the unsorted one does, on the first
    block's experts and enough random rows to take it; when it does not, every block of ``blocks`` goes
    unsorted (``sort_experts``). Returns the measured relative difference.

    Measured: MLX 0.32.4's CUDA backend returns wrong products from the sorted ``gather_mm`` (relative
    difference ~1.2-1.3 at 64 and 128 pairs, against 0 between the unsorted path and rows computed alone;
    bench/results/h100-mlx-cuda-moe-sort.txt): a prompt of 32 tokens or more at top-2 routing, or a batch
    of 32 decode steps, then decodes garbage (stock mlx-lm too). On this project's CPU both paths agree."""
    if not blocks:
        return 0.0
    block = blocks[0]
    switch = block.switch_mlp
    dtype = getattr(switch.down_proj, "scales", switch.down_proj.weight).dtype  # quantized: the scales' dtype
    experts = switch.down_proj.num_experts
    top_k = min(block.top_k, experts)
    rows = max(2, -(-SORT_MIN_PAIRS // top_k))
    key = mx.random.key(20261124)
    x = (mx.random.normal((rows, 1, switch.up_proj.input_dims), key=key) * 0.5).astype(dtype)
    order = mx.argsort(mx.random.uniform(shape=(rows, 1, experts), key=mx.random.split(key)[0]), axis=-1)
    indices = order[..., :top_k].astype(mx.uint32)
    sorted_out, unsorted = switch(x, indices), experts_unsorted(switch, x, indices)
    scale = mx.maximum(mx.abs(unsorted.astype(mx.float32)).max(), 1e-6)
    difference = float((mx.abs(sorted_out.astype(mx.float32) - unsorted.astype(mx.float32)).max() / scale).item())
    if difference > SORTED_EXPERTS_TOLERANCE:
        for each in blocks:
            each.sort_experts = False
    return difference


QUERY_BLOCK = 256  # query rows per product in ``cpu_attention`` (the bits do not depend on it: each row alone)
# Scores per key head below which MLX's own call is faster (its one batched product vs a call per sequence and
# key head): docs/performance.md, "The code's reasons": ``CPU_ATTENTION_MIN_SCORES``.
CPU_ATTENTION_MIN_SCORES = 2048


def cpu_attention(linear: Callable[[mx.array, mx.array], mx.array], queries: mx.array, keys: mx.array,
                  values: mx.array, scale: float, mask: Any) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` for bfloat16 on MLX's CPU backend, computed as that backend
    computes it (its fallback: queries times ``scale`` in their dtype, scores = q k^T, a causal or boolean
    mask as the dtype's minimum, a precise softmax, scores v), with the two products on exo's ``linear``
    kernel (``kernels.cpu_linear``: the bits of MLX's product). MLX multiplies bfloat16 there with a scalar
    loop, so on long contexts attention was most of a prefill chunk's time and grew with every cached token
    (what a prefix-cache hit still prefills sits after them); what this saves: docs/performance.md, "The code's reasons":
    ``cpu_attention``. The same bits: ``cpu_attention_matches``
    checks it against MLX's own call before a model uses it, and tests/engine/test_kernels.py on more shapes.
    The products' work grows with the keys; the softmax between them (MLX's, scalar ``exp``) is now most of it.

    queries [B, H, T, D], keys and values [B, Hk, L, D] (H a multiple of Hk: each key head serves H / Hk query
    heads, whose T rows each are stacked into one product); mask None, "causal" or a boolean array that
    broadcasts to [B, H, T, L]."""
    B, H, T, D = queries.shape
    Hk, L = keys.shape[1], keys.shape[2]
    rep = H // Hk
    q = mx.multiply(mx.array(scale, queries.dtype), queries)
    causal = isinstance(mask, str)
    low = mx.array(mx.finfo(queries.dtype).min, queries.dtype)
    outputs = []
    for b in range(B):
        for h in range(Hk):
            # weights @ v as linear(weights, v^T), but for a decode step's row or two: transposing v costs more
            # there than MLX's own product (docs/performance.md, "The code's reasons"); the same bits either way
            v_t = mx.contiguous(values[b, h].T) if rep * min(T, QUERY_BLOCK) > 2 else None  # [D, L]
            if mask is None or causal:
                group_mask = None
            else:  # [1 or H, T, L] of this sequence -> this key head's query heads
                m = mask[b if mask.shape[0] > 1 else 0] if mask.ndim == 4 else mask
                group_mask = m[h * rep : (h + 1) * rep] if m.ndim == 3 and m.shape[0] == H else m
            parts = []
            for t in range(0, T, QUERY_BLOCK):  # a block of rows at a time: what its scores take stays in cache
                u = min(t + QUERY_BLOCK, T)
                rows = q[b, h * rep : (h + 1) * rep, t:u].reshape(rep * (u - t), D)
                scores = linear(rows, keys[b, h]).reshape(rep, u - t, L)
                if causal:  # the queries are the last T of the L positions
                    scores = mx.where(mx.arange(L - T + t, L - T + u)[:, None] >= mx.arange(L)[None], scores, low)
                elif group_mask is not None:
                    scores = mx.where(group_mask[..., t:u, :] if group_mask.shape[-2] > 1 else group_mask, scores, low)
                # MLX's precise softmax of bfloat16 is this, computing each exp once instead of twice
                weights = mx.softmax(scores.astype(mx.float32), axis=-1).astype(queries.dtype)
                parts.append(weights @ values[b, h] if v_t is None
                             else linear(weights.reshape(rep * (u - t), L), v_t).reshape(rep, u - t, D))
            outputs.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1))
    return mx.stack(outputs).reshape(B, H, T, D)


def _cpu_attention_fits(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, mask: Any) -> bool:
    B, H, T, _ = queries.shape
    Hk, L = keys.shape[1], keys.shape[2]
    return (queries.dtype == keys.dtype == values.dtype == mx.bfloat16 and not hasattr(cache, "bits")
            and H % Hk == 0 and H // Hk * T * L >= CPU_ATTENTION_MIN_SCORES
            and (mask is None or mask == "causal" if isinstance(mask, (str, type(None))) else mask.dtype == mx.bool_))


@cache
def cpu_attention_matches() -> bool:
    """Whether ``cpu_attention`` gives MLX's own attention's bits here (grouped heads, causal at an offset,
    a boolean mask, one query): checked once per process before any layer uses it (a later MLX may compute
    its fallback otherwise: then MLX's own call stays)."""
    from ..kernels import cpu_linear

    linear = cpu_linear()
    if linear is None:
        return False
    key = mx.random.key(41)
    with mx.stream(mx.cpu):
        for B, H, Hk, T, L, mask in ((1, 4, 2, 5, 37, "causal"), (2, 2, 1, 1, 19, None), (2, 2, 2, 3, 11, "bool")):
            kq, kk, kv, km, key = mx.random.split(key, 5)
            q = mx.random.normal((B, H, T, 64), key=kq).astype(mx.bfloat16)
            k = mx.random.normal((B, Hk, L, 64), key=kk).astype(mx.bfloat16)
            v = mx.random.normal((B, Hk, L, 64), key=kv).astype(mx.bfloat16)
            m = (mx.random.uniform(shape=(B, 1, T, L), key=km) > 0.3) if mask == "bool" else mask
            want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m)
            got = cpu_attention(linear, q, k, v, 0.125, m)
            if not mx.array_equal(want.view(mx.uint16), got.view(mx.uint16)).item():
                return False
    return True


class Attention(Qwen3NextAttention):
    """Qwen3.5 / Qwen3.6 / Qwen3-Next full attention whose verify call can attend row by row.

    Measured (bench/op_invariance.py@3c719fd): on MLX's CUDA backend every matmul, norm, conv and the gated delta
    rule give row 0 of a 4-row call bit for bit what a 1-row call gives, but scaled-dot-product attention
    does not (a query block and a single query take different kernels). With ``per_row``, a multi-row
    call attends each row against the keys up to itself, exactly the shape of a decode step, so a verify
    row rounds as that decode step does; the projections stay batched.
    """

    per_row: bool = False  # set by the engine around verify calls only
    per_sequence: bool = False  # batch-invariant batch steps: each sequence alone, as its solo step
    attn_kernel: bool = False  # exo's decode-attention kernel (``kernels.cuda_attn``; ``use_attn_kernel``, at load)
    cpu_linear: Callable[[mx.array, mx.array], mx.array] | None = None  # set by ``use_cpu_kernels``
    fused_inputs: tuple[int, ...] | None = None  # ``qkv_proj``'s split points (``models.fused_inputs``)
    long_attention: tuple[int, int] | None = None  # (min keys, block): ``models.long_attention``, set at load

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, cache: Any, mask: Any) -> mx.array:
        """mlx-lm's ``scaled_dot_product_attention``, on exo's CPU kernel where it is set (the same bits); a long
        context's prompt chunk in key blocks where ``EXO_LONG_ATTENTION`` is on (``models.long_attention``)."""
        if self.long_attention is not None and long_attention.applies(queries, keys, mask, self.long_attention[0]):
            return long_attention.blocked_attention(queries, keys, values, self.scale, self.long_attention[1])
        if self.cpu_linear is not None and _cpu_attention_fits(queries, keys, values, cache, mask):
            return cpu_attention(self.cpu_linear, queries, keys, values, self.scale, mask)
        return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        if cache is not None and positions.at(cache) is not None:
            return self.at_position(x, cache)
        if self.per_sequence and B > 1 and isinstance(cache, BatchKVCache):
            return self._per_sequence(x, cache)
        if self.attn_kernel and ATTN_KERNEL_ON and _attn_kernel_applies(cache, mask, B, L):
            from ..kernels.cuda_attn import attend_rows

            queries, _, _, gate = self._project(x, cache)  # (the cache's buffers hold the new keys now)
            output = attend_rows(queries, cache.keys, cache.values, cache.offset, self.scale)
            return self.gated_output(output, gate)
        if cache is None or not self.per_row or L == 1:
            if self.cpu_linear is None and self.fused_inputs is None and self.long_attention is None:
                return super().__call__(x, mask, cache)
            queries, keys, values, gate = self._project(x, cache)  # the stock call's, then its attention here
            output = self.attend(queries, keys, values, cache, mask).transpose(0, 2, 1, 3).reshape(B, L, -1)
            return self.o_proj(output * mx.sigmoid(gate))
        queries, keys, values, gate = self._project(x, cache)
        before = keys.shape[2] - L
        # A batch's mask (left padding, mlx-lm's BatchKVCache) carries over row by row; alone, a row attends
        # to every key up to itself, which needs none.
        row_mask = mask if isinstance(mask, mx.array) else None
        rows = [
            self.attend(queries[:, :, t : t + 1], keys[:, :, : before + t + 1], values[:, :, : before + t + 1],
                        cache, row_mask[..., t : t + 1, : before + t + 1] if row_mask is not None else None)
            for t in range(L)
        ]
        output = mx.concatenate(rows, axis=2).transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(output * mx.sigmoid(gate))

    def _project(self, x: mx.array, cache: Any) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Queries, keys and values [B, heads, T, D] of ``x`` (rope applied at the cache's offsets, the keys and
        values stored and fetched: every key of the cache) and the output gate, as the stock call computes them."""
        return self.place(*self.heads(x), cache)

    def heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """``_project``'s part before the positions: queries, keys, values [B, heads, T, D] normed, without rope,
        and the output gate (a function of ``x`` alone: ``compiled_layers`` compiles it)."""
        B, L, _ = x.shape
        if self.fused_inputs is not None:
            q, keys, values = mx.split(self.qkv_proj(x), self.fused_inputs, axis=-1)
        else:
            q, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries, gate = mx.split(q.reshape(B, L, self.num_attention_heads, -1), 2, axis=-1)
        gate = gate.reshape(B, L, -1)
        queries = self.q_norm(queries).transpose(0, 2, 1, 3)
        keys = self.k_norm(keys.reshape(B, L, self.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        return queries, keys, values, gate

    def place(self, queries: mx.array, keys: mx.array, values: mx.array, gate: mx.array,
              cache: Any) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """``_project``'s part at the positions: rope at the cache's offset, the keys and values stored and every
        key of the cache fetched."""
        if cache is None:  # (a call without a cache: from position 0, as the stock call's)
            return self.rope(queries), self.rope(keys), values, gate
        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        return queries, keys, values, gate

    def at_position(self, x: mx.array, cache: Any, queries: mx.array | None = None, keys: mx.array | None = None,
                    values: mx.array | None = None, gate: mx.array | None = None) -> mx.array:
        """A call on a cache written at a device position (``models.positions``: a chained round's): rope at it,
        the keys and values written there, each row over the keys up to its own position; the heads given where
        a compiled call computed them already (roped: then the attention's rows [B, Hq, T, D] come back, before
        the output gate, for the compiled call after it). One sequence, at most ``cuda_attn.MAX_ROWS`` rows."""
        from ..kernels.cuda_attn import attend_rows, on_cuda

        position = positions.at(cache)
        assert position is not None
        gated = queries is None
        if queries is None:
            queries, keys, values, gate = self.heads(x)
            queries = self.rope(queries, offset=position)
            keys = self.rope(keys, offset=position)
        assert keys is not None and values is not None and gate is not None
        positions.write(cache, keys, values)
        rows, bound = queries.shape[2], cache.offset
        if self.attn_kernel and ATTN_KERNEL_ON and on_cuda():
            output = attend_rows(queries, cache.keys, cache.values, bound, self.scale, position=position)
        else:
            mask = positions.row_mask(position, rows, bound)
            output = self.attend(queries, cache.keys[:, :, :bound], cache.values[:, :, :bound], None, mask)
        return self.gated_output(output, gate) if gated else output

    def kernel_applies(self, cache: Any, mask: Any, batch: int, rows: int) -> bool:
        """Whether a call takes exo's decode-attention kernel (``cuda_attn.attend_rows``)."""
        return self.attn_kernel and ATTN_KERNEL_ON and _attn_kernel_applies(cache, mask, batch, rows)

    def gated_output(self, output: mx.array, gate: mx.array) -> mx.array:
        """The attention's rows [B, Hq, T, D] through the output gate and projection."""
        B, _, L, _ = output.shape
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate))

    def _per_sequence(self, x: mx.array, cache: BatchKVCache) -> mx.array:
        """A batch's call where each sequence's attention runs as its solo call would: its own keys without the
        left padding, no mask (rows one at a time when ``per_row``); the projections as the linear layers are
        set (one-row products in a batch-invariant step)."""
        B, L, _ = x.shape
        pads = cache.left_padding.tolist()  # small, already computed
        # Rope in one call with the batch's offsets: measured equal to each sequence's own call (an H100: rope per
        # sequence gave the same tokens at more cost, bench/results/h100-mlx-cuda-batch-identity.txt).
        queries, keys, values, gate = self._project(x, cache)
        end = keys.shape[2]
        outputs = []
        from ..kernels.cuda_attn import MAX_ROWS, attend_rows

        kernel = self.attn_kernel and ATTN_KERNEL_ON and L <= MAX_ROWS
        for b in range(B):
            q, k, v = queries[b : b + 1], keys[b : b + 1, :, pads[b] :], values[b : b + 1, :, pads[b] :]
            if kernel:  # as the solo call attends (exo's kernel): its keys from position 0, so the same chunks
                outputs.append(attend_rows(q, k, v, k.shape[2], self.scale))
            elif L == 1:
                outputs.append(self.attend(q, k, v, None, None))
            elif self.per_row:
                before = end - pads[b] - L
                outputs.append(mx.concatenate([
                    self.attend(q[:, :, t : t + 1], k[:, :, : before + t + 1], v[:, :, : before + t + 1], None, None)
                    for t in range(L)
                ], axis=2))
            else:
                outputs.append(self.attend(q, k, v, None, "causal"))
        output = mx.concatenate(outputs).transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(output * mx.sigmoid(gate))
