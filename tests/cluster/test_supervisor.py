"""InstanceSupervisor with real runner subprocesses on the bundled demo model.

The supervisor lives on an asyncio loop in a thread of its own for the whole module (as on the
daemon's loop), so one ready runner is shared: the tests of the shared instance run in file order
(load, generate, cancel, crash and restart, stop). Each failure scenario uses a supervisor of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from exo.cards import load_catalog
from exo.cluster.supervisor import InstanceFailedError, InstanceSupervisor, UnknownInstanceError
from exo.engine import GenerationRequest, NativeMTPStats, ResolvedModel, load, resolve_model
from exo.wire.proto_gen import node_pb2 as pb

pytestmark = pytest.mark.timeout(180)

T = TypeVar("T")
SHARED = "shared-instance"
MESSAGES = [{"role": "user", "content": "Write a function that reverses a string."}]
SRC = Path(__file__).resolve().parents[2] / "src"


class LoopThread:
    """An asyncio loop running in a thread; ``run`` executes a coroutine on it from the test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="supervisor-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 90.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def loop() -> Any:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("supervisor-home")


@pytest.fixture(scope="module")
def demo(home: Path) -> ResolvedModel:
    return resolve_model("exo-demo", load_catalog(home=home))


@pytest.fixture(scope="module")
def shared(loop: LoopThread, home: Path, demo: ResolvedModel) -> Any:
    """One supervisor and its instance of the demo model, with what was observed while it loaded."""
    changes: list[pb.Instance] = []
    sup = InstanceSupervisor(home, node_id=lambda: "node-a", on_change=changes.append)
    sup.READY_POLL_S = 0.2  # the cancel test watches `running` fall back to 0

    async def start_and_watch() -> list[pb.Instance]:
        seen = [await sup.start(SHARED, demo, model_ref="exo-demo")]
        while seen[-1].state == pb.INSTANCE_STATE_LOADING:
            await asyncio.sleep(0.1)
            seen.append(sup.get(SHARED))
        return seen

    seen = loop.run(start_and_watch())
    yield sup, seen, changes
    loop.run(sup.close())


def _wait(predicate: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def _generate(sup: InstanceSupervisor, request: pb.GenerateRequest) -> list[pb.GenerateChunk]:
    call = sup.generate(SHARED, request, timeout=120)
    return [chunk async for chunk in call if not chunk.heartbeat]


def _request(max_tokens: int, **kwargs: Any) -> pb.GenerateRequest:
    msgs = pb.Messages(messages=[pb.ChatMessage(**m) for m in MESSAGES])
    return pb.GenerateRequest(
        messages=msgs, max_tokens=max_tokens, sampling=pb.SamplingParams(temperature=0.0, top_p=1.0), **kwargs
    )


# -- the shared instance, in order ------------------------------------------------------------------------


def test_start_reports_loading_progress_then_ready(shared: Any, demo: ResolvedModel, home: Path) -> None:
    sup, seen, changes = shared
    first, ready = seen[0], seen[-1]
    assert first.state == pb.INSTANCE_STATE_LOADING and first.stage == "starting" and first.pid > 0
    assert first.model_ref == "exo-demo" and first.node_id == "node-a" and first.shard.world_size == 1
    loading = [s for s in seen if s.state == pb.INSTANCE_STATE_LOADING]
    assert any(0 < s.progress < 1 for s in loading), [(s.stage, s.progress) for s in loading]
    assert {s.stage for s in loading} - {"starting"}, "no stage reported by the runner while loading"
    progress = [s.progress for s in seen]
    assert progress == sorted(progress)
    assert ready.state == pb.INSTANCE_STATE_READY and ready.progress == 1.0 and ready.stage == "ready"
    card = demo.card
    assert card is not None
    assert ready.model == pb.ModelSummary(
        model_id="exo-demo",
        name=card.name,
        arch=card.arch,
        context_length=card.context_length,
        mtp_available=True,
        default_k=card.native_mtp.default_k,
        max_k=card.native_mtp.max_k,
        owned_by="exo",
    )
    assert not ready.HasField("failure") and ready.restarts == 0 and ready.pid == first.pid
    assert [c.state for c in changes] == [pb.INSTANCE_STATE_LOADING, pb.INSTANCE_STATE_READY]
    assert [i.instance_id for i in sup.list()] == [SHARED]
    assert sup.live_for("exo-demo").instance_id == SHARED and sup.live_for("other") is None
    assert _alive(ready.pid)


def test_generate_equals_in_process_engine(shared: Any, loop: LoopThread) -> None:
    sup = shared[0]
    max_tokens = 40
    chunks = loop.run(_generate(sup, _request(max_tokens, native_mtp="on", mtp_k=2)))
    engine = load("exo-demo")
    prompt = engine.loaded.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    expected = engine.complete(
        GenerationRequest(list(prompt), max_tokens=max_tokens, native_mtp="on", mtp_k=2)
    )

    assert chunks[0].HasField("started"), chunks[0]
    assert chunks[0].started.prompt_tokens == len(prompt) and chunks[0].started.max_tokens == max_tokens
    body = chunks[1:]
    assert not any(c.HasField("error") for c in body), body
    tokens = [t for c in body for t in c.token_ids]
    assert tokens == expected.token_ids
    assert "".join(c.text for c in body) == expected.text
    assert body[-1].finish_reason == expected.finish_reason and all(not c.finish_reason for c in body[:-1])
    stats = NativeMTPStats.model_validate_json(body[-1].native_mtp_json)
    assert stats.enabled and stats.k_fixed and stats.k == 2
    assert stats.prompt_tokens == len(prompt) and stats.completion_tokens == len(tokens)
    assert 0 < stats.accepted_tokens <= stats.drafted_tokens == 2 * stats.rounds
    assert stats.acceptance_rate == pytest.approx(stats.accepted_tokens / stats.drafted_tokens, abs=1e-3)
    # Same model, same forced depth: the same rounds and acceptances as in this process.
    same = ("k_histogram", "rounds", "drafted_tokens", "accepted_tokens", "per_position_drafted")
    assert {f: getattr(stats, f) for f in same} == {f: getattr(expected.stats, f) for f in same}


def test_cancelling_a_generate_call_stops_the_generation(shared: Any, loop: LoopThread) -> None:
    sup = shared[0]

    async def start_then_cancel() -> tuple[int, Any]:
        call = sup.generate(SHARED, _request(3500, native_mtp="off"), timeout=300)
        got = 0
        async for chunk in call:
            got += len(chunk.token_ids)
            if got >= 3:
                break
        call.cancel()
        return got, call

    assert _wait(lambda: sup.get(SHARED).running == 0, 5)
    got, call = loop.run(start_then_cancel())
    assert got >= 3
    cancelled_at = time.monotonic()
    # 3500 tokens take minutes here: `running` back to 0 within seconds means the runner stopped.
    assert _wait(lambda: sup.get(SHARED).running == 0, 5), sup.get(SHARED)
    assert time.monotonic() - cancelled_at < 5
    assert loop.run(_code(call)) == "CANCELLED"
    # The device is free: the next request starts at once.
    chunks = loop.run(_generate(sup, _request(4)))
    # A device still busy with the cancelled 3500 tokens would queue it for minutes.
    assert chunks[0].started.queue_s < 10.0 and chunks[-1].finish_reason == "length"


async def _code(call: Any) -> str:
    return (await call.code()).name


def test_sigkilled_runner_is_reported_and_restarted(shared: Any, loop: LoopThread) -> None:
    sup, _, changes = shared
    before = sup.get(SHARED)
    changes.clear()
    os.kill(before.pid, signal.SIGKILL)
    assert _wait(lambda: sup.get(SHARED).restarts == 1, 10), sup.get(SHARED)
    restarted = sup.get(SHARED)
    assert restarted.failure.exit_code == -9
    assert "SIGKILL" in restarted.failure.message and restarted.failure.at_unix > 0
    assert restarted.failure.stderr_tail and "ready" in restarted.failure.stderr_tail[-1]
    ready = loop.run(sup.wait_ready(SHARED, 90))
    assert ready.pid != before.pid and _alive(ready.pid) and not _alive(before.pid)
    assert ready.restarts == 1 and ready.failure.exit_code == -9  # the last failure stays visible
    assert [c.state for c in changes] == [pb.INSTANCE_STATE_LOADING, pb.INSTANCE_STATE_READY]
    chunks = loop.run(_generate(sup, _request(6)))
    assert chunks[0].HasField("started") and chunks[-1].finish_reason == "length"


def test_stop_removes_process_socket_and_instance(shared: Any, loop: LoopThread, home: Path) -> None:
    sup = shared[0]
    pid = sup.get(SHARED).pid
    entry_socket = sup._entries[SHARED].socket_path  # the socket is not part of the Instance message
    assert os.path.exists(entry_socket)
    if sys.platform.startswith("linux"):
        # No thread takes SIGTERM but the one that waits for it: a Python handler would run only on the main
        # thread, and a signal the kernel handed to another thread left an idle runner deaf to it.
        threads = _sigterm_blocked(pid)
        assert len(threads) > 2 and sum(not blocked for blocked in threads.values()) == 1, threads
    started = time.monotonic()
    assert loop.run(sup.stop(SHARED))
    assert time.monotonic() - started < 4.0  # it ended on SIGTERM, not on the SIGKILL after the 5 s grace
    assert not _alive(pid) and not os.path.exists(entry_socket)
    assert sup.get(SHARED) is None and sup.list() == [] and sup.live_for("exo-demo") is None
    assert not loop.run(sup.stop(SHARED))
    with pytest.raises(UnknownInstanceError):
        loop.run(sup.wait_ready(SHARED, 1))
    with pytest.raises(UnknownInstanceError):
        sup.generate(SHARED, _request(2))


def _sigterm_blocked(pid: int) -> dict[str, bool]:
    """Each thread of a process: whether it blocks SIGTERM (Linux's /proc)."""
    blocked = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        blocked[f"{task.name} {status['Name']}"] = bool(int(status["SigBlk"], 16) & (1 << (signal.SIGTERM - 1)))
    return blocked


# -- failures -----------------------------------------------------------------------------------------------


def test_exhausted_restarts_leave_the_instance_failed(
    loop: LoopThread, home: Path, demo: ResolvedModel
) -> None:
    sup = InstanceSupervisor(home, node_id=lambda: "node-a", max_restarts=0)
    inst = loop.run(sup.start("doomed", demo))
    os.kill(inst.pid, signal.SIGKILL)
    with pytest.raises(InstanceFailedError) as err:
        loop.run(sup.wait_ready("doomed", 30))
    failed = err.value.instance
    assert failed.state == pb.INSTANCE_STATE_FAILED and failed.restarts == 0
    assert failed.failure.exit_code == -9 and "SIGKILL" in failed.failure.message
    assert sup.get("doomed").state == pb.INSTANCE_STATE_FAILED  # listed until stopped
    assert sup.live_for("exo-demo") is None
    with pytest.raises(InstanceFailedError):
        sup.generate("doomed", _request(2))
    assert loop.run(sup.stop("doomed")) and sup.list() == []
    loop.run(sup.close())


def test_unresponsive_runner_is_killed(loop: LoopThread, home: Path, demo: ResolvedModel) -> None:
    node = ["node-a"]
    sup = InstanceSupervisor(home, node_id=lambda: node[0], max_restarts=0)
    sup.UNREACHABLE_S = 1.0
    inst = loop.run(sup.start("frozen", demo))
    # The runner answers Status within a second (before it imports the engine); then it freezes.
    assert _wait(lambda: sup.get("frozen").stage != "starting", 20), sup.get("frozen")
    os.kill(inst.pid, signal.SIGSTOP)
    with pytest.raises(InstanceFailedError) as err:
        loop.run(sup.wait_ready("frozen", 20))
    failure = err.value.instance.failure
    assert failure.exit_code == -9 and "stopped answering Status" in failure.message, failure
    assert not _alive(inst.pid)
    node[0] = "node-b"  # a regenerated node id shows in the next snapshot
    assert sup.get("frozen").node_id == "node-b"
    loop.run(sup.close())
    assert sup.list() == []


def _runners_of(instance_id: str) -> list[int]:
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"exo.runner" in args and instance_id.encode() in args and _alive(int(proc.name)):
            pids.append(int(proc.name))
    return pids


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="lists processes through /proc")
def test_stop_during_start_leaves_no_runner(loop: LoopThread, home: Path, demo: ResolvedModel) -> None:
    sup = InstanceSupervisor(home, node_id=lambda: "node-a")

    async def race() -> list[Any]:
        start = asyncio.ensure_future(sup.start("raced", demo))
        await asyncio.sleep(0)  # start() is inside its spawn now
        stopped = await sup.stop("raced")
        return [stopped, *(await asyncio.gather(start, return_exceptions=True))]

    stopped, started = loop.run(race())
    assert stopped is True and isinstance(started, UnknownInstanceError), started
    assert sup.get("raced") is None
    assert _wait(lambda: not _runners_of("raced"), 5), _runners_of("raced")
    loop.run(sup.close())


def test_crashing_runner_is_restarted_within_its_budget(
    loop: LoopThread, home: Path, demo: ResolvedModel
) -> None:
    # A broken installation: the runner's module cannot be imported, so every start exits with status 1.
    changes: list[pb.Instance] = []
    sup = InstanceSupervisor(
        home,
        node_id=lambda: "node-a",
        max_restarts=1,
        on_change=changes.append,
        runner_cmd=[sys.executable, "-m", "exo.no_such_runner"],
    )
    sup.RESTART_DELAY_S = 0.1
    loop.run(sup.start("crashy", demo))
    with pytest.raises(InstanceFailedError):
        loop.run(sup.wait_ready("crashy", 30))
    failed = sup.get("crashy")
    assert failed.restarts == 1 and failed.failure.exit_code == 1
    assert "No module named exo.no_such_runner" in failed.failure.message
    assert any("exo.no_such_runner" in line for line in failed.failure.stderr_tail)
    states = [c.state for c in changes]
    assert states == [pb.INSTANCE_STATE_LOADING, pb.INSTANCE_STATE_LOADING, pb.INSTANCE_STATE_FAILED]
    assert changes[1].restarts == 1 and changes[1].failure.exit_code == 1
    loop.run(sup.close())
    assert sup.list() == []


def test_malformed_checkpoint_fails_with_the_loaders_message(
    loop: LoopThread, home: Path, malformed_checkpoint: Callable[..., Path]
) -> None:
    broken = ResolvedModel(malformed_checkpoint("missing_shard"), "broken-model", None)
    sup = InstanceSupervisor(home, node_id=lambda: "node-a", max_restarts=2)
    loop.run(sup.start("broken", broken))
    with pytest.raises(InstanceFailedError) as err:
        loop.run(sup.wait_ready("broken", 60))
    failure = err.value.instance.failure
    assert err.value.instance.restarts == 0  # a failed load is not retried
    assert failure.exit_code == 3
    assert failure.message.startswith("exo runner: cannot load broken-model: CheckpointError: ")
    assert "model-00002" in failure.message or "shard" in failure.message, failure.message
    assert failure.stderr_tail[-1] == failure.message and len(failure.stderr_tail) <= 20
    assert failure.message in str(err.value)
    loop.run(sup.close())


def test_runner_dies_with_a_sigkilled_daemon(tmp_path: Path, demo: ResolvedModel) -> None:
    parent = textwrap.dedent(
        """
        import asyncio, json, sys
        from pathlib import Path
        from exo.cluster.supervisor import InstanceSupervisor
        from exo.engine import ResolvedModel

        async def main():
            sup = InstanceSupervisor(Path(sys.argv[1]), node_id=lambda: "node-b")
            inst = await sup.start("orphan", ResolvedModel(Path(sys.argv[2]), "exo-demo", None))
            print(json.dumps({"pid": inst.pid}), flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", parent, str(tmp_path), str(demo.path)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        runner = json.loads(line)["pid"]
        assert _alive(runner)
        proc.kill()
        proc.wait(10)
        assert _wait(lambda: not _alive(runner), 5), f"runner {runner} outlived its daemon"
    finally:
        proc.kill()
        proc.wait(10)
