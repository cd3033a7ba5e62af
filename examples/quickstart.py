"""fp8jax quickstart: TransformerEngine's FP8 tutorial, in JAX and Flax.

Run with ``bash tools/demo.sh`` (sets up .venv) or ``python examples/quickstart.py``. Runs on CPU
(FP8 emulated with identical numerics) in seconds, and on an H100/Ada GPU with FP8 tensor cores.

1. A 768 -> 768 ``fp8jax.flax.DenseGeneral`` on a (1024, 768) input: FP32 vs FP8 outputs.
2. The same with input and kernel made exactly representable in FP8: the difference drops to
   accumulation order (the FP8 cast was the whole difference).
3. A short jitted training loop with delayed scaling and ``Fp8TrainState``: the optimizer updates
   the params, the FP8 state (amax histories, scales) is updated functionally beside it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import fp8jax
from fp8jax.flax import DenseGeneral, Fp8TrainState
from fp8jax.recipe import DelayedScaling, Format

BATCH, HIDDEN, STEPS = 1024, 768, 20


def differences(name: str, out: jax.Array, ref: jax.Array) -> None:
    diff = jnp.abs(out - ref)
    rel = float(jnp.max(diff) / jnp.max(jnp.abs(ref)))
    print(f"  {name}: max |diff| {float(jnp.max(diff)):.3e}, relative to max |out| {rel:.3e}")


def precision_demo(recipe: DelayedScaling) -> None:
    layer = DenseGeneral(features=HIDDEN)
    x = jax.random.uniform(jax.random.key(12345), (BATCH, HIDDEN), jnp.float32)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        variables = layer.init(jax.random.key(0), x)  # params + FP8 state + probes
    print("variables:", jax.tree.map(jnp.shape, variables))

    out_fp32 = layer.apply(variables, x)  # outside autocast: plain FP32
    with fp8jax.autocast(enabled=True, recipe=recipe):
        out_fp8 = layer.apply(variables, x)  # FP8 GEMM, first step: every scale is 1
    print("FP8 vs FP32 (input and kernel cast to E4M3):")
    differences("out_fp8 - out_fp32", out_fp8, out_fp32)

    e4m3 = recipe.fwd_dtype
    x_r = fp8jax.cast_to_representable(x, e4m3)
    params = variables["params"]
    params_r = {**params, "kernel": fp8jax.cast_to_representable(params["kernel"], e4m3)}
    variables_r = {**variables, "params": params_r}
    out_fp32_r = layer.apply(variables_r, x_r)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        out_fp8_r = layer.apply(variables_r, x_r)
    print("FP8 vs FP32 on FP8-representable input and kernel:")
    differences("out_fp8 - out_fp32_representable", out_fp8_r, out_fp32_r)
    print("  (only the summation order differs: ~1e-4 or less, as in the TE tutorial)")


def training_demo(recipe: DelayedScaling) -> None:
    layer = DenseGeneral(features=HIDDEN)
    kx, kw, kn = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (BATCH, HIDDEN), jnp.float32)
    teacher = jax.random.normal(kw, (HIDDEN, HIDDEN), jnp.float32) / HIDDEN**0.5
    y = x @ teacher + 0.01 * jax.random.normal(kn, (BATCH, HIDDEN), jnp.float32)
    # The recipe is stated once: the state initialises, runs and updates the model with it.
    state = Fp8TrainState.from_model(
        layer, jax.random.key(2), x, tx=optax.adam(1e-2), recipe=recipe
    )

    @jax.jit
    def train_step(state: Fp8TrainState, x: jax.Array, y: jax.Array):
        def loss_fn(params, fp8_probe):
            out = state.apply(state.variables(params, fp8_probe), x)  # FP8, the state's recipe
            return jnp.mean(jnp.sum((out - y) ** 2, axis=-1))  # squared error per example

        loss, (grads, probe_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            state.params, state.fp8_probe
        )
        # skip_if_nonfinite: a NaN/inf batch changes nothing (params, optimizer, FP8 state)
        state = state.apply_gradients(grads=grads, probe_grads=probe_grads, skip_if_nonfinite=True)
        return state, loss

    print(f"training {STEPS} jitted steps (Adam on params; FP8 state updated beside it):")
    for step in range(1, STEPS + 1):
        state, loss = train_step(state, x, y)
        if step == 1 or step % 5 == 0:
            print(f"  step {step:2d}  loss {float(loss):9.3f}")
    meta = state.fp8_meta
    roles = ("input", "kernel", "grad_output")
    print("final FP8 state (role: newest amax -> scale):")
    for i, role in enumerate(roles):
        amax, scale = float(meta["amax_history"][i, 0]), float(meta["scale"][i])
        print(f"  {role:<12} {amax:.4g} -> {scale:.6g}")


def main() -> None:
    supported, reason = fp8jax.fp8_support()
    print(f"backend: {jax.default_backend()}, fp8_support: {supported} ({reason})")
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    print(f"recipe: {recipe}")
    precision_demo(recipe)
    training_demo(recipe)


if __name__ == "__main__":
    main()
