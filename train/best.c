/* best.c - RUN/best/best.json (best.h). */
#include "best.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsutil.h"
#include "setup.h"

#define BEST_JSON_MAX (1u << 20)

int df_best_load(const char *run_dir, df_best *b, df_err *e)
{
    memset(b, 0, sizeof *b);
    char path[4200];
    if (snprintf(path, sizeof path, "%s/" DF_BEST_DIR "/" DF_BEST_JSON, run_dir) >=
        (int)sizeof path)
        return df_errf(e, -ENAMETOOLONG, "%s: path too long", run_dir);
    char *txt = NULL;
    size_t len = 0;
    int rc = df_file_read_all(path, BEST_JSON_MAX, &txt, &len, e);
    if (rc == -ENOENT)
        return df_errf(e, -ENOENT, "%s has no best export (%s/): training keeps one when it "
                       "evaluates (--eval-cache)", run_dir, DF_BEST_DIR);
    if (rc < 0)
        return rc;
    cJSON *r = cJSON_ParseWithLength(txt, len);
    free(txt);
    const char *bad = NULL;
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(r, "format"),
                *v = cJSON_GetObjectItemCaseSensitive(r, "version"),
                *st = cJSON_GetObjectItemCaseSensitive(r, "step"),
                *m = cJSON_GetObjectItemCaseSensitive(r, "metric"),
                *val = cJSON_GetObjectItemCaseSensitive(r, "value"),
                *th = cJSON_GetObjectItemCaseSensitive(r, "eval_tau_hat"),
                *tw = cJSON_GetObjectItemCaseSensitive(r, "eval_tau_walk"),
                *lo = cJSON_GetObjectItemCaseSensitive(r, "eval_loss"),
                *ro = cJSON_GetObjectItemCaseSensitive(r, "eval_rows"),
                *bl = cJSON_GetObjectItemCaseSensitive(r, "eval_blocks"),
                *ca = cJSON_GetObjectItemCaseSensitive(r, "eval_cache");
    if (!cJSON_IsObject(r))
        bad = "not a JSON object";
    else if (!cJSON_IsString(f) || strcmp(f->valuestring, "dflash-best"))
        bad = "format: want \"dflash-best\"";
    else if (!cJSON_IsNumber(v) || v->valuedouble != 1)
        bad = "version: want 1";
    else if (!cJSON_IsNumber(st) || !(st->valuedouble >= 0 && st->valuedouble < 9e15) ||
             st->valuedouble != floor(st->valuedouble))
        bad = "step: want an integer >= 0";
    else if (!cJSON_IsString(m) || (strcmp(m->valuestring, "eval_tau_walk") &&
                                    strcmp(m->valuestring, "eval_tau_hat")))
        bad = "metric: want \"eval_tau_walk\" or \"eval_tau_hat\"";
    else if (!cJSON_IsNumber(val) || !isfinite(val->valuedouble))
        bad = "value: want a finite number";
    else if (!cJSON_IsNumber(th) || !cJSON_IsNumber(lo) || (tw && !cJSON_IsNumber(tw)))
        bad = "eval_tau_hat, eval_loss, eval_tau_walk: want numbers";
    else if (!cJSON_IsNumber(ro) || !(ro->valuedouble >= 0 && ro->valuedouble < 2e9) ||
             !cJSON_IsNumber(bl) || !(bl->valuedouble >= 0))
        bad = "eval_rows, eval_blocks: want counts";
    else if (!cJSON_IsString(ca) || strlen(ca->valuestring) >= sizeof b->eval_cache)
        bad = "eval_cache: want a path";
    if (bad) {
        cJSON_Delete(r);
        return df_errf(e, -DF_ECORRUPT, "%s: %s", path, bad);
    }
    b->step = (int64_t)st->valuedouble;
    snprintf(b->metric, sizeof b->metric, "%s", m->valuestring);
    b->value = val->valuedouble;
    b->walked = tw != NULL;
    b->tau_walk = tw ? tw->valuedouble : 0;
    b->tau_hat = th->valuedouble;
    b->loss = lo->valuedouble;
    b->rows = (int)ro->valuedouble;
    b->blocks = (uint64_t)bl->valuedouble;
    snprintf(b->eval_cache, sizeof b->eval_cache, "%s", ca->valuestring);
    cJSON_Delete(r);
    return 0;
}

char *df_best_json(const df_best *b)
{
    cJSON *r = cJSON_CreateObject();
    int ok = r != NULL;
#define ADD(x) ok = ok && (x) != NULL
    ADD(cJSON_AddStringToObject(r, "format", "dflash-best"));
    ADD(cJSON_AddNumberToObject(r, "version", 1));
    ADD(cJSON_AddNumberToObject(r, "step", (double)b->step));
    ADD(cJSON_AddStringToObject(r, "metric", b->metric));
    ADD(cJSON_AddNumberToObject(r, "value", b->value));
    if (b->walked)
        ADD(cJSON_AddNumberToObject(r, "eval_tau_walk", b->tau_walk));
    ADD(cJSON_AddNumberToObject(r, "eval_tau_hat", b->tau_hat));
    ADD(cJSON_AddNumberToObject(r, "eval_loss", b->loss));
    ADD(cJSON_AddNumberToObject(r, "eval_rows", b->rows));
    ADD(cJSON_AddNumberToObject(r, "eval_blocks", (double)b->blocks));
    ADD(cJSON_AddStringToObject(r, "eval_cache", b->eval_cache));
#undef ADD
    char *txt = ok ? cJSON_Print(r) : NULL;
    cJSON_Delete(r);
    if (!txt)
        return NULL;
    /* a final newline, for people reading it */
    size_t n = strlen(txt);
    char *out = malloc(n + 2);
    if (out) {
        memcpy(out, txt, n);
        out[n] = '\n';
        out[n + 1] = 0;
    }
    cJSON_free(txt);
    return out;
}

/* The best so far: RUN/best/best.json when there is one (a resumed run, or one
 * stopped before its first checkpoint); a damaged one is an error. */
int best_open(best_state *bs, const char *run_dir, df_err *e)
{
    int rc = df_best_load(run_dir, &bs->best, e);
    if (rc == -ENOENT)
        return 0;
    bs->have = rc == 0;
    return rc;
}

/* After an evaluation whose figures are r (at step r->step): RUN/best is
 * replaced when r scores strictly higher than the best so far, or when that
 * best was of another evaluation (metric, cache, rows, blocks), which cannot
 * be compared.
 *
 * The weights written are ds->w, the ones just evaluated. They are the same on
 * every rank: ZeRO-1 shards only the fp32 master and the moments, the weights
 * the drafter reads (bf16 on a GPU, f32 on CPU ranks) are all-gathered after
 * every step; so rank 0 writes it alone, with no collective the other ranks
 * would have to join. bf16 weights are the master rounded to nearest even, as
 * the export rounds it: the files are bit for bit what RUN/export would hold
 * at that step. Sharded, the weights come to the host through ck_master (the
 * host copy of the fp32 master, which a sharded run reads only when placing
 * the state, and fetches again before every checkpoint and the export). */
int best_update(best_state *bs, df_best *r, const df_train_opts *o, df_backend *be,
                const dev_state *ds, const df_drafter_config *c, const df_params *ps,
                float *ck_master, const df_basis *basis, df_err *e)
{
    snprintf(r->eval_cache, sizeof r->eval_cache, "%s", o->eval_cache);
    const df_best *b = &bs->best;
    int comparable = bs->have && !strcmp(b->metric, r->metric) &&
                     !strcmp(b->eval_cache, r->eval_cache) && b->rows == r->rows &&
                     b->blocks == r->blocks;
    if (comparable && !(r->value > b->value))
        return 0;
    if (bs->have && !comparable && !o->quiet)
        printf("best: %s/%s (step %" PRId64 ") was scored on another evaluation (%s of %d rows, "
               "%" PRIu64 " blocks, %s); replacing it\n", o->run_dir, DF_BEST_DIR, b->step,
               b->metric, b->rows, b->blocks, b->eval_cache);
    const float *w = ds->w;
    int rc = 0;
    if (ds->sharded) {
        size_t wes = df_dtype_size(ds->wdt);
        if (ds->wdt != DF_DTYPE_F32 && ds->wdt != DF_DTYPE_BF16)
            return df_errf(e, -ENOTSUP, "best export: weights of dtype %s",
                           df_dtype_name(ds->wdt));
        if ((rc = df_backend_download(be, ck_master, ds->w, (size_t)ds->n * wes)))
            return df_errf(e, rc, "best export: copying the weights from %s failed",
                           df_backend_name(be));
        if (ds->wdt == DF_DTYPE_BF16)
            df_bf16_widen_inplace(ck_master, ds->n);
        w = ck_master;
    }
    df_best nb = *r;
    char *json = df_best_json(&nb), dir[4200];
    if (!json)
        return df_errf(e, -ENOMEM, "out of memory");
    snprintf(dir, sizeof dir, "%s/%s", o->run_dir, DF_BEST_DIR);
    df_export_extra x = {.name = DF_BEST_JSON, .text = json};
    rc = c->feature_dim ? df_export_drafter_projected_with(dir, c, ps, w, basis, &x, e)
                        : df_export_drafter_with(dir, c, ps, w, &x, e);
    free(json);
    if (rc) {
        df_err_wrap(e, "best export at step %" PRId64, r->step);
        return rc;
    }
    if (!o->quiet) {
        printf("best: step %" PRId64 ", %s %.4f", r->step, r->metric, r->value);
        if (comparable)
            printf(" (was %.4f at step %" PRId64 ")", b->value, b->step);
        printf(" -> %s\n", dir);
        fflush(stdout);
    }
    bs->best = nb;
    bs->have = 1;
    return 0;
}
