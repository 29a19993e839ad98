"""Every benchmark in bench/ starts: its imports resolve (a helper module that left the tree, a renamed one)
and its command line parses. What each measures is for the benchmarks themselves to show when run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "bench").glob("*.py") if p.name != "common.py")


def test_there_are_benchmarks():
    assert {"engine.py", "serving.py", "constrained.py", "pipeline.py"} <= {p.name for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_a_benchmark_starts(script):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr[-2000:]


def test_the_tensor_benchmarks_estimate_runs_on_a_model():
    """bench/tensor.py's last phase (placement's estimate on the run's figures) imports cluster code late, after
    every measurement: a name that moved would only show at the end of a GPU run."""
    import importlib.util

    from exo.engine import resolve_model

    spec = importlib.util.spec_from_file_location("bench_tensor", ROOT / "bench" / "tensor.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    estimate = module._estimate(resolve_model("exo-demo"), 100.0, 2, "ring", 100.0)
    assert estimate["single_tok_s"] > 0 and estimate["tensor_tok_s"] > 0, estimate
    assert estimate["auto"] in ("pipeline", "tensor"), estimate  # asked for 2 nodes: one of the two splits
