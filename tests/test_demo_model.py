"""The bundled demo models: the offline default, with heads that genuinely agree with their backbones."""

from __future__ import annotations

import json

import pytest

from exo.cards import bundled_model_dir, load_catalog
from exo.cli.main import main
from exo.engine import Engine, GenerationRequest, load
from exo.engine.loader import inspect_head, read_config
from tests.fixtures.engines import fresh_engine

CODE_PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):\n")


def _engine(name: str) -> Engine:
    return fresh_engine(bundled_model_dir(name), prefill_chunk=16)


@pytest.mark.parametrize("name", ["exo-demo", "exo-demo-moe"])
def test_bundled_files_are_official_raw_layout(name):
    path = bundled_model_dir(name)
    config = read_config(path)
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    info = inspect_head(path)
    assert info.source == "in-shard" and info.norm_convention == "hf"
    assert all(f.name == "model-00002-of-00002.safetensors" for f in info.files)
    card = load_catalog().get(name)
    text = config["text_config"]
    assert (card.n_layers, card.hidden_size, card.kv_heads, card.head_dim) == (
        text["num_hidden_layers"], text["hidden_size"], text["num_key_value_heads"], text["head_dim"],
    )
    assert card.storage_bytes == sum(f.stat().st_size for f in path.iterdir())


@pytest.mark.parametrize(("name", "depths"), [("exo-demo", (1, 2, 3)), ("exo-demo-moe", (1, 2))])
def test_demo_heads_agree_and_mtp_is_exact(name, depths):
    engine = _engine(name)
    tokenizer = engine.loaded.tokenizer
    for text in CODE_PROMPTS:
        prompt = tokenizer.encode(text)
        plain = engine.complete(GenerationRequest(prompt, max_tokens=48, native_mtp="off"))
        for k in depths:
            result = engine.complete(GenerationRequest(prompt, max_tokens=48, mtp_k=k))
            assert result.token_ids == plain.token_ids, (text, k)
            assert result.stats.per_position_acceptance[0] > 0.5, (text, k, result.stats.per_position_acceptance)


def test_default_model_runs_offline(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["run", "--prompt", "def fibonacci(n):", "--max-tokens", "32", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["model"] == "exo-demo"
    assert payload["native_mtp"]["enabled"]
    assert len(payload["token_ids"]) > 0 and payload["text"].strip()


def test_load_without_a_reference_is_the_demo():
    assert load().loaded.model_id == "exo-demo"


def test_models_lists_the_demo_first_as_local(capsys):
    main(["models", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["id"] == "exo-demo" and rows[0]["status"] == "local"
    assert rows[1]["id"] == "exo-demo-moe" and rows[1]["status"] == "local"
