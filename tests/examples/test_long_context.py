"""examples/long_context.py: run as its docstring says (a subprocess on 8 emulated CPU devices),
it exits 0 having printed both claims, and what it printed holds them: the one-device train
step over the budget, each context-parallel device's under it, the loss falling; its batches
are the pattern it says, in TE's load-balancing order."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from _example import EXAMPLES, example

import fp8jax

EXAMPLE = EXAMPLES / "long_context.py"


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *argv], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_trains_past_one_devices_budget():
    done = _run()
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    mem = re.search(r"budget ([\d.]+) MiB.*one device ([\d.]+) MiB.*devices ([\d.]+) MiB", out)
    assert mem, out
    budget, one, each = map(float, mem.groups())
    assert each <= budget < one, out
    assert one > 4 * each, out  # the [S, S] attention arrays are gone, not just split
    losses = [float(v) for v in re.findall(r"step +\d+ +loss ([\d.]+)", out)]
    assert len(losses) == 12, out
    assert abs(losses[0] - float(jnp.log(64))) < 1e-3, losses  # the zero head
    assert losses[-1] < losses[0] / 4, losses
    assert "one device exceeds the budget, 8 fit it" in out and "loss fell" in out, out


@pytest.mark.slow
def test_a_budget_one_device_fits_fails_the_run():
    done = _run("--length", "256", "--steps", "1", "--budget-mb", "1000")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "MEMORY CLAIM FAILED" in done.stdout, done.stdout


def test_batches_are_the_shifted_pattern_in_balanced_order():
    with example("long_context") as module:
        args = module.parse_args(["--length", "64", "--batch", "3"])
        tokens, targets = module.batch(jax.random.key(0), args)
    back = [fp8jax.inverse_reorder_causal_load_balancing(t, module.BALANCE, 8, 1)
            for t in (tokens, targets)]  # fmt: skip
    assert tokens.shape == targets.shape == (3, 64)
    assert (back[1][:, :-1] == back[0][:, 1:]).all()  # targets: the next tokens
    assert not (tokens == back[0]).all()  # reordered
    # one fixed cycle: each token is always followed by the same one
    follows = {}
    for t, n in zip(back[0].ravel().tolist(), back[1].ravel().tolist(), strict=True):
        assert follows.setdefault(t, n) == n
