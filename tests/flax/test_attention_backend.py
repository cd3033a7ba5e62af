"""The attention core's default implementation (fp8jax/layers/attention_backend.py): cuDNN's fused
attention where JAX can lower it, XLA's path elsewhere, decided while tracing. On this host JAX
has no GPU, so the GPU side is faked: the backend query, and for the cuDNN checks a stand-in of
jax.nn.dot_product_attention that accepts or rejects ``implementation="cudnn"`` as JAX's own
checks would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import normal

from fp8jax.layers import attention_backend as ab
from fp8jax.layers.attention_core import attention_core

BF16 = jnp.bfloat16


def _qkv(dtype=BF16, head_dim=64):
    q = jnp.ones((2, 16, 4, head_dim), dtype)
    return q, q, q


def test_on_cpu_the_default_is_xla():
    assert not ab.cuda_default_backend()
    assert ab.choose_attention(None, *_qkv(), None, None, is_causal=True) == "xla"


def test_an_explicit_choice_is_kept():
    for impl in ("xla", "cudnn"):
        assert ab.choose_attention(impl, *_qkv(jnp.float32), None, None) == impl


@pytest.fixture
def fake_gpu(monkeypatch):
    """JAX's default backend is a GPU, and jax.nn.dot_product_attention with
    ``implementation="cudnn"`` raises JAX's NotImplementedError for a head dim above 128 (as
    JAX's check does before Hopper), else traces."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    real = jax.nn.dot_product_attention
    calls = []

    def fake(q, k, v, bias=None, mask=None, *, implementation=None, **kw):
        calls.append(implementation)
        if implementation == "cudnn" and q.shape[-1] > 128:
            raise NotImplementedError("The head dim must be <= 128 and a multiple of 8")
        return real(q, k, v, bias, mask, implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    return calls


def test_on_a_gpu_cudnn_where_jax_accepts_it(fake_gpu):
    assert ab.cuda_default_backend()
    assert ab.choose_attention(None, *_qkv(), None, None, is_causal=True) == "cudnn"
    assert "cudnn" in fake_gpu  # JAX's checks were asked, on abstract values
    # JAX's checks refuse: XLA's path is the fallback
    assert ab.choose_attention(None, *_qkv(head_dim=256), None, None) == "xla"
    # float32: cuDNN's flash attention has no float32 (decided before asking JAX)
    fake_gpu.clear()
    assert ab.choose_attention(None, *_qkv(jnp.float32), None, None) == "xla"
    assert fake_gpu == []


def test_attention_core_passes_the_choice_on(fake_gpu):
    """The core (what DotProductAttention, MultiHeadAttention and the NNX modules call) runs the
    chosen implementation: cuDNN for bf16 heads of 64, XLA for heads of 256; the dropout path
    never calls jax.nn.dot_product_attention."""
    kw = dict(num_attention_heads=4, attn_mask_type="causal")
    q, k, v = _qkv()
    out = attention_core(q, k, v, head_dim=64, **kw)
    assert fake_gpu[-1] == "cudnn" and out.shape == q.shape
    q, k, v = _qkv(head_dim=256)
    attention_core(q, k, v, head_dim=256, **kw)
    assert fake_gpu[-1] == "xla"
    fake_gpu.clear()
    attention_core(q, k, v, head_dim=256, implementation="xla", **kw)
    assert fake_gpu == ["xla"]  # an explicit choice: JAX's checks are not even asked


def test_the_default_is_the_same_numbers_as_xla_on_cpu():
    rng = np.random.default_rng(0)
    q, k, v = (normal(rng, (2, 16, 4, 32), BF16) for _ in range(3))
    kw = dict(head_dim=32, num_attention_heads=4, attn_mask_type="causal")
    np.testing.assert_array_equal(
        np.asarray(attention_core(q, k, v, **kw)),
        np.asarray(attention_core(q, k, v, implementation="xla", **kw)),
    )
