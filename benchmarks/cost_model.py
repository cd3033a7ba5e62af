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
   fusions sharing one. ``calibration()`` reproduces each fit and its residuals.

The measured numbers are those of ``docs/performance.md``'s H100 run (2026-11-26, commit 5276131,
JAX 0.11.2): ``MEASURED`` below, each with the benchmark that produced it. What is not calibrated
(no measurement yet) says so: TF32/FP32 dots, collectives, the launch gap, and cuDNN's fused
attention, priced from published H100 figures (:data:`CUDNN_ATTENTION_TFLOPS`).

    python benchmarks/cost_model.py      # the calibration and its residuals
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
import statistics
from collections.abc import Callable
from typing import Any

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


def _custom_unit(g: Graph, node: Node, bw: Bandwidths) -> Unit:
    ins = [g.array(v) for v in node.inputs]  # as the call takes them (reshapes are free)
    outs = [g.array(v) for v in node.outputs]
    if "gemm" in node.target:  # a [M, K] x b [N, K]; the last output is the workspace
        a, b = ins[0], ins[1]
        k = a.dims[-1]
        flops = 2 * (a.numel // k) * (b.numel // k) * k
        nbytes = a.nbytes + b.nbytes + outs[0].nbytes
        t = max(gemm_seconds(flops, "fp8_kernel"), nbytes / bw.copy) + LAUNCH_S
        return Unit("gemm:fp8_kernel", node.name, nbytes, flops, t)
    nbytes = sum(a.nbytes for a in ins) + sum(a.nbytes for a in outs)
    if node.target.startswith("__cudnn$fmha"):
        return cudnn_attention_unit(node, ins, nbytes, bw)
    kind = "fp8jax" if node.target.startswith("fp8jax_") else "custom"
    band = bw.kernel(node.target) if kind == "fp8jax" else bw.copy
    return Unit(f"{kind}:{node.target}", node.name, nbytes, 0, nbytes / band + LAUNCH_S)


# ------------------------------------------------------------------- cuDNN attention (assumed)

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


def _interpolated(points: dict[int, float], seq: int) -> float:
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
        return _interpolated(CUDNN_ATTENTION_TFLOPS[(k, d, mask)], seq)

    mask = "causal" if causal else "no_mask"
    if direction == "forward":
        rate = at("bf16", "forward", mask)
    else:
        rate = at("bf16", "backward", "no_mask")
        rate *= at("bf16", "forward", mask) / at("bf16", "forward", "no_mask")
    if kind == "fp8":
        rate *= at("fp8", "forward", "no_mask") / at("bf16", "forward", "no_mask")
    return rate


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
    bw = bw or bandwidths()
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


# ---------------------------------------------------------------------------------- calibration


def op_programs() -> dict[tuple[str, str], str]:
    """The HLO of each measured op (``MEASURED["ops_ms"]``) on bf16[8192, 8192], as the
    benchmarks called it, under each implementation."""
    import jax
    import jax.numpy as jnp

    from fp8jax import ops

    e4m3, bf16 = jnp.float8_e4m3fn, jnp.bfloat16
    x = jax.ShapeDtypeStruct((8192, 8192), bf16)
    q = jax.ShapeDtypeStruct((8192, 8192), e4m3)
    s = jax.ShapeDtypeStruct((), jnp.float32)
    row = jax.ShapeDtypeStruct((8192,), jnp.float32)
    h = jax.ShapeDtypeStruct((8192,), jnp.float32)
    norm = dict(norm_type="layernorm", epsilon=1e-5)
    cases: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
        "quantize": (lambda x, s: ops.quantize(x, s, e4m3), (x, s)),
        "dequantize": (lambda q, s: ops.dequantize(q, s, bf16), (q, s)),
        "cast_transpose": (lambda x, s: ops.cast_transpose(x, s, e4m3), (x, s)),
        "cast_transpose_dbias": (lambda g, s: ops.cast_transpose_dbias(g, s, e4m3), (x, s)),
        "norm_forward_fp8": (
            lambda x, g, b, s: ops.norm_forward_fp8(x, g, b, s, e4m3, **norm),
            (x, h, h, s),
        ),
        "norm_forward": (lambda x, g, b: ops.norm_forward(x, g, b, **norm), (x, h, h)),
        "norm_backward": (
            lambda dy, x, mu, rs, g: ops.norm_backward(dy, x, mu, rs, g, norm_type="layernorm"),
            (x, x, row, row, h),
        ),
    }
    out = {}
    for op, (fn, args) in cases.items():
        for impl in ("kernel", "xla"):
            with ops.implementation(impl):
                out[(op, impl)] = lowered_hlo(fn, *args)
    return out


@functools.cache
def bandwidths() -> Bandwidths:
    """The bandwidths fitted on ``MEASURED["ops_ms"]`` (see :func:`calibration`)."""
    return _fit(op_programs())[0]


def _launch_s(units: list[Unit]) -> float:
    """The launch time inside a prediction's total (small fusions share one launch)."""
    small = [u for u in units if u.kind.endswith("fusion") and u.bytes < SMALL_BYTES]
    return LAUNCH_S * (len(units) - len(small) + bool(small))


def _fit(programs: dict[tuple[str, str], str]) -> tuple[Bandwidths, dict[str, Any]]:
    """XLA's two fusion bandwidths from the references' times, then each kernel's from its own
    time less what its program runs besides it (at XLA's bandwidths) and the launches."""
    probe = Bandwidths(1.0, 1.0, ())  # only the units' bytes are used
    units = {key: predict(text, probe).units for key, text in programs.items()}

    def split(us: list[Unit]) -> tuple[int, int, int]:  # plain, transposing, fp8jax bytes
        return (sum(u.bytes for u in us if u.kind == "fusion"),
                sum(u.bytes for u in us if u.kind == "fusion:transpose"),
                sum(u.bytes for u in us if u.kind.startswith("fp8jax:")))  # fmt: skip

    def seconds(key: tuple[str, str]) -> float:  # the measured time less the launches
        return MEASURED["ops_ms"][key] * 1e-3 - _launch_s(units[key])

    xla_runs = [(split(us), seconds(k)) for k, us in units.items() if k[1] == "xla"]
    xla = statistics.median(pb / t for (pb, tb, _), t in xla_runs if not tb)
    xla_t = statistics.median(tb / (t - pb / xla) for (pb, tb, _), t in xla_runs if tb)
    kernels = {}
    for (op, impl), us in units.items():
        if impl == "kernel":
            pb, tb, kb = split(us)
            kernels[op] = kb / (seconds((op, impl)) - pb / xla - tb / xla_t)
    bw = Bandwidths(xla, xla_t, tuple(sorted(kernels.items(), key=lambda kv: -len(kv[0]))))
    residuals = {
        f"{op}[{impl}]": {
            "measured_ms": MEASURED["ops_ms"][(op, impl)],
            "predicted_ms": predict(text, bw).total_s * 1e3,
        }
        for (op, impl), text in programs.items()
    }
    return bw, residuals


def calibration() -> dict[str, Any]:
    """What calibrates what: the GEMM fits (and the held-out shapes), the bandwidths, and the
    residual of every measured op under the fitted model."""
    bw, residuals = _fit(op_programs())
    gemm = {}
    for kind, (rate, t0) in gemm_fits().items():
        held = {
            "x".join(map(str, s)): {
                "measured_tflops": tf,
                "predicted_tflops": 2 * math.prod(s) / gemm_seconds(2 * math.prod(s), kind) / 1e12,
            }
            for s, tf in MEASURED["gemm_held_out"].get(kind, {}).items()
        }
        gemm[kind] = {"tflops_peak": rate / 1e12, "t0_us": t0 * 1e6, "held_out": held}
    return {
        "source": "docs/performance.md, H100 80GB HBM3, 2026-11-26, commit 5276131",
        "gemm": gemm,
        "xla_fusion_gbps": bw.xla / 1e9,
        "xla_transpose_fusion_gbps": bw.xla_transpose / 1e9,
        "fp8jax_kernel_gbps": {k: v / 1e9 for k, v in bw.kernels},
        "ops": residuals,
        "assumed": {
            "launch_us": LAUNCH_S * 1e6,
            "tf32_over_bf16": TF32_OVER_BF16,
            "f32_over_bf16": F32_OVER_BF16,
            "link_gbps": LINK_BYTES_S / 1e9,
            "cudnn_attention_tflops": {"/".join(k): v for k, v in CUDNN_ATTENTION_TFLOPS.items()},
        },
    }


if __name__ == "__main__":
    import json

    print(json.dumps(calibration(), indent=2, default=str))
