"""``fp8jax.dense``: an FP8 dense layer as a ``jax.custom_vjp``.

Forward: quantize the input and the kernel (E4M3 under HYBRID) with the delayed scales, one FP8
GEMM with fast accumulation. Backward: quantize the output gradient (E5M2 under HYBRID) and run
dgrad and wgrad as FP8 GEMMs with split (full-precision) accumulation; the bias gradient is the
float32 column sum of the output gradient, taken by ``cast_transpose_dbias`` in the same pass as
its casts. Every GEMM gets K-major operands straight from ``cast_transpose``, so no XLA
transpose of an FP8 tensor is needed; the one exception is FSDP, where the dgrad GEMM transposes
the kernel copy the forward GEMM gathered (on each device) rather than gather it a second time.

The layer reports what it saw, one amax per role (input, kernel, output-grad), as the cotangent of
``probe`` (see :mod:`fp8jax.state`); ``fp8jax.update_fp8_meta`` turns that into the next step's
state. Differentiating the layer without differentiating its probe would lose the observation
and freeze the state, so with delayed scaling that is an error at trace time.

Everything the backward pass needs (both FP8 layouts of the input and the kernel, their inverse
scales and amaxes) carries a checkpoint name (:data:`CHECKPOINT_NAMES`), so under
``jax.checkpoint`` the policy :data:`save_fp8_operands` keeps the FP8 operands instead of
recomputing the casts.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from fp8jax.autocast import _current_state
from fp8jax.ops._gemm_partition import explicit_matmul_spec
from fp8jax.ops._implementation import get_implementation
from fp8jax.ops._partition import explicit_mesh
from fp8jax.ops.cast_transpose import cast_transpose, cast_transpose_dbias
from fp8jax.ops.gemm import gemm_codes
from fp8jax.recipe import DelayedScaling, Float8CurrentScaling, Format, Recipe, fp8_max
from fp8jax.state import Fp8Meta

__all__ = ["CHECKPOINT_NAMES", "dense", "save_fp8_operands"]

#: Checkpoint names of everything an FP8 GEMM layer saves for its backward pass, for
#: ``jax.checkpoint_policies.save_only_these_names``: the FP8 input and kernel in both layouts
#: (row-wise for the forward GEMM, transposed for the backward ones), their inverse scales and
#: their amaxes. Saving all of them means no cast is recomputed under ``jax.checkpoint``.
CHECKPOINT_NAMES: tuple[str, ...] = (
    "fp8jax_input_fp8",  # input, transposed (K-major for the wgrad GEMM)
    "fp8jax_kernel_fp8",  # kernel, row-wise (the dgrad GEMM)
    "fp8jax_input_fp8_fwd",  # input, row-wise (the forward GEMM)
    "fp8jax_kernel_fp8_fwd",  # kernel, transposed (the forward GEMM; FSDP's gathered copy)
    "fp8jax_scale_inv",  # inverse scales of the input and the kernel
    "fp8jax_amax",  # amaxes of the input and the kernel (the forward observations)
)

#: A ``jax.checkpoint`` policy that saves the FP8 operands of every fp8jax GEMM (and their
#: scales) and recomputes everything else: ``jax.checkpoint(f, policy=save_fp8_operands)`` or
#: ``nn.remat(Block, policy=save_fp8_operands)``. A forward GEMM whose output the backward needs
#: (e.g. the input of an activation) is recomputed from the saved FP8 operands, with no cast.
save_fp8_operands = jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES)

_WIDE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class _Config(NamedTuple):
    """Static (hashable) configuration of one dense call."""

    fwd_dtype: Any
    bwd_dtype: Any
    out_dtype: Any
    current_scaling: bool
    margin: int
    has_bias: bool
    # Under explicit sharding (AxisType.Explicit) the shardings of x, kernel and bias (2-D):
    # a custom_vjp cotangent must have its primal's type, sharding included. None otherwise.
    shardings: tuple[Any, Any, Any] | None = None
    # Who is calling, for error messages ("fp8jax.dense", "DenseGeneral at 'Dense_0'", ...).
    where: str = "fp8jax.dense"
    # dtypes of the input and the kernel as given: the casts read them directly (no convert
    # pass to the compute dtype first) and dgrad/wgrad are produced in them.
    x_dtype: Any = None
    w_dtype: Any = None
    # fp8jax.ops.implementation of the casts and the GEMMs, read when the layer is called, so
    # that a backward traced later (jax.vjp's function called elsewhere) runs the same ones.
    cast_impl: str = "kernel"
    gemm_impl: str = "kernel"


def _current_scale(x: jax.Array, fp8_dtype: Any, margin: int) -> jax.Array:
    """Float8CurrentScaling: the scale from this tensor's own amax (1 if amax is 0/non-finite)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    s = (np.float32(fp8_max(fp8_dtype)) / amax) * np.float32(2.0**-margin)
    ok = (amax >= np.finfo(np.float32).smallest_normal) & jnp.isfinite(amax)
    return jnp.where(ok, jnp.minimum(s, np.finfo(np.float32).max), jnp.float32(1.0))


def _cast_t(cfg: _Config, x: jax.Array, scale: jax.Array, fp8_dtype: Any, *, dbias=False):
    """``cast_transpose`` of ``x`` (with ``dbias``: ``cast_transpose_dbias``, which also sums
    its columns in the same pass, so the bias gradient costs no second read of ``x``)."""
    if cfg.current_scaling:
        scale = _current_scale(x, fp8_dtype, cfg.margin)
    # "mesh": every amax of the step is reduced over the same devices, so XLA merges all of
    # them into one all-reduce (the value is the tensor's global amax either way).
    op = cast_transpose_dbias if dbias else cast_transpose
    return op(x, scale, fp8_dtype, amax_reduction="mesh", implementation=cfg.cast_impl)


def _named(x: jax.Array, i: int) -> jax.Array:
    return checkpoint_name(x, CHECKPOINT_NAMES[i])


def _codes(q: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def _forward(cfg: _Config, x, w, bias, scale):
    """The forward GEMM; returns ``(y, forward observations), residuals``.

    FP8 tensors travel as their ``uint8`` codes (the GEMMs view them as FP8 on each device):
    for every floating-point residual that the forward also uses, ``jax.checkpoint`` inserts
    ``reduce_precision(x, finfo(x.dtype))``, which XLA applies with IEEE rules (E4M3FN codes of
    256 and above become NaN, subnormals are flushed), so FP8 residuals would change the forward
    pass under remat; codes are left alone. Both GEMMs that use ``w_t`` see the very same value,
    so an FSDP gather of it is shared.
    """
    x_q, x_t, x_sinv, x_amax = _cast_t(cfg, x, scale[0], cfg.fwd_dtype)
    w_q, w_t, w_sinv, w_amax = _cast_t(cfg, w, scale[1], cfg.fwd_dtype)
    x_t, w_q, x_q, w_t = (_named(_codes(v), i) for i, v in enumerate((x_t, w_q, x_q, w_t)))
    x_sinv, w_sinv = _named(x_sinv, 4), _named(w_sinv, 4)
    x_amax, w_amax = _named(x_amax, 5), _named(w_amax, 5)
    y = gemm_codes(
        x_q, w_t, x_sinv, w_sinv,
        dtypes=(cfg.fwd_dtype, cfg.fwd_dtype),
        out_dtype=cfg.out_dtype,
        bias=bias if cfg.has_bias else None,
        accumulate="fast",
        implementation=cfg.gemm_impl,
    )  # fmt: skip
    # What the forward saw; the output-grad role is unknown here (NaN: "not observed").
    seen = jnp.stack([x_amax, w_amax, jnp.float32(jnp.nan)]).reshape(3)
    res = (x_t, w_q, w_t, x_sinv, w_sinv, x_amax, w_amax, scale[2])
    return (y, seen), res


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dense2d(cfg: _Config, x, w, bias, scale, probe):
    del probe
    out, _ = _forward(cfg, x, w, bias, scale)
    return out


def _perturbed(tree: Any) -> bool:
    return any(p.perturbed for p in jax.tree.leaves(tree))


def _dense2d_fwd(cfg: _Config, x, w, bias, scale, probe):
    # symbolic_zeros=True: each argument arrives as a CustomVJPPrimal that says whether it is
    # being differentiated. The output-grad amax leaves only through the probe's cotangent.
    if not cfg.current_scaling and not probe.perturbed and _perturbed((x, w, bias)):
        from fp8jax._fp8_gemm import probe_error  # _fp8_gemm imports this module

        raise probe_error(cfg.where)
    x, w, bias, scale = jax.tree.map(lambda p: p.value, (x, w, bias, scale))
    return _forward(cfg, x, w, bias, scale)


def _dense2d_bwd(cfg: _Config, res, cts):
    x_t, w_q, w_t, x_sinv, w_sinv, x_amax, w_amax, g_scale = res
    g = cts[0]
    if isinstance(g, jax.custom_derivatives.SymbolicZero):
        g = jnp.zeros(g.shape, g.dtype)
    dbias = None
    if cfg.has_bias:  # the bias gradient from the same pass over g as its casts
        g_q, g_t, g_sinv, g_amax, dbias = _cast_t(cfg, g, g_scale, cfg.bwd_dtype, dbias=True)
        dbias = dbias.astype(g.dtype)
    else:
        g_q, g_t, g_sinv, g_amax = _cast_t(cfg, g, g_scale, cfg.bwd_dtype)
    g_q, g_t = _codes(g_q), _codes(g_t)
    # dgrad: dx[M,K] = g[M,N] @ w[K,N]^T; wgrad: dw[K,N] = x^T[K,M] @ g^T[N,M]^T.
    # The casts read x and w in their own dtypes, so dgrad and wgrad are produced in them.
    # Under FSDP dgrad reuses the forward GEMM's gathered w_t (no second all-gather).
    fwd, bwd = cfg.fwd_dtype, cfg.bwd_dtype
    dx = gemm_codes(
        g_q, w_q, g_sinv, w_sinv,
        dtypes=(bwd, fwd), reuse=(w_t, x_t), out_dtype=cfg.x_dtype, accumulate="split",
        implementation=cfg.gemm_impl,
    )  # fmt: skip
    dw = gemm_codes(
        x_t, g_t, x_sinv, g_sinv,
        dtypes=(fwd, bwd), out_dtype=cfg.w_dtype, accumulate="split",
        implementation=cfg.gemm_impl,
    )  # fmt: skip
    if cfg.shardings is not None:
        dx = jax.sharding.reshard(dx, cfg.shardings[0])
        dw = jax.sharding.reshard(dw, cfg.shardings[1])
        if dbias is not None:
            dbias = jax.sharding.reshard(dbias, cfg.shardings[2])
    observed = jnp.stack([x_amax, w_amax, g_amax]).reshape(3)
    return dx, dw, dbias, jnp.zeros((3,), jnp.float32), observed


_dense2d.defvjp(_dense2d_fwd, _dense2d_bwd, symbolic_zeros=True)


def _normalize_axes(axis: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    out = []
    for a in axes:
        if not isinstance(a, (int, np.integer)) or not -ndim <= a < ndim:
            raise ValueError(f"dense: axis {a!r} is out of range for an input of rank {ndim}")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out) or not out:
        raise ValueError(f"dense: axis must name distinct input axes, got {axis!r}")
    return tuple(out)


def _check_inputs(x, kernel, bias, axes, dtype):
    for name, v in (("x", x), ("kernel", kernel)):
        if not hasattr(v, "dtype") or not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"dense: {name} must be a floating-point array, got {v!r:.80}")
    contract = tuple(x.shape[a] for a in axes)
    if kernel.ndim < len(axes) or tuple(kernel.shape[: len(axes)]) != contract:
        raise ValueError(
            f"dense: kernel shape {kernel.shape} must start with the contracted input dims "
            f"{contract} (x shape {x.shape}, axis {axes})"
        )
    features = kernel.shape[len(axes) :]
    if bias is not None and tuple(bias.shape) != tuple(features):
        raise ValueError(f"dense: bias must have shape {features}, got {bias.shape}")
    if jnp.dtype(dtype) not in _WIDE:
        raise TypeError(f"dense: dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return features


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    fp8_meta: Fp8Meta | None = None,
    recipe: Recipe | None = None,
    *,
    probe: jax.Array | None = None,
    axis: int | Sequence[int] = -1,
    dtype: Any = None,
    enabled: bool | None = None,
) -> jax.Array:
    """FP8 dense layer: contracts ``x``'s ``axis`` dims with ``kernel``'s leading dims.

    Shapes follow ``flax.linen.DenseGeneral``: ``kernel`` is ``contracted_dims + features`` and
    the result is ``x``'s remaining dims + ``features``.

    Whether FP8 is on, and with which recipe: an explicit ``enabled`` decides; otherwise an
    explicit ``recipe`` turns FP8 on (a recipe given by hand is never silently ignored);
    otherwise the enclosing :func:`fp8jax.autocast` decides (off outside any). The recipe is the
    one given, else the autocast's.

    With :class:`~fp8jax.recipe.DelayedScaling`, differentiate with respect to ``probe`` as
    well (its gradient is the observation that updates ``fp8_meta``): differentiating ``x``,
    ``kernel`` or ``bias`` but not ``probe`` is a ValueError at trace time, since the state would
    silently stop updating.

    Args:
      x: input, any float dtype; leading (batch) dims are kept.
      kernel: weights, shape ``[x.shape[a] for a in axis] + features``.
      bias: optional, shape ``features``.
      fp8_meta: the layer's :class:`~fp8jax.state.Fp8Meta` (3 roles); needed for
        :class:`~fp8jax.recipe.DelayedScaling`, ignored by ``Float8CurrentScaling``.
      recipe: the recipe; default: the one of the enclosing :func:`fp8jax.autocast`.
      probe: zero ``float32[3]`` whose cotangent is this call's observed amax of (input, kernel,
        output-grad). Differentiate with respect to it to get the observation.
      axis: input axes to contract (default: the last).
      dtype: computation and output dtype (default: the promoted dtype of ``x`` and ``kernel``).
      enabled: FP8 on/off (see above). Off: a plain high-precision dense with the same API.

    >>> import jax.numpy as jnp, fp8jax
    >>> x, w = jnp.ones((4, 8)), jnp.full((8, 2), 0.5)
    >>> recipe = fp8jax.DelayedScaling(amax_history_len=4)
    >>> fp8jax.dense(x, w, None, fp8jax.init_fp8_meta(recipe), recipe).tolist()  # FP8: recipe given
    [[4.0, 4.0], [4.0, 4.0], [4.0, 4.0], [4.0, 4.0]]
    """
    y, _ = _dense(
        x, kernel, bias, fp8_meta, recipe, probe=probe, axis=axis, dtype=dtype, enabled=enabled
    )
    return y


def _dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    fp8_meta: Fp8Meta | None,
    recipe: Recipe | None,
    *,
    probe: jax.Array | None,
    axis: int | Sequence[int],
    dtype: Any,
    enabled: bool | None,
    where: str = "fp8jax.dense",
) -> tuple[jax.Array, jax.Array | None]:
    """:func:`dense`, also returning the forward observations: ``float32[3]`` amax of (input,
    kernel, NaN) -- NaN marks the output-grad role, which the forward cannot see -- or ``None``
    with FP8 off. ``where`` names the caller in error messages."""
    axes = _normalize_axes(axis, getattr(x, "ndim", 0) or 1)
    if dtype is None:
        dtype = jnp.result_type(x, kernel) if hasattr(x, "dtype") else jnp.float32
    features = _check_inputs(x, kernel, bias, axes, dtype)
    state = _current_state()
    if enabled is None:
        enabled = True if recipe is not None else state.enabled
    if recipe is None:
        recipe = state.recipe if state.recipe is not None else DelayedScaling()
    if not enabled or jnp.dtype(x.dtype) not in _WIDE:
        x = x.astype(dtype)
    if not enabled or jnp.dtype(kernel.dtype) not in _WIDE:
        kernel = kernel.astype(dtype)
    bias = None if bias is None else bias.astype(dtype)
    batch_axes = [a for a in range(x.ndim) if a not in axes]
    x_perm = jnp.transpose(x, (*batch_axes, *axes))
    batch_shape = x_perm.shape[: len(batch_axes)]
    k = int(np.prod([x.shape[a] for a in axes]))
    n = int(np.prod(features))
    x2 = x_perm.reshape(int(np.prod(batch_shape)), k)
    w2 = kernel.reshape(k, n)
    b2 = None if bias is None else bias.reshape(n)
    if not enabled:
        # (explicit sharding: the output layout the FP8 GEMM would give; jnp.dot cannot pick
        # one itself when the contracted dim is split, as in row-parallel layers)
        out_sharding = explicit_matmul_spec(x2, w2, b_rows_are_n=False) if explicit_mesh() else None
        y2 = jnp.dot(x2, w2, preferred_element_type=jnp.float32, out_sharding=out_sharding)
        if b2 is not None:
            b = b2.astype(jnp.float32)
            if out_sharding is not None:  # laid out as the output's columns
                b = jax.sharding.reshard(b, PartitionSpec(out_sharding[1]))
            y2 = y2 + b
        return y2.astype(dtype).reshape(*batch_shape, *features), None
    cfg = _make_config(recipe, dtype, b2 is not None)._replace(
        where=where,
        x_dtype=x2.dtype,
        w_dtype=w2.dtype,
        cast_impl=get_implementation("cast"),
        gemm_impl=get_implementation("gemm"),
    )
    if explicit_mesh():
        cfg = cfg._replace(shardings=tuple(None if v is None else jax.typeof(v).sharding
                                           for v in (x2, w2, b2)))  # fmt: skip
    if cfg.current_scaling:
        scale = jnp.ones((3,), jnp.float32)
    else:
        if not isinstance(fp8_meta, Fp8Meta):
            raise TypeError(
                f"{where}: DelayedScaling needs fp8_meta (an Fp8Meta with 3 roles, from "
                f"fp8jax.init_fp8_meta(recipe)), got {type(fp8_meta).__name__}"
            )
        if fp8_meta.scale.shape != (3,):
            raise ValueError(f"{where}: fp8_meta must have 3 roles, got {fp8_meta.scale.shape}")
        scale = jax.lax.stop_gradient(fp8_meta.scale)
    if probe is None:
        probe = jnp.zeros((3,), jnp.float32)
    elif jnp.shape(probe) != (3,) or jnp.result_type(probe) != jnp.float32:
        raise ValueError(f"{where}: probe must be float32[3], got {jnp.shape(probe)}")
    y2, seen = _dense2d(cfg, x2, w2, b2, scale, probe)
    return y2.reshape(*batch_shape, *features), seen


def _make_config(recipe: Recipe, dtype: Any, has_bias: bool) -> _Config:
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(f"dense: recipe must be DelayedScaling or Float8CurrentScaling: {recipe!r}")
    if recipe.fp8_format is Format.E5M2:
        raise ValueError(
            "dense: Format.E5M2 cannot run GEMMs (FP8 tensor cores have no E5M2 x E5M2 "
            "matmul); use Format.HYBRID or Format.E4M3"
        )
    return _Config(
        fwd_dtype=recipe.fwd_dtype,
        bwd_dtype=recipe.bwd_dtype,
        out_dtype=jnp.dtype(dtype),
        current_scaling=isinstance(recipe, Float8CurrentScaling),
        margin=recipe.margin,
        has_bias=has_bias,
    )
