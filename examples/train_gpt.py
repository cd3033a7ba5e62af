"""Train a small byte-level GPT in FP8 and in BF16 on real text, and compare them.

The model is a decoder-only Transformer built from ``fp8jax.flax.TransformerLayer`` (stacked
with ``nn.scan``, causal self-attention, rotary position embeddings, tied byte embeddings). The
text is the Python standard library's own ``.py`` sources (every Python has them; split into
train and validation by file), or any file or folder given with ``--data``. Each run uses the
same initial params, seed and batch order; by default FP8 with ``DelayedScaling(HYBRID)`` and
BF16 (the same model with FP8 off), ``--recipes`` adds ``current`` (``Float8CurrentScaling``),
``block`` (``Float8BlockScaling``: DeepSeek-V3's 1 x 128 / 128 x 128 blocks), ``mxfp8``
(``MXFP8BlockScaling``: 1 x 32 blocks, E8M0 scales), ``rowwise`` and ``rowwise-gw-hp``
(``Float8RowwiseScaling``, torchao's row-wise recipes, the second with the weight gradients in
high precision; reference path only, no kernels yet: not for the MoE presets).

``--optimizer`` (comma-separated; each recipe runs with each) picks the optimizer: ``adamw``
(``optax.adamw``, float32 params and moments: 12 bytes per parameter), ``adamw_fp8``
(``fp8jax.optim.adamw``: both moments in FP8, 6.06 bytes), ``adamw_fp8_bf16`` (the same with
bfloat16 params and stochastic rounding, 4.06 bytes) and ``adamw_bf16`` (bfloat16 params,
float32 moments). A run with another optimizer than ``adamw`` is named ``recipe+optimizer``.

Writes to ``--out`` (default ``gpt_runs``): ``metrics.csv`` (per step), ``summary.json`` and
``summary.md`` (final validation loss of each run, its difference to BF16, tokens/s, device,
versions, commit), ``samples.txt`` (text each run generates), ``loss.png`` (needs matplotlib)
and an orbax checkpoint per run (``--resume`` continues from it).

``--api nnx`` runs the same demo with Flax NNX: ``fp8jax.nnx.TransformerLayer``s stacked with
``nnx.vmap`` and applied with ``nnx.scan``, an ``nnx.Optimizer``, an ``nnx.jit`` train step
(``fp8jax.nnx.diff_state``, ``fp8jax.nnx.apply_gradients``) and ``nnx.state`` checkpoints.

    python examples/train_gpt.py                      # 3-7 minutes on a 2-core CPU
    python examples/train_gpt.py --api nnx            # the same with Flax NNX modules
    python examples/train_gpt.py --preset gpu-small   # 12 layers, hidden 768, sequence 1024
    python examples/train_gpt.py --preset cpu-moe --recipes fp8,block,bf16  # 8 experts, top-2
    python examples/train_gpt.py --recipes bf16 --seed 1   # another draw, for the spread

Progress: a bar on a terminal; otherwise (CI, ``| tee``, ``nohup``) a line at every evaluation
with the losses and tokens/s. ``--help`` needs neither JAX nor fp8jax (nothing is imported).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import pathlib
import platform
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from typing import Any, NamedTuple

PRESETS = {  # layers, hidden, heads, mlp, seq, batch, steps, lr
    "cpu": dict(layers=2, hidden=128, heads=4, mlp=512, seq=128, batch=16, steps=800, lr=2e-3),
    # a mixture of experts: 8 SwiGLU experts of width 128, top-2 (an active width of 4 x
    # hidden, as "cpu"'s dense MLP), TE's load-balancing loss; smaller than "cpu" in hidden,
    # sequence and steps because XLA's CPU ragged_dot computes every expert on every row
    "cpu-moe": dict(layers=2, hidden=64, heads=4, mlp=128, seq=64, batch=16, steps=300,
                    lr=2e-3, experts=8, topk=2),
    "gpu-small": dict(layers=12, hidden=768, heads=12, mlp=3072, seq=1024, batch=32, steps=2000,
                      lr=6e-4),
    "gpu-medium": dict(layers=24, hidden=1024, heads=16, mlp=4096, seq=1024, batch=32,
                       steps=5000, lr=3e-4),
}  # fmt: skip
RECIPE_NAMES = ("fp8", "bf16", "current", "block", "mxfp8", "fp8-dpa", "rowwise", "rowwise-gw-hp")
OPTIMIZER_NAMES = ("adamw", "adamw_fp8", "adamw_bf16", "adamw_fp8_bf16")  # OPTIMIZERS below
API_NAMES = ("linen", "nnx")  # APIS below


def build_parser() -> argparse.ArgumentParser:
    """The command line (kept above the heavy imports: ``--help`` imports nothing)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="cpu")
    p.add_argument("--api", choices=list(API_NAMES), default="linen",
                   help="Flax API of the model (default: linen)")  # fmt: skip
    p.add_argument("--recipes", default="fp8,bf16",
                   help="comma-separated, of: " + ", ".join(RECIPE_NAMES))  # fmt: skip
    p.add_argument("--optimizer", default="adamw",
                   help="comma-separated, of: " + ", ".join(OPTIMIZER_NAMES))  # fmt: skip
    p.add_argument("--steps", type=int, help="override the preset's step count")
    p.add_argument("--seed", type=int, default=0,
                   help="initial params and batch order (default 0)")  # fmt: skip
    p.add_argument("--data", help="a text file or a folder (default: the stdlib's .py files)")
    p.add_argument("--max-bytes", type=int, default=8_000_000)
    p.add_argument("--out", default="gpt_runs")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoints")
    return p


if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    build_parser().parse_args()  # prints the usage and exits

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fp8jax
from fp8jax import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    Format,
    MXFP8BlockScaling,
)
from fp8jax.flax import Fp8TrainState, TransformerLayer
from fp8jax.layers import MoEBlockConfig

RECIPES = {
    "fp8": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max"),
    "bf16": None,
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    # "fp8" with FP8 attention too (TransformerLayer(fp8_dpa=True): E4M3 Q, K, V, P, O and
    # gradients; cuDNN's FP8 attention on a GPU, its reference on CPU)
    "fp8-dpa": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16,
                              amax_compute_algo="max"),
    "rowwise": Float8RowwiseScaling(),
    "rowwise-gw-hp": Float8RowwiseScaling(wgrad_high_precision=True),
}  # fmt: skip
#: The recipes whose runs set ``fp8_dpa`` on the layers.
FP8_DPA_RECIPES = ("fp8-dpa",)
#: optimizer -> (FP8 moments? None: optax.adamw itself, dtype of the params)
OPTIMIZERS = {
    "adamw": (None, jnp.float32),
    "adamw_fp8": (True, jnp.float32),
    "adamw_bf16": (False, jnp.bfloat16),
    "adamw_fp8_bf16": (True, jnp.bfloat16),
}
REMAT_POLICIES = {  # what a layer keeps for the backward under nn.remat (None: no remat)
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "fp8": fp8jax.save_fp8_operands,  # the FP8 operands of the backward GEMMs, by name
}


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int
    hidden: int
    heads: int
    mlp: int
    seq: int
    batch: int
    steps: int
    lr: float
    eval_every: int = 25
    eval_batches: int = 16
    seed: int = 0
    experts: int = 0  # > 0: every MLP is a mixture of experts (fp8jax.flax.MoEBlock)
    topk: int = 2
    optimizer: str = "adamw"  # a key of OPTIMIZERS
    remat: str = "none"  # a key of REMAT_POLICIES (Linen)
    fp8_dpa: bool = False  # FP8 attention (a run of FP8_DPA_RECIPES)


# ------------------------------------------------------------------------------------- data


def load_text(path: str | None, max_bytes: int) -> tuple[np.ndarray, np.ndarray, str]:
    """``(train bytes, validation bytes, description)``: every 10th file (sorted by path) goes
    to validation; a single file is split 90/10 instead."""
    root = pathlib.Path(path) if path else pathlib.Path(sysconfig.get_paths()["stdlib"])
    if not root.exists():
        raise SystemExit(f"--data: {root} does not exist")
    if root.is_file():
        data = root.read_bytes()[:max_bytes]
        cut = int(len(data) * 0.9)
        return _bytes(data[:cut]), _bytes(data[cut:]), str(root)
    pattern = "*.py" if path is None else "*"
    files = sorted(p for p in root.rglob(pattern) if p.is_file() and "test" not in p.parts)
    train, val, size = [], [], 0
    for i, f in enumerate(files):
        if size >= max_bytes:
            break
        data = f.read_bytes()
        (val if i % 10 == 9 else train).append(data)
        size += len(data)
    if not train or not val:
        raise SystemExit(f"--data: not enough files under {root}")
    desc = f"{root} ({len(train)} train / {len(val)} validation files, {size / 1e6:.1f} MB)"
    return _bytes(b"\n".join(train)), _bytes(b"\n".join(val)), desc


def _bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8).astype(np.int32)


def batch_at(data: np.ndarray, cfg: Config, step: int, salt: int = 0) -> tuple[Any, Any]:
    """Random windows of ``seq + 1`` bytes, the same for every run at a given step."""
    rng = np.random.default_rng((cfg.seed, salt, step))
    starts = rng.integers(0, len(data) - cfg.seq - 1, cfg.batch)
    windows = np.stack([data[s : s + cfg.seq + 1] for s in starts])
    return jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])


# ------------------------------------------------------------------------------------ model


AUX_LOSS_COEFF = 0.01  # the MoE presets' load-balancing loss (TE's aux_loss_coeff)


def layer_config(cfg: Config) -> dict:
    """The ``TransformerLayer`` arguments besides ``hidden_size`` (Linen and NNX alike)."""
    moe = {}
    if cfg.experts:
        moe = dict(mlp="moe", moe=MoEBlockConfig(
            num_experts=cfg.experts, num_experts_per_tok=cfg.topk, intermediate_size=cfg.mlp,
            activation_type="silu", aux_loss_coeff=AUX_LOSS_COEFF,
        ))  # fmt: skip
    return dict(
        mlp_hidden_size=cfg.mlp, num_attention_heads=cfg.heads, hidden_dropout=0.0,
        attention_dropout=0.0, intermediate_dropout=0.0, self_attn_mask_type="causal",
        enable_relative_embedding=False, enable_rotary_pos_emb=True, mlp_activations=("gelu",),
        dtype=jnp.bfloat16, **moe, **({"fp8_dpa": True} if cfg.fp8_dpa else {}),
    )  # fmt: skip


class _Block(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x, _):
        layer = TransformerLayer(hidden_size=self.cfg.hidden, **layer_config(self.cfg),
                                 name="layer")  # fmt: skip
        return layer(x, deterministic=True), None


class GPT(nn.Module):
    """Byte embedding -> ``layers`` scanned ``TransformerLayer``s -> norm -> tied logits."""

    cfg: Config

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(256, self.cfg.hidden, embedding_init=nn.initializers.normal(0.02))
        x = embed(tokens).astype(jnp.bfloat16)
        block = _Block
        if (policy := REMAT_POLICIES[self.cfg.remat]) is not None:
            block = nn.remat(_Block, policy=policy, prevent_cse=False)
        blocks = nn.scan(
            block,
            variable_axes={"params": 0, "fp8_meta": 0, "fp8_probe": 0, "intermediates": 0},
            split_rngs={"params": True}, length=self.cfg.layers,
        )  # fmt: skip
        x, _ = blocks(self.cfg, name="blocks")(x, None)
        x = nn.LayerNorm(dtype=jnp.float32)(x)
        return embed.attend(x.astype(jnp.float32))


class NnxGPT(nnx.Module):
    """:class:`GPT` in Flax NNX: the layers stacked by ``nnx.vmap``, applied by ``nnx.scan``."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        if cfg.remat != "none":
            raise ValueError(f"remat={cfg.remat!r}: the NNX model of the demo has no remat")
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(256, cfg.hidden, embedding_init=init, rngs=rngs)

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs):  # FP8 state (if any) gets the layer axis too
            return fp8jax.nnx.TransformerLayer(cfg.hidden, **layer_config(cfg), rngs=rngs)

        self.layers = make_layers(rngs)
        self.norm = nnx.LayerNorm(cfg.hidden, dtype=jnp.float32, rngs=rngs)

    def __call__(self, tokens):
        return self.forward_with_aux(tokens)[0]

    def forward_with_aux(self, tokens):
        """The logits and the MoE layers' load-balancing losses, summed (0 for a dense model):
        each layer's losses, sown by its ``MoEBlock`` as ``nnx.Intermediate``, are collected
        by ``nnx.capture`` inside the scan and leave it as a scan output (the Linen model's
        ``intermediates``, scanned along the layers)."""

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def blocks(x, layer):
            x, sown = nnx.capture(layer, nnx.Intermediate)(x, deterministic=True)
            return x, sum((jnp.sum(v) for v in jax.tree.leaves(sown)), jnp.zeros(()))

        x, aux = blocks(self.embed(tokens).astype(jnp.bfloat16), self.layers)
        return self.embed.attend(self.norm(x).astype(jnp.float32)), jnp.sum(aux)


def loss_of(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_tx(cfg: Config) -> optax.GradientTransformation:
    """Clipping, then AdamW: ``optax.adamw`` or ``fp8jax.optim.adamw`` (``cfg.optimizer``)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(1, cfg.steps // 10),
                                                  cfg.steps, cfg.lr / 10)  # fmt: skip
    fp8_moments, _ = OPTIMIZERS[cfg.optimizer]
    if fp8_moments is None:
        adam = optax.adamw(schedule, weight_decay=0.1)
    else:
        adam = fp8jax.optim.adamw(schedule, weight_decay=0.1, fp8_moments=fp8_moments,
                                  seed=cfg.seed)  # fmt: skip
    return optax.chain(optax.clip_by_global_norm(1.0), adam)


def param_dtype(cfg: Config) -> Any:
    """The dtype the params are kept in (float32, or bfloat16 with no float32 copy)."""
    return OPTIMIZERS[cfg.optimizer][1]


# ------------------------------------------------------------------------------------- APIs


class Api(NamedTuple):
    """What differs between the Flax APIs. The train state is opaque to the rest of the file:
    ``train_step(state, tokens, targets) -> (state, loss)``, ``eval_loss(state, tokens,
    targets)``, ``logits_at(state, tokens, pos)`` (the logits of row 0 at ``pos``)."""

    init: Callable[[Config, Any], Any]  # (cfg, recipe) -> the initial state
    steps: Callable[[Any], tuple[Callable, Callable, Callable]]  # recipe -> the three above
    step: Callable[[Any], int]  # optimizer steps taken (skipped non-finite steps not counted)
    saved: Callable[[Any], Any]  # the pytree a checkpoint holds
    load: Callable[[Any, Any], Any]  # (state, restored pytree) -> state


def init_linen_state(cfg: Config, recipe) -> Fp8TrainState:
    """The same initial params for every run (FP8 state, if any, from the recipe)."""
    tokens = jnp.zeros((cfg.batch, cfg.seq), jnp.int32)
    # the FP8 layers init their params the same way with FP8 on or off
    state = Fp8TrainState.from_model(
        GPT(cfg), jax.random.key(cfg.seed), tokens, tx=make_tx(cfg),
        recipe=recipe or DelayedScaling(amax_history_len=1),
    )  # fmt: skip
    if param_dtype(cfg) == jnp.float32:
        return state
    params = jax.tree.map(lambda p: p.astype(param_dtype(cfg)), state.params)
    return state.replace(params=params, opt_state=state.tx.init(params))


def linen_steps(recipe):
    enabled = recipe is not None

    def forward(state, params, probes, tokens):
        with fp8jax.autocast(enabled=enabled, recipe=recipe):
            return state.apply_fn(state.variables(params, probes), tokens)

    def forward_with_aux(state, params, probes, tokens):
        """The logits and the MoE layers' load-balancing losses (0 for a dense model)."""
        with fp8jax.autocast(enabled=enabled, recipe=recipe):
            logits, sown = state.apply_fn(state.variables(params, probes), tokens,
                                          mutable=["intermediates"])  # fmt: skip
        aux = sum(jnp.sum(v) for v in jax.tree.leaves(sown.get("intermediates", {})))
        return logits, aux

    @jax.jit
    def train_step(state, tokens, targets):
        def f(params, probes):
            logits, aux = forward_with_aux(state, params, probes, tokens)
            return loss_of(logits, targets) + aux

        loss, (g, pg) = jax.value_and_grad(f, argnums=(0, 1))(state.params, state.fp8_probe)
        return state.apply_gradients(grads=g, probe_grads=pg, skip_if_nonfinite=True), loss

    @jax.jit
    def eval_loss(state, tokens, targets):
        return loss_of(forward(state, state.params, state.fp8_probe, tokens), targets)

    @jax.jit
    def logits_at(state, tokens, pos):
        return forward(state, state.params, state.fp8_probe, tokens)[0, pos]

    return train_step, eval_loss, logits_at


class NnxState(NamedTuple):
    model: NnxGPT
    optimizer: nnx.Optimizer


def init_nnx_state(cfg: Config, recipe) -> NnxState:
    """The same initial params for every run: constructed inside ``autocast`` the layers also
    hold delayed-scaling FP8 state; BF16 and current scaling construct them without."""
    with fp8jax.autocast(enabled=recipe is not None, recipe=recipe):
        model = NnxGPT(cfg, rngs=nnx.Rngs(cfg.seed))
    if param_dtype(cfg) != jnp.float32:
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p: p.astype(param_dtype(cfg)), params))
    return NnxState(model, nnx.Optimizer(model, make_tx(cfg), wrt=nnx.Param))


def nnx_steps(recipe):
    def fp8():
        return fp8jax.autocast(enabled=recipe is not None, recipe=recipe)

    @nnx.jit
    def train(model, optimizer, tokens, targets):
        def f(model):
            logits, aux = model.forward_with_aux(tokens)
            return loss_of(logits, targets) + aux

        with fp8():  # params and probes (a model without FP8 state has none: params only)
            loss, grads = nnx.value_and_grad(f, argnums=fp8jax.nnx.diff_state())(model)
        fp8jax.nnx.apply_gradients(model, optimizer, grads, skip_if_nonfinite=True)
        return loss

    @nnx.jit
    def forward(model, tokens):
        with fp8():
            return model(tokens)

    def train_step(state, tokens, targets):  # updates the model and optimizer in place
        return state, train(*state, tokens, targets)

    def eval_loss(state, tokens, targets):
        return loss_of(forward(state.model, tokens), targets)

    def logits_at(state, tokens, pos):
        return forward(state.model, tokens)[0, pos]

    return train_step, eval_loss, logits_at


def nnx_load(state: NnxState, restored: dict) -> NnxState:
    nnx.update(state.model, restored["model"])
    nnx.update(state.optimizer, restored["optimizer"])
    return state


APIS = {
    "linen": Api(init_linen_state, linen_steps, lambda s: int(s.step), lambda s: s, lambda _, r: r),
    "nnx": Api(
        init_nnx_state, nnx_steps, lambda s: int(s.optimizer.step[...]),
        lambda s: {"model": nnx.state(s.model), "optimizer": nnx.state(s.optimizer)}, nnx_load,
    ),
}  # fmt: skip


# ------------------------------------------------------------------------------------ runs


def sample(state, logits_at, cfg: Config, prompt: bytes, n: int, seed: int) -> str:
    """``n`` bytes after ``prompt`` (temperature 0.8), a full forward per byte (no cache)."""
    buf = np.zeros((1, cfg.seq), np.int32)
    text = list(prompt[-cfg.seq :])
    rng = np.random.default_rng(seed)
    for _ in range(n):
        window = text[-cfg.seq :]
        buf[0, : len(window)] = window
        logits = np.asarray(logits_at(state, jnp.asarray(buf), len(window) - 1), np.float64)
        p = np.exp((logits - logits.max()) / 0.8)
        text.append(int(rng.choice(256, p=p / p.sum())))
    return bytes(text[len(prompt[-cfg.seq :]) :]).decode("utf-8", errors="replace")


def restore(impl: Api, state, ckpt: pathlib.Path):
    """``state`` (a freshly built one) with the values of the orbax checkpoint ``ckpt``."""
    import orbax.checkpoint as ocp

    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, impl.saved(state))
    return impl.load(state, ocp.StandardCheckpointer().restore(ckpt, target))


def run(name, recipe, cfg, train, val, out: pathlib.Path, resume: bool, progress,
        api: str = "linen", log: Callable[[str], None] = print) -> dict:  # fmt: skip
    """Trains one run; ``log`` prints the progress lines (compile notice, every evaluation)."""
    import orbax.checkpoint as ocp

    impl = APIS[api]
    state = impl.init(cfg, recipe)
    tag = name if api == "linen" else f"{api}-{name}"  # the checkpoints differ by API
    ckpt = (out / "checkpoints" / tag).absolute()
    history: list[dict] = []
    if resume and ckpt.exists():
        state = restore(impl, state, ckpt)
        history = json.loads((out / "checkpoints" / f"{tag}.json").read_text())
    train_step, eval_loss, logits_at = impl.steps(recipe)
    tokens_per_step = cfg.batch * cfg.seq
    start = impl.step(state)
    task = progress.add_task(name, total=cfg.steps, completed=start, info="")
    t0, timed = None, 0
    for step in range(start, cfg.steps):
        if step == start:
            log(f"{name}: compiling the train step (the first step takes a while)")
            progress.update(task, info="compiling the train step")
            compile_start = time.perf_counter()
        state, loss = train_step(state, *batch_at(train, cfg, step))
        loss = float(loss)
        if step == start:  # the first step compiles
            t0 = time.perf_counter()
            log(f"{name}: compiled and ran step {step + 1} in {t0 - compile_start:.1f} s")
        else:
            timed += 1
        tps = timed * tokens_per_step / max(time.perf_counter() - t0, 1e-9) if timed else 0.0
        row = {"run": name, "step": step + 1, "train_loss": loss, "val_loss": "",
               "tokens_per_s": round(tps, 1)}  # fmt: skip
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            vals = [float(eval_loss(state, *batch_at(val, cfg, i, salt=1)))
                    for i in range(cfg.eval_batches)]  # fmt: skip
            row["val_loss"] = float(np.mean(vals))
            log(f"{name}: step {step + 1}/{cfg.steps}  train loss {loss:.4f}  validation loss "
                f"{row['val_loss']:.4f}  {tps:,.0f} tokens/s")  # fmt: skip
        history.append(row)
        progress.update(task, advance=1, info=f"loss {loss:.3f}  {tps:,.0f} tok/s")
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(ckpt, impl.saved(state), force=True)
    checkpointer.wait_until_finished()
    (out / "checkpoints" / f"{tag}.json").write_text(json.dumps(history))
    prompt = b"def "
    text = sample(state, logits_at, cfg, prompt, 80, cfg.seed)
    return {"history": history, "sample": prompt.decode() + text, "peak_bytes": _peak_bytes(),
            "optimizer": cfg.optimizer}  # fmt: skip


def _peak_bytes() -> int | None:
    """Peak device memory so far, where the backend reports it (GPUs; not the CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


# --------------------------------------------------------------------------------- reports


def final_val(history: list[dict]) -> float:
    return next(float(r["val_loss"]) for r in reversed(history) if r["val_loss"] != "")


def environment() -> dict:
    here = pathlib.Path(__file__).parent
    try:
        git = ["git", "rev-parse", "--short", "HEAD"]
        commit = subprocess.run(git, capture_output=True, text=True, cwd=here).stdout.strip()
    except OSError:
        commit = ""
    return {
        "device": str(jax.devices()[0].device_kind),
        "platform": jax.default_backend(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "fp8jax": getattr(fp8jax, "__version__", ""),
        "commit": commit or "unknown",
    }


def write_reports(out: pathlib.Path, results: dict, cfg: Config, data_desc: str,
                  api: str = "linen") -> dict:  # fmt: skip
    rows = [r for res in results.values() for r in res["history"]]
    with open(out / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    base = final_val(results["bf16"]["history"]) if "bf16" in results else None
    runs = {}
    for name, res in results.items():
        v = final_val(res["history"])
        tps = [r["tokens_per_s"] for r in res["history"] if r["tokens_per_s"]]
        runs[name] = {
            "final_val_loss": round(v, 4),
            "vs_bf16": None if base is None else round((v - base) / base, 4),
            "tokens_per_s": tps[-1] if tps else None,
            "optimizer": res.get("optimizer", "adamw"),
            # cumulative over the runs of this process (the device's peak so far)
            "peak_bytes": res.get("peak_bytes"),
        }
    summary = {"runs": runs, "api": api, "config": dataclasses.asdict(cfg), "data": data_desc,
               **environment()}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    lines = ["| run | final val loss | vs BF16 | tokens/s |", "|---|---|---|---|"]
    for name, r in runs.items():
        rel = "" if r["vs_bf16"] is None else f"{100 * r['vs_bf16']:+.2f}%"
        lines.append(f"| {name} | {r['final_val_loss']:.4f} | {rel} | {r['tokens_per_s']} |")
    env = environment()
    lines.append(f"\n{env['device']} ({env['platform']}), JAX {env['jax']}, commit "
                 f"{env['commit']}; data: {data_desc}")  # fmt: skip
    if api != "linen":
        lines.append(f"API: flax {api}")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "samples.txt").write_text(
        "".join(f"== {name}\n{res['sample']}\n\n" for name, res in results.items())
    )
    plot(out, results)
    return summary


def plot(out: pathlib.Path, results: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("loss.png skipped: matplotlib is not installed (pip install fp8jax[demo])")
        return
    # Top: the loss curves (FP8 and BF16 agree so closely that one hides the other); bottom:
    # each run's validation loss relative to BF16's at the same step, which shows the gap.
    fig, (ax, gap) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                  gridspec_kw={"height_ratios": (2, 1)})  # fmt: skip
    vals = {}
    for name, res in results.items():
        h = res["history"]
        ax.plot([r["step"] for r in h], [r["train_loss"] for r in h], alpha=0.35,
                label=f"{name} train")  # fmt: skip
        vals[name] = dict((r["step"], r["val_loss"]) for r in h if r["val_loss"] != "")
        ax.plot(*zip(*vals[name].items(), strict=True), marker="o", label=f"{name} validation")
    ax.set_ylabel("loss (nats per byte)")
    ax.legend()
    ax.grid(alpha=0.3)
    base = vals.get("bf16")
    for name, v in vals.items():
        if base is None or name == "bf16":
            continue
        steps = [s for s in v if s in base]
        gap.plot(steps, [100 * (v[s] - base[s]) / base[s] for s in steps], marker="o",
                 label=f"{name} - bf16")  # fmt: skip
    gap.axhline(0.0, color="gray", linewidth=0.8)
    gap.set_xlabel("step")
    gap.set_ylabel("validation vs BF16 (%)")
    if gap.lines[:-1]:
        gap.legend()
    gap.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)


def main(argv: list[str] | None = None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if bad := [r for r in recipes if r not in RECIPES]:
        p.error(f"--recipes: unknown {bad}; choose from {list(RECIPES)}")
    optimizers = [o.strip() for o in args.optimizer.split(",") if o.strip()]
    if bad := [o for o in optimizers if o not in OPTIMIZERS]:
        p.error(f"--optimizer: unknown {bad}; choose from {list(OPTIMIZERS)}")
    preset = dict(PRESETS[args.preset])
    if args.steps is not None:
        preset["steps"] = args.steps
    cfg = Config(**preset, eval_every=max(1, min(50, preset["steps"] // 4)), seed=args.seed)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, val, desc = load_text(args.data, args.max_bytes)
    print(f"data: {desc}\nmodel: {cfg}\ndevice: {jax.devices()[0].device_kind}")
    if args.api != "linen":
        print(f"api: {args.api}")

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    results = {}
    columns = (TextColumn("{task.description:>8}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"))  # fmt: skip
    tty = sys.stdout.isatty()
    with Progress(*columns, disable=not tty) as progress:
        # on a terminal the lines go above the bar; in a log (CI, | tee, nohup) they are the
        # progress report, flushed at once
        log = progress.console.print if tty else (lambda msg: print(msg, flush=True))
        for opt in optimizers:
            for recipe in recipes:
                name = recipe if opt == "adamw" else f"{recipe}+{opt}"
                run_cfg = dataclasses.replace(cfg, optimizer=opt,
                                              fp8_dpa=recipe in FP8_DPA_RECIPES)  # fmt: skip
                results[name] = run(name, RECIPES[recipe], run_cfg, train, val, out, args.resume,
                                    progress, args.api, log)  # fmt: skip
    summary = write_reports(out, results, cfg, desc, args.api)
    print((out / "summary.md").read_text())
    print(
        f"wrote {out}/: metrics.csv, summary.json, summary.md, samples.txt, loss.png, checkpoints"
    )
    return summary


if __name__ == "__main__":
    main()
