"""Sphinx configuration of mixprec's documentation site.

Build it with ``pip install -e ".[docs]"`` and ``python -m sphinx -W -b html docs docs/_build/html``;
``tests/test_docs.py`` runs the same build inside the suite.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the source tree, also when mixprec is not installed
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))  # cli_help: each subcommand's --help

from sphinx.ext.napoleon.docstring import GoogleDocstring  # noqa: E402

from mixprec import __version__  # noqa: E402

project = "mixprec"
author = "the mixprec authors"
copyright = "the mixprec authors, Apache-2.0"  # noqa: A001 - Sphinx's name
release = version = __version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
    "cli_help",
    "hf_fields_table",
    "example_diff",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "_ext", "ARCHITECTURE.md"]
smartquotes = False  # "--flag" stays two hyphens
myst_heading_anchors = 3

# Docstrings are the one place each behaviour is described: show members in source order, with their types
# in the description rather than a signature too long to read.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_typehints_description_target = "documented"  # the signature already shows every type
autodoc_class_signature = "separated"
autodoc_default_options = {"members": True}
autodoc_preserve_defaults = True
add_module_names = False

# Google-style "Args:" sections (napoleon), but field and property docstrings are prose: napoleon would read
# "The precision name (a string): ..." as a type and a description, and print a type that is no type.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
GoogleDocstring._parse_attribute_docstring = lambda self: self._consume_to_end()

# nitpicky (-n): every cross-reference must resolve. Types from other packages (torch, the standard library)
# have no pages here (no intersphinx: the build runs offline), nor do mixprec's private submodules; a reference
# to a public name (mixprec.X, mixprec.precision.X, ...) that does not exist still fails the build.
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(torch|nn|collections|contextlib|pathlib|numpy|os|typing|enum|abc|dataclasses|datetime|"
        r"logging|argparse|transformers|datasets|peft|torchao|accelerate)(\..*)?",
    ),
    (
        r"py:.*",
        r"mixprec\.(scaling|strategies|checkpoint|loaders|accelerator|trainer|watch|diagnostics|models|"
        r"data|optim|tracking|bench|cli|precision)\.[a-z_]+(\..*)?",
    ),
]
# unqualified names in docstrings, resolved by a reader but not by Sphinx (each one documented elsewhere here)
nitpick_ignore = (
    [
        ("py:class", name)
        for name in ("PrecisionNotSupportedError", "DiagnoseConfig", "WatchHost", "DistributedStrategy", "nn.Module")
    ]
    + [
        ("py:class", "F"),  # PartialState.on_main_process's type variable
        ("py:class", "default"),  # a napoleon "Returns:" phrase
    ]
    + [
        ("py:func", "make_precision"),
        ("py:func", "diagnose"),
        ("py:func", "fallback.restore"),
        ("py:meth", "PreparedDataLoader.skip_first_batches"),
        ("py:attr", "record"),
        ("py:mod", "mixprec.watch"),
    ]
)

html_theme = "furo"
html_title = f"mixprec {release}"
html_static_path: list[str] = []
pygments_style = "friendly"
pygments_dark_style = "monokai"
