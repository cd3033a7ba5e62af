"""FP8 training across OS processes: 2 processes x 4 emulated CPU devices, one global mesh.

``test_parallel_train.py`` shards the FP8 MLP block over 8 devices of *one* process. Real
clusters run one process per host, and the FP8 state must then agree across processes too:
every amax reduction (the one all-reduce per step that fp8jax's custom calls add) has to cross
the process boundary. Here two worker processes
(``_multiprocess_worker.py``) join with ``jax.distributed.initialize``, each with 4 CPU devices,
and run the three ``DelayedScaling`` steps of ``test_parallel_train`` on a ``(4, 2)``
``("data", "model")`` mesh whose two axes both mix the devices of both processes; the CPU
backend performs the cross-process collectives with Gloo.

Checked: both processes report the same losses, FP8 state and params (bit-identical: they ran
one global computation), each process holds the same FP8 state on all its devices, and the
results match the single-device run of ``test_parallel_train`` (computed in this process on one
CPU device) within the tolerances used there: losses and params ``rtol=2e-5`` (another
reduction order), FP8 scales and amax histories ``rtol=1e-6``, the amaxes of the first layer's
input (the data alone) exactly.

The children get their own environment: ``JAX_PLATFORMS=cpu`` and no
``--xla_force_host_platform_device_count`` from this process's ``XLA_FLAGS`` (they take 4
devices each through ``jax_num_cpu_devices``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import test_parallel_train as tp
from _multiprocess_worker import LOCAL_DEVICES, _to_lists
from conftest import on_cpu

NUM_PROCESSES = 2
TIMEOUT_S = 240
WORKER = Path(__file__).resolve().parent / "_multiprocess_worker.py"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return env


def _tail(path: Path, n: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else "<none>"
    # Gloo reports every connection it makes; those lines say nothing on failure
    lines = [line for line in text.splitlines() if not line.startswith("[Gloo]")]
    return "\n".join(lines)[-n:]


def _launch(tmp_path: Path) -> list[dict[str, Any]]:
    """Runs the workers to completion (or kills them all); returns their JSON results."""
    port = _free_port()
    env = _child_env()
    procs, outs, errs = [], [], []
    try:
        for i in range(NUM_PROCESSES):
            outs.append(tmp_path / f"result{i}.json")
            errs.append(tmp_path / f"stderr{i}.txt")
            with open(errs[i], "wb") as err:
                cmd = [sys.executable, str(WORKER), str(i), str(NUM_PROCESSES), str(port)]
                procs.append(
                    subprocess.Popen(
                        [*cmd, str(outs[i])],
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                    )
                )
        # wait for all; if one fails, the others would wait for it until their own timeouts
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if None not in codes or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    report = "\n".join(
        f"--- process {i}: exit code {code} (None: killed, after {TIMEOUT_S} s or a failure of "
        f"the other process), stderr:\n"
        f"{_tail(errs[i])}"
        for i, code in enumerate(codes)
    )
    assert codes == [0] * NUM_PROCESSES, report
    return [json.loads(out.read_text()) for out in outs]


def test_two_processes_train_like_one_device(tmp_path: Path) -> None:
    results = _launch(tmp_path)

    for i, r in enumerate(results):
        assert r["process_index"] == i
        assert r["process_count"] == NUM_PROCESSES
        assert r["device_count"] == NUM_PROCESSES * LOCAL_DEVICES
        assert r["local_device_count"] == LOCAL_DEVICES
        # every model group (row) and every data group (column) spans both processes
        mesh = np.array(r["mesh_processes"])
        assert mesh.shape == (4, 2)
        for group in [*mesh, *mesh.T]:
            assert set(group) == set(range(NUM_PROCESSES)), mesh
        # the kernel is split over "model", so across processes: no process holds all of it
        assert r["wi_kernel_spec"] == [None, "model"]
        assert not r["wi_kernel_fully_addressable"]
        assert r["fp8_meta_shards_identical"] and all(r["fp8_meta_shards_identical"].values()), r[
            "fp8_meta_shards_identical"
        ]

    # one global computation: both processes see exactly the same values
    drop = lambda r: {k: v for k, v in r.items() if k != "process_index"}
    assert drop(results[0]) == drop(results[1])

    ref_state, ref_losses = on_cpu(tp._single_device_run)
    ref_meta = _to_lists(jax.device_get(ref_state.fp8_meta))
    ref_params = _to_lists(jax.device_get(ref_state.params))
    got = results[0]
    np.testing.assert_allclose(got["losses"], ref_losses, rtol=2e-5)
    assert got["fp8_meta"].keys() == ref_meta.keys()
    assert {"wi/scale", "wi/amax_history", "wo/scale", "wo/amax_history"} <= ref_meta.keys()
    for key, ref in ref_meta.items():
        np.testing.assert_allclose(
            np.array(got["fp8_meta"][key], np.float32), ref, rtol=1e-6, err_msg=key
        )
    # the amaxes of the first layer's input depend on the data only: exact
    np.testing.assert_array_equal(
        np.array(got["fp8_meta"]["wi/amax_history"][0], np.float32), ref_meta["wi/amax_history"][0]
    )
    assert got["params"].keys() == ref_params.keys()
    for key, ref in ref_params.items():
        np.testing.assert_allclose(
            np.array(got["params"][key], np.float32), ref, rtol=2e-5, atol=1e-6, err_msg=key
        )
