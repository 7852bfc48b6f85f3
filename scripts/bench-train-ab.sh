#!/usr/bin/env bash
# bench-train-ab.sh A_DIR B_DIR LOG [ROUNDS] [TRAIN_ARGS...]: the 27B-shape fp8 training step (the
# synthetic cache of bench-train.sh), A and B alternately ROUNDS times (default 2), 12 steps a run:
# per run the median of steps 4-12, peak memory and median power; B - A of the medians; whether
# the first runs' losses match step by step (else both, step by step). A_DIR, B_DIR hold a dflash
# binary each (the same one for an option A/B: B_ARGS="..." goes to the B side only). Run on the
# GPU machine; a measurement, never run by tests.
set -u
A=$1; B=$2; L=$3; R=${4:-2}; shift 4 || shift $#
W=/tmp/tb; rm -rf $W; mkdir -p $W $L
python3 -c "
import json; json.dump(dict(model_type='qwen3_5_text', hidden_size=5120, num_hidden_layers=64,
  num_attention_heads=24, num_key_value_heads=4, head_dim=256, intermediate_size=17408, vocab_size=248320,
  rope_theta=1e7, partial_rotary_factor=0.25, linear_num_key_heads=16, linear_num_value_heads=48,
  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
  max_position_embeddings=262144, attn_output_gate=True, hidden_act='silu',
  layer_types=['linear_attention' if (i + 1) % 4 else 'full_attention' for i in range(64)]),
  open('$W/config.json', 'w'))"
$A/dflash cache synth --out $W/cache --samples 12 --hidden 5120 --target-layers 64 --layers 5 --min-tokens 4096 --max-tokens 4096 > $L/synth.log 2>&1
cat $W/cache/* > /dev/null
TA=(--cache $W/cache --random-target $W/config.json --layers 5 --layer-types sliding,sliding,sliding,sliding,full
    --heads 32 --kv-heads 8 --head-dim 128 --intermediate 17408 --block-size 16 --max-tokens 4096 --max-anchors 512
    --mask-token 248070 --log-every 1 --no-ckpt --buffered-io --device cuda --steps 12 --fp8 "$@")
for i in $(seq 1 $R); do for s in a b; do
  D=$A; [ $s = b ] && D=$B
  nvidia-smi --query-gpu=power.draw,clocks.sm --format=csv,noheader,nounits -lms 200 > $L/pw-$s$i.csv 2>/dev/null & P=$!
  X=(); [ $s = b ] && [ -n "${B_ARGS:-}" ] && X=($B_ARGS)
  timeout 120 $D/dflash train "${TA[@]}" "${X[@]}" --out $W/r$s$i > $L/train-$s$i.log 2>&1; echo "run $s$i rc=$?"
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
    print('%s%d: median %.1f ms (steps 4-%d: %s), peak %.1f GiB, power median %.0f W' % (s,i,statistics.median(t),len(r),' '.join('%.0f'%x for x in t),max(x['mem_gib'] for x in r),statistics.median([p for p in pw if p>hi/2]) if pw else 0))
a=[statistics.median([x['step_s']*1e3 for x in res[('a',i)][3:]]) for i in range(1,R+1) if ('a',i) in res]
b=[statistics.median([x['step_s']*1e3 for x in res[('b',i)][3:]]) for i in range(1,R+1) if ('b',i) in res]
if a and b: print('A %s  B %s  B-A of medians %+.1f ms (%+.2f%%)' % (a,b,statistics.median(b)-statistics.median(a),100*(statistics.median(b)/statistics.median(a)-1)))
if ('a',1) in res and ('b',1) in res:
  la=[x['loss'] for x in res[('a',1)]]; lb=[x['loss'] for x in res[('b',1)]]
  print('losses a1 vs b1 identical step by step:', la==lb)
  if la!=lb: print('  a1/b1 by step: ' + ' '.join('%.4f/%.4f' % x for x in zip(la,lb)), ' mean b-a %+.4f' % (sum(lb)/len(lb)-sum(la)/len(la)))
PY
