"""Where an agent turn's time goes with the prefix cache: in one process, the session of
``bench/agent_session.py`` (a system prompt with tools' schemas, then turns that each add the model's reply
and a tool result) on an engine with the runner's cache (RAM + disk tiers under a temporary EXO_HOME), and
each prompt again on an engine without one (cold), alternating.

Per turn: prompt and restored tokens, then the time of each phase of the cached request: tokenizing (the
chat template), the lookup (``PrefixCache.plan``), the restore (reading the blocks and the snapshot,
concatenating the KV), the prefill of the new tokens, the first token, and the store after it (copying
the blocks and snapshots out of the caches, and handing them to the disk writer); the time to first token
cached and cold and their ratio.

    python bench/prefix_phases.py [MODEL] [--turns 10] [--system-tokens 4000] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agent_session import (  # bench/ is this script's folder
    RESULT_TOKENS,
    long_context_copy,
    system_prompt,
    text_of,
)
from common import report_to

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

import random  # noqa: E402

import mlx.core as mx  # noqa: E402

from exo.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, load_checkpoint  # noqa: E402
from exo.engine import generate as gen  # noqa: E402
from exo.engine import prefix_cache as pc  # noqa: E402
from exo.engine.prompt import tokenize  # noqa: E402
from exo.runner.prefix_store import open_prefix_cache  # noqa: E402
from exo.settings import load_settings  # noqa: E402


class Phases:
    """Wall time per named phase of the current request (patched around the cache's and the sequence's calls)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - start) * 1000

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        phases = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            with phases.timed(name):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)

    def wrap_restore(self) -> None:
        """The restore, evaluated here to be timed apart (a server evaluates it with the first prefill chunk)."""
        original = pc.PrefillPlan.restore
        phases = self

        def timed(plan: Any, caches: list[Any], head_cache: Any) -> bool:
            with phases.timed("restore"):
                done = original(plan, caches, head_cache)
                mx.eval([c.state for c in caches])
            return done

        pc.PrefillPlan.restore = timed  # type: ignore[method-assign]

    def wrap_prefill(self) -> None:
        """The prefill generator, timed while it runs (it ends with the first token chosen, lazily)."""
        original = gen.SequenceState.prefill
        phases = self

        def timed(state: Any, chunk: int | None = None) -> Any:
            steps = original(state, chunk)
            while True:
                with phases.timed("prefill"):
                    try:
                        position = next(steps)
                    except StopIteration:
                        mx.eval(state.pending_token)  # the last chunk and the first token
                        return
                yield position

        gen.SequenceState.prefill = timed  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with report_to(args.json) as report, tempfile.TemporaryDirectory() as tmp:
        model_dir = long_context_copy(args.model, args.context, Path(tmp) / "model")
        loaded = load_checkpoint(model_dir)
        settings = load_settings(env={"EXO_HOME": str(Path(tmp) / "home")})
        warm, cold = Engine(loaded, EngineConfig()), Engine(loaded, EngineConfig())
        warm.prefix_cache = open_prefix_cache(loaded, settings)
        warm.warmup()
        cold.warmup()
        phases = Phases()
        phases.wrap(pc.PrefixCache, "plan", "lookup")
        phases.wrap_restore()
        phases.wrap(pc.PrefillPlan, "capture", "store")
        phases.wrap_prefill()

        tokenizer = loaded.tokenizer
        rng = random.Random(1)
        system = system_prompt(args.system_tokens, tokenizer)
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": "The tests in tests/test_parser.py fail. Find out why and fix it."}]
        rows = []
        for turn in range(args.turns):
            row: dict[str, Any] = {"turn": turn + 1}
            for name, engine in (("cold", cold), ("cached", warm)):
                phases.ms = {}
                start = time.perf_counter()
                with phases.timed("tokenize"):
                    ids = tokenize(tokenizer, messages=messages)
                request = GenerationRequest(ids, max_tokens=args.max_tokens, native_mtp="off",
                                            sampling=SamplingParams(temperature=0.0))
                stream = engine.generate(request)
                first = next(stream)
                ttft = (time.perf_counter() - start) * 1000
                chunks = [first, *stream]
                if name == "cached":
                    row.update({f"{k}_ms": round(v, 1) for k, v in phases.ms.items()})
                    row["prompt_tokens"] = len(ids)
                    row["cached_tokens"] = chunks[-1].stats.cached_tokens
                row[f"{name}_ttft_ms"] = round(ttft, 1)
                row[f"{name}_text"] = "".join(c.text for c in chunks)
            assert row["cold_text"] == row["cached_text"], turn
            row["ratio"] = round(row["cached_ttft_ms"] / row["cold_ttft_ms"], 3)
            rows.append(row)
            reply = row.pop("cached_text")
            row.pop("cold_text")
            result = text_of(RESULT_TOKENS[turn % len(RESULT_TOKENS)], rng, tokenizer)
            messages = messages + [{"role": "assistant", "content": reply},
                                   {"role": "user", "content": f"Tool result (step {turn + 1}):\n{result}"}]
        warm.prefix_cache.store.close()
        report.update(model=args.model, turns=rows)
        print_table(rows, ["turn", "prompt_tokens", "cached_tokens", "tokenize_ms", "lookup_ms", "restore_ms",
                           "prefill_ms", "store_ms", "cached_ttft_ms", "cold_ttft_ms", "ratio"])


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    print(" ".join(f"{c:>14}" for c in cols))
    for row in rows:
        print(" ".join(f"{row.get(c, 0):>14}" for c in cols))


if __name__ == "__main__":
    main()
