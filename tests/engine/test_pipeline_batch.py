"""Continuous batching through a pipeline (engine/batch.py over engine/pipeline.py): the batch's one loop runs
on the leader with a ``PipelineForward`` as its backbone, and every other stage mirrors the batch's cache
operations (joins, filters, per-sequence rollbacks) on its own layers' caches, by slot. Stage 0 serves steps
on a thread of this process over an in-process link (as tests/engine/test_pipeline.py's), on genuine tiny
checkpoints. Every member of a pipelined batch gets exactly its single-node solo output: greedy with native MTP
off, at forced depths and adaptive, members joining (newcomers prefilling in chunks between the batch's steps)
and leaving; seeded sampling reproduces the solo samples; a stop, max_tokens or a cancellation ends one member
and leaves the others exact."""

from __future__ import annotations

import dataclasses
import queue
import threading

import mlx.core as mx
import numpy as np
import pytest

from exo.engine import Engine, EngineConfig, SamplingParams, load_checkpoint
from exo.engine import pipeline as pipeline_module
from exo.engine.adaptive import DepthCosts
from exo.engine.batch import BatchDecoder, BatchLanes
from exo.runner.device import pipeline_failed
from tests.fixtures.engines import fresh_engine, watch_prefill_together

from .test_batch import CHUNK, TEXTS, _solo
from .test_pipeline import _QueueLink

SPLIT = (2, 4)  # the fixtures' 4 layers: stage 0 holds 0-1, the leader 2-3


class _Link(_QueueLink):
    """The in-process link (numpy copies between threads), bfloat16 too (as 16-bit words), where a lost peer
    stays lost: once a receive found the other stage gone, every later one raises at once (as a closed
    doorbell does: runner/group.py)."""

    lost: BaseException | None = None

    def send(self, x, dst: int) -> None:
        mx.eval(x)
        self.sent.append(x.nbytes)
        bf16 = x.dtype == mx.bfloat16
        self.queues[(self.rank, dst)].put((np.array(x.view(mx.uint16) if bf16 else x), bf16))

    def recv(self, shape, dtype, src: int):
        if self.lost is not None:
            raise RuntimeError("the other stage failed") from self.lost
        message = self.queues[(src, self.rank)].get(timeout=60)
        if isinstance(message, BaseException):
            self.lost = message
            raise RuntimeError("the other stage failed") from message
        x, bf16 = message
        out = mx.array(x).view(mx.bfloat16) if bf16 else mx.array(x)
        assert tuple(out.shape) == tuple(shape) and out.dtype == dtype, (out.shape, shape, out.dtype, dtype)
        return out


class _Pipeline:
    """The stages but the last serving on threads of their own (parked once they return: a thread that ran MLX
    may abort the process as it exits), the leader's engine here. ``split``: the stages' end layers (the
    fixtures' 4 layers: (2, 4) is 0-1 | 2-3). ``slots``: each serving stage's slot table (what it holds)."""

    def __init__(self, path, eos: bool, config: EngineConfig, split: tuple[int, ...] = SPLIT,
                 on_step=None, states_room: bool = False) -> None:
        n = len(split)
        ranges = [(split[r - 1] if r else 0, split[r]) for r in range(n)]
        stages = [load_checkpoint(path, layers=ranges[r]) for r in range(n - 1)]
        leader = load_checkpoint(path, layers=ranges[-1])
        if not eos:
            leader = dataclasses.replace(leader, eos_token_ids=frozenset())
        queues = {(r, (r + 1) % n): queue.Queue() for r in range(n)}
        self.links = [_Link(r, queues) for r in range(n)]
        self.errors: list[BaseException] = []
        self.all_slots = [pipeline_module.StageSlots(stage.model, r) for r, stage in enumerate(stages)]
        self.slots = self.all_slots[0]
        self.done = [threading.Event() for _ in stages]
        park = threading.Event()

        def serve(r: int) -> None:
            try:
                pipeline_module.serve_stage(stages[r].model, pipeline_module.StageSpec(r, n, *ranges[r]), self.links[r],
                                            slots=self.all_slots[r], on_step=on_step if r == 0 else None,
                                            states_room=states_room)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.errors.append(e)
                queues[(r, r + 1)].put(e)
            self.done[r].set()
            park.wait()

        for r in range(n - 1):
            threading.Thread(target=serve, args=(r,), daemon=True).start()
        self.forward = pipeline_module.PipelineForward(
            leader.model, pipeline_module.StageSpec(n - 1, n, *ranges[-1]), self.links[-1])
        self.stage_models = [stage.model for stage in stages]
        self.stage_model, self.leader_model = stages[0].model, leader.model
        self.engine = Engine(leader, config, forward=self.forward)

    def close(self) -> None:
        if not self.lost:  # a forward that failed refuses every call (the stages may be out of step)
            self.forward.shutdown()
        assert all(done.wait(60) for done in self.done)
        assert not self.errors or self.lost, self.errors

    lost = False  # a test killed stage 0 on purpose


@pytest.fixture
def pipelined(checkpoint):
    """``pipelined(arch, eos=False, **config)`` -> (the pipelined leader's engine, the pipeline)."""
    made: list[_Pipeline] = []

    def make(arch: str, eos: bool = False, path=None, split=SPLIT, on_step=None, states_room=False,
             **config) -> tuple[Engine, _Pipeline]:
        """``split``: the stages' end layers (SPLIT: two stages); ``states_room``: the serving stages' nodes set
        room aside for a full batch's states (``serve_stage``)."""
        path = path or checkpoint(arch, dtype="float32")
        pipe = _Pipeline(path, eos, EngineConfig(prefill_chunk=CHUNK, **config), split, on_step, states_room)
        made.append(pipe)
        return pipe.engine, pipe

    yield make
    for pipe in made:
        pipe.close()


def _whole(path, eos: bool = False) -> Engine:
    return fresh_engine(path, eos, prefill_chunk=CHUNK)


def _prompt(engine: Engine, i: int, length: int | None = None) -> list[int]:
    ids = list(engine.loaded.tokenizer.encode(TEXTS[i % len(TEXTS)]))
    while length is not None and len(ids) < length:
        ids += ids
    return ids[:length] if length is not None else ids


def _requests(engine: Engine, specs: list[dict]) -> list:
    from exo.engine import GenerationRequest

    out = []
    for i, spec in enumerate(specs):
        spec = dict(spec)
        prompt = _prompt(engine, i, spec.pop("length", None))
        out.append(GenerationRequest(prompt, max_tokens=spec.pop("max_tokens", 16), **spec))
    return out


def _drive(engine: Engine, requests, join_at, cancel=None, chunk: int = CHUNK, lanes: int | None = None,
           together: bool = False):
    """Decode ``requests`` in one pipelined batch as the device queue does: request i arrives before step
    ``join_at[i]``, prefills one chunk of ``chunk`` tokens per batch step while the batch decodes, and joins
    after its first token; ``cancel``: {i: step} ends request i from that step on. Every member's invariants
    are checked between steps. ``lanes``: micro-batches (``BatchLanes``: each lane its own slot on the stages,
    a lane's step evaluated on the leader while the next lane's runs on stage 0). ``together``: the requests that
    arrive at one step prefill their whole prompts as rows of one call (``engine.batch_prefill``, as the device
    queue's scheduler admits them). Returns per request (token ids, text, finish reason, stats)."""
    from exo.engine.batch_prefill import prefill_together

    cancel = cancel or {}
    batch = BatchDecoder(engine) if lanes is None else BatchLanes(engine, lanes)
    out = {i: ([], [], None, None) for i in range(len(requests))}
    index: dict[int, int] = {}
    clock = [0]
    pending = set(range(len(requests)))
    prefilling: list = []

    def take(i, chunk):
        tokens, text, _, _ = out[i]
        tokens.extend(chunk.token_ids)
        text.append(chunk.text)
        if chunk.finish_reason is not None:
            out[i] = (tokens, text, chunk.finish_reason, chunk.stats)

    while pending or prefilling or len(batch):
        arriving = []
        for i in sorted(pending):
            if join_at[i] <= clock[0]:
                pending.discard(i)
                request = requests[i]
                if i in cancel:
                    request = dataclasses.replace(request, should_stop=lambda at=cancel[i]: clock[0] >= at)
                run = engine.start(request)
                index[id(run)] = i
                arriving.append((i, run))
        if together and len(arriving) > 1:
            prefill_together([run for _, run in arriving])
        prefilling += [(i, run, iter(()) if together and len(arriving) > 1 else run.prefill(chunk)) for i, run in arriving]
        still = []
        for i, run, chunks in prefilling:
            if next(chunks, None) is not None:  # a chunk done, more to come: the batch steps first
                if run.cancelled():  # as the device queue does: it leaves, its caches dropped everywhere
                    run.release()
                    take(i, run.final_chunk())
                else:
                    still.append((i, run, chunks))
                continue
            for c in run.first_token():
                take(i, c)
            if run.output.finish is not None:
                run.release()
                take(i, run.final_chunk())
            else:
                batch.add(run)
        prefilling = still
        if len(batch):
            for run, chunks in batch.step():
                for c in chunks:
                    take(index[id(run)], c)
            for lane in batch.lanes if lanes is not None else [batch]:
                lane.check_invariants()
        clock[0] += 1
    return {i: (tokens, "".join(text), finish, stats) for i, (tokens, text, finish, stats) in out.items()}


def _check(whole: Engine, requests, got, finish: str | None = "length", stages: int = 2) -> None:
    for i, request in enumerate(requests):
        solo = _solo(whole, dataclasses.replace(request, should_stop=None))
        tokens, text, reason, stats = got[i]
        assert tokens == solo.token_ids, f"request {i}"
        assert text == solo.text and reason == solo.finish_reason, f"request {i}"
        if finish is not None:
            assert reason == finish, f"request {i}"
        assert stats.mode == "pipeline" and stats.stages == stages and stats.completion_tokens == len(tokens)


def _no_slots_left(pipe: _Pipeline) -> None:
    """Every request and batch that ended dropped its caches on stage 0 too (nothing leaks)."""
    for slots in pipe.all_slots:
        assert not slots.caches and not slots.sizes


# Prompts of 30 tokens (four chunks of 8) join while the others decode; budgets differ, so members leave at
# different steps.
JOINS = dict(join_at=[0, 0, 2, 3, 6])
SPECS = [dict(max_tokens=m, length=n) for m, n in zip((20, 7, 16, 12, 5), (None, 30, 30, None, 17), strict=True)]


@pytest.mark.parametrize("lanes", [None, 2], ids=["one-batch", "micro-batches"])
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("mtp", ["off", "k2", "k1-k3"])
def test_a_pipelined_batch_decodes_every_member_as_its_single_node_solo(checkpoint, pipelined, arch, mtp, lanes):
    engine, pipe = pipelined(arch)
    depth = {"off": [None] * 5, "k2": [2] * 5, "k1-k3": [1, 3, None, 3, 1]}[mtp]
    specs = [dict(spec, **({"mtp_k": k, "native_mtp": "on"} if k else {"native_mtp": "off"}))
             for spec, k in zip(SPECS, depth, strict=True)]
    requests = _requests(engine, specs)
    got = _drive(engine, requests, **JOINS, lanes=lanes)
    _check(_whole(checkpoint(arch, dtype="float32")), requests, got)
    assert max(got[0][3].batch_sizes) >= 3  # members decoded together
    if mtp != "off":
        drafting = [s for _, _, _, s in got.values() if s.enabled]
        assert all(s.rounds > 0 for s in drafting)
        # Drafts were rejected (rows rolled back per member on both stages) and accepted.
        assert 0 < sum(s.accepted_tokens for s in drafting) < sum(s.drafted_tokens for s in drafting)
    _no_slots_left(pipe)


@pytest.mark.parametrize("split", [SPLIT, (1, 2, 4)], ids=["2-stages", "3-stages"])
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_prompts_prefilled_together_through_the_stages_decode_their_solo_output(checkpoint, pipelined, arch, split):
    """Newcomers' whole prompts as rows of one call through a pipeline (``engine.batch_prefill``): the call's header
    carries each row's length and the slot of the sequence that owns it (a ``PREFILL_ROWS`` record); every other
    stage makes the call's caches with those lengths (the padding after a row leaves its GatedDeltaNet state) and
    right after the step hands row b to sequence b's slot, its own positions only. Every member then decodes its
    single-node solo output (plain, K = 2, seeded sampling) in a batch, and nothing of the call's slot is left."""
    from mlx_lm.models.cache import KVCache

    from exo.engine.batch_cache import BatchKVCache
    from exo.engine.batch_prefill import can_prefill_together, prefill_together

    engine, pipe = pipelined(arch, split=split)
    assert can_prefill_together(engine)
    modes = [dict(native_mtp="off"), dict(mtp_k=2), dict(sampling=SamplingParams(temperature=0.8, seed=4),
                                                          native_mtp="off"), dict(native_mtp="off"), dict(mtp_k=1)]
    specs = [dict(max_tokens=9 + i, length=n, **mode)
             for i, (n, mode) in enumerate(zip((None, 30, 3, 17, 1), modes, strict=True))]
    requests = _requests(engine, specs)
    runs = [engine.start(r) for r in requests]
    slots = [run.cache.slot for run in runs]
    prefill_together(runs)
    assert [run.cache.slot for run in runs] == slots  # each sequence keeps its slot
    pipe.forward.memory_rates()  # (a round trip: every stage has split the call's rows by now)
    lengths = [len(r.prompt_tokens) for r in requests]
    for stage in pipe.all_slots:
        assert sorted(stage.caches) == sorted(slots) and not stage.prompts and not stage.sizes
        for slot, n in zip(slots, lengths, strict=True):
            for c in stage.caches[slot]:
                if isinstance(c, KVCache):
                    assert not isinstance(c, BatchKVCache) and c.offset == n and c.keys.shape[:3:2] == (1, n)
                else:
                    assert all(a.shape[0] == 1 for a in c.cache)
    for run in runs:  # (these end here: every stage drops their slots)
        run.release()
    got = _drive(engine, requests, join_at=[0] * len(requests), together=True)
    _check(_whole(checkpoint(arch, dtype="float32")), requests, got, stages=len(split))
    assert sum(s.accepted_tokens for _, _, _, s in got.values()) > 0  # drafts kept through the stages
    _no_slots_left(pipe)


def test_prefill_rows_records_are_checked():
    """A ``PREFILL_ROWS`` record: as many lengths (each >= 1) as owners, the owners distinct and not the call's
    slot; a stage refuses one on a slot it holds, and a step whose shape is not the call's."""
    from exo.engine.pipeline import PREFILL_ROWS, Op, StepHeader, StepHeaderError

    assert Op.parse([PREFILL_ROWS, 9, 4, 3, 5, 1, 2]) == (Op(PREFILL_ROWS, 9, (3, 5, 1, 2)),)
    for bad in ([PREFILL_ROWS, 9, 3, 3, 5, 1], [PREFILL_ROWS, 9, 4, 0, 5, 1, 2], [PREFILL_ROWS, 9, 4, 3, 5, 1, 1],
                [PREFILL_ROWS, 9, 4, 3, 5, 1, 9], [PREFILL_ROWS, 9, 0]):
        with pytest.raises(StepHeaderError, match="malformed op record"):
            Op.parse(bad)
    slots = pipeline_module.StageSlots(load_checkpoint(_demo(), layers=(0, 4)).model, 0)
    slots.apply(Op(PREFILL_ROWS, 9, (3, 5, 1, 2)))
    with pytest.raises(StepHeaderError, match="which it holds"):
        slots.apply(Op(PREFILL_ROWS, 9, (3, 5, 1, 2)))
    with pytest.raises(StepHeaderError, match="made for prompts of"):
        slots.forward_cache(StepHeader.forward(0, 9, 2, 4, None))
    assert slots.forward_cache(StepHeader.forward(0, 9, 2, 5, None)) is slots.caches[9]
    slots.drop(9)  # (a call's slot dropped before its step: nothing of it is left to split)
    assert not slots.caches and not slots.prompts and slots.split_rows(9) == []


def _demo():
    from exo.cards import bundled_model_dir

    return bundled_model_dir("exo-demo")


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_adaptive_depth_in_a_pipelined_batch_switches_between_plain_steps_and_rounds(checkpoint, pipelined, arch):
    """With costs that say drafting pays (as on a GPU), the pipelined batch crosses between batched plain
    steps and rounds; every member stays exact."""
    engine, pipe = pipelined(arch)
    engine._costs = DepthCosts(beta=(1.2, 1.3, 1.4), delta=(0.01, 0.02, 0.03), device="test", plain_s=1.0, stages=2)
    requests = _requests(engine, [dict(max_tokens=40), dict(max_tokens=30, length=30), dict(max_tokens=35)])
    got = _drive(engine, requests, join_at=[0, 0, 3])
    _check(_whole(checkpoint(arch, dtype="float32")), requests, got)
    for _, _, _, stats in got.values():
        assert stats.enabled and stats.rounds > 0 and stats.k_histogram.get(0, 0) > 0
    _no_slots_left(pipe)


def test_seeded_sampling_and_penalties_in_a_pipelined_batch_reproduce_the_solo_samples(checkpoint, pipelined):
    engine, pipe = pipelined("qwen3_5")
    samplings = [
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=5.0),
        SamplingParams(temperature=1.2, top_p=0.9, seed=2, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, top_k=20, seed=1),  # the same seed as the first: its own stream
    ]
    specs = [dict(max_tokens=20, sampling=s, native_mtp="off") for s in samplings]
    specs += [dict(max_tokens=20, sampling=SamplingParams(temperature=0.8, seed=7), mtp_k=2, native_mtp="on")]
    requests = _requests(engine, specs)
    got = _drive(engine, requests, join_at=[0, 0, 1, 2, 3])
    whole = _whole(checkpoint("qwen3_5", dtype="float32"))
    for i, request in enumerate(requests):
        # Plain members against plain solo sampling; the drafting one against its solo MTP samples at K = 2.
        solo = whole.complete(request) if request.mtp_k else _solo(whole, request)
        assert got[i][0] == solo.token_ids, f"request {i}"
    assert got[4][3].rounds > 0
    _no_slots_left(pipe)


def test_a_stop_max_tokens_or_cancellation_ends_one_member_and_leaves_the_others_exact(checkpoint, pipelined):
    path = checkpoint("qwen3_5", dtype="float32")
    engine, pipe = pipelined("qwen3_5", eos=True)
    whole, free = _whole(path, eos=True), _whole(path)
    full = _solo(free, _requests(free, [dict(max_tokens=24)])[0]).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    specs = [
        dict(max_tokens=24, stop=[stop], mtp_k=3, native_mtp="on"),  # a stop string inside an accepted run
        dict(max_tokens=20, mtp_k=2, native_mtp="on", ignore_eos=True),  # cancelled at step 4
        dict(max_tokens=9, native_mtp="off", ignore_eos=True),  # max_tokens
        dict(max_tokens=1, native_mtp="off"),  # done at its first token: never joins
        dict(max_tokens=30, native_mtp="off", length=30, ignore_eos=True),  # cancelled while it prefills
        dict(max_tokens=22, mtp_k=1, native_mtp="on"),
    ]
    requests = _requests(engine, specs)
    got = _drive(engine, requests, join_at=[0, 0, 0, 1, 2, 2], cancel={1: 4, 4: 3})
    for i in (0, 2, 3, 5):
        solo = _solo(whole, requests[i])
        assert got[i][:3] == (solo.token_ids, solo.text, solo.finish_reason), f"request {i}"
    assert got[0][2] == "stop" and stop not in got[0][1]
    assert got[2][2] == "length" and len(got[2][0]) == 9
    for i in (1, 4):
        tokens, _, finish, _ = got[i]
        assert finish == "cancelled", f"request {i}"
        assert tokens == _solo(whole, requests[i]).token_ids[: len(tokens)]
    assert len(got[4][0]) == 0  # it never reached its first token
    _no_slots_left(pipe)


def test_a_lone_pipelined_member_becomes_a_batch_row_and_both_stay_exact(checkpoint, pipelined):
    """A batch of one steps on its member's own caches on both stages; a newcomer makes them the batch's first
    row (every stage mirrors it) and joins it."""
    engine, pipe = pipelined("qwen3_5")
    first, second = _requests(engine, [dict(max_tokens=30, mtp_k=2, native_mtp="on"), dict(max_tokens=12)])
    run = engine.start(first)
    streamed = [t for chunk in run.begin() for t in chunk.token_ids]
    batch = BatchDecoder(engine)
    batch.add(run)
    for _ in range(4):
        for _, chunks in batch.step():
            streamed += [t for chunk in chunks for t in chunk.token_ids]
    assert run.cache and run.output.finish is None and 1 <= len(streamed) < 30
    other = engine.start(second)
    other_tokens = [t for chunk in other.begin() for t in chunk.token_ids]
    batch.add(other)
    while len(batch):
        for r, chunks in batch.step():
            for chunk in chunks:
                (streamed if r is run else other_tokens).extend(chunk.token_ids)
        batch.check_invariants()
    whole = _whole(checkpoint("qwen3_5", dtype="float32"))
    assert streamed == _solo(whole, first).token_ids
    assert other_tokens == _solo(whole, second).token_ids
    _no_slots_left(pipe)


# -- the device queue of a pipelined leader ---------------------------------------------------------------


class _Client:
    """One generation job on the device queue and what it received."""

    def __init__(self, device, engine: Engine, i: int, max_tokens: int, **params) -> None:
        from exo.engine.prompt import GenerateParams, Prompt
        from exo.runner.device import GenerationJob

        self.prompt = _prompt(engine, i, 20 if i % 2 else None)
        self.params = GenerateParams(max_tokens=max_tokens, default_max_tokens=max_tokens, **params)
        self.items: list = []
        self.finish: str | None = None
        self.stats = None
        self.job = GenerationJob(device, lambda: engine, Prompt(token_ids=self.prompt), self.params, self.items.append,
                                 timeout_s=600, on_done=self._done)

    def _done(self, finish, stats, *_) -> None:
        self.finish, self.stats = finish, stats

    @property
    def tokens(self) -> list[int]:
        return [t for item in self.items if hasattr(item, "token_ids") for t in item.token_ids]


def _serve(device, clients: list[_Client]) -> None:
    """Serve on this thread until every client's job has ended."""
    for client in clients:
        done = client._done

        def on_done(*args, done=done) -> None:
            done(*args)
            if all(c.finish is not None for c in clients):
                device.close()

        client.job.on_done = on_done
        device.submit(client.job)
    device.serve()


def test_a_pipelined_leaders_device_queue_batches_its_generations(checkpoint, pipelined, monkeypatch):
    """Generations waiting on a pipelined leader decode as one batch, as on a single node: the first prefills
    in chunks alone, the others are admitted together once it decodes (their prompts fit one step's budget),
    prefill in that step as rows of one call through the stages (``engine.batch_prefill``) and join, and each
    gets its single-node solo output (greedy plain and drafting, seeded sampling)."""
    from exo.engine import GenerationRequest
    from exo.runner.device import Device, Started

    groups = watch_prefill_together(monkeypatch)
    path = checkpoint("qwen3_5", dtype="float32")
    engine, pipe = pipelined("qwen3_5", batch_prefill_chunk=64)
    sizes: list[int] = []
    device = Device(8, max_batch=4, on_batch=sizes.append)
    params = [dict(native_mtp="off"), dict(mtp_k=2), dict(sampling=SamplingParams(temperature=0.8, seed=3),
                                                           native_mtp="off"),
              dict(mtp_k=1), dict(native_mtp="off")]
    clients = [_Client(device, engine, i, 10 + i, **p) for i, p in enumerate(params)]
    _serve(device, clients)
    whole = _whole(path)
    for i, client in enumerate(clients):
        assert isinstance(client.items[0], Started) and client.finish == "length", client.items
        request = GenerationRequest(client.prompt, max_tokens=client.params.max_tokens,
                                    sampling=client.params.sampling, native_mtp="off")
        assert client.tokens == whole.complete(request).token_ids, f"client {i}"
        assert client.stats.batch_sizes and client.stats.mode == "pipeline", f"client {i}"
    assert max(sizes) == 4 and device.generations == 5 and max(groups, default=0) >= 2
    _no_slots_left(pipe)


def test_admission_counts_every_stages_memory(pipelined):
    """Each stage measures its own layers' cache rates (``OP_MEASURE``), and a batch is admitted only where
    every stage's KV budget holds it: exo-demo split 0-5 | 6-7 puts five GatedDeltaNet states per attention
    layer on stage 0 against one on the leader, so stage 0 refuses a pair the leader alone would admit."""
    from exo.cards import bundled_model_dir
    from exo.engine.batch import batch_bytes, batch_fits, stage_bytes
    from exo.engine.forward import cache_rates

    engine, pipe = pipelined("exo-demo", path=bundled_model_dir("exo-demo"), split=(6, 8))
    rates = stage_bytes(engine)
    assert rates == [cache_rates(pipe.stage_model), cache_rates(pipe.leader_model)]
    (stage_token, stage_sequence), (leader_token, leader_sequence) = rates
    assert stage_token == leader_token > 0 and stage_sequence == 5 * leader_sequence > 0
    budget = 1000
    assert batch_bytes([100, 100], leader_token, leader_sequence) <= budget * leader_token  # the leader: fits
    assert batch_bytes([100, 100], stage_token, stage_sequence) > budget * stage_token  # stage 0: does not
    assert not batch_fits(engine, [100, 100], budget)
    assert batch_fits(engine, [100, 100], 4 * budget)
    assert batch_fits(engine, [4000], 1)  # a lone run always runs
    _no_slots_left(pipe)


def test_stages_with_room_for_a_batch_s_states_count_only_their_kv(pipelined):
    """A serving stage whose node set room aside for a full batch's states (``states_room``) reports none per
    sequence, and the leader's own room (``engine.state_room``) covers its own stage's: the pair stage 0's states
    refused above (``test_admission_counts_every_stages_memory``) is admitted on the KV alone."""
    from exo.cards import bundled_model_dir
    from exo.engine.batch import batch_fits, stage_bytes
    from exo.engine.forward import cache_rates

    engine, pipe = pipelined("exo-demo", path=bundled_model_dir("exo-demo"), split=(6, 8), states_room=True)
    (stage_token, stage_sequence), (leader_token, leader_sequence) = stage_bytes(engine)
    assert (stage_token, stage_sequence) == (cache_rates(pipe.stage_model)[0], 0)
    assert (leader_token, leader_sequence) == cache_rates(pipe.leader_model)
    budget = 1000
    assert not batch_fits(engine, [100, 100], budget // 10)  # the KV of two 100-token rows is over 100 tokens
    assert batch_fits(engine, [100, 100], budget)  # stage 0 holds it now; the leader's states fit its KV budget
    assert not batch_fits(engine, [400] * 3, budget)  # the leader's 3 x 400 rows of KV do not
    engine.state_room = 3 * leader_sequence  # the leader's room: only its rows' KV counts
    assert batch_fits(engine, [330] * 3, budget)
    engine.state_room = 0
    assert not batch_fits(engine, [330] * 3, budget)
    _no_slots_left(pipe)


def test_a_stage_lost_mid_batch_ends_every_member_with_an_error(checkpoint, pipelined):
    """Stage 0 dies while a batch decodes (and a newcomer prefills): every generation on the device gets a
    ``Failed`` and ends "error" (the runner then places the instance anew: runner/service.py), none hangs."""
    from exo.runner.device import Device, Failed

    steps = [0]

    def die() -> None:
        steps[0] += 1
        if steps[0] == 40:
            raise ConnectionError("stage 0's machine went away")

    engine, pipe = pipelined("qwen3_5", on_step=die, batch_prefill_chunk=4)
    pipe.lost = True
    sizes: list[int] = []
    device = Device(8, max_batch=4, on_batch=sizes.append)
    clients = [_Client(device, engine, i, 60, native_mtp="off" if i % 2 else "auto", mtp_k=None if i % 2 else 2)
               for i in range(5)]
    _serve(device, clients)
    assert max(sizes) >= 2  # it died while a batch ran
    for i, client in enumerate(clients):
        assert client.finish == "error", f"client {i}: {client.finish}"
        failures = [item for item in client.items if isinstance(item, Failed)]
        assert len(failures) == 1 and "stage failed" in str(failures[0].error), client.items
    assert isinstance(pipe.errors[0], ConnectionError)
    assert pipeline_failed(engine)  # the runner's service then ends the group: it is placed anew


def test_a_members_consumer_failing_ends_it_alone_and_the_pipeline_serves_on(checkpoint, pipelined):
    """A consumer that raises (its client's stream broke) ends that request alone, at a step boundary, with
    every stage in step: a batch member mid-batch, a newcomer at its first token and a solo run each get their
    error, their caches are dropped on stage 0 too, the other members get their single-node solo output, the
    pipeline has not failed (the runner's service keeps the group: ``pipeline_failed``), and the next request
    through it is exact."""
    from exo.runner.device import Device, Failed

    engine, pipe = pipelined("qwen3_5", batch_prefill_chunk=64)  # the newcomers join in one step
    whole = _whole(checkpoint("qwen3_5", dtype="float32"))

    def breaks(client: _Client, at: int, device: Device, batched: bool) -> None:
        """``client``'s consumer raises at its ``at``-th chunk of output (``batched``: while others decode too)."""
        seen = [0]

        def emit(item) -> None:
            if hasattr(item, "token_ids") and (not batched or len(device.active) > 1):
                seen[0] += 1
                if seen[0] == at:
                    raise ConnectionError(f"client {id(client)}'s stream broke")
            client.items.append(item)

        client.job.emit = emit

    def check_broken(client: _Client) -> None:
        assert client.finish == "error", client.finish
        failures = [item for item in client.items if isinstance(item, Failed)]
        assert len(failures) == 1 and isinstance(failures[0].error, ConnectionError), client.items
        assert client.tokens == _solo_tokens(client)[: len(client.tokens)]

    def _solo_tokens(client: _Client) -> list[int]:
        from exo.engine import GenerationRequest

        return whole.complete(GenerationRequest(client.prompt, max_tokens=client.params.max_tokens,
                                                native_mtp="off")).token_ids

    sizes: list[int] = []
    device = Device(8, max_batch=4, on_batch=sizes.append)
    clients = [_Client(device, engine, i, 14, **p) for i, p in
               enumerate([dict(mtp_k=2), dict(native_mtp="off"), dict(native_mtp="off"), dict(mtp_k=1)])]
    breaks(clients[1], 3, device, batched=True)  # a member, mid-batch
    breaks(clients[3], 1, device, batched=True)  # a newcomer, at its first token
    _serve(device, clients)
    assert max(sizes) >= 3
    check_broken(clients[1])
    check_broken(clients[3])
    for client in (clients[0], clients[2]):
        assert client.finish == "length" and client.tokens == _solo_tokens(client)
    assert not pipeline_failed(engine) and not pipe.errors
    _no_slots_left(pipe)
    # A solo run's consumer breaks; then the next request: exact, through the same pipeline.
    device = Device(8, max_batch=4)
    alone = _Client(device, engine, 0, 12, native_mtp="off")
    breaks(alone, 2, device, batched=False)
    _serve(device, [alone])
    check_broken(alone)
    _no_slots_left(pipe)
    device = Device(8, max_batch=4)
    following = _Client(device, engine, 2, 12, mtp_k=2)
    _serve(device, [following])
    assert following.finish == "length" and following.tokens == _solo_tokens(following)
    assert not pipeline_failed(engine) and not pipe.errors
    _no_slots_left(pipe)


def test_a_wide_batch_through_three_stages_passes_its_op_records_and_ids_on(checkpoint, pipelined):
    """48 members at K = 3 over three stages (0 | 1 | 2-3): a round's ids follow its header to the first
    stage, and when members leave right after a round the op records (a rollback of 30-odd counts and a
    filter) outgrow the header and follow it too, passed on by the middle stage; every member stays exact."""
    engine, pipe = pipelined("qwen3_5", split=(1, 2, 4))
    sent: list[int] = []
    send = pipe.forward.link.send

    def spy(x, dst):
        sent.append(x.shape[0] if x.ndim == 1 and x.dtype == mx.int32 else 0)
        send(x, dst)

    pipe.forward.link.send = spy
    lengths: list[int] = []
    take = pipe.forward._take_ops

    def spy_ops():
        ops = take()
        lengths.append(sum(3 + len(op.args) for op in ops))
        return ops

    pipe.forward._take_ops = spy_ops
    specs = [dict(max_tokens=6 + (i % 3), mtp_k=3, native_mtp="on") for i in range(48)]
    requests = _requests(engine, specs)
    got = _drive(engine, requests, join_at=[0] * 48)
    _check(_whole(checkpoint("qwen3_5", dtype="float32")), requests, got, stages=3)
    from exo.engine.pipeline import HEADER_LEN, INLINE

    assert max(lengths) > INLINE  # some message's op records did not fit in its header...
    assert any(n > INLINE and n != HEADER_LEN for n in sent)  # ...and followed it
    # Every stage's memory figures reach the leader through the middle stage.
    from exo.engine.batch import stage_bytes
    from exo.engine.forward import cache_rates

    assert stage_bytes(engine) == [cache_rates(m) for m in (*pipe.stage_models, pipe.leader_model)]
    _no_slots_left(pipe)


def test_a_stage_that_does_not_lead_rolls_back_its_batched_attention_per_member(pipelined, monkeypatch):
    """exo-demo split 0-3 | 4-7 puts attention layer 3 on stage 0: its left-padded batch KV is rolled back per
    member (each one's rejected rows rolled into its left padding), filtered and extended there as on the
    leader, and every member's output is still its single-node solo output."""
    from exo.cards import bundled_model_dir

    stage_rollbacks: list[list[int]] = []  # the per-member kept counts stage 0 applied
    real = pipeline_module.keep_rows_per_sequence

    def spy(cache, rows, kept):
        if threading.current_thread() is not threading.main_thread():
            stage_rollbacks.append(list(kept))
        real(cache, rows, kept)

    monkeypatch.setattr(pipeline_module, "keep_rows_per_sequence", spy)
    path = bundled_model_dir("exo-demo")
    engine, pipe = pipelined("exo-demo", path=path, split=(4, 8))
    assert any(not layer.is_linear for layer in pipe.stage_model.stage_layers)  # attention on stage 0
    specs = [dict(max_tokens=m, mtp_k=k, native_mtp="on") for m, k in zip((24, 12, 18, 9, 20), (3, 2, 3, 1, 2),
                                                                            strict=True)]
    requests = _requests(engine, specs)
    got = _drive(engine, requests, join_at=[0, 0, 2, 3, 5])
    _check(_whole(path), requests, got)
    drafted = sum(s.drafted_tokens for _, _, _, s in got.values())
    accepted = sum(s.accepted_tokens for _, _, _, s in got.values())
    assert 0 < accepted < drafted  # rows were rejected, so rolled back per member on both stages
    assert any(len(set(kept)) > 1 for kept in stage_rollbacks)  # members kept different counts on stage 0
    _no_slots_left(pipe)


# -- the runner's service on a pipelined leader --------------------------------------------------------------


class _Call:
    """One Generate call on the runner's servicer, on a thread of its own (the call's gRPC context, the outer
    edge, is this object: it only takes the callbacks run when the call ends). ``on_chunk``: called with each
    chunk streamed."""

    def __init__(self, servicer, request, on_chunk=None) -> None:
        self.chunks: list = []
        self.callbacks: list = []
        self.on_chunk = on_chunk or (lambda chunk: None)
        self.ended = threading.Event()
        threading.Thread(target=self._run, args=(servicer, request), daemon=True).start()

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def _run(self, servicer, request) -> None:
        try:
            for chunk in servicer.Generate(request, self):
                if not chunk.heartbeat:
                    self.chunks.append(chunk)
                    self.on_chunk(chunk)
        finally:
            self.ended.set()

    @property
    def tokens(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.token_ids]

    @property
    def error(self):
        errors = [chunk.error for chunk in self.chunks if chunk.HasField("error")]
        assert len(errors) <= 1, errors
        return errors[0] if errors else None


def _leader_service(engine: Engine, device):
    """The runner's state and servicer of a pipelined leader (the last of two stages), ready with ``engine``."""
    from exo.runner.service import RunnerServicer, RunnerState
    from exo.wire.proto_gen import node_pb2 as pb

    state = RunnerState("pipelined", pb.Shard(start_layer=SPLIT[0], end_layer=SPLIT[1], rank=1, world_size=2))
    state.ready(pb.ModelSummary(model_id="qwen3_5"), engine)
    return state, RunnerServicer(state, device)


def _generate(engine: Engine, i: int, max_tokens: int, **fields):
    from exo.wire.proto_gen import node_pb2 as pb

    return pb.GenerateRequest(model="qwen3_5", token_ids=pb.TokenIds(ids=_prompt(engine, i)), max_tokens=max_tokens,
                              native_mtp="off", **fields)


def _serve_until_closed(device, seconds: float) -> None:
    """Serve on this thread until the device is closed (by what the test exercises); closed anyway after
    ``seconds`` so a test that fails does not hang."""
    watchdog = threading.Timer(seconds, device.close)
    watchdog.daemon = True
    watchdog.start()
    device.serve()
    watchdog.cancel()


def test_the_service_ends_the_group_when_a_stage_is_lost_mid_batch(pipelined):
    """Through the runner's service: stage 0 dies while a batch decodes and a request waits; every call, the
    waiting one too, gets a clear ``model_unavailable`` error (a stage was lost: retry), the group is marked
    broken (the runner exits ``EXIT_GROUP_LOST`` and the daemons place the instance anew) and the service
    closes the device itself."""
    from exo.runner.device import Device

    steps = [0]

    def die() -> None:
        steps[0] += 1
        if steps[0] == 30:
            raise ConnectionError("stage 0's machine went away")

    engine, pipe = pipelined("qwen3_5", on_step=die, batch_prefill_chunk=4)
    pipe.lost = True
    sizes: list[int] = []
    device = Device(8, max_batch=3, on_batch=sizes.append)
    state, servicer = _leader_service(engine, device)
    calls = [_Call(servicer, _generate(engine, i, 60)) for i in range(4)]
    _serve_until_closed(device, 120)  # the service closes it when the pipeline fails
    assert all(call.ended.wait(30) for call in calls)
    assert state.group_broken and max(sizes) >= 2
    started = [call for call in calls if call.chunks[0].HasField("started")]
    assert len(started) == 3, [call.chunks[0] for call in calls]
    for call in calls:
        assert call.error is not None and call.error.type == "model_unavailable", call.chunks
        assert "pipeline stage" in call.error.message, call.error
        assert ("mid-generation" if call in started else "before this request ran") in call.error.message


def test_the_service_keeps_the_group_when_it_shuts_down_with_requests_waiting(pipelined):
    """SIGTERM while a pipelined batch decodes and a request waits (``Device.close``): the waiting request gets
    its shutdown error and the running ones end cancelled, but nothing failed in the pipeline, so the group is
    not marked broken: the runner shuts the stages down in step (the fixture's ``close`` checks they return
    cleanly) instead of leaving them to find a lost link."""
    from exo.runner.device import Device

    engine, pipe = pipelined("qwen3_5", batch_prefill_chunk=4)
    device = Device(8, max_batch=2)
    state, servicer = _leader_service(engine, device)

    def close_once_one_waits(chunk) -> None:
        if device.waiting and len(device.active) == 2:  # two decode together, the third waits
            device.close()  # what the runner's SIGTERM handler does

    calls = [_Call(servicer, _generate(engine, i, 200), on_chunk=close_once_one_waits) for i in range(3)]
    _serve_until_closed(device, 120)
    assert all(call.ended.wait(30) for call in calls)
    finishes = sorted(call.chunks[-1].finish_reason or call.error.type for call in calls)
    assert finishes == ["cancelled", "cancelled", "model_unavailable"], [call.chunks[-1] for call in calls]
    waiting = next(call for call in calls if call.error is not None)
    assert "shutting down" in waiting.error.message and not waiting.tokens
    assert not state.group_broken and not pipeline_failed(engine)


def test_a_pipelined_batch_with_dense_batch_steps_decodes_as_the_single_node_batch(checkpoint, pipelined, monkeypatch):
    """``EXO_BATCH_DENSE=on:2`` on a 4-bit model: the stages and the leader decide by the call's shape alike (a
    batch step of 3 sequences runs dense on both stages, a member alone does not), so the pipelined batch gives
    every member the single node's batched tokens (on this CPU MLX's quantized product rounds far from the dense one,
    so a batch no longer gives its solo tokens: the single node's batch is the reference)."""
    from exo.engine.models import prompt_dense

    from .test_batch import _run_batch

    path = checkpoint("qwen3_5", layout="mlx_q4_sidecar", head="trained", dtype="bfloat16")
    monkeypatch.setenv("EXO_BATCH_DENSE", "on:2")
    single = Engine(dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset()),
                    EngineConfig(prefill_chunk=CHUNK))
    engine, pipe = pipelined("qwen3_5", path=path)
    ran: set[int] = set()  # the layers that ran dense
    real = prompt_dense.dense_weight
    monkeypatch.setattr(prompt_dense, "dense_weight", lambda m, d: ran.add(id(m)) or real(m, d))
    requests = _requests(engine, [dict(max_tokens=m, native_mtp="off") for m in (9, 5, 7)])
    want = _run_batch(single, requests)
    assert ran
    ran.clear()
    got = _drive(engine, requests, [0, 0, 0])
    for model in (pipe.stage_model, pipe.leader_model):  # each stage ran its batch steps dense
        assert ran & {id(m) for _, m in model.named_modules() if isinstance(m, prompt_dense.DenseRows)}
    for i in range(3):
        assert got[i][0] == want[i][0], i
