#!/usr/bin/env bash
# bench-train-ab.sh A_DIR B_DIR LOG [ROUNDS] [TRAIN_ARGS...]: the 27B-shape fp8 training step
# (scripts/train27b.sh: bench-train.sh's shape and synthetic cache), A and B alternately ROUNDS
# times (default 2), STEPS steps a run (default 12) over SAMPLES rows (default 12): per run the
# median of steps 4 on, peak memory and median power; B - A of the medians; whether the first
# runs' losses match step by step (else B - A: the mean, and per window of 20 steps, a loss curve
# comparison with e.g. STEPS=240 SAMPLES=24). A_DIR, B_DIR hold a dflash binary each (the same
# one for an option A/B: B_ARGS="..." goes to the B side only). Run on the GPU machine; a
# measurement, never run by tests.
set -u
A=$1; B=$2; L=$3; R=${4:-2}; shift 4 || shift $#
W=/tmp/tb; rm -rf $W; mkdir -p $W $L
source "$(cd "$(dirname "$0")" && pwd)/train27b.sh"
train27b_setup "$A" "$W" "${SAMPLES:-12}" "$L" >/dev/null || { echo "synth FAILED"; exit 1; }
TA=("${TA27[@]}" --buffered-io --device cuda --steps "${STEPS:-12}" --fp8 "$@")
for i in $(seq 1 $R); do for s in a b; do
  D=$A; [ $s = b ] && D=$B
  nvidia-smi --query-gpu=power.draw,clocks.sm --format=csv,noheader,nounits -lms 200 > $L/pw-$s$i.csv 2>/dev/null & P=$!
  X=(); [ $s = b ] && [ -n "${B_ARGS:-}" ] && X=($B_ARGS)
  timeout $((120 + ${STEPS:-12} / 2)) $D/dflash train "${TA[@]}" "${X[@]}" --out $W/r$s$i > $L/train-$s$i.log 2>&1; echo "run $s$i rc=$?"
  kill $P 2>/dev/null; wait $P 2>/dev/null
  cp $W/r$s$i/log.jsonl $L/$s$i.jsonl 2>/dev/null
done; done
python3 - $L $R <<'PY'
import json,statistics,sys
L,R=sys.argv[1],int(sys.argv[2])
def ld(f): return [json.loads(l) for l in open(f) if '"loss"' in l]
res={}
for s in 'ab':
  for i in range(1,R+1):
    try: r=ld(f'{L}/{s}{i}.jsonl')
    except Exception as e: print(s,i,'missing',e); continue
    res[(s,i)]=r
    t=[x['step_s']*1e3 for x in r[3:]]
    pw=[]
    try:
      for l in open(f'{L}/pw-{s}{i}.csv'):
        a=l.split(','); pw.append(float(a[0]))
    except Exception: pass
    hi=max(pw) if pw else 0
    print('%s%d: median %.1f ms (steps 4-%d: %s), peak %.1f GiB, power median %.0f W' % (s,i,statistics.median(t),len(r),' '.join('%.0f'%x for x in t) if len(t) <= 30 else '%d steps' % len(t),max(x['mem_gib'] for x in r),statistics.median([p for p in pw if p>hi/2]) if pw else 0))
a=[statistics.median([x['step_s']*1e3 for x in res[('a',i)][3:]]) for i in range(1,R+1) if ('a',i) in res]
b=[statistics.median([x['step_s']*1e3 for x in res[('b',i)][3:]]) for i in range(1,R+1) if ('b',i) in res]
if a and b: print('A %s  B %s  B-A of medians %+.1f ms (%+.2f%%)' % (a,b,statistics.median(b)-statistics.median(a),100*(statistics.median(b)/statistics.median(a)-1)))
if ('a',1) in res and ('b',1) in res:
  la=[x['loss'] for x in res[('a',1)]]; lb=[x['loss'] for x in res[('b',1)]]
  print('losses a1 vs b1 identical step by step:', la==lb)
  n=min(len(la),len(lb))
  if la!=lb and n:
    print('  b1 - a1 over %d steps: mean %+.4f, last %+.4f' % (n, sum(lb[:n])/n-sum(la[:n])/n, lb[n-1]-la[n-1]))
    for i in range(0,n,20):
      wa=la[i:min(i+20,n)]; wb=lb[i:min(i+20,n)]
      print('  steps %d-%d: a %.4f b %.4f b-a %+.4f' % (i+1,i+len(wa),sum(wa)/len(wa),sum(wb)/len(wb),sum(wb)/len(wb)-sum(wa)/len(wa)))
PY
