"""What a newcomer's prefill costs the streams already running, through `exo serve`, per batch prefill chunk.

    python bench/prefill_stall.py [MODEL] [--chunks 256 2048] [--streams 4] [--long-words 220] [--clients 8]
                                  [--seconds 10] [--repeats 2]

Starts one `exo serve --model MODEL` process per ``--chunks`` value (EXO_BATCH_PREFILL_CHUNK: the tokens a
generation joining a running batch prefills at a time, the batch decoding a step between two chunks; 2048
is what a newcomer got before that setting, the solo prefill chunk) and on each in turn:

- ``--streams`` clients stream 400-token chat completions; 1.5 s in, one more sends a long prompt
  (``--long-words`` phrases, ~1650 tokens at 220) for 4 tokens. Prints the long prompt's time to first
  token and the running streams' longest gap between two streamed chunks while it prefilled (and their
  median gap overall).
- ``--clients`` clients stream 64-token completions of short chat prompts back to back for ``--seconds``:
  streamed tokens/s of all together and the median time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import tempfile
import time

import aiohttp
from api_overhead import _free_port, start_server
from batching import load, quantile, warm

OFF = {"enabled": False}


async def _stream(session: aiohttp.ClientSession, url: str, content: str, max_tokens: int,
                  arrivals: list[float] | None) -> float:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "native_mtp": OFF}
    start = time.perf_counter()
    first = None
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            first = first or now
            if arrivals is not None:
                arrivals.append(now)
    if first is None:
        raise RuntimeError("no chunk streamed")
    return first - start


async def stall(url: str, streams: int, words: int) -> tuple[float, float, float]:
    """(the long prompt's TTFT, the running streams' longest gap during its prefill, their median gap)."""
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        running = [asyncio.create_task(_stream(session, url, f"Write a short poem about topic {i}.", 400, arrivals[i]))
                   for i in range(streams)]
        await asyncio.sleep(1.5)
        text = "Summarize this text. " + " ".join(f"word{i} and more words here" for i in range(words))
        sent = time.perf_counter()
        ttft = await _stream(session, url, text, 4, None)
        await asyncio.gather(*running)
    gaps = [(a, b) for times in arrivals for a, b in zip(times, times[1:], strict=False)]
    during = [b - a for a, b in gaps if b > sent and a < sent + ttft]
    return ttft, max(during, default=float("nan")), statistics.median(b - a for a, b in gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long-words", type=int, default=220)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    servers: dict[str, tuple] = {}
    try:
        for chunk in args.chunks:
            name = f"chunk {chunk}"
            os.environ["EXO_BATCH_PREFILL_CHUNK"] = str(chunk)
            port, grpc_port = _free_port(), _free_port()
            home = tempfile.mkdtemp(prefix="exo-bench-")
            servers[name] = (start_server(args.model, port, grpc_port, home=home), f"http://127.0.0.1:{port}")
            asyncio.run(warm(servers[name][1], 64))
        rows: dict[str, list] = {name: [] for name in servers}
        for _ in range(args.repeats):
            for name, (_, url) in servers.items():  # alternating: a shared machine's drift hits both
                ttft, worst, median = asyncio.run(stall(url, args.streams, args.long_words))
                out = asyncio.run(load(url, args.clients, args.seconds, 64, OFF))
                rows[name].append((ttft, worst, median, out["tok_s"], quantile(out["ttft"], 0.5)))
        print(f"model {args.model}; {args.streams} streams + one long prompt ({args.long_words} phrases); "
              f"{args.clients} clients x 64-token completions for {args.seconds:.0f} s; {args.repeats} repeats, medians")
        print(f"{'server':>18} {'long TTFT':>9} {'worst gap':>9} {'median gap':>10} {'tok/s':>7} {'TTFT p50':>8}")
        for name, values in rows.items():
            cols = [statistics.median(v[i] for v in values) for i in range(5)]
            print(f"{name:>18} {cols[0]:8.2f}s {cols[1] * 1e3:7.0f}ms {cols[2] * 1e3:8.1f}ms {cols[3]:7.1f} {cols[4]:7.3f}s")
    finally:
        for process, _ in servers.values():
            process.send_signal(signal.SIGINT)
            process.wait(30)


if __name__ == "__main__":
    main()
