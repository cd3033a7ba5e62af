"""Helpers of the fp8jax.te layer tests: a TE-style delayed-scaling state (per role scale and
history) for ``g`` GEMMs, its quantizer sets, and the same state as fp8jax's Fp8Meta."""

from __future__ import annotations

import jax.numpy as jnp

import fp8jax
from fp8jax.te.jax.quantize import ROLES, QuantizerFactory


def te_states(recipe, gemms: int) -> list | None:
    """One state per GEMM with some history already in it; ``None`` for a stateless recipe."""
    if not recipe.keeps_state:
        return None
    length = recipe.amax_history_len
    return [
        {
            r: {
                "scale": jnp.full((1,), 2.0 ** (i - 1)),
                "amax_history": jnp.arange(length) + float(i),
            }
            for i, r in enumerate(ROLES, start=3 * g)
        }
        for g in range(gemms)
    ]


def quantizer_sets(recipe, states, gemms: int) -> tuple:
    """The quantizer sets of ``states`` (or stateless ones)."""
    if states is None:
        return tuple(QuantizerFactory.create_set(fp8_recipe=recipe) for _ in range(gemms))
    return tuple(
        QuantizerFactory.create_set(
            fp8_recipe=recipe,
            quantize_meta_set={r: (s[r]["scale"], s[r]["amax_history"]) for r in ROLES},
        )
        for s in states
    )


def as_meta(states) -> fp8jax.Fp8Meta | None:
    """The states as one fp8jax Fp8Meta (rows x, kernel, grad of each GEMM)."""
    if states is None:
        return None
    rows = [s[r] for s in states for r in ROLES]
    return fp8jax.Fp8Meta(
        amax_history=jnp.stack([v["amax_history"] for v in rows]),
        scale=jnp.concatenate([v["scale"] for v in rows]),
    )
