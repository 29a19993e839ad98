"""How fast a long prompt prefills: stock mlx-lm vs exo, one GatedDeltaNet layer's recurrence by method, and
where a prompt's time goes. Three phases in one process, each printing its own figures:

1. ``layer``: the gated delta rule of one GatedDeltaNet layer (default: Qwen3.5-9B's, 16 key heads, 32 value
   heads, head dim 128) over ``--layer-tokens`` rows (each; a few rows show what one call costs whatever its
   length: a prefix-cache snapshot edge cuts a prompt's prefill into such pieces) of random bfloat16 inputs,
   alternating: mlx-lm's
   per-token step (``gated_delta_ops``: what stock runs on CUDA and the CPU), MLX's fused
   ``mx.fast.gated_delta_update``, exo's chunked form at each ``--gdn-chunk`` (on MLX CUDA also with its state
   steps in one CUDA kernel, ``gated_delta_states_cuda``), exo's CPU kernel (on the CPU)
   and mlx-lm's Metal kernel (on Apple GPUs), and the chunked form's parallel products alone (what its
   chunk-to-chunk state steps add is the difference). Each method's largest difference from the loop's outputs and
   state, relative to their scale, is printed beside its time (on MLX CUDA this checks the float32
   tolerance of tests/engine/test_gated_delta_chunked.py on the device).
2. ``model``: MODEL's whole prefill, stock mlx-lm (its model classes, 2048-token steps as its
   ``generate_step`` prefills, the last token's logits) vs exo's engine (``SequenceState.prefill``, the first
   token chosen) with the chunked GatedDeltaNet form at each ``--prefill-chunk`` (its state steps in their CUDA
   kernel where usable, MLX ops elsewhere: ``gdn_prefill="chunked"``), with the prompt kernel where the load's
   check passed (a chunk's rows in one launch a layer, each row its decode step's bits: what ``gdn_prefill="auto"``
   runs on MLX CUDA), with ``--long-attention`` that default with and without a long context's chunks attending in
   key blocks (``EXO_LONG_ATTENTION``, ``engine/models/long_attention.py``) and, up to ``--loop-max``
   tokens, with the token loop (``gdn_prefill="loop"``), alternating, for each ``--tokens`` length. Stock runs
   up to ``--stock-max`` tokens (at ~340 tokens/s a 32k prompt takes stock 1.5 minutes per repeat). Prints
   tokens/s and exo / stock. The first token of stock and exo is compared (the same greedy token or not).
3. ``profile``: one exo prefill of ``--profile-tokens`` tokens in ``--prefill-chunk`` chunks with every part
   of every layer evaluated on its own (so the parts' sum runs slower than the real forward: the sync after
   each part costs its latency), summed by kind: embedding, norms, GatedDeltaNet input projections, conv +
   q/k norms, the recurrence, gated norm + output projection, attention projections (+ rope, cache update),
   SDPA, attention output, MLP, MoE router / experts / shared expert, lm_head; then the same chunks through
   the real forward (``forward.hidden``, one evaluation per chunk as the engine prefills) for the total, and
   the engine's prefill for what its per-chunk host work adds. The real forward is also split into the host's
   graph building and the evaluation. ``--profile-context C`` profiles the chunks after C tokens already in the
   caches (a cached turn's new tokens after its restored prefix; each run starts from a copy of those caches);
   ``--profile-cold`` runs the parts first at shapes the process has not run (as a cached turn meets them), then
   again: which part pays for a new shape.

    python bench/prefill.py MODEL [--tokens 4096 32768] [--prefill-chunk 2048 4096] [--phases layer model profile]
    python bench/prefill.py exo-demo --device cpu --tokens 128 --layer-tokens 256 8 --layer-shape 2,4,64 --profile-tokens 256

On a small machine: a random checkpoint with few layers (``bench/make_random_model.py --layers 4``) and short
prompts. Targets (the issue's, reported, never asserted): 9B 4-bit at 4,096 tokens >= 8,000 tokens/s and >= 20x
stock; at 32,768 >= 6,000 tokens/s; 35B-A3B >= 10x stock.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import statistics
import time
from collections import defaultdict
from typing import Any

import mlx.core as mx
from common import add_common_arguments, report_to, use_device  # bench/ is this script's folder
from mlx_lm.models.gated_delta import compute_g, gated_delta_kernel, gated_delta_ops, normalize_qk

from exo.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, load_checkpoint
from exo.engine.costs import device_name
from exo.engine.forward import prompt_eval_every
from exo.engine.kernels import cuda_gdn
from exo.engine.models import gated_delta_chunked as chunked
from exo.engine.models import gated_delta_states_cuda as states_cuda
from exo.engine.models import layers, long_attention, prompt_dense


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=2)
    parser.add_argument("--phases", nargs="+", default=["layer", "model", "profile"],
                        choices=["layer", "model", "profile"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768], help="prompt lengths (model)")
    parser.add_argument("--prefill-chunk", type=int, nargs="+", default=[2048],
                        help="exo's prefill chunk(s) (EngineConfig.prefill_chunk)")
    parser.add_argument("--stock-max", type=int, default=4096, help="longest prompt stock mlx-lm prefills")
    parser.add_argument("--loop-max", type=int, default=4096, help="longest prompt exo prefills with the loop")
    parser.add_argument("--long-attention", action="store_true",
                        help="model: also exo's default with a long context's chunks attending in key blocks "
                             "(EXO_LONG_ATTENTION's value where it applies here, else from 8,192 keys in blocks of 4,096)")
    parser.add_argument("--layer-tokens", type=int, nargs="+", default=[4096, 64, 8],
                        help="rows of the layer phase (short ones show a call's fixed cost)")
    parser.add_argument("--layer-shape", default="16,32,128", help="Hk,Hv,D of the layer phase")
    parser.add_argument("--gdn-chunk", type=int, nargs="+", default=[64], help="chunk sizes of the chunked form")
    parser.add_argument("--profile-tokens", type=int, default=8192)
    parser.add_argument("--profile-context", type=int, default=0,
                        help="tokens in the caches before the profiled chunks (a cached turn's new tokens: the "
                             "prefix prefilled first, untimed)")
    parser.add_argument("--profile-cold", action="store_true",
                        help="profile: the parts first at shapes new to the process (no warm-up), then again")
    args = parser.parse_args()
    use_device(args.device)
    with report_to(args.json) as report:
        report.update(model=args.model, device=device_name(), mlx=mx.__version__)
        print(f"device: {device_name()} (MLX {mx.__version__}), model {args.model}")
        if "layer" in args.phases:
            report["layer"] = [layer_phase(args, t) for t in args.layer_tokens]
        if {"model", "profile"} & set(args.phases):
            loaded = load_checkpoint(_resolve(args.model))
            loaded = dataclasses.replace(loaded, eos_token_ids=frozenset())
            if "model" in args.phases:
                report["model"] = model_phase(args, loaded)
            if "profile" in args.phases:
                report["profile"] = profile_phase(args, loaded)


def _resolve(model: str) -> Any:
    from exo.engine import resolve_model

    return resolve_model(model).path


def _sync() -> None:
    mx.synchronize()


def _timed(fn, repeats: int) -> tuple[float, Any]:
    """Median seconds of ``repeats`` runs of ``fn`` (each evaluated) and the last result."""
    times, out = [], None
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        out = fn()
        mx.eval(out)
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _rel_err(got: tuple[mx.array, mx.array], want: tuple[mx.array, mx.array]) -> float:
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        g, w = g.astype(mx.float32), w.astype(mx.float32)
        worst = max(worst, mx.abs(g - w).max().item() / max(1.0, mx.abs(w).max().item()))
    return worst


# -- 1. one layer -------------------------------------------------------------------------------------------
def layer_phase(args: argparse.Namespace, T: int) -> dict[str, Any]:
    hk, hv, d = (int(x) for x in args.layer_shape.split(","))
    mx.random.seed(0)
    q, k = normalize_qk(mx.random.normal((1, T, hk, d)), mx.random.normal((1, T, hk, d)), inv_scale=d**-0.5, eps=1e-6)
    q, k, v = q.astype(mx.bfloat16), k.astype(mx.bfloat16), mx.random.normal((1, T, hv, d)).astype(mx.bfloat16)
    a, b = mx.random.normal((1, T, hv)).astype(mx.bfloat16), mx.random.normal((1, T, hv)).astype(mx.bfloat16)
    A_log = mx.log(mx.random.uniform(1, 16, (hv,)))
    dt_bias = (0.5 * mx.random.normal((hv,))).astype(mx.bfloat16)
    state = 0.1 * mx.random.normal((1, hv, d, d))
    g, beta = compute_g(A_log, a, dt_bias), mx.sigmoid(b)
    log_g = chunked.log_decay(A_log, a, dt_bias)
    mx.eval(q, k, v, g, beta, log_g, state)
    methods: dict[str, Any] = {"mlx-lm per-token step": lambda: gated_delta_ops(q, k, v, g, beta, state)}
    if hasattr(mx.fast, "gated_delta_update"):
        methods["mx.fast.gated_delta_update"] = lambda: tuple(mx.fast.gated_delta_update(q, k, v, g, beta, state))
    for c in args.gdn_chunk:
        methods[f"exo chunked (C={c})"] = lambda c=c: chunked.gated_delta_chunked(q, k, v, log_g, beta, state, None, c)
        # its parallel part alone (the rest: the chunk-to-chunk state steps and the outputs' reads of them)
        methods[f"C={c}: products only"] = lambda c=c: chunked.chunk_products(q, k, v, log_g, beta, None, c)
        if states_cuda.applies(d, d):  # the state steps in one CUDA kernel instead of 3 products a chunk
            methods[f"C={c}, CUDA state kernel"] = lambda c=c: chunked.gated_delta_chunked(
                q, k, v, log_g, beta, state, None, c, steps=states_cuda.chunk_states)
    if mx.default_device() == mx.cpu:
        from exo.engine import kernels

        kernel = kernels.cpu_gated_delta()
        if kernel is not None:
            methods["exo CPU kernel"] = lambda: kernel(q, k, v, g, beta, state, None)
    elif mx.metal.is_available():
        methods["mlx-lm Metal kernel"] = lambda: gated_delta_kernel(q, k, v, g, beta, state)
    reference = None
    rows = []
    for name, fn in list(methods.items()):  # warm-up (compilation) and the reference
        try:
            out = fn()
            mx.eval(out)
        except Exception as e:  # noqa: BLE001 - a method that cannot run here is reported and left out
            print(f"[layer] {name}: {type(e).__name__}: {e}")
            del methods[name]
            continue
        if reference is None:
            reference = out
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(max(1, args.repeats) * (1 if T >= 1024 else 10)):
        for name, fn in methods.items():
            times[name].append(_timed(fn, 1)[0])
    print(f"\n[layer] the gated delta rule of one layer: Hk {hk}, Hv {hv}, D {d}, {T} tokens, bfloat16 in, "
          f"float32 state; error = max |x - loop| / max(1, max |loop|) over outputs and state")
    print(f"{'method':>30} {'ms':>9} {'tok/s':>10} {'vs loop':>8} {'error':>9}")
    base = statistics.median(times["mlx-lm per-token step"])
    for name, fn in methods.items():
        t = statistics.median(times[name])
        out = fn()
        err = _rel_err(out, reference) if len(out) == 2 else None  # (a part has no outputs of its own)
        rows.append(dict(method=name.strip(), ms=t * 1e3, tokens_per_s=T / t, vs_loop=base / t, error=err))
        shown = f"{err:9.2e}" if err is not None else f"{'':>9}"
        print(f"{name:>30} {t * 1e3:9.2f} {T / t:10.0f} {base / t:7.2f}x {shown}")
    return dict(tokens=T, shape=[hk, hv, d], rows=rows)


# -- 2. the whole model --------------------------------------------------------------------------------------
def _prompt(vocab: int, n: int) -> list[int]:
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(n)).tolist()


def _stock_prefill(model: Any, prompt: list[int], step: int = 2048) -> tuple[float, int]:
    """mlx-lm's prefill as ``generate_step`` runs it: 2048-token steps, each evaluated, then the last token's
    logits; returns (seconds, the greedy first token)."""
    from mlx_lm.models.cache import make_prompt_cache

    _sync()
    start = time.perf_counter()
    cache = make_prompt_cache(model)
    tokens = mx.array(prompt)
    for i in range(0, len(prompt) - 1, step):
        model(tokens[None, i : min(i + step, len(prompt) - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    logits = model(tokens[None, -1:], cache=cache)
    first = int(mx.argmax(logits[0, -1]).item())
    return time.perf_counter() - start, first


def _exo_prefill(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    _sync()
    start = time.perf_counter()
    run = engine.start(GenerationRequest(prompt, max_tokens=1, native_mtp="off",
                                         sampling=SamplingParams(temperature=0.0)))
    for _ in run.prefill():
        pass
    token = int(run.pending_token[0].item())  # the first token, chosen lazily by the prefill
    return time.perf_counter() - start, token


def model_phase(args: argparse.Namespace, loaded: Any) -> dict[str, Any]:
    from mlx_lm import load as stock_load

    vocab = int(loaded.model.text_model.embed_tokens.weight.shape[0])
    stock_model = None
    if min(args.tokens) <= args.stock_max:
        stock_model, _ = stock_load(str(loaded.path))
    engines, engines_modes = {}, {}
    text = loaded.model.text_model
    gdn = next((layer.linear_attn for layer in text.layers if hasattr(layer, "linear_attn")), None)
    kernel = gdn is not None and states_cuda.usable(gdn.head_k_dim, gdn.head_v_dim)  # what "auto" runs here
    dense = any(found.startswith("ok") for found in loaded.dense.values())  # prompt_dense: on by default on CUDA
    prompt_kernel = gdn is not None and gdn.gdn_prompt_kernel  # what "auto" runs where it passed its check
    limit = layers.PROMPT_KERNEL_MAX_ROWS
    form = cuda_gdn.PROMPT_VARIANT
    loaded_long = next((leaf.long_attention for _, leaf in loaded.model.named_modules()
                        if isinstance(leaf, layers.Attention)), None)  # what the load set (EXO_LONG_ATTENTION)
    long = (long_attention.configured() or (long_attention.MIN_KEYS, long_attention.BLOCK)) if args.long_attention else None
    for c in args.prefill_chunk:
        # (gdn_prefill, prompt_dense on, the prompt kernel's longest call, its form): the chunked form (its state
        # steps in their kernel where usable, as MLX ops elsewhere)
        modes = {("chunked", True, limit, form): f"exo chunked{'+kernel' if kernel else ''}, chunk {c}"}
        if prompt_kernel:  # the default on MLX CUDA: a call of <= limit rows in one launch a layer (gdn_prompt)
            reach = "every call" if limit is None else f"<= {limit}"
            modes[("auto", True, limit, form)] = f"exo default (prompt kernel form {form}, {reach}), chunk {c}"
            for variant in (1, 2):  # the kernel for every call, however long, in each form, in one process
                if (limit is not None and c > limit) or variant != form:
                    modes[("auto", True, c, variant)] = f"exo prompt kernel form {variant}, chunk {c}"
        if dense:  # the same default with MLX's quantized products (EXO_PROMPT_DENSE=off)
            modes[("auto", False, limit, form)] = f"exo default, qmm, chunk {c}"
        modes = {mode + (loaded_long,): name for mode, name in modes.items()}
        if long is not None:  # the default with a long context's attention in key blocks, and with MLX's call
            if long != loaded_long:
                modes[("auto", True, limit, form, long)] = f"exo default, attention in key blocks of {long[1]}, chunk {c}"
            if loaded_long is not None:
                modes[("auto", True, limit, form, None)] = f"exo default, MLX attention, chunk {c}"
        for mode, name in modes.items():
            engines[name] = Engine(loaded, EngineConfig(prefill_chunk=c, gdn_prefill=mode[0]))
            engines_modes[name] = mode
    engines["exo loop"] = Engine(loaded, EngineConfig(prefill_chunk=args.prefill_chunk[0], gdn_prefill="loop"))
    engines_modes["exo loop"] = ("loop", True, limit, form, loaded_long)
    print("\n[model] a prompt's quantized products on dequantized weights (prompt_dense): "
          + ("; ".join(f"{k}: {v}" for k, v in loaded.dense.items()) or "not used here"))
    print(f"\n[model] the chunked form's state-steps kernel: {'usable' if kernel else 'not usable here'}; the prompt "
          f"kernel (a chunk's rows in one launch, the default where usable): {'usable' if prompt_kernel else 'not here'}")
    results = []
    print(f"\n[model] prefill of MODEL's whole forward: stock mlx-lm vs exo, alternating, {args.repeats} repeats")
    for n in args.tokens:
        prompt = _prompt(vocab, n)
        configs: dict[str, Any] = {}
        if stock_model is not None and n <= args.stock_max:
            configs["stock mlx-lm"] = lambda: _stock_prefill(stock_model, prompt)  # noqa: B023
        for name, engine in engines.items():
            if name == "exo loop" and n > args.loop_max:
                continue

            def run(engine=engine, mode=engines_modes[name], tokens=prompt) -> tuple[float, int]:
                engine.model.set_gdn_prefill(mode[0])  # (the engines share the model's layers)
                layers.PROMPT_KERNEL_MAX_ROWS, cuda_gdn.PROMPT_VARIANT = mode[2], mode[3]
                layers.set_long_attention([loaded.model], mode[4])
                try:
                    with contextlib.nullcontext() if mode[1] else prompt_dense.suspended():
                        return _exo_prefill(engine, tokens)
                finally:
                    layers.PROMPT_KERNEL_MAX_ROWS, cuda_gdn.PROMPT_VARIANT = limit, form
                    layers.set_long_attention([loaded.model], loaded_long)

            configs[name] = run
        short = prompt[: min(n, 256)]
        for name in configs:  # warm-up (kernels compiled): a short prompt, a whole chunk for the dense products
            if name == "stock mlx-lm":
                _stock_prefill(stock_model, short)
            else:
                configs[name](tokens=short if name == "exo loop" else prompt[: min(n, 4096)])
        times: dict[str, list[float]] = defaultdict(list)
        firsts: dict[str, int] = {}
        for _ in range(max(1, args.repeats)):
            for name, fn in configs.items():
                t, first = fn()
                times[name].append(t)
                firsts[name] = first
        row: dict[str, Any] = {"tokens": n}
        stock_t = statistics.median(times["stock mlx-lm"]) if "stock mlx-lm" in times else None
        print(f"{n} tokens:")
        for name in configs:
            t = statistics.median(times[name])
            row[name] = {"s": t, "tokens_per_s": n / t, "first_token": firsts[name]}
            vs = f"  {stock_t / t:6.2f}x stock" if stock_t is not None else ""
            print(f"  {name:>28} {t:8.3f} s {n / t:10.0f} tok/s{vs}  first token {firsts[name]}")
            if stock_t is not None:
                row[name]["vs_stock"] = stock_t / t
        results.append(row)
    return dict(rows=results)


# -- 3. where the time goes ----------------------------------------------------------------------------------
class Parts:
    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)

    def __call__(self, name: str, fn, *args: Any) -> Any:
        _sync()
        start = time.perf_counter()
        out = fn(*args)
        mx.eval(out)
        _sync()
        self.s[name] += time.perf_counter() - start
        return out


def _gdn_parts(parts: Parts, layer: Any, x: mx.array, cache: Any) -> mx.array:
    """The GatedDeltaNet layer's prefill (``layers._mix``'s unmasked, unrecorded path) part by part."""
    B, S, _ = x.shape
    qkv, z, b, a = parts("gdn input projections", layer.input_projections, x)  # (fused or not, as the layer runs)

    def conv() -> tuple[mx.array, ...]:
        window = cache[0] if cache[0] is not None else mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), qkv.dtype)
        conv_input = mx.concatenate([window, qkv], axis=1)
        chunked_here = layers.chunked_prefill(getattr(layer, "gdn_prefill", "auto"), S, _on_cuda())
        out = layers._silu(layer, layers._conv(layer, conv_input, False, chunked_here))
        q, k, v = [t.reshape(B, S, h, d) for t, h, d in zip(
            mx.split(out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim], strict=True)]
        q, k = layers.fused_normalize_qk(q, k, layer.head_k_dim**-0.5, 1e-6)
        return q, k, v, mx.contiguous(conv_input[:, -(layer.conv_kernel_size - 1):])

    q, k, v, window = parts("gdn conv + q/k norms", conv)
    out, state = parts("gdn recurrence", lambda: layers._recurrence(layer, q, k, v, a, b, cache[1], None))
    cache[0], cache[1] = window, state
    cache.advance(S)
    return parts("gdn gated norm + out_proj", lambda: layer.out_proj(layer.norm(out, z).reshape(B, S, -1)))


def _attention_parts(parts: Parts, attn: Any, x: mx.array, cache: Any, mask: Any) -> mx.array:
    B, L, _ = x.shape
    queries, keys, values, gate = parts("attention projections + rope + cache", lambda: attn._project(x, cache))
    out = parts("attention SDPA", lambda: attn.attend(queries, keys, values, cache, mask))
    return parts("attention output", lambda: attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate)))


def _mlp_parts(parts: Parts, mlp: Any, x: mx.array) -> mx.array:
    if not isinstance(mlp, layers.SparseMoeBlock):
        return parts("mlp", lambda: mlp(x))
    inds, scores, shared_logit = parts("moe router", lambda: mlp._routed(x))  # (the shared gate's too, fused)
    if mlp.dense_experts_from and inds.size >= mlp.dense_experts_from and prompt_dense.active():  # as _block
        experts = parts("moe experts", lambda: prompt_dense.experts_dense(mlp.switch_mlp, x, inds))
    elif mlp.sort_experts:
        experts = parts("moe experts", lambda: mlp.switch_mlp(x, inds))
    else:
        experts = parts("moe experts", lambda: layers.experts_unsorted(mlp.switch_mlp, x, inds))
    shared = parts("moe shared expert", lambda: mx.sigmoid(
        mlp.shared_expert_gate(x) if shared_logit is None else shared_logit) * mlp.shared_expert(x))
    return parts("moe combine", lambda: (experts * scores[..., None]).sum(axis=-2) + shared)


def profile_phase(args: argparse.Namespace, loaded: Any) -> dict[str, Any]:
    from mlx_lm.models.base import create_attention_mask

    model = loaded.model
    vocab = int(model.text_model.embed_tokens.weight.shape[0])
    n, step, context = args.profile_tokens, args.prefill_chunk[0], args.profile_context
    prompt = mx.array(_prompt(vocab, context + n))[None]
    engine = Engine(loaded, EngineConfig(prefill_chunk=step))  # gdn_prefill "auto": what this device runs
    mx.eval(model.hidden(prompt[:, :256], model.make_cache()))  # warm-up
    base = model.make_cache()
    for lo in range(0, context, step):  # the prefix (untimed)
        mx.eval(model.hidden(prompt[:, lo : min(lo + step, context)], base), [c.state for c in base])
    spans = [(lo, min(lo + step, context + n)) for lo in range(context, context + n, step)]

    def parts_pass() -> tuple[Parts, float]:
        parts = Parts()
        cache = copy.deepcopy(base)
        _sync()
        start = time.perf_counter()
        for lo, hi in spans:
            tokens = prompt[:, lo:hi]
            h = parts("embedding", lambda: model.text_model.embed_tokens(tokens))  # noqa: B023
            fa = next(i for i, layer in enumerate(model.stage_layers) if not layer.is_linear)
            mask = create_attention_mask(h, cache[fa])
            for layer, c in zip(model.stage_layers, cache, strict=True):
                x = parts("norms", layer.input_layernorm, h)
                if layer.is_linear:
                    r = _gdn_parts(parts, layer.linear_attn, x, c)
                else:
                    r = _attention_parts(parts, layer.self_attn, x, c, mask)
                h = parts("residuals", lambda: h + r)  # noqa: B023
                x = parts("norms", layer.post_attention_layernorm, h)
                m = _mlp_parts(parts, layer.mlp, x)
                h = parts("residuals", lambda: h + m)  # noqa: B023
            h = parts("norms", model.text_model.norm, h)
            parts("lm_head (last row)", lambda: model.logits(h[:, -1:]))  # noqa: B023
        return parts, time.perf_counter() - start

    first = None
    if args.profile_cold:  # the parts at shapes this process has not run yet (a cached turn's new chunk), then again
        first, first_s = parts_pass()
    else:
        mx.eval(model.hidden(prompt[:, context : context + spans[0][1] - spans[0][0]], copy.deepcopy(base)))  # warm
    parts, by_parts = parts_pass()
    every = prompt_eval_every(spans[0][1] - spans[0][0])  # what the engine's forward does on this device
    runs: dict[int, list[tuple[float, float, float]]] = {0: [], every: []}
    for _ in range(max(1, args.repeats)):
        for e in runs:  # alternating
            cache = copy.deepcopy(base)
            _sync()
            build = evaluate = 0.0
            for lo, hi in spans:
                t0 = time.perf_counter()
                out = model.logits(model.stage_hidden(prompt[:, lo:hi], cache, eval_every=e)[:, -1:])
                t1 = time.perf_counter()
                mx.eval(out, [c.state for c in cache])
                _sync()
                build += t1 - t0
                evaluate += time.perf_counter() - t1
            runs[e].append((build + evaluate, build, evaluate))
    forward, build, evaluate = sorted(runs[0])[len(runs[0]) // 2]
    staged = sorted(runs[every])[len(runs[every]) // 2][0]
    engine_s = _exo_prefill(engine, prompt[0].tolist())[0] if context == 0 else None
    chunks = len(spans)
    total = sum(parts.s.values())
    where = f" after {context} tokens in the caches" if context else ""
    print(f"\n[profile] {n} tokens in {chunks} chunks of {step}{where}, every part evaluated on its own "
          f"(gdn_prefill auto: {'chunked' if layers.chunked_prefill('auto', hi - lo, _on_cuda()) else 'kernel/loop'})")
    print(f"{'part':>40} {'s':>8} {'share':>7}" + (f" {'first s':>8} {'first-s':>8}" if first else ""))
    rows = {}
    for name, s in sorted(parts.s.items(), key=lambda kv: -kv[1]):
        rows[name] = s
        extra = f" {first.s[name]:8.3f} {first.s[name] - s:8.3f}" if first else ""
        print(f"{name:>40} {s:8.3f} {s / total:6.1%}{extra}")
    print(f"{'sum of parts (a sync after each)':>40} {by_parts:8.3f}" + (f"        {first_s:8.3f} (first: shapes new to "
          "this process)" if first else ""))
    print(f"{'real forward (one sync per chunk)':>40} {forward:8.3f}  {n / forward:8.0f} tok/s  (median of "
          f"{len(runs[0])}: the host's graph building {build * 1e3:.1f} ms, evaluation {evaluate * 1e3:.1f} ms)")
    if every:
        print(f"{f'evaluated every {every} layers as built':>40} {staged:8.3f}  {n / staged:8.0f} tok/s  "
              f"({forward / staged:.3f}x the one evaluation; forward.prompt_eval_every, what the engine runs)")
    if engine_s is not None:
        print(f"{'engine prefill':>40} {engine_s:8.3f}  {n / engine_s:8.0f} tok/s  "
              f"(host work per chunk beyond the forward: {(engine_s - forward) / chunks * 1e3:.1f} ms)")
    return dict(tokens=n, chunk=step, context=context, parts_s=rows, sum_of_parts_s=by_parts, forward_s=forward,
                build_s=build, eval_s=evaluate, eval_every=every, staged_s=staged, engine_s=engine_s)


def _on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


if __name__ == "__main__":
    main()
