"""Adaptive depth: table tests of the pure cost model and policy."""

import random

import pytest

from exo.engine import adaptive
from exo.engine.adaptive import (
    MIN_GAIN,
    MIN_ROUND_SAMPLES,
    PROBE_FAR_MAX,
    PROBE_FIRST,
    PROBE_MAX,
    PROBE_RESTART,
    REFRESH_FIRST,
    REFRESH_SAMPLES,
    SETTLE_SAMPLES,
    STALE_TOKENS,
    WARM_WEIGHT,
    AcceptanceTracker,
    BatchDepthPolicy,
    DepthCosts,
    DepthPolicy,
    batch_bucket,
    batch_costs,
    best_depth,
    can_pay_off,
    expected_speedup,
    expected_tokens,
)

# Measured shapes of the two regimes (shared/reference/native-mtp.md).
H100 = DepthCosts(beta=(1.27, 1.59, 2.17), delta=(0.05, 0.10, 0.15), device="cuda")
FLAT = DepthCosts(beta=(1.1, 1.2, 1.3), delta=(0.1, 0.2, 0.3), device="metal")
CPU = DepthCosts(beta=(2.0, 3.0, 4.0), delta=(0.15, 0.30, 0.45), device="cpu")


@pytest.mark.parametrize(
    ("acceptance", "k", "tokens"),
    [
        ([0.8, 0.8, 0.8], 0, 1.0),
        ([0.8, 0.8, 0.8], 1, 1.8),
        ([0.8, 0.5, 0.8], 2, 1 + 0.8 + 0.4),
        ([1.0, 1.0, 1.0], 3, 4.0),
        ([0.0, 1.0, 1.0], 3, 1.0),
    ],
)
def test_expected_tokens(acceptance, k, tokens):
    assert expected_tokens(acceptance, k) == pytest.approx(tokens)


@pytest.mark.parametrize(
    ("costs", "acceptance", "expected_k"),
    [
        (H100, [0.8, 0.8, 0.8], 2),  # 2.44/1.69 = 1.44x beats 1.8/1.32 = 1.36x and 2.95/2.32 = 1.27x
        (H100, [0.95, 0.95, 0.95], 2),  # 2.85/1.69 = 1.69x vs 3.71/2.32 = 1.60x
        (FLAT, [0.9, 0.9, 0.9], 3),  # cheap verify rows: 3.44/1.6 = 2.15x
        (H100, [0.8, 0.3, 0.3], 1),  # deeper drafts rarely land
        (H100, [0.2, 0.2, 0.2], 0),  # 1.2 / 1.32 < 1
        (H100, [0.35, 0.0, 0.0], 0),  # 1.35 / 1.32 = 1.02x: inside the noise margin
        (CPU, [1.0, 1.0, 1.0], 0),  # compute-bound: even perfect drafts lose
        (CPU, [0.9, 0.9, 0.9], 0),
    ],
)
def test_best_depth(costs, acceptance, expected_k):
    k, speedup = best_depth(costs, acceptance, max_k=3)
    assert k == expected_k
    if k:
        assert speedup == pytest.approx(expected_speedup(costs, acceptance, k))


def test_best_depth_respects_max_k():
    assert best_depth(H100, [0.9, 0.9, 0.9], max_k=1)[0] == 1


def test_can_pay_off():
    assert can_pay_off(H100, 3)
    assert not can_pay_off(CPU, 3)


def test_cpu_policy_never_drafts_or_probes():
    policy = DepthPolicy(CPU, max_k=3, default_k=2)
    assert not policy.mtp_can_pay_off
    for _ in range(50):
        assert policy.choose() == 0
        policy.observe_plain(100, 1.0)
    assert policy.plain_budget() > 10**6


def test_policy_starts_at_default_then_follows_acceptance():
    policy = DepthPolicy(FLAT, max_k=3, default_k=2)
    assert policy.choose() == 2
    for _ in range(30):
        policy.observe_round(2, 2)  # everything accepted
    assert policy.choose() == 3
    for _ in range(60):
        policy.observe_round(3, 0)  # nothing accepted
    assert policy.choose() == 0


def test_warm_up_evidence_counts_as_a_few_rounds_and_moves_the_first_choice():
    warm = AcceptanceTracker(3)
    for accepted in [3, 3, 2, 3, 3, 1, 3, 3] * 5:  # 40 warm-up rounds: 0.975 / 0.92 / 0.86
        warm.observe(3, accepted)
    policy = DepthPolicy(H100, max_k=3, default_k=1)
    before = policy.tracker.rates()
    policy.tracker.absorb(warm)
    assert policy.tracker.reached[0] == pytest.approx(WARM_WEIGHT)  # capped: real rounds soon outvote it
    after = policy.tracker.rates()
    assert before == [adaptive.PRIOR_ACCEPTANCE] * 3
    expected = warm.rates()
    assert all(b < a and abs(a - e) < 0.1 for b, a, e in zip(before, after, expected, strict=True))
    # The best depth by that evidence from the first round on (unseeded: the default depth, then the prior).
    assert DepthPolicy(H100, max_k=3, default_k=1).choose() == 1
    assert policy.choose() == best_depth(H100, after, 3)[0] == 2
    for _ in range(40):
        policy.observe_round(3, 0)  # the requests' text suits the head far less
    assert policy.tracker.rates()[0] < 0.2 and policy.choose() == 0
    few = AcceptanceTracker(3)
    few.observe(3, 3)
    fresh = AcceptanceTracker(3)
    fresh.absorb(few)
    assert fresh.reached[0] == 1.0  # less evidence than the cap counts as it is


def test_policy_probes_rarely_after_falling_back():
    policy = DepthPolicy(H100, max_k=3, default_k=1)
    policy.choose()
    for _ in range(60):
        policy.observe_round(1, 0)
    assert policy.choose() == 0
    assert policy.plain_budget() == PROBE_FIRST
    policy.observe_plain(PROBE_FIRST)
    assert policy.choose() == 1  # a probe
    policy.observe_round(1, 0)
    assert policy.choose() == 0
    assert policy.plain_budget() == 2 * PROBE_FIRST  # the next probe comes twice as late


def test_probes_whose_drafts_land_but_cannot_pay_back_off():
    """Drafts are accepted, but measured rounds cost more than the tokens they bring (a GPU where a verify
    call costs ~2 plain steps): the probes come ever more rarely, not every PROBE_FIRST tokens. A probe of a
    depth whose timings are stale runs MIN_ROUND_SAMPLES rounds (enough to outvote them) where its warm-up
    cost says it could pay, no more."""
    costs = DepthCosts(beta=(1.3,), delta=(0.1,), device="gpu", plain_s=0.010)
    policy = DepthPolicy(costs, max_k=1, default_k=1)
    assert policy.choose() == 1
    for _ in range(8):
        policy.observe_round(1, 1, seconds=0.025)  # 2 tokens per 2.5 plain steps
    assert policy.choose() == 0
    budgets, probe_rounds = [], []
    for _ in range(4):
        budget = policy.plain_budget()
        budgets.append(budget)
        policy.observe_plain(budget, budget * 0.010)
        rounds = 0
        while policy.choose() == 1:  # the probe
            policy.observe_round(1, 1, seconds=0.025)  # accepted, still too slow
            rounds += 1
        probe_rounds.append(rounds)
    assert budgets == [PROBE_FIRST, 2 * PROBE_FIRST, 4 * PROBE_FIRST, 8 * PROBE_FIRST]
    # After a plain stretch shorter than STALE_TOKENS, K = 1's timings are fresh: one round.
    assert probe_rounds == [MIN_ROUND_SAMPLES if b >= STALE_TOKENS else 1 for b in budgets]
    assert probe_rounds[-1] == MIN_ROUND_SAMPLES


def test_a_stale_depth_that_could_pay_is_timed_again_over_several_rounds():
    """The other side: K = 1 timed at 1.6 plain steps a round with 90% of its drafts landing (1.9 tokens: it
    pays), then plain decoding for a stretch (say a text the head did not suit) leaves its timings stale. The
    probe that follows renews them over MIN_ROUND_SAMPLES rounds: one new timing would not outvote the old."""
    costs = DepthCosts(beta=(1.3,), delta=(0.1,), device="gpu", plain_s=0.010)
    policy = DepthPolicy(costs, max_k=1, default_k=1)
    policy.observe_plain(64, 0.64)
    for i in range(6):
        policy.observe_round(1, int(i % 10 != 9), seconds=0.016)
    policy.observe_plain(64, 0.64)  # its timings are now STALE_TOKENS old
    policy._current, policy._probe_every = 0, 0  # at K = 0, a probe due
    rounds = 0
    while policy.choose() == 1 and rounds < 10:
        policy.observe_round(1, 1, seconds=0.016)
        rounds += 1
    assert rounds >= MIN_ROUND_SAMPLES


def test_fixed_depth_is_kept():
    policy = DepthPolicy(CPU, max_k=3, fixed_k=2)
    assert policy.mtp_can_pay_off
    for _ in range(10):
        policy.observe_round(2, 0)
        assert policy.choose() == 2


def test_measured_round_times_replace_warmup_costs():
    # Warm-up said drafting pays; real rounds turn out 3x slower than a plain step.
    costs = DepthCosts(beta=(1.2,), delta=(0.1,), device="gpu", plain_s=0.010)
    policy = DepthPolicy(costs, max_k=1, default_k=1)
    assert policy.choose() == 1
    for _ in range(20):
        policy.observe_round(1, 1, seconds=0.030)
    assert policy.effective_costs().round_cost(1) == pytest.approx(3.0, rel=0.05)
    assert policy.choose() == 0
    # Live timings leave a depth; only the warm-up (a property of the device) turns MTP off for good,
    # so the policy still probes now and then (timings of a busy moment must not disable MTP forever).
    assert policy.mtp_can_pay_off
    policy.observe_plain(PROBE_FIRST, PROBE_FIRST * 0.010)
    assert policy.choose() == 1


def test_costs_are_compared_like_for_like_from_live_timings():
    """Plain tokens and rounds are both timed live, in seconds: a plain step that runs faster live than at
    warm-up (pipelined) does not make rounds look costlier than they are."""
    costs = DepthCosts(beta=(1.5,), delta=(0.2,), device="cpu", plain_s=0.020)
    policy = DepthPolicy(costs, max_k=1, default_k=1)
    policy.choose()
    for _ in range(16):
        policy.observe_plain(16, 16 * 0.010)  # 10 ms a token live
        policy.observe_round(1, 1, seconds=0.017)  # a round: 1.7 plain steps, 2 tokens
    assert policy.effective_costs().round_cost(1) == pytest.approx(1.7)
    assert policy.choose() == 1  # 1.9 tokens (acceptance ~0.95) per 1.7 steps beats plain


def test_noisy_timings_do_not_move_the_choice():
    costs = DepthCosts(beta=(1.3,), delta=(0.1,), device="gpu", plain_s=0.010)
    policy = DepthPolicy(costs, max_k=1, default_k=1)
    policy.choose()
    for i in range(40):
        policy.observe_plain(8, 8 * 0.010)
        # A busy moment now and then: a round takes 5x as long.
        policy.observe_round(1, 1, seconds=0.075 if i % 5 == 0 else 0.015)
        assert policy.choose() == 1


def test_rounds_that_catch_the_head_up_are_not_timed():
    costs = DepthCosts(beta=(1.3,), delta=(0.1,), device="gpu", plain_s=0.010)
    policy = DepthPolicy(costs, max_k=1, default_k=1)
    policy.choose()
    for _ in range(10):
        policy.observe_round(1, 1, seconds=None)  # after a long plain stretch: not representative
    assert policy.effective_costs() == costs


def test_a_probe_tries_the_most_promising_depth():
    """At K = 0 a probe runs the depth with the best expected speed, not always K = 1: where K = 2 is the
    one that could pay, its cost and its second position are what the probe must renew."""
    costs = DepthCosts(beta=(1.7, 1.8), delta=(0.1, 0.2), device="gpu", plain_s=0.010)
    policy = DepthPolicy(costs, max_k=2, default_k=2)
    assert policy.choose() == 2
    for _ in range(6):
        policy.observe_round(2, 2, seconds=0.033)  # every draft lands, but a round costs 3.3 plain steps
    policy.observe_plain(4, 4 * 0.010)
    assert policy.choose() == 0
    rates = policy.tracker.rates()
    assert expected_speedup(policy.effective_costs(), rates, 2) > expected_speedup(policy.effective_costs(), rates, 1)
    policy.observe_plain(policy.plain_budget(), 0.010 * policy.plain_budget())
    assert policy.choose() == 2


def test_a_probe_gives_a_position_seen_once_the_benefit_of_the_doubt(monkeypatch):
    """A deeper position judged on one rejected draft is uncertain, not bad: a probe from K = 0 picks the
    depth by optimistic acceptance (each position's rate plus a standard error of its evidence), so K = 2
    gets the rounds that measure its second position. On point estimates the probe went to K = 1, which
    cannot pay, and position 2 stayed at its one observation (simulated H200 exo-demo: the first requests
    ran plainly for half their tokens where K = 3 ran 1.13x)."""

    def probed_depth() -> int:
        costs = DepthCosts(beta=(1.8, 2.1), delta=(0.1, 0.2), device="gpu")
        policy = DepthPolicy(costs, max_k=2, default_k=1)
        assert policy.choose() == 1
        for i in range(20):
            policy.observe_round(1, 0 if i % 5 == 0 else 1)  # position 1 lands 80%
        policy.observe_round(2, 1)  # position 2 tried once: rejected
        assert policy.choose() == 0  # K = 1 runs ~0.95x plain, K = 2 looks no better
        policy.observe_plain(policy.plain_budget())
        return policy.choose()

    assert probed_depth() == 2
    monkeypatch.setattr(adaptive, "OPTIMISM", 0.0)
    assert probed_depth() == 1


def test_new_timings_of_a_depth_outvote_its_old_ones_after_a_stretch_elsewhere():
    """Rounds timed in a slow moment sent the policy to K = 0; the machine is quiet again and the probes
    measure rounds at 1.7 plain steps. The old timings stood for the machine as it was: after a stretch at
    other depths a depth keeps only its two newest ones, so fresh probes decide within a few (with a plain
    window of 16 old timings, the probes of ~2000 tokens would have been needed)."""
    costs = DepthCosts(beta=(1.3, 1.5), delta=(0.1, 0.2), device="gpu", plain_s=0.010)
    policy = DepthPolicy(costs, max_k=2, default_k=2)
    policy.choose()
    for _ in range(16):
        policy.observe_round(2, 2, seconds=0.035)  # a busy moment: 3.5 plain steps a round
    policy.observe_plain(8, 8 * 0.010)
    assert policy.choose() == 0
    plain_tokens = 0
    while policy._current != 2:  # plain stretches and probes (a probe of stale timings: several rounds)
        if (k := policy.choose()) == 0:
            budget = policy.plain_budget()
            plain_tokens += budget
            policy.observe_plain(budget, budget * 0.010)
        else:
            policy.observe_round(k, k, seconds=0.017)
        assert plain_tokens < 300
    assert policy.choose() == 2
    assert policy.effective_costs().round_cost(2) == pytest.approx(1.7)
    # While it runs K = 2, one odd round among its fresh ones moves nothing.
    policy.observe_round(2, 2, seconds=0.060)
    assert policy.choose() == 2


def test_rounds_are_judged_against_plain_tokens_as_the_decode_loop_runs_them():
    """beta and delta count plain steps built, computed and read back one at a time; the decode loop builds
    each step while the previous one computes, 1.2x faster here (an H100 serving a tiny model, this CPU:
    1.1-1.2x). A K = 1 round of 1.6 such steps costs 1.92 pipelined tokens: with 80% acceptance, plain
    decoding is faster. Judged in steps alone it looked 1.12x faster (an H100: adaptive drafted at 0.87x
    plain decoding)."""
    costs = DepthCosts(beta=(1.5,), delta=(0.1,), device="gpu", plain_s=0.012, plain_pipelined_s=0.010)
    assert costs.in_pipelined_steps().round_cost(1) == pytest.approx(1.92)
    policy = DepthPolicy(costs, max_k=1, default_k=1)
    assert policy.choose() == 1
    for i in range(20):
        policy.observe_round(1, 1 if i % 5 else 0)  # 80% accepted, rounds not timed
    assert policy.plain_step_s() == 0.010  # no plain token timed live yet: the warm-up's pipelined one
    assert policy.effective_costs().round_cost(1) == pytest.approx(1.92)
    assert policy.choose() == 0
    # Timed live: a round in seconds against a plain token in seconds.
    for _ in range(4):
        policy.observe_plain(16, 16 * 0.008)
        policy.observe_round(1, 1, seconds=0.0128)
    assert policy.effective_costs().round_cost(1) == pytest.approx(1.6)


def test_mtp_that_cannot_pay_off_against_pipelined_plain_decoding_never_probes():
    """Even full acceptance (2 tokens a round) cannot beat a round of 1.8 steps alone = 2.16 pipelined plain
    tokens: the head is not fed and nothing is probed (in steps alone it looked like 1.11x)."""
    costs = DepthCosts(beta=(1.7,), delta=(0.1,), device="gpu", plain_s=0.012, plain_pipelined_s=0.010)
    assert can_pay_off(costs, 1) and not can_pay_off(costs.in_pipelined_steps(), 1)
    policy = DepthPolicy(costs, max_k=1, default_k=1)
    assert not policy.mtp_can_pay_off
    assert policy.choose() == 0 and policy.plain_budget() == 1 << 30


def test_unmeasured_depths_carry_the_measured_overhead():
    """A depth not run yet is estimated from its warm-up cost times how much slower the measured depths
    ran than theirs."""
    costs = DepthCosts(beta=(1.2, 1.4), delta=(0.1, 0.2), device="gpu", plain_s=0.010)
    policy = DepthPolicy(costs, max_k=2, default_k=1)
    policy.choose()
    for _ in range(16):
        policy.observe_plain(8, 8 * 0.010)
        policy.observe_round(1, 1, seconds=0.013 * 1.5)  # K = 1 ran 1.5x its warm-up cost
    effective = policy.effective_costs()
    assert effective.round_cost(1) == pytest.approx(1.95)
    assert effective.round_cost(2) == pytest.approx(1.6 * 1.5)


def test_a_depth_is_left_only_for_a_clearly_faster_one():
    costs = DepthCosts(beta=(1.3, 1.6), delta=(0.1, 0.2), device="gpu", plain_s=0.010)
    policy = DepthPolicy(costs, max_k=2, default_k=1)
    assert policy.choose() == 1
    # Position 2 accepted just often enough that K = 2 would be ~1% faster: stay at K = 1.
    for _ in range(60):
        policy.observe_round(2, 1)
        policy.observe_round(2, 2)
    rates = policy.tracker.rates()
    gain = expected_speedup(costs, rates, 2) / expected_speedup(costs, rates, 1)
    assert gain < 1.03
    # It stays at K = 1; a round at K = 2 now and then is a probe one deeper (rarer and rarer).
    depths = []
    for i in range(40):
        depths.append(policy.choose())
        policy.observe_round(depths[-1], min(depths[-1], 1 + i % 2))
    # (K = 2 has no timed rounds here: a probe of a depth that could win and has no live cost runs a few.)
    assert depths.count(2) <= 2 * MIN_ROUND_SAMPLES and depths.count(1) == len(depths) - depths.count(2)
    assert depths[-10:] == [1] * 10


def test_learning_carries_over_to_the_next_request():
    policy = DepthPolicy(FLAT, max_k=3, default_k=1)
    assert policy.choose() == 1
    for _ in range(30):
        policy.observe_round(3, 3)
    policy.new_request()
    assert policy.choose() == 3  # not back to the default depth
    for _ in range(80):
        policy.observe_round(3, 0)
    policy.new_request()
    assert policy.choose() == 0
    assert policy.plain_budget() == PROBE_FIRST  # no probe ran yet: the first one comes early


def _probe_to_max_backoff(policy: DepthPolicy, accepted) -> None:
    """K = 0 after many probes (rounds accepting ``accepted(i)`` drafts): the backoff at its maximum."""
    policy.choose()
    for i in range(80):
        policy.observe_round(1, accepted(i))
    i = 0
    while policy.plain_budget() < PROBE_MAX:
        policy.observe_plain(policy.plain_budget())
        assert policy.choose() == 1
        policy.observe_round(1, accepted(i))
        i += 1
        assert policy.choose() == 0


def _probes_in(policy: DepthPolicy, tokens_wanted: int) -> int:
    probes, tokens = 0, 0
    while tokens < tokens_wanted:
        budget = min(policy.plain_budget(), tokens_wanted - tokens)
        policy.observe_plain(budget)
        tokens += budget
        if policy.choose() == 1:
            probes += 1
            policy.observe_round(1, 0)
            tokens += 1
    return probes


def test_a_new_request_probes_within_a_few_dozen_tokens_not_three_times():
    """At K = 0 after many probes (backoff at its maximum), the head's drafts now landing about a third of the
    time: 1.37 tokens a round against 1.37 plain steps, not the MIN_GAIN it takes to draft but within
    LIVE_DOUBT of paying (a text it suits better could). A new request's first probe comes after
    PROBE_RESTART plain tokens, then the backoff doubles again: one probe in a 128-token request, not three
    (16, 48, 112) as when every request restarted at PROBE_FIRST."""
    costs = DepthCosts(beta=(1.27,), delta=(0.1,), device="gpu", plain_s=0.010)
    policy = DepthPolicy(costs, max_k=1, default_k=1)
    _probe_to_max_backoff(policy, lambda i: 0)
    for i in range(40):
        policy.tracker.observe(1, int(i % 5 in (0, 2)))
    assert 1.344 < 1 + policy.tracker.rates()[0] < 1.37 * MIN_GAIN
    policy.new_request()
    assert _probes_in(policy, 128) == 1 and PROBE_RESTART < 128 < 3 * PROBE_RESTART


def test_a_head_whose_drafts_never_land_is_not_probed_in_every_request():
    """A head whose drafts are all rejected (random weights, a head for another model): no depth could pay at
    that acceptance, so a new request does not restart the backoff: 64-token requests go without probes
    while it grows (a random 9B on an H200 probed once per request: adaptive 0.85x plain)."""
    costs = DepthCosts(beta=(1.3,), delta=(0.1,), device="gpu", plain_s=0.010)
    policy = DepthPolicy(costs, max_k=1, default_k=1)
    _probe_to_max_backoff(policy, lambda i: 0)
    probes = 0
    for _ in range(8):
        policy.new_request()
        probes += _probes_in(policy, 64)
    assert probes <= 1  # 512 plain tokens: at most the one probe of the maximal backoff
    # Acceptance comes back (the text suits the head): the next requests probe early again.
    for _ in range(40):
        policy.tracker.observe(1, 1)
    policy.new_request()
    assert policy.plain_budget() <= PROBE_RESTART


@pytest.mark.parametrize(("rates", "steps", "warm_beta", "warm_delta", "most_rounds"), [
    ((0.89, 0.85, 0.69), {1: 2.3, 2: 3.1, 3: 3.9}, (2.0, 2.5, 3.0), (0.14, 0.29, 0.39), 8),
    # Another H200: the warm-up timed K = 2 at 2.5 plain steps, its rounds ran at 3.2 for 2.65 tokens. Judged
    # at its warm-up cost once stale, K = 2 restarted a three-round probe in every request (32 rounds here, 14 now).
    ((0.87, 0.90, 0.66), {1: 2.9, 2: 3.2, 3: 5.0}, (1.73, 2.1, 2.5), (0.17, 0.27, 0.36), 20),
])
def test_a_depth_timed_too_slow_to_pay_does_not_restart_probes_in_every_request(
        rates, steps, warm_beta, warm_delta, most_rounds):
    """exo-demo on an H200 once plain decoding ran 1.1x stock: its drafts landed 89/85/69% of the time (3.2
    tokens a round at K = 3), but K = 3 rounds were timed at 3.9 plain steps. Judged by the warm-up's drafts
    alone (1 + delta: a verify call as cheap as a plain step) K = 3 still looked affordable, and every
    128-token request restarted the probes at PROBE_RESTART, each renewing K = 3 over three rounds (adaptive
    0.977x plain in bench/adaptive_sim.py@3c719fd, 0.97-0.98x measured). Judged by what it cost live it cannot pay:
    probes carry on across requests on the doubling backoff."""
    rng = random.Random(0)
    costs = DepthCosts(beta=warm_beta, delta=warm_delta, device="cuda", plain_s=0.0034, plain_pipelined_s=0.0032)
    policy = DepthPolicy(costs, max_k=3, default_k=1)

    def round_at(k: int) -> int:
        accepted = 0
        while accepted < k and rng.random() < rates[accepted]:
            accepted += 1
        policy.observe_round(k, accepted, seconds=steps[k] * 0.0032)
        return accepted + 1

    policy.observe_plain(64, 64 * 0.0032)
    for _ in range(12):  # every depth timed live
        for k in (1, 2, 3):
            round_at(k)
    policy._current = 0
    rounds = 0
    for _ in range(12):
        policy.new_request()
        tokens = 0
        while tokens < 127:
            k = policy.choose()
            if k == 0:
                n = min(policy.plain_budget(), 127 - tokens)
                policy.observe_plain(n, n * 0.0032)
                tokens += n
            else:
                tokens += round_at(k)
                rounds += 1
    assert rounds <= most_rounds  # 38 when every request restarted: three rounds at K = 3 in each


# -- batches: one depth per batch-size bucket ------------------------------------------------------------------
SOLO_GPU = DepthCosts(beta=(1.25, 1.5, 1.75), delta=(0.05, 0.10, 0.15), device="cuda", plain_s=0.010)


@pytest.mark.parametrize(
    ("size", "bucket"),
    [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (16, 4), (17, 5), (64, 5)],
)
def test_batch_sizes_share_timings_by_bucket(size, bucket):
    assert batch_bucket(size) == bucket


@pytest.mark.parametrize(
    ("size", "rows_factor", "beta1", "delta1"),
    [
        (1, None, 1.25, 0.05),  # a batch of one costs what a solo round costs
        (8, 8.0, 2.0, 0.05),  # compute-bound: every row costs a step, a K = 1 round two steps
        (8, 1.0, 1.25, 0.4),  # rows are free: the solo verify's extra once, 8 drafting chains
        (8, 2.0, 1.0 + (8 / 7 + (0.25 - 1 / 7)) / 2, 0.2),
        (8, None, 1.0 + 2.0 / 2.75, 0.4 / 2.75),  # extrapolated from the warm-up: m = beta(1) - 1
        (4, 9.0, 2.0, 0.05),  # a measured factor beyond the rows is clamped to them
    ],
)
def test_batch_costs_scale_the_solo_warmup_by_the_rows_cost(size, rows_factor, beta1, delta1):
    costs = batch_costs(SOLO_GPU, size, rows_factor)
    assert costs.beta[0] == pytest.approx(beta1) and costs.delta[0] == pytest.approx(delta1)
    assert costs.max_k == SOLO_GPU.max_k


def _batch_policy(solo_costs: DepthCosts, acceptance: int = 40) -> BatchDepthPolicy:
    solo = DepthPolicy(solo_costs, max_k=3, default_k=1)
    for _ in range(acceptance):
        solo.observe_round(3, 3)  # a head that lands nearly every draft
    return BatchDepthPolicy(solo)


def test_a_batch_never_drafts_where_solo_drafting_cannot_pay_off():
    policy = _batch_policy(CPU)
    for size in (1, 2, 8, 32):
        for _ in range(3 * PROBE_FIRST):
            assert policy.choose(size) == 0  # not even a probe
            policy.observe_plain(size, 0.02)


def test_a_bucket_times_its_plain_step_before_it_drafts():
    policy = _batch_policy(SOLO_GPU)
    assert policy.choose(2) == 0
    policy.observe_plain(2, None)  # the first plain step after a round is not timed
    assert policy.choose(2) == 0
    policy.observe_plain(2, 0.0105)
    assert policy.choose(2) >= 1  # rows nearly free, drafts landing: the estimate drafts


def test_batch_depth_follows_the_measured_rows_cost_per_bucket():
    """Bandwidth-bound small batches keep drafting; a large batch whose plain step grows with its rows
    (compute-bound there) decodes plainly: each bucket from its own timings."""
    policy = _batch_policy(SOLO_GPU)
    policy.observe_plain(2, 0.0105)  # 2 rows cost about 1
    policy.observe_plain(32, 0.300)  # 32 rows cost 30 solo steps
    assert policy.choose(2) >= 1
    assert policy.choose(32) == 0
    assert policy.choose(20) == 0  # the same bucket (17+)


def test_measured_batch_rounds_replace_the_estimate():
    policy = _batch_policy(SOLO_GPU)
    policy.observe_plain(4, 0.011)
    k = policy.choose(4)
    assert k >= 1
    for _ in range(8):
        policy.observe_round(4, k, 0.050)  # measured: a round costs 4.5 plain steps, K+1 tokens at most
    assert policy.choose(4) == 0
    # ... and it probes back now and then (exponentially rarer), the plain step staying the reference.
    probes = 0
    for _ in range(PROBE_FIRST + 1):
        if policy.choose(4):
            probes += 1
            policy.observe_round(4, 1, 0.050)
        else:
            policy.observe_plain(4, 0.011)
    assert probes == 1


def test_a_batch_bucket_learns_acceptance_with_the_solo_policy():
    """One acceptance tracker: a head whose drafts stop landing sends batches to K = 0 as well."""
    solo = DepthPolicy(SOLO_GPU, max_k=3, default_k=1)
    policy = BatchDepthPolicy(solo)
    policy.observe_plain(2, 0.0105)
    assert policy.choose(2) >= 1
    for _ in range(80):
        solo.observe_round(1, 0)
    assert policy.choose(2) == 0


def test_a_batch_of_one_starts_at_the_solo_default_depth():
    """Its costs are the solo ones; like a solo request it drafts at the default depth before acceptance is
    known (a larger bucket follows its estimates: prior acceptance 0.6 does not pay here)."""
    costs = DepthCosts(beta=(1.4, 1.8), delta=(0.2, 0.4), device="cpu", plain_s=0.010)
    policy = BatchDepthPolicy(DepthPolicy(costs, max_k=2, default_k=1))
    for size in (1, 2):
        policy.observe_plain(size, 0.010 * size ** 0.5)
    assert policy.choose(1) == 1
    assert policy.choose(2) == 0


def test_a_bucket_where_drafting_cannot_pay_off_does_not_probe():
    """A batched plain step of 8 costs 3 solo steps here: a K = 1 round is estimated at 2.25 steps, more
    than its 2 tokens at full acceptance. The bucket decodes plainly without probes; a small bucket whose
    rows are nearly free still drafts."""
    solo = DepthCosts(beta=(1.28, 1.57, 1.86), delta=(0.18, 0.34, 0.50), device="cpu", plain_s=0.009)
    policy = _batch_policy(solo)
    policy.observe_plain(8, 0.027)
    policy.observe_plain(2, 0.0095)
    for _ in range(4 * PROBE_FIRST):
        assert policy.choose(8) == 0
        policy.observe_plain(8, 0.027)
    assert policy.choose(2) >= 1


def test_batches_do_not_draft_where_solo_rounds_measure_slower_than_plain():
    """The solo policy's live timings say drafting loses here (rounds cost more than their tokens, as on a
    small model on an H100): batches of several decode plainly even where their estimate from the solo
    warm-up would draft; a batch of one still follows its own bucket, as a solo request does."""
    policy = _batch_policy(SOLO_GPU)
    policy.observe_plain(2, 0.0105)
    assert policy.choose(2) >= 1  # by the warm-up estimate
    solo = policy.solo
    for _ in range(16):
        solo.observe_plain(16, 16 * 0.010)
        solo.observe_round(3, 3, seconds=0.045)  # 4 tokens per 4.5 plain steps
    assert not solo.drafting_pays()
    for size in (2, 8):
        policy.observe_plain(size, 0.011)
        assert policy.choose(size) == 0


def test_a_batch_starts_drafting_only_on_a_clear_margin():
    """A batch of several drafts only where its estimate promises BATCH_ENTRY_GAIN over batched plain (its
    members' acceptance runs below the solo acceptance the estimate uses); a solo request or a batch of one
    starts at MIN_GAIN. Here a K = 1 round costs 1.75 plain steps for 1.9 tokens: 1.09x."""
    from exo.engine.adaptive import BATCH_ENTRY_GAIN

    costs = DepthCosts(beta=(1.55,), delta=(0.2,), device="cuda", plain_s=0.010)
    solo = DepthPolicy(costs, max_k=1, default_k=1)
    for _ in range(60):
        solo.observe_round(1, 1 if _ % 10 else 0)  # 90% of drafts land
    assert 1.03 < expected_speedup(costs, solo.tracker.rates(), 1) < BATCH_ENTRY_GAIN
    assert solo.drafting_pays()
    policy = BatchDepthPolicy(solo)
    policy.observe_plain(2, 0.010)  # a second row is free: the bucket's estimate is the solo one
    policy.observe_plain(1, 0.010)
    assert policy.choose(1) == 1
    for _ in range(3 * PROBE_FIRST):
        assert policy.choose(2) == 0  # neither drafts nor probes
        policy.observe_plain(2, 0.010)


def _dip_then_idle(tracker: AcceptanceTracker) -> tuple[float, float]:
    """(position 1's rate after a stretch of hard text, the same after a request's worth of plain tokens)."""
    for i in range(150):  # a head landing 7 in 8 of its first drafts
        tracker.observe(2, 0 if i % 8 == 0 else 2)
    for i in range(16):  # hard text: a quarter land
        tracker.observe(2, int(i % 4 == 0))
    dipped = tracker.rates()[0]
    tracker.idle(128)
    return dipped, tracker.rates()[0]


def test_acceptance_left_at_a_dip_reverts_to_the_long_run_rate_while_plain_decoding_observes_nothing():
    """Drafting stops because a stretch of hard text pulled the estimates down, and then nothing is observed:
    the estimates stayed at that dip, chosen by the leaving itself. Aged by the plain tokens run since, the
    recent evidence gives way to the head's long-run rate. exo-demo-moe on an H200, where K = 2 ran 1.035x
    plain: adaptive estimated 0.80/0.73 at K = 0 against 0.87/0.80 over its own K = 2 rounds, and decoded whole
    requests plainly (0.973-0.979x the fixed K = 2; with the rates reverting, 0.982-0.994 in the same runs)."""
    dipped, later = _dip_then_idle(AcceptanceTracker(2))
    assert dipped < 0.7 and later > 0.75  # the long-run rate, the dip in it: 0.79
    dipped_before, later_before = _dip_then_idle(AcceptanceTracker(2, idle_forget=1.0, revert_weight=0.0))
    assert later_before == dipped_before < 0.7  # as it was: the dip stood until the next rounds


_GPU_COSTS = DepthCosts(beta=(1.7, 2.0), delta=(0.15, 0.25), device="cuda", plain_s=0.003, plain_pipelined_s=0.003)


def _request(policy: DepthPolicy, tokens_wanted: int, hard_after: int) -> dict[int, int]:
    """One request as the decode loop runs it (rounds at 2.3 plain steps): its tokens per depth. Drafts land 7
    rounds in 8 until token ``hard_after``, then one round in three lands one draft."""
    policy.new_request()
    done: dict[int, int] = {}
    tokens, rounds = 0, 0
    while tokens < tokens_wanted:
        k = policy.choose()
        if k == 0:
            n = min(policy.plain_budget(), tokens_wanted - tokens)
            policy.observe_plain(n, n * 0.003)
        else:
            hard = tokens >= hard_after
            n = min(k + 1, 1 + (int(rounds % 3 == 0) if hard else (k if rounds % 8 else 1)))
            policy.observe_round(k, n - 1, 2.3 * 0.003)
            rounds += 1
        done[k] = done.get(k, 0) + n
        tokens += n
    return done


def _drafted_after_a_dip(policy: DepthPolicy, hard_after: int) -> int:
    """Tokens drafted in an easy request that follows one whose text turned hard at ``hard_after``."""
    policy.observe_plain(32, 32 * 0.003)
    for _ in range(3):
        _request(policy, 128, hard_after=1 << 30)
    assert _request(policy, 128, hard_after=hard_after).get(0, 0) > 0  # the hard text sent it to plain decoding
    return 128 - _request(policy, 128, hard_after=1 << 30).get(0, 0)


def test_a_new_request_drafts_again_once_the_dip_that_stopped_drafting_has_aged():
    """A request whose text turned hard ends decoding plainly; the next one, on text the head suits, drafts
    again from its start (estimates back at the long-run rate), not after PROBE_RESTART plain tokens and a
    probe whose few landed drafts hardly move estimates weighted by dozens of rounds."""
    assert _drafted_after_a_dip(DepthPolicy(_GPU_COSTS, max_k=2, default_k=2), hard_after=40) >= 120
    before = DepthPolicy(_GPU_COSTS, max_k=2, default_k=2)
    before.tracker = AcceptanceTracker(2, idle_forget=1.0, revert_weight=0.0)
    assert _drafted_after_a_dip(before, hard_after=40) < 40  # 8: one probe of three rounds


def test_a_deeper_position_not_yet_measured_is_expected_to_land_like_the_one_before():
    """Rounds at K = 1 measure position 1 only. Position 2 is expected to land as position 1 does, so a
    depth that pays at that acceptance gets tried (and measured) instead of being ruled out by a fixed prior:
    the CPU costs of exo-demo, where K = 2 and 3 beat K = 1 by 5-6%."""
    from exo.engine.adaptive import AcceptanceTracker

    tracker = AcceptanceTracker(3)
    for i in range(40):
        tracker.observe(1, 0 if i % 10 == 0 else 1)
    rates = tracker.rates()
    assert rates[0] == pytest.approx(0.9, abs=0.03) and rates[1] == pytest.approx(rates[0], abs=0.01)
    costs = DepthCosts(beta=(1.31, 1.59, 1.84), delta=(0.16, 0.32, 0.49), device="cpu", plain_s=0.010)
    policy = DepthPolicy(costs, max_k=3, default_k=1)
    assert policy.choose() == 1
    for i in range(40):
        policy.observe_round(1, 0 if i % 10 == 0 else 1, seconds=0.0147)
    assert policy.choose() >= 2


def test_a_depth_one_deeper_is_probed_rarer_and_rarer():
    """At K >= 1 a round at K + 1 comes after 8, then 16, 32, ... rounds: it measures the next position and
    that depth's cost, so one unlucky round cannot rule a depth out for good."""
    policy = DepthPolicy(FLAT, max_k=3, default_k=1)
    rounds = []
    for _ in range(300):
        k = policy.choose()
        rounds.append(k)
        policy.observe_round(k, 1)  # first drafts land, deeper ones never: the policy stays at K = 1
    settled = rounds[12:]  # the first rounds try the deeper depths their priors favour, then learn
    # Probes: runs of rounds at K = 2 (a few in a row while K = 2 could still win and has no live cost).
    probes = [i for i, k in enumerate(settled) if k != 1 and (i == 0 or settled[i - 1] == 1)]
    assert len(probes) >= 3 and all(k in (1, 2) for k in settled)
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert all(b > a for a, b in zip(gaps, gaps[1:], strict=False)) and probes[0] < 20
    assert settled.count(2) <= len(probes) * MIN_ROUND_SAMPLES


def test_a_deeper_depth_timed_slow_early_is_renewed_by_the_next_deeper_probe():
    """This CPU (exo-demo): K = 3's first rounds, in the first request, were timed at 2.5 plain steps; the policy
    settled at K = 2 and probed K = 3 one round at a time, each new timing outvoted by the stale window, while
    K = 3 ran at 1.9 (0.94x a fixed K = 3 over a run). A deeper probe of a depth whose timings are stale, which
    could beat the current one at its warm-up cost, runs MIN_ROUND_SAMPLES rounds: K = 3 is back at once."""
    costs = DepthCosts(beta=(1.35, 1.68, 1.69), delta=(0.25, 0.46, 0.66), device="cpu", plain_s=0.005,
                       plain_pipelined_s=0.005)
    policy = DepthPolicy(costs, max_k=3, default_k=3)
    policy.observe_plain(64, 64 * 0.005)
    for i in range(6):  # K = 3 timed slow: 2.5 steps
        assert policy.choose() == 3
        policy.observe_round(3, (3, 2, 1)[i % 3], seconds=2.5 * 0.005)
    policy._current = 2
    for _ in range(40):  # K = 2 for a while (K = 3's timings go stale), its last position rarely tested
        policy.observe_round(2, 2, seconds=2.1 * 0.005)
    policy._rounds_since_deeper = policy._deeper_every  # a deeper probe is due, no refresh
    policy._rounds_since_refresh = 0
    ran = []
    for _ in range(8):
        k = policy.choose()
        ran.append(k)
        policy.observe_round(k, k, seconds={2: 2.1, 3: 1.9}[k] * 0.005)
    assert ran[:MIN_ROUND_SAMPLES] == [3] * MIN_ROUND_SAMPLES and ran[-1] == 3, ran


# -- the warm-up's verdict ------------------------------------------------------------------------------------
def test_a_warmup_that_says_drafting_cannot_pay_is_confirmed_before_it_turns_mtp_off(monkeypatch):
    """"Cannot pay off even with every draft accepted" turns adaptive MTP off for the engine's life, so a
    warm-up that says it is measured again and each part's fastest time kept (interference only adds time): a
    moment of noise (an H100 once timed exo-demo-moe's 2-row verify at 2.9 plain steps, its rounds then ran at
    1.9) no longer disables drafting. A warm-up that says drafting can pay is taken as it is; a device where
    drafting really cannot pay (every warm-up says so) stays off."""
    from exo.engine import costs as costs_module

    slow = DepthCosts(beta=(2.9, 2.7), delta=(0.2, 0.3), device="cuda", plain_s=0.004, plain_pipelined_s=0.004)
    fast = DepthCosts(beta=(1.6, 1.8), delta=(0.1, 0.2), device="cuda", plain_s=0.005, plain_pipelined_s=0.0045)
    assert not can_pay_off(slow.in_pipelined_steps(), 2) and can_pay_off(fast.in_pipelined_steps(), 2)

    def warm(*measured):
        calls = list(measured)
        monkeypatch.setattr(costs_module, "measure_costs", lambda *args, **kwargs: calls.pop(0))
        result = costs_module.warmup_costs(None, None, None, 2)
        return result, len(measured) - len(calls)

    confirmed, runs = warm(slow, fast, slow)
    assert runs == 2 and can_pay_off(confirmed.in_pipelined_steps(), 2)
    # Each part's fastest time, in the fastest plain step: the verify of 2 rows 1.6 x 5 ms = 8 ms / 4 ms.
    assert confirmed.plain_s == 0.004 and confirmed.plain_pipelined_s == 0.004
    assert confirmed.beta == pytest.approx((2.0, 2.25)) and confirmed.delta == pytest.approx((0.125, 0.25))
    assert warm(fast, slow) == (fast, 1)
    off, runs = warm(slow, slow, slow)
    assert runs == 3 and not can_pay_off(off.in_pipelined_steps(), 2)


def test_live_costs_never_put_a_verify_call_below_one_plain_step():
    """Live costs are a round's measured time over live plain tokens, split as the warm-up split them: a round
    timed in a fast moment against plain tokens timed in a slow one once gave a pipeline's verify 0.991 plain
    steps. A verify of K+1 rows never costs less than one row, as the warm-up already holds."""
    costs = DepthCosts(beta=(1.2,), delta=(0.1,), device="cpu", plain_s=0.010, plain_pipelined_s=0.010)
    policy = DepthPolicy(costs, max_k=1, default_k=1)
    policy.observe_plain(16, 16 * 0.010)
    for _ in range(3):
        policy.observe_round(1, 1, 0.0105)  # 1.05 plain tokens: 0.97 of them the verify at the warm-up's split
    live = policy.effective_costs()
    assert live.beta[0] == 1.0 and live.delta[0] == pytest.approx(0.0105 / 0.010 * 0.1 / 1.3)


def _drafting_costs() -> DepthCosts:
    return DepthCosts(beta=(1.2, 1.4, 1.6), delta=(0.1, 0.2, 0.3), device="cpu", plain_s=0.010,
                      plain_pipelined_s=0.010)


def _refresh(policy: DepthPolicy, at: int, plain_s: float, round_s: float) -> list[int]:
    """Run what ``choose`` asks until it returns to depth ``at``; plain bursts as long as ``plain_budget`` says."""
    ran: list[int] = []
    while (k := policy.choose()) < at:
        assert len(ran) < 2 * REFRESH_SAMPLES, ran
        ran.append(k)
        if k == 0:
            tokens = policy.plain_budget()
            policy.observe_plain(tokens, tokens * plain_s)
        else:
            policy.observe_round(k, k, round_s)
    return ran


def test_a_shallower_depth_timed_in_another_moment_is_timed_again_while_drafting():
    """Plain tokens timed in a slow minute (11 ms) stand for plain decoding while the policy drafts: every depth
    looks faster than plain than it is. After REFRESH_FIRST rounds against live timings, plain decoding runs
    REFRESH_SAMPLES timed bursts, enough to outvote the STALE_KEEP old timings; then rarer and rarer."""
    policy = DepthPolicy(_drafting_costs(), max_k=3, default_k=3)
    policy.observe_plain(16, 16 * 0.011)
    rounds = 0
    while policy._rounds_since_refresh < REFRESH_FIRST:
        assert policy.choose() == 3
        policy.observe_round(3, 3, 0.030)
        rounds += 1
    ran = _refresh(policy, 3, 0.0095, 0.030)
    assert ran == [0] * REFRESH_SAMPLES
    assert policy._median(0) == pytest.approx(0.0095)  # the fresh bursts' time, not the slow minute's
    for _ in range(REFRESH_FIRST):  # the next refresh only after twice as many rounds
        assert policy.choose() == 3
        policy.observe_round(3, 3, 0.030)
    assert policy.choose() == 3
    policy.observe_round(3, 3, 0.030)


def test_the_warmup_plain_step_is_timed_live_once_drafting_runs_on_live_timings():
    """No plain token timed live: the warm-up's plain step (another moment) stands for plain decoding, so it is
    refreshed like a stale timing once the current depth runs on live ones (and not before: figures that all
    come from the warm-up are of one moment)."""
    policy = DepthPolicy(_drafting_costs(), max_k=2, default_k=2)
    for _ in range(2 * REFRESH_FIRST):
        assert policy.choose() == 2
        policy.observe_round(2, 2)  # untimed rounds: nothing live to compare
    assert policy.choose() == 2
    policy.observe_round(2, 2, 0.020)
    assert _refresh(policy, 2, 0.0095, 0.020) == [0] * REFRESH_SAMPLES
    assert policy._median(0) == pytest.approx(0.0095)


def test_a_refresh_times_the_stalest_shallower_depth():
    """Drafting at K = 3 with plain decoding timed just now and K = 1 timed long ago: K = 1 is run again."""
    policy = DepthPolicy(_drafting_costs(), max_k=3, default_k=3)
    for _ in range(MIN_ROUND_SAMPLES):
        policy.observe_round(1, 1, 0.025)  # a slow minute
    for _ in range(REFRESH_FIRST):
        policy.observe_round(3, 3, 0.030)
    policy.observe_plain(8, 8 * 0.0095)  # plain decoding timed just now
    assert _refresh(policy, 3, 0.0095, 0.015) == [1] * REFRESH_SAMPLES
    assert policy._median(1) == pytest.approx(0.015)


def test_depths_timed_in_different_minutes_are_compared_at_one_speed():
    """K = 1 runs 16 ms rounds, then the machine slows down by half for a minute (24 ms), then runs fast again
    and plain decoding is timed again (10 ms a token, 1.6 plain steps a K = 1 round as before). K = 1's recent
    timings come mostly from the slow minute: compared with them, a round looked like 2.4 plain steps and the
    policy left K = 1 (1.95 tokens a round) for plain decoding. Timings of the depth it runs measure the
    machine instead, and the plain bursts are taken at the speed of the rounds just before them."""
    costs = DepthCosts(beta=(1.5,), delta=(0.1,), device="cpu", plain_s=0.010, plain_pipelined_s=0.010)
    policy = DepthPolicy(costs, max_k=1, default_k=1)
    policy.observe_plain(16, 16 * 0.010)
    rounds = 0

    def run(n: int, seconds: float) -> None:
        nonlocal rounds
        for _ in range(n):
            assert policy.choose() == 1
            policy.observe_round(1, 1, seconds)
            rounds += 1

    run(SETTLE_SAMPLES, 0.016)
    # The check after REFRESH_FIRST rounds finds plain decoding fresh (2 tokens a round: it is stale after
    # STALE_TOKENS); the next comes twice as many rounds later.
    refresh_at = 3 * REFRESH_FIRST
    assert REFRESH_FIRST < STALE_TOKENS // 2 <= refresh_at
    run(refresh_at - 3 - rounds, 0.024)
    run(3, 0.016)  # fast again
    assert _refresh(policy, 1, 0.010, 0.016) == [0] * REFRESH_SAMPLES
    assert policy.effective_costs().round_cost(1) == pytest.approx(1.6)
    assert policy.choose() == 1
    # The slow minute as the machine runs it now: a level on the timings, not the depth's cost.
    run(8, 0.024)
    assert policy.level() == pytest.approx(1.5)
    assert policy.effective_costs().round_cost(1) == pytest.approx(1.6)
    assert policy.effective_costs().plain_s == pytest.approx(0.015)


def test_a_deeper_depth_that_never_ran_is_timed_before_plain_decoding_settles_in():
    """An H100 (exo-demo): K = 1 rounds cost 2 plain steps live (0.94x plain), K = 2 rounds 2.4 (1.13x at 90%
    acceptance), but K = 2 was only ever estimated, from K = 1's glue on its warm-up cost (3.7 steps), so the
    probes from K = 0 all went to K = 1 and adaptive stayed at plain decoding. A depth deeper than every depth
    that ran, which could pay off at the acceptance measured if it cost what the depth below it costs, is run
    MIN_ROUND_SAMPLES times by the first probe."""
    costs = DepthCosts(beta=(1.3, 2.4), delta=(0.1, 0.2), device="gpu", plain_s=0.010, plain_pipelined_s=0.010)
    seconds = {1: 0.020, 2: 0.024}
    policy = DepthPolicy(costs, max_k=2, default_k=1)
    ran: list[int] = []
    for i in range(400):
        k = policy.choose()
        ran.append(k)
        if k == 0:
            tokens = min(policy.plain_budget(), 64)
            policy.observe_plain(tokens, tokens * 0.010)
        else:
            policy.observe_round(k, 0 if i % 10 == 0 else k, seconds[k])
    assert 0 in ran[:40]  # K = 1 does not pay: plain decoding first
    assert ran[-100:].count(2) >= 90, ran[-100:]


def test_a_probe_of_a_depth_with_stale_timings_outvotes_them():
    """K = 2 was timed in a slow minute (30 ms a round, plain tokens 7.5 ms) and the policy decodes plainly,
    probing rarer and rarer. The machine is fast again (K = 2 10 ms, plain 5 ms): the next probe finds K = 2's
    timings stale and runs MIN_ROUND_SAMPLES rounds, so K = 2 is back at once. One round among STALE_KEEP slow
    ones moved nothing, and the next probe came twice as many plain tokens later."""
    costs = DepthCosts(beta=(1.6, 1.9), delta=(0.13, 0.23), device="cuda", plain_s=0.005, plain_pipelined_s=0.005)
    policy = DepthPolicy(costs, max_k=2, default_k=2)
    while policy.choose() == 2:
        policy.observe_round(2, 2, 0.030)
    while policy.plain_budget() < STALE_TOKENS:  # slow: plain stretches and probes, all at K = 2
        policy.observe_plain(policy.plain_budget(), policy.plain_budget() * 0.0075)
        while policy.choose() == 2:
            policy.observe_round(2, 2, 0.030)
    budget = policy.plain_budget()
    policy.observe_plain(budget, budget * 0.005)  # fast again
    probe = 0
    while policy.choose() == 2 and probe < MIN_ROUND_SAMPLES:
        policy.observe_round(2, 2, 0.010)
        probe += 1
    assert probe == MIN_ROUND_SAMPLES and policy._current == 2
    assert policy.choose() == 2


def test_a_probe_ranks_a_depth_timed_stale_and_slow_by_what_it_could_cost():
    """exo-demo-moe on an H200: K = 2 ran at 2.0-2.5 plain steps, then one probe in a slow moment timed it at
    3.45, and K = 1 (live at 1.95 steps, 0.97x plain) became the most promising depth by live costs: every
    probe of the next 50 requests went to K = 1 and K = 2's figure stood, where a fixed K = 2 ran 1.03x plain.
    A depth whose timings are stale is ranked by its warm-up cost if that is less (as ``_could_pay`` judges it),
    so the probe renews K = 2, over MIN_ROUND_SAMPLES rounds."""
    u = 0.003
    costs = DepthCosts(beta=(1.6, 1.9), delta=(0.15, 0.25), device="cuda", plain_s=u, plain_pipelined_s=u)
    policy = DepthPolicy(costs, max_k=2, default_k=0)
    policy.observe_plain(32, 32 * u)
    for _ in range(3):
        policy.observe_round(1, 1, 1.95 * u)
    for i in range(12):
        policy.observe_round(2, (2, 2, 1, 2, 0, 2, 2, 1)[i % 8], 2.2 * u)
    policy.observe_plain(64, 64 * u)
    for _ in range(3):  # a probe in a slow moment
        policy.observe_round(2, 2, 3.45 * u)
    policy.observe_plain(128, 128 * u)
    assert policy.effective_costs().round_cost(2) == pytest.approx(3.45, abs=0.01)
    while (k := policy.choose()) == 0:
        policy.observe_plain(policy.plain_budget(), policy.plain_budget() * u)
    assert k == 2 and len(policy._refresh) == MIN_ROUND_SAMPLES - 1


def test_a_trace_records_what_the_policy_saw_and_chose(tmp_path, monkeypatch):
    """EXO_ADAPTIVE_TRACE: the warm-up costs, then every request, decision and observation as JSON lines (a
    real run's view, for bench/adaptive_sim.py@3c719fd), written a request at a time; nothing is written without it."""
    import json

    monkeypatch.delenv(adaptive.TRACE_ENV, raising=False)
    assert adaptive.trace_from_env(FLAT, 3) is None
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(adaptive.TRACE_ENV, str(path))
    policy = DepthPolicy(FLAT, max_k=3, default_k=2, trace=adaptive.trace_from_env(FLAT, 3))
    policy.new_request()
    k = policy.choose()
    policy.observe_round(k, 1, 0.02)
    policy.observe_plain(8, 0.05)
    # Written at the next request (off the decode path), not event by event.
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["policy", "request"]
    policy.new_request()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in events] == ["policy", "request", "choose", "round", "plain", "request"]
    assert events[0]["beta"] == list(FLAT.beta) and events[0]["max_k"] == 3
    assert events[2]["k"] == k == 2 and len(events[2]["rates"]) == 3
    assert events[3] | {"t": 0} == {"t": 0, "event": "round", "k": 2, "accepted": 1, "seconds": 0.02}
    assert events[4]["tokens"] == 8


@pytest.mark.parametrize(("round_s", "drafts"), [(0.0075, False), (0.0048, True)])
def test_a_probe_from_plain_decoding_is_judged_against_the_plain_burst_just_before_it(round_s, drafts):
    """An H200 (exo-demo) ran a first request's plain tokens at 3.0 ms (kernels compiled as contexts grew) and
    later ones at 2.2. A K = 3 round of 7.5 ms costs 3.4 of those plain steps and brings 3.3 tokens: plain
    decoding wins. Judged against plain decoding's window of first timings, a probe in the fast moment cost
    2.5 plain steps and the policy drafted at K = 3 (0.85x plain) for eight requests. Plain decoding is the
    unit: after its first timing its bursts measure the machine, and the probe is judged against the burst
    timed just before it. The other side: K = 3 rounds of 4.8 ms (2.2 plain steps) are drafted."""
    costs = DepthCosts(beta=(2.0, 2.5, 3.0), delta=(0.14, 0.29, 0.4), device="cuda", plain_s=0.0022,
                       plain_pipelined_s=0.0022)
    policy = DepthPolicy(costs, max_k=3, default_k=0)
    pattern = [3, 3, 2, 3, 1, 3, 3, 2, 3, 0]  # 0.9 / 0.89 / 0.75: 3.3 tokens a K = 3 round
    for i in range(60):
        policy.tracker.observe(3, pattern[i % len(pattern)])
    assert policy.choose() == 0  # 3.3 tokens for 3.4 plain steps by the warm-up
    for _ in range(3):
        policy.observe_plain(32, 32 * 0.0030)  # the first request
    policy.observe_plain(32, 32 * 0.0022)  # the burst just before the probe
    probe = []
    while (k := policy.choose()) != 0 and len(probe) < 10:
        probe.append(k)
        policy.observe_round(k, pattern[len(probe) % len(pattern)], round_s)
    assert probe[:MIN_ROUND_SAMPLES] == [3] * MIN_ROUND_SAMPLES
    assert (len(probe) > MIN_ROUND_SAMPLES) is drafts, probe
    assert policy.effective_costs().round_cost(3) == pytest.approx(round_s / 0.0022, rel=0.01)


def _probe_rounds(policy: DepthPolicy, round_costs: tuple[float, ...], rates: tuple[float, ...], requests: int,
                  budgets: list[int] | None = None) -> int:
    """Requests of 128 tokens as the decode loop runs them (plain tokens at 3 ms, a round at depth K costing
    ``round_costs[K - 1]`` plain steps, each draft landing at ``rates`` given the one before): the rounds run
    (``budgets``: gets every plain budget asked for)."""
    rng = random.Random(0)
    rounds = 0
    for _ in range(requests):
        policy.new_request()
        tokens = 0
        while tokens < 128:
            k = policy.choose()
            if k == 0:
                budget = policy.plain_budget()
                if budgets is not None:
                    budgets.append(budget)
                n = min(budget, 128 - tokens)
                policy.observe_plain(n, n * 0.003)
            else:
                landed = 0
                while landed < k and rng.random() < rates[landed]:
                    landed += 1
                policy.observe_round(k, landed, round_costs[k - 1] * 0.003)
                rounds, n = rounds + 1, landed + 1
            tokens += n
    return rounds


@pytest.mark.parametrize("far_max", [PROBE_FAR_MAX, PROBE_MAX])
def test_probes_grow_rarer_than_every_probe_max_tokens_where_every_depth_misses_by_far(monkeypatch, far_max):
    """exo-demo on an H200: drafts land 85/70/65% of the time, but K = 1, 2, 3 cost 2.2, 2.9 and 3.5 plain
    steps (every depth 0.81-0.85x plain decoding, optimistic acceptance within FAR_MISS of none). A probe every
    512 tokens, a K = 3 round and the head's catch-up (~4% of its request), cost adaptive 1.1% against an engine
    that never probed; past PROBE_MAX the backoff goes on doubling to PROBE_FAR_MAX."""
    monkeypatch.setattr(adaptive, "PROBE_FAR_MAX", far_max)
    costs = DepthCosts(beta=(2.0, 2.6, 3.1), delta=(0.2, 0.3, 0.4), device="cuda", plain_s=0.003, plain_pipelined_s=0.003)
    policy = DepthPolicy(costs, max_k=3, default_k=1)
    warm = _probe_rounds(policy, (2.2, 2.9, 3.5), (0.85, 0.7, 0.65), 16)  # the backoff reaches PROBE_MAX
    assert warm < 40 and policy.choose() == 0
    rounds = _probe_rounds(policy, (2.2, 2.9, 3.5), (0.85, 0.7, 0.65), 128)
    assert policy.plain_budget() > PROBE_MAX if far_max > PROBE_MAX else policy.plain_budget() <= PROBE_MAX
    if far_max > PROBE_MAX:
        assert rounds <= 12  # ~1 probe in 2048 tokens of 16384 (+ its deeper rounds)
    else:
        assert rounds >= 28  # as before: one in 512


def test_a_depth_that_misses_by_a_little_is_probed_every_probe_max_tokens():
    """K = 2 at 0.92x plain, 1.0x at optimistic acceptance (within FAR_MISS of the entry gain): the text may
    turn, and the machine's speed with it; its probes stay at one every PROBE_MAX tokens."""
    costs = DepthCosts(beta=(1.6, 1.9), delta=(0.15, 0.25), device="cuda", plain_s=0.003, plain_pipelined_s=0.003)
    policy = DepthPolicy(costs, max_k=2, default_k=2)
    budgets: list[int] = []
    assert _probe_rounds(policy, (2.2, 2.55), (0.85, 0.75), 128, budgets) > 0
    assert max(budgets) == PROBE_MAX


def test_one_probe_timed_in_a_slow_moment_does_not_put_off_the_next_probes():
    """K = 2 misses by a little (probes every PROBE_MAX tokens); one probe's rounds are timed at 3.4 plain
    steps in a slow moment (0.73x plain: FAR_MISS short). The next probe still comes PROBE_MAX tokens later:
    it takes FAR_PROBES probes in a row to stretch the backoff."""
    costs = DepthCosts(beta=(1.6, 1.9), delta=(0.15, 0.25), device="cuda", plain_s=0.003, plain_pipelined_s=0.003)
    policy = DepthPolicy(costs, max_k=2, default_k=2)
    _probe_rounds(policy, (2.2, 2.55), (0.85, 0.75), 32)
    budgets: list[int] = []
    assert _probe_rounds(policy, (3.0, 3.4), (0.85, 0.75), 4, budgets) > 0  # one probe, in a slow moment
    _probe_rounds(policy, (2.2, 2.55), (0.85, 0.75), 16, budgets)
    assert max(budgets) == PROBE_MAX
