"""Adaptive depth: table tests of the cost model, the estimator and the state machine (synthetic observations,
deterministic)."""

import random

import pytest

from exo.engine import adaptive
from exo.engine.adaptive import (
    COST_PRIOR_WEIGHT,
    MIN_GAIN,
    PAIR_SAMPLES,
    PROBE_FIRST,
    PROBE_MAX,
    PROBE_PLAIN_TOKENS,
    PROBE_ROUNDS,
    WARM_WEIGHT,
    AcceptanceTracker,
    BatchDepthPolicy,
    DepthCosts,
    DepthPolicy,
    RoundCosts,
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


# A device where a round costs about as many plain steps as it has rows, twice its warm-up's excess over one
HOPELESS = DepthCosts(beta=(3.0, 5.0, 7.0), delta=(0.15, 0.30, 0.45), device="cpu")


def test_can_pay_off():
    assert can_pay_off(H100, 3)
    assert not can_pay_off(CPU, 3)
    # the warm-up's excess over a plain step doubted: a compute-bound CPU's rounds might pay, HOPELESS's not
    assert can_pay_off(CPU, 3, doubt=adaptive.WARM_COST_DOUBT)
    assert not can_pay_off(HOPELESS, 3, doubt=adaptive.WARM_COST_DOUBT)


def test_a_policy_where_no_depth_could_pay_never_drafts_or_probes():
    policy = DepthPolicy(HOPELESS, max_k=3, default_k=2)
    assert not policy.mtp_can_pay_off
    for _ in range(50):
        assert policy.choose() == 0
        policy.observe_plain(100, 1.0)
    assert policy.plain_budget() > 10**6


def test_a_compute_bound_device_is_probed_once_then_every_probe_max_tokens():
    """The warm-up says rounds cost their rows (a compute-bound CPU) and so they do: the first probe point probes a
    depth (the warm-up's costs alone decide nothing), the live pair says no depth pays, and from then on probe
    points pass until they are PROBE_MAX apart: nearly every token is a plain one."""
    policy = DepthPolicy(CPU, max_k=3, default_k=0)
    assert policy.mtp_can_pay_off
    machine = Machine(cost=[CPU.round_cost(k) for k in (1, 2, 3)], acceptance=(0.9, 0.9, 0.9))
    first = machine.run(policy, 400)
    assert machine.probes and machine.probes[0] <= 2 * PROBE_FIRST and policy.depth == 0
    assert sum(first.get(k, 0) for k in (1, 2, 3)) <= 2 * (PROBE_ROUNDS * 4)
    later = machine.run(policy, 20000)
    assert _share(later, 0) > 0.98


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




def test_fixed_depth_is_kept():
    policy = DepthPolicy(CPU, max_k=3, fixed_k=2)
    assert policy.mtp_can_pay_off
    for _ in range(10):
        policy.observe_round(2, 0)
        assert policy.choose() == 2




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
    # HOPELESS, not CPU: a batch of one is the solo policy, which probes CPU's doubted warm-up costs once
    policy = _batch_policy(HOPELESS)
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
    # ... the other depths' estimates carry the same glue: none could pay, probe points pass, growing further
    # apart, until they are PROBE_MAX steps apart: then a probe (PROBE_ROUNDS rounds) at each.
    rounds_at = []
    for step in range(2 * PROBE_MAX + 64):
        if k := policy.choose(4):
            rounds_at.append(step)
            policy.observe_round(4, k, 0.050)
        else:
            policy.observe_plain(4, 0.011)
    assert len(rounds_at) == PROBE_ROUNDS and rounds_at[0] > PROBE_MAX


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




def test_a_warmup_that_says_drafting_cannot_pay_is_confirmed_before_it_turns_mtp_off(monkeypatch):
    """"Cannot pay off even with every draft accepted" turns adaptive MTP off for the engine's life, so a
    warm-up that says it is measured again and each part's fastest time kept (interference only adds time): a
    moment of noise (an H100 once timed exo-demo-moe's 2-row verify at 2.9 plain steps, its rounds then ran at
    1.9) no longer disables drafting. A warm-up that says drafting can pay is taken as it is; a device where
    drafting really cannot pay (every warm-up says so) stays off."""
    from exo.engine import costs as costs_module

    slow = DepthCosts(beta=(4.0, 5.5), delta=(0.2, 0.3), device="cuda", plain_s=0.004, plain_pipelined_s=0.004)
    fast = DepthCosts(beta=(1.6, 1.8), delta=(0.1, 0.2), device="cuda", plain_s=0.005, plain_pipelined_s=0.0045)
    doubt = adaptive.WARM_COST_DOUBT  # the verdict that turns MTP off is the policy's, on doubted costs

    def can_pay(costs: DepthCosts) -> bool:
        return can_pay_off(costs.in_pipelined_steps(), 2, doubt=doubt)

    assert not can_pay(slow) and can_pay(fast)

    def warm(*measured):
        calls = list(measured)
        monkeypatch.setattr(costs_module, "measure_costs", lambda *args, **kwargs: calls.pop(0))
        result = costs_module.warmup_costs(None, None, None, 2)
        return result, len(measured) - len(calls)

    confirmed, runs = warm(slow, fast, slow)
    assert runs == 2 and can_pay(confirmed)
    # Each part's fastest time, in the fastest plain step: the verify of 2 rows 1.6 x 5 ms = 8 ms / 4 ms.
    assert confirmed.plain_s == 0.004 and confirmed.plain_pipelined_s == 0.004
    assert confirmed.beta == pytest.approx((2.0, 2.25)) and confirmed.delta == pytest.approx((0.125, 0.25))
    assert warm(fast, slow) == (fast, 1)
    off, runs = warm(slow, slow, slow)
    assert runs == 3 and not can_pay(off)




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




# -- the estimator: costs from neighbouring timings ---------------------------------------------------------------
def _costs(*rounds: float) -> RoundCosts:
    """An estimator whose warm-up put every round at ``rounds`` plain tokens (all verify)."""
    return RoundCosts(DepthCosts(beta=tuple(rounds), delta=(0.0,) * len(rounds), device="test"))


def test_a_pair_of_neighbouring_timings_sets_a_depth_s_cost():
    costs = _costs(1.2, 1.4, 1.6)
    costs.observe(0, 0.010)  # a plain burst: seconds per token
    for _ in range(PAIR_SAMPLES):
        costs.observe(2, 0.025)
    # Fitted with the warm-up's 1.4 as a weak prior: (w log 2.5 + w0 log 1.4) / (w + w0), w = one pair.
    w0 = COST_PRIOR_WEIGHT
    glue = 2.5 ** (1 / (1 + w0)) * 1.4 ** (w0 / (1 + w0)) / 1.4  # fitted over warm-up, first fit
    assert costs.round_cost(2) == pytest.approx(2.5 ** (1 / (1 + w0)) * (1.4 * glue) ** (w0 / (1 + w0)))
    # Depths not timed: their warm-up cost times that glue.
    assert costs.round_cost(1) == pytest.approx(1.2 * glue) and costs.round_cost(3) == pytest.approx(1.6 * glue)
    costs.observe(0, 0.010)  # back to plain: a second pair, the same ratio
    assert costs.round_cost(2) == pytest.approx(2.5, rel=0.01)


def test_a_chain_of_pairs_reaches_plain_decoding_through_other_depths():
    costs = _costs(1.2, 1.4, 1.6)
    for _ in range(5):  # plain, then K = 2 rounds, then K = 3 rounds, and back
        costs.observe(0, 0.010)
        for _ in range(PAIR_SAMPLES):
            costs.observe(2, 0.020)
        for _ in range(PAIR_SAMPLES):
            costs.observe(3, 0.030)
        for _ in range(PAIR_SAMPLES):
            costs.observe(2, 0.020)
    assert costs.paired(3, 0) and not costs.paired(1, 0)
    assert costs.round_cost(2) == pytest.approx(2.0, rel=0.05) and costs.round_cost(3) == pytest.approx(3.0, rel=0.05)


def test_drift_between_minutes_cancels_out_of_pairs():
    """The machine runs 1.6x slower in some minutes than in others; each pair's two sides are timed seconds
    apart, so the costs come out as they are (a median of seconds per depth would compare minutes)."""
    costs = _costs(1.0, 1.0, 1.0)
    for minute in range(40):
        speed, k = (1.6 if minute % 2 else 1.0), 1 + minute % 3
        costs.observe(0, 0.010 * speed)
        for _ in range(PAIR_SAMPLES):
            costs.observe(k, 0.010 * speed * (1.5, 2.0, 2.6)[k - 1])
        costs.observe(0, 0.010 * speed)
    assert [costs.round_cost(k) for k in (1, 2, 3)] == pytest.approx([1.5, 2.0, 2.6], rel=0.03)


def test_untimed_runs_leave_a_stretch_whole_and_a_round_never_costs_less_than_a_plain_token():
    costs = _costs(1.2)
    costs.observe(0, 0.010)
    costs.observe(1, 0.011)
    costs.observe(0, None)  # a near tie's single plain step: not timed, not a change of depth
    costs.observe(1, 0.009)
    costs.observe(1, 0.008)
    assert costs.timings(1) == 3 and costs.timings(0) == 1
    assert costs.round_cost(1) == 1.0  # timed at 0.9 plain tokens, in a fast moment: at least one


# -- the state machine -------------------------------------------------------------------------------------------
class Machine:
    """A synthetic device and head: a plain token costs ``unit`` seconds times the machine's speed of the moment,
    a round at depth k ``cost[k - 1]`` of them; each draft position lands with its ``acceptance`` (seeded)."""

    def __init__(self, cost, acceptance, unit=0.010, seed=0):
        self.cost, self.acceptance, self.unit = list(cost), list(acceptance), unit
        self.rng = random.Random(seed)
        self.speed = 1.0
        self.tokens = 0
        self.probes: list[int] = []  # tokens run when each probe started

    def run(self, policy: DepthPolicy, tokens: int) -> dict[int, int]:
        """Drives ``policy`` as the decode loop does for ``tokens`` tokens: tokens emitted per depth."""
        emitted: dict[int, int] = {}
        end = self.tokens + tokens
        while self.tokens < end:
            probing = policy.probing
            k = policy.choose()
            if policy.probing is not None and probing is None:
                self.probes.append(self.tokens)
            if k == 0:
                n = min(policy.plain_budget(), end - self.tokens)
                policy.observe_plain(n, n * self.unit * self.speed if n >= adaptive.PLAIN_TIMED_MIN else None)
            else:
                accepted = 0
                while accepted < k and self.rng.random() < self.acceptance[accepted]:
                    accepted += 1
                n = accepted + 1
                policy.observe_round(k, accepted, self.cost[k - 1] * self.unit * self.speed)
            emitted[k] = emitted.get(k, 0) + n
            self.tokens += n
        return emitted


# The warm-up's view (cheap rounds, as a warm-up of parts alone reads them) against what rounds really cost.
WARM = DepthCosts(beta=(1.15, 1.3, 1.45), delta=(0.05, 0.1, 0.15), device="test", plain_s=0.010)


def _share(emitted: dict[int, int], k: int) -> float:
    return emitted.get(k, 0) / sum(emitted.values())


def test_exploits_the_depth_with_the_most_tokens_per_cost():
    """Rounds cost more than the warm-up said, K = 2 the most tokens per cost (2.44 / 1.6 = 1.53x plain, K = 1
    1.38x, K = 3 1.34x): after learning, the policy runs K = 2 almost throughout."""
    policy = DepthPolicy(WARM, max_k=3, default_k=1)
    machine = Machine(cost=(1.3, 1.6, 2.2), acceptance=(0.8, 0.8, 0.8))
    machine.run(policy, 2000)
    later = machine.run(policy, 6000)
    assert policy.depth == 2 and _share(later, 2) > 0.95
    assert policy.estimator.round_cost(2) == pytest.approx(1.6, rel=0.05)


def test_probes_back_off_where_no_depth_pays():
    """Every depth runs at 0.86-0.90x plain here (a warm-up that said they were cheap): the policy decodes
    plainly, and its probes come further and further apart, doubling up to PROBE_MAX tokens; nearly every
    token is a plain one."""
    policy = DepthPolicy(WARM, max_k=3, default_k=1)
    machine = Machine(cost=(2.2, 3.0, 3.8), acceptance=(0.9, 0.9, 0.9))
    machine.run(policy, 2000)
    assert policy.depth == 0
    later = machine.run(policy, 20000)
    assert _share(later, 0) > 0.98
    assert policy.probe_every == PROBE_MAX
    gaps = [b - a for a, b in zip(machine.probes, machine.probes[1:], strict=False)]
    assert gaps == sorted(gaps) or max(gaps[-5:]) <= PROBE_MAX + 16  # growing, then PROBE_MAX apart
    assert min(gaps[-5:]) >= PROBE_MAX  # at the end: once per PROBE_MAX tokens at most


def test_a_head_whose_drafts_never_land_is_probed_only_every_probe_max_tokens():
    """No depth could pay at the acceptance measured (a random head): probe points pass without a probe until
    they are PROBE_MAX apart, then one probe of PROBE_ROUNDS rounds each time (the head might suit a new text)."""
    policy = DepthPolicy(WARM, max_k=3, default_k=0)
    for _ in range(40):
        policy.observe_round(3, 0)  # the warm-up's answer: nothing landed
    machine = Machine(cost=(1.3, 1.6, 2.2), acceptance=(0.02, 0.02, 0.02))
    emitted = machine.run(policy, 3 * PROBE_MAX + 2 * PROBE_FIRST * 64)
    rounds = sum(emitted.get(k, 0) for k in (1, 2, 3))
    assert 0 < rounds <= 4 * PROBE_ROUNDS * 1.2


def test_recovers_when_acceptance_returns():
    """A text the head cannot draft for (2% of drafts land): plain decoding. Then the head's text again (85%):
    within a few probe intervals the policy drafts at its best depth again."""
    policy = DepthPolicy(WARM, max_k=3, default_k=1)
    machine = Machine(cost=(1.3, 1.6, 2.2), acceptance=(0.85, 0.85, 0.85))
    machine.run(policy, 1500)
    assert policy.depth >= 1
    machine.acceptance = [0.02, 0.02, 0.02]
    hard = machine.run(policy, 3000)
    assert policy.depth == 0 and _share(hard, 0) > 0.97
    machine.acceptance = [0.85, 0.85, 0.85]
    machine.run(policy, 2 * PROBE_MAX + 200)
    assert policy.depth >= 1
    back = machine.run(policy, 3000)
    assert _share(back, 0) < 0.05


def test_the_first_probe_from_a_depth_never_timed_against_plain_decoding_is_plain_decoding():
    """The exploited depth's cost must be known in plain tokens: until a pair links it to plain decoding, the
    probe point goes to a timed plain burst (PROBE_PLAIN_TOKENS tokens), whatever else looks promising."""
    policy = DepthPolicy(WARM, max_k=3, default_k=3)
    assert policy.choose() == 3
    for _ in range(PROBE_FIRST):
        policy.observe_round(3, 3, 0.025)
    assert policy.choose() == 0 and policy.probing == 0
    assert policy.plain_budget() == PROBE_PLAIN_TOKENS
    policy.observe_plain(PROBE_PLAIN_TOKENS, PROBE_PLAIN_TOKENS * 0.010)
    assert policy.choose() == 3 and policy.probing is None
    assert policy.estimator.paired(3, 0) and policy.estimator.round_cost(3) > 2.0


def test_a_change_of_depth_needs_a_clear_gain():
    """Depths within MIN_GAIN of each other: the policy stays where it is (flipping would cost catch-ups)."""
    policy = DepthPolicy(WARM, max_k=3, default_k=2)
    machine = Machine(cost=(1.2, 1.6, 2.0), acceptance=(0.8, 0.8, 0.8))  # K = 1: 1.50x, K = 2: 1.53x, K = 3 1.47x
    machine.run(policy, 3000)
    depth = policy.depth
    assert depth in (1, 2)
    changes = 0
    for _ in range(30):
        machine.run(policy, 100)
        changes += policy.depth != depth
        depth = policy.depth
    assert changes <= 2
    assert MIN_GAIN > 1.0


def test_learning_carries_over_to_the_next_request():
    policy = DepthPolicy(WARM, max_k=3, default_k=1)
    machine = Machine(cost=(1.3, 1.6, 2.2), acceptance=(0.8, 0.8, 0.8))
    machine.run(policy, 2000)
    depth, cost = policy.depth, policy.estimator.round_cost(2)
    policy.new_request()
    assert policy.choose() in (depth, policy.probing) and policy.estimator.round_cost(2) == cost


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
    # Timed live, in pairs: a round in seconds against the plain tokens timed just before and after it.
    for _ in range(4):
        policy.observe_plain(16, 16 * 0.008)
        for _ in range(PAIR_SAMPLES):
            policy.observe_round(1, 1, seconds=0.0128)
    policy.observe_plain(16, 16 * 0.008)
    assert policy.effective_costs().round_cost(1) == pytest.approx(1.6, rel=0.01)


def test_a_warm_up_that_overstates_round_costs_is_corrected_by_a_probe():
    """The warm-up timed rounds at 2.5-4 plain steps, so that not even full acceptance would pay by its costs;
    live they cost 1.6-2.6 (an H200's 9B: adaptive never drafted where K = 1 ran 1.13x plain). The first probe
    point probes a depth, the pair with plain decoding sets the live cost, and the policy drafts from then on."""
    warm = DepthCosts(beta=(2.4, 3.1, 3.7), delta=(0.1, 0.2, 0.3), device="gpu")
    assert not can_pay_off(warm, 3)  # by its costs as timed
    policy = DepthPolicy(warm, max_k=3, default_k=0)
    machine = Machine(cost=(1.6, 2.1, 2.6), acceptance=(0.9, 0.9, 0.9))
    machine.run(policy, 300)
    assert policy.depth >= 1
    later = machine.run(policy, 3000)
    assert _share(later, 0) < 0.1


def test_mtp_that_cannot_pay_off_against_pipelined_plain_decoding_never_probes():
    """Even full acceptance (2 tokens a round) cannot beat a round of 2.6 steps alone = 3.12 pipelined plain
    tokens, its excess over one doubted (2.06): the head is not fed and nothing is probed (in steps alone, 1.8
    doubted, it looked like 1.11x)."""
    costs = DepthCosts(beta=(2.5,), delta=(0.1,), device="gpu", plain_s=0.012, plain_pipelined_s=0.010)
    doubt = adaptive.WARM_COST_DOUBT
    assert can_pay_off(costs, 1, doubt=doubt) and not can_pay_off(costs.in_pipelined_steps(), 1, doubt=doubt)
    policy = DepthPolicy(costs, max_k=1, default_k=1)
    assert not policy.mtp_can_pay_off
    assert policy.choose() == 0 and policy.plain_budget() == 1 << 30


def test_a_batch_bucket_probes_plain_decoding_for_a_pair_s_worth_of_steps():
    """A batch's plain steps come one timing each (a solo burst averages its tokens): a bucket's plain probe runs
    PAIR_SAMPLES steps, enough for a pair's median, and the round after it is paired with them."""
    policy = DepthPolicy(WARM, max_k=3, default_k=3, plain_samples=PAIR_SAMPLES)
    assert policy.choose() == 3
    for _ in range(PROBE_FIRST):
        policy.observe_round(3, 3, 0.025)  # drafts landing: K = 3 pays at 2.5
    probe = []
    while (k := policy.choose()) == 0:
        probe.append(k)
        policy.observe_plain(1, 0.010)
    assert len(probe) == PAIR_SAMPLES and k == 3
    for _ in range(PAIR_SAMPLES):
        policy.observe_round(3, 3, 0.025)  # drafts landing: K = 3 pays at 2.5
    assert policy.estimator.round_cost(3) == pytest.approx(2.5, rel=0.05)
