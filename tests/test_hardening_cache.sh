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
# (the bug some of these guard against) is a failure after 60 s, not a stuck ctest.
run() {
  local want=$1 pat=$2; shift 2
  timeout 60 "$@" >"$W/out" 2>&1
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

# --- 5. token ids past the vocabulary: dump --verify and cache read name sample and position
# (cache synth takes a corpus' ids as they are; its caches say vocab 151936)
printf '{"input_ids":[1,2,3,160000,5]}\n{"input_ids":[7,8]}\n' >"$W/big.jsonl"
run 0 "" "$D" corpus import --vocab 200000 --out "$W/big.dtok" "$W/big.jsonl"
run 0 "wrote" "$D" cache synth --corpus "$W/big.dtok" --hidden 64 --target-layers 6 --layers 3 --out "$W/bigvocab"
run 1 "sample 0 position 3: token id 160000 out of range \(vocab 151936\)" "$D" dump "$W/bigvocab" --verify
run 1 "sample 0 position 3: token id 160000 out of range" "$D" cache read "$W/bigvocab"
run 1 "sample 0 position 3: token id 160000" "$D" dump "$W/bigvocab" --sample 0 --layer 1

echo "test_hardening_cache: $fails failure(s)"
[ "$fails" = 0 ]
