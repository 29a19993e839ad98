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


def assert_plain_tokens(loaded, mode: str, depth: int | None, chunk: int) -> None:
    """Greedy MTP at ``depth`` (None: adaptive) with rounds built ``mode`` ("on": ahead, "chain": chained) equals
    plain decoding and MTP without them, token for token, with the same rounds and drafts kept, at prompt lengths
    across prefill chunks of ``chunk`` and budgets that end inside rounds."""
    from exo.engine import EngineConfig

    built = Engine(loaded, EngineConfig(prefill_chunk=chunk, round_ahead=mode))
    off = Engine(loaded, EngineConfig(prefill_chunk=chunk, round_ahead="off"))
    for length, budget in ((1, 40), (chunk + 1, 23), (2 * chunk + 3, 31)):
        ids = prompt(loaded, length)
        plain = complete(off, ids, native_mtp="off", max_tokens=budget)
        with_built = complete(built, ids, mtp_k=depth, max_tokens=budget)
        without = complete(off, ids, mtp_k=depth, max_tokens=budget)
        assert with_built.token_ids == plain.token_ids == without.token_ids, (length, budget)
        assert with_built.finish_reason == plain.finish_reason
        if depth is not None:  # the same rounds, the same drafts kept
            assert (with_built.stats.rounds, with_built.stats.accepted_tokens) == (
                without.stats.rounds, without.stats.accepted_tokens)
