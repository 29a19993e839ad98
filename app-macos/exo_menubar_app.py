"""The entry point of exo.app (py2app): the same menu-bar app as ``exo menubar``.

Start exo runs ``sys.executable -m exo.menubar.tethered ...``; inside the bundle that is the bundled
interpreter, which finds the bundled packages only through the path this process was given, so the
path is handed down to it.
"""

import os
import sys

os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)

from exo.cli.main import main  # noqa: E402 - after the path is set for the daemon it may start

sys.exit(main(["menubar", *sys.argv[1:]]))
