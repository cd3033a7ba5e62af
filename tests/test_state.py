"""fp8jax.state: initial state, max-merge of observations, one-launch model-wide update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import DelayedScaling, Format


def test_init_and_single_update():
    r = DelayedScaling(amax_history_len=2, fp8_format=Format.HYBRID)
    m = fp8jax.init_fp8_meta(r)
    assert m.amax_history.shape == (3, 2) and m.scale.tolist() == [1.0, 1.0, 1.0]
    m = fp8jax.update_fp8_meta(m, jnp.array([2.0, 4.0, 8.0]), r)
    # input and kernel use E4M3 (448), the output-grad E5M2 (57344)
    assert m.scale.tolist() == [224.0, 112.0, 7168.0]
    assert m.amax_history[:, 0].tolist() == [2.0, 4.0, 8.0]


def test_merge_observations_is_max_not_sum():
    a, b = jnp.array([1.0, 5.0, 2.0]), jnp.array([3.0, 4.0, 2.0])
    assert fp8jax.merge_observations(a, b).tolist() == [3.0, 5.0, 2.0]
    tree = fp8jax.merge_observations({"x": a}, {"x": b}, {"x": jnp.zeros(3)})
    assert tree["x"].tolist() == [3.0, 5.0, 2.0]
    with pytest.raises(ValueError, match="at least one"):
        fp8jax.merge_observations()


def test_many_layers_one_launch_equals_one_by_one():
    r = DelayedScaling(amax_history_len=4)
    rng = np.random.default_rng(0)
    metas = [
        fp8jax.Fp8Meta(
            jnp.asarray(rng.exponential(size=(3, 4)), jnp.float32),
            jnp.asarray(rng.uniform(1, 2, 3), jnp.float32),
        )
        for _ in range(5)
    ]
    obs = [jnp.asarray(rng.exponential(size=3), jnp.float32) for _ in range(5)]
    f = jax.jit(lambda m, o: fp8jax.update_fp8_metas(m, o, r))
    assert f.lower(metas, obs).as_text().count("fp8jax_update_fp8_state") == 1
    together = f(metas, obs)
    for m, o, t in zip(metas, obs, together, strict=True):
        one = fp8jax.update_fp8_meta(m, o, r)
        np.testing.assert_array_equal(np.asarray(one.amax_history), np.asarray(t.amax_history))
        np.testing.assert_array_equal(np.asarray(one.scale), np.asarray(t.scale))


def test_bad_input():
    r = DelayedScaling(amax_history_len=4)
    m = fp8jax.init_fp8_meta(r)
    with pytest.raises(TypeError, match="DelayedScaling"):
        fp8jax.init_fp8_meta(fp8jax.Float8CurrentScaling())
    with pytest.raises(ValueError, match="n_roles"):
        fp8jax.init_fp8_meta(r, n_roles=0)
    with pytest.raises(ValueError, match=r"observed amax of shape \(3,\)"):
        fp8jax.update_fp8_meta(m, jnp.ones(2), r)
    with pytest.raises(ValueError, match="recipe wants"):
        fp8jax.update_fp8_meta(m, jnp.ones(3), DelayedScaling(amax_history_len=8))
    with pytest.raises(TypeError, match="Fp8Meta"):
        fp8jax.update_fp8_meta({"scale": 1}, jnp.ones(3), r)
    with pytest.raises(ValueError, match="2 states but 1"):
        fp8jax.update_fp8_metas([m, m], [jnp.ones(3)], r)


def test_multi_gemm_roles_use_the_backward_format_per_triple():
    from fp8jax.state import backward_roles, gemm_roles

    assert gemm_roles("fc1", "fc2") == (
        "fc1/input", "fc1/kernel", "fc1/grad_output",
        "fc2/input", "fc2/kernel", "fc2/grad_output",
    )  # fmt: skip
    assert backward_roles(6) == (False, False, True) * 2
    r = DelayedScaling(amax_history_len=2, fp8_format=Format.HYBRID)
    m = fp8jax.init_fp8_meta(r, n_roles=6)
    m = fp8jax.update_fp8_meta(m, jnp.full((6,), 8.0), r)
    # rows 2 and 5 (each GEMM's output gradient) use E5M2 (57344), the others E4M3 (448)
    assert m.scale.tolist() == [56.0, 56.0, 7168.0, 56.0, 56.0, 7168.0]
    for bad in (0, 4, -3):
        with pytest.raises(ValueError, match="multiple of 3"):
            backward_roles(bad)
    with pytest.raises(ValueError, match="distinct"):
        gemm_roles("fc1", "fc1")
    # an explicit layout still works for any row count
    m5 = fp8jax.init_fp8_meta(r, n_roles=5)
    out = fp8jax.update_fp8_meta(m5, jnp.full((5,), 8.0), r, backward=(True,) + (False,) * 4)
    assert out.scale.tolist() == [7168.0, 56.0, 56.0, 56.0, 56.0]
    with pytest.raises(ValueError, match="multiple of 3"):
        fp8jax.update_fp8_meta(m5, jnp.full((5,), 8.0), r)
