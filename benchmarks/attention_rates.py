"""cuDNN's fused attention on an H100, as published: the rates ``cost_model.py`` prices a
``__cudnn$fmha*`` call at. Assumed, never measured by fp8jax, until a GPU run (issue 52)."""

from __future__ import annotations

import itertools
import math

#: cuDNN's fused flash attention on one H100 80GB SXM5 at head dim 128, TFLOP/s by sequence
#: length: the cuDNN bars of FlashAttention-3's figures (Shah, Bikshandi, Zhang, Thakkar, Ramani,
#: Dao, arXiv:2407.08608, 2024: BF16 forward with and without a causal mask, BF16 backward, FP8
#: forward). Published, never measured by fp8jax: assumed until a GPU run (issue 52). NVIDIA's
#: own figure ("Accelerating Transformers with NVIDIA cuDNN 9", NVIDIA technical blog, 2024: up
#: to 1.2 PFLOP/s FP8 on an H200) agrees in scale. FLOPs as the paper counts them: forward
#: ``4 B H Sq Skv D``, halved with a causal mask; the backward 2.5 times the forward's.
CUDNN_ATTENTION_TFLOPS: dict[tuple[str, str, str], dict[int, float]] = {
    ("bf16", "forward", "causal"): {512: 315, 1024: 410, 2048: 484, 4096: 518, 8192: 529,
                                    16384: 539},
    ("bf16", "forward", "no_mask"): {512: 497, 1024: 574, 2048: 617, 4096: 609, 8192: 600,
                                     16384: 595},
    ("bf16", "backward", "no_mask"): {512: 305, 1024: 408, 2048: 465, 4096: 499, 8192: 518,
                                      16384: 516},
    ("fp8", "forward", "no_mask"): {512: 617, 1024: 751, 2048: 886, 4096: 864, 8192: 971,
                                    16384: 1005},
}  # fmt: skip


def interpolated(points: dict[int, float], seq: int) -> float:
    """``points`` (TFLOP/s by sequence length) at ``seq``, linear in log2(seq), clamped."""
    xs = sorted(points)
    x = min(max(math.log2(max(seq, 1)), math.log2(xs[0])), math.log2(xs[-1]))
    for lo, hi in itertools.pairwise(xs):
        a, b = math.log2(lo), math.log2(hi)
        if a <= x <= b:
            return points[lo] + (points[hi] - points[lo]) * (x - a) / (b - a)
    return points[xs[0]]


def cudnn_attention_tflops(kind: str, direction: str, causal: bool, seq: int) -> float:
    """The assumed rate of :data:`CUDNN_ATTENTION_TFLOPS` for ``kind`` (``"bf16"``/``"fp8"``),
    ``direction`` (``"forward"``/``"backward"``), mask and sequence length. Figures not
    published are derived (assumed too): a causal backward scales the backward by the causal
    forward's share of the unmasked one, and FP8 scales BF16 by the unmasked forward's FP8/BF16
    ratio (the backward's FP8 gain is not published)."""

    def at(k: str, d: str, mask: str) -> float:
        return interpolated(CUDNN_ATTENTION_TFLOPS[(k, d, mask)], seq)

    mask = "causal" if causal else "no_mask"
    if direction == "forward":
        rate = at("bf16", "forward", mask)
    else:
        rate = at("bf16", "backward", "no_mask")
        rate *= at("bf16", "forward", mask) / at("bf16", "forward", "no_mask")
    if kind == "fp8":
        rate *= at("fp8", "forward", "no_mask") / at("bf16", "forward", "no_mask")
    return rate
