"""Expert parallelism (fp8jax.moe with ``expert_axis``) on 8 emulated CPU devices equals one
device: experts split over the ``expert`` axis, tokens over ``data`` x ``expert``, an
``all_to_all`` each way, under every recipe and with FP8 off; with a capacity factor too (the
drops of one device, from the counts of every device). The tokens' FP8 codes, not their
high-precision values, cross the forward ``all_to_all``."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import make_mesh, rand
from conftest import needs_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax.functional.moe import MoEConfig

pytestmark = [needs_devices(8), pytest.mark.usefixtures("float32_matmuls")]

E, K, H, INTER, T = 8, 2, 16, 8, 32
RECIPES = {
    "off": None,
    "delayed": fp8jax.DelayedScaling(amax_history_len=4),
    "current": fp8jax.Float8CurrentScaling(),
    "block": fp8jax.Float8BlockScaling(),
    "mxfp8": fp8jax.MXFP8BlockScaling(),
}


def _params():
    return {
        "gate_kernel": rand((H, E), 0, 0.5),
        "wi_0": rand((E, H, INTER), 1, 0.3),
        "wi_1": rand((E, H, INTER), 2, 0.3),
        "wo": rand((E, INTER, H), 3, 0.3),
        "wi_0_bias": rand((E, INTER), 4, 0.1),
        "wi_1_bias": rand((E, INTER), 5, 0.1),
        "wo_bias": rand((E, H), 6, 0.1),
    }


def _loss_and_grads(config, recipe, x, params, c):
    """The MoE's output, losses and gradients (w.r.t. x, the params, the probe)."""
    n = 6 * E
    meta = (
        fp8jax.init_fp8_meta(recipe, n_roles=n)
        if isinstance(recipe, fp8jax.DelayedScaling)
        else None
    )

    def loss(x, params, probe):
        r = fp8jax.moe(
            x, params, config, fp8_meta=meta, recipe=recipe, probe=probe, enabled=recipe is not None
        )
        return jnp.sum(r.out * c) + r.aux_loss + r.z_loss, r

    probe = jnp.zeros((n,), jnp.float32)
    (_value, r), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(x, params, probe)
    return r, grads


SPLITS = {
    "data2-expert4": ((2, 4), ("data", "expert"), ("data",)),
    "expert8": ((8,), ("expert",), ()),
}


# The recipe decides how the tokens are quantized before they cross the all-to-all, the split how
# they are dispatched (one axis, or data x expert); the two are independent, so each recipe runs on
# one split, and each split meets FP8 off, a per-tensor and a block-scaled recipe (8 cases where
# the full product was 14). The capacity's drops do not depend on the recipe: once per split.
CASES = [
    ("off", "expert8", None),
    ("off", "data2-expert4", None),
    ("delayed", "expert8", None),
    ("current", "data2-expert4", None),
    ("block", "expert8", None),
    ("mxfp8", "data2-expert4", None),
    ("off", "expert8", 1.0),
    ("delayed", "data2-expert4", 1.0),
]


@pytest.mark.parametrize(("name", "split", "capacity"), CASES)
def test_expert_parallel_equals_one_device(name, split, capacity):
    shape, names, data_axes = SPLITS[split]
    recipe = RECIPES[name]
    x, params, c = rand((T, H), 7), _params(), rand((T, H), 8)
    base = dict(
        num_experts=E,
        num_experts_per_tok=K,
        aux_loss_coeff=0.01,
        z_loss_coeff=1e-3,
        capacity_factor=capacity,
    )
    one, one_grads = jax.jit(lambda *a: _loss_and_grads(MoEConfig(**base), recipe, *a))(
        x, params, c
    )
    mesh = make_mesh(shape, names=names)
    ep = MoEConfig(**base, expert_axis="expert", data_parallelism_axes=data_axes)
    with jax.set_mesh(mesh):
        tokens = NamedSharding(mesh, P((*data_axes, "expert")))
        xs, cs = jax.device_put(x, tokens), jax.device_put(c, tokens)
        got, got_grads = jax.jit(lambda *a: _loss_and_grads(ep, recipe, *a))(xs, params, cs)
    tol = dict(rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(got.out, one.out, **tol)
    np.testing.assert_allclose(got.aux_loss, one.aux_loss, rtol=1e-6)
    np.testing.assert_allclose(got.z_loss, one.z_loss, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(one_grads), strict=True):
        np.testing.assert_allclose(g, w, **tol)
    if recipe is not None and got.observed is not None:
        np.testing.assert_array_equal(got.observed, one.observed)


def test_fp8_codes_cross_the_all_to_all():
    """In the forward pass the tokens travel as uint8 FP8 codes; the experts' outputs come back
    in the compute dtype."""
    mesh = make_mesh("8", names=("expert",))
    ep = MoEConfig(num_experts=E, num_experts_per_tok=K, expert_axis="expert")
    x, params = rand((T, H), 9), _params()
    with jax.set_mesh(mesh):
        f = jax.jit(lambda x, p: fp8jax.moe(x, p, ep, recipe=RECIPES["current"]).out)
        hlo = f.lower(jax.device_put(x, NamedSharding(mesh, P("expert"))), params).compile()
    text = hlo.as_text()
    # each all-to-all's result element types (one array, or a tuple of them)
    results = re.findall(r"=\s*(.*?)\s+all-to-all(?:-start)?\(", text)
    shapes = [t for r in results for t in re.findall(r"\b([a-z]+\d*)\[", r)]
    assert "u8" in shapes, shapes
    wide = [s for s in shapes if s in ("f32", "bf16")]
    assert wide and len(wide) < len(shapes)  # the outputs' way back, and the counts in s32
