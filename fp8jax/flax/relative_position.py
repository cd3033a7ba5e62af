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

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.flax._params import annotated

__all__ = ["RelativePositionBiases", "t5_relative_buckets"]


def t5_relative_buckets(
    q_seqlen: int, k_seqlen: int, num_buckets: int, max_distance: int, bidirectional: bool
) -> np.ndarray:
    """T5's bucket of each ``(query, key)`` pair, ``(q_seqlen, k_seqlen)`` int32 (numpy).

    With ``bidirectional``, half the buckets are for keys after the query. Within a half of
    ``n`` buckets, distances below ``n/2`` get a bucket each and larger ones share
    logarithmically spaced buckets up to ``max_distance`` (and beyond, the last bucket)."""
    dist = (
        np.arange(q_seqlen, dtype=np.int64)[:, None] - np.arange(k_seqlen, dtype=np.int64)[None, :]
    )
    n = num_buckets
    bucket = np.zeros_like(dist)
    if bidirectional:
        n //= 2
        bucket += (dist < 0).astype(np.int64) * n
        dist = np.abs(dist)
    else:
        dist = np.maximum(dist, 0)
    exact = n // 2
    with np.errstate(divide="ignore"):
        log_ratio = np.log(dist.astype(np.float32) / exact + np.finfo(np.float32).eps) / np.log(
            max_distance / exact
        )
    large = exact + (log_ratio * (n - exact)).astype(np.int64)
    large = np.minimum(large, n - 1)
    bucket += np.where(dist < exact, dist, large)
    return bucket.astype(np.int32)


class RelativePositionBiases(nn.Module):
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

    num_buckets: int
    max_distance: int
    num_attention_heads: int
    embedding_init: Callable[..., Any] = nn.linear.default_embed_init
    embedding_axes: tuple[str | None, ...] = ()
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def check(self, q_seqlen: Any, k_seqlen: Any, bidirectional: bool) -> None:
        """Every refusal of a call (ValueError naming the argument). Shared with
        :class:`fp8jax.nnx.RelativePositionBiases`."""
        owner = "RelativePositionBiases"
        for name in ("num_buckets", "max_distance", "num_attention_heads"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{owner}: {name} must be a positive int, got {v!r}")
        if self.num_buckets < (4 if bidirectional else 2):
            raise ValueError(
                f"{owner}: num_buckets must be >= {4 if bidirectional else 2} "
                f"(bidirectional={bidirectional}), got {self.num_buckets}"
            )
        for name, v in (("q_seqlen", q_seqlen), ("k_seqlen", k_seqlen)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{owner}: {name} must be a positive int, got {v!r}")

    @nn.compact
    def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True) -> jax.Array:
        owner = "RelativePositionBiases"
        self.check(q_seqlen, k_seqlen, bidirectional)
        buckets = t5_relative_buckets(
            int(q_seqlen), int(k_seqlen), int(self.num_buckets), int(self.max_distance),
            bool(bidirectional),
        )  # fmt: skip
        init = annotated(owner, "embedding_axes", self.embedding_init, self.embedding_axes, 2)
        table = self.param(
            "rel_embedding", init, (self.num_attention_heads, self.num_buckets), self.param_dtype
        )
        values = jnp.take(jnp.asarray(table), jnp.asarray(buckets), axis=1)
        return values[None].astype(self.dtype or table.dtype)
