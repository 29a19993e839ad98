"""Many clients at once: continuous batching vs one generation at a time, through `exo serve`.

    python bench/serving.py [MODEL] [--clients 1 8 32] [--seconds 30] [--max-tokens 64] [--mtp off,k1,adaptive]
                            [--lanes 1 2] [--repeats 3] [--json]

Starts two `exo serve --model MODEL` processes as users run them (the daemon relays to a runner
subprocess over gRPC): one with EXO_MAX_BATCH=1 (requests strictly one at a time, as before batching)
and one with batching (EXO_MAX_BATCH, default 32). For each client count N, in turn on each server
(alternating, so drift on a shared CPU hits both alike), N clients stream chat completions of
--max-tokens tokens (temperature 0, distinct prompts) back to back for --seconds. Prints per row: completed
requests, errors, TTFT p50/p99 (request sent -> first streamed text), streamed completion tokens/s of all
clients together (tokens streamed in the window / window: requests that completed in it, plus for
those still streaming at its end the share streamed before it, prorated), the ratio to one client
on the same server, and for batching the ratio to the one-at-a-time server at the same N. ``--mtp`` runs
the whole table once per native-MTP mode of the requests (``off``: ``{"enabled": false}``; ``kN``: a forced
depth, ``{"k": N}``; ``adaptive``: no field, the default), with the mean depth and acceptance the
responses report; ratios compare rows of the same mode. ``--lanes`` starts a batching server per lane count
(EXO_BATCH_LANES: ``engine.batch.BatchLanes``, a batch's plain steps split over streams that MLX's CPU
backend runs on cores of their own) instead of one with the node's default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from typing import Any

import aiohttp
from common import add_common_arguments, free_port, report_to, start_server  # bench/ is this script's folder

TOPICS = (
    "the sea", "a lighthouse", "autumn leaves", "a cat", "the moon", "a city at night", "rain", "mountains",
    "a library", "coffee", "trains", "the desert", "snow", "a garden", "the stars", "an old clock",
)


MTP_MODES: dict[str, dict[str, Any] | None] = {"off": {"enabled": False}, "adaptive": None,
                                                **{f"k{k}": {"k": k} for k in range(1, 4)}}


async def client(
    session: aiohttp.ClientSession, url: str, index: int, max_tokens: int, until: float, out: dict[str, Any],
    mtp: dict[str, Any] | None = None,
) -> None:
    n = 0
    while time.perf_counter() < until:
        topic = TOPICS[(index + n) % len(TOPICS)]
        n += 1
        body = {
            "messages": [{"role": "user", "content": f"Write a short poem about {topic}."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **({"native_mtp": mtp} if mtp is not None else {}),
        }
        start = time.perf_counter()
        first = None
        tokens = 0
        text: list[str] = []
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as response:
                if response.status != 200:
                    out["errors"] += 1
                    await asyncio.sleep(0.05)
                    continue
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(event["error"]["message"])
                    if event.get("choices"):
                        first = first or time.perf_counter()
                        text.append(event["choices"][0]["delta"].get("content") or "")
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                        stats = event["usage"].get("native_mtp") or {}
                        out["drafted"] += stats.get("drafted_tokens") or 0
                        out["accepted"] += stats.get("accepted_tokens") or 0
                        out["rounds"] += stats.get("rounds") or 0
                        batch = stats.get("batch_sizes") or {}
                        if batch:
                            out["batched"] += 1
                            out["max_batch"] = max(out["max_batch"], max(int(b) for b in batch))
        except (aiohttp.ClientError, RuntimeError):
            out["errors"] += 1
            continue
        end = time.perf_counter()
        out["texts"].setdefault(topic, []).append("".join(text))
        if first is None:
            continue
        out["ttft"].append(first - start)
        if end <= until:
            out["completed"] += 1
            out["tokens"] += tokens
            out["request_s"].append(end - start)
        elif first < until:
            # Still streaming at the end of the window: the share it streamed inside (at its own rate).
            out["tokens"] += tokens * (until - first) / (end - first)


async def load(url: str, clients: int, seconds: float, max_tokens: int, mtp: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "completed": 0, "errors": 0, "tokens": 0, "ttft": [], "request_s": [], "batched": 0, "max_batch": 0, "texts": {},
        "drafted": 0, "accepted": 0, "rounds": 0,
    }
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        until = time.perf_counter() + seconds
        await asyncio.gather(*(client(session, url, i, max_tokens, until, out, mtp) for i in range(clients)))
    out["tok_s"] = out["tokens"] / seconds
    return out


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def warm(url: str, max_tokens: int) -> None:
    await load(url, 2, 3.0, max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The model runs in the servers, on their default device: no --device here.
    add_common_arguments(parser, repeats=1, device=False)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--mtp", default="adaptive", help=f"comma-separated request modes: {', '.join(MTP_MODES)}")
    parser.add_argument("--lanes", type=int, nargs="+", default=None,
                        help="a batching server per lane count (EXO_BATCH_LANES); default: one, with the node's default")
    args = parser.parse_args()
    modes = args.mtp.split(",")
    unknown = [m for m in modes if m not in MTP_MODES]
    if unknown:
        parser.error(f"unknown --mtp mode(s) {unknown}: choose from {list(MTP_MODES)}")
    with report_to(args.json) as report:
        servers = {}
        processes = []
        homes = []
        try:
            configs = [("one at a time", 1, None)] + (
                [("batching", args.max_batch, None)] if args.lanes is None
                else [(f"batching L={lanes}", args.max_batch, lanes) for lanes in args.lanes]
            )
            for name, batch, lanes in configs:
                os.environ["EXO_MAX_BATCH"] = str(batch)
                os.environ["EXO_MAX_QUEUE"] = "256"
                os.environ.pop("EXO_BATCH_LANES", None)
                if lanes is not None:
                    os.environ["EXO_BATCH_LANES"] = str(lanes)
                home = tempfile.TemporaryDirectory()
                homes.append(home)
                port = free_port()
                processes.append(start_server(args.model, port, free_port(), home=home.name))
                servers[name] = f"http://127.0.0.1:{port}"
                asyncio.run(warm(servers[name], args.max_tokens))
            rows: dict[tuple[str, str, int], dict[str, Any]] = {}
            repeats: dict[tuple[str, str, int], list[float]] = {}  # tok/s of every repeat
            for repeat in range(args.repeats):
                for mode in modes:
                    for n in args.clients:
                        for name, url in servers.items():
                            r = asyncio.run(load(url, n, args.seconds, args.max_tokens, MTP_MODES[mode]))
                            repeats.setdefault((mode, name, n), []).append(r["tok_s"])
                            if repeat == 0:
                                rows[mode, name, n] = r
                            else:  # the table's row is the first repeat's; every response counts for identity
                                for topic, texts in r["texts"].items():
                                    rows[mode, name, n]["texts"].setdefault(topic, []).extend(texts)
                            print(f"  ran {mode:8s} {name:13s} clients={n:3d}: {r['completed']} completed, "
                                  f"{r['tok_s']:.1f} tok/s", flush=True)
            print(f"\nmodel {args.model}, {args.max_tokens}-token streamed chat completions, {args.seconds:.0f} s per row, "
                  f"temperature 0, {os.cpu_count()} CPUs")
            print(f"{'mtp':8s} {'server':14s} {'clients':>7s} {'completed':>9s} {'errors':>6s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
                  f"{'tok/s':>7s} {'vs 1 client':>11s} {'vs one-at-a-time':>16s} {'batched reqs':>12s} {'max batch':>9s} "
                  f"{'req s p50':>9s} {'accept':>6s} {'tok/round':>9s}")
            for mode in modes:
                for n in args.clients:
                    for name in servers:
                        r = rows[mode, name, n]
                        one = rows[mode, name, args.clients[0]]["tok_s"]
                        base = rows[mode, "one at a time", n]["tok_s"]
                        accept = f"{r['accepted'] / r['drafted']:.2f}" if r["drafted"] else "-"
                        per_round = f"{1 + r['accepted'] / r['rounds']:.2f}" if r["rounds"] else "-"
                        print(f"{mode:8s} {name:14s} {n:7d} {r['completed']:9d} {r['errors']:6d} {quantile(r['ttft'], 0.5):8.2f}s "
                              f"{quantile(r['ttft'], 0.99):8.2f}s {r['tok_s']:7.1f} {r['tok_s'] / one:10.2f}x "
                              f"{r['tok_s'] / base:15.2f}x {r['batched']:12d} {r['max_batch']:9d} "
                              f"{quantile(r['request_s'], 0.5):8.3f}s {accept:>6s} {per_round:>9s}")
            # Greedy output must not depend on what else runs: every response for a topic, on either server
            # and in any batch, against the one-at-a-time server's first response for it.
            reference: dict[str, str] = {}
            for mode in modes:
                for n in args.clients:
                    for topic, texts in rows[mode, "one at a time", n]["texts"].items():
                        reference.setdefault(topic, texts[0])
            same = total = 0
            for r in rows.values():
                for topic, texts in r["texts"].items():
                    if topic in reference:
                        total += len(texts)
                        same += sum(t == reference[topic] for t in texts)
            print(f"\nresponses identical to the one-at-a-time output of their prompt: {same}/{total}")
            report.update(model=args.model, max_tokens=args.max_tokens, seconds=args.seconds, repeats=args.repeats,
                          rows=[{"mtp": mode, "server": name, "clients": n,
                                 **{k: v for k, v in r.items() if k not in ("texts", "ttft", "request_s")},
                                 "ttft_p50_s": quantile(r["ttft"], 0.5), "ttft_p99_s": quantile(r["ttft"], 0.99)}
                                for (mode, name, n), r in rows.items()],
                          identical_to_one_at_a_time=[same, total], tok_s_per_repeat=[
                              {"mtp": m, "server": name, "clients": n, "tok_s": v} for (m, name, n), v in repeats.items()])
            if args.repeats > 1:
                print(f"\n{args.repeats} repeats (each: every row once, in the order above): tok/s median (min-max) and the "
                      f"median of each repeat's ratio to one client on the same server in the same repeat")
                for mode in modes:
                    for n in args.clients:
                        for name in servers:
                            values = repeats[mode, name, n]
                            ratios = [v / o for v, o in zip(values, repeats[mode, name, args.clients[0]], strict=True)]
                            print(f"{mode:8s} {name:14s} {n:7d} {statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})"
                                  f"  vs 1 client {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
        finally:
            for process in processes:
                process.terminate()
                process.wait(30)
            for home in homes:
                home.cleanup()


if __name__ == "__main__":
    main()
