"""FP8 scaled dot-product attention on FP8 codes: the ``jnp`` reference that defines fp8jax's
numerics (the default, ``implementation("xla")``, what a CPU runs), and cuDNN's fused FP8 flash
attention through XLA (JAX's ``dot_product_attention(use_fp8=True)``, ``"kernel"`` on a GPU),
whose backward differs in one term (below).

Layout ``[batch, seq, heads, head_dim]``; queries have ``h`` heads, keys and values ``g``
(grouped-query attention: ``g`` divides ``h``). Every tensor is ``float8_e4m3fn``: XLA's cuDNN
FP8 attention takes one FP8 type for Q, K, V, its output O, the output gradient dO and the
gradients dQ, dK, dV it writes. Each tensor ``t`` has a scale ``s_t`` (``code = fp8(t *
s_t)``, saturating, round to nearest even) and is read back as ``code * (1 / s_t)``. All
arithmetic is float32.

Forward::

    S   = scale * (q / s_q) (k / s_k)^T          causal: keys after the query get P = 0
    P   = softmax(S)                             amax_s = max P
    O   = (fp8(P s_s) / s_s) (v / s_v)           amax_o = max |O|, returned as fp8(O s_o)

Backward, from the output gradient's codes ``dO8`` (scale ``s_do``)::

    P, fp8(P s_s) recomputed from q, k (cuDNN keeps the softmax statistics instead)
    dV  = (fp8(P s_s) / s_s)^T (dO8 / s_do)                  (summed over a group's heads)
    dP  = (dO8 / s_do)(v / s_v)^T,  D = rowsum(P * dP)
    dS  = P * (dP - D)                       amax_dp = max |dS|
    dQ  = scale * (fp8(dS s_dp) / s_dp)(k / s_k),  dK = scale * (...)^T (q / s_q)
    amax_dq, amax_dk, amax_dv; each returned as fp8(. s_.)

``D`` is the softmax gradient's row sum for the P that ``dS`` uses, so a row of dS sums to 0 as
the softmax's gradient does. cuDNN, as flash attention does, takes it from the forward's output
instead: ``D = rowsum((dO8 / s_do) * (O8 / s_o))`` (``delta="output"`` of the reference
emulates it). With FP8 that output is not ``P v``: it was made from the quantized P and is
quantized itself, so each row of dS gains ``P * (dO . (P v - O8))``, which dQ multiplies by the
row's attention-weighted mean key and dK by the queries; emulated on CPU it trained the GPT demo
22% and 31% worse than BF16 (two seeds; the reference's D: docs/convergence.md), which is why
``"xla"`` is the default. cuDNN agrees with ``delta="output"`` to a tolerance, not bit for bit
(its tiles sum in another order and apply the softmax online), unmeasured on a GPU.

A scale given as ``None`` (the reference only) is the tensor's own: ``448 / amax`` (1 when the
amax is 0 or not finite), current scaling of a tensor the kernel makes itself.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.ops.base.switch import get_implementation, register_family
from fp8jax.ops.casts.quantize import to_fp8

__all__ = [
    "FP8_ATTENTION_DTYPE",
    "AttentionScales",
    "cudnn_fp8_attention_refusal",
    "fp8_attention_backward",
    "fp8_attention_backward_reference",
    "fp8_attention_forward",
    "fp8_attention_forward_reference",
    "gpu_backend",
]

FAMILY = register_family("attention", "fp8_attention")
#: The FP8 type of every tensor of the FP8 attention.
FP8_ATTENTION_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
_MAX = np.float32(448.0)
_HIGHEST = jax.lax.Precision.HIGHEST


class AttentionScales(NamedTuple):
    """The scale of each tensor of the FP8 attention (float32 scalars): its inputs ``q``, ``k``,
    ``v``, the probabilities ``s``, the output ``o``, the output gradient ``do``, the scores'
    gradient ``dp`` and the gradients ``dq``, ``dk``, ``dv``. ``None``: the tensor's own scale
    (reference only; see the module docstring)."""

    q: Any
    k: Any
    v: Any
    s: Any
    o: Any
    do: Any
    dp: Any
    dq: Any
    dk: Any
    dv: Any


class AttentionForward(NamedTuple):
    out: jax.Array  # O's FP8 codes, [b, sq, h, d]
    out_scale_inv: jax.Array  # 1 / s_o
    amax_s: jax.Array
    amax_o: jax.Array
    residuals: Any  # what the backward reads (a pytree)


class AttentionBackward(NamedTuple):
    dq: jax.Array  # FP8 codes, with their inverse scales in ``scale_inv`` (dq, dk, dv)
    dk: jax.Array
    dv: jax.Array
    scale_inv: tuple[jax.Array, jax.Array, jax.Array]
    amax_dp: jax.Array
    amax_dq: jax.Array
    amax_dk: jax.Array
    amax_dv: jax.Array


def gpu_backend() -> bool:
    """Whether JAX's default backend is a GPU, where cuDNN's attention can run (the one place
    fp8jax's attention asks; a lowering for CUDA from a machine without one substitutes it)."""
    try:
        return jax.default_backend() in ("gpu", "cuda")
    except RuntimeError:
        return False


# ------------------------------------------------------------------------------- reference


def _own_scale(amax: jax.Array) -> jax.Array:
    ok = (amax >= np.finfo(np.float32).smallest_normal) & jnp.isfinite(amax)
    return jnp.where(ok, jnp.minimum(_MAX / amax, np.finfo(np.float32).max), jnp.float32(1.0))


def _cast(x: jax.Array, scale: Any) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(codes, scale, 1 / scale, amax)`` of float32 ``x`` (``scale`` None: its own)."""
    amax = jnp.max(jnp.abs(x))
    scale = _own_scale(amax) if scale is None else jnp.asarray(scale, jnp.float32).reshape(())
    codes = to_fp8(x, scale, FP8_ATTENTION_DTYPE)
    return codes, scale, (1.0 / scale).astype(jnp.float32), amax


def _read(codes: jax.Array, scale_inv: jax.Array) -> jax.Array:
    return codes.astype(jnp.float32) * scale_inv


def _groups(q: jax.Array, k: jax.Array) -> tuple[int, int]:
    h, g = q.shape[2], k.shape[2]
    return g, h // g


def _probs(qf, kf, scale: float, causal: bool) -> jax.Array:
    """``P`` [b, g, r, sq, skv] from the read-back q [b, sq, h, d] and k [b, skv, g, d]."""
    b, sq, h, d = qf.shape
    g = kf.shape[2]
    qg = qf.reshape(b, sq, g, h // g, d)
    logits = jnp.einsum("bqgrd,bkgd->bgrqk", qg, kf, precision=_HIGHEST) * jnp.float32(scale)
    if causal:
        keep = jnp.tril(jnp.ones((sq, kf.shape[1]), bool))
        logits = jnp.where(keep, logits, -0.7 * np.finfo(np.float32).max)
    return jax.nn.softmax(logits, axis=-1)


def fp8_attention_forward_reference(q, k, v, scales: AttentionScales, *, scale: float,
                                    causal: bool) -> AttentionForward:  # fmt: skip
    """The forward of the module docstring on the codes ``q``, ``k``, ``v`` (the definition of
    :func:`fp8_attention_forward`'s numerics)."""
    dq_, dk_, dv_ = (1.0 / jnp.asarray(s, jnp.float32) for s in (scales.q, scales.k, scales.v))
    qf, kf, vf = _read(q, dq_), _read(k, dk_), _read(v, dv_)
    p = _probs(qf, kf, scale, causal)
    p8, s_scale, s_inv, amax_s = _cast(p, scales.s)
    b, sq, h, d = q.shape
    o = jnp.einsum("bgrqk,bkgd->bqgrd", _read(p8, s_inv), vf, precision=_HIGHEST)
    o8, _, o_inv, amax_o = _cast(o.reshape(b, sq, h, d), scales.o)
    codes = tuple(jax.lax.bitcast_convert_type(t, jnp.uint8) for t in (q, k, v, o8))
    return AttentionForward(o8, o_inv, amax_s, amax_o, (codes, s_scale, o_inv))


def fp8_attention_backward_reference(residuals, do, do_scale_inv, scales: AttentionScales, *,
                                     scale: float, causal: bool,
                                     delta: str = "probs") -> AttentionBackward:  # fmt: skip
    """The backward of the module docstring from the forward's ``residuals`` and the output
    gradient's codes ``do`` with their inverse scale. ``delta``: ``"probs"`` (fp8jax's D,
    ``rowsum(P * dP)``) or ``"output"`` (cuDNN's, from the FP8 output)."""
    if delta not in ("probs", "output"):
        raise ValueError(f"fp8_attention_backward_reference: delta must be 'probs' or 'output', "
                         f"got {delta!r}")  # fmt: skip
    codes, s_scale, o_inv = residuals
    q, k, v, o8 = (jax.lax.bitcast_convert_type(c, FP8_ATTENTION_DTYPE) for c in codes)
    inv = [1.0 / jnp.asarray(s, jnp.float32) for s in (scales.q, scales.k, scales.v)]
    qf, kf, vf = (_read(t, i) for t, i in zip((q, k, v), inv, strict=True))
    of = _read(o8, o_inv)
    p = _probs(qf, kf, scale, causal)
    pf = _read(to_fp8(p, s_scale, FP8_ATTENTION_DTYPE), (1.0 / s_scale).astype(jnp.float32))
    b, sq, h, d = q.shape
    g, r = _groups(q, k)
    dof = _read(do, do_scale_inv).reshape(b, sq, g, r, d)
    dv = jnp.einsum("bgrqk,bqgrd->bkgd", pf, dof, precision=_HIGHEST)
    dp = jnp.einsum("bqgrd,bkgd->bgrqk", dof, vf, precision=_HIGHEST)
    if delta == "probs":
        row = jnp.sum(p * dp, axis=-1, keepdims=True)  # [b, g, r, sq, 1]
    else:
        row = jnp.sum(dof * of.reshape(b, sq, g, r, d), axis=-1)  # [b, sq, g, r]
        row = jnp.transpose(row, (0, 2, 3, 1))[..., None]
    ds = p * (dp - row)
    ds8, _, ds_inv, amax_dp = _cast(ds, scales.dp)
    dsf = _read(ds8, ds_inv) * jnp.float32(scale)
    dq = jnp.einsum("bgrqk,bkgd->bqgrd", dsf, kf, precision=_HIGHEST).reshape(b, sq, h, d)
    dk = jnp.einsum("bgrqk,bqgrd->bkgd", dsf, qf.reshape(b, sq, g, r, d), precision=_HIGHEST)
    (dq8, _, dq_inv, amax_dq), (dk8, _, dk_inv, amax_dk), (dv8, _, dv_inv, amax_dv) = (
        _cast(t, s) for t, s in ((dq, scales.dq), (dk, scales.dk), (dv, scales.dv))
    )
    return AttentionBackward(dq8, dk8, dv8, (dq_inv, dk_inv, dv_inv), amax_dp, amax_dq,
                             amax_dk, amax_dv)  # fmt: skip


# ------------------------------------------------------------------- cuDNN, through XLA (JAX's)


def _cudnn() -> Any:
    """JAX's cuDNN attention module. JAX has no public FP8 attention (``jax.nn``'s is BF16/FP16
    only, to 0.12 at least); this private module has it, in every JAX fp8jax supports (0.10.2
    on): the one allowance of ``tests/test_import_layers.py``'s private-API check."""
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


def _one(x: Any) -> jax.Array:
    return jnp.asarray(x, jnp.float32).reshape(1, 1, 1, 1)


def _cudnn_params(sc: AttentionScales) -> dict[str, jax.Array]:
    """JAX's ``fp8_params`` of the scales: descales of what cuDNN reads, scales of what it
    writes; the four ``amax_d*`` entries are placeholders whose cotangents are the backward's
    amaxes."""
    inv = lambda s: _one(1.0 / jnp.asarray(s, jnp.float32))
    zero = _one(0.0)
    return {
        "amax_dQ": zero, "amax_dK": zero, "amax_dV": zero, "amax_dP": zero,
        "descale_q": inv(sc.q), "descale_k": inv(sc.k), "descale_v": inv(sc.v),
        "descale_s": inv(sc.s), "scale_s": _one(sc.s), "scale_o": _one(sc.o),
        "descale_o": inv(sc.o), "descale_dO": inv(sc.do), "descale_dP": inv(sc.dp),
        "scale_dQ": _one(sc.dq), "scale_dK": _one(sc.dk), "scale_dV": _one(sc.dv),
        "scale_dP": _one(sc.dp),
    }  # fmt: skip


def _cudnn_forward(q, k, v, sc: AttentionScales, scale: float, causal: bool) -> AttentionForward:
    fa = _cudnn()
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK

    def call(q, k, v, params):
        return fa.dot_product_attention(q, k, v, fp8_params=params, scale=scale, mask_type=mask,
                                        use_fp8=True, qkv_layout="BTNH")  # fmt: skip

    # The pullback (a pytree of the forward's residuals) is the backward's residual.
    (o8, amax_s, amax_o), pullback = jax.vjp(call, q, k, v, _cudnn_params(sc))
    o_inv = (1.0 / jnp.asarray(sc.o, jnp.float32)).reshape(())
    return AttentionForward(o8, o_inv, amax_s.reshape(()), amax_o.reshape(()), pullback)


def _cudnn_backward(pullback, do, sc: AttentionScales) -> AttentionBackward:
    zero = _one(0.0)
    dq, dk, dv, grads = pullback((do, zero, zero))
    inv = tuple((1.0 / jnp.asarray(s, jnp.float32)).reshape(()) for s in (sc.dq, sc.dk, sc.dv))
    amaxes = (grads[n].reshape(()) for n in ("amax_dP", "amax_dQ", "amax_dK", "amax_dV"))
    return AttentionBackward(dq, dk, dv, inv, *amaxes)  # type: ignore[arg-type]


def cudnn_fp8_attention_refusal(
    q: Any, k: Any, v: Any, *, scale: float, causal: bool
) -> str | None:
    """Why cuDNN's FP8 attention cannot train on these (abstract) inputs here, or ``None`` when
    it can: a GPU backend of compute capability 9.0 or later, a cuDNN other than 9.10.0 (JAX's
    tests skip it), and JAX's own checks of the forward and backward (training needs head dim
    128 and sequence lengths divisible by 128), traced on abstract values."""
    if not gpu_backend():
        return "JAX's default backend is not a GPU (cuDNN runs on NVIDIA GPUs only)"
    fa = _cudnn()
    shapes = [jax.ShapeDtypeStruct(jnp.shape(t), FP8_ATTENTION_DTYPE) for t in (q, k, v)]
    ones = AttentionScales(*([jnp.float32(1.0)] * 10))

    def train(q, k, v):
        fwd = _cudnn_forward(q, k, v, ones, scale, causal)
        return _cudnn_backward(fwd.residuals, fwd.out, ones)

    try:
        if not fa.check_compute_capability("9.0"):
            return "cuDNN's FP8 attention needs compute capability 9.0 (Hopper) or later"
        if fa.check_cudnn_version() == 91000:
            return "cuDNN 9.10.0 has no FP8 attention (JAX's own tests skip it)"
        jax.eval_shape(train, *shapes)
    except (NotImplementedError, ValueError, RuntimeError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


# ------------------------------------------------------------------------------ the op


def _check(op: str, q: Any, k: Any, v: Any) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if jnp.result_type(t) != FP8_ATTENTION_DTYPE or jnp.ndim(t) != 4:
            raise TypeError(f"{op}: {name} must be float8_e4m3fn codes [batch, seq, heads, "
                            f"head_dim], got {jnp.result_type(t)}{jnp.shape(t)}")  # fmt: skip
    (b, _, h, d), kv = jnp.shape(q), jnp.shape(k)
    if jnp.shape(v) != kv or kv[0] != b or kv[3] != d or h % kv[2]:
        raise ValueError(
            f"{op}: k and v must be equal [batch, seq_kv, groups, head_dim] with q's batch and "
            f"head_dim and groups dividing q's heads; got q {jnp.shape(q)}, k {kv}, v "
            f"{jnp.shape(v)}"
        )


def _runs_cudnn(implementation: str | None) -> bool:
    impl = implementation if implementation is not None else get_implementation(FAMILY)
    if impl not in ("kernel", "xla"):
        raise ValueError(f"fp8 attention: implementation must be 'kernel' or 'xla', got {impl!r}")
    return impl == "kernel" and gpu_backend()


def fp8_attention_forward(q, k, v, scales: AttentionScales, *, scale: float, causal: bool,
                          implementation: str | None = None) -> AttentionForward:  # fmt: skip
    """The FP8 attention's forward (module docstring) on FP8 codes: ``(out codes, 1 / s_o,
    amax_s, amax_o, residuals)``. ``implementation`` (default: the ``"attention"`` family's,
    :func:`fp8jax.ops.implementation`, itself ``"xla"`` by default): ``"xla"`` the reference,
    ``"kernel"`` cuDNN's where JAX's default backend is a GPU (its backward's D is not the
    reference's: module docstring) and the reference elsewhere, as the GEMM on CPU."""
    op = "fp8_attention_forward"
    _check(op, q, k, v)
    if _runs_cudnn(implementation):
        if any(s is None for s in scales):
            raise ValueError(f"{op}: cuDNN needs every scale before it runs (no current scaling "
                             "of the tensors it makes); got None")  # fmt: skip
        return _cudnn_forward(q, k, v, scales, scale, causal)
    return fp8_attention_forward_reference(q, k, v, scales, scale=scale, causal=causal)


def fp8_attention_backward(residuals, do, do_scale_inv, scales: AttentionScales, *,
                           scale: float, causal: bool,
                           implementation: str | None = None) -> AttentionBackward:  # fmt: skip
    """The FP8 attention's backward from :func:`fp8_attention_forward`'s ``residuals`` (the same
    ``implementation``) and the output gradient's codes ``do`` (cast with ``scales.do``; its
    inverse ``do_scale_inv``): the gradients' codes, their inverse scales and the amaxes of
    dP, dQ, dK, dV."""
    if jnp.result_type(do) != FP8_ATTENTION_DTYPE:
        raise TypeError(f"fp8_attention_backward: do must be float8_e4m3fn codes, got "
                        f"{jnp.result_type(do)}")  # fmt: skip
    if _runs_cudnn(implementation):
        return _cudnn_backward(residuals, do, scales)
    return fp8_attention_backward_reference(residuals, do, do_scale_inv, scales, scale=scale,
                                            causal=causal)  # fmt: skip
