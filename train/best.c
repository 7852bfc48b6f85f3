/* best.c - RUN/best/best.json (best.h). */
#include "best.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsutil.h"

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
