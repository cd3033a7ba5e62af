"""Fixtures of the multi-device tests."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture
def gspmd():
    """The GSPMD partitioner (the default before Shardy), where JAX still has it."""
    if not hasattr(jax.config, "jax_use_shardy_partitioner"):
        pytest.skip("this JAX has no GSPMD partitioner switch")
    old = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", old)
