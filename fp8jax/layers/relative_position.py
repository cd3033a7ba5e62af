"""The config of ``RelativePositionBiases`` (T5's relative position biases for the attention
logits) and T5's bucketing, shared by both Flax APIs; :class:`fp8jax.flax.RelativePositionBiases`
documents the fields."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.layers.checks import positive_int
from fp8jax.layers.params import ParamSpec, default_embed_init

__all__ = ["RelativePositionBiasesConfig", "t5_relative_buckets"]


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


@dataclasses.dataclass(unsafe_hash=True)
class RelativePositionBiasesConfig:
    """The config of ``RelativePositionBiases`` (:class:`fp8jax.flax.RelativePositionBiases`
    documents the fields)."""

    num_buckets: int
    max_distance: int
    num_attention_heads: int
    embedding_init: Callable[..., Any] = default_embed_init
    embedding_axes: tuple[str | None, ...] = ()
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def check(self, q_seqlen: Any, k_seqlen: Any, bidirectional: bool) -> None:
        """Every refusal of a call (ValueError naming the argument)."""
        owner = "RelativePositionBiases"
        self.check_config()
        if self.num_buckets < (4 if bidirectional else 2):
            raise ValueError(
                f"{owner}: num_buckets must be >= {4 if bidirectional else 2} "
                f"(bidirectional={bidirectional}), got {self.num_buckets}"
            )
        for name, v in (("q_seqlen", q_seqlen), ("k_seqlen", k_seqlen)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{owner}: {name} must be a positive int, got {v!r}")

    def check_config(self) -> None:
        """The refusals of the configuration alone."""
        for name in ("num_buckets", "max_distance", "num_attention_heads"):
            positive_int("RelativePositionBiases", name, getattr(self, name))

    def param_specs(self) -> dict[str, ParamSpec]:
        """``rel_embedding`` ``(num_attention_heads, num_buckets)``."""
        shape = (int(self.num_attention_heads), int(self.num_buckets))
        spec = ParamSpec(shape, self.param_dtype, self.embedding_init, tuple(self.embedding_axes),
                         "embedding_axes")  # fmt: skip
        return {"rel_embedding": spec}

    def forward(
        self, table: jax.Array, q_seqlen: int, k_seqlen: int, bidirectional: bool
    ) -> jax.Array:
        """The biases ``(1, heads, q_seqlen, k_seqlen)`` from the embedding ``table``."""
        buckets = t5_relative_buckets(
            int(q_seqlen), int(k_seqlen), int(self.num_buckets), int(self.max_distance),
            bool(bidirectional),
        )  # fmt: skip
        values = jnp.take(jnp.asarray(table), jnp.asarray(buckets), axis=1)
        return values[None].astype(self.dtype or table.dtype)
