#!/usr/bin/env bash
# The GPU checks of issues 28, 31 (watch, flight-recorder) and 34 (fp8, muon) in one go, for a machine with one GPU
# (H200-class), in under 10 minutes; with 2+ GPUs the two-process smoke tests run too. Results: OUT/<part>.json and OUT/summary.txt.
#
#   tests/gpu/run.sh [--dry-run] [OUT]      # OUT defaults to runs/gpu-checks
#
# --dry-run runs every part that can on the CPU at tiny sizes (the rehearsal: run it before the
# first GPU run, so that run needs no fixing on the spot). Each part has its own time limit and a
# failed part does not stop the others; the exit status is 1 if any failed.
set -u
cd "$(dirname "$0")/../.."
DRY=""
if [ "${1:-}" = "--dry-run" ]; then DRY="--dry-run"; shift; fi
OUT="${1:-runs/gpu-checks}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
mkdir -p "$OUT"
: > "$OUT/summary.txt"
status=0

part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local line="$name: rc $rc ($((SECONDS - t0)) s)"
  [ $rc -eq 124 ] && line="$line TIMED OUT after $limit s"
  echo "$line" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || { status=1; tail -5 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$OUT/summary.txt"; }
}

"$PY" - <<'PYEOF' | tee -a "$OUT/summary.txt"
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, {n} GPU(s)"
      + "".join(f"\n  {i}: {torch.cuda.get_device_name(i)}" for i in range(n)))
PYEOF

LIMIT=150  # per part on the GPU; a CPU rehearsal is slower (compiling, every layout simulated)
[ -n "$DRY" ] && LIMIT=900
for p in syncs moe profile compile cp-kernel watch flight-recorder muon; do
  part "$p" "$LIMIT" "$PY" tests/gpu/checks.py "$p" "$OUT" $DRY
done
# FP8 against bf16, eager and compiled (two compilations): a longer limit
part fp8 $((LIMIT * 2)) "$PY" tests/gpu/checks.py fp8 "$OUT" $DRY
# a short run of the trainer under the GPU profile (bf16, compile, log_every 10) on the embedded data,
# with the TensorBoard sink and a console line per log step (issue 31: their path on the device)
TORCHRUN="$(dirname "$PY")/torchrun"
if [ -z "$DRY" ]; then
  part train "$LIMIT" "$TORCHRUN" --standalone --nproc-per-node 1 -m fivefold.train --profile gpu \
    --preset small --steps 30 --name gpu-checks --run.out_dir "$OUT/train" --overwrite \
    --logging.sinks jsonl,tensorboard --run.progress false
else
  part train "$LIMIT" "$PY" -m fivefold.train --profile gpu --preset tiny --steps 4 --nproc 1 \
    --device cpu --train.seq_len 64 --train.global_batch 4 --train.micro_batch 2 \
    --name gpu-checks --run.out_dir "$OUT/train" --overwrite \
    --logging.sinks jsonl,tensorboard --run.progress false
fi
if [ -z "$DRY" ]; then  # the two-process NCCL smoke tests (skipped by pytest with fewer than 2 GPUs)
  part smoke 240 "$PY" -m pytest -p no:cacheprovider -q -s tests/gpu/test_gpu_smoke.py
fi
echo "results in $OUT" | tee -a "$OUT/summary.txt"
exit $status
