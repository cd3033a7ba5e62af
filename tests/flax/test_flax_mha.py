"""fp8jax.flax.MultiHeadAttention against a plain-Flax twin with the same params (flax.linen
LayerNorm/RMSNorm and DenseGeneral, jax.nn.dot_product_attention): bit-identical with FP8 off,
within FP8 bounds with FP8 on (current scaling), a delayed-scaling train step with
Fp8TrainState, TE's params and return value, and bad input."""

from __future__ import annotations

import itertools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _shared import rand

import fp8jax
from fp8jax import DelayedScaling, Float8CurrentScaling
from fp8jax.flax import Fp8TrainState, MultiHeadAttention, RelativePositionBiases
from fp8jax.rotary import rotary_pos_emb

pytestmark = pytest.mark.usefixtures("float32_matmuls")

B, S, SKV, HID, KV_HID, HEADS, D = 2, 6, 5, 16, 12, 4, 4


def _mha(**kw):
    kw.setdefault("transpose_batch_sequence", False)
    return MultiHeadAttention(head_dim=D, num_attention_heads=HEADS, **kw)


def _dense(p, x, features):
    """flax.linen.DenseGeneral with ``p``'s kernel (and bias)."""
    layer = nn.DenseGeneral(features, axis=-1, use_bias="bias" in p)
    return layer.apply({"params": p}, x)


def twin(p, xq, xkv, cfg, mask=None, bias=None):
    """The same attention from flax.linen layers and jax.nn.dot_product_attention."""
    groups = cfg.get("num_gqa_groups") or HEADS
    tbs = cfg.get("transpose_batch_sequence", False)
    self_attn = xkv is None
    if tbs:
        xq = jnp.swapaxes(xq, 0, 1)
        xkv = None if self_attn else jnp.swapaxes(xkv, 0, 1)
    first = p["qkv"] if "qkv" in p else p["query"]
    y = xq
    if cfg.get("input_layernorm", True):
        if cfg.get("layernorm_type", "layernorm") == "layernorm":
            ln = nn.LayerNorm(epsilon=1e-6)
            y = ln.apply({"params": {"scale": first["scale"], "bias": first["ln_bias"]}}, xq)
        else:
            y = nn.RMSNorm(epsilon=1e-6).apply({"params": {"scale": first["scale"]}}, xq)
    strip = lambda d: {k: v for k, v in d.items() if k in ("kernel", "bias")}
    if "qkv" in p:
        qkv = _dense(strip(p["qkv"]), y, (3, HEADS * D))
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    else:
        q = _dense(strip(p["query"]), y, HEADS * D)
        src = y if self_attn else xkv
        if "kv" in p:
            kv = _dense(p["kv"], src, (2, groups * D))
            k, v = kv[..., 0, :], kv[..., 1, :]
        else:
            k, v = _dense(p["key"], src, groups * D), _dense(p["value"], src, groups * D)
    q = q.reshape(*q.shape[:2], HEADS, D)
    k = k.reshape(*k.shape[:2], groups, D)
    v = v.reshape(*v.shape[:2], groups, D)
    if cfg.get("enable_rotary_pos_emb"):
        method = cfg.get("rotary_pos_emb_group_method", "consecutive")
        q = rotary_pos_emb(q, (1, 10000), False, method)
        k = rotary_pos_emb(k, (1, 10000), False, method)
    mt = cfg.get("attn_mask_type", "causal")
    jmask = ~mask if mt in ("padding", "padding_causal") else None
    scale = 1 / math.sqrt(D) if cfg.get("scale_attn_logits") else 1.0
    x = jax.nn.dot_product_attention(q, k, v, bias, jmask, scale=scale, is_causal="causal" in mt)
    out = _dense(p["out"], x.reshape(*x.shape[:2], HEADS * D), xq.shape[-1])
    return jnp.swapaxes(out, 0, 1) if tbs else out


def _mask(sq=S, skv=S):
    q_ok = np.arange(sq)[None, :] < np.array([sq, sq - 2])[:, None]
    kv_ok = np.arange(skv)[None, :] < np.array([skv, skv - 1])[:, None]
    return jnp.asarray(~(q_ok[:, None, :, None] & kv_ok[:, None, None, :]))


# name, config, cross-attention?, parameter tree (module -> param shapes)
CASES = [
    ("fused_self", dict(attn_mask_type="causal"), False,
     {"qkv": {"kernel": (HID, 3, HEADS * D), "ln_bias": (HID,), "scale": (HID,)},
      "out": {"kernel": (HEADS * D, HID)}}),
    ("fused_self_gqa_rms_tbs", dict(num_gqa_groups=2, layernorm_type="rmsnorm",
                                    attn_mask_type="padding", transpose_batch_sequence=True),
     False,
     {"query": {"kernel": (HID, HEADS * D), "scale": (HID,)},
      "kv": {"kernel": (HID, 2, 2 * D)}, "out": {"kernel": (HEADS * D, HID)}}),
    ("separate_self_bias_rope", dict(fuse_qkv_params=False, use_bias=True, attn_mask_type="no_mask",
                                     enable_rotary_pos_emb=True), False,
     {"query": {"kernel": (HID, HEADS * D), "bias": (HEADS * D,), "ln_bias": (HID,),
                "scale": (HID,)},
      "key": {"kernel": (HID, HEADS * D), "bias": (HEADS * D,)},
      "value": {"kernel": (HID, HEADS * D), "bias": (HEADS * D,)},
      "out": {"kernel": (HEADS * D, HID), "bias": (HID,)}}),
    ("fused_cross_rope_alt", dict(attn_mask_type="padding_causal", enable_rotary_pos_emb=True,
                                  rotary_pos_emb_group_method="alternate", use_bias=True), True,
     {"query": {"kernel": (HID, HEADS * D), "bias": (HEADS * D,), "ln_bias": (HID,),
                "scale": (HID,)},
      "kv": {"kernel": (KV_HID, 2, HEADS * D), "bias": (2, HEADS * D)},
      "out": {"kernel": (HEADS * D, HID), "bias": (HID,)}}),
    ("separate_cross_noln_gqa", dict(fuse_qkv_params=False, input_layernorm=False,
                                     scale_attn_logits=True, num_gqa_groups=1,
                                     attn_mask_type="no_mask"), True,
     {"query": {"kernel": (HID, HEADS * D)}, "key": {"kernel": (KV_HID, D)},
      "value": {"kernel": (KV_HID, D)}, "out": {"kernel": (HEADS * D, HID)}}),
]  # fmt: skip


def _inputs(cfg, cross):
    tbs = cfg.get("transpose_batch_sequence", False)
    xq = rand((B, S, HID), 0)
    xkv = rand((B, SKV, KV_HID), 1) if cross else None
    skv = SKV if cross else S
    mask = _mask(S, skv)
    if tbs:
        xq = jnp.swapaxes(xq, 0, 1)
    return xq, xkv, mask


@pytest.mark.parametrize(("name", "cfg", "cross", "shapes"), CASES, ids=[c[0] for c in CASES])
def test_fp8_off_is_bit_identical_to_the_flax_twin(name, cfg, cross, shapes):
    """Params as TE names and shapes them; forward bit-identical, input and param gradients
    equal to float32 reduction order (fp8jax's DenseGeneral contracts the weight gradient's
    batch dims as one, Flax's as two)."""
    model = _mha(**cfg)
    xq, xkv, mask = _inputs(cfg, cross)
    kv_arg = xkv if cross else xq
    params = model.init(jax.random.key(0), xq, kv_arg, mask)["params"]
    assert jax.tree.map(jnp.shape, params) == shapes
    c = rand(xq.shape, 5)

    def ours(p, xq, xkv):
        out, _ = model.apply({"params": p}, xq, xkv if cross else xq, mask)
        return jnp.sum(out * c)

    def theirs(p, xq, xkv):
        return jnp.sum(twin(p, xq, xkv if cross else None, cfg, mask) * c)

    # self-attention is `inputs_q is inputs_kv` (TE's test), so xq goes into jit once
    out, _ = jax.jit(lambda p, xq: model.apply({"params": p}, xq, xkv if cross else xq, mask))(
        params, xq
    )
    tout = jax.jit(lambda p, xq, xkv: twin(p, xq, xkv, cfg, mask))(params, xq, xkv)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(tout))
    xkv_arg = xkv if cross else jnp.zeros(())
    g = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(params, xq, xkv_arg)
    tg = jax.jit(jax.grad(theirs, argnums=(0, 1, 2)))(params, xq, xkv_arg)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(tg), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-6)


def test_relative_position_bias_and_bfloat16():
    """A T5 relative bias as the attention bias; bf16 inputs and params stay bf16."""
    cfg = dict(attn_mask_type="no_mask")
    model = _mha(**cfg)
    rpb = RelativePositionBiases(num_buckets=8, max_distance=16, num_attention_heads=HEADS)
    bias = rpb.apply(rpb.init(jax.random.key(1), S, S), S, S)
    x = rand((B, S, HID), 3)
    params = model.init(jax.random.key(0), x, x, None, bias)["params"]
    out, _ = model.apply({"params": params}, x, x, None, bias)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(twin(params, x, None, cfg, None,
                                                                   bias)))  # fmt: skip
    m16 = _mha(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, **cfg)
    x16 = x.astype(jnp.bfloat16)
    v16 = m16.init(jax.random.key(0), x16, x16)
    out16, _ = m16.apply(v16, x16, x16)
    assert out16.dtype == jnp.bfloat16
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(v16))


def test_layernorm_output_is_returned_as_te_does():
    x = rand((B, S, HID), 0)
    ln = nn.LayerNorm(epsilon=1e-6)
    for kw, want in ((dict(), None), (dict(return_layernorm_output=True), "ln"),
                     (dict(num_gqa_groups=2), "ln"), (dict(fuse_qkv_params=False), "ln"),
                     (dict(input_layernorm=False, return_layernorm_output=True), "x")):  # fmt: skip
        model = _mha(**kw)
        v = model.init(jax.random.key(0), x, x)
        _, ln_out = model.apply(v, x, x)
        if want is None:
            assert ln_out is None
            continue
        first = v["params"]["qkv" if "qkv" in v["params"] else "query"]
        expect = x
        if want == "ln":
            expect = ln.apply({"params": {"scale": first["scale"], "bias": first["ln_bias"]}}, x)
        np.testing.assert_array_equal(np.asarray(ln_out), np.asarray(expect))
    cross = _mha(return_layernorm_output=False)
    v = cross.init(jax.random.key(0), x, x[:, :3])
    assert cross.apply(v, x, x[:, :3])[1] is None


def test_te_initialization():
    """The fused kernel's q/k/v slices are independent draws; the query one is divided by
    sqrt(head_dim) (scaled_query_init), the output projection is not."""
    model = MultiHeadAttention(head_dim=16, num_attention_heads=8, transpose_batch_sequence=False)
    x = jnp.ones((1, 2, 256))
    p = jax.jit(lambda k, x: model.init(k, x, x))(jax.random.key(0), x)["params"]
    kernel = np.asarray(p["qkv"]["kernel"])
    stds = kernel.std(axis=(0, 2))
    np.testing.assert_allclose(stds, [1 / 16 / 4, 1 / 16, 1 / 16], rtol=0.05)  # 1/sqrt(256)
    assert not np.allclose(kernel[:, 1], kernel[:, 2])
    np.testing.assert_allclose(np.asarray(p["out"]["kernel"]).std(), 1 / math.sqrt(128), rtol=0.05)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("index", [0, 3])
def test_fp8_on_is_within_fp8_bounds_of_the_twin(index):
    """Current scaling: four FP8 projections (E4M3 forward, E5M2 gradients) around a
    high-precision core. Forward within 10%, gradients within 25% (Frobenius)."""
    _, cfg, cross, _ = CASES[index]
    model = _mha(**cfg)
    xq, xkv, mask = _inputs(cfg, cross)
    kv_arg = xkv if cross else xq
    params = model.init(jax.random.key(0), xq, kv_arg, mask)["params"]
    c = rand(xq.shape, 5)

    def ours(p, xq):
        with fp8jax.autocast(enabled=True, recipe=Float8CurrentScaling()):
            out, _ = model.apply({"params": p}, xq, xkv if cross else xq, mask)
        return jnp.sum(out * c), out

    def theirs(p, xq):
        out = twin(p, xq, xkv, cfg, mask)
        return jnp.sum(out * c), out

    (_, out), g = jax.jit(jax.value_and_grad(ours, argnums=(0, 1), has_aux=True))(params, xq)
    (_, tout), tg = jax.jit(jax.value_and_grad(theirs, argnums=(0, 1), has_aux=True))(params, xq)
    assert _rel(out, tout) < 0.1
    assert _rel(g[1], tg[1]) < 0.25
    for a, b in zip(jax.tree.leaves(g[0]), jax.tree.leaves(tg[0]), strict=True):
        assert _rel(a, b) < 0.25


def test_delayed_scaling_train_steps_with_fp8_train_state():
    """Three jitted steps: the FP8 state (4 projections x 3 roles, fused QKV: 3 layers) is
    created by init, changes every step, and the loss falls."""
    recipe = DelayedScaling(amax_history_len=4)
    model = _mha(attn_mask_type="causal")
    x, y = rand((B, S, HID), 0), rand((B, S, HID), 1, 0.1)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        variables = model.init(jax.random.key(0), x, x)
    assert set(variables["fp8_meta"]) == {"qkv", "out"}
    state = Fp8TrainState.from_variables(
        apply_fn=model.apply, variables=variables, tx=optax.sgd(0.05), recipe=recipe
    )

    @jax.jit
    def step(state):
        def loss(params, probes):
            v = {"params": params, "fp8_meta": state.fp8_meta, "fp8_probe": probes}
            with fp8jax.autocast(enabled=True, recipe=recipe):
                out, _ = model.apply(v, x, x)
            return jnp.mean((out - y) ** 2)

        value, (grads, probe_grads) = jax.value_and_grad(loss, argnums=(0, 1))(
            state.params, state.fp8_probe
        )
        return state.apply_gradients(grads=grads, probe_grads=probe_grads, recipe=recipe), value

    losses, metas = [], [state.fp8_meta]
    for _ in range(3):
        state, value = step(state)
        losses.append(float(value))
        metas.append(state.fp8_meta)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    for before, after in itertools.pairwise(metas):
        assert not all(
            np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after),
                                                 strict=True)
        )  # fmt: skip


def test_dropout_and_logical_axes():
    x = rand((B, S, HID), 0)
    model = _mha(attention_dropout=0.3, qkv_kernel_axes=("embed", "heads"),
                 qkv_bias_axes=("heads",), out_kernel_axes=("heads", "embed"),
                 out_bias_axes=("embed",), use_bias=True)  # fmt: skip
    v = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, x)
    specs = nn.get_partition_spec(v)["params"]
    assert tuple(specs["qkv"]["kernel"]) == ("embed", None, "heads")
    assert tuple(specs["qkv"]["bias"]) == (None, "heads")
    assert tuple(specs["out"]["kernel"]) == ("heads", "embed")
    a = model.apply(v, x, x, rngs={"dropout": jax.random.key(2)})[0]
    b = model.apply(v, x, x, rngs={"dropout": jax.random.key(3)})[0]
    det = model.apply(v, x, x, deterministic=True)[0]
    nodrop = _mha(attention_dropout=0.0, use_bias=True).apply(nn.unbox(v), x, x)[0]
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(det, nodrop)


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(num_gqa_groups=3), ValueError, "num_gqa_groups"),
        (dict(num_attention_heads=0), ValueError, "num_attention_heads"),
        (dict(head_dim=0), ValueError, "head_dim"),
        (dict(attn_mask_type="full"), ValueError, "attn_mask_type"),
        (dict(enable_rotary_pos_emb=True, rotary_pos_emb_group_method="x"), ValueError,
         "rotary_pos_emb_group_method"),
        (dict(enable_rotary_pos_emb=True, head_dim=3), ValueError, "even head_dim"),
        (dict(qkv_kernel_axes=("embed",)), ValueError, "qkv_kernel_axes"),
    ],
)  # fmt: skip
def test_bad_config_names_the_argument(kw, exc, match):
    kw = {"head_dim": D, "num_attention_heads": HEADS, "transpose_batch_sequence": False, **kw}
    x = rand((B, S, HID), 0)
    with pytest.raises(exc, match=match):
        MultiHeadAttention(**kw).init(jax.random.key(0), x, x)


def test_bad_input_names_the_argument():
    x = rand((B, S, HID), 0)
    model = _mha(attn_mask_type="padding")
    with pytest.raises(ValueError, match="inputs_q"):
        model.init(jax.random.key(0), x[0], x[0])
    with pytest.raises(TypeError, match="inputs_kv"):
        model.init(jax.random.key(0), x, jnp.ones((B, S, HID), jnp.int32))
    with pytest.raises(ValueError, match="batch sizes"):
        model.init(jax.random.key(0), x, x[:1])
    with pytest.raises(ValueError, match="mask"):
        model.init(jax.random.key(0), x, x, jnp.zeros((B, S, S), bool))
    with pytest.raises(TypeError, match="mask"):
        model.init(jax.random.key(0), x, x, jnp.zeros((B, 1, S, S), jnp.float32))
    v = _mha().init(jax.random.key(0), x, x, decode=True)
    with pytest.raises(ValueError, match="one token"):
        _mha().apply(v, x, x, decode=True, mutable=["cache"])


@pytest.mark.parametrize(
    "cfg",
    [dict(attn_mask_type="causal", enable_rotary_pos_emb=True, num_gqa_groups=2),
     dict(attn_mask_type="padding_causal", transpose_batch_sequence=True, fuse_qkv_params=False,
          enable_rotary_pos_emb=True, rotary_pos_emb_group_method="alternate")],
)  # fmt: skip
def test_decode_steps_equal_the_causal_forward(cfg):
    """Token by token through the key/value cache = one causal pass over the sequence
    (rotary at the cached positions, the padding mask row by row)."""
    model = _mha(**cfg)
    tbs = cfg.get("transpose_batch_sequence", False)
    x = rand((B, S, HID), 0)
    mask = jnp.zeros((B, 1, S, S), bool).at[1, :, :, 1].set(True)  # batch 1 skips key 1
    xin = jnp.swapaxes(x, 0, 1) if tbs else x
    variables = model.init(jax.random.key(0), xin, xin, mask, decode=True)
    assert variables["cache"]["cached_key"].shape == (
        (S, B, cfg.get("num_gqa_groups", HEADS), D) if tbs else (B, S, 2, D)
    )
    full, _ = model.apply({"params": variables["params"]}, xin, xin, mask)
    full = jnp.swapaxes(full, 0, 1) if tbs else full

    @jax.jit
    def step(variables, tok, row):
        (out, _), upd = model.apply(variables, tok, tok, row, decode=True, mutable=["cache"])
        return out, {**variables, **upd}

    padded = cfg["attn_mask_type"] == "padding_causal"
    for t in range(S):
        tok = x[:, t : t + 1]
        tok = jnp.swapaxes(tok, 0, 1) if tbs else tok
        out, variables = step(variables, tok, mask[:, :, t : t + 1] if padded else None)
        out = jnp.swapaxes(out, 0, 1) if tbs else out
        np.testing.assert_allclose(np.asarray(out[:, 0]), np.asarray(full[:, t]), rtol=1e-5,
                                   atol=1e-5)  # fmt: skip
    assert int(variables["cache"]["cache_index"]) == S


class _Block(nn.Module):
    """x + attention(x): the way a Transformer layer calls it (the same array twice)."""

    @nn.compact
    def __call__(self, x):
        return x + _mha(num_gqa_groups=2, enable_rotary_pos_emb=True)(x, x)[0]


def test_remat_with_the_fp8_policy_keeps_the_numbers():
    """nn.remat(policy=fp8jax.save_fp8_operands) around a block: the same loss and gradients
    (the attention core is recomputed in the backward pass)."""
    x = rand((B, S, HID), 0)
    plain, remat = _Block(), nn.remat(_Block, policy=fp8jax.save_fp8_operands)()
    recipe = Float8CurrentScaling()
    params = jax.jit(plain.init)(jax.random.key(0), x)["params"]

    def loss(model):
        def f(p, x):
            with fp8jax.autocast(enabled=True, recipe=recipe):
                return jnp.sum(model.apply({"params": p}, x) ** 2)

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x)

    (a, ga), (b, gb) = loss(plain), loss(remat)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for u, w in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(w), rtol=1e-6, atol=1e-6)
