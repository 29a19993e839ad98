"""Adaptive draft depth: pick the K with the best expected tokens per second, on this machine.

A round at depth K costs beta(K) + delta(K) plain decode steps (beta: the (K+1)-row verify, delta: K
draft steps of the head) and yields 1 + a1 + a1*a2 + ... + a1*...*aK tokens on average, a_i being the
acceptance rate at draft position i given that position i-1 was accepted. K = 0 is plain decoding
(cost 1, one token). Costs come from a warm-up measurement and are refined by the rounds actually run;
acceptance is tracked per position with exponential forgetting. When the best K is 0 the policy
still probes K = 1 now and then (exponentially rarer) in case acceptance improved, unless even perfect
acceptance could not pay off on this machine (e.g. a compute-bound CPU where beta(1) ~ 2), in which
case it never probes and MTP costs nothing.

Everything here is pure Python over numbers: table-tested in tests/engine/test_adaptive.py.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field

# A depth must beat plain decoding by this factor to be chosen: measurement noise must not make the
# policy oscillate into slower configurations.
MIN_GAIN = 1.03
PRIOR_ACCEPTANCE = 0.6  # before any observation (a typical trained head accepts 0.6-0.85)
PRIOR_WEIGHT = 2.0  # pseudo-observations behind the prior
FORGET = 0.97  # per observation: recent rounds matter more (acceptance varies with the text)
PROBE_FIRST = 16  # plain tokens before the first probe when K = 0 was chosen on acceptance
PROBE_MAX = 512
COST_WINDOW = 16  # live timings kept per depth (their median is the depth's cost)
MIN_ROUND_SAMPLES = 3  # round timings before they replace a depth's warm-up estimate


@dataclass(frozen=True)
class DepthCosts:
    """Costs of a round at depth K relative to one plain decode step; index K-1 for K = 1..max_k."""

    beta: tuple[float, ...]  # verify of K+1 rows
    delta: tuple[float, ...]  # drafting K tokens with the head
    device: str = ""
    plain_s: float | None = None  # seconds of one plain decode step when measured
    stages: int = 1  # measured through a pipeline of this many stages (its steps and transfers)

    @property
    def max_k(self) -> int:
        return len(self.beta)

    def round_cost(self, k: int) -> float:
        return 1.0 if k == 0 else self.beta[k - 1] + self.delta[k - 1]


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


def can_pay_off(costs: DepthCosts, max_k: int, min_gain: float = MIN_GAIN) -> bool:
    """Whether any depth would beat plain decoding even if every draft were accepted."""
    return best_depth(costs, [1.0] * max_k, max_k, min_gain)[0] > 0


@dataclass
class AcceptanceTracker:
    """Per-position conditional acceptance with a prior and exponential forgetting."""

    max_k: int
    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted = [PRIOR_ACCEPTANCE * PRIOR_WEIGHT] * self.max_k
        self.reached = [PRIOR_WEIGHT] * self.max_k

    def observe(self, k: int, accepted: int) -> None:
        """A round drafted k tokens and accepted the first ``accepted`` of them."""
        for i in range(min(k, self.max_k)):
            if i > accepted:
                break  # position i was never tested
            self.reached[i] = self.reached[i] * FORGET + 1.0
            self.accepted[i] = self.accepted[i] * FORGET + (1.0 if i < accepted else 0.0)

    def rates(self) -> list[float]:
        return [a / r for a, r in zip(self.accepted, self.reached, strict=True)]


@dataclass
class DepthPolicy:
    """Chooses the depth of each round. ``fixed_k`` forces a depth (0..max_k) and disables adaptation.

    What a depth costs is measured live, in seconds, the same way for every K: a plain token's time in
    plain stretches (K = 0), a round's time (K >= 1), each the median of the last ``COST_WINDOW``
    measurements, so that a noisy moment on a shared machine moves nothing. A depth not measured yet is
    estimated from the warm-up costs, scaled by the live plain step and by how much slower than their
    warm-up costs the measured depths turned out (the loop's own work around a round). Whether drafting
    can pay off at all (even at full acceptance) is decided by the warm-up costs alone: live noise must
    not turn MTP off for good; a depth that measures slow is left by ``choose`` and probed again later.
    """

    costs: DepthCosts
    max_k: int
    default_k: int = 1
    fixed_k: int | None = None
    tracker: AcceptanceTracker = field(init=False)
    _seconds: dict[int, collections.deque[float]] = field(default_factory=dict, init=False)
    _current: int = field(default=0, init=False)
    _plain_since_probe: int = field(default=0, init=False)
    _probe_every: int = field(default=PROBE_FIRST, init=False)
    _rounds_run: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.max_k = min(self.max_k, self.costs.max_k)
        self.default_k = min(self.default_k, self.max_k)
        self.tracker = AcceptanceTracker(self.max_k)

    # -- costs -----------------------------------------------------------------------------------
    def _median(self, k: int) -> float | None:
        samples = self._seconds.get(k)
        # A plain timing already averages a stretch of tokens; one round is one round: wait for a few.
        enough = 1 if k == 0 else MIN_ROUND_SAMPLES
        return statistics.median(samples) if samples and len(samples) >= enough else None

    def plain_step_s(self) -> float | None:
        return self._median(0) or self.costs.plain_s

    def _glue(self) -> float:
        """Measured round time over warm-up cost x live plain step, over the depths measured (1 if none)."""
        plain = self.plain_step_s()
        ratios = [
            measured / (self.costs.round_cost(k) * plain)
            for k in range(1, self.costs.max_k + 1)
            if plain and (measured := self._median(k)) is not None and self.costs.round_cost(k) > 0
        ]
        return statistics.median(ratios) if ratios else 1.0

    def effective_costs(self) -> DepthCosts:
        """Costs in plain steps as measured live (warm-up costs where a depth was not measured yet)."""
        plain = self.plain_step_s()
        if plain is None or not self._seconds:
            return self.costs
        glue = self._glue()
        beta, delta = list(self.costs.beta), list(self.costs.delta)
        for k in range(1, len(beta) + 1):
            warm = beta[k - 1] + delta[k - 1]
            measured = self._median(k)
            total = measured / plain if measured is not None else warm * glue
            share = beta[k - 1] / warm if warm else 1.0  # keep the warm-up split of verify and drafts
            beta[k - 1], delta[k - 1] = total * share, total * (1.0 - share)
        return DepthCosts(tuple(beta), tuple(delta), self.costs.device, plain, self.costs.stages)

    @property
    def mtp_can_pay_off(self) -> bool:
        if self.fixed_k is not None:
            return self.fixed_k > 0
        return can_pay_off(self.costs, self.max_k)

    def new_request(self) -> None:
        """A new generation: acceptance and costs learned so far stay, the probe schedule restarts."""
        self._plain_since_probe = 0
        self._probe_every = PROBE_FIRST

    # -- decisions ---------------------------------------------------------------------------------
    def choose(self) -> int:
        if self.fixed_k is not None:
            return self.fixed_k
        if not self.mtp_can_pay_off:
            return 0
        if self._rounds_run == 0 and self.default_k > 0:
            self._current = self.default_k
            return self.default_k
        costs = self.effective_costs()
        rates = self.tracker.rates()
        speed = {k: expected_speedup(costs, rates, k) for k in range(0, self.max_k + 1)}
        best = max(speed, key=lambda k: (speed[k], -k))
        # Hysteresis: leave the current depth only for one that is clearly faster (timings are noisy).
        current = min(self._current, self.max_k)
        k = best if speed[best] > speed[current] * MIN_GAIN else current
        if k == 0 and self._plain_since_probe >= self._probe_every:
            self._plain_since_probe = 0
            self._probe_every = min(self._probe_every * 2, PROBE_MAX)
            return 1  # a probe: the current depth stays 0 unless it shows otherwise
        self._current = k
        return k

    def plain_budget(self) -> int:
        """Plain tokens to run before asking ``choose`` again (pipelined without host decisions)."""
        if self.fixed_k is not None or not self.mtp_can_pay_off:
            return 1 << 30
        return max(1, self._probe_every - self._plain_since_probe)

    # -- observations ------------------------------------------------------------------------------
    def _sample(self, k: int, seconds: float) -> None:
        self._seconds.setdefault(k, collections.deque(maxlen=COST_WINDOW)).append(seconds)

    def observe_round(self, k: int, accepted: int, seconds: float | None = None) -> None:
        """A round at depth k accepted ``accepted`` drafts in ``seconds`` (None: not a representative
        round, e.g. one that first caught the head up on a long plain stretch)."""
        self._rounds_run += 1
        self.tracker.observe(k, accepted)
        # A probe whose drafts land does not bring the next probe forward: what it measured already moves
        # ``choose`` to a depth when one pays; when none does (the device, not the head, is the reason),
        # eager probing would cost a round every few tokens for good.
        if seconds is not None and k > 0:
            self._sample(k, seconds)

    def observe_plain(self, tokens: int, seconds: float | None = None) -> None:
        self._plain_since_probe += tokens
        if seconds is not None and tokens > 0:
            self._sample(0, seconds / tokens)
