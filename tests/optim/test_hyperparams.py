"""fp8jax.optim's hyperparameters (issue 46): numpy scalars go through the range checks that
Python numbers do, strings and other non-numbers are refused by name before they reach numpy,
numpy integers are ints, and ``optax.inject_hyperparams`` works with the integers static."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _shared import rand

from fp8jax.optim import adamw, scale_by_adam, stochastic_rounding

STATIC = ("block_size", "seed")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        # numpy scalars used to pass unchecked: gradient ascent, b1 > 1, a negative eps
        ({"learning_rate": np.float32(-1e-3)}, ValueError,
         r"adamw: learning_rate must be a finite number >= 0.0, got np.float32\(-0.001\)"),
        ({"b1": np.float32(1.5)}, ValueError,
         r"adamw: b1 must be a finite number in \[0.0, 1.0\), got np.float32\(1.5\)"),
        ({"eps": np.float32(-1)}, ValueError, r"adamw: eps must be a finite number >= 0.0"),
        ({"b2": np.float64(np.nan)}, ValueError, "b2 must be a finite number"),
        ({"weight_decay": np.int64(-1)}, ValueError, "weight_decay must be a finite number"),
        # concrete jax scalars are checked too
        ({"learning_rate": jnp.float32(-1e-3)}, ValueError, "learning_rate must be a finite"),
        ({"eps_root": jnp.asarray(-1.0)}, ValueError, "eps_root must be a finite number"),
        ({"learning_rate": jnp.ones(2)}, ValueError,
         r"learning_rate must be a scalar, got a jax array of dtype float32 and shape \(2,\)"),
        # what a YAML config gives: refused by name, not deep in numpy
        ({"learning_rate": "1e-3"}, TypeError,
         "fp8jax.optim.adamw: learning_rate must be a number, a schedule or a jax array, got "
         "str '1e-3'"),
        ({"b1": "0.9"}, TypeError, "b1 must be a number or a jax array, got str '0.9'"),
        ({"weight_decay": None}, TypeError, "weight_decay must be a number, a schedule or a"),
        ({"eps": lambda count: 1e-8}, TypeError, "eps must be a number or a jax array, got"),
        ({"b2": np.bool_(True)}, TypeError, "b2 must be a number or a jax array, got bool"),
        ({"learning_rate": 1e-3 + 0j}, TypeError, "learning_rate must be a number, a schedule"),
        ({"b1": jnp.asarray(True)}, TypeError, "b1 must be a number or a jax array"),
        # the integers: numpy ints are ints, floats and jax arrays are not
        ({"block_size": np.int64(0)}, ValueError, r"block_size must be a positive int, got"),
        ({"block_size": "128"}, TypeError, "block_size must be a positive int, got str '128'"),
        ({"block_size": jnp.int32(128)}, TypeError,
         r"block_size must be a positive int, got a jax array of dtype int32 .* static_args="
         r"\('block_size', 'seed'\)"),
        ({"seed": np.float64(0)}, TypeError, "seed must be an int, got float64"),
        ({"seed": jnp.uint32(0)}, TypeError, r"seed must be an int, .*static_args="),
        ({"param_rounding": 1}, TypeError, "param_rounding must be a str, got 1"),
        ({"fp8_moments": np.int64(1)}, TypeError, "fp8_moments must be a bool"),
    ],
)  # fmt: skip
def test_hyperparameters_of_every_kind_are_checked_by_name(kwargs, error, match):
    args = {"learning_rate": 1e-3, **kwargs}
    with pytest.raises(error, match=match):
        adamw(**args)


def test_scale_by_adam_and_stochastic_rounding_check_their_own():
    with pytest.raises(ValueError, match=r"scale_by_adam: b2 must be a finite number in \[0.0"):
        scale_by_adam(b2=np.float32(1.0))
    with pytest.raises(TypeError, match="scale_by_adam: block_size must be a positive int"):
        scale_by_adam(block_size=np.float32(128))
    with pytest.raises(TypeError, match="stochastic_rounding: seed must be an int, got str"):
        stochastic_rounding("0")
    with pytest.raises(TypeError, match="stochastic_rounding: seed must be an int, got bool"):
        stochastic_rounding(True)


def _steps(tx, n=3, dtype=jnp.float32):
    params = {"w": rand((4, 256), seed=1).astype(dtype), "b": rand((130,), seed=2).astype(dtype)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    out = []
    for i in range(n):
        grads = jax.tree.map(lambda p, i=i: rand(p.shape, seed=10 + i).astype(p.dtype), params)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        out.append(updates)
    return out, state


def test_numpy_scalars_are_accepted_as_the_python_numbers_they_hold():
    """``np.int64(128)`` was refused as a block size; numpy numbers now act as Python's."""
    numbers = {"b1": np.float64(0.9), "weight_decay": np.float32(0.0), "seed": np.uint8(3),
               "block_size": np.int64(128), "fp8_moments": np.bool_(True)}  # fmt: skip
    tx_np = adamw(np.float32(1e-2), **numbers)
    tx_py = adamw(1e-2, b1=0.9, weight_decay=0.0, block_size=128, seed=3)
    ours, state = _steps(tx_np, dtype=jnp.bfloat16)
    ref, _ = _steps(tx_py, dtype=jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert state[0].mu.scale_inv["w"].shape == (4, 2)


def test_inject_hyperparams_with_the_integers_static():
    """``optax.inject_hyperparams`` passes numbers as jax arrays (traced under ``jit``), which
    work, and ints too unless static: ``static_args=("block_size", "seed")``. With float32
    moments it is ``optax.inject_hyperparams(optax.adamw)`` bit for bit; a learning rate
    changed in the state takes effect at the next update."""
    with pytest.raises(TypeError, match=r"block_size must be a positive int.*static_args="):
        optax.inject_hyperparams(adamw)(learning_rate=1e-3).init({"w": jnp.ones(4)})
    inject = optax.inject_hyperparams(adamw, static_args=STATIC)
    ours, _ = _steps(inject(learning_rate=1e-2, weight_decay=0.1, fp8_moments=False))
    ref, _ = _steps(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # optax gives the hyperparameters the params' dtype: in bfloat16, b2 = 0.999 is 1
    rounded = (r"b2 must be a finite number in \[0.0, 1.0\), got Array\(1, dtype=bfloat16\) "
               r"\(bfloat16 rounds it; .*hyperparam_dtype=jnp.float32")  # fmt: skip
    with pytest.raises(ValueError, match=rounded):
        inject(learning_rate=1e-2).init({"w": jnp.ones((4,), jnp.bfloat16)})
    inject = optax.inject_hyperparams(adamw, static_args=STATIC, hyperparam_dtype=jnp.float32)
    tx = inject(learning_rate=1e-2, b1=0.8, block_size=np.int64(128), seed=7)
    updates, state = _steps(tx, 2, jnp.bfloat16)
    assert state.inner_state[0].mu.codes["w"].dtype == jnp.float8_e4m3fn
    assert float(state.hyperparams["b1"]) == pytest.approx(0.8)
    assert all(jnp.isfinite(u).all() and (u != 0).any() for u in jax.tree.leaves(updates))
    state.hyperparams["learning_rate"] = jnp.zeros_like(state.hyperparams["learning_rate"])
    params = {"w": jnp.ones((4, 256), jnp.bfloat16), "b": jnp.ones((130,), jnp.bfloat16)}
    grads = jax.tree.map(jnp.ones_like, params)
    frozen, _ = jax.jit(tx.update)(grads, state, params)
    assert all((np.asarray(u) == 0).all() for u in jax.tree.leaves(frozen))
