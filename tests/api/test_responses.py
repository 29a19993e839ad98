"""The OpenAI Responses dialect (``/v1/responses``), spoken to by the official ``openai`` SDK on the bundled
demo model: create, the stream's events, a function-call round trip, ``previous_response_id`` with
``store`` and GET / DELETE, the store's bounds, JSON output, forced calls valid against their schemas,
reasoning items, and a body Codex sent (shrunk) replayed as sent."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from exo.api.responses import ResponseStore
from tests.api.conftest import demo_model_with_template, short_context_copy, sse_events
from tests.api.test_agents import ADD, WEATHER
from tests.api.test_agents_rules import ALWAYS_THINK

DATA = Path(__file__).parent / "data"
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER},
    {"type": "function", "name": "add", "description": "Add two numbers", "parameters": ADD},
    {"type": "web_search"},  # a hosted tool exo cannot run: accepted, never called
]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS if t["type"] == "function"}
ASK = "What is the weather in Paris for the next two days?"


@pytest.fixture(scope="module")
def demo(make_server):
    return make_server()


@pytest.fixture(scope="module")
def client(demo) -> openai.OpenAI:
    return demo.openai()


def test_create_answers_with_a_message_and_usage(client):
    response = client.responses.create(model="exo-demo", input="Say hello", instructions="Be brief.",
                                       max_output_tokens=16, temperature=0)
    assert response.object == "response" and response.model == "exo-demo"
    assert response.status in ("completed", "incomplete")
    assert response.output[-1].type == "message" and response.output_text
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 16
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0


def test_max_output_tokens_makes_it_incomplete(client):
    response = client.responses.create(model="exo-demo", input="Write a long story", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_the_stream_events_and_text_match_create(client):
    request = dict(model="exo-demo", input=[{"role": "developer", "content": "Be brief."},
                                            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                   max_output_tokens=20, temperature=0, store=False)
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "add"}])
def test_forced_calls_follow_their_schemas(client, choice):
    for stream in (False, True):
        request = dict(model="exo-demo", input=ASK, tools=TOOLS, tool_choice=choice, max_output_tokens=200)
        if stream:
            events = list(client.responses.create(**request, stream=True))
            response = events[-1].response
            deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
            assert deltas == "".join(done)
        else:
            response = client.responses.create(**request)
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls, response
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            assert choice == "required" or call.name == "add"


def test_a_function_call_round_trip_and_previous_response_id(client, demo):
    first = client.responses.create(model="exo-demo", input=ASK, tools=TOOLS, parallel_tool_calls=False,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200)
    (call,) = [item for item in first.output if item.type == "function_call"]
    # Stateless: the whole conversation again, as Codex sends it (store: false).
    items = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    stateless = client.responses.create(model="exo-demo", input=items, tools=TOOLS, max_output_tokens=8,
                                        temperature=0, store=False)
    # Stored: only the new items, after previous_response_id.
    stored = client.responses.create(model="exo-demo", previous_response_id=first.id, tools=TOOLS,
                                     input=[items[-1]], max_output_tokens=8, temperature=0)
    assert stored.usage.input_tokens == stateless.usage.input_tokens > first.usage.input_tokens
    assert stored.output_text == stateless.output_text
    assert client.responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stateless.id)  # store: false
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="exo-demo", previous_response_id=first.id, input="again")
    # A result that answers no call: a 400, as on chat completions.
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="exo-demo", input=items[-1:], max_output_tokens=4)


def test_the_store_is_bounded_oldest_out(tmp_path):
    store = ResponseStore(tmp_path, max_count=3, max_bytes=10_000)
    ids = [f"resp_{i:032x}" for i in range(5)]
    for i, response_id in enumerate(ids):
        store.put(response_id, {"response": {"id": response_id}, "conversation": [], "n": i})
    assert [store.get(i) is not None for i in ids] == [False, False, True, True, True]
    store.put(ids[0], {"response": {}, "conversation": [], "pad": "x" * 9_950})  # bytes: the older go
    assert [store.get(i) is not None for i in ids] == [True, False, False, False, False]
    assert store.get("../../etc/passwd") is None and not store.delete("resp_../x")


def test_json_schema_output_is_constrained(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    response = client.responses.create(model="exo-demo", input="Name a city", max_output_tokens=40,
                                       text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)


def test_errors_are_openai_shaped(client, demo):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="no-such-model", input="Hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="exo-demo", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}])
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="exo-demo", input="Hi", max_output_tokens=0)


def test_reasoning_items_from_the_think_block(make_server, tmp_path):
    server = make_server(demo_model_with_template(ALWAYS_THINK, tmp_path / "always"))
    client = server.openai()
    request = dict(model=server.model, input=ASK, max_output_tokens=12, temperature=0,
                   reasoning={"effort": "medium"}, include=["reasoning.encrypted_content"])
    response = client.responses.create(**request)
    item = response.output[0]
    assert item.type == "reasoning" and item.content[0].text
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens
    events = list(client.responses.create(**request, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == item.content[0].text
    # Passed back in a later turn: accepted.
    later = [{"role": "user", "content": ASK}, item.model_dump(exclude_none=True), {"role": "user", "content": "Go on"}]
    assert client.responses.create(**{**request, "input": later}).output


def test_a_codex_request_replayed(make_server, model_dir, server, tmp_path_factory):
    """The body Codex 0.169.0 sent (its prompts shrunk; shape, headers and fields as sent): a streamed
    answer, with no max_output_tokens: bounded by what a context of the prompt + 8 tokens leaves."""
    recorded = json.loads((DATA / "codex_request.json").read_text())
    body = {**recorded["body"], "model": server.model, "stream": False, "max_output_tokens": 1, "store": False}
    with server.http() as http:
        counted = http.post("/v1/responses", json=body).json()["usage"]["input_tokens"]
    short = make_server(short_context_copy(model_dir, tmp_path_factory.mktemp("codex") / "short", counted + 8))
    with short.http() as http, http.stream("POST", recorded["path"], json={**recorded["body"], "model": short.model},
                                           headers=recorded["headers"]) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["usage"]["input_tokens"] == counted
    assert events[-1]["response"]["usage"]["output_tokens"] == 8


def test_the_stream_repeats_in_progress_while_the_prompt_is_read(demo, monkeypatch):
    """Codex gives up on a stream silent for 5 minutes: response.in_progress comes again until the first
    token (the prompt read made slow here by holding the first token back 0.5 s)."""
    import asyncio

    from exo.api import responses as dialect
    from exo.api.completions import ChatGeneration

    first = ChatGeneration.first

    async def slow_first(self):
        await asyncio.sleep(0.5)
        return await first(self)

    monkeypatch.setattr(ChatGeneration, "first", slow_first)
    monkeypatch.setattr(dialect, "KEEPALIVE_S", 0.05)
    with demo.http() as http, http.stream("POST", "/v1/responses", json={
        "model": "exo-demo", "max_output_tokens": 2, "stream": True, "input": "Hi", "store": False,
    }) as response:
        kinds = [e["type"] for e in sse_events(response)]
    before = kinds[: kinds.index("response.output_item.added")]
    assert before[0] == "response.created" and before.count("response.in_progress") >= 4, kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")


def test_prompt_cache_key_reaches_the_chat_path(client):
    # Codex sends one on every request: the chat's prefix-cache hint.
    from exo.api.responses import ResponsesRequest, chat_body

    req = ResponsesRequest.model_validate({"model": "exo-demo", "input": "Hi", "prompt_cache_key": "session-1"})
    assert chat_body(req, [{"role": "user", "content": "Hi"}])["prompt_cache_key"] == "session-1"
    answer = client.responses.create(model="exo-demo", input="Hi", max_output_tokens=4, prompt_cache_key="session-1")
    assert answer.status in ("completed", "incomplete")
    # A hint is never an error, however long (tests/api/test_prefix_cache_api.py: any value).
    long = client.responses.create(model="exo-demo", input="Hi", max_output_tokens=4, prompt_cache_key="k" * 5000)
    assert long.status in ("completed", "incomplete")
