"""How fp8jax's Linen modules declare the params their configs list (:mod:`fp8jax.layers`):
``self.param`` in the listed order, each initializer boxed with its logical axis names
(:func:`flax.linen.with_logical_partitioning`) when it has some."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
from flax.core import meta

from fp8jax.layers.checks import check_names
from fp8jax.layers.layout import explicit_spec
from fp8jax.layers.params import ParamSpec

__all__ = ["annotated", "declare"]


def annotated(owner: str, name: str, init: Any, names: Any, ndim: int) -> Any:
    """``init`` boxed with logical axis ``names``; ``init`` itself when ``names`` is empty.

    Under explicit mesh axes (``jax.make_mesh``'s default) with logical axis rules active, the
    drawn value is laid out as the rules say before Flax's unboxing constrains it (there a
    sharding constraint only asserts), so ``init`` under ``jax.set_mesh`` and the rules gives
    params already sharded."""
    if not names:
        return init
    names = check_names(owner, name, names, ndim)

    def laid_out(*args: Any, **kwargs: Any) -> Any:
        value = init(*args, **kwargs)
        spec = explicit_spec(names)
        if spec is None or isinstance(value, meta.AxisMetadata):
            return value
        return jax.sharding.reshard(value, spec)

    return nn.with_logical_partitioning(laid_out, names)


def declare(module: nn.Module, owner: str, specs: Mapping[str, ParamSpec]) -> dict[str, jax.Array]:
    """Creates (or reads) ``module``'s params ``specs`` in their order; returns their values by
    name."""
    out = {}
    for name, p in specs.items():
        init = annotated(owner, p.axes_arg, p.init, p.axes, len(p.shape))
        out[name] = module.param(name, init, p.shape, p.dtype)
    return out
