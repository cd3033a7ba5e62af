"""``fp8jax.layernorm_dense``: a norm followed by an FP8 dense layer, as one ``jax.custom_vjp``;
and the normalisation step every fp8jax layer with a norm shares.

The norm step: argument checks, the high-precision form (Flax's own formula, so that FP8-off
layers equal their Flax twins bit for bit) and the FP8 form (one fused kernel: norm, FP8 cast,
transposed copy for the next GEMM's wgrad). In ``layernorm_dense`` the norm is fused with the
FP8 cast of its output (and the transposed copy the wgrad GEMM reads), so the normalised
activations never exist in high precision in memory unless asked for
(``return_layernorm_output``, e.g. for a residual taken after the norm). The state has the three
roles of :func:`fp8jax.dense` (input = the norm's output, kernel, output-grad); the backward is
the output gradient's cast (fused with the bias gradient), dgrad and wgrad in FP8, and the
norm's backward.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.autocast import is_fp8_enabled
from fp8jax.functional import _core as core
from fp8jax.functional._core import Fp8Setup, block_norm_cast, cast_t, named_input
from fp8jax.functional._vjp import layer_vjp, zeros_if_symbolic
from fp8jax.ops.base import partition
from fp8jax.ops.fused.norm import norm_backward, norm_forward, norm_forward_fp8
from fp8jax.ops.fused.norm_autodiff import layernorm, rmsnorm
from fp8jax.ops.gemms import fixed_groups
from fp8jax.ops.gemms.gemm_options import below_fp8_flops
from fp8jax.recipe import Recipe
from fp8jax.state import DENSE_ROLES, Fp8Meta

__all__ = [
    "NORM_TYPES",
    "NormResiduals",
    "check_norm_args",
    "check_norm_params",
    "flax_norm",
    "input_backward",
    "input_forward",
    "layernorm_dense",
    "norm_fp8",
    "norm_layer",
]

_N = len(DENSE_ROLES)


NORM_TYPES = ("layernorm", "rmsnorm")


def check_norm_args(where: str, norm_type: Any, epsilon: Any, zero_centered_gamma: Any) -> None:
    """ValueError/TypeError naming the argument that is wrong."""
    if norm_type not in NORM_TYPES:
        raise ValueError(f"{where}: layernorm_type must be one of {NORM_TYPES}, got {norm_type!r}")
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float, np.floating)):
        raise TypeError(f"{where}: epsilon must be a float, got {epsilon!r}")
    if not epsilon > 0:
        raise ValueError(f"{where}: epsilon must be > 0, got {epsilon!r}")
    if not isinstance(zero_centered_gamma, (bool, np.bool_)):
        raise TypeError(f"{where}: zero_centered_gamma must be a bool, got {zero_centered_gamma!r}")


def check_norm_params(where: str, norm_type: str, hidden: int, gamma: Any, beta: Any) -> None:
    """Shapes of the norm's scale (``gamma``) and bias (``beta``; none for RMSNorm)."""
    for name, v in (("gamma", gamma), ("beta", beta)):
        if v is None:
            continue
        if not hasattr(v, "dtype") or not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"{where}: {name} must be a floating-point array, got {v!r:.60}")
        if tuple(v.shape) != (hidden,):
            raise ValueError(
                f"{where}: {name} must have shape ({hidden},) (the input's last dim), got "
                f"{tuple(v.shape)}"
            )
    if gamma is None:
        raise ValueError(f"{where}: gamma (the norm's scale) is required")
    if norm_type == "layernorm" and beta is None:
        raise ValueError(f"{where}: layernorm_type='layernorm' needs beta (the norm's bias)")
    if norm_type == "rmsnorm" and beta is not None:
        raise ValueError(f"{where}: layernorm_type='rmsnorm' has no bias; pass beta=None")


def flax_norm(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    norm_type: str,
    epsilon: float,
    zero_centered_gamma: bool,
    dtype: Any,
) -> jax.Array:
    """The norm over the last axis exactly as ``flax.linen.LayerNorm``/``RMSNorm`` compute it
    (statistics in float32 with ``E[x^2] - E[x]^2``, clipped at 0), in ``dtype``. With
    ``zero_centered_gamma`` the scale applied is ``1 + gamma``."""
    # Written op for op as Flax writes it (the square before the means, statistics expanded
    # before rsqrt), so that autodiff accumulates the gradient in the same order too.
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if norm_type == "layernorm":
        sq = jax.lax.square(xf)
        mu, mu2 = jnp.mean(xf, axis=-1), jnp.mean(sq, axis=-1)
        var = jnp.maximum(0.0, mu2 - jax.lax.square(mu))
    else:
        var = jnp.mean(jax.lax.square(xf), axis=-1)
        mu = jnp.zeros_like(var)
    features = (1,) * (x.ndim - 1) + (x.shape[-1],)
    y = x - jnp.expand_dims(mu, -1)
    mul = jax.lax.rsqrt(jnp.expand_dims(var, -1) + epsilon)
    mul = mul * (gamma + 1 if zero_centered_gamma else gamma).reshape(features)
    y = y * mul
    if beta is not None:
        y = y + beta.reshape(features)
    return jnp.asarray(y, dtype)


def norm_layer(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    norm_type: str,
    epsilon: float,
    zero_centered_gamma: bool,
    dtype: Any,
) -> jax.Array:
    """The ``LayerNorm`` module's forward, shared by Linen and NNX: inside FP8 autocast the norm
    op (:func:`~fp8jax.ops.layernorm`/:func:`~fp8jax.ops.rmsnorm` on the rows), otherwise
    :func:`flax_norm`; in ``dtype``."""
    if not is_fp8_enabled():
        return flax_norm(x, gamma, beta, norm_type, epsilon, zero_centered_gamma, dtype)
    x2 = x.reshape(-1, x.shape[-1])
    kw = dict(epsilon=epsilon, zero_centered_gamma=zero_centered_gamma)
    if norm_type == "layernorm":
        y = layernorm(x2, gamma, beta, **kw)
    else:
        y = rmsnorm(x2, gamma, **kw)
    return y.reshape(x.shape).astype(dtype)


def norm_fp8(
    setup: Fp8Setup,
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    scale: jax.Array,
    norm: tuple[str, float, bool],
    keep_output: bool = False,
):
    """The norm of ``x`` ``[..., H]`` cast to the forward FP8 format: ``(q [M, H], q_t [H, M],
    scale_inv, amax, mu, rsigma, y)`` (``M`` the rows, flattened after the norm; ``mu``,
    ``rsigma`` and ``y`` in ``x``'s shape), ``y`` (the norm in ``x.dtype``) ``None`` unless
    ``keep_output``.

    Delayed scaling runs the fused kernel, and so does block scaling (its own,
    :func:`~fp8jax.ops.norm_block_cast_transpose`); current scaling (which needs the output's
    amax before the cast) and ``keep_output`` run the norm, then ``cast_transpose``: the same
    values either way, since the fused kernels quantize the norm as rounded to ``x.dtype``."""
    norm_type, epsilon, zero_centered = norm
    kw = dict(norm_type=norm_type, epsilon=epsilon, zero_centered_gamma=zero_centered)
    impl = setup.implementation("norm")
    hidden = x.shape[-1]
    if setup.blocks is not None and not keep_output:  # the norm fused into the block cast
        q, q_t, sinv, amax, mu, rsigma = block_norm_cast(
            setup, x.reshape(-1, hidden), gamma, beta, norm
        )
        rows = x.shape[:-1]
        return q, q_t, sinv, amax, mu.reshape(rows), rsigma.reshape(rows), None
    if setup.current_scaling or keep_output:
        y, mu, rsigma = norm_forward(x, gamma, beta, implementation=impl, **kw)
        q, q_t, sinv, amax = cast_t(setup, y.reshape(-1, hidden), scale, setup.fwd_dtype)
        return q, q_t, sinv, amax, mu, rsigma, (y if keep_output else None)
    # [..., H] unflattened, so that rows split in several dims (batch and sequence) stay split
    # through the norm; the flattening after it gathers FP8 codes where a split must go.
    q, q_t, sinv, amax, mu, rsigma = norm_forward_fp8(
        x, gamma, beta, scale, setup.fwd_dtype, amax_reduction="mesh", implementation=impl, **kw
    )
    return q.reshape(-1, hidden), q_t, sinv, amax, mu, rsigma, None


class NormResiduals(NamedTuple):
    """What the norm's backward reads: its input and statistics, and its scale."""

    x: jax.Array
    gamma: jax.Array
    mu: jax.Array
    rsigma: jax.Array


def input_forward(
    setup: Fp8Setup,
    x: jax.Array,
    gamma: jax.Array | None,
    beta: jax.Array | None,
    scale: jax.Array,
    norm: tuple[str, float, bool] | None,
    keep_output: bool,
):
    """A layer's first GEMM input: ``x`` ``[..., H]`` normalised (``norm``; ``None``: as it
    is) and cast to FP8 -> ``(q [M, H], q_t [H, M], scale_inv, amax, output or None,
    NormResiduals or None)``, the FP8 tensors as checkpoint-named codes
    (:data:`fp8jax.CHECKPOINT_NAMES`). ``output`` (the norm's output in ``x.dtype``, or
    ``x``; ``[M, H]``) is kept when ``keep_output``."""
    hidden = x.shape[-1]
    if norm is None:
        x = x.reshape(-1, hidden)
        q, q_t, sinv, amax = cast_t(setup, x, scale, setup.fwd_dtype)
        out, res = (x if keep_output else None), None
    else:
        q, q_t, sinv, amax, mu, rsigma, out = norm_fp8(
            setup, x, gamma, beta, scale, norm, keep_output=keep_output
        )
        res = NormResiduals(x, gamma, mu, rsigma)
        out = None if out is None else out.reshape(-1, hidden)
    return (*named_input(q, q_t, sinv, amax), out, res)


def input_backward(
    setup: Fp8Setup,
    norm: tuple[str, float, bool] | None,
    res: NormResiduals | None,
    d_in: jax.Array,
    d_out: Any,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The gradient of :func:`input_forward`'s input and norm params from the gradient
    ``d_in [M, H]`` of the GEMM input (plus ``d_out``, the kept output's cotangent, if any):
    ``(dx, dgamma, dbeta)`` (float32 ``dgamma``/``dbeta``; ``None`` without a norm); ``dx``
    ``[M, H]`` without a norm, else in the norm's input's shape."""
    if d_out is not None and not isinstance(d_out, jax.custom_derivatives.SymbolicZero):
        d_in = (d_in.astype(jnp.float32) + d_out.astype(jnp.float32)).astype(d_in.dtype)
    if norm is None:
        return d_in, None, None
    norm_type, _, zero_centered = norm
    return norm_backward(
        d_in.reshape(res.x.shape), res.x, res.mu, res.rsigma, res.gamma, norm_type=norm_type,
        zero_centered_gamma=zero_centered, implementation=setup.implementation("norm"),
    )  # fmt: skip


class _Config(NamedTuple):
    setup: core.Fp8Setup
    norm: tuple[str, float, bool] | None  # None: no norm
    has_bias: bool
    keep_ln: bool  # also return the norm's output (return_layernorm_output)
    grouped: bool  # kernel (hidden, g, N) kept 3-D (fp8jax.ops.gemms.fixed_groups), e.g. fused QKV
    dtype: Any
    dtypes: tuple[Any, ...]  # x, gamma, beta, kernel, bias


def _forward(cfg: _Config, x, gamma, beta, w, b, scale):
    s = cfg.setup
    ln_q, ln_t, ln_sinv, ln_amax, ln, norm_res = input_forward(
        s, x, gamma, beta, scale[0], cfg.norm, cfg.keep_ln
    )
    gemm = core.grouped_forward if cfg.grouped else core.gemm_forward
    y, w_amax, r = gemm(s, ln_q, ln_sinv, w, scale[1], b, cfg.dtype)
    seen = jnp.stack([ln_amax, w_amax, jnp.float32(jnp.nan)]).reshape(_N)
    res = (norm_res, ln_t, ln_sinv, r, scale[2], ln_amax, w_amax)
    return (y, ln, seen), res


def _backward(cfg: _Config, res, cts):
    s = cfg.setup
    norm_res, ln_t, ln_sinv, r, g_scale, ln_amax, w_amax = res
    x_dt, gamma_dt, beta_dt, w_dt, b_dt = cfg.dtypes
    dy = zeros_if_symbolic(cts[0])
    if cfg.grouped:
        g_q, g_t, g_sinv, g_amax, db = core.grouped_cast_grad(s, dy, g_scale, cfg.has_bias)
        dln, dw = core.grouped_backward(s, g_q, g_t, g_sinv, ln_t, ln_sinv, r, x_dt, w_dt)
    else:
        g_q, g_t, g_sinv, g_amax, db = core.cast_dbias(s, dy, g_scale, cfg.has_bias)
        g_q, g_t = core.codes(g_q), core.codes(g_t)
        dln, dw = core.gemm_backward(s, g_q, g_t, g_sinv, ln_t, ln_sinv, r, x_dt, w_dt)
    dx, dgamma, dbeta = input_backward(s, cfg.norm, norm_res, dln, cts[1] if cfg.keep_ln else None)
    grads = (
        dx.astype(x_dt),
        None if gamma_dt is None else dgamma.astype(gamma_dt),
        None if beta_dt is None else dbeta.astype(beta_dt),
        dw,
        None if b_dt is None else db.astype(b_dt),
    )
    return grads, jnp.stack([ln_amax, w_amax, g_amax]).reshape(_N)


_ln_dense2d = layer_vjp(_forward, _backward, "layernorm_dense")


def layernorm_dense(
    x: jax.Array,
    gamma: jax.Array | None,
    beta: jax.Array | None,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    fp8_meta: Fp8Meta | None = None,
    recipe: Recipe | None = None,
    *,
    probe: jax.Array | None = None,
    layernorm_type: str | None = "layernorm",
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    return_layernorm_output: bool = False,
    dtype: Any = None,
    enabled: bool | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``norm(x) @ kernel (+ bias)`` with the norm fused into the GEMM's FP8 input cast.

    The norm is over the last axis of ``x``, which is also the contracted axis; ``kernel`` is
    ``(hidden, *features)``. FP8 on/off and the recipe are decided as for
    :func:`fp8jax.dense`; with FP8 off this is the plain high-precision computation (the norm
    as ``flax.linen.LayerNorm``/``RMSNorm`` compute it).

    Args:
      x: ``[..., hidden]``; gamma, beta: ``(hidden,)`` (``beta=None`` for RMSNorm; both
        ``None`` with ``layernorm_type=None``, which casts ``x`` as it is: an FP8 dense).
      kernel: ``(hidden, *features)``; bias: ``features``.
      fp8_meta: 3-role :class:`~fp8jax.state.Fp8Meta` (input = the norm's output, kernel,
        output-grad), for delayed scaling. probe: zero ``float32[3]`` (see :func:`fp8jax.dense`).
      layernorm_type: ``"layernorm"``, ``"rmsnorm"`` or ``None``; epsilon;
        zero_centered_gamma: scale by ``1 + gamma``.
      return_layernorm_output: also return the norm's output (in ``x``'s dtype), e.g. for a
        residual connection after the norm; it is then differentiated too.
      dtype: the GEMM's output dtype (default: promoted from ``x`` and ``kernel``).

    Returns:
      ``[..., *features]``, and the norm's output when ``return_layernorm_output``.

    >>> import jax.numpy as jnp, fp8jax
    >>> x, w = jnp.arange(32.0).reshape(4, 8), jnp.full((8, 2), 0.25)
    >>> y = fp8jax.layernorm_dense(x, jnp.ones(8), jnp.zeros(8), w,
    ...                            recipe=fp8jax.Float8CurrentScaling())
    >>> y.shape
    (4, 2)
    """
    y, ln, _ = layernorm_dense_observed(
        x, gamma, beta, kernel, bias, fp8_meta, recipe, probe=probe,
        layernorm_type=layernorm_type, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma,
        return_layernorm_output=return_layernorm_output, dtype=dtype, enabled=enabled,
    )  # fmt: skip
    return (y, ln) if return_layernorm_output else y


def _check(x, gamma, beta, kernel, bias, norm, dtype):
    where = "layernorm_dense"
    for name, v in (("x", x), ("kernel", kernel)):
        if not hasattr(v, "dtype") or not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"{where}: {name} must be a floating-point array, got {v!r:.60}")
    if x.ndim < 1 or kernel.ndim < 2 or kernel.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{where}: kernel must have shape (hidden, *features) with hidden = x.shape[-1] = "
            f"{x.shape[-1] if x.ndim else None}, got {kernel.shape}"
        )
    if norm is None:
        if gamma is not None or beta is not None:
            raise ValueError(f"{where}: layernorm_type=None (no norm) takes no gamma or beta")
    else:
        check_norm_args(where, *norm)
        check_norm_params(where, norm[0], x.shape[-1], gamma, beta)
    if bias is not None and tuple(bias.shape) != tuple(kernel.shape[1:]):
        raise ValueError(f"{where}: bias must have shape {kernel.shape[1:]}, got {bias.shape}")
    if jnp.dtype(dtype) not in core.WIDE:
        raise TypeError(f"{where}: dtype must be float32, bfloat16 or float16, got {dtype!r}")


def layernorm_dense_observed(
    x, gamma, beta, kernel, bias, fp8_meta, recipe, *, probe, layernorm_type, epsilon,
    zero_centered_gamma, return_layernorm_output, dtype, enabled, where="fp8jax.layernorm_dense",
):  # fmt: skip
    """:func:`layernorm_dense` with its norm output and forward observations
    (:class:`~fp8jax.functional._core.LayerOutput`): what the Flax modules call."""
    norm = None if layernorm_type is None else (layernorm_type, epsilon, zero_centered_gamma)
    if dtype is None and hasattr(x, "dtype") and hasattr(kernel, "dtype"):
        dtype = jnp.result_type(x, kernel)
    _check(x, gamma, beta, kernel, bias, norm, dtype)
    dtype = jnp.dtype(dtype)
    lead, hidden, features = x.shape[:-1], x.shape[-1], kernel.shape[1:]
    setup, scale, probe = core.resolve(where, recipe, enabled, fp8_meta, probe, _N, ("norm",))
    m = int(np.prod(lead, dtype=np.int64))
    n = int(np.prod(features, dtype=np.int64))
    if setup is not None and below_fp8_flops([(m, n, hidden)]):
        setup = None  # too small for FP8 to pay (fp8jax.ops.gemm_options): the plain block
    if setup is None:
        ln = x.astype(dtype) if norm is None else flax_norm(x, gamma, beta, *norm, dtype=dtype)
        y = partition.dot_last(ln, kernel.astype(dtype))
        if bias is not None:
            y = y + bias.astype(dtype)
        return core.LayerOutput(y, ln.astype(x.dtype) if return_layernorm_output else None, None)
    if jnp.dtype(x.dtype) not in core.WIDE:
        x = x.astype(dtype)
    w = kernel if jnp.dtype(kernel.dtype) in core.WIDE else kernel.astype(dtype)
    # a (hidden, g, N) kernel (fused QKV: g = 3) keeps its group dim, so that a split of N
    # (tensor parallelism) needs no resharding; with delayed scaling and the kernel GEMM
    grouped = (
        kernel.ndim == 3
        and not setup.current_scaling
        and fixed_groups.usable(setup.implementation("gemm"))
    )
    b = None if bias is None else bias.astype(dtype)
    b = b if b is None or grouped else partition.reshape(b, (n,))
    cfg = _Config(
        setup=setup,
        norm=norm,
        has_bias=b is not None,
        keep_ln=bool(return_layernorm_output),
        grouped=grouped,
        dtype=dtype,
        dtypes=tuple(None if v is None else v.dtype for v in (x, gamma, beta, w, bias)),
    )
    # the norm takes x unflattened (see norm_fp8)
    x_in = x if norm is not None and x.ndim >= 2 else partition.reshape(x, (m, hidden))
    w = w if grouped else partition.reshape(w, (hidden, n))
    y2, ln2, seen = _ln_dense2d(cfg, (x_in, gamma, beta, w, b), scale, probe)
    ln = None if ln2 is None else partition.reshape(ln2, (*lead, hidden))
    return core.LayerOutput(partition.reshape(y2, (*lead, *features)), ln, seen)
