"""The serving scheduler's rules, table by table, without a model: admission (room, KV budget, the step's token
budget, FIFO, a drain for what cannot join), prefill chunks under the budget, and the bookkeeping the device
reports back (begun, fed, joined, left)."""

from __future__ import annotations

import random

import pytest

from exo.runner.scheduler import Chunk, Scheduler, StepPlan, Waiting, shared_call


def kv_room(tokens: int):
    """A KV budget of ``tokens`` rows: every run padded to the longest (``engine.batch.batch_bytes``'s shape,
    no recurrent state); a lone run always fits."""
    return lambda horizons: len(horizons) < 2 or len(horizons) * max(horizons) <= tokens


def make(max_batch: int = 8, kv: int = 10_000, step: int = 256, idle: int = 2048) -> Scheduler:
    return Scheduler(max_batch, kv_room(kv), step_tokens=step, idle_tokens=idle)


def gen(key: str, prompt: int, max_tokens: int = 64) -> Waiting:
    return Waiting(key, joins=True, horizon=prompt + max_tokens, prompt=prompt)


def run_step(s: Scheduler, plan: StepPlan, restored: dict[str, int] | None = None) -> None:
    """What the device does with a plan: begin the admitted (a prefix cache may have restored part of a prompt),
    feed every chunk in full, and join the newcomers whose prompt is in."""
    for key in plan.admit:
        s.begun(key, s.newcomers[key].remaining - (restored or {}).get(key, 0))
    for chunk in plan.prefill:
        s.fed(chunk.key, chunk.tokens)
        if s.newcomers[chunk.key].remaining == 0:
            s.joined(chunk.key)


@pytest.mark.parametrize(
    ("prompts", "idle", "admitted", "chunks", "held"),
    [
        # An idle batch: as many newcomers as the idle budget takes, in one step (their chunks all in it).
        ([20, 30, 40], 2048, ["a", "b", "c"], [20, 30, 40], None),
        # The budget ends inside the third: it gets the rest of the budget, the fourth waits for the next step.
        ([50, 50, 50, 50], 120, ["a", "b", "c"], [50, 50, 20], "step_tokens"),
        # A prompt longer than the budget: one chunk of the budget.
        ([3000, 10], 2048, ["a"], [2048], "step_tokens"),
    ],
)
def test_an_idle_batch_admits_newcomers_while_the_idle_budget_lasts(prompts, idle, admitted, chunks, held):
    s = make(idle=idle)
    plan = s.plan(gen(k, p) for k, p in zip("abcd", prompts, strict=False))
    assert plan.admit == tuple(admitted)
    assert plan.prefill == tuple(Chunk(k, t) for k, t in zip(admitted, chunks, strict=True))
    assert not plan.decode and plan.held == held


def test_with_members_decoding_the_step_budget_goes_to_the_oldest_newcomer_first():
    s = make(step=256)
    run_step(s, s.plan([gen("a", 10)]))  # a member now
    assert s.members == {"a": 74}
    plan = s.plan([gen("b", 600), gen("c", 100)])
    # b takes the whole step budget; c, behind it, waits (nothing overtakes b's prefill).
    assert plan == StepPlan(admit=("b",), prefill=(Chunk("b", 256),), decode=True, held="step_tokens", budget=256)
    run_step(s, plan)
    plan = s.plan([gen("c", 100)])
    assert plan == StepPlan(admit=(), prefill=(Chunk("b", 256),), decode=True, held="step_tokens", budget=256)
    run_step(s, plan)
    # b's last 88 tokens, and c is admitted with what is left of the budget.
    plan = s.plan([gen("c", 100)])
    assert plan == StepPlan(admit=("c",), prefill=(Chunk("b", 88), Chunk("c", 100)), decode=True, budget=256)
    run_step(s, plan)
    assert set(s.members) == {"a", "b", "c"} and not s.newcomers


def test_room_in_the_batch_counts_members_and_newcomers():
    s = make(max_batch=3)
    plan = s.plan(gen(k, 10) for k in "abcde")
    assert plan.admit == ("a", "b", "c") and plan.held == "max_batch"
    run_step(s, plan)
    assert s.plan([gen("d", 10)]) == StepPlan(decode=True, held="max_batch", budget=256)
    s.left("b")
    assert s.plan([gen("d", 10)]).admit == ("d",)


def test_the_kv_budget_holds_the_head_and_nothing_behind_it_overtakes():
    s = make(kv=300)  # two runs of horizon <= 150, or three of <= 100
    plan = s.plan([gen("a", 36), gen("b", 36), gen("big", 200), gen("small", 1)])
    # a and b fit (2 x 100); "big" (264) does not fit beside them; "small" behind it would, but waits (FIFO).
    assert plan.admit == ("a", "b") and plan.held == "kv_budget"
    run_step(s, plan)
    assert s.plan([gen("big", 200), gen("small", 1)]) == StepPlan(decode=True, held="kv_budget", budget=256)
    s.left("a")
    s.left("b")
    # Alone, a generation always runs, whatever its size.
    assert s.plan([gen("big", 5000), gen("small", 1)]).admit == ("big",)


def test_a_job_that_cannot_join_stops_admissions_until_the_batch_drains():
    s = make()
    load = Waiting("load", joins=False)
    plan = s.plan([gen("a", 10), load, gen("b", 10)])
    assert plan.admit == ("a",) and plan.held == "drain"
    run_step(s, plan)
    assert s.plan([load, gen("b", 10)]) == StepPlan(decode=True, held="drain", budget=256)
    s.left("a")
    assert s.plan([load]).idle  # drained: the device serves the load next


def test_a_rejected_generation_weighs_nothing_in_the_kv_budget():
    s = make(kv=1)
    plan = s.plan([gen("a", 10), Waiting("bad", joins=True), gen("b", 10)])
    # "bad" (horizon 0: rejected when it begins) joins weightless; b does not fit beside a.
    assert plan.admit == ("a", "bad") and plan.held == "kv_budget"


def test_a_prefix_cache_hit_and_a_snapshot_edge_change_what_is_left_to_prefill():
    s = make(step=64, idle=64)
    plan = s.plan([gen("a", 200)])
    assert plan.prefill == (Chunk("a", 64),)
    s.begun("a", 30)  # a prefix cache restored 170 of its 200 tokens
    s.fed("a", 20)  # the chunk ended at a snapshot edge after 20
    assert s.plan().prefill == (Chunk("a", 10),)


def test_an_admitted_job_that_ends_when_it_begins_leaves_the_batch():
    s = make(max_batch=1)
    plan = s.plan([gen("a", 10), gen("b", 10)])
    assert plan.admit == ("a",) and plan.held == "max_batch"
    s.left("a")  # cancelled while it waited: it ends in begin()
    assert s.plan([gen("b", 10)]).admit == ("b",)


@pytest.mark.parametrize("seed", range(20))
def test_a_running_stream_never_waits_more_than_the_step_budget_and_every_newcomer_gets_in(seed):
    """Random arrivals, prompts and lengths: while members decode, each step's chunks hold at most the step
    budget; with none decoding, at most the idle budget; each step feeds the oldest newcomer (no newcomer
    starves), and admissions keep queue order."""
    rng = random.Random(seed)
    s = make(max_batch=rng.choice([2, 4, 8]), kv=rng.choice([400, 2000, 100_000]), step=rng.choice([16, 64, 256]),
             idle=rng.choice([256, 2048]))
    queue = [gen(f"r{i}", rng.randint(1, 700), rng.randint(1, 40)) for i in range(40)]
    left: dict[str, int] = {}  # member -> tokens left to decode
    admitted: list[str] = []
    for _ in range(5000):
        if not queue and not len(s):
            break
        plan = s.plan(queue)
        budget = s.step_tokens if plan.decode else s.idle_tokens
        assert sum(c.tokens for c in plan.prefill) <= budget
        assert plan.decode == bool(s.members)
        if s.newcomers:
            assert plan.prefill and plan.prefill[0].key == next(iter(s.newcomers))
        admitted += plan.admit
        queue = queue[len(plan.admit):]
        for key in plan.admit:
            s.begun(key, s.newcomers[key].remaining)
        for chunk in plan.prefill:
            s.fed(chunk.key, chunk.tokens)
            if s.newcomers[chunk.key].remaining == 0:
                s.joined(chunk.key)
                left[chunk.key] = int(chunk.key[1:]) % 40 + 1
        if plan.decode:
            for key in list(left):
                left[key] -= 1
                if left[key] == 0:
                    del left[key]
                    s.left(key)
    assert not queue and not len(s)
    assert admitted == [f"r{i}" for i in range(40)]


@pytest.mark.parametrize(
    ("whole", "budget", "group"),
    [
        ([("a", 20), ("b", 30), ("c", 25)], 2048, ["a", "b", "c"]),  # padded 3 x 30
        ([("a", 20), ("b", 30), ("c", 25)], 80, ["a", "b"]),  # c would pad the call to 3 x 30 = 90
        ([("a", 20), ("b", 200), ("c", 25)], 100, ["a", "c"]),  # b alone would pad it to 2 x 200: it goes alone
        ([("a", 20)], 2048, []),  # one prompt prefills on its own
        ([("a", 100), ("b", 100)], 150, []),  # no two fit together
    ],
)
def test_whole_prompts_prefill_in_one_call_while_its_padded_size_fits_the_budget(whole, budget, group):
    assert shared_call(whole, budget) == group
