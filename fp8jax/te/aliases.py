"""``import transformer_engine`` resolved to :mod:`fp8jax.te` (opt in: :func:`install`).

After ``fp8jax.te.install()``, ``import transformer_engine.jax``, ``from
transformer_engine.common import recipe`` and every other module path :mod:`fp8jax.te`
mirrors give fp8jax's modules (``transformer_engine.X`` is ``fp8jax.te.X``, the same module
object), so code written for TransformerEngine's JAX API (MaxText's ``te_*`` quantization)
runs on fp8jax unchanged. A path fp8jax does not mirror is the usual ``ModuleNotFoundError``.

It refuses when TransformerEngine itself is installed (both cannot be ``transformer_engine``),
is idempotent, and :func:`uninstall` undoes it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence

__all__ = ["ALIAS", "install", "is_installed", "uninstall"]

#: The package name the finder answers for.
ALIAS = "transformer_engine"
_TARGET = "fp8jax.te"


def _target(fullname: str) -> str | None:
    if fullname == ALIAS:
        return _TARGET
    if fullname.startswith(ALIAS + "."):
        return _TARGET + fullname[len(ALIAS) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Hands out the fp8jax.te module itself for its ``transformer_engine`` name."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        return None  # already executed under its fp8jax name


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``transformer_engine[.X]`` as ``fp8jax.te[.X]`` when that module exists."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        name = _target(fullname)
        if name is None or importlib.util.find_spec(name) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(name), is_package=True)


def _finder() -> _AliasFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, _AliasFinder)), None)


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _finder() is not None


def install() -> None:
    """Makes ``import transformer_engine...`` give :mod:`fp8jax.te`'s modules.

    Raises:
      RuntimeError: TransformerEngine is installed (or another ``transformer_engine`` module
        is importable or imported): uninstall it, or use its API instead of fp8jax's.
    """
    if is_installed():
        return
    loaded = sys.modules.get(ALIAS)
    if loaded is not None or importlib.util.find_spec(ALIAS) is not None:
        where = getattr(loaded, "__file__", None) or importlib.util.find_spec(ALIAS).origin
        raise RuntimeError(
            f"fp8jax.te.install: a {ALIAS!r} package is already installed ({where}); fp8jax "
            "will not stand in for TransformerEngine where TransformerEngine is present. "
            f"Uninstall it (pip uninstall transformer-engine) to run TE code on fp8jax."
        )
    sys.meta_path.insert(0, _AliasFinder())


def uninstall() -> None:
    """Undoes :func:`install`: removes the finder and the ``transformer_engine`` modules it
    gave out (fp8jax's modules stay imported under their own names)."""
    finder = _finder()
    if finder is None:
        return
    sys.meta_path.remove(finder)
    for name in [n for n in sys.modules if _target(n) is not None]:
        if sys.modules[name] is sys.modules.get(_target(name)):
            del sys.modules[name]
