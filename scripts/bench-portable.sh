#!/usr/bin/env bash
# bench-portable.sh BUILD LOGDIR - the non-Hopper path measured on a Hopper GPU: every figure
# twice in one call, with the per-device default (wgmma / TMA kernels on compute capability 9.0)
# and with DFLASH_PORTABLE=1 (the portable mma.sync kernels under the 99 KiB of shared memory of
# sm_86 / sm_89 / sm_120: what an RTX PRO 6000 Blackwell or an L40S chooses), next to the
# PyTorch baselines (flex_attention, SpecForge, HF) where their scripts are there.
# STAGES (default "test attn ops train extract"); FLEX: the attn stage's flex runs (default
# "default portable mma2 sm120f sm120b"); OPS: the ops stage's test binaries:
#   test    the GPU tests with DFLASH_PORTABLE=1 (the default's run in gpu-check.sh)
#   attn    tools/bench_mma_peak (mma.sync's ceiling on this GPU), tools/bench_dflash_attn,
#           default and portable, FlashAttention-2 on dense analogs (scripts/bench_sdpa_fa2.py)
#           and torch.compile(flex_attention)
#           on both anchor layouts (scripts/bench_flex_dflash.py), as compiled for the GPU and
#           with Triton's Hopper MMA off (DISABLE_MMA_V3=1: mma.sync, like the portable path);
#           then the table of them all (scripts/portable_table.py: LOGDIR/table.md)
#   ops     the target's prefill attention and GDN benchmarks, default and portable
#   train   scripts/bench-train.sh (27B drafter shape; SpecForge once), default and portable
#   extract scripts/bench-extract.sh (27B shape, 4096-token documents or XSHAPES; HF once unless
#           HF=0), both; with the device memory in use after the load and at the batch's peak
# Stages run in the order given; each one's wall time is printed; full logs in LOGDIR.
set -uo pipefail
B=${1:?build dir}; LOG=${2:?log dir}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STAGES=${STAGES:-test attn ops train extract}
mkdir -p "$LOG"
status=0
t() { echo "[$(date +%T)] $*" >>"$LOG/times.txt"; }
nvidia-smi -L >"$LOG/machine.log" 2>&1
st_test() {
  t test start
  DFLASH_PORTABLE=1 ctest --test-dir "$B" -R "test_gpu" --output-on-failure -j4 >"$LOG/ctest-portable.log" 2>&1 || status=1
  t test end "$(grep -E 'tests passed|tests failed' "$LOG/ctest-portable.log" | tail -1)"
}
st_attn() {
  t attn start
  "$B/tools/bench_mma_peak" >"$LOG/mma-peak.log" 2>&1 || status=1 # the portable path's ceiling
  "$B/tools/bench_dflash_attn" --anchors-out "$LOG/anchors.json" --anchors-1doc-out "$LOG/anchors-1doc.json" \
    --json-out "$LOG/attn-default.json" >"$LOG/attn-default.log" 2>&1 || status=1
  t attn default done
  DFLASH_PORTABLE=1 "$B/tools/bench_dflash_attn" --json-out "$LOG/attn-portable.json" >"$LOG/attn-portable.log" 2>&1 || status=1
  t attn portable done
  # flex as compiled for this GPU (Triton's wgmma on Hopper) against both; then with Triton's
  # Hopper MMA off (DISABLE_MMA_V3=1: mma.sync, as on the GPUs the portable path is for)
  # sm120f / sm120b: mma.sync with the tiles torch's own heuristics pick for compute capability
  # 12 at head dim 128 in BF16 (CUDAConfigHeuristic in torch's sources, a recent main: forward
  # 128 x 64, 8 warps, 2 stages; backward 64 x 64 both ways, 4 warps, 1 stage), which fit an
  # sm_120's 99 KiB; on the H100 Triton otherwise takes Hopper's tiles and up to 227 KiB. One
  # kernel_options dict sets both passes' warps and stages, so the forward's figure comes from
  # sm120f and the backward's from sm120b (portable_table.py)
  KO_sm120f='{"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}'
  KO_sm120b='{"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "num_warps": 4, "num_stages": 1}'
  for v in ${FLEX:-default portable mma2 sm120f sm120b}; do
    j=$v mma3=; ko=
    case $v in
      mma2) j=portable mma3=1 ;;
      sm120f) j=portable mma3=1 ko=$KO_sm120f ;;
      sm120b) j=portable mma3=1 ko=$KO_sm120b ;;
    esac
    env ${mma3:+DISABLE_MMA_V3=1} KO="$ko" bash -c "
      python3 '$ROOT/scripts/bench_flex_dflash.py' --anchors '$LOG/anchors.json' --ours '$LOG/attn-$j.json' --title '3docs $v' \
        \${KO:+--kernel-options \"\$KO\"} &&
      python3 '$ROOT/scripts/bench_flex_dflash.py' --anchors '$LOG/anchors-1doc.json' --ours '$LOG/attn-$j.json' \
        --ours-key layers_1doc --title '1doc $v' \${KO:+--kernel-options \"\$KO\"}" >"$LOG/flex-$v.log" 2>&1 || status=1
  done
  # FlashAttention-2 (PyTorch's, on mma.sync) on the layouts' dense analogs: 3 documents of ~1365
  # tokens per row as 12 x 1365 causal, one 4096-token document as 4 x 4096 causal
  python3 "$ROOT/scripts/bench_sdpa_fa2.py" --shapes 12x1365c,4x4096c >"$LOG/fa2.log" 2>&1 || status=1
  # issue 30's table: both layouts, the kernels against both flex builds and the goal, and the
  # portable backward against mma.sync's ceiling
  python3 "$ROOT/scripts/portable_table.py" "$LOG" >"$LOG/table.md" 2>&1 || status=1
  cat "$LOG/table.md"
  t attn end
}
st_ops() {
  t ops start
  OPS=${OPS:-test_gpu_attn_prefill test_gpu_gdn test_gpu_lmhead_ce}
  for v in default portable; do
    for o in $OPS; do
      env $([ $v = portable ] && echo DFLASH_PORTABLE=1) "$B/tests/$o" --bench || status=1
    done >"$LOG/ops-$v.log" 2>&1
  done
  t ops end
}
st_train() {
  t train start
  DISK=0 RECOMPUTE=0 OVERLAP=0 GPUS=1 "$ROOT/scripts/bench-train.sh" "$B" "$LOG/train-default" >"$LOG/train-default.log" 2>&1 || status=1
  t train default done
  DFLASH_PORTABLE=1 DISK=0 RECOMPUTE=0 OVERLAP=0 PROFILE=0 GPUS=1 BENCH_DIR=/nonexistent SPECFORGE_SRC=/nonexistent \
    "$ROOT/scripts/bench-train.sh" "$B" "$LOG/train-portable" >"$LOG/train-portable.log" 2>&1 || status=1
  t train end
}
st_extract() {
  t extract start
  SHAPES=${XSHAPES:-q35-4096} RUNS=1 TOKENS=${TOKENS:-65536} "$ROOT/scripts/bench-extract.sh" "$B" "$LOG/extract-default" \
    >"$LOG/extract-default.log" 2>&1 || status=1
  t extract default done
  DFLASH_PORTABLE=1 HF=0 SHAPES=${XSHAPES:-q35-4096} RUNS=1 TOKENS=${TOKENS:-65536} "$ROOT/scripts/bench-extract.sh" "$B" \
    "$LOG/extract-portable" >"$LOG/extract-portable.log" 2>&1 || status=1
  t extract end
}
for st in $STAGES; do "st_$st"; done
cat "$LOG/times.txt"
exit $status
