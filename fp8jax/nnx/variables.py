"""The FP8 variables of fp8jax's NNX modules, and how they map onto the Linen collections.

An FP8 layer of fp8jax.nnx holds, beside its :class:`flax.nnx.Param` attributes:

- ``fp8_meta`` (:class:`Fp8State`): :class:`Fp8MetaVariable` ``amax_history`` float32[R, L]
  and ``scale`` float32[R], the delayed-scaling state (R = 3 per FP8 GEMM: input, kernel,
  output-grad);
- ``fp8_probe`` (:class:`Fp8Probes`): :class:`Fp8Probe` ``call_0``, zeros float32[R]. The
  gradient of the loss with respect to it is what the layer observed (its amax per role),
  max-merged over the layer's calls (:mod:`fp8jax.nnx._probe`).

Both are created when a layer is constructed inside ``fp8jax.autocast(enabled=True,
recipe=DelayedScaling(...))``. Being their own :class:`flax.nnx.Variable` types, they are never
seen by ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, ``nnx.state(model, Fp8MetaVariable)``
selects the state, and they are saved with the rest of ``nnx.state(model)`` by orbax.

The attribute tree of a model mirrors the variables of its Linen twin (``fp8jax.flax``), with
each Linen scope's ``fp8_meta``/``fp8_probe`` entries one level down, so a parameter named
``scale`` and the FP8 ``scale`` never collide; :func:`to_linen` and :func:`from_linen` convert.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["FP8_META", "FP8_PROBE", "Fp8MetaVariable", "Fp8Probe", "Fp8Probes", "Fp8State"]

#: Name of the attribute that holds a layer's :class:`Fp8State` (and of the Linen collection).
FP8_META = "fp8_meta"
#: Name of the attribute that holds a layer's :class:`Fp8Probes` (and of the Linen collection).
FP8_PROBE = "fp8_probe"

_META_KEYS = frozenset({"amax_history", "scale"})
_CALL_RE = re.compile(r"call_\d+")


class Fp8MetaVariable(nnx.Variable):
    """Delayed-scaling state of an FP8 layer: ``amax_history`` float32[R, L] or ``scale``
    float32[R]. Updated by :func:`fp8jax.nnx.update_fp8_variables`, never by an optimizer.
    (The arrays of :class:`fp8jax.Fp8Meta`, as NNX variables.)"""


class Fp8Probe(nnx.Variable):
    """A zero float32[R] whose gradient is what the layer observed (one amax per role).

    Differentiate with respect to it (:func:`fp8jax.nnx.diff_state`) and pass the gradients to
    :func:`fp8jax.nnx.update_fp8_variables`."""


class Fp8State(nnx.Module):
    """The ``fp8_meta`` node of an FP8 layer: ``amax_history`` and ``scale``."""

    def __init__(self, amax_history: jax.Array, scale: jax.Array) -> None:
        self.amax_history = Fp8MetaVariable(jnp.asarray(amax_history, jnp.float32))
        self.scale = Fp8MetaVariable(jnp.asarray(scale, jnp.float32))


class Fp8Probes(nnx.Module):
    """The ``fp8_probe`` node of an FP8 layer: ``call_0`` (one probe per layer; its calls are
    merged by the fork of :mod:`fp8jax.nnx._probe`)."""

    def __init__(self, call_0: jax.Array) -> None:
        self.call_0 = Fp8Probe(jnp.asarray(call_0, jnp.float32))


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
