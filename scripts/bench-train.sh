#!/usr/bin/env bash
# bench-train.sh BUILD LOGDIR: the Qwen3.6-27B drafter shape (5 layers, 4 sliding + 1 full,
# hidden 5120, 32/8 heads x 128, MLP 17408, 4096-token rows, 512 anchors x 16, vocab 248320)
# trained on one GPU from a cache of synthetic features, against SpecForge's own PyTorch step
# (bench_dflash_torch.py in $BENCH_DIR, SpecForge files in $SPECFORGE_SRC) in the same run.
#
# Rows are read through the page cache (--buffered-io, warmed first) so the figures are about
# compute; a second 2-GPU run reads the cache from the disk (O_DIRECT) to show what it allows.
# Env: DISK=0 skips the run from the disk; RECOMPUTE=0 the 1-GPU run with --no-recompute
# (every activation kept; the default recomputes the cheap ones);
# OVERLAP=0 skips the 1-GPU run with --no-overlap-optimizer (the default overlaps the optimizer);
# RECOMPUTE_MLP=1 adds one with --recompute-mlp; NOALIAS=1 one with --no-grad-alias; FP8=1 one with
# --fp8 (FP8 training, docs/FP8.md; its loss printed against the BF16 run's, step by step; FP8_ARGS: more
# options for it and its profiled run); STEPS (timed run, default 14), SAMPLES (4096-token documents in the cache, default 12),
# GPUS (also run on this many GPUs, one process each; default: 2 when two are visible),
# PROFILE (default 1: a short extra run with DFLASH_PROFILE=1, GPU time per op; 0 skips it; PROFILE_GPUS=N also on N GPUs),
# SPECFORGE_SRC (default .anchors_src; skipped when absent), BENCH_DIR (the folder of
# bench_dflash_torch.py, the PyTorch baseline, which is not part of this repository; default
# .device/bench; skipped with a note naming BENCH_DIR when absent), WORK (default /tmp/dflash-trainbench).
# Prints a table last; full logs in LOGDIR.
set -u
B=${1:?build dir}; LOG=${2:?log dir}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=${WORK:-/tmp/dflash-trainbench}
STEPS=${STEPS:-14}; SAMPLES=${SAMPLES:-12}
SRC=${SPECFORGE_SRC:-$ROOT/.anchors_src}
BENCH=${BENCH_DIR:-$ROOT/.device/bench}
mkdir -p "$LOG"; rm -rf "$W"; mkdir -p "$W"
status=0
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
GPUS=${GPUS:-$([ "$ngpu" -ge 2 ] && echo 2 || echo 1)}

source "$ROOT/scripts/train27b.sh"
train27b_setup "$B" "$W" "$SAMPLES" "$LOG" || { echo "synth FAILED"; status=1; }
TA0=("${TA27[@]}")
TA=("${TA0[@]}" --buffered-io)
# (every run says its numerics: BF16 with --no-fp8, FP8 with --fp8; the default, --fp8 auto,
# would take FP8 on Hopper at this width)
# median step time (s) of the log's steps after the first 3 (warm-up: plans, allocation)
med() { python3 -c "
import json,statistics,sys
r=[json.loads(l) for l in open('$1') if '\"loss\"' in l]
r=r[3:] if len(r)>4 else r
f=lambda k: statistics.median([x[k] for x in r])
peak=max(x['mem_gib'] for x in r); x=r[-1]
above=peak-x.get('mem_base_gib',0)-x.get('persistent_gib',0)
# the wait of the rank that waited longest (the others wait for it in the collectives)
for x in r: x['dw'] = x.get('data_wait_max', x.get('data_wait', 0))
w=sum(1 for x in r if x['dw']>0.01)  # a median of 0 can hide some waiting steps
print('%.1f %.0f %.0f %.3f %.1f %.4f %.2f %d/%d' % (1e3*f('step_s'), f('tokens_per_s'), f('tflops'), f('mfu'), peak, f('dw'), above, w, len(r)))
"; }
# the GPU's power and SM clock beside a timed run (nvidia-smi every 200 ms; PW=0 skips):
# pw_start NAME before it, pw_stop after; pw_sum NAME: medians over the samples drawing more than
# half the run's peak power (the steps, not the start-up), and how often the power cap held the clock
PWQ=clocks_event_reasons.sw_power_cap # (older drivers: clocks_throttle_reasons)
nvidia-smi --query-gpu=$PWQ --format=csv,noheader >/dev/null 2>&1 || PWQ=clocks_throttle_reasons.sw_power_cap
pw_start() { [ "${PW:-1}" = 1 ] || return 0; nvidia-smi --query-gpu=power.draw,clocks.sm,power.limit,$PWQ \
  --format=csv,noheader,nounits -lms 200 >"$LOG/power-$1.csv" 2>/dev/null & PWPID=$!; }
pw_stop() { [ -n "${PWPID:-}" ] && kill "$PWPID" 2>/dev/null; wait "$PWPID" 2>/dev/null; PWPID=; }
pw_sum() { [ -s "$LOG/power-$1.csv" ] && python3 -c "
import statistics
r=[]
for l in open('$LOG/power-$1.csv'):
    f=[x.strip() for x in l.split(',')]
    try: r.append((float(f[0]), float(f[1]), float(f[2]), f[3] if len(f) > 3 else '?'))
    except (ValueError, IndexError): pass
if not r: raise SystemExit
hi=max(x[0] for x in r); b=[x for x in r if x[0] > hi/2]
cap=sum(1 for x in b if x[3].lower().startswith('active'))
print('%.0f W (limit %.0f, max %.0f), SM %.0f MHz (min %.0f), power-capped in %d of %d samples' % (statistics.median(x[0] for x in b),
  b[0][2], hi, statistics.median(x[1] for x in b), min(x[1] for x in b), cap, len(b)))" || echo "no samples"; }
oursf="not run"; oursna="not run"; ours="FAILED"; ours2="not run"; ours2d="not run"; oursrc="not run"; oursov="not run"; oursrm="not run"
# the disk's own read rate (O_DIRECT, one cache shard), for the data-wait figures
disk=$(f=$(ls -S "$W"/cache/*.dfc 2>/dev/null | head -1); [ -n "$f" ] && dd if="$f" of=/dev/null bs=16M iflag=direct 2>&1 | tail -1 | sed 's/.*, //')
if [ $status = 0 ]; then
  pw_start bf16
  if "$B/dflash" train "${TA[@]}" --no-fp8 --out "$W/run1" --device cuda --steps "$STEPS" >"$LOG/train-1gpu.log" 2>&1; then
    pw_stop; cp "$W/run1/log.jsonl" "$LOG/train-1gpu.jsonl"; ours=$(med "$W/run1/log.jsonl")
  else status=1; fi
  pw_stop
  if [ "${RECOMPUTE:-1}" = 1 ]; then # more memory: every activation kept (the default recomputes)
    if "$B/dflash" train "${TA[@]}" --no-fp8 --out "$W/runrc" --device cuda --steps "$STEPS" --no-recompute \
         >"$LOG/train-1gpu-recompute.log" 2>&1; then
      cp "$W/runrc/log.jsonl" "$LOG/train-1gpu-recompute.jsonl"; oursrc=$(med "$W/runrc/log.jsonl")
    else oursrc="FAILED"; status=1; fi
  fi
  if [ "${OVERLAP:-1}" = 1 ]; then # the optimizer after the backward, not overlapping the next forward
    if "$B/dflash" train "${TA[@]}" --no-fp8 --out "$W/runov" --device cuda --steps "$STEPS" --no-overlap-optimizer \
         >"$LOG/train-1gpu-no-overlap.log" 2>&1; then
      cp "$W/runov/log.jsonl" "$LOG/train-1gpu-no-overlap.jsonl"; oursov=$(med "$W/runov/log.jsonl")
    else oursov="FAILED"; status=1; fi
  fi
  if [ "${RECOMPUTE_MLP:-0}" = 1 ]; then # least memory: the MLP's gate/up GEMMs recomputed too
    if "$B/dflash" train "${TA[@]}" --no-fp8 --out "$W/runrm" --device cuda --steps "$STEPS" --recompute-mlp \
         >"$LOG/train-1gpu-recompute-mlp.log" 2>&1; then
      cp "$W/runrm/log.jsonl" "$LOG/train-1gpu-recompute-mlp.jsonl"; oursrm=$(med "$W/runrm/log.jsonl")
    else oursrm="FAILED"; status=1; fi
  fi
  if [ "${FP8:-0}" = 1 ]; then # the GEMMs' operands rounded to E4M3 (docs/FP8.md)
    pw_start fp8
    if "$B/dflash" train "${TA[@]}" --out "$W/runf" --device cuda --steps "$STEPS" --fp8 ${FP8_ARGS:-} \
         >"$LOG/train-1gpu-fp8.log" 2>&1; then
      pw_stop; cp "$W/runf/log.jsonl" "$LOG/train-1gpu-fp8.jsonl"; oursf=$(med "$W/runf/log.jsonl")
    else oursf="FAILED"; status=1; fi
    pw_stop
  fi
  if [ "${NOALIAS:-0}" = 1 ]; then # activations apart from the gradients
    if "$B/dflash" train "${TA[@]}" --no-fp8 --out "$W/runna" --device cuda --steps "$STEPS" --no-grad-alias \
         >"$LOG/train-1gpu-no-alias.log" 2>&1; then
      cp "$W/runna/log.jsonl" "$LOG/train-1gpu-no-alias.jsonl"; oursna=$(med "$W/runna/log.jsonl")
    else oursna="FAILED"; status=1; fi
  fi
  if [ "${PROFILE:-1}" = 1 ]; then
    DFLASH_PROFILE=1 DFLASH_LOG=info "$B/dflash" train "${TA[@]}" --no-fp8 --out "$W/runp" --device cuda --steps 4 \
      >"$LOG/train-profile.log" 2>&1 || status=1
    if [ "${FP8:-0}" = 1 ]; then # the fp8 step's ops: the rounding passes against the GEMMs they feed
      DFLASH_PROFILE=1 DFLASH_LOG=info "$B/dflash" train "${TA[@]}" --out "$W/runpf" --device cuda --steps 4 --fp8 ${FP8_ARGS:-} \
        >"$LOG/train-profile-fp8.log" 2>&1 || status=1
    fi
    if [ "${PROFILE_GPUS:-1}" -gt 1 ]; then # the same on several GPUs: each rank logs its own
      DFLASH_PROFILE=1 DFLASH_LOG=info "$B/dflash" train "${TA[@]}" --no-fp8 --out "$W/runpn" --device cuda \
        --gpus "$PROFILE_GPUS" --steps 4 >"$LOG/train-profile-${PROFILE_GPUS}gpu.log" 2>&1 || status=1
    fi
  fi
  if [ "$GPUS" -ge 2 ]; then
    # not disk-bound: the cache read through the page cache (warm), as the 1-GPU run
    if "$B/dflash" train "${TA[@]}" --no-fp8 --out "$W/run2" --device cuda --gpus "$GPUS" --steps "$STEPS" \
         >"$LOG/train-${GPUS}gpu.log" 2>&1; then
      cp "$W/run2/log.jsonl" "$LOG/train-${GPUS}gpu.jsonl"; ours2=$(med "$W/run2/log.jsonl")
    else ours2="FAILED"; status=1; fi
    # from the disk (O_DIRECT, the default): what the disk allows (DISK=1)
    if [ "${DISK:-1}" = 1 ] && "$B/dflash" train "${TA0[@]}" --no-fp8 --out "$W/run2d" --device cuda --gpus "$GPUS" --steps "$STEPS" \
         >"$LOG/train-${GPUS}gpu-disk.log" 2>&1; then
      cp "$W/run2d/log.jsonl" "$LOG/train-${GPUS}gpu-disk.jsonl"; ours2d=$(med "$W/run2d/log.jsonl")
    elif [ "${DISK:-1}" = 1 ]; then ours2d="FAILED"; status=1; fi
  fi
fi
sf="not run (no $SRC)"
if [ -d "$SRC/specforge" ] && [ ! -f "$BENCH/bench_dflash_torch.py" ]; then
  sf="not run (no $BENCH/bench_dflash_torch.py: set BENCH_DIR to its folder)"
elif [ -d "$SRC/specforge" ]; then
  if python3 "$BENCH/bench_dflash_torch.py" --src "$SRC" --json-out "$LOG/specforge.json" >"$LOG/specforge.log" 2>&1; then
    sf=$(python3 -c "
import json; r=json.load(open('$LOG/specforge.json'))
print('%.1f ms/step (fwd %.1f bwd %.1f opt %.1f), %.0f model TFLOP/s, peak %.1f GiB (before step %.1f)' % (r['step_ms_median'], r['fwd_ms_median'], r['bwd_ms_median'], r['opt_ms_median'], r['model_tflops_per_s'], r['peak_mem_step_gib'], r['mem_before_step_gib']))")
  else sf="FAILED (specforge.log)"; status=1; fi
fi
rm -rf "$W"

echo
echo "== bench-train ($(date -u +%FT%TZ), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) x $ngpu, code $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?') + $(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) changed files${DFLASH_ATTN_BWD:+, DFLASH_ATTN_BWD=$DFLASH_ATTN_BWD})"
echo "ours, 1 GPU   (ms/step tok/s TFLOP/s MFU peak-GiB data-wait above-persistent-GiB steps-waiting): $ours"
echo "  (above-persistent = peak - the CUDA context and handles before the trainer's memory - persistent state)"
# per step: the step, the wait, the feeder's build and its cache reads (a wait with a slow build: the host)
[ -f "$LOG/train-1gpu.jsonl" ] && python3 -c "
import json
r=[json.loads(l) for l in open('$LOG/train-1gpu.jsonl') if '\"loss\"' in l]
print('  1 GPU per step, ms (step/wait/build/read): ' + ' '.join('%.0f/%.0f/%.0f/%.0f' % (1e3*x['step_s'], 1e3*x['step_s']*x['data_wait'], 1e3*x.get('feed_build_s',0), 1e3*x.get('feed_read_s',0)) for x in r))"
echo "  power / clock, bf16 run: $(pw_sum bf16)"
echo "ours, 1 GPU, --no-recompute (same fields):                     $oursrc"
echo "ours, 1 GPU, --no-overlap-optimizer (same fields):             $oursov"
echo "ours, 1 GPU, --recompute-mlp (same fields):                    $oursrm"
echo "ours, 1 GPU, --no-grad-alias (same fields):                   $oursna"
echo "ours, 1 GPU, --fp8 (same fields):                              $oursf"
[ -f "$LOG/power-fp8.csv" ] && echo "  power / clock, fp8 run: $(pw_sum fp8)"
# the two runs see the same rows in the same order: their losses step by step
[ -f "$LOG/train-1gpu-fp8.jsonl" ] && [ -f "$LOG/train-1gpu.jsonl" ] && python3 -c "
import json
ld=lambda f: {x['step']: x['loss'] for x in map(json.loads, open(f)) if 'loss' in x}
b, f = ld('$LOG/train-1gpu.jsonl'), ld('$LOG/train-1gpu-fp8.jsonl')
s = sorted(set(b) & set(f))
print('  loss bf16 / fp8 by step: ' + ' '.join('%d:%.4f/%.4f' % (k, b[k], f[k]) for k in s))
if s: print('  fp8 - bf16 loss: mean %+.4f over %d steps, last %+.4f' % (sum(f[k] - b[k] for k in s) / len(s), len(s), f[s[-1]] - b[s[-1]]))
w = max(1, len(s) // 12)  # a long run: the curves as means over 12 windows of steps
if len(s) >= 48:
    print('  loss by window of %d steps (first step: bf16 mean / fp8 mean / fp8 - bf16):' % w)
    for i in range(0, len(s) - w + 1, w):
        ks = s[i:i + w]; mb = sum(b[k] for k in ks) / w; mf = sum(f[k] for k in ks) / w
        print('    %5d: %.4f / %.4f / %+.4f' % (ks[0], mb, mf, mf - mb))"
echo "ours, $GPUS GPUs (same fields; tok/s is the total):            $ours2"
echo "ours, $GPUS GPUs, cache read from the disk (O_DIRECT):           $ours2d"
echo "disk read rate (dd O_DIRECT, one cache shard): ${disk:-?}"
echo "SpecForge, 1 GPU: $sf"
grep -E "persistent|parameters" "$LOG/train-1gpu.log" | head -2
if [ -f "$LOG/train-profile.log" ]; then
  echo "-- GPU time per op over the 4-step profiled run (DFLASH_PROFILE=1)"
  grep -A40 "cuda profile" "$LOG/train-profile.log" | head -40
fi
if [ -f "$LOG/train-profile-fp8.log" ]; then
  echo "-- the same for the fp8 step, and the gaps between ops on each stream"
  grep -A200 "cuda profile" "$LOG/train-profile-fp8.log" | grep -E "profile|ms/call|ms/gap" | head -60
fi
if [ -f "$LOG/train-profile-${PROFILE_GPUS:-1}gpu.log" ]; then
  echo "-- the same on $PROFILE_GPUS GPUs (every rank's profile)"
  grep -A20 "cuda profile" "$LOG/train-profile-${PROFILE_GPUS}gpu.log" | grep -E "profile|lmhead|matmul|adamw|attn|nccl|comm|reduce|gather" | head -60
fi
exit $status
