"""``python -m exo.runner``: one member of an instance's group of runners (one, or one per pipeline stage).

Lifecycle: serve Status on the unix socket at once (state LOADING with progress), load the model (a
pipeline stage: its layers) and warm it up on the main thread, then serve generations on the main thread
until SIGTERM. A pipeline stage first waits for its group's hosts (``JoinGroup``, from its daemon) and
joins the ring; the last stage then serves generations, the others serve steps until the leader shuts
the group down. A load that fails prints the reason to stderr and exits with ``EXIT_LOAD_FAILED``; a
stage whose group lost a member exits with ``EXIT_GROUP_LOST`` (``exo.wire.runner``); the daemon reports
either with the last stderr lines. The runner dies with its daemon (PR_SET_PDEATHSIG on Linux, and a
watcher of the parent pid everywhere), so a killed daemon never leaves runners behind.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exo.settings import Settings
    from exo.wire.proto_gen import node_pb2 as pb

    from .service import RunnerState


GRACEFUL_EXIT_S = 4.0  # after SIGTERM, a serving runner finishes within this (the daemon's grace is 5 s)


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
    p.add_argument("--group-id", default="")
    p.add_argument("--sharding", choices=("pipeline", "tensor"), default="pipeline",
                   help="a group's split: by layers, or a slice of every layer (tensor)")
    p.add_argument("--backend", choices=("ring", "nccl", "jaccl"), default="ring",
                   help="a tensor group's collectives, or a pipeline's group (MLX's distributed backend; nccl: "
                        "a pipeline of two on GPUs, its steps on the collective wire)")
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


def _take_sigterm(on_term: Callable[[], bool]) -> None:
    """SIGTERM on a thread of its own. A Python handler runs on the main thread only when that thread runs
    bytecode, and the kernel may hand a process's signal to any thread that does not block it: the main
    thread idle in a wait on a lock (the device's queue) is then never woken, and the runner sits out the
    daemon's grace. So every thread blocks SIGTERM (call this before any thread starts: they inherit the
    mask) and this one takes it with ``sigwait``. ``on_term()`` returns True when it began a graceful stop;
    False, or a second SIGTERM, ends the process as SIGTERM's default action does."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def take() -> None:
        graceful = False
        while True:
            signal.sigwait({signal.SIGTERM})
            if not graceful and on_term():
                graceful = True
                continue
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # the default action: the process ends

    threading.Thread(target=take, name="exo-runner-sigterm", daemon=True).start()


def prepare_process(settings: Settings) -> None:
    """What the runner's process sets before anything else runs: MLX's PTX cache (``use_ptx_cache``) and how long
    its threads wait for the GIL before the thread building graphs hands it over (``Settings.runner_switch_interval_s``
    says why)."""
    use_ptx_cache()
    sys.setswitchinterval(settings.runner_switch_interval_s)


def use_ptx_cache() -> None:
    """MLX CUDA compiles its JIT kernels (compiled graphs, its generated ops) at their first launch and keeps the
    PTX in ``MLX_PTX_CACHE_DIR`` (default: under the system's temporary folder, emptied by reboots): here beside
    exo's own compiled kernels (``system.kernel_dir()``: per machine, every EXO_HOME shares it; under each
    EXO_HOME, a fresh home's 9B server took 241 s to answer on an H200, compiling them all again), a folder per MLX
    version (its kernels' cache names do not change with its sources).
    A value set outside wins. MLX reads it at its first compile, after this."""
    from importlib.metadata import PackageNotFoundError, version

    from exo.system import kernel_dir  # (not the engine: it loads with the model, after Status serves)

    try:
        mlx = version("mlx")
    except PackageNotFoundError:  # (an MLX built from source, unregistered)
        mlx = "unknown"
    os.environ.setdefault("MLX_PTX_CACHE_DIR", str(kernel_dir() / "mlx-ptx" / mlx))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    stopping: list[Callable[[], bool]] = [lambda: False]  # until the device serves: SIGTERM ends us at once
    _take_sigterm(lambda: stopping[0]())
    _die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C goes to the daemon; it stops us
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s runner {args.instance_id[:8]} %(levelname)s: %(message)s")

    from exo.settings import load_settings
    from exo.wire.proto_gen import node_pb2 as pb
    from exo.wire.runner import EXIT_GROUP_LOST, EXIT_LOAD_FAILED

    from .device import Device
    from .group import free_port
    from .service import RunnerState, start_server

    settings = load_settings()
    prepare_process(settings)
    shard = pb.Shard(start_layer=args.start_layer, end_layer=args.end_layer, rank=args.rank, world_size=args.world_size,
                     sharding=args.sharding if args.world_size > 1 else "",
                     backend=args.backend if args.sharding == "tensor" else "")
    pipelined = args.world_size > 1
    # A pipeline stage's ring listener: chosen now, reported by Status, used once the group's hosts arrive.
    state = RunnerState(args.instance_id, shard, ring_port=free_port("0.0.0.0") if pipelined else 0)
    device = Device(settings.max_queue, max_batch=settings.max_batch, kv_budget_tokens=settings.kv_budget_tokens)
    server = start_server(args.socket, state, device, max_workers=settings.max_queue + 8,
                          stream_interval_s=settings.stream_interval_s)

    try:
        loaded, config, summary = _load(args, settings, state)
    except BaseException as e:  # noqa: BLE001 - reported to the daemon through stderr and the exit code
        message = str(e.args[0]) if isinstance(e, LookupError) and e.args else str(e)
        state.fail(f"{type(e).__name__}: {message}")
        traceback.print_exc(file=sys.stderr)
        print(f"exo runner: cannot load {args.model_id}: {type(e).__name__}: {message}", file=sys.stderr, flush=True)
        server.stop(0.2)
        os._exit(EXIT_LOAD_FAILED)
    log = logging.getLogger(__name__)
    if not pipelined:
        from .loading import ready_engine

        state.update("warming up", 0.75)
        started = time.perf_counter()
        engine = ready_engine(loaded, config, settings)  # (with the node's prefix cache: runner.prefix_store)
        log.info("warmed up in %.1f s (%s)", time.perf_counter() - started, _seconds(engine.warmup_seconds))
        from ..engine.models import compiled_layers

        # what this load's device checks chose, and whether its decoder layers run as compiled calls
        log.info("kernels: %s; compiled layers: %s", loaded.kernels(), compiled_layers.describe())
        state.decode_bytes_per_s = _decode_rate(engine)
        state.ready(summary, engine)
        log.info("ready: %s", args.model_id)
        stopping[0] = _close_on_term(device)
        device.serve()  # until SIGTERM
        _close_prefix_cache(engine)
        _exit(server, 0)
    try:
        secret = settings.cluster_secret.get_secret_value() if settings.cluster_secret else None
        serve = _serve_tensor if args.sharding == "tensor" else _serve_stage
        code = serve(args, state, device, loaded, config, summary, stopping, secret, settings)
    except Exception as e:  # noqa: BLE001 - a lost member (or a bug) ends this member of the group
        state.fail(f"{type(e).__name__}: {e}")
        what = "tensor group member" if args.sharding == "tensor" else "pipeline stage"
        print(f"exo runner: {what} {args.rank} of {args.model_id} left its group: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        code = EXIT_GROUP_LOST
    _exit(server, code)


def _close_prefix_cache(engine: Any) -> None:
    """Let the disk tier finish its writes (what the next start restores from)."""
    cache = engine.prefix_cache
    if cache is not None and hasattr(cache.store, "close"):
        cache.store.close()


def _close_on_term(device: Any) -> Callable[[], bool]:
    """SIGTERM while the device serves: finish gracefully (the running generation is cancelled between
    steps, the queued ones are told why), and end the process anyway if that takes too long."""

    def close() -> bool:
        device.close()
        deadline = threading.Timer(GRACEFUL_EXIT_S, os._exit, args=(128 + signal.SIGTERM,))
        deadline.daemon = True
        deadline.start()
        return True

    return close


def _exit(server: object, code: int) -> None:
    server.stop(1.0).wait(2.0)  # type: ignore[attr-defined]
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: nothing to flush, and MLX's thread-exit hooks stay out of it


def _serve_stage(args: argparse.Namespace, state: RunnerState, device: object, loaded: object, config: object,
                 summary: pb.ModelSummary, stopping: list[Callable[[], bool]], secret: str | None,
                 settings: Any) -> int:
    """A pipeline stage: join the group, then lead (the last stage: generations through the Runner service)
    or serve steps (the others). Returns the exit status."""
    from exo.downloads.heads import PENDING_SIDECAR, check_pending_head
    from exo.engine import Engine
    from exo.engine.pipeline import WIRE_NAMES, PipelineForward, StageSpec, serve_stage

    from .group import DOORBELL_ONLY, JOIN_TIMEOUT_S, join_group, watch_hangups

    log = logging.getLogger(__name__)
    stage = StageSpec(args.rank, args.world_size, args.start_layer, args.end_layer)
    state.update("waiting for the other stages", 0.7)
    hosts = state.wait_for_hosts(JOIN_TIMEOUT_S)
    state.update("joining the group", 0.72)
    # every member proves the cluster's secret; a group over NCCL carries its host messages on the doorbells
    link = join_group(hosts, args.rank, secret=secret, backend=args.backend,
                      inline_bytes=None if args.backend == "ring" else DOORBELL_ONLY)
    if args.backend != "ring":  # NCCL waits for a lost member without end: its closed doorbell ends us
        from exo.wire.runner import EXIT_GROUP_LOST

        def lost() -> None:
            print(f"exo runner: a stage of the pipeline of {args.model_id} left", file=sys.stderr, flush=True)
            os._exit(EXIT_GROUP_LOST)

        watch_hangups(link, lost)
    log.info("stage %d of %d (layers %d-%d, %s) joined %s", stage.rank, stage.world_size, stage.start_layer,
             stage.end_layer - 1, args.backend, ",".join(hosts))
    layers = (stage.start_layer, stage.end_layer)
    if not stage.last:
        from .loading import stage_memory, stage_prefix_cache

        loaded.model.set_gdn_prefill(config.gdn_prefill)  # type: ignore[attr-defined]  # (no Engine here sets it)
        reserve, room = stage_memory(loaded, settings, batch_room=True)  # type: ignore[arg-type]
        prefix_cache = stage_prefix_cache(loaded, settings, layers, reserve)  # type: ignore[arg-type]
        state.ready(summary, None)  # blocked in a receive until the leader shuts down: SIGTERM ends us at once
        try:
            serve_stage(loaded.model, stage, link, prefix_cache=prefix_cache,  # type: ignore[attr-defined]
                        states_room=room > 0)
        finally:
            if prefix_cache is not None and hasattr(prefix_cache.store, "close"):
                prefix_cache.store.close()
        log.info("the group was shut down")
        return 0
    forward = PipelineForward(loaded.model, stage, link)  # the engine sets its verify mode (its probe)
    if (loaded.path / PENDING_SIDECAR).is_file():  # type: ignore[attr-defined]
        # A head recovered for this stage: its agreement is measured here, through the pipeline.
        state.update("checking the recovered MTP head", 0.73)
        loaded = check_pending_head(loaded, forward)  # type: ignore[arg-type]
        head_status = loaded.head_status
        summary.mtp_available = head_status.available
        summary.mtp_reason = "" if head_status.available else (head_status.reason or "no MTP head")
    engine = Engine(loaded, config, forward=forward)  # type: ignore[arg-type]
    state.update("warming up", 0.75)
    started = time.perf_counter()
    engine.warmup()
    logging.getLogger(__name__).info("warmed up in %.1f s (%s)", time.perf_counter() - started,
                                     _seconds(engine.warmup_seconds))
    from .loading import attach_prefix_cache, set_state_room

    set_state_room(engine, settings)  # room for a full batch's states on this stage (the others say theirs)
    attach_prefix_cache(engine, settings, layers)  # each stage restores its own layers' part (engine/prefix_cache.py)
    state.ready(summary, engine)
    log.info("ready: %s, leading a pipeline of %d stages (its steps on the %s wire)", args.model_id, stage.world_size,
             WIRE_NAMES[forward.wire])
    return _lead(engine, state, device, forward, stopping)


def _decode_rate(engine: Any) -> float:
    """The node's measured decode speed (weight bytes a plain step reads per second), for placement's estimates;
    0 when it could not be measured (the instance serves all the same)."""
    from exo.engine.costs import decode_bytes_per_s

    try:
        costs = engine.costs() if engine.mtp_unavailable_reason() is None else None  # (the warm-up's, measured)
        return decode_bytes_per_s(engine.model, engine.forward, costs)
    except Exception:  # noqa: BLE001 - a figure for estimates, never a reason not to serve
        logging.getLogger(__name__).exception("measuring the decode speed failed")
        return 0.0


def _serve_tensor(args: argparse.Namespace, state: RunnerState, device: object, loaded: Any, config: object,
                  summary: pb.ModelSummary, stopping: list[Callable[[], bool]], secret: str | None,
                  settings: Any) -> int:
    """A member of a tensor group: join it (its slice is loaded already; the group's collectives go over
    ``args.backend``), then lead (the last member: generations through the Runner service) or run the leader's
    steps on its slice (the others). Returns the exit status."""
    from exo.downloads.heads import PENDING_SIDECAR, check_pending_head
    from exo.engine import Engine
    from exo.engine.pipeline import StageSpec
    from exo.engine.tensor import TensorForward, serve_tensor
    from exo.wire.runner import EXIT_GROUP_LOST

    from .group import DOORBELL_ONLY, JOIN_TIMEOUT_S, join_group, watch_hangups
    from .loading import attach_prefix_cache, stage_memory, stage_prefix_cache

    log = logging.getLogger(__name__)
    member = StageSpec(args.rank, args.world_size, 0, loaded.model.num_layers)
    state.update("waiting for the other members", 0.7)
    hosts = state.wait_for_hosts(JOIN_TIMEOUT_S)
    state.update("joining the group", 0.72)
    link = join_group(hosts, args.rank, secret=secret, backend=args.backend, inline_bytes=DOORBELL_ONLY)
    loaded.model.tensor_share.group = link.group
    if args.backend != "ring":  # NCCL and JACCL wait for a lost member without end: its closed doorbell ends us
        def lost() -> None:
            print(f"exo runner: a member of the tensor group of {args.model_id} left", file=sys.stderr, flush=True)
            os._exit(EXIT_GROUP_LOST)

        watch_hangups(link, lost)
    log.info("tensor member %d of %d (%s) joined %s", member.rank, member.world_size, args.backend, ",".join(hosts))
    if not member.last:
        prefix_cache = stage_prefix_cache(loaded, settings, None, stage_memory(loaded, settings, batch_room=False)[0])
        state.ready(summary, None)  # in a receive until the leader shuts down: SIGTERM ends us at once
        try:
            serve_tensor(loaded.model, member, link, prefix_cache=prefix_cache)
        finally:
            if prefix_cache is not None and hasattr(prefix_cache.store, "close"):
                prefix_cache.store.close()
        log.info("the group was shut down")
        return 0
    forward = TensorForward(loaded.model, member, link)  # the engine sets its verify mode (its probe)
    if (loaded.path / PENDING_SIDECAR).is_file():  # a head recovered here: its agreement measured through the group
        state.update("checking the recovered MTP head", 0.73)
        loaded = check_pending_head(loaded, forward)
        summary.mtp_available = loaded.head_status.available
        summary.mtp_reason = "" if loaded.head_status.available else (loaded.head_status.reason or "no MTP head")
    engine = Engine(loaded, config, forward=forward)  # type: ignore[arg-type]
    state.update("warming up", 0.75)
    started = time.perf_counter()
    engine.warmup()
    logging.getLogger(__name__).info("warmed up in %.1f s (%s)", time.perf_counter() - started,
                                     _seconds(engine.warmup_seconds))
    attach_prefix_cache(engine, settings)  # each member restores its own slice's part (its namespace)
    state.ready(summary, engine)
    log.info("ready: %s, leading a tensor group of %d", args.model_id, member.world_size)
    return _lead(engine, state, device, forward, stopping)


def _lead(engine: Any, state: RunnerState, device: Any, forward: Any, stopping: list[Any]) -> int:
    """A group's leader serves until SIGTERM or a generation that broke the group, then ends the group: with a
    shutdown message when its members are in step, else ``EXIT_GROUP_LOST`` (no message: they may be mid-step)."""
    from exo.wire.runner import EXIT_GROUP_LOST

    stopping[0] = _close_on_term(device)
    device.serve()
    _close_prefix_cache(engine)
    if state.group_broken or forward.broken is not None:
        return EXIT_GROUP_LOST
    try:
        forward.shutdown()
    except Exception:  # noqa: BLE001 - the others are gone already
        pass
    return 0


def _load(args: argparse.Namespace, settings: Settings, state: RunnerState) -> tuple[Any, Any, pb.ModelSummary]:
    # Status already serves (the server needs none of this): the engine's imports take seconds.
    state.update("importing the engine", 0.02)
    from exo.cards import load_catalog
    from exo.engine import ResolvedModel
    from exo.engine.memory import limit_buffer_cache
    from exo.wire.proto_gen import node_pb2 as pb

    from .loading import load_for_serving

    cache_bytes = limit_buffer_cache(settings.mlx_cache_bytes)  # (MLX's default otherwise: engine/memory.py)
    if cache_bytes is not None:
        logging.getLogger(__name__).info("MLX's buffer cache: at most %d MiB", cache_bytes >> 20)
    state.update("resolving", 0.05)
    card = load_catalog(home=settings.home).get(args.card) if args.card else None
    resolved = ResolvedModel(Path(args.model_path), args.model_id, card)
    state.update("loading weights", 0.1)
    tensor = args.world_size > 1 and args.sharding == "tensor"
    layers = (args.start_layer, args.end_layer) if args.world_size > 1 and not tensor else None
    share = None
    if tensor:
        from exo.engine.sharding import TensorShare, member_process_settings

        changed = member_process_settings()  # (before the process's first evaluation)
        if changed:
            logging.getLogger(__name__).info("a tensor member: %s", ", ".join(f"{k}={v}" for k, v in changed.items()))
        share = TensorShare(None, args.rank, args.world_size)  # its group once joined (the slices need none)
    loaded, config = load_for_serving(resolved, settings, layers=layers, tensor=share)
    logging.getLogger(__name__).info("loaded %s in %.1f s (%s)", resolved.model_id, sum(loaded.load_seconds.values()),
                                     _seconds(loaded.load_seconds))
    n_layers = loaded.model.num_layers
    if (args.world_size == 1 or tensor) and (args.start_layer, args.end_layer) not in ((0, 0), (0, n_layers)):
        raise ValueError(f"layers [{args.start_layer}, {args.end_layer}) of {n_layers} on a single runner")
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
    return loaded, config, summary


def _seconds(parts: dict[str, float]) -> str:
    """A load's or warm-up's seconds per part, for the log (MLX CUDA compiles kernels in them on a first start)."""
    return ", ".join(f"{name} {value:.1f} s" for name, value in parts.items() if value >= 0.05) or "-"
