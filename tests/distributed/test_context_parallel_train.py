"""A TransformerLayer stack (two layers; one under the block and row-wise recipes: DEPTH) trained
3 steps with context parallelism on 8 emulated devices (data x context, context x tensor)
against the same steps on one device, under every recipe, both strategies, causal with and
without load balancing (the batch in TE's DualChunkSwap order on the mesh, in its own order on
one device).

Each mesh step starts from the one-device run's state before it and is compared with
tests/distributed/_matrix.py's :func:`assert_same_training`: loss within 1e-4, each param's
update within 1e-4 normwise with FP8 off (float32 reduction order: the ring sums its blocks in
another order) and 5e-3 with FP8 (that order can tip an FP8 code over a rounding tie), the FP8
state within 1e-4 and equal on every device: each shard quantized with the same scales, the
amax max-reduced over the context axis too.

Sizes: the block recipes quantize the weight-gradient GEMMs' operands in blocks along the
tokens (128 for Float8BlockScaling, 32 for MXFP8); for the mesh to group the same tokens as one
device, each device holds whole blocks of one sequence (2 x 512 tokens on data x context for
Float8BlockScaling), so their runs are larger than the others.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from _matrix import RECIPES, UPDATE_TOLERANCE, Step, assert_same_training
from _shared import make_mesh, rand
from conftest import needs_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax import Float8RowwiseScaling
from fp8jax.flax import TransformerLayer, TransformerLayerType
from fp8jax.functional.load_balancing import ReorderStrategy, reorder_causal_load_balancing

pytestmark = needs_devices(8)

RECIPES = {**RECIPES, "rowwise": Float8RowwiseScaling()}
HEADS, GROUPS = 4, 2
#: recipe -> (batch, length, hidden, mlp hidden)
SIZES = {"block": (2, 512, 128, 256), "mxfp8": (2, 128, 64, 128)}
SMALL = (2, 64, 64, 128)
LR = 0.5
MESHES = {  # name -> (shape, axis names, logical axis rules, the batch's split)
    "data_x_context": (
        (2, 4), ("data", "cp"), (("batch", "data"), ("length", "cp")), P("data", "cp"),
    ),
    "context_x_tensor": (
        (4, 2), ("cp", "model"), (("length", "cp"), ("heads", "model"), ("mlp", "model")),
        P(None, "cp"),
    ),
}  # fmt: skip
#: Layers in the stack by recipe: the block and row-wise recipes' runs have one. Two are
#: chaotic under them at these sizes: one device's own updates move by up to 2e-2 normwise when
#: its input moves by 1e-6 (both recipes); the context-parallel run (float32 reduction order)
#: moved layer_0's by up to 3e-2 (block, step 3) and the last layer's by 2.5e-3: the first
#: layer's gradients pass through the second layer's FP8 backward.
DEPTH = {"block": 1, "rowwise": 1}
#: Cases on jax.make_mesh's explicit axes (the others: automatic ones).
EXPLICIT = {("delayed", "data_x_context")}
#: (recipe, mesh, strategy, load balanced): every recipe, every pair of mesh, strategy and
#: balancing, both strategies and both balancings under FP8.
CASES = [
    ("off", "data_x_context", "ring", True),
    ("off", "context_x_tensor", "all_gather", False),
    ("delayed", "context_x_tensor", "ring", False),
    ("delayed", "data_x_context", "all_gather", True),
    ("current", "data_x_context", "ring", False),
    # not balanced: the reorder would put other tokens together in the 128-token blocks of the
    # weight-gradient GEMMs than one device's order does (a different quantization)
    ("block", "data_x_context", "ring", False),
    ("mxfp8", "context_x_tensor", "all_gather", False),
    ("rowwise", "context_x_tensor", "ring", True),
]


class Stack(nn.Module):
    """``depth`` causal TransformerLayers (no relative position bias: a bias is not split)."""

    cp: dict
    mlp: int
    depth: int = 2

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = TransformerLayer(
                hidden_size=x.shape[-1], mlp_hidden_size=self.mlp, num_attention_heads=HEADS,
                num_gqa_groups=GROUPS, layer_type=TransformerLayerType.ENCODER,
                self_attn_mask_type="causal", enable_relative_embedding=False,
                hidden_dropout=0.0, attention_dropout=0.0, logical_axes=True, name=f"layer_{i}",
                **self.cp,
            )(x, deterministic=True)  # fmt: skip
        return x


def _autocast(recipe: str):
    return fp8jax.autocast(enabled=RECIPES[recipe] is not None, recipe=RECIPES[recipe])


def _train(recipe, model, data, targets, starts=None, mesh=None, rules=(), split=None,
           reorder=None):  # fmt: skip
    """3 SGD steps (each from ``starts[i]`` when given); ``reorder``: applied to each batch and
    target on the way in (the loss, a mean, does not see the order)."""

    def step(params, meta, probes, x, y):
        def loss_fn(params, probes):
            with _autocast(recipe):
                out = model.apply({"params": params, "fp8_meta": meta, "fp8_probe": probes}, x)
            return jnp.mean((out.astype(jnp.float32) - y) ** 2)

        loss, (grads, pgrads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, probes)
        params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        if meta:
            meta = fp8jax.flax.update_fp8_variables(meta, pgrads, RECIPES[recipe])
        return params, meta, loss

    with _autocast(recipe):
        variables = jax.jit(model.clone(cp={}).init)(jax.random.key(1), data[0])
    state = (variables["params"], variables.get("fp8_meta", {}))
    probes = variables.get("fp8_probe", {})
    step = jax.jit(step)
    steps = []
    for i, (x, y) in enumerate(zip(data, targets, strict=True)):
        start = state if starts is None else starts[i]
        if mesh is None:
            params, meta, loss = step(*start, probes, x, y)
        else:
            x, y = reorder(x), reorder(y)
            with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
                x, y = jax.device_put((x, y), NamedSharding(mesh, split))
                replicated = NamedSharding(mesh, P())  # params and FP8 state, on every device
                start_, probes_ = jax.device_put((start, probes), replicated)
                params, meta, loss = step(*start_, probes_, x, y)
        state = (params, meta)
        steps.append(Step(start, float(loss), params, meta))
    return steps


@pytest.mark.parametrize("recipe, mesh_name, strategy, balanced", CASES)
def test_context_parallel_training_equals_one_device(recipe, mesh_name, strategy, balanced):
    shape, names, rules, split = MESHES[mesh_name]
    mesh = make_mesh(shape, names=names, explicit=(recipe, mesh_name) in EXPLICIT)
    cp = names.index("cp")
    b, length, hidden, mlp = SIZES.get(recipe, SMALL)
    data = [rand((b, length, hidden), 10 + i, s) for i, s in enumerate((1.0, 3.0, 0.5))]
    targets = [rand((b, length, hidden), 30 + i) for i in range(3)]
    want = _train(recipe, Stack({}, mlp, DEPTH.get(recipe, 2)), data, targets)

    def reorder(t):
        if not balanced:
            return t
        return reorder_causal_load_balancing(t, ReorderStrategy.DualChunkSwap, shape[cp], 1)

    cp_args = dict(context_parallel_axis="cp", context_parallel_strategy=strategy.upper(),
                   context_parallel_causal_load_balanced=balanced)  # fmt: skip
    model = Stack(cp_args, mlp, DEPTH.get(recipe, 2))
    got = _train(recipe, model, data, targets, [s.start for s in want], mesh, rules, split, reorder)
    # (5e-3 for every FP8 recipe; the mesh matrix predates the row-wise one)
    assert_same_training(got, want, recipe if recipe in UPDATE_TOLERANCE else "current")
