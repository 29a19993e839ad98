"""``app-macos/`` on Linux: what setup.py hands py2app, and the launch path of a py2app bundle (the app's
own executable re-invoked with ``-m MODULE``), with a shell script standing in for py2app's launcher.

Only a Mac can build and open exo.app (app-macos/README.md says what to check there)."""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import httpx2 as httpx
import pytest

from exo.launch import module_argv
from exo.menubar import DaemonState
from exo.menubar.process import serve_argv

from .apps import app_env, wait_state

APP_MACOS = Path(__file__).resolve().parents[2] / "app-macos"
APP_SCRIPT = APP_MACOS / "exo_menubar_app.py"
REPO = APP_MACOS.parent

# setup.py as py2app would run it, with setuptools.setup capturing its arguments.
RUN_SETUP = r"""
import importlib.util, json, runpy, sys
import setuptools
captured = {}
setuptools.setup = lambda **kwargs: captured.update(kwargs)
setup_py = sys.argv[1]
sys.argv = [setup_py, *sys.argv[2:]]
namespace = runpy.run_path(setup_py, run_name="__main__")
found = {}
for name in captured["options"]["py2app"]["packages"]:
    spec = importlib.util.find_spec(name)
    found[name] = None if spec is None else (spec.origin or "namespace")
print(json.dumps({"kwargs": captured, "found": found, "required": namespace["REQUIRED_ASSETS"]}))
"""

# py2app's launcher (Contents/MacOS/<app>): sets EXECUTABLEPATH and sys.frozen, then runs the app script.
LAUNCHER = """#!/bin/sh
export EXECUTABLEPATH="$0"
exec {python} -c 'import runpy, sys; sys.frozen = "macosx_app"; sys.argv[0] = sys.argv.pop(1); \
runpy.run_path(sys.argv[0], run_name="__main__")' {script} "$@"
"""


def _run_setup(tmp_path: Path, *args: str) -> dict:
    folder = tmp_path / "app-macos"
    folder.mkdir()
    for name in ("setup.py", APP_SCRIPT.name):
        shutil.copy(APP_MACOS / name, folder / name)
    done = subprocess.run(
        [sys.executable, "-c", RUN_SETUP, str(folder / "setup.py"), "py2app", *args],
        env=app_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_setup_py_bundles_the_app_script_real_assets_and_importable_packages(tmp_path):
    result = _run_setup(tmp_path)
    kwargs = result["kwargs"]
    assert kwargs["app"] == [APP_SCRIPT.name] and (tmp_path / "app-macos" / APP_SCRIPT.name).is_file()
    options = kwargs["options"]["py2app"]
    assert options["plist"]["LSUIElement"] is True and options["argv_emulation"] is False
    assert [name for name, origin in result["found"].items() if origin is None] == []
    # A standalone build copies exo from the stage: real files, the cards and dashboard included.
    stage = tmp_path / "app-macos" / "build" / "exo-package" / "exo"
    assert result["found"]["exo"] == str(stage / "__init__.py")
    assert [p for p in stage.rglob("*") if p.is_symlink()] == []
    assert all((stage / asset).is_file() for asset in result["required"])
    cards = sorted(p.name for p in (stage / "assets" / "model_cards").iterdir())
    assert "exo-demo.toml" in cards and len(cards) == len(list((REPO / "model_cards").glob("*.toml")))


def test_setup_py_alias_build_uses_the_package_in_place(tmp_path):
    result = _run_setup(tmp_path, "-A")
    assert not (tmp_path / "app-macos" / "build").exists()
    assert result["found"]["exo"] == str(REPO / "src" / "exo" / "__init__.py")


def test_a_frozen_app_launches_exo_modules_through_its_own_executable(tmp_path, monkeypatch):
    plain = [sys.executable, "-m", "exo.menubar.tethered", "--parent-pid", "7", "serve", "--port", "1"]
    assert serve_argv(["--port", "1"], parent_pid=7) == plain
    monkeypatch.setattr(sys, "frozen", "macosx_app", raising=False)
    contents = tmp_path / "exo.app" / "Contents"
    (contents / "MacOS").mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(contents / "MacOS" / "python"))
    monkeypatch.delenv("EXECUTABLEPATH", raising=False)
    with pytest.raises(FileNotFoundError, match="cannot find this app's executable"):
        serve_argv([], parent_pid=7)
    (contents / "Info.plist").write_bytes(plistlib.dumps({"CFBundleExecutable": "exo"}))
    app = str(contents / "MacOS" / "exo")
    assert serve_argv(["--port", "1"], parent_pid=7) == [app, *plain[1:]]
    monkeypatch.setenv("EXECUTABLEPATH", "/Applications/exo.app/Contents/MacOS/exo")
    assert module_argv("exo.runner") == ["/Applications/exo.app/Contents/MacOS/exo", "-m", "exo.runner"]
    from exo.cluster.supervisor import InstanceSupervisor

    runner_cmd = InstanceSupervisor(tmp_path, node_id=lambda: "n").runner_cmd
    assert runner_cmd == ["/Applications/exo.app/Contents/MacOS/exo", "-m", "exo.runner"]


def test_the_app_script_runs_only_exo_modules():
    done = subprocess.run(
        [sys.executable, str(APP_SCRIPT), "-m", "os"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "-m runs exo's own modules (exo.*), not os" in done.stderr


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


@pytest.mark.timeout(240)
def test_frozen_app_starts_exo_and_its_runner_and_prints_its_menu(make_controller, tmp_path, monkeypatch):
    launcher = tmp_path / "exo.app" / "Contents" / "MacOS" / "exo"
    launcher.parent.mkdir(parents=True)
    launcher.write_text(LAUNCHER.format(python=sys.executable, script=APP_SCRIPT))
    launcher.chmod(0o755)
    monkeypatch.setattr(sys, "frozen", "macosx_app", raising=False)
    monkeypatch.setenv("EXECUTABLEPATH", str(launcher))
    home = tmp_path / "home"
    controller = make_controller(home=home)
    controller.start_daemon()
    wait_state(controller, DaemonState.RUNNING)
    daemon = _cmdline(controller.daemon_pid)
    at = daemon.index(str(APP_SCRIPT))
    assert daemon[at + 1 : at + 5] == ["-m", "exo.menubar.tethered", "--parent-pid", str(os.getpid())]

    # The daemon runs "frozen" too: its runner goes through the same executable.
    created = httpx.post(
        controller.api_url + "/v1/instances", json={"model": "exo-demo", "wait": True}, timeout=120
    )
    assert created.status_code == 201, created.text
    runner = _cmdline(created.json()["instance"]["pid"])
    at = runner.index(str(APP_SCRIPT))
    assert runner[at + 1 : at + 3] == ["-m", "exo.runner"]

    for argv in ([str(APP_SCRIPT)], ["-m", "exo.menubar"]):
        done = subprocess.run(
            [sys.executable, *argv, "--once", "--url", controller.api_url],
            env=app_env(home),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0] == "exo: running" and "exo-demo: ready on " in done.stdout, done.stdout
        assert "Start exo  (disabled)" in lines
        assert "[x] Native MTP" in lines  # the app's default is no lock for another app
