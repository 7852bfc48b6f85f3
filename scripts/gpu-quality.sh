#!/usr/bin/env bash
# gpu-quality.sh OUT [VARIANTS...] - on the GPU machine: build (sm_90a; or PREBUILT=DIR, a folder
# holding a dflash binary built elsewhere, skips the build), then scripts/cache-quality.sh with the
# environment given (SEEDS, STEPS, PAR, REAL_TAU, ...); logs and the table into OUT.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUTD=${1:?usage: gpu-quality.sh OUT}
mkdir -p "$OUTD"
cd "$ROOT"
[ -f .device/env.sh ] && source .device/env.sh
B=$ROOT/build-gpu
t0=$(date +%s)
{ nvidia-smi -L; echo "code: $(git rev-parse --short HEAD 2>/dev/null) + $(git status --porcelain 2>/dev/null | wc -l) changed files"; } >"$OUTD/machine.log" 2>&1
if [ -n "${PREBUILT:-}" ]; then
  B=$(cd "$PREBUILT" && pwd) || exit 1
  echo "prebuilt: $B/dflash"
else
  cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA_ARCHS="${ARCHS:-90a}" >"$OUTD/cmake.log" 2>&1 &&
    cmake --build "$B" -j "$(nproc)" >"$OUTD/build.log" 2>&1 || { tail -30 "$OUTD/build.log"; exit 1; }
  echo "build: $(($(date +%s) - t0)) s"
fi
"$ROOT/scripts/cache-quality.sh" "$B" /tmp/dflash-quality "$OUTD"
