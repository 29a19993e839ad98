"""Does exo's quantized matrix-vector kernel (engine/kernels/cuda_qgemv.py) give every row the same bits whatever
rows share its launch, compute what its reference arithmetic computes, and how fast is it against MLX's product,
on a model's real layer shapes?

    python bench/qmv_check.py MODEL [--rows 1 2 3 4 8] [--calls 20] [--repeats 5]

Every distinct quantized linear shape of the backbone, the MTP head's layers and the output projection (a tied
embedding as a linear), random rows in the scales' dtype. Per shape and row count M it prints:
- ``rows==alone``: the kernel's M-row launch gives each row the bits of its 1-row launch (what makes a verify
  call's rows equal their decode steps);
- ``==ref``: the kernel equals ``cuda_qgemv.emulate`` (its arithmetic in MLX operations) bit for bit on the
  first ``--ref-outputs`` outputs;
- at M = 1: ``err``, the kernel's largest error against a float32 reference, and ``mlx``, MLX's product's, both
  relative to sum |x||w| of the output (``cuda_qgemv.check``'s measures), on the first ``--ref-outputs``;
- microseconds per call of M rows (``calls`` products in one evaluation, median of ``repeats``): MLX's one-row
  product (``mlx1``), MLX's M-row product (``mlxM``), the kernel (``kern``); ``kern/mlx1`` and ``kern/k1`` (the
  kernel's M rows over its own one row: the cost of verify rows next to a decode step's), and the kernel's
  ``GB/s`` (weights, scales and biases read once).
A total line per M sums the times over the model's layers (each shape times how many layers have it). Exits 1
when a launch's rows differ from their rows alone or the kernel from its reference anywhere. On the CPU the kernel
is ``emulate`` itself: the equalities hold trivially there and the times say nothing (a check that the script runs).
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
from exo.engine.kernels import cuda_qgemv  # noqa: E402


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
            if isinstance(module, nn.QuantizedLinear) and cuda_qgemv.supported(module):
                sig = (tuple(module.weight.shape), module.bits, module.group_size)
                counts[sig] += 1
                found.setdefault(sig, (module, 0, f"{where} {path.split('.')[-1]}"))
    head = model.output_projection()
    if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and cuda_qgemv.supported(head):
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


def bits_equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.array_equal(a.view(mx.uint16), b.view(mx.uint16)).item())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--ref-outputs", type=int, default=256, help="outputs compared with the reference")
    args = parser.parse_args()
    use_device(args.device)
    engine = load(args.model)
    shapes = quantized_shapes(engine)
    ok = True
    with report_to(args.json) as report:
        print(f"{engine.loaded.model_id} on {device_name()}: {len(shapes)} quantized shapes; us per call of M rows, "
              f"median of {args.repeats} x {args.calls} calls; kernel at load: "
              + ("; ".join(f"{k}: {v}" for k, v in engine.loaded.qgemv.items()) or "not installed"))
        print(f"{'shape':<40} {'layers':>6} {'M':>2} {'rows==alone':>11} {'==ref':>5} {'err':>8} {'mlx':>8} "
              f"{'mlx1':>8} {'mlxM':>8} {'kern':>8} {'kern/mlx1':>9} {'kern/k1':>7} {'GB/s':>7}")
        totals: dict[int, Counter[str]] = {m: Counter() for m in args.rows}
        report["shapes"] = []
        for module, count, name in shapes.values():
            w, scales, biases = module["weight"], module["scales"], module["biases"]
            group, bits = module.group_size, module.bits
            k, n = w.shape[1] * 32 // bits, w.shape[0]
            nbytes = w.nbytes + scales.nbytes + biases.nbytes
            dtype = scales.dtype
            label = f"{name} {k}->{n} {bits}-bit"

            def kernel(x, w=w, scales=scales, biases=biases, group=group, bits=bits):
                return cuda_qgemv.qgemv(x, w, scales, biases, group_size=group, bits=bits)

            def stock(x, w=w, scales=scales, biases=biases, group=group, bits=bits):
                return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group, bits=bits)

            top = min(args.ref_outputs, n)
            one_mlx = one_kernel = None
            for m in args.rows:
                x = (mx.random.normal((m, k), key=mx.random.key(m)) * 0.5).astype(dtype)
                block = kernel(x)
                alone = mx.concatenate([kernel(x[t : t + 1]) for t in range(m)])
                reference = cuda_qgemv.emulate(x, w[:top], scales[:top], biases[:top], group_size=group, bits=bits,
                                               split=cuda_qgemv.split_for(n, k, bits))
                mx.eval(block, alone, reference)
                same = bits_equal(block, alone)
                as_ref = bits_equal(block[:, :top], reference)
                ok &= same and as_ref
                err = mlx_err = float("nan")
                if m == 1:  # on the first --ref-outputs outputs (a float32 copy of a 248k-row lm_head is 4 GB)
                    dense = mx.dequantize(w[:top], scales[:top].astype(mx.float32), biases[:top].astype(mx.float32),
                                          group_size=group, bits=bits)
                    exact = x.astype(mx.float32) @ dense.T
                    magnitude = mx.maximum(mx.abs(x.astype(mx.float32)) @ mx.abs(dense).T, 1e-30)
                    err = float((mx.abs(block[:, :top].astype(mx.float32) - exact) / magnitude).max().item())
                    mlx_err = float((mx.abs(stock(x)[:, :top].astype(mx.float32) - exact) / magnitude).max().item())
                    del dense
                if one_mlx is None:
                    one_mlx = per_call_us(lambda x=x: stock(x[:1]), args.calls, args.repeats)
                    one_kernel = per_call_us(lambda x=x: kernel(x[:1]), args.calls, args.repeats)
                mlx_us = per_call_us(lambda x=x: stock(x), args.calls, args.repeats)
                kernel_us = per_call_us(lambda x=x: kernel(x), args.calls, args.repeats)
                for part, us in (("mlx1", one_mlx), ("mlxM", mlx_us), ("kern", kernel_us), ("k1", one_kernel)):
                    totals[m][part] += us * count
                gbs = nbytes / kernel_us / 1e3
                print(f"{label:<40} {count:>6} {m:>2} {same!s:>11} {as_ref!s:>5} {err:>8.1e} {mlx_err:>8.1e} "
                      f"{one_mlx:>8.1f} {mlx_us:>8.1f} {kernel_us:>8.1f} {kernel_us / one_mlx:>9.3f} "
                      f"{kernel_us / one_kernel:>7.3f} {gbs:>7.0f}")
                report["shapes"].append({"shape": label, "layers": count, "rows": m, "rows_equal_alone": same,
                                         "equals_reference": as_ref, "error": err, "mlx_error": mlx_err,
                                         "mlx_one_us": one_mlx, "mlx_rows_us": mlx_us, "kernel_us": kernel_us,
                                         "kernel_one_us": one_kernel, "kernel_gb_s": gbs})
        for m in args.rows:
            t = totals[m]
            print(f"{'total (x layers)':<40} {'':>6} {m:>2} {'':>11} {'':>5} {'':>8} {'':>8} {t['mlx1']:>8.0f} "
                  f"{t['mlxM']:>8.0f} {t['kern']:>8.0f} {t['kern'] / t['mlx1']:>9.3f} {t['kern'] / t['k1']:>7.3f}")
        report["totals"] = {m: dict(totals[m]) for m in args.rows}
        report["exact_everywhere"] = ok
        print("every launch's rows equal their rows alone and the reference: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
