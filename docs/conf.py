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

# Docstring fixes applied before napoleon reads the docstring, for the few
# docstrings in torch_sac/ that do not yet parse as reST or that napoleon
# renders wrongly. Each entry is an
# exact (old, new) text replacement on one object's docstring; the build
# fails if `old` is no longer there, so an entry goes once its docstring is
# fixed in torch_sac/ (CONTRIBUTING.md, "Docs"). No warning category is
# suppressed.
DOCSTRING_FIXES = {
    # "*args, **kwargs:" as one Args entry: napoleon escapes only the first
    # name, and docutils reads "**kwargs" as unclosed strong emphasis.
    "torch_sac.checkpoint": [(
        "    *args, **kwargs: passed to ``function``.\n",
        "    *args: passed to ``function``.\n    **kwargs: passed to ``function``.\n",
    )],
    # A bullet list straight after "one of" (no blank line): docutils
    # reports unexpected indentation.
    "torch_sac.create_selective_checkpoint_contexts": [(
        "    policy_fn_or_list: one of\n",
        "    policy_fn_or_list: one of\n\n",
    )],
    # Property and data docstrings whose first line reads "X: Y": napoleon
    # takes X as the attribute's type and renders "Type: X" (no warning,
    # wrong page). Reworded without the first-line colon.
    "torch_sac.IGNORED_OPS": [(
        "Ops never passed to a policy: metadata queries and detach, whose count\n"
        "differs between forward and recompute.",
        "Ops never passed to a policy, namely metadata queries and detach, whose\n"
        "count differs between forward and recompute.",
    )],
    "torch_sac.profile.ops": [(
        "Per op overload, summed over the regions: a list of dicts.",
        "A list of dicts, per op overload, summed over the regions.",
    )],
    "torch_sac.policies.ModelBudget.budget_bytes": [(
        "Summed over blocks: the most the plans let the blocks keep.",
        "The most the plans let the blocks keep, summed over blocks.",
    )],
    "torch_sac.ReplaySchedule.recomputed": [(
        "How many rebuilds each tensor key was rebuilt in: ``{key: count}``",
        "How many rebuilds each tensor key was rebuilt in, as ``{key: count}``",
    )],
}
_FIXES_USED = set()
# Whether autodoc read any docstring in this build: an incremental build that
# did not re-read docs/api.rst applies no fix and checks none.
_AUTODOC_RAN = {"ran": False}


def _fix_docstring(app, what, name, obj, options, lines):
    _AUTODOC_RAN["ran"] = True
    fixes = DOCSTRING_FIXES.get(name)
    if not fixes:
        return
    _FIXES_USED.add(name)
    text = "\n".join(lines) + "\n"
    for old, new in fixes:
        if old not in text:
            raise RuntimeError(
                f"docs/conf.py: the docstring fix for {name} no longer applies "
                f"(fixed in torch_sac/?): remove it from DOCSTRING_FIXES")
        text = text.replace(old, new, 1)
    lines[:] = text.rstrip("\n").split("\n")


def _check_fixes_used(app, exception):
    unused = set(DOCSTRING_FIXES) - _FIXES_USED
    if exception is None and unused and _AUTODOC_RAN["ran"]:
        raise RuntimeError(
            f"docs/conf.py: DOCSTRING_FIXES entries matched no documented object: "
            f"{sorted(unused)} (renamed, or no longer in docs/api.rst?)")


def setup(app):
    # Before napoleon (priority 500) turns the Google sections into reST.
    app.connect("autodoc-process-docstring", _fix_docstring, priority=400)
    app.connect("build-finished", _check_fixes_used)
