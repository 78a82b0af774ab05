"""The package's layers, checked from the source: each layer imports only from the layers below
it, and no module imports itself back through others (nor, inside a folder, at all, counting
late imports). No module reads another's private attributes, no function's body runs past 40
lines, and docs/architecture.md names only functions that exist.

    engine  <  observability  <  planning  <  wrapper  <  tools

(`comm_hooks` imports only torch; `testing` is the test harness; `gradsync/__init__` exports;
`patch` is an entry point, `python -m gradsync.patch train.py`, and `ft` the wrapper under torchft's
Manager, both above them all.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

SRC = Path(__file__).resolve().parents[2] / "src" / "gradsync"
LAYERS = ["engine", "observability", "planning", "wrapper", "tools"]


def _modules() -> dict[str, Path]:
    return {
        ".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in SRC.rglob("*.py")
    }


def _imports(name: str, path: Path, type_checking: bool) -> set[str]:
    """Modules of gradsync that `name` imports (optionally counting TYPE_CHECKING-only ones)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip: set[int] = set()
    if not type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip.update(id(n) for n in ast.walk(node))
    modules = _modules()
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("gradsync"):
                for alias in node.names:  # `from pkg import module`, or a name from `base`
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("gradsync"))
    return {m for m in found if m in modules and m != name}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_lives_in_a_layer():
    loose = sorted(m for m in _modules() if _layer(m) is None)
    assert loose == ["gradsync", "gradsync.comm_hooks", "gradsync.ft", "gradsync.patch",
                     "gradsync.testing"]


@pytest.mark.parametrize("module", sorted(m for m in _modules() if _layer(m) is not None))
def test_imports_point_down_the_layers(module):
    mine = _layer(module)
    upward = sorted(m for m in _imports(module, _modules()[module], type_checking=True)
                    if (_layer(m) or 0) > mine or m == "gradsync")
    assert not upward, f"{module} ({LAYERS[mine]}) imports from above: {upward}"


def test_comm_hooks_need_nothing_of_gradsync():
    assert _imports("gradsync.comm_hooks", _modules()["gradsync.comm_hooks"],
                    type_checking=True) == set()


def test_no_import_cycles():
    graph = {m: _imports(m, p, type_checking=False) for m, p in _modules().items()}
    # A package's __init__ that only holds a docstring imports nothing; edges into it are
    # the Python machinery's, not a dependency.
    for module, found in graph.items():
        graph[module] = {n for n in found if not (n == "gradsync" or n.count(".") == 1
                                                  and n.split(".")[1] in LAYERS)}
    _assert_no_cycle(graph, "import cycle")


def _assert_no_cycle(graph: dict[str, set[str]], what: str) -> None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError(f"{what}: {' -> '.join(path + [node, nxt])}")
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def _folder(module: str) -> str:
    return module.rpartition(".")[0]


def test_no_import_circle_inside_a_folder_counting_every_import():
    # TYPE_CHECKING and function-level imports count: a circle of modules around one class's
    # private state is a circle whoever imports late.
    modules = _modules()
    graph = {m: {n for n in _imports(m, p, type_checking=True)
                 if _folder(n) == _folder(m) and n != _folder(m)}
             for m, p in modules.items()}
    _assert_no_cycle(graph, "import circle")


# Functions only: a class-size limit bent the code to fit it (classes cut into tuples and
# once-called helpers, #50); a class is as long as what it owns. A function's body is counted,
# not its signature: torch's constructor takes 17 keywords, one line each.
MAX_FUNCTION_LINES = 40


def _sized(kind: type | tuple[type, ...], limit: int) -> list[str]:
    over = []
    for module, path in sorted(_modules().items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kind):
                lines = node.end_lineno - node.body[0].lineno + 1
                if lines > limit:
                    over.append(f"{module}.{node.name}: {lines} lines")
    return over


def test_no_function_over_a_screen():
    assert _sized((ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES) == []


def _private_names_defined(tree: ast.AST) -> set[str]:
    """`_x` names a module defines: methods, class attributes, `self._x = ...` assignments."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, (ast.AnnAssign, ast.Assign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names.add(target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_reads_another_modules_private_attributes():
    # `obj._x` where `_x` is private state or a private method of some other gradsync module:
    # the phases take what they need explicitly. torch's own private names (`_parameters`,
    # `_allgather_base`, ...) are torch's protocol, not ours, and are left alone.
    trees = {m: ast.parse(p.read_text()) for m, p in _modules().items()}
    defined = {m: _private_names_defined(t) for m, t in trees.items()}
    torchs = (dist.ProcessGroup, torch.nn.Module, torch.Tensor)  # a stand-in may define torch's own
    ours = {n for n in set().union(*defined.values()) if not any(hasattr(t, n) for t in torchs)}
    reaches = []
    for module, tree in sorted(trees.items()):
        for node in ast.walk(tree):
            if (not isinstance(node, ast.Attribute) or node.attr not in ours
                    or node.attr in defined[module]):
                continue
            # `self._x` too: a subclass in another module reading its base's private state.
            reaches.append(f"{module}: {ast.unparse(node.value)}.{node.attr}")
    assert reaches == []


def test_the_architecture_page_names_only_what_exists():
    page = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    named = re.findall(r"`((?:engine|observability|planning|wrapper|tools)/"
                       r"[\w/]+\.py)::([\w.]+)`", page)
    assert len(named) >= 30
    missing = [f"{path}::{name}" for path, name in named
               if not _defines(SRC / path, name.split("."))]
    assert missing == []


def _defines(path: Path, names: list[str]) -> bool:
    if not path.exists():
        return False
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for name in names:
        found = [n for n in scope
                 if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == name]
        if not found:
            return False
        scope = found[0].body if isinstance(found[0], ast.ClassDef) else []
    return True
