"""Run the fixture-dependent tests on fixtures built from several seeds and report the measured margins.

The tests build tiny trained checkpoints (tests/fixtures). Training on a CPU is not bit-reproducible across
machines, so every assertion about those models must hold for any fixture the recipe can produce, not
only for the one this machine builds. ``EXO_FIXTURE_SEED`` picks another, equally valid build; this
script runs ``pytest -m fixture_dependent`` once per seed (each seed its own pytest process) and prints,
for every value a test records with ``record_property``, its spread over the seeds. Bounds in the tests
are set from these spreads (each test says which figure it uses).

    python scripts/fixture_sweep.py --seeds 0-7                       # every fixture-dependent test
    python scripts/fixture_sweep.py --seeds 0-15 -- -k "loading or fixtures"
    python scripts/fixture_sweep.py --report DIR                      # re-read an earlier sweep

Fixtures of every seed are kept in ``--fixture-dir`` (default: a folder under the system temp dir), so a
second sweep over the same seeds only runs the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            seeds.extend(range(lo, hi + 1))
        elif part:
            seeds.append(int(part))
    return seeds


def run_seed(seed: int, fixture_dir: Path, out_dir: Path, pytest_args: list[str]) -> tuple[int, float]:
    env = dict(os.environ, EXO_FIXTURE_SEED=str(seed), EXO_FIXTURE_DIR=str(fixture_dir))
    xml = out_dir / f"seed-{seed}.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "fixture_dependent", "-p", "no:cacheprovider",
               f"--junitxml={xml}", "-o", "junit_family=xunit1", *pytest_args]
    start = time.perf_counter()
    with open(out_dir / f"seed-{seed}.log", "w") as log:
        code = subprocess.call(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return code, time.perf_counter() - start


def read_results(out_dir: Path) -> dict[int, dict[str, dict]]:
    """seed -> test id -> {"outcome": passed|failed|skipped, "properties": {name: value}}."""
    results: dict[int, dict[str, dict]] = {}
    for xml in sorted(out_dir.glob("seed-*.xml")):
        seed = int(xml.stem.split("-", 1)[1])
        tests: dict[str, dict] = {}
        for case in ET.parse(xml).getroot().iter("testcase"):
            test_id = f"{case.get('classname')}::{case.get('name')}"
            outcome = "passed"
            if case.find("failure") is not None or case.find("error") is not None:
                outcome = "failed"
            elif case.find("skipped") is not None:
                outcome = "skipped"
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
            tests[test_id] = {"outcome": outcome, "properties": props}
        results[seed] = tests
    return results


def _number(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "None") else None
    except ValueError:
        return None


def summarize(results: dict[int, dict[str, dict]]) -> dict:
    outcomes = {seed: {o: sum(t["outcome"] == o for t in tests.values()) for o in ("passed", "failed", "skipped")}
                for seed, tests in results.items()}
    failures = {seed: sorted(t for t, r in tests.items() if r["outcome"] == "failed")
                for seed, tests in results.items()}
    values: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for seed, tests in results.items():
        for test_id, result in tests.items():
            for name, raw in result["properties"].items():
                number = _number(raw)
                if number is not None:
                    values[(test_id, name)][seed] = number
    spreads = []
    for (test_id, name), by_seed in sorted(values.items()):
        series = list(by_seed.values())
        spreads.append({
            "test": test_id, "property": name, "seeds": len(series), "min": min(series), "max": max(series),
            "median": statistics.median(series),
            "argmin_seed": min(by_seed, key=by_seed.__getitem__), "argmax_seed": max(by_seed, key=by_seed.__getitem__),
        })
    return {"outcomes": outcomes, "failures": failures, "spreads": spreads}


def print_summary(summary: dict) -> None:
    print("seed  passed failed skipped")
    for seed, o in sorted(summary["outcomes"].items()):
        print(f"{seed:4d}  {o['passed']:6d} {o['failed']:6d} {o['skipped']:7d}")
    for seed, failed in sorted(summary["failures"].items()):
        for test_id in failed:
            print(f"FAILED seed {seed}: {test_id}")
    print(f"\n{'test :: property':<100} {'n':>3} {'min':>9} {'median':>9} {'max':>9}")
    for row in summary["spreads"]:
        label = f"{row['test']} :: {row['property']}"
        print(f"{label[-100:]:<100} {row['seeds']:3d} {row['min']:9.4g} {row['median']:9.4g} {row['max']:9.4g}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0-4", help="seeds, e.g. 0-7 or 0,3,9 (default 0-4)")
    p.add_argument("--fixture-dir", type=Path, default=Path(tempfile.gettempdir()) / "exo-fixture-sweep")
    p.add_argument("--out", type=Path, default=None, help="where the per-seed logs and results go")
    p.add_argument("--report", type=Path, default=None, help="only summarize an earlier sweep's --out dir")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args(argv)
    if args.report is not None:
        out_dir = args.report
    else:
        out_dir = args.out or Path(tempfile.mkdtemp(prefix="exo-sweep-"))
        out_dir.mkdir(parents=True, exist_ok=True)
        for seed in parse_seeds(args.seeds):
            code, seconds = run_seed(seed, args.fixture_dir, out_dir, args.pytest_args)
            print(f"seed {seed}: pytest exit {code} in {seconds:.0f} s ({out_dir / f'seed-{seed}.log'})",
                  file=sys.stderr, flush=True)
    summary = summarize(read_results(out_dir))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print_summary(summary)
    return 1 if any(summary["failures"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
