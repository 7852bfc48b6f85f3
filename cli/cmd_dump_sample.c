/* cmd_dump_sample.c - `dflash dump CACHE_DIR --sample ID`: one record read
 * back and shown: its tokens (loss tokens marked), and per selected layer the
 * statistics over the whole layer and a rows x cols slice, as text or --json.
 * It decodes one layer at a time (memory stays at one layer) on the pool.
 * Kept apart as the only mode that decodes hidden states for display.
 */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache.h"
#include "dtype.h"
#include "dump_internal.h"
#include "err.h"
#include "pool.h"

#define TOKENS_PER_LINE 16u

static void json_add_num(cJSON *o, const char *k, double v)
{
    if (isfinite(v))
        cJSON_AddNumberToObject(o, k, v);
    else
        cJSON_AddNullToObject(o, k);
}

/* ------------------------------------------------------------------ */
/* one sample                                                          */

static float load_elem(const void *buf, df_dtype t, size_t i)
{
    return df_elem_to_f32((const uint8_t *)buf + i * df_dtype_size(t), t);
}

typedef struct layer_stats {
    uint64_t count, finite, nan, inf;
    double mean, std, min, max, max_abs;
    uint64_t max_abs_row, max_abs_col;
} layer_stats;

/* Statistics over a [rows x cols] layer; mean/std/min/max over finite values. */
static void compute_stats(const void *buf, df_dtype t, uint64_t rows, uint64_t cols,
                          layer_stats *s)
{
    memset(s, 0, sizeof *s);
    s->count = rows * cols;
    s->min = INFINITY;
    s->max = -INFINITY;
    s->max_abs = -1;
    double sum = 0;
    size_t n = (size_t)(rows * cols), arg = 0;
    for (size_t i = 0; i < n; i++) {
        float f = load_elem(buf, t, i);
        if (isnan(f)) {
            s->nan++;
            continue;
        }
        if (isinf(f)) {
            s->inf++;
            continue;
        }
        s->finite++;
        sum += f;
        if (f < s->min)
            s->min = f;
        if (f > s->max)
            s->max = f;
        if (fabsf(f) > s->max_abs) {
            s->max_abs = fabsf(f);
            arg = i;
        }
    }
    if (!s->finite) {
        s->mean = s->std = s->min = s->max = s->max_abs = NAN;
        return;
    }
    s->mean = sum / (double)s->finite;
    double ss = 0;
    for (size_t i = 0; i < n; i++) {
        float f = load_elem(buf, t, i);
        if (isfinite(f)) {
            double d = f - s->mean;
            ss += d * d;
        }
    }
    s->std = sqrt(ss / (double)s->finite);
    s->max_abs_row = cols ? arg / cols : 0;
    s->max_abs_col = cols ? arg % cols : 0;
}

/* Resolves an optional range against [0, n): end clipped to n; start must be < n. */
static int resolve_range(const range *r, uint64_t n, uint64_t def_hi, uint64_t *lo, uint64_t *hi)
{
    *lo = r->given && r->has_lo ? r->lo : 0;
    *hi = r->given ? (r->has_hi ? r->hi : n) : def_hi;
    if (*hi > n)
        *hi = n;
    if (r->given && r->has_lo && *lo >= n)
        return -1;
    if (*lo > *hi)
        *lo = *hi;
    return 0;
}

static void print_float(float f)
{
    if (isnan(f))
        printf(" %11s", "nan");
    else if (isinf(f))
        printf(" %11s", f > 0 ? "inf" : "-inf");
    else
        printf(" %11.5g", (double)f);
}

int dump_sample(df_cache *c, const opts *o, df_pool *pool)
{
    const df_cache_info *inf = df_cache_get_info(c);
    const df_cache_params *p = &inf->params;
    df_err e = {0};
    int rc = EXIT_OK;

    int64_t k = df_cache_find(c, o->sample_id);
    if (k < 0) {
        size_t n = df_cache_count(c);
        if (n)
            fprintf(stderr,
                    PROG ": no sample with id %" PRIu64 " in %s (%zu samples, ids %" PRIu64
                    "..%" PRIu64 "; see --samples)\n",
                    o->sample_id, df_cache_dir(c), n, df_cache_entry_at(c, 0)->id,
                    df_cache_entry_at(c, n - 1)->id);
        else
            fprintf(stderr, PROG ": no sample with id %" PRIu64 " in %s (the cache is empty)\n",
                    o->sample_id, df_cache_dir(c));
        return EXIT_DATA;
    }
    const df_cache_entry *en = df_cache_entry_at(c, (size_t)k);

    /* Which layers. */
    uint32_t nl = p->n_layers < DF_CACHE_MAX_LAYERS ? p->n_layers : DF_CACHE_MAX_LAYERS;
    uint64_t mask = 0;
    if (o->layer >= 0) {
        for (uint32_t i = 0; i < nl; i++)
            if (p->layer_ids[i] == o->layer)
                mask |= 1ull << i;
        if (!mask) {
            fprintf(stderr, PROG ": --layer %" PRId64 " is not in this cache; its layers are:",
                    o->layer);
            for (uint32_t i = 0; i < nl; i++)
                fprintf(stderr, " %" PRId32, p->layer_ids[i]);
            fprintf(stderr, "\n(try 'dflash dump --help')\n");
            return EXIT_USAGE;
        }
    } else {
        mask = nl == 64 ? ~0ull : (1ull << nl) - 1;
    }

    /* Which rows and columns. */
    uint64_t nt = en->n_tokens, hid = p->hidden_size;
    uint64_t r0, r1, c0, c1, t0, t1;
    if (resolve_range(&o->rows, nt, nt < DEFAULT_SLICE_ROWS ? nt : DEFAULT_SLICE_ROWS, &r0, &r1)) {
        fprintf(stderr, PROG ": --rows starts at %" PRIu64 " but sample %" PRIu64 " has %" PRIu64
                " tokens\n(try 'dflash dump --help')\n", o->rows.lo, en->id, nt);
        return EXIT_USAGE;
    }
    if (resolve_range(&o->cols, hid, hid < DEFAULT_SLICE_COLS ? hid : DEFAULT_SLICE_COLS, &c0,
                      &c1)) {
        fprintf(stderr, PROG ": --cols starts at %" PRIu64 " but the hidden size is %" PRIu64
                "\n(try 'dflash dump --help')\n", o->cols.lo, hid);
        return EXIT_USAGE;
    }
    t0 = o->rows.given ? r0 : 0;
    t1 = o->rows.given ? r1 : nt;

    size_t esz = df_dtype_size(p->dtype);
    if (p->dtype != DF_DTYPE_BF16 && p->dtype != DF_DTYPE_F16 && p->dtype != DF_DTYPE_F32) {
        fprintf(stderr, PROG ": %s: unsupported cache dtype %s\n", df_cache_dir(c),
                df_dtype_name(p->dtype));
        return EXIT_DATA;
    }
    size_t layer_bytes = (size_t)(nt * hid * esz);
    uint32_t *ids = malloc(nt ? nt * sizeof *ids : 1);
    uint8_t *lmask = malloc(nt ? nt : 1);
    void *lbuf = malloc(layer_bytes ? layer_bytes : 1);
    cJSON *root = NULL, *jlayers = NULL;
    if (!ids || !lmask || !lbuf) {
        fprintf(stderr, PROG ": out of memory (sample %" PRIu64 ": %" PRIu64 " tokens x %" PRIu64
                " channels)\n", en->id, nt, hid);
        rc = EXIT_DATA;
        goto out;
    }

    /* Tokens first (no layers), then one layer at a time: memory stays at one layer. */
    df_cache_out dst;
    memset(&dst, 0, sizeof dst);
    dst.ids = ids;
    dst.loss_mask = lmask;
    int r = df_cache_read(c, (size_t)k, 0, &dst, pool, &e);
    if (r < 0) {
        rc = dump_data_err(&e, r);
        goto out;
    }
    uint64_t n_loss = 0;
    for (uint64_t i = 0; i < nt; i++)
        n_loss += lmask[i] != 0;
    if (n_loss != en->n_loss)
        fprintf(stderr, PROG ": warning: sample %" PRIu64 ": the index says %" PRIu32
                " loss tokens, the record's mask has %" PRIu64 "\n", en->id, en->n_loss, n_loss);

    char b1[32];
    if (o->json) {
        cJSON *a, *m, *tk;
        root = cJSON_CreateObject();
        cJSON_AddNumberToObject(root, "id", (double)en->id);
        cJSON_AddNumberToObject(root, "position", (double)k);
        cJSON_AddNumberToObject(root, "n_tokens", (double)nt);
        cJSON_AddNumberToObject(root, "n_loss", (double)n_loss);
        cJSON_AddStringToObject(root, "shard", dump_shard_name(inf, en->shard));
        cJSON_AddNumberToObject(root, "offset", (double)en->offset);
        cJSON_AddNumberToObject(root, "record_bytes", (double)en->record_bytes);
        cJSON_AddNumberToObject(root, "stored_bytes", (double)en->stored_bytes);
        cJSON_AddStringToObject(root, "dtype", df_dtype_name(p->dtype));
        cJSON_AddItemToObject(root, "tokens", tk = cJSON_CreateObject());
        cJSON_AddItemToObject(tk, "rows", a = cJSON_CreateArray());
        cJSON_AddItemToArray(a, cJSON_CreateNumber((double)t0));
        cJSON_AddItemToArray(a, cJSON_CreateNumber((double)t1));
        cJSON_AddItemToObject(tk, "ids", a = cJSON_CreateArray());
        cJSON_AddItemToObject(tk, "loss_mask", m = cJSON_CreateArray());
        for (uint64_t i = t0; i < t1; i++) {
            cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
            cJSON_AddItemToArray(m, cJSON_CreateNumber(lmask[i] ? 1 : 0));
        }
        cJSON_AddItemToObject(root, "layers", jlayers = cJSON_CreateArray());
    } else {
        printf("sample %" PRIu64 " (position %" PRId64 " of %zu): %" PRIu64 " tokens, %" PRIu64
               " with loss; %s @ %" PRIu64 ", record %s, stored %s\n",
               en->id, k, df_cache_count(c), nt, n_loss, dump_shard_name(inf, en->shard),
               en->offset,
               dump_human_bytes(b1, sizeof b1, (double)en->record_bytes),
               dump_human_bytes((char[32]){0}, 32, (double)en->stored_bytes));
        printf("tokens %" PRIu64 ":%" PRIu64 " (* = loss_mask 1):", t0, t1);
        for (uint64_t i = t0; i < t1; i++) {
            if ((i - t0) % TOKENS_PER_LINE == 0)
                printf("\n  %6" PRIu64 ":", i);
            printf(" %" PRIu32 "%s", ids[i], lmask[i] ? "*" : "");
        }
        printf("\n");
    }

    for (uint32_t li = 0; li < nl; li++) {
        if (!(mask >> li & 1))
            continue;
        memset(&dst, 0, sizeof dst);
        dst.layers[li] = lbuf;
        r = df_cache_read(c, (size_t)k, 1ull << li, &dst, pool, &e);
        if (r < 0) {
            rc = dump_data_err(&e, r);
            goto out;
        }
        layer_stats st;
        compute_stats(lbuf, p->dtype, nt, hid, &st);
        if (o->json) {
            cJSON *x = cJSON_CreateObject(), *s, *sl, *a, *v;
            cJSON_AddItemToArray(jlayers, x);
            cJSON_AddNumberToObject(x, "layer", p->layer_ids[li]);
            cJSON_AddNumberToObject(x, "index", li);
            cJSON_AddItemToObject(x, "stats", s = cJSON_CreateObject());
            cJSON_AddNumberToObject(s, "count", (double)st.count);
            cJSON_AddNumberToObject(s, "finite", (double)st.finite);
            json_add_num(s, "mean", st.mean);
            json_add_num(s, "std", st.std);
            json_add_num(s, "min", st.min);
            json_add_num(s, "max", st.max);
            json_add_num(s, "max_abs", st.max_abs);
            if (st.finite) {
                cJSON_AddNumberToObject(s, "max_abs_row", (double)st.max_abs_row);
                cJSON_AddNumberToObject(s, "max_abs_channel", (double)st.max_abs_col);
            } else {
                cJSON_AddNullToObject(s, "max_abs_row");
                cJSON_AddNullToObject(s, "max_abs_channel");
            }
            cJSON_AddNumberToObject(s, "nan", (double)st.nan);
            cJSON_AddNumberToObject(s, "inf", (double)st.inf);
            cJSON_AddItemToObject(x, "slice", sl = cJSON_CreateObject());
            cJSON_AddItemToObject(sl, "rows", a = cJSON_CreateArray());
            cJSON_AddItemToArray(a, cJSON_CreateNumber((double)r0));
            cJSON_AddItemToArray(a, cJSON_CreateNumber((double)r1));
            cJSON_AddItemToObject(sl, "cols", a = cJSON_CreateArray());
            cJSON_AddItemToArray(a, cJSON_CreateNumber((double)c0));
            cJSON_AddItemToArray(a, cJSON_CreateNumber((double)c1));
            cJSON_AddItemToObject(sl, "values", v = cJSON_CreateArray());
            for (uint64_t i = r0; i < r1; i++) {
                cJSON *row = cJSON_CreateArray();
                for (uint64_t j = c0; j < c1; j++) {
                    float f = load_elem(lbuf, p->dtype, (size_t)(i * hid + j));
                    cJSON_AddItemToArray(row, isfinite(f) ? cJSON_CreateNumber(f)
                                                          : cJSON_CreateNull());
                }
                cJSON_AddItemToArray(v, row);
            }
        } else {
            printf("\nlayer %" PRId32 " (%u of %u): %" PRIu64 " x %" PRIu64 " %s\n",
                   p->layer_ids[li], li + 1, nl, nt, hid, df_dtype_name(p->dtype));
            if (st.finite)
                printf("  mean %.6g  std %.6g  min %.6g  max %.6g  max|x| %.6g (token %" PRIu64
                       ", channel %" PRIu64 ")  nan %" PRIu64 "  inf %" PRIu64 "\n",
                       st.mean, st.std, st.min, st.max, st.max_abs, st.max_abs_row,
                       st.max_abs_col, st.nan, st.inf);
            else
                printf("  no finite values (%" PRIu64 " elements)  nan %" PRIu64 "  inf %" PRIu64
                       "\n", st.count, st.nan, st.inf);
            if (r0 == r1 || c0 == c1) {
                printf("  (empty slice)\n");
                continue;
            }
            printf("  rows %" PRIu64 ":%" PRIu64 " x cols %" PRIu64 ":%" PRIu64 "\n  %8s", r0, r1,
                   c0, c1, "");
            for (uint64_t j = c0; j < c1; j++) {
                char h[24];
                snprintf(h, sizeof h, "c%" PRIu64, j);
                printf(" %11s", h);
            }
            printf("\n");
            for (uint64_t i = r0; i < r1; i++) {
                printf("  %8" PRIu64, i);
                for (uint64_t j = c0; j < c1; j++)
                    print_float(load_elem(lbuf, p->dtype, (size_t)(i * hid + j)));
                printf("\n");
            }
        }
    }
    if (o->json) {
        int jr = dump_json_emit(root);
        root = NULL;
        if (jr)
            rc = EXIT_DATA;
    }
out:
    cJSON_Delete(root);
    free(ids);
    free(lmask);
    free(lbuf);
    return rc;
}
