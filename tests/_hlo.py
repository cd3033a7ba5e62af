"""Reading collectives out of compiled HLO text, for the multi-device tests."""

from __future__ import annotations

import re


def count(hlo: str, op: str) -> int:
    """Number of ``op`` instructions (sync or ``-start`` async form) in ``hlo``."""
    return len(re.findall(rf"\s{op}(?:-start)?\(", hlo))


def group_size(line: str) -> int:
    """The replica-group size of one collective instruction, in any of the forms XLA prints:
    iota ``[groups,size]<=[n]``, explicit ``{{0,1,...},...}`` or, in newer XLA, named mesh axes
    ``mesh['data'=2,'model'=4] {'model'}`` (possibly with ``device_ids=(...)`` before the
    braces)."""
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)
    if m is None:
        raise AssertionError(f"cannot read the replica groups of {line!r}")
    sizes = {name: int(n) for name, n in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
    size = 1
    for name in re.findall(r"'(\w+)'", m.group(2)):
        size *= sizes[name]
    return size


def all_reduce_group_sizes(hlo: str) -> list[int]:
    """Replica-group sizes of every all-reduce instruction, in order."""
    return [
        group_size(line)
        for line in hlo.splitlines()
        if re.search(r"\sall-reduce(?:-start)?\(", line)
    ]
