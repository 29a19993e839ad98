"""Helpers for the menu-bar tests: a test app's environment, daemon flags, waiting on states, pids."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
from cluster.daemons import free_port, python_path

from exo.menubar import DaemonState, MenubarController, Snapshot


def serve_flags() -> list[str]:
    """exo serve flags for a test daemon: loopback only, its own gRPC port, no zeroconf."""
    return ["--host", "127.0.0.1", "--grpc-port", str(free_port()), "--no-discovery"]


def app_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXO_") or k == "EXO_FIXTURE_DIR"}
    return {**env, "EXO_HOME": str(home), "PYTHONPATH": python_path(), **extra}


def wait_state(
    controller: MenubarController, state: DaemonState, timeout: float = 60.0
) -> tuple[Snapshot, list[DaemonState]]:
    """Refresh until the state is reached; also returns the states seen on the way, in order."""
    seen: list[DaemonState] = []
    deadline = time.monotonic() + timeout
    while True:
        snapshot = controller.refresh()
        if not seen or seen[-1] is not snapshot.state:
            seen.append(snapshot.state)
        if snapshot.state is state:
            return snapshot, seen
        if time.monotonic() > deadline:
            log = controller.log_path.read_text()[-3000:] if controller.log_path.exists() else ""
            raise AssertionError(
                f"still {snapshot.state} ({snapshot.detail}) after {timeout} s, seen {seen}\n{log}"
            )
        time.sleep(0.1)


def get_json(url: str) -> Any:
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def pid_gone(pid: int) -> bool:
    """Exited (a zombie counts: no reaper may be running in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")
