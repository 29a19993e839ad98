"""The menu as plain data, built from a ``Snapshot``: what each line says, whether it is enabled or
checked, and which ``Action`` a click runs. No UI toolkit here: the status-item backend draws it."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from .state import DaemonState, ModelStage, RunningModel, Snapshot


class Action(enum.StrEnum):
    TOGGLE_NATIVE_MTP = "toggle_native_mtp"
    START = "start"
    STOP = "stop"
    OPEN_DASHBOARD = "open_dashboard"
    COPY_API_URL = "copy_api_url"
    OPEN_LOG = "open_log"
    QUIT = "quit"


@dataclasses.dataclass(frozen=True)
class MenuEntry:
    text: str
    action: Action | None = None  # None: an information line (drawn disabled)
    enabled: bool = True
    checked: bool | None = None  # None: not a check item
    default: bool = False  # the action a plain click on the icon runs, where the backend has no menu
    separator: bool = False
    live: bool = False  # a figure that moves all the time (free memory, seconds): not worth a reprint


def stable_view(entries: Sequence[MenuEntry]) -> tuple:
    """The menu apart from its live figures: printing it again is worth it when this changes."""
    return tuple(dataclasses.replace(e, text="") if e.live else e for e in entries)


SEPARATOR = MenuEntry("", enabled=False, separator=True)
NATIVE_MTP = "Native MTP"
START, STOP = "Start exo", "Stop exo"
OPEN_DASHBOARD, COPY_API_URL, OPEN_LOG, QUIT = "Open Dashboard", "Copy API URL", "Open exo Log", "Quit"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f}"


def _info(text: str, live: bool = False) -> MenuEntry:
    return MenuEntry(text, enabled=False, live=live)


def title(snapshot: Snapshot) -> str:
    """One line for the icon's tooltip: the state, and the cluster's size while running."""
    text = f"exo: {snapshot.state}"
    if snapshot.cluster is not None:
        c = snapshot.cluster
        text += f", {c.node_count} node{'s' if c.node_count != 1 else ''}, {len(c.models)} model(s)"
    return text


def model_lines(model: RunningModel) -> list[str]:
    """``exo-demo: ready on studio (layers 0-8)``; a pipeline gets one indented line per stage."""

    def where(s: ModelStage) -> str:
        progress = f" {s.progress:.0%}" if s.state in ("loading", "downloading") else ""
        doing = f", {s.stage}" if s.stage and s.stage != s.state else ""
        return f"{s.state}{progress}{doing} on {s.node_name} (layers {s.start_layer}-{s.end_layer})"

    if len(model.stages) == 1 and model.stages[0].world_size == 1:
        return [f"{model.model}: {where(model.stages[0])}"]
    lines = [f"{model.model}:"]
    for s in model.stages:
        lines.append(f"    stage {s.rank + 1}/{s.world_size}: {where(s)}")
    return lines


def build_menu(snapshot: Snapshot) -> list[MenuEntry]:
    entries: list[MenuEntry] = []
    state_line = f"exo: {snapshot.state}"
    if snapshot.started_here and snapshot.state is not DaemonState.STOPPED:
        state_line += " (started here)"
    entries.append(_info(state_line))
    if snapshot.detail:
        entries.append(_info(f"    {snapshot.detail}", live=snapshot.state is DaemonState.STARTING))
    if snapshot.error:
        entries.append(_info(f"⚠ {snapshot.error}"))
    if snapshot.cluster is not None:
        c = snapshot.cluster
        nodes = f"{c.node_count} node{'s' if c.node_count != 1 else ''}"
        free = f"{_gib(c.memory_available_bytes)} of {_gib(c.memory_total_bytes)} GiB free"
        entries.append(_info(f"{nodes} · {free}", live=True))
        if not c.models:
            entries.append(_info("No models running"))
        for model in c.models:
            entries.extend(_info(line) for line in model_lines(model))
    entries.append(SEPARATOR)

    mtp = snapshot.native_mtp
    entries.append(
        MenuEntry(NATIVE_MTP, Action.TOGGLE_NATIVE_MTP, enabled=mtp.can_change, checked=mtp.enabled)
    )
    why_not = mtp.locked_reason or mtp.unavailable_reason
    if why_not:
        entries.append(_info(f"    {'locked: ' if mtp.locked_reason else ''}{why_not}"))
    entries.append(SEPARATOR)

    if snapshot.started_here or snapshot.state is DaemonState.STOPPING:
        entries.append(MenuEntry(STOP, Action.STOP, enabled=snapshot.can_stop))
    else:
        entries.append(MenuEntry(START, Action.START, enabled=snapshot.can_start))
    running = snapshot.state is DaemonState.RUNNING
    entries.append(MenuEntry(OPEN_DASHBOARD, Action.OPEN_DASHBOARD, enabled=running, default=True))
    entries.append(MenuEntry(COPY_API_URL, Action.COPY_API_URL))
    entries.append(MenuEntry(OPEN_LOG, Action.OPEN_LOG, enabled=snapshot.log_path.exists()))
    entries.append(SEPARATOR)
    entries.append(MenuEntry("Quit (stops exo)" if snapshot.started_here else QUIT, Action.QUIT))
    return entries


def actionable(entries: Sequence[MenuEntry]) -> list[MenuEntry]:
    """The entries with an action, in order: number N of ``render_text(numbered=True)`` is the N-th."""
    return [e for e in entries if e.action is not None]


def render_text(entries: Sequence[MenuEntry], numbered: bool = False) -> str:
    """The menu as text (``exo menubar --once``, the log of a backend without menus, ``--text`` numbered)."""
    lines = []
    number = 0
    for e in entries:
        if e.separator:
            lines.append("-" * 40)
            continue
        mark = "" if e.checked is None else ("[x] " if e.checked else "[ ] ")
        suffix = "" if e.enabled or e.action is None else "  (disabled)"
        prefix = ""
        if numbered and e.action is not None:
            number += 1
            prefix = f"{number:2d}. "
        lines.append(f"{prefix}{mark}{e.text}{suffix}")
    return "\n".join(lines)
