#!/usr/bin/env bash
# The fp8jax test command: bash tools/test.sh [PYTEST ARGS...]
#
# Sets itself up: creates ./.venv (with the python3 on PATH) when missing and installs fp8jax into
# it, editable, building the CPU extension and, when nvcc is found, the CUDA one (FP8JAX_CUDA=
# AUTO|ON|OFF, default AUTO). Then: ruff lint, ruff format check, clang-format check of cpp/,
# the test suite, and the multi-device tests (tests/distributed, if present) on 8 emulated CPU
# devices.
# Extra arguments go to both pytest runs (e.g. -k quantize, -x). Exits non-zero on any failure.
# Both runs spread the tests over FP8JAX_TEST_JOBS pytest-xdist workers (default: one per CPU
# core, at most 4; 1 runs them in one process). FP8JAX_TEST_MARKS, when set, selects tests by
# marker for both runs (pytest -m, e.g. "not slow"). FP8JAX_TEST_IMPLEMENTATIONS=kernel runs the
# op tests under the kernels only (default: kernel and xla; tests/ops/_implementations.py).
# FP8JAX_TEST_DISTRIBUTED, when set, names the files of tests/distributed to run (default: all).
# Without a GPU, XLA compiles the tests at backend optimization level 0, except those marked slow
# (FP8JAX_TEST_XLA_O0=0: XLA's default for all).

set -euo pipefail

# shellcheck source=tools/_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"

lint_paths=()
for p in fp8jax tests examples benchmarks tools; do
  if [[ -e "$p" ]]; then
    lint_paths+=("$p")
  fi
done

echo "== ruff check"
"$FP8JAX_PY" -m ruff check "${lint_paths[@]}"
echo "== ruff format --check"
"$FP8JAX_PY" -m ruff format --check "${lint_paths[@]}"

# The C++/CUDA sources against .clang-format (clang-format comes with the test extras).
clang_format="$(dirname "$FP8JAX_PY")/clang-format"
if [[ -d cpp && -x "$clang_format" ]]; then
  echo "== clang-format --dry-run --Werror (cpp/)"
  find cpp -name '*.cc' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' | sort |
    xargs "$clang_format" --dry-run --Werror
fi

# The multi-device tests need XLA_FLAGS set before JAX starts, so they run in their own process
# (and are left out of the main run, which could not give them 8 devices).
jobs="${FP8JAX_TEST_JOBS:-}"
if [[ -z "$jobs" ]]; then
  jobs="$(nproc 2>/dev/null || echo 1)"
  jobs=$((jobs > 4 ? 4 : jobs))
fi
xdist=()
if [[ "$jobs" -gt 1 ]]; then
  xdist=(-n "$jobs")
  # On a GPU, each worker would otherwise reserve most of its memory up front.
  export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
fi
marks=()
if [[ -n "${FP8JAX_TEST_MARKS:-}" ]]; then
  marks=(-m "$FP8JAX_TEST_MARKS")
fi
main_args=(-q "${xdist[@]}" tests)
if [[ -d tests/distributed ]]; then
  main_args+=(--ignore=tests/distributed)
fi

# Without a GPU the suite's time is mostly XLA compiling (LLVM): at backend optimization level 0
# it compiles about 1.6x faster and computes the same bits (fast-math is off at every level, so
# nothing is reassociated). The tests marked slow are training loops, whose time is running the
# compiled steps (about 1.3x slower at level 0), so without FP8JAX_TEST_MARKS they run in a
# second pytest at XLA's default level. FP8JAX_TEST_XLA_O0=0 keeps the default for every test;
# a machine with a GPU always does.
o0=""
if [[ "${FP8JAX_TEST_XLA_O0:-1}" != 0 ]] && ! nvidia-smi -L >/dev/null 2>&1; then
  o0="--xla_backend_optimization_level=0"
fi
xla_o0=(env "XLA_FLAGS=${XLA_FLAGS:+$XLA_FLAGS }$o0")

if [[ -n "$o0" && ${#marks[@]} -eq 0 ]]; then
  echo "== pytest tests, not marked slow (XLA $o0)"
  fast=0
  "${xla_o0[@]}" "$FP8JAX_PY" -m pytest --durations=25 -m "not slow" "${main_args[@]}" "$@" ||
    fast=$?
  echo "== pytest tests, marked slow (training loops; XLA's default optimization)"
  slow=0
  "$FP8JAX_PY" -m pytest --durations=10 -m slow "${main_args[@]}" "$@" || slow=$?
  for rc in "$fast" "$slow"; do  # 5: no test selected (e.g. by -k), unless neither run has one
    if [[ $rc -ne 0 && $rc -ne 5 ]]; then
      exit "$rc"
    fi
  done
  if [[ $fast -eq 5 && $slow -eq 5 ]]; then
    exit 5
  fi
else
  echo "== pytest tests${o0:+ (XLA $o0)}"
  "${xla_o0[@]}" "$FP8JAX_PY" -m pytest --durations=25 "${marks[@]}" "${main_args[@]}" "$@"
fi

if [[ -d tests/distributed ]]; then
  read -ra distributed <<<"${FP8JAX_TEST_DISTRIBUTED:-tests/distributed}"
  echo "== pytest ${distributed[*]} (8 CPU devices)"
  rc=0
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=8${o0:+ $o0}" \
    JAX_PLATFORMS=cpu \
    "$FP8JAX_PY" -m pytest -q "${xdist[@]}" "${marks[@]}" "${distributed[@]}" "$@" || rc=$?
  if [[ $rc -eq 5 ]]; then
    echo "tests/distributed holds no tests yet (pytest exit 5); not a failure"
  elif [[ $rc -ne 0 ]]; then
    exit "$rc"
  fi
fi

echo "== all checks passed"
