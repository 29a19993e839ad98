"""Serving overhead: tokens/s through `exo serve` (HTTP streaming) vs the engine alone, and concurrency.

Starts `exo serve --model MODEL` as its own process (as users run it: the daemon runs the model in a
runner subprocess and relays generations from it over gRPC), then, in this process:
  1. engine alone: `Engine.generate` on the same model, prompt and settings, streamed chunk by chunk;
  2. HTTP: a streamed POST /v1/completions (SSE) of the same request; with --via-peer, sent to a second
     daemon that relays it over gRPC to the first (a model placed on another node of the cluster);
runs alternate (engine, HTTP, engine, ...) so drift on a shared CPU hits both sides alike. Tokens/s is
completion tokens / wall time from the call (request sent) to the last token (last event), prefill
included on both sides. Then aggregate throughput with 1, 4 and 8 concurrent streams (the device runs
one generation at a time, so the aggregate should stay flat while queueing shows in the TTFT).

    python bench/api_overhead.py MODEL [--prompt P] [--max-tokens N] [--repeats R] [--mtp off,2] [--via-peer]

MODEL: a card id (default exo-demo), repo id or checkpoint directory. --mtp: comma-separated modes per
request: "off" (plain decoding), a depth K (forced), "auto" (adaptive: its depth choice follows timings,
so both sides may decode differently; use a fixed mode to compare like with like).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from exo.engine import GenerationRequest, load
from exo.runner.group import free_port
from exo.settings import load_settings

SRC = Path(__file__).resolve().parents[1] / "src"


_free_port = free_port  # never the same port twice in this process (two calls in a row could be)


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _mode(mtp: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine request fields, API native_mtp field) for one mode."""
    if mtp == "off":
        return {"native_mtp": "off"}, {"enabled": False}
    if mtp == "auto":
        return {}, {}
    return {"mtp_k": int(mtp)}, {"k": int(mtp)}


def engine_run(engine: Any, prompt: str, max_tokens: int, fields: dict[str, Any]) -> tuple[int, float]:
    start = time.perf_counter()
    ids = engine.loaded.tokenizer.encode(prompt)
    tokens = 0
    for chunk in engine.generate(GenerationRequest(ids, max_tokens=max_tokens, **fields)):
        tokens += len(chunk.token_ids)
    return tokens, time.perf_counter() - start


async def http_run(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, native_mtp: dict[str, Any]
) -> tuple[int, float, float]:
    """(completion tokens, seconds to the last token, seconds to the first text)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "native_mtp": native_mtp,
    }
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event["choices"]:
                now = time.perf_counter()
                first = first or now
                if event["choices"][0]["finish_reason"] is not None:
                    last = now
            elif event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    assert first is not None and last is not None
    return tokens, last - start, first - start


async def concurrent(url: str, prompt: str, max_tokens: int, native_mtp: dict[str, Any], n: int) -> dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(http_run(session, url, prompt, max_tokens, native_mtp) for _ in range(n)))
        wall = time.perf_counter() - start
    tokens = sum(r[0] for r in results)
    return {
        "streams": n,
        "tokens": tokens,
        "aggregate_tok_s": tokens / wall,
        "mean_ttft_s": statistics.mean(r[2] for r in results),
        "max_ttft_s": max(r[2] for r in results),
    }


def _tree_cpu_seconds(pid: int) -> float | None:
    """CPU time of a process and its children (exo serve runs each model in a runner subprocess)."""
    total = _cpu_seconds(pid)
    if total is None:
        return None
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        total += _tree_cpu_seconds(int(child)) or 0.0
    return total


def start_server(
    model: str | None, port: int, grpc_port: int, peers: str | None = None, home: str | None = None
) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env.pop("EXO_API_KEY", None)
    if home is not None:
        env["EXO_HOME"] = home
    argv = [sys.executable, "-m", "exo.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--grpc-port", str(grpc_port), "--no-discovery"]
    argv += ["--model", model] if model is not None else []
    argv += ["--peers", peers] if peers is not None else []
    process = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    async def wait() -> None:
        async with aiohttp.ClientSession() as session:
            for _ in range(600):
                if process.poll() is not None:
                    raise RuntimeError(f"exo serve exited: {process.stderr.read() if process.stderr else ''}")
                try:
                    async with session.get(f"http://127.0.0.1:{port}/health") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError("exo serve did not come up")

    asyncio.run(wait())
    return process


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} (min {min(values):.1f}, max {max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--prompt", default="0 0 0", help="raw completion prompt (default: one the test fixtures "
                        "continue without EOS)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mtp", default="off,1", help="comma-separated: off, auto, or a depth K")
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument(
        "--via-peer",
        action="store_true",
        help="send the requests to a second daemon (a static peer) that relays them over gRPC to the node "
        "running the model, as a cluster serves a model placed on another node",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    port, grpc_port = _free_port(), _free_port()
    url = f"http://127.0.0.1:{port}"
    engine = load(args.model, load_settings())
    server = start_server(args.model, port, grpc_port)
    front = None
    if args.via_peer:
        import tempfile

        front_port = _free_port()
        front = start_server(None, front_port, _free_port(), peers=f"127.0.0.1:{grpc_port}", home=tempfile.mkdtemp())
        url = f"http://127.0.0.1:{front_port}"
        time.sleep(4.0)  # a few registry polls: the front node learns the peer and its instance
    report: dict[str, Any] = {"model": args.model, "prompt": args.prompt, "max_tokens": args.max_tokens,
                              "via_peer": args.via_peer, "modes": {}}
    try:
        for mtp in args.mtp.split(","):
            fields, native = _mode(mtp)

            async def http_once(native: dict[str, Any] = native) -> tuple[int, float, float]:
                async with aiohttp.ClientSession() as session:
                    return await http_run(session, url, args.prompt, args.max_tokens, native)

            engine_run(engine, args.prompt, args.max_tokens, fields)  # warm both sides
            asyncio.run(http_once())
            engine_tps, http_tps, ratios = [], [], []
            engine_cpu = server_cpu = 0.0
            for _ in range(args.repeats):
                cpu0 = time.process_time()
                e_tokens, e_s = engine_run(engine, args.prompt, args.max_tokens, fields)
                engine_cpu += time.process_time() - cpu0
                cpu0 = _tree_cpu_seconds(server.pid)
                h_tokens, h_s, _ = asyncio.run(http_once())
                cpu1 = _tree_cpu_seconds(server.pid)
                server_cpu += (cpu1 - cpu0) if cpu0 is not None and cpu1 is not None else float("nan")
                assert e_tokens == h_tokens, (e_tokens, h_tokens)
                engine_tps.append(e_tokens / e_s)
                http_tps.append(h_tokens / h_s)
                ratios.append(http_tps[-1] / engine_tps[-1])
            conc = [
                asyncio.run(concurrent(url, args.prompt, args.max_tokens, native, int(n)))
                for n in args.concurrency.split(",")
            ]
            report["modes"][mtp] = {
                "tokens": e_tokens,
                "engine_tok_s": engine_tps,
                "http_tok_s": http_tps,
                "http_over_engine": ratios,
                "overhead_pct_median": round((1 - statistics.median(ratios)) * 100, 2),
                # CPU time per 1000 tokens: less sensitive than wall time to other work on a shared CPU.
                "engine_cpu_s_per_1k_tokens": engine_cpu / (e_tokens * args.repeats) * 1000,
                "server_cpu_s_per_1k_tokens": server_cpu / (e_tokens * args.repeats) * 1000,
                "concurrency": conc,
            }
    finally:
        for process in (front, server):
            if process is not None:
                process.terminate()
                process.wait(30)

    if args.json:
        print(json.dumps(report, indent=2))
        return
    path = "through a peer daemon (gRPC relay)" if args.via_peer else "to the daemon running the model"
    print(f"model {args.model}, prompt {args.prompt!r}, max_tokens {args.max_tokens}, {args.repeats} alternating runs, "
          f"HTTP {path}")
    for mtp, r in report["modes"].items():
        print(f"\nnative MTP {mtp}: {r['tokens']} tokens per request")
        print(f"  engine alone     tok/s {spread(r['engine_tok_s'])}")
        print(f"  HTTP streaming   tok/s {spread(r['http_tok_s'])}")
        ratios = r["http_over_engine"]
        print(
            f"  HTTP / engine    {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) "
            f"-> overhead {r['overhead_pct_median']:.1f}% (median)"
        )
        e_cpu, s_cpu = r["engine_cpu_s_per_1k_tokens"], r["server_cpu_s_per_1k_tokens"]
        print(
            f"  CPU s per 1000 tokens: engine {e_cpu:.2f}, exo serve process {s_cpu:.2f} "
            f"({(s_cpu / e_cpu - 1) * 100:+.1f}%)"
        )
        base = r["concurrency"][0]["aggregate_tok_s"]
        for c in r["concurrency"]:
            print(
                f"  {c['streams']} concurrent streams: aggregate {c['aggregate_tok_s']:7.1f} tok/s "
                f"(x{c['aggregate_tok_s'] / base:.2f} of 1 stream), TTFT mean {c['mean_ttft_s'] * 1000:.0f} ms, "
                f"max {c['max_ttft_s'] * 1000:.0f} ms"
            )


if __name__ == "__main__":
    main()
