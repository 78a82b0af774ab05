"""The package's layers, checked from the source: each layer imports only from the layers below
it, and no module imports itself back through others.

    engine  <  observability  <  planning  <  wrapper  <  tools

(`comm_hooks` imports only torch; `testing` is the test harness; `gradsync/__init__` exports;
`patch` is an entry point, `python -m gradsync.patch train.py`, above them all.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
    assert loose == ["gradsync", "gradsync.comm_hooks", "gradsync.patch", "gradsync.testing"]


@pytest.mark.parametrize("module", sorted(m for m in _modules() if _layer(m) is not None))
def test_imports_point_down_the_layers(module):
    mine = _layer(module)
    upward = sorted(m for m in _imports(module, _modules()[module], type_checking=True)
                    if (_layer(m) or 0) > mine or m == "gradsync")
    assert not upward, f"{module} ({LAYERS[mine]}) imports from above: {upward}"


def test_comm_hooks_need_nothing_of_gradsync():
    assert _imports("gradsync.comm_hooks", _modules()["gradsync.comm_hooks"], type_checking=True) == set()


def test_no_import_cycles():
    graph = {m: _imports(m, p, type_checking=False) for m, p in _modules().items()}
    # A package's __init__ that only holds a docstring imports nothing; edges into it are
    # the Python machinery's, not a dependency.
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if nxt == "gradsync" or nxt.count(".") == 1 and nxt.split(".")[1] in LAYERS:
                continue
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [node, nxt])}")
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
