#!/usr/bin/env bash
# test_hardening_cache.sh DFLASH WORKDIR SRCDIR - issue 32, the cache half: each hardening fix
# of the cache's readers and writers against the input that used to get past it (a FIFO for a
# shard, token ids past the vocabulary, edited manifests, a missing rank at the merge, failed
# writes, --out into a foreign directory). Faults are injected through DFLASH_FAULT (common/
# fsutil.h, df_fault), read once per process. Exit codes as test_cli.sh: 0 ok, 1 data error.
set -u
D=$1 W=$2 SRC=$3
rm -rf "$W" && mkdir -p "$W"
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }

# run CODE PATTERN cmd...: exit code must be CODE, stdout+stderr must match PATTERN. A hang
# (the bug some of these guard against) is a failure after 120 s, not a stuck ctest.
run() {
  local want=$1 pat=$2; shift 2
  timeout 120 "$@" >"$W/out" 2>&1
  local got=$?
  [ "$got" = "$want" ] || { fail "exit $got (want $want): $*"; sed 's/^/    /' "$W/out" | head -20 >&2; return; }
  [ -z "$pat" ] || grep -Eq -- "$pat" "$W/out" || { fail "output of '$*' lacks /$pat/"; sed 's/^/    /' "$W/out" | head -20 >&2; }
}

run 0 "" "$D" corpus import --vocab 4096 --out "$W/tiny.dtok" "$SRC/data/tiny/corpus.jsonl"
SYNTH=(cache synth --corpus "$W/tiny.dtok" --hidden 64 --target-layers 6 --layers 3 --rows-per-block 32 --shard-mb 1 --threads 2)
run 0 "wrote" "$D" "${SYNTH[@]}" --out "$W/cache"
run 0 "OK: 48 samples" "$D" dump "$W/cache" --verify

# --- 3. a FIFO where a cache file belongs is refused by name, never waited on
cp -r "$W/cache" "$W/fifo1" && rm "$W/fifo1/shard-r0000-00001.dfc" && mkfifo "$W/fifo1/shard-r0000-00001.dfc"
run 1 "shard-r0000-00001.dfc: a FIFO" "$D" dump "$W/fifo1" --verify
run 1 "shard-r0000-00001.dfc: a FIFO" "$D" cache read "$W/fifo1"
cp -r "$W/cache" "$W/fifo2" && rm "$W/fifo2/shard-r0000-00002.dfi" && mkfifo "$W/fifo2/shard-r0000-00002.dfi"
run 1 "shard-r0000-00002.dfi: a FIFO" "$D" dump "$W/fifo2" --verify
cp -r "$W/cache" "$W/fifo3" && rm "$W/fifo3/manifest.json" && mkfifo "$W/fifo3/manifest.json"
run 1 "manifest.json: a FIFO" "$D" dump "$W/fifo3"
# the writer: resuming over a FIFO partial shard, a FIFO lock file, a FIFO meta.json
mkdir -p "$W/fifo4" && cp "$W/cache/meta.json" "$W/fifo4/" && mkfifo "$W/fifo4/shard-r0000-00000.dfc.partial"
run 1 "shard-r0000-00000.dfc.partial: a FIFO" "$D" "${SYNTH[@]}" --out "$W/fifo4"
mkdir -p "$W/fifo5" && mkfifo "$W/fifo5/.lock-r0000"
run 1 ".lock-r0000: a FIFO" "$D" "${SYNTH[@]}" --out "$W/fifo5"
mkdir -p "$W/fifo6" && mkfifo "$W/fifo6/meta.json"
run 1 "meta.json: a FIFO" "$D" "${SYNTH[@]}" --out "$W/fifo6"
# a cache without manifest.json whose meta.json is a FIFO: the "unfinished" message, no wait
cp -r "$W/cache" "$W/fifo7" && rm "$W/fifo7/manifest.json" "$W/fifo7/meta.json" && mkfifo "$W/fifo7/meta.json"
run 1 "fifo7: unfinished cache" "$D" dump "$W/fifo7"
# the readers of user-given inputs: a model's weights (single file or an index's shard), its
# config.json, a corpus (was: the safetensors reader waited on the FIFO)
TMF=$SRC/data/tiny-qwen3
FX=(extract --device cpu --data "$TMF/corpus.jsonl" --quiet)
mkdir -p "$W/mf1" && cp "$TMF/config.json" "$W/mf1/" && mkfifo "$W/mf1/model.safetensors"
run 1 "mf1/model.safetensors: a FIFO" "$D" "${FX[@]}" --model "$W/mf1" --out "$W/fx1"
mkdir -p "$W/mf2" && cp "$TMF/config.json" "$W/mf2/" && mkfifo "$W/mf2/model-00001-of-00001.safetensors"
echo '{"weight_map":{"lm_head.weight":"model-00001-of-00001.safetensors"}}' >"$W/mf2/model.safetensors.index.json"
run 1 "mf2/model-00001-of-00001.safetensors: a FIFO" "$D" "${FX[@]}" --model "$W/mf2" --out "$W/fx2"
mkdir -p "$W/mf3" && cp "$TMF/model.safetensors" "$W/mf3/" && mkfifo "$W/mf3/config.json"
run 1 "mf3/config.json: a FIFO" "$D" "${FX[@]}" --model "$W/mf3" --out "$W/fx3"
mkfifo "$W/corpus-fifo.jsonl"
run 1 "corpus-fifo.jsonl: a FIFO" "$D" extract --device cpu --model "$TMF" --data "$W/corpus-fifo.jsonl" --quiet --out "$W/fx4"
# a FIFO left at a writer's .tmp name: refused, not waited on
mkfifo "$W/cf.dtok.tmp"
run 1 "cf.dtok.tmp: a FIFO" "$D" corpus import --vocab 4096 --out "$W/cf.dtok" "$SRC/data/tiny/corpus.jsonl"

# --- 5. token ids past the vocabulary: dump --verify and cache read name sample and position
# (cache synth takes a corpus' ids as they are; its caches say vocab 151936)
printf '{"input_ids":[1,2,3,160000,5]}\n{"input_ids":[7,8]}\n' >"$W/big.jsonl"
run 0 "" "$D" corpus import --vocab 200000 --out "$W/big.dtok" "$W/big.jsonl"
run 0 "wrote" "$D" cache synth --corpus "$W/big.dtok" --hidden 64 --target-layers 6 --layers 3 --out "$W/bigvocab"
run 1 "sample 0 position 3: token id 160000 out of range \(vocab 151936\)" "$D" dump "$W/bigvocab" --verify
run 1 "sample 0 position 3: token id 160000 out of range" "$D" cache read "$W/bigvocab"
run 1 "sample 0 position 3: token id 160000" "$D" dump "$W/bigvocab" --sample 0 --layer 1

# --- 2. the merge never writes a manifest the shards contradict
TM=$SRC/data/tiny-qwen3
EX=(extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --world-size 2 --quiet)
# rank 0's meta.json lost: rank 1 does not start a new cache over rank 0's files
run 0 "48 docs" "$D" "${EX[@]}" --rank 0 --out "$W/m1"
rm "$W/m1/meta.json"
run 1 "m1: not empty \(holds (rank|shard)-.*no meta.json" "$D" "${EX[@]}" --rank 1 --out "$W/m1"
[ ! -e "$W/m1/manifest.json" ] || fail "a manifest was written over a cache without meta.json"
# a rank file from another cache (another uuid): refused by file and field
run 0 "48 docs" "$D" "${EX[@]}" --rank 0 --out "$W/m2"
cp "$W/m2/rank-0000.json" "$W/other-rank-0000.json"
rm -rf "$W/m2"
run 0 "48 docs" "$D" "${EX[@]}" --rank 0 --out "$W/m2"
cp "$W/other-rank-0000.json" "$W/m2/rank-0000.json"
run 1 "rank-0000.json: \"uuid\" [0-9a-f]{32} is not this cache's" "$D" "${EX[@]}" --rank 1 --out "$W/m2"
[ ! -e "$W/m2/manifest.json" ] || fail "a manifest was written with another cache's rank"
# a rank file without uuid (older writers) whose shard was truncated: the shard check catches it
run 0 "48 docs" "$D" "${EX[@]}" --rank 0 --out "$W/m3"
sed -i '/"uuid"/d' "$W/m3/rank-0000.json"
truncate -s -4096 "$W/m3/shard-r0000-00000.dfc"
run 1 "cannot merge rank 0.*shard-r0000-00000.dfc: [0-9]+ bytes, .*rank-0000.json says" "$D" "${EX[@]}" --rank 1 --out "$W/m3"
[ ! -e "$W/m3/manifest.json" ] || fail "a manifest was written over a truncated shard"
# rank 0's rank file lost: rank 1 finishes, the manifest waits; rerunning rank 0 completes it
run 0 "48 docs" "$D" "${EX[@]}" --rank 0 --out "$W/m4"
rm "$W/m4/rank-0000.json"
run 0 "" env DFLASH_LOG=info "$D" "${EX[@]}" --rank 1 --out "$W/m4"
grep -q "rank 0 of 2 has not finished" "$W/out" || fail "rank 1 did not say the manifest waits for rank 0"
run 1 "unfinished" "$D" dump "$W/m4"
run 0 "0 docs \(48 already there" "$D" "${EX[@]}" --rank 0 --out "$W/m4"
run 0 "OK: 96 samples" "$D" dump "$W/m4" --verify

# --- 4. writes
run 0 "" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/ext3" --layers 0,1,2 --quiet
run 0 "" "$D" cache project "$W/ext3" "$W/pj" --rank 8 --device cpu
# an EIO on the directory fsync after manifest.json's rename: exit 1, no manifest; a rerun finishes
run 1 "manifest.json not published \(removed again\).*Input/output error" env DFLASH_FAULT=cache-final-dirsync=EIO "$D" "${SYNTH[@]}" --out "$W/eio"
[ ! -e "$W/eio/manifest.json" ] || fail "a failed final fsync left manifest.json"
run 1 "unfinished" "$D" dump "$W/eio"
run 0 "0 samples \(48 resumed\)" "$D" "${SYNTH[@]}" --out "$W/eio"
run 0 "OK: 48 samples" "$D" dump "$W/eio" --verify
# a write of shard 1 fails and its completion is reaped just before the shard's publish (was:
# published as .dfc anyway, about 1 run in 5 under ulimit -f with --threads 2; the rerun could
# not resume): exit 1 naming the partial shard, no .dfc of it; the rerun resumes shard 0
run 1 "shard-r0000-00001.dfc.partial: write of sample .* failed: Input/output error" env DFLASH_FAULT=cache-shard-write=EIO "$D" "${SYNTH[@]}" --out "$W/wfail"
[ -e "$W/wfail/shard-r0000-00000.dfc" ] || fail "shard 0, written before the failure, was not published"
[ ! -e "$W/wfail/shard-r0000-00001.dfc" ] || fail "shard 1, whose write failed, was published"
[ ! -e "$W/wfail/manifest.json" ] || fail "a run whose write failed wrote manifest.json"
run 0 "\([1-9][0-9]* resumed\)" "$D" "${SYNTH[@]}" --out "$W/wfail"
run 0 "OK: 48 samples" "$D" dump "$W/wfail" --verify
# writes past RLIMIT_FSIZE with two encoder threads, ten times: a rerun always resumes to a
# cache that verifies (was: 1 run in 4-5 left a published shard the rerun could not take)
for i in $(seq 10); do
  rm -rf "$W/fsz"
  bash -c 'trap "" XFSZ; ulimit -f 256; exec "$@" >/dev/null 2>&1' _ "$D" "${SYNTH[@]}" --out "$W/fsz"
  run 0 "" "$D" "${SYNTH[@]}" --out "$W/fsz"
  run 0 "OK: 48 samples" "$D" dump "$W/fsz" --verify
done
# an empty corpus: an empty cache that verifies (was: UBSan, a memcpy from a NULL shard list)
: >"$W/empty.jsonl"
run 0 "0 docs" "$D" extract --device cpu --model "$TM" --data "$W/empty.jsonl" --out "$W/emptyc" --quiet
run 0 "OK: 0 samples" "$D" dump "$W/emptyc" --verify
# --out into a directory that is not a cache of this corpus: refused, nothing written there
cp -r "$TM" "$W/model"
ls -A "$W/model" >"$W/model.ls"
run 1 "model: not empty \(holds .*not a dflash cache" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/model" --quiet
[ "$(ls -A "$W/model")" = "$(cat "$W/model.ls")" ] || fail "a refused extract --out left files in the model folder"
mkdir -p "$W/notes" && echo hi >"$W/notes/README"
run 1 "notes: not empty \(holds README\)" "$D" "${SYNTH[@]}" --out "$W/notes"
# commands that put basis.dfb into OUT before the cache: a refused folder gets nothing
run 1 "notes: not empty \(holds README\)" "$D" cache project "$W/ext3" "$W/notes" --rank 8 --device cpu
run 1 "model: not empty" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --layers 0,1,2 --basis "$W/pj/basis.dfb" --out "$W/model" --quiet
[ "$(ls -A "$W/notes")" = README ] || fail "a refused cache project left files in $W/notes"
[ "$(ls -A "$W/model")" = "$(cat "$W/model.ls")" ] || fail "a refused extract --basis left files in the model folder"
# an unfinished cache of another corpus: refused by the resume check (naming the difference)
run 0 "docs" "$D" extract --device cpu --model "$TM" --data "$TM/eval.jsonl" --world-size 2 --rank 0 --quiet --out "$W/other"
run 1 "other: cannot resume.*corpus" "$D" "${EX[@]}" --rank 1 --out "$W/other"
# an empty existing directory is fine, and so is resuming the same cache (m4 above, eio here)
mkdir -p "$W/empty"
run 0 "wrote" "$D" "${SYNTH[@]}" --out "$W/empty"
# ENOSPC on train's log.jsonl stops the run, naming the file and the step (the fault fails every
# line: the first is the run line of step 0)
TA=(train --cache "$W/ext3" --target "$TM" --steps 10 --mask-token 1 --block-size 8 --max-tokens 512 --max-anchors 32 --lr 3e-3 --log-every 5 --ckpt-every 5 --quiet --device cpu)
run 1 "runF/log.jsonl: writing the line of step 0 failed: No space left on device" env DFLASH_FAULT=log-write=ENOSPC "$D" "${TA[@]}" --out "$W/runF"
[ ! -e "$W/runF/export" ] || fail "a run whose log failed exported"
printf '{"step":0,"loss":1.2' >>"$W/runF/log.jsonl"   # a line cut short by a failed write
run 0 "" "$D" "${TA[@]}" --out "$W/runF"
[ "$(grep -c '"loss"' "$W/runF/log.jsonl")" = 2 ] || fail "resumed run's log does not hold steps 5 and 10 once each"
grep -q '"loss":1.2{' "$W/runF/log.jsonl" && fail "the resumed log kept a torn line"
# mid-run: after a checkpoint at step 5 the resume's first line fails; the checkpoint stands
run 0 "" "$D" "${TA[@]}" --out "$W/runG" --stop-after 5
run 1 "runG/log.jsonl: writing the line of step 5 failed: No space left on device" env DFLASH_FAULT=log-write=ENOSPC "$D" "${TA[@]}" --out "$W/runG"
run 0 "" "$D" "${TA[@]}" --out "$W/runG"
cmp -s "$W/runF/export/model.safetensors" "$W/runG/export/model.safetensors" || fail "the run resumed after a failed log write differs"

# --- 1. the manifest's parameters are checksummed: an edit names the file and the field
# edit NAME SED: a copy of the cache with manifest.json edited by SED
edit() { rm -rf "$W/$1" && cp -r "$W/cache" "$W/$1" && sed -i "$2" "$W/$1/manifest.json"; }
edit lay1 's/"layers":\t\[1, 2, 3\]/"layers":\t[1, 2, 4]/'
run 1 "lay1/manifest.json: \"layers\" does not match its checksum" "$D" dump "$W/lay1" --verify
edit lay2 's/"layers":\t\[1, 2, 3\]/"layers":\t[1, 3, 2]/'
run 1 "lay2/manifest.json: \"layers\" does not match its checksum" "$D" dump "$W/lay2" --verify
run 1 "lay2/manifest.json: \"layers\"" "$D" cache read "$W/lay2"
edit voc 's/"vocab_size":\t151936/"vocab_size":\t151937/'
run 1 "voc/manifest.json: \"target.vocab_size\" does not match" "$D" dump "$W/voc" --verify
edit lvl 's/"codec_level":\t0/"codec_level":\t3/'
run 1 "lvl/manifest.json: \"codec_level\" does not match" "$D" dump "$W/lvl"
edit fp 's/"fingerprint":\t"[0-9a-f]/"fingerprint":\t"z/'
run 1 "fp/manifest.json: \"corpus.fingerprint\" does not match" "$D" dump "$W/fp"
edit tot 's/"raw_bytes":\t\([0-9]*\)/"raw_bytes":\t1\1/'
run 1 "tot/manifest.json: \"totals\" does not match" "$D" dump "$W/tot"
edit tl 's/"num_hidden_layers":\t6/"num_hidden_layers":\t7/'
run 1 "tl/manifest.json: \"target.num_hidden_layers\" does not match" "$D" dump "$W/tl"
# a different spelling of the same values is no edit
edit same 's/"layers":\t\[1, 2, 3\]/"layers": [1,2,3.0]/'
run 0 "OK: 48 samples" "$D" dump "$W/same" --verify
# meta.json too: resuming over an edited meta.json is refused by field
rm -rf "$W/metaed" && cp -r "$W/eio" "$W/metaed" && rm "$W/metaed/manifest.json"
sed -i 's/"layers":\t\[1, 2, 3\]/"layers":\t[1, 2, 4]/' "$W/metaed/meta.json"
run 1 "metaed/meta.json: \"layers\" does not match its checksum" "$D" "${SYNTH[@]}" --out "$W/metaed"
if command -v python3 >/dev/null; then
  # "checksums" removed and a layer edited: every shard's header holds the parameters' checksum
  rm -rf "$W/strip" && cp -r "$W/cache" "$W/strip"
  python3 - "$W/strip/manifest.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1])); del m["checksums"]; m["layers"] = [1, 2, 4]
json.dump(m, open(sys.argv[1], "w"))
PY
  run 1 "strip/shard-r0000-00000.dfc: offset 64: .*parameters" "$D" dump "$W/strip" --verify
  # a cache written before the checksums (no "checksums", 0 at shard header offsets 64..71) reads
  rm -rf "$W/old" && cp -r "$W/cache" "$W/old"
  python3 - "$W/old" <<'PY'
import glob, json, sys
d = sys.argv[1]
for f in ("manifest.json", "meta.json"):
    m = json.load(open(f"{d}/{f}")); del m["checksums"]; json.dump(m, open(f"{d}/{f}", "w"))
for f in glob.glob(f"{d}/*.dfc"):
    with open(f, "r+b") as h:
        h.seek(64); h.write(b"\0" * 8)
PY
  run 0 "OK: 48 samples" "$D" dump "$W/old" --verify
  run 0 "read .*48 samples" "$D" cache read "$W/old"
fi

echo "test_hardening_cache: $fails failure(s)"
[ "$fails" = 0 ]
