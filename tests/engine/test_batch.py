"""Batched plain decoding (engine/batch.py) on genuine tiny checkpoints: each sequence of a batch gets
exactly its solo output (greedy, seeded sampling, penalties, stops), whatever else runs, joins or leaves."""

from __future__ import annotations

import dataclasses

import pytest
from mlx_lm.models.cache import BatchKVCache

from exo.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, load_checkpoint
from exo.engine.batch import BatchDecoder, BatchLanes, default_lanes
from exo.engine.models import layers
from tests.fixtures.engines import fresh_engine

CHUNK = 8  # small prefill chunks: prompts cross chunk boundaries
TEXTS = (
    "def fibonacci(n):\n    if n < 2:",
    "The quick brown fox",
    "import numpy as np\nx = np.",
    "Once upon a time, in a land far away, there lived",
    "1, 2, 3,",
)


def _engine(path, eos: bool = False) -> Engine:
    return fresh_engine(path, eos, prefill_chunk=CHUNK)  # (eos False: every generation runs its whole budget)


def _request(engine: Engine, i: int, **fields) -> GenerationRequest:
    prompt = engine.loaded.tokenizer.encode(TEXTS[i % len(TEXTS)])
    return GenerationRequest(prompt, max_tokens=fields.pop("max_tokens", 16), **fields)


def _solo(engine: Engine, request: GenerationRequest):
    return engine.complete(dataclasses.replace(request, native_mtp="off"))


def _run_batch(engine: Engine, requests, join_at=None, cancel=None, lanes=None, check=False):
    """Decode ``requests`` in one batch: request i joins before step ``join_at[i]``; ``cancel``: {i: step}
    ends request i from that step on. Returns per request (token ids, text, finish reason, stats).
    ``lanes``: a ``BatchLanes`` of that many lanes, as the device queue decodes a batch; ``check``: the
    batch's invariants checked after every step."""
    join_at = join_at or [0] * len(requests)
    cancel = cancel or {}
    batch = BatchDecoder(engine) if lanes is None else BatchLanes(engine, lanes)
    out = {i: ([], [], None, None) for i in range(len(requests))}
    index: dict[int, int] = {}
    clock = [0]  # the current step (read by the cancellation polls)
    pending = set(range(len(requests)))

    def take(i, chunk):
        tokens, text, _, _ = out[i]
        tokens.extend(chunk.token_ids)
        text.append(chunk.text)
        if chunk.finish_reason is not None:
            out[i] = (tokens, text, chunk.finish_reason, chunk.stats)

    while pending or len(batch):
        for i in sorted(pending):
            if join_at[i] <= clock[0]:
                pending.discard(i)
                request = requests[i]
                if i in cancel:
                    at = cancel[i]
                    request = dataclasses.replace(request, should_stop=lambda at=at: clock[0] >= at)
                run = engine.start(request)
                for chunk in run.begin():
                    if chunk is not None:
                        take(i, chunk)
                index[id(run)] = i
                if run.output.finish is not None:
                    take(i, run.final_chunk())
                else:
                    batch.add(run)
        for run, chunks in batch.step():
            for chunk in chunks:
                take(index[id(run)], chunk)
        if check and len(batch):
            batch.check_invariants()
        clock[0] += 1
    return {i: (tokens, "".join(text), finish, stats) for i, (tokens, text, finish, stats) in out.items()}


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_6_moe", "qwen3_next"])
def test_batched_greedy_equals_solo_with_joins_and_leaves(checkpoint, arch):
    engine = _engine(checkpoint(arch, dtype="float32"))
    # Distinct prompts of different lengths (some cross prefill chunks), different budgets: sequences
    # join mid-batch (left padding of the attention caches differs) and leave at different steps.
    # Plain decoding: one token per member per step, so who is in the batch at each step does not depend on
    # how many drafts a fixture's head lands (native MTP inside a batch: tests/engine/test_batch_mtp.py).
    requests = [_request(engine, i, max_tokens=m, native_mtp="off") for i, m in enumerate((20, 7, 16, 12, 3))]
    got = _run_batch(engine, requests, join_at=[0, 0, 3, 5, 9])
    for i, request in enumerate(requests):
        solo = _solo(engine, request)
        tokens, text, finish, stats = got[i]
        assert tokens == solo.token_ids, f"request {i}"
        assert text == solo.text and finish == solo.finish_reason == "length"
        assert stats.completion_tokens == len(tokens)
    # The stats say it ran in a batch (native MTP inside a batch: tests/engine/test_batch_mtp.py).
    stats = got[0][3]
    assert stats.batch_sizes and max(stats.batch_sizes) == 4
    assert sum(stats.batch_sizes.values()) == 19  # every token after the first came from a batch step


def test_bfloat16_batched_greedy_equals_solo(checkpoint):
    engine = _engine(checkpoint("qwen3_5", dtype="bfloat16"))
    requests = [_request(engine, i, max_tokens=24) for i in range(4)]
    got = _run_batch(engine, requests, join_at=[0, 1, 2, 2])
    for i, request in enumerate(requests):
        assert got[i][0] == _solo(engine, request).token_ids, f"request {i}"


@pytest.mark.parametrize("compiled", ["cuda", "always"], ids=["gdn-ops", "gdn-compiled"])
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_batch_invariant_steps_equal_solo_with_joins_plain_and_drafting(checkpoint, arch, compiled, monkeypatch):
    """EngineConfig.batch_invariant (EXO_BATCH_INVARIANT=1, for devices whose batched kernels round by batch
    shape): one-row linear products, per-sequence attention over unpadded keys, unsorted experts.
    Members that join at different steps (different left padding), plainly and drafting at K = 2, each get
    their solo output token for token, and the layers are back to their ordinary path after each step.
    ``gdn-compiled``: solo GatedDeltaNet rows through the compiled graph (as on CUDA), batched ones not."""
    monkeypatch.setattr(layers, "COMPILED_ROWS", compiled)
    loaded = dataclasses.replace(load_checkpoint(checkpoint(arch, dtype="bfloat16")), eos_token_ids=frozenset())
    engine = Engine(loaded, EngineConfig(prefill_chunk=CHUNK, batch_invariant=True))
    requests = [_request(engine, i, max_tokens=14, **({"mtp_k": 2} if i % 2 else {"native_mtp": "off"}))
                for i in range(4)]
    got = _run_batch(engine, requests, join_at=[0, 0, 2, 5])
    for i, request in enumerate(requests):
        assert got[i][0] == _solo(engine, request).token_ids, f"request {i}"
    linears, attention, blocks = engine.model.__dict__["_batch_invariant_parts"]  # the mode ran
    assert linears and attention and (blocks or arch == "qwen3_5")
    assert not any(linear.batch_vectors for linear in linears) and not any(a.per_sequence for a in attention)
    assert got[1][3].rounds > 0  # the drafting members ran speculative rounds in the batch


def test_seeded_sampling_and_penalties_per_sequence(checkpoint):
    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    samplings = [
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=5.0),
        SamplingParams(temperature=1.2, top_p=0.9, seed=2, repetition_penalty=1.3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=20, seed=1),  # the same seed as the first: its own stream
    ]
    # Batched plain steps (with MTP, a seed reproduces the solo MTP samples at the same depths instead:
    # test_batch_mtp.py).
    requests = [_request(engine, i, max_tokens=24, sampling=s, native_mtp="off") for i, s in enumerate(samplings)]
    got = _run_batch(engine, requests, join_at=[0, 0, 1, 2, 4])
    for i, request in enumerate(requests):
        assert got[i][0] == _solo(engine, request).token_ids, f"request {i}"
    # The penalties acted: the penalised greedy sequence is not the plain greedy one.
    plain = _solo(engine, _request(engine, 1, max_tokens=24))
    assert got[1][0] != plain.token_ids


def test_stops_and_eos_inside_a_batch(checkpoint):
    engine = _engine(checkpoint("qwen3_5", dtype="float32"), eos=True)
    free = _engine(checkpoint("qwen3_5", dtype="float32"))
    full = _solo(free, _request(free, 0, max_tokens=24)).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    requests = [
        _request(engine, 0, max_tokens=24, stop=[stop]),
        _request(engine, 1, max_tokens=40),  # the model's own EOS, if it ends before the budget
        _request(engine, 2, max_tokens=1),  # done at its first token: never joins
    ]
    got = _run_batch(engine, requests)
    for i, request in enumerate(requests):
        solo = _solo(engine, request)
        assert (got[i][0], got[i][1], got[i][2]) == (solo.token_ids, solo.text, solo.finish_reason), f"request {i}"
    assert got[0][2] == "stop" and stop not in got[0][1]


def test_cancelling_one_sequence_leaves_the_others_running(checkpoint):
    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    requests = [_request(engine, i, max_tokens=20) for i in range(3)]
    got = _run_batch(engine, requests, cancel={1: 5})
    assert got[1][2] == "cancelled"
    assert 0 < len(got[1][0]) < 20
    assert got[1][0] == _solo(engine, requests[1]).token_ids[: len(got[1][0])]
    for i in (0, 2):
        assert got[i][0] == _solo(engine, requests[i]).token_ids and got[i][2] == "length"


@pytest.mark.parametrize("compiled", ["cuda", "always"], ids=["gdn-ops", "gdn-compiled"])
def test_a_lone_member_s_own_caches_become_a_batch_row_when_a_second_joins(checkpoint, compiled, monkeypatch):
    """A batch of one steps on its member's own caches (no batch conversion: a solo request's speed); a second
    member makes them the batch's first row mid-generation, and both stay exact."""
    monkeypatch.setattr(layers, "COMPILED_ROWS", compiled)  # the caches a compiled solo step leaves, batched on
    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    first = _request(engine, 0, max_tokens=30)
    run = engine.start(first)
    streamed = [t for chunk in run.begin() for t in chunk.token_ids]
    batch = BatchDecoder(engine)
    batch.add(run)
    for _ in range(5):
        for _, chunks in batch.step():
            streamed += [t for chunk in chunks for t in chunk.token_ids]
        batch.check_invariants()
    assert run.cache and not any(isinstance(c, BatchKVCache) for c in run.cache), "a lone member keeps its caches"
    assert run.output.finish is None and 1 <= len(streamed) < 30
    other = engine.start(_request(engine, 3, max_tokens=10))
    other_tokens = [t for chunk in other.begin() if chunk is not None for t in chunk.token_ids]
    batch.add(other)
    assert not run.cache  # the batch's first row now
    finals = {}
    while len(batch):
        for r, chunks in batch.step():
            for chunk in chunks:
                (streamed if r is run else other_tokens).extend(chunk.token_ids)
                if chunk.finish_reason:
                    finals[id(r)] = chunk
        batch.check_invariants()
    assert streamed == _solo(engine, first).token_ids
    assert other_tokens == _solo(engine, _request(engine, 3, max_tokens=10)).token_ids
    assert finals[id(run)].stats.completion_tokens == 30


def test_runs_that_cannot_batch_are_refused(checkpoint):
    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    unstarted = engine.start(_request(engine, 0))
    with pytest.raises(ValueError, match="started, unfinished"):
        BatchDecoder(engine).add(unstarted)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("lanes", [2, 3])
def test_lanes_decode_every_sequence_as_solo(checkpoint, arch, lanes):
    """BatchLanes (a batch's plain steps split over streams of their own, evaluated at once: on MLX's CPU
    backend, a core each): greedy, seeded and penalised members joining at different steps, one cancelled;
    each gets its solo output token for token, and its stats count the size of the whole batch, not of its
    lane."""
    engine = _engine(checkpoint(arch, dtype="float32"))
    samplings = [SamplingParams(), SamplingParams(temperature=0.9, seed=1), SamplingParams(presence_penalty=2.0),
                 SamplingParams(), SamplingParams(temperature=1.1, top_p=0.9, seed=2)]
    requests = [_request(engine, i, max_tokens=m, sampling=s, native_mtp="off")
                for i, (m, s) in enumerate(zip((18, 9, 14, 12, 1), samplings, strict=True))]
    got = _run_batch(engine, requests, join_at=[0, 0, 1, 4, 6], cancel={3: 9}, lanes=lanes)
    for i, request in enumerate(requests):
        solo = _solo(engine, request).token_ids
        tokens, _, finish, _ = got[i]
        if i == 3:
            assert finish == "cancelled" and 0 < len(tokens) < 12 and tokens == solo[: len(tokens)]
        else:
            assert tokens == solo and finish == "length", f"request {i}"
    assert max(got[0][3].batch_sizes) == 4  # four ran together, over lanes of two or fewer each


def test_lanes_spread_runs_over_streams_of_their_own(checkpoint):
    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    batch = BatchLanes(engine, 2)
    assert len(batch.lanes) == 2 and batch.lanes[0].stream is None and batch.lanes[1].stream is not None
    for i in range(5):
        run = engine.start(_request(engine, i, max_tokens=4, native_mtp="off"))
        list(run.begin())
        batch.add(run)
    assert [len(lane) for lane in batch.lanes] == [3, 2] and len(batch) == 5
    while len(batch):
        batch.step()
    assert [lane.stream for lane in BatchLanes(engine, 1).lanes] == [None]  # one lane: the default stream


def test_default_lanes_is_one_and_the_setting_chooses_more(checkpoint, monkeypatch):
    import os

    path = checkpoint("qwen3_5", dtype="float32")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert default_lanes(Engine(load_checkpoint(path), EngineConfig())) == 1
    assert default_lanes(Engine(load_checkpoint(path), EngineConfig(batch_lanes=3))) == 3
    assert len(BatchLanes(Engine(load_checkpoint(path), EngineConfig(batch_lanes=2))).lanes) == 2


def test_a_solo_request_decodes_as_a_batch_of_one_on_its_own_caches(checkpoint, monkeypatch):
    """``Engine.generate`` is a batch of one: the batch's plain step and round run it, on the request's own
    caches (never converted to a batch's: ``forward.join`` is not called), one plain step per token after the
    first and none computed past the last."""
    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    calls = {"plain": 0, "round": 0, "join": 0}

    def counted(name, original):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(BatchDecoder, "_plain_step", counted("plain", BatchDecoder._plain_step))
    monkeypatch.setattr(BatchDecoder, "_round", counted("round", BatchDecoder._round))
    monkeypatch.setattr(engine.forward, "join", counted("join", engine.forward.join))
    plain = engine.complete(_request(engine, 0, max_tokens=12, native_mtp="off"))
    assert len(plain.token_ids) == 12 and calls == {"plain": 11, "round": 0, "join": 0}
    drafted = engine.complete(_request(engine, 0, max_tokens=12, mtp_k=2))
    assert drafted.token_ids == plain.token_ids
    assert calls["round"] == drafted.stats.rounds > 0 and calls["join"] == 0
    assert plain.stats.batch_sizes == {} and drafted.stats.batch_sizes == {}
