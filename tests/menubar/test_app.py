"""The thin menu layer over a fake status item (the UI toolkit is the outer edge), with the real controller
and, where it matters, a real ``exo serve``: what the menu shows, and what each click does."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest
from cluster.daemons import wait_for

from exo.menubar import Action, DaemonState, MenubarError, MenuEntry
from exo.menubar.app import MenubarApp
from exo.menubar.menu import model_lines
from exo.menubar.state import cluster_summary

from .apps import get_json, pid_gone


class FakeStatusItem:
    """Records what the app draws; clicks like a user would (only enabled entries with an action)."""

    def __init__(self, has_menu: bool = True) -> None:
        self.has_menu = has_menu
        self.updates: list[tuple[str, DaemonState, list[MenuEntry]]] = []
        self.stopped = threading.Event()
        self._on_click: Callable[[Action], Future[None]] | None = None

    def run(self, on_ready: Callable[[], None]) -> None:
        on_ready()
        assert self.stopped.wait(120), "the app never stopped its status item"

    def update(self, title: str, state: DaemonState, entries: Sequence[MenuEntry], on_click) -> None:
        self.updates.append((title, state, list(entries)))
        self._on_click = on_click

    def stop(self) -> None:
        self.stopped.set()

    @property
    def entries(self) -> list[MenuEntry]:
        return self.updates[-1][2]

    def texts(self) -> list[str]:
        return [e.text for e in self.entries if not e.separator]

    def entry(self, text: str) -> MenuEntry:
        [found] = [e for e in self.entries if e.text == text]
        return found

    def click(self, text: str) -> None:
        entry = self.entry(text)
        assert entry.enabled and entry.action is not None, f"{text!r} cannot be clicked: {entry}"
        self._on_click(entry.action).result(timeout=60)

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout: float = 60) -> None:
        wait_for(lambda: self.updates and predicate(), timeout, what, interval=0.05)


@pytest.fixture
def running_app(make_controller):
    """``start(**controller_kwargs) -> (app, status_item, outer edges)``; the app runs in a thread."""
    started: list[tuple[MenubarApp, threading.Thread]] = []

    def start(**kwargs):
        edges: dict[str, list] = {"opened": [], "copied": [], "files": []}

        def copy_text(text: str) -> None:  # the first copy fails, as without a clipboard tool
            edges["copied"].append(text)
            if len(edges["copied"]) == 1:
                raise MenubarError("cannot copy to the clipboard (no xclip)")

        app = MenubarApp(
            make_controller(**kwargs),
            FakeStatusItem(),
            poll_interval_s=0.2,
            open_url=edges["opened"].append,
            copy_text=copy_text,
            open_path=edges["files"].append,
        )
        thread = threading.Thread(target=app.run, daemon=True)
        thread.start()
        started.append((app, thread))
        app.backend.wait_until(lambda: True, "the first menu")
        return app, app.backend, edges

    yield start
    for app, thread in started:
        app.backend.stop()
        thread.join(30)


def test_menu_follows_the_daemon_and_clicks_act(running_app):
    app, item, edges = running_app()
    assert item.texts()[0] == "exo: stopped" and item.updates[-1][1] is DaemonState.STOPPED
    assert not item.entry("Open Dashboard").enabled and item.entry("Native MTP").checked is True

    assert not item.entry("Open exo Log").enabled  # nothing started yet, no log
    item.click("Copy API URL")  # a failing action: an error line, no crash
    assert "⚠ cannot copy to the clipboard (no xclip)" in item.texts()

    item.click("Start exo")
    item.wait_until(lambda: item.texts()[0] == "exo: running (started here)", "running")
    assert not any(t.startswith("⚠") for t in item.texts())  # a successful action clears the error
    assert item.updates[-1][0] == "exo: running, 1 node, 0 model(s)"
    assert "No models running" in item.texts() and any(" GiB free" in t for t in item.texts())
    assert [t for t in item.texts() if t in ("Start exo", "Stop exo")] == ["Stop exo"]
    assert "Quit (stops exo)" in item.texts()

    url = app.controller.api_url
    item.click("Native MTP")
    assert get_json(url + "/v1/settings")["native_mtp_enabled"] is False
    assert item.entry("Native MTP").checked is False
    item.click("Native MTP")
    assert get_json(url + "/v1/settings")["native_mtp_enabled"] is True

    item.click("Open Dashboard")
    item.click("Copy API URL")
    item.click("Open exo Log")
    assert edges == {
        "opened": [url + "/"],
        "copied": [url + "/v1", url + "/v1"],
        "files": [app.controller.log_path],
    }

    pid = app.controller.daemon_pid
    item.click("Quit (stops exo)")
    assert item.stopped.is_set() and pid_gone(pid)


def test_env_forced_toggle_is_disabled_with_its_reason(running_app):
    app, item, _ = running_app(env={"EXO_NATIVE_MTP_ENABLED": "0"})
    toggle = item.entry("Native MTP")
    assert toggle.checked is False and not toggle.enabled
    reason = item.texts()[item.texts().index("Native MTP") + 1]
    assert reason == "    locked: EXO_NATIVE_MTP_ENABLED=0 is set in this app's environment"
    with pytest.raises(AssertionError, match="cannot be clicked"):
        item.click("Native MTP")


def test_a_backend_without_menus_gets_the_menu_printed_when_it_changes(make_controller):
    printed: list[str] = []
    item = FakeStatusItem(has_menu=False)
    app = MenubarApp(make_controller(), item, echo=printed.append)
    app.refresh()
    app.refresh()
    assert len(printed) == 1 and printed[0].startswith("exo: stopped\n") and "[x] Native MTP" in printed[0]
    [default] = [e for e in item.entries if e.default]
    assert default.action is Action.OPEN_DASHBOARD  # what a click on the icon does there


def test_a_pipeline_model_lists_its_stages():
    view = {
        "nodes": [
            {"id": "a1", "name": "studio", "memory_total_bytes": 2 << 30, "memory_available_bytes": 1 << 30},
            {"id": "b2", "name": "mini", "memory_total_bytes": 2 << 30, "memory_available_bytes": 1 << 30},
        ],
        "instances": [
            {
                "id": "i2",
                "model": "big",
                "node": "b2",
                "state": "loading",
                "stage": "loading weights",
                "progress": 0.4,
                "shard": {"start_layer": 24, "end_layer": 48, "rank": 1, "world_size": 2},
            },
            {
                "id": "i1",
                "model": "big",
                "node": "a1",
                "state": "ready",
                "stage": "ready",
                "progress": 1.0,
                "shard": {"start_layer": 0, "end_layer": 24, "rank": 0, "world_size": 2},
            },
        ],
    }
    summary = cluster_summary(view)
    assert (summary.node_count, summary.memory_total_bytes, summary.memory_available_bytes) == (
        2,
        4 << 30,
        2 << 30,
    )
    assert model_lines(summary.models[0]) == [
        "big:",
        "    stage 1/2: ready on studio (layers 0-24)",
        "    stage 2/2: loading 40%, loading weights on mini (layers 24-48)",
    ]


def test_a_model_whose_weights_download_shows_how_far_the_download_is():
    view = {
        "nodes": [{"id": "a1", "name": "studio", "memory_total_bytes": 2 << 30, "memory_available_bytes": 1 << 30}],
        "instances": [
            {
                "id": "i1",
                "model": "qwen",
                "node": "a1",
                "state": "downloading",
                "stage": "downloading",
                "progress": 0.0,
                "download": {"id": "d1", "status": "downloading", "bytes_done": 1 << 30, "bytes_total": 4 << 30},
                "shard": {"start_layer": 0, "end_layer": 32, "rank": 0, "world_size": 1},
            }
        ],
    }
    assert model_lines(cluster_summary(view).models[0]) == ["qwen: downloading 25% on studio (layers 0-32)"]


def test_quit_without_a_daemon_stops_the_ui(running_app):
    app, item, _ = running_app()
    started = time.monotonic()
    item.click("Quit")
    assert item.stopped.is_set() and time.monotonic() - started < 5
    assert app.controller.daemon_pid is None


def test_open_path_reports_a_missing_opener(tmp_path: Path, monkeypatch):
    from exo.menubar.app import open_path

    monkeypatch.setenv("PATH", str(tmp_path))  # no xdg-open / open anywhere
    with pytest.raises(MenubarError, match="cannot open"):
        open_path(tmp_path / "exo-serve.log")


def test_exo_menubar_once_prints_the_menu_and_bad_flags_are_user_errors(capsys, tmp_path):
    from cluster.daemons import free_port

    from exo.cli.main import main

    url = f"http://127.0.0.1:{free_port()}"
    assert main(["menubar", "--once", "--url", url]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "exo: stopped" and "[x] Native MTP" in out and "Start exo" in out
    assert main(["menubar", "--once", "--url", "localhost"]) == 1
    assert "the daemon URL must look like http://host:port" in capsys.readouterr().err
    assert main(["menubar", "--once", "--stop-timeout", "-1"]) == 1
    assert "stop_timeout_s must be a positive" in capsys.readouterr().err
