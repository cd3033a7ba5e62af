#!/usr/bin/env bash
# DRAFT (issue 51 item 3; not yet run end to end): MaxText's TransformerEngine options on fp8jax.
#
#   bash tools/maxtext_check.sh [--steps N]
#
# Creates (once) a Python 3.12 venv at $FP8JAX_MAXTEXT_VENV (default
# ~/.cache/fp8jax/maxtext-venv), installs MaxText from the package index (MAXTEXT_VERSION,
# default 0.2.5) and fp8jax from this checkout (CPU extension only) into it, then trains a tiny
# decoder on CPU with synthetic data for quantization in {none, te_fp8_delayedscaling,
# te_fp8_currentscaling, te_mxfp8} and scan_layers in {true, false}. TransformerEngine is not
# installed: a sitecustomize.py on PYTHONPATH runs fp8jax.te.install() before MaxText imports
# transformer_engine. Passes when every run finishes, its loss falls, and each FP8 run's final
# loss is within MAXTEXT_LOSS_RTOL (default 0.05) of the no-FP8 run's with the same scan_layers.
# Logs: $FP8JAX_MAXTEXT_OUT (default ./maxtext_runs).
#
# Not covered yet: the check that the FP8 state moves (read the _overwrite_with_gradient
# collection from a checkpoint), attention=cudnn_flash_te, and te_nvfp4 (expected to raise
# NotImplementedError naming NVFP4BlockScaling).

set -euo pipefail

STEPS=5
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) STEPS="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "maxtext_check: unknown argument $1" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FP8JAX_MAXTEXT_VENV:-$HOME/.cache/fp8jax/maxtext-venv}"
OUT="${FP8JAX_MAXTEXT_OUT:-$ROOT/maxtext_runs}"
PY312="${FP8JAX_PYTHON312:-python3.12}"
RTOL="${MAXTEXT_LOSS_RTOL:-0.05}"
mkdir -p "$OUT"

if ! "$VENV/bin/python" -c "import maxtext" >/dev/null 2>&1; then
  command -v "$PY312" >/dev/null || { echo "maxtext_check: $PY312 is needed" >&2; exit 1; }
  "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet "maxtext==${MAXTEXT_VERSION:-0.2.5}"
fi
# fp8jax from this checkout, CPU only (re-installed each run: cheap once built)
FP8JAX_CUDA=OFF FP8JAX_TESTING=OFF "$VENV/bin/python" -m pip install --quiet "$ROOT"
if "$VENV/bin/python" -c "import importlib.util as u; exit(u.find_spec('transformer_engine') is None)"; then
  echo "maxtext_check: transformer_engine is installed in $VENV; fp8jax.te would refuse" >&2
  exit 1
fi

SITE="$OUT/site"
mkdir -p "$SITE"
cat > "$SITE/sitecustomize.py" <<'PY'
import fp8jax.te

fp8jax.te.install()
PY

CONFIG="$("$VENV/bin/python" -c 'import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml"))')"

run() {  # run QUANT SCAN -> writes $OUT/QUANT-scanSCAN.log
  local quant="$1" scan="$2" name="$1-scan$2"
  local q="$quant"; [[ "$quant" == none ]] && q=""
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cpu \
    "$VENV/bin/python" -m maxtext.trainers.pre_train.train "$CONFIG" \
    run_name="$name" base_output_directory="$OUT/out" hardware=cpu \
    skip_jax_distributed_system=true dataset_type=synthetic steps="$STEPS" log_period=1 \
    enable_checkpointing=false enable_goodput_recording=false \
    quantization="$q" scan_layers="$scan" attention=dot_product \
    base_emb_dim=128 base_num_query_heads=4 base_num_kv_heads=4 head_dim=32 base_mlp_dim=256 \
    base_num_decoder_layers=2 vocab_size=256 max_target_length=128 per_device_batch_size=2 \
    > "$OUT/$name.log" 2>&1
}

status=0
for scan in true false; do
  for quant in none te_fp8_delayedscaling te_fp8_currentscaling te_mxfp8; do
    if ! run "$quant" "$scan"; then
      echo "FAIL $quant scan_layers=$scan (see $OUT/$quant-scan$scan.log)"; status=1; continue
    fi
  done
  "$VENV/bin/python" - "$OUT" "$scan" "$RTOL" <<'PY' || status=1
import re, sys
out, scan, rtol = sys.argv[1], sys.argv[2], float(sys.argv[3])
def losses(q):
    text = open(f"{out}/{q}-scan{scan}.log", errors="replace").read()
    return [float(v) for v in re.findall(r"\bloss: ([0-9.eE+-]+)", text)]
base = losses("none")
ok = len(base) > 1 and base[-1] < base[0]
print(f"none scan_layers={scan}: {base}")
for q in ("te_fp8_delayedscaling", "te_fp8_currentscaling", "te_mxfp8"):
    got = losses(q)
    good = len(got) == len(base) and got[-1] < got[0] and abs(got[-1] - base[-1]) <= rtol * abs(base[-1])
    print(f"{'ok  ' if good else 'FAIL'} {q} scan_layers={scan}: {got}")
    ok &= good
sys.exit(0 if ok else 1)
PY
done
exit "$status"
