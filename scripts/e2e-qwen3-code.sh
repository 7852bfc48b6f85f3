#!/usr/bin/env bash
# e2e-qwen3-code.sh [BUILD_DIR] [WORK_DIR] - the whole pipeline on a real, small trained target.
#
# Target: qwen3-code-8m, a 6-layer, hidden-256, vocab-4096 Qwen3 trained from scratch on source code,
# whose corpus/{train,eval}.jsonl.xz hold its own greedy completions. It is not part of this
# repository: MODEL must name its folder (or another target folder laid out the same way).
# In one invocation:
#   1. corpus   xz -dc the train/eval corpora (optionally the first LIMIT/EVAL_LIMIT records),
#               `dflash corpus import` them (ids checked against the target's vocabulary)
#   2. extract  the target's hidden states of the feature layers (docs/DRAFTER.md's rule:
#               1,2,3 of 6)
#               for the train corpus and the eval corpus, each into its own cache
#   3. verify   `dflash dump --verify` of both caches (every CRC and index entry), summaries
#   4. train    a DFlash drafter (block 16, mask token 1, sliding+full layers) on the train cache,
#               scored on the eval cache every EVAL_EVERY steps (--eval-cache); export/
#   5. check    export/config.json (DFlash keys) and export/model.safetensors (header, tensors)
#   6. plot     scripts/plot_train_log.py of the run's log.jsonl (PNG, or SVG without matplotlib)
#   7. report   eval acc[k] and tau_hat at the first and last evaluation, training throughput,
#               then a summary table (last). Exit status 0 when every stage passed, 1 otherwise,
#               2 on bad usage.
#
# BUILD_DIR (default build) holds the dflash binary; WORK_DIR (default /tmp/dflash-e2e) gets
# everything: corpora, caches, run/, logs/ (one log per stage), summary.txt. The outputs of an
# earlier run in WORK_DIR are removed first (only the names this script writes).
#
# Environment (defaults in brackets: GPU / CPU; "GPU" = DEVICE=cuda, or DEVICE=auto with a visible
# GPU as nvidia-smi reports it):
#   DEVICE          auto | cpu | cuda [auto]: passed to extract and train as --device
#   MODEL           the target folder (required): config.json, safetensors, corpus/{train,eval}.jsonl.xz
#   STEPS           optimizer steps [4000 / 60]
#   LIMIT           train records to use, 0 = all 2700 [0 / 400]
#   EVAL_LIMIT      eval records to use, 0 = all 300 [0 / 100]
#   LAYERS          target feature layers for extract: auto (docs/DRAFTER.md's rule) or ids [auto]
#   CODEC           cache codec [split-zstd]
#   DRAFT_LAYERS    drafter layers: DRAFT_LAYERS-1 sliding + 1 full, as the recipe [2]
#   LAYER_TYPES     explicit --layer-types (overrides the above) []
#   WINDOW          sliding window [256: the recipe's 2048 of 4096 scaled to these <=448-token docs]
#   HEADS KV_HEADS HEAD_DIM   drafter attention [4 2 64: the CUDA DFlash attention takes head
#                   dims 64 and 128 only, the target's 8 x 32 is not accepted there]
#   INTERMEDIATE    drafter MLP size [768, the target's]
#   BLOCK           block size [16]     MASK_TOKEN  [1]
#   MAX_TOKENS      context tokens per packed row [4096 / 1024]
#   MAX_ANCHORS     blocks per row [512 / 64]
#   LR              peak learning rate [3e-3]; WARMUP fraction [0.04]
#   LOG_EVERY       [50 / 10]   EVAL_EVERY [STEPS/10 / STEPS/2]   EVAL_ROWS [64 / 8]
#   MIN_EVAL_TAU    if set, fail when the last eval tau_hat is below it []
#   KEEP_CACHES=1   keep complete caches of an earlier run in WORK_DIR (retrain only) [0]
#   SPECFORGE=1     (GPU, torch) also scripts/specforge_tau.py: the real acceptance length (tau) of
#                   our export by speculative decoding with SpecForge's spec_generate, and of a
#                   drafter of the same shape trained on the same corpus by SpecForge's own code
#                   (SF_STEPS [2000] x SF_BATCH [16] records x SF_ANCHORS [64] blocks: about our
#                   4000 x 512 blocks), on SF_PROMPTS [64] eval prompts; set LAYER_TYPES=full,full
#                   for an exact comparison (spec_generate runs sliding layers as full) [0]
#
# CPU check (2 cores, about 1.5 minutes): MODEL=/path/to/qwen3-code-8m DEVICE=cpu STEPS=60 \
#                                            scripts/e2e-qwen3-code.sh
# GPU run:                                 MODEL=/path/to/qwen3-code-8m scripts/e2e-qwen3-code.sh
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
abspath() { case $1 in /*) printf '%s\n' "$1";; *) printf '%s\n' "$PWD/$1";; esac; }
die() { echo "e2e: $*" >&2; exit 2; }

[ $# -le 2 ] || die "usage: $0 [BUILD_DIR] [WORK_DIR]"
BUILD=${1:-build}
if [ -x "$(abspath "$BUILD")/dflash" ]; then BUILD=$(abspath "$BUILD")
elif [ -x "$ROOT/$BUILD/dflash" ]; then BUILD=$ROOT/$BUILD
else die "no dflash binary in $BUILD (nor in $ROOT/$BUILD); build it first (cmake -B build && cmake --build build -j)"
fi
D=$BUILD/dflash
W=$(abspath "${2:-/tmp/dflash-e2e}")
[ -n "${MODEL:-}" ] || die "MODEL is not set: point it at the qwen3-code-8m folder (config.json, corpus/{train,eval}.jsonl.xz)"
[ -f "$MODEL/config.json" ] && [ -f "$MODEL/corpus/train.jsonl.xz" ] && [ -f "$MODEL/corpus/eval.jsonl.xz" ] ||
  die "MODEL=$MODEL: want the qwen3-code-8m folder (config.json, corpus/{train,eval}.jsonl.xz)"
MODEL=$(cd "$MODEL" && pwd)
command -v xz >/dev/null || die "xz is needed (xz-utils)"
PY=$(command -v python3 || true)

DEVICE=${DEVICE:-auto}
case $DEVICE in auto|cpu|cuda) ;; *) die "DEVICE=$DEVICE: want auto, cpu or cuda";; esac
if [ "$DEVICE" = auto ]; then
  if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then GPU=1; else GPU=0; fi
else
  [ "$DEVICE" = cuda ] && GPU=1 || GPU=0
fi
if [ $GPU = 1 ]; then
  STEPS=${STEPS:-4000}; LIMIT=${LIMIT:-0}; EVAL_LIMIT=${EVAL_LIMIT:-0}; MAX_TOKENS=${MAX_TOKENS:-4096}
  MAX_ANCHORS=${MAX_ANCHORS:-512}; LOG_EVERY=${LOG_EVERY:-50}; EVAL_ROWS=${EVAL_ROWS:-64}
  EVAL_EVERY=${EVAL_EVERY:-$(( STEPS / 10 > 0 ? STEPS / 10 : 1 ))}
else
  STEPS=${STEPS:-60}; LIMIT=${LIMIT:-400}; EVAL_LIMIT=${EVAL_LIMIT:-100}; MAX_TOKENS=${MAX_TOKENS:-1024}
  MAX_ANCHORS=${MAX_ANCHORS:-64}; LOG_EVERY=${LOG_EVERY:-10}; EVAL_ROWS=${EVAL_ROWS:-8}
  EVAL_EVERY=${EVAL_EVERY:-$(( STEPS / 2 > 0 ? STEPS / 2 : 1 ))}
fi
LAYERS=${LAYERS:-auto}; CODEC=${CODEC:-split-zstd}
DRAFT_LAYERS=${DRAFT_LAYERS:-2}; WINDOW=${WINDOW:-256}
HEADS=${HEADS:-4}; KV_HEADS=${KV_HEADS:-2}; HEAD_DIM=${HEAD_DIM:-64}; INTERMEDIATE=${INTERMEDIATE:-768}
BLOCK=${BLOCK:-16}; MASK_TOKEN=${MASK_TOKEN:-1}; LR=${LR:-3e-3}; WARMUP=${WARMUP:-0.04}
if [ -z "${LAYER_TYPES:-}" ]; then
  LAYER_TYPES=""
  for ((i = 1; i < DRAFT_LAYERS; i++)); do LAYER_TYPES+="sliding,"; done
  LAYER_TYPES+="full"
fi
for v in STEPS LIMIT EVAL_LIMIT MAX_TOKENS MAX_ANCHORS LOG_EVERY EVAL_ROWS EVAL_EVERY DRAFT_LAYERS; do
  [[ ${!v} =~ ^[0-9]+$ ]] || die "$v=${!v}: want a non-negative integer"
done

mkdir -p "$W" || die "cannot create $W"
if [ "${KEEP_CACHES:-0}" = 1 ]; then
  rm -rf "$W/run" "$W/logs" "$W/summary.txt" "$W/log.png" "$W/log.svg"
else
  rm -rf "$W"/{train,eval}.jsonl "$W"/{train,eval}.dtok "$W"/cache-{train,eval} "$W/run" "$W/logs" \
         "$W"/extract-{train,eval}.json* "$W"/dump-{train,eval}.json "$W/summary.txt" "$W"/log.{png,svg}
fi
mkdir -p "$W/logs"
RUN=$W/run

declare -A ST SECS          # stage -> ok | FAILED (rc N) | skipped; stage -> seconds
ORDER=()
FAIL=0
now() { date +%s.%N; }
# stage NAME CMD...: runs CMD, its output shown and kept in logs/NAME.log
stage() {
  local name=$1; shift
  ORDER+=("$name")
  printf '\n== %s\n+ %s\n' "$name" "$*"
  local t0 rc; t0=$(now)
  "$@" 2>&1 | tee "$W/logs/$name.log"
  rc=${PIPESTATUS[0]}
  SECS[$name]=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
  if [ "$rc" = 0 ]; then ST[$name]=ok; else ST[$name]="FAILED (exit $rc)"; FAIL=1; fi
  return "$rc"
}
skip() { ORDER+=("$1"); ST[$1]="skipped ($2)"; FAIL=1; }

echo "e2e: dflash $D, target $MODEL, work dir $W"
echo "e2e: DEVICE=$DEVICE ($([ $GPU = 1 ] && echo GPU || echo CPU) defaults) STEPS=$STEPS LIMIT=$LIMIT" \
     "EVAL_LIMIT=$EVAL_LIMIT LAYERS=$LAYERS drafter $DRAFT_LAYERS layers ($LAYER_TYPES, window $WINDOW)" \
     "${HEADS}/${KV_HEADS}x${HEAD_DIM} MLP $INTERMEDIATE block $BLOCK, rows $MAX_TOKENS tokens /" \
     "$MAX_ANCHORS anchors, lr $LR"

# ---------------------------------------------------------------- 1. corpora
corpus() { # corpus NAME LIMIT: decompress (first LIMIT records), import
  local name=$1 limit=$2
  if [ "$limit" -gt 0 ]; then
    xz -dc "$MODEL/corpus/$name.jsonl.xz" > "$W/$name.all.jsonl" || return 1
    head -n "$limit" "$W/$name.all.jsonl" > "$W/$name.jsonl" && rm -f "$W/$name.all.jsonl" || return 1
  else
    xz -dc "$MODEL/corpus/$name.jsonl.xz" > "$W/$name.jsonl" || return 1
  fi
  "$D" corpus import --model "$MODEL" --out "$W/$name.dtok" "$W/$name.jsonl"
}
have_cache() { [ "${KEEP_CACHES:-0}" = 1 ] && [ -f "$W/cache-$1/manifest.json" ]; }
for s in train eval; do
  lim=$LIMIT; [ $s = eval ] && lim=$EVAL_LIMIT
  if have_cache $s; then ORDER+=("corpus-$s"); ST[corpus-$s]="kept (KEEP_CACHES=1)"; continue; fi
  stage "corpus-$s" corpus $s "$lim"
done

# ---------------------------------------------------------------- 2. extraction
for s in train eval; do
  if have_cache $s; then ORDER+=("extract-$s"); ST[extract-$s]="kept (KEEP_CACHES=1)"; continue; fi
  if [ "${ST[corpus-$s]}" != ok ]; then skip "extract-$s" "no corpus"; continue; fi
  stage "extract-$s" "$D" extract --device "$DEVICE" --model "$MODEL" --data "$W/$s.dtok" \
    --out "$W/cache-$s" --layers "$LAYERS" --codec "$CODEC" --stats-json "$W/extract-$s.json"
done
caches_ok=1
for s in train eval; do
  case ${ST[extract-$s]} in ok|kept*) ;; *) caches_ok=0;; esac
done

# ---------------------------------------------------------------- 3. verify + summaries
for s in train eval; do
  if [ ! -f "$W/cache-$s/manifest.json" ]; then skip "verify-$s" "no cache"; continue; fi
  stage "verify-$s" "$D" dump "$W/cache-$s" --verify
  "$D" dump "$W/cache-$s" | tee -a "$W/logs/verify-$s.log"
  "$D" dump "$W/cache-$s" --json > "$W/dump-$s.json" 2>/dev/null || true
done

# ---------------------------------------------------------------- 4. training
if [ $caches_ok = 1 ]; then
  stage train "$D" train --device "$DEVICE" --cache "$W/cache-train" --target "$MODEL" --out "$RUN" \
    --steps "$STEPS" --mask-token "$MASK_TOKEN" --block-size "$BLOCK" \
    --layers "$DRAFT_LAYERS" --layer-types "$LAYER_TYPES" --sliding-window "$WINDOW" \
    --heads "$HEADS" --kv-heads "$KV_HEADS" --head-dim "$HEAD_DIM" --intermediate "$INTERMEDIATE" \
    --max-tokens "$MAX_TOKENS" --max-anchors "$MAX_ANCHORS" --lr "$LR" --warmup "$WARMUP" \
    --log-every "$LOG_EVERY" --ckpt-every "$STEPS" \
    --eval-cache "$W/cache-eval" --eval-every "$EVAL_EVERY" --eval-rows "$EVAL_ROWS"
else
  skip train "no caches"
fi

# ---------------------------------------------------------------- 5. the export
check_export() {
  local x=$RUN/export
  [ -s "$x/config.json" ] || { echo "missing or empty: $x/config.json"; return 1; }
  [ -s "$x/model.safetensors" ] || { echo "missing or empty: $x/model.safetensors"; return 1; }
  [ -n "$PY" ] || { echo "config.json + model.safetensors present (python3 absent: not parsed)"; return 0; }
  "$PY" - "$x" "$BLOCK" "$MASK_TOKEN" "$DRAFT_LAYERS" <<'PY'
import json, struct, sys, os
x, bs, mask, nl = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
c = json.load(open(os.path.join(x, "config.json")))
bad = []
dc = c.get("dflash_config", {})
if c.get("architectures") != ["DFlashDraftModel"]: bad.append("architectures %r" % c.get("architectures"))
if c.get("block_size") != bs: bad.append("block_size %r" % c.get("block_size"))
if dc.get("mask_token_id") != mask: bad.append("dflash_config.mask_token_id %r" % dc.get("mask_token_id"))
if c.get("num_hidden_layers") != nl: bad.append("num_hidden_layers %r" % c.get("num_hidden_layers"))
p = os.path.join(x, "model.safetensors")
with open(p, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    h = json.loads(f.read(n))
h.pop("__metadata__", None)
need = ["fc.weight", "hidden_norm.weight", "norm.weight"] + \
       ["layers.%d.self_attn.%s_proj.weight" % (i, t) for i in range(nl) for t in "qkvo"] + \
       ["layers.%d.mlp.%s_proj.weight" % (i, t) for i in range(nl) for t in ("gate", "up", "down")]
miss = [k for k in need if k not in h]
if miss: bad.append("tensors missing: " + ", ".join(miss[:5]))
dts = sorted({v["dtype"] for v in h.values()})
end = max(v["data_offsets"][1] for v in h.values())
if 8 + n + end != os.path.getsize(p): bad.append("file size %d != header's %d" % (os.path.getsize(p), 8 + n + end))
params = sum(eval("*".join(map(str, v["shape"])) or "1") for v in h.values())
print("export: %d tensors (%s), %.2fM parameters, %.1f MB; target_layer_ids %s, block_size %s, "
      "mask_token_id %s, layer_types %s" % (len(h), "/".join(dts), params / 1e6,
      os.path.getsize(p) / 1e6, dc.get("target_layer_ids"), c.get("block_size"),
      dc.get("mask_token_id"), c.get("layer_types")))
if bad:
    print("export: BAD " + "; ".join(bad)); sys.exit(1)
PY
}
if [ -d "$RUN" ] && [ "${ST[train]}" = ok ]; then stage export check_export; else skip export "no training run"; fi

# ---------------------------------------------------------------- 5b. real tau, and SpecForge's drafter
SF=-
if [ "${SPECFORGE:-0}" = 1 ]; then
  if [ "${ST[export]:-}" = ok ] && [ -n "$PY" ]; then
    stage specforge "$PY" "$ROOT/scripts/specforge_tau.py" --target "$MODEL" --eval-corpus "$W/eval.jsonl" \
      --drafter "ours=$RUN/export" --train-corpus "$W/train.jsonl" --steps "${SF_STEPS:-2000}" \
      --batch "${SF_BATCH:-16}" --anchors "${SF_ANCHORS:-64}" --lr "$LR" --warmup "$WARMUP" \
      --prompts "${SF_PROMPTS:-64}" --json-out "$W/specforge-tau.json"
    [ -s "$W/specforge-tau.json" ] && SF=$("$PY" -c "
import json; r = json.load(open('$W/specforge-tau.json')); d = r['drafters']
print('; '.join('%s tau %.3f (%d verifications%s)' % (k, v['tau'], v['verifications'],
  ', teacher-forced mean %.3f harmonic %.3f walk %.3f' % (v['tf_tau_mean'], v['tf_tau_harmonic'],
  v['tf_tau_walk']) if 'tf_tau_mean' in v else '') for k, v in d.items()))")
  else
    skip specforge "no export"
  fi
fi

# ---------------------------------------------------------------- 6. plot
PLOT=-
if [ -s "$RUN/log.jsonl" ] && [ -f "$ROOT/scripts/plot_train_log.py" ] && [ -n "$PY" ]; then
  if stage plot "$PY" "$ROOT/scripts/plot_train_log.py" "$RUN/log.jsonl" --out "$W/log.png" \
       --title "qwen3-code-8m drafter ($DEVICE, $STEPS steps)"; then
    PLOT=$(ls "$W"/log.png "$W"/log.svg 2>/dev/null | head -1)
  fi
fi

# ---------------------------------------------------------------- 7. report
T_TRAIN=${SECS[train]:-0}
REPORT=$W/logs/report.txt
if [ -n "$PY" ]; then
  "$PY" - "$W" "$RUN/log.jsonl" "$T_TRAIN" "${MIN_EVAL_TAU:-}" > "$REPORT" <<'PY'
import json, os, statistics, sys
w, logp, t_train, min_tau = sys.argv[1], sys.argv[2], float(sys.argv[3] or 0), sys.argv[4]
def load(p):
    try: return json.load(open(p))
    except Exception: return None
def kv(k, v): print("%s=%s" % (k, v))
def xstats(s):
    """extract's --stats-json; with several GPUs each rank wrote FILE.rankR: summed up"""
    p = os.path.join(w, "extract-%s.json" % s)
    st = load(p)
    if st:
        return st
    ranks = [load(os.path.join(w, f)) for f in sorted(os.listdir(w))
             if f.startswith("extract-%s.json.rank" % s)]
    ranks = [r for r in ranks if r]
    if not ranks:
        return None
    st = {k: sum(r[k] for r in ranks) for k in ("docs", "tokens", "raw_bytes", "stored_bytes")}
    for k in ("seconds", "setup_seconds", "forward_seconds"):
        st[k] = max(r[k] for r in ranks)
    st["device"] = "%s x %d ranks" % (ranks[0]["device"], len(ranks))
    return st
for s in ("train", "eval"):
    st, dp = xstats(s), load(os.path.join(w, "dump-%s.json" % s))
    if st:
        steady = st["seconds"] - st["setup_seconds"]
        kv("X_%s" % s, "%d docs, %d tokens in %.1f s on %s: %.0f tok/s (forward alone %.0f tok/s)" % (
           st["docs"], st["tokens"], st["seconds"], st["device"],
           st["tokens"] / steady if steady > 0 else 0,
           st["tokens"] / st["forward_seconds"] if st["forward_seconds"] > 0 else 0))
    if dp:
        kv("C_%s" % s, "%.1f MB stored / %.1f MB raw = %.3f (%.0f B/token, layers %s, %s)" % (
           dp["stored_bytes"] / 1e6, dp["raw_bytes"] / 1e6, dp["ratio"],
           dp["bytes_per_token"]["stored"], ",".join(map(str, dp["layer_ids"])), dp["codec"]["name"]))
        kv("LAYER_IDS", ",".join(map(str, dp["layer_ids"])))
devs = []
for s in ("train", "eval"):
    st = xstats(s)
    devs.append("extract-%s %s" % (s, st["device"] if st else "?"))
try:
    import re
    m = re.search(r"parameters on (\w+)", open(os.path.join(w, "logs", "train.log")).read())
    devs.append("train %s" % (m.group(1) if m else "?"))
except OSError:
    pass
kv("DEVICES", ", ".join(devs))
tr, ev = [], []
try:
    for line in open(logp):
        try: r = json.loads(line)
        except ValueError: continue
        if "eval_loss" in r:
            ev.append(r)
        elif "loss" in r:  # (the run lines hold metadata)
            tr.append(r)
except OSError:
    pass
if tr:
    last = tr[-1]
    kv("T_STEPS", last["step"])
    kv("T_FINAL", "loss %.4f, tau_hat %.3f, acc1 %.3f (step %d, epoch %d)" % (
       last["loss"], last["tau_hat"], last["acc"][0], last["step"], last["epoch"]))
    # steady rate: median over the logged intervals, the first one (start-up) left out;
    # an interval that holds an evaluation counts it too, the median leaves those out
    rates = [r["tokens_per_s"] for r in tr[1:]] or [tr[0]["tokens_per_s"]]
    med = statistics.median(rates)
    mfu = statistics.median([r.get("mfu", 0) for r in tr[1:]] or [0])
    kv("T_RATE", "%.0f tok/s median of the logged intervals (%s); %d context tokens in %.1f s "
       "with start-up, evals and export = %.0f tok/s" % (
       med, "MFU %.2f%%" % (100 * mfu) if mfu > 0 else "no MFU on the CPU", last["tokens"],
       t_train, last["tokens"] / t_train if t_train > 0 else 0))
def evline(r):
    dec = ", tau_walk %.3f" % r["eval_tau_walk"] if "eval_tau_walk" in r else ""
    return "step %d: loss %.4f, acc1 %.3f, tau_hat %.3f%s (%d rows, %d blocks)" % (
        r["step"], r["eval_loss"], r["eval_acc"][0], r["eval_tau_hat"], dec, r["eval_rows"],
        r["eval_blocks"])
if ev:
    kv("E_FIRST", evline(ev[0]))
    kv("E_LAST", evline(ev[-1]))
    kv("E_N", len(ev))
    for tag, r in (("E_ACC_FIRST", ev[0]), ("E_ACC_LAST", ev[-1])):
        kv(tag, " ".join("%.3f" % a for a in r["eval_acc"]))
    kv("E_TAU_LAST", ev[-1]["eval_tau_hat"])
    if min_tau:
        kv("E_TAU_OK", 1 if ev[-1]["eval_tau_hat"] >= float(min_tau) else 0)
PY
fi
val() { [ -f "$REPORT" ] && sed -n "s/^$1=//p" "$REPORT" | tail -1; }

printf '\n== report\n'
if [ -n "$(val E_FIRST)" ]; then
  echo "eval acc[k], k = 1..$((BLOCK - 1)) (block position k predicts the k-th next token):"
  echo "  first eval, $(val E_FIRST)"
  echo "    acc: $(val E_ACC_FIRST)"
  echo "  last eval,  $(val E_LAST)"
  echo "    acc: $(val E_ACC_LAST)"
fi
[ -n "$(val T_RATE)" ] && echo "training throughput: $(val T_RATE)"
if [ -n "${MIN_EVAL_TAU:-}" ]; then
  if [ "$(val E_TAU_OK)" = 1 ]; then echo "eval tau_hat $(val E_TAU_LAST) >= MIN_EVAL_TAU $MIN_EVAL_TAU: ok"
  else
    echo "eval tau_hat $(val E_TAU_LAST) below MIN_EVAL_TAU $MIN_EVAL_TAU"
    ORDER+=("tau-check"); ST[tau-check]="FAILED (below $MIN_EVAL_TAU)"; FAIL=1
  fi
fi

row() { printf '%-22s %s\n' "$1" "$2"; }
{
  printf '\n== summary: qwen3-code-8m end to end (DEVICE=%s, feature layers %s, drafter %s layers %s)\n' \
    "$DEVICE" "$(val LAYER_IDS)" "$DRAFT_LAYERS" "$LAYER_TYPES"
  stages=""
  for s in "${ORDER[@]}"; do
    case ${ST[$s]} in ok) stages+="$s ok, ";; *) stages+="$s ${ST[$s]}, ";; esac
  done
  row "stages" "${stages%, }"
  row "devices used" "$(val DEVICES)"
  row "extract train" "$(val X_train || true)"
  row "extract eval" "$(val X_eval || true)"
  row "cache train" "$(val C_train || true)"
  row "cache eval" "$(val C_eval || true)"
  row "train" "$(val T_STEPS) steps of $MAX_TOKENS-token rows x $MAX_ANCHORS blocks of $BLOCK, ${SECS[train]:--} s"
  row "train throughput" "$(val T_RATE)"
  row "final train" "$(val T_FINAL)"
  row "eval first" "$(val E_FIRST)"
  row "eval last" "$(val E_LAST)"
  row "export" "$([ "${ST[export]:-}" = ok ] && echo "$RUN/export (config.json + model.safetensors; $(sed -n 's/^export: \([0-9]* tensors[^;]*\);.*/\1/p' "$W/logs/export.log"))" || echo "${ST[export]:-}")"
  row "plot" "$PLOT"
  [ "$SF" != - ] && row "real tau (spec_generate)" "$SF"
  row "logs" "$W/logs/"
  if [ $FAIL = 0 ]; then row "result" "OK"; else row "result" "FAILED"; fi
} | tee "$W/summary.txt"
exit $FAIL
