"""exo for agents, the rules around the calls (official openai client, the bundled demo model): budgets
(a constrained answer always completes; a max_tokens below its shortest document is a 400), schemas that
closing must leave satisfiable, OpenAI's conversation rules, at most one call with parallel_tool_calls
false, parallel calls streamed, thinking templates, completions logprobs with MTP on and off, and the
the example of docs/api.md run as written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from exo.api.completions import Reasoning
from exo.api.reasoning import ReasoningSplitter, split_whole
from exo.api.tools import END
from tests.api.conftest import demo_model_with_template, wait_until_serving
from tests.api.test_agents import ADD, ASK, TOOLS, XML_TEMPLATE
from tests.api.test_serve_cli import SRC, _free_port

FIVE = {"type": "object", "properties": {k: {"type": "string"} for k in ("first", "second", "third", "fourth", "fifth")},
        "required": ["first", "second", "third", "fourth", "fifth"]}
API_DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


@pytest.fixture(scope="module")
def demo(make_server):
    return make_server()


@pytest.fixture(scope="module")
def client(demo):
    return demo.openai()


def _fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def test_five_required_strings_fit_48_tokens_and_a_smaller_budget_is_a_400(client, demo):
    for temperature in (0.0, 1.0):
        response = client.chat.completions.create(model="exo-demo", messages=ASK, response_format=_fmt(FIVE),
                                                  max_tokens=48, temperature=temperature, seed=2)
        assert response.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(response.choices[0].message.content), FIVE)
    with demo.http() as http:
        error = http.post("/v1/chat/completions", json={"messages": ASK, "response_format": _fmt(FIVE),
                                                        "max_tokens": 12}).json()["error"]
        assert error["param"] == "max_tokens" and "12" in error["message"], error
        needed = int(re.search(r"takes (\d+) tokens", error["message"]).group(1))
        ok = http.post("/v1/chat/completions", json={"messages": ASK, "response_format": _fmt(FIVE),
                                                     "max_tokens": needed})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "stop", ok.text
        tools = [{"type": "function", "function": {"name": "f", "parameters": FIVE}}]
        error = http.post("/v1/chat/completions", json={"messages": ASK, "tools": tools, "tool_choice": "required",
                                                        "max_tokens": 8}).json()["error"]
        assert error["param"] == "max_tokens", error


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
     "anyOf": [{"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}, "required": ["a", "b"]},
], ids=["anyOf_adds_properties", "required_not_listed"])
def test_closing_keeps_schemas_satisfiable(client, schema):
    response = client.chat.completions.create(model="exo-demo", messages=ASK, response_format=_fmt(schema),
                                              max_tokens=64, temperature=0)
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)


def test_an_unsatisfiable_schema_is_a_400_that_says_why(demo):
    schema = {"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False}
    with demo.http() as http:
        error = http.post("/v1/chat/completions", json={"messages": ASK, "response_format": _fmt(schema)}).json()["error"]
        assert error["param"] == "response_format.json_schema.schema" and "unsatisfiable" in error["message"], error


_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
_CALL2 = {**_CALL, "id": "call_2"}


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "none"}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [_CALL, _CALL2]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "3"},
                         {"role": "user", "content": "and?"}]}, "messages.1.tool_calls"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [_CALL]}]}, "messages.1.tool_calls"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [_CALL]}, {"role": "assistant", "content": "x"}]},
     "messages.1.tool_calls"),
], ids=["choice_auto_no_tools", "choice_none_no_tools", "parallel_no_tools", "one_of_two_answered", "unanswered_at_end",
        "assistant_follows"])
def test_conversation_rules_are_400s_naming_the_message(demo, body, param):
    with demo.http() as http:
        response = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param, error
        if param.startswith("messages"):
            assert "call_" in error["message"] and "messages.1" in error["message"]


def test_parallel_tool_calls_false_under_auto_stops_after_one_call(demo):
    """The demo model does not call tools by itself: the generation's stop holds the rule (the parser closes a
    call at the stop), checked on what the handler asks the engine for."""
    from exo.api import completions

    seen = []
    original = demo.service.generate

    def spy(model, prompt, params, **kwargs):
        seen.append(params.stop)
        return original(model, prompt, params, **kwargs)

    demo.service.generate = spy
    try:
        client = demo.openai()
        client.chat.completions.create(model="exo-demo", messages=ASK, tools=TOOLS, parallel_tool_calls=False,
                                       max_tokens=4)
        client.chat.completions.create(model="exo-demo", messages=ASK, tools=TOOLS, max_tokens=4)
    finally:
        demo.service.generate = original
    assert END in seen[0] and END not in seen[1]
    assert completions.ToolCallParser  # the parser closes a call cut at its closing tag:
    parser = completions.ToolCallParser(TOOLS)
    parser.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n')
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("add", {"a": 1, "b": 2})]


def test_parallel_calls_stream_with_indices_reassembled_by_the_sdk(client):
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
    request = dict(model="exo-demo", messages=[{"role": "user", "content": "Add 1 and 2, then 3 and 4."}],
                   tools=tools, tool_choice="required", temperature=0, max_tokens=160)
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls
    assert len(whole) >= 2, "the demo model writes several calls here"
    with client.chat.completions.stream(**request) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        streamed = stream.get_final_completion().choices[0].message.tool_calls
    indices = {d.index for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []}
    assert indices == set(range(len(whole)))
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole]
    assert len({c.id for c in streamed}) == len(streamed)
    for call in streamed:
        jsonschema.validate(json.loads(call.function.arguments), ADD)


def test_completions_logprobs_are_the_same_with_mtp_on_and_off(client):
    def ask(mtp):
        return client.completions.create(model="exo-demo", prompt="def fibonacci(n):", max_tokens=16, logprobs=3,
                                         temperature=0, extra_body={"native_mtp": mtp}).choices[0]

    plain = ask({"enabled": False})
    for mtp in ({"k": 1}, {"k": 3}, {}):
        other = ask(mtp)
        assert other.text == plain.text and other.logprobs.tokens == plain.logprobs.tokens
        assert other.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
        for a, b in zip(other.logprobs.top_logprobs, plain.logprobs.top_logprobs, strict=True):
            assert set(a) == set(b) and list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)


# -- thinking templates ---------------------------------------------------------------------------------------

THINK_TEMPLATE = XML_TEMPLATE.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}",
)
ALWAYS_THINK = XML_TEMPLATE.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}",
)


@pytest.mark.parametrize("template", [THINK_TEMPLATE, ALWAYS_THINK], ids=["qwen3.5_style", "ignores_enable_thinking"])
def test_constrained_answers_start_after_the_think_block(make_server, tmp_path, template):
    """A template that opens <think> in the generation prompt: constrained output is the answer itself
    (enable_thinking=False, and a block still open is closed), so calls parse and JSON validates."""
    server = make_server(demo_model_with_template(template, tmp_path / "think"))
    client = server.openai()
    reply = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), {t["function"]["name"]: t["function"]["parameters"]
                                                              for t in TOOLS}[call.function.name])
    out = client.chat.completions.create(model=server.model, messages=ASK, response_format=_fmt(FIVE), max_tokens=60)
    jsonschema.validate(json.loads(out.choices[0].message.content), FIVE)


def test_reasoning_is_apart_from_content_and_calls():
    """vLLM's convention: the think block is reasoning_content; calls are read only after it."""
    text = ('<think>\nI could write <tool_call>\n{"name": "add", "arguments": {}}\n</tool_call> here.\n</think>\n\n'
            'Sure.')
    assert split_whole(text) == ('\nI could write <tool_call>\n{"name": "add", "arguments": {}}\n</tool_call> here.\n',
                                 "Sure.")
    assert split_whole("the prompt opened the block</think>\nanswer", opened=True) == ("the prompt opened the block",
                                                                                         "answer")
    assert split_whole("an answer that mentions </think>") == ("", "an answer that mentions </think>")
    assert split_whole("plain answer") == ("", "plain answer")
    for cuts in (range(len(text)), [3, 40, 90]):  # streamed in any pieces: the same split
        splitter, pieces, start = ReasoningSplitter(), [], 0
        for cut in [*cuts, len(text)]:
            pieces.append(splitter.feed(text[start:cut]))
            start = cut
        pieces.append(splitter.finish())
        assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == split_whole(text)
    assert Reasoning("x").text == "x"


def test_a_template_that_opens_think_gives_reasoning_content(make_server, tmp_path):
    """Unconstrained, the answer starts inside the template's think block (as Qwen3.5's does by default:
    mlx-lm passes enable_thinking=True when <think> is in the vocabulary): it is reasoning_content, the same
    streamed and whole. A template not asked to think (this vocabulary: enable_thinking=False) answers content."""
    server = make_server(demo_model_with_template(ALWAYS_THINK, tmp_path / "always"))
    client = server.openai()
    request = dict(model=server.model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=12)
    whole = client.chat.completions.create(**request).choices[0].message
    thought = whole.model_extra["reasoning_content"]
    assert thought and not whole.content and not whole.tool_calls
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
    assert not "".join(d.content or "" for d in deltas)
    other = make_server(demo_model_with_template(THINK_TEMPLATE, tmp_path / "think"))
    plain = other.openai().chat.completions.create(**{**request, "model": other.model})
    assert plain.choices[0].message.content and not (plain.choices[0].message.model_extra or {}).get(
        "reasoning_content")


# -- the docs' example, as written ---------------------------------------------------------------------------


@pytest.fixture()
def exo_serve(tmp_path):
    """``exo serve`` as a user starts it (a real process, its default model exo-demo): its URL."""
    port = _free_port()
    env = {**os.environ, "EXO_HOME": str(tmp_path), "PYTHONPATH": str(SRC), "EXO_API_KEY": ""}
    process = subprocess.Popen(
        [sys.executable, "-m", "exo.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--grpc-port", str(_free_port()), "--no-discovery"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url, process, 90)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=30)


def test_the_docs_agent_example_runs_as_written(exo_serve):
    section = API_DOCS.read_text().split("## Tool calling, structured output and logprobs", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'base_url="http://127.0.0.1:52415/v1"' in code
    code = code.replace("http://127.0.0.1:52415/v1", exo_serve + "/v1")  # the only change: this server's port
    out = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/api.md", "exec"), scope)  # noqa: S102 - the project's own docs
    reply = scope["reply"].choices[0]
    assert reply.finish_reason == "tool_calls" and len(reply.message.tool_calls) == 1
    jsonschema.validate(scope["args"], scope["tools"][0]["function"]["parameters"])
    assert scope["final"].choices[0].message.content is not None and out.getvalue().strip()
