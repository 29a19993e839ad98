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
