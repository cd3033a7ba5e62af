"""examples/train_gpt.py: a shortened run of the demo (FP8 delayed scaling and BF16 on the same
data, same initial params) writes every report, both runs learn, and FP8 ends within 3% of BF16
(the full default run is within 1%; see docs/convergence.md). ``--api nnx``: the FP8 run of the
Flax NNX model learns, checkpoints and resumes (its FP8-vs-BF16 comparison is the Linen run's:
the NNX train step equals the Linen one bit for bit, tests/nnx/test_nnx_train.py).
``--preset cpu-moe``: a few FP8 steps of the mixture of experts in either API; the NNX train loss
includes the MoE layers' load-balancing losses, as the Linen one does."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from _example import EXAMPLES, example

EXAMPLE = EXAMPLES / "train_gpt.py"


@pytest.fixture(scope="module")
def train_gpt():
    with example("train_gpt") as module:
        yield module


@pytest.mark.slow
def test_short_run_reports_and_fp8_tracks_bf16(train_gpt, tmp_path, capsys):
    out = tmp_path / "runs"
    summary = train_gpt.main(["--steps", "80", "--out", str(out), "--max-bytes", "2000000"])
    for name in ("metrics.csv", "summary.json", "summary.md", "samples.txt", "loss.png"):
        assert (out / name).stat().st_size > 0, name
    # stdout is not a terminal here: the progress is in the log, a line per evaluation
    printed = capsys.readouterr().out
    for run in ("fp8", "bf16"):
        assert f"{run}: compiling the train step" in printed
        evals = [line for line in printed.splitlines() if line.startswith(f"{run}: step ")]
        assert len(evals) == 4 and all("tokens/s" in line for line in evals), evals
    import matplotlib.pyplot as plt

    assert len(plt.gcf().axes) == 2  # the curves, and FP8 minus BF16 below them
    assert (out / "checkpoints" / "fp8").is_dir() and (out / "checkpoints" / "bf16").is_dir()
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert runs == summary["runs"]
    fp8, bf16 = runs["fp8"]["final_val_loss"], runs["bf16"]["final_val_loss"]
    assert bf16 < 3.0 and fp8 < 3.0, runs  # from ln(256) = 5.55 nats per byte at the start
    assert abs(fp8 - bf16) / bf16 < 0.03, runs
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert len(rows) == 160 and {r["run"] for r in rows} == {"fp8", "bf16"}
    # --resume continues from the checkpoints to a larger step count
    again = train_gpt.main(["--steps", "84", "--out", str(out), "--max-bytes", "2000000",
                            "--resume", "--recipes", "fp8"])  # fmt: skip
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == list(range(1, 85))
    assert again["runs"]["fp8"]["final_val_loss"] < 3.0


@pytest.mark.slow
def test_short_nnx_run_learns_checkpoints_and_resumes(train_gpt, tmp_path):
    out, data = tmp_path / "runs", ["--max-bytes", "2000000", "--recipes", "fp8"]
    summary = train_gpt.main(["--api", "nnx", "--steps", "40", "--out", str(out), *data])
    for name in ("metrics.csv", "summary.json", "summary.md", "samples.txt"):
        assert (out / name).stat().st_size > 0, name
    assert json.loads((out / "summary.json").read_text())["api"] == summary["api"] == "nnx"
    fp8 = summary["runs"]["fp8"]["final_val_loss"]
    assert fp8 < 3.0, summary["runs"]  # 2.76 measured; 5.58 at the start
    # the checkpoint holds the params, the optimizer and the FP8 state of the delayed run
    api = train_gpt.APIS["nnx"]
    cfg = train_gpt.Config(**{**train_gpt.PRESETS["cpu"], "steps": 40})
    state = api.init(cfg, train_gpt.RECIPES["fp8"])
    scale = state.model.layers.mlp.fp8_meta.scale
    assert (scale[...] == 1).all()
    state = train_gpt.restore(api, state, (out / "checkpoints" / "nnx-fp8").absolute())
    assert api.step(state) == 40 and (scale[...] != 1).all()
    again = train_gpt.main(["--api", "nnx", "--steps", "44", "--out", str(out), *data,
                            "--resume"])  # fmt: skip
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == list(range(1, 45))
    assert again["runs"]["fp8"]["final_val_loss"] < fp8


@pytest.mark.slow  # compiles the MoE train and eval steps (most of a minute on 2 cores)
def test_moe_preset_trains_a_few_fp8_steps(train_gpt, tmp_path):
    """--preset cpu-moe (8 experts, top-2, every MLP a MoEBlock): two FP8 steps run and report
    a finite loss below the start, and the FP8 state has one row per expert and tensor; the
    full runs (delayed, block, BF16) are docs/convergence.md's."""
    out = tmp_path / "runs"
    summary = train_gpt.main(["--preset", "cpu-moe", "--steps", "2", "--out", str(out),
                              "--max-bytes", "300000", "--recipes", "fp8"])  # fmt: skip
    for name in ("fp8",):
        loss = summary["runs"][name]["final_val_loss"]
        assert 0 < loss < 5.6, summary["runs"]  # ln(256) = 5.55 at the start
    cfg = train_gpt.Config(**{**train_gpt.PRESETS["cpu-moe"], "steps": 3})
    state = train_gpt.APIS["linen"].init(cfg, train_gpt.RECIPES["fp8"])
    scale = state.fp8_meta["blocks"]["layer"]["mlp"]["scale"]
    assert scale.shape == (cfg.layers, 6 * cfg.experts)  # scanned layers x (2 GEMMs x 3 E)


def test_fp8_dpa_recipe_trains_fp8_attention(train_gpt, tmp_path):
    """--recipes fp8-dpa: the FP8 run with TransformerLayer(fp8_dpa=True), whose attention keeps
    its own 15 FP8 roles per layer; two steps learn (the five-seed runs: docs/convergence.md)."""
    out = tmp_path / "runs"
    summary = train_gpt.main(["--steps", "2", "--out", str(out), "--max-bytes", "300000",
                              "--recipes", "fp8-dpa"])  # fmt: skip
    assert 0 < summary["runs"]["fp8-dpa"]["final_val_loss"] < 5.6
    cfg = train_gpt.Config(**{**train_gpt.PRESETS["cpu"], "steps": 3}, fp8_dpa=True)
    state = train_gpt.APIS["linen"].init(cfg, train_gpt.RECIPES["fp8-dpa"])
    attention = state.fp8_meta["blocks"]["layer"]["attention"]["attention"]
    assert attention["scale"].shape == (cfg.layers, 15)


def test_attention_error_tool():
    """tools/attention_error.py (docs/numerics.md's per-layer table) on the demo model after
    two BF16 steps: one row per layer, every error a few percent (FP8's 2**-4 rounding)."""
    sys.path.insert(0, str(EXAMPLES.parent / "tools"))
    import attention_error as tool

    train_gpt_module = tool.train_gpt
    cfg = train_gpt_module.Config(**{**train_gpt_module.PRESETS["cpu"], "steps": 4})
    train, val, _ = train_gpt_module.load_text(None, 300_000)
    params = tool.trained(cfg, 2, train)
    rows = tool.layer_errors(cfg, params, *train_gpt_module.batch_at(val, cfg, 0, salt=1))
    assert [r["layer"] for r in rows] == list(range(cfg.layers))
    for r in rows:
        assert all(0 < r[k] < 0.25 for k in ("out", "dq", "dk", "dv")), r
    assert "| layer | output |" in tool.table(rows)


@pytest.mark.slow  # compiles the NNX MoE train step and two forwards (about a minute on 2 cores)
def test_nnx_moe_preset_adds_the_load_balancing_loss(train_gpt, tmp_path):
    """--api nnx --preset cpu-moe: two FP8 steps run, and the first step's train loss is the
    cross-entropy plus every layer's load-balancing loss (sown by its MoEBlock inside the
    ``nnx.scan``), as Linen's train step adds its ``intermediates``."""
    import jax.numpy as jnp
    from flax import nnx

    out, data = tmp_path / "runs", ["--max-bytes", "300000", "--recipes", "fp8"]
    summary = train_gpt.main(["--api", "nnx", "--preset", "cpu-moe", "--steps", "2",
                              "--out", str(out), *data])  # fmt: skip
    assert 0 < summary["runs"]["fp8"]["final_val_loss"] < 5.6, summary["runs"]
    first = float(next(csv.DictReader(open(out / "metrics.csv")))["train_loss"])
    # the same initial model and first batch, forward only: cross-entropy and the sown losses
    cfg = train_gpt.Config(**{**train_gpt.PRESETS["cpu-moe"], "steps": 2})
    recipe = train_gpt.RECIPES["fp8"]
    state = train_gpt.APIS["nnx"].init(cfg, recipe)
    tokens, targets = train_gpt.batch_at(train_gpt.load_text(None, 300000)[0], cfg, 0)

    @nnx.jit
    def forward(model, tokens):
        with train_gpt.fp8jax.autocast(enabled=True, recipe=recipe):
            return model.forward_with_aux(tokens)

    logits, aux = forward(state.model, tokens)
    aux = float(aux)
    # TE's loss is the coefficient times about 1 per layer when the router is balanced
    assert 0.9 < aux / (cfg.layers * train_gpt.AUX_LOSS_COEFF) < 2, aux
    ce = float(train_gpt.loss_of(logits, targets))
    assert abs(first - (ce + aux)) < 0.05 * aux, (first, ce, aux)
    assert jnp.shape(state.model.layers.mlp.fp8_meta.scale) == (cfg.layers, 6 * cfg.experts)


def test_bad_arguments(train_gpt, tmp_path):
    with pytest.raises(SystemExit):
        train_gpt.main(["--recipes", "fp9", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        train_gpt.main(["--api", "bogus", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        train_gpt.main(["--optimizer", "adamw,adam9", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="does not exist"):
        train_gpt.main(["--data", str(tmp_path / "missing"), "--out", str(tmp_path)])


def test_help_imports_nothing():
    """tools/demo.sh --help runs this before any setup: no JAX, Flax or fp8jax is imported."""
    guard = (
        "import builtins, runpy, sys\n"
        "real = builtins.__import__\n"
        "def imp(name, *a, **k):\n"
        "    if name.split('.')[0] in ('jax', 'flax', 'fp8jax', 'numpy', 'optax'):\n"
        "        raise ImportError('imported ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = imp\n"
        f"sys.argv = [{str(EXAMPLE)!r}, '--help']\n"
        f"runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", guard], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "--seed" in proc.stdout and "--recipes" in proc.stdout


def test_command_line_names_match_the_tables(train_gpt):
    assert train_gpt.RECIPE_NAMES == tuple(train_gpt.RECIPES)
    assert train_gpt.API_NAMES == tuple(train_gpt.APIS)
    assert train_gpt.OPTIMIZER_NAMES == tuple(train_gpt.OPTIMIZERS)


def test_fp8_optimizer_with_bfloat16_params(train_gpt):
    """--optimizer adamw_fp8_bf16: the demo's params are bfloat16 and its AdamW (after the
    clipping) keeps E4M3 and uint8 codes (issue 39); nothing is trained."""
    import jax
    import jax.numpy as jnp

    small = {"layers": 1, "seq": 16, "batch": 2, "optimizer": "adamw_fp8_bf16"}
    cfg = train_gpt.Config(**{**train_gpt.PRESETS["cpu"], **small})
    state = train_gpt.init_linen_state(cfg, None)
    assert {p.dtype for p in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw's chain -> its Adam
    assert {c.dtype for c in jax.tree.leaves(adam.mu.codes)} == {jnp.dtype(jnp.float8_e4m3fn)}
    assert {c.dtype for c in jax.tree.leaves(adam.nu.codes)} == {jnp.dtype(jnp.uint8)}
