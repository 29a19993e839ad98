"""One stage of a pipeline, as a process: ``python tests/engine/pipeline_worker.py SPEC RANK``.

SPEC (JSON): {"model": dir, "stages": [[start, end], ...], "hosts": ["127.0.0.1:port", ...],
"prefill_chunk": n, "requests": [{"prompt": [ids], "max_tokens": n, "mtp_k": k|null,
"native_mtp": "auto"|"on"|"off", "sampling": {...}, "ignore_eos": bool}], "out": file}.
Every rank loads its layers and joins the ring; the last stage runs the requests through the engine
(``PipelineForward``) and writes {"results": [{"token_ids", "text", "finish_reason", "stats"}], "bytes"}
to "out"; the others serve steps until it shuts the group down.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    from exo.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, load_checkpoint
    from exo.engine.pipeline import PipelineForward, StageSpec, serve_stage
    from exo.runner.group import join_group

    start, end = spec["stages"][rank]
    stage = StageSpec(rank, len(spec["stages"]), start, end)
    loaded = load_checkpoint(spec["model"], layers=(start, end))
    link = join_group(spec["hosts"], rank)
    if not stage.last:
        serve_stage(loaded.model, stage, link)
        return
    forward = PipelineForward(loaded.model, stage, link)
    engine = Engine(loaded, EngineConfig(prefill_chunk=spec.get("prefill_chunk", 2048)), forward=forward)
    results = []
    try:
        for req in spec["requests"]:
            engine.loaded = dataclasses.replace(loaded, eos_token_ids=frozenset()) if req.get("ignore_eos") else loaded
            result = engine.complete(GenerationRequest(
                req["prompt"], max_tokens=req["max_tokens"], mtp_k=req.get("mtp_k"),
                native_mtp=req.get("native_mtp", "auto"), sampling=SamplingParams(**req.get("sampling", {})),
                stop=[req["stop"]] if req.get("stop") else (),
            ))
            results.append({"token_ids": result.token_ids, "text": result.text,
                            "finish_reason": result.finish_reason, "stats": result.stats.model_dump()})
    finally:
        forward.shutdown()
    Path(spec["out"]).write_text(json.dumps(
        {"results": results, "bytes": {"sent": forward.bytes_sent, "received": forward.bytes_received}}
    ))


if __name__ == "__main__":
    main()
