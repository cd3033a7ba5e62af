"""The block-scaled recipes on 8 emulated devices: ``layernorm_mlp`` (forward and every
gradient) under data, tensor (column- then row-parallel) and fully-sharded layouts equals the
one-device result within float32 summation order (every layout splits some contracted dim: the
rows, for the weight gradients), and the compiled step reduces no amax across devices (no
all-reduce takes a maximum): block scales are local. (The count of all-reduces is XLA's own
partitioning of the dequantized GEMMs: under FSDP it adds one sum that the FP8-off step does
without.)"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import count
from _shared import rand
from conftest import needs_devices
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax

pytestmark = needs_devices(8)

ROWS, HIDDEN, MLP = 256, 256, 512
RECIPES = {"block": fp8jax.Float8BlockScaling(), "mxfp8": fp8jax.MXFP8BlockScaling()}
# name: (x, w1 (hidden, 1, mlp), w2 (mlp, hidden)) specs on a ("data", "model") = (2, 4) mesh
LAYOUTS = {
    "data": (P("data", None), P(), P()),
    "tensor": (P("data", None), P(None, None, "model"), P("model", None)),  # K of GEMM 2 split
    "fsdp": (P("data", None), P("data", None, None), P("data", None)),
}


def _loss(recipe):
    def loss(x, gamma, w1, w2):
        kw = dict(recipe=recipe, enabled=recipe is not None)
        y = fp8jax.layernorm_mlp(x, gamma, None, w1, w2, layernorm_type="rmsnorm", **kw)
        return jnp.sum(y * jnp.sin(y))

    return jax.value_and_grad(loss, (0, 1, 2, 3))


def _args():
    return (rand((ROWS, HIDDEN), 1), 1 + 0.1 * rand((HIDDEN,), 2), rand((HIDDEN, 1, MLP), 3) * 0.06,
            rand((MLP, HIDDEN), 4) * 0.04)  # fmt: skip


def _sharded(recipe, layout):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    xs, w1s, w2s = LAYOUTS[layout]
    shard = [NamedSharding(mesh, s) for s in (xs, P(), w1s, w2s)]
    fn = jax.jit(_loss(recipe), in_shardings=shard)
    args = [jax.device_put(a, s) for a, s in zip(_args(), shard, strict=True)]
    return fn, args


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(RECIPES))
def test_sharded_equals_one_device(name, layout):
    recipe = RECIPES[name]
    one = jax.jit(_loss(recipe))(*_args())
    fn, args = _sharded(recipe, layout)
    got = fn(*args)
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(one), strict=True):
        scale = float(jnp.max(jnp.abs(c))) or 1.0
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=0, atol=1e-5 * scale)


def _max_all_reduces(hlo: str) -> list[str]:
    """The all-reduce instructions of ``hlo`` whose reduction takes a maximum (an amax)."""
    found = []
    for line in hlo.splitlines():
        if not re.search(r"\sall-reduce(?:-start)?\(", line):
            continue
        name = re.search(r"to_apply=%?([\w.\-]+)", line).group(1)
        body = re.search(rf"%?{re.escape(name)} \(.*?\n\}}", hlo, re.DOTALL)
        if body is None or "maximum" in body.group(0):
            found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_amax_is_reduced_across_devices(layout):
    fn, args = _sharded(RECIPES["block"], layout)
    hlo = fn.lower(*args).compile().as_text()
    assert count(hlo, "all-reduce") > 0  # the gradients' sums are there
    assert _max_all_reduces(hlo) == []
    # the same check sees per-tensor scaling's amax reduction
    fn, args = _sharded(fp8jax.Float8CurrentScaling(), layout)
    assert _max_all_reduces(fn.lower(*args).compile().as_text())
