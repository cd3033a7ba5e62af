"""LayerNorm and RMSNorm over the last axis, with an FP8 form that also casts the output.

Numerics (docs/numerics.md, "Norms"), per row ``x`` of ``h`` values, all in float32::

    layernorm: mu = mean(x), var = mean((x - mu)**2), rsigma = 1 / sqrt(var + epsilon),
               y = ((x - mu) * rsigma) * g + beta
    rmsnorm:   mu = 0,       rsigma = 1 / sqrt(mean(x**2) + epsilon),
               y = (x * rsigma) * g

where ``g = gamma`` or, with ``zero_centered_gamma``, ``g = 1 + gamma`` (a weight decayed towards
zero then means a scale near one). Means are two-pass: the sum of the row divided by ``h``, the
centred squares summed in a second pass (never ``E[x^2] - E[x]^2``, which cancels badly). ``y`` is
rounded once to ``x.dtype``. The kernels sum in another order than XLA does, so the ops match
their references within a tolerance of a few float32 ulps of the row's sums (stated in
tests/ops/test_norm.py), not bit for bit.

:func:`norm_forward_fp8` is exactly :func:`fp8jax.ops.quantize` of :func:`norm_forward`'s ``y``
(rounded to ``x.dtype`` first) under the same implementation, bit for bit, plus ``q``'s transpose
(what the next GEMM's weight gradient reads, K-major); one kernel writes both without ``y``
touching memory.

:func:`~fp8jax.ops.layernorm` and :func:`~fp8jax.ops.rmsnorm` (``norm_autodiff.py``) are these
ops made differentiable. :func:`norm_backward`'s ``dgamma`` and
``dbeta`` are column sums over the rows, computed in a fixed order (per-block partial sums, then
the blocks in order), so they are the same bits on every run whatever the thread count.

Ranks: the ops take ``x`` of rank >= 2, every leading dimension a dimension of rows (``y``,
``mu`` and ``rsigma`` come back in ``x``'s leading shape; ``q_t`` is ``[h, rows]`` of the
flattened rows). :func:`jax.vmap` adds batch dimensions of its own, each batch element its own
tensor (own ``gamma``, own ``scale`` and ``amax``).

Sharding: each leading dimension of rows may be split any way, independently (batch over one
mesh axis and sequence over another, as sequence parallelism does: the kernels see
``[batch, seq, h]`` unflattened, since flattening a sequence-split ``[batch, seq]`` would gather
it first); the hidden dimension ``h`` is never split (an operand split along it is gathered
first). ``mu`` and ``rsigma`` follow the rows, ``amax`` is made global with one ``pmax`` over the
axes that split ``x``, and ``dgamma``/``dbeta`` with one ``psum`` over the axes that split the
rows.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.ops.base import checks, opdef
from fp8jax.ops.casts.quantize import quantize_reference

__all__ = [
    "norm_backward",
    "norm_backward_reference",
    "norm_forward",
    "norm_forward_fp8",
    "norm_forward_fp8_reference",
    "norm_forward_reference",
]

NORM_TYPES: tuple[str, ...] = ("layernorm", "rmsnorm")
NORM_CODES = {"layernorm": 0, "rmsnorm": 1}  # the kernels' norm_type attribute

# ------------------------------------------------------------------------------- references


def _scale_of(gamma: jax.Array, zero_centered_gamma: bool) -> jax.Array:
    g = gamma.astype(jnp.float32)
    return g + 1.0 if zero_centered_gamma else g


def norm_forward_reference(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    *,
    norm_type: str,
    epsilon: float,
    zero_centered_gamma: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`norm_forward` over the last axis (any leading dims):
    ``(y in x.dtype, mu f32, rsigma f32)``, ``mu`` and ``rsigma`` of shape ``x.shape[:-1]``."""
    xf = x.astype(jnp.float32)
    h = x.shape[-1]
    if norm_type == "layernorm":
        mu = jnp.sum(xf, axis=-1) / np.float32(h)
        xc = xf - mu[..., None]
    else:
        mu = jnp.zeros(x.shape[:-1], jnp.float32)
        xc = xf
    var = jnp.sum(xc * xc, axis=-1) / np.float32(h)
    rsigma = 1.0 / jnp.sqrt(var + np.float32(epsilon))
    y = (xc * rsigma[..., None]) * _scale_of(gamma, zero_centered_gamma)
    if beta is not None:
        y = y + beta.astype(jnp.float32)
    return y.astype(x.dtype), mu, rsigma


def norm_forward_fp8_reference(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    scale: jax.Array,
    fp8_dtype: Any,
    *,
    norm_type: str,
    epsilon: float,
    zero_centered_gamma: bool = False,
) -> tuple[jax.Array, ...]:
    """Pure-jnp reference of :func:`norm_forward_fp8` for ``x`` ``[..., m, h]``:
    :func:`fp8jax.ops.quantize_reference` of :func:`norm_forward_reference`'s ``y``, and the
    transpose of ``q`` (last two dims)."""
    y, mu, rsigma = norm_forward_reference(
        x,
        gamma,
        beta,
        norm_type=norm_type,
        epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma,
    )
    q, scale_inv, amax = quantize_reference(y, scale, fp8_dtype)
    return q, jnp.swapaxes(q, -1, -2), scale_inv, amax, mu, rsigma


def norm_backward_reference(
    dy: jax.Array,
    x: jax.Array,
    mu: jax.Array,
    rsigma: jax.Array,
    gamma: jax.Array,
    *,
    norm_type: str,
    zero_centered_gamma: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`norm_backward` (the closed form of the forward's
    derivative), for ``dy``, ``x`` ``[..., m, h]``, ``mu``, ``rsigma`` ``[..., m]``, ``gamma``
    ``[..., h]``: ``(dx in dy.dtype, dgamma f32, dbeta f32)``, the sums over the rows ``m``.

    With ``xhat = (x - mu) * rsigma`` and ``dz = dy * g``::

        layernorm: dx = rsigma * (dz - mean(dz) - xhat * mean(dz * xhat))
        rmsnorm:   dx = rsigma * (dz - xhat * mean(dz * xhat))
        dgamma = sum_rows(dy * xhat), dbeta = sum_rows(dy) (zeros for rmsnorm)
    """
    h = x.shape[-1]
    dyf = dy.astype(jnp.float32)
    xf = x.astype(jnp.float32)
    rs = rsigma[..., None]
    xhat = (xf - mu[..., None]) * rs if norm_type == "layernorm" else xf * rs
    dz = dyf * _scale_of(gamma, zero_centered_gamma)[..., None, :]
    c2 = jnp.sum(dz * xhat, axis=-1, keepdims=True) / np.float32(h)
    if norm_type == "layernorm":
        c1 = jnp.sum(dz, axis=-1, keepdims=True) / np.float32(h)
        dx = rs * ((dz - c1) - xhat * c2)
        dbeta = jnp.sum(dyf, axis=-2)
    else:
        dx = rs * (dz - xhat * c2)
        dbeta = jnp.zeros(gamma.shape, jnp.float32)
    dgamma = jnp.sum(dyf * xhat, axis=-2)
    return dx.astype(dy.dtype), dgamma, dbeta


# ------------------------------------------------------------------------------- op definitions


def _attrs(*, epsilon: float, zero_centered_gamma: bool, **_: Any) -> dict[str, Any]:
    return {"epsilon": np.float32(epsilon), "zero_centered_gamma": np.int64(zero_centered_gamma)}


def per_row(x: jax.Array) -> jax.ShapeDtypeStruct:
    """The type of a float32 ``[..., m]`` output (``mu``, ``rsigma``) of ``x`` ``[..., m, h]``;
    under explicit sharding it carries ``x``'s sharding without the last dim."""
    sharding = jax.typeof(x).sharding
    axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    if not any(t == jax.sharding.AxisType.Explicit for t in axis_types):
        return jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)
    spec = (*sharding.spec, *(None,) * (x.ndim - len(sharding.spec)))
    rows = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[:-1]))
    return jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32, sharding=rows)


def _forward_outputs(x, gamma, *rest, **_):
    return opdef.like(x, x.dtype), per_row(x), per_row(x)


def _row_factors(ndim: int) -> str:
    """``x``'s dims of rows, one factor each: ``"r0 r1"`` for ``[batch, seq, h]``."""
    return opdef.lead(ndim - 1, "r")


def _transposed(q: jax.Array) -> jax.Array:
    """``q [*rows, h]`` -> ``[h, *rows]``: the bytes of ``[h, prod(rows)]``, the layout the
    kernels write."""
    return jnp.moveaxis(q, -1, 0)


def _fp8_outputs(x, gamma, *rest, fp8_dtype, **_):
    scale = rest[-1]
    n_rows = x.ndim - gamma.ndim  # x: [*vmap, *rows, h], gamma: [*vmap, h]
    return (
        opdef.like(x, fp8_dtype),
        # [*vmap, h, *rows]: per vmap element, the [h, prod(rows)] matrix the kernels write
        opdef.like(x, fp8_dtype, dims=(-1, *range(-n_rows - 1, -1)), core=n_rows + 1),
        opdef.like(scale, jnp.float32),
        opdef.like(scale, jnp.float32),
        per_row(x),
        per_row(x),
    )


def _forward_factors(params: list[str], ndim: int) -> tuple[list[str], list[str]]:
    r = _row_factors(ndim)
    ins = [p.replace("m", r) for p in params]
    return ins, [f"{r} h", r, r]


def _make_forward(norm_type: str) -> opdef.OpDef:
    with_beta = norm_type == "layernorm"
    params = ["m h", "h", "h"] if with_beta else ["m h", "h"]

    def reference(x, gamma, *beta, epsilon, zero_centered_gamma):
        return norm_forward_reference(
            x,
            gamma,
            beta[0] if beta else None,
            norm_type=norm_type,
            epsilon=epsilon,
            zero_centered_gamma=zero_centered_gamma,
        )

    return opdef.OpDef(
        name=f"{norm_type}_forward",
        family="norm",
        target=f"fp8jax_{norm_type}_forward",
        reference=reference,
        outputs=_forward_outputs,
        factors=lambda *ndims: _forward_factors(params, ndims[0]),
        attrs=_attrs,
        need_replication=("h",),
    )


def _make_forward_fp8(norm_type: str) -> opdef.OpDef:
    with_beta = norm_type == "layernorm"
    params = ["m h", "h", "h"] if with_beta else ["m h", "h"]

    def reference(x, gamma, *rest, fp8_dtype, epsilon, zero_centered_gamma):
        beta = rest[0] if with_beta else None
        q, _, sinv, amax, mu, rs = norm_forward_fp8_reference(
            x,
            gamma,
            beta,
            rest[-1],
            fp8_dtype,
            norm_type=norm_type,
            epsilon=epsilon,
            zero_centered_gamma=zero_centered_gamma,
        )
        return q, _transposed(q), sinv, amax, mu, rs

    def factors(*ndims):
        s, r = "s" * ndims[-1], _row_factors(ndims[0])
        ins = [p.replace("m", r) for p in params]
        return [*ins, s], [f"{r} h", f"h {r}", s, s, r, r]

    return opdef.OpDef(
        name=f"{norm_type}_forward_fp8",
        family="norm",
        target=f"fp8jax_{norm_type}_forward_fp8",
        reference=reference,
        outputs=_fp8_outputs,
        factors=factors,
        attrs=_attrs,
        max_over={3: 0},  # amax: the max over all of y, split like x
        need_replication=("h",),
    )


NORM_WORKSPACE_SLOTS = 256
"""Rows of the backward's workspace at least: per-block partial ``dgamma``/``dbeta`` rows that the
kernels add in a fixed order. See :func:`norm_workspace_slots`."""

NORM_ROWS_PER_SLOT = 16
"""Rows a partial row sums at most where the workspace cap allows (the backward's parallelism)."""

NORM_WORKSPACE_BYTES = 1 << 24
"""The workspace's float32 bytes at most (per vmap group), once it has more than 256 rows."""


def norm_workspace_slots(rows: int, h: int) -> int:
    """Rows of the norm backward's workspace for ``rows`` rows of ``h`` per vmap group.

    The kernels cut the rows into at most this many row groups, each summing its rows into one
    partial ``dgamma``/``dbeta`` row, and add the partials in order. The count depends only on the
    shapes, never on the device, so the sums are the same on every GPU; it is an output of the
    custom call, so that XLA owns the memory and the CUDA handler stays CUDA-graph compatible (the
    public function drops it). At least 256 (enough blocks for short inputs), about one per 16 rows
    for long ones (so that a 16,384-row backward fills an H100), at most 4,096 and at most
    16 MiB of float32.

    >>> norm_workspace_slots(16384, 1024)
    1024
    """
    cap = min(4096, max(NORM_WORKSPACE_SLOTS, NORM_WORKSPACE_BYTES // (8 * max(int(h), 1))))
    return max(1, min(cap, max(NORM_WORKSPACE_SLOTS, -(-int(rows) // NORM_ROWS_PER_SLOT))))


def _workspace(gamma: Any, slots: int) -> jax.ShapeDtypeStruct:
    return opdef.like(gamma, jnp.float32, shape=(*gamma.shape[:-1], slots, 2, gamma.shape[-1]))


def _backward_reference(
    dy, x, mu, rsigma, gamma, *, norm_type, zero_centered_gamma, workspace_slots
):
    h = x.shape[-1]
    dx, dgamma, dbeta = norm_backward_reference(
        dy.reshape(-1, h), x.reshape(-1, h), mu.reshape(-1), rsigma.reshape(-1), gamma,
        norm_type=norm_type, zero_centered_gamma=zero_centered_gamma,
    )  # fmt: skip
    dx = dx.reshape(x.shape)
    workspace = jnp.zeros(_workspace(gamma, workspace_slots).shape)
    return dx, dgamma, dbeta, workspace  # XLA drops the unused zeros


def _backward_factors(r: str) -> tuple[list[str], list[str]]:
    return [f"{r} h", f"{r} h", r, r, "h"], [f"{r} h", "h", "h", "w t h"]


_FORWARD = {t: _make_forward(t) for t in NORM_TYPES}
_FORWARD_FP8 = {t: _make_forward_fp8(t) for t in NORM_TYPES}
_BACKWARD = opdef.OpDef(
    name="norm_backward",
    family="norm",
    target="fp8jax_norm_backward",
    reference=_backward_reference,
    outputs=lambda dy, x, mu, rsigma, gamma, *, workspace_slots, **_: (
        opdef.like(dy, dy.dtype),
        opdef.like(gamma, jnp.float32),
        opdef.like(gamma, jnp.float32),
        _workspace(gamma, workspace_slots),
    ),
    # The workspace's slot and pair dims are factors of their own (never split).
    factors=lambda *ndims: _backward_factors(_row_factors(ndims[0])),
    attrs=lambda *, norm_type, zero_centered_gamma, workspace_slots: {
        "norm_type": np.int64(NORM_CODES[norm_type]),
        "zero_centered_gamma": np.int64(zero_centered_gamma),
    },
    sum_over={1: 0, 2: 0},  # dgamma, dbeta: sums of dy's rows, psum-ed over the row split
    need_replication=("h",),
)

# ------------------------------------------------------------------------------- validation


def norm_type_arg(op: str, norm_type: Any) -> str:
    if not isinstance(norm_type, str) or norm_type not in NORM_TYPES:
        raise ValueError(f"{op}: norm_type must be 'layernorm' or 'rmsnorm', got {norm_type!r}")
    return norm_type


def epsilon_arg(op: str, epsilon: Any) -> float:
    try:
        eps = float(epsilon)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{op}: epsilon must be a float, got {epsilon!r}") from e
    if isinstance(epsilon, bool) or not math.isfinite(eps) or eps <= 0.0:
        raise ValueError(f"{op}: epsilon must be a finite float > 0, got {epsilon!r}")
    return eps


def matrix_arg(op: str, name: str, x: Any) -> jax.Array:
    x = checks.wide_array(op, name, x)
    if x.ndim < 2:
        raise ValueError(f"{op}: {name} must have rank >= 2 ([rows, hidden]), got {x.shape}")
    if x.shape[-1] < 1:
        raise ValueError(f"{op}: {name} must have a non-empty last (hidden) dim, got {x.shape}")
    return x


def _vector_arg(op: str, name: str, v: Any, h: int) -> jax.Array:
    v = checks.wide_array(op, name, v)
    if v.shape != (h,):
        raise ValueError(f"{op}: {name} must have shape ({h},) (x's last dim), got {v.shape}")
    return v


def params_args(
    op: str, norm_type: str, x: jax.Array, gamma: Any, beta: Any
) -> tuple[jax.Array, jax.Array | None]:
    h = x.shape[-1]
    gamma = _vector_arg(op, "gamma", gamma, h)
    if norm_type == "rmsnorm":
        if beta is not None:
            raise ValueError(f"{op}: beta must be None for norm_type='rmsnorm' (it has no bias)")
        return gamma, None
    if beta is None:
        raise ValueError(f"{op}: beta is required for norm_type='layernorm'")
    return gamma, _vector_arg(op, "beta", beta, h)


# ------------------------------------------------------------------------------- public ops


def norm_forward(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    *,
    norm_type: str,
    epsilon: float,
    zero_centered_gamma: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normalises ``x`` over its last axis; returns ``(y, mu, rsigma)``.

    Args:
      x: float32, bfloat16 or float16 ``[m, h]`` (rank > 2: the leading dims are rows).
      gamma: ``[h]``, any of those dtypes (used in float32).
      beta: ``[h]`` for ``"layernorm"``; must be ``None`` for ``"rmsnorm"``.
      norm_type: ``"layernorm"`` or ``"rmsnorm"``.
      epsilon: float > 0, added to the variance (mean square for rmsnorm).
      zero_centered_gamma: scale by ``1 + gamma`` instead of ``gamma``.
      implementation: ``"kernel"`` or ``"xla"`` (:func:`norm_forward_reference` compiled by
        XLA); default: the enclosing :func:`fp8jax.ops.implementation` choice for ``"norm"``.

    Returns:
      ``y`` (``x.shape``, ``x.dtype``), float32 ``mu`` (zeros for rmsnorm) and ``rsigma``, both
      ``x.shape[:-1]``.

    >>> import jax.numpy as jnp, fp8jax
    >>> y, mu, rs = fp8jax.ops.norm_forward(jnp.array([[1.0, 3.0]]), jnp.ones(2), jnp.zeros(2),
    ...                                     norm_type="layernorm", epsilon=1e-6)
    >>> y.round(3).tolist(), mu.tolist()
    ([[-1.0, 1.0]], [2.0])
    """
    op = "norm_forward"
    norm_type = norm_type_arg(op, norm_type)
    x = matrix_arg(op, "x", x)
    gamma, beta = params_args(op, norm_type, x, gamma, beta)
    eps = epsilon_arg(op, epsilon)
    params = (gamma,) if beta is None else (gamma, beta)
    y, mu, rs = _FORWARD[norm_type](
        x,
        *params,
        epsilon=eps,
        zero_centered_gamma=bool(zero_centered_gamma),
        implementation=implementation,
    )
    return y, mu, rs


def norm_forward_fp8(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    scale: jax.Array,
    fp8_dtype: Any,
    *,
    norm_type: str,
    epsilon: float,
    zero_centered_gamma: bool = False,
    amax_reduction: str = "split",
    implementation: str | None = None,
) -> tuple[jax.Array, ...]:
    """:func:`norm_forward` fused with the FP8 cast of ``y`` and its transpose.

    Returns ``(q, q_t, scale_inv, amax, mu, rsigma)``: ``q, scale_inv, amax`` are exactly
    ``fp8jax.ops.quantize(norm_forward(x, ...)[0], scale, fp8_dtype)`` of the same
    implementation (``y`` rounded to ``x.dtype`` first; ``amax`` of that rounded ``y``), ``q_t``
    is ``q``'s transpose ``[h, m]`` (the flattened rows, for rank > 2), ``mu`` and ``rsigma`` as
    :func:`norm_forward`'s. ``y`` itself is never written.

    Args:
      x, gamma, beta, norm_type, epsilon, zero_centered_gamma: as for :func:`norm_forward`.
      scale: float32, shape ``()`` or ``(1,)``.
      fp8_dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
      amax_reduction: ``"split"`` or ``"mesh"``, as for :func:`fp8jax.ops.quantize`.
      implementation: ``"kernel"`` or ``"xla"``, as for :func:`norm_forward`.
    """
    op = "norm_forward_fp8"
    norm_type = norm_type_arg(op, norm_type)
    x = matrix_arg(op, "x", x)
    gamma, beta = params_args(op, norm_type, x, gamma, beta)
    eps = epsilon_arg(op, epsilon)
    scale = checks.scalar_f32(op, "scale", scale)
    dt = checks.fp8_dtype_arg(op, "fp8_dtype", fp8_dtype)
    reduction = checks.amax_reduction_arg(op, amax_reduction)
    params = (gamma,) if beta is None else (gamma, beta)
    q, q_t, scale_inv, amax, mu, rs = _FORWARD_FP8[norm_type](
        x,
        *params,
        scale,
        fp8_dtype=dt,
        epsilon=eps,
        zero_centered_gamma=bool(zero_centered_gamma),
        amax_reduction=reduction,
        implementation=implementation,
    )
    return q, q_t.reshape(x.shape[-1], math.prod(x.shape[:-1])), scale_inv, amax, mu, rs


def norm_backward(
    dy: jax.Array,
    x: jax.Array,
    mu: jax.Array,
    rsigma: jax.Array,
    gamma: jax.Array,
    *,
    norm_type: str,
    zero_centered_gamma: bool = False,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The backward pass of :func:`norm_forward`; returns ``(dx, dgamma, dbeta)``.

    Args:
      dy: the gradient of ``y``, ``x.shape``, float32, bfloat16 or float16 (usually ``x``'s
        dtype; another one is fine: both are then widened to float32 for the kernel).
      x: the forward's input (rank > 2: the leading dims are rows).
      mu, rsigma: :func:`norm_forward`'s outputs, float32 ``x.shape[:-1]``.
      gamma: ``[h]``, as given to the forward.
      norm_type, zero_centered_gamma, implementation: as for :func:`norm_forward`.

    Returns:
      ``dx`` (``x.shape``, ``dy.dtype``), float32 ``dgamma`` and ``dbeta`` ``[h]`` (``dbeta``
      zeros for rmsnorm): sums over all rows, in a fixed order (the same bits every run).
    """
    op = "norm_backward"
    norm_type = norm_type_arg(op, norm_type)
    x = matrix_arg(op, "x", x)
    dy = matrix_arg(op, "dy", dy)
    if dy.shape != x.shape:
        raise ValueError(f"{op}: dy must have x's shape {x.shape}, got {dy.shape}")
    lead = x.shape[:-1]
    for name, v in (("mu", mu), ("rsigma", rsigma)):
        v = checks.array_arg(op, name, v)
        if v.dtype != jnp.float32 or v.shape != lead:
            raise ValueError(
                f"{op}: {name} must be float32 of shape {lead}, got {v.dtype}{list(v.shape)}"
            )
    gamma = _vector_arg(op, "gamma", gamma, x.shape[-1])
    # The kernels take dy and x in one dtype: a mixed pair is widened (exactly) to float32,
    # and dx rounded once to dy's dtype, as the reference does.
    common = x.dtype if dy.dtype == x.dtype else jnp.dtype(jnp.float32)
    dx, dgamma, dbeta, _ = _BACKWARD(
        dy.astype(common),
        x.astype(common),
        mu,
        rsigma,
        gamma,
        norm_type=norm_type,
        zero_centered_gamma=bool(zero_centered_gamma),
        # From the whole call's shape: every shard of a split call gets the same workspace.
        workspace_slots=norm_workspace_slots(math.prod(lead), x.shape[-1]),
        implementation=implementation,
    )
    return dx.astype(dy.dtype), dgamma, dbeta
