"""Controllers on real ``exo serve`` daemons: each test's app has its own EXO_HOME, ports and log file."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster.daemons import free_port

from exo.menubar import MenubarController

from .apps import app_env, serve_flags


@pytest.fixture
def make_controller(tmp_path: Path) -> Iterator[Callable[..., MenubarController]]:
    """``make_controller(home=..., env={...}, **kwargs)``: a controller whose daemon dies with the test."""
    made: list[MenubarController] = []

    def make(home: Path | None = None, env: dict[str, str] | None = None, **kwargs: Any) -> MenubarController:
        home = home or tmp_path / f"home{len(made)}"
        kwargs.setdefault("url", f"http://127.0.0.1:{free_port()}")
        kwargs.setdefault("serve_args", serve_flags())
        kwargs.setdefault("request_timeout_s", 1.0)
        controller = MenubarController(env=app_env(home, **(env or {})), **kwargs)
        made.append(controller)
        return controller

    yield make
    for controller in made:
        pid = controller.daemon_pid
        if pid is not None:
            os.kill(pid, signal.SIGCONT)  # a test may have left it stopped (SIGSTOP)
            controller.stop_timeout_s = 5.0
            controller.shutdown()
