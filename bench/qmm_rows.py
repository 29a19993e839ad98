"""MLX's own quantized product at 1-16 rows on a model's shapes: what a call of M rows costs, and whether each row's
bits depend on the rows beside it.

    python bench/qmm_rows.py MODEL [--rows 1 2 4 7 8 9 16] [--pad 8] [--calls 20] [--repeats 5]

On an H200 MLX computes 1-7 rows with ``qmv`` (each row reads the weights again: M rows cost ~M one-row calls) and
8 or more with a tiled kernel that read the 9B's layers faster for 8 rows than ``qmv`` for one
(bench/results/h200-mlx-cuda-qgemv-rounds-9b-2026-11-29.txt, ``mlxM``). A verify call of K + 1 rows costs
K + 1 one-row reads of every linear layer: most of a round's cost there. If the tiled kernel gives a row the same
bits whatever its companions, a decode step, a verify call and a batch step could all pad their rows to ``--pad``
and agree by construction, each costing about one tiled call.

Per distinct linear shape (weight, bits, group) of the backbone and the output projection, prints:
- ``us@M``: microseconds per call of M random rows (``--calls`` calls in one evaluation, median of ``--repeats``);
- ``alone``: at each M, every row equals its one-row product bit for bit;
- ``pad``: the rows of a call padded with zero rows to ``--pad`` equal the same rows in a padded call whose other
  rows are random (companions do not change a row's bits), for M = 1 .. pad;
- the time of a padded call over one row's call (what a padded decode step would cost).
Then the whole step's linear time at 1 row vs padded (each shape times how many layers have it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from common import add_common_arguments, report_to, use_device  # noqa: E402

from exo.engine import load_checkpoint, resolve_model  # noqa: E402
from exo.engine.costs import device_name  # noqa: E402


def shapes(model) -> dict[tuple, tuple[nn.QuantizedLinear, int, str]]:
    found: dict[tuple, tuple[nn.QuantizedLinear, int, str]] = {}
    counts: Counter[tuple] = Counter()
    for layer in model.stage_layers:
        for name, m in layer.named_modules():
            if isinstance(m, nn.QuantizedLinear) and m.weight.ndim == 2:
                key = (tuple(m.weight.shape), m.bits, m.group_size)
                counts[key] += 1
                found.setdefault(key, (m, 0, name.split(".")[-1]))
    head = model.output_projection()
    if isinstance(head, nn.QuantizedLinear):
        key = (tuple(head.weight.shape), head.bits, head.group_size)
        counts[key] += 1
        found.setdefault(key, (head, 0, "lm_head"))
    return {k: (m, counts[k], name) for k, (m, _, name) in found.items()}


def in_features(m: nn.QuantizedLinear) -> int:
    return m.weight.shape[1] * 32 // m.bits


def timed(fn, x: mx.array, calls: int, repeats: int) -> float:
    xs = [x + 0 for _ in range(calls)]
    mx.eval(xs, fn(x))
    times = []
    for _ in range(repeats):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval([fn(v) for v in xs])
        mx.synchronize()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 7, 8, 9, 16])
    parser.add_argument("--pad", type=int, default=8)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    use_device(args.device)
    model = load_checkpoint(resolve_model(args.model).path).model
    found = shapes(model)
    key = mx.random.key(0)
    rows_out = []
    totals = Counter()
    print(f"device: {device_name()} (MLX {mx.__version__}), model {args.model}, pad {args.pad}")
    print(f"{'shape':>36} {'layers':>6} " + "".join(f"{'us@' + str(m):>10}" for m in args.rows)
          + f" {'pad/1':>6} {'alone':>7} {'pad':>5}")
    bad = False
    for (wshape, bits, group), (m, count, name) in sorted(found.items(), key=lambda kv: -kv[1][1]):
        k = in_features(m)
        dtype = m.scales.dtype
        key, sub = mx.random.split(key)
        x = (mx.random.normal((max(args.rows + [args.pad]), 1, k), key=sub) * 0.5).astype(dtype)
        us = {r: timed(m, x[:r], args.calls, args.repeats) for r in args.rows}
        pad_us = timed(m, mx.concatenate([x[:1], mx.zeros((args.pad - 1, 1, k), dtype)]), args.calls, args.repeats)
        ones = mx.concatenate([m(x[i : i + 1]) for i in range(x.shape[0])])
        alone = {r: mx.array_equal(m(x[:r]), ones[:r]).item() for r in args.rows}
        pad_ok = True
        for r in range(1, args.pad + 1):
            zeros = mx.concatenate([x[:r], mx.zeros((args.pad - r, 1, k), dtype)])
            key, sub = mx.random.split(key)
            other = mx.concatenate([x[:r], (mx.random.normal((args.pad - r, 1, k), key=sub) * 0.5).astype(dtype)])
            pad_ok &= mx.array_equal(m(zeros)[:r], m(other)[:r]).item()
        bad |= not pad_ok
        totals["one"] += us[1] * count if 1 in us else 0
        totals["pad"] += pad_us * count
        label = f"{name} {wshape[0]}x{k} {bits}b g{group}"
        alone_s = "".join("y" if alone[r] else "n" for r in args.rows)
        print(f"{label:>36} {count:>6} " + "".join(f"{us[r]:10.1f}" for r in args.rows)
              + f" {pad_us / us.get(1, pad_us):6.2f} {alone_s:>7} {'yes' if pad_ok else 'NO':>5}")
        rows_out.append(dict(shape=label, layers=count, us={str(r): us[r] for r in args.rows}, pad_us=pad_us,
                             alone={str(r): alone[r] for r in args.rows}, pad_exact=pad_ok))
    if totals["one"]:
        print(f"\nthe step's linears: one row {totals['one'] / 1e3:.2f} ms, padded to {args.pad} rows "
              f"{totals['pad'] / 1e3:.2f} ms ({totals['pad'] / totals['one']:.2f}x)")
    print("alone: y/n per row count in --rows order; pad: rows of a padded call independent of their companions")
    with report_to(args.json) as report:
        report.update(model=args.model, device=device_name(), pad=args.pad, shapes=rows_out, totals=dict(totals))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
