"""The train steps that ``benchmarks/e2e.py`` times and ``benchmarks/structure.py``'s cost model
predicts: four variants of each workload, built one way for both.

Workloads (``SIZES``: the GPU sizes and the tiny ``--allow-cpu`` ones):

  layernorm_mlp      LayerNorm -> Dense(ffn) -> gelu -> Dense(hidden) on bf16 ``[tokens, hidden]``
  transformer_layer  one pre-LN causal encoder layer on bf16 ``[batch, seq, hidden]``, gelu MLP
                     (``rotary=True`` in its sizes: with rotary embeddings)
  gpt-small          examples/train_gpt.py's byte-level GPT at its ``gpu-small`` preset (rotary
  gpt-medium         embeddings, layers under ``nn.scan``, AdamW), and at ``gpu-medium``

Variants, each ``step(state, batch) -> (state, loss)``, one optimizer step (SGD for the layers,
the demo's AdamW for the GPTs):

  fp8       fp8jax's modules under ``DelayedScaling(HYBRID)`` with its kernels
  fp8_xla   the same step traced under ``fp8jax.ops.implementation("xla")``
  flax_fp8  the model from Flax layers, every Dense with Flax's ``Fp8DirectDotGeneralOp``
  bf16      the same Flax model in BF16

Every variant starts from the same weights (fp8jax's init, reshaped for the Flax model), sees the
same batches and runs attention through ``jax.nn.dot_product_attention`` with one implementation
(``attention``) in every variant.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen import fp8_ops

import fp8jax
from fp8jax.flax import Fp8TrainState, LayerNormMLP, TransformerLayer
from fp8jax.rotary import rotary_pos_emb

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_gpt

VARIANTS = ("fp8", "fp8_xla", "flax_fp8", "bf16")
BF16 = jnp.bfloat16
RECIPE = train_gpt.RECIPES["fp8"]  # DelayedScaling(HYBRID, amax_history_len=16, max)
LR = 1e-2  # the layers' SGD
_TINY_GPT = dict(layers=2, hidden=32, heads=2, mlp=64, seq=32, batch=2, steps=20, lr=1e-3)
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "layernorm_mlp": {
        "gpu": dict(tokens=16384, hidden=4096, ffn=16384),
        "cpu": dict(tokens=64, hidden=32, ffn=64),
    },
    "transformer_layer": {
        "gpu": dict(batch=8, seq=2048, hidden=4096, ffn=16384, heads=32),
        "cpu": dict(batch=2, seq=16, hidden=32, ffn=64, heads=2),
    },
    "gpt-small": {"gpu": train_gpt.PRESETS["gpu-small"], "cpu": _TINY_GPT},
    "gpt-medium": {"gpu": train_gpt.PRESETS["gpu-medium"], "cpu": _TINY_GPT},
}
WORKLOADS = tuple(SIZES)


# ------------------------------------------------------------------------- the Flax models


class FlaxMlp(nn.Module):
    """LayerNorm -> Dense(ffn) -> gelu -> Dense(hidden), no bias (fp8jax's LayerNormMLP)."""

    ffn: int
    dot_general_cls: Any = None
    param_dtype: Any = BF16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(
            use_bias=False,
            dtype=BF16,
            param_dtype=self.param_dtype,
            dot_general_cls=self.dot_general_cls,
        )
        y = nn.LayerNorm(dtype=BF16, param_dtype=self.param_dtype, name="ln")(x)
        y = nn.gelu(nn.Dense(self.ffn, name="up", **kw)(y))
        return nn.Dense(x.shape[-1], name="down", **kw)(y)


class FlaxLayer(nn.Module):
    """fp8jax's TransformerLayer as these benchmarks configure it, from Flax layers: pre-LN,
    fused QKV, causal attention with unscaled logits (fp8jax's default scales the query's
    init instead), optional rotary embeddings, then :class:`FlaxMlp`."""

    heads: int
    ffn: int
    rotary: bool = False
    attention: str = "xla"
    dot_general_cls: Any = None
    param_dtype: Any = BF16

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        del deterministic  # (no dropout; the argument fp8jax's layer takes)
        b, s, h = x.shape
        kw = dict(
            use_bias=False,
            dtype=BF16,
            param_dtype=self.param_dtype,
            dot_general_cls=self.dot_general_cls,
        )
        y = nn.LayerNorm(dtype=BF16, param_dtype=self.param_dtype, name="attn_ln")(x)
        qkv = nn.Dense(3 * h, name="qkv", **kw)(y).reshape(b, s, 3, self.heads, h // self.heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.rotary:
            q, k = (rotary_pos_emb(t, (1, 10000), False, "consecutive") for t in (q, k))
        a = jax.nn.dot_product_attention(
            q, k, v, scale=1.0, is_causal=True, implementation=self.attention
        )
        x = x + nn.Dense(h, name="out", **kw)(a.reshape(b, s, h))
        return x + FlaxMlp(self.ffn, self.dot_general_cls, self.param_dtype, name="mlp")(x)


class _Block(nn.Module):
    layer: Callable[..., nn.Module]  # builds the layer, given its name

    @nn.compact
    def __call__(self, x, _):
        return self.layer(name="layer")(x, deterministic=True), None


class Gpt(nn.Module):
    """``train_gpt.GPT`` with the layer ``layer`` builds: byte embedding -> ``cfg.layers``
    layers under ``nn.scan`` -> LayerNorm -> tied logits (the same params tree for every
    layer kind: ``Embed_0``, ``blocks/layer``, ``LayerNorm_0``)."""

    cfg: Any
    layer: Callable[..., nn.Module]

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(256, self.cfg.hidden, embedding_init=nn.initializers.normal(0.02))
        x = embed(tokens).astype(BF16)
        axes = dict.fromkeys(
            ("params", "fp8_meta", "fp8_probe", fp8_ops.OVERWRITE_WITH_GRADIENT), 0
        )
        blocks = nn.scan(
            _Block, variable_axes=axes, split_rngs={"params": True}, length=self.cfg.layers
        )
        x, _ = blocks(self.layer, name="blocks")(x, None)
        x = nn.LayerNorm(dtype=jnp.float32)(x)
        return embed.attend(x.astype(jnp.float32))


def flax_mlp_params(p: dict[str, Any]) -> dict[str, Any]:
    """fp8jax's LayerNormMLP params as :class:`FlaxMlp`'s (leading stacked axes kept)."""
    wi = p["wi_kernel"]  # [..., hidden, 1, ffn]
    return {
        "ln": {"scale": p["scale"], "bias": p["ln_bias"]},
        "up": {"kernel": wi.reshape(*wi.shape[:-2], wi.shape[-1])},
        "down": {"kernel": p["wo_kernel"]},
    }


def flax_layer_params(p: dict[str, Any]) -> dict[str, Any]:
    """fp8jax's TransformerLayer params as :class:`FlaxLayer`'s."""
    qkv = p["attention"]["qkv"]  # kernel [..., hidden, 3, hidden]
    k = qkv["kernel"]
    return {
        "attn_ln": {"scale": qkv["scale"], "bias": qkv["ln_bias"]},
        "qkv": {"kernel": k.reshape(*k.shape[:-2], -1)},
        "out": {"kernel": p["attention"]["out"]["kernel"]},
        "mlp": flax_mlp_params(p["mlp"]),
    }


# ------------------------------------------------------------------------------ the steps


class FlaxState(NamedTuple):
    """The Flax variants' train state: params, the other collections (Flax's FP8 scales and
    amax histories, which their gradient replaces), the optimizer's state."""

    params: Any
    other: Any
    opt_state: Any


def fp8_step(objective: Callable[..., jax.Array], call: dict[str, Any], update: bool = True):
    """The fp8jax step: loss and gradients of params and probes, then the optimizer and the FP8
    state update (``update=False``: the FP8 state update only, gradients returned too)."""

    def step(state: Fp8TrainState, batch: tuple[jax.Array, jax.Array]):
        x, y = batch

        def loss_fn(params, probes):
            return objective(state.apply(state.variables(params, probes), x, **call), y)

        loss, (g, pg) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state.params, state.fp8_probe)
        if update:
            return state.apply_gradients(grads=g, probe_grads=pg), loss
        meta = fp8jax.flax.update_fp8_variables(state.fp8_meta, pg, state.recipe)
        return state.replace(fp8_meta=meta), loss, g

    return step


def with_cudnn_fp8(fn: Callable[..., Any], fp8_dpa: bool) -> Callable[..., Any]:
    """``fn`` traced with cuDNN's FP8 attention opted into (``implementation(attention=
    "kernel")``: its backward is not the reference's; fp8jax/ops/attention/fp8_attention.py)
    when ``fp8_dpa``, else ``fn``."""
    if not fp8_dpa:
        return fn

    @functools.wraps(fn)
    def traced(*args: Any) -> Any:
        with fp8jax.ops.implementation(attention="kernel"):
            return fn(*args)

    return traced


def under_xla(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` traced with every fp8jax op as XLA's compilation of its reference."""

    @functools.wraps(step)
    def traced(*args: Any) -> Any:
        with fp8jax.ops.implementation("xla"):
            return step(*args)

    return traced


def flax_step(model: nn.Module, tx: Any, objective: Callable[..., jax.Array], update: bool = True):
    """The Flax step: loss and gradients, the optimizer on params, the other collections
    replaced by their gradients (Flax's FP8 state); ``update=False`` returns the gradients."""

    def step(state: FlaxState, batch: tuple[jax.Array, jax.Array]):
        x, y = batch

        def loss_fn(params, other):
            return objective(model.apply({"params": params, **other}, x), y)

        loss, (g, new_other) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            state.params, state.other
        )
        if not update:
            return state._replace(other=new_other), loss, g
        updates, opt_state = tx.update(g, state.opt_state, state.params)
        return FlaxState(optax.apply_updates(state.params, updates), new_other, opt_state), loss

    return step


def _mse(out: Any, y: jax.Array) -> jax.Array:
    out = out[0] if isinstance(out, tuple) else out  # LayerNormMLP returns (out, ln_out)
    return jnp.mean(jnp.square(out.astype(jnp.float32) - y.astype(jnp.float32)))


@dataclasses.dataclass
class Workload:
    """One workload's four variants: ``steps[v](state, batch)``, ``init[v]()`` (the initial
    state; under ``jax.eval_shape`` its shapes) and ``batches(n)`` (n device batches)."""

    name: str
    sizes: dict[str, Any]
    tokens_per_step: int
    attention: str
    steps: dict[str, Callable[..., Any]]
    init: dict[str, Callable[[], Any]]
    batches: Callable[[int], list[Any]]

    def abstract(self, variant: str) -> tuple[Any, Any]:
        """``(state, batch)`` as shapes (to lower a step without allocating)."""
        batch = jax.eval_shape(lambda: self.batches(1)[0])
        return jax.eval_shape(self.init[variant]), batch


def _attention_kw(attention: str) -> dict[str, Any]:
    """fp8jax's TransformerLayer set to ``attention``: its own field where it has one; without
    one it runs JAX's default, the XLA path, the only one the Flax variants can then match."""
    if "attention_implementation" in {f.name for f in dataclasses.fields(TransformerLayer)}:
        return {"attention_implementation": attention}
    if attention != "xla":
        raise ValueError(
            f"attention={attention!r}: this fp8jax's TransformerLayer has no "
            "attention_implementation field, so only 'xla' (JAX's default) is the same in every "
            "variant"
        )
    return {}


def _flax_init(
    model: nn.Module,
    fp8_init: Callable[[], Any],
    to_flax: Callable[..., Any],
    x: jax.Array,
    tx: Any,
) -> Callable[[], FlaxState]:
    """The Flax model's initial state with fp8jax's initial params (checked to fit)."""

    def init() -> FlaxState:
        variables = model.init(jax.random.key(7), x)
        params = to_flax(fp8_init().params)
        want = jax.tree.map(lambda a: (a.shape, a.dtype), variables["params"])
        got = jax.tree.map(lambda a: (a.shape, a.dtype), params)
        if want != got:
            raise RuntimeError(f"the Flax twin's params {want} differ from the mapped {got}")
        other = {k: v for k, v in variables.items() if k != "params"}
        return FlaxState(params, other, tx.init(params))

    return init


def build(
    name: str,
    sizes: dict[str, Any],
    attention: str = "xla",
    update: bool = True,
    fp8_dpa: bool = False,
) -> Workload:
    """The workload ``name`` (of ``WORKLOADS``) at ``sizes`` (``SIZES[name]["gpu"]`` or
    ``["cpu"]``, or your own); ``fp8_dpa``: fp8jax's variants run FP8 attention (the Flax
    ones cannot), cuDNN's where the step is lowered for a GPU (:func:`with_cudnn_fp8`)."""
    if name not in SIZES:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")
    if attention not in ("xla", "cudnn"):
        raise ValueError(f"attention must be 'xla' or 'cudnn', got {attention!r}")
    if fp8_dpa and name == "layernorm_mlp":
        raise ValueError("fp8_dpa: layernorm_mlp has no attention")
    dpa = {"fp8_dpa": True} if fp8_dpa else {}
    if name.startswith("gpt"):
        return _gpt(name, sizes, attention, update, dpa)
    key = jax.random.key(0)
    if name == "layernorm_mlp":
        shape = (sizes["tokens"], sizes["hidden"])
        fp8_model = LayerNormMLP(
            intermediate_dim=sizes["ffn"],
            activations=("gelu",),
            intermediate_dropout_rate=0.0,
            dtype=BF16,
            param_dtype=BF16,
        )
        call: dict[str, Any] = {"deterministic": True}

        def flax_model(dg):
            return FlaxMlp(sizes["ffn"], dg)

        to_flax = flax_mlp_params
    else:
        shape = (sizes["batch"], sizes["seq"], sizes["hidden"])
        fp8_model = TransformerLayer(
            hidden_size=sizes["hidden"],
            mlp_hidden_size=sizes["ffn"],
            num_attention_heads=sizes["heads"],
            hidden_dropout=0.0,
            attention_dropout=0.0,
            intermediate_dropout=0.0,
            enable_relative_embedding=False,
            dtype=BF16,
            param_dtype=BF16,
            enable_rotary_pos_emb=sizes.get("rotary", False),
            **_attention_kw(attention),
            **dpa,
        )
        call = {"deterministic": True}

        def flax_model(dg):
            return FlaxLayer(
                sizes["heads"], sizes["ffn"], sizes.get("rotary", False), attention, dg
            )

        to_flax = flax_layer_params

    def batches(n: int) -> list[Any]:
        kx, ky = jax.random.split(jax.random.key(1))
        x = jax.random.normal(kx, shape, jnp.float32).astype(BF16)
        return [(x, jax.random.normal(ky, shape, jnp.float32).astype(BF16))] * n

    tx = optax.sgd(LR)
    x = jax.ShapeDtypeStruct(shape, BF16)

    def fp8_init() -> Fp8TrainState:
        return Fp8TrainState.from_model(
            fp8_model, key, jnp.zeros(shape, BF16), tx=tx, recipe=RECIPE, **call
        )

    step = fp8_step(_mse, call, update)
    steps = {"fp8": with_cudnn_fp8(step, fp8_dpa), "fp8_xla": under_xla(step)}
    fp8_init = with_cudnn_fp8(fp8_init, fp8_dpa)
    init: dict[str, Callable[[], Any]] = {"fp8": fp8_init, "fp8_xla": fp8_init}
    for variant, dg in (("flax_fp8", fp8_ops.Fp8DirectDotGeneralOp), ("bf16", None)):
        model = flax_model(dg)
        steps[variant] = flax_step(model, tx, _mse, update)
        init[variant] = _flax_init(model, fp8_init, to_flax, jnp.zeros(x.shape, BF16), tx)
    tokens = shape[0] * (shape[1] if len(shape) == 3 else 1)
    return Workload(name, dict(sizes), tokens, attention, steps, init, batches)


def _gpt(
    name: str, sizes: dict[str, Any], attention: str, update: bool, dpa: dict[str, Any]
) -> Workload:
    cfg = train_gpt.Config(**sizes)
    tx = train_gpt.make_tx(cfg)
    tokens = jnp.zeros((cfg.batch, cfg.seq), jnp.int32)
    fp8_layer = functools.partial(
        TransformerLayer,
        hidden_size=cfg.hidden,
        **train_gpt.layer_config(cfg),
        **_attention_kw(attention),
        **dpa,
    )

    def fp8_init() -> Fp8TrainState:
        return Fp8TrainState.from_model(
            Gpt(cfg, fp8_layer), jax.random.key(cfg.seed), tokens, tx=tx, recipe=RECIPE
        )

    def to_flax(p: dict[str, Any]) -> dict[str, Any]:
        return {**p, "blocks": {"layer": flax_layer_params(p["blocks"]["layer"])}}

    data: dict[str, Any] = {}

    def batches(n: int) -> list[Any]:
        if "train" not in data:  # the demo's text: the standard library's sources
            max_bytes = 8_000_000 if cfg.batch * cfg.seq > 4096 else 200_000
            data["train"] = train_gpt.load_text(None, max_bytes)[0]
        return [train_gpt.batch_at(data["train"], cfg, i) for i in range(n)]

    step = fp8_step(train_gpt.loss_of, {}, update)
    dpa = bool(dpa)
    steps = {"fp8": with_cudnn_fp8(step, dpa), "fp8_xla": under_xla(step)}
    fp8_init = with_cudnn_fp8(fp8_init, dpa)
    init: dict[str, Callable[[], Any]] = {"fp8": fp8_init, "fp8_xla": fp8_init}
    for variant, dg in (("flax_fp8", fp8_ops.Fp8DirectDotGeneralOp), ("bf16", None)):
        layer = functools.partial(
            FlaxLayer,
            cfg.heads,
            cfg.mlp,
            rotary=True,
            attention=attention,
            dot_general_cls=dg,
            param_dtype=jnp.float32,
        )
        model = Gpt(cfg, layer)
        steps[variant] = flax_step(model, tx, train_gpt.loss_of, update)
        init[variant] = _flax_init(model, fp8_init, to_flax, tokens, tx)
    return Workload(name, dict(sizes), cfg.batch * cfg.seq, attention, steps, init, batches)
