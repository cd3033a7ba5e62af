"""Parallel FP8 training of ``LayerNormMLP`` and ``LayerNormDenseGeneral`` on 8 emulated devices.

As test_parallel_train.py does for a ``DenseGeneral`` pair, with the fused layers: a
``LayerNormMLP`` (non-gated ``"gelu"`` and gated ``("silu", "linear")``, with biases) and a
``LayerNormDenseGeneral``, their params named by logical axes (``wi_kernel`` ``("embed", None,
"mlp")``: GEMM1 column parallel, ``wo_kernel`` ``("mlp", "embed")``: GEMM2 row parallel), trained
three steps with ``DelayedScaling`` on a ``("data", "model")`` mesh in TP, SP (the norm on a
sequence-split input, ``layernorm_input_axes=("batch", "length", "embed")`` with ``length ->
model``), DP x TP, FSDP and FSDP x TP, and compared with the same steps on one device: losses and
params within float32 reduction order, the FP8 state within ``1e-6``.

The compiled step gathers what the same model with FP8 disabled gathers (the gathered sizes
compared: a kernel may be gathered in its other layout, or as the 2-D view the FP8 GEMM reads;
dtypes are not compared), has no other collective that the FP32 model does not have, and adds
exactly one all-reduce per step: every amax of a split tensor is reduced over the whole mesh,
which XLA combines into one all-reduce. The gated block's first GEMM keeps the activation pair
as its own dim (fp8jax/ops/gemms/fixed_groups.py); before, its 2-D reshape gathered ``wi_kernel``,
``wi_bias`` and the activation gradient under TP. In SP the fused layers run the norm on the
sequence-split input and gather its FP8 output before GEMM1 (Megatron's sequence parallelism),
where the FP32 blocks keep the sequence split through the GEMMs and gather the kernels instead
(``_SP_ROWS``): xfailed in ``test_collectives`` and pinned by ``test_sp_gathers``.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from _hlo import count, group_size
from _parallel import (
    N_DEVICES,
    all_reduces,
    assert_like_reference,
    gathered_shapes,
    is_scalar_reduce,
    mse_step,
    state_shardings,
    train,
)
from _shared import make_mesh, rand
from conftest import needs_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax import DelayedScaling
from fp8jax.flax import DEFAULT_RULES, Fp8TrainState, LayerNormDenseGeneral, LayerNormMLP

pytestmark = needs_devices(N_DEVICES)

RECIPE = DelayedScaling(amax_history_len=4)
BATCH, LENGTH, EMBED, MLP = 8, 8, 32, 64
FSDP_RULES = (("batch", "data"), ("embed", "data"), ("mlp", None), ("length", None))
FSDP_TP_RULES = (("batch", "data"), ("embed", "data"), ("mlp", "model"), ("length", None))
SP_RULES = (("batch", "data"), ("length", "model"), ("embed", None), ("mlp", "model"))

# mode: (mesh shape (data, model), logical axis rules)
MODES = {
    "tp": ((1, 8), DEFAULT_RULES),
    "sp": ((2, 4), SP_RULES),
    "dp_tp": ((2, 4), DEFAULT_RULES),
    "fsdp": ((8, 1), FSDP_RULES),
    "fsdp_tp": ((2, 4), FSDP_TP_RULES),
}
INPUT_SPECS = {"sp": P("data", "model")}
GELU, GATED = ("gelu",), ("silu", "linear")


class MlpBlock(nn.Module):
    """A ``LayerNormMLP`` whose input (``layernorm_input_axes``) and output carry the logical
    names ``("batch", "length", "embed")``: under SP's rules both are split along the
    sequence."""

    activations: tuple[str, ...] = GELU

    @nn.compact
    def __call__(self, x):
        out, _ = LayerNormMLP(
            intermediate_dim=MLP,
            activations=self.activations,
            intermediate_dropout_rate=0.0,
            scale_axes=("embed",),
            ln_bias_axes=("embed",),
            kernel_axes_1=("embed", None, "mlp"),
            kernel_axes_2=("mlp", "embed"),
            use_bias=True,
            bias_axes_1=(None, "mlp"),
            bias_axes_2=("embed",),
            layernorm_input_axes=("batch", "length", "embed"),
            name="mlp",
        )(x, deterministic=True)
        return nn.with_logical_constraint(out, ("batch", "length", "embed"))


class LnDenseBlock(nn.Module):
    """``LayerNormDenseGeneral`` (embed -> mlp, column parallel) with its input named as
    ``MlpBlock``'s; its output is ``("batch", None, "mlp")`` (the whole sequence under SP)."""

    @nn.compact
    def __call__(self, x):
        out, _ = LayerNormDenseGeneral(
            features=MLP,
            scale_axes=("embed",),
            ln_bias_axes=("embed",),
            kernel_axes=("embed", "mlp"),
            use_bias=True,
            bias_axes=("mlp",),
            layernorm_input_axes=("batch", "length", "embed"),
            name="ln_dense",
        )(x)
        return nn.with_logical_constraint(out, ("batch", None, "mlp"))


def _batches(out_features):
    return [
        (rand((BATCH, LENGTH, EMBED), 10 + i, s), rand((BATCH, LENGTH, out_features), 20 + i))
        for i, s in enumerate((1.0, 3.0, 0.5))
    ]


def _step_fn(model, enabled=True):
    return mse_step(model, RECIPE, enabled)


def _init_state(model, x):
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        boxed = model.init(jax.random.key(0), x)

    # random norm params and biases, so that their gradients and shardings matter
    def perturb(path, v):
        if "kernel" in jax.tree_util.keystr(path):
            return v
        seed = 100 + len(jax.tree_util.keystr(path)) * 7 + v.size
        return rand(v.shape, seed, 0.1) + ("scale" in jax.tree_util.keystr(path))

    params = jax.tree_util.tree_map_with_path(perturb, nn.unbox(boxed)["params"])
    variables = {**nn.unbox(boxed), "params": params}
    state = Fp8TrainState.from_variables(
        apply_fn=model.apply, variables=variables, tx=optax.sgd(0.1), recipe=RECIPE
    )
    return state, boxed


def _model(kind):
    return LnDenseBlock() if kind == "ln_dense" else MlpBlock(GATED if kind == "gated" else GELU)


def _out_features(kind):
    return MLP if kind == "ln_dense" else EMBED


_REFERENCE: dict = {}


def _reference(kind):
    """The three steps on one device."""
    if kind not in _REFERENCE:
        model = _model(kind)
        batches = _batches(_out_features(kind))
        state, _ = _init_state(model, batches[0][0])
        step = jax.jit(_step_fn(model))
        losses = []
        for x, y in batches:
            state, loss = step(state, x, y)
            losses.append(float(loss))
        _REFERENCE[kind] = (state, losses)
    return _REFERENCE[kind]


def _sharded_setup(kind, mode, enabled=True, explicit=False):
    """(jitted step, sharded state, sharded batches, mesh) for ``kind`` in ``mode``."""
    shape, rules = MODES[mode]
    m = make_mesh(shape, explicit=explicit)
    model = _model(kind)
    batches = _batches(_out_features(kind))
    state, boxed = _init_state(model, batches[0][0])
    shardings = state_shardings(state, boxed, m, rules)
    state = jax.device_put(state, shardings)
    data = NamedSharding(m, INPUT_SPECS.get(mode, P("data")))
    batches = [jax.device_put(b, data) for b in batches]
    inner = _step_fn(model, enabled)

    def step(state, x, y):
        with nn.logical_axis_rules(rules):
            return inner(state, x, y)

    jitted = jax.jit(step, out_shardings=(shardings, NamedSharding(m, P())))
    return jitted, state, batches, m


_COMPILED: dict = {}


def _compiled(kind, mode, enabled=True):
    """``(compiled step, sharded state, sharded batches, mesh, HLO text)``, compiled once per
    case for both tests."""
    key = (kind, mode, enabled)
    if key not in _COMPILED:
        step, state, batches, m = _sharded_setup(kind, mode, enabled)
        with jax.set_mesh(m):
            compiled = step.lower(state, *batches[0]).compile()
        _COMPILED[key] = (compiled, state, batches, m, compiled.as_text())
    return _COMPILED[key]


CASES = [
    *((kind, mode) for kind in ("gelu", "gated") for mode in MODES),
    ("ln_dense", "tp"),
    ("ln_dense", "sp"),
    ("ln_dense", "dp_tp"),
    ("ln_dense", "fsdp"),
]


@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_matches_single_device(kind, mode):
    compiled, state, batches, m, _ = _compiled(kind, mode)
    state, losses = train(compiled, state, batches, m)
    assert_like_reference(state, losses, _reference(kind))
    for leaf in jax.tree.leaves(state.fp8_meta):  # every device holds the same FP8 state
        shards = leaf.addressable_shards
        assert len(shards) == N_DEVICES
        for shard in shards:
            np.testing.assert_array_equal(shard.data, shards[0].data)


# Where the FP8 step communicates otherwise than the FP32 one (the results match in every case):
_SP_ROWS = (
    "fp8jax's GEMMs read [rows, k]: the norm runs on the sequence-split [batch, length, "
    "embed] input, and the (batch, length) -> rows flattening of its FP8 output gathers the "
    "sequence (Shardy keeps no split of length through it) before GEMM1, Megatron's sequence "
    "parallelism (the FP8 output and its transposed copy, and in the MLP block the output "
    "gradient in the backward), where the FP32 block, which contracts the 3-D input directly, "
    "keeps the sequence split through both GEMMs and gathers the kernels and wi's bias over "
    "model instead (LayerNormDenseGeneral: the norm's output); see test_sp_gathers"
)
COLLECTIVE_XFAILS = {
    ("gelu", "sp"): _SP_ROWS,
    ("gated", "sp"): _SP_ROWS,
    ("ln_dense", "sp"): f"{_SP_ROWS}; here FP32 gathers the norm's output (f32) where the FP8 "
    "layer gathers its FP8 codes and their transposed copy",
}


def _gather_key(hlo: str) -> list[int]:
    """The sizes of the all-gathered arrays, sorted (a kernel may be gathered in its other
    layout, or the 2-D view the FP8 GEMM reads of the 3-D ``wi_kernel``)."""
    return sorted(int(np.prod(s)) for s in gathered_shapes(hlo))


@pytest.mark.parametrize(
    ("kind", "mode"),
    [
        pytest.param(*c, marks=pytest.mark.xfail(reason=COLLECTIVE_XFAILS[c], strict=True))
        if c in COLLECTIVE_XFAILS
        else c
        for c in CASES
    ],
)
def test_collectives(kind, mode):
    """FP8 gathers what FP32 gathers, has no other collective FP32 lacks, and adds one amax
    all-reduce per step (every amax reduced over the whole mesh, combined by XLA)."""
    fp8, plain = _compiled(kind, mode)[-1], _compiled(kind, mode, enabled=False)[-1]
    assert _gather_key(fp8) == _gather_key(plain), (gathered_shapes(fp8), gathered_shapes(plain))
    for op in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert count(fp8, op) == count(plain, op), op
    reduces, plain_reduces = all_reduces(fp8), all_reduces(plain)
    amax = [line for line in reduces if is_scalar_reduce(line)]
    assert len(amax) == 1 and group_size(amax[0]) == N_DEVICES, amax
    assert len(reduces) == len(plain_reduces) + 1, (reduces, plain_reduces)


@pytest.mark.parametrize("kind", ["gelu", "gated", "ln_dense"])
def test_sp_gathers(kind):
    """What the FP8 layers communicate under SP (see ``_SP_ROWS``): the fused norm runs on the
    local part of the sequence ``[batch / 2, length / 4, embed]``; gathered along the sequence
    are its FP8 output (``[batch / 2, length, embed]``, never the f32 input) and the transposed
    FP8 copy for GEMM1's weight gradient (``[embed, batch / 2, length]``), and for the MLP block
    (whose output is split along the sequence again) its output gradient in the backward; no
    other gather, all-to-all or permute of its own, and one amax all-reduce over the whole
    mesh, ``dgamma``/``dbeta`` summed over the whole mesh too."""
    fp8, plain = _compiled(kind, "sp")[-1], _compiled(kind, "sp", enabled=False)[-1]
    half, half_t = (BATCH // 2, LENGTH, EMBED), (EMBED, BATCH // 2, LENGTH)
    want = [half, half_t] if kind == "ln_dense" else [half, half_t, half]
    assert sorted(gathered_shapes(fp8)) == sorted(want), gathered_shapes(fp8)
    gathers = [line for line in fp8.splitlines() if re.search(r"\sall-gather(?:-start)?\(", line)]
    # the norm's output is gathered as FP8 codes (the CPU backend widens them to f16 to move
    # them; a GPU moves the bytes); only the MLP's output gradient is f32
    assert sum("= f32[" in line for line in gathers) == (0 if kind == "ln_dense" else 1), gathers
    norms = [
        line for line in fp8.splitlines() if 'custom_call_target="fp8jax_layernorm_forward' in line
    ]
    local = f"f32[{BATCH // 2},{LENGTH // 4},{EMBED}]"
    assert len(norms) == 1 and f"operand_layout_constraints={{{local}" in norms[0], norms
    if kind == "gelu":  # FP32: wo's and wi's kernels and wi's bias over model, no activation
        assert sorted(gathered_shapes(plain)) == [(1, MLP), (EMBED, 1, MLP), (MLP, EMBED)]
    elif kind == "ln_dense":  # FP32: the norm's output (the norm ran on the split sequence)
        assert gathered_shapes(plain) == [half]
    for op in ("collective-permute", "reduce-scatter"):
        assert count(fp8, op) == 0, op
    # LayerNormDenseGeneral: its output, whole along the sequence, meets the sequence-split
    # target in the loss (an all-to-all, as in FP32)
    assert count(fp8, "all-to-all") == (1 if kind == "ln_dense" else 0)
    amax = [line for line in all_reduces(fp8) if is_scalar_reduce(line)]
    assert len(amax) == 1 and group_size(amax[0]) == N_DEVICES, amax


def test_gspmd_partitioner(gspmd):
    """The gated block in DP x TP under the GSPMD partitioner (``jax_use_shardy_partitioner=
    False``): results as on one device, FP32's gathers (none), one all-reduce more."""
    del gspmd
    step, state, batches, m = _sharded_setup("gated", "dp_tp")
    with jax.set_mesh(m):
        fp8 = step.lower(state, *batches[0]).compile().as_text()
    assert_like_reference(*train(step, state, batches, m), _reference("gated"))
    plain_step, plain_state, _, _ = _sharded_setup("gated", "dp_tp", enabled=False)
    with jax.set_mesh(m):
        plain = plain_step.lower(plain_state, *batches[0]).compile().as_text()
    assert gathered_shapes(fp8) == gathered_shapes(plain) == []
    assert len(all_reduces(fp8)) == len(all_reduces(plain)) + 1


@pytest.mark.parametrize("kind", ["gelu", "gated"])
def test_explicit_sharding_mesh(kind):
    """TP on a mesh with explicit axes (``jax.make_mesh``'s default, shardings part of the
    types): the results of one device, and no gather (the gated 2-D reshape would not even be
    allowed there)."""
    step, state, batches, m = _sharded_setup(kind, "tp", explicit=True)
    with jax.set_mesh(m):
        hlo = step.lower(state, *batches[0]).compile().as_text()
    assert_like_reference(*train(step, state, batches, m), _reference(kind))
    assert gathered_shapes(hlo) == []
