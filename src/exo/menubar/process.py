"""The ``exo serve`` process the menu-bar app starts: its log file, and a graceful-then-forced stop.

The daemon runs tethered to the app (``exo.menubar.tethered``): if the app dies without stopping it
(killed, crashed), the daemon stops itself gracefully, so the app never leaves an orphaned daemon.
It gets its own session so that a terminal's Ctrl-C reaches the app only; the app then stops it.
"""

from __future__ import annotations

import enum
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from exo.launch import module_argv

from .errors import DaemonStartError

LOG_ROTATE_BYTES = 5 << 20  # at start, a log past this size moves to <name>.1 (one old log kept)
# What exo serve prints while `--model` loads, before its HTTP port opens, and once it serves.
LOADING_LINE, SERVING_LINE = "exo: loading ", "exo: serving on "


class StopOutcome(enum.StrEnum):
    GRACEFUL = "graceful"  # exited after SIGTERM within the timeout
    FORCED = "forced"  # still alive after the timeout: SIGKILL
    ALREADY_EXITED = "already exited"


def serve_argv(serve_args: Sequence[str], parent_pid: int | None = None) -> list[str]:
    """The command line of a daemon tethered to ``parent_pid`` (default: this process); inside exo.app, the
    app's own executable runs it (``exo.launch.module_argv``)."""
    parent = os.getpid() if parent_pid is None else parent_pid
    return [*module_argv("exo.menubar.tethered"), "--parent-pid", str(parent), "serve", *serve_args]


class DaemonProcess:
    def __init__(
        self, process: subprocess.Popen[bytes], log_path: Path, argv: Sequence[str], log_start: int = 0
    ) -> None:
        self.process = process
        self.log_path = log_path
        self.argv = list(argv)
        self.started_at = time.monotonic()
        self._scanned = log_start  # how far progress() has read this daemon's log
        self._loading: str | None = None
        self._log_grew_at = time.monotonic()

    @classmethod
    def start(cls, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> DaemonProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if log_path.exists() and log_path.stat().st_size > LOG_ROTATE_BYTES:
            log_path.replace(log_path.with_name(log_path.name + ".1"))
        with log_path.open("ab") as log:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"--- {stamp} started by the exo menu-bar app: {' '.join(argv)}\n".encode())
            log.flush()
            log_start = log.tell()
            try:
                process = subprocess.Popen(
                    list(argv),
                    env=dict(env),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as e:
                raise DaemonStartError(f"cannot start exo ({argv[0]}): {e}") from None
        return cls(process, log_path, argv, log_start)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def stop(self, timeout: float) -> StopOutcome:
        """SIGTERM (exo serve shuts down: requests, runners, gRPC), then SIGKILL after ``timeout`` s."""
        if not self.alive():
            return StopOutcome.ALREADY_EXITED
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
            return StopOutcome.GRACEFUL
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return StopOutcome.FORCED

    def progress(self) -> tuple[float, str | None]:
        """Seconds since this daemon's log last grew, and what it loads (``loading exo-demo on this node``)
        when its log says it loads a model and does not serve yet (``exo serve --model`` opens its port
        only once the model is loaded). Reads only what the log gained since the last call."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._scanned)
                gained = f.read()
        except OSError:
            gained = b""
        complete = gained[: gained.rfind(b"\n") + 1]
        if gained:
            self._log_grew_at = time.monotonic()
        self._scanned += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith(LOADING_LINE):
                self._loading = line.removeprefix("exo: ").strip()
            elif line.startswith(SERVING_LINE):
                self._loading = None
        return time.monotonic() - self._log_grew_at, self._loading

    def exit_description(self) -> str:
        code = self.returncode
        if code is None:
            return "is running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"was killed ({name})"
        return f"exited with status {code}"

    def log_tail(self, lines: int = 1) -> str:
        """The last non-empty lines of the log (why a start failed, usually)."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])
