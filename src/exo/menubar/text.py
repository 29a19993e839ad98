"""A status item on a terminal (``exo menubar --text``): the menu printed with numbers, an entry run by
typing its number and Enter. Every action can be tried this way where no menu can be drawn (pystray's
X11 backend has none; a terminal over SSH has no tray at all).

The menu is printed again after each action and whenever it changes (not for live figures such as free
memory); an empty line prints it again. End of input (Ctrl-D) is Quit.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TextIO

from .menu import Action, MenuEntry, actionable, render_text, stable_view
from .state import DaemonState

PROMPT = "exo menubar: type a number and Enter (Enter alone: the menu again)"


def _print(text: str) -> None:
    print(text, flush=True)


class TextBackend:
    has_menu = True
    name = "text"

    def __init__(self, stdin: TextIO | None = None, out: Callable[[str], None] = _print) -> None:
        self._stdin = sys.stdin if stdin is None else stdin
        self._out = out
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._entries: list[MenuEntry] = []
        self._on_click: Callable[[Action], object] | None = None
        self._shown: tuple | None = None

    def run(self, on_ready: Callable[[], None]) -> None:
        threading.Thread(target=self._read, name="exo-menubar-stdin", daemon=True).start()
        on_ready()
        while not self._stopped.is_set():
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                continue
            self._choose(line)

    def update(
        self,
        title: str,
        state: DaemonState,
        entries: Sequence[MenuEntry],
        on_click: Callable[[Action], object],
    ) -> None:
        with self._lock:
            self._entries, self._on_click = list(entries), on_click
        self._show(force=False)

    def stop(self) -> None:
        self._stopped.set()

    def _read(self) -> None:
        for line in self._stdin:
            self._lines.put(line)
        self._lines.put(None)

    def _show(self, force: bool) -> None:
        with self._lock:
            view = stable_view(self._entries)
            if not force and view == self._shown:
                return
            self._shown = view
            self._out(f"{render_text(self._entries, numbered=True)}\n{PROMPT}")

    def _choose(self, line: str | None) -> None:
        with self._lock:
            choices, on_click = actionable(self._entries), self._on_click
        text = "" if line is None else line.strip()
        if line is None:  # end of input: Quit (stops an exo this app started)
            [entry] = [e for e in choices if e.action is Action.QUIT]
        elif not text:
            self._show(force=True)
            return
        elif not text.isdigit() or not 1 <= int(text) <= len(choices):
            self._out(f"choose a number from 1 to {len(choices)}")
            return
        else:
            entry = choices[int(text) - 1]
        if not entry.enabled or on_click is None:
            self._out(f"{entry.text}: not now (disabled)")
            return
        self._out(f"> {entry.text}")
        done = on_click(entry.action)
        if isinstance(done, Future):
            done.result()  # the action's outcome (or its error line) is in the menu printed next
        if not self._stopped.is_set():
            self._show(force=True)
