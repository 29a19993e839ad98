"""Does exo's multi-row quantized product (kernels/cuda_qmv.py) give MLX's one-row products bit for bit on a
model's real layer shapes, and what does it cost against M one-row calls and against MLX's own M-row call?

    python bench/qmv_check.py MODEL [--rows 2 3 4] [--calls 20] [--repeats 5]

Every distinct quantized linear shape of the backbone, the MTP head's layer and the output projection (a tied
embedding as a linear), random rows in the activations' dtype. Per shape and row count M it prints whether
MLX's M-row call equals the M one-row calls (``block==rows``: what the verify probe finds), whether exo's
kernel does (``kernel==rows``), and microseconds per M rows (``calls`` products in one evaluation, median of
``repeats``): M one-row calls (``rows``: what a verify call costs computing its rows one by one), MLX's M-row
call (``block``) and the kernel (``kernel``), with ``kernel/block`` and ``kernel/one``: the kernel's M rows over
ONE one-row call (1.0 = rows as cheap as a decode step's). A total line sums them over the model's layers (each
shape times how many layers have it), per M. Exits 1 when the kernel differs anywhere. On the CPU the kernel is
MLX's own product (the reference path): the equalities still hold there, the times say nothing.
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

from exo.engine import load  # noqa: E402
from exo.engine.costs import device_name  # noqa: E402
from exo.engine.kernels import cuda_qmv  # noqa: E402


def quantized_shapes(engine) -> dict[tuple, tuple[nn.Module, int, str]]:
    """signature -> (a module of it, how many layers of the decode path have it, a name)."""
    model = engine.model
    found: dict[tuple, tuple[nn.Module, int, str]] = {}
    counts: Counter[tuple] = Counter()
    parts = [("backbone", layer) for layer in model.stage_layers]
    if engine.loaded.head is not None:
        parts.append(("head", engine.loaded.head))
    for where, part in parts:
        for path, module in part.named_modules():
            if isinstance(module, nn.QuantizedLinear):
                sig = (tuple(module.weight.shape), module.bits, module.group_size)
                counts[sig] += 1
                found.setdefault(sig, (module, 0, f"{where} {path.split('.')[-1]}"))
    head = model.output_projection()
    if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        sig = ("output", tuple(head.weight.shape), head.bits, head.group_size)
        counts[sig] += 1
        found[sig] = (head, 0, "lm_head" if isinstance(head, nn.QuantizedLinear) else "tied embedding")
    return {sig: (m, counts[sig], name) for sig, (m, _, name) in found.items()}


def per_call_us(fn, calls: int, repeats: int) -> float:
    mx.eval([fn() for _ in range(calls)])  # compile, warm the caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    use_device(args.device)
    engine = load(args.model)
    shapes = quantized_shapes(engine)
    ok = True
    with report_to(args.json) as report:
        print(f"{engine.loaded.model_id} on {device_name()}: {len(shapes)} quantized shapes; "
              f"us per M rows, median of {args.repeats} x {args.calls} calls")
        print(f"{'shape':<40} {'layers':>6} {'M':>2} {'block==rows':>11} {'kernel==rows':>12} {'one':>8} "
              f"{'rows':>8} {'block':>8} {'kernel':>8} {'kernel/block':>12} {'kernel/one':>10}")
        totals: dict[int, Counter[str]] = {m: Counter() for m in args.rows}
        report["shapes"] = []
        for module, count, name in shapes.values():
            tied = isinstance(module, nn.QuantizedEmbedding)
            one_row = module.as_linear if tied else module
            in_dims = module.weight.shape[1] * 32 // module.bits
            dtype = module.scales.dtype
            label = f"{name} {in_dims}->{module.weight.shape[0]} {module.bits}-bit"
            one_us = None
            for m in args.rows:
                key = mx.random.key(m)
                x = (mx.random.normal((1, m, in_dims), key=key) * 0.5).astype(dtype)
                single = mx.concatenate([one_row(x[:, t : t + 1]) for t in range(m)], axis=1)
                block = one_row(x)
                kernel = cuda_qmv.module_rows(module, x)
                mx.eval(single, block, kernel)
                block_same = bool(mx.array_equal(block, single).item())
                kernel_same = bool(mx.array_equal(kernel, single).item())
                ok &= kernel_same
                if one_us is None:
                    one_us = per_call_us(lambda x=x, f=one_row: f(x[:, :1]), args.calls, args.repeats)
                rows_us = per_call_us(lambda x=x, m=m, f=one_row: [f(x[:, t : t + 1]) for t in range(m)], args.calls,
                                      args.repeats)
                block_us = per_call_us(lambda x=x, f=one_row: f(x), args.calls, args.repeats)
                kernel_us = per_call_us(lambda x=x, q=module: cuda_qmv.module_rows(q, x), args.calls, args.repeats)
                for part, us in (("one", one_us), ("rows", rows_us), ("block", block_us), ("kernel", kernel_us)):
                    totals[m][part] += us * count
                print(f"{label:<40} {count:>6} {m:>2} {block_same!s:>11} {kernel_same!s:>12} {one_us:>8.1f} "
                      f"{rows_us:>8.1f} {block_us:>8.1f} {kernel_us:>8.1f} {kernel_us / block_us:>12.3f} "
                      f"{kernel_us / one_us:>10.3f}")
                report["shapes"].append({"shape": label, "layers": count, "rows": m, "block_equal": block_same,
                                         "kernel_equal": kernel_same, "one_us": one_us, "rows_us": rows_us,
                                         "block_us": block_us, "kernel_us": kernel_us})
        for m in args.rows:
            t = totals[m]
            print(f"{'total (x layers)':<40} {'':>6} {m:>2} {'':>11} {'':>12} {t['one']:>8.0f} {t['rows']:>8.0f} "
                  f"{t['block']:>8.0f} {t['kernel']:>8.0f} {t['kernel'] / t['block']:>12.3f} "
                  f"{t['kernel'] / t['one']:>10.3f}")
        report["totals"] = {m: dict(totals[m]) for m in args.rows}
        report["kernel_equal_everywhere"] = ok
        print("the kernel gives MLX's one-row products everywhere: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
