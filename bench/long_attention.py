"""A prompt chunk's attention over a long context, by method: what a cached agent turn and a long prompt's later
chunks pay on a GPU (issue 49).

    python bench/long_attention.py [--rows 554 2048] [--context 18697 30720] [--heads 16] [--kv-heads 4]
                                   [--head-dim 256] [--blocks 4096 8192] [--repeats 5]

A chunk of R new rows attends to C cached keys and to its own rows causally. Qwen3.5's head dimension of 256 has no
fused attention kernel on MLX CUDA for more than one query row (MLX 0.32's ``sdpa_vector`` takes one; the rest falls
back to MLX's unfused graph: the scores of every row against every key written out, a softmax, a product by the
values). On an H200 a cached turn's new tokens took 1.4-1.6x as long over a 16-23k-token prefix as alone
(``bench/cached_turn.py``: `alone` against `prefill0`), with the attention the likeliest share. For each (R, C) this
times, on random bfloat16 inputs of the model's head counts:

- ``mlx``: ``mx.fast.scaled_dot_product_attention`` with ``mask="causal"``, what the engine's attention layers call;
- ``blocked-N``: the engine's ``EXO_LONG_ATTENTION`` path (``engine/models/long_attention.py``) with blocks of N: each
  block's scores, row maxima and sums in float32 and its product by the values in bfloat16, the blocks combined by
  their maxima (an online softmax in MLX ops); only the blocks that reach the new rows take the causal mask;
- ``split``: the cached keys in one unmasked block, the new rows' own keys in a causal one, the two combined (the
  same rule with two blocks);
- ``folded`` / ``folded-N``: the same rule (one block of every key / blocks of N) with the query heads that share a
  KV head folded into rows of one product ([Hkv, G x R, D] against [Hkv, D, N]: a plain batched GEMM), where
  ``blocked-N`` takes them as a group axis against the keys broadcast over it (as MLX's fallback does);
- ``mlx-mask``: MLX's call with the causal mask as a boolean array;

and each one's distance from a float32 computation of the same attention (the largest difference over the largest
output), so a faster method is also seen to be as exact as MLX's. The times are of one layer's call (median of
``--repeats``, each a chain of calls evaluated at once); a model has 8 such layers (the 9B) or 16 (the 27B).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from common import add_common_arguments, report_to, use_device  # bench/ is this script's folder

from exo.engine.models.long_attention import blocked_attention, causal_mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5, model=False)
    parser.add_argument("--rows", type=int, nargs="+", default=[554, 2048], help="new rows of the chunk")
    parser.add_argument("--context", type=int, nargs="+", default=[18697, 30720], help="keys cached before them")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, nargs="+", default=[4096, 8192], help="key blocks of blocked-N")
    parser.add_argument("--calls", type=int, default=4, help="calls chained per timed evaluation")
    args = parser.parse_args()
    use_device(args.device)
    methods = {"mlx": mlx_attention, "mlx-mask": mlx_array_mask, "folded": folded, "split": split_attention,
               **{f"blocked-{n}": (lambda q, k, v, c, n=n: blocked(q, k, v, c, n, fold=False)) for n in args.blocks},
               **{f"folded-{n}": (lambda q, k, v, c, n=n: blocked(q, k, v, c, n)) for n in args.blocks}}
    with report_to(args.json) as report:
        print(f"device: {mx.default_device()} (MLX {mx.__version__}); heads {args.heads}, kv heads {args.kv_heads}, "
              f"head dim {args.head_dim}; ms per call (one layer), median of {args.repeats}; error: the largest "
              "difference from float32 over the largest output")
        print(f"{'rows':>6} {'context':>8} " + "".join(f"{m:>22}" for m in methods))
        report["rows"] = []
        for rows in args.rows:
            for context in args.context:
                q, k, v = _inputs(rows, context, args.heads, args.kv_heads, args.head_dim)
                want = reference(q, k, v, context)
                cells, row = [], {"rows": rows, "context": context}
                for name, fn in methods.items():
                    out = fn(q, k, v, context)
                    error = (mx.abs(out.astype(mx.float32) - want).max() / mx.abs(want).max()).item()
                    ms = _time(lambda fn=fn, q=q, k=k, v=v, c=context: fn(q, k, v, c), args.calls, args.repeats) * 1e3
                    row[name] = {"ms": ms, "error": error}
                    cells.append(f"{ms:9.2f} ms {error:8.1e}")
                report["rows"].append(row)
                print(f"{rows:>6} {context:>8} " + "".join(f"{c:>22}" for c in cells))


def _inputs(rows: int, context: int, heads: int, kv_heads: int, dim: int) -> tuple[mx.array, mx.array, mx.array]:
    key = mx.random.key(rows * 7 + context)
    a, b, c = mx.random.split(key, 3)
    q = mx.random.normal((1, heads, rows, dim), key=a).astype(mx.bfloat16)
    k = mx.random.normal((1, kv_heads, context + rows, dim), key=b).astype(mx.bfloat16)
    v = mx.random.normal((1, kv_heads, context + rows, dim), key=c).astype(mx.bfloat16)
    mx.eval(q, k, v)
    return q, k, v


def _time(call, calls: int, repeats: int) -> float:
    mx.eval(call())  # (warm: kernels compiled)
    times = []
    for _ in range(max(1, repeats)):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval([call() for _ in range(calls)])
        mx.synchronize()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _scale(q: mx.array) -> float:
    return q.shape[-1] ** -0.5


def mlx_attention(q: mx.array, k: mx.array, v: mx.array, context: int) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=_scale(q), mask="causal")


def reference(q: mx.array, k: mx.array, v: mx.array, context: int) -> mx.array:
    """The attention in float32 throughout."""
    b, heads, rows, dim = q.shape
    groups = heads // k.shape[1]
    qf = q.astype(mx.float32).reshape(b, k.shape[1], groups, rows, dim) * _scale(q)
    scores = qf @ k.astype(mx.float32)[:, :, None].swapaxes(-1, -2)
    scores = mx.where(causal_mask(rows, context, 0, k.shape[2]), scores, -mx.inf)
    out = mx.softmax(scores, axis=-1) @ v.astype(mx.float32)[:, :, None]
    return out.reshape(b, heads, rows, dim)


def blocked(q: mx.array, k: mx.array, v: mx.array, context: int, block: int, fold: bool = True) -> mx.array:
    """The engine's key-blocked path (``EXO_LONG_ATTENTION``): the query heads of a KV head as rows of one product
    (``fold``) or as a group axis against broadcast keys."""
    return blocked_attention(q, k, v, _scale(q), block, fold=fold)


def split_attention(q: mx.array, k: mx.array, v: mx.array, context: int) -> mx.array:
    """The cached keys as one unmasked block, the new rows' own keys as one causal block."""
    return blocked(q, k, v, context, max(context, 1))


def mlx_array_mask(q: mx.array, k: mx.array, v: mx.array, context: int) -> mx.array:
    """MLX's call with the causal mask as a boolean array (the path a batch's masks take)."""
    mask = causal_mask(q.shape[2], context, 0, k.shape[2]).reshape(1, 1, q.shape[2], k.shape[2])
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=_scale(q), mask=mask)


def folded(q: mx.array, k: mx.array, v: mx.array, context: int) -> mx.array:
    """One block of every key with the query heads folded into rows: one GEMM per KV head for the scores and one
    for the values, a float32 softmax between."""
    return blocked(q, k, v, context, k.shape[2])


if __name__ == "__main__":
    main()
