"""fp8jax on a 2-D device mesh: data parallel x tensor parallel FP8 training of an MLP block.

Run ``python examples/parallel_train.py --dp 2 --tp 4``. On a machine without GPUs the script
asks XLA for ``dp * tp`` emulated CPU devices itself (``--xla_force_host_platform_device_count``,
which only affects the CPU platform); on a host with ``dp * tp`` GPUs it runs unchanged.

The model is ``DenseGeneral(embed -> mlp)`` (column parallel: kernel split over ``model`` on
``mlp``), gelu, ``DenseGeneral(mlp -> embed)`` (row parallel: kernel split over ``model`` on
``mlp``, output summed over ``model``), with logical axis names mapped onto the mesh by
``fp8jax.flax.DEFAULT_RULES`` (batch -> data, mlp -> model). ``--fsdp`` also splits the
kernels over ``data`` on ``embed`` (fully sharded data parallel: each kernel is gathered once per
step, in FP8). The FP8 state is replicated; the amaxes of split tensors are max-reduced across
the mesh in one all-reduce per step, so every device computes the same scales.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=2, help="data-parallel mesh axis size")
    parser.add_argument("--tp", type=int, default=4, help="tensor-parallel mesh axis size")
    parser.add_argument(
        "--fsdp", action="store_true", help="also shard the kernels over data (on embed)"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16, help="global batch (divisible by dp)")
    parser.add_argument("--length", type=int, default=8)
    parser.add_argument("--embed", type=int, default=64)
    parser.add_argument("--mlp", type=int, default=256, help="MLP width (divisible by tp)")
    parser.add_argument("--lr", type=float, default=0.01)
    return parser.parse_args(argv)


if __name__ == "__main__":  # before JAX starts: enough host devices for a CPU-only run
    _args = parse_args()
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        _n = _args.dp * _args.tp
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count={_n}".strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax.flax import DEFAULT_RULES, DenseGeneral, Fp8TrainState  # noqa: E402
from fp8jax.recipe import DelayedScaling, Format  # noqa: E402


class MlpBlock(nn.Module):
    """x [batch, length, embed] -> [batch, length, embed] through an ``mlp``-wide hidden layer."""

    embed: int
    mlp: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = DenseGeneral(
            features=self.mlp,
            kernel_axes=("embed", "mlp"),
            bias_axes=("mlp",),
            output_axes=("batch", "length", "mlp"),
            name="wi",
        )(x)
        h = nn.gelu(h)
        return DenseGeneral(
            features=self.embed,
            kernel_axes=("mlp", "embed"),
            bias_axes=("embed",),
            output_axes=("batch", "length", "embed"),
            name="wo",
        )(h)


def main(argv: list[str] | None = None) -> list[float]:
    """Trains ``--steps`` steps on a ``(dp, tp)`` mesh; returns the losses."""
    args = parse_args(argv)
    n = args.dp * args.tp
    if jax.device_count() < n:
        sys.exit(
            f"--dp {args.dp} --tp {args.tp} needs {n} devices, found {jax.device_count()} "
            f"({jax.default_backend()}); on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX starts"
        )
    if args.batch % args.dp or args.mlp % args.tp:
        sys.exit("--batch must be divisible by --dp and --mlp by --tp")
    # jax.make_mesh gives explicit axes (shardings are part of the array types); fp8jax works
    # the same with automatic axes (jax.sharding.Mesh(devices, names)).
    mesh = jax.make_mesh((args.dp, args.tp), ("data", "model"), devices=jax.devices()[:n])
    print(f"mesh: {dict(mesh.shape)} on {jax.default_backend()}")
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)
    model = MlpBlock(embed=args.embed, mlp=args.mlp)

    kx, kw = jax.random.split(jax.random.key(0))
    shape = (args.batch, args.length, args.embed)
    target_w = jax.random.normal(kw, (args.embed, args.embed)) / np.sqrt(args.embed)

    def batch(step: int) -> tuple[jax.Array, jax.Array]:
        x = jax.random.normal(jax.random.fold_in(kx, step), shape)
        return x, jnp.tanh(x @ target_w)

    with fp8jax.autocast(enabled=True, recipe=recipe):
        boxed = model.init(jax.random.key(1), batch(0)[0])  # params annotated with axis names
    state = Fp8TrainState.from_variables(
        apply_fn=model.apply, variables=nn.unbox(boxed), tx=optax.adam(args.lr), recipe=recipe
    )
    rules = DEFAULT_RULES
    if args.fsdp:  # embed -> data instead of replicated
        rules = tuple((name, "data" if name == "embed" else axis) for name, axis in rules)
    with nn.logical_axis_rules(rules):
        param_sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh)
    replicated = NamedSharding(mesh, P())
    # params per the rules; optimizer moments like their params; FP8 state and step replicated
    shardings = state.replace(
        step=replicated,
        params=param_sharding["params"],
        fp8_meta=jax.tree.map(lambda _: replicated, state.fp8_meta),
        fp8_probe=jax.tree.map(lambda _: replicated, state.fp8_probe),
        opt_state=optax.tree_map_params(
            state.tx,
            lambda _, s: s,
            state.opt_state,
            param_sharding["params"],
            transform_non_params=lambda _: replicated,
        ),
    )
    state = jax.device_put(state, shardings)
    data = NamedSharding(mesh, P("data"))

    def train_step(state, x, y):
        def loss_fn(params, probes):
            out = state.apply(state.variables(params, probes), x)  # FP8 under state.recipe
            return jnp.mean((out - y) ** 2)

        with nn.logical_axis_rules(rules):
            loss, (grads, probe_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
                state.params, state.fp8_probe
            )
        return state.apply_gradients(grads=grads, probe_grads=probe_grads), loss

    step_fn = jax.jit(train_step, out_shardings=(shardings, replicated))
    losses = []
    with jax.set_mesh(mesh):
        for i in range(args.steps):
            x, y = jax.device_put(batch(i), data)
            state, loss = step_fn(state, x, y)
            losses.append(float(loss))
            print(f"step {i + 1:3d}  loss {losses[-1]:.5f}")
    scale = state.fp8_meta["wi"]["scale"]
    if any(not np.array_equal(s.data, scale.addressable_shards[0].data)
           for s in scale.addressable_shards):  # fmt: skip
        raise RuntimeError("the devices disagree on the FP8 scales")
    print(f"wi kernel sharding: {state.params['wi']['kernel'].sharding.spec}")
    print(f"wi FP8 scales (input, kernel, grad), same on all {n} devices: {np.asarray(scale)}")
    return losses


if __name__ == "__main__":
    main()
