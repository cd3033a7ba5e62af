"""Flax Linen attention with TransformerEngine's argument names and params.

``MultiHeadAttention`` (here): the QKV projections (with the input norm fused in) and the output
projection in FP8, the attention core in high precision; ``DotProductAttention`` (the core,
:mod:`fp8jax.flax.dot_product_attention`) and ``RelativePositionBiases``
(:mod:`fp8jax.flax.relative_position`) are re-exported from here.

>>> import jax, jax.numpy as jnp, fp8jax
>>> from fp8jax.flax import MultiHeadAttention
>>> mha = MultiHeadAttention(head_dim=4, num_attention_heads=2)
>>> x = jnp.ones((2, 3, 8))                                  # (batch, seq, hidden)
>>> with fp8jax.autocast(enabled=True, recipe=fp8jax.Float8CurrentScaling()):
...     variables = mha.init(jax.random.key(0), x, x)
...     out, ln_out = mha.apply(variables, x, None)              # None: self-attention
>>> out.shape, ln_out is None
((2, 3, 8), True)
>>> jax.tree.map(jnp.shape, variables["params"])  # doctest: +NORMALIZE_WHITESPACE
{'out': {'kernel': (8, 8)},
 'qkv': {'kernel': (8, 3, 8), 'ln_bias': (8,), 'scale': (8,)}}
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8jax.flax.dense import DenseGeneral
from fp8jax.flax.dot_product_attention import DotProductAttention
from fp8jax.flax.layernorm import LayerNormDenseGeneral
from fp8jax.flax.relative_position import RelativePositionBiases
from fp8jax.layers.attention import MultiHeadAttentionConfig, decode_step
from fp8jax.layers.checks import check_no_score_mod
from fp8jax.layers.dense import DenseGeneralConfig
from fp8jax.layers.params import default_mha_kernel_init

__all__ = [
    "DotProductAttention",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "default_mha_kernel_init",
]


class _Cache:
    """The ``"cache"`` collection of a :class:`MultiHeadAttention` as the config's forward uses
    it (:class:`fp8jax.layers.attention.KVCache`): the first call with ``decode=True`` (``init``)
    creates ``cached_key``/``cached_value`` shaped as the full-length keys/values and
    ``cache_index`` = 0 and attends normally; each later call is a step."""

    def __init__(self, module: nn.Module, step: bool) -> None:
        self.module, self.step = module, step

    def index(self) -> jax.Array | None:
        return self.module.get_variable("cache", "cache_index") if self.step else None

    def update(self, k, v, mask, bias):
        m = self.module
        ck = m.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cv = m.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        ci = m.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not self.step:
            return k, v, mask, bias
        idx = ci.value
        k, v, mask, bias = decode_step(
            ck.value, cv.value, idx, k, v, mask, bias, seq_axis=0 if m.transpose_batch_sequence
            else 1, mask_type=m.attn_mask_type,
        )  # fmt: skip
        ck.value, cv.value, ci.value = k, v, idx + 1
        return k, v, mask, bias


class MultiHeadAttention(MultiHeadAttentionConfig, nn.Module):
    """``[norm] -> Q, K, V projections (FP8) -> [rotary] -> attention -> output projection
    (FP8)``, TransformerEngine's ``MultiHeadAttention``.

    Call: ``mha(inputs_q, inputs_kv, mask=None, bias=None, *, decode=False,
    deterministic=False, segment_ids=None)`` returns ``(out, ln_out)``: ``out`` has
    ``inputs_q``'s shape; ``ln_out`` is the query input after the norm (the raw input with
    ``input_layernorm=False``) when ``return_layernorm_output``, and also, as in TE, for
    self-attention without the packed QKV projection (GQA or ``fuse_qkv_params=False``); else
    ``None``. Self-attention is ``inputs_kv=None`` (fp8jax's, recommended) or ``inputs_q is
    inputs_kv`` (TE's rule): the keys and values are projected from the normalised query
    input. Object identity does not survive ``jax.jit`` arguments (one array passed twice
    arrives as two tracers) or ``nn.remat`` of this module (which retraces its arguments), so
    pass ``None`` there; a module initialised as self-attention with the packed ``qkv`` kernel
    and then called with a distinct ``inputs_kv`` is a ValueError that says so.
    Cross-attention projects ``inputs_kv`` as is (no norm); its width may differ.
    ``mask``/``bias``/``segment_ids`` go to :class:`~fp8jax.flax.DotProductAttention` (mask:
    ``True`` = masked out). ``decode=True``
    uses an autoregressive key/value cache in the ``"cache"`` collection, as TE: ``init`` with
    the full-length input creates it, then each ``apply(..., decode=True,
    mutable=["cache"])`` takes one token (see :meth:`_cache`).

    Params (TE's names and shapes; ``h`` hidden, ``H`` heads, ``G`` GQA groups, ``d``
    head_dim):

    - self-attention, ``fuse_qkv_params`` and ``G == H``: ``qkv`` = {``scale``, ``ln_bias``,
      ``kernel`` ``(h, 3, H*d)``, ``bias`` ``(3, H*d)``};
    - otherwise with ``fuse_qkv_params``: ``query`` = {``scale``, ``ln_bias``, ``kernel``
      ``(h, H*d)``, ``bias``} and ``kv`` = {``kernel`` ``(h_kv, 2, G*d)``, ``bias`` ``(2,
      G*d)``};
    - ``fuse_qkv_params=False``: ``query`` as above, ``key`` and ``value`` = {``kernel``
      ``(h_kv, G*d)``, ``bias``};
    - ``out`` = {``kernel`` ``(H*d, h)``, ``bias`` ``(h,)``}.

    ``scale``/``ln_bias`` exist with ``input_layernorm`` (``ln_bias`` for LayerNorm only), the
    biases with ``use_bias``. The query kernel is divided by ``sqrt(d)`` at init when
    ``scaled_query_init``; the logits are scaled by ``1/sqrt(d)`` only with
    ``scale_attn_logits`` (TE's T5-style defaults: scaled init, unscaled logits). Each of the
    projections (``qkv`` or ``query``, ``kv`` or ``key``/``value``, ``out``) is an FP8 layer
    with the 3 FP8 roles of a dense layer under ``fp8jax.autocast(enabled=True, ...)``.

    Differences from TE: ``dtype`` is the computation dtype (default promoted from inputs and
    params, as in Flax) and ``param_dtype`` the params'; logical axis names default to none
    (TE's are ``kernel (embed, [joined,] tp)`` with its own ``nvte_*`` names; fp8jax's
    :data:`~fp8jax.flax.DEFAULT_RULES` suggest ``qkv_kernel_axes=("embed", "heads")``,
    ``qkv_bias_axes=("heads",)``, ``out_kernel_axes=("heads", "embed")``,
    ``out_bias_axes=("embed",)``, ``layernorm_input_axes=("batch", "length", "embed")``);
    ``enable_sequence_parallel`` has no effect (sequence parallelism comes from logical axis
    rules); LoRA, ``softmax_type``, ``score_mod``, ``score_mod_bprop`` and TE's deprecated
    aliases (``num_heads``, ``dropout_rate``, ``output_layernorm``,
    ``apply_residual_connection_post_layernorm``, ``fuse_qkv``) are accepted at TE's defaults
    only (ValueError otherwise); in decode
    steps rotary embeddings use the cached position (TE's use position 0) and sliding windows
    and ``segment_ids`` are rejected; the attention core is not FP8
    (``recipe.fp8_mha``/``fp8_dpa`` are rejected); rotary embeddings are applied in float32
    and cast back (as TE).

    Attributes:
      head_dim, num_attention_heads, num_gqa_groups: as :class:`DotProductAttention`.
      attention_dropout, dropout_rng_name, attn_mask_type (default ``"causal"``),
        attn_bias_type, float32_logits, window_size: passed to the attention core.
      input_layernorm, layernorm_type, layernorm_epsilon, zero_centered_gamma: the norm on the
        query input.
      return_layernorm_output: see the return value above.
      kernel_init: default TE's ``variance_scaling(1.0, "fan_in", "normal")``.
      use_bias, bias_init: biases of all four projections.
      enable_rotary_pos_emb, rotary_pos_emb_windows, rotary_pos_emb_group_method: rotary
        embeddings on the projected queries and keys (:mod:`fp8jax.rotary`).
      fuse_qkv_params: one ``qkv`` (or ``kv``) kernel instead of separate ones.
      transpose_batch_sequence: inputs are ``[seq, batch, hidden]``; default ``False``
        (``[batch, seq, hidden]``), TE's since v2.10.
      scale_attn_logits, scaled_query_init: see above.
      dtype, param_dtype: see above.
      layernorm_input_axes, scale_axes, ln_bias_axes, qkv_kernel_axes (2 names: input width,
        projected width; the fused kernels get ``None`` for their stacking dim),
        qkv_bias_axes (1), out_kernel_axes (2), out_bias_axes (1): logical axis names.
      attention_implementation: ``implementation`` of the attention core.
      low_rank_adaptation_scope, low_rank_adaptation_dim, low_rank_adaptation_alpha,
        enable_sequence_parallel, softmax_type, score_mod, score_mod_bprop, num_heads,
        dropout_rate, output_layernorm, apply_residual_connection_post_layernorm, fuse_qkv:
        TE's (see above).
    """

    @nn.compact
    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_kv: jax.Array,
        mask: jax.Array | None = None,
        bias: jax.Array | None = None,
        *,
        decode: bool = False,
        deterministic: bool = False,
        segment_ids: Any = None,
        score_mod_tensors: Any = None,
        score_mod_bprop_tensors: Any = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        owner = "MultiHeadAttention"
        if inputs_kv is None:
            inputs_kv = inputs_q
        is_self = inputs_q is inputs_kv
        check_no_score_mod(owner, score_mod_tensors, score_mod_bprop_tensors)
        step = decode and self.has_variable("cache", "cached_key")
        heads, groups, inputs_q, inputs_kv = self.check(
            inputs_q, inputs_kv, decode=decode, step=step, segment_ids=segment_ids
        )
        packed = self.fuse_qkv_params and groups == heads
        if packed and not is_self and "qkv" in self.variables.get("params", {}):
            raise ValueError(
                f"{owner}: initialised as self-attention (one packed 'qkv' kernel: inputs_kv was "
                "inputs_q) but called with a different inputs_kv object. Self-attention is "
                "decided by identity (TE's rule), which jax.jit arguments (one array passed "
                "twice arrives as two tracers), nn.remat of this module and copies do not "
                "keep: pass inputs_kv=None for self-attention."
            )
        if packed and is_self and "query" in self.variables.get("params", {}):
            raise ValueError(
                f"{owner}: initialised as cross-attention ('query' and 'kv' kernels: inputs_kv "
                "was another array) but called with inputs_kv being inputs_q (or None), i.e. "
                "as self-attention. Initialise with inputs_kv=None for self-attention, or pass "
                "the key/value input as a distinct array."
            )
        configs = self.projection_configs(is_self, inputs_q.shape[-1])
        project = {name: _linen(name, c) for name, c in configs.items()}

        def core(q, k, v, mask, bias, mask_type):
            attention = DotProductAttention(
                **self.core_config(mask_type, jnp.result_type(q, k, v)),
                dropout_rng_name=self.dropout_rng_name, float32_logits=self.float32_logits,
                name="attention",
            )  # fmt: skip
            return attention(q, k, v, mask, bias, deterministic=deterministic,
                             segment_ids=segment_ids)  # fmt: skip

        cache = _Cache(self, step) if decode else None
        return self.forward(project, core, inputs_q, inputs_kv, is_self, mask, bias, cache)


def _linen(name: str, config: Any) -> nn.Module:
    """The Linen module of a projection's config."""
    cls = DenseGeneral if type(config) is DenseGeneralConfig else LayerNormDenseGeneral
    return cls(**{f: getattr(config, f) for f in config.__dataclass_fields__}, name=name)
