"""Chained speculative rounds (``EXO_NATIVE_MTP_ROUND_AHEAD=chain``, ``engine.ahead.build_chained``): round n + 1
built on round n's verdict as the device holds it and launched before the host reads it. Greedy output stays plain
decoding's token for token whatever round n kept, and the state between steps is the loop's. Where round n ended
the request (round n + 1 rejected) and where a round after it will not run (abandoned): test_ahead.py, which runs
those for rounds built ahead and chained alike."""

from __future__ import annotations

import pytest

from exo.engine import Engine, EngineConfig, GenerationRequest, batch_step
from exo.engine import ahead as ahead_module
from exo.engine.batch import BatchDecoder
from exo.engine.replay import ReplayDrafter

from .rounds import assert_plain_tokens, count_calls
from .rounds import complete as _complete
from .rounds import loaded as _loaded
from .rounds import prompt as _prompt

CHUNK = 8


@pytest.fixture
def counted(monkeypatch):
    """How many chained rounds were built, went on (their round before read and kept), were rejected, abandoned."""
    counts = {"built": 0, "confirmed": 0, "rejected": 0, "abandoned": 0}
    count_calls(monkeypatch, batch_step, "build_chained", counts, "built")
    for name, key in (("confirm", "confirmed"), ("reject", "rejected"), ("abandon", "abandoned")):
        count_calls(monkeypatch, ahead_module.ChainedRound, name, counts, key)
    return counts


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("depth", [1, 2, 3, None], ids=["k1", "k2", "k3", "adaptive"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chained_rounds_give_plain_decodings_tokens(checkpoint, arch, depth, dtype, counted):
    """The demo head keeps some drafts and refuses others: each chained round is built on whatever the round
    before kept; greedy MTP with them equals plain decoding and MTP without them, token for token, with the same
    rounds and drafts kept, at prompt lengths across prefill chunks and budgets that end inside rounds."""
    assert_plain_tokens(_loaded(checkpoint(arch, dtype=dtype)), "chain", depth, CHUNK)
    if depth is not None:
        assert counted["built"] > 0 and counted["confirmed"] > 0, counted


@pytest.mark.parametrize("paths", ["cpu", "cuda"])
@pytest.mark.parametrize("acceptance", [1.0, 0.6, 0.0])
def test_chained_rounds_at_replayed_acceptance_and_the_invariants_between_steps(checkpoint, counted, acceptance,
                                                                                paths, monkeypatch):
    """A replayed continuation (the benchmarks' drafter: its drafts for a chained round taken by the device's
    position): every round's drafts kept, some, none. The output is plain decoding's, a chained round is in the
    caches between steps and the invariants hold there, and the budget ends inside a round. ``cuda``: the layers
    wired as on MLX CUDA (compiled calls, exo's GatedDeltaNet and attention kernels with their references standing
    in on this CPU), in bfloat16."""
    if paths == "cuda":
        monkeypatch.setattr("exo.engine.models.compiled_layers.MODE", "always")
        monkeypatch.setenv("EXO_GDN_KERNEL", "always")
        monkeypatch.setenv("EXO_ATTN_KERNEL", "always")
    loaded = _loaded(checkpoint("qwen3_5", dtype="float32" if paths == "cpu" else "bfloat16"))
    engine = Engine(loaded, EngineConfig(prefill_chunk=CHUNK, round_ahead="chain"))
    prompt = _prompt(loaded, 11)
    plain = _complete(engine, prompt, native_mtp="off", max_tokens=60)
    engine.replay = ReplayDrafter({tuple(prompt): plain.token_ids}, acceptance, engine.vocab_size, seed=3)
    budget = 1 + 3 * 4 + 2 if acceptance == 1.0 else 30
    run = engine.start(GenerationRequest(prompt, max_tokens=budget, mtp_k=3))
    batch = BatchDecoder(engine)
    tokens = []
    for chunk in run.begin():
        tokens.extend(chunk.token_ids)
    batch.add(run)
    chained_steps = 0
    while len(batch):
        for _, chunks in batch.step():
            for chunk in chunks:
                tokens.extend(chunk.token_ids)
        if len(batch):
            batch.check_invariants()
            chained_steps += isinstance(batch.ahead, ahead_module.ChainedRound)
            if isinstance(batch.ahead, ahead_module.ChainedRound):  # bounds: the rows written, not every row ever
                filled = len(prompt) + len(run.output.tokens) - 1
                assert all(c.offset == filled + 3 + 1 for c in batch.caches.cache if not hasattr(c, "recording"))
                assert run.head.cache.offset <= filled + 2 * 3
    assert tokens == plain.token_ids[:budget]
    assert chained_steps >= 2 and counted["confirmed"] >= 2, counted
    assert batch.ahead is None and run.ahead is None
    if acceptance == 1.0:
        recorder = run.stats.recorder
        assert recorder.accepted_total == recorder.drafted > 0  # every draft kept
