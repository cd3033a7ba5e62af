# shellcheck shell=bash
# Sourced (not run) by tools/test.sh and tools/demo.sh: puts fp8jax, built from this checkout, into
# the repo's own virtual environment, ./.venv, creating it when it is missing.
#
# After sourcing, the current directory is the repo root and these are set:
#   FP8JAX_ROOT  absolute path of the repo root
#   FP8JAX_PY    the venv's python
#   FP8JAX_CUDA  passed to the build (AUTO when unset: the CUDA extension is built if nvcc is found)
#   FP8JAX_TESTING  passed to the build (ON when unset: the test-only extensions are built)
# FP8JAX_CUBLAS_ROOT, when set, tells the CUDA build where cuBLASLt is (see CMakeLists.txt); .ci/run
# sets it to a cached nvidia-cublas wheel.
#
# The editable install ("pip install -e .[test]") is redone only when something that changes the
# compiled extensions or the package's file list changed since the last install (a stamp in the
# venv records that), so a second run starts in seconds. Python edits need no reinstall.
# FP8JAX_REINSTALL=1 forces the install. FP8JAX_VENV (default ./.venv) and FP8JAX_PYTHON (the
# interpreter that creates it, default python3) let CI keep a second environment, e.g. the newest
# JAX on a newer Python, beside the first.

set -euo pipefail

FP8JAX_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$FP8JAX_ROOT"
export FP8JAX_CUDA="${FP8JAX_CUDA:-AUTO}"
# The tests need the test-only extensions (cpp/testing/); a user's `pip install` leaves them out.
export FP8JAX_TESTING="${FP8JAX_TESTING:-ON}"

_fp8jax_venv="${FP8JAX_VENV:-$FP8JAX_ROOT/.venv}"
_fp8jax_python="${FP8JAX_PYTHON:-python3}"
FP8JAX_PY="$_fp8jax_venv/bin/python"

if ! "$FP8JAX_PY" -c "import sys" >/dev/null 2>&1; then
  if ! command -v "$_fp8jax_python" >/dev/null 2>&1; then
    echo "fp8jax: $_fp8jax_python (>= 3.10) is needed on PATH to create $_fp8jax_venv" >&2
    exit 1
  fi
  echo "fp8jax: creating $_fp8jax_venv with $("$_fp8jax_python" --version 2>&1)" \
    "($(command -v "$_fp8jax_python"))"
  rm -rf "$_fp8jax_venv"
  "$_fp8jax_python" -m venv "$_fp8jax_venv"
fi

# What the install depends on: build files, kernel sources, the package's file list (an editable
# install maps known files), the CUDA switch, nvcc's presence, the cuBLAS root, and the interpreter.
_fp8jax_stamp_now() {
  {
    echo "FP8JAX_CUDA=$FP8JAX_CUDA FP8JAX_TESTING=$FP8JAX_TESTING nvcc=$(command -v nvcc || echo none)"
    echo "FP8JAX_COVERAGE=${FP8JAX_COVERAGE:-OFF}"
    echo "FP8JAX_CUBLAS_ROOT=${FP8JAX_CUBLAS_ROOT:-} FP8JAX_CUDA_ARCHS=${FP8JAX_CUDA_ARCHS:-}"
    "$FP8JAX_PY" -c "import sys; print(sys.version)"
    cat pyproject.toml CMakeLists.txt
    find cpp -type f -print0 | LC_ALL=C sort -z | xargs -0 -r cat
    find fp8jax -type f \( -name '*.py' -o -name '*.pyi' -o -name 'py.typed' \) | LC_ALL=C sort
  } | sha256sum | cut -d' ' -f1
}

_fp8jax_stamp_file="$_fp8jax_venv/.fp8jax-install-stamp"
_fp8jax_stamp="$(_fp8jax_stamp_now)"
if [[ "${FP8JAX_REINSTALL:-0}" == "1" ]] \
  || [[ ! -f "$_fp8jax_stamp_file" ]] \
  || [[ "$(cat "$_fp8jax_stamp_file")" != "$_fp8jax_stamp" ]] \
  || ! "$FP8JAX_PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('fp8jax._fp8jax_cpu') is None)" >/dev/null 2>&1; then
  echo "fp8jax: installing into .venv (FP8JAX_CUDA=$FP8JAX_CUDA); this builds the extensions"
  rm -f "$_fp8jax_stamp_file"
  "$FP8JAX_PY" -m pip install --upgrade pip
  "$FP8JAX_PY" -m pip install -e ".[test]"
  echo "$_fp8jax_stamp" >"$_fp8jax_stamp_file"
else
  echo "fp8jax: .venv is up to date with this checkout (FP8JAX_REINSTALL=1 forces a reinstall)"
fi

unset _fp8jax_venv _fp8jax_python _fp8jax_stamp _fp8jax_stamp_file
unset -f _fp8jax_stamp_now
export FP8JAX_ROOT FP8JAX_PY
