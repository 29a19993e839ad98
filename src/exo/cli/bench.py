"""``exo bench``: plain vs native-MTP decoding at each depth, measured in one run."""

from __future__ import annotations

import argparse
import sys

from exo.cli.common import CommandError, print_json


def use_device(name: str | None) -> None:
    """MLX's default device for this process (``--device``; None: MLX's own default, the GPU where there is one)."""
    if name is None:
        return
    import mlx.core as mx

    device = mx.cpu if name == "cpu" else mx.gpu
    if not mx.is_available(device):
        raise CommandError(f"--device {name}: this machine's MLX has no {name.upper()} backend")
    mx.set_default_device(device)


def bench_command(args: argparse.Namespace) -> int:
    from exo.engine import load
    from exo.engine.bench import DEFAULT_PROMPTS, identity_failures, run_bench
    from exo.settings import load_settings

    use_device(args.device)
    engine = load(args.model, load_settings())
    report = run_bench(
        engine,
        args.prompt or DEFAULT_PROMPTS,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        raw=not args.chat,
        repeats=args.repeats,
        baseline=args.baseline,
        pairs=args.pairs,
        progress=None if args.json else (lambda line: print(line, file=sys.stderr)),
    )
    failures = identity_failures(report) if args.check else []
    for failure in failures:
        print(f"exo bench --check: {failure}", file=sys.stderr)
    if args.json:
        print_json(report.model_dump())
        return 1 if failures else 0
    print(f"model {report.model}  device {report.device}  prompts {report.prompts}  max_tokens {report.max_tokens}")
    if not report.native_mtp_available:
        print(f"native MTP unavailable: {report.reason}")
    else:
        ks = range(1, len(report.beta) + 1)
        print("K            " + "".join(f"{k:>8}" for k in ks))
        print("beta(K)      " + "".join(f"{b:>8.3f}" for b in report.beta))
        print("delta(K)     " + "".join(f"{d:>8.3f}" for d in report.delta))
        print("beta+delta   " + "".join(f"{b + d:>8.3f}" for b, d in zip(report.beta, report.delta, strict=True)))
        print("proj. @0.8   " + "".join(f"{s:>8.3f}x" for s in report.projected_speedup_at_0_8))
    print()
    stock = any(row.vs_stock is not None for row in report.rows)
    print(f"{'config':>12} {'tok/s':>9} {'speedup':>8}" + (f" {'vs stock':>9} {'(q1-q3)':>13}" if stock else "")
          + f" {'accept':>7}  per-position        k-histogram   same-as-plain")
    for row in report.rows:
        positions = "/".join(f"{a:.2f}" for a in row.per_position_acceptance) or "-"
        same = "" if row.identical_to_plain is None else ("yes" if row.identical_to_plain else "NO")
        spread = f"({row.vs_stock_quartiles[0]:.3f}-{row.vs_stock_quartiles[1]:.3f})" if row.vs_stock_quartiles else ""
        versus = f" {row.vs_stock:>8.3f}x {spread:>13}" if stock and row.vs_stock is not None else (" " * 24 if stock else "")
        print(
            f"{row.config:>12} {row.tokens_per_s:>9.1f} {row.speedup:>7.3f}x{versus} {row.acceptance_rate:>6.1%}  "
            f"{positions:<19} {str(row.k_histogram):<13} {same}"
        )
    glue = [row for row in report.rows if row.glue is not None]
    if glue:
        print("\nround time, measured / its verify call and drafts timed alone before each request (median "
              "of the ratios): " + "  ".join(f"{row.config} {row.round_ms:.2f} / {row.alone_ms:.2f} ms = {row.glue:.3f}x"
                                              for row in glue))
        print("the same with the head taking in the rows the round before kept (its parts timed alone start it "
              "from one row): " + "  ".join(
                  f"{row.config} +{row.catch_up_ms:.2f} ms = {row.glue_with_catch_up:.3f}x" for row in glue))
        shares = [row for row in glue if row.outside_share is not None]
        if shares:
            print("a round's time outside its verify call and drafts, by the phase timer (reading the verdict back, "
                  "rollback, emission, the loop; median over requests): "
                  + "  ".join(f"{row.config} {row.outside_share:.1%}" for row in shares))
        print("round cost in this run's plain steps: " + "  ".join(f"{row.config} {row.round_cost:.3f}" for row in glue))
    timed = [row for row in report.rows if row.phases_ms]
    if timed:
        names = list(dict.fromkeys(p for row in timed for p in row.phases_ms or {}))
        print("\na round by phase, ms (median over requests; 'alone': its verify call and drafts timed alone, "
              "'/alone': the phases' sum over it)")
        print(f"{'config':>12} " + " ".join(f"{p:>12}" for p in names) + f" {'sum':>8} {'alone':>8} {'/alone':>7}")
        for row in timed:
            phases = row.phases_ms or {}
            total = sum(phases.values())
            alone = f"{row.alone_ms:>8.3f} {total / row.alone_ms:>6.3f}x" if row.alone_ms else ""
            print(f"{row.config:>12} " + " ".join(f"{phases.get(p, 0.0):>12.3f}" for p in names) + f" {total:>8.3f} {alone}")
    if report.adaptive_vs_best_fixed is not None:
        q = report.adaptive_vs_best_fixed_quartiles
        print(f"\nadaptive vs the fastest fixed configuration ({report.best_fixed}): {report.adaptive_vs_best_fixed:.3f}x"
              + (f" (quartiles {q[0]:.3f}-{q[1]:.3f})" if q else "")
              + ", median over prompts and repeats of tokens/s in the same round")
    if report.adaptive_vs_best_fixed_paired is not None:
        q = report.adaptive_vs_best_fixed_paired_quartiles
        print(f"the same in {report.paired_groups} tight pairs (adaptive and {report.best_fixed} alone, request after "
              f"request): {report.adaptive_vs_best_fixed_paired:.3f}x" + (f" (quartiles {q[0]:.3f}-{q[1]:.3f})" if q else ""))
        if report.best_fixed_again_paired is not None:
            q = report.best_fixed_again_paired_quartiles
            print(f"the noise floor: {report.best_fixed} run twice in each of those groups reads "
                  f"{report.best_fixed_again_paired:.3f}x itself" + (f" (quartiles {q[0]:.3f}-{q[1]:.3f})" if q else ""))
    if stock:
        if report.plain_identical_to_stock is not None:
            print(f"\nplain decoding identical to stock mlx-lm's, token for token: "
                  f"{'yes' if report.plain_identical_to_stock else 'NO'}"
                  + (f" (not required: exo's own {'; '.join(report.own_ops)})" if report.own_ops else ""))
        print("vs stock: median over prompts and repeats of tokens/s / stock mlx-lm's plain tokens/s in the same round"
              " (q1-q3: its quartiles)")
    if args.check:
        print(f"\n--check: {'FAILED, ' + '; '.join(failures) if failures else 'every greedy configuration identical'}")
    return 1 if failures else 0
