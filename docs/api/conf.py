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
    """The field names of fp8jax's dataclasses (recipes, layer configs, Flax modules, the mesh
    resource) and of its NamedTuples whose docstring has an "Attributes:" section (the
    optimizer's state)."""
    import dataclasses

    import fp8jax.flax
    import fp8jax.layers
    import fp8jax.optim
    import fp8jax.recipe
    import fp8jax.sharding

    names: set[str] = set()
    for module in (fp8jax.recipe, fp8jax.layers, fp8jax.flax, fp8jax.sharding, fp8jax.optim):
        for value in vars(module).values():
            if not isinstance(value, type):
                continue
            if dataclasses.is_dataclass(value):
                names.update(f.name for f in dataclasses.fields(value))
            elif issubclass(value, tuple) and "Attributes:" in (value.__doc__ or ""):
                names.update(getattr(value, "_fields", ()))
    return names


_FIELDS: set[str] = set()


def _skip_fields(app, what, name, obj, skip, options):
    """A class's fields are documented by its docstring's "Attributes:" section (napoleon);
    autodoc would document each a second time."""
    if what == "class" and name in _FIELDS:
        return True
    return None


def _constant_docs(app, what, name, obj, options, lines):
    """A constant re-exported by its public name (``fp8jax.CHECKPOINT_NAMES``) has its ``#:``
    comment in the module that defines it, which autodoc does not read: it shows the
    docstring of the value's type ("Built-in immutable sequence."). Use that comment."""
    import inspect
    import sys

    from sphinx.pycode import ModuleAnalyzer, PycodeError

    if what != "data" or not isinstance(type(obj).__doc__, str):
        return
    own = inspect.cleandoc(type(obj).__doc__)
    if not own or " ".join(lines).split() != own.split():
        return
    attr = name.rsplit(".", 1)[-1]
    for modname, module in sorted(sys.modules.items()):
        if not modname.startswith("fp8jax") or getattr(module, attr, None) is not obj:
            continue
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except PycodeError:
            continue
        if ("", attr) in docs:
            lines[:] = list(docs[("", attr)])
            return
    lines[:] = []


def setup(app):
    _FIELDS.update(_dataclass_fields())
    app.connect("autodoc-skip-member", _skip_fields)
    app.connect("autodoc-process-docstring", _constant_docs)
