"""The FP8 on/off switch and the current recipe.

``with fp8jax.autocast(enabled=True, recipe=recipe): ...`` turns FP8 on for the fp8jax layers
called inside the block and tells them which :class:`~fp8jax.recipe.Recipe` to follow. Outside any
``autocast`` FP8 is off and there is no recipe. Blocks nest; leaving one (normally or by an
exception) restores the state of the enclosing one.

The state is **thread-local**: entering ``autocast`` in one thread changes nothing that another
thread sees.

The state is also **part of jax.jit's cache key** (it is held in a
:func:`jax.make_user_context` context). A function jitted under one recipe, or with FP8 off, is
traced again when it is called under another recipe or with the flag changed, so a stale trace is
never reused; calling it again under a state seen before hits the cache.

Enter it around ``init`` and ``apply`` of fp8jax layers, either outside ``jax.jit`` (the state
then becomes part of the jitted call's cache key) or inside the jitted function, around the code
that calls the layers (it is read while tracing)::

    with fp8jax.autocast(enabled=True, recipe=recipe):
        variables = layer.init(rng, x)

    @jax.jit
    def train_step(state, x, y):
        with fp8jax.autocast(enabled=True, recipe=recipe):
            ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from fp8jax.recipe import DelayedScaling, Recipe, check_recipe
from fp8jax.sharding import MeshResource

__all__ = ["autocast", "fp8_autocast", "get_recipe", "is_fp8_enabled"]


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """The autocast state: hashable, so it can be part of jit's cache key."""

    enabled: bool
    recipe: Recipe | None


DEFAULT_STATE = AutocastState(enabled=False, recipe=None)

# Created once, at import: jax.make_user_context must not be called concurrently with other JAX
# APIs. Using the context afterwards (from any thread) is thread-safe and thread-local.
_CONTEXT = jax.make_user_context(default_value=DEFAULT_STATE)


# Context managers that every ``autocast`` block enters as well, registered at import by the layers
# above (the Linen modules number their FP8 calls per ``apply`` with one: fp8jax.flax._variables).
# They change what Python tracks while tracing, never the traced program.
_BLOCK_CONTEXTS: list[Callable[[], contextlib.AbstractContextManager[None]]] = []


def register_block_context(factory: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
    """Makes every ``autocast`` block enter ``factory()`` too (once per factory)."""
    if factory not in _BLOCK_CONTEXTS:
        _BLOCK_CONTEXTS.append(factory)


def current_state() -> AutocastState:
    """Returns the autocast state of the innermost ``autocast`` block of this thread."""
    return _CONTEXT.value


class _AutocastContext(contextlib.ContextDecorator):
    """Enters a fixed :class:`AutocastState`; reusable, reentrant, usable from several threads."""

    def __init__(self, state: AutocastState) -> None:
        self._state = state
        self._local = threading.local()  # per-thread stack of entered jax contexts

    def __enter__(self) -> None:
        stack = self._local.__dict__.setdefault("stack", [])
        with contextlib.ExitStack() as contexts:
            contexts.enter_context(_CONTEXT(self._state))
            for factory in _BLOCK_CONTEXTS:
                contexts.enter_context(factory())
            stack.append(contexts.pop_all())

    def __exit__(self, *exc_info: Any) -> None:
        self._local.stack.pop().__exit__(*exc_info)

    def __repr__(self) -> str:
        s = self._state
        return f"autocast(enabled={s.enabled!r}, recipe={s.recipe!r})"


def _check_mesh_resource(fn: str, mesh_resource: Any) -> None:
    """``None`` or an empty :class:`~fp8jax.sharding.MeshResource`; anything else is an error
    saying how fp8jax shards instead."""
    if mesh_resource is None:
        return
    if not isinstance(mesh_resource, MeshResource):
        raise TypeError(
            f"{fn}: mesh_resource must be None or a fp8jax.sharding.MeshResource, got "
            f"{mesh_resource!r}"
        )
    if mesh_resource.is_empty():
        return
    raise ValueError(
        f"{fn}: mesh_resource={mesh_resource!r} names mesh axes, but fp8jax does not take "
        "sharding from autocast: its layers are placed by Flax logical axis rules (the modules' "
        "*_axes arguments, TransformerLayer(logical_axes=True)). Leave mesh_resource out and "
        "enter flax.linen.logical_axis_rules(mesh_resource.axis_rules()) around init and "
        "apply (the same mapping; fp8jax.flax.DEFAULT_RULES is data x tensor parallelism on a "
        "('data', 'model') mesh). See docs/porting-from-te.md."
    )


def _checked(
    enabled: Any, recipe: Any, fn: str, recipe_arg: str, mesh_resource: Any = None
) -> contextlib.AbstractContextManager[None]:
    """Validates the arguments of ``fn`` and returns the context manager entering the state."""
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"{fn}: enabled must be a bool, got {enabled!r}")
    _check_mesh_resource(fn, mesh_resource)
    recipe = check_recipe(recipe, f"{fn}: {recipe_arg}", default=DelayedScaling())
    return _AutocastContext(AutocastState(enabled=bool(enabled), recipe=recipe))


def autocast(
    enabled: bool = True, recipe: Recipe | None = None, mesh_resource: MeshResource | None = None
) -> contextlib.AbstractContextManager[None]:
    """Context manager that turns FP8 on (or off) and sets the recipe for the block inside it.

    Args:
      enabled: Whether fp8jax layers compute in FP8 inside the block. With ``False`` the recipe is
        still recorded (:func:`get_recipe` returns it) but :func:`is_fp8_enabled` is ``False``.
      recipe: The :class:`~fp8jax.recipe.Recipe` to follow; ``None`` means
        ``DelayedScaling()`` (TransformerEngine's defaults).
      mesh_resource: TransformerEngine's argument, for porting: ``None`` or an empty
        :class:`~fp8jax.sharding.MeshResource` (what TE's single-device examples pass). One
        that names mesh axes is a ValueError: fp8jax shards by Flax logical axis rules
        (:meth:`~fp8jax.sharding.MeshResource.axis_rules` gives the equivalent ones).

    ``enabled`` defaults to ``True`` here (TE's ``autocast`` defaults to ``False``; TE code
    passes it explicitly).

    Returns:
      A context manager (also usable as a decorator, and reusable); the arguments are checked
      when ``autocast`` is called, not when the block is entered.

    Raises:
      TypeError: if ``enabled`` is not a bool, ``recipe`` is neither ``None`` nor a ``Recipe``,
        or ``mesh_resource`` is neither ``None`` nor a ``MeshResource``.
      ValueError: if ``mesh_resource`` names mesh axes (see above).

    Example:

    >>> from fp8jax.recipe import DelayedScaling
    >>> with autocast(enabled=True, recipe=DelayedScaling(margin=1)):
    ...     print(is_fp8_enabled(), get_recipe().margin)
    True 1
    >>> is_fp8_enabled(), get_recipe()
    (False, None)
    """
    return _checked(enabled, recipe, "autocast", "recipe", mesh_resource)


def fp8_autocast(
    enabled: bool = False,
    fp8_recipe: Recipe | None = None,
    mesh_resource: MeshResource | None = None,
) -> contextlib.AbstractContextManager[None]:
    """:func:`autocast` with the argument names and defaults of TransformerEngine's older
    ``fp8_autocast`` (off by default; TE v2 keeps it as a deprecated alias).

    For porting TE code: ``fp8_autocast(enabled=True, fp8_recipe=r)`` is
    ``autocast(enabled=True, recipe=r)``; ``mesh_resource`` as in :func:`autocast`.
    """
    return _checked(enabled, fp8_recipe, "fp8_autocast", "fp8_recipe", mesh_resource)


def is_fp8_enabled() -> bool:
    """Whether FP8 is on in the innermost ``autocast`` block of this thread (``False`` outside)."""
    return current_state().enabled


def get_recipe() -> Recipe | None:
    """The recipe of the innermost ``autocast`` block of this thread (``None`` outside any)."""
    return current_state().recipe
