"""The runner's Generate stream (runner/service.py): the device thread only queues what a job emits; the
call's own thread turns it into messages, several chunks that are ready together in one message."""

from __future__ import annotations

import threading
import time

from exo.engine import GenerationRequest
from exo.engine.request import GenerationChunk, TokenLogprob
from exo.runner.device import Device, Failed, Started
from exo.runner.service import DONE, RunnerServicer, RunnerState, coalesced
from exo.wire.proto_gen import node_pb2 as pb
from tests.fixtures.engines import fresh_engine


def test_chunks_ready_together_become_one_and_nothing_else_moves():
    started, failed = Started(3, 8, 0.0), Failed(RuntimeError("x"))
    lp = [TokenLogprob(1, b"a", -0.5, ())]
    a = GenerationChunk("a", [1], None, None, lp)
    b = GenerationChunk("b", [2], None, None, None)
    end = GenerationChunk("c", [3], "length", None, None, "stop!")
    assert list(coalesced([started, a, b, end, DONE])) == [
        started, GenerationChunk("abc", [1, 2, 3], "length", None, lp, "stop!"), DONE]
    assert list(coalesced([a, failed])) == [a, failed]
    assert list(coalesced([a, b])) == [GenerationChunk("ab", [1, 2], None, None, lp)]
    assert list(coalesced([end, a])) == [end, a]  # nothing is joined across a finish


class _Call:
    """A Generate call on the servicer, read on a thread of its own after ``lag`` seconds (a consumer that
    falls behind); the call's context is this object."""

    def __init__(self, servicer: RunnerServicer, request: pb.GenerateRequest, lag: float = 0.0) -> None:
        self.messages: list[pb.GenerateChunk] = []
        self.callbacks: list = []
        self.ended = threading.Event()
        threading.Thread(target=self._run, args=(servicer, request, lag), daemon=True).start()

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def _run(self, servicer: RunnerServicer, request: pb.GenerateRequest, lag: float) -> None:
        try:
            for message in servicer.Generate(request, self):
                if not message.heartbeat:
                    self.messages.append(message)
                if message.HasField("started"):
                    time.sleep(lag)  # the generation runs on while this consumer waits
        finally:
            self.ended.set()


def _serve_one(checkpoint, *, lag: float = 0.0, interval: float = 0.0):
    """A 24-token greedy Generate call on a device thread of the tiny qwen3_5, read ``lag`` seconds late through a
    servicer whose stream interval is ``interval``: the engine, the prompt, the call's messages (heartbeats left
    out), and whether the device thread is still there (parked) after ``close``."""
    engine = fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False)
    device = Device(8, max_batch=4)
    state = RunnerState("solo", pb.Shard(start_layer=0, end_layer=0, rank=0, world_size=1))
    state.ready(pb.ModelSummary(model_id="qwen3_5"), engine)
    prompt = engine.loaded.tokenizer.encode("The quick brown fox")
    request = pb.GenerateRequest(model="qwen3_5", token_ids=pb.TokenIds(ids=prompt), max_tokens=24, native_mtp="off")
    thread = device.start_thread()
    try:
        call = _Call(RunnerServicer(state, device, stream_interval_s=interval), request, lag=lag)
        assert call.ended.wait(120)
    finally:
        device.close(10)
    return engine, prompt, call.messages, thread.is_alive()


def test_a_consumer_that_lags_gets_the_tokens_so_far_in_one_message(checkpoint):
    engine, prompt, messages, parked = _serve_one(checkpoint, lag=2.0)
    assert parked  # the device thread, as it is meant to be
    first, *outputs = messages
    assert first.HasField("started") and first.started.prompt_tokens == len(prompt)
    tokens = [t for m in outputs for t in m.token_ids]
    assert tokens == engine.complete(GenerationRequest(prompt, max_tokens=24, native_mtp="off")).token_ids
    # The generation ended while the consumer slept: what followed the first token came in one message.
    assert len(outputs) <= 3, [list(m.token_ids) for m in outputs]
    assert outputs[-1].finish_reason == "length" and outputs[-1].native_mtp_json


def test_a_paced_stream_sends_its_first_token_at_once_and_the_rest_with_its_end(checkpoint):
    """With an interval longer than the whole generation (``stream_interval_s``), the device thread wakes the call
    for the first token and for the last chunk only: two messages of tokens, the engine's tokens between them."""
    engine, prompt, messages, _ = _serve_one(checkpoint, interval=600.0)
    first, *outputs = messages
    assert first.HasField("started")
    assert [len(m.token_ids) for m in outputs] == [1, 23], [list(m.token_ids) for m in outputs]
    tokens = [t for m in outputs for t in m.token_ids]
    assert tokens == engine.complete(GenerationRequest(prompt, max_tokens=24, native_mtp="off")).token_ids
    assert outputs[-1].finish_reason == "length"
