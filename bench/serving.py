"""Many clients at once: continuous batching vs one generation at a time, through `exo serve`.

    python bench/serving.py [MODEL] [--clients 1 8 32] [--seconds 30] [--max-tokens 64] [--mtp off,k1,adaptive]
                            [--lanes 1 2] [--repeats 3] [--engine-vs-client N] [--no-one-at-a-time] [--profile N] [--json]

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
backend runs on cores of their own) instead of one with the node's default. ``--no-one-at-a-time`` skips the
EXO_MAX_BATCH=1 server.

Each row also says what the servers' device threads did in its window (``EXO_DEVICE_TRACE``,
``runner.device.DeviceTrace``): decode steps per second, the mean batch, the step's median time, the longest
stretch between two decode steps (a stall shows there), the prompt tokens prefilled (and in how many shared
calls) and the share of the window the thread spent planning, prefilling, stepping, emitting, or idle.

``--profile N`` runs the servers' device threads under cProfile (``EXO_DEVICE_PROFILE``; it slows them, so
take its rows' speed as no figure) and prints after each row its N functions of most own time; with
``--engine-vs-client``, also the engine alone's requests (profiled in this process) beside the runner's device
thread over the client's: where the serving loop's extra time per token goes.

``--engine-vs-client N`` first runs N requests of the engine alone (in this process, a fresh engine on the same
checkpoint, no prefix cache) against N of one client through the batching server (idle otherwise), the same
chat requests alternating, and prints the medians: the engine's decode tok/s and its request tok/s (prefill
included), the client's decode tok/s as streamed (first to last token), its request tok/s (sent to last
token) and TTFT, and the runner's own decode tok/s for those requests (``usage.native_mtp``); then the
ratios. The runner's decode against the engine's is what the serving loop costs; the client's decode against
the runner's, what the relay costs; the request ratios add the per-request work (tokenizing, the prefix
cache, prefill, HTTP).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from typing import Any

import aiohttp
from common import (  # bench/ is this script's folder
    add_common_arguments,
    device_profile,
    device_trace,
    format_trace,
    free_port,
    report_to,
    server_log_lines,
    start_server,
    stop_on_signals,
)

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
        out["window"] = (time.monotonic(), time.monotonic() + seconds)  # the device trace's clock
        until = time.perf_counter() + seconds
        await asyncio.gather(*(client(session, url, i, max_tokens, until, out, mtp) for i in range(clients)))
    out["tok_s"] = out["tokens"] / seconds
    return out


async def one_stream(session: aiohttp.ClientSession, url: str, topic: str, max_tokens: int,
                     mtp: dict[str, Any] | None) -> dict[str, float]:
    """One streamed chat completion: (sent -> first text) TTFT, (first -> last event) decode rate as the client
    sees it, tokens / (sent -> last) and the runner's own decode rate for it (``usage.native_mtp``)."""
    body = {"messages": [{"role": "user", "content": f"Write a short poem about {topic}."}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **({"native_mtp": mtp} if mtp is not None else {})}
    start = time.perf_counter()
    first = last = None
    usage: dict[str, Any] = {}
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            now = time.perf_counter()
            if event.get("choices"):
                first = first or now
                last = now
            if event.get("usage"):
                usage = event["usage"]
    assert first is not None and last is not None and usage
    n = usage["completion_tokens"]
    return {"ttft_s": first - start, "decode_tok_s": (n - 1) / (last - first) if last > first else float("nan"),
            "request_tok_s": n / (last - start), "runner_decode_tok_s": usage["native_mtp"]["decode_tokens_per_s"],
            "tokens": n}


def engine_vs_client(model: str, url: str, requests: int, max_tokens: int, mtp: dict[str, Any] | None, profile: int = 0,
                     profile_dir: str | None = None) -> dict[str, Any]:
    """The engine alone (in this process: a fresh engine on the same checkpoint, as `exo bench` runs it) against
    one client through `exo serve` (the server idle otherwise), the same chat requests, alternating."""
    from exo.engine import GenerationRequest, SamplingParams, resolve_model
    from exo.engine.prompt import GenerateParams, Prompt, generation_request
    from exo.runner.loading import load_for_serving, ready_engine
    from exo.settings import load_settings

    settings = load_settings()
    loaded, config = load_for_serving(resolve_model(model), settings)
    engine = ready_engine(loaded, config)
    fields: dict[str, Any] = {}
    if mtp is not None and mtp.get("enabled") is False:
        fields["native_mtp"] = "off"
    elif mtp is not None and "k" in mtp:
        fields["mtp_k"] = mtp["k"]
    rows: dict[str, list[dict[str, float]]] = {"engine": [], "client": []}
    import cProfile

    profiler = cProfile.Profile() if profile else None  # the engine alone's requests (this process, every thread)
    window = [0.0, 0.0]  # the client requests' span (time.monotonic()): the runner's device profile of them

    async def run() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            for i in range(requests + 1):  # the first pair warms both sides
                topic = TOPICS[i % len(TOPICS)]
                prompt = Prompt(messages=[{"role": "user", "content": f"Write a short poem about {topic}."}])
                params = GenerateParams(max_tokens=max_tokens, default_max_tokens=max_tokens,
                                        sampling=SamplingParams(temperature=0.0), **fields)
                start = time.perf_counter()
                if profiler is not None and i:
                    profiler.enable()
                request: GenerationRequest = generation_request(engine, prompt, params)
                stats = None
                n = 0
                for chunk in engine.generate(request):
                    n += len(chunk.token_ids)
                    stats = chunk.stats or stats
                if profiler is not None:
                    profiler.disable()
                wall = time.perf_counter() - start
                assert stats is not None
                if i == 1:
                    window[0] = time.monotonic()
                client = await one_stream(session, url, topic, max_tokens, mtp)
                window[1] = time.monotonic()
                if i:
                    rows["engine"].append({"decode_tok_s": stats.decode_tokens_per_s, "request_tok_s": n / wall,
                                           "ttft_s": stats.ttft_ms / 1000})
                    rows["client"].append(client)

    asyncio.run(run())
    if profiler is not None:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile)
        own = text.getvalue().strip().replace(os.getcwd() + "/", "")
        print(f"\nthe engine alone's {requests} requests, by own time:\n{own}")
        print(f"\nthe runner's device thread over the client's {requests} requests (and the engine's between them, "
              f"idle there), by own time:\n{device_profile(profile_dir, *window, profile)}", flush=True)
    med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in rows.items()}
    return {"requests": requests, **med,
            "client_decode_vs_engine": med["client"]["decode_tok_s"] / med["engine"]["decode_tok_s"],
            "client_request_vs_engine_request": med["client"]["request_tok_s"] / med["engine"]["request_tok_s"],
            "client_request_vs_engine_decode": med["client"]["request_tok_s"] / med["engine"]["decode_tok_s"],
            "runner_decode_vs_engine": med["client"]["runner_decode_tok_s"] / med["engine"]["decode_tok_s"]}


def print_engine_vs_client(r: dict[str, Any], max_tokens: int) -> None:
    e, c = r["engine"], r["client"]
    print(f"\nengine alone vs one client through exo serve ({max_tokens}-token chat completions, {r['requests']} of each, "
          "alternating; medians)")
    print(f"  engine alone:  decode {e['decode_tok_s']:7.1f} tok/s, request {e['request_tok_s']:7.1f} tok/s "
          f"(prefill included), TTFT {1000 * e['ttft_s']:.0f} ms")
    print(f"  one client:    decode {c['decode_tok_s']:7.1f} tok/s as streamed, request {c['request_tok_s']:7.1f} tok/s "
          f"(sent -> last token), TTFT {1000 * c['ttft_s']:.0f} ms; the runner's engine decoded at "
          f"{c['runner_decode_tok_s']:.1f}")
    print(f"  client / engine: decode {r['client_decode_vs_engine']:.3f}x, request {r['client_request_vs_engine_request']:.3f}x, "
          f"request vs the engine's decode {r['client_request_vs_engine_decode']:.3f}x; the runner's decode vs the "
          f"engine's {r['runner_decode_vs_engine']:.3f}x")


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
    parser.add_argument("--no-one-at-a-time", dest="one_at_a_time", action="store_false",
                        help="skip the EXO_MAX_BATCH=1 server (its column of ratios then reads '-')")
    parser.add_argument("--engine-vs-client", type=int, default=0, metavar="N",
                        help="first, N requests of the engine alone (in this process) against N of one client through "
                        "the batching server, alternating, in the first --mtp mode")
    parser.add_argument("--server-gpu", type=int, default=None, metavar="I",
                        help="the servers on GPU I alone (CUDA_VISIBLE_DEVICES in their environment), the engine of "
                             "--engine-vs-client on this process's default: one client's speed without two processes "
                             "sharing a GPU (a host of two GPUs)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="the runners' device threads under cProfile (EXO_DEVICE_PROFILE; slows them): each row "
                        "also prints its N functions of most own time")
    args = parser.parse_args()
    modes = args.mtp.split(",")
    unknown = [m for m in modes if m not in MTP_MODES]
    if unknown:
        parser.error(f"unknown --mtp mode(s) {unknown}: choose from {list(MTP_MODES)}")
    with report_to(args.json) as report:
        servers = {}
        traces: dict[str, str] = {}  # each server's runners' device trace (runner.device.DeviceTrace)
        processes = []
        homes = []
        try:
            configs = ([("one at a time", 1, None)] if args.one_at_a_time else []) + (
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
                traces[name] = os.environ["EXO_DEVICE_TRACE"] = os.path.join(home.name, "device-trace")
                if args.profile:
                    os.environ["EXO_DEVICE_PROFILE"] = os.path.join(home.name, "device-profile")
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                if args.server_gpu is not None:
                    os.environ["CUDA_VISIBLE_DEVICES"] = str(args.server_gpu)
                processes.append(start_server(args.model, port, free_port(), home=home.name))
                os.environ.pop("EXO_DEVICE_TRACE")
                os.environ.pop("EXO_DEVICE_PROFILE", None)
                if args.server_gpu is not None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES")
                    if visible is not None:
                        os.environ["CUDA_VISIBLE_DEVICES"] = visible
                servers[name] = f"http://127.0.0.1:{port}"
                asyncio.run(warm(servers[name], args.max_tokens))
            if args.engine_vs_client:
                batching = next(url for name, url in servers.items() if name != "one at a time")
                name = next(name for name in servers if name != "one at a time")
                versus = engine_vs_client(args.model, batching, args.engine_vs_client, args.max_tokens, MTP_MODES[modes[0]],
                                          args.profile, os.path.join(os.path.dirname(traces[name]), "device-profile"))
                print_engine_vs_client(versus, args.max_tokens)
                report["engine_vs_client"] = versus
            rows: dict[tuple[str, str, int], dict[str, Any]] = {}
            repeats: dict[tuple[str, str, int], list[float]] = {}  # tok/s of every repeat
            for repeat in range(args.repeats):
                for mode in modes:
                    for n in args.clients:
                        for name, url in servers.items():
                            r = asyncio.run(load(url, n, args.seconds, args.max_tokens, MTP_MODES[mode]))
                            r["device"] = device_trace(traces[name], *r["window"])
                            repeats.setdefault((mode, name, n), []).append(r["tok_s"])
                            if repeat == 0:
                                rows[mode, name, n] = r
                            else:  # the table's row is the first repeat's; every response counts for identity
                                for topic, texts in r["texts"].items():
                                    rows[mode, name, n]["texts"].setdefault(topic, []).extend(texts)
                            print(f"  ran {mode:8s} {name:13s} clients={n:3d}: {r['completed']} completed, "
                                  f"{r['tok_s']:.1f} tok/s; {format_trace(r['device'])}", flush=True)
                            if args.profile:
                                folder = os.path.join(os.path.dirname(traces[name]), "device-profile")
                                print(device_profile(folder, *r["window"], args.profile), flush=True)
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
                        base = rows.get((mode, "one at a time", n), {}).get("tok_s")
                        versus_base = f"{r['tok_s'] / base:15.2f}x" if base else f"{'-':>16s}"
                        accept = f"{r['accepted'] / r['drafted']:.2f}" if r["drafted"] else "-"
                        per_round = f"{1 + r['accepted'] / r['rounds']:.2f}" if r["rounds"] else "-"
                        versus_one = f"{r['tok_s'] / one:10.2f}x" if one else f"{'-':>11s}"  # (one client: none streamed)
                        print(f"{mode:8s} {name:14s} {n:7d} {r['completed']:9d} {r['errors']:6d} {quantile(r['ttft'], 0.5):8.2f}s "
                              f"{quantile(r['ttft'], 0.99):8.2f}s {r['tok_s']:7.1f} {versus_one} "
                              f"{versus_base} {r['batched']:12d} {r['max_batch']:9d} "
                              f"{quantile(r['request_s'], 0.5):8.3f}s {accept:>6s} {per_round:>9s}")
            # Greedy output must not depend on what else runs: every response for a topic, on either server
            # and in any batch, against the one-at-a-time server's first response for it (without that server:
            # the first server's at the first client count).
            reference: dict[str, str] = {}
            solo = [("one at a time", n) for n in args.clients] if args.one_at_a_time else [(next(iter(servers)), args.clients[0])]
            for mode in modes:
                for name, n in solo:
                    for topic, texts in rows[mode, name, n]["texts"].items():
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
                                 **{k: v for k, v in r.items() if k not in ("texts", "ttft", "request_s", "window")},
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
            # What each server's runner chose at load (its device checks) and its warm-up: where one server's runner
            # decodes slower than another's of the same model, a check that chose differently shows here.
            for i, process in enumerate(processes):
                for line in server_log_lines(process, "kernels:", "warmed up in"):
                    print(f"server {i + 1}: {line.split(': ', 1)[-1] if 'runner' in line else line}")
                with contextlib.suppress(OSError, AttributeError):
                    os.unlink(process.log_path)
            for home in homes:
                home.cleanup()


if __name__ == "__main__":
    stop_on_signals()  # killed, it ends its daemons (the finally)
    main()
