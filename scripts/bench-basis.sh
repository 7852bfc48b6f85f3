#!/usr/bin/env bash
# bench-basis.sh [BUILD] - the projection basis' heavy parts on the GPU against the CPU
# (tools/bench_basis.c says what each figure is): for D = 768, 5120 and 25600 (3 x 256, 5 x 1024,
# 5 x 5120: the Qwen3.6-27B features), the second moment's rate in tokens/s (GPU BF16 and F64
# paths; the CPU on all cores, timed on a small sample and extrapolated: labelled), the GPU
# eigensolve for R = 10/20/30% of D (2560/5120/7680 at D = 25600) and the energy rule, LAPACK's
# dsyevr where it is cheap (extrapolated as D^3 beyond: labelled), and the CPU projection rate
# (the step `dflash cache project` keeps on the CPU). Each part prints as it finishes, then a
# table with the machine. Built (cmake --build BUILD, CUDA on) beforehand; BUILD defaults to
# $DFLASH_BUILD_DIR or ./build. Expect ~2-4 minutes on one H200 with 16 cores; tools/bench_basis
# skips the eigensolves still to come after BUDGET seconds (default 400) and the whole run is
# cut at 470 s. Env: DIMS (default 768,5120,25600), THREADS (default: all CPUs), BUDGET.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=${1:-${DFLASH_BUILD_DIR:-$ROOT/build}}
X=$B/tools/bench_basis
[ -x "$X" ] || { echo "bench-basis.sh: no $X: build first (cmake --build $B)" >&2; exit 2; }
echo "== machine: $(hostname); $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1 || echo 'no nvidia-smi');" \
  "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //') x $(nproc); $(free -g | awk '/Mem:/ { print $2 " GB RAM" }')"
echo "== code: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?') + $(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) changed files; build $B"
t0=$(date +%s)
timeout 470 "$X" --dims "${DIMS:-768,5120,25600}" --threads "${THREADS:-0}" --budget "${BUDGET:-400}"
rc=$?
[ $rc = 124 ] && echo "bench-basis.sh: cut at 470 s (the table above is partial)"
echo "== bench-basis.sh: $(($(date +%s) - t0)) s, exit $rc"
exit $rc
