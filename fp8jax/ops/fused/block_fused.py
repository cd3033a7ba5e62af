"""Block-scaled casts fused with what precedes them in a layer: the bias gradient
(``block_cast_transpose_dbias``), the MLP's activation (``activation_block_cast_transpose``),
its gradient with the bias gradient (``dactivation_block_cast_transpose_dbias``) and the norm
before a GEMM (``norm_block_cast_transpose``).

They are the block-scaled forms of :func:`~fp8jax.ops.cast_transpose_dbias`,
:func:`~fp8jax.ops.activation_cast_transpose`,
:func:`~fp8jax.ops.dactivation_cast_transpose_dbias` and :func:`~fp8jax.ops.norm_forward_fp8`:
the same values quantized as
:func:`~fp8jax.ops.block_cast_transpose` quantizes them (both layouts, each with its own scale
grid), in one op, so a GPU reads the high-precision tensor once per layout and never writes the
activation out in high precision. The kernels (``cpp/common/block_sources.h``) compute the
fused value as they read it: the activation rounded once to the input dtype, exactly as
:func:`~fp8jax.ops.activation` returns it, so each op equals its unfused chain bit for bit
within one implementation. dbias is the float32 column sums of ``g`` in the fixed order of the
other dbias kernels (docs/numerics.md, "dbias: a fixed summation order"): the same bits as
:func:`~fp8jax.ops.cast_transpose_dbias`'s dbias. The norm's CUDA kernel computes the row
statistics, then the block cast computes ``y`` from them as it reads ``x`` (``y`` never goes to
memory); the CPU kernel casts the ``y`` of its own norm forward.

Sharding: as :func:`~fp8jax.ops.block_cast_transpose` (a split dim must leave whole blocks on
each device); dbias is summed with one ``psum`` over the axes that split the rows, and the
activation's ``k`` dim (the gated pair) is never split, nor is the norm's hidden dim.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.ops.base import checks, opdef
from fp8jax.ops.block.block_scaling import (
    BLOCK_1D,
    MXFP8_BLOCK,
    SCALE_E8M0,
    SCALE_F32,
    SCALE_POW2,
    block_attrs,
    block_cast_transpose_reference,
    cast_transpose_coarse,
    cast_transpose_factors,
    cast_transpose_outputs,
    check_block,
    grid_shape,
    run_cast,
    scale_dtype,
)
from fp8jax.ops.casts.cast_transpose import dbias_workspace
from fp8jax.ops.fused.activation import (
    activation_attrs,
    activation_reference,
    activations_arg,
    dactivation_reference,
    gradient_arg,
)
from fp8jax.ops.fused.norm import (
    NORM_CODES,
    epsilon_arg,
    norm_forward_reference,
    norm_type_arg,
    params_args,
    per_row,
)

__all__ = [
    "activation_block_cast_transpose",
    "activation_block_cast_transpose_reference",
    "activation_mxfp8_cast_transpose",
    "block_cast_transpose_dbias",
    "block_cast_transpose_dbias_reference",
    "dactivation_block_cast_transpose_dbias",
    "dactivation_block_cast_transpose_dbias_reference",
    "dactivation_mxfp8_cast_transpose_dbias",
    "mxfp8_cast_transpose_dbias",
    "norm_block_cast_transpose",
    "norm_block_cast_transpose_reference",
    "norm_mxfp8_cast_transpose",
]


def block_cast_transpose_dbias_reference(
    g: jax.Array, *, fp8_dtype: Any, block: tuple[int, int], scale_mode: int, amax_epsilon: float
) -> tuple[jax.Array, ...]:
    """Pure-jnp reference of :func:`block_cast_transpose_dbias`: ``block_cast_transpose`` of
    ``g`` [..., m, n] and the float32 column sums of ``g``."""
    kw = dict(fp8_dtype=fp8_dtype, block=block, scale_mode=scale_mode, amax_epsilon=amax_epsilon)
    return (*block_cast_transpose_reference(g, **kw), jnp.sum(g.astype(jnp.float32), axis=-2))


def activation_block_cast_transpose_reference(
    x: jax.Array, *, fp8_dtype: Any, block: tuple[int, int], scale_mode: int,
    amax_epsilon: float, activations: tuple[str, ...],
) -> tuple[jax.Array, ...]:  # fmt: skip
    """Pure-jnp reference of :func:`activation_block_cast_transpose`: ``block_cast_transpose``
    of :func:`~fp8jax.ops.activation` of ``x`` [..., m, k, n] (in ``x``'s dtype)."""
    kw = dict(fp8_dtype=fp8_dtype, block=block, scale_mode=scale_mode, amax_epsilon=amax_epsilon)
    return block_cast_transpose_reference(activation_reference(x, activations), **kw)


def dactivation_block_cast_transpose_dbias_reference(
    g: jax.Array, x: jax.Array, *, fp8_dtype: Any, block: tuple[int, int], scale_mode: int,
    amax_epsilon: float, activations: tuple[str, ...],
) -> tuple[jax.Array, ...]:  # fmt: skip
    """Pure-jnp reference of :func:`dactivation_block_cast_transpose_dbias`: the gradient ``dx =``
    :func:`~fp8jax.ops.dactivation` ``(g, x)`` [..., m, k, n], each half ``dx[..., :, j, :]``
    cast by ``block_cast_transpose`` as its own matrix, stacked as ``q [..., m, k, n]``, grid
    ``[..., mb, k, nb]``, ``q_t [..., k, n, m]``, grid ``[..., k, n, mb_t]``; ``dbias [..., k, n]``
    the float32 sums of ``dx`` over ``m``."""
    dx = dactivation_reference(g, x, activations)
    kw = dict(fp8_dtype=fp8_dtype, block=block, scale_mode=scale_mode, amax_epsilon=amax_epsilon)
    q, s, q_t, s_t = block_cast_transpose_reference(jnp.moveaxis(dx, -2, -3), **kw)
    dbias = jnp.sum(dx.astype(jnp.float32), axis=-3)
    return jnp.moveaxis(q, -3, -2), jnp.moveaxis(s, -3, -2), q_t, s_t, dbias


def norm_block_cast_transpose_reference(
    x: jax.Array, gamma: jax.Array, beta: jax.Array, *, norm_type: str, norm_epsilon: float,
    zero_centered_gamma: bool, fp8_dtype: Any, block: tuple[int, int], scale_mode: int,
    amax_epsilon: float,
) -> tuple[jax.Array, ...]:  # fmt: skip
    """Pure-jnp reference of :func:`norm_block_cast_transpose`: ``block_cast_transpose`` of
    :func:`~fp8jax.ops.norm_forward`'s ``y`` (in ``x``'s dtype) of ``x`` [m, h], then its ``mu``
    and ``rsigma`` (``beta`` unread for ``"rmsnorm"``)."""
    y, mu, rsigma = norm_forward_reference(
        x, gamma, beta if norm_type == "layernorm" else None, norm_type=norm_type,
        epsilon=norm_epsilon, zero_centered_gamma=zero_centered_gamma,
    )  # fmt: skip
    kw = dict(fp8_dtype=fp8_dtype, block=block, scale_mode=scale_mode, amax_epsilon=amax_epsilon)
    return (*block_cast_transpose_reference(y, **kw), mu, rsigma)


def _act_outputs(x, *, fp8_dtype, block, scale_mode, activations, **_):
    """``q [m, n]``, its grid, ``q_t [n, m]``, its grid, of ``x [..., m, k, n]``."""
    lead, (m, n) = x.shape[:-3], (x.shape[-3], x.shape[-1])
    sdt = scale_dtype(scale_mode)
    return (
        opdef.like(x, fp8_dtype, dims=(-3, -1)),
        opdef.like(x, sdt, shape=grid_shape((*lead, m, n), block), dims=(-3, -1)),
        opdef.like(x, fp8_dtype, dims=(-1, -3)),
        opdef.like(x, sdt, shape=grid_shape((*lead, n, m), block), dims=(-1, -3)),
    )


_BLOCK_CAST_TRANSPOSE_DBIAS = opdef.OpDef(
    name="block_cast_transpose_dbias",
    family="cast",
    target="fp8jax_block_cast_transpose_dbias",
    reference=block_cast_transpose_dbias_reference,
    outputs=lambda g, **kw: (
        *cast_transpose_outputs(g, **kw),
        opdef.like(g, jnp.float32, dims=(-1,), core=2),
    ),
    factors=lambda g_ndim: (
        cast_transpose_factors(g_ndim)[0],
        [*cast_transpose_factors(g_ndim)[1], "k"],
    ),
    attrs=block_attrs,
    coarse=cast_transpose_coarse,
    sum_over={4: 0},  # dbias: the sum over g's rows, psum-ed over the axes that split them
    workspace=lambda g, **_: dbias_workspace(g, g.shape[-1]),
)


def _dact_outputs(g, x, *, fp8_dtype, block, scale_mode, **_):
    """``q [m, k, n]``, its grid ``[mb, k, nb]``, ``q_t [k, n, m]``, its grid, dbias ``[k, n]``."""
    lead, (m, k, n) = x.shape[:-3], x.shape[-3:]
    sdt = scale_dtype(scale_mode)
    (mb, nb), (nt, mt) = grid_shape((m, n), block), grid_shape((n, m), block)
    return (
        opdef.like(x, fp8_dtype),
        opdef.like(x, sdt, shape=(*lead, mb, k, nb), dims=(-3, -2, -1)),
        opdef.like(x, fp8_dtype, dims=(-2, -1, -3)),
        opdef.like(x, sdt, shape=(*lead, k, nt, mt), dims=(-2, -1, -3)),
        opdef.like(x, jnp.float32, dims=(-2, -1), core=3),
    )


_ACTIVATION_BLOCK_CAST_TRANSPOSE = opdef.OpDef(
    name="activation_block_cast_transpose",
    family="activation",
    target="fp8jax_activation_block_cast_transpose",
    reference=activation_block_cast_transpose_reference,
    outputs=_act_outputs,
    factors=lambda x_ndim: (["m a n"], ["m n", "mb nb", "n m", "nt mt"]),
    attrs=lambda *, activations, **kw: {
        **block_attrs(**kw),
        **activation_attrs(activations=activations),
    },
    coarse=lambda *, block, **_: {
        "mb": ("m", block[0]),
        "nb": ("n", block[1]),
        "nt": ("n", block[0]),
        "mt": ("m", block[1]),
    },
    need_replication=("a",),
)


_DACTIVATION_BLOCK_CAST_TRANSPOSE_DBIAS = opdef.OpDef(
    name="dactivation_block_cast_transpose_dbias",
    family="activation",
    target="fp8jax_dactivation_block_cast_transpose_dbias",
    reference=dactivation_block_cast_transpose_dbias_reference,
    outputs=_dact_outputs,
    factors=lambda g_ndim, x_ndim: (
        ["m n", "m a n"],
        ["m a n", "mb a nb", "a n m", "a nt mt", "a n"],
    ),
    attrs=lambda *, activations, **kw: {
        **block_attrs(**kw),
        **activation_attrs(activations=activations),
    },
    coarse=lambda *, block, **_: {
        "mb": ("m", block[0]),
        "nb": ("n", block[1]),
        "nt": ("n", block[0]),
        "mt": ("m", block[1]),
    },
    sum_over={4: 0},  # dbias: the sum over g's rows
    need_replication=("a",),
    workspace=lambda g, x, **_: dbias_workspace(g, x.shape[-2] * x.shape[-1]),
)


def _cast_kw(*, fp8_dtype, block, scale_mode, amax_epsilon, **_):
    return dict(fp8_dtype=fp8_dtype, block=block, scale_mode=scale_mode, amax_epsilon=amax_epsilon)


_NORM_BLOCK_CAST_TRANSPOSE = opdef.OpDef(
    name="norm_block_cast_transpose",
    family="norm",
    target="fp8jax_norm_block_cast_transpose",
    reference=norm_block_cast_transpose_reference,
    outputs=lambda x, gamma, beta, **kw: (
        *cast_transpose_outputs(x, **_cast_kw(**kw)),
        per_row(x),
        per_row(x),
    ),
    factors=lambda x_ndim, gamma_ndim, beta_ndim: (
        ["m h", "h", "h"],
        ["m h", "mb hb", "h m", "ht mt", "m", "m"],
    ),
    attrs=lambda *, norm_type, norm_epsilon, zero_centered_gamma, **kw: {
        **block_attrs(**_cast_kw(**kw)),
        "norm_type": np.int64(NORM_CODES[norm_type]),
        "norm_epsilon": np.float32(norm_epsilon),
        "zero_centered_gamma": np.int64(zero_centered_gamma),
    },
    coarse=lambda *, block, **_: {"mb": ("m", block[0]), "mt": ("m", block[1])},
    # a row's statistics read the whole row: h is never split, nor the grids' dims that count it
    need_replication=("h", "hb", "ht"),
)


def _both(owner, block, x_rank, x):
    block = check_block(owner, block)
    if jnp.ndim(x) != x_rank:
        raise ValueError(f"{owner}: x must have rank {x_rank}, got shape {jnp.shape(x)}")
    if block[0] != 1 and block[0] != block[1]:
        raise ValueError(f"{owner}: block must be 1 x n or square, got {block}")
    return block


def block_cast_transpose_dbias(
    g: jax.Array,
    fp8_dtype: Any,
    block: tuple[int, int] = BLOCK_1D,
    *,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`~fp8jax.ops.block_cast_transpose` of a gradient ``g`` [m, n] plus its bias
    gradient, in one op: ``(q, scale_inv, q_t, scale_inv_t, dbias)``, the first four bit for
    bit :func:`~fp8jax.ops.block_cast_transpose`'s, ``dbias`` float32 ``[n]``, the column sums
    of ``g`` (the kernels' fixed order; ``"xla"``: XLA's). ``implementation``: ``"kernel"`` or
    ``"xla"`` (family ``"cast"``); blocks the kernel does not take run the reference.

    >>> import jax.numpy as jnp
    >>> q, s, q_t, s_t, dbias = block_cast_transpose_dbias(jnp.ones((4, 256)), jnp.float8_e4m3fn)
    >>> s.shape, s_t.shape, dbias[:2]
    ((4, 2), (256, 1), Array([4., 4.], dtype=float32))
    """
    block = _both("block_cast_transpose_dbias", block, 2, g)
    mode = SCALE_POW2 if power_2_scale else SCALE_F32
    return run_cast(_BLOCK_CAST_TRANSPOSE_DBIAS, "block_cast_transpose_dbias", g, fp8_dtype, block,
                mode, amax_epsilon, implementation, arg="g")  # fmt: skip


def mxfp8_cast_transpose_dbias(
    g: jax.Array,
    fp8_dtype: Any = jnp.float8_e4m3fn,
    block: tuple[int, int] = MXFP8_BLOCK,
    *,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`block_cast_transpose_dbias` for MXFP8: :func:`~fp8jax.ops.mxfp8_cast_transpose`
    of ``g`` [m, n] (E8M0 scales) and its float32 column sums."""
    block = _both("mxfp8_cast_transpose_dbias", block, 2, g)
    return run_cast(_BLOCK_CAST_TRANSPOSE_DBIAS, "mxfp8_cast_transpose_dbias", g, fp8_dtype, block,
                SCALE_E8M0, 0.0, implementation, arg="g")  # fmt: skip


def activation_block_cast_transpose(
    x: jax.Array,
    activations: Any,
    fp8_dtype: Any,
    block: tuple[int, int] = BLOCK_1D,
    *,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The activation of an MLP's first GEMM output ``x`` [m, k, n] (see
    :mod:`fp8jax.ops.activation` for ``activations`` and the layout), block-scaled in both
    layouts in one op: ``(q [m, n], scale_inv, q_t [n, m], scale_inv_t)``, bit for bit
    ``block_cast_transpose(activation(x, activations), ...)`` within one implementation.
    ``implementation``: ``"kernel"`` or ``"xla"`` (family ``"activation"``).

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((4, 2, 128))  # gated: silu(x[:, 0]) * x[:, 1]
    >>> q, s, q_t, s_t = activation_block_cast_transpose(x, ("silu", "linear"),
    ...                                                  jnp.float8_e4m3fn)
    >>> q.shape, s.shape, q_t.shape, s_t.shape
    ((4, 128), (4, 1), (128, 4), (128, 1))
    """
    acts = activations_arg("activation_block_cast_transpose", activations)
    block = _both("activation_block_cast_transpose", block, 3, x)
    _act_shape("activation_block_cast_transpose", x, acts)
    mode = SCALE_POW2 if power_2_scale else SCALE_F32
    return run_cast(_ACTIVATION_BLOCK_CAST_TRANSPOSE, "activation_block_cast_transpose", x,
                fp8_dtype, block, mode, amax_epsilon, implementation,
                activations=acts)  # fmt: skip


def activation_mxfp8_cast_transpose(
    x: jax.Array,
    activations: Any,
    fp8_dtype: Any = jnp.float8_e4m3fn,
    block: tuple[int, int] = MXFP8_BLOCK,
    *,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`activation_block_cast_transpose` for MXFP8 (E8M0 scales)."""
    acts = activations_arg("activation_mxfp8_cast_transpose", activations)
    block = _both("activation_mxfp8_cast_transpose", block, 3, x)
    _act_shape("activation_mxfp8_cast_transpose", x, acts)
    return run_cast(_ACTIVATION_BLOCK_CAST_TRANSPOSE, "activation_mxfp8_cast_transpose", x,
                fp8_dtype, block, SCALE_E8M0, 0.0, implementation, activations=acts)  # fmt: skip


def _act_shape(owner: str, x: Any, acts: tuple[str, ...]) -> None:
    if jnp.shape(x)[1] != len(acts):
        raise ValueError(
            f"{owner}: x must be [m, k, n] with k = len(activations) = {len(acts)}, got shape "
            f"{jnp.shape(x)}"
        )


def _dact(owner, g, x, activations, fp8_dtype, block, mode, eps, implementation):
    acts = activations_arg(owner, activations)
    x = checks.wide_array(owner, "x", x)
    block = _both(owner, block, 3, x)
    _act_shape(owner, x, acts)
    g = gradient_arg(owner, g, x)
    return run_cast(_DACTIVATION_BLOCK_CAST_TRANSPOSE_DBIAS, owner, g, fp8_dtype, block, mode, eps,
                implementation, arg="g", extra_operands=(x,), activations=acts)  # fmt: skip


def dactivation_block_cast_transpose_dbias(
    g: jax.Array,
    x: jax.Array,
    activations: Any,
    fp8_dtype: Any,
    block: tuple[int, int] = BLOCK_1D,
    *,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The gradient of the activation (``g`` [m, n], the MLP's first GEMM output ``x``
    [m, k, n]; :func:`~fp8jax.ops.dactivation`) block-scaled in both layouts, with its bias
    gradient, in one op: ``(q [m, k, n], scale_inv [mb, k, nb], q_t [k, n, m], scale_inv_t
    [k, n, mb_t], dbias [k, n])``. Each half ``j`` of a gated gradient is cast as its own
    ``[m, n]`` matrix, so as the ``[m, k * n]`` matrix the GEMMs read, the blocks are those of
    :func:`~fp8jax.ops.block_cast_transpose` when ``n`` is a multiple of the block's columns
    (the layers use this op then, else the unfused pair). dbias: float32, the kernels' fixed
    order. Bit for bit ``dactivation`` then the cast within one implementation;
    ``implementation`` as for :func:`activation_block_cast_transpose`.

    >>> import jax.numpy as jnp
    >>> q, s, q_t, s_t, dbias = dactivation_block_cast_transpose_dbias(
    ...     jnp.ones((4, 128)), jnp.ones((4, 2, 128)), ("silu", "linear"), jnp.float8_e4m3fn)
    >>> q.shape, s.shape, q_t.shape, s_t.shape, dbias.shape
    ((4, 2, 128), (4, 2, 1), (2, 128, 4), (2, 128, 1), (2, 128))
    """
    mode = SCALE_POW2 if power_2_scale else SCALE_F32
    return _dact("dactivation_block_cast_transpose_dbias", g, x, activations, fp8_dtype, block,
                 mode, amax_epsilon, implementation)  # fmt: skip


def dactivation_mxfp8_cast_transpose_dbias(
    g: jax.Array,
    x: jax.Array,
    activations: Any,
    fp8_dtype: Any = jnp.float8_e4m3fn,
    block: tuple[int, int] = MXFP8_BLOCK,
    *,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`dactivation_block_cast_transpose_dbias` for MXFP8 (E8M0 scales)."""
    return _dact("dactivation_mxfp8_cast_transpose_dbias", g, x, activations, fp8_dtype, block,
                 SCALE_E8M0, 0.0, implementation)  # fmt: skip


def _norm(owner, x, gamma, beta, fp8_dtype, block, mode, amax_epsilon, implementation, norm_type,
          epsilon, zero_centered_gamma):  # fmt: skip
    norm_type = norm_type_arg(owner, norm_type)
    x = checks.wide_array(owner, "x", x)
    block = _both(owner, block, 2, x)
    gamma, beta = params_args(owner, norm_type, x, gamma, beta)
    if beta is None:  # rmsnorm: the kernel takes one signature and reads no beta
        beta = jnp.zeros_like(gamma)
    return run_cast(_NORM_BLOCK_CAST_TRANSPOSE, owner, x, fp8_dtype, block, mode, amax_epsilon,
                implementation, extra_operands=(gamma, beta), norm_type=norm_type,
                norm_epsilon=epsilon_arg(owner, epsilon),
                zero_centered_gamma=bool(zero_centered_gamma))  # fmt: skip


def norm_block_cast_transpose(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    fp8_dtype: Any,
    block: tuple[int, int] = BLOCK_1D,
    *,
    norm_type: str,
    epsilon: float,
    zero_centered_gamma: bool = False,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The norm of ``x`` [m, h] (:func:`~fp8jax.ops.norm_forward`'s arguments: ``gamma``,
    ``beta`` (``None`` for ``"rmsnorm"``), ``norm_type``, ``epsilon``, ``zero_centered_gamma``)
    block-scaled in both layouts in one op: ``(q [m, h], scale_inv, q_t [h, m], scale_inv_t,
    mu [m], rsigma [m])``, bit for bit ``block_cast_transpose(norm_forward(x, ...)[0], ...)``
    and the norm's statistics, within one implementation. ``implementation``: ``"kernel"`` or
    ``"xla"`` (family ``"norm"``).

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(512.0).reshape(2, 256)
    >>> q, s, q_t, s_t, mu, rs = norm_block_cast_transpose(
    ...     x, jnp.ones(256), jnp.zeros(256), jnp.float8_e4m3fn, norm_type="layernorm",
    ...     epsilon=1e-6)
    >>> q.shape, s.shape, q_t.shape, s_t.shape, mu.tolist()
    ((2, 256), (2, 2), (256, 2), (256, 1), [127.5, 383.5])
    """
    mode = SCALE_POW2 if power_2_scale else SCALE_F32
    return _norm("norm_block_cast_transpose", x, gamma, beta, fp8_dtype, block, mode,
                 amax_epsilon, implementation, norm_type, epsilon, zero_centered_gamma)  # fmt: skip


def norm_mxfp8_cast_transpose(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    fp8_dtype: Any = jnp.float8_e4m3fn,
    block: tuple[int, int] = MXFP8_BLOCK,
    *,
    norm_type: str,
    epsilon: float,
    zero_centered_gamma: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`norm_block_cast_transpose` for MXFP8 (E8M0 scales)."""
    return _norm("norm_mxfp8_cast_transpose", x, gamma, beta, fp8_dtype, block, SCALE_E8M0, 0.0,
                 implementation, norm_type, epsilon, zero_centered_gamma)  # fmt: skip
