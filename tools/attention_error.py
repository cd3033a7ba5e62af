"""Per-layer error of FP8 attention (``fp8_dpa``) against BF16 attention on the GPT demo's own
activations (issue 48): the demo model (``examples/train_gpt.py``, a preset) trained ``--steps``
steps in BF16, then on a validation batch each layer's attention inputs (q, k, v after the
rotary embedding) and the loss's gradient at its output, and per layer the relative error
``|a - b| / |b|`` (Frobenius norms) of the FP8 attention's output and q, k, v gradients against
the BF16 attention's (``jax.nn.dot_product_attention``, XLA's, float32 softmax). The FP8
attention is :func:`fp8jax.dot_product_attention`'s reference (what a CPU runs) with each
tensor's own scale (``Float8CurrentScaling``: what delayed scaling converges to on a steady
tensor). Prints the markdown table of docs/numerics.md ("FP8 attention").

    python tools/attention_error.py [--preset cpu] [--steps 400] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_gpt

import fp8jax
from fp8jax.flax import DotProductAttention, TransformerLayer


def trained(cfg: train_gpt.Config, steps: int, text: np.ndarray) -> dict[str, Any]:
    """The demo's params after ``steps`` BF16 train steps."""
    state = train_gpt.init_linen_state(cfg, None)
    train_step, _, _ = train_gpt.linen_steps(None)
    for i in range(steps):
        state, _ = train_step(state, *train_gpt.batch_at(text, cfg, i))
    return state.params


def _forward(cfg, params, tokens, shifts, captured=None):
    """The demo's forward, layer by layer (its scan unrolled), adding ``shifts[l]`` (zeros) to
    layer ``l``'s attention output and recording its (q, k, v) in ``captured``."""
    layer = TransformerLayer(hidden_size=cfg.hidden, **train_gpt.layer_config(cfg))
    table = params["Embed_0"]["embedding"]
    x = table[tokens].astype(jnp.bfloat16)
    for n in range(cfg.layers):

        def hook(next_fun, args, kwargs, context, n=n):
            module, method = context.module, context.method_name
            if isinstance(module, DotProductAttention) and method == "__call__":
                if captured is not None:
                    captured.append(tuple(args[:3]))
                return next_fun(*args, **kwargs) + shifts[n].astype(jnp.bfloat16)
            return next_fun(*args, **kwargs)

        p = jax.tree.map(lambda a, n=n: a[n], params["blocks"]["layer"])
        with nn.intercept_methods(hook):
            x = layer.apply({"params": p}, x, deterministic=True)
    x = nn.LayerNorm(dtype=jnp.float32).apply({"params": params["LayerNorm_0"]}, x)
    return x.astype(jnp.float32) @ table.T


def layer_errors(cfg, params, tokens, targets) -> list[dict[str, float]]:
    """Per layer: the relative errors of the FP8 attention's output and gradients."""
    b, s = tokens.shape
    shape = (b, s, cfg.heads, cfg.hidden // cfg.heads)
    shifts = [jnp.zeros(shape, jnp.float32) for _ in range(cfg.layers)]
    captured: list[tuple] = []
    _forward(cfg, params, tokens, shifts, captured)

    def loss(shifts):
        return train_gpt.loss_of(_forward(cfg, params, tokens, shifts), targets)

    douts = jax.grad(loss)(shifts)
    recipe = fp8jax.Float8CurrentScaling()
    rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) /
                             jnp.linalg.norm(b.astype(jnp.float32)))  # fmt: skip
    rows = []
    for n, ((q, k, v), dout) in enumerate(zip(captured, douts, strict=True)):

        def bf16(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

        def fp8(q, k, v):
            return fp8jax.dot_product_attention(q, k, v, recipe=recipe, is_causal=True)

        out_b, vjp_b = jax.vjp(bf16, q, k, v)
        out_f, vjp_f = jax.vjp(fp8, q, k, v)
        g_b, g_f = vjp_b(dout.astype(out_b.dtype)), vjp_f(dout.astype(out_f.dtype))
        grads = {f"d{t}": rel(a, c) for t, a, c in zip("qkv", g_f, g_b, strict=True)}
        rows.append({"layer": n, "out": rel(out_f, out_b), **grads})
    return rows


def table(rows: list[dict[str, float]]) -> str:
    lines = ["| layer | output | dq | dk | dv |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{100 * r[k]:.2f}%" for k in ("out", "dq", "dk", "dv")]
        lines.append(f"| {r['layer']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu", choices=list(train_gpt.PRESETS))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cfg = train_gpt.Config(**dict(train_gpt.PRESETS[args.preset], steps=args.steps),
                           seed=args.seed)  # fmt: skip
    train, val, desc = train_gpt.load_text(None, 8_000_000)
    params = trained(cfg, args.steps, train)
    rows = layer_errors(cfg, params, *train_gpt.batch_at(val, cfg, 0, salt=1))
    print(f"{args.preset}, {args.steps} BF16 steps, seed {args.seed}; data: {desc}")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
