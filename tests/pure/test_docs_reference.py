"""The two reference pages stay complete as the code changes.

docs/migrating.md names every keyword of torch's `DistributedDataParallel` constructor, every
public method or attribute torch's class defines itself (not inherited from `nn.Module`), and
every public method or attribute of gradsync's class, each as `name` in backticks.

docs/troubleshooting.md quotes every message the code raises or warns with. Read with `ast`
under src/gradsync: each exception made with a message (`raise X(message)`, or `X(message)`
returned or kept to raise later), each `raise make_error(..., message)` and each
`warnings.warn(message)`. The longest literal piece of the message (a string, the literal parts
of an f-string or a concatenation, a module constant, a `.format` template, what a
message-building function returns) must appear on the page, whitespace collapsed. Messages with
no literal piece of `MIN_FRAGMENT` characters (bare re-raises, values passed through) are
skipped; invariants that no user input reaches are listed in `INTERNAL`, each with its reason.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import gradsync

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "gradsync"
MIGRATING = ROOT / "docs" / "migrating.md"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
MIN_FRAGMENT = 20

# Messages of invariants that no user input reaches: not documented; the reason for each.
INTERNAL = {
    "gradsync's accumulator look-up is never backpropagated":
        "an AssertionError in a node that autograd never runs (engine/unused.py)",
    "no iteration's buckets are being watched":
        "an AssertionError: the stall watch is asked about buckets only between begin and end "
        "(engine/waits.py)",
    "a reduce-scatter bucket holds dense gradients only, and no tail (unless reduced by "
    "all-reduce without a hook)":
        "buckets are built by BucketSet, which refuses sparse gradients with its own message "
        "first and puts the reports' tail only where it may go (engine/bucket.py)",
    "gradsync join: no rank could serve as the authoritative copy":
        "asked only while some rank still trains, and that rank is a candidate "
        "(wrapper/join.py)",
}


# ------------------------------------------------------------------- docs/migrating.md


def _quoted(page: Path) -> set[str]:
    """Every name the page writes in a code span of its text or tables (`name`, `name()`,
    `ddp.name(...)`, ...); the fenced blocks (examples, messages) do not count."""
    text = re.sub(r"^(```|~~~).*?^\1", "", page.read_text(), flags=re.S | re.M)
    spans = re.findall(r"`([^`\n]+)`", text)
    return {word for span in spans for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span)}


def _own_public_names(cls: type) -> list[str]:
    """Public names of `cls` that are not `nn.Module`'s own (inherited unchanged)."""
    return sorted(
        name for name in dir(cls)
        if not name.startswith("_") and getattr(cls, name) is not getattr(nn.Module, name, None)
    )


def test_migrating_names_every_keyword_of_torchs_constructor():
    keywords = set(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__)
                   .parameters) - {"self"}
    missing = sorted(keywords - _quoted(MIGRATING))
    assert not missing, f"docs/migrating.md does not name these keywords of torch's DDP: {missing}"


def test_migrating_names_every_method_torchs_class_defines_itself():
    names = _own_public_names(torch.nn.parallel.DistributedDataParallel)
    assert "no_sync" in names and "join" in names  # the listing itself works
    missing = sorted(set(names) - _quoted(MIGRATING))
    assert not missing, f"docs/migrating.md does not name these methods of torch's DDP: {missing}"


def test_migrating_names_every_public_method_of_gradsyncs_wrapper():
    names = _own_public_names(gradsync.DistributedDataParallel)
    assert "stats" in names and "overlap_optimizer" in names
    missing = sorted(set(names) - _quoted(MIGRATING))
    assert not missing, f"docs/migrating.md does not name these of gradsync's wrapper: {missing}"


# ------------------------------------------------------------- docs/troubleshooting.md

Segments = list  # str (literal text) or None (a value formatted in), in order


@dataclass(frozen=True)
class Message:
    where: str  # path:line
    fragment: str  # its longest literal piece, whitespace collapsed


class _Module:
    """One source file's tree, and each node's parent (to find the function around a raise)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tree = ast.parse(path.read_text(), str(path))
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node


class _Source:
    """Every file under src/gradsync, and the names it defines that messages are built from."""

    def __init__(self) -> None:
        self.modules = [_Module(p) for p in sorted(SRC.rglob("*.py"))]
        self.functions: dict[str, list[tuple[_Module, ast.FunctionDef]]] = {}
        self.exceptions = {n for n in dir(builtins)
                           if isinstance(getattr(builtins, n), type)
                           and issubclass(getattr(builtins, n), BaseException)}
        classes = []
        for module in self.modules:
            for node in ast.walk(module.tree):
                if isinstance(node, ast.FunctionDef):
                    self.functions.setdefault(node.name, []).append((module, node))
                elif isinstance(node, ast.ClassDef):
                    classes.append(node)
        grew = True
        while grew:  # gradsync's own exception classes, whatever their depth
            grew = False
            for cls in classes:
                bases = {_last_name(b) for b in cls.bases}
                if cls.name not in self.exceptions and bases & self.exceptions:
                    self.exceptions.add(cls.name)
                    grew = True

    def messages(self) -> Iterator[Message]:
        for module in self.modules:
            where = module.path.relative_to(ROOT)
            for node in ast.walk(module.tree):
                for variant in self._sites(module, node):
                    fragment = _longest_piece(variant)
                    if len(fragment) >= MIN_FRAGMENT:
                        yield Message(f"{where}:{node.lineno}", fragment)

    def _sites(self, module: _Module, node: ast.AST) -> Iterator[Segments]:
        """The message variants of an exception made here, a raise or a warnings.warn."""
        if isinstance(node, ast.Call) and _last_name(node.func) in self.exceptions:
            yield from self._message_of(module, node, node.args[:1])  # raised, returned, kept
        elif (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
              and _last_name(node.exc.func) not in self.exceptions):
            # a function that builds the exception: its string arguments are the message
            yield from self._message_of(module, node, node.exc.args)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "warnings.warn":
            yield from self._message_of(module, node, node.args[:1])

    def _message_of(self, module: _Module, at: ast.AST, args: list[ast.expr]) -> Iterator[Segments]:
        for arg in args:
            yield from self._resolve(module, at, arg, depth=0)

    def _resolve(self, module: _Module, at: ast.AST, node: ast.AST, depth: int) -> list[Segments]:
        """The ways `node` can read as text: literal parts and holes (None)."""
        if depth > 4:
            return [[None]]
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [[node.value]]
        if isinstance(node, ast.JoinedStr):
            return [[v.value if isinstance(v, ast.Constant) else None for v in node.values]]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            lefts = self._resolve(module, at, node.left, depth + 1)
            rights = self._resolve(module, at, node.right, depth + 1)
            return [left + right for left in lefts for right in rights][:16]
        if isinstance(node, ast.IfExp):
            return (self._resolve(module, at, node.body, depth + 1)
                    + self._resolve(module, at, node.orelse, depth + 1))
        if isinstance(node, ast.Name):
            values = _assignments(module, at, node.id)
            resolved = [v for value, where in values
                        for v in self._resolve(module, where, value, depth + 1)]
            return resolved or [[None]]
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "format":
                templates = self._resolve(module, at, func.value, depth + 1)
                return [_split_template(t) for t in templates]
            name = _last_name(func)
            if name in self.functions and name not in self.exceptions:
                return [v for owner, fn in self.functions[name] for ret in _returns(fn)
                        if ret.value is not None
                        for v in self._resolve(owner, ret, ret.value, depth + 1)] or [[None]]
        return [[None]]


def _last_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _enclosing_function(module: _Module, node: ast.AST) -> ast.AST | None:
    while node in module.parents:
        node = module.parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node
    return None


def _assignments(module: _Module, at: ast.AST, name: str) -> list[tuple[ast.expr, ast.AST]]:
    """The values assigned to `name` in the function around `at`, else at module level."""
    scopes = [_enclosing_function(module, at), module.tree]
    for scope in scopes:
        if scope is None:
            continue
        body = ast.walk(scope) if scope is not module.tree else iter(module.tree.body)
        found = [(node.value, node) for node in body
                 if isinstance(node, ast.Assign) and len(node.targets) == 1
                 and isinstance(node.targets[0], ast.Name) and node.targets[0].id == name]
        if found:
            return found
    return []


def _returns(fn: ast.FunctionDef) -> Iterator[ast.Return]:
    """The function's own return statements (not those of functions nested in it)."""
    stack = list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return):
            yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                 ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _split_template(segments: Segments) -> Segments:
    """A `str.format` template's literal parts, its `{fields}` as holes."""
    out: Segments = []
    for segment in segments:
        if segment is None:
            out.append(None)
            continue
        for i, part in enumerate(re.split(r"\{[^{}]*\}", segment)):
            if i:
                out.append(None)
            out.append(part)
    return out


def _collapse(text: str) -> str:
    return " ".join(text.split())


def _longest_piece(segments: Segments) -> str:
    pieces, current = [], ""
    for segment in segments:
        if segment is None:
            pieces.append(current)
            current = ""
        else:
            current += segment
    pieces.append(current)
    return max((_collapse(p) for p in pieces), key=len)


@functools.lru_cache(maxsize=1)
def _messages() -> tuple[Message, ...]:
    """Read once per session: the three tests share it."""
    return tuple(sorted(set(_Source().messages()), key=lambda m: m.where))


def test_the_extraction_finds_the_messages_it_should():
    fragments = {m.fragment for m in _messages()}
    expected = [
        # a plain string, an f-string, a module constant with .format, a message function,
        # a warning, a concatenation with a local variable
        "gradsync.DistributedDataParallel needs a process group: call",
        "expected a list of one device, e.g. [local_rank], or None",
        "were written in place through a view taken before backward ended",
        "Possible causes and fixes: 1. The parameter is used outside the module's forward",
        "did not require grad when the wrapper was built",
        "; gradsync logging stays off",
    ]
    for text in expected:
        assert any(text in f for f in fragments), text
    assert len(fragments) > 100


def test_troubleshooting_quotes_every_error_message():
    page = _collapse(TROUBLESHOOTING.read_text())
    missing = [f"{m.where}: {m.fragment}" for m in _messages()
               if m.fragment not in INTERNAL and m.fragment not in page]
    assert not missing, (
        f"docs/troubleshooting.md does not quote {len(missing)} message(s) (each must appear "
        "exactly, whitespace collapsed):\n" + "\n".join(missing)
    )


def test_the_internal_allow_list_names_messages_that_exist_and_are_undocumented():
    fragments = {m.fragment for m in _messages()}
    page = _collapse(TROUBLESHOOTING.read_text())
    stale = [f for f in INTERNAL if f not in fragments]
    assert not stale, f"INTERNAL lists messages no longer in the code: {stale}"
    documented = [f for f in INTERNAL if f in page]
    assert not documented, f"documented, so not internal after all: {documented}"
