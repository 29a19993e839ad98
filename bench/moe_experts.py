"""A prompt's MoE experts by method: what the 35B-A3B's prefill spends 72% of its time on (issue 49).

One SwitchGLU layer (up, gate, SiLU, down) of quantized experts over ``--tokens`` rows routed top-k at random,
five ways, alternating, each timed (median of ``--repeats``) and compared with the first (exo's path on MLX CUDA,
where ``layers.check_expert_sort`` finds MLX's sorted kernels wrong):

1. ``unsorted``: ``gather_qmm`` per (row, expert) pair in row order (``layers.experts_unsorted``);
2. ``sorted``: mlx-lm's SwitchGLU path (pairs sorted by expert, ``gather_qmm(..., sorted_indices=True)``);
3. ``sorted, contiguous``: the same with every operand copied contiguous first (MLX issues 4055 and 4253 are
   wrong results of the sorted path on non-contiguous operands);
4. ``dequantized, gather_mm``: the layer's experts dequantized to the activations' dtype for this call, then
   the sorted ``gather_mm`` (MLX issue 4339: on CUDA the quantized gather runs one CTA per pair, the float one
   as a grouped GEMM); its time includes the dequantization;
5. ``segments``: pairs sorted by expert, the counts read on the host (one sync), then one ``quantized_matmul``
   per expert with rows.

Prints ms, tokens/s and each method's largest difference from ``unsorted`` relative to its scale (bfloat16
rounding is ~1e-2; "wrong" results of the issues above are ~1). Figures go to docs/performance.md.

    python bench/moe_experts.py                                  # 35B-A3B's layer: 256 experts, 2048 -> 512, top-8
    python bench/moe_experts.py --tokens 64 --experts 16 --hidden 256 --inter 128 --top-k 4 --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from common import add_common_arguments, report_to, use_device  # bench/ is this script's folder

Experts = dict[str, tuple[mx.array, mx.array, mx.array]]  # projection -> (weight, scales, biases)


def make_experts(experts: int, hidden: int, inter: int, bits: int, group: int, dtype: mx.Dtype,
                 key: mx.array) -> Experts:
    out: Experts = {}
    for i, (name, shape) in enumerate((("up", (experts, inter, hidden)), ("gate", (experts, inter, hidden)),
                                       ("down", (experts, hidden, inter)))):
        w = (mx.random.normal(shape, key=mx.random.split(key, 3)[i]) * shape[-1] ** -0.5).astype(dtype)
        q, s, b = mx.quantize(w, group, bits)
        out[name] = (q, s, b)
    mx.eval(out)
    return out


def glu(up: mx.array, gate: mx.array) -> mx.array:
    return nn.silu(gate) * up


def unsorted(x: mx.array, inds: mx.array, ex: Experts, bits: int, group: int) -> mx.array:
    x = mx.expand_dims(x, (-2, -3))

    def proj(v: mx.array, name: str) -> mx.array:
        return mx.gather_qmm(v, *ex[name], rhs_indices=inds, transpose=True, group_size=group, bits=bits)

    return proj(glu(proj(x, "up"), proj(x, "gate")), "down").squeeze(-2)


def _sort(x: mx.array, inds: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    k = inds.shape[-1]
    flat = inds.flatten()
    order = mx.argsort(flat)
    return mx.expand_dims(x.reshape(-1, x.shape[-1]), -2)[order // k], flat[order], mx.argsort(order)


def _unsort(y: mx.array, inv: mx.array, inds: mx.array) -> mx.array:
    return y[inv].reshape(*inds.shape, y.shape[-1])


def sorted_path(x: mx.array, inds: mx.array, ex: Experts, bits: int, group: int, contiguous: bool) -> mx.array:
    xs, idx, inv = _sort(x, inds)
    if contiguous:
        xs, idx = mx.contiguous(xs), mx.contiguous(idx)

    def proj(v: mx.array, name: str) -> mx.array:
        ops = tuple(mx.contiguous(a) for a in ex[name]) if contiguous else ex[name]
        return mx.gather_qmm(v, *ops, rhs_indices=idx, transpose=True, group_size=group, bits=bits,
                             sorted_indices=True)

    y = proj(glu(proj(xs, "up"), proj(xs, "gate")), "down").squeeze(-2)
    return _unsort(y, inv, inds)


def dequantized(x: mx.array, inds: mx.array, ex: Experts, bits: int, group: int) -> mx.array:
    xs, idx, inv = _sort(x, inds)

    def proj(v: mx.array, name: str) -> mx.array:
        w = mx.dequantize(*ex[name], group_size=group, bits=bits).astype(x.dtype)
        return mx.gather_mm(v, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True)

    y = proj(glu(proj(xs, "up"), proj(xs, "gate")), "down").squeeze(-2)
    return _unsort(y, inv, inds)


def segments(x: mx.array, inds: mx.array, ex: Experts, bits: int, group: int) -> mx.array:
    xs, idx, inv = _sort(x, inds)
    experts = ex["up"][0].shape[0]
    counts = (idx[:, None] == mx.arange(experts)[None, :]).sum(axis=0).tolist()  # the one host sync
    xs = xs.squeeze(-2)
    parts, start = [], 0
    for e, n in enumerate(counts):
        if not n:
            continue
        rows = xs[start:start + n]
        start += n

        def proj(v: mx.array, name: str, e: int = e) -> mx.array:
            w, s, b = ex[name]
            return mx.quantized_matmul(v, w[e], s[e], b[e], transpose=True, group_size=group, bits=bits)

        parts.append(proj(glu(proj(rows, "up"), proj(rows, "gate")), "down"))
    return _unsort(mx.concatenate(parts, axis=0), inv, inds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5, model=False)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 512])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    use_device(args.device)
    dtype = getattr(mx, args.dtype)
    key = mx.random.key(20261129)
    ex = make_experts(args.experts, args.hidden, args.inter, args.bits, args.group, dtype, key)
    methods: dict[str, Callable[[mx.array, mx.array], mx.array]] = {
        "unsorted": lambda x, i: unsorted(x, i, ex, args.bits, args.group),
        "sorted": lambda x, i: sorted_path(x, i, ex, args.bits, args.group, contiguous=False),
        "sorted, contiguous": lambda x, i: sorted_path(x, i, ex, args.bits, args.group, contiguous=True),
        "dequantized, gather_mm": lambda x, i: dequantized(x, i, ex, args.bits, args.group),
        "segments": lambda x, i: segments(x, i, ex, args.bits, args.group),
    }
    with report_to(args.json) as report:
        report["device"] = str(mx.default_device())
        report["rows"] = []
        print(f"device {mx.default_device()}: {args.experts} experts, {args.hidden} -> {args.inter}, top-{args.top_k}, "
              f"{args.bits}-bit g{args.group} {args.dtype}; median of {args.repeats}")
        for tokens in args.tokens:
            k1, k2 = mx.random.split(mx.random.key(tokens))
            x = (mx.random.normal((1, tokens, args.hidden), key=k1) * 0.5).astype(dtype)
            order = mx.argsort(mx.random.uniform(shape=(1, tokens, args.experts), key=k2), axis=-1)
            inds = order[..., : args.top_k].astype(mx.uint32)
            mx.eval(x, inds)
            outs, run = {}, dict(methods)
            for name, f in methods.items():  # the first call also compiles what each one needs
                try:
                    outs[name] = f(x, inds)
                    mx.eval(outs[name])
                except RuntimeError as exc:  # e.g. MLX's CPU gather_mm is float32 only
                    print(f"{name}: not run on this device: {exc}")
                    del run[name]
                    outs.pop(name, None)
            ref = outs["unsorted"].astype(mx.float32)
            scale = max(float(mx.abs(ref).max().item()), 1e-6)
            times: dict[str, list[float]] = {name: [] for name in run}
            for _ in range(args.repeats):
                for name, f in run.items():
                    mx.synchronize()
                    start = time.perf_counter()
                    mx.eval(f(x, inds))
                    mx.synchronize()
                    times[name].append(time.perf_counter() - start)
            print(f"\n{tokens} tokens ({tokens * args.top_k} pairs)")
            print(f"{'method':>24} {'ms':>9} {'tok/s':>10} {'vs unsorted':>12} {'error':>9}")
            base = statistics.median(times["unsorted"])
            for name in run:
                t = statistics.median(times[name])
                err = float(mx.abs(outs[name].astype(mx.float32) - ref).max().item()) / scale
                print(f"{name:>24} {t * 1e3:9.2f} {tokens / t:10.0f} {base / t:11.2f}x {err:9.2e}")
                report["rows"].append(dict(tokens=tokens, method=name, ms=t * 1e3, error=err))


if __name__ == "__main__":
    main()
