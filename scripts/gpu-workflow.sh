#!/usr/bin/env bash
# gpu-workflow.sh [BUILD_DIR] [WORK_DIR] - the user's steps after extraction, on the device, checked.
#
# On a real small target (qwen3-code-8m and its shipped corpus; MODEL names its folder, default
# .device/qwen3-code-8m), with DEVICE (default cuda) for every command:
#   1. import and extract a train and an eval cache;
#   2. train with --eval-cache: RUN/best must be the export of the step with the best eval
#      tau_walk, and `export --best` must give it back bit for bit;
#   3. `dflash eval` of that export must give the trainer's own evaluation at that step (acc[k],
#      tau_hat, tau_walk equal; the loss within 1e-3 relative; not on the CPU, whose trainer
#      evaluates f32 weights), and the same eval on the CPU must
#      agree with it (tau_walk within 2%, loss within 1%: BF16 activations against f32);
#   4. `train --init-from` the export: --steps 0 exports the same bits; a fine-tune starts at the
#      trained drafter's loss, not a drawn one's; stopped and resumed it ends on the same bits;
#   5. REAL_TAU=1: the export's real acceptance length through SpecForge's spec_generate
#      (scripts/specforge_tau.py; GPU machine with torch and SpecForge's sources only).
# Prints one line per check and "gpu-workflow: N checks, F failed" last; exit 1 if any failed.
# Environment: MODEL, DEVICE [cuda], STEPS [600], LIMIT [all records of the shipped corpus].
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=${1:-$ROOT/build}; W=${2:-/tmp/dflash-workflow}
D=$B/dflash
[ -x "$D" ] || { echo "gpu-workflow: no dflash binary in $B" >&2; exit 2; }
MODEL=${MODEL:-$ROOT/.device/qwen3-code-8m}
[ -f "$MODEL/corpus/train.jsonl.xz" ] || { echo "gpu-workflow: MODEL=$MODEL has no corpus/train.jsonl.xz" >&2; exit 2; }
DEV=${DEVICE:-cuda}; STEPS=${STEPS:-600}
rm -rf "$W"; mkdir -p "$W" || exit 2
n=0; bad=0
ok() { n=$((n + 1)); echo "ok   $*"; }
no() { n=$((n + 1)); bad=$((bad + 1)); echo "FAIL $*"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else no "$what"; fi; }
t0=$(date +%s)
el() { echo "$(($(date +%s) - t0)) s"; }

# 1. caches
for s in train eval; do
  (set +o pipefail; xz -dc "$MODEL/corpus/$s.jsonl.xz" | head -n "${LIMIT:-1000000000}" >"$W/$s.jsonl")
  "$D" corpus import --model "$MODEL" --out "$W/$s.dtok" "$W/$s.jsonl" >"$W/import-$s.log" 2>&1 &&
    "$D" extract --device "$DEV" --model "$MODEL" --data "$W/$s.dtok" --out "$W/c-$s" --quiet >"$W/extract-$s.log" 2>&1 ||
    { echo "gpu-workflow: import/extract of $s failed:" >&2; tail -5 "$W"/*-$s.log >&2; exit 1; }
done
echo "caches: $(el)"

# 2. a run with evaluations and RUN/best
DR="--mask-token 1 --block-size 16 --layers 2 --layer-types full,full --heads 4 --kv-heads 2 --head-dim 64
  --intermediate 768 --max-tokens 4096 --max-anchors 512"
EV="--max-tokens 4096 --max-anchors 512"
"$D" train --device "$DEV" --cache "$W/c-train" --eval-cache "$W/c-eval" --target "$MODEL" --out "$W/runA" \
  --steps "$STEPS" $DR --lr 3e-3 --eval-every $((STEPS / 3)) --eval-rows 64 --log-every 50 --quiet \
  >"$W/trainA.log" 2>&1
check "train with --eval-cache ($STEPS steps, $(el))" [ -f "$W/runA/export/model.safetensors" ]
bs=$(sed -nE 's/.*"step":[[:space:]]*([0-9]+).*/\1/p' "$W/runA/best/best.json" 2>/dev/null)
check "RUN/best names a step ($bs)" [ -n "$bs" ]
"$D" export --run "$W/runA" --best --out "$W/xBest" >"$W/export.log" 2>&1
check "export --best gives RUN/best bit for bit" cmp -s "$W/runA/best/model.safetensors" "$W/xBest/model.safetensors"
"$D" export --run "$W/runA" --step "$bs" --out "$W/xStep" >>"$W/export.log" 2>&1
check "RUN/best is the export of step $bs" cmp -s "$W/runA/best/model.safetensors" "$W/xStep/model.safetensors"

# 3. dflash eval of the export against the trainer's evaluation, and the CPU's
"$D" eval --device "$DEV" --cache "$W/c-eval" --drafter "$W/xBest" --target "$MODEL" --rows 64 $EV --json >"$W/eval-dev.json" 2>"$W/eval-dev.log"
"$D" eval --device cpu --cache "$W/c-eval" --drafter "$W/xBest" --target "$MODEL" --rows 64 $EV --json >"$W/eval-cpu.json" 2>"$W/eval-cpu.log"
python3 - "$W/eval-dev.json" "$W/eval-cpu.json" "$W/runA/log.jsonl" "$bs" >"$W/eval-cmp.txt" 2>&1 <<'PY'
import json, sys
dev = next(json.loads(l) for l in open(sys.argv[1]) if l.startswith("{"))
cpu = next(json.loads(l) for l in open(sys.argv[2]) if l.startswith("{"))
want = [r for r in map(json.loads, open(sys.argv[3])) if "eval_loss" in r and r["step"] == int(sys.argv[4])][0]
print("trainer @ %s: loss %.5f tau_hat %.4f tau_walk %.4f" % (sys.argv[4], want["eval_loss"], want["eval_tau_hat"], want["eval_tau_walk"]))
print("eval device : loss %.5f tau_hat %.4f tau_walk %.4f" % (dev["eval_loss"], dev["eval_tau_hat"], dev["eval_tau_walk"]))
print("eval cpu    : loss %.5f tau_hat %.4f tau_walk %.4f" % (cpu["eval_loss"], cpu["eval_tau_hat"], cpu["eval_tau_walk"]))
same = all(dev[k] == want[k] for k in ("eval_rows", "eval_blocks", "eval_tau_hat", "eval_tau_walk", "eval_acc"))
same = same and abs(dev["eval_loss"] - want["eval_loss"]) < 1e-3 * want["eval_loss"]
near = abs(cpu["eval_tau_walk"] - dev["eval_tau_walk"]) < 0.02 * dev["eval_tau_walk"] and \
    abs(cpu["eval_loss"] - dev["eval_loss"]) < 0.01 * dev["eval_loss"]
print("SAME" if same else "DIFFERENT", "NEAR" if near else "FAR")
PY
cat "$W/eval-cmp.txt"
# on the CPU the trainer evaluates its f32 weights, the export is their BF16 rounding
[ "$DEV" = cpu ] || check "dflash eval --device $DEV = the trainer's evaluation at step $bs" grep -q "^SAME" "$W/eval-cmp.txt"
check "dflash eval on the CPU agrees (tau_walk 2%, loss 1%)" grep -q " NEAR$" "$W/eval-cmp.txt"

# 4. --init-from the export on the device
IA="--device $DEV --init-from $W/xBest --cache $W/c-train --target $MODEL $EV --quiet"
"$D" train $IA --steps 0 --out "$W/runI0" >"$W/trainI0.log" 2>&1
check "--init-from --steps 0 exports the same weights" cmp -s "$W/xBest/model.safetensors" "$W/runI0/export/model.safetensors"
IA1="$IA --steps 40 --lr 3e-4 --log-every 1 --ckpt-every 20"
"$D" train $IA1 --out "$W/runI1" >"$W/trainI1.log" 2>&1
first() { grep -m1 '"loss"' "$1" | sed -E 's/.*"loss":([0-9.]+).*/\1/'; }
la=$(first "$W/runA/log.jsonl"); lb=$(awk '/"loss"/ && !/eval/ { l = $0 } END { print l }' "$W/runA/log.jsonl" | sed -E 's/.*"loss":([0-9.]+).*/\1/')
li=$(first "$W/runI1/log.jsonl")
echo "loss: runA first $la, last $lb; the fine-tune's first $li"
check "the fine-tune starts at the trained loss" awk -v a="$la" -v z="$lb" -v i="$li" 'BEGIN { exit !(i != "" && i < z + 0.3 && i < a - 0.5) }'
"$D" train $IA1 --out "$W/runI2" --stop-after 25 >"$W/trainI2.log" 2>&1
"$D" train $IA1 --out "$W/runI2" >>"$W/trainI2.log" 2>&1
check "the fine-tune, stopped at 25 and resumed, ends on the same bits" cmp -s "$W/runI1/export/model.safetensors" "$W/runI2/export/model.safetensors"
echo "workflow: $(el)"

# 5. real tau of the best export
if [ "${REAL_TAU:-0}" = 1 ]; then
  timeout "${REAL_TAU_TIMEOUT:-300}" python3 -u "$ROOT/scripts/specforge_tau.py" --target "$MODEL" --eval-corpus "$W/eval.jsonl" \
    --drafter "best=$W/xBest" --prompts "${SF_PROMPTS:-16}" --json-out "$W/real-tau.json" >"$W/real-tau.log" 2>&1
  grep -v "prompt .* decoded" "$W/real-tau.log" | tail -3
  check "SpecForge's DFlashDraftModel decodes with the export" grep -q '"tau"' "$W/real-tau.json"
fi
echo "gpu-workflow: $n checks, $bad failed ($(el))"
[ $bad = 0 ]
