"""Activations of an MLP's first GEMM output, with their gradients and their FP8 forms.

Layout (the fused MLP's): the first GEMM's output ``x`` is viewed as ``[m, k, n]`` (tokens,
``k = len(activations)``, intermediate size). ``activations`` is one name, e.g. ``("gelu",)``,
for ``y = act(x[:, 0])``, or a gated pair whose second name is ``"linear"``, e.g.
``("silu", "linear")`` (SwiGLU), for ``y = act(x[:, 0]) * x[:, 1]``. Names:

* ``"gelu"``: the tanh approximation, ``jax.nn.gelu(approximate=True)`` (Flax's default);
* ``"gelu_exact"``: ``x * Phi(x)`` with the exact normal CDF, ``Phi(x) = erfc(-x / sqrt(2)) / 2``
  (erfc, not ``1 + erf``, which cancels for negative ``x``);
* ``"relu"``; ``"silu"`` (alias ``"swish"``): ``x * sigmoid(x)``; ``"linear"``: identity.

Numerics: every value is computed in float32 from the float32 inputs and rounded once to the
output dtype. The transcendental functions (tanh, erfc, exp) are each platform's own: the CPU
kernel uses the C library's, the CUDA kernel CUDA's, and the ``"xla"`` implementation XLA's, so
the implementations agree to a few float32 ulps (docs/numerics.md), not bit for bit. Within one
implementation the FP8 forms are exact: ``activation_cast_transpose``'s ``q`` is bit-identical
to ``quantize(activation(x), scale)`` and ``dactivation_cast_transpose_dbias``'s to
``quantize(dactivation(g, x), scale)`` (the high-precision value is rounded to its dtype first;
``amax`` is of that rounded value).

Sharding: rows (``m``) and columns (``n``) may be split over a mesh; the ``k`` dim is never split
(it is gathered first). ``amax`` is made global with one ``pmax``, ``dbias`` with one ``psum``
over the axes that split the rows.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.ops.base import checks, opdef
from fp8jax.ops.casts.cast_transpose import cast_transpose_reference, dbias_workspace
from fp8jax.ops.casts.quantize import quantize_reference

__all__ = [
    "activation",
    "activation_cast_transpose",
    "activation_cast_transpose_reference",
    "activation_reference",
    "dactivation",
    "dactivation_cast_transpose_dbias",
    "dactivation_cast_transpose_dbias_reference",
    "dactivation_reference",
]

# Name -> the kernels' activation code (the ``act`` FFI attribute; cpp/common/activations.h).
_CODES = {"linear": 0, "gelu": 1, "gelu_exact": 2, "relu": 3, "silu": 4}
_ALIASES = {"swish": "silu"}
ACTIVATIONS: tuple[str, ...] = ("gelu", "gelu_exact", "relu", "silu", "swish", "linear")
"""The accepted activation names (``"swish"`` is ``"silu"``)."""

_SQRT_2_OVER_PI = np.float32(math.sqrt(2.0 / math.pi))
_GELU_CUBIC = np.float32(0.044715)
_INV_SQRT_2 = np.float32(1.0 / math.sqrt(2.0))
_INV_SQRT_2PI = np.float32(1.0 / math.sqrt(2.0 * math.pi))


def activations_arg(op: str, activations: Any) -> tuple[str, ...]:
    """Normalises ``activations`` (aliases resolved) or raises ValueError naming it."""
    acts = (activations,) if isinstance(activations, str) else activations
    try:
        acts = tuple(acts)
    except TypeError:
        acts = None
    ok = acts is not None and all(isinstance(a, str) and a in ACTIVATIONS for a in acts)
    if ok:
        acts = tuple(_ALIASES.get(a, a) for a in acts)
        ok = len(acts) == 1 or (len(acts) == 2 and acts[1] == "linear" and acts[0] != "linear")
    if not ok:
        raise ValueError(
            f"{op}: activations must be one name, e.g. ('gelu',), or a gated pair whose second "
            f"is 'linear', e.g. ('silu', 'linear'); names: {', '.join(ACTIVATIONS)}; "
            f"got {activations!r}"
        )
    return acts


# ------------------------------------------------------------------ the float32 math


def act_f32(name: str, a: jax.Array) -> jax.Array:
    """``act(a)`` for float32 ``a`` (the order of operations is the kernels')."""
    if name == "gelu":
        inner = _SQRT_2_OVER_PI * (a + _GELU_CUBIC * (a * a * a))
        return 0.5 * a * (1.0 + jnp.tanh(inner))
    if name == "gelu_exact":
        return 0.5 * a * jax.lax.erfc(-a * _INV_SQRT_2)
    if name == "relu":
        return jnp.maximum(a, 0.0)
    if name == "silu":
        return a / (1.0 + jnp.exp(-a))
    return a


def dact_f32(name: str, a: jax.Array) -> jax.Array:
    """``act'(a)`` for float32 ``a``."""
    if name == "gelu":
        a2 = a * a
        t = jnp.tanh(_SQRT_2_OVER_PI * (a + _GELU_CUBIC * (a2 * a)))
        du = _SQRT_2_OVER_PI * (1.0 + (3.0 * _GELU_CUBIC) * a2)
        return 0.5 * (1.0 + t) + 0.5 * a * ((1.0 - t * t) * du)
    if name == "gelu_exact":
        cdf = 0.5 * jax.lax.erfc(-a * _INV_SQRT_2)
        return cdf + a * (_INV_SQRT_2PI * jnp.exp(-0.5 * (a * a)))
    if name == "relu":
        return jnp.where(a > 0.0, 1.0, 0.0).astype(jnp.float32)
    if name == "silu":
        s = 1.0 / (1.0 + jnp.exp(-a))
        return s * (1.0 + a * (1.0 - s))
    return jnp.ones_like(a)


def _halves(x: jax.Array, gated: bool) -> tuple[jax.Array, jax.Array | None]:
    a = x[..., 0, :].astype(jnp.float32)
    return a, (x[..., 1, :].astype(jnp.float32) if gated else None)


# ------------------------------------------------------------------ references


def activation_reference(x: jax.Array, activations: tuple[str, ...]) -> jax.Array:
    """Pure-jnp reference of :func:`activation`: ``act(x[..., 0, :])`` (times ``x[..., 1, :]``
    when gated), in float32, rounded once to ``x.dtype``."""
    a, b = _halves(x, len(activations) == 2)
    y = act_f32(activations[0], a)
    if b is not None:
        y = y * b
    return y.astype(x.dtype)


def dactivation_reference(g: jax.Array, x: jax.Array, activations: tuple[str, ...]) -> jax.Array:
    """Pure-jnp reference of :func:`dactivation`: ``[g * act'(a) * b, g * act(a)]`` (gated) or
    ``[g * act'(a)]``, stacked on the ``k`` axis, in float32, rounded once to ``g.dtype``."""
    a, b = _halves(x, len(activations) == 2)
    gf = g.astype(jnp.float32)
    da = gf * dact_f32(activations[0], a)
    if b is None:
        return da[..., None, :].astype(g.dtype)
    da = da * b
    db = gf * act_f32(activations[0], a)
    return jnp.stack([da, db], axis=-2).astype(g.dtype)


def activation_cast_transpose_reference(
    x: jax.Array, scale: jax.Array, fp8_dtype: Any, activations: tuple[str, ...]
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`activation_cast_transpose`: ``cast_transpose`` of
    :func:`activation_reference`."""
    return cast_transpose_reference(activation_reference(x, activations), scale, fp8_dtype)


def dactivation_cast_transpose_dbias_reference(
    g: jax.Array, x: jax.Array, scale: jax.Array, fp8_dtype: Any, activations: tuple[str, ...]
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`dactivation_cast_transpose_dbias`: ``dx`` =
    :func:`dactivation_reference` ``[m, k, n]``, quantized; ``q_t[k, n, m]`` its transpose as a
    ``[m, k * n]`` matrix; ``dbias`` the float32 sum of ``dx`` over ``m``."""
    dx = dactivation_reference(g, x, activations)
    q, scale_inv, amax = quantize_reference(dx, scale, fp8_dtype)
    q_t = jnp.moveaxis(q, -3, -1)
    dbias = jnp.sum(dx.astype(jnp.float32), axis=-3)
    return q, q_t, scale_inv, amax, dbias


# ------------------------------------------------------------------ op definitions


def activation_attrs(*, activations: tuple[str, ...], **_: Any) -> dict[str, Any]:
    return {"act": np.int64(_CODES[activations[0]]), "gated": np.int64(len(activations) == 2)}


def _x_out(x: jax.Array, dtype: Any) -> jax.ShapeDtypeStruct:
    """``[m, n]`` of ``x[m, k, n]``."""
    return opdef.like(x, dtype, dims=(-3, -1))


def _scalars(scale: jax.Array) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    return opdef.like(scale, jnp.float32), opdef.like(scale, jnp.float32)


_ACTIVATION = opdef.OpDef(
    name="activation",
    family="activation",
    target="fp8jax_activation",
    reference=activation_reference,
    outputs=lambda x, *, activations: (_x_out(x, x.dtype),),
    factors=lambda x_ndim: (["m a n"], ["m n"]),
    attrs=activation_attrs,
    need_replication=("a",),
)

_DACTIVATION = opdef.OpDef(
    name="dactivation",
    family="activation",
    target="fp8jax_dactivation",
    reference=dactivation_reference,
    outputs=lambda g, x, *, activations: (opdef.like(x, g.dtype),),
    factors=lambda g_ndim, x_ndim: (["m n", "m a n"], ["m a n"]),
    attrs=activation_attrs,
    need_replication=("a",),
)

_ACTIVATION_CAST_TRANSPOSE = opdef.OpDef(
    name="activation_cast_transpose",
    family="activation",
    target="fp8jax_activation_cast_transpose",
    reference=activation_cast_transpose_reference,
    outputs=lambda x, scale, *, fp8_dtype, activations: (
        _x_out(x, fp8_dtype),
        opdef.like(x, fp8_dtype, dims=(-1, -3)),
        *_scalars(scale),
    ),
    factors=lambda x_ndim, s_ndim: (
        ["m a n", "s" * s_ndim],
        ["m n", "n m", "s" * s_ndim, "s" * s_ndim],
    ),
    attrs=activation_attrs,
    max_over={3: 0},  # amax: the max over all of the activation, which is split like x
    need_replication=("a",),
)

_DACTIVATION_CAST_TRANSPOSE_DBIAS = opdef.OpDef(
    name="dactivation_cast_transpose_dbias",
    family="activation",
    target="fp8jax_dactivation_cast_transpose_dbias",
    reference=dactivation_cast_transpose_dbias_reference,
    outputs=lambda g, x, scale, *, fp8_dtype, activations: (
        opdef.like(x, fp8_dtype),
        opdef.like(x, fp8_dtype, dims=(-2, -1, -3)),
        *_scalars(scale),
        opdef.like(x, jnp.float32, dims=(-2, -1), core=3),
    ),
    factors=lambda g_ndim, x_ndim, s_ndim: (
        ["m n", "m a n", "s" * s_ndim],
        ["m a n", "a n m", "s" * s_ndim, "s" * s_ndim, "a n"],
    ),
    attrs=activation_attrs,
    max_over={3: 0},  # amax: the max over all of dx, which is split like g
    sum_over={4: 0},  # dbias: the sum over g's rows
    need_replication=("a",),
    workspace=lambda g, x, scale, *, fp8_dtype, activations: dbias_workspace(
        g, x.shape[-2] * x.shape[-1]
    ),
)


# ------------------------------------------------------------------ validation


def _x_arg(op: str, x: Any, acts: tuple[str, ...]) -> jax.Array:
    x = checks.wide_array(op, "x", x)
    if x.ndim != 3 or x.shape[1] != len(acts):
        raise ValueError(
            f"{op}: x must have shape [m, k, n] with k = len(activations) = {len(acts)}, "
            f"got shape {x.shape}"
        )
    return x


def gradient_arg(op: str, g: Any, x: jax.Array) -> jax.Array:
    g = checks.wide_array(op, "g", g)
    want = (x.shape[0], x.shape[2])
    if g.shape != want:
        raise ValueError(f"{op}: g must have shape [m, n] = {want} (from x), got {g.shape}")
    if g.dtype != x.dtype:
        raise TypeError(f"{op}: g and x must share a dtype, got {g.dtype} and {x.dtype}")
    return g


# ------------------------------------------------------------------ public ops


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _activation(x: jax.Array, acts: tuple[str, ...], impl: str | None) -> jax.Array:
    return _ACTIVATION(x, activations=acts, implementation=impl)[0]


def _activation_fwd(x, acts, impl):
    return _activation(x, acts, impl), x


def _activation_bwd(acts, impl, x, g):
    return (_DACTIVATION(g, x, activations=acts, implementation=impl)[0],)


_activation.defvjp(_activation_fwd, _activation_bwd)


def activation(x: jax.Array, activations: Any, *, implementation: str | None = None) -> jax.Array:
    """The activation ``y[m, n]`` of ``x[m, k, n]`` (module docstring); differentiable.

    Args:
      x: float32, bfloat16 or float16, shape ``[m, k, n]`` with ``k = len(activations)``.
      activations: e.g. ``("gelu",)`` or ``("silu", "linear")`` (see :data:`ACTIVATIONS`).
      implementation: ``"kernel"`` or ``"xla"`` (:func:`activation_reference` compiled by XLA);
        default: the enclosing :func:`fp8jax.ops.implementation` choice for ``"activation"``.

    Returns:
      ``y`` of shape ``[m, n]`` and ``x.dtype``. Its gradient is :func:`dactivation`.

    >>> import jax.numpy as jnp, fp8jax
    >>> x = jnp.array([[[-1.0, 0.0, 2.0]]])
    >>> fp8jax.ops.activation(x, ("relu",)).tolist()
    [[0.0, 0.0, 2.0]]
    """
    acts = activations_arg("activation", activations)
    return _activation(_x_arg("activation", x, acts), acts, implementation)


def dactivation(
    g: jax.Array, x: jax.Array, activations: Any, *, implementation: str | None = None
) -> jax.Array:
    """The gradient of :func:`activation` at ``x`` for the output gradient ``g``.

    Args:
      g: ``[m, n]``, the dtype of ``x``.
      x: ``[m, k, n]``, float32, bfloat16 or float16.
      activations: as for :func:`activation`.
      implementation: ``"kernel"`` or ``"xla"``, as for :func:`activation`.

    Returns:
      ``dx[m, k, n]`` in ``g.dtype``: ``g * act'(a)`` (non-gated) or
      ``[g * act'(a) * b, g * act(a)]`` (gated, ``a = x[:, 0]``, ``b = x[:, 1]``).
    """
    op = "dactivation"
    acts = activations_arg(op, activations)
    x = _x_arg(op, x, acts)
    g = gradient_arg(op, g, x)
    return _DACTIVATION(g, x, activations=acts, implementation=implementation)[0]


def activation_cast_transpose(
    x: jax.Array,
    scale: jax.Array,
    fp8_dtype: Any,
    activations: Any,
    *,
    amax_reduction: str = "split",
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The activation of ``x``, quantized, and its transpose: ``(q, q_t, scale_inv, amax)``.

    What feeds an MLP's second GEMM: ``q[m, n]`` for the forward, ``q_t[n, m]`` for its wgrad.
    ``q`` is bit-identical to ``quantize(activation(x), scale, fp8_dtype)[0]`` (the activation
    rounded to ``x.dtype`` first); ``amax`` is that rounded activation's.

    Args:
      x: ``[m, k, n]``, as for :func:`activation`.
      scale: float32, shape ``()`` or ``(1,)``.
      fp8_dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
      activations: as for :func:`activation`.
      amax_reduction: ``"split"`` or ``"mesh"``, as for :func:`~fp8jax.ops.quantize`.
      implementation: ``"kernel"`` or ``"xla"``, as for :func:`activation`.
    """
    op = "activation_cast_transpose"
    acts = activations_arg(op, activations)
    x = _x_arg(op, x, acts)
    scale = checks.scalar_f32(op, "scale", scale)
    dt = checks.fp8_dtype_arg(op, "fp8_dtype", fp8_dtype)
    reduction = checks.amax_reduction_arg(op, amax_reduction)
    q, q_t, scale_inv, amax = _ACTIVATION_CAST_TRANSPOSE(
        x,
        scale,
        fp8_dtype=dt,
        activations=acts,
        amax_reduction=reduction,
        implementation=implementation,
    )
    return q, q_t, scale_inv, amax


def dactivation_cast_transpose_dbias(
    g: jax.Array,
    x: jax.Array,
    scale: jax.Array,
    fp8_dtype: Any,
    activations: Any,
    *,
    amax_reduction: str = "split",
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The activation's gradient, quantized and transposed, with its column sums.

    What feeds an MLP's first GEMM's backward: ``q[m, k, n]`` (viewed ``[m, k * n]``) for its
    dgrad, ``q_t[k, n, m]`` (viewed ``[k * n, m]``) for its wgrad, ``dbias[k, n]`` for its
    bias gradient. ``q`` is bit-identical to ``quantize(dactivation(g, x), scale)[0]``;
    ``amax`` is that of ``dactivation(g, x)``; ``dbias`` is its float32 sum over ``m`` (the
    kernels' summation order is fixed, so repeated runs give the same bits).

    Args:
      g: ``[m, n]``, the dtype of ``x``.
      x: ``[m, k, n]``, as for :func:`activation`.
      scale, fp8_dtype, amax_reduction, implementation: as for
        :func:`activation_cast_transpose`.
      activations: as for :func:`activation`.

    Returns:
      ``(q, q_t, scale_inv, amax, dbias)``.
    """
    op = "dactivation_cast_transpose_dbias"
    acts = activations_arg(op, activations)
    x = _x_arg(op, x, acts)
    g = gradient_arg(op, g, x)
    scale = checks.scalar_f32(op, "scale", scale)
    dt = checks.fp8_dtype_arg(op, "fp8_dtype", fp8_dtype)
    reduction = checks.amax_reduction_arg(op, amax_reduction)
    q, q_t, scale_inv, amax, dbias = _DACTIVATION_CAST_TRANSPOSE_DBIAS(
        g,
        x,
        scale,
        fp8_dtype=dt,
        activations=acts,
        amax_reduction=reduction,
        implementation=implementation,
    )
    return q, q_t, scale_inv, amax, dbias
