"""A pipeline over a stripped MLX conversion gets its MTP head back. Each stage's node downloads only its
stage (its own HF cache here); the last stage's node also fetches the source's head shard and converts it,
but cannot measure its agreement (layers 0-1 are not on that node), so the head waits as
mtp.pending.safetensors. The pipeline's leader measures it through the pipeline once every stage is up
(exo.runner.local_pipeline: the stage runtime a cluster runs) and keeps it or refuses it with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from exo.downloads import AGREEMENT_THRESHOLD, Stage
from exo.downloads.heads import PENDING_REASON, PENDING_SIDECAR
from exo.engine import Engine, load_checkpoint
from exo.engine.loader import HEAD_RECOVERY_NOTE
from exo.runner.local_pipeline import run_local_pipeline

from .conftest import pull_model, write_card
from .reshard import reshard, shard_name
from .test_heads import MAX_TOKENS, PROMPTS, acceptance

MLX_REPO, SOURCE_REPO, CARD = "mlx-community/tiny-4bit", "Qwen/Tiny", "tiny-4bit"
INDEX, SOURCE_HEAD_SHARD = "model.safetensors.index.json", "model-00002-of-00002.safetensors"
STAGES = [(0, 2), (2, 4)]  # the fixtures have 4 layers
# Pipeline and single node compute the same float32 hidden states on this CPU (tests/engine/test_pipeline.py),
# and the recovered head holds the original's tensors: the same acceptance. Measured: a difference of 0 on
# fixtures of seeds 0-5 (scripts/fixture_sweep.py, pipeline_recovered_minus_original).
SAME_HEAD_TOLERANCE = 0.0


def pipeline_over_stage_downloads(hub, checkpoint, tmp_path, monkeypatch, head: str) -> tuple[list[Path], dict]:
    """The stripped conversion (re-sharded: the last stage lacks layers 0-1) and a raw source with a
    ``head`` head on the hub; each stage pulled onto its own node; the pipeline run on PROMPTS."""
    stripped = reshard(checkpoint("qwen3_5", layout="mlx", dtype="float32"), tmp_path / "stripped")
    hub.add_repo(MLX_REPO, stripped)
    hub.add_repo(SOURCE_REPO, checkpoint("qwen3_5", "hf", head, dtype="float32"))
    write_card(CARD, MLX_REPO, stripped, source_repo=SOURCE_REPO)
    paths = []
    for node, (start, end) in enumerate(STAGES):
        monkeypatch.setenv("HF_HOME", str(tmp_path / f"node-{node}"))
        result = pull_model(CARD, stage=Stage.of(start, end, 4))
        paths.append(Path(result.path))
    last = result.head
    assert last is not None and last.status == "pending" and last.reason == PENDING_REASON, last
    assert f"MTP head converted from {SOURCE_REPO} (1 shard(s)" in "\n".join(result.summary_lines())
    assert hub.fetched_files(SOURCE_REPO) == {INDEX, SOURCE_HEAD_SHARD}  # only the shard holding mtp.*
    assert (paths[1] / PENDING_SIDECAR).is_file() and not (paths[1] / "mtp.safetensors").exists()
    assert not (paths[1] / shard_name(2)).exists()  # the last stage's node lacks layers 0-1

    tokenizer = load_tokenizer(paths[1])
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
               for text in PROMPTS]
    requests = [{"prompt": list(p), "max_tokens": MAX_TOKENS, "ignore_eos": True, "mtp_k": 1} for p in prompts]
    return paths, run_local_pipeline(paths, STAGES, requests, timeout_s=240)


def test_a_pipeline_checks_and_uses_the_head_its_last_stage_recovered(hub, checkpoint, tmp_path, monkeypatch,
                                                                       record_property):
    paths, out = pipeline_over_stage_downloads(hub, checkpoint, tmp_path, monkeypatch, "trained")
    stats = [r["stats"] for r in out["results"]]
    assert all(s["enabled"] and s["mode"] == "pipeline" and s["stages"] == 2 for s in stats), stats
    rate = sum(s["accepted_tokens"] for s in stats) / sum(s["drafted_tokens"] for s in stats)
    original = acceptance(Engine(load_checkpoint(checkpoint("qwen3_5", "mlx_sidecar", "trained", dtype="float32"))))
    record_property("pipeline_recovered_minus_original", rate - original)
    assert rate > 0.5 and rate == pytest.approx(original, abs=SAME_HEAD_TOLERANCE + 1e-9)
    # It passed: it is the stage's sidecar now, which the next load takes as it is.
    assert (paths[1] / "mtp.safetensors").is_file() and not (paths[1] / PENDING_SIDECAR).exists()
    assert load_checkpoint(paths[1], layers=STAGES[1]).head_status.source.endswith("(sidecar)")


def test_a_pipeline_refuses_a_broken_recovered_head_and_says_why(hub, checkpoint, tmp_path, monkeypatch):
    paths, out = pipeline_over_stage_downloads(hub, checkpoint, tmp_path, monkeypatch, "random")
    stats = [r["stats"] for r in out["results"]]
    assert not any(s["enabled"] for s in stats)
    reason = stats[0]["reason"]
    assert f"the head recovered from {SOURCE_REPO} agrees with the backbone on" in reason
    assert f"below the {AGREEMENT_THRESHOLD:.0%} a working head reaches" in reason
    assert not (paths[1] / PENDING_SIDECAR).exists() and not (paths[1] / "mtp.safetensors").exists()
    assert (paths[1] / HEAD_RECOVERY_NOTE).is_file()  # later loads say why, without measuring again
    assert reason in load_checkpoint(paths[1], layers=STAGES[1]).head_status.reason
