"""Sphinx configuration: the docs/ tree (Markdown through myst-parser) and
the API reference generated from torch_sac's docstrings (autodoc + napoleon).

Build with ``bash scripts/build_docs.sh`` (warnings are errors). autodoc
imports torch_sac, so the package must be built in this Python first
(``bash scripts/setup.sh`` or ``pip install --no-build-isolation -e .``).
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# The source tree's torch_sac (with its built extension module) comes first.
sys.path.insert(0, ROOT)

project = "torch_sac"
author = "torch_sac developers"
copyright = "torch_sac developers"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "build", "Thumbs.db", ".DS_Store"]

# Docstrings are Google style ("Args:", "Returns:", "Raises:", "Example:").
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_include_init_with_doc = False
napoleon_use_rtype = False

autodoc_member_order = "bysource"
autodoc_typehints = "none"  # signatures as written; few functions are annotated

# Markdown: "[text](page.md#a-heading)" links resolve to headings up to ###.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "alabaster"
html_title = "torch_sac"
