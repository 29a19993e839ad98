"""Grammar engines for constrained decoding, measured on one JSON schema: llguidance (what exo uses),
xgrammar and outlines-core, with the bundled model's tokenizer.

    python bench/grammar_engines.py        # engines that are not installed are skipped
    pip install --target /tmp/gpk xgrammar apache-tvm-ffi outlines-core --no-deps
    PYTHONPATH=/tmp/gpk python bench/grammar_engines.py

Per engine: the time to compile the schema into a matcher, and the host time of one next-token mask
while it follows a valid document of bench/constrained.py's SCHEMA token by token (median and p99),
checking that every token of the document is allowed. Also exo's own ``Matcher`` (llguidance under the
tool-format grammar exo builds, unpacked to the bool mask the engine applies).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from constrained import SCHEMA  # noqa: E402

from exo.engine import load  # noqa: E402
from exo.engine.constraints import ConstraintSpec, compile_grammar  # noqa: E402
from exo.engine.prompt import prompt_tool_format  # noqa: E402

DOC = {"records": [{"name": f"src/module_{i}.py", "count": i * 7, "tags": ["python", "src"], "ok": i % 2 == 0}
                   for i in range(12)]}


def follow(ids: list[int], mask: Callable[[], object], allowed: Callable[[object, int], bool],
           consume: Callable[[int], object]) -> tuple[float, float, bool]:
    times = []
    for token in ids:
        start = time.perf_counter()
        m = mask()
        times.append(time.perf_counter() - start)
        if not allowed(m, token):
            return statistics.median(times), float(np.percentile(times, 99)), False
        consume(token)
    return statistics.median(times), float(np.percentile(times, 99)), True


def main() -> None:
    engine = load(None)
    tok = engine.loaded.tokenizer
    hf = getattr(tok, "_tokenizer", tok)
    vocab = engine.vocab_size
    spaced = hf.encode(json.dumps(DOC), add_special_tokens=False)  # json.dumps' separators, as exo spells JSON
    compact = hf.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)
    rows: list[tuple[str, float, float, float, bool]] = []

    start = time.perf_counter()
    grammar = compile_grammar(ConstraintSpec(json_schema=SCHEMA), engine.grammar_tokenizer, vocab,
                              prompt_tool_format(tok), None)
    matcher = grammar.matcher(None)
    compiled = time.perf_counter() - start
    rows.append(("exo Matcher.allowed (llguidance)", compiled,
                 *follow(spaced, matcher.allowed, lambda m, t: bool(m[t]), matcher.consume)))

    import llguidance

    start = time.perf_counter()
    lm = llguidance.LLMatcher(engine.grammar_tokenizer,
                              llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False}),
                              log_level=0)
    compiled = time.perf_counter() - start
    bits = np.empty((engine.grammar_tokenizer.vocab_size + 31) // 32, dtype=np.int32)

    def llg_mask() -> np.ndarray:
        lm.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        return bits

    rows.append(("llguidance", compiled, *follow(compact, llg_mask, lambda m, t: bool(m[t // 32] >> (t % 32) & 1),
                                                lm.consume_token)))
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar: not installed (see the docstring)")
    else:
        start = time.perf_counter()
        compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab))
        xm = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
        compiled = time.perf_counter() - start
        bitmask = xgr.allocate_token_bitmask(1, vocab)

        def xg_mask() -> object:
            xm.fill_next_token_bitmask(bitmask)
            return bitmask

        rows.append(("xgrammar", compiled, *follow(
            spaced, xg_mask, lambda m, t: bool(int(m[0, t // 32]) >> (t % 32) & 1), xm.accept_token)))
    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        print("outlines-core: not installed (see the docstring)")
    else:
        start = time.perf_counter()
        eos = tok.eos_token_id
        strings: dict[str, list[int]] = {}
        for t in range(vocab):
            text = engine.grammar_tokenizer.decode_bytes([t]).decode("utf-8", errors="replace")
            if t != eos and text:
                strings.setdefault(text, []).append(t)
        guide = Guide(Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=r"[ ]?"),
                            Vocabulary(eos, strings)))
        compiled = time.perf_counter() - start
        rows.append(("outlines-core", compiled, *follow(spaced, guide.get_tokens, lambda m, t: t in m, guide.advance)))
    print(f"vocabulary {vocab}, document {len(spaced)} tokens (bench/constrained.py SCHEMA)")
    for name, compiled, median, p99, ok in rows:
        print(f"{name:30s} compile {compiled * 1000:8.1f} ms   mask median {median * 1e6:7.1f} us   "
              f"p99 {p99 * 1e6:7.1f} us   followed the document: {ok}")


if __name__ == "__main__":
    main()
