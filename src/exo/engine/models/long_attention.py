"""A prompt chunk's attention over a long context as an online softmax over key blocks (``EXO_LONG_ATTENTION``, off by
default: on an H200 it lost to MLX's call, the 9B's 32k prefill 12,930 tok/s against 15,739; docs/performance.md).

Qwen3.5's attention head dimension is 256. MLX 0.32 CUDA has no fused attention for it beyond one query row
(``sdpa_vector``), so a prompt chunk's ``mx.fast.scaled_dot_product_attention`` falls back to MLX's unfused graph: the
scores of every new row against every cached key written out at once, a softmax over them, a product by the values.
On an H200 a cached agent turn's new tokens took 1.4-1.6x as long over a 16-23k-token prefix as alone
(``bench/cached_turn.py``), and a 32k prompt's prefill slowed with its length (docs/performance.md). Here the keys
go in blocks of ``block``: each block's scores, row maxima and sums in float32, its product by the values in the
inputs' type, the blocks combined by their maxima; only the blocks that reach the new rows take the causal mask.
``bench/long_attention.py`` times it against MLX's call and measures both against float32.

Where it applies (``applies``): a solo prompt chunk (one sequence, more than one row, mlx-lm's ``"causal"`` mask) whose
keys, cached and new, number ``min_keys`` or more. Decode steps, verify calls, a batch's calls (their masks are
arrays) and short prompts keep MLX's call. A row's keys go in blocks fixed by their positions, and the blocks past a
row add exact zeros to it, so where the products round a row alike whatever rows share the call (this CPU), a prompt
prefilled in other chunks, or a cached turn's new tokens, compute what the cold prefill computes wherever both calls
take this path (the threshold is a chunk's: a chunk on the other side of it takes MLX's call).

``EXO_LONG_ATTENTION``: ``off`` (default), ``on`` (MLX CUDA: from ``MIN_KEYS`` keys, blocks of ``BLOCK``),
``on:KEYS:BLOCK`` (any device: the CPU tests).
"""

from __future__ import annotations

import os

import mlx.core as mx

MIN_KEYS = 8192
BLOCK = 4096


def setting() -> tuple[str, int, int]:
    """``EXO_LONG_ATTENTION`` -> (where, min keys, block): ("off", 0, 0) by default."""
    value = os.environ.get("EXO_LONG_ATTENTION", "off").strip().lower()
    if value in ("off", "0", ""):
        return "off", 0, 0
    if value in ("on", "1"):
        return "cuda", MIN_KEYS, BLOCK
    parts = value.split(":")
    if len(parts) == 3 and parts[0] == "on" and all(p.isdigit() and int(p) > 0 for p in parts[1:]):
        return "always", int(parts[1]), int(parts[2])
    raise ValueError(f"EXO_LONG_ATTENTION must be off, on or on:<keys>:<block>, not {value!r}")


def configured() -> tuple[int, int] | None:
    """(min keys, block) where the setting applies on this process's device, else None."""
    where, keys, block = setting()
    if where == "off" or (where == "cuda" and not (mx.default_device() == mx.gpu and mx.cuda.is_available())):
        return None
    return keys, block


def applies(queries: mx.array, keys: mx.array, mask: object, min_keys: int) -> bool:
    """A solo prompt chunk under mlx-lm's causal mask whose keys reach ``min_keys``."""
    return (isinstance(mask, str) and mask == "causal" and isinstance(keys, mx.array)  # (not a quantized cache's)
            and queries.shape[0] == 1 and queries.shape[2] > 1
            and keys.shape[2] >= min_keys and keys.shape[2] >= queries.shape[2])


def causal_mask(rows: int, context: int, lo: int, hi: int) -> mx.array:
    """Row i (at position context + i) sees keys lo .. hi - 1 up to its own position: [1, 1, 1, rows, hi - lo]."""
    return (mx.arange(context, context + rows)[:, None] >= mx.arange(lo, hi)[None]).reshape(1, 1, 1, rows, hi - lo)


def blocked_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, block: int,
                      fold: bool = True) -> mx.array:
    """``mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask="causal")`` (the new rows the
    last of the keys) as an online softmax over key blocks of ``block``: [B, Hq, R, D] in the queries' type.

    ``fold``: the query heads that share a KV head go as rows of one product per KV head ([B, Hkv, G * R, D] against
    the block's [B, Hkv, D, N]: a plain batched GEMM); else as a group axis against the keys broadcast over it
    ([B, Hkv, G, R, D] against [B, Hkv, 1, D, N], as MLX's own fallback does). Each (row, key) pair's dot product and
    each row's sums are the same either way; ``bench/long_attention.py`` times both."""
    b, heads, rows, dim = queries.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    total = keys.shape[2]
    context = total - rows
    if fold:
        qs = (queries * scale).reshape(b, kv_heads, groups * rows, dim)
        blocks = keys.swapaxes(-1, -2)
        vals = values
    else:
        qs = (queries * scale).reshape(b, kv_heads, groups, rows, dim)
        blocks = keys[:, :, None].swapaxes(-1, -2)
        vals = values[:, :, None]
    top = weight = acc = None
    for lo in range(0, total, block):
        hi = min(lo + block, total)
        scores = (qs @ blocks[..., lo:hi]).astype(mx.float32)
        if hi > context:
            mask = causal_mask(rows, context, lo, hi)  # [1, 1, 1, R, N]
            if fold:
                mask = mx.tile(mask.reshape(1, 1, rows, hi - lo), (1, 1, groups, 1))  # row g * R + i: row i's
            scores = mx.where(mask, scores, -mx.inf)
        new_top = scores.max(axis=-1, keepdims=True) if top is None else mx.maximum(top, scores.max(axis=-1, keepdims=True))
        p = mx.exp(scores - new_top)
        part = (p.astype(queries.dtype) @ vals[..., lo:hi, :]).astype(mx.float32)
        if top is None:
            weight, acc = p.sum(axis=-1, keepdims=True), part
        else:
            fix = mx.exp(top - new_top)
            weight = weight * fix + p.sum(axis=-1, keepdims=True)
            acc = acc * fix + part
        top = new_top
    return (acc / weight).astype(queries.dtype).reshape(b, heads, rows, dim)
