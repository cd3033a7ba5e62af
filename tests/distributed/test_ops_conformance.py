"""Every op on a device mesh equals the op on one device (the conformance suite's mesh check).

Run on 8 emulated CPU devices (``tools/test.sh`` does). Each op's conformance sample (the
``SAMPLES`` of its tests/ops/test_<op>.py, collected by tests/ops/_samples.py) with its first
operand's leading (batch-ish) dim split over 8 devices, or over the ``data`` axis of a
2 x 4 mesh (replicated over ``model``), the other operands replicated: under both
implementations, every device's block of every output has the one-device call's bits; an output
summed over the rows (``Sample.sums``: dbias, dgamma) is added across devices in another order,
so it is held to the sample's tolerance. The per-op files (test_ops_sharding*.py,
test_norm_sharding.py, test_act_dbias_sharding.py) check the collectives and the other splits.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from _samples import cases
from _samples import sample as get_sample
from _shared import make_mesh
from _values import assert_matches
from conftest import needs_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pytestmark = needs_devices(8)

SPLITS = {"8-data": ("8", P("data")), "2x4-data": ("2x4", P("data"))}
SUM_CLOSE = {"rtol": 1e-6, "atol": 1e-6}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("case", cases(), ids="-".join)
def test_sharded_equals_one_device(case, split):
    s = get_sample(*case)
    mesh_name, spec = SPLITS[split]
    mesh = make_mesh(mesh_name)
    operands = list(s.operands().values())
    one = jax.devices()[0]
    placed = [
        jax.device_put(a, NamedSharding(mesh, spec if i == 0 else P()))
        for i, a in enumerate(operands)
    ]
    for impl in ("kernel", "xla"):
        f = jax.jit(functools.partial(s.call, implementation=impl))
        want = f(*(jax.device_put(a, one) for a in operands))
        got = f(*placed)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.shape == w.shape and g.dtype == w.dtype, (impl, i)
            w = np.asarray(w)
            tol = dict(s.close or SUM_CLOSE) if i in s.sums else {}
            for shard in g.addressable_shards:
                assert_matches(np.asarray(shard.data), w[shard.index], not tol, **tol)
