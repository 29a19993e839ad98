"""The menu-bar app's controller against real ``exo serve`` daemons: states, the Native MTP toggle,
start and stop, a hung daemon, a daemon that dies, and an app that dies."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest
from cluster.daemons import Daemon, free_port, wait_for

from exo.menubar import (
    Action,
    DaemonAlreadyRunningError,
    DaemonBusyError,
    DaemonState,
    MenubarController,
    MenubarError,
    NativeMTPLockedError,
    NotStartedHereError,
    StopOutcome,
    build_menu,
)
from exo.menubar.process import LOG_ROTATE_BYTES, DaemonProcess

from .apps import app_env, get_json, pid_gone, serve_flags, wait_state


def test_nothing_listening_is_stopped(make_controller, tmp_path):
    controller = make_controller()
    snapshot = controller.refresh()
    assert snapshot.state is DaemonState.STOPPED and snapshot.detail is None
    assert snapshot.cluster is None and snapshot.can_start and not snapshot.can_stop
    assert (
        snapshot.native_mtp.enabled
        and snapshot.native_mtp.can_change
        and snapshot.native_mtp.source == "default"
    )
    assert snapshot.dashboard_url == controller.api_url + "/"
    with pytest.raises(NotStartedHereError, match="not started by this app"):
        controller.stop_daemon()


def test_start_exo_only_for_this_machine(make_controller):
    remote = make_controller(url="http://192.0.2.1:52415", request_timeout_s=0.3)  # TEST-NET: nobody
    snapshot = remote.refresh()
    assert snapshot.state in (DaemonState.STOPPED, DaemonState.UNREACHABLE) and not snapshot.can_start
    with pytest.raises(MenubarError, match="Start exo starts exo on this machine; http://192.0.2.1:52415 is"):
        remote.start_daemon()
    assert remote.daemon_pid is None


def test_bad_configuration_is_a_typed_error(make_controller, tmp_path):
    with pytest.raises(MenubarError, match="must look like http://host:port"):
        make_controller(url="localhost:52415")
    with pytest.raises(MenubarError, match="stop_timeout_s must be a positive"):
        make_controller(stop_timeout_s=0)
    from exo.settings import SettingsError

    with pytest.raises(SettingsError, match="EXO_NATIVE_MTP_ENABLED"):
        make_controller(env={"EXO_NATIVE_MTP_ENABLED": "maybe"})


def test_lifecycle_toggle_models_and_graceful_stop(make_controller, tmp_path):
    home = tmp_path / "app-home"
    controller = make_controller(home=home)

    # Stopped: the flip goes to the node's settings file, and the next start passes it on.
    assert controller.set_native_mtp(False).native_mtp.enabled is False
    assert json.loads((home / "settings.json").read_text()) == {"native_mtp_enabled": False}
    assert controller.refresh().native_mtp.source == "file"

    controller.start_daemon()
    with pytest.raises(DaemonAlreadyRunningError):
        controller.start_daemon()
    snapshot, seen = wait_state(controller, DaemonState.RUNNING)
    assert seen[0] is DaemonState.STARTING and seen[-1] is DaemonState.RUNNING, seen
    assert snapshot.started_here and snapshot.can_stop
    view = get_json(controller.api_url + "/v1/settings")
    assert view["native_mtp_enabled"] is False and view["sources"]["native_mtp_enabled"] == "app"
    # The app passed its own saved choice as a start-up default (EXO_NATIVE_MTP_ENABLED_FROM_APP=1): no
    # override, so no lock, here or in the dashboard.
    assert view["env_overrides"] == {}
    assert snapshot.native_mtp.enabled is False and snapshot.native_mtp.can_change

    # Running: the flip is a PUT, applied at once and persisted by the daemon.
    assert controller.set_native_mtp(True).native_mtp.enabled is True
    view = get_json(controller.api_url + "/v1/settings")
    assert view["native_mtp_enabled"] is True and view["sources"]["native_mtp_enabled"] == "api"
    assert json.loads((home / "settings.json").read_text())["native_mtp_enabled"] is True

    # Another app sees no lock either and changes it; one with the variable in its environment is locked.
    other = MenubarController(url=controller.api_url, env=app_env(home))
    assert other.refresh().native_mtp.locked_reason is None
    assert other.set_native_mtp(False).native_mtp.enabled is False
    assert get_json(controller.api_url + "/v1/settings")["native_mtp_enabled"] is False
    assert other.set_native_mtp(True).native_mtp.enabled is True
    forced = MenubarController(url=controller.api_url, env=app_env(home, EXO_NATIVE_MTP_ENABLED="0"))
    assert (
        forced.refresh().native_mtp.locked_reason
        == "EXO_NATIVE_MTP_ENABLED=0 is set in this app's environment"
    )
    with pytest.raises(NativeMTPLockedError, match="EXO_NATIVE_MTP_ENABLED=0"):
        forced.set_native_mtp(False)
    assert get_json(controller.api_url + "/v1/settings")["native_mtp_enabled"] is True
    with pytest.raises(NotStartedHereError):
        other.stop_daemon()
    assert other.shutdown() is None and controller.refresh().state is DaemonState.RUNNING

    # A model: nodes, memory and the model's stage as the daemon reports them.
    created = httpx.post(
        controller.api_url + "/v1/instances", json={"model": "exo-demo", "wait": True}, timeout=120
    )
    assert created.status_code == 201, created.text
    runner_pid = created.json()["instance"]["pid"]
    cluster = controller.refresh().cluster
    nodes = get_json(controller.api_url + "/v1/cluster")["nodes"]
    assert cluster is not None and cluster.node_count == len(nodes) == 1
    assert cluster.memory_total_bytes == nodes[0]["memory_total_bytes"] > 0
    [model] = cluster.models
    [stage] = model.stages
    assert (model.model, stage.state, stage.stage, stage.node_name) == (
        "exo-demo",
        "ready",
        "ready",
        nodes[0]["name"],
    )
    assert (stage.start_layer, stage.end_layer, stage.world_size) == (0, 8, 1)

    # Stop: SIGTERM, exo serve shuts down cleanly, its runner with it.
    daemon_pid = controller.daemon_pid
    assert controller.stop_daemon() is StopOutcome.GRACEFUL
    assert controller.last_exit_code == 0  # exo serve's own clean shutdown, not SIGTERM's default death
    assert pid_gone(daemon_pid) and wait_for(lambda: pid_gone(runner_pid), 10, "the runner to exit")
    snapshot = controller.refresh()
    assert snapshot.state is DaemonState.STOPPED and snapshot.detail is None and not snapshot.started_here
    log = controller.log_path.read_text()
    assert "started by the exo menu-bar app" in log and f"serving on {controller.api_url}" in log


def test_hung_daemon_unreachable_then_a_daemon_that_dies(make_controller):
    controller = make_controller(stop_timeout_s=1.0)
    controller.start_daemon()
    wait_state(controller, DaemonState.RUNNING)
    pid = controller.daemon_pid

    os.kill(pid, signal.SIGSTOP)  # hung: the port still accepts, nothing answers
    snapshot = controller.refresh()
    assert snapshot.state is DaemonState.UNREACHABLE and f"pid {pid}" in snapshot.detail
    assert snapshot.native_mtp.unavailable_reason == "exo does not answer"
    with pytest.raises(DaemonBusyError):
        controller.set_native_mtp(False)
    os.kill(pid, signal.SIGCONT)
    wait_state(controller, DaemonState.RUNNING, timeout=10)

    os.kill(pid, signal.SIGKILL)  # dies on its own
    snapshot, _ = wait_state(controller, DaemonState.STOPPED, timeout=10)
    assert (
        snapshot.detail.startswith("exo was killed (SIGKILL)") and str(controller.log_path) in snapshot.detail
    )
    assert not snapshot.started_here and snapshot.can_start

    controller.start_daemon()  # and starts again
    wait_state(controller, DaemonState.RUNNING)
    assert controller.refresh().detail is None
    pid = controller.daemon_pid
    os.kill(pid, signal.SIGSTOP)  # SIGTERM cannot end it now: Stop exo forces it after the timeout
    started = time.monotonic()
    assert controller.stop_daemon() is StopOutcome.FORCED
    assert 1.0 <= time.monotonic() - started < 10 and pid_gone(pid)
    snapshot = controller.refresh()
    assert snapshot.state is DaemonState.STOPPED and "was killed" in snapshot.error


def test_a_slow_model_load_is_starting_not_unreachable(make_controller):
    """exo serve --model opens its port only once the model is loaded: the whole load is the start."""
    controller = make_controller(serve_args=[*serve_flags(), "--model", "exo-demo"], start_timeout_s=1.0)
    controller.start_daemon()
    runner_line = re.compile(r"runner pid (\d+) for exo-demo")
    found = wait_for(lambda: runner_line.search(controller.log_path.read_text()), 60, "the runner", 0.05)
    runner_pid = int(found.group(1))
    os.kill(runner_pid, signal.SIGSTOP)  # a load that takes its time (a big model): nothing more is logged
    try:
        time.sleep(2 * controller.start_timeout_s + 0.5)
        snapshot = controller.refresh()
        assert snapshot.state is DaemonState.STARTING, snapshot.detail
        assert "(loading exo-demo on this node, " in snapshot.detail and snapshot.can_stop
        with pytest.raises(httpx.ConnectError):
            httpx.get(controller.api_url + "/health", timeout=5)  # still no port while it loads
    finally:
        os.kill(runner_pid, signal.SIGCONT)
    snapshot, seen = wait_state(controller, DaemonState.RUNNING)
    assert DaemonState.UNREACHABLE not in seen and [m.model for m in snapshot.cluster.models] == ["exo-demo"]


def test_daemon_that_fails_to_start_says_why(make_controller):
    controller = make_controller(serve_args=[*serve_flags(), "--namespace", "not a namespace"])
    controller.start_daemon()
    snapshot, seen = wait_state(controller, DaemonState.STOPPED, timeout=60)
    assert seen[0] is DaemonState.STARTING
    assert snapshot.detail.startswith("exo exited with status 1 while starting (exo: error: --namespace")


def test_a_daemon_started_elsewhere_is_shown_not_owned_and_its_death_noticed(make_controller, tmp_path):
    daemon = Daemon(tmp_path / "elsewhere", "elsewhere", env={"EXO_NATIVE_MTP_ENABLED": "0"}).start()
    try:
        daemon.wait_up()
        controller = make_controller(url=daemon.url)
        snapshot = controller.refresh()
        assert snapshot.state is DaemonState.RUNNING and not snapshot.started_here and not snapshot.can_stop
        assert snapshot.native_mtp.enabled is False and snapshot.native_mtp.source == "env"
        # Set by whoever started that daemon (not an app's default): it locks the toggle.
        assert get_json(daemon.url + "/v1/settings")["env_overrides"] == {
            "native_mtp_enabled": "EXO_NATIVE_MTP_ENABLED"
        }
        assert (
            snapshot.native_mtp.locked_reason == "the running exo was started with EXO_NATIVE_MTP_ENABLED set"
        )
        with pytest.raises(NativeMTPLockedError):
            controller.set_native_mtp(True)
        with pytest.raises(DaemonAlreadyRunningError, match="already running"):
            controller.start_daemon()
        with pytest.raises(NotStartedHereError):
            controller.stop_daemon()
    finally:
        daemon.stop()
    assert controller.refresh().state is DaemonState.STOPPED and controller.snapshot.can_start


APP_SCRIPT = """
import sys, time
from exo.menubar import DaemonState, MenubarController
controller = MenubarController(url=sys.argv[1], serve_args=sys.argv[2:])
controller.start_daemon()
while controller.refresh().state is not DaemonState.RUNNING:
    time.sleep(0.1)
print(controller.daemon_pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_an_app_that_is_killed_leaves_no_daemon(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    app = subprocess.Popen(
        [sys.executable, "-c", APP_SCRIPT, url, *serve_flags()],
        env=app_env(tmp_path),
        stdout=subprocess.PIPE,
        text=True,
    )
    daemon_pid = None
    try:
        daemon_pid = int(app.stdout.readline())
        assert get_json(url + "/health")["status"] == "ok"
        app.kill()
        app.wait(10)
        wait_for(lambda: pid_gone(daemon_pid), 15, "the tethered daemon to stop")
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)
        if daemon_pid is not None and not pid_gone(daemon_pid):
            os.kill(daemon_pid, signal.SIGKILL)  # the test failed: leave nothing behind
    log = (tmp_path / "logs" / "exo-serve.log").read_text()
    assert "Traceback" not in log, log


def test_stopping_a_hung_daemon_shows_stopping(make_controller):
    controller = make_controller(stop_timeout_s=3.0)
    controller.start_daemon()
    wait_state(controller, DaemonState.RUNNING)
    pid = controller.daemon_pid
    os.kill(pid, signal.SIGSTOP)  # SIGTERM cannot end it: the stop waits the whole timeout, then forces
    outcome: list[StopOutcome] = []
    stopper = threading.Thread(target=lambda: outcome.append(controller.stop_daemon()))
    stopper.start()
    snapshot, seen = wait_state(controller, DaemonState.STOPPING, timeout=5)  # refreshed from this thread
    assert f"exo (pid {pid}) got SIGTERM; SIGKILL after 3 s" == snapshot.detail
    assert snapshot.started_here and not snapshot.can_stop and not snapshot.can_start
    assert snapshot.native_mtp.unavailable_reason == "exo is stopping"
    entries = build_menu(snapshot)
    texts = [e.text for e in entries]
    [stop] = [e for e in entries if e.action is Action.STOP]
    assert stop.text == "Stop exo" and not stop.enabled and "Start exo" not in texts
    assert texts[texts.index("Native MTP") + 1] == "    exo is stopping"
    stopper.join(15)
    assert outcome == [StopOutcome.FORCED] and pid_gone(pid)
    assert controller.refresh().state is DaemonState.STOPPED


class _NotExo(http.server.BaseHTTPRequestHandler):
    status, body = 200, b"<html>a web server, not exo</html>"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(self.status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("status", [200, 404])
def test_another_http_server_on_the_port_is_unreachable(make_controller, status):
    handler = type("Handler", (_NotExo,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        controller = make_controller(url=f"http://127.0.0.1:{server.server_address[1]}")
        snapshot = controller.refresh()
    finally:
        server.shutdown()
        server.server_close()
    assert snapshot.state is DaemonState.UNREACHABLE and "is not an exo API" in snapshot.detail
    assert not snapshot.can_start and snapshot.cluster is None
    assert snapshot.native_mtp.unavailable_reason == "exo does not answer"


def test_the_log_moves_aside_past_5_mib_at_a_start(tmp_path):
    log = tmp_path / "logs" / "exo-serve.log"
    log.parent.mkdir()
    log.write_bytes(b"an old run\n" * (LOG_ROTATE_BYTES // 11 + 1))
    old_size = log.stat().st_size
    argv = [sys.executable, "-c", "print('a new run')"]
    for run in (1, 2):  # the first start rotates; the second appends to a small log
        DaemonProcess.start(argv, os.environ, log).process.wait(30)
        assert (log.parent / "exo-serve.log.1").stat().st_size == old_size
        text = log.read_text()
        assert text.startswith("--- ") and text.count("a new run\n") == run and "an old run" not in text


def test_the_api_key_goes_with_the_apps_calls(make_controller, tmp_path):
    controller = make_controller(env={"EXO_API_KEY": "menubar-secret"})  # the daemon it starts inherits it
    controller.start_daemon()
    snapshot, _ = wait_state(controller, DaemonState.RUNNING)
    assert httpx.get(controller.api_url + "/v1/settings", timeout=10).status_code == 401  # it is required
    assert snapshot.detail is None and snapshot.cluster is not None and snapshot.native_mtp.can_change
    assert controller.set_native_mtp(False).native_mtp.enabled is False
    auth = {"Authorization": "Bearer menubar-secret"}
    view = httpx.get(controller.api_url + "/v1/settings", headers=auth, timeout=10).json()
    assert view["native_mtp_enabled"] is False

    keyless = MenubarController(url=controller.api_url, env=app_env(tmp_path / "keyless"))
    snapshot = keyless.refresh()
    assert snapshot.state is DaemonState.RUNNING and snapshot.cluster is None
    assert "GET /v1/cluster answered 401" in snapshot.detail
    assert snapshot.native_mtp.unavailable_reason == "exo's settings cannot be read"
