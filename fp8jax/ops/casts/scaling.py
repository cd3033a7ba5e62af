"""The delayed-scaling state update: ``update_fp8_state`` and its batched form.

Exactly the order of docs/numerics.md, per tensor, after the step that observed ``amax``:

0. a non-finite ``amax`` (NaN, +inf, -inf) is not recorded: that tensor's history and scale stay
   exactly as they were (the history is not even shifted), so one bad step leaves no trace. This
   differs on purpose from TransformerEngine, which records it (a NaN in a 1024-long history
   would keep the old scale for 1024 steps under ``"max"``);
1. the rolling history takes ``amax`` in its newest slot, index 0; the oldest value (the last
   index) falls off;
2. the history is reduced: ``"max"`` over all of it (NaN-propagating), ``"most_recent"`` = index
   0, or the recipe's callable;
3. ``scale = (fp8_max / amax_reduced) * 2**-margin`` in float32; if ``amax_reduced`` is 0, inf
   or NaN (or subnormal: XLA:CPU flushes subnormals, so this keeps platforms equal) the old
   scale is kept; a scale that overflows to inf is clamped to float32's max
   (TransformerEngine does the same). A recipe's ``scaling_factor_compute_algo`` replaces this
   step entirely: ``scale = fn(amax_reduced, old_scale, fp8_max, recipe)``.

The string algorithms run in one FFI kernel launch for any number of tensors
(:func:`update_fp8_states`), or, with ``fp8jax.ops.implementation(scaling="xla")``, as XLA's
compilation of :func:`update_fp8_states_reference`; a callable in the recipe always runs as jnp
(it is user Python).

Sharding: the states are independent rows, so under :func:`jax.jit` on a mesh the kernel runs on
each device's rows (the ``n`` dimension may be split, or replicated); the history dimension is
never split (an operand split along it is gathered first). No collective is added.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.ops.base import checks, opdef, switch
from fp8jax.recipe import DelayedScaling, check_recipe

__all__ = ["update_fp8_state", "update_fp8_states", "update_fp8_states_reference"]

_ALGO_CODES = {"max": 0, "most_recent": 1}
_F32_MAX = np.float32(np.finfo(np.float32).max)
_F32_TINY = np.float32(np.finfo(np.float32).smallest_normal)


def _margin_factor(margin: int) -> np.float32:
    return np.float32(2.0**-margin)


def _nan_max(h: jax.Array) -> jax.Array:
    """Row-wise max that propagates NaN (XLA:CPU's max-reduction does not reliably)."""
    nan = jnp.isnan(h)
    m = jnp.max(jnp.where(nan, -jnp.inf, h), axis=1)
    return jnp.where(jnp.any(nan, axis=1), jnp.float32(jnp.nan), m)


def update_fp8_states_reference(
    amax_histories: jax.Array,
    scales: jax.Array,
    amaxes: jax.Array,
    fp8_maxes: jax.Array,
    recipe: DelayedScaling,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp reference of the update for ``n`` states: histories ``[n, L]``, others ``[n]``.

    Rows whose ``amaxes`` entry is NaN or +-inf are returned unchanged (history and scale).
    """
    new_hist, new_scales = _update_all_rows(amax_histories, scales, amaxes, fp8_maxes, recipe)
    recorded = jnp.isfinite(amaxes)
    new_hist = jnp.where(recorded[:, None], new_hist, amax_histories)
    return new_hist, jnp.where(recorded, new_scales, scales)


def _update_all_rows(
    amax_histories: jax.Array,
    scales: jax.Array,
    amaxes: jax.Array,
    fp8_maxes: jax.Array,
    recipe: DelayedScaling,
) -> tuple[jax.Array, jax.Array]:
    """Steps 1 to 3 for every row, as if every observation were recorded."""
    new_hist = jnp.concatenate([amaxes[:, None], amax_histories[:, :-1]], axis=1)
    algo = recipe.amax_compute_algo
    if algo == "max":
        red = _nan_max(new_hist)
    elif algo == "most_recent":
        red = new_hist[:, 0]
    else:
        red = jax.vmap(lambda h: jnp.reshape(jnp.asarray(algo(h), jnp.float32), ()))(new_hist)
    if recipe.scaling_factor_compute_algo is not None:
        fn = recipe.scaling_factor_compute_algo
        new_scales = jax.vmap(
            lambda a, s, m: jnp.reshape(jnp.asarray(fn(a, s, m, recipe), jnp.float32), ())
        )(red, scales, fp8_maxes)
        return new_hist, new_scales
    s = (fp8_maxes / red) * _margin_factor(recipe.margin)
    s = jnp.where(s > _F32_MAX, _F32_MAX, s)
    usable = (red >= _F32_TINY) & (red <= _F32_MAX)
    return new_hist, jnp.where(usable, s, scales)


def _kernel_attrs(*, recipe: DelayedScaling) -> dict[str, np.int64]:
    return {
        "margin": np.int64(recipe.margin),
        "algo": np.int64(_ALGO_CODES[recipe.amax_compute_algo]),
    }


# The op definition (fp8jax.ops.base.opdef) for the string algorithms. Operands: histories [n, L],
# scales, amaxes, fp8_maxes [n]. The rows are independent: each device updates its own, and the
# history dim ``l`` is never split. No collective.
_UPDATE = opdef.OpDef(
    name="update_fp8_states",
    family="scaling",
    target="fp8jax_update_fp8_state",
    reference=update_fp8_states_reference,
    outputs=lambda hist, scales, amaxes, fp8_maxes, *, recipe: (
        opdef.like(hist, jnp.float32),
        opdef.like(scales, jnp.float32),
    ),
    factors=lambda *ndims: (["n l", "n", "n", "n"], ["n l", "n"]),
    attrs=_kernel_attrs,
    need_replication=("l",),
)


def _rule(n_batch: int) -> str:
    """The Shardy rule, e.g. ``"n l, n, n, n -> n l, n"``."""
    return _UPDATE.rule(n_batch, n_batch + 2, n_batch + 1, n_batch + 1, n_batch + 1)


def _uses_kernel(recipe: DelayedScaling) -> bool:
    # the built-in algos are named (str); a custom one is a callable
    return not callable(recipe.amax_compute_algo) and recipe.scaling_factor_compute_algo is None


def _fp8_maxes(op: str, recipe: DelayedScaling, backward: Any, n: int) -> jax.Array:
    flags = np.asarray(backward)
    if flags.dtype != np.bool_ or flags.shape not in ((), (n,)):
        raise TypeError(
            f"{op}: backward must be a bool or a sequence of {n} bools, got {backward!r}"
        )
    flags = np.broadcast_to(flags, (n,))
    return jnp.asarray(
        np.where(flags, recipe.fp8_max(backward=True), recipe.fp8_max(backward=False)),
        jnp.float32,
    )


def update_fp8_states(
    amax_histories: jax.Array,
    scales: jax.Array,
    amaxes: jax.Array,
    recipe: DelayedScaling,
    *,
    backward: bool | Sequence[bool] = False,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Updates ``n`` delayed-scaling states in one kernel launch.

    Args:
      amax_histories: float32 ``[n, amax_history_len]``, newest at index 0.
      scales: float32 ``[n]`` or ``[n, 1]``.
      amaxes: float32 of the same shape as ``scales``: each tensor's amax of this step.
      recipe: a :class:`~fp8jax.recipe.DelayedScaling`.
      backward: per state (or for all), whether it is a backward tensor (gradient), which picks
        the recipe's backward FP8 format for ``fp8_max`` (E5M2 under HYBRID).
      implementation: ``"kernel"`` or ``"xla"`` (:func:`update_fp8_states_reference` compiled
        by XLA); default: the enclosing :func:`fp8jax.ops.implementation` choice for
        ``"scaling"``. A recipe with a callable always runs the reference.

    Returns:
      ``(new_histories, new_scales)`` of the input shapes; bit-identical to calling
      :func:`update_fp8_state` on each state. A state whose ``amaxes`` entry is NaN or +-inf is
      returned unchanged (not recorded; see the module docstring).
    """
    op = "update_fp8_states"
    recipe = check_recipe(recipe, f"{op}: recipe", keeps_state=True)
    hist = checks.array_arg(op, "amax_histories", amax_histories)
    scales = checks.array_arg(op, "scales", scales)
    amaxes = checks.array_arg(op, "amaxes", amaxes)
    for name, v in (("amax_histories", hist), ("scales", scales), ("amaxes", amaxes)):
        if v.dtype != jnp.float32:
            raise TypeError(f"{op}: {name} must be float32, got dtype {v.dtype}")
    if hist.ndim != 2 or hist.shape[1] != recipe.amax_history_len:
        raise ValueError(
            f"{op}: amax_histories must have shape [n, {recipe.amax_history_len}] "
            f"(recipe.amax_history_len), got {hist.shape}"
        )
    n = hist.shape[0]
    if scales.shape not in ((n,), (n, 1)):
        raise ValueError(f"{op}: scales must have shape ({n},) or ({n}, 1), got {scales.shape}")
    if amaxes.shape != scales.shape:
        raise ValueError(
            f"{op}: amaxes must have the shape of scales {scales.shape}, got {amaxes.shape}"
        )
    fp8_maxes = _fp8_maxes(op, recipe, backward, n)
    impl = switch.choose(op, _UPDATE.family, implementation)
    flat_scales = jnp.reshape(scales, (n,))
    flat_amaxes = jnp.reshape(amaxes, (n,))
    if not _uses_kernel(recipe):
        new_hist, new_scales = update_fp8_states_reference(
            hist, flat_scales, flat_amaxes, fp8_maxes, recipe
        )
        return new_hist, jnp.reshape(new_scales, scales.shape)
    new_hist, new_scales = _UPDATE(
        hist, flat_scales, flat_amaxes, fp8_maxes, recipe=recipe, implementation=impl
    )
    return new_hist, jnp.reshape(new_scales, scales.shape)


def update_fp8_state(
    amax_history: jax.Array,
    scale: jax.Array,
    amax: jax.Array,
    recipe: DelayedScaling,
    *,
    backward: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Updates one tensor's delayed-scaling state; returns ``(new_amax_history, new_scale)``.

    Args:
      amax_history: float32 ``[recipe.amax_history_len]``, newest at index 0.
      scale: float32, shape ``()`` or ``(1,)``: the scale this step quantized with.
      amax: float32, shape ``()`` or ``(1,)``: this step's amax of the tensor.
      recipe: a :class:`~fp8jax.recipe.DelayedScaling`.
      backward: whether the tensor is a gradient (uses the recipe's backward format's max).
      implementation: ``"kernel"`` or ``"xla"``, as for :func:`update_fp8_states`.

    A NaN or +-inf ``amax`` is not recorded: ``amax_history`` and ``scale`` come back unchanged.

    >>> import jax.numpy as jnp, fp8jax
    >>> r = fp8jax.DelayedScaling(amax_history_len=3)
    >>> h, s = fp8jax.ops.update_fp8_state(jnp.zeros(3), jnp.float32(1), jnp.float32(2), r)
    >>> h.tolist(), float(s)
    ([2.0, 0.0, 0.0], 224.0)
    """
    op = "update_fp8_state"
    recipe = check_recipe(recipe, f"{op}: recipe", keeps_state=True)
    hist = checks.array_arg(op, "amax_history", amax_history)
    if hist.dtype != jnp.float32:
        raise TypeError(f"{op}: amax_history must be float32, got dtype {hist.dtype}")
    if hist.shape != (recipe.amax_history_len,):
        raise ValueError(
            f"{op}: amax_history must have shape ({recipe.amax_history_len},) "
            f"(recipe.amax_history_len), got {hist.shape}"
        )
    scale = checks.scalar_f32(op, "scale", scale)
    amax = checks.scalar_f32(op, "amax", amax)
    if not isinstance(backward, (bool, np.bool_)):
        raise TypeError(f"{op}: backward must be a bool, got {backward!r}")
    impl = switch.choose(op, _UPDATE.family, implementation)
    new_hist, new_scale = update_fp8_states(
        hist[None, :],
        jnp.reshape(scale, (1,)),
        jnp.reshape(amax, (1,)),
        recipe,
        backward=bool(backward),
        implementation=impl,
    )
    return new_hist[0], jnp.reshape(new_scale, scale.shape)
