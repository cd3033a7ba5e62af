"""What one call of an NNX FP8 layer computes with: FP8 on or off, the recipe, the state, the
probe; and the per-call probe fork.

Observations of a layer called several times in one step are merged by max, never summed: each
call forks the layer's probe (:func:`_fork`: its value goes to the call, a copy back into the
variable), and the fork's backward takes the max of the two cotangents. The probe's gradient
is then the max over all calls, with no call numbering.

When the call is differentiated, the copy written back is the probe's value plus one (the
functional layers never read a probe's value): a use count. A call whose write-back is dropped
(the layer broadcast over ``nnx.scan``, where autodiff adds up the iterations' observations
instead) leaves the count at zero while its probe gets a gradient, which
:func:`fp8jax.nnx.update_fp8_variables` turns into a non-finite state rather than a silently
wrong one (no trace-time signal tells a broadcast apart).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fp8jax.autocast import get_recipe, is_fp8_enabled
from fp8jax.nnx.variables import Fp8Probes, Fp8State
from fp8jax.recipe import DelayedScaling, Recipe
from fp8jax.state import Fp8Meta

__all__ = ["Fp8Use", "calibrating", "fp8_use"]

_CALIBRATING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fp8jax_nnx_calibrating", default=False
)


@contextlib.contextmanager
def calibrating() -> Iterator[None]:
    """Within: every layer call stores its forward observations in its probe (max-merged)
    instead of forking it (used by :func:`fp8jax.nnx.calibrate` inside its own trace)."""
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
    """The Fp8MetaVariable variables are differentiated (TE's convention; not NNX's)."""
    return (
        f"{where}: differentiated with respect to its Fp8MetaVariable variables. Their gradient "
        "is not the next FP8 state in NNX (calls of a layer would add up): differentiate with "
        "argnums=fp8jax.nnx.diff_state() (params and probes) and fold the probe gradients in "
        "with fp8jax.nnx.update_fp8_variables or apply_gradients."
    )


class Fp8Use(NamedTuple):
    """What one call of an FP8 layer passes to the functional layer."""

    enabled: bool  # FP8 on for this call
    recipe: Recipe | None  # the autocast recipe (None outside autocast)
    meta: Fp8Meta | None  # DelayedScaling state; None otherwise
    probe: jax.Array | None  # this call's probe (its gradient is the observation), or None
    record: Callable[[jax.Array], None] | None  # calibration: stores forward observations


def check_recipe(where: str, stated: DelayedScaling | None, needs_state: bool = True) -> None:
    """ValueError if the autocast recipe is a DelayedScaling other than ``stated`` (the one
    the layer's state was made under), or if the layer has no state but needs one."""
    recipe = get_recipe()
    if not is_fp8_enabled() or not recipe.keeps_state:
        return
    if stated is None and needs_state:
        raise ValueError(
            f"{where}: called inside fp8jax.autocast with DelayedScaling, but the module has "
            "no FP8 state: construct it inside fp8jax.autocast(enabled=True, "
            "recipe=DelayedScaling(...)) (the constructor creates the state)"
        )
    if stated is not None and recipe != stated:
        raise ValueError(
            f"{where}: called under {recipe!r}, but its FP8 state was made under "
            f"{stated!r}; the recipe is stated once: call it under the recipe it was "
            "constructed with"
        )


def fp8_use(
    where: str,
    stated: DelayedScaling | None,
    state: Fp8State | None,
    probes: Fp8Probes | None,
) -> Fp8Use:
    """Reads the autocast state and, under DelayedScaling, the layer's state and forks its
    probe (or, inside :func:`calibrating`, sets up the recorder of the observations)."""
    check_recipe(where, stated)
    recipe, enabled = get_recipe(), is_fp8_enabled()
    delayed = enabled and recipe.keeps_state
    if state is None or probes is None:
        return Fp8Use(enabled, recipe, None, None, None)
    if not delayed:
        # FP8 off (or current scaling): the probe is not used; being differentiated would
        # record nothing, silently
        _refuse_gradient(probes.call_0.get_value(), _idle_probe_error(where))
        return Fp8Use(enabled, recipe, None, None, None)
    refusal = _state_gradient_error(where)
    meta = Fp8Meta(
        amax_history=_refuse_gradient(state.amax_history.get_value(), refusal),
        scale=_refuse_gradient(state.scale.get_value(), refusal),
    )
    var = probes.call_0
    if _CALIBRATING.get():
        n_roles = var.get_value().shape[-1]

        def record(seen: jax.Array) -> None:
            # max keeps NaN ("not observed": the output-grad roles), as the update expects
            seen = jnp.asarray(seen, jnp.float32).reshape(n_roles)
            var.set_value(jnp.maximum(var.get_value(), seen))

        return Fp8Use(True, recipe, meta, var.get_value(), record)
    used, passed_on = _fork(var.get_value())
    var.set_value(passed_on)
    return Fp8Use(True, recipe, meta, used, None)
