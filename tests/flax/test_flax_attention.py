"""fp8jax.flax.DotProductAttention and RelativePositionBiases, and fp8jax.rotary: against
jax.nn.dot_product_attention with TE's mask convention translated (bit-identical), against
numpy oracles written from the formulas (float32 rounding), and bad input."""

from __future__ import annotations

import doctest
import math

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import rand

import fp8jax
from fp8jax import rotary
from fp8jax.flax import DotProductAttention, RelativePositionBiases
from fp8jax.flax import attention as mha_mod
from fp8jax.flax import relative_position as rpb_mod
from fp8jax.layers import attention_core as core_mod
from fp8jax.layers.attention_core import (
    attention_core,
    attention_with_dropout,
    segment_mask,
)

pytestmark = pytest.mark.usefixtures("float32_matmuls")

B, SQ, SKV, H, D = 2, 6, 5, 4, 8


def _qkv(groups=H, sq=SQ, skv=SKV, seed=0):
    return (
        rand((B, sq, H, D), seed),
        rand((B, skv, groups, D), seed + 1),
        rand((B, skv, groups, D), seed + 2),
    )


def _padding_mask(sq=SQ, skv=SKV):
    """TE's convention (True = masked out), from lengths: batch 1 is padded."""
    q_len, kv_len = np.array([sq, sq - 2]), np.array([skv, skv - 1])
    q_ok = np.arange(sq)[None, :] < q_len[:, None]
    kv_ok = np.arange(skv)[None, :] < kv_len[:, None]
    return jnp.asarray(~(q_ok[:, None, :, None] & kv_ok[:, None, None, :]))


def _oracle(q, k, v, masked=None, causal=False, window=None, bias=None, scale=None):
    """numpy float64: softmax(scale * q k^T + bias) over the allowed keys; GQA: query head h
    reads key/value head h // (H / G); masked logits -> a large negative (rows all masked
    average the values, as jax does)."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    b, sq, h, d = q.shape
    skv, g = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // g)
            logits = scale * q[bi, :, hi] @ k[bi, :, kh].T
            if bias is not None:
                bb = np.broadcast_to(np.asarray(bias, np.float64), (b, h, sq, skv))
                logits = logits + bb[bi, hi]
            allowed = np.ones((sq, skv), bool)
            if masked is not None:
                mm = np.broadcast_to(np.asarray(masked), (b, h, sq, skv))
                allowed &= ~mm[bi, hi]
            for i in range(sq):
                for j in range(skv):
                    if causal and j > i:
                        allowed[i, j] = False
                    if window is not None and not (i - window[0] <= j <= i + window[1]):
                        allowed[i, j] = False
            logits = np.where(allowed, logits, -0.7 * np.finfo(np.float32).max)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[bi, :, hi] = p @ v[bi, :, kh]
    return out


def _dpa(**kw):
    kw.setdefault("transpose_batch_sequence", False)
    kw.setdefault("attn_mask_type", "no_mask")
    return DotProductAttention(head_dim=D, num_attention_heads=H, **kw)


# ------------------------------------------------------------------------ masks and GQA


@pytest.mark.parametrize("groups", [H, 2, 1])
@pytest.mark.parametrize("mask_type", ["no_mask", "padding", "causal", "padding_causal"])
def test_every_mask_type_matches_jax_and_the_oracle(mask_type, groups):
    """Forward and q/k/v gradients bit-identical to jax.nn.dot_product_attention with the mask
    inverted; forward equal to the numpy oracle to float32 rounding."""
    q, k, v = _qkv(groups)
    mask = _padding_mask()
    attn = _dpa(num_gqa_groups=groups, attn_mask_type=mask_type)
    padded = mask_type in ("padding", "padding_causal")
    causal = "causal" in mask_type
    c = rand((B, SQ, H, D), 9)

    def ours(q, k, v):
        return jnp.sum(attn.apply({}, q, k, v, mask) * c)

    def theirs(q, k, v):
        m = ~mask if padded else None
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=causal) * c)

    np.testing.assert_array_equal(
        np.asarray(attn.apply({}, q, k, v, mask)),
        np.asarray(jax.nn.dot_product_attention(q, k, v, mask=~mask if padded else None,
                                                is_causal=causal)),
    )  # fmt: skip
    for a, b in zip(jax.grad(ours, (0, 1, 2))(q, k, v), jax.grad(theirs, (0, 1, 2))(q, k, v),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = _oracle(q, k, v, masked=mask if padded else None, causal=causal)
    np.testing.assert_allclose(np.asarray(attn.apply({}, q, k, v, mask)), want, atol=2e-6)


def test_padding_types_without_a_mask_mask_nothing_or_causally():
    q, k, v = _qkv()
    for padded, plain in (("padding", "no_mask"), ("padding_causal", "causal")):
        np.testing.assert_array_equal(
            _dpa(attn_mask_type=padded).apply({}, q, k, v),
            _dpa(attn_mask_type=plain).apply({}, q, k, v),
        )


def test_mask_is_ignored_by_no_mask_and_causal_as_in_te():
    q, k, v = _qkv()
    full = jnp.ones((B, 1, SQ, SKV), bool)
    for mt in ("no_mask", "causal"):
        attn = _dpa(attn_mask_type=mt)
        np.testing.assert_array_equal(attn.apply({}, q, k, v, full), attn.apply({}, q, k, v))


def test_transpose_batch_sequence_and_te_defaults():
    """TE's defaults (v2.10+): causal mask, [batch, seq, heads, dim] inputs; [seq, batch, ...]
    with transpose_batch_sequence=True."""
    q, k, v = _qkv(sq=SKV)
    attn = DotProductAttention(head_dim=D, num_attention_heads=H)
    assert attn.attn_mask_type == "causal" and not attn.transpose_batch_sequence
    np.testing.assert_array_equal(
        np.asarray(attn.apply({}, q, k, v)),
        np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True)),
    )
    attn = DotProductAttention(head_dim=D, num_attention_heads=H, transpose_batch_sequence=True)
    t = lambda x: jnp.swapaxes(x, 0, 1)
    got = attn.apply({}, t(q), t(k), t(v))
    np.testing.assert_array_equal(
        np.asarray(t(got)), np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True))
    )


def test_int_mask_and_per_head_mask_and_deprecated_mask_keyword():
    q, k, v = _qkv()
    mask = _padding_mask()
    attn = _dpa(attn_mask_type="padding")
    want = attn.apply({}, q, k, v, mask)
    np.testing.assert_array_equal(attn.apply({}, q, k, v, mask.astype(jnp.uint8)), want)
    np.testing.assert_array_equal(attn.apply({}, q, k, v, mask=mask), want)
    per_head = jnp.broadcast_to(mask, (B, H, SQ, SKV))
    np.testing.assert_array_equal(attn.apply({}, q, k, v, per_head), want)
    with pytest.raises(ValueError, match="not both"):
        attn.apply({}, q, k, v, mask, mask=mask)


def test_packed_layouts_equal_separate_qkv():
    q, k, v = _qkv(sq=SKV)
    mask = _padding_mask(SKV, SKV)
    sep = _dpa(attn_mask_type="padding_causal").apply({}, q, k, v, mask)
    kv = _dpa(attn_mask_type="padding_causal", qkv_layout="bshd_bs2hd")
    np.testing.assert_array_equal(kv.apply({}, q, jnp.stack([k, v], 2), None, mask), sep)
    qkv = _dpa(attn_mask_type="padding_causal", qkv_layout="bs3hd")
    np.testing.assert_array_equal(qkv.apply({}, jnp.stack([q, k, v], 2), None, None, mask), sep)


# ------------------------------------------------------------------------ window, segments


@pytest.mark.parametrize(("window", "mask_type"), [((2, 0), "causal"), ((1, 2), "no_mask"),
                                                   ((3, 1), "padding")])  # fmt: skip
def test_sliding_window_matches_the_oracle(window, mask_type):
    q, k, v = _qkv(2)
    mask = _padding_mask()
    got = _dpa(num_gqa_groups=2, attn_mask_type=mask_type, window_size=window).apply(
        {}, q, k, v, mask
    )
    want = _oracle(q, k, v, masked=mask if mask_type == "padding" else None,
                   causal=mask_type == "causal", window=window)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


def test_negative_window_is_unbounded():
    q, k, v = _qkv()
    base = _dpa(attn_mask_type="causal").apply({}, q, k, v)
    for w in ((-1, -1), (-1, 0), (SQ + SKV, -1)):
        got = _dpa(attn_mask_type="causal", window_size=w).apply({}, q, k, v)
        np.testing.assert_array_equal(got, base)


def test_segment_ids_pack_sequences():
    """Two packed sequences and padding in one row attend as if they were separate rows."""
    s = 6
    q, k, v = (rand((1, s, H, D), i) for i in range(3))
    ids = jnp.asarray([[1, 1, 1, 2, 2, 0]])
    attn = _dpa(attn_mask_type="padding_causal")
    got = attn.apply({}, q, k, v, segment_ids=ids)
    for lo, hi in ((0, 3), (3, 5)):
        alone = _dpa(attn_mask_type="causal").apply({}, q[:, lo:hi], k[:, lo:hi], v[:, lo:hi])
        np.testing.assert_allclose(np.asarray(got[:, lo:hi]), np.asarray(alone), atol=1e-6)
    np.testing.assert_array_equal(
        attn.apply({}, q, k, v, segment_ids=(ids, ids)), got
    )  # a (q_ids, kv_ids) pair
    np.testing.assert_array_equal(
        _dpa(attn_mask_type="padding_causal").apply({}, q, k, v, segment_mask(ids, ids)), got
    )


# ------------------------------------------------------------------------ bias, scale


def test_post_and_pre_scale_bias_and_scale_factor():
    q, k, v = _qkv(2)
    bias = rand((1, H, SQ, SKV), 5)
    post = _dpa(num_gqa_groups=2).apply({}, q, k, v, None, bias)  # default: post_scale_bias
    np.testing.assert_allclose(np.asarray(post), _oracle(q, k, v, bias=bias), atol=2e-6)
    pre = _dpa(num_gqa_groups=2, attn_bias_type="pre_scale_bias", scale_factor=0.5)
    np.testing.assert_allclose(
        np.asarray(pre.apply({}, q, k, v, None, bias)),
        _oracle(q, k, v, bias=0.5 * np.asarray(bias), scale=0.5), atol=2e-6,
    )  # fmt: skip
    with pytest.raises(ValueError, match="needs a bias"):
        _dpa(num_gqa_groups=2, attn_bias_type="post_scale_bias").apply({}, q, k, v)
    with pytest.raises(ValueError, match="takes no bias"):
        _dpa(num_gqa_groups=2, attn_bias_type="no_bias").apply({}, q, k, v, None, bias)


def test_bfloat16_inputs_keep_their_dtype():
    q, k, v = (t.astype(jnp.bfloat16) for t in _qkv())
    out = _dpa(attn_mask_type="causal").apply({}, q, k, v)
    assert out.dtype == jnp.bfloat16
    want = _oracle(q, k, v, causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=3e-2)


# ------------------------------------------------------------------------ dropout


def test_dropout_uses_its_rng_stream_and_is_off_when_deterministic():
    q, k, v = _qkv(2)
    attn = _dpa(num_gqa_groups=2, attention_dropout=0.5, attn_mask_type="causal",
                dropout_rng_name="attn_drop")  # fmt: skip
    base = _dpa(num_gqa_groups=2, attn_mask_type="causal").apply({}, q, k, v)
    np.testing.assert_array_equal(attn.apply({}, q, k, v, deterministic=True), base)
    a = attn.apply({}, q, k, v, rngs={"attn_drop": jax.random.key(1)})
    b = attn.apply({}, q, k, v, rngs={"attn_drop": jax.random.key(1)})
    c = attn.apply({}, q, k, v, rngs={"attn_drop": jax.random.key(2)})
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c) and not np.allclose(a, base)
    with pytest.raises(flax.errors.InvalidRngError, match="attn_drop"):
        attn.apply({}, q, k, v)  # no RNG for the stream


def test_attention_core_is_the_module_as_a_function():
    """attention_core (what fp8jax.nnx calls) gives the module's result bit for bit; with a
    key, the dropout of attention_with_dropout with that key; a key function is called only
    when the dropout is on."""
    q, k, v = _qkv(2)
    kw = dict(num_gqa_groups=2, attn_mask_type="padding_causal", scale_factor=0.3)
    mask, bias = _padding_mask(), rand((1, H, SQ, SKV), 9)
    want = _dpa(**kw).apply({}, q, k, v, mask, bias)
    got = attention_core(q, k, v, mask, bias, head_dim=D, num_attention_heads=H, **kw)
    np.testing.assert_array_equal(got, want)

    def no_key():
        raise AssertionError("drew a key with the dropout off")

    drop = dict(kw, attention_dropout=0.5, head_dim=D, num_attention_heads=H)
    off = attention_core(q, k, v, mask, bias, **dict(drop, attention_dropout=0.0),
                         dropout_rng=no_key)  # fmt: skip
    np.testing.assert_array_equal(off, want)
    np.testing.assert_array_equal(attention_core(q, k, v, mask, bias, **drop), want)
    rng = jax.random.key(4)
    on = attention_core(q, k, v, mask, bias, **drop, dropout_rng=lambda: rng)
    ref = attention_with_dropout(q, k, v, bias, ~mask, is_causal=True, window=None, scale=0.3,
                                 rate=0.5, rng=rng)  # fmt: skip
    np.testing.assert_array_equal(on, ref)
    np.testing.assert_array_equal(attention_core(q, k, v, mask, bias, **drop, dropout_rng=rng), ref)


def test_dropout_formula_and_expectation():
    """attention_with_dropout equals the oracle's probabilities times the Bernoulli keep mask
    it draws, rescaled; and averaged over keys it converges to attention without dropout."""
    q, k, v = _qkv(2)
    rate, rng = 0.25, jax.random.key(7)
    got = attention_with_dropout(q, k, v, None, None, is_causal=True, window=None,
                                 scale=1 / math.sqrt(D), rate=rate, rng=rng)  # fmt: skip
    keep = np.asarray(jax.random.bernoulli(rng, 1 - rate, (B, 2, H // 2, SQ, SKV)))
    qq, kk, vv = (np.asarray(t, np.float64) for t in (q, k, v))
    want = np.zeros_like(qq)
    for b in range(B):
        for h in range(H):
            g, r = h // 2, h % 2
            logits = qq[b, :, h] @ kk[b, :, g].T / math.sqrt(D)
            logits = np.where(np.tril(np.ones((SQ, SKV), bool)), logits, -1e30)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            want[b, :, h] = (p * keep[b, g, r] / (1 - rate)) @ vv[b, :, g]
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)

    keys = jax.random.split(jax.random.key(3), 4000)
    f = jax.vmap(lambda r: attention_with_dropout(q, k, v, None, None, is_causal=True,
                                                  window=None, scale=1 / math.sqrt(D),
                                                  rate=rate, rng=r))  # fmt: skip
    mean = jnp.mean(f(keys), axis=0)
    base = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(mean), np.asarray(base), atol=0.08)


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kw", "args", "exc", "match"),
    [
        (dict(num_gqa_groups=3), {}, ValueError, "num_gqa_groups"),
        (dict(num_gqa_groups=0), {}, ValueError, "num_gqa_groups"),
        (dict(attn_mask_type="bidirectional"), {}, ValueError, "attn_mask_type"),
        (dict(attn_mask_type=1), {}, TypeError, "attn_mask_type"),
        (dict(attn_mask_type="padding"), {"mask": jnp.zeros((B, SQ, SKV), bool)}, ValueError,
         "mask"),
        (dict(attn_mask_type="padding"), {"mask": jnp.zeros((B, 1, SQ, SKV + 1), bool)},
         ValueError, "mask"),
        (dict(attn_mask_type="padding"), {"mask": jnp.zeros((B, 1, SQ, SKV))}, TypeError,
         "mask"),
        (dict(window_size=3), {}, TypeError, "window_size"),
        (dict(attention_dropout=1.0), {}, ValueError, "attention_dropout"),
        (dict(qkv_layout="thd_thd_thd"), {}, ValueError, "qkv_layout"),
        (dict(attn_bias_type="sideways"), {}, ValueError, "attn_bias_type"),
        (dict(), {"segment_ids": jnp.ones((B, SQ), jnp.int32)}, ValueError, "segment_ids"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(kw, args, exc, match):
    q, k, v = _qkv()
    with pytest.raises(exc, match=match):
        _dpa(**kw).apply({}, q, k, v, **args)


def test_bad_shapes_name_the_argument():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="num_attention_heads"):
        DotProductAttention(head_dim=D, num_attention_heads=2, num_gqa_groups=2,
                            transpose_batch_sequence=False).apply({}, q, k, v)  # fmt: skip
    with pytest.raises(ValueError, match="num_gqa_groups"):
        _dpa(num_gqa_groups=2).apply({}, q, k, v)  # k, v have 4 heads
    with pytest.raises(ValueError, match="query"):
        _dpa().apply({}, q[0], k, v)
    with pytest.raises(ValueError, match="segment_ids"):
        _dpa(attn_mask_type="padding").apply({}, q, k, v, segment_ids=jnp.ones((B, SQ + 1), int))
    with pytest.raises(TypeError, match="segment_ids"):
        _dpa(attn_mask_type="padding").apply({}, q, k, v, segment_ids=jnp.ones((B, SQ)))


# ---------------------------------------------------------------------------------- fp8_dpa


def _dpa_train(module, q, k, v, recipe, steps=2):
    """``steps`` steps of ``module`` (the mean of its output squared, differentiated with
    respect to its probes; no params) -> (outputs, fp8_meta, fp8_probe)."""
    with fp8jax.autocast(enabled=True, recipe=recipe):
        variables = module.init(jax.random.key(0), q, k, v)
    meta, probes = variables["fp8_meta"], variables["fp8_probe"]

    def loss(probes, meta):
        with fp8jax.autocast(enabled=True, recipe=recipe):
            out = module.apply({"fp8_meta": meta, "fp8_probe": probes}, q, k, v)
        return jnp.mean(out.astype(jnp.float32) ** 2), out

    outs = []
    for _ in range(steps):
        (_, out), pg = jax.value_and_grad(loss, has_aux=True)(probes, meta)
        meta = fp8jax.flax.update_fp8_variables(meta, pg, recipe)
        outs.append(out)
    return outs, meta, probes


def test_fp8_dpa_keeps_the_attention_roles_and_trains():
    """DotProductAttention(fp8_dpa=True) under DelayedScaling: 15 FP8 roles in its own
    fp8_meta/fp8_probe; after a step the scales follow the amaxes, and the output is the
    high-precision attention's to E4M3 precision."""
    q, k, v = _qkv(sq=8, skv=8)
    recipe = fp8jax.DelayedScaling(amax_history_len=4)
    outs, meta, probes = _dpa_train(_dpa(fp8_dpa=True, attn_mask_type="causal"), q, k, v, recipe)
    assert meta["scale"].shape == (15,) and probes["call_0"].shape == (15,)
    assert float(meta["scale"][0]) == np.float32(448.0) / jnp.max(jnp.abs(q))
    want = _dpa(attn_mask_type="causal").apply({}, q, k, v)
    assert np.linalg.norm(outs[-1] - want) < 0.1 * np.linalg.norm(want)


def test_fp8_dpa_under_current_scaling_has_no_state():
    q, k, v = _qkv(sq=8, skv=8)
    with fp8jax.autocast(enabled=True, recipe=fp8jax.Float8CurrentScaling()):
        module = _dpa(fp8_dpa=True, attn_mask_type="causal")
        variables = module.init(jax.random.key(0), q, k, v)
        out = module.apply(variables, q, k, v)
    assert variables == {}
    want = _dpa(attn_mask_type="causal").apply({}, q, k, v)
    assert np.linalg.norm(out - want) < 0.1 * np.linalg.norm(want)


def test_fp8_dpa_off_or_without_fp8_is_the_high_precision_core():
    q, k, v = _qkv()
    want = _dpa().apply({}, q, k, v)
    assert _dpa(fp8_dpa=True).init(jax.random.key(0), q, k, v) == {}
    np.testing.assert_array_equal(_dpa(fp8_dpa=True).apply({}, q, k, v), want)


def test_fp8_dpa_refusals_warn_once_or_raise_when_strict():
    """A call the FP8 attention cannot take (here a bias) runs in high precision with a
    warning naming the reason; inside strict_fp8_attention it is a ValueError."""
    from fp8jax.layers.attention_backend import Fp8AttentionFallback, strict_fp8_attention

    q, k, v = _qkv()
    bias = rand((1, H, SQ, SKV), 5)
    recipe = fp8jax.Float8CurrentScaling()
    module = _dpa(fp8_dpa=True)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        with pytest.warns(Fp8AttentionFallback, match="fp8_dpa=True.*takes no bias"):
            out = module.apply({}, q, k, v, bias=bias)
        np.testing.assert_array_equal(out, _dpa().apply({}, q, k, v, bias=bias))
        with strict_fp8_attention(), pytest.raises(ValueError, match=r"takes no bias.*strict"):
            module.apply({}, q, k, v, bias=bias)
    with fp8jax.autocast(enabled=True, recipe=fp8jax.Float8BlockScaling()):
        with pytest.warns(Fp8AttentionFallback, match="block-scaled"):
            module.apply({}, q, k, v)


def test_fp8_attention_recipe_flags_stay_rejected():
    for flag in ("fp8_dpa", "fp8_mha"):
        with pytest.raises(ValueError, match=flag):
            fp8jax.DelayedScaling(**{flag: True})


def test_docstring_examples():
    for mod in (rpb_mod, mha_mod, core_mod, rotary):
        result = doctest.testmod(mod, verbose=False)
        assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------------------------ relative position


def _t5_bucket(rel, bidirectional, num_buckets, max_distance):
    """T5's bucket of one relative position (key - query), scalar Python."""
    n = num_buckets
    out = 0
    dist = -rel
    if bidirectional:
        n //= 2
        if dist < 0:
            out += n
        dist = abs(dist)
    else:
        dist = max(dist, 0)
    exact = n // 2
    if dist < exact:
        return out + dist
    big = exact + int(
        math.log(dist / exact + np.finfo(np.float32).eps)
        / math.log(max_distance / exact)
        * (n - exact)
    )
    return out + min(big, n - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_biases_are_t5_buckets_of_the_table(bidirectional):
    rpb = RelativePositionBiases(num_buckets=8, max_distance=20, num_attention_heads=H)
    variables = rpb.init(jax.random.key(0), 7, 30, bidirectional)
    table = np.asarray(variables["params"]["rel_embedding"])
    assert table.shape == (H, 8)
    got = np.asarray(rpb.apply(variables, 7, 30, bidirectional))
    assert got.shape == (1, H, 7, 30)
    for i in range(7):
        for j in range(30):
            bucket = _t5_bucket(j - i, bidirectional, 8, 20)
            np.testing.assert_array_equal(got[0, :, i, j], table[:, bucket])

    g = jax.grad(lambda p: jnp.sum(rpb.apply({"params": p}, 7, 30, bidirectional)))(
        variables["params"]
    )
    counts = np.zeros(8)
    for i in range(7):
        for j in range(30):
            counts[_t5_bucket(j - i, bidirectional, 8, 20)] += 1
    np.testing.assert_array_equal(np.asarray(g["rel_embedding"]), np.tile(counts, (H, 1)))


def test_relative_position_biases_axes_and_errors():
    rpb = RelativePositionBiases(num_buckets=8, max_distance=20, num_attention_heads=H,
                                 embedding_axes=("heads", "relpos_buckets"))  # fmt: skip
    variables = rpb.init(jax.random.key(0), 3, 3)
    spec = nn.get_partition_spec(variables)["params"]["rel_embedding"]
    assert tuple(spec) == ("heads", "relpos_buckets")
    with pytest.raises(ValueError, match="num_buckets"):
        RelativePositionBiases(num_buckets=0, max_distance=4, num_attention_heads=2).init(
            jax.random.key(0), 2, 2
        )
    with pytest.raises(ValueError, match="q_seqlen"):
        RelativePositionBiases(num_buckets=8, max_distance=4, num_attention_heads=2).init(
            jax.random.key(0), 0, 2
        )


# ------------------------------------------------------------------------ rotary


def _rope_oracle(x, windows, method, seq_dim=1):
    """Direct formula, numpy float64: pair (a, b) at position p rotated by p / tau_i."""
    x = np.moveaxis(np.asarray(x, np.float64), seq_dim, 1)
    d = x.shape[-1]
    lo, hi = windows
    out = np.empty_like(x)
    for p in range(x.shape[1]):
        for i in range(d // 2):
            theta = p / (lo * (hi / lo) ** (2 * i / d))
            ia, ib = (2 * i, 2 * i + 1) if method == "consecutive" else (i, i + d // 2)
            a, b = x[:, p, ..., ia], x[:, p, ..., ib]
            out[:, p, ..., ia] = a * math.cos(theta) - b * math.sin(theta)
            out[:, p, ..., ib] = b * math.cos(theta) + a * math.sin(theta)
    return np.moveaxis(out, 1, seq_dim)


@pytest.mark.parametrize("method", ["consecutive", "alternate"])
@pytest.mark.parametrize("transpose", [False, True])
def test_rotary_matches_the_direct_formula(method, transpose):
    x = rand((2, 7, 3, 8), 4)
    if transpose:
        x = jnp.swapaxes(x, 0, 1)
    got = rotary.rotary_pos_emb(x, (1, 10000), transpose, method)
    want = _rope_oracle(x, (1, 10000), method, seq_dim=0 if transpose else 1)
    np.testing.assert_allclose(np.asarray(got), want, atol=5e-6)
    assert got.dtype == x.dtype
    # a rotation: norms of the pairs are kept, position 0 unchanged
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_rotary_positions_dtype_and_errors():
    x = rand((2, 5, 3, 4), 1)
    shifted = rotary.rotary_pos_emb(x, (1, 100), False, "alternate", positions=jnp.arange(5) + 3)
    whole = rotary.rotary_pos_emb(jnp.concatenate([x[:, :3], x], 1), (1, 100), False, "alternate")
    np.testing.assert_allclose(np.asarray(shifted), np.asarray(whole[:, 3:]), atol=1e-6)
    assert rotary.rotary_pos_emb(x.astype(jnp.bfloat16), (1, 100), False).dtype == jnp.bfloat16
    assert rotary.canonical_group_method("Consecutive") == "consecutive"
    with pytest.raises(ValueError, match="group_method"):
        rotary.rotary_pos_emb(x, (1, 100), False, "interleaved")
    with pytest.raises(ValueError, match="even"):
        rotary.rotary_pos_emb(x[..., :3], (1, 100), False)
    with pytest.raises(ValueError, match="windows"):
        rotary.rotary_pos_emb(x, (0, 100), False)
    with pytest.raises(ValueError, match="positions"):
        rotary.rotary_pos_emb(x, (1, 100), False, positions=jnp.arange(4))
