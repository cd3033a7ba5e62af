"""Flax Linen ``RelativePositionBiases``: T5's relative position biases for the attention
logits, with TransformerEngine's argument names and param.

>>> import jax
>>> from fp8jax.flax import RelativePositionBiases
>>> rpb = RelativePositionBiases(num_buckets=8, max_distance=16, num_attention_heads=2)
>>> variables = rpb.init(jax.random.key(0), 3, 4)
>>> variables["params"]["rel_embedding"].shape, rpb.apply(variables, 3, 4).shape
((2, 8), (1, 2, 3, 4))
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fp8jax.flax._params import declare
from fp8jax.layers.relative_position import RelativePositionBiasesConfig, t5_relative_buckets

__all__ = ["RelativePositionBiases", "t5_relative_buckets"]


class RelativePositionBiases(RelativePositionBiasesConfig, nn.Module):
    """T5-style relative position biases for the attention logits.

    ``rpb(q_seqlen, k_seqlen, bidirectional=True)`` returns ``(1, num_attention_heads,
    q_seqlen, k_seqlen)``: entry ``[0, h, i, j]`` is ``rel_embedding[h, bucket(j - i)]`` with
    T5's buckets (:func:`t5_relative_buckets`). Pass it as the ``bias`` of
    :class:`~fp8jax.flax.DotProductAttention`/:class:`~fp8jax.flax.MultiHeadAttention`.

    Param: ``rel_embedding`` ``(num_attention_heads, num_buckets)`` (TE's name and shape).

    Differences from TE: ``embedding_axes`` defaults to none (``()``; TE annotates
    ``("heads", "relpos_buckets")``); ``dtype`` is the output dtype (default the param's) and
    ``param_dtype`` the param's (TE's ``dtype`` is both); the lookup is a gather (TE: a one-hot
    matmul; the same values).

    Attributes:
      num_buckets: number of buckets (both directions together when bidirectional).
      max_distance: distances beyond it share the last bucket.
      num_attention_heads: one bias per head.
      embedding_init: initializer of ``rel_embedding`` (Flax's ``default_embed_init``).
      embedding_axes: logical axis names of ``rel_embedding`` (``()``: none).
      dtype, param_dtype: output and param dtypes.
    """

    @nn.compact
    def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True) -> jax.Array:
        self.check(q_seqlen, k_seqlen, bidirectional)
        params = declare(self, "RelativePositionBiases", self.param_specs())
        return self.forward(params["rel_embedding"], q_seqlen, k_seqlen, bidirectional)
