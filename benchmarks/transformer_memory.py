"""Bytes one TransformerLayer saves for its backward pass: fp8jax FP8 vs the same layer built from
plain Flax layers in BF16. Runs on any machine: it traces the forward pass and sums the
residuals JAX keeps (the leaves of the function ``jax.vjp`` returns, under ``jax.eval_shape``);
nothing is executed.

Per token, as the marginal cost of one more sequence of ``--seq`` tokens. Attention on a GPU
runs as cuDNN's fused kernel, which keeps q, k, v, the output and the softmax statistics (one
float32 per head and token) but no ``[seq, seq]`` matrix; cuDNN cannot be traced without a
GPU, so the report gives both: ``as_traced`` (XLA's attention, which keeps the probabilities)
and ``flash`` (the ``[.., seq, seq]`` residuals replaced by the softmax statistics): the
number that matters on a GPU.

    python benchmarks/transformer_memory.py [--hidden 1024 --heads 16 --ffn 4096 --seq 1024]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from _common import environment, write_json

import fp8jax
from fp8jax.flax import TransformerLayer


class Bf16Twin(nn.Module):
    """Pre-LN encoder layer from Flax layers in BF16: LayerNorm -> fused QKV DenseGeneral ->
    ``jax.nn.dot_product_attention`` (causal) -> out DenseGeneral -> residual -> LayerNorm ->
    Dense -> relu -> Dense -> residual."""

    heads: int
    ffn: int

    @nn.compact
    def __call__(self, x):
        dt, h = jnp.bfloat16, x.shape[-1]
        hd = h // self.heads
        ln = nn.LayerNorm(dtype=dt)(x)
        qkv = nn.DenseGeneral((3, self.heads, hd), use_bias=False, dtype=dt)(ln)
        q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        y = x + nn.DenseGeneral(h, axis=(-2, -1), use_bias=False, dtype=dt)(a)
        m = nn.Dense(self.ffn, use_bias=False, dtype=dt)(nn.LayerNorm(dtype=dt)(y))
        return y + nn.Dense(h, use_bias=False, dtype=dt)(nn.relu(m))


def _residuals(fn, params, x, seq: int) -> tuple[int, int, list[str]]:
    """(bytes as traced, bytes with flash attention's residuals, the list)."""
    res = jax.eval_shape(lambda p, x: jax.tree.leaves(jax.vjp(fn, p, x)[1]), params, x)
    traced = flash = 0
    items = []
    for a in res:
        n = int(np.prod(a.shape)) * a.dtype.itemsize
        traced += n
        square = a.ndim >= 4 and a.shape[-1] == seq and a.shape[-2] == seq  # [.., heads, q, k]
        flash += 0 if square else n
        items.append(f"{a.dtype}{list(a.shape)}: {n} B{' (seq x seq)' if square else ''}")
    return traced, flash, items


def _measure(kind: str, batch: int, seq: int, hidden: int, heads: int, ffn: int):
    x = jnp.zeros((batch, seq, hidden), jnp.bfloat16)
    if kind == "bf16":
        twin = Bf16Twin(heads, ffn)
        params = twin.init(jax.random.key(0), x)["params"]
        return _residuals(lambda p, x: twin.apply({"params": p}, x), params, x, seq)
    layer = TransformerLayer(
        hidden_size=hidden, mlp_hidden_size=ffn, num_attention_heads=heads,
        hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
        enable_relative_embedding=False, dtype=jnp.bfloat16,
    )  # fmt: skip
    recipe = fp8jax.DelayedScaling(amax_history_len=16)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        v = layer.init(jax.random.key(0), x, deterministic=True)

    def fn(p, x):
        with fp8jax.autocast(enabled=True, recipe=recipe):
            variables = {"params": p[0], "fp8_meta": v["fp8_meta"], "fp8_probe": p[1]}
            return layer.apply(variables, x, deterministic=True)

    return _residuals(fn, (v["params"], v["fp8_probe"]), x, seq)


def run(hidden: int, heads: int, ffn: int, seq: int, batch: int = 1) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tokens = batch * seq
    for kind in ("fp8", "bf16"):
        t1, f1, items = _measure(kind, batch, seq, hidden, heads, ffn)
        t2, f2, _ = _measure(kind, 2 * batch, seq, hidden, heads, ffn)
        stats = 4 * heads  # flash attention's softmax statistics: float32 per head and token
        out[kind] = {
            "bytes_per_token_as_traced": (t2 - t1) / tokens,
            "bytes_per_token_flash": (f2 - f1) / tokens + stats,
            "residuals": items,
        }
    for key in ("as_traced", "flash"):
        out[f"ratio_{key}"] = (
            out["fp8"][f"bytes_per_token_{key}"] / out["bf16"][f"bytes_per_token_{key}"]
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--allow-cpu", action="store_true", help="accepted (this needs no GPU)")
    args = p.parse_args(argv)
    result = run(args.hidden, args.heads, args.ffn, args.seq)
    report = {
        "benchmark": "transformer_memory",
        "config": {"hidden": args.hidden, "heads": args.heads, "ffn": args.ffn, "seq": args.seq},
        "environment": environment(),
        "result": result,
    }
    print(
        f"TransformerLayer hidden {args.hidden}, {args.heads} heads, FFN {args.ffn}, seq "
        f"{args.seq}: bytes saved for the backward per token"
    )
    for key in ("flash", "as_traced"):
        f, b = (result[k][f"bytes_per_token_{key}"] for k in ("fp8", "bf16"))
        print(f"  {key:9s}: FP8 {f:9.1f}  BF16 {b:9.1f}  ratio {result[f'ratio_{key}']:.3f}")
    print("  (target: flash ratio <= 0.7)")
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
