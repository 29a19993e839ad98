"""One corpus of hostile bodies against every generation endpoint of every dialect (chat completions,
completions, Anthropic Messages, OpenAI Responses, Ollama): lone surrogates (``"\\ud800"``: valid JSON, no
Unicode) in every string, wrong types, huge numbers, missing and unknown fields, broken JSON. Each answer is
a 4xx in the dialect's own error shape (a lone surrogate: a 400 naming its field) or a 200, never a 500;
and the wire to a runner (``exo serve``) carries any string, lone surrogates replaced by U+FFFD."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest

from exo.engine import SamplingParams
from exo.engine.prompt import GenerateParams, Prompt
from exo.wire.convert import error_to_pb, generate_request, request_from_pb
from tests.api.conftest import short_context_copy

LONE = "\ud800"
TOOL = {"type": "function", "function": {"name": "add", "description": "Add",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}

# (path, dialect, a valid body that generates at most 2 tokens); every string and value in it gets mutated.
ENDPOINTS: list[tuple[str, str, dict[str, Any]]] = [
    ("/v1/chat/completions", "openai", {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "", "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "2"}],
        "tools": [TOOL], "stop": ["zz"], "max_tokens": 2, "temperature": 0.5}),
    ("/v1/completions", "openai", {"prompt": "hi", "stop": "zz", "max_tokens": 2}),
    ("/v1/messages", "anthropic", {
        "model": "MODEL", "max_tokens": 2, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "2"}]}],
        "tools": [{"name": "add", "input_schema": {"type": "object"}}], "stop_sequences": ["zz"]}),
    ("/v1/messages/count_tokens", "anthropic", {"model": "MODEL", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", "openai", {
        "model": "MODEL", "instructions": "Be brief.", "max_output_tokens": 2, "store": False,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                  {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "2"}],
        "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}]}),
    ("/api/chat", "ollama", {
        "model": "MODEL", "stream": False, "options": {"num_predict": 2, "stop": ["zz"]},
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}]},
                     {"role": "tool", "content": "2", "tool_name": "add"}],
        "tools": [TOOL]}),
    ("/api/generate", "ollama", {"model": "MODEL", "prompt": "hi", "system": "Be brief.", "stream": False,
                                 "options": {"num_predict": 2}}),
    ("/api/show", "ollama", {"model": "MODEL"}),
]
WRONG = [None, True, -1, 10**40, 1e308, "x", [], {}, [1, "a"]]
RAW = [b"", b"{", b"[]", b'"text"', b"null", b"\xff\xfe{}", b'{"a": NaN}', b"[" * 50_000, b'{"model": "\xed\xa0\x80"}']


def _paths(value: Any, path: tuple = ()) -> Iterator[tuple]:
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, (*path, i))


def _set(body: Any, path: tuple, value: Any) -> Any:
    out = copy.deepcopy(body)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


def _delete(body: Any, path: tuple) -> Any:
    out = copy.deepcopy(body)
    target = out
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return out


def corpus(body: dict[str, Any]) -> Iterator[tuple[str, bytes]]:
    """(what, raw body) for every mutation of ``body``."""
    yield "valid", json.dumps(body).encode()
    yield "valid, streamed", json.dumps({**body, "stream": True}).encode()
    yield "unknown field", json.dumps({**body, "no_such_field": 1}).encode()
    for raw in RAW:
        yield f"raw {raw[:12]!r}", raw
    for path in _paths(body):
        if not path:
            continue
        here = _get(body, path)
        if isinstance(here, str):
            yield f"{path}: lone surrogate", json.dumps(_set(body, path, here + LONE)).encode()
            yield f"{path}: lone low surrogate", json.dumps(_set(body, path, "\udc00" + here)).encode()
        if isinstance(here, dict | list) and isinstance(path[-1], str):
            yield f"{path}: empty", json.dumps(_set(body, path, type(here)())).encode()
        for wrong in WRONG:
            if type(wrong) is not type(here):
                yield f"{path}: {wrong!r}", json.dumps(_set(body, path, wrong)).encode()
        yield f"{path}: missing", json.dumps(_delete(body, path)).encode()
    # A key that is a lone surrogate.
    yield "surrogate key", json.dumps({**body, LONE: 1}).encode()


def _get(body: Any, path: tuple) -> Any:
    for key in path:
        body = body[key]
    return body


def _dialect_error(dialect: str, payload: Any) -> bool:
    if dialect == "anthropic":
        return payload.get("type") == "error" and isinstance(payload["error"]["message"], str)
    if dialect == "ollama":
        return set(payload) == {"error"} and isinstance(payload["error"], str)
    return isinstance(payload["error"]["message"], str)


@pytest.fixture(scope="module")
def hostile_server(make_server, model_dir, tmp_path_factory):
    # A declared context of 640 tokens (the longest valid body's prompt is ~530: its tools) bounds every
    # generation a mutated budget can ask for.
    model = short_context_copy(model_dir, tmp_path_factory.mktemp("hostile") / "short-context", 640)
    return make_server(model, env={"EXO_REQUEST_TIMEOUT_S": "10", "EXO_OFFLINE": "1"})


@pytest.mark.parametrize(("path", "dialect", "body"), ENDPOINTS, ids=[e[0] for e in ENDPOINTS])
def test_hostile_bodies_get_a_4xx_or_an_answer_never_a_500(hostile_server, path, dialect, body):
    body = json.loads(json.dumps(body).replace('"MODEL"', json.dumps(hostile_server.model)))
    failures, seen = [], 0
    with hostile_server.http(timeout=30) as http:
        for what, raw in corpus(body):
            seen += 1
            response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            text = response.text
            if what.startswith("valid") and response.status_code != 200:
                failures.append(f"{what}: {response.status_code} {text[:200]}")
            elif response.status_code >= 500:
                failures.append(f"{what}: {response.status_code} {text[:200]}")
            elif response.status_code >= 400:
                if not _dialect_error(dialect, json.loads(text)):
                    failures.append(f"{what}: not the dialect's error shape: {text[:200]}")
            elif LONE in text or "\\ud800" in text:
                failures.append(f"{what}: a lone surrogate came back: {text[:200]}")
            elif '"error"' in text and ("event: error" in text or '{"error"' in text):
                failures.append(f"{what}: an error in the stream: {text[:300]}")
    assert seen > 20
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(("path", "dialect", "body"), ENDPOINTS, ids=[e[0] for e in ENDPOINTS])
def test_a_lone_surrogate_is_a_400_naming_its_field(hostile_server, path, dialect, body):
    """Not text, so no prompt: a 400 in the dialect's shape that says which field holds it (Python's JSON
    reads the escape as a str the tokenizer and the wire cannot encode; before, exo serve answered 500)."""
    body = json.loads(json.dumps(body).replace('"MODEL"', json.dumps(hostile_server.model)))
    free_text = ("content", "text", "prompt", "system", "instructions", "output")
    string_path = next((p for p in _paths(body) if p and isinstance(_get(body, p), str) and p[-1] in free_text),
                       ("model",))
    raw = json.dumps(_set(body, string_path, "caf\u00e9 " + LONE)).encode()
    with hostile_server.http() as http:
        response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and _dialect_error(dialect, response.json()), response.text
    assert ".".join(map(str, string_path)) in response.text
    paired = json.dumps(_set(body, string_path, "caf\u00e9 \U0001F600")).encode()  # a pair: one character
    if string_path == ("model",):
        return  # no such model
    with hostile_server.http() as http:
        ok = http.post(path, content=paired, headers={"Content-Type": "application/json"})
        assert ok.status_code == 200, ok.text


def test_the_wire_carries_any_string_a_client_sends():
    """A runner's request and its error chunk (protobuf: UTF-8 strings) with lone surrogates in content, names,
    tool arguments and stop strings: U+FFFD in their place, never UnicodeEncodeError."""
    messages = [{"role": "user", "content": f"a{LONE}b", "name": f"n{LONE}"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": f"c{LONE}", "type": "function", "function": {"name": f"f{LONE}", "arguments": {"x": LONE}}}]},
                {"role": "tool", "content": LONE, "tool_call_id": f"c{LONE}", "name": "f"}]
    params = GenerateParams(max_tokens=2, default_max_tokens=2, sampling=SamplingParams(), stop=(f"s{LONE}",))
    request = generate_request(f"m{LONE}", "i", Prompt(messages=messages, tools=[{"name": LONE}]), params, 5.0)
    prompt, params = request_from_pb(request)
    assert prompt.messages[0]["content"] == "a\ufffdb" and params.stop == ("s\ufffd",)
    assert prompt.messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": LONE}  # JSON: escaped, kept
    assert request_from_pb(generate_request("m", "i", Prompt(text=LONE), params, 5.0))[0].text == "\ufffd"
    assert error_to_pb(RuntimeError(f"model 'm{LONE}'")).error.message == "RuntimeError: model 'm\ufffd'"
