"""The adaptive depth policy replayed against synthetic machines, modelled on runs measured on real devices.

    python bench/adaptive_sim.py [--seeds 200] [--repeats 3] [--drift-every 3000] [--set NAME=VALUE ...]

A real `exo bench` run of adaptive against fixed depths takes minutes of device time and its per-request
ratios spread by +-10% (host noise); this replays ``exo.engine.adaptive.DepthPolicy`` itself, the way the
decode loop drives it (``choose``, plain bursts of ``plain_budget`` tokens timed when at least
PLAIN_TIMED_MIN long, rounds timed, ``new_request`` per request), against machines whose round costs,
acceptance per draft position and warm-up estimates are those measured, with per-step jitter and a machine
speed that jumps now and then. Like ``exo bench``, every repeat runs each prompt at plain, K = 1..max and
adaptive in turn (4 prompts x 3 repeats x 128 tokens; the adaptive policy carries over between requests)
and the figure is the median over requests of adaptive / the fastest fixed configuration, next to the
same figure for an oracle that always runs the fastest one (the noise floor of that metric).

``--trace FILE`` instead reads what a real run's policy saw and chose (``EXO_ADAPTIVE_TRACE=FILE exo bench
...``): per request, the tokens at each depth and, at every change of depth, its acceptance and cost estimates.

``--set`` overrides a module constant of exo.engine.adaptive (e.g. ``--set OPTIMISM=0``) to compare
policies; what is printed per scenario: the median over seeds and its 10th percentile.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass

from exo.engine import adaptive
from exo.engine.adaptive import DepthCosts, DepthPolicy


@dataclass(frozen=True)
class Scenario:
    source: str
    warm_beta: tuple[float, ...]  # the warm-up's costs (plain steps alone)
    warm_delta: tuple[float, ...]
    warm_over_pipelined: float  # a plain step timed alone over one pipelined plain token
    rounds: tuple[float, ...]  # what a round at K really costs, in pipelined plain tokens
    acceptance: tuple[float, ...]  # conditional acceptance per draft position


SCENARIOS = {
    "h200-exo-demo": Scenario("bench/results/h200-mlx-cuda-engine-2026-11-26.txt", (1.733, 2.068, 2.300),
                              (0.126, 0.238, 0.367), 1.08, (2.04, 2.44, 2.88), (0.88, 0.90, 0.73)),
    "h200-exo-demo-moe": Scenario("same file", (1.594, 1.907), (0.129, 0.230), 1.08, (2.011, 2.303), (0.89, 0.80)),
    "h200-random-9b": Scenario("same file (random head: nothing lands)", (1.706, 2.305, 2.954),
                               (0.119, 0.219, 0.318), 1.0, (1.863, 2.308, 2.981), (0.0, 0.0, 0.0)),
    "h200-exo-demo-1127": Scenario("bench/results/h200-mlx-cuda-round-phases-2026-11-27.txt (plain 1.1x stock: no K pays)",
                                   (2.016, 2.503, 3.003), (0.140, 0.287, 0.389), 1.08, (2.26, 3.14, 3.93),
                                   (0.91, 0.88, 0.72)),
    "h200-moe-1127": Scenario("same file (K = 1, 2 within 3% of plain)", (1.843, 2.237), (0.165, 0.275), 1.08,
                              (1.96, 2.67), (0.91, 0.79)),
    "h200-moe-marginal": Scenario("bench/results/h200-mlx-cuda-adaptive-levels-2026-11-27.txt (K = 2 1.02-1.05x plain)",
                                  (1.670, 1.974), (0.193, 0.269), 1.08, (2.05, 2.50), (0.875, 0.80)),
    "cpu-exo-demo": Scenario("bench/results/cpu-2core-bench-exo-demo-baseline.txt", (1.35, 1.70, 2.05),
                             (0.116, 0.20, 0.28), 1.0, (1.70, 2.29, 2.82), (0.91, 0.90, 0.75)),
    "cpu-kernel-1127": Scenario("this CPU with exo's matmul kernel, 2026-11-27 (K = 1/2/3: 1.20/1.23/1.25x plain)",
                                (1.35, 1.68, 1.69), (0.25, 0.46, 0.66), 1.02, (1.57, 2.13, 2.53), (0.88, 0.85, 0.72)),
    "h100-marginal": Scenario("bench/results/h100-mlx-cuda-engine-speed.txt (every K ~0.9x plain)",
                              (1.61, 1.97, 2.27), (0.12, 0.28, 0.38), 1.0, (2.10, 2.85, 3.55), (0.90, 0.86, 0.70)),
    "cpu-compute-bound": Scenario("a 2-row verify costs ~2 decode steps (shared/reference)", (1.95, 2.9, 3.85),
                                  (0.05, 0.08, 0.11), 1.0, (2.05, 3.0, 3.95), (0.8, 0.75, 0.7)),
}
PROMPT_ACCEPTANCE = (1.0, 0.97, 1.02, 0.95)  # the prompts suit the head differently
UNIT = 2.78e-3  # seconds of a pipelined plain token (any unit: only ratios are printed)
BURST_START = 0.3  # a plain burst's first step is not overlapped by the one before
CATCH_UP = 0.4  # a round after a plain stretch first feeds the head the stretch (not timed, but paid)
JITTER = 0.12  # lognormal sigma of every timing


class Machine:
    """A machine whose speed jumps now and then (``level``: a factor on every timing, within
    e^-drift..e^drift). ``round_exponent`` < 1: a round's time follows the level less than a plain step's
    does, as on a host-bound GPU whose host slows down (an H200: K = 3 rounds cost 2.4 plain steps in a slow
    phase, 3.4 in a fast one): a round's cost in plain steps is its scenario cost at level 1 times
    level^(round_exponent - 1)."""

    def __init__(self, rng: random.Random, drift_every: int, drift: float = 0.3, round_exponent: float = 1.0) -> None:
        self.rng, self.drift_every, self.drift, self.level = rng, drift_every, drift, 1.0
        self.round_exponent = round_exponent

    def ran(self, tokens: int) -> None:
        if self.drift_every and self.rng.random() < tokens / self.drift_every:
            self.level = math.exp(self.rng.uniform(-self.drift, self.drift))

    def seconds(self, plain_tokens: float, round_: bool = False) -> float:
        level = self.level ** self.round_exponent if round_ else self.level
        return plain_tokens * UNIT * level * math.exp(self.rng.gauss(0.0, JITTER))


def text_of(rng: random.Random, tokens: int, runs: float, contrast: float) -> list[float]:
    """A prompt's text as a factor on acceptance per token position: stretches of easy text (x (1 + contrast))
    and hard text (x (1 - contrast)), each ``runs`` tokens long on average (0: a uniform text). Every
    configuration that runs the prompt meets the same text."""
    if not runs:
        return [1.0] * tokens
    out, easy = [], rng.random() < 0.5
    for _ in range(tokens):
        if rng.random() < 1.0 / runs:
            easy = not easy
        out.append(1.0 + contrast if easy else 1.0 - contrast)
    return out


def keep_evidence(policy: DepthPolicy, rounds: float) -> None:
    """The tracker's evidence scaled down to at most ``rounds`` rounds (rates unchanged, their weight less):
    a new request's text then moves the estimates within that request."""
    t = policy.tracker
    if t.reached[0] > rounds:
        scale = rounds / t.reached[0]
        t.accepted = [a * scale for a in t.accepted]
        t.reached = [r * scale for r in t.reached]


def request(s: Scenario, policy: DepthPolicy | None, fixed: int, m: Machine, rng: random.Random,
            max_tokens: int, suits: float, text: list[float] | None = None,
            request_keep: float | None = None) -> float:
    """Tokens/s of one request (first token to last, as ``decode_tokens_per_s``)."""
    produced, elapsed, stretch = 1, 0.0, 0
    text = text or [1.0] * (max_tokens + 16)
    if policy is not None:
        policy.new_request()
        if request_keep is not None:
            keep_evidence(policy, request_keep)
    while produced < max_tokens:
        k = policy.choose() if policy is not None else fixed
        if k == 0:
            budget = policy.plain_budget() if policy is not None else max_tokens
            n = min(budget, max_tokens - produced)
            took = sum(m.seconds(1.0) for _ in range(n)) + m.seconds(BURST_START)
            if policy is not None:
                policy.observe_plain(n, took if n >= adaptive.PLAIN_TIMED_MIN else None)
            produced, elapsed, stretch = produced + n, elapsed + took, stretch + n
            m.ran(n)
        else:
            took = m.seconds(s.rounds[k - 1], round_=True)
            extra = m.seconds(CATCH_UP) if stretch > k + 1 else 0.0
            accepted = 0
            while accepted < k and rng.random() < s.acceptance[accepted] * suits * text[produced + accepted]:
                accepted += 1
            if policy is not None:
                policy.observe_round(k, accepted, took)
            produced, elapsed, stretch = produced + accepted + 1, elapsed + took + extra, 0
            m.ran(accepted + 1)
    return (max_tokens - 1) / elapsed


@dataclass(frozen=True)
class Knobs:
    """What a simulated run varies besides its scenario (the command line's options)."""

    drift_every: int = 3000
    drift: float = 0.3
    round_exponent: float = 1.0
    prompt_spread: float = 1.0
    text_runs: float = 0.0
    text_contrast: float = 0.15
    warm_rounds: int = 0
    warm_suits: float = 1.0
    entry_gain: float | None = None
    request_keep: float | None = None


def trial(s: Scenario, seed: int, knobs: Knobs, prompts: int = 4, repeats: int = 3,
          max_tokens: int = 128) -> tuple[float, float, float]:
    """(adaptive / fastest fixed, oracle / fastest fixed, adaptive / plain): medians over the requests."""
    rng = random.Random(seed)
    m = Machine(rng, knobs.drift_every, knobs.drift, knobs.round_exponent)
    max_k = len(s.warm_beta)
    warm = DepthCosts(s.warm_beta, s.warm_delta, "sim", UNIT * s.warm_over_pipelined, 1, UNIT)
    policy = DepthPolicy(costs=warm, max_k=max_k, default_k=1)
    if knobs.entry_gain is not None:
        policy.entry_gain = knobs.entry_gain
    if knobs.warm_rounds:  # the warm-up's greedy text, drafted at max_k (it suits the head by warm_suits)
        warm_tracker = adaptive.AcceptanceTracker(max_k)
        for _ in range(knobs.warm_rounds):
            accepted = 0
            while accepted < max_k and rng.random() < s.acceptance[accepted] * knobs.warm_suits:
                accepted += 1
            warm_tracker.observe(max_k, accepted)
        policy.tracker.absorb(warm_tracker)
    fixed = list(range(max_k + 1))
    texts = [text_of(rng, max_tokens + 16, knobs.text_runs, knobs.text_contrast) for _ in range(prompts)]  # greedy: one text each
    rows = []
    for _ in range(repeats):
        for p in range(prompts):
            suits = 1.0 + (PROMPT_ACCEPTANCE[p % len(PROMPT_ACCEPTANCE)] - 1.0) * knobs.prompt_spread
            row = {k: request(s, None, k, m, rng, max_tokens, suits, texts[p]) for k in fixed}
            row["adaptive"] = request(s, policy, 0, m, rng, max_tokens, suits, texts[p], knobs.request_keep)
            # Each depth once more, where the adaptive run was: an oracle that runs the fastest one is the
            # metric's own noise floor.
            row.update({("again", k): request(s, None, k, m, rng, max_tokens, suits, texts[p]) for k in fixed})
            rows.append(row)
    best = max(fixed, key=lambda k: statistics.median(r[k] for r in rows))
    return (statistics.median(r["adaptive"] / r[best] for r in rows),
            statistics.median(r[("again", best)] / r[best] for r in rows),
            statistics.median(r["adaptive"] / r[0] for r in rows))


def show_trace(path: str) -> None:
    """Per request of a real run: tokens per depth, and the policy's estimates wherever its depth changed."""
    import json

    with open(path, encoding="utf-8") as f:
        events = [json.loads(line) for line in f]
    print(f"warm-up: beta {events[0]['beta']} delta {events[0]['delta']} on {events[0]['device']}")
    tokens: dict[int, int] = {}
    last, n = None, 0
    for e in [*events[1:], {"event": "request"}]:
        if e["event"] == "request":
            if tokens:
                print(f"request {n}: tokens per depth {dict(sorted(tokens.items()))}")
            tokens, last, n = {}, None, n + 1
        elif e["event"] == "round":
            tokens[e["k"]] = tokens.get(e["k"], 0) + e["accepted"] + 1
        elif e["event"] == "plain":
            tokens[0] = tokens.get(0, 0) + e["tokens"]
        elif e["event"] == "warm_acceptance":
            rates = "/".join(f"{r:.2f}" for r in e["rates"])
            print(f"warm-up answer: acceptance {rates} over {e['rounds']:.0f} rounds (seeds the policy)")
        elif e["event"] == "choose" and e["k"] != last:
            last = e["k"]
            rates = "/".join(f"{r:.2f}" for r in e["rates"])
            costs = "/".join(f"{c:.2f}" for c in e["round_costs"])
            print(f"  -> K = {e['k']}  acceptance {rates}  round costs {costs} plain steps  "
                  f"plain {1000 * (e['plain_s'] or 0):.2f} ms  level {e['level']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--drift-every", type=int, default=3000, help="tokens between jumps of machine speed (0: none)")
    parser.add_argument("--drift", type=float, default=0.3,
                        help="a jump sets the machine's speed to e^u, u uniform in [-drift, drift] (0.6: 0.55-1.8x)")
    parser.add_argument("--round-exponent", type=float, default=1.0,
                        help="a round's time follows the machine's speed to this power, a plain step's to 1 "
                             "(0.2: a host-bound GPU, where rounds cost fewer plain steps in slow phases)")
    parser.add_argument("--prompt-spread", type=float, default=1.0,
                        help="scales how differently the prompts suit the head (PROMPT_ACCEPTANCE; 4: exo-demo-moe "
                             "on an H200, whose prompts accepted 0.73-0.93 at the first position)")
    parser.add_argument("--entry-gain", type=float, help="DepthPolicy.entry_gain (default MIN_GAIN)")
    parser.add_argument("--text-runs", type=float, default=0.0,
                        help="stretches of easier and harder text within a prompt, this many tokens long on average")
    parser.add_argument("--text-contrast", type=float, default=0.15,
                        help="acceptance x (1 +- this) in easy / hard stretches (with --text-runs)")
    parser.add_argument("--request-keep", type=float,
                        help="an experiment: at each request keep at most this many rounds of acceptance evidence")
    parser.add_argument("--only", nargs="*", default=[], help="scenarios to run (default: all)")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE")
    parser.add_argument("--warm-rounds", type=int, default=0,
                        help="rounds at max K of a warm-up text seeding acceptance (the engine: Engine.warm_acceptance)")
    parser.add_argument("--warm-suits", type=float, default=1.0, help="the warm-up text's acceptance over the requests'")
    parser.add_argument("--repeats", type=int, default=3,
                        help="times each prompt runs per configuration (a run's length: 4 prompts x this x 128 tokens)")
    parser.add_argument("--trace", help="summarise an EXO_ADAPTIVE_TRACE file of a real run instead")
    args = parser.parse_args()
    if args.trace:
        show_trace(args.trace)
        return
    for item in args.set:
        name, value = item.split("=")
        setattr(adaptive, name, type(getattr(adaptive, name))(value))
    print(f"{args.seeds} seeds, machine speed jumps every ~{args.drift_every} tokens (by up to e^{args.drift:g}, "
          f"rounds following it to the power {args.round_exponent:g}); overrides: {args.set or 'none'}")
    print(f"{'scenario':18s} {'adaptive/fastest':>17s} {'(p10)':>6s} {'oracle/fastest':>15s} {'(p10)':>6s} "
          f"{'adaptive/plain':>15s}")
    knobs = Knobs(args.drift_every, args.drift, args.round_exponent, args.prompt_spread, args.text_runs,
                  args.text_contrast, args.warm_rounds, args.warm_suits, args.entry_gain, args.request_keep)
    for name, s in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        results = [trial(s, seed, knobs, repeats=args.repeats) for seed in range(args.seeds)]
        ours, oracle, plain = (sorted(x) for x in zip(*results, strict=True))
        p10 = len(ours) // 10
        print(f"{name:18s} {statistics.median(ours):17.3f} {ours[p10]:6.3f} {statistics.median(oracle):15.3f} "
              f"{oracle[p10]:6.3f} {statistics.median(plain):15.3f}")


if __name__ == "__main__":
    main()
