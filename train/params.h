/* params.h - the drafter's trainable parameters as one flat fp32 array.
 *
 * Every tensor of the drafter (docs/DRAFTER.md "Parameters" names, no
 * prefix) is a slice of one contiguous fp32 buffer: optimizer state, the
 * gradient and the checkpoint all share this layout, so AdamW, clipping and
 * checkpointing are single loops over `total` floats.
 *
 * Order (and so offsets) is fixed by df_params_build():
 *   fc.weight [H, K*H], hidden_norm.weight [H], then per layer i:
 *   layers.i.input_layernorm.weight [H], layers.i.self_attn.q_proj.weight [nq*D, H],
 *   k_proj [nkv*D, H], v_proj [nkv*D, H], o_proj [H, nq*D], q_norm [D], k_norm [D],
 *   layers.i.post_attention_layernorm.weight [H], mlp.gate_proj [F, H], up_proj [F, H],
 *   down_proj [H, F]; then norm.weight [H].
 * The frozen target embedding and lm_head are not parameters.
 */
#ifndef DF_PARAMS_H
#define DF_PARAMS_H

#include <stdint.h>

#include "err.h"
#include "hfconfig.h"

typedef struct df_param {
    char name[96];
    int ndim;            /* 1 or 2 */
    int64_t shape[2];
    int64_t offset;      /* into the flat array, in floats */
    int64_t numel;
    int is_norm;         /* RMSNorm weight: initialised to 1, no weight decay */
} df_param;

typedef struct df_params {
    int n;
    df_param *p;         /* malloc'd, n entries */
    int64_t total;       /* floats in the flat array */
} df_params;

/* Builds the table for a drafter config (K = num_target_features). */
int df_params_build(const df_drafter_config *c, df_params *out, df_err *e);
void df_params_free(df_params *ps);
/* Index of a parameter by name, or -1. */
int df_params_find(const df_params *ps, const char *name);
/* Deterministic init: linear weights ~ N(0, std), norms = 1. */
void df_params_init(const df_params *ps, float *flat, float std, uint64_t seed);
/* Parameter i alone, with the bits df_params_init(seed) gives it. */
void df_params_init_one(const df_params *ps, int i, float *flat, float std, uint64_t seed);

/* fc = the mean of the K feature layers, [I ... I] / K (hidden x K*hidden); for a
 * drafter of a projected cache (c->feature_dim = b->R) that map times P^T. */
struct df_basis;
void df_params_init_fc_mean(const df_params *ps, const df_drafter_config *c,
                            const struct df_basis *b, float *flat);

/* "PREFIX=S[,PREFIX=S...]": every parameter whose name starts with PREFIX drawn
 * again with seed S (the bits that seed gives it). -EINVAL naming a bad item or a
 * prefix no parameter has. */
int df_params_init_overrides(const df_params *ps, float *flat, float std, const char *spec,
                             df_err *e);

#endif
