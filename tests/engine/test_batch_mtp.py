"""Native MTP inside a batch (engine/batch.py) on genuine tiny checkpoints: every member drafts with its own
head, one verify call serves the batch, and each member accepts, rolls back and emits on its own. Greedy
members get exactly their solo plain-decoding tokens whatever K, whatever else runs, joins or leaves;
seeded sampling reproduces the solo MTP samples."""

from __future__ import annotations

import dataclasses

import pytest

from exo.engine import Engine, EngineConfig, SamplingParams
from exo.engine import forward as forward_module
from exo.engine import round as round_module
from exo.engine.adaptive import DepthCosts
from exo.engine.replay import ReplayDrafter

from .test_batch import CHUNK, _engine, _request, _run_batch, _solo


@pytest.fixture
def rounds(monkeypatch):
    """Records what every batched round kept per member (rows of the verify call) and, per emission, how
    many tokens a member's verdict decided and how many its output took (fewer: it ended inside them)."""
    kept: list[list[int]] = []
    emitted: list[tuple[int, int]] = []
    keep_rows = forward_module.keep_rows_per_sequence
    emit = round_module.emit

    def spy_keep(cache, rows, counts):
        kept.append(list(counts))
        keep_rows(cache, rows, counts)

    def spy_emit(run, decision, tokens):
        added = emit(run, decision, tokens)
        emitted.append((len(tokens), added))
        return added

    monkeypatch.setattr(forward_module, "keep_rows_per_sequence", spy_keep)
    monkeypatch.setattr(round_module, "emit", spy_emit)
    return kept, emitted


def _check_solo(engine: Engine, requests, got, finish: str | None = "length") -> None:
    for i, request in enumerate(requests):
        solo = _solo(engine, request)
        tokens, text, reason, stats = got[i]
        assert tokens == solo.token_ids, f"request {i}"
        assert text == solo.text and reason == solo.finish_reason, f"request {i}"
        if finish is not None:
            assert reason == finish
        assert stats.completion_tokens == len(tokens)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_6_moe", "qwen3_next"])
def test_batched_greedy_mtp_equals_solo_plain_with_joins_and_leaves(checkpoint, arch, rounds):
    engine = _engine(checkpoint(arch, dtype="float32"))
    kept, _ = rounds
    # Distinct prompts of different lengths, different budgets: members join mid-batch and leave at
    # different rounds, each accepting its own counts.
    requests = [_request(engine, i, max_tokens=m, mtp_k=2) for i, m in enumerate((20, 9, 16, 13, 4))]
    got = _run_batch(engine, requests, join_at=[0, 0, 2, 3, 5])
    _check_solo(engine, requests, got)
    for i, (tokens, _, _, stats) in got.items():
        assert stats.enabled and stats.reason is None, f"request {i}"
        assert stats.rounds > 0 and stats.drafted_tokens == 2 * stats.rounds
        # All but the first came from the batch; those decoded once the others left are no batch's.
        assert 0 < sum(stats.batch_sizes.values()) <= len(tokens) - 1 and 1 not in stats.batch_sizes
    assert max(got[0][3].batch_sizes) == 4
    # Members accepted different counts in one round, so attention rows were padded per member.
    assert any(len(set(counts)) > 1 for counts in kept)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_6_moe", "qwen3_next"])
@pytest.mark.parametrize("depth", [1, 3])
def test_batched_greedy_mtp_at_every_forced_depth(checkpoint, arch, depth, rounds):
    engine = _engine(checkpoint(arch, dtype="float32"))
    kept, _ = rounds
    requests = [_request(engine, i, max_tokens=m, mtp_k=depth) for i, m in enumerate((18, 11, 15))]
    got = _run_batch(engine, requests, join_at=[0, 1, 1])
    _check_solo(engine, requests, got)
    assert all(stats.rounds > 0 and stats.k == depth for _, _, _, stats in got.values())
    # Some member's drafts all landed in a batched round (it kept every row), and none kept more. Which
    # rounds mix counts depends on where the fixture's head misses, which moves with the CPU's rounding
    # (the qwen3_5_moe fixture at K = 1 missed no draft in a batch on an AMD EPYC): the joins-and-leaves test
    # above checks mixed counts at K = 2, over five members.
    assert any(max(counts) == depth + 1 for counts in kept)
    assert all(max(counts) <= depth + 1 for counts in kept)


def test_adaptive_depth_in_a_batch_switches_between_plain_steps_and_rounds(checkpoint):
    """With a warm-up that says drafting pays (as on a GPU), the batch times a plain step, drafts on the
    estimate, measures its rounds and decides by them: members cross between batched plain steps and
    rounds (emitting what the last plain step computed first), and stay exact throughout."""
    engine = Engine(_engine(checkpoint("qwen3_5", dtype="float32")).loaded, EngineConfig(prefill_chunk=CHUNK))
    # Rows cost nothing next to this solo step: batched rounds are estimated cheap until timed.
    engine._costs = DepthCosts(beta=(1.2, 1.3, 1.4), delta=(0.01, 0.02, 0.03), device="test", plain_s=1.0)
    requests = [_request(engine, i, max_tokens=40) for i in range(3)]
    got = _run_batch(engine, requests)
    _check_solo(engine, requests, got)
    for _, _, _, stats in got.values():
        assert stats.rounds > 0 and stats.k_histogram.get(0, 0) > 0  # both kinds of steps
        assert stats.reason is None
    bucket = engine.batch_policy().bucket(3)
    assert bucket.estimator.plain_s() is not None and bucket.rounds_run > 0


def test_members_with_different_depths_share_a_round(checkpoint):
    """Forced depths 1 and 3, MTP off and a forced K = 0 in one batch: each drafts its own count (the
    others' rows are filler), and the ones without drafts decode their row plainly."""
    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    requests = [
        _request(engine, 0, max_tokens=16, mtp_k=1),
        _request(engine, 1, max_tokens=16, mtp_k=3),
        _request(engine, 2, max_tokens=16, native_mtp="off"),
        _request(engine, 3, max_tokens=16, mtp_k=0),
    ]
    got = _run_batch(engine, requests, join_at=[0, 0, 0, 4])
    _check_solo(engine, requests, got)
    stats = [s for _, _, _, s in got.values()]
    assert stats[0].rounds and stats[0].k_histogram.keys() == {1}
    assert stats[1].rounds and stats[1].k_histogram.keys() == {3}
    assert stats[2].rounds == 0 and not stats[2].enabled and stats[2].k_histogram == {0: 15}
    assert stats[3].rounds == 0 and "forced to 0" in stats[3].reason


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_6_moe", "qwen3_next"])
def test_bfloat16_batched_greedy_mtp_equals_solo_plain(checkpoint, arch):
    engine = _engine(checkpoint(arch, dtype="bfloat16"))
    requests = [_request(engine, i, max_tokens=20, mtp_k=2) for i in range(4)]
    got = _run_batch(engine, requests, join_at=[0, 1, 2, 2])
    _check_solo(engine, requests, got)


def test_eos_stops_and_max_tokens_inside_accepted_runs(checkpoint, rounds):
    engine = _engine(checkpoint("qwen3_5", dtype="float32"), eos=True)
    free = _engine(checkpoint("qwen3_5", dtype="float32"))
    _, emitted = rounds
    full = _solo(free, _request(free, 0, max_tokens=24)).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    requests = [
        _request(engine, 0, max_tokens=24, stop=[stop], mtp_k=3),
        _request(engine, 1, max_tokens=40, mtp_k=3),  # the model's own EOS, if it ends before the budget
        _request(engine, 3, max_tokens=7, mtp_k=3),
        _request(engine, 4, max_tokens=10, mtp_k=3),
    ]
    # Every round accepts its 3 drafts (each prompt's plain reply replayed, engine/replay.py), so the budgets
    # of 7 (1 + 4 + 2) and 10 (1 + 4 + 4 + 1) end inside accepted runs on any CPU.
    engine.replay = ReplayDrafter({tuple(r.prompt_tokens): _solo(free, dataclasses.replace(r, max_tokens=40)).token_ids
                                   for r in requests}, 1.0, engine.vocab_size)
    got = _run_batch(engine, requests, check=True)
    _check_solo(engine, requests, got, finish=None)
    assert got[0][2] == "stop" and stop not in got[0][1]
    # Members ended inside tokens their verdict had decided (the rest were dropped exactly, the caches with them).
    assert sum(added < decided for decided, added in emitted) >= 2


def test_cancelling_one_member_leaves_the_others_drafting(checkpoint):
    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    requests = [_request(engine, i, max_tokens=20, mtp_k=2) for i in range(3)]
    got = _run_batch(engine, requests, cancel={1: 3})
    assert got[1][2] == "cancelled"
    assert 0 < len(got[1][0]) < 20
    assert got[1][0] == _solo(engine, requests[1]).token_ids[: len(got[1][0])]
    for i in (0, 2):
        assert got[i][0] == _solo(engine, requests[i]).token_ids and got[i][2] == "length"


def test_a_lone_mtp_member_keeps_its_head_state_when_a_second_joins(checkpoint):
    """A member that drafted alone (a batch of one, on its own caches) becomes a batch's row at a round
    boundary with its head cache and waiting rows, and goes on drafting there."""
    from exo.engine.batch import BatchDecoder

    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    first = _request(engine, 0, max_tokens=30, mtp_k=2)
    run = engine.start(first)
    streamed = [t for chunk in run.begin() for t in chunk.token_ids]
    batch = BatchDecoder(engine)
    batch.add(run)
    for _ in range(3):
        for _, chunks in batch.step():
            streamed += [t for chunk in chunks for t in chunk.token_ids]
    assert run.stats.recorder.rounds == 3 and run.cache and run.output.finish is None
    solo_rounds = run.stats.recorder.rounds
    other = engine.start(_request(engine, 3, max_tokens=10, mtp_k=2))
    other_tokens = [t for chunk in other.begin() if chunk is not None for t in chunk.token_ids]
    batch.add(other)
    finals = {}
    while len(batch):
        for r, chunks in batch.step():
            for chunk in chunks:
                (streamed if r is run else other_tokens).extend(chunk.token_ids)
                if chunk.finish_reason:
                    finals[id(r)] = chunk.stats
    assert streamed == _solo(engine, first).token_ids
    assert other_tokens == _solo(engine, _request(engine, 3, max_tokens=10)).token_ids
    stats = finals[id(run)]
    assert stats.rounds > solo_rounds and stats.acceptance_rate > 0.3  # the head kept its context


def test_seeded_sampling_and_penalties_with_mtp_in_a_batch(checkpoint):
    """Each member's verdict uses its own parameters, penalties and PRNG key stream: a seeded sampling
    member reproduces its solo MTP samples exactly (the same verify rows, the same key use), a penalised
    greedy member its solo plain tokens."""
    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    samplings = [
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=1.2, top_p=0.9, seed=2, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, top_k=20, seed=1),  # the same seed as the first: its own stream
    ]
    requests = [_request(engine, i, max_tokens=20, sampling=s, mtp_k=2) for i, s in enumerate(samplings)]
    got = _run_batch(engine, requests, join_at=[0, 0, 1, 2])
    for i, request in enumerate(requests):
        solo_mtp = engine.complete(request)
        assert got[i][0] == solo_mtp.token_ids, f"request {i}"
        assert got[i][3].rounds == solo_mtp.stats.rounds and got[i][3].accepted_tokens == solo_mtp.stats.accepted_tokens
    assert got[1][0] == _solo(engine, requests[1]).token_ids
    again = _run_batch(engine, requests, join_at=[0, 1, 0, 3])
    assert [again[i][0] for i in range(4)] == [got[i][0] for i in range(4)]


def test_stats_say_why_a_batch_decoded_plainly(checkpoint):
    path = checkpoint("qwen3_5", dtype="float32")
    loaded = _engine(path).loaded
    # A device where a verify call costs too much (no depth could pay even with the warm-up's costs doubted,
    # ``WARM_COST_DOUBT``): batches never draft either.
    slow = Engine(loaded, EngineConfig(prefill_chunk=CHUNK))
    slow._costs = DepthCosts(beta=(3.0, 5.0), delta=(0.2, 0.4), device="test", plain_s=0.01)
    # Drafting can pay off, but a batch first times its plain step: two steps are not enough to draft.
    fast = Engine(loaded, EngineConfig(prefill_chunk=CHUNK))
    fast._costs = DepthCosts(beta=(1.2, 1.3), delta=(0.01, 0.02), device="test", plain_s=1.0)
    for engine, reason in ((slow, "costs too much"), (fast, "for the batch sizes")):
        requests = [_request(engine, i, max_tokens=3) for i in range(2)]
        got = _run_batch(engine, requests)
        _check_solo(engine, requests, got)
        for _, _, _, stats in got.values():
            assert stats.enabled and stats.rounds == 0 and reason in stats.reason
            assert stats.batch_sizes == {2: 2}


def test_per_sequence_rollback_leaves_each_sequence_as_its_solo_rollback(checkpoint):
    """After one verify call of a batch whose sequences keep different counts of rows, each sequence's
    attention keys and values, RoPE offset and GatedDeltaNet state are those of the same call alone,
    rolled back alone; the rejected rows became left padding and the padding all share was cut."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from exo.engine.batch_cache import batch_cache, keep_rows_per_sequence

    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    forward = engine.forward
    prompts = [mx.array([[5 + i for i in range(n)]], dtype=mx.uint32) for n in (6, 9, 3)]
    rows = mx.array([[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]], dtype=mx.uint32)
    kept = [4, 1, 3]  # the longest prompt keeps fewest: every sequence ends up padded, then the lead is cut
    solos, batch = [], None
    for b, prompt in enumerate(prompts):
        solo, joining = forward.new_cache(), forward.new_cache()
        for cache in (solo, joining):
            forward.hidden(prompt, cache)
        forward.hidden(rows[b : b + 1], solo, verify=True)
        forward.rollback(solo, 4, kept[b])
        solos.append(solo)
        if batch is None:
            batch = [batch_cache(c) for c in joining]
        else:
            for mine, theirs in zip(batch, joining, strict=True):
                mine.extend(batch_cache(theirs))
    forward.hidden(rows, batch, verify=True)
    keep_rows_per_sequence(batch, 4, kept)
    lengths = [p.shape[1] + k for p, k in zip(prompts, kept, strict=True)]
    for layer, c in enumerate(batch):
        if isinstance(c, BatchKVCache):
            padding = c.left_padding.tolist()
            assert min(padding) == 0 and c._idx == max(lengths), layer  # no padding every sequence has
            assert c.offset.tolist() == lengths
            for b, solo in enumerate(solos):
                assert padding[b] == c._idx - lengths[b]
                assert mx.array_equal(c.keys[b : b + 1, :, padding[b] : c._idx], solo[layer].keys[..., : lengths[b], :])
                assert mx.array_equal(c.values[b : b + 1, :, padding[b] : c._idx], solo[layer].values[..., : lengths[b], :])
        else:
            for b, solo in enumerate(solos):
                assert mx.array_equal(c[0][b : b + 1], solo[layer][0]) and mx.array_equal(c[1][b : b + 1], solo[layer][1])


def test_heads_are_not_fed_while_a_batch_decodes_plainly(checkpoint):
    """Where the batch's depth is 0 (here: every row costs a whole step, as on a compute-bound device), an
    adaptive member's head gets nothing (a head row costs about a backbone layer): only its last few rows
    wait, for a probe round to draft from."""
    from exo.engine.batch import BatchDecoder
    from exo.engine.depth import BATCH_HEAD_WINDOW

    engine = Engine(_engine(checkpoint("qwen3_5", dtype="float32")).loaded, EngineConfig(prefill_chunk=CHUNK))
    # Drafting pays alone, but next to a solo step this short any batched step is all rows.
    engine._costs = DepthCosts(beta=(1.2, 1.3), delta=(0.05, 0.1), device="test", plain_s=1e-9)
    requests = [_request(engine, i, max_tokens=14) for i in range(3)]
    batch = BatchDecoder(engine)
    runs, heads = [], {}
    for request in requests:
        run = engine.start(request)
        list(run.begin())
        batch.add(run)
        runs.append(run)
        heads[id(run)] = run.head.cache.offset
    assert all(run.head.tracked for run in runs)
    tokens = {id(run): list(run.output.tokens) for run in runs}
    while len(batch):
        for run, chunks in batch.step():
            tokens[id(run)].extend(t for chunk in chunks for t in chunk.token_ids)
        for run in batch.runs:
            assert len(run.head._hidden) <= BATCH_HEAD_WINDOW and run.head.cache.offset == heads[id(run)]
    for run, request in zip(runs, requests, strict=True):
        assert run.stats.recorder.rounds == 0
        assert tokens[id(run)] == _solo(engine, request).token_ids


def test_every_member_s_invariants_hold_between_batched_steps_and_rounds(checkpoint):
    """``BatchDecoder.check_invariants`` after every step of a batch mixing plain members, forced depths,
    seeded sampling and penalties: each member's row of the batch's caches holds every position before its
    pending token, its head covers them, its history follows its output."""
    from exo.engine.batch import BatchDecoder

    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    requests = [
        _request(engine, 0, max_tokens=18, mtp_k=2),
        _request(engine, 1, max_tokens=12, native_mtp="off"),
        _request(engine, 2, max_tokens=15, mtp_k=1, sampling=SamplingParams(temperature=0.8, seed=5)),
        _request(engine, 3, max_tokens=16, mtp_k=3, sampling=SamplingParams(presence_penalty=1.0)),
    ]
    batch = BatchDecoder(engine)
    steps = 0
    for request in requests:
        run = engine.start(request)
        list(run.begin())
        run.check_invariants()
        batch.add(run)
        batch.check_invariants()
    while len(batch):
        batch.step()
        batch.check_invariants()
        steps += 1
    assert steps >= 5


def test_a_batch_shrunk_to_one_decodes_as_a_solo_request(checkpoint):
    """Once its partner leaves, the last member is a batch of one: the solo policy chooses its depth, its plain
    stretches are timed for that policy and keep the solo head window (HEAD_WINDOW rows, not the batch's
    BATCH_HEAD_WINDOW), and its tokens from then on are no batch's. Its output stays plain decoding's."""
    from exo.engine.batch import BatchDecoder
    from exo.engine.depth import BATCH_HEAD_WINDOW, HEAD_WINDOW

    engine = Engine(_engine(checkpoint("qwen3_5", dtype="float32")).loaded,
                    EngineConfig(prefill_chunk=CHUNK, warm_acceptance=False))
    engine._costs = DepthCosts(beta=(1.45, 2.6, 3.7), delta=(0.01, 0.02, 0.03), device="test", plain_s=1.0)
    policy = engine._adaptive_policy()
    for i in range(80):  # 40% of first drafts land: the solo policy sits at plain decoding, probing now and then
        policy.observe_round(1, int(i % 5 < 2))
    policy.since_probe, policy.probe_every = 0, 2 * HEAD_WINDOW
    short, long = _request(engine, 0, max_tokens=4), _request(engine, 1, max_tokens=60)
    batch = BatchDecoder(engine)
    runs = []
    for request in (short, long):
        run = engine.start(request)
        list(run.begin())
        batch.add(run)
        runs.append(run)
    member = runs[1]
    tokens, together, alone, final = list(member.output.tokens), [], [], None
    timed = policy.estimator.timings(0)
    while len(batch):
        size = len(batch)
        for run, chunks in batch.step():
            if run is member:
                tokens.extend(t for chunk in chunks for t in chunk.token_ids)
                final = next((chunk for chunk in chunks if chunk.finish_reason), final)
        (together if size > 1 else alone).append(len(member.head._hidden))
    assert together and alone and max(together) <= BATCH_HEAD_WINDOW
    assert BATCH_HEAD_WINDOW < max(alone) <= HEAD_WINDOW + 1
    assert policy.estimator.timings(0) > timed  # its plain stretches alone timed for the solo policy
    assert final is not None and set(final.stats.batch_sizes) == {2}
    assert sum(final.stats.batch_sizes.values()) <= len(together) < len(tokens) - 1
    assert tokens == _solo(engine, long).token_ids
