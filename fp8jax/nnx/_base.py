"""The base of fp8jax's NNX layers: construction from the Linen twin's initial values, the
Linen-shaped variable views, dropout.

A layer's constructor draws its initial values with the public ``init`` of its Linen twin in
:mod:`fp8jax.flax` (one definition of the params, their initializers and their keys, so the
same key gives the same params in both) on a one-token sample, and keeps them as typed NNX
variables: :class:`flax.nnx.Param` (logical axis names as NNX's ``out_sharding`` metadata) and
the FP8 state of :mod:`fp8jax.nnx.variables`. A composite (``MultiHeadAttention``,
``TransformerLayer``) runs its twin's ``init`` once and hands each child layer its subtree
(:class:`Given`); the forward of every layer is its own (the functional layers of fp8jax).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import meta as flax_meta

from fp8jax.autocast import get_recipe, is_fp8_enabled
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

__all__ = ["Fp8Module", "Given", "linen_init"]

_ACTIVATION_AXES = ("output_axes", "layernorm_input_axes", "dot_input_axes")


class Given(NamedTuple):
    """A layer's initial values, handed to it by a composite (instead of its own ``init``):
    its Linen twin (the configuration), its ``params``, ``fp8_meta`` and ``fp8_probe``
    subtrees (the last two empty without FP8 state) and the recipe they were made under."""

    linen: nn.Module
    params: Mapping[str, Any]
    fp8_meta: Mapping[str, Any]
    fp8_probe: Mapping[str, Any]
    recipe: DelayedScaling | None


def check_rngs(owner: str, rngs: Any) -> nnx.Rngs:
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"{owner}: rngs must be a flax.nnx.Rngs, got {type(rngs).__name__}")
    return rngs


def positive_int(owner: str, name: str, value: Any) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
    return int(value)


def linen_init(
    owner: str,
    linen: nn.Module,
    sample: tuple[Any, ...],
    rngs: nnx.Rngs,
    init_kwargs: Mapping[str, Any] | None = None,
) -> Given:
    """Runs the twin's ``init`` with ``rngs.params()`` (the first draw, as Linen's
    ``init(key)`` uses it). The activation constraints do not touch the params: init runs
    without them (the sample is one token, of fixed rank) and without axis rules (no mesh
    needs to divide it)."""
    check_rngs(owner, rngs)
    quiet = {f: () for f in _ACTIVATION_AXES if getattr(linen, f, ())}
    with nn.logical_axis_rules(()):
        variables = linen.clone(**quiet).init(
            {"params": rngs.params()}, *sample, **dict(init_kwargs or {})
        )
    extra = sorted(set(variables) - {"params", FP8_META, FP8_PROBE})
    if extra:
        raise ValueError(f"{owner}: unexpected Linen collections {extra}")
    recipe = get_recipe() if is_fp8_enabled() else None
    meta = variables.get(FP8_META, {})
    stated = recipe if meta and isinstance(recipe, DelayedScaling) else None
    return Given(linen, variables.get("params", {}), meta, variables.get(FP8_PROBE, {}), stated)


def child(given: Given, name: str, linen: nn.Module) -> Given:
    """The subtree of ``given`` for the child ``name`` (configured by ``linen``)."""

    def sub(tree: Mapping[str, Any]) -> Mapping[str, Any]:
        return tree.get(name, {}) if isinstance(tree, Mapping) else {}

    return Given(linen, sub(given.params), sub(given.fp8_meta), sub(given.fp8_probe),
                 given.recipe)  # fmt: skip


def as_param(value: Any) -> nnx.Param:
    """A Linen param (possibly boxed with logical axis names) as an ``nnx.Param`` with NNX's
    sharding metadata (``out_sharding``, and ``sharding_rules`` where the box has rules)."""
    if isinstance(value, nn.Partitioned):
        metadata: dict[str, Any] = {"out_sharding": tuple(value.names)}
        rules = getattr(value, "rules", None)
        if rules:
            metadata["sharding_rules"] = tuple(rules)
        if flax_meta.get_global_mesh() is None:
            # NNX shards annotated variables when they are made (eager sharding), which needs a
            # mesh; without one the names are kept as metadata only, as Linen keeps them.
            metadata["eager_sharding"] = False
        return nnx.Param(value.value, **metadata)
    return nnx.Param(value)


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

    def _adopt(self, given: Given, *, with_params: bool = True) -> None:
        """Keeps ``given``'s params and FP8 state as this layer's variables."""
        self._linen = given.linen
        self._recipe = given.recipe
        if with_params:
            for key, value in given.params.items():
                if isinstance(value, Mapping):
                    raise ValueError(f"{type(self).__name__}: unexpected param scope {key!r}")
                setattr(self, str(key), as_param(value))
        if given.fp8_meta:
            probes = dict(given.fp8_probe)
            if set(probes) != {"call_0"}:
                raise ValueError(
                    f"{type(self).__name__}: expected one probe 'call_0', got {sorted(probes)}"
                )
            self.fp8_meta = Fp8State(given.fp8_meta["amax_history"], given.fp8_meta["scale"])
            self.fp8_probe = Fp8Probes(probes["call_0"])

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
    def linen_module(self) -> nn.Module:
        """The Linen twin (``fp8jax.flax``) that configures this layer."""
        return self._linen

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
            given = jax.tree.map(jnp.shape, nn.unbox(tree))
            if have != given:
                raise ValueError(
                    f"{owner}: {name!r} has the structure/shapes {given}, this module has {have}"
                )
            assign(self, kind, jax.tree.map(jnp.asarray, nn.unbox(tree)))

    def _value(self, name: str) -> jax.Array | None:
        """The value of param ``name``, or None if the layer has none of that name."""
        var = getattr(self, name, None)
        return None if var is None else var.get_value()
