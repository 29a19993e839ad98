"""exo's quantized matrix-vector product for decode-sized calls on MLX CUDA: 1 to 8 rows in one launch, every
row's sums in an order that does not depend on how many rows the launch has, near the memory's bandwidth.

A decode step multiplies one row by every weight of the model: on a GPU the quantized linear layers are most of
its time, and they should cost the weights' bytes over the memory's bandwidth. MLX 0.32's CUDA ``qmv`` (one warp
per output, each lane dequantizing 16 weights in bfloat16 arrays and re-reading its 32 bytes of x per 8 bytes
of weight) reads them at a fraction of the memory's bandwidth (docs/performance.md). A verify call's K + 1 rows must
also each round as the decode step at its position does, or greedy speculative decoding stops reproducing plain
decoding; MLX sums 1 to 7 rows alike but reads the weights again for every row. This kernel runs the plain
step and the verify rows alike, so rows agree by construction, and reads each weight once for all rows.

The arithmetic (float32 throughout, every operation an IEEE one written as an intrinsic so that nothing is
contracted or reordered): a lane takes 16 bytes of one output's packed weights at a time (a "chunk": 32 4-bit or
16 8-bit weights, inside one quantization group), and for each row m

- ``S = sum_e x[e] * (1 + q[e] / 2^bits)`` in element order from +0 (each product is exact: a 16-bit x times
  a 5- or 9-bit factor; the factor is the weight's bits placed under the mantissa of 1.0: one shift and one
  logic op per weight, no conversion), ``X = sum_e x[e]`` in order from +0;
- the chunk's value ``t = (s * 2^bits) * S + (b - s * 2^bits) * X`` (= ``sum_e x[e] * (s * q[e] + b)``,
  the group's scale s and bias b), two products and a sum, each rounded once;
- the lane's sum of its chunks' ``t`` in order from +0; the warp's lanes summed by an xor butterfly (16, 8, 4,
  2, 1); where a few warps split K between them (``split``, chosen from the layer's shape only), their sums
  added in warp order; one rounding to the activations' type.

Nothing in that depends on the number of rows: each row's value is the same whether it is computed alone or
with others. It is not MLX's product (which dequantizes and accumulates in bfloat16 for 4-bit weights), so a
plain decode step on MLX CUDA no longer equals stock mlx-lm's bit for bit where this runs; it is closer to the
exact value (``check`` measures both against a float32 reference).

``emulate`` is the same arithmetic in MLX operations, on any device: the kernel's reference, bit for bit
(``check`` compares them on the device before a model uses the kernel), and what the engine runs on the CPU
when ``EXO_QGEMV=always`` (tests of the wiring).

On by default on MLX CUDA (``EXO_QGEMV=0``: MLX's products). It was off while its Python wrapper built each call
for ~9 us (plain decoding then ran at 0.654x stock mlx-lm); with its launch arguments kept and the layers' input
projections fused (``models.fused_inputs``), on an H200 the random 9B decoded at 1.146x stock with it and the
GatedDeltaNet step kernel, against 0.922x on MLX's products in the same run, and a verify call of 2 / 4 rows cost
1.09x / 1.29x a one-row step against 1.48x / 2.48x (docs/performance.md).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import mlx.core as mx

from .cuda_build import CudaKernel, precompiled_failed

WARPS = 4  # warps per block
WARP = 32
MAX_ROWS = 8  # rows per launch; more go in launches of this many
# Calls of up to this many rows (a batch step of up to 32 sequences, a short prompt chunk) go through the kernel in
# launches of MAX_ROWS; more keep MLX's product (a prompt's chunks: its tiled product, or dense, ``prompt_dense``).
# On an H200 MLX's product grows with its rows (the 9B's up_proj: 59 us at one row, 207 at 8, 378 at 16: each row
# re-read the weights, ``bench/qmm_rows.py``) where a launch of 8 rows of this kernel took 85 us (``qmv_check.py``):
# 16 rows in two launches ~170 us. ``EXO_QGEMV_ROWS`` sets it (8: only what one launch takes).
CALL_ROWS = max(MAX_ROWS, int(os.environ.get("EXO_QGEMV_ROWS", "32") or 32))
BITS = (4, 8)
GROUPS = (32, 64, 128)
DTYPES = (mx.bfloat16, mx.float16)

HEADER = r"""
namespace exo_qgemv {

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Element e (0 or 1) of two 16-bit activations packed in a 32-bit word, as a float (exact).
template <typename T> __device__ __forceinline__ float unpack(uint32_t u, int e);
template <> __device__ __forceinline__ float unpack<__nv_bfloat16>(uint32_t u, int e) {
  return __uint_as_float(e ? (u & 0xffff0000u) : (u << 16));
}
template <> __device__ __forceinline__ float unpack<__half>(uint32_t u, int e) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(e ? (u >> 16) : (u & 0xffffu))));
}

// Weight e of a packed 32-bit word (MLX's affine layout: element e in bits [BITS e, BITS (e + 1))) as
// 1 + q / 2^BITS: its bits moved under the mantissa's top and or-ed into 1.0f (exact; e is a constant
// once the loops over it are unrolled).
template <int BITS>
__device__ __forceinline__ float weight(uint32_t w, int e) {
  constexpr int top = 23 - BITS;
  constexpr uint32_t mask = ((1u << BITS) - 1u) << top;
  const int at = BITS * e;
  const uint32_t v = at <= top ? (w << (top - at)) : (w >> (at - top));
  return __uint_as_float((v & mask) | 0x3f800000u);
}

// 16 bytes of weights, read once: past L1 (every byte is used once; x stays there).
__device__ __forceinline__ uint4 load_weights(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

}  // namespace exo_qgemv
"""

# The kernel's body: MLX writes the signature (x, w, scales, biases with w_shape, then out) and the template
# constants T, ST, BITS, GROUP, K, ROWS, OUTS, SPLIT. x is ROWS rows of K, whatever its shape's leading dims.
SOURCE = r"""
  using namespace exo_qgemv;
  constexpr int WARPS = 4;
  constexpr int NGROUPS = WARPS / SPLIT;  // groups of OUTS outputs per block
  constexpr int CHUNK = 128 / BITS;       // weights in 16 bytes
  constexpr int PER_WORD = 32 / BITS;     // weights in a 32-bit word
  const float scale_up = static_cast<float>(1 << BITS);
  const int n_out = w_shape[0];
  const int k = K;
  const int chunks = k / CHUNK;
  const int groups_per_row = k / GROUP;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int part = warp % SPLIT;          // which share of K this warp sums
  const int n0 = (blockIdx.x * NGROUPS + warp / SPLIT) * OUTS;
  __shared__ float partial[WARPS][OUTS * ROWS];

  int64_t w_row[OUTS], s_row[OUTS];
#pragma unroll
  for (int r = 0; r < OUTS; ++r) {
    const int64_t n = min(n0 + r, n_out - 1);  // outputs past N read the last row; nothing is written for them
    w_row[r] = n * chunks;
    s_row[r] = n * groups_per_row;
  }
  const uint4* w16 = reinterpret_cast<const uint4*>(w);

  float acc[OUTS][ROWS];
#pragma unroll
  for (int r = 0; r < OUTS; ++r) {
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      acc[r][m] = 0.0f;
    }
  }

  for (int c = part * 32 + lane; c < chunks; c += 32 * SPLIT) {
    uint4 wv[OUTS];
#pragma unroll
    for (int r = 0; r < OUTS; ++r) {
      wv[r] = load_weights(w16 + w_row[r] + c);
    }
    const int g = (c * CHUNK) / GROUP;
    float sc[OUTS], bi[OUTS];
#pragma unroll
    for (int r = 0; r < OUTS; ++r) {
      sc[r] = __fmul_rn(to_float(scales[s_row[r] + g]), scale_up);
      bi[r] = __fsub_rn(to_float(biases[s_row[r] + g]), sc[r]);
    }
    float sum[OUTS][ROWS], xsum[ROWS];
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      xsum[m] = 0.0f;
#pragma unroll
      for (int r = 0; r < OUTS; ++r) {
        sum[r][m] = 0.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // the PER_WORD activations of each row under word j: 16 bytes (4-bit) or 8 bytes (8-bit)
      uint32_t xw[ROWS][PER_WORD / 2];
#pragma unroll
      for (int m = 0; m < ROWS; ++m) {
        const T* xp = x + static_cast<int64_t>(m) * k + c * CHUNK + j * PER_WORD;
        if constexpr (PER_WORD == 8) {
          const uint4 v = __ldg(reinterpret_cast<const uint4*>(xp));
          xw[m][0] = v.x; xw[m][1] = v.y; xw[m][2] = v.z; xw[m][3] = v.w;
        } else {
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(xp));
          xw[m][0] = v.x; xw[m][1] = v.y;
        }
      }
#pragma unroll
      for (int e = 0; e < PER_WORD; ++e) {
        float xf[ROWS];
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
          xf[m] = unpack<T>(xw[m][e / 2], e % 2);
          xsum[m] = __fadd_rn(xsum[m], xf[m]);
        }
#pragma unroll
        for (int r = 0; r < OUTS; ++r) {
          const float f = weight<BITS>(word(wv[r], j), e);
#pragma unroll
          for (int m = 0; m < ROWS; ++m) {
            sum[r][m] = __fmaf_rn(xf[m], f, sum[r][m]);  // the product is exact: fma or not, the same
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < OUTS; ++r) {
#pragma unroll
      for (int m = 0; m < ROWS; ++m) {
        acc[r][m] = __fadd_rn(acc[r][m], __fadd_rn(__fmul_rn(sc[r], sum[r][m]), __fmul_rn(bi[r], xsum[m])));
      }
    }
  }

#pragma unroll
  for (int r = 0; r < OUTS; ++r) {
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      float v = acc[r][m];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, offset));
      }
      acc[r][m] = v;  // every lane holds the warp's sum (each pair added both ways: the same bits)
    }
  }
  if constexpr (SPLIT == 1) {
#pragma unroll
    for (int r = 0; r < OUTS; ++r) {
#pragma unroll
      for (int m = 0; m < ROWS; ++m) {
        if (lane == r * ROWS + m && n0 + r < n_out) {
          out[static_cast<int64_t>(m) * n_out + n0 + r] = from_float<T>(acc[r][m]);
        }
      }
    }
  } else {
#pragma unroll
    for (int r = 0; r < OUTS; ++r) {
#pragma unroll
      for (int m = 0; m < ROWS; ++m) {
        if (lane == r * ROWS + m) {
          partial[warp][r * ROWS + m] = acc[r][m];
        }
      }
    }
    __syncthreads();
    if (part == 0 && lane < OUTS * ROWS) {
      float total = partial[warp][lane];
#pragma unroll
      for (int p = 1; p < SPLIT; ++p) {
        total = __fadd_rn(total, partial[warp + p][lane]);
      }
      const int r = lane / ROWS;
      const int m = lane % ROWS;
      if (n0 + r < n_out) {
        out[static_cast<int64_t>(m) * n_out + n0 + r] = from_float<T>(total);
      }
    }
  }
"""


def outputs_per_warp(rows: int) -> int:
    """Outputs a warp computes at once for a launch of ``rows`` rows (more outputs: x read once for more of
    them; more rows: more registers per output). Each output's sums do not depend on it."""
    return 8 if rows <= 2 else 4 if rows <= 4 else 2


def split_for(n: int, k: int, bits: int) -> int:
    """Warps that split a layer's K between them (1, 2 or 4): more for a layer of few outputs, so that it still
    has warps enough to keep the memory busy; at most one pass of the warp's 32 lanes each. From the layer's
    shape only: the sums' order must not depend on the rows."""
    chunks = k // (128 // bits)
    split = 1
    while split < WARPS and chunks >= 64 * split and n * split < 4096:
        split *= 2
    return split


@functools.cache
def _kernel() -> Any:
    return CudaKernel(
        name="exo_qgemv",
        input_names=["x", "w", "scales", "biases"],
        output_names=["out"],
        source=SOURCE,
        header=HEADER,
        ensure_row_contiguous=True,
    )


def mode() -> str:
    """``EXO_QGEMV``: ``1`` (default) this kernel on MLX CUDA where ``check`` passes; ``0`` MLX's products
    everywhere; ``always`` also on other devices, as ``emulate`` (tests run the engine's wiring on the CPU)."""
    value = os.environ.get("EXO_QGEMV", "1").strip().lower()
    return {"0": "off", "false": "off", "off": "off", "always": "always"}.get(value, "cuda")


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and on_cuda_device()


def supported(module: Any) -> bool:
    """Whether a QuantizedLinear / QuantizedEmbedding's weights are in a layout this computes: affine, 4 or 8
    bits with biases, groups of 32/64/128, 16-bit scales."""
    return (
        getattr(module, "mode", "affine") == "affine"
        and getattr(module, "bits", None) in BITS
        and getattr(module, "group_size", None) in GROUPS
        and "biases" in module
        and module["scales"].dtype in DTYPES
        and module["biases"].dtype == module["scales"].dtype
        and module["weight"].dtype == mx.uint32
        and module["weight"].ndim == 2
    )


def qgemv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int) -> mx.array:
    """``x @ dequantize(w).T`` for x [..., K] bfloat16 / float16, w [N, K * bits / 32] uint32 (MLX's affine
    layout), every row as this module's arithmetic computes it alone: the kernel on MLX CUDA (rows in launches of
    ``MAX_ROWS``), ``emulate`` elsewhere."""
    if not on_cuda():
        return emulate(x, w, scales, biases, group_size=group_size, bits=bits)
    shape = x.shape
    k, n = shape[-1], w.shape[0]
    rows = x.size // k
    if rows <= MAX_ROWS:  # a decode step's, a verify call's, a small batch's: one launch, bound once (_bound)
        return _bound(rows, n, k, bits, group_size, x.dtype, scales.dtype, len(shape))(
            [x, w, scales, biases], [(*shape[:-1], n)])[0]
    flat = x.reshape(-1, k)
    outs = []
    for start in range(0, rows, MAX_ROWS):
        part = flat[start : start + MAX_ROWS]
        template, grid = _launch(part.shape[0], n, k, bits, group_size, x.dtype, scales.dtype)
        outs.append(_kernel()(inputs=[part, w, scales, biases], template=template, grid=grid, threadgroup=THREADGROUP,
                              output_shapes=[(part.shape[0], n)], output_dtypes=[x.dtype])[0])
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return out.reshape(*x.shape[:-1], n)


THREADGROUP = (WARP * WARPS, 1, 1)


@functools.cache
def _launch(rows: int, n: int, k: int, bits: int, group_size: int, dtype: mx.Dtype,
            scale_dtype: mx.Dtype) -> tuple[list[tuple[str, Any]], tuple[int, int, int]]:
    """A launch's template constants and grid for ``rows`` rows of a layer's shape (kept: a decode step makes
    ~250 launches, and building these each time cost the host more than the launch itself)."""
    split = split_for(n, k, bits)
    per_warp = outputs_per_warp(rows)
    blocks = -(-n // (per_warp * (WARPS // split)))
    template = [("T", dtype), ("ST", scale_dtype), ("BITS", bits), ("GROUP", group_size), ("K", k), ("ROWS", rows),
                ("OUTS", per_warp), ("SPLIT", split)]
    return template, (WARP * WARPS * blocks, 1, 1)


@functools.cache
def _bound(rows: int, n: int, k: int, bits: int, group_size: int, dtype: mx.Dtype, scale_dtype: mx.Dtype,
           ndim: int) -> Any:
    """The kernel's launch for ``rows`` rows of a layer's shape and an input of ``ndim`` dims, bound once
    (``CudaKernel.bind``): a decode step makes ~130 of these; through ``CudaKernel.__call__`` each cost the host
    ~3.7 us more (a 2-core EPYC, ``bench/build_profile.py --emulate-cuda``)."""
    template, grid = _launch(rows, n, k, bits, group_size, dtype, scale_dtype)
    return _kernel().bind(template, [dtype, mx.uint32, scale_dtype, scale_dtype], [ndim, 2, 2, 2], [dtype], grid,
                          THREADGROUP)


@functools.cache
def on_cuda_device() -> bool:
    return mx.cuda.is_available()


def emulate(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int, bits: int,
            split: int | None = None) -> mx.array:
    """The kernel's arithmetic (see the module's doc) in MLX operations, each a float32 operation rounded once
    in the kernel's order: its reference bit for bit, on any device. ``split``: the warps splitting K (default
    ``split_for`` of w's shape; given, to reproduce some outputs of a larger layer)."""
    k, n = x.shape[-1], w.shape[0]
    flat = x.reshape(-1, k).astype(mx.float32)  # exact
    rows = flat.shape[0]
    chunk, per_word = 128 // bits, 32 // bits
    chunks = k // chunk
    shifts = mx.arange(per_word, dtype=mx.uint32) * bits
    q = (w[:, :, None] >> shifts) & ((1 << bits) - 1)  # [N, K / per_word, per_word]: element e of each word
    factor = (q.astype(mx.float32) * (1.0 / (1 << bits)) + 1.0).reshape(n, chunks, chunk)  # 1 + q / 2^bits
    xc = flat.reshape(rows, 1, chunks, chunk)
    s = mx.zeros((rows, n, chunks), dtype=mx.float32)
    xs = mx.zeros((rows, 1, chunks), dtype=mx.float32)
    for e in range(chunk):
        s = s + xc[..., e] * factor[None, :, :, e]  # the product is exact
        xs = xs + xc[..., e]
    group = mx.arange(chunks) * chunk // group_size
    sc = scales.astype(mx.float32)[:, group] * float(1 << bits)  # [N, chunks]
    bi = biases.astype(mx.float32)[:, group] - sc
    t = sc[None] * s + bi[None] * xs  # [rows, N, chunks]
    split = split_for(n, k, bits) if split is None else split
    lanes = WARP * split
    steps = -(-chunks // lanes)
    t = mx.pad(t, [(0, 0), (0, 0), (0, steps * lanes - chunks)])  # +0 where a lane has no chunk: adds nothing
    t = t.reshape(rows, n, steps, split, WARP)
    acc = mx.zeros((rows, n, split, WARP), dtype=mx.float32)
    for step in range(steps):
        acc = acc + t[:, :, step]
    offset = WARP // 2
    while offset:
        partner = acc.reshape(rows, n, split, WARP // (2 * offset), 2, offset)[..., ::-1, :]
        acc = acc + partner.reshape(rows, n, split, WARP)
        offset //= 2
    total = acc[..., 0, 0]
    for p in range(1, split):
        total = total + acc[..., p, 0]
    return total.astype(x.dtype).reshape(*x.shape[:-1], n)


def module_product(module: Any, x: mx.array) -> mx.array:
    """A QuantizedLinear's call (or a QuantizedEmbedding's ``as_linear``) through ``qgemv``, its bias added as
    the layer adds it."""
    out = qgemv(x, module["weight"], module["scales"], module["biases"], group_size=module.group_size,
                bits=module.bits)
    if "bias" in module:
        out = out + module["bias"]
    return out


# Tolerances of ``check``, relative to sum_k |x_k| |w_k| of each output (what a rounding error of the sum can
# scale with): the kernel's own error against a float32 reference (a bfloat16 output's rounding is at most 2^-9
# of its value: room for float32's roundings on top; measured up to 7.5e-4 on random layers), and its distance
# to MLX's product, a sanity bound (MLX rounds the dequantized weights and partial sums to bfloat16 for 4-bit
# weights: its own error measured up to 1.8e-2 on the CPU; a wrong group or layout is off by O(1)).
REFERENCE_TOLERANCE = 2.0**-8
MLX_TOLERANCE = 2.0**-3
CHECK_OUTPUTS = 256  # outputs of each shape compared with ``emulate``, a float32 reference and MLX's product


def check(module: Any, *, rows: int = 4, key: mx.array | None = None) -> tuple[bool, str]:
    """Whether ``qgemv`` computes ``module``'s product as it should on this device: on random rows, (1) a launch
    of 1..``rows`` rows gives each row the bits it gets alone, (2) the first ``CHECK_OUTPUTS`` outputs equal
    ``emulate``'s bit for bit, (3) one row is within ``REFERENCE_TOLERANCE`` of a float32 reference and
    ``MLX_TOLERANCE`` of MLX's product. Returns (passed, what was found). A failure of the JIT (no CUDA headers,
    a compile error) counts as not passed."""
    w, scales, biases = module["weight"], module["scales"], module["biases"]
    group, bits = module.group_size, module.bits
    k = w.shape[1] * 32 // bits
    key = mx.random.key(20261129) if key is None else key
    x = (mx.random.normal((rows, k), key=key) * 0.5).astype(scales.dtype)
    try:
        alone = mx.concatenate([qgemv(x[t : t + 1], w, scales, biases, group_size=group, bits=bits)
                                for t in range(rows)])
        together = [qgemv(x[:r], w, scales, biases, group_size=group, bits=bits) for r in range(2, rows + 1)]
        head = slice(0, min(CHECK_OUTPUTS, w.shape[0]))
        emulated = emulate(x, w[head], scales[head], biases[head], group_size=group, bits=bits,
                           split=split_for(w.shape[0], k, bits))
        mlx = mx.quantized_matmul(x[:1], w[head], scales[head], biases[head], transpose=True, group_size=group,
                                  bits=bits)
        mx.eval(alone, together, emulated, mlx)
    except Exception as e:  # noqa: BLE001 - any failure of the custom kernel leaves MLX's product in place
        if precompiled_failed(e):  # once more, MLX compiling the kernel
            return check(module, rows=rows, key=key)
        return False, f"the kernel did not run: {type(e).__name__}: {str(e)[:300]}"
    for r, block in enumerate(together, start=2):
        if not _bits_equal(block, alone[:r]):
            return False, f"a launch of {r} rows differs from its rows alone"
    if not _bits_equal(alone[:, head], emulated):
        return False, "the kernel differs from its reference arithmetic (emulate)"
    # against a float32 reference and MLX's product on those outputs (each output's value is its own)
    dense = mx.dequantize(w[head], scales[head].astype(mx.float32), biases[head].astype(mx.float32), group_size=group,
                          bits=bits)
    reference = x[:1].astype(mx.float32) @ dense.T
    magnitude = mx.abs(x[:1].astype(mx.float32)) @ mx.abs(dense).T
    magnitude = mx.maximum(magnitude, 1e-30)
    own = float((mx.abs(alone[:1, head].astype(mx.float32) - reference) / magnitude).max().item())
    vs_mlx = float((mx.abs(alone[:1, head].astype(mx.float32) - mlx.astype(mx.float32)) / magnitude).max().item())
    found = f"error {own:.2e} of |x||w| (MLX's product {vs_mlx:.2e} from it)"
    if not (own <= REFERENCE_TOLERANCE and vs_mlx <= MLX_TOLERANCE) or math.isnan(own + vs_mlx):
        return False, found
    return True, found


def _bits_equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a.view(mx.uint16), b.view(mx.uint16)).item())
