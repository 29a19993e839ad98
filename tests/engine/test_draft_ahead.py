"""Drafting ahead: a speculative round builds the next round's drafts while its verify call computes, as if
every draft lands; kept when the verdict keeps every row, undone (head cache, PRNG key) when not. Nothing a
request sees may depend on it: greedy output, seeded samples, acceptance and depths are the same as without.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest

from exo.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, load_checkpoint

MAX_TOKENS = 48


@functools.cache
def _loaded(path):
    # Without an EOS every generation runs its whole budget: a fixed number of rounds on any fixture.
    return dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())


def _engine(path, ahead: bool) -> Engine:
    return Engine(_loaded(path), EngineConfig(prefill_chunk=8, draft_ahead=ahead))


def _prompt(engine: Engine) -> list[int]:
    return engine.loaded.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fib")


def _run(engine: Engine, request: GenerationRequest, choices=None):
    """(tokens, final stats, the run); ``choices``: the depths the run's policy picks, in turn."""
    run = engine.start(request)
    if choices is not None:
        assert run.policy is not None
        depths = itertools.cycle(choices)
        run.policy.choose = lambda: next(depths)  # type: ignore[method-assign]
        run.policy.plain_budget = lambda: 3  # type: ignore[method-assign]
    tokens, stats = [], None
    for chunk in run.stream():
        tokens.extend(chunk.token_ids)
        stats = chunk.stats or stats
    return tokens, stats, run


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_drafts_built_ahead_are_the_drafts_the_next_round_would_build(checkpoint, arch):
    """At each fixed depth, with and without drafting ahead: the same tokens as plain decoding, and the same
    drafts (the same acceptance, round by round: ``accepted_tokens`` and the per-position counts). Rounds
    after a round that kept every row ran on drafts built ahead; the others drafted afresh."""
    path = checkpoint(arch, dtype="float32")
    on, off = _engine(path, True), _engine(path, False)
    prompt = _prompt(on)
    plain = off.complete(GenerationRequest(prompt, max_tokens=MAX_TOKENS, native_mtp="off")).token_ids
    for k in (1, 2, 3):
        request = GenerationRequest(prompt, max_tokens=MAX_TOKENS, native_mtp="on", mtp_k=k)
        ahead_tokens, ahead, run = _run(on, request)
        fresh_tokens, fresh, _ = _run(off, request)
        assert ahead_tokens == fresh_tokens == plain, f"K = {k}"
        assert (ahead.rounds, ahead.accepted_tokens, ahead.per_position_drafted) == (
            fresh.rounds, fresh.accepted_tokens, fresh.per_position_drafted), f"K = {k}"
        assert fresh.rounds_drafted_ahead == 0
        # Every round but the last that could still need another one drafted ahead; those whose verdict kept
        # all k + 1 rows handed their drafts on (a trained head lands most).
        assert run.ahead_drafted >= ahead.rounds - 2
        assert 0 < ahead.rounds_drafted_ahead <= run.ahead_drafted
        assert ahead.rounds_drafted_ahead < ahead.rounds  # and some verdicts rejected a draft: undone


def test_seeded_samples_are_the_same_with_drafting_ahead(checkpoint):
    """Drafts built ahead draw their PRNG keys after the round's verdict, as the next round would; a verdict
    that rejects a draft sets the key stream back. A seed reproduces the same samples either way (without
    the rewind, the rounds after a rejection would draw other keys)."""
    path = checkpoint("qwen3_5", dtype="float32")
    on, off = _engine(path, True), _engine(path, False)
    prompt = _prompt(on)
    for k, seed in ((1, 3), (2, 11), (3, 5)):
        request = GenerationRequest(prompt, max_tokens=MAX_TOKENS, native_mtp="on", mtp_k=k,
                                    sampling=SamplingParams(temperature=0.9, seed=seed))
        ahead_tokens, ahead, run = _run(on, request)
        fresh_tokens, fresh, _ = _run(off, request)
        assert ahead_tokens == fresh_tokens, f"K = {k}, seed {seed}"
        assert ahead.accepted_tokens == fresh.accepted_tokens
        assert 0 < ahead.rounds_drafted_ahead < run.ahead_drafted  # kept some, undid some


def test_a_depth_change_or_plain_steps_undo_the_drafts_built_ahead(checkpoint):
    """The depth policy may pick another depth, or plain steps, after a round that drafted ahead: those drafts
    are undone and the head takes in the kept rows as after any round. Greedy output stays plain decoding's,
    and the drafts of every round are the ones a run without drafting ahead builds."""
    path = checkpoint("qwen3_5", dtype="float32")
    on, off = _engine(path, True), _engine(path, False)
    prompt = _prompt(on)
    plain = off.complete(GenerationRequest(prompt, max_tokens=64, native_mtp="off")).token_ids
    request = GenerationRequest(prompt, max_tokens=64, native_mtp="on")
    choices = [2, 2, 3, 1, 1, 0, 3, 3, 2]
    ahead_tokens, ahead, run = _run(on, request, choices)
    fresh_tokens, fresh, _ = _run(off, request, choices)
    assert ahead_tokens == fresh_tokens == plain
    assert ahead.k_histogram == fresh.k_histogram and ahead.accepted_tokens == fresh.accepted_tokens
    assert 0 < ahead.rounds_drafted_ahead < run.ahead_drafted


def _handed_over(engine: Engine, prompt: list[int], leave):
    """A K = 2 run that leaves its solo loop for a batch when ``leave(run)``: (its tokens, final stats, run,
    rounds it ran alone)."""
    from exo.engine.batch import BatchDecoder

    runs = []
    request = GenerationRequest(prompt, max_tokens=40, native_mtp="on", mtp_k=2,
                                yield_to_batch=lambda: leave(runs[0]))
    run = engine.start(request)
    runs.append(run)
    streamed = [t for chunk in run.stream() for t in chunk.token_ids]
    assert run.handed_over and run._ahead is None
    alone = run.recorder.rounds
    batch = BatchDecoder(engine)
    batch.add(run)
    final = None
    while len(batch):
        for _, chunks in batch.step():
            for chunk in chunks:
                streamed.extend(chunk.token_ids)
                final = chunk.stats or final
    assert final is not None
    return streamed, final, run, alone


def test_a_run_joining_a_batch_undoes_its_drafts_built_ahead(checkpoint):
    """A run leaving its solo loop for a batch at a round boundary takes the rows its last round kept to the
    batch (which drafts for itself): the batch's drafts are those of a run that never drafted ahead."""
    path = checkpoint("qwen3_5", dtype="float32")
    on, off = _engine(path, True), _engine(path, False)
    prompt = _prompt(on)
    # It leaves after a round whose verdict kept every row, drafts built ahead waiting for the next round.
    ahead_tokens, ahead, run, alone = _handed_over(on, prompt, lambda r: r.recorder.rounds >= 3 and r._ahead)
    fresh_tokens, fresh, _, _ = _handed_over(off, prompt, lambda r: r.recorder.rounds == alone)
    plain = off.complete(GenerationRequest(prompt, max_tokens=40, native_mtp="off")).token_ids
    assert ahead_tokens == fresh_tokens == plain
    assert run.ahead_drafted > 0 and ahead.rounds_drafted_ahead > 0 and alone < ahead.rounds
    assert (ahead.rounds, ahead.accepted_tokens) == (fresh.rounds, fresh.accepted_tokens)
