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

``--alone`` also times a round's parts alone around every request: its (K+1)-row verify call and K draft
steps and the head's catch-up on the rows the round before kept (``exo bench``'s parts), after as many tokens
as the request's mean context, just before and just after the request (averaged). Per depth it prints the
medians over requests of ``inside``: the round's drafts and verify call as the loop runs them (draft_build +
verify_build + device_wait) over those parts alone, and ``glue``: the whole round over them. The phase
timer's rounds against parts timed seconds apart, request by request: what ``exo bench``'s end-to-end ratio
measures, without the request's own start and end.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from exo.engine import GenerationRequest, load
from exo.engine.bench import DEFAULT_PROMPTS, OUTSIDE_PHASES, catch_up_alone, encode_prompt, parts_alone
from exo.engine.costs import device_name

PHASES = ("draft_build", "verify_build", "device_wait", *OUTSIDE_PHASES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--alone", action="store_true", help="time each round's parts alone around every request")
    args = parser.parse_args()
    engine = load(args.model)
    engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    engine.config = dataclasses.replace(engine.config, profile_rounds=True)
    prompts = [encode_prompt(engine, p, raw=True) for p in DEFAULT_PROMPTS]
    per: dict[int, list[dict[str, float]]] = {k: [] for k in args.depths}
    tps: dict[int, list[float]] = {k: [] for k in args.depths}
    inside: dict[int, list[float]] = {k: [] for k in args.depths}
    glue: dict[int, list[float]] = {k: [] for k in args.depths}

    def run(prompt: list[int], k: int, max_tokens: int):
        return engine.complete(GenerationRequest(prompt, max_tokens=max_tokens, native_mtp="on", mtp_k=k)).stats

    for k in args.depths:  # warm-up: every path compiled once, over a whole request
        run(max(prompts, key=len), k, args.max_tokens)
    turn = 0
    for _ in range(args.repeats):
        for prompt in prompts:
            order = args.depths[turn % len(args.depths):] + args.depths[: turn % len(args.depths)]
            turn += 1
            for k in order:
                context = len(prompt) + args.max_tokens // 2  # the request's mean context
                before = parts_alone(engine, k, context) if args.alone else None
                stats = run(prompt, k, args.max_tokens)
                if stats.rounds > 1 and stats.profile_ms:
                    # ("between" is counted from the second round on)
                    phases = {p: stats.profile_ms.get(p, 0.0) / (stats.rounds - (p == "between")) for p in PHASES}
                    per[k].append(phases)
                    tps[k].append(stats.decode_tokens_per_s)
                    if before is not None:
                        after = parts_alone(engine, k, context)
                        assert after is not None
                        rows = 1 + stats.accepted_tokens / stats.rounds
                        alone_ms = 1e3 * ((before + after) / 2 + catch_up_alone(engine, k, rows, context))
                        inside[k].append(sum(phases[p] for p in PHASES if p not in OUTSIDE_PHASES) / alone_ms)
                        glue[k].append(sum(phases.values()) / alone_ms)
    print(f"{engine.loaded.model_id} on {device_name()}: ms per round, median over {args.repeats * len(prompts)} "
          f"requests of {args.max_tokens} tokens")
    print(f"{'K':>3} " + " ".join(f"{p:>12}" for p in PHASES) + f" {'total':>8} {'outside':>8} {'tok/s':>8}"
          + (f" {'inside':>7} {'(q1-q3)':>13} {'glue':>7} {'(q1-q3)':>13}" if args.alone else ""))
    for k in args.depths:
        rows = per[k]
        medians = [statistics.median(r[p] for r in rows) for p in PHASES]
        total = statistics.median(sum(r.values()) for r in rows)
        outside = statistics.median(sum(r[p] for p in OUTSIDE_PHASES) / sum(r.values()) for r in rows)
        line = (f"{k:>3} " + " ".join(f"{m:>12.3f}" for m in medians) + f" {total:>8.3f} {outside:>7.1%} "
                f"{statistics.median(tps[k]):>8.1f}")
        if inside[k]:
            line += f" {_spread(inside[k])} {_spread(glue[k])}"
        print(line)


def _spread(values: list[float]) -> str:
    """The median of ``values`` and its quartiles."""
    if len(values) < 2:
        return f"{values[0]:>7.3f} {'':>13}"
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return f"{median:>7.3f} ({q1:.3f}-{q3:.3f})"


if __name__ == "__main__":
    main()
