"""``python -m exo.menubar [flags]``: the same as ``exo menubar [flags]``."""

import sys

from exo.cli.main import main

raise SystemExit(main(["menubar", *sys.argv[1:]]))
