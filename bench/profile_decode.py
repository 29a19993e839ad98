"""Where a forward's time goes: building the graph on the host vs computing it on the device.

    python bench/profile_decode.py MODEL [--rows 1 2 3 4] [--reps 20]

For a one-row decode step and multi-row verify calls (the caches restored after each), prints the
median time to build the lazy graph (Python) and to evaluate it (device), and the same for one head
draft step. Plain decoding hides graph building behind the previous step's compute (mlx-lm's pipelining);
a speculative round has to read its verdict back before building the next round, so on a fast GPU its
host time adds up. This split explains beta(K) there.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from snapshot import Snapshot

from exo.engine import load
from exo.engine.costs import device_name
from exo.engine.models.layers import RollbackArraysCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    engine = load(args.model)
    model, head = engine.model, engine.loaded.head
    vocab = model.text_model.embed_tokens.weight.shape[0]
    tokens = mx.random.randint(0, vocab, (1, args.context), key=mx.random.key(1))
    cache = model.make_cache()
    hidden = model.hidden(tokens, cache)
    mx.eval([c.state for c in cache], hidden)
    snapshot = Snapshot(cache)
    print(f"{engine.loaded.model_id} on {device_name()}, context {args.context}")

    def measure(build, state: Snapshot = snapshot) -> tuple[float, float]:
        builds, evals = [], []
        for i in range(args.reps + 3):
            start = time.perf_counter()
            out = build()
            built = time.perf_counter()
            mx.eval(out)
            done = time.perf_counter()
            if i >= 3:
                builds.append(built - start)
                evals.append(done - built)
            state.restore()
        return 1000 * statistics.median(builds), 1000 * statistics.median(evals)

    base = None
    for rows in args.rows:
        inputs = tokens[:, :rows]

        def verify(inputs=inputs, rows=rows):
            for c in cache:
                if isinstance(c, RollbackArraysCache):
                    c.recording = rows > 1
            model.set_verify_mode("route_locked" if rows > 1 else None, rows > 1 and engine.verify_mode.per_row_attention)
            out = mx.argmax(model.logits(model.hidden(inputs, cache)), axis=-1)
            model.set_verify_mode(None)
            for c in cache:
                if isinstance(c, RollbackArraysCache):
                    c.recording = False
            return out

        build_ms, eval_ms = measure(verify)
        total = build_ms + eval_ms
        base = base or total
        print(f"{rows} row(s): build {build_ms:7.3f} ms + eval {eval_ms:7.3f} ms = {total:7.3f} ms  "
              f"({total / base:.2f}x one row)")
    if head is not None:
        head_cache = KVCache()
        head(model.embed(tokens[:, 1:]), hidden[:, :-1], head_cache)
        mx.eval(head_cache.state)
        head_snapshot = Snapshot([head_cache])
        last = hidden[:, -1:]

        def draft():
            out = head(model.embed(tokens[:, :1]), last, head_cache)
            return mx.argmax(model.logits(out), axis=-1)

        b, e = measure(draft, head_snapshot)
        print(f"draft step: build {b:7.3f} ms + eval {e:7.3f} ms = {b + e:7.3f} ms ({(b + e) / base:.2f}x one row)")


if __name__ == "__main__":
    main()
