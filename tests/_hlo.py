"""Reading collectives out of compiled HLO text, for the multi-device tests."""

from __future__ import annotations

import re


def count(hlo: str, op: str) -> int:
    """Number of ``op`` instructions (sync or ``-start`` async form) in ``hlo``."""
    return len(re.findall(rf"\s{op}(?:-start)?\(", hlo))


def all_reduce_group_sizes(hlo: str) -> list[int]:
    """Replica-group sizes of every all-reduce (iota ``[groups,size]<=[n]`` or explicit)."""
    sizes = []
    for line in hlo.splitlines():
        if not re.search(r"\sall-reduce(?:-start)?\(", line):
            continue
        m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
        if m:
            sizes.append(int(m.group(2)))
            continue
        m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
        if m is None:
            raise AssertionError(f"cannot read the replica groups of {line!r}")
        sizes.append(len(m.group(1).split(",")))
    return sizes
