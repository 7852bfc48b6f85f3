#!/usr/bin/env bash
# gpu-resume-check.sh BUILD_DIR WORK_DIR - kill -9 in the middle of a GPU extraction, rerun the
# same command, and check that the finished cache verifies and equals an uninterrupted run's
# bit for bit (`dflash cache diff`). Model: the Qwen3.5-27B layer shapes cut to 8 layers, random
# weights; corpus: 160 random documents of 300..6000 tokens. Exit 0 when all holds.
set -uo pipefail
B=${1:?build dir}
W=${2:?work dir}
rm -rf "$W"
mkdir -p "$W"
python3 - "$W" <<'EOF'
import json, random, sys
w = sys.argv[1]
c = dict(model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=8, num_attention_heads=24,
         num_key_value_heads=4, head_dim=256, intermediate_size=17408, vocab_size=248320,
         rope_theta=1e7, partial_rotary_factor=0.25, linear_num_key_heads=16, linear_num_value_heads=48,
         linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
         max_position_embeddings=262144, attn_output_gate=True, hidden_act="silu",
         layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(8)])
json.dump(c, open(f"{w}/config.json", "w"))
rng = random.Random(5)
with open(f"{w}/corpus.jsonl", "w") as f:
    for _ in range(160):
        f.write(json.dumps({"input_ids": [rng.randrange(248320) for _ in range(rng.randrange(300, 6000))]}) + "\n")
EOF
run() { "$B/dflash" extract --random-weights "$W/config.json" --data "$W/corpus.jsonl" --out "$1" \
          --layers 1,3,5 --batch-tokens 8192 --gpus 1 --quiet; }
run "$W/a" >"$W/a.log" 2>&1 || { echo "uninterrupted run failed"; cat "$W/a.log"; exit 1; }
# dflash itself in the background (not a shell function: kill -9 must hit the extractor).
"$B/dflash" extract --random-weights "$W/config.json" --data "$W/corpus.jsonl" --out "$W/b" \
  --layers 1,3,5 --batch-tokens 8192 --gpus 1 --quiet >"$W/b1.log" 2>&1 &
pid=$!
# Kill once a good part of the data is on disk (but before the end).
full=$(du -sb "$W/a" | cut -f1)
for _ in $(seq 1 600); do
  sz=$(du -sb "$W/b" 2>/dev/null | cut -f1)
  [ "${sz:-0}" -gt $((full / 3)) ] && break
  kill -0 $pid 2>/dev/null || break
  sleep 0.05
done
kill -9 $pid 2>/dev/null && killed=1 || killed=0
wait $pid 2>/dev/null
echo "killed: $killed at $(du -sb "$W/b" | cut -f1) of $full bytes"
[ "$killed" = 1 ] || { echo "the run ended before the kill: nothing tested"; exit 1; }
run "$W/b" >"$W/b2.log" 2>&1 || { echo "resumed run failed"; cat "$W/b2.log"; exit 1; }
grep -o "[0-9]* already there" "$W/b2.log" || cat "$W/b2.log"
"$B/dflash" dump "$W/b" --verify >"$W/verify.log" 2>&1 || { echo "verify failed"; tail -5 "$W/verify.log"; exit 1; }
tail -1 "$W/verify.log"
"$B/dflash" cache diff "$W/a" "$W/b" || exit 1
rm -rf "$W/a" "$W/b"
