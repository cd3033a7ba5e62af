"""Sphinx configuration of fp8jax's API reference (built from the docstrings; CI builds it with
warnings as errors: ``python -m sphinx -W --keep-going -b html docs/api <out>``)."""

from __future__ import annotations

project = "fp8jax"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.autosummary"]
autodoc_typehints = "none"  # the signatures show them; docstrings say what they mean
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
nitpicky = False
html_theme = "alabaster"
exclude_patterns = ["_build"]


def _dataclass_fields() -> set[str]:
    """The field names of fp8jax's dataclasses (recipes, layer configs, Flax modules)."""
    import dataclasses

    import fp8jax.flax
    import fp8jax.layers
    import fp8jax.recipe

    names: set[str] = set()
    for module in (fp8jax.recipe, fp8jax.layers, fp8jax.flax):
        for value in vars(module).values():
            if isinstance(value, type) and dataclasses.is_dataclass(value):
                names.update(f.name for f in dataclasses.fields(value))
    return names


_FIELDS: set[str] = set()


def _skip_fields(app, what, name, obj, skip, options):
    """A class's dataclass fields are documented by its docstring's "Attributes:" section
    (napoleon); autodoc would document each a second time."""
    if what == "class" and name in _FIELDS:
        return True
    return None


def setup(app):
    _FIELDS.update(_dataclass_fields())
    app.connect("autodoc-skip-member", _skip_fields)
