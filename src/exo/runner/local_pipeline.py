"""A pipeline of stages (or a tensor group) on this machine, one process per member over loopback: no daemons.

For tests and benchmarks (``exo bench --stages N``, ``bench/pipeline.py``): the same stage runtime a
cluster runs (``load_checkpoint(layers=...)``, ``join_group``, ``serve_stage`` / ``PipelineForward``),
without the control plane around it.

    results = run_local_pipeline(model_dir, [(0, 4), (4, 8)], [{"prompt": [1, 2, 3], "max_tokens": 16}])

``model``: one directory for every stage, or one per stage (each "node" with its own partial snapshot).

Each request: {"prompt": [ids], "max_tokens": n, "mtp_k": k | None, "native_mtp": "auto" | "on" | "off",
"sampling": {...}, "stop": str, "ignore_eos": bool, "constraint": ConstraintSpec JSON, "logprobs": n}; each
result: {"token_ids", "text", "finish_reason", "stats", "seconds", "bytes_sent", "bytes_received",
"logprobs": [[token, logprob, [[token, logprob], ...]], ...]} (bytes: the leader's stage, both ways). A request
{"batch": [request, ...], "join_at": [step, ...]} decodes its requests in one batch (``BatchDecoder``, as the
device queue does), request i joining before the batch's step join_at[i]; its result is the list of theirs. With
"together": true the requests joining at one step whose whole prompt can go (``SequenceState.whole_prompt_in``)
prefill as rows of one call (``engine.batch_prefill``, as the serving scheduler admits newcomers), and each
result's "together" says whether it did.
``prefix_cache``: {"block_tokens": n, "min_snapshot_tokens": m} gives every member a prefix cache in memory;
``out["prefix"]`` then holds each member's figures (``PrefixStats``), the leader's last. ``collective_reps``: a tensor
group first times its all-reduce alone (``out["collectives"]``, bench/tensor.py). ``out["wire"]``: how the
pipeline's steps crossed its stages ("graph" or "host": ``EXO_PIPELINE_WIRE`` in ``stage_env``).
``out["compiled_layers"]``: how many compiled functions the leader's layers traced (``models.compiled_layers``);
``out["cuda_graphs"]``: the leader's ``MLX_USE_CUDA_GRAPHS`` (a tensor member's is "0": ``sharding.
member_process_settings``). A single
stage [(0, n)] runs the model whole in one process, for comparisons. ``links``: every stage's
``RingLink.report()`` (where its time went, per phase, over the whole run; ``EXO_PIPELINE_PHASES=1`` in a
stage's environment times the ring's receives apart).

The members end with the process that started them: ``run_local_pipeline`` kills them when it returns or raises
(Ctrl-C included), and a member whose starter was killed outright ends itself (``_end_with``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .group import free_port

PARENT_POLL_S = 0.5  # how often a member looks whether the process that started it is still there


class LocalPipelineError(RuntimeError):
    """A stage process failed; the message carries its stderr."""


def run_local_tensor(model: str | Path, nodes: int, requests: list[dict[str, Any]], *, backend: str = "ring",
                     **options: Any) -> dict[str, Any]:
    """Run ``requests`` on a tensor group of ``nodes`` members on this machine (one process each, the last leads;
    ``engine/tensor.py``): the same results as ``run_local_pipeline``. ``backend``: MLX's distributed backend
    (``ring``; ``nccl`` on a host with a GPU per member: give each its ``CUDA_VISIBLE_DEVICES`` in ``stage_env``)."""
    return run_local_pipeline(model, [(0, 0)] * nodes, requests, sharding="tensor", backend=backend, **options)


def run_local_pipeline(
    model: str | Path | Sequence[str | Path], stages: Sequence[tuple[int, int]], requests: list[dict[str, Any]], *,
    prefill_chunk: int = 2048, warmup: bool = False, timeout_s: float = 300.0,
    stage_env: Sequence[dict[str, str]] | None = None, sharding: str = "pipeline", backend: str = "ring",
    prefix_cache: dict[str, int] | None = None, collective_reps: int = 0,
) -> dict[str, Any]:
    """Run ``requests`` on a pipeline of ``stages`` (one process each); the leader's results and the bytes
    its stage sent and received. ``stage_env``: environment variables per stage, over this process's (on a
    host with several GPUs, ``CUDA_VISIBLE_DEVICES`` puts each stage on its own, as separate nodes would be).
    ``sharding`` "tensor": the stages are a tensor group's members instead (their layer ranges unused).
    ``timeout_s``: the whole run's limit; past it every stage is killed and ``LocalPipelineError`` carries what
    each wrote (``EXO_STAGE_TRACEBACK_S=N`` in ``stage_env``: each dumps its main thread's stack after N seconds)."""
    if stage_env is not None and len(stage_env) != len(stages):
        raise ValueError(f"{len(stage_env)} stage environments for {len(stages)} stages")
    with tempfile.TemporaryDirectory(prefix="exo-local-pipeline-") as tmp:
        models = [str(model)] * len(stages) if isinstance(model, (str, Path)) else [str(m) for m in model]
        if len(models) != len(stages):
            raise ValueError(f"{len(models)} model directories for {len(stages)} stages")
        spec = {
            "models": models, "stages": [list(s) for s in stages],
            "hosts": [f"127.0.0.1:{free_port()}" for _ in stages], "prefill_chunk": prefill_chunk,
            "warmup": warmup, "requests": requests, "out": str(Path(tmp) / "out.json"), "sharding": sharding,
            "backend": backend, "prefix_cache": prefix_cache, "collective_reps": collective_reps,
        }
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        procs = [
            subprocess.Popen([sys.executable, "-m", "exo.runner.local_pipeline", str(spec_file), str(rank), str(os.getpid())],
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **stage_env[rank]} if stage_env is not None else None)
            for rank in range(len(stages))
        ]
        deadline = time.monotonic() + timeout_s
        try:
            errors = [p.communicate(timeout=max(0.0, deadline - time.monotonic()))[1] for p in procs]
        except subprocess.TimeoutExpired:
            # Stuck (a stage waits for another) or slow: what every stage wrote, its tracebacks included where
            # EXO_STAGE_TRACEBACK_S (``traceback_s``) had each dump its main thread's stack before the limit.
            for p in procs:
                p.kill()
            errors = [p.communicate()[1] or "" for p in procs]
            raise LocalPipelineError(f"the pipeline's stages did not finish within {timeout_s:.0f} s:\n" + "\n".join(
                f"stage {i}: {e[-6000:]}" for i, e in enumerate(errors) if e)) from None
        finally:
            for p in procs:
                p.kill()
        if any(p.returncode != 0 for p in procs):
            raise LocalPipelineError("\n".join(f"stage {i}: {e[-3000:]}" for i, e in enumerate(errors) if e))
        out = json.loads(Path(spec["out"]).read_text())
        for rank in range(len(stages) - 1):  # the other stages' link reports (bench/pipeline.py's hop breakdown)
            report = Path(f"{spec['out']}.link{rank}.json")
            if report.is_file():
                out["links"].append(json.loads(report.read_text()))
        out["links"].sort(key=lambda r: r["rank"])
        figures = [Path(f"{spec['out']}.prefix{rank}.json") for rank in range(len(stages) - 1)]
        if prefix_cache is not None:
            out["prefix"] = [json.loads(f.read_text()) for f in figures if f.is_file()] + out["prefix"]
        return out


def _stage_main(spec_file: str, rank: int) -> None:
    spec = json.loads(Path(spec_file).read_text())
    from exo.downloads.heads import check_pending_head
    from exo.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, load_checkpoint
    from exo.engine.constraints import ConstraintSpec, compile_grammar
    from exo.engine.models import compiled_layers
    from exo.engine.pipeline import WIRE_NAMES, PipelineForward, StageSpec, serve_stage
    from exo.engine.prompt import prompt_tool_format

    from .group import DOORBELL_ONLY, join_group

    stages = spec["stages"]
    start, end = stages[rank]
    prefix_cache = None

    def with_prefix_cache(loaded: Any) -> Any:
        nonlocal prefix_cache
        if spec.get("prefix_cache") is not None:
            from exo.engine import prefix_cache as pc

            starts = pc.message_starts(loaded.tokenizer) if loaded.tokenizer is not None else frozenset()
            prefix_cache = pc.PrefixCache(pc.MemoryStore(1 << 30), pc.namespace(loaded, (start, end) if len(stages) > 1
                                                                                 and spec.get("sharding") != "tensor" else None),
                                          stride_tokens=0, message_starts=starts, **spec["prefix_cache"])
        return prefix_cache

    def prefix_figures(rank: int) -> None:
        if prefix_cache is not None:
            Path(f"{spec['out']}.prefix{rank}.json").write_text(json.dumps(dataclasses.asdict(prefix_cache.stats)))

    config = EngineConfig(prefill_chunk=spec.get("prefill_chunk", 2048))
    forward = None
    collectives = None
    model = spec["models"][rank]
    if spec.get("sharding") == "tensor":
        from exo.engine.sharding import TensorShare, member_process_settings
        from exo.engine.tensor import TensorForward, serve_tensor

        member_process_settings()  # (before the process's first evaluation)
        share = TensorShare(None, rank, len(stages))
        loaded = load_checkpoint(model, tensor=share)  # this member's slices (the group is not needed to cut them)
        link = join_group(spec["hosts"], rank, secret=os.environ.get("EXO_CLUSTER_SECRET") or None,
                          backend=spec.get("backend", "ring"), inline_bytes=DOORBELL_ONLY)
        share.group = link.group
        member = StageSpec(rank, len(stages), 0, loaded.model.num_layers)
        collectives = _time_collectives(loaded.model, spec.get("collective_reps", 0))  # (every member, in step)
        if not member.last:
            serve_tensor(loaded.model, member, link, prefix_cache=with_prefix_cache(loaded))
            Path(f"{spec['out']}.link{rank}.json").write_text(json.dumps(link.report()))
            prefix_figures(rank)
            return
        forward = TensorForward(loaded.model, member, link)
    elif len(stages) == 1:
        loaded = load_checkpoint(model)
    else:
        stage = StageSpec(rank, len(stages), start, end)
        loaded = load_checkpoint(model, layers=(start, end))
        backend = spec.get("backend", "ring")  # (nccl: the collective wire's group of two, its host messages on doorbells)
        link = join_group(spec["hosts"], rank, secret=os.environ.get("EXO_CLUSTER_SECRET") or None, backend=backend,
                          inline_bytes=None if backend == "ring" else DOORBELL_ONLY)
        if not stage.last:
            serve_stage(loaded.model, stage, link, prefix_cache=with_prefix_cache(loaded))
            Path(f"{spec['out']}.link{rank}.json").write_text(json.dumps(link.report()))
            prefix_figures(rank)
            return
        forward = PipelineForward(loaded.model, stage, link)
        loaded = check_pending_head(loaded, forward)  # a head recovered for this stage, checked on the pipeline
    engine = Engine(loaded, config, forward=forward)
    engine.prefix_cache = with_prefix_cache(loaded)

    def request_of(req: dict[str, Any]) -> GenerationRequest:
        grammar = None
        if req.get("constraint"):  # a ConstraintSpec as JSON, compiled here as a runner would
            grammar = compile_grammar(ConstraintSpec.from_json(req["constraint"]), engine.grammar_tokenizer,
                                      engine.vocab_size, prompt_tool_format(loaded.tokenizer), engine.closing_tokens)
        return GenerationRequest(
            req["prompt"], max_tokens=req["max_tokens"], mtp_k=req.get("mtp_k"),
            native_mtp=req.get("native_mtp", "auto"), sampling=SamplingParams(**req.get("sampling", {})),
            stop=[req["stop"]] if req.get("stop") else (), constraint=grammar, logprobs=req.get("logprobs"),
        )

    results: list[Any] = []
    try:
        if spec.get("warmup"):
            engine.warmup()
        for req in spec["requests"]:
            ignore_eos = req.get("ignore_eos") or any(r.get("ignore_eos") for r in req.get("batch", ()))
            engine.loaded = dataclasses.replace(loaded, eos_token_ids=frozenset()) if ignore_eos else loaded
            started = time.perf_counter()
            before = (forward.bytes_sent, forward.bytes_received) if forward is not None else (0, 0)
            if "batch" in req:
                results.append(_run_batch(engine, [request_of(r) for r in req["batch"]], req.get("join_at"),
                                          req.get("together", False)))
                continue
            result = engine.complete(request_of(req))
            after = (forward.bytes_sent, forward.bytes_received) if forward is not None else (0, 0)
            logprobs = [[e.token, e.logprob, [[t.token, t.logprob] for t in e.top]] for e in result.logprobs or []]
            results.append({"token_ids": result.token_ids, "text": result.text, "finish_reason": result.finish_reason,
                            "stats": result.stats.model_dump(), "seconds": time.perf_counter() - started,
                            "bytes_sent": after[0] - before[0], "bytes_received": after[1] - before[1],
                            "logprobs": logprobs})
    finally:
        if forward is not None and forward.broken is None:  # a failed pipeline refuses (its error is raised)
            forward.shutdown()
    sent = forward.bytes_sent if forward is not None else 0
    received = forward.bytes_received if forward is not None else 0
    links = [forward.link.report()] if forward is not None and hasattr(forward.link, "report") else []
    prefix = [dataclasses.asdict(prefix_cache.stats)] if prefix_cache is not None else []
    wire = None if forward is None else WIRE_NAMES[forward.wire]  # how its steps crossed the stages
    Path(spec["out"]).write_text(json.dumps({"results": results, "bytes": {"sent": sent, "received": received},
                                             "links": links, "prefix": prefix, "collectives": collectives,
                                             "wire": wire, "compiled_layers": compiled_layers.traced(loaded.model),
                                             "cuda_graphs": os.environ.get("MLX_USE_CUDA_GRAPHS")}))


def _time_collectives(model: Any, reps: int) -> dict[str, float] | None:
    """A tensor group's all-reduce alone (``reps`` > 0; every member runs the same): median microseconds of one of a
    decode step's ([1, 1, H], the activations' dtype) and of a 4-row verify call's, each evaluated on its own; and
    per all-reduce of a chain of as many as a token runs (2 x layers + 1, each on the last one's sum, one
    evaluation: how a step meets them, in one graph, without the layers' work between)."""
    if reps <= 0:
        return None
    import statistics

    import mlx.core as mx

    group = model.tensor_share.group
    dtype = model.text_model.layers[0].input_layernorm.weight.dtype
    chain_length = 2 * model.num_layers + 1
    times: dict[int, list[float]] = {1: [], 4: []}
    chains: list[float] = []
    for i in range(reps + 10):
        for rows, seconds in times.items():  # interleaved: a busy moment of the machine hits both
            x = mx.ones((1, rows, model.hidden_size), dtype=dtype)
            mx.eval(x)
            started = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            if i >= 10:  # (the first ones set the connections up)
                seconds.append(time.perf_counter() - started)
        if i % 10 == 0:  # a chain costs as many as a token's: every tenth round
            x = mx.ones((1, 1, model.hidden_size), dtype=dtype)
            mx.eval(x)
            started = time.perf_counter()
            for _ in range(chain_length):
                x = mx.distributed.all_sum(x, group=group) * 0.5
            mx.eval(x)
            if i >= 10:
                chains.append((time.perf_counter() - started) / chain_length)
    out = {f"all_sum_{rows}_row_us": statistics.median(seconds) * 1e6 for rows, seconds in times.items()}
    if chains:
        out["all_sum_chained_us"] = statistics.median(chains) * 1e6
    return out


def _run_batch(engine: Any, requests: list[Any], join_at: list[int] | None, together: bool = False) -> list[dict[str, Any]]:
    """``requests`` decoded in one batch (``BatchDecoder``: the device queue's loop), request i joining before the
    batch's step ``join_at[i]``; each one's token ids, text, finish reason and stats. ``together``: those joining at
    one step whose whole prompt can go prefill as rows of one call first."""
    from exo.engine.batch import BatchDecoder
    from exo.engine.batch_prefill import prefill_together

    join_at = join_at or [0] * len(requests)
    batch = BatchDecoder(engine)
    out: list[dict[str, Any]] = [{"token_ids": [], "text": "", "finish_reason": None, "stats": None, "together": False}
                                 for _ in requests]
    index: dict[int, int] = {}
    pending, step = set(range(len(requests))), 0

    def take(i: int, chunk: Any) -> None:
        out[i]["token_ids"] += chunk.token_ids
        out[i]["text"] += chunk.text
        if chunk.finish_reason is not None:
            out[i]["finish_reason"], out[i]["stats"] = chunk.finish_reason, chunk.stats.model_dump()

    while pending or len(batch):
        joining = [i for i in sorted(pending) if join_at[i] <= step]
        runs = {i: engine.start(requests[i]) for i in joining} if together else {}
        shared = [i for i in runs if runs[i].whole_prompt_in(len(requests[i].prompt_tokens))]
        if len(shared) > 1:
            prefill_together([runs[i] for i in shared])
            for i in shared:
                out[i]["together"] = True
        for i in joining:
            pending.discard(i)
            run = runs[i] if i in runs else engine.start(requests[i])
            for chunk in run.first_token() if out[i]["together"] else run.begin():
                if chunk is not None:
                    take(i, chunk)
            index[id(run)] = i
            if run.output.finish is not None:
                take(i, run.final_chunk())
                run.release()
            else:
                batch.add(run)
        for run, chunks in batch.step():
            for chunk in chunks:
                take(index[id(run)], chunk)
        step += 1
    return out


def _end_with(parent: int) -> None:
    """End this process once ``parent`` (the process that started the group) is gone: killed (SIGKILL, or a
    SIGTERM its code does not handle), it could not end its members, and they would go on serving (a tensor
    member spinning in a collective, a pipeline stage in a receive) on the machine's cores or GPU."""
    if sys.platform == "linux":
        # The kernel's parent-death signal (PR_SET_PDEATHSIG = 1): a member's main thread holds the GIL while it
        # waits in MLX's ring backend, so a thread of this process could not be relied on to look.
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
        if os.getppid() != parent:  # gone before the signal was asked for
            os._exit(1)
        return

    def watch() -> None:  # elsewhere: a thread looks (whenever the main thread lets go of the GIL)
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="exo-local-parent", daemon=True).start()


def _dump_stack_after(seconds: float) -> None:
    """Write the main thread's stack to stderr after ``seconds``, wherever it is (a C call that never returns
    included). A signal sent to the main thread does it there, so the frames it reads hold still:
    faulthandler's own timer reads them from another thread while the main thread runs on, and crashed a stage
    that way. SA_RESTART: a blocking read the signal interrupts goes on."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=False)
    signal.siginterrupt(signal.SIGUSR1, False)
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(seconds, signal.pthread_kill, (main, signal.SIGUSR1))
    timer.daemon = True
    timer.start()


if __name__ == "__main__":
    import exo

    exo.without_torch()
    if os.environ.get("EXO_STAGE_TRACEBACK_S"):  # the main thread's stack to stderr then (a stuck stage says where)
        _dump_stack_after(float(os.environ["EXO_STAGE_TRACEBACK_S"]))
    _end_with(int(sys.argv[3]))
    _stage_main(sys.argv[1], int(sys.argv[2]))
