"""The documentation as a reader meets it: a README that fits a screen, links and anchors that
resolve (checked here without network), an API page that names every public name, and every
example in examples/ run by some test. The Python blocks themselves run through Sybil
(conftest.py at the root); the site is built with warnings as errors by `make docs`."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250


def _pages() -> list[Path]:
    pages = [ROOT / "README.md"]
    for page in sorted((ROOT / "docs").rglob("*.md")):
        rel = page.relative_to(ROOT / "docs").parts
        if rel[0] != "_build" and "data" not in rel:
            pages.append(page)
    return pages


def _prose(text: str) -> str:
    """The page without its fenced blocks and code spans: links inside code are not links."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading (MyST's `myst_heading_anchors` makes the same one)."""
    heading = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*$", _prose(page.read_text()), flags=re.M)
    return {_slug(h) for h in headings}


def _links(page: Path) -> list[str]:
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(page.read_text()))


def test_the_readme_fits_a_screen_or_so():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path):
    broken = []
    for link in _links(page):
        if re.match(r"^[a-z]+:", link):  # http(s), mailto: not checked (no network)
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link}: no heading with anchor #{anchor} in {path.name}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_api_page_documents_every_public_name():
    api = (ROOT / "docs" / "api.md").read_text()
    missing = []
    for module in ("gradsync", "gradsync.comm_hooks", "gradsync.ft"):
        for name in importlib.import_module(module).__all__:
            if not re.search(rf"{re.escape(module)}\.{name}\b|\b{name}\b", api):
                missing.append(f"{module}.{name}")
    assert not missing, f"docs/api.md does not document {missing}"


def test_every_example_runs_in_some_test():
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    unrun = [p.name for p in sorted((ROOT / "examples").glob("*.py")) if p.name not in tests]
    assert not unrun, f"examples not run by any test under tests/: {unrun}"
