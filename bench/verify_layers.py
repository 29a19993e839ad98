"""What a verify call's rows cost next to a decode step, layer kind by layer kind: where a round's extra cost sits.

    python bench/verify_layers.py MODEL [--rows 2 3 4] [--context 256 2048] [--calls 20] [--repeats 5]

On the model's first GatedDeltaNet layer, first attention layer and the output projection, after a random
context of each ``--context`` positions: microseconds per call (``calls`` in one evaluation, median of
``repeats``) of a decode step (one row) and of a verify call of T rows as the engine runs it (its probed verify
mode: attention per row where this device needs it, GatedDeltaNet recording its states), each call's caches
rolled back after it; T rows over one row is what that layer kind adds to a round. For attention also the same
rows attended as one block (``block``: what per-row attention costs over it). A decoder layer's call includes its
norms and MLP (an MoE block's routing locked as a verify call locks it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from common import add_common_arguments, report_to, use_device  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from exo.engine import load  # noqa: E402
from exo.engine.costs import device_name  # noqa: E402
from exo.engine.models.layers import RollbackArraysCache  # noqa: E402
from exo.engine.verify import verify_logits  # noqa: E402


def per_call_us(fn, calls: int, repeats: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            mx.eval(fn())
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--context", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    use_device(args.device)
    engine = load(args.model)
    model = engine.model
    mode = engine.verify_mode
    layers = model.stage_layers
    dtype = layers[0].input_layernorm.weight.dtype
    picked = [(name, next((layer for layer in layers if layer.is_linear is linear), None))
              for name, linear in (("GatedDeltaNet layer", True), ("attention layer", False))]
    with report_to(args.json) as report:
        print(f"{engine.loaded.model_id} on {device_name()}: verify mode {mode}; us per call, median of "
              f"{args.repeats} x {args.calls} calls")
        print(f"{'part':<22} {'context':>7} {'1 row':>8} " + " ".join(f"{f'{t} rows':>8} {'x1':>5}" for t in args.rows)
              + "   block (attention: rows as one block)")
        report["rows"] = []
        key = mx.random.key(3)
        for context in args.context:
            prefix = (mx.random.normal((1, context, model.hidden_size), key=key) * 0.5).astype(dtype)
            rows = (mx.random.normal((1, max(args.rows), model.hidden_size), key=mx.random.split(key)[0])
                    * 0.5).astype(dtype)
            for name, layer in picked:
                if layer is None:
                    continue
                cache = RollbackArraysCache() if layer.is_linear else KVCache()
                mx.eval(layer(prefix, mask=None if layer.is_linear else "causal", cache=cache))

                saved = (cache[0], cache[1]) if isinstance(cache, RollbackArraysCache) else None

                def timed(t: int, per_row: bool = True, layer=layer, cache=cache, saved=saved, rows=rows) -> float:
                    def once():
                        verify = t > 1
                        recorded = isinstance(cache, RollbackArraysCache)
                        if recorded:
                            cache.recording = verify
                        if verify:
                            model.set_verify_mode(mode.moe, mode.per_row_attention and per_row)
                        try:
                            out = layer(rows[:, :t], mask=None if layer.is_linear or t == 1 else "causal", cache=cache)
                            mx.eval(out, *(cache.pending_arrays() if recorded else []))
                        finally:
                            model.set_verify_mode(None, False)
                            if recorded:
                                cache.recording = False
                        if recorded:  # back to the context's state and window
                            cache.discard()
                            cache[0], cache[1] = saved
                        else:
                            cache.trim(t)
                        return out

                    return per_call_us(once, args.calls, args.repeats)

                one = timed(1)
                line = f"{name:<22} {context:>7} {one:>8.1f}"
                entry = {"part": name, "context": context, "one_row_us": one, "rows_us": {}, "block_us": {}}
                for t in args.rows:
                    us = timed(t)
                    entry["rows_us"][t] = us
                    line += f" {us:>8.1f} {us / one:>5.2f}"
                if not layer.is_linear and mode.per_row_attention:
                    for t in args.rows:
                        entry["block_us"][t] = timed(t, per_row=False)
                    line += "   " + " ".join(f"{t}: {entry['block_us'][t]:.1f}" for t in args.rows)
                print(line)
                report["rows"].append(entry)
        head = model.output_projection()
        hidden = rows[:, :1]
        one = per_call_us(lambda: model.logits(hidden), args.calls, args.repeats)
        line = f"{'output projection':<22} {'-':>7} {one:>8.1f}"
        for t in args.rows:
            us = per_call_us(lambda t=t: verify_logits(model, rows[:, :t], mode), args.calls, args.repeats)
            line += f" {us:>8.1f} {us / one:>5.2f}"
        print(line + f"   ({type(head).__name__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
