"""fp8jax.te.jax.attention: SequenceDescriptor for padded batches, fed to fp8jax's attention
as segment ids (the same output as the mask it stands for)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _shared import rand

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
