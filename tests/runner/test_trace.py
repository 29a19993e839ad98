"""The device thread's trace and profile (``runner.trace.DeviceTrace``): what the benchmarks read back."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from exo.runner.trace import DeviceTrace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from common import device_profile  # noqa: E402  (bench/ is a folder of scripts)


def _spin_in_the_step() -> float:
    total = 0.0
    for i in range(20_000):
        total += i ** 0.5
    return total


def test_steps_traced_and_profiled_per_second(tmp_path: Path) -> None:
    trace = DeviceTrace(str(tmp_path / "device.jsonl"), str(tmp_path))
    start = time.monotonic()
    for _ in range(3):
        lap = trace.step()
        lap("plan")
        _spin_in_the_step()
        lap("step")
        lap("emit", stepped=2)
    # work outside a step is not in the profile
    trace.step()("plan")
    trace.pause()
    # a step in a later second writes the earlier second's profile out
    time.sleep(max(0.0, int(start) + 1.05 - time.monotonic()))
    lap = trace.step()
    lap("emit", stepped=1)
    trace._file.flush()
    lines = [json.loads(line) for line in (tmp_path / "device.jsonl").read_text().splitlines()]
    assert [line["stepped"] for line in lines] == [2, 2, 2, 1]
    assert all(line["step"] >= 0 for line in lines[:3])
    written = list(tmp_path.glob("profile-*.pstats"))
    assert len(written) == 1 and written[0].stem.split("-")[2] == str(int(start))  # written when the batch ended
    top = device_profile(str(tmp_path), start, time.monotonic(), 10)
    assert "_spin_in_the_step" in top
    assert device_profile(str(tmp_path), start + 2, start + 3, 10) == ""  # no second of steps in that window


def test_off_unless_set(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("EXO_DEVICE_TRACE", raising=False)
    monkeypatch.delenv("EXO_DEVICE_PROFILE", raising=False)
    trace = DeviceTrace.from_env()
    lap = trace.step()
    lap("emit", stepped=1)
    assert trace._file is None and trace._profile is None
    monkeypatch.setenv("EXO_DEVICE_PROFILE", str(tmp_path / "p"))
    trace = DeviceTrace.from_env()
    assert trace._file is None
    lap = trace.step()
    lap("emit", stepped=1)
    assert trace._profile is not None and (tmp_path / "p").is_dir()


def _stalls_here(seconds: float) -> None:
    time.sleep(seconds)


def test_a_stalled_step_says_where_its_thread_was(monkeypatch, tmp_path: Path) -> None:
    from common import device_trace, format_trace

    monkeypatch.setattr(DeviceTrace, "STALL_SECONDS", 0.2)
    trace = DeviceTrace(str(tmp_path / "device-1.jsonl"))
    start = time.monotonic()
    lap = trace.step()
    lap("plan")
    _stalls_here(0.02)  # a quick step: not sampled
    lap("step")
    lap("emit", stepped=3, members=3)
    lap = trace.step()
    lap("plan")
    _stalls_here(0.8)
    lap("step")
    lap("emit", stepped=3, members=3)
    trace._file.flush()
    lines = [json.loads(line) for line in (tmp_path / "device-1.jsonl").read_text().splitlines()]
    assert "stall_stack" not in lines[0]
    assert any("_stalls_here" in frame for frame in lines[1]["stall_stack"])
    summary = device_trace(str(tmp_path), start, time.monotonic())
    assert summary["stall"]["members"] == 3 and summary["stall"]["seconds"] >= 0.8
    assert "_stalls_here" in format_trace(summary)
