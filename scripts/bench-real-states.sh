#!/usr/bin/env bash
# bench-real-states.sh MODEL_DIR [CORPUS] [OUT_DIR] - the codecs on REAL hidden states:
# `dflash extract` runs the target over the corpus once per codec (CPU backend), then reports
# per codec and layer the stored/raw ratio and bytes per token (dump --json), and the
# one-thread streaming read rate of decoded states (`dflash cache read --threads 1`,
# which includes CRC checks and I/O). Then `bench_codec --cache` on the stored cache: every
# codec on the same states, with the lossy codecs' errors (relative RMS, worst element error
# relative to its row's and its 32-element block's absmax) and one-thread encode/decode GB/s.
# MODEL_DIR (or the MODEL variable): a target's HF folder, e.g. qwen3-code-8m (not part of this
# repository; its eval corpus, 300 completions and 103,416 tokens, gave docs/FORMAT-codecs.md's
# figures). CORPUS defaults to MODEL_DIR/corpus/eval.jsonl.xz. Feature layers 1,2,3,4 (LAYERS);
# CODECS="stored lz4 ..." picks codecs (keep stored for the bench_codec part).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODEL=${1:-${MODEL:-}}
[ -n "$MODEL" ] || { echo "usage: $0 MODEL_DIR [CORPUS] [OUT_DIR] (or MODEL=DIR): the target's HF folder" >&2; exit 2; }
[ -f "$MODEL/config.json" ] || { echo "bench-real-states: $MODEL/config.json not found (MODEL_DIR / MODEL: a target's HF folder)" >&2; exit 2; }
CORPUS=${2:-$MODEL/corpus/eval.jsonl.xz}
[ -f "$CORPUS" ] || { echo "bench-real-states: corpus $CORPUS not found (give CORPUS)" >&2; exit 2; }
OUT=${3:-$ROOT/out/bench-real-states}
LAYERS=${LAYERS:-1,2,3,4}
D=${DFLASH_BUILD_DIR:-$ROOT/build}/dflash
B=${DFLASH_BUILD_DIR:-$ROOT/build}/tools/bench_codec
CODECS=${CODECS:-stored lz4 split-lz4 split-zstd fp8-e4m3 fp8-b32 int4-b32 int5-b32 int6-b32 int3-b32 int2-b32}
[ -x "$D" ] && [ -x "$B" ] || { echo "build first: cmake --build build" >&2; exit 2; }
rm -rf "$OUT" && mkdir -p "$OUT"
case "$CORPUS" in
  *.xz) xz -dc "$CORPUS" >"$OUT/corpus.jsonl"; CORPUS=$OUT/corpus.jsonl ;;
esac
"$D" corpus import --model "$MODEL" --out "$OUT/corpus.dtok" "$CORPUS" --quiet
printf '%-11s %8s %9s' codec "B/token" "read GB/s"
IFS=, read -ra LS <<<"$LAYERS"
for l in "${LS[@]}"; do printf ' %8s' "layer$l"; done
printf '   extract tok/s\n'
for codec in $CODECS; do
  c=$OUT/cache-$codec
  line=$("$D" extract --model "$MODEL" --data "$OUT/corpus.dtok" --out "$c" --layers "$LAYERS" \
          --codec $codec --quiet)
  tps=$(sed -n 's/.*; \([0-9]*\) tok\/s after setup.*/\1/p' <<<"$line")
  js=$("$D" dump "$c" --json)
  rd=$("$D" cache read "$c" --threads 1 --json)
  python3 - "$codec" "$tps" "$js" "$rd" <<'PY'
import json, sys
codec, tps, js, rd = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
bpt = js["bytes_per_token"]["stored"]
print(f"{codec:<11} {bpt:8.1f} {rd['raw_GBps']:9.3f}", end="")
for l in js["layers"]:
    print(f" {l['ratio']:8.4f}", end="")
print(f"   {tps}")
PY
done
echo "raw bf16: $(( $(sed -n 's/.*"hidden_size":[[:space:]]*\([0-9]*\).*/\1/p' <<<"$js" | head -1) * 2 * ${#LS[@]} )) B/token over ${#LS[@]} layers; machine: $(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo), $(nproc) cores"
if [ -d "$OUT/cache-stored" ]; then
  echo
  "$B" --cache "$OUT/cache-stored" --threads 1 --repeats 5 --codecs "$(tr ' ' , <<<"$CODECS")"
fi
