#!/usr/bin/env bash
# gpu-check.sh [LOG_DIR] - on the GPU machine: build for sm_90a + sm_80, run every test
# (the GPU ones included), check the GPU target forward against HF transformers run live on fresh
# random models, run the benchmarks (drafter attention vs flex_attention, storage, extraction vs
# HF), print a short table last. STAGES picks stages (default: all of them;
# the build always runs); ARCHS the CUDA architectures (default "90a;80").
# CTEST_J the ctest jobs (default 4). Full logs go to LOG_DIR (default out/gpu-check). From the repo root, with .device/ carried:
# the libraries the GPU machine lacks (liburing, cJSON; .device/env.sh is sourced when present),
# for the e2e stage qwen3-code-8m in .device/qwen3-code-8m (or E2E_MODEL=DIR), and for the
# baselines the PyTorch scripts in .device/bench (bench-train.sh, bench-extract.sh say more):
#   scripts/gpu-check.sh "$OUT"
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LOG=${1:-$ROOT/out/gpu-check}
mkdir -p "$LOG"
cd "$ROOT"
[ -f .device/env.sh ] && source .device/env.sh
B=$ROOT/build-gpu
status=0
row() { printf '%-28s %s\n' "$1" "$2"; }

{ nvidia-smi -L; nvcc --version | tail -1; uname -r; nproc; free -g | head -2; df -hT /tmp
  # the code measured: the commit and the files changed on top of it
  echo "code: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?') + $(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) changed files"
  git -C "$ROOT" status --porcelain 2>/dev/null | head -20; } >"$LOG/machine.log" 2>&1
t0=$(date +%s)
STAGES=${STAGES:-test live resume train trainbench e2e opbench attn storage extract}
has() { case " $STAGES " in *" $1 "*) return 0;; esac; return 1; }
if cmake -S . -B "$B" -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA_ARCHS="${ARCHS:-90a;80}" >"$LOG/cmake.log" 2>&1 &&
   cmake --build "$B" -j "$(nproc)" >"$LOG/build.log" 2>&1; then
  build="ok ($(($(date +%s) - t0)) s)"
else
  build="FAILED (see build.log)"; status=1
fi
tests="not run"; live="not run"
if [ $status = 0 ] && has test; then
  # test_gpu_drafter's reference: our PyTorch DFlash step in fp64 and naive bf16, made now
  python3 "$ROOT/scripts/dflash_reference.py" --config c --bf16 --out "$LOG/drafter_c.safetensors" \
    >"$LOG/drafter-ref.log" 2>&1 && export DFLASH_GPU_DRAFTER_REF="$LOG/drafter_c.safetensors"
  ctest --test-dir "$B" --output-on-failure -j "${CTEST_J:-4}" >"$LOG/ctest.log" 2>&1 || status=1
  "$B/tests/test_gpu_drafter" >"$LOG/gpu-drafter.log" 2>&1
  tests=$(grep -E "tests passed|tests failed" "$LOG/ctest.log" | tail -1)
  echo "ctest: $tests" >>"$LOG/summary.txt"
  gpu=$(grep -E "^gpu [0-9]+:" "$B"/Testing/Temporary/LastTest.log | head -2 | tr '\n' ' ')
  gpu_test=$(grep -E "test_gpu_probe .*(Passed|Failed|Skipped|\*\*\*)" "$LOG/ctest.log" | sed 's/.*test_gpu_probe *\.*//')
fi
if [ $status = 0 ] && has live; then
  # Fresh random HF models with the real head dims (128/256, GDN 128), made now by transformers.
  off=$(( $(date +%s) % 1000 + 1 ))
  if python3 "$ROOT/scripts/make_fixtures.py" --variant big --seed-offset $off --out "$LOG/live" \
       >"$LOG/live-fixtures.log" 2>&1 &&
     DFLASH_GPU_MODEL_DIRS="$LOG/live/qwen3-big:$LOG/live/qwen3_5-big" "$B/tests/test_gpu_model" \
       >"$LOG/live-test.log" 2>&1; then
    live="passed (seed offset $off)"
  else
    live="FAILED (live-fixtures.log, live-test.log)"; status=1
  fi
  rm -f "$LOG"/live/*/*.safetensors
fi
if [ $status = 0 ] && has attn; then
  # ours and torch.compile(flex_attention) on the same anchors, side by side
  # on both anchor layouts: 3docs (packed documents) and 1doc (SpecForge's: one document per row)
  { "$B/tools/bench_dflash_attn" --anchors-out "$LOG/attn-anchors.json" \
      --anchors-1doc-out "$LOG/attn-anchors-1doc.json" --json-out "$LOG/attn-ours.json" &&
    python3 "$ROOT/scripts/bench_flex_dflash.py" --anchors "$LOG/attn-anchors.json" --ours "$LOG/attn-ours.json" \
      --title 3docs &&
    python3 "$ROOT/scripts/bench_flex_dflash.py" --anchors "$LOG/attn-anchors-1doc.json" \
      --ours "$LOG/attn-ours.json" --ours-key layers_1doc --title 1doc; } \
    >"$LOG/bench-dflash-attn.log" 2>&1 || status=1
fi
if [ $status = 0 ] && has storage; then
  DFLASH_BUILD_DIR=$B REPEATS=${REPEATS:-3} "$ROOT/scripts/bench-storage.sh" /tmp/dflash-bench "${BENCH_MIB:-2048}" \
    >"$LOG/bench-storage.log" 2>&1 || status=1
fi
if [ $status = 0 ] && has opbench; then # the target ops alone: prefill attention, GDN
  { "$B/tests/test_gpu_attn_prefill" --bench; "$B/tests/test_gpu_gdn" --bench;
    "$B/tests/test_gpu_ops" --bench; "$B/tests/test_gpu_lmhead_ce" --bench;
    echo "LM head with 2 GiB chunks:"; DFLASH_CE_CHUNK_MIB=2048 "$B/tests/test_gpu_lmhead_ce" --bench | grep bench;
    echo "LM head with 512 MiB chunks:"; DFLASH_CE_CHUNK_MIB=512 "$B/tests/test_gpu_lmhead_ce" --bench | grep bench; } >"$LOG/opbench.log" 2>&1 || status=1
fi
train="not run"; train_resume="not run"
if [ $status = 0 ] && has train; then # the drafter trained on the GPU, on the bundled tiny cache
  TM=$ROOT/data/tiny-qwen3 W=/tmp/dflash-gpu-train
  rm -rf $W && mkdir -p $W
  TA="--cache $W/cache --target $TM --steps 200 --mask-token 1 --block-size 8 --max-tokens 512 --max-anchors 32 --lr 3e-3 --log-every 20 --ckpt-every 100 --heads 4 --kv-heads 2 --head-dim 64"
  if "$B/dflash" extract --device cpu --model $TM --data $TM/corpus.jsonl --out $W/cache --quiet >"$LOG/train.log" 2>&1 &&
     "$B/dflash" train $TA --out $W/gpu --device cuda >>"$LOG/train.log" 2>&1 &&
     "$B/dflash" train $TA --out $W/cpu --device cpu >>"$LOG/train.log" 2>&1; then
    train="GPU: $(grep -E '^step +200' "$LOG/train.log" | head -1 | sed 's/  */ /g') | CPU: $(grep -E '^step +200' "$LOG/train.log" | tail -1 | sed 's/  */ /g')"
    # one GPU, stopped at step 150 and resumed from the step-100 checkpoint: bit-identical?
    "$B/dflash" train $TA --out $W/gpuR --device cuda --stop-after 150 >>"$LOG/train.log" 2>&1
    "$B/dflash" train $TA --out $W/gpuR --device cuda >>"$LOG/train.log" 2>&1
    if cmp -s $W/gpu/export/model.safetensors $W/gpuR/export/model.safetensors; then
      train_resume="bit-identical export after stop at 150 + resume from 100"
    else
      train_resume="DIFFERS"; status=1
    fi
    # the optimizer after the backward (the default overlaps it with the next forward): the same bits
    "$B/dflash" train $TA --out $W/gpuO --device cuda --no-overlap-optimizer >>"$LOG/train.log" 2>&1
    if cmp -s $W/gpu/export/model.safetensors $W/gpuO/export/model.safetensors; then
      train_resume="$train_resume; --no-overlap-optimizer identical"
    else
      train_resume="$train_resume; --no-overlap-optimizer DIFFERS"; status=1
    fi
    # 3 layers: activations in the gradients of the layer below (the default) or apart, the same
    # bits; then the same on 2 GPUs below
    "$B/dflash" train $TA --layers 3 --out $W/gL3 --device cuda >>"$LOG/train.log" 2>&1
    "$B/dflash" train $TA --layers 3 --out $W/gL3n --device cuda --no-grad-alias >>"$LOG/train.log" 2>&1
    if cmp -s $W/gL3/export/model.safetensors $W/gL3n/export/model.safetensors; then
      train_resume="$train_resume; --no-grad-alias identical (3 layers)"
    else
      train_resume="$train_resume; --no-grad-alias DIFFERS"; status=1
    fi
    # two GPUs (NCCL, ZeRO-1): runs, and its resume is bit-identical too
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      "$B/dflash" train $TA --layers 3 --out $W/g2L3 --gpus 2 >>"$LOG/train.log" 2>&1
      "$B/dflash" train $TA --layers 3 --out $W/g2L3n --gpus 2 --no-grad-alias >>"$LOG/train.log" 2>&1
      cmp -s $W/g2L3/export/model.safetensors $W/g2L3n/export/model.safetensors ||
        { train_resume="$train_resume; 2 GPUs --no-grad-alias DIFFERS"; status=1; }
      "$B/dflash" train $TA --out $W/g2 --gpus 2 >>"$LOG/train.log" 2>&1 &&
      "$B/dflash" train $TA --out $W/g2R --gpus 2 --stop-after 150 >>"$LOG/train.log" 2>&1 &&
      "$B/dflash" train $TA --out $W/g2R --gpus 2 >>"$LOG/train.log" 2>&1
      if cmp -s $W/g2/export/model.safetensors $W/g2R/export/model.safetensors; then
        train_resume="$train_resume; 2 GPUs too ($(grep -E '^step +200' "$LOG/train.log" | tail -1 | sed 's/  */ /g'))"
      else
        train_resume="$train_resume; 2 GPUs: FAILED or DIFFERS"; status=1
      fi
      # both ranks on rank 0's rows: NCCL + ZeRO-1 must reproduce the 1-GPU weights exactly
      "$B/dflash" train $TA --out $W/g2O --gpus 2 --no-overlap-optimizer >>"$LOG/train.log" 2>&1
      cmp -s $W/g2/export/model.safetensors $W/g2O/export/model.safetensors ||
        { train_resume="$train_resume; 2 GPUs --no-overlap-optimizer DIFFERS"; status=1; }
      DFLASH_TEST_REPLICATE_DATA=1 "$B/dflash" train $TA --out $W/g2S --gpus 2 >>"$LOG/train.log" 2>&1
      if cmp -s $W/gpu/export/model.safetensors $W/g2S/export/model.safetensors; then
        train_resume="$train_resume; 2 GPUs on the same rows = 1 GPU bit for bit"
      else
        train_resume="$train_resume; 2 GPUs on the same rows DIFFER from 1 GPU"; status=1
      fi
    fi
  else
    train="FAILED (train.log)"; status=1
  fi
  # as soon as known: a call that hits its time limit later still has it
  printf 'drafter training (tiny): %s\ntrainer resume (GPU): %s\n' "$train" "$train_resume" >>"$LOG/summary.txt"
fi
trainbench="not run"
if [ $status = 0 ] && has trainbench; then # the Qwen3.6-27B drafter shape vs SpecForge, same run
  if "$ROOT/scripts/bench-train.sh" "$B" "$LOG/trainbench" >"$LOG/trainbench.log" 2>&1; then
    trainbench="$(grep -E "^ours, 1 GPU" "$LOG/trainbench.log" | sed 's/.*: //')"
  else
    trainbench="FAILED (trainbench.log)"; status=1
  fi
  printf '27B drafter shape: %s\n' "$trainbench" >>"$LOG/summary.txt"
fi
e2e="not run"
if [ $status = 0 ] && has e2e; then # qwen3-code-8m: extract -> train -> eval -> export, on the GPU
  if MODEL=${E2E_MODEL:-$ROOT/.device/qwen3-code-8m} "$ROOT/scripts/e2e-qwen3-code.sh" "$B" /tmp/dflash-e2e >"$LOG/e2e.log" 2>&1; then
    e2e="passed"
  else
    e2e="FAILED (e2e.log)"; status=1
  fi
  cp -r /tmp/dflash-e2e/logs "$LOG/e2e-logs" 2>/dev/null; cp /tmp/dflash-e2e/run/log.jsonl "$LOG/e2e-log.jsonl" 2>/dev/null
  cp /tmp/dflash-e2e/run/*.png /tmp/dflash-e2e/run/*.svg "$LOG/" 2>/dev/null
fi
resume="not run"
if [ $status = 0 ] && has resume; then
  if "$ROOT/scripts/gpu-resume-check.sh" "$B" /tmp/dflash-resume >"$LOG/resume.log" 2>&1; then
    resume="passed: $(grep -E "^killed" "$LOG/resume.log"); $(tail -1 "$LOG/resume.log")"
  else
    resume="FAILED (resume.log)"; status=1
  fi
fi
if has extract && [ -x "$B/dflash" ]; then
  "$ROOT/scripts/bench-extract.sh" "$B" "$LOG/extract" >"$LOG/bench-extract.log" 2>&1 || status=1
fi

echo
echo "== gpu-check ($(date -u +%FT%TZ))"
row "machine" "$(head -1 "$LOG/machine.log")"
row "code" "$(grep -m1 '^code: ' "$LOG/machine.log" | sed 's/^code: //')"
row "build (sm_90a + sm_80)" "$build"
row "ctest" "$tests"
row "test_gpu_probe" "${gpu_test:-?} ${gpu:-}"
row "GPU forward vs live HF" "$live"
[ -f "$LOG/gpu-drafter.log" ] && { echo "-- test_gpu_drafter (one training step vs fp64 / naive bf16)"; grep -E "^loss|gradients:|^metrics|^ok|FAIL" "$LOG/gpu-drafter.log" | head -8; }
row "kill -9 + resume (GPU)" "$resume"
row "drafter training (tiny)" "$train"
row "trainer resume (GPU)" "$train_resume"
row "27B drafter shape (1 GPU)" "$trainbench"
row "e2e qwen3-code-8m" "$e2e"
[ -f "$LOG/e2e.log" ] && { echo "-- e2e (tail)"; tail -25 "$LOG/e2e.log"; }
[ -f "$LOG/trainbench.log" ] && { echo "-- bench-train"; sed -n '/^== bench-train/,$p' "$LOG/trainbench.log"; }
grep -E "FAILED|out of tolerance|rel err .* ratio [2-9]" "$LOG/ctest.log" 2>/dev/null | head -8
if [ -f "$LOG/bench-dflash-attn.log" ]; then
  echo "-- bench_dflash_attn against flex_attention"
  grep -A8 "^ours against" "$LOG/bench-dflash-attn.log" | grep -v '^{' || tail -8 "$LOG/bench-dflash-attn.log"
fi
if [ -f "$LOG/opbench.log" ]; then
  echo "-- target op benchmarks (tail)"
  grep -vE "^\s*$" "$LOG/opbench.log" | tail -45
fi
if [ -f "$LOG/bench-extract.log" ]; then
  echo "-- bench-extract"
  grep -vE "^\s*$" "$LOG/extract/bench-extract.txt" 2>/dev/null || tail -5 "$LOG/bench-extract.log"
fi
if [ -f "$LOG/bench-storage.log" ]; then
  echo "-- bench-storage (tail)"
  tail -9 "$LOG/bench-storage.log"
fi
# every log in one file, first in name order (a device call that brings back only some files
# brings back that one); model weights left out
(cd "$LOG" && tar czf 00-logs.tgz --exclude=00-logs.tgz --exclude='*.safetensors' . 2>/dev/null)
exit $status
