"""Prompts prefilled together, as rows of one backbone call (engine/batch_prefill.py): on this CPU every row
is its solo prefill bit for bit, so every sequence then decodes its solo output token for token (alone or in
a batch, MTP off and drafting), and what the prefix cache keeps is the same."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from exo.engine import GenerationRequest, SamplingParams
from exo.engine.batch import BatchDecoder
from exo.engine.batch_prefill import can_prefill_together, prefill_together
from exo.engine.models.layers import RollbackArraysCache
from tests.fixtures.engines import fresh_engine

TEXTS = (
    "def fibonacci(n):\n    if n < 2:",
    "The quick brown fox",
    "import numpy as np\nx = np.",
    "Once upon a time, in a land far away, there lived",
    "1, 2, 3,",
)


def _requests(engine, **fields) -> list[GenerationRequest]:
    return [GenerationRequest(engine.loaded.tokenizer.encode(t), max_tokens=fields.get("max_tokens", 14),
                              **{k: v for k, v in fields.items() if k != "max_tokens"}) for t in TEXTS]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_of_one_call_are_each_prompts_solo_prefill(checkpoint, arch, dtype):
    engine = fresh_engine(checkpoint(arch, dtype=dtype), eos=False)
    requests = _requests(engine, native_mtp="off")
    together = [engine.start(r) for r in requests]
    prefill_together(together)
    for request, run in zip(requests, together, strict=True):
        solo = engine.start(request)
        for _ in solo.prefill():
            pass
        n = len(request.prompt_tokens)
        for mine, theirs in zip(run.cache, solo.cache, strict=True):
            if isinstance(mine, KVCache):
                assert mine.offset == theirs.offset == n
                assert mx.array_equal(mine.keys[..., :n, :], theirs.keys[..., :n, :])
                assert mx.array_equal(mine.values[..., :n, :], theirs.values[..., :n, :])
            else:
                assert isinstance(mine, RollbackArraysCache)
                assert all(mx.array_equal(a, b) for a, b in zip(mine.cache, theirs.cache, strict=True))
        assert list(run.first_token()) == list(solo.first_token())


@pytest.mark.parametrize("mtp", [{"native_mtp": "off"}, {"mtp_k": 2}, {"sampling": SamplingParams(temperature=0.8, seed=5),
                                                                        "native_mtp": "off"}])
def test_sequences_prefilled_together_decode_their_solo_output_in_a_batch(checkpoint, mtp):
    engine = fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False)
    requests = _requests(engine, **mtp)
    runs = [engine.start(r) for r in requests]
    prefill_together(runs)
    batch = BatchDecoder(engine)
    out: dict[int, list[int]] = {i: [] for i in range(len(runs))}
    index = {id(run): i for i, run in enumerate(runs)}
    for i, run in enumerate(runs):
        out[i] += [t for chunk in run.first_token() for t in chunk.token_ids]
        batch.add(run)
    while len(batch):
        for run, chunks in batch.step():
            out[index[id(run)]] += [t for chunk in chunks for t in chunk.token_ids]
        batch.check_invariants()
    for i, request in enumerate(requests):
        assert out[i] == engine.complete(dataclasses.replace(request)).token_ids, f"request {i}"


def test_a_sequence_prefilled_together_decodes_alone_as_a_solo_one(checkpoint):
    """A lone member steps on its own caches: the views of the shared call grow into its own buffers."""
    engine = fresh_engine(checkpoint("qwen3_next", dtype="bfloat16"), eos=False)
    requests = _requests(engine, native_mtp="off", max_tokens=300)[:2]  # past a KV cache step of 256
    runs = [engine.start(r) for r in requests]
    prefill_together(runs)
    for request, run in zip(requests, runs, strict=True):
        tokens = [t for chunk in run.first_token() for t in chunk.token_ids]
        batch = BatchDecoder(engine)
        batch.add(run)
        while len(batch):
            tokens += [t for _, chunks in batch.step() for chunk in chunks for t in chunk.token_ids]
        assert tokens == engine.complete(request).token_ids


def test_only_whole_prompts_from_the_start_on_one_node_go_together(checkpoint):
    engine = fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False)
    assert can_prefill_together(engine)
    requests = _requests(engine, native_mtp="off")
    run = engine.start(requests[0])
    n = len(requests[0].prompt_tokens)
    assert run.whole_prompt_in(n) and not run.whole_prompt_in(n - 1)
    next(run.prefill(4))  # under way on its own
    assert not run.whole_prompt_in(n)
    with pytest.raises(ValueError, match="whole prompts"):
        prefill_together([run, engine.start(requests[1])])
    invariant = fresh_engine(checkpoint("qwen3_5", dtype="float32"), batch_invariant=True)
    assert not can_prefill_together(invariant)


def test_running_out_of_memory_while_prefilling_together_is_the_typed_error(checkpoint, monkeypatch):
    """Prompts prefilled as rows of one call: an allocation failure inside the forward (a GPU's forward evaluates
    layers as it builds them) is ``DeviceMemoryError`` (507 ``insufficient_memory``), not MLX's raw error; the
    engine prefills the same prompts afterwards."""
    import sys

    from exo.engine import DeviceMemoryError
    from exo.engine import forward as forward_module

    engine = fresh_engine(checkpoint("qwen3_5", dtype="float32"), eos=False)
    requests = _requests(engine, native_mtp="off")
    monkeypatch.setattr(forward_module, "prompt_eval_every", lambda rows: 1)
    real = mx.async_eval

    def failing(*args):
        if sys._getframe(1).f_code.co_name == "stage_hidden":  # noqa: SLF001 - the forward's own evaluations
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        return real(*args)

    monkeypatch.setattr(mx, "async_eval", failing)
    with pytest.raises(DeviceMemoryError, match=f"prefilling {len(requests)} prompts"):
        prefill_together([engine.start(r) for r in requests])
    monkeypatch.setattr(mx, "async_eval", real)
    runs = [engine.start(r) for r in requests]
    prefill_together(runs)
    assert all(list(run.first_token()) for run in runs)
