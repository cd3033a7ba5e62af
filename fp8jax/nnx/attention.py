"""NNX ``MultiHeadAttention``: a native ``nnx.Module`` composed of the FP8 layers of
:mod:`fp8jax.nnx` (typed attributes named as the Linen twin's submodules: ``attention.qkv``,
``attention.out``, ...), built from :class:`~fp8jax.layers.MultiHeadAttentionConfig`; FP8 in
every projection inside ``fp8jax.autocast``, the attention core in high precision (in FP8 with
``fp8_dpa``: its state in a :class:`DotProductAttention` child named ``attention``, as Linen's),
a key/value cache in ``nnx.Cache`` variables for decoding.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.functional.attention import ATTENTION_ROLES
from fp8jax.layers.attention import MultiHeadAttentionConfig, decode_step
from fp8jax.layers.attention_core import attention_core
from fp8jax.layers.checks import positive_int
from fp8jax.nnx._base import Fp8Module, Keys, check_rngs, keys_for, make_config
from fp8jax.nnx._children import child_layer
from fp8jax.nnx._probe import fp8_use

__all__ = ["DotProductAttention", "MultiHeadAttention"]


class DotProductAttention(Fp8Module):
    """The attention core (:func:`~fp8jax.layers.attention_core.attention_core`, Linen's
    :class:`fp8jax.flax.DotProductAttention`) as an NNX module: no params; with ``fp8_dpa``
    and constructed inside ``fp8jax.autocast(enabled=True, recipe=DelayedScaling(...))`` it
    holds the FP8 state of the attention's 15 roles (:data:`fp8jax.ATTENTION_ROLES`).

    Args:
      fp8_dpa: FP8 attention (Linen's ``fp8_dpa``); default ``False``.
      **config: the core's settings (``head_dim``, ``num_attention_heads``,
        ``attn_mask_type``, ...: :func:`~fp8jax.layers.attention_core.attention_core`'s
        keywords), which a call's keywords override.
    """

    def __init__(self, *, fp8_dpa: bool = False, **config: Any) -> None:
        if not isinstance(fp8_dpa, bool):
            raise TypeError(f"DotProductAttention: fp8_dpa must be a bool, got {fp8_dpa!r}")
        self.fp8_dpa = fp8_dpa
        self.config = tuple(sorted(config.items()))  # static, so hashable
        self._fp8_state(len(ATTENTION_ROLES) if fp8_dpa else None)

    def __call__(self, query, key, value, sequence_descriptor=None, bias=None, **call: Any):
        """``attention_core(query, key, value, sequence_descriptor, bias, **config, **call)``
        with this module's FP8 state."""
        fp8 = None
        if self.fp8_dpa:
            fp8 = fp8_use("DotProductAttention", self._recipe, getattr(self, "fp8_meta", None),
                          getattr(self, "fp8_probe", None))  # fmt: skip
        kw = {**dict(self.config), **call, "fp8_dpa": self.fp8_dpa}
        return attention_core(query, key, value, sequence_descriptor, bias, fp8=fp8, **kw)


class _Cache:
    """A :class:`MultiHeadAttention`'s ``nnx.Cache`` variables as the config's forward uses
    them (:class:`fp8jax.layers.attention.KVCache`): every call with ``decode=True`` is a step."""

    def __init__(self, module: MultiHeadAttention) -> None:
        self.module = module

    def index(self) -> jax.Array:
        return self.module.cache_index.get_value()

    def update(self, k, v, mask, bias):
        m, cfg = self.module, self.module.config
        index = m.cache_index.get_value()
        k, v, mask, bias = decode_step(
            m.cached_key.get_value(), m.cached_value.get_value(), index, k, v, mask, bias,
            seq_axis=0 if cfg.transpose_batch_sequence else 1, mask_type=cfg.attn_mask_type,
        )  # fmt: skip
        m.cached_key.set_value(k)
        m.cached_value.set_value(v)
        m.cache_index.set_value(index + 1)
        return k, v, mask, bias


class MultiHeadAttention(Fp8Module):
    """FP8 multi-head attention (:class:`fp8jax.flax.MultiHeadAttention`): norm fused into the
    QKV projection, ``jax.nn.dot_product_attention``, output projection; returns ``(out,
    ln_out)``.

    Self- or cross-attention is fixed at construction (the params differ: a fused ``qkv``
    kernel, or ``query`` and ``kv``): ``kv_features=None`` builds self-attention, called as
    ``mha(x)`` (or ``mha(x, x)``); an int builds cross-attention over inputs of that width,
    called as ``mha(x, encoded)``. The projections are attributes named as the Linen params:
    ``qkv`` (a :class:`~fp8jax.nnx.LayerNormDenseGeneral`) or ``query`` and ``kv`` (or
    ``key``/``value``: :class:`~fp8jax.nnx.DenseGeneral`), and ``out``.

    Decoding: :meth:`init_cache` creates the key/value cache (``nnx.Cache`` variables
    ``cached_key``, ``cached_value``, ``cache_index``), then each ``mha(token, decode=True)``
    takes one token, attends to the cached positions up to its own and advances the index.

    Args:
      in_features: width of ``inputs_q`` (and of the output).
      head_dim, num_attention_heads: as the Linen twin.
      kv_features: see above.
      **config: the twin's other attributes (``num_gqa_groups``, ``attn_mask_type``,
        ``attention_dropout``, ``enable_rotary_pos_emb``, ``transpose_batch_sequence``,
        logical axis names, ...).
      deterministic: dropout off (``model.eval()`` sets it).
      rngs: ``rngs.params()`` draws the init key; the dropout stream is forked and kept.
    """

    def __init__(
        self,
        in_features: int,
        *,
        head_dim: int | None = None,
        num_attention_heads: int | None = None,
        kv_features: int | None = None,
        deterministic: bool = False,
        rngs: nnx.Rngs,
        _config: MultiHeadAttentionConfig | None = None,
        _keys: Keys | None = None,
        **config: Any,
    ) -> None:
        owner = "MultiHeadAttention"
        check_rngs(owner, rngs)
        self.in_features = positive_int(owner, "in_features", in_features)
        self.kv_features = None if kv_features is None else positive_int(
            owner, "kv_features", kv_features
        )  # fmt: skip
        if _config is None:
            if head_dim is None or num_attention_heads is None:
                raise TypeError(f"{owner}: head_dim and num_attention_heads are required")
            _config = make_config(owner, MultiHeadAttentionConfig, config, head_dim=head_dim,
                                  num_attention_heads=num_attention_heads)  # fmt: skip
        self.config = _config
        heads, _ = _config.check_config()
        keys = keys_for(owner, rngs, _keys)
        is_self = self.kv_features is None
        widths = {"qkv": self.in_features, "query": self.in_features,
                  "out": heads * int(_config.head_dim)}  # fmt: skip
        kv_width = self.in_features if is_self else self.kv_features
        configs = _config.projection_configs(is_self, self.in_features)
        for name, child in configs.items():
            width = widths.get(name, kv_width)
            layer = child_layer(child, width, keys.child(name), rngs, deterministic)
            setattr(self, name, layer)
        self._projections = tuple(configs)
        if _config.fp8_dpa:  # the core's FP8 state, where Linen keeps it (``attention``)
            self.attention = DotProductAttention(fp8_dpa=True)
        self._fp8_state(None)
        self._dropout_stream(rngs, _config.dropout_rng_name, deterministic)

    def init_cache(self, input_shape: tuple[int, ...], dtype: Any = None) -> None:
        """Creates an empty key/value cache for decoding inputs of ``input_shape``
        (``(batch, max_length, in_features)``, or ``(max_length, batch, in_features)`` with
        ``transpose_batch_sequence``) and sets its index to 0; ``dtype`` of the cached keys
        and values (default: ``dtype``, else ``param_dtype``)."""
        owner = "MultiHeadAttention.init_cache"
        try:
            shape = tuple(int(s) for s in input_shape)
        except TypeError:
            raise TypeError(
                f"{owner}: input_shape must be a tuple of ints, got {input_shape!r}"
            ) from None
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(
                f"{owner}: input_shape must be (batch, max_length, features) (or (max_length, "
                f"batch, features) with transpose_batch_sequence), got {input_shape!r}"
            )
        cfg = self.config
        dtype = dtype or cfg.dtype or cfg.param_dtype
        kv_shape = cfg.cache_shape(shape)
        self.cached_key = nnx.Cache(jnp.zeros(kv_shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(kv_shape, dtype))
        self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_kv: jax.Array | None = None,
        mask: jax.Array | None = None,
        bias: jax.Array | None = None,
        *,
        decode: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
        segment_ids: Any = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """Attention of ``inputs_q`` over itself (self-attention) or over ``inputs_kv``;
        ``mask`` is True where attention is *not* allowed; ``decode``: one token against the
        cache (see :meth:`init_cache`)."""
        owner, cfg = "MultiHeadAttention", self.config
        is_self = inputs_kv is None or inputs_kv is inputs_q
        if is_self != (self.kv_features is None):
            built = "self" if self.kv_features is None else "cross"
            raise ValueError(
                f"{owner}: built for {built}-attention (kv_features={self.kv_features}); "
                f"call it with {'inputs_kv=None' if built == 'self' else 'inputs_kv'} "
                "(the params of self- and cross-attention differ)"
            )
        deterministic = self._deterministic(deterministic)
        # decode=True is always a step here: init_cache made the cache
        _, _, inputs_q, inputs_kv = cfg.check(
            inputs_q, inputs_q if is_self else inputs_kv, decode=decode, step=decode,
            segment_ids=segment_ids,
        )  # fmt: skip
        if decode and not hasattr(self, "cache_index"):
            raise ValueError(f"{owner}: decode=True needs a cache: call init_cache first")
        dropout_rng = None if deterministic else functools.partial(self._dropout_key, rngs)

        def core(q, k, v, mask, bias, mask_type):
            run = getattr(self, "attention", None) or attention_core
            return run(
                q, k, v, mask, bias, **cfg.core_config(mask_type, jnp.result_type(q, k, v)),
                segment_ids=segment_ids, dropout_rng=dropout_rng,
            )  # fmt: skip

        project = {name: getattr(self, name) for name in self._projections}
        cache = _Cache(self) if decode else None
        return cfg.forward(project, core, inputs_q, inputs_kv, is_self, mask, bias, cache)
