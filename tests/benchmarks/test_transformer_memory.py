"""benchmarks/transformer_memory.py: a TransformerLayer keeps at most 0.7x the bytes per token of
the BF16 Flax layer for its backward (with flash attention's residuals, as on a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import transformer_memory


@pytest.mark.slow
def test_fp8_layer_keeps_under_0_7_of_bf16():
    r = transformer_memory.run(hidden=128, heads=4, ffn=512, seq=64)
    assert r["ratio_flash"] <= 0.7, r["ratio_flash"]
    assert r["fp8"]["bytes_per_token_flash"] < r["fp8"]["bytes_per_token_as_traced"]
