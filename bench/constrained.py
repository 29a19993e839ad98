"""Decode speed under a JSON-schema constraint vs unconstrained, native MTP off and on, in one run.

    python bench/constrained.py [MODEL] [--max-tokens 256] [--repeats 5] [--mtp off,1,2] [--device cpu|gpu] [--json]

For each MTP mode, runs alternate (unconstrained, constrained, unconstrained, ...) on the same chat prompt
so drift on a shared CPU hits both alike. The constrained runs follow SCHEMA (an open-ended list of
records: a small model fills it until the budget, where the grammar closes the document); the
unconstrained runs ignore EOS so both decode the whole budget. Speed is the engine's decode tokens/s
(first token excluded). The ratio is constrained / unconstrained, median over the alternating pairs; the
acceptance rate says how the drafts fared under the grammar (a different text than the free one).
Also reported: the grammar's host time per token (the mask, computed while the device runs the step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

from common import use_device  # bench/ is this script's folder

from exo.engine import GenerationRequest, load
from exo.engine import constraints as constraints_module
from exo.engine.constraints import ConstraintSpec, compile_grammar
from exo.engine.costs import device_name
from exo.engine.prompt import prompt_tool_format, tokenize

SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 32},
                    "count": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
                    "ok": {"type": "boolean"},
                },
                "required": ["name", "count", "tags", "ok"],
            },
        }
    },
    "required": ["records"],
}
PROMPT = "List the files of a Python project as JSON records."


class _MaskTimer:
    """Host seconds spent computing masks (Matcher.allowed), summed over a run."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._original = constraints_module.Matcher.allowed

    def __enter__(self) -> _MaskTimer:
        timer = self

        def allowed(matcher: Any) -> Any:
            start = time.perf_counter()
            try:
                return timer._original(matcher)
            finally:
                timer.seconds += time.perf_counter() - start
                timer.calls += 1

        constraints_module.Matcher.allowed = allowed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        constraints_module.Matcher.allowed = self._original  # type: ignore[method-assign]


def _mode(mtp: str) -> dict[str, Any]:
    if mtp == "off":
        return {"native_mtp": "off"}
    if mtp == "auto":
        return {"native_mtp": "auto"}
    return {"native_mtp": "on", "mtp_k": int(mtp)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mtp", default="off,1,2")
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", choices=("cpu", "gpu"), default=None, help="MLX's device (default: MLX's default)")
    args = p.parse_args(argv)
    use_device(args.device)
    engine = load(args.model)
    tokenizer = engine.loaded.tokenizer
    # A checkpoint without a chat template (bench/make_random_model.py's) takes the prompt as plain text.
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenize(tokenizer, messages=[{"role": "user", "content": PROMPT}])
    else:
        prompt = tokenize(tokenizer, text=PROMPT)
    grammar = compile_grammar(ConstraintSpec(json_schema=SCHEMA), engine.grammar_tokenizer, engine.vocab_size,
                              prompt_tool_format(tokenizer), engine.closing_tokens)
    free_loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    constrained_loaded = engine.loaded
    engine.warmup()
    report: dict[str, Any] = {"device": device_name(), "model": engine.loaded.model_id, "max_tokens": args.max_tokens,
                              "repeats": args.repeats, "modes": {}}
    for mtp in args.mtp.split(","):
        request = _mode(mtp)
        # One warm-up pair (first-use costs: the grammar tokenizer, kernels), not counted.
        engine.loaded = constrained_loaded
        engine.complete(GenerationRequest(prompt, max_tokens=32, constraint=grammar, **request))
        free, bound, ratios, accept_free, accept_bound, mask_ms, valid = [], [], [], [], [], [], 0
        for _ in range(args.repeats):
            engine.loaded = free_loaded
            a = engine.complete(GenerationRequest(prompt, max_tokens=args.max_tokens, **request))
            engine.loaded = constrained_loaded
            with _MaskTimer() as timer:
                b = engine.complete(GenerationRequest(prompt, max_tokens=args.max_tokens, constraint=grammar, **request))
            try:
                json.loads(b.text)
                valid += 1
            except ValueError:
                pass
            free.append(a.stats.decode_tokens_per_s)
            bound.append(b.stats.decode_tokens_per_s)
            ratios.append(b.stats.decode_tokens_per_s / a.stats.decode_tokens_per_s)
            accept_free.append(a.stats.acceptance_rate)
            accept_bound.append(b.stats.acceptance_rate)
            mask_ms.append(1000 * timer.seconds / max(1, len(b.token_ids)))
            tokens = len(b.token_ids)
        report["modes"][mtp] = {
            "unconstrained_tok_s": statistics.median(free),
            "constrained_tok_s": statistics.median(bound),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "acceptance_unconstrained": statistics.median(accept_free),
            "acceptance_constrained": statistics.median(accept_bound),
            "mask_ms_per_token": statistics.median(mask_ms),
            "constrained_tokens": tokens,
            "valid_json": f"{valid}/{args.repeats}",
        }
    engine.loaded = constrained_loaded
    if args.json:
        print(json.dumps(report, indent=2))
        return report
    print(f"model {report['model']}, {report['device']}, max_tokens {args.max_tokens}, {args.repeats} alternating pairs")
    print(f"schema: an open-ended list of records (bench/constrained.py SCHEMA); prompt {PROMPT!r}")
    for mtp, r in report["modes"].items():
        print(f"\nnative MTP {mtp}:")
        print(f"  unconstrained  tok/s {r['unconstrained_tok_s']:8.1f}   acceptance {r['acceptance_unconstrained']:.2f}")
        print(f"  json_schema    tok/s {r['constrained_tok_s']:8.1f}   acceptance {r['acceptance_constrained']:.2f}"
              f"   ({r['constrained_tokens']} tokens, valid JSON {r['valid_json']})")
        print(f"  ratio          {r['ratio']:.3f} (min {r['ratio_min']:.3f}, max {r['ratio_max']:.3f})"
              f"   grammar host time {r['mask_ms_per_token']:.3f} ms/token")
    return report


if __name__ == "__main__":
    main()
