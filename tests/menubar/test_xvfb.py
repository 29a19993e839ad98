"""``exo menubar`` as a user runs it on Linux: pystray's X11 backend on a real X server (Xvfb), with this
test acting as the system tray (it owns the tray selection and receives the icon's dock request).

Needs the Xvfb binary (Debian: ``xvfb``) and, for the clipboard, ``xclip``: skipped without them, except
in CI (``CI`` set), where they must be installed and a skip would hide that.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster.daemons import free_port, wait_for

from .apps import app_env, get_json, pid_gone, serve_flags


def _require(condition: bool, reason: str) -> None:
    if condition:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must install it (apt-get install xvfb xclip, see docs/development.md)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def x_display() -> Iterator[str]:
    _require(shutil.which("Xvfb") is not None, "Xvfb is not installed (apt-get install xvfb)")
    pytest.importorskip(
        "Xlib", reason="python-xlib (pystray's X11 backend) is not installed: pip install 'exo[menubar]'"
    )
    read_fd, write_fd = os.pipe()
    server = subprocess.Popen(
        ["Xvfb", "-displayfd", str(write_fd), "-screen", "0", "640x480x24", "-nolisten", "tcp"],
        pass_fds=(write_fd,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(write_fd)
    with os.fdopen(read_fd) as announced:
        number = announced.readline().strip()  # Xvfb writes its display number once it accepts clients
    try:
        assert number.isdigit(), f"Xvfb did not start (exit {server.poll()})"
        yield f":{number}"
    finally:
        server.terminate()
        server.wait(10)


class FakeTray:
    """The system tray as the XEMBED spec has it: owner of _NET_SYSTEM_TRAY_S0; icons ask it to dock them."""

    def __init__(self, display_name: str) -> None:
        import Xlib.display
        import Xlib.X

        self.X = Xlib.X
        self.display = Xlib.display.Display(display_name)
        screen = self.display.screen()
        self.window = screen.root.create_window(0, 0, 1, 1, 0, screen.root_depth)
        self.opcode = self.display.intern_atom("_NET_SYSTEM_TRAY_OPCODE")
        self.window.set_selection_owner(self.display.intern_atom("_NET_SYSTEM_TRAY_S0"), Xlib.X.CurrentTime)
        self.display.sync()

    def wait_for_dock_request(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while self.display.pending_events():
                event = self.display.next_event()
                if event.type == self.X.ClientMessage and event.client_type == self.opcode:
                    _, opcode, window_id, *_ = event.data[1]
                    if opcode == 0:  # SYSTEM_TRAY_REQUEST_DOCK
                        return window_id
            time.sleep(0.05)
        raise AssertionError("no icon asked the tray to dock it")

    def title(self, window_id: int) -> str:
        return self.display.create_resource_object("window", window_id).get_wm_name() or ""

    def left_click(self, window_id: int) -> None:
        import Xlib.protocol.event

        window = self.display.create_resource_object("window", window_id)
        root = self.display.screen().root
        event = Xlib.protocol.event.ButtonPress(
            time=self.X.CurrentTime,
            root=root,
            window=window,
            same_screen=1,
            child=self.X.NONE,
            root_x=1,
            root_y=1,
            event_x=1,
            event_y=1,
            state=0,
            detail=1,
        )
        window.send_event(event, event_mask=self.X.NoEventMask)  # no mask: to the client owning the window
        self.display.flush()


@pytest.mark.timeout(180)
def test_exo_menubar_on_x11_starts_shows_clicks_and_quits(x_display, tmp_path: Path):
    tray = FakeTray(x_display)
    opened = tmp_path / "opened-url"
    browser = tmp_path / "browser"
    browser.write_text(f'#!/bin/sh\nprintf %s "$1" > {opened}\n')
    browser.chmod(0o755)
    url = f"http://127.0.0.1:{free_port()}"
    env = app_env(tmp_path / "home", DISPLAY=x_display, PYSTRAY_BACKEND="xorg", BROWSER=f"{browser} %s")
    app = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exo.cli.main",
            "menubar",
            "--url",
            url,
            "--start",
            "--poll-interval",
            "0.3",
            "--",
            *serve_flags(),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        icon = tray.wait_for_dock_request(timeout=30)
        wait_for(
            lambda: tray.title(icon) == "exo: running, 1 node, 0 model(s)",
            60,
            "the icon's title to say running",
        )
        assert get_json(url + "/health")["status"] == "ok"
        tray.left_click(icon)  # pystray's X11 backend: a left click runs the menu's default entry
        wait_for(
            lambda: opened.exists() and opened.read_text() == url + "/", 15, "the dashboard to be opened"
        )
        children = " ".join(p.read_text() for p in Path(f"/proc/{app.pid}/task").glob("*/children"))
        [daemon_pid] = [int(pid) for pid in children.split()]  # the app's only child: its exo
        app.send_signal(signal.SIGTERM)
        output, _ = app.communicate(timeout=30)
    finally:
        if app.poll() is None:
            app.kill()
            print(app.communicate()[0])  # the app's output, for the failure report
    assert app.returncode == 0, output
    assert "pystray's xorg backend has no menus" in output and "exo: running (started here)" in output
    assert "Traceback" not in output, output
    assert pid_gone(daemon_pid)


def test_copy_api_url_reaches_the_x_clipboard(x_display, monkeypatch):
    _require(shutil.which("xclip") is not None, "xclip is not installed (apt-get install xclip)")
    pytest.importorskip("pyperclip", reason="pyperclip is not installed: pip install 'exo[menubar]'")
    monkeypatch.setenv("DISPLAY", x_display)
    from exo.menubar.app import copy_text

    copy_text("http://127.0.0.1:52415")

    def pasted() -> str:  # xclip serves the selection from a process it forks: it may take a moment
        out = subprocess.run(
            ["xclip", "-o", "-selection", "clipboard"], capture_output=True, text=True, timeout=10
        )
        return out.stdout

    wait_for(lambda: pasted() == "http://127.0.0.1:52415", 10, "the clipboard to hold the API URL")
