"""The attention core of every fp8jax attention layer, in both Flax APIs: scaled dot-product
attention with TransformerEngine's arguments (grouped-query attention, TE's masks, sliding
windows, segment ids, biases, attention dropout), computed with
:func:`jax.nn.dot_product_attention`, in high precision (the input dtype, logits and softmax in
float32). Masks follow TE's convention: ``True`` means *masked out* (the opposite of
:func:`jax.nn.dot_product_attention`'s ``mask``). :class:`fp8jax.flax.DotProductAttention` is
this function as a Linen module. With ``fp8_dpa`` and FP8 on, the attention runs with FP8
operands (:func:`fp8jax.dot_product_attention`) where it can, else as above with a warning
(:mod:`fp8jax.layers.attention_backend`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from fp8jax.functional.attention import dot_product_attention_observed
from fp8jax.layers.attention_backend import choose_attention, fp8_dpa_refusal, refuse_or_warn
from fp8jax.layers.context_parallel import context_parallel_core, resolve_context_parallel
from fp8jax.ops.base.switch import get_implementation
from fp8jax.ops.base.switch import implementation as op_implementation

__all__ = [
    "ATTN_BIAS_TYPES",
    "ATTN_MASK_TYPES",
    "attention_core",
    "attention_with_dropout",
    "canonical_mask_type",
    "check_heads",
    "check_window",
    "segment_mask",
]

#: Accepted ``attn_mask_type`` values (``"causal_padding"`` is an alias of
#: ``"padding_causal"``, as in TE).
ATTN_MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal", "causal_padding")
#: Accepted ``attn_bias_type`` values (``None``: ``"post_scale_bias"`` when a bias is given,
#: else ``"no_bias"``).
ATTN_BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias")
_QKV_LAYOUTS = ("bshd_bshd_bshd", "bshd_bs2hd", "bs3hd")


def canonical_mask_type(value: Any, name: str = "attn_mask_type") -> str:
    """``value`` as one of ``no_mask``, ``padding``, ``causal``, ``padding_causal``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str in {ATTN_MASK_TYPES}, got {value!r}")
    out = value.lower().strip()
    if out not in ATTN_MASK_TYPES:
        raise ValueError(f"{name} must be one of {ATTN_MASK_TYPES}, got {value!r}")
    return "padding_causal" if out == "causal_padding" else out


def check_heads(owner: str, num_attention_heads: Any, num_gqa_groups: Any) -> tuple[int, int]:
    """``(heads, groups)`` validated: positive ints, ``groups`` divides ``heads``."""
    pairs = (("num_attention_heads", num_attention_heads), ("num_gqa_groups", num_gqa_groups))
    for name, v in pairs:
        if v is None and name == "num_gqa_groups":
            continue
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{owner}: {name} must be a positive int, got {v!r}")
    heads = int(num_attention_heads)
    groups = heads if num_gqa_groups is None else int(num_gqa_groups)
    if heads % groups:
        raise ValueError(
            f"{owner}: num_gqa_groups={groups} must divide num_attention_heads={heads}"
        )
    return heads, groups


def check_window(owner: str, window_size: Any) -> tuple[int, int] | None:
    """TE's ``window_size``: ``None`` or ``(left, right)`` ints, negative meaning unbounded."""
    if window_size is None:
        return None
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(
            f"{owner}: window_size must be None or a pair (left, right) of ints, got "
            f"{window_size!r}"
        ) from None
    for v in (left, right):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise TypeError(f"{owner}: window_size must hold ints, got {window_size!r}")
    return int(left), int(right)


def _bool_mask(owner: str, name: str, mask: Any, shape: tuple[int, int, int, int]) -> jax.Array:
    """TE's mask (``True``/nonzero = masked out) validated against ``(b, h, sq, skv)``."""
    mask = jnp.asarray(mask)
    if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)):
        raise TypeError(
            f"{owner}: {name} must be a bool (or integer 0/1) array with True = masked out, got "
            f"dtype {mask.dtype}; pass an additive mask as the bias"
        )
    b, h, sq, skv = shape
    ok = (
        mask.ndim == 4
        and mask.shape[0] in (1, b)
        and mask.shape[1] in (1, h)
        and mask.shape[2] in (1, sq)
        and mask.shape[3] in (1, skv)
    )
    if not ok:
        raise ValueError(
            f"{owner}: {name} must have shape (batch|1, 1|heads, seq_q|1, seq_kv|1) = "
            f"({b}, 1 or {h}, {sq}, {skv}), got {mask.shape}"
        )
    return mask if mask.dtype == jnp.bool_ else mask != 0


def segment_mask(q_ids: jax.Array, kv_ids: jax.Array) -> jax.Array:
    """``(b, 1, sq, skv)`` mask in TE's convention (True = masked out) from segment ids:
    a query attends to the keys of its own segment; id 0 marks padding (never attended)."""
    allowed = (q_ids[:, :, None] == kv_ids[:, None, :]) & (kv_ids[:, None, :] != 0)
    return ~allowed[:, None]


def _segment_ids(owner: str, segment_ids: Any, b: int, sq: int, skv: int) -> jax.Array:
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(
                f"{owner}: segment_ids must be an array or a pair (q_ids, kv_ids), got "
                f"{len(segment_ids)} items"
            )
        q_ids, kv_ids = (jnp.asarray(s) for s in segment_ids)
    else:
        q_ids = kv_ids = jnp.asarray(segment_ids)
    for name, ids, s in (("q", q_ids, sq), ("kv", kv_ids, skv)):
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{owner}: segment_ids ({name}) must be integers, got {ids.dtype}")
        if ids.shape != (b, s):
            raise ValueError(
                f"{owner}: segment_ids ({name}) must have shape (batch, seq) = {(b, s)}, got "
                f"{ids.shape}"
            )
    return segment_mask(q_ids, kv_ids)


def _large_negative() -> jax.Array:
    return jnp.asarray(-0.7 * float(np.finfo(np.float32).max), jnp.float32)


def _window_allowed(sq: int, skv: int, window: tuple[int, int]) -> jax.Array:
    qp, kp = jnp.arange(sq)[:, None], jnp.arange(skv)[None, :]
    return (kp >= qp - window[0]) & (kp <= qp + window[1])


def attention_with_dropout(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    allowed: jax.Array | None,
    *,
    is_causal: bool,
    window: tuple[int, int] | None,
    scale: float,
    rate: float,
    rng: jax.Array,
) -> jax.Array:
    """Attention with dropout on the probabilities, the formula of
    :func:`jax.nn.dot_product_attention`'s XLA path (float32 logits and softmax, masked logits
    set to a large negative number) plus ``where(keep, p / (1 - rate), 0)`` with ``keep`` drawn
    by ``jax.random.bernoulli(rng, 1 - rate, (b, groups, heads_per_group, sq, skv))``.

    ``q`` ``(b, sq, h, d)``, ``k``/``v`` ``(b, skv, g, d)``; ``bias`` and ``allowed`` (True =
    attend) broadcastable to ``(b, h, sq, skv)``."""
    b, sq, h, d = q.shape
    skv, g = k.shape[1], k.shape[2]
    qg = q.reshape(b, sq, g, h // g, d)
    presets = {
        jnp.dtype(jnp.bfloat16): jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
        jnp.dtype(jnp.float16): jax.lax.DotAlgorithmPreset.F16_F16_F32,
    }
    prec = presets.get(jnp.dtype(q.dtype))
    logits = jnp.einsum("bqgrd,bkgd->bgrqk", qg, k, precision=prec,
                        preferred_element_type=jnp.float32)  # fmt: skip
    logits = logits * jnp.float32(scale)

    def grouped(t: jax.Array) -> jax.Array:
        t = jnp.broadcast_to(t, (t.shape[0], h if t.shape[1] == h else 1, sq, skv))
        if t.shape[1] == h:
            return t.reshape(t.shape[0], g, h // g, sq, skv)
        return t[:, :, None]

    if bias is not None:
        logits = logits + grouped(jnp.asarray(bias)).astype(jnp.float32)
    keep_mask = None if allowed is None else grouped(allowed)
    if is_causal:
        c = jnp.tril(jnp.ones((sq, skv), bool))
        keep_mask = c if keep_mask is None else keep_mask & c
    if window is not None:
        w = _window_allowed(sq, skv, window)
        keep_mask = w if keep_mask is None else keep_mask & w
    if keep_mask is not None:
        logits = jnp.where(keep_mask, logits, _large_negative())
    probs = jax.nn.softmax(logits, axis=-1)
    keep = jax.random.bernoulli(rng, 1.0 - rate, probs.shape)
    probs = jnp.where(keep, probs / jnp.float32(1.0 - rate), 0.0).astype(v.dtype)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", probs, v)
    return out.reshape(b, sq, h, d)


def _check_config(
    head_dim: Any,
    num_attention_heads: Any,
    num_gqa_groups: Any,
    attention_dropout: Any,
    attn_mask_type: Any,
    qkv_layout: Any,
    window_size: Any,
    implementation: Any,
) -> tuple[int, int, str, tuple[int, int] | None, str]:
    """``(heads, groups, mask type, window, layout)`` of :func:`attention_core`, validated."""
    owner = "DotProductAttention"
    heads, groups = check_heads(owner, num_attention_heads, num_gqa_groups)
    if not isinstance(head_dim, (int, np.integer)) or head_dim < 1:
        raise ValueError(f"{owner}: head_dim must be a positive int, got {head_dim!r}")
    mask_type = canonical_mask_type(attn_mask_type)
    window = check_window(owner, window_size)
    if not 0.0 <= float(attention_dropout) < 1.0:
        raise ValueError(f"{owner}: attention_dropout must be in [0, 1), got {attention_dropout!r}")
    layout = str(qkv_layout).lower()
    if layout not in _QKV_LAYOUTS:
        raise ValueError(
            f"{owner}: qkv_layout must be one of {_QKV_LAYOUTS} (the THD layouts are not "
            f"supported; use segment_ids for packed sequences), got {qkv_layout!r}"
        )
    if implementation not in (None, "xla", "cudnn"):
        raise ValueError(
            f"{owner}: implementation must be None, 'xla' or 'cudnn', got {implementation!r}"
        )
    return heads, groups, mask_type, window, layout


def _unpack(layout: str, query: Any, key: Any, value: Any) -> tuple[jax.Array, ...]:
    """``(q, k, v)`` from the inputs of ``qkv_layout`` ``layout``."""
    owner = "DotProductAttention"
    query = jnp.asarray(query)
    if layout == "bs3hd":
        if query.ndim != 5 or query.shape[2] != 3:
            raise ValueError(
                f"{owner}: with qkv_layout='bs3hd' query must be [b, s, 3, h, d], got {query.shape}"
            )
        return query[:, :, 0], query[:, :, 1], query[:, :, 2]
    key = jnp.asarray(key)
    if layout == "bshd_bs2hd":
        if key.ndim != 5 or key.shape[2] != 2:
            raise ValueError(
                f"{owner}: with qkv_layout='bshd_bs2hd' key must be [b, s, 2, g, d], got "
                f"{key.shape}"
            )
        return query, key[:, :, 0], key[:, :, 1]
    if value is None:
        raise ValueError(f"{owner}: value is required with qkv_layout='bshd_bshd_bshd'")
    return query, key, jnp.asarray(value)


def _keep_mask(
    mask_type: str,
    attn_mask_type: Any,
    sequence_descriptor: Any,
    segment_ids: Any,
    shape: tuple[int, int, int, int],
) -> jax.Array | None:
    """The padding mask in JAX's convention (True = attend), or None: nothing is padded."""
    owner = "DotProductAttention"
    b, _, sq, skv = shape
    if mask_type not in ("padding", "padding_causal"):
        if segment_ids is not None:
            raise ValueError(
                f"{owner}: segment_ids need attn_mask_type 'padding' or 'padding_causal', got "
                f"{attn_mask_type!r}"
            )
        return None
    masked = None
    if sequence_descriptor is not None:
        masked = _bool_mask(owner, "mask", sequence_descriptor, shape)
    if segment_ids is not None:
        seg = _segment_ids(owner, segment_ids, b, sq, skv)
        masked = seg if masked is None else masked | seg
    return None if masked is None else ~masked


def _checked_bias(
    bias: Any, attn_bias_type: Any, scale: float, shape: tuple[int, int, int, int]
) -> jax.Array | None:
    """``bias`` checked against ``attn_bias_type`` and ``shape``; pre-scaled for
    ``"pre_scale_bias"``."""
    owner = "DotProductAttention"
    bias_type = attn_bias_type
    if bias_type is None:
        bias_type = "no_bias" if bias is None else "post_scale_bias"
    if bias_type not in ATTN_BIAS_TYPES:
        raise ValueError(f"{owner}: attn_bias_type must be None or one of {ATTN_BIAS_TYPES}, "
                         f"got {attn_bias_type!r}")  # fmt: skip
    if (bias is None) != (bias_type == "no_bias"):
        raise ValueError(
            f"{owner}: attn_bias_type={bias_type!r} "
            + ("takes no bias" if bias is not None else "needs a bias")
        )
    if bias is None:
        return None
    bias = jnp.asarray(bias)
    if (
        bias.ndim != 4
        or any(bias.shape[i] not in (1, shape[i]) for i in range(4))
        or not jnp.issubdtype(bias.dtype, jnp.floating)
    ):
        raise ValueError(
            f"{owner}: bias must be a float array broadcastable to (b, h, sq, skv) = "
            f"{shape}, got {bias.shape} {bias.dtype}"
        )
    if bias_type == "pre_scale_bias":
        bias = bias * jnp.asarray(scale, bias.dtype)
    return bias


def attention_core(
    query: jax.Array,
    key: jax.Array | None,
    value: jax.Array | None,
    sequence_descriptor: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    head_dim: int,
    num_attention_heads: int,
    num_gqa_groups: int | None = None,
    attention_dropout: float = 0.0,
    attn_mask_type: str = "causal",
    attn_bias_type: str | None = None,
    dtype: Any = None,
    qkv_layout: str = "bshd_bshd_bshd",
    scale_factor: float | None = None,
    transpose_batch_sequence: bool = False,
    window_size: tuple[int, int] | None = None,
    context_checkpoint_name: str = "context",
    implementation: str | None = None,
    segment_ids: Any = None,
    dropout_rng: jax.Array | Callable[[], jax.Array] | None = None,
    fp8_dpa: bool = False,
    fp8: Any = None,
    context_parallel_axis: str = "",
    context_parallel_strategy: Any = "DEFAULT",
    context_parallel_causal_load_balanced: bool = False,
) -> jax.Array:
    """The attention of :class:`fp8jax.flax.DotProductAttention` as a function (no Flax): the
    arguments are its attributes and its call's, except ``dropout_rng``: the dropout key, or a
    function drawing it (called only when the dropout is active); ``None``: no dropout
    (deterministic); and ``fp8``: the module's FP8 call (``enabled``, ``recipe``, ``meta``,
    ``probe``, ``record``: :class:`fp8jax.flax._variables.Fp8Call` or NNX's), read with
    ``fp8_dpa`` only. ``context_parallel_*``: TE's context parallelism
    (:mod:`fp8jax.layers.context_parallel`).

    >>> import jax.numpy as jnp
    >>> q = jnp.ones((2, 5, 4, 8))
    >>> attention_core(q, q, q, head_dim=8, num_attention_heads=4).shape
    (2, 5, 4, 8)
    """
    owner = "DotProductAttention"
    heads, groups, mask_type, window, layout = _check_config(
        head_dim, num_attention_heads, num_gqa_groups, attention_dropout, attn_mask_type,
        qkv_layout, window_size, implementation,
    )  # fmt: skip
    cp = resolve_context_parallel(owner, context_parallel_axis, context_parallel_strategy,
                                  context_parallel_causal_load_balanced)  # fmt: skip
    q, k, v = _unpack(layout, query, key, value)
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.ndim != 4 or not jnp.issubdtype(t.dtype, jnp.floating):
            raise ValueError(
                f"{owner}: {name} must be a rank-4 float array [b, s, heads, head_dim], got "
                f"shape {t.shape} dtype {t.dtype}"
            )
    if transpose_batch_sequence:
        q, k, v = (jnp.swapaxes(t, 0, 1) for t in (q, k, v))
    b, sq = q.shape[:2]
    skv = k.shape[1]
    if q.shape[2] != heads or q.shape[3] != head_dim:
        raise ValueError(
            f"{owner}: query must have {heads} heads of width head_dim={head_dim} "
            f"(num_attention_heads), got {q.shape[2:]}"
        )
    if k.shape[2:] != (groups, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"{owner}: key and value must have {groups} heads (num_gqa_groups) of width "
            f"{head_dim} and equal shapes, got key {k.shape} value {v.shape}"
        )
    if k.shape[0] != b:
        raise ValueError(f"{owner}: query and key batch sizes differ: {b} vs {k.shape[0]}")
    dtype = dtype or jnp.result_type(q, k, v)
    q, k, v = (t.astype(dtype) for t in (q, k, v))

    shape = (b, heads, sq, skv)
    is_causal = mask_type in ("causal", "padding_causal")
    scale = 1.0 / math.sqrt(head_dim) if scale_factor is None else scale_factor
    bias = _checked_bias(bias, attn_bias_type, scale, shape)
    dropout = dropout_rng is not None and attention_dropout > 0.0
    if cp is not None:  # no [s, s] mask is built: the blocks make theirs from segment ids
        padded = mask_type in ("padding", "padding_causal")
        if segment_ids is not None and not padded:
            _keep_mask(mask_type, attn_mask_type, None, segment_ids, shape)  # raises
        refusals = dict(bias=bias is not None, attention_dropout=dropout,
                        sequence_descriptor=padded and sequence_descriptor is not None,
                        fp8_dpa=bool(fp8_dpa and fp8 is not None and fp8.enabled))  # fmt: skip
        out = context_parallel_core(
            owner, cp, q, k, v, is_causal=is_causal, window=window, scale=scale, dtype=dtype,
            segment_ids=segment_ids if padded else None, refusals=refusals,
        )  # fmt: skip
        if transpose_batch_sequence:
            out = jnp.swapaxes(out, 0, 1)
        return checkpoint_name(out, context_checkpoint_name)
    keep = _keep_mask(mask_type, attn_mask_type, sequence_descriptor, segment_ids, shape)

    jax_window = None
    if window is not None:
        big = max(sq, skv)
        left, right = (big if w < 0 else w for w in window)
        if left < big or right < big:
            jax_window = (left, right)

    out = None
    if fp8_dpa and fp8 is not None and fp8.enabled:
        out = _fp8_attention(
            q, k, v, fp8, implementation, scale=scale, is_causal=is_causal, dtype=dtype,
            refusal=dict(padded=keep is not None, bias=bias, window=jax_window, dropout=dropout),
        )  # fmt: skip
    if out is None and dropout:
        rng = dropout_rng() if callable(dropout_rng) else dropout_rng
        out = attention_with_dropout(
            q, k, v, bias, keep, is_causal=is_causal, window=jax_window, scale=scale,
            rate=float(attention_dropout), rng=rng,
        )  # fmt: skip
    elif out is None:
        kwargs = dict(scale=scale, is_causal=is_causal, local_window_size=jax_window)
        impl = choose_attention(implementation, q, k, v, bias, keep, **kwargs)
        out = jax.nn.dot_product_attention(q, k, v, bias, keep, implementation=impl, **kwargs)
    if transpose_batch_sequence:
        out = jnp.swapaxes(out, 0, 1)
    return checkpoint_name(out, context_checkpoint_name)


def _fp8_attention(q, k, v, fp8: Any, implementation: Any, *, scale: float, is_causal: bool,
                   dtype: Any, refusal: dict[str, Any]) -> jax.Array | None:  # fmt: skip
    """``fp8_dpa``'s attention (its observations recorded under calibration), or ``None``
    after the fallback's warning (:func:`~fp8jax.layers.attention_backend.refuse_or_warn`).
    ``implementation="xla"``: the FP8 reference, compiled by XLA."""
    where = getattr(fp8, "where", "") or "DotProductAttention"
    family = "xla" if implementation == "xla" else get_implementation("attention")
    reason = fp8_dpa_refusal(q, k, v, recipe=fp8.recipe, stateless=fp8.meta is None,
                             scale=scale, is_causal=is_causal, implementation=family,
                             **refusal)  # fmt: skip
    if reason is not None:
        refuse_or_warn(where, reason)
        return None
    forced = op_implementation(attention="xla") if implementation == "xla" else None
    with forced or contextlib.nullcontext():
        result = dot_product_attention_observed(
            q, k, v, fp8.meta, fp8.recipe, probe=fp8.probe, is_causal=is_causal, scale=scale,
            dtype=dtype, enabled=True, where=where,
        )  # fmt: skip
    if getattr(fp8, "record", None) is not None and result.observed is not None:
        fp8.record(result.observed)
    return result.out
