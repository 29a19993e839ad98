"""The menu-bar app's typed errors: each carries a message a user can act on (shown in the menu)."""

from __future__ import annotations


class MenubarError(Exception):
    """An error for the user: shown as the menu's warning line, printed by ``exo menubar``."""


class DaemonUnreachableError(MenubarError):
    """No usable answer from the daemon's API. ``refused``: nothing listens there (a stopped daemon)."""

    def __init__(self, message: str, *, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


class DaemonAPIError(MenubarError):
    """The daemon answered with an error status (an OpenAI-style error body, when it has one)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NativeMTPLockedError(MenubarError):
    """The Native MTP toggle cannot change: an environment variable forces the value."""


class DaemonAlreadyRunningError(MenubarError):
    """Start exo was asked while a daemon already answers (or this app's daemon is still alive)."""


class NotStartedHereError(MenubarError):
    """Stop exo was asked for a daemon this app did not start (it has no handle on that process)."""


class DaemonStartError(MenubarError):
    """The daemon process could not be started at all (e.g. the Python executable is missing)."""


class DaemonBusyError(MenubarError):
    """The action needs an answering daemon and exo is starting, stopping or does not answer."""
