"""Sphinx configuration for gradsync's documentation (`make docs`).

Sphinx with MyST, as torch and torchft: the pages are Markdown, the API reference comes from the
docstrings (autodoc) and the CLI reference from the argument parsers (sphinx-argparse), so
neither can drift from the code. The build needs no network (no intersphinx) and runs with
warnings as errors (`-W` in the Makefile).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

project = "gradsync"
author = "the gradsync authors"
copyright = "2026, the gradsync authors"
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinxarg.ext",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "**/data/**", "**/raw/**"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# Docstrings write code in single backticks, as Markdown does.
default_role = "code"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
suppress_warnings: list[str] = []

html_theme = "furo"
html_title = "gradsync"
html_static_path: list[str] = []
