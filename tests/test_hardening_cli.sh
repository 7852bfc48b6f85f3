#!/usr/bin/env bash
# test_hardening_cli.sh DFLASH WORKDIR SRCDIR - issue 32, the CLI and training half: bad
# numeric option values (exit 2 naming option, value and range), --layers bounds, a target
# without its lm_head, resume with changed settings, two runs in one RUN. Small and fast:
# the bundled tiny target (data/tiny-qwen3), a few steps.
set -u
D=$1 W=$2 SRC=$3
rm -rf "$W" && mkdir -p "$W"
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }

# run CODE PATTERN cmd...: exit code must be CODE, stdout+stderr must match PATTERN
run() {
  local want=$1 pat=$2; shift 2
  "$@" >"$W/out" 2>&1
  local got=$?
  [ "$got" = "$want" ] || { fail "exit $got (want $want): $*"; sed 's/^/    /' "$W/out" | head -20 >&2; return; }
  [ -z "$pat" ] || grep -Eq -- "$pat" "$W/out" || { fail "output of '$*' lacks /$pat/"; sed 's/^/    /' "$W/out" | head -20 >&2; }
}

TM=$SRC/data/tiny-qwen3
run 0 "" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/ext" --layers 0,1,2 --quiet
run 0 "" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/ext2" --layers 0,1,2 --quiet
TA="--cache $W/ext --target $TM --mask-token 1 --block-size 8 --max-tokens 512 --max-anchors 32 --lr 3e-3 --log-every 5 --quiet --device cpu"

# --- 1. numeric options: every bad value is a usage error naming option, value and range
bad() { # bad OPTION VALUE PATTERN: train refuses it with exit 2
  run 2 "$1 '$2'.*$3" "$D" train $TA --steps 4 --out "$W/bad" "$1" "$2"
  [ ! -e "$W/bad" ] || fail "train $1 $2 created its --out"
}
bad --steps 2.5 "want an integer in 0\.\."
bad --steps 1e30 "want an integer"
bad --steps 12x "want an integer"
bad --seed -1 "want an integer in 0\.\.18446744073709551615"
bad --seed nan "want an integer"
bad --mask-token 1e20 "want an integer in 0\.\."
bad --threads 100000 "want an integer in 0\.\.4096"
bad --gamma nan "want a finite number"
bad --gamma inf "want a finite number"
bad --clip nan "want a finite number"
bad --lr -1 "want a finite number in"
bad --lr 1e-3x "want a finite number"
bad --keep-last -1 "want an integer in 0\.\."
bad --block-size 1000 "want an integer in 2\.\.64"
bad --max-tokens 0 "want an integer in 1\.\."
bad --warmup 2 "in \[0, 1\]"
bad --init-seed 0 "in 1\.\."
bad --world-size 0 "in 1\.\."
bad --noise nan "finite"
bad --master-port 0 "want an integer in 1\.\.65535"
bad --master-port 65536 "want an integer in 1\.\.65535"
# the TCP rendezvous's address: both options or neither; a launcher's MASTER_PORT is checked too
run 2 "--master-addr and --master-port go together" "$D" train $TA --steps 4 --out "$W/bad" --master-addr 127.0.0.1
run 2 "MASTER_PORT 'x': want an integer in 1\.\.65535" env RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 DFLASH_RUN_ID=h MASTER_ADDR=127.0.0.1 MASTER_PORT=x "$D" train $TA --steps 4 --out "$W/bad"
run 2 "MASTER_ADDR is set \(127\.0\.0\.1\) but MASTER_PORT is not" env -u MASTER_PORT RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 DFLASH_RUN_ID=h MASTER_ADDR=127.0.0.1 "$D" train $TA --steps 4 --out "$W/bad"
[ ! -e "$W/bad" ] || fail "a refused master address created --out"
run 1 "--init-seed-for: 'fc=-1' is not PREFIX=SEED" "$D" train $TA --steps 2 --out "$W/bad" --init-seed-for fc=-1
rm -rf "$W/bad"
run 2 "--target-layers '0,1,': want ids" "$D" train $TA --steps 4 --out "$W/bad" --target-layers 0,1,
# 1e1 is an integer written as a float: accepted
run 0 "" "$D" train $TA --steps 1e1 --out "$W/r1e1" --no-ckpt
# other commands: the same parser
run 2 "--threads '-3'" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/bad" --threads -3
run 2 "--max-len '2.5'" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/bad" --max-len 2.5
run 2 "--step '1.5'" "$D" export --run "$W/r1e1" --step 1.5 --out "$W/bad"
run 2 "--tol 'nan'" "$D" cache diff "$W/ext" "$W/ext" --tol nan
run 2 "--limit '-1'" "$D" dump "$W/ext" --samples --limit -1
run 2 "--vocab '1e99'" "$D" corpus import --vocab 1e99 --out "$W/bad.dtok" "$TM/corpus.jsonl"
run 2 "--threads '1e9': want an integer in 0\.\.4096" "$D" cache read "$W/ext" --threads 1e9
run 2 "--seed 'nan'" "$D" cache synth --out "$W/bad" --hidden 64 --seed nan
run 2 "--layers '2.5'" "$D" cache plan --hidden 64 --layers 2.5 --tokens 10
run 2 "--threads '-1'" "$D" cache project "$W/ext" "$W/bad" --rank 4 --threads -1
run 2 "--energy 'inf'" "$D" cache project "$W/ext" "$W/bad" --energy inf
run 2 "--batch-tokens '0'" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/bad" --batch-tokens 0
# nonsense that parses: a row shorter than one block, more rows per step than memory holds
run 1 "--max-tokens 8: a row must hold at least one block of 8.*give --max-tokens 9" "$D" train $TA --steps 2 --out "$W/bad" --max-tokens 8
run 1 "--rows-per-step 65536: the rows' buffers need .* GiB.*give --rows-per-step [0-9]+ or less" "$D" train ${TA/--max-tokens 512/--max-tokens 1048576} --steps 2 --out "$W/bad" --rows-per-step 65536

# --- 2. --layers: bounded where it enters (was: 100000 a segfault, 5000 a hang)
run 2 "--layers '100000': want an integer in 1\.\.1024" "$D" train $TA --steps 2 --out "$W/bad" --layers 100000
run 2 "--layers '5000'" "$D" train $TA --steps 2 --out "$W/bad" --layers 5000
run 2 "--layers '0'" "$D" train $TA --steps 2 --out "$W/bad" --layers 0
run 1 "--layer-types .* 3 of them" "$D" train $TA --steps 2 --out "$W/bad" --layers 3 --layer-types full,full,full,full

# --- 3. a target without lm_head.weight and tie_word_embeddings false: an error naming it
# (the tensor renamed in the safetensors header, same length: the offsets stay right)
if command -v perl >/dev/null; then
  mkdir -p "$W/nohead"
  cp "$TM"/config.json "$W/nohead/"
  perl -0777 -pe 's/"lm_head\.weight"/"lm_head.unused"/' "$TM/model.safetensors" >"$W/nohead/model.safetensors"
  run 1 "lm_head.weight is missing.*tie_word_embeddings false" "$D" train ${TA/--target $TM/--target $W\/nohead} --steps 2 --out "$W/bad"
else
  echo "perl not found: the missing lm_head check skipped" >&2
fi

# --- 4. resume with changed settings: refused naming each with both values; a longer --steps
# extends the run (said); threads, cadence, --quiet may change; an old checkpoint without
# settings resumes with a warning
TS="$TA --ckpt-every 3 --keep-last 0"
run 0 "" "$D" train $TS --steps 6 --out "$W/rs" --stop-after 3
run 1 "other settings: --lr 0.003 \(now 0.001\)" "$D" train ${TS/--lr 3e-3/--lr 1e-3} --steps 6 --out "$W/rs"
run 1 "--seed 1 \(now 2\)" "$D" train $TS --steps 6 --out "$W/rs" --seed 2
run 1 "--max-anchors 32 \(now 16\)" "$D" train ${TS/--max-anchors 32/--max-anchors 16} --steps 6 --out "$W/rs"
run 1 "--layers 1 \(now 2\)" "$D" train $TS --steps 6 --out "$W/rs" --layers 2
run 1 "--gamma 7 \(now 4\)" "$D" train $TS --steps 6 --out "$W/rs" --gamma 4
run 1 "--clip 1 \(now 0.5\)" "$D" train $TS --steps 6 --out "$W/rs" --clip 0.5
run 1 "--steps 6 \(now 5\)" "$D" train $TS --steps 5 --out "$W/rs"
run 1 "--warmup 0.04 \(now 0.1\).*--init-seed 1 \(now 9\)" "$D" train $TS --steps 6 --out "$W/rs" --warmup 0.1 --init-seed 9
run 1 "--cache uuid" "$D" train ${TS/--cache $W\/ext/--cache $W\/ext2} --steps 6 --out "$W/rs"
[ "$(ls -d "$W"/rs/ckpt-* | wc -l)" = 1 ] || fail "a refused resume wrote a checkpoint"
# what does not change the math may change; --steps may grow
run 0 "" "$D" train $TS --steps 6 --out "$W/rs" --stop-after 5 --threads 1 --log-every 1
run 0 "--steps extended from 6 to 9" "$D" train ${TS/--quiet/} --steps 9 --out "$W/rs"
grep -q '"--steps":[[:space:]]*9' "$W/rs/ckpt-0000000009/hparams.json" || fail "the extended --steps was not recorded"
run 1 "--steps 9 \(now 6\)" "$D" train $TS --steps 6 --out "$W/rs"
# an old checkpoint: hparams.json empty (its manifest and COMPLETE made to match)
run 0 "" "$D" train $TS --steps 6 --out "$W/ro" --stop-after 3
ck=$W/ro/ckpt-0000000003
: >"$ck/hparams.json"
sed -i -E 's/("hparams_sha256":[[:space:]]*")[0-9a-f]+/\1e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855/; s/("hparams_bytes":[[:space:]]*)[0-9]+/\10/' "$ck/manifest.json"
sed -i -E "s/^manifest.json sha256 .*/manifest.json sha256 $(sha256sum "$ck/manifest.json" | cut -d' ' -f1)/" "$ck/COMPLETE"
run 0 "written before runs recorded their settings" "$D" train $TS --steps 6 --out "$W/ro" --lr 1e-3
grep -q '"--lr":[[:space:]]*0.001' "$W/ro/ckpt-0000000006/hparams.json" || fail "the old run's resume did not record its settings"

# --- 5. one train per RUN: a second one exits 1 naming the first's pid
"$D" train $TA --steps 100000 --out "$W/rl" >/dev/null 2>&1 &
lpid=$!
for _ in $(seq 4000); do [ "$(cat "$W/rl/.lock" 2>/dev/null)" = "$lpid" ] && break; sleep 0.005; done
run 1 "in use by another train \(pid $lpid" "$D" train $TA --steps 4 --out "$W/rl"
kill $lpid 2>/dev/null; wait $lpid 2>/dev/null
run 0 "" "$D" train $TA --steps 4 --out "$W/rl"   # a lock left by a killed run is no lock

# --- 6. ranks that do not make a world: refused (were: one process training alone, exit 0)
run 2 "--rank 1 out of range for --world-size 1" "$D" train $TA --steps 2 --out "$W/bad" --rank 1 --world-size 1
run 2 "RANK 3 out of range for WORLD_SIZE 2" env RANK=3 WORLD_SIZE=2 LOCAL_RANK=0 "$D" train $TA --steps 2 --out "$W/bad"
run 2 "LOCAL_RANK is not set" env -u LOCAL_RANK RANK=1 WORLD_SIZE=2 "$D" train $TA --steps 2 --out "$W/bad"
run 2 "RANK 'x'" env RANK=x WORLD_SIZE=2 LOCAL_RANK=0 "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/bad" --quiet
run 2 "SLURM_PROCID 2 out of range for SLURM_NTASKS 2" env -u RANK -u WORLD_SIZE SLURM_PROCID=2 SLURM_NTASKS=2 SLURM_LOCALID=0 "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/bad" --quiet

# --- 6a. flags that ask for opposite things: refused (was: the last one won)
run 2 "--recompute and --no-recompute ask for opposite things" "$D" train $TA --steps 2 --out "$W/bad" --recompute --no-recompute
run 2 "--recompute-mlp and --no-recompute" "$D" train $TA --steps 2 --out "$W/bad" --no-recompute --recompute-mlp
run 2 "--overlap-optimizer and --no-overlap-optimizer" "$D" train $TA --steps 2 --out "$W/bad" --overlap-optimizer --no-overlap-optimizer
run 2 "--fp8 and --no-fp8" "$D" train $TA --steps 2 --out "$W/bad" --fp8 --no-fp8
run 2 "--target and --random-target: give one" "$D" train $TA --steps 2 --out "$W/bad" --random-target "$TM/config.json"
run 2 "--device cpu with --gpus: give one" "$D" train $TA --steps 2 --out "$W/bad" --gpus 2

# --- 6b. layer lists: each layer once, in increasing order (serving engines hand the drafter
# the target's layers in layer order; was: 2,1 kept as given and exported so)
run 2 "--layers '2,1': list each layer once, in increasing order" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/bad" --layers 2,1 --quiet
run 2 "--layers '1,1': list each layer once" "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/bad" --layers 1,1 --quiet
run 2 "--target-layers '2,0': list each layer once, in increasing order" "$D" train $TA --steps 2 --out "$W/bad" --target-layers 2,0

# --- 7. a FIFO where train's log.jsonl belongs: refused naming it (the model's and the corpus'
# FIFOs: test_hardening_cache.sh)
mkdir -p "$W/rf" && mkfifo "$W/rf/log.jsonl"
run 1 "log.jsonl: a FIFO" timeout 20 "$D" train $TA --steps 2 --out "$W/rf"

[ "$fails" = 0 ] && echo "test_hardening_cli: all passed" || echo "test_hardening_cli: $fails failed"
[ "$fails" = 0 ]
