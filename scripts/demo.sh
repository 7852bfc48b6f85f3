#!/usr/bin/env bash
# demo.sh [OUT_DIR] - the main job end to end on the bundled tiny data.
#
# Installs what is missing, builds (or uses DFLASH_BUILD_DIR), then runs as much of
# extract -> train -> dump -> export as exists today, on the bundled tiny target
# (data/demo-target: a tiny Qwen3 trained on a code-like language by scripts/make_demo_target.py,
# and its own greedy completions of held-out prompts):
#   1. corpus import  its completions -> OUT/corpus.dtok (checked against the vocab)
#   2. extract        the target's forward over the corpus -> OUT/cache (on the GPU when one is
#                     visible, else the CPU; feature layers 0,1,2, split-zstd, io_uring writer), and
#                     over the held-out eval corpus -> OUT/eval-cache
#   3. resume         a cache writer is killed (SIGKILL) mid-run and rerun: the result equals an
#                     uninterrupted run (on synthetic states: the tiny extraction is too quick to kill)
#   4. dump           summary, sample listing, one sample's tokens and hidden-state slice
#   5. verify + read  every CRC and index entry; the streaming reader's rate
#   6. train          a 2-layer DFlash drafter on the cache (GPU when visible, else CPU): the log
#                     shows the loss falling and tau_hat rising, on the training rows and on the
#                     held-out eval cache; checkpoints; export/ for SGLang/vLLM; a plot of the log
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/out/demo}
cd "$ROOT"
if [ -n "${DFLASH_BUILD_DIR:-}" ]; then
  BUILD=$DFLASH_BUILD_DIR
else
  ./scripts/install-deps.sh
  BUILD=$ROOT/build
  # the CUDA targets: DFLASH_CUDA_ARCHS when set, else this machine's GPUs (CMakeLists.txt);
  # without a GPU the demo runs on the CPU, and one target (90a) keeps the compile short
  ARCHS=${DFLASH_CUDA_ARCHS:-}
  if [ -z "$ARCHS" ] && ! nvidia-smi -L >/dev/null 2>&1; then ARCHS=90a; fi
  cmake -S . -B "$BUILD" ${ARCHS:+-DDFLASH_CUDA_ARCHS="$ARCHS"} >/dev/null
  cmake --build "$BUILD" -j "$(nproc)" --target dflash >/dev/null
fi
D=$BUILD/dflash
[ -x "$D" ] || { echo "demo: no dflash binary at $D" >&2; exit 1; }
rm -rf "$OUT" && mkdir -p "$OUT"
step() { printf '\n== %s\n' "$*"; }

TM=data/demo-target
# A visible GPU runs extraction and training on it (the drafter then uses the CUDA attention's
# head size, 64); otherwise the CPU reference backend does everything.
if nvidia-smi -L >/dev/null 2>&1; then
  DEV=cuda; DRAFTER="--heads 4 --kv-heads 2 --head-dim 64"
else
  DEV=cpu; DRAFTER=""
fi
echo "device: $DEV"
step "1. import the tokenized corpus (vocab of the tiny target)"
"$D" corpus import --model "$TM" --out "$OUT/corpus.dtok" "$TM/corpus.jsonl"

step "2. extract: the target over the corpus, hidden states into the cache"
"$D" extract --device $DEV --model "$TM" --data "$OUT/corpus.dtok" --out "$OUT/cache" --layers 0,1,2
"$D" extract --device $DEV --model "$TM" --data "$TM/eval.jsonl" --out "$OUT/eval-cache" --layers 0,1,2 --quiet

step "3. crash and resume: kill -9 a writer mid-run, rerun it, compare with a clean run"
"$D" cache synth --out "$OUT/crash" --corpus data/tiny/corpus.jsonl --hidden 256 --target-layers 6 \
  --layers 3 --shard-mb 2 --threads 1 --codec split-lz4 >/dev/null 2>&1 &
pid=$!
# kill it once its first shard is finished, while later samples are in flight
for _ in $(seq 500); do ls "$OUT"/crash/*.dfc >/dev/null 2>&1 && break; sleep 0.01; done
kill -9 $pid 2>/dev/null || true; wait $pid 2>/dev/null || true
echo "killed writer; partial files:"; ls "$OUT/crash" | sed 's/^/  /'
"$D" cache synth --out "$OUT/crash" --corpus data/tiny/corpus.jsonl --hidden 256 --target-layers 6 \
  --layers 3 --shard-mb 2 --threads 1 --codec split-lz4
"$D" dump "$OUT/crash" --verify
"$D" cache synth --out "$OUT/clean" --corpus data/tiny/corpus.jsonl --hidden 256 --target-layers 6 \
  --layers 3 --shard-mb 2 --threads 1 --codec split-lz4 >/dev/null
if diff <("$D" dump "$OUT/crash" --samples --limit 0) <("$D" dump "$OUT/clean" --samples --limit 0) >/dev/null; then
  echo "resumed cache == uninterrupted cache: same samples at the same offsets with the same sizes"
else
  echo "demo: the resumed cache differs from an uninterrupted run" >&2; exit 1
fi

step "4. dump: summary, samples, one sample"
"$D" dump "$OUT/cache"
"$D" dump "$OUT/cache" --samples --limit 5
"$D" dump "$OUT/cache" --sample 2 --layer 1 --rows 0:3 --cols 0:6

step "5. verify every checksum, stream it back"
"$D" dump "$OUT/cache" --verify
"$D" cache read "$OUT/cache"

step "6. train a DFlash drafter on the cache ($DEV), evaluate it on the held-out cache, export it"
"$D" train --cache "$OUT/cache" --target "$TM" --out "$OUT/run" --device $DEV --mask-token 1 \
  --steps ${DEMO_STEPS:-400} --layers 2 --intermediate 256 --block-size 8 --max-tokens 1024 \
  --max-anchors 128 --lr 5e-3 --log-every 50 --ckpt-every 100 $DRAFTER \
  --eval-cache "$OUT/eval-cache" --eval-every 100 --eval-rows 8
echo "log: $OUT/run/log.jsonl; drafter: $OUT/run/export/{config.json,model.safetensors}"
if command -v python3 >/dev/null; then
  python3 scripts/plot_train_log.py "$OUT/run/log.jsonl" || echo "(plot skipped)"
fi

printf '\ndemo done: outputs in %s\n' "$OUT"
