#!/usr/bin/env bash
# CMake's launcher for nvcc when FP8JAX_PTXAS_LOG_DIR is set at configure time (CMakeLists.txt):
#   tools/ptxas_log.sh DIR NVCC-COMMAND...
# Runs the command and keeps what it printed (the build adds -Xptxas -v, so this is ptxas's
# report of every kernel it compiled) in DIR/<source file name>.log, where tools/ptxas_report.sh
# (FP8JAX_PTXAS_LOGS=DIR) reads the build's own machine code instead of compiling it again. The
# output is shown only when the command fails; its exit status is returned.

set -uo pipefail
dir="$1"
shift
src=""
for arg in "$@"; do
  if [[ "$arg" == *.cu ]]; then
    src="$arg"
  fi
done
mkdir -p "$dir"
log="$dir/$(basename "${src:-unnamed}").log"
"$@" >"$log" 2>&1
rc=$?
if [[ $rc -ne 0 ]]; then
  cat "$log" >&2
fi
exit $rc
