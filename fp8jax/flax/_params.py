"""How fp8jax's Linen modules declare the params their configs list (:mod:`fp8jax.layers`):
``self.param`` in the listed order, each initializer boxed with its logical axis names
(:func:`flax.linen.with_logical_partitioning`) when it has some."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax

from fp8jax.layers.checks import check_names
from fp8jax.layers.params import ParamSpec

__all__ = ["annotated", "declare"]


def annotated(owner: str, name: str, init: Any, names: Any, ndim: int) -> Any:
    """``init`` boxed with logical axis ``names``; ``init`` itself when ``names`` is empty."""
    if not names:
        return init
    return nn.with_logical_partitioning(init, check_names(owner, name, names, ndim))


def declare(module: nn.Module, owner: str, specs: Mapping[str, ParamSpec]) -> dict[str, jax.Array]:
    """Creates (or reads) ``module``'s params ``specs`` in their order; returns their values by
    name."""
    out = {}
    for name, p in specs.items():
        init = annotated(owner, p.axes_arg, p.init, p.axes, len(p.shape))
        out[name] = module.param(name, init, p.shape, p.dtype)
    return out
