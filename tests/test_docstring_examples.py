"""The docstring examples of the layers run as written (``doctest``)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "fp8jax.state",
    "fp8jax.functional.dense",
    "fp8jax.functional.layernorm",
    "fp8jax.functional.mlp",
    "fp8jax.functional.grouped_dense",
    "fp8jax.functional.moe",
    "fp8jax.functional.context_parallel",
    "fp8jax.functional.load_balancing",
    "fp8jax.ops.gemms.grouped_gemm",
    "fp8jax.ops.block.grouped_scaling",
    "fp8jax.ops.block.rowwise",
    "fp8jax.flax.attention",
    "fp8jax.flax.dense",
    "fp8jax.flax.layernorm",
    "fp8jax.flax.mlp",
    "fp8jax.flax.moe",
    "fp8jax.flax.transformer",
    "fp8jax.flax.twin",
    "fp8jax.layers.attention_core",
    "fp8jax.nnx.dense",
    "fp8jax.nnx.moe",
    "fp8jax.nnx.train",
    "fp8jax.nnx.transformer",
    "fp8jax.te.convert",
]


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, verbose=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0
