#!/usr/bin/env bash
# test_cli.sh DFLASH WORKDIR SRCDIR [SERVE_KEYS] - the dflash binary end to end, as a user
# runs it: corpus import -> cache (synthetic states) -> dump/verify/read, then
# corrupted files and bad usage giving clear errors and the documented exit
# codes (0 ok, 1 data error, 2 usage).
set -u
D=$1 W=$2 SRC=$3 SK=${4:-}
rm -rf "$W" && mkdir -p "$W"
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }

# run CODE PATTERN cmd...: exit code must be CODE, stdout+stderr must match PATTERN
# (DFLASH_TEST_TIMES=FILE: each command's seconds appended to FILE, to see where the time goes)
run() {
  local want=$1 pat=$2 t0=$EPOCHREALTIME; shift 2
  "$@" >"$W/out" 2>&1
  local got=$?
  [ -z "${DFLASH_TEST_TIMES:-}" ] || echo "$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }') $*" >>"$DFLASH_TEST_TIMES"
  [ "$got" = "$want" ] || { fail "exit $got (want $want): $*"; sed 's/^/    /' "$W/out" | head -20 >&2; return; }
  [ -z "$pat" ] || grep -Eq -- "$pat" "$W/out" || { fail "output of '$*' lacks /$pat/"; sed 's/^/    /' "$W/out" | head -20 >&2; }
}

# flip FILE OFFSET: xor one byte
flip() {
  local b; b=$(od -An -tu1 -j"$2" -N1 "$1" | tr -d ' ')
  printf "$(printf '\\%03o' $((b ^ 0x20)))" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}

# TEST_CLI_PART: a (corpus, caches, extraction, training), b (projected caches, --init-from,
# cache plan, data parallel, env, usage; it first makes the cache, eval cache and 60-step run it
# builds on), or all (the default). ctest runs a and b as two tests, side by side.
PART=${TEST_CLI_PART:-all}
case $PART in a | b | all) ;; *) echo "test_cli: TEST_CLI_PART=$PART: a, b or all" >&2; exit 2 ;; esac

# shared by both parts: the tiny target, the training arguments, log filters
TM=$SRC/data/tiny-qwen3
cols() { "$D" dump "$1" --samples --limit 0 | awk 'NR > 2 { print $1, $2, $3, $7 }'; }
TA="--cache $W/ext3 --target $TM --steps 60 --mask-token 1 --block-size 8 --max-tokens 512 --max-anchors 32 --lr 3e-3 --log-every 5 --ckpt-every 20 --quiet --device cpu"
TA3="${TA/--steps 60/--steps 12} --layers 3 --eval-cache $W/ext3 --eval-every 6 --eval-rows 2"
TA3=${TA3/--ckpt-every 20/--ckpt-every 4}
nolat() { grep -v '^{"step":[0-9]*,"run":{' "$1" | sed -E 's/"tokens_per_s":[0-9.e+-]+,"step_s":[0-9.e+-]+,"data_wait":[0-9.e+-]+,"data_wait_max":[0-9.e+-]+,"feed_build_s":[0-9.e+-]+,"feed_read_s":[0-9.e+-]+,"tflops":[0-9.e+-]+,"mfu":[0-9.e+-]+,"mem_gib":[0-9.e+-]+,//; s/"eta_s":[0-9.e+-]+,//'; }
evl() { grep -o '"eval_[a-z_0-9]*": *[-0-9.e+]*' "$1/log.jsonl"; }
bstep() { sed -nE 's/.*"step":[[:space:]]*([0-9]+).*/\1/p' "$1/best/best.json"; }

if [ "$PART" != b ]; then
# --- corpus
run 0 "48 docs|docs +48" "$D" corpus import --vocab 4096 --out "$W/tiny.dtok" "$SRC/data/tiny/corpus.jsonl"
run 0 "" "$D" corpus info "$W/tiny.dtok"
run 1 "corpus.jsonl:[0-9]+:[0-9]+: .*vocab" "$D" corpus import --vocab 100 --out "$W/bad.dtok" "$SRC/data/tiny/corpus.jsonl"
[ ! -e "$W/bad.dtok" ] || fail "a failed import left $W/bad.dtok"
printf '{"input_ids":[1,2,3],"loss_mask":[1,1]}\n' >"$W/mismatch.jsonl"
run 1 "mismatch.jsonl" "$D" corpus import --out "$W/m.dtok" "$W/mismatch.jsonl"

# --- a cache of the corpus' tokens with synthetic hidden states, several shards
run 0 "wrote" "$D" cache synth --out "$W/cache" --corpus "$W/tiny.dtok" --hidden 64 \
  --target-layers 6 --layers 3 --rows-per-block 32 --shard-mb 1 --threads 2
run 0 "split-zstd" "$D" dump "$W/cache"
run 0 "\"samples\":[[:space:]]*48" "$D" dump "$W/cache" --json
if command -v python3 >/dev/null; then
  "$D" dump "$W/cache" --json | python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["samples"]==48, d' \
    || fail "dump --json is not valid JSON with 48 samples"
fi
run 0 "shard-r0000-" "$D" dump "$W/cache" --samples --limit 5
run 0 "mean" "$D" dump "$W/cache" --sample 3 --layer 2
run 2 "layers|available" "$D" dump "$W/cache" --sample 3 --layer 4
run 1 "not in|no sample|range" "$D" dump "$W/cache" --sample 4000
run 0 "OK: 48 samples" "$D" dump "$W/cache" --verify
run 0 "read .*48 samples" "$D" cache read "$W/cache" --threads 2
run 0 "read .*48 samples.*threads" "$D" cache read "$W/cache" --fallback-io --shuffle 7
run 1 "already complete" "$D" cache synth --out "$W/cache" --corpus "$W/tiny.dtok" --hidden 64 \
  --target-layers 6 --layers 3

# --- the lossy codecs: same samples, checksums hold, states within tolerance of the lossless cache
for c in fp8-e4m3 fp8-b32 int6-b32 int5-b32 int4-b32 int3-b32 int2-b32; do
  run 0 "wrote" "$D" cache synth --out "$W/lossy-$c" --corpus "$W/tiny.dtok" --hidden 64 \
    --target-layers 6 --layers 3 --rows-per-block 32 --shard-mb 1 --threads 2 --codec $c
  run 0 "$c.*LOSSY" "$D" dump "$W/lossy-$c"
  run 0 "OK: 48 samples" "$D" dump "$W/lossy-$c" --verify
  run 0 "" "$D" cache diff "$W/cache" "$W/lossy-$c" --tol 0.06
  run 1 "" "$D" cache diff "$W/cache" "$W/lossy-$c"
done

# --- corrupted caches: clear errors naming file and sample, exit 1
cp -r "$W/cache" "$W/flip"
flip "$W/flip/shard-r0000-00000.dfc" 70000
run 1 "shard-r0000-00000.dfc.*sample [0-9]+|sample [0-9]+.*CRC" "$D" dump "$W/flip" --verify
cp -r "$W/cache" "$W/trunc"
truncate -s -4096 "$W/trunc/shard-r0000-00001.dfc"
run 1 "shard-r0000-00001.dfc" "$D" dump "$W/trunc"
cp -r "$W/cache" "$W/ver"
sed -i 's/"version":\t1,/"version":\t7,/' "$W/ver/manifest.json"
run 1 "version 7" "$D" dump "$W/ver"
cp -r "$W/cache" "$W/noman"
rm "$W/noman/manifest.json"
run 1 "unfinished" "$D" dump "$W/noman"
run 1 "not a dflash cache" "$D" dump "$W"

# --- extract: the bundled tiny target over its own completions
run 0 "extracted .*96 docs.*layers 2," "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/ext" --quiet
run 0 "OK: 96 samples" "$D" dump "$W/ext" --verify
run 0 "qwen3 'tiny-qwen3'" "$D" dump "$W/ext"
run 1 "already complete" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/ext" --quiet
# two ranks write one cache with the same samples
run 0 "48 docs" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/ext2" --world-size 2 --rank 1 --quiet
run 1 "unfinished" "$D" dump "$W/ext2"
run 0 "48 docs" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/ext2" --world-size 2 --rank 0 --quiet
run 0 "OK: 96 samples" "$D" dump "$W/ext2" --verify
[ "$(cols "$W/ext")" = "$(cols "$W/ext2")" ] || fail "2-rank extraction differs from 1-rank"
# the same two ranks as a launcher (torchrun) would start them: rank and world from the environment
run 0 "48 docs" env RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/ext4" --quiet
run 0 "48 docs" env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/ext4" --quiet
[ "$(cols "$W/ext")" = "$(cols "$W/ext4")" ] || fail "launcher-ranked extraction differs from 1-rank"
run 0 "features +3 layers: 0 1 2" bash -c "'$D' extract --device cpu --model '$TM' --data '$TM/corpus.jsonl' --out '$W/ext3' --layers 0,1,2 --codec split-lz4 --quiet && '$D' dump '$W/ext3'"
# bad input: ids >= vocab, an over-long document, no model, too many layers, bad usage
run 1 "vocab" "$D" extract --model "$TM" --data "$SRC/data/tiny/corpus.jsonl" --out "$W/bad1" --quiet
run 1 "longer|max" "$D" extract --model "$TM" --data "$TM/corpus.jsonl" --out "$W/bad2" --max-len 20 --quiet
run 1 "config.json" "$D" extract --model "$W" --data "$TM/corpus.jsonl" --out "$W/bad3" --quiet
run 1 "explicitly" "$D" extract --model "$TM" --data "$TM/corpus.jsonl" --out "$W/bad4" --layers 3 --quiet
run 1 "out of range" "$D" extract --model "$TM" --data "$TM/corpus.jsonl" --out "$W/bad5" --layers 3, --quiet
run 2 "want auto, cpu or cuda" "$D" extract --model "$TM" --data "$TM/corpus.jsonl" --out "$W/bad6" --device tpu
run 2 "required" "$D" extract --model "$TM"

# --- train: the drafter on the bundled cache; the loss falls; exact resume; export
run 0 "" "$D" train $TA --out "$W/runA"
first=$(grep -m1 '"loss"' "$W/runA/log.jsonl" | sed -E 's/.*"loss":([0-9.]+).*/\1/')
last=$(tail -1 "$W/runA/log.jsonl" | sed -E 's/.*"loss":([0-9.]+).*/\1/')
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.3) }' || fail "loss did not fall: $first -> $last"
run 0 "" "$D" train $TA --out "$W/runB" --stop-after 30   # stops as if killed after step 30
run 0 "" "$D" train $TA --out "$W/runB"                    # resumes from the step-20 checkpoint
# the run lines (one per start and resume: time, host, pid) differ by design; the rest is the same
[ "$(nolat "$W/runA/log.jsonl")" = "$(nolat "$W/runB/log.jsonl")" ] || fail "resumed run's log differs"
[ "$(grep -c '^{"step":0,"run":{"event":"start",' "$W/runB/log.jsonl")" = 1 ] &&
  [ "$(grep -c '^{"step":20,"run":{"event":"resume",.*"settings":{"--steps":60,' "$W/runB/log.jsonl")" = 1 ] ||
  fail "the resumed run's log lacks its start line at step 0 or its resume line at step 20"
cmp -s "$W/runA/export/model.safetensors" "$W/runB/export/model.safetensors" || fail "resumed run's weights differ"
[ -f "$W/runA/export/config.json" ] && grep -q DFlashDraftModel "$W/runA/export/config.json" || fail "no export"
# the export's config.json carries every key the SGLang and vLLM DFlash loaders read
[ -z "$SK" ] || "$SK" "$W/runA/export" || fail "the export's config.json lacks a serving key (test_serve_keys)"
# --no-recompute (every activation kept; the default recomputes the cheap ones): the same
# weights, bit for bit
run 0 "" "$D" train $TA --out "$W/runRc" --no-recompute
cmp -s "$W/runA/export/model.safetensors" "$W/runRc/export/model.safetensors" || fail "--no-recompute changed the weights"
# --no-overlap-optimizer (AdamW after the backward; the default runs it per bucket on a side
# stream, with per-bucket zeroing, the forward waiting per part): the same weights, bit for bit,
# and an exact resume of each
run 0 "" "$D" train $TA --out "$W/runOv" --no-overlap-optimizer
cmp -s "$W/runA/export/model.safetensors" "$W/runOv/export/model.safetensors" || fail "--no-overlap-optimizer changed the weights"
run 0 "" "$D" train $TA --out "$W/runOvR" --no-overlap-optimizer --stop-after 30
run 0 "" "$D" train $TA --out "$W/runOvR" --no-overlap-optimizer
cmp -s "$W/runA/export/model.safetensors" "$W/runOvR/export/model.safetensors" || fail "--no-overlap-optimizer resume differs"
# --no-grad-alias (activations kept out of the gradient array; by default layers 1..L-1 keep
# theirs in the gradients of the layer below): 3 layers, the same weights and evaluation, bit for
# bit, at each recompute level, with and without the overlapped optimizer, and across a resume
DFLASH_LOG=info run 0 "MiB more in the gradient array" "$D" train $TA3 --out "$W/runL3"
grep -q " 0.000 MiB more in the gradient array" "$W/out" && fail "no activations went into the gradients"
run 0 "" "$D" train $TA3 --out "$W/runL3n" --no-grad-alias --no-overlap-optimizer
cmp -s "$W/runL3/export/model.safetensors" "$W/runL3n/export/model.safetensors" || fail "--no-grad-alias changed the weights"
[ -n "$(evl "$W/runL3")" ] && [ "$(evl "$W/runL3")" = "$(evl "$W/runL3n")" ] || fail "--no-grad-alias changed the evaluation"
run 0 "" "$D" train $TA3 --out "$W/runL3r" --stop-after 10
run 0 "" "$D" train $TA3 --out "$W/runL3r"
cmp -s "$W/runL3/export/model.safetensors" "$W/runL3r/export/model.safetensors" || fail "resume with aliased gradients differs"
# two rows per step accumulate gradients over rows: nothing may live in them then
DFLASH_LOG=info run 0 " 0.000 MiB more in the gradient array" "$D" train ${TA3/--steps 12/--steps 4} --out "$W/runL3rows" --rows-per-step 2
for lv in --no-recompute --recompute-mlp --no-overlap-optimizer; do
  run 0 "" "$D" train $TA3 --out "$W/runL3$lv" $lv
  cmp -s "$W/runL3/export/model.safetensors" "$W/runL3$lv/export/model.safetensors" || fail "$lv with aliased gradients changed the weights"
done
run 0 "" "$D" train $TA --out "$W/runRm" --recompute-mlp
cmp -s "$W/runA/export/model.safetensors" "$W/runRm/export/model.safetensors" || fail "--recompute-mlp changed the weights"
# --fp8 (the GEMMs' operands rounded to E4M3): other weights than without, an exact resume, and
# a run started without it refuses to resume with it, naming the setting
TF="${TA/--steps 60/--steps 12}"; TF=${TF/--ckpt-every 20/--ckpt-every 4}
run 0 "" "$D" train $TF --out "$W/runF" --fp8
run 0 "" "$D" train $TF --out "$W/runFr" --fp8 --stop-after 6
run 0 "" "$D" train $TF --out "$W/runFr" --fp8
cmp -s "$W/runF/export/model.safetensors" "$W/runFr/export/model.safetensors" || fail "--fp8 resume differs"
# (the default, --fp8 auto, is off on the CPU: said, recorded, and the weights --no-fp8's)
run 0 "--fp8 auto: off \(no verified FP8 tensor cores here" "$D" train ${TF/--quiet/} --out "$W/runF0"
grep -q '"--fp8":.false' "$W"/runF0/ckpt-*/hparams.json || fail "--fp8 auto's choice not recorded"
cmp -s "$W/runF/export/model.safetensors" "$W/runF0/export/model.safetensors" && fail "--fp8 changed nothing"
run 0 "" "$D" train $TF --out "$W/runF0n" --no-fp8
cmp -s "$W/runF0/export/model.safetensors" "$W/runF0n/export/model.safetensors" || fail "--fp8 auto on the CPU differs from --no-fp8"
run 1 "--fp8 false \(now true\)" "$D" train $TF --out "$W/runF0" --fp8
# FP8's weight gradients take dy per 128 x 128 by default: --no-fp8-dy-blocks (128 x 1) trains
# other weights, is recorded, and a run resumes only with the same choice
run 0 "" "$D" train $TF --out "$W/runFd" --fp8 --no-fp8-dy-blocks
grep -q '"--fp8-dy-blocks":.false' "$W"/runFd/ckpt-*/hparams.json || fail "--no-fp8-dy-blocks not recorded"
cmp -s "$W/runF/export/model.safetensors" "$W/runFd/export/model.safetensors" && fail "--no-fp8-dy-blocks changed nothing"
run 0 "" "$D" train $TF --out "$W/runFdb" --fp8-dy-blocks
cmp -s "$W/runF/export/model.safetensors" "$W/runFdb/export/model.safetensors" || fail "--fp8-dy-blocks is not --fp8's default"
run 1 "--fp8-dy-blocks false \(now true\)" "$D" train $TF --out "$W/runFd" --fp8
run 2 "ask for opposite things" "$D" train $TF --out "$W/runFx" --fp8-dy-blocks --no-fp8-dy-blocks
# --fp8-ce-onepass (the LM head's softmax gradient in one pass): --fp8 with it, other weights,
# recorded, an exact resume, the switch refused on resume; with --no-fp8-ce-onepass refused
run 0 "" "$D" train $TF --out "$W/runFo" --fp8-ce-onepass
grep -q '"--fp8-ce-onepass":.true' "$W"/runFo/ckpt-*/hparams.json || fail "--fp8-ce-onepass not recorded"
grep -q '"--fp8-ce-onepass":.false' "$W"/runF/ckpt-*/hparams.json || fail "--fp8 recorded one pass"
cmp -s "$W/runF/export/model.safetensors" "$W/runFo/export/model.safetensors" && fail "--fp8-ce-onepass changed nothing"
run 0 "" "$D" train $TF --out "$W/runFor" --fp8-ce-onepass --stop-after 6
run 0 "" "$D" train $TF --out "$W/runFor" --fp8 --fp8-ce-onepass
cmp -s "$W/runFo/export/model.safetensors" "$W/runFor/export/model.safetensors" || fail "--fp8-ce-onepass resume differs"
run 1 "--fp8-ce-onepass true \(now false\)" "$D" train $TF --out "$W/runFo" --fp8
run 2 "ask for opposite things" "$D" train $TF --out "$W/runFx" --fp8-ce-onepass --no-fp8-ce-onepass
# --adam-bf16 (AdamW's moments in BF16, stochastically rounded): other weights, recorded, an
# exact resume (the checkpoint holds the moments widened to F32), and no switching on resume
run 0 "fp32 master \+ bf16 moments" "$D" train ${TF/--quiet/} --out "$W/runAb" --adam-bf16
grep -q '"--adam-bf16":.true' "$W"/runAb/ckpt-*/hparams.json || fail "--adam-bf16 not recorded"
cmp -s "$W/runF0/export/model.safetensors" "$W/runAb/export/model.safetensors" && fail "--adam-bf16 changed nothing"
run 0 "" "$D" train $TF --out "$W/runAbr" --adam-bf16 --stop-after 6
run 0 "" "$D" train $TF --out "$W/runAbr" --adam-bf16
cmp -s "$W/runAb/export/model.safetensors" "$W/runAbr/export/model.safetensors" || fail "--adam-bf16 resume differs"
run 1 "--adam-bf16 true \(now false\)" "$D" train $TF --out "$W/runAb"
# m alone in BF16 (v F32) is the default: said, recorded, the same as --adam-m-bf16, an exact
# resume; --no-adam-m-bf16 (F32 moments) trains other weights, is recorded and is not switched
# on resume; --adam-bf16 with it is refused
run 0 "fp32 master \+ bf16 m / fp32 v moments" "$D" train ${TF/--quiet/} --out "$W/runAm" --adam-m-bf16
grep -q '"--adam-m-bf16":.true' "$W"/runAm/ckpt-*/hparams.json || fail "--adam-m-bf16 not recorded"
grep -q '"--adam-m-bf16":.true' "$W"/runF0/ckpt-*/hparams.json || fail "m in BF16 is not the default"
cmp -s "$W/runF0/export/model.safetensors" "$W/runAm/export/model.safetensors" || fail "--adam-m-bf16 is not the default"
cmp -s "$W/runAb/export/model.safetensors" "$W/runAm/export/model.safetensors" && fail "--adam-m-bf16 is --adam-bf16"
run 0 "" "$D" train $TF --out "$W/runAmr" --stop-after 6
run 0 "" "$D" train $TF --out "$W/runAmr"
cmp -s "$W/runAm/export/model.safetensors" "$W/runAmr/export/model.safetensors" || fail "m16 resume differs"
run 0 "fp32 master \+ fp32 moments" "$D" train ${TF/--quiet/} --out "$W/runA32" --no-adam-m-bf16
grep -q '"--adam-m-bf16":.false' "$W"/runA32/ckpt-*/hparams.json || fail "--no-adam-m-bf16 not recorded"
cmp -s "$W/runF0/export/model.safetensors" "$W/runA32/export/model.safetensors" && fail "--no-adam-m-bf16 changed nothing"
run 1 "--adam-m-bf16 false \(now true\)" "$D" train $TF --out "$W/runA32"
run 1 "--adam-m-bf16 true \(now false\)" "$D" train $TF --out "$W/runAm" --no-adam-m-bf16
run 2 "ask for opposite things" "$D" train $TF --out "$W/runAx" --adam-m-bf16 --no-adam-m-bf16
run 2 "opposite things" "$D" train $TF --out "$W/runAx" --adam-bf16 --no-adam-m-bf16
# --adam-v16 (v in UF16, m in BF16): said, recorded, weights of their own (neither m16's nor
# --adam-bf16's), an exact resume, no switching on resume; refused with --adam-bf16,
# --no-adam-m-bf16 and a clip outside (0, 4]
run 0 "fp32 master \+ bf16 m / uf16 v moments" "$D" train ${TF/--quiet/} --out "$W/runAv" --adam-v16
grep -q '"--adam-v16":.true' "$W"/runAv/ckpt-*/hparams.json || fail "--adam-v16 not recorded"
grep -q '"--adam-v16":.false' "$W"/runAm/ckpt-*/hparams.json || fail "m16 recorded --adam-v16"
cmp -s "$W/runAm/export/model.safetensors" "$W/runAv/export/model.safetensors" && fail "--adam-v16 changed nothing"
cmp -s "$W/runAb/export/model.safetensors" "$W/runAv/export/model.safetensors" && fail "--adam-v16 is --adam-bf16"
run 0 "" "$D" train $TF --out "$W/runAvr" --adam-v16 --stop-after 6
run 0 "" "$D" train $TF --out "$W/runAvr" --adam-v16
cmp -s "$W/runAv/export/model.safetensors" "$W/runAvr/export/model.safetensors" || fail "--adam-v16 resume differs"
run 1 "--adam-v16 true \(now false\)" "$D" train $TF --out "$W/runAv"
run 2 "not with --adam-bf16" "$D" train $TF --out "$W/runAx" --adam-v16 --adam-bf16
run 2 "not with --no-adam-m-bf16" "$D" train $TF --out "$W/runAx" --adam-v16 --no-adam-m-bf16
run 1 "needs --clip in \(0, 4\]" "$D" train $TF --out "$W/runAx" --adam-v16 --clip 0
run 1 "needs --clip in \(0, 4\]" "$D" train $TF --out "$W/runAx" --adam-v16 --clip 5
# --bf16-logits (the training steps' logits rounded to BF16): recorded, weights of their own, the
# switch refused on resume
run 0 "" "$D" train $TF --out "$W/runBl" --bf16-logits
grep -q '"--bf16-logits":.true' "$W"/runBl/ckpt-*/hparams.json || fail "--bf16-logits not recorded"
cmp -s "$W/runF0/export/model.safetensors" "$W/runBl/export/model.safetensors" && fail "--bf16-logits changed nothing"
run 1 "--bf16-logits true \(now false\)" "$D" train $TF --out "$W/runBl"
# --f16-logits (the same in FP16): recorded, weights of their own (neither F32's nor BF16's),
# the switch refused on resume; with --bf16-logits refused
run 0 "" "$D" train $TF --out "$W/runHl" --f16-logits
grep -q '"--f16-logits":.true' "$W"/runHl/ckpt-*/hparams.json || fail "--f16-logits not recorded"
cmp -s "$W/runF0/export/model.safetensors" "$W/runHl/export/model.safetensors" && fail "--f16-logits changed nothing"
cmp -s "$W/runBl/export/model.safetensors" "$W/runHl/export/model.safetensors" && fail "--f16-logits is --bf16-logits"
run 1 "--f16-logits true \(now false\)" "$D" train $TF --out "$W/runHl"
run 2 "give one" "$D" train $TF --out "$W/runHx" --f16-logits --bf16-logits
# a run recorded before the setting existed rounded dy per 128 x 1: resumed as such, not switched
for c in "$W"/runFd/ckpt-*; do # (the manifest and COMPLETE hash what they name: kept true)
  sed -i '/"--fp8-dy-blocks"/d' "$c/hparams.json"
  sed -i -e "s/\"hparams_sha256\":.*/\"hparams_sha256\":\t\"$(sha256sum <"$c/hparams.json" | cut -c1-64)\",/" \
    -e "s/\"hparams_bytes\":.*/\"hparams_bytes\":\t$(stat -c %s "$c/hparams.json"),/" "$c/manifest.json"
  sed -i "s/^manifest.json sha256 .*/manifest.json sha256 $(sha256sum <"$c/manifest.json" | cut -c1-64)/" "$c/COMPLETE"
done
run 1 "--fp8-dy-blocks false \(now true\)" "$D" train $TF --out "$W/runFd" --fp8
run 0 "" "$D" train $TF --out "$W/runFd" --fp8 --no-fp8-dy-blocks
# --no-ckpt: no checkpoint written, the export still holds the trained weights
run 0 "" "$D" train $TA --out "$W/runNc" --no-ckpt
ls "$W/runNc" | grep -q ckpt && fail "--no-ckpt wrote a checkpoint"
cmp -s "$W/runA/export/model.safetensors" "$W/runNc/export/model.safetensors" || fail "--no-ckpt exported other weights"
# a real kill -9 once the first checkpoint exists, then resume: same result
"$D" train $TA --out "$W/runK" --steps 60 >/dev/null 2>&1 &
kpid=$!
for _ in $(seq 1000); do [ -e "$W/runK/ckpt-0000000020" ] && break; sleep 0.005; done
kill -9 $kpid 2>/dev/null; wait $kpid 2>/dev/null
run 0 "" "$D" train $TA --out "$W/runK"
cmp -s "$W/runA/export/model.safetensors" "$W/runK/export/model.safetensors" || fail "run resumed after kill -9 differs"
# evaluation on a held-out cache (the bundled eval corpus): logged lines, the same at every resume
run 0 "" "$D" extract --device cpu --model "$TM" --data "$TM/eval.jsonl" --out "$W/evc" --layers 0,1,2 --quiet
run 0 "eval @ step 60: .* rows.* tau_walk [0-9.]* " "$D" train ${TA/--quiet/} --out "$W/runEv" --eval-cache "$W/evc" --eval-every 20 --eval-rows 4 --keep-last 0
# dflash eval of the export: the trainer's last evaluation (same rows, anchors and walk); the loss
# within the export's BF16 rounding of the CPU's f32 weights
run 0 '"eval_tau_walk"' "$D" eval --cache "$W/evc" --drafter "$W/runEv/export" --target "$TM" --rows 4 --max-tokens 512 --max-anchors 32 --json
python3 - "$W/out" "$W/runEv/log.jsonl" <<'PY' || fail "dflash eval differs from the trainer's evaluation at step 60"
import json, sys
got = next(json.loads(l) for l in open(sys.argv[1]) if l.startswith("{"))
want = [json.loads(l) for l in open(sys.argv[2]) if '"eval_loss"' in l][-1]
for k in ("eval_rows", "eval_blocks", "eval_tau_hat", "eval_tau_walk", "eval_walk_verifications", "eval_acc"):
    assert got[k] == want[k], (k, got[k], want[k])
assert abs(got["eval_loss"] - want["eval_loss"]) < 1e-3 * want["eval_loss"], (got["eval_loss"], want["eval_loss"])
PY
run 2 "required" "$D" eval --cache "$W/evc" --target "$TM"
run 1 "nope" "$D" eval --cache "$W/evc" --drafter "$W/nope" --target "$TM"
[ "$(grep -c eval_tau_hat "$W/runEv/log.jsonl")" = 3 ] || fail "expected 3 evaluation lines in log.jsonl"
# the walk's tau: tokens per verification, between 1 and the block size
for t in $(sed -n 's/.*"eval_tau_walk":\([0-9.]*\).*/\1/p' "$W/runEv/log.jsonl"); do
  awk -v t="$t" 'BEGIN { exit !(t >= 1 && t <= 8) }' || fail "eval_tau_walk $t outside [1, 8]"
done
[ "$(grep -c '"eval_walk_verifications":[1-9]' "$W/runEv/log.jsonl")" = 3 ] || fail "expected 3 walks"
# RUN/best: the export of the step with the highest eval tau_walk, with best.json (step, figures):
# no logged evaluation beats it, it is the export of that step's checkpoint, and `export --best`
# gives it back bit for bit
bs=$(bstep "$W/runEv")
bv=$(sed -nE 's/.*"value":[[:space:]]*([0-9.e+-]+).*/\1/p' "$W/runEv/best/best.json")
[ -n "$bs" ] && [ -n "$bv" ] || fail "runEv: no best/best.json with a step and a value"
grep -q "^{\"step\":$bs,\"eval_rows\".*\"eval_tau_walk\":$(printf %.4f "$bv")," "$W/runEv/log.jsonl" || fail "best.json: step $bs did not score $bv"
sed -nE 's/.*"eval_tau_walk":([0-9.]+).*/\1/p' "$W/runEv/log.jsonl" |
  awk -v v="$(printf %.4f "$bv")" '$1 > v + 0 { bad = 1 } END { exit bad }' || fail "a logged eval_tau_walk beats best.json's $bv"
run 0 "exported the best step $bs of" "$D" export --run "$W/runEv" --best --out "$W/exBest"
cmp -s "$W/runEv/best/model.safetensors" "$W/exBest/model.safetensors" || fail "export --best differs from RUN/best"
run 0 "exported step $bs of" "$D" export --run "$W/runEv" --step "$bs" --out "$W/exBestS"
cmp -s "$W/runEv/best/model.safetensors" "$W/exBestS/model.safetensors" || fail "RUN/best is not the export of step $bs"
run 1 "has no best export" "$D" export --run "$W/runA" --best --out "$W/exNoBest"
run 2 "no --step" "$D" export --run "$W/runEv" --best --step 20 --out "$W/exNoBest"
run 0 "" "$D" train $TA --out "$W/runEvN" --eval-cache "$W/evc" --eval-rows 4 --no-eval-walk
grep -q eval_tau_hat "$W/runEvN/log.jsonl" || fail "--no-eval-walk: no evaluation line"
grep -q eval_tau_walk "$W/runEvN/log.jsonl" && fail "--no-eval-walk still walked"
grep -Eq '"metric":[[:space:]]*"eval_tau_hat"' "$W/runEvN/best/best.json" || fail "--no-eval-walk: the best is not by tau_hat"
run 0 "" "$D" train ${TA/--steps 60/--steps 4} --out "$W/runEvNb" --eval-cache "$W/evc" --eval-rows 2 --no-eval-walk --no-best
[ -e "$W/runEvNb/best" ] && fail "--no-best kept a best export"
run 1 "nope" "$D" train $TA --out "$W/runEv2" --eval-cache "$W/nope"
run 1 "another target" "$D" train $TA --out "$W/runC" --target "$SRC/tests/fixtures/qwen3_5-tiny"
run 1 "layer" "$D" train $TA --out "$W/runD" --target-layers 0,3
run 2 "mask-token" "$D" train --cache "$W/ext3" --target "$TM" --out "$W/runE" --steps 5

fi # part a

if [ "$PART" = b ]; then # what part a would have left for part b: corpus, caches, runs
  run 0 "" "$D" corpus import --vocab 4096 --out "$W/tiny.dtok" "$SRC/data/tiny/corpus.jsonl"
  run 0 "" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/ext" --quiet
  run 0 "" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/ext3" --layers 0,1,2 --codec split-lz4 --quiet
  run 0 "" "$D" extract --device cpu --model "$TM" --data "$TM/eval.jsonl" --out "$W/evc" --layers 0,1,2 --quiet
  run 0 "" "$D" train $TA --out "$W/runA"
  run 0 "" "$D" train $TA3 --out "$W/runL3"
fi

if [ "$PART" != a ]; then
# --- projected caches: `cache project` derives one from a finished cache without the target; a
# drafter trains on z and its export is an ordinary drafter (fc merged to hidden x K*hidden)
run 0 "eigenbasis .*on the CPU" "$D" cache project "$W/ext3" "$W/pj" --rank 24 --device cpu
kept_cpu=$(grep -oE 'rank 24 of [0-9]+, [0-9.]+% of the features. energy kept' "$W/out" | cut -d, -f2 | cut -d% -f1)
[ -n "$kept_cpu" ] || fail "cache project --rank 24: no 'rank 24 of' line with the energy kept"
# --device cuda: on a GPU the same basis up to rounding (the kept energy printed agrees), in a
# build without CUDA or on a machine without a GPU a clear refusal; a bad value is a usage error
"$D" cache project "$W/ext3" "$W/pjg" --rank 24 --device cuda >"$W/out" 2>&1
rc=$?
gpu=$([ $rc = 0 ] && echo 1)   # the GPU variants below run when this one did
if [ $rc = 0 ]; then
  kept_gpu=$(grep -oE 'rank 24 of [0-9]+, [0-9.]+% of the features. energy kept' "$W/out" | cut -d, -f2 | cut -d% -f1)
  awk -v a="$kept_cpu" -v b="$kept_gpu" 'BEGIN { d = a - b; exit !(a > 0 && d < 0.002 && d > -0.002) }' ||
    fail "--device cuda keeps ${kept_gpu}%, the CPU's basis ${kept_cpu}%"
  grep -q "eigenbasis .* on .*device 0" "$W/out" || fail "--device cuda: the fit did not say it ran on the GPU"
  run 0 "OK: 96 samples" "$D" dump "$W/pjg" --verify
else
  [ $rc = 1 ] && grep -q -- "--device cuda: .*CUDA" "$W/out" ||
    { fail "--device cuda without a GPU: exit $rc, want 1 and a message naming CUDA"; sed 's/^/    /' "$W/out" >&2; }
fi
run 2 "want cpu, cuda or auto" "$D" cache project "$W/ext3" "$W/pjg2" --rank 24 --device tpu
run 0 "OK: 96 samples" "$D" dump "$W/pj" --verify
run 0 "PROJECTED: z = P x, rank 24 of 3 x" "$D" dump "$W/pj"
grep -Eq '"version":[[:space:]]*2' "$W/pj/manifest.json" || fail "a projected manifest is not version 2"
run 0 "rank 24 of " "$D" cache project "$W/evc" "$W/pje" --basis "$W/pj/basis.dfb"
run 0 "eval @ step 60: .* tau_walk" "$D" train ${TA/--quiet/} --cache "$W/pj" --out "$W/runPj" --eval-cache "$W/pje" --eval-rows 4
hid=$(sed -nE 's/.*"hidden_size":[[:space:]]*([0-9]+).*/\1/p' "$TM/config.json" | head -1)
grep -aq "\"fc.weight\":{\"dtype\":\"BF16\",\"shape\":\[$hid,$((3 * hid))\]" "$W/runPj/export/model.safetensors" ||
  fail "the projected run's export has no merged fc.weight [$hid, $((3 * hid))]"
grep -q '"target_layer_ids":[[:space:]]*\[0, 1, 2\]' "$W/runPj/export/config.json" || fail "projected export: target_layer_ids"
cmp -s "$W/runPj/export/model.safetensors" "$W/runPj/best/model.safetensors" || fail "projected run: best/ (its last evaluation) is not its merged export"
# a stopped run on a projected cache resumes to the same weights
run 0 "" "$D" train $TA --cache "$W/pj" --out "$W/runPj1"
run 0 "" "$D" train $TA --cache "$W/pj" --out "$W/runPj2" --stop-after 30
run 0 "" "$D" train $TA --cache "$W/pj" --out "$W/runPj2"
cmp -s "$W/runPj1/export/model.safetensors" "$W/runPj2/export/model.safetensors" || fail "projected run resumed to other weights"
# dflash export: any checkpoint; the newest gives the trainer's own export, bit for bit
run 1 "projected cache .*--cache" "$D" export --run "$W/runPj1" --out "$W/exP"
run 0 "exported step 60 of" "$D" export --run "$W/runPj1" --out "$W/exP" --cache "$W/pj"
cmp -s "$W/runPj1/export/model.safetensors" "$W/exP/model.safetensors" || fail "export of the newest checkpoint differs from the run's"
run 0 "exported step 40 of" "$D" export --run "$W/runPj1" --out "$W/exP40" --step 40 --basis "$W/pj/basis.dfb"
cmp -s "$W/exP/model.safetensors" "$W/exP40/model.safetensors" && fail "steps 40 and 60 exported the same weights"
run 1 "steps: 40, 60" "$D" export --run "$W/runPj1" --out "$W/exP41" --step 41 --cache "$W/pj"
run 0 "exported step" "$D" export --run "$W/runA" --out "$W/exA"
cmp -s "$W/runA/export/model.safetensors" "$W/exA/model.safetensors" || fail "export of runA's newest checkpoint differs from its export"
run 2 "not a run on a projected cache" "$D" export --run "$W/runA" --out "$W/exA2" --basis "$W/pj/basis.dfb"
run 1 "cannot open run directory" "$D" export --run "$W/nonexistent" --out "$W/exN"
# the fc rows of a drafter trained on the source cache as the basis (R = hidden), and an interrupted projection resumed
run 0 "rank $hid of " "$D" cache project "$W/ext3" "$W/pf" --fc-basis "$W/runA/export"
run 0 "" "$D" cache project "$W/ext3" "$W/pf2" --basis "$W/pf/basis.dfb"
rm "$W/pf/manifest.json" "$W/pf/rank-0000.json"   # as if it stopped before finishing
run 0 "rank $hid of " "$D" cache project "$W/ext3" "$W/pf" --fc-basis "$W/runA/export"
run 0 "identical" "$D" cache diff "$W/pf" "$W/pf2"
# fc's rows extended by the features' energy outside them (R > hidden), and its top rows (R < hidden)
run 0 "rank $((hid + 8)) of " "$D" cache project "$W/ext3" "$W/pfx" --fc-basis "$W/runA/export" --rank $((hid + 8)) --device cpu
kx_cpu=$(grep -oE 'rank [0-9]+ of [0-9]+, [0-9.]+% of the features. energy kept' "$W/out" | cut -d, -f2 | cut -d% -f1)
run 0 "OK: 96 samples" "$D" dump "$W/pfx" --verify
# the same extension (basis kind 3) on the GPU: the features' energy it keeps agrees with the CPU's
if [ -n "$gpu" ]; then
  run 0 "fc basis: extension and evaluation in .* on .*device 0" "$D" cache project "$W/ext3" "$W/pfxg" --fc-basis "$W/runA/export" --rank $((hid + 8)) --device cuda
  kx_gpu=$(grep -oE 'rank [0-9]+ of [0-9]+, [0-9.]+% of the features. energy kept' "$W/out" | cut -d, -f2 | cut -d% -f1)
  awk -v a="$kx_cpu" -v b="$kx_gpu" 'BEGIN { d = a - b; exit !(a > 0 && d < 0.002 && d > -0.002) }' ||
    fail "--fc-basis --rank $((hid + 8)) --device cuda keeps ${kx_gpu}%, the CPU's ${kx_cpu}%"
  run 0 "OK: 96 samples" "$D" dump "$W/pfxg" --verify
fi
run 0 "rank $((hid / 2)) of " "$D" cache project "$W/ext3" "$W/pfy" --fc-basis "$W/runA/export" --rank $((hid / 2))
run 1 "the basis is rank" "$D" export --run "$W/runPj1" --out "$W/exPf" --basis "$W/pf/basis.dfb"
run 0 "eval @ step 60: .* tau_walk" "$D" train ${TA/--quiet/} --cache "$W/pfx" --out "$W/runPfx" --eval-cache "$W/pfx" --eval-rows 4
# extraction straight into a projected cache (--basis): the z of projecting the lossless cache
run 0 "extracted" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/extpj" --layers 0,1,2 --basis "$W/pj/basis.dfb" --quiet
run 0 "identical" "$D" cache diff "$W/extpj" "$W/pj"
if [ -n "$gpu" ]; then # on a GPU, z = P x is computed on the device: the host's projection of the
  # GPU's own features up to z's rounding (one BF16 ulp, 2^-8 relative at most)
  run 0 "extracted" "$D" extract --device cuda --model "$TM" --data "$TM/corpus.jsonl" --out "$W/extg" --layers 0,1,2 --quiet
  run 0 "rank 24 of" "$D" cache project "$W/extg" "$W/extgp" --basis "$W/pj/basis.dfb" --device cpu
  run 0 "extracted" "$D" extract --device cuda --model "$TM" --data "$TM/corpus.jsonl" --out "$W/extpjg" --layers 0,1,2 --basis "$W/pj/basis.dfb" --quiet
  run 0 "" "$D" cache diff "$W/extpjg" "$W/extgp" --tol 0.004
fi
# two ranks (rank 0 last: it writes the basis, the manifest needs it too)
run 0 "48 docs" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/extpjr" --layers 0,1,2 --basis "$W/pj/basis.dfb" --world-size 2 --rank 1 --quiet
run 0 "48 docs" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/extpjr" --layers 0,1,2 --basis "$W/pj/basis.dfb" --world-size 2 --rank 0 --quiet
run 0 "OK: 96 samples" "$D" dump "$W/extpjr" --verify
run 0 "identical" "$D" cache diff "$W/extpjr" "$W/pj"
run 1 "a basis of 3 layers" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/extpj2" --layers 0,1 --basis "$W/pj/basis.dfb" --quiet
run 1 "holds another basis" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/extpj" --layers 0,1,2 --basis "$W/pf/basis.dfb" --quiet
# errors, each by name: the wrong eval cache, a subset of projected layers, a damaged basis,
# bad usage
run 1 "not projected" "$D" train $TA --cache "$W/pj" --out "$W/runPx" --eval-cache "$W/evc"
run 1 "projected .* subset" "$D" train $TA --cache "$W/pj" --out "$W/runPy" --target-layers 0,1
cp -r "$W/pj" "$W/pjbad" && flip "$W/pjbad/basis.dfb" 100
run 1 "basis.dfb: sha256 .* not the basis" "$D" dump "$W/pjbad" --verify
run 1 "basis.dfb: sha256 .* not the basis" "$D" train $TA --cache "$W/pjbad" --out "$W/runPz"
run 1 "projected already" "$D" cache project "$W/pj" "$W/pj3" --rank 4
run 1 "a basis of 3 layers" "$D" cache project "$W/ext" "$W/pj4" --basis "$W/pj/basis.dfb"
run 2 "exactly one of" "$D" cache project "$W/ext3" "$W/pj5"
run 2 "exactly one of" "$D" cache project "$W/ext3" "$W/pj5" --rank 4 --energy 0.9
run 2 "out of range" "$D" cache project "$W/ext3" "$W/pj6" --rank 100000
run 2 "bad or missing value" "$D" cache project "$W/ext3" "$W/pj7" --energy 1.5

# --- --init-from: a run that starts from a drafter export (ours here; a released DFlash drafter
# has the same names) with a fresh optimizer. --steps 0: the start itself, exported bit for bit,
# its block size, mask token and layers taken from its config (none given here)
IA="--init-from $W/runA/export --cache $W/ext3 --target $TM --max-tokens 512 --max-anchors 32 --quiet --device cpu"
run 0 "" "$D" train $IA --steps 0 --out "$W/runI0"
cmp -s "$W/runA/export/model.safetensors" "$W/runI0/export/model.safetensors" || fail "--init-from --steps 0 changed the weights"
cmp -s "$W/runA/export/config.json" "$W/runI0/export/config.json" || fail "--init-from --steps 0 changed the config"
# fine-tuning: the first step's loss is the trained drafter's (runA ends near 5.7; a drawn one
# starts near 6.5); an interrupted fine-tune resumes exactly
IA1="$IA --steps 8 --lr 1e-3 --log-every 1 --ckpt-every 4"
run 0 "" "$D" train $IA1 --out "$W/runI1"
a=$(grep -m1 '"loss"' "$W/runA/log.jsonl" | sed -E 's/.*"loss":([0-9.]+).*/\1/')
z=$(tail -1 "$W/runA/log.jsonl" | sed -E 's/.*"loss":([0-9.]+).*/\1/')
i1=$(grep -m1 '"loss"' "$W/runI1/log.jsonl" | sed -E 's/.*"loss":([0-9.]+).*/\1/')
awk -v a="$a" -v z="$z" -v i="$i1" 'BEGIN { exit !(i < z + 0.1 && i < a - 0.3) }' || fail "--init-from: step 1 loss $i1, not near runA's last $z"
run 0 "" "$D" train $IA1 --out "$W/runI2" --stop-after 5
run 0 "" "$D" train $IA1 --out "$W/runI2"
cmp -s "$W/runI1/export/model.safetensors" "$W/runI2/export/model.safetensors" || fail "--init-from run resumed to other weights"
# a run resumes only from the start it was made from
run 1 "started from drawn weights; --init-from .* starts a new run" "$D" train $IA1 --out "$W/runA"
run 1 "started from --init-from .*runA/export; give it again" "$D" train ${IA1/--init-from $W\/runA\/export/} --mask-token 1 --block-size 8 --out "$W/runI1"
run 2 "nothing to draw" "$D" train $IA1 --out "$W/runIx" --init-seed 3
# what does not fit is named, with both values: a config key, a tensor's shape, a missing tensor,
# an extra one
run 1 "num_hidden_layers is 1; the drafter being built has 2 \(--layers\)" "$D" train $IA1 --out "$W/runIx" --layers 2
run 1 "block_size is 8; the drafter being built has 4 \(--block-size\)" "$D" train $IA1 --out "$W/runIx" --block-size 4
cp -r "$W/runA/export" "$W/initH"
sed -i -E 's/"(target_)?hidden_size":[[:space:]]*[0-9]+/"\1hidden_size": 32/' "$W/initH/config.json"
run 1 "hidden_size is 32; the drafter being built has $hid \(the target's" "$D" train ${IA1/runA\/export/initH} --out "$W/runIx"
cp -r "$W/runA/export" "$W/initF"
sed -i -E 's/"intermediate_size":[[:space:]]*[0-9]+/"intermediate_size": 99/' "$W/initF/config.json"
run 1 "tensor layers.0.mlp.gate_proj.weight has shape \[[0-9]+,$hid\]; its config.json implies \[99,$hid\]" "$D" train ${IA1/runA\/export/initF} --out "$W/runIx"
cp -r "$W/runA/export" "$W/initM"
sed -i -E 's/"num_hidden_layers":[[:space:]]*1/"num_hidden_layers": 2/; s/\["full_attention"\]/["full_attention", "full_attention"]/' "$W/initM/config.json"
run 1 "tensor layers.1.input_layernorm.weight is missing" "$D" train ${IA1/runA\/export/initM} --out "$W/runIx"
cp -r "$W/runL3/export" "$W/initX"   # 3 layers, its config made to say 2
sed -i -E 's/"num_hidden_layers":[[:space:]]*3/"num_hidden_layers": 2/; s/\["sliding_attention", /[/' "$W/initX/config.json"
run 1 "extra tensor layers.2\." "$D" train ${IA1/runA\/export/initX} --out "$W/runIx"
# a projected cache: fc_r = fc P^T. On pf (whose basis is runA's fc rows) the evaluation at step 0
# is runA's own, to float rounding (a rank-24 basis of the energy moves it by ~1e-2)
run 0 "eval @ step 0" "$D" train ${IA/--quiet/} --steps 0 --eval-cache "$W/evc" --eval-rows 4 --no-eval-walk --out "$W/runI0e"
run 0 "" "$D" cache project "$W/evc" "$W/pfe" --basis "$W/pf/basis.dfb"
run 0 "fc_r = fc P\^T \($hid x $hid\)" "$D" train ${IA/--quiet/} --cache "$W/pf" --steps 0 --eval-cache "$W/pfe" --eval-rows 4 --no-eval-walk --out "$W/runIp"
e0=$(sed -nE 's/.*"eval_loss":([0-9.]+).*/\1/p' "$W/runI0e/log.jsonl")
ep=$(sed -nE 's/.*"eval_loss":([0-9.]+).*/\1/p' "$W/runIp/log.jsonl")
awk -v a="$e0" -v b="$ep" 'BEGIN { d = a - b; exit !(a > 0 && d < 1e-4 && d > -1e-4) }' || fail "projected --init-from: eval loss $ep, runA's $e0"
# the start is the best while nothing beats it: at a learning rate of 1e-30 every evaluation ties
# (the earlier step stays), also across a resume, which must read the best back from best.json
# (tau_hat without the walk: the same rule, cheaper)
IB="$IA --steps 6 --lr 1e-30 --eval-cache $W/evc --eval-every 2 --eval-rows 2 --no-eval-walk --ckpt-every 2"
run 0 "" "$D" train $IB --out "$W/runIb" --stop-after 3
run 0 "" "$D" train $IB --out "$W/runIb"
[ "$(grep -c '"eval_tau_hat"' "$W/runIb/log.jsonl")" = 4 ] || fail "--init-from: expected evaluations at steps 0, 2, 4, 6"
[ "$(bstep "$W/runIb")" = 0 ] || fail "a resumed run replaced the best of step 0 by a tie (step $(bstep "$W/runIb"))"
cmp -s "$W/runA/export/model.safetensors" "$W/runIb/best/model.safetensors" || fail "the best of step 0 is not the start"

# --- cache plan: the size before anything runs (typical ratios, or measured on a cache)
run 0 "total +15.48 TB" "$D" cache plan --hidden 5120 --layers 5 --tokens 1.3e9 --codec int4-b32
run 0 "total +11\.30 TB" "$D" cache plan --hidden 5120 --layers 5 --tokens 1.3e9 --codec int3-b32
run 0 "total +4\.63 TB" "$D" cache plan --hidden 5120 --layers 5 --tokens 1.3e9 --codec int2-b32
run 0 "ratio 0\.[0-9]+ measured on .* tokens" "$D" cache plan --model "$TM" --corpus "$TM/corpus.jsonl" --layers 3 --codec fp8-b32 --from "$W/ext3" --rank-frac 0.25 --disk "$W"
run 2 "at most one of" "$D" cache plan --hidden 64 --tokens 10 --rank 4 --rank-frac 0.5
run 2 "exceeds" "$D" cache plan --hidden 64 --layers 2 --tokens 10 --rank 200
run 1 "nope" "$D" cache plan --hidden 64 --tokens 10 --from "$W/nope"

# data parallel on the CPU: two ranks from the environment (as torchrun starts them), one
# shared-memory communicator, ZeRO-1 shards; a stopped and resumed 2-rank run is bit-identical
# to an uninterrupted one, and resuming with another number of ranks is refused
TA2="${TA/--steps 60/--steps 40} --threads 1"
ranks2() { # ranks2 RUN_ID ARGS...: both ranks, waits; fails when either does
  local id=$1; shift
  RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 DFLASH_RUN_ID=$id "$D" train "$@" >"$W/r0.out" 2>&1 & local p0=$!
  RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 DFLASH_RUN_ID=$id "$D" train "$@" >"$W/r1.out" 2>&1 & local p1=$!
  wait $p0 || { fail "rank 0 of: $*"; cat "$W/r0.out" >&2; }
  wait $p1 || { fail "rank 1 of: $*"; cat "$W/r1.out" >&2; }
}
EV2="--eval-cache $W/evc --eval-every 20 --eval-rows 2 --no-eval-walk"
ranks2 dp1 $TA2 $EV2 --out "$W/runP"
# every step logs the longest wait over the ranks, at least rank 0's own
sed -nE 's/.*"data_wait":([0-9.e+-]+),"data_wait_max":([0-9.e+-]+),.*/\1 \2/p' "$W/runP/log.jsonl" |
  awk '{ n++; if ($2 < $1) bad++ } END { exit !(n >= 8 && !bad) }' || fail "2-rank log: data_wait_max"
ranks2 dp2 $TA2 $EV2 --out "$W/runQ" --stop-after 30
ranks2 dp3 $TA2 $EV2 --out "$W/runQ"
cmp -s "$W/runP/export/model.safetensors" "$W/runQ/export/model.safetensors" || fail "2-rank run resumed differs"
# RUN/best of 2 ranks (ZeRO-1: rank 0 writes the all-gathered weights): the export of its step,
# and the same after a resume
run 0 "" "$D" export --run "$W/runP" --step "$(bstep "$W/runP")" --out "$W/exP2b"
cmp -s "$W/runP/best/model.safetensors" "$W/exP2b/model.safetensors" || fail "2 ranks: best/ is not the export of step $(bstep "$W/runP")"
[ "$(bstep "$W/runP")" = "$(bstep "$W/runQ")" ] && cmp -s "$W/runP/best/model.safetensors" "$W/runQ/best/model.safetensors" || fail "2 ranks: the resumed run's best differs"
[ "$(nolat "$W/runP/log.jsonl")" = "$(nolat "$W/runQ/log.jsonl")" ] || fail "2-rank resumed run's log differs"
run 1 "run of 2 rank" "$D" train $TA2 --out "$W/runQ" --steps 50
# the data-parallel math (denominator over ranks, gradient buckets reduce-scattered from the
# backward, sharded AdamW, all-gather): two ranks that both read rank 0's rows must give one
# rank's weights exactly (each rank's gradient is half of it; halves add exactly)
run 0 "" "$D" train $TA2 --out "$W/runS1" --no-adam-m-bf16
DFLASH_TEST_REPLICATE_DATA=1 ranks2 dp4 $TA2 --out "$W/runS2" --no-adam-m-bf16
cmp -s "$W/runS1/export/model.safetensors" "$W/runS2/export/model.safetensors" || fail "2 ranks on the same rows differ from 1 rank"
# the same with FP8 training (each rank rounds its own rows' GEMM operands)
run 0 "" "$D" train ${TA2/--steps 40/--steps 12} --out "$W/runS1f" --fp8
DFLASH_TEST_REPLICATE_DATA=1 ranks2 dp8 ${TA2/--steps 40/--steps 12} --out "$W/runS2f" --fp8
cmp -s "$W/runS1f/export/model.safetensors" "$W/runS2f/export/model.safetensors" || fail "--fp8: 2 ranks on the same rows differ from 1 rank"
# and with BF16 moments: their stochastic rounding keyed by the global index, not the shard
run 0 "" "$D" train ${TA2/--steps 40/--steps 12} --out "$W/runS1a" --adam-bf16
DFLASH_TEST_REPLICATE_DATA=1 ranks2 dp9 ${TA2/--steps 40/--steps 12} --out "$W/runS2a" --adam-bf16
cmp -s "$W/runS1a/export/model.safetensors" "$W/runS2a/export/model.safetensors" || fail "--adam-bf16: 2 ranks on the same rows differ from 1 rank"
# and with m alone in BF16, the default (the checkpoint gathers one BF16 and one F32 moment), resumed
T12="${TA2/--steps 40/--steps 12}"; T12=${T12/--ckpt-every 20/--ckpt-every 4}
run 0 "" "$D" train $T12 --out "$W/runS1m"
DFLASH_TEST_REPLICATE_DATA=1 ranks2 dp10 $T12 --out "$W/runS2m" --stop-after 6
DFLASH_TEST_REPLICATE_DATA=1 ranks2 dp11 $T12 --out "$W/runS2m"
cmp -s "$W/runS1m/export/model.safetensors" "$W/runS2m/export/model.safetensors" || fail "m in BF16 (the default): 2 ranks on the same rows, resumed, differ from 1 rank"
# the same with the optimizer after the backward (the default: on the side stream, all-gathers
# joined there, per-bucket zeroing)
ranks2 dp5 $TA2 --out "$W/runOv2" --no-overlap-optimizer --no-grad-alias
cmp -s "$W/runP/export/model.safetensors" "$W/runOv2/export/model.safetensors" || fail "2 ranks with --no-overlap-optimizer differ"
# 3 layers on 2 ranks (the reduce-scatter per bucket while later layers' gradient ranges are
# cleared and written): with and without aliased gradients, the same bits
ranks2 dp6 ${TA2/--steps 40/--steps 12} --layers 3 --out "$W/runA2"
ranks2 dp7 ${TA2/--steps 40/--steps 12} --layers 3 --out "$W/runA2n" --no-grad-alias --no-overlap-optimizer
cmp -s "$W/runA2/export/model.safetensors" "$W/runA2n/export/model.safetensors" || fail "2 ranks, 3 layers: --no-grad-alias differs"

run 2 "DFLASH_RUN_ID" env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 "$D" train $TA2 --out "$W/runR"

run 0 "loss 6.82796" "$D" train-step --in "$SRC/tests/fixtures/drafter_ref.safetensors" --out "$W/grads.safetensors"
run 1 "missing|config" "$D" train-step --in "$W/grads.safetensors"

# --- dflash env: the knob table with the values in use; docs/KNOBS.md is its --markdown
run 0 "DFLASH_CE_CHUNK_MIB=1024 \(default\)" env -u DFLASH_CE_CHUNK_MIB "$D" env
run 0 "DFLASH_CE_CHUNK_MIB=2048 \(set\)" env DFLASH_CE_CHUNK_MIB=2048 "$D" env
run 0 "DFLASH_IO=bogus \(bad: an error at use\)" env DFLASH_IO=bogus "$D" env
run 0 "warn: DFLASH_ATTN_BWD=mma: want one of simt, mma4, wg2, wg2f, wg3; using the default" env DFLASH_ATTN_BWD=mma "$D" env
[ "$(DFLASH_ATTN_BWD=mma "$D" env 2>&1 | grep -c "warn: DFLASH_ATTN_BWD")" = 1 ] || fail "a bad knob did not warn exactly once"
"$D" env --markdown | cmp -s - "$SRC/docs/KNOBS.md" || fail "docs/KNOBS.md is not \`dflash env --markdown\`"
run 2 "unknown argument" "$D" env --bogus
run 1 "DFLASH_IO=bogus: want one of auto, uring \(or io_uring\), threads" env DFLASH_IO=bogus "$D" cache synth --out "$W/iobad" \
  --corpus "$W/tiny.dtok" --hidden 64 --target-layers 6 --layers 3

# --- usage
run 2 "" "$D"
run 2 "unknown command" "$D" nosuch
run 2 "" "$D" dump
run 2 "" "$D" dump "$W/cache" --bogus
run 2 "codec" "$D" cache synth --out "$W/x" --codec zip
run 0 "usage" "$D" --help
run 0 "usage" "$D" dump --help
run 2 "" "$D" train

fi # part b

if [ "$fails" -gt 0 ]; then
  echo "test_cli: $fails failure(s)" >&2
  exit 1
fi
echo ok
