"""What the tests of rounds built before the round they follow is read share (``engine/ahead.py``: rounds built
ahead, chained rounds): the demo checkpoints without EOS, a code prompt of any length, a completion."""

from __future__ import annotations

import dataclasses
import functools

from exo.engine import Engine, GenerationRequest, load_checkpoint


@functools.cache
def loaded(path):
    return dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())


def prompt(loaded, length: int) -> list[int]:
    ids = loaded.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fib")
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def complete(engine: Engine, prompt, **request):
    return engine.complete(GenerationRequest(prompt, max_tokens=request.pop("max_tokens", 40), **request))


def count_calls(monkeypatch, owner, name: str, counts: dict[str, int], key: str) -> None:
    """Each call of ``owner.name`` (a module's function or a class's method) adds one to ``counts[key]``."""
    function = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[key] += 1
        return function(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
