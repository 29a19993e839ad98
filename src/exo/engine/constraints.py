"""Constrained decoding: a grammar (llguidance) decides which tokens may come next at every position.

A request asks for structure with a ``ConstraintSpec`` (JSON valid against a schema, or one or more calls
of listed tools); where the model lives it becomes a Lark grammar for llguidance (``grammar_for``), in the
tool-call format the model's chat template writes (``tool_format``), compiled against the model's
tokenizer (``compile_grammar``). A ``Matcher`` follows one generation: ``mask()`` is the set of tokens
allowed after everything consumed so far, ``consume`` / ``rollback`` move it, so native MTP's drafts can
be consumed speculatively and rolled back with the caches when the verify call rejects them. With the
tokenizer's ``ClosingTokens`` the output also finishes within its budget (``closing.py``).

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

from .closing import MARGIN, ClosingTokens, candidates, completion_tokens, subschemas

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


def _declares_keys(schema: Any) -> bool:
    """Whether a schema may say which keys an object has (so closing its neighbours could forbid them)."""
    return isinstance(schema, dict) and any(
        k in schema for k in ("properties", "patternProperties", "additionalProperties", "required", "$ref",
                              "anyOf", "oneOf", "allOf")
    )


def closed(schema: Any, *, keep_open: bool = False) -> Any:
    """``schema`` with ``additionalProperties: false`` on object schemas that list properties and say nothing
    about others (OpenAI's strict mode): what it accepts is a subset of what ``schema`` accepts, and a model
    cannot wander off into made-up keys. Only where that keeps the schema satisfiable: an object whose
    anyOf / oneOf / allOf members (or a sibling ``$ref``) declare keys of their own stays open, and so do
    those members (each side would forbid the other's keys); a required key that ``properties`` does not
    list is added to them (any value)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    members = [m for c in ("anyOf", "oneOf", "allOf") if isinstance(schema.get(c), list) for m in schema[c]]
    shared = isinstance(schema.get("properties"), dict) or "$ref" in schema or "required" in schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
            out[key] = {k: closed(v) for k, v in value.items()} if isinstance(value, dict) else value
        elif key == "allOf" or (key in ("anyOf", "oneOf") and shared):
            out[key] = [closed(v, keep_open=True) for v in value] if isinstance(value, list) else value
        elif key in ("items", "prefixItems", "anyOf", "oneOf", "additionalProperties", "not", "if", "then", "else",
                     "contains", "additionalItems"):
            out[key] = closed(value)
        else:
            out[key] = value
    if (
        not keep_open
        and isinstance(out.get("properties"), dict)
        and not any(k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties", "$ref"))
        and not any(_declares_keys(m) for m in members)
    ):
        required = out.get("required")
        listed = out["properties"]
        missing = [k for k in required if isinstance(k, str) and k not in listed] if isinstance(required, list) else []
        if missing:
            out["properties"] = {**listed, **{k: {} for k in missing}}
        out["additionalProperties"] = False
    return out


def _json_block(schema: dict[str, Any]) -> str:
    """``schema`` as an inline JSON grammar, closed (``closed``) unless closing is what makes it unusable."""
    strict = closed(schema)
    if strict != schema and _schema_problem(json.dumps(strict, sort_keys=True), False) is not None:
        if _schema_problem(json.dumps(schema, sort_keys=True), False) is None:
            strict = schema
    return "%json " + json.dumps({**strict, "x-guidance": {**strict.get("x-guidance", {}), **_JSON_STYLE}})


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
    """A parameter's value: raw text for a plain string (an enum: one of its values); a JSON string for a
    string with a ``pattern`` or ``format`` (llguidance enforces them there; the parser reads it back); any
    other schema as JSON."""
    end = _lark_string("\n</parameter>\n")
    if schema.get("type") == "string" and set(schema) <= _STRING_ONLY:
        choices = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
        if choices is not None:
            if not all(isinstance(c, str) for c in choices):
                raise ConstraintError(f"{param}: a string enum must list strings", param)
            return "(" + " | ".join(_lark_string(c) for c in choices) + f") {end}"
        return _raw_value(rules, schema.get("minLength", 0), schema.get("maxLength"))
    if schema.get("type") == "string" and not set(schema) <= _STRING_ONLY | {"pattern", "format"}:
        extra = sorted(set(schema) - _STRING_ONLY - {"pattern", "format"})
        raise ConstraintError(
            f"{param}: this model writes string arguments as raw text, which exo cannot constrain with "
            f"{', '.join(extra)}",
            param,
        )
    return f"{_json_block({**schema, **defs})} {end}"


@functools.cache
def _unpack_table() -> np.ndarray:
    return np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool)


class Matcher:
    """One generation's grammar state (an llguidance matcher) and the token masks it allows.

    With ``closing`` and a budget (``closing.py``), every output ends complete within ``max_tokens``: once
    the shortest completion of the state (and the end of sequence) takes all but ``MARGIN`` of the positions
    left, it is forced token by token; before that, near the end, a token after which the output would need
    more than is left is masked out. A position's mask depends only on the tokens before it and its index,
    as the grammar's does, so plain and speculative decoding see the same masks."""

    def __init__(self, grammar: Grammar, max_tokens: int | None = None) -> None:
        import llguidance

        if grammar.template is not None:
            self._matcher = grammar.template.deep_copy()  # a fresh state without parsing the grammar again
        else:
            self._matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0)
        if self._matcher.is_error():
            raise ConstraintError(f"the constraint cannot be compiled: {_first_line(self._matcher.get_error())}")
        self.vocab = grammar.vocab
        self._tokenizer = grammar.tokenizer
        self._words = (grammar.tokenizer.vocab_size + 31) // 32
        self.closing = grammar.closing if grammar.min_tokens is not None else None
        self.max_tokens = max_tokens
        self.zone = grammar.zone
        self.consumed = 0  # tokens consumed so far (drafts included until rolled back)
        self._plan: tuple[int, tuple[int, ...]] | None = None  # (from position, tokens): the forced completion
        self._need_at: tuple[int, int] | None = None  # (position, tokens needed there): the last measured
        self.eos = frozenset(grammar.tokenizer.eos_tokens)
        # Tokens taken since an end-of-sequence token (a draft's; the output ends there). They are not given
        # to llguidance, whose rollback does not undo a consumed end of sequence (1.9: the next token fails).
        self._after_eos = 0

    def _only(self, tokens: Any) -> np.ndarray:
        out = np.zeros(self.vocab, dtype=bool)
        out[[t for t in tokens if t < self.vocab]] = True
        return out

    def allowed(self) -> np.ndarray:
        """Bool [vocab]: the tokens allowed next."""
        if self._after_eos:
            return self._only(self.eos)
        if self._plan is not None:
            start, tokens = self._plan
            at = self.consumed - start
            return self._only([tokens[at]] if at < len(tokens) else self.eos)
        bits = np.empty(self._words, dtype=np.int32)
        self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        allowed = _unpack_table()[bits.view(np.uint8)].reshape(-1)
        if allowed.shape[0] < self.vocab:
            allowed = np.concatenate([allowed, np.zeros(self.vocab - allowed.shape[0], dtype=bool)])
        allowed = allowed[: self.vocab]
        if self.closing is not None and self.max_tokens is not None:
            allowed = self._within_budget(allowed, self.max_tokens - self.consumed)
        return allowed

    def _need(self) -> int | None:
        """Tokens the output needs from here (its shortest completion and the end of sequence)."""
        assert self.closing is not None
        tokens = completion_tokens(self._matcher, self.closing, self._tokenizer)
        return None if tokens is None else len(tokens) + 1

    def _within_budget(self, allowed: np.ndarray, left: int) -> np.ndarray:
        assert self.closing is not None
        if self._need_at is not None:
            # One token adds at most ``zone`` to what is needed: far from the end, no need to measure (the
            # mask is what measuring would give, so it does not depend on where it was last measured).
            at, before = self._need_at
            if left - (before + (self.consumed - at) * self.zone) > self.zone + MARGIN:
                return allowed
        tokens = completion_tokens(self._matcher, self.closing, self._tokenizer)
        if tokens is None:
            return allowed
        need = len(tokens) + 1
        self._need_at = (self.consumed, need)
        if need >= left - MARGIN:
            self._plan = (self.consumed, tuple(tokens))
            return self._only(tokens[:1] or self.eos)
        if left - need > self.zone:
            return allowed
        narrowed = allowed.copy()
        for token in np.flatnonzero(candidates(allowed, self._matcher, self.closing)):
            if not self._matcher.consume_token(int(token)):
                continue
            after = self._need()
            self._matcher.rollback(1)
            if after is None or after > left - 1:
                narrowed[token] = False
        if narrowed.any():
            if not np.array_equal(narrowed, allowed):
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

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        virtual = min(n, self._after_eos)
        self._after_eos -= virtual
        if n > virtual and not self._matcher.rollback(n - virtual):
            raise RuntimeError(f"the grammar could not roll back {n} tokens: {self._matcher.get_error()}")
        self.consumed -= n
        if self._plan is not None and self.consumed < self._plan[0]:
            self._plan = None
        if self._need_at is not None and self.consumed < self._need_at[0]:
            self._need_at = None

    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()


@dataclass(frozen=True)
class Grammar:
    """A constraint compiled for one model's tokenizer: makes a ``Matcher`` per generation."""

    tokenizer: Any  # llguidance.LLTokenizer
    grammar: str
    vocab: int
    closing: ClosingTokens | None = None  # how to finish the output within its budget
    # The shortest output (tokens, the end of sequence included): a smaller budget cannot hold one. None: not
    # known (no closing guarantee).
    min_tokens: int | None = None
    zone: int = 0  # tokens: the most one token can add to what the output needs (closing.py)
    template: Any = None  # an llguidance.LLMatcher at the start, copied for each generation

    def matcher(self, max_tokens: int | None = None) -> Matcher:
        return Matcher(self, max_tokens)


def compile_grammar(
    spec: ConstraintSpec, tokenizer: Any, vocab: int, fmt: ToolFormat, closing: ClosingTokens | None = None
) -> Grammar:
    """``spec`` as a grammar for this tokenizer (an ``llguidance.LLTokenizer``); ConstraintError if it cannot.

    ``closing``: the tokenizer's ``ClosingTokens``: outputs then finish within their budget."""
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
    template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if template.is_error():
        raise ConstraintError(f"the constraint cannot be compiled: {_first_line(template.get_error())}")
    min_tokens, zone = None, 0
    if closing is not None:
        start = completion_tokens(template, closing, tokenizer)
        if start is not None:
            min_tokens = len(start) + 1
            zone = _zone(spec, tokenizer, closing, min_tokens)
    return Grammar(tokenizer, grammar, vocab, closing, min_tokens, zone, template)


def _zone(spec: ConstraintSpec, tokenizer: Any, closing: ClosingTokens, min_tokens: int) -> int:
    """How much one token can add to what an output needs, bounded by the shortest documents of the
    schemas' objects and arrays (and of a whole output: a parallel call) and MARGIN."""
    import llguidance

    roots = [t.parameters for t in spec.tools] + ([spec.json_schema] if spec.json_schema is not None else [])
    most = min_tokens
    for root in roots:
        parts = subschemas(root)
        if parts is None:
            return 1 << 30  # too many to measure: check near-end tokens all the way
        for part in parts:
            try:
                grammar = llguidance.LLMatcher.grammar_from_lark("start: " + _json_block(part) + "\n")
                matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            except (ValueError, TypeError):
                continue
            tokens = None if matcher.is_error() else completion_tokens(matcher, closing, tokenizer)
            if tokens is not None:
                most = max(most, len(tokens) + 4)  # + the key or separator that opens it
    return most + 2 * MARGIN
