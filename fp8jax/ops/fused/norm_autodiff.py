"""Differentiable LayerNorm and RMSNorm: :func:`jax.custom_vjp` over the norm ops.

The forward is :func:`~fp8jax.ops.norm_forward`, which also returns the row statistics the
backward reads (``mu``, ``rsigma``: one float each per row, saved instead of ``y``), and the
backward :func:`~fp8jax.ops.norm_backward`; both run the implementation chosen when the function
is called. Numerics, ranks and sharding are the ops' (``norm.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp8jax.ops.base import switch
from fp8jax.ops.fused.norm import (
    epsilon_arg,
    matrix_arg,
    norm_backward,
    norm_forward,
    norm_type_arg,
    params_args,
)

__all__ = ["layernorm", "rmsnorm"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _norm(x, gamma, beta, cfg):
    return _norm_fwd(x, gamma, beta, cfg)[0]


def _norm_fwd(x, gamma, beta, cfg):
    norm_type, epsilon, zero_centered_gamma, impl, _ = cfg
    y, mu, rsigma = norm_forward(
        x,
        gamma,
        beta,
        norm_type=norm_type,
        epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma,
        implementation=impl,
    )
    return y, (x, mu, rsigma, gamma)


def _norm_bwd(cfg, residuals, dy):
    norm_type, _, zero_centered_gamma, impl, beta_dtype = cfg
    x, mu, rsigma, gamma = residuals
    dx, dgamma, dbeta = norm_backward(
        dy,
        x,
        mu,
        rsigma,
        gamma,
        norm_type=norm_type,
        zero_centered_gamma=zero_centered_gamma,
        implementation=impl,
    )
    dbeta = None if beta_dtype is None else dbeta.astype(beta_dtype)
    return dx.astype(x.dtype), dgamma.astype(gamma.dtype), dbeta


_norm.defvjp(_norm_fwd, _norm_bwd)


def _differentiable(op, norm_type, x, gamma, beta, epsilon, zero_centered_gamma, implementation):
    norm_type = norm_type_arg(op, norm_type)
    x = matrix_arg(op, "x", x)
    gamma, beta = params_args(op, norm_type, x, gamma, beta)
    eps = epsilon_arg(op, epsilon)
    impl = switch.choose(op, "norm", implementation)
    beta_dtype = None if beta is None else jnp.dtype(beta.dtype).name  # dbeta comes back in it
    return _norm(x, gamma, beta, (norm_type, eps, bool(zero_centered_gamma), impl, beta_dtype))


def layernorm(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array,
    *,
    epsilon: float,
    zero_centered_gamma: bool = False,
    implementation: str | None = None,
) -> jax.Array:
    """Differentiable LayerNorm over the last axis of ``x`` (rank >= 2); returns ``y``.

    The forward is :func:`norm_forward` (``norm_type="layernorm"``), the backward
    :func:`norm_backward`; the gradients of ``x``, ``gamma`` and ``beta`` come back in their
    dtypes. ``implementation`` (``"kernel"``/``"xla"``) is
    resolved when this is called and used by both passes.
    """
    return _differentiable(
        "layernorm", "layernorm", x, gamma, beta, epsilon, zero_centered_gamma, implementation
    )


def rmsnorm(
    x: jax.Array,
    gamma: jax.Array,
    *,
    epsilon: float,
    zero_centered_gamma: bool = False,
    implementation: str | None = None,
) -> jax.Array:
    """Differentiable RMSNorm over the last axis of ``x`` (rank >= 2); returns ``y``.

    As :func:`layernorm`, with ``norm_type="rmsnorm"`` (no bias).
    """
    return _differentiable(
        "rmsnorm", "rmsnorm", x, gamma, None, epsilon, zero_centered_gamma, implementation
    )
