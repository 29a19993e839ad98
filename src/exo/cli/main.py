"""The ``exo`` command line."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from exo import __version__
from exo.cli.common import EXIT_ERROR, EXIT_USAGE, CommandError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'24GiB', '512 MiB', '16GB', '1000000' -> bytes (argparse type)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use bytes, or a number with KiB, MiB, GiB, GB ...")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return value


def _add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="card id (see `exo models`), Hugging Face repo id, or a local checkpoint directory; "
        "omitted: the bundled demo model",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exo", description="Distributed LLM inference with native MTP, on MLX.")
    parser.add_argument("--version", action="version", version=f"exo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="generate a completion with one model on this machine")
    _add_model_argument(run)
    run.add_argument("--prompt", required=True, help="the prompt (a user message unless --raw)")
    run.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    run.add_argument("--system", default=None, help="a system message (chat template only)")
    run.add_argument("--max-tokens", type=int, default=256)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--min-p", type=float, default=0.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    run.add_argument(
        "--native-mtp",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: use the MTP head when there is one; on: require it; off: plain decoding",
    )
    run.add_argument("--mtp-k", type=int, default=None, help="force the draft depth K (0..8); default adaptive")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    bench = sub.add_parser("bench", help="plain vs native-MTP decoding at each depth, in one run")
    _add_model_argument(bench)
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable); default: built-in")
    bench.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.add_argument("--device", choices=("cpu", "gpu"), default=None,
                       help="MLX's device for the run (default: MLX's default, the GPU where there is one)")
    bench.add_argument(
        "--baseline", action="store_true",
        help="also decode each prompt with stock mlx-lm (plain) in the same round and print every configuration's ratio to it",
    )
    bench.add_argument(
        "--pairs", type=int, default=8,
        help="then N requests each of adaptive and the fastest fixed configuration in tight pairs (0: none)",
    )
    bench.add_argument(
        "--check", action="store_true",
        help="exit 1 unless, at temperature 0, every MTP configuration gave plain decoding's tokens (and, with "
             "--baseline, plain decoding gave stock mlx-lm's)",
    )

    convert = sub.add_parser(
        "convert", help="convert a checkpoint to MLX layout (optionally quantized), keeping its MTP head"
    )
    convert.add_argument("source", help="checkpoint directory (raw Hugging Face or MLX layout)")
    convert.add_argument("destination", help="new directory to write")
    convert.add_argument("--bits", type=int, default=None, choices=(2, 3, 4, 5, 6, 8), help="quantize the backbone")
    convert.add_argument("--group-size", type=int, default=64)
    convert.add_argument(
        "--head",
        choices=("in-shard", "sidecar", "drop"),
        default="in-shard",
        help="where the MTP head goes: inside the shards, a sidecar mtp.safetensors, or nowhere",
    )
    convert.add_argument("--quantize-head", action="store_true", help="quantize the head too (default: keep it)")

    pull = sub.add_parser(
        "pull", help="download a model into the Hugging Face cache and recover its stripped MTP head"
    )
    pull.add_argument("model", help="card id (see `exo models`) or Hugging Face repo id")
    pull.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    pull.add_argument(
        "--quantize-head", action="store_true", help="quantize a recovered head like the backbone (default: bf16)"
    )
    pull.add_argument("--no-head", action="store_true", help="do not recover a stripped MTP head")
    pull.add_argument("--json", action="store_true", help="print the result as one JSON object")

    models = sub.add_parser("models", help="list the models exo knows and which are on this machine")
    models.add_argument("--json", action="store_true")

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API on this machine")
    serve.add_argument("--host", default=None, help="address to listen on (default: settings api_host, 0.0.0.0)")
    serve.add_argument("--port", type=int, default=None, help="port (default: settings api_port, 52415)")
    serve.add_argument(
        "--model",
        default=None,
        help="load this model at start and make it the default (card id, repo id or directory); "
        "without it, models load when a request names them",
    )
    serve.add_argument(
        "--load-timeout",
        type=float,
        default=None,
        help="seconds a request waits for its model to load (default: the request timeout)",
    )
    serve.add_argument(
        "--max-loaded", type=int, default=1, help="on-demand models kept loaded on this node at once (default 1)"
    )
    serve.add_argument("--grpc-port", type=int, default=None, help="cluster (gRPC) port (default: settings grpc_port, 52416)")
    serve.add_argument(
        "--peers",
        default=None,
        help="static peers host:grpc_port,... for networks without multicast (default: EXO_PEERS)",
    )
    serve.add_argument(
        "--namespace", default=None, help="cluster namespace: only nodes of the same one join (default: EXO_NAMESPACE, default)"
    )
    serve.add_argument("--no-discovery", action="store_true", help="turn zeroconf discovery off (static peers only)")
    serve.add_argument("--name", default=None, help="this node's display name (default: the host name)")
    serve.add_argument(
        "--memory-budget", type=parse_bytes, default=None, metavar="SIZE",
        help="the most memory this node offers to models, e.g. 24GiB (default: EXO_MEMORY_BUDGET_BYTES, "
        "else what the OS has available)",
    )

    cluster = sub.add_parser("cluster", help="the nodes of the cluster as seen from this node's running daemon")
    cluster.add_argument("--url", default=None, help="the daemon's API (default http://127.0.0.1:<settings api_port>)")
    cluster.add_argument("--json", action="store_true", help="print GET /v1/cluster as it is")

    menubar = sub.add_parser(
        "menubar",
        help="the menu-bar app: exo's state, Native MTP, Start/Stop exo (a tray icon on Linux)",
        description="Flags after `--` go to `exo serve` when the app starts exo "
        "(e.g. exo menubar --start -- --model exo-demo).",
    )
    menubar.add_argument("--url", default=None, help="the daemon's API (default http://127.0.0.1:<settings api_port>)")
    menubar.add_argument("--start", action="store_true", help="start exo at launch unless one already answers")
    menubar.add_argument("--once", action="store_true", help="print the menu as text once and exit (no UI)")
    menubar.add_argument(
        "--text", action="store_true",
        help="the menu on this terminal, numbered: type an entry's number to run it (no tray icon)",
    )
    menubar.add_argument("--poll-interval", type=float, default=2.0, help="seconds between state refreshes")
    menubar.add_argument(
        "--stop-timeout", type=float, default=10.0, help="seconds Stop exo waits after SIGTERM before SIGKILL"
    )
    menubar.add_argument(
        "--start-timeout", type=float, default=120.0,
        help="seconds a starting exo may stay silent (its log not growing) before it counts as unreachable; "
        "one that loads its --model (before its port opens) stays starting",
    )
    menubar.add_argument("serve_args", nargs="*", metavar="SERVE_FLAG", help="flags for exo serve (after --)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from exo.cards import AmbiguousModelError, CardError, UnknownModelError
    from exo.downloads.errors import DownloadError, StageRangeError
    from exo.engine import (
        CheckpointError,
        GenerationRequestError,
        ModelNotAvailableError,
        NativeMTPUnavailableError,
        SamplingParamsError,
        UnsupportedModelError,
    )
    from exo.settings import SettingsError

    user_errors = (
        CommandError,
        AmbiguousModelError,
        DownloadError,
        StageRangeError,
        FileExistsError,
        CardError,
        CheckpointError,
        GenerationRequestError,
        ModelNotAvailableError,
        NativeMTPUnavailableError,
        SamplingParamsError,
        SettingsError,
        UnknownModelError,
        UnsupportedModelError,
    )
    try:
        if args.command == "run":
            from exo.cli.run import run_command

            return run_command(args)
        if args.command == "bench":
            from exo.cli.bench import bench_command

            return bench_command(args)
        if args.command == "convert":
            from exo.engine.convert import convert_checkpoint

            out = convert_checkpoint(
                args.source,
                args.destination,
                bits=args.bits,
                group_size=args.group_size,
                head=args.head,
                quantize_head_too=args.quantize_head,
            )
            print(out)
            return 0
        if args.command == "pull":
            from exo.cli.pull import pull_command

            return pull_command(args)
        if args.command == "models":
            from exo.cli.models import models_command

            return models_command(args)
        if args.command == "cluster":
            from exo.cli.cluster import cluster_command

            return cluster_command(args)
        if args.command == "serve":
            from exo.cli.serve import serve_command

            return serve_command(args)
        if args.command == "menubar":
            from exo.cli.menubar import menubar_command

            return menubar_command(args)
    except user_errors as e:
        message = e.args[0] if isinstance(e, LookupError) and e.args else str(e)
        print(f"exo: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return EXIT_USAGE


def entry() -> int:
    """The ``exo`` command (``[project.scripts]``): ``main`` in a process that never imports PyTorch
    (``exo.without_torch``)."""
    import exo

    exo.without_torch()
    return main()


if __name__ == "__main__":
    raise SystemExit(entry())
