"""fp8jax.te.jax.cpp_extensions: TE's collective-op types; the no-op set works, overlap
requests are refused when used."""

from __future__ import annotations

import pytest

from fp8jax.te.jax.cpp_extensions import (
    CollectiveOp,
    CollectiveOpSet,
    check_no_collective,
    collective_gemm_bootstrap,
    noop_collective_op_set,
)


def test_sets_as_te_builds_them():
    ag = CollectiveOpSet.create(CollectiveOp.ALL_GATHER)
    rs = CollectiveOpSet.create(CollectiveOp.REDUCE_SCATTER)
    assert (ag.forward, ag.backward) == (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER)
    assert (rs.forward, rs.backward) == (CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_GATHER)
    assert noop_collective_op_set == CollectiveOpSet.create(CollectiveOp.NONE)
    assert noop_collective_op_set.is_noop and not ag.is_noop
    assert ag.forward.is_all_gather and rs.forward.is_reduce_scatter


def test_refusals():
    check_no_collective(noop_collective_op_set, "ops")
    with pytest.raises(NotImplementedError, match=r"ops=.*collective GEMM .*reduce_scatter"):
        check_no_collective(CollectiveOpSet.create(CollectiveOp.REDUCE_SCATTER), "ops")
    with pytest.raises(TypeError, match="ops must be a CollectiveOpSet"):
        check_no_collective(None, "ops")
    with pytest.raises(TypeError, match="forward_collective_op must be a CollectiveOp"):
        CollectiveOpSet.create("all_gather")
    with pytest.raises(NotImplementedError, match="collective_gemm_bootstrap"):
        collective_gemm_bootstrap(8, 8, 0, 1)
