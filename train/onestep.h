/* onestep.h - one training step's loss and gradients from a safetensors file,
 * so anyone can check us against their own reference implementation.
 *
 * Input (the format scripts/dflash_reference.py writes):
 *   metadata "config": JSON {hidden_size, num_target_features, vocab_size,
 *     block_size, num_attention_heads, num_key_value_heads, head_dim,
 *     intermediate_size, num_hidden_layers, sliding_window, layer_types[],
 *     rms_norm_eps, rope_theta, mask_token_id}
 *   F32 feat [S, K*H]; I32 ctx_pos [S]; I32 anchor, doc_start, valid [n_blocks];
 *   I32 block_ids, block_pos, labels [n_blocks*bs]; F32 weights [n_blocks*bs];
 *   F32 embed, head [V, H]; F32 "param.<name>" for every drafter weight
 *   (docs/DRAFTER.md names).
 * Output: F32 "loss" [1] (sum(w*CE)/sum(w) over labelled positions), F32
 *   "tau_hat" [1], F32 "acc" [bs] (acc[k]; acc[0] = 0), F32 "grad.<name>" for
 *   every weight.
 */
#ifndef DF_ONESTEP_H
#define DF_ONESTEP_H

#include "err.h"

typedef struct df_onestep_result {
    double loss, tau_hat;
    int n_params;
} df_onestep_result;

int df_train_onestep(const char *in_path, const char *out_path, df_onestep_result *res,
                     df_err *e);

#endif
