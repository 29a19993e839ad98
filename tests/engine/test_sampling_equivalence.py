"""MTP sampling draws from the same distribution as plain sampling (two-sample chi-squared tests)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from exo.engine import Engine, GenerationRequest, SamplingParams
from tests.fixtures.engines import fresh_engine

RUNS = 300
LENGTH = 3  # token 0 comes from prefill; tokens 1 and 2 from speculative rounds


def _engine(path) -> Engine:
    return fresh_engine(path)


@functools.cache
def _cached_samples(engine: Engine, prompt: tuple[int, ...], sampling: tuple, mode: str, k: int | None):
    return _sample_runs(engine, list(prompt), dict(sampling), native_mtp=mode, mtp_k=k)


def _samples(engine: Engine, prompt, sampling: dict, native_mtp: str = "auto", mtp_k: int | None = None):
    return _cached_samples(engine, tuple(prompt), tuple(sorted(sampling.items())), native_mtp, mtp_k)


def _sample_runs(engine: Engine, prompt, sampling: dict, **request) -> tuple[np.ndarray, int, int]:
    rows, drafted, accepted = [], 0, 0
    for seed in range(RUNS):
        result = engine.complete(
            GenerationRequest(prompt, max_tokens=LENGTH, sampling=SamplingParams(seed=seed, **sampling), **request)
        )
        rows.append((result.token_ids + [-1] * LENGTH)[:LENGTH])
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    return np.array(rows), drafted, accepted


def _batched_runs(engine: Engine, prompt, sampling: dict, mtp_k: int, size: int = 8) -> tuple[np.ndarray, int, int]:
    """The same seeds as ``_sample_runs``, decoded ``size`` at a time in one batch with native MTP."""
    from exo.engine.batch import BatchDecoder

    rows, drafted, accepted = [], 0, 0
    for first in range(0, RUNS, size):
        batch = BatchDecoder(engine)
        tokens: dict[int, list[int]] = {}
        seeds: dict[int, int] = {}  # id(run) -> its seed
        for seed in range(first, min(first + size, RUNS)):
            run = engine.start(
                GenerationRequest(prompt, max_tokens=LENGTH, sampling=SamplingParams(seed=seed, **sampling), mtp_k=mtp_k)
            )
            tokens[seed] = [t for chunk in run.begin() if chunk is not None for t in chunk.token_ids]
            seeds[id(run)] = seed
            if run.output.finish is None:
                batch.add(run)
            else:  # it ended at its first token (an end of sequence): that token is in its final chunk
                tokens[seed].extend(run.final_chunk().token_ids)
        while len(batch):
            for run, chunks in batch.step():
                for chunk in chunks:
                    tokens[seeds[id(run)]].extend(chunk.token_ids)
                    if chunk.stats is not None:
                        drafted += chunk.stats.drafted_tokens
                        accepted += chunk.stats.accepted_tokens
        rows.extend((tokens[seed] + [-1] * LENGTH)[:LENGTH] for seed in sorted(tokens))
    return np.array(rows), drafted, accepted


def _same_distribution_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample chi-squared on the joint (token1, token2) outcomes, rare outcomes pooled."""
    keys_a = [tuple(r) for r in a]
    keys_b = [tuple(r) for r in b]
    outcomes = sorted(set(keys_a) | set(keys_b))
    counts = np.array([[keys_a.count(o) for o in outcomes], [keys_b.count(o) for o in outcomes]])
    common = counts.sum(axis=0) >= 10
    table = np.column_stack([counts[:, common], counts[:, ~common].sum(axis=1)])
    table = table[:, table.sum(axis=0) > 0]
    return float(chi2_contingency(table).pvalue)


@pytest.fixture(scope="module")
def setup(checkpoint):
    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    prompt = engine.loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me something."}], add_generation_prompt=True
    )
    return engine, prompt


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.0},
        {"temperature": 1.1, "top_p": 0.9, "top_k": 20, "min_p": 0.05},
    ],
    ids=["t1", "filtered"],
)
def test_mtp_sampling_matches_plain_sampling(setup, sampling, record_property):
    engine, prompt = setup
    plain, _, _ = _samples(engine, prompt, sampling, native_mtp="off")
    mtp, drafted, accepted = _samples(engine, prompt, sampling, mtp_k=2)
    assert 0 < accepted < drafted, "both the accept and the reject path must run"
    pvalue = _same_distribution_pvalue(plain[:, 1:], mtp[:, 1:])
    record_property("pvalue", pvalue)
    record_property("acceptance", accepted / drafted)
    assert pvalue > 1e-3, pvalue


def test_mtp_sampling_in_a_batch_matches_plain_sampling(setup, record_property):
    """Members of a batch, each with its own seed, drafting and verifying together: each one's samples keep
    plain sampling's distribution (and the batch's are the solo MTP samples, seed for seed)."""
    engine, prompt = setup
    sampling = {"temperature": 1.0}
    plain, _, _ = _samples(engine, prompt, sampling, native_mtp="off")
    batched, drafted, accepted = _batched_runs(engine, prompt, sampling, mtp_k=2)
    assert 0 < accepted < drafted, "both the accept and the reject path must run"
    pvalue = _same_distribution_pvalue(plain[:, 1:], batched[:, 1:])
    record_property("pvalue", pvalue)
    assert pvalue > 1e-3, pvalue
    solo_mtp, _, _ = _samples(engine, prompt, sampling, mtp_k=2)
    assert (batched == solo_mtp).all()


def test_the_check_has_power(setup, record_property):
    engine, prompt = setup
    hot, _, _ = _samples(engine, prompt, {"temperature": 1.0}, native_mtp="off")
    cold, _, _ = _samples(engine, prompt, {"temperature": 0.4}, native_mtp="off")
    pvalue = _same_distribution_pvalue(hot[:, 1:], cold[:, 1:])
    record_property("pvalue", pvalue)
    assert pvalue < 1e-3
