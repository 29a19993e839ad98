"""The official openai client against a real server: output equals the engine's, stats are there."""

from __future__ import annotations

import pytest

from .conftest import sse_events

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
STATS_FIELDS = {
    "enabled", "reason", "mode", "k", "rounds", "drafted_tokens", "accepted_tokens", "acceptance_rate",
    "per_position_acceptance", "ttft_ms", "decode_tokens_per_s",
}


def _chat_ids(reference, messages):
    return reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _check_usage(usage: dict, prompt_tokens: int, completion_tokens: int) -> None:
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == completion_tokens
    assert usage["total_tokens"] == prompt_tokens + completion_tokens
    assert STATS_FIELDS <= set(usage["native_mtp"])
    assert usage["native_mtp"]["completion_tokens"] == completion_tokens
    assert usage["ttft_ms"] > 0 and usage["decode_tokens_per_s"] > 0


def test_chat_non_stream_equals_the_engine(server, reference):
    expected = reference(_chat_ids(reference, CHAT), max_tokens=24)
    response = server.openai().chat.completions.create(
        model=server.model, messages=CHAT, temperature=0, max_tokens=24
    )
    assert response.object == "chat.completion" and response.model == server.model
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    usage = response.usage.model_dump()
    _check_usage(usage, len(_chat_ids(reference, CHAT)), len(expected.token_ids))
    assert usage["native_mtp"]["enabled"] is True  # the fixture has a trained head


def test_chat_stream_equals_the_engine(server, reference):
    expected = reference(_chat_ids(reference, CHAT), max_tokens=24)
    stream = server.openai().chat.completions.create(
        model=server.model,
        messages=CHAT,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == expected.finish_reason
    native = finals[0].model_extra["native_mtp"]
    assert STATS_FIELDS <= set(native) and native["completion_tokens"] == len(expected.token_ids)
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    _check_usage(usage_chunk.usage.model_dump(), len(_chat_ids(reference, CHAT)), len(expected.token_ids))
    assert usage_chunk.usage.model_extra["native_mtp"] == native  # the same stats object


def test_completions_non_stream_and_stream_equal_the_engine(server, reference):
    prompt = "0 0 0"
    expected = reference(reference.tokenizer.encode(prompt), max_tokens=30)
    client = server.openai()
    whole = client.completions.create(model=server.model, prompt=prompt, temperature=0, max_tokens=30)
    assert whole.object == "text_completion"
    assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == "length"
    _check_usage(whole.usage.model_dump(), len(reference.tokenizer.encode(prompt)), 30)
    chunks = list(
        client.completions.create(model=server.model, prompt=prompt, temperature=0, max_tokens=30, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["native_mtp"]["completion_tokens"] == 30
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_token_id_prompt_and_default_model(server, reference):
    ids = reference.tokenizer.encode("a b c d")
    expected = reference(ids, max_tokens=12)
    with server.http() as http:
        body = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0}).json()
    assert body["model"] == server.model  # no model: the server's default
    assert body["choices"][0]["text"] == expected.text


@pytest.mark.parametrize("mtp", [{"enabled": False}, {"k": 2}], ids=["plain", "k2"])
def test_sampling_with_a_seed_equals_the_engine(server, reference, mtp):
    # A seed reproduces samples for a fixed decoding path (adaptive depth picks K from timings, and
    # each K draws different random keys: same distribution, different samples).
    from exo.engine import SamplingParams

    params = dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=7)
    ids = _chat_ids(reference, CHAT)
    mode = {"native_mtp": "off"} if mtp.get("enabled") is False else {"mtp_k": mtp["k"]}
    expected = reference(ids, max_tokens=20, sampling=SamplingParams(**params), **mode)
    client = server.openai()
    runs = [
        client.chat.completions.create(
            model=server.model,
            messages=CHAT,
            max_tokens=20,
            temperature=0.8,
            top_p=0.9,
            seed=seed,
            extra_body={"top_k": 20, "min_p": 0.05, "native_mtp": mtp},
        ).choices[0].message.content
        for seed in (7, 7, 8)
    ]
    assert runs[:2] == [expected.text, expected.text]
    assert runs[2] != expected.text  # the seed matters


def test_stop_strings_and_max_completion_tokens(server, reference):
    ids = reference.tokenizer.encode("0 0 0")
    full = reference(ids, max_tokens=30).text
    stop = full[6:9]
    client = server.openai()
    for value in (stop, [stop, "zzz"]):
        response = client.completions.create(model=server.model, prompt="0 0 0", temperature=0, max_tokens=30, stop=value)
        assert response.choices[0].text == full[: full.index(stop)]
        assert response.choices[0].finish_reason == "stop"
    response = client.chat.completions.create(
        model=server.model, messages=CHAT, temperature=0, max_completion_tokens=5
    )
    assert response.usage.completion_tokens == 5 and response.choices[0].finish_reason == "length"


def test_presence_and_frequency_penalties_reach_the_engine(server, reference):
    from exo.engine import SamplingParams

    ids = reference.tokenizer.encode("0 0 0")
    sampling = SamplingParams(presence_penalty=0.5, frequency_penalty=0.8)
    expected = reference(ids, max_tokens=24, sampling=sampling)
    assert expected.text != reference(ids, max_tokens=24).text  # the penalties change this output
    response = server.openai().completions.create(
        model=server.model, prompt="0 0 0", temperature=0, max_tokens=24, presence_penalty=0.5, frequency_penalty=0.8
    )
    assert response.choices[0].text == expected.text


@pytest.mark.parametrize(
    ("options", "enabled", "k"),
    [({"enabled": False}, False, None), ({"enabled": True, "k": 2}, True, 2), ({"k": 0}, True, 0)],
)
def test_native_mtp_extension(server, reference, options, enabled, k):
    ids = _chat_ids(reference, CHAT)
    expected = reference(ids, max_tokens=24)
    response = server.openai().chat.completions.create(
        model=server.model, messages=CHAT, temperature=0, max_tokens=24, extra_body={"native_mtp": options}
    )
    assert response.choices[0].message.content == expected.text  # greedy: MTP never changes the output
    stats = response.usage.model_extra["native_mtp"]
    assert stats["enabled"] is enabled
    if not enabled:
        assert "off" in stats["reason"] and stats["rounds"] == 0
    if k is not None:
        assert stats["k"] == k and stats["k_fixed"] is True
    if k == 2:
        assert stats["rounds"] > 0 and stats["drafted_tokens"] == 2 * stats["rounds"]
        assert len(stats["per_position_acceptance"]) == 2


def test_raw_sse_framing(server):
    with server.http() as http, http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": server.model, "messages": CHAT, "max_tokens": 6, "temperature": 0, "stream": True},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length") and "native_mtp" in events[-2]
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events[:-1])


def test_models_list_and_retrieve(server):
    client = server.openai()
    models = client.models.list()
    rows = [m.model_dump() for m in models.data]
    assert rows[0]["id"] == server.model and rows[0]["status"] == "loaded"
    assert rows[0]["native_mtp"] == {"default_k": 1, "max_k": 3, "available": True, "reason": None}
    order = {"loaded": 0, "local": 1, "remote": 2}
    assert [order[r["status"]] for r in rows] == sorted(order[r["status"]] for r in rows)
    assert {"exo-demo", "qwen3.5-27b-4bit"} <= {r["id"] for r in rows}  # the whole catalog is listed
    for row in rows:
        assert row["object"] == "model" and isinstance(row["created"], int) and row["owned_by"]
        assert set(row["native_mtp"]) == {"default_k", "max_k", "available", "reason"}
        assert row["native_mtp"]["available"] or row["native_mtp"]["reason"]
    assert client.models.retrieve(server.model).id == server.model
    with pytest.raises(Exception) as info:
        client.models.retrieve("no-such-model")
    assert info.value.status_code == 404


def test_health_and_metrics(server):
    with server.http() as http:
        health = http.get("/health").json()
        assert health["status"] == "ok" and health["models_loaded"] == [server.model]
        assert health["queue_depth"] == 0
        text = http.get("/metrics").text
    for name in (
        "exo_http_requests_total",
        "exo_completion_tokens_total",
        "exo_native_mtp_drafted_tokens_total",
        "exo_native_mtp_accepted_tokens_total",
        "exo_native_mtp_acceptance_rate",
        "exo_queue_depth",
        "exo_api_errors_total",
    ):
        assert name in text, name
    assert server.metric("exo_completion_tokens_total", model=server.model) > 0
    # MLX's memory in the process that ran the last generation (its runner): the weights at least are active
    active = server.metric("exo_device_memory_bytes", model=server.model, kind="active")
    peak = server.metric("exo_device_memory_bytes", model=server.model, kind="peak")
    assert 0 < active <= peak and server.metric("exo_device_memory_bytes", model=server.model, kind="cache") >= 0
