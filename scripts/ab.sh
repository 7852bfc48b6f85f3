#!/usr/bin/env bash
# ab.sh BUILD LOGDIR PART...: the same measurement with and without an environment switch, in
# one call on the GPU machine (an opt-in kernel variant against the default). AB_ENV holds the
# switch, e.g. AB_ENV="DFLASH_ATTN_FWD=ws" or AB_ENV="DFLASH_RMSNORM_BWD=twopass".
# Parts:
#   test   every GPU test (ctest -R ^test_gpu_) under AB_ENV
#   attn   tools/bench_dflash_attn with and without AB_ENV: times, and the hash of the default
#          forward's bits per configuration (equal hashes: bitwise the same forward)
#   train  scripts/bench-train.sh (1 GPU, no SpecForge) with and without AB_ENV: the median
#          and step-by-step times, and whether the losses are identical step by step;
#          AB_GPUS=N: also on N GPUs (bench-train's GPUS), compared the same way
# Prints a short table last; logs in LOGDIR. Exit status: 1 when a part failed.
set -u
B=${1:?build dir}; LOG=${2:?log dir}; shift 2
AB_ENV=${AB_ENV:?AB_ENV, e.g. DFLASH_ATTN_FWD=ws}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$LOG"
status=0; rows=()
for part in "$@"; do
  case $part in
  test)
    # through ctest (its arguments, its skip code 77)
    if env $AB_ENV ctest --test-dir "$B" -R '^test_gpu_' --output-on-failure >"$LOG/test.log" 2>&1; then
      rows+=("GPU tests under $AB_ENV: $(grep -E 'tests passed' "$LOG/test.log")")
    else
      status=1
      rows+=("GPU tests under $AB_ENV: FAILED ($(grep -E 'tests passed|tests failed' "$LOG/test.log" | tail -1); test.log)")
    fi
    ;;
  attn)
    timeout 200 "$B/tools/bench_dflash_attn" >"$LOG/attn-a.log" 2>&1 || status=1
    env $AB_ENV timeout 200 "$B/tools/bench_dflash_attn" >"$LOG/attn-b.log" 2>&1 || status=1
    for side in a b; do
      echo "-- bench_dflash_attn, $([ $side = a ] && echo default || echo "$AB_ENV")"
      grep -E "default forward bits|visible pairs" "$LOG/attn-$side.log" | cut -c1-170
    done
    same=$(diff <(grep "default forward bits" "$LOG/attn-a.log") <(grep "default forward bits" "$LOG/attn-b.log") >/dev/null && echo yes || echo no)
    rows+=("attention forward bits equal with and without $AB_ENV: $same")
    ;;
  train)
    for side in a b; do
      if [ $side = a ]; then e=""; else e=$AB_ENV; fi
      env $e DISK=0 RECOMPUTE=0 OVERLAP=0 PROFILE=0 GPUS=${AB_GPUS:-1} SPECFORGE_SRC=/nonexistent timeout 240 \
        "$ROOT/scripts/bench-train.sh" "$B" "$LOG/train-$side" >"$LOG/train-$side.log" 2>&1 || status=1
    done
    python3 - "$LOG" <<'PY' || status=1
import json, statistics, sys
log = sys.argv[1]
import glob, os
def rows(side, name):
    return [json.loads(l) for l in open(f"{log}/train-{side}/{name}") if '"loss"' in l]
for name in sorted(os.path.basename(f) for f in glob.glob(f"{log}/train-a/train-*gpu.jsonl")):
    a, b = rows("a", name), rows("b", name)
    print(f"-- {name}\nstep  default ms  switched ms   loss equal")
    for i, (x, y) in enumerate(zip(a, b)):
        print("%4d %11.1f %12.1f   %s" % (i + 1, 1e3 * x["step_s"], 1e3 * y["step_s"], x["loss"] == y["loss"]))
    ma = statistics.median([x["step_s"] for x in a[3:]]) * 1e3
    mb = statistics.median([x["step_s"] for x in b[3:]]) * 1e3
    d = statistics.median([(y["step_s"] - x["step_s"]) * 1e3 for x, y in zip(a[3:], b[3:])])
    eq = all(x["loss"] == y["loss"] for x, y in zip(a, b))
    print(f"{name}: medians (steps 4-): {ma:.1f} vs {mb:.1f} ms; median step-by-step difference {d:+.1f} ms; losses identical: {eq}")
PY
    rows+=("27B-shape step, default vs $AB_ENV: see the table above")
    ;;
  *) echo "ab.sh: unknown part $part"; status=1 ;;
  esac
done
echo "== ab.sh ($AB_ENV)"
for r in "${rows[@]}"; do echo "$r"; done
exit $status
