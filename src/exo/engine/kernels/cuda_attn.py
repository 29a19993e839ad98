"""Decode-sized attention on MLX CUDA: 1 .. ``MAX_ROWS`` query rows of one sequence (a decode step, a verify call's
K + 1 rows) against its KV cache, each row over the keys up to itself, every row's arithmetic the same whatever the
rows beside it: a verify call's row t computes what the decode step at its position computes, by construction.

Why: Qwen3.5's head dimension of 256 has no fused attention kernel on MLX CUDA (cuDNN's SDPA takes at most 128), so
MLX runs it unfused (a query-by-keys product, a softmax, a product by the values), and a block of query rows may
round otherwise than one row: a verify call then attends row by row (``verify.probe``'s ``per_row_attention``),
~20 primitives an attention layer a row, each ~7 us of the host's evaluation on an H200 (a 9B verify call of 2 rows:
1,017 primitives against a step's 785). Here one layer's attention is two launches for all its rows.

Pass 1, a block per (row, chunk of ``CHUNK`` keys): 4 warps take the chunk's keys in turn (key j to warp j mod 4),
a lane holds D / 32 of the query's values and of the output's; a key's score is the lane's products in order,
then an xor butterfly, times the scale, all float32; each warp keeps an online softmax (running max, sum, and
the weighted values); the warps combine in order. Pass 2, a block per row: the chunks up to the row's last key
combine in order. The chunks are fixed by the key's index alone (key j in chunk j // CHUNK), so the row at
position p sees the same chunks, warps and orders in a decode step and in any verify call.

It reads the cache's buffer (``KVCache.keys`` / ``values``, [B, Hkv, capacity, D]) in place: no copy of the keys a
step. Not stock mlx-lm's op: its scores and softmax are float32 throughout (``check`` measures both against a
float32 reference). On by default on MLX CUDA where ``check`` passes (``EXO_ATTN_KERNEL=0``: MLX's attention): on
an H200 at 9B (2026-11-29, ``bench/results/h200-mlx-cuda-kernel-cache-rounds-attention-9b-2026-11-29.txt``) a
one-row step evaluated in 6.7 against 7.8 ms, a K = 3 round cost 1.32 plain steps against 1.69-1.97, greedy MTP
stayed plain decoding's. ``always``: ``reference`` in its place on any device (the CPU tests of the wiring).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import mlx.core as mx

from . import bits_equal, cuda_conversions, relative_error
from .cuda_build import CudaKernel, precompiled_failed

MAX_ROWS = 8
CHUNK = 256  # keys per block of pass 1
WARPS = 4
DTYPES = (mx.bfloat16, mx.float16)

HEADER = cuda_conversions("exo_attn") + r"""
__device__ __forceinline__ float neg_inf() { return __int_as_float(static_cast<int>(0xff800000u)); }
}  // namespace exo_attn
"""

# Inputs: q [B, HQ, T, D] (T rows), keys and values [B, HKV, capacity, D] (the cache's buffers), meta int32
# [before, T, chunks] (row t sees keys 0 .. before + t), scale float32 [1]. Outputs: m, l [B * HQ * T, chunks],
# acc [B * HQ * T, chunks, D] float32: each chunk's running max, sum and weighted values.
PASS1 = r"""
  using namespace exo_attn;
  constexpr int PER = D / 32;
  const int before = meta[0];
  const int rows = meta[1];
  const int chunks = meta[2];
  const int capacity = keys_shape[2];
  const int chunk = blockIdx.x % chunks;
  const int r = blockIdx.x / chunks;
  const int t = r % rows;
  const int hq = (r / rows) % HQ;
  const int b = r / (rows * HQ);
  const int hk = hq / (HQ / HKV);
  const int n = before + t + 1;
  const int start = chunk * CHUNK;
  const int end = min(start + CHUNK, n);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const float sc = scale[0];

  float qv[PER];
  const T* qrow = q + ((static_cast<int64_t>(b) * HQ + hq) * rows + t) * D + lane * PER;
#pragma unroll
  for (int i = 0; i < PER; ++i) qv[i] = to_float(qrow[i]);
  float m = neg_inf();
  float l = 0.0f;
  float acc[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) acc[i] = 0.0f;
  const int64_t head = (static_cast<int64_t>(b) * HKV + hk) * capacity * D;
  for (int j = start + warp; j < end; j += WARPS_) {
    const T* kr = keys + head + static_cast<int64_t>(j) * D + lane * PER;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) s = __fmaf_rn(qv[i], to_float(kr[i]), s);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
    s = __fmul_rn(s, sc);
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new);
    const float p = expf(s - m_new);
    l = __fmaf_rn(l, corr, p);
    const T* vr = values + head + static_cast<int64_t>(j) * D + lane * PER;
#pragma unroll
    for (int i = 0; i < PER; ++i) acc[i] = __fmaf_rn(p, to_float(vr[i]), __fmul_rn(acc[i], corr));
    m = m_new;
  }
  __shared__ float wm[WARPS_];
  __shared__ float wl[WARPS_];
  __shared__ float wacc[WARPS_][D];
  if (lane == 0) {
    wm[warp] = m;
    wl[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < PER; ++i) wacc[warp][lane * PER + i] = acc[i];
  __syncthreads();
  const int64_t at = static_cast<int64_t>(r) * chunks + chunk;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float mm = neg_inf();
#pragma unroll
    for (int w = 0; w < WARPS_; ++w) mm = fmaxf(mm, wm[w]);
    float ll = 0.0f;
    float aa = 0.0f;
    if (mm != neg_inf()) {  // (a chunk no warp had a key of: nothing)
#pragma unroll
      for (int w = 0; w < WARPS_; ++w) {
        const float f = expf(wm[w] - mm);
        ll = __fmaf_rn(wl[w], f, ll);
        aa = __fmaf_rn(wacc[w][d], f, aa);
      }
    }
    acc_out[at * D + d] = aa;
    if (d == 0) {
      m_out[at] = mm;
      l_out[at] = ll;
    }
  }
"""

# Inputs: m, l, acc of pass 1, meta as pass 1's. Output: out [B, HQ, T, D] in the queries' type.
PASS2 = r"""
  using namespace exo_attn;
  const int before = meta[0];
  const int rows = meta[1];
  const int chunks = meta[2];
  const int r = blockIdx.x;
  const int t = r % rows;
  const int used = (before + t + 1 + CHUNK - 1) / CHUNK;
  const int64_t base = static_cast<int64_t>(r) * chunks;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float mm = neg_inf();
    for (int c = 0; c < used; ++c) mm = fmaxf(mm, m[base + c]);
    float ll = 0.0f;
    float aa = 0.0f;
    for (int c = 0; c < used; ++c) {
      const float f = expf(m[base + c] - mm);
      ll = __fmaf_rn(l[base + c], f, ll);
      aa = __fmaf_rn(acc[(base + c) * D + d], f, aa);
    }
    out[static_cast<int64_t>(r) * D + d] = from_float<T>(aa / ll);
  }
"""


@functools.cache
def _kernels() -> tuple[Any, Any]:
    first = CudaKernel(name="exo_attn_chunks", input_names=["q", "keys", "values", "meta", "scale"],
                                output_names=["m_out", "l_out", "acc_out"], source=PASS1, header=HEADER,
                                ensure_row_contiguous=True)
    second = CudaKernel(name="exo_attn_rows", input_names=["m", "l", "acc", "meta"], output_names=["out"],
                                 source=PASS2, header=HEADER, ensure_row_contiguous=True)
    return first, second


def mode() -> str:
    """``EXO_ATTN_KERNEL``: ``1`` (default) this kernel on MLX CUDA where ``check`` passes; ``0`` MLX's attention;
    ``always`` ``reference`` in its place on any device (tests of the wiring)."""
    value = os.environ.get("EXO_ATTN_KERNEL", "1").strip().lower()
    return {"1": "cuda", "true": "cuda", "on": "cuda", "always": "always"}.get(value, "off")


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def supported(layer: Any) -> bool:
    """Whether an attention layer's shapes are ones this computes."""
    dim = layer.head_dim  # a lane holds D / 32 values; pass 2 is a thread per value
    return dim % 32 == 0 and 32 <= dim <= 256 and layer.num_attention_heads % layer.num_key_value_heads == 0


def buffers(cache: Any) -> tuple[mx.array, mx.array, int] | None:
    """A solo KV cache's key and value buffers [1, Hkv, capacity, D] and how many keys they hold, or None where
    the cache is not one this reads (a batch's, a quantized one, a rotating window)."""
    from mlx_lm.models.cache import KVCache

    if type(cache) is not KVCache or cache.keys is None:
        return None
    return cache.keys, cache.values, cache.offset


def attend_rows(queries: mx.array, keys: mx.array, values: mx.array, count: int, scale: float,
                position: mx.array | None = None) -> mx.array:
    """Attention of ``queries`` [B, Hq, T, D] (T <= MAX_ROWS, the last T of ``count`` positions) over the buffers
    ``keys`` / ``values`` [B, Hkv, capacity, D], whose first ``count`` positions are filled: row t over keys
    0 .. count - T + t. [B, Hq, T, D] in the queries' type. On MLX CUDA the kernel; elsewhere ``reference``.

    ``position`` (MLX CUDA only): the first row's position as a device array (``models.positions``: a chained
    round), ``count`` then only an upper bound of the keys filled; row t attends to keys 0 .. position + t, in the
    same chunks as with a Python position (the chunks past its last key hold none)."""
    B, hq, T, D = queries.shape
    if position is None and not on_cuda():
        return reference(queries, keys[:, :, :count], values[:, :, :count], scale)
    assert on_cuda(), "a device position takes the kernel (elsewhere: models.positions.row_mask)"
    chunks = -(-count // CHUNK)
    if position is None:
        meta = mx.array([count - T, T, chunks], dtype=mx.int32)
    else:  # (one meta for every layer of a call at this position)
        from ..models.positions import derived

        meta = derived(position, ("attn-meta", T, chunks), lambda p: mx.concatenate(
            [p.astype(mx.int32).reshape(1), mx.array([T, chunks], dtype=mx.int32)]))
    first, second = _kernels()
    template = [("T", queries.dtype), ("D", D), ("HQ", hq), ("HKV", keys.shape[1]), ("CHUNK", CHUNK),
                ("WARPS_", WARPS)]
    rows = B * hq * T
    maxima, sums, acc = first(inputs=[queries, keys, values, meta, mx.array([scale], dtype=mx.float32)], template=template,
                      grid=(32 * WARPS * rows * chunks, 1, 1), threadgroup=(32 * WARPS, 1, 1),
                      output_shapes=[(rows, chunks), (rows, chunks), (rows, chunks, D)],
                      output_dtypes=[mx.float32, mx.float32, mx.float32])
    return second(inputs=[maxima, sums, acc, meta], template=[("T", queries.dtype), ("D", D), ("CHUNK", CHUNK)],
                  grid=(D * rows, 1, 1), threadgroup=(D, 1, 1),
                  output_shapes=[(B, hq, T, D)], output_dtypes=[queries.dtype])[0]


def reference(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """``attend_rows`` by mlx-lm's attention, a row at a time over the keys up to itself (as a decode step at its
    position attends): keys [B, Hkv, count, D]."""
    from mlx_lm.models.base import scaled_dot_product_attention

    T = queries.shape[2]
    before = keys.shape[2] - T
    rows = [scaled_dot_product_attention(queries[:, :, t : t + 1], keys[:, :, : before + t + 1],
                                         values[:, :, : before + t + 1], cache=None, scale=scale, mask=None)
            for t in range(T)]
    return rows[0] if T == 1 else mx.concatenate(rows, axis=2)


def exact(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """The same in float32 throughout (scores, softmax, values), GQA heads repeated: what ``check`` measures
    both against."""
    B, hq, T, D = queries.shape
    group = hq // keys.shape[1]
    k = mx.repeat(keys.astype(mx.float32), group, axis=1)
    v = mx.repeat(values.astype(mx.float32), group, axis=1)
    before = keys.shape[2] - T
    rows = []
    for t in range(T):
        n = before + t + 1
        s = (queries[:, :, t : t + 1].astype(mx.float32) @ k[:, :, :n].swapaxes(-1, -2)) * scale
        rows.append(mx.softmax(s, axis=-1) @ v[:, :, :n])
    return mx.concatenate(rows, axis=2)


TOLERANCE = 2.0**-7  # of the largest |output|: a bfloat16 output's rounding and float32 sums in another order
STOCK_SLACK = 1.25  # or no further from float32 than mlx-lm's attention is (its bfloat16 scores), times this
EXACT_CAP = 2.0**-5
CHECK_KEYS = 300  # keys before the probe's rows: past one chunk


def check(layer: Any, *, rows: int = 4, key: mx.array | None = None) -> tuple[bool, str]:
    """Whether ``attend_rows`` computes ``layer``'s attention as it should on this device, on random inputs: (1) a
    call of 1..``rows`` rows gives each row the bits of a one-row call at its position, (2) it is within
    ``TOLERANCE`` of ``exact``, or no further from it than mlx-lm's attention is (times ``STOCK_SLACK``, under
    ``EXACT_CAP``). A failure of
    the JIT counts as not passed."""
    key = mx.random.key(20261201) if key is None else key
    hq, hkv, D = layer.num_attention_heads, layer.num_key_value_heads, layer.head_dim
    dtype = layer.o_proj.scales.dtype if hasattr(layer.o_proj, "scales") else layer.o_proj.weight.dtype
    if dtype not in DTYPES:
        return False, f"activations in {dtype}"
    k1, k2, k3 = mx.random.split(key, 3)
    capacity = CHECK_KEYS + 2 * MAX_ROWS
    keys = mx.random.normal((1, hkv, capacity, D), key=k1).astype(dtype)
    values = mx.random.normal((1, hkv, capacity, D), key=k2).astype(dtype)
    queries = mx.random.normal((1, hq, rows, D), key=k3).astype(dtype)
    count = CHECK_KEYS + rows
    scale = layer.scale
    try:
        together = attend_rows(queries, keys, values, count, scale)
        alone = [attend_rows(queries[:, :, t : t + 1], keys, values, count - rows + t + 1, scale) for t in range(rows)]
        blocks = [attend_rows(queries[:, :, :r], keys, values, count - rows + r, scale) for r in range(2, rows)]
        want = exact(queries, keys[:, :, :count], values[:, :, :count], scale)
        stock = reference(queries, keys[:, :, :count], values[:, :, :count], scale)
        mx.eval(together, alone, blocks, want, stock)
    except Exception as e:  # noqa: BLE001 - any failure of the custom kernel leaves MLX's attention in place
        if precompiled_failed(e):  # once more, MLX compiling the kernel
            return check(layer, rows=rows, key=key)
        return False, f"the kernel did not run: {type(e).__name__}: {str(e)[:300]}"
    stepped = mx.concatenate(alone, axis=2)
    same = bits_equal(together, stepped) and all(bits_equal(b, stepped[:, :, : b.shape[2]]) for b in blocks)
    if not same:
        return False, "a call of several rows differs from its rows one at a time"
    error, stock_error = relative_error(together, want), relative_error(stock, want)
    found = f"{error:.2e} from float32 throughout (mlx-lm's attention {stock_error:.2e})"
    return error <= max(TOLERANCE, min(EXACT_CAP, stock_error * STOCK_SLACK)), found
