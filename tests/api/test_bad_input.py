"""Every class of bad input gets an OpenAI-style error body with the right 4xx; the server keeps serving."""

from __future__ import annotations

import pytest

MESSAGES = [{"role": "user", "content": "Hello"}]


def _chat(**fields):
    return {"messages": MESSAGES, "max_tokens": 4, **fields}


def _error(response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(
    ("raw", "what"),
    [
        (b"{", "not valid JSON"),
        (b"", "empty"),
        (b"[1, 2]", "JSON object"),
        (b'{"messages": NaN}', "not valid JSON"),
        (b"\xff\xfe\x00", "not valid JSON"),
        (b"[" * 100000, "not valid JSON"),
    ],
    ids=["truncated", "empty", "array", "nan", "binary", "deep"],
)
def test_malformed_json(server, raw, what):
    with server.http() as http:
        response = http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert what in _error(response, 400, "invalid_json")["message"]


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"max_tokens": 4}, "missing_required_parameter", "messages"),
        (_chat(messages="Hello"), "invalid_type", "messages"),
        (_chat(messages=[]), "invalid_value", "messages"),
        (_chat(messages=[{"role": "user"}]), "missing_required_parameter", "messages.0.content"),
        (_chat(messages=[{"role": "robot", "content": "x"}]), "invalid_value", "messages.0.role"),
        (_chat(max_tokens="4"), "invalid_type", "max_tokens"),
        (_chat(max_tokens=4.5), "invalid_type", "max_tokens"),
        (_chat(temperature="hot"), "invalid_type", "temperature"),
        (_chat(stream="yes"), "invalid_type", "stream"),
        (_chat(stop=[1, 2]), "invalid_type", "stop.0"),
        (_chat(native_mtp={"enabled": "sometimes"}), "invalid_type", "native_mtp.enabled"),
        (_chat(native_mtp={"depth": 2}), "unknown_parameter", "native_mtp.depth"),
        (_chat(model=42), "invalid_type", "model"),
        (_chat(temprature=0.5), "unknown_parameter", "temprature"),
    ],
    ids=[
        "missing-messages", "messages-string", "messages-empty", "message-without-content", "bad-role",
        "max-tokens-string", "max-tokens-float", "temperature-string", "stream-string", "stop-ints",
        "mtp-enabled-string", "mtp-unknown-key", "model-int", "typo",
    ],
)
def test_wrong_types_and_unknown_fields(server, body, code, param):
    with server.http() as http:
        _error(http.post("/v1/chat/completions", json=body), 400, code, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_chat(max_tokens=0), "max_tokens"),
        (_chat(max_tokens=-5), "max_tokens"),
        (_chat(temperature=-1), "temperature"),
        (_chat(temperature=1e9), "temperature"),
        (_chat(top_p=0), "top_p"),
        (_chat(top_p=1.5), "top_p"),
        (_chat(top_k=-1), "top_k"),
        (_chat(min_p=2), "min_p"),
        (_chat(seed=-1), "seed"),
        (_chat(seed=2**64), "seed"),
        (_chat(presence_penalty=3), "presence_penalty"),
        (_chat(frequency_penalty=-2.5), "frequency_penalty"),
        (_chat(repetition_penalty=0), "repetition_penalty"),
        (_chat(native_mtp={"k": 9}), "native_mtp.k"),
        (_chat(native_mtp={"k": -1}), "native_mtp.k"),
        (_chat(native_mtp={"enabled": False, "k": 2}), "native_mtp.k"),
        (_chat(stream_options={"include_usage": True}), "stream_options"),
        (_chat(stop=["x"] * 17), "stop"),
        (_chat(max_tokens=4, max_completion_tokens=5), "max_completion_tokens"),
        (_chat(ignore_eos=True, response_format={"type": "json_object"}), "ignore_eos"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_out_of_range_parameters(server, body, param):
    with server.http() as http:
        _error(http.post("/v1/chat/completions", json=body), 400, "invalid_value", param)


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("chat", _chat(functions=[{"name": "f"}]), "functions"),
        ("chat", _chat(function_call="auto"), "function_call"),
        ("chat", _chat(n=2), "n"),
        ("chat", _chat(logit_bias={"5": 10}), "logit_bias"),
        ("chat", _chat(messages=[{"role": "function", "content": "x", "name": "f"}]), "messages.0.role"),
        (
            "chat",
            _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages.0.content.0.type",
        ),
        ("completions", {"prompt": "x", "echo": True}, "echo"),
        ("completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("completions", {"prompt": ["a", "b"]}, "prompt"),
        ("completions", {"prompt": [[1, 2], [3]]}, "prompt"),
    ],
    ids=lambda v: v if isinstance(v, str) and v not in ("chat", "completions") else None,
)
def test_unsupported_openai_features_are_refused(server, endpoint, body, param):
    with server.http() as http:
        error = _error(http.post(f"/v1/{endpoint.replace('chat', 'chat/completions')}", json=body), 400)
    assert error["code"] == "unsupported_parameter" and error["param"] == param
    assert "not supported" in error["message"]


def test_off_values_of_unsupported_features_are_accepted(server):
    body = _chat(n=1, logprobs=False, tools=[], response_format={"type": "text"}, store=False, temperature=0)
    with server.http() as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_oversize_body(make_server, model_dir):
    srv = make_server(model_dir, max_body_bytes=10_000)
    with srv.http() as http:
        big = _chat(messages=[{"role": "user", "content": "x" * 20_000}])
        _error(http.post("/v1/chat/completions", json=big), 413, "request_too_large")
        assert http.post("/v1/chat/completions", json=_chat()).status_code == 200


def test_unknown_and_unavailable_models(server):
    with server.http() as http:
        error = _error(http.post("/v1/chat/completions", json=_chat(model="no-such-model")), 404, "model_not_found", "model")
        assert "no-such-model" in error["message"]
        error = _error(http.post("/v1/chat/completions", json=_chat(model="qwen3.5-27b")), 404, "model_not_found")
        assert "qwen3.5-27b-4bit" in error["message"]  # suggestions
        # Known to the catalog but not on this machine.
        error = _error(http.post("/v1/chat/completions", json=_chat(model="qwen3.5-27b-4bit")), 404, "model_not_available")
        assert "huggingface-cli download" in error["message"]
        # Clients cannot name directories on the server.
        _error(http.post("/v1/chat/completions", json=_chat(model="/tmp")), 404, "model_not_found")
        _error(http.post("/v1/chat/completions", json=_chat(model="tests/fixtures")), 404, "model_not_found")


def test_prompt_longer_than_the_context(server, reference):
    with server.http() as http:
        too_long = _chat(max_tokens=300_000)
        error = _error(http.post("/v1/chat/completions", json=too_long), 400, "context_length_exceeded", "messages")
        assert "262144" in error["message"]
        ids = reference.tokenizer.encode("a b c d") * 40_000  # 160k-token prompt + 200k completion
        error = _error(
            http.post("/v1/completions", json={"prompt": ids, "max_tokens": 200_000}), 400, "context_length_exceeded", "prompt"
        )
        longer = reference.tokenizer.encode("a b c d") * 70_000  # the prompt alone exceeds the context
        error = _error(http.post("/v1/completions", json={"prompt": longer}), 400, "context_length_exceeded")
        assert "280000 in the prompt" in error["message"]
        # Stream requests get the same 4xx before any event is sent.
        response = http.post("/v1/chat/completions", json=_chat(max_tokens=300_000, stream=True))
        _error(response, 400, "context_length_exceeded")


def test_bad_prompts(server):
    with server.http() as http:
        _error(http.post("/v1/completions", json={"prompt": [10**9]}), 400, "invalid_value")
        _error(http.post("/v1/completions", json={"prompt": [-1]}), 400, "invalid_value")
        _error(http.post("/v1/completions", json={"prompt": []}), 400, "invalid_value")
        _error(http.post("/v1/completions", json={"prompt": ""}), 400, "invalid_value")
        lone_surrogate = b'{"prompt": "\\ud800 lone surrogate"}'  # valid JSON, not encodable text
        _error(http.post("/v1/completions", content=lone_surrogate), 400, "invalid_value")
        reserved = _chat(chat_template_kwargs={"tokenize": False})
        _error(http.post("/v1/chat/completions", json=reserved), 400, "invalid_value")


def test_routes_and_methods(server):
    with server.http() as http:
        _error(http.get("/v1/nothing"), 404, "not_found")
        response = http.get("/v1/chat/completions")
        _error(response, 405, "method_not_allowed")
        assert "POST" in response.headers["Allow"]


def test_the_server_keeps_serving(server):
    with server.http() as http:
        for _ in range(3):
            http.post("/v1/chat/completions", content=b"{oops")
            http.post("/v1/chat/completions", json=_chat(max_tokens=-1))
        assert http.get("/health").json()["status"] == "ok"
        assert http.post("/v1/chat/completions", json=_chat(temperature=0)).status_code == 200
    assert server.metric("exo_api_errors_total", code="invalid_json") >= 3
