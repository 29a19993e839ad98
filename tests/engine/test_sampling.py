"""Sampling distributions and the speculative ratio test (statistical checks)."""

import math

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

from exo.engine.sampling import (
    KeyStream,
    SamplingParams,
    SamplingParamsError,
    accepted_prefix,
    apply_processors,
    filtered_logprobs,
    greedy_verdict,
    make_processors,
    sampling_verdict,
    top_two,
)

TRIALS = 40_000


def _emitted_first_tokens(p: np.ndarray, q: np.ndarray, seed: int) -> np.ndarray:
    """TRIALS independent single-draft rounds (one per row): the token each round emits first."""
    keys = KeyStream(seed)
    log_p = mx.log(mx.array(np.tile(p, (TRIALS + 1, 1)), dtype=mx.float32))
    log_q = mx.log(mx.array(np.tile(q, (TRIALS, 1)), dtype=mx.float32))
    drafts = mx.random.categorical(log_q, axis=-1, key=keys.next())
    verdict = sampling_verdict(log_p, log_q, drafts, keys)
    emitted = mx.where(verdict.accepted, drafts, verdict.replacement[:TRIALS])
    return np.array(emitted)


@pytest.mark.parametrize(
    ("p", "q"),
    [
        ([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.1, 0.1, 0.5, 0.1, 0.1, 0.1]),  # very different
        ([0.4, 0.3, 0.2, 0.1, 0.0, 0.0], [0.0, 0.25, 0.25, 0.25, 0.25, 0.0]),  # disjoint-ish supports
        ([0.25, 0.25, 0.25, 0.25, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0, 0.0]),  # identical: no residual
        ([0.9, 0.02, 0.02, 0.02, 0.02, 0.02], [0.6, 0.08, 0.08, 0.08, 0.08, 0.08]),
    ],
)
def test_ratio_test_reproduces_target_distribution(p, q):
    p, q = np.array(p), np.array(q)
    emitted = _emitted_first_tokens(p, q, seed=7)
    support = p > 0
    counts = np.bincount(emitted, minlength=len(p))
    assert counts[~support].sum() == 0, "a token the target gives zero probability was emitted"
    result = chisquare(counts[support], TRIALS * p[support])
    assert result.pvalue > 1e-3, (counts, TRIALS * p)


def test_ratio_test_detects_a_wrong_target():
    # The statistic has power: the same draws judged against another distribution fail.
    p = np.array([0.5, 0.2, 0.1, 0.1, 0.05, 0.05])
    q = np.array([0.1, 0.1, 0.5, 0.1, 0.1, 0.1])
    counts = np.bincount(_emitted_first_tokens(p, q, seed=3), minlength=6)
    wrong = np.array([0.45, 0.25, 0.1, 0.1, 0.05, 0.05])
    assert chisquare(counts, TRIALS * wrong).pvalue < 1e-6


def test_acceptance_probability_is_min_one_ratio():
    p = np.array([0.7, 0.3])
    q = np.array([0.3, 0.7])
    keys = KeyStream(11)
    n = 20_000
    drafts = mx.ones((n,), dtype=mx.uint32)  # always propose token 1: p/q = 3/7
    verdict = sampling_verdict(
        mx.log(mx.array(np.tile(p, (n + 1, 1)), dtype=mx.float32)),
        mx.log(mx.array(np.tile(q, (n, 1)), dtype=mx.float32)),
        drafts,
        keys,
    )
    rate = float(mx.mean(verdict.accepted.astype(mx.float32)))
    assert rate == pytest.approx(3 / 7, abs=0.015)


def test_greedy_verdict():
    logits = mx.array([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 9.0]])
    verdict = greedy_verdict(logits, mx.array([1, 2]))
    assert verdict.accepted.tolist() == [True, False]
    assert verdict.replacement.tolist() == [1, 0, 2]
    assert accepted_prefix(verdict.accepted.tolist()) == (1, True)
    assert accepted_prefix([False, True]) == (0, True)
    assert accepted_prefix([True, True]) == (2, True)


def test_near_ties_leave_rows_undecided():
    # Row 0: clear winner; row 1: top two 0.001 apart (relative 1e-4); row 2: clear.
    logits = mx.array([[0.0, 9.0, 1.0], [3.0, 3.001, 1.0], [0.0, 1.0, 9.0]])
    strict = greedy_verdict(logits, mx.array([1, 1]), tie_margin=1e-3)
    assert strict.decided.tolist() == [True, False, True]
    assert accepted_prefix(strict.accepted.tolist(), strict.decided.tolist()) == (1, False)
    loose = greedy_verdict(logits, mx.array([1, 1]), tie_margin=1e-5)
    assert loose.decided.tolist() == [True, True, True]
    assert accepted_prefix(loose.accepted.tolist(), loose.decided.tolist()) == (2, True)
    # An undecided first row: nothing accepted, and the row after the (empty) run is undecided.
    first = greedy_verdict(mx.array([[1.0, 1.0], [0.0, 5.0]]), mx.array([0]), tie_margin=1e-3)
    assert accepted_prefix(first.accepted.tolist(), first.decided.tolist()) == (0, False)


def _probs(logits, **kw):
    return np.exp(np.array(filtered_logprobs(mx.array(np.asarray([logits], dtype=np.float32)), SamplingParams(**kw))[0]))


def test_filtered_distribution_matches_definitions():
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05]))
    np.testing.assert_allclose(_probs(logits, temperature=1.0), [0.4, 0.3, 0.15, 0.1, 0.05], atol=1e-6)
    np.testing.assert_allclose(_probs(logits, temperature=1.0, top_k=2), [4 / 7, 3 / 7, 0, 0, 0], atol=1e-6)
    # top_p 0.8 keeps the smallest prefix with mass >= 0.8: 0.4 + 0.3 + 0.15.
    np.testing.assert_allclose(_probs(logits, temperature=1.0, top_p=0.8), np.array([0.4, 0.3, 0.15, 0, 0]) / 0.85, atol=1e-6)
    # min_p 0.3 keeps tokens with p >= 0.3 * 0.4 = 0.12.
    np.testing.assert_allclose(_probs(logits, temperature=1.0, min_p=0.3), np.array([0.4, 0.3, 0.15, 0, 0]) / 0.85, atol=1e-6)
    hot = _probs(logits, temperature=2.0)
    expected = np.sqrt([0.4, 0.3, 0.15, 0.1, 0.05])
    np.testing.assert_allclose(hot, expected / expected.sum(), atol=1e-6)
    assert math.isclose(float(hot.sum()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"min_p": 2.0},
        {"repetition_penalty": 0.0},
        {"presence_penalty": 3.0},
        {"seed": -1},
    ],
)
def test_invalid_params_are_typed_errors(kwargs):
    with pytest.raises(SamplingParamsError):
        SamplingParams(**kwargs)


def test_a_repetition_penalty_near_zero_keeps_the_distribution_finite():
    """Any penalty in (0, 10] is valid; one that underflows (5e-324, found by the API fuzz test) divides the
    repeated positive logits into infinity and 0 by 0 into NaN. The penalised logits stay bounded: the repeated
    token with the positive logit becomes certain, and every log-probability (the API returns them) is finite."""
    params = SamplingParams(temperature=1.0, repetition_penalty=5e-324)
    logits = [[2.0, 0.0, -1.0, 3.0]]
    penalised = apply_processors(make_processors(params), mx.array([0, 1, 2]), mx.array(logits))
    assert mx.all(mx.isfinite(penalised)).item()
    assert mx.argmax(penalised, axis=-1).item() == 0
    logprobs = filtered_logprobs(penalised, params)
    assert mx.all(mx.isfinite(logprobs)).item()
    assert math.isclose(logprobs[0, 0].item(), 0.0, abs_tol=1e-6)
    # an ordinary penalty is untouched
    ordinary = apply_processors(make_processors(SamplingParams(repetition_penalty=1.3)), mx.array([0, 1, 2]),
                                mx.array(logits))
    assert np.allclose(np.array(ordinary), [[2.0 / 1.3, 0.0, -1.3, 3.0]])


def test_the_top_two_logits_of_each_row_are_those_topk_finds():
    """The near-tie test's two largest logits per row, without a partition of the vocabulary: equal to
    ``mx.topk``'s on random rows, on rows whose maximum occurs twice, and in bfloat16."""
    key = mx.random.key(7)
    rows = mx.random.normal((64, 300), key=key)
    rows[5, 17] = rows[5, 250] = 9.0  # a maximum that occurs twice: the second-largest is that maximum
    rows[6] = 0.0  # every logit equal
    for dtype in (mx.float32, mx.bfloat16):
        logits = rows.astype(dtype)
        first, second = top_two(logits, mx.argmax(logits, axis=-1))
        top = mx.topk(logits.astype(mx.float32), 2, axis=-1)
        assert mx.array_equal(first, mx.max(top, axis=-1)).item()
        assert mx.array_equal(second, mx.min(top, axis=-1)).item()
    assert second[5].item() == first[5].item() == 9.0
