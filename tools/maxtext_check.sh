#!/usr/bin/env bash
# MaxText's TransformerEngine options on fp8jax (issue 51 item 3): train a tiny decoder on CPU.
#
#   bash tools/maxtext_check.sh [--steps N] [--only QUANT] [--scan true|false]
#                               [--attention dot_product|cudnn_flash_te]
#
# 1. Creates (once) a Python 3.12 venv at $FP8JAX_MAXTEXT_VENV (default
#    ${FP8JAX_CACHE:-~/.cache/fp8jax}/maxtext-venv) and installs maxtext==0.2.5 plus the pinned
#    set of tools/maxtext_requirements.txt, all with --no-deps --only-binary (maxtext declares
#    its dependencies only as extras; the cuda12 one is ~300 packages, TransformerEngine among
#    them). No transformer_engine is installed.
# 2. fp8jax from this checkout: a .pth to it (the checkout's compiled CPU extension,
#    fp8jax/_fp8jax_cpu*.so, must be built: tools/build.sh or pip install -e). The venv's
#    jax/jaxlib are pinned to the versions that extension is built against (0.12.0.1).
# 3. A sitecustomize.py on PYTHONPATH runs fp8jax.te.install() before MaxText imports
#    transformer_engine, and (FP8JAX_MAXTEXT_TRACE=1, set here) logs the delayed-scaling state
#    that every TE GEMM reads, one "FP8STATE" line per GEMM and step (jax.debug.callback).
# 4. Trains MaxText's default decoder (llama2 block), tiny: emb 128, 2 layers, 4 heads, mlp 256,
#    vocab 256, 128 tokens, batch 1, synthetic data, hardware=cpu, no checkpoints, lr 1e-3, for
#    quantization in {none, fp8, te_fp8_delayedscaling, te_fp8_currentscaling, te_mxfp8} x
#    scan_layers in {true, false}. "fp8" is MaxText's own FP8 (Flax's Fp8DotGeneralOp, delayed
#    scaling, no TE and no fp8jax): the independent reference for the te_* runs.
#
# Passes when every run finishes, its loss falls, each te_* run's last loss is within
# MAXTEXT_FP8_RTOL (default 0.01) of the "fp8" run's and within MAXTEXT_LOSS_RTOL (default 0.10)
# of the no-FP8 run's (this tiny bf16 model's FP8 forward costs ~0.07-0.16 nats from step 0 on,
# under any FP8 implementation: docs/maxtext_check.md), and under te_fp8_delayedscaling the logged
# scales moved off their initial 1 (MaxText's step updates the _overwrite_with_gradient
# collection). Logs and summary.json: $FP8JAX_MAXTEXT_OUT (default ./maxtext_runs).
#
# attention=cudnn_flash_te (MaxText's TE attention: transformer_engine's DotProductAttention,
# here fp8jax.te's, with context_parallel_axis="context", an axis of size 1 on one CPU device)
# runs under none, fp8 and te_fp8_delayedscaling; each such run passes when, besides the above,
# it logged the TE attention's arguments ("TEATTN" lines, from a subclass that sitecustomize
# puts at TE's path) and its last loss is within MAXTEXT_ATTN_RTOL (default 0.01) of the
# attention=dot_product run's. te_nvfp4 is not run: fp8jax has no NVFP4
# (recipe.NVFP4BlockScaling raises NotImplementedError when used).

set -euo pipefail

STEPS=10
QUANTS=(none fp8 te_fp8_delayedscaling te_fp8_currentscaling te_mxfp8)
SCANS=(true false)
ATTENTIONS=(dot_product cudnn_flash_te)
TE_ATTENTION_QUANTS=" none fp8 te_fp8_delayedscaling "  # the ones run with cudnn_flash_te
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) STEPS="$2"; shift 2 ;;
    --only) QUANTS=(none fp8 "$2"); shift 2 ;;
    --scan) SCANS=("$2"); shift 2 ;;
    --attention) ATTENTIONS=("$2"); shift 2 ;;
    -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
    *) echo "maxtext_check: unknown argument $1" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${FP8JAX_CACHE:-$HOME/.cache/fp8jax}"
VENV="${FP8JAX_MAXTEXT_VENV:-$CACHE/maxtext-venv}"
OUT="${FP8JAX_MAXTEXT_OUT:-$ROOT/maxtext_runs}"
PY312="${FP8JAX_PYTHON312:-$HOME/.pyenv/versions/3.12.1/bin/python}"
MAXTEXT_VERSION="${MAXTEXT_VERSION:-0.2.5}"
RTOL="${MAXTEXT_LOSS_RTOL:-0.10}"
FP8_RTOL="${MAXTEXT_FP8_RTOL:-0.01}"
ATTN_RTOL="${MAXTEXT_ATTN_RTOL:-0.01}"
mkdir -p "$OUT"

if ! "$VENV/bin/python" -c "import maxtext, ml_collections, datasets" >/dev/null 2>&1; then
  [[ -x "$PY312" ]] || PY312="$(command -v python3.12)" || {
    echo "maxtext_check: Python 3.12 is needed (FP8JAX_PYTHON312)" >&2; exit 1; }
  "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --only-binary :all: --no-deps \
    "maxtext==$MAXTEXT_VERSION" -r "$ROOT/tools/maxtext_requirements.txt"
fi
if ! compgen -G "$ROOT/fp8jax/_fp8jax_cpu*.so" >/dev/null; then
  echo "maxtext_check: build fp8jax's CPU extension in $ROOT first (fp8jax/_fp8jax_cpu*.so)" >&2
  exit 1
fi
SITE_PACKAGES="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$ROOT" > "$SITE_PACKAGES/fp8jax_checkout.pth"
if "$VENV/bin/python" -c "import importlib.util as u; exit(u.find_spec('transformer_engine') is None)"; then
  echo "maxtext_check: transformer_engine is installed in $VENV; fp8jax.te would refuse" >&2
  exit 1
fi

SITE="$OUT/site"
mkdir -p "$SITE"
cat > "$SITE/sitecustomize.py" <<'PY'
"""Runs before MaxText: TE's imports resolve to fp8jax.te; optionally logs the FP8 state."""
import os

import fp8jax.te

fp8jax.te.install()

if os.environ.get("FP8JAX_MAXTEXT_TRACE"):
    import jax
    import numpy as np

    from fp8jax.te.jax.flax import module

    _generate = module.TransformerEngineBase.generate_quantizer_set

    def _log(path, xs, ks, gs, xh):
        first = lambda a: float(np.ravel(a)[0])  # noqa: E731 (one layer of a scan: its own)
        print(
            f"FP8STATE {path} x_scale={first(xs):.6g} kernel_scale={first(ks):.6g} "
            f"grad_scale={first(gs):.6g} x_amax_max={float(np.max(xh)):.6g}",
            flush=True,
        )

    def generate_quantizer_set(self, *args, **kwargs):
        qs = _generate(self, *args, **kwargs)
        if qs.x.scale is not None:
            path = "/".join(str(p) for p in self.scope.path) if self.scope else ""
            path = path or type(self).__name__  # MaxText's NNX model: no Linen path
            jax.debug.callback(
                lambda *a, path=path: _log(path, *a),
                qs.x.scale,
                qs.kernel.scale,
                qs.dgrad.scale,
                qs.x.amax_history,
            )
        return qs

    module.TransformerEngineBase.generate_quantizer_set = generate_quantizer_set

    import flax.linen as nn

    from fp8jax.te.jax.flax import transformer

    class DotProductAttention(transformer.DotProductAttention):
        """fp8jax.te's, logging what MaxText passes (once per trace)."""

        @nn.compact
        def __call__(self, query, key, value, sequence_descriptor=None, *args, **kwargs):
            mesh = jax.sharding.get_abstract_mesh()
            axis = self.context_parallel_axis
            size = None if mesh.empty or axis not in mesh.axis_names else mesh.shape[axis]
            desc = getattr(sequence_descriptor, "shape", type(sequence_descriptor).__name__)
            print(
                f"TEATTN class={type(self).__mro__[1].__module__} q={tuple(query.shape)} "
                f"attn_mask_type={self.attn_mask_type} qkv_layout={self.qkv_layout} "
                f"scale_factor={self.scale_factor} window_size={self.window_size} "
                f"context_parallel_axis={axis} size={size} "
                f"strategy={self.context_parallel_strategy} "
                f"load_balanced={self.context_parallel_causal_load_balanced} "
                f"sequence_descriptor={desc}",
                flush=True,
            )
            return super().__call__(query, key, value, sequence_descriptor, *args, **kwargs)

    transformer.DotProductAttention = DotProductAttention
PY

CONFIG="$SITE_PACKAGES/maxtext/configs/base.yml"

run() {  # run QUANT SCAN ATTENTION -> $OUT/QUANT-scanSCAN-ATTENTION.log
  local quant="$1" scan="$2" attention="$3" name="$1-scan$2-$3"
  local q="$quant"; [[ "$quant" == none ]] && q=""
  local start=$SECONDS
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cpu FP8JAX_MAXTEXT_TRACE=1 \
    "$VENV/bin/python" -m maxtext.trainers.pre_train.train "$CONFIG" \
    run_name="$name" base_output_directory="$OUT/out" hardware=cpu \
    skip_jax_distributed_system=true dataset_type=synthetic steps="$STEPS" log_period=1 \
    enable_checkpointing=false enable_goodput_recording=false enable_tensorboard=false \
    learning_rate=1e-3 quantization="$q" scan_layers="$scan" attention="$attention" \
    base_emb_dim=128 base_num_query_heads=4 base_num_kv_heads=4 head_dim=32 base_mlp_dim=256 \
    base_num_decoder_layers=2 vocab_size=256 max_target_length=128 per_device_batch_size=1 \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - start))" >> "$OUT/times.txt"
  return $rc
}

: > "$OUT/times.txt"
status=0
for attention in "${ATTENTIONS[@]}"; do
  for scan in "${SCANS[@]}"; do
    for quant in "${QUANTS[@]}"; do
      [[ $attention == cudnn_flash_te && $TE_ATTENTION_QUANTS != *" $quant "* ]] && continue
      run "$quant" "$scan" "$attention" || {
        echo "FAIL $quant scan_layers=$scan attention=$attention (see $OUT/$quant-scan$scan-$attention.log)"
        status=1
      }
    done
  done
done

"$VENV/bin/python" - "$OUT" "$RTOL" "$FP8_RTOL" "$STEPS" "${QUANTS[*]}" "${SCANS[*]}" "${ATTENTIONS[*]}" \
  "$ATTN_RTOL" "$TE_ATTENTION_QUANTS" <<'PY' || status=1
import json, os, re, sys
import importlib.metadata as md

out, rtol, fp8_rtol, steps = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
quants, scans, attentions = (a.split() for a in sys.argv[5:8])
attn_rtol, te_attention_quants = float(sys.argv[8]), sys.argv[9].split()
times = dict(line.split(" ", 1) for line in open(f"{out}/times.txt").read().splitlines())

def parse(name):
    path = f"{out}/{name}.log"
    text = open(path, errors="replace").read() if os.path.exists(path) else ""
    losses = [float(v) for v in re.findall(r"completed step: \d+, .*?\bloss: ([0-9.eE+-]+)", text)]
    state = [dict(re.findall(r"(\w+)=([0-9.eE+-]+)", m)) for m in re.findall(r"^FP8STATE .*$", text, re.M)]
    attn = re.findall(r"^TEATTN (.*)$", text, re.M)
    return losses, [{k: float(v) for k, v in s.items()} for s in state], attn

ok, runs = True, []
for attention in attentions:
    for scan in scans:
        base, _, _ = parse(f"none-scan{scan}-{attention}")
        ref, _, _ = parse(f"fp8-scan{scan}-{attention}")
        for q in quants:
            if attention == "cudnn_flash_te" and q not in te_attention_quants:
                continue
            name = f"{q}-scan{scan}-{attention}"
            losses, state, attn = parse(name)
            good = len(losses) == steps and losses[-1] < losses[0]
            rel_dp = None
            if attention == "cudnn_flash_te":  # fp8jax.te's attention ran, and tracks dot_product's
                dp = parse(f"{q}-scan{scan}-dot_product")[0] if "dot_product" in attentions else None
                rel_dp = (losses[-1] - dp[-1]) / dp[-1] if dp and losses else None
                good &= bool(attn) and (rel_dp is None or abs(rel_dp) <= attn_rtol)
            else:
                good &= not attn
            rel = rel_fp8 = None
            if q != "none" and base and losses:
                rel = (losses[-1] - base[-1]) / base[-1]
                good &= abs(rel) <= rtol
            if q.startswith("te_"):
                rel_fp8 = (losses[-1] - ref[-1]) / ref[-1] if ref and losses else None
                good &= rel_fp8 is not None and abs(rel_fp8) <= fp8_rtol
            moved = None
            if q == "te_fp8_delayedscaling":
                last = state[-1] if state else {}
                moved = bool(state) and all(last.get(k, 1.0) != 1.0 for k in ("x_scale", "kernel_scale", "grad_scale"))
                good &= moved
            elif q.startswith("te_"):
                good &= not state  # stateless recipes declare no state
            ok &= good
            runs.append({"quantization": q, "scan_layers": scan, "attention": attention,
                         "ok": good, "losses": losses, "rel_to_none_last": rel, "rel_to_fp8_last": rel_fp8,
                         "rel_to_dot_product_last": rel_dp, "te_attention": attn[0] if attn else None,
                         "state_lines": len(state), "state_moved": moved,
                         "last_state": state[-1] if state else None,
                         "time": times.get(name, "").strip()})
            print(f"{'ok  ' if good else 'FAIL'} {name}: last loss "
                  f"{losses[-1] if losses else None} (first {losses[0] if losses else None}), "
                  f"vs none {'' if rel is None else f'{100 * rel:+.2f}%'}, "
                  f"vs fp8 {'' if rel_fp8 is None else f'{100 * rel_fp8:+.2f}%'}, "
                  f"vs dot_product {'' if rel_dp is None else f'{100 * rel_dp:+.2f}%'}, "
                  f"state lines {len(state)}, moved {moved}; {times.get(name, '').strip()}")
versions = {p: md.version(p) for p in ("maxtext", "jax", "jaxlib", "flax", "optax")}
versions["python"] = sys.version.split()[0]
json.dump({"steps": steps, "rtol": rtol, "fp8_rtol": fp8_rtol, "attn_rtol": attn_rtol,
           "versions": versions, "runs": runs},
          open(f"{out}/summary.json", "w"), indent=1)
print("versions:", versions)
sys.exit(0 if ok else 1)
PY
echo "maxtext_check: $([[ $status == 0 ]] && echo passed || echo FAILED) (logs: $OUT)"
exit "$status"
