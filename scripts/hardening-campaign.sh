#!/usr/bin/env bash
# hardening-campaign.sh BUILD_DIR [ASAN_BUILD_DIR] [WORK_DIR] - issue 32's four campaigns, rerun:
#   1 cache   damaged caches (bit flips, truncations, zeroed ranges, appended bytes, edited JSON
#             fields, deleted/replaced files, FIFOs, directories) -> dump --verify, cache read,
#             a short train;
#   2 input   malformed JSONL, ids past the vocabulary, empty corpora, broken config.json and
#             safetensors -> corpus import, extract, train;
#   3 cli     bad option values for every command (non-numbers, nan, inf, negative, huge,
#             fractions for integers, empty, missing), unknown options, missing arguments;
#   4 faults  DFLASH_FAULT (log-write, cache-final-dirsync), RLIMIT_FSIZE (write() fails with
#             EFBIG at a chosen size), kill -9 during extract / synth / train, each followed by
#             a rerun that must end on the clean run's bits.
# Deterministic: fixed seed (DFLASH_CAMPAIGN_SEED, default 32); each command runs under
# `timeout` (DFLASH_CAMPAIGN_TIMEOUT, default 20 s). Outcomes:
#   clean      nonzero exit, a message on stderr, no signal, no sanitizer report
#   accepted   exit 0 where that is right: the damaged cache decodes bit-identical to the
#              original (cache diff), or a result equal to the clean run's
#   unclass    exit 0 that the script cannot judge (listed in findings.txt)
#   crash      a signal (exit >= 128 but not the timeout) or a sanitizer report
#   hang       the timeout
#   silent     exit 0 where the case must fail, or a rerun ending on other bits
#   other      nonzero exit where the case must succeed, or no message on stderr
# One table per build; every non-clean case (command, exit, stderr) goes to WORK_DIR/findings.txt
# (WORK_DIR/BUILD-LABEL/findings.txt per build, concatenated in WORK_DIR/findings.txt).
# CAMPAIGNS="1 2 3 4" selects campaigns (e.g. a subset for the ASan build); QUICK=N keeps every
# Nth case of campaigns 1 and 2's generated damage (1: all).
set -u
[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR [ASAN_BUILD_DIR] [WORK_DIR]" >&2; exit 2; }
SRC=$(cd "$(dirname "$0")/.." && pwd)
TM=$SRC/data/tiny-qwen3
PY=$(python3 -c 'import sys; print(sys.executable)')   # the interpreter itself: no shim per call
H="$PY $SRC/scripts/campaign_helper.py"
SEED=${DFLASH_CAMPAIGN_SEED:-32}
TO=${DFLASH_CAMPAIGN_TIMEOUT:-20}
CAMPAIGNS=${CAMPAIGNS:-1 2 3 4}
QUICK=${QUICK:-1}
QN=0
skip() { QN=$((QN + 1)); [ $((QN % QUICK)) != 0 ]; }   # true: leave this case out
BUILDS=("$1")
[ -n "${2:-}" ] && BUILDS+=("$2")
WROOT=${3:-/tmp/dflash-campaign}
mkdir -p "$WROOT" && WROOT=$(cd "$WROOT" && pwd)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
unset DFLASH_FAULT

find_bin() { for c in "$1/dflash" "$1/cli/dflash"; do [ -x "$c" ] && { echo "$c"; return; }; done; find "$1" -name dflash -type f -perm -u+x | head -1; }

CLASSES="clean accepted unclass crash hang silent other"
declare -A CNT

# record CAMP CLASS DESC [ERRFILE]
record() {
  local camp=$1 cls=$2 desc=$3 ef=${4:-}
  CNT[$camp,tried]=$((${CNT[$camp,tried]:-0} + 1))
  CNT[$camp,$cls]=$((${CNT[$camp,$cls]:-0} + 1))
  if [ "$cls" != clean ]; then
    { echo "[$camp] $cls: $desc"
      [ "$cls" != accepted ] && [ -n "$ef" ] && [ -s "$ef" ] && head -c 3000 "$ef" | sed 's/^/    /'
      echo; } >>"$F"
  fi
}

# classify RC ERRFILE -> echoes hang|crash|fail|nomsg|ok
classify() {
  local rc=$1 ef=$2
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo hang
  elif grep -Eq "ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer|Sanitizer:DEADLYSIGNAL" "$ef"; then echo crash
  elif [ "$rc" -ge 128 ]; then echo crash
  elif [ "$rc" != 0 ]; then [ -s "$ef" ] && echo fail || echo nomsg
  else echo ok; fi
}

# kase CAMP EXPECT CHECK cmd...: EXPECT fail (must fail) | any (exit 0 judged by CHECK: a
# command whose status 0 = accepted, 1 = silent, 2 = unclass; "-" = unclass) | ok (must
# succeed: a failure is "other"; exit 0 judged by CHECK as for any)
kase() {
  local camp=$1 exp=$2 chk=$3; shift 3
  timeout -k 5 "$TO" "$@" >"$W/o" 2>"$W/e" </dev/null
  local rc=$? cls
  cls=$(classify $rc "$W/e")
  case $cls in
    fail) [ "$exp" = ok ] && cls=other || cls=clean ;;
    nomsg) cls=other ;;
    ok)
      if [ "$exp" = fail ]; then cls=silent
      elif [ "$chk" = - ]; then cls=unclass
      else (eval "$chk") >"$W/chk" 2>&1; case $? in 0) cls=accepted ;; 1) cls=silent ;; *) cls=unclass ;; esac
      fi ;;
  esac
  record "$camp" "$cls" "exit $rc: $* ${KNOTE:-}" "$W/e"
}

h256() { sha256sum "$1" 2>/dev/null | cut -d' ' -f1; }
# same_cache DIR: 0 when DIR decodes bit-identical to the original and verifies, 1 when not
same_cache() { "$D" dump "$1" --verify >/dev/null 2>&1 && "$D" cache diff "$REF" "$1" 2>&1 | grep -q '^identical' && return 0; return 1; }
# same_json ORIG COPY: 0 when the two parse to the same values
same_json() { python3 -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))==json.load(open(sys.argv[2])) else 1)' "$1" "$2" 2>/dev/null; }

# FSZ K CMD...: CMD with RLIMIT_FSIZE K KiB (SIGXFSZ ignored: write() fails with EFBIG); its
# stderr through a pipe, which the limit does not cut short
FSZ=(bash -c 'trap "" XFSZ; ( ulimit -f "$0"; exec "$@" 2>&1 >/dev/null ) | cat >&2; exit ${PIPESTATUS[0]}')
TA=(--target "$TM" --mask-token 1 --block-size 8 --max-tokens 512 --max-anchors 32 --steps 6 --device cpu --quiet --threads 2)
# run_hash RUN: the final checkpoint's state and the export
run_hash() { cat "$1"/ckpt-0000000006/state.safetensors "$1"/export/model.safetensors 2>/dev/null | sha256sum | cut -d' ' -f1; }

############################################################################ campaign 1
campaign1() {
  local c=1 f sz offs o b i n=0 dmg chk
  REF=$W/ext
  TRAIN_REF=$(run_hash "$W/run-ref")
  # one_cache NAME SETUP...: copy the reference, apply SETUP (a shell string), feed it to the readers
  one_cache() {
    local name=$1 setup=$2 kind=$3   # kind: data (judge by cache diff) | json FILE | file
    skip && return
    rm -rf "$W/c" && cp -r "$REF" "$W/c" && (cd "$W/c" && eval "$setup") >/dev/null 2>&1
    local chk="same_cache $W/c"
    if [ "$kind" = cosmetic ]; then chk="same_cache $W/c"   # e.g. created_by, meta.json: no reader uses it
    elif [ "${kind%% *}" = json ]; then
      local jf=${kind#json }
      # a JSON edit read back as exit 0: accepted when the values are the same; else unclass
      # unless the field is covered by the manifest's checksums (then silent)
      chk="{ same_cache $W/c || exit 1; same_json $REF/$jf $W/c/$jf && exit 0; [ -n \"\$KCOV\" ] && exit 1; exit 2; }"
      chk="( $chk )"
    fi
    KNOTE="[$name]" kase $c any "$chk" "$D" dump "$W/c" --verify
    KNOTE="[$name]" kase $c any "$chk" "$D" cache read "$W/c"
    n=$((n + 1))
    if [ $((n % 4)) = 0 ]; then
      # exit 0 is right when the run is the clean one (a 6-step run reads a part of the
      # samples; damage elsewhere does not reach it)
      rm -rf "$W/rt"
      KNOTE="[$name]" kase $c any "[ \"\$(run_hash $W/rt)\" = $TRAIN_REF ]" "$D" train --cache "$W/c" "${TA[@]}" --out "$W/rt"
    fi
  }
  KCOV=
  # bit flips, truncations, zeroed ranges, appended bytes in the shard and its index
  for f in shard-r0000-00000.dfc shard-r0000-00000.dfi; do
    sz=$(stat -c %s "$REF/$f")
    for o in $($H offsets $((SEED + ${#f})) 40 "$sz"); do
      one_cache "$f flip ${o%:*} bit ${o#*:}" "$H flip $f ${o%:*} ${o#*:}" data
    done
    for b in 0 1 8 63 64 4095 4096 $((sz / 2)) $((sz - 4096)) $((sz - 1)); do
      [ "$b" -ge 0 ] && [ "$b" -lt "$sz" ] && one_cache "$f truncated to $b" "$H trunc $f $b" data
    done
    for b in 0:64 0:4096 64:8 $((sz / 3)):4096 $((sz - 4096)):4096 $((sz - 8)):8; do
      one_cache "$f zeroed ${b%:*}+${b#*:}" "$H zero $f ${b%:*} ${b#*:}" data
    done
    one_cache "$f +1 byte" "$H append $f 1" data
    one_cache "$f +4096 bytes" "$H append $f 4096" data
  done
  # JSON fields: every leaf of manifest.json and meta.json, several edits each
  local jf p op ops
  for jf in manifest.json meta.json; do
    i=0
    while read -r p; do
      i=$((i + 1))
      case $((i % 3)) in 0) ops="inc del" ;; 1) ops="inc null" ;; *) ops="zero str" ;; esac
      case $p in checksums.*) ops=inc ;; esac
      for op in $ops; do
        KCOV=
        [ "$jf" = manifest.json ] && grep -q "\"${p%%.[0-9]*}\":" <(sed -n '/"checksums"/,/}/p' "$REF/manifest.json") && KCOV=1
        case $p in shards.*|totals*|layers*|target.*|corpus.*) KCOV=1 ;; created_by|checksums*) KCOV= ;; esac
        local kind="json $jf"; [ "$p" = created_by ] && kind=cosmetic
        # meta.json is the writer's record for a resume: no reader of a finished cache opens
        # it, so exit 0 with the same samples is right (resumes are campaign 4's)
        [ "$jf" = meta.json ] && kind=cosmetic
        one_cache "$jf $p $op" "$H jsonedit $jf $p $op" "$kind"
      done
    done < <($H jsonpaths "$REF/$jf")
    KCOV=1
    local fk="json $jf"; [ "$jf" = meta.json ] && fk=cosmetic
    for b in 0 1 $(($(stat -c %s "$REF/$jf") / 2)); do one_cache "$jf truncated to $b" "$H trunc $jf $b" "$fk"; done
    for o in $($H offsets $((SEED + 7)) 12 "$(stat -c %s "$REF/$jf")"); do
      one_cache "$jf flip ${o%:*} bit ${o#*:}" "$H flip $jf ${o%:*} ${o#*:}" "$fk"
    done
  done
  KCOV=
  # whole files: deleted, emptied, a directory, a FIFO, a symlink to /dev/zero or elsewhere
  for f in manifest.json meta.json rank-0000.json shard-r0000-00000.dfc shard-r0000-00000.dfi; do
    local kind=data
    case $f in rank-*) kind=data ;; esac
    one_cache "$f deleted" "rm -f $f" $kind
    one_cache "$f emptied" ": >$f" $kind
    one_cache "$f a directory" "rm -f $f && mkdir $f" $kind
    one_cache "$f a FIFO" "rm -f $f && mkfifo $f" $kind
    one_cache "$f -> /dev/zero" "rm -f $f && ln -s /dev/zero $f" $kind
    one_cache "$f -> dangling" "rm -f $f && ln -s /nonexistent/x $f" $kind
  done
  one_cache "shard from the synth cache" "cp $W/syn/shard-r0000-00000.dfc shard-r0000-00000.dfc" data
  one_cache "index from the synth cache" "cp $W/syn/shard-r0000-00000.dfi shard-r0000-00000.dfi" data
  one_cache "manifest from ext2 (other uuid)" "cp $W/ext2/manifest.json manifest.json" data
  one_cache "shard+index from ext2" "cp $W/ext2/shard-r0000-00000.df? ." data
  one_cache "extra file" "echo x >stray.dfc" data
  # the synth cache: five shards
  REF=$W/syn
  for o in $($H offsets $((SEED + 99)) 16 1000000); do
    local s=$(( ${o%:*} % 5 ))
    one_cache "synth shard $s flip ${o%:*}" "$H flip shard-r0000-0000$s.dfc ${o%:*} ${o#*:}" data
  done
  one_cache "synth shard 2 deleted" "rm shard-r0000-00002.dfc" data
  one_cache "synth shards 1,3 swapped" "mv shard-r0000-00001.dfc t && mv shard-r0000-00003.dfc shard-r0000-00001.dfc && mv t shard-r0000-00003.dfc" data
  one_cache "synth index 4 -> index 0" "cp shard-r0000-00000.dfi shard-r0000-00004.dfi" data
  REF=$W/ext
}

############################################################################ campaign 2
campaign2() {
  local c=2 i name body exp
  # JSONL cases: NAME EXPECT BODY (printf format). EXPECT any: exit 0 is accepted when the
  # import's fingerprint equals the canonical two-doc corpus' ([1,2,3] and [4,5]).
  local good='{"input_ids":[1,2,3]}\n{"input_ids":[4,5]}\n'
  printf "$good" >"$W/good.jsonl"
  "$D" corpus import --vocab 512 --out "$W/good.dtok" "$W/good.jsonl" >"$W/good.out" 2>&1
  local gfp; gfp=$(grep -o 'fingerprint: [0-9a-f]*' "$W/good.out")
  local -a J=(
    "not-json fail" 'hello\n'
    "truncated-line fail" '{"input_ids":[1,2,3]}\n{"input_ids":[4,5\n'
    "truncated-no-nl fail" '{"input_ids":[1,2,3]}\n{"input_ids":[4,'
    "ids-string fail" '{"input_ids":"1,2,3"}\n'
    "ids-object fail" '{"input_ids":{"a":1}}\n'
    "ids-nested fail" '{"input_ids":[[1,2],[3]]}\n'
    "ids-float fail" '{"input_ids":[1.5,2]}\n'
    "ids-negative fail" '{"input_ids":[-1,2]}\n'
    "ids-huge fail" '{"input_ids":[99999999999999999999,2]}\n'
    "ids-2^32 fail" '{"input_ids":[4294967296]}\n'
    "ids-past-vocab fail" '{"input_ids":[1,512]}\n'
    "ids-past-vocab-big fail" '{"input_ids":[1,100000]}\n'
    "ids-null fail" '{"input_ids":[1,null]}\n'
    "ids-bool fail" '{"input_ids":[true]}\n'
    "ids-string-elem fail" '{"input_ids":["1"]}\n'
    "ids-nan fail" '{"input_ids":[NaN]}\n'
    "ids-1e2 any" '{"input_ids":[1,2,3]}\n{"input_ids":[4,5]}\n'
    "no-ids fail" '{"tokens":[1,2]}\n'
    "array-line fail" '[1,2,3]\n'
    "number-line fail" '42\n'
    "trailing-garbage fail" '{"input_ids":[1,2,3]} x\n'
    "two-objects-one-line fail" '{"input_ids":[1]}{"input_ids":[2]}\n'
    "nul-byte fail" '{"input_ids":[1,\0002]}\n'
    "binary fail" '\377\376\375\374\n'
    "mask-short fail" '{"input_ids":[1,2,3],"loss_mask":[1]}\n'
    "mask-long fail" '{"input_ids":[1,2],"loss_mask":[1,1,1]}\n'
    "mask-values fail" '{"input_ids":[1,2],"loss_mask":[2,-1]}\n'
    "mask-string fail" '{"input_ids":[1,2],"loss_mask":"11"}\n'
    "dup-key any" '{"input_ids":[9],"input_ids":[1,2,3]}\n{"input_ids":[4,5]}\n'
    "crlf any" '{"input_ids":[1,2,3]}\r\n{"input_ids":[4,5]}\r\n'
    "blank-lines any" '\n{"input_ids":[1,2,3]}\n\n\n{"input_ids":[4,5]}\n\n'
    "spaces any" '  { "input_ids" : [ 1 , 2 , 3 ] }  \n{"input_ids":[4,5]}\n'
    "extra-keys any" '{"input_ids":[1,2,3],"x":{"y":[1]}}\n{"input_ids":[4,5],"z":null}\n'
    "bom any" '\357\273\277{"input_ids":[1,2,3]}\n{"input_ids":[4,5]}\n'
    "no-final-nl any" '{"input_ids":[1,2,3]}\n{"input_ids":[4,5]}'
    "empty-file any" ''
    "only-blank any" '\n\n\n'
    "empty-doc any" '{"input_ids":[]}\n'
    "deep-nesting fail" '{"input_ids":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}\n'
    "unterminated-string fail" '{"input_ids":[1],"x":"abc\n'
    "bad-escape fail" '{"input_ids":[1],"x":"\\uZZZZ"}\n'
  )
  # a long line and a deeply nested document
  python3 -c 'import sys; sys.stdout.write("{\"input_ids\":[" + ",".join(["7"]*300000) + "]}\n")' >"$W/long.jsonl"
  python3 -c 'import sys; sys.stdout.write("{\"x\":" + "["*100000 + "]"*100000 + ",\"input_ids\":[1]}\n")' >"$W/deep.jsonl"
  for ((i = 0; i < ${#J[@]}; i += 2)); do
    name=${J[i]% *} exp=${J[i]#* }
    printf "${J[i+1]}" >"$W/in-$name.jsonl"
  done
  for ((i = 0; i < ${#J[@]}; i += 2)); do
    name=${J[i]% *} exp=${J[i]#* }
    local jf=$W/in-$name.jsonl chk=-
    # accepted: the import equals the canonical corpus
    [ "$exp" = any ] && chk="grep -q '$gfp' $W/o && exit 0; exit 2"
    case $name in empty-file|only-blank|empty-doc) chk="grep -Eq 'imported 0 docs' $W/o && exit 0; exit 2" ;; esac
    rm -f "$W/x.dtok"
    KNOTE="[$name]" kase $c $exp "$chk" "$D" corpus import --vocab 512 --out "$W/x.dtok" "$jf"
    rm -rf "$W/xe"
    local echk=-
    [ "$exp" = any ] && echk="exit 2"
    KNOTE="[$name]" kase $c $exp "$echk" "$D" extract --device cpu --model "$TM" --data "$jf" --out "$W/xe" --layers 0,1,2 --quiet
  done
  for jf in long deep; do
    rm -f "$W/x.dtok"; KNOTE="[$jf]" kase $c any "exit 2" "$D" corpus import --vocab 512 --out "$W/x.dtok" "$W/$jf.jsonl"
    rm -rf "$W/xe"; KNOTE="[$jf]" kase $c any "exit 2" "$D" extract --device cpu --model "$TM" --data "$W/$jf.jsonl" --out "$W/xe" --layers 0,1,2 --quiet
  done
  # corpus import --vocab smaller than the ids
  KNOTE="[vocab 100 < max id]" kase $c fail - "$D" corpus import --vocab 100 --out "$W/x.dtok" "$TM/corpus.jsonl"
  # the model: config.json edits (every key: deleted, and set to 0, -1, a string, null, 1e30)
  local key op
  one_model() { # NAME SETUP EXPECT: a copy of the target, SETUP in it, extract and (every 2nd) train
    local nm=$1 setup=$2 exp=$3
    skip && return
    rm -rf "$W/m" && cp -r "$TM" "$W/m" && (cd "$W/m" && eval "$setup") >/dev/null 2>&1
    rm -rf "$W/xe"
    # exit 0: accepted when the cache equals the clean extract's; else unclass (a changed
    # model may legitimately give other states)
    KNOTE="[$nm]" kase $c $exp "$D cache diff $W/ext $W/xe | grep -q '^identical' && exit 0; exit 2" \
      "$D" extract --device cpu --model "$W/m" --data "$TM/corpus.jsonl" --out "$W/xe" --layers 0,1,2 --quiet
    MN=$((MN + 1))
    if [ $((MN % 2)) = 0 ]; then
      rm -rf "$W/rt"
      KNOTE="[$nm]" kase $c $exp "[ \"\$(run_hash $W/rt)\" = $(run_hash "$W/run-ref") ] && exit 0; exit 2" \
        "$D" train --cache "$W/ext" "${TA[@]/$TM/$W/m}" --out "$W/rt"
    fi
  }
  MN=0
  for key in $(python3 -c 'import json,sys; print(" ".join(json.load(open(sys.argv[1]))))' "$TM/config.json"); do
    for op in del zero neg str null huge; do
      one_model "config $key $op" "$H jsonedit config.json $key $op" any
    done
  done
  one_model "config.json empty" ": >config.json" fail
  one_model "config.json truncated" "$H trunc config.json 100" fail
  one_model "config.json missing" "rm config.json" fail
  one_model "config.json a list" "echo '[1,2]' >config.json" fail
  one_model "config.json a FIFO" "rm config.json && mkfifo config.json" fail
  one_model "config heads*2 (shape mismatch)" "$H jsonedit config.json num_attention_heads inc" fail
  one_model "config hidden_size+1" "$H jsonedit config.json hidden_size inc" fail
  one_model "config vocab_size+1" "$H jsonedit config.json vocab_size inc" fail
  one_model "config num_hidden_layers+1" "$H jsonedit config.json num_hidden_layers inc" fail
  one_model "config layer_types short" "$H jsonedit config.json layer_types.3 del" any
  # safetensors
  local st=model.safetensors ssz t
  ssz=$(stat -c %s "$TM/$st")
  for b in 0 4 7 8 9 100 1000 $((ssz / 2)) $((ssz - 1)); do one_model "safetensors truncated to $b" "$H trunc $st $b" fail; done
  for b in 0 1 7 1000000 18446744073709551615 9223372036854775807 $((ssz)) $((ssz - 7)); do
    one_model "safetensors header length $b" "$H stedit $st hlen=$b" fail
  done
  for t in $($H stedit "$TM/$st" tensors); do
    one_model "tensor $t missing" "$H stedit $st rename=$t" any
    one_model "tensor $t dtype F64" "$H stedit $st dtype=$t:F64" fail
    one_model "tensor $t dtype XX" "$H stedit $st dtype=$t:XX" fail
    one_model "tensor $t shape+1" "$H stedit $st shape=$t" fail
    one_model "tensor $t offsets+2" "$H stedit $st offs=$t" fail
    one_model "tensor $t offsets past end" "$H stedit $st offsbig=$t" fail
    one_model "tensor $t offsets swapped" "$H stedit $st offsswap=$t" fail
  done
  for o in $($H offsets $((SEED + 5)) 16 600); do
    one_model "safetensors header flip ${o%:*} bit ${o#*:}" "$H flip $st ${o%:*} ${o#*:}" any
  done
  one_model "safetensors a FIFO" "rm $st && mkfifo $st" fail
  one_model "safetensors a directory" "rm $st && mkdir $st" fail
  one_model "safetensors missing" "rm $st" fail
  # a cache whose ids are past the target's vocabulary -> train
  printf '{"input_ids":[1,2,3,600,5,6,7,8,9,10,11,12]}\n' >"$W/v600.jsonl"
  "$D" corpus import --vocab 4096 --out "$W/v600.dtok" "$W/v600.jsonl" >/dev/null 2>&1
  rm -rf "$W/c600"; "$D" cache synth --corpus "$W/v600.dtok" --hidden 64 --target-layers 4 --layers 3 --out "$W/c600" >/dev/null 2>&1
  rm -rf "$W/rt"; KNOTE="[synth cache, id 600 vs target vocab 512]" kase $c fail - "$D" train --cache "$W/c600" "${TA[@]}" --out "$W/rt"
  # an empty corpus through extract and synth
  : >"$W/empty.jsonl"
  rm -rf "$W/xe"; KNOTE="[empty corpus]" kase $c any "exit 2" "$D" extract --device cpu --model "$TM" --data "$W/empty.jsonl" --out "$W/xe" --layers 0,1,2 --quiet
  if [ -d "$W/xe" ] && [ -e "$W/xe/manifest.json" ]; then
    rm -rf "$W/rt"; KNOTE="[train on an empty cache]" kase $c fail - "$D" train --cache "$W/xe" "${TA[@]}" --out "$W/rt"
  fi
}

############################################################################ campaign 3
campaign3() {
  local c=3 line cmd opt ty vals v
  rm -rf "$W/r3"; "$D" train --cache "$W/ext" "${TA[@]}" --out "$W/r3" >/dev/null 2>&1
  # base command lines (must succeed), by name
  declare -A BASE=(
    [import]="corpus import --vocab 512 --out $W/o3.dtok $TM/corpus.jsonl"
    [extract]="extract --device cpu --model $TM --data $TM/corpus.jsonl --out $W/o3 --layers 0,1,2 --quiet"
    [dump]="dump $W/ext --samples"
    [read]="cache read $W/ext"
    [diff]="cache diff $W/ext $W/ext"
    [synth]="cache synth --corpus $W/tiny.dtok --hidden 64 --target-layers 6 --layers 3 --out $W/o3"
    [plan]="cache plan --hidden 64 --layers 2 --tokens 10"
    [project]="cache project $W/ext $W/o3 --rank 4 --device cpu"
    [train]="train --cache $W/ext ${TA[*]} --out $W/o3"
    [export]="export --run $W/r3 --out $W/o3"
    [eval]="eval --cache $W/ext --drafter $W/r3/export --target $TM --device cpu --rows 8"
  )
  # numeric options: CMD OPTION TYPE (i integer, f float)
  local -a OPTS=(
    import:--vocab:i import:--max-len:i
    extract:--seed:i extract:--gpu:i extract:--level:i extract:--batch-tokens:i extract:--max-len:i extract:--threads:i extract:--world-size:i extract:--rank:i
    dump:--sample:i dump:--limit:i dump:--offset:i dump:--layer:i dump:--threads:i
    read:--threads:i read:--shuffle:i read:--prefetch-mb:i
    diff:--tol:f
    synth:--samples:i synth:--min-tokens:i synth:--max-tokens:i synth:--hidden:i synth:--target-layers:i synth:--layers:i synth:--level:i synth:--rows-per-block:i synth:--shard-mb:i synth:--threads:i synth:--seed:i
    plan:--hidden:i plan:--layers:i plan:--tokens:i plan:--rank-frac:f
    project:--rank:i project:--energy:f project:--sample-tokens:i project:--level:i project:--threads:i
    export:--step:i
    eval:--rows:i eval:--max-tokens:i eval:--max-anchors:i eval:--gpu:i eval:--threads:i
    train:--layers:i train:--sliding-window:i train:--intermediate:i train:--heads:i train:--kv-heads:i train:--head-dim:i
    train:--block-size:i train:--mask-token:i train:--max-tokens:i train:--max-anchors:i train:--rows-per-step:i
    train:--gamma:f train:--noise:f train:--steps:i train:--lr:f train:--min-lr:f train:--warmup:f train:--clip:f
    train:--init-std:f train:--seed:i train:--init-seed:i train:--log-every:i train:--eval-every:i train:--eval-rows:i
    train:--ckpt-every:i train:--keep-last:i train:--threads:i train:--gpu:i train:--rank:i train:--world-size:i train:--stop-after:i
  )
  local -a IV=(abc nan inf -inf 2.5 1e999 -1 99999999999999999999999 12x "" 0x10 " 1" "1,2" --)
  local -a FV=(abc nan inf -inf 1e999 -1e308 12x "" "1e" 0x1p-2x --)
  # controls: each base line must succeed, else its cases would prove nothing
  for cmd in "${!BASE[@]}"; do
    rm -rf "$W/o3" "$W/o3.dtok"
    timeout "$TO" "$D" ${BASE[$cmd]} >/dev/null 2>"$W/e" || { echo "campaign 3: base '$cmd' fails: $(head -3 "$W/e")" >>"$F"; }
  done
  for line in "${OPTS[@]}"; do
    IFS=: read -r cmd opt ty <<<"$line"
    [ "$ty" = i ] && vals=("${IV[@]}") || vals=("${FV[@]}")
    for v in "${vals[@]}"; do
      rm -rf "$W/o3" "$W/o3.dtok"
      if [ "$v" = -- ]; then  # the option last, no value
        KNOTE="[$cmd $opt missing value]" kase $c fail - "$D" ${BASE[$cmd]} "$opt"
      else
        KNOTE="[$cmd $opt '$v']" kase $c fail - "$D" ${BASE[$cmd]} "$opt" "$v"
      fi
    done
    # out of range by a little (the ranges the source names)
    case "$cmd$opt" in
      train--block-size) for v in 1 65 0; do KNOTE="[$cmd $opt $v]" kase $c fail - "$D" ${BASE[$cmd]} "$opt" "$v"; done ;;
      *--threads) rm -rf "$W/o3" "$W/o3.dtok"; KNOTE="[$cmd $opt 4097]" kase $c fail - "$D" ${BASE[$cmd]} "$opt" 4097 ;;
      *--gpu) rm -rf "$W/o3" "$W/o3.dtok"; KNOTE="[$cmd $opt 1024]" kase $c fail - "$D" ${BASE[$cmd]} "$opt" 1024 ;;
      train--warmup) KNOTE="[$cmd $opt 1.0001]" kase $c fail - "$D" ${BASE[$cmd]} "$opt" 1.0001 ;;
      train--lr|train--min-lr) KNOTE="[$cmd $opt 10.5]" kase $c fail - "$D" ${BASE[$cmd]} "$opt" 10.5 ;;
    esac
  done
  # unknown options, a stray positional, -h spelled wrong, every command; path options that
  # point nowhere; a missing required option
  for cmd in "${!BASE[@]}"; do
    rm -rf "$W/o3" "$W/o3.dtok"
    KNOTE="[$cmd unknown option]" kase $c fail - "$D" ${BASE[$cmd]} --no-such-option
    rm -rf "$W/o3" "$W/o3.dtok"
    KNOTE="[$cmd unknown option with value]" kase $c fail - "$D" ${BASE[$cmd]} --bogus 3
    rm -rf "$W/o3" "$W/o3.dtok"
    KNOTE="[$cmd stray positional]" kase $c fail - "$D" ${BASE[$cmd]} stray-arg
    KNOTE="[$cmd single dash]" kase $c fail - "$D" ${BASE[$cmd]} -x
  done
  kase $c fail - "$D"
  kase $c fail - "$D" nosuchcommand
  kase $c fail - "$D" cache
  kase $c fail - "$D" cache nosuch
  kase $c fail - "$D" corpus
  kase $c fail - "$D" corpus nosuch
  kase $c fail - "$D" dump
  kase $c fail - "$D" dump "$W/nonexistent"
  kase $c fail - "$D" cache read "$W/nonexistent"
  kase $c fail - "$D" cache read "$TM/config.json"
  kase $c fail - "$D" cache diff "$W/ext"
  kase $c fail - "$D" cache diff "$W/ext" "$W/nonexistent"
  kase $c fail - "$D" export --out "$W/o3"
  kase $c fail - "$D" export --run "$W/nonexistent" --out "$W/o3"
  kase $c fail - "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --layers 0,1,2
  kase $c fail - "$D" extract --device cpu --model "$TM" --out "$W/o3" --layers 0,1,2
  kase $c fail - "$D" extract --device cpu --data "$TM/corpus.jsonl" --out "$W/o3" --layers 0,1,2
  kase $c fail - "$D" extract --device cpu --model "$W/nonexistent" --data "$TM/corpus.jsonl" --out "$W/o3"
  kase $c fail - "$D" extract --device cpu --model "$TM" --data "$W/nonexistent.jsonl" --out "$W/o3"
  kase $c fail - "$D" extract --device nosuch --model "$TM" --data "$TM/corpus.jsonl" --out "$W/o3"
  for v in 9 -1 0,0 2,1 0,,1 a "" 4 0,1,2,3,4; do
    rm -rf "$W/o3"; KNOTE="[extract --layers '$v']" kase $c fail - "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/o3" --layers "$v" --quiet
  done
  for v in "--world-size 2 --rank 2" "--world-size 1 --rank 1" "--rank 5"; do
    rm -rf "$W/o3"; KNOTE="[extract $v]" kase $c fail - "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/o3" --quiet $v
  done
  kase $c fail - "$D" train --cache "$W/ext" "${TA[@]}"
  kase $c fail - "$D" train "${TA[@]}" --out "$W/o3"
  kase $c fail - "$D" train --cache "$W/nonexistent" "${TA[@]}" --out "$W/o3"
  kase $c fail - "$D" train --cache "$W/ext" "${TA[@]}" --out "$W/o3" --device nosuch
  for v in "--rank 1 --world-size 1" "--rank 3 --world-size 2" "--target-layers 9" "--target-layers 0,0" "--init-from $W/nonexistent" "--eval-cache $W/nonexistent --eval-every 2" "--layer-types nosuch" "--init-seed-for x" "--fc-basis $W/nonexistent"; do
    rm -rf "$W/o3"; KNOTE="[train $v]" kase $c fail - "$D" train --cache "$W/ext" "${TA[@]}" --out "$W/o3" $v
  done
  for v in "--tol -1" "--tol 1e999"; do kase $c fail - "$D" cache diff "$W/ext" "$W/ext" $v; done
  # conflicting options: either refused, or one of them wins (judged unclass when accepted)
  for v in "--recompute --no-recompute" "--no-ckpt --ckpt-every 2" "--overlap-optimizer --no-overlap-optimizer" "--best --no-best" "--steps 6 --stop-after 100"; do
    rm -rf "$W/o3"; KNOTE="[train conflicting $v]" kase $c any - "$D" train --cache "$W/ext" "${TA[@]}" --out "$W/o3" $v
  done
  rm -rf "$W/o3"; KNOTE="[project --rank and --energy]" kase $c any - "$D" cache project "$W/ext" "$W/o3" --rank 4 --energy 0.9 --device cpu
  rm -rf "$W/o3"; KNOTE="[export --step and --best]" kase $c any - "$D" export --run "$W/r3" --out "$W/o3" --step 6 --best
  rm -rf "$W/o3"; KNOTE="[export --step of no checkpoint]" kase $c fail - "$D" export --run "$W/r3" --out "$W/o3" --step 5
}

############################################################################ campaign 4
campaign4() {
  local c=4 pt er le ce k t i out
  # the train settings that the fault cases share; the clean runs' bits, by settings
  declare -A CLEAN
  clean_run() { # SETTINGS...: echo the uninterrupted run's hash
    local key="k $*"
    if [ -z "${CLEAN[$key]:-}" ]; then
      rm -rf "$W/rc"; "$D" train --cache "$W/ext" "${TA[@]}" --out "$W/rc" "$@" >/dev/null 2>&1
      CLEAN[$key]=$(run_hash "$W/rc")
    fi
    echo "${CLEAN[$key]}"
  }
  # fault_train FAULTDESC PREFIX...: the faulted run must fail; the rerun must end on the clean bits
  fault_train() {
    local desc=$1; shift
    local -a pre=(); while [ "$1" != -- ]; do pre+=("$1"); shift; done; shift
    local ref; ref=$(clean_run "$@")
    rm -rf "$W/rf"
    timeout -k 5 "$TO" "${pre[@]}" "$D" train --cache "$W/ext" "${TA[@]}" --out "$W/rf" "$@" >"$W/o" 2>"$W/e" </dev/null
    local rc=$? cls; cls=$(classify $rc "$W/e")
    local what="$desc: ${pre[*]} train ... $*"
    if [ "$cls" = ok ]; then
      # exit 0 is right only when no write failed: then the bits are the clean run's
      if [ "$(run_hash "$W/rf")" = "$ref" ]; then
        record $c accepted "$what (exit 0, clean bits: the fault point was not reached)" "$W/e"; return
      fi
      record $c silent "$what (exit 0 after a failed write, other bits)" "$W/e"; return
    fi
    [ "$cls" = fail ] || { [ "$cls" = nomsg ] && cls=other; record $c "$cls" "exit $rc: $what" "$W/e"; return; }
    [ -e "$W/rf/export/model.safetensors" ] && { record $c silent "$what: failed run left an export" "$W/e"; return; }
    timeout -k 5 "$TO" "$D" train --cache "$W/ext" "${TA[@]}" --out "$W/rf" "$@" >"$W/o" 2>"$W/e2" </dev/null
    rc=$?; cls=$(classify $rc "$W/e2")
    case $cls in
      ok) [ "$(run_hash "$W/rf")" = "$ref" ] && record $c clean "$what" || record $c silent "$what: resumed run ends on other bits" "$W/e2" ;;
      fail|nomsg) record $c other "rerun exit $rc after: $what" "$W/e2" ;;
      *) record $c "$cls" "rerun exit $rc after: $what" "$W/e2" ;;
    esac
  }
  # DFLASH_FAULT on train's log
  for er in ENOSPC EIO; do
    for le in 1 2 5; do
      for ce in 0 2 3; do
        fault_train "log-write=$er" env DFLASH_FAULT=log-write=$er -- --log-every $le --ckpt-every $ce
      done
    done
  done
  # RLIMIT_FSIZE: every write past K KiB fails with EFBIG (SIGXFSZ ignored)
  for k in 0 1 2 4 8 16 64 256 400 600 1024 4096; do
    fault_train "fsize ${k}K" "${FSZ[@]}" $k -- --ckpt-every 2 --log-every 1
  done
  # caches: a faulted write must not publish; the rerun must equal the clean cache
  # fault_cache DESC REF PREFIX... -- CMD...  (CMD writes $W/fc)
  fault_cache() {
    local desc=$1 ref=$2; shift 2
    local -a pre=(); while [ "$1" != -- ]; do pre+=("$1"); shift; done; shift
    rm -rf "$W/fc"
    timeout -k 5 "$TO" "${pre[@]}" "$D" "$@" >"$W/o" 2>"$W/e" </dev/null
    local rc=$? cls; cls=$(classify $rc "$W/e")
    local what="$desc: ${pre[*]} $*"
    if [ "$cls" = ok ]; then
      if "$D" dump "$W/fc" --verify >/dev/null 2>&1 && "$D" cache diff "$ref" "$W/fc" 2>/dev/null | grep -q '^identical'; then
        record $c accepted "$what (exit 0, the clean cache: no write failed)" "$W/e"
      else record $c silent "$what (exit 0, the cache is not the clean one)" "$W/e"; fi
      return
    fi
    [ "$cls" = fail ] || { [ "$cls" = nomsg ] && cls=other; record $c "$cls" "exit $rc: $what" "$W/e"; return; }
    [ -e "$W/fc/manifest.json" ] && "$D" dump "$W/fc" >/dev/null 2>&1 && { record $c silent "$what: failed run left a readable manifest" "$W/e"; return; }
    timeout -k 5 "$TO" "$D" "$@" >"$W/o" 2>"$W/e2" </dev/null
    rc=$?; cls=$(classify $rc "$W/e2")
    case $cls in
      ok) if "$D" dump "$W/fc" --verify >/dev/null 2>&1 && "$D" cache diff "$ref" "$W/fc" 2>/dev/null | grep -q '^identical'; then record $c clean "$what"
          else record $c silent "$what: rerun's cache differs from the clean one" "$W/e2"; fi ;;
      fail|nomsg) record $c other "rerun exit $rc after: $what" "$W/e2" ;;
      *) record $c "$cls" "rerun exit $rc after: $what" "$W/e2" ;;
    esac
  }
  local -a EXT=(extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/fc" --layers 0,1,2 --quiet)
  local -a SYN=(cache synth --corpus "$W/tiny.dtok" --hidden 64 --target-layers 6 --layers 3 --rows-per-block 32 --shard-mb 1 --threads 2 --out "$W/fc")
  local -a PRJ=(cache project "$W/ext" "$W/fc" --rank 8 --device cpu)
  for er in EIO ENOSPC; do
    fault_cache "cache-final-dirsync=$er extract" "$W/ext" env DFLASH_FAULT=cache-final-dirsync=$er -- "${EXT[@]}"
    fault_cache "cache-final-dirsync=$er synth" "$W/syn" env DFLASH_FAULT=cache-final-dirsync=$er -- "${SYN[@]}"
    fault_cache "cache-final-dirsync=$er project" "$W/prj" env DFLASH_FAULT=cache-final-dirsync=$er -- "${PRJ[@]}"
  done
  for k in 0 1 4 16 64 256 1024 2000 3000; do
    fault_cache "fsize ${k}K extract" "$W/ext" "${FSZ[@]}" $k -- "${EXT[@]}"
    fault_cache "fsize ${k}K synth" "$W/syn" "${FSZ[@]}" $k -- "${SYN[@]}"
    fault_cache "fsize ${k}K project" "$W/prj" "${FSZ[@]}" $k -- "${PRJ[@]}"
  done
  # corpus import and export under RLIMIT_FSIZE: exit 0 only with the clean bytes
  for k in 0 1 8 32 64; do
    rm -f "$W/fi.dtok"
    KNOTE="[fsize ${k}K]" kase $c any "cmp -s $W/fi.dtok $W/tiny.dtok" "${FSZ[@]}" $k "$D" corpus import --vocab 4096 --out "$W/fi.dtok" "$SRC/data/tiny/corpus.jsonl"
    rm -rf "$W/fx"
    KNOTE="[fsize ${k}K]" kase $c any "cmp -s $W/fx/model.safetensors $W/run-ref/export/model.safetensors" "${FSZ[@]}" $k "$D" export --run "$W/run-ref" --out "$W/fx"
  done
  # DFLASH_FAULT spellings that name no fault: ignored, the run is the clean one
  for v in garbage "log-write" "log-write=" "log-write=EFOO" "=EIO" ",,," "$(printf 'x%.0s' {1..600})=EIO"; do
    rm -rf "$W/rf"
    KNOTE="[DFLASH_FAULT='${v:0:40}']" kase $c ok "[ \"\$(run_hash $W/rf)\" = $(clean_run) ]" env DFLASH_FAULT="$v" "$D" train --cache "$W/ext" "${TA[@]}" --out "$W/rf"
  done
  # kill -9 at several points, then a rerun (twice killed for some) that must give the clean bits
  # kill_case DESC REF-KIND DELAY|@FILE CMD...
  kill_case() {
    local desc=$1 kind=$2 when=$3; shift 3
    local out=$W/kk
    rm -rf "$out"
    local rounds=1; case $desc in *twice*) rounds=2 ;; esac
    for ((r = 0; r < rounds; r++)); do
      "$@" >/dev/null 2>"$W/e" </dev/null &
      local pid=$!
      if [ "${when:0:1}" = @ ]; then
        for _ in $(seq 2000); do compgen -G "$out/${when:1}" >/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 0.005; done
      else sleep "$when"; fi
      kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
    done
    local what="kill -9 $desc at $when, rerun: $*"
    if [ "$kind" != run ] && [ -e "$out/manifest.json" ]; then
      # it finished before the kill: the cache must be the clean one (a rerun is refused)
      if "$D" dump "$out" --verify >/dev/null 2>&1 && "$D" cache diff "$kind" "$out" 2>/dev/null | grep -q '^identical'; then
        record $c accepted "$what: finished before the kill, the clean cache"
      else record $c silent "$what: finished before the kill, but not the clean cache"; fi
      return
    fi
    timeout -k 5 "$TO" "$@" >"$W/o" 2>"$W/e2" </dev/null
    local rc=$? cls; cls=$(classify $rc "$W/e2")
    case $cls in
      ok) local same=1
          if [ "$kind" = run ]; then [ "$(run_hash "$out")" = "$(clean_run --ckpt-every 2)" ] || same=0
          else "$D" dump "$out" --verify >/dev/null 2>&1 && "$D" cache diff "$kind" "$out" 2>/dev/null | grep -q '^identical' || same=0; fi
          [ $same = 1 ] && record $c clean "$what" || record $c silent "$what: resumed result differs from the clean run" "$W/e2" ;;
      fail|nomsg) record $c other "rerun exit $rc after $what" "$W/e2" ;;
      *) record $c "$cls" "rerun exit $rc after $what" "$W/e2" ;;
    esac
  }
  local -a KT=(train --cache "$W/ext" "${TA[@]}" --out "$W/kk" --ckpt-every 2)
  local -a KE=(extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/kk" --layers 0,1,2 --quiet --batch-tokens 256)
  local -a KS=(cache synth --corpus "$W/tiny.dtok" --hidden 64 --target-layers 6 --layers 3 --rows-per-block 32 --shard-mb 1 --threads 2 --out "$W/kk")
  for t in 0.01 0.03 0.05 0.08 0.12 0.16 0.2 0.3; do
    kill_case "train" run $t "$D" "${KT[@]}"
    kill_case "extract" "$W/ext" $t "$D" "${KE[@]}"
    kill_case "synth" "$W/syn" $t "$D" "${KS[@]}"
  done
  for t in 0.05 0.1; do
    kill_case "train twice" run $t "$D" "${KT[@]}"
    kill_case "extract twice" "$W/ext" $t "$D" "${KE[@]}"
    kill_case "synth twice" "$W/syn" $t "$D" "${KS[@]}"
  done
  kill_case "train" run "@ckpt-0000000002" "$D" "${KT[@]}"
  kill_case "train" run "@ckpt-0000000004" "$D" "${KT[@]}"
  kill_case "train" run "@*.tmp" "$D" "${KT[@]}"
  kill_case "train" run "@log.jsonl" "$D" "${KT[@]}"
  kill_case "extract" "$W/ext" "@*.partial" "$D" "${KE[@]}"
  kill_case "extract" "$W/ext" "@rank-0000.json" "$D" "${KE[@]}"
  kill_case "synth" "$W/syn" "@shard-r0000-00002.dfc*" "$D" "${KS[@]}"
  kill_case "synth" "$W/syn" "@meta.json" "$D" "${KS[@]}"
}

############################################################################ main
SUMMARY=$WROOT/summary.txt
: >"$SUMMARY"
: >"$WROOT/findings.txt"
for B in "${BUILDS[@]}"; do
  D=$(find_bin "$B")
  [ -n "$D" ] || { echo "no dflash binary under $B" >&2; exit 2; }
  label=$(basename "$(cd "$B" && pwd)")
  W=$WROOT/$label
  rm -rf "$W" && mkdir -p "$W"
  F=$W/findings.txt
  : >"$F"
  CNT=()
  t0=$(date +%s)
  # fixtures: the tiny target's cache (twice: two uuids), a synth cache, a reference run, a projection
  "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/ext" --layers 0,1,2 --quiet >/dev/null 2>&1 &&
  "$D" extract --device cpu --model "$TM" --data "$TM/corpus.jsonl" --out "$W/ext2" --layers 0,1,2 --quiet >/dev/null 2>&1 &&
  "$D" corpus import --vocab 4096 --out "$W/tiny.dtok" "$SRC/data/tiny/corpus.jsonl" >/dev/null 2>&1 &&
  "$D" cache synth --corpus "$W/tiny.dtok" --hidden 64 --target-layers 6 --layers 3 --rows-per-block 32 --shard-mb 1 --threads 2 --out "$W/syn" >/dev/null 2>&1 &&
  "$D" cache project "$W/ext" "$W/prj" --rank 8 --device cpu >/dev/null 2>&1 &&
  "$D" train --cache "$W/ext" "${TA[@]}" --out "$W/run-ref" >/dev/null 2>&1 &&
  "$D" train --cache "$W/ext" "${TA[@]}" --out "$W/run-ref2" >/dev/null 2>&1 || { echo "fixtures failed ($B)" >&2; exit 1; }
  [ "$(run_hash "$W/run-ref")" = "$(run_hash "$W/run-ref2")" ] || echo "warning: two clean train runs differ; train comparisons are unreliable" | tee -a "$F" >&2
  for camp in $CAMPAIGNS; do
    ts=$(date +%s)
    campaign$camp
    echo "[$label] campaign $camp: $(( $(date +%s) - ts )) s" >&2
  done
  {
    echo "== $label ($D): $(( $(date +%s) - t0 )) s, seed $SEED, timeout $TO s"
    printf '%-10s %6s %6s %8s %8s %6s %5s %7s %6s\n' campaign tried clean accepted unclass crash hang silent other
    names=([1]=cache [2]=input [3]=cli [4]=faults)
    for camp in $CAMPAIGNS; do
      printf '%-10s' "$camp ${names[$camp]}"
      printf ' %6s' "${CNT[$camp,tried]:-0}"
      for cls in $CLASSES; do printf ' %*s' $([ $cls = accepted ] || [ $cls = unclass ] && echo 8 || echo 6) "${CNT[$camp,$cls]:-0}"; done
      echo
    done
  } | tee -a "$SUMMARY"
  { echo "######## $label"; cat "$F"; } >>"$WROOT/findings.txt"
done
echo "findings: $WROOT/findings.txt" >&2
