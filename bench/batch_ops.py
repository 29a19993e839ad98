"""Which operation of a batched decode step (or of a verify call) rounds differently from the same sequences'
solo steps?

    python bench/batch_ops.py [MODEL] [--size 8] [--steps 32]
    python bench/batch_ops.py MODEL --verify K [--steps 24] [--prompt-tokens 200]

``--verify K``: a verify call of K + 1 rows against the K + 1 one-row decode steps of the same tokens, on real
inputs (``verify_main`` says how); without it, a batch against solo steps:

B prompts of different lengths are prefilled twice each: one copy joins a BatchDecoder's caches (mlx-lm's
BatchKVCache, left-padded, and the GatedDeltaNet rows), the other stays solo. Each step feeds the same
tokens (the solo greedy ones, so both stay aligned after a difference) through the batched forward and
through each solo forward, recording the output of every module of every decoder layer (each linear
layer, the attention / GatedDeltaNet mixer, the MLP or MoE block, the layer). Prints, per step, the first
module in call order whose output for some sequence differs from that sequence's solo output, and how
many greedy tokens differ; then, over all steps, how often each module was the first to differ.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from exo.engine import GenerationRequest, load
from exo.engine.batch import BatchDecoder
from exo.engine.costs import device_name
from exo.engine.models.layers import vector_matmul, vectors_apply

_VECTOR_CLASSES: dict[type, type] = {}


class _BatchVectors:
    """A bias-free linear layer whose rows (of every sequence) go as one-row products while ``on`` is set."""

    on = False

    def __call__(self, x: mx.array) -> mx.array:
        if not _BatchVectors.on or x.size == x.shape[-1]:
            return super().__call__(x)  # type: ignore[misc]
        return vector_matmul(x, self.weight)  # type: ignore[attr-defined]


def batch_vectors(engine) -> int:
    """Give every bias-free linear layer of the backbone and its lm_head the ``--vectors`` path (off until
    ``_BatchVectors.on``); returns how many layers."""
    model = engine.model
    count = 0
    for layer in model.stage_layers:
        for _, module in layer.named_modules():
            if vectors_apply(module):
                cls = type(module)
                if cls not in _VECTOR_CLASSES:
                    _VECTOR_CLASSES[cls] = type(f"BatchVectors{cls.__name__}", (_BatchVectors, cls), {})
                module.__class__ = _VECTOR_CLASSES[cls]
                count += 1
    weight = model.output_weight()
    if weight is not None:
        logits = model.logits
        object.__setattr__(model, "logits", lambda h: vector_matmul(h, weight) if _BatchVectors.on else logits(h))
        count += 1
    return count

RECORD: list[tuple[str, mx.array]] = []
_CLASSES: dict[type, type] = {}


class _Recording:
    record_name = ""

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)  # type: ignore[misc]
        RECORD.append((self.record_name, out))
        return out


def record(module: nn.Module, name: str) -> None:
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Recording{cls.__name__}", (_Recording, cls), {})
    module.__class__ = _CLASSES[cls]
    object.__setattr__(module, "record_name", name)


def instrument(model) -> None:
    for i, layer in enumerate(model.stage_layers):
        for path, module in layer.named_modules():
            if isinstance(module, (nn.Linear, nn.QuantizedLinear)) or path in ("linear_attn", "self_attn", "mlp"):
                record(module, f"layer {i} {path}")
        record(layer, f"layer {i}")


def first_difference(batched: list[tuple[str, mx.array]], solo: list[list[tuple[str, mx.array]]]) -> str | None:
    for j, (name, out) in enumerate(batched):
        for i, alone in enumerate(solo):
            other_name, other = alone[j]
            assert other_name == name, (other_name, name)
            if not mx.array_equal(out[i : i + 1], other).item():
                return name
    return None


# -- verify call vs one-row steps (--verify K) ------------------------------------------------------------------
TRACE: list[tuple[str, Any, mx.array]] = []  # (module, its input, its output) in call order
_TRACE_CLASSES: dict[type, type] = {}


class _Tracing:
    trace_name = ""

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)  # type: ignore[misc]
        first = args[0] if args and isinstance(args[0], mx.array) else None
        TRACE.append((self.trace_name, first, out if isinstance(out, mx.array) else None))
        return out


def trace_modules(model) -> None:
    """Every module of every decoder layer (linears, norms, the mixers, the MLP, the layer) and the final norm
    records its input and output."""
    def mark(module: nn.Module, name: str) -> None:
        cls = type(module)
        if cls not in _TRACE_CLASSES:
            _TRACE_CLASSES[cls] = type(f"Tracing{cls.__name__}", (_Tracing, cls), {})
        module.__class__ = _TRACE_CLASSES[cls]
        object.__setattr__(module, "trace_name", name)

    for i, layer in enumerate(model.stage_layers):
        for path, module in layer.named_modules():
            if path and isinstance(module, (nn.Linear, nn.QuantizedLinear, nn.RMSNorm)) or path in (
                    "linear_attn", "self_attn", "mlp", "linear_attn.norm"):
                mark(module, f"layer {i} {path}")
        mark(layer, f"layer {i}")
    mark(model.text_model.norm, "final norm")


def _row(a: mx.array | None, t: int, rows: int) -> mx.array | None:
    """Row t of a verify call's array (its second axis has the rows), as a one-row step's shape."""
    if a is None or a.ndim < 2 or a.shape[1] != rows:
        return None
    return a[:, t : t + 1]


def _same(a: mx.array | None, b: mx.array | None) -> bool | None:
    if a is None or b is None or a.shape != b.shape:
        return None
    return bool(mx.array_equal(a, b).item())


def verify_main(args) -> None:
    """One prompt, decoded plainly (greedy) for ``--steps`` rounds' worth of tokens; two copies of its caches. Per
    round: the K + 1 next tokens of the plain continuation go as K + 1 one-row decode steps through one copy and as
    one verify call (GatedDeltaNet recording, MoE routes locked, the engine's probed verify mode: what a round runs)
    through the other, which then keeps all its rows (every draft accepted), so both stay at the same position.
    Each row of the verify call is compared with its decode step, module by module: the first module (in call
    order) whose output differs while its input was equal is the op that rounds otherwise. Then a verdict per
    suspect over all rounds: quantized/plain linears, RMSNorms, the attention mixer (rope included), the
    GatedDeltaNet mixer and its recorded states and conv windows against the decode steps', RoPE alone on the
    real queries, the logits (as the round computes them) and their argmax, exact top-2 ties."""
    from exo.engine.models.layers import RollbackArraysCache
    from exo.engine.verify import verify_logits

    engine = load(args.model)
    engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    k = args.verify
    mode = engine.verify_mode
    print(f"{args.model} on {device_name()}: verify mode {mode}")
    print("probe: " + ", ".join(f"{name}={value}" for name, value in engine.verify_probe.items()))
    tokenizer = engine.loaded.tokenizer
    text = "Write a long story about a lighthouse keeper and the sea. " * 40
    prompt = tokenizer.encode(text)[: args.prompt_tokens]
    total = args.steps * (k + 1) + 1
    plain = engine.complete(GenerationRequest(prompt, max_tokens=total, native_mtp="off")).token_ids
    runs = []
    for _ in range(2):
        run = engine.start(GenerationRequest(prompt, max_tokens=total, native_mtp="off"))
        for _chunk in run.begin():
            pass
        runs.append(run)
    decode, verify = runs
    assert int(decode.pending_token.item()) == plain[0]
    model = engine.model
    trace_modules(model)
    rope_layer = next(layer.self_attn for layer in model.stage_layers if not layer.is_linear)
    culprits: Counter[str] = Counter()  # modules whose input was equal and output not
    firsts: Counter[str] = Counter()
    verdicts: dict[str, Counter[str]] = {}

    def note(suspect: str, same: bool | None) -> None:
        if same is not None:
            verdicts.setdefault(suspect, Counter())["equal" if same else "DIFFERS"] += 1

    position = 0
    for step in range(args.steps):
        tokens = plain[position : position + k + 1]
        offset = len(prompt) + position
        # K + 1 one-row decode steps, each module's input and output recorded; the GatedDeltaNet states after each
        steps, states, logits_rows = [], [], []
        for token in tokens:
            TRACE.clear()
            h = engine.forward.hidden(mx.array([[token]]), decode.cache)
            logits_rows.append(model.logits(h))
            gdn = [(c[0], c[1]) for c in decode.cache if isinstance(c, RollbackArraysCache)]
            mx.eval(logits_rows[-1], [o for _, i, o in TRACE if o is not None], gdn)
            steps.append(list(TRACE))
            states.append(gdn)
        TRACE.clear()
        h = engine.forward.hidden(mx.array([tokens]), verify.cache, verify=True)
        verify_out = verify_logits(model, h, mode)
        recorded = [c.pending_arrays() for c in verify.cache if isinstance(c, RollbackArraysCache)]
        mx.eval(verify_out, [o for _, i, o in TRACE if o is not None], recorded)
        call = list(TRACE)
        rows = k + 1
        first = None
        for t in range(rows):
            assert len(steps[t]) == len(call), "the verify call and a decode step ran other modules"
            for (name, vin, vout), (_, sin, sout) in zip(call, steps[t], strict=True):
                out_same = _same(_row(vout, t, rows), sout)
                in_same = _same(_row(vin, t, rows), sin)
                kind = ("linear" if "proj" in name else "norm" if "norm" in name else
                        "attention mixer" if name.endswith("self_attn") else
                        "GatedDeltaNet mixer" if name.endswith("linear_attn") else
                        "mlp" if name.endswith("mlp") else "layer" if name.startswith("layer") else name)
                if in_same:
                    note(kind + " (equal input)", out_same)
                if in_same and out_same is False:
                    culprits[name] += 1
                if out_same is False and first is None:
                    first = f"{name} (row {t}, input {'equal' if in_same else 'already different'})"
        firsts[first or "none"] += 1
        # GatedDeltaNet: the state and conv window recorded after row t against the decode step's after step t.
        for layer_states, record in zip(zip(*states, strict=True), recorded, strict=True):
            conv_input, *after = record
            for t in range(rows):
                window, state = layer_states[t]
                note("GatedDeltaNet state after row", _same(after[t + 1], state))
                note("GatedDeltaNet conv window after row", _same(
                    conv_input[:, t + 1 : t + 1 + window.shape[1]], window))
        # RoPE alone on real queries (the first attention layer's q_norm output): a block at the offset vs rows.
        q = next((o for name, _, o in call if name.endswith("self_attn.q_norm")), None)
        if q is not None:
            q = q.transpose(0, 2, 1, 3)  # [B, heads, T, D] as the layer ropes them
            block = rope_layer.rope(q, offset=offset)
            alone = mx.concatenate([rope_layer.rope(q[:, :, t : t + 1], offset=offset + t) for t in range(rows)],
                                   axis=2)
            note("RoPE (block vs rows)", _same(block, alone))
        # The logits as the round computes them, their argmax, exact ties at the top.
        for t in range(rows):
            single = logits_rows[t]
            row = verify_out[:, t : t + 1]
            note("logits (as the round computes them)", _same(row, single))
            note("argmax", bool((mx.argmax(row, axis=-1) == mx.argmax(single, axis=-1)).item()))
            top = mx.topk(single.astype(mx.float32).reshape(-1), 2)
            note("no exact top-2 tie in the one-row logits", bool((top[0] != top[1]).item()))
        # All rows kept (every draft accepted): both copies at the same position again.
        engine.forward.rollback(verify.cache, rows, rows)
        position += rows
        print(f"round {step:3d} at position {offset}: first module to differ: {first or 'none'}")
    print("first module to differ, over the rounds: " + ", ".join(f"{n} x{c}" for n, c in firsts.most_common()))
    print("modules whose output differed from equal inputs (the op that rounds otherwise): "
          + (", ".join(f"{n} x{c}" for n, c in culprits.most_common(12)) or "none"))
    print("verdict per suspect, row by row over all rounds:")
    for suspect, counts in verdicts.items():
        print(f"  {suspect:<45} equal {counts['equal']:>5}  DIFFERS {counts['DIFFERS']:>5}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--verify", type=int, metavar="K", help="a verify call of K + 1 rows against K + 1 one-row "
                        "decode steps (real inputs) instead of a batch against solo steps")
    parser.add_argument("--prompt-tokens", type=int, default=200, help="--verify: the prompt's length (the "
                        "context the verify calls attend to)")
    parser.add_argument("--invariant", action="store_true", help="batched steps in the engine's batch-invariant "
                        "mode (EngineConfig.batch_invariant)")
    parser.add_argument("--vectors", action="store_true", help="batched steps with every linear layer's rows as "
                        "one-row products (batch_identity.py --vectors)")
    args = parser.parse_args()
    if args.verify:
        verify_main(args)
        return
    engine = load(args.model)
    engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    tokenizer = engine.loaded.tokenizer
    subjects = ("the sea", "a lighthouse", "autumn", "a cat", "the moon", "a city", "rain", "mountains")
    texts = [f"Write a poem about {subjects[i % 8]}." + " and more" * (i // 2) for i in range(args.size)]
    ids = [tokenizer.encode(t) for t in texts]
    solo, batch = [], BatchDecoder(engine)
    for p in ids:
        pair = []
        for _ in range(2):
            run = engine.start(GenerationRequest(p, max_tokens=args.steps + 2, native_mtp="off"))
            for _chunk in run.begin():
                pass
            pair.append(run)
        solo.append(pair[0])
        batch.add(pair[1])
    if args.vectors:
        batch_vectors(engine)
    engine.model.set_batch_invariant(False)  # the linear layers take their batch-invariant class before recording
    instrument(engine.model)
    tokens = mx.concatenate([run.pending_token.reshape(1) for run in solo])
    firsts: Counter[str] = Counter()
    print(f"{args.model} on {device_name()}{' with --vectors' if args.vectors else ''}{' with --invariant' if args.invariant else ''}: B = {args.size} prompts of {sorted(len(p) for p in ids)} tokens, "
          f"{args.steps} decode steps")
    for step in range(args.steps):
        RECORD.clear()
        _BatchVectors.on = args.vectors
        engine.model.set_batch_invariant(args.invariant)
        hidden = engine.forward.hidden(tokens[:, None], batch.cache)
        weight = engine.model.output_weight() if args.invariant else None
        logits = vector_matmul(hidden, weight) if weight is not None else engine.model.logits(hidden)
        batched_next = mx.argmax(logits[:, -1], axis=-1)
        engine.model.set_batch_invariant(False)
        _BatchVectors.on = False
        mx.eval(batched_next, [out for _, out in RECORD])
        batched = list(RECORD)
        alone, solo_next = [], []
        for i, run in enumerate(solo):
            RECORD.clear()
            h = engine.forward.hidden(tokens[i].reshape(1, 1), run.cache)
            solo_next.append(mx.argmax(engine.model.logits(h)[:, -1], axis=-1))
            mx.eval(solo_next[-1], [out for _, out in RECORD])
            alone.append(list(RECORD))
        following = mx.concatenate(solo_next)
        flips = int((following != batched_next).sum().item())
        first = first_difference(batched, alone)
        firsts[first or "none"] += 1
        print(f"step {step:3d}: first module to differ: {first or 'none'}; greedy tokens differing: {flips}")
        tokens = following
    print("first module to differ, over the steps: " + ", ".join(f"{name} x{n}" for name, n in firsts.most_common()))


if __name__ == "__main__":
    main()
