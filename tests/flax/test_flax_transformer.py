"""fp8jax.flax.TransformerLayer: a 2-layer decoder model trains in FP8 (loss falls, the FP8
state moves every step), encoder and decoder layers, nn.scan over layers, decoding with the
key/value cache, and bad input."""

from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax import DelayedScaling, Float8CurrentScaling
from fp8jax.flax import (
    Fp8TrainState,
    TransformerLayer,
    TransformerLayerType,
    update_fp8_variables,
)

HIDDEN, HEADS, MLP, SEQ, VOCAB = 32, 4, 64, 8, 16
NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0)


def _layer(**kw):
    base = dict(hidden_size=HIDDEN, mlp_hidden_size=MLP, num_attention_heads=HEADS, **NO_DROPOUT)
    return TransformerLayer(**{**base, **kw})  # fmt: skip


class TinyLM(nn.Module):
    """Embedding -> 2 decoder-only layers (encoder layers with a causal mask) -> logits."""

    scan: bool = False
    body: str | None = None  # "plain" or "remat": layers in _Body (remat: nn.remat with the FP8
    # policy, fp8jax.save_fp8_operands)

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, HIDDEN)(tokens)
        if self.body is not None:
            remat = nn.remat(_Body, policy=fp8jax.save_fp8_operands)
            body = remat if self.body == "remat" else _Body
            for i in range(2):
                x = body(name=f"layer_{i}")(x)
        elif self.scan:
            block = nn.scan(
                _ScanBody, variable_axes={"params": 0, "fp8_meta": 0, "fp8_probe": 0},
                split_rngs={"params": True}, length=2,
            )  # fmt: skip
            x, _ = block(name="layers")(x, None)
        else:
            for i in range(2):
                x = _layer(self_attn_mask_type="causal", name=f"layer_{i}")(x, deterministic=True)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class _Body(nn.Module):
    """One causal layer taking only arrays (what nn.remat differentiates through)."""

    @nn.compact
    def __call__(self, x):
        return _layer(self_attn_mask_type="causal", name="layer")(x, deterministic=True)


class _ScanBody(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return _layer(self_attn_mask_type="causal")(x, deterministic=True), None


def _data():
    rng = np.random.default_rng(0)
    # a learnable sequence: each token is the previous one plus one (mod VOCAB)
    start = rng.integers(0, VOCAB, (8, 1))
    seq = (start + np.arange(SEQ + 1)) % VOCAB
    return jnp.asarray(seq[:, :-1]), jnp.asarray(seq[:, 1:])


def _train(model, recipe, steps):
    x, y = _data()
    state = Fp8TrainState.from_model(model, jax.random.key(0), x, tx=optax.adam(3e-3),
                                     recipe=recipe)  # fmt: skip

    @jax.jit
    def step(state):
        def loss_fn(params, probes):
            logits = state.apply(state.variables(params, probes), x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, (g, pg) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state.params,
                                                                   state.fp8_probe)  # fmt: skip
        return state.apply_gradients(grads=g, probe_grads=pg), loss

    losses, scales = [], []
    for _ in range(steps):
        state, loss = step(state)
        losses.append(float(loss))
        leaves = [np.ravel(s) for s in jax.tree.leaves(state.fp8_meta)]
        scales.append(np.concatenate(leaves) if leaves else np.zeros(0))
    return losses, scales


@pytest.mark.slow
def test_two_layer_decoder_trains_with_delayed_scaling():
    losses, states = _train(TinyLM(), DelayedScaling(amax_history_len=4), 20)
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], losses
    for a, b in itertools.pairwise(states):
        assert not np.array_equal(a, b)  # the FP8 state moves every step


@pytest.mark.slow
def test_two_layer_decoder_trains_with_current_scaling():
    losses, states = _train(TinyLM(), Float8CurrentScaling(), 20)
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(s.size == 0 for s in states)  # no state at all


def test_scan_over_layers():
    losses, _ = _train(TinyLM(scan=True), DelayedScaling(amax_history_len=4), 5)
    assert losses[-1] < losses[0]


def test_remat_with_the_fp8_policy_keeps_the_numbers():
    """Each layer under ``nn.remat(policy=fp8jax.save_fp8_operands)`` (the FP8 codes and scales
    saved, the rest recomputed): the same losses and FP8 state over three delayed-scaling steps
    as without remat."""
    recipe = DelayedScaling(amax_history_len=4)
    plain_losses, plain_states = _train(TinyLM(body="plain"), recipe, 3)
    losses, states = _train(TinyLM(body="remat"), recipe, 3)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    for a, b in zip(states, plain_states, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_logical_axes_name_every_param():
    """``logical_axes=True``: every param boxed with its logical names (the names
    ``DEFAULT_RULES`` maps); off (the default): plain arrays."""
    x = jax.random.normal(jax.random.key(1), (2, SEQ, HIDDEN))
    v = _layer(logical_axes=True, use_bias=True).init(jax.random.key(0), x, deterministic=True)
    specs = nn.get_partition_spec(v)["params"]
    assert specs["attention"]["qkv"]["kernel"] == P("embed", None, "heads")
    assert specs["attention"]["out"]["kernel"] == P("heads", "embed")
    assert specs["mlp"]["wi_kernel"] == P("embed", "act", "mlp")
    assert specs["mlp"]["wo_kernel"] == P("mlp", "embed")
    assert specs["relpos_bias"]["rel_embedding"] == P("heads", "relpos_buckets")
    boxed = jax.tree.leaves(v["params"], is_leaf=lambda b: isinstance(b, nn.Partitioned))
    assert all(isinstance(b, nn.LogicallyPartitioned) for b in boxed)
    plain = _layer().init(jax.random.key(0), x, deterministic=True)
    assert not any(
        isinstance(b, nn.Partitioned)
        for b in jax.tree.leaves(plain, is_leaf=lambda b: isinstance(b, nn.Partitioned))
    )


def test_encoder_and_decoder_layers():
    x = jax.random.normal(jax.random.key(1), (2, SEQ, HIDDEN))
    enc = jax.random.normal(jax.random.key(2), (2, SEQ + 3, HIDDEN))
    recipe = DelayedScaling(amax_history_len=4)
    dec = _layer(layer_type=TransformerLayerType.DECODER)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        v = dec.init(jax.random.key(0), x, enc, deterministic=True)
        y = dec.apply(v, x, enc, deterministic=True)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert {"self_attention", "encoder_decoder_attention", "mlp", "relpos_bias"} <= set(v["params"])
    e = _layer(output_layernorm=True, apply_residual_connection_post_layernorm=True)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        ev = e.init(jax.random.key(0), x, deterministic=True)
        assert e.apply(ev, x, deterministic=True).shape == x.shape
    assert {"attention", "mlp", "output_layernorm"} <= set(ev["params"])


def test_dropout_needs_its_rng_and_is_reproducible():
    x = jax.random.normal(jax.random.key(1), (2, SEQ, HIDDEN))
    layer = TransformerLayer(hidden_size=HIDDEN, mlp_hidden_size=MLP, num_attention_heads=HEADS)
    v = layer.init(jax.random.key(0), x, deterministic=True)
    a = layer.apply(v, x, rngs={"dropout": jax.random.key(3)})
    b = layer.apply(v, x, rngs={"dropout": jax.random.key(3)})
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(layer.apply(v, x, deterministic=True)))


@pytest.mark.parametrize(
    ("kw", "args", "match"),
    [
        (dict(num_attention_heads=5), (), "num_attention_heads"),
        (dict(layer_type="encoder"), (), "layer_type"),
        (dict(layer_type=TransformerLayerType.DECODER), (), "encoded"),
        (dict(hidden_size=48), (), "hidden_size"),
        (dict(hidden_dropout=1.5), (), "hidden_dropout"),
    ],
)
def test_bad_input_names_the_argument(kw, args, match):
    x = jnp.ones((2, SEQ, HIDDEN))
    with pytest.raises(ValueError, match=match):
        _layer(**kw).init(jax.random.key(0), x, *args, deterministic=True)


def test_rank_error():
    with pytest.raises(ValueError, match="rank 3"):
        _layer().init(jax.random.key(0), jnp.ones((SEQ, HIDDEN)), deterministic=True)


ENC, DEC = TransformerLayerType.ENCODER, TransformerLayerType.DECODER
# name -> (layer_type, transpose_batch_sequence, layer arguments)
DECODE_CASES = {
    "encoder_relbias": (ENC, False, {}),
    "encoder_gqa_rotary_tbs": (ENC, True, dict(num_gqa_groups=2, enable_rotary_pos_emb=True,
                                               enable_relative_embedding=False)),
    "decoder_relbias_tbs": (DEC, True, {}),
    "decoder_padding_causal_separate_qkv": (DEC, False, dict(
        self_attn_mask_type="padding_causal", fuse_qkv_params=False, num_gqa_groups=2,
        use_bias=True, apply_residual_connection_post_layernorm=True)),
}  # fmt: skip


# float32 matmuls: with a GPU's default TF32 the one-token and whole-sequence products round
# differently (1e-3 apart on an H100, and then FP8 codes flip), which is not what this compares.
@pytest.mark.usefixtures("float32_matmuls")
@pytest.mark.parametrize("fp8", [False, True], ids=["fp8_off", "fp8_on"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_steps_equal_the_causal_forward(case, fp8):
    """``decode=True``: ``init`` on the full-length input creates the self-attention's
    key/value cache; then token by token (one jitted step, ``mutable=["cache"]``) each output
    equals the causal forward over the whole sequence at that position. Relative bias rows at
    the cached position, rotary at the cached position, a padding_causal mask row by row, a
    decoder's cross-attention over the whole ``encoded`` (with its padding mask row) at every
    step. FP8 on: DelayedScaling with state moved off its initial scales by one observed
    forward/backward pass, the same state for both runs, so every quantization scale is the
    same and the two agree as closely as with FP8 off."""
    layer_type, tbs, kw = DECODE_CASES[case]
    decoder = layer_type is DEC
    padded = kw.get("self_attn_mask_type") == "padding_causal"
    layer = _layer(layer_type=layer_type, transpose_batch_sequence=tbs, **kw)
    b, s, s_enc = 2, 6, 5
    swap = (lambda t: jnp.swapaxes(t, 0, 1)) if tbs else (lambda t: t)
    x = jax.random.normal(jax.random.key(1), (b, s, HIDDEN))
    enc = swap(jax.random.normal(jax.random.key(2), (b, s_enc, HIDDEN))) if decoder else None
    mask = jnp.zeros((b, 1, s, s), bool).at[1, :, :, 1].set(True) if padded else None
    enc_mask = jnp.zeros((b, 1, s, s_enc), bool).at[0, :, :, -1].set(True) if decoder else None
    recipe = DelayedScaling(amax_history_len=4)

    def run(variables, inputs, row, enc_row, **call):
        with fp8jax.autocast(enabled=fp8, recipe=recipe):
            return layer.apply(variables, inputs, enc, row, enc_row, deterministic=True, **call)

    with fp8jax.autocast(enabled=fp8, recipe=recipe):
        variables = layer.init(jax.random.key(0), swap(x), enc, mask, enc_mask,
                               deterministic=True, decode=True)  # fmt: skip
    fixed = {k: v for k, v in variables.items() if k != "cache"}
    cache = variables["cache"]
    name = "self_attention" if decoder else "attention"
    assert set(cache) == {name}  # the cross-attention has no cache
    groups = kw.get("num_gqa_groups", HEADS)
    head_dim = HIDDEN // HEADS
    assert cache[name]["cached_key"].shape == ((s, b) if tbs else (b, s)) + (groups, head_dim)
    if fp8:
        probe_grads = jax.grad(
            lambda probe: jnp.sum(run({**fixed, "fp8_probe": probe}, swap(x), mask, enc_mask))
        )(fixed["fp8_probe"])
        moved = update_fp8_variables(fixed["fp8_meta"], probe_grads, recipe)
        assert not all(np.array_equal(u, w) for u, w in zip(
            jax.tree.leaves(moved), jax.tree.leaves(fixed["fp8_meta"]), strict=True))  # fmt: skip
        fixed = {**fixed, "fp8_meta": moved}
    full = swap(run(fixed, swap(x), mask, enc_mask))
    steps = dict(max_decode_length=s) if decoder else {}  # TE's argument; optional here

    @jax.jit
    def step(cache, tok, row, enc_row):
        out, upd = run({**fixed, "cache": cache}, tok, row, enc_row, decode=True,
                       mutable=["cache"], **steps)  # fmt: skip
        return out, upd["cache"]

    for t in range(s):
        row = mask[:, :, t : t + 1] if padded else None
        enc_row = enc_mask[:, :, t : t + 1] if decoder else None
        out, cache = step(cache, swap(x[:, t : t + 1]), row, enc_row)
        np.testing.assert_allclose(np.asarray(swap(out)[:, 0]), np.asarray(full[:, t]),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
    assert int(cache[name]["cache_index"]) == s


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(self_attn_mask_type="padding"), "self_attn_mask_type"),
        (dict(self_attn_mask_type="no_mask"), "self_attn_mask_type"),
        (dict(window_size=(2, 0)), "window_size"),
        (dict(layer_type=DEC, enable_rotary_pos_emb=True), "enable_rotary_pos_emb"),
    ],
)
def test_decode_rejects_what_the_cache_cannot_do(kw, match):
    x = jnp.ones((2, SEQ, HIDDEN))
    enc = x if kw.get("layer_type") is DEC else None
    with pytest.raises(ValueError, match=match):
        _layer(**kw).init(jax.random.key(0), x, enc, deterministic=True, decode=True)


def test_decode_max_length_and_step_errors():
    """``max_decode_length`` must be the cache's length (at init: the input's); a step takes
    one token (MultiHeadAttention's check)."""
    layer = _layer()
    x = jnp.ones((2, SEQ, HIDDEN))
    with pytest.raises(ValueError, match="max_decode_length"):
        layer.init(jax.random.key(0), x, deterministic=True, decode=True,
                   max_decode_length=SEQ + 1)  # fmt: skip
    v = layer.init(jax.random.key(0), x, deterministic=True, decode=True, max_decode_length=SEQ)
    with pytest.raises(ValueError, match="max_decode_length"):
        layer.apply(v, x[:, :1], deterministic=True, decode=True, max_decode_length=2 * SEQ,
                    mutable=["cache"])  # fmt: skip
    with pytest.raises(ValueError, match="one token"):
        layer.apply(v, x, deterministic=True, decode=True, mutable=["cache"])


def _mlp_twin(p, x):
    """The MLP block from flax.linen layers with the LayerNormMLP's params (gelu, TE's default
    since v2.10: the tanh approximation)."""
    ln = nn.LayerNorm(epsilon=1e-6).apply({"params": {"scale": p["scale"], "bias": p["ln_bias"]}},
                                          x)  # fmt: skip
    h = nn.DenseGeneral((1, p["wi_kernel"].shape[-1]), use_bias=False).apply(
        {"params": {"kernel": p["wi_kernel"]}}, ln
    )
    return nn.Dense(x.shape[-1], use_bias=False).apply(
        {"params": {"kernel": p["wo_kernel"]}}, jax.nn.gelu(h[..., 0, :], approximate=True)
    )


# layer arguments -> the attention twin's config (tests/flax/test_flax_mha.py)
VARIANTS = {
    "relbias": {},
    "gqa_rotary": dict(num_gqa_groups=2, enable_rotary_pos_emb=True,
                       enable_relative_embedding=False),
    "alternate_rotary_separate_qkv": dict(enable_rotary_pos_emb=True, fuse_qkv_params=False,
                                          rotary_pos_emb_group_method="alternate"),
}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layer_type", [TransformerLayerType.ENCODER, TransformerLayerType.DECODER])
def test_fp8_off_matches_a_plain_flax_twin(layer_type, variant):
    """The layer with FP8 off against the same layer written with flax.linen layers and
    jax.nn.dot_product_attention (the attention twin of tests/flax/test_flax_mha.py), the same
    params: forward, input and parameter gradients to float32 summation order. Variants: the
    T5 relative bias; GQA with rotary embeddings (consecutive); separate Q/K/V params with
    rotary embeddings (alternate)."""
    from test_flax_mha import HEADS as T_HEADS
    from test_flax_mha import HID
    from test_flax_mha import twin as attention_twin

    from fp8jax.flax import RelativePositionBiases

    decoder = layer_type is TransformerLayerType.DECODER
    kw = VARIANTS[variant]
    layer = TransformerLayer(hidden_size=HID, mlp_hidden_size=24, num_attention_heads=T_HEADS,
                             layer_type=layer_type, **NO_DROPOUT, **kw)  # fmt: skip
    cfg = {k: v for k, v in kw.items() if k != "enable_relative_embedding"}
    x = jax.random.normal(jax.random.key(4), (2, 6, HID))
    enc = jax.random.normal(jax.random.key(5), (2, 7, HID)) if decoder else None
    params = layer.init(jax.random.key(6), x, enc, deterministic=True)["params"]
    c = jax.random.normal(jax.random.key(7), x.shape)

    def ours(p, x):
        return jnp.sum(layer.apply({"params": p}, x, enc, deterministic=True) * c)

    def theirs(p, x):
        bias = None
        if kw.get("enable_relative_embedding", True):
            rel = RelativePositionBiases(num_buckets=32, max_distance=128,
                                         num_attention_heads=T_HEADS)  # fmt: skip
            bias = rel.apply({"params": p["relpos_bias"]}, 6, 6, not decoder)
        name = "self_attention" if decoder else "attention"
        h = x + attention_twin(p[name], x, None, {**cfg, "attn_mask_type": "causal"}, bias=bias)
        if decoder:
            h = h + attention_twin(p["encoder_decoder_attention"], h, enc,
                                   {**cfg, "attn_mask_type": "no_mask"})  # fmt: skip
        return jnp.sum((h + _mlp_twin(p["mlp"], h)) * c)

    np.testing.assert_allclose(float(ours(params, x)), float(theirs(params, x)), rtol=1e-6)
    g = jax.grad(ours, argnums=(0, 1))(params, x)
    tg = jax.grad(theirs, argnums=(0, 1))(params, x)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(tg), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_fp8_on_is_within_fp8_bounds_of_fp8_off():
    """Current scaling against the same layer with FP8 off (itself equal to the plain-Flax
    twin, above): forward within 10%, every gradient within 30% (Frobenius)."""
    layer = _layer()
    x = jax.random.normal(jax.random.key(8), (2, SEQ, HIDDEN))
    params = layer.init(jax.random.key(9), x, deterministic=True)["params"]
    c = jax.random.normal(jax.random.key(10), x.shape)

    def loss(p, x, enabled):
        with fp8jax.autocast(enabled=enabled, recipe=Float8CurrentScaling()):
            return jnp.sum(layer.apply({"params": p}, x, deterministic=True) * c)

    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    with fp8jax.autocast(enabled=True, recipe=Float8CurrentScaling()):
        y8 = layer.apply({"params": params}, x, deterministic=True)
    y = layer.apply({"params": params}, x, deterministic=True)
    assert rel(y8 - x, y - x) < 0.1  # the branch outputs (the residual is exact)
    g8 = jax.grad(loss, argnums=(0, 1))(params, x, True)
    g = jax.grad(loss, argnums=(0, 1))(params, x, False)
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g), strict=True):
        assert rel(a, b) < 0.3
