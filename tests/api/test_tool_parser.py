"""The tool-call parser alone (no model): both Qwen formats, text around calls kept as content, and the same
result however the text is split into streamed pieces (which is what makes streamed and whole answers agree)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exo.api.tools import Arguments, CallStart, Content, ToolCallParser

TOOLS = [{"type": "function", "function": {"name": "write", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "lines": {"type": "integer"}, "opts": {"type": "object"}}}}}]

CASES = {
    "json": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris \\"x\\"", "n": [1, {"a": 2}]}}'
        '\n</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": 'Pa}ris "x"', "n": [1, {"a": 2}]}), ("noop", {})],
    ),
    "xml": (
        "I will write it.\n\n<tool_call>\n<function=write>\n<parameter=path>\n/tmp/a b.txt\n</parameter>\n"
        '<parameter=lines>\n12\n</parameter>\n<parameter=opts>\n{"mode": "w"}\n</parameter>\n</function>\n'
        "</tool_call>",
        "I will write it.",
        [("write", {"path": "/tmp/a b.txt", "lines": 12, "opts": {"mode": "w"}})],
    ),
    "text_after": ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\nDone.', "Done.", [("f", {"x": 1})]),
    "no_call": ("plain text that mentions <tool_ and <tool_call without closing", None, []),
    "not_a_call": ("before <tool_call>nonsense</tool_call> after", None, []),
    "late_name": ('<tool_call>\n{"arguments": {"x": 1}, "name": "late"}\n</tool_call>', "", [("late", {"x": 1})]),
}


def _run(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]], list]:
    parser = ToolCallParser(TOOLS)
    events, start = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[start:cut])
        start = cut
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    return content, [(c.name, c.arguments) for c in parser.calls], events


@pytest.mark.parametrize("name", list(CASES))
def test_formats_and_content(name):
    text, content, calls = CASES[name]
    got_content, got_calls, events = _run(text, [])
    assert got_content == (text if content is None else content)
    assert [(n, json.loads(a)) for n, a in got_calls] == calls
    for event in events:  # per call: its start (index, id, name) before any of its arguments
        if isinstance(event, Arguments):
            assert any(isinstance(e, CallStart) and e.index == event.index for e in events[: events.index(event)])


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(name=st.sampled_from(list(CASES)), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_split_gives_the_same_answer(name, cuts):
    text = CASES[name][0]
    whole = _run(text, [])
    split = _run(text, [c % (len(text) + 1) for c in cuts])
    assert split[:2] == whole[:2]


def test_char_by_char_streams_arguments_in_fragments():
    text = CASES["json"][0]
    _, calls, events = _run(text, list(range(len(text))))
    fragments = [e for e in events if isinstance(e, Arguments) and e.index == 0]
    assert len(fragments) > 5 and "".join(f.fragment for f in fragments) == calls[0][1]


def test_an_unfinished_call_keeps_what_it_has():
    content, calls, _ = _run('Sure <tool_call>\n{"name": "f", "arguments": {"a": "unfini', [])
    assert content == "Sure" and calls == [("f", '{"a": "unfini')]


def test_xml_string_with_pattern_or_format_is_read_back_from_its_json_string():
    """exo constrains such a parameter as a JSON string (llguidance enforces pattern/format there)."""
    tools = [{"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
        "when": {"type": "string", "format": "date"}, "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "note": {"type": "string"}}}}}]
    parser = ToolCallParser(tools)
    parser.feed('<tool_call>\n<function=book>\n<parameter=when>\n"2024-05-01"\n</parameter>\n<parameter=code>\n'
                'ABC\n</parameter>\n<parameter=note>\n"quoted"\n</parameter>\n</function>\n</tool_call>')
    parser.finish()
    assert json.loads(parser.calls[0].arguments) == {"when": "2024-05-01", "code": "ABC", "note": '"quoted"'}
