"""A predicted H100 time for a program lowered for CUDA, for sessions without a GPU.

The input is the HLO text of a jitted step lowered for CUDA (``jax.jit(f).trace(...).lower(
lowering_platforms=("cuda",)).as_text(dialect="hlo")``; lowering needs no GPU): the program before
XLA optimises it, with fp8jax's custom calls as a GPU runs them. The model, in order:

1. Parse the HLO and inline every ``call``; reshapes, bitcasts and tuples are free.
2. GEMMs: a ``dot`` whose two operands trace back (through converts, scalings by a broadcast,
   transposes, slices and copies) to FP8 values is one cuBLASLt FP8 GEMM reading the FP8 codes
   (XLA's GEMM rewriter does this on a Hopper); an operand whose contracting dimension is not its
   minor one costs an FP8 transpose (cuBLASLt's FP8 GEMM takes both operands K-major). Other
   dots run in their operands' type (f32: TF32, or FP32 at "highest" precision). A transpose of
   a GEMM's result, or read only by non-FP8 GEMMs, is a layout (free).
3. XLA's fusion, approximated: every op that is neither a kernel (dot, custom call, collective,
   loop) nor free joins the fusion of its consumer; an op's output is written to memory (a fusion
   root) when a kernel or the program's output reads it, or when it is a reduction. A fusion reads
   each outside value once (a slice only its part) and writes its root; fusions reading the same
   large value over the same number of elements, neither depending on the other, are merged into
   one (XLA's multi-output fusion), so the shared value is read once.
4. Times: a GEMM ``flops / R + t0`` with ``(R, t0)`` fitted per kind (BF16, fp8jax's FP8 GEMM,
   XLA's FP8 GEMM) on two measured shapes; an fp8jax custom call its bytes (operands + results) at
   the bandwidth its own benchmark measured for it; an XLA fusion its bytes at the bandwidth fitted
   to XLA's compilations of the same ops' references (one value for fusions with a transpose, one
   for the rest; the GEMM rewriter's FP8 operand transposes at the latter: at the former, the
   model put Flax's FP8 LayerNormMLP at 15.3 ms, measured 13.68); ``LAUNCH_S`` per kernel, small
   fusions sharing one. ``calibration.py`` reproduces each fit and its residuals.

The measured numbers are those of ``docs/performance.md``'s H100 run (2026-11-26, commit 5276131,
JAX 0.11.2): ``MEASURED`` below, each with the benchmark that produced it. What is not calibrated
(no measurement yet) says so: TF32/FP32 dots, collectives, the launch gap, the grouped GEMMs'
tile padding and per-group overhead, and cuDNN's fused attention, priced from published H100
figures (``attention_rates.py``).

    python benchmarks/calibration.py      # the calibration and its residuals
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from typing import Any

from attention_rates import cudnn_attention_tflops
from hlo_graph import COLLECTIVE, FP8, REDUCTION, Array, Graph, Node, attr, dims, kind_of

# the ops XLA's FP8 GEMM rewrite looks through between a dot and its FP8 operand
_FP8_PATH = {"convert", "copy", "transpose", "broadcast", "slice", "dynamic-slice", "pad",
             "bitcast", "reshape", "bitcast-convert", "multiply", "divide", "select"}  # fmt: skip

# ---------------------------------------------------------------------------------- measured

#: The GPU measurements the model is calibrated on (one H100 80GB HBM3, docs/performance.md,
#: 2026-11-26, commit 5276131, JAX 0.11.2; each ratio within one run).
MEASURED: dict[str, Any] = {
    # benchmarks/gemm.py, TFLOP/s at (M, N, K): the fit of each kind's (R, t0)...
    "gemm_fit": {
        "bf16": {(8192, 8192, 8192): 715.0, (2048, 2048, 2048): 279.0},
        "fp8_kernel": {(8192, 8192, 8192): 1222.0, (2048, 2048, 2048): 218.0},
        "fp8_xla": {(8192, 8192, 8192): 1246.0, (2048, 2048, 2048): 261.0},
    },
    # ... and the shapes held out of it (checked, not fitted)
    "gemm_held_out": {
        "bf16": {(16384, 4096, 4096): 726.0, (16384, 16384, 16384): 704.0},
        "fp8_kernel": {(16384, 4096, 4096): 1140.0, (16384, 16384, 16384): 1367.0},
        "fp8_xla": {(16384, 4096, 4096): 1213.0, (16384, 16384, 16384): 1347.0},
    },
    # benchmarks/cast_bandwidth.py: a device copy of 8192^2 bf16, GB/s (read + written)
    "copy_gbps": 2368.0,
    # per op on bf16[8192, 8192], ms: benchmarks/implementations.py (kernel and XLA in one run),
    # quantize from cast_bandwidth.py's GB/s (1609 kernel, 1982 XLA's cast + amax; 3 B per
    # element), the norms from benchmarks/norm.py at 8192 x 8192 (683 GB/s = 393 us with the
    # cast, 233/221 us without, 409/336 us backward)
    "ops_ms": {
        ("quantize", "kernel"): 3 * 8192**2 / 1609e9 * 1e3,
        ("quantize", "xla"): 3 * 8192**2 / 1982e9 * 1e3,
        ("dequantize", "kernel"): 0.165,
        ("dequantize", "xla"): 0.106,
        ("cast_transpose", "kernel"): 0.129,
        ("cast_transpose", "xla"): 0.308,
        ("cast_transpose_dbias", "kernel"): 0.202,
        ("cast_transpose_dbias", "xla"): 0.378,
        ("norm_forward_fp8", "kernel"): 0.393,
        ("norm_forward_fp8", "xla"): 0.413,
        ("norm_forward", "kernel"): 0.233,
        ("norm_forward", "xla"): 0.221,
        ("norm_backward", "kernel"): 0.409,
        ("norm_backward", "xla"): 0.336,
    },
    # benchmarks/mlp.py (the whole LayerNormMLP step, 16384 tokens, 4096 -> 16384 -> 4096,
    # grads without an optimizer): a validation, not a fit
    "layernorm_mlp_ms": {"fp8": 13.75, "bf16": 20.00, "flax_fp8": 13.68},
}
#: Not measured (no GPU run has timed them yet): assumptions, stated.
LAUNCH_S = 2e-6  # per kernel: the gap between back-to-back kernels of one program
TF32_OVER_BF16 = 0.5  # an f32 dot at default precision runs on TF32 tensor cores (datasheet)
F32_OVER_BF16 = 67 / 989  # an f32 dot at "highest" precision: FP32 CUDA cores (datasheet)
LINK_BYTES_S = 3.6e11  # a collective's bytes per second over NVLink (ring all-reduce, guess)
SMALL_BYTES = 1 << 16  # fusions below this share one launch (XLA's horizontal fusion)
# A mixture of experts' grouped GEMMs (docs/performance.md, "Grouped GEMMs"): the tensor-core
# ones (CUTLASS's, fp8jax's sm90 target; and XLA's ragged-dot of bf16) at the dense GEMM fit of
# their type, each group's last row tile padded (half a tile on average) and a per-group
# overhead; fp8jax's CUDA-core kernel at a fraction of the FP32 peak.
GROUPED_TILE_ROWS = 128  # CUTLASS's grouped tile (cpp/sm90/grouped_gemm.cu: 128 x 128 x 128)
GROUPED_GROUP_S = 1e-6  # per group: its TMA descriptors rewritten, its pipeline filled (guess)
CUDA_CORE_GROUPED_FLOPS = 0.45 * 67e12  # shared-memory tiles on the FP32 cores (guess, datasheet)

# ---------------------------------------------------------------------------------- the model


@dataclasses.dataclass
class Unit:
    """One kernel of the predicted program: what it moves and computes, and its time."""

    kind: str  # "gemm:<kind>", "fp8jax:<target>", "fusion", "fusion:transpose", ...
    name: str
    bytes: int = 0
    flops: int = 0
    seconds: float = 0.0


@dataclasses.dataclass
class Prediction:
    units: list[Unit]

    @property
    def total_s(self) -> float:
        return sum(u.seconds for u in self.units)

    def by_kind(self) -> dict[str, float]:
        """Seconds per category (GEMMs by kind, fp8jax kernels, XLA fusions, launches)."""
        out: dict[str, float] = {}
        for u in self.units:
            if u.kind.startswith("attention:"):  # XLA's attention, its [.., S, S] ops
                key = "attention"
            elif u.kind.startswith(("gemm", "fusion")):
                key = u.kind
            else:
                key = u.kind.split(":")[0]
            out[key] = out.get(key, 0.0) + u.seconds
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def fit_gemm(points: dict[tuple[int, int, int], float]) -> tuple[float, float]:
    """``(R FLOP/s, t0 s)`` of ``t = flops / R + t0`` through two measured (shape, TFLOP/s)."""
    (s1, r1), (s2, r2) = sorted(points.items(), key=lambda kv: math.prod(kv[0]))
    f1, f2 = 2 * math.prod(s1), 2 * math.prod(s2)
    t1, t2 = f1 / (r1 * 1e12), f2 / (r2 * 1e12)
    rate = (f2 - f1) / (t2 - t1)
    return rate, t1 - f1 / rate


@functools.cache
def gemm_fits() -> dict[str, tuple[float, float]]:
    fits = {k: fit_gemm(v) for k, v in MEASURED["gemm_fit"].items()}
    rate, t0 = fits["bf16"]
    fits["tf32"] = (rate * TF32_OVER_BF16, t0)
    fits["f32"] = (rate * F32_OVER_BF16, t0)
    return fits


def gemm_seconds(flops: float, kind: str) -> float:
    rate, t0 = gemm_fits()[kind]
    return flops / rate + t0


@dataclasses.dataclass(frozen=True)
class Bandwidths:
    """Bytes per second: XLA's fusions (with and without a transpose) and each fp8jax kernel
    family (matched by the longest family name in the custom call's target)."""

    xla: float
    xla_transpose: float
    kernels: tuple[tuple[str, float], ...]  # (family, bytes/s), longest first
    copy: float = MEASURED["copy_gbps"] * 1e9

    def kernel(self, target: str) -> float:
        name = target.removeprefix("fp8jax_")
        for family, bw in self.kernels:
            if family in name:
                return bw
        return dict(self.kernels).get("quantize", self.copy)


def _fp8_source(g: Graph, value: int, depth: int = 0) -> tuple[int, tuple[int, ...] | None] | None:
    """``(the FP8 value, the permutation of transposes on the way)`` that ``value`` is a
    dequantisation of, as XLA's GEMM rewriter matches it; None if it is none."""
    if g.array(value).dtype in FP8:  # (before and after the free ops: u8 codes bitcast back)
        return value, None
    value = g.resolve(value)
    if g.array(value).dtype in FP8:
        return value, None
    node = g.producer(value)
    if depth > 8 or node.op not in _FP8_PATH or not node.inputs:
        return None
    tries = {"multiply": node.inputs[:2], "select": node.inputs[1:3]}.get(node.op, node.inputs[:1])
    for v in tries:
        found = _fp8_source(g, v, depth + 1)
        if found is not None:
            src, perm = found
            if node.op == "transpose":
                p = dims(node.attrs, "dimensions")
                perm = tuple(perm[i] for i in p) if perm else p
            return src, perm
    return None


def _k_major(
    src: Array, operand: Array, perm: tuple[int, ...] | None, contracting: tuple[int, ...]
) -> bool:
    """Whether an FP8 GEMM operand is K-major (its contracting dimension the minor one) in the
    FP8 value it dequantises (through the transposes on the way; a reshape on the way is
    assumed to keep the minor dimension)."""
    if len(contracting) != 1:
        return True
    c = contracting[0]
    if perm is None or len(perm) != len(src.dims):
        return c == len(operand.dims) - 1
    return perm[c] == len(src.dims) - 1


def _fp8_operands(g: Graph, node: Node) -> list[Any] | None:
    """The FP8 sources of a dot's operands if XLA makes it an FP8 GEMM (not both E5M2)."""
    srcs = [_fp8_source(g, v) for v in node.inputs[:2]]
    if all(srcs) and not all(g.array(s[0]).dtype == "f8e5m2" for s in srcs if s):
        return srcs
    return None


def _dot_units(
    g: Graph, node: Node, srcs: list[Any] | None, bw: Bandwidths
) -> tuple[list[Unit], list[int]]:
    """A dot's GEMM (and XLA's FP8 operand transposes), and the values it reads."""
    lhs, rhs = node.inputs[:2]
    out = g.array(node.outputs[0])
    lc, rc = dims(node.attrs, "lhs_contracting_dims"), dims(node.attrs, "rhs_contracting_dims")
    k = math.prod(g.array(lhs).dims[d] for d in lc)
    flops = 2 * out.numel * k
    units: list[Unit] = []
    if srcs:
        kind = "fp8_xla"
        reads = []
        for (src, perm), operand, contracting in zip(srcs, (lhs, rhs), (lc, rc), strict=True):
            reads.append(src)
            if not _k_major(g.array(src), g.array(operand), perm, contracting):
                nb = 2 * g.array(src).nbytes  # XLA transposes the codes for cuBLASLt
                t = nb / bw.xla + LAUNCH_S
                units.append(Unit("fusion:fp8_operand_transpose", f"{node.name}.T", nb, 0, t))
    else:
        wide = {g.array(lhs).dtype, g.array(rhs).dtype} & {"f32", "f64"}
        highest = "operand_precision={highest" in node.attrs
        kind = ("f32" if highest else "tf32") if wide else "bf16"
        algorithm = attr(node.attrs, "algorithm") or ""  # e.g. dot_bf16_bf16_f32 (JAX's choice)
        kind = next((k for k in ("bf16", "tf32") if f"_{k}_" in algorithm), kind)
        reads = [lhs, rhs]
    nbytes = sum(g.array(g.resolve(v)).nbytes for v in reads) + out.nbytes
    t = max(gemm_seconds(flops, kind), nbytes / bw.copy) + LAUNCH_S
    scores = any(is_scores(g.array(v)) for v in (lhs, rhs, node.outputs[0]))
    units.insert(0, Unit(f"{'attention:' * scores}gemm:{kind}", node.name, nbytes, flops, t))
    return units, reads


def grouped_seconds(flops: float, rows: int, groups: int, kind: str) -> float:
    """A grouped GEMM on the tensor cores: ``flops`` over ``rows`` ragged rows (or contracted
    columns) in ``groups`` groups, at the dense fit of ``kind``, its groups' last tiles padded."""
    padded = flops * (rows + groups * GROUPED_TILE_ROWS / 2) / max(rows, 1)
    return gemm_seconds(padded, kind) + groups * GROUPED_GROUP_S


def _grouped_unit(node: Node, ins: list[Array], outs: list[Array], bw: Bandwidths) -> Unit:
    """fp8jax's grouped GEMM: ``a [M, K] x b [G, N, K]`` (rows) or ``a [K, M] x b [N, M]``
    (contracting, ``[G, K, N]`` out); the tensor-core target or the CUDA-core kernel."""
    a, b, sizes = ins[0], ins[1], ins[2]
    groups = sizes.dims[0]
    rows_form = len(b.dims) == 3
    m, k = (a.dims[0], a.dims[1]) if rows_form else (a.dims[1], a.dims[0])
    n = b.dims[1] if rows_form else b.dims[0]
    flops = 2 * m * n * k
    nbytes = a.nbytes + b.nbytes + outs[0].nbytes
    if node.target.endswith("_sm90"):
        t = max(grouped_seconds(flops, m, groups, "fp8_kernel"), nbytes / bw.copy)
        return Unit("gemm:fp8_grouped", node.name, nbytes, flops, t + 3 * LAUNCH_S)
    t = max(flops / CUDA_CORE_GROUPED_FLOPS, nbytes / bw.copy) + LAUNCH_S
    return Unit("gemm:cuda_core_grouped", node.name, nbytes, flops, t)


def _ragged_dot_unit(g: Graph, node: Node, bw: Bandwidths) -> Unit:
    """XLA's ``ragged-dot`` (a BF16 mixture of experts: ``lhs [M, K] x rhs [G, K, N]``, or the
    wgrad's ragged contraction), priced as a grouped GEMM of its operands' type."""
    lhs, rhs, sizes = (g.array(v) for v in node.inputs[:3])
    out = g.array(node.outputs[0])
    groups = sizes.dims[0]
    lc = dims(node.attrs, "lhs_contracting_dims")
    k = math.prod(lhs.dims[d] for d in lc)
    rows = lhs.dims[0] if len(rhs.dims) == 3 and len(out.dims) == 2 else k
    flops = 2 * (out.numel // (groups if len(out.dims) == 3 else 1)) * k
    wide = {lhs.dtype, rhs.dtype} & {"f32", "f64"}
    kind = ("f32" if "operand_precision={highest" in node.attrs else "tf32") if wide else "bf16"
    nbytes = lhs.nbytes + rhs.nbytes + out.nbytes
    t = max(grouped_seconds(flops, rows, groups, kind), nbytes / bw.copy) + LAUNCH_S
    return Unit(f"gemm:{kind}_grouped", node.name, nbytes, flops, t)


# rowwise_gemm's cuBLASLt call (OUTER_VEC_32F, one float32 scale per row of a and of b): priced
# as the per-tensor FP8 GEMM plus one read of its M + N scales at copy bandwidth (not calibrated:
# no GPU has run it; the mode's epilogue cost is assumed to be that read).
_ROWWISE_GEMM = re.compile(r"\ba_scale_mode = 3 ")


def _custom_unit(g: Graph, node: Node, bw: Bandwidths) -> Unit:
    ins = [g.array(v) for v in node.inputs]  # as the call takes them (reshapes are free)
    outs = [g.array(v) for v in node.outputs]
    if "grouped_gemm" in node.target:
        return _grouped_unit(node, ins, outs, bw)
    if "gemm" in node.target:  # a [M, K] x b [N, K]; the last output is the workspace
        a, b = ins[0], ins[1]
        k = a.dims[-1]
        flops = 2 * (a.numel // k) * (b.numel // k) * k
        nbytes = a.nbytes + b.nbytes + outs[0].nbytes
        t = max(gemm_seconds(flops, "fp8_kernel"), nbytes / bw.copy) + LAUNCH_S
        if _ROWWISE_GEMM.search(node.attrs):  # the per-tensor GEMM plus its row scales' read
            scales = ins[2].nbytes + ins[3].nbytes
            nbytes, t = nbytes + scales, t + scales / bw.copy
        return Unit("gemm:fp8_kernel", node.name, nbytes, flops, t)
    nbytes = sum(a.nbytes for a in ins) + sum(a.nbytes for a in outs)
    if node.target.startswith("__cudnn$fmha"):
        return cudnn_attention_unit(node, ins, nbytes, bw)
    kind = "fp8jax" if node.target.startswith("fp8jax_") else "custom"
    band = bw.kernel(node.target) if kind == "fp8jax" else bw.copy
    return Unit(f"{kind}:{node.target}", node.name, nbytes, 0, nbytes / band + LAUNCH_S)


# ------------------------------------------------------------------- cuDNN attention (assumed)


def is_cudnn_attention(node: Node) -> bool:
    """Whether ``node`` is a cuDNN fused attention custom call (``__cudnn$fmha*``)."""
    return node.op == "custom-call" and node.target.startswith("__cudnn$fmha")


def cudnn_attention_unit(node: Node, ins: list[Array], nbytes: int, bw: Bandwidths) -> Unit:
    """A cuDNN fused attention custom call (``__cudnn$fmha*``: q, k, v ``[B, S, N, D]`` first),
    at :func:`cudnn_attention_tflops` (FP8 when its q is)."""
    q, kk = ins[0], ins[1]
    direction = "backward" if "Backward" in node.target else "forward"
    causal = re.search(r"mask_type\W+(PADDING_)?CAUSAL", node.attrs) is not None
    kind = "fp8" if q.dtype in FP8 else "bf16"
    flops = 4 * q.numel * kk.dims[-3] * (0.5 if causal else 1.0)
    flops *= 2.5 if direction == "backward" else 1.0
    rate = cudnn_attention_tflops(kind, direction, causal, q.dims[-3]) * 1e12
    t = max(flops / rate, nbytes / bw.copy) + LAUNCH_S
    return Unit(f"cudnn_attention:{kind}", node.name, nbytes, int(flops), t)


def predict_graph(g: Graph, bw: Bandwidths | None = None) -> Prediction:
    """The units of ``g`` and their times (see the module docstring)."""
    if bw is None:  # the calibrated bandwidths (calibration.py imports this module)
        from calibration import bandwidths

        bw = bandwidths()
    fp8 = {i: _fp8_operands(g, nd) for i, nd in enumerate(g.nodes) if nd.op == "dot"}
    _transposes_into_layouts(g, fp8)
    units: list[Unit] = []
    reads_of: dict[int, list[int]] = {}  # kernel node -> values it reads (FP8 GEMMs: the codes)
    for i, node in enumerate(g.nodes):
        if node.op == "dot":
            dot_units, reads = _dot_units(g, node, fp8[i], bw)
            units += dot_units
            reads_of[i] = reads
        elif node.op == "custom-call":
            units.append(_custom_unit(g, node, bw))
        elif node.op == "ragged-dot":
            units.append(_ragged_dot_unit(g, node, bw))
        elif node.op in COLLECTIVE:
            nbytes = sum(g.array(v).nbytes for v in node.outputs)
            if not node.op.endswith("-done"):
                t = nbytes / LINK_BYTES_S + 10e-6
                units.append(Unit(f"collective:{node.op}", node.name, nbytes, 0, t))
        elif node.op in ("while", "conditional"):
            subs = [predict_graph(Graph(g.text, c), bw).total_s for c in node.subs if c]
            units.append(Unit(node.op, node.name, 0, 0, node.trips * max(subs, default=0.0)))
        elif kind_of(node) == "kernel":
            nbytes = sum(g.array(g.resolve(v)).nbytes for v in node.inputs)
            nbytes += sum(g.array(v).nbytes for v in node.outputs)
            units.append(
                Unit(f"kernel:{node.op}", node.name, nbytes, 0, nbytes / bw.xla + LAUNCH_S)
            )
    units += _fusions(g, reads_of, bw)
    return Prediction(units)


def _transposes_into_layouts(g: Graph, fp8: dict[int, Any]) -> None:
    """Transposes of a GEMM's result, or read only by BF16/F32 GEMMs, become layouts (XLA's
    layout assignment: cuBLAS takes and writes either order), so they cost nothing: made
    bitcasts here. (FP8 GEMMs need K-major operands: ``_k_major`` charges those.) So does the
    transpose JAX writes after cuDNN's attention, whose custom call states its result's layout
    (:func:`is_cudnn_attention`)."""
    readers: dict[int, list[int]] = {}
    for i, node in enumerate(g.nodes):
        for v in node.inputs:
            readers.setdefault(g.values[g.resolve(v)][0], []).append(i)
    for i, node in enumerate(g.nodes):
        if node.op != "transpose":
            continue
        src = g.producer(g.resolve(node.inputs[0]))
        users = readers.get(i, [])
        if (
            src.op == "dot"
            or is_cudnn_attention(src)
            or (users and all(g.nodes[u].op == "dot" and not fp8.get(u) for u in users))
        ):
            node.op = "bitcast"


def _fusions(g: Graph, reads_of: dict[int, list[int]], bw: Bandwidths) -> list[Unit]:
    """XLA's fusions of ``g``'s fusible ops, merged where XLA would merge siblings."""
    n = len(g.nodes)
    consumers: list[set[int]] = [set() for _ in range(n)]  # real producer -> real consumers
    for i, node in enumerate(g.nodes):
        if kind_of(node) != "free":
            for v in reads_of.get(i, node.inputs):
                consumers[g.values[g.resolve(v)][0]].add(i)
    live = {g.values[g.resolve(v)][0] for v in g.live_out}
    roots = [
        i
        for i, node in enumerate(g.nodes)
        if kind_of(node) == "fusible"
        and (
            i in live
            or (node.op in REDUCTION and consumers[i])
            or any(kind_of(g.nodes[c]) == "kernel" for c in consumers[i])
        )
    ]
    group_of = {r: gi for gi, r in enumerate(roots)}
    # the fusions each node depends on (bit gi: fusion gi), through every kind of node
    anc = [0] * n
    for i, node in enumerate(g.nodes):
        bits = 0
        for v in reads_of.get(i, node.inputs):
            p = g.values[g.resolve(v)][0]
            bits |= anc[p] | (1 << group_of[p] if p in group_of else 0)
        anc[i] = bits
    groups = [
        _fusion_group(g, r, group_of) | {"anc": anc[r], "members": 1 << gi}
        for gi, r in enumerate(roots)
    ]
    units = [_fusion_unit(grp, bw) for grp in _merge_siblings(groups)]
    # XLA fuses the tiny ones (scalars, amax bookkeeping) horizontally: one launch for them all
    small = [u for u in units if u.bytes < SMALL_BYTES]
    if len(small) > 1:
        for u in small[1:]:
            u.seconds -= LAUNCH_S
    return units


def _fusion_group(g: Graph, r: int, roots: dict[int, int]) -> dict[str, Any]:
    """The fusion whose root is node ``r``: the values it reads (bytes each), bytes written,
    its number of elements and whether it transposes."""
    reads: dict[int, int] = {}
    members, stack = set(), [r]
    loop, transpose = g.array(g.nodes[r].outputs[0]).numel, False
    while stack:
        i = stack.pop()
        if i in members:
            continue
        members.add(i)
        node = g.nodes[i]
        transpose = transpose or node.op == "transpose"
        if node.op in REDUCTION:  # a reduction loops over its input's elements
            loop = max(loop, g.array(node.inputs[0]).numel)
        for pos, v in enumerate(node.inputs):
            v = g.resolve(v)
            p = g.values[v][0]
            if kind_of(g.nodes[p]) == "fusible" and p not in roots:
                stack.append(p)
                continue
            if g.nodes[p].op == "constant" and g.array(v).numel <= 1:
                continue
            need = g.array(v).nbytes
            if pos == 0 and node.op in ("slice", "dynamic-slice", "gather"):
                need = min(need, g.array(node.outputs[0]).nbytes)
            if pos == 0 and node.op == "dynamic-update-slice" and i == r:
                need = 0  # updated in place
            reads[v] = max(reads.get(v, 0), need)
    root = g.nodes[r]
    written = g.array(root.outputs[0]).nbytes
    if root.op == "dynamic-update-slice" and len(root.inputs) > 1:
        written = g.array(g.resolve(root.inputs[1])).nbytes
    scores = is_scores(g.array(root.outputs[0])) or any(is_scores(g.array(v)) for v in reads)
    return {
        "name": root.name,
        "reads": reads,
        "written": written,
        "loop": loop,
        "transpose": transpose,
        "scores": scores,
    }


def _merge_siblings(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merges fusions that read one large value (>= 1 MiB) over the same number of elements
    when neither depends on the other (XLA's multi-output fusion); a merged fusion reads the
    union of its parts' values once and writes all their roots."""
    out: list[dict[str, Any]] = []
    first: dict[tuple[int, int], dict[str, Any]] = {}  # (value, elements) -> its first reader
    for grp in groups:
        into = None
        for v, need in grp["reads"].items():
            other = first.get((v, grp["loop"]))
            if (
                need >= 1 << 20
                and other is not None
                and not (grp["anc"] & other["members"] or other["anc"] & grp["members"])
            ):
                into = other
                break
        if into is None:
            out.append(grp)
            into = grp
        else:
            for u, nb in grp["reads"].items():
                into["reads"][u] = max(into["reads"].get(u, 0), nb)
            into["written"] += grp["written"]
            into["transpose"] = into["transpose"] or grp["transpose"]
            into["scores"] = into["scores"] or grp["scores"]
            into["members"] |= grp["members"]
            into["anc"] |= grp["anc"]
        for v in grp["reads"]:
            first.setdefault((v, grp["loop"]), into)
    return out


def is_scores(a: Array) -> bool:
    """Whether ``a`` looks like attention scores, ``[..., S, S]`` (S >= 256, at least 3-D)."""
    d = [n for n in a.dims if n != 1]
    return len(d) >= 3 and d[-1] == d[-2] >= 256


def _fusion_unit(grp: dict[str, Any], bw: Bandwidths) -> Unit:
    nbytes = sum(grp["reads"].values()) + grp["written"]
    band = bw.xla_transpose if grp["transpose"] else bw.xla
    kind = ("attention:" if grp["scores"] else "") + (
        "fusion:transpose" if grp["transpose"] else "fusion"
    )
    return Unit(kind, grp["name"], nbytes, 0, nbytes / band + LAUNCH_S)


def predict(hlo_text: str, bw: Bandwidths | None = None) -> Prediction:
    """The predicted H100 time of a module's HLO text (lowered for CUDA)."""
    return predict_graph(Graph(hlo_text), bw)


def lowered_hlo(fn: Callable[..., Any], *args: Any) -> str:
    """``fn`` jitted and lowered for CUDA on abstract ``args`` (no GPU, nothing allocated)."""
    import jax

    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
