"""A prompt chunk's quantized linears by method: what the 9B's prefill spends beyond the gated delta rule (issue 49).

    python bench/prefill_linears.py MODEL [--rows 2048 4096] [--calls 4] [--repeats 3]

At prefill sizes (thousands of rows) a layer's product is bound by arithmetic, not by reading its weights. MLX's
quantized product dequantizes inside its tiles (``qmm_sm80`` on an H200); a dense product on bfloat16 weights
goes to cuBLAS. Per distinct linear shape (weight, bits, group) of the backbone, three ways, each timed (median of
``--repeats``, ``--calls`` calls per evaluation):

- ``qmm``: ``mx.quantized_matmul`` (what the engine runs today);
- ``deq+mm``: ``mx.dequantize`` of the layer's weight for this call, then ``x @ w.T`` (the dequantization is in
  its time: nothing kept beyond the call);
- ``mm``: ``x @ w.T`` on a bfloat16 copy made beforehand (the bound a kept copy would give, at 4x the memory).

``error``: the largest |y - reference| over the largest |reference|, the reference a float32 product on the
dequantized weight (bfloat16 rounding is ~4e-3). The last lines sum each method over the model's layers (each
shape times how many layers have it): the linears of one chunk of M rows.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from common import add_common_arguments, report_to, use_device  # noqa: E402
from qmm_rows import in_features, shapes, timed  # noqa: E402 (timed: microseconds a call)

from exo.engine import load_checkpoint, resolve_model  # noqa: E402
from exo.engine.costs import device_name  # noqa: E402


def methods(m: nn.QuantizedLinear) -> dict:
    def deq() -> mx.array:
        return mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)

    dense = deq().astype(m.scales.dtype)
    mx.eval(dense)
    return {
        "qmm": lambda x: mx.quantized_matmul(x, m.weight, m.scales, m.biases, transpose=True,
                                             group_size=m.group_size, bits=m.bits),
        "deq+mm": lambda x: x @ deq().astype(x.dtype).T,
        "mm": lambda x: x @ dense.T,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    use_device(args.device)
    model = load_checkpoint(resolve_model(args.model).path).model
    found = shapes(model)
    key = mx.random.key(0)
    out = []
    totals: Counter[tuple[int, str]] = Counter()
    print(f"device: {device_name()} (MLX {mx.__version__}), model {args.model}")
    print(f"{'shape':>34} {'layers':>6} {'rows':>6} {'method':>7} {'ms':>8} {'TFLOP/s':>8} {'vs qmm':>7} {'error':>9}")
    for (wshape, bits, group), (m, count, name) in sorted(found.items(), key=lambda kv: -kv[1][1]):
        if name == "lm_head":
            continue  # a prompt needs its last row's logits only
        k = in_features(m)
        fns = methods(m)
        label = f"{name} {wshape[0]}x{k} {bits}b g{group}"
        for rows in args.rows:
            key, sub = mx.random.split(key)
            x = (mx.random.normal((rows, k), key=sub) * 0.5).astype(m.scales.dtype)
            ref = x.astype(mx.float32) @ mx.dequantize(m.weight, m.scales, m.biases, group_size=group,
                                                       bits=bits).astype(mx.float32).T
            scale = mx.abs(ref).max().item()
            base = None
            for method, fn in fns.items():
                ms = timed(fn, x, args.calls, args.repeats) / 1e3
                err = (mx.abs(fn(x).astype(mx.float32) - ref).max() / scale).item()
                base = base or ms
                tflops = 2 * rows * k * wshape[0] / ms / 1e9
                totals[(rows, method)] += ms * count
                print(f"{label:>34} {count:>6} {rows:>6} {method:>7} {ms:8.3f} {tflops:8.1f} {base / ms:6.2f}x "
                      f"{err:9.2e}")
                out.append(dict(shape=label, layers=count, rows=rows, method=method, ms=ms, error=err))
    print()
    if not out:
        raise SystemExit(f"{args.model} has no quantized linear layers")
    for rows in args.rows:
        base = totals[(rows, "qmm")]
        print(f"the model's linears at {rows} rows: " + ", ".join(
            f"{method} {totals[(rows, method)]:.1f} ms ({base / totals[(rows, method)]:.2f}x)"
            for method in ("qmm", "deq+mm", "mm")))
    with report_to(args.json) as report:
        report.update(model=args.model, device=device_name(), rows=out,
                      totals={f"{r}:{m}": v for (r, m), v in totals.items()})


if __name__ == "__main__":
    main()
