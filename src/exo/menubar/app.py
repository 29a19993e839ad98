"""The thin menu layer: polls the controller, draws its snapshot through a status-item backend, and runs
the clicked action on a worker thread (Stop exo can take the whole stop timeout; the UI never waits).

    app = MenubarApp(MenubarController(), PystrayBackend())
    app.run()          # blocks in the UI loop until Quit; stops the daemon it started
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import webbrowser
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from exo.settings import SettingsError

from .controller import MenubarController
from .errors import MenubarError
from .menu import Action, MenuEntry, build_menu, render_text, stable_view, title
from .state import DaemonState, Snapshot
from .tray import StatusItemBackend

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 2.0
FAST_POLL_INTERVAL_S = 0.5  # while exo starts or stops, so the menu follows it closely


def open_url(url: str) -> None:
    if not webbrowser.open(url):
        raise MenubarError(f"no web browser could open {url}")


def open_path(path: Path) -> None:
    """Open a file with the desktop's default application (Console for a log on macOS)."""
    command = ["open", str(path)] if sys.platform == "darwin" else ["xdg-open", str(path)]
    try:
        subprocess.run(command, check=True, timeout=15, capture_output=True)
    except (OSError, subprocess.SubprocessError) as e:
        raise MenubarError(f"cannot open {path} ({e})") from None


def copy_text(text: str) -> None:
    import pyperclip

    try:
        pyperclip.copy(text)
    except pyperclip.PyperclipException as e:
        raise MenubarError(f"cannot copy to the clipboard ({e})") from None


def _log_failure(future: Future[None]) -> None:
    """An action that failed with something other than a user error is a bug: log it, do not lose it."""
    error = None if future.cancelled() else future.exception()
    if error is not None:
        log.error("a menu action failed", exc_info=error)


class MenubarApp:
    def __init__(
        self,
        controller: MenubarController,
        backend: StatusItemBackend,
        *,
        poll_interval_s: float = POLL_INTERVAL_S,
        open_url: Callable[[str], None] = open_url,
        open_path: Callable[[Path], None] = open_path,
        copy_text: Callable[[str], None] = copy_text,
        echo: Callable[[str], None] | None = None,
        start_daemon: bool = False,
    ) -> None:
        self.controller = controller
        self.backend = backend
        self.poll_interval_s = poll_interval_s
        self.open_url, self.open_path, self.copy_text = open_url, open_path, copy_text
        self.echo = echo  # prints the menu when it changes (backends without menus, terminals)
        self.start_daemon = start_daemon
        self.snapshot: Snapshot | None = None
        self.entries: list[MenuEntry] = []
        self._render_lock = threading.Lock()
        self._rendered: tuple | None = None
        self._echoed: tuple | None = None
        self._quitting = threading.Event()
        self._quit_requested = threading.Event()
        self._actions = ThreadPoolExecutor(max_workers=1, thread_name_prefix="exo-menubar-action")
        self._poller: threading.Thread | None = None

    # -- running ----------------------------------------------------------------------------------------
    def run(self) -> None:
        """The UI loop (blocks, main thread) until Quit or ``quit()``; then stops the daemon it started."""
        try:
            self.backend.run(on_ready=self._on_ready)
        finally:
            self._quitting.set()
            self._actions.shutdown(wait=True, cancel_futures=True)
            self.controller.shutdown()

    def _on_ready(self) -> None:
        try:
            if self.start_daemon and self.refresh().can_start:
                self.click(Action.START)
        finally:  # whatever happened, the menu keeps following the daemon
            self._poller = threading.Thread(target=self._poll, name="exo-menubar-poll", daemon=True)
            self._poller.start()

    def _poll(self) -> None:
        while not self._quitting.is_set():
            try:
                snapshot = self.refresh()
                busy = snapshot.state in (DaemonState.STARTING, DaemonState.STOPPING)
            except Exception:  # noqa: BLE001 - a bug must not end polling silently: log it, keep going
                log.exception("refreshing the menu failed")
                busy = False
            self._quitting.wait(FAST_POLL_INTERVAL_S if busy else self.poll_interval_s)

    def refresh(self) -> Snapshot:
        snapshot = self.controller.refresh()
        self._render(snapshot)
        return snapshot

    def _render(self, snapshot: Snapshot) -> None:
        entries = build_menu(snapshot)
        key = (title(snapshot), snapshot.state, tuple(entries))
        with self._render_lock:
            if self.snapshot is not None and snapshot.seq < self.snapshot.seq:
                return  # a refresh that finished after a newer one (poll thread vs action thread)
            self.snapshot, self.entries = snapshot, entries
            if key == self._rendered:
                return
            self._rendered = key
            self.backend.update(title(snapshot), snapshot.state, entries, self.click)
            if self.echo is not None and stable_view(entries) != self._echoed:
                self._echoed = stable_view(entries)
                self.echo(render_text(entries))

    # -- actions ----------------------------------------------------------------------------------------
    def click(self, action: Action) -> Future[None]:
        """What a menu click calls (from the UI thread): the action runs on the worker thread."""
        try:
            future = self._actions.submit(self._perform, action)
        except RuntimeError:  # the app has quit: nothing runs any more
            future = Future()
            future.set_result(None)
            return future
        future.add_done_callback(_log_failure)
        return future

    def _perform(self, action: Action) -> None:
        try:
            self._dispatch(action)
        except (MenubarError, SettingsError, OSError) as e:
            self._render(self.controller.record_error(str(e)))
            return
        if action is not Action.QUIT:
            self.refresh()

    def _dispatch(self, action: Action) -> None:
        c = self.controller
        if action is Action.TOGGLE_NATIVE_MTP:
            shown = self.snapshot.native_mtp.enabled if self.snapshot else c.snapshot.native_mtp.enabled
            c.set_native_mtp(not shown)
        elif action is Action.START:
            c.start_daemon()
        elif action is Action.STOP:
            c.stop_daemon()
        elif action is Action.OPEN_DASHBOARD:
            self.open_url(c.dashboard_url)
        elif action is Action.COPY_API_URL:
            self.copy_text(c.api_url + "/v1")  # the base URL OpenAI clients take
        elif action is Action.OPEN_LOG:
            if not c.log_path.exists():
                raise MenubarError(f"no log yet: {c.log_path} is written when this app starts exo")
            self.open_path(c.log_path)
        elif action is Action.QUIT:
            self._quit()
        else:  # pragma: no cover - every Action is handled above
            raise MenubarError(f"unknown action {action!r}")

    def quit(self) -> None:
        """Quit from any thread (a signal handler's thread, a test): as if Quit were clicked, once."""
        if not self._quit_requested.is_set():
            self._quit_requested.set()
            self.click(Action.QUIT)

    def _quit(self) -> None:
        try:
            self.controller.shutdown()  # before the UI goes; polling goes on: the menu shows "stopping"
        finally:
            self._quitting.set()
            self.backend.stop()
