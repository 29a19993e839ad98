"""``exo menubar``: the menu-bar app (macOS menu bar; a Linux tray icon, e.g. under Xvfb), ``--once`` to
print the menu as text, or ``--text`` for a numbered menu on the terminal that runs every action. Flags
after ``--`` go to ``exo serve`` when the app starts exo."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from exo.cli.common import CommandError


def menubar_command(args: argparse.Namespace) -> int:
    from exo.menubar import MenubarController, MenubarError, build_menu, render_text

    if not args.poll_interval > 0:
        raise CommandError(f"--poll-interval must be a positive number of seconds, not {args.poll_interval}")
    try:
        controller = MenubarController(
            url=args.url,
            serve_args=args.serve_args,
            stop_timeout_s=args.stop_timeout,
            start_timeout_s=args.start_timeout,
        )
        if args.once:
            print(render_text(build_menu(controller.refresh())))
            return 0
        from exo.menubar.app import MenubarApp
        from exo.menubar.text import TextBackend
        from exo.menubar.tray import PystrayBackend

        backend = TextBackend() if args.text else PystrayBackend()
    except MenubarError as e:
        raise CommandError(str(e)) from None
    echo = None if backend.has_menu else _echo
    if echo is not None:
        print(
            f"exo menubar: pystray's {backend.name} backend has no menus: a click on the icon opens the "
            "dashboard; the menu is printed here when it changes (`exo menubar --text` runs every entry)",
            file=sys.stderr,
        )
    app = MenubarApp(
        controller, backend, poll_interval_s=args.poll_interval, echo=echo, start_daemon=args.start
    )
    if sys.platform != "darwin":
        # Quit cleanly (stopping a daemon the app started) on Ctrl-C, kill and logout. Not on macOS: there
        # the main thread sits in AppKit's loop, where Python handlers never run; the default action ends
        # the app and the tethered daemon stops itself.
        def on_signal(signum: int, frame: object) -> None:
            threading.Thread(target=app.quit, name="exo-menubar-signal", daemon=True).start()

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, on_signal)
    app.run()
    return 0


def _echo(text: str) -> None:
    print(text + "\n", flush=True)
