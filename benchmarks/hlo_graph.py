"""The HLO of a lowered program as a graph: parsed, its calls inlined, values with shapes.

``Graph(text)`` reads the HLO text of a module (``Lowered.as_text(dialect="hlo")``): every
computation, with ``call``s inlined (a jitted function called inside another is one), tuples and
``get-tuple-element``s resolved, loops and conditionals kept as nodes with their computations
named. Each node lists the values it reads and writes, each value its dtype and dimensions, so
``benchmarks/cost_model.py`` can count the bytes and FLOPs of every op.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any

BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "f8e4m3fn": 1, "f8e5m2": 1,
         "f8e8m0fnu": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2,
         "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
         "c128": 16, "token": 0}  # fmt: skip
FP8 = ("f8e4m3fn", "f8e5m2")
#: Ops that move no data: a reshape or bitcast of a row-major array is a relabelling.
FREE = {"parameter", "constant", "bitcast", "reshape", "bitcast-convert", "after-all",
        "partition-id", "replica-id", "get-dimension-size", "add-dependency"}  # fmt: skip
#: Ops XLA runs as their own kernels (library calls, custom calls, loops), not in fusions.
KERNEL = {"dot", "ragged-dot", "convolution", "custom-call", "fft", "sort", "scatter",
          "select-and-scatter", "triangular-solve", "cholesky", "while", "conditional",
          "rng-get-and-update-state", "infeed", "outfeed", "send", "recv", "send-done",
          "recv-done"}  # fmt: skip
COLLECTIVE = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
              "all-reduce-start", "all-gather-start", "collective-permute-start",
              "all-reduce-done", "all-gather-done", "collective-permute-done",
              "collective-broadcast", "ragged-all-to-all"}  # fmt: skip
REDUCTION = {"reduce", "reduce-window"}


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of an HLO shape."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        return self.numel * BYTES.get(self.dtype, 4)


@dataclasses.dataclass
class Instr:
    name: str
    arrays: tuple[Array, ...]  # the shape, tuples flattened
    op: str
    operands: list[str]
    attrs: str
    text: str  # what is inside the parentheses (a parameter's number, a constant's literal)


_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-$]+)\s*(?:\([^{]*\)\s*->\s*.*)?\{\s*$")


def parse_arrays(text: str) -> tuple[Array, ...]:
    """The arrays of an HLO shape (a tuple's elements in order, nesting flattened)."""
    text = re.sub(r"/\*.*?\*/", "", text)
    return tuple(
        Array(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
        for m in _ARRAY.finditer(text)
    )


def _closing(text: str, start: int, open_: str = "(", close: str = ")") -> int:
    """The index just after the bracket closing the one opened before ``start``."""
    depth = 1
    i = start
    while depth and i < len(text):
        depth += {open_: 1, close: -1}.get(text[i], 0)
        i += 1
    return i


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


def parse_instr(line: str) -> tuple[Instr, bool] | None:
    """``(instruction, is_root)`` of one HLO line, or None for anything else."""
    line = line.strip()
    root = line.startswith("ROOT ")
    if root:
        line = line[5:]
    name, sep, rest = line.partition(" = ")
    if not sep:
        return None
    rest = rest.lstrip()
    if rest.startswith("("):
        end = _closing(rest, 1)
        shape, rest = rest[:end], rest[end:]
    else:
        shape, _, rest = rest.partition(" ")
    m = re.match(r"\s*([\w\-]+)\(", rest)
    if m is None:
        return None
    end = _closing(rest, m.end())
    inner, attrs = rest[m.end() : end - 1], rest[end:]
    op = m.group(1)
    operands = [] if op == "constant" else [p.split()[-1].lstrip("%") for p in _split_top(inner)]
    return Instr(name.lstrip("%"), parse_arrays(shape), op, operands, attrs, inner), root


def parse_module(text: str) -> tuple[dict[str, list[Instr]], dict[str, str], str]:
    """``(computations, their root names, the entry's name)`` of an HLO module's text."""
    comps: dict[str, list[Instr]] = {}
    roots: dict[str, str] = {}
    entry, current = "", None
    for line in text.splitlines():
        m = _COMP.match(line.strip())
        if m and " = " not in line:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        if current is None:
            continue
        parsed = parse_instr(line)
        if parsed is not None:
            instr, root = parsed
            comps[current].append(instr)
            if root:
                roots[current] = instr.name
    if not entry:
        raise ValueError("cost_model: no ENTRY computation in the HLO text")
    for name, body in comps.items():
        roots.setdefault(name, body[-1].name if body else "")
    return comps, roots, entry


def attr(attrs: str, key: str) -> str | None:
    """The value of ``key=...`` in an instruction's attributes (a computation's name: no %)."""
    m = re.search(rf"\b{key}=([^\s,]+)", attrs)
    return m.group(1).lstrip("%") if m else None


def dims(attrs: str, key: str) -> tuple[int, ...]:
    """The integers of ``key={...}`` in an instruction's attributes."""
    m = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


# ---------------------------------------------------------------------------------- the graph


@dataclasses.dataclass
class Node:
    op: str
    name: str
    inputs: list[int]  # value ids
    outputs: list[int]
    attrs: str = ""
    target: str = ""  # a custom call's
    subs: tuple[str, ...] = ()  # a loop's body, a conditional's branches
    trips: int = 1  # a loop's trip count


class Graph:
    """A module with its calls inlined: nodes in program order, values by id."""

    def __init__(self, text: str, computation: str | None = None):
        self.text = text
        self.comps, self.roots, entry = parse_module(text)
        self.nodes: list[Node] = []
        self.values: list[tuple[int, Array]] = []  # (producer node, array)
        comp = computation or entry
        params = sorted((int(i.text), i) for i in self.comps[comp] if i.op == "parameter")
        args = [self._new_node("parameter", i.name, [], i.arrays) for _, i in params]
        self.live_out = self._emit(comp, args)

    def _new_node(
        self, op: str, name: str, inputs: list[int], arrays: Iterable[Array], **kw: Any
    ) -> list[int]:
        node = Node(op, name, inputs, [], **kw)
        idx = len(self.nodes)
        self.nodes.append(node)
        for a in arrays:
            node.outputs.append(len(self.values))
            self.values.append((idx, a))
        return node.outputs

    def _emit(self, comp: str, args: list[list[int]]) -> list[int]:
        env: dict[str, list[int]] = {}
        for ins in self.comps[comp]:
            vals = [env.get(o, []) for o in ins.operands]
            flat = [v for vs in vals for v in vs]
            if ins.op == "parameter":
                env[ins.name] = args[int(ins.text)]
            elif ins.op == "get-tuple-element":
                idx = int(attr(ins.attrs, "index") or 0)
                env[ins.name] = vals[0][idx : idx + len(ins.arrays)]
            elif ins.op in ("tuple", "opt-barrier"):
                env[ins.name] = flat
            elif ins.op == "call":
                env[ins.name] = self._emit(attr(ins.attrs, "to_apply") or "", vals)
            elif ins.op in ("while", "conditional"):
                subs, trips = self._subs(ins)
                env[ins.name] = self._new_node(
                    ins.op, ins.name, flat, ins.arrays, attrs=ins.attrs, subs=subs, trips=trips
                )
            else:
                target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
                env[ins.name] = self._new_node(
                    ins.op,
                    ins.name,
                    flat,
                    ins.arrays,
                    attrs=ins.attrs,
                    target=target.group(1) if target else "",
                )
        return env[self.roots[comp]]

    def _subs(self, ins: Instr) -> tuple[tuple[str, ...], int]:
        """A loop's body and trip count (the largest integer constant of its condition: a
        lowered scan compares its counter with its length), or a conditional's branches."""
        if ins.op == "while":
            cond = self.comps.get(attr(ins.attrs, "condition") or "", [])
            bound = [int(c.text) for c in cond if c.op == "constant" and c.text.isdigit()]
            return (attr(ins.attrs, "body") or "",), max(bound, default=1)
        found = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
        names = re.findall(r"[\w.\-$]+", found.group(1)) if found else []
        names += [b for k in ("true_computation", "false_computation") if (b := attr(ins.attrs, k))]
        return tuple(names), 1

    def array(self, value: int) -> Array:
        return self.values[value][1]

    def producer(self, value: int) -> Node:
        return self.nodes[self.values[value][0]]

    def resolve(self, value: int) -> int:
        """``value`` before the free ops (reshapes, bitcasts) that produced it."""
        while True:
            node = self.producer(value)
            if node.op in FREE and node.op not in ("parameter", "constant") and node.inputs:
                if node.op == "bitcast-convert" and (
                    self.array(node.inputs[0]).nbytes != self.array(value).nbytes
                ):
                    return value
                value = node.inputs[0]
            else:
                return value


def kind_of(node: Node) -> str:
    """``"free"``, ``"kernel"`` (its own launch) or ``"fusible"`` (joins an XLA fusion)."""
    if node.op in FREE:
        return "free"
    if node.op in KERNEL or node.op in COLLECTIVE:
        return "kernel"
    return "fusible"
