"""The install the README gives is the one CI runs, and it resolves to the versions the suite was run
against (constraints.txt), whatever the package index holds by the time someone installs."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

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
