"""The device queue with batching, on a genuine tiny checkpoint: generations waiting together decode as
one batch (each gets its solo output), FIFO around generations that cannot batch, cancellation of one
member, and the queue bound while a batch runs."""

from __future__ import annotations

import pytest

from exo.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, load_checkpoint
from exo.engine.batch import batch_bytes, sequence_bytes
from exo.engine.prompt import GenerateParams, Prompt
from exo.runner.device import Device, Failed, GenerationJob, QueueFullError, Started
from tests.fixtures.engines import fresh_engine, watch_prefill_together

TEXTS = ("def fibonacci(n):\n    if n < 2:", "The quick brown fox", "import numpy as np\nx = np.", "1, 2, 3,")


def _engine(path) -> Engine:
    # fixed-length outputs; prompts cross prefill chunks, solo and (smaller) joining a batch
    return fresh_engine(path, eos=False, prefill_chunk=8, batch_prefill_chunk=4)


@pytest.fixture
def engine(checkpoint) -> Engine:
    return _engine(checkpoint("qwen3_5", dtype="float32"))


@pytest.fixture
def roomy(checkpoint) -> Engine:
    """Prefill budgets that take every prompt here at once: the four waiting ones are admitted in one step."""
    return fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False, prefill_chunk=128, batch_prefill_chunk=64)


class Client:
    """One generation job and what it received."""

    def __init__(self, device: Device, engine: Engine, i: int, *, max_tokens: int = 12, hook=None, batch_key: str = "",
                 **params):
        self.engine = engine
        self.prompt = engine.loaded.tokenizer.encode(TEXTS[i % len(TEXTS)])
        self.params = GenerateParams(max_tokens=max_tokens, default_max_tokens=max_tokens, **params)
        self.items: list = []
        self.finish: str | None = None
        self.stats = None
        self.job = GenerationJob(
            device, lambda: engine, Prompt(token_ids=self.prompt), self.params, self.items.append,
            timeout_s=600, on_done=self._done, step_hook=hook, batch_key=batch_key,
        )

    def _done(self, finish, stats, queue_s, device_s) -> None:
        self.finish, self.stats = finish, stats

    @property
    def tokens(self) -> list[int]:
        return [t for item in self.items if hasattr(item, "token_ids") for t in item.token_ids]

    def solo(self) -> list[int]:
        request = GenerationRequest(
            self.prompt, max_tokens=self.params.max_tokens, sampling=self.params.sampling, native_mtp="off"
        )
        return self.engine.complete(request).token_ids


def _serve(device: Device, clients: list[Client]) -> None:
    """Serve on this thread until every client's job has ended."""
    for client in clients:
        done = client._done

        def on_done(*args, done=done) -> None:
            done(*args)
            if all(c.finish is not None for c in clients):
                device.close()

        client.job.on_done = on_done
    device.serve()


def test_waiting_generations_decode_as_one_batch_with_their_solo_output(roomy):
    engine = roomy
    sizes: list[int] = []
    device = Device(8, max_batch=4, on_batch=sizes.append)
    samplings = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams(presence_penalty=1.0),
                 SamplingParams(), SamplingParams(temperature=0.7, seed=4)]
    # Seeded sampling reproduces plain sampling's samples where the batch decodes plainly (with drafts, the
    # solo MTP samples at the same depths: the next test), so those two leave MTP off.
    clients = [
        Client(device, engine, i, max_tokens=10 + i, sampling=s, native_mtp="auto" if s.greedy else "off")
        for i, s in enumerate(samplings)
    ]
    for client in clients:
        device.submit(client.job)
    _serve(device, clients)
    for i, client in enumerate(clients):
        assert isinstance(client.items[0], Started)
        assert client.finish == "length", client.items
        assert client.tokens == client.solo(), f"client {i}"
        # The first four decoded together; the fifth joined when one left (and may have ended alone: a lone
        # member's tokens are no batch's).
        assert client.stats.batch_sizes or i == 4, f"client {i} never ran in a batch"
    # The four that waited were admitted and prefilled in the first step: they decoded together from it.
    assert sizes[0] == 4 and max(sizes) == 4 and device.generations == 5 and device.snapshot()["running"] == 0
    assert max(clients[4].stats.batch_sizes, default=1) <= 4


def test_generations_admitted_in_one_step_prefill_as_rows_of_one_call(roomy, monkeypatch):
    """Waiting generations whose prompts fit the step's budget are admitted in one step and prefill as rows of
    one backbone call (``engine.batch_prefill``); a prompt longer than what is left of the budget prefills in
    chunks of its own. Every one gets its solo output."""

    engine = roomy
    groups = watch_prefill_together(monkeypatch)
    device = Device(8, max_batch=8, on_batch=(sizes := []).append)
    clients = [Client(device, engine, i, max_tokens=12, native_mtp="off") for i in range(5)]
    clients[4].prompt = engine.loaded.tokenizer.encode(TEXTS[0] * 8)  # > 128 tokens: its own chunks
    clients[4].job.prompt = Prompt(token_ids=clients[4].prompt)
    for client in clients:
        device.submit(client.job)
    _serve(device, clients)
    assert groups == [4] and sizes[0] == 4
    for i, client in enumerate(clients):
        assert client.finish == "length" and client.tokens == client.solo(), f"client {i}"


def test_waiting_generations_with_native_mtp_run_batched_rounds(roomy):
    """Generations that draft (a forced depth here; adaptive ones as their batch size pays) keep drafting in
    the batch: one verify call for all, each member's own verdict. Greedy members get their solo plain
    tokens, a seeded one its solo MTP samples."""
    engine = roomy
    sizes: list[int] = []
    device = Device(8, max_batch=4, on_batch=sizes.append)
    samplings = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams(presence_penalty=1.0),
                 SamplingParams()]
    clients = [Client(device, engine, i, max_tokens=14 + i, sampling=s, mtp_k=2) for i, s in enumerate(samplings)]
    for client in clients:
        device.submit(client.job)
    _serve(device, clients)
    for i, client in enumerate(clients):
        assert client.finish == "length", client.items
        if client.params.sampling.greedy:
            assert client.tokens == client.solo(), f"client {i}"
        else:
            request = GenerationRequest(client.prompt, max_tokens=client.params.max_tokens,
                                        sampling=client.params.sampling, mtp_k=2)
            assert client.tokens == engine.complete(request).token_ids, f"client {i}"
        stats = client.stats
        assert stats.batch_sizes and stats.rounds > 0 and stats.reason is None, f"client {i}"
    assert max(sizes) == 4


def test_generations_that_cannot_batch_keep_fifo_order(engine):
    device = Device(8, max_batch=4)
    order: list[int] = []
    clients = [
        Client(device, engine, 0, hook=lambda job: order.append(0)),
        Client(device, engine, 1, batch_key="another model", hook=lambda job: order.append(1)),  # alone
        Client(device, engine, 2, hook=lambda job: order.append(2)),
    ]
    for client in clients:
        device.submit(client.job)
    _serve(device, clients)
    # Nothing batched: the one at the head of the queue could not join, so each ran alone, in order.
    assert [c.stats.batch_sizes for c in clients] == [{}, {}, {}]
    assert order == sorted(order)
    assert [c.tokens for c in clients] == [c.solo() for c in clients]


def test_constrained_and_logprob_generations_arriving_later_join_the_running_batch(checkpoint):
    """What coding agents send (a forced tool call / a JSON schema) and a logprobs request, arriving while
    others decode, join their batch instead of waiting for it to drain; each gets its solo output."""
    from exo.engine.constraints import ConstraintSpec
    from exo.engine.prompt import generation_request

    engine = Engine(load_checkpoint(checkpoint("qwen3_5", dtype="float32")), EngineConfig(prefill_chunk=8, batch_prefill_chunk=4))
    device = Device(8, max_batch=4, on_batch=(sizes := []).append)
    schema = ConstraintSpec(json_schema={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    late: list[Client] = []

    def arrive(job: GenerationJob) -> None:
        if job.steps == 3 and not late:  # the first two decode together by now
            late.extend([Client(device, engine, 2, max_tokens=30, constraint=schema, native_mtp="off"),
                         Client(device, engine, 3, max_tokens=12, logprobs=2, native_mtp="off", ignore_eos=True)])
            for client in late:
                device.submit(client.job)
                watch(client)

    clients = [Client(device, engine, 0, max_tokens=40, hook=arrive, native_mtp="off", ignore_eos=True),
               Client(device, engine, 1, max_tokens=40, native_mtp="off", ignore_eos=True)]

    def watch(client: Client) -> None:
        done = client.job.on_done

        def on_done(*args) -> None:
            done(*args)
            if all(c.finish is not None for c in clients + late):
                device.close()

        client.job.on_done = on_done

    for client in clients:
        device.submit(client.job)
        watch(client)
    device.serve()
    assert len(late) == 2 and max(sizes) == 4
    for i, client in enumerate(clients + late):
        request = generation_request(engine, Prompt(token_ids=client.prompt), client.params, None)
        solo = engine.complete(request)
        assert client.finish == solo.finish_reason and client.tokens == solo.token_ids, f"client {i}"
        assert max(client.stats.batch_sizes) == 4, f"client {i} decoded in the batch of four"
    assert late[0].finish == "stop"  # the grammar ended it
    lps = [e for item in late[1].items if getattr(item, "logprobs", None) for e in item.logprobs]
    assert [e.logprob for e in lps] == [e.logprob for e in engine.complete(
        generation_request(engine, Prompt(token_ids=late[1].prompt), late[1].params, None)).logprobs]


def test_cancelling_one_member_leaves_the_batch_running(engine):
    device = Device(8, max_batch=4)

    def cancel_at_step_5(job: GenerationJob) -> None:
        if job.steps == 5:
            job.cancel()

    clients = [Client(device, engine, 0, max_tokens=16), Client(device, engine, 1, max_tokens=16, hook=cancel_at_step_5),
               Client(device, engine, 2, max_tokens=16)]
    for client in clients:
        device.submit(client.job)
    _serve(device, clients)
    assert clients[1].finish == "cancelled"
    cancelled = clients[1].tokens
    assert 0 < len(cancelled) < 16 and cancelled == clients[1].solo()[: len(cancelled)]
    for client in (clients[0], clients[2]):
        assert client.finish == "length" and client.tokens == client.solo()


def test_a_member_whose_client_goes_away_frees_its_row_at_the_next_step(roomy):
    """A client that disconnects mid-batch (its call's end cancels its job) leaves before the next step: that
    step is one row smaller, and the others decode on to their solo output."""
    engine = roomy
    sizes: list[int] = []

    def stepped(size: int) -> None:
        sizes.append(size)
        if len(sizes) == 5:
            clients[1].job.cancel()  # between two steps, as the gRPC call's end does from its thread

    device = Device(8, max_batch=4, on_batch=stepped)
    clients = [Client(device, engine, i, max_tokens=20, native_mtp="off") for i in range(3)]
    for client in clients:
        device.submit(client.job)
    _serve(device, clients)
    assert sizes[:6] == [3, 3, 3, 3, 3, 2]
    cancelled = clients[1].tokens
    assert clients[1].finish == "cancelled" and 0 < len(cancelled) < 20 and cancelled == clients[1].solo()[: len(cancelled)]
    for client in (clients[0], clients[2]):
        assert client.finish == "length" and client.tokens == client.solo()


def test_queue_bound_while_a_batch_runs(engine):
    device = Device(2, max_batch=2)
    clients: list[Client] = []
    late: list[Client] = []
    refused: list[BaseException] = []

    def submit_more(job: GenerationJob) -> None:
        # On the device thread, once two decode together: two more wait (the queue holds two), the
        # next is refused at once.
        if late or len(device.active) < 2:
            return
        late.extend([Client(device, engine, 2, max_tokens=6), Client(device, engine, 3, max_tokens=9)])
        for client in late:
            device.submit(client.job)
            clients.append(client)
            watch(client)
        try:
            device.submit(Client(device, engine, 0).job)
        except QueueFullError as e:
            refused.append(e)
        assert device.snapshot() == {"queue_depth": 2, "running": 2, "generations": 0}

    def watch(client: Client) -> None:
        done = client.job.on_done

        def on_done(*args) -> None:
            done(*args)
            if all(c.finish is not None for c in clients):
                device.close()

        client.job.on_done = on_done

    clients += [Client(device, engine, 0, hook=submit_more), Client(device, engine, 1)]
    for client in clients:
        device.submit(client.job)
    _serve(device, clients)
    assert len(refused) == 1 and refused[0].retry_after_s >= 1
    # The ones that waited ran when members left, with their solo output (together, or one alone once the
    # other ended: a lone member's tokens are no batch's).
    assert len(clients) == 4
    for i, client in enumerate(clients):
        assert client.finish == "length" and client.tokens == client.solo()
        assert (client.stats.batch_sizes or i >= 2) and max(client.stats.batch_sizes, default=1) <= 2
    assert not any(isinstance(item, Failed) for c in clients for item in c.items)


def test_batch_bytes_pads_every_row_to_the_longest_and_counts_each_state():
    assert batch_bytes([], 10, 100) == 0
    assert batch_bytes([50], 10, 100) == 600
    assert batch_bytes([50, 20, 30], 10, 100) == 3 * (50 * 10 + 100)


def test_kv_budget_keeps_generations_that_do_not_fit_waiting_and_the_queue_bound_refuses(engine):
    """A budget for two of these generations: two decode together while the others wait in the queue
    (FIFO), the queue bound refuses one more at once, and every one still gets its solo output."""
    per_token, per_sequence = sequence_bytes(engine)
    assert per_token > 0 and per_sequence > 0  # the fixture has attention KV and GatedDeltaNet states
    device = Device(2, max_batch=8, on_batch=(sizes := []).append)
    late: list[Client] = []
    waiting: list[int] = []
    refused: list[BaseException] = []

    def submit_more(job: GenerationJob) -> None:
        # On the device thread, once two decode together: two more wait, the next one is refused.
        if len(device.active) < 2:
            return
        if late:
            waiting.append(device.snapshot()["queue_depth"])
            return
        late.extend(clients[2:])
        for client in late:
            device.submit(client.job)
        try:
            device.submit(Client(device, engine, 0).job)
        except QueueFullError as e:
            refused.append(e)

    clients = [Client(device, engine, 0, hook=submit_more)] + [Client(device, engine, i) for i in (1, 2, 3)]
    horizons = [len(c.prompt) + 12 for c in clients]
    two = max(batch_bytes([a, b], per_token, per_sequence) for a in horizons for b in horizons)
    three = batch_bytes(sorted(horizons)[:3], per_token, per_sequence)
    device.kv_budget_tokens = -(-two // per_token)  # room for any two, never for three
    assert device.kv_budget_tokens * per_token < three
    for client in clients[:2]:
        device.submit(client.job)
    _serve(device, clients)
    assert len(refused) == 1 and late
    assert waiting and waiting[0] == 2  # with room in max_batch, the budget kept them in the queue
    assert max(sizes) == 2
    for i, client in enumerate(clients):
        assert client.finish == "length" and client.tokens == client.solo(), f"client {i}"
        assert client.stats.batch_sizes and max(client.stats.batch_sizes) <= 2, f"client {i}"


def test_a_generation_larger_than_the_kv_budget_still_runs_alone(engine):
    device = Device(8, max_batch=8, kv_budget_tokens=1)
    clients = [Client(device, engine, i) for i in range(3)]
    for client in clients:
        device.submit(client.job)
    _serve(device, clients)
    assert [c.stats.batch_sizes for c in clients] == [{}, {}, {}]
    assert [c.tokens for c in clients] == [c.solo() for c in clients]


def test_a_newcomer_prefills_in_batch_chunks_with_a_batch_step_between_them(engine, monkeypatch):
    """A generation joining a running batch prefills in chunks of ``batch_prefill_chunk`` tokens (smaller than
    a solo prefill's), and the batch decodes a step between two chunks: a long prompt holds the running
    streams for a chunk at a time. Every output is still its solo one."""
    from exo.engine.sequence import SequenceState

    device = Device(8, max_batch=4)

    def arrive(job: GenerationJob) -> None:
        if job.tokens == 2 and not arrived:  # the newcomer arrives while the first decodes
            arrived.append(1)
            device.submit(clients[1].job)

    arrived: list[int] = []
    # The running member decodes plainly (a token a step) and long enough to outlast the newcomer's prefill.
    clients = [Client(device, engine, 0, max_tokens=120, native_mtp="off", hook=arrive),
               Client(device, engine, 1, max_tokens=6)]
    clients[1].prompt = engine.loaded.tokenizer.encode(TEXTS[2] * 3)  # 4 x 4 tokens at least
    clients[1].job.prompt = Prompt(token_ids=clients[1].prompt)
    chunks: list[int | None] = []
    steps_between: list[int] = []  # the running member's step count at each of the newcomer's chunk ends
    original = SequenceState.prefill

    def prefill(self, chunk=None):
        if self.request.prompt_tokens == clients[1].prompt and not serving_done:
            chunks.append(chunk)
            for positions in original(self, chunk):
                steps_between.append(clients[0].job.steps)
                yield positions
        else:
            yield from original(self, chunk)

    monkeypatch.setattr(SequenceState, "prefill", prefill)
    serving_done = False
    device.submit(clients[0].job)
    _serve(device, clients)
    serving_done = True
    for client in clients:
        assert client.finish == "length" and client.tokens == client.solo()
    assert chunks == [engine.config.batch_prefill_chunk]
    assert len(steps_between) >= len(clients[1].prompt) // 4 - 1 >= 3
    assert all(b > a for a, b in zip(steps_between, steps_between[1:], strict=False)), steps_between


def test_a_running_stream_waits_at_most_one_step_budget_of_prefill_whatever_arrives(engine, monkeypatch):
    """Newcomers with long prompts keep arriving while a stream decodes: between two of its decode steps the
    device prefills at most one step's budget (``batch_prefill_chunk`` tokens) of all of theirs together, so
    the stream never stalls behind them; every newcomer still gets in (FIFO) and every output is its solo one."""
    budget = engine.config.batch_prefill_chunk
    calls: list[int] = []  # the tokens of every backbone call; -1 after each decode step of the batch
    hidden = engine.forward.hidden

    def watched(tokens, cache, **kw):
        calls.append(int(tokens.shape[0]) * int(tokens.shape[1]))
        return hidden(tokens, cache, **kw)

    monkeypatch.setattr(engine.forward, "hidden", watched)
    device = Device(16, max_batch=8, on_batch=lambda size: calls.append(-1))
    late: list[Client] = []

    def arrive(job: GenerationJob) -> None:
        if 2 <= job.steps <= 7 and len(late) < job.steps - 1:  # a newcomer at each of its steps 2..7
            client = Client(device, engine, len(late), max_tokens=6, native_mtp="off")
            client.prompt = engine.loaded.tokenizer.encode(TEXTS[len(late) % len(TEXTS)] * 3)
            client.job.prompt = Prompt(token_ids=client.prompt)
            late.append(client)
            device.submit(client.job)
            watch(client)

    clients = [Client(device, engine, 0, max_tokens=80, native_mtp="off", hook=arrive)]

    def watch(client: Client) -> None:
        done = client.job.on_done

        def on_done(*args) -> None:
            done(*args)
            if all(c.finish is not None for c in clients + late):
                device.close()

        client.job.on_done = on_done

    watch(clients[0])
    device.submit(clients[0].job)
    device.serve()
    assert len(late) == 6
    # Each step's calls are its prefill chunks, then its decode step's (the last before the -1): from the first
    # step on (before it nothing decodes, and the first stream's prefill has the idle budget), a step's chunks
    # hold at most the step budget.
    steps = " ".join(map(str, calls)).split(" -1")
    assert len(steps) > 20
    for step in steps[1:-1]:
        tokens = [int(t) for t in step.split()]
        assert sum(tokens[:-1]) <= budget, calls
    for client in clients + late:
        assert client.finish == "length" and client.tokens == client.solo()


def _serve_within(device: Device, clients: list[Client], seconds: float) -> None:
    """``_serve`` on a thread, given ``seconds`` for every client to end (a member left hanging fails the test
    instead of hanging it)."""
    import threading

    thread = threading.Thread(target=_serve, args=(device, clients), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        device.close()
        thread.join(60)
    assert all(c.finish is not None for c in clients), [c.finish for c in clients]


def test_a_member_whose_stream_breaks_fails_alone_and_the_others_finish(engine):
    """A member's consumer raising (its client's stream broke) ends that member with an error; the batch
    decodes on without it and every other member gets its solo output and its end."""
    from exo.engine.request import GenerationChunk

    device = Device(8, max_batch=4)
    clients = [Client(device, engine, i, max_tokens=16) for i in range(3)]
    broken = clients[1]
    received: list[GenerationChunk] = []

    def emit(item) -> None:
        if isinstance(item, GenerationChunk) and broken.job in device.active and len(device.active) > 1:
            received.append(item)
            if len(received) == 3:
                raise ConnectionError("the client went away")
        broken.items.append(item)

    broken.job.emit = emit
    for client in clients:
        device.submit(client.job)
    _serve_within(device, clients, 120)
    assert broken.finish == "error" and any(isinstance(item, Failed) for item in broken.items)
    for client in (clients[0], clients[2]):
        assert client.finish == "length" and client.tokens == client.solo()
        assert client.stats.batch_sizes and max(client.stats.batch_sizes) >= 2


@pytest.mark.parametrize("how", ["cancelled", "timeout"])
def test_a_request_stopped_during_the_engine_s_warm_up_ends_before_it_starts(checkpoint, monkeypatch, how):
    """The first adaptive request waits on the engine's warm-up (round costs, warm acceptance): its
    cancellation and deadline are polled through it, and end it there, with nothing of it generated and the
    warm-up not kept (the next request warms up again)."""
    from exo.engine import costs as costs_module
    from exo.wire.errors import RequestTimeoutError

    engine = Engine(_engine(checkpoint("qwen3_5", dtype="float32")).loaded, EngineConfig(prefill_chunk=8))
    device = Device(8)
    client = Client(device, engine, 0)
    measure = costs_module.measure_costs

    def measured_while_the_client_leaves(*args, **kwargs):
        out = measure(*args, **kwargs)
        if how == "cancelled":
            client.job.cancel()
        else:
            client.job.deadline = 0.0
        return out

    monkeypatch.setattr(costs_module, "measure_costs", measured_while_the_client_leaves)
    device.submit(client.job)
    _serve_within(device, [client], 120)
    assert client.finish == how
    assert not any(isinstance(item, Started) for item in client.items) and client.tokens == []
    if how == "timeout":
        assert [type(item.error) for item in client.items] == [RequestTimeoutError]
    assert engine._policy is None and client.job.steps == 0


def test_a_prompt_goes_into_the_prefix_cache_after_its_first_token_is_out(checkpoint):
    """The prompt's blocks and snapshots are copied and stored once the first token is emitted (their copies
    and the tiers' puts are no part of the time to the first token), before any decode step moves the caches
    on: the next request restores them and answers as a cold engine does."""
    from exo.engine import prefix_cache as pc

    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    emitted: list[int] = []  # tokens the job had emitted at each put

    class Watching(pc.MemoryStore):
        def put(self, key, arrays, group=None):
            emitted.append(sum(len(getattr(item, "token_ids", ())) for item in items))
            return super().put(key, arrays, group)

    loaded = engine.loaded
    engine.prefix_cache = pc.PrefixCache(Watching(1 << 30), pc.namespace(loaded), block_tokens=8, stride_tokens=0,
                                         min_snapshot_tokens=4)
    prompt = loaded.tokenizer.encode(" ".join(TEXTS) * 2)
    device = Device(max_queue=4, max_batch=4)
    items: list = []
    ends: list[str] = []

    def job(tokens: list[int], sink: list) -> GenerationJob:
        params = GenerateParams(max_tokens=6, default_max_tokens=6, native_mtp="off")
        return GenerationJob(device, lambda: engine, Prompt(token_ids=tokens), params, sink.append, timeout_s=600,
                             on_done=lambda finish, *_: (ends.append(finish), device.close()))

    device.submit(job(prompt, items))
    device.serve()
    assert ends == ["length"] and len(prompt) // 8 >= 2
    assert emitted and min(emitted) >= 1  # every put came after the first token was out
    cold = fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False, prefill_chunk=8)
    extended = prompt + loaded.tokenizer.encode(" and then some more text")
    again: list = []
    device = Device(max_queue=4, max_batch=4)
    device.submit(job(extended, again))
    device.serve()
    tokens = [t for item in again if hasattr(item, "token_ids") for t in item.token_ids]
    stats = [item.stats for item in again if getattr(item, "stats", None) is not None][-1]
    assert stats.cached_tokens > 0
    request = GenerationRequest(extended, max_tokens=6, sampling=SamplingParams(temperature=0.0), native_mtp="off")
    assert tokens == cold.complete(request).token_ids
