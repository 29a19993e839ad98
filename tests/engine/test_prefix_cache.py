"""The prefix cache (engine/prefix_cache.py) on genuine tiny checkpoints: a request whose prompt starts like
an earlier one's restores that prefix and prefills only the rest, and its reply (tokens, logprobs, native
MTP's drafts and acceptances) equals a cold engine's at temperature 0, for hybrid dense, MoE and
Qwen3-Next models, alone and joining a batch."""

from __future__ import annotations

import dataclasses
import json
import logging

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from exo.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from exo.engine import prefix_cache as pc
from exo.engine.ahead import ChainedRound
from exo.engine.batch import BatchDecoder
from exo.engine.constraints import ConstraintSpec
from exo.engine.replay import ReplayDrafter
from exo.metrics import Metrics
from tests.fixtures.engines import fresh_engine

from .rounds import count_calls
from .test_batch import _run_batch

BLOCK = 16
CHUNK = 24  # prefill chunks that do not line up with the blocks
ARCHS = ["qwen3_5", "qwen3_5_moe", "qwen3_6_moe", "qwen3_next"]
SYSTEM = "You are a coding agent. Tools: read(path), write(path, text), run(cmd). " * 3


def _engine(path, cached: bool, budget: int = 1 << 30, stride: int = 0, round_ahead: str = "off") -> Engine:
    engine = fresh_engine(path, eos=False, prefill_chunk=CHUNK, round_ahead=round_ahead)  # every reply runs its whole budget
    loaded = engine.loaded
    if cached:
        engine.prefix_cache = pc.PrefixCache(
            pc.MemoryStore(budget), pc.namespace(loaded), block_tokens=BLOCK, stride_tokens=stride,
            message_starts=pc.message_starts(loaded.tokenizer), min_snapshot_tokens=8,
        )
    return engine


def _prompt(engine: Engine, turns: list[tuple[str, str]], system: str = SYSTEM) -> list[int]:
    messages = [{"role": "system", "content": system}]
    for role, text in turns:
        messages.append({"role": role, "content": text})
    return list(engine.loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


TURN1 = [("user", "List the files in src and read main.py")]
TURN2 = TURN1 + [("assistant", "I will call read(main.py)."), ("user", "Tool result: def main(): return 42\n" * 4)]
OTHER = [("user", "Write a test for the parser module, please")]


def _complete(engine: Engine, prompt: list[int], **fields):
    request = GenerationRequest(prompt, max_tokens=fields.pop("max_tokens", 12),
                                sampling=SamplingParams(temperature=0.0), **fields)
    return engine.complete(request)


def _same(hit, cold) -> None:
    assert hit.token_ids == cold.token_ids
    assert hit.text == cold.text
    for name in ("rounds", "drafted_tokens", "accepted_tokens", "k_histogram", "per_position_acceptance"):
        assert getattr(hit.stats, name) == getattr(cold.stats, name), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mtp", [dict(native_mtp="off"), dict(mtp_k=1), dict(mtp_k=2), dict(mtp_k=3)])
def test_next_turn_and_new_conversation_equal_cold(checkpoint, arch, mtp):
    path = checkpoint(arch, dtype="float32")
    warm, cold = _engine(path, cached=True), _engine(path, cached=False)
    p1, p2, p3 = _prompt(warm, TURN1), _prompt(warm, TURN2), _prompt(warm, OTHER)
    first = _complete(warm, p1, **mtp)
    assert first.stats.cached_tokens == 0
    _same(first, _complete(cold, p1, **mtp))
    # The next turn resends turn 1's prompt: restored at its generation header (the last message start).
    second = _complete(warm, p2, **mtp)
    starts = [i for i, t in enumerate(p1) if t in warm.prefix_cache.starts]
    assert p2[: len(p1)] == p1
    assert second.stats.cached_tokens == starts[-1]
    _same(second, _complete(cold, p2, **mtp))
    # The same prompt again: restored up to its own header.
    again = _complete(warm, p2, **mtp)
    assert again.stats.cached_tokens == max(i for i, t in enumerate(p2) if t in warm.prefix_cache.starts)
    _same(again, second)
    # A raw prompt (no chat) again: restored up to its last token.
    raw = [t for t in p2 if t not in warm.prefix_cache.starts]
    _complete(warm, raw, **mtp)
    whole = _complete(warm, raw, **mtp)
    assert whole.stats.cached_tokens == len(raw) - 1
    _same(whole, _complete(cold, raw, **mtp))
    # A new conversation with the same system prompt: restored at the end of the system part.
    other = _complete(warm, p3, **mtp)
    assert other.stats.cached_tokens == starts[1]
    _same(other, _complete(cold, p3, **mtp))


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_adaptive_depth_after_a_hit_equals_cold(checkpoint, arch):
    path = checkpoint(arch, dtype="float32")
    warm, cold = _engine(path, cached=True), _engine(path, cached=False)
    p1, p2 = _prompt(warm, TURN1), _prompt(warm, TURN2)
    _complete(warm, p1, max_tokens=20)
    hit = _complete(warm, p2, max_tokens=20)
    assert hit.stats.cached_tokens > 0
    assert hit.token_ids == _complete(cold, p2, max_tokens=20).token_ids


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_restored_caches_equal_a_cold_prefill(checkpoint, arch):
    """Restore + the rest prefilled leaves every layer's cache (attention KV, conv window, recurrent state)
    and the head's cache exactly as a cold prefill of the whole prompt, and the next logits equal."""
    path = checkpoint(arch, dtype="float32")
    warm, cold = _engine(path, cached=True, stride=BLOCK * 2), _engine(path, cached=False)
    p1, p2 = _prompt(warm, TURN1), _prompt(warm, TURN2)
    _complete(warm, p1, mtp_k=1)

    def prefilled(engine):
        run = engine.start(GenerationRequest(p2, max_tokens=4, mtp_k=1))
        for _ in run.prefill():  # the prompt's one entry; the first token is chosen, not yet emitted
            pass
        token = run.pending_token
        run.head.flush()
        return run, token

    hit, hit_token = prefilled(warm)
    ref, ref_token = prefilled(cold)
    assert hit.prefilled > BLOCK
    assert hit_token.item() == ref_token.item()
    for a, b in [*zip(hit.cache, ref.cache, strict=True), (hit.head.cache, ref.head.cache)]:
        xs, ys = _arrays(a), _arrays(b)
        assert len(xs) == len(ys) > 0
        for x, y in zip(xs, ys, strict=True):
            assert x.shape == y.shape and mx.array_equal(x, y).item()


def _arrays(cache) -> list[mx.array]:
    if isinstance(cache, KVCache):
        assert cache.offset > 0
        return list(cache.keys_and_values())
    return [cache[0], cache[1]]


def test_stride_snapshots_serve_a_prompt_that_diverges_mid_message(checkpoint):
    path = checkpoint("qwen3_5", dtype="float32")
    warm, cold = _engine(path, cached=True, stride=BLOCK * 2), _engine(path, cached=False)
    long_text = "alpha beta gamma delta epsilon " * 12
    p1 = _prompt(warm, [("user", long_text + "first ending")])
    p2 = _prompt(warm, [("user", long_text + "a different ending")])
    _complete(warm, p1, mtp_k=2)
    hit = _complete(warm, p2, mtp_k=2)
    diverge = next(i for i, (a, b) in enumerate(zip(p1, p2, strict=False)) if a != b)
    assert hit.stats.cached_tokens == (diverge // (BLOCK * 2)) * (BLOCK * 2)
    assert hit.stats.cached_tokens > len(_prompt(warm, []))  # past the system part
    _same(hit, _complete(cold, p2, mtp_k=2))


def test_logprobs_and_penalties_after_a_hit_equal_cold(checkpoint):
    path = checkpoint("qwen3_5_moe", dtype="float32")
    warm, cold = _engine(path, cached=True), _engine(path, cached=False)
    p1, p2 = _prompt(warm, TURN1), _prompt(warm, TURN2)
    _complete(warm, p1)
    fields = dict(logprobs=3, native_mtp="off")
    sampling = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    hit = warm.complete(GenerationRequest(p2, max_tokens=10, sampling=sampling, **fields))
    ref = cold.complete(GenerationRequest(p2, max_tokens=10, sampling=sampling, **fields))
    assert hit.stats.cached_tokens > 0
    assert hit.token_ids == ref.token_ids
    assert hit.logprobs == ref.logprobs


@pytest.mark.parametrize("mtp", [dict(native_mtp="off"), dict(mtp_k=2)])
def test_a_constrained_request_after_a_hit_equals_cold(checkpoint, mtp):
    path = checkpoint("qwen3_next", dtype="float32")
    warm, cold = _engine(path, cached=True), _engine(path, cached=False)
    p1, p2 = _prompt(warm, TURN1), _prompt(warm, TURN2)
    _complete(warm, p1)
    spec = ConstraintSpec(json_schema={"type": "object", "properties": {"path": {"type": "string", "maxLength": 8}},
                                       "required": ["path"]})
    outputs = []
    for engine in (warm, cold):
        grammar = engine.grammar(spec, "json")
        outputs.append(engine.complete(GenerationRequest(p2, max_tokens=24, sampling=SamplingParams(temperature=0.0),
                                                         constraint=grammar, logprobs=2, **mtp)))
    hit, ref = outputs
    assert hit.stats.cached_tokens > 0 and ref.stats.cached_tokens == 0
    assert hit.token_ids == ref.token_ids and hit.logprobs == ref.logprobs
    assert "path" in json.JSONDecoder().raw_decode(hit.text)[0]  # (no EOS in these fixtures: text may follow)
    _same(hit, ref)


def test_seeded_sampling_after_a_hit_equals_cold(checkpoint):
    path = checkpoint("qwen3_5", dtype="float32")
    warm, cold = _engine(path, cached=True), _engine(path, cached=False)
    p1, p2 = _prompt(warm, TURN1), _prompt(warm, TURN2)
    _complete(warm, p1)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    hit = warm.complete(GenerationRequest(p2, max_tokens=16, sampling=sampling, mtp_k=2))
    ref = cold.complete(GenerationRequest(p2, max_tokens=16, sampling=sampling, mtp_k=2))
    assert hit.stats.cached_tokens > 0
    assert hit.token_ids == ref.token_ids


@pytest.mark.parametrize("mtp_k", [0, 2])
def test_a_hit_joining_a_batch_equals_solo_cold(checkpoint, mtp_k):
    path = checkpoint("qwen3_5", dtype="float32")
    warm, cold = _engine(path, cached=True), _engine(path, cached=False)
    p1, p2, p3 = _prompt(warm, TURN1), _prompt(warm, TURN2), _prompt(warm, OTHER)
    _complete(warm, p1)
    batch = BatchDecoder(warm)
    tokens: dict[int, list[int]] = {}
    runs = {}
    for i, prompt in enumerate((p2, p3)):
        run = warm.start(GenerationRequest(prompt, max_tokens=12, sampling=SamplingParams(temperature=0.0),
                                           mtp_k=mtp_k))
        tokens[i] = [t for chunk in run.begin() if chunk is not None for t in chunk.token_ids]
        runs[id(run)] = i
        assert run.prefilled > 0
        batch.add(run)
    stats = {}
    while len(batch):
        for run, chunks in batch.step():
            for chunk in chunks:
                tokens[runs[id(run)]].extend(chunk.token_ids)
                if chunk.stats is not None:
                    stats[runs[id(run)]] = chunk.stats
    for i, prompt in enumerate((p2, p3)):
        assert tokens[i] == _complete(cold, prompt, mtp_k=mtp_k).token_ids
        assert stats[i].cached_tokens > 0


def test_a_budget_too_small_evicts_and_stays_exact(checkpoint):
    path = checkpoint("qwen3_5", dtype="float32")
    warm, cold = _engine(path, cached=True, budget=20_000), _engine(path, cached=False)
    store = warm.prefix_cache.store
    p1, p2 = _prompt(warm, TURN1), _prompt(warm, TURN2)
    _complete(warm, p1, mtp_k=1)
    assert 0 < store.bytes <= 20_000 and store.evictions > 0
    hit = _complete(warm, p2, mtp_k=1)
    _same(hit, _complete(cold, p2, mtp_k=1))


def test_keys_depend_on_every_token_and_the_namespace():
    tokens = list(range(40))
    a = pc.block_chain(tokens, 8, "model-a")
    assert len(a) == 6 and len(set(a)) == 6
    b = pc.block_chain(tokens[:20] + [99] + tokens[21:], 8, "model-a")
    assert a[:3] == b[:3] and all(x != y for x, y in zip(a[3:], b[3:], strict=True))
    assert pc.block_chain(tokens, 8, "model-b")[1] != a[1]
    assert pc.snapshot_key(13, a, tokens, 8) != pc.snapshot_key(13, a, tokens[:12] + [7] + tokens[13:], 8)


def test_a_pipeline_plan_settles_on_what_the_stages_hold():
    # (tests/engine/test_prefix_cache_pipeline.py runs it through a pipeline)
    cache = pc.PrefixCache(pc.MemoryStore(1 << 20), "ns", block_tokens=4)
    tokens = list(range(20))
    assert isinstance(pc.plan_for(cache, tokens, False, stages=2), pc.NoPlan)  # a forward that cannot ask
    assert isinstance(pc.plan_for(cache, tokens, False, stages=1), pc.PrefillPlan)
    assert isinstance(pc.plan_for(None, tokens, False, stages=1), pc.NoPlan)
    chain = pc.block_chain(tokens, 4, "ns")
    for p in (6, 9, 13):
        for b in range(1, p // 4 + 1):
            cache.store.put(cache.key(f"b-{chain[b].hex()}"), {"x": mx.zeros((1,))})
        cache.store.put(cache.key(pc.snapshot_key(p, chain, tokens, 4)), {"x": mx.zeros((1,))})
        cache._lengths.add(p)
    asked = []
    plan = pc.plan_for(cache, tokens, False, stages=2, lookup=lambda held: asked.append(held) or [6, 9])
    assert asked == [[13, 9, 6]] and plan.found is not None and plan.found[0] == 9
    assert pc.plan_for(cache, tokens, False, stages=2, lookup=lambda held: []).found is None


def test_snapshot_edges():
    starts = frozenset({1})
    tokens = [1, 5, 5, 5, 1, 6, 6, 1, 7] + [8] * 30
    assert pc.snapshot_edges(tokens, starts, 16, 2) == [4, 7, 16, 32, 38]  # 32 tokens after the last start
    assert pc.snapshot_edges(tokens[:12], starts, 0, 2) == [4, 7]  # a generation header: no end snapshot
    assert pc.snapshot_edges(tokens, frozenset(), 0, 2) == [38]
    plan = pc.PrefillPlan(None, tokens, [], None, [4, 7, 16, 32, 38], False)  # type: ignore[arg-type]
    # Edges do not cut the prefill's chunks: the chunk keeps its GatedDeltaNet states at the edges inside it.
    assert list(plan.spans(0, 39, 10)) == [(0, 10), (10, 20), (20, 30), (30, 39)]
    assert [plan.inside(a, b) for a, b in plan.spans(0, 39, 10)] == [[4, 7], [16], [], [32, 38]]
    assert list(plan.spans(7, 39, 100)) == [(7, 39)] and plan.inside(7, 39) == [16, 32, 38]
    assert pc.NoPlan().inside(0, 39) == [] and list(pc.NoPlan().spans(0, 39, 10))[-1] == (30, 39)


def test_a_summary_lets_a_router_find_the_held_prefix(checkpoint):
    # What a runner reports (PrefixCache.summary) and what the cluster's router computes from a prompt
    # (held_prefix) agree with what a lookup then restores.
    path = checkpoint("qwen3_5", dtype="float32")
    warm = _engine(path, cached=True)
    p1, p2, p3 = _prompt(warm, TURN1), _prompt(warm, TURN2), _prompt(warm, OTHER, system="Another system. " * 6)
    assert pc.held_prefix(p2, warm.prefix_cache.summary()) == 0
    _complete(warm, p1, native_mtp="off")
    summary = warm.prefix_cache.summary()
    assert summary.namespace == warm.prefix_cache.ns and summary.block_tokens == BLOCK and summary.heads
    held = pc.held_prefix(p2, summary)
    assert held > 0 and _complete(warm, p2, native_mtp="off").stats.cached_tokens == held
    assert pc.held_prefix(p3, summary) == 0  # another system prompt: nothing held
    assert pc.held_prefix(p2, pc.Summary("other-model", BLOCK, summary.heads)) == 0  # another namespace
    # Entries evicted since are left out of the summary.
    for key in warm.prefix_cache.store.keys():
        warm.prefix_cache.store.remove(key)
    assert warm.prefix_cache.summary().heads == ()


def test_the_summary_is_bounded_and_lists_the_keys_served(monkeypatch):
    monkeypatch.setattr(pc, "SUMMARY_HEADS", 3)
    monkeypatch.setattr(pc, "SUMMARY_KEYS", 2)
    cache = pc.PrefixCache(pc.MemoryStore(1 << 20), "ns", block_tokens=4)
    for p in range(5, 10):
        name = f"s-{p}-{p:032x}"
        cache.store.put(cache.key(name), {"x": mx.zeros((1,))})
        cache._note(name, p)
    assert [p for p, _ in cache.summary().heads] == [7, 8, 9]
    for key in ("a", "b", "c", None, ""):
        cache.note_key(key)
    assert cache.summary().keys == (pc.key_hash("b"), pc.key_hash("c"))


def _entry(n: int) -> dict[str, mx.array]:
    return {"x": mx.zeros((n,), dtype=mx.uint8)}


def test_memory_store_evicts_a_prompt_cache_key_group_together():
    store = pc.MemoryStore(100)
    for key in ("a1", "a2", "a3"):
        store.put(key, _entry(20), group="A")
    store.put("b1", _entry(20), group="B")
    store.get("a1", group="A")  # A was used after B: B goes first, whole
    store.put("c1", _entry(30), group="C")
    assert sorted(store.keys()) == ["a1", "a2", "a3", "c1"] and store.bytes == 90 and store.evictions == 1
    store.put("c2", _entry(30), group="C")  # A is the least recent group now: all of it goes
    assert sorted(store.keys()) == ["c1", "c2"] and store.evictions == 4
    # A group larger than the budget loses its oldest entries only.
    for i in range(3):
        store.put(f"c{i + 3}", _entry(30), group="C")
    assert store.keys() == ["c3", "c4", "c5"] and store.bytes == 90
    # Without groups: plain LRU, entry by entry.
    plain = pc.MemoryStore(60)
    for key in ("x", "y", "z"):
        plain.put(key, _entry(20))
    plain.get("x")
    plain.put("w", _entry(20))
    assert sorted(plain.keys()) == ["w", "x", "z"]
    # An entry used under another group moves to it.
    plain.get("z", group="G")
    plain.put("v", _entry(20))
    assert sorted(plain.keys()) == ["v", "w", "z"]


def test_a_requests_prompt_cache_key_groups_its_entries(checkpoint):
    path = checkpoint("qwen3_5", dtype="float32")
    warm, cold = _engine(path, cached=True), _engine(path, cached=False)
    p1, p2 = _prompt(warm, TURN1), _prompt(warm, TURN2)
    _complete(warm, p1, prompt_cache_key="session-1", native_mtp="off")
    store = warm.prefix_cache.store
    assert len(store.keys()) == len(store) > 0
    assert {store.group_of(key) for key in store.keys()} == {f"{pc.key_hash('session-1'):016x}"}
    assert warm.prefix_cache.summary().keys == (pc.key_hash("session-1"),)
    hit = _complete(warm, p2, prompt_cache_key="session-2", native_mtp="off")  # restored entries move to its key
    assert hit.stats.cached_tokens > 0
    _same(hit, _complete(cold, p2, native_mtp="off"))
    assert f"{pc.key_hash('session-2'):016x}" in {store.group_of(key) for key in store.keys()}


def test_only_a_run_that_feeds_the_head_stores_the_last_hidden(checkpoint):
    # A snapshot holds no hidden: a run without the head never computes a chunk's last hidden (the last layer's
    # output of a chunk before the prompt's last is never evaluated), and evaluating it for the snapshot cost
    # seconds a turn on this CPU. The head's tail (sh-) holds it: a run feeding the head computed it anyway.
    path = checkpoint("qwen3_5", dtype="float32")
    warm, cold = _engine(path, cached=True), _engine(path, cached=False)
    p1, p2 = _prompt(warm, TURN1), _prompt(warm, TURN2)
    _complete(warm, p1, native_mtp="off")
    store = warm.prefix_cache.store
    entries = {k.split("/", 1)[1].split("-", 1)[0]: store.get(k) for k in store.keys()}
    assert "s" in entries and "sh" not in entries and all("hidden" not in e for e in entries.values())
    _complete(warm, p1, mtp_k=2)  # the head's parts, with the hidden
    tails = [store.get(k) for k in store.keys() if k.split("/", 1)[1].startswith("sh-")]
    assert tails and all(t["hidden"].shape[:2] == (1, 1) for t in tails)
    hit = _complete(warm, p2, mtp_k=2)
    assert hit.stats.cached_tokens > 0
    _same(hit, _complete(cold, p2, mtp_k=2))


# -- the reply: a sequence that ended keeps its generated part ---------------------------------------------
REPLY_TOKENS = 40  # more than two blocks of BLOCK
TOOL = [("user", "Tool result: def main(): return 42\n" * 3)]


def _next_turn(engine: Engine, reply_text: str) -> list[int]:
    """Turn 2 as an agent sends it: turn 1's messages, the reply rendered by the template, a tool result."""
    return _prompt(engine, TURN1 + [("assistant", reply_text)] + TOOL)


def _output_lengths(engine: Engine, prompt: list[int]) -> list[int]:
    """Snapshot positions held past ``prompt`` (a reply's end)."""
    return sorted(p for p in engine.prefix_cache._lengths if p > len(prompt))


@pytest.mark.parametrize("mtp", [dict(native_mtp="off"), dict(mtp_k=2)])
def test_the_next_turn_restores_through_the_reply(checkpoint, mtp):
    path = checkpoint("qwen3_5", dtype="float32")
    warm, cold = _engine(path, cached=True), _engine(path, cached=False)
    p1 = _prompt(warm, TURN1)
    first = _complete(warm, p1, max_tokens=REPLY_TOKENS, **mtp)
    assert first.finish_reason == "length"
    p2 = _next_turn(warm, first.text)
    assert p2[: len(p1) + REPLY_TOKENS] == p1 + first.token_ids  # (this template renders the reply as generated)
    second = _complete(warm, p2, max_tokens=20, **mtp)
    # Restored through the reply: every position its caches held (the last token is never fed, except where
    # a speculative round fed it before its run was cut at max_tokens).
    assert second.stats.cached_tokens in (len(p1) + REPLY_TOKENS - 1, len(p1) + REPLY_TOKENS)
    _same(second, _complete(cold, p2, max_tokens=20, **mtp))


@pytest.mark.parametrize("mtp_k", [0, 2])
def test_a_reply_decoded_in_a_batch_is_stored_from_its_row(checkpoint, mtp_k):
    path = checkpoint("qwen3_5", dtype="float32")
    warm, cold = _engine(path, cached=True), _engine(path, cached=False)
    p1, p3 = _prompt(warm, TURN1), _prompt(warm, OTHER)
    # Different prompt lengths and budgets: the rows are padded differently and leave at different steps.
    requests = [GenerationRequest(prompt, max_tokens=budget, sampling=SamplingParams(temperature=0.0), mtp_k=mtp_k)
                for prompt, budget in ((p3, REPLY_TOKENS - 13), (p1, REPLY_TOKENS))]
    tokens = {i: out[0] for i, out in _run_batch(warm, requests, check=True).items()}
    assert len(_output_lengths(warm, p3)) >= 1 and len(tokens[1]) == REPLY_TOKENS
    text = warm.loaded.tokenizer.decode(tokens[1])
    p2 = _next_turn(warm, text)
    hit = _complete(warm, p2, max_tokens=20, mtp_k=mtp_k)
    assert hit.stats.cached_tokens > len(p1)
    assert hit.token_ids == _complete(cold, p2, max_tokens=20, mtp_k=mtp_k).token_ids


def _replaying(engine: Engine, prompts: list[list[int]], tokens: int) -> Engine:
    """``engine`` drafting each prompt's plain greedy reply at acceptance 1.0 (engine/replay.py): every round
    of depth K accepts its K drafts and emits K + 1 tokens, whatever the CPU's arithmetic."""
    plain = Engine(engine.loaded, EngineConfig(prefill_chunk=CHUNK))
    continuations = {tuple(p): _complete(plain, p, max_tokens=tokens, native_mtp="off").token_ids for p in prompts}
    engine.replay = ReplayDrafter(continuations, 1.0, engine.vocab_size)
    return engine


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("batched", [False, True, "chained"], ids=["solo", "batch", "chained"])
def test_a_reply_ending_inside_an_accepted_run_is_kept(checkpoint, k, batched, monkeypatch):
    """A budget that ends the reply j tokens into a fully accepted run (j = 1..K): the caches roll back to the
    finish and the reply is stored, alone, as a batch's member and alone in chained rounds (the last one
    committed as any round: ``EXO_NATIVE_MTP_ROUND_AHEAD=chain``); the next turn restores through it and equals a
    cold run."""
    path = checkpoint("qwen3_5", dtype="float32")
    rounds = 2 * BLOCK // (k + 1) + 1  # the reply covers more than two blocks
    chained = batched == "chained"
    batched = batched is True
    confirmed = {"chained": 0}
    count_calls(monkeypatch, ChainedRound, "confirm", confirmed, "chained")
    for j in range(1, k + 1):
        warm = _engine(path, cached=True, round_ahead="chain" if chained else "off")
        cold = _engine(path, cached=False)
        p1, p3 = _prompt(warm, TURN1), _prompt(warm, OTHER)
        budget = 1 + (k + 1) * rounds + j  # the first token, whole rounds, then j of the next run's K + 1
        _replaying(warm, [p1, p3], budget + 20)
        request = GenerationRequest(p1, max_tokens=budget, sampling=SamplingParams(temperature=0.0), mtp_k=k)
        if batched:  # beside a member that outlives it (its row leaves the batch's caches at the finish)
            other = dataclasses.replace(request, prompt_tokens=p3, max_tokens=budget + 8)
            first_tokens, _, finish, stats = _run_batch(warm, [request, other], check=True)[0]
        else:
            result = _complete(warm, p1, max_tokens=budget, mtp_k=k)
            first_tokens, finish, stats = result.token_ids, result.finish_reason, result.stats
        assert finish == "length" and len(first_tokens) == budget
        # The finish fell inside an accepted run: every round accepted all K, the last one past the budget.
        assert stats.rounds == rounds + 1 and stats.accepted_tokens == k * (rounds + 1), (stats.rounds, stats.accepted_tokens)
        stored = _output_lengths(warm, p1)  # (a batch: the other member's entries too)
        assert len(p1) + budget - 1 in stored and (batched or stored == [len(p1) + budget - 1])  # its last token never fed
        p2 = _next_turn(warm, warm.loaded.tokenizer.decode(first_tokens))
        assert p2[: len(p1) + budget] == p1 + first_tokens
        _replaying(warm, [p1, p3, p2], 24)
        _replaying(cold, [p2], 24)
        second = _complete(warm, p2, max_tokens=12, mtp_k=k)
        assert second.stats.cached_tokens == len(p1) + budget - 1
        _same(second, _complete(cold, p2, max_tokens=12, mtp_k=k))
    assert (confirmed["chained"] > 0) == chained, confirmed


def test_a_reply_stopped_by_eos_inside_an_accepted_run_is_kept(checkpoint):
    """The same with the end an EOS token: the first token of a reply (past a block) that is new there is made
    the EOS, at a depth K that puts it inside an accepted run rather than last in one."""
    path = checkpoint("qwen3_5", dtype="float32")
    base = _engine(path, cached=False)
    prompts = [_prompt(base, turns) for turns in (TURN1, OTHER, TURN2)]
    _replaying(base, prompts, 64)

    def ends_inside(at: int, k: int) -> bool:  # output position ``at`` is a round's draft, not its last token
        return (at - 1) % (k + 1) < k

    found = [(p, at, k) for p in prompts for at, token in enumerate(base.replay.continuations[tuple(p)])
             if at > BLOCK and token not in base.replay.continuations[tuple(p)][:at]
             for k in (1, 2, 3) if ends_inside(at, k)]
    assert found, "no reply of the fixture has a new token past a block"
    p1, at, k = found[0]
    reply = base.replay.continuations[tuple(p1)]
    warm = Engine(dataclasses.replace(base.loaded, eos_token_ids=frozenset({reply[at]})), EngineConfig(prefill_chunk=CHUNK))
    warm.prefix_cache = _engine(path, cached=True).prefix_cache
    warm.replay = base.replay
    first = _complete(warm, p1, max_tokens=64, mtp_k=k)
    assert first.finish_reason == "stop" and first.token_ids == reply[: at + 1]
    assert first.stats.accepted_tokens == k * first.stats.rounds  # every run accepted whole: the EOS cut the last
    assert _output_lengths(warm, p1) == [len(p1) + at]  # the reply to its EOS, the EOS never fed


def test_a_cancelled_or_abandoned_run_stores_nothing_of_its_reply(checkpoint):
    path = checkpoint("qwen3_5", dtype="float32")
    warm = _engine(path, cached=True)
    p1 = _prompt(warm, TURN1)
    sampling = SamplingParams(temperature=0.0)
    # Cancelled after more than a block of its reply, alone (by what the consumer has seen, not by a count of
    # polls: the first adaptive request's warm-up polls it too, as often as this machine's timings make it).
    seen = [0]
    chunks = []
    for chunk in warm.generate(GenerationRequest(p1, max_tokens=REPLY_TOKENS, sampling=sampling,
                                                 should_stop=lambda: seen[0] > BLOCK + 1)):
        chunks.append(chunk)
        seen[0] += len(chunk.token_ids)
    assert chunks[-1].finish_reason == "cancelled" and seen[0] > BLOCK + 1
    # Abandoned by its consumer (a client gone) after 30 tokens, alone.
    stream = warm.generate(GenerationRequest(p1, max_tokens=REPLY_TOKENS, sampling=sampling))
    got = 0
    for chunk in stream:
        got += len(chunk.token_ids)
        if got > 30:
            break
    stream.close()
    # In a batch: one member cancelled, one whose consumer failed (taken out), one failed batch (dropped).
    for leave in ("cancel", "remove", "drop"):
        batch = BatchDecoder(warm)
        flag = [False]
        run = warm.start(GenerationRequest(p1, max_tokens=REPLY_TOKENS, sampling=sampling,
                                           native_mtp="off", should_stop=lambda flag=flag: flag[0]))
        list(run.begin())
        batch.add(run)
        steps = 0
        while len(batch) and steps < 20:  # (a token a step)
            batch.step()
            steps += 1
        if leave == "cancel":
            flag[0] = True
            batch.step()
            assert run.output.finish == "cancelled"
        elif leave == "remove":
            batch.remove(run)
        else:
            batch.drop()
        assert not len(batch)
    assert _output_lengths(warm, p1) == []
    # The same run let to finish stores its reply (so the above would have).
    list(warm.generate(GenerationRequest(p1, max_tokens=REPLY_TOKENS, sampling=sampling, native_mtp="off")))
    assert _output_lengths(warm, p1) == [len(p1) + REPLY_TOKENS - 1]


def test_a_reply_shorter_than_a_block_is_not_stored(checkpoint):
    path = checkpoint("qwen3_5", dtype="float32")
    warm = _engine(path, cached=True)
    p1 = _prompt(warm, TURN1)
    _complete(warm, p1, max_tokens=BLOCK)  # the caches hold BLOCK - 1 of its tokens
    assert _output_lengths(warm, p1) == []
    _complete(warm, p1, max_tokens=BLOCK + 1)
    assert _output_lengths(warm, p1) == [len(p1) + BLOCK]


def test_a_drafting_turn_restores_a_reply_stored_without_the_heads_parts(checkpoint):
    """A reply whose run did not feed the head every row (MTP off here; an adaptive run's plain stretches) is
    stored without the head's parts; a drafting next turn that holds the head's parts of the prompt before it
    still restores through the reply (its head then has a gap) rather than prefilling it again, and its output
    is the cold one."""
    path = checkpoint("qwen3_5", dtype="float32")
    warm, cold = _engine(path, cached=True), _engine(path, cached=False)
    p1 = _prompt(warm, TURN1)
    _complete(warm, p1, max_tokens=2, mtp_k=2)  # the prompt, with the head's parts
    first = _complete(warm, p1, max_tokens=REPLY_TOKENS, native_mtp="off")
    assert not any(k.split("/", 1)[1].startswith(f"sh-{len(p1) + REPLY_TOKENS - 1}-") for k in warm.prefix_cache.store.keys())
    p2 = _next_turn(warm, first.text)
    second = _complete(warm, p2, max_tokens=20, mtp_k=2)
    assert second.stats.cached_tokens == len(p1) + REPLY_TOKENS - 1
    assert second.token_ids == _complete(cold, p2, max_tokens=20, mtp_k=2).token_ids


# -- a store that raises: a miss or a skipped store, never a failed request ---------------------------------
class FailingStore(pc.MemoryStore):
    """The RAM tier, raising where a test says: ``put_error`` from a put of the entries ``failing`` names (the
    tier out of memory, a disk full), ``get_error`` from every read, ``has_error`` from every lookup of a key (a
    disk tier failing); ``garble``: a read snapshot lacks its last recurrent state (an entry that does not fit
    what restores it)."""

    put_error: BaseException | None = None
    get_error: BaseException | None = None
    has_error: BaseException | None = None
    garble = False

    @staticmethod
    def failing(name: str) -> bool:
        return True

    def put(self, key, arrays, group=None):
        if self.put_error is not None and self.failing(key.split("/", 1)[1]):
            raise self.put_error
        return super().put(key, arrays, group)

    def has(self, key):
        if self.has_error is not None:
            raise self.has_error
        return super().has(key)

    def get(self, key, group=None):
        if self.get_error is not None:
            raise self.get_error
        arrays = super().get(key, group)
        if self.garble and arrays is not None and key.split("/", 1)[1].startswith("s-"):
            last = max((k for k in arrays if k.startswith("r")), key=lambda k: int(k[1:]))
            arrays = {k: v for k, v in arrays.items() if k != last}
        return arrays


def test_a_store_that_raises_is_a_miss_never_a_failed_request(checkpoint, caplog):
    path = checkpoint("qwen3_5", dtype="float32")
    warm, cold = _engine(path, cached=True), _engine(path, cached=False)
    store = FailingStore(1 << 30)
    cache = warm.prefix_cache = pc.PrefixCache(store, warm.prefix_cache.ns, block_tokens=BLOCK, stride_tokens=0,
                                               message_starts=warm.prefix_cache.starts, min_snapshot_tokens=8)
    p1 = _prompt(warm, TURN1)
    cold1 = _complete(cold, p1, max_tokens=REPLY_TOKENS, mtp_k=2)
    # The RAM tier is full: storing the prompt raises; the sequence stores nothing more (its reply neither).
    store.put_error = MemoryError("the RAM tier is full")
    with caplog.at_level(logging.WARNING, logger="exo.engine.prefix_cache"):
        _same(_complete(warm, p1, max_tokens=REPLY_TOKENS, mtp_k=2), cold1)
    assert cache.figures()["failures"] == 1 and len(store) == 0
    assert [r.levelname for r in caplog.records if r.name == "exo.engine.prefix_cache"] == ["WARNING"]

    # Storing the reply's end raises (its blocks went in): the prompt is kept, the next turn restores that.
    def reply_end(name: str) -> bool:
        return name.startswith("s-") and int(name.split("-")[1]) > len(p1)

    store.failing = reply_end
    first = _complete(warm, p1, max_tokens=REPLY_TOKENS, mtp_k=2)
    _same(first, cold1)
    assert cache.stats.failures == 2 and not any(reply_end(k.split("/", 1)[1]) for k in store.keys())
    store.put_error = None
    p2 = _next_turn(warm, first.text)
    cold2 = _complete(cold, p2, max_tokens=20, mtp_k=2)
    second = _complete(warm, p2, max_tokens=20, mtp_k=2)
    assert 0 < second.stats.cached_tokens < len(p1)
    _same(second, cold2)
    # Reading raises (a disk tier failing), then a snapshot does not fit what restores it: each a miss, with
    # nothing half-restored (the recurrent states before the missing one are not left in the caches).
    for fault in ("get_error", "garble"):
        setattr(store, fault, OSError(5, "Input/output error") if fault == "get_error" else True)
        miss = _complete(warm, p2, max_tokens=20, mtp_k=2)
        setattr(store, fault, FailingStore.get_error if fault == "get_error" else False)
        assert miss.stats.cached_tokens == 0
        _same(miss, cold2)
    assert cache.stats.failures == 4
    # Looking keys up raises: the lookup holds nothing, the prefill keeps no snapshot (one failure each).
    store.has_error = OSError(5, "Input/output error")
    miss = _complete(warm, p2, max_tokens=20, mtp_k=2)
    assert cache.summary().heads == ()  # (the runner's status carries it: it lists nothing rather than fail)
    store.has_error = None
    assert cache.summary().heads != ()
    assert miss.stats.cached_tokens == 0 and cache.stats.failures == 6
    _same(miss, cold2)
    # (The reply alone cannot show a half-restored state here: this small model's reply to a 200-token prompt
    # forgets its first recurrent states. So, directly: a restore that fails leaves fresh caches fresh.)
    plan, caches, head = cache.plan(p2, True), warm.model.make_cache(), KVCache()
    store.garble = True
    assert plan.found is not None and not plan.restore(caches, head)
    store.garble = False
    assert cache.stats.failures == 7 and head.offset == 0 and plan.head_row is None
    assert all(c.offset == 0 if isinstance(c, KVCache) else c[0] is None and c[1] is None for c in caches)
    hit = _complete(warm, p2, max_tokens=20, mtp_k=2)
    assert hit.stats.cached_tokens > len(p1)
    _same(hit, cold2)
    # /metrics shows the count (from the generation's figures, as the API records them).
    metrics = Metrics()
    metrics.record_generation("m", hit.finish_reason, hit.stats)
    assert 'exo_prefix_cache_failures{model="m"} 7.0' in metrics.render().decode()
    # ... and the runner's status carries it to the cluster's views (the dashboard's node card)
    from exo.cluster.views import prefix_cache_json
    from exo.runner.service import prefix_cache_figures
    from exo.wire.proto_gen import node_pb2 as pb

    figures = prefix_cache_figures(warm)
    assert figures.failures == 7
    assert prefix_cache_json([pb.Instance(prefix_cache=figures), pb.Instance(prefix_cache=figures)])["failures"] == 14
