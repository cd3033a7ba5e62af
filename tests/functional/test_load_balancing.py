"""TE's causal load-balancing reorder (fp8jax.functional.load_balancing): TE's documented
layouts, the inverse, and the argument errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.functional.load_balancing import (
    ReorderStrategy,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
    reorder_permutation,
)


def test_dual_chunk_swap_is_tes_layout():
    # TE's reorder_causal_dual_chunk_swap: device i holds chunks i and 2 * cp - 1 - i of 2 * cp
    # (its ReorderStrategy docstring's example for 4 GPUs disagrees with its code after GPU0)
    out = reorder_causal_load_balancing(jnp.arange(16), ReorderStrategy.DualChunkSwap, 4, 0)
    assert out.reshape(4, 4).tolist() == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]
    ]  # fmt: skip


def test_striped_is_tes_documented_layout():
    out = reorder_causal_load_balancing(jnp.arange(16), ReorderStrategy.Striped, 4, 0)
    assert out.reshape(4, 4).tolist() == [
        [0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]
    ]  # fmt: skip
    out = reorder_causal_load_balancing(jnp.arange(16), ReorderStrategy.Striped, 2, 0, 2)
    assert out.tolist() == [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]


@pytest.mark.parametrize(
    "strategy, cp, stripe",
    [(ReorderStrategy.DualChunkSwap, 2, None), (ReorderStrategy.DualChunkSwap, 1, None),
     (ReorderStrategy.Striped, 4, None), (ReorderStrategy.Striped, 2, 3)],
)  # fmt: skip
def test_inverse_undoes_the_reorder_on_any_seq_dim(strategy, cp, stripe):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 24, 2)))
    y = reorder_causal_load_balancing(x, strategy, cp, 1, stripe)
    assert y.shape == x.shape
    np.testing.assert_array_equal(
        inverse_reorder_causal_load_balancing(y, strategy, cp, 1, stripe), x
    )
    perm = reorder_permutation(24, strategy, cp, stripe)
    np.testing.assert_array_equal(y, x[:, perm])


def test_errors_name_the_argument():
    x = jnp.zeros((2, 12))
    with pytest.raises(ValueError, match="multiple of 2 \\* cp_size"):
        reorder_causal_load_balancing(x, ReorderStrategy.DualChunkSwap, 4, 1)
    with pytest.raises(ValueError, match="stripe_size must be None"):
        reorder_causal_load_balancing(x, ReorderStrategy.DualChunkSwap, 2, 1, 2)
    with pytest.raises(ValueError, match="stripe_size must be a positive"):
        reorder_causal_load_balancing(x, ReorderStrategy.Striped, 2, 1, 0)
    with pytest.raises(ValueError, match="cp_size must be a positive"):
        inverse_reorder_causal_load_balancing(x, ReorderStrategy.Striped, 0, 1)
    with pytest.raises(ValueError, match="seq_dim=2 is out of range"):
        reorder_causal_load_balancing(x, ReorderStrategy.Striped, 2, 2)
    with pytest.raises(TypeError, match="strategy must be a ReorderStrategy"):
        reorder_causal_load_balancing(x, "DualChunkSwap", 2, 1)
