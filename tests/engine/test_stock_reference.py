"""A reference outside exo: exo's plain greedy decoding gives stock mlx-lm's tokens (``mlx_lm.stream_generate``
with a greedy sampler, mlx-lm's own model classes and loader, on the same checkpoint directory), and exo's
forward gives its prompt logits bit for bit, for every architecture in bfloat16, float32, 4-bit and 8-bit.

exo replaces parts of mlx-lm's models (its own model classes for the speculative backbone, fused norms and
CPU kernels for linear layers and the GatedDeltaNet recurrence, engine/loader.py's ``cpu_compatible``), and
its decode loop is its own: this is what says that none of that changed a number on this CPU. The one
difference that remains is MLX's, not exo's: MLX's CPU backend has no bfloat16 ``gather_mm`` (unquantized
MoE experts), so stock mlx-lm cannot decode a bfloat16 MoE checkpoint on the CPU at all; exo keeps those
experts in float32 there, and the stock model is compared with the same change (docs/architecture.md,
"Quantized checkpoints and the stock reference").
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from exo.engine import Engine, GenerationRequest
from tests.fixtures.engines import fresh_engine

ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_6_moe", "qwen3_next")
VARIANTS = {  # id: (layout, dtype)
    "bf16": ("mlx_sidecar", "bfloat16"),
    "fp32": ("mlx_sidecar", "float32"),
    "q4": ("mlx_q4_sidecar", "bfloat16"),
    "q8": ("mlx_q8_sidecar", "bfloat16"),
}
TEXTS = ("def fibonacci(n):\n    if n < 2:", "Once upon a time, in a land far away, there lived")
MAX_TOKENS = 32
GATHER_MM_FLOAT32_ONLY = "GatherMM"  # MLX's CPU error for a bfloat16 gather_mm: "[GatherMM::eval] ... float32"


def _stock(path):
    from mlx_lm import load

    model, tokenizer = load(str(path))
    tokenizer.eos_token_ids = set()  # every generation runs its whole budget, as the engine's below
    return model, tokenizer


def _upcast_experts(model) -> None:
    """What exo's ``cpu_compatible`` does to unquantized experts on the CPU (MLX's gather_mm: float32 only)."""
    from mlx_lm.models.switch_layers import SwitchLinear

    for _, leaf in model.named_modules():
        if isinstance(leaf, SwitchLinear) and leaf.weight.dtype == mx.bfloat16:
            leaf.weight = leaf.weight.astype(mx.float32)


def _stock_greedy(model, tokenizer, prompt: list[int]) -> list[int]:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    return [int(r.token) for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=MAX_TOKENS,
                                                  sampler=make_sampler(temp=0.0))]


def _engine(path) -> Engine:
    return fresh_engine(path, eos=False)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_plain_greedy_equals_stock_mlx_lm(checkpoint, arch, variant):
    layout, dtype = VARIANTS[variant]
    path = checkpoint(arch, layout=layout, head="trained", dtype=dtype)
    engine = _engine(path)
    model, tokenizer = _stock(path)
    prompts = [engine.loaded.tokenizer.encode(text) for text in TEXTS]
    try:
        stock = [_stock_greedy(model, tokenizer, p) for p in prompts]
    except RuntimeError as error:  # MLX's, not exo's: see the module's docstring
        assert GATHER_MM_FLOAT32_ONLY in str(error)
        assert mx.default_device() == mx.cpu and dtype == "bfloat16" and engine.loaded.model.is_moe
        _upcast_experts(model)
        stock = [_stock_greedy(model, tokenizer, p) for p in prompts]
    for prompt, want in zip(prompts, stock, strict=True):
        got = engine.complete(GenerationRequest(prompt, max_tokens=MAX_TOKENS, native_mtp="off"))
        assert len(want) == MAX_TOKENS
        assert got.token_ids == want, len(prompt)
    # The prompt's logits, every row: bit for bit.
    tokens = mx.array([prompts[0] + stock[0]])
    backbone = engine.loaded.model
    ours = backbone.logits(backbone.hidden(tokens, backbone.make_cache()))
    assert mx.array_equal(ours, model(tokens)).item()
