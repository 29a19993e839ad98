"""How far a multi-row verify call's logits are from a one-row decode step's, on this device.

    python bench/batch_invariance.py MODEL [--steps 64] [--rows 2 4]

Walks a greedy plain-decoding trajectory; at each position computes the next-token logits twice on the
same cache state: as a one-row decode step, and as row 0 of an R-row verify call (as the engine runs it:
GatedDeltaNet recording, MoE routes locked). Prints the largest relative difference
max|dlogit| / max(|top1|, 1), how often the argmax differs, and the relative top-2 gap at those
positions. On the CPU both are bitwise equal; on GPUs they are not, which is what the engine's greedy
near-tie guard (EngineConfig.greedy_tie_margin) is calibrated against.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from snapshot import Snapshot

from exo.engine import load
from exo.engine.bench import encode_prompt
from exo.engine.costs import device_name
from exo.engine.models.layers import RollbackArraysCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    engine = load(args.model)
    model = engine.model
    prompt = encode_prompt(engine, "def fibonacci(n):", raw=True)
    cache = model.make_cache()
    hidden = model.hidden(mx.array(prompt)[None], cache)
    token = mx.argmax(model.logits(hidden[:, -1:])[0, -1])
    mx.eval(token, [c.state for c in cache])
    worst = {r: 0.0 for r in args.rows}
    flips = {r: [] for r in args.rows}
    gaps = []
    for _ in range(args.steps):
        snapshot = Snapshot(cache)
        one = model.logits(model.hidden(token.reshape(1, 1), cache))[0, -1].astype(mx.float32)
        mx.eval(one)
        top = mx.topk(one, 2)
        first = mx.max(top).item()
        gap = (first - mx.min(top).item()) / max(abs(first), 1.0)
        gaps.append(gap)
        snapshot.restore()
        for rows in args.rows:
            batch = mx.concatenate([token.reshape(1, 1), mx.zeros((1, rows - 1), dtype=token.dtype)], axis=1)
            for c in cache:
                if isinstance(c, RollbackArraysCache):
                    c.recording = True
            model.set_verify_mode(engine.config.moe_verify, engine.verify_mode.per_row_attention)
            many = model.logits(model.hidden(batch, cache))[0, 0].astype(mx.float32)
            model.set_verify_mode(None)
            mx.eval(many)
            snapshot.restore()
            rel = mx.max(mx.abs(many - one)).item() / max(abs(first), 1.0)
            worst[rows] = max(worst[rows], rel)
            if mx.argmax(many).item() != mx.argmax(one).item():
                flips[rows].append(gap)
        # Advance along the plain trajectory.
        hidden = model.hidden(token.reshape(1, 1), cache)
        token = mx.argmax(model.logits(hidden)[0, -1])
        mx.eval(token, [c.state for c in cache])
    gaps.sort()
    print(f"{engine.loaded.model_id} on {device_name()}, {args.steps} positions")
    print(f"relative top-2 gap of the one-row logits: min {gaps[0]:.2e}, 5% {gaps[len(gaps) // 20]:.2e}, "
          f"median {gaps[len(gaps) // 2]:.2e}")
    for rows in args.rows:
        print(f"{rows} rows: max relative |dlogit| {worst[rows]:.2e}; argmax flips {len(flips[rows])}"
              + (f" at gaps {', '.join(f'{g:.1e}' for g in flips[rows])}" if flips[rows] else ""))


if __name__ == "__main__":
    main()
