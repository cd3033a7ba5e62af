"""benchmarks/e2e.py and benchmarks/_workloads.py: the four variants of every workload start from
the same weights, the report says what it measured (ratios, checks, the Markdown table), and
``--allow-cpu`` runs end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _workloads
import e2e


def _variant(ms: float, loss: float = 1.0, cudnn: int = 0, **program: int) -> dict:
    counts = {"fp8jax_gemm": 0, "fp8jax_kernels": 0, "xla_fp8_gemm": 0, "cudnn_attention": cudnn}
    return {"median_step_ms": ms, "tokens_per_s": 1000 / ms, "loss_first": 2.0,
            "loss_final": loss, "compile_s": 1.0, "program": counts | program}  # fmt: skip


def test_summary_ratios_are_speedups_of_fp8_and_checks_say_what_held():
    variants = {"fp8": _variant(10.0, fp8jax_gemm=6), "bf16": _variant(16.0, loss=1.02),
                "flax_fp8": _variant(10.0, xla_fp8_gemm=6), "fp8_xla": _variant(12.0)}  # fmt: skip
    s = e2e.summarize("layernorm_mlp", variants, gpu=True)
    assert s["ratios"] == {"fp8_vs_fp8_xla": 1.2, "fp8_vs_flax_fp8": 1.0, "fp8_vs_bf16": 1.6}
    assert s["checks"] == {
        "fp8_loss_within_5pct_of_bf16": True,
        "same_first_loss_within_2pct": True,
        "same_attention_in_every_variant": True,
        "fp8_runs_fp8jax_gemm": True,
        "flax_fp8_runs_xla_fp8_gemm": True,
        "meets_fp8_vs_bf16_1.6x": True,
        "meets_fp8_vs_fp8_xla_1.1x": True,
    }
    variants["bf16"] = _variant(16.0, loss=2.0, cudnn=1)  # another attention, another loss
    s = e2e.summarize("layernorm_mlp", variants, gpu=False)
    assert not s["checks"]["fp8_loss_within_5pct_of_bf16"]
    assert not s["checks"]["same_attention_in_every_variant"]
    assert "fp8_runs_fp8jax_gemm" not in s["checks"]  # the CPU has no fp8jax GEMM kernel


def test_table_has_a_row_per_measured_variant():
    report = {
        "env": {"device": "NVIDIA H100", "driver": "580", "jax": "0.11.2", "jaxlib": "0.11.2",
                "flax": "0.12", "git_commit": "abc", "source_digest": "d", "timestamp": "t"},
        "config": {"iters": 10, "inner": 10, "warmup": 3, "attention": "xla"},
        "workloads": {"gpt-small": {"variants": {"fp8": _variant(10.0), "bf16": _variant(15.0)},
                                    "ratios": {"fp8_vs_bf16": 1.5}}},
        "not_run": ["gpt-small/flax_fp8"],
    }  # fmt: skip
    report["workloads"]["gpt-small"]["failed"] = {"fp8_xla": "XlaRuntimeError: RESOURCE_EXHAUSTED"}
    text = e2e.table(report)
    assert "| gpt-small | bf16 | 15.00 | 67 | 1.50x | 2.0000 -> 1.0000 |" in text
    assert "| gpt-small | fp8 | 10.00 | 100 |  |" in text
    assert "Not run (deadline): gpt-small/flax_fp8" in text
    assert "Failed: gpt-small/fp8_xla (XlaRuntimeError)" in text


@pytest.mark.skipif(e2e.on_gpu(), reason="a CUDA device is present: main() would run full size")
def test_without_gpu_it_skips_and_bad_workloads_are_refused(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    assert e2e.main(["--json", str(out)]) == 0
    assert json.loads(out.read_text())["skipped"]
    with pytest.raises(SystemExit):
        e2e.main(["--workloads", "nope"])
    assert "--workloads: unknown ['nope']" in capsys.readouterr().err


def test_every_variant_of_every_workload_builds_from_fp8jax_weights():
    """Traced only: the Flax variants' init checks that fp8jax's params, reshaped, are exactly
    the Flax model's tree; every step takes its state and a batch."""
    for name in _workloads.WORKLOADS[:3]:  # gpt-medium is gpt-small at CPU sizes
        wl = _workloads.build(name, _workloads.SIZES[name]["cpu"])
        for variant in _workloads.VARIANTS:
            state, batch = wl.abstract(variant)
            new_state, loss = jax.eval_shape(wl.steps[variant], state, batch)
            assert loss.shape == ()
            assert jax.tree.structure(new_state) == jax.tree.structure(state), (name, variant)


def test_bad_workload_arguments():
    with pytest.raises(ValueError, match="workload must be one of"):
        _workloads.build("nope", {})
    with pytest.raises(ValueError, match="attention must be 'xla' or 'cudnn'"):
        _workloads.build("layernorm_mlp", _workloads.SIZES["layernorm_mlp"]["cpu"], "flash")


@pytest.mark.slow  # (compiles four TransformerLayer steps: about a minute on 2 loaded cores)
def test_the_variants_start_from_the_same_loss():
    """Same weights, same batch: the first losses agree to FP8's rounding of one forward pass
    (with rotary embeddings, as the GPT's layers; e2e.py checks the GPT's own in every run)."""
    sizes = _workloads.SIZES["transformer_layer"]["cpu"] | {"rotary": True}
    wl = _workloads.build("transformer_layer", sizes)
    batch = wl.batches(1)[0]
    losses = {v: float(jax.jit(wl.steps[v])(wl.init[v](), batch)[1]) for v in _workloads.VARIANTS}
    assert max(losses.values()) - min(losses.values()) < 0.02 * losses["bf16"], losses


@pytest.mark.slow  # (compiles the four LayerNormMLP steps)
def test_allow_cpu_end_to_end(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    argv = ["--allow-cpu", "--workloads", "layernorm_mlp", "--iters", "1", "--inner", "2",
            "--warmup", "1", "--json", str(out)]  # fmt: skip
    assert e2e.main(argv) == 0
    report = json.loads(out.read_text())
    w = report["workloads"]["layernorm_mlp"]
    assert list(w["variants"]) == list(e2e.RUN_ORDER)
    assert set(w["ratios"]) == {"fp8_vs_bf16", "fp8_vs_flax_fp8", "fp8_vs_fp8_xla"}
    assert w["checks"]["fp8_loss_within_5pct_of_bf16"]
    for r in w["variants"].values():
        assert len(r["step_s"]) == 1 and len(r["losses"]) == 3
    for key in ("device", "driver", "jax", "jaxlib", "flax", "git_commit", "source_digest"):
        assert key in report["env"]
    assert e2e.main(["--table", str(out)]) == 0
    assert "| layernorm_mlp | fp8_xla |" in capsys.readouterr().out
