"""``exo pull``: download a model into the Hugging Face cache (progress bar), check it, recover its head."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

from exo.cli.common import print_json


class TerminalProgress:
    """A tqdm bar on stderr fed by a download's progress snapshots (off when stderr is not a terminal)."""

    def __init__(self, description: str) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1000, desc=description,
                         disable=None, file=sys.stderr, dynamic_ncols=True)
        self._lock = threading.Lock()
        self._shown = 0.0

    def __call__(self, progress: Any) -> None:
        now = time.monotonic()
        final = progress.status in ("complete", "failed", "cancelled")
        with self._lock:
            if not final and now - self._shown < 0.1:
                return
            self._shown = now
            self._bar.total = progress.bytes_total
            self._bar.n = progress.bytes_done
            self._bar.set_postfix_str(
                f"{progress.files_done}/{progress.files_total} files, {progress.status}", refresh=False
            )
            self._bar.refresh()

    def close(self) -> None:
        with self._lock:
            self._bar.close()


def pull_command(args: argparse.Namespace) -> int:
    from exo.downloads import (
        HubConfig,
        InProcessSteps,
        ProgressTracker,
        PullOptions,
        prepare,
        pull,
        pull_target,
    )
    from exo.settings import load_settings

    settings = load_settings()
    hub = HubConfig.from_env(offline=settings.offline)
    target = pull_target(args.model)
    options = PullOptions(revision=args.revision, recover_head=not args.no_head, quantize_head=args.quantize_head)
    bar = None if args.json else TerminalProgress(target.model_id)
    tracker = ProgressTracker(listener=bar)
    try:
        tracker.set_status("planning")
        plan = prepare(target, hub, options, tracker)
        if plan is not None and not args.json:
            cached = len(plan.files) - len(plan.to_fetch)
            where = "offline, from the cache" if plan.offline else hub.endpoint
            print(f"{target.model_id}: {len(plan.to_fetch)} file(s) to download from {where}"
                  f"{f', {cached} already in the cache' if cached else ''}", file=sys.stderr)
        result = pull(target, plan, hub, tracker, InProcessSteps(), options)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print_json(result.to_json())
    else:
        print("\n".join(result.summary_lines()))
    return 0
