"""``exo run``: one completion on this machine, streamed or as one JSON object."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from exo.cli.common import CommandError, print_json


def build_prompt(tokenizer: Any, prompt: str, raw: bool, system: str | None) -> list[int]:
    if raw:
        return list(tokenizer.encode(prompt))
    if not getattr(tokenizer, "chat_template", None):
        raise CommandError("this model's tokenizer has no chat template; pass --raw to send the prompt as is")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def describe_stats(stats: Any) -> str:
    if not stats.enabled:
        return f"[native MTP off: {stats.reason}] {stats.decode_tokens_per_s:.1f} tok/s, ttft {stats.ttft_ms:.0f} ms"
    positions = "/".join(f"{a:.2f}" for a in stats.per_position_acceptance) or "-"
    parts = [
        f"native MTP k={stats.k}{' (fixed)' if stats.k_fixed else ''}",
        f"rounds {stats.rounds}",
        f"acceptance {stats.acceptance_rate:.1%} ({positions})",
        f"{stats.decode_tokens_per_s:.1f} tok/s",
        f"ttft {stats.ttft_ms:.0f} ms",
    ]
    note = f" ({stats.reason})" if stats.reason else ""
    return "[" + ", ".join(parts) + "]" + note


def run_command(args: argparse.Namespace) -> int:
    from exo.engine import GenerationRequest, SamplingParams, load
    from exo.settings import load_settings

    settings = load_settings()
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed
    )
    engine = load(args.model, settings)
    prompt = build_prompt(engine.loaded.tokenizer, args.prompt, args.raw, args.system)
    request = GenerationRequest(
        prompt_tokens=prompt,
        max_tokens=args.max_tokens,
        sampling=sampling,
        stop=tuple(args.stop),
        native_mtp=args.native_mtp,
        mtp_k=args.mtp_k,
    )
    if args.json:
        result = engine.complete(request)
        print_json(
            {
                "model": engine.loaded.model_id,
                "text": result.text,
                "token_ids": result.token_ids,
                "finish_reason": result.finish_reason,
                "usage": {
                    "prompt_tokens": result.stats.prompt_tokens,
                    "completion_tokens": result.stats.completion_tokens,
                },
                "native_mtp": result.stats.model_dump(),
            }
        )
        return 0
    stats = None
    for chunk in engine.generate(request):
        if chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        stats = chunk.stats or stats
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stats is not None:
        print(describe_stats(stats), file=sys.stderr)
    return 0
