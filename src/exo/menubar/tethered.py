"""``exo serve`` tethered to a parent process: when the parent is gone, the daemon stops gracefully.

    python -m exo.menubar.tethered --parent-pid PID serve [serve flags...]

The menu-bar app starts its daemon this way. Quitting the app stops the daemon explicitly; this covers
the app being killed or crashing. The watcher sends the daemon SIGTERM (not SIGKILL), so it shuts down
as ``exo serve`` does on SIGTERM: its runners stop with it. A parent-pid watcher (every 0.5 s) rather
than Linux's PR_SET_PDEATHSIG: that fires when the *thread* that started the daemon ends (the app starts
it from a worker thread), and macOS has nothing like it.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from collections.abc import Sequence

WATCH_INTERVAL_S = 0.5
FORCE_AFTER_S = 30.0


def _stop_when_parent_is_gone(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_INTERVAL_S)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(FORCE_AFTER_S)  # still here: shutdown hangs; nobody is left to force it but us
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="exo-parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exo.menubar.tethered")
    parser.add_argument(
        "--parent-pid", type=int, required=True, help="stop gracefully when this process is gone"
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="the exo command line (e.g. serve --port 52415)"
    )
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("an exo command is required (e.g. serve)")
    if os.getppid() != args.parent_pid:  # the parent died before we got here
        return 1
    _stop_when_parent_is_gone(args.parent_pid)

    from exo.cli.main import main as exo_main

    return exo_main(args.command)


if __name__ == "__main__":
    raise SystemExit(main())
