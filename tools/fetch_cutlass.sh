#!/usr/bin/env bash
# CUTLASS's C++ headers for the grouped GEMM's tensor-core path: bash tools/fetch_cutlass.sh DEST
#
# Downloads the pinned nvidia-cutlass wheel from the package index (pip download: no install, no
# dependencies) and keeps only its headers, cutlass_library/source/include, as DEST/include (about
# 27 MB), so that FP8JAX_CUTLASS_ROOT=DEST builds cpp/sm90/. Does nothing when DEST already has
# them. .ci/run caches them as it caches cuBLAS; for a GPU session, fetch them into
# third_party/cutlass (ignored by git) and carry that path to the device, where
# tools/gpu_check.sh finds it (docs/performance.md has the command).
set -euo pipefail

WHEEL="nvidia-cutlass==4.2.0.0"
dest="${1:?usage: bash tools/fetch_cutlass.sh DEST}"
if [[ -f "$dest/include/cutlass/cutlass.h" ]]; then
  echo "fetch_cutlass: reusing $dest"
  exit 0
fi
py="${PYTHON:-python3}"
mkdir -p "$(dirname "$dest")"
tmp="$(mktemp -d "$(dirname "$dest")/.cutlass.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp/wheel" "$WHEEL"
"$py" - "$tmp"/wheel/*.whl "$tmp/x" <<'PY'
import sys
import zipfile

prefix = "cutlass_library/source/include/"
with zipfile.ZipFile(sys.argv[1]) as z:
    names = [n for n in z.namelist() if n.startswith(prefix)]
    if not any(n.endswith("include/cutlass/cutlass.h") for n in names):
        sys.exit(f"fetch_cutlass: {sys.argv[1]} has no {prefix}cutlass/cutlass.h")
    z.extractall(sys.argv[2], names)
PY
rm -rf "$dest"
mv "$tmp/x/cutlass_library/source" "$dest"
echo "fetch_cutlass: $WHEEL's headers in $dest"
