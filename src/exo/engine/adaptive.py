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

from dataclasses import dataclass, field

# A depth must beat plain decoding by this factor to be chosen: measurement noise must not make the
# policy oscillate into slower configurations.
MIN_GAIN = 1.03
PRIOR_ACCEPTANCE = 0.6  # before any observation (a typical trained head accepts 0.6-0.85)
PRIOR_WEIGHT = 2.0  # pseudo-observations behind the prior
FORGET = 0.97  # per observation: recent rounds matter more (acceptance varies with the text)
PROBE_FIRST = 16  # plain tokens before the first probe when K = 0 was chosen on acceptance
PROBE_MAX = 512


@dataclass(frozen=True)
class DepthCosts:
    """Costs of a round at depth K relative to one plain decode step; index K-1 for K = 1..max_k."""

    beta: tuple[float, ...]  # verify of K+1 rows
    delta: tuple[float, ...]  # drafting K tokens with the head
    device: str = ""
    plain_s: float | None = None  # seconds of one plain decode step when measured

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
    """Chooses the depth of each round. ``fixed_k`` forces a depth (0..max_k) and disables adaptation."""

    costs: DepthCosts
    max_k: int
    default_k: int = 1
    fixed_k: int | None = None
    tracker: AcceptanceTracker = field(init=False)
    _measured: dict[int, float] = field(default_factory=dict, init=False)  # EMA seconds per round by K
    _plain_step_s: float | None = field(default=None, init=False)
    _plain_since_probe: int = field(default=0, init=False)
    _probe_every: int = field(default=PROBE_FIRST, init=False)
    _rounds_run: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.max_k = min(self.max_k, self.costs.max_k)
        self.default_k = min(self.default_k, self.max_k)
        self.tracker = AcceptanceTracker(self.max_k)
        self._plain_step_s = self.costs.plain_s

    # -- costs -----------------------------------------------------------------------------------
    def effective_costs(self) -> DepthCosts:
        """Warm-up costs, replaced by measured round times once both sides have been observed."""
        if self._plain_step_s is None or not self._measured:
            return self.costs
        beta = list(self.costs.beta)
        delta = list(self.costs.delta)
        for k, seconds in self._measured.items():
            if 1 <= k <= len(beta):
                # The measurement covers verify + draft together; keep the warm-up split.
                total = seconds / self._plain_step_s
                share = beta[k - 1] / (beta[k - 1] + delta[k - 1])
                beta[k - 1], delta[k - 1] = total * share, total * (1.0 - share)
        return DepthCosts(tuple(beta), tuple(delta), self.costs.device, self._plain_step_s)

    @property
    def mtp_can_pay_off(self) -> bool:
        if self.fixed_k is not None:
            return self.fixed_k > 0
        return can_pay_off(self.effective_costs(), self.max_k)

    def new_request(self) -> None:
        """A new generation: acceptance and costs learned so far stay, the probe schedule restarts."""
        self._plain_since_probe = 0
        self._probe_every = PROBE_FIRST

    # -- decisions ---------------------------------------------------------------------------------
    def choose(self) -> int:
        if self.fixed_k is not None:
            return self.fixed_k
        costs = self.effective_costs()
        if not can_pay_off(costs, self.max_k):
            return 0
        if self._rounds_run == 0 and self.default_k > 0:
            return self.default_k
        k, _ = best_depth(costs, self.tracker.rates(), self.max_k)
        if k == 0 and self._plain_since_probe >= self._probe_every:
            self._plain_since_probe = 0
            self._probe_every = min(self._probe_every * 2, PROBE_MAX)
            return 1
        return k

    def plain_budget(self) -> int:
        """Plain tokens to run before asking ``choose`` again (pipelined without host decisions)."""
        if self.fixed_k is not None or not self.mtp_can_pay_off:
            return 1 << 30
        return max(1, self._probe_every - self._plain_since_probe)

    # -- observations ------------------------------------------------------------------------------
    def observe_round(self, k: int, accepted: int, seconds: float | None = None) -> None:
        self._rounds_run += 1
        self.tracker.observe(k, accepted)
        if accepted > 0 and k > 0:
            self._probe_every = PROBE_FIRST  # drafts are landing again: probe eagerly next time
        if seconds is not None and k > 0:
            previous = self._measured.get(k)
            self._measured[k] = seconds if previous is None else 0.8 * previous + 0.2 * seconds

    def observe_plain(self, tokens: int, seconds: float | None = None) -> None:
        self._plain_since_probe += tokens
        if seconds is not None and tokens > 0:
            per_token = seconds / tokens
            previous = self._plain_step_s
            self._plain_step_s = per_token if previous is None else 0.8 * previous + 0.2 * per_token
