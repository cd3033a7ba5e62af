"""update_fp8_state(s): a hand-computed multi-step oracle, kernel vs reference, batched form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _implementations import (  # noqa: F401
    DIV_ULPS,
    implementation_fixture,
    pytest_generate_tests,
    reference_bits_promised,
)
from _samples import F32, M, Sample
from _values import assert_matches
from conftest import on_cpu

from fp8jax import DelayedScaling, Float8CurrentScaling, Format, ops

F32_MAX = float(np.finfo(np.float32).max)


def _run(recipe, amaxes, backward=False, scale0=1.0):
    """Feeds ``amaxes`` step by step; returns [(history, scale)] after each step."""
    hist = jnp.zeros(recipe.amax_history_len, jnp.float32)
    scale = jnp.float32(scale0)
    out = []
    for a in amaxes:
        hist, scale = ops.update_fp8_state(hist, scale, jnp.float32(a), recipe, backward=backward)
        out.append((np.asarray(hist).tolist(), float(scale)))
    return out


# Hand-computed: E4M3 max 448, history length 2, observations 2, 8, 0.5.
#   max:          [2,0] -> 448/2=224 | [8,2] -> 448/8=56 | [0.5,8] -> max 8 -> 56
#   most_recent:  224 | 56 | 448/0.5 = 896
# margin 2 divides each scale by 4.
ORACLE = {
    ("max", 0): [([2, 0], 224.0), ([8, 2], 56.0), ([0.5, 8], 56.0)],
    ("most_recent", 0): [([2, 0], 224.0), ([8, 2], 56.0), ([0.5, 8], 896.0)],
    ("max", 2): [([2, 0], 56.0), ([8, 2], 14.0), ([0.5, 8], 14.0)],
    ("most_recent", 2): [([2, 0], 56.0), ([8, 2], 14.0), ([0.5, 8], 224.0)],
}


@pytest.mark.parametrize(("algo", "margin"), list(ORACLE))
def test_three_step_oracle(algo, margin):
    r = DelayedScaling(
        amax_history_len=2, amax_compute_algo=algo, margin=margin, fp8_format=Format.E4M3
    )
    assert _run(r, [2.0, 8.0, 0.5]) == ORACLE[(algo, margin)]


def test_five_step_oracle_long_history_backward_e5m2():
    r = DelayedScaling(amax_history_len=4)  # HYBRID: backward tensors use E5M2, max 57344
    got = _run(r, [1.0, 4.0, 2.0, 0.5, 0.25], backward=True)
    assert got == [
        ([1, 0, 0, 0], 57344.0),
        ([4, 1, 0, 0], 14336.0),
        ([2, 4, 1, 0], 14336.0),
        ([0.5, 2, 4, 1], 14336.0),
        ([0.25, 0.5, 2, 4], 14336.0),  # 1 fell off; 4 still in the window
    ]
    assert _run(r, [1.0, 4.0, 2.0, 0.5, 0.25, 0.125])[-1] == ([0.125, 0.25, 0.5, 2], 224.0)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_zero_amax_is_recorded_and_keeps_old_scale(algo):
    r = DelayedScaling(amax_history_len=2, amax_compute_algo=algo, fp8_format=Format.E4M3)
    hist, scale = ops.update_fp8_state(jnp.zeros(2), jnp.float32(3.0), jnp.float32(0.0), r)
    assert float(scale) == 3.0
    np.testing.assert_array_equal(np.asarray(hist), [0.0, 0.0])


def _second_newest(h):
    return h[1]


def _halve(amax, scale, fp8_max, recipe):
    return fp8_max / amax / 2


# Every kind of reduction and scale rule: the two kernel algorithms and the jnp path (callables).
RECIPES = {
    "max": dict(amax_compute_algo="max"),
    "most_recent": dict(amax_compute_algo="most_recent"),
    "callable_amax": dict(amax_compute_algo=_second_newest),
    "custom_scale": dict(scaling_factor_compute_algo=_halve),
    "callable_both": dict(amax_compute_algo=_second_newest, scaling_factor_compute_algo=_halve),
}
NONFINITE = [np.nan, -np.nan, np.inf, -np.inf]


@pytest.mark.parametrize("kind", list(RECIPES))
@pytest.mark.parametrize("bad", NONFINITE, ids=["nan", "-nan", "inf", "-inf"])
def test_nonfinite_observation_is_not_recorded(kind, bad):
    # Deliberately unlike TransformerEngine, which records it: the row (history and scale)
    # stays exactly as it was, not even shifted.
    r = DelayedScaling(amax_history_len=3, fp8_format=Format.E4M3, **RECIPES[kind])
    hist0 = jnp.asarray([4.0, 2.0, 1.0], jnp.float32)
    hist, scale = ops.update_fp8_state(hist0, jnp.float32(7.0), jnp.float32(bad), r)
    assert np.asarray(hist).tobytes() == np.asarray(hist0).tobytes()
    assert np.asarray(scale).tobytes() == np.float32(7.0).tobytes()


@pytest.mark.parametrize("kind", list(RECIPES))
@pytest.mark.parametrize("bad", NONFINITE, ids=["nan", "-nan", "inf", "-inf"])
def test_run_with_a_bad_step_equals_the_run_without_it(kind, bad):
    r = DelayedScaling(amax_history_len=3, fp8_format=Format.E4M3, **RECIPES[kind])
    clean = _run(r, [2.0, 8.0, 0.5, 1.0], scale0=5.0)
    dirty = _run(r, [2.0, bad, 8.0, bad, bad, 0.5, 1.0], scale0=5.0)
    assert [dirty[i] for i in (0, 2, 5, 6)] == clean
    assert dirty[1] == dirty[0] and dirty[3] == dirty[4] == dirty[2]


@pytest.mark.parametrize("kind", list(RECIPES))
def test_batched_nonfinite_rows_kernel_and_reference(kind, implementation):
    # One call with good and bad rows: only the bad rows stay; kernel (string algorithms) and the
    # jnp path agree with the reference bit for bit (a recipe with a callable runs the reference:
    # XLA's, whose scales on a GPU are within DIV_ULPS).
    kernel = kind in ("max", "most_recent")
    exact = reference_bits_promised(implementation if kernel else "xla")
    r = DelayedScaling(amax_history_len=4, fp8_format=Format.HYBRID, **RECIPES[kind])
    rng = np.random.default_rng(7)
    n = 9
    hist = rng.exponential(size=(n, 4)).astype(np.float32)
    scales = rng.uniform(0.5, 4, n).astype(np.float32)
    amaxes = rng.exponential(size=n).astype(np.float32)
    amaxes[[1, 3, 4, 8]] = NONFINITE
    backward = [i % 2 == 1 for i in range(n)]
    h, s = ops.update_fp8_states(
        jnp.asarray(hist), jnp.asarray(scales), jnp.asarray(amaxes), r, backward=backward
    )
    maxes = np.where(backward, 57344.0, 448.0).astype(np.float32)
    rh, rs = on_cpu(
        ops.update_fp8_states_reference,
        *map(jnp.asarray, (hist, scales, amaxes, maxes)),
        r,
    )
    assert np.asarray(h).tobytes() == np.asarray(rh).tobytes()
    assert_matches(s, rs, exact, ulps=DIV_ULPS)
    bad = ~np.isfinite(amaxes)
    assert np.asarray(h)[bad].tobytes() == hist[bad].tobytes()
    assert np.asarray(s)[bad].tobytes() == scales[bad].tobytes()
    np.testing.assert_array_equal(np.asarray(h)[~bad][:, 0], amaxes[~bad])  # good rows recorded
    np.testing.assert_array_equal(np.asarray(h)[~bad][:, 1:], hist[~bad][:, :-1])


def test_nan_in_history_keeps_scale_under_max_until_it_falls_off():
    # An observation can no longer put NaN into a history, but a history from an older checkpoint
    # (or built by hand) can hold one: under "max" it keeps the old scale until it falls off.
    r = DelayedScaling(amax_history_len=2, fp8_format=Format.E4M3)
    hist = jnp.asarray([np.nan, 0.0], jnp.float32)
    scale = jnp.float32(5.0)
    got = []
    for a in (4.0, 8.0):
        hist, scale = ops.update_fp8_state(hist, scale, jnp.float32(a), r)
        got.append(float(scale))
    assert got == [5.0, 56.0]


def test_tiny_amax_clamps_scale_to_float32_max():
    r = DelayedScaling(amax_history_len=1, fp8_format=Format.E5M2)
    _, scale = ops.update_fp8_state(jnp.zeros(1), jnp.float32(1), jnp.float32(1e-37), r)
    assert float(scale) == F32_MAX


def test_subnormal_amax_keeps_old_scale_on_every_platform():
    # XLA:CPU runs with denormals-are-zero; the rule "amax must be a normal number" makes the
    # CPU and CUDA kernels agree.
    r = DelayedScaling(amax_history_len=1)
    _, scale = ops.update_fp8_state(jnp.zeros(1), jnp.float32(2), jnp.float32(1e-40), r)
    assert float(scale) == 2.0


def test_custom_callables():
    second_newest = lambda h: h[1]
    r = DelayedScaling(amax_history_len=3, amax_compute_algo=second_newest, fp8_format=Format.E4M3)
    assert [s for _, s in _run(r, [1.0, 2.0, 4.0], scale0=7.0)] == [
        7.0,
        448.0,
        224.0,
    ]  # first: h[1] == 0 keeps the old scale

    def halve(amax, scale, fp8_max, recipe):
        return fp8_max / amax / 2

    r2 = DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=halve)
    assert _run(r2, [2.0])[0][1] == 112.0


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1, 3])
def test_kernel_matches_reference_and_single_form_bit_for_bit(algo, margin, implementation):
    rng = np.random.default_rng(margin)
    n, length = 37, 16
    r = DelayedScaling(amax_history_len=length, amax_compute_algo=algo, margin=margin)
    hist = rng.exponential(size=(n, length)).astype(np.float32)
    hist[3, 5] = np.nan
    hist[4] = 0
    scales = rng.uniform(0.5, 4, n).astype(np.float32)
    amaxes = rng.exponential(size=n).astype(np.float32)
    amaxes[[4, 7, 9]] = [0.0, np.inf, np.nan]
    backward = rng.integers(0, 2, n).astype(bool)
    h, s = ops.update_fp8_states(
        jnp.asarray(hist), jnp.asarray(scales), jnp.asarray(amaxes), r, backward=backward.tolist()
    )
    maxes = np.where(backward, 57344.0, 448.0).astype(np.float32)
    rh, rs = on_cpu(
        ops.update_fp8_states_reference,
        jnp.asarray(hist),
        jnp.asarray(scales),
        jnp.asarray(amaxes),
        jnp.asarray(maxes),
        r,
    )
    np.testing.assert_array_equal(np.asarray(h), np.asarray(rh))
    assert_matches(s, rs, reference_bits_promised(implementation), ulps=DIV_ULPS)
    for i in range(n):
        hi, si = ops.update_fp8_state(
            jnp.asarray(hist[i]),
            jnp.asarray(scales[i]),
            jnp.asarray(amaxes[i]),
            r,
            backward=bool(backward[i]),
        )
        np.testing.assert_array_equal(np.asarray(hi), np.asarray(h[i]))
        assert np.asarray(si).tobytes() == np.asarray(s[i]).tobytes()


def test_batched_is_one_kernel_launch_and_vmap_works(implementation):
    r = DelayedScaling(amax_history_len=8)
    hist = jnp.zeros((5, 8), jnp.float32)
    scales = jnp.ones((5, 1), jnp.float32)
    amaxes = jnp.arange(1, 6, dtype=jnp.float32).reshape(5, 1)
    f = jax.jit(lambda h, s, a: ops.update_fp8_states(h, s, a, r))
    hlo = f.lower(hist, scales, amaxes).as_text()
    assert hlo.count("fp8jax_update_fp8_state") == (implementation == "kernel")
    h, s = f(hist, scales, amaxes)
    assert s.shape == (5, 1)
    single = jax.vmap(lambda h, s, a: ops.update_fp8_state(h, s, a, r))
    vh, vs = single(hist, scales, amaxes)
    np.testing.assert_array_equal(np.asarray(vh), np.asarray(h))
    np.testing.assert_array_equal(np.asarray(vs), np.asarray(s))
    want = np.float32(448) / np.arange(1, 6, dtype=np.float32)
    assert_matches(s[:, 0], want, reference_bits_promised(implementation), ulps=DIV_ULPS)


def test_bad_input():
    r = DelayedScaling(amax_history_len=4)
    h, one = jnp.zeros(4, jnp.float32), jnp.float32(1)
    with pytest.raises(TypeError, match="DelayedScaling"):
        ops.update_fp8_state(h, one, one, Float8CurrentScaling())
    with pytest.raises(ValueError, match=r"amax_history must have shape \(4,\)"):
        ops.update_fp8_state(jnp.zeros(3, jnp.float32), one, one, r)
    with pytest.raises(TypeError, match="amax_history must be float32"):
        ops.update_fp8_state(jnp.zeros(4, jnp.bfloat16), one, one, r)
    with pytest.raises(ValueError, match="amax must hold one value"):
        ops.update_fp8_state(h, one, jnp.ones(2, jnp.float32), r)
    with pytest.raises(TypeError, match="backward must be a bool"):
        ops.update_fp8_state(h, one, one, r, backward="yes")
    with pytest.raises(ValueError, match=r"amax_histories must have shape \[n, 4\]"):
        ops.update_fp8_states(jnp.zeros((2, 5), jnp.float32), jnp.ones(2), jnp.ones(2), r)
    with pytest.raises(ValueError, match="scales must have shape"):
        ops.update_fp8_states(jnp.zeros((2, 4), jnp.float32), jnp.ones(3), jnp.ones(3), r)
    with pytest.raises(ValueError, match="amaxes must have the shape"):
        ops.update_fp8_states(jnp.zeros((2, 4), jnp.float32), jnp.ones(2), jnp.ones((2, 1)), r)
    with pytest.raises(TypeError, match="backward must be a bool or a sequence of 2"):
        ops.update_fp8_states(
            jnp.zeros((2, 4), jnp.float32),
            jnp.ones(2),
            jnp.ones(2),
            r,
            backward=[True, False, True],
        )


# ------------------------------------------------------------------ the conformance sample
# This op's entries in the conformance suite's table (tests/ops/_samples.py, tests/ops/
# test_conformance.py, tests/distributed/test_ops_conformance.py).


def _sample_update_fp8_states(key):
    r = np.random.default_rng(key)
    out = {}
    for name, recipe, backward in (
        ("max", DelayedScaling(amax_history_len=4), False),
        (
            "most_recent-margin2-bwd",
            DelayedScaling(amax_history_len=3, margin=2, amax_compute_algo="most_recent"),
            [True, False] * (M // 2),
        ),
    ):
        hist = jnp.asarray(np.abs(r.standard_normal((M, recipe.amax_history_len))) * 10, F32)
        amaxes = np.abs(r.standard_normal(M)).astype(np.float32) * 100
        amaxes[[1, 5, 9]] = [np.nan, np.inf, 0.0]  # not recorded, not recorded, kept scale
        scales = jnp.asarray(r.uniform(0.5, 2, M), F32)
        out[name] = Sample(
            ops.update_fp8_states,
            (hist, scales, jnp.asarray(amaxes), recipe),
            dict(backward=backward),
            gpu_close={"ulps": 2},  # XLA:GPU's division (DIV_ULPS)
        )
    return out


SAMPLES = {"update_fp8_states": _sample_update_fp8_states}
