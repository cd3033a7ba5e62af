"""Bytes an MLP block saves for its backward pass: fp8jax's LayerNormMLP (FP8) vs the same block
from plain Flax layers in BF16. Runs on any machine: it traces the forward pass and sums the
residuals JAX keeps (the leaves of the function ``jax.vjp`` returns, under ``jax.eval_shape``);
nothing is executed.

Reported per token, as the marginal cost (residual bytes at ``2 T`` tokens minus at ``T``,
divided by ``T``): what grows with the batch, i.e. activations; the kernels' copies (FP8 in
both layouts, or BF16 casts) are reported separately, once per layer.

    python benchmarks/mlp_memory.py [--hidden 1024 --intermediate 4096 --tokens 4096] [--json F]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, write_json

import fp8jax
from fp8jax.flax import LayerNormMLP

ACTS = {"gelu": nn.gelu, "relu": nn.relu, "silu": nn.silu}


class Bf16Twin(nn.Module):
    """LayerNorm -> DenseGeneral((k, I)) -> activation -> Dense(hidden), computing in BF16."""

    intermediate: int
    activations: tuple[str, ...]

    @nn.compact
    def __call__(self, x):
        dt = jnp.bfloat16
        ln = nn.LayerNorm(epsilon=1e-6, dtype=dt, name="ln")(x)
        h = nn.DenseGeneral((len(self.activations), self.intermediate), use_bias=False, dtype=dt,
                            name="wi")(ln)  # fmt: skip
        a = ACTS[self.activations[0]](h[..., 0, :])
        if len(self.activations) == 2:
            a = a * h[..., 1, :]
        return nn.Dense(x.shape[-1], use_bias=False, dtype=dt, name="wo")(a)


def _residual_bytes(fn, params, x) -> tuple[int, list[tuple[str, int]]]:
    """Total bytes of what ``fn(params, x)`` keeps for its backward, and the list."""
    res = jax.eval_shape(lambda p, x: jax.tree.leaves(jax.vjp(fn, p, x)[1]), params, x)
    items = [(f"{a.dtype}{list(a.shape)}", int(np.prod(a.shape)) * a.dtype.itemsize)
             for a in res]  # fmt: skip
    return sum(b for _, b in items), items


def _measure(kind: str, hidden: int, inter: int, tokens: int, acts: tuple[str, ...], recipe=None):
    x = jnp.zeros((tokens, hidden), jnp.bfloat16)
    if kind == "bf16":
        model = Bf16Twin(inter, acts)
        params = model.init(jax.random.key(0), x)["params"]

        def fn(p, x):
            return model.apply({"params": p}, x)

        return _residual_bytes(fn, params, x)
    model = LayerNormMLP(intermediate_dim=inter, activations=acts, intermediate_dropout_rate=0.0,
                         dtype=jnp.bfloat16)  # fmt: skip
    recipe = recipe or fp8jax.DelayedScaling(amax_history_len=16)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        v = model.init(jax.random.key(0), x)
    state = {k: c for k, c in v.items() if k not in ("params", "fp8_probe")}  # fp8_meta, if any

    def fn(p, x):
        with fp8jax.autocast(enabled=True, recipe=recipe):
            variables = {"params": p[0], **state, **({"fp8_probe": p[1]} if p[1] else {})}
            return model.apply(variables, x)[0]

    return _residual_bytes(fn, (v["params"], v.get("fp8_probe", {})), x)


def run(
    hidden: int, inter: int, tokens: int, acts: tuple[str, ...], recipe: Any = None
) -> dict[str, Any]:
    """Residual bytes of the FP8 block (``recipe``: default ``DelayedScaling``) and its BF16
    twin, per token and per layer, and their ratio."""
    out: dict[str, Any] = {}
    for kind in ("fp8", "bf16"):
        small, items = _measure(kind, hidden, inter, tokens, acts, recipe)
        large, _ = _measure(kind, hidden, inter, 2 * tokens, acts, recipe)
        per_token = (large - small) / tokens
        out[kind] = {
            "bytes_per_token": per_token,
            "bytes_per_layer_fixed": small - per_token * tokens,
            "total_bytes": small,
            "residuals": [f"{name}: {b} B" for name, b in items],
        }
    out["ratio_fp8_over_bf16_per_token"] = (
        out["fp8"]["bytes_per_token"] / out["bf16"]["bytes_per_token"]
    )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--activations", default="gelu", help="e.g. gelu or silu,linear")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--allow-cpu", action="store_true", help="accepted (this needs no GPU)")
    args = p.parse_args(argv)
    acts = tuple(args.activations.split(","))
    result = run(args.hidden, args.intermediate, args.tokens, acts)
    report = {
        "benchmark": "mlp_memory",
        "config": {
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "tokens": args.tokens,
            "activations": list(acts),
        },
        "environment": environment(),
        "result": result,
    }
    f, b = result["fp8"], result["bf16"]
    print(
        f"LayerNormMLP hidden {args.hidden}, intermediate {args.intermediate}, {args.tokens} "
        f"tokens, {','.join(acts)}: bytes saved for the backward per token"
    )
    for name, r in (("fp8jax FP8", f), ("Flax BF16", b)):
        fixed = r["bytes_per_layer_fixed"]
        print(f"  {name:10s}: {r['bytes_per_token']:9.1f} B/token (+ {fixed:.0f} B per layer)")
    print(f"  ratio      : {result['ratio_fp8_over_bf16_per_token']:.3f} (target <= 0.6)")
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
