"""The FP8 variables of fp8jax's NNX modules, and how they map onto the Linen collections.

An NNX module of fp8jax holds, beside its :class:`flax.nnx.Param` attributes:

- :class:`Fp8Meta`: the delayed-scaling state, in an ``fp8_meta`` sub-node with ``amax_history``
  float32[R, L] and ``scale`` float32[R] (R = 3 per FP8 GEMM: input, kernel, output-grad);
- :class:`Fp8Probe`: zeros, in an ``fp8_probe`` sub-node (``call_0``, ...: one per call of the
  FP8 GEMM inside one forward of the module). The gradient of the loss with respect to a probe
  is what that call observed (its amax per role), max-merged over the module's calls.

Both are created when a module is constructed inside ``fp8jax.autocast(enabled=True,
recipe=DelayedScaling(...))``. Being their own :class:`flax.nnx.Variable` types, they are never
seen by ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, ``nnx.state(model, Fp8Meta)`` selects the
state, and they are saved with the rest of ``nnx.state(model)`` by orbax.

The attribute tree of a module mirrors the variables of its Linen twin (``fp8jax.flax``), with
each Linen scope's ``fp8_meta``/``fp8_probe`` entries one level down (``fp8_meta``/``fp8_probe``
nodes), so a parameter named ``scale`` and the FP8 ``scale`` never collide.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx

__all__ = ["FP8_META", "FP8_PROBE", "Fp8Meta", "Fp8Probe"]

#: Name of the node that holds a scope's :class:`Fp8Meta` (and of the Linen collection).
FP8_META = "fp8_meta"
#: Name of the node that holds a scope's :class:`Fp8Probe` (and of the Linen collection).
FP8_PROBE = "fp8_probe"

_META_KEYS = frozenset({"amax_history", "scale"})
_CALL_RE = re.compile(r"call_\d+")


class Fp8Meta(nnx.Variable):
    """Delayed-scaling state of an FP8 module: ``amax_history`` float32[R, L] or ``scale``
    float32[R]. Updated by :func:`fp8jax.nnx.update_fp8_state`, never by an optimizer."""


class Fp8Probe(nnx.Variable):
    """A zero float32[R] whose gradient is what the module observed (one amax per role).

    Differentiate with respect to it (:func:`fp8jax.nnx.diff_state`) and pass the gradients to
    :func:`fp8jax.nnx.update_fp8_state`."""


class Node(nnx.Module):
    """A scope of a Linen-defined layer: its variables (and sub-scopes) as attributes."""


def is_meta_key(key: Any) -> bool:
    return key in _META_KEYS


def is_probe_key(key: Any) -> bool:
    return isinstance(key, str) and _CALL_RE.fullmatch(key) is not None


def to_linen(tree: Any, level: str) -> Any:
    """An NNX pure dict (``{..., level: {leaves}}`` per scope) as a Linen collection tree (the
    ``level`` nodes' leaves directly in their scope)."""
    if not isinstance(tree, Mapping):
        return tree
    out: dict[str, Any] = {}
    for key, sub in tree.items():
        if key == level and isinstance(sub, Mapping):
            out.update(sub)
        elif isinstance(sub, Mapping):
            converted = to_linen(sub, level)
            if converted:
                out[str(key)] = converted  # str: list indices become names, as Linen's
    return out


def from_linen(tree: Any, level: str, is_leaf_key: Callable[[Any], bool]) -> Any:
    """Inverse of :func:`to_linen`: the leaves named by ``is_leaf_key`` go one level down,
    into a ``level`` node of their scope."""
    out: dict[str, Any] = {}
    group: dict[str, Any] = {}
    for key, sub in tree.items():
        if isinstance(sub, Mapping):
            out[str(key)] = from_linen(sub, level, is_leaf_key)
        elif is_leaf_key(key):
            group[str(key)] = sub
        else:
            raise ValueError(f"unexpected leaf {key!r} in the {level!r} collection")
    if group:
        out[level] = group
    return out


def write_back(pure: dict[Any, Any], tree: Mapping[str, Any], level: str) -> dict[Any, Any]:
    """``pure`` (an NNX pure dict, changed in place and returned) with each leaf replaced by the
    leaf of the Linen-shaped ``tree`` at its path (``level`` nodes dropped, keys as str)."""

    def walk(node: dict[Any, Any], path: tuple[str, ...]) -> None:
        for key, sub in node.items():
            if isinstance(sub, dict):
                walk(sub, path if key == level else (*path, str(key)))
                continue
            value: Any = tree
            for name in (*path, str(key)):
                value = value[name]
            node[key] = value

    walk(pure, ())
    return pure


def pure(obj: Any, *filters: Any) -> dict[Any, Any]:
    """The values of ``obj``'s variables selected by ``filters`` as a nested dict."""
    return nnx.to_pure_dict(nnx.state(obj, *filters))


def assign(obj: Any, kind: Any, values: dict[Any, Any]) -> None:
    """Sets ``obj``'s variables of ``kind`` from a nested dict shaped like :func:`pure`'s."""
    state = nnx.state(obj, kind)
    nnx.replace_by_pure_dict(state, values)
    nnx.update(obj, state)
