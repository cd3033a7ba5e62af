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

**Fused GELU epilogues** (:mod:`fp8jax.ops.gemms.gemm_epilogue`, opt-in:
``fp8jax.ops.gemm_options(fused_epilogues=True)``): with a ``"gelu"`` activation,
delayed scaling, a bfloat16/float16 ``dtype``, no dropout, the ``"kernel"`` implementation of the
``gemm`` and ``activation`` families and no explicit mesh axes, GEMM1 runs with cuBLASLt's GELU
epilogue (its output is the activation in FP8, with its amax, and the float16 GELU input that the
backward keeps instead of GEMM1's output) and GEMM2's dgrad with the DGELU epilogue (the
activation's gradient in FP8 with its amax and the first bias gradient, rounded to ``dtype``).
Each FP8 tensor's transposed copy is a transpose of its codes. Nothing is rounded to ``dtype``
between a GEMM and its cast there (see that module for the numerics and the bytes saved); on CPU
the same definition runs as XLA ops, which hold more float32 temporaries than the separate
kernels (docs/performance.md): one reason they are opt-in, the other that no GPU has run them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.functional import _core as core
from fp8jax.functional._vjp import layer_vjp, zeros_if_symbolic
from fp8jax.functional.layernorm import (
    check_norm_args,
    check_norm_params,
    flax_norm,
    input_backward,
    input_forward,
)
from fp8jax.ops.base import partition
from fp8jax.ops.base.partition import explicit_mesh
from fp8jax.ops.fused.activation import (
    activation,
    activation_cast_transpose,
    dactivation,
    dactivation_cast_transpose_dbias,
)
from fp8jax.ops.gemms import fixed_groups
from fp8jax.ops.gemms.gemm_epilogue import EPILOGUE_DTYPES, gemm_dgelu, gemm_gelu
from fp8jax.ops.gemms.gemm_options import below_fp8_flops, get_gemm_options
from fp8jax.recipe import Recipe
from fp8jax.state import Fp8Meta, gemm_roles

__all__ = ["MLP_ROLES", "layernorm_mlp"]

#: The FP8 state rows of :func:`layernorm_mlp` (and ``fp8jax.flax.LayerNormMLP``).
MLP_ROLES: tuple[str, ...] = gemm_roles("fc1", "fc2")
_N = len(MLP_ROLES)


class _Config(NamedTuple):
    setup: core.Fp8Setup
    norm: tuple[str, float, bool] | None  # norm_type, epsilon, zero_centered_gamma; None: no norm
    activations: tuple[str, ...]
    has_bias: tuple[bool, bool]
    keep_ln: bool  # also return the norm's output (return_layernorm_output)
    # GEMM1 with the gated pair as its own dim (fp8jax.ops.gemms.fixed_groups): kernel_1
    # (hidden, 2, I), bias_1 (2, I); else the 2-D view (hidden, k I), (k I,)
    grouped: bool
    # GEMM1 with the GELU epilogue and GEMM2's dgrad with the DGELU epilogue
    # (fp8jax.ops.gemms.gemm_epilogue; fused_path says when)
    fused: bool
    dtype: Any  # dtype of the GEMMs' outputs (the activation's input and the result)
    # dtypes of (x, gamma, beta, w1, b1, w2, b2): each gradient is returned in its primal's
    dtypes: tuple[Any, ...]


def _activation_fp8(cfg: _Config, h: jax.Array, scale: jax.Array, mask: jax.Array | None):
    """The activation of ``h`` [M, k, I] cast to FP8: ``(q [M, I], q_t [I, M], sinv, amax)``.
    One fused kernel (block scaling: the block-scaled one), unless current scaling (the scale
    needs the output's amax first) or a dropout mask (applied between the activation and the
    cast) split it in two."""
    s = cfg.setup
    impl = s.implementation("activation")
    if s.blocks is not None and mask is None:  # one fused op, as delayed scaling's
        return core.block_cast(s, h, s.fwd_dtype, "x", activations=cfg.activations)
    if s.current_scaling or mask is not None:
        a = activation(h, cfg.activations, implementation=impl)
        if mask is not None:
            a = (a * mask).astype(a.dtype)
        return core.cast_t(s, a, scale, s.fwd_dtype)
    return activation_cast_transpose(
        h, scale, s.fwd_dtype, cfg.activations, amax_reduction="mesh", implementation=impl
    )


def _dactivation_fp8(cfg: _Config, da: jax.Array, h: jax.Array, scale: jax.Array):
    """The activation's gradient cast to FP8, 2-D: ``(q [M, k I], q_t [k I, M], sinv, amax,
    dbias float32[k I])``; with ``cfg.grouped`` 3-D: ``q [M, k, I]``, ``q_t [k, I, M]``, dbias
    ``[k, I]``. One fused kernel, block scaling's included (where ``I`` holds whole blocks),
    unless current scaling split it in two (the scale needs the gradient's amax first)."""
    s = cfg.setup
    m, k, i = h.shape
    impl = s.implementation("activation")
    if s.blocks is not None and not cfg.grouped and i % s.block("grad")[0][1] == 0:
        # one fused op; its per-half blocks are the [m, k i] matrix's when i holds whole blocks
        return core.block_cast(s, (da, h), s.bwd_dtype, "grad", activations=cfg.activations)
    if s.current_scaling:
        dh = dactivation(da, h, cfg.activations, implementation=impl).reshape(m, k * i)
        return core.cast_dbias(s, dh, scale, True)
    q, q_t, sinv, amax, dbias = dactivation_cast_transpose_dbias(
        da, h, scale, s.bwd_dtype, cfg.activations, amax_reduction="mesh", implementation=impl
    )
    if cfg.grouped:
        return q, q_t, sinv, amax, dbias
    return q.reshape(m, k * i), q_t.reshape(k * i, m), sinv, amax, dbias.reshape(k * i)


def fused_path(setup: core.Fp8Setup, acts: tuple[str, ...], dtype: Any, dropout: bool) -> bool:
    """Whether :func:`layernorm_mlp` runs its GEMMs with the GELU epilogues (module docstring):
    where they compute what the separate kernels do, with per-tensor delayed scales."""
    return (
        acts == ("gelu",)
        and not setup.current_scaling  # delayed scaling (the block recipes count as current)
        and not dropout  # applied between the activation and its cast
        and jnp.dtype(dtype) in EPILOGUE_DTYPES
        and setup.implementation("gemm") == "kernel"
        and setup.implementation("activation") == "kernel"
        and get_gemm_options().fused_epilogues
        and not explicit_mesh()
    )


def _fused_forward(cfg: _Config, ln_q, ln_sinv, w1, b1, scale):
    """GEMM1 with the GELU epilogue: ``(a_q, a_t, a_sinv, a_amax, w1's amax, r1, aux)``, the
    activation as checkpoint-named codes and the float16 GELU input."""
    s = cfg.setup
    fwd = s.fwd_dtype
    w1_amax, r1 = core.cast_kernel(s, w1, scale[1])
    q, aux, a_sinv, a_amax = gemm_gelu(
        ln_q, r1.w_t, ln_sinv, r1.w_sinv, scale[3], fp8_dtype=fwd, bias=b1, dtypes=(fwd, fwd),
        implementation="kernel",
    )  # fmt: skip
    a_q, a_t, a_sinv, a_amax = core.named_input(q, jnp.transpose(q), a_sinv, a_amax)
    return a_q, a_t, a_sinv, a_amax, w1_amax, r1, aux


def _fused_backward(cfg: _Config, dy_q, dy_t, dy_sinv, a_t, a_sinv, r2, aux, scale, w2_dt):
    """GEMM2's dgrad with the DGELU epilogue, and its wgrad: ``(dh_q, dh_t, dh_sinv, dh_amax,
    db1 or None, dw2)``, the activation's gradient as codes."""
    s = cfg.setup
    fwd, bwd = s.fwd_dtype, s.bwd_dtype
    q, dh_sinv, dh_amax, db1 = gemm_dgelu(
        dy_q, r2.w_q, dy_sinv, r2.w_sinv, aux, scale[2], fp8_dtype=bwd, dbias_dtype=cfg.dtype,
        with_dbias=cfg.has_bias[0], reuse=(r2.w_t, a_t), dtypes=(bwd, fwd),
        implementation="kernel",
    )  # fmt: skip
    dw2 = core.gemm_wgrad(s, dy_t, dy_sinv, a_t, a_sinv, w2_dt)
    dh_q = core.codes(q)
    return dh_q, jnp.transpose(dh_q), dh_sinv, dh_amax, db1, dw2


def _forward(cfg: _Config, x, gamma, beta, w1, b1, w2, b2, scale, mask):
    s = cfg.setup
    ln_q, ln_t, ln_sinv, ln_amax, ln, norm_res = input_forward(
        s, x, gamma, beta, scale[0], cfg.norm, cfg.keep_ln
    )
    if cfg.fused:
        a_q, a_t, a_sinv, a_amax, w1_amax, r1, h = _fused_forward(cfg, ln_q, ln_sinv, w1, b1,
                                                                  scale)  # fmt: skip
        y, w2_amax, r2 = core.gemm_forward(s, a_q, a_sinv, w2, scale[4], b2, cfg.dtype)
        nan = jnp.float32(jnp.nan)
        seen = jnp.stack([ln_amax, w1_amax, nan, a_amax, w2_amax, nan]).reshape(_N)
        fwd_seen = jnp.stack([ln_amax, w1_amax, a_amax, w2_amax]).reshape(4)
        res = (norm_res, ln_t, ln_sinv, r1, h, a_t, a_sinv, r2, scale, fwd_seen, mask)
        return (y, ln, seen), res
    if cfg.grouped:
        h, w1_amax, r1 = core.grouped_forward(s, ln_q, ln_sinv, w1, scale[1], b1, cfg.dtype)
    else:
        h, w1_amax, r1 = core.gemm_forward(s, ln_q, ln_sinv, w1, scale[1], b1, cfg.dtype)
        h = h.reshape(ln_q.shape[0], len(cfg.activations), -1)
    a_q, a_t, a_sinv, a_amax = core.named_input(*_activation_fp8(cfg, h, scale[3], mask))
    y, w2_amax, r2 = core.gemm_forward(s, a_q, a_sinv, w2, scale[4], b2, cfg.dtype)
    nan = jnp.float32(jnp.nan)  # the output-grad roles: not observed by the forward
    seen = jnp.stack([ln_amax, w1_amax, nan, a_amax, w2_amax, nan]).reshape(_N)
    fwd_seen = jnp.stack([ln_amax, w1_amax, a_amax, w2_amax]).reshape(4)
    res = (norm_res, ln_t, ln_sinv, r1, h, a_t, a_sinv, r2, scale, fwd_seen, mask)
    return (y, ln, seen), res


def _backward(cfg: _Config, res, cts):
    s = cfg.setup
    norm_res, ln_t, ln_sinv, r1, h, a_t, a_sinv, r2, scale, fwd_seen, mask = res
    x_dt, gamma_dt, beta_dt, w1_dt, b1_dt, w2_dt, b2_dt = cfg.dtypes
    dy = zeros_if_symbolic(cts[0])
    dy_q, dy_t, dy_sinv, dy_amax, db2 = core.cast_dbias(s, dy, scale[5], cfg.has_bias[1])
    dy_q, dy_t = core.codes(dy_q), core.codes(dy_t)
    if cfg.fused:
        dh_q, dh_t, dh_sinv, dh_amax, db1, dw2 = _fused_backward(
            cfg, dy_q, dy_t, dy_sinv, a_t, a_sinv, r2, h, scale, w2_dt
        )
    else:
        da, dw2 = core.gemm_backward(s, dy_q, dy_t, dy_sinv, a_t, a_sinv, r2, cfg.dtype, w2_dt)
        if mask is not None:
            da = (da * mask).astype(da.dtype)
        dh_q, dh_t, dh_sinv, dh_amax, db1 = _dactivation_fp8(cfg, da, h, scale[2])
        dh_q, dh_t = core.codes(dh_q), core.codes(dh_t)
    if cfg.grouped:
        dln, dw1 = core.grouped_backward(s, dh_q, dh_t, dh_sinv, ln_t, ln_sinv, r1, x_dt, w1_dt)
    else:
        dln, dw1 = core.gemm_backward(s, dh_q, dh_t, dh_sinv, ln_t, ln_sinv, r1, x_dt, w1_dt)
    dx, dgamma, dbeta = input_backward(s, cfg.norm, norm_res, dln, cts[1] if cfg.keep_ln else None)
    ln_amax, w1_amax, a_amax, w2_amax = (fwd_seen[i] for i in range(4))
    observed = jnp.stack([ln_amax, w1_amax, dh_amax, a_amax, w2_amax, dy_amax]).reshape(_N)
    grads = (
        dx.astype(x_dt),
        None if gamma_dt is None else dgamma.astype(gamma_dt),
        None if beta_dt is None else dbeta.astype(beta_dt),
        dw1,
        None if b1_dt is None else db1.astype(b1_dt),
        dw2,
        None if b2_dt is None else db2.astype(b2_dt),
    )
    return grads, observed


# the dropout mask is an argument that is not differentiated (zero cotangent)
_mlp2d = layer_vjp(_forward, _backward, "layernorm_mlp")


def _check(x, gamma, beta, kernel_1, bias_1, kernel_2, bias_2, norm, activations, dtype):
    where = "layernorm_mlp"
    for name, v in (("x", x), ("kernel_1", kernel_1), ("kernel_2", kernel_2)):
        if not hasattr(v, "dtype") or not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"{where}: {name} must be a floating-point array, got {v!r:.60}")
    if x.ndim < 1:
        raise ValueError(f"{where}: x must have a hidden (last) dim, got shape {x.shape}")
    if norm is None:
        if gamma is not None or beta is not None:
            raise ValueError(f"{where}: layernorm_type=None (no norm) takes no gamma or beta")
    else:
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
    if jnp.dtype(dtype) not in core.WIDE:
        raise TypeError(f"{where}: dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return acts


def layernorm_mlp(
    x: jax.Array,
    gamma: jax.Array | None,
    beta: jax.Array | None,
    kernel_1: jax.Array,
    kernel_2: jax.Array,
    bias_1: jax.Array | None = None,
    bias_2: jax.Array | None = None,
    fp8_meta: Fp8Meta | None = None,
    recipe: Recipe | None = None,
    *,
    probe: jax.Array | None = None,
    layernorm_type: str | None = "layernorm",
    epsilon: float = 1e-6,
    zero_centered_gamma: bool = False,
    activations: Sequence[str] = ("gelu",),
    dropout_mask: jax.Array | None = None,
    return_layernorm_output: bool = False,
    dtype: Any = None,
    enabled: bool | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``norm(x) -> GEMM1 (+bias_1) -> activation -> GEMM2 (+bias_2)``, in FP8.

    The norm is over the last axis of ``x``; ``kernel_1`` is ``(hidden, len(activations),
    intermediate)`` as in TransformerEngine's ``LayerNormMLP`` (a gated pair such as
    ``("silu", "linear")`` computes ``act(x @ kernel_1[:, 0]) * (x @ kernel_1[:, 1])``).
    FP8 on/off and the recipe are decided as for :func:`fp8jax.dense`. With FP8 off this is the
    plain high-precision block, computed as a Flax ``LayerNorm -> DenseGeneral -> activation
    -> Dense`` block computes it.

    Args:
      x: input ``[..., hidden]``, float32/bfloat16/float16.
      gamma, beta: the norm's scale and bias, ``(hidden,)``; ``beta`` is ``None`` for RMSNorm,
        both ``None`` without a norm.
      kernel_1: ``(hidden, len(activations), intermediate)``; kernel_2: ``(intermediate,
        out_features)``; bias_1: ``(len(activations), intermediate)``; bias_2:
        ``(out_features,)``.
      fp8_meta: :class:`~fp8jax.state.Fp8Meta` with the 6 roles of :data:`MLP_ROLES`
        (``fp8jax.init_fp8_meta(recipe, n_roles=6)``); needed for delayed scaling.
      recipe: as for :func:`fp8jax.dense`.
      probe: zero ``float32[6]``; its cotangent is this call's amax per role.
      layernorm_type: ``"layernorm"``, ``"rmsnorm"`` or ``None`` (no norm: ``x`` is cast as
        it is).
      epsilon: the norm's epsilon. zero_centered_gamma: scale by ``1 + gamma``.
      activations: one of ``"gelu"`` (tanh approximation), ``"gelu_exact"``, ``"relu"``,
        ``"silu"``/``"swish"``, ``"linear"``, or a gated pair ending in ``"linear"``.
      dropout_mask: optional factor broadcastable to ``[..., intermediate]``, applied to the
        activation's output (dropout's keep mask divided by the keep rate).
      return_layernorm_output: also return the norm's output (``x.dtype``), differentiated too.
      dtype: dtype of the GEMMs' outputs (default: promoted from ``x`` and the kernels).
      enabled: FP8 on/off (see :func:`fp8jax.dense`).

    Returns:
      ``[..., out_features]`` in ``dtype`` (and the norm's output if asked for).

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
    y, ln, _ = layernorm_mlp_observed(
        x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2, fp8_meta, recipe, probe=probe,
        layernorm_type=layernorm_type, epsilon=epsilon, zero_centered_gamma=zero_centered_gamma,
        activations=activations, dropout_mask=dropout_mask,
        return_layernorm_output=return_layernorm_output, dtype=dtype, enabled=enabled,
    )  # fmt: skip
    return (y, ln) if return_layernorm_output else y


def layernorm_mlp_observed(
    x, gamma, beta, kernel_1, kernel_2, bias_1, bias_2, fp8_meta, recipe, *, probe,
    layernorm_type, epsilon, zero_centered_gamma, activations, dropout_mask,
    return_layernorm_output, dtype, enabled, where="fp8jax.layernorm_mlp",
):  # fmt: skip
    """:func:`layernorm_mlp` with its norm output and forward observations
    (:class:`~fp8jax.functional._core.LayerOutput`; ``float32[6]``): what the Flax modules call."""
    norm = None if layernorm_type is None else (layernorm_type, epsilon, zero_centered_gamma)
    if dtype is None and hasattr(x, "dtype") and hasattr(kernel_1, "dtype"):
        dtype = jnp.result_type(x, kernel_1, kernel_2)
    acts = _check(x, gamma, beta, kernel_1, bias_1, kernel_2, bias_2, norm, activations, dtype)
    dtype = jnp.dtype(dtype)
    lead, hidden = x.shape[:-1], x.shape[-1]
    inter, out = kernel_1.shape[2], kernel_2.shape[1]
    if dropout_mask is not None:
        dropout_mask = jnp.broadcast_to(dropout_mask, (*lead, inter))
    setup, scale, probe = core.resolve(
        where, recipe, enabled, fp8_meta, probe, _N, families=("norm", "activation")
    )
    m = int(np.prod(lead, dtype=np.int64))
    if setup is not None and below_fp8_flops([(m, len(acts) * inter, hidden), (m, out, inter)]):
        setup = None  # too small for FP8 to pay (fp8jax.ops.gemm_options): the plain block
    keep = bool(return_layernorm_output)
    if setup is None:
        y, ln = _reference(x, gamma, beta, kernel_1, bias_1, kernel_2, bias_2, norm, acts,
                           dropout_mask, dtype)  # fmt: skip
        return core.LayerOutput(y, ln.astype(x.dtype) if keep else None, None)
    if jnp.dtype(x.dtype) not in core.WIDE:
        x = x.astype(dtype)
    w1 = kernel_1 if jnp.dtype(kernel_1.dtype) in core.WIDE else kernel_1.astype(dtype)
    w2 = kernel_2 if jnp.dtype(kernel_2.dtype) in core.WIDE else kernel_2.astype(dtype)
    # the gated pair kept as a dim of its own (see fp8jax.ops.gemms.fixed_groups), except with
    # current scaling (whose casts of the activation gradient are 2-D)
    grouped = (
        len(acts) == 2
        and not setup.current_scaling
        and fixed_groups.usable(setup.implementation("gemm"))
    )
    b1 = None if bias_1 is None else bias_1.astype(dtype)
    b1 = b1 if b1 is None or grouped else partition.reshape(b1, (b1.size,))
    b2 = None if bias_2 is None else bias_2.astype(dtype)
    mask2 = (
        None if dropout_mask is None else partition.reshape(dropout_mask.astype(dtype), (m, inter))
    )
    cfg = _Config(
        setup=setup,
        norm=norm,
        activations=acts,
        has_bias=(b1 is not None, b2 is not None),
        keep_ln=keep,
        grouped=grouped,
        fused=fused_path(setup, acts, dtype, dropout_mask is not None),
        dtype=dtype,
        dtypes=tuple(
            None if v is None else v.dtype for v in (x, gamma, beta, w1, bias_1, w2, bias_2)
        ),
    )
    w1 = w1 if grouped else partition.reshape(w1, (hidden, w1.size // hidden))
    # the norm takes x unflattened (see fp8jax.functional.layernorm.norm_fp8)
    x_in = x if norm is not None and x.ndim >= 2 else partition.reshape(x, (m, hidden))
    y2, ln2, seen = _mlp2d(cfg, (x_in, gamma, beta, w1, b1, w2, b2), scale, probe, (mask2,))
    ln = None if ln2 is None else partition.reshape(ln2, (*lead, hidden))
    return core.LayerOutput(partition.reshape(y2, (*lead, out)), ln, seen)


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
    """The high-precision block (FP8 off), computed as its plain-Flax twin computes it;
    ``(y, the norm's output)``."""
    ln = x.astype(dtype) if norm is None else flax_norm(x, gamma, beta, *norm, dtype=dtype)
    h = partition.dot_last(ln, w1.astype(dtype))
    if b1 is not None:
        h = h + b1.astype(dtype)
    a = plain_activation(h, acts)
    if mask is not None:
        a = a * mask.astype(a.dtype)
    y = partition.dot_last(a, w2.astype(dtype))
    if b2 is not None:
        y = y + b2.astype(dtype)
    return y, ln


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
