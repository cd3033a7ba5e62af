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

The layer is built from :mod:`fp8jax.functional._core`, as :func:`fp8jax.layernorm_dense` and
:func:`fp8jax.layernorm_mlp` are (the recipe and state resolution, the casts, the GEMM's forward
and backward, the checkpoint names and the ``custom_vjp`` wiring); this module holds the
argument checks, the reshape of ``x`` and ``kernel`` to one 2-D GEMM, and its forward and
backward composed from those pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from fp8jax.functional import _core as core
from fp8jax.functional._core import CHECKPOINT_NAMES, save_fp8_operands
from fp8jax.functional._vjp import layer_vjp, zeros_if_symbolic
from fp8jax.ops.base import partition
from fp8jax.ops.base.partition import explicit_matmul_spec, explicit_mesh
from fp8jax.ops.gemms.gemm_options import below_fp8_flops
from fp8jax.recipe import Recipe
from fp8jax.state import DENSE_ROLES, Fp8Meta

__all__ = ["CHECKPOINT_NAMES", "dense", "save_fp8_operands"]

_N = len(DENSE_ROLES)


class _Config(NamedTuple):
    """Static (hashable) configuration of one dense call."""

    setup: core.Fp8Setup
    has_bias: bool
    dtype: Any  # the GEMM's output dtype
    # dtypes of the input and the kernel as given: the casts read them directly (no convert
    # pass to the compute dtype first) and dgrad/wgrad are produced in them.
    dtypes: tuple[Any, Any]


def _forward(cfg: _Config, x, w, bias, scale):
    """The forward GEMM; returns ``(y, forward observations), residuals``."""
    s = cfg.setup
    x_q, x_t, x_sinv, x_amax = core.named_input(*core.cast_t(s, x, scale[0], s.fwd_dtype))
    y, w_amax, r = core.gemm_forward(s, x_q, x_sinv, w, scale[1], bias, cfg.dtype)
    # What the forward saw; the output-grad role is unknown here (NaN: "not observed").
    seen = jnp.stack([x_amax, w_amax, jnp.float32(jnp.nan)]).reshape(_N)
    return (y, seen), (x_t, x_sinv, r, x_amax, w_amax, scale[2])


def _backward(cfg: _Config, res, cts):
    s = cfg.setup
    x_t, x_sinv, r, x_amax, w_amax, g_scale = res
    g = zeros_if_symbolic(cts[0])
    # the bias gradient from the same pass over g as its casts
    g_q, g_t, g_sinv, g_amax, dbias = core.cast_dbias(s, g, g_scale, cfg.has_bias)
    g_q, g_t = core.codes(g_q), core.codes(g_t)
    dx, dw = core.gemm_backward(s, g_q, g_t, g_sinv, x_t, x_sinv, r, *cfg.dtypes)
    dbias = None if dbias is None else dbias.astype(g.dtype)
    return (dx, dw, dbias), jnp.stack([x_amax, w_amax, g_amax]).reshape(_N)


_dense2d = layer_vjp(_forward, _backward, "dense")


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
    if jnp.dtype(dtype) not in core.WIDE:
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
    return dense_observed(
        x, kernel, bias, fp8_meta, recipe, probe=probe, axis=axis, dtype=dtype, enabled=enabled
    ).out


def dense_observed(
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
) -> core.LayerOutput:
    """:func:`dense` with its forward observations (:class:`~fp8jax.functional._core.LayerOutput`,
    ``ln_out`` None): ``float32[3]`` amax of (input, kernel, NaN), or ``None`` with FP8 off;
    what the Flax modules call. ``where`` names the caller in error messages."""
    axes = _normalize_axes(axis, getattr(x, "ndim", 0) or 1)
    if dtype is None:
        dtype = jnp.result_type(x, kernel) if hasattr(x, "dtype") else jnp.float32
    features = _check_inputs(x, kernel, bias, axes, dtype)
    setup, scale, probe = core.resolve(where, recipe, enabled, fp8_meta, probe, _N)
    shape = (
        int(np.prod([x.shape[a] for a in range(x.ndim) if a not in axes])),
        int(np.prod(features)),
        int(np.prod([x.shape[a] for a in axes])),
    )
    if setup is not None and below_fp8_flops([shape]):
        setup = None  # too small for FP8 to pay (fp8jax.ops.gemm_options): a plain dense
    if setup is None or jnp.dtype(x.dtype) not in core.WIDE:
        x = x.astype(dtype)
    if setup is None or jnp.dtype(kernel.dtype) not in core.WIDE:
        kernel = kernel.astype(dtype)
    bias = None if bias is None else bias.astype(dtype)
    batch_axes = [a for a in range(x.ndim) if a not in axes]
    x_perm = jnp.transpose(x, (*batch_axes, *axes))
    batch_shape = x_perm.shape[: len(batch_axes)]
    k = int(np.prod([x.shape[a] for a in axes]))
    n = int(np.prod(features))
    x2 = partition.reshape(x_perm, (int(np.prod(batch_shape)), k))
    w2 = partition.reshape(kernel, (k, n))
    b2 = None if bias is None else partition.reshape(bias, (n,))
    if setup is None:
        # (explicit sharding: the output layout the FP8 GEMM would give; jnp.dot cannot pick
        # one itself when the contracted dim is split, as in row-parallel layers)
        out_sharding = explicit_matmul_spec(x2, w2, b_rows_are_n=False) if explicit_mesh() else None
        y2 = jnp.dot(x2, w2, preferred_element_type=jnp.float32, out_sharding=out_sharding)
        if b2 is not None:
            b = b2.astype(jnp.float32)
            if out_sharding is not None:  # laid out as the output's columns
                b = jax.sharding.reshard(b, PartitionSpec(out_sharding[1]))
            y2 = y2 + b
        y = partition.reshape(y2.astype(dtype), (*batch_shape, *features))
        return core.LayerOutput(y, None, None)
    cfg = _Config(setup, has_bias=b2 is not None, dtype=jnp.dtype(dtype),
                  dtypes=(x2.dtype, w2.dtype))  # fmt: skip
    y2, seen = _dense2d(cfg, (x2, w2, b2), scale, probe)
    return core.LayerOutput(partition.reshape(y2, (*batch_shape, *features)), None, seen)
