"""A speculative round built while the round before computes (``engine/ahead.py``): greedy output stays plain
decoding's token for token whether the round built ahead runs (every draft kept), is rejected (a draft refused,
the request ended inside the round) or abandoned (another depth, a second request joining), and the state it put
back is the state the loop without it leaves (the invariants between steps, the rounds it ran)."""

from __future__ import annotations

import mlx.core as mx
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
    """How many rounds were built ahead, ran as built, were rejected, were abandoned."""
    counts = {"built": 0, "ran": 0, "rejected": 0, "abandoned": 0}
    count_calls(monkeypatch, batch_step, "build_ahead", counts, "built")
    for kind in (ahead_module.RoundAhead, ahead_module.ChainedRound):  # (chained rounds: test_chain.py)
        count_calls(monkeypatch, kind, "reject", counts, "rejected")
        count_calls(monkeypatch, kind, "abandon", counts, "abandoned")
    round_ = batch_step.speculative_round

    def ran(*args, **kwargs):
        if (args[9] if len(args) > 9 else kwargs.get("built")) is not None:
            counts["ran"] += 1
        return round_(*args, **kwargs)

    monkeypatch.setattr(batch_step, "speculative_round", ran)
    import exo.engine.batch as batch_module

    monkeypatch.setattr(batch_module, "speculative_round", ran)
    return counts


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("depth", [1, 2, 3, None], ids=["k1", "k2", "k3", "adaptive"])
def test_rounds_built_ahead_give_plain_decodings_tokens(checkpoint, arch, depth, counted):
    """The trained demo head keeps some drafts and refuses others: rounds built ahead run where every draft was
    kept and are rejected elsewhere; greedy MTP with them equals plain decoding and MTP without them, token for
    token, at prompt lengths across prefill chunks and budgets that end inside rounds."""
    assert_plain_tokens(_loaded(checkpoint(arch, dtype="float32")), "on", depth, CHUNK)
    if depth is not None:
        assert counted["built"] > 0 and counted["ran"] > 0 and counted["rejected"] > 0, counted


def test_every_draft_kept_runs_every_round_built_ahead(checkpoint, counted):
    """A replayed continuation at acceptance 1 keeps every draft: after the first round each one runs as built
    ahead, none is rejected; the budget ends inside a round (rejected then: the request ended), and the
    invariants hold between steps with a round built ahead in the caches."""
    loaded = _loaded(checkpoint("qwen3_5", dtype="float32"))
    engine = Engine(loaded, EngineConfig(prefill_chunk=CHUNK, round_ahead="on"))
    prompt = _prompt(loaded, 11)
    plain = _complete(engine, prompt, native_mtp="off", max_tokens=60)
    engine.replay = ReplayDrafter({tuple(prompt): plain.token_ids}, 1.0, engine.vocab_size)
    budget = 1 + 3 * 4 + 2  # the first token, 3 rounds of K = 3 kept whole, 2 of a 4th
    run = engine.start(GenerationRequest(prompt, max_tokens=budget, mtp_k=3))
    batch = BatchDecoder(engine)
    tokens = []
    for chunk in run.begin():
        tokens.extend(chunk.token_ids)
    batch.add(run)
    while len(batch):
        for _, chunks in batch.step():
            for chunk in chunks:
                tokens.extend(chunk.token_ids)
        if len(batch):
            batch.check_invariants()
            assert batch.ahead is not None and run.ahead is batch.ahead
    assert tokens == plain.token_ids[:budget]
    # (no round is built where the budget would end inside the round before it)
    assert counted["ran"] == counted["built"] >= 2 and counted["rejected"] == 0, counted
    assert batch.ahead is None and run.ahead is None


@pytest.mark.parametrize("mode", ["on", "chain"])
def test_a_stop_string_inside_a_round_kept_whole_rejects_the_round_built_ahead(checkpoint, counted, mode):
    """Every draft kept, but the request ends inside the round (a stop string): the round built ahead (or the
    chained round after it, launched) is rejected, the commit keeps the reply up to the stop, as without it."""
    loaded = _loaded(checkpoint("qwen3_5", dtype="float32"))
    on = Engine(loaded, EngineConfig(prefill_chunk=CHUNK, round_ahead=mode))
    off = Engine(loaded, EngineConfig(prefill_chunk=CHUNK, round_ahead="off"))
    prompt = _prompt(loaded, 11)
    plain = _complete(off, prompt, native_mtp="off", max_tokens=60)
    for engine in (on, off):
        engine.replay = ReplayDrafter({tuple(prompt): plain.token_ids}, 1.0, engine.vocab_size)
    stop = loaded.tokenizer.decode(plain.token_ids[9:11])  # inside the third round of K = 3 (tokens 9-12)
    assert stop and stop in loaded.tokenizer.decode(plain.token_ids)
    with_ahead = _complete(on, prompt, mtp_k=3, max_tokens=60, stop=[stop])
    without = _complete(off, prompt, mtp_k=3, max_tokens=60, stop=[stop])
    stopped = _complete(off, prompt, native_mtp="off", max_tokens=60, stop=[stop])
    assert with_ahead.finish_reason == without.finish_reason == stopped.finish_reason == "stop"
    assert with_ahead.token_ids == without.token_ids == stopped.token_ids
    assert with_ahead.text == stopped.text
    assert counted["rejected"] >= 1, counted


@pytest.mark.parametrize(("mode", "acceptance"), [("on", 1.0), ("chain", 0.7)])
def test_a_round_built_ahead_is_abandoned_when_the_depth_changes_or_a_request_joins(checkpoint, counted, mode,
                                                                                    acceptance):
    """Between rounds the loop may not run the round built ahead (or chained: launched, whatever the round before
    kept): the policy chose another depth, or a second request joined the batch (its rows are batched, the round
    was built for one). It is abandoned, the state after the last round comes back (as the loop commits it), and
    every output is its solo one."""
    loaded = _loaded(checkpoint("qwen3_5", dtype="float32"))
    engine = Engine(loaded, EngineConfig(prefill_chunk=CHUNK, round_ahead=mode))
    first, second = _prompt(loaded, 9), _prompt(loaded, 14)
    solo = {tuple(p): _complete(engine, p, native_mtp="off", max_tokens=30).token_ids for p in (first, second)}
    engine.replay = ReplayDrafter(solo, acceptance, engine.vocab_size)
    # another depth: the policy's fixed depth changed under the round built ahead
    run = engine.start(GenerationRequest(first, max_tokens=30, mtp_k=2))
    batch = BatchDecoder(engine)
    tokens = [t for chunk in run.begin() for t in chunk.token_ids]
    batch.add(run)
    steps = 0
    while len(batch):
        for _, chunks in batch.step():
            tokens.extend(t for chunk in chunks for t in chunk.token_ids)
        steps += 1
        if steps == 2 and len(batch):
            assert batch.ahead is not None
            run.policy.fixed_k = 1
    assert tokens == solo[tuple(first)]
    assert counted["abandoned"] >= 1, counted
    # a second request joins while a round is built ahead for the first
    abandoned = counted["abandoned"]
    one = engine.start(GenerationRequest(first, max_tokens=30, mtp_k=2))
    two = engine.start(GenerationRequest(second, max_tokens=30, mtp_k=2))
    batch = BatchDecoder(engine)
    out = {id(one): [t for chunk in one.begin() for t in chunk.token_ids]}
    batch.add(one)
    for _ in range(2):
        for run, chunks in batch.step():
            out[id(run)].extend(t for chunk in chunks for t in chunk.token_ids)
    assert batch.ahead is not None
    out[id(two)] = [t for chunk in two.begin() for t in chunk.token_ids]
    batch.add(two)
    assert batch.ahead is None and counted["abandoned"] == abandoned + 1
    batch.check_invariants()
    while len(batch):
        for run, chunks in batch.step():
            out[id(run)].extend(t for chunk in chunks for t in chunk.token_ids)
    assert out[id(one)] == solo[tuple(first)] and out[id(two)] == solo[tuple(second)]


def test_a_snapshot_keeps_arrays_assigned_into_in_place():
    """mlx-lm's KVCache writes its keys in place (``keys[..., a:b, :] = new``), which changes every handle of
    that array object: a snapshot holds new handles, so what it restores is what was there."""
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    keys = mx.ones((1, 1, 4, 2))
    cache.update_and_fetch(keys, keys)
    snapshot = ahead_module.Snapshot([cache])
    before = mx.array(cache.keys)
    cache.update_and_fetch(2 * keys[:, :, :1], 2 * keys[:, :, :1])
    assert cache.offset == 5
    snapshot.restore()
    assert cache.offset == 4 and mx.array_equal(cache.keys[..., :4, :], before[..., :4, :]).item()
    snapshot.restore()  # usable twice
    assert cache.offset == 4


def test_no_round_is_built_ahead_by_default(checkpoint, counted):
    """Off by default: slower where measured (a 2-core CPU, an H200 at 9B: host-bound both)."""
    loaded = _loaded(checkpoint("qwen3_5", dtype="float32"))
    engine = Engine(loaded, EngineConfig(prefill_chunk=CHUNK))
    assert engine.config.round_ahead == "off"
    result = _complete(engine, _prompt(loaded, 9), mtp_k=2)
    assert result.stats.rounds > 0 and counted["built"] == 0
