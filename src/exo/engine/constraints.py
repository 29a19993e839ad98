"""Constrained decoding: a grammar (llguidance) decides which tokens may come next at every position.

A request asks for structure with a ``ConstraintSpec`` (JSON valid against a schema, or one or more calls
of listed tools); where the model lives it becomes a Lark grammar for llguidance (``grammar_for``), in the
tool-call format the model's chat template writes (``tool_format``), compiled against the model's
tokenizer (``compile_grammar``). A ``Matcher`` follows one generation: ``mask()`` is the set of tokens
allowed after everything consumed so far, ``consume`` / ``rollback`` move it, so native MTP's drafts can
be consumed speculatively and rolled back with the caches when the verify call rejects them.

Tool-call formats (Qwen families):
  json (Qwen3, Qwen3-Next; exo's own rendering for templates that render no tools):
      <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>
  xml (Qwen3.5, Qwen3.6, Qwen3-Coder):
      <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx
import numpy as np

ToolFormat = Literal["json", "xml"]

# JSON inside a grammar: one canonical spelling (json.dumps' separators), no free whitespace, so a model
# cannot spin on blanks and the output reads like what chat templates render (``tojson``).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_LENIENT = {"lenient": True}
TOOL_CALL_TAIL = "}\n</tool_call>"
_STRING_ONLY = frozenset(
    {"type", "description", "title", "default", "examples", "enum", "const", "minLength", "maxLength"}
)


class ConstraintError(ValueError):
    """A constraint that cannot be compiled (an invalid schema, one the grammar engine cannot handle)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call: its name and the JSON schema of its arguments (an object)."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True)
class ConstraintSpec:
    """What the output must be. Exactly one of: ``json_schema`` (the whole output is one JSON value valid
    against it) or ``tools`` (the output is one call, or with ``parallel_tool_calls`` one or more calls,
    of these functions, with arguments valid against their schemas)."""

    json_schema: dict[str, Any] | None = None
    tools: tuple[ToolSpec, ...] = ()
    parallel_tool_calls: bool = False
    # Where each schema came from in the request, for errors (e.g. "response_format.json_schema.schema").
    params: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(
            {
                "json_schema": self.json_schema,
                "tools": [{"name": t.name, "parameters": t.parameters} for t in self.tools],
                "parallel_tool_calls": self.parallel_tool_calls,
                "params": list(self.params),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ConstraintSpec:
        data = json.loads(text)
        return cls(
            json_schema=data.get("json_schema"),
            tools=tuple(ToolSpec(t["name"], t["parameters"]) for t in data.get("tools", [])),
            parallel_tool_calls=bool(data.get("parallel_tool_calls", False)),
            params=tuple(data.get("params", ())),
        )


def tool_format(chat_template: str | None) -> ToolFormat:
    """The tool-call format a chat template teaches (xml: Qwen3.5/3.6/Coder; else Qwen3's JSON)."""
    if chat_template and "<function=" in chat_template:
        return "xml"
    return "json"


def check_schema(schema: Any, param: str, *, lenient: bool = False) -> None:
    """Raise ``ConstraintError`` (naming ``param``) if llguidance cannot compile ``schema``.

    ``lenient``: keywords llguidance does not implement are ignored (tools that are only shown to the model);
    otherwise they are an error (a constraint must mean what the schema says)."""
    if not isinstance(schema, dict):
        raise ConstraintError(f"{param} must be a JSON schema object", param)
    problem = _schema_problem(json.dumps(schema, sort_keys=True), lenient)
    if problem is not None:
        raise ConstraintError(f"{param} {problem}", param)


@functools.lru_cache(maxsize=512)
def _schema_problem(schema: str, lenient: bool) -> str | None:
    """Why llguidance cannot compile a schema (None: it can). Cached: agents send the same tools each turn."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides={**_JSON_STYLE, **(_LENIENT if lenient else {})}  # type: ignore[arg-type]
        )
    except (ValueError, TypeError) as e:
        return f"is not a valid JSON schema: {e}"
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return f"cannot be used as a constraint: {_first_line(error)}" if error else None


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else error


def closed(schema: Any, *, inside_all_of: bool = False) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists properties and
    says nothing about others (OpenAI's strict mode): what it accepts is a subset of what ``schema`` accepts,
    and a model cannot wander off into made-up keys. allOf members are left open (closing each would
    forbid the others' properties)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
            out[key] = {k: closed(v) for k, v in value.items()} if isinstance(value, dict) else value
        elif key == "allOf":
            out[key] = [closed(v, inside_all_of=True) for v in value] if isinstance(value, list) else value
        elif key in ("items", "prefixItems", "anyOf", "oneOf", "additionalProperties", "not", "if", "then", "else",
                     "contains", "additionalItems"):
            out[key] = closed(value)
        else:
            out[key] = value
    if (
        not inside_all_of
        and isinstance(out.get("properties"), dict)
        and "additionalProperties" not in out
        and "patternProperties" not in out
        and "unevaluatedProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


def _json_block(schema: dict[str, Any]) -> str:
    schema = closed(schema)
    return "%json " + json.dumps({**schema, "x-guidance": {**schema.get("x-guidance", {}), **_JSON_STYLE}})


def _lark_string(text: str) -> str:
    return json.dumps(text)


def grammar_for(spec: ConstraintSpec, fmt: ToolFormat) -> str:
    """The Lark grammar (llguidance's dialect) of ``spec``; tool calls in the format ``fmt``."""
    if spec.json_schema is not None:
        return "start: " + _json_block(spec.json_schema) + "\n"
    if not spec.tools:
        raise ConstraintError("a constraint needs a schema or at least one tool")
    rules: list[str] = []
    names: list[str] = []
    for i, tool in enumerate(spec.tools):
        param = spec.params[i] if i < len(spec.params) else f"tools.{i}.function.parameters"
        body = _json_call(tool) if fmt == "json" else _xml_call(tool, i, rules, param)
        rules.append(f"call_{i}: {body}")
        names.append(f"call_{i}")
    calls = "call: " + " | ".join(names)
    start = 'start: call ("\\n" call)*' if spec.parallel_tool_calls else "start: call"
    return "\n".join([start, calls, *rules]) + "\n"


def _json_call(tool: ToolSpec) -> str:
    head = _lark_string('<tool_call>\n{"name": ' + json.dumps(tool.name) + ', "arguments": ')
    return f"{head} {_json_block(tool.parameters)} {_lark_string(TOOL_CALL_TAIL)}"


def _xml_call(tool: ToolSpec, index: int, rules: list[str], param: str) -> str:
    """One call in the XML format: every parameter in the schema's order (required ones always)."""
    schema = tool.parameters
    if schema.get("type", "object") != "object" or not isinstance(schema.get("properties", {}), dict):
        raise ConstraintError(
            f"{param}: this model writes tool arguments as XML parameters, which exo can constrain only for an "
            "object schema with properties",
            param,
        )
    properties: dict[str, Any] = schema.get("properties", {})
    required = set(schema.get("required", []))
    defs: dict[str, Any] = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    parts = []
    for j, (name, sub) in enumerate(properties.items()):
        rule = f"p_{index}_{j}"
        value = _xml_value(sub if isinstance(sub, dict) else {}, defs, f"{param}.properties.{name}", rules)
        rules.append(f"{rule}: {_lark_string(f'<parameter={name}>' + chr(10))} {value}")
        parts.append(rule if name in required else f"{rule}?")
    if not properties and schema.get("additionalProperties", True) is not False:
        rules.append(f"p_{index}_any: \"<parameter=\" /[A-Za-z0-9_.-]+/ \">\\n\" {_raw_value(rules, 0, None)}")
        parts.append(f"p_{index}_any*")
    head = _lark_string(f"<tool_call>\n<function={tool.name}>\n")
    tail = _lark_string("</function>\n</tool_call>")
    return " ".join([head, *parts, tail])


def _raw_value(rules: list[str], low: int, high: int | None) -> str:
    """A raw-text parameter value (``low``..``high`` characters) and its closing tag: a lazy lexeme, so it
    ends at the first ``\\n</parameter>``."""
    name = f"raw_value_{low}_{high if high is not None else 'n'}"
    if not any(r.startswith(name + "[") for r in rules):
        count = f"{{{low},{high if high is not None else ''}}}"
        rules.append(f"{name}[lazy]: /(.|\\n){count}\\n<\\/parameter>/ \"\\n\"")
    return name


def _xml_value(schema: dict[str, Any], defs: dict[str, Any], param: str, rules: list[str]) -> str:
    end = _lark_string("\n</parameter>\n")
    if schema.get("type") == "string" and set(schema) <= _STRING_ONLY:
        choices = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
        if choices is not None:
            if not all(isinstance(c, str) for c in choices):
                raise ConstraintError(f"{param}: a string enum must list strings", param)
            return "(" + " | ".join(_lark_string(c) for c in choices) + f") {end}"
        return _raw_value(rules, schema.get("minLength", 0), schema.get("maxLength"))
    if schema.get("type") == "string":
        extra = sorted(set(schema) - _STRING_ONLY)
        raise ConstraintError(
            f"{param}: this model writes string arguments as raw text, which exo cannot constrain with "
            f"{', '.join(extra)}",
            param,
        )
    return f"{_json_block({**schema, **defs})} {end}"


@functools.cache
def _unpack_table() -> np.ndarray:
    return np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool)


_BLANKS = b" \t\r\n"
_QUOTE = ord('"')
_BRACKETS = frozenset(b"}]")
_PUNCTUATION = frozenset(b"}],:")


@dataclass(frozen=True)
class ClosingTokens:
    """Token classes for closing a JSON document when the budget runs out (blanks aside): ``end_string`` close a
    string (a quote, then only closing brackets), ``quotes`` a quote then brackets or separators, ``brackets``
    only close objects and arrays, ``separators`` only brackets, ``,`` and ``:``; ``eos`` end the output."""

    end_string: np.ndarray  # bool [vocab]
    quotes: np.ndarray
    brackets: np.ndarray
    separators: np.ndarray
    eos: np.ndarray
    texts: tuple[bytes, ...]  # every token's bytes (special tokens: empty), for following the JSON state

    @classmethod
    def of(cls, tokenizer: Any, vocab: int) -> ClosingTokens:
        end_string, quotes, brackets, separators, eos = (np.zeros(vocab, dtype=bool) for _ in range(5))
        texts = []
        for token in range(vocab):
            if token >= tokenizer.vocab_size or tokenizer.is_special_token(token):
                eos[token] = token in tokenizer.eos_tokens
                texts.append(b"")
                continue
            raw = tokenizer.decode_bytes([token])
            texts.append(raw)
            text = raw.strip(_BLANKS)
            if not text:
                continue
            if text[0] == _QUOTE and all(b in _PUNCTUATION for b in text[1:]):
                quotes[token] = True
                end_string[token] = all(b in _BRACKETS for b in text[1:])
            elif all(b in _BRACKETS for b in text):
                brackets[token] = separators[token] = True
            elif all(b in _PUNCTUATION for b in text):
                separators[token] = True
        return cls(end_string, quotes, brackets, separators, eos, tuple(texts))


@dataclass(frozen=True)
class JsonState:
    """Where a JSON text stands after some bytes: inside a string (after a backslash), open brackets."""

    in_string: bool = False
    escaped: bool = False
    open: tuple[int, ...] = ()

    def after(self, data: bytes) -> JsonState:
        in_string, escaped, stack = self.in_string, self.escaped, list(self.open)
        for b in data:
            if in_string:
                if escaped:
                    escaped = False
                elif b == 0x5C:  # backslash
                    escaped = True
                elif b == _QUOTE:
                    in_string = False
            elif b == _QUOTE:
                in_string = True
            elif b in (0x7B, 0x5B):  # { [
                stack.append(b)
            elif b in (0x7D, 0x5D) and stack:
                stack.pop()
        return JsonState(in_string, escaped, tuple(stack))


def closing_window(max_tokens: int) -> int:
    """How many tokens before the end of the budget a JSON structure starts closing."""
    return max(6, min(48, max_tokens // 4))


class Matcher:
    """One generation's grammar state (an llguidance matcher) and the token masks it allows.

    With ``closing`` (JSON outputs), the last ``closing_window(max_tokens)`` positions of the budget narrow
    the grammar's mask to the tokens that close what is open, where it allows any: inside a string its
    closing quote; else closing brackets, then separators, then a quote (a required key); at the top level
    the end of the output. So an answer that would run out of tokens mid-value ends as a complete, valid
    document instead. The mask of a position depends only on the tokens before it and its index, as the
    grammar's does, so plain and speculative decoding see the same masks."""

    def __init__(self, grammar: Grammar, max_tokens: int | None = None) -> None:
        import llguidance

        if grammar.template is not None:
            self._matcher = grammar.template.deep_copy()  # a fresh state without parsing the grammar again
        else:
            self._matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0)
        if self._matcher.is_error():
            raise ConstraintError(f"the constraint cannot be compiled: {_first_line(self._matcher.get_error())}")
        self.vocab = grammar.vocab
        self._words = (grammar.tokenizer.vocab_size + 31) // 32
        self.closing = grammar.closing
        window = closing_window(max_tokens) + grammar.frame_tokens if max_tokens is not None else 0
        self.closing_from = None if max_tokens is None else max_tokens - window
        self.consumed = 0  # tokens consumed so far (drafts included until rolled back)
        self.closing_steps = 0  # positions whose mask the closing preference narrowed
        self._json = [JsonState()]  # the JSON state after each consumed token (closing only)
        self.eos = frozenset(grammar.tokenizer.eos_tokens)
        # Tokens taken since an end-of-sequence token (a draft's; the output ends there). They are not given
        # to llguidance, whose rollback does not undo a consumed end of sequence (1.9: the next token fails).
        self._after_eos = 0

    def allowed(self) -> np.ndarray:
        """Bool [vocab]: the tokens allowed next."""
        if self._after_eos:
            only_eos = np.zeros(self.vocab, dtype=bool)
            only_eos[[t for t in self.eos if t < self.vocab]] = True
            return only_eos
        bits = np.empty(self._words, dtype=np.int32)
        self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        allowed = _unpack_table()[bits.view(np.uint8)].reshape(-1)
        if allowed.shape[0] < self.vocab:
            allowed = np.concatenate([allowed, np.zeros(self.vocab - allowed.shape[0], dtype=bool)])
        allowed = allowed[: self.vocab]
        if self.closing is not None and self.closing_from is not None and self.consumed >= self.closing_from:
            state, c = self._json[-1], self.closing
            tiers = ((c.end_string, c.quotes) if state.in_string else (c.brackets, c.separators, c.quotes)
                     if state.open else (c.eos,))
            for preferred in tiers:
                narrowed = allowed & preferred
                if narrowed.any():
                    self.closing_steps += 1
                    return narrowed
        return allowed

    def mask(self) -> mx.array:
        """The allowed tokens as a device bool array [vocab] (computed on the host, from this state)."""
        allowed = self.allowed()
        if not allowed.any():
            raise RuntimeError(f"the grammar allows no token here ({self._matcher.get_error() or 'dead end'})")
        return mx.array(allowed)

    def consume(self, token: int) -> None:
        if self._after_eos or token in self.eos:
            if not self._after_eos and not self._matcher.is_accepting():
                raise RuntimeError("the grammar refused the end of sequence: the output is not complete")
            self._after_eos += 1
        elif not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")
        self.consumed += 1
        if self.closing is not None:
            text = self.closing.texts[token] if token < len(self.closing.texts) else b""
            self._json.append(self._json[-1].after(text))

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        virtual = min(n, self._after_eos)
        self._after_eos -= virtual
        if n > virtual and not self._matcher.rollback(n - virtual):
            raise RuntimeError(f"the grammar could not roll back {n} tokens: {self._matcher.get_error()}")
        self.consumed -= n
        if self.closing is not None:
            del self._json[-n:]

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()


@dataclass(frozen=True)
class Grammar:
    """A constraint compiled for one model's tokenizer: makes a ``Matcher`` per generation."""

    tokenizer: Any  # llguidance.LLTokenizer
    grammar: str
    vocab: int
    closing: ClosingTokens | None = None  # JSON output: how to close it when the budget runs out
    # Tokens of the longest fixed text around a tool call's arguments: the closing window widens by it, so
    # a call started late still fits (and between calls, the end of the output is preferred).
    frame_tokens: int = 0
    template: Any = None  # an llguidance.LLMatcher at the start, copied for each generation

    def matcher(self, max_tokens: int | None = None) -> Matcher:
        return Matcher(self, max_tokens)


def compile_grammar(
    spec: ConstraintSpec, tokenizer: Any, vocab: int, fmt: ToolFormat, closing: ClosingTokens | None = None
) -> Grammar:
    """``spec`` as a grammar for this tokenizer (an ``llguidance.LLTokenizer``); ConstraintError if it cannot.

    ``closing``: the tokenizer's ``ClosingTokens``, used when the output is JSON (a schema, or tool calls in
    the JSON format)."""
    import llguidance

    for i, tool in enumerate(spec.tools):
        check_schema(tool.parameters, spec.params[i] if i < len(spec.params) else f"tools.{i}.function.parameters")
    if spec.json_schema is not None:
        check_schema(spec.json_schema, spec.params[0] if spec.params else "response_format")
    lark = grammar_for(spec, fmt)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        param = spec.params[0] if len(spec.params) == 1 else None
        raise ConstraintError(f"the constraint cannot be compiled: {_first_line(error)}", param)
    json_output = spec.json_schema is not None or fmt == "json"
    frame = max((len(tokenizer.tokenize_str(_json_frame(t))) for t in spec.tools), default=0)
    template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if template.is_error():
        raise ConstraintError(f"the constraint cannot be compiled: {_first_line(template.get_error())}")
    return Grammar(tokenizer, grammar, vocab, closing if json_output else None, frame, template)


def _json_frame(tool: ToolSpec) -> str:
    return '<tool_call>\n{"name": ' + json.dumps(tool.name) + ', "arguments": ' + TOOL_CALL_TAIL
