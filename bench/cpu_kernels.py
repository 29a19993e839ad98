"""exo's CPU linear kernel against MLX's bfloat16 matmul, on the shapes of a decode step (this machine).

    python bench/cpu_kernels.py [MODEL] [--rows 1 2 4 8 32] [--iters 200]

For every distinct (out, in) shape of MODEL's linear layers and its lm_head (exo-demo by default), and each
row count, times ``x @ w.T`` (MLX) and ``kernels.cpu_linear()(x, w)`` (exo), alternating, each call evaluated
alone, and checks that both give the same bits. Prints the median time of each and their ratio, then the
whole step's worth of linear layers (every layer's shape, as often as the model has it) per row count.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import mlx.core as mx
import mlx.nn as nn

from exo.engine import kernels, load


def timed(fn, iters: int) -> list[float]:
    mx.eval(fn())
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        mx.eval(fn())
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    linear = kernels.cpu_linear()
    if linear is None:
        raise SystemExit(f"exo's CPU kernel is not in use here: {kernels.status()}")
    engine = load(args.model)
    shapes: Counter[tuple[int, int]] = Counter()
    for _, module in engine.loaded.model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and "bias" not in module and module.weight.ndim == 2:
            shapes[tuple(module.weight.shape)] += 1
    print(f"{args.model}: {sum(shapes.values())} linear layers / tables, {len(shapes)} shapes; "
          f"median of {args.iters} calls each, MLX vs exo alternating")
    print(f"{'rows':>4} {'shape (out x in)':>18} {'count':>5} {'MLX ms':>8} {'exo ms':>8} {'MLX/exo':>8}  same bits")
    for rows in args.rows:
        step_mlx = step_exo = 0.0
        for (n, k), count in sorted(shapes.items()):
            x = mx.random.normal((rows, k), key=mx.random.key(rows * 7 + k)).astype(mx.bfloat16)
            w = (mx.random.normal((n, k), key=mx.random.key(n)) * 0.05).astype(mx.bfloat16)
            same = mx.array_equal((x @ w.T).view(mx.uint16), linear(x, w).view(mx.uint16)).item()
            t_mlx, t_exo = [], []
            for _ in range(args.iters // 20):
                t_mlx += timed(lambda: x @ w.T, 10)  # noqa: B023
                t_exo += timed(lambda: linear(x, w), 10)  # noqa: B023
            m, e = statistics.median(t_mlx) * 1e3, statistics.median(t_exo) * 1e3
            step_mlx += m * count
            step_exo += e * count
            print(f"{rows:>4} {f'{n} x {k}':>18} {count:>5} {m:8.3f} {e:8.3f} {m / e:8.2f}x  {same}")
        print(f"{rows:>4} {'a step':>18} {sum(shapes.values()):>5} {step_mlx:8.3f} {step_exo:8.3f} "
              f"{step_mlx / step_exo:8.2f}x")


if __name__ == "__main__":
    main()
