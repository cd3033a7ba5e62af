"""``fp8jax.nnx`` models trained in FP8 on 8 emulated devices (DP x TP), against the same steps
on one device.

Two models, each built inside ``autocast`` (which creates its FP8 state) and trained three
``DelayedScaling`` steps by the NNX train step (``nnx.jit``, ``nnx.value_and_grad`` with
``fp8jax.nnx.diff_state()``, ``fp8jax.nnx.apply_gradients``):

- ``mlp``: two ``fp8jax.nnx.DenseGeneral`` (``embed -> mlp``: column parallel, gelu, ``mlp ->
  embed``: row parallel) with logical axis names, on a ``(4, 2)`` ``("data", "model")`` mesh;
- ``transformer``: a ``fp8jax.nnx.TransformerLayer(logical_axes=True)`` (heads and the FFN width
  over ``model``), on a ``(2, 4)`` mesh.

The params are placed by ``nnx.get_partition_spec`` of the model's state under
``nn.logical_axis_rules(DEFAULT_RULES)`` (the Linen axis names are the ``nnx.Param``s'
``out_sharding``; the FP8 state has none: replicated), the batch split over ``data``, the step
traced under ``DEFAULT_RULES``.
Losses and params agree with one device within float32 reduction order, the FP8 state
(``nnx.state(model, Fp8MetaVariable)``) within ``1e-6`` and is the same on every device, as in
the Linen tests (test_parallel_train.py, test_transformer_parallel.py); the column-parallel
kernels are split over ``model`` before and after training, so the comparison is not of two
replicated runs.
"""

from __future__ import annotations

from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _parallel import N_DEVICES, assert_like_reference
from _shared import make_mesh, rand
from conftest import needs_devices
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax import DelayedScaling
from fp8jax.flax import DEFAULT_RULES

pytestmark = needs_devices(N_DEVICES)

RECIPE = DelayedScaling(amax_history_len=4)
BATCH, LENGTH, EMBED, MLP, HEADS = 8, 8, 32, 64, 8
# The init seed. With nnx.Rngs(0) the one-device TransformerLayer run of JAX 0.12 sits on an FP8
# rounding tie in its second step: params 1e-9 apart (as the sharded run's are, by summation
# order) round an element to the neighbouring FP8 code, and losses then differ by ~1e-4, the
# amax histories by ~1e-2. With seed 1 three steps stay put under a 1e-7 relative perturbation
# of the initial params on both JAX versions tested (0.10, 0.12).
SEED = 1


class Mlp(nnx.Module):
    """embed -> mlp (column parallel) -> gelu -> embed (row parallel), named by logical axes
    (params and outputs)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.wi = fp8jax.nnx.DenseGeneral(
            EMBED, MLP, kernel_axes=("embed", "mlp"), bias_axes=("mlp",),
            output_axes=("batch", "length", "mlp"), rngs=rngs,
        )  # fmt: skip
        self.wo = fp8jax.nnx.DenseGeneral(
            MLP, EMBED, kernel_axes=("mlp", "embed"), bias_axes=("embed",),
            output_axes=("batch", "length", "embed"), rngs=rngs,
        )  # fmt: skip

    def __call__(self, x, deterministic=True):
        return self.wo(nn.gelu(self.wi(x)))


def _transformer(rngs):
    return fp8jax.nnx.TransformerLayer(
        EMBED, mlp_hidden_size=MLP, num_attention_heads=HEADS, hidden_dropout=0.0,
        attention_dropout=0.0, intermediate_dropout=0.0, mlp_activations=("gelu",),
        use_bias=True, self_attn_mask_type="causal", logical_axes=True, rngs=rngs,
    )  # fmt: skip


# case: (constructor, mesh shape (data, model), column-parallel kernels: path in the Param state)
CASES = {
    "mlp": (lambda rngs: Mlp(rngs=rngs), (4, 2), [("wi", "kernel")]),
    "transformer": (_transformer, (2, 4),
                    [("attention", "qkv", "kernel"), ("mlp", "wi_kernel")]),
}  # fmt: skip


def _batches():
    return [(rand((BATCH, LENGTH, EMBED), 10 + i, s), rand((BATCH, LENGTH, EMBED), 20 + i))
            for i, s in enumerate((1.0, 3.0, 0.5))]  # fmt: skip


def _build(case):
    """The model (on the default device: no mesh, so the axis names are metadata only) and its
    SGD optimizer."""
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        model = CASES[case][0](nnx.Rngs(SEED))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def _train(model, optimizer, batches):
    """One NNX train step per batch (a fresh ``nnx.jit``: traced under the caller's mesh and
    rules); the losses."""

    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            return jnp.mean((model(x, deterministic=True) - y) ** 2)

        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            loss, grads = nnx.value_and_grad(loss_fn, argnums=fp8jax.nnx.diff_state())(model)
        fp8jax.nnx.apply_gradients(model, optimizer, grads)
        return loss

    return [float(train_step(model, optimizer, x, y)) for x, y in batches]


def _result(model, losses):
    """``(state, losses)`` in the form ``assert_like_reference`` reads."""
    state = SimpleNamespace(
        params=nnx.to_pure_dict(nnx.state(model, nnx.Param)),
        fp8_meta=nnx.to_pure_dict(nnx.state(model, fp8jax.nnx.Fp8MetaVariable)),
    )
    return state, losses


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_device(case):
    _, shape, column_parallel = CASES[case]
    batches = _batches()
    model, optimizer = _build(case)
    reference = _result(model, _train(model, optimizer, batches))
    scales = [v for k, v in jax.tree_util.tree_leaves_with_path(reference[0].fp8_meta)
              if "scale" in jax.tree_util.keystr(k)]  # fmt: skip
    assert scales and all(np.all(np.asarray(v) != 1.0) for v in scales)  # delayed scaling ran

    m = make_mesh(shape)
    model, optimizer = _build(case)
    with nn.logical_axis_rules(DEFAULT_RULES):
        specs = nnx.get_partition_spec(nnx.state(model))
    shardings = jax.tree.map(lambda spec: NamedSharding(m, spec), specs)
    nnx.update(model, jax.device_put(nnx.state(model), shardings))
    replicated = NamedSharding(m, P())
    nnx.update(optimizer, jax.device_put(nnx.state(optimizer), replicated))
    data = NamedSharding(m, P("data"))
    batches = [jax.device_put(b, data) for b in batches]
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for path in column_parallel:  # the sharded run is not a replicated one
        assert _get(params, path).sharding.spec[-1] == "model", path
    with jax.set_mesh(m), nn.logical_axis_rules(DEFAULT_RULES):
        losses = _train(model, optimizer, batches)
    state, _ = _result(model, losses)

    assert_like_reference(state, losses, reference)
    for path in column_parallel:  # still split after the updates
        kernel = _get(state.params, path)
        assert kernel.sharding.spec[-1] == "model", (path, kernel.sharding)
        assert kernel.addressable_shards[0].data.shape[-1] == kernel.shape[-1] // shape[1]
    for leaf in jax.tree.leaves(state.fp8_meta):  # every device holds the same FP8 state
        shards = leaf.addressable_shards
        assert len(shards) == N_DEVICES
        for shard in shards:
            np.testing.assert_array_equal(shard.data, shards[0].data)


def test_built_under_the_mesh_is_sharded_on_creation():
    """Inside ``jax.set_mesh`` and the rules, NNX shards the annotated params as they are made."""
    m = make_mesh((2, 4))
    with jax.set_mesh(m), nn.logical_axis_rules(DEFAULT_RULES):
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            layer = _transformer(nnx.Rngs(SEED))
        assert layer.mlp.wi_kernel[...].sharding.spec == P(None, None, "model")
        assert layer.attention.qkv.kernel[...].sharding.spec[-1] == "model"
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            y = nnx.jit(lambda m, x: m(x, deterministic=True))(layer, _batches()[0][0])
    assert y.shape == (BATCH, LENGTH, EMBED)
