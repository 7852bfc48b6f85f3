/* test_serve_keys - the drafter export's config.json against every key that
 * SGLang's and vLLM's DFlash draft loaders read (docs/SERVE.md says why each
 * value is what it is). No network, no Python: the facts were read from the
 * engines' sources once, and the table below records, per key, the rule our
 * value must follow, the loader that reads it and the file it was read in
 * (repository path @ commit; "index copy" where the source store named no
 * commit). Where a loader reads a key we do not write, the row says so and
 * the test checks the key stays absent, so that the loader's default (which
 * matches this drafter) applies.
 *
 * It checks the writer's output for a mixed sliding/full drafter at the
 * Qwen3.6-27B shape and for an all-full one, that an export written before
 * these keys existed still loads, and, given a directory (test_cli.sh passes
 * the export of its short CPU training run), that export's config.json. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsutil.h"
#include "hfconfig.h"
#include "test.h"
#include "test_drafter27b.h"

/* Sources (see docs/SERVE.md "Where the facts come from"). */
#define SG_MODEL "sglang python/sglang/srt/models/dflash.py@003b23d7"
#define SG_UTILS "sglang python/sglang/srt/speculative/dflash_utils.py (index copy)"
#define SG_WORKER "sglang python/sglang/srt/speculative/dflash_worker.py@0468412f"
#define SG_HOOK "sglang python/sglang/srt/arg_groups/speculative_hook.py@d9ccf6a7"
#define SG_MCFG "sglang python/sglang/srt/configs/model_config.py@001adf56"
#define VL_MODEL "vllm vllm/model_executor/models/qwen3_dflash.py@036a00d1"
#define VL_SPEC "vllm vllm/config/speculative.py@002e77c1"
#define VL_AUX_OLD "vllm vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py@da844450"
#define VL_AUX_NEW "vllm vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (index copy)"
#define VL_EAGLECFG "vllm vllm/transformers_utils/configs/eagle.py (index copy)"
#define HF "transformers Qwen3Config (both engines parse config.json with it)"

/* What our value must be. */
typedef enum rule {
    R_STR,        /* the string want */
    R_ARCH,       /* ["DFlashDraftModel"] */
    R_BLOCK,      /* block_size */
    R_MASK,       /* mask_token_id */
    R_IDS,        /* target_layer_ids */
    R_IDS_PLUS1,  /* target_layer_ids + 1 */
    R_NTARGET,    /* num_target_layers */
    R_LAYERS,     /* num_hidden_layers */
    R_HIDDEN,     /* hidden_size */
    R_INTER,      /* intermediate_size */
    R_HEADS,      /* num_attention_heads */
    R_KV,         /* num_key_value_heads */
    R_HEAD_DIM,   /* head_dim */
    R_EPS,        /* rms_norm_eps */
    R_THETA,      /* rope_theta */
    R_MAXPOS,     /* max_position_embeddings */
    R_VOCAB,      /* vocab_size */
    R_TYPES,      /* layer_types, one name per drafter layer */
    R_WINDOW,     /* sliding_window: the window when a layer slides, else null */
    R_USE_SW,     /* use_sliding_window: true iff a layer slides */
    R_NULL,       /* JSON null */
    R_FALSE,      /* false */
    R_ABSENT,     /* not written: the loader's default (want) is this drafter */
} rule;

typedef struct key_rule {
    const char *path; /* "a" or "dflash_config.a" */
    rule r;
    const char *want; /* R_STR: the value; R_ABSENT: the default that applies */
    const char *loader;
    const char *source;
} key_rule;

/* THE TABLE: every key the two DFlash draft loaders read. */
static const key_rule KEYS[] = {
    {"architectures", R_ARCH, NULL, "SGLang: model registry -> DFlashDraftModel (EntryClass)", SG_MODEL},
    {"architectures", R_ARCH, NULL, "vLLM: EAGLEConfig keeps names starting DFlash; registry "
     "DFlashDraftModel -> qwen3_dflash.DFlashQwen3ForCausalLM", VL_EAGLECFG},
    {"model_type", R_STR, "qwen3", "both: AutoConfig -> Qwen3Config", HF},
    {"block_size", R_BLOCK, NULL, "SGLang: parse_dflash_draft_config (dflash_config first, then "
     "top level); _handle_dflash infers --speculative-num-draft-tokens", SG_HOOK},
    {"dflash_config.block_size", R_BLOCK, NULL, "SGLang: parse_dflash_draft_config", SG_UTILS},
    {"dflash_config.mask_token_id", R_MASK, NULL, "SGLang: DFlashWorker._resolve_mask_token_id",
     SG_WORKER},
    {"dflash_config.mask_token_id", R_MASK, NULL, "vLLM: DFlashQwen3Model.mask_token_id", VL_MODEL},
    {"dflash_config.mask_token", R_ABSENT, "\"<|MASK|>\" (only checked against the tokenizer)",
     "SGLang: parse_dflash_draft_config", SG_UTILS},
    {"dflash_config.target_layer_ids", R_IDS, NULL, "SGLang: resolve_target_layer_ids (fc input "
     "= K x hidden_size)", SG_MODEL},
    {"dflash_config.target_layer_ids", R_IDS, NULL, "vLLM (newer): ids + 1 when "
     "eagle_aux_hidden_state_layer_ids is absent", VL_AUX_NEW},
    {"eagle_aux_hidden_state_layer_ids", R_IDS_PLUS1, NULL, "vLLM (older): the only source of the "
     "aux layers; else the target model's default layers", VL_AUX_OLD},
    {"eagle_aux_hidden_state_layer_ids", R_IDS_PLUS1, NULL, "vLLM (newer): read first; "
     "EAGLEConfig refuses a value other than target_layer_ids + 1", VL_EAGLECFG},
    {"num_target_layers", R_NTARGET, NULL, "SGLang: parse_dflash_draft_config", SG_UTILS},
    {"num_hidden_layers", R_LAYERS, NULL, "both: drafter layers", SG_MODEL},
    {"hidden_size", R_HIDDEN, NULL, "both", VL_MODEL},
    {"target_hidden_size", R_HIDDEN, NULL, "vLLM: _get_dflash_fc_input_size (else hidden_size)",
     VL_MODEL},
    {"intermediate_size", R_INTER, NULL, "both: the MLP", SG_MODEL},
    {"hidden_act", R_STR, "silu", "SGLang: DFlashMLP raises on anything else", SG_MODEL},
    {"hidden_act", R_STR, "silu", "vLLM: Qwen3MLP(hidden_act=config.hidden_act)", VL_MODEL},
    {"num_attention_heads", R_HEADS, NULL, "both", VL_MODEL},
    {"num_key_value_heads", R_KV, NULL, "both", VL_MODEL},
    {"head_dim", R_HEAD_DIM, NULL, "both (else hidden_size / heads)", SG_MODEL},
    {"attention_bias", R_FALSE, NULL, "both: qkv/o biases", SG_MODEL},
    {"rms_norm_eps", R_EPS, NULL, "both", VL_MODEL},
    {"rope_theta", R_THETA, NULL, "SGLang: get_rope_config; vLLM: rope_parameters (built from it)",
     SG_MODEL},
    {"rope_scaling", R_NULL, NULL, "SGLang: get_rope_config", SG_MODEL},
    {"rope_is_neox_style", R_ABSENT, "true (rotate-half, as ours)", "SGLang: DFlashAttention",
     SG_MODEL},
    {"is_neox_style", R_ABSENT, "true (rotate-half, as ours)", "vLLM: DFlashQwen3DecoderLayer",
     VL_MODEL},
    {"max_position_embeddings", R_MAXPOS, NULL, "SGLang: the draft's context length must reach "
     "the target's (else SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1)", SG_MCFG},
    {"max_position_embeddings", R_MAXPOS, NULL, "vLLM: RoPE cache size", VL_MODEL},
    {"layer_types", R_TYPES, NULL, "SGLang: get_dflash_layer_types (full: ENCODER_ONLY, "
     "sliding: DECODER + window)", SG_MODEL},
    {"layer_types", R_TYPES, NULL, "vLLM: _resolve_layer_attention (sliding layers causal; mixed "
     "layouts need VLLM_USE_V2_MODEL_RUNNER=1)", VL_MODEL},
    {"sliding_window", R_WINDOW, NULL, "SGLang: window_left = sliding_window - 1", SG_UTILS},
    {"sliding_window", R_WINDOW, NULL, "vLLM: per_layer_sliding_window", VL_MODEL},
    {"use_sliding_window", R_USE_SW, NULL, "transformers drops sliding_window when false", HF},
    {"vocab_size", R_VOCAB, NULL, "vLLM: embedding/lm_head shapes, draft_vocab_size default",
     VL_MODEL},
    {"draft_vocab_size", R_ABSENT, "vocab_size", "vLLM: DFlashQwen3ForCausalLM", VL_MODEL},
    {"tie_word_embeddings", R_FALSE, NULL, "transformers (the drafter has no embedding)", HF},
    {"torch_dtype", R_STR, "bfloat16", "SGLang: the draft's dtype under --dtype auto "
     "(transformers 4 name)", SG_MCFG},
    {"dtype", R_STR, "bfloat16", "SGLang: the same under transformers 5", SG_MCFG},
    {"is_causal", R_ABSENT, "per layer: sliding causal, full not (as ours)",
     "vLLM: _dflash_layer_causal", VL_MODEL},
    {"dflash_config.causal", R_ABSENT, "per layer (as ours)", "vLLM: _dflash_layer_causal",
     VL_MODEL},
    {"dflash_config.use_swa", R_ABSENT, "false: layer_types decides", "vLLM: _resolve_layer_attention",
     VL_MODEL},
    {"dflash_config.swa_window_size", R_ABSENT, "sliding_window", "vLLM: _resolve_layer_attention",
     VL_MODEL},
    {"dflash_config.attention_sink_bias", R_ABSENT, "false", "vLLM: DFlashQwen3DecoderLayer",
     VL_MODEL},
    {"dflash_config.use_aux_hidden_state", R_ABSENT, "true (fc on the target features)",
     "vLLM: DFlashQwen3Model", VL_MODEL},
    {"dflash_config.conv_kernel_size", R_ABSENT, "0 (none)", "SGLang: parse_dflash_draft_config",
     SG_UTILS},
    {"dflash_config.selector_rank", R_ABSENT, "0 (none)", "SGLang: parse_dflash_draft_config",
     SG_UTILS},
    {"dflash_config.output_multiplier", R_ABSENT, "1.0", "SGLang: parse_dflash_draft_config",
     SG_UTILS},
    {"dflash_config.final_logit_softcapping", R_ABSENT, "none", "SGLang: parse_dflash_draft_config",
     SG_UTILS},
};

static const cJSON *lookup(const cJSON *root, const char *path)
{
    const char *dot = strchr(path, '.');
    if (!dot)
        return cJSON_GetObjectItemCaseSensitive(root, path);
    char head[64];
    snprintf(head, sizeof head, "%.*s", (int)(dot - path), path);
    return cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(root, head), dot + 1);
}

static int is_int(const cJSON *j, double v)
{
    return cJSON_IsNumber(j) && j->valuedouble == v;
}

static int ids_match(const cJSON *j, const df_drafter_config *d, int plus)
{
    if (!cJSON_IsArray(j) || cJSON_GetArraySize(j) != d->num_target_features)
        return 0;
    for (int i = 0; i < d->num_target_features; i++)
        if (!is_int(cJSON_GetArrayItem(j, i), d->target_layer_ids[i] + plus))
            return 0;
    return 1;
}

static int any_sliding(const df_drafter_config *d)
{
    for (int i = 0; i < d->num_hidden_layers; i++)
        if (d->layer_types[i] == DF_LAYER_SLIDING)
            return 1;
    return 0;
}

static int rule_holds(const key_rule *k, const cJSON *j, const df_drafter_config *d)
{
    switch (k->r) {
    case R_STR: return cJSON_IsString(j) && !strcmp(j->valuestring, k->want);
    case R_ARCH:
        return cJSON_IsArray(j) && cJSON_GetArraySize(j) == 1 &&
               cJSON_IsString(cJSON_GetArrayItem(j, 0)) &&
               !strcmp(cJSON_GetArrayItem(j, 0)->valuestring, "DFlashDraftModel");
    case R_BLOCK: return is_int(j, d->block_size);
    case R_MASK: return is_int(j, (double)d->mask_token_id);
    case R_IDS: return ids_match(j, d, 0);
    case R_IDS_PLUS1: return ids_match(j, d, 1);
    case R_NTARGET: return is_int(j, d->num_target_layers);
    case R_LAYERS: return is_int(j, d->num_hidden_layers);
    case R_HIDDEN: return is_int(j, d->hidden_size);
    case R_INTER: return is_int(j, d->intermediate_size);
    case R_HEADS: return is_int(j, d->num_attention_heads);
    case R_KV: return is_int(j, d->num_key_value_heads);
    case R_HEAD_DIM: return is_int(j, d->head_dim);
    case R_EPS: return cJSON_IsNumber(j) && j->valuedouble == d->rms_norm_eps;
    case R_THETA: return cJSON_IsNumber(j) && j->valuedouble == d->rope_theta;
    case R_MAXPOS: return is_int(j, (double)d->max_position_embeddings);
    case R_VOCAB: return is_int(j, (double)d->vocab_size);
    case R_TYPES:
        if (!cJSON_IsArray(j) || cJSON_GetArraySize(j) != d->num_hidden_layers)
            return 0;
        for (int i = 0; i < d->num_hidden_layers; i++) {
            const cJSON *t = cJSON_GetArrayItem(j, i);
            if (!cJSON_IsString(t) ||
                strcmp(t->valuestring, df_layer_type_name((df_layer_type)d->layer_types[i])))
                return 0;
        }
        return 1;
    case R_WINDOW:
        return any_sliding(d) ? is_int(j, d->sliding_window) && d->sliding_window > 0
                              : cJSON_IsNull(j);
    case R_USE_SW: return any_sliding(d) ? cJSON_IsTrue(j) : cJSON_IsBool(j);
    case R_NULL: return cJSON_IsNull(j);
    case R_FALSE: return cJSON_IsFalse(j);
    case R_ABSENT: return j == NULL;
    }
    return 0;
}

/* Checks config.json text against the table; d is the drafter it describes. */
static void check_text(const char *what, const char *txt, const df_drafter_config *d)
{
    cJSON *root = cJSON_Parse(txt);
    CHECK(cJSON_IsObject(root));
    if (!root)
        return;
    for (size_t i = 0; i < sizeof KEYS / sizeof KEYS[0]; i++) {
        const key_rule *k = &KEYS[i];
        const cJSON *j = lookup(root, k->path);
        if (!rule_holds(k, j, d)) {
            char *v = j ? cJSON_PrintUnformatted(j) : NULL;
            fprintf(stderr, "%s: %s = %s does not fit what %s reads (%s)%s%s\n", what, k->path,
                    v ? v : "(absent)", k->loader, k->source, k->r == R_ABSENT ? "; default: " : "",
                    k->r == R_ABSENT ? k->want : "");
            free(v);
            df_test_failures++;
        }
    }
    /* Every key we write is read by someone: no key outside the table. */
    const cJSON *it;
    cJSON_ArrayForEach(it, root)
    {
        int known = 0;
        for (size_t i = 0; !known && i < sizeof KEYS / sizeof KEYS[0]; i++)
            known = KEYS[i].r != R_ABSENT && !strcmp(KEYS[i].path, it->string);
        if (!known && strcmp(it->string, "dflash_config")) {
            fprintf(stderr, "%s: %s is written but is in no loader's row\n", what, it->string);
            df_test_failures++;
        }
    }
    cJSON_Delete(root);
    /* And our own reader takes it back unchanged. */
    df_drafter_config back;
    df_err e = {0};
    CHECK_OK(df_drafter_config_parse(txt, strlen(txt), what, &back, &e), &e);
    CHECK_EQ(back.num_target_features, d->num_target_features);
    CHECK_EQ(back.hidden_size, d->hidden_size);
    CHECK_EQ(back.block_size, d->block_size);
}


static void test_writer(void)
{
    df_drafter_config d;
    df_err e = {0};
    test_drafter_27b(&d);
    CHECK_EQ(d.target_layer_ids[4], 61);
    char *js = df_drafter_config_to_json(&d, &e);
    CHECK(js != NULL);
    if (js)
        check_text("27B sliding x4 + full", js, &d);
    free(js);

    /* All full layers (what vLLM's default runner takes): sliding_window null. */
    for (int i = 0; i < d.num_hidden_layers; i++)
        d.layer_types[i] = DF_LAYER_FULL;
    d.sliding_window = 0;
    d.use_sliding_window = false;
    d.num_target_features = 3;
    d.target_layer_ids[0] = 1, d.target_layer_ids[1] = 31, d.target_layer_ids[2] = 61;
    js = df_drafter_config_to_json(&d, &e);
    CHECK(js != NULL);
    if (js)
        check_text("27B all full, 3 features", js, &d);
    free(js);
}

/* An export as the writer made it before the serving keys (git 9aed207):
 * it still loads, to the same drafter as the new text. */
static const char OLD_EXPORT[] =
    "{\n\t\"architectures\":\t[\"DFlashDraftModel\"],\n\t\"model_type\":\t\"qwen3\",\n"
    "\t\"block_size\":\t16,\n\t\"dflash_config\":\t{\n\t\t\"block_size\":\t16,\n"
    "\t\t\"mask_token_id\":\t248070,\n\t\t\"target_layer_ids\":\t[1, 16, 31, 46, 61]\n\t},\n"
    "\t\"num_target_layers\":\t64,\n\t\"num_hidden_layers\":\t5,\n\t\"hidden_size\":\t5120,\n"
    "\t\"intermediate_size\":\t17408,\n\t\"num_attention_heads\":\t32,\n"
    "\t\"num_key_value_heads\":\t8,\n\t\"head_dim\":\t128,\n\t\"rms_norm_eps\":\t1e-06,\n"
    "\t\"rope_theta\":\t10000000,\n\t\"rope_scaling\":\tnull,\n"
    "\t\"max_position_embeddings\":\t262144,\n\t\"layer_types\":\t[\"sliding_attention\", "
    "\"sliding_attention\", \"sliding_attention\", \"sliding_attention\", \"full_attention\"],\n"
    "\t\"sliding_window\":\t2048,\n\t\"use_sliding_window\":\ttrue,\n\t\"vocab_size\":\t248320,\n"
    "\t\"tie_word_embeddings\":\tfalse\n}\n";

static void test_old_export(void)
{
    df_drafter_config d, old, now;
    df_err e = {0};
    test_drafter_27b(&d);
    CHECK_OK(df_drafter_config_parse(OLD_EXPORT, strlen(OLD_EXPORT), "old.json", &old, &e), &e);
    char *js = df_drafter_config_to_json(&d, &e);
    CHECK(js != NULL);
    if (!js)
        return;
    CHECK_OK(df_drafter_config_parse(js, strlen(js), "new.json", &now, &e), &e);
    /* The same drafter; only the bytes (and so config_sha256) differ. */
    CHECK(strcmp(old.config_sha256, now.config_sha256) != 0);
    memset(old.config_sha256, 0, sizeof old.config_sha256);
    memset(now.config_sha256, 0, sizeof now.config_sha256);
    CHECK(memcmp(&old, &now, sizeof old) == 0);
    /* Re-exporting an old export's drafter gives the new text. */
    char *again = df_drafter_config_to_json(&old, &e);
    CHECK(again && !strcmp(again, js));
    free(again);
    free(js);
}

/* A directory's config.json (an export made by `dflash train`). */
static void test_export_dir(const char *dir)
{
    df_drafter_config d;
    df_err e = {0};
    CHECK_OK(df_drafter_config_load(dir, &d, &e), &e);
    char p[4096];
    snprintf(p, sizeof p, "%s/config.json", dir);
    char *txt = NULL;
    size_t len = 0;
    CHECK_OK(df_file_read_all(p, 1u << 20, &txt, &len, &e), &e);
    if (txt) /* NUL-terminated */
        check_text(p, txt, &d);
    free(txt);
}

int main(int argc, char **argv)
{
    test_writer();
    test_old_export();
    for (int i = 1; i < argc; i++)
        test_export_dir(argv[i]);
    return test_main_end();
}
