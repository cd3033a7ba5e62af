"""NNX ``RelativePositionBiases``: T5 relative position biases over
:class:`~fp8jax.layers.RelativePositionBiasesConfig`."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from fp8jax.layers.relative_position import RelativePositionBiasesConfig
from fp8jax.nnx._base import Fp8Module, Keys, keys_for, make_config

__all__ = ["RelativePositionBiases"]


class RelativePositionBiases(Fp8Module):
    """T5 relative position biases (:class:`fp8jax.flax.RelativePositionBiases`): param
    ``rel_embedding`` ``(num_attention_heads, num_buckets)``; ``rpb(q_len, k_len,
    bidirectional=True)`` returns ``(1, heads, q_len, k_len)``."""

    def __init__(
        self,
        num_buckets: int,
        max_distance: int,
        num_attention_heads: int,
        *,
        rngs: nnx.Rngs | None = None,
        _config: RelativePositionBiasesConfig | None = None,
        _keys: Keys | None = None,
        **config: Any,
    ) -> None:
        owner = "RelativePositionBiases"
        if _config is None:
            _config = make_config(owner, RelativePositionBiasesConfig, config,
                                  num_buckets=num_buckets, max_distance=max_distance,
                                  num_attention_heads=num_attention_heads)  # fmt: skip
        self.config = _config
        _config.check_config()
        self._draw(owner, _config.param_specs(), keys_for(owner, rngs, _keys))
        self._recipe = None

    def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True) -> jax.Array:
        self.config.check(q_seqlen, k_seqlen, bidirectional)
        table = self.rel_embedding.get_value()
        return self.config.forward(table, q_seqlen, k_seqlen, bidirectional)
