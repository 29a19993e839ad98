"""Pipeline benchmark: tokens/s of one node vs 2- and 3-stage pipelines over loopback, MTP off and on.

    python bench/pipeline.py [MODEL] [--stages 1,2,3] [--modes plain,k1,k2,adaptive] [--max-tokens 128] [--repeats 3]
                             [--json] [--gpu-per-stage] [--no-breakdown | --breakdown-only] [--breakdown-modes plain]
                             [--breakdown-repeats 1] [--transports ring,inline] [--transport-ab]
                             [--clients 1,8,32 [--seconds 20]] [--wires host,graph,collective]

Every configuration runs in fresh processes (one per stage, a ring over 127.0.0.1, exactly what a
cluster's runners run: exo.runner.local_pipeline), the same prompts, greedy, EOS ignored so every
generation is max-tokens long. Repeats alternate the configurations, so a slow moment of the machine
hits all of them. Prints decode tokens/s (median over prompts and repeats) per stage count and mode, the
ratio to one node in the same mode, acceptance, and what crosses a stage boundary (the leader's bytes,
both ways) per round and per emitted token. ``--wires host,graph``: every pipeline once per wire in each repeat
(``EXO_PIPELINE_WIRE`` in every stage: "host", a stage reads its input and evaluates its output on the host, so
the stages' graph building adds up; "graph", the transfers are ops of each stage's step, built before the input
arrives, opt-in; "auto", the default: host for now), each against one node.

The hop breakdown (on unless ``--no-breakdown``; printed as each run finishes): per pipeline, mode
(``--breakdown-modes``), repeat (``--breakdown-repeats``) and transport (``--transports``:
"inline", a step's message on the stage's own doorbell socket, as exo runs; "ring", every message on MLX's
ring, as before) one more run with ``EXO_PIPELINE_PHASES=1`` (on the host wire: its phases are host messages), every stage's ``RingLink`` phases, median
microseconds per step message (medians over the run, then over the repeats): on a send, work (since its
previous message: its layers, on the leader sampling and drafting too), ready (evaluating what is sent: on a
GPU the stream's synchronisation), ring (the message's send: device to host and the socket's write, or
MLX's send) and bell (the rung before a message on the ring); on a receive, gap (since its previous
message), wait (asleep on the doorbell: the other stages' work and the wire) and ring (the message into
an array: host to device). A round is the leader's path (the sum of its phases); "hops" is what a round
costs beyond every stage's own work, beside one node's time for as many tokens.

The clients axis (``--clients 1,8,32``): two ``exo serve`` daemons on 127.0.0.1 (each stage's runner on its
own GPU with ``--gpu-per-stage``), N clients streaming --max-tokens chat completions (temperature 0) back to
back for --seconds through the first daemon's HTTP API, the model on one node, then placed over two
(``min_nodes: 2``), in the same run: completed requests, errors, time to first token p50/p99, tokens/s
of all clients together, and the ratio to one client on the same placement. ``--clients-repeats N``: the two
placements N times, alternating, each placed anew (new runner processes: one process's speed moves against
another's), every ratio against its own repeat's, and the medians over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import mlx.core as mx

from exo.engine import load_checkpoint, resolve_model
from exo.runner.group import GRAPH_PHASES, PHASES
from exo.runner.local_pipeline import run_local_pipeline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_trace, format_trace, free_port, start_server, stop_on_signals  # noqa: E402
from serving import load as load_clients  # noqa: E402
from serving import quantile  # noqa: E402

MODES = {"plain": {"native_mtp": "off"}, "k1": {"mtp_k": 1}, "k2": {"mtp_k": 2}, "k3": {"mtp_k": 3},
         "adaptive": {}, "batch8": {"native_mtp": "off"}}
BATCH = 8  # mode batch8: 8 plain requests decoded as one batch (the device queue's loop), per prompt


def _batch_result(members: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch's members as one result: their tokens, their decode tok/s summed (they step together)."""
    return {"token_ids": [t for m in members for t in m["token_ids"]], "bytes_sent": 0, "bytes_received": 0,
            "stats": {"decode_tokens_per_s": sum(m["stats"]["decode_tokens_per_s"] for m in members),
                      "drafted_tokens": 0, "accepted_tokens": 0, "k_histogram": {"0": sum(len(m["token_ids"]) for m in members)}}}
PROMPTS = ("def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n")


def split(n_layers: int, stages: int) -> list[tuple[int, int]]:
    base, extra = divmod(n_layers, stages)
    out, start = [], 0
    for rank in range(stages):
        end = start + base + (1 if rank < extra else 0)
        out.append((start, end))
        start = end
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="card id, repo or directory (default: exo-demo)")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--modes", default="plain,k1,k2,adaptive",
                   help="plain, k1, k2, k3, adaptive; batch8: 8 plain requests as one batch per prompt, their prompts "
                        "prefilled as rows of one call (summed tok/s)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--gpu-per-stage", action="store_true",
                   help="on a host with several CUDA GPUs: stage i on GPU i (CUDA_VISIBLE_DEVICES), as separate nodes")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                   help="skip the traced runs that break a pipeline's round down per phase")
    p.add_argument("--breakdown-modes", default="", help="the breakdown's modes (default: --modes)")
    p.add_argument("--breakdown-repeats", type=int, default=1)
    p.add_argument("--breakdown-only", action="store_true", help="skip the tokens/s table (the breakdown's runs only)")
    p.add_argument("--transports", default="ring,inline",
                   help="the breakdown's A/B: 'ring' (every message on MLX's ring, a doorbell rung first, as before) "
                   "and/or 'inline' (a step's message on the doorbell itself, exo's default)")
    p.add_argument("--transport-ab", action="store_true",
                   help="also the transports' A/B outside a model: round trips of step-sized messages, inline vs ring")
    p.add_argument("--transport-work-ms", type=float, default=2.0, help="compute per side per round in that A/B")
    p.add_argument("--clients", default="", help="e.g. 1,8,32: concurrent streams through exo serve, one node and 2 stages")
    p.add_argument("--clients-mode", default="plain", choices=sorted(MODES_API), help="the clients' native MTP mode")
    p.add_argument("--seconds", type=float, default=20.0, help="per row of the clients axis")
    p.add_argument("--clients-repeats", type=int, default=1,
                   help="the clients axis's placements this many times, alternating, each placed anew (new runners)")
    p.add_argument("--wires", default="auto",
                   help="pipelines' wires, each a configuration: host, graph, collective, auto (EXO_PIPELINE_WIRE); "
                        "collective: the stages an NCCL group with --gpu-per-stage on MLX CUDA, else a ring group; "
                        "a wire+nographs: its stages with MLX_USE_CUDA_GRAPHS=0")
    p.add_argument("--phases", action="store_true",
                   help="EXO_PIPELINE_PHASES=1 in every pipeline's stages: on the graph and collective wires, each "
                        "stage's median graph.wait / graph.build and the leader's graph.period per step, printed per run")
    args = p.parse_args(argv)
    resolved = resolve_model(args.model)
    loaded = load_checkpoint(resolved.path)
    n_layers = loaded.model.num_layers
    tokenizer = loaded.tokenizer
    stage_counts = [int(s) for s in args.stages.split(",")]
    modes = args.modes.split(",")
    requests, keys = [], []
    for mode in modes:
        for i, prompt in enumerate(PROMPTS):
            if mode == "batch8":
                members = [{"prompt": tokenizer.encode(PROMPTS[(i + j) % len(PROMPTS)]), "max_tokens": args.max_tokens,
                            "ignore_eos": True, **MODES[mode]} for j in range(BATCH)]
                # (their prompts prefilled as rows of one call, as the serving scheduler admits 8 arriving at once)
                requests.append({"batch": members, "join_at": [0] * BATCH, "together": True})
            else:
                requests.append({"prompt": tokenizer.encode(prompt), "max_tokens": args.max_tokens, "ignore_eos": True,
                                 **MODES[mode]})
            keys.append(mode)
    wires = args.wires.split(",")
    configs = [(stages, wire) for stages in stage_counts for wire in (wires if stages > 1 else ["-"])]
    rows: dict[tuple[int, str, str], list[dict]] = {}
    used: dict[tuple[int, str], str] = {}  # the wire each configuration's leader used ("graph" / "host")
    for repeat in range(0 if args.breakdown_only else args.repeats):
        for stages, wire in configs:
            name, _, variant = wire.partition("+")
            env = [{**({"CUDA_VISIBLE_DEVICES": str(rank)} if args.gpu_per_stage else {}),
                    **({"EXO_PIPELINE_WIRE": name} if wire != "-" else {}),
                    **({"MLX_USE_CUDA_GRAPHS": "0"} if variant == "nographs" else {}),
                    **({"EXO_PIPELINE_PHASES": "1"} if args.phases and stages > 1 else {})} for rank in range(stages)]
            nccl = name in ("collective", "auto") and args.gpu_per_stage and mx.cuda.is_available() and stages == 2
            out = run_local_pipeline(resolved.path, split(n_layers, stages), requests, warmup=True, stage_env=env,
                                     backend="nccl" if nccl else "ring")
            used[(stages, wire)] = (out.get("wire") or "-") + (f"+{variant}" if variant else "")
            for mode, result in zip(keys, out["results"], strict=True):
                rows.setdefault((stages, wire, mode), []).append(_batch_result(result) if isinstance(result, list) else result)
            done = {mode: statistics.median(r["stats"]["decode_tokens_per_s"]
                                            for r in rows[(stages, wire, mode)][-len(PROMPTS):]) for mode in modes}
            print(f"repeat {repeat + 1}/{args.repeats}: {stages} stage(s) ({used[(stages, wire)]} wire) done (tok/s: "
                  + ", ".join(f"{mode} {tps:.1f}" for mode, tps in done.items()) + ")", file=sys.stderr, flush=True)
            if args.phases and stages > 1:
                print("  " + graph_phases(out["links"]), file=sys.stderr, flush=True)
    report = []
    first = configs[0]
    for stages, wire in configs if rows else []:
        for mode in modes:
            results = rows[(stages, wire, mode)]
            tps = statistics.median(r["stats"]["decode_tokens_per_s"] for r in results)
            base = statistics.median(r["stats"]["decode_tokens_per_s"] for r in rows[(*first, mode)])
            drafted = sum(r["stats"]["drafted_tokens"] for r in results)
            accepted = sum(r["stats"]["accepted_tokens"] for r in results)
            steps = sum(sum(r["stats"]["k_histogram"].values()) for r in results)  # rounds + plain steps
            tokens = sum(len(r["token_ids"]) for r in results)
            moved = sum(r["bytes_sent"] + r["bytes_received"] for r in results)
            report.append({
                "stages": stages, "wire": used[(stages, wire)], "mode": mode, "decode_tokens_per_s": round(tps, 2),
                "vs_first": round(tps / base, 3) if base else None,
                "acceptance": round(accepted / drafted, 3) if drafted else None,
                "bytes_per_round": round(moved / steps) if stages > 1 and steps else 0,
                "bytes_per_token": round(moved / tokens) if stages > 1 and tokens else 0,
            })
    if not args.json and report:
        print_table(resolved.model_id, n_layers, args, stage_counts, report)
    breakdown = []
    if args.breakdown:  # repeats alternate the transports, as above: a slow moment hits both
        runs: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
        if not args.json:
            print_breakdown_header()
        for repeat in range(args.breakdown_repeats):
            for stages in [n for n in stage_counts if n > 1]:
                for mode in (args.breakdown_modes or args.modes).split(","):
                    for order in args.transports.split(","):
                        run = hop_breakdown(resolved.path, split(n_layers, stages), mode, tokenizer, args, order,
                                            single=next((r for r in report if r["stages"] == 1 and r["mode"] == mode), None))
                        runs.setdefault((stages, mode, order), []).append(run)
                        if not args.json:  # as each run finishes: a cut-off run still shows what it measured
                            print_breakdown_rows(run, f"repeat {repeat + 1}/{args.breakdown_repeats}")
        breakdown = [_median_run(r) for r in runs.values()]
        if not args.json and args.breakdown_repeats > 1:
            print(f"\nmedians over the {args.breakdown_repeats} repeats:")
            for b in breakdown:
                print_breakdown_rows(b, "median")
    transports = []
    if args.transport_ab:
        dtype = str(loaded.model.stage_layers[0].input_layernorm.weight.dtype).removeprefix("mlx.core.")
        for rows in (1, 3):  # a plain step's hiddens, a round's at K = 2
            for hidden, dt in ((loaded.model.hidden_size, dtype), (4096, "bfloat16")):
                transports.append(transport_ab(rows, hidden, dt, args.transport_work_ms, 2 * args.repeats + 2))
                print(f"transport A/B [{rows}, {hidden}] {dt} done", file=sys.stderr, flush=True)
    clients = []
    if args.clients:
        clients = clients_axis(resolved, [int(c) for c in args.clients.split(",")], args)
    if args.json:
        print(json.dumps({"model": resolved.model_id, "n_layers": n_layers, "max_tokens": args.max_tokens,
                          "repeats": args.repeats, "rows": report, "breakdown": breakdown, "transports": transports,
                          "clients": clients}, indent=1))
        return 0
    if transports:
        print(f"\ntransport A/B: two processes pass [1, rows, H] back and forth with ~{args.transport_work_ms:g} ms of "
              "compute on each side; round p50 with the message on the doorbell (inline) and on MLX's ring, "
              "alternating blocks in the same processes")
        print(f"{'rows':>4} {'H':>6} {'dtype':>9} {'bytes':>7} {'work us':>8} {'inline us':>9} {'ring us':>8} {'ring/inline':>11}")
        for t in transports:
            print(f"{t['rows']:>4} {t['hidden']:>6} {t['dtype']:>9} {t['bytes']:>7} {t['work_us']:>8.0f} {t['inline']:>9.0f} "
                  f"{t['ring']:>8.0f} {t['inline_vs_ring']:>10.2f}x")
    if clients:
        print_clients(clients, args)
    return 0


def graph_phases(links: list[dict[str, Any]]) -> str:
    """Each stage's graph-wire phases over a run (``group.GRAPH_PHASES``: medians in microseconds over every forward
    step of every mode, prompts included), as one line."""
    parts = []
    for link in links:
        medians = {phase: statistics.median(link["samples"].get(phase) or [0.0]) * 1e6 for phase in GRAPH_PHASES}
        counted = {phase: len(link["samples"].get(phase) or []) for phase in GRAPH_PHASES}
        shown = ", ".join(f"{phase} {medians[phase]:.0f} us" for phase in GRAPH_PHASES if counted[phase])
        parts.append(f"rank {link['rank']}: {shown or 'no graph-wire steps timed'}")
    return "graph-wire phases (medians): " + "; ".join(parts)


def print_table(model_id: str, n_layers: int, args: argparse.Namespace, stage_counts: list[int],
                report: list[dict[str, Any]]) -> None:
    print(f"{model_id} ({n_layers} layers), {args.max_tokens} tokens x {len(PROMPTS)} prompts x "
          f"{args.repeats} repeats; ratio vs {stage_counts[0]} stage(s) in the same mode")
    print(f"{'stages':>6} {'wire':>10} {'mode':>9} {'tok/s':>8} {'ratio':>6} {'accept':>7} {'B/round':>8} {'B/token':>8}")
    for row in report:
        print(f"{row['stages']:>6} {row['wire']:>10} {row['mode']:>9} {row['decode_tokens_per_s']:>8.2f} {row['vs_first'] or 0:>6.3f} "
              f"{row['acceptance'] if row['acceptance'] is not None else '-':>7} {row['bytes_per_round']:>8} "
              f"{row['bytes_per_token']:>8}")


def hop_breakdown(path: Path, stages: list[tuple[int, int]], mode: str, tokenizer: Any, args: argparse.Namespace,
                  order: str, single: dict[str, Any] | None) -> dict[str, Any]:
    """One traced run of ``mode`` on ``stages``: every stage's link phases per step message (microseconds).
    ``order``: "inline" (a step's message on the doorbell, as exo runs) or "ring" (every message on MLX's ring)."""
    requests = [{"prompt": tokenizer.encode(p), "max_tokens": args.max_tokens, "ignore_eos": True, **MODES[mode]}
                for p in PROMPTS]
    env = [{"EXO_PIPELINE_PHASES": "1", "EXO_PIPELINE_WIRE": "host", **({"EXO_RING_INLINE_BYTES": "0"} if order == "ring" else {}),
            **({"CUDA_VISIBLE_DEVICES": str(r)} if args.gpu_per_stage else {})} for r in range(len(stages))]
    out = run_local_pipeline(path, stages, requests, warmup=True, stage_env=env)
    # Medians per step message: robust to the warm-up's first steps and to a shared machine's slow moments.
    medians = [{phase: 1e6 * statistics.median(link["samples"][phase] or [0.0]) for phase in PHASES}
               for link in out["links"]]
    leader = medians[-1]
    round_us = sum(leader.values())  # the leader's path around one round
    own_work = sum(m["send.work"] for m in medians)  # every stage's layers (the leader's: and sampling)
    tps = statistics.median(r["stats"]["decode_tokens_per_s"] for r in out["results"])
    stats = [r["stats"] for r in out["results"]]
    tokens_per_round = sum(s["completion_tokens"] for s in stats) / max(1, sum(sum(s["k_histogram"].values()) for s in stats))
    return {
        "stages": len(stages), "mode": mode, "order": order, "tokens_per_round": round(tokens_per_round, 3),
        "decode_tokens_per_s": round(tps, 2), "median_us": [{k: round(v, 1) for k, v in m.items()} for m in medians],
        "round_us": round(round_us, 1), "own_work_us": round(own_work, 1), "hop_us": round(round_us - own_work, 1),
        "one_node_round_us": round(1e6 * tokens_per_round / single["decode_tokens_per_s"], 1) if single else None,
    }


TRANSPORT_MEMBER = """
import json, statistics, sys, time
import mlx.core as mx
from exo.runner.group import join_group
rank, hosts, rows, hidden, dtype, work_ms, blocks = (int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3]),
                                                    int(sys.argv[4]), getattr(mx, sys.argv[5]), float(sys.argv[6]),
                                                    int(sys.argv[7]))
link = join_group(hosts, rank, timeout_s=60)
w = mx.random.normal((256, 256)) / 16  # the stand-in for a stage's layers: a fixed chain of small matmuls
z = mx.random.normal((1, 256))
x = mx.random.normal((1, rows, hidden)).astype(dtype)
mx.eval(w, z, x)
def work(x, n):
    h = z
    for _ in range(n):
        h = mx.tanh(h @ w)
    return x + h.sum().astype(x.dtype)  # the message depends on the work, as a stage's output does
n, t = 1, 0.0  # matmuls for about work_ms
while t < work_ms / 1000 and n < 1 << 16:
    n *= 2
    t0 = time.perf_counter(); mx.eval(work(x, n)); t = time.perf_counter() - t0
rounds = {"inline": [], "ring": []}
for block in range(blocks):  # alternating blocks: a slow moment of the machine hits both transports
    mode = "inline" if block % 2 == 0 else "ring"
    link.inline_bytes = 1 << 30 if mode == "inline" else 0
    for i in range(30):
        t0 = time.perf_counter()
        if rank == 0:
            y = work(x, n); mx.eval(y); link.send(y, 1); x = link.recv((1, rows, hidden), dtype, 1); mx.eval(x)
        else:
            x = link.recv((1, rows, hidden), dtype, 0); y = work(x, n); mx.eval(y); link.send(y, 0)
        if i >= 3:
            rounds[mode].append(time.perf_counter() - t0)
if rank == 0:
    print(json.dumps({m: 1e6 * statistics.median(v) for m, v in rounds.items()} | {"work_us": 1e6 * t}))
"""


def transport_ab(rows: int, hidden: int, dtype: str, work_ms: float, blocks: int) -> dict[str, Any]:
    """Two processes pass a [1, rows, hidden] message back and forth with ~work_ms of compute on each side,
    the message on the doorbell (inline) and on MLX's ring in alternating blocks: round p50 of each."""
    import subprocess

    from exo.runner.group import free_port

    hosts = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    argv = [str(rows), str(hidden), dtype, str(work_ms), str(blocks)]
    procs = [subprocess.Popen([sys.executable, "-c", TRANSPORT_MEMBER, str(rank), hosts, *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    if any(p.returncode for p in procs):
        raise RuntimeError("\n".join(err[-2000:] for _, err in outs))
    result = json.loads(outs[0][0])
    return {"rows": rows, "hidden": hidden, "dtype": dtype, "bytes": rows * hidden * (2 if "16" in dtype else 4),
            **{k: round(v, 1) for k, v in result.items()}, "inline_vs_ring": round(result["ring"] / result["inline"], 3)}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeats of one breakdown as one: every figure's median."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            out[key] = round(statistics.median(r[key] for r in runs), 2)
    out["median_us"] = [{phase: round(statistics.median(r["median_us"][rank][phase] for r in runs), 1) for phase in PHASES}
                        for rank in range(len(runs[0]["median_us"]))]
    out["repeats"] = len(runs)
    return out


def print_breakdown_header() -> None:
    print("\nhop breakdown: median microseconds per step message (EXO_PIPELINE_PHASES=1: receives timed apart; the "
          "last rank leads)\n  send: work (since its last message: layers, sampling) ready (evaluating what is sent) "
          "ring (the message's send) bell (the rung before a message on the ring)\n  recv: gap (since its last "
          "message) wait (asleep on the doorbell) ring (the message into an array)", flush=True)
    names = [p.replace("send.", "s.").replace("recv.", "r.") for p in PHASES]
    print(f"{'stages':>6} {'mode':>6} {'path':>6} {'rank':>4} " + " ".join(f"{n:>8}" for n in names), flush=True)


def print_breakdown_rows(b: dict[str, Any], label: str) -> None:
    for rank, m in enumerate(b["median_us"]):
        print(f"{b['stages']:>6} {b['mode']:>6} {b['order']:>6} {rank:>4} " + " ".join(f"{m[p]:>8.0f}" for p in PHASES))
    one = f"; one node {b['one_node_round_us']:.0f} us for as many tokens" if b["one_node_round_us"] else ""
    print(f"{'':>6} {b['mode']:>6} {b['order']:>6}   ({label}) round {b['round_us']:.0f} us = stages' work "
          f"{b['own_work_us']:.0f} + hops {b['hop_us']:.0f}{one} ({b['tokens_per_round']:.2f} tokens/round, "
          f"{b['decode_tokens_per_s']:.1f} tok/s traced)", flush=True)


def clients_axis(resolved: Any, counts: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """N concurrent streams through ``exo serve``: the model on one node, then over two, in this run."""
    homes = [tempfile.TemporaryDirectory(prefix="exo-bench-pipeline-") for _ in range(2)]
    ports = [(free_port(), free_port()) for _ in range(2)]
    model = str(resolved.path) if resolved.card is None else resolved.model_id
    processes = []
    saved = dict(os.environ)
    rows: list[dict[str, Any]] = []
    trace = os.path.join(homes[0].name, "device-trace")  # both daemons' runners (runner.device.DeviceTrace)
    try:
        os.environ["EXO_MAX_QUEUE"] = str(max(256, 4 * max(counts)))
        os.environ["EXO_DEVICE_TRACE"] = trace
        for i, (port, grpc_port) in enumerate(ports):
            if args.gpu_per_stage:
                os.environ["CUDA_VISIBLE_DEVICES"] = str(i)
            peers = f"127.0.0.1:{ports[0][1]}" if i else None
            processes.append(start_server(model, port, grpc_port, peers=peers, home=homes[i].name))
        url = f"http://127.0.0.1:{ports[0][0]}"
        asyncio.run(_wait_for_peer(url))
        for repeat in range(max(1, args.clients_repeats)):
            for placement in ("one node", "2 stages"):
                model_id = asyncio.run(_place(url, 2 if placement == "2 stages" else 1))
                asyncio.run(load_clients(url, 2, 3.0, args.max_tokens))  # warm
                for n in counts:
                    r = asyncio.run(load_clients(url, n, args.seconds, args.max_tokens, MODES_API[args.clients_mode]))
                    device = device_trace(trace, *r["window"])
                    rows.append({"placement": placement, "model": model_id, "clients": n, "completed": r["completed"],
                                 "errors": r["errors"], "ttft_p50_s": round(quantile(r["ttft"], 0.5), 3),
                                 "ttft_p99_s": round(quantile(r["ttft"], 0.99), 3), "tok_s": round(r["tok_s"], 2),
                                 "device": device, "repeat": repeat})
                    print(f"  clients: {placement} x {n} (repeat {repeat + 1}): {r['completed']} completed, "
                          f"{r['errors']} errors, {r['tok_s']:.1f} tok/s; {format_trace(device)}", file=sys.stderr,
                          flush=True)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(30)
            except Exception:  # noqa: BLE001 - a daemon that does not stop is killed
                process.kill()
        for home in homes:
            home.cleanup()
    for row in rows:
        same = [r for r in rows if r["repeat"] == row["repeat"]]
        one = next(r for r in same if r["placement"] == row["placement"] and r["clients"] == counts[0])
        row["vs_one_client"] = round(row["tok_s"] / one["tok_s"], 3) if one["tok_s"] else None
        node = next(r for r in same if r["placement"] == "one node" and r["clients"] == row["clients"])
        row["vs_one_node"] = round(row["tok_s"] / node["tok_s"], 3) if node["tok_s"] else None
    return rows


MODES_API: dict[str, dict[str, Any] | None] = {"plain": {"enabled": False}, "adaptive": None,
                                                **{f"k{k}": {"k": k} for k in range(1, 4)}}


async def _wait_for_peer(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(300):
            async with session.get(url + "/v1/cluster") as response:
                if len((await response.json())["nodes"]) >= 2:
                    return
            await asyncio.sleep(0.2)
    raise RuntimeError("the two daemons did not meet")


async def _place(url: str, nodes: int) -> str:
    """Remove every instance, then place the model on ``nodes`` nodes and wait until it is ready."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        async with session.get(url + "/v1/instances") as response:
            instances = (await response.json())["instances"]
        model_id = instances[0]["model"] if instances else None
        for inst in instances:
            async with session.delete(f"{url}/v1/instances/{inst['id']}") as response:
                await response.read()
        if model_id is None:
            async with session.get(url + "/v1/models") as response:
                model_id = (await response.json())["data"][0]["id"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the deleted instances leave every node's view
            async with session.get(url + "/v1/instances") as response:
                if not [i for i in (await response.json())["instances"] if i["state"] != "gone"]:
                    break
            await asyncio.sleep(0.3)
        body = {"model": model_id, "wait": True, **({"min_nodes": nodes} if nodes > 1 else {})}
        async with session.post(url + "/v1/instances", json=body) as response:
            if response.status != 201:
                raise RuntimeError(f"placing {model_id} on {nodes} node(s): {response.status} {await response.text()}")
            backend = (await response.json())["instance"].get("backend")
        if nodes > 1:  # (nccl: a pair of CUDA nodes, the collective wire; null: MLX's ring)
            print(f"  placed over {nodes} nodes, the group's backend: {backend or 'ring'}", file=sys.stderr, flush=True)
        return model_id


def print_clients(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nclients through exo serve ({args.max_tokens}-token streamed chat completions, {args.seconds:.0f} s per row, "
          f"native MTP {args.clients_mode}); ratios in this run")
    print(f"{'placement':>9} {'clients':>7} {'done':>5} {'errors':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s':>7} "
          f"{'vs 1 client':>11} {'vs one node':>11}")
    def ratio(value: float | None) -> str:  # (None: the row it compares with streamed nothing in its window)
        return f"{value:>10.2f}x" if value is not None else f"{'-':>11}"

    for r in rows:
        print(f"{r['placement']:>9} {r['clients']:>7} {r['completed']:>5} {r['errors']:>6} {r['ttft_p50_s']:>8.2f}s "
              f"{r['ttft_p99_s']:>8.2f}s {r['tok_s']:>7.1f} {ratio(r['vs_one_client'])} {ratio(r['vs_one_node'])}")
    repeats = len({r["repeat"] for r in rows})
    if repeats > 1:  # each ratio against its own repeat's, then the median over the repeats
        print(f"medians over the {repeats} repeats (each placed anew):")
        for placement in ("one node", "2 stages"):
            for n in sorted({r["clients"] for r in rows}):
                mine = [r for r in rows if r["placement"] == placement and r["clients"] == n]
                vs_node = [r["vs_one_node"] for r in mine if r["vs_one_node"] is not None]
                print(f"{placement:>9} {n:>7}  tok/s {statistics.median(r['tok_s'] for r in mine):7.1f}  TTFT p50 "
                      f"{statistics.median(r['ttft_p50_s'] for r in mine):.2f}s  vs one node "
                      f"{statistics.median(vs_node) if vs_node else float('nan'):.3f}x "
                      f"({', '.join(f'{v:.3f}' for v in vs_node)})")


if __name__ == "__main__":
    stop_on_signals()  # killed, it ends its stages and daemons (the finally blocks)
    sys.exit(main())
