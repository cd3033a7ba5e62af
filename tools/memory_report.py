"""Where the memory of a training step goes, per parameter and per token: the GPT demo model
(examples/train_gpt.py) under a recipe, an optimizer, a remat policy and FSDP.

For each config, side by side:

- bytes per parameter of the params, the optimizer state and the gradients (the state's own
  arrays, scales and counts included; the FP8 scaling state is reported apart);
- activation bytes kept for the backward per token and layer: the residuals JAX keeps (the
  leaves of the function ``jax.vjp`` returns, under ``jax.eval_shape``, as
  benchmarks/transformer_memory.py measures them), the marginal cost of one more layer and one
  more batch; XLA's attention on CPU keeps the ``[seq, seq]`` probabilities, a GPU's fused
  attention does not (their share is reported: the kept arrays that grow with the square of
  the sequence, found by tracing again at twice the sequence, never by their dims);
- the compiled train step's bytes per device from XLA's memory analysis (on CPU here; the
  state donated to the step, as a training loop does): ``temp`` (XLA's arena for what the step
  makes and drops: activations, gradients, the optimizer's float32 intermediates) and ``peak``
  = arguments + outputs - aliased + temp.

Nothing is trained: the step is only compiled. ``--fsdp N`` shards params and optimizer state
over N devices (on a CPU, N emulated devices) along each parameter's largest dim that N
divides (a last dim only in whole 128-element blocks of the FP8 moments).

    python tools/memory_report.py [--preset cpu] [--configs all] [--remat none|full|fp8]
                                  [--fsdp N] [--json F] [--markdown]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: name -> (label, recipe, optimizer of examples/train_gpt.py)
CONFIGS = {
    "bf16_adam": ("BF16 + Adam", "bf16", "adamw"),
    "fp8_adam": ("FP8 + Adam", "fp8", "adamw"),
    "fp8_fp8adam": ("FP8 + FP8 Adam", "fp8", "adamw_fp8"),
    "bf16params_fp8adam": ("BF16 params + FP8 Adam", "fp8", "adamw_fp8_bf16"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cpu", help="a preset of examples/train_gpt.py")
    p.add_argument("--configs", default="all", help="comma-separated, of: " + ", ".join(CONFIGS))
    p.add_argument("--remat", default="none", help="none, full or fp8 (see train_gpt.py)")
    p.add_argument("--fsdp", type=int, default=1, help="devices to shard params and state over")
    p.add_argument("--batch", type=int, help="override the preset's batch")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    return p


def _set_devices(n: int) -> None:
    """N emulated CPU devices for --fsdp (before JAX starts its backends)."""
    if n > 1 and "jax" not in sys.modules:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"


def _nbytes(tree: Any) -> int:
    import jax
    import numpy as np

    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _residual_leaves(gpt, cfg, recipe, batch: int) -> list[Any]:
    """The arrays (shapes and dtypes) the forward of ``cfg`` at ``batch`` keeps for the
    backward: the leaves of the function ``jax.vjp`` returns, under ``jax.eval_shape``."""
    import jax
    import jax.numpy as jnp

    import fp8jax

    state = jax.eval_shape(
        lambda: gpt.init_linen_state(dataclasses.replace(cfg, batch=batch), recipe)
    )
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq), jnp.int32)

    def loss(params, probes, tokens):
        with fp8jax.autocast(enabled=recipe is not None, recipe=recipe):
            logits = state.apply_fn(state.variables(params, probes), tokens)
        return gpt.loss_of(logits, tokens)

    return jax.eval_shape(
        lambda p, q, t: jax.tree.leaves(jax.vjp(lambda p, q: loss(p, q, t), p, q)[1]),
        state.params,
        state.fp8_probe,
        tokens,
    )


def _residuals(gpt, cfg, recipe, batch: int) -> tuple[int, int]:
    """(bytes the forward keeps for the backward, of which seq x seq arrays).

    A kept array is seq x seq when it grows with the square of the sequence: the same program
    traced at twice ``cfg.seq`` keeps, in the same place, an array with 4 times its elements
    (XLA's attention on CPU: the ``[batch, heads, seq, seq]`` probabilities and masks). So an
    array is classified by what it is a function of, never by matching its dims against the
    config's (a ``[layers, batch, seq, hidden]`` activation looks like ``[.., heads, seq, seq]``
    when ``batch`` or ``2 * batch`` equals ``heads`` and ``hidden`` equals ``seq``)."""
    import numpy as np

    leaves = _residual_leaves(gpt, cfg, recipe, batch)
    twins = _residual_leaves(gpt, dataclasses.replace(cfg, seq=2 * cfg.seq), recipe, batch)
    if len(twins) != len(leaves):
        raise RuntimeError(
            f"the backward keeps {len(leaves)} arrays at seq {cfg.seq} but {len(twins)} at seq "
            f"{2 * cfg.seq}: cannot tell its seq x seq arrays apart"
        )
    total = square = 0
    for a, twice in zip(leaves, twins, strict=True):
        n = int(np.prod(a.shape)) * a.dtype.itemsize
        total += n
        square += n if n and int(np.prod(twice.shape)) == 4 * int(np.prod(a.shape)) else 0
    return total, square


def _fsdp_spec(shape: tuple[int, ...], n: int) -> Any:
    """FSDP: the largest dim that ``n`` divides (a last dim only in whole 128 blocks)."""
    from jax.sharding import PartitionSpec as P

    best = None
    for d, size in enumerate(shape):
        whole = d < len(shape) - 1 or (size % n == 0 and (size // n) % 128 == 0)
        if size % n == 0 and whole and (best is None or size > shape[best]):
            best = d
    if best is None:
        return P()
    return P(*(("data" if d == best else None) for d in range(len(shape))))


def _shardings(state, n: int):
    """Per leaf of the train state: params and their optimizer state by :func:`_fsdp_spec`,
    the rest replicated."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    rep = NamedSharding(mesh, P())
    params = jax.tree.map(lambda p: NamedSharding(mesh, _fsdp_spec(p.shape, n)), state.params)
    opt = optax.tree_map_params(
        state.tx, lambda _, s: s, state.opt_state, params, transform_non_params=lambda _: rep
    )
    whole = jax.tree.map(lambda _: rep, state)
    return whole.replace(params=params, opt_state=opt), mesh


def config(name: str, preset: str = "cpu", remat: str = "none", **overrides: Any):
    """``(train_gpt module, its Config, the recipe)`` of config ``name`` (a key of
    :data:`CONFIGS`) on ``preset``, fields of the Config overridden by ``overrides``."""
    sys.path.insert(0, str(ROOT / "examples"))
    import train_gpt as gpt

    _, recipe_name, optimizer = CONFIGS[name]
    fields = {**gpt.PRESETS[preset], **overrides}
    return gpt, gpt.Config(**fields, optimizer=optimizer, remat=remat), gpt.RECIPES[recipe_name]


def state_bytes(gpt, cfg, recipe) -> dict[str, Any]:
    """Bytes per parameter of the params, the optimizer state, their sum, the gradients and
    the FP8 scaling state (from the train state's shapes: nothing is allocated)."""
    import jax

    state = jax.eval_shape(lambda: gpt.init_linen_state(cfg, recipe))
    n = sum(x.size for x in jax.tree.leaves(state.params))
    per = lambda tree: _nbytes(tree) / n
    return {
        "params": n,
        "bytes_per_param": {
            "params": per(state.params),
            "optimizer_state": per(state.opt_state),
            "params_and_optimizer": per((state.params, state.opt_state)),
            "gradients": per(state.params),  # a gradient has its param's dtype
            "fp8_scaling_state": per((state.fp8_meta, state.fp8_probe)),
        },
    }


def activation_bytes(gpt, cfg, recipe) -> dict[str, float]:
    """Residual bytes per token: of one more layer (and of them, the ``[seq, seq]`` arrays),
    and of the whole model (embedding and logits included): one more batch of one more
    layer."""
    tokens = cfg.batch * cfg.seq
    marginal = {}
    for layers in (cfg.layers, cfg.layers + 1):
        c = dataclasses.replace(cfg, layers=layers)
        small = _residuals(gpt, c, recipe, cfg.batch)
        large = _residuals(gpt, c, recipe, 2 * cfg.batch)
        marginal[layers] = [(large[i] - small[i]) / tokens for i in range(2)]
    return {
        "per_token_per_layer": marginal[cfg.layers + 1][0] - marginal[cfg.layers][0],
        "per_token_per_layer_seq_x_seq": marginal[cfg.layers + 1][1] - marginal[cfg.layers][1],
        "per_token_whole_model": marginal[cfg.layers][0],
    }


def step_bytes(gpt, cfg, recipe, fsdp: int = 1) -> dict[str, int]:
    """The compiled train step's memory per device (XLA's memory analysis), the state donated;
    with ``fsdp > 1`` params and optimizer state sharded over that many devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    state = jax.eval_shape(lambda: gpt.init_linen_state(cfg, recipe))
    train_step = gpt.linen_steps(recipe)[0]
    step = jax.jit(lambda s, x, y: train_step(s, x, y), donate_argnums=0)
    batch = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32)
    if fsdp > 1:
        shardings, mesh = _shardings(state, fsdp)
        state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings
        )
        spec = P("data", None) if cfg.batch % fsdp == 0 else P()
        batch = jax.ShapeDtypeStruct(batch.shape, jnp.int32, sharding=NamedSharding(mesh, spec))
    mem = step.lower(state, batch, batch).compile().memory_analysis()
    # What is live during the step: its arguments, what it writes that does not reuse an argument
    # (the state is donated: the new state aliases the old), and XLA's temp arena. (XLA:CPU's
    # own peak_memory_in_bytes counts the arguments only.)
    peak = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )
    return {
        "temp_bytes": mem.temp_size_in_bytes,
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "peak_bytes": peak,
    }


def measure(
    name: str, preset: str = "cpu", remat: str = "none", fsdp: int = 1, **overrides: Any
) -> dict[str, Any]:
    """The whole report of one config (a key of :data:`CONFIGS`)."""
    gpt, cfg, recipe = config(name, preset, remat, **overrides)
    label, recipe_name, optimizer = CONFIGS[name]
    acts = activation_bytes(gpt, cfg, recipe)
    return {
        "label": label,
        "recipe": recipe_name,
        "optimizer": optimizer,
        "remat": remat,
        "fsdp": fsdp,
        **state_bytes(gpt, cfg, recipe),
        "activations_per_token_per_layer": acts["per_token_per_layer"],
        "activations_per_token_per_layer_seq_x_seq": acts["per_token_per_layer_seq_x_seq"],
        "activations_per_token_whole_model": acts["per_token_whole_model"],
        "step_per_device": step_bytes(gpt, cfg, recipe, fsdp),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`measure`'s reports."""
    lines = [
        "| config | params | optimizer state | params + optimizer | gradients | activations "
        "per token and layer (of which seq x seq) | step temp | step peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, s = r["bytes_per_param"], r["step_per_device"]
        lines.append(
            f"| {r['label']} | {b['params']:.2f} B | {b['optimizer_state']:.2f} B | "
            f"{b['params_and_optimizer']:.2f} B | {b['gradients']:.2f} B | "
            f"{r['activations_per_token_per_layer']:,.0f} B "
            f"({r['activations_per_token_per_layer_seq_x_seq']:,.0f} B) | "
            f"{s['temp_bytes'] / 2**20:.1f} MiB | {s['peak_bytes'] / 2**20:.1f} MiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    names = list(CONFIGS) if args.configs == "all" else args.configs.split(",")
    if bad := [c for c in names if c not in CONFIGS]:
        raise SystemExit(f"--configs: unknown {bad}; choose from {list(CONFIGS)}")
    _set_devices(args.fsdp)
    import jax

    if args.fsdp > jax.device_count():
        raise SystemExit(f"--fsdp {args.fsdp}: only {jax.device_count()} devices")
    overrides = {} if args.batch is None else {"batch": args.batch}
    rows = [measure(c, args.preset, args.remat, args.fsdp, **overrides) for c in names]
    first = rows[0]
    print(
        f"GPT demo, preset {args.preset} ({first['params']:,} params), remat {args.remat}, "
        f"FSDP over {args.fsdp} device(s); {jax.devices()[0].device_kind}, JAX "
        f"{jax.__version__}"
    )
    if args.markdown:
        print(table(rows))
    else:
        for r in rows:
            b, s = r["bytes_per_param"], r["step_per_device"]
            print(
                f"{r['label']:24s} params {b['params']:.2f}  optimizer {b['optimizer_state']:.2f}"
                f"  params+optimizer {b['params_and_optimizer']:.2f}  gradients "
                f"{b['gradients']:.2f} B/param;  activations "
                f"{r['activations_per_token_per_layer']:,.0f} B/token/layer;  step temp "
                f"{s['temp_bytes'] / 2**20:.1f} MiB, peak {s['peak_bytes'] / 2**20:.1f} MiB"
            )
    report = {
        "preset": args.preset,
        "remat": args.remat,
        "fsdp": args.fsdp,
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "configs": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
