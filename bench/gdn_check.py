"""Does exo's GatedDeltaNet step kernel (engine/kernels/cuda_gdn.py) compute a call of T rows as T calls of one
row, near mlx-lm's ops, and what does a layer's decode step and verify call cost with it against the compiled
row graph (models.layers._row_step), on a model's real layers?

    python bench/gdn_check.py MODEL [--rows 1 2 3 4 8] [--calls 20] [--repeats 5] [--prompt-rows 8 64 554 2048 4096]

Per distinct GatedDeltaNet shape of the model: the load-time check's finding (``cuda_gdn.check``: rows of one call
against the calls of one row after another, bit for bit; y and the states against mlx-lm's ops), then per T on
the model's first such layer with random inputs after a random state:
- ``rows==steps``: the kernel's T-row call gives every row's y and state the bits of T one-row calls;
- ``y err`` / ``state err``: the kernel against mlx-lm's ops row by row (``cuda_gdn.reference``), the largest
  difference over the largest value;
- microseconds per call (``calls`` in one evaluation, median of ``repeats``): the kernel alone (``kernel``), and the
  whole layer's recorded call of T rows (projections, the step, the gated norm, out_proj, the states recorded) with
  the kernel (``layer+k``) and with the compiled row graph once per row (``layer+c``, today's path), and
  ``layer+c / layer+k``.
Then the prompt kernel (``cuda_gdn.gdn_prompt``: a prompt chunk of any length in one launch), both its forms
(``PROMPT_VARIANT`` 1, the default, and 2, the next tile prepared while this one's rows step), per ``--prompt-rows``
T: ``form N == steps``, its y and last state against the step kernel over the same rows in calls of ``MAX_ROWS``, bit
for bit; milliseconds per call of the kernel alone, and of the whole layer on a prompt chunk of T rows (input
projections, the recurrence, the gated norm, out_proj) through it (``layer+pN``, the default under
``gdn_prefill="auto"`` up to ``PROMPT_KERNEL_MAX_ROWS``, here at every T) against the chunked form with its state
steps' kernel (``layer+ch``, the default beyond).
Exits 1 when a call's rows differ from its rows one after another. On the CPU the kernel is ``reference`` (the
script runs; the times say nothing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from common import add_common_arguments, report_to, use_device  # noqa: E402

from exo.engine import load  # noqa: E402
from exo.engine.costs import device_name  # noqa: E402
from exo.engine.kernels import cuda_gdn  # noqa: E402
from exo.engine.models import layers as model_layers  # noqa: E402
from exo.engine.models.layers import GatedDeltaNet, NextGatedDeltaNet, RollbackArraysCache  # noqa: E402


def per_call_us(fn, calls: int, repeats: int) -> float:
    mx.eval([fn() for _ in range(calls)])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 2, 3, 4, 8],
                        help="rows of the step kernel's calls (none: skip that part)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--prompt-rows", type=int, nargs="*", default=[8, 64, 554, 2048, 4096],
                        help="prompt chunk lengths for the prompt kernel's part (none: skip it)")
    args = parser.parse_args()
    use_device(args.device)
    engine = load(args.model)
    model = engine.model
    gdn = [m for _, m in model.named_modules() if isinstance(m, (GatedDeltaNet, NextGatedDeltaNet))]
    ok = True
    with report_to(args.json) as report:
        print(f"{engine.loaded.model_id} on {device_name()}: {len(gdn)} GatedDeltaNet layers; kernel at load: "
              + ("; ".join(f"{k}: {v}" for k, v in engine.loaded.gdn.items()) or "not installed"))
        if not gdn or not cuda_gdn.supported(gdn[0]):
            print("no GatedDeltaNet layer this kernel takes")
            return 0
        layer = gdn[0]
        dtype = layer.conv1d.weight.dtype
        hidden = model.hidden_size
        key = mx.random.key(7)
        conv_dim = layer.conv1d.weight.shape[0]
        taps = layer.conv_kernel_size
        state0 = mx.random.normal((1, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), key=key) * 0.1
        window0 = (mx.random.normal((1, taps - 1, conv_dim), key=mx.random.split(key)[0]) * 0.5).astype(dtype)
        print(f"{'T':>2} {'rows==steps':>11} {'y err':>8} {'state err':>9} {'kernel':>8} {'layer+k':>8} {'layer+c':>8} "
              f"{'layer+c/layer+k':>15}")
        report["rows"] = []
        kernel_was = layer.gdn_kernel
        for t in args.rows:
            k1, k2, k3, k4 = mx.random.split(mx.random.key(100 + t), 4)
            qkv = (mx.random.normal((1, t, conv_dim), key=k1) * 0.5).astype(dtype)
            a = mx.random.normal((1, t, layer.num_v_heads), key=k2).astype(dtype)
            b = mx.random.normal((1, t, layer.num_v_heads), key=k3).astype(dtype)
            y, states = cuda_gdn.gdn_rows(layer, window0, qkv, a, b, state0)
            steps_y, steps_s, w, s = [], [], window0, state0
            for i in range(t):
                y1, s1 = cuda_gdn.gdn_rows(layer, w, qkv[:, i : i + 1], a[:, i : i + 1], b[:, i : i + 1], s)
                steps_y.append(y1)
                steps_s.append(s1[0])
                w, s = mx.concatenate([w, qkv[:, i : i + 1]], axis=1)[:, 1:], s1[0]
            ref_y, ref_s = cuda_gdn.reference(layer, window0, qkv, a, b, state0)
            mx.eval(y, states, steps_y, steps_s, ref_y, ref_s)
            same = (mx.array_equal(y, mx.concatenate(steps_y, axis=1)).item()
                    and mx.array_equal(states, mx.stack(steps_s)).item())
            ok &= bool(same)
            y_err = float((mx.abs(y.astype(mx.float32) - ref_y.astype(mx.float32)).max()
                           / mx.abs(ref_y.astype(mx.float32)).max()).item())
            s_err = float((mx.abs(states - ref_s).max() / mx.abs(ref_s).max()).item())
            kernel_us = per_call_us(lambda qkv=qkv, a=a, b=b: cuda_gdn.gdn_rows(layer, window0, qkv, a, b, state0), args.calls,
                                    args.repeats)
            x = (mx.random.normal((1, t, hidden), key=k4) * 0.5).astype(dtype)

            def layer_call(x=x, t=t):
                cache = RollbackArraysCache()
                cache[0], cache[1] = window0, state0
                cache.recording = t > 1
                out = layer(x, cache=cache)
                return [out, *cache.pending_arrays(), cache[1]]

            times = {}
            for name, on in (("kernel", True), ("compiled", False)):
                layer.gdn_kernel = on and kernel_was
                if name == "compiled" and model_layers.COMPILED_ROWS == "off":
                    times[name] = float("nan")
                    continue
                times[name] = per_call_us(layer_call, args.calls, args.repeats)
            layer.gdn_kernel = kernel_was
            print(f"{t:>2} {bool(same)!s:>11} {y_err:>8.1e} {s_err:>9.1e} {kernel_us:>8.1f} {times['kernel']:>8.1f} "
                  f"{times['compiled']:>8.1f} {times['compiled'] / times['kernel']:>15.2f}")
            report["rows"].append({"rows": t, "rows_equal_steps": bool(same), "y_error": y_err, "state_error": s_err,
                                   "kernel_us": kernel_us, "layer_kernel_us": times["kernel"],
                                   "layer_compiled_us": times["compiled"]})
        if args.prompt_rows:
            ok &= prompt_part(args, layer, hidden, window0, state0, report)
        report["exact"] = ok
        print("every call's rows equal its rows one after another: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


def prompt_part(args: argparse.Namespace, layer, hidden: int, window0: mx.array, state0: mx.array,
                report: dict) -> bool:
    """The prompt kernel's forms (``cuda_gdn.PROMPT_VARIANT`` 1 and 2) against the step kernel's rows (bits) and
    against the chunked form (time), per length."""
    variants = (1, 2)
    print(f"\nprompt kernel at load: {layer.gdn_prompt_kernel} (form {cuda_gdn.PROMPT_VARIANT}; tiles of "
          + ", ".join(f"{cuda_gdn.tile_rows(layer.head_k_dim, v)} rows (form {v})" for v in variants) + ")")
    print(f"{'T':>5} " + " ".join(f"{f'form {v} == steps':>15} {f'kernel {v} ms':>11} {f'layer+p{v} ms':>12}"
                                  for v in variants) + f" {'layer+ch ms':>11} {'ch / p1':>7} {'ch / p2':>7}")
    dtype = layer.conv1d.weight.dtype
    conv_dim = layer.conv1d.weight.shape[0]
    ok, report["prompt"] = True, []
    kernel_was, prefill_was, variant_was = layer.gdn_prompt_kernel, layer.gdn_prefill, cuda_gdn.PROMPT_VARIANT
    for t in args.prompt_rows:
        k1, k2, k3, k4 = mx.random.split(mx.random.key(300 + t), 4)
        qkv = (mx.random.normal((1, t, conv_dim), key=k1) * 0.5).astype(dtype)
        a = mx.random.normal((1, t, layer.num_v_heads), key=k2).astype(dtype)
        b = mx.random.normal((1, t, layer.num_v_heads), key=k3).astype(dtype)
        steps_y, w, s = [], window0, state0
        for lo in range(0, t, cuda_gdn.MAX_ROWS):
            hi = min(t, lo + cuda_gdn.MAX_ROWS)
            y1, s1 = cuda_gdn.gdn_rows(layer, w, qkv[:, lo:hi], a[:, lo:hi], b[:, lo:hi], s)
            steps_y.append(y1)
            w, s = mx.concatenate([w, qkv[:, lo:hi]], axis=1)[:, hi - lo :], s1[-1]
            mx.eval(steps_y[-1], w, s)
        stepped = mx.concatenate(steps_y, axis=1)
        calls = max(1, min(args.calls, 20000 // t))
        x = (mx.random.normal((1, t, hidden), key=k4) * 0.5).astype(dtype)

        def layer_call(x=x):
            cache = RollbackArraysCache()
            cache[0], cache[1] = window0, state0
            return [layer(x, cache=cache), cache[0], cache[1]]

        row: dict = {"rows": t}
        limit = model_layers.PROMPT_KERNEL_MAX_ROWS
        model_layers.PROMPT_KERNEL_MAX_ROWS = None  # the kernel at every length here
        try:
            for v in variants:
                cuda_gdn.PROMPT_VARIANT = v
                try:
                    y, after = cuda_gdn.gdn_prompt(layer, window0, qkv, a, b, state0)
                    same = bool(mx.array_equal(y, stepped).item() and mx.array_equal(after, s).item())
                except Exception as e:  # noqa: BLE001 - a form that does not run is reported, the other still timed
                    print(f"  form {v} did not run: {type(e).__name__}: {str(e)[:200]}")
                    row[f"form{v}"] = {"rows_equal_steps": False}
                    ok = False
                    continue
                ok &= same
                kernel_ms = per_call_us(lambda qkv=qkv, a=a, b=b: cuda_gdn.gdn_prompt(layer, window0, qkv, a, b, state0),
                                        calls, args.repeats) / 1e3
                layer.gdn_prompt_kernel, layer.gdn_prefill = kernel_was, "auto"
                layer_ms = per_call_us(layer_call, calls, args.repeats) / 1e3
                row[f"form{v}"] = {"rows_equal_steps": same, "kernel_ms": kernel_ms, "layer_ms": layer_ms}
            layer.gdn_prompt_kernel, layer.gdn_prefill = False, "chunked"
            row["layer_chunked_ms"] = per_call_us(layer_call, calls, args.repeats) / 1e3
        finally:
            layer.gdn_prompt_kernel, layer.gdn_prefill = kernel_was, prefill_was
            model_layers.PROMPT_KERNEL_MAX_ROWS, cuda_gdn.PROMPT_VARIANT = limit, variant_was
        cells = []
        for v in variants:
            f = row.get(f"form{v}", {})
            cells.append(f"{f.get('rows_equal_steps', False)!s:>15} {f.get('kernel_ms', float('nan')):>11.3f} "
                         f"{f.get('layer_ms', float('nan')):>12.3f}")
        ratios = " ".join(f"{row['layer_chunked_ms'] / row.get(f'form{v}', {}).get('layer_ms', float('nan')):>7.2f}"
                          for v in variants)
        print(f"{t:>5} " + " ".join(cells) + f" {row['layer_chunked_ms']:>11.3f} {ratios}")
        report["prompt"].append(row)
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
