"""fp8jax.te.jax.sharding: fp8jax's MeshResource and TE's global_shard_guard."""

from __future__ import annotations

import pytest

import fp8jax.sharding
from fp8jax.te.jax.sharding import MeshResource, global_mesh_resource, global_shard_guard


def test_guard_sets_and_restores():
    assert MeshResource is fp8jax.sharding.MeshResource
    assert global_mesh_resource() == MeshResource()
    outer = MeshResource(dp_resource="data")
    # MaxText's resource names context and pipeline axes too: recorded, not refused
    maxtext = MeshResource(
        dp_resource="data", tp_resource="tensor", fsdp_resource="fsdp", cp_resource="context"
    )
    with global_shard_guard(outer):
        with global_shard_guard(maxtext):
            assert global_mesh_resource() is maxtext
        assert global_mesh_resource() is outer
    assert global_mesh_resource() == MeshResource()


def test_guard_checks_its_argument():
    with pytest.raises(TypeError, match="resource must be a MeshResource"):
        with global_shard_guard({"dp_resource": "data"}):
            pass
