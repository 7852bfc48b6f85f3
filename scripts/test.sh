#!/usr/bin/env bash
# test.sh - installs what is missing, builds, runs every test.
#
#   1. the normal build (build/, CUDA parts too when nvcc is present) and its tests;
#   2. a clang AddressSanitizer + UBSan build (build-asan/) running the same tests
#      plus each libFuzzer target for DFLASH_FUZZ_SECONDS (default 10) seconds.
# GPU tests skip (exit 77) on machines without a GPU. Exit status: non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
JOBS=$(nproc)
# CUDA targets: DFLASH_CUDA_ARCHS when set; else this machine's GPUs (CMakeLists.txt); on a
# machine without a GPU (CI) one architecture, 90a, keeps the compile short (the portable
# kernels' sm_120 compile is a test of its own, cuda_compile_sm120).
ARCHS=${DFLASH_CUDA_ARCHS:-}
if [ -z "$ARCHS" ] && ! nvidia-smi -L >/dev/null 2>&1; then ARCHS=90a; fi

echo "== build (build/)"
cmake -S . -B build ${ARCHS:+-DDFLASH_CUDA_ARCHS="$ARCHS"} >/dev/null
cmake --build build -j "$JOBS"
echo "== tests (build/)"
ctest --test-dir build --output-on-failure -j "$JOBS"

if command -v clang >/dev/null 2>&1 && [ "${DFLASH_SKIP_ASAN:-0}" != 1 ]; then
  echo "== build (build-asan/: clang, ASan + UBSan, fuzz targets)"
  CC=clang cmake -S . -B build-asan -DDFLASH_CUDA=OFF -DDFLASH_SANITIZE=ON -DDFLASH_FUZZ=ON \
    -DDFLASH_FUZZ_SECONDS="${DFLASH_FUZZ_SECONDS:-10}" -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_C_FLAGS_DEBUG="-g -O1" >/dev/null # ASan's advice: -O1 keeps every check, runs several x faster
  cmake --build build-asan -j "$JOBS"
  echo "== tests (build-asan/)"
  ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan --output-on-failure -j "$JOBS"
else
  echo "== clang not found: sanitizer and fuzz tests skipped" >&2
fi
echo "== all tests passed"
