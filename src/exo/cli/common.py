"""What every ``exo`` subcommand shares: the user-error type, exit statuses and JSON output.

A module of its own so that the subcommands (``exo.cli.run``, ``exo.cli.cluster``, ...) and the entry point
(``exo.cli.main``, which imports them) both import it, and neither imports the other: run as
``python -m exo.cli.main`` the entry point is ``__main__``, and an error class defined there would be a
second class, not the one the subcommands raise.
"""

from __future__ import annotations

import json
import sys

EXIT_ERROR = 1
EXIT_USAGE = 2


class CommandError(Exception):
    """An error for the user: printed without a traceback, exit status 1."""


def print_json(payload: object) -> None:
    json.dump(payload, sys.stdout, indent=None, ensure_ascii=False)
    sys.stdout.write("\n")
    sys.stdout.flush()
