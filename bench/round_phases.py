"""Where a speculative round's time goes, phase by phase; what a round costs in plain steps and earns, at the
head's own acceptance or at chosen ones (a replayed continuation).

    python bench/round_phases.py [MODEL] [--depths 1 2 3] [--max-tokens 128] [--repeats 3]
    python bench/round_phases.py MODEL --replay 0.6,0.8,0.9 [--repeats 1] [--max-tokens 96]

Runs greedy requests of plain decoding, each fixed depth and adaptive depth, interleaved in one process (each
prompt rotates the order), with the engine's phase timer (``EngineConfig.profile_rounds``, as
EXO_ENGINE_PROFILE=1), and prints per depth per round (median over requests, ms):
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

Then per configuration: tokens/s, its ratio to plain decoding in the same run (median of per-prompt ratios),
a round's time over a plain token's (``round cost``, in plain steps of this run: the figure the targets on a
round's cost are stated in), tokens per round, the k histogram (adaptive) and how many requests gave plain
decoding's tokens exactly.

The warm-up's round costs (in pipelined plain steps, what the depth policy starts from) and exo's own kernels'
load-time checks are printed before the tables.

``--replay A,B,...``: the head's drafts are replaced by the plain greedy continuation of each prompt, right at
each position with probability A (``engine/replay.py``; the head still runs: its cost is the real one), so a
random-weight checkpoint of a real shape (``bench/make_random_model.py``) is measured at real acceptance: every
table once per acceptance, in one run. Adaptive's acceptance estimate starts anew at each, seeded by the engine's
warm acceptance on the first prompt's replayed continuation (as a fresh engine's warm-up seeds it; then one
unmeasured request), its round costs carry over.

``--alone`` also times a round's parts alone around every request: its (K+1)-row verify call and K draft
steps and the head's catch-up on the rows the round before kept (``exo bench``'s parts), after as many tokens
as the request's mean context, just before and just after the request (averaged). Per depth it prints the
medians over requests of ``inside``: the round's drafts and verify call as the loop runs them (draft_build +
verify_build + device_wait) over those parts alone, and ``glue``: the whole round over them.

The engine's warm-up (the verify probe, the round costs, the head's warm acceptance) is timed phase by phase
and printed first (``Engine.warmup_seconds``), then again on a second engine of the same model, whose kernels
are compiled by then: the difference is compiling.

``--verify-eval-every N ...``: each fixed depth once per N, its verify calls evaluated every N layers as they are
built (``engine/forward.py``: 0 is one evaluation, the GPU's default; the device computes the first layers while the
host builds the rest), named ``k=K/eN``: whether a round's ``verify_build`` (the host building the graph while the
device waits) hides behind the device's work. Adaptive runs the default. (``EXO_VERIFY_EVAL_EVERY``, when set,
overrides every setting.)

``--census``: instead of timing, one request per configuration with every ``mx.eval`` / ``mx.async_eval`` counted: the
primitives each evaluates (``mx.export_to_dot``), per plain step or round, by the engine function
that evaluated them and by kind (on MLX CUDA the host builds and launches each: a round's primitives beyond a plain
step's are what it costs more on a host-bound device).

``--ahead on off``: each fixed depth with and without the next round built while a round computes
(``engine/ahead.py``, off by default), named ``k=K/a1`` and ``k=K/a0``: a round built ahead shows its build in the
round before (``draft_build`` and ``verify_build`` near 0 where it ran). ``chain``: chained rounds, named ``k=K/ac``
(each built on the round before's verdict as the device holds it and launched before the host reads it: its build
and launch fall inside the round before's ``device_wait``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from exo.engine import Engine, GenerationRequest, load
from exo.engine import forward as forward_module
from exo.engine.adaptive import AcceptanceTracker
from exo.engine.bench import DEFAULT_PROMPTS, OUTSIDE_PHASES, catch_up_alone, encode_prompt, parts_alone
from exo.engine.costs import device_name
from exo.engine.replay import ReplayDrafter

PROMPT_SITES = ("prefill", "prefill_with", "first_token", "_fed")  # the prompt's evaluations (--census: apart)
PHASES = ("draft_build", "verify_build", "device_wait", *OUTSIDE_PHASES)


_AHEAD_NAMES = {"on": "1", "off": "0", "chain": "c"}  # --ahead's settings in a configuration's name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--alone", action="store_true", help="time each round's parts alone around every request")
    parser.add_argument("--replay", type=lambda s: [float(a) for a in s.split(",")], default=None,
                        metavar="A,B,...", help="acceptance rates to replay the plain continuation at")
    parser.add_argument("--no-adaptive", action="store_true", help="leave adaptive depth out")
    parser.add_argument("--ahead", choices=["on", "off", "chain"], nargs="+", default=None,
                        help="each fixed depth once per setting: the next round built while a round computes "
                        "(engine/ahead.py) or not, or chained rounds: named k=K/a1, k=K/a0, k=K/ac")
    parser.add_argument("--verify-eval-every", type=int, nargs="+", default=None, metavar="N",
                        help="each fixed depth once per setting: a verify call evaluated every N layers as it is "
                        "built (0: one evaluation; engine/forward.py), named k=K/eN")
    parser.add_argument("--census", action="store_true",
                        help="count the primitives every evaluation runs, per plain step or round (no timing)")
    args = parser.parse_args()
    engine = load(args.model)
    engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    engine.config = dataclasses.replace(engine.config, profile_rounds=True)
    prompts = [encode_prompt(engine, p, raw=True) for p in DEFAULT_PROMPTS]
    adaptive = not args.no_adaptive
    configs: list[tuple[str, int | None]] = [("plain", 0)]
    evals: dict[str, int] = {}  # config -> its verify calls' evaluation interval (the rest: the engine's default)
    aheads: dict[str, str] = {}  # config -> rounds built ahead or not (the rest: the engine's default)
    for k in args.depths:
        for every in args.verify_eval_every or [None]:
            for ahead in args.ahead or [None]:
                name = f"k={k}" + ("" if every is None else f"/e{every}") + ("" if ahead is None else
                                                                              f"/a{_AHEAD_NAMES[ahead]}")
                configs.append((name, k))
                if every is not None:
                    evals[name] = every
                if ahead is not None:
                    aheads[name] = ahead
    if adaptive:
        configs.append(("adaptive", None))
    default_every = (forward_module.VERIFY_EVAL_EVERY, forward_module.VERIFY_EVAL_EVERY_GPU)

    def run(prompt: list[int], k: int | None, max_tokens: int, name: str = ""):
        mode = "off" if k == 0 else "on"
        every = evals.get(name)
        forward_module.VERIFY_EVAL_EVERY, forward_module.VERIFY_EVAL_EVERY_GPU = (
            default_every if every is None else (every, every))
        config = engine.config
        if name in aheads:
            engine.config = dataclasses.replace(config, round_ahead=aheads[name])
        try:
            return engine.complete(GenerationRequest(prompt, max_tokens=max_tokens, native_mtp=mode,
                                                     mtp_k=None if k == 0 else k))
        finally:
            forward_module.VERIFY_EVAL_EVERY, forward_module.VERIFY_EVAL_EVERY_GPU = default_every
            engine.config = config

    # The engine's warm-up first (its phases printed), then every path compiled once over a whole request.
    if adaptive:
        engine.warmup()
        print(f"{engine.loaded.model_id} on {device_name()}: warm-up "
              + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in engine.warmup_seconds.items()))
        # The same warm-up on a second engine of the model: every kernel compiled by now (MLX CUDA compiles each
        # at its first launch), what is left is the warm-up's own work.
        again = Engine(engine.loaded, engine.config)
        again.warmup()
        print("warm-up again, kernels compiled: "
              + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in again.warmup_seconds.items()))
        costs = engine.costs().in_pipelined_steps()
        print("warm-up round costs in pipelined plain steps: " + ", ".join(
            f"k={k} {costs.round_cost(k):.2f}" for k in range(1, costs.max_k + 1))
              + f" (plain step alone {1e3 * (engine.costs().plain_s or 0):.2f} ms, pipelined "
              f"{1e3 * (costs.plain_s or 0):.2f} ms)")
    print(f"verify mode: {engine.verify_mode}")
    print("exo's own kernels: " + ("; ".join(f"{k}: {v}" for k, v in {**engine.loaded.qgemv, **engine.loaded.padded, **engine.loaded.gdn}.items())
                                  or "none"))
    print("probe: " + ", ".join(f"{name}={value}" for name, value in engine.verify_probe.items()))
    longest = max(prompts, key=len)
    if args.census:
        census(configs, lambda k, name: run(longest, k, args.max_tokens, name), args.max_tokens)
        return
    plain_tokens = {}
    for prompt in prompts:  # the plain greedy continuations (replayed) and the reference for identity
        plain_tokens[tuple(prompt)] = run(prompt, 0, args.max_tokens).token_ids
    for name, k in configs[1:]:
        if k is not None:
            run(longest, k, args.max_tokens, name)
    for acceptance in args.replay or [None]:
        if acceptance is not None:
            engine.replay = ReplayDrafter(plain_tokens, acceptance, engine.vocab_size, seed=1)
            policy = engine._policy  # noqa: SLF001 - a fresh acceptance estimate per replayed rate (costs kept)
            if policy is not None:
                # as a fresh engine's warm-up seeds it, here on the replayed continuation at this rate
                policy.tracker = AcceptanceTracker(policy.max_k)
                warm = engine.warm_acceptance()
                assert warm is not None
                policy.tracker.absorb(warm)
            if adaptive:
                run(longest, None, args.max_tokens)  # unmeasured: adaptive learns this rate
        measure(engine, args, configs, prompts, plain_tokens, run, acceptance)
    engine.replay = None


def measure(engine, args, configs, prompts, plain_tokens, run, acceptance: float | None) -> None:
    names = [name for name, _ in configs]
    per: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    tps: dict[str, list[float]] = {n: [] for n in names}
    rounds_ms: dict[str, list[float]] = {n: [] for n in names}
    tokens_per_round: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    identical: Counter[str] = Counter()
    requests: Counter[str] = Counter()
    histogram: dict[str, Counter[int]] = {n: Counter() for n in names}
    inside: dict[str, list[float]] = {n: [] for n in names}
    glue: dict[str, list[float]] = {n: [] for n in names}
    turn = 0
    for _ in range(args.repeats):
        for prompt in prompts:
            order = configs[turn % len(configs):] + configs[: turn % len(configs)]
            turn += 1
            speeds: dict[str, float] = {}
            for name, k in order:
                context = len(prompt) + args.max_tokens // 2  # the request's mean context
                alone = args.alone and k not in (0, None)
                before = parts_alone(engine, k, context) if alone else None
                result = run(prompt, k, args.max_tokens, name)
                stats = result.stats
                requests[name] += 1
                identical[name] += result.token_ids == plain_tokens[tuple(prompt)]
                tps[name].append(stats.decode_tokens_per_s)
                speeds[name] = stats.decode_tokens_per_s
                histogram[name].update(stats.k_histogram)
                if k != 0 and stats.rounds > 1 and stats.profile_ms:
                    # ("between" is counted from the second round on)
                    phases = {p: stats.profile_ms.get(p, 0.0) / (stats.rounds - (p == "between")) for p in PHASES}
                    per[name].append(phases)
                    rounds_ms[name].append(sum(phases.values()))
                    tokens_per_round[name].append(1 + stats.accepted_tokens / stats.rounds)
                    if before is not None:
                        after = parts_alone(engine, k, context)
                        assert after is not None
                        rows = 1 + stats.accepted_tokens / stats.rounds
                        alone_ms = 1e3 * ((before + after) / 2 + catch_up_alone(engine, k, rows, context))
                        inside[name].append(sum(phases[p] for p in PHASES if p not in OUTSIDE_PHASES) / alone_ms)
                        glue[name].append(sum(phases.values()) / alone_ms)
            for name in names:
                if speeds.get("plain"):
                    ratios[name].append(speeds[name] / speeds["plain"])
    rate = "the head's own" if acceptance is None else f"{acceptance:.2f} (replayed)"
    print(f"\n{engine.loaded.model_id} on {device_name()}, acceptance {rate}: ms per round, median over "
          f"{args.repeats * len(prompts)} requests of {args.max_tokens} tokens")
    print(f"{'config':>8} " + " ".join(f"{p:>12}" for p in PHASES) + f" {'total':>8} {'outside':>8}"
          + (f" {'inside':>7} {'(q1-q3)':>13} {'glue':>7} {'(q1-q3)':>13}" if args.alone else ""))
    for name in names:
        rows = per[name]
        if not rows:
            continue
        medians = [statistics.median(r[p] for r in rows) for p in PHASES]
        total = statistics.median(sum(r.values()) for r in rows)
        outside = statistics.median(sum(r[p] for p in OUTSIDE_PHASES) / sum(r.values()) for r in rows)
        line = f"{name:>8} " + " ".join(f"{m:>12.3f}" for m in medians) + f" {total:>8.3f} {outside:>7.1%}"
        if inside[name]:
            line += f" {_spread(inside[name])} {_spread(glue[name])}"
        print(line)
    plain_ms = 1e3 / statistics.median(tps["plain"])
    print(f"{'config':>8} {'tok/s':>8} {'vs plain':>9} {'(q1-q3)':>13} {'round ms':>9} {'round cost':>10} "
          f"{'tok/round':>9} {'identical':>9}  k-histogram")
    for name in names:
        cost = statistics.median(rounds_ms[name]) / plain_ms if rounds_ms[name] else None
        per_round = statistics.median(tokens_per_round[name]) if tokens_per_round[name] else None
        print(f"{name:>8} {statistics.median(tps[name]):>8.1f} {_spread(ratios[name], 9)} "
              f"{statistics.median(rounds_ms[name]) if rounds_ms[name] else plain_ms:>9.2f} "
              f"{cost if cost is not None else 1.0:>10.3f} {per_round if per_round is not None else 1.0:>9.2f} "
              f"{identical[name]:>4}/{requests[name]:<4}  {dict(sorted(histogram[name].items()))}")
    fixed = [n for n in names if n not in ("plain", "adaptive")]
    if "adaptive" in names and fixed:
        best = max(["plain", *fixed], key=lambda n: statistics.median(tps[n]))
        pairs = [a / b for a, b in zip(ratios["adaptive"], ratios[best], strict=True)]
        print(f"adaptive vs the fastest fixed configuration ({best}): {_spread(pairs, 0).strip()}")


def census(configs: list[tuple[str, int | None]], run: Callable[[int | None, str], Any], max_tokens: int) -> None:
    """``--census``: per configuration (each run once unmeasured first: kernels built), one request with every
    evaluation's new primitives counted, per plain step or round, by the function that evaluated them and by kind."""
    real_eval, real_async = mx.eval, mx.async_eval
    sites: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    site_kinds: dict[str, Counter[str]] = {}

    def count(args: tuple[Any, ...], how: str) -> None:
        arrays = [a for _, a in tree_flatten(list(args)) if isinstance(a, mx.array)]
        if not arrays:
            return
        frame = sys._getframe(2)  # noqa: SLF001 - the engine function that evaluated
        site = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name} {how}"
        with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
            mx.export_to_dot(f.name, *arrays)
            nodes = re.findall(r'\{ (\d+) \[label\s*=\s*"([A-Za-z_][A-Za-z0-9_]*)"', f.read())
        # (an evaluation hands its arrays to the device as it goes, each then a leaf of later graphs: every
        # primitive is in one evaluation's graph only)
        sites[site] += len(nodes)
        kinds.update(kind for _, kind in nodes)
        site_kinds.setdefault(site, Counter()).update(kind for _, kind in nodes)

    def counted_eval(*args: Any) -> None:
        count(args, "eval")
        real_eval(*args)

    def counted_async(*args: Any) -> None:
        count(args, "async_eval")
        real_async(*args)

    print(f"\nprimitives evaluated per plain step or round, one request of {max_tokens} tokens per configuration "
          "(by the function that evaluated them; the kinds after)")
    for name, k in configs:
        run(k, name)  # unmeasured: every kernel built
        sites.clear()
        kinds.clear()
        site_kinds.clear()
        mx.eval, mx.async_eval = counted_eval, counted_async
        try:
            stats = run(k, name).stats
        finally:
            mx.eval, mx.async_eval = real_eval, real_async
        units = max(1, stats.rounds if k != 0 else stats.completion_tokens)
        unit = "round" if k != 0 else "step"
        prompt = {s: n for s, n in sites.items() if s.split(" ")[0].split(":")[1] in PROMPT_SITES}
        total = sum(sites.values()) - sum(prompt.values())
        print(f"{name:>8}: {total / units:7.1f} per {unit} ({units} {unit}s, {stats.completion_tokens} tokens; "
              f"{total / max(1, stats.completion_tokens):.1f} per token; the prompt's "
              f"{sum(prompt.values())} apart)")
        for site, n in sites.most_common():
            if site not in prompt:
                print(f"{'':10}{n / units:7.1f}  {site}: " + ", ".join(
                    f"{kind} {c / units:.1f}" for kind, c in site_kinds[site].most_common(12)))
        print(f"{'':10}kinds: " + ", ".join(f"{kind} {n / units:.1f}" for kind, n in kinds.most_common(24)))


def _spread(values: list[float], width: int = 7) -> str:
    """The median of ``values`` and its quartiles."""
    if not values:
        return f"{'-':>{width}} {'':>13}"
    if len(values) < 2:
        return f"{values[0]:>{width}.3f} {'':>13}"
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return f"{median:>{width}.3f} ({q1:.3f}-{q3:.3f})"


if __name__ == "__main__":
    main()
