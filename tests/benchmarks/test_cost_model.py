"""benchmarks/hlo_graph.py, cost_model.py, calibration.py and attention_rates.py: the HLO is
read as written, the model
counts the bytes and FLOPs it says it counts, and its calibration reproduces the measurements."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import attention_rates
import calibration
import cost_model as cm
import hlo_graph as hg

# unit bandwidths: a unit's seconds are then its bytes (plus the launch)
PROBE = cm.Bandwidths(1.0, 1.0, (("cast_transpose", 2.0),))


def _units(text: str) -> list[cm.Unit]:
    return cm.predict(text, PROBE).units


def test_parse_instr_reads_tuples_comments_and_attributes():
    line = (
        "  ROOT ffi.7 = (f8e4m3fn[4,16]{1,0}, /*index=1*/f32[]) custom-call(a.1, b.2), "
        'custom_call_target="fp8jax_cast_transpose", backend_config={x = 1 : i64}'
    )
    instr, root = hg.parse_instr(line)
    assert root and instr.name == "ffi.7" and instr.op == "custom-call"
    assert instr.arrays == (hg.Array("f8e4m3fn", (4, 16)), hg.Array("f32", ()))
    assert instr.operands == ["a.1", "b.2"]
    assert hg.attr(instr.attrs, "custom_call_target") == '"fp8jax_cast_transpose"'
    dot, _ = hg.parse_instr(
        "d = f32[2,3]{1,0} dot(x, y), lhs_contracting_dims={1}, rhs_contracting_dims={0}"
    )
    assert hg.dims(dot.attrs, "lhs_contracting_dims") == (1,)
    assert hg.parse_instr("HloModule m, entry_computation_layout={()->f32[]}") is None


CALLS = """HloModule m

inner.1 {
  p.1 = f32[8]{0} parameter(0)
  ROOT n.1 = f32[8]{0} negate(p.1)
}

ENTRY main.2 {
  x.1 = f32[8]{0} parameter(0)
  c.1 = f32[8]{0} call(x.1), to_apply=inner.1
  t.1 = (f32[8]{0}, f32[8]{0}) tuple(c.1, x.1)
  g.1 = f32[8]{0} get-tuple-element(t.1), index=0
  ROOT e.1 = f32[8]{0} exponential(g.1)
}
"""


def test_graph_inlines_calls_and_resolves_tuples():
    g = hg.Graph(CALLS)
    assert [n.op for n in g.nodes] == ["parameter", "negate", "exponential"]
    exp = g.nodes[2]
    assert g.producer(exp.inputs[0]).op == "negate"  # through the tuple and its element
    assert [g.producer(v).op for v in g.live_out] == ["exponential"]


ELEMENTWISE = """HloModule m

ENTRY main {
  x = bf16[1024,1024]{1,0} parameter(0)
  c = f32[1024,1024]{1,0} convert(x)
  r = f32[1024,1024]{1,0} reshape(c)
  m = f32[1024,1024]{1,0} multiply(r, r)
  ROOT o = bf16[1024,1024]{1,0} convert(m)
}
"""


def test_a_chain_of_elementwise_ops_is_one_fusion():
    (u,) = _units(ELEMENTWISE)
    assert u.kind == "fusion"
    assert u.bytes == 2 * 2 * 1024 * 1024  # x read once, o written once


SIBLINGS = """HloModule m

region {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT m = f32[] maximum(a, b)
}

ENTRY main {
  x = bf16[1024,1024]{1,0} parameter(0)
  s = f32[] parameter(1)
  c = f32[1024,1024]{1,0} convert(x)
  sb = f32[1024,1024]{1,0} broadcast(s), dimensions={}
  m = f32[1024,1024]{1,0} multiply(c, sb)
  q = f8e4m3fn[1024,1024]{1,0} convert(m)
  a = f32[1024,1024]{1,0} abs(c)
  z = f32[] constant(0)
  amax = f32[] reduce(a, z), dimensions={0,1}, to_apply=region
  ROOT t = (f8e4m3fn[1024,1024]{1,0}, f32[]) tuple(q, amax)
}
"""


def test_a_reduction_and_a_cast_of_one_input_share_its_read():
    """The amax reduction and the cast both read x: XLA's multi-output fusion reads it once."""
    (u,) = _units(SIBLINGS)
    assert u.bytes == 2 * 1024 * 1024 + 1024 * 1024 + 4 + 4  # x; q; s; amax


def _dot_module(lhs: str, rhs: str, lc: int, rc: int, out: str = "bf16[256,512]") -> str:
    return f"""HloModule m

ENTRY main {{
  a = {lhs}{{1,0}} parameter(0)
  b = {rhs}{{1,0}} parameter(1)
  ca = bf16{lhs[lhs.index("[") :]}{{1,0}} convert(a)
  cb = bf16{rhs[rhs.index("[") :]}{{1,0}} convert(b)
  ROOT d = {out}{{1,0}} dot(ca, cb), lhs_contracting_dims={{{lc}}}, rhs_contracting_dims={{{rc}}}
}}
"""


def test_a_dot_of_dequantised_fp8_operands_is_an_fp8_gemm_on_the_codes():
    units = _units(_dot_module("f8e4m3fn[256,1024]", "f8e4m3fn[512,1024]", 1, 1))
    (gemm,) = units  # the converts fold into the GEMM: no fusion writes them
    assert gemm.kind == "gemm:fp8_xla"
    assert gemm.flops == 2 * 256 * 512 * 1024
    assert gemm.bytes == 256 * 1024 + 512 * 1024 + 2 * 256 * 512


def test_an_fp8_operand_that_is_not_k_major_costs_a_transpose():
    units = _units(_dot_module("f8e4m3fn[256,1024]", "f8e4m3fn[1024,512]", 1, 0))
    assert [u.kind for u in units] == ["gemm:fp8_xla", "fusion:fp8_operand_transpose"]
    assert units[1].bytes == 2 * 1024 * 512


def test_two_e5m2_operands_are_no_fp8_gemm():
    (gemm, *_) = _units(_dot_module("f8e5m2[256,1024]", "f8e5m2[512,1024]", 1, 1))
    assert gemm.kind == "gemm:bf16"


def test_a_transpose_into_a_bf16_gemm_is_a_layout():
    text = """HloModule m

ENTRY main {
  a = bf16[256,1024]{1,0} parameter(0)
  b = bf16[1024,512]{1,0} parameter(1)
  t = bf16[512,1024]{1,0} transpose(b), dimensions={1,0}
  ROOT d = bf16[256,512]{1,0} dot(a, t), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
"""
    assert [u.kind for u in _units(text)] == ["gemm:bf16"]


def test_fp8jax_custom_calls():
    text = """HloModule m

ENTRY main {
  a = f8e4m3fn[256,1024]{1,0} parameter(0)
  b = f8e4m3fn[512,1024]{1,0} parameter(1)
  s = f32[] parameter(2)
  g = (bf16[256,512]{1,0}, u8[33554432]{0}) custom-call(a, b, s, s), GEMM
  o = bf16[256,512]{1,0} get-tuple-element(g), index=0
  c = (f8e4m3fn[256,512]{1,0}, f8e4m3fn[512,256]{1,0}, f32[]) custom-call(o, s), CAST
  ROOT r = f8e4m3fn[512,256]{1,0} get-tuple-element(c), index=1
}
""".replace("GEMM", 'custom_call_target="fp8jax_gemm"')
    text = text.replace("CAST", 'custom_call_target="fp8jax_cast_transpose"')
    gemm, cast = _units(text)
    assert gemm.kind == "gemm:fp8_kernel" and gemm.flops == 2 * 256 * 512 * 1024
    assert gemm.bytes == 256 * 1024 + 512 * 1024 + 2 * 256 * 512  # not the workspace
    assert cast.kind == "fp8jax:fp8jax_cast_transpose"
    assert cast.bytes == 2 * 256 * 512 + 4 + 2 * 256 * 512 + 4
    assert cast.seconds == pytest.approx(cast.bytes / 2.0 + cm.LAUNCH_S)  # its family's


def test_the_rowwise_gemm_is_the_per_tensor_one_plus_its_scales():
    """rowwise_gemm's call (scale mode 3): the per-tensor FP8 GEMM's time plus one read of its
    M + N float32 row scales at copy bandwidth."""
    text = """HloModule m

ENTRY main {
  a = f8e4m3fn[256,1024]{1,0} parameter(0)
  b = f8e4m3fn[512,1024]{1,0} parameter(1)
  sa = f32[256]{0} parameter(2)
  sb = f32[512]{0} parameter(3)
  g = (bf16[256,512]{1,0}, u8[33554432]{0}) custom-call(a, b, sa, sb), GEMM
  ROOT o = bf16[256,512]{1,0} get-tuple-element(g), index=0
}
"""
    call = 'custom_call_target="fp8jax_gemm", backend_config={{a_scale_mode = {m} : i64, b_scale_mode = {m} : i64}}'  # noqa: E501
    (per_tensor,) = _units(text.replace("GEMM", call.format(m=0)))
    (rowwise,) = _units(text.replace("GEMM", call.format(m=3)))
    assert rowwise.kind == per_tensor.kind == "gemm:fp8_kernel"
    assert rowwise.flops == per_tensor.flops
    assert rowwise.bytes == per_tensor.bytes + 4 * (256 + 512)
    extra = 4 * (256 + 512) / cm.Bandwidths.copy
    assert rowwise.seconds == pytest.approx(per_tensor.seconds + extra)


def _fmha(dtype: str, target: str, mask: str) -> str:
    return f"""HloModule m

ENTRY main {{
  q = {dtype}[8,2048,32,128]{{3,2,1,0}} parameter(0)
  s = f32[1,1,1,1]{{3,2,1,0}} parameter(1)
  a = ({dtype}[8,2048,32,128]{{3,2,1,0}}, u8[0]{{0}}) custom-call(q, q, q, s), custom_call_target="{target}", backend_config={{"cudnn_fmha_backend_config":{{"mask_type":"{mask}"}}}}
  ROOT o = {dtype}[8,2048,32,128]{{3,2,1,0}} get-tuple-element(a), index=0
}}
"""  # noqa: E501


def test_cudnn_attention_is_priced_at_the_published_rates():
    """FLOPs as FlashAttention-3 counts them (4 B H S S D, halved when causal, 2.5x for the
    backward) at CUDNN_ATTENTION_TFLOPS (2k: BF16 forward 484 causal / 617 without, FP8
    forward 886 without a mask); FP8 is faster by the forward's FP8/BF16 ratio."""
    flops = 4 * 8 * 2048 * 32 * 128 * 2048
    (bf16,) = _units(_fmha("bf16", "__cudnn$fmhaSoftmax", "CAUSAL"))
    assert bf16.kind == "cudnn_attention:bf16" and bf16.flops == flops // 2
    assert bf16.seconds == pytest.approx(flops / 2 / 484e12 + cm.LAUNCH_S)
    (full,) = _units(_fmha("bf16", "__cudnn$fmhaSoftmax", "NO_MASK"))
    assert full.seconds == pytest.approx(flops / 617e12 + cm.LAUNCH_S)
    (bwd,) = _units(_fmha("bf16", "__cudnn$fmhaSoftmaxBackward", "NO_MASK"))
    assert bwd.flops == 2.5 * flops
    assert bwd.seconds == pytest.approx(2.5 * flops / 465e12 + cm.LAUNCH_S)
    (fp8,) = _units(_fmha("f8e4m3fn", "__cudnn$fmhaSoftmaxF8", "NO_MASK"))
    assert fp8.kind == "cudnn_attention:fp8"
    assert fp8.seconds == pytest.approx(flops / 886e12 + cm.LAUNCH_S)
    assert attention_rates.cudnn_attention_tflops("fp8", "backward", True, 2048) == pytest.approx(
        465 * (484 / 617) * (886 / 617)
    )
    # between the published lengths: linear in log2(length); outside them: the nearest
    assert attention_rates.cudnn_attention_tflops("bf16", "forward", True, 1448) == pytest.approx(
        410 + (484 - 410) * (math.log2(1448) - 10), rel=1e-6
    )
    assert attention_rates.cudnn_attention_tflops("bf16", "forward", True, 64) == 315


def test_a_loop_costs_its_body_times_its_trip_count():
    text = """HloModule m

body {
  p = (s32[], f32[1048576]{0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  x = f32[1048576]{0} get-tuple-element(p), index=1
  one = s32[] constant(1)
  j = s32[] add(i, one)
  y = f32[1048576]{0} exponential(x)
  ROOT t = (s32[], f32[1048576]{0}) tuple(j, y)
}

cond {
  p = (s32[], f32[1048576]{0}) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  n = s32[] constant(12)
  ROOT lt = pred[] compare(i, n), direction=LT
}

ENTRY main {
  x = f32[1048576]{0} parameter(0)
  z = s32[] constant(0)
  t = (s32[], f32[1048576]{0}) tuple(z, x)
  w = (s32[], f32[1048576]{0}) while(t), condition=cond, body=body
  ROOT r = f32[1048576]{0} get-tuple-element(w), index=1
}
"""
    (loop,) = [u for u in _units(text) if u.kind == "while"]
    body = cm.predict_graph(hg.Graph(text, "body"), PROBE).total_s
    assert loop.seconds == pytest.approx(12 * body) and body > 2 * 4 * 1048576


def test_the_gemm_fits_pass_through_their_points_and_near_the_held_out_ones():
    for kind, points in cm.MEASURED["gemm_fit"].items():
        for shape, tflops in points.items():
            flops = 2 * math.prod(shape)
            assert flops / cm.gemm_seconds(flops, kind) / 1e12 == pytest.approx(tflops)
        for shape, tflops in cm.MEASURED["gemm_held_out"][kind].items():
            flops = 2 * math.prod(shape)
            assert flops / cm.gemm_seconds(flops, kind) / 1e12 == pytest.approx(tflops, rel=0.06)


def test_calibration_reproduces_the_measured_ops():
    """Each fp8jax kernel's bandwidth is its own measurement (exact); XLA's two fitted
    bandwidths put every reference within 30% of its measured time."""
    cal = calibration.calibration()
    for name, r in cal["ops"].items():
        rel = 1e-6 if name.endswith("[kernel]") else 0.3
        assert r["predicted_ms"] == pytest.approx(r["measured_ms"], rel=rel), name
    assert 0 < cal["xla_transpose_fusion_gbps"] < cal["xla_fusion_gbps"] < cm.MEASURED["copy_gbps"]


def test_real_steps_have_the_gemms_they_should():
    """Each variant of the LayerNormMLP step, lowered for CUDA: six GEMMs of its own kind."""
    import _workloads

    wl = _workloads.build("layernorm_mlp", _workloads.SIZES["layernorm_mlp"]["cpu"])
    kinds = {"fp8": "gemm:fp8_kernel", "fp8_xla": "gemm:fp8_xla", "flax_fp8": "gemm:fp8_xla",
             "bf16": "gemm:bf16"}  # fmt: skip
    for variant, kind in kinds.items():
        hlo = cm.lowered_hlo(wl.steps[variant], *wl.abstract(variant))
        gemms = [u.kind for u in cm.predict(hlo, PROBE).units if u.kind.startswith("gemm")]
        assert gemms == [kind] * 6, variant
