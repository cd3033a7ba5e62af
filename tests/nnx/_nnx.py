"""Shared by the fp8jax.nnx tests: the recipe, a small TransformerLayer config and a bitwise
tree comparison (inputs: ``_shared.rand``)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from fp8jax import DelayedScaling

RECIPE = DelayedScaling(amax_history_len=4)
TRANSFORMER = dict(
    hidden_size=16, mlp_hidden_size=32, num_attention_heads=2, hidden_dropout=0.0,
    attention_dropout=0.0, intermediate_dropout=0.0,
)  # fmt: skip


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(autouse=True)
def float32_matmuls():
    """Full float32 high-precision references on a GPU too (no TF32); autouse in every module
    that imports it."""
    with jax.default_matmul_precision("float32"):
        yield
