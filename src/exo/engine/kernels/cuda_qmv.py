"""A quantized linear layer's product for a few rows on MLX CUDA: the weights read once, every row summed exactly
as MLX's one-row product (its ``qmv`` kernel) sums it.

A verify call computes K + 1 rows of every linear layer of the backbone. Each row must round as the one-row
decode step at its position rounds, or greedy speculative decoding stops reproducing plain decoding; and the
rows should cost about one row's weight reads, or a round can never cost much less than K + 1 plain steps on a
device whose decoding is bound by memory bandwidth.

MLX 0.32's CUDA backend (``mlx/backend/cuda/quantized/quantized.cpp``, ``qmm/qmv.cu``) runs a one-row
``quantized_matmul`` (affine, group 32/64/128, bfloat16 or float16 activations; on sm_90 its ``qmm_sm90`` path
needs ``group_size >= K`` and is not taken) as ``qmv``: one warp per output, 8 warps a block; lane ``t`` of the
warp takes ``E`` consecutive inputs at ``t * E + r * 32 * E`` (``E`` = 16 for 4-bit, 8 for 8-bit), dequantizes
them in the activations' type (``w * scale + bias``, cutlass's array operators: two roundings) and accumulates
``E`` partial sums in order: in the activations' type for fewer than 8 bits (``cutlass::fma`` of half-precision
arrays), in float for 8 bits (both operands widened, a float fma); then sums its ``E`` partials in float from
+0, reduces the warp with ``cg::reduce(plus<float>)`` and rounds once to the output type. Rows 2..7 of a block
go through the same kernel, one grid row each (``M * B < 8``): every row as alone, but each row reading the
whole weight again (from L2 where it fits, else from memory); from 8 rows on, ``qmm_sm80``, another order.

``qmv_rows`` is that kernel for up to ``MAX_ROWS`` rows at once: the same warp layout, the same dequantization
and the same per-lane order of fmas and reductions (cutlass's own functions, through the headers MLX's JIT
ships), with one set of partial sums per row: each weight tile is read and dequantized once and used by every
row. Each row's sums are exactly the one-row kernel's. ``matches_mlx`` checks that, bit for bit against MLX's
own one-row products, before a model uses it (``engine/verify.py``), so a later MLX whose ``qmv`` sums otherwise
keeps MLX's product. Other devices: MLX's own ``quantized_matmul`` (the reference path; on the CPU a block of
rows equals its rows one at a time, tests/engine/test_layers.py).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

MAX_ROWS = 4  # rows per launch (K + 1 at K <= 3); more rows go in launches of this many
ROWS_PER_BLOCK = 8  # warps (outputs) per block, as MLX's qmv
WARP = 32
BITS = (4, 8)
GROUPS = (32, 64, 128)

# The headers MLX's qmv takes its arithmetic from (cutlass's converters and array operators, cute's bit sizes),
# without cute/tensor.hpp: NVRTC compiles this in seconds, once per (bits, group, residue) and MLX version (MLX
# keeps the PTX in its cache, MLX_PTX_CACHE_DIR).
HEADER = r"""
// MLX's default header (its device utils, through libcu++) defines FP_NAN & co. as macros under NVRTC;
// cutlass's NVRTC header declares them as enumerators (and then defines the same macros, the same values):
// undefined first, or NVRTC stops at "expected an identifier".
#undef FP_NAN
#undef FP_INFINITE
#undef FP_ZERO
#undef FP_SUBNORMAL
#undef FP_NORMAL
#include <cute/numeric/numeric_types.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cuda/std/type_traits>
#include <cooperative_groups/reduce.h>

namespace exo_qmv {

template <typename U> struct cutlass_type;
template <> struct cutlass_type<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct cutlass_type<__half> { using type = cutlass::half_t; };

// MLX's qmv_kernel_impl (qmm/qmv.cu) for up to MAX_ROWS rows of x: one warp per output ``row``, each lane's
// partial sums per x row in the one-row kernel's order; the weight tile is loaded and dequantized once.
template <int MAX_ROWS, int BITS, int GROUP, bool HAS_RESIDUE_K, typename CT>
__device__ __forceinline__ void qmv_rows(
    const CT* x, const uint8_t* w_bytes, const CT* scales, const CT* biases, CT* out,
    int rows, int row, int n, int k) {
  namespace cg = cooperative_groups;
  using T = typename cutlass_type<CT>::type;
  using Q = cuda::std::conditional_t<(BITS == 4), cutlass::uint4b_t, uint8_t>;
  constexpr int E = (cute::sizeof_bits_v<T> <= 16 && cute::sizeof_bits_v<Q> <= 4) ? 16 : 8;
  using Acc = cuda::std::conditional_t<(BITS >= 8), float, T>;
  auto warp = cg::tiled_partition<WARP_SIZE>(cg::this_thread_block());
  auto w_step = [&](int idx) { return idx * cuda::std::min(8, BITS) / 8; };
  const T* xt = reinterpret_cast<const T*>(x);
  const Q* w = reinterpret_cast<const Q*>(w_bytes);
  const T* st = reinterpret_cast<const T*>(scales);
  const T* bt = reinterpret_cast<const T*>(biases);
  int groups_per_row = k / GROUP;
  w += static_cast<int64_t>(row) * w_step(k);
  st += static_cast<int64_t>(row) * groups_per_row;
  bt += static_cast<int64_t>(row) * groups_per_row;

  Acc sums[MAX_ROWS][E] = {};

  auto tile = [&](int idx) {
    T scale = st[idx / GROUP];
    T bias = bt[idx / GROUP];
    auto w_vec = *(reinterpret_cast<const cutlass::Array<Q, E>*>(w + w_step(idx)));
    cutlass::NumericArrayConverter<T, Q, E> converter_tq;
    cutlass::Array<T, E> w_dq = converter_tq(w_vec);
    w_dq = w_dq * T(scale) + bias;
    if constexpr (BITS >= 8) {
      cutlass::NumericArrayConverter<float, T, E> converter_ft;
      cutlass::Array<float, E> w_f = converter_ft(w_dq);
#pragma unroll
      for (int m = 0; m < MAX_ROWS; ++m) {
        if (m < rows) {
          auto x_vec = *(reinterpret_cast<const cutlass::Array<T, E>*>(xt + static_cast<int64_t>(m) * k + idx));
          cutlass::Array<float, E> x_f = converter_ft(x_vec);
          auto* acc = reinterpret_cast<cutlass::Array<float, E>*>(sums[m]);
          *acc = cutlass::fma(x_f, w_f, *acc);
        }
      }
    } else {
#pragma unroll
      for (int m = 0; m < MAX_ROWS; ++m) {
        if (m < rows) {
          auto x_vec = *(reinterpret_cast<const cutlass::Array<T, E>*>(xt + static_cast<int64_t>(m) * k + idx));
          auto* acc = reinterpret_cast<cutlass::Array<T, E>*>(sums[m]);
          *acc = cutlass::fma(x_vec, w_dq, *acc);
        }
      }
    }
  };

  constexpr int elems_per_warp = WARP_SIZE * E;
  for (int r = 0; r < k / elems_per_warp; ++r) {
    tile(warp.thread_rank() * E + r * elems_per_warp);
  }
  if constexpr (HAS_RESIDUE_K) {
    int rest = k % elems_per_warp;
    int idx = warp.thread_rank() * E + k - rest;
    if (idx < k) {
      tile(idx);
    }
  }

#pragma unroll
  for (int m = 0; m < MAX_ROWS; ++m) {
    if (m < rows) {
      float sum{0};
#pragma unroll
      for (int i = 0; i < E; ++i) {
        sum += sums[m][i];
      }
      sum = cg::reduce(warp, sum, cg::plus<float>{});
      if (warp.thread_rank() == 0) {
        reinterpret_cast<T*>(out)[static_cast<int64_t>(m) * n + row] = static_cast<T>(sum);
      }
    }
  }
}

}  // namespace exo_qmv
"""

# The kernel's body (MLX writes the signature: x, w, scales, biases and their shapes, then out).
SOURCE = r"""
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<WARP_SIZE>(block);
  int n = w_shape[0];
  int k = x_shape[1];
  int row = block.group_index().x * ROWS_PER_BLOCK + warp.meta_group_rank();
  if (row >= n) {
    return;
  }
  exo_qmv::qmv_rows<MAX_ROWS, BITS, GROUP, HAS_RESIDUE_K>(
      x, reinterpret_cast<const uint8_t*>(w), scales, biases, out, x_shape[0], row, n, k);
"""


def elems_per_lane(bits: int) -> int:
    """Inputs a lane takes per step (MLX's ``elems_per_thread``: 16 for sub-byte weights of 16-bit activations)."""
    return 16 if bits <= 4 else 8


@functools.cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="exo_qmv_rows",
        input_names=["x", "w", "scales", "biases"],
        output_names=["out"],
        source=SOURCE,
        header=HEADER,
        ensure_row_contiguous=True,
    )


def enabled() -> bool:
    """``EXO_QMV_ROWS=0`` keeps MLX's products everywhere (A/B measurement)."""
    return os.environ.get("EXO_QMV_ROWS", "") != "0"


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def applies(x: mx.array, module: Any) -> bool:
    """Whether ``qmv_rows`` computes ``module``'s product (a QuantizedLinear / QuantizedEmbedding's) for ``x``:
    MLX CUDA, affine 4- or 8-bit with biases, groups of 32/64/128, 16-bit activations."""
    return (
        on_cuda()
        and getattr(module, "mode", "affine") == "affine"
        and getattr(module, "bits", None) in BITS
        and getattr(module, "group_size", None) in GROUPS
        and "biases" in module
        and x.dtype in (mx.bfloat16, mx.float16)
        and module.scales.dtype == x.dtype
        and x.shape[-1] % module.group_size == 0
        and x.shape[-1] % 8 == 0
    )


def qmv_rows(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int) -> mx.array:
    """``x @ dequantize(w).T`` for x [..., K] (its rows in launches of ``MAX_ROWS``), w [N, K * bits / 32] uint32,
    each row bit for bit MLX's one-row ``quantized_matmul`` on MLX CUDA (``matches_mlx`` checks it); on any other
    device MLX's ``quantized_matmul`` itself."""
    if not on_cuda():
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    k, n = x.shape[-1], w.shape[0]
    flat = x.reshape(-1, k)
    blocks = -(-n // ROWS_PER_BLOCK)
    residue = k % (WARP * elems_per_lane(bits)) != 0
    outs = []
    for start in range(0, flat.shape[0], MAX_ROWS):
        rows = flat[start : start + MAX_ROWS]
        outs.append(_kernel()(
            inputs=[rows, w, scales, biases],
            template=[("MAX_ROWS", MAX_ROWS), ("BITS", bits), ("GROUP", group_size), ("HAS_RESIDUE_K", residue),
                      ("ROWS_PER_BLOCK", ROWS_PER_BLOCK)],
            grid=(WARP * blocks, ROWS_PER_BLOCK, 1),
            threadgroup=(WARP, ROWS_PER_BLOCK, 1),
            output_shapes=[(rows.shape[0], n)],
            output_dtypes=[x.dtype],
        )[0])
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return out.reshape(*x.shape[:-1], n)


def module_rows(module: Any, x: mx.array) -> mx.array:
    """A QuantizedLinear's call (or a QuantizedEmbedding's ``as_linear``) through ``qmv_rows``, its bias added as
    the layer adds it."""
    out = qmv_rows(x, module["weight"], module["scales"], module["biases"], group_size=module.group_size,
                   bits=module.bits)
    if "bias" in module:
        out = out + module["bias"]
    return out


def matches_mlx(module: Any, rows: mx.array, one_row: Callable[[mx.array], mx.array] | None = None) -> bool:
    """Whether ``module_rows`` gives, for ``rows`` [1, R, K], MLX's one-row products of the same rows bit for bit
    (every launch size from 1 row to R); ``one_row``: the layer's one-row call (default ``module`` itself; a tied
    embedding's ``as_linear``). Errors of the JIT (no CUDA headers, a compile failure) count as no."""
    one_row = one_row or module
    try:
        single = mx.concatenate([one_row(rows[:, t : t + 1]) for t in range(rows.shape[1])], axis=1)
        outs = [module_rows(module, rows[:, :r]) for r in range(1, rows.shape[1] + 1)]
        mx.eval(single, outs)
    except Exception:  # noqa: BLE001 - any failure of the custom kernel leaves MLX's product in place
        return False
    return all(bool(mx.array_equal(out.view(mx.uint16), single[:, : out.shape[1]].view(mx.uint16)).item())
               for out in outs)


def faster(kernel: Callable[[], mx.array], stock: Callable[[], mx.array], *, calls: int = 8, reps: int = 3) -> bool:
    """Whether ``kernel`` computes as fast as ``stock`` or faster: ``calls`` calls of each in one evaluation, timed
    ``reps`` times in turn after an untimed one (its first launch compiles), the fastest of each kept."""
    times: dict[int, float] = {0: math.inf, 1: math.inf}
    for rep in range(reps + 1):
        for i, fn in enumerate((kernel, stock)):
            start = time.perf_counter()
            mx.eval([fn() for _ in range(calls)])
            if rep:
                times[i] = min(times[i], time.perf_counter() - start)
    return times[0] <= times[1]
