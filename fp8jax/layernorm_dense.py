"""``fp8jax.layernorm_dense``: a norm followed by an FP8 dense layer, as one ``jax.custom_vjp``.

The norm is fused with the FP8 cast of its output (and the transposed copy the wgrad GEMM
reads), so the normalised activations never exist in high precision in memory unless asked for
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

from fp8jax import _layer_core as core
from fp8jax._norm_layer import (
    check_norm_args,
    check_norm_params,
    flax_norm,
    input_backward,
    input_forward,
)
from fp8jax.ops.gemms import fixed_groups
from fp8jax.ops.gemms.gemm_options import below_fp8_flops
from fp8jax.recipe import Recipe
from fp8jax.state import DENSE_ROLES, Fp8Meta

__all__ = ["layernorm_dense"]

_N = len(DENSE_ROLES)


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
    dy = core.zeros_if_symbolic(cts[0])
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


_ln_dense2d = core.layer_vjp(_forward, _backward, "layernorm_dense")


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
    (:class:`~fp8jax._layer_core.LayerOutput`): what the Flax modules call."""
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
        y = jax.lax.dot_general(ln, kernel.astype(dtype), (((ln.ndim - 1,), (0,)), ((), ())))
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
    b = b if b is None or grouped else b.reshape(n)
    cfg = _Config(
        setup=setup,
        norm=norm,
        has_bias=b is not None,
        keep_ln=bool(return_layernorm_output),
        grouped=grouped,
        dtype=dtype,
        dtypes=tuple(None if v is None else v.dtype for v in (x, gamma, beta, w, bias)),
    )
    # the norm takes x unflattened (see fp8jax._norm_layer.norm_fp8)
    x_in = x if norm is not None and x.ndim >= 2 else x.reshape(m, hidden)
    w = w if grouped else w.reshape(hidden, n)
    y2, ln2, seen = _ln_dense2d(cfg, (x_in, gamma, beta, w, b), scale, probe)
    ln = None if ln2 is None else ln2.reshape(*lead, hidden)
    return core.LayerOutput(y2.reshape(*lead, *features), ln, seen)
