"""fp8jax.sharding.MeshResource: TE's fields, validated, and the equivalent axis rules."""

from __future__ import annotations

import dataclasses

import pytest

import fp8jax
from fp8jax.sharding import MeshResource


def test_fields_are_te_v2_fields_in_order_all_none():
    names = [f.name for f in dataclasses.fields(MeshResource)]
    assert names == [
        "dp_resource", "tp_resource", "tpsp_resource", "fsdp_resource", "pp_resource",
        "cp_resource", "ep_resource",
    ]  # fmt: skip
    assert MeshResource().is_empty() and fp8jax.MeshResource is MeshResource
    assert not MeshResource("data").is_empty()


def test_axis_rules_cover_default_rules_names():
    from fp8jax.flax import DEFAULT_RULES

    rules = dict(MeshResource(dp_resource="data", tp_resource="model").axis_rules())
    assert rules == dict(DEFAULT_RULES)  # the default rules are DP x TP on ("data", "model")
    fsdp_sp = dict(MeshResource(dp_resource="d", fsdp_resource="f", tpsp_resource="m").axis_rules())
    assert fsdp_sp["batch"] == ("d", "f") and fsdp_sp["embed"] == "f"
    assert fsdp_sp["length"] == fsdp_sp["mlp"] == fsdp_sp["heads"] == "m"
    assert dict(MeshResource().axis_rules())["batch"] is None


@pytest.mark.parametrize("field", ["pp_resource", "cp_resource", "ep_resource"])
def test_unimplemented_parallelism_is_refused_by_name(field):
    with pytest.raises(ValueError, match=field):
        MeshResource(**{field: "x"}).axis_rules()


def test_bad_values():
    with pytest.raises(TypeError, match="dp_resource must be a mesh axis name"):
        MeshResource(dp_resource=0)
    with pytest.raises(ValueError, match="not both"):
        MeshResource(tp_resource="a", tpsp_resource="b").axis_rules()
