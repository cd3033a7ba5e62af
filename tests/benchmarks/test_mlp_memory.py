"""benchmarks/mlp_memory.py: the residual bytes of LayerNormMLP, exactly as designed, and the
target ratio to the plain-Flax BF16 block (issue: FP8 <= 0.6x BF16 per token)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import mlp_memory


@pytest.mark.parametrize("acts", [("gelu",), ("silu", "linear")])
def test_fp8_block_keeps_what_it_should_and_under_0_6_of_bf16(acts):
    h, i = 64, 256
    r = mlp_memory.run(h, i, 128, acts)
    k = len(acts)
    # per token: x (bf16, for the norm's backward), mu and rsigma (f32), the norm's output in
    # FP8 transposed (wgrad 1), GEMM1's output (bf16, the activation's input), the activation's
    # output in FP8 transposed (wgrad 2)
    assert r["fp8"]["bytes_per_token"] == 2 * h + 8 + h + 2 * k * i + i
    assert r["ratio_fp8_over_bf16_per_token"] <= 0.6


def test_main_writes_json(tmp_path):
    out = tmp_path / "m.json"
    report = mlp_memory.main(["--hidden", "32", "--intermediate", "64", "--tokens", "16",
                              "--json", str(out)])  # fmt: skip
    assert out.exists() and report["result"]["ratio_fp8_over_bf16_per_token"] <= 0.6
