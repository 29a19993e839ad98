"""``exo bench`` (exo.engine.bench): how its rounds are run."""

from __future__ import annotations

import pytest

from exo.engine import Engine, EngineConfig, load_checkpoint
from exo.engine import bench as bench_module
from exo.engine.bench import run_bench


def test_each_round_runs_its_configurations_in_a_rotated_order(checkpoint, monkeypatch):
    """On a host whose speed drifts within a run, a configuration that always ran last in its round, furthest
    from the stock run it is compared with, would carry the drift in its ratios: every configuration, stock
    mlx-lm included, takes each place in turn."""
    loaded = load_checkpoint(checkpoint("qwen3_5"))
    engine = Engine(loaded, EngineConfig(max_k=1, default_k=1))
    order: list[str] = []
    stock_decode = bench_module.StockMLXLM.decode
    complete = engine.complete

    def logged_stock(self, *args):
        order.append("stock")
        return stock_decode(self, *args)

    speeds: list[tuple[str, float]] = []

    def logged_complete(request):
        name = "plain" if request.native_mtp == "off" else f"k={request.mtp_k}" if request.mtp_k else "adaptive"
        order.append(name)
        result = complete(request)
        speeds.append((name, result.stats.decode_tokens_per_s))
        return result

    monkeypatch.setattr(bench_module.StockMLXLM, "decode", logged_stock)
    monkeypatch.setattr(engine, "complete", logged_complete)
    report = run_bench(engine, ["Hello", "def f(x):"], max_tokens=4, repeats=2, baseline=True, pairs=4)
    slots = ["stock", "plain", "k=1", "adaptive"]
    warmup = len(slots)  # every path once before the timed rounds
    rounds = [order[warmup + i * len(slots): warmup + (i + 1) * len(slots)] for i in range(4)]
    assert all(sorted(r) == sorted(slots) for r in rounds), rounds
    assert {r[-1] for r in rounds} == set(slots) and {r[0] for r in rounds} == set(slots), rounds
    rows = {row.config: row for row in report.rows}
    assert rows["plain"].speedup == 1.0 and rows["k=1"].identical_to_plain and rows["adaptive"].identical_to_plain
    assert rows["stock mlx-lm"].vs_stock == 1.0
    # The phase timer ran for the bench's requests (the share of k=1's rounds outside its parts), not after.
    assert 0.0 < rows["k=1"].outside_share < 1.0 and rows["plain"].outside_share is None
    # And by phase, ms per round (exo bench's phase table): the verify call and drafts, then the loop's glue.
    assert {"draft_build", "verify_build", "device_wait", "rollback"} <= set(rows["k=1"].phases_ms)
    assert all(ms >= 0.0 for ms in rows["k=1"].phases_ms.values()) and rows["plain"].phases_ms is None
    assert engine.config.profile_rounds is False
    # The spread of the ratios, and adaptive against the fastest fixed configuration round by round.
    for name in ("plain", "k=1", "adaptive"):
        q1, q3 = rows[name].vs_stock_quartiles
        assert q1 <= rows[name].vs_stock <= q3
    best = max(("plain", "k=1"), key=lambda name: rows[name].tokens_per_s)
    engine_slots = len(slots) - 1  # stock's runs are not engine calls
    timed = speeds[engine_slots: engine_slots + 4 * engine_slots]  # the rounds, after the warm-up
    per_round = {name: [tps for n, tps in timed if n == name] for name in ("plain", "k=1", "adaptive")}
    paired = sorted(a / b for a, b in zip(per_round["adaptive"], per_round[best], strict=True))
    assert report.best_fixed == best and len(paired) == 4
    assert report.adaptive_vs_best_fixed == round((paired[1] + paired[2]) / 2, 3)
    q1, q3 = report.adaptive_vs_best_fixed_quartiles
    assert q1 <= report.adaptive_vs_best_fixed <= q3 and paired[0] <= q1 and q3 <= paired[-1]
    # Then the tight groups: adaptive and the fastest fixed configuration twice, alone, the order rotated.
    tail = speeds[engine_slots + 4 * engine_slots:]
    roles = ["adaptive", "best", "again"]
    orders = [roles[g % 3:] + roles[: g % 3] for g in range(4)]
    assert [name for name, _ in tail] == ["adaptive" if r == "adaptive" else best for o in orders for r in o]
    groups = [dict(zip(o, (tps for _, tps in tail[3 * g: 3 * g + 3]), strict=True)) for g, o in enumerate(orders)]
    tight = sorted(g["adaptive"] / g["best"] for g in groups)
    again = sorted(g["again"] / g["best"] for g in groups)
    assert report.paired_groups == 4
    assert report.adaptive_vs_best_fixed_paired == round((tight[1] + tight[2]) / 2, 3)
    assert report.adaptive_vs_best_fixed_paired_quartiles is not None
    assert report.best_fixed_again_paired == round((again[1] + again[2]) / 2, 3)
    assert report.best_fixed_again_paired_quartiles is not None


def test_the_catch_up_is_timed_with_the_rows_a_round_kept(checkpoint):
    """A round's head first takes in the verify rows the round before kept: the catch-up timing feeds it that
    many rows (one head call of r rows), then chains K - 1 steps on one row each."""
    from exo.engine.costs import catch_up_seconds

    loaded = load_checkpoint(checkpoint("qwen3_5"))
    engine = Engine(loaded, EngineConfig(max_k=3))
    head = loaded.head
    calls: list[int] = []
    real_call = type(head).__call__

    class Counted(type(head)):
        def __call__(self, embeddings, hidden, cache):
            calls.append(hidden.shape[1])
            return real_call(self, embeddings, hidden, cache)

    head.__class__ = Counted
    try:
        seconds = catch_up_seconds(engine.model, engine.forward, head, 3, [1, 4], reps=1)
    finally:
        head.__class__ = Counted.__bases__[0]
    assert set(seconds) == {1, 4} and all(s > 0 for s in seconds.values())
    timed = calls[1:]  # after priming the head on the context
    assert [r for r in timed if r > 1] and set(timed) == {1, 4}
    # Each timed call of 4 rows is followed by 2 chained one-row steps, as a depth-3 round drafts.
    fours = [i for i, r in enumerate(timed) if r == 4]
    assert all(timed[i + 1 : i + 3] == [1, 1] for i in fours)


def test_the_warm_up_times_its_parts_side_by_side():
    """beta and delta are medians of per-repetition ratios to the plain step timed beside them: a moment of
    interference that slowed one plain step (or sped up one verify call) moves neither, where the fastest verify
    over the fastest plain step mixed moments (an H200 warm-up: beta(1) 1.24 next to beta(2) 2.45)."""
    from exo.engine.costs import _interleaved, ratio_of

    calls: list[str] = []
    times = _interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, reps=3, warmup=1)
    assert calls == ["a", "b"] + ["a", "b"] * 3 and all(len(v) == 3 for v in times.values())
    plain = [0.5, 1.0, 1.0, 1.0, 1.0]  # one plain step fast: its moment's verify call was fast too
    verify = [0.9, 1.9, 2.0, 2.1, 2.0]
    assert ratio_of(verify, plain) == 2.0
    assert min(verify) / min(plain) == 1.8  # the old account: two moments


def test_the_warm_up_times_whole_rounds_and_counts_drafting_beyond_the_verify(checkpoint, monkeypatch):
    """A round's cost is timed as a round runs: its drafts, the verify call built on them (K + 1 rows: the token,
    then the head's drafts), one sync, the caches rolled back; delta(K) is what that adds beyond the verify call
    alone. Drafts timed alone and summed with the verify over-counted deeper rounds (an H200's 9B, K = 3: 3.49
    plain steps by parts, 1.77 live), and adaptive depth chose K = 2 where K = 3 ran fastest."""
    from exo.engine import costs as costs_module

    loaded = load_checkpoint(checkpoint("qwen3_5"))
    engine = Engine(loaded, EngineConfig(max_k=3))
    verified: list[list[int]] = []
    hidden = engine.forward.hidden

    def recorded(rows, cache, verify=False, **kwargs):
        if verify:
            verified.append(rows[0].tolist())
        return hidden(rows, cache, verify=verify, **kwargs)

    monkeypatch.setattr(engine.forward, "hidden", recorded)
    fake = {"plain": 1.0, "burst": 8 * 0.9, "verify1": 1.2, "verify2": 1.4, "verify3": 1.6,
            "round1": 1.5, "round2": 1.6, "round3": 1.7}
    names: list[str] = []

    def interleaved(fns, reps, warmup=2):
        names.extend(fns)
        for fn in fns.values():
            fn()  # each runs for real once
        return {name: [fake[name] * 1e-3] * reps for name in fns}

    monkeypatch.setattr(costs_module, "_interleaved", interleaved)
    costs = costs_module.measure_costs(engine.model, engine.forward, loaded.head, 3)
    assert sorted(names) == sorted(fake)  # no drafts timed alone
    assert costs.beta == pytest.approx((1.2, 1.4, 1.6))
    assert [costs.round_cost(k) for k in (1, 2, 3)] == pytest.approx([1.5, 1.6, 1.7])
    assert costs.delta == pytest.approx((0.3, 0.2, 0.1))
    token = verified[0][0]
    rounds = [rows for rows in verified if len(rows) > 1 and rows[1:] != [token] * (len(rows) - 1)]
    assert sorted(len(rows) for rows in rounds) == [2, 3, 4]  # each round verified its own drafts


def test_check_names_every_greedy_configuration_that_is_not_identical():
    """``exo bench --check`` fails on any MTP configuration whose greedy tokens differ from plain decoding's
    and on plain decoding that differs from stock mlx-lm's; sampled runs are not compared."""
    from exo.engine.bench import BenchReport, BenchRow, identity_failures

    def row(config: str, same: bool | None) -> BenchRow:
        return BenchRow(config=config, k=None, completion_tokens=1, decode_seconds=1.0, tokens_per_s=1.0, speedup=1.0,
                        acceptance_rate=0.0, per_position_acceptance=[], k_histogram={}, identical_to_plain=same)

    report = BenchReport(model="m", device="cpu", prompts=1, max_tokens=1, temperature=0.0, native_mtp_available=True,
                         rows=[row("plain", None), row("k=1", True), row("k=2", True)], plain_identical_to_stock=True)
    assert identity_failures(report) == []
    report.rows[2].identical_to_plain = False
    report.plain_identical_to_stock = False
    assert identity_failures(report) == ["k=2: not plain decoding's tokens", "plain: not stock mlx-lm's tokens"]
    assert identity_failures(report.model_copy(update={"temperature": 0.7})) == []
    # where exo's own kernels compute plain decoding (not stock's ops), plain against stock is reported, not required
    own = report.model_copy(update={"own_ops": ["quantized linear products"]})
    assert identity_failures(own) == ["k=2: not plain decoding's tokens"]


def test_own_ops_names_the_quantized_kernel_where_it_runs(checkpoint, monkeypatch):
    from exo.engine import Engine, load_checkpoint
    from exo.engine.bench import own_ops

    path = checkpoint("qwen3_5", layout="mlx_q4_sidecar", head="trained", dtype="bfloat16")
    assert own_ops(Engine(load_checkpoint(path))) == []  # the CPU: MLX's products
    monkeypatch.setenv("EXO_QGEMV", "always")
    assert own_ops(Engine(load_checkpoint(path))) == [
        "quantized linear products (engine/kernels/cuda_qgemv.py; EXO_QGEMV=0 for MLX's)"]


def test_round_phases_replays_chosen_acceptances_and_reports_each(checkpoint, capsys, monkeypatch):
    """``bench/round_phases.py --replay``: per acceptance one table, every configuration's tokens plain decoding's
    (the replayed drafts are right or wrong, never another output), the warm-up's phases printed first, the depth
    policy's acceptance estimate started anew per rate."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "round_phases.py"
    spec = importlib.util.spec_from_file_location("round_phases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DEFAULT_PROMPTS", ("def fibonacci(n):", "The quick brown fox"))
    monkeypatch.setattr(sys, "argv", ["round_phases.py", str(checkpoint("qwen3_5", dtype="float32")), "--replay",
                                      "0.5,1.0", "--depths", "1", "2", "--repeats", "1", "--max-tokens", "12"])
    module.main()
    out = capsys.readouterr().out
    assert "warm-up verify probe" in out and "round costs" in out and "warm-up again, kernels compiled" in out
    tables = out.split(", acceptance ")[1:]
    assert [t.split(" ")[0] for t in tables] == ["0.50", "1.00"]
    def speeds(table: str) -> dict[str, str]:  # the tokens/s table: config, tok/s, ... n/m identical
        return {line.split()[0]: line for line in table.splitlines() if "/" in line and line.split()[1][0].isdigit()}

    for table in tables:
        lines = speeds(table)
        for name in ("plain", "k=1", "k=2", "adaptive"):
            assert " 2/2 " in lines[name], (name, lines[name])  # both requests gave plain decoding's tokens
    # At acceptance 1.0 a round of depth 2 emits 3 tokens (the last round may be cut by the budget).
    per_round = {}
    for name, line in speeds(tables[1]).items():
        parts = line.split()
        per_round[name] = float(parts[parts.index(next(p for p in parts if "/" in p)) - 1])  # before "n/m"
    assert per_round["k=2"] >= 2.5 and per_round["k=1"] >= 1.8, per_round
