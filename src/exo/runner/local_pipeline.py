"""A pipeline of stages on this machine, one process per stage over a loopback ring: no daemons.

For tests and benchmarks (``exo bench --stages N``, ``bench/pipeline.py``): the same stage runtime a
cluster runs (``load_checkpoint(layers=...)``, ``join_group``, ``serve_stage`` / ``PipelineForward``),
without the control plane around it.

    results = run_local_pipeline(model_dir, [(0, 4), (4, 8)], [{"prompt": [1, 2, 3], "max_tokens": 16}])

``model``: one directory for every stage, or one per stage (each "node" with its own partial snapshot).

Each request: {"prompt": [ids], "max_tokens": n, "mtp_k": k | None, "native_mtp": "auto" | "on" | "off",
"sampling": {...}, "stop": str, "ignore_eos": bool, "constraint": ConstraintSpec JSON, "logprobs": n}; each
result: {"token_ids", "text", "finish_reason", "stats", "seconds", "bytes_sent", "bytes_received",
"logprobs": [[token, logprob, [[token, logprob], ...]], ...]} (bytes: the leader's stage, both ways). A single
stage [(0, n)] runs the model whole in one process, for comparisons. ``links``: every stage's
``RingLink.report()`` (where its time went, per phase, over the whole run; ``EXO_PIPELINE_PHASES=1`` in a
stage's environment times the ring's receives apart).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .group import free_port


class LocalPipelineError(RuntimeError):
    """A stage process failed; the message carries its stderr."""


def run_local_pipeline(
    model: str | Path | Sequence[str | Path], stages: Sequence[tuple[int, int]], requests: list[dict[str, Any]], *,
    prefill_chunk: int = 2048, warmup: bool = False, timeout_s: float = 300.0,
    stage_env: Sequence[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """Run ``requests`` on a pipeline of ``stages`` (one process each); the leader's results and the bytes
    its stage sent and received. ``stage_env``: environment variables per stage, over this process's (on a
    host with several GPUs, ``CUDA_VISIBLE_DEVICES`` puts each stage on its own, as separate nodes would be)."""
    if stage_env is not None and len(stage_env) != len(stages):
        raise ValueError(f"{len(stage_env)} stage environments for {len(stages)} stages")
    with tempfile.TemporaryDirectory(prefix="exo-local-pipeline-") as tmp:
        models = [str(model)] * len(stages) if isinstance(model, (str, Path)) else [str(m) for m in model]
        if len(models) != len(stages):
            raise ValueError(f"{len(models)} model directories for {len(stages)} stages")
        spec = {
            "models": models, "stages": [list(s) for s in stages],
            "hosts": [f"127.0.0.1:{free_port()}" for _ in stages], "prefill_chunk": prefill_chunk,
            "warmup": warmup, "requests": requests, "out": str(Path(tmp) / "out.json"),
        }
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        procs = [
            subprocess.Popen([sys.executable, "-m", "exo.runner.local_pipeline", str(spec_file), str(rank)],
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **stage_env[rank]} if stage_env is not None else None)
            for rank in range(len(stages))
        ]
        try:
            errors = [p.communicate(timeout=timeout_s)[1] for p in procs]
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
        return out


def _stage_main(spec_file: str, rank: int) -> None:
    spec = json.loads(Path(spec_file).read_text())
    from exo.downloads.heads import check_pending_head
    from exo.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, load_checkpoint
    from exo.engine.constraints import ConstraintSpec, compile_grammar
    from exo.engine.pipeline import PipelineForward, StageSpec, serve_stage
    from exo.engine.prompt import prompt_tool_format

    from .group import join_group

    stages = spec["stages"]
    start, end = stages[rank]
    config = EngineConfig(prefill_chunk=spec.get("prefill_chunk", 2048))
    forward = None
    model = spec["models"][rank]
    if len(stages) == 1:
        loaded = load_checkpoint(model)
    else:
        stage = StageSpec(rank, len(stages), start, end)
        loaded = load_checkpoint(model, layers=(start, end))
        link = join_group(spec["hosts"], rank, secret=os.environ.get("EXO_CLUSTER_SECRET") or None)
        if not stage.last:
            serve_stage(loaded.model, stage, link)
            Path(f"{spec['out']}.link{rank}.json").write_text(json.dumps(link.report()))
            return
        forward = PipelineForward(loaded.model, stage, link)
        loaded = check_pending_head(loaded, forward)  # a head recovered for this stage, checked on the pipeline
    engine = Engine(loaded, config, forward=forward)
    results = []
    try:
        if spec.get("warmup"):
            engine.warmup()
        for req in spec["requests"]:
            engine.loaded = dataclasses.replace(loaded, eos_token_ids=frozenset()) if req.get("ignore_eos") else loaded
            started = time.perf_counter()
            before = (forward.bytes_sent, forward.bytes_received) if forward is not None else (0, 0)
            grammar = None
            if req.get("constraint"):  # a ConstraintSpec as JSON, compiled here as a runner would
                grammar = compile_grammar(ConstraintSpec.from_json(req["constraint"]), engine.grammar_tokenizer,
                                          engine.vocab_size, prompt_tool_format(loaded.tokenizer),
                                          engine.closing_tokens)
            result = engine.complete(GenerationRequest(
                req["prompt"], max_tokens=req["max_tokens"], mtp_k=req.get("mtp_k"),
                native_mtp=req.get("native_mtp", "auto"), sampling=SamplingParams(**req.get("sampling", {})),
                stop=[req["stop"]] if req.get("stop") else (), constraint=grammar, logprobs=req.get("logprobs"),
            ))
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
    Path(spec["out"]).write_text(json.dumps({"results": results, "bytes": {"sent": sent, "received": received},
                                             "links": links}))


if __name__ == "__main__":
    _stage_main(sys.argv[1], int(sys.argv[2]))
