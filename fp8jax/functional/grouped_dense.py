"""``fp8jax.grouped_dense``: a mixture of experts' expert GEMM, ``jax.lax.ragged_dot`` in FP8, as
one ``jax.custom_vjp``.

``y [T, N] = ragged_dot(x [T, K], kernel [G, K, N], group_sizes)`` (rows sorted by expert; rows
past the sum of ``group_sizes`` give 0), ``+ bias[g]`` for the rows of group ``g``. Forward: the
rows and each expert's kernel cast to FP8, one ragged grouped GEMM
(:func:`~fp8jax.ops.grouped_gemm`, fast accumulation). Backward: the output gradient cast, the
dgrad (the same ragged form against the kernel's codes) and the wgrad (contracting each group's
rows), split accumulation.

Scaling per expert, by recipe:

- DelayedScaling, Float8CurrentScaling: *one scale per expert* for each of the GEMM's three
  tensors: the input's rows of expert ``g``, its kernel ``kernel[g]`` and its rows of the output
  gradient (:func:`~fp8jax.ops.grouped_quantize`). The FP8 state therefore has one GEMM triple
  per expert, ``grouped_roles(G)`` (``3 G`` rows, input, kernel, grad_output of expert 0,
  then expert 1, ...), which the usual update (``update_fp8_variables``) handles as any other
  layer's. An expert whose tokens are small is not coarsened by another's large ones; an expert
  that got no token observes 0 and keeps its scale.
- Float8BlockScaling, MXFP8BlockScaling: the rows with ``1 x 128`` (``1 x 32``) blocks along K,
  each expert's kernel with its own ``128 x 128`` (``1 x 32``) blocks; the wgrad's operands (the
  input and output gradient transposed, blocks along the tokens) with segment blocks that
  restart at each expert's first token (:func:`~fp8jax.ops.segment_block_quantize`), so no
  block mixes two experts' tokens. Those transposed copies are quantized from the row-wise FP8
  values (dequantized), as DeepSeek-V3 does: under expert parallelism the expert's device only
  ever receives the FP8 rows, and one device computes exactly as a mesh does.
- Float8RowwiseScaling: each token's row its own scale along K, each expert's kernel one scale
  per output column; the wgrad's operands one scale per group per column over the group's
  tokens (:mod:`fp8jax.functional.grouped_rowwise`, the reference path).

Expert parallelism (:mod:`fp8jax.functional._exchange`): with an exchange, the input is cast on the
devices that hold the tokens and its FP8 codes (and row scales) cross the ``all_to_all``
(``exchange_input``), or the output goes back to the tokens' devices and the gradient's FP8
codes come to the experts (``exchange_output``). The scales are those of the global experts
(current scaling: each expert's amax max-reduced over the devices first).

With FP8 off: ``jax.lax.ragged_dot`` of the high-precision operands (what a plain-JAX twin
computes), plus the bias.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fp8jax.functional import _core as core
from fp8jax.functional import _exchange
from fp8jax.functional._vjp import layer_vjp, zeros_if_symbolic
from fp8jax.functional.grouped_rowwise import RowwiseGroupedConfig, grouped_rowwise
from fp8jax.ops.base.partition import varying
from fp8jax.ops.block.block_scaling import (
    block_cast_transpose,
    block_dequantize,
    block_quantize,
    mxfp8_cast_transpose,
    mxfp8_quantize,
)
from fp8jax.ops.block.grouped_scaling import (
    check_group_sizes,
    check_sum,
    clamped,
    group_ids,
    grouped_quantize,
    segment_block_quantize,
    transpose_padded,
)
from fp8jax.ops.casts.cast_transpose import transpose
from fp8jax.ops.casts.quantize import quantize
from fp8jax.ops.gemms.gemm_options import get_gemm_options
from fp8jax.ops.gemms.grouped_gemm import TENSOR_CORE_PAD, grouped_gemm
from fp8jax.recipe import Recipe
from fp8jax.state import Fp8Meta, gemm_roles

__all__ = ["grouped_dense", "grouped_roles"]


def grouped_roles(n_groups: int) -> tuple[str, ...]:
    """The FP8 state rows of a grouped GEMM over ``n_groups`` experts: one GEMM triple each.

    >>> grouped_roles(2)[:4]
    ('expert_0/input', 'expert_0/kernel', 'expert_0/grad_output', 'expert_1/input')
    """
    return gemm_roles(*(f"expert_{g}" for g in range(n_groups)))


class _Config(NamedTuple):
    setup: core.Fp8Setup
    has_bias: bool
    dtype: Any  # the GEMM's output dtype
    dtypes: tuple[Any, Any, Any]  # x's, kernel's, bias's (None): each gradient in its primal's
    exchange: _exchange.Exchange | None
    exchange_input: bool  # x is on the token side (else: the output goes back there)
    n_experts: int  # the state's experts (all of them, under expert parallelism)
    pair: bool = False  # the kernel is a gated pair (w0, w1), its halves concatenated along N
    pad: int = 0  # the wgrad operands' padded layout (the tensor-core path's), 0: none


def _per_group_scale(s: core.Fp8Setup, x, sizes, scale, fp8_dtype, ex, side):
    """The scale of each group's rows: the delayed ``scale``, or under current scaling the one
    from each group's amax (max-reduced over the devices holding the same experts' rows,
    ``side`` ``"tokens"`` or ``"experts"`` of the exchange)."""
    if not s.current_scaling:
        return scale
    _, _, amax = grouped_quantize(x, sizes, jnp.ones_like(scale), fp8_dtype)
    return core.scale_from_amax(_exchange.global_max(ex, amax, side), fp8_dtype, s.margin)


def _cast_rows(s: core.Fp8Setup, x, sizes, scale, fp8_dtype, role, ex=None, side="tokens"):
    """The rows of ``x`` in FP8 for a ``"rows"`` GEMM: ``(codes, scale_inv, amax [G])``; block
    scaling: ``scale_inv`` the row-wise grid, ``amax`` NaN (not observed)."""
    if s.blocks is None:
        scale = _per_group_scale(s, x, sizes, scale, fp8_dtype, ex, side)
        q, sinv, amax = grouped_quantize(x, sizes, scale, fp8_dtype)
        return core.codes(q), sinv, amax
    block, pow2, eps = s.block(role)
    impl = s.implementation("cast")
    if s.mxfp8:
        q, grid = mxfp8_quantize(x, fp8_dtype, block, implementation=impl)
        grid = jax.lax.bitcast_convert_type(grid, jnp.uint8)
    else:
        q, grid = block_quantize(
            x, fp8_dtype, block, power_2_scale=pow2, amax_epsilon=eps, implementation=impl
        )
    return core.codes(q), grid, jnp.full(scale.shape, jnp.nan, jnp.float32)


def _scales(s: core.Fp8Setup, sinv):
    """Scale grids as the GEMM takes them (MXFP8's travel as their uint8 bits)."""
    if s.mxfp8 and s.blocks is not None:
        return jax.lax.bitcast_convert_type(sinv, jnp.float8_e8m0fnu)
    return sinv


def _transposed(s: core.Fp8Setup, codes, sinv, sizes, fp8_dtype, role, pad=0):
    """The wgrad operand ``[cols, rows]`` from a tensor's row-wise FP8 ``codes [rows, cols]``:
    the transposed codes (per-group scales: each element keeps its scale), or under block
    scaling the row-wise values dequantized and cast again with segment blocks along the rows.
    With ``pad``, in the padded layout of that width (each group's columns starting at a multiple
    of it), as the tensor-core path reads it."""
    if s.blocks is None:
        impl = s.implementation("cast")
        if pad:
            return transpose_padded(codes, sizes, pad, implementation=impl), sinv
        return transpose(codes, implementation=impl), sinv
    block = s.block(role)[0]
    values = block_dequantize(
        jax.lax.bitcast_convert_type(codes, fp8_dtype), _scales(s, sinv), block
    )
    pow2, eps = s.block(role)[1:]
    q, grid = segment_block_quantize(
        values.T,
        sizes,
        fp8_dtype,
        (1, block[1]),
        mxfp8=s.mxfp8,
        power_2_scale=pow2,
        amax_epsilon=eps,
        implementation=s.implementation("cast"),
        padded=bool(pad),
    )
    if s.mxfp8:
        grid = jax.lax.bitcast_convert_type(grid, jnp.uint8)
    return core.codes(q), grid


def _cast_kernel(s: core.Fp8Setup, w, scale):
    """Each expert's kernel ``w [G, K, N]`` in FP8: ``(w_q [G, K, N], w_t [G, N, K], (scale_inv
    of w_q, of w_t), amax [G])``; one scale per expert (its own state row, or its own amax), or
    its own blocks. ``w`` may be a gated pair ``(w0, w1)``, cast as their concatenation along
    ``N`` (one scale per expert for both, or each half's whole blocks) without the
    high-precision concatenation ever being written: in one XLA fusion under per-expert scales,
    the codes concatenated under block scaling."""
    if isinstance(w, tuple):
        return _cast_pair(s, w, scale)
    fwd = s.fwd_dtype
    if s.blocks is None:
        if s.current_scaling:
            amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=(1, 2))
            scale = core.scale_from_amax(amax, fwd, s.margin)
        q, sinv, amax = _quantize_experts(s, w, scale)
        return q, transpose(q, implementation=s.implementation("cast")), (sinv, sinv), amax
    block, pow2, eps = s.block("w")
    impl = s.implementation("cast")
    if s.mxfp8:
        q, sq, q_t, sq_t = mxfp8_cast_transpose(w, fwd, block, implementation=impl)
        sq, sq_t = (jax.lax.bitcast_convert_type(v, jnp.uint8) for v in (sq, sq_t))
    else:
        q, sq, q_t, sq_t = block_cast_transpose(
            w, fwd, block, power_2_scale=pow2, amax_epsilon=eps, implementation=impl
        )
    return core.codes(q), core.codes(q_t), (sq, sq_t), jnp.full(scale.shape, jnp.nan)


def _quantize_experts(s: core.Fp8Setup, w, scale, impl=None):
    """``w [G, K, N]`` cast with one scale per expert: ``(codes, scale_inv [G], amax [G])``."""
    impl = impl or s.implementation("cast")
    q, sinv, amax = jax.vmap(
        lambda v, sc: quantize(v, sc, s.fwd_dtype, amax_reduction="mesh", implementation=impl)
    )(w, scale)
    return core.codes(q), sinv, amax


def _cast_pair(s: core.Fp8Setup, pair, scale):
    fwd = s.fwd_dtype
    if s.blocks is None:
        if s.current_scaling:
            amaxes = [jnp.max(jnp.abs(h.astype(jnp.float32)), axis=(1, 2)) for h in pair]
            scale = core.scale_from_amax(jnp.maximum(*amaxes), fwd, s.margin)
        # XLA's cast, which fuses the concatenation into its one pass over the halves (a kernel
        # reads a materialized operand: the concatenated kernel, or its halves' codes to be
        # concatenated, one more pass either way)
        q, sinv, amax = _quantize_experts(s, jnp.concatenate(pair, axis=-1), scale, "xla")
        q_t = transpose(q, implementation=s.implementation("cast"))
        return q, q_t, (sinv, sinv), amax
    halves = [_cast_kernel(s, h, scale) for h in pair]  # each half's own whole blocks
    cat = lambda i, axis: jnp.concatenate([h[i] for h in halves], axis=axis)
    grid = lambda j, axis: jnp.concatenate([h[2][j] for h in halves], axis=axis)
    return cat(0, -1), cat(1, 1), (grid(0, -1), grid(1, 1)), halves[0][3]


def _pad(s: core.Fp8Setup) -> int:
    """The wgrad operands' padded layout when the tensor-core path is asked for
    (``gemm_options(grouped_tensor_cores=True)``): 16 under per-group scales, the segment blocks'
    width under Float8BlockScaling (its blocks are then the kernel's K blocks); 0 otherwise (and
    for MXFP8, which has no tensor-core grouped path)."""
    if not get_gemm_options().grouped_tensor_cores or s.mxfp8:
        return 0
    return TENSOR_CORE_PAD if s.blocks is None else s.block("x")[0][1]


def pair_casts_apart(s: core.Fp8Setup | None, n: int) -> bool:
    """Whether a gated pair's halves ``[G, K, n]`` are cast apart (:func:`_cast_pair`): under
    row-wise scaling never (the dgrad's kernel rows run along both halves); under per-group
    scales always; under block scaling when ``n`` is whole blocks along either of the
    weight block's dims (the dgrad reads the kernel blocked along ``n`` too: MXFP8's 1 x 32 as
    well as 128 x 128); a block straddling the two halves is cast from the concatenated kernel
    instead."""
    if s is not None and s.rowwise is not None:
        return False
    if s is None or s.blocks is None:
        return True
    return n % max(s.block("w")[0]) == 0


def _blocks(s: core.Fp8Setup, a_role: str, b_role: str) -> dict[str, Any]:
    if s.blocks is None:
        return {}
    return {"a_block": s.block(a_role)[0], "b_block": s.block(b_role)[0]}


def _gemm(s: core.Fp8Setup, a, sa, b, sb, sizes, dtypes, out_dtype, accumulate, ragged, roles,
          padded=0):  # fmt: skip
    view = lambda c, dt: jax.lax.bitcast_convert_type(c, dt)
    return grouped_gemm(
        view(a, dtypes[0]),
        view(b, dtypes[1]),
        sizes,
        _scales(s, sa),
        _scales(s, sb),
        ragged=ragged,
        out_dtype=out_dtype,
        accumulate=accumulate,
        padded=padded,
        implementation=s.implementation("gemm"),
        **_blocks(s, *roles),
    )


def _local_rows(n_local: int, first, per_role):
    """This device's experts' rows of a ``[E]`` per-expert vector."""
    return jax.lax.dynamic_slice_in_dim(per_role, first, n_local)


def _forward(cfg: _Config, x, w, w1, bias, scale, sizes, plan):
    s, ex = cfg.setup, cfg.exchange
    fwd = s.fwd_dtype
    sc = scale.reshape(-1, 3)
    n_local = w.shape[0]
    w = (w, w1) if cfg.pair else w
    first = plan.first_expert if ex is not None else 0
    local = lambda v: _local_rows(n_local, first, v) if ex is not None else v
    # the input's rows: on the token side (all experts' scales) or the expert side
    x_sizes = plan.sizes_tokens if ex is not None and cfg.exchange_input else sizes
    x_scale = sc[:, 0] if ex is None or cfg.exchange_input else local(sc[:, 0])
    x_side = "tokens" if cfg.exchange_input else "experts"
    x_q, x_sinv, x_amax = _cast_rows(s, x, x_sizes, x_scale, fwd, "x", ex, x_side)
    if ex is not None and cfg.exchange_input:
        x_q = _exchange.to_experts(ex, plan, x_q)
        if s.blocks is not None:
            x_sinv = _exchange.to_experts(ex, plan, x_sinv)
        else:  # the expert side's groups are this device's experts
            x_sinv = local(x_sinv)
    w_q, w_t, (w_sinv, w_t_sinv), w_amax = _cast_kernel(s, w, local(sc[:, 1]))
    x_q, w_q = core.named(x_q, 2), core.named(w_q, 1)
    w_t, x_sinv = core.named(w_t, 3), core.named(x_sinv, 4)
    with_bias = bias is not None
    y = _gemm(
        s,
        x_q,
        x_sinv,
        w_t,
        w_t_sinv,
        sizes,
        (fwd, fwd),
        jnp.float32 if with_bias else cfg.dtype,
        "fast",
        "rows",
        ("x", "w"),
    )
    if with_bias:
        gid = group_ids(sizes, y.shape[0])
        b = jnp.take(bias.astype(jnp.float32), gid, axis=0, mode="fill", fill_value=0)
        y = (y + b).astype(cfg.dtype)
    if ex is not None and not cfg.exchange_input:
        y = _exchange.to_tokens(ex, plan, y)
    # observations, one triple per expert (global experts; this device's contributions)
    seen = _observed(cfg, x_amax, w_amax, None, first)
    res = (x_q, x_sinv, w_q, w_sinv, sizes, plan, x_amax, w_amax, sc[:, 2], first)
    return (y, seen), res


def _observed(cfg: _Config, x_amax, w_amax, g_amax, first):
    """``float32[3 E]``: (input, kernel, grad_output) amax per global expert; under expert
    parallelism each device reports its own contributions (0 where it saw nothing) and the
    caller max-reduces over the devices."""
    ex = cfg.exchange
    if g_amax is None:  # the forward pass: the gradients' roles are not observed
        g_amax = jnp.full((cfg.n_experts,), jnp.nan, jnp.float32)
        g_on_tokens = True
    else:
        g_on_tokens = ex is not None and not cfg.exchange_input
    if ex is None:
        return jnp.stack([x_amax, w_amax, g_amax], axis=1).reshape(-1)

    def widen(v, on_token_side):
        if on_token_side:
            return v
        full = jnp.zeros((cfg.n_experts,), jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(full, v, first, 0)

    x_g = widen(x_amax, cfg.exchange_input)
    w_g = widen(w_amax, False)
    g_g = widen(g_amax, g_on_tokens)
    return jnp.stack([x_g, w_g, g_g], axis=1).reshape(-1)


def _backward(cfg: _Config, res, cts):
    s, ex = cfg.setup, cfg.exchange
    fwd, bwd = s.fwd_dtype, s.bwd_dtype
    x_q, x_sinv, w_q, w_sinv, sizes, plan, x_amax, w_amax, g_scale, first = res
    x_dt, w_dt, b_dt = cfg.dtypes
    n_local = w_q.shape[0]
    g = zeros_if_symbolic(cts[0])
    g_on_tokens = ex is not None and not cfg.exchange_input
    g_sizes = plan.sizes_tokens if g_on_tokens else sizes
    g_scale = g_scale if ex is None or g_on_tokens else _local_rows(n_local, first, g_scale)
    g_side = "tokens" if g_on_tokens else "experts"
    g_q, g_sinv, g_amax = _cast_rows(s, g, g_sizes, g_scale, bwd, "grad", ex, g_side)
    dbias = None
    if cfg.has_bias:
        g32 = g.astype(jnp.float32)
        if g_on_tokens:
            g32 = _exchange.to_experts(ex, plan, g32)
        dbias = jax.ops.segment_sum(g32, group_ids(sizes, g32.shape[0]), num_segments=n_local)
        dbias = dbias.astype(b_dt)
    if g_on_tokens:
        g_q = _exchange.to_experts(ex, plan, g_q)
        g_sinv = (
            _exchange.to_experts(ex, plan, g_sinv)
            if s.blocks is not None
            else _local_rows(n_local, first, g_sinv)
        )
    dx = _gemm(s, g_q, g_sinv, w_q, w_sinv, sizes, (bwd, fwd), x_dt, "split", "rows", ("grad", "w"))
    if ex is not None and cfg.exchange_input:
        dx = _exchange.to_tokens(ex, plan, dx)
    if cfg.pad:  # as the padded layout and the GEMM read them alike
        sizes = clamped(sizes, x_q.shape[0])
    x_t, x_t_sinv = _transposed(s, x_q, x_sinv, sizes, fwd, "x", cfg.pad)
    g_t, g_t_sinv = _transposed(s, g_q, g_sinv, sizes, bwd, "grad", cfg.pad)

    def wgrad(g_t, g_t_sinv):
        return _gemm(s, x_t, x_t_sinv, g_t, g_t_sinv, sizes, (fwd, bwd), w_dt, "split",
                     "contracting", ("x", "grad"), cfg.pad)  # fmt: skip

    if cfg.pair:  # each half's gradient written by its own GEMM: no split of a [G, K, 2N] one
        n = g_t.shape[0] // 2
        rows = lambda v, half: v if s.blocks is None and v.ndim == 1 else v[half]
        halves = (slice(0, n), slice(n, 2 * n))
        dw, dw1 = (wgrad(g_t[h], rows(g_t_sinv, h)) for h in halves)
    else:
        dw, dw1 = wgrad(g_t, g_t_sinv), None
    observed = _observed(cfg, x_amax, w_amax, g_amax, first)
    if ex is not None:  # typed as the probe it is the cotangent of: varying over every token axis
        observed = varying(observed, (*ex.data_axes, *ex.axes))
    return (dx, dw, dw1, dbias), observed


_grouped = layer_vjp(_forward, _backward, "grouped_dense")


def _check(where, x, kernel, group_sizes, bias, dtype):
    if isinstance(kernel, tuple):  # a gated pair: checked as the kernel it concatenates to
        kernel = jax.ShapeDtypeStruct((*kernel[0].shape[:2], 2 * kernel[0].shape[2]),
                                      jnp.result_type(*kernel))  # fmt: skip
    for name, v in (("x", x), ("kernel", kernel)):
        if not hasattr(v, "dtype") or not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"{where}: {name} must be a floating-point array, got {v!r:.60}")
    if x.ndim != 2:
        raise ValueError(f"{where}: x must be [T, K] (rows sorted by group), got {x.shape}")
    if kernel.ndim != 3 or kernel.shape[1] != x.shape[1]:
        raise ValueError(
            f"{where}: kernel must be [G, K, N] with K = x's last dim {x.shape[1]}, got "
            f"{kernel.shape}"
        )
    group_sizes = check_group_sizes(where, group_sizes, kernel.shape[0])
    check_sum(where, group_sizes, x.shape[0], "rows of x")
    if bias is not None and tuple(bias.shape) != (kernel.shape[0], kernel.shape[2]):
        raise ValueError(
            f"{where}: bias must be [G, N] = {(kernel.shape[0], kernel.shape[2])}, got "
            f"{tuple(bias.shape)}"
        )
    if jnp.dtype(dtype) not in core.WIDE:
        raise TypeError(f"{where}: dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return group_sizes


def _reference(x, kernel, group_sizes, bias, dtype):
    # the sizes as the FP8 path reads them (negative as 0, clamped to the rows): ragged_dot's
    # own reading of a negative size differs (it shifts the later groups' rows)
    group_sizes = clamped(group_sizes, x.shape[0])
    y = jax.lax.ragged_dot(x.astype(dtype), kernel.astype(dtype), group_sizes)
    if bias is not None:
        gid = group_ids(group_sizes, x.shape[0])
        y = y + jnp.take(bias.astype(dtype), gid, axis=0, mode="fill", fill_value=0)
    return y.astype(dtype)


def grouped_dense(
    x: jax.Array,
    kernel: jax.Array,
    group_sizes: jax.Array,
    bias: jax.Array | None = None,
    fp8_meta: Fp8Meta | None = None,
    recipe: Recipe | None = None,
    *,
    probe: jax.Array | None = None,
    dtype: Any = None,
    enabled: bool | None = None,
) -> jax.Array:
    """The experts' GEMM: ``ragged_dot(x, kernel, group_sizes) (+ bias per group)``, in FP8.

    FP8 on/off and the recipe are decided as for :func:`fp8jax.dense`; the scaling per expert
    is described in the module docstring. With FP8 off this is ``jax.lax.ragged_dot`` of the
    high-precision operands.

    Args:
      x: ``[T, K]``, rows sorted by group (expert).
      kernel: ``[G, K, N]``, one matrix per expert.
      group_sizes: int32 ``[G]``, rows per expert, summing to at most ``T`` (rows past the sum
        give 0). Concrete sizes that are negative or sum past ``T`` are a ValueError; traced
        ones are read clamped, FP8 on or off: a negative size as 0, the running sum capped at
        ``T``.
      bias: optional ``[G, N]``, one per expert.
      fp8_meta: :class:`~fp8jax.state.Fp8Meta` of ``3 G`` roles (:func:`grouped_roles`) for
        delayed scaling.
      recipe, probe, dtype, enabled: as for :func:`fp8jax.dense` (``probe``: zero
        ``float32[3 G]``).

    >>> import jax.numpy as jnp, fp8jax
    >>> x, w = jnp.ones((3, 4)), jnp.stack([jnp.full((4, 2), 0.5), jnp.full((4, 2), 1.0)])
    >>> sizes = jnp.array([2, 1], jnp.int32)
    >>> y = fp8jax.grouped_dense(x, w, sizes, recipe=fp8jax.Float8CurrentScaling())
    >>> y.round(4).tolist()
    [[2.0, 2.0], [2.0, 2.0], [4.0, 4.0]]
    """
    return grouped_dense_observed(
        x, kernel, group_sizes, bias, fp8_meta, recipe, probe=probe, dtype=dtype, enabled=enabled
    ).out


def grouped_dense_observed(
    x,
    kernel,
    group_sizes,
    bias,
    fp8_meta,
    recipe,
    *,
    probe,
    dtype,
    enabled,
    where="fp8jax.grouped_dense",
    exchange=None,
    plan=None,
    exchange_input=True,
    n_experts=None,
):
    """:func:`grouped_dense` with its forward observations (a
    :class:`~fp8jax.functional._core.LayerOutput`): what the MoE layers call. ``exchange``/``plan``
    (expert parallelism, inside a ``shard_map``): the rows of ``x`` (``exchange_input``) or of
    the output are on the token side; ``group_sizes`` are then the expert side's and
    ``n_experts`` the global expert count (the state's, ``3 n_experts`` rows)."""
    pair = kernel if isinstance(kernel, tuple) else None
    if pair is not None:
        if (
            len(pair) != 2
            or any(not hasattr(h, "shape") for h in pair)
            or (pair[0].shape != pair[1].shape)
        ):
            raise ValueError(f"{where}: a kernel pair must be two [G, K, N] arrays alike")
        kernel = None
    if dtype is None and hasattr(x, "dtype"):
        dtype = jnp.result_type(x, *(pair or (kernel,)))
    group_sizes = _check(where, x, pair or kernel, group_sizes, bias, dtype)
    dtype = jnp.dtype(dtype)
    lead = pair[0] if pair is not None else kernel
    n = n_experts if n_experts is not None else lead.shape[0]
    setup, scale, probe = core.resolve(where, recipe, enabled, fp8_meta, probe, 3 * n)
    if pair is not None and not pair_casts_apart(setup, pair[0].shape[-1]):
        kernel, pair = jnp.concatenate(pair, axis=-1), None
    if setup is None:
        if pair is not None:
            kernel = jnp.concatenate(pair, axis=-1)
        if exchange is not None and exchange_input:
            x = _exchange.to_experts(exchange, plan, x)
        y = _reference(x, kernel, group_sizes, bias, dtype)
        if exchange is not None and not exchange_input:
            y = _exchange.to_tokens(exchange, plan, y)
        return core.LayerOutput(y, None, None)
    if jnp.dtype(x.dtype) not in core.WIDE:
        x = x.astype(dtype)
    ws = pair if pair is not None else (kernel, None)
    wide = lambda w: w if w is None or jnp.dtype(w.dtype) in core.WIDE else w.astype(dtype)
    ws = tuple(wide(w) for w in ws)
    if plan is None:
        plan = _exchange.ExchangePlan(*(jnp.zeros((0,), jnp.int32),) * 4, jnp.int32(0))
    if setup.rowwise is not None:  # its own custom_vjp (fp8jax.functional.grouped_rowwise)
        dtypes = (x.dtype, ws[0].dtype, None if bias is None else bias.dtype)
        rcfg = RowwiseGroupedConfig(setup, bias is not None, dtype, dtypes, exchange,
                                    bool(exchange_input), n)  # fmt: skip
        y, seen = grouped_rowwise(rcfg, x, ws[0], bias, scale, probe, group_sizes, plan)
        return core.LayerOutput(y, None, seen)
    cfg = _Config(
        setup,
        bias is not None,
        dtype,
        (x.dtype, ws[0].dtype, None if bias is None else bias.dtype),
        exchange,
        bool(exchange_input),
        n,
        pair is not None,
        _pad(setup),
    )
    (y, seen) = _grouped(cfg, (x, *ws, bias), scale, probe, (group_sizes, plan))
    return core.LayerOutput(y, None, seen)
