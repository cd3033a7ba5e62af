"""fp8jax quickstart: TransformerEngine's FP8 tutorial, in JAX and Flax (Linen or NNX).

Run with ``python examples/quickstart.py [--api linen|nnx]`` (default ``linen``). Runs on CPU
(FP8 emulated with identical numerics) in seconds, and on an H100/Ada GPU with FP8 tensor cores.

1. A 768 -> 768 FP8 ``DenseGeneral`` on a (1024, 768) input: FP32 vs FP8 outputs.
2. The same with input and kernel made exactly representable in FP8: the difference drops to
   accumulation order (the FP8 cast was the whole difference).
3. A short jitted training loop with delayed scaling: the optimizer updates the params, the FP8
   state (amax histories, scales) is updated beside it. ``linen``: ``fp8jax.flax.DenseGeneral``
   and ``Fp8TrainState``; ``nnx``: ``fp8jax.nnx.DenseGeneral``, ``nnx.Optimizer(model, tx,
   wrt=nnx.Param)`` and ``fp8jax.nnx.apply_gradients`` in an ``nnx.jit`` step. Both APIs run
   the same math; their numbers differ a little because their params are drawn from other keys.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import fp8jax
from fp8jax.flax import DenseGeneral, Fp8TrainState
from fp8jax.recipe import DelayedScaling, Format

BATCH, HIDDEN, STEPS = 1024, 768, 20
APIS = ("linen", "nnx")


def differences(name: str, out: jax.Array, ref: jax.Array) -> float:
    diff = jnp.abs(out - ref)
    rel = float(jnp.max(diff) / jnp.max(jnp.abs(ref)))
    print(f"  {name}: max |diff| {float(jnp.max(diff)):.3e}, relative to max |out| {rel:.3e}")
    return rel


def sq_error(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.sum((out - y) ** 2, axis=-1))  # squared error per example


def linen_layer(recipe: DelayedScaling, x: jax.Array):
    """(variables, forward(x), set_kernel(f)) of a Linen layer; FP8 inside autocast."""
    layer = DenseGeneral(features=HIDDEN)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        variables = layer.init(jax.random.key(0), x)  # params + FP8 state + probes

    def set_kernel(f: Callable[[jax.Array], jax.Array]) -> None:
        nonlocal variables
        params = variables["params"]
        variables = {**variables, "params": {**params, "kernel": f(params["kernel"])}}

    return variables, lambda x: layer.apply(variables, x), set_kernel


def nnx_layer(recipe: DelayedScaling, x: jax.Array):
    """The same as an NNX module (sizes given, ``x`` unused); constructed inside autocast, it
    holds its FP8 state."""
    with fp8jax.autocast(enabled=True, recipe=recipe):
        model = fp8jax.nnx.DenseGeneral(HIDDEN, HIDDEN, rngs=nnx.Rngs(0))

    def set_kernel(f: Callable[[jax.Array], jax.Array]) -> None:
        model.kernel[...] = f(model.kernel[...])

    return nnx.to_pure_dict(nnx.state(model)), model, set_kernel  # params, fp8_meta, fp8_probe


def precision_demo(recipe: DelayedScaling, api: str) -> dict[str, float]:
    x = jax.random.uniform(jax.random.key(12345), (BATCH, HIDDEN), jnp.float32)
    variables, forward, set_kernel = {"linen": linen_layer, "nnx": nnx_layer}[api](recipe, x)
    print("variables:", jax.tree.map(jnp.shape, variables))

    out_fp32 = forward(x)  # outside autocast: plain FP32
    with fp8jax.autocast(enabled=True, recipe=recipe):
        out_fp8 = forward(x)  # FP8 GEMM, first step: every scale is 1
    print("FP8 vs FP32 (input and kernel cast to E4M3):")
    fp8 = differences("out_fp8 - out_fp32", out_fp8, out_fp32)

    e4m3 = recipe.fwd_dtype
    x_r = fp8jax.cast_to_representable(x, e4m3)
    set_kernel(lambda kernel: fp8jax.cast_to_representable(kernel, e4m3))
    out_fp32_r = forward(x_r)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        out_fp8_r = forward(x_r)
    print("FP8 vs FP32 on FP8-representable input and kernel:")
    rep = differences("out_fp8 - out_fp32_representable", out_fp8_r, out_fp32_r)
    print(
        "  (only the accumulation differs: ~1e-4 or less with float32 sums, as on CPU; up to "
        "~3e-3 on FP8 tensor cores, whose forward accumulator keeps ~14 bits)"
    )
    return {"fp8_vs_fp32": fp8, "representable": rep}


def linen_trainer(recipe: DelayedScaling, x: jax.Array):
    """(step(x, y) -> loss, fp8_meta() -> {"amax_history", "scale"}) with Fp8TrainState."""
    # The recipe is stated once: the state initialises, runs and updates the model with it.
    state = Fp8TrainState.from_model(
        DenseGeneral(features=HIDDEN), jax.random.key(2), x, tx=optax.adam(1e-2), recipe=recipe
    )

    @jax.jit
    def train_step(state: Fp8TrainState, x: jax.Array, y: jax.Array):
        def loss_fn(params, fp8_probe):
            out = state.apply(state.variables(params, fp8_probe), x)  # FP8, the state's recipe
            return sq_error(out, y)

        loss, (grads, probe_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            state.params, state.fp8_probe
        )
        # skip_if_nonfinite: a NaN/inf batch changes nothing (params, optimizer, FP8 state)
        state = state.apply_gradients(grads=grads, probe_grads=probe_grads, skip_if_nonfinite=True)
        return state, loss

    def step(x: jax.Array, y: jax.Array) -> jax.Array:
        nonlocal state
        state, loss = train_step(state, x, y)
        return loss

    return step, lambda: state.fp8_meta


def nnx_trainer(recipe: DelayedScaling, x: jax.Array):
    """The same with an NNX model (``x`` unused), nnx.Optimizer and an nnx.jit step that updates
    the model and the optimizer in place."""
    with fp8jax.autocast(enabled=True, recipe=recipe):  # creates the FP8 state (Fp8MetaVariable)
        model = fp8jax.nnx.DenseGeneral(HIDDEN, HIDDEN, rngs=nnx.Rngs(2))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)  # never sees FP8 state

    @nnx.jit
    def train_step(model, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
        with fp8jax.autocast(enabled=True, recipe=recipe):  # FP8 forward and backward
            loss, grads = nnx.value_and_grad(
                lambda model: sq_error(model(x), y), argnums=fp8jax.nnx.diff_state()
            )(model)  # params and probes: the probe gradients are the observed amaxes
        # FP8 state from the observations, then Adam on the params; a NaN/inf batch changes nothing
        fp8jax.nnx.apply_gradients(model, optimizer, grads, skip_if_nonfinite=True)
        return loss

    return (
        lambda x, y: train_step(model, optimizer, x, y),
        lambda: nnx.to_pure_dict(nnx.state(model.fp8_meta)),  # {"amax_history", "scale"}
    )


def training_demo(recipe: DelayedScaling, api: str) -> dict[str, list[float]]:
    kx, kw, kn = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (BATCH, HIDDEN), jnp.float32)
    teacher = jax.random.normal(kw, (HIDDEN, HIDDEN), jnp.float32) / HIDDEN**0.5
    y = x @ teacher + 0.01 * jax.random.normal(kn, (BATCH, HIDDEN), jnp.float32)
    step, fp8_meta = {"linen": linen_trainer, "nnx": nnx_trainer}[api](recipe, x)

    print(f"training {STEPS} jitted steps (Adam on params; FP8 state updated beside it):")
    losses = []
    for i in range(1, STEPS + 1):
        losses.append(float(step(x, y)))
        if i == 1 or i % 5 == 0:
            print(f"  step {i:2d}  loss {losses[-1]:9.3f}")
    meta = fp8_meta()
    roles = ("input", "kernel", "grad_output")
    print("final FP8 state (role: newest amax -> scale):")
    for i, role in enumerate(roles):
        amax, scale = float(meta["amax_history"][i, 0]), float(meta["scale"][i])
        print(f"  {role:<12} {amax:.4g} -> {scale:.6g}")
    return {"losses": losses, "scale": [float(s) for s in meta["scale"]]}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--api", choices=APIS, default="linen", help="Flax API of the layer (default: linen)"
    )
    args = parser.parse_args(argv)
    supported, reason = fp8jax.fp8_support()
    print(f"backend: {jax.default_backend()}, fp8_support: {supported} ({reason})")
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    print(f"recipe: {recipe}")
    if args.api != "linen":
        print(f"api: {args.api}")
    return {**precision_demo(recipe, args.api), **training_demo(recipe, args.api)}


if __name__ == "__main__":
    main()
