#!/usr/bin/env bash
# scale-out.sh [LOG_DIR] - the scale-out run (issue 8) in one call, on the largest machine lent
# (8 or 4 GPUs; it runs on 2 as well): build, then
#   1. extraction throughput of the random-weight Qwen3.5-27B shape (4096-token documents) on every
#      GPU (one process each, one cache) vs 1 GPU: scripts/bench-extract.sh
#   2. training throughput of the Qwen3.6-27B drafter shape on every GPU (NCCL, ZeRO-1) vs 1 GPU
#      (the default trainer only: no --no-recompute / --no-overlap-optimizer side runs),
#      rows through the page cache (compute-bound) and from the disk (O_DIRECT), with each run's
#      data_wait: scripts/bench-train.sh
#   3. the disk's own read rate (dd O_DIRECT over a cache shard) and the rate the trainer needs
# and prints a table of scaling efficiencies last (full logs in LOG_DIR).
# Env: ARCHS (default 90a), EXTRACT_TOKENS_PER_GPU (default 65536), STEPS (default 14).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOG=${1:-$ROOT/out/scale-out}
mkdir -p "$LOG"
cd "$ROOT"
[ -f .device/env.sh ] && source .device/env.sh
B=$ROOT/build-gpu
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$NGPU" -lt 2 ]; then echo "scale-out: needs 2+ GPUs ($NGPU visible)"; exit 77; fi
cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA_ARCHS="${ARCHS:-90a}" >"$LOG/cmake.log" 2>&1 &&
  cmake --build "$B" -j "$(nproc)" >"$LOG/build.log" 2>&1 || { echo "build FAILED (build.log)"; exit 1; }
status=0

# 1. extraction: the same tokens per GPU in both runs would hide the final drain; give the
# all-GPU run NGPU times the tokens so each rank's share equals the 1-GPU run's
TOK=${EXTRACT_TOKENS_PER_GPU:-65536}
HF=0 RUNS=1 SHAPES=q35-4096 TOKENS=$TOK "$ROOT/scripts/bench-extract.sh" "$B" "$LOG/extract-1" >"$LOG/extract-1.log" 2>&1 || status=1
# the whole pipeline's rate after setup (the line's first figure; "forward alone" comes later)
x1=$(grep -E "^ours q35-4096 1 GPU" "$LOG/extract-1/bench-extract.txt" | sed -E 's/^ours q35-4096 1 GPU +([0-9]+) tok\/s.*/\1/')
HF=0 RUNS=all SHAPES=q35-4096 TOKENS=$((TOK * NGPU)) "$ROOT/scripts/bench-extract.sh" "$B" "$LOG/extract-n" >"$LOG/extract-n.log" 2>&1 || status=1
xn=$(grep -E "^ours q35-4096 $NGPU GPUs" "$LOG/extract-n/bench-extract.txt" | sed -E 's/.* ([0-9]+) tok\/s total.*/\1/')
xw=$(grep -E "^ours q35-4096 $NGPU GPUs" "$LOG/extract-n/bench-extract.txt" | sed -E 's/.*writer-bound ([0-9.]+)%.*/\1/')

# 2. + 3. training (1 GPU, all GPUs from the page cache, all GPUs from the disk) and the disk
GPUS=$NGPU SAMPLES=$((6 * NGPU)) STEPS=${STEPS:-14} PROFILE=${PROFILE:-1} PROFILE_GPUS=$NGPU DISK=1 RECOMPUTE=0 OVERLAP=0 SPECFORGE_SRC=/nonexistent \
  "$ROOT/scripts/bench-train.sh" "$B" "$LOG/train" >"$LOG/train.log" 2>&1 || status=1
t1=$(grep -E "^ours, 1 GPU +\(" "$LOG/train.log" | head -1 | sed 's/.*: //')
tn=$(grep -E "^ours, $NGPU GPUs \(same" "$LOG/train.log" | sed 's/.*: *//')
td=$(grep -E "^ours, $NGPU GPUs, cache read" "$LOG/train.log" | sed 's/.*: *//')
disk=$(grep -E "^disk read rate" "$LOG/train.log" | sed 's/.*: //')

eff() { python3 -c "
a, b, n = '$1', '$2', $3
try: print(f'{float(b) / float(a):.2f}x = {100 * float(b) / float(a) / n:.1f}% efficiency')
except Exception: print('?')"; }
f2() { echo "$1" | awk '{print $2}'; } # tok/s field of bench-train's figures
f1() { echo "$1" | awk '{print $1}'; } # ms/step
echo
echo "== scale-out ($(date -u +%FT%TZ)) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $NGPU"
printf '%-44s %s\n' "extract 27B shape, 1 GPU (tok/s)" "${x1:-FAILED}"
printf '%-44s %s\n' "extract 27B shape, $NGPU GPUs (tok/s total)" "${xn:-FAILED} (writer-bound ${xw:-?}%); $(eff "${x1:-0}" "${xn:-0}" "$NGPU")"
printf '%-44s %s\n' "train 27B drafter, 1 GPU" "${t1:-FAILED}"
printf '%-44s %s\n' "train, $NGPU GPUs, page cache" "${tn:-FAILED}; $(eff "$(f2 "$t1")" "$(f2 "$tn")" "$NGPU")"
printf '%-44s %s\n' "train, $NGPU GPUs, from the disk (O_DIRECT)" "${td:-FAILED}; $(eff "$(f2 "$t1")" "$(f2 "$td")" "$NGPU")"
printf '%-44s %s\n' "disk read rate (dd O_DIRECT)" "${disk:-?}"
# where the training's scaling goes: each rank's GPU time in ops per step (the profiled runs:
# 4 steps, the first left out) against the step time; the rest is the collectives not hidden
# under compute and waiting for the slowest rank
python3 - "$LOG/train" "$NGPU" "$(f1 "$t1")" "$(f1 "$tn")" <<'EOF' || true
import re, sys
d, n, s1, sn = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
ops = lambda f: [float(x) / 3 for x in re.findall(r"cuda profile \(device \d+\): ([0-9.]+) ms in ops", open(f).read())]
a, b = ops(d + "/train-profile.log"), ops(d + "/train-profile-%dgpu.log" % n)
print("GPU time in ops per step: 1 GPU %.1f ms (step %.1f); %d GPUs %.1f-%.1f ms over the ranks (step %.1f):"
      % (a[0], s1, n, min(b), max(b), sn))
print("  %.1f ms per step outside the ops on %d GPUs (collectives not hidden, the slowest rank), %.1f on 1"
      % (sn - max(b), n, s1 - a[0]) + " (AdamW on the side stream overlaps the ops: it can be < 0)")
EOF
echo "(train fields: ms/step tok/s TFLOP/s MFU peak-GiB data-wait; a row is ~142 MB compressed, so"
echo " $NGPU GPUs need ~$((142 * NGPU)) MB per step from the disk)"
exit $status
