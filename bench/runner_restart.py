"""A runner killed while a batch decodes, through ``exo serve``: how long until the model serves again.

    python bench/runner_restart.py [MODEL] [--kills 3] [--members 4] [--max-tokens 256]

Issue 51 asks that a runner killed mid-batch fails every member cleanly and that the model serves again within
15 s (``tests/cluster/test_runner_faults.py`` asserts both on the CPU with exo-demo). On a GPU a runner's start is
a process's: import, load (exo's CUDA kernels read from the machine's folder, MLX's PTX cache), the engine's
warm-up. This starts one daemon on MODEL, and per kill: ``--members`` streamed completions decoding together, the
runner SIGKILLed (its pid from ``/v1/instances``), then how each stream ended (an error event after its tokens,
or a status before any: never a 500 or a hang), and the seconds from the kill until a one-token completion
answers 200 (the target: 15 s), printed per kill, then their median and worst.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx
from agent_session import Server  # bench/ is this script's folder
from common import SRC, stop_on_signals

sys.path.insert(0, str(SRC))

from exo.engine import resolve_model  # noqa: E402

SERVES_AGAIN_S = 15.0


def stream(url: str, model: str, max_tokens: int, out: dict) -> None:
    """One streamed completion; ``out``: its status, tokens, and how it ended."""
    body = {"model": model, "messages": [{"role": "user", "content": "Count slowly from one to a thousand."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    out.update(status=None, tokens=0, ended="open")
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
            out["status"] = response.status_code
            if response.status_code != 200:
                response.read()
                out["ended"] = f"status {response.status_code}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["ended"] = f"error event {event['error'].get('code')}"
                    return
                out["tokens"] += sum(1 for c in event.get("choices") or [] if (c.get("delta") or {}).get("content"))
            out["ended"] = "done"
    except httpx.HTTPError as e:
        out["ended"] = f"transport {type(e).__name__}"


def instance(url: str) -> dict | None:
    try:
        instances = httpx.get(url + "/v1/instances", timeout=5).json()["instances"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return next((i for i in instances if i.get("state") == "ready" and i.get("pid")), None)


def serves(url: str, model: str) -> bool:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    try:
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    stop_on_signals()
    model_dir = Path(resolve_model(args.model).path)
    with tempfile.TemporaryDirectory(prefix="exo-runner-restart-") as root:
        server = Server(model_dir, Path(root) / "home", cache=False)
        server.start()
        again: list[float] = []
        try:
            for kill in range(args.kills):
                deadline = time.monotonic() + 120
                while (ready := instance(server.url)) is None and time.monotonic() < deadline:
                    time.sleep(0.2)
                if ready is None:
                    raise RuntimeError(f"no ready instance: {server.log_tail(20)}")
                outs = [{} for _ in range(args.members)]
                threads = [threading.Thread(target=stream, args=(server.url, server.model_id, args.max_tokens, o))
                           for o in outs]
                for t in threads:
                    t.start()
                deadline = time.monotonic() + 120
                while not all(o.get("tokens", 0) >= 2 for o in outs) and time.monotonic() < deadline:
                    time.sleep(0.05)
                os.kill(int(ready["pid"]), signal.SIGKILL)
                killed = time.monotonic()
                for t in threads:
                    t.join(60)
                while not serves(server.url, server.model_id):
                    if time.monotonic() - killed > 300:
                        raise RuntimeError(f"not serving 300 s after the kill: {server.log_tail(20)}")
                    time.sleep(0.2)
                seconds = time.monotonic() - killed
                again.append(seconds)
                endings = ", ".join(f"{o.get('tokens', 0)} tokens then {o.get('ended')}" for o in outs)
                print(f"kill {kill + 1}: serves again {seconds:.1f} s after it (target {SERVES_AGAIN_S:.0f} s); "
                      f"the members: {endings}", flush=True)
        finally:
            server.stop()
    print(f"{args.model}: serves again after a kill, median {statistics.median(again):.1f} s, worst {max(again):.1f} s "
          f"over {len(again)} kills (target {SERVES_AGAIN_S:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
