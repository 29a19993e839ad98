"""exo's CPU kernels against MLX's bfloat16 matmul and mlx-lm's gated delta ops, on a model's shapes (this machine).

    python bench/cpu_kernels.py [MODEL] [--rows 1 2 4 8 32] [--iters 200] [--delta 1x1 8x1 1x22 1x512]

For every distinct (out, in) shape of MODEL's linear layers and its lm_head (exo-demo by default), and each
row count, times ``x @ w.T`` (MLX), ``kernels.cpu_linear()(x, w)`` (exo) and ``kernels.cpu_linear_packed()`` on
``pack_linear(w)`` (exo, what the layers run), alternating, each call evaluated alone, and checks that all
give the same bits. Prints the median time of each and their ratio, then the
whole step's worth of linear layers (every layer's shape, as often as the model has it) per row count.
Then, for MODEL's GatedDeltaNet heads, the recurrence of one layer over B sequences of T rows (``--delta BxT``:
a decode step, a batch's step, prompts) by mlx-lm's ``gated_delta_ops`` and by ``kernels.cpu_gated_delta()``,
with the same check of y and the state; and a prompt's prefill through MODEL's whole forward (``--prefill``
lengths) with its GatedDeltaNet layers on the kernel and on mlx-lm's ops, alternating, with the same check
of the hidden states. Then MODEL's attention (``--attention TxL``: T queries over L keys) by MLX's
``scaled_dot_product_attention`` and by ``layers.cpu_attention`` (its products on the linear kernel), and a
prefill chunk deep in a prompt (``--chunk-at T@L``) through the whole forward with either, checked the same.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import mlx.core as mx
import mlx.nn as nn

from exo.engine import kernels, load
from exo.engine.kernels import bits_equal, gated_delta_inputs


def timed(fn, iters: int) -> list[float]:
    mx.eval(fn())
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        mx.eval(fn())
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--delta", nargs="*", default=["1x1", "2x1", "8x1", "1x22", "1x512"],
                        help="BxT shapes of the gated delta comparison (none: skip it)")
    parser.add_argument("--prefill", type=int, nargs="*", default=[22, 512], help="prompt lengths (none: skip)")
    parser.add_argument("--attention", nargs="*", default=["1x1024", "1x8192", "512x8192"],
                        help="TxL: T queries over L keys, an attention layer of MODEL (none: skip)")
    parser.add_argument("--chunk-at", nargs="*", default=["512@8192"],
                        help="T@L: a T-token prefill chunk after L prompt tokens through MODEL's forward (none: skip)")
    args = parser.parse_args()
    linear = kernels.cpu_linear()
    if linear is None:
        raise SystemExit(f"exo's CPU kernel is not in use here: {kernels.status()}")
    engine = load(args.model)
    shapes: Counter[tuple[int, int]] = Counter()
    for _, module in engine.loaded.model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and "bias" not in module and module.weight.ndim == 2:
            shapes[tuple(module.weight.shape)] += 1
    print(f"{args.model}: {sum(shapes.values())} linear layers / tables, {len(shapes)} shapes; "
          f"median of {args.iters} calls each, MLX vs exo alternating")
    print(f"exo: ``linear`` (w transposed in every call) and ``linear_packed`` (w packed once, what the layers use), "
          f"built for {kernels.isa()}")
    print(f"{'rows':>4} {'shape (out x in)':>18} {'count':>5} {'MLX ms':>8} {'exo ms':>8} {'packed':>8} {'MLX/exo':>8} "
          f"{'MLX/packed':>10}  same bits")
    packed = kernels.cpu_linear_packed()
    for rows in args.rows:
        step_mlx = step_exo = step_packed = 0.0
        for (n, k), count in sorted(shapes.items()):
            x = mx.random.normal((rows, k), key=mx.random.key(rows * 7 + k)).astype(mx.bfloat16)
            w = (mx.random.normal((n, k), key=mx.random.key(n)) * 0.05).astype(mx.bfloat16)
            wp = kernels.pack_linear(w)
            want = x @ w.T
            same = bits_equal(want, linear(x, w)) and bits_equal(want, packed(x, wp, n))
            t_mlx, t_exo, t_packed = [], [], []
            for _ in range(args.iters // 20):
                t_mlx += timed(lambda: x @ w.T, 10)  # noqa: B023
                t_exo += timed(lambda: linear(x, w), 10)  # noqa: B023
                t_packed += timed(lambda: packed(x, wp, n), 10)  # noqa: B023
            m, e, p = (statistics.median(t) * 1e3 for t in (t_mlx, t_exo, t_packed))
            step_mlx += m * count
            step_exo += e * count
            step_packed += p * count
            print(f"{rows:>4} {f'{n} x {k}':>18} {count:>5} {m:8.3f} {e:8.3f} {p:8.3f} {m / e:8.2f}x {m / p:9.2f}x  {same}")
        print(f"{rows:>4} {'a step':>18} {sum(shapes.values()):>5} {step_mlx:8.3f} {step_exo:8.3f} {step_packed:8.3f} "
              f"{step_mlx / step_exo:8.2f}x {step_mlx / step_packed:9.2f}x")
    if args.delta:
        gated_delta(engine, args.delta, args.iters)
    if args.prefill:
        prefill(engine, args.prefill)
    if args.attention or args.chunk_at:
        attention(engine, args.attention, args.chunk_at)


def attention(engine, shapes: list[str], chunks: list[str]) -> None:
    """MLX's scaled-dot-product attention vs ``layers.cpu_attention`` (its two products on the linear kernel), one
    layer of MODEL's heads; then whole prefill chunks deep in a prompt with every attention layer on each."""
    from exo.engine.models.layers import Attention, cpu_attention

    modules = [m for _, m in engine.loaded.model.named_modules() if isinstance(m, Attention) and m.cpu_linear]
    if not modules:
        print("\nno attention layer takes the kernel here")
        return
    layer = modules[0]
    h, hk, d = layer.num_attention_heads, layer.num_key_value_heads, layer.head_dim
    print(f"\nattention, {h} query heads over {hk} key heads of {d}: MLX's vs exo's products, alternating")
    print(f"{'T x L':>12} {'MLX ms':>9} {'exo ms':>9} {'ratio':>7}  same bits")
    for shape in shapes:
        t, length = (int(v) for v in shape.split("x"))
        key = mx.random.key(t + length)
        q, k, v = (mx.random.normal(s, key=kk).astype(mx.bfloat16) for s, kk in
                   zip([(1, h, t, d), (1, hk, length, d), (1, hk, length, d)], mx.random.split(key, 3), strict=True))
        mask = "causal" if t > 1 else None
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=layer.scale, mask=mask)
        same = bits_equal(want, cpu_attention(layer.cpu_linear, q, k, v, layer.scale, mask))
        iters = max(3, min(50, 2_000_000 // (t * length)))
        t_mlx, t_exo = [], []
        for _ in range(3):
            t_mlx += timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=layer.scale, mask=mask), iters)  # noqa: B023
            t_exo += timed(lambda: cpu_attention(layer.cpu_linear, q, k, v, layer.scale, mask), iters)  # noqa: B023
        m, e = statistics.median(t_mlx) * 1e3, statistics.median(t_exo) * 1e3
        print(f"{shape:>12} {m:9.2f} {e:9.2f} {m / e:6.2f}x  {same}")
    if not chunks:
        return
    print(f"\na prefill chunk after a prompt's first L tokens, MODEL's whole forward with its {len(modules)} attention "
          f"layers on MLX's vs exo's products (alternating)")
    print(f"{'T @ L':>12} {'MLX ms':>9} {'exo ms':>9} {'ratio':>7}  same bits")
    linear = layer.cpu_linear
    vocab = engine.loaded.model.text_model.embed_tokens.weight.shape[0]
    for spec in chunks:
        t, length = (int(v) for v in spec.split("@"))
        prompt = mx.random.randint(0, vocab, (1, length + t), key=mx.random.key(length)).astype(mx.uint32)
        def run(on: bool, prompt=prompt, length=length) -> tuple[float, mx.array]:
            for m in modules:
                m.cpu_linear = linear if on else None
            cache = engine.forward.new_cache()  # the first L tokens, untimed
            for start in range(0, length, 2048):
                mx.eval(engine.forward.hidden(prompt[:, start : min(start + 2048, length)], cache), [c.state for c in cache])
            begin = time.perf_counter()
            hidden = engine.forward.hidden(prompt[:, length:], cache)
            mx.eval(hidden, [c.state for c in cache])
            return time.perf_counter() - begin, hidden

        t_mlx, t_exo, same = [], [], True
        for _ in range(3):
            a, x = run(False)
            b, y = run(True)
            t_mlx.append(a)
            t_exo.append(b)
            same = same and bits_equal(x, y)
        m, e = statistics.median(t_mlx) * 1e3, statistics.median(t_exo) * 1e3
        print(f"{spec:>12} {m:9.1f} {e:9.1f} {m / e:6.2f}x  {same}")
    for m in modules:
        m.cpu_linear = linear


def prefill(engine, lengths: list[int]) -> None:
    layers = [m for _, m in engine.loaded.model.named_modules() if getattr(m, "cpu_gated_delta", None) is not None]
    if not layers:
        return
    kernel = layers[0].cpu_gated_delta
    vocab = engine.loaded.model.text_model.embed_tokens.weight.shape[0]
    print(f"\na prompt's prefill through {len(layers)} GatedDeltaNet layers' recurrence on mlx-lm's ops vs exo's kernel "
          f"(the rest of the forward the same), alternating")
    print(f"{'tokens':>6} {'mlx-lm ms':>10} {'exo ms':>8} {'ratio':>7}  same bits")

    def run(prompt, on: bool) -> tuple[float, mx.array]:
        for layer in layers:
            layer.cpu_gated_delta = kernel if on else None
        cache = engine.forward.new_cache()
        start = time.perf_counter()
        hidden = engine.forward.hidden(prompt, cache)
        mx.eval(hidden, [c.state for c in cache])
        return time.perf_counter() - start, hidden

    for n in lengths:
        prompt = mx.random.randint(0, vocab, (1, n), key=mx.random.key(n)).astype(mx.uint32)
        t_ops, t_exo, same = [], [], True
        for _ in range(max(3, 60 // max(1, n // 22))):
            t, a = run(prompt, False)
            t_ops.append(t)
            t, b = run(prompt, True)
            t_exo.append(t)
            same = same and bits_equal(a, b)
        m, e = statistics.median(t_ops) * 1e3, statistics.median(t_exo) * 1e3
        print(f"{n:>6} {m:10.1f} {e:8.1f} {m / e:6.2f}x  {same}")
    for layer in layers:
        layer.cpu_gated_delta = kernel


def gated_delta(engine, shapes: list[str], iters: int) -> None:
    from mlx_lm.models.gated_delta import gated_delta_ops

    kernel = kernels.cpu_gated_delta()
    layer = next((m for _, m in engine.loaded.model.named_modules() if hasattr(m, "head_k_dim") and hasattr(m, "A_log")), None)
    if kernel is None or layer is None:
        print("no GatedDeltaNet layer in this model" if layer is None else f"no kernel: {kernels.status()}")
        return
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    count = sum(1 for _, m in engine.loaded.model.named_modules() if type(m) is type(layer))
    print(f"\nthe gated delta rule of one layer (Hk {hk}, Hv {hv}, Dk {dk}, Dv {dv}; {count} such layers), "
          f"mlx-lm's gated_delta_ops vs exo's kernel, alternating")
    print(f"{'B x T':>8} {'mlx-lm ms':>10} {'exo ms':>8} {'mlx-lm/exo':>10}  same bits")
    for shape in shapes:
        b, t = (int(v) for v in shape.lower().split("x"))
        args = gated_delta_inputs(mx.random.key(b * 100 + t), b, t, hk, hv, dk, dv)
        mx.eval(args)
        want, got = gated_delta_ops(*args), kernel(*args, None)
        same = bits_equal(want[0], got[0]) and bits_equal(want[1], got[1])
        reps = max(2, min(iters, 4000 // t) // 10)
        t_ops, t_exo = [], []
        for _ in range(reps):
            t_ops += timed(lambda: gated_delta_ops(*args), 5)  # noqa: B023
            t_exo += timed(lambda: kernel(*args, None), 5)  # noqa: B023
        m, e = statistics.median(t_ops) * 1e3, statistics.median(t_exo) * 1e3
        print(f"{shape:>8} {m:10.3f} {e:8.3f} {m / e:9.2f}x  {same}")


if __name__ == "__main__":
    main()
