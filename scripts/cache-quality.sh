#!/usr/bin/env bash
# cache-quality.sh [BUILD_DIR] [WORK_DIR] [OUT_DIR] - drafter quality per cache variant, in one call.
#
# The protocol of issue 27: a lossy cache is judged by the drafter it trains, not by its error.
# On the small really-trained target qwen3-code-8m and its 10x completions corpus (corpus30k/:
# 27,000 train records, 9.47M tokens; 3,000 eval records from disjoint documents):
#   1. import the train and eval corpora, extract the lossless caches (split-zstd) once;
#   2. derive each variant's train cache (another codec: extracted again with --codec; a projection:
#      `dflash cache project` of the lossless cache) and the eval cache it is scored on (the lossless
#      one for codecs: serving sees exact features; for projections the same basis applied to it);
#   3. train the same drafter on every variant with every seed (PAR runs at a time on the GPU),
#      each scored on its eval cache (eval loss, tau_hat, tau_walk over EVAL_ROWS rows: rows and
#      anchors do not depend on the seed);
#   4. optionally (REAL_TAU=1) decode with the first seed's export of each variant (REAL_TAU_SEEDS=all:
#      every seed's) through SpecForge's spec_generate (scripts/specforge_tau.py): the real
#      acceptance length;
#   5. print a table: bytes/token (of raw BF16, and at the Qwen3.6-27B shape), eval figures as mean
#      and spread over seeds, and each variant's paired differences to lossless (same seed, same data
#      order, only the cache or the training option differs): mean and spread of (variant -
#      lossless) eval loss, tau_walk and, where both were decoded, real tau.
#
# VARIANTS (space-separated NAME=SPEC; "lossless" is always run first):
#   codec:C            train on a cache extracted with --codec C
#   init:S[:P=S2,...]  the lossless cache, with --init-seed S (the weights' draw) and the run's seed
#                      for everything else (tells the init's effect from the data order's); parameters
#                      named P... drawn with seed S2 (--init-seed-for: which draw decides)
#   train:ARGS         the lossless cache, with more train options (ARGS: commas for spaces, e.g.
#                      train:--fc-init-random or train:--lr,1e-3): a training change against lossless
#   project:R[:C]      `dflash cache project --rank R [--codec C]` of the lossless cache
#   project-energy:F[:C]  the same, R chosen to keep fraction F of the features' energy
#   fcbasis:N[:C[:R[:S]]]  P = the row space of fc (R = hidden size: the subspace fc reads) of a
#                      drafter trained N steps on the lossless cache (seed 1000, its own run), then
#                      projected; with R: `cache project --fc-basis --rank R` (R > hidden: fc's rows,
#                      then the directions of the most energy outside them; C may be empty:
#                      split-zstd); with S: the fc run and the basis' moment see only a lossless
#                      sample, S train records spread over the corpus (the README's recipe), and the whole train
#                      cache is projected with that basis
# A SPEC may end in /S1,S2,...: that variant's seeds instead of SEEDS.
# Environment: MODEL (the qwen3-code-8m folder, which is not part of this repository; unset: the
#   .device/qwen3-code-8m if it exists, else an error naming MODEL), CORPUS [corpus30k],
#   SEEDS ["1 2 3"], STEPS [4000], LR [3e-3], WARMUP [0.04], LAYER_TYPES [full,full], EVAL_ROWS [256],
#   EVAL_EVERY [STEPS/4], PAR [4], REAL_TAU [0] (1: every variant's first-seed export; or a list of
#   variant names), REAL_TAU_SEEDS [first] (all: every seed's export), SF_PROMPTS [64], REAL_TAU_TIMEOUT [900] (seconds), DEADLINE [none] (seconds after the start past which the real-tau
#   stage is skipped), TRAIN_ARGS [] (more train options),
#   EXTRACT_ARGS [] (more extract options, e.g. --layers 0,1,2,3,4: five feature layers as at 27B; use a
#   fresh work folder per value), DEVICE [cuda], LIMIT [all] (records of each corpus: for a quick check of the script on a CPU).
# Outputs: OUT_DIR/table.md (printed last), OUT_DIR/runs.tsv (one line per run), logs in OUT_DIR/logs,
#   OUT_DIR/exports.tgz: exports/NAME, each variant's first-seed export (for scripts/specforge_tau.py).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
die() { echo "cache-quality: $*" >&2; exit 2; }
abspath() { case $1 in /*) printf '%s\n' "$1";; *) printf '%s\n' "$PWD/$1";; esac; }
BUILD=$(abspath "${1:-build}"); W=$(abspath "${2:-/tmp/dflash-quality}"); OUTD=$(abspath "${3:-$W/out}")
D=$BUILD/dflash
[ -x "$D" ] || die "no dflash binary in $BUILD"
MODEL=${MODEL:-}
if [ -z "$MODEL" ]; then
  [ -f "$ROOT/.device/qwen3-code-8m/config.json" ] && MODEL=$ROOT/.device/qwen3-code-8m
fi
[ -n "$MODEL" ] || die "MODEL is not set (and no .device/qwen3-code-8m): set MODEL to the qwen3-code-8m folder"
case ${REAL_TAU_SEEDS:-first} in first | all) ;; *) die "REAL_TAU_SEEDS=$REAL_TAU_SEEDS: first or all";; esac
CORPUS=${CORPUS:-corpus30k}
[ -f "$MODEL/config.json" ] && [ -f "$MODEL/$CORPUS/train.jsonl.xz" ] || die "MODEL=$MODEL: no $CORPUS/train.jsonl.xz"
SEEDS=${SEEDS:-1 2 3}; STEPS=${STEPS:-4000}; LR=${LR:-3e-3}; WARMUP=${WARMUP:-0.04}
LAYER_TYPES=${LAYER_TYPES:-full,full}; EVAL_ROWS=${EVAL_ROWS:-256}; EVAL_EVERY=${EVAL_EVERY:-$((STEPS / 4))}
PAR=${PAR:-4}; DEVICE=${DEVICE:-cuda}; VARIANTS=${VARIANTS:-}
NL=$(tr ',' '\n' <<<"$LAYER_TYPES" | wc -l)
DRAFTER_ARGS="--mask-token 1 --block-size 16 --layers $NL --layer-types $LAYER_TYPES --heads 4 --kv-heads 2
  --head-dim 64 --intermediate 768 --max-tokens 4096 --max-anchors 512 --lr $LR --warmup $WARMUP"
mkdir -p "$W" "$OUTD/logs" || die "cannot create $W / $OUTD"
LOGS=$OUTD/logs
now() { date +%s.%N; }
t_start=$(now)
note() { printf '[%6.1f s] %s\n' "$(awk -v a="$t_start" -v b="$(now)" 'BEGIN { print b - a }')" "$*"; }

# ---------------------------------------------------------------- 1. corpora and lossless caches
for s in train eval; do
  if [ ! -f "$W/$s.dtok" ]; then
    (set +o pipefail; xz -dc "$MODEL/$CORPUS/$s.jsonl.xz" | head -n "${LIMIT:-1000000000}" >"$W/$s.jsonl") &&
      "$D" corpus import --model "$MODEL" --out "$W/$s.dtok" "$W/$s.jsonl" >"$LOGS/corpus-$s.log" 2>&1 ||
      die "corpus import of $s failed (see $LOGS/corpus-$s.log)"
  fi
done
note "corpora: $(du -h "$W/train.dtok" | cut -f1) train, $(du -h "$W/eval.dtok" | cut -f1) eval"
extract() { # extract SPLIT CODEC OUT
  [ -f "$3/manifest.json" ] && return 0
  "$D" extract --device "$DEVICE" --model "$MODEL" --data "$W/$1.dtok" --out "$3" --codec "$2" \
    ${EXTRACT_ARGS:-} >"$LOGS/extract-$(basename "$3").log" 2>&1 && return 0
  echo "cache-quality: extract $1 --codec $2 failed (see $LOGS)" >&2; return 1
}
skipv() { echo "cache-quality: variant $name skipped: $*" >&2; unset 'NAMES[${#NAMES[@]}-1]'; }
extract train split-zstd "$W/c-lossless" && extract eval split-zstd "$W/e-lossless" || die "no lossless caches"
note "lossless caches extracted"

# ---------------------------------------------------------------- 2. variants' caches
declare -A TRAIN EVAL EXTRA VSEEDS KIND
NAMES=(lossless)
TRAIN[lossless]=$W/c-lossless; EVAL[lossless]=$W/e-lossless; EXTRA[lossless]=""; VSEEDS[lossless]=$SEEDS
for v in $VARIANTS; do
  name=${v%%=*}; spec=${v#*=}
  [ "$name" != "$v" ] && [ -n "$name" ] || die "VARIANTS: '$v' is not NAME=SPEC"
  vs=$SEEDS
  if [[ $spec == */* ]]; then vs=${spec##*/}; vs=${vs//,/ }; spec=${spec%/*}; fi
  if [ "$name" = lossless ]; then VSEEDS[lossless]=$vs; continue; fi
  NAMES+=("$name"); EXTRA[$name]=""; VSEEDS[$name]=$vs
  IFS=: read -r kind a b c smp <<<"$spec"
  KIND[$name]=$kind
  case $kind in
    codec)
      extract train "$a" "$W/c-$name" || { skipv "extraction failed"; continue; }
      TRAIN[$name]=$W/c-$name; EVAL[$name]=$W/e-lossless;;
    init)
      TRAIN[$name]=$W/c-lossless; EVAL[$name]=$W/e-lossless; EXTRA[$name]="--init-seed $a"
      [ -n "${b:-}" ] && EXTRA[$name]+=" --init-seed-for $b";;
    train)
      TRAIN[$name]=$W/c-lossless; EVAL[$name]=$W/e-lossless; EXTRA[$name]=${spec#train:}
      EXTRA[$name]=${EXTRA[$name]//,/ };;
    fcbasis|project|project-energy)
      case $kind in
        fcbasis)
          fr=$W/fcrun-$a; src=$W/c-lossless
          if [ -n "${smp:-}" ]; then
            fr=$W/fcrun-$a-s$smp; src=$W/c-sample$smp
            if [ ! -f "$W/sample$smp.dtok" ]; then
              # every k-th record: the sample spans the corpus, as a user's would
              awk -v m="$smp" -v n="$(wc -l <"$W/train.jsonl")" \
                'BEGIN { k = int(n / m); if (k < 1) k = 1 } (NR - 1) % k == 0 && c < m { print; c++ }' \
                "$W/train.jsonl" >"$W/sample$smp.jsonl" &&
                "$D" corpus import --model "$MODEL" --out "$W/sample$smp.dtok" "$W/sample$smp.jsonl" \
                  >"$LOGS/corpus-sample$smp.log" 2>&1 || { skipv "corpus import of the sample failed"; continue; }
            fi
            extract "sample$smp" split-zstd "$src" || { skipv "extraction of the sample failed"; continue; }
          fi
          if [ ! -f "$fr/export/model.safetensors" ]; then
            "$D" train --device "$DEVICE" --cache "$src" --target "$MODEL" --out "$fr" --steps "$a" \
              $DRAFTER_ARGS --seed 1000 --log-every 100 --no-ckpt --buffered-io --quiet ${TRAIN_ARGS:-} \
              >"$LOGS/fcrun-$a.log" 2>&1 || { skipv "its fc run failed (see $LOGS/fcrun-$a.log)"; continue; }
          fi
          opt="--fc-basis $fr/export";;
        project) opt="--rank $a";;
        *) opt="--energy $a";;
      esac
      [ -n "${b:-}" ] && opt+=" --codec $b"
      [ "$kind" = fcbasis ] && [ -n "${c:-}" ] && opt+=" --rank $c"
      if [ "$kind" = fcbasis ] && [ -n "${smp:-}" ] && [ ! -f "$W/c-$name/manifest.json" ]; then
        # the basis from the sample, then the whole train cache through it
        "$D" cache project "$src" "$W/s-$name" $opt >"$LOGS/project-sample-$name.log" 2>&1 ||
          { skipv "cache project of the sample failed (see $LOGS/project-sample-$name.log)"; continue; }
        opt="--basis $W/s-$name/basis.dfb"; [ -n "${b:-}" ] && opt+=" --codec $b"
      fi
      if [ ! -f "$W/c-$name/manifest.json" ]; then
        "$D" cache project "$W/c-lossless" "$W/c-$name" $opt >"$LOGS/project-$name.log" 2>&1 ||
          { skipv "cache project failed (see $LOGS/project-$name.log)"; continue; }
      fi
      if [ ! -f "$W/e-$name/manifest.json" ]; then
        # lossless codec: the drafter is scored on the features serving gives it (exact x, so exact z)
        "$D" cache project "$W/e-lossless" "$W/e-$name" --basis "$W/c-$name/basis.dfb" \
          >"$LOGS/project-eval-$name.log" 2>&1 ||
          { skipv "cache project of the eval cache failed (see $LOGS/project-eval-$name.log)"; continue; }
      fi
      TRAIN[$name]=$W/c-$name; EVAL[$name]=$W/e-$name;;
    *) die "VARIANTS: unknown kind '$kind' in '$v'";;
  esac
  note "variant $name: ${TRAIN[$name]}"
done

# bytes/token: stored bytes of the train cache over its tokens, and over raw BF16 of the lossless
# cache's layers (a projected cache holds fewer values per token than the raw features)
tokens_of() { "$D" dump "$1" --json 2>/dev/null | python3 -c '
import json, sys; d = json.load(sys.stdin); t = d.get("totals", d)
print(t["tokens"], t["stored_bytes"], t["raw_bytes"])'; }
read -r LTOK LSTORED LRAW <<<"$(tokens_of "$W/c-lossless")"
[ -n "${LRAW:-}" ] || die "dump --json of the lossless cache gave no totals"

# ---------------------------------------------------------------- 3. training runs
RUNS=$OUTD/runs.tsv
printf 'variant\tseed\tsteps\teval_loss\teval_tau_hat\teval_tau_walk\tseconds\trun\n' >"$RUNS"
train_one() { # train_one NAME SEED
  local name=$1 seed=$2 run=$W/run-$1-s$2 t0 fp8=--no-fp8; t0=$(now)
  # BF16 unless the variant says (train's default, --fp8 auto, depends on the GPU and the width)
  case "${EXTRA[$name]} ${TRAIN_ARGS:-}" in *-fp8*) fp8= ;; esac
  rm -rf "$run"
  "$D" train --device "$DEVICE" --cache "${TRAIN[$name]}" --eval-cache "${EVAL[$name]}" --target "$MODEL" \
    --out "$run" --steps "$STEPS" $DRAFTER_ARGS --seed "$seed" --log-every 100 --eval-every "$EVAL_EVERY" \
    --eval-rows "$EVAL_ROWS" --ckpt-every "$STEPS" --keep-last 1 --buffered-io --quiet \
    $fp8 ${EXTRA[$name]} ${TRAIN_ARGS:-} >"$LOGS/train-$name-s$seed.log" 2>&1
  local rc=$? secs; secs=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
  cp "$run/log.jsonl" "$LOGS/log-$name-s$seed.jsonl" 2>/dev/null # the loss curve comes back with the logs
  python3 - "$run/log.jsonl" "$name" "$seed" "$secs" "$run" "$rc" >>"$RUNS" <<'PY'
import json, sys
path, name, seed, secs, run, rc = sys.argv[1:]
last = None
try:
    for line in open(path):
        r = json.loads(line)
        if "eval_loss" in r:
            last = r
except OSError:
    pass
if last is None or rc != "0":
    print("\t".join([name, seed, "FAILED(rc %s)" % rc, "", "", "", secs, run]))
else:
    print("\t".join([name, seed, str(last.get("step")), "%.4f" % last["eval_loss"],
                     "%.4f" % last["eval_tau_hat"], "%.4f" % last.get("eval_tau_walk", float("nan")),
                     secs, run]))
PY
}
JOBS=()
for name in "${NAMES[@]}"; do for seed in ${VSEEDS[$name]}; do JOBS+=("$name $seed"); done; done
note "training ${#JOBS[@]} runs, $PAR at a time ($STEPS steps each)"
running=0
for j in "${JOBS[@]}"; do
  train_one $j &
  running=$((running + 1))
  if [ $running -ge "$PAR" ]; then wait -n; running=$((running - 1)); fi
done
wait
note "training done"
(cd "$W" && tar czf "$OUTD/logs.tgz" run-*/log.jsonl 2>/dev/null) || true
rm -rf "$W/exports" # each variant's first-seed export, for decoding in a later call: one file
for name in "${NAMES[@]}"; do
  first=$(awk '{print $1; exit}' <<<"${VSEEDS[$name]}"); x=$W/run-$name-s$first/export
  [ -f "$x/model.safetensors" ] && mkdir -p "$W/exports/$name" && cp "$x"/config.json "$x"/model.safetensors "$W/exports/$name/"
done
[ -d "$W/exports" ] && (cd "$W" && tar czf "$OUTD/exports.tgz" exports)

# ---------------------------------------------------------------- 5. the table
SIZES=$OUTD/sizes.tsv
: >"$SIZES"
for name in "${NAMES[@]}"; do
  read -r tok st raw <<<"$(tokens_of "${TRAIN[$name]}")"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$tok" "$st" "$raw" "${KIND[$name]:-codec}" >>"$SIZES"
done
SFJ=$OUTD/real-tau.json
print_table() {
python3 - "$RUNS" "$SIZES" "$LRAW" "$LTOK" "$SFJ" "$OUTD/table.md" "$MODEL/config.json" <<'PY'
import json, math, os, statistics as st, sys
runs_p, sizes_p, lraw, ltok, sfj, out, cfg = sys.argv[1:]
hidden = json.load(open(cfg))["hidden_size"]
raw_per_tok = float(lraw) / float(ltok)            # raw BF16 bytes of the K feature layers per token
RAW27B = 5 * 5120 * 2                               # Qwen3.6-27B: 5 feature layers x 5120, BF16
runs, order = {}, []
for line in open(runs_p).read().splitlines()[1:]:
    f = line.split("\t")
    if f[0] not in runs:
        runs[f[0]] = {}; order.append(f[0])
    runs[f[0]][f[1]] = None if f[2].startswith("FAILED") else tuple(map(float, f[3:6]))
order.sort(key=lambda n: n != "lossless")         # lossless first, the rest as they finished
# bytes/token at the 27B shape: the same fraction of the raw features, except for a basis of fc's
# rows, whose rank is a multiple of the hidden size (1 for fc's rows alone): R = c x hidden is c/K
# of the features here, c/5 there (c x 5120 values)
sizes, at27 = {}, {}
for line in open(sizes_p).read().splitlines():
    n, t, s, raw, kind = line.split("\t")
    sizes[n] = float(s) / float(t)
    per_value = float(s) / (float(raw) / 2)       # stored bytes per stored BF16 value
    rank = float(raw) / float(t) / 2               # stored values per token
    at27[n] = per_value * 5120 * rank / hidden if kind == "fcbasis" else sizes[n] / raw_per_tok * RAW27B
real = {}  # variant -> {seed: real tau}; the decoded drafters are named NAME@SEED
if os.path.exists(sfj):
    try:
        for k, v in json.load(open(sfj))["drafters"].items():
            n, _, sd = k.rpartition("@")
            real.setdefault(n, {})[sd] = v["tau"]
    except Exception:
        pass
def ms(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs: return "-"
    if len(xs) == 1: return "%.3f" % xs[0]
    return "%.3f ± %.3f" % (st.mean(xs), st.stdev(xs))
base = runs.get("lossless", {})
lines = ["| variant | bytes/token (of raw BF16) | at 27B shape | eval loss | eval tau_hat | eval tau_walk | per seed tau_walk | paired d eval loss vs lossless | paired d tau_walk vs lossless | real tau | per seed real tau | paired d real tau vs lossless |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
rbase = real.get("lossless", {})
for n in order:
    r = runs[n]
    ok = [v for v in r.values() if v]
    ratio = sizes.get(n, float("nan")) / raw_per_tok
    paired = lambda i: [r[s][i] - base[s][i] for s in r if r[s] and base.get(s)] if n != "lossless" else []
    dl, dw = paired(0), paired(2)
    rt = real.get(n, {})
    dr = [rt[s] - rbase[s] for s in rt if s in rbase] if n != "lossless" else []
    lines.append("| %s | %.0f B (%.4f) | %.2f KB | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
        n, sizes.get(n, float("nan")), ratio, at27.get(n, float("nan")) / 1000, ms([v[0] for v in ok]),
        ms([v[1] for v in ok]), ms([v[2] for v in ok]),
        " ".join("%s:%s" % (s, "%.3f" % r[s][2] if r[s] else "FAIL") for s in sorted(r, key=int)),
        ms(dl) if dl else "-", ms(dw) if dw else "-", ms(list(rt.values())) if rt else "-",
        " ".join("%s:%.3f" % (s, rt[s]) for s in sorted(rt, key=int)) if rt else "-",
        ms(dr) if dr else "-"))
txt = "\n".join(lines) + "\n"
open(out, "w").write(txt)
print(txt)
PY
}
print_table

# ---------------------------------------------------------------- 4. real acceptance length
elapsed() { awk -v a="$t_start" -v b="$(now)" 'BEGIN { printf "%d", b - a }'; }
if [ "${REAL_TAU:-0}" != 0 ] && [ -n "${DEADLINE:-}" ] && [ "$(elapsed)" -gt "$DEADLINE" ]; then
  note "real tau skipped: past DEADLINE=$DEADLINE s"
elif [ "${REAL_TAU:-0}" != 0 ]; then
  want=" ${NAMES[*]} "; [ "$REAL_TAU" = 1 ] || want=" ${REAL_TAU//,/ } "
  args=()
  for name in "${NAMES[@]}"; do
    [[ $want == *" $name "* ]] || continue
    seeds=$(awk '{print $1; exit}' <<<"${VSEEDS[$name]}")
    [ "${REAL_TAU_SEEDS:-first}" = all ] && seeds=${VSEEDS[$name]}
    for seed in $seeds; do
      x=$W/run-$name-s$seed/export
      [ -f "$x/model.safetensors" ] && args+=(--drafter "$name@$seed=$x")
    done
  done
  if [ ${#args[@]} -gt 0 ]; then
    timeout "${REAL_TAU_TIMEOUT:-900}" python3 -u "$ROOT/scripts/specforge_tau.py" --target "$MODEL" --eval-corpus "$W/eval.jsonl" "${args[@]}" \
      --prompts "${SF_PROMPTS:-64}" --json-out "$SFJ" >"$LOGS/real-tau.log" 2>&1 ||
      { echo "cache-quality: specforge_tau.py failed (status $?; $LOGS/real-tau.log ends:)" >&2
        tail -n 15 "$LOGS/real-tau.log" >&2; }
  fi
  note "real tau done"
  print_table
fi
note "done"

