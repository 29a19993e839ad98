"""Ollama's API (``/api/*``) on the bundled demo model, checked against the examples of Ollama's API
documentation (docs/api.md): every field an example shows is there with the same JSON type; NDJSON
streaming and not, ``options`` mapped onto exo's sampling, tools on chat, JSON ``format``, errors."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.api.test_agents import ADD, WEATHER

# Ollama's documented responses (docs/api.md), abridged to one entry each.
DETAILS = {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"], "parameter_size": "3.2B",
           "quantization_level": "Q4_K_M"}
TAGS = {"models": [{"name": "llama3.2:latest", "model": "llama3.2:latest", "modified_at": "2025-05-10T08:06:48.6-07:00",
                    "size": 2019393189, "digest": "a80c4f17acd5", "details": DETAILS}]}
PS = {"models": [{"name": "mistral:latest", "model": "mistral:latest", "size": 5137025024, "digest": "2ae6f6dd7a3d",
                  "details": DETAILS, "expires_at": "2024-06-04T14:38:31.83753-07:00", "size_vram": 5137025024}]}
VERSION = {"version": "0.5.1"}
SHOW = {"modelfile": "# Modelfile", "parameters": "num_keep 24", "template": "{{ .Prompt }}", "details": DETAILS,
        "model_info": {"general.architecture": "llama"}, "capabilities": ["completion"],
        "modified_at": "2025-05-10T08:06:48.6-07:00"}
CHAT_CHUNK = {"model": "llama3.2", "created_at": "2023-08-04T08:52:19.385406455-07:00",
              "message": {"role": "assistant", "content": "The"}, "done": False}
CHAT_FINAL = {"model": "llama3.2", "created_at": "2023-08-04T19:22:45.499127Z",
              "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "stop",
              "total_duration": 4883583458, "load_duration": 1334875, "prompt_eval_count": 26,
              "prompt_eval_duration": 342546000, "eval_count": 282, "eval_duration": 4535599000}
GENERATE_CHUNK = {"model": "llama3.2", "created_at": "2023-08-04T08:52:19.385406455-07:00", "response": "The",
                  "done": False}
GENERATE_FINAL = {**{k: v for k, v in CHAT_FINAL.items() if k != "message"}, "response": ""}
TOOL_CALL_MESSAGE = {"role": "assistant", "content": "",
                     "tool_calls": [{"function": {"name": "get_current_weather", "arguments": {"city": "Toronto"}}}]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
ASK = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]


def same_shape(ours, documented, where="") -> None:
    """Every field of the documented example is in ours, with the same JSON type (lists: their first items)."""
    if isinstance(documented, dict):
        assert isinstance(ours, dict), f"{where}: {ours!r}"
        for key, value in documented.items():
            assert key in ours, f"{where}.{key} missing from {ours!r}"
            same_shape(ours[key], value, f"{where}.{key}")
    elif isinstance(documented, list):
        assert isinstance(ours, list), f"{where}: {ours!r}"
        if documented and ours:
            same_shape(ours[0], documented[0], f"{where}.0")
    elif isinstance(documented, bool):
        assert isinstance(ours, bool), f"{where}: {ours!r}"
    elif isinstance(documented, int):
        assert isinstance(ours, int) and not isinstance(ours, bool), f"{where}: {ours!r}"
    else:
        assert type(ours) is type(documented), f"{where}: {ours!r}"


@pytest.fixture(scope="module")
def demo(make_server):
    return make_server()


@pytest.fixture(scope="module")
def http(demo):
    with demo.http() as client:
        yield client


def lines(response) -> list[dict]:
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def test_models_version_show(http):
    same_shape(http.get("/api/version").json(), VERSION)
    assert http.get("/api/ps").json() == {"models": []}
    loaded = http.post("/api/generate", json={"model": "exo-demo"}).json()  # empty prompt: load, answer at once
    assert loaded["done"] is True and loaded["done_reason"] == "load"
    tags = http.get("/api/tags").json()
    same_shape(tags, TAGS)
    assert "exo-demo" in [m["name"] for m in tags["models"]]
    ps = http.get("/api/ps").json()
    same_shape(ps, PS)
    assert [m["name"] for m in ps["models"]] == ["exo-demo"]  # loaded
    show = http.post("/api/show", json={"model": "exo-demo"}).json()
    same_shape(show, SHOW)
    assert show["model_info"]["qwen3_5.context_length"] == 4096
    missing = http.post("/api/show", json={"model": "nope"})
    assert missing.status_code == 404 and set(missing.json()) == {"error"}


def test_chat_streams_ndjson_and_matches_the_whole_answer(http):
    body = {"model": "exo-demo", "messages": ASK, "options": {"temperature": 0, "num_predict": 12}}
    streamed = lines(http.post("/api/chat", json=body))
    for chunk in streamed[:-1]:
        same_shape(chunk, CHAT_CHUNK)
    same_shape(streamed[-1], CHAT_FINAL)
    whole = http.post("/api/chat", json={**body, "stream": False}).json()
    same_shape(whole, CHAT_FINAL)
    assert "".join(c["message"]["content"] for c in streamed) == whole["message"]["content"]
    assert whole["eval_count"] == streamed[-1]["eval_count"] <= 12


def test_generate_streams_and_not(http):
    body = {"model": "exo-demo", "prompt": "Why is the sky blue?", "system": "Be brief.",
            "options": {"temperature": 0, "num_predict": 6}}
    streamed = lines(http.post("/api/generate", json=body))
    for chunk in streamed[:-1]:
        same_shape(chunk, GENERATE_CHUNK)
    same_shape(streamed[-1], GENERATE_FINAL)
    whole = http.post("/api/generate", json={**body, "stream": False}).json()
    assert "".join(c["response"] for c in streamed) == whole["response"]
    raw = http.post("/api/generate", json={**body, "raw": True, "stream": False}).json()
    assert raw["eval_count"] <= 6 and raw["prompt_eval_count"] < whole["prompt_eval_count"]  # no template


def test_options_map_onto_sampling(http):
    body = {"model": "exo-demo", "prompt": "Once upon a time", "stream": False}
    sampled = http.post("/api/generate", json={**body, "options": {
        "num_predict": 8, "temperature": 1.5, "seed": 3, "top_k": 50, "top_p": 0.95, "min_p": 0.01,
        "repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5, "num_ctx": 8192, "mirostat": 0}})
    assert sampled.status_code == 200 and sampled.json()["eval_count"] <= 8
    bad = http.post("/api/generate", json={**body, "options": {"top_p": 2}})
    assert bad.status_code == 400 and "top_p" in bad.json()["error"]
    one = http.post("/api/generate", json={**body, "options": {"num_predict": 1}}).json()
    assert one["eval_count"] == 1 and one["done_reason"] == "length"
    stopped = http.post("/api/generate", json={**body, "options": {"temperature": 0, "num_predict": 20}}).json()
    cut = stopped["response"][3:6]
    with_stop = http.post("/api/generate", json={**body, "options": {"temperature": 0, "num_predict": 20,
                                                                     "stop": [cut]}}).json()
    assert with_stop["response"] == stopped["response"][: stopped["response"].index(cut)]
    bad = http.post("/api/generate", json={**body, "options": {"temperature": "hot"}})
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]


def test_tools_on_chat_and_the_results_back(http):
    body = {"model": "exo-demo", "messages": ASK, "tools": TOOLS, "stream": False,
            "format": None, "options": {"temperature": 0, "num_predict": 64}}
    answer = http.post("/api/chat", json=body).json()
    same_shape(answer, CHAT_FINAL)
    # The demo model rarely calls on its own: a round trip with the documented call shape, then a JSON answer.
    messages = [*ASK, {**TOOL_CALL_MESSAGE, "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris", "days": 2}}}]},
                {"role": "tool", "content": "Sunny", "tool_name": "get_weather"}]
    schema = {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}
    answer = http.post("/api/chat", json={**body, "messages": messages, "format": schema}).json()
    jsonschema.validate(json.loads(answer["message"]["content"]), schema)
    orphan = http.post("/api/chat", json={**body, "messages": [*ASK, messages[-1]]})
    assert orphan.status_code == 400 and "tool" in orphan.json()["error"]


def test_streamed_tool_calls_are_whole_objects():
    """A call's streamed argument fragments go out as one whole call with object arguments, as Ollama's do."""
    from exo.api.ollama import _Answer

    class Finished:
        finished, model, usage, finish_reason = True, "m", {}, "tool_calls"

    from exo.api.tools import Arguments, CallStart

    answer = _Answer(Finished(), chat=True, arrived=0.0)
    (obj,) = answer.add([CallStart(0, "call_1", "add"), Arguments(0, '{"a": 1,'), Arguments(0, ' "b": 2}')])
    same_shape(obj["message"], {**TOOL_CALL_MESSAGE, "tool_calls": [{"function": {"name": "", "arguments": {}}}]})
    assert obj["message"]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}


def test_errors_are_ollamas(http):
    for response in (http.post("/api/chat", json={"model": "nope", "messages": ASK}),
                     http.post("/api/chat", content=b"{not json"),
                     http.post("/api/chat", json={"messages": ASK}),
                     http.post("/api/chat", json={"model": "exo-demo", "messages": [
                         {"role": "user", "content": "what is this", "images": ["iVBORw0KGgo="]}]}),
                     http.get("/api/nothing")):
        assert 400 <= response.status_code < 500 and set(response.json()) == {"error"}, response.text
