"""The runner process's setup before MLX compiles anything."""

from __future__ import annotations

from exo.runner.main import use_ptx_cache


def test_mlx_ptx_cache_goes_under_exo_home_unless_set(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    use_ptx_cache(tmp_path)
    import os

    assert os.environ["MLX_PTX_CACHE_DIR"] == str(tmp_path / "cache" / "mlx-ptx")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "/elsewhere")
    use_ptx_cache(tmp_path)
    assert os.environ["MLX_PTX_CACHE_DIR"] == "/elsewhere"
