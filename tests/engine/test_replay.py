"""The replay drafter (engine/replay.py), the benchmarks' way to measure rounds at a chosen acceptance: it
delivers the rate it was asked for, the engine accepts exactly the drafts it made right, and the output is
plain greedy decoding's."""

from __future__ import annotations

import pytest

from exo.engine import Engine, EngineConfig, SamplingParams
from exo.engine.replay import ReplayDrafter, ReplayError

from .test_batch import _engine, _request, _run_batch, _solo


@pytest.mark.parametrize("acceptance", [0.0, 0.6, 0.8, 0.9, 1.0])
def test_the_drafter_delivers_the_rate_it_was_asked_for(acceptance):
    drafter = ReplayDrafter({(1, 2): list(range(20_000))}, acceptance, vocab_size=50_000, seed=3)
    drafts = drafter.drafts([1, 2], 0, 20_000)
    right = sum(d == i for i, d in enumerate(drafts)) / 20_000
    assert abs(right - acceptance) < 0.012  # (binomial sd <= 0.0036 at 20k draws)
    assert drafts == drafter.drafts([1, 2], 0, 20_000)  # fixed by the seed and the position
    assert drafter.drafts([1, 2], 100, 5) == drafts[100:105]  # the same whatever the depth that asks
    assert all(d != i for i, d in enumerate(drafts) if not drafter.right(i))
    with pytest.raises(ReplayError):
        drafter.drafts([9], 0, 1)
    with pytest.raises(ValueError):
        ReplayDrafter({}, 1.5, vocab_size=10)


def _expected(drafter: ReplayDrafter, k: int, max_tokens: int) -> tuple[int, int]:
    """(rounds, accepted drafts) of a reply of ``max_tokens`` at depth ``k``: each round accepts the drafts the
    drafter made right, up to the first wrong one, and emits one token more."""
    position, rounds, accepted = 1, 0, 0  # position 0 is the first token (prefill's)
    while position < max_tokens:
        run = 0
        while run < k and drafter.right(position + run):
            run += 1
        rounds, accepted, position = rounds + 1, accepted + run, position + run + 1
    return rounds, accepted


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_engine_accepts_exactly_the_replayed_right_drafts(checkpoint, k):
    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    requests = [_request(engine, i, max_tokens=60, mtp_k=k) for i in range(2)]
    plain = [_solo(engine, r).token_ids for r in requests]
    engine.replay = ReplayDrafter({tuple(r.prompt_tokens): p for r, p in zip(requests, plain, strict=True)}, 0.8,
                                  engine.vocab_size, seed=7)
    rounds, accepted = _expected(engine.replay, k, 60)
    for request, tokens in zip(requests, plain, strict=True):
        result = engine.complete(request)
        assert result.token_ids == tokens
        assert (result.stats.rounds, result.stats.accepted_tokens) == (rounds, accepted)
    # A batch's members see the same pattern (each its own positions).
    got = _run_batch(engine, requests, check=True)
    for i, tokens in enumerate(plain):
        assert got[i][0] == tokens and (got[i][3].rounds, got[i][3].accepted_tokens) == (rounds, accepted)


def test_a_replayed_engine_refuses_sampling(checkpoint):
    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    request = _request(engine, 0, max_tokens=8, mtp_k=1, sampling=SamplingParams(temperature=0.7, seed=1))
    engine.replay = ReplayDrafter({tuple(request.prompt_tokens): list(range(8))}, 1.0, engine.vocab_size)
    with pytest.raises(ReplayError):
        engine.complete(request)
    assert Engine(engine.loaded, EngineConfig()).replay is None  # nothing installs one by default


@pytest.mark.parametrize("acceptance", [0.0, 1.0])
def test_the_warm_acceptance_under_a_replay_is_the_replayed_rate(checkpoint, acceptance):
    """A benchmark's replayed run warms the depth policy on the replayed continuation, not the head's own answer to
    the warm-up question (a random head's ~0 acceptance kept adaptive from ever drafting at 0.9 replayed)."""
    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    request = _request(engine, 0, max_tokens=40)
    engine.replay = ReplayDrafter({tuple(request.prompt_tokens): _solo(engine, request).token_ids}, acceptance,
                                  engine.vocab_size, seed=1)
    warm = engine.warm_acceptance()
    assert warm is not None and warm.reached[0] >= 5
    assert warm.rates()[0] == pytest.approx(acceptance, abs=0.1)
