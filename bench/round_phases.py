"""Where a speculative round's time goes, phase by phase.

    python bench/round_phases.py [MODEL] [--depths 1 2 3] [--max-tokens 128] [--repeats 3]

Runs greedy requests at each fixed depth, interleaved in one process (each prompt rotates the order), with
the engine's phase timer (``EngineConfig.profile_rounds``, as EXO_ENGINE_PROFILE=1), and prints per round (median over requests, ms):
- ``draft_build``: the head taking in the rows the round before kept and drafting K tokens (built, and on
  the CPU partly computed; on MLX CUDA the kernels launch at the evaluation);
- ``verify_build``: the (K+1)-row verify call and its verdict, built (on the CPU evaluated two layers at a
  time as it is built);
- ``device_wait``: the one evaluation: on MLX CUDA the host launching every kernel of the drafts and the
  verify call and waiting for the last (the device's work);
- ``rollback``: reading the verdict back, acceptance, caches rolled back, the depth policy's bookkeeping;
- ``emit``: the tokens into the output (detokenizing, stop strings);
- ``between``: from the end of one round to the next (the caller reading its chunks, the policy's choice).
``outside`` is the share of the round spent outside its verify call and drafts (rollback + emit + between):
the glue a round adds to its parts.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from exo.engine import GenerationRequest, load
from exo.engine.bench import DEFAULT_PROMPTS, OUTSIDE_PHASES, encode_prompt
from exo.engine.costs import device_name

PHASES = ("draft_build", "verify_build", "device_wait", *OUTSIDE_PHASES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engine = load(args.model)
    engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    engine.config = dataclasses.replace(engine.config, profile_rounds=True)
    prompts = [encode_prompt(engine, p, raw=True) for p in DEFAULT_PROMPTS]
    per: dict[int, list[dict[str, float]]] = {k: [] for k in args.depths}
    tps: dict[int, list[float]] = {k: [] for k in args.depths}

    def run(prompt: list[int], k: int, max_tokens: int):
        return engine.complete(GenerationRequest(prompt, max_tokens=max_tokens, native_mtp="on", mtp_k=k)).stats

    for k in args.depths:  # warm-up: every path compiled once
        run(prompts[0], k, 16)
    turn = 0
    for _ in range(args.repeats):
        for prompt in prompts:
            order = args.depths[turn % len(args.depths):] + args.depths[: turn % len(args.depths)]
            turn += 1
            for k in order:
                stats = run(prompt, k, args.max_tokens)
                if stats.rounds > 1 and stats.profile_ms:
                    # ("between" is counted from the second round on)
                    per[k].append({p: stats.profile_ms.get(p, 0.0) / (stats.rounds - (p == "between"))
                                   for p in PHASES})
                    tps[k].append(stats.decode_tokens_per_s)
    print(f"{engine.loaded.model_id} on {device_name()}: ms per round, median over {args.repeats * len(prompts)} "
          f"requests of {args.max_tokens} tokens")
    print(f"{'K':>3} " + " ".join(f"{p:>12}" for p in PHASES) + f" {'total':>8} {'outside':>8} {'tok/s':>8}")
    for k in args.depths:
        rows = per[k]
        medians = [statistics.median(r[p] for r in rows) for p in PHASES]
        total = statistics.median(sum(r.values()) for r in rows)
        outside = statistics.median(sum(r[p] for p in OUTSIDE_PHASES) / sum(r.values()) for r in rows)
        print(f"{k:>3} " + " ".join(f"{m:>12.3f}" for m in medians) + f" {total:>8.3f} {outside:>7.1%} "
              f"{statistics.median(tps[k]):>8.1f}")


if __name__ == "__main__":
    main()
