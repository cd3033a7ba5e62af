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


def test_unimplemented_parallelism_is_refused_by_name():
    with pytest.raises(ValueError, match="pp_resource"):
        MeshResource(pp_resource="x").axis_rules()


def test_cp_resource_splits_the_sequence():
    assert dict(MeshResource(dp_resource="d", cp_resource="c").axis_rules())["length"] == "c"
    with pytest.raises(ValueError, match="cp_resource or tpsp_resource, not both"):
        MeshResource(cp_resource="c", tpsp_resource="t").axis_rules()


def test_ep_resource_points_at_the_moe_layers_expert_axis():
    with pytest.raises(ValueError, match=r"ep_resource='e'.*MoEBlock\(expert_axis=\.\.\.\)"):
        MeshResource(ep_resource="e").axis_rules()


@pytest.mark.parametrize("mlp", ["dense", "moe"])
def test_every_logical_name_the_layers_use_has_a_default_rule(mlp):
    """DEFAULT_RULES names every logical axis a TransformerLayer(logical_axes=True) gives its
    params (NNX's eager sharding maps a name without a rule onto a mesh axis of that name:
    "Resource axis: exp ... is not found in mesh")."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from fp8jax.flax import DEFAULT_RULES, TransformerLayer
    from fp8jax.layers import MoEBlockConfig

    moe = MoEBlockConfig(num_experts=2, num_experts_per_tok=1, intermediate_size=8)
    layer = TransformerLayer(
        hidden_size=8, mlp_hidden_size=16, num_attention_heads=2, logical_axes=True, mlp=mlp,
        moe=moe if mlp == "moe" else None, enable_relative_embedding=True,
    )  # fmt: skip
    boxed = jax.eval_shape(layer.init, jax.random.key(0), jnp.ones((1, 4, 8)))
    specs = jax.tree.leaves(nn.get_partition_spec(boxed), is_leaf=lambda x: isinstance(x, tuple))
    names = {n for spec in specs for n in spec if n is not None}
    assert names and names <= set(dict(DEFAULT_RULES)), names - set(dict(DEFAULT_RULES))
    assert names <= set(dict(MeshResource().axis_rules()))


def test_bad_values():
    with pytest.raises(TypeError, match="dp_resource must be a mesh axis name"):
        MeshResource(dp_resource=0)
    with pytest.raises(ValueError, match="not both"):
        MeshResource(tp_resource="a", tpsp_resource="b").axis_rules()
