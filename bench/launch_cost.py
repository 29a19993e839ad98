"""What one launch costs the host on MLX CUDA: MLX's own ops against ``mx.fast.cuda_kernel`` calls, and a decode
step's graph building against its evaluation, with exo's quantized GEMV off and on.

    python bench/launch_cost.py [MODEL] [--chain 200] [--repeats 5] [--steps 16] [--rows 1 2 4]

Issue 50's verify kernel (``engine/kernels/cuda_qgemv.py``) reads the weights once for all of a verify's rows,
and each of its launches ran at or under MLX's one-row product on the device; yet a whole decode step ran at
0.654x stock mlx-lm with it. This finds where the host's time goes:

1. ``ops``: a chain of ``--chain`` calls (each call's output the next one's input, [1, 4096] bfloat16 through
   a 4096x4096 4-bit layer where there is one), per call: the Python graph building (``build``) and the
   evaluation (``eval``: the chain's encoding and launches; each op's device time is a few microseconds, so
   this is the host's), median of ``--repeats``. Ops: a tiny MLX op, MLX's quantized product, exo's qgemv as
   the engine calls it, the same kernel called with its arguments prepared once, a tiny custom kernel with
   a small source and with a source as long as qgemv's, and qgemv's source with its comments stripped;
2. ``model``: MODEL's decode forward at ``--rows`` rows of one sequence, ms per step of graph
   building and of evaluation, MLX's products against exo's qgemv (two loads of the model), and the step's
   graph: its primitives, counted by kind (``mx.export_to_dot``). Run on a model of the same layers with tiny
   widths (``make_random_model.py --set hidden_size=256 ...``), the evaluation is the host's alone.
   ``--verify``: rows past one go as verify calls, built as a native-MTP round builds them (the engine's
   probed verify mode: GatedDeltaNet rows recorded, rows alone where the device needs it).

CUDA only (``mx.fast.cuda_kernel``); on another device it says so and stops.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from common import add_common_arguments, report_to, use_device  # bench/ is this script's folder

from exo.engine.costs import device_name
from exo.engine.kernels import cuda_qgemv

TINY = """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < x_shape[1]) { out[i] = x[i]; }
"""


def _strip(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return "\n".join(line.strip() for line in text.splitlines() if line.strip())


def _ops(k: int) -> dict[str, Callable[[mx.array], mx.array]]:
    w = mx.random.normal((k, k), key=mx.random.key(1)).astype(mx.bfloat16) * 0.02
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    mx.eval(wq, s, b)
    kern = cuda_qgemv._kernel()
    stripped = mx.fast.cuda_kernel(name="exo_qgemv_stripped", input_names=["x", "w", "scales", "biases"],
                                   output_names=["out"], source=_strip(cuda_qgemv.SOURCE),
                                   header=_strip(cuda_qgemv.HEADER), ensure_row_contiguous=True)
    tiny = mx.fast.cuda_kernel(name="exo_tiny", input_names=["x"], output_names=["out"], source=TINY)
    pad = "// " + "x" * 78 + "\n"
    long_source = pad * ((len(cuda_qgemv.SOURCE) + len(cuda_qgemv.HEADER)) // len(pad)) + TINY
    tiny_long = mx.fast.cuda_kernel(name="exo_tiny_long", input_names=["x"], output_names=["out"], source=long_source)
    template, grid = cuda_qgemv._launch(1, k, k, 4, 64, mx.bfloat16, s.dtype)
    group = cuda_qgemv.THREADGROUP
    shapes, dtypes = [(1, k)], [mx.bfloat16]

    def raw(x: mx.array, kernel: Any = kern) -> mx.array:
        return kernel(inputs=[x, wq, s, b], template=template, grid=grid, threadgroup=group, output_shapes=shapes,
                      output_dtypes=dtypes)[0]

    def tiny_call(x: mx.array, kernel: Any = tiny) -> mx.array:
        return kernel(inputs=[x], grid=(k, 1, 1), threadgroup=(256, 1, 1), output_shapes=shapes, output_dtypes=dtypes)[0]

    return {
        "mx.add (an MLX op)": lambda x: x + 1,
        "mx.quantized_matmul, one row": lambda x: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64,
                                                                       bits=4),
        "qgemv as the engine calls it": lambda x: cuda_qgemv.qgemv(x, wq, s, b, group_size=64, bits=4),
        "qgemv kernel, arguments prepared": raw,
        "qgemv kernel, comments stripped": lambda x: raw(x, stripped),
        "tiny kernel, short source": tiny_call,
        "tiny kernel, source as long as qgemv's": lambda x: tiny_call(x, tiny_long),
    }


def ops_phase(args: argparse.Namespace) -> dict[str, Any]:
    k = 4096
    rows = {}
    print(f"\n[ops] a chain of {args.chain} calls, [1, {k}] bfloat16, us per call (median of {args.repeats}); "
          f"qgemv source {len(cuda_qgemv.SOURCE) + len(cuda_qgemv.HEADER)} chars, stripped "
          f"{len(_strip(cuda_qgemv.SOURCE)) + len(_strip(cuda_qgemv.HEADER))}")
    print(f"{'op':>42} {'build':>9} {'eval':>9} {'total':>9}")
    for name, op in _ops(k).items():
        x0 = mx.random.normal((1, k), key=mx.random.key(2)).astype(mx.bfloat16)
        mx.eval(op(x0))  # compile / warm
        builds, evals = [], []
        for _ in range(args.repeats + 1):
            mx.synchronize()
            t0 = time.perf_counter()
            y = x0
            for _ in range(args.chain):
                y = op(y)
            t1 = time.perf_counter()
            mx.eval(y)
            mx.synchronize()
            t2 = time.perf_counter()
            builds.append((t1 - t0) / args.chain * 1e6)
            evals.append((t2 - t1) / args.chain * 1e6)
        b, e = statistics.median(builds[1:]), statistics.median(evals[1:])
        rows[name] = dict(build_us=b, eval_us=e)
        print(f"{name:>42} {b:9.1f} {e:9.1f} {b + e:9.1f}")
    return rows


def model_phase(args: argparse.Namespace) -> dict[str, Any]:
    from exo.engine import Engine, EngineConfig, load_checkpoint, resolve_model

    path = resolve_model(args.model).path
    models = {}
    forwards = {}
    gdn_labels = {"1": "", "0": ", gdn graph", "force": ", gdn kernel"}
    variants = [(("MLX's products" if q == "0" else "exo qgemv") + ("" if f == "1" else ", projections apart")
                 + gdn_labels[g] + (", attention kernel" if a == "1" else ""), q, f, g, a)
                for q in ("0", "1") if q in args.qgemv for f in ("1", "0") if f in args.fused
                for g in ("1", "0", "force") if g in args.gdn for a in ("0", "1") if a in args.attn]
    for label, qgemv, fused, gdn, attn in variants:
        os.environ["EXO_QGEMV"], os.environ["EXO_FUSED_INPUTS"], os.environ["EXO_GDN_KERNEL"] = qgemv, fused, gdn
        os.environ["EXO_ATTN_KERNEL"] = attn
        loaded = load_checkpoint(path)
        models[label] = loaded.model
        if args.verify:  # verify calls as the engine builds them, in the mode its probe finds on this device
            engine = Engine(loaded, EngineConfig())
            engine.verify_mode  # noqa: B018 - probes once, sets engine.forward.verify
            forwards[label] = engine.forward
        print(f"[model] {label}: qgemv {len(loaded.qgemv)} shapes "
              f"{'ok' if all(v.startswith('ok') for v in loaded.qgemv.values()) else loaded.qgemv}; "
              f"fused inputs {loaded.fused or 'off'}; gdn kernel {loaded.gdn or 'off'}; attention kernel "
              f"{loaded.attn or 'off'}", flush=True)
    vocab = int(next(iter(models.values())).text_model.embed_tokens.weight.shape[0])
    prompt = mx.random.randint(0, vocab, (1, 256), key=mx.random.key(3))
    results: dict[str, Any] = {}
    print(f"\n[model] decode forward of one sequence at R rows, ms per step (median of {args.repeats} x "
          f"{args.steps} steps): graph building, evaluation")
    print(f"{'rows':>5} {'products':>44} {'build':>8} {'eval':>8} {'total':>8}    ops (primitives in the step's graph)")
    for R in args.rows:
        caches = {}
        for label, model in models.items():
            caches[label] = model.make_cache()
            mx.eval(model.logits(model.hidden(prompt, caches[label])[:, -1:]))
        token = mx.zeros((1, R), dtype=mx.int32)
        times: dict[str, tuple[list[float], list[float]]] = {label: ([], []) for label in models}
        for rep in range(args.repeats + 1):
            for label, model in models.items():
                cache = caches[label]
                builds, evals = 0.0, 0.0
                for _ in range(args.steps):
                    mx.synchronize()
                    t0 = time.perf_counter()
                    out = _step(model, forwards.get(label), token, cache)
                    t1 = time.perf_counter()
                    mx.eval(out, [c.state for c in cache])
                    mx.synchronize()
                    t2 = time.perf_counter()
                    builds += t1 - t0
                    evals += t2 - t1
                    if label in forwards and R > 1:
                        forwards[label].rollback(cache, R, R)  # every row kept: the next call goes on from there
                if rep:  # the first is a warm-up (kernels built for R rows)
                    times[label][0].append(builds / args.steps * 1e3)
                    times[label][1].append(evals / args.steps * 1e3)
        for label, model in models.items():
            b, e = statistics.median(times[label][0]), statistics.median(times[label][1])
            kinds = _op_count(_step(model, forwards.get(label), token, caches[label]), caches[label])
            if label in forwards and R > 1:
                forwards[label].rollback(caches[label], R, R)
            results[f"{label} R={R}"] = dict(build_ms=b, eval_ms=e, ops=sum(kinds.values()), kinds=kinds)
            top = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:args.kinds])
            print(f"{R:5d} {label:>44} {b:8.2f} {e:8.2f} {b + e:8.2f} {sum(kinds.values()):6d} ops: {top}")
            for kind, layer_kinds in ({} if label in forwards else _layer_counts(model, caches[label], R)).items():
                results[f"{label} R={R}"][kind] = layer_kinds
                every = ", ".join(f"{k} {v}" for k, v in sorted(layer_kinds.items(), key=lambda kv: -kv[1]))
                print(f"{'':5} {kind:>44} {'':8} {'':8} {'':8} {sum(layer_kinds.values()):6d} ops: {every}")
        del caches
    return results


def _op_count(out: mx.array, cache: list[Any]) -> dict[str, int]:
    """The primitives of ``out``'s graph (with the caches' new states) by kind, from ``mx.export_to_dot``;
    leaves the graph evaluated."""
    states = [a for c in cache for a in (c.state if isinstance(c.state, (list, tuple)) else [c.state])
              if isinstance(a, mx.array)]
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, out, *states)
        kinds = Counter(re.findall(r'label\s*=\s*"([A-Za-z_][A-Za-z0-9_]*)', f.read()))
    mx.eval(out, states)
    return dict(kinds)


def _step(model: Any, forward: Any, token: mx.array, cache: list[Any]) -> mx.array:
    """A decode forward of ``token``'s rows and their logits; with ``forward`` (``--verify``), rows past one go
    as a verify call (GatedDeltaNet rows recorded, the probed verify mode), as a native-MTP round's is."""
    if forward is not None and token.shape[1] > 1:
        return model.logits(forward.hidden(token, cache, verify=True))
    return model.logits(model.hidden(token, cache))


def _layer_counts(model: Any, cache: list[Any], rows: int) -> dict[str, dict[str, int]]:
    """The primitives of one GatedDeltaNet layer's and one attention layer's call (with its cache's new state) on
    ``rows`` rows of hidden states, by kind (the first layer of each kind; its cache moves on by ``rows``)."""
    out: dict[str, dict[str, int]] = {}
    h = mx.zeros((1, rows, model.hidden_size), dtype=mx.bfloat16)
    for i, layer in enumerate(model.stage_layers):
        kind = "gated delta layer" if layer.is_linear else "attention layer"
        if kind not in out:
            out[kind] = _op_count(layer(h, mask=None, cache=cache[i]), [cache[i]])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--chain", type=int, default=200)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--phases", nargs="+", default=["ops", "model"], choices=["ops", "model"])
    parser.add_argument("--qgemv", nargs="+", default=["0", "1"], choices=["0", "1"],
                        help="model phase: EXO_QGEMV values to load the model with")
    parser.add_argument("--fused", nargs="+", default=["1"], choices=["0", "1"],
                        help="model phase: EXO_FUSED_INPUTS values to load the model with (the layers' input "
                             "projections as one product, or apart: models.fused_inputs)")
    parser.add_argument("--gdn", nargs="+", default=["1"], choices=["1", "0", "force"],
                        help="model phase: EXO_GDN_KERNEL values to load the model with (1: exo's GatedDeltaNet "
                             "step kernel where its load-time check passes; force: wherever its rows equal their "
                             "steps; 0: the compiled row graph)")
    parser.add_argument("--attn", nargs="+", default=["0"], choices=["0", "1"],
                        help="model phase: EXO_ATTN_KERNEL values to load the model with (exo's decode-attention "
                             "kernel where its load-time check passes, or MLX's attention)")
    parser.add_argument("--kinds", type=int, default=12, help="model phase: primitive kinds listed per step")
    parser.add_argument("--verify", action="store_true",
                        help="model phase: rows past one as verify calls (the engine's probed mode), not a forward")
    args = parser.parse_args()
    use_device(args.device)
    if not cuda_qgemv.on_cuda():
        if "ops" in args.phases or "1" in args.qgemv:  # (cuda_kernel calls; qgemv is a CUDA kernel)
            print(f"launch_cost: the ops phase and --qgemv 1 are MLX CUDA only (this is {device_name()}); "
                  "the model phase runs anywhere: --phases model --qgemv 0", file=sys.stderr)
            raise SystemExit(0)
    with report_to(args.json) as report:
        print(f"device: {device_name()} (MLX {mx.__version__})")
        if "ops" in args.phases:
            report["ops"] = ops_phase(args)
        if "model" in args.phases:
            report["model"] = model_phase(args)


if __name__ == "__main__":
    main()
