"""Long-context FP8 training with context parallelism: a sequence one device's memory budget
cannot hold, trained on 8 devices that each hold an eighth of it.

Run ``python examples/long_context.py``. On a machine without 8 GPUs the script asks XLA for 8
emulated CPU devices itself (``--xla_force_host_platform_device_count=8``; set ``XLA_FLAGS``
yourself to override). It takes 30-40 s on 2 CPU cores.

The model is an embedding, two causal ``fp8jax.flax.TransformerLayer``s (FP8, delayed scaling)
and an output head. The mesh is one ``context`` axis of 8 devices: every activation is split
along the sequence (logical axis ``length`` -> ``context``), the attention runs the ring strategy
(keys and values travel round the devices block by block, nothing ``[S, S]`` exists anywhere),
and the batch is in TransformerEngine's causal load-balancing order (DualChunkSwap).

1. **Memory**: the per-device budget is ``--budget-mb``. The script compiles the same train step
   for one device and for the 8-device mesh at ``--length`` tokens and reads XLA's
   ``memory_analysis()`` of each: arguments + outputs + temporaries - aliased (donated) bytes,
   per device. One device's step needs more than the budget (its attention holds ``[S, S]``
   logits and probabilities); each of the 8 devices needs less.
2. **Training**: a few Adam steps on the 8 devices on a repeated pattern (a fixed cycle through
   the vocabulary, from a random start): the loss starts at ``log(vocab)`` (the head is zero at
   first) and falls more than 4x.

Exits non-zero if either claim fails.
"""

from __future__ import annotations

import argparse
import os
import sys

DEVICES = 8

if __name__ == "__main__":  # before JAX starts: enough host devices for a CPU-only run
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        _flag = f"--xla_force_host_platform_device_count={DEVICES}"
        os.environ["XLA_FLAGS"] = f"{_flags} {_flag}".strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax.flax import Fp8TrainState, TransformerLayer, TransformerLayerType  # noqa: E402
from fp8jax.recipe import DelayedScaling, Format  # noqa: E402

AXIS = "context"
RULES = (("length", AXIS),)  # logical axis -> mesh axis; everything else is replicated
BALANCE = fp8jax.ReorderStrategy.DualChunkSwap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--budget-mb", type=float, default=32.0, help="per-device budget, MiB")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    return parser.parse_args(argv)


class LongContextLM(nn.Module):
    """tokens [batch, length] -> logits [batch, length, vocab]."""

    vocab: int
    hidden: int
    heads: int
    layers: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.hidden, name="embed")(tokens)
        for i in range(self.layers):
            x = TransformerLayer(
                hidden_size=self.hidden,
                mlp_hidden_size=4 * self.hidden,
                num_attention_heads=self.heads,
                layer_type=TransformerLayerType.ENCODER,
                self_attn_mask_type="causal",
                enable_relative_embedding=False,  # a bias cannot be split over the context
                hidden_dropout=0.0,
                attention_dropout=0.0,
                logical_axes=True,  # activations [batch, length, ...]: length -> context
                context_parallel_axis=AXIS,
                context_parallel_strategy="RING",
                context_parallel_causal_load_balanced=True,
                name=f"layer_{i}",
            )(x, deterministic=True)
        x = nn.LayerNorm(name="final_norm")(x)
        # float32 head, zero at first: every sequence starts at the loss log(vocab)
        return nn.Dense(self.vocab, kernel_init=nn.initializers.zeros, name="head")(x)


def batch(key: jax.Array, args: argparse.Namespace) -> tuple[jax.Array, jax.Array]:
    """(tokens, next tokens) [batch, length]: a fixed cycle through the vocabulary (a random
    permutation of it, the same in every batch) repeated along the sequence from a random
    start, both in the causal load-balancing order (the targets shifted first, in true order)."""
    cycle = jax.random.permutation(jax.random.key(42), args.vocab)
    starts = jax.random.randint(key, (args.batch, 1), 0, args.vocab)
    seq = cycle[(starts + jnp.arange(args.length + 1)) % args.vocab]
    tokens, targets = seq[:, :-1], seq[:, 1:]
    return tuple(fp8jax.reorder_causal_load_balancing(t, BALANCE, DEVICES, 1)
                 for t in (tokens, targets))  # fmt: skip


def footprint(compiled) -> int:
    """Per-device bytes of a compiled step: arguments + outputs + temporaries, less the outputs
    that reuse donated arguments' buffers."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)  # fmt: skip


def make_step():
    def train_step(state: Fp8TrainState, tokens: jax.Array, targets: jax.Array):
        def loss_fn(params, probes):
            logits = state.apply(state.variables(params, probes), tokens)  # FP8, state's recipe
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        with nn.logical_axis_rules(RULES):
            loss, (grads, probe_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
                state.params, state.fp8_probe
            )
        return state.apply_gradients(grads=grads, probe_grads=probe_grads), loss

    return jax.jit(train_step, donate_argnums=0)


def compile_for(mesh, state, args):
    """The train step compiled on ``mesh`` (state replicated, tokens split along the length)."""
    tokens = jax.ShapeDtypeStruct((args.batch, args.length), jnp.int32,
                                  sharding=NamedSharding(mesh, P(None, AXIS)))  # fmt: skip
    with jax.set_mesh(mesh):
        state = jax.device_put(state, NamedSharding(mesh, P()))
        return make_step().lower(state, tokens, tokens).compile(), state


def main(argv: list[str] | None = None) -> dict:
    """Checks the memory claim, trains; returns the numbers. Exits non-zero if a claim fails."""
    args = parse_args(argv)
    if jax.device_count() < DEVICES:
        sys.exit(
            f"needs {DEVICES} devices, found {jax.device_count()} ({jax.default_backend()}); on "
            f"CPU set XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} before JAX starts"
        )
    if args.length % (2 * DEVICES):
        sys.exit(f"--length must be a multiple of {2 * DEVICES} (load balancing: 2 chunks each)")
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)
    model = LongContextLM(args.vocab, args.hidden, args.heads, args.layers)
    auto = (jax.sharding.AxisType.Auto,)  # shardings from the logical axis rules
    one = jax.make_mesh((1,), (AXIS,), auto, devices=jax.devices()[:1])  # size 1: plain path
    mesh = jax.make_mesh((DEVICES,), (AXIS,), auto, devices=jax.devices()[:DEVICES])
    print(f"{args.layers} FP8 TransformerLayers, hidden {args.hidden}, batch {args.batch} x "
          f"{args.length} tokens; mesh {dict(mesh.shape)} on {jax.default_backend()}")  # fmt: skip

    with jax.set_mesh(one), nn.logical_axis_rules(RULES):  # init on a short sequence
        state = Fp8TrainState.from_model(
            model, jax.random.key(0), jnp.zeros((args.batch, 2 * DEVICES), jnp.int32),
            tx=optax.adam(args.lr), recipe=recipe,
        )  # fmt: skip

    budget = int(args.budget_mb * 2**20)
    single, _ = compile_for(one, state, args)
    step, state = compile_for(mesh, state, args)
    mem = {"one_device": footprint(single), "per_device": footprint(step), "budget": budget}
    mib = {k: f"{v / 2**20:.1f} MiB" for k, v in mem.items()}
    print(f"per-device budget {mib['budget']}; train step at {args.length} tokens "
          f"(arguments + outputs + temporaries): one device {mib['one_device']}, "
          f"each of {DEVICES} context-parallel devices {mib['per_device']}")  # fmt: skip
    fits = mem["per_device"] <= budget < mem["one_device"]
    print("one device exceeds the budget, 8 fit it" if fits else "MEMORY CLAIM FAILED")

    split = NamedSharding(mesh, P(None, AXIS))
    losses = []
    key = jax.random.key(1)
    with jax.set_mesh(mesh):
        for i in range(args.steps):
            tokens, targets = jax.device_put(batch(jax.random.fold_in(key, i), args), split)
            state, loss = step(state, tokens, targets)
            losses.append(float(loss))
            print(f"step {i + 1:3d}  loss {losses[-1]:.4f}")
    learned = losses[-1] < losses[0] / 4  # from log(vocab) (a zero head) towards 0
    print(f"the loss fell {losses[0] / losses[-1]:.1f}x" if learned else "LOSS CLAIM FAILED")
    result = {**mem, "losses": losses}
    if not (fits and learned):
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
