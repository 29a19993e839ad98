"""The entry point of exo.app (py2app): the same menu-bar app as ``exo menubar``.

``exo.app/Contents/MacOS/exo -m MODULE [args]`` runs one of exo's modules instead, as ``python -m`` would:
that is how the app starts its daemon (``exo.menubar.tethered``) and the daemon its runners, since
the bundle's own ``Contents/MacOS/python`` cannot run on its own (``exo.launch.module_argv``).
"""

import sys


def run_module(argv: list[str]) -> None:
    """``-m MODULE [args]``: run that exo module as ``__main__`` with ``args`` as its arguments."""
    import runpy

    if not argv or not argv[0].startswith("exo."):
        sys.exit(f"exo.app: -m runs exo's own modules (exo.*), not {argv[0] if argv else 'nothing'}")
    module, sys.argv[1:] = argv[0], argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if sys.argv[1:2] == ["-m"]:
    run_module(sys.argv[2:])
    sys.exit(0)

from exo.cli.main import main  # noqa: E402 - only the menu-bar app needs it

sys.exit(main(["menubar", *sys.argv[1:]]))
