"""The API reference (docs/api, Sphinx) covers the public API: every name of ``fp8jax.__all__``
by its public name, and the public submodules. Read from the .rst directives, so it runs
without Sphinx (``bash tools/docs.sh`` builds the pages, warnings as errors)."""

from __future__ import annotations

import functools
import importlib
import re
import types
from pathlib import Path
from typing import Any

import pytest

import fp8jax

API = Path(__file__).resolve().parents[1] / "docs" / "api"
#: Public modules that are not in ``fp8jax.__all__``: the lazily imported front-ends and
#: optimizer (a star import would import Flax), the layer spec, and TE's API (fp8jax.te).
PUBLIC_MODULES = (
    "fp8jax.flax",
    "fp8jax.nnx",
    "fp8jax.optim",
    "fp8jax.layers",
    "fp8jax.ops",
    "fp8jax.te",
    "fp8jax.te.convert",
    "fp8jax.te.common.recipe",
    "fp8jax.te.jax.dense",
    "fp8jax.te.jax.layernorm_dense",
    "fp8jax.te.jax.layernorm_mlp",
    "fp8jax.te.jax.quantize",
    "fp8jax.te.jax.cpp_extensions",
    "fp8jax.te.jax.sharding",
    "fp8jax.te.jax.attention",
    "fp8jax.te.jax.flax.module",
)
_DIRECTIVE = re.compile(
    r"^\.\. auto(module|function|class|data|exception|attribute|method)::\s*(\S+)[ \t]*\n"
    r"((?:[ \t]+:[\w-]+:.*\n(?:[ \t]{6,}\S.*\n)*)*)",
    re.M,
)
_OPTION = re.compile(r"^[ \t]+:([\w-]+):(.*(?:\n[ \t]{6,}\S.*)*)", re.M)


@functools.cache
def directives() -> list[tuple[str, str, dict[str, str], str]]:
    """``(kind, target, options, file)`` of every autodoc directive in docs/api/*.rst."""
    out = []
    for rst in sorted(API.glob("*.rst")):
        for kind, target, block in _DIRECTIVE.findall(rst.read_text()):
            options = {k: " ".join(v.split()) for k, v in _OPTION.findall(block)}
            out.append((kind, target, options, rst.name))
    return out


def resolve(target: str) -> Any:
    """The object a directive's dotted ``target`` names, as autodoc finds it: the longest
    importable module prefix, then attributes."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(target)


def automodule_members(target: str, options: dict[str, str]) -> set[str]:
    """What ``.. automodule:: target`` documents besides the module: its ``__all__`` (as
    autodoc reads it) less ``:exclude-members:``; nothing with ``:no-members:``."""
    if "no-members" in options:
        return set()
    excluded = {n.strip() for n in options.get("exclude-members", "").split(",") if n.strip()}
    module = importlib.import_module(target)
    return {f"{target}.{n}" for n in getattr(module, "__all__", ()) if n not in excluded}


@functools.cache
def documented() -> tuple[set[str], set[str]]:
    """(the dotted names the site documents, of which modules documented with members)."""
    names, modules = set(), set()
    for kind, target, options, _ in directives():
        names.add(target)
        if kind == "module":
            members = automodule_members(target, options)
            names |= members
            if "no-members" not in options:
                modules.add(target)
    return names, modules


def test_the_directives_are_read():
    found = {(kind, target) for kind, target, _, _ in directives()}
    assert ("function", "fp8jax.dense") in found
    assert ("module", "fp8jax.flax") in found
    options = {target: opts for _, target, opts, _ in directives()}
    assert options["fp8jax"] == {"no-members": ""}
    assert "Recipe" in options["fp8jax.recipe"]["exclude-members"].split(", ")


@pytest.mark.parametrize("name", sorted(fp8jax.__all__))
def test_every_public_name_has_an_entry(name):
    """``fp8jax.NAME`` by that name (the module defining it may move: the functional layers
    moved into fp8jax/functional/), a public module by an automodule with its members."""
    names, _ = documented()
    kind = "automodule" if isinstance(getattr(fp8jax, name), types.ModuleType) else "autofunction"
    assert f"fp8jax.{name}" in names, (
        f"docs/api: fp8jax.{name} has no entry; add '.. {kind}:: fp8jax.{name}' (autoclass, "
        "autodata) to the page of its kind"
    )


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_module_has_a_page(module):
    _, modules = documented()
    assert module in modules, f"docs/api: no '.. automodule:: {module}' documenting its members"
    assert getattr(importlib.import_module(module), "__all__", None), (
        f"{module} has no __all__: autodoc would document only what it defines itself"
    )


def test_every_entry_names_a_public_object():
    """Each directive resolves (a page naming a moved module path fails here before Sphinx
    does), and a name of ``fp8jax.__all__`` is documented by its public name only, never by
    the module that defines it (``fp8jax.moe``, not ``fp8jax.functional.moe.moe``)."""
    public = {
        id(getattr(fp8jax, n)): f"fp8jax.{n}"
        for n in fp8jax.__all__
        if not isinstance(getattr(fp8jax, n), (types.ModuleType, str, int, float))
    }
    wrong = []
    for kind, target, _, page in directives():
        try:
            obj = resolve(target)
        except (ImportError, AttributeError) as e:
            wrong.append(f"{page}: {target} does not resolve ({type(e).__name__}: {e})")
            continue
        if kind != "module" and public.get(id(obj), target) != target:
            wrong.append(f"{page}: {target} is public as {public[id(obj)]}; document it so")
    assert not wrong, wrong


def test_no_members_list():
    """conf.py's ``autodoc_default_options`` ("members": True) replaces a directive's
    ``:members: a, b`` list (Sphinx merges only string defaults), so a list would document
    every member; the pages narrow an automodule with ``:exclude-members:`` instead."""
    lists = [
        f"{page}: {target}"
        for _, target, options, page in directives()
        if options.get("members", "").strip()
    ]
    assert not lists, lists


def test_every_page_is_in_the_toctree():
    index = (API / "index.rst").read_text()
    pages = {p.stem for p in API.glob("*.rst")} - {"index"}
    missing = sorted(p for p in pages if not re.search(rf"^\s+{p}\s*$", index, re.M))
    assert not missing, f"docs/api/index.rst: {missing} not in the toctree"
