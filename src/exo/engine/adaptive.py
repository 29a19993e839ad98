"""Adaptive draft depth: pick the K with the best expected tokens per second, on this machine.

A round at depth K costs beta(K) + delta(K) plain decode steps (beta: the (K+1)-row verify, delta: K
draft steps of the head) and yields 1 + a1 + a1*a2 + ... + a1*...*aK tokens on average, a_i being the
acceptance rate at draft position i given that position i-1 was accepted. K = 0 is plain decoding
(cost 1, one token). Costs come from a warm-up measurement and are refined by the rounds actually run,
relative to the machine's speed of the moment (the depth the policy runs measures that speed, and what
runs beside it is timed against it), and a depth timed again after a stretch elsewhere lets its new
timings outvote its old ones; acceptance is tracked per position with exponential forgetting. When the
best K is 0 the policy still probes its most
promising depth now and then (exponentially rarer) in case acceptance or costs changed, unless even
perfect acceptance could not pay off on this machine (e.g. a compute-bound CPU where beta(1) ~ 2), in
which case it never probes and MTP costs nothing.

In a batch (``BatchDepthPolicy``) one K serves every member of a round, chosen per batch-size bucket
(1, 2, 3-4, 5-8, 9-16, 17+) from that bucket's own live timings of a batched plain step and of batched
rounds, with the same acceptance tracker: a verify call of B x (K+1) rows costs what the device makes of
B x (K+1) rows, so a compute-bound device goes to K = 0 as B grows while a bandwidth-bound one keeps
drafting. A bucket first times its plain step; until its rounds are timed it estimates them from the solo
warm-up costs scaled by its measured rows-cost factor (``batch_costs``).

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

# A depth must beat plain decoding by this factor to be chosen: measurement noise must not make the
# policy oscillate into slower configurations.
MIN_GAIN = 1.03
# A batch of several starts drafting only on a clear margin: its members' acceptance runs below the solo
# acceptance its estimates use (heads fall behind while the batch decodes plainly: 0.50 against 0.77 serving
# exo-demo to 8 clients on an H100), and every batch size explores on its own.
BATCH_ENTRY_GAIN = 1.15
PRIOR_ACCEPTANCE = 0.6  # before any observation (a typical trained head accepts 0.6-0.85)
PRIOR_WEIGHT = 1.0  # pseudo-observations behind the prior (2 held a good head's first rates near 0.6 longer)
# A probe from K = 0 (and whether a depth that never ran is worth one) goes by each position's rate plus this
# many standard errors of its evidence: a position judged on one or two drafts is uncertain, not bad. Only
# probes: choosing the running depth on optimistic rates kept drafting where every depth ran 0.9x plain
# (bench/adaptive_sim.py@3c719fd, h100-marginal: 0.97 -> 0.92x the fastest fixed depth).
OPTIMISM = 1.0
# The warm-up's greedy text (``Engine.warm_acceptance``) counts for at most this many rounds of evidence: the
# head's acceptance on the model's own text before any request, where the prior alone is a guess (0.6 against
# 0.9 on exo-demo: the first requests' few rounds decided K = 0 at 0.88x the fastest fixed depth on an H200).
WARM_WEIGHT = 6.0
FORGET = 0.97  # per observation: recent rounds matter more (acceptance varies with the text)
# While the policy decodes plainly it observes no drafts, and its estimates stay where the rounds that made it
# leave drafting put them: a stretch of hard text, a dip selected by the leaving itself. exo-demo-moe on an H200
# (K = 2 at 1.035x plain) estimated 0.80/0.73 at K = 0 against 0.87/0.80 over its own K = 2 rounds, and
# decoded whole requests plainly: 0.973-0.979x the fixed K = 2. So every plain token ages the recent evidence by
# IDLE_FORGET (a request of 128 plain tokens leaves 2% of it), and each position's rate reverts to the head's
# long-run rate (its evidence forgotten at LONG_FORGET per round, ~200 rounds), which stands for REVERT_WEIGHT
# rounds beside the recent ones. Seven H200 runs (bench/results/h200-mlx-cuda-adaptive-revert-2026-11-27.txt):
# adaptive 0.968-0.994x the fastest fixed configuration, 6 of 7 at 0.97 or more; the tracker before, in the same
# runs, 0.962-0.993x, 4 of 7.
IDLE_FORGET = 0.97
LONG_FORGET = 0.995
REVERT_WEIGHT = 4.0
PROBE_FIRST = 16  # plain tokens before the first probe when K = 0 was chosen on acceptance
PROBE_MAX = 512
# Where even the most promising depth, at its live cost and optimistic acceptance, misses the entry gain by
# FAR_MISS or more, the backoff goes on doubling up to PROBE_FAR_MAX: a probe there finds what the last one
# found. exo-demo on an H200 (every depth 0.83-0.86x plain): a probe every 512 tokens (a K = 3 round and the
# head's catch-up on its waiting rows, ~4% of a 128-token request) cost adaptive 1.1% against a run of the same
# engine that never probed (80 pairs each: 0.988x plain against 0.999x).
# Only once FAR_PROBES probes in a row found it so: one probe timed in a slow moment (exo-demo-moe on an H200:
# K = 2 at 3.4 plain steps where it ran at 2.4, 0.8x plain) must not put off the next probes for 16 requests.
FAR_MISS = 1.1
FAR_PROBES = 2
PROBE_FAR_MAX = 2048
# A new request's text may suit the head better: its first probe comes after at most this many plain tokens
# (then the backoff goes on doubling). Restarting at PROBE_FIRST cost three probes in every 128-token request
# at K = 0 (16, 48, 112): on an H100, where a probe with its head catch-up costs a few plain tokens, 3-7%.
PROBE_RESTART = 64
# What a depth is known to cost (live, else its warm-up) may be this much too high: a timing taken in a busy
# moment, a warm-up beside other work. Whether a depth could pay off (a probe restart, a probe of several
# rounds) is judged at its cost divided by this (bench/adaptive_sim.py@3c719fd: 1.05 and 1.1 alike; 1.15 let
# exo-demo's probes of a depth that never pays back in).
LIVE_DOUBT = 1.05
DEEPER_PROBE_FIRST = 8  # rounds at K before a round at K + 1, doubling up to DEEPER_PROBE_MAX
DEEPER_PROBE_MAX = 256
COST_WINDOW = 16  # live timings kept per depth (their median is the depth's cost)
MIN_ROUND_SAMPLES = 3  # round timings before they replace a depth's warm-up estimate
# A depth timed again after this many tokens run at other depths keeps only its STALE_KEEP newest timings
# besides the new one: they stood for the machine as it was then. On an H100 (exo-demo-moe) a first request's
# slow rounds (2.2 plain steps at K = 1 where later requests measured 1.8) sent the policy to K = 0, and 16
# old timings outvoted every later probe: adaptive ran at 0.86x a fixed K = 2 over 8 requests.
STALE_TOKENS = 64
STALE_KEEP = 2  # with the new timing, a median of three: one odd timing moves nothing, two fresh ones agree
# While drafting, a shallower depth is timed again now and then, when its timings are stale: nothing else
# runs it, and on a shared machine its old timings stand for another moment. On this CPU (exo-demo) the
# policy timed plain tokens at 11.3 ms and K = 1 rounds at 21.1 ms in a slow minute, then drafted at K = 3
# for the rest of the run against those figures (1.36-1.47x plain by its estimate; K = 3 ran at 1.02x,
# K = 1 at 1.12x): 0.93x the best fixed depth. After REFRESH_FIRST rounds at K >= 1 (doubling up to
# REFRESH_MAX), the stalest shallower depth runs REFRESH_SAMPLES times in a row (plain: bursts of
# REFRESH_PLAIN_TOKENS), enough to outvote the STALE_KEEP old timings.
REFRESH_FIRST = 16
REFRESH_MAX = 256
REFRESH_SAMPLES = 3
# Plain bursts shorter than this are not timed for the depth policy: their first step is built before any
# compute overlaps it (on this CPU a 5-token burst measured 11.8 ms a token against 9.7 in long ones).
PLAIN_TIMED_MIN = 8
REFRESH_PLAIN_TOKENS = PLAIN_TIMED_MIN  # a refresh's plain bursts: timed ones
# A shared machine's speed drifts (this CPU: K = 1 rounds at 15.7 ms in one minute, 21.6 in another), and a
# depth timed in a slow minute compared with one timed in a fast minute is a comparison of minutes: the policy
# drafted at K = 3 (1.03x plain) for a whole run while K = 2 ran at 1.11x. So the policy tracks the machine's
# speed: once the depth it runs has SETTLE_SAMPLES timings, its further timings measure the machine (each one
# over that depth's cost: a level) instead of the depth; every other timing (a probe, a refresh, a deeper
# probe, the first ones of a depth) is divided by the level of the timings just before it (the median of the
# last LEVEL_SAMPLES within LEVEL_TOKENS tokens), so that what a depth's window keeps are its costs relative to
# the depth it ran beside, whatever minute each was timed in.
SETTLE_SAMPLES = 10
# Plain decoding is the unit every depth's cost is counted in: nothing of its own to learn, so while it runs,
# every timing of it after its first is a level. Probes from K = 0 are then judged against the plain burst
# timed just before them, a tight pair. With plain decoding settling like a depth, at SETTLE_SAMPLES timings
# (a request or more of long bursts), an H200 host that ran a first request's plain tokens at 3.0 ms and later
# ones at 2.2 judged a K = 3 probe taken in a fast moment against the slow window's median: 2.4 plain steps
# where K = 3 cost 3.4, and adaptive drafted at K = 3 (0.85x plain) through eight requests (0.93x plain).
# A plain burst's level stands alone (it already averages its tokens), not in a median with older ones.
PLAIN_SETTLE_SAMPLES = 1
LEVEL_SAMPLES = 5
LEVEL_TOKENS = 64


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


def can_pay_off(costs: DepthCosts, max_k: int, min_gain: float = MIN_GAIN) -> bool:
    """Whether any depth would beat plain decoding even if every draft were accepted."""
    return best_depth(costs, [1.0] * max_k, max_k, min_gain)[0] > 0


@dataclass
class AcceptanceTracker:
    """Per-position conditional acceptance with exponential forgetting (per round, and per plain token while
    nothing is observed: ``idle``) and a prior it reverts to: the position's long-run rate, and where that has
    not been seen, PRIOR_ACCEPTANCE for the first position and for each deeper one the rate of the position
    before it (``idle_forget`` 1 and ``revert_weight`` 0: the tracker before reverting, the prior weighted
    PRIOR_WEIGHT). A depth's deeper positions
    are measured only once that depth runs; with a fixed prior (0.6) a head that lands 90% of its first
    drafts made K + 1 look no better than K, so it never ran (exo-demo on this CPU stayed at K = 1 where
    K = 2 and 3 were 5-6% faster)."""

    max_k: int
    accepted: list[float] = field(default_factory=list)  # observed, forgetting applied (no prior)
    reached: list[float] = field(default_factory=list)
    long_accepted: list[float] = field(default_factory=list)  # the same, forgetting LONG_FORGET
    long_reached: list[float] = field(default_factory=list)
    idle_forget: float = field(default_factory=lambda: IDLE_FORGET)
    revert_weight: float = field(default_factory=lambda: REVERT_WEIGHT)

    def __post_init__(self) -> None:
        self.accepted = [0.0] * self.max_k
        self.reached = [0.0] * self.max_k
        self.long_accepted = [0.0] * self.max_k
        self.long_reached = [0.0] * self.max_k

    def observe(self, k: int, accepted: int) -> None:
        """A round drafted k tokens and accepted the first ``accepted`` of them."""
        for i in range(min(k, self.max_k)):
            if i > accepted:
                break  # position i was never tested
            self.reached[i] = self.reached[i] * FORGET + 1.0
            self.accepted[i] = self.accepted[i] * FORGET + (1.0 if i < accepted else 0.0)
            self.long_reached[i] = self.long_reached[i] * LONG_FORGET + 1.0
            self.long_accepted[i] = self.long_accepted[i] * LONG_FORGET + (1.0 if i < accepted else 0.0)

    def idle(self, tokens: int) -> None:
        """``tokens`` plain tokens ran: nothing observed, the recent evidence ages (``idle_forget``)."""
        if self.idle_forget < 1.0 and tokens > 0:
            scale = self.idle_forget ** tokens
            self.accepted = [a * scale for a in self.accepted]
            self.reached = [r * scale for r in self.reached]

    def absorb(self, other: AcceptanceTracker, weight: float = WARM_WEIGHT) -> None:
        """Add ``other``'s evidence (the warm-up's rounds), counted as at most ``weight`` rounds."""
        scale = min(1.0, weight / other.reached[0]) if other.reached[0] else 1.0
        for i in range(min(self.max_k, other.max_k)):
            self.accepted[i] += other.accepted[i] * scale
            self.reached[i] += other.reached[i] * scale
            self.long_accepted[i] += other.accepted[i] * scale
            self.long_reached[i] += other.reached[i] * scale

    def rates(self) -> list[float]:
        return self._rates(0.0)

    def optimistic_rates(self) -> list[float]:
        """Each position's rate plus OPTIMISM standard errors of its evidence (observations and prior), a
        deeper position's prior being the optimistic rate of the one before it."""
        return self._rates(OPTIMISM)

    def _rates(self, errors: float) -> list[float]:
        out, prior = [], PRIOR_ACCEPTANCE
        for i, (a, r) in enumerate(zip(self.accepted, self.reached, strict=True)):
            if self.revert_weight:
                # The long-run rate (the position before's rate standing in for what it has not seen) is
                # where the recent evidence reverts to as it ages.
                lr = self.long_reached[i]
                prior = (self.long_accepted[i] + prior * PRIOR_WEIGHT) / (lr + PRIOR_WEIGHT)
                rate = (a + prior * self.revert_weight) / (r + self.revert_weight)
                seen = max(r, min(lr, 1.0 / (1.0 - FORGET))) + PRIOR_WEIGHT  # all it has seen of the position
            else:
                rate = (a + prior * PRIOR_WEIGHT) / (r + PRIOR_WEIGHT)
                seen = r + PRIOR_WEIGHT
            if errors:
                rate = min(1.0, rate + errors * math.sqrt(rate * (1.0 - rate) / seen))
            prior = rate
            out.append(rate)
        return out


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
    # Whether drafting can pay off at all, when another policy decided it (a batch-size bucket: the solo
    # warm-up's verdict); None: from ``costs``.
    can_draft: bool | None = None
    # What a depth must promise over plain decoding before the policy starts drafting (leaving a depth for
    # another always takes MIN_GAIN).
    entry_gain: float = MIN_GAIN
    # Whether timings are taken relative to the machine's speed of the moment (see SETTLE_SAMPLES); a batch
    # bucket keeps raw timings (its rows cost is a ratio of seconds to the solo policy's).
    track_drift: bool = True
    # Whether a probe from K = 0 may run several rounds: a deeper depth that never ran, or a depth whose
    # timings are stale (see ``choose``); a batch bucket probes single rounds.
    explore_deeper: bool = True
    # The longest probe backoff where every depth misses by FAR_MISS (PROBE_FAR_MAX; PROBE_MAX: as before it)
    probe_far_max: int = field(default_factory=lambda: PROBE_FAR_MAX)
    # Called with every decision and observation (``EXO_ADAPTIVE_TRACE``: JSON lines for bench/adaptive_sim.py@3c719fd)
    trace: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False, compare=False)
    tracker: AcceptanceTracker = field(init=False)
    _seconds: dict[int, collections.deque[float]] = field(default_factory=dict, init=False)
    _current: int = field(default=0, init=False)
    _plain_since_probe: int = field(default=0, init=False)
    _rounds_since_deeper: int = field(default=0, init=False)
    _deeper_every: int = field(default=DEEPER_PROBE_FIRST, init=False)
    _rounds_since_refresh: int = field(default=0, init=False)
    _refresh_every: int = field(default=REFRESH_FIRST, init=False)
    _refresh: list[int] = field(default_factory=list, init=False)  # depths still to run (a refresh, a probe of rounds)
    _plain_refresh: bool = field(default=False, init=False)  # the plain burst just chosen is a refresh
    _probe_every: int = field(default=PROBE_FIRST, init=False)
    _far_probes: int = field(default=0, init=False)  # probes in a row that found every depth FAR_MISS short
    _rounds_run: int = field(default=0, init=False)
    _view: tuple[DepthCosts, list[float]] | None = field(default=None, init=False, repr=False)  # choose's, for the trace
    _tokens: int = field(default=0, init=False)  # tokens run under this policy (a batch bucket: steps)
    _timed_at: dict[int, int] = field(default_factory=dict, init=False)  # ``_tokens`` at a depth's last timing
    _sampled_at: dict[int, int] = field(default_factory=dict, init=False)  # ``_tokens`` at the end of its last timed run
    # (``_tokens``, seconds over the running depth's cost): the machine's speed, from the depth it runs
    _levels: collections.deque[tuple[int, float]] = field(
        default_factory=lambda: collections.deque(maxlen=LEVEL_SAMPLES), init=False
    )

    def __post_init__(self) -> None:
        self.max_k = min(self.max_k, self.costs.max_k)
        self.default_k = min(self.default_k, self.max_k)
        self.tracker = AcceptanceTracker(self.max_k)

    # -- costs -----------------------------------------------------------------------------------
    @property
    def rounds_run(self) -> int:
        return self._rounds_run

    def _median(self, k: int) -> float | None:
        samples = self._seconds.get(k)
        # A plain timing already averages a stretch of tokens; one round is one round: wait for a few.
        enough = 1 if k == 0 else MIN_ROUND_SAMPLES
        return statistics.median(samples) if samples and len(samples) >= enough else None

    def plain_step_s(self) -> float | None:
        """Seconds per plain token: live (in the units of the depths' windows: see ``level``), else the
        warm-up's pipelined steps, else its step alone."""
        return self._median(0) or self.costs.plain_pipelined_s or self.costs.plain_s

    def level(self) -> float:
        """The machine's speed now, as a factor on the windows' timings (1: as when the running depth's
        cost was settled): the median of the newest levels, those within LEVEL_TOKENS tokens of the last."""
        if not self._levels:
            return 1.0
        newest = self._levels[-1][0]
        return statistics.median(v for at, v in self._levels if newest - at <= LEVEL_TOKENS)

    def plain_step_now_s(self) -> float | None:
        """Seconds a plain token takes at the machine's speed now."""
        plain = self.plain_step_s()
        return plain * self.level() if plain is not None else None

    def _warm_step_s(self) -> float | None:
        """Seconds of the warm-up's unit (one plain step alone: beta and delta count those), in the windows'
        units (seconds over ``level``): a depth never timed is estimated against plain decoding as it runs now
        (its warm-up cost over a window of plain timings from a slow first request read K = 3 at 2.5 plain
        steps where it cost 3.4)."""
        return self.costs.plain_s / self.level() if self.costs.plain_s else self.plain_step_s()

    def _glue(self) -> float:
        """Measured round time over the warm-up time of its parts, over the depths measured (1 if none)."""
        unit = self._warm_step_s()
        ratios = [
            measured / (self.costs.round_cost(k) * unit)
            for k in range(1, self.costs.max_k + 1)
            if unit and (measured := self._median(k)) is not None and self.costs.round_cost(k) > 0
        ]
        return statistics.median(ratios) if ratios else 1.0

    def effective_costs(self) -> DepthCosts:
        """Costs in plain tokens as the decode loop runs them (pipelined), measured live; a depth not measured
        yet: its warm-up time, times how much slower than theirs the measured depths ran."""
        plain, unit = self.plain_step_s(), self._warm_step_s()
        if plain is None or unit is None or (not self._seconds and unit == plain):
            return self.costs
        glue = self._glue()
        beta, delta = list(self.costs.beta), list(self.costs.delta)
        for k in range(1, len(beta) + 1):
            warm = beta[k - 1] + delta[k - 1]
            measured = self._median(k)
            total = measured / plain if measured is not None else warm * unit * glue / plain
            share = beta[k - 1] / warm if warm else 1.0  # keep the warm-up split of verify and drafts
            # A verify of K+1 rows never costs less than one row (as at warm-up): a round timed in a fast
            # moment against plain tokens timed in a slow one can say so (a pipeline's beta(1) read 0.991).
            beta[k - 1], delta[k - 1] = max(1.0, total * share), total * (1.0 - share)
        return DepthCosts(tuple(beta), tuple(delta), self.costs.device, plain * self.level(), self.costs.stages)

    def drafting_pays(self) -> bool:
        """Whether some depth beats plain decoding by ``MIN_GAIN`` at the costs and acceptance measured so far
        (no probe, no state change)."""
        return best_depth(self.effective_costs(), self.tracker.rates(), self.max_k, self.entry_gain)[0] > 0

    @property
    def mtp_can_pay_off(self) -> bool:
        if self.fixed_k is not None:
            return self.fixed_k > 0
        if self.can_draft is not None:
            return self.can_draft
        return can_pay_off(self.costs.in_pipelined_steps(), self.max_k, self.entry_gain)

    def new_request(self) -> None:
        """A new generation: acceptance and costs learned so far stay; the probe backoff restarts at no more
        than ``PROBE_RESTART`` plain tokens if the acceptance measured so far could pay at some depth (a new
        text may suit the head better). Where it could not, the backoff goes on doubling and the plain tokens
        since the last probe carry over: probes go on across requests, rarer and rarer, instead of one per
        request. Restarting where nothing could pay cost a round of rejected drafts in every short request (a
        random Qwen3.5-9B on an H200, 64-token requests: adaptive 0.85x plain), and three rounds at K = 3 in
        every 128-token request where no depth paid (exo-demo on an H200 once plain decoding ran at 1.1x stock:
        every depth at 0.80-0.84x plain, adaptive at 0.97-0.98x plain; bench/adaptive_sim.py@3c719fd h200-exo-demo-1127:
        0.977 -> 0.995x the fastest fixed depth). A depth timed live is judged here by its live cost alone, stale
        or not: an H200 warm-up timed exo-demo's K = 2 at 2.5 plain steps, its rounds ran at 2.8-3.6 for 2.7
        tokens, and the warm-up figure restarted a three-round probe of K = 2 in each of 20 requests (the
        probes themselves still renew a stale depth that its warm-up says could pay)."""
        if self.trace is not None:
            self.trace({"event": "request"})
        costs = self.effective_costs()
        if any(self._could_pay(d, costs, stale_warm=False) for d in range(1, self.max_k + 1)):
            self._plain_since_probe = 0
            self._probe_every = min(self._probe_every, PROBE_RESTART)
        self._deeper_every = DEEPER_PROBE_FIRST

    def _could_pay(self, d: int, costs: DepthCosts, rates: list[float] | None = None, against: float = 1.0,
                   stale_warm: bool = True) -> bool:
        """Whether depth d could beat plain decoding (or a depth of expected speedup ``against``) by the entry gain
        at the acceptance measured (``rates``), if it cost LIVE_DOUBT times less than what is known of it: its
        live timings where it has them (or its warm-up cost if less, once they are stale and ``stale_warm``); else
        its warm-up cost, or what the shallower depths measured live cost if that is less (a deeper round
        costs at least that). A depth's own live cost is what its next rounds will cost give or take the
        machine's drift (its timings are taken relative to the machine's speed: ``level``); the warm-up cost
        of a depth never timed is the best estimate there is, and a shallower depth's live cost is a floor
        for it. (Bounding every depth by 1 + its drafts alone, a verify call as cheap as a plain step, kept
        exo-demo's K = 3 looking affordable at 1.4 plain steps where it had run at 3.9.)"""
        warm = self.costs.in_pipelined_steps()
        if self._median(d) is not None:
            optimistic = self._hoped_cost(d, costs) if stale_warm else costs.round_cost(d)
        else:
            below = [costs.round_cost(j) for j in range(1, d) if self._median(j) is not None]
            optimistic = min(warm.round_cost(d), max(below)) if below else warm.round_cost(d)
        return expected_tokens(rates or self.tracker.rates(), d) > optimistic / LIVE_DOUBT * self.entry_gain * against

    def _hoped_cost(self, d: int, costs: DepthCosts) -> float:
        """Depth d's cost (``costs``), or its warm-up cost if that is less once its live timings are stale: what
        a probe hopes it costs now."""
        if self._median(d) is not None and self._is_stale(d):
            return min(costs.round_cost(d), self.costs.in_pipelined_steps().round_cost(d))
        return costs.round_cost(d)

    # -- decisions ---------------------------------------------------------------------------------
    def choose(self) -> int:
        self._view = None
        k = self._choose()
        if self.trace is not None:
            costs, rates = self._view or (self.effective_costs(), self.tracker.rates())
            self.trace({"event": "choose", "k": k, "rates": rates, "round_costs": [
                costs.round_cost(d) for d in range(1, self.max_k + 1)], "plain_s": self.plain_step_s(),
                "level": self.level()})
        return k

    def _choose(self) -> int:
        if self.fixed_k is not None:
            return self.fixed_k
        if not self.mtp_can_pay_off:
            return 0
        if self._refresh:
            depth = self._refresh.pop()
            self._plain_refresh = depth == 0
            return depth
        if self._rounds_run == 0 and self.default_k > 0 and not self.tracker.reached[0]:  # nothing seen yet
            self._current = self.default_k
            return self.default_k
        costs = self.effective_costs()
        rates = self.tracker.rates()
        self._view = costs, rates
        speed = {k: expected_speedup(costs, rates, k) for k in range(0, self.max_k + 1)}
        best = max(speed, key=lambda k: (speed[k], -k))
        # Hysteresis: leave the current depth only for one that is clearly faster (timings are noisy).
        current = min(self._current, self.max_k)
        k = best if speed[best] > speed[current] * (self.entry_gain if current == 0 else MIN_GAIN) else current
        self._current = k
        if k == 0 and self._plain_since_probe >= self._probe_every:
            self._plain_since_probe = 0
            hopes = self.tracker.optimistic_rates()
            far = all(expected_speedup(costs, hopes, d) * FAR_MISS < self.entry_gain for d in range(1, self.max_k + 1))
            self._far_probes = self._far_probes + 1 if far else 0
            ceiling = self.probe_far_max if self._far_probes >= FAR_PROBES else PROBE_MAX
            self._probe_every = min(self._probe_every * 2, ceiling)
            # A probe at the most promising depth (the current one stays 0 unless it shows otherwise): it
            # times that depth and measures its positions, so stale figures for a deeper depth get renewed
            # (probing only K = 1 left an H100's K = 2 judged by its first request's rounds for good).
            # A depth deeper than every depth that ran goes first, for MIN_ROUND_SAMPLES rounds in a row
            # (enough to be judged on its own timings), if it could pay off at the acceptance measured when it
            # cost what the depth below it costs (a deeper round costs at least that): its estimate is the
            # measured depths' glue on its warm-up cost, and glue differs by depth (an H100, exo-demo: K = 1
            # ran 0.94x plain, K = 2 1.04x, yet only K = 1 was ever probed from K = 0, 22 times in 3000 tokens).
            # The same goes for a depth whose timings are stale (STALE_TOKENS old, as a probe's usually are):
            # one new timing among the STALE_KEEP old ones moves nothing, and timings from a slow minute
            # (an H100: a first request's, before plain decoding was timed live) kept adaptive decoding
            # plainly for three requests of one probe each where K = 2 ran 1.2x plain.
            # A depth whose live timings are stale is ranked by its warm-up cost if that is less (``_hoped_cost``,
            # as ``_could_pay`` judges it). Ranked by their live costs, one probe of K = 2 timed at 3.45 plain
            # steps in a slow moment (its rounds ran at 2.0-2.5 before and after) made K = 1 the most promising
            # depth, and every probe of the next 50 requests went to K = 1 (0.9x plain) while K = 2's figure
            # stood: exo-demo-moe on an H200 decoded them plainly where a fixed K = 2 ran 1.03x plain.
            hoped = {d: expected_tokens(hopes, d) / (self._hoped_cost(d, costs) if self.explore_deeper
                                                     else costs.round_cost(d)) for d in range(1, self.max_k + 1)}
            ran = max((d for d in self._timed_at if d > 0), default=0)
            never_ran = [d for d in range(ran + 1, self.max_k + 1) if self._could_pay(d, costs, hopes)]
            if never_ran and self.explore_deeper:
                depth = max(never_ran, key=lambda d: (hoped[d], -d))
            else:
                depth = max(range(1, self.max_k + 1), key=lambda d: (hoped[d], -d))
            if self.explore_deeper and self._could_pay(depth, costs, hopes) and (depth not in self._timed_at or self._is_stale(depth)):
                self._refresh = [depth] * (MIN_ROUND_SAMPLES - 1)
            return depth
        # Only against live timings of the current depth: figures all from the warm-up are of one moment.
        if k >= 1 and k in self._sampled_at and self._rounds_since_refresh >= self._refresh_every:
            self._rounds_since_refresh = 0
            self._refresh_every = min(self._refresh_every * 2, REFRESH_MAX)
            stale = [d for d in range(k) if self._is_stale(d)]
            if stale:
                oldest = min(stale, key=lambda d: self._sampled_at.get(d, -1))
                self._refresh = [oldest] * (REFRESH_SAMPLES - 1)
                self._plain_refresh = oldest == 0
                return oldest
        if 1 <= k < self.max_k and self._rounds_since_deeper >= self._deeper_every:
            # A probe one deeper: rounds at K measure positions 1..K only, so without it one unlucky round
            # at K + 1 (or the prior) would stand for that position for good (exo-demo on this CPU stayed at
            # K = 1 after a single K = 2 round rejected its second draft). Rarer and rarer, like plain probes.
            self._rounds_since_deeper = 0
            self._deeper_every = min(self._deeper_every * 2, DEEPER_PROBE_MAX)
            # Like a probe from K = 0: a deeper depth with no live cost yet, or only stale timings, that could
            # beat this one (at optimistic acceptance, its cost over LIVE_DOUBT) runs MIN_ROUND_SAMPLES rounds,
            # enough to be judged on its own timings (one new round among the stale window's two moves
            # nothing). On this CPU K = 3's first rounds, timed in the first request, stood at 2.5 plain steps
            # through four requests of single-round probes while it ran at 1.9: adaptive decoded at K = 1-2
            # meanwhile, at 0.94x a fixed K = 3.
            if self.explore_deeper and (self._median(k + 1) is None or self._is_stale(k + 1)) and self._could_pay(
                k + 1, costs, self.tracker.optimistic_rates(), against=speed[k]
            ):
                self._refresh = [k + 1] * (MIN_ROUND_SAMPLES - 1)
            return k + 1
        return k

    def plain_budget(self) -> int:
        """Plain tokens to run before asking ``choose`` again (pipelined without host decisions)."""
        if self.fixed_k is not None or not self.mtp_can_pay_off:
            return 1 << 30
        if self._plain_refresh:
            self._plain_refresh = False
            return REFRESH_PLAIN_TOKENS
        return max(1, self._probe_every - self._plain_since_probe)

    # -- observations ------------------------------------------------------------------------------
    def _sample(self, k: int, seconds: float) -> None:
        window = self._seconds.setdefault(k, collections.deque(maxlen=COST_WINDOW))
        if self.track_drift:
            if k == self._current and len(window) >= (SETTLE_SAMPLES if k else PLAIN_SETTLE_SAMPLES):
                # The running depth, settled: its timing says how fast the machine runs now. A plain burst is
                # already a mean over its tokens: the newest stands alone (a probe's pair).
                if k == 0:
                    self._levels.clear()
                self._levels.append((self._tokens, seconds / statistics.median(window)))
                return
            seconds /= self.level()
        last = self._timed_at.get(k)
        if last is not None and self._tokens - last >= STALE_TOKENS:
            while len(window) > STALE_KEEP:
                window.popleft()
        window.append(seconds)

    def _is_stale(self, k: int) -> bool:
        """Whether depth k's live timings are STALE_TOKENS or more tokens old; plain decoding's too when it has
        none (every depth is judged against it: the warm-up's plain steps then stand for it, timed in another
        moment: on this CPU once at 12.2 ms where live plain tokens took ~9.5)."""
        last = self._sampled_at.get(k)
        if last is None:
            return k == 0 and self._tokens >= STALE_TOKENS
        return self._tokens - last >= STALE_TOKENS

    def _ran(self, k: int, tokens: int, seconds: float | None) -> None:
        """Depth k ran ``tokens`` tokens (timed: ``seconds`` per plain token or per round)."""
        if seconds is not None:
            self._sample(k, seconds)
        self._tokens += tokens
        if seconds is not None:
            self._sampled_at[k] = self._tokens  # as of the end of the run timed (a plain burst: its last token)
        self._timed_at[k] = self._tokens

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
        self._rounds_since_deeper += 1
        self._rounds_since_refresh += 1
        # A probe whose drafts land does not bring the next probe forward: what it measured already moves
        # ``choose`` to a depth when one pays; when none does (the device, not the head, is the reason),
        # eager probing would cost a round every few tokens for good.
        if k > 0:
            self._ran(k, tokens, seconds)

    def observe_plain(self, tokens: int, seconds: float | None = None) -> None:
        if self.trace is not None:
            self.trace({"event": "plain", "tokens": tokens, "seconds": seconds})
        self._plain_since_probe += tokens
        self.tracker.idle(tokens)
        if tokens > 0:
            self._ran(0, tokens, None if seconds is None else seconds / tokens)


TRACE_ENV = "EXO_ADAPTIVE_TRACE"
TRACE_BUFFER = 100_000  # events held at most (a request of 128 tokens leaves ~100)


def trace_from_env(costs: DepthCosts, max_k: int) -> Callable[[dict[str, Any]], None] | None:
    """Where ``EXO_ADAPTIVE_TRACE`` names a file: a tracer appending each event as a JSON line (with its
    time), the policy's warm-up costs first. A trace replays the policy's view of a real run (what it saw,
    what it chose) for bench/adaptive_sim.py@3c719fd."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return None
    start = time.perf_counter()
    # Events wait in memory and go to the file at each new request (before its prefill, off the decode path),
    # every TRACE_BUFFER events, and at exit: a file opened and written per event cost ~0.1 ms a round, 1-1.5%
    # of an H200's 6-9 ms rounds, which traced runs then charged to adaptive alone.
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
    timings (seconds of a whole batched step or round), sharing the solo policy's acceptance tracker and
    its verdict on whether drafting can pay off on this device at all (when it cannot, every batch decodes
    plainly and nothing is timed or probed). A bucket decodes plainly until its plain step is timed (rounds
    are judged against it); then it follows ``DepthPolicy.choose``: estimates (``batch_costs``) until its
    rounds are timed, a K >= 1 only when it beats plain decoding by ``MIN_GAIN``, rarer and rarer probes
    while at K = 0, and none where even full acceptance could not pay off at that size (re-judged as its
    timings come in)."""

    solo: DepthPolicy
    _buckets: dict[int, DepthPolicy] = field(default_factory=dict, init=False)

    def bucket(self, size: int) -> DepthPolicy:
        index = batch_bucket(size)
        policy = self._buckets.get(index)
        if policy is None:
            # A batch of one starts at the solo default depth, as a solo request does; larger ones on their
            # estimates.
            policy = DepthPolicy(
                costs=batch_costs(self.solo.costs, size), max_k=self.solo.max_k,
                default_k=self.solo.default_k if index == 0 else 0, can_draft=self.solo.mtp_can_pay_off,
                entry_gain=MIN_GAIN if index == 0 else BATCH_ENTRY_GAIN, track_drift=False,
                explore_deeper=False,
            )
            policy.tracker = self.solo.tracker  # acceptance is the head's on the text, whatever the batch
            self._buckets[index] = policy
        return policy

    def rows_factor(self, size: int) -> float | None:
        """A batched plain step's measured seconds over a solo plain step's (None until both are known)."""
        solo = self.solo.plain_step_now_s()
        plain = self.bucket(size)._median(0)
        return plain / solo if plain and solo else None

    def choose(self, size: int) -> int:
        if not self.solo.mtp_can_pay_off:
            return 0
        if size > 1 and not self.solo.drafting_pays():
            # Solo requests, which draft cheapest (one row each), do not gain by drafting here as measured
            # live: a batch, whose members' heads also fall behind while it decodes plainly, would not
            # either (exo-demo on an H100: adaptive batches of 8 drafted off their estimates at 2.88x one
            # client where plain batching served 3.60x).
            return 0
        policy = self.bucket(size)
        if policy._median(0) is None:
            return 0  # time a plain step first: every round is judged against it
        policy.costs = batch_costs(self.solo.costs, size, self.rows_factor(size))
        # Where even full acceptance could not pay off at this batch size by the estimate from its measured
        # rows cost (a compute-bound device), the bucket does not probe either. Its plain steps keep timing
        # that cost; a few slow rounds (a busy moment) must not end probing for good, so not those.
        policy.can_draft = can_pay_off(policy.costs, policy.max_k, policy.entry_gain)
        return policy.choose()

    def observe_plain(self, size: int, seconds: float | None = None) -> None:
        """A batched plain step of ``size`` sequences ran (in ``seconds``; None: not a representative one)."""
        self.bucket(size).observe_plain(1, seconds)

    def observe_round(self, size: int, k: int, seconds: float | None = None) -> None:
        """A batched round at depth k ran (its acceptance went to the tracker member by member)."""
        self.bucket(size).observe_round_time(k, seconds)
