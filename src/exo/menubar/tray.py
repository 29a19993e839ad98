"""The status item itself: a backend interface the app draws through, and its pystray implementation.

pystray picks the platform's backend: AppKit (``NSStatusItem``) on macOS, AppIndicator or GTK on a Linux
desktop with PyGObject, else plain X11 (``PYSTRAY_BACKEND`` forces one). pystray's X11 backend has no
menus: the icon, its tooltip and a left click (the menu's default action, Open Dashboard) work there, and
the app prints the menu to the terminal whenever it changes.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .errors import MenubarError
from .menu import Action, MenuEntry
from .state import DaemonState

ICON_SIZE = 64
# Colour by state, so the icon says running / starting / down at a glance on light and dark menu bars.
STATE_COLOURS = {
    DaemonState.RUNNING: (52, 199, 89),
    DaemonState.STARTING: (255, 179, 64),
    DaemonState.STOPPING: (255, 179, 64),
    DaemonState.STOPPED: (142, 142, 147),
    DaemonState.UNREACHABLE: (255, 69, 58),
}


class StatusItemBackend(Protocol):
    """What the app needs from a status item. Tests use a fake; ``PystrayBackend`` is the real one."""

    has_menu: bool  # False: only the default entry's action is reachable (a click on the icon)

    def run(self, on_ready: Callable[[], None]) -> None:
        """Run the UI loop (on the main thread) until ``stop()``; ``on_ready`` runs once it is up."""

    def update(
        self,
        title: str,
        state: DaemonState,
        entries: Sequence[MenuEntry],
        on_click: Callable[[Action], object],
    ) -> None:
        """Show this tooltip, icon state and menu (from any thread)."""

    def stop(self) -> None:
        """End ``run()`` (from any thread)."""


def status_image(state: DaemonState) -> Any:
    """A filled circle in the state's colour, drawn at run time (no image files to ship)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGBA", (ICON_SIZE, ICON_SIZE), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    margin = ICON_SIZE // 8
    box = (margin, margin, ICON_SIZE - margin, ICON_SIZE - margin)
    draw.ellipse(box, fill=STATE_COLOURS[state] + (255,), outline=(40, 40, 40, 255), width=ICON_SIZE // 16)
    return image


class _SayDockFailureOnce(logging.Filter):
    """pystray's X11 backend logs a traceback at every update while no system tray runs: say it once."""

    def __init__(self) -> None:
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != "Failed to dock icon":
            return True
        if self.said:
            return False
        self.said = True
        record.msg, record.args = "no system tray on this display (yet): the icon appears when one runs", ()
        record.exc_info = record.exc_text = None
        return True


class PystrayBackend:
    def __init__(self) -> None:
        try:
            import pystray
        except ImportError as e:
            raise MenubarError(f"the menu-bar app needs pystray: pip install 'exo[menubar]' ({e})") from None
        except Exception as e:  # noqa: BLE001 - python-xlib raises its own errors without a display
            raise MenubarError(
                f"no status-item backend could start ({type(e).__name__}: {e}); run it in a desktop session "
                "(on Linux, with $DISPLAY set, e.g. under Xvfb), or try `exo menubar --once`"
            ) from None
        self._pystray = pystray
        logging.getLogger("pystray._base").addFilter(_SayDockFailureOnce())  # pystray's icons log there
        self.icon = pystray.Icon("exo", icon=status_image(DaemonState.STOPPED), title="exo", menu=None)
        self.has_menu = bool(self.icon.HAS_MENU)
        self.name = type(self.icon).__module__.rsplit(".", 1)[-1].lstrip("_")  # darwin, xorg, gtk, ...
        self._state: DaemonState | None = None
        # One call into pystray at a time: its X11 backend hands calls from other threads to its loop
        # through one shared reply queue.
        self._calls = threading.Lock()
        self._stopped = False

    def run(self, on_ready: Callable[[], None]) -> None:
        def setup(icon: Any) -> None:
            icon.visible = True
            on_ready()

        self.icon.run(setup=setup)

    def update(
        self,
        title: str,
        state: DaemonState,
        entries: Sequence[MenuEntry],
        on_click: Callable[[Action], object],
    ) -> None:
        pystray = self._pystray

        def item(entry: MenuEntry) -> Any:
            if entry.separator:
                return pystray.Menu.SEPARATOR
            action = entry.action
            checked = None if entry.checked is None else functools.partial(_constant, entry.checked)
            return pystray.MenuItem(
                entry.text,
                # A partial, not a lambda with a default: pystray counts a lambda's parameters.
                None if action is None else functools.partial(_clicked, on_click, action),
                enabled=entry.enabled and action is not None,
                checked=checked,
                default=entry.default,
            )

        menu = pystray.Menu(*[item(e) for e in entries])

        def apply() -> None:
            with self._calls:
                if self._stopped:
                    return  # after stop() the loop is gone: a call would wait for it forever
                if state is not self._state:
                    self._state = state
                    self.icon.icon = status_image(state)
                self.icon.title = title
                self.icon.menu = menu  # pystray rebuilds the native menu
                self._flush_x11()

        _on_ui_thread(apply)

    def stop(self) -> None:
        def stop_once() -> None:
            with self._calls:
                if not self._stopped:
                    self._stopped = True
                    self.icon.stop()
                    self._flush_x11()

        _on_ui_thread(stop_once)

    def _flush_x11(self) -> None:
        """Make sure what pystray's X11 loop queued (a title, the window's destruction) reaches the server.

        python-xlib's threaded display returns early from a flush while another thread is sending, so a
        request the loop queued in a handler can wait, unsent, until some other event wakes the loop; on
        an idle display that is never (seen as a title that never changed and a Quit that never ended the
        loop). A round trip from this thread sends everything queued before it.
        """
        display = getattr(self.icon, "_display", None) if self.name == "xorg" else None
        if display is not None:
            display.sync()


def _clicked(on_click: Callable[[Action], object], action: Action, _icon: Any, _item: Any) -> None:
    on_click(action)


def _constant(value: bool, _item: Any) -> bool:
    return value


def _on_ui_thread(fn: Callable[[], None]) -> None:
    """AppKit objects may only change on the main thread; pystray's other backends marshal calls."""
    if sys.platform == "darwin":
        from PyObjCTools import AppHelper

        AppHelper.callAfter(fn)
    else:
        fn()
