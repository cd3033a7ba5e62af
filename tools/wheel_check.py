"""Which compiled extensions an fp8jax wheel holds, and whether a user may be given it.

``python tools/wheel_check.py WHEEL [--cuda | --no-cuda]`` lists the wheel's extensions and exits
non-zero, naming the problem, when it lacks the CPU extension, holds a test-only one (built with
FP8JAX_TESTING=ON: those are for tools/test.sh, not for a user's install), or, with ``--cuda`` /
``--no-cuda``, lacks or holds the CUDA extension. tools/wheel_check.sh runs it on the wheel it
builds.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

CPU = "_fp8jax_cpu"
CUDA = "_fp8jax_cuda"
# CMakeLists.txt's FP8JAX_TESTING targets.
TESTING = ("_fp8jax_testing", "_fp8jax_host_cuda", "_fp8jax_cuda_testing")


def extensions(wheel: str | Path) -> list[str]:
    """The module names of the extensions in the wheel's fp8jax package, sorted."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    return sorted(
        Path(n).name.split(".")[0] for n in names if n.startswith("fp8jax/") and n.endswith(".so")
    )


def problems(wheel: str | Path, cuda: bool | None = None) -> list[str]:
    """What is wrong with the wheel for a user; empty when nothing is.

    ``cuda``: True when the CUDA extension must be there, False when it must not, None when
    either will do.
    """
    found = extensions(wheel)
    out = []
    if CPU not in found:
        out.append(f"no CPU extension ({CPU}) in the wheel")
    if cuda is True and CUDA not in found:
        out.append(f"no CUDA extension ({CUDA}) in the wheel")
    if cuda is False and CUDA in found:
        out.append(f"a CUDA extension ({CUDA}) in a wheel built without CUDA")
    testing = [name for name in found if name in TESTING]
    if testing:
        out.append(f"test-only extension(s) in the wheel: {', '.join(testing)} (FP8JAX_TESTING=ON)")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("wheel")
    parser.add_argument("--cuda", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args(argv)
    print(f"{args.wheel}: {', '.join(extensions(args.wheel)) or 'no extensions'}")
    found = problems(args.wheel, cuda=args.cuda)
    for problem in found:
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
