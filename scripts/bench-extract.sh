#!/usr/bin/env bash
# bench-extract.sh BUILD_DIR LOG_DIR - extraction throughput on the GPU machine, ours and HF
# transformers' in the same run, on random-weight models of the real shapes:
#   - Qwen3.5-27B text shape (64 layers, GDN x3 + gated attention), documents of 4096 and 8192 tokens
#   - Qwen3-32B shape (dense), 4096-token documents
#   - the 27B shape on every visible GPU (--gpus all) vs 1 GPU, when there are 2+
# Ours: `dflash extract --random-weights` writing a split-zstd cache of layers 1,16,31,46,61 to the
# local disk (forward, D2H copies, compression, io_uring writes: the whole pipeline), tokens/s
# after setup, and the fraction of the bf16 GEMM ceiling (790 TFLOP/s measured on these H200s)
# with FLOPs per token counted as flops() below does (2 x body params + causal attention + the GDN
# core estimate, the HF baseline's conventions). HF: bench_hf_extract.py, a PyTorch script that
# times HF transformers' forward with output_hidden_states on a random model of the same shape; it
# is not part of this repository (HF_BENCH names it; it writes its own JSON; HF_LAYERS overrides
# its layer count when the 64-layer init is too slow).
# Env: TOKENS (per run, default 131072), HF (1 = run the HF baselines, default 1; skipped with a
# note when HF_BENCH is absent), HF_BENCH (default .device/bench/bench_hf_extract.py),
# SHAPES (default "q35-4096 q35-8192 q3-4096"), DISK (cache folder, default /tmp/dflash-bench-x).
# EXTRACT_ARGS: more options for ours (e.g. --basis FILE: a projected cache, z = P x on the GPU).
# RUNS (default "1 all"): "1" the per-shape runs on one GPU (and HF's), "all" the 27B shape on
# every GPU. OOM_TOKENS=N: also one N-token document of the 27B shape at --batch-tokens N, too
# large for the device: its exit status and error line.
set -uo pipefail
B=${1:?build dir}
LOG=${2:?log dir}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TOKENS=${TOKENS:-131072}
HF=${HF:-1}
SHAPES=${SHAPES:-"q35-4096 q35-8192 q3-4096"}
DISK=${DISK:-/tmp/dflash-bench-x}
RUNS=${RUNS:-"1 all"}
HF_BENCH=${HF_BENCH:-$ROOT/.device/bench/bench_hf_extract.py}
hf_note=""
if [ "$HF" = 1 ] && [ ! -f "$HF_BENCH" ]; then
  hf_note="not run: no $HF_BENCH (set HF_BENCH to bench_hf_extract.py, or HF=0)"
  echo "bench-extract: HF baseline $hf_note" >&2
  HF=0
fi
mkdir -p "$LOG" "$DISK"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)

# Configs and corpora (random ids; documents of exactly S tokens).
python3 - "$LOG" "$TOKENS" <<'EOF'
import json, os, random, sys
log, tokens = sys.argv[1], int(sys.argv[2])
q35 = dict(model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
           num_key_value_heads=4, head_dim=256, intermediate_size=17408, vocab_size=248320,
           rope_theta=10000000.0, partial_rotary_factor=0.25, linear_num_key_heads=16,
           linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
           linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
           attn_output_gate=True, full_attention_interval=4, hidden_act="silu",
           layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(64)])
q3 = dict(model_type="qwen3", hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
          num_key_value_heads=8, head_dim=128, intermediate_size=25600, vocab_size=151936,
          rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960, hidden_act="silu",
          tie_word_embeddings=False)
for name, cfg in (("q35", q35), ("q3", q3)):
    os.makedirs(f"{log}/{name}", exist_ok=True)
    json.dump(cfg, open(f"{log}/{name}/config.json", "w"), indent=1)
    for S in (4096, 8192):
        rng = random.Random(S)
        with open(f"{log}/{name}-{S}.jsonl", "w") as f:
            for _ in range(max(1, tokens // S)):
                f.write(json.dumps({"input_ids": [rng.randrange(cfg["vocab_size"]) for _ in range(S)]}) + "\n")
EOF

# FLOPs per token: 2 x body params + causal attention + GDN core (the HF script's conventions).
flops() { python3 - "$1" "$2" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1])); S = int(sys.argv[2])
H, L, F = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
nq, nkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
lt = c.get("layer_types") or ["full_attention"] * L
mlp = 3 * H * F + 2 * H
gated = 2 if c.get("attn_output_gate") else 1
attn = H * nq * D * gated + 2 * H * nkv * D + nq * D * H + 2 * D
if c["model_type"].startswith("qwen3_5"):
    hk, hv, dk, dv = (c[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                      "linear_key_head_dim", "linear_value_head_dim"))
    conv = 2 * hk * dk + hv * dv
    gdn = H * conv + H * hv * dv + 2 * H * hv + conv * 4 + 2 * hv + dv + hv * dv * H
    per_head = 4 * 64 * dk + 64 * (dk + dv) + 6 * dk * dv + 2 * 64 * dv
    gdn_core = hv * per_head + 2 * 4 * conv
else:
    gdn = gdn_core = 0
body = sum(mlp + (attn if t == "full_attention" else gdn) for t in lt) + H
n_full = sum(t == "full_attention" for t in lt)
f = 2 * body + n_full * 4 * nq * D * (S + 1) / 2 + sum(t != "full_attention" for t in lt) * gdn_core
print(f"{f:.6e}")
EOF
}

row() { printf '%-34s %s\n' "$1" "$2"; }
ours() { # name S gpus -> prints tok/s (after setup, whole pipeline) and forward-only tok/s
  local name=$1 S=$2 g=$3 out="$DISK/c-$1-$2-$3"
  rm -rf "$out"
  "$B/dflash" extract --random-weights "$LOG/$name/config.json" --data "$LOG/$name-$S.jsonl" \
    --out "$out" --layers 1,16,31,46,61 --batch-tokens "$S" --gpus "$g" ${EXTRACT_ARGS:-} \
    --stats-json "$LOG/ours-$name-$S-g$g.json" >"$LOG/ours-$name-$S-g$g.log" 2>&1 || {
      echo "FAILED"; tail -5 "$LOG/ours-$name-$S-g$g.log" >&2; return 1; }
  python3 - "$LOG/ours-$name-$S-g$g.json" "$g" <<'EOF'
import glob, json, sys
base, g = sys.argv[1], int(sys.argv[2])
files = sorted(glob.glob(base + ".rank*")) if g > 1 else [base]
st = [json.load(open(f)) for f in files]
tok = sum(s["tokens"] for s in st)
wall = max(s["seconds"] - s["setup_seconds"] for s in st)
fwd = max(s["forward_seconds"] for s in st)
wait = max(s["writer_wait_seconds"] for s in st)
ratio = sum(s["stored_bytes"] for s in st) / max(1, sum(s["raw_bytes"] for s in st))
mem = max(s.get("mem_peak_bytes", -1) for s in st) / 2**30
mem0 = max(s.get("mem_setup_bytes", -1) for s in st) / 2**30
print(f"{tok / wall:.0f} {tok / fwd / len(st) * len(st):.0f} {100 * wait / wall:.1f} {ratio:.3f} {mem0:.2f} {mem:.2f}")
EOF
  rm -rf "$out"
}

{
echo "== bench-extract ($(date -u +%FT%TZ)) on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$NGPU"
[ -n "$hf_note" ] && row "HF transformers" "$hf_note"
for sh in $(case " $RUNS " in *" 1 "*) echo "$SHAPES";; esac); do
  name=${sh%-*}; S=${sh#*-}
  f=$(flops "$LOG/$name/config.json" "$S")
  r=$(ours "$name" "$S" 1) || r="FAILED"
  set -- $r
  if [ "$1" != FAILED ]; then
    tflops=$(python3 -c "print(f'{$1 * $f / 1e12:.0f}')")
    row "ours $sh 1 GPU" "$1 tok/s ($tflops TFLOP/s, $(python3 -c "print(f'{100 * $1 * $f / 790e12:.0f}')")% of 790; forward alone $2 tok/s; writer-bound $3%; ratio $4; device memory $5 GiB after load, $6 GiB peak)"
    ours_tps=$1
  else
    row "ours $sh 1 GPU" "FAILED (see ours-$name-$S-g1.log)"; ours_tps=0
  fi
  if [ "$HF" = 1 ]; then
    dense=""; [ "$name" = q3 ] && dense="--dense"
    hl=""; [ -n "${HF_LAYERS:-}" ] && hl="--layers $HF_LAYERS"
    timeout 900 python3 "$HF_BENCH" $dense $hl --seq-len "$S" --json-out "$LOG/hf-$sh.json" \
      >"$LOG/hf-$sh.log" 2>&1
    if [ -f "$LOG/hf-$sh.json" ]; then
      row "HF transformers $sh" "$(python3 - "$LOG/hf-$sh.json" "$ours_tps" <<'EOF2'
import json, sys
d = json.load(open(sys.argv[1])); ours = float(sys.argv[2]); L = d["num_layers"]
tps = d["tokens_per_s"] * L / 64  # per-layer cost ~constant: scaled to the 64-layer model
print(f"{d['tokens_per_s']:.0f} tok/s with {L} layers" + (f" (= {tps:.0f} scaled to 64)" if L != 64 else "")
      + f", {d['achieved_tflops_per_s']:.0f} TFLOP/s; ours / HF = {ours / tps:.2f}")
EOF2
)"
    else
      row "HF transformers $sh" "FAILED (see hf-$sh.log)"
    fi
  fi
done
if [ "${PROFILE:-0}" = 1 ]; then # where the GPU time goes: the backend's per-op event timing
  for name in q35 q3; do
    rm -rf "$DISK/prof"
    DFLASH_PROFILE=1 DFLASH_LOG=info "$B/dflash" extract --random-weights "$LOG/$name/config.json" \
      --data "$LOG/$name-4096.jsonl" --out "$DISK/prof" --layers 1,16,31,46,61 --batch-tokens 4096 \
      --gpu 0 --quiet >"$LOG/prof-$name.log" 2>&1
    echo "-- GPU time by op, $name 4096 (DFLASH_PROFILE=1)"
    grep -A30 "cuda profile" "$LOG/prof-$name.log" | sed 's/^dflash info: //' | head -20
  done
  rm -rf "$DISK/prof"
fi
if [ -n "${OOM_TOKENS:-}" ]; then # a batch that cannot fit: a clean error, not a crash
  python3 -c "import json, random; r = random.Random(1); print(json.dumps({'input_ids':
    [r.randrange(248320) for _ in range($OOM_TOKENS)]}))" >"$LOG/q35-oom.jsonl"
  rm -rf "$DISK/oom"
  "$B/dflash" extract --random-weights "$LOG/q35/config.json" --data "$LOG/q35-oom.jsonl" \
    --out "$DISK/oom" --layers 1,16,31,46,61 --batch-tokens "$OOM_TOKENS" --gpus 1 >"$LOG/oom.log" 2>&1
  rc=$?
  row "one $OOM_TOKENS-token document" "exit $rc: $(grep -v '^\s*$' "$LOG/oom.log" | tail -1 | cut -c1-300)"
  rm -rf "$DISK/oom"
fi
if [ "$NGPU" -ge 2 ] && case " $RUNS " in *" all "*) true;; *) false;; esac; then
  r=$(ours q35 4096 "$NGPU") || r="FAILED"
  set -- $r
  row "ours q35-4096 $NGPU GPUs" "$1 tok/s total (writer-bound ${3:-?}%)"
fi
} 2>&1 | tee "$LOG/bench-extract.txt"
