"""The exo command line, run in-process on fixture checkpoints."""

from __future__ import annotations

import json

import pytest

from exo.cli.main import main


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_run_json_contract(checkpoint, capsys):
    path = checkpoint("qwen3_5")
    code, out, _ = _run(capsys, "run", str(path), "--prompt", "Hello", "--json", "--max-tokens", "12", "--mtp-k", "2")
    assert code == 0
    payload = json.loads(out)
    assert set(payload) == {"model", "text", "token_ids", "finish_reason", "usage", "native_mtp"}
    assert payload["model"] == path.name
    assert set(payload["usage"]) == {"prompt_tokens", "completion_tokens"}
    assert payload["usage"]["completion_tokens"] == len(payload["token_ids"])
    stats = payload["native_mtp"]
    for key in (
        "enabled", "reason", "mode", "k", "k_histogram", "rounds", "drafted_tokens", "accepted_tokens",
        "acceptance_rate", "per_position_acceptance", "ttft_ms", "decode_tokens_per_s", "prompt_tokens",
        "completion_tokens",
    ):
        assert key in stats
    assert stats["enabled"] and stats["k"] == 2 and stats["mode"] == "single_node"


def test_run_streams_text_and_reports_stats(checkpoint, capsys):
    path = checkpoint("qwen3_5")
    code, out, err = _run(capsys, "run", str(path), "--prompt", "Hello", "--max-tokens", "12")
    _, json_out, _ = _run(capsys, "run", str(path), "--prompt", "Hello", "--max-tokens", "12", "--json")
    assert code == 0
    assert out == json.loads(json_out)["text"] + "\n"
    assert "native MTP" in err and "tok/s" in err


def test_raw_skips_the_chat_template(checkpoint, capsys):
    path = checkpoint("qwen3_5")
    _, chat, _ = _run(capsys, "run", str(path), "--prompt", "Hello", "--json", "--max-tokens", "4")
    _, raw, _ = _run(capsys, "run", str(path), "--prompt", "Hello", "--json", "--max-tokens", "4", "--raw")
    assert json.loads(chat)["native_mtp"]["prompt_tokens"] > json.loads(raw)["native_mtp"]["prompt_tokens"]


def test_native_mtp_on_without_a_head_is_an_error(checkpoint, capsys):
    code, out, err = _run(capsys, "run", str(checkpoint("qwen3_5", layout="mlx")), "--prompt", "Hi", "--native-mtp", "on")
    assert code == 1 and out == ""
    assert "native MTP cannot run" in err and "mtp.safetensors" in err


def test_auto_without_a_head_falls_back_with_the_reason(checkpoint, capsys):
    code, out, _ = _run(capsys, "run", str(checkpoint("qwen3_5", layout="mlx")), "--prompt", "Hi", "--json", "--max-tokens", "4")
    stats = json.loads(out)["native_mtp"]
    assert code == 0 and not stats["enabled"] and "mtp" in stats["reason"]


def test_env_switch_disables_native_mtp(checkpoint, capsys, monkeypatch):
    monkeypatch.setenv("EXO_NATIVE_MTP_ENABLED", "0")
    code, out, _ = _run(capsys, "run", str(checkpoint("qwen3_5")), "--prompt", "Hi", "--json", "--max-tokens", "4")
    stats = json.loads(out)["native_mtp"]
    assert code == 0 and not stats["enabled"] and "EXO_NATIVE_MTP_ENABLED" in stats["reason"]
    code, _, err = _run(capsys, "run", str(checkpoint("qwen3_5")), "--prompt", "Hi", "--native-mtp", "on")
    assert code == 1 and "EXO_NATIVE_MTP_ENABLED" in err


def test_unknown_model_suggests(capsys):
    code, _, err = _run(capsys, "run", "qwen3.5-27", "--prompt", "Hi")
    assert code == 1 and "qwen3.5-27b-4bit" in err


def test_bad_sampling_parameter(checkpoint, capsys):
    code, _, err = _run(capsys, "run", str(checkpoint("qwen3_5")), "--prompt", "Hi", "--top-p", "0")
    assert code == 1 and "top_p" in err


def test_bench_json(checkpoint, capsys):
    code, out, _ = _run(capsys, "bench", str(checkpoint("qwen3_5")), "--json", "--max-tokens", "8", "--prompt", "Hello")
    report = json.loads(out)
    assert code == 0 and report["native_mtp_available"]
    configs = [row["config"] for row in report["rows"]]
    assert configs[0] == "plain" and "adaptive" in configs and "k=1" in configs
    assert len(report["beta"]) == len(report["delta"]) == len(report["projected_speedup_at_0_8"]) >= 1
    assert all(row["identical_to_plain"] for row in report["rows"][1:])
    assert report["rows"][0]["speedup"] == 1.0
    # A fixed depth's glue is seconds over seconds: its round's measured time over its verify call and drafts
    # timed alone beside it (one request here: that one ratio), not over this run's pipelined plain steps.
    fixed = [row for row in report["rows"] if row["k"]]
    assert fixed and all(row["glue"] is not None and row["alone_ms"] > 0 for row in fixed)
    for row in fixed:
        assert row["glue"] == pytest.approx(row["round_ms"] / row["alone_ms"], rel=1e-2)
        # The same with the head's catch-up on the rows the round before kept, timed alone after the request.
        assert row["catch_up_ms"] >= 0
        assert row["glue_with_catch_up"] == pytest.approx(
            row["round_ms"] / (row["alone_ms"] + row["catch_up_ms"]), rel=1e-2)
    assert report["plain_step_alone_ms"] > 0
    # Adaptive against the fastest fixed configuration, then in tight pairs (--pairs, 8 by default).
    assert report["best_fixed"] in configs and report["paired_groups"] == 8
    assert report["adaptive_vs_best_fixed_paired"] > 0
    assert report["best_fixed_again_paired"] > 0  # the same configuration twice a group: the noise floor


def test_bench_prints_the_tight_pairs_with_their_noise_floor(checkpoint, capsys):
    code, out, _ = _run(capsys, "bench", str(checkpoint("qwen3_5")), "--max-tokens", "6", "--prompt", "Hello",
                        "--pairs", "3")
    assert code == 0
    pairs = next(line for line in out.splitlines() if line.startswith("the same in 3 tight pairs"))
    floor = next(line for line in out.splitlines() if line.startswith("the noise floor:"))
    assert "adaptive and" in pairs and "run twice in each of those groups reads" in floor


def test_models_lists_the_catalog(capsys):
    code, out, _ = _run(capsys, "models", "--json")
    rows = json.loads(out)
    ids = [r["id"] for r in rows]
    assert code == 0 and "qwen3.5-27b-4bit" in ids and "exo-demo" in ids
    statuses = [r["status"] for r in rows]
    assert statuses == sorted(statuses, key=lambda s: s != "local")


def test_convert_then_run(checkpoint, tmp_path, capsys):
    dst = tmp_path / "q4"
    code, _, _ = _run(capsys, "convert", str(checkpoint("qwen3_5")), str(dst), "--bits", "4", "--group-size", "32")
    assert code == 0
    code, out, _ = _run(capsys, "run", str(dst), "--prompt", "Hello", "--json", "--max-tokens", "6", "--native-mtp", "on")
    assert code == 0 and json.loads(out)["native_mtp"]["enabled"]
    code, _, err = _run(capsys, "convert", str(checkpoint("qwen3_5")), str(dst))
    assert code == 1 and "exists" in err


@pytest.mark.parametrize("argv", [["run"], ["run", "--prompt", "x", "--native-mtp", "maybe"]])
def test_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_exo_cluster_says_how_far_an_instance_is():
    from exo.cli.cluster import instance_label

    assert instance_label({"model": "exo-demo", "state": "ready", "progress": 1.0}) == "exo-demo (ready)"
    assert instance_label({"model": "big", "state": "loading", "progress": 0.4}) == "big (loading 40%)"
    downloading = {"model": "qwen", "state": "downloading", "progress": 0.0,
                   "download": {"bytes_done": 1 << 30, "bytes_total": 4 << 30}}
    assert instance_label(downloading) == "qwen (downloading 25%)"


def test_a_subcommand_error_is_a_user_error_when_run_as_a_module(tmp_path):
    """``python -m exo.cli.main`` makes the entry point ``__main__``: a subcommand's CommandError (from
    ``exo.cli.common``) must still be the class the entry point catches, printed without a traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "EXO_HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "exo.cli.main", "cluster", "--url", "http://127.0.0.1:9"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("exo: error: no exo daemon at http://127.0.0.1:9") and "Traceback" not in result.stderr


def test_bench_runs_on_the_device_asked_for(checkpoint, capsys):
    """``--device`` (the benchmarks' shared option): the report's device is the one asked for, and one this
    machine's MLX lacks is a clear error, not a crash."""
    import mlx.core as mx

    default = mx.default_device()
    try:
        code, out, _ = _run(capsys, "bench", str(checkpoint("qwen3_5")), "--json", "--max-tokens", "4",
                            "--prompt", "Hello", "--pairs", "0", "--device", "cpu")
        assert code == 0 and json.loads(out)["device"].startswith("cpu")
        code, out, err = _run(capsys, "bench", str(checkpoint("qwen3_5")), "--json", "--max-tokens", "4",
                              "--prompt", "Hello", "--pairs", "0", "--device", "gpu")
        if mx.is_available(mx.gpu):
            assert code == 0 and not json.loads(out)["device"].startswith("cpu")
        else:
            assert code == 1 and err.strip() == "exo: error: --device gpu: this machine's MLX has no GPU backend"
    finally:
        mx.set_default_device(default)
