"""Context-parallel attention (fp8jax.functional.context_parallel) on 8 emulated devices
against jax.nn.dot_product_attention on the whole sequence: both strategies, causal with and
without load balancing, a sliding window, padding by segment ids, grouped-query attention;
outputs and gradients within float32 rounding (the blocks are summed in another order). Also
the ring's HLO (collective-permutes, no all-gather of keys/values) and its per-device
temporaries falling with the context size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp8jax.functional.context_parallel import (
    CPStrategy,
    canonical_strategy,
    context_parallel_attention,
)
from fp8jax.functional.load_balancing import (
    ReorderStrategy,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)

pytestmark = needs_devices(8)

B, S, H, G, D = 2, 32, 4, 2, 8
TOL = 2e-6  # float32 rounding of a softmax summed block by block


def _inputs():
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, S, H, D))
    k, v = (jax.random.normal(kk, (B, S, G, D)) for kk in ks[1:])
    # two segments and padding (id 0) at the end of every sequence
    seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 8 + [0] * 4], B, 0), jnp.int32)
    return q, k, v, seg


def _reference(q, k, v, seg, causal, window):
    mask = None
    if seg is not None:
        mask = ((seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0))[:, None]
    k, v = (jnp.repeat(t, H // G, axis=2) for t in (k, v))
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                        local_window_size=window, implementation="xla")  # fmt: skip


@pytest.mark.parametrize("strategy", ["RING", "ALL_GATHER"])
@pytest.mark.parametrize("masks", ["causal", "balanced_window_padding"])
def test_matches_one_device_forward_and_backward(strategy, masks):
    q, k, v, seg = _inputs()
    balanced = masks != "causal"
    window, ids = ((5, 0), seg) if balanced else (None, None)
    # automatic axes, and jax.make_mesh's explicit ones
    kind = jax.sharding.AxisType.Explicit if balanced else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((2, 4), ("data", "cp"), axis_types=(kind,) * 2)
    lb = ReorderStrategy.DualChunkSwap

    def cp(q, k, v):
        if balanced:
            q, k, v = (reorder_causal_load_balancing(t, lb, 4, 1) for t in (q, k, v))
        s = None if ids is None else reorder_causal_load_balancing(ids, lb, 4, 1)
        out = context_parallel_attention(
            q, k, v, axis="cp", strategy=strategy, load_balanced=balanced, is_causal=True,
            window=window, segment_ids=None if s is None else (s, s),
        )  # fmt: skip
        return inverse_reorder_causal_load_balancing(out, lb, 4, 1) if balanced else out

    def loss(f):
        return lambda *a: jnp.sum(jnp.sin(f(*a)))

    with jax.set_mesh(mesh):
        out, grads = jax.jit(jax.value_and_grad(loss(cp), argnums=(0, 1, 2)))(q, k, v)

    def ref(q, k, v):
        return _reference(q, k, v, ids, True, window)

    want, want_grads = jax.value_and_grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=TOL * 4, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_bfloat16_gradients_compile_and_match_one_device(strategy):
    """In bfloat16: the all-gather's backward once was a bfloat16 reduce-scatter, which aborted
    XLA:CPU's compiler (AllReducePromotion); the key/value gradients are now summed over the
    axis in float32. Gradients within bfloat16 rounding of one device's."""
    q, k, v, _ = (t.astype(jnp.bfloat16) if t is not None else t for t in _inputs())
    mesh = jax.make_mesh((2,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])  # fmt: skip

    def loss(f):
        return lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)

    def cp(q, k, v):
        return context_parallel_attention(q, k, v, axis="cp", strategy=strategy, is_causal=True)

    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(loss(cp), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(lambda *a: _reference(*a, None, True, None)), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, want, strict=True):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=5e-2, atol=5e-2)  # fmt: skip


def _compiled(n: int, strategy: str, seq: int = 256):
    mesh = jax.make_mesh((n,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n])  # fmt: skip
    q = jax.ShapeDtypeStruct((1, seq, 2, 16), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "cp")))  # fmt: skip

    def step(q, k, v):
        out = context_parallel_attention(q, k, v, axis="cp", strategy=strategy, is_causal=True)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    with jax.set_mesh(mesh):
        return jax.jit(jax.grad(step, argnums=(0, 1, 2))).lower(q, q, q).compile()


def test_ring_hlo_permutes_and_gathers_no_keys_or_values():
    hlo = _compiled(4, "ring").as_text()
    assert "collective-permute" in hlo
    assert "all-gather" not in hlo
    assert "collective-permute" not in _compiled(4, "all_gather").as_text()


def test_ring_temporaries_fall_with_the_context_size():
    temp = {n: _compiled(n, "ring").memory_analysis().temp_size_in_bytes for n in (1, 2, 8)}
    # the [S / n, S / n] blocks: each doubling of n at least halves the per-device temporaries
    # (n = 1 is the plain path with its [S, S] logits and probabilities)
    assert temp[2] * 2 <= temp[1] * 1.1, temp
    assert temp[8] * 4 <= temp[2] * 1.1, temp


def test_strategy_spellings_are_tes():
    for spelling in ("DEFAULT", "all_gather", "ALLGATHER", CPStrategy.ALL_GATHER):
        assert canonical_strategy(spelling) == "all_gather"
    assert canonical_strategy("ring") == canonical_strategy(CPStrategy.RING) == "ring"
    with pytest.raises(ValueError, match="context_parallel_strategy must be one of"):
        canonical_strategy("p2p")
    with pytest.raises(TypeError, match="context_parallel_strategy must be a str"):
        canonical_strategy(2)


def test_errors_name_the_argument():
    q = jnp.zeros((1, 12, 2, 4))
    with pytest.raises(ValueError, match="axis='cp' must name an axis of the current mesh"):
        context_parallel_attention(q, q, q, axis="cp")
    mesh = jax.make_mesh((4,), ("cp",), devices=jax.devices()[:4])
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="multiple of 2 \\* the 'cp'"):
        context_parallel_attention(q, q, q, axis="cp", load_balanced=True)
    with pytest.raises(ValueError, match="self-attention shapes"):
        context_parallel_attention(q, q[:, :8], q[:, :8], axis="cp")
