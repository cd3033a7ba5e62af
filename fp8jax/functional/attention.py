"""``fp8jax.dot_product_attention``: scaled dot-product attention with FP8 operands (TE's
``fp8_dpa``) as a ``jax.custom_vjp`` over :mod:`fp8jax.ops.attention`.

Forward: the query, key and value are cast to E4M3 (fp8jax's ``quantize``, amax observed) and
the FP8 attention runs on the codes: cuDNN's fused FP8 flash attention on a GPU, its reference
elsewhere; its FP8 output is read back in ``dtype``. Backward: the output gradient is cast to
E4M3 and the FP8 attention's backward gives the FP8 gradients of q, k and v, read back in their
dtypes. Every tensor is E4M3, the gradients too, whatever the recipe's backward format: XLA's
cuDNN FP8 attention takes one FP8 type (:mod:`fp8jax.ops.attention.fp8_attention`).

FP8 roles (:data:`ATTENTION_ROLES`, 15 rows of the layer's ``Fp8Meta``, laid out as five GEMM
triples so that the state, its update and its checkpoints are a GEMM layer's): the ten tensors
sit in the triples' first two rows, which keep the recipe's forward format, E4M3, so each row's
scale is its tensor's E4M3 scale; the triples' third rows (the backward format's) are unused.
Under delayed scaling every tensor's scale is its row's; under current scaling the tensors
cast here (q, k, v, dO) take their own amax, and so do those the attention makes (P, O, dS,
dQ, dK, dV): the reference only, since cuDNN needs their scales before it runs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.functional import _core as core
from fp8jax.functional._vjp import layer_vjp, zeros_if_symbolic
from fp8jax.ops.attention.fp8_attention import (
    FP8_ATTENTION_DTYPE,
    AttentionScales,
    fp8_attention_backward,
    fp8_attention_forward,
)
from fp8jax.ops.casts.quantize import quantize
from fp8jax.recipe import Recipe
from fp8jax.state import Fp8Meta

__all__ = ["ATTENTION_ROLES", "dot_product_attention", "dot_product_attention_observed"]

#: The FP8 roles of :func:`dot_product_attention`, in row order of its ``Fp8Meta``.
ATTENTION_ROLES: tuple[str, ...] = (
    "query", "key", "unused_0",
    "probs", "value", "unused_1",
    "output", "grad_output", "unused_2",
    "grad_scores", "grad_query", "unused_3",
    "grad_key", "grad_value", "unused_4",
)  # fmt: skip
_N = len(ATTENTION_ROLES)
_ROW = {name: i for i, name in enumerate(ATTENTION_ROLES)}
_UNUSED = np.array([i for i, name in enumerate(ATTENTION_ROLES) if name.startswith("unused")])
_E4M3 = FP8_ATTENTION_DTYPE


class _Config(NamedTuple):
    setup: core.Fp8Setup
    causal: bool
    scale: float
    dtype: Any  # output dtype
    dtypes: tuple[Any, Any, Any]  # q, k, v as given (their gradients' dtypes)


def _cast(setup: core.Fp8Setup, x: jax.Array, scale: jax.Array):
    """``x`` cast to E4M3 (its own scale under current scaling): ``(codes, scale, 1 / scale,
    amax)``; the amax is reduced over the whole mesh, as every layer's."""
    scale = core.scale_for(setup, x, scale, _E4M3)
    q, sinv, amax = quantize(x, scale, _E4M3, amax_reduction="mesh",
                             implementation=setup.implementation("cast"))  # fmt: skip
    return q, scale, sinv, amax


def _scales(cfg: _Config, sc: jax.Array, q_s, k_s, v_s) -> AttentionScales:
    """The attention's scales: delayed, the rows'; current, None for what the attention makes
    (and dO's, taken from the gradient when it is cast)."""
    if cfg.setup.current_scaling:
        return AttentionScales(q_s, k_s, v_s, *([None] * 7))
    r = {name: sc[i] for name, i in _ROW.items()}
    return AttentionScales(
        q_s, k_s, v_s, r["probs"], r["output"], r["grad_output"], r["grad_scores"],
        r["grad_query"], r["grad_key"], r["grad_value"],
    )  # fmt: skip


def _forward(cfg: _Config, q, k, v, scale):
    s, sc = cfg.setup, scale
    q8, q_s, _, q_amax = _cast(s, q, sc[_ROW["query"]])
    k8, k_s, _, k_amax = _cast(s, k, sc[_ROW["key"]])
    v8, v_s, _, v_amax = _cast(s, v, sc[_ROW["value"]])
    scales = _scales(cfg, sc, q_s, k_s, v_s)
    impl = s.implementation("attention")
    fwd = fp8_attention_forward(q8, k8, v8, scales, scale=cfg.scale, causal=cfg.causal,
                                implementation=impl)  # fmt: skip
    out = (fwd.out.astype(jnp.float32) * fwd.out_scale_inv).astype(cfg.dtype)
    seen = jnp.full((_N,), jnp.nan, jnp.float32)  # NaN: "not observed" (the backward's roles)
    for name, amax in (("query", q_amax), ("key", k_amax), ("value", v_amax),
                       ("probs", fwd.amax_s), ("output", fwd.amax_o)):  # fmt: skip
        seen = seen.at[_ROW[name]].set(jnp.asarray(amax, jnp.float32).reshape(()))
    return (out, seen), (fwd.residuals, scales, seen, sc[_ROW["grad_output"]])


def _backward(cfg: _Config, res, cts):
    s = cfg.setup
    residuals, scales, seen, do_row = res
    g = zeros_if_symbolic(cts[0])
    do8, do_s, do_sinv, do_amax = _cast(s, g, do_row)
    scales = scales._replace(do=do_s)
    bwd = fp8_attention_backward(
        residuals, do8, do_sinv, scales, scale=cfg.scale, causal=cfg.causal,
        implementation=s.implementation("attention"),
    )  # fmt: skip
    grads = tuple(
        (t.astype(jnp.float32) * inv).astype(dt)
        for t, inv, dt in zip((bwd.dq, bwd.dk, bwd.dv), bwd.scale_inv, cfg.dtypes, strict=True)
    )
    # the unused rows observe 0, not NaN: a NaN gradient would make the step non-finite
    observed = seen.at[_UNUSED].set(0.0)
    for name, amax in (("grad_output", do_amax), ("grad_scores", bwd.amax_dp),
                       ("grad_query", bwd.amax_dq), ("grad_key", bwd.amax_dk),
                       ("grad_value", bwd.amax_dv)):  # fmt: skip
        observed = observed.at[_ROW[name]].set(jnp.asarray(amax, jnp.float32).reshape(()))
    return grads, observed


_attention = layer_vjp(_forward, _backward, "dot_product_attention")


def _check(where: str, q: Any, k: Any, v: Any, dtype: Any) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not hasattr(t, "dtype") or jnp.ndim(t) != 4 or jnp.dtype(t.dtype) not in core.WIDE:
            raise TypeError(f"{where}: {name} must be a float32/bfloat16/float16 array [batch, "
                            f"seq, heads, head_dim], got {t!r:.80}")  # fmt: skip
    (b, _, h, d), kv = q.shape, k.shape
    if v.shape != kv or kv[0] != b or kv[3] != d or h % kv[2]:
        raise ValueError(
            f"{where}: key and value must be equal [batch, seq_kv, groups, head_dim] with the "
            f"query's batch and head_dim and groups dividing its heads; got query {q.shape}, "
            f"key {kv}, value {v.shape}"
        )
    if jnp.dtype(dtype) not in core.WIDE:
        raise TypeError(f"{where}: dtype must be float32, bfloat16 or float16, got {dtype!r}")


def dot_product_attention_observed(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    fp8_meta: Fp8Meta | None,
    recipe: Recipe | None,
    *,
    probe: jax.Array | None,
    is_causal: bool,
    scale: float,
    dtype: Any,
    enabled: bool | None,
    where: str = "fp8jax.dot_product_attention",
) -> core.LayerOutput:
    """:func:`dot_product_attention` with its forward observations (``float32[15]``, NaN for
    the backward's roles; ``None`` with FP8 off), what the modules call."""
    dtype = jnp.dtype(dtype if dtype is not None else jnp.result_type(query, key, value))
    _check(where, query, key, value, dtype)
    setup, scale_vec, probe = core.resolve(where, recipe, enabled, fp8_meta, probe, _N,
                                           families=("attention",))  # fmt: skip
    if setup is None:
        out = jax.nn.dot_product_attention(
            query.astype(dtype), key.astype(dtype), value.astype(dtype), scale=scale,
            is_causal=is_causal, implementation="xla",
        )  # fmt: skip
        return core.LayerOutput(out, None, None)
    if setup.blocks is not None or setup.rowwise is not None:
        raise ValueError(f"{where}: block-scaled and row-wise recipes have no FP8 attention "
                         f"({setup.recipe_name}; per-tensor DelayedScaling or "
                         "Float8CurrentScaling only)")  # fmt: skip
    if jnp.dtype(setup.fwd_dtype) != _E4M3:  # (resolve refuses Format.E5M2 already)
        raise ValueError(f"{where}: FP8 attention runs in E4M3, the recipe's forward format "
                         f"is {setup.fwd_dtype}")  # fmt: skip
    cfg = _Config(setup, bool(is_causal), float(scale), dtype,
                  (query.dtype, key.dtype, value.dtype))  # fmt: skip
    out, seen = _attention(cfg, (query, key, value), scale_vec, probe)
    return core.LayerOutput(out, None, seen)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    fp8_meta: Fp8Meta | None = None,
    recipe: Recipe | None = None,
    *,
    probe: jax.Array | None = None,
    is_causal: bool = True,
    scale: float | None = None,
    dtype: Any = None,
    enabled: bool | None = None,
) -> jax.Array:
    """Scaled dot-product attention ``softmax(scale q k^T) v`` with FP8 operands (module
    docstring); with FP8 off, :func:`jax.nn.dot_product_attention` in ``dtype``.

    FP8 on or off and the recipe as :func:`fp8jax.dense` decides them; per-tensor recipes only
    (``DelayedScaling``: ``fp8_meta`` of 15 roles, :data:`ATTENTION_ROLES`, and ``probe``
    ``float32[15]``, differentiated like a GEMM layer's).

    Args:
      query: ``[batch, seq_q, heads, head_dim]``; key, value: ``[batch, seq_kv, groups,
        head_dim]`` (``groups`` divides ``heads``).
      is_causal: a query attends to the keys up to its own position; else to all.
      scale: the logits' scale (default ``1 / sqrt(head_dim)``).
      dtype: the output's dtype (default: the inputs' promoted one).

    >>> import jax.numpy as jnp, fp8jax
    >>> q = jnp.ones((1, 4, 2, 8))
    >>> recipe = fp8jax.DelayedScaling(amax_history_len=4)
    >>> meta = fp8jax.init_fp8_meta(recipe, n_roles=len(fp8jax.ATTENTION_ROLES))
    >>> fp8jax.dot_product_attention(q, q, q, meta, recipe).shape
    (1, 4, 2, 8)
    """
    d = jnp.shape(query)[-1] if jnp.ndim(query) else 1
    scale = 1.0 / float(np.sqrt(d)) if scale is None else float(scale)
    return dot_product_attention_observed(
        query, key, value, fp8_meta, recipe, probe=probe, is_causal=is_causal, scale=scale,
        dtype=dtype, enabled=enabled,
    ).out  # fmt: skip
