/* settings.c - a run's defining settings in hparams.json, checked on resume (settings.h). */
#include "settings.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A copy from malloc (the checkpoint state frees hparams_json with free(), not cJSON's hooks). */
static char *dup_free_cjson(char *txt)
{
    char *out = txt ? malloc(strlen(txt) + 1) : NULL;
    if (out)
        memcpy(out, txt, strlen(txt) + 1);
    cJSON_free(txt);
    return out;
}

static int add_u64(cJSON *s, const char *k, uint64_t v)
{
    char b[32];
    snprintf(b, sizeof b, "%" PRIu64, v);
    return cJSON_AddStringToObject(s, k, b) != NULL;
}

char *df_run_settings_json(const char *base, const df_train_opts *o, const df_drafter_config *c,
                           const df_cache_params *cp)
{
    cJSON *r = base && *base ? cJSON_Parse(base) : NULL;
    if (!cJSON_IsObject(r)) {
        cJSON_Delete(r);
        r = cJSON_CreateObject();
    }
    cJSON *s = cJSON_CreateObject();
    if (!r || !s) {
        cJSON_Delete(r);
        cJSON_Delete(s);
        return NULL;
    }
    cJSON_DeleteItemFromObjectCaseSensitive(r, "settings");
    cJSON_AddItemToObject(r, "settings", s);
    char types[8 * DF_MAX_LAYERS + 8] = "", ids[16 * DF_MAX_TARGET_FEATURES] = "", uuid[40] = "";
    for (int i = 0; i < c->num_hidden_layers && i < DF_MAX_LAYERS; i++)
        strcat(types, c->layer_types[i] == DF_LAYER_FULL ? (i ? ",full" : "full")
                                                         : (i ? ",sliding" : "sliding"));
    for (int i = 0; i < c->num_target_features && i < DF_MAX_TARGET_FEATURES; i++)
        snprintf(ids + strlen(ids), sizeof ids - strlen(ids), "%s%d", i ? "," : "",
                 c->target_layer_ids[i]);
    for (int i = 0; i < 16; i++)
        snprintf(uuid + 2 * i, sizeof uuid - 2 * (size_t)i, "%02x", cp->uuid[i]);
    char cache_id[160];
    snprintf(cache_id, sizeof cache_id, "uuid %s, corpus %.16s", uuid, cp->corpus_fingerprint);
    int nrows = o->rows_per_step > 0 ? o->rows_per_step : 1;
    int ok = cJSON_AddNumberToObject(s, "--steps", (double)o->steps) &&
             cJSON_AddNumberToObject(s, "--lr", o->lr) &&
             cJSON_AddNumberToObject(s, "--min-lr", o->min_lr) &&
             cJSON_AddNumberToObject(s, "--warmup", o->warmup_frac) &&
             cJSON_AddNumberToObject(s, "--clip", o->clip) &&
             cJSON_AddNumberToObject(s, "--gamma", o->gamma > 0 ? o->gamma : 7) &&
             cJSON_AddNumberToObject(s, "--noise", o->noise) &&
             cJSON_AddNumberToObject(s, "--init-std", o->init_std) &&
             add_u64(s, "--seed", o->seed) &&
             add_u64(s, "--init-seed", o->init_seed ? o->init_seed : o->seed) &&
             cJSON_AddStringToObject(s, "--init-seed-for", o->init_seed_for ? o->init_seed_for : "") &&
             cJSON_AddBoolToObject(s, "--fc-init-random", o->fc_init_random) &&
             cJSON_AddStringToObject(s, "--cache", cache_id) &&
             cJSON_AddStringToObject(s, "--random-target", o->random_target ? o->random_target : "") &&
             cJSON_AddNumberToObject(s, "--max-tokens", o->max_tokens) &&
             cJSON_AddNumberToObject(s, "--max-anchors", o->max_anchors) &&
             cJSON_AddNumberToObject(s, "--rows-per-step", nrows) &&
             cJSON_AddNumberToObject(s, "--block-size", c->block_size) &&
             cJSON_AddNumberToObject(s, "--mask-token", (double)c->mask_token_id) &&
             cJSON_AddNumberToObject(s, "--layers", c->num_hidden_layers) &&
             cJSON_AddStringToObject(s, "--layer-types", types) &&
             cJSON_AddNumberToObject(s, "--sliding-window", c->use_sliding_window ? c->sliding_window : 0) &&
             cJSON_AddNumberToObject(s, "--intermediate", c->intermediate_size) &&
             cJSON_AddNumberToObject(s, "--heads", c->num_attention_heads) &&
             cJSON_AddNumberToObject(s, "--kv-heads", c->num_key_value_heads) &&
             cJSON_AddNumberToObject(s, "--head-dim", c->head_dim) &&
             cJSON_AddStringToObject(s, "--target-layers", ids) &&
             /* GPU gradients in F32 or BF16: other rounding (the CPU always uses F32) */
             cJSON_AddBoolToObject(s, "--grad-f32", o->grad_f32) &&
             cJSON_AddBoolToObject(s, "--adam-bf16", o->adam_bf16) &&
             cJSON_AddBoolToObject(s, "--adam-m-bf16", df_train_moments16(o) == 1) &&
             cJSON_AddBoolToObject(s, "--adam-v16", o->adam_v16) &&
             cJSON_AddBoolToObject(s, "--bf16-logits", o->bf16_logits) &&
             cJSON_AddBoolToObject(s, "--f16-logits", o->f16_logits) &&
             cJSON_AddBoolToObject(s, "--fp8", o->fp8 > 0) &&
             cJSON_AddBoolToObject(s, "--fp8-dy-blocks", o->fp8 > 0 && o->fp8_dy_blocks) &&
             cJSON_AddBoolToObject(s, "--fp8-ce-onepass", o->fp8 > 0 && o->fp8_ce_onepass) &&
             cJSON_AddBoolToObject(s, "DFLASH_TEST_REPLICATE_DATA", o->replicate_data);
    char *txt = ok ? cJSON_Print(r) : NULL;
    cJSON_Delete(r);
    return dup_free_cjson(txt);
}

/* A value as the message shows it: strings without quotes, numbers as JSON has them. */
static void shown(const cJSON *v, char *b, size_t n)
{
    if (cJSON_IsString(v)) {
        snprintf(b, n, "%s", *v->valuestring ? v->valuestring : "(none)");
        return;
    }
    char *t = cJSON_PrintUnformatted(v);
    snprintf(b, n, "%s", t ? t : "?");
    cJSON_free(t);
}

int df_run_settings_check(const char *ckpt_dir, const char *had, const char *now,
                          int64_t *extended_from, int *unchecked, df_err *e)
{
    *extended_from = 0;
    *unchecked = 0;
    cJSON *h = had && *had ? cJSON_Parse(had) : NULL, *w = now ? cJSON_Parse(now) : NULL;
    const cJSON *hs = cJSON_GetObjectItemCaseSensitive(h, "settings"),
                *ws = cJSON_GetObjectItemCaseSensitive(w, "settings");
    int rc = 0;
    if (!cJSON_IsObject(ws)) {
        rc = df_errf(e, -ENOMEM, "out of memory");
        goto out;
    }
    if (!cJSON_IsObject(hs)) {
        *unchecked = 1;
        goto out;
    }
    char diffs[400] = "";
    int n = 0;
    const cJSON *wv;
    /* settings whose value is known for runs recorded before them (what those runs did): a
     * resume that asks for another is refused like any change */
    static const struct {
        const char *key, *was;
    } absent[] = {{"--fp8-dy-blocks", "false"}, {"--adam-bf16", "false"}, {"--adam-m-bf16", "false"},
                  {"--bf16-logits", "false"}, {"--fp8-ce-onepass", "false"},
                  {"--f16-logits", "false"}, {"--adam-v16", "false"}};
    cJSON_ArrayForEach(wv, ws) {
        const cJSON *hv = cJSON_GetObjectItemCaseSensitive(hs, wv->string);
        char a[160], b[160];
        const char *was = NULL;
        for (size_t k = 0; k < sizeof absent / sizeof absent[0] && !hv; k++)
            if (!strcmp(wv->string, absent[k].key))
                was = absent[k].was;
        if (!hv && !was) /* a setting recorded only by newer versions: nothing to compare with */
            continue;
        if (hv)
            shown(hv, a, sizeof a);
        else
            snprintf(a, sizeof a, "%s", was);
        shown(wv, b, sizeof b);
        if (!strcmp(a, b))
            continue;
        if (!strcmp(wv->string, "--steps") && cJSON_IsNumber(hv) && cJSON_IsNumber(wv) &&
            wv->valuedouble > hv->valuedouble) {
            *extended_from = (int64_t)hv->valuedouble;
            continue;
        }
        size_t l = strlen(diffs);
        if (l + 8 < sizeof diffs)
            snprintf(diffs + l, sizeof diffs - l, "%s%s %s (now %s)", n ? "; " : "", wv->string,
                     a, b);
        n++;
    }
    if (n)
        rc = df_errf(e, -DF_EMISMATCH, "%s: this run was started with other settings: %s. They "
                     "define the run: give the run's values to resume it (--steps may grow), or "
                     "use another --out", ckpt_dir, diffs);
out:
    cJSON_Delete(h);
    cJSON_Delete(w);
    return rc;
}
