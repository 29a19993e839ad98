"""The Anthropic Messages dialect (``/v1/messages``), spoken to by the official ``anthropic`` SDK on the
bundled demo model: create, the streaming helpers, a tool round trip, count_tokens, typed errors, forced
tool calls valid against their schemas, thinking blocks, the key in ``x-api-key``, and a body Claude Code
sent (shrunk) replayed as sent."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import jsonschema
import pytest

from tests.api.conftest import demo_model_with_template, short_context_copy, sse_events
from tests.api.test_agents import ADD, WEATHER
from tests.api.test_agents_rules import ALWAYS_THINK

DATA = Path(__file__).parent / "data"
TOOLS = [
    {"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER},
    {"name": "add", "description": "Add two numbers", "input_schema": ADD},
]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]


@pytest.fixture(scope="module")
def demo(make_server):
    return make_server()  # the bundled exo-demo (it ends its answers)


def _client(server, **kwargs) -> anthropic.Anthropic:
    kwargs.setdefault("api_key", server.api_key or "unused")
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=60, **kwargs)


@pytest.fixture(scope="module")
def client(demo) -> anthropic.Anthropic:
    return _client(demo)


def test_create_answers_with_a_text_block_and_usage(client):
    message = client.messages.create(
        model="exo-demo", max_tokens=32000, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Say hello"}],
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        metadata={"user_id": "u1"},
    )
    assert message.type == "message" and message.role == "assistant" and message.model == "exo-demo"
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")  # 32000: clamped to what the context leaves
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    assert message.usage.cache_read_input_tokens == 0
    assert "native_mtp" in message.usage.model_extra


def test_max_tokens_stops_the_answer(client):
    message = client.messages.create(model="exo-demo", max_tokens=3, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": "Write a long story"}])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_stream_helper_gives_the_same_text_as_create(client):
    request = dict(model="exo-demo", max_tokens=24, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Hi"}])
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_the_event_sequence_is_anthropics(demo):
    with demo.http() as http, http.stream("POST", "/v1/messages", json={
        "model": "exo-demo", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hi"}],
    }) as response:
        assert response.status_code == 200
        events = sse_events(response)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert events[0]["message"]["usage"]["input_tokens"] > 0
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"]["output_tokens"] == 8


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"}])
def test_forced_tool_calls_follow_their_schemas(client, choice):
    for stream in (False, True):
        request = dict(model="exo-demo", max_tokens=200, messages=ASK, tools=TOOLS, tool_choice=choice)
        if stream:
            with client.messages.stream(**request) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(**request)
        calls = [b for b in message.content if b.type == "tool_use"]
        assert calls and message.stop_reason == "tool_use", message
        for call in calls:
            jsonschema.validate(call.input, SCHEMAS[call.name])
            assert choice["type"] == "any" or call.name == "add"


def test_a_tool_round_trip(client):
    first = client.messages.create(model="exo-demo", max_tokens=200, messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather",
                                                "disable_parallel_tool_use": True})
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1
    messages = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": calls[0].id, "content": [{"type": "text", "text": "Sunny"}]},
                    {"type": "text", "text": "And tomorrow?"},
                ]}]
    second = client.messages.create(model="exo-demo", max_tokens=16, messages=messages, tools=TOOLS)
    assert second.content and second.usage.input_tokens > first.usage.input_tokens
    # An error result, and a string content, are results too.
    messages[-1]["content"] = [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "no data",
                                "is_error": True}]
    assert client.messages.create(model="exo-demo", max_tokens=4, messages=messages, tools=TOOLS).content
    # A result that answers no call is OpenAI's rule, kept here: a 400.
    messages[-1]["content"][0]["tool_use_id"] = "toolu_unknown"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="exo-demo", max_tokens=4, messages=messages, tools=TOOLS)


def test_count_tokens_is_the_prompt_the_model_reads(client):
    counted = client.messages.count_tokens(model="exo-demo", messages=ASK, system="Be brief.")
    message = client.messages.create(model="exo-demo", max_tokens=1, messages=ASK, system="Be brief.")
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens > 0


def test_count_tokens_queues_no_generation(client, demo):
    # Only the chat template and the tokenizer: no job on the device (none queued behind running ones),
    # so the device records one job of this prompt, the create's.
    jobs = len(demo.service.history)
    counted = client.messages.count_tokens(model="exo-demo", messages=ASK, tools=TOOLS)
    message = client.messages.create(model="exo-demo", max_tokens=1, messages=ASK, tools=TOOLS)
    # input_tokens are the ones read anew (Anthropic's): with a prefix cache, the rest were read from it
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens > 0
    records = lambda: [(job.finish_reason, job.prompt_tokens) for job in list(demo.service.history)[jobs:]]  # noqa: E731
    with demo.http() as http:  # a last job, of another length: once it is recorded, the ones before it are
        last = http.post("/v1/completions", json={"prompt": "The", "max_tokens": 2}).json()["usage"]["prompt_tokens"]
    demo.wait_for(lambda: ("length", last) in records())
    ours = [record for record in records() if record[1] in (0, counted.input_tokens)]  # 0: cancelled unstarted
    assert ours == [("length", counted.input_tokens)]


def test_errors_are_typed(client, demo):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="exo-demo", max_tokens=4,
                               messages=[{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}])
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="exo-demo", max_tokens=0, messages=ASK)
    with demo.http() as http:
        response = http.post("/v1/messages/nothing", json={})
        assert response.status_code == 404 and response.json()["type"] == "error"


def test_system_role_messages_inside_messages_are_accepted(client):
    message = client.messages.create(model="exo-demo", max_tokens=4, messages=[
        {"role": "user", "content": "Hi"}, {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    ])
    assert message.content


def test_x_api_key_is_accepted_like_bearer(make_server, model_dir):
    server = make_server(model_dir, env={"EXO_API_KEY": "sekret"})
    assert _client(server).messages.create(model=server.model, max_tokens=2, messages=ASK).content
    with pytest.raises(anthropic.AuthenticationError) as e:
        _client(server, api_key="wrong").messages.create(model=server.model, max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"


def test_thinking_blocks_from_the_think_block(make_server, tmp_path):
    server = make_server(demo_model_with_template(ALWAYS_THINK, tmp_path / "always"))
    client = _client(server)
    request = dict(model=server.model, max_tokens=12, extra_body={"temperature": 0}, messages=ASK,
                   thinking={"type": "enabled", "budget_tokens": 1024})
    message = client.messages.create(**request)
    assert message.content[0].type == "thinking" and message.content[0].thinking
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == message.content[0].thinking
    # Passed back in a later turn: accepted.
    later = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in message.content]},
             {"role": "user", "content": "Go on"}]
    assert client.messages.create(**{**request, "messages": later}).content


def test_a_claude_code_request_replayed(make_server, model_dir, server, tmp_path_factory):
    """The body Claude Code 2.1.328 sent (its prompts shrunk; its shape, headers and fields as sent): a
    streamed answer, its max_tokens of 32000 clamped to what a context of the prompt + 8 tokens leaves."""
    recorded = json.loads((DATA / "claude_code_request.json").read_text())
    counted = _client(server).messages.count_tokens(
        **{k: v for k, v in recorded["body"].items() if k in ("messages", "system", "tools", "thinking")},
        model=server.model,
    ).input_tokens
    short = make_server(short_context_copy(model_dir, tmp_path_factory.mktemp("cc") / "short", counted + 8))
    body = {**recorded["body"], "model": short.model}
    with short.http() as http, http.stream("POST", recorded["path"], json=body, headers=recorded["headers"]) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    assert events[0]["type"] == "message_start" and events[0]["message"]["usage"]["input_tokens"] == counted
    assert events[-1]["type"] == "message_stop"
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"]["output_tokens"] == 8


def test_the_stream_pings_while_the_prompt_is_read(demo, monkeypatch):
    """A stream opens once the prompt is validated and pings until the first token (an agent's long prompt
    takes minutes to read on a CPU, and Claude Code gives up on a silent stream). The prompt read is made
    slow here by holding the first token back 0.5 s."""
    import asyncio

    from exo.api import anthropic as dialect
    from exo.api.completions import ChatGeneration

    first = ChatGeneration.first

    async def slow_first(self):
        await asyncio.sleep(0.5)
        return await first(self)

    monkeypatch.setattr(ChatGeneration, "first", slow_first)
    monkeypatch.setattr(dialect, "KEEPALIVE_S", 0.05)
    with demo.http() as http, http.stream("POST", "/v1/messages", json={
        "model": "exo-demo", "max_tokens": 2, "stream": True, "messages": ASK,
    }) as response:
        events = sse_events(response)
    kinds = [e["type"] for e in events]
    before = kinds[: kinds.index("content_block_start")]
    assert before[0] == "message_start" and before.count("ping") >= 4, kinds
    assert kinds[-1] == "message_stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_matched_stop_sequence_is_the_stop_reason(client, stream):
    # The answer without stops, then the same answer cut at a piece of its middle: the piece is named.
    request = dict(model="exo-demo", max_tokens=24, extra_body={"temperature": 0},
                   messages=[{"role": "user", "content": "Write a long story"}])
    text = client.messages.create(**request).content[0].text
    assert len(text) > 12, text
    piece = text[6:10]
    assert piece.strip(), text
    stops = ["never in the answer \x01", piece]
    if stream:
        with client.messages.stream(**request, stop_sequences=stops) as s:
            cut = "".join(s.text_stream)
            message = s.get_final_message()
    else:
        message = client.messages.create(**request, stop_sequences=stops)
        cut = message.content[0].text if message.content else ""
    assert cut == text[: text.index(piece)]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == piece
    no_match = client.messages.create(**request, stop_sequences=["never in the answer \x01"])
    assert no_match.stop_reason == "max_tokens" and no_match.stop_sequence is None
