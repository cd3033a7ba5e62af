"""The base of fp8jax's NNX layers: params drawn from the layer spec, the FP8 state,
dropout.

A layer's config (:mod:`fp8jax.layers`) lists its params; the constructor draws each into an
:class:`flax.nnx.Param` (logical axis names as NNX's ``out_sharding`` metadata) with the key
Linen's ``init`` would give it (:func:`fp8jax.layers.params.param_key`: the constructor's
``rngs.params()`` draw, the path of child names from the outermost layer, the param's number),
so the same key gives the same params as the Linen twin of :mod:`fp8jax.flax`, without running
it. Constructed inside ``fp8jax.autocast(enabled=True, recipe=DelayedScaling(...))`` a layer
also holds its FP8 state, the typed variables of :mod:`fp8jax.nnx.variables`. A composite
(``MultiHeadAttention``, ``TransformerLayer``) builds its children from its config's child
configs with their real sizes, handing each its :class:`Keys`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import meta as flax_meta

from fp8jax.autocast import get_recipe, is_fp8_enabled
from fp8jax.layers.checks import check_names, positive_int
from fp8jax.layers.params import ParamSpec, param_key
from fp8jax.nnx.variables import (
    FP8_META,
    FP8_PROBE,
    Fp8MetaVariable,
    Fp8Probe,
    Fp8Probes,
    Fp8State,
    assign,
    from_linen,
    is_meta_key,
    pure,
    to_linen,
)
from fp8jax.recipe import DelayedScaling

__all__ = [
    "Fp8Module",
    "Keys",
    "check_rngs",
    "feature_sizes",
    "keys_for",
    "make_config",
    "positive_int",
    "sizes",
]


class Keys(NamedTuple):
    """Where a layer draws its params' keys: the ``params`` key of the outermost layer's
    constructor and the child names from it down to this layer."""

    root: jax.Array
    path: tuple[str, ...] = ()

    def child(self, name: str) -> Keys:
        return Keys(self.root, (*self.path, name))


def check_rngs(owner: str, rngs: Any) -> nnx.Rngs:
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"{owner}: rngs must be a flax.nnx.Rngs, got {type(rngs).__name__}")
    return rngs


def keys_for(owner: str, rngs: Any, keys: Keys | None) -> Keys:
    """``keys`` (handed down by a composite), else a new root from ``rngs.params()``."""
    if keys is not None:
        return keys
    return Keys(check_rngs(owner, rngs).params())


def as_param(value: Any, names: tuple[str | None, ...]) -> nnx.Param:
    """An initial value as an ``nnx.Param`` with NNX's sharding metadata: logical axis
    ``names`` (or those of a value an initializer boxed itself) as ``out_sharding``."""
    metadata: dict[str, Any] = {}
    if isinstance(value, flax_meta.Partitioned):
        names = tuple(value.names)
        rules = getattr(value, "rules", None)
        if rules:
            metadata["sharding_rules"] = tuple(rules)
        value = value.value
    if names:
        metadata["out_sharding"] = tuple(names)
        if flax_meta.get_global_mesh() is None:
            # NNX shards annotated variables when they are made (eager sharding), which needs a
            # mesh; without one the names are kept as metadata only, as Linen keeps them.
            metadata["eager_sharding"] = False
    return nnx.Param(value, **metadata)


def dropout(x: jax.Array, rate: float, broadcast_dims: Any, key: jax.Array | None) -> jax.Array:
    """Inverted dropout as ``flax.linen.Dropout`` computes it (the same mask for the same
    key); ``x`` itself when ``key`` is None or the rate is 0."""
    if key is None or rate == 0.0:
        return x
    if rate == 1.0:
        return jnp.zeros_like(x)
    keep_prob = 1.0 - rate
    shape = list(x.shape)
    for d in broadcast_dims:
        shape[d] = 1
    keep = jax.random.bernoulli(key, p=keep_prob, shape=tuple(shape))
    keep = jnp.broadcast_to(keep, x.shape)
    return jax.lax.select(keep, x / keep_prob, jnp.zeros_like(x))


def call_rngs(rngs: Any) -> Any:
    """A call's ``rngs=`` for a composite to hand its children: a bare key becomes an
    ``nnx.Rngs`` (so each child draws its own key from it)."""
    if isinstance(rngs, jax.Array):
        return nnx.Rngs(dropout=rngs)
    return rngs


class Fp8Module(nnx.Module):
    """Base class of fp8jax's NNX layers (see the module docstring)."""

    def _draw(self, owner: str, specs: Mapping[str, ParamSpec], keys: Keys) -> None:
        """Draws the params ``specs`` (a config's, in its order) as this layer's attributes."""
        for number, (name, p) in enumerate(specs.items(), start=1):
            names = check_names(owner, p.axes_arg, p.axes, len(p.shape)) if p.axes else ()
            value = p.init(param_key(keys.root, keys.path, number), p.shape, p.dtype)
            setattr(self, name, as_param(value, names))

    def _fp8_state(self, n_roles: int | None) -> None:
        """Records the recipe the layer is constructed under, when it is a DelayedScaling
        inside ``autocast(enabled=True, ...)``, with the layer's FP8 state and probe of
        ``n_roles`` roles (``None``: a composite, whose children hold the state)."""
        recipe = get_recipe()
        self._recipe = None
        if is_fp8_enabled() and recipe.keeps_state:
            self._recipe = recipe
            if n_roles is not None:
                length = recipe.amax_history_len
                self.fp8_meta = Fp8State(jnp.zeros((n_roles, length)), jnp.ones((n_roles,)))
                self.fp8_probe = Fp8Probes(jnp.zeros((n_roles,)))

    def _dropout_stream(self, rngs: nnx.Rngs, name: str, deterministic: bool) -> None:
        """Keeps a fork of ``rngs[name]`` and the ``deterministic`` flag (``eval()``)."""
        if not isinstance(deterministic, bool):
            raise TypeError(
                f"{type(self).__name__}: deterministic must be a bool, got {deterministic!r}"
            )
        self.deterministic = deterministic
        self.rngs = rngs[name].fork()
        self._dropout_rng_name = name

    def _deterministic(self, deterministic: bool | None) -> bool:
        value = getattr(self, "deterministic", True) if deterministic is None else deterministic
        if not isinstance(value, bool):
            raise TypeError(
                f"{type(self).__name__}: deterministic must be a bool or None, got {value!r}"
            )
        return value

    def _dropout_key(self, rngs: Any) -> jax.Array:
        """A dropout key: from the call's ``rngs`` (an ``nnx.Rngs``, a stream or a key) if
        given, else from the kept stream."""
        name = self._dropout_rng_name
        source = rngs if rngs is not None else getattr(self, "rngs", None)
        if isinstance(source, nnx.Rngs):
            return source[name]()
        if isinstance(source, nnx.RngStream):
            return source()
        if isinstance(source, jax.Array):
            return source
        raise ValueError(
            f"{type(self).__name__}: deterministic is False (dropout on) but there is no "
            "RNG: construct with rngs=nnx.Rngs(...) or pass rngs=, or call with "
            "deterministic=True (model.eval())"
        )

    @property
    def recipe(self) -> DelayedScaling | None:
        """The DelayedScaling this layer's FP8 state was made under (None: no state)."""
        return self._recipe

    def linen_variables(self) -> dict[str, Any]:
        """The variables of the Linen twin: ``params``, ``fp8_meta`` and ``fp8_probe`` (the
        last two only with FP8 state), e.g. to save a Linen checkpoint."""
        out = {"params": pure(self, nnx.Param)}
        meta = to_linen(pure(self, Fp8MetaVariable), FP8_META)
        if meta:
            out[FP8_META] = meta
            out[FP8_PROBE] = to_linen(pure(self, Fp8Probe), FP8_PROBE)
        return out

    def load_linen_variables(self, variables: Mapping[str, Any]) -> None:
        """Sets the params (and the ``fp8_meta`` state, if given) from the Linen twin's
        variables (e.g. a Linen checkpoint); ValueError if their structure or shapes differ."""
        owner = f"{type(self).__name__}.load_linen_variables"
        if not isinstance(variables, Mapping) or "params" not in variables:
            raise ValueError(f"{owner}: variables must be a mapping holding 'params'")
        targets = [("params", nnx.Param, variables["params"])]
        if FP8_META in variables:
            meta = from_linen(variables[FP8_META], FP8_META, is_meta_key)
            targets.append((FP8_META, Fp8MetaVariable, meta))
        for name, kind, tree in targets:
            have = jax.tree.map(jnp.shape, pure(self, kind))
            given = jax.tree.map(jnp.shape, flax_meta.unbox(tree))
            if have != given:
                raise ValueError(
                    f"{owner}: {name!r} has the structure/shapes {given}, this module has {have}"
                )
            assign(self, kind, jax.tree.map(jnp.asarray, flax_meta.unbox(tree)))

    def _values(self, names: Any) -> dict[str, jax.Array]:
        """The values of the params ``names`` this layer has, by name."""
        return {n: getattr(self, n).get_value() for n in names if hasattr(self, n)}


def make_config(owner: str, cls: type, config: Mapping[str, Any], **fixed: Any) -> Any:
    """A ``cls`` config from a constructor's keyword arguments ``config`` and its ``fixed``
    ones (the sizes it takes positionally); a TypeError names an unknown or fixed keyword.
    Lists become tuples, so the config stays hashable."""
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in config:
        if key not in fields or key in fixed:
            raise TypeError(f"{owner}: unexpected keyword argument {key!r}")
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    return cls(**fixed, **kw)


def sizes(owner: str, name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return (positive_int(owner, name, value),)
    try:
        out = tuple(value)
    except TypeError:
        raise TypeError(
            f"{owner}: {name} must be an int or a tuple of ints, got {value!r}"
        ) from None
    if not out:
        raise ValueError(f"{owner}: {name} must not be empty")
    return tuple(positive_int(owner, name, v) for v in out)


def feature_sizes(features: Any) -> tuple[int, ...]:
    return (int(features),) if np.ndim(features) == 0 else tuple(int(f) for f in features)
