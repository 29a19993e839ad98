"""The menu-bar app without any UI: the daemon's state from its API, the actions, the toggle's persistence.

Everything the menu does goes through ``MenubarController`` (tested against a real ``exo serve``); the
menu layer (``exo.menubar.app``) only renders ``Snapshot``s and calls these methods.

The Native MTP toggle is the node's own switch, kept in ``$EXO_HOME/settings.json`` (the file ``exo
serve`` reads at start and ``PUT /v1/settings`` writes): while the daemon runs, a flip is a ``PUT``
(it applies from the next request on); while it is stopped, the flip is written to that file, and the
next Start exo passes it to the daemon as ``EXO_NATIVE_MTP_ENABLED``, marked as the app's default
(``EXO_NATIVE_MTP_ENABLED_FROM_APP=1``: the daemon's source "app", no override that locks the toggle
in the dashboard or another menu-bar app). It is locked (shown disabled, with the reason) when the
environment forces it: ``EXO_NATIVE_MTP_ENABLED`` in the app's own environment, or a running daemon
that reports it among its ``env_overrides`` (set where that daemon was started).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from exo.settings import (
    Settings,
    SettingsError,
    app_default_var,
    env_var,
    load_settings,
    persist_settings,
)

from .api import DaemonAPI
from .errors import (
    DaemonAlreadyRunningError,
    DaemonAPIError,
    DaemonBusyError,
    DaemonUnreachableError,
    MenubarError,
    NativeMTPLockedError,
    NotStartedHereError,
)
from .process import DaemonProcess, StopOutcome, serve_argv
from .state import ClusterSummary, DaemonState, NativeMTPToggle, Snapshot, cluster_summary

MTP_ENV = env_var("native_mtp_enabled")
MTP_FROM_APP_ENV = app_default_var("native_mtp_enabled")
LOG_NAME = "logs/exo-serve.log"


class MenubarController:
    """Thread-safe: the app refreshes from a poll thread and runs actions on a worker thread."""

    def __init__(
        self,
        *,
        url: str | None = None,
        env: Mapping[str, str] | None = None,
        serve_args: Sequence[str] = (),
        stop_timeout_s: float = 10.0,
        start_timeout_s: float = 120.0,
        request_timeout_s: float = 2.0,
    ) -> None:
        for name, value in (
            ("stop_timeout_s", stop_timeout_s),
            ("start_timeout_s", start_timeout_s),
            ("request_timeout_s", request_timeout_s),
        ):
            if not value > 0:
                raise MenubarError(f"{name} must be a positive number of seconds, not {value!r}")
        self.env = dict(os.environ if env is None else env)
        settings = self._settings()  # a malformed EXO_* variable or settings file fails here, typed
        self.home = settings.home
        self.api_url = (url or f"http://127.0.0.1:{settings.api_port}").rstrip("/")
        parts = urlsplit(self.api_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MenubarError(f"the daemon URL must look like http://host:port, not {url!r}")
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        # Start exo starts a daemon on this machine: only where the app's URL points here.
        self.local = parts.hostname in ("127.0.0.1", "localhost", "::1")
        self.dashboard_url = self.api_url + "/"
        self.serve_args = list(serve_args)
        self.stop_timeout_s = stop_timeout_s
        self.start_timeout_s = start_timeout_s
        self.log_path = self.home / LOG_NAME
        key = settings.api_key.get_secret_value() if settings.api_key else None
        self.api = DaemonAPI(self.api_url, api_key=key, timeout=request_timeout_s)
        self._lock = threading.RLock()
        self._process: DaemonProcess | None = None
        self._answered_since_start = False
        self._stopping = False
        self._exit_note: str | None = None  # how this app's daemon ended, when it ended on its own
        self._error: str | None = None
        self._snapshot: Snapshot | None = None
        self._seq = 0
        self.last_exit_code: int | None = None  # how the last exo this app started ended (-N: signal N)

    # -- state ------------------------------------------------------------------------------------------
    def refresh(self) -> Snapshot:
        """Ask the daemon (a few small calls, each bounded by the request timeout) and rebuild the snapshot.

        One refresh at a time, and none across a start: a snapshot never mixes before and after.
        """
        with self._lock:
            self._note_exit()
            process, stopping = self._process, self._stopping
            cluster: ClusterSummary | None = None
            daemon_settings: dict | None = None
            detail: str | None = None
            try:
                self.api.health()
                state = DaemonState.RUNNING
                self._answered_since_start = self._answered_since_start or process is not None
                try:
                    cluster = cluster_summary(self.api.cluster())
                    daemon_settings = self.api.settings()
                except (DaemonAPIError, DaemonUnreachableError) as e:
                    detail = str(e)  # e.g. an API key this app does not have: running, details unknown
            except DaemonUnreachableError as e:
                state, detail = self._state_without_answer(process, e)
            except DaemonAPIError as e:
                state, detail = DaemonState.UNREACHABLE, f"{self.api_url} is not an exo API ({e})"
            if stopping:
                state = DaemonState.STOPPING
                pid = process.pid if process is not None else "?"
                detail = f"exo (pid {pid}) got SIGTERM; SIGKILL after {self.stop_timeout_s:g} s"
            elif state is DaemonState.STOPPED and self._exit_note:
                detail = self._exit_note
            started_here = process is not None and process.alive()
            self._seq += 1
            self._snapshot = Snapshot(
                state=state,
                detail=detail,
                api_url=self.api_url,
                dashboard_url=self.dashboard_url,
                started_here=started_here,
                can_start_here=self.local,
                cluster=cluster,
                native_mtp=self._mtp_toggle(state, daemon_settings),
                log_path=self.log_path,
                error=self._error,
                seq=self._seq,
            )
            return self._snapshot

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot if self._snapshot is not None else self.refresh()

    def _state_without_answer(
        self, process: DaemonProcess | None, error: DaemonUnreachableError
    ) -> tuple[DaemonState, str | None]:
        if process is not None and process.alive():
            waited = time.monotonic() - process.started_at
            silent, loading = process.progress()
            # Starting while its log grows, and for as long as it loads a model (no port before that).
            if not self._answered_since_start and (loading or silent < self.start_timeout_s):
                doing = f"{loading}, " if loading else ""
                return DaemonState.STARTING, f"exo (pid {process.pid}) is starting ({doing}{waited:.0f} s)"
            return DaemonState.UNREACHABLE, f"exo (pid {process.pid}) runs but does not answer: {error}"
        if error.refused:
            return DaemonState.STOPPED, None
        return DaemonState.UNREACHABLE, str(error)

    def _note_exit(self) -> None:
        """An own daemon that ended without Stop exo: say how (the log says why)."""
        process = self._process
        if process is None or process.alive():
            return
        self.last_exit_code = process.returncode
        if not self._stopping:
            when = "while starting" if not self._answered_since_start else ""
            last = process.log_tail(1)
            self._exit_note = (
                " ".join(
                    part
                    for part in (f"exo {process.exit_description()}", when, f"({last})" if last else "")
                    if part
                )
                + f"; see {process.log_path}"
            )
        self._process = None

    # -- Native MTP -------------------------------------------------------------------------------------
    def _settings(self) -> Settings:
        return load_settings(env=self.env)

    def _mtp_toggle(self, state: DaemonState, daemon_settings: dict | None) -> NativeMTPToggle:
        unavailable = {
            DaemonState.STARTING: "exo is starting",
            DaemonState.STOPPING: "exo is stopping",
            DaemonState.UNREACHABLE: "exo does not answer",
        }.get(state)
        if state is DaemonState.RUNNING and daemon_settings is None:
            unavailable = "exo's settings cannot be read"
        try:
            local = self._settings()
        except SettingsError as e:  # the settings file was edited into something invalid
            local, unavailable = None, str(e)
        locked = None if local is None else self._lock_reason(local, daemon_settings)
        if daemon_settings is not None and "native_mtp_enabled" in daemon_settings:
            enabled = bool(daemon_settings["native_mtp_enabled"])
            source = str(daemon_settings.get("sources", {}).get("native_mtp_enabled", "unknown"))
        elif local is not None:
            enabled, source = local.native_mtp_enabled, local.source("native_mtp_enabled")
        else:
            enabled, source = False, "unknown"
        return NativeMTPToggle(
            enabled=enabled, locked_reason=locked, unavailable_reason=unavailable, source=source
        )

    def _lock_reason(self, local: Settings, daemon_settings: dict | None) -> str | None:
        if local.source("native_mtp_enabled") == "env":
            return f"{MTP_ENV}={self.env[MTP_ENV]} is set in this app's environment"
        overrides = (daemon_settings or {}).get("env_overrides") or {}
        if "native_mtp_enabled" in overrides:
            return f"the running exo was started with {overrides['native_mtp_enabled']} set"
        return None

    def set_native_mtp(self, enabled: bool) -> Snapshot:
        snapshot = self.refresh()
        toggle = snapshot.native_mtp
        if toggle.locked_reason:
            raise NativeMTPLockedError(f"Native MTP cannot change: {toggle.locked_reason}")
        if toggle.unavailable_reason:
            raise DaemonBusyError(f"Native MTP cannot change now: {toggle.unavailable_reason}")
        if snapshot.state is DaemonState.RUNNING:
            self.api.put_settings({"native_mtp_enabled": enabled})
        # Also this app's own settings file: the choice the next Start exo passes (the daemon wrote the
        # same file if it shares this EXO_HOME; a daemon with another home keeps its own).
        persist_settings(self.home, {"native_mtp_enabled": enabled})
        return self._succeeded()

    # -- start / stop -----------------------------------------------------------------------------------
    def start_daemon(self) -> Snapshot:
        if not self.local:
            raise MenubarError(f"Start exo starts exo on this machine; {self.api_url} is another one")
        with self._lock:
            snapshot = self.refresh()
            if self._process is not None and self._process.alive():
                raise DaemonAlreadyRunningError(
                    f"this app's exo (pid {self._process.pid}) is still {snapshot.state}"
                )
            if snapshot.state is not DaemonState.STOPPED:
                raise DaemonAlreadyRunningError(f"exo is already {snapshot.state} at {self.api_url}")
            env = dict(self.env)
            if MTP_ENV not in env or not env[MTP_ENV]:  # the app's saved choice, as a default PUT may change
                env[MTP_ENV] = "1" if self._settings().native_mtp_enabled else "0"
                env[MTP_FROM_APP_ENV] = "1"
            argv = serve_argv(["--port", str(self.port), *self.serve_args])
            self._process = DaemonProcess.start(argv, env, self.log_path)
            self._answered_since_start = False
            self._exit_note = None
        return self._succeeded()

    def stop_daemon(self) -> StopOutcome:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``. Blocks until the process is gone."""
        with self._lock:
            process = self._process
            if process is None or not process.alive():
                raise NotStartedHereError(
                    f"the exo at {self.api_url} was not started by this app; stop it where it runs (Ctrl-C)"
                )
            self._stopping = True
        try:
            outcome = process.stop(self.stop_timeout_s)
        finally:
            with self._lock:
                self.last_exit_code = process.returncode
                self._stopping = False
                self._process = None
                self._exit_note = None
        if outcome is StopOutcome.FORCED:
            self.record_error(f"exo did not stop within {self.stop_timeout_s:g} s of SIGTERM and was killed")
        else:
            self._succeeded()
        return outcome

    def shutdown(self) -> StopOutcome | None:
        """On quit: stop the daemon if this app started it (never leave it orphaned)."""
        with self._lock:
            ours = self._process is not None and self._process.alive()
        return self.stop_daemon() if ours else None

    @property
    def daemon_pid(self) -> int | None:
        with self._lock:
            return self._process.pid if self._process is not None and self._process.alive() else None

    # -- errors -----------------------------------------------------------------------------------------
    def record_error(self, message: str) -> Snapshot:
        """An action failed: the message stays in the menu until an action succeeds."""
        with self._lock:
            self._error = message
        return self.refresh()

    def _succeeded(self) -> Snapshot:
        with self._lock:
            self._error = None
        return self.refresh()
