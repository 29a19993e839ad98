"""How exo runs one of its own modules in a child process: the daemon the menu-bar app starts, the runners
and download steps the daemon starts.

Normally ``sys.executable -m MODULE``. Inside exo.app (a py2app bundle, ``sys.frozen == "macosx_app"``)
``sys.executable`` is the bundle's ``Contents/MacOS/python``, which py2app does not build to run on its
own (dyld "Library not loaded", "Failed to import encodings"); there the child is the app's own
executable with ``-m MODULE``, which ``app-macos/exo_menubar_app.py`` dispatches on. py2app's launcher
sets ``EXECUTABLEPATH`` to that executable; without it, ``Info.plist`` names it.
"""

from __future__ import annotations

import os
import plistlib
import sys
from pathlib import Path

PY2APP_FROZEN = "macosx_app"


def module_argv(module: str) -> list[str]:
    """The command line that runs ``python -m module`` with this process's exo."""
    if getattr(sys, "frozen", None) == PY2APP_FROZEN:
        return [app_executable(), "-m", module]
    return [sys.executable, "-m", module]


def app_executable() -> str:
    """The py2app bundle's main executable (``.../exo.app/Contents/MacOS/exo``)."""
    if os.environ.get("EXECUTABLEPATH"):
        return os.environ["EXECUTABLEPATH"]
    contents = Path(sys.executable).parent.parent  # .../Contents/MacOS/python -> .../Contents
    try:
        name = plistlib.loads((contents / "Info.plist").read_bytes())["CFBundleExecutable"]
    except (OSError, ValueError, KeyError) as e:
        raise FileNotFoundError(
            f"cannot find this app's executable: no EXECUTABLEPATH and no usable {contents}/Info.plist ({e!r})"
        ) from None
    return str(contents / "MacOS" / name)
