"""fp8jax.te.jax.attention: SequenceDescriptor for padded batches, fed to fp8jax's attention
as segment ids (the same output as the mask it stands for)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import rand

import fp8jax
from fp8jax.te.jax.attention import AttnMaskType, SequenceDescriptor
from fp8jax.te.jax.flax.transformer import DotProductAttention


def test_from_seqlens_and_segment_ids_agree():
    lens = jnp.array([3, 5])
    by_len = SequenceDescriptor.from_seqlens(lens).segment_ids_pair(max_len=6)
    ids = by_len[0]
    by_ids = SequenceDescriptor.from_segment_ids_and_pos(ids).segment_ids_pair(max_len=6)
    np.testing.assert_array_equal(by_len[0], by_ids[0])
    assert ids.sum(axis=1).tolist() == [3, 5]
    q, kv = SequenceDescriptor.from_seqlens((lens, lens + 1)).segment_ids_pair((6, 7))
    assert q.shape == (2, 6) and kv.shape == (2, 7) and kv.sum(axis=1).tolist() == [4, 6]


def test_drives_fp8jax_attention():
    b, s, h, d = 2, 8, 2, 16
    q, k, v = (rand((b, s, h, d), i) for i in range(3))
    desc = SequenceDescriptor.from_seqlens(jnp.array([5, 8]))
    attn = DotProductAttention(head_dim=d, num_attention_heads=h, num_gqa_groups=h,
                               attn_mask_type=AttnMaskType.PADDING_MASK.value)  # fmt: skip
    out = attn.apply({}, q, k, v, segment_ids=desc.segment_ids_pair(s), deterministic=True)
    # the first sequence's valid rows see only its first 5 keys
    short = attn.apply({}, q[:1, :5], k[:1, :5], v[:1, :5], deterministic=True)
    np.testing.assert_allclose(out[0, :5], short[0], rtol=1e-5, atol=1e-5)


def test_refusals():
    with pytest.raises(NotImplementedError, match="packed \\(THD\\)"):
        SequenceDescriptor.from_segment_ids_and_pos(jnp.ones((2, 4)), is_thd=True)
    with pytest.raises(ValueError, match="segment_ids must be \\(q, kv\\)"):
        SequenceDescriptor.from_segment_ids_and_pos((jnp.ones((2, 4)),) * 3)
    with pytest.raises(ValueError, match="neither seqlens nor segment_ids"):
        SequenceDescriptor().segment_ids_pair(4)


# ------------------------------------------- MaxText's attention=cudnn_flash_te (its arguments)


def _mesh():
    """MaxText's mesh on one CPU device: its context axis exists, of size 1."""
    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "context"))


def _maxtext_dpa(**overrides):
    """DotProductAttention as MaxText's ``cudnn_flash_attention`` builds it (GQA 4/2 heads)."""
    kwargs = dict(
        head_dim=16, num_attention_heads=4, num_gqa_groups=2, attn_mask_type="padding_causal",
        attn_bias_type="no_bias", attention_dropout=0.0, dropout_rng_name="aqt",
        dtype=jnp.float32, float32_logits=False, qkv_layout="BSHD_BSHD_BSHD", scale_factor=1.0,
        transpose_batch_sequence=False, window_size=None,
        context_parallel_causal_load_balanced=True, context_parallel_axis="context",
        context_parallel_strategy="all_gather", max_segments_per_seq=1, softmax_type="vanilla",
    )  # fmt: skip
    return DotProductAttention(**{**kwargs, **overrides})


def _plain(**kwargs):
    """fp8jax's own attention, no context axis: the reference."""
    defaults = dict(head_dim=16, num_attention_heads=4, num_gqa_groups=2, scale_factor=1.0)
    return fp8jax.flax.DotProductAttention(**{**defaults, **kwargs})


def _qkv(b=2, s=8):
    return rand((b, s, 4, 16), 0), rand((b, s, 2, 16), 1), rand((b, s, 2, 16), 2)


_IDS = jnp.array([[1] * 8, [1] * 5 + [0] * 3], jnp.int32)


def _maxtext_mask(ids):
    """MaxText's dense mask for cudnn_flash_te: [b, 1, 1, s, s] uint8, 1 = masked out, from
    the segment ids only (its FULL attention type: causality comes from attn_mask_type)."""
    allowed = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] != 0)
    return jnp.where(allowed, 0, 1).astype(jnp.uint8)[:, None, None]


def test_maxtext_dense_five_dim_mask_on_a_context_axis_of_size_1():
    q, k, v = _qkv()
    with jax.set_mesh(_mesh()):
        out = _maxtext_dpa().apply({}, q, k, v, sequence_descriptor=_maxtext_mask(_IDS))
    want = _plain(attn_mask_type="padding_causal").apply({}, q, k, v, segment_ids=_IDS)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    # the 4-D mask it holds gives the same
    mask4 = _maxtext_mask(_IDS)[:, 0]
    with jax.set_mesh(_mesh()):
        out4 = _maxtext_dpa().apply({}, q, k, v, sequence_descriptor=mask4)
    np.testing.assert_array_equal(out4, out)


def test_maxtext_sliding_window_list():
    """MaxText passes window_size=[w - 1, 0] (a list) for its local sliding attention."""
    q, k, v = _qkv()
    mask = _maxtext_mask(jnp.ones((2, 8), jnp.int32))
    with jax.set_mesh(_mesh()):
        out = _maxtext_dpa(window_size=[2, 0]).apply({}, q, k, v, sequence_descriptor=mask)
    want = _plain(attn_mask_type="causal", window_size=(2, 0)).apply({}, q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


def test_maxtext_context_parallel_causal_without_mask():
    """With a context axis larger than 1 MaxText passes no mask and attn_mask_type="causal";
    on an axis of size 1 that is the plain causal attention."""
    q, k, v = _qkv()
    with jax.set_mesh(_mesh()):
        out = _maxtext_dpa(attn_mask_type="causal").apply({}, q, k, v, sequence_descriptor=None)
    want = _plain(attn_mask_type="causal").apply({}, q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("how", ["seqlens", "segment_ids"])
def test_sequence_descriptor_object(how):
    q, k, v = _qkv()
    if how == "seqlens":
        desc = SequenceDescriptor.from_seqlens(_IDS.sum(axis=1))
    else:
        desc = SequenceDescriptor.from_segment_ids_and_pos(
            _IDS, jnp.broadcast_to(jnp.arange(8), (2, 8))
        )
    with jax.set_mesh(_mesh()):
        out = _maxtext_dpa().apply({}, q, k, v, sequence_descriptor=desc)
        by_mask_alias = _maxtext_dpa().apply({}, q, k, v, mask=desc)
        causal = _maxtext_dpa(attn_mask_type="causal").apply({}, q, k, v, sequence_descriptor=desc)
    want = _plain(attn_mask_type="padding_causal").apply({}, q, k, v, segment_ids=_IDS)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(by_mask_alias, out)
    # ignored by a mask type without padding, as TE ignores it
    np.testing.assert_allclose(causal, _plain(attn_mask_type="causal").apply({}, q, k, v),
                               rtol=1e-6, atol=1e-6)  # fmt: skip


def test_sequence_descriptor_transposed_and_packed_layouts():
    q, k, v = _qkv()
    desc = SequenceDescriptor.from_seqlens(_IDS.sum(axis=1))
    want = _plain(attn_mask_type="padding").apply({}, q, k, v, segment_ids=_IDS)
    tq, tk, tv = (jnp.swapaxes(t, 0, 1) for t in (q, k, v))
    out = _maxtext_dpa(attn_mask_type="padding", transpose_batch_sequence=True,
                       context_parallel_axis="").apply({}, tq, tk, tv, desc)  # fmt: skip
    np.testing.assert_allclose(jnp.swapaxes(out, 0, 1), want, rtol=1e-6, atol=1e-6)
    qkv = jnp.stack([q, q, q], axis=2)  # bs3hd: one length for q and kv
    packed = _maxtext_dpa(attn_mask_type="padding", qkv_layout="BS3HD", num_gqa_groups=4,
                          context_parallel_axis="").apply({}, qkv, None, None, desc)  # fmt: skip
    ref = _plain(attn_mask_type="padding", num_gqa_groups=4)
    np.testing.assert_allclose(packed, ref.apply({}, q, q, q, segment_ids=_IDS), rtol=1e-6,
                               atol=1e-6)  # fmt: skip


def test_maxtext_argument_refusals():
    q, k, v = _qkv()
    desc = SequenceDescriptor.from_seqlens(_IDS.sum(axis=1))
    dpa = _maxtext_dpa(context_parallel_axis="")
    with pytest.raises(ValueError, match="segment_ids or a SequenceDescriptor, not both"):
        dpa.apply({}, q, k, v, desc, segment_ids=_IDS)
    with pytest.raises(ValueError, match="sequence_descriptor or mask, not both"):
        dpa.apply({}, q, k, v, desc, mask=desc)
    with pytest.raises(ValueError, match=r"5-D sequence_descriptor .*MaxText's layout"):
        dpa.apply({}, q, k, v, jnp.zeros((2, 2, 2, 8, 8), jnp.uint8))
    with pytest.raises(ValueError, match="max_segments_per_seq"):
        _maxtext_dpa(max_segments_per_seq=2, context_parallel_axis="").apply({}, q, k, v, desc)
    with pytest.raises(ValueError, match="context_parallel_strategy"):
        _maxtext_dpa(context_parallel_strategy="ulysses").apply({}, q, k, v, desc)
    with pytest.raises(ValueError, match="context_parallel_axis='context' must name an axis"):
        _maxtext_dpa().apply({}, q, k, v, desc)  # no mesh set


def test_fp8_dpa_state_through_the_te_class():
    """The TE class's call wraps fp8jax's: fp8_dpa still declares its FP8 state."""
    q, k, v = _qkv(s=16)
    with fp8jax.autocast(enabled=True, recipe=fp8jax.DelayedScaling()):
        variables = _maxtext_dpa(attn_mask_type="causal", context_parallel_axis="",
                                 fp8_dpa=True).init(jax.random.key(0), q, k, v)  # fmt: skip
    assert variables["fp8_meta"]["scale"].shape == (15,)


def test_context_parallel_names_at_te_paths():
    """MaxText's GPU input pipeline: reorder_causal_load_balancing(x, DualChunkSwap, cp_size=,
    seq_dim=1) from transformer_engine.jax.attention."""
    from fp8jax.te.jax import attention

    x = jnp.arange(16).reshape(2, 8)
    y = attention.reorder_causal_load_balancing(
        x, attention.ReorderStrategy.DualChunkSwap, cp_size=2, seq_dim=1
    )
    assert y[0].tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    back = attention.inverse_reorder_causal_load_balancing(
        y, attention.ReorderStrategy.DualChunkSwap, 2, 1
    )
    np.testing.assert_array_equal(back, x)
    assert attention.CPStrategy.RING is fp8jax.CPStrategy.RING
    assert attention.ReorderStrategy.Striped is fp8jax.ReorderStrategy.Striped
