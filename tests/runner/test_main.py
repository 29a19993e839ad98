"""The runner process's setup before MLX compiles anything."""

from __future__ import annotations

import os

import mlx.core as mx

from exo.runner.main import use_ptx_cache


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
