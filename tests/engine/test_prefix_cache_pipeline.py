"""The prefix cache on a pipelined instance: every stage keeps its own layers' part (attention KV blocks and
GatedDeltaNet snapshots of ITS layers, under its own namespace; the head's cache on the leader), the leader
settles on the deepest snapshot every stage holds (a LOOKUP round trip) and every stage restores it (BEGIN),
then stores its part of the prompt at the leader's block and snapshot edges. At temperature 0 a 2-stage reply
with a cache hit equals a cold single node's token for token, native MTP off and on. Stage 0 serves on a
thread of this process over an in-process link (tests/engine/test_pipeline.py's)."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading

import pytest
from mlx_lm.models.cache import KVCache

from exo.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, load_checkpoint
from exo.engine import pipeline as pl
from exo.engine import prefix_cache as pc
from exo.engine.replay import ReplayDrafter
from tests.fixtures.engines import fresh_engine

from .test_batch import _run_batch
from .test_pipeline import _QueueLink
from .test_prefix_cache import FailingStore

BLOCK = 16
CHUNK = 24
SYSTEM = "You are a coding agent. Tools: read(path), write(path, text), run(cmd). " * 3
TURN1 = [("user", "List the files in src and read main.py")]
TURN2 = TURN1 + [("assistant", "I will call read(main.py)."), ("user", "Tool result: def main(): return 42\n" * 4)]
OTHER = [("user", "Write a test for the parser module, please")]


class _Link(_QueueLink):
    """tests/engine/test_pipeline.py's link, carrying bfloat16 too (the demo model's activations) as its bits."""

    def send(self, x, dst: int) -> None:
        import mlx.core as mx

        super().send(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x, dst)

    def recv(self, shape, dtype, src: int):
        import mlx.core as mx

        if dtype == mx.bfloat16:
            return super().recv(shape, mx.uint16, src).view(mx.bfloat16)
        return super().recv(shape, dtype, src)


class Forgetful(FailingStore):
    """A store whose entries vanish between a lookup and the restore when ``forget`` is set (as one evicted
    meanwhile by another instance sharing the disk tier); it raises where a test says (``FailingStore``)."""

    forget = False

    def get(self, key, group=None):
        return None if self.forget else super().get(key, group)


def _cache(loaded, layers) -> pc.PrefixCache:
    return pc.PrefixCache(Forgetful(1 << 30), pc.namespace(loaded, layers), block_tokens=BLOCK, stride_tokens=0,
                          message_starts=pc.message_starts(loaded.tokenizer) if loaded.tokenizer else frozenset(),
                          min_snapshot_tokens=8)


class _Pipeline:
    def __init__(self, path, split: tuple[int, int]) -> None:
        first = load_checkpoint(path, layers=(0, split[0]))
        leader = dataclasses.replace(load_checkpoint(path, layers=split), eos_token_ids=frozenset())
        queues = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}
        self.links = [_Link(0, queues), _Link(1, queues)]
        self.errors: list[BaseException] = []
        self.stage_cache = _cache(first, (0, split[0]))
        self.stage_model = first.model
        self.done, park = threading.Event(), threading.Event()

        def stage0() -> None:
            try:
                pl.serve_stage(first.model, pl.StageSpec(0, 2, 0, split[0]), self.links[0],
                               prefix_cache=self.stage_cache)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.errors.append(e)
                queues[(0, 1)].put(e)
            self.done.set()
            park.wait()  # a thread that ran MLX may abort the process as it exits

        threading.Thread(target=stage0, daemon=True).start()
        self.forward = pl.PipelineForward(leader.model, pl.StageSpec(1, 2, *split), self.links[1])
        self.engine = Engine(leader, EngineConfig(prefill_chunk=CHUNK), forward=self.forward)
        self.engine.prefix_cache = _cache(leader, split)

    def close(self) -> None:
        self.forward.shutdown()
        assert self.done.wait(60)
        assert not self.errors, self.errors


@pytest.fixture
def pipeline():
    made: list[_Pipeline] = []

    def make(path, split):
        made.append(_Pipeline(path, split))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _path(checkpoint, arch):
    if arch == "demo":  # 8 layers, attention at 3 and 7: stage 0 (0-3) holds an attention layer's KV blocks
        from exo.cards import bundled_model_dir

        return bundled_model_dir("exo-demo"), (4, 8)
    return checkpoint(arch, dtype="float32"), (2, 4)


def _single(path) -> Engine:
    return fresh_engine(path, eos=False, prefill_chunk=CHUNK)


def _prompt(engine: Engine, turns, system: str = SYSTEM) -> list[int]:
    messages = [{"role": "system", "content": system}] + [{"role": r, "content": t} for r, t in turns]
    return list(engine.loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _complete(engine: Engine, prompt, **fields):
    fields.setdefault("max_tokens", 12)
    return engine.complete(GenerationRequest(prompt, sampling=SamplingParams(temperature=0.0), **fields))


def _same_counts(a, b) -> None:
    for name in ("rounds", "drafted_tokens", "accepted_tokens", "k_histogram"):
        assert getattr(a.stats, name) == getattr(b.stats, name), name


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "demo"])
@pytest.mark.parametrize("mtp", [dict(native_mtp="off"), dict(mtp_k=2)], ids=["mtp-off", "mtp-k2"])
def test_a_pipelined_hit_equals_a_cold_single_node(checkpoint, pipeline, arch, mtp):
    path, split = _path(checkpoint, arch)
    pipe = pipeline(path, split)
    warm, single = pipe.engine, _single(path)
    p1, p2, p3 = _prompt(single, TURN1), _prompt(single, TURN2), _prompt(single, OTHER)
    starts = [i for i, t in enumerate(p2) if t in warm.prefix_cache.starts]
    # The pipeline cold (no cache on the leader: it asks the stages nothing), for the MTP counts.
    cache, warm.prefix_cache = warm.prefix_cache, None
    cold2, cold3 = _complete(warm, p2, **mtp), _complete(warm, p3, **mtp)
    warm.prefix_cache = cache
    assert pipe.stage_cache.stats.lookups == 0

    first = _complete(warm, p1, **mtp)
    assert first.stats.cached_tokens == 0 and first.token_ids == _complete(single, p1, **mtp).token_ids
    assert pipe.stage_cache.stats.captured_bytes > 0  # stage 0 stored its layers' part
    if arch == "demo":  # stage 0's attention layer: its KV blocks too
        assert any(k.split("/", 1)[1].startswith("b-") and "k3" in pipe.stage_cache.store.get(k)
                   for k in pipe.stage_cache.store.keys())

    second = _complete(warm, p2, **mtp)  # the next turn: restored on both stages at turn 1's header
    assert second.stats.cached_tokens == starts[2] > 0
    assert second.token_ids == _complete(single, p2, **mtp).token_ids == cold2.token_ids
    _same_counts(second, cold2)
    other = _complete(warm, p3, **mtp)  # a new conversation: the system part
    assert other.stats.cached_tokens == starts[1]
    assert other.token_ids == _complete(single, p3, **mtp).token_ids == cold3.token_ids
    _same_counts(other, cold3)
    assert pipe.stage_cache.stats.hits == 2 and warm.prefix_cache.stats.hits == 2


def test_the_leader_settles_on_what_every_stage_holds(checkpoint, pipeline):
    path, split = _path(checkpoint, "qwen3_5")
    pipe = pipeline(path, split)
    warm, single = pipe.engine, _single(path)
    p1, p2 = _prompt(single, TURN1), _prompt(single, TURN2)
    _complete(warm, p1, native_mtp="off")
    cold = _complete(single, p2, native_mtp="off")
    # Stage 0 lost its part (evicted): the leader's own is no use alone; everything is prefilled.
    stage_store = pipe.stage_cache.store
    saved = {k: stage_store.get(k) for k in stage_store.keys()}
    for k in saved:
        stage_store.remove(k)
    miss = _complete(warm, p2, native_mtp="off")
    assert miss.stats.cached_tokens == 0 and miss.token_ids == cold.token_ids
    for k, v in saved.items():
        stage_store.put(k, v)
    # Stage 0's entries vanish between the lookup and the restore: BEGIN fails there, every stage starts
    # from 0 again.
    stage_store.forget = True
    vanished = _complete(warm, p2, native_mtp="off")
    stage_store.forget = False
    assert vanished.stats.cached_tokens == 0 and vanished.token_ids == cold.token_ids
    # The leader's own entries vanish after the stages restored: they are told to start from 0.
    warm.prefix_cache.store.forget = True
    gone = _complete(warm, p2, native_mtp="off")
    warm.prefix_cache.store.forget = False
    assert gone.stats.cached_tokens == 0 and gone.token_ids == cold.token_ids
    hit = _complete(warm, p2, native_mtp="off")
    assert hit.stats.cached_tokens > 0 and hit.token_ids == cold.token_ids


def test_prefix_headers_and_payloads_are_checked():
    for op in (pl.OP_PREFIX_LOOKUP, pl.OP_PREFIX_BEGIN):
        good = pl.StepHeader(op, 0, 3, 1, 5)
        assert pl.StepHeader.decode(good.encode().tolist()) == good
        for bad in (dict(rows=0), dict(batch=2)):
            with pytest.raises(pl.StepHeaderError, match="malformed"):
                pl.StepHeader.decode(dataclasses.replace(good, **bad).encode().tolist())
    slots = pl.StageSlots(None, 0)
    header = pl.StepHeader(pl.OP_PREFIX_LOOKUP, 0, 3, 1, 4)
    with pytest.raises(pl.StepHeaderError, match="malformed prefix payload"):
        pl._prefix_step(header, [5, 1, 2, 3], slots, {}, None)  # 5 tokens announced, 3 sent
    begin = pl.StepHeader(pl.OP_PREFIX_BEGIN, 0, 3, 1, 9)
    with pytest.raises(pl.StepHeaderError, match="malformed prefix payload"):
        pl._prefix_step(begin, [1, 8, 0, 0, 0, 0, 0, 2, 4], slots, {}, None)  # 2 edges announced, 1 sent
    # A BEGIN whose LOOKUP this stage never saw: it says it did not restore (the leader starts all from 0).
    assert pl._prefix_step(begin, [1, 8, 0, 0, 0, 0, 0, 1, 4], slots, {}, None)[0] == 0
    # A stage without a prefix cache holds nothing, and restores nothing but position 0.
    prefixes: dict = {}
    lookup = pl.StepHeader(pl.OP_PREFIX_LOOKUP, 0, 3, 1, 6)
    assert pl._prefix_step(lookup, [2, 7, 7, 2, 1, 1], slots, prefixes, None) == [2, 7, 7, 2, -1, -1]


# -- the reply: every stage keeps its layers' part (STORE_END) ---------------------------------------------
REPLY_TOKENS = 40  # more than two blocks of BLOCK
TOOL = [("user", "Tool result: def main(): return 42\n" * 3)]


def _next_turn(engine: Engine, reply_text: str) -> list[int]:
    return _prompt(engine, TURN1 + [("assistant", reply_text)] + TOOL)


def _replies(cache: pc.PrefixCache, prompt: list[int]) -> set[int]:
    return {p for p in cache._lengths if p > len(prompt)}


@pytest.mark.parametrize("mtp", [dict(native_mtp="off"), dict(mtp_k=2)], ids=["mtp-off", "mtp-k2"])
def test_a_pipelined_next_turn_restores_through_the_reply(checkpoint, pipeline, mtp):
    path, split = _path(checkpoint, "qwen3_5")
    pipe = pipeline(path, split)
    warm, single = pipe.engine, _single(path)
    p1 = _prompt(single, TURN1)
    first = _complete(warm, p1, max_tokens=REPLY_TOKENS, **mtp)
    assert first.finish_reason == "length"
    # Stage 0 stored its layers' part of the reply at the leader's end too (without it the leader, which
    # settles on what every stage holds, would restore the prompt only).
    pipe.forward.memory_rates()  # (a round trip: stage 0 has applied what the last message carried)
    assert _replies(pipe.stage_cache, p1) == _replies(warm.prefix_cache, p1) != set()
    p2 = _next_turn(single, first.text)
    assert p2[: len(p1) + REPLY_TOKENS] == p1 + first.token_ids
    second = _complete(warm, p2, max_tokens=20, **mtp)
    assert second.stats.cached_tokens in (len(p1) + REPLY_TOKENS - 1, len(p1) + REPLY_TOKENS)
    assert second.token_ids == _complete(single, p2, max_tokens=20, **mtp).token_ids


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_pipelined_reply_ending_inside_an_accepted_run_is_kept_on_every_stage(checkpoint, pipeline, k):
    """Every round accepts its K drafts (the plain reply replayed, engine/replay.py) and the budget ends the
    reply one token into a run: the leader's rollback to the finish reaches stage 0 with the round's decision,
    both stages store the reply to its end, and the next turn restores through it."""
    path, split = _path(checkpoint, "qwen3_5")
    pipe = pipeline(path, split)
    warm, single = pipe.engine, _single(path)
    p1 = _prompt(single, TURN1)
    budget = 1 + (k + 1) * (2 * BLOCK // (k + 1) + 1) + 1
    warm.replay = ReplayDrafter({tuple(p1): _complete(single, p1, max_tokens=budget + 8, native_mtp="off").token_ids},
                                1.0, warm.vocab_size)
    first = _complete(warm, p1, max_tokens=budget, mtp_k=k)
    assert first.finish_reason == "length" and first.stats.accepted_tokens == k * first.stats.rounds
    pipe.forward.memory_rates()  # (a round trip: stage 0 has applied what the last message carried)
    assert _replies(pipe.stage_cache, p1) == _replies(warm.prefix_cache, p1) == {len(p1) + budget - 1}
    p2 = _next_turn(single, first.text)
    assert p2[: len(p1) + budget] == p1 + first.token_ids
    second = _complete(warm, p2, max_tokens=20, native_mtp="off")
    assert second.stats.cached_tokens == len(p1) + budget - 1
    assert second.token_ids == _complete(single, p2, max_tokens=20, native_mtp="off").token_ids


def test_a_pipelined_batch_member_stores_its_reply_from_its_row(checkpoint, pipeline):

    path, split = _path(checkpoint, "qwen3_5")
    pipe = pipeline(path, split)
    warm, single = pipe.engine, _single(path)
    p1, p3 = _prompt(single, TURN1), _prompt(single, OTHER)
    # p1's member ends first (its row is stored, then filtered out); p3's ends last (the batch's end).
    requests = [GenerationRequest(prompt, max_tokens=budget, sampling=SamplingParams(temperature=0.0), native_mtp="off")
                for prompt, budget in ((p1, REPLY_TOKENS), (p3, REPLY_TOKENS + 13))]
    tokens = {i: out[0] for i, out in _run_batch(warm, requests).items()}
    assert len(tokens[0]) == REPLY_TOKENS and len(tokens[1]) == REPLY_TOKENS + 13
    pipe.forward.memory_rates()  # (a round trip: stage 0 has applied what the last message carried)
    for prompt in (p1, p3):
        assert _replies(pipe.stage_cache, prompt) >= _replies(warm.prefix_cache, prompt) != set()
    p2 = _next_turn(single, warm.loaded.tokenizer.decode(tokens[0]))
    hit = _complete(warm, p2, max_tokens=20, native_mtp="off")
    assert hit.stats.cached_tokens > len(p1) + BLOCK
    assert hit.token_ids == _complete(single, p2, max_tokens=20, native_mtp="off").token_ids


# -- a stage's store that raises: the stage serves on, the reply is the cold one -----------------------------
def test_a_stage_whose_store_raises_keeps_serving(checkpoint, pipeline, caplog):
    path, split = _path(checkpoint, "qwen3_5")
    pipe = pipeline(path, split)
    warm, single = pipe.engine, _single(path)
    stage = pipe.stage_cache
    p1 = _prompt(single, TURN1)
    cold1 = _complete(single, p1, max_tokens=REPLY_TOKENS, native_mtp="off")
    # Stage 0's RAM tier is full: storing its part of the prompt raises there. It logs and counts it once, drops
    # the sequence's StagePrefix (its reply is not stored either) and serves on.
    stage.store.put_error = MemoryError("the RAM tier is full")
    with caplog.at_level(logging.WARNING, logger="exo.engine.prefix_cache"):
        first = _complete(warm, p1, max_tokens=REPLY_TOKENS, native_mtp="off")
        pipe.forward.memory_rates()  # (a round trip: stage 0 has applied what the last message carried)
    assert first.token_ids == cold1.token_ids
    assert stage.stats.failures == 1 and not list(stage.store.keys()) and warm.prefix_cache.stats.failures == 0
    assert len([r for r in caplog.records if r.name == "exo.engine.prefix_cache"]) == 1

    # Storing its part of the reply raises (STORE_END): its part of the prompt stays.
    def reply_end(name: str) -> bool:
        return name.startswith("s-") and int(name.split("-")[1]) > len(p1)

    stage.store.failing = reply_end
    first = _complete(warm, p1, max_tokens=REPLY_TOKENS, native_mtp="off")
    pipe.forward.memory_rates()
    assert first.token_ids == cold1.token_ids and stage.stats.failures == 2
    assert _replies(warm.prefix_cache, p1) and not any(reply_end(k.split("/", 1)[1]) for k in stage.store.keys())
    # The next turn settles on what every stage holds: the prompt's header, not through the reply.
    stage.store.put_error = None
    p2 = _next_turn(single, first.text)
    second = _complete(warm, p2, max_tokens=20, native_mtp="off")
    assert 0 < second.stats.cached_tokens < len(p1)
    assert second.token_ids == _complete(single, p2, max_tokens=20, native_mtp="off").token_ids
    # The leader's own store raises: it stores nothing of the sequence and asks no stage to store its reply.
    p3 = _prompt(single, OTHER)
    warm.prefix_cache.store.put_error = MemoryError("the RAM tier is full")
    other = _complete(warm, p3, max_tokens=REPLY_TOKENS, native_mtp="off")
    warm.prefix_cache.store.put_error = None
    pipe.forward.memory_rates()
    assert warm.prefix_cache.stats.failures == 1 and stage.stats.failures == 2
    assert other.token_ids == _complete(single, p3, max_tokens=REPLY_TOKENS, native_mtp="off").token_ids
    fed = p3 + other.token_ids[:-1]  # (what the caches held at its end: the last token is never fed)
    assert not stage.store.has(stage.key(pc.snapshot_key(len(fed), pc.block_chain(fed, BLOCK, stage.ns), fed, BLOCK)))


def test_a_stage_whose_restore_raises_answers_not_restored(checkpoint, pipeline):
    path, split = _path(checkpoint, "qwen3_5")
    pipe = pipeline(path, split)
    warm, single = pipe.engine, _single(path)
    stage = pipe.stage_cache
    p1, p2 = _prompt(single, TURN1), _prompt(single, TURN2)
    _complete(warm, p1, native_mtp="off")
    cold = _complete(single, p2, native_mtp="off")
    # Stage 0's tier fails the read in BEGIN: it answers "not restored", every stage starts from 0.
    stage.store.get_error = OSError(5, "Input/output error")
    miss = _complete(warm, p2, native_mtp="off")
    stage.store.get_error = None
    assert miss.stats.cached_tokens == 0 and miss.token_ids == cold.token_ids
    assert stage.stats.failures == 1 and warm.prefix_cache.stats.failures == 0
    hit = _complete(warm, p2, native_mtp="off")  # (stage 0 served on, and stored p2 in the miss)
    assert hit.stats.cached_tokens > len(p1) and hit.token_ids == cold.token_ids
    # The leader's own read raises after stage 0 restored: every stage starts from 0 again.
    warm.prefix_cache.store.get_error = OSError(5, "Input/output error")
    gone = _complete(warm, p2, native_mtp="off")
    warm.prefix_cache.store.get_error = None
    assert gone.stats.cached_tokens == 0 and gone.token_ids == cold.token_ids
    assert warm.prefix_cache.stats.failures == 1 and stage.stats.hits == 2
    # A stage's BEGIN whose restore fails on an entry that does not fit (a recurrent state missing) leaves the
    # slot's caches fresh, nothing half-restored (stage 0 idles in a receive meanwhile).
    slots, prefixes = pl.StageSlots(pipe.stage_model, 0), {}
    held = sorted(stage._lengths)
    lookup = [len(p2), *p2, len(held), *held]
    found = pl._prefix_step(pl.StepHeader(pl.OP_PREFIX_LOOKUP, 0, 7, 1, len(lookup)), lookup, slots, prefixes, stage)
    position = max(found[2 + len(p2) :])
    assert position > len(p1)
    begin = [1, position, 0, 0, 0, 0, 0, 0]
    stage.store.garble = True
    answer = pl._prefix_step(pl.StepHeader(pl.OP_PREFIX_BEGIN, 1, 7, 1, len(begin)), begin, slots, prefixes, stage)
    stage.store.garble = False
    assert answer[0] == 0 and stage.stats.failures == 2
    assert all(c.offset == 0 if isinstance(c, KVCache) else c[0] is None and c[1] is None for c in slots.caches[7])


@pytest.mark.parametrize("arch", ["qwen3_5", "demo"])
def test_prompts_prefilled_together_are_stored_on_every_stage(checkpoint, pipeline, arch):
    """Two whole prompts prefilled as rows of one call through the stages (``engine.batch_prefill``): each stage's
    prefix cache finds each row as after that sequence's own prefill (``StagePrefix.step`` on the row it handed to
    the sequence's slot), so after the batch both stages store each reply; the next turn of either restores
    through its reply on both stages and equals a cold single node's."""
    from exo.engine.batch import BatchDecoder
    from exo.engine.batch_prefill import prefill_together

    path, split = _path(checkpoint, arch)
    pipe = pipeline(path, split)
    warm, single = pipe.engine, _single(path)
    encode = single.loaded.tokenizer.encode
    # Prompts short of the cache's first snapshot edge (``min_snapshot_tokens``: a longer one has an edge inside, at
    # its last token, and prefills alone): what each stage stores of them and then of their replies is its own.
    prompts = [list(encode(SYSTEM))[:8], list(encode("Write a parser for TOML files in Python."))[:7]]
    requests = [GenerationRequest(p, max_tokens=REPLY_TOKENS + 5 * i, sampling=SamplingParams(temperature=0.0),
                                  native_mtp="off") for i, p in enumerate(prompts)]
    runs = [warm.start(r) for r in requests]
    assert all(run.whole_prompt_in(len(p)) for run, p in zip(runs, prompts, strict=True))
    prefill_together(runs)
    replies: list[list[int]] = [[], []]
    batch = BatchDecoder(warm)
    for run, reply in zip(runs, replies, strict=True):
        reply += [t for chunk in run.first_token() for t in chunk.token_ids]
        batch.add(run)
    while len(batch):
        for run, chunks in batch.step():
            replies[runs.index(run)] += [t for chunk in chunks for t in chunk.token_ids]
    pipe.forward.memory_rates()  # (a round trip: stage 0 has applied what the last message carried)
    for prompt, request, reply in zip(prompts, requests, replies, strict=True):
        assert reply == _complete(single, prompt, max_tokens=request.max_tokens, native_mtp="off").token_ids
        assert _replies(pipe.stage_cache, prompt) >= _replies(warm.prefix_cache, prompt) != set()
        turn = [*prompt, *reply, *encode(" Now explain it.")]
        hit = _complete(warm, turn, max_tokens=12, native_mtp="off")
        assert hit.stats.cached_tokens > len(prompt) + BLOCK
        assert hit.token_ids == _complete(single, turn, max_tokens=12, native_mtp="off").token_ids
    assert pipe.stage_cache.stats.hits == 2
