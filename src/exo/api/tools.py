"""Tool calling and structured output on ``/v1/chat/completions``: requests in, tool calls out.

In: ``chat_messages`` turns OpenAI messages (assistant ``tool_calls``, ``tool`` results) into what chat
templates read, checking that every tool result answers an earlier call; ``tool_definitions`` the tools;
``constraint_for`` what the output must follow (a forced call of the listed functions: ``tool_choice``
"required" or a named function; JSON: ``response_format``), checking each schema with the grammar engine
(400s name the field).

Out: ``ToolCallParser`` splits generated text into content and calls, incrementally, for both formats the
Qwen families write (a JSON object, or XML ``<function=...>`` / ``<parameter=...>`` blocks, inside
``<tool_call>...</tool_call>``). It emits OpenAI's streaming events (a call's index, id and name once,
then its arguments in fragments); a whole answer is the same parser run over the whole text, so streaming
and non-streaming clients see the same calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from exo.engine.constraints import ConstraintError, ConstraintSpec, ToolSpec, check_schema

from .errors import APIError
from .schemas import ChatCompletionRequest, NamedToolChoice

START = "<tool_call>"
END = "</tool_call>"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# -- requests ------------------------------------------------------------------------------------------


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as chat templates read them (arguments as objects, tool results named after their call)."""
    out: list[dict[str, Any]] = []
    calls: dict[str, str] = {}  # call id -> function name, from earlier assistant messages
    pending: tuple[int, list[str]] | None = None  # the last assistant message with calls, its unanswered ids
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        if m.role != "tool" and pending is not None:
            _unanswered(pending, i)
            pending = None
        content = _text(m.content)
        role = "system" if m.role == "developer" else m.role  # chat templates know "system"
        if m.tool_calls is not None and role != "assistant":
            raise _invalid(f"{where}.tool_calls", f"{where}: only assistant messages carry tool_calls")
        if m.tool_call_id is not None and role != "tool":
            raise _invalid(f"{where}.tool_call_id", f"{where}: only tool messages carry a tool_call_id")
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.tool_calls:
            rendered = []
            for j, call in enumerate(m.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError:
                    arguments = None
                if not isinstance(arguments, dict):
                    raise _invalid(
                        f"{where}.tool_calls.{j}.function.arguments",
                        f"{where}.tool_calls.{j}.function.arguments must be a JSON object (in a string)",
                    )
                calls[call.id] = call.function.name
                rendered.append(
                    {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
                )
            message["tool_calls"] = rendered
            message["content"] = content or ""
            pending = (i, [call.id for call in m.tool_calls])
        elif role == "tool":
            if m.tool_call_id is None:
                raise _invalid(f"{where}.tool_call_id", f"{where}.tool_call_id: required on tool messages",
                               "missing_required_parameter")
            if m.tool_call_id not in calls:
                raise _invalid(
                    f"{where}.tool_call_id",
                    f"{where}.tool_call_id {m.tool_call_id!r} answers no tool call of an earlier assistant message",
                )
            message["tool_call_id"] = m.tool_call_id
            message["name"] = calls[m.tool_call_id]
            if pending is not None and m.tool_call_id in pending[1]:
                pending[1].remove(m.tool_call_id)
        if message["content"] is None:
            raise _invalid(f"{where}.content", f"{where}.content: required", "missing_required_parameter")
        if m.name is not None and role != "tool":
            message["name"] = m.name
        out.append(message)
    if pending is not None:
        _unanswered(pending, None)
    return out


def _unanswered(pending: tuple[int, list[str]], before: int | None) -> None:
    """OpenAI's rule: an assistant message's tool_calls are each answered by a tool message before the next
    turn."""
    index, ids = pending
    if ids:
        where = f"before messages.{before}" if before is not None else "at the end of the messages"
        raise _invalid(
            f"messages.{index}.tool_calls",
            f"messages.{index} has tool_calls that no tool message answers {where}: "
            f"{', '.join(repr(i) for i in ids)} (each call needs a tool message with its tool_call_id)",
        )


def tool_definitions(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools for the chat template (None: none), each parameters schema checked."""
    if not req.tools:
        if req.tool_choice is not None:
            raise _invalid("tool_choice", "tool_choice is only allowed when tools are given")
        if req.parallel_tool_calls is not None:
            raise _invalid("parallel_tool_calls", "parallel_tool_calls is only allowed when tools are given")
        return None
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(req.tools):
        fn = tool.function
        if fn.name in seen:
            raise _invalid(f"tools.{i}.function.name", f"tools.{i}.function.name: {fn.name!r} is listed twice")
        seen.add(fn.name)
        parameters = fn.parameters if fn.parameters is not None else EMPTY_PARAMETERS
        _check(parameters, f"tools.{i}.function.parameters", lenient=True)
        definition: dict[str, Any] = {"name": fn.name}
        if fn.description is not None:
            definition["description"] = fn.description
        definition["parameters"] = parameters
        out.append({"type": "function", "function": definition})
    return out


def _check(schema: Any, param: str, *, lenient: bool = False) -> None:
    try:
        check_schema(schema, param, lenient=lenient)
    except ConstraintError as e:
        raise _invalid(param, str(e)) from None


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_choice(req: ChatCompletionRequest) -> ToolChoice:
    if req.tool_choice is not None:
        return req.tool_choice
    return "auto" if req.tools else "none"


def parses_tool_calls(req: ChatCompletionRequest) -> bool:
    """Whether the answer's text is searched for tool calls."""
    return bool(req.tools) and tool_choice(req) != "none"


def constraint_for(req: ChatCompletionRequest) -> ConstraintSpec | None:
    """What the output must follow: a forced tool call, JSON (response_format), or nothing."""
    choice = tool_choice(req)
    tools = req.tools or []
    if choice == "required" or isinstance(choice, NamedToolChoice):
        if not tools:
            raise _invalid("tool_choice", "tool_choice asks for a tool call but tools lists no function")
        indices = list(range(len(tools)))
        if isinstance(choice, NamedToolChoice):
            indices = [i for i, t in enumerate(tools) if t.function.name == choice.function.name]
            if not indices:
                names = ", ".join(repr(t.function.name) for t in tools)
                raise _invalid(
                    "tool_choice.function.name",
                    f"tool_choice names {choice.function.name!r}, which is not in tools ({names})",
                )
        specs, params = [], []
        for i in indices:
            fn = tools[i].function
            param = f"tools.{i}.function.parameters"
            parameters = fn.parameters if fn.parameters is not None else EMPTY_PARAMETERS
            _check(parameters, param)
            specs.append(ToolSpec(fn.name, parameters))
            params.append(param)
        parallel = req.parallel_tool_calls is not False and not isinstance(choice, NamedToolChoice)
        return ConstraintSpec(tools=tuple(specs), parallel_tool_calls=parallel, params=tuple(params))
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ConstraintSpec(json_schema={"type": "object"}, params=("response_format",))
    schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {"type": "object"}
    _check(schema, "response_format.json_schema.schema")
    return ConstraintSpec(json_schema=schema, params=("response_format.json_schema.schema",))


def logprobs_for(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise _invalid("top_logprobs", "top_logprobs needs logprobs: true")
    return (req.top_logprobs or 0) if req.logprobs else None


# -- responses -----------------------------------------------------------------------------------------


@dataclass
class ParsedCall:
    index: int
    id: str
    name: str
    arguments: str = ""


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    fragment: str


Event = Content | CallStart | Arguments

_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*', re.DOTALL)
_XML_HEAD = re.compile(r"\s*<function=([^>\n]+)>\n?")
_XML_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_XML_CLOSE = re.compile(r"\s*</function>")


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class _Block:
    """One <tool_call> block being read."""

    body: str = ""
    blanks: str = ""  # the whitespace before the block (kept if it is not a call after all)
    call: ParsedCall | None = None
    kind: Literal["json", "xml"] | None = None
    args_start: int = 0  # json: where the arguments value starts in body
    scanned: int = 0  # json: how far the value has been scanned
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    args_end: int | None = None
    position: int = 0  # xml: how far parameters have been read
    params: int = 0
    closed: bool = False  # xml: </function> seen


@dataclass
class ToolCallParser:
    """Content and tool calls out of generated text, fed piece by piece (``feed``, then ``finish``)."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    calls: list[ParsedCall] = field(default_factory=list)
    _buffer: str = ""  # text not yet classified (outside a block: a possible start tag, held whitespace)
    _block: _Block | None = None
    _after_block: bool = False  # whitespace after a block is dropped (however the text is split)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if self._block is None:
                if self._after_block:
                    self._buffer = self._buffer.lstrip()
                    if not self._buffer:
                        return events
                    self._after_block = False
                at = self._buffer.find(START)
                if at < 0:
                    keep = _partial_suffix(self._buffer, START)
                    cut = len(self._buffer) - keep
                    head = self._buffer[:cut]
                    stripped = head.rstrip()
                    if stripped:  # trailing whitespace waits: it is dropped if a call follows
                        events.append(Content(stripped))
                        self._buffer = self._buffer[len(stripped) :]
                    return events
                before = self._buffer[:at].rstrip()
                if before:
                    events.append(Content(before))
                self._block = _Block(blanks=self._buffer[len(before) : at])
                self._buffer = self._buffer[at + len(START) :]
                continue
            at = self._buffer.find(END)
            if at < 0:
                keep = _partial_suffix(self._buffer, END)
                cut = len(self._buffer) - keep
                self._block.body += self._buffer[:cut]
                self._buffer = self._buffer[cut:]
                events.extend(self._advance(final=False))
                return events
            self._block.body += self._buffer[:at]
            self._buffer = self._buffer[at + len(END) :]
            events.extend(self._advance(final=True, closing=END))
            self._after_block = self._block.call is not None
            self._block = None

    def finish(self) -> list[Event]:
        """The end of the output: an unfinished call is closed with what it has; other text is content."""
        events: list[Event] = []
        if self._block is not None:
            self._block.body += self._buffer
            self._buffer = ""
            events.extend(self._advance(final=True, closing=""))
            self._block = None
        rest = self._buffer if not self.calls else self._buffer.strip()
        if rest:
            events.append(Content(rest))
        self._buffer = ""
        return events

    # -- one block --------------------------------------------------------------------------------------
    def _advance(self, *, final: bool, closing: str = "") -> list[Event]:
        """Read what the block has so far; ``final``: it is complete (``closing`` ended it)."""
        block = self._block
        assert block is not None
        if block.kind is None:
            stripped = block.body.lstrip()
            if stripped.startswith("{"):
                block.kind = "json"
            elif stripped.startswith("<"):
                block.kind = "xml"
        events: list[Event] = []
        if block.kind == "json":
            events = self._advance_json(block, final)
        elif block.kind == "xml":
            events = self._advance_xml(block, final)
        if final and block.call is None:
            # Not a call after all: the block's text is content, as written.
            events.append(Content(block.blanks + START + block.body + closing))
        return events

    def _start(self, block: _Block, name: str) -> CallStart:
        call = ParsedCall(len(self.calls), _new_id(), name)
        self.calls.append(call)
        block.call = call
        return CallStart(call.index, call.id, call.name)

    def _arguments(self, block: _Block, fragment: str) -> list[Event]:
        if not fragment:
            return []
        assert block.call is not None
        block.call.arguments += fragment
        return [Arguments(block.call.index, fragment)]

    def _advance_json(self, block: _Block, final: bool) -> list[Event]:
        events: list[Event] = []
        if block.call is None:
            match = _JSON_HEAD.match(block.body)
            if match is not None and match.end() == len(block.body) and not final:
                match = None  # the blanks before the value may go on: wait for its first character
            if match is None:
                if final:
                    return self._json_whole(block)
                return events
            try:
                name = json.loads(match.group(1))
            except ValueError:
                name = match.group(1).strip('"')
            events.append(self._start(block, name))
            block.args_start = block.scanned = match.end()
        end = self._scan_json(block)
        stop = end if end is not None else len(block.body)
        if final and end is None:
            # Unfinished (or unusual) arguments: what is there, without the object's closing brace.
            stop = block.args_start + len(block.body[block.args_start :].rstrip().removesuffix("}").rstrip())
        done = len(block.call.arguments) if block.call else 0
        events.extend(self._arguments(block, block.body[block.args_start + done : stop]))
        return events

    def _json_whole(self, block: _Block) -> list[Event]:
        """A JSON call whose name does not come first: read it whole at its end."""
        try:
            data = json.loads(block.body)
        except ValueError:
            return []
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return []
        arguments = data.get("arguments", data.get("parameters", {}))
        events: list[Event] = [self._start(block, data["name"])]
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return events + self._arguments(block, text)

    def _scan_json(self, block: _Block) -> int | None:
        """Where the arguments value ends in the body (None: not yet)."""
        if block.args_end is not None:
            return block.args_end
        body = block.body
        i = block.scanned
        while i < len(body):
            ch = body[i]
            i += 1
            if block.in_string:
                if block.escaped:
                    block.escaped = False
                elif ch == "\\":
                    block.escaped = True
                elif ch == '"':
                    block.in_string = False
                    if block.depth == 0:
                        block.args_end = i
                        break
            elif ch == '"':
                block.in_string = True
            elif ch in "{[":
                block.depth += 1
            elif ch in "}]":
                block.depth -= 1
                if block.depth <= 0:
                    block.args_end = i
                    break
            elif block.depth == 0 and ch in ",}":
                block.args_end = i - 1
                break
        block.scanned = i
        return block.args_end

    def _advance_xml(self, block: _Block, final: bool) -> list[Event]:
        events: list[Event] = []
        if block.call is None:
            match = _XML_HEAD.match(block.body)
            if match is None:
                return events
            events.append(self._start(block, match.group(1).strip()))
            block.position = match.end()
        properties = _properties(self.tools, block.call.name if block.call else "")
        while not block.closed:
            match = _XML_PARAM.match(block.body, block.position)
            if match is None:
                close = _XML_CLOSE.match(block.body, block.position)
                if close is not None:
                    block.closed = True
                    block.position = close.end()
                break
            name = match.group(1).strip()
            value = _convert(match.group(2), properties.get(name))
            prefix = "{" if block.params == 0 else ", "
            events.extend(self._arguments(block, prefix + json.dumps(name) + ": " + json.dumps(value, ensure_ascii=False)))
            block.params += 1
            block.position = match.end()
        if final:
            events.extend(self._arguments(block, "}" if block.params else "{}"))
        return events


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _properties(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for tool in tools:
        fn = tool.get("function", {})
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties")
            return props if isinstance(props, dict) else {}
    return {}


def _convert(raw: str, schema: Any) -> Any:
    """An XML parameter's text as the JSON value its schema asks for (strings stay as written, except one
    with a ``pattern`` or ``format`` written as a JSON string, as exo's constraint writes it)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        if ("pattern" in schema or "format" in schema) and raw.startswith('"') and raw.endswith('"'):
            try:
                value = json.loads(raw)
            except ValueError:
                return raw
            return value if isinstance(value, str) else raw
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw
