"""``python -m exo.runner``: one member of an instance's group of runners (world_size 1 today).

Lifecycle: serve Status on the unix socket at once (state LOADING with progress), load the model and
warm it up on the main thread, then serve generations on the main thread until SIGTERM. A load that
fails prints the reason to stderr and exits with status ``EXIT_LOAD_FAILED`` (``exo.wire.runner``); the daemon reports it
with the last stderr lines. The runner dies with its daemon (PR_SET_PDEATHSIG on Linux, and a watcher
of the parent pid everywhere), so a killed daemon never leaves runners behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exo.engine import Engine
    from exo.settings import Settings
    from exo.wire.proto_gen import node_pb2 as pb

    from .service import RunnerState



def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m exo.runner", description="an exo runner (started by exo serve)")
    p.add_argument("--instance-id", required=True)
    p.add_argument("--socket", required=True, help="unix socket path to serve the Runner service on")
    p.add_argument("--model-path", required=True, help="the checkpoint directory")
    p.add_argument("--model-id", required=True)
    p.add_argument("--card", default=None, help="the model card id, when the model has one")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--start-layer", type=int, default=0)
    p.add_argument("--end-layer", type=int, default=0)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    return p.parse_args(argv)


def _die_with_parent(parent_pid: int | None) -> None:
    if parent_pid is None:
        return
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="exo-runner-parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    _die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C goes to the daemon; it stops us
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s runner {args.instance_id[:8]} %(levelname)s: %(message)s")

    from exo.settings import load_settings
    from exo.wire.proto_gen import node_pb2 as pb
    from exo.wire.runner import EXIT_LOAD_FAILED

    from .device import Device
    from .service import RunnerState, start_server

    settings = load_settings()
    shard = pb.Shard(start_layer=args.start_layer, end_layer=args.end_layer, rank=args.rank, world_size=args.world_size)
    state = RunnerState(args.instance_id, shard)
    device = Device(settings.max_queue)
    server = start_server(args.socket, state, device, max_workers=settings.max_queue + 8)

    def on_term(signum: int, frame: object) -> None:
        if state.state != pb.INSTANCE_STATE_READY:
            os._exit(128 + signum)  # mid-load: nothing to finish
        device.close()

    signal.signal(signal.SIGTERM, on_term)
    try:
        engine, summary = _load(args, settings, state)
    except BaseException as e:  # noqa: BLE001 - reported to the daemon through stderr and the exit code
        message = str(e.args[0]) if isinstance(e, LookupError) and e.args else str(e)
        state.fail(f"{type(e).__name__}: {message}")
        traceback.print_exc(file=sys.stderr)
        print(f"exo runner: cannot load {args.model_id}: {type(e).__name__}: {message}", file=sys.stderr, flush=True)
        server.stop(0.2)
        os._exit(EXIT_LOAD_FAILED)
    state.ready(summary, engine)
    logging.getLogger(__name__).info("ready: %s", args.model_id)
    device.serve()  # until SIGTERM
    server.stop(1.0).wait(2.0)
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: nothing to flush, and MLX's thread-exit hooks stay out of it


def _load(args: argparse.Namespace, settings: Settings, state: RunnerState) -> tuple[Engine, pb.ModelSummary]:
    if args.world_size != 1 or args.rank != 0 or args.start_layer != 0:
        raise NotImplementedError(
            "sharded instances (a layer range, world_size > 1) need the pipeline runtime, which is not built yet"
        )
    # Status already serves (the server needs none of this): the engine's imports take seconds.
    state.update("importing the engine", 0.02)
    from exo.cards import load_catalog
    from exo.engine import Engine, ResolvedModel, engine_config, load_checkpoint
    from exo.wire.proto_gen import node_pb2 as pb

    state.update("resolving", 0.05)
    card = load_catalog(home=settings.home).get(args.card) if args.card else None
    resolved = ResolvedModel(Path(args.model_path), args.model_id, card)
    state.update("loading weights", 0.1)
    config = engine_config(resolved, settings)
    loaded = load_checkpoint(resolved.path, model_id=resolved.model_id, head_source_repo=resolved.head_source_repo)
    text_config = loaded.config.get("text_config", loaded.config)
    n_layers = int(text_config.get("num_hidden_layers") or 0)
    if args.end_layer not in (0, n_layers):
        raise NotImplementedError(
            f"layers [{args.start_layer}, {args.end_layer}) of {n_layers}: a partial model needs the pipeline "
            "runtime, which is not built yet"
        )
    state.update("warming up", 0.75)
    engine = Engine(loaded, config)
    engine.warmup()  # adaptive depth's cost measurement, once, here rather than in the first request
    owner = "local"
    if card is not None:
        owner = "exo" if card.bundled else (card.repo.split("/", 1)[0] if card.repo else "exo")
    summary = pb.ModelSummary(
        model_id=resolved.model_id,
        name=card.name if card else resolved.model_id,
        arch=card.arch if card else str(loaded.config.get("model_type", "")),
        context_length=loaded.context_length or 0,
        mtp_available=loaded.head is not None,
        mtp_reason="" if loaded.head is not None else (loaded.head_status.reason or "no MTP head"),
        default_k=resolved.default_k,
        max_k=resolved.max_k,
        owned_by=owner,
    )
    return engine, summary
