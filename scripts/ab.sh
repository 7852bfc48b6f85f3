#!/usr/bin/env bash
# ab.sh BUILD LOGDIR PART...: the same measurement with and without an environment switch, in
# one call on the GPU machine (an opt-in kernel variant against the default). AB_ENV holds the
# switch, e.g. AB_ENV="DFLASH_ATTN_BWD=mma4" or AB_ENV="DFLASH_RMSNORM_BWD=twopass".
# AB_SRC="FILE=REPLACEMENT ..." makes the B side a second build (under /tmp/ab-build) of this
# tree with each FILE replaced by REPLACEMENT (paths from the repo root; REPLACEMENT e.g. an
# untracked copy of a branch's file), so a kernel change is measured against main in one call
# without a switch in the code; AB_ENV then applies to the B side too (may be empty).
# AB_PATCH=FILE (a patch, e.g. docs/attic/*.patch) does the same with the patch applied to the
# copy (git apply; after AB_SRC's replacements, if any).
# AB_BUILD_B=DIR: the B side is that build directory as it is (e.g. binaries built off the GPU
# machine from a patched tree and sent along: DIR/dflash, DIR/tools/*, DIR/tests/*); the B build
# is skipped. The test part needs a CMake build (ctest) on both sides.
# AB_ENV_A: the A side's environment (default none), e.g. with AB_SRC and
# AB_ENV_A=DFLASH_PORTABLE=1 AB_ENV=DFLASH_PORTABLE=1 a portable-path kernel change against main's.
# Parts:
#   test   every GPU test (ctest -R ^test_gpu_) under AB_ENV
#   attn   tools/bench_dflash_attn with and without AB_ENV: times, and the hash of the default
#          forward's bits per configuration (equal hashes: bitwise the same forward)
#   attnx  tools/bench_dflash_attn AB_RUNS times per side (default 5), A and B alternately:
#          per configuration the medians over the runs, the change and in how many run pairs
#          B was faster (scripts/ab_attnx.py). The attention moves 2-5% from process to
#          process, more than most kernel changes: one run per side can mislead
#   fp8    tests/test_gpu_fp8 --bench on both sides (the FP8 GEMMs and their rounding)
#   train  scripts/bench-train.sh (1 GPU, no SpecForge) with and without AB_ENV: the median
#          and step-by-step times, and whether the losses are identical step by step;
#          AB_GPUS=N: also on N GPUs (bench-train's GPUS), compared the same way; FP8=1 in
#          the environment: also bench-train's --fp8 run, compared the same way
# Prints a short table last; logs in LOGDIR, and all of them in LOGDIR/00-logs.tgz (first in
# name order: a device call that brings back only some files brings back that one). Exit status:
# 1 when a part failed.
set -u
B=${1:?build dir}; LOG=${2:?log dir}; shift 2
AB_SRC=${AB_SRC:-}; AB_PATCH=${AB_PATCH:-}; AB_ENV_A=${AB_ENV_A:-}; AB_BUILD_B=${AB_BUILD_B:-}
if [ -z "$AB_SRC$AB_PATCH$AB_BUILD_B" ]; then AB_ENV=${AB_ENV:?AB_ENV, e.g. DFLASH_ATTN_BWD=mma4 (or AB_SRC, AB_PATCH)}; else AB_ENV=${AB_ENV:-}; fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$LOG"
status=0; rows=()
BB=$B # the B side's build
WHAT=$AB_ENV
if [ -n "$AB_BUILD_B" ]; then
  [ -d "$AB_BUILD_B" ] || { echo "ab.sh: AB_BUILD_B $AB_BUILD_B: no such directory"; exit 2; }
  BB=$AB_BUILD_B WHAT="build $AB_BUILD_B${AB_ENV:+ + $AB_ENV}"
elif [ -n "$AB_SRC$AB_PATCH" ]; then
  S2=/tmp/ab-src BB=/tmp/ab-build
  rm -rf "$S2" "$BB" && mkdir -p "$S2"
  (cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$S2") || exit 1
  for fr in $AB_SRC; do
    f=${fr%%=*} r=${fr#*=}
    [ -f "$ROOT/$f" ] && [ -f "$ROOT/$r" ] || { echo "ab.sh: AB_SRC $fr: want FILE=REPLACEMENT, both files"; exit 2; }
    cp "$ROOT/$r" "$S2/$f"
  done
  if [ -n "$AB_PATCH" ] && ! (cd "$S2" && git apply "$ROOT/$AB_PATCH"); then
    echo "ab.sh: AB_PATCH $AB_PATCH does not apply"; exit 2
  fi
  archs=$(sed -n 's/^DFLASH_CUDA_ARCHS:[A-Z]*=//p' "$B/CMakeCache.txt")
  if ! { cmake -S "$S2" -B "$BB" -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA_ARCHS="$archs" &&
         cmake --build "$BB" -j "$(nproc)"; } >"$LOG/ab-build.log" 2>&1; then
    echo "ab.sh: the B build failed (ab-build.log)"; exit 1
  fi
  WHAT="${AB_SRC}${AB_PATCH:+${AB_SRC:+ + }$AB_PATCH}${AB_ENV:+ + $AB_ENV}"
fi
for part in "$@"; do
  case $part in
  test)
    # through ctest (its arguments, its skip code 77)
    if env $AB_ENV ctest --test-dir "$BB" -R '^test_gpu_' --output-on-failure >"$LOG/test.log" 2>&1; then
      rows+=("GPU tests under $WHAT: $(grep -E 'tests passed' "$LOG/test.log")")
    else
      status=1
      rows+=("GPU tests under $WHAT: FAILED ($(grep -E 'tests passed|tests failed' "$LOG/test.log" | tail -1); test.log)")
    fi
    ;;
  attn)
    env $AB_ENV_A timeout 200 "$B/tools/bench_dflash_attn" >"$LOG/attn-a.log" 2>&1 || status=1
    env $AB_ENV timeout 200 "$BB/tools/bench_dflash_attn" >"$LOG/attn-b.log" 2>&1 || status=1
    for side in a b; do
      echo "-- bench_dflash_attn, $([ $side = a ] && echo default || echo "$WHAT")"
      grep -E "default (forward|backward) bits|visible pairs|bwd passes|^ +default " "$LOG/attn-$side.log" | cut -c1-170
    done
    for dir in forward backward; do
      same=$(diff <(grep "default $dir bits" "$LOG/attn-a.log") <(grep "default $dir bits" "$LOG/attn-b.log") >/dev/null && echo yes || echo no)
      rows+=("attention $dir bits equal with and without $WHAT: $same")
    done
    ;;
  attnx)
    n=${AB_RUNS:-5}
    for r in $(seq 1 "$n"); do
      env $AB_ENV_A timeout 200 "$B/tools/bench_dflash_attn" >"$LOG/attnx-a-$r.log" 2>&1 || status=1
      env $AB_ENV timeout 200 "$BB/tools/bench_dflash_attn" >"$LOG/attnx-b-$r.log" 2>&1 || status=1
    done
    echo "-- bench_dflash_attn, $n runs each, A = default, B = $WHAT"
    python3 "$ROOT/scripts/ab_attnx.py" "$LOG" "$n" || status=1
    rows+=("attention, $n interleaved runs per side, default vs $WHAT: see the table above")
    ;;
  fp8)
    env $AB_ENV_A timeout 120 "$B/tests/test_gpu_fp8" --bench >"$LOG/fp8-a.log" 2>&1 || status=1
    env $AB_ENV timeout 120 "$BB/tests/test_gpu_fp8" --bench >"$LOG/fp8-b.log" 2>&1 || status=1
    for side in a b; do
      echo "-- test_gpu_fp8 --bench, $([ $side = a ] && echo "default${AB_ENV_A:+ ($AB_ENV_A)}" || echo "$WHAT")"
      grep -E "^bench" "$LOG/fp8-$side.log" | cut -c1-250
    done
    rows+=("FP8 GEMMs, default vs $WHAT: see the tables above")
    ;;
  train)
    for side in a b; do
      if [ $side = a ]; then e=$AB_ENV_A b=$B; else e=$AB_ENV b=$BB; fi
      env $e DISK=0 RECOMPUTE=0 OVERLAP=0 PROFILE=0 GPUS=${AB_GPUS:-1} SPECFORGE_SRC=/nonexistent timeout 240 \
        "$ROOT/scripts/bench-train.sh" "$b" "$LOG/train-$side" >"$LOG/train-$side.log" 2>&1 || status=1
    done
    python3 - "$LOG" <<'PY' || status=1
import json, statistics, sys
log = sys.argv[1]
import glob, os
def rows(side, name):
    return [json.loads(l) for l in open(f"{log}/train-{side}/{name}") if '"loss"' in l]
for name in sorted(os.path.basename(f) for f in glob.glob(f"{log}/train-a/train-*gpu*.jsonl")):
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
    rows+=("27B-shape step, default vs $WHAT: see the table above")
    ;;
  *) echo "ab.sh: unknown part $part"; status=1 ;;
  esac
done
echo "== ab.sh ($WHAT${AB_ENV_A:+; A side: $AB_ENV_A})"
for r in "${rows[@]}"; do echo "$r"; done
(cd "$LOG" && tar czf 00-logs.tgz --exclude=00-logs.tgz . 2>/dev/null)
exit $status
