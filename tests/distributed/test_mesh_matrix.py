"""Every layer, under every recipe, on both kinds of mesh (issue 46): a pairwise design over the
layer (DenseGeneral, a 3-D fused-QKV DenseGeneral, LayerNormDenseGeneral, LayerNormMLP,
MultiHeadAttention, TransformerLayer dense and MoE, MoEBlock), the recipe (off, delayed,
current, block, MXFP8), the parallelism (DP, TP, FSDP, EP), the mesh (``jax.sharding.Mesh``,
``jax.make_mesh``'s explicit axes), jitted or eager, and the API (Linen, NNX): every pair of
values meets in at least one case (``_matrix.pairwise``); Float8RowwiseScaling (and its
high-precision wgrad) in three focused cases (``_matrix.ROWWISE_CASES``) over every dimension's
values. Each case trains 2 SGD steps on the
mesh and on one device; the two agree (``_matrix.assert_same_training``)."""

from __future__ import annotations

import itertools

import pytest
from _matrix import (
    DIMENSIONS,
    ROWWISE_CASES,
    allowed,
    assert_same_training,
    case_id,
    mesh_of,
    pairwise,
    run,
)
from conftest import needs_devices

pytestmark = needs_devices(4)

CASES = pairwise()


def test_the_design_covers_every_pair():
    for a, b in itertools.combinations(DIMENSIONS, 2):
        for va, vb in itertools.product(DIMENSIONS[a], DIMENSIONS[b]):
            if allowed({a: va, b: vb}):
                assert any(c[a] == va and c[b] == vb for c in CASES), (a, va, b, vb)
    assert all(allowed(c) for c in CASES)
    assert len(CASES) <= 50, len(CASES)


@pytest.mark.parametrize("case", CASES + list(ROWWISE_CASES), ids=case_id)
def test_mesh_equals_one_device(case):
    want = run(case)
    got = run(case, mesh_of(case), starts=[step.start for step in want])
    assert_same_training(got, want, case["recipe"])
