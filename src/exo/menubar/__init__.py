"""The exo menu-bar app: the daemon's state, the Native MTP toggle, Start/Stop exo, from the menu bar.

``MenubarController`` (``controller.py``) holds all behaviour and no UI; ``build_menu`` (``menu.py``)
turns its ``Snapshot`` into menu entries; ``MenubarApp`` (``app.py``) draws them through a status-item
backend (``tray.py``: pystray, AppKit on macOS, X11/AppIndicator/GTK on Linux) and runs the clicks.
``exo menubar`` runs it; ``app-macos/`` packages it as a macOS ``.app``.
"""

from .controller import MenubarController
from .errors import (
    DaemonAlreadyRunningError,
    DaemonAPIError,
    DaemonBusyError,
    DaemonStartError,
    DaemonUnreachableError,
    MenubarError,
    NativeMTPLockedError,
    NotStartedHereError,
)
from .menu import Action, MenuEntry, build_menu, render_text
from .process import StopOutcome
from .state import ClusterSummary, DaemonState, ModelStage, NativeMTPToggle, RunningModel, Snapshot

__all__ = [
    "Action",
    "ClusterSummary",
    "DaemonAPIError",
    "DaemonAlreadyRunningError",
    "DaemonBusyError",
    "DaemonStartError",
    "DaemonState",
    "DaemonUnreachableError",
    "MenuEntry",
    "MenubarController",
    "MenubarError",
    "ModelStage",
    "NativeMTPLockedError",
    "NativeMTPToggle",
    "NotStartedHereError",
    "RunningModel",
    "Snapshot",
    "StopOutcome",
    "build_menu",
    "render_text",
]
