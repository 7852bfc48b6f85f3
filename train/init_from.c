/* init_from.c - a run started from a drafter export (init_from.h). */
#include "init_from.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "log.h"
#include "pool.h"
#include "safetensors.h"

/* "[1, 16, 31]" into out (size n). */
static const char *ids_str(char *out, size_t n, const int *ids, int k)
{
    size_t len = (size_t)snprintf(out, n, "[");
    for (int i = 0; i < k && len + 16 < n; i++)
        len += (size_t)snprintf(out + len, n - len, "%s%d", i ? ", " : "", ids[i]);
    snprintf(out + len, n - len, "]");
    return out;
}

int df_init_config_check(const char *dir, const df_drafter_config *c,
                         const df_drafter_config *ic, int projected, int verbose, df_err *e)
{
    /* key: DIR's name; ours: what the drafter being built has and where it comes from */
#define CHK(key, mine, theirs, from)                                                          \
    if ((int64_t)(mine) != (int64_t)(theirs))                                                 \
        return df_errf(e, -DF_EMISMATCH, "--init-from %s: config.json %s is %" PRId64 "; the " \
                       "drafter being built has %" PRId64 " (%s)", dir, key, (int64_t)(theirs), \
                       (int64_t)(mine), from)
    CHK("hidden_size", c->hidden_size, ic->hidden_size, "the target's hidden size: a drafter of "
        "another target");
    CHK("vocab_size", c->vocab_size, ic->vocab_size, "the target's vocabulary");
    CHK("num_target_layers", c->num_target_layers, ic->num_target_layers,
        "the target's layers: a drafter of another target");
    CHK("num_hidden_layers", c->num_hidden_layers, ic->num_hidden_layers, "--layers");
    for (int i = 0; i < c->num_hidden_layers; i++)
        if (c->layer_types[i] != ic->layer_types[i])
            return df_errf(e, -DF_EMISMATCH, "--init-from %s: config.json layer_types[%d] is %s; "
                           "the drafter being built has %s (--layer-types)", dir, i,
                           df_layer_type_name((df_layer_type)ic->layer_types[i]),
                           df_layer_type_name((df_layer_type)c->layer_types[i]));
    if (c->use_sliding_window)
        CHK("sliding_window", c->sliding_window, ic->sliding_window, "--sliding-window");
    CHK("num_attention_heads", c->num_attention_heads, ic->num_attention_heads, "--heads");
    CHK("num_key_value_heads", c->num_key_value_heads, ic->num_key_value_heads, "--kv-heads");
    CHK("head_dim", c->head_dim, ic->head_dim, "--head-dim");
    CHK("intermediate_size", c->intermediate_size, ic->intermediate_size, "--intermediate");
    CHK("block_size", c->block_size, ic->block_size, "--block-size");
    CHK("dflash_config.mask_token_id", c->mask_token_id, ic->mask_token_id, "--mask-token");
#undef CHK
    int same = c->num_target_features == ic->num_target_features;
    for (int i = 0; same && i < c->num_target_features; i++)
        same = c->target_layer_ids[i] == ic->target_layer_ids[i];
    if (!same) {
        char a[400], b[400];
        return df_errf(e, -DF_EMISMATCH, "--init-from %s: config.json dflash_config."
                       "target_layer_ids is %s; the drafter being built reads %s (%s)", dir,
                       ids_str(a, sizeof a, ic->target_layer_ids, ic->num_target_features),
                       ids_str(b, sizeof b, c->target_layer_ids, c->num_target_features),
                       projected ? "the layers the projected cache holds" : "--target-layers");
    }
    /* the same weights under another RoPE base or norm epsilon still load; the run uses
     * the target's (what serving engines will), so the first steps may move more */
    if (verbose && c->rope_theta != ic->rope_theta)
        df_log(DF_LOG_WARN, "--init-from %s: config.json rope_theta %g; the drafter trains with "
               "the target's %g", dir, ic->rope_theta, c->rope_theta);
    if (verbose && c->rms_norm_eps != ic->rms_norm_eps)
        df_log(DF_LOG_WARN, "--init-from %s: config.json rms_norm_eps %g; the drafter trains "
               "with the target's %g", dir, ic->rms_norm_eps, c->rms_norm_eps);
    return 0;
}

int df_init_weights(const char *dir, const df_drafter_config *c, const df_params *ps,
                    const df_basis *b, int threads, float *master, int verbose, df_err *e)
{
    df_drafter_config ic;
    df_params ips;
    float *w = NULL;
    df_pool *pool = NULL;
    int rc = df_export_load(dir, &ic, &ips, &w, e);
    if (rc < 0) {
        df_err_wrap(e, "--init-from");
        return rc;
    }
    /* read again: the config must still be the one checked (a file replaced
     * between the two reads would otherwise go unnoticed) */
    if ((rc = df_init_config_check(dir, c, &ic, b != NULL, 0, e)) < 0)
        goto out;
    for (int i = 0; i < ps->n; i++) {
        const df_param *q = &ps->p[i];
        int j = df_params_find(&ips, q->name);
        if (j < 0) { /* the configs agree, so the tables do: a bug if reached */
            rc = df_errf(e, -DF_EMISMATCH, "--init-from %s: tensor %s is missing", dir, q->name);
            goto out;
        }
        const df_param *s = &ips.p[j];
        if (b && !strcmp(q->name, "fc.weight")) {
            if (s->shape[0] != q->shape[0] || s->shape[1] != b->D || q->shape[1] != b->R) {
                rc = df_errf(e, -DF_EMISMATCH, "--init-from %s: fc.weight is %" PRId64 " x %"
                             PRId64 "; the basis maps %d features to %d, the drafter's fc_r is %"
                             PRId64 " x %" PRId64, dir, s->shape[0], s->shape[1], b->D, b->R,
                             q->shape[0], q->shape[1]);
                goto out;
            }
            if (!(pool = df_pool_open(threads))) {
                rc = df_errf(e, -ENOMEM, "--init-from %s: cannot start threads", dir);
                goto out;
            }
            /* fc_r = fc P^T: each of fc's H rows projected like a token's features */
            if ((rc = df_basis_project_rows_f32(b, w + s->offset, s->shape[0],
                                                master + q->offset, pool, e)) < 0) {
                df_err_wrap(e, "--init-from %s: fc_r = fc P^T", dir);
                goto out;
            }
            continue;
        }
        if (s->ndim != q->ndim || s->shape[0] != q->shape[0] || s->shape[1] != q->shape[1]) {
            char a[64], bb[64];
            rc = df_errf(e, -DF_EMISMATCH, "--init-from %s: tensor %s has shape %s; the drafter "
                         "being built has %s", dir, q->name,
                         df_st_shape_str(a, sizeof a, s->ndim, s->shape),
                         df_st_shape_str(bb, sizeof bb, q->ndim, q->shape));
            goto out;
        }
        memcpy(master + q->offset, w + s->offset, (size_t)q->numel * sizeof *master);
    }
    if (verbose) {
        printf("init: the %d tensors of %s (a fresh optimizer from step 0)\n", ps->n, dir);
        if (b)
            printf("init: fc_r = fc P^T (%d x %d): %s's fc restricted to the cache's basis of "
                   "rank %d (exact on features in its span, the least-squares nearest map "
                   "otherwise)\n", c->hidden_size, b->R, dir, b->R);
        fflush(stdout);
    }
out:
    df_pool_close(pool);
    free(w);
    df_params_free(&ips);
    return rc;
}

char *df_init_hparams(const char *dir, const df_drafter_config *ic)
{
    cJSON *r = cJSON_CreateObject();
    char *txt = NULL, *out = NULL;
    if (r && cJSON_AddStringToObject(r, "init_from", dir) &&
        cJSON_AddStringToObject(r, "init_from_config_sha256", ic->config_sha256))
        txt = cJSON_Print(r);
    cJSON_Delete(r);
    /* the checkpoint state frees it with free(): a copy from malloc, not cJSON's hooks */
    if (txt && (out = malloc(strlen(txt) + 1)))
        memcpy(out, txt, strlen(txt) + 1);
    cJSON_free(txt);
    return out;
}

int df_init_resume_check(const char *ckpt_dir, const char *hparams, const char *dir,
                         const df_drafter_config *ic, df_err *e)
{
    char had_dir[1024] = "", had_sha[DF_SHA256_HEX] = "";
    cJSON *r = hparams && *hparams ? cJSON_Parse(hparams) : NULL;
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(r, "init_from"),
                *h = cJSON_GetObjectItemCaseSensitive(r, "init_from_config_sha256");
    if (cJSON_IsString(d) && cJSON_IsString(h)) {
        snprintf(had_dir, sizeof had_dir, "%s", d->valuestring);
        snprintf(had_sha, sizeof had_sha, "%s", h->valuestring);
    }
    cJSON_Delete(r);
    if (!dir && !*had_sha)
        return 0;
    if (dir && !*had_sha)
        return df_errf(e, -DF_EMISMATCH, "%s: this run started from drawn weights; --init-from %s "
                       "starts a new run (use another --out)", ckpt_dir, dir);
    if (!dir)
        return df_errf(e, -DF_EMISMATCH, "%s: this run started from --init-from %s; give it "
                       "again to resume (its config sets the drafter's shape)", ckpt_dir, had_dir);
    if (strcmp(had_sha, ic->config_sha256))
        return df_errf(e, -DF_EMISMATCH, "%s: this run started from --init-from %s (config.json "
                       "sha256 %.12s...); %s/config.json is %.12s...: a new start needs another "
                       "--out", ckpt_dir, had_dir, had_sha, dir, ic->config_sha256);
    return 0;
}
