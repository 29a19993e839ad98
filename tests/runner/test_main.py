"""The runner process's setup before MLX compiles anything."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from exo.runner.main import prepare_process, use_ptx_cache


def test_mlx_ptx_cache_is_the_machines_per_mlx_version_unless_set(tmp_path, monkeypatch):
    """Beside exo's compiled kernels, not under an EXO_HOME: a second home's runner reads what the first compiled."""
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    monkeypatch.setenv("EXO_KERNEL_DIR", str(tmp_path / "kernels"))
    for home in ("one", "two"):
        monkeypatch.setenv("EXO_HOME", str(tmp_path / home))
        use_ptx_cache()
        assert os.environ["MLX_PTX_CACHE_DIR"] == str(tmp_path / "kernels" / "mlx-ptx" / mx.__version__)
        monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "/elsewhere")
    use_ptx_cache()
    assert os.environ["MLX_PTX_CACHE_DIR"] == "/elsewhere"


def test_the_runner_hands_the_gil_over_as_its_settings_say(tmp_path, monkeypatch):
    """The runner's threads wait ``runner_switch_interval_s`` (default 0.05 s, not Python's 0.005) for the GIL
    before the thread building graphs is made to hand it over; the variable sets it."""
    import sys

    from exo.settings import load_settings

    monkeypatch.setenv("EXO_KERNEL_DIR", str(tmp_path / "kernels"))
    before = sys.getswitchinterval()
    try:
        prepare_process(load_settings(env={"EXO_HOME": str(tmp_path)}))
        assert sys.getswitchinterval() == pytest.approx(0.05)
        prepare_process(load_settings(env={"EXO_HOME": str(tmp_path), "EXO_RUNNER_SWITCH_INTERVAL_S": "0.2"}))
        assert sys.getswitchinterval() == pytest.approx(0.2)
    finally:
        sys.setswitchinterval(before)
