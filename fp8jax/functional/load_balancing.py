"""TransformerEngine's batch reorder for causal load balancing under context parallelism.

With a causal mask, the devices holding the sequence's last tokens attend to many more keys
than those holding its first ones. Reordering the sequence before splitting it over the
context axis evens that out. ``ReorderStrategy.DualChunkSwap`` (what
``context_parallel_causal_load_balanced=True`` expects, TE's for the BSHD layouts) cuts the
sequence into ``2 * cp_size`` chunks and gives device ``i`` chunks ``i`` and
``2 * cp_size - 1 - i``; ``ReorderStrategy.Striped`` deals the tokens out in stripes of
``stripe_size``. Same names, arguments and layouts as TE's
``transformer_engine.jax.attention.reorder_causal_load_balancing`` and its inverse.

>>> import jax.numpy as jnp
>>> from fp8jax.functional.load_balancing import ReorderStrategy, reorder_causal_load_balancing
>>> reorder_causal_load_balancing(jnp.arange(8), ReorderStrategy.DualChunkSwap, 2, 0).tolist()
[0, 1, 6, 7, 2, 3, 4, 5]
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ReorderStrategy",
    "inverse_reorder_causal_load_balancing",
    "reorder_causal_load_balancing",
    "reorder_permutation",
]


class ReorderStrategy(enum.Enum):
    """TE's token orders for causal load balancing (its member names and values)."""

    DualChunkSwap = 0
    Striped = 1


def reorder_permutation(
    seq_len: int, strategy: ReorderStrategy, cp_size: int, stripe_size: int | None = None
) -> np.ndarray:
    """``perm`` (int32 ``[seq_len]``) with ``reordered[j] = original[perm[j]]``: also the
    original position of the token each slot of the reordered sequence holds.

    Raises:
      TypeError: ``strategy`` is not a :class:`ReorderStrategy`.
      ValueError: ``cp_size`` is not positive, ``seq_len`` is not a multiple of
        ``2 * cp_size`` (DualChunkSwap) or ``cp_size * stripe_size`` (Striped), or
        ``stripe_size`` is given for DualChunkSwap or is not positive.
    """
    if not isinstance(strategy, ReorderStrategy):
        raise TypeError(f"strategy must be a ReorderStrategy, got {strategy!r}")
    if not isinstance(cp_size, (int, np.integer)) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    idx = np.arange(seq_len, dtype=np.int32)
    if strategy is ReorderStrategy.DualChunkSwap:
        if stripe_size is not None:
            raise ValueError(f"stripe_size must be None with DualChunkSwap, got {stripe_size!r}")
        if cp_size == 1:
            return idx
        if seq_len % (2 * cp_size):
            raise ValueError(
                f"the sequence length {seq_len} must be a multiple of 2 * cp_size = {2 * cp_size}"
            )
        chunks = idx.reshape(2 * cp_size, -1)
        order = [c for i in range(cp_size) for c in (i, 2 * cp_size - 1 - i)]
        return chunks[order].reshape(-1)
    stripe = 1 if stripe_size is None else stripe_size
    if not isinstance(stripe, (int, np.integer)) or isinstance(stripe, bool) or stripe < 1:
        raise ValueError(f"stripe_size must be a positive int or None, got {stripe_size!r}")
    if seq_len % (cp_size * stripe):
        raise ValueError(
            f"the sequence length {seq_len} must be a multiple of cp_size * stripe_size = "
            f"{cp_size * stripe}"
        )
    return idx.reshape(-1, cp_size, stripe).swapaxes(0, 1).reshape(-1)


def _take(tensor: jax.Array, perm: np.ndarray, seq_dim: int) -> jax.Array:
    tensor = jnp.asarray(tensor)
    if not -tensor.ndim <= seq_dim < tensor.ndim:
        raise ValueError(f"seq_dim={seq_dim} is out of range for a tensor of rank {tensor.ndim}")
    return jnp.take(tensor, jnp.asarray(perm), axis=seq_dim)


def reorder_causal_load_balancing(
    tensor: jax.Array,
    strategy: ReorderStrategy,
    cp_size: int,
    seq_dim: int,
    stripe_size: int | None = None,
) -> jax.Array:
    """``tensor`` with its ``seq_dim`` reordered for causal load balancing over ``cp_size``
    context-parallel devices (TE's function; errors as :func:`reorder_permutation`)."""
    n = jnp.shape(tensor)[seq_dim] if -jnp.ndim(tensor) <= seq_dim < jnp.ndim(tensor) else 0
    return _take(tensor, reorder_permutation(n, strategy, cp_size, stripe_size), seq_dim)


def inverse_reorder_causal_load_balancing(
    tensor: jax.Array,
    strategy: ReorderStrategy,
    cp_size: int,
    seq_dim: int,
    stripe_size: int | None = None,
) -> jax.Array:
    """The inverse of :func:`reorder_causal_load_balancing` (TE's function): the original
    order back."""
    n = jnp.shape(tensor)[seq_dim] if -jnp.ndim(tensor) <= seq_dim < jnp.ndim(tensor) else 0
    perm = reorder_permutation(n, strategy, cp_size, stripe_size)
    return _take(tensor, np.argsort(perm).astype(np.int32), seq_dim)
