"""A TransformerEngine-style encoder classifier, ported to fp8jax by renaming the imports.

The model and the train loop are written the way TransformerEngine's JAX examples write them
(an ``nn.Embed``, one ``TransformerLayer`` encoder with a padding mask, two ``DenseGeneral``s and
a plain ``nn.Dense`` head; the whole variable dict differentiated and its non-``params``
gradients kept as the next FP8 state). Only the imports changed::

    import transformer_engine.jax as te              ->  import fp8jax as te
    import transformer_engine.jax.flax as te_flax    ->  import fp8jax.flax as te_flax

The task is synthetic and needs no download: each sentence is a padded run of random word ids,
and its label says whether it holds more "positive" words (ids below half the vocabulary) than
"negative" ones. See docs/porting-from-te.md for what differs from TE and for fp8jax's own
train step (``Fp8TrainState``), which this example can run instead (``--fp8jax-step``).

    python examples/te_encoder.py                  # FP8 (DelayedScaling, HYBRID), TE's step
    python examples/te_encoder.py --no-fp8         # the same model in high precision
    python examples/te_encoder.py --fp8jax-step    # fp8jax's step: the same numbers
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state

import fp8jax as te
import fp8jax.flax as te_flax

PARAMS_KEY = "params"
DROPOUT_KEY = "dropout"


class Net(nn.Module):
    """embed -> TransformerLayer (padding mask) -> 2 DenseGeneral -> 2 logits."""

    num_embed: int
    hidden: int = 64

    @nn.compact
    def __call__(self, x, mask, disable_dropout=False):
        x = nn.Embed(num_embeddings=self.num_embed, features=self.hidden, dtype=jnp.bfloat16)(x)
        encoder = partial(
            te_flax.TransformerLayer,
            hidden_size=self.hidden,
            mlp_hidden_size=4 * self.hidden,
            num_attention_heads=4,
            hidden_dropout=0.1,
            attention_dropout=0.1,
            dropout_rng_name=DROPOUT_KEY,
            layer_type=te_flax.TransformerLayerType.ENCODER,
            self_attn_mask_type="padding",
            enable_relative_embedding=False,
        )
        x = encoder()(x, attention_mask=mask, deterministic=disable_dropout)
        x = x.reshape(x.shape[0], -1)
        x = te_flax.DenseGeneral(features=self.hidden)(x)
        x = te_flax.DenseGeneral(features=self.hidden)(x)
        return nn.Dense(features=2)(x)


def make_dataset(size: int, seq_len: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Padded sentences of word ids 1..vocab-1 (0 pads), TE's 4-D padding masks (1 = masked
    out), and labels: 1.0 when a sentence has more ids below vocab/2 than above."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq_len // 4, seq_len + 1, size)
    words = rng.integers(1, vocab, (size, seq_len))
    valid = np.arange(seq_len)[None, :] < lengths[:, None]
    words = np.where(valid, words, 0).astype(np.int32)
    positive = ((words > 0) & (words < vocab // 2)).sum(1)
    negative = (words >= vocab // 2).sum(1)
    labels = (positive > negative).astype(np.float32)
    both = valid[:, None, :, None] & valid[:, None, None, :]
    return {"sentence": words, "mask": (~both).astype(np.uint8), "label": labels}


def _loss_and_logits(state, var_collect, inputs, masks, labels, rngs, disable_dropout):
    logits = state.apply_fn(var_collect, inputs, masks, disable_dropout, rngs=rngs)
    one_hot = jax.nn.one_hot(labels.astype(jnp.int32), 2)
    return jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot)), logits


@jax.jit
def train_step(state, inputs, masks, labels, var_collect, rngs):
    """TransformerEngine's train step: the non-params gradients are the next FP8 state."""

    def loss_fn(var_collect):
        return _loss_and_logits(state, var_collect, inputs, masks, labels, rngs, False)

    var_collect = {**var_collect, PARAMS_KEY: state.params}
    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(var_collect)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    var_collect, grads = flax.core.pop(grads, PARAMS_KEY)
    state = state.apply_gradients(grads=grads)
    return state, loss, accuracy, var_collect


@jax.jit
def fp8jax_train_step(state, inputs, masks, labels, rngs):
    """fp8jax's train step: params and probes differentiated, the FP8 state updated from the
    probe gradients (merged by max) in one launch."""

    def loss_fn(params, probes):
        variables = state.variables(params, probes)
        return _loss_and_logits(state, variables, inputs, masks, labels, rngs, False)

    (loss, logits), (grads, probe_grads) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True
    )(state.params, state.fp8_probe)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return state.apply_gradients(grads=grads, probe_grads=probe_grads), loss, accuracy


@jax.jit
def eval_step(state, inputs, masks, labels, var_collect):
    var_collect = {**var_collect, PARAMS_KEY: state.params}
    loss, logits = _loss_and_logits(state, var_collect, inputs, masks, labels, {}, True)
    return loss, jnp.mean(jnp.argmax(logits, -1) == labels)


def train_and_evaluate(args: argparse.Namespace) -> dict[str, float]:
    """Trains for ``args.epochs``; returns the last epoch's train and test loss/accuracy."""
    train_ds = make_dataset(args.train_size, args.seq_len, args.vocab, args.seed)
    test_ds = make_dataset(args.test_size, args.seq_len, args.vocab, args.seed + 1)
    rng = jax.random.key(args.seed)
    rng, params_rng, dropout_rng = jax.random.split(rng, 3)
    recipe = te.DelayedScaling(fp8_format=te.Format.HYBRID) if args.use_fp8 else None
    result: dict[str, float] = {}
    with te.autocast(enabled=args.use_fp8, recipe=recipe, mesh_resource=te.MeshResource()):
        model = Net(num_embed=args.vocab)
        inputs = jnp.zeros((args.batch_size, args.seq_len), jnp.int32)
        masks = jnp.zeros((args.batch_size, 1, args.seq_len, args.seq_len), jnp.uint8)
        var_collect = model.init({PARAMS_KEY: params_rng, DROPOUT_KEY: dropout_rng}, inputs, masks)
        tx = optax.adamw(args.lr)
        if args.fp8jax_step:
            state = te_flax.Fp8TrainState.from_variables(
                apply_fn=model.apply, variables=var_collect, tx=tx, recipe=recipe
            )
        else:
            state = train_state.TrainState.create(
                apply_fn=model.apply, params=var_collect[PARAMS_KEY], tx=tx
            )
        var_collect = {k: v for k, v in var_collect.items() if k != PARAMS_KEY}
        steps = args.train_size // args.batch_size
        for epoch in range(1, args.epochs + 1):
            rng, perm_rng = jax.random.split(rng)
            perms = np.asarray(jax.random.permutation(perm_rng, args.train_size))
            losses, accs, start = [], [], time.perf_counter()
            for i in range(steps):
                idx = perms[i * args.batch_size : (i + 1) * args.batch_size]
                batch = [jnp.asarray(train_ds[k][idx]) for k in ("sentence", "mask", "label")]
                rngs = {DROPOUT_KEY: jax.random.fold_in(dropout_rng, epoch * steps + i)}
                if args.fp8jax_step:
                    state, loss, acc = fp8jax_train_step(state, *batch, rngs)
                    var_collect = {k: v for k, v in state.variables().items() if k != PARAMS_KEY}
                else:
                    state, loss, acc, var_collect = train_step(state, *batch, var_collect, rngs)
                losses.append(float(loss))
                accs.append(float(acc))
            test = []
            for j in range(0, args.test_size - args.batch_size + 1, args.batch_size):
                batch = [jnp.asarray(test_ds[k][j : j + args.batch_size])
                         for k in ("sentence", "mask", "label")]  # fmt: skip
                test.append(eval_step(state, *batch, var_collect))
            result = {
                "train_loss": float(np.mean(losses)),
                "train_accuracy": float(np.mean(accs)),
                "test_loss": float(np.mean([float(t[0]) for t in test])),
                "test_accuracy": float(np.mean([float(t[1]) for t in test])),
            }
            print(
                f"Epoch {epoch:2d}  train loss {result['train_loss']:.4f} acc "
                f"{result['train_accuracy']:.3f}  test loss {result['test_loss']:.4f} acc "
                f"{result['test_accuracy']:.3f}  ({time.perf_counter() - start:.1f} s)",
                flush=True,
            )
    if args.use_fp8:
        scales = [np.asarray(s) for s in jax.tree.leaves(var_collect["fp8_meta"]) if s.ndim == 1]
        result["fp8_scales_updated"] = float(np.mean([np.all(s != 1.0) for s in scales]))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--train-size", type=int, default=2048)
    p.add_argument("--test-size", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fp8", dest="use_fp8", action="store_false", help="high precision")
    p.add_argument("--fp8jax-step", action="store_true", help="fp8jax's train step instead of TE's")
    return p.parse_args(argv)


if __name__ == "__main__":
    print(train_and_evaluate(parse_args()))
