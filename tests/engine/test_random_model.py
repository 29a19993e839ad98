"""bench/make_random_model.py: the real-size shapes the GPU benchmarks run on (issue 43), dense and MoE.

Its shapes are what make a benchmark on random weights stand for the real model: a wrong size in one of
them measures another model. Their parameter counts are checked here against the published totals (the
model is built lazily: no weight is materialised), and a small MoE shape is written, loaded by exo and
decoded with its MTP head, token for token as plain decoding and as stock mlx-lm.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlx.utils import tree_flatten

from exo.engine import Engine, EngineConfig, GenerationRequest, load_checkpoint
from exo.engine.bench import StockMLXLM
from exo.engine.models import get_model_classes

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "make_random_model.py"


def _script():
    spec = importlib.util.spec_from_file_location("make_random_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _counts(text: dict) -> tuple[float, float]:
    """(total, active per token) parameters of the text model in billions, the MTP head excluded."""
    moe = text.get("num_experts", 0) > 0
    config = {"model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text,
              "tie_word_embeddings": text["tie_word_embeddings"]}
    model_cls, args_cls = get_model_classes(config)
    sizes = [(name, value.size) for name, value in tree_flatten(model_cls(args_cls.from_dict(config)).parameters())]
    total = sum(size for _, size in sizes)
    routed = sum(size for name, size in sizes if ".switch_mlp." in name)
    active = total - routed + routed * text.get("num_experts_per_tok", 0) / max(text.get("num_experts", 1), 1)
    return total / 1e9, active / 1e9


# Published sizes: the names' totals and active parameters (Qwen3.5-9B: 9B with its ~0.4B vision tower).
@pytest.mark.parametrize(("shape", "total", "active"), [
    ("qwen3.5-9b", (8.8, 9.1), (8.8, 9.1)),
    ("qwen3.5-27b", (26.5, 27.5), (26.5, 27.5)),
    ("qwen3.6-35b-a3b", (34.0, 35.5), (3.0, 3.6)),
    ("qwen3.5-122b-a10b", (121.5, 123.0), (9.5, 10.5)),
])
def test_shapes_have_the_published_sizes(shape, total, active):
    text = _script().text_config(shape)
    got_total, got_active = _counts(text)
    assert total[0] <= got_total <= total[1], got_total
    assert active[0] <= got_active <= active[1], got_active
    if text.get("num_experts"):
        assert text["num_experts"] == 256 and text["num_experts_per_tok"] == 8
        assert text["shared_expert_intermediate_size"] == text["moe_intermediate_size"]
        assert text["full_attention_interval"] == 4 and text["mtp_num_hidden_layers"] == 1


def test_a_random_moe_model_loads_and_decodes_with_mtp_as_plain_and_stock(tmp_path):
    out = tmp_path / "moe"
    subprocess.run([sys.executable, str(SCRIPT), "--shape", "tiny-moe", "--bits", "4", "--layers", "4",
                    "--set", "num_experts=8", "--out", str(out)], check=True, capture_output=True, timeout=300)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and config["text_config"]["num_experts"] == 8
    assert config["quantization"]["bits"] == 4
    # mlx-lm's own rule for the MoE routers: 8 bits (as mlx-community's conversions)
    assert config["quantization"]["language_model.model.layers.0.mlp.gate"]["bits"] == 8
    loaded = dataclasses.replace(load_checkpoint(out), eos_token_ids=frozenset())
    assert loaded.head_status.available and loaded.head_status.moe, loaded.head_status
    engine = Engine(loaded, EngineConfig())
    prompt = loaded.tokenizer.encode("def fibonacci(n):")
    plain = engine.complete(GenerationRequest(prompt, max_tokens=12, native_mtp="off"))
    assert StockMLXLM(out).decode(prompt, 12, 0.0)[1] == plain.token_ids
    for depth in (1, 2):
        mtp = engine.complete(GenerationRequest(prompt, max_tokens=12, native_mtp="on", mtp_k=depth))
        assert mtp.token_ids == plain.token_ids, depth
        assert mtp.stats.rounds > 0 and mtp.stats.drafted_tokens == depth * mtp.stats.rounds
