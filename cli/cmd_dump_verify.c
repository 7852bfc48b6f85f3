/* cmd_dump_verify.c - `dflash dump CACHE_DIR --verify`: every checksum of
 * every shard, record, token section and block, checked on the worker pool
 * (df_cache_verify), with a progress line on a terminal and one verdict as
 * text or --json. Kept apart: it is the mode CI and scripts gate on.
 */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cache.h"
#include "dump_internal.h"
#include "err.h"
#include "fsutil.h"
#include "pool.h"

/* ------------------------------------------------------------------ */
/* verify                                                              */

typedef struct progress {
    pthread_mutex_t mu;
    int tty;
    double t0, last;
    int shown;
} progress;

static void on_progress(void *arg, uint64_t done, uint64_t total)
{
    progress *pg = arg;
    if (!pg->tty)
        return;
    pthread_mutex_lock(&pg->mu);
    double now = df_now();
    if (now - pg->last >= 0.1 || done == total) {
        pg->last = now;
        fprintf(stderr, "\rverifying: %" PRIu64 " / %" PRIu64 " samples (%.1f%%), %.0f s", done, total,
                total ? 100.0 * (double)done / (double)total : 100.0, now - pg->t0);
        fflush(stderr);
        pg->shown = 1;
    }
    pthread_mutex_unlock(&pg->mu);
}

int dump_verify(df_cache *c, const opts *o, df_pool *pool)
{
    const df_cache_info *inf = df_cache_get_info(c);
    const df_cache_params *p = &inf->params;
    size_t n = df_cache_count(c);
    /* Blocks: every layer of every sample is cut into ceil(n_tokens / rows_per_block). */
    uint64_t blocks = 0;
    for (size_t k = 0; k < n && p->rows_per_block; k++) {
        const df_cache_entry *en = df_cache_entry_at(c, k);
        blocks += (uint64_t)p->n_layers *
                  ((en->n_tokens + (uint64_t)p->rows_per_block - 1) / p->rows_per_block);
    }
    progress pg;
    memset(&pg, 0, sizeof pg);
    pthread_mutex_init(&pg.mu, NULL);
    pg.tty = isatty(STDERR_FILENO);
    pg.t0 = df_now();
    df_err e = {0};
    uint64_t bad = 0;
    int r = df_cache_verify(c, pool, on_progress, &pg, &bad, &e);
    double secs = df_now() - pg.t0;
    if (pg.shown)
        fprintf(stderr, "\r%70s\r", "");
    pthread_mutex_destroy(&pg.mu);
    int ok = r >= 0 && bad == 0;
    if (!ok && r >= 0 && !e.msg[0])
        snprintf(e.msg, sizeof e.msg, "%" PRIu64 " bad samples", bad);
    if (!ok && r >= 0)
        r = -DF_ECORRUPT;

    if (o->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddBoolToObject(j, "ok", ok);
        cJSON_AddStringToObject(j, "dir", df_cache_dir(c));
        cJSON_AddNumberToObject(j, "samples", (double)n);
        cJSON_AddNumberToObject(j, "blocks", (double)blocks);
        cJSON_AddNumberToObject(j, "bad_samples", (double)bad);
        cJSON_AddNumberToObject(j, "file_bytes", (double)inf->file_bytes);
        cJSON_AddNumberToObject(j, "seconds", secs);
        if (ok) {
            cJSON_AddNullToObject(j, "error");
            cJSON_AddNullToObject(j, "error_code");
        } else {
            cJSON_AddStringToObject(j, "error", e.msg[0] ? e.msg : df_strerror(r));
            cJSON_AddNumberToObject(j, "error_code", r);
        }
        if (dump_json_emit(j))
            return EXIT_DATA;
        if (!ok)
            fprintf(stderr, PROG ": %s\n", e.msg[0] ? e.msg : df_strerror(r));
        return ok ? EXIT_OK : EXIT_DATA;
    }
    if (!ok) {
        dump_data_err(&e, r);
        fprintf(stderr, PROG ": FAILED: %" PRIu64 " of %zu samples bad\n", bad ? bad : 1, n);
        return EXIT_DATA;
    }
    char b1[32];
    printf("OK: %zu samples, %" PRIu64 " blocks verified (%s in %.1f s)\n", n, blocks,
           dump_human_bytes(b1, sizeof b1, (double)inf->file_bytes), secs);
    return EXIT_OK;
}
