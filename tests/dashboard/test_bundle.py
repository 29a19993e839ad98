"""The dashboard bundle committed in the package (src/exo/assets/dashboard, what `pip install` serves):
small, complete, and exactly what its sources build to. Also runs the dashboard's own unit tests
(Vitest) and type check (svelte-check), so the README's one test command covers them.
"""

from __future__ import annotations

import filecmp
import gzip
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .conftest import BUNDLE, DASHBOARD, ROOT, needs, node_tool

FIRST_LOAD_BUDGET = 300 * 1024  # gzipped: index.html and what it loads
FILE_BUDGET = 400 * 1024  # any one file, uncompressed
COMPONENT_LINES = 400


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1", "FORCE_COLOR": "0"}
    return subprocess.run(args, cwd=DASHBOARD, capture_output=True, text=True, timeout=timeout, env=env)


def test_first_load_is_small_and_every_file_it_names_is_there():
    index = (BUNDLE / "index.html").read_text()
    loaded = re.findall(r'(?:src|href)="\./([^"]+)"', index)
    assert any(p.endswith(".js") for p in loaded) and any(p.endswith(".css") for p in loaded), index
    for path in loaded:
        assert (BUNDLE / path).is_file(), f"index.html names {path}, which the bundle lacks"
    assets = {p.relative_to(BUNDLE).as_posix() for p in (BUNDLE / "assets").iterdir()}
    assert assets <= set(loaded), f"files nothing loads (a stale build?): {assets - set(loaded)}"
    first_load = sum(len(gzip.compress((BUNDLE / p).read_bytes(), 9)) for p in ["index.html", *loaded])
    assert first_load < FIRST_LOAD_BUDGET, f"first load is {first_load / 1024:.0f} KB gzipped"
    for path in BUNDLE.rglob("*"):
        assert not path.name.endswith(".map"), "source maps do not belong in the package"
        if path.is_file():
            assert path.stat().st_size < FILE_BUDGET, f"{path.name} is {path.stat().st_size // 1024} KB"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_wheel_ships_the_dashboard(tmp_path: Path):
    """What `pip install` gets: a wheel built from this checkout (a copy of what the build reads, so no
    stale build/ directory can add or hide a file) holds index.html and every file of the bundle,
    byte for byte, among them every file index.html loads."""
    needs(importlib.util.find_spec("setuptools") is not None, "setuptools is missing from this environment")
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q",
         "-w", str(wheels), str(source)],
        capture_output=True, text=True, timeout=100,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [wheel] = wheels.glob("exo-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert "exo/assets/dashboard/index.html" in names, f"the wheel has no dashboard: {sorted(names)[:20]}…"
        index = archive.read("exo/assets/dashboard/index.html").decode()
        loaded = re.findall(r'(?:src|href)="\./([^"]+)"', index)
        assert any(p.endswith(".js") for p in loaded) and any(p.endswith(".css") for p in loaded), index
        for path in loaded:
            assert f"exo/assets/dashboard/{path}" in names, f"the wheel lacks {path}, which index.html loads"
        for path in BUNDLE.rglob("*"):
            if path.is_file():
                name = f"exo/assets/dashboard/{path.relative_to(BUNDLE).as_posix()}"
                assert name in names, f"the wheel lacks {name}"
                assert archive.read(name) == path.read_bytes(), f"{name} differs in the wheel"


def test_components_stay_small():
    for path in (DASHBOARD / "src").rglob("*"):
        if path.suffix in (".svelte", ".ts") and not path.name.endswith(".test.ts"):
            lines = len(path.read_text().splitlines())
            assert lines <= COMPONENT_LINES, f"{path.relative_to(DASHBOARD)} has {lines} lines; split it"


def test_committed_bundle_is_what_the_sources_build(tmp_path: Path):
    vite = node_tool("vite")
    out = tmp_path / "dist"
    result = _run([str(vite), "build", "--outDir", str(out), "--emptyOutDir", "--logLevel", "warn"])
    assert result.returncode == 0, result.stdout + result.stderr
    comparison = filecmp.dircmp(out, BUNDLE)
    stale = _differences(comparison)
    assert not stale, (
        f"src/exo/assets/dashboard differs from a fresh build of dashboard/ ({stale}): "
        "run `npm run build` in dashboard/ and commit the result"
    )


def _differences(comparison: filecmp.dircmp) -> list[str]:
    out = [f"only in the fresh build: {n}" for n in comparison.left_only]
    out += [f"only committed: {n}" for n in comparison.right_only]
    out += [f"changed: {n}" for n in comparison.diff_files]
    for sub in comparison.subdirs.values():
        out += _differences(sub)
    return out


def test_dashboard_unit_tests():
    vitest = node_tool("vitest")
    result = _run([str(vitest), "run", "--reporter=dot"])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert re.search(r"Tests\s+\d+ passed", result.stdout), result.stdout[-2000:]


@pytest.mark.timeout(300)
def test_dashboard_type_check():
    svelte_check = node_tool("svelte-check")
    result = _run([str(svelte_check), "--tsconfig", "./tsconfig.json", "--fail-on-warnings", "--output", "machine"])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
