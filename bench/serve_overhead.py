"""The runner's serving path against the engine alone, in ONE process: what the path itself costs a stream.

    python bench/serve_overhead.py MODEL [--requests 6] [--max-tokens 64] [--intervals 0 0.02] [--json]

This process loads MODEL as a runner does (``runner.loading``) and serves it as a runner does: the device queue
on a thread of its own (``runner.device``), the runner's gRPC service on a unix socket (``runner.service``). A
client process streams Generate calls to it (out of this process, as the daemon is). Between them, the same
prompts decode in the engine alone (``Engine.generate``), as a job of the same device thread with nobody reading
its chunks. Each stream interval (``--intervals``: ``EXO_STREAM_INTERVAL_S``, ``runner/outbox.py``) is a
configuration of the service; the engine alone and every configuration alternate request by request, their order
rotated each round.

Why one process: the 9B's decoding on the H200 machines moves 115-216 tok/s from process to process with the host
(docs/performance.md, "Figures still to measure"), so `bench/serving.py --engine-vs-client`, which compares a
server process with the benchmark's own, reads 0.8-1.13x for the same code. Here both sides share a process and
a minute. What differs from a runner: the device thread is not the process's main thread, and there is no daemon
(its relay is `bench/serving.py`'s). EOS is ignored: every request decodes ``--max-tokens``.

Prints, per configuration, the median decode tok/s the runner's engine reports (``usage.native_mtp``), as the
client saw it streamed (first to last token), the messages per request, and the median of its per-round ratios to
the engine alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from common import add_common_arguments, report_to, stop_on_signals  # bench/ is this script's folder


def client(socket_path: str) -> None:
    """The client process: one Generate call per line of stdin (a JSON request), one JSON line of results each."""
    import grpc

    from exo.wire.proto_gen import node_pb2 as pb
    from exo.wire.proto_gen import node_pb2_grpc as pb_grpc

    stub = pb_grpc.RunnerStub(grpc.insecure_channel(f"unix:{socket_path}"))
    for line in sys.stdin:
        ask = json.loads(line)
        request = pb.GenerateRequest(model="bench", token_ids=pb.TokenIds(ids=ask["ids"]), max_tokens=ask["max_tokens"],
                                     native_mtp="off")
        first = last = None
        tokens = messages = 0
        stats: dict[str, Any] = {}
        for message in stub.Generate(request, timeout=600):
            if message.HasField("error"):
                raise SystemExit(f"Generate failed: {message.error}")
            if message.token_ids:
                now = time.perf_counter()
                first = first or now
                last = now
                tokens += len(message.token_ids)
                messages += 1
            if message.native_mtp_json:
                stats = json.loads(message.native_mtp_json)
        streamed = (tokens - 1) / (last - first) if first is not None and last is not None and last > first else 0.0
        print(json.dumps({"tokens": tokens, "messages": messages, "streamed_tok_s": streamed,
                          "runner_tok_s": stats.get("decode_tokens_per_s", 0.0)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=1, device=False)  # (--repeats unused: --requests)
    parser.add_argument("--requests", type=int, default=6, help="rounds: each a request of every configuration")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--intervals", type=float, nargs="+", default=[0.0, 0.02],
                        help="stream intervals of the service, seconds (EXO_STREAM_INTERVAL_S), one configuration each")
    parser.add_argument("--prefix-cache", action="store_true",
                        help="two configurations more: the engine alone and the service at the first interval with the "
                             "node's prefix cache (its RAM and disk tiers, as a runner has them), every prompt new to it")
    parser.add_argument("--runner-engine", action="store_true",
                        help="one configuration more: a second engine of the same model readied as a runner readies its "
                             "own (its batches warmed up to the node's max_batch, its state room, its prefix cache), alone")
    parser.add_argument("--client", metavar="SOCKET", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client(args.client)
        return
    stop_on_signals()
    with report_to(args.json) as report:
        run(args, report)


def run(args: argparse.Namespace, report: dict[str, Any]) -> None:
    import dataclasses
    from concurrent import futures

    import grpc

    from exo.engine import GenerationRequest, SamplingParams, resolve_model
    from exo.engine.bench import DEFAULT_PROMPTS, encode_prompt
    from exo.runner.device import Device
    from exo.runner.loading import load_for_serving, ready_engine
    from exo.runner.service import RunnerServicer, RunnerState
    from exo.settings import load_settings
    from exo.wire.proto_gen import node_pb2 as pb
    from exo.wire.proto_gen import node_pb2_grpc as pb_grpc

    folder = tempfile.mkdtemp(prefix="exo-serve-overhead-")
    if args.prefix_cache:
        os.environ["EXO_HOME"] = os.path.join(folder, "home")  # the disk tier in a folder of its own, removed after
    settings = load_settings()
    loaded, config = load_for_serving(resolve_model(args.model), settings)
    loaded = dataclasses.replace(loaded, eos_token_ids=frozenset())  # every request decodes --max-tokens
    engine = ready_engine(loaded, config)
    prompts = [encode_prompt(engine, p, True) for p in DEFAULT_PROMPTS]
    device = Device(16, max_batch=settings.max_batch)
    device.start_thread()
    state = RunnerState("bench", pb.Shard(start_layer=0, end_layer=0, rank=0, world_size=1))
    state.ready(pb.ModelSummary(model_id="bench"), engine)
    servicer = RunnerServicer(state, device, args.intervals[0])
    socket_path = os.path.join(folder, "runner.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_RunnerServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    child = subprocess.Popen([sys.executable, __file__, "--client", socket_path], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None

    class Alone:
        """The engine alone on the device thread: a job of the queue, its chunks read by nobody else."""

        bounded = False

        def __init__(self, ids: list[int], on: Any) -> None:
            self.ids, self.on, self.done, self.tok_s = ids, on, threading.Event(), 0.0

        def run(self) -> None:
            request = GenerationRequest(self.ids, max_tokens=args.max_tokens, sampling=SamplingParams(temperature=0),
                                        native_mtp="off")
            stats = None
            for chunk in self.on.generate(request):
                stats = chunk.stats or stats
            self.tok_s = stats.decode_tokens_per_s if stats is not None else 0.0
            self.done.set()

        def drop(self, reason: str) -> None:
            self.done.set()

    def alone(ids: list[int], on: Any = engine) -> dict[str, float]:
        job = Alone(ids, on)
        device.submit(job)
        job.done.wait()
        return {"runner_tok_s": job.tok_s}

    def served(ids: list[int], interval: float) -> dict[str, float]:
        servicer.stream_interval_s = interval
        child.stdin.write(json.dumps({"ids": ids, "max_tokens": args.max_tokens}) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if not line:
            raise SystemExit("the client process ended")
        return json.loads(line)

    # (name, served, interval, prefix cache)
    configs = [("alone", False, 0.0, False)] + [(f"served {v:g} s", True, v, False) for v in args.intervals]
    cache = None
    if args.prefix_cache:
        from exo.runner.loading import attach_prefix_cache

        attach_prefix_cache(engine, settings)
        cache, engine.prefix_cache = engine.prefix_cache, None
        if cache is None:
            raise SystemExit("--prefix-cache: the settings turn the prefix cache off")
        configs += [("alone + prefix cache", False, 0.0, True),
                    (f"served {args.intervals[0]:g} s + prefix cache", True, args.intervals[0], True)]
    runner_engine = None
    if args.runner_engine:
        loaded2, config2 = load_for_serving(resolve_model(args.model), settings)
        runner_engine = ready_engine(dataclasses.replace(loaded2, eos_token_ids=frozenset()), config2, settings)
        configs.append(("runner's engine alone", False, 0.0, False))
    names = [c[0] for c in configs]
    rows: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    fresh = iter(range(1000, 1 << 30))  # a first token of its own per request: every prompt new to the cache

    def request(config: tuple[str, bool, float, bool], ids: list[int]) -> dict[str, float]:
        _, is_served, interval, cached = config
        ids = [next(fresh) % engine.vocab_size, *ids]
        engine.prefix_cache = cache if cached else None
        try:
            if config[0] == "runner's engine alone":
                return alone(ids, runner_engine)
            return served(ids, interval) if is_served else alone(ids)
        finally:
            if cached:
                cache.store.flush()  # its disk writes inside its own request's time, not the next one's
            engine.prefix_cache = None

    try:
        for prompt in prompts[:2]:  # warm every path
            for config in configs:
                request(config, prompt)
        for i in range(args.requests):
            ids = prompts[i % len(prompts)]
            for config in configs[i % len(configs):] + configs[: i % len(configs)]:
                rows[config[0]].append(request(config, ids))
    finally:
        child.stdin.close()
        child.wait(30)
        server.stop(5)
        device.close(10)
        shutil.rmtree(folder, ignore_errors=True)
    base = [r["runner_tok_s"] for r in rows["alone"]]
    print(f"{args.model}: {args.requests} rounds of {args.max_tokens}-token greedy requests, MTP off, one process "
          f"(the device thread serving both)")
    print(f"  engine alone: decode {statistics.median(base):.1f} tok/s (requests {', '.join(f'{t:.1f}' for t in base)})")
    report.update(model=args.model, requests=args.requests, max_tokens=args.max_tokens,
                  alone_tok_s=statistics.median(base), configurations={})
    for name, _, interval, _ in configs[1:]:
        got = rows[name]
        runner = [r["runner_tok_s"] for r in got]
        ratios = [r / b for r, b in zip(runner, base, strict=True)]
        entry = {"interval_s": interval, "runner_tok_s": statistics.median(runner),
                 "streamed_tok_s": statistics.median(r.get("streamed_tok_s", 0.0) for r in got),
                 "messages": statistics.median(r.get("messages", 0) for r in got),
                 "vs_alone": statistics.median(ratios), "vs_alone_each": ratios}
        report["configurations"][name] = entry
        streamed = f", as streamed {entry['streamed_tok_s']:.1f}; {entry['messages']:.0f} messages a request" \
            if "messages" in got[0] else ""
        print(f"  {name:>14}: decode {entry['runner_tok_s']:.1f} tok/s{streamed}; vs the engine alone {entry['vs_alone']:.3f}x "
              f"(rounds {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
