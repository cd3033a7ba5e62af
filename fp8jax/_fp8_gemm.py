"""The pieces every FP8 layer is built from: resolving FP8 on/off and the recipe, the cast of a
tensor for a GEMM, and one FP8 GEMM's forward and backward on already-cast operands.

A layer with ``G`` GEMMs has ``3 G`` tensor roles (:func:`fp8jax.state.gemm_roles`); each GEMM's
forward here takes its input already in FP8 (from a fused norm or activation kernel, or from
``cast_transpose``), casts its kernel, and keeps, as ``uint8`` codes with the checkpoint names of
:data:`fp8jax.dense.CHECKPOINT_NAMES`, exactly what its two backward GEMMs read.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from fp8jax.autocast import _current_state
from fp8jax.dense import CHECKPOINT_NAMES, _current_scale
from fp8jax.ops._implementation import get_implementation
from fp8jax.ops.cast_transpose import cast_transpose, cast_transpose_dbias
from fp8jax.ops.gemm import gemm_codes
from fp8jax.recipe import DelayedScaling, Float8CurrentScaling, Format, Recipe
from fp8jax.state import Fp8Meta

WIDE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class Fp8Setup(NamedTuple):
    """Static FP8 settings of one layer call (hashable: part of a custom_vjp's config)."""

    fwd_dtype: Any
    bwd_dtype: Any
    current_scaling: bool
    margin: int
    # fp8jax.ops.implementation per family, read when the layer is called, so that a backward
    # traced later runs the same ones.
    impl: tuple[tuple[str, str], ...]
    where: str

    def implementation(self, family: str) -> str:
        return dict(self.impl)[family]


def resolve(
    where: str,
    recipe: Recipe | None,
    enabled: bool | None,
    fp8_meta: Fp8Meta | None,
    probe: jax.Array | None,
    n_roles: int,
    families: tuple[str, ...],
) -> tuple[Fp8Setup | None, jax.Array | None, jax.Array | None]:
    """FP8 on or off, with which recipe, scales and probe, as :func:`fp8jax.dense` decides:
    an explicit ``enabled`` decides; otherwise an explicit ``recipe`` turns FP8 on; otherwise
    the enclosing autocast. Returns ``(setup, scale, probe)``; ``setup`` is ``None`` with FP8
    off."""
    state = _current_state()
    if enabled is None:
        enabled = True if recipe is not None else state.enabled
    if not enabled:
        return None, None, None
    if recipe is None:
        recipe = state.recipe if state.recipe is not None else DelayedScaling()
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(
            f"{where}: recipe must be DelayedScaling or Float8CurrentScaling, got {recipe!r}"
        )
    if recipe.fp8_format is Format.E5M2:
        raise ValueError(
            f"{where}: Format.E5M2 cannot run GEMMs (FP8 tensor cores have no E5M2 x E5M2 "
            "matmul); use Format.HYBRID or Format.E4M3"
        )
    current = isinstance(recipe, Float8CurrentScaling)
    if current:
        scale = jnp.ones((n_roles,), jnp.float32)
    else:
        if not isinstance(fp8_meta, Fp8Meta):
            raise TypeError(
                f"{where}: DelayedScaling needs fp8_meta (an Fp8Meta with {n_roles} roles, from "
                f"fp8jax.init_fp8_meta(recipe, n_roles={n_roles})), got {type(fp8_meta).__name__}"
            )
        if fp8_meta.scale.shape != (n_roles,):
            raise ValueError(
                f"{where}: fp8_meta must have {n_roles} roles, got scale {fp8_meta.scale.shape}"
            )
        scale = jax.lax.stop_gradient(fp8_meta.scale)
    if probe is None:
        probe = jnp.zeros((n_roles,), jnp.float32)
    elif jnp.shape(probe) != (n_roles,) or jnp.result_type(probe) != jnp.float32:
        raise ValueError(f"{where}: probe must be float32[{n_roles}], got {jnp.shape(probe)}")
    setup = Fp8Setup(
        fwd_dtype=recipe.fwd_dtype,
        bwd_dtype=recipe.bwd_dtype,
        current_scaling=current,
        margin=recipe.margin,
        impl=tuple((f, get_implementation(f)) for f in ("cast", "gemm", *families)),
        where=where,
    )
    return setup, scale, probe


def codes(q: jax.Array) -> jax.Array:
    """An FP8 tensor's ``uint8`` codes (how FP8 residuals travel; see :mod:`fp8jax.dense`)."""
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def named(x: jax.Array, i: int) -> jax.Array:
    return checkpoint_name(x, CHECKPOINT_NAMES[i])


def cast_t(setup: Fp8Setup, x: jax.Array, scale: jax.Array, fp8_dtype: Any):
    """``cast_transpose`` with this call's scale (current scaling: ``x``'s own) -> ``(q, q_t,
    scale_inv, amax)``; amaxes reduced over the whole mesh (one all-reduce for all)."""
    if setup.current_scaling:
        scale = _current_scale(x, fp8_dtype, setup.margin)
    return cast_transpose(
        x, scale, fp8_dtype, amax_reduction="mesh", implementation=setup.implementation("cast")
    )


def scale_for(setup: Fp8Setup, value: jax.Array, scale: jax.Array, fp8_dtype: Any) -> jax.Array:
    """The scale to quantize ``value`` with: the delayed one, or under current scaling the one
    from ``value``'s own amax."""
    return _current_scale(value, fp8_dtype, setup.margin) if setup.current_scaling else scale


def cast_dbias(setup: Fp8Setup, g: jax.Array, scale: jax.Array, with_bias: bool):
    """An output gradient cast to the backward format, with its column sums when the layer has
    a bias: ``(q, q_t, scale_inv, amax, dbias or None)`` (one pass over ``g``)."""
    bwd = setup.bwd_dtype
    if not with_bias:
        return (*cast_t(setup, g, scale, bwd), None)
    scale = scale_for(setup, g, scale, bwd)
    return cast_transpose_dbias(
        g, scale, bwd, amax_reduction="mesh", implementation=setup.implementation("cast")
    )


class GemmResiduals(NamedTuple):
    """What one FP8 GEMM's backward reads of its forward (besides its input's transposed
    copy, which the caller produced): the kernel in both layouts (codes), its inverse scale."""

    w_q: jax.Array
    w_t: jax.Array
    w_sinv: jax.Array


def gemm_forward(
    setup: Fp8Setup,
    x_q: jax.Array,
    x_sinv: jax.Array,
    w: jax.Array,
    w_scale: jax.Array,
    bias: jax.Array | None,
    out_dtype: Any,
) -> tuple[jax.Array, jax.Array, GemmResiduals]:
    """``y = x @ w (+ bias)`` for ``x_q`` (codes, [M, K], row-wise) and the high-precision
    kernel ``w`` [K, N], which is cast here; returns ``(y, w's amax, residuals)``."""
    fwd = setup.fwd_dtype
    w_q, w_t, w_sinv, w_amax = cast_t(setup, w, w_scale, fwd)
    w_q, w_t = named(codes(w_q), 1), named(codes(w_t), 3)
    w_sinv, w_amax = named(w_sinv, 4), named(w_amax, 5)
    y = gemm_codes(
        x_q, w_t, x_sinv, w_sinv, dtypes=(fwd, fwd), out_dtype=out_dtype, bias=bias,
        accumulate="fast", implementation=setup.implementation("gemm"),
    )  # fmt: skip
    return y, w_amax, GemmResiduals(w_q, w_t, w_sinv)


def gemm_backward(
    setup: Fp8Setup,
    g_q: jax.Array,
    g_t: jax.Array,
    g_sinv: jax.Array,
    x_t: jax.Array,
    x_sinv: jax.Array,
    res: GemmResiduals,
    x_dtype: Any,
    w_dtype: Any,
) -> tuple[jax.Array, jax.Array]:
    """dgrad and wgrad of one FP8 GEMM from its cast output gradient (codes ``g_q`` [M, N] and
    ``g_t`` [N, M]) and its input's transposed copy ``x_t`` (codes, [K, M]):
    ``dx = g @ w^T`` in ``x_dtype``, ``dw = x^T @ g`` in ``w_dtype``."""
    fwd, bwd = setup.fwd_dtype, setup.bwd_dtype
    gemm = setup.implementation("gemm")
    dx = gemm_codes(
        g_q, res.w_q, g_sinv, res.w_sinv, dtypes=(bwd, fwd), reuse=(res.w_t, x_t),
        out_dtype=x_dtype, accumulate="split", implementation=gemm,
    )  # fmt: skip
    dw = gemm_codes(
        x_t, g_t, x_sinv, g_sinv, dtypes=(fwd, bwd), out_dtype=w_dtype, accumulate="split",
        implementation=gemm,
    )  # fmt: skip
    return dx, dw


def zeros_if_symbolic(g: Any) -> jax.Array:
    """A cotangent as an array (``symbolic_zeros=True`` hands over ``SymbolicZero`` objects)."""
    if isinstance(g, jax.custom_derivatives.SymbolicZero):
        return jnp.zeros(g.shape, g.dtype)
    return g


def perturbed(tree: Any) -> bool:
    return any(p.perturbed for p in jax.tree.leaves(tree))


def probe_error(where: str) -> ValueError:
    """Differentiated without the probe under delayed scaling (see :mod:`fp8jax.dense`)."""
    return ValueError(
        f"{where}: differentiated with FP8 DelayedScaling, but not with respect to its probe, "
        "so this step's amax observations would be dropped and the FP8 scales would never "
        "update. Differentiate the loss with respect to the fp8_probe collection too and fold "
        "its gradient into fp8_meta (fp8jax.flax.Fp8TrainState.apply_gradients or "
        "update_fp8_variables; for the functional layers: probe=jnp.zeros(n_roles) and "
        "fp8jax.update_fp8_meta). Under nn.scan, give fp8_probe a variable axis. Flax NNX: "
        "nnx.value_and_grad(..., argnums=fp8jax.nnx.diff_state()), then "
        "fp8jax.nnx.update_fp8_state or apply_gradients. A gradient that must not update the "
        "state: differentiate the probe too and ignore its gradient."
    )
