#!/usr/bin/env bash
# fp8jax's wheel, installed where nothing can be compiled: bash tools/wheel_check.sh [WORK_DIR]
#
# 1. Builds a user wheel (pip wheel . --no-deps): the CPU extension only (FP8JAX_CUDA=OFF, what a
#    CPU machine gets; FP8JAX_WHEEL_CUDA=AUTO|ON builds the CUDA one too) and no test-only
#    extensions (FP8JAX_TESTING=OFF); tools/wheel_check.py checks what the wheel holds.
# 2. Creates a fresh venv (FP8JAX_WHEEL_PYTHON, default python3; CI passes the newest Python it
#    uses) and, with a PATH on which no compiler, CMake or nvcc can be found, installs the wheel
#    with flax and optax from wheels only (pip --only-binary=:all:: nothing is built).
# 3. From outside the checkout (so the installed package is the one imported): imports fp8jax
#    (and fp8jax.te, where this checkout has it), runs the quick start (examples/quickstart.py)
#    and, where the wheel holds the CUDA extension, checks that its RUNPATH looks for cuBLASLt in
#    the nvidia-cublas wheel beside it (tools/elf_dynamic.py: no readelf needed).
#
# WORK_DIR (default: a temporary directory, removed at exit) keeps the wheel (WORK_DIR/dist), the
# CMake build (WORK_DIR/build: apart from the editable install's build/<tag>, whose options differ)
# and the venv. FP8JAX_WHEEL=<a wheel> skips the build and checks that wheel (a rebuild is no
# faster with a kept build directory: each isolated build env has new paths, jaxlib's headers'
# among them, so everything compiles again). pip's cache is reused: JAX's wheels are usually in it.

set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root="$PWD"
py="${FP8JAX_WHEEL_PYTHON:-python3}"
cuda="${FP8JAX_WHEEL_CUDA:-OFF}"
if [[ $# -gt 0 ]]; then
  work="$1"
  mkdir -p "$work"
  work="$(cd "$work" && pwd)"
else
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
fi
start=$SECONDS

if [[ -n "${FP8JAX_WHEEL:-}" ]]; then
  wheel="$(cd "$(dirname "$FP8JAX_WHEEL")" && pwd)/$(basename "$FP8JAX_WHEEL")"
  echo "== wheel: $wheel (FP8JAX_WHEEL: not built here)"
  cuda_flag=()
else
  echo "== wheel: pip wheel . (FP8JAX_CUDA=$cuda, FP8JAX_TESTING=OFF) with $("$py" --version 2>&1)"
  rm -rf "$work/dist"
  FP8JAX_CUDA="$cuda" FP8JAX_TESTING=OFF FP8JAX_COVERAGE=OFF \
    "$py" -m pip wheel . --no-deps --quiet -w "$work/dist" -C build-dir="$work/build"
  wheels=("$work"/dist/fp8jax-*.whl)
  wheel="${wheels[0]}"
  case "$cuda" in
    OFF) cuda_flag=(--no-cuda) ;;
    ON) cuda_flag=(--cuda) ;;
    *) cuda_flag=() ;;
  esac
  echo "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1)) in $((SECONDS - start)) s"
fi
"$py" tools/wheel_check.py "$wheel" "${cuda_flag[@]}"

# A PATH without compilers: the new venv's bin, then a directory of links to the few programs a
# pip install and the checks below run. Nothing from /usr/bin or /usr/local/bin comes along
# wholesale, since cc, c++, gcc, cmake and nvcc live there.
echo "== a fresh venv and a PATH without a compiler [at $((SECONDS - start)) s]"
rm -rf "$work/venv" "$work/tools"
"$py" -m venv "$work/venv"
mkdir -p "$work/tools"
for tool in bash sh env uname cat ls rm mkdir; do
  ln -s "$(command -v "$tool")" "$work/tools/$tool"
done
clean_path="$work/venv/bin:$work/tools"
for tool in cc c++ gcc g++ clang cmake ninja make nvcc; do
  if PATH="$clean_path" command -v "$tool" >/dev/null 2>&1; then
    echo "FAIL: $tool is on the clean PATH ($(PATH="$clean_path" command -v "$tool"))" >&2
    exit 1
  fi
done
echo "ok: none of cc c++ gcc g++ clang cmake ninja make nvcc on PATH=$clean_path"

# Every later command runs under the clean PATH, outside the checkout, with nothing of the
# caller's Python setup leaking in.
in_venv() {
  (cd "$work" && env -u PYTHONPATH -u PYTHONHOME PYTHONNOUSERSITE=1 PATH="$clean_path" "$@")
}

echo "== pip install the wheel, flax and optax (wheels only) [at $((SECONDS - start)) s]"
in_venv python -m pip install --quiet --only-binary=:all: "$wheel" flax optax

echo "== import fp8jax from the installed wheel [at $((SECONDS - start)) s]"
in_venv python -c "
import os, sys, sysconfig
import fp8jax
from fp8jax import _ffi
site = sysconfig.get_paths()['platlib']
if not fp8jax.__file__.startswith(site + os.sep):
    sys.exit(f'FAIL: fp8jax imported from {fp8jax.__file__}, not from the venv ({site})')
_ffi.cpu_extension()
print('ok: fp8jax', fp8jax.__version__, 'from', os.path.dirname(fp8jax.__file__))
print('ok: fp8_support():', fp8jax.fp8_support())
"
# fp8jax.te (TransformerEngine's API, issue 51) where this checkout has it.
if in_venv python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("fp8jax.te") is None)'; then
  in_venv python -c "import fp8jax.te; print('ok: import fp8jax.te')"
else
  echo "skipped: import fp8jax.te (not in this checkout)"
fi

echo "== the quick start (examples/quickstart.py) [at $((SECONDS - start)) s]"
in_venv python "$root/examples/quickstart.py"

if in_venv python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("fp8jax._fp8jax_cuda") is None)'; then
  echo "== the CUDA extension's RUNPATH [at $((SECONDS - start)) s]"
  in_venv python - "$root/tools" <<'EOF'
import importlib.util, sys
sys.path.insert(0, sys.argv[1])
import elf_dynamic
origin = importlib.util.find_spec("fp8jax._fp8jax_cuda").origin
search = elf_dynamic.search_path(origin)
if search[:2] != ["$ORIGIN/../nvidia/cu13/lib", "$ORIGIN/../nvidia/cublas/lib"]:
    sys.exit(f"FAIL: {origin} does not look in the nvidia-cublas wheel first: {search}")
print("ok: RUNPATH", ":".join(search))
EOF
fi

echo "== wheel check passed in $((SECONDS - start)) s"
