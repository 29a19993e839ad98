"""The install the README gives is the one CI runs, and it resolves to the versions the suite was run
against (constraints.txt), whatever the package index holds by the time someone installs."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def constraints() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def readme_commands() -> list[str]:
    return re.findall(r"^(python3 -m venv \.venv && .*)$", (ROOT / "README.md").read_text(), re.MULTILINE)


def test_ci_runs_the_readme_test_command_with_the_constraints() -> None:
    install, test = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == test
    for command in (install, test):
        assert "-c constraints.txt" in command


def test_every_dependency_is_pinned_within_its_bounds() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    requirements = [Requirement(r) for r in project["dependencies"] + extras["dev"] + extras["menubar"] + extras["train"]]
    pins = constraints()
    linux = {"sys_platform": "linux", "platform_system": "Linux"}
    for requirement in requirements:
        if requirement.marker is not None and not requirement.marker.evaluate(linux):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not in constraints.txt: run scripts/freeze_constraints.py"
        assert requirement.specifier.contains(pins[name], prereleases=True), (requirement, pins[name])


def test_this_environment_has_the_pinned_versions() -> None:
    """Installed as the README says, every pinned package present here has its pinned version (a local
    label such as torch's +cpu aside)."""
    wrong = []
    for name, pinned in constraints().items():
        try:
            installed = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue  # another platform's package (mlx-cpu on a Mac, python-xlib off Linux)
        if Version(installed.public) != pinned:
            wrong.append(f"{name} {installed} (constraints.txt: {pinned})")
    assert not wrong, f"installed without -c constraints.txt? ({sys.prefix}): " + ", ".join(wrong)


# -- .ci/run checks Node first ------------------------------------------------------------------------------

STUBBED = ("node", "npm", "python3", "apt-get", "chromium", "Xvfb", "xclip")


def _stub(path: Path, calls: Path, name: str, then: str = "") -> None:
    path.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n{then}\n')
    path.chmod(0o755)


def run_ci_with(tmp_path: Path, node_version: str | None) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Runs a copy of .ci/run in an empty directory with every program it calls stubbed (each stub notes
    its call; ``node --version`` prints ``node_version``, or there is no node at all; ``python3 -m venv``
    makes a venv of stubs): whatever the script does, it touches neither this checkout nor the machine."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / "dashboard").mkdir()
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    venv_bin = repo / ".venv" / "bin"
    for name in STUBBED:
        if name == "node" and node_version is None:
            continue
        then = f"echo {node_version}" if name == "node" else ""
        if name == "python3":
            then = f'[ "$1 $2 $3" = "-m venv .venv" ] && mkdir -p {venv_bin}'
            then += "".join(f" && cp {bin_dir}/.venv-{tool} {venv_bin}/{tool}" for tool in ("pip", "python"))
            for tool in ("pip", "python"):
                _stub(bin_dir / f".venv-{tool}", calls, f".venv/bin/{tool}")
        _stub(bin_dir / name, calls, name, then)
    for name in ("dirname", "rm", "mkdir", "cp"):  # what the script and the stubs run besides
        (bin_dir / name).symlink_to(shutil.which(name) or f"/bin/{name}")
    bash = shutil.which("bash") or "/bin/bash"
    result = subprocess.run([bash, str(repo / ".ci" / "run")], capture_output=True, text=True, timeout=30,
                            env={"PATH": str(bin_dir), "HOME": str(tmp_path)})
    ran = calls.read_text().splitlines() if calls.exists() else []
    return result, ran


@pytest.mark.parametrize("node_version", [None, "v18.19.0", "v20.11.1", "v21.7.3", "v22.11.0"])
def test_ci_stops_at_once_without_a_recent_enough_node(tmp_path: Path, node_version: str | None) -> None:
    result, ran = run_ci_with(tmp_path, node_version)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "needs Node 20.19+" in result.stderr and "bookworm" in result.stderr, result.stderr
    assert (node_version or "no node on PATH") in result.stderr, result.stderr
    assert [c for c in ran if not c.startswith("node ")] == [], f"it went on: {ran}"


@pytest.mark.parametrize("node_version", ["v20.19.0", "v22.12.0", "v24.1.0"])
def test_ci_goes_on_with_a_recent_enough_node_to_the_readme_command(tmp_path: Path, node_version: str) -> None:
    result, ran = run_ci_with(tmp_path, node_version)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [c for c in ran if not c.startswith("node ")] == [
        "npm ci --no-audit --no-fund --loglevel=error",
        "python3 -m venv .venv",
        '.venv/bin/pip install -e .[dev] -c constraints.txt',
        ".venv/bin/python -m pytest -q",
        ".venv/bin/python -m pytest -q -m arithmetic",  # (with EXO_CPU_KERNELS_ISA=avx2)
    ]
