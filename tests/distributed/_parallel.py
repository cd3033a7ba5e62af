"""Shared pieces of the parallel-training tests (test_parallel_train.py, test_mlp_parallel.py,
test_transformer_parallel.py): the train step, the train state's shardings from the params'
logical axis names, the comparison with a one-device run, and reading the compiled HLO's
collectives (their meshes are ``_shared.make_mesh``'s)."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax

N_DEVICES = 8


def state_shardings(state, boxed, mesh, rules):
    """The train state's shardings: params by their logical axis names under ``rules``; the
    step, the optimizer state (SGD: none per param) and the FP8 state replicated."""
    with nn.logical_axis_rules(rules):
        specs = nn.get_partition_spec(boxed)
        param_shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)["params"]
    replicated = NamedSharding(mesh, P())
    return state.replace(
        step=replicated,
        params=param_shardings,
        opt_state=jax.tree.map(lambda _: replicated, state.opt_state),
        fp8_meta=jax.tree.map(lambda _: replicated, state.fp8_meta),
        fp8_probe=jax.tree.map(lambda _: replicated, state.fp8_probe),
    )


def mse_step(model, recipe, enabled=True):
    """The train step every parallel test uses: mean squared error of ``model(x)`` against
    ``y`` under ``autocast(enabled, recipe)``, params and probes differentiated, the state
    updated under ``recipe``. Returns ``step(state, x, y) -> (state, loss)``, not jitted."""

    def step(state, x, y):
        def loss_fn(params, probes):
            with fp8jax.autocast(enabled=enabled, recipe=recipe):
                out = model.apply(state.variables(params, probes), x)
            return jnp.mean((out - y) ** 2)

        loss, (grads, probe_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            state.params, state.fp8_probe
        )
        return state.apply_gradients(grads=grads, probe_grads=probe_grads, recipe=recipe), loss

    return step


def train(step, state, batches, mesh):
    """Runs the jitted ``step`` over ``batches`` on ``mesh``; ``(final state, losses)``."""
    losses = []
    with jax.set_mesh(mesh):
        for x, y in batches:
            state, loss = step(state, x, y)
            losses.append(float(loss))
    return state, losses


def assert_like_reference(state, losses, reference, rtol=2e-5, atol=1e-6, meta_rtol=1e-6):
    """Loss and params within float32 reduction order of the single-device run ``reference``
    (``(state, losses)``), FP8 state within ``meta_rtol``; returns both FP8 states."""
    ref_state, ref_losses = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
    jax.tree.map(close, jax.device_get(state.params), jax.device_get(ref_state.params))
    meta, ref_meta = jax.device_get(state.fp8_meta), jax.device_get(ref_state.fp8_meta)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=meta_rtol), meta, ref_meta)
    return meta, ref_meta


def all_reduces(hlo: str) -> list[str]:
    """The all-reduce instructions (sync or async start) of compiled HLO text."""
    return [line for line in hlo.splitlines() if re.search(r"\sall-reduce(?:-start)?\(", line)]


def is_scalar_reduce(line: str) -> bool:
    """Whether an all-reduce reduces ``f32[]`` scalars only (amaxes)."""
    line = re.sub(r"/\*.*?\*/", "", line)  # drop /*index=5*/ comments
    shapes = re.match(r"\s*%\S+ = \(?([^=]*?)\)? all-reduce", line).group(1)
    return all(s.strip() == "f32[]" for s in shapes.split(","))


def gathered_shapes(hlo: str) -> list[tuple[int, ...]]:
    """The result shapes of the all-gathers of compiled HLO text, in order."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather(?:-start)?\(", line)
        if m:
            out.append(tuple(int(d) for d in m.group(1).split(",") if d))
    return out


def gather_key(hlo: str) -> list[tuple[int, ...]]:
    """The all-gathered shapes, each as its sorted dims (a kernel may come in either layout)."""
    return sorted(tuple(sorted(s)) for s in gathered_shapes(hlo))
