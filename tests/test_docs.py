"""The README and docs/ say what is true: their tested shell examples run, their links lead somewhere, and
docs/configuration.md names every environment variable exo reads.

Convention (docs/development.md, "Examples that are tested"): a fenced block tagged ```` ```sh test ````
runs as written, one command per line (a trailing backslash continues it), with ``exo`` meaning this
checkout's ``exo`` and a fresh ``EXO_HOME``; every command must exit 0. ```` ```sh test-serve ```` blocks run
the same way against an ``exo serve`` this file starts, its ``localhost:52415`` replaced by that node's
address, and ```` ```python test-serve ```` blocks run as a script against it (``127.0.0.1:52415`` replaced).
Plain ```` ```sh ```` blocks are not run (installs, downloads, daemons left running, a second Mac).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from exo.settings import Settings, env_var
from tests.api.conftest import wait_until_serving

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SERVE_ADDRESS = "localhost:52415"
# `exo` as a shell function: this checkout's CLI with this Python, whatever is on PATH.
PRELUDE = f'exo() {{ "{sys.executable}" -m exo.cli.main "$@"; }}\n'


def _blocks(tag: str, language: str = "sh") -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        if not page.exists():
            continue
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(1).split() == [language, tag]:
                line = text[: match.start()].count("\n") + 1
                found.append((f"{page.relative_to(ROOT)}:{line}", match.group(2)))
    return found


def _commands(block: str) -> list[str]:
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip() and not c.startswith("#")]


def _run(command: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "EXO_HOME": str(home)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return subprocess.run(["bash", "-c", PRELUDE + command], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)


def test_the_pages_have_tested_examples():
    """The convention is in use: dropping the tags (or the pages) would make the example tests vacuous."""
    assert len(_blocks("test")) >= 6 and _blocks("test-serve") and _blocks("test-serve", "python")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("where", "block"), _blocks("test"), ids=[w for w, _ in _blocks("test")])
def test_a_tested_example_runs(where, block, tmp_path):
    for command in _commands(block):
        result = _run(command, tmp_path)
        assert result.returncode == 0, f"{where}: `{command}` exited {result.returncode}\n{result.stderr[-3000:]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def exo_serve(tmp_path_factory):
    """``exo serve`` as a user starts it (its default model exo-demo), on free ports: its address."""
    port = _free_port()
    env = {**os.environ, "EXO_HOME": str(tmp_path_factory.mktemp("serve-home")), "EXO_API_KEY": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "exo.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--grpc-port", str(_free_port()), "--no-discovery"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_until_serving(f"http://127.0.0.1:{port}", process, 120)
        yield f"127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("where", "block"), _blocks("test-serve"), ids=[w for w, _ in _blocks("test-serve")])
def test_a_tested_example_runs_against_a_node(where, block, exo_serve, tmp_path):
    for command in _commands(block):
        assert SERVE_ADDRESS in command, f"{where}: a test-serve command must call {SERVE_ADDRESS}: `{command}`"
        command = command.replace(SERVE_ADDRESS, exo_serve)
        if command.startswith("curl "):
            command = "curl --fail-with-body " + command[len("curl "):]  # an HTTP error fails the example
        result = _run(command, tmp_path)
        assert result.returncode == 0, f"{where}: `{command}` exited {result.returncode}\n{result.stdout[-2000:]}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("where", "block"), _blocks("test-serve", "python"),
                         ids=[w for w, _ in _blocks("test-serve", "python")])
def test_a_python_example_runs_against_a_node(where, block, exo_serve, tmp_path):
    assert f"http://127.0.0.1:{SERVE_ADDRESS.split(':')[1]}" in block, where
    script = tmp_path / "example.py"
    script.write_text(block.replace(f"127.0.0.1:{SERVE_ADDRESS.split(':')[1]}", exo_serve))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0 and result.stdout.strip(), f"{where}:\n{result.stderr[-3000:]}"


def test_relative_links_lead_to_files():
    broken = []
    for page in PAGES:
        if not page.exists():
            continue
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken


def _documented() -> str:
    return (ROOT / "docs" / "configuration.md").read_text()


def test_every_setting_has_its_variable_documented():
    missing = [env_var(name) for name in Settings.model_fields if f"`{env_var(name)}`" not in _documented()]
    assert not missing, f"add these to docs/configuration.md: {missing}"


def test_every_exo_variable_the_code_reads_is_documented():
    names = set()
    for path in SRC.rglob("*.py"):
        names |= set(re.findall(r"\bEXO_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    names = {n for n in names if not n.endswith("_FROM_APP")} - {"EXO_"}
    assert len(names) > 10  # the scan found the variables (a changed layout would make this test vacuous)
    missing = sorted(n for n in names if f"`{n}`" not in _documented())
    assert not missing, f"add these to docs/configuration.md: {missing}"


def test_every_bench_file_named_exists():
    """A benchmark or result that left the tree is named ``bench/NAME@COMMIT`` (bench/README.md): every other
    ``bench/...`` path in the code, the tests, the scripts and the docs is there."""
    sources = [*PAGES, *(ROOT / "docs").glob("*.md"), *SRC.rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
               *(ROOT / "bench").glob("*.py"), *(ROOT / "scripts").glob("*.py")]
    missing = set()
    for source in sources:
        if not source.exists():
            continue
        for name in re.findall(r"\bbench/[\w./-]*\w\.(?:py|txt|json|md)(?![\w@])", source.read_text()):
            if not (ROOT / name).exists():
                missing.add(f"{source.relative_to(ROOT)}: {name}")
    assert not missing, sorted(missing)
