"""What storing Adam's moments in 8 bits loses, measured on the moments of the GPT demo.

Trains the demo model (examples/train_gpt.py, CPU preset, BF16 compute) with float32
``optax.adamw`` (the demo's schedule and clipping) and, fed the same clipped gradients, keeps
a *shadow* of the two moments in each candidate representation: dequantized, updated in
float32 and re-quantized every step, as ``fp8jax.optim.scale_by_adam`` does. The shadows do
not move the params, so what they show is the representation's own error, step after step,
apart from any change of trajectory. Reported at each checkpoint step:

- ``update err``: ``||u' - u|| / ||u||`` of the Adam direction ``u = m_hat / (sqrt(v_hat) +
  eps)`` from the shadow moments against the float32 ones, over every parameter;
- ``sqrt(v) ratio``: the median over elements of ``sqrt(v') / sqrt(v)`` (1 when unbiased; a
  second moment that cannot follow its EMA drifts from 1);
- ``max |u'|/|u|``: the largest amplification of one element's update (a denominator that
  rounded toward 0);
- at the last step, the round trip of the float32 moments themselves (one quantization).

    python tools/optimizer_state_error.py [--steps 800] [--json F] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import train_gpt  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax.ops.block.block_scaling import block_scale  # noqa: E402
from fp8jax.optim import BLOCK, MOMENT_FORMATS, dequantize_moment, quantize_moment  # noqa: E402
from fp8jax.optim.moments import from_blocks, to_blocks  # noqa: E402

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


class Repr(NamedTuple):
    """How one moment is stored, block-scaled along the last dim (128 elements a scale):

    - ``kind`` an FP8 dtype: its codes, ``fp8_max / amax`` float32 scales (``pow2``: rounded
      down to a power of two), of ``sqrt(x)`` with ``root``; ``nonzero``: a nonzero value that
      would round to 0 gets the smallest subnormal; ``sr``: stochastic rounding;
    - ``"e4m3"`` / ``"sqrt_uint8"``: fp8jax.optim's formats (``fp8jax.optim.quantize_moment``);
    - ``"uint8"``: uint8 codes of ``x`` itself, linear from 0 to the block's largest;
      ``"int8"``: signed, -127..127; ``"log8"``: uint8 codes of ``log2`` of ``sqrt(x)`` below the
      block's largest, 16 an octave; ``"bf16"``: bfloat16 per element, no scale.
    """

    kind: Any
    root: bool = False
    pow2: bool = False
    nonzero: bool = False
    sr: bool = False

    def round_trip(self, x: jax.Array, key: jax.Array) -> jax.Array:
        if self.kind == "bf16":
            return x.astype(jnp.bfloat16).astype(jnp.float32)
        if self.kind in MOMENT_FORMATS:
            return dequantize_moment(*quantize_moment(x, self.kind), self.kind)
        if self.kind in ("uint8", "int8", "log8"):
            return _linear_or_log(x, self.kind)
        y = to_blocks(jnp.sqrt(x) if self.root else x, BLOCK)
        scale = block_scale(jnp.max(jnp.abs(y), -1), self.kind, power_2_scale=self.pow2)
        a = jnp.abs(y * scale[..., None])
        if self.sr:  # E4M3's step at a: 2**(exponent - 3), subnormals 2**-9
            step = jnp.exp2(jnp.floor(jnp.log2(jnp.maximum(a, 2.0**-6))) - 3)
            low = jnp.floor(a / step) * step
            up = jax.random.uniform(key, a.shape) < (a - low) / step
            q = jnp.minimum(jnp.where(up, low + step, low), 448.0)
        else:
            limit = float(jnp.finfo(self.kind).max)
            q = jnp.minimum(a, limit).astype(self.kind).astype(jnp.float32)
        if self.nonzero:
            q = jnp.where((q == 0) & (a > 0), float(jnp.finfo(self.kind).smallest_subnormal), q)
        back = from_blocks(jnp.sign(y) * q / scale[..., None], x.shape)
        return back**2 if self.root else back


def _linear_or_log(x: jax.Array, kind: str) -> jax.Array:
    y = to_blocks(jnp.sqrt(x) if kind == "log8" else x, BLOCK)
    top = jnp.max(jnp.abs(y), -1, keepdims=True)
    top = jnp.where(top > 0, top, 1.0)
    if kind == "log8":
        c = jnp.clip(jnp.round(-16 * jnp.log2(jnp.maximum(y, 1e-38) / top)), 0, 254)
        return from_blocks(jnp.where(y > 0, top * jnp.exp2(-c / 16), 0.0), x.shape) ** 2
    levels = 255 if kind == "uint8" else 127
    c = jnp.round(y / top * levels)
    if kind == "uint8":
        c = jnp.where((c == 0) & (y > 0), 1.0, c)  # a denominator never 0
    return from_blocks(c / levels * top, x.shape)


M_OURS, V_OURS = Repr("e4m3"), Repr("sqrt_uint8")
E4M3_SQRT = Repr(E4M3, root=True, nonzero=True)
#: name -> (first moment, second moment)
CANDIDATES = {
    "E4M3 m, uint8 sqrt(v) (fp8jax)": (M_OURS, V_OURS),
    "E4M3 m, E4M3 sqrt(v)": (M_OURS, E4M3_SQRT),
    "E4M3 m, E4M3 sqrt(v), stochastic rounding": (M_OURS, E4M3_SQRT._replace(sr=True)),
    "E4M3 m, E4M3 v": (M_OURS, Repr(E4M3, nonzero=True)),
    "E4M3 m, E5M2 v": (M_OURS, Repr(E5M2, nonzero=True)),
    "E4M3 m, uint8 v (no square root)": (M_OURS, Repr("uint8")),
    "E4M3 m, uint8 log2 sqrt(v)": (M_OURS, Repr("log8")),
    "int8 m, uint8 sqrt(v)": (Repr("int8"), V_OURS),
    "E4M3 m stochastic rounding, uint8 sqrt(v)": (Repr(E4M3, sr=True), V_OURS),
    "E5M2 m, uint8 sqrt(v)": (Repr(E5M2), V_OURS),
    "E4M3 m and sqrt(v), power-of-two scales": (
        Repr(E4M3, pow2=True),
        E4M3_SQRT._replace(pow2=True),
    ),
    "bfloat16 m and v (4 B, no scales)": (Repr("bf16"), Repr("bf16")),
}
EPS, B1, B2 = 1e-8, 0.9, 0.999


def _direction(m, v, count):
    c1, c2 = 1 - B1**count, 1 - B2**count
    return (m / c1) / (np.sqrt(v / c2) + EPS)


def _compare(mv, ref, count) -> dict[str, float]:
    """Errors of the moments ``mv`` (lists of per-param m and v) against ``ref`` (numpy, in
    float64)."""
    num = den = 0.0
    ratios, amp = [], 0.0
    for m, v, m0, v0 in zip(*mv, *ref, strict=True):
        m, v, m0, v0 = (np.asarray(a, np.float64) for a in (m, v, m0, v0))
        u, u0 = _direction(m, v, count), _direction(m0, v0, count)
        num += float(np.sum((u - u0) ** 2))
        den += float(np.sum(u0**2))
        live = v0 > 0
        ratios.append(np.sqrt(v[live]) / np.sqrt(v0[live]))
        a = np.abs(u[live]) / np.maximum(np.abs(u0[live]), 1e-30)
        big = np.abs(u0[live]) > 0.1  # amplification of an update of Adam's size
        amp = max(amp, float(a[big].max()) if big.any() else 0.0)
    ratios = np.concatenate(ratios)
    return {
        "update_err": float(np.sqrt(num / den)),
        "sqrt_v_ratio_median": float(np.median(ratios)),
        "sqrt_v_ratio_p1": float(np.percentile(ratios, 1)),
        "sqrt_v_ratio_p99": float(np.percentile(ratios, 99)),
        "max_update_amplification": amp,
    }


def _round_trip(ms, vs) -> dict[str, dict[str, float]]:
    """One quantization of the float32 moments, per representation."""
    key = jax.random.key(0)
    m_reps = {
        "m E4M3 (fp8jax)": M_OURS,
        "m E4M3, power-of-two scales": Repr(E4M3, pow2=True),
        "m E5M2": Repr(E5M2),
        "m int8": Repr("int8"),
        "m bfloat16": Repr("bf16"),
    }
    v_reps = {
        "sqrt(v) of uint8 sqrt(v) (fp8jax)": V_OURS,
        "sqrt(v) of E4M3 sqrt(v)": E4M3_SQRT,
        "sqrt(v) of E4M3 v": Repr(E4M3, nonzero=True),
        "sqrt(v) of E5M2 v": Repr(E5M2, nonzero=True),
        "sqrt(v) of uint8 v": Repr("uint8"),
        "sqrt(v) of uint8 log2 sqrt(v)": Repr("log8"),
        "sqrt(v) of bfloat16 v": Repr("bf16"),
    }
    out = {}
    for reps, xs, root in ((m_reps, ms, False), (v_reps, vs, True)):
        for name, r in reps.items():
            backs = jax.jit(lambda xs, r=r: [r.round_trip(x, key) for x in xs])(xs)
            pairs = []
            for back, x in zip(backs, xs, strict=True):
                back, x = np.asarray(back, np.float64), np.asarray(x, np.float64)
                if root:
                    back, x = np.sqrt(back), np.sqrt(x)
                pairs.append((back - x, x))
            out[name] = _rel(pairs)
    return out


def _rel(pairs) -> dict[str, float]:
    """Relative L2 error, mean relative error over nonzero elements, share lost to 0."""
    num = sum(float(np.sum(e**2)) for e, _ in pairs)
    den = sum(float(np.sum(x**2)) for _, x in pairs)
    rel = np.concatenate([np.abs(e[x != 0]) / np.abs(x[x != 0]) for e, x in pairs])
    zero = np.concatenate([((e + x == 0) & (x != 0)).ravel() for e, x in pairs])
    return {
        "rel_l2": float(np.sqrt(num / den)),
        "mean_rel": float(rel.mean()),
        "max_rel": float(rel.max()),
        "to_zero": float(zero.mean()),
    }


def run(
    steps: int,
    checkpoints: list[int],
    max_bytes: int = 8_000_000,
    names: tuple[str, ...] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """The report: ``steps`` steps of the demo's CPU preset (fields overridden by
    ``overrides``), the shadows of ``names`` (default: all of :data:`CANDIDATES`) compared at
    ``checkpoints``."""
    candidates = {n: CANDIDATES[n] for n in (names or CANDIDATES)}
    cfg = train_gpt.Config(**{**train_gpt.PRESETS["cpu"], **overrides})
    train, _, desc = train_gpt.load_text(None, max_bytes)
    state = train_gpt.init_linen_state(cfg, None)
    tx = train_gpt.make_tx(cfg)  # clip by global norm 1, then optax.adamw (float32)
    clip = optax.clip_by_global_norm(1.0)
    params, opt_state = state.params, tx.init(state.params)
    leaves = jax.tree.leaves(params)
    zeros = [jnp.zeros_like(p) for p in leaves]
    shadows = {name: (list(zeros), list(zeros)) for name in candidates}

    @jax.jit
    def step(params, opt_state, shadows, tokens, targets, key):
        def loss(p):
            with fp8jax.autocast(enabled=False):
                return train_gpt.loss_of(state.apply_fn({"params": p}, tokens), targets)

        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        clipped, _ = clip.update(grads, clip.init(params))
        new = {}
        g = jax.tree.leaves(clipped)
        for i, (name, (mr, vr)) in enumerate(candidates.items()):
            ms, vs = shadows[name]
            keys = jax.random.split(jax.random.fold_in(key, i), (len(g), 2))
            new[name] = (
                [
                    mr.round_trip((1 - B1) * gi + B1 * m, k[0])
                    for gi, m, k in zip(g, ms, keys, strict=True)
                ],
                [
                    vr.round_trip((1 - B2) * gi**2 + B2 * v, k[1])
                    for gi, v, k in zip(g, vs, keys, strict=True)
                ],
            )
        return optax.apply_updates(params, updates), opt_state, new

    report: dict[str, Any] = {"data": desc, "steps": {}}
    for i in range(steps):
        batch = train_gpt.batch_at(train, cfg, i)
        key = jax.random.fold_in(jax.random.key(1), i)
        params, opt_state, shadows = step(params, opt_state, shadows, *batch, key)
        n = i + 1
        if n in checkpoints:
            adam = opt_state[1][0]  # chain(clip, adamw) -> adamw's chain -> ScaleByAdamState
            ref = (jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu))
            report["steps"][n] = {name: _compare(shadows[name], ref, n) for name in candidates}
            print(
                f"step {n}: "
                + ", ".join(f"{k}: {v['update_err']:.3f}" for k, v in report["steps"][n].items()),
                flush=True,
            )
    report["round_trip"] = _round_trip(*ref)
    return report


def tables(report: dict[str, Any]) -> str:
    """The two markdown tables of docs/numerics.md from a report."""
    steps = list(report["steps"])
    last = steps[-1]
    head = " | ".join(f"step {n}" for n in steps)
    lines = [
        f"| shadow moments | update error at {head} | median sqrt(v) / float32's at step "
        f"{last} [1st, 99th percentile] |",
        "|---|" + "---|" * len(steps) + "---|",
    ]
    for name in report["steps"][last]:
        errs = " | ".join(f"{100 * report['steps'][n][name]['update_err']:.1f}%" for n in steps)
        r = report["steps"][last][name]
        lines.append(
            f"| {name} | {errs} | {r['sqrt_v_ratio_median']:.3f} [{r['sqrt_v_ratio_p1']:.2f}, "
            f"{r['sqrt_v_ratio_p99']:.2f}] |"
        )
    lines += [
        "",
        "| one round trip | relative L2 | mean relative | largest relative |",
        "|---|---|---|---|",
    ]
    for name, r in report["round_trip"].items():
        lines.append(
            f"| {name} | {100 * r['rel_l2']:.2f}% | {100 * r['mean_rel']:.2f}% | "
            f"{r['max_rel']:.3g} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", action="store_true", help="print docs/numerics.md's tables")
    args = p.parse_args(argv)
    checkpoints = sorted({c for c in (10, 100, 200, 400, 800) if c <= args.steps} | {args.steps})
    report = run(args.steps, checkpoints)
    print("\nround trip of the float32 moments at the last step (one quantization):")
    print(f"{'':36s} {'rel L2':>8s} {'mean rel':>9s} {'max rel':>8s} {'to 0':>8s}")
    for name, r in report["round_trip"].items():
        print(
            f"{name:36s} {r['rel_l2']:8.4f} {r['mean_rel']:9.4f} {r['max_rel']:8.3f} "
            f"{r['to_zero']:8.2e}"
        )
    print("\nshadow moments, re-quantized every step, against float32 AdamW:")
    for n, rows in report["steps"].items():
        print(f"step {n}")
        for name, r in rows.items():
            print(
                f"  {name:44s} update err {r['update_err']:.4f}  sqrt(v) ratio median "
                f"{r['sqrt_v_ratio_median']:.3f} [p1 {r['sqrt_v_ratio_p1']:.3f}, p99 "
                f"{r['sqrt_v_ratio_p99']:.3f}]  max |u'|/|u| "
                f"{r['max_update_amplification']:.2f}"
            )
    if args.markdown:
        print("\n" + tables(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
