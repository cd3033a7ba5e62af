"""Non-finite moments in fp8jax.optim (issue 46): optax's semantics through 8-bit storage.

Before, an inf second moment was stored as a finite 65025, an inf first moment as 448, a NaN
second moment as 0, and a block holding one took scale 1, so a NaN, inf or overflowing gradient
had a finite effect on the next updates of it and of its 127 neighbours. Now:

- the round trip keeps +-inf and NaN, in a block flagged by a negative ``scale_inv``, whose
  finite values keep their block-scaled precision; finite blocks are stored as before;
- against ``optax.adamw`` over several steps, for a NaN, +-inf and a finite 2e19 (whose square
  overflows float32) gradient: the element's updates equal optax's (0 under an infinite ``v``,
  up to the zero's sign, else NaN), its moments are non-finite where optax's are, and its block's
  finite neighbours follow optax within the FP8 bound of test_adam.py;
- ``fp8_moments=False`` is ``optax.adamw`` bit for bit with non-finite gradients too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _shared import rand

from fp8jax.optim import adamw, dequantize_moment, quantize_moment

F32_MAX = float(np.finfo(np.float32).max)
INF, NAN = float("inf"), float("nan")
#: test_adam.py's bound: each step's update within 8% (relative L2) of float32 AdamW's.
UPDATE_BOUND = 0.08


def _with(x, row, values):
    return x.at[row, : len(values)].set(jnp.asarray(values, jnp.float32))


@pytest.mark.parametrize("fmt", ["e4m3", "sqrt_uint8"])
def test_non_finite_values_survive_the_round_trip(fmt):
    """+-inf and NaN come back as themselves (the sqrt_uint8 moment is ``v >= 0``: -inf is its
    square root's NaN), the block is flagged by a negative scale_inv, its finite values keep
    their precision against the block's largest finite value, and a finite block is stored as
    it is alone."""
    x = jnp.abs(rand((3, 256), seed=5)) if fmt == "sqrt_uint8" else rand((3, 256), seed=5)
    specials = [INF, NAN, -INF] if fmt == "e4m3" else [INF, NAN]
    bad = _with(x, 0, specials)
    q, s = quantize_moment(bad, fmt)
    back = np.asarray(dequantize_moment(q, s, fmt))
    k = len(specials)
    np.testing.assert_array_equal(back[0, :k], np.asarray(specials, np.float32))
    assert np.signbit(np.asarray(s)).tolist() == [[True, False], [False, False], [False, False]]
    # the rest of the flagged block: block-scaled from its largest finite value
    fin = np.asarray(bad, np.float64)[0, k:128]
    top = np.abs(fin).max()
    if fmt == "e4m3":  # 3 fraction bits in the normal range (>= top * 2**-6 / 416)
        normal = np.abs(fin) >= top * 2.0**-6 / 416
        err = np.abs(back[0, k:128] - fin)
        assert (err[normal] <= 2.0**-4 * np.abs(fin[normal]) * (1 + 1e-6)).all()
    else:  # sqrt(v) within half a code step, max sqrt(v) / 506 (253 codes)
        err = np.abs(np.sqrt(back[0, k:128]) - np.sqrt(fin))
        assert (err <= np.sqrt(top) / 506 * (1 + 1e-6)).all()
    np.testing.assert_allclose(back[0, k:128][np.argmax(np.abs(fin))], fin[np.argmax(np.abs(fin))],
                               rtol=3e-7)  # fmt: skip
    # finite blocks: the codes and scales of the same values without the non-finite block
    q1, s1 = quantize_moment(x[1:], fmt)
    np.testing.assert_array_equal(np.asarray(q[1:].astype(jnp.float32)),
                                  np.asarray(q1.astype(jnp.float32)))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(s[1:]), np.asarray(s1))
    np.testing.assert_array_equal(np.asarray(q[0, 128:].astype(jnp.float32)),
                                  np.asarray(quantize_moment(x[:1], fmt)[0][0, 128:]
                                             .astype(jnp.float32)))  # fmt: skip


def test_the_issues_reproducers_round_trip():
    """An inf second moment came back as 65025, an inf first moment as 448, NaN v as 0; a
    block of nothing but non-finite values, and finite values at float32's largest, too."""
    for fmt, x in [("sqrt_uint8", [INF, 1.0]), ("e4m3", [INF, 1.0]), ("sqrt_uint8", [NAN, 4.0]),
                   ("e4m3", [NAN, -INF]), ("sqrt_uint8", [INF, NAN]),
                   ("e4m3", [F32_MAX, -F32_MAX]), ("sqrt_uint8", [F32_MAX, 0.0])]:  # fmt: skip
        x = jnp.asarray([x], jnp.float32)
        back = dequantize_moment(*quantize_moment(x, fmt), fmt)
        np.testing.assert_array_equal(np.isfinite(back), np.isfinite(x))
        np.testing.assert_array_equal(np.asarray(back)[~np.isfinite(x)],
                                      np.asarray(x)[~np.isfinite(x)])  # fmt: skip


def _bad_grads(params, bad_step, value, steps):
    """Gaussian gradients, with ``value`` at w[0, 5] and b[7] at ``bad_step``."""
    out = []
    for i in range(steps):
        g = jax.tree.map(lambda p, i=i: rand(p.shape, seed=200 + i), params)
        if i == bad_step:
            g = {"w": g["w"].at[0, 5].set(value), "b": g["b"].at[7].set(value)}
        out.append(g)
    return out


def _trajectory(tx, params, grads):
    """Jitted updates on the given gradients: each step's updates, the last state."""
    state = tx.init(params)
    step = jax.jit(tx.update)
    history = []
    for g in grads:
        updates, state = step(g, state, params)
        params = optax.apply_updates(params, updates)
        history.append(updates)
    return history, state


def _moments(state):
    """The first and second moments of ``adamw``'s state as float32 trees."""
    adam = state[0]
    if not hasattr(adam.mu, "codes"):
        return adam.mu, adam.nu

    def read(moment, fmt):
        return jax.tree.map(lambda c, s: dequantize_moment(c, s, fmt), moment.codes,
                            moment.scale_inv)  # fmt: skip

    return read(adam.mu, "e4m3"), read(adam.nu, "sqrt_uint8")


BAD = {"w": (0, 5), "b": (7,)}


@pytest.mark.parametrize("value", [INF, -INF, NAN, 2e19], ids=["inf", "-inf", "nan", "2e19"])
@pytest.mark.parametrize("bad_step", [0, 2])
def test_non_finite_gradients_have_optax_effect_over_steps(value, bad_step):
    params = {"w": rand((2, 256), seed=1), "b": rand((130,), seed=2)}
    grads = _bad_grads(params, bad_step, value, 6)
    # no weight decay: it would add lr * wd * p, and p has moved by FP8's updates before
    ours, state8 = _trajectory(adamw(1e-2, weight_decay=0.0), params, grads)
    ref, state32 = _trajectory(optax.adamw(1e-2, weight_decay=0.0), params, grads)
    for step, (u8, u32) in enumerate(zip(ours, ref, strict=True)):
        rest8, rest32 = [], []
        for name, at in BAD.items():
            a, b = np.asarray(u8[name]), np.asarray(u32[name])
            keep = np.ones(a.shape, bool)
            if step >= bad_step:
                # the element: optax's update (NaN, or 0 under an infinite v; NaN == NaN and
                # -0 == 0 here: the sign of a zero follows m, which may differ)
                np.testing.assert_array_equal(a[at], b[at], err_msg=f"{name} step {step}")
                keep[at] = False
            rest8.append(a[keep])
            rest32.append(b[keep])
        rest8, rest32 = np.concatenate(rest8), np.concatenate(rest32)
        assert np.isfinite(rest8).all(), step
        rel = np.linalg.norm(rest8 - rest32) / np.linalg.norm(rest32)
        assert rel < UPDATE_BOUND, (step, rel)
    # the moments: non-finite where optax's are (v exactly; a finite m under an infinite v is
    # finite: stored as 0 at the overflowing step, which no later update can see)
    (m8, v8), (m32, v32) = _moments(state8), _moments(state32)
    for name, at in BAD.items():
        v_a, v_b = float(v8[name][at]), float(v32[name][at])
        assert v_a == v_b or (np.isnan(v_a) and np.isnan(v_b)), (name, v_a, v_b)
        assert not np.isfinite(v_b)
        m_a, m_b = float(m8[name][at]), float(m32[name][at])
        if np.isfinite(m_b):
            assert abs(m_a) < 10, (name, m_a, m_b)
        else:
            assert m_a == m_b or (np.isnan(m_a) and np.isnan(m_b)), (name, m_a, m_b)
        others = np.delete(np.asarray(v8[name]).ravel(), np.ravel_multi_index(at, v8[name].shape))
        assert np.isfinite(others).all()


@pytest.mark.parametrize("value", [INF, NAN, 2e19], ids=["inf", "nan", "2e19"])
def test_fp8_off_is_optax_with_non_finite_gradients_bit_for_bit(value):
    params = {"w": rand((2, 256), seed=1), "b": rand((130,), seed=2)}
    grads = _bad_grads(params, 1, value, 4)
    ours, state = _trajectory(adamw(1e-2, fp8_moments=False), params, grads)
    ref, state_ref = _trajectory(optax.adamw(1e-2), params, grads)
    ours, ref = (ours, state[0].mu, state[0].nu), (ref, state_ref[0].mu, state_ref[0].nu)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
