"""A group on this machine (exo.runner.local_pipeline, what benchmarks and tests start): its members end with the
process that started them, however it ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent to reap it has ended)."""
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX process tools")
def test_a_tensor_groups_members_end_when_the_process_that_started_them_is_killed(checkpoint):
    """SIGKILL leaves its ``finally`` no chance to end the members: they end themselves (a tensor member spins in a
    collective holding the GIL, so the kernel ends it: Linux's parent-death signal). Without that they would serve
    the rest of the run (here minutes of requests) on the machine's cores."""
    path = str(checkpoint("qwen3_5", dtype="float32"))
    requests = [{"prompt": [1, 2, 3, 4], "max_tokens": 200, "ignore_eos": True}] * 200
    script = ("import json, sys\nfrom exo.runner.local_pipeline import run_local_tensor\n"
              f"run_local_tensor({path!r}, 2, json.loads(sys.argv[1]), timeout_s=600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script, json.dumps(requests)])
    members: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(members) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
            members = _children(parent.pid)
        assert len(members) == 2, "the group's two members did not start"
        time.sleep(8)  # loaded, joined and generating
        assert all(_alive(p) for p in members) and parent.poll() is None
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in members) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in members if _alive(p)]
    finally:
        parent.kill()
        for p in members:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
