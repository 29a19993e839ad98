"""Many clients at once, cancellation by disconnect, the bounded queue, timeouts, failures mid-stream."""

from __future__ import annotations

import threading
import time

import httpx2 as httpx
import openai
import pytest

from .conftest import sse_events

LONG = "0 0 0"  # the fixture model repeats "22, 22, ..." after this prompt: no EOS for thousands of tokens
PROMPTS = ["0 0 0", "a b c d", "The", "1, 2, 3,", "Once upon a time", "def fibonacci(n):"]


def _running(server) -> bool:
    return server.service.status()["running"] >= 1


EXTRA_PROMPTS = ("x = [", "import os", "Dear Sir,", "7 8 9", "The capital of", "while True:", "# TODO", "<html>")


def test_concurrent_streams_equal_their_solo_output(server, reference):
    # Prompts whose solo outputs all differ, so that mixed-up streams would show (which prompts a fixture
    # answers alike depends on the fixture: pick them from a pool).
    solo_of: dict[str, str] = {}
    for prompt in [*PROMPTS, *EXTRA_PROMPTS]:
        text = reference(reference.tokenizer.encode(prompt), max_tokens=24).text
        if text not in solo_of.values():
            solo_of[prompt] = text
    assert len(solo_of) >= 5, solo_of
    prompts, solo = list(solo_of)[:6], list(solo_of.values())[:6]
    results: dict[int, str] = {}
    barrier = threading.Barrier(len(prompts))
    client = server.openai()

    def run(i: int) -> None:
        barrier.wait()
        stream = client.completions.create(
            model=server.model, prompt=prompts[i], temperature=0, max_tokens=24, stream=True
        )
        results[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results.get(i) for i in range(len(prompts))] == solo


def test_requests_waiting_together_decode_as_one_batch(make_server, model_dir, reference):
    prompts = PROMPTS[:4]
    solo = [reference(reference.tokenizer.encode(p), max_tokens=16).text for p in prompts]
    released = threading.Event()
    holder: dict[str, object] = {}

    def hold_first(job) -> None:
        # The first generation waits on the device until the other three are queued: then they all
        # decode together (the first one hands over to the batch at its next step).
        if not released.is_set():
            srv = holder["server"]
            deadline = time.monotonic() + 30
            while srv.service.status()["queue_depth"] < len(prompts) - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            released.set()

    srv = make_server(model_dir, service_kwargs={"step_hook": hold_first})
    holder["server"] = srv
    results: dict[int, dict] = {}

    def run(i: int) -> None:
        with srv.http() as http:
            body = {"prompt": prompts[i], "temperature": 0, "max_tokens": 16}
            results[i] = http.post("/v1/completions", json=body).json()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
        if not holder.get("first"):
            srv.wait_for(lambda: _running(srv))  # the first one is on the device before the others queue
            holder["first"] = True
    for t in threads:
        t.join(60)
    assert [results[i]["choices"][0]["text"] for i in range(len(prompts))] == solo
    for i in range(len(prompts)):
        mtp = results[i]["usage"]["native_mtp"]
        assert max(int(size) for size in mtp["batch_sizes"]) == len(prompts), mtp
        # Native MTP ran inside the batch (rounds counted), or the stats say why the batch decoded plainly.
        assert mtp["rounds"] > 0 or "batch" in mtp["reason"], mtp
    tokens = sum(r["usage"]["completion_tokens"] for r in results.values())
    assert srv.metric("exo_batch_size_count") == tokens
    assert srv.metric("exo_batch_size_bucket", le="1.0") < tokens
    with srv.http() as http:
        health = http.get("/health").json()
    assert health["running"] == 0 and health["queue_depth"] == 0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnect_cancels_the_generation_within_one_round(server, stream):
    before = server.metric("exo_generations_total", finish_reason="cancelled")
    seen = len(server.service.history)
    client = server.openai(timeout=1.0)
    if stream:
        response = client.completions.create(
            model=server.model, prompt=LONG, temperature=0, max_tokens=20000, stream=True
        )
        for _, _chunk in zip(range(5), response, strict=False):
            pass
        response.close()  # the client goes away mid-stream
    else:
        with pytest.raises(openai.APITimeoutError):  # the client gives up after 1 s
            client.completions.create(model=server.model, prompt=LONG, temperature=0, max_tokens=20000)
    server.wait_for(lambda: len(server.service.history) > seen and not _running(server))
    record = server.service.history[-1]
    assert record.finish_reason == "cancelled"
    assert record.completion_tokens < 5000
    # One plain step or one speculative round (at most max_k + 1 = 4 tokens) after cancel().
    assert record.tokens_at_cancel is not None
    assert record.completion_tokens - record.tokens_at_cancel <= 4
    # Within one round is the token bound above; in time, well under the minutes the 20000 tokens would take.
    assert record.cancel_latency_s < 10.0
    assert server.metric("exo_generations_total", finish_reason="cancelled") == before + 1
    # The device is free: the next request is served at once.
    after = server.openai().completions.create(model=server.model, prompt="The", temperature=0, max_tokens=4)
    assert after.usage.completion_tokens >= 1


def test_a_full_queue_answers_429_with_retry_after(make_server, model_dir):
    # One at a time (no batching): the second request waits in the queue.
    srv = make_server(model_dir, env={"EXO_MAX_QUEUE": "1", "EXO_MAX_BATCH": "1"})
    client = srv.openai()
    running = client.completions.create(model=srv.model, prompt=LONG, temperature=0, max_tokens=20000, stream=True)
    next(iter(running))  # on the device now
    queued: dict[str, object] = {}
    waiter = threading.Thread(
        target=lambda: queued.setdefault(
            "response", client.completions.create(model=srv.model, prompt="The", temperature=0, max_tokens=4)
        )
    )
    waiter.start()
    srv.wait_for(lambda: srv.service.status()["queue_depth"] == 1)
    with srv.http() as http:
        response = http.post("/v1/completions", json={"prompt": "The", "max_tokens": 4})
        assert response.status_code == 429
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"]["code"] == "queue_full"
        assert srv.metric("exo_queue_depth") == 1
    running.close()
    waiter.join(30)
    assert queued["response"].choices[0].finish_reason in ("stop", "length")  # FIFO: it ran next


def test_request_timeout(make_server, model_dir):
    srv = make_server(model_dir, env={"EXO_REQUEST_TIMEOUT_S": "0.5"})
    with srv.http() as http:
        start = time.monotonic()
        response = http.post("/v1/completions", json={"prompt": LONG, "max_tokens": 20000, "temperature": 0})
        assert response.status_code == 408
        assert response.json()["error"]["code"] == "request_timeout"
        assert time.monotonic() - start < 5
        with http.stream(
            "POST", "/v1/completions", json={"prompt": LONG, "max_tokens": 20000, "temperature": 0, "stream": True}
        ) as stream:
            assert stream.status_code == 200
            events = sse_events(stream)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "request_timeout"
    assert any("choices" in e for e in events[:-2])  # the text before the timeout was delivered
    srv.wait_for(lambda: not _running(srv))
    assert srv.service.history[-1].finish_reason == "timeout"
    assert srv.metric("exo_generations_total", finish_reason="timeout") == 2


def test_a_failure_mid_stream_ends_the_stream_with_an_error_event(make_server, model_dir):
    armed = threading.Event()

    def device_failure(job) -> None:
        # A real failure inside the engine's decode loop (what a device error looks like to the server).
        if armed.is_set() and job.steps == 4:
            armed.clear()
            raise RuntimeError("device lost")

    srv = make_server(model_dir, service_kwargs={"step_hook": device_failure})
    armed.set()
    with srv.http() as http:
        with http.stream(
            "POST", "/v1/completions", json={"prompt": LONG, "max_tokens": 200, "temperature": 0, "stream": True}
        ) as stream:
            events = sse_events(stream)
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["type"] == "server_error" and "device lost" in error["message"]
        assert any("choices" in e for e in events[:-2])
        armed.set()
        response = http.post("/v1/completions", json={"prompt": LONG, "max_tokens": 200, "temperature": 0})
        assert response.status_code == 500 and "device lost" in response.json()["error"]["message"]
        # The server keeps serving.
        ok = http.post("/v1/completions", json={"prompt": "The", "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200
    assert srv.metric("exo_generations_total", finish_reason="error") == 2
    with pytest.raises(openai.APIError, match="device lost"):
        armed.set()
        for _ in srv.openai().completions.create(
            model=srv.model, prompt=LONG, max_tokens=200, temperature=0, stream=True
        ):
            pass


def test_slow_reader_does_not_block_others(server, reference):
    # A client that reads nothing keeps its own stream buffered; another client is served meanwhile.
    expected = reference(reference.tokenizer.encode("The"), max_tokens=8).text
    with httpx.Client(base_url=server.url, timeout=30) as http, http.stream(
        "POST", "/v1/completions", json={"prompt": "a b c d", "max_tokens": 64, "temperature": 0, "stream": True}
    ) as idle:
        other = server.openai().completions.create(model=server.model, prompt="The", temperature=0, max_tokens=8)
        assert other.choices[0].text == expected
        assert sse_events(idle)[-1] == "[DONE]"
