"""Parallel FP8 training of an MLP block on 8 emulated devices: DP, FSDP, TP, DP x TP, FSDP x TP
and sequence parallel (SP: the block's input and output split along the sequence over the TP
axis, as Megatron SP places them around a TP pair).

The block is ``DenseGeneral(embed -> mlp)`` (column parallel), gelu, ``DenseGeneral(mlp ->
embed)`` (row parallel), with logical axis names mapped onto a ``("data", "model")`` mesh by
``nn.logical_axis_rules``. Three jitted train steps with ``DelayedScaling`` are compared with the
same three steps on one device:

- loss and params within float32 reduction-order tolerance (``rtol=2e-5, atol=1e-6``: a sharded
  run sums the same products in another order, e.g. the row-parallel all-reduce);
- the amax histories and scales within ``rtol=1e-6``: a max is exact in any order, but after the
  first step the tensors themselves differ in the last bit (DP and FSDP give bit-identical
  state here; TP does not, through the row-parallel sum); the amaxes of the data are exact;
- every device holds the same scales (``addressable_shards``).

HLO (compiled): FP8 gathers what the same model with FP8 disabled gathers: nothing in DP, TP
and DP x TP; each weight once in FSDP and FSDP x TP; in SP the input along the sequence before
the column-parallel GEMM and the output gradient in the backward pass. The all-reduces
are those of the FP8-disabled model plus the amax reductions, which XLA combines into one
all-reduce per step in every mode (each split tensor's amax is reduced over the whole mesh).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo import count, group_size
from _parallel import N_DEVICES, mse_step, state_shardings
from _parallel import all_reduces as _all_reduces
from _parallel import assert_like_reference as _assert_like_reference
from _parallel import gather_key as _gather_key
from _parallel import gathered_shapes as _gathered_shapes
from _parallel import is_scalar_reduce as _is_scalar_reduce
from _parallel import train as _train
from _shared import make_mesh, rand
from conftest import needs_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax import DelayedScaling
from fp8jax.flax import DEFAULT_RULES, DenseGeneral, Fp8DotGeneral, Fp8TrainState

pytestmark = needs_devices(N_DEVICES)

RECIPE = DelayedScaling(amax_history_len=4)
BATCH, LENGTH, EMBED, MLP = 16, 4, 32, 64
STEPS = 3
FSDP_RULES = (("batch", "data"), ("embed", "data"), ("mlp", None), ("length", None))
FSDP_TP_RULES = (("batch", "data"), ("embed", "data"), ("mlp", "model"), ("length", None))
# sequence parallel (Megatron SP) around the TP pair: outside it the sequence is split over model
SP_RULES = (("batch", "data"), ("length", "model"), ("embed", None), ("mlp", "model"))

# mode: (mesh shape (data, model), logical axis rules)
MODES = {
    "dp": ((8, 1), DEFAULT_RULES),
    "fsdp": ((8, 1), FSDP_RULES),
    "tp": ((1, 8), DEFAULT_RULES),
    "dp_tp": ((2, 4), DEFAULT_RULES),
    "fsdp_tp": ((2, 4), FSDP_TP_RULES),
    "sp": ((2, 4), SP_RULES),
}
# the block's input (and output) layout per mode: batch over data; SP also splits the sequence
INPUT_SPECS = {"sp": P("data", "model")}


class MlpBlock(nn.Module):
    """embed -> mlp (column parallel) -> gelu -> embed (row parallel).

    ``sequence_parallel``: the hidden activations hold the whole sequence (``None`` for their
    length axis), so that with ``length -> model`` only the block's input and output are split
    along the sequence (Megatron SP: gather before the column-parallel GEMM, reduce after the
    row-parallel one).
    """

    sequence_parallel: bool = False

    @nn.compact
    def __call__(self, x):
        h = DenseGeneral(
            features=MLP,
            kernel_axes=("embed", "mlp"),
            bias_axes=("mlp",),
            output_axes=("batch", None if self.sequence_parallel else "length", "mlp"),
            name="wi",
        )(x)
        h = nn.gelu(h)
        return DenseGeneral(
            features=EMBED,
            kernel_axes=("mlp", "embed"),
            bias_axes=("embed",),
            output_axes=("batch", "length", "embed"),
            name="wo",
        )(h)


def _batches():
    return [
        (rand((BATCH, LENGTH, EMBED), 10 + i, s), rand((BATCH, LENGTH, EMBED), 20 + i))
        for i, s in enumerate((1.0, 3.0, 0.5))
    ]


def _step_fn(model, enabled=True):
    return mse_step(model, RECIPE, enabled)


def _init_state(model, x):
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        boxed = model.init(jax.random.key(0), x)
    variables = nn.unbox(boxed)
    state = Fp8TrainState.from_variables(
        apply_fn=model.apply, variables=variables, tx=optax.sgd(0.1), recipe=RECIPE
    )
    return state, boxed


def _single_device_run(model=None):
    model = model or MlpBlock()
    batches = _batches()
    state, _ = _init_state(model, batches[0][0])
    step = jax.jit(_step_fn(model))
    losses = []
    for x, y in batches:
        state, loss = step(state, x, y)
        losses.append(float(loss))
    return state, losses


_REFERENCE: list = []


def _reference():
    if not _REFERENCE:
        _REFERENCE.append(_single_device_run())
    return _REFERENCE[0]


def _sharded_setup(mode, enabled=True, model=None, explicit=False):
    """(jitted step, sharded state, sharded batches, mesh) for ``mode``."""
    shape, rules = MODES[mode]
    mesh = make_mesh(shape, explicit=explicit)
    model = model or MlpBlock(sequence_parallel=mode == "sp")
    batches = _batches()
    state, boxed = _init_state(model, batches[0][0])
    shardings = state_shardings(state, boxed, mesh, rules)
    replicated = NamedSharding(mesh, P())
    state = jax.device_put(state, shardings)
    data = NamedSharding(mesh, INPUT_SPECS.get(mode, P("data")))
    batches = [jax.device_put(b, data) for b in batches]
    inner = _step_fn(model, enabled)

    def step(state, x, y):
        with nn.logical_axis_rules(rules):
            return inner(state, x, y)

    jitted = jax.jit(step, out_shardings=(shardings, replicated))
    return jitted, state, batches, mesh


def _compiled_hlo(mode, enabled=True, explicit=False) -> str:
    step, state, batches, mesh = _sharded_setup(mode, enabled, explicit=explicit)
    with jax.set_mesh(mesh):
        return step.lower(state, *batches[0]).compile().as_text()


def test_logical_axes_annotate_params_only():
    model = MlpBlock()
    x = _batches()[0][0]
    _, boxed = _init_state(model, x)
    specs = nn.get_partition_spec(boxed)
    assert specs["params"]["wi"]["kernel"] == P("embed", "mlp")
    assert specs["params"]["wo"]["kernel"] == P("mlp", "embed")
    assert specs["params"]["wo"]["bias"] == P("embed")
    # the FP8 state is not boxed: replicated under any rules
    for leaf in jax.tree.leaves(specs["fp8_meta"]) + jax.tree.leaves(specs["fp8_probe"]):
        assert leaf == P()
    # without axis names nothing is boxed (the checkpoint layout of before)
    plain = DenseGeneral(features=4).init(jax.random.key(0), jnp.ones((2, 3)))
    assert not any(isinstance(v, nn.Partitioned) for v in jax.tree.leaves(
        plain, is_leaf=lambda v: isinstance(v, nn.Partitioned)))  # fmt: skip
    with pytest.raises(ValueError, match="kernel_axes"):
        DenseGeneral(features=4, kernel_axes=("embed",)).init(jax.random.key(0), jnp.ones((2, 3)))


@pytest.mark.parametrize("mode", list(MODES))
def test_parallel_train_matches_single_device(mode):
    state, losses = _train(*_sharded_setup(mode))
    meta, ref_meta = _assert_like_reference(state, losses, _reference())
    # the first layer's input amaxes depend on the data only: exact in every mode
    np.testing.assert_array_equal(meta["wi"]["amax_history"][0], ref_meta["wi"]["amax_history"][0])
    for leaf in jax.tree.leaves(state.fp8_meta):
        shards = leaf.addressable_shards
        assert len(shards) == N_DEVICES
        for shard in shards:
            np.testing.assert_array_equal(shard.data, shards[0].data)
    # the params really are sharded as the rules say
    kernel = state.params["wi"]["kernel"]
    if mode == "fsdp":
        assert kernel.sharding.spec == P("data", None)
    elif mode == "fsdp_tp":
        assert kernel.sharding.spec == P("data", "model")
    elif mode in ("tp", "dp_tp", "sp"):
        assert kernel.sharding.spec == P(None, "model")


# mode: (amax all-reduces: the scalar-only ones, their replica-group sizes, sorted), the number
# of amaxes they reduce, the all-reduces of the same model with FP8 disabled. Each amax of a
# split tensor is reduced over the whole mesh (amax_reduction="mesh"), so XLA combines all of
# them into a single all-reduce per step, on a 2-D mesh too.
AMAX_ALL_REDUCES = {
    "dp": ([8], 4, 1),  # x, h, and both output grads are split over data; kernels replicated
    "fsdp": ([8], 6, 1),  # the same four plus both kernels (split over data on embed)
    "tp": ([8], 4, 1),  # wi kernel and output grad, wo input and kernel: split over model
    "dp_tp": ([8], 6, 2),  # split over data, over model, over both: one all-reduce for all
    "fsdp_tp": ([8], 6, 2),  # the same six (the kernels split over data and model)
    "sp": ([8], 6, 3),  # as DP x TP; the plain model's loss sum is an all-reduce of its own here
}


@pytest.mark.parametrize("mode", list(MODES))
def test_collectives(mode):
    fp8 = _compiled_hlo(mode, enabled=True)
    plain = _compiled_hlo(mode, enabled=False)
    # FP8 gathers exactly what the plain model gathers (a kernel may come in the other layout)
    gathered = _gathered_shapes(fp8)
    assert _gather_key(fp8) == _gather_key(plain), (gathered, _gathered_shapes(plain))
    if mode == "sp":  # the block's input along the sequence, and its output gradient: as Megatron
        assert gathered == [(BATCH // 2, LENGTH, EMBED)] * 2, gathered
    else:  # no activation: under FSDP each kernel (its model-local block) and wo's bias, once
        tp = MODES[mode][0][1]
        param_shapes = {tuple(sorted((EMBED, MLP // tp))), (EMBED,)}
        assert {tuple(sorted(s)) for s in gathered} <= param_shapes, gathered
        assert len(gathered) == (3 if mode.startswith("fsdp") else 0), fp8
    for op in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert count(fp8, op) == count(plain, op) == 0, op
    # the all-reduces: those of the plain model plus the amax reductions
    groups, n_amax, n_plain = AMAX_ALL_REDUCES[mode]
    reduces = _all_reduces(fp8)
    amax = [line for line in reduces if _is_scalar_reduce(line) and "cast_transpose" in line]
    assert sorted(group_size(line) for line in amax) == groups, amax
    assert sum(line.split(" all-reduce")[0].count("f32[]") for line in amax) == n_amax
    assert len(_all_reduces(plain)) == n_plain
    assert len(reduces) == n_plain + len(groups)


class InjectedMlpBlock(nn.Module):
    """The MLP block from Flax's own ``nn.DenseGeneral`` with ``dot_general_cls=Fp8DotGeneral``:
    the params (and their logical axis names) belong to Flax's layer, FP8 runs inside."""

    @nn.compact
    def __call__(self, x):
        def layer(features, axes, name):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes)
            return nn.DenseGeneral(
                features, kernel_init=init, dot_general_cls=Fp8DotGeneral, name=name
            )

        h = nn.gelu(layer(MLP, ("embed", "mlp"), "wi")(x))
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        return layer(EMBED, ("mlp", "embed"), "wo")(h)


@pytest.mark.parametrize("mode", ["tp", "dp_tp", "fsdp"])
def test_injected_dot_general_trains_sharded(mode):
    """Fp8DotGeneral inside Flax's DenseGeneral: the same results as one device and the same
    gathers as the FP8-disabled model (no activation; FSDP: each kernel once)."""
    step, state, batches, mesh = _sharded_setup(mode, model=InjectedMlpBlock())
    assert state.params["wi"]["kernel"].sharding.spec != P()  # really sharded
    with jax.set_mesh(mesh):
        hlo = step.lower(state, *batches[0]).compile().as_text()
    state, losses = _train(step, state, batches, mesh)
    _assert_like_reference(state, losses, _single_device_run(InjectedMlpBlock()))
    plain_step, plain_state, _, _ = _sharded_setup(mode, False, model=InjectedMlpBlock())
    with jax.set_mesh(mesh):
        plain = plain_step.lower(plain_state, *batches[0]).compile().as_text()
    # (the biases have no axis names here, so both models gather wi's bias gradient in TP)
    assert _gather_key(hlo) == _gather_key(plain), (_gathered_shapes(hlo), _gathered_shapes(plain))
    assert not any(len(s) == 3 for s in _gathered_shapes(hlo))  # no activation


@pytest.mark.parametrize("mode", ["fsdp", "dp_tp", "sp"])
def test_gspmd_partitioner(gspmd, mode):
    """The same under the GSPMD partitioner (``jax_use_shardy_partitioner=False``): results as
    on one device, the plain model's gathers, one all-reduce more than the plain model."""
    del gspmd
    state, losses = _train(*_sharded_setup(mode))
    _assert_like_reference(state, losses, _reference())
    fp8, plain = _compiled_hlo(mode), _compiled_hlo(mode, enabled=False)
    assert _gather_key(fp8) == _gather_key(plain)
    assert len(_all_reduces(fp8)) == len(_all_reduces(plain)) + 1


@pytest.mark.parametrize("mode", list(MODES))
def test_explicit_sharding_mesh(mode):
    """The same steps on a mesh with explicit axes (``jax.make_mesh``'s default, where shardings
    are part of the types): results as on one device; the plain model's gathers and other
    collectives, plus one amax all-reduce."""
    state, losses = _train(*_sharded_setup(mode, explicit=True))
    _assert_like_reference(state, losses, _reference())
    for leaf in jax.tree.leaves(state.fp8_meta):
        assert leaf.sharding.spec == P()
    fp8 = _compiled_hlo(mode, explicit=True)
    plain = _compiled_hlo(mode, enabled=False, explicit=True)
    assert _gather_key(fp8) == _gather_key(plain), (_gathered_shapes(fp8), _gathered_shapes(plain))
    for op in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert count(fp8, op) == count(plain, op), op
    assert len(_all_reduces(fp8)) == len(_all_reduces(plain)) + 1


def test_fsdp_gathers_each_weight_once():
    """FSDP: the backward pass reuses the forward pass's gathered FP8 kernel (dgrad transposes
    it locally) instead of gathering the other layout again, as the FP32 model keeps its one
    gathered weight: one all-gather per kernel (and one for wo's bias) in both."""
    fp8 = _gathered_shapes(_compiled_hlo("fsdp", enabled=True))
    plain = _gathered_shapes(_compiled_hlo("fsdp", enabled=False))
    assert len(fp8) == len(plain) == 3, (fp8, plain)
    # one 2-D gather per kernel (wi's and wo's, in the layout of the forward GEMM), wo's bias
    assert sorted(fp8) == [(EMBED,), (EMBED, MLP), (MLP, EMBED)], fp8


@pytest.mark.parametrize("fsdp", [False, True], ids=["dp_tp", "fsdp_tp"])
def test_parallel_train_example_runs(capsys, fsdp):
    path = Path(__file__).resolve().parents[2] / "examples" / "parallel_train.py"
    spec = importlib.util.spec_from_file_location("parallel_train_example", path)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # Flax's dataclasses look their module up
    try:
        spec.loader.exec_module(example)
    finally:
        del sys.modules[spec.name]
    argv = ["--dp", "2", "--tp", "4", "--steps", "3", "--batch", "8", "--length", "2"]
    losses = example.main([*argv, "--embed", "16", "--mlp", "32", *(["--fsdp"] if fsdp else [])])
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert losses[-1] < losses[0]
    out = capsys.readouterr().out
    assert "mesh: {'data': 2, 'model': 4}" in out
    assert ("P('data', 'model')" if fsdp else "P(None, 'model')") in out
