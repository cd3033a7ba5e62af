"""The tools behind docs/performance.md's memory table and docs/numerics.md's state-error table:
tools/memory_report.py (bytes per parameter of the GPT demo model: issue 39's targets, 12 ->
<= 6.1 -> <= 4.1 bytes for params and optimizer state) and tools/optimizer_state_error.py (on a
tiny model, a few steps)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import memory_report
import optimizer_state_error


def test_bytes_per_parameter_of_the_demo_model_meet_the_targets():
    per = {}
    for name in memory_report.CONFIGS:
        gpt, cfg, recipe = memory_report.config(name)
        report = memory_report.state_bytes(gpt, cfg, recipe)
        assert report["params"] == 427_264
        per[name] = report["bytes_per_param"]
    assert per["bf16_adam"]["params_and_optimizer"] == pytest.approx(12.0, abs=1e-4)
    assert per["fp8_adam"]["params_and_optimizer"] == pytest.approx(12.0, abs=1e-4)
    # 4 + 2 codes + 8 bytes of scales per 128 elements (every last dim here is 128's multiple)
    assert per["fp8_fp8adam"]["params_and_optimizer"] == pytest.approx(4 + 2 + 8 / 128, abs=1e-4)
    assert per["fp8_fp8adam"]["params_and_optimizer"] <= 6.1
    assert per["bf16params_fp8adam"]["params_and_optimizer"] <= 4.1
    assert per["bf16params_fp8adam"]["gradients"] == 2.0
    assert 0 < per["fp8_adam"]["fp8_scaling_state"] < 0.01  # delayed scaling: a few rows


SMALL = dict(layers=1, hidden=128, heads=2, mlp=256, seq=32, batch=2)


@pytest.mark.slow  # traces the demo model's backward 8 times (1-2 minutes on 2 busy cores)
def test_activations_of_a_small_model():
    acts = {}
    for name in ("bf16_adam", "fp8_fp8adam"):
        acts[name] = memory_report.activation_bytes(*memory_report.config(name, **SMALL))
    assert 0 < acts["fp8_fp8adam"]["per_token_per_layer"] < acts["bf16_adam"]["per_token_per_layer"]
    assert acts["bf16_adam"]["per_token_per_layer_seq_x_seq"] > 0  # XLA's attention: [seq, seq]


@pytest.mark.parametrize("batch", [4, 2])
def test_seq_x_seq_activations_when_the_batch_matches_the_heads(batch):
    """The "of which seq x seq" share is the attention's probabilities, however the dims
    coincide: with hidden == seq and batch (4) or the doubled batch of the marginal (2 * 2)
    equal to the heads, a [layers, batch, seq, hidden] activation has the shape of
    [layers, heads, seq, seq] probabilities, which the report took for them before
    (-512 B and 10,240 B per token and layer instead of 3,072 B on the CPU preset)."""
    heads, seq = 4, 64
    cfg = dict(layers=1, hidden=seq, heads=heads, mlp=128, seq=seq, batch=batch)
    acts = memory_report.activation_bytes(*memory_report.config("bf16_adam", **cfg))
    # Independently, from the config: XLA's attention on CPU keeps, per query token and head,
    # a row of `seq` probabilities twice: softmax's float32 output (4 B) and the probabilities
    # in the layers' compute dtype, bfloat16 (2 B), for the value GEMM's gradient.
    assert acts["per_token_per_layer_seq_x_seq"] == heads * seq * (4 + 2)
    assert acts["per_token_per_layer"] > acts["per_token_per_layer_seq_x_seq"]


@pytest.mark.slow  # compiles a train step of the demo model (a minute on 2 busy cores)
def test_the_compiled_step_of_a_small_model():
    gpt, cfg, recipe = memory_report.config("fp8_fp8adam", **SMALL)
    step = memory_report.step_bytes(gpt, cfg, recipe)
    # the arguments: the train state (6.06 bytes a param) and two batches of tokens
    state = memory_report.state_bytes(gpt, cfg, recipe)
    assert step["argument_bytes"] >= state["params"] * 6.06
    assert step["peak_bytes"] >= step["temp_bytes"] > 0
    with pytest.raises(SystemExit, match="--fsdp 64: only"):
        memory_report.main(["--fsdp", "64", "--configs", "bf16_adam"])


def test_every_candidate_representation_round_trips():
    """Each representation of the state-error table comes back near a moment-like input: the
    first moment within E4M3's/E5M2's/int8's/bfloat16's rounding, sqrt(v) too."""
    import jax
    import jax.numpy as jnp
    from _shared import rand

    m = rand((4, 256), seed=1) * 1e-3
    v = rand((4, 256), seed=2) ** 2 * 1e-6 + 1e-9
    key = jax.random.key(0)
    for name, (mr, vr) in optimizer_state_error.CANDIDATES.items():
        back_m = np.asarray(jax.jit(mr.round_trip)(m, key))
        back_v = np.asarray(jax.jit(vr.round_trip)(v, key))
        rel_m = np.linalg.norm(back_m - np.asarray(m)) / np.linalg.norm(np.asarray(m))
        rel_v = np.linalg.norm(np.sqrt(back_v) - np.sqrt(np.asarray(v))) / np.linalg.norm(
            np.sqrt(np.asarray(v))
        )
        assert rel_m < 0.1 and rel_v < 0.1, (name, rel_m, rel_v)
        assert back_v.min() > 0, name  # every candidate keeps a positive v positive
    assert jnp.float8_e4m3fn is optimizer_state_error.E4M3


@pytest.mark.slow  # trains a tiny GPT 2 steps with shadows (minutes on 2 busy cores)
def test_state_error_tool_runs_its_shadows():
    names = ("E4M3 m, uint8 sqrt(v) (fp8jax)", "bfloat16 m and v (4 B, no scales)")
    small = dict(layers=1, hidden=128, heads=2, mlp=256, seq=16, batch=2)
    report = optimizer_state_error.run(2, [2], max_bytes=200_000, names=names, **small)
    rows = report["steps"][2]
    assert set(rows) == set(names)
    assert 0 < rows[names[1]]["update_err"] < rows[names[0]]["update_err"] < 0.2
    assert report["round_trip"]["sqrt(v) of uint8 sqrt(v) (fp8jax)"]["to_zero"] == 0
    assert "| E4M3 m, uint8 sqrt(v) (fp8jax) | " in optimizer_state_error.tables(report)
