"""One process of the multi-process FP8 training test (``test_multiprocess.py`` launches two).

Usage: ``python _multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON``.

The process joins the others with ``jax.distributed.initialize`` (coordinator on
``127.0.0.1:PORT``, run by process 0), takes ``LOCAL_DEVICES`` emulated CPU devices of its own
(cross-process collectives on CPU go through Gloo) and builds a ``("data", "model")`` mesh of
shape ``(4, 2)`` over all global devices, laid out so that *both* axes span processes: every
amax all-reduce, over ``data``, over ``model`` or over both, then has to cross the process
boundary. It then runs the three ``DelayedScaling`` train steps of ``test_parallel_train.py``
(same model, data, recipe and step function, imported from there) with the params sharded by
``DEFAULT_RULES`` and writes what the test compares to ``OUT_JSON``: the losses, the final FP8
state and params (gathered to every process), whether the FP8 state is identical on every
local device, and the process/device counts.

``test_parallel_train`` is imported only after ``jax.distributed.initialize``: its module-level
skip mark asks for ``jax.device_count()``, which starts the backend, and the backend must not
start before the distributed runtime is up.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fp8jax.flax import DEFAULT_RULES

LOCAL_DEVICES = 4
MESH_SHAPE = (4, 2)  # (data, model)

_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE.parent):  # tests/distributed (test_parallel_train), tests (_hlo)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def _initialize(process_id: int, num_processes: int, port: int) -> None:
    """Joins the distributed runtime; must run before anything starts the JAX backend."""
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=120,
    )


def _mesh() -> Mesh:
    """A ``(4, 2)`` mesh whose rows (``model`` groups) and columns (``data`` groups) both mix
    the devices of process 0 and process 1 (for two processes of four devices each)."""
    by_process: dict[int, list[jax.Device]] = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        by_process.setdefault(d.process_index, []).append(d)
    procs = sorted(by_process)
    rows = []
    for r in range(MESH_SHAPE[0]):
        # row r holds device r of each process, the process order rotated by r
        order = procs[r % len(procs) :] + procs[: r % len(procs)]
        rows.append([by_process[p][r] for p in order][: MESH_SHAPE[1]])
    return Mesh(np.array(rows), ("data", "model"))


def _put(tree: Any, shardings: Any) -> Any:
    """Places a tree of host values, the same in every process, onto (global) shardings.

    ``jax.device_put`` of a NumPy array onto a sharding that spans processes takes each
    process's own slices of the (identical) global value.
    """
    host = jax.tree.map(np.asarray, jax.device_get(tree))
    return jax.device_put(host, shardings)


def _gather(tree: Any) -> Any:
    """The global value of every leaf as a NumPy array, in every process."""
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def _to_lists(tree: Any) -> dict[str, Any]:
    """``{"wi/amax_history": [...], ...}``: the leaves of a nested dict, keyed by path."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf).tolist()
        for path, leaf in flat
    }


def _run(tp: ModuleType) -> dict[str, Any]:
    """Three sharded DelayedScaling steps of ``tp.MlpBlock``; returns the JSON-ready results."""
    mesh = _mesh()
    model = tp.MlpBlock()
    batches = tp._batches()
    state, boxed = tp._init_state(model, batches[0][0])
    shardings = tp.state_shardings(state, boxed, mesh, DEFAULT_RULES)
    replicated = NamedSharding(mesh, P())
    state = _put(state, shardings)
    data = NamedSharding(mesh, P("data"))
    batches = [_put(b, (data, data)) for b in batches]
    inner = tp._step_fn(model)

    def step(state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, jax.Array]:
        with nn.logical_axis_rules(DEFAULT_RULES):
            return inner(state, x, y)

    jitted = jax.jit(step, out_shardings=(shardings, replicated))
    losses = []
    with jax.set_mesh(mesh):
        for x, y in batches:
            state, loss = jitted(state, x, y)
            losses.append(float(loss.addressable_data(0)))

    meta_identical = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.fp8_meta)[0]:
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        key = "/".join(str(getattr(k, "key", k)) for k in path)
        meta_identical[key] = len(shards) == jax.local_device_count() and all(
            np.array_equal(s, shards[0]) for s in shards
        )
    kernel = state.params["wi"]["kernel"]
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "mesh_processes": [[d.process_index for d in row] for row in mesh.devices],
        "wi_kernel_spec": [None if a is None else str(a) for a in kernel.sharding.spec],
        "wi_kernel_fully_addressable": kernel.is_fully_addressable,
        "losses": losses,
        "fp8_meta": _to_lists(_gather(state.fp8_meta)),
        "fp8_meta_shards_identical": meta_identical,
        "params": _to_lists(_gather(state.params)),
    }


def main(argv: list[str]) -> None:
    process_id, num_processes, port, out = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    _initialize(process_id, num_processes, port)
    tp = importlib.import_module("test_parallel_train")
    result = _run(tp)
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out)  # the test never reads a half-written file
    # every process must be done with its collectives before the coordinator (process 0) leaves
    multihost_utils.sync_global_devices("fp8jax multiprocess worker done")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
