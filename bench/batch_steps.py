"""Where a batched plain step's time goes on the host: building its graph, evaluating it, emitting its tokens.

    python bench/batch_steps.py [MODEL] [--sizes 1 8] [--lanes 1 2] [--steps 150] [--linear packed unpacked]
                                [--silu exo mlx] [--repeats 3]

For each batch size B and lane count L: B generations (distinct prompts, EOS ignored, native MTP off) decode
together in a ``BatchLanes`` of L lanes; after 20 warm-up steps, each step is timed in its three phases as
``BatchLanes.step`` runs them (every lane's ``prepare``: the graph built; ``mx.async_eval`` of every lane's
outputs: MLX holds the caller until ~100 ops are left to compute; every lane's ``finish``: the tokens fed to
the step emitted), and the medians are printed with the tokens/s they make.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from exo.engine import GenerationRequest, kernels, load
from exo.engine.batch import BatchLanes
from exo.engine.costs import device_name
from exo.engine.models.layers import CpuLinear, CpuMLP

TEXTS = ("Once upon a time", "The capital of France", "def fibonacci(n):", "In the beginning", "A quick brown fox",
         "Explain gravity", "List three colors", "Write a poem about the sea")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--lanes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--linear", nargs="+", choices=["packed", "unpacked"], default=["packed"],
                        help="CPU: the layers' kernel per row (unpacked: ``kernels.linear``, w transposed per call, as "
                             "before ``linear_packed``); several: alternated per size")
    parser.add_argument("--silu", nargs="+", choices=["exo", "mlx"], default=["exo"],
                        help="CPU: the MLPs' swiglu and the convs' silu on ``kernels.silu`` (exo) or MLX's compiled ops; "
                             "several: alternated")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    engine = load(args.model)
    tokenizer = engine.loaded.tokenizer
    print(f"{args.model} on {device_name()}: median ms per batched plain step, {args.steps} steps")
    print(f"{'B':>3} {'L':>2} {'linear':>8} {'silu':>4} {'build':>7} {'eval':>7} {'emit':>7} {'step':>7} {'tok/s':>7}")
    packed_call = CpuLinear.__call__
    unpacked = kernels.cpu_linear()

    def unpacked_call(self, x):
        return unpacked(x, self["weight"]) if x.dtype == mx.bfloat16 and self["weight"].dtype == mx.bfloat16 \
            else nn.Linear.__call__(self, x)

    silu = kernels.cpu_silu()
    deltas = [m for _, m in engine.loaded.model.named_modules() if getattr(m, "cpu_silu", None) is not None]

    runs = [(size, lanes, linear, act) for size in args.sizes for lanes in args.lanes
            for _ in range(args.repeats) for linear in args.linear for act in args.silu]
    for size, lanes, linear, act in runs:
        CpuLinear.__call__ = packed_call if linear == "packed" else unpacked_call
        CpuMLP.kernel = staticmethod(silu if act == "exo" else swiglu)
        for layer in deltas:
            layer.cpu_silu = silu if act == "exo" else None
        if True:
            batch = BatchLanes(engine, lanes)
            for i in range(size):
                request = GenerationRequest(tokenizer.encode(TEXTS[i % len(TEXTS)]), max_tokens=args.steps + 64,
                                            native_mtp="off", ignore_eos=True)
                run = engine.start(request)
                for _ in run.begin():
                    pass
                batch.add(run)
            for _ in range(20):
                batch.step()
            phases: list[tuple[float, float, float]] = []
            for _ in range(args.steps):
                busy = [lane for lane in batch.lanes if len(lane)]
                for lane in busy:
                    lane.together = len(batch)
                start = time.perf_counter()
                prepared = [lane.prepare() for lane in busy]
                built = time.perf_counter()
                mx.async_eval([a for p in prepared for a in p.arrays])
                evaluated = time.perf_counter()
                for p in prepared:
                    p.finish()
                phases.append((built - start, evaluated - built, time.perf_counter() - evaluated))
            build, run_s, emit = (statistics.median(p[i] for p in phases) for i in range(3))
            step = sum(statistics.median(p) for p in [[sum(x) for x in phases]])
            print(f"{size:>3} {lanes:>2} {linear:>8} {act:>4} {build * 1e3:7.2f} {run_s * 1e3:7.2f} {emit * 1e3:7.2f} {step * 1e3:7.2f} "
                  f"{size / step:7.1f}")
            for lane in batch.lanes:  # end the runs (their caches go)
                lane.cancel_all()


if __name__ == "__main__":
    main()
