"""Sphinx configuration of the celery-duraflow documentation.

Build it with ``make docs`` (``sphinx-build -W --keep-going -b html docs docs/_build/html``):
every warning is an error, so a broken cross-reference, a public name missing from the API
reference or a setting missing from the configuration table fails the build.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx
from sphinx.util import logging

import celery_duraflow
import celery_duraflow.errors
import celery_duraflow.signals

logger = logging.getLogger(__name__)
DOCS = Path(__file__).resolve().parent

# -- Project ---------------------------------------------------------------------------------

project = "celery-duraflow"
author = "celery-duraflow contributors"
copyright = "celery-duraflow contributors"
release = celery_duraflow.__version__
version = ".".join(release.split(".")[:2])

# -- General ---------------------------------------------------------------------------------

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_click",
]
# Intersphinx is left out on purpose: it downloads the inventories of Python, Celery and
# SQLAlchemy at build time, and the build must work offline. The references to their types
# that this leaves unresolved are listed in nitpick_ignore_regex below.

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "**/README.md", ".DS_Store", "Thumbs.db"]

# Every cross-reference must resolve (warnings are errors in `make docs`).
nitpicky = True
# The standard library, Celery, kombu and SQLAlchemy are not documented here (no intersphinx,
# see above), yet their types appear in signatures and lists of base classes.
nitpick_ignore_regex = [
    ("py:(class|mod|func|exc|obj)",
     r"(datetime|collections|typing|types|pickle|pathlib|os)(\..*)?"),
    ("py:(class|mod|func|exc|obj)", r"(celery|kombu|sqlalchemy)(\..*)?"),
    # Pydantic AI, whose types the signatures of celery_duraflow.contrib.pydantic_ai name.
    ("py:(class|mod|func|exc|obj|meth)", r"(pydantic_ai|pydantic_core|pydantic)(\..*)?"),
]
# Private names that public docstrings and signatures mention. They are not part of the
# documented API, so there is nothing to link to.
nitpick_ignore = [
    ("py:class", "celery_duraflow._records.RunRecord"),  # what retry_run() returns
    ("py:class", "celery_duraflow._history.History"),  # a loaded history file
    # RunView.queue's items, documented as celery_duraflow.QueuePlace
    ("py:class", "celery_duraflow._flow_store.QueuePlace"),
]


# Docutils' smart quotes would turn the `--option` of a command into an en dash and the
# straight quotes of a JSON payload into curly ones wherever the text is not a literal: in
# the help texts of the CLI reference (sphinx-click) above all, from which commands are
# copied. Text stays as typed; MyST's own "smartquotes" and "replacements" stay off too.
smartquotes = False

# -- MyST ------------------------------------------------------------------------------------

# Headings up to ### get anchors, so pages can link to sections: [text](page.md#anchor).
myst_heading_anchors = 3

# -- autodoc and napoleon --------------------------------------------------------------------

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Show defaults as written (`input=_NO_INPUT`), not the repr of a sentinel object.
autodoc_preserve_defaults = True

napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" sections become fields of their class, not separate object descriptions
# (which would collide with the members autodoc documents).
napoleon_use_ivar = True

# -- HTML ------------------------------------------------------------------------------------

html_theme = "furo"
html_title = f"celery-duraflow {release}"
html_short_title = "celery-duraflow"
html_copy_source = False
html_show_sourcelink = False


# -- Checks: the reference pages must keep up with the package --------------------------------


def _public_names() -> dict[str, list[str]]:
    """The objects the API reference must describe, by fully qualified name."""
    top = [n for n in celery_duraflow.__all__ if not n.startswith("__")]
    return {
        "celery_duraflow.__all__": [f"celery_duraflow.{n}" for n in top],
        "celery_duraflow.errors.__all__": [
            f"celery_duraflow.errors.{n}" for n in celery_duraflow.errors.__all__],
        "celery_duraflow.signals.__all__": [
            f"celery_duraflow.signals.{n}" for n in celery_duraflow.signals.__all__],
    }


def _check_api_reference(app: Sphinx, env: Any) -> None:
    objects = env.get_domain("py").objects
    for source, names in _public_names().items():
        for name in names:
            if name not in objects:
                logger.warning("%s lists %s, which the API reference does not describe "
                               "(add it to a page under docs/reference/)", source, name)


def _check_settings_table(app: Sphinx, env: Any) -> None:
    try:
        from celery_duraflow._config import KNOWN_KEYS
    except ImportError:  # the list moved: nothing to compare against
        return
    path = DOCS / "reference" / "configuration.md"
    page = path.read_text(encoding="utf-8") if path.exists() else ""
    documented = set(re.findall(r"`duraflow_([a-z_]+)`", page))
    for key in KNOWN_KEYS:
        if key not in documented:
            logger.warning("setting duraflow_%s is not in docs/reference/configuration.md",
                           key)


def _indent_first_line_literal(app: Sphinx, what: str, name: str, obj: Any, options: Any,
                               lines: list[str]) -> None:
    """Repair a literal block announced by ``::`` at the end of a docstring's first line.

    ``inspect.cleandoc`` takes the common indentation from the lines after the first, so
    the block that follows loses the indentation that made it a literal block, and
    docutils warns "Literal block expected; none found". Indent it again. (The docstring
    itself is better written with the example announced in a paragraph of its own.)
    """
    if not lines or not lines[0].rstrip().endswith("::"):
        return
    rest = lines[1:]
    if any(line.startswith(" ") for line in rest if line.strip()):
        return
    lines[1:] = ["    " + line if line.strip() else line for line in rest]


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("autodoc-process-docstring", _indent_first_line_literal)
    app.connect("env-check-consistency", _check_api_reference)
    app.connect("env-check-consistency", _check_settings_table)
    return {"parallel_read_safe": True}
