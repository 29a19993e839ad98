"""``exo menubar --text`` as a user runs it: the numbered menu on the terminal, entries chosen by number on
stdin, against the real ``exo serve`` the app starts: Start exo, the Native MTP toggle, Stop exo, Quit."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cluster.daemons import free_port

from .apps import app_env, get_json, pid_gone, serve_flags

NUMBERED = re.compile(r"^ ?(\d+)\. (?:\[[x ]\] )?(.*?)(  \(disabled\))?$")


class Terminal:
    """The app's stdin and stdout: menus as printed (the last one complete), entries chosen by text."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))

    def menu(self, predicate, what: str, timeout: float = 60) -> list[str]:
        """The first menu printed from now on (or the last one already printed) that satisfies predicate."""
        deadline = time.monotonic() + timeout
        block: list[str] = []
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                continue
            self.seen.append(line)
            if line.startswith("exo: "):
                block = [line]
            elif block:
                block.append(line)
                if line.startswith("exo menubar: type a number") and predicate(block):
                    return block
        raise AssertionError(f"no menu with {what} within {timeout} s; output:\n" + "\n".join(self.seen))

    def rest(self) -> list[str]:
        """Everything printed, once the app has exited."""
        while True:
            try:
                self.seen.append(self.lines.get(timeout=5))
            except queue.Empty:
                return self.seen

    def choose(self, block: list[str], text: str) -> None:
        for line in block:
            match = NUMBERED.match(line)
            if match and match.group(2) == text:
                self.type(match.group(1))
                return
        raise AssertionError(f"no entry {text!r} in the menu:\n" + "\n".join(block))

    def type(self, text: str) -> None:
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()


@pytest.mark.timeout(180)
def test_exo_menubar_text_runs_every_action_from_stdin(tmp_path: Path):
    url = f"http://127.0.0.1:{free_port()}"
    app = subprocess.Popen(
        [sys.executable, "-m", "exo.cli.main", "menubar", "--text", "--url", url, "--poll-interval", "0.3"]
        + ["--", *serve_flags()],
        env=app_env(tmp_path / "home"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    term = Terminal(app)
    try:
        menu = term.menu(lambda b: b[0] == "exo: stopped", "exo stopped")
        assert " 3. Open Dashboard  (disabled)" in menu
        term.type("3")  # disabled now: nothing runs
        term.type("99")
        term.choose(menu, "Start exo")
        menu = term.menu(lambda b: b[0] == "exo: running (started here)", "exo running")
        assert any(line.endswith(" GiB free") for line in menu) and " 1. [x] Native MTP" in menu
        assert (
            "Open Dashboard: not now (disabled)" in term.seen and "choose a number from 1 to 6" in term.seen
        )
        children = " ".join(p.read_text() for p in Path(f"/proc/{app.pid}/task").glob("*/children"))
        [daemon_pid] = [int(pid) for pid in children.split()]

        term.choose(menu, "Native MTP")
        menu = term.menu(lambda b: " 1. [ ] Native MTP" in b, "Native MTP off")
        assert get_json(url + "/v1/settings")["native_mtp_enabled"] is False
        term.choose(menu, "Native MTP")
        menu = term.menu(lambda b: " 1. [x] Native MTP" in b, "Native MTP on")
        assert get_json(url + "/v1/settings")["native_mtp_enabled"] is True

        term.choose(menu, "Stop exo")
        menu = term.menu(lambda b: b[0] == "exo: stopped", "exo stopped again")
        assert pid_gone(daemon_pid)
        term.choose(menu, "Quit")
        assert app.wait(30) == 0
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)
    output = "\n".join(term.rest())
    assert "Traceback" not in output and "> Stop exo" in term.seen and "> Quit" in output, output


def test_end_of_input_quits_and_stops_the_exo_it_started(tmp_path: Path):
    url = f"http://127.0.0.1:{free_port()}"
    app = subprocess.Popen(
        [sys.executable, "-m", "exo.cli.main", "menubar", "--text", "--start", "--url", url]
        + ["--", *serve_flags()],
        env=app_env(tmp_path / "home"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    term = Terminal(app)
    try:
        term.menu(lambda b: b[0] == "exo: running (started here)", "exo running")
        children = " ".join(p.read_text() for p in Path(f"/proc/{app.pid}/task").glob("*/children"))
        [daemon_pid] = [int(pid) for pid in children.split()]
        app.stdin.close()  # Ctrl-D
        assert app.wait(30) == 0
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)
    assert pid_gone(daemon_pid)
