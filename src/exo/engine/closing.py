"""Constrained outputs that always finish within the budget: the shortest completion of a grammar state.

``shortest_completion`` walks an llguidance matcher forward byte by byte to an accepting state (then rolls
it back): first the bytes the grammar forces (a required key, the fixed text of a tool call), otherwise the
first byte of a fixed preference that closes what is open (a JSON string's quote, an XML raw value's
``\\n</parameter>\\n``, closing brackets, the shortest value). Its tokens (plus the end of sequence) are
what the output still needs from that state. ``Matcher`` (``constraints.py``) uses it at every position:

- when what is needed reaches what is left of the budget (less a small margin), it forces that
  completion, token by token;
- near the end of the budget (``zone``: the most one token can add to what is needed, measured on the
  schema's parts), a token that would make the output need more than is left is masked out.

So a constrained output (a JSON schema, a forced tool call, JSON or XML) is complete and valid at the end
of any budget at least its shortest document (``Grammar.min_tokens``; below it the request is a 400). Both
depend only on the tokens before a position, as native MTP's identity needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

# Tokens that one byte of slack cannot cover are checked (near the end of the budget); other tokens can add
# at most this many tokens to what the output needs (a literal's rest: ``t`` -> ``rue``; a number's digit).
MARGIN = 4
_LIMIT = 4096  # bytes: a completion longer than this is not searched (no closing guarantee)
_RAW_CLOSE = b"\n</parameter>\n"
_STRUCTURE = (b"}", b"]", b"/", b",", b"1", b"0", b'"', b"[", b"{", b"n", b"f", b"t", b"-", *(bytes([c]) for c in b"23456789"))
_FALLBACK = tuple(
    bytes([c])
    for c in b"abcdefghijklmnopqrstuvwxyz1234567890ABCDEFGHIJKLMNOPQRSTUVWXYZ_-. "
    + bytes(c for c in range(256) if chr(c) not in "abcdefghijklmnopqrstuvwxyz1234567890ABCDEFGHIJKLMNOPQRSTUVWXYZ_-. ")
)
_CHECK_ALL = 256  # at most this many allowed tokens: each is checked; more: only those of the context's class


@dataclass(frozen=True)
class ClosingTokens:
    """What closing needs of a tokenizer: the token of each single byte, and which tokens may add structure
    (``quote``: contains ``"``, ``angle``: contains ``<``, ``structure``: any of ``{[,:<``)."""

    byte_token: tuple[int | None, ...]  # [256]
    quote: np.ndarray  # bool [vocab]
    angle: np.ndarray
    structure: np.ndarray
    eos: tuple[int, ...]
    # The preference orders (bytes, their single-byte tokens) in an XML raw value, a JSON string, elsewhere.
    orders: tuple[tuple[tuple[bytes, tuple[int, ...]], ...], ...] = ()
    probes: tuple[tuple[int, ...], ...] = ()  # single-byte tokens whose acceptance tells states apart

    @classmethod
    def of(cls, tokenizer: Any, vocab: int) -> ClosingTokens:
        byte_token: list[int | None] = [None] * 256
        quote, angle, structure = (np.zeros(vocab, dtype=bool) for _ in range(3))
        for token in range(min(vocab, tokenizer.vocab_size)):
            if tokenizer.is_special_token(token):
                continue
            raw = tokenizer.decode_bytes([token])
            if len(raw) == 1 and byte_token[raw[0]] is None:
                byte_token[raw[0]] = token
            quote[token] = b'"' in raw
            angle[token] = b"<" in raw
            structure[token] = any(c in raw for c in b"{[,:<")
        eos = tuple(t for t in tokenizer.eos_tokens if t < vocab)

        def order(*items: bytes) -> tuple[tuple[bytes, tuple[int, ...]], ...]:
            pairs = ((data, [byte_token[b] for b in data]) for data in items)
            return tuple((data, tuple(t)) for data, t in pairs if all(x is not None for x in t))  # type: ignore[misc]

        orders = (order(_RAW_CLOSE, *_FALLBACK), order(b'"', *_FALLBACK), order(_RAW_CLOSE, *_STRUCTURE, *_FALLBACK))
        probes = tuple((t,) for t in (byte_token[b] for b in b'"azAZ09@.-_:/+ ,}]T') if t is not None)
        return cls(tuple(byte_token), quote, angle, structure, eos, orders, probes)

    def tokens_of(self, data: bytes) -> list[int] | None:
        out = [self.byte_token[b] for b in data]
        return None if any(t is None for t in out) else out  # type: ignore[return-value]


def _take(matcher: Any, tokens: Any) -> int:
    """Consume ``tokens`` if the grammar accepts all of them; how many were consumed (0: none)."""
    if tokens is None or matcher.validate_tokens(tokens) != len(tokens):
        return 0
    matcher.consume_tokens(tokens)
    return len(tokens)


def shortest_completion(matcher: Any, closing: ClosingTokens) -> bytes | None:
    """Bytes that take ``matcher`` from its state to an accepting one, short (greedy, not always the
    shortest); None if none is found within a few kilobytes. The matcher is left as it was."""
    consumed = 0
    out = bytearray()
    backslash = closing.tokens_of(b"\\")
    newline = closing.tokens_of(b"\n")
    last, repeats = b"", 0  # the byte chosen last (not forced), and how many times in a row before
    try:
        while not matcher.is_accepting():
            if len(out) > _LIMIT or matcher.is_error():
                return None
            forced = matcher.compute_ff_bytes()
            if forced:
                n = _take(matcher, closing.tokens_of(forced))
                if not n:
                    return None
                consumed += n
                out += forced
                last, repeats = b"", 0
                continue
            in_text = backslash is not None and matcher.validate_tokens(backslash) == 1  # a string or raw value
            if in_text and newline is not None and matcher.validate_tokens(newline) == 1:
                order = closing.orders[0]  # an XML raw value
            elif in_text:
                order = closing.orders[1]  # inside a JSON string
            else:
                order = closing.orders[2]
            choice = _novel(matcher, closing) if repeats >= 2 else None
            for data, tokens in ((choice,) if choice is not None else order):
                n = _take(matcher, tokens)
                if n:
                    repeats = repeats + 1 if data == last else 0
                    last = data
                    consumed += n
                    out += data
                    break
            else:
                return None
        return bytes(out)
    finally:
        if consumed:
            matcher.rollback(consumed)


def _signature(matcher: Any, closing: ClosingTokens) -> tuple[bool, ...]:
    """Which of a few telling bytes may come next."""
    return tuple(matcher.validate_tokens(tokens) == 1 for tokens in closing.probes)


def _novel(matcher: Any, closing: ClosingTokens) -> tuple[bytes, tuple[int, ...]] | None:
    """After a repeated byte (``aaa`` in ``[a-z]+@...``): the first byte after which the bytes allowed next
    change (the ``@``), so the walk moves on instead of repeating; None if there is none."""
    here = _signature(matcher, closing)
    for data, tokens in closing.orders[1]:
        if not _take(matcher, tokens):
            continue
        moved = _signature(matcher, closing) != here
        matcher.rollback(len(tokens))
        if moved:
            return data, tokens
    return None


def completion_tokens(matcher: Any, closing: ClosingTokens, tokenizer: Any) -> list[int] | None:
    """The tokens of ``shortest_completion`` (the tokenizer's, if the grammar takes them; else byte by
    byte), without the end of sequence; None if no completion was found."""
    data = shortest_completion(matcher, closing)
    if data is None:
        return None
    if not data:
        return []
    tokens = list(tokenizer.tokenize_bytes(data))
    if matcher.validate_tokens(tokens) == len(tokens):
        return tokens
    return closing.tokens_of(data)


def candidates(allowed: np.ndarray, matcher: Any, closing: ClosingTokens) -> np.ndarray:
    """The allowed tokens that may add more to what the output needs than ``MARGIN`` covers: all of them
    when they are few, else those that can open structure in this context."""
    if allowed.sum() <= _CHECK_ALL:
        out = allowed.copy()
    else:
        backslash, newline = closing.tokens_of(b"\\"), closing.tokens_of(b"\n")
        in_text = backslash is not None and matcher.validate_tokens(backslash) == 1
        raw = in_text and newline is not None and matcher.validate_tokens(newline) == 1
        cls = closing.angle if raw else closing.quote if in_text else closing.structure
        out = allowed & cls[: allowed.shape[0]]
    out[[t for t in closing.eos if t < out.shape[0]]] = False
    return out


def subschemas(schema: Any, limit: int = 24) -> list[dict[str, Any]] | None:
    """The object and array schemas inside ``schema`` (each with the root's ``$defs``), whose shortest
    documents bound how much one token can add to what an output needs; None if there are more than
    ``limit``."""
    if not isinstance(schema, dict):
        return []
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    found: list[dict[str, Any]] = []
    seen: set[str] = set()

    def walk(node: Any) -> bool:
        if isinstance(node, list):
            return all(walk(n) for n in node)
        if not isinstance(node, dict):
            return True
        key = json.dumps(node, sort_keys=True)
        if key in seen:
            return True
        seen.add(key)
        if node is not schema and (
            node.get("type") in ("object", "array") or any(k in node for k in ("properties", "items", "$ref", "anyOf"))
        ):
            found.append({**node, **defs})
            if len(found) > limit:
                return False
        return all(walk(v) for k, v in node.items() if k not in ("enum", "const", "default", "examples"))

    return found if walk(schema) else None
