#!/usr/bin/env bash
# gpu-profile.sh BUILD LOGDIR: measurements that are not benchmarks of ours against a baseline,
# but inputs for deciding what to build next. Needs a GPU; run after a build (gpu-check.sh).
#  - tools/bench_gemm_algos --sustained: each cuBLASLt candidate of the step's biggest GEMM
#    shapes back to back, with nvidia-smi dmon alongside (power, SM clock): does any candidate
#    sustain more at the 700 W limit than the first choice?
#  - ncu (hardware counters; --clock-control none keeps the clocks alone) on the attention
#    kernels of the default implementation (forward, dQ, context dK/dV), the first launch of each.
# Env: PARTS (default "gemm ncu"); KERNELS (default "fwd_wg_kernel dq_wg_kernel dkv_wg_kernel",
# regexes of the kernel names ncu profiles; e.g. with DFLASH_ATTN_BWD=mma4, "dkv4_kernel"; with
# DFLASH_PORTABLE=1, "dkv_mma2_kernel dq_dsd_kernel fwd_mma2_kernel"). SASS=1: each kernel's
# full-set report kept (LOGDIR/ncu-K.ncu-rep) with its per-instruction page (executed
# instructions, stall samples per SASS line: LOGDIR/ncu-K-sass.csv.gz) and its details page, to
# read without the GPU (scripts/ncu_sass.py summarizes the first). With DFLASH_PORTABLE=1 the
# context dK/dV pass is "dkvr_kernel".
set -u
B=${1:?build dir}; LOG=${2:?log dir}
PARTS=${PARTS:-gemm ncu}
KERNELS=${KERNELS:-fwd_wg_kernel dq_wg_kernel dkv_wg_kernel}
mkdir -p "$LOG"
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
status=0
if has gemm; then
  nvidia-smi dmon -s pc -d 1 >"$LOG/gemm-dmon.log" 2>&1 &
  dm=$!
  timeout 300 "$B/tools/bench_gemm_algos" --sustained >"$LOG/gemm-algos.log" 2>&1 || status=1
  kill $dm 2>/dev/null
  grep -E "sustained|first choice" "$LOG/gemm-algos.log" | tail -80
fi
if has ncu; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -n "$NCU" ]; then
    : >"$LOG/ncu-attn.log"
    # the first launch of each (the bench's first configuration: 3 documents, full layer)
    for k in $KERNELS; do
      timeout 120 "$NCU" --clock-control none -k "regex:$k" -c 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section LaunchStats \
        "$B/tools/bench_dflash_attn" 1 >>"$LOG/ncu-attn.log" 2>&1 || status=1
      if [ "${SASS:-0}" = 1 ]; then
        timeout 150 "$NCU" --clock-control none -k "regex:$k" -c 1 --set full --import-source no \
          -o "$LOG/ncu-$k" "$B/tools/bench_dflash_attn" 1 >"$LOG/ncu-$k.log" 2>&1 || status=1
        "$NCU" --import "$LOG/ncu-$k.ncu-rep" --page source --print-source sass --csv 2>&1 |
          gzip >"$LOG/ncu-$k-sass.csv.gz"
        "$NCU" --import "$LOG/ncu-$k.ncu-rep" --page details >"$LOG/ncu-$k-details.txt" 2>&1
      fi
    done
    grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput   |Achieved Occupancy|Eligible Warps|Issued Warp|No Eligible|Registers Per|L2 Cache Throughput|DRAM Throughput|Executed Ipc A|Stall" "$LOG/ncu-attn.log" | head -80
  else
    echo "ncu: not found"
  fi
fi
exit $status
