# train27b.sh (sourced by bench-train.sh and bench-train-ab.sh): the Qwen3.6-27B drafter shape they
# train. train27b_setup BUILD WORK SAMPLES LOG writes WORK/config.json (a Qwen3.6-27B-shaped target for
# --random-target), a synthetic cache of SAMPLES 4096-token rows in WORK/cache (LOG/synth.log) read once
# into the page cache, and sets TA27: the train arguments of that shape (5 layers, 4 sliding + 1 full,
# hidden 5120, 32/8 heads x 128, MLP 17408, 512 anchors x 16). Status 1 when the synthesis failed.
train27b_setup() {
  local b=$1 w=$2 samples=$3 log=$4 t0 rc=0
  python3 -c "
import json; json.dump(dict(model_type='qwen3_5_text', hidden_size=5120, num_hidden_layers=64,
  num_attention_heads=24, num_key_value_heads=4, head_dim=256, intermediate_size=17408, vocab_size=248320,
  rope_theta=1e7, partial_rotary_factor=0.25, linear_num_key_heads=16, linear_num_value_heads=48,
  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
  max_position_embeddings=262144, attn_output_gate=True, hidden_act='silu',
  layer_types=['linear_attention' if (i + 1) % 4 else 'full_attention' for i in range(64)]),
  open('$w/config.json', 'w'))" || rc=1
  t0=$(date +%s)
  "$b/dflash" cache synth --out "$w/cache" --samples "$samples" --hidden 5120 --target-layers 64 --layers 5 \
    --min-tokens 4096 --max-tokens 4096 >"$log/synth.log" 2>&1 || rc=1
  echo "synthetic cache: $samples x 4096 tokens, $(du -sh "$w/cache" | cut -f1), $(($(date +%s) - t0)) s" | tee -a "$log/synth.log"
  # warm the page cache: the benchmarks are about compute, not the disk (the logs' data_wait says)
  cat "$w"/cache/* >/dev/null 2>&1
  TA27=(--cache "$w/cache" --random-target "$w/config.json" --layers 5
        --layer-types sliding,sliding,sliding,sliding,full --heads 32 --kv-heads 8 --head-dim 128
        --intermediate 17408 --block-size 16 --max-tokens 4096 --max-anchors 512 --mask-token 248070
        --log-every 1 --no-ckpt)
  return $rc
}
