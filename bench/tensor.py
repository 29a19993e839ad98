"""Tensor benchmark: tokens/s of one node vs a tensor group of N members (every layer's slice on each, joined by
all-reduces), MTP off and on, and what the collectives cost per token.

    python bench/tensor.py [MODEL] [--nodes 2] [--modes plain,k1,k2,k3] [--max-tokens 64] [--prompts 3]
                           [--repeats 2] [--gpu-per-node] [--backend ring|nccl] [--collective-reps 200] [--json]

Every configuration runs in fresh processes over loopback (exo.runner.local_pipeline: what a cluster's runners
run), the same prompts, greedy, EOS ignored so every generation is max-tokens long; repeats alternate one node
and the group, so a slow moment of the machine hits both. Phases, each printed as it is measured:

1. collectives: every member times its all-reduce alone before serving (median microseconds of one of a decode
   step's [1, 1, H] and of a 4-row verify call's, interleaved; the fastest run's), times the 2 x layers + 1 a
   token runs (two per layer, one for the step's ids): the collectives' share of a plain step of the group; and
   per all-reduce of a chain of that many in one evaluation (a step's graph, without its layers);
2. speed: decode tokens/s per mode, one node and the group, and the ratio (median over prompts and repeats);
3. identity: within the group, each MTP mode's greedy tokens against the group's plain ones (they must be
   equal: exit 1 otherwise); against one node, how many prompts give the same tokens and where the first
   differs (the sums of a layer's slices round in another order than one node's products: a rate, not a bug);
4. estimate: what placement's estimate (``placement.estimate_tokens_per_s``, what "auto" weighs) says of the two
   on this run's measured one-node speed and all-reduce, beside the measured ratio, and which "auto" takes.

``--gpu-per-node``: on a host with several CUDA GPUs, member i on GPU i (``CUDA_VISIBLE_DEVICES``) as separate
nodes would be, one node on GPU 0, the collectives over NCCL (``--backend``, default nccl then, else ring).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from mlx_lm.utils import load_tokenizer

from exo.engine import resolve_model
from exo.engine.loader import read_config
from exo.runner.local_pipeline import run_local_pipeline, run_local_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_arguments, report_to, stop_on_signals  # noqa: E402

MODES = {"plain": {"native_mtp": "off"}, "k1": {"mtp_k": 1}, "k2": {"mtp_k": 2}, "k3": {"mtp_k": 3},
         "adaptive": {}}
PROMPTS = ("def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
           "The history of the printing press", "SELECT name, count(*) FROM", "Once upon a time, in a city",
           "fn main() {\n    let", "# Notes on distributed inference\n\n")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where ``a`` and ``b`` differ (None: the same)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p, repeats=2, device=False)
    p.add_argument("--nodes", type=int, default=2, help="members of the tensor group")
    p.add_argument("--modes", default="plain,k1,k2,k3")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=3, help=f"prompts per mode (at most {len(PROMPTS)})")
    p.add_argument("--gpu-per-node", action="store_true",
                   help="a host with several CUDA GPUs: member i on GPU i, one node on GPU 0 (as separate nodes)")
    p.add_argument("--backend", choices=("ring", "nccl"), default=None,
                   help="the group's collectives (default: nccl with --gpu-per-node, else ring)")
    p.add_argument("--collective-reps", type=int, default=200, help="all-reduces timed alone per run")
    args = p.parse_args(argv)
    resolved = resolve_model(args.model)
    text = read_config(resolved.path)
    text = text.get("text_config", text)
    n_layers, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
    tokenizer = load_tokenizer(resolved.path)
    modes = args.modes.split(",")
    prompts = [tokenizer.encode(t) for t in PROMPTS[: args.prompts]]
    requests, keys = [], []
    for mode in modes:
        for i, prompt in enumerate(prompts):
            requests.append({"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True, **MODES[mode]})
            keys.append((mode, i))
    backend = args.backend or ("nccl" if args.gpu_per_node else "ring")
    member_env = [{"CUDA_VISIBLE_DEVICES": str(r)} for r in range(args.nodes)] if args.gpu_per_node else None
    single_env = [{"CUDA_VISIBLE_DEVICES": "0"}] if args.gpu_per_node else None
    runs: dict[str, list[dict[str, Any]]] = {"single": [], "tensor": []}
    collectives: list[dict[str, float]] = []
    with report_to(args.json) as report:
        report.update(model=str(resolved.model_id), nodes=args.nodes, backend=backend, layers=n_layers, hidden=hidden,
                      max_tokens=args.max_tokens, modes=modes, prompts=len(prompts))
        for repeat in range(args.repeats):
            for config in ("single", "tensor"):
                if config == "single":
                    out = run_local_pipeline(resolved.path, [(0, n_layers)], requests, warmup=True, stage_env=single_env,
                                             timeout_s=570)
                else:
                    out = run_local_tensor(resolved.path, args.nodes, requests, backend=backend, warmup=True,
                                           stage_env=member_env, collective_reps=args.collective_reps, timeout_s=570)
                    if out.get("collectives"):
                        collectives.append(out["collectives"])
                runs[config].append({key: r for key, r in zip(keys, out["results"], strict=True)})
                speed = statistics.median(r["stats"]["decode_tokens_per_s"] for r in out["results"])
                print(f"repeat {repeat + 1}/{args.repeats}: {config} done ({speed:.1f} tok/s median)", file=sys.stderr,
                      flush=True)

        def tps(config: str, mode: str) -> float:
            return statistics.median(run[(mode, i)]["stats"]["decode_tokens_per_s"] for run in runs[config]
                                     for i in range(len(prompts)))

        # 1. collectives
        if collectives:
            # Each run's median, the fastest run's: a run that shared its cores with other work measures that work.
            one = min(c["all_sum_1_row_us"] for c in collectives)
            four = min(c["all_sum_4_row_us"] for c in collectives)
            chained = [c["all_sum_chained_us"] for c in collectives if "all_sum_chained_us" in c]
            per_token_ms = (2 * n_layers + 1) * one / 1000
            step_ms = 1000 / tps("tensor", "plain") if "plain" in modes else None
            report["collectives"] = {"all_sum_1_row_us": round(one, 1), "all_sum_4_row_us": round(four, 1),
                                     "all_sum_chained_us": round(min(chained), 1) if chained else None,
                                     "per_token_ms": round(per_token_ms, 3),
                                     "tensor_plain_step_ms": round(step_ms, 3) if step_ms else None,
                                     "share_of_step": round(per_token_ms / step_ms, 3) if step_ms else None}
            print(f"\ncollectives ({backend}, {args.nodes} members): all-reduce of [1, 1, {hidden}] {one:.0f} us, of "
                  f"[1, 4, {hidden}] {four:.0f} us; x {2 * n_layers + 1} a token = {per_token_ms:.2f} ms"
                  + (f" of a {step_ms:.2f} ms plain step ({per_token_ms / step_ms:.0%})" if step_ms else ""))
            if chained:
                print(f"  chained, {2 * n_layers + 1} in one evaluation (as a step meets them, without its layers): "
                      f"{min(chained):.0f} us each, {min(chained) * (2 * n_layers + 1) / 1000:.2f} ms a token")
        # 2. speed
        print(f"\n{'mode':<9}{'one node':>12}{f'tensor x{args.nodes}':>12}{'ratio':>8}")
        report["speed"] = {}
        for mode in modes:
            single, tensor = tps("single", mode), tps("tensor", mode)
            report["speed"][mode] = {"single_tok_s": round(single, 2), "tensor_tok_s": round(tensor, 2),
                                     "ratio": round(tensor / single, 3)}
            print(f"{mode:<9}{single:>12.1f}{tensor:>12.1f}{tensor / single:>7.2f}x")
        # 3. identity
        exact = True
        print()
        if "plain" in modes:
            for mode in modes:
                if mode == "plain":
                    continue
                same = sum(run[(mode, i)]["token_ids"] == run[("plain", i)]["token_ids"]
                           for run in runs["tensor"] for i in range(len(prompts)))
                total = len(runs["tensor"]) * len(prompts)
                exact &= same == total
                report.setdefault("identity_within_group", {})[mode] = f"{same}/{total}"
                print(f"within the group: {mode} greedy = its plain greedy on {same}/{total}")
            firsts = [first_difference(runs["tensor"][0][("plain", i)]["token_ids"],
                                       runs["single"][0][("plain", i)]["token_ids"]) for i in range(len(prompts))]
            same = sum(f is None for f in firsts)
            report["against_one_node"] = {"same": same, "prompts": len(prompts), "first_difference": firsts}
            print(f"against one node (plain greedy, {args.max_tokens} tokens): {same}/{len(prompts)} prompts the same; "
                  f"first difference at token {[f for f in firsts if f is not None] or '-'}")
        # 4. what placement's estimate says of this split, from this run's measured one-node speed (its decode speed
        # in bytes a second, as a node's runners measure it) and all-reduce (a ring's link round trip)
        estimate = None
        if "plain" in modes:
            try:
                estimate = _estimate(resolved, tps("single", "plain"), args.nodes, backend,
                                     min(c["all_sum_1_row_us"] for c in collectives) if collectives else None)
            except (ImportError, RuntimeError) as e:  # the cluster's gRPC stubs want grpcio >= 1.85.1 (the GPU image's
                # is older: gpu_session's `grpc` phase installs it): the figures above stand without the estimate
                print(f"placement's estimate skipped: {type(e).__name__}: {e}")
        if estimate is not None:
            measured = tps("tensor", "plain") / tps("single", "plain")
            report["estimate"] = {**estimate, "measured_ratio": round(measured, 3)}
            print(f"placement's estimate: one node {estimate['single_tok_s']:.1f} tok/s, tensor x{args.nodes} "
                  f"{estimate['tensor_tok_s']:.1f} (ratio {estimate['ratio']:.2f}, measured {measured:.2f}): \"auto\" "
                  f"over {args.nodes} nodes would choose {estimate['auto']}")
        report["exact_within_group"] = exact
    if args.json:
        return 0 if exact else 1
    print(json.dumps({"exact_within_group": exact}))
    return 0 if exact else 1


def _estimate(resolved: Any, single_tok_s: float, nodes: int, backend: str, all_sum_us: float | None) -> dict[str, Any]:
    """``placement.estimate_tokens_per_s`` for one node and the tensor group on this host's measured figures."""
    from exo.cluster import placement as pl
    from exo.cluster.cluster_view import model_requirement
    from exo.cluster.models import availability

    req = model_requirement(resolved.model_id, resolved.card, [availability(resolved)])
    rate = single_tok_s * (req.active_bytes or req.weights_bytes)
    kind = "cuda" if backend == "nccl" else "cpu"
    capacities = [pl.NodeCapacity(f"n{i}", 1 << 50, 1 << 50, backend=kind, decode_bytes_per_s=rate) for i in range(nodes)]
    links = {(a.node_id, b.node_id): (all_sum_us or 1000.0) / 1000 for a in capacities for b in capacities if a != b}
    by_id = {c.node_id: c for c in capacities}
    single = pl.placement(req, capacities[:1])
    tensor = pl.placement(req, capacities, sharding="tensor", min_nodes=nodes, links=links,
                          tensor_backend=backend)
    one, many = pl.estimate_tokens_per_s(single, by_id, links)[0], pl.estimate_tokens_per_s(tensor, by_id, links)[0]
    # "auto" as a request for this many nodes gets it (on its own a model that fits one node stays there)
    auto = pl.placement(req, capacities, sharding="auto", min_nodes=nodes, links=links, tensor_backend=backend)
    return {"single_tok_s": round(one, 2), "tensor_tok_s": round(many, 2), "ratio": round(many / one, 3),
            "auto": auto.sharding, "collective": "nominal" if backend in pl.NOMINAL_COLLECTIVE_S else "measured"}


if __name__ == "__main__":
    stop_on_signals()  # killed, it ends its members (run_local_pipeline's finally)
    raise SystemExit(main())
