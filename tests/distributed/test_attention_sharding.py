"""MultiHeadAttention trained in FP8 on 8 emulated devices (DP x TP, FSDP x TP) with its logical
axis names, against the same steps on one device: heads split over the TP axis (Megatron: the
QKV projection column parallel, the output projection row parallel), batch over the data axis.

Three jitted ``DelayedScaling`` steps; loss and params within float32 reduction order, the FP8
state within 1e-6 (see tests/distributed/test_parallel_train.py for why).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _shared import make_mesh, rand
from conftest import needs_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax import DelayedScaling
from fp8jax.flax import DEFAULT_RULES, Fp8TrainState, MultiHeadAttention

pytestmark = needs_devices(8)

RECIPE = DelayedScaling(amax_history_len=4)
BATCH, LENGTH, EMBED, HEADS, HEAD_DIM = 8, 6, 32, 4, 8
FSDP_TP_RULES = (("batch", "data"), ("embed", "data"), ("heads", "model"), ("length", None))
AXES = dict(
    qkv_kernel_axes=("embed", "heads"),
    qkv_bias_axes=("heads",),
    out_kernel_axes=("heads", "embed"),
    out_bias_axes=("embed",),
    layernorm_input_axes=("batch", "length", "embed"),
)


def _model(**kw):
    return MultiHeadAttention(head_dim=HEAD_DIM, num_attention_heads=HEADS, use_bias=True,
                              transpose_batch_sequence=False, attn_mask_type="causal",
                              **AXES, **kw)  # fmt: skip


def _batches():
    return [(rand((BATCH, LENGTH, EMBED), 10 + i, s), rand((BATCH, LENGTH, EMBED), 20 + i))
            for i, s in enumerate((1.0, 3.0, 0.5))]  # fmt: skip


def _step_fn(model):
    def step(state, x, y):
        def loss_fn(params, probes):
            with fp8jax.autocast(enabled=True, recipe=RECIPE):
                out, _ = model.apply(state.variables(params, probes), x, x)
            return jnp.mean((out - y) ** 2)

        loss, (grads, probe_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            state.params, state.fp8_probe
        )
        return state.apply_gradients(grads=grads, probe_grads=probe_grads, recipe=RECIPE), loss

    return step


def _init(model, x):
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        boxed = jax.jit(lambda k, x: model.init(k, x, x))(jax.random.key(0), x)
    state = Fp8TrainState.from_variables(
        apply_fn=model.apply, variables=nn.unbox(boxed), tx=optax.sgd(0.1), recipe=RECIPE
    )
    return state, boxed


def _run(model, mesh=None, rules=None):
    batches = _batches()
    state, boxed = _init(model, batches[0][0])
    inner = _step_fn(model)
    if mesh is None:
        step = jax.jit(inner)
    else:
        with nn.logical_axis_rules(rules):
            specs = nn.get_partition_spec(boxed)
            params = nn.logical_to_mesh_sharding(specs, mesh, rules)["params"]
        rep = NamedSharding(mesh, P())
        shardings = state.replace(
            step=rep, params=params, opt_state=jax.tree.map(lambda _: rep, state.opt_state),
            fp8_meta=jax.tree.map(lambda _: rep, state.fp8_meta),
            fp8_probe=jax.tree.map(lambda _: rep, state.fp8_probe),
        )  # fmt: skip
        state = jax.device_put(state, shardings)
        batches = [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in batches]

        def sharded(state, x, y):
            with nn.logical_axis_rules(rules):
                return inner(state, x, y)

        step = jax.jit(sharded, out_shardings=(shardings, rep))
    losses = []
    for x, y in batches:
        if mesh is None:
            state, loss = step(state, x, y)
        else:
            with jax.set_mesh(mesh):
                state, loss = step(state, x, y)
        losses.append(float(loss))
    return state, losses


@pytest.mark.parametrize("rules", [DEFAULT_RULES, FSDP_TP_RULES], ids=["dp_tp", "fsdp_tp"])
@pytest.mark.parametrize("gqa", [None, 2], ids=["mha", "gqa"])
def test_sharded_training_matches_one_device(rules, gqa):
    model = _model(num_gqa_groups=gqa)
    ref_state, ref_losses = _run(model)
    mesh = make_mesh()
    state, losses = _run(model, mesh, rules)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    jax.tree.map(close, jax.device_get(state.params), jax.device_get(ref_state.params))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 jax.device_get(state.fp8_meta), jax.device_get(ref_state.fp8_meta))  # fmt: skip
    kernel = state.params["qkv" if gqa is None else "query"]["kernel"]
    assert kernel.sharding.spec[-1] == "model"  # heads split over the TP axis


def test_fp8_dpa_sharded_training_matches_one_device():
    """fp8_dpa (FP8 attention, its reference on CPU) trained data x tensor parallel: its
    roles' amaxes are global (q, k, v and dO cast by fp8jax's quantize, reduced over the mesh;
    P, O, dS and the gradients XLA's max over the sharded tensors), so the state and the steps
    are one device's. A rounding that flips one FP8 step between the two reduction orders moves
    a value by 2**-4 of itself: looser bounds than the high-precision core's."""
    model = _model(fp8_dpa=True)
    ref_state, ref_losses = _run(model)
    state, losses = _run(model, make_mesh(), DEFAULT_RULES)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-3)
    assert state.fp8_meta["attention"]["scale"].shape == (15,)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-2),
                 jax.device_get(state.fp8_meta), jax.device_get(ref_state.fp8_meta))  # fmt: skip
