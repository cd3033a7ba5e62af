"""Calibration for inference: FP8 scales from a few forward passes, no gradients.

A model trained without FP8 (or restored without its ``fp8_meta``) starts with every scale at 1:
inputs above the format's maximum (448 for E4M3) saturate and small values lose precision. Before
serving it in FP8, :func:`calibrate` runs it forward over a few representative batches, records
what each FP8 call sees (the amax of its input and of its kernel), and folds that into
``fp8_meta`` exactly as a train step would, one batch per step. The output-gradient roles exist
only in training: they are left as they were.

How: the model is applied with its ``fp8_probe`` collection mutable; each FP8 call then stores its
forward observations in its probe (the output-gradient entry is NaN: "not observed", and a
non-finite observation is never recorded), and :func:`~fp8jax.flax.update_fp8_variables` merges
and folds them in, by max over calls, in one kernel launch per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from fp8jax.autocast import autocast
from fp8jax.flax._variables import FP8_META, FP8_PROBE
from fp8jax.flax.train import update_fp8_variables
from fp8jax.recipe import DelayedScaling, check_recipe

__all__ = ["calibrate"]


def calibrate(
    apply_fn: Callable[..., Any],
    variables: Mapping[str, Any],
    batches: Iterable[Any],
    *,
    recipe: DelayedScaling,
    **apply_kwargs: Any,
) -> Any:
    """The ``fp8_meta`` collection after one forward-only delayed-scaling step per batch.

    Args:
      apply_fn: the model's ``apply`` (``model.apply``).
      variables: ``params`` and the ``fp8_meta`` to start from (e.g. fresh from ``init`` under
        ``autocast``); ``fp8_probe`` is not needed.
      batches: an iterable of model inputs: each item is passed as ``apply_fn(variables,
        *item)`` when it is a tuple, else as ``apply_fn(variables, item)``.
      recipe: the :class:`~fp8jax.recipe.DelayedScaling` of the run. With
        ``amax_compute_algo="max"`` and ``amax_history_len`` >= the number of batches, the scale
        covers the largest value seen in any batch.
      **apply_kwargs: passed to every ``apply_fn`` call (e.g. ``deterministic=True``).

    Returns:
      The new ``fp8_meta``: forward roles (input, kernel) updated, output-grad roles unchanged.

    Example (inputs far above E4M3's 448: a fresh state saturates them, a calibrated one not):

    >>> import jax, jax.numpy as jnp, fp8jax
    >>> from fp8jax.flax import DenseGeneral, calibrate
    >>> recipe = fp8jax.DelayedScaling(amax_history_len=4)
    >>> model, x = DenseGeneral(features=2), jnp.full((4, 3), 700.0)
    >>> with fp8jax.autocast(enabled=True, recipe=recipe):
    ...     variables = model.init(jax.random.key(0), x)
    >>> meta = calibrate(model.apply, variables, [x], recipe=recipe)
    >>> float(meta["amax_history"][0, 0]), float(meta["scale"][0]) == 448.0 / 700.0
    (700.0, True)
    """
    check_recipe(recipe, "calibrate: recipe", keeps_state=True)
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise ValueError("calibrate: variables must hold 'params' (and 'fp8_meta')")
    if FP8_META not in variables:
        raise ValueError(
            f"calibrate: variables have no {FP8_META!r}; initialise the model inside "
            "fp8jax.autocast(enabled=True, recipe=recipe) to create it"
        )
    if "mutable" in apply_kwargs:
        raise ValueError("calibrate: mutable is set by calibrate itself (fp8_probe)")
    rest = {k: v for k, v in variables.items() if k not in (FP8_META, FP8_PROBE)}

    @jax.jit
    def step(fp8_meta: Any, batch: tuple[Any, ...]) -> Any:
        with autocast(enabled=True, recipe=recipe):
            _, seen = apply_fn(
                {**rest, FP8_META: fp8_meta}, *batch, mutable=[FP8_PROBE], **apply_kwargs
            )
        return update_fp8_variables(fp8_meta, seen.get(FP8_PROBE, {}), recipe)

    fp8_meta = variables[FP8_META]
    count = 0
    for batch in batches:
        fp8_meta = step(fp8_meta, batch if isinstance(batch, tuple) else (batch,))
        count += 1
    if count == 0:
        raise ValueError("calibrate: batches is empty; give at least one batch")
    return fp8_meta
