"""The package's layers point one way and its modules import no cycle (docs/architecture.md, "Layers").

Read from the sources (``ast``), not by importing them: every ``import`` and ``from ... import`` of an ``exo``
module counts, at module level or inside a function (a function-local import hides a cycle, it does not
remove it), except those under ``if TYPE_CHECKING:`` (annotations only: nothing runs them)."""

from __future__ import annotations

import ast
from pathlib import Path

import exo

SRC = Path(exo.__file__).parent
# The rooms, lowest first: a module may import its own room's and lower rooms' modules only. The entry points
# share the top room (``exo menubar`` runs the menu-bar app, whose process runs exo's command line).
ROOMS = [
    {"exo", "exo.settings", "exo.system"},
    {"exo.cards"},
    {"exo.engine"},
    {"exo.metrics"},
    {"exo.wire"},
    {"exo.launch"},
    {"exo.downloads"},
    {"exo.runner"},
    {"exo.cluster"},
    {"exo.api"},
    {"exo.cli", "exo.menubar"},
]
STANDALONE = {"exo.training"}  # tools for the tests and scripts: nothing of the runtime imports them


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = ["exo", *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The exo modules ``name`` imports at run time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def known(target: str) -> str:
        while target not in modules and "." in target:
            target = target.rpartition(".")[0]
        return target

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(known(a.name) for a in child.names if a.name.split(".")[0] == "exo")
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    module = ".".join([*base, *([child.module] if child.module else [])])
                else:
                    module = child.module or ""
                if module.split(".")[0] == "exo":
                    for alias in child.names:
                        found.add(known(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module))
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _room(module: str) -> int | None:
    best = None
    for i, room in enumerate(ROOMS):
        for prefix in room:
            if module == prefix or module.startswith(prefix + ".") and prefix != "exo":
                best = i
    return best


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_module_imports_a_cycle():
    assert _cycles(_graph()) == []


def test_layers_point_down():
    upward = []
    for module, targets in _graph().items():
        if any(module == s or module.startswith(s + ".") for s in STANDALONE):
            continue
        mine = _room(module)
        assert mine is not None, f"{module} is in no room: add it to ROOMS"
        for target in targets:
            theirs = _room(target)
            if any(target == s or target.startswith(s + ".") for s in STANDALONE) or theirs is None or theirs > mine:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_the_checks_see_what_they_look_for():
    """The walk finds a cycle and an upward import where there are some (a check that finds nothing to find
    would pass on anything)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _graph()
    assert "exo.engine.batch" in graph["exo.engine.generate"]  # a module-level import
    assert "exo.engine.generate" not in graph["exo.engine.batch"]  # only under TYPE_CHECKING there
    # The batch's parts sit below it (batch re-exports them), and the runner's batch loop below the device queue.
    assert {"exo.engine.batch_step", "exo.engine.batch_clock", "exo.engine.batch_memory"} <= graph["exo.engine.batch"]
    assert not {"exo.engine.batch", "exo.engine.generate"} & graph["exo.engine.batch_step"]
    assert "exo.runner.batch_loop" in graph["exo.runner.device"]
    assert not {"exo.runner.device", "exo.runner.job"} & graph["exo.runner.batch_loop"]  # TYPE_CHECKING only
    assert _room("exo.api.server") > _room("exo.cluster.orchestration") > _room("exo.runner.device") > _room("exo.engine.batch")
    assert _room("exo.wire.convert") < _room("exo.runner.service")


def _run(code: str, **env: str) -> str:
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_exos_own_processes_load_tokenizers_without_importing_torch():
    """torch is installed with the dev dependencies, as on an NVIDIA node, where its import was most of a runner's
    first ~20 s: the ``exo`` command, a runner and a pipeline's stage mark it absent first; the package alone does
    not (a notebook's torch stays importable)."""
    load = ("from mlx_lm.utils import load_tokenizer; from exo.engine import resolve_model;"
            "t = load_tokenizer(resolve_model('exo-demo').path); assert t.encode('def f():');"
            "import sys, transformers.utils as u; print(sys.modules.get('torch'), u.is_torch_available())")
    assert _run("import exo; exo.without_torch();" + load) == "None False"
    assert _run(load).startswith("<module 'torch'")  # the package alone: torch as installed
    assert _run("import exo; exo.without_torch();" + load, EXO_IMPORT_TORCH="1").startswith("<module 'torch'")
    entry = ("import sys; from exo.cli import main as m; sys.argv = ['exo', '--version']\n"
             "try:\n    m.entry()\nexcept SystemExit:\n    pass\nprint(sys.modules.get('torch', 'absent'))")
    assert _run(entry).splitlines()[-1] == "None"
    for module in ("exo.runner.__main__", "exo.runner.local_pipeline"):
        text = (SRC / Path(*module.split(".")[1:])).with_suffix(".py").read_text()
        assert "exo.without_torch()" in text, module
