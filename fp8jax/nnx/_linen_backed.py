"""The base of fp8jax's NNX modules: a Linen twin's variables as NNX attributes.

Every NNX module of fp8jax is defined by its Linen twin in :mod:`fp8jax.flax` (one definition of
the math, the params and their init): the constructor runs the twin's ``init`` on a one-token
sample with ``rngs.params()`` and keeps the variables as :class:`flax.nnx.Param`,
:class:`~fp8jax.nnx.Fp8Meta` and :class:`~fp8jax.nnx.Fp8Probe` attributes (tree mirrored, see
:mod:`fp8jax.nnx.variables`); ``__call__`` runs the twin's ``apply`` on them. So the same key gives
the same params as the Linen module, and both train bit for bit alike.

Observations of a module called several times in one step are merged by max, never summed: each
call forks every probe (:func:`_fork`: its value goes to the call, a copy back into the
variable), and the fork's backward takes the max of the two cotangents. The first call's probe
gradient is then the max over all calls, and each call inside the Linen twin has its own probe.

When the call is differentiated, the copy written back is the probe's value plus one (the
twin never reads a probe's value): a use count. A call whose write-back is dropped (the module
broadcast over ``nnx.scan``, where autodiff adds up the iterations' observations instead)
leaves the count at zero while its probe gets a gradient, which
:func:`fp8jax.nnx.update_fp8_state` turns into a non-finite state rather than a silently wrong
one (no trace-time signal tells a broadcast apart).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta as flax_meta

from fp8jax.autocast import get_recipe, is_fp8_enabled
from fp8jax.nnx.variables import (
    FP8_META,
    FP8_PROBE,
    Fp8Meta,
    Fp8Probe,
    Node,
    assign,
    from_linen,
    is_meta_key,
    is_probe_key,
    pure,
    to_linen,
)
from fp8jax.recipe import DelayedScaling

__all__ = ["LinenBacked", "calibrating"]

_CALIBRATING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fp8jax_nnx_calibrating", default=False
)
_RESERVED = frozenset({"rngs", "deterministic", FP8_META, FP8_PROBE})
_ACTIVATION_AXES = ("output_axes", "layernorm_input_axes", "dot_input_axes")


@contextlib.contextmanager
def calibrating() -> Iterator[None]:
    """Within: every module call stores its forward observations in its probes (max-merged)
    instead of forking them (used by :func:`fp8jax.nnx.calibrate` inside its own trace)."""
    token = _CALIBRATING.set(True)
    try:
        yield
    finally:
        _CALIBRATING.reset(token)


@jax.custom_vjp
def _fork(probe: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(probe, probe)``: the value for this call and the copy written back. Differentiated
    (:func:`_fork_fwd`), the copy is ``probe + 1``: it counts the differentiated uses (see the
    module docstring), so evaluation changes nothing. The backward is the max of the two
    cotangents (amaxes are >= 0)."""
    return probe, probe


def _fork_fwd(probe: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
    return (probe, probe + 1.0), None


def _fork_bwd(_: None, cts: tuple[jax.Array, jax.Array]) -> tuple[jax.Array]:
    used, passed_on = cts
    return (jnp.maximum(used, passed_on),)


_fork.defvjp(_fork_fwd, _fork_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _refuse_gradient(value: jax.Array, message: str) -> jax.Array:
    """``value``; differentiating it is ``ValueError(message)`` at trace time."""
    return value


def _refuse_gradient_fwd(value: Any, message: str) -> tuple[jax.Array, None]:
    if value.perturbed:
        raise ValueError(message)
    return value.value, None


def _refuse_gradient_bwd(message: str, _: None, ct: jax.Array) -> tuple[jax.Array]:
    return (ct,)


_refuse_gradient.defvjp(_refuse_gradient_fwd, _refuse_gradient_bwd, symbolic_zeros=True)


def _idle_probe_error(where: str) -> str:
    """A probe that this call does not use (FP8 off) is differentiated."""
    return (
        f"{where}: differentiated with respect to its FP8 probes outside FP8 DelayedScaling, "
        "so this step would record no observation (the FP8 state would go stale). Call the "
        "model inside fp8jax.autocast(enabled=True, recipe=...) with the recipe it was "
        "constructed under; for a high-precision run, construct it outside autocast (no FP8 "
        "state) or differentiate the params only."
    )


def _state_gradient_error(where: str) -> str:
    """The Fp8Meta variables are differentiated (TE's convention, which NNX does not offer)."""
    return (
        f"{where}: differentiated with respect to its Fp8Meta variables. Their gradient is not "
        "the next FP8 state in NNX (each call is its own apply, so calls would add up): "
        "differentiate with argnums=fp8jax.nnx.diff_state() (params and probes) and fold the "
        "probe gradients in with fp8jax.nnx.update_fp8_state or apply_gradients."
    )


def _param(value: Any) -> nnx.Param:
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


def _child(node: nnx.Module, key: str, where: str) -> nnx.Module:
    if key in _RESERVED:
        raise ValueError(f"{where}: the Linen scope name {key!r} is reserved in fp8jax.nnx")
    if not hasattr(node, key):
        setattr(node, key, Node())
    child = getattr(node, key)
    if not isinstance(child, nnx.Module):
        raise ValueError(f"{where}: {key!r} is both a variable and a scope")
    return child


def _set_params(node: nnx.Module, tree: Mapping[str, Any], where: str) -> None:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            _set_params(_child(node, str(key), where), value, where)
        else:
            if key in _RESERVED:
                raise ValueError(f"{where}: the param name {key!r} is reserved in fp8jax.nnx")
            setattr(node, str(key), _param(value))


def _set_fp8(node: nnx.Module, tree: Mapping[str, Any], kind: type, where: str) -> None:
    level = FP8_META if kind is Fp8Meta else FP8_PROBE
    for key, value in tree.items():
        if isinstance(value, Mapping) and key != level:
            _set_fp8(_child(node, str(key), where), value, kind, where)
        elif key == level:
            holder = Node()
            for name, leaf in value.items():
                setattr(holder, str(name), kind(jnp.asarray(leaf)))
            setattr(node, level, holder)


class LinenBacked(nnx.Module):
    """Base class: see the module docstring. Subclasses call :meth:`_build` in ``__init__`` and
    :meth:`_apply` in ``__call__``."""

    #: Whether the module runs an FP8 GEMM (and so needs FP8 state under DelayedScaling).
    _HAS_GEMM: ClassVar[bool] = True

    def _build(
        self,
        linen: nn.Module,
        sample: tuple[Any, ...],
        *,
        rngs: nnx.Rngs,
        init_kwargs: Mapping[str, Any] | None = None,
        dropout_rng_name: str | None = None,
        deterministic: bool = False,
    ) -> None:
        owner = type(self).__name__
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"{owner}: rngs must be a flax.nnx.Rngs, got {type(rngs).__name__}")
        if not isinstance(deterministic, bool):
            raise TypeError(f"{owner}: deterministic must be a bool, got {deterministic!r}")
        self._linen = linen
        self._dropout_rng_name = dropout_rng_name
        # The params key first (as Linen's init(key) uses it), then the dropout stream. The
        # activation constraints do not touch the params: init runs without them (the sample
        # is one token, of fixed rank) and without axis rules (no mesh needs to divide it).
        quiet = {f: () for f in _ACTIVATION_AXES if getattr(linen, f, ())}
        with nn.logical_axis_rules(()):
            variables = linen.clone(**quiet).init(
                {"params": rngs.params()}, *sample, **dict(init_kwargs or {})
            )
        if dropout_rng_name is not None:  # a module with dropout: nnx's eval()/train() flag
            self.deterministic = deterministic
            self.rngs = rngs[dropout_rng_name].fork()
        extra = sorted(set(variables) - {"params", FP8_META, FP8_PROBE})
        if extra:
            raise ValueError(f"{owner}: unexpected Linen collections {extra}")
        _set_params(self, variables.get("params", {}), owner)
        _set_fp8(self, from_linen(variables.get(FP8_META, {}), FP8_META, is_meta_key), Fp8Meta,
                 owner)  # fmt: skip
        _set_fp8(self, from_linen(variables.get(FP8_PROBE, {}), FP8_PROBE, is_probe_key),
                 Fp8Probe, owner)  # fmt: skip
        recipe = get_recipe() if is_fp8_enabled() else None
        has_state = bool(variables.get(FP8_META))
        self._recipe = recipe if has_state and isinstance(recipe, DelayedScaling) else None

    @property
    def linen_module(self) -> nn.Module:
        """The Linen twin (``fp8jax.flax``) that defines this module."""
        return self._linen

    @property
    def recipe(self) -> DelayedScaling | None:
        """The DelayedScaling this module's FP8 state was made under (None: no state)."""
        return self._recipe

    def linen_variables(self) -> dict[str, Any]:
        """The variables of the Linen twin: ``params``, ``fp8_meta`` and ``fp8_probe`` (the
        last two only with FP8 state), e.g. to save a Linen checkpoint."""
        out = {"params": pure(self, nnx.Param)}
        meta = to_linen(pure(self, Fp8Meta), FP8_META)
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
            targets.append((FP8_META, Fp8Meta, meta))
        for name, kind, tree in targets:
            have = jax.tree.map(jnp.shape, pure(self, kind))
            given = jax.tree.map(jnp.shape, nn.unbox(tree))
            if have != given:
                raise ValueError(
                    f"{owner}: {name!r} has the structure/shapes {given}, this module has {have}"
                )
            assign(self, kind, jax.tree.map(jnp.asarray, nn.unbox(tree)))

    def _check_recipe(self) -> None:
        recipe = get_recipe()
        if not is_fp8_enabled() or not isinstance(recipe, DelayedScaling):
            return
        owner = type(self).__name__
        if self._recipe is None and self._HAS_GEMM:
            raise ValueError(
                f"{owner}: called inside fp8jax.autocast with DelayedScaling, but the module has "
                "no FP8 state: construct it inside fp8jax.autocast(enabled=True, "
                "recipe=DelayedScaling(...)) (the constructor creates the state)"
            )
        if self._recipe is not None and recipe != self._recipe:
            raise ValueError(
                f"{owner}: called under {recipe!r}, but its FP8 state was made under "
                f"{self._recipe!r}; the recipe is stated once: call it under the recipe it "
                "was constructed with"
            )

    def _apply(
        self,
        *args: Any,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
        **kwargs: Any,
    ) -> Any:
        """Runs the Linen twin on this module's variables (see the module docstring)."""
        self._check_recipe()
        params = pure(self, nnx.Param)
        variables: dict[str, Any] = {"params": params}
        meta = to_linen(pure(self, Fp8Meta), FP8_META)
        calibrate = _CALIBRATING.get()
        delayed = is_fp8_enabled() and isinstance(get_recipe(), DelayedScaling)
        if meta and not delayed:
            # FP8 off (or current scaling): the probes are not used; being differentiated
            # would record nothing, silently
            for leaf in jax.tree.leaves(pure(self, Fp8Probe)):
                _refuse_gradient(leaf, _idle_probe_error(type(self).__name__))
            meta = {}
        for leaf in jax.tree.leaves(meta):
            _refuse_gradient(leaf, _state_gradient_error(type(self).__name__))
        if meta:
            variables[FP8_META] = meta
        if meta and not calibrate:  # calibration: each call records into a fresh probe
            leaves, tree = jax.tree.flatten(pure(self, Fp8Probe))
            forks = [_fork(leaf) for leaf in leaves]
            assign(self, Fp8Probe, jax.tree.unflatten(tree, [f[1] for f in forks]))
            variables[FP8_PROBE] = to_linen(jax.tree.unflatten(tree, [f[0] for f in forks]),
                                            FP8_PROBE)  # fmt: skip
        linen_rngs = self._dropout_rngs(deterministic, rngs)
        if self._dropout_rng_name is not None:
            kwargs["deterministic"] = self._deterministic(deterministic)
        if not (calibrate and meta):
            return self._linen.apply(variables, *args, rngs=linen_rngs, **kwargs)
        out, seen = self._linen.apply(
            variables, *args, rngs=linen_rngs, mutable=[FP8_PROBE], **kwargs
        )
        seen = from_linen(seen.get(FP8_PROBE, {}), FP8_PROBE, is_probe_key)
        # max keeps NaN ("not observed": the output-grad roles), as the update expects
        assign(self, Fp8Probe, jax.tree.map(jnp.maximum, pure(self, Fp8Probe), seen))
        return out

    def _deterministic(self, deterministic: bool | None) -> bool:
        value = getattr(self, "deterministic", True) if deterministic is None else deterministic
        if not isinstance(value, bool):
            raise TypeError(
                f"{type(self).__name__}: deterministic must be a bool or None, got {value!r}"
            )
        return value

    def _dropout_rngs(self, deterministic: bool | None, rngs: Any) -> dict[str, jax.Array]:
        name = self._dropout_rng_name
        if name is None or self._deterministic(deterministic):
            return {}
        source = rngs if rngs is not None else getattr(self, "rngs", None)
        if isinstance(source, nnx.Rngs):
            key = source[name]()
        elif isinstance(source, nnx.RngStream):
            key = source()
        elif isinstance(source, jax.Array):
            key = source
        else:
            raise ValueError(
                f"{type(self).__name__}: deterministic is False (dropout on) but there is no "
                f"RNG: construct with rngs=nnx.Rngs(...) or pass rngs=, or call with "
                "deterministic=True (model.eval())"
            )
        return {name: key}
