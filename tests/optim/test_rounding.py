"""BF16 params with stochastic rounding (fp8jax.optim.stochastic_rounding, issue 39 item 2):
each rounding picks one of the two neighbouring bfloat16 values with the right odds (unbiased),
``optax.apply_updates`` lands exactly on it, and updates far below a bfloat16 step still move
the params on average where round to nearest loses them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fp8jax.optim import adamw, round_to_bfloat16, stochastic_rounding


def _neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bfloat16 values at and below / above float32 ``x`` (positive)."""
    bits = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    lo = bits.view(np.float32)
    hi = (bits + np.uint32(0x10000)).view(np.float32)
    return lo, hi


def test_round_to_bfloat16_is_unbiased_between_the_neighbours():
    x = np.float32(3.0) + np.float32(2.0**-7) * np.float32([0.1, 0.5, 0.9, 0.0])
    n = 4096
    bits = jax.random.bits(jax.random.key(0), (n, 4), jnp.uint32)
    out = np.asarray(round_to_bfloat16(jnp.broadcast_to(x, (n, 4)), bits), np.float32)
    lo, hi = _neighbours(x)
    assert ((out == lo) | (out == hi)).all()
    np.testing.assert_allclose(out.mean(0), x, atol=3 * float(hi[0] - lo[0]) / np.sqrt(n))
    assert (out[:, 3] == 3.0).all()  # a bfloat16 value stays itself
    # negative values round in magnitude, the same odds
    neg = np.asarray(round_to_bfloat16(-jnp.broadcast_to(x, (n, 4)), bits), np.float32)
    np.testing.assert_array_equal(neg, -out)


def test_non_finite_values_stay():
    x = jnp.array([jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    out = round_to_bfloat16(x, jnp.full((3,), 0xFFFF, jnp.uint32))
    assert np.isposinf(out[0]) and np.isneginf(out[1]) and np.isnan(out[2])


def test_apply_updates_lands_on_the_stochastically_rounded_value():
    tx = stochastic_rounding(seed=3)
    params = {"w": jnp.linspace(-2, 2, 1000).astype(jnp.bfloat16), "f": jnp.ones(3)}
    updates = {"w": jnp.full((1000,), 1e-3, jnp.float32), "f": jnp.full((3,), 0.25)}
    out, _ = tx.update(updates, tx.init(params), params)
    new = optax.apply_updates(params, out)
    assert new["w"].dtype == jnp.bfloat16
    want = params["w"].astype(jnp.float32) + 1e-3
    bits = jax.random.bits(
        jax.random.fold_in(jax.random.fold_in(jax.random.key(3), 0), 1), (1000,), jnp.uint32
    )  # leaf 1 in tree order ("f", "w"), step 0
    np.testing.assert_array_equal(np.asarray(new["w"]), np.asarray(round_to_bfloat16(want, bits)))
    np.testing.assert_array_equal(np.asarray(new["f"]), np.full(3, 1.25, np.float32))


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_small_steps_move_bfloat16_params_only_with_stochastic_rounding(rounding):
    """SGD-sized steps of 2**-12 on weights of 1 (a bfloat16 step there is 2**-7): round to
    nearest never moves them; stochastic rounding moves them by 2**-12 per step on average."""
    tx = optax.chain(optax.sgd(2.0**-12), stochastic_rounding(seed=0))
    if rounding == "nearest":
        tx = optax.sgd(2.0**-12)
    params = {"w": jnp.ones((4096,), jnp.bfloat16)}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        updates, state = tx.update({"w": -jnp.ones((4096,), jnp.bfloat16)}, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(64):
        params, state = step(params, state)
    mean = float(params["w"].astype(jnp.float32).mean())
    if rounding == "nearest":
        assert mean == 1.0
    else:
        assert abs(mean - (1 + 64 * 2.0**-12)) < 2e-3


def test_adamw_with_bfloat16_params_uses_stochastic_rounding_by_default():
    params = {"w": jnp.ones((2, 256), jnp.bfloat16)}
    tx = adamw(2.0**-12, weight_decay=0.0)  # Adam's first steps are ~lr each
    state = tx.init(params)
    grads = {"w": -jnp.ones((2, 256), jnp.bfloat16)}
    for _ in range(8):
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    moved = float(params["w"].astype(jnp.float32).mean()) - 1
    assert abs(moved - 8 * 2.0**-12) < 1e-3
    nearest = adamw(2.0**-12, weight_decay=0.0, param_rounding="nearest")
    p, s = {"w": jnp.ones((2, 256), jnp.bfloat16)}, None
    s = nearest.init(p)
    updates, s = nearest.update(grads, s, p)
    assert (optax.apply_updates(p, updates)["w"] == 1).all()
