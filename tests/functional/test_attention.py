"""``fp8jax.dot_product_attention`` (fp8jax/functional/attention.py): against high-precision
attention and its gradients under both per-tensor recipes, its observations through the probe
and the state update they drive, the rows' E4M3 scales under HYBRID, and its refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import normal

import fp8jax
from fp8jax.functional.attention import ATTENTION_ROLES, dot_product_attention_observed

B, S, H, G, D = 2, 32, 4, 2, 16
N = len(ATTENTION_ROLES)
RECIPE = fp8jax.DelayedScaling(amax_history_len=4)


def _inputs(dtype=jnp.float32, groups=H, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(normal(rng, (B, S, h, D), dtype) for h in (H, groups, groups))


def _hp(q, k, v):
    r = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(t, r, axis=2) for t in (k, v))
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _calibrated(q, k, v, dy, steps=2):
    """The state after ``steps`` train steps of the layer on (q, k, v) and the output gradient
    ``dy``: scales from their amaxes."""
    meta = fp8jax.init_fp8_meta(RECIPE, N)
    for _ in range(steps):
        _, obs = _grads(q, k, v, meta, dy)
        meta = fp8jax.update_fp8_meta(meta, obs, RECIPE)
    return meta


def _grads(q, k, v, meta, dy, recipe=RECIPE):
    def f(q, k, v, probe):
        out = fp8jax.dot_product_attention(q, k, v, meta, recipe, probe=probe)
        return jnp.sum(out * dy)

    g = jax.grad(f, argnums=(0, 1, 2, 3))(q, k, v, jnp.zeros((N,), jnp.float32))
    return g[:3], g[3]


def _rel(a, b):
    return float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b))


def test_fp8_off_is_jax_attention():
    q, k, v = _inputs()
    out = fp8jax.dot_product_attention(q, k, v, enabled=False)
    np.testing.assert_array_equal(out, _hp(q, k, v))


@pytest.mark.parametrize("groups", [H, G])
def test_delayed_scaling_is_attention_to_fp8_precision(groups):
    """After two steps (scales from the observed amaxes) the output and the gradients are the
    high-precision ones within 0.1 of each tensor's largest value (E4M3 on every tensor)."""
    q, k, v = _inputs(groups=groups)
    dy = normal(3, q.shape)
    meta = _calibrated(q, k, v, dy)
    out = fp8jax.dot_product_attention(q, k, v, meta, RECIPE)
    want, vjp = jax.vjp(_hp, q, k, v)
    grads, _ = _grads(q, k, v, meta, dy)
    for got, ref in zip((out, *grads), (want, *vjp(dy)), strict=True):
        assert got.dtype == ref.dtype
        assert _rel(got, ref) < 0.1  # the op's accuracy (tests/ops/test_fp8_attention.py)


def test_current_scaling_needs_no_state():
    q, k, v = _inputs(jnp.bfloat16)
    recipe = fp8jax.Float8CurrentScaling()
    out = fp8jax.dot_product_attention(q, k, v, recipe=recipe)
    want = _hp(q, k, v).astype(jnp.float32)
    assert out.dtype == jnp.bfloat16
    assert _rel(out.astype(jnp.float32), want) < 0.1
    grads = jax.grad(lambda q: jnp.sum(fp8jax.dot_product_attention(q, k, v, recipe=recipe)))(q)
    assert grads.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(grads)))


def test_observations_fill_the_roles():
    """The probe's gradient: each role's amax, the inputs' exactly (max |x|), 0 for the unused
    rows (never NaN: a step with a NaN gradient would be skipped); one update folds them in."""
    q, k, v = _inputs()
    meta = fp8jax.init_fp8_meta(RECIPE, N)
    _, obs = _grads(q, k, v, meta, jnp.ones_like(q))
    row = {name: i for i, name in enumerate(ATTENTION_ROLES)}
    for name, x in (("query", q), ("key", k), ("value", v)):
        assert float(obs[row[name]]) == float(jnp.max(jnp.abs(x)))
    assert float(obs[row["grad_output"]]) == 1.0
    assert 0.0 < float(obs[row["probs"]]) <= 1.0
    used = [row[n] for n in ("grad_scores", "output", "grad_key", "grad_query", "grad_value")]
    assert bool(jnp.all(obs[jnp.array(used)] > 0))
    assert all(float(obs[i]) == 0.0 for n, i in row.items() if n.startswith("unused"))
    new = fp8jax.update_fp8_meta(meta, obs, RECIPE)
    np.testing.assert_allclose(new.scale[row["query"]], 448.0 / jnp.max(jnp.abs(q)), rtol=1e-6)


def test_forward_observations_for_calibration():
    q, k, v = _inputs()
    seen = dot_product_attention_observed(
        q, k, v, fp8jax.init_fp8_meta(RECIPE, N), RECIPE, probe=None, is_causal=True,
        scale=1 / np.sqrt(D), dtype=None, enabled=None,
    ).observed  # fmt: skip
    assert seen.shape == (N,)
    assert bool(jnp.isnan(seen[7])) and float(seen[0]) == float(jnp.max(jnp.abs(q)))  # dO: NaN


def test_every_tensor_has_a_forward_row():
    """The ten tensors sit in the forward (E4M3) rows of the five GEMM triples, so HYBRID and
    Format.E4M3 give the same scales and bits; the backward rows are the unused ones."""
    q, k, v = _inputs()
    e4m3 = fp8jax.DelayedScaling(amax_history_len=4, fp8_format=fp8jax.Format.E4M3)
    used = [i for i, r in enumerate(ATTENTION_ROLES) if not r.startswith("unused")]
    backward = fp8jax.state.backward_roles(N)
    assert len(used) == 10 and not any(backward[i] for i in used)
    meta_h, meta_e = (_calibrated_with(r, q, k, v) for r in (RECIPE, e4m3))
    np.testing.assert_array_equal(meta_h.scale[jnp.array(used)], meta_e.scale[jnp.array(used)])
    dy = jnp.ones_like(q)
    for a, b in zip(_grads(q, k, v, meta_h, dy)[0], _grads(q, k, v, meta_e, dy, e4m3)[0],
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)


def _calibrated_with(recipe, q, k, v):
    meta = fp8jax.init_fp8_meta(recipe, N)
    _, obs = _grads(q, k, v, meta, jnp.ones_like(q), recipe)
    return fp8jax.update_fp8_meta(meta, obs, recipe)


def test_bad_arguments_name_them():
    q, k, v = _inputs()
    meta = fp8jax.init_fp8_meta(RECIPE, N)
    with pytest.raises(TypeError, match="query must be a float32/bfloat16/float16"):
        fp8jax.dot_product_attention(q[0], k, v, meta, RECIPE)
    with pytest.raises(ValueError, match="key and value must be equal"):
        fp8jax.dot_product_attention(q, k, v[:, :3], meta, RECIPE)
    with pytest.raises(ValueError, match="fp8_meta must have 15 roles"):
        fp8jax.dot_product_attention(q, k, v, fp8jax.init_fp8_meta(RECIPE), RECIPE)
    with pytest.raises(ValueError, match="block-scaled and row-wise recipes have no FP8 atten"):
        fp8jax.dot_product_attention(q, k, v, recipe=fp8jax.Float8BlockScaling())
    with pytest.raises(ValueError, match=r"row-wise recipes have no .*\(Float8RowwiseScaling;"):
        fp8jax.dot_product_attention(q, k, v, recipe=fp8jax.Float8RowwiseScaling())
    with pytest.raises(ValueError, match="probe"):  # differentiated without its probe
        jax.grad(lambda q: jnp.sum(fp8jax.dot_product_attention(q, k, v, meta, RECIPE)))(q)
