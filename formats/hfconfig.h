/* hfconfig.h - Hugging Face config.json of the target model, and the DFlash
 * drafter's config.json (docs: spec TARGETS.md, docs/DRAFTER.md).
 *
 * Target configs: model_type "qwen3" (dense), "qwen3_5" (hybrid; the text
 * part under "text_config", whose model_type is "qwen3_5_text") or a bare
 * "qwen3_5_text". Everything the forward pass needs is read into a plain,
 * copyable struct. Keys that change the numbers (sizes, heads, eps, theta)
 * are required: a missing one is an error naming the key, never a silent
 * default. Keys whose absence has one meaning in transformers are defaulted
 * the same way (num_key_value_heads = num_attention_heads, sliding_window
 * null = none, tie_word_embeddings false, qwen3_5 attn_output_gate true and
 * partial_rotary_factor 0.25, qwen3 layer_types from use_sliding_window and
 * max_window_layers, qwen3_5 layer_types from full_attention_interval).
 * For qwen3_5, keys absent from text_config are looked up at the top level.
 *
 * rope_theta comes from rope_parameters.rope_theta (transformers 5), else
 * the top-level rope_theta (transformers 4), else rope_scaling.rope_theta;
 * partial_rotary_factor likewise from rope_parameters first.
 *
 * Errors: -EINVAL for a missing key, a wrong type or an absurd value (the
 * message names the file and the key, e.g. "config.json: text_config.
 * num_key_value_heads: 5 does not divide num_attention_heads 24"), -ENOTSUP
 * for an unknown model_type or rope type, -DF_ECORRUPT for text that is not
 * JSON, or the errno of a failed read. Parsing never reads outside [json,
 * json+len) and needs no NUL terminator.
 */
#ifndef DF_HFCONFIG_H
#define DF_HFCONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "err.h"
#include "sha256.h"

#define DF_MAX_LAYERS 1024         /* target and drafter layers accepted */
#define DF_MAX_TARGET_FEATURES 64  /* entries of target_layer_ids */

typedef enum df_layer_type {
    DF_LAYER_FULL = 0,    /* "full_attention" */
    DF_LAYER_LINEAR = 1,  /* "linear_attention" (Gated DeltaNet) */
    DF_LAYER_SLIDING = 2, /* "sliding_attention" */
} df_layer_type;

typedef enum df_arch {
    DF_ARCH_QWEN3 = 1,   /* dense */
    DF_ARCH_QWEN3_5 = 2, /* hybrid GDN + gated attention */
} df_arch;

typedef struct df_model_config {
    df_arch arch;
    char model_type[32];      /* as in the file: "qwen3", "qwen3_5", "qwen3_5_text" */
    bool has_text_config;     /* qwen3_5 multimodal: text tensors under model.language_model. */
    int hidden_size;
    int num_hidden_layers;
    int64_t vocab_size;
    int intermediate_size;
    int num_attention_heads;
    int num_key_value_heads;
    int head_dim;
    double rms_norm_eps;
    double rope_theta;
    double partial_rotary_factor; /* 1.0 for qwen3 */
    int rotary_dim;               /* head_dim * partial_rotary_factor, even */
    bool tie_word_embeddings;
    bool attn_output_gate;        /* qwen3_5 gated attention */
    int64_t max_position_embeddings; /* 0 when absent */
    int sliding_window;           /* 0 = none (also when use_sliding_window is false,
                                     as in transformers) */
    /* Gated DeltaNet (qwen3_5; 0 for qwen3). */
    int full_attention_interval;  /* 0 when absent */
    int linear_num_key_heads;
    int linear_num_value_heads;
    int linear_key_head_dim;
    int linear_value_head_dim;
    int linear_conv_kernel_dim;
    char torch_dtype[16];         /* "bfloat16", ... ("" when absent) */
    df_dtype dtype;               /* BF16/F16/F32 from torch_dtype, else INVALID */
    uint8_t layer_types[DF_MAX_LAYERS]; /* df_layer_type per layer */
    char config_sha256[DF_SHA256_HEX];  /* hex SHA-256 of the config.json bytes */
} df_model_config;

/* Loads DIR/config.json (or the file itself when a file is given). */
int df_model_config_load(const char *model_dir_or_config_json, df_model_config *out, df_err *e);

/* Parses config text; name_for_errors prefixes every message. */
int df_model_config_parse(const char *json, size_t len, const char *name_for_errors,
                          df_model_config *out, df_err *e);

/* docs/DRAFTER.md rule for K feature layers of a T-layer target: K==1 -> [T/2];
 * else ids[i] = round(1 + i*(T-4)/(K-1)), rounding half to even like
 * Python's round() in the reference code. T=64, K=5 -> [1,16,31,46,61].
 * Returns 0, or -EINVAL when K < 1, K > DF_MAX_TARGET_FEATURES, or the ids
 * would not be distinct and inside [0, T). */
int df_default_target_layers(int num_target_layers, int k, int *ids);

/* The drafter's config.json (docs/DRAFTER.md "Export"). */
typedef struct df_drafter_config {
    int block_size;
    int64_t mask_token_id;
    int num_target_features;                     /* K = entries of target_layer_ids */
    int target_layer_ids[DF_MAX_TARGET_FEATURES];
    int num_target_layers;                       /* layers of the target model */
    int num_hidden_layers;                       /* drafter layers */
    int hidden_size;
    int intermediate_size;
    int num_attention_heads;
    int num_key_value_heads;
    int head_dim;
    double rms_norm_eps;
    double rope_theta;
    int64_t max_position_embeddings;             /* required, >= 1 */
    uint8_t layer_types[DF_MAX_LAYERS];          /* DF_LAYER_FULL or DF_LAYER_SLIDING */
    int sliding_window;                          /* 0 = none; > 0 when a layer slides */
    bool use_sliding_window;                     /* must be true when a layer slides:
                                                    transformers drops the window otherwise */
    int64_t vocab_size;
    char config_sha256[DF_SHA256_HEX];           /* of the parsed bytes ("" after init) */
    int feature_dim;                             /* training only, never in config.json: the
                                                    width of the features fc reads, 0 = K x
                                                    hidden_size; a projected cache's rank R
                                                    (fc is then H x R; the export merges it) */
} df_drafter_config;

/* Input width of fc: K x hidden_size, or feature_dim when set. */
static inline int64_t df_drafter_fc_in(const df_drafter_config *c)
{
    return c->feature_dim ? c->feature_dim : (int64_t)c->num_target_features * c->hidden_size;
}

int df_drafter_config_load(const char *dir_or_config_json, df_drafter_config *out, df_err *e);
int df_drafter_config_parse(const char *json, size_t len, const char *name_for_errors,
                            df_drafter_config *out, df_err *e);

/* Checks a filled-in struct (the same rules as parsing). */
int df_drafter_config_validate(const df_drafter_config *c, const char *name_for_errors, df_err *e);

/* config.json text (malloc'd, NUL-terminated): the docs/DRAFTER.md keys, then the
 * keys SGLang's and vLLM's DFlash loaders read beyond them (docs/SERVE.md):
 * hidden_act "silu", attention_bias false, torch_dtype and dtype "bfloat16"
 * (the weights' type), target_hidden_size = hidden_size, and
 * eagle_aux_hidden_state_layer_ids = target_layer_ids + 1 (vLLM counts the
 * hidden state entering a layer). NULL with e set when c is invalid or
 * memory runs out. The parser accepts configs with or without those keys;
 * present, they must agree with the drafter. */
char *df_drafter_config_to_json(const df_drafter_config *c, df_err *e);

const char *df_layer_type_name(df_layer_type t);

#endif
