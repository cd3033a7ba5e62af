"""The dynamic section of an ELF shared object: what it needs and where it looks for it.

``python tools/elf_dynamic.py FILE...`` prints each file's NEEDED, SONAME, RPATH and RUNPATH
entries, as ``readelf -d`` would. It exists because readelf comes with binutils, which a plain
Debian or python:*-slim image does not have: tools/wheel_check.sh and tests/test_wheel.py read
the CUDA extension's RUNPATH (how it finds libcublasLt from the nvidia-cublas wheel) with it on a
machine without a compiler toolchain. 64-bit little-endian ELF only (x86-64, aarch64: the
platforms fp8jax builds for).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

# d_tag values (elf.h) of the entries read here.
TAGS = {1: "NEEDED", 14: "SONAME", 15: "RPATH", 29: "RUNPATH"}
_SHT_DYNAMIC = 6


def dynamic_entries(path: str | Path) -> dict[str, list[str]]:
    """The NEEDED, SONAME, RPATH and RUNPATH strings of ``path``, in file order, by tag name.

    A tag the file does not have maps to an empty list. Raises ``ValueError`` when the file is
    not a 64-bit little-endian ELF file or has no dynamic section.
    """
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF":
        raise ValueError(f"{path}: not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    # Elf64_Ehdr: e_shoff at 0x28, e_shentsize and e_shnum at 0x3A.
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)

    def section(i: int) -> tuple[int, int, int, int]:
        # Elf64_Shdr: sh_type (I) at 4, sh_offset (Q) at 24, sh_size (Q) at 32, sh_link (I) at 40.
        base = shoff + i * shentsize
        (sh_type,) = struct.unpack_from("<I", data, base + 4)
        sh_offset, sh_size = struct.unpack_from("<QQ", data, base + 24)
        (sh_link,) = struct.unpack_from("<I", data, base + 40)
        return sh_type, sh_offset, sh_size, sh_link

    out: dict[str, list[str]] = {name: [] for name in TAGS.values()}
    for i in range(shnum):
        sh_type, offset, size, link = section(i)
        if sh_type != _SHT_DYNAMIC:
            continue
        _, str_offset, _, _ = section(link)  # the string table the entries' values index
        for d_tag, d_val in struct.iter_unpack("<qQ", data[offset : offset + size]):
            if d_tag == 0:  # DT_NULL ends the table
                break
            if d_tag in TAGS:
                end = data.index(b"\0", str_offset + d_val)
                out[TAGS[d_tag]].append(data[str_offset + d_val : end].decode())
        return out
    raise ValueError(f"{path}: no dynamic section")


def search_path(path: str | Path) -> list[str]:
    """The directories the loader searches for ``path``'s NEEDED libraries, from its own entries.

    RUNPATH when the file has one (the loader then ignores RPATH), else RPATH; the entries split
    at ``:``, with ``$ORIGIN`` left as written.
    """
    entries = dynamic_entries(path)
    paths = entries["RUNPATH"] or entries["RPATH"]
    return [d for p in paths for d in p.split(":") if d]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: python tools/elf_dynamic.py FILE...", file=sys.stderr)
        return 2
    for path in argv:
        print(f"{path}:")
        for tag, values in dynamic_entries(path).items():
            for value in values:
                print(f"  {tag:8} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
