"""``fp8jax.layernorm_mlp``: a Transformer MLP block in FP8 as one ``jax.custom_vjp``.

Forward: norm of ``x`` fused with its FP8 cast (and the transposed copy the first GEMM's wgrad
reads) -> GEMM1 (+bias, in the GEMM's epilogue) -> activation fused with its FP8 cast -> GEMM2
(+bias). Backward: the output gradient's cast fused with the second bias gradient; dgrad and
wgrad of GEMM2; the activation's gradient fused with its FP8 cast and the first bias gradient;
dgrad and wgrad of GEMM1; the norm's backward. Every GEMM is FP8 both ways, and no tensor makes a
high-precision round trip through memory between the norm and the second GEMM.

What the backward keeps: ``x`` and the norm's statistics (for the norm's backward), the FP8
transposed norm output and activation output (the wgrads), the kernels in FP8, and GEMM1's
output (the activation's input). The six roles of the FP8 state are
``gemm_roles("fc1", "fc2")``: input, kernel and output-grad of each GEMM, as in
:func:`fp8jax.dense`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fp8jax import _fp8_gemm as g8
from fp8jax._norm_layer import check_norm_args, check_norm_params, flax_norm, norm_fp8
from fp8jax.ops.activation import (
    activation,
    activation_cast_transpose,
    dactivation,
    dactivation_cast_transpose_dbias,
)
from fp8jax.ops.cast_transpose import cast_transpose_dbias
from fp8jax.ops.norm import norm_backward
from fp8jax.recipe import Recipe
from fp8jax.state import Fp8Meta, gemm_roles

__all__ = ["MLP_ROLES", "layernorm_mlp"]

#: The FP8 state rows of :func:`layernorm_mlp` (and ``fp8jax.flax.LayerNormMLP``).
MLP_ROLES: tuple[str, ...] = gemm_roles("fc1", "fc2")
_N = len(MLP_ROLES)


class _Config(NamedTuple):
    setup: g8.Fp8Setup
    norm: tuple[str, float, bool]  # norm_type, epsilon, zero_centered_gamma
    activations: tuple[str, ...]
    has_bias: tuple[bool, bool]
    dtype: Any  # dtype of the GEMMs' outputs (the activation's input and the result)
    # dtypes of (x, gamma, beta, w1, b1, w2, b2): each gradient is returned in its primal's
    dtypes: tuple[Any, ...]
    has_mask: bool


def cast_dbias(setup: g8.Fp8Setup, g: jax.Array, scale: jax.Array, with_bias: bool):
    """An output gradient cast to the backward format, with its column sums when the layer has
    a bias: ``(q, q_t, scale_inv, amax, dbias or None)`` (one pass over ``g``)."""
    bwd = setup.bwd_dtype
    if not with_bias:
        return (*g8.cast_t(setup, g, scale, bwd), None)
    scale = g8.scale_for(setup, g, scale, bwd)
    return cast_transpose_dbias(
        g, scale, bwd, amax_reduction="mesh", implementation=setup.implementation("cast")
    )


def _activation_fp8(cfg: _Config, h: jax.Array, scale: jax.Array, mask: jax.Array | None):
    """The activation of ``h`` [M, k, I] cast to FP8: ``(q [M, I], q_t [I, M], sinv, amax)``."""
    s = cfg.setup
    impl = s.implementation("activation")
    if s.current_scaling or mask is not None:
        a = activation(h, cfg.activations, implementation=impl)
        if mask is not None:
            a = (a * mask).astype(a.dtype)
        return g8.cast_t(s, a, scale, s.fwd_dtype)
    return activation_cast_transpose(
        h, scale, s.fwd_dtype, cfg.activations, amax_reduction="mesh", implementation=impl
    )


def _dactivation_fp8(cfg: _Config, da: jax.Array, h: jax.Array, scale: jax.Array):
    """The activation's gradient cast to FP8, 2-D: ``(q [M, k I], q_t [k I, M], sinv, amax,
    dbias float32[k I])``."""
    s = cfg.setup
    m, k, i = h.shape
    impl = s.implementation("activation")
    if s.current_scaling:
        dh = dactivation(da, h, cfg.activations, implementation=impl).reshape(m, k * i)
        return cast_dbias(s, dh, scale, True)
    q, q_t, sinv, amax, dbias = dactivation_cast_transpose_dbias(
        da, h, scale, s.bwd_dtype, cfg.activations, amax_reduction="mesh", implementation=impl
    )
    return q.reshape(m, k * i), q_t.reshape(k * i, m), sinv, amax, dbias.reshape(k * i)


def _forward(cfg: _Config, x, gamma, beta, w1, b1, w2, b2, scale, mask):
    s = cfg.setup
    m = x.shape[0]
    k = len(cfg.activations)
    ln_q, ln_t, ln_sinv, ln_amax, mu, rsigma, _ = norm_fp8(s, x, gamma, beta, scale[0], cfg.norm)
    ln_q, ln_t = g8.named(g8.codes(ln_q), 2), g8.named(g8.codes(ln_t), 0)
    ln_sinv, ln_amax = g8.named(ln_sinv, 4), g8.named(ln_amax, 5)
    h, w1_amax, r1 = g8.gemm_forward(s, ln_q, ln_sinv, w1, scale[1], b1, cfg.dtype)
    h = h.reshape(m, k, -1)
    a_q, a_t, a_sinv, a_amax = _activation_fp8(cfg, h, scale[3], mask)
    a_q, a_t = g8.named(g8.codes(a_q), 2), g8.named(g8.codes(a_t), 0)
    a_sinv, a_amax = g8.named(a_sinv, 4), g8.named(a_amax, 5)
    y, w2_amax, r2 = g8.gemm_forward(s, a_q, a_sinv, w2, scale[4], b2, cfg.dtype)
    nan = jnp.float32(jnp.nan)  # the output-grad roles: not observed by the forward
    seen = jnp.stack([ln_amax, w1_amax, nan, a_amax, w2_amax, nan]).reshape(_N)
    fwd_seen = jnp.stack([ln_amax, w1_amax, a_amax, w2_amax]).reshape(4)
    res = (x, gamma, mu, rsigma, ln_t, ln_sinv, r1, h, a_t, a_sinv, r2, scale, fwd_seen, mask)
    return (y, seen), res


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mlp2d(cfg: _Config, x, gamma, beta, w1, b1, w2, b2, scale, probe, mask):
    del probe
    out, _ = _forward(cfg, x, gamma, beta, w1, b1, w2, b2, scale, mask)
    return out


def _mlp2d_fwd(cfg: _Config, x, gamma, beta, w1, b1, w2, b2, scale, probe, mask):
    params = (x, gamma, beta, w1, b1, w2, b2)
    if not cfg.setup.current_scaling and not probe.perturbed and g8.perturbed(params):
        raise g8.probe_error(cfg.setup.where)
    args = jax.tree.map(lambda p: p.value, (*params, scale, mask))
    return _forward(cfg, *args)


def _mlp2d_bwd(cfg: _Config, res, cts):
    s = cfg.setup
    x, gamma, mu, rsigma, ln_t, ln_sinv, r1, h, a_t, a_sinv, r2, scale, fwd_seen, mask = res
    x_dt, gamma_dt, beta_dt, w1_dt, b1_dt, w2_dt, b2_dt = cfg.dtypes
    dy = g8.zeros_if_symbolic(cts[0])
    dy_q, dy_t, dy_sinv, dy_amax, db2 = cast_dbias(s, dy, scale[5], cfg.has_bias[1])
    dy_q, dy_t = g8.codes(dy_q), g8.codes(dy_t)
    da, dw2 = g8.gemm_backward(s, dy_q, dy_t, dy_sinv, a_t, a_sinv, r2, cfg.dtype, w2_dt)
    if mask is not None:
        da = (da * mask).astype(da.dtype)
    dh_q, dh_t, dh_sinv, dh_amax, db1 = _dactivation_fp8(cfg, da, h, scale[2])
    dh_q, dh_t = g8.codes(dh_q), g8.codes(dh_t)
    dln, dw1 = g8.gemm_backward(s, dh_q, dh_t, dh_sinv, ln_t, ln_sinv, r1, x_dt, w1_dt)
    norm_type, _, zero_centered = cfg.norm
    dx, dgamma, dbeta = norm_backward(
        dln, x, mu, rsigma, gamma, norm_type=norm_type, zero_centered_gamma=zero_centered,
        implementation=s.implementation("norm"),
    )  # fmt: skip
    ln_amax, w1_amax, a_amax, w2_amax = (fwd_seen[i] for i in range(4))
    observed = jnp.stack([ln_amax, w1_amax, dh_amax, a_amax, w2_amax, dy_amax]).reshape(_N)
    grads = (
        dx.astype(x_dt),
        dgamma.astype(gamma_dt),
        None if beta_dt is None else dbeta.astype(beta_dt),
        dw1,
        db1.astype(b1_dt) if cfg.has_bias[0] else None,
        dw2,
        db2.astype(b2_dt) if cfg.has_bias[1] else None,
    )
    dmask = None if mask is None else jnp.zeros_like(mask)
    return (*grads, jnp.zeros((_N,), jnp.float32), observed, dmask)


_mlp2d.defvjp(_mlp2d_fwd, _mlp2d_bwd, symbolic_zeros=True)


def _check(x, gamma, beta, kernel_1, bias_1, kernel_2, bias_2, norm, activations, dtype):
    where = "layernorm_mlp"
    for name, v in (("x", x), ("kernel_1", kernel_1), ("kernel_2", kernel_2)):
        if not hasattr(v, "dtype") or not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"{where}: {name} must be a floating-point array, got {v!r:.60}")
    if x.ndim < 1:
        raise ValueError(f"{where}: x must have a hidden (last) dim, got shape {x.shape}")
    check_norm_args(where, *norm)
    check_norm_params(where, norm[0], x.shape[-1], gamma, beta)
    acts = check_activations(where, activations)
    hidden, k = x.shape[-1], len(acts)
    if kernel_1.ndim != 3 or kernel_1.shape[:2] != (hidden, k):
        raise ValueError(
            f"{where}: kernel_1 must have shape (hidden={hidden}, len(activations)={k}, "
            f"intermediate), got {kernel_1.shape}"
        )
    inter = kernel_1.shape[2]
    if kernel_2.ndim != 2 or kernel_2.shape[0] != inter:
        raise ValueError(
            f"{where}: kernel_2 must have shape (intermediate={inter}, out_features), got "
            f"{kernel_2.shape}"
        )
    for name, v, want in (("bias_1", bias_1, (k, inter)), ("bias_2", bias_2, kernel_2.shape[1:])):
        if v is not None and tuple(v.shape) != tuple(want):
            raise ValueError(f"{where}: {name} must have shape {want}, got {tuple(v.shape)}")
    if jnp.dtype(dtype) not in g8.WIDE:
        raise TypeError(f"{where}: dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return acts


def layernorm_mlp(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    kernel_1: jax.Array,
    kernel_2: jax.Array,
    bias_1: jax.Array | None = None,
    bias_2: jax.Array | None = None,
    fp8_meta: Fp8Meta | None = None,
    recipe: Recipe | None = None,
    *,
    probe: jax.Array | None = None,
    layernorm_type: str = "layernorm",
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    activations: Sequence[str] = ("gelu",),
    dropout_mask: jax.Array | None = None,
    dtype: Any = None,
    enabled: bool | None = None,
) -> jax.Array:
    """``norm(x) -> GEMM1 (+bias_1) -> activation -> GEMM2 (+bias_2)``, in FP8.

    The norm is over the last axis of ``x``; ``kernel_1`` is ``(hidden, len(activations),
    intermediate)`` as in TransformerEngine's ``LayerNormMLP`` (gated pairs such as
    ``("silu", "linear")`` multiply ``act(x @ kernel_1[:, 0]) * (x @ kernel_1[:, 1])``).
    FP8 on/off and the recipe are decided as for :func:`fp8jax.dense`. With FP8 off this is the
    plain high-precision block (the norm computed as ``flax.linen.LayerNorm`` does).

    Args:
      x: input ``[..., hidden]``, float32/bfloat16/float16.
      gamma, beta: the norm's scale and bias, ``(hidden,)``; ``beta`` is ``None`` for RMSNorm.
      kernel_1: ``(hidden, len(activations), intermediate)``; kernel_2: ``(intermediate,
        out_features)``; bias_1: ``(len(activations), intermediate)``; bias_2:
        ``(out_features,)``.
      fp8_meta: :class:`~fp8jax.state.Fp8Meta` with the 6 roles of :data:`MLP_ROLES`
        (``fp8jax.init_fp8_meta(recipe, n_roles=6)``); needed for delayed scaling.
      recipe: as for :func:`fp8jax.dense`.
      probe: zero ``float32[6]``; its cotangent is this call's amax per role.
      layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
      epsilon: the norm's epsilon. zero_centered_gamma: scale by ``1 + gamma``.
      activations: one of ``"gelu"`` (tanh approximation), ``"gelu_exact"``, ``"relu"``,
        ``"silu"``/``"swish"``, ``"linear"``, or a gated pair ending in ``"linear"``.
      dropout_mask: optional ``[..., intermediate]`` factor applied to the activation's output
        (dropout's mask already divided by the keep rate); its gradient is not computed.
      dtype: dtype of the GEMMs' outputs (default: promoted from ``x`` and the kernels).
      enabled: FP8 on/off (see :func:`fp8jax.dense`).

    Returns:
      ``[..., out_features]`` in ``dtype``.

    >>> import jax, jax.numpy as jnp, fp8jax
    >>> x = jax.random.normal(jax.random.key(0), (8, 16))
    >>> w1, w2 = jnp.full((16, 1, 32), 0.05), jnp.full((32, 16), 0.05)
    >>> recipe = fp8jax.DelayedScaling(amax_history_len=4)
    >>> meta = fp8jax.init_fp8_meta(recipe, n_roles=6)
    >>> y = fp8jax.layernorm_mlp(x, jnp.ones(16), jnp.zeros(16), w1, w2, fp8_meta=meta,
    ...                          recipe=recipe)
    >>> y.shape
    (8, 16)
    """
    y, _ = _layernorm_mlp(
        x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2, fp8_meta, recipe, probe=probe,
        layernorm_type=layernorm_type, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma,
        activations=activations, dropout_mask=dropout_mask, dtype=dtype, enabled=enabled,
    )  # fmt: skip
    return y


def _layernorm_mlp(
    x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2, fp8_meta, recipe, *, probe,
    layernorm_type, epsilon, zero_centered_gamma, activations, dropout_mask, dtype, enabled,
    where="fp8jax.layernorm_mlp",
) -> tuple[jax.Array, jax.Array | None]:  # fmt: skip
    """:func:`layernorm_mlp`, also returning the forward observations (``float32[6]``, NaN for
    the output-grad roles) or ``None`` with FP8 off."""
    norm = (layernorm_type, epsilon, zero_centered_gamma)
    if dtype is None and hasattr(x, "dtype") and hasattr(kernel_1, "dtype"):
        dtype = jnp.result_type(x, kernel_1, kernel_2)
    acts = _check(x, gamma, beta, kernel_1, bias_1, kernel_2, bias_2, norm, activations, dtype)
    dtype = jnp.dtype(dtype)
    lead, hidden = x.shape[:-1], x.shape[-1]
    inter, out = kernel_1.shape[2], kernel_2.shape[1]
    if dropout_mask is not None:
        dropout_mask = jnp.broadcast_to(dropout_mask, (*lead, inter))
    setup, scale, probe = g8.resolve(
        where, recipe, enabled, fp8_meta, probe, _N, families=("norm", "activation")
    )
    if setup is None:
        y = _reference(x, gamma, beta, kernel_1, bias_1, kernel_2, bias_2, norm, acts,
                       dropout_mask, dtype)  # fmt: skip
        return y, None
    if jnp.dtype(x.dtype) not in g8.WIDE:
        x = x.astype(dtype)
    m = int(jnp.size(x) // hidden) if hidden else 0
    x2 = x.reshape(m, hidden)
    w1 = kernel_1 if jnp.dtype(kernel_1.dtype) in g8.WIDE else kernel_1.astype(dtype)
    w2 = kernel_2 if jnp.dtype(kernel_2.dtype) in g8.WIDE else kernel_2.astype(dtype)
    w1 = w1.reshape(hidden, -1)
    b1 = None if bias_1 is None else bias_1.astype(dtype).reshape(-1)
    b2 = None if bias_2 is None else bias_2.astype(dtype)
    mask2 = None if dropout_mask is None else dropout_mask.astype(dtype).reshape(m, inter)
    cfg = _Config(
        setup=setup,
        norm=norm,
        activations=acts,
        has_bias=(b1 is not None, b2 is not None),
        dtype=dtype,
        dtypes=(
            x2.dtype, gamma.dtype, None if beta is None else beta.dtype, w1.dtype,
            None if bias_1 is None else bias_1.dtype, w2.dtype,
            None if bias_2 is None else bias_2.dtype,
        ),
        has_mask=mask2 is not None,
    )  # fmt: skip
    y2, seen = _mlp2d(cfg, x2, gamma, beta, w1, b1, w2, b2, scale, probe, mask2)
    return y2.reshape(*lead, out), seen


_PLAIN = {
    "gelu": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "linear": lambda v: v,
}


def plain_activation(h: jax.Array, acts: tuple[str, ...]) -> jax.Array:
    """The activation of ``h`` [..., k, I] with ``jax.nn``'s functions, in ``h``'s dtype (as a
    plain Flax block computes it): ``act(h[..., 0, :])``, times ``h[..., 1, :]`` when gated."""
    a = _PLAIN[acts[0]](h[..., 0, :])
    return a * h[..., 1, :] if len(acts) == 2 else a


def _reference(x, gamma, beta, w1, b1, w2, b2, norm, acts, mask, dtype):
    """The high-precision block (FP8 off), computed as its plain-Flax twin computes it."""
    ln = flax_norm(x, gamma, beta, *norm, dtype=dtype)
    h = jax.lax.dot_general(ln, w1.astype(dtype), (((ln.ndim - 1,), (0,)), ((), ())))
    if b1 is not None:
        h = h + b1.astype(dtype)
    a = plain_activation(h, acts)
    if mask is not None:
        a = a * mask.astype(a.dtype)
    y = jax.lax.dot_general(a, w2.astype(dtype), (((a.ndim - 1,), (0,)), ((), ())))
    if b2 is not None:
        y = y + b2.astype(dtype)
    return y


def check_activations(where: str, activations: Any) -> tuple[str, ...]:
    """``activations`` as a tuple, or a ValueError naming it: one name, or a gated pair whose
    second is ``"linear"``."""
    acts = (activations,) if isinstance(activations, str) else tuple(activations)
    names = tuple(_PLAIN)
    ok = len(acts) in (1, 2) and all(a in _PLAIN for a in acts)
    if ok and len(acts) == 2:
        ok = acts[1] == "linear" and acts[0] != "linear"
    if not ok:
        raise ValueError(
            f"{where}: activations must be one of {names} or a gated pair (act, 'linear') such "
            f"as ('gelu', 'linear') or ('silu', 'linear'), got {activations!r}"
        )
    return acts
