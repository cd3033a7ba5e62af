"""TE's context_parallel_* arguments on the attention modules (fp8jax.layers.context_parallel):
Linen's and NNX's DotProductAttention split over a context axis of 8 emulated devices equal
the unsplit module (float32 rounding); an axis of size 1 is the plain path, bit for bit; what
the split cannot take is refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_devices
from flax import nnx

import fp8jax
from fp8jax import DelayedScaling
from fp8jax.flax import DotProductAttention

pytestmark = needs_devices(8)

B, S, H, G, D = 2, 32, 4, 2, 8
CORE = dict(head_dim=D, num_attention_heads=H, num_gqa_groups=G, window_size=(6, 0))


def _qkv():
    ks = jax.random.split(jax.random.key(3), 3)
    return jax.random.normal(ks[0], (B, S, H, D)), *(
        jax.random.normal(k, (B, S, G, D)) for k in ks[1:]
    )


def _mesh(n: int = 4):
    return jax.make_mesh((8 // n, n), ("data", "cp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _apply(module, *args, **kw):
    return module.apply({}, *args, deterministic=True, **kw)


def test_linen_ring_with_padding_and_balancing_equals_the_unsplit_module():
    q, k, v = _qkv()
    seg = jnp.asarray(np.repeat([[1] * 24 + [0] * 8], B, 0), jnp.int32)
    plain = _apply(DotProductAttention(**CORE, attn_mask_type="padding_causal"), q, k, v,
                   segment_ids=seg)  # fmt: skip
    lb = fp8jax.ReorderStrategy.DualChunkSwap
    reorder = lambda t: fp8jax.reorder_causal_load_balancing(t, lb, 4, 1)
    module = DotProductAttention(
        **CORE, attn_mask_type="padding_causal", context_parallel_axis="cp",
        context_parallel_strategy="RING", context_parallel_causal_load_balanced=True,
    )  # fmt: skip
    with jax.set_mesh(_mesh()):
        out = jax.jit(lambda *a: _apply(module, *a[:3], segment_ids=a[3]))(
            *map(reorder, (q, k, v, seg))
        )
    out = fp8jax.inverse_reorder_causal_load_balancing(out, lb, 4, 1)
    np.testing.assert_allclose(out, plain, atol=1e-6)


def test_nnx_all_gather_equals_the_unsplit_module():
    q, k, v = _qkv()
    plain = nnx.jit(lambda m, *a: m(*a))(fp8jax.nnx.DotProductAttention(**CORE), q, k, v)
    module = fp8jax.nnx.DotProductAttention(
        **CORE, context_parallel_axis="cp", context_parallel_strategy=fp8jax.CPStrategy.DEFAULT
    )
    with jax.set_mesh(_mesh()):
        out = nnx.jit(lambda m, *a: m(*a))(module, q, k, v)
    np.testing.assert_allclose(out, plain, atol=1e-6)


def test_an_axis_of_size_one_is_the_plain_path():
    q, k, v = _qkv()
    plain = _apply(DotProductAttention(**CORE), q, k, v)
    mesh = jax.make_mesh((8, 1), ("data", "cp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        out = _apply(DotProductAttention(**CORE, context_parallel_axis="cp"), q, k, v)
    np.testing.assert_array_equal(out, plain)


@pytest.mark.parametrize(
    "kwargs, call, match",
    [
        (dict(attn_bias_type="post_scale_bias"), "bias", "does not support bias"),
        (dict(attention_dropout=0.1), "dropout", "does not support attention_dropout"),
        (dict(attn_mask_type="padding"), "mask", "does not support sequence_descriptor"),
        (dict(fp8_dpa=True), "fp8", "does not support fp8_dpa"),
        (dict(context_parallel_axis="seq"), "", "context_parallel_axis='seq' must name an axis"),
        (dict(context_parallel_strategy="p2p"), "", "context_parallel_strategy must be one of"),
    ],
)  # fmt: skip
def test_refusals_name_the_argument(kwargs, call, match):
    q, k, v = _qkv()
    module = DotProductAttention(**{**CORE, "context_parallel_axis": "cp", **kwargs})
    args, kw = [q, k, v], dict(deterministic=call != "dropout")
    if call == "bias":
        args += [None, jnp.zeros((1, H, S, S))]
    if call == "mask":
        kw["mask"] = jnp.zeros((B, 1, S, S), bool)
    recipe = DelayedScaling(amax_history_len=4)
    with jax.set_mesh(_mesh()), fp8jax.autocast(enabled=call == "fp8", recipe=recipe):
        with pytest.raises(ValueError, match=match):
            module.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, *args, **kw)


def test_load_balanced_must_be_a_bool():
    q, k, v = _qkv()
    module = DotProductAttention(**CORE, context_parallel_causal_load_balanced="yes")
    with pytest.raises(TypeError, match="context_parallel_causal_load_balanced must be a bool"):
        _apply(module, q, k, v)
