"""The mesh matrix's cases and their runs (tests/distributed/test_mesh_matrix.py).

Dimensions: the layer, the recipe, the parallelism, the kind of mesh (``jax.sharding.Mesh``'s
automatic axes or ``jax.make_mesh``'s explicit ones), jitted or eager, Linen or NNX.
:func:`pairwise` picks cases so that every pair of values of two dimensions meets in at least
one of them (not the full product, which would not fit CI); a case trains its layer 2 SGD steps
on one device and on the mesh, and :func:`assert_same_training` compares them.

Sizes: the block recipes need every split dim of every GEMM operand to be whole 128-blocks per
device (fp8jax refuses the rest by name), so the layers are 256 wide with 256 tokens, on meshes
of at most 2 x 2 devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _shared import make_mesh, rand
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    MXFP8BlockScaling,
)
from fp8jax.layers import MoEBlockConfig

DIMENSIONS: dict[str, tuple[str, ...]] = {
    "layer": (
        "dense",
        "dense_qkv",
        "layernorm_dense",
        "layernorm_mlp",
        "attention",
        "transformer",
        "transformer_moe",
        "moe",
    ),
    "recipe": ("off", "delayed", "current", "block", "mxfp8"),
    "parallel": ("dp", "tp", "fsdp", "ep"),
    "mesh": ("auto", "explicit"),
    "jit": ("jit", "eager"),
    "api": ("linen", "nnx"),
}
MOE_LAYERS = ("transformer_moe", "moe")

RECIPES = {
    "off": None,
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    # not in the pairwise design (it would add a case per layer): ROWWISE_CASES
    "rowwise": Float8RowwiseScaling(),
    "rowwise_hp": Float8RowwiseScaling(wgrad_high_precision=True),
}

#: Float8RowwiseScaling's focused cases (issue 49): both kinds of mesh, jitted and eager, Linen
#: and NNX, the MoE block with expert parallelism, its high-precision wgrad under explicit axes
#: (the whole design would add a case per layer to the distributed leg; tensor parallelism:
#: tests/distributed/test_rowwise_sharding.py).
ROWWISE_CASES: tuple[dict[str, str], ...] = tuple(
    dict(zip(DIMENSIONS, c, strict=True))
    for c in (
        ("moe", "rowwise", "ep", "explicit", "jit", "nnx"),
        ("moe", "rowwise_hp", "ep", "auto", "jit", "linen"),
        ("dense", "rowwise_hp", "fsdp", "explicit", "eager", "nnx"),
    )
)

BATCH, LENGTH, HIDDEN, HEADS, HEAD_DIM, MLP, EXPERTS = 4, 64, 256, 2, 128, 256, 2
LR = 0.5


def _rules(**axes: Any) -> tuple[tuple[str, Any], ...]:
    """Logical axis rules naming every logical axis fp8jax's layers use (NNX maps a name
    without a rule onto a mesh axis of that name), ``axes`` split, the rest replicated."""
    names = [n for n, _ in fp8jax.flax.DEFAULT_RULES]
    return tuple((n, axes.get(n)) for n in names)


# parallelism -> (mesh shape, axis names, logical axis rules); "ep" also names the experts' axis
_TP = dict(batch="data", mlp="model", heads="model")
PARALLEL: dict[str, tuple[tuple[int, ...], tuple[str, ...], tuple[tuple[str, Any], ...]]] = {
    "dp": ((2,), ("data",), _rules(batch="data")),
    "tp": ((2, 2), ("data", "model"), _rules(**_TP)),
    "fsdp": ((2, 2), ("data", "model"), _rules(**_TP, embed="data")),
    "ep": ((2, 2), ("data", "expert"), _rules(batch="data", exp="expert")),
}


def allowed(case: dict[str, str]) -> bool:
    """Expert parallelism is a property of the MoE layers only."""
    return case.get("parallel") != "ep" or case.get("layer", MOE_LAYERS[0]) in MOE_LAYERS


def _pairs(case: dict[str, str]) -> set[tuple[tuple[str, str], tuple[str, str]]]:
    items = sorted(case.items())
    return set(itertools.combinations(items, 2))


def pairwise(dims: dict[str, tuple[str, ...]] = DIMENSIONS) -> list[dict[str, str]]:
    """A deterministic greedy pairwise (2-way covering) design over ``dims`` under
    :func:`allowed`: each case starts from an uncovered pair and adds, dimension by dimension,
    the value that covers the most pairs not yet covered."""
    names = list(dims)
    uncovered = set()
    for a, b in itertools.combinations(names, 2):
        for va, vb in itertools.product(dims[a], dims[b]):
            if allowed({a: va, b: vb}):
                uncovered.add(tuple(sorted(((a, va), (b, vb)))))
    cases = []
    while uncovered:
        (a, va), (b, vb) = min(uncovered, key=lambda p: (names.index(p[0][0]), p))
        case = {a: va, b: vb}
        for name in names:
            if name in case:
                continue
            best = max(
                (v for v in dims[name] if allowed({**case, name: v})),
                key=lambda v: len(_pairs({**case, name: v}) & uncovered),
            )
            case[name] = best
        case = {n: case[n] for n in names}
        uncovered -= _pairs(case)
        cases.append(case)
    return cases


def case_id(case: dict[str, str]) -> str:
    return "-".join(case.values())


# ------------------------------------------------------------------------------------ the layers


@dataclasses.dataclass(frozen=True)
class Layer:
    """A layer of the matrix: ``kwargs(expert_axis)`` its arguments, ``linen(**kwargs)`` its
    Linen module, ``nnx(width, rngs=..., **kwargs)`` its NNX module, ``call(module, x)`` a
    call of either (the first output is the one trained)."""

    kwargs: Callable[[str | None], dict[str, Any]]
    linen: Callable[..., Any]
    nnx: Callable[..., Any]
    call: Callable[[Any, jax.Array], jax.Array] = lambda m, x: m(x)


def _first(y):
    return y[0] if isinstance(y, tuple) else y


def _moe_config(expert_axis):
    return MoEBlockConfig(
        num_experts=EXPERTS, num_experts_per_tok=1, intermediate_size=MLP,
        expert_axis=expert_axis, data_parallelism_axes=("data",) if expert_axis else (),
    )  # fmt: skip


def _transformer_kwargs(moe: bool):
    def kwargs(expert_axis):
        kw = dict(
            hidden_size=HIDDEN, mlp_hidden_size=MLP, num_attention_heads=HEADS,
            hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
            self_attn_mask_type="causal", logical_axes=True,
        )  # fmt: skip
        if moe:
            kw.update(mlp="moe", moe=_moe_config(expert_axis))
        return kw

    return kwargs


LAYERS: dict[str, Layer] = {
    "dense": Layer(
        lambda _: dict(features=MLP, kernel_axes=("embed", "mlp"), bias_axes=("mlp",)),
        fp8jax.flax.DenseGeneral,
        lambda h, features, **kw: fp8jax.nnx.DenseGeneral(h, features, **kw),
    ),
    "dense_qkv": Layer(  # a fused QKV projection: a 3-D kernel split on its last dim
        lambda _: dict(features=(3, HEADS * HEAD_DIM), kernel_axes=("embed", None, "heads")),
        fp8jax.flax.DenseGeneral,
        lambda h, features, **kw: fp8jax.nnx.DenseGeneral(h, features, **kw),
    ),
    "layernorm_dense": Layer(
        lambda _: dict(
            features=MLP,
            kernel_axes=("embed", "mlp"),
            scale_axes=("embed",),
            ln_bias_axes=("embed",),
        ),
        fp8jax.flax.LayerNormDenseGeneral,
        lambda h, features, **kw: fp8jax.nnx.LayerNormDenseGeneral(h, features, **kw),
    ),
    "layernorm_mlp": Layer(
        lambda _: dict(
            intermediate_dim=MLP,
            activations=("gelu", "linear"),
            intermediate_dropout_rate=0.0,
            kernel_axes_1=("embed", "act", "mlp"),
            kernel_axes_2=("mlp", "embed"),
            scale_axes=("embed",),
            ln_bias_axes=("embed",),
        ),
        fp8jax.flax.LayerNormMLP,
        fp8jax.nnx.LayerNormMLP,
        call=lambda m, x: m(x, deterministic=True),
    ),
    "attention": Layer(
        lambda _: dict(
            head_dim=HEAD_DIM,
            num_attention_heads=HEADS,
            attention_dropout=0.0,
            attn_mask_type="causal",
            qkv_kernel_axes=("embed", "heads"),
            out_kernel_axes=("heads", "embed"),
            scale_axes=("embed",),
            ln_bias_axes=("embed",),
        ),
        fp8jax.flax.MultiHeadAttention,
        fp8jax.nnx.MultiHeadAttention,
        call=lambda m, x: m(x, x, deterministic=True),
    ),
    "transformer": Layer(
        _transformer_kwargs(moe=False),
        fp8jax.flax.TransformerLayer,
        lambda h, **kw: fp8jax.nnx.TransformerLayer(**kw),
        call=lambda m, x: m(x, deterministic=True),
    ),
    "transformer_moe": Layer(
        _transformer_kwargs(moe=True),
        fp8jax.flax.TransformerLayer,
        lambda h, **kw: fp8jax.nnx.TransformerLayer(**kw),
        call=lambda m, x: m(x, deterministic=True),
    ),
    "moe": Layer(
        lambda expert_axis: dict(
            num_experts=EXPERTS,
            num_experts_per_tok=1,
            intermediate_size=MLP,
            gate_kernel_axes=("embed", None),
            wi_kernel_axes=("exp", "embed", "mlp"),
            wo_kernel_axes=("exp", "mlp", "embed"),
            expert_axis=expert_axis,
            data_parallelism_axes=("data",) if expert_axis else (),
        ),
        fp8jax.flax.MoEBlock,
        fp8jax.nnx.MoEBlock,
    ),
}


# ------------------------------------------------------------------------------------- the runs


@dataclasses.dataclass
class Step:
    """One train step: the state it started from (Linen: ``(params, fp8_meta)``; NNX: the pure
    dict of the model's whole state), the loss, the params and the FP8 state it left."""

    start: Any
    loss: float
    params: Any
    fp8_meta: Any


def inputs() -> list[jax.Array]:
    """The two steps' inputs (the second at another scale, so delayed scaling's history
    matters)."""
    return [rand((BATCH, LENGTH, HIDDEN), 10 + i, s) for i, s in enumerate((1.0, 3.0))]


def _autocast(recipe_name: str):
    recipe = RECIPES[recipe_name]
    return fp8jax.autocast(enabled=recipe is not None, recipe=recipe)


def _maybe_jit(fn, jit: bool, nnx_api: bool):
    if not jit:
        return fn
    return nnx.jit(fn) if nnx_api else jax.jit(fn)


def run(
    case: dict[str, str], mesh: Any | None = None, starts: list[Any] | None = None
) -> list[Step]:
    """The case's layer trained 2 SGD steps: on one device (``mesh=None``), or on ``mesh``
    with its params placed by their logical axis names under the case's rules (the FP8 state
    replicated) and the batch split over ``data``, each step starting from ``starts[i]`` (the
    one-device run's state before it, placed on the mesh), so that each step is compared on
    its own: a difference of float32 reduction order that tips one FP8 code over a rounding tie
    in step 1 would otherwise move a whole block's power-of-two scale in step 2."""
    layer = LAYERS[case["layer"]]
    _, _, rules = PARALLEL[case["parallel"]]
    expert_axis = "expert" if (mesh is not None and case["parallel"] == "ep") else None
    data = inputs()
    # the targets, shaped as the layer's first output (traced without the expert axis, whose
    # exchange needs the mesh)
    builder = layer.linen(**layer.kwargs(None))
    with _autocast(case["recipe"]):
        shape = jax.eval_shape(
            lambda x: _first(layer.call(lambda *a, **k: builder.init_with_output(
                jax.random.key(0), *a, **k)[0], x)), data[0]
        ).shape  # fmt: skip
    targets = [rand(shape, 30 + i) for i in range(len(data))]
    fn = _run_nnx if case["api"] == "nnx" else _run_linen
    return fn(layer, layer.kwargs(expert_axis), case, data, targets, mesh, rules, starts)


def _on(mesh, rules) -> contextlib.ExitStack:
    """``jax.set_mesh(mesh)`` and the logical axis ``rules``; nothing without a mesh. The
    layers are built outside (Linen's boxed params would be constrained, which under explicit
    axes only asserts), trained inside."""
    stack = contextlib.ExitStack()
    if mesh is not None:
        stack.enter_context(jax.set_mesh(mesh))
        stack.enter_context(nn.logical_axis_rules(rules))
    return stack


def _place(tree, specs, mesh):
    return jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), tree, specs)


def _batch(mesh, x, y):
    return (x, y) if mesh is None else jax.device_put((x, y), NamedSharding(mesh, P("data")))


def _run_linen(layer, kwargs, case, data, targets, mesh, rules, starts):
    recipe = RECIPES[case["recipe"]]
    module = layer.linen(**kwargs)
    # built without the expert axis, whose exchange needs the mesh (the same params)
    builder = layer.linen(**layer.kwargs(None))

    def call(variables, x):
        return _first(layer.call(lambda *a, **k: module.apply(variables, *a, **k), x))

    with _autocast(case["recipe"]):
        boxed = jax.jit(
            lambda x: layer.call(lambda *a, **k: builder.init(jax.random.key(1), *a, **k), x)
        )(data[0])
    variables = nn.unbox(boxed)
    state = (variables["params"], variables.get("fp8_meta", {}))
    probes = variables.get("fp8_probe", {})
    place = lambda t: t
    if mesh is not None:
        with nn.logical_axis_rules(rules):
            shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
        replicated = lambda t: _place(t, jax.tree.map(lambda _: P(), t), mesh)
        place = lambda t: (jax.device_put(t[0], shardings["params"]), replicated(t[1]))
        probes = replicated(probes)

    def step(params, meta, probes, x, y):
        def loss_fn(params, probes):
            with _autocast(case["recipe"]):
                out = call({"params": params, "fp8_meta": meta, "fp8_probe": probes}, x)
            return jnp.mean((out.astype(jnp.float32) - y) ** 2)

        loss, (grads, probe_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, probes)
        params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        if meta:
            meta = fp8jax.flax.update_fp8_variables(meta, probe_grads, recipe)
        return params, meta, loss

    step = _maybe_jit(step, case["jit"] == "jit", nnx_api=False)
    steps = []
    for i, (x, y) in enumerate(zip(data, targets, strict=True)):
        start = state if starts is None else place(starts[i])
        with _on(mesh, rules):
            params, meta, loss = step(*start, probes, *_batch(mesh, x, y))
        state = (params, meta)
        steps.append(Step(start, float(loss), params, meta))
    return steps


def _run_nnx(layer, kwargs, case, data, targets, mesh, rules, starts):
    with _autocast(case["recipe"]):
        model = layer.nnx(HIDDEN, rngs=nnx.Rngs(1), **kwargs)
    optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
    place = lambda t: t
    if mesh is not None:
        with nn.logical_axis_rules(rules):
            specs = nnx.get_partition_spec(nnx.state(model))
        place = lambda t: _place(t, specs, mesh)
        opt_state = nnx.state(optimizer)
        nnx.update(optimizer, _place(opt_state, jax.tree.map(lambda _: P(), opt_state), mesh))

    def step(model, optimizer, x, y):
        def loss_fn(model):
            return jnp.mean((_first(layer.call(model, x)).astype(jnp.float32) - y) ** 2)

        with _autocast(case["recipe"]):
            loss, grads = nnx.value_and_grad(loss_fn, argnums=fp8jax.nnx.diff_state())(model)
        fp8jax.nnx.apply_gradients(model, optimizer, grads)
        return loss

    step = _maybe_jit(step, case["jit"] == "jit", nnx_api=True)
    steps = []
    for i, (x, y) in enumerate(zip(data, targets, strict=True)):
        if starts is not None:
            state = nnx.state(model)
            nnx.replace_by_pure_dict(state, starts[i])
            nnx.update(model, place(state))
        start = nnx.to_pure_dict(nnx.state(model))  # a copy: the step updates the variables
        with _on(mesh, rules):
            loss = float(step(model, optimizer, *_batch(mesh, x, y)))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        meta = nnx.to_pure_dict(nnx.state(model, fp8jax.nnx.Fp8MetaVariable))
        steps.append(Step(start, loss, params, meta))
    return steps


def mesh_of(case: dict[str, str]):
    shape, names, _ = PARALLEL[case["parallel"]]
    return make_mesh(shape, names=names, explicit=case["mesh"] == "explicit")


def _normwise(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.linalg.norm(b), 1e-30)
    return float(np.linalg.norm(a - b) / scale)


#: How far (normwise) a param's update on the mesh may be from one device's, by recipe: float32
#: reduction order alone with FP8 off; with FP8, that order can tip an FP8 code over a rounding
#: tie (seen: one E5M2 gradient code moving a 256 x 768 wgrad by 1.8e-3 on JAX 0.10.2), and
#: under the block recipes a block's amax over a power of two (its 128 codes move: about 1e-3
#: of a 256 x 256 tensor). A wrong scale on some shard moves every element by FP8's
#: resolution instead: 2-4% normwise (E4M3's and E5M2's rounding noise).
UPDATE_TOLERANCE = {
    "off": 1e-4, "delayed": 5e-3, "current": 5e-3, "block": 5e-3, "mxfp8": 5e-3, "rowwise": 5e-3,
    "rowwise_hp": 5e-3,
}  # fmt: skip


def assert_same_training(got: list[Step], want: list[Step], recipe: str) -> None:
    """Each step of the mesh run ``got`` (started from ``want``'s state before it) against the
    one-device run ``want``: the loss within ``1e-4``; each param's update within
    :data:`UPDATE_TOLERANCE` normwise; the FP8 state within ``1e-4`` and the same on every
    device."""
    tolerance = UPDATE_TOLERANCE[recipe]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        where = f"step {i + 1}"
        np.testing.assert_allclose(g.loss, w.loss, rtol=1e-4, err_msg=where)
        before = _params_of(w.start, w.params)
        ref = dict(_leaves(w.params))
        flat = _leaves(g.params)
        assert len(flat) == len(ref) and flat, (len(flat), len(ref))
        for path, value in flat:
            err = _normwise(value - before[path], ref[path] - before[path])
            assert err < tolerance, f"{where}, {path}: update off by {err:.2e} normwise"
        meta_want = dict(_leaves(w.fp8_meta))
        meta_got = jax.tree_util.tree_leaves_with_path(g.fp8_meta)
        assert len(meta_got) == len(meta_want)
        for path, leaf in meta_got:
            key = jax.tree_util.keystr(path)
            np.testing.assert_allclose(np.asarray(leaf), meta_want[key], rtol=1e-4, err_msg=key)
            shards = leaf.addressable_shards
            for shard in shards:
                np.testing.assert_array_equal(shard.data, shards[0].data)


def _leaves(tree) -> list[tuple[str, np.ndarray]]:
    flat = jax.tree_util.tree_leaves_with_path(jax.device_get(tree))
    return [(jax.tree_util.keystr(p), np.asarray(v)) for p, v in flat]


def _params_of(start, params_like) -> Any:
    """The params of a step's start state (Linen: ``(params, meta)``; NNX: the pure dict of
    the model's state), as the tree ``params_like``."""
    if isinstance(start, tuple):
        return dict(_leaves(start[0]))
    keys = {k for k, _ in _leaves(params_like)}
    flat = jax.tree_util.tree_leaves_with_path(start)
    return {k: np.asarray(v) for p, v in flat if (k := jax.tree_util.keystr(p)) in keys}
