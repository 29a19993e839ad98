"""Where the host's time goes building a decode step's graph and a verify call's (Python, before any evaluation).

    python bench/build_profile.py [MODEL] [--context 256] [--rows 1 2 4] [--repeats 50] [--top 30]

On MLX CUDA at 9B a step is host-bound: ~640-740 primitives, ~10 us each to build in Python and as long again to
launch (docs/performance.md). This builds the backbone's forward of R rows of one sequence (R = 1: a plain step;
R > 1: a verify call, ``verify=True``) and the logits, ``--repeats`` times, each time putting the caches back as
they were (``engine.ahead.Snapshot``: nothing is evaluated), and prints per R: ms per build; ms of the same graph
evaluated (one build evaluated, then put back, repeated: building + evaluation, minus the build); and the
functions where the builds spent their own time (cProfile, ``tottime``), the ``--top`` first: what to make cheaper
or fewer. ``--emulate-cuda``: the same builds on a machine without a GPU along MLX CUDA's code paths
(``bench/common.py`` ``emulate_cuda``; the evaluation column then says nothing).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import mlx.core as mx
from common import add_emulate_argument, emulate_cuda  # bench/ is this script's folder

from exo.engine import forward as forward_module
from exo.engine import load
from exo.engine.ahead import Snapshot
from exo.engine.costs import device_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens in the cache before the step")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--top", type=int, default=30)
    add_emulate_argument(parser)
    args = parser.parse_args()
    if args.emulate_cuda:
        emulate_cuda()
    engine = load(args.model)
    if not args.emulate_cuda:
        engine.warmup()  # the verify probe (the verify mode the loop uses), kernels compiled
    forward = engine.forward
    # one evaluation per call (a verify call on the CPU is otherwise evaluated as it is built: not a build's time)
    forward_module.VERIFY_EVAL_EVERY = forward_module.VERIFY_EVAL_EVERY_GPU = 0
    cache = forward.new_cache()
    prompt = mx.array([[(7 * i) % engine.vocab_size for i in range(args.context)]], dtype=mx.uint32)
    mx.eval(forward.hidden(prompt, cache))
    snapshot = Snapshot(cache)
    print(f"{engine.loaded.model_id} on {device_name()}, context {args.context}, verify mode {engine.verify_mode}")
    for rows in args.rows:
        tokens = mx.array([[5] * rows], dtype=mx.uint32)

        def build(rows: int = rows, tokens: mx.array = tokens) -> list[mx.array]:
            hidden = forward.hidden(tokens, cache, verify=rows > 1)
            return [hidden, engine.model.logits(hidden)]

        def builds(n: int, evaluate: bool = False) -> float:
            start = time.perf_counter()
            for _ in range(n):
                out = build()
                if evaluate:
                    mx.eval(*out, *[a for c in cache for a in getattr(c, "state", []) if isinstance(a, mx.array)])
                snapshot.restore()
            return (time.perf_counter() - start) / n

        builds(5, evaluate=not args.emulate_cuda)  # compiled, warm
        built = builds(args.repeats)
        whole = built if args.emulate_cuda else builds(args.repeats, evaluate=True)
        profile = cProfile.Profile()
        profile.enable()
        builds(args.repeats)
        profile.disable()
        print(f"\nrows {rows}: build {1e3 * built:.2f} ms, evaluation {1e3 * (whole - built):.2f} ms "
              f"(build + evaluation {1e3 * whole:.2f} ms); the builds' own time by function ({args.repeats} builds):")
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
