"""The normalisation step of fp8jax's layers: argument checks, the high-precision form (Flax's
own formula, so that FP8-off layers equal their Flax twins bit for bit) and the FP8 form (one
fused kernel: norm, FP8 cast, transposed copy for the next GEMM's wgrad)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax._layer_core import Fp8Setup, block_norm_cast, cast_t, named_input
from fp8jax.autocast import is_fp8_enabled
from fp8jax.ops.fused.norm import norm_backward, norm_forward, norm_forward_fp8
from fp8jax.ops.fused.norm_autodiff import layernorm, rmsnorm

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
