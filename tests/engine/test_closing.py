"""Constrained outputs always finish within their budget (engine/closing.py), on the bundled demo model.

Property-based over generated schemas (tests/fixtures/schemas.py) and small budgets, from the constraint's
shortest document up: a json_schema output, and forced tool calls in both formats (Qwen3's JSON, Qwen3.5's
XML parameters), greedy and sampled, native MTP on and off: the output ends with the end of sequence within
the budget, parses, and validates against the schema (jsonschema).
"""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exo.api.tools import ToolCallParser
from exo.cards import bundled_model_dir
from exo.engine import Engine, GenerationRequest, SamplingParams
from exo.engine.constraints import ConstraintSpec, ToolSpec
from exo.engine.prompt import tokenize
from tests.fixtures.engines import fresh_engine, loaded_model
from tests.fixtures.schemas import BOUNDED, parameters

FIVE = {"type": "object", "properties": {k: {"type": "string"} for k in ("first", "second", "third", "fourth", "fifth")},
        "required": ["first", "second", "third", "fourth", "fifth"]}


def _engine() -> Engine:
    return fresh_engine(bundled_model_dir("exo-demo"))


@pytest.fixture
def demo() -> Engine:
    return _engine()


@functools.cache
def _prompt(text: str) -> list[int]:
    return tokenize(loaded_model(bundled_model_dir("exo-demo")).tokenizer, messages=[{"role": "user", "content": text}])


def _check(spec: ConstraintSpec, text: str) -> None:
    if spec.json_schema is not None:
        jsonschema.validate(json.loads(text), spec.json_schema)
        return
    tools = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in spec.tools]
    parser = ToolCallParser(tools)
    events = parser.feed(text) + parser.finish()
    assert parser.calls and not [e for e in events if getattr(e, "text", "").strip()], text
    schemas = {t.name: t.parameters for t in spec.tools}
    for call in parser.calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def _run(engine: Engine, spec: ConstraintSpec, fmt: str, extra: int, temperature: float, mtp: bool, prompt: str):
    grammar = engine.grammar(spec, fmt)
    assert grammar.min_tokens is not None
    budget = grammar.min_tokens + extra
    request = GenerationRequest(_prompt(prompt), max_tokens=budget, native_mtp="auto" if mtp else "off", constraint=grammar,
                                sampling=SamplingParams(temperature=temperature, seed=extra))
    result = engine.complete(request)
    assert result.finish_reason == "stop" and len(result.token_ids) <= budget, (spec.to_json(), budget, result.text)
    _check(spec, result.text)
    return result


def test_five_required_strings_in_48_tokens(demo):
    """The audit's case: fixed text the required keys need is counted, so the answer closes in time."""
    spec = ConstraintSpec(json_schema=FIVE)
    assert demo.grammar(spec, "json").min_tokens <= 48
    for temperature in (0.0, 1.0):
        for mtp in (False, True):
            grammar = demo.grammar(spec, "json")
            result = demo.complete(GenerationRequest(
                _prompt("Tell me a long story."), max_tokens=48, native_mtp="auto" if mtp else "off",
                sampling=SamplingParams(temperature=temperature, seed=3), constraint=grammar))
            assert result.finish_reason == "stop", result.text
            jsonschema.validate(json.loads(result.text), FIVE)


_PROMPTS = st.sampled_from(["Hello", "Call the tool.", "Write a long essay about Rome.", "def f(x):"])
_RUNS = dict(extra=st.integers(0, 24), temperature=st.sampled_from([0.0, 1.0]), mtp=st.booleans(), prompt=_PROMPTS)


@settings(max_examples=60, **BOUNDED)
@given(schema=parameters(), **_RUNS)
def test_json_schema_outputs_finish_within_any_budget(demo, schema, extra, temperature, mtp, prompt):
    spec = ConstraintSpec(json_schema=schema)
    _run(demo, spec, "json", extra, temperature, mtp, prompt)


@settings(max_examples=40, **BOUNDED)
@given(schemas=st.lists(parameters(), min_size=1, max_size=2), fmt=st.sampled_from(["json", "xml"]),
       parallel=st.booleans(), **_RUNS)
def test_forced_tool_calls_finish_within_any_budget(demo, schemas, fmt, parallel, extra, temperature, mtp, prompt):
    spec = ConstraintSpec(tools=tuple(ToolSpec(f"tool_{i}", s) for i, s in enumerate(schemas)),
                          parallel_tool_calls=parallel)
    _run(demo, spec, fmt, extra, temperature, mtp, prompt)


def test_closing_is_the_same_with_mtp_on_and_off(demo):
    """Masks near the end of the budget depend only on the tokens before them: greedy outputs agree."""
    spec = ConstraintSpec(tools=(ToolSpec("f", FIVE),))
    for fmt in ("json", "xml"):
        grammar = demo.grammar(spec, fmt)
        for budget in (grammar.min_tokens, grammar.min_tokens + 7, grammar.min_tokens + 20):
            outputs = [demo.complete(GenerationRequest(_prompt("Write a long essay."), max_tokens=budget, mtp_k=k,
                                                       native_mtp="off" if k is None else "auto", constraint=grammar))
                       for k in (None, 1, 3)]
            assert outputs[0].finish_reason == "stop"
            _check(spec, outputs[0].text)
            assert all(o.token_ids == outputs[0].token_ids for o in outputs), (fmt, budget)


def test_json_object_closes_at_any_budget(demo):
    """response_format json_object: any object, closed in time from its shortest ({}) up."""
    spec = ConstraintSpec(json_schema={"type": "object"})
    grammar = demo.grammar(spec, "json")
    for budget in range(grammar.min_tokens, grammar.min_tokens + 12, 3):
        for temperature in (0.0, 1.0):
            result = demo.complete(GenerationRequest(
                _prompt("Describe Rome as JSON."), max_tokens=budget, constraint=grammar,
                sampling=SamplingParams(temperature=temperature, seed=budget)))
            assert result.finish_reason == "stop" and len(result.token_ids) <= budget, result.text
            assert isinstance(json.loads(result.text), dict)
