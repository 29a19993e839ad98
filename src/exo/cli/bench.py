"""``exo bench``: plain vs native-MTP decoding at each depth, measured in one run."""

from __future__ import annotations

import argparse
import sys

from exo.cli.main import print_json


def bench_command(args: argparse.Namespace) -> int:
    from exo.engine import load
    from exo.engine.bench import DEFAULT_PROMPTS, run_bench
    from exo.settings import load_settings

    engine = load(args.model, load_settings())
    report = run_bench(
        engine,
        args.prompt or DEFAULT_PROMPTS,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        raw=not args.chat,
        repeats=args.repeats,
        progress=None if args.json else (lambda line: print(line, file=sys.stderr)),
    )
    if args.json:
        print_json(report.model_dump())
        return 0
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
    print(f"{'config':>9} {'tok/s':>9} {'speedup':>8} {'accept':>7}  per-position        k-histogram   same-as-plain")
    for row in report.rows:
        positions = "/".join(f"{a:.2f}" for a in row.per_position_acceptance) or "-"
        same = "" if row.identical_to_plain is None else ("yes" if row.identical_to_plain else "NO")
        print(
            f"{row.config:>9} {row.tokens_per_s:>9.1f} {row.speedup:>7.3f}x {row.acceptance_rate:>6.1%}  "
            f"{positions:<19} {str(row.k_histogram):<13} {same}"
        )
    return 0
