"""A GatedDeltaNet layer's decode-sized step on MLX CUDA in one launch: T = 1 .. ``MAX_ROWS`` rows (a decode step,
or a verify call's K + 1 rows), the conv window, the q/k norms, the gate and beta, the recurrence and every row's
state for the rollback.

mlx-lm runs a GatedDeltaNet step off Apple GPUs as ~25 small ops (window concat, depthwise conv, silu, splits, two
RMS norms, the gate and beta, the recurrence as broadcast products and sums); exo compiles them into one graph
per row (``models.layers._row_step``), and a verify call runs that graph once per row: T launches of a few fused
kernels each, per layer. Here one launch computes all T rows, each row's arithmetic the same whatever T (its inputs
are the rows before it, its state the one the row before left: by construction a verify call's row t computes
what the t-th decode step computes), so the plain step (T = 1) and the verify call share it.

Per block: one value head of one sequence and 32 of its value rows (its state: 32 x Dk floats in registers,
4 lanes a row, Dk / 4 values a lane). First, for all T rows at once, the conv of the block's channels (the key
head's q and k, its 32 v) over the window and the rows, silu, the q and k RMS norms (each row's sums of squares
by one warp, in lane order then an xor butterfly), the gate and beta; then the rows one after another, each
with no barrier: decay, ``kv = sum(state * k)``, ``delta = (v - kv) * beta``, ``state += k * delta``,
``y = sum(state * q)`` (each sum: a lane's Dk / 4 values in order, then xor 1, 2 across the row's four lanes),
the state after the row written out. Roundings follow mlx-lm's graph: the conv's output, sigmoid and silu, a + dt_bias
and softplus (in their promoted dtype), the normalized q and k and beta in the activations' type; the recurrence
in float32. The order of sums and the fused multiply-adds are the kernel's own: it is not stock mlx-lm's op for op
(``check`` bounds the difference on the device, against ``reference``, mlx-lm's ops).

A prompt's chunk of any length goes through the same rows (``gdn_prompt``, ``PROMPT_SOURCE``): the body is composed
from the same pieces, ``TILE_ROWS`` rows prepared at a time in shared memory, the state kept in registers from the
first row to the last, only the last state written. Each row is thus its decode step's bits (``check_prompt``
confirms it on the device at load): a prompt, a cached turn's rest after a restore and the same tokens as decode
steps agree exactly, and a chunk is one launch a layer where the chunked form is ~350 primitives.

Off MLX CUDA (``EXO_GDN_KERNEL=always``: tests of the wiring) ``gdn_rows`` computes ``reference``. ``EXO_GDN_KERNEL=0``
keeps the compiled row graph.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import bits_equal, cuda_conversions, relative_error
from .cuda_build import CudaKernel, precompiled_failed

MAX_ROWS = 8
THREADS = 128
TILE = 32  # value rows per block
DTYPES = (mx.bfloat16, mx.float16)

HEADER = cuda_conversions("exo_gdn") + r"""
// v rounded to T, as an op of mlx-lm's graph in T rounds its result.
template <typename T> __device__ __forceinline__ float in_t(float v) { return to_float(from_float<T>(v)); }

}  // namespace exo_gdn
"""

# The kernels' body, shared by the step (``SOURCE``: a call's every row, each row's state written out) and the prompt
# kernel (``PROMPT_SOURCE``: any number of rows, ``TILE_ROWS`` at a time, the last state only). Both compute each
# row with the same instructions in the same order, so a prompt's rows are its decode steps' bits (``check_prompt``).
# @R0@: the first row of the rows being prepared (the call's row index), @N@: how many, @ROWS@: the call's rows,
# @TILE@: the rows the shared arrays hold.
_INDICES = r"""
  using namespace exo_gdn;
  constexpr int KEY_DIM = HK * DK;
  constexpr int C = 2 * KEY_DIM + HV * DV;
  constexpr int CH = 2 * DK + 32;   // channels a block convolves per row: q, k, its 32 v
  constexpr int PER_LANE = DK / 4;  // state values a lane holds
  const int batch = state_shape[0];
  const int tiles = DV / 32;
  const int tile = blockIdx.x % tiles;
  const int hv = (blockIdx.x / tiles) % HV;
  const int bi = blockIdx.x / (tiles * HV);
  const int hk = hv / (HV / HK);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int row = warp * 8 + (lane >> 2);  // the value row of the tile this lane's group holds
  const int part = lane & 3;
  const int dv = tile * 32 + row;
"""

_PRELUDE = _INDICES + r"""
  __shared__ __align__(16) float qn[@TILE@][DK];
  __shared__ __align__(16) float kn[@TILE@][DK];
  __shared__ float vv[@TILE@][32];
  __shared__ float gate[@TILE@];
  __shared__ float beta[@TILE@];
  __shared__ float inv_rms[2][@TILE@];

  // The state first: its loads are in flight while the rows' inputs are prepared.
  float s[PER_LANE];
  const float* state_row = state + ((static_cast<int64_t>(bi) * HV + hv) * DV + dv) * DK;
#pragma unroll
  for (int j = 0; j < DK / 16; ++j) {
    const float4 v = *reinterpret_cast<const float4*>(state_row + 16 * j + 4 * part);
    s[4 * j] = v.x; s[4 * j + 1] = v.y; s[4 * j + 2] = v.z; s[4 * j + 3] = v.w;
  }
"""

_CONV = r"""
  // The conv over [window; rows] of this block's channels, silu, for every row.
  for (int idx = tid; idx < @N@ * CH; idx += blockDim.x) {
    const int t = idx / CH;
    const int i = idx % CH;
    const int c = i < DK ? hk * DK + i : i < 2 * DK ? KEY_DIM + hk * DK + (i - DK) : 2 * KEY_DIM + hv * DV + tile * 32 + (i - 2 * DK);
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < TAPS; ++j) {
      const int r = @R0@ + t + j;  // row r of [window; rows]
      const float x = r < TAPS - 1 ? to_float(window[(static_cast<int64_t>(bi) * (TAPS - 1) + r) * C + c])
                                   : to_float(qkv[(static_cast<int64_t>(bi) * @ROWS@ + r - (TAPS - 1)) * C + c]);
      acc = __fmaf_rn(x, to_float(conv_w[c * TAPS + j]), acc);
    }
    const float conv = in_t<T>(acc);
    const float act = in_t<T>(conv * in_t<T>(1.0f / (1.0f + expf(-conv))));  // silu: x * sigmoid(x)
    if (i < DK) {
      qn[t][i] = act;
    } else if (i < 2 * DK) {
      kn[t][i - DK] = act;
    } else {
      vv[t][i - 2 * DK] = act;
    }
  }
"""

# A row's gate and beta, its q and k RMS norms and scales: @TID@ / @STRIDE@ the preparing threads' index and count,
# @WARP@ / @WARPS@ their warps', @SYNC@ their barrier, @B@ the half of double-buffered arrays (the second form).
_GATE = r"""  if (@TID@ < @N@) {
    const int64_t at = (static_cast<int64_t>(bi) * @ROWS@ + @R0@ + @TID@) * HV + hv;
    float x = to_float(a[at]) + to_float(dt_bias[hv]);  // a + dt_bias, then softplus, in their promoted dtype
    if constexpr (!PROMOTE_F32) {
      x = in_t<T>(x);
    }
    float softplus = fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
    if constexpr (!PROMOTE_F32) {
      softplus = in_t<T>(softplus);
    }
    gate@B@[@TID@] = expf(-expf(to_float(a_log[hv])) * softplus);
    beta@B@[@TID@] = in_t<T>(1.0f / (1.0f + expf(-to_float(b[at]))));
  }
  @SYNC@

"""

_NORMS = r"""  // Each row's RMS of q and of k: one warp a vector, lanes in order, then the butterfly.
  for (int p = @WARP@; p < 2 * @N@; p += @WARPS@) {
    const float* v = (p & 1) ? kn@B@[p >> 1] : qn@B@[p >> 1];
    float sq = 0.0f;
    for (int i = lane; i < DK; i += 32) {
      sq = __fmaf_rn(v[i], v[i], sq);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      sq = __fadd_rn(sq, __shfl_xor_sync(0xffffffffu, sq, offset));
    }
    if (lane == 0) {
      inv_rms[p & 1][p >> 1] = rsqrtf(sq / static_cast<float>(DK) + scalars[2]);
    }
  }
  @SYNC@
"""

_SCALE = r"""  for (int idx = @TID@; idx < @N@ * 2 * DK; idx += @STRIDE@) {
    const int t = idx / (2 * DK);
    const int i = idx % (2 * DK);
    if (i < DK) {
      qn@B@[t][i] = in_t<T>(in_t<T>(qn@B@[t][i] * inv_rms[0][t]) * scalars[0]);
    } else {
      kn@B@[t][i - DK] = in_t<T>(in_t<T>(kn@B@[t][i - DK] * inv_rms[1][t]) * scalars[1]);
    }
  }
"""

_PREPARE = _CONV + _GATE + _NORMS + _SCALE + "  @SYNC@\n"

_ROW = r"""
    const float g = gate@B@[t];
    float kv = 0.0f;
#pragma unroll
    for (int j = 0; j < DK / 16; ++j) {
      const float4 k4 = *reinterpret_cast<const float4*>(&kn@B@[t][16 * j + 4 * part]);
      const float kk[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[4 * j + e] = __fmul_rn(s[4 * j + e], g);
        kv = __fmaf_rn(s[4 * j + e], kk[e], kv);
      }
    }
    kv = __fadd_rn(kv, __shfl_xor_sync(0xffffffffu, kv, 1));
    kv = __fadd_rn(kv, __shfl_xor_sync(0xffffffffu, kv, 2));
    const float delta = __fmul_rn(__fsub_rn(vv@B@[t][row], kv), beta@B@[t]);
    float out = 0.0f;
#pragma unroll
    for (int j = 0; j < DK / 16; ++j) {
      const float4 k4 = *reinterpret_cast<const float4*>(&kn@B@[t][16 * j + 4 * part]);
      const float4 q4 = *reinterpret_cast<const float4*>(&qn@B@[t][16 * j + 4 * part]);
      const float kk[4] = {k4.x, k4.y, k4.z, k4.w};
      const float qq[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[4 * j + e] = __fmaf_rn(kk[e], delta, s[4 * j + e]);
        out = __fmaf_rn(s[4 * j + e], qq[e], out);
      }
    }
    out = __fadd_rn(out, __shfl_xor_sync(0xffffffffu, out, 1));
    out = __fadd_rn(out, __shfl_xor_sync(0xffffffffu, out, 2));
    if (part == 0) {
      y[((static_cast<int64_t>(bi) * @ROWS@ + @R0@ + t) * HV + hv) * DV + dv] = from_float<T>(out);
    }
"""


def _fill(text: str, r0: str, n: str, rows: str, tile: str, buffer: str = "", *, tid: str = "tid",
          stride: str = "blockDim.x", warp: str = "warp", warps: str = "blockDim.x / 32",
          sync: str = "__syncthreads();") -> str:
    if r0 == "0":
        text = text.replace("@R0@ + ", "")
    for name, value in (("R0", r0), ("N", n), ("ROWS", rows), ("TILE", tile), ("B", buffer), ("TID", tid),
                        ("STRIDE", stride), ("WARPS", warps), ("WARP", warp), ("SYNC", sync)):
        text = text.replace(f"@{name}@", value)
    return text


# The step: MLX writes the signature: window [B, TAPS - 1, C], qkv [B, ROWS, C], conv_w [C, TAPS, 1], a and b
# [B, ROWS, HV], a_log and dt_bias [HV], state [B, HV, DV, DK] float32, scalars [3] float32 (q's scale, k's scale,
# the norms' eps), then y [B, ROWS, HV, DV] and states [ROWS, B, HV, DV, DK] float32.
SOURCE = _fill(_PRELUDE + _PREPARE + r"""
  // The recurrence, row after row.
  for (int t = 0; t < ROWS; ++t) {""" + _ROW + r"""    float* state_out = states + (((static_cast<int64_t>(t) * batch + bi) * HV + hv) * DV + dv) * DK;
#pragma unroll
    for (int j = 0; j < DK / 16; ++j) {
      *reinterpret_cast<float4*>(state_out + 16 * j + 4 * part) =
          make_float4(s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3]);
    }
  }
""", "0", "ROWS", "ROWS", "ROWS")

# The prompt: the same inputs, qkv [B, rows, C] and a, b [B, rows, HV] of any rows (read from qkv's shape), then y
# [B, rows, HV, DV] and the state after the last row [B, HV, DV, DK] float32. ``TILE_ROWS`` rows are prepared at a
# time (their conv, norms, gate and beta in shared memory), then stepped; the state stays in registers throughout.
PROMPT_SOURCE = _fill(_PRELUDE, "", "", "", "TILE_ROWS") + r"""
  const int rows = qkv_shape[1];
  for (int t0 = 0; t0 < rows; t0 += TILE_ROWS) {
    const int n = min(TILE_ROWS, rows - t0);
""" + _fill(_PREPARE, "t0", "n", "rows", "TILE_ROWS") + r"""
    for (int t = 0; t < n; ++t) {""" + _fill(_ROW, "t0", "n", "rows", "TILE_ROWS") + r"""    }
    __syncthreads();  // every lane done with this tile's rows before the next tile overwrites them
  }
  float* state_out = state_after + ((static_cast<int64_t>(bi) * HV + hv) * DV + dv) * DK;
#pragma unroll
  for (int j = 0; j < DK / 16; ++j) {
    *reinterpret_cast<float4*>(state_out + 16 * j + 4 * part) =
        make_float4(s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3]);
  }
"""


# The prompt kernel, second form (``PROMPT_VARIANT`` 2, the default: the faster in a whole 9B prefill on an H200 at
# 1,024-32,768 tokens, ``models.layers.PROMPT_KERNEL_MAX_ROWS``): the same rows, bit for bit, with
# the preparation of the next tile overlapped with the rows of this one. The first form is latency-bound at ~1.6 us a
# row a layer on an H200 (9B): one block of 4 warps per SM, each tile's conv (every row's window read from global
# memory four times), norms and gate prepared between barriers before its rows step. Here a block has 4 stepping
# warps (the state's lanes, as before) and ``PREP_THREADS`` preparing ones: they copy the next tile's raw rows
# ([window; qkv], once each) into shared memory, convolve them from there, normalize and gate them into the other
# half of double-buffered arrays (their own barriers: ``bar.sync 1``), while the steppers run this tile's rows;
# one block-wide barrier a tile swaps the halves. Each row's arithmetic is the step kernel's (the same pieces, the
# same order of sums); ``check_prompt`` confirms it on the device.
PREP_THREADS = 256

PROMPT2_SOURCE = _INDICES + r"""  constexpr int STEPPERS = 128;  // (warps 0-3: the state's lanes, as in the step; the rest prepare)
  const int rows = qkv_shape[1];
  const bool stepper = tid < STEPPERS;
  const int ptid = tid - STEPPERS;  // a preparing thread's index

  __shared__ __align__(16) float qn[2][TILE_ROWS][DK];
  __shared__ __align__(16) float kn[2][TILE_ROWS][DK];
  __shared__ float vv[2][TILE_ROWS][32];
  __shared__ float gate[2][TILE_ROWS];
  __shared__ float beta[2][TILE_ROWS];
  __shared__ float inv_rms[2][TILE_ROWS];
  __shared__ unsigned short raw[TILE_ROWS + TAPS - 1][CH];  // the tile's rows of [window; qkv], as they are

  // Tile `k`'s rows into half `h`, by the preparing threads only (their own barrier: bar.sync 1).
  auto prepare = [&](int k, int h) {
    const int t0 = k * TILE_ROWS;
    const int n = min(TILE_ROWS, rows - t0);
    for (int idx = ptid; idx < (n + TAPS - 1) * CH; idx += PREP_THREADS) {
      const int rl = idx / CH;
      const int i = idx % CH;
      const int c = i < DK ? hk * DK + i : i < 2 * DK ? KEY_DIM + hk * DK + (i - DK) : 2 * KEY_DIM + hv * DV + tile * 32 + (i - 2 * DK);
      const int r = t0 + rl;  // row r of [window; rows]
      const T x = r < TAPS - 1 ? window[(static_cast<int64_t>(bi) * (TAPS - 1) + r) * C + c]
                               : qkv[(static_cast<int64_t>(bi) * rows + r - (TAPS - 1)) * C + c];
      raw[rl][i] = *reinterpret_cast<const unsigned short*>(&x);
    }
    asm volatile("bar.sync 1, %0;" :: "r"(PREP_THREADS) : "memory");
    for (int idx = ptid; idx < n * CH; idx += PREP_THREADS) {
      const int t = idx / CH;
      const int i = idx % CH;
      const int c = i < DK ? hk * DK + i : i < 2 * DK ? KEY_DIM + hk * DK + (i - DK) : 2 * KEY_DIM + hv * DV + tile * 32 + (i - 2 * DK);
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < TAPS; ++j) {
        const float x = to_float(*reinterpret_cast<const T*>(&raw[t + j][i]));
        acc = __fmaf_rn(x, to_float(conv_w[c * TAPS + j]), acc);
      }
      const float conv = in_t<T>(acc);
      const float act = in_t<T>(conv * in_t<T>(1.0f / (1.0f + expf(-conv))));  // silu: x * sigmoid(x)
      if (i < DK) {
        qn[h][t][i] = act;
      } else if (i < 2 * DK) {
        kn[h][t][i - DK] = act;
      } else {
        vv[h][t][i - 2 * DK] = act;
      }
    }
""" + _fill(_GATE + _NORMS + _SCALE, "t0", "n", "rows", "TILE_ROWS", "[h]", tid="ptid", stride="PREP_THREADS",
            warp="(ptid >> 5)", warps="PREP_THREADS / 32",
            sync='asm volatile("bar.sync 1, %0;" :: "r"(PREP_THREADS) : "memory");') + r"""  };

  float s[PER_LANE];
  if (stepper) {
    const float* state_row = state + ((static_cast<int64_t>(bi) * HV + hv) * DV + dv) * DK;
#pragma unroll
    for (int j = 0; j < DK / 16; ++j) {
      const float4 v = *reinterpret_cast<const float4*>(state_row + 16 * j + 4 * part);
      s[4 * j] = v.x; s[4 * j + 1] = v.y; s[4 * j + 2] = v.z; s[4 * j + 3] = v.w;
    }
  } else {
    prepare(0, 0);
  }
  __syncthreads();
  const int count = (rows + TILE_ROWS - 1) / TILE_ROWS;
  for (int k = 0; k < count; ++k) {
    const int b = k & 1;
    if (stepper) {
      const int t0 = k * TILE_ROWS;
      const int n = min(TILE_ROWS, rows - t0);
      for (int t = 0; t < n; ++t) {""" + _fill(_ROW, "t0", "n", "rows", "TILE_ROWS", "[b]") + r"""      }
    } else if (k + 1 < count) {
      prepare(k + 1, b ^ 1);
    }
    __syncthreads();  // this tile's rows stepped, the next one's prepared: the halves swap
  }
  if (stepper) {
    float* state_out = state_after + ((static_cast<int64_t>(bi) * HV + hv) * DV + dv) * DK;
#pragma unroll
    for (int j = 0; j < DK / 16; ++j) {
      *reinterpret_cast<float4*>(state_out + 16 * j + 4 * part) =
          make_float4(s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3]);
    }
  }
"""


INPUTS = ["window", "qkv", "conv_w", "a", "b", "a_log", "dt_bias", "state", "scalars"]


def _gdn_kernel(name: str, source: str, outputs: list[str]) -> CudaKernel:
    return CudaKernel(name=name, input_names=INPUTS, output_names=outputs, source=source, header=HEADER,
                      ensure_row_contiguous=True)


@functools.cache
def _kernel() -> Any:
    return _gdn_kernel("exo_gdn_rows", SOURCE, ["y", "states"])


@functools.cache
def _prompt_kernel() -> Any:
    return _gdn_kernel("exo_gdn_prompt", PROMPT_SOURCE, ["y", "state_after"])


@functools.cache
def _prompt2_kernel() -> Any:
    return _gdn_kernel("exo_gdn_prompt2", PROMPT2_SOURCE, ["y", "state_after"])


# Which form of the prompt kernel ``gdn_prompt`` launches: 2 (``PROMPT2_SOURCE``, the default) or 1; the loader's
# ``check_prompt`` checks the one set; ``EXO_GDN_PROMPT_VARIANT`` sets it, benchmarks switch it within a process.
PROMPT_VARIANT = 1 if os.environ.get("EXO_GDN_PROMPT_VARIANT", "2").strip() == "1" else 2


def mode() -> str:
    """``EXO_GDN_KERNEL``: ``0`` the compiled row graph; ``1`` (default) this kernel on MLX CUDA where ``check``
    passes; ``force`` on MLX CUDA where its rows equal their steps, however far from mlx-lm's ops (benchmarks: what
    the kernel would give a step); ``always`` on any device (``reference`` off MLX CUDA: tests of the wiring)."""
    value = os.environ.get("EXO_GDN_KERNEL", "1").strip().lower()
    return {"0": "off", "false": "off", "off": "off", "always": "always", "force": "force"}.get(value, "cuda")


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def supported(layer: Any) -> bool:
    """Whether a GatedDeltaNet layer's shapes are ones this kernel computes."""
    dk, dv = layer.head_k_dim, layer.head_v_dim
    return (
        dk % 16 == 0 and dk <= 256 and dv % 32 == 0 and layer.num_v_heads % layer.num_k_heads == 0
        and 2 <= layer.conv_kernel_size <= 8 and "bias" not in layer.conv1d
        and layer.conv1d.weight.dtype in DTYPES
    )


def _scalars(layer: Any, dtype: mx.Dtype) -> mx.array:
    """q's and k's scales as mlx-lm's ``normalize_qk`` applies them (Python floats times arrays of ``dtype``:
    rounded to it) and its eps for ``rms_norm``. Computed once per head size and dtype (every step of every layer
    passes them: built anew, they were two more primitives a layer a step)."""
    return _scalars_for(layer.head_k_dim, dtype)


@functools.cache
def _scalars_for(head_k_dim: int, dtype: mx.Dtype) -> mx.array:
    inv_scale = head_k_dim**-0.5
    scales = mx.array([inv_scale**2, inv_scale], dtype=dtype).astype(mx.float32)
    out = mx.concatenate([scales, mx.array([1e-6 * inv_scale**2], dtype=mx.float32)])
    mx.eval(out)
    return out


def gdn_rows(layer: Any, window: mx.array, qkv: mx.array, a: mx.array, b: mx.array,
             state: mx.array) -> tuple[mx.array, mx.array]:
    """The layer's recurrence over ``qkv`` [B, T, C]'s rows after ``window`` [B, taps - 1, C] and ``state``
    [B, Hv, Dv, Dk]: (y [B, T, Hv, Dv] before the gated norm, the state after each row [T, B, Hv, Dv, Dk]).
    On MLX CUDA one launch of the kernel; elsewhere ``reference``."""
    if not on_cuda():
        return reference(layer, window, qkv, a, b, state)
    B, T, _ = qkv.shape
    hv, dv, dk = layer.num_v_heads, layer.head_v_dim, layer.head_k_dim
    inputs = [window, qkv, layer.conv1d.weight, a, b, layer.A_log, layer.dt_bias, state, _scalars(layer, qkv.dtype)]
    bound = _rows_launch(tuple(x.dtype for x in inputs), B, T, layer.conv_kernel_size, layer.num_k_heads, hv, dk, dv)
    y, states = bound(inputs, [(B, T, hv, dv), (T, B, hv, dv, dk)])
    return y, states


@functools.cache
def _rows_launch(dtypes: tuple[mx.Dtype, ...], batch: int, rows: int, taps: int, hk: int, hv: int, dk: int,
                 dv: int) -> Any:
    """``gdn_rows``'s launch for these inputs' types and shapes, bound once (``CudaKernel.bind``; every layer of
    every decode step makes one)."""
    dtype = dtypes[1]
    promote = mx.result_type(dtypes[3], dtypes[6]) == mx.float32  # (a + dt_bias in mlx-lm's graph)
    return _kernel().bind(
        [("T", dtype), ("ROWS", rows), ("TAPS", taps), ("HK", hk), ("HV", hv), ("DK", dk), ("DV", dv),
         ("PROMOTE_F32", promote)],
        list(dtypes), [3, 3, 3, 3, 3, 1, 1, 4, 1], [dtype, mx.float32], (THREADS * batch * hv * (dv // TILE), 1, 1),
        (THREADS, 1, 1))


def tile_rows(head_k_dim: int, variant: int = 1) -> int:
    """The prompt kernel's rows prepared at a time: q and k of ``TILE_ROWS`` rows in float32 fit the 48 KB of a
    block's static shared memory (32 rows at the 9B's head dim 128; the second form holds two tiles and the raw
    rows of one: 16)."""
    if variant == 2:
        return max(8, min(16, 2048 // head_k_dim))
    return max(8, min(32, 4096 // head_k_dim))


def gdn_prompt(layer: Any, window: mx.array, qkv: mx.array, a: mx.array, b: mx.array,
               state: mx.array) -> tuple[mx.array, mx.array]:
    """The layer's recurrence over any number of rows of ``qkv`` [B, T, C] (a prompt's chunk), as ``gdn_rows``
    computes each of them: (y [B, T, Hv, Dv] before the gated norm, the state after the last row [B, Hv, Dv, Dk]).
    Every row is what the decode step that came to it would compute, bit for bit (``check_prompt``). On MLX CUDA
    one launch; elsewhere ``reference``'s rows."""
    if not on_cuda():
        y, states = reference(layer, window, qkv, a, b, state)
        return y, states[-1]
    B, T, _ = qkv.shape
    hv, dv, dk = layer.num_v_heads, layer.head_v_dim, layer.head_k_dim
    promote = mx.result_type(a, layer.dt_bias) == mx.float32
    variant = PROMPT_VARIANT
    kernel, threads = (_prompt2_kernel(), THREADS + PREP_THREADS) if variant == 2 else (_prompt_kernel(), THREADS)
    template = [("T", qkv.dtype), ("TILE_ROWS", tile_rows(dk, variant)), ("TAPS", layer.conv_kernel_size),
                ("HK", layer.num_k_heads), ("HV", hv), ("DK", dk), ("DV", dv), ("PROMOTE_F32", promote)]
    if variant == 2:
        template.append(("PREP_THREADS", PREP_THREADS))
    y, after = kernel(
        inputs=[window, qkv, layer.conv1d.weight, a, b, layer.A_log, layer.dt_bias, state, _scalars(layer, qkv.dtype)],
        template=template,
        grid=(threads * B * hv * (dv // TILE), 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, T, hv, dv), (B, hv, dv, dk)],
        output_dtypes=[qkv.dtype, mx.float32],
    )
    return y, after


def reference(layer: Any, window: mx.array, qkv: mx.array, a: mx.array, b: mx.array,
              state: mx.array) -> tuple[mx.array, mx.array]:
    """``gdn_rows`` by mlx-lm's ops, row after row as a decode step runs them (conv1d, silu, ``normalize_qk``,
    ``gated_delta_update``)."""
    from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

    B, T, _ = qkv.shape
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    key_dim = hk * dk
    taps = layer.conv_kernel_size
    conv_input = mx.concatenate([window, qkv], axis=1)
    ys, states = [], []
    for t in range(T):
        conv = nn.silu(mx.conv1d(conv_input[:, t : t + taps], layer.conv1d.weight, groups=conv_input.shape[-1]))
        q, k, v = mx.split(conv, [key_dim, 2 * key_dim], -1)
        q, k = normalize_qk(q.reshape(B, 1, hk, dk), k.reshape(B, 1, hk, dk), inv_scale=dk**-0.5, eps=1e-6)
        y, state = gated_delta_update(q, k, v.reshape(B, 1, hv, dv), a[:, t : t + 1], b[:, t : t + 1], layer.A_log,
                                      layer.dt_bias, state, None, use_kernel=False)
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), mx.stack(states)


Y_TOLERANCE = 2.0**-6  # of the largest |y|: a few roundings of a bfloat16 output, summed over Dk
STATE_TOLERANCE = 1e-4  # of the largest |state|: float32 sums in another order, over the probe's rows
# Or, further from mlx-lm's ops than that: no further from the step in float32 throughout than mlx-lm's own ops
# are (times STOCK_SLACK, for the probe's chance), and never beyond EXACT_CAP of it. On an H200 the 9B's layer was
# 7.5e-3 from mlx-lm's ops in its states, where mlx-lm's ops are 7.5e-3 from float32 and the kernel 4.7e-3: the two
# bfloat16 graphs round at other points; the kernel is the closer of them to the exact step.
STOCK_SLACK = 1.25
EXACT_CAP = 2.0**-5


def accepted(y_stock: float, state_stock: float, y_exact: float, state_exact: float, stock_y_exact: float,
             stock_state_exact: float) -> bool:
    """Whether the kernel's distances pass: from mlx-lm's ops (``*_stock``), within ``Y_TOLERANCE`` /
    ``STATE_TOLERANCE``; or from the step in float32 throughout (``*_exact``), no further than mlx-lm's ops are
    from it (``stock_*_exact``) times ``STOCK_SLACK`` and within ``EXACT_CAP``. All relative to the largest value."""
    if y_stock <= Y_TOLERANCE and state_stock <= STATE_TOLERANCE:
        return True
    return (y_exact <= min(EXACT_CAP, stock_y_exact * STOCK_SLACK)
            and state_exact <= min(EXACT_CAP, stock_state_exact * STOCK_SLACK))


def _random_inputs(layer: Any, rows: int, key: mx.array) -> tuple[mx.array, ...]:
    """A check's inputs for ``layer``: window, qkv (``rows`` rows), a, b in its weights' type, a float32 state."""
    dtype = layer.conv1d.weight.dtype
    conv_dim = layer.conv1d.weight.shape[0]
    k1, k2, k3, k4, k5 = mx.random.split(key, 5)
    window = (mx.random.normal((1, layer.conv_kernel_size - 1, conv_dim), key=k1) * 0.5).astype(dtype)
    qkv = (mx.random.normal((1, rows, conv_dim), key=k2) * 0.5).astype(dtype)
    a = mx.random.normal((1, rows, layer.num_v_heads), key=k3).astype(dtype)
    b = mx.random.normal((1, rows, layer.num_v_heads), key=k4).astype(dtype)
    state = mx.random.normal((1, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), key=k5) * 0.1
    return window, qkv, a, b, state


def check(layer: Any, *, rows: int = 4, key: mx.array | None = None) -> tuple[bool, str]:
    """Whether ``gdn_rows`` computes ``layer``'s step as it should on this device: on random inputs, (1) one call
    of 1..``rows`` rows gives each row the bits (y and state) of the calls of one row after another, (2) its
    distances pass ``accepted``: near ``reference`` (mlx-lm's ops), or no further than they are from the step in
    float32 throughout. A failure of the JIT counts as not passed."""
    key = mx.random.key(20261130) if key is None else key
    window, qkv, a, b, state = _random_inputs(layer, rows, key)
    try:
        y, states = gdn_rows(layer, window, qkv, a, b, state)
        steps_y, steps_state, w, s = [], [], window, state
        for t in range(rows):
            y1, s1 = gdn_rows(layer, w, qkv[:, t : t + 1], a[:, t : t + 1], b[:, t : t + 1], s)
            steps_y.append(y1)
            steps_state.append(s1[0])
            w = mx.concatenate([w, qkv[:, t : t + 1]], axis=1)[:, 1:]
            s = s1[0]
        blocks = [gdn_rows(layer, window, qkv[:, :r], a[:, :r], b[:, :r], state) for r in range(2, rows)]
        ref_y, ref_states = reference(layer, window, qkv, a, b, state)
        exact_y, exact_states = reference(_float32(layer), *(t.astype(mx.float32) for t in (window, qkv, a, b)), state)
        mx.eval(y, states, steps_y, steps_state, blocks, ref_y, ref_states, exact_y, exact_states)
    except Exception as e:  # noqa: BLE001 - any failure of the custom kernel leaves the compiled rows in place
        if precompiled_failed(e):  # once more, MLX compiling the kernel
            return check(layer, rows=rows, key=key)
        return False, f"the kernel did not run: {type(e).__name__}: {str(e)[:300]}"
    stepped_y, stepped_states = mx.concatenate(steps_y, axis=1), mx.stack(steps_state)
    same = bits_equal(y, stepped_y) and bits_equal(states, stepped_states)
    for r, (by, bs) in enumerate(blocks, start=2):
        same = same and bits_equal(by, stepped_y[:, :r]) and bits_equal(bs, stepped_states[:r])
    if not same:
        return False, "a call of several rows differs from its rows one after another"
    y_error, state_error = relative_error(y, ref_y), relative_error(states, ref_states)
    # Both against the same step in float32 throughout (no rounding to the activations' type anywhere): how far
    # each is from the exact value, so that a distance between them can be told apart from an error of the kernel
    distances = (y_error, state_error, relative_error(y, exact_y), relative_error(states, exact_states),
                 relative_error(ref_y, exact_y), relative_error(ref_states, exact_states))
    found = ("y {:.2e}, state {:.2e} from mlx-lm's ops; from float32 throughout: the kernel y {:.2e}, state {:.2e}, "
             "mlx-lm's ops y {:.2e}, state {:.2e}").format(*distances)
    if mode() == "force":
        return True, found + " (EXO_GDN_KERNEL=force: used whatever the distance)"
    return accepted(*distances), found


def check_prompt(layer: Any, *, rows: int = 75, key: mx.array | None = None) -> tuple[bool, str]:
    """Whether ``gdn_prompt`` computes ``layer``'s prompt rows as its decode steps do, bit for bit, on this device:
    random inputs of ``rows`` rows (across several of its tiles, the last one partial), one call against
    ``gdn_rows`` over the same rows in calls of ``MAX_ROWS`` (each of which ``check`` found equal to its rows one
    after another), its y and its last state; and a call cut in two pieces, the second from the first's state and
    window, equal to the whole. Run after ``check`` passed: the step's rows are the standard."""
    key = mx.random.key(20261201) if key is None else key
    window, qkv, a, b, state = _random_inputs(layer, rows, key)
    try:
        y, after = gdn_prompt(layer, window, qkv, a, b, state)
        steps_y, w, s = [], window, state
        for lo in range(0, rows, MAX_ROWS):
            hi = min(rows, lo + MAX_ROWS)
            y1, s1 = gdn_rows(layer, w, qkv[:, lo:hi], a[:, lo:hi], b[:, lo:hi], s)
            steps_y.append(y1)
            w = mx.concatenate([w, qkv[:, lo:hi]], axis=1)[:, hi - lo :]
            s = s1[-1]
        cut = rows // 3
        y_a, s_a = gdn_prompt(layer, window, qkv[:, :cut], a[:, :cut], b[:, :cut], state)
        w_a = mx.concatenate([window, qkv[:, :cut]], axis=1)[:, cut:]
        y_b, s_b = gdn_prompt(layer, w_a, qkv[:, cut:], a[:, cut:], b[:, cut:], s_a)
        mx.eval(y, after, steps_y, s, y_a, s_a, y_b, s_b)
    except Exception as e:  # noqa: BLE001 - any failure of the custom kernel leaves the chunked form in place
        if precompiled_failed(e):
            return check_prompt(layer, rows=rows, key=key)
        return False, f"the prompt kernel did not run: {type(e).__name__}: {str(e)[:300]}"
    stepped = mx.concatenate(steps_y, axis=1)
    if not (bits_equal(y, stepped) and bits_equal(after, s)):
        return False, (f"a prompt's rows differ from its steps (y {relative_error(y, stepped):.2e}, "
                       f"state {relative_error(after, s):.2e})")
    if not (bits_equal(mx.concatenate([y_a, y_b], axis=1), y) and bits_equal(s_b, after)):
        return False, "a prompt cut in two differs from the whole"
    return True, f"{rows} rows the bits of their steps"


def _float32(layer: Any) -> Any:
    """The parts of ``layer`` that ``reference`` reads, in float32."""
    from types import SimpleNamespace

    return SimpleNamespace(
        num_k_heads=layer.num_k_heads, num_v_heads=layer.num_v_heads, head_k_dim=layer.head_k_dim,
        head_v_dim=layer.head_v_dim, conv_kernel_size=layer.conv_kernel_size,
        conv1d=SimpleNamespace(weight=layer.conv1d.weight.astype(mx.float32)),
        A_log=layer.A_log.astype(mx.float32), dt_bias=layer.dt_bias.astype(mx.float32))
