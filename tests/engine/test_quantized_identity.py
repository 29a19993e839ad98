"""The identity contracts on quantized checkpoints, as the catalog ships them (mlx-lm 4- and 8-bit conversions,
group 64, bfloat16 scales, the head as a sidecar): at temperature 0, native MTP at every depth and adaptive
gives plain decoding's tokens, a batch gives every member its solo tokens (decoding plainly and drafting),
and a pipeline gives single-node plain decoding's tokens, for every architecture.

The bfloat16 / float32 versions of these tests (test_generation.py, test_batch.py, test_batch_mtp.py,
test_pipeline.py) cover joins, leaves, prompt lengths and chunk edges in depth; here one prompt per case and
few tokens keep the suite's added time small. A quantized matmul (``quantized_matmul`` / ``gather_qmm``)
is a different kernel from the unquantized one, with its own row blocking: what these tests catch is a path
of the verify call, the batch or a stage that rounds a quantized layer differently from the decode step.
"""

from __future__ import annotations

import pytest
from mlx.utils import tree_flatten

from exo.engine import Engine, GenerationRequest
from exo.runner.local_pipeline import run_local_pipeline
from tests.fixtures.engines import fresh_engine

from .test_batch import _run_batch, _solo

ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_6_moe", "qwen3_next")
LAYOUTS = ("mlx_q4_sidecar", "mlx_q8_sidecar")
CHUNK = 8  # small prefill chunks: the prompt crosses a chunk edge
PROMPT_LENGTH = 11
MAX_TOKENS = 16
DEPTHS = (1, 2, 3, None)  # None: adaptive
TEXTS = ("def fibonacci(n):\n    if n < 2:", "The quick brown fox", "import numpy as np\nx = np.",
         "Once upon a time, in a land far away, there lived")

CASES = [pytest.param(arch, layout, id=f"{arch}-{layout.split('_')[1]}") for arch in ARCHS for layout in LAYOUTS]


def _engine(path) -> Engine:
    """Without an EOS every generation runs its whole budget: fixed-length comparisons."""
    return fresh_engine(path, eos=False, prefill_chunk=CHUNK)


def _prompt(engine: Engine) -> list[int]:
    ids = engine.loaded.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fib")
    return ids[:PROMPT_LENGTH]


def _path(checkpoint, arch: str, layout: str):
    return checkpoint(arch, layout=layout, head="trained", dtype="bfloat16")


@pytest.mark.parametrize(("arch", "layout"), CASES)
def test_quantized_greedy_mtp_equals_plain_decoding(checkpoint, arch, layout):
    engine = _engine(_path(checkpoint, arch, layout))
    assert engine.loaded.head is not None and engine.loaded.head_status.available
    assert any(name.endswith(".scales") for name, _ in tree_flatten(engine.loaded.model.parameters()))
    prompt = _prompt(engine)
    plain = engine.complete(GenerationRequest(prompt, max_tokens=MAX_TOKENS, native_mtp="off"))
    drafted = accepted = 0
    for depth in DEPTHS:
        mtp = engine.complete(GenerationRequest(prompt, max_tokens=MAX_TOKENS, native_mtp="on", mtp_k=depth))
        assert mtp.token_ids == plain.token_ids, depth
        assert mtp.text == plain.text, depth
        assert mtp.stats.enabled, depth
        if depth is not None:  # adaptive may time rounds as not paying here and decode plainly
            assert mtp.stats.rounds > 0, depth
            drafted += mtp.stats.drafted_tokens
            accepted += mtp.stats.accepted_tokens
    # Rounds that accepted drafts and rounds that rolled some back: both paths ran (measured 0.46-0.92 here).
    assert 0 < accepted < drafted, (accepted, drafted)


@pytest.mark.parametrize(("arch", "layout"), CASES)
def test_quantized_batched_greedy_equals_solo(checkpoint, arch, layout):
    """Plain members, then drafting members (K = 2), each joining at its own step: every member gets its solo
    plain tokens."""
    engine = _engine(_path(checkpoint, arch, layout))
    for fields in ({"native_mtp": "off"}, {"native_mtp": "on", "mtp_k": 2}):
        requests = [GenerationRequest(engine.loaded.tokenizer.encode(text), max_tokens=m, **fields)
                    for text, m in zip(TEXTS, (12, 5, 10, 8), strict=True)]
        got = _run_batch(engine, requests, join_at=[0, 0, 2, 3])
        for i, request in enumerate(requests):
            tokens, text, finish, stats = got[i]
            solo = _solo(engine, request)
            assert tokens == solo.token_ids, (fields, i)
            assert text == solo.text and finish == solo.finish_reason == "length", (fields, i)
            assert stats.batch_sizes and sum(stats.batch_sizes.values()) > 0, (fields, i)
        assert max(got[0][3].batch_sizes) >= 3, fields


@pytest.mark.parametrize(("arch", "layout"), CASES)
def test_quantized_pipeline_greedy_equals_single_node_plain(checkpoint, arch, layout):
    """Two stages (one process each), plain and every depth: single-node plain decoding's tokens."""
    path = _path(checkpoint, arch, layout)
    engine = _engine(path)
    prompt = _prompt(engine)
    requests = [{"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "native_mtp": "off"}]
    requests += [{"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "native_mtp": "on", "mtp_k": k}
                 for k in DEPTHS]
    out = run_local_pipeline(path, [(0, 2), (2, 4)], requests, prefill_chunk=CHUNK, timeout_s=240)
    plain = engine.complete(GenerationRequest(prompt, max_tokens=MAX_TOKENS, native_mtp="off"))
    drafted = 0
    for request, result in zip(requests, out["results"], strict=True):
        where = (request["native_mtp"], request.get("mtp_k"))
        assert result["token_ids"] == plain.token_ids, where
        assert result["text"] == plain.text, where
        assert result["stats"]["mode"] == "pipeline" and result["stats"]["stages"] == 2, where
        drafted += result["stats"]["drafted_tokens"]
    assert drafted > 0  # the head drafted through the pipeline
