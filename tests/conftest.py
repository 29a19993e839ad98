"""Session fixtures: genuine tiny checkpoints of every target architecture, built once and cached.

    def test_something(checkpoint, tokenizer_dir):
        path = checkpoint("qwen3_5_moe", layout="hf", head="trained", dtype="float32")

``checkpoint(arch, layout="hf", head=None, dtype="bfloat16") -> Path``
    arch: "qwen3_5" | "qwen3_5_moe" | "qwen3_6_moe" | "qwen3_next"
    layout: "hf" | "mlx" | "mlx_q4" | "mlx_q8" | "mlx_sidecar" | "mlx_q4_sidecar" | "mlx_q8_sidecar"
            (mlx_q4 / mlx_q8: stock mlx-lm 4- / 8-bit conversions, group 64, as the catalog's checkpoints)
    head: "trained" | "random" | "none" (default: "trained", or "none" for mlx / mlx_q4 / mlx_q8)
    dtype: "bfloat16" | "float32"
``malformed_checkpoint(kind, arch="qwen3_5") -> Path`` with kind in fixtures.MALFORMED.
``tokenizer_dir -> Path``; ``fixture_store -> fixtures.FixtureStore``.

Returned directories live in pytest's cache (``.pytest_cache/d/exo_fixtures/<key>``) and are shared by
every test and later sessions: never modify them (copy to tmp_path first). Each file's
``exo_fixture.json`` says what was built and the measured head agreement.
Set EXO_FIXTURE_DIR to keep the cache somewhere else (e.g. shared by several worktrees).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Torch's default of one thread per core thrashes when this small CPU is shared (a 1.5 s check took 40 s
# with two threads under load). Set before anything imports torch; an explicit value is respected.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The fixture checkpoints are trained here with torch. Its CPU kernels are chosen per machine (ATen's
# AVX2 / AVX-512 paths, MKL's per-vendor code paths), and each choice rounds differently, so the same
# recipe trained different weights on different machines. ATen's portable kernels and MKL's
# conditional-numerical-reproducibility mode take the same code path on any x86-64 CPU (and oneDNN,
# which also dispatches per instruction set, is switched off while training: fixtures/training.py).
os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

ROOT = Path(__file__).resolve().parents[1]
_SRC = ROOT / "src"
# On the PYTHONPATH of every process a test starts: its sitecustomize hides torch from them (it says why).
SUBPROCESS_SITE = Path(__file__).resolve().parent / "subprocess_site"
if _SRC.is_dir() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

from fixtures import FixtureStore  # noqa: E402

# The suite runs its files on several workers (pyproject's addopts: -n auto --dist loadfile; each file's
# tests stay on one worker, in order, sharing their module fixtures). Most of a test's time is one busy
# core (MLX on small models, daemons starting): two workers take the suite on this 2-core machine from 20
# to 11 minutes. More than four would mostly multiply the daemons and models each test starts.
# Tests of one file run in this process (a worker would only add its start-up). -n 0 runs serially;
# PYTEST_XDIST_AUTO_NUM_WORKERS=N picks N.
MAX_AUTO_WORKERS = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist reads it
    files = {arg.split("::")[0] for arg in config.args}
    if len(files) == 1 and Path(next(iter(files))).is_file():
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_AUTO_WORKERS, cpus))

FIXTURE_FIXTURES = frozenset({"fixture_store", "tokenizer_dir", "checkpoint", "malformed_checkpoint"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses a built fixture (directly or through other fixtures) ``fixture_dependent``:
    ``EXO_FIXTURE_SEED=N python -m pytest -m fixture_dependent`` reruns them on fixtures of another seed
    (scripts/fixture_sweep.py does that for many seeds and reports the measured margins)."""
    for item in items:
        if FIXTURE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.fixture_dependent)
        if _runs_the_cpu_kernels(Path(str(item.fspath))):
            item.add_marker(pytest.mark.arithmetic)


ARITHMETIC = (ROOT / "tests" / "engine", ROOT / "tests" / "test_demo_model.py")


def _runs_the_cpu_kernels(path: Path) -> bool:
    """Tests that run a model on exo's CPU kernels in the pytest process (the engine's, the demo models'): their
    outcome can depend on the arithmetic of the kernels' build (AVX-512 or AVX2), so the README's test command
    runs them a second time with ``EXO_CPU_KERNELS_ISA=avx2`` (``-m arithmetic``): a test that holds on one
    instruction set only fails where it is written, whichever CPU CI has."""
    return any(path == p or p in path.parents for p in ARITHMETIC)


@pytest.fixture(scope="session")
def fixture_store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FixtureStore:
    if os.environ.get("EXO_FIXTURE_DIR"):
        root = Path(os.environ["EXO_FIXTURE_DIR"])
    elif getattr(request.config, "cache", None) is not None:
        root = request.config.cache.mkdir("exo_fixtures")
    else:  # cacheprovider disabled (-p no:cacheprovider): build per session, one store for its xdist workers
        base = tmp_path_factory.getbasetemp()  # a worker's is <the session's basetemp>/popen-gwN
        root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "exo_fixtures"
    return FixtureStore(root)


@pytest.fixture(scope="session")
def tokenizer_dir(fixture_store: FixtureStore) -> Path:
    return fixture_store.tokenizer_dir()


@pytest.fixture(scope="session")
def checkpoint(fixture_store: FixtureStore) -> Callable[..., Path]:
    return fixture_store.checkpoint


@pytest.fixture(scope="session")
def malformed_checkpoint(fixture_store: FixtureStore) -> Callable[..., Path]:
    return fixture_store.malformed


@pytest.fixture(scope="session", autouse=True)
def _subprocesses_without_torch() -> Iterator[None]:
    """Python processes started by the tests (daemons, runners, pipeline stages, the CLI) run without torch,
    as exo does where it is installed: see subprocess_site/sitecustomize.py. Helpers that set PYTHONPATH for
    a process keep what they inherit after their own entries (tests/cluster/daemons.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SUBPROCESS_SITE), os.environ.get("PYTHONPATH")])))
        yield


@pytest.fixture(autouse=True)
def _hermetic_exo_environment(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test gets an empty EXO_HOME and no EXO_* settings from the developer's shell."""
    for name in list(os.environ):
        if name.startswith("EXO_") and name not in ("EXO_FIXTURE_DIR", "EXO_FIXTURE_SEED"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("EXO_HOME", str(tmp_path_factory.mktemp("exo-home")))


@pytest.fixture
def bounded_cache(monkeypatch):
    """MLX's cache bounded at 8 MiB as a runner bounds it (``limit_buffer_cache``), emptied before and after; the
    process's own bound put back."""
    import mlx.core as mx

    from exo.engine import memory

    mx.clear_cache()
    before = mx.set_cache_limit(8 << 20)
    mx.set_cache_limit(before)
    monkeypatch.setattr(memory, "_bound", None)
    memory.limit_buffer_cache(8 << 20)
    try:
        yield memory
    finally:
        mx.set_cache_limit(before)
        mx.clear_cache()
