"""exo for agents, through the official openai client on the bundled demo model: tool calling (a full loop,
streaming and not), forced calls and JSON output that always follow their schemas (property-based over
generated schemas and prompts), logprobs with native MTP on and off, and bad input as 400s naming the field.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exo.api.schemas import ChatCompletionRequest
from exo.api.tools import chat_messages, tool_definitions
from exo.cards import bundled_model_dir
from exo.engine.prompt import tokenize
from tests.api.conftest import demo_model_with_template
from tests.fixtures.schemas import BOUNDED, parameters

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "a city name"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
}
ADD = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]


@pytest.fixture(scope="module")
def demo(make_server):
    return make_server()  # no model: the default, the bundled exo-demo


@pytest.fixture(scope="module")
def client(demo) -> openai.OpenAI:
    return demo.openai()


def _check_calls(calls, schemas) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


# -- the tool loop ----------------------------------------------------------------------------------------


def test_full_tool_loop_streaming_and_not(client):
    request = dict(model="exo-demo", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   temperature=0, max_tokens=96)
    whole = client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, SCHEMAS)
    assert whole.usage.model_extra["native_mtp"]["completion_tokens"] == whole.usage.completion_tokens
    # The SDK's stream helper reassembles the same call from the deltas.
    with client.chat.completions.stream(**request) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    # OpenAI's delta shape: per call, index + id + type + name once, then arguments in fragments.
    deltas = [d.model_dump(exclude_none=True) for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["type"] == "function"
    assert deltas[0]["function"] == {"name": choice.message.tool_calls[0].function.name, "arguments": ""}
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas[1:])
    assert len(deltas) > 2 and {d["index"] for d in deltas} == {0}, "one call, its arguments in fragments"
    # The tool's result goes back; the model answers.
    call = choice.message.tool_calls[0]
    follow_up = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny", "high": 21})},
    ]
    answer = client.chat.completions.create(model="exo-demo", messages=follow_up, tools=TOOLS, temperature=0,
                                            max_tokens=24)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
    chunks = client.chat.completions.create(model="exo-demo", messages=follow_up, tools=TOOLS, temperature=0,
                                            max_tokens=24, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content
    # The tool result reached the model: the rendered prompt lists the tools, the call and its result.
    text = _rendered(bundled_model_dir("exo-demo"), {"messages": follow_up, "tools": TOOLS})
    assert '"name": "get_weather"' in text.split("\n</tools>")[0]  # the tools, in the system turn
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call>' in text
    assert '<tool_response>\n{"forecast": "sunny", "high": 21}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")


@functools.cache
def _tokenizer(path: Path):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(path)


def _rendered(path: Path, body: dict) -> str:
    """The prompt exo renders for a chat request (the model's template, or exo's fallback for tools)."""
    req = ChatCompletionRequest.model_validate({"model": "m", **body})
    tokenizer = _tokenizer(path)
    return tokenizer.decode(tokenize(tokenizer, messages=chat_messages(req), tools=tool_definitions(req)))


def test_named_tool_choice_and_none(client):
    named = client.chat.completions.create(
        model="exo-demo", messages=[{"role": "user", "content": "1 plus 2?"}], tools=TOOLS, temperature=0,
        tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=96,
    )
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add"]
    _check_calls(calls, SCHEMAS)
    # "none": tools are shown to the model but nothing is parsed or forced.
    none = client.chat.completions.create(model="exo-demo", messages=ASK, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=8)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"


# -- forced calls and JSON always follow their schemas (property-based) --------------------------------------

_PROMPTS = st.sampled_from(["Hello", "Call the tool.", "What is 2 + 2?", "def f(x):", "Plan a trip to Rome."])


@settings(max_examples=14, **BOUNDED)
@given(
    schemas=st.lists(parameters(), min_size=1, max_size=3),
    prompt=_PROMPTS,
    choice=st.integers(0, 3),
    parallel=st.booleans(),
    temperature=st.sampled_from([0.0, 0.7, 1.2]),
)
def test_forced_tool_calls_always_follow_the_schema(client, schemas, prompt, choice, parallel, temperature):
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": s}} for i, s in enumerate(schemas)]
    named = choice < len(tools)
    tool_choice = {"type": "function", "function": {"name": f"tool_{choice}"}} if named else "required"
    response = client.chat.completions.create(
        model="exo-demo", messages=[{"role": "user", "content": prompt}], tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=parallel, temperature=temperature, seed=choice, max_tokens=320,
    )
    choice_ = response.choices[0]
    assert choice_.finish_reason == "tool_calls", choice_
    _check_calls(choice_.message.tool_calls, {t["function"]["name"]: t["function"]["parameters"] for t in tools})
    if named or not parallel:
        assert len(choice_.message.tool_calls) == 1
    if named:
        assert choice_.message.tool_calls[0].function.name == f"tool_{choice}"


@settings(max_examples=14, **BOUNDED)
@given(schema=parameters(), prompt=_PROMPTS, temperature=st.sampled_from([0.0, 0.8]), budget=st.integers(0, 40))
def test_json_schema_output_always_validates(client, schema, prompt, temperature, budget):
    """Budgets from tight to roomy: the shortest document of these schemas is under 200 tokens here."""
    response = client.chat.completions.create(
        model="exo-demo", messages=[{"role": "user", "content": prompt}], temperature=temperature, seed=1,
        max_tokens=200 + budget, response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                                                "strict": True}},
    )
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)


def test_json_object_and_streamed_json_schema(client):
    obj = client.chat.completions.create(model="exo-demo", messages=ASK, response_format={"type": "json_object"},
                                         temperature=0, max_tokens=64)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
              "required": ["answer", "confidence"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    chunks = client.chat.completions.create(model="exo-demo", messages=ASK, response_format=fmt, temperature=0,
                                            max_tokens=64, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)


# -- the XML tool-call format (Qwen3.5 / 3.6 templates) ------------------------------------------------------

XML_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nCall a function in this format:\\n<tool_call>\\n<function=example_function_name>\\n"
    "<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- for call in message.tool_calls %}{{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' }}"
    "{%- for name, value in call.function.arguments | items %}"
    "{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}"
    "{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def xml_model(tmp_path_factory) -> Path:
    """The demo model with a chat template that teaches the XML call format (its weights linked, not copied)."""
    return demo_model_with_template(XML_TEMPLATE, tmp_path_factory.mktemp("xml") / "exo-demo-xml")


@pytest.fixture(scope="module")
def xml_server(make_server, xml_model):
    return make_server(xml_model)


def test_xml_tool_calls_are_constrained_and_parsed(xml_server, xml_model):
    """Strings are raw text in this format (unbounded here: the budget closes them too)."""
    server = xml_server
    client = server.openai()
    weather = WEATHER
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}, TOOLS[1]]
    request = dict(model=server.model, messages=ASK, tools=tools, temperature=0, max_tokens=96,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**request)
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    _check_calls(calls, {"get_weather": weather})
    with client.chat.completions.stream(**request) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0].message.tool_calls
    assert [c.function.arguments for c in streamed] == [c.function.arguments for c in calls]
    # The call goes back through the template's XML rendering.
    follow_up = ASK + [{"role": "assistant", "tool_calls": [calls[0].model_dump(exclude_none=True)]},
                       {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
    assert client.chat.completions.create(model=server.model, messages=follow_up, max_tokens=4).choices[0]
    text = _rendered(xml_model, {"messages": follow_up, "tools": tools})
    args = json.loads(calls[0].function.arguments)
    assert '"name": "get_weather"' in text.split("\n</tools>")[0]
    assert f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{args['city']}\n</parameter>\n" in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


@settings(max_examples=7, **BOUNDED)
@given(schemas=st.lists(parameters(), min_size=1, max_size=2), prompt=_PROMPTS, parallel=st.booleans(),
       temperature=st.sampled_from([0.0, 1.0]), budget=st.integers(0, 60))
def test_forced_xml_tool_calls_always_follow_the_schema(xml_server, schemas, prompt, parallel, temperature, budget):
    """The XML format, like the JSON one: raw strings, JSON strings for pattern/format, JSON values, within
    tight budgets (the shortest call of these schemas is under 240 tokens here)."""
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": s}} for i, s in enumerate(schemas)]
    response = xml_server.openai().chat.completions.create(
        model=xml_server.model, messages=[{"role": "user", "content": prompt}], tools=tools, tool_choice="required",
        parallel_tool_calls=parallel, temperature=temperature, seed=budget, max_tokens=240 + budget,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    _check_calls(choice.message.tool_calls, {t["function"]["name"]: t["function"]["parameters"] for t in tools})
    assert parallel or len(choice.message.tool_calls) == 1


# -- logprobs ---------------------------------------------------------------------------------------------


def test_chat_logprobs_with_mtp_on_and_off_and_streaming(client):
    def ask(mtp: dict):
        request = dict(model="exo-demo", messages=ASK, temperature=0, max_tokens=24, logprobs=True, top_logprobs=3,
                       extra_body={"native_mtp": mtp})
        return client.chat.completions.create(**request).choices[0]

    plain = ask({"enabled": False})
    content = plain.logprobs.content
    assert len(content) == 24 and "".join(t.token for t in content) == plain.message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the likeliest token
        assert bytes(entry.bytes).decode() == entry.token
    for mtp in ({"k": 1}, {"k": 3}):
        other = ask(mtp)
        assert other.message.content == plain.message.content
        for a, b in zip(other.logprobs.content, content, strict=True):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
    chunks = client.chat.completions.create(model="exo-demo", messages=ASK, temperature=0, max_tokens=24, stream=True,
                                            logprobs=True, top_logprobs=3, extra_body={"native_mtp": {"k": 2}})
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)


def test_completion_logprobs(client):
    response = client.completions.create(model="exo-demo", prompt="def fibonacci(n):", max_tokens=8, logprobs=2,
                                         temperature=0)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(lp)
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True))
    stream = client.completions.create(model="exo-demo", prompt="def fibonacci(n):", max_tokens=8, logprobs=2,
                                       temperature=0, stream=True)
    tokens = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens


# -- bad input ----------------------------------------------------------------------------------------------

_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}]}, "messages.1.tool_call_id"),
        ({"messages": ASK + [{"role": "assistant", "tool_calls": [_CALL]}, {"role": "tool", "content": "3"}]},
         "messages.2.tool_call_id"),
        ({"messages": ASK + [{"role": "assistant", "tool_calls": [{**_CALL, "function": {"name": "add",
                                                                                         "arguments": "{oops"}}]}]},
         "messages.1.tool_calls.0.function.arguments"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [_CALL]}]}, "messages.0.tool_calls"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
         "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array",
                                                                                 "uniqueItems": True}}}],
          "tool_choice": "required"}, "tools.0.function.parameters"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools.2.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "dependentRequired": {"a": ["b"]}}}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_agent_input_is_a_400_naming_the_field(demo, body, param):
    with demo.http() as http:
        response = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["message"], error
        # Nothing broke: the next request is served.
        assert http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}).status_code == 200


def test_unsupported_schema_says_why(demo):
    with demo.http() as http:
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
        error = http.post("/v1/chat/completions", json={"messages": ASK, "response_format": fmt}).json()["error"]
        assert "uniqueItems" in error["message"] and error["code"] == "invalid_value"
        # Shown to the model only (tool_choice auto), the same schema is fine: llguidance is lenient there.
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "tags": {"type": "array", "uniqueItems": True}}}}}]
        ok = http.post("/v1/chat/completions", json={"messages": ASK, "tools": tools, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        response = http.post("/v1/completions", json={"prompt": "x", "logprobs": 21})
        assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"
