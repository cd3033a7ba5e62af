"""The FP8 train step in NNX idiom: ``nnx.jit``, ``nnx.value_and_grad`` with a ``DiffState``.

The loss is differentiated with respect to the params *and* the :class:`~fp8jax.nnx.Fp8Probe`
variables (:func:`diff_state`); the probe gradients are what each FP8 call observed.
:func:`update_fp8_variables` folds them into the model's
:class:`~fp8jax.nnx.Fp8MetaVariable` variables (max over calls, never the sum; one kernel
launch for the whole model) and returns the gradients the optimizer should see::

    import jax.numpy as jnp, optax, fp8jax
    from flax import nnx

    recipe = fp8jax.DelayedScaling(amax_history_len=16)
    with fp8jax.autocast(enabled=True, recipe=recipe):      # creates the FP8 state
        model = fp8jax.nnx.DenseGeneral(768, 768, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        with fp8jax.autocast(enabled=True, recipe=recipe):
            loss, grads = nnx.value_and_grad(loss_fn, argnums=fp8jax.nnx.diff_state())(model)
        optimizer.update(model, fp8jax.nnx.update_fp8_variables(model, grads))
        return loss

Stacked layers made by ``nnx.vmap`` and applied by ``nnx.scan`` keep one state row per layer.
One module applied at every step of an ``nnx.scan`` (its state broadcast, ``in_axes=None``)
must carry its probes: ``nnx.StateAxes({Fp8Probe: nnx.Carry, ...: None})``; broadcast probes
would have the steps' observations summed by autodiff (each call hands the next its probe).

:func:`apply_gradients` does the last line, optionally skipping a non-finite step entirely;
:func:`accumulate_gradients` runs micro-batches (param gradients averaged, observations
max-merged); :func:`calibrate` sets the scales for inference from forward passes only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax._train_math import all_finite, micro_batch_count
from fp8jax._train_math import update_fp8_variables as _update_tree
from fp8jax.autocast import autocast
from fp8jax.nnx._base import Fp8Module
from fp8jax.nnx._probe import calibrating
from fp8jax.nnx.variables import (
    FP8_META,
    FP8_PROBE,
    Fp8MetaVariable,
    Fp8Probe,
    assign,
    pure,
    to_linen,
    write_back,
)
from fp8jax.recipe import DelayedScaling

__all__ = [
    "accumulate_gradients",
    "apply_gradients",
    "calibrate",
    "diff_state",
    "model_recipe",
    "update_fp8_variables",
]


def diff_state(argnum: int = 0, params: Any = nnx.Param) -> nnx.DiffState:
    """``nnx.DiffState(argnum, nnx.Any(params, Fp8Probe))``: what ``nnx.value_and_grad`` (or
    ``nnx.grad``) differentiates in an FP8 train step: the params and the probes."""
    return nnx.DiffState(argnum, nnx.Any(params, Fp8Probe))


def model_recipe(model: Any) -> DelayedScaling | None:
    """The DelayedScaling the FP8 state of ``model`` was made under (None: no FP8 state);
    ValueError if its modules were made under different recipes."""
    recipes = {
        node.recipe
        for _, node in nnx.iter_graph(model)
        if isinstance(node, Fp8Module) and node.recipe is not None
    }
    if len(recipes) > 1:
        raise ValueError(
            f"the FP8 modules of the model were constructed under different recipes "
            f"{sorted(map(repr, recipes))}; construct the whole model under one"
        )
    return next(iter(recipes), None)


def _fold(model: Any, observed: Any, owner: str, check_uses: bool = False) -> None:
    """Updates every Fp8MetaVariable of ``model`` from ``observed`` (a pure dict of probe values or
    gradients, NNX-shaped) in one launch. With ``check_uses`` (``observed`` are gradients), a
    module whose probe was observed but never used visibly (its use counts, the probe values,
    still zero: broadcast over ``nnx.scan``, so the observation is a sum) gets a NaN scale, and
    every probe is reset to zero."""
    current = pure(model, Fp8MetaVariable)
    meta = to_linen(current, FP8_META)
    if not meta:
        return
    recipe = model_recipe(model)
    probes = to_linen(observed, FP8_PROBE)
    if not probes:
        raise ValueError(
            f"{owner}: the model has FP8 state but the gradients have no Fp8Probe entries; "
            "differentiate with argnums=fp8jax.nnx.diff_state() (params and probes)"
        )
    new = _update_tree(meta, probes, recipe)
    if check_uses:
        counts = pure(model, Fp8Probe)
        summed = to_linen(_summed(observed, counts), FP8_PROBE)
        new = _poisoned(new, summed)
        assign(model, Fp8Probe, jax.tree.map(jnp.zeros_like, counts))
    assign(model, Fp8MetaVariable, write_back(current, new, FP8_META))


def _summed(observed: Any, counts: Any) -> Any:
    """Per probe: whether it has an observation although no use of it was counted."""
    return jax.tree.map(
        lambda g, n: jnp.any((jnp.asarray(g) > 0) & (jnp.asarray(n) == 0)), observed, counts
    )


def _poisoned(meta: Any, summed: Any) -> Any:
    """``meta`` with a NaN scale in every module one of whose probes was ``summed``."""
    if not isinstance(meta, dict):
        return meta
    out = {k: _poisoned(v, summed.get(k, {}) if isinstance(summed, dict) else {})
           for k, v in meta.items()}  # fmt: skip
    if "scale" in meta and isinstance(summed, dict):
        flags = [v for k, v in summed.items() if not isinstance(v, dict)]
        if flags:
            bad = jnp.any(jnp.stack(flags))
            out["scale"] = jnp.where(bad, jnp.float32(jnp.nan), meta["scale"])
    return out


def update_fp8_variables(model: Any, grads: nnx.State) -> nnx.State:
    """Folds this step's observations into the FP8 state of ``model``; returns the rest of
    ``grads``.

    Args:
      model: the model that was differentiated (its :class:`Fp8MetaVariable` variables are
        updated in place, as NNX updates state: under ``nnx.jit`` functionally).
      grads: what ``nnx.value_and_grad(..., argnums=diff_state())`` returned for ``model``.

    Returns:
      ``grads`` without the :class:`Fp8Probe` entries: pass it to ``optimizer.update``.

    Per module, the observations of all its calls are merged by max (stacked layers of
    ``nnx.vmap``/``nnx.scan`` keep one row per layer), and all rows of the whole model are
    updated by one :func:`fp8jax.ops.update_fp8_states` launch with the recipe the model was
    constructed under. The probes (use counts) are reset to zero.

    A module applied at every step of an ``nnx.scan`` with its probes broadcast (``in_axes=
    None`` for the whole module) would have its steps' observations *summed* by autodiff; no
    trace-time signal tells that apart, so such a module (observed, but no use counted) gets a
    NaN scale here: the next loss is non-finite instead of the scales silently too small. Carry
    the probes: ``in_axes=(nnx.Carry, nnx.StateAxes({Fp8Probe: nnx.Carry, ...: None}))``.
    """
    if not isinstance(grads, nnx.State):
        raise TypeError(
            f"update_fp8_variables: grads must be the nnx.State that nnx.grad returned, got "
            f"{type(grads).__name__}"
        )
    probes = nnx.filter_state(grads, Fp8Probe)
    _fold(model, nnx.to_pure_dict(probes), "update_fp8_variables", check_uses=True)
    return nnx.filter_state(grads, nnx.Not(Fp8Probe))


def apply_gradients(
    model: Any, optimizer: nnx.Optimizer, grads: nnx.State, *, skip_if_nonfinite: bool = False
) -> None:
    """:func:`update_fp8_variables`, then ``optimizer.update(model, param_grads)``.

    With ``skip_if_nonfinite=True``, a step whose gradients (params or observations) hold a NaN
    or inf changes nothing: params, optimizer state and step, and FP8 state stay as they were
    (traced, no host sync). Use it instead of ``optax.apply_if_finite``, which would skip the
    params but not the FP8 state.
    """
    if not isinstance(skip_if_nonfinite, bool):
        raise TypeError(
            f"apply_gradients: skip_if_nonfinite must be a bool, got {skip_if_nonfinite!r}"
        )
    kept = nnx.Any(nnx.Param, Fp8MetaVariable)
    if skip_if_nonfinite:
        old_model, old_opt = pure(model, kept), pure(optimizer)
    param_grads = update_fp8_variables(model, grads)
    optimizer.update(model, param_grads)
    if not skip_if_nonfinite:
        return
    ok = all_finite(grads)
    for obj, old, which in ((model, old_model, kept), (optimizer, old_opt, ...)):
        new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), pure(obj, which), old)
        assign(obj, which, new)


def accumulate_gradients(
    grad_fn: Callable[[Any, Any], tuple[jax.Array, nnx.State]],
    model: Any,
    micro_batches: Any,
    *,
    reduce: str = "mean",
) -> tuple[jax.Array, nnx.State]:
    """Gradient accumulation over micro-batches that merges FP8 observations by max.

    Runs ``grad_fn(model, micro_batch)`` (``(loss, grads)``, as ``nnx.value_and_grad(loss_fn,
    argnums=diff_state())`` returns for ``loss_fn(model, batch)``) for each micro-batch along
    the leading axis of ``micro_batches`` (a ``lax.scan`` after the first), carrying the model's
    other state (e.g. dropout RNG counts). Losses and param gradients are averaged
    (``reduce="mean"``) or summed (``"sum"``); the probe gradients are max-merged: summing them
    would add the amaxes.
    """
    n = micro_batch_count(micro_batches, reduce)

    def merge(acc: nnx.State, new: nnx.State) -> nnx.State:
        probes = jax.tree.map(
            jnp.maximum, nnx.filter_state(acc, Fp8Probe), nnx.filter_state(new, Fp8Probe)
        )
        rest = jax.tree.map(
            jnp.add, nnx.filter_state(acc, nnx.Not(Fp8Probe)),
            nnx.filter_state(new, nnx.Not(Fp8Probe)),
        )  # fmt: skip
        return nnx.merge_state(rest, probes)

    loss, grads = grad_fn(model, jax.tree.map(lambda x: x[0], micro_batches))
    if n > 1:
        graphdef, state = nnx.split(model)

        def body(carry, batch):
            state, loss_acc, grads_acc = carry
            m = nnx.merge(graphdef, state)
            loss, grads = grad_fn(m, batch)
            return (nnx.state(m), loss_acc + loss, merge(grads_acc, grads)), None

        rest = jax.tree.map(lambda x: x[1:], micro_batches)
        (state, loss, grads), _ = jax.lax.scan(body, (state, loss, grads), rest)
        nnx.update(model, state)
    if reduce == "mean":
        loss = loss / n
        params = jax.tree.map(lambda g: g / n, nnx.filter_state(grads, nnx.Not(Fp8Probe)))
        grads = nnx.merge_state(params, nnx.filter_state(grads, Fp8Probe))
    return loss, grads


def calibrate(model: Any, batches: Iterable[Any], **call_kwargs: Any) -> None:
    """Sets the FP8 scales of ``model`` for inference from forward passes only.

    One delayed-scaling step per batch, as a train step would make, from the forward
    observations (input and kernel amaxes); the output-gradient rows are left as they were.
    Each batch is passed as ``model(*batch, **call_kwargs)`` when it is a tuple, else
    ``model(batch, **call_kwargs)``, under the recipe the model was constructed with. Dropout
    stays as the model is set: call ``model.eval()`` first (or pass ``deterministic=True``).

    >>> import jax.numpy as jnp, fp8jax
    >>> from flax import nnx
    >>> recipe = fp8jax.DelayedScaling(amax_history_len=4)
    >>> with fp8jax.autocast(enabled=True, recipe=recipe):
    ...     layer = fp8jax.nnx.DenseGeneral(3, 2, rngs=nnx.Rngs(0))
    >>> fp8jax.nnx.calibrate(layer, [jnp.full((4, 3), 700.0)])
    >>> float(layer.fp8_meta.amax_history[0, 0]), round(float(layer.fp8_meta.scale[0]), 6)
    (700.0, 0.64)
    """
    recipe = model_recipe(model)
    if recipe is None:
        raise ValueError(
            "calibrate: the model has no FP8 state; construct it inside "
            "fp8jax.autocast(enabled=True, recipe=DelayedScaling(...))"
        )

    @nnx.jit
    def step(model: Any, batch: tuple[Any, ...]) -> None:
        with autocast(enabled=True, recipe=recipe), calibrating():
            model(*batch, **call_kwargs)
        probes = pure(model, Fp8Probe)
        _fold(model, probes, "calibrate")
        assign(model, Fp8Probe, jax.tree.map(jnp.zeros_like, probes))

    count = 0
    for batch in batches:
        step(model, batch if isinstance(batch, tuple) else (batch,))
        count += 1
    if count == 0:
        raise ValueError("calibrate: batches is empty; give at least one batch")
