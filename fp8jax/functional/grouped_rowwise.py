"""The grouped (MoE) GEMM of :func:`fp8jax.grouped_dense` under row-wise scaling
(``Float8RowwiseScaling``, issue 49), on the reference (XLA) path.

``y [T, N] = ragged_dot(x [T, K], kernel [G, K, N], group_sizes)``: every GEMM operand is
scaled per row along that GEMM's contraction dim (:func:`~fp8jax.ops.rowwise_quantize`):

- forward: each token's row of ``x`` its own scale along ``K``, whichever expert it goes to;
  each expert's kernel one scale per output column along ``K`` (``[G, N]`` scales);
- dgrad ``dx = g @ kernel[g]^T``: each row of the output gradient along ``N``, each expert's
  kernel per input row along ``N`` (``[G, K]`` scales);
- wgrad ``dw[g] = x_g^T g_g`` contracts over each expert's tokens: the transposed operands get
  one scale **per group per column**, from the column's amax over that group's tokens only
  (``[G, K]`` for ``x``, ``[G, N]`` for the gradient), so no scale mixes two experts' tokens.
  As the block-scaled recipes' segment blocks (:mod:`fp8jax.functional.grouped_dense`), these
  copies are quantized from the row-wise FP8 values (dequantized), not from the high-precision
  tensors: under expert parallelism the expert's device only receives the FP8 rows, and a mesh
  computes what one device computes (each group's column amax is max-reduced over the data axes
  that hold other tokens of the same experts).
- with the high-precision wgrad (``Float8RowwiseScaling(wgrad_high_precision=True)``), the wgrad
  is ``ragged_dot_general`` of the high-precision input and output gradient (their promoted
  dtype, float32 accumulation); under expert parallelism those cross the ``all_to_all`` in high
  precision in the backward pass (one more exchange of the input or the gradient).

Each GEMM is ``ragged_dot_general`` of the FP8 values in float32 (``precision=HIGHEST``), scaled
by the outer product of the operands' scales (``acc * (s_a * s_b)``, as
:func:`~fp8jax.ops.rowwise_scaled_matmul` does): XLA on every platform, no kernel yet. The
recipe is stateless: nothing is observed (NaN), there is no amax pass beyond the casts'.

A gated kernel pair is concatenated along ``N`` before the call (the dgrad's scales run along
the whole ``2 N``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax.functional import _core as core
from fp8jax.functional import _exchange
from fp8jax.functional._vjp import layer_vjp, zeros_if_symbolic
from fp8jax.ops.base.partition import varying
from fp8jax.ops.block.block_scaling import block_scale
from fp8jax.ops.block.grouped_scaling import group_ids
from fp8jax.ops.block.rowwise import rowwise_quantize
from fp8jax.ops.casts.quantize import to_fp8

__all__ = ["RowwiseGroupedConfig", "group_column_quantize", "grouped_rowwise", "ragged_rows_gemm"]

_ROWS = lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), [0], [0])
_CONTRACTING = lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), [0], [])


class RowwiseGroupedConfig(NamedTuple):
    """The static side of one row-wise grouped GEMM call (hashable)."""

    setup: core.Fp8Setup
    has_bias: bool
    dtype: Any  # the GEMM's output dtype
    dtypes: tuple[Any, Any, Any]  # x's, kernel's, bias's (None): each gradient in its primal's
    exchange: _exchange.Exchange | None
    exchange_input: bool  # x is on the token side (else: the output goes back there)
    n_experts: int  # the state's experts (all of them, under expert parallelism)


def ragged_rows_gemm(a_q, a_sinv, b_q, b_sinv, sizes) -> jax.Array:
    """``y [M, N] = ragged_dot(a, b[g]^T)`` of the FP8 ``a_q [M, K]`` (inverse scales ``[M,
    1]``, one per row) and ``b_q [G, N, K]`` (``[G, N, 1]``, one per row of each group's
    matrix), in float32: the dot of the FP8 values scaled by ``a_sinv * b_sinv[g(row)]``; rows
    past the sum of ``sizes`` are 0."""
    m = a_q.shape[0]
    acc = lax.ragged_dot_general(
        a_q.astype(jnp.float32), b_q.astype(jnp.float32), sizes, _ROWS,
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )  # fmt: skip
    sb = jnp.take(b_sinv[..., 0], group_ids(sizes, m), axis=0, mode="fill", fill_value=0.0)
    return acc * (a_sinv * sb)


def group_column_quantize(
    values: jax.Array, sizes: jax.Array, fp8_dtype: Any, pow2: bool, eps: float, reduce=None
) -> tuple[jax.Array, jax.Array]:
    """``values [M, C]`` (float32, rows sorted by group) quantized with one scale per group per
    column, from the column's amax over the group's rows: ``(codes [M, C], scale_inv [G,
    C])``, the scale :func:`~fp8jax.ops.block.block_scaling.block_scale`'s rule (as the
    row-wise cast's; NaN left out of the amax). Rows past the sum: scale 1. ``reduce``: applied
    to the ``[G, C]`` amax (a max over devices holding other rows of the same groups)."""
    m = values.shape[0]
    groups = sizes.shape[0]
    gid = group_ids(sizes, m)
    mag = jnp.abs(values)
    mag = jnp.where(jnp.isnan(mag), jnp.float32(0), mag)
    amax = jax.ops.segment_max(mag, gid, num_segments=groups, indices_are_sorted=True)
    amax = jnp.maximum(amax, jnp.float32(0))  # an empty group's -inf
    if reduce is not None:
        amax = reduce(amax)
    scale = block_scale(amax, fp8_dtype, power_2_scale=pow2, amax_epsilon=eps)
    per_row = jnp.take(scale, gid, axis=0, mode="fill", fill_value=1.0)
    return to_fp8(values, per_row, fp8_dtype), (np.float32(1) / scale).astype(jnp.float32)


def _ragged_wgrad(a, b, sizes, dtype=jnp.float32) -> jax.Array:
    """``[G, K, N]``: each group's ``a_g^T b_g`` of ``a [M, K]`` and ``b [M, N]`` in ``dtype``,
    accumulated in float32."""
    return lax.ragged_dot_general(
        a.astype(dtype), b.astype(dtype), sizes, _CONTRACTING,
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )  # fmt: skip


def _rows(s: core.Fp8Setup, x, dt, role):
    pow2, eps = s.rows(role)
    q, sinv = rowwise_quantize(x, dt, power_2_scale=pow2, amax_epsilon=eps)
    return core.codes(q), sinv


def _view(c, dt):
    return lax.bitcast_convert_type(c, dt)


def _forward(cfg: RowwiseGroupedConfig, x, w, bias, scale, sizes, plan):
    del scale  # stateless
    s, ex = cfg.setup, cfg.exchange
    fwd = s.fwd_dtype
    x_q, x_sinv = _rows(s, x, fwd, "x")  # each token's row along K
    if ex is not None and cfg.exchange_input:
        x_q, x_sinv = (_exchange.to_experts(ex, plan, v) for v in (x_q, x_sinv))
    w_t, w_t_sinv = _rows(s, jnp.swapaxes(w, 1, 2), fwd, "w")  # [G, N, K]: per column along K
    w_q, w_sinv = _rows(s, w, fwd, "w")  # [G, K, N]: per input row along N (the dgrad's)
    x_q, w_q, w_t = core.named(x_q, 2), core.named(w_q, 1), core.named(w_t, 3)
    x_sinv = core.named(x_sinv, 4)
    y = ragged_rows_gemm(_view(x_q, fwd), x_sinv, _view(w_t, fwd), w_t_sinv, sizes)
    if bias is not None:
        gid = group_ids(sizes, y.shape[0])
        y = y + jnp.take(bias.astype(jnp.float32), gid, axis=0, mode="fill", fill_value=0)
    y = y.astype(cfg.dtype)
    if ex is not None and not cfg.exchange_input:
        y = _exchange.to_tokens(ex, plan, y)
    x_hp = x if s.hp_wgrad else None
    seen = jnp.full((3 * cfg.n_experts,), jnp.nan, jnp.float32)  # stateless: nothing observed
    return (y, seen), (x_q, x_sinv, w_q, w_sinv, x_hp, sizes, plan)


def _backward(cfg: RowwiseGroupedConfig, res, cts):
    s, ex = cfg.setup, cfg.exchange
    fwd, bwd = s.fwd_dtype, s.bwd_dtype
    x_q, x_sinv, w_q, w_sinv, x_hp, sizes, plan = res
    x_dt, w_dt, b_dt = cfg.dtypes
    g = zeros_if_symbolic(cts[0])
    g_on_tokens = ex is not None and not cfg.exchange_input
    g_q, g_sinv = _rows(s, g, bwd, "grad")  # each row along N
    dbias = None
    if cfg.has_bias or s.hp_wgrad:
        g_wide = _exchange.to_experts(ex, plan, g) if g_on_tokens else g
    if cfg.has_bias:
        g32 = g_wide.astype(jnp.float32)
        dbias = jax.ops.segment_sum(g32, group_ids(sizes, g32.shape[0]),
                                    num_segments=w_q.shape[0]).astype(b_dt)  # fmt: skip
    if g_on_tokens:
        g_q, g_sinv = (_exchange.to_experts(ex, plan, v) for v in (g_q, g_sinv))
    dx = ragged_rows_gemm(_view(g_q, bwd), g_sinv, _view(w_q, fwd), w_sinv, sizes).astype(x_dt)
    if ex is not None and cfg.exchange_input:
        dx = _exchange.to_tokens(ex, plan, dx)
    if s.hp_wgrad:
        if ex is not None and cfg.exchange_input:
            x_hp = _exchange.to_experts(ex, plan, x_hp)
        dt = jnp.promote_types(x_hp.dtype, g_wide.dtype)
        dw = _ragged_wgrad(x_hp, g_wide, sizes, dt)
    else:
        reduce = None if ex is None else (lambda a: _exchange.global_max(ex, a, "experts"))
        xv = _view(x_q, fwd).astype(jnp.float32) * x_sinv
        gv = _view(g_q, bwd).astype(jnp.float32) * g_sinv
        x_c, x_c_sinv = group_column_quantize(xv, sizes, fwd, *s.rows("x"), reduce)
        g_c, g_c_sinv = group_column_quantize(gv, sizes, bwd, *s.rows("grad"), reduce)
        dw = _ragged_wgrad(x_c, g_c, sizes) * (x_c_sinv[:, :, None] * g_c_sinv[:, None, :])
    observed = jnp.full((3 * cfg.n_experts,), jnp.nan, jnp.float32)
    if ex is not None:  # typed as the probe it is the cotangent of: varying over every token axis
        observed = varying(observed, (*ex.data_axes, *ex.axes))
    return (dx, dw.astype(w_dt), dbias), observed


_grouped = layer_vjp(_forward, _backward, "grouped_dense_rowwise")


def grouped_rowwise(
    cfg: RowwiseGroupedConfig,
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    scale: jax.Array,
    probe: jax.Array,
    sizes: jax.Array,
    plan: _exchange.ExchangePlan,
) -> tuple[jax.Array, jax.Array]:
    """The row-wise grouped GEMM (see the module docstring) as one ``jax.custom_vjp``: ``(y,
    observed)``, ``observed`` NaN ``float32[3 n_experts]`` (stateless). ``x`` and ``kernel`` in
    a wide dtype, checked by the caller (:func:`fp8jax.grouped_dense`)."""
    return _grouped(cfg, (x, kernel, bias), scale, probe, (sizes, plan))
