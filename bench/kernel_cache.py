"""exo's CUDA kernels compiled once per machine (``engine/kernels/cuda_build.py``) against MLX compiling them in every
process: the same bits, what a process's start costs, and what a decode step costs.

    python bench/kernel_cache.py [MODEL] [--repeats 2] [--tokens 64] [--json]

On MLX CUDA only. Phases, each printed as it is measured:

1. bits: every kernel exo launches (the quantized GEMV at 1-8 rows, 4 and 8 bits, bfloat16 and half; the
   GatedDeltaNet step at 1 and 4 rows; both attention passes) on random inputs, launched precompiled and by
   ``mx.fast.cuda_kernel``: the outputs must be equal bit for bit (exit 1 otherwise);
2. start and speed: fresh processes load MODEL, warm the engine up and decode --tokens plain greedy tokens, in turn
   with ``EXO_CUDA_KERNEL_CACHE=0`` (MLX compiles every instance), ``1`` on an empty kernel folder (exo compiles
   each, and keeps it) and ``1`` again on that folder (nothing compiled): seconds of import, load (its parts) and
   warm-up (its parts), and decode tok/s, per repeat, then the medians and the ratios to ``0``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SRC, add_common_arguments, report_to  # noqa: E402

CHILD = r"""
import dataclasses, json, sys, time
started = time.perf_counter()
import exo
exo.without_torch()  # as exo's runners start
import mlx.core as mx
from exo.engine import load_checkpoint
from exo.engine.generate import Engine, EngineConfig
from exo.engine.request import GenerationRequest
imported = time.perf_counter() - started
t = time.perf_counter(); loaded = load_checkpoint(sys.argv[1]); load = time.perf_counter() - t
engine = Engine(loaded, EngineConfig())
t = time.perf_counter(); engine.warmup(); warm = time.perf_counter() - t
engine.loaded = dataclasses.replace(loaded, eos_token_ids=frozenset())
prompt = loaded.tokenizer.encode("def fibonacci(n):")
speeds = [engine.complete(GenerationRequest(prompt, max_tokens=int(sys.argv[2]), native_mtp="off")).stats.decode_tokens_per_s
          for _ in range(3)]
from exo.engine.kernels.cuda_build import CudaKernel
print(json.dumps({"import_s": imported, "load_s": load, "load": loaded.load_seconds, "warmup_s": warm,
                  "warmup": engine.warmup_seconds, "decode_tok_s": sorted(speeds)[1],
                  "fallback": CudaKernel.fallback_reason}))
"""


def bits() -> list[tuple[str, bool]]:
    """Each kernel instance launched both ways on the same random inputs: (what, equal bit for bit)."""
    import mlx.core as mx

    from exo.engine.kernels import bits_equal, cuda_attn, cuda_gdn, cuda_qgemv

    out = []
    key = mx.random.key(0)

    def both(kernel: Any, what: str, **call: Any) -> None:
        mine = kernel(**call)
        theirs = kernel._fallback()(**call)
        mx.eval(mine, theirs)
        out.append((what, all(bits_equal(a, b) for a, b in zip(mine, theirs, strict=True))))

    q = cuda_qgemv._kernel()
    for bits_ in cuda_qgemv.BITS:
        for dtype in cuda_qgemv.DTYPES:
            n, k = 1024, 4096
            w = mx.random.normal((n, k), key=key).astype(dtype)
            wq, scales, biases = mx.quantize(w, group_size=64, bits=bits_)
            for rows in range(1, cuda_qgemv.MAX_ROWS + 1):
                x = mx.random.normal((rows, k), key=mx.random.key(rows)).astype(dtype)
                template, grid = cuda_qgemv._launch(rows, n, k, bits_, 64, dtype, scales.dtype)
                both(q, f"qgemv {bits_}-bit {dtype} x{rows}", inputs=[x, wq, scales, biases], template=template,
                     grid=grid, threadgroup=cuda_qgemv.THREADGROUP, output_shapes=[(rows, n)], output_dtypes=[dtype])
    gdn = cuda_gdn._kernel()
    hk, hv, dk, dv, taps, b = 4, 8, 128, 128, 4, 1
    channels = 2 * hk * dk + hv * dv
    for rows in (1, 4):
        ks = mx.random.split(mx.random.key(10 + rows), 8)
        window = mx.random.normal((b, taps - 1, channels), key=ks[0]).astype(mx.bfloat16)
        qkv = mx.random.normal((b, rows, channels), key=ks[1]).astype(mx.bfloat16)
        conv_w = (mx.random.normal((channels, taps, 1), key=ks[2]) * 0.3).astype(mx.bfloat16)
        a = mx.random.normal((b, rows, hv), key=ks[3]).astype(mx.bfloat16)
        bb = mx.random.normal((b, rows, hv), key=ks[4]).astype(mx.bfloat16)
        a_log = mx.random.normal((hv,), key=ks[5]).astype(mx.float32)
        dt_bias = mx.random.normal((hv,), key=ks[6]).astype(mx.bfloat16)
        state = (mx.random.normal((b, hv, dv, dk), key=ks[7]) * 0.1).astype(mx.float32)
        scalars = cuda_gdn._scalars_for(dk, mx.bfloat16)
        both(gdn, f"gdn x{rows}", inputs=[window, qkv, conv_w, a, bb, a_log, dt_bias, state, scalars],
             template=[("T", mx.bfloat16), ("ROWS", rows), ("TAPS", taps), ("HK", hk), ("HV", hv), ("DK", dk),
                       ("DV", dv), ("PROMOTE_F32", True)],
             grid=(cuda_gdn.THREADS * b * hv * (dv // cuda_gdn.TILE), 1, 1), threadgroup=(cuda_gdn.THREADS, 1, 1),
             output_shapes=[(b, rows, hv, dv), (rows, b, hv, dv, dk)], output_dtypes=[mx.bfloat16, mx.float32])
    first, second = cuda_attn._kernels()
    hq, hkv, d, count, rows = 16, 4, 256, 700, 3
    ks = mx.random.split(mx.random.key(20), 3)
    queries = mx.random.normal((1, hq, rows, d), key=ks[0]).astype(mx.bfloat16)
    keys = mx.random.normal((1, hkv, 1024, d), key=ks[1]).astype(mx.bfloat16)
    values = mx.random.normal((1, hkv, 1024, d), key=ks[2]).astype(mx.bfloat16)
    chunks = -(-count // cuda_attn.CHUNK)
    meta = mx.array([count - rows, rows, chunks], dtype=mx.int32)
    n = hq * rows
    call = dict(inputs=[queries, keys, values, meta, mx.array([d**-0.5], dtype=mx.float32)],
                template=[("T", mx.bfloat16), ("D", d), ("HQ", hq), ("HKV", hkv), ("CHUNK", cuda_attn.CHUNK),
                          ("WARPS_", cuda_attn.WARPS)],
                grid=(32 * cuda_attn.WARPS * n * chunks, 1, 1), threadgroup=(32 * cuda_attn.WARPS, 1, 1),
                output_shapes=[(n, chunks), (n, chunks), (n, chunks, d)], output_dtypes=[mx.float32] * 3)
    both(first, "attention pass 1", **call)
    m, l_, acc = first(**call)
    both(second, "attention pass 2", inputs=[m, l_, acc, meta], template=[("T", mx.bfloat16), ("D", d),
                                                                        ("CHUNK", cuda_attn.CHUNK)],
         grid=(d * n, 1, 1), threadgroup=(d, 1, 1), output_shapes=[(1, hq, rows, d)], output_dtypes=[mx.bfloat16])
    return out


def child(model: str, tokens: int, cache: str, folder: str) -> dict[str, Any]:
    env = {**os.environ, "EXO_CUDA_KERNEL_CACHE": cache, "EXO_KERNEL_DIR": folder,
           "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(tokens)], capture_output=True, text=True, env=env,
                         timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"the child process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p, repeats=2, device=False)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--no-bits", dest="check_bits", action="store_false")
    args = p.parse_args(argv)
    import mlx.core as mx

    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        raise SystemExit("kernel_cache: MLX CUDA only (exo's CUDA kernels run nowhere else)")
    from exo.engine import resolve_model

    model = str(resolve_model(args.model).path)
    exact = True
    with report_to(args.json) as report:
        if args.check_bits:
            checked = bits()
            report["bits"] = dict(checked)
            for what, same in checked:
                print(f"{what:<28} {'same bits' if same else 'DIFFERENT'}", flush=True)
            exact = all(same for _, same in checked)
        runs: dict[str, list[dict[str, Any]]] = {"mlx": [], "exo cold": [], "exo warm": []}
        for repeat in range(args.repeats):
            with tempfile.TemporaryDirectory() as folder:
                for name, cache in (("mlx", "0"), ("exo cold", "1"), ("exo warm", "1")):
                    run = child(model, args.tokens, cache, folder)
                    runs[name].append(run)
                    print(f"repeat {repeat + 1}: {name:<9} import {run['import_s']:.1f} s, load {run['load_s']:.1f} s "
                          f"{ {k: round(v, 1) for k, v in run['load'].items() if v >= 0.05} }, warm-up "
                          f"{run['warmup_s']:.1f} s { {k: round(v, 1) for k, v in run['warmup'].items()} }, "
                          f"decode {run['decode_tok_s']:.1f} tok/s" + (f" (fell back: {run['fallback']})"
                                                                       if run["fallback"] else ""), flush=True)
        report["runs"] = runs
        print(f"\n{'':<10}{'start s':>9}{'decode tok/s':>14}{'start vs mlx':>14}{'decode vs mlx':>15}")
        base = {k: statistics.median(r[k] for r in runs["mlx"]) for k in ("load_s", "warmup_s", "decode_tok_s")}
        for name, rs in runs.items():
            start = statistics.median(r["load_s"] + r["warmup_s"] for r in rs)
            decode = statistics.median(r["decode_tok_s"] for r in rs)
            print(f"{name:<10}{start:>9.1f}{decode:>14.1f}{start / (base['load_s'] + base['warmup_s']):>13.2f}x"
                  f"{decode / base['decode_tok_s']:>14.3f}x")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
