"""Adaptive draft depth: an estimator and a small state machine.

A round at depth K costs c(K) plain tokens (the unit: a plain token as the decode loop runs them, c(0) = 1)
and yields 1 + a1 + a1*a2 + ... + a1*...*aK tokens on average, a_i being the acceptance rate at draft
position i given that position i-1 was accepted. The fastest depth maximises tokens per cost.

The estimator (``AcceptanceTracker``, ``RoundCosts``):

- acceptance per position, with exponential forgetting per observed draft (``FORGET``), a prior for
  positions not seen (``PRIOR_ACCEPTANCE`` for the first, each deeper one the rate of the one before it),
  seeded by the warm-up's greedy answer (``Engine.warm_acceptance``, counted as at most ``WARM_WEIGHT``
  rounds);
- costs from timings taken next to each other only: where the policy moves from one depth to another, the
  last timings of the one and the first of the other give the ratio of their costs (a pair). c is the least
  squares fit, in logs, of every pair of depths' median ratio, anchored at c(0) = 1, the warm-up's costs
  (``costs.warmup_costs``) a weak prior. A shared machine's speed drifts from one minute to the next; a pair
  spans seconds, so drift cancels out of it.

The state machine (``DepthPolicy``): EXPLOIT d (run the depth with the best expected tokens per cost;
leaving d takes ``MIN_GAIN``) or PROBE k (``PROBE_ROUNDS`` rounds at k, or one timed plain burst), started
at probe points ``PROBE_FIRST``, doubling up to ``PROBE_MAX`` tokens apart while the depth stays. A probe
goes to the most promising other depth (acceptance one standard error up, cost ``COST_DOUBT`` down, and its
excess over a plain token ``WARM_COST_DOUBT`` times down while only the warm-up has timed rounds) when it
could beat d, or first to plain decoding while d's cost has no live pair back to it, and at every probe point
once they are ``PROBE_MAX`` apart; otherwise the point passes and the next comes twice as late: where no depth
can pay, probes grow rare. Where no depth could pay even at full acceptance by the warm-up's costs so doubted,
the policy never drafts or probes.

In a batch (``BatchDepthPolicy``) one K serves every member of a round, chosen per batch-size bucket
(2, 3-4, 5-8, 9-16, 17+) by a ``DepthPolicy`` over that bucket's timings of batched steps and rounds, the
solo policy's acceptance tracker shared; until its rounds are paired with its plain steps a bucket's costs
are the solo warm-up's scaled by its measured rows-cost factor (``batch_costs``). A batch of one is a solo
request: its bucket is the solo policy itself (``engine.depth`` applies the solo rules to it).

Everything here is pure Python over numbers: table-tested in tests/engine/test_adaptive.py.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Leaving the exploited depth takes this factor: estimates are noisy, and flipping between depths that read
# alike would cost head catch-ups for nothing.
MIN_GAIN = 1.03
# A batch of several starts drafting only on a clear margin: its members' acceptance runs below the solo
# acceptance its estimates use (heads fall behind while the batch decodes plainly); without it, batches drafted
# where plain batching served more (docs/performance.md, "The engine's constants").
BATCH_ENTRY_GAIN = 1.15
PRIOR_ACCEPTANCE = 0.6  # before any observation (a typical trained head accepts 0.6-0.85)
PRIOR_WEIGHT = 1.0  # pseudo-observations behind the prior
FORGET = 0.97  # per observation: recent rounds matter more (acceptance varies with the text)
# The warm-up's greedy answer counts for at most this many rounds (the requests' own rounds soon outvote it;
# docs/performance.md, "The engine's constants").
WARM_WEIGHT = 6.0
# Probes judge another depth by its acceptance plus this many standard errors of its evidence (a position seen
# once or twice is uncertain, not bad) and its cost over COST_DOUBT (a pair timed in a busy moment).
OPTIMISM = 1.0
COST_DOUBT = 1.05
# The warm-up's costs come from one short measurement of a round's parts alone, and live rounds have cost far
# less beyond their one plain step: by the warm-up's costs adaptive never drafted where a fixed K = 1 paid
# (docs/performance.md, the H200's replayed rounds; bench/results/h200-mlx-cuda-round-phases-replay-9b-2026-11-28.txt).
# Until a round is timed live against plain decoding, a depth is judged for a probe as if its warm-up cost beyond
# one plain step were this many times too high (``doubted``), and MTP is off altogether only where no depth could
# pay even so at full acceptance. A probe that finds it cannot pay costs a few rounds: the probe points then pass
# until PROBE_MAX apart.
WARM_COST_DOUBT = 2.0


def doubted(cost: float, doubt: float = WARM_COST_DOUBT) -> float:
    """A round's cost with its excess over one plain token divided by ``doubt``."""
    return 1.0 + max(cost - 1.0, 0.0) / doubt
PROBE_FIRST = 16  # tokens from a change of depth to the first probe point
PROBE_MAX = 1024  # the longest interval between probe points, where a probe always runs
PROBE_ROUNDS = 3  # rounds in a probe of a depth: timings enough for a pair's median
PROBE_PLAIN_TOKENS = 32  # a probe of plain decoding: one timed burst
PAIR_SAMPLES = 3  # timings on each side of a pair (a solo plain burst already averages its tokens: one)
PAIR_KEEP = 5  # ratios kept per two depths (their median is the pair's)
COST_PRIOR_WEIGHT = 0.1  # the warm-up's cost (times the glue), as pairs' worth of evidence
# Plain bursts shorter than this are not timed: their first step is built before any compute overlaps it, so a
# short burst times mostly that (docs/performance.md, "The engine's constants").
PLAIN_TIMED_MIN = 8


@dataclass(frozen=True)
class DepthCosts:
    """Costs of a round at depth K relative to one plain decode step; index K-1 for K = 1..max_k."""

    beta: tuple[float, ...]  # verify of K+1 rows
    delta: tuple[float, ...]  # drafting K tokens with the head
    device: str = ""
    plain_s: float | None = None  # seconds of one plain decode step when measured (the unit of beta, delta)
    stages: int = 1  # measured through a pipeline of this many stages (its steps and transfers)
    plain_pipelined_s: float | None = None  # seconds per token of plain steps pipelined as the decode loop runs them

    @property
    def max_k(self) -> int:
        return len(self.beta)

    def round_cost(self, k: int) -> float:
        return 1.0 if k == 0 else self.beta[k - 1] + self.delta[k - 1]

    def in_pipelined_steps(self) -> DepthCosts:
        """The same costs counted in plain tokens of the pipelined decode loop (where the warm-up timed both)."""
        if not self.plain_s or not self.plain_pipelined_s:
            return self
        scale = self.plain_s / self.plain_pipelined_s
        return DepthCosts(tuple(b * scale for b in self.beta), tuple(d * scale for d in self.delta), self.device,
                          self.plain_pipelined_s, self.stages, self.plain_pipelined_s)


def expected_tokens(acceptance: list[float] | tuple[float, ...], k: int) -> float:
    """Mean tokens emitted by a round at depth k: 1 + a1 + a1*a2 + ..."""
    total, run = 1.0, 1.0
    for i in range(k):
        run *= acceptance[i]
        total += run
    return total


def expected_speedup(costs: DepthCosts, acceptance: list[float] | tuple[float, ...], k: int) -> float:
    return expected_tokens(acceptance, k) / costs.round_cost(k)


def best_depth(
    costs: DepthCosts, acceptance: list[float] | tuple[float, ...], max_k: int, min_gain: float = MIN_GAIN
) -> tuple[int, float]:
    """(K, expected speedup over plain decoding); K = 0 unless some K >= 1 wins by ``min_gain``."""
    best_k, best = 0, 1.0
    for k in range(1, min(max_k, costs.max_k) + 1):
        speedup = expected_speedup(costs, acceptance, k)
        if speedup > best * (min_gain if best_k == 0 else 1.0):
            best_k, best = k, speedup
    return best_k, best


def can_pay_off(costs: DepthCosts, max_k: int, min_gain: float = MIN_GAIN, doubt: float = 1.0) -> bool:
    """Whether any depth would beat plain decoding even if every draft were accepted (its cost ``doubted``)."""
    return any((k + 1) / doubted(costs.round_cost(k), doubt) > min_gain for k in range(1, min(max_k, costs.max_k) + 1))


@dataclass
class AcceptanceTracker:
    """Per-position conditional acceptance with exponential forgetting, a prior for what is not seen:
    PRIOR_ACCEPTANCE (weighted PRIOR_WEIGHT) for the first position, for each deeper one the rate of the
    position before it (rounds at K never measure position K + 1: with a fixed prior, a head landing 90% of
    its first drafts made K + 1 look no better than K, and it never ran)."""

    max_k: int
    accepted: list[float] = field(default_factory=list)  # observed, forgetting applied (no prior)
    reached: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted = [0.0] * self.max_k
        self.reached = [0.0] * self.max_k

    def observe(self, k: int, accepted: int) -> None:
        """A round drafted k tokens and accepted the first ``accepted`` of them."""
        for i in range(min(k, self.max_k)):
            if i > accepted:
                break  # position i was never tested
            self.reached[i] = self.reached[i] * FORGET + 1.0
            self.accepted[i] = self.accepted[i] * FORGET + (1.0 if i < accepted else 0.0)

    def absorb(self, other: AcceptanceTracker, weight: float = WARM_WEIGHT) -> None:
        """Add ``other``'s evidence (the warm-up's rounds), counted as at most ``weight`` rounds."""
        scale = min(1.0, weight / other.reached[0]) if other.reached[0] else 1.0
        for i in range(min(self.max_k, other.max_k)):
            self.accepted[i] += other.accepted[i] * scale
            self.reached[i] += other.reached[i] * scale

    def rates(self) -> list[float]:
        return self._rates(0.0)

    def optimistic_rates(self) -> list[float]:
        """Each position's rate plus OPTIMISM standard errors of its evidence (observations and prior), a
        deeper position's prior being the optimistic rate of the one before it."""
        return self._rates(OPTIMISM)

    def _rates(self, errors: float) -> list[float]:
        out, prior = [], PRIOR_ACCEPTANCE
        for a, r in zip(self.accepted, self.reached, strict=True):
            rate = (a + prior * PRIOR_WEIGHT) / (r + PRIOR_WEIGHT)
            if errors:
                rate = min(1.0, rate + errors * math.sqrt(rate * (1.0 - rate) / (r + PRIOR_WEIGHT)))
            prior = rate
            out.append(rate)
        return out


@dataclass
class _Segment:
    """Consecutive timings at one depth: its first and its last ``size``, whether its first are paired."""

    depth: int
    size: int
    first: list[float] = field(default_factory=list)
    last: collections.deque[float] = field(default_factory=collections.deque)
    paired: bool = False

    def add(self, seconds: float) -> None:
        if len(self.first) < self.size:
            self.first.append(seconds)
        self.last.append(seconds)
        while len(self.last) > self.size:
            self.last.popleft()


@dataclass
class RoundCosts:
    """Round costs in plain tokens from pairs of neighbouring timings (see the module's doc).

    ``observe`` takes timings in the order they ran (seconds per plain token, or per round; untimed ones are
    left out and do not break a stretch). Where the depth changes, the ``PAIR_SAMPLES`` timings before the
    change and the first ``PAIR_SAMPLES`` after it (a solo plain burst: one, ``plain_samples``) give the ratio
    of the two depths' costs; ``round_cost`` is the least-squares fit of log costs to the median ratio of each
    pair of depths (of its last ``PAIR_KEEP``) with c(0) = 1, ``prior`` (the warm-up's costs) weighted
    ``COST_PRIOR_WEIGHT``, never below one plain token."""

    prior: DepthCosts
    plain_samples: int = 1
    _pairs: dict[tuple[int, int], collections.deque[float]] = field(default_factory=dict, init=False)
    _before: _Segment | None = field(default=None, init=False)
    _now: _Segment | None = field(default=None, init=False)
    _fit: list[float] | None = field(default=None, init=False)
    _plain: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=5), init=False)
    _timed: collections.Counter[int] = field(default_factory=collections.Counter, init=False)

    def set_prior(self, prior: DepthCosts) -> None:
        if prior != self.prior:
            self.prior, self._fit = prior, None

    def observe(self, k: int, seconds: float | None) -> None:
        if seconds is None or seconds <= 0:
            return
        self._timed[k] += 1
        if k == 0:
            self._plain.append(seconds)
        now = self._now
        if now is None or now.depth != k:
            if now is not None and not now.paired:
                self._pair()  # a stretch cut short (a probe's plain burst, a depth left early): what it has
            self._before = now
            now = self._now = _Segment(k, self.plain_samples if k == 0 else PAIR_SAMPLES)
        now.add(seconds)
        if not now.paired and len(now.first) >= now.size:
            self._pair()

    def _pair(self) -> None:
        before, now = self._before, self._now
        assert now is not None
        now.paired = True
        if before is None or not before.last or not now.first:
            return
        ratio = statistics.median(now.first) / statistics.median(before.last)  # c(now) / c(before)
        a, b = sorted((before.depth, now.depth))
        log = math.log(ratio) if now.depth == b else -math.log(ratio)  # log c(b) / c(a)
        self._pairs.setdefault((a, b), collections.deque(maxlen=PAIR_KEEP)).append(log)
        self._fit = None

    def timings(self, k: int) -> int:
        """How many timings of depth k were observed."""
        return self._timed[k]

    def paired(self, a: int, b: int) -> bool:
        """Whether depths a and b are joined by pairs, directly or through other depths."""
        seen, todo = {a}, [a]
        while todo:
            x = todo.pop()
            for p, q in self._pairs:
                y = q if p == x else p if q == x else None
                if y is not None and y not in seen:
                    seen.add(y)
                    todo.append(y)
        return b in seen

    def plain_s(self) -> float | None:
        """Seconds of a plain token (a batch bucket: of a batched plain step), live; None until timed."""
        return statistics.median(self._plain) if self._plain else None

    def round_cost(self, k: int) -> float:
        if k == 0:
            return 1.0
        if self._fit is None:
            self._fit = self._solve()
        return max(1.0, math.exp(self._fit[k - 1]))

    def _solve(self) -> list[float]:
        """Log costs of depths 1..max_k (log c(0) = 0), fitted twice: the second time each depth's prior is its
        warm-up cost times the glue, the median of fitted over warm-up cost of the depths paired with plain
        decoding (a round costs more than its parts timed alone, by a factor much alike from depth to depth),
        so that a depth not timed yet is not taken at the warm-up's optimism."""
        warm = [math.log(max(1.0, self.prior.round_cost(k))) for k in range(1, self.prior.max_k + 1)]  # a forced depth's: 0
        fit = self._fit_logs(warm)
        glue = [x - w for k, (x, w) in enumerate(zip(fit, warm, strict=True), start=1) if self.paired(k, 0)]
        if not glue:
            return fit
        shift = statistics.median(glue)
        return self._fit_logs([w + shift for w in warm])

    def _fit_logs(self, prior: list[float]) -> list[float]:
        """Normal equations of the weighted least squares: prior log costs, and the pairs' median log ratios."""
        n = self.prior.max_k
        matrix = [[0.0] * n for _ in range(n)]
        rhs = [0.0] * n
        for k in range(1, n + 1):
            matrix[k - 1][k - 1] += COST_PRIOR_WEIGHT
            rhs[k - 1] += COST_PRIOR_WEIGHT * prior[k - 1]
        for (a, b), logs in self._pairs.items():
            if b > n:
                continue
            w, m = float(len(logs)), statistics.median(logs)  # (x_b - x_a - m)^2, weighted w
            matrix[b - 1][b - 1] += w
            rhs[b - 1] += w * m
            if a > 0:
                matrix[a - 1][a - 1] += w
                matrix[a - 1][b - 1] -= w
                matrix[b - 1][a - 1] -= w
                rhs[a - 1] -= w * m
        return _solve_linear(matrix, rhs)


def _solve_linear(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination (the matrix is symmetric positive definite: no pivoting needed)."""
    n = len(rhs)
    a = [row[:] + [r] for row, r in zip(matrix, rhs, strict=True)]
    for i in range(n):
        for j in range(i + 1, n):
            f = a[j][i] / a[i][i]
            for c in range(i, n + 1):
                a[j][c] -= f * a[i][c]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (a[i][n] - sum(a[i][c] * x[c] for c in range(i + 1, n))) / a[i][i]
    return x


@dataclass
class DepthPolicy:
    """Chooses the depth of each round. ``fixed_k`` forces a depth (0..max_k) and disables adaptation.

    The state machine of the module's doc: EXPLOIT ``depth``, or PROBE ``probing`` for ``probe_left`` more
    rounds. ``choose`` is asked before every round or plain burst (``plain_budget``: how long a burst runs),
    ``observe_round`` and ``observe_plain`` report what ran."""

    costs: DepthCosts
    max_k: int
    default_k: int = 1
    fixed_k: int | None = None
    # Whether drafting can pay off at all, when another policy decided it (a batch-size bucket: the solo
    # warm-up's verdict); None: from ``costs``.
    can_draft: bool | None = None
    # What a depth must promise over plain decoding before the policy starts drafting (leaving a depth for
    # another always takes MIN_GAIN).
    entry_gain: float = MIN_GAIN
    # Timings on the plain side of a pair: a solo plain burst averages its tokens (1); a batch's plain steps
    # come one at a time (PAIR_SAMPLES); a plain probe then lasts as many steps.
    plain_samples: int = 1
    # Called with every decision and observation (``EXO_ADAPTIVE_TRACE``: JSON lines)
    trace: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False, compare=False)
    tracker: AcceptanceTracker = field(init=False)
    estimator: RoundCosts = field(init=False)
    depth: int = field(default=0, init=False)  # EXPLOIT: the depth run between probes
    probing: int | None = field(default=None, init=False)  # PROBE: the depth probed
    probe_left: int = field(default=0, init=False)  # rounds (plain: bursts or steps) of the probe still to run
    probe_every: int = field(default=PROBE_FIRST, init=False)  # tokens between probe points
    since_probe: int = field(default=0, init=False)  # tokens since the last probe point
    _rounds_run: int = field(default=0, init=False)
    _started: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.max_k = min(self.max_k, self.costs.max_k)
        self.default_k = min(self.default_k, self.max_k)
        self.tracker = AcceptanceTracker(self.max_k)
        self.estimator = RoundCosts(self.costs.in_pipelined_steps(), self.plain_samples)

    @property
    def rounds_run(self) -> int:
        return self._rounds_run

    @property
    def mtp_can_pay_off(self) -> bool:
        if self.fixed_k is not None:
            return self.fixed_k > 0
        if self.can_draft is not None:
            return self.can_draft
        return can_pay_off(self.costs.in_pipelined_steps(), self.max_k, self.entry_gain, WARM_COST_DOUBT)

    def plain_step_s(self) -> float | None:
        """Seconds per plain token: live, else the warm-up's pipelined steps, else its step alone."""
        return self.estimator.plain_s() or self.costs.plain_pipelined_s or self.costs.plain_s

    def effective_costs(self) -> DepthCosts:
        """The estimator's costs in plain tokens (verify and drafts split as at warm-up)."""
        est = self.estimator
        beta, delta = [], []
        for k in range(1, self.costs.max_k + 1):
            warm_b, warm_d = est.prior.beta[k - 1], est.prior.delta[k - 1]
            total = est.round_cost(k) if k <= est.prior.max_k else warm_b + warm_d
            share = warm_b / (warm_b + warm_d) if warm_b + warm_d else 1.0
            beta.append(max(1.0, total * share))
            delta.append(total - beta[-1])
        return DepthCosts(tuple(beta), tuple(delta), self.costs.device, self.plain_step_s(), self.costs.stages)

    def speeds(self, rates: list[float] | None = None) -> list[float]:
        """Expected tokens per plain token's time at each depth 0..max_k."""
        rates = rates if rates is not None else self.tracker.rates()
        return [expected_tokens(rates, k) / self.estimator.round_cost(k) for k in range(self.max_k + 1)]

    def drafting_pays(self) -> bool:
        """Whether some depth beats plain decoding by ``entry_gain`` as estimated now (no state change)."""
        return max(self.speeds()[1:], default=0.0) > self.entry_gain

    def new_request(self) -> None:
        """A new generation: what was learned (acceptance, costs) and the probe schedule carry over."""
        if self.trace is not None:
            self.trace({"event": "request"})

    # -- decisions ---------------------------------------------------------------------------------
    def choose(self) -> int:
        k = self._choose()
        if self.trace is not None:
            self.trace({"event": "choose", "k": k, "rates": self.tracker.rates(), "round_costs": [
                self.estimator.round_cost(d) for d in range(1, self.max_k + 1)], "plain_s": self.plain_step_s(),
                "state": "probe" if self.probing is not None else "exploit"})
        return k

    def _choose(self) -> int:
        if self.fixed_k is not None:
            return self.fixed_k
        if not self.mtp_can_pay_off:
            return 0
        if self.probing is not None:
            if self.probe_left > 0:
                self.probe_left -= 1
                return self.probing
            self.probing = None  # the probe ran: back to EXPLOIT, on what it measured
        if not self._started:
            self._started = True
            if self.default_k > 0 and not self.tracker.reached[0]:  # nothing known of the head yet
                self.depth = self.default_k
                return self.depth
        speed = self.speeds()
        best = max(range(self.max_k + 1), key=lambda d: (speed[d], -d))
        if speed[best] > speed[self.depth] * (self.entry_gain if self.depth == 0 else MIN_GAIN):
            self.depth, self.probe_every, self.since_probe = best, PROBE_FIRST, 0
        if self.since_probe >= self.probe_every:
            self.since_probe = 0
            target = self._probe_target(speed)
            self.probe_every = min(2 * self.probe_every, PROBE_MAX)
            if target is not None:
                self.probing = target
                self.probe_left = (PROBE_ROUNDS if target else self.plain_samples) - 1
                return target
        return self.depth

    def _probe_target(self, speed: list[float]) -> int | None:
        """The depth to probe at a probe point, or None: plain decoding while the exploited depth's cost has no
        pair back to it; else the most promising other depth, if it could beat the exploited one (or the probe
        points are PROBE_MAX apart)."""
        d = self.depth
        if d > 0 and not self.estimator.paired(d, 0):
            return 0
        hopes = self.tracker.optimistic_rates()
        # While no round is timed live against plain decoding, every cost is the warm-up's (after one is, the
        # others' estimates carry its measured glue)
        warm_only = not any(self.estimator.paired(k, 0) for k in range(1, self.max_k + 1))
        hoped = {k: expected_tokens(hopes, k) * COST_DOUBT
                 / doubted(self.estimator.round_cost(k), WARM_COST_DOUBT if warm_only and k else 1.0)
                 for k in range(self.max_k + 1) if k != d}
        target = max(hoped, key=lambda k: (hoped[k], -k))
        could_beat = hoped[target] > speed[d] * (self.entry_gain if d == 0 else 1.0)
        return target if could_beat or self.probe_every >= PROBE_MAX else None

    def plain_budget(self) -> int:
        """Plain tokens to run before asking ``choose`` again (pipelined without host decisions)."""
        if self.fixed_k is not None or not self.mtp_can_pay_off:
            return 1 << 30
        if self.probing == 0:
            return PROBE_PLAIN_TOKENS
        return max(1, self.probe_every - self.since_probe)

    # -- observations ------------------------------------------------------------------------------
    def observe_round(self, k: int, accepted: int, seconds: float | None = None) -> None:
        """A round at depth k accepted ``accepted`` drafts in ``seconds`` (None: not a representative
        round)."""
        if self.trace is not None:
            self.trace({"event": "round", "k": k, "accepted": accepted, "seconds": seconds})
        self.tracker.observe(k, accepted)
        self.observe_round_time(k, seconds, accepted + 1)

    def observe_round_time(self, k: int, seconds: float | None, tokens: int = 1) -> None:
        """A round at depth k ran (in ``seconds``; None: not representative), its acceptance counted elsewhere;
        ``tokens``: what it emitted (a batch bucket counts its steps)."""
        self._rounds_run += 1
        self.since_probe += tokens
        if k > 0:
            self.estimator.observe(k, seconds)

    def observe_plain(self, tokens: int, seconds: float | None = None) -> None:
        """``tokens`` plain tokens ran in ``seconds`` (None: not timed)."""
        if self.trace is not None:
            self.trace({"event": "plain", "tokens": tokens, "seconds": seconds})
        self.since_probe += tokens
        if tokens > 0 and seconds is not None:
            self.estimator.observe(0, seconds / tokens)


TRACE_ENV = "EXO_ADAPTIVE_TRACE"
TRACE_BUFFER = 100_000  # events held at most (a request of 128 tokens leaves ~100)


def trace_from_env(costs: DepthCosts, max_k: int) -> Callable[[dict[str, Any]], None] | None:
    """Where ``EXO_ADAPTIVE_TRACE`` names a file: a tracer appending each event as a JSON line (with its
    time), the policy's warm-up costs first. A trace is the policy's view of a real run (what it saw and
    what it chose)."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return None
    start = time.perf_counter()
    # Events wait in memory and go to the file at each new request (before its prefill, off the decode path),
    # every TRACE_BUFFER events, and at exit: a file written per event slowed traced rounds, which traced runs
    # then charged to adaptive alone (docs/performance.md, "The engine's constants").
    pending: list[dict[str, Any]] = []

    def flush() -> None:
        if pending:
            with open(path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(e) + "\n" for e in pending)
            pending.clear()

    def write(event: dict[str, Any]) -> None:
        pending.append({"t": round(time.perf_counter() - start, 6), **event})
        if event["event"] == "request" or len(pending) >= TRACE_BUFFER:
            flush()

    def flush_at_exit() -> None:
        with contextlib.suppress(OSError):  # its folder gone (a test's temporary one)
            flush()

    atexit.register(flush_at_exit)
    write({"event": "policy", "max_k": max_k, "beta": costs.beta, "delta": costs.delta, "plain_s": costs.plain_s,
           "plain_pipelined_s": costs.plain_pipelined_s, "device": costs.device})
    return write


# Batch-size buckets: sizes up to each bound share timings (1, 2, 3-4, 5-8, 9-16); larger ones the last.
BATCH_BUCKETS = (1, 2, 4, 8, 16)


def batch_bucket(size: int) -> int:
    """The bucket of a batch of ``size`` sequences (0 .. len(BATCH_BUCKETS))."""
    for i, top in enumerate(BATCH_BUCKETS):
        if size <= top:
            return i
    return len(BATCH_BUCKETS)


def batch_costs(solo: DepthCosts, size: int, rows_factor: float | None = None) -> DepthCosts:
    """Estimated costs of a batched round of ``size`` sequences in batched plain steps, from the solo
    warm-up costs (in solo plain steps).

    A step costs ``m`` solo steps more per extra row: a batched plain step of ``size`` rows costs
    ``rows_factor`` = 1 + (size - 1) m solo steps (measured live; without it, m = beta(1) - 1, the warm-up's
    extra verify row). A batched verify call of size x (K+1) rows costs the rows, plus what a solo verify
    call costs beyond its rows (its row-by-row recurrences and recording: per call, not per sequence);
    drafting runs per sequence: size x delta(K). On a compute-bound device (m = 1) a round costs K+1
    steps, as many as the rows; where rows are nearly free, about what a solo round costs."""
    if size <= 1:
        return solo
    if rows_factor is None:
        rows_factor = 1.0 + (size - 1) * min(max(solo.beta[0] - 1.0, 0.0), 1.0)
    rows_factor = min(max(rows_factor, 1.0), float(size))
    m = (rows_factor - 1.0) / (size - 1)
    beta = tuple(
        1.0 + (size * k * m + max(b - 1.0 - k * m, 0.0)) / rows_factor for k, b in enumerate(solo.beta, start=1)
    )
    delta = tuple(d * size / rows_factor for d in solo.delta)
    plain_s = solo.plain_s * rows_factor if solo.plain_s else None
    return DepthCosts(beta, delta, solo.device, plain_s)


@dataclass
class BatchDepthPolicy:
    """The depth of a batch's rounds, per batch-size bucket: a ``DepthPolicy`` per bucket over that bucket's
    timings (seconds of a whole batched step or round), sharing the solo policy's acceptance tracker and its
    verdict on whether drafting can pay off on this device at all (when it cannot, every batch decodes
    plainly and nothing is timed or probed). A bucket decodes plainly until its plain step is timed; its
    prior costs are ``batch_costs`` at its measured rows cost, and where even full acceptance could not pay
    by them it neither drafts nor probes. A batch of several drafts only while solo drafting pays as
    estimated now, and starts only on ``BATCH_ENTRY_GAIN``."""

    solo: DepthPolicy
    _buckets: dict[int, DepthPolicy] = field(default_factory=dict, init=False)

    def bucket(self, size: int) -> DepthPolicy:
        """The policy of batches of ``size``: the solo policy for a batch of one."""
        index = batch_bucket(size)
        if index == 0:
            return self.solo
        policy = self._buckets.get(index)
        if policy is None:
            # A batch of several starts on its estimates (not the solo default depth), drafting only on a
            # clear margin.
            policy = DepthPolicy(
                costs=batch_costs(self.solo.costs, size), max_k=self.solo.max_k, default_k=0,
                can_draft=self.solo.mtp_can_pay_off, entry_gain=BATCH_ENTRY_GAIN, plain_samples=PAIR_SAMPLES,
            )
            policy.tracker = self.solo.tracker  # acceptance is the head's on the text, whatever the batch
            self._buckets[index] = policy
        return policy

    def rows_factor(self, size: int) -> float | None:
        """A batched plain step's measured seconds over a solo plain step's (None until both are known)."""
        solo = self.solo.plain_step_s()
        plain = self.bucket(size).estimator.plain_s()
        return plain / solo if plain and solo else None

    def choose(self, size: int) -> int:
        if batch_bucket(size) == 0:
            return self.solo.choose()
        if not self.solo.mtp_can_pay_off:
            return 0
        if size > 1 and not self.solo.drafting_pays():
            # Solo requests, which draft cheapest (one row each), do not gain by drafting here: a batch, whose
            # members' heads also fall behind while it decodes plainly, would not either (docs/performance.md, "The engine's constants").
            return 0
        policy = self.bucket(size)
        if policy.estimator.plain_s() is None:
            return 0  # time a plain step first: the rows cost, and every round is judged against it
        costs = batch_costs(self.solo.costs, size, self.rows_factor(size))
        policy.costs = costs
        policy.estimator.set_prior(costs)
        policy.can_draft = can_pay_off(costs, policy.max_k, policy.entry_gain)
        return policy.choose()

    def observe_plain(self, size: int, seconds: float | None = None) -> None:
        """A batched plain step of ``size`` sequences ran (in ``seconds``; None: not a representative one)."""
        self.bucket(size).observe_plain(1, seconds)

    def observe_round(self, size: int, k: int, seconds: float | None = None) -> None:
        """A batched round at depth k ran (its acceptance went to the tracker member by member)."""
        self.bucket(size).observe_round_time(k, seconds)
