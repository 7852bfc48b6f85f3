/* bench_codec - ratio and speed of the hidden-state codecs (formats/codec.h).
 *
 * Data: synthetic hidden states (cache/synth.h), several "layers" per hidden
 * size, cut into blocks of ~1 MiB of whole rows as the cache writes them; or
 * a raw bf16 file of real hidden states (--file F --hidden N); or every layer
 * of a finished cache (--cache DIR, e.g. real states from `dflash extract`).
 * For each codec: ratio (stored bytes / raw bytes), encode and decode GB/s of
 * raw bytes on one thread (median of --repeats runs over all blocks), decode
 * GB/s on a df_pool of --threads threads (one context per thread), and for
 * the lossy codecs their error (relative RMS over all and over ordinary
 * elements, worst element error relative to its row's and its 32-element
 * block's absmax). --explore also measures the candidate entropy coders of
 * the high byte plane and the plane split/merge kernels; --explore-block the
 * candidate designs of the block-scaled codecs (scale encodings, escapes,
 * entropy coding of the codes). Numbers depend on the machine; its CPU
 * model is printed with them.
 */
#define ZSTD_STATIC_LINKING_ONLY /* experimental params, measured in --explore only */
#include <errno.h>
#include <lz4.h>
#include <lz4hc.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zstd.h>

#include "cache.h"
#include "codec.h"
#include "e4m3.h"
#include "pool.h"
#include "synth.h"

typedef struct block {
    const uint8_t *raw;
    size_t raw_len;
    uint8_t *enc;
    size_t enc_len;
    int used_id;
    uint8_t *dec; /* points into a buffer as large as the data */
} block;

typedef struct dataset {
    char name[128];
    df_dtype dtype;
    size_t hidden, tokens, row_bytes;
    uint8_t *data; /* tokens x hidden elements of dtype */
    uint8_t *out;  /* decode target, same size */
    block *blocks;
    size_t nblocks;
} dataset;

typedef struct opts {
    size_t hidden[8];
    int nhidden;
    int layers;
    double mib;       /* data per hidden size */
    double block_mib; /* target block size */
    int repeats;
    int threads;
    const char *file;
    const char *cache; /* a finished cache: its layers, decoded */
    df_dtype dtype;
    int json;
    int explore;
    int explore_block;
    unsigned codec_mask; /* bit id: run codec id; 0 = all */
    int level;
    uint64_t seed;
} opts;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_dbl(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_dbl);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "bench_codec: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

static void cpu_model(char *out, size_t cap)
{
    snprintf(out, cap, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, "model name", 10)) {
            char *p = strchr(line, ':');
            if (p) {
                p++;
                while (*p == ' ')
                    p++;
                p[strcspn(p, "\n")] = 0;
                snprintf(out, cap, "%s", p);
            }
            break;
        }
    }
    fclose(f);
}

/* ---- data ----------------------------------------------------------------- */

/* bf16 rows -> the dataset's dtype (f32 is exact; f16 rounds) */
static void convert_rows(const uint16_t *bf, size_t n, df_dtype t, uint8_t *out)
{
    for (size_t i = 0; i < n; i++) {
        if (t == DF_DTYPE_BF16)
            memcpy(out + 2 * i, &bf[i], 2);
        else if (t == DF_DTYPE_F32) {
            float f = df_bf16_to_f32(bf[i]);
            memcpy(out + 4 * i, &f, 4);
        } else {
            uint16_t h = df_f32_to_f16(df_bf16_to_f32(bf[i]));
            memcpy(out + 2 * i, &h, 2);
        }
    }
}

static void make_blocks(dataset *d, size_t layer_tokens, double block_mib)
{
    size_t rows_per_block = (size_t)(block_mib * 1048576.0) / d->row_bytes;
    if (!rows_per_block)
        rows_per_block = 1;
    /* blocks never straddle layers: each layer is cut on its own */
    size_t layers = d->tokens / layer_tokens, per_layer = (layer_tokens + rows_per_block - 1) / rows_per_block;
    d->nblocks = layers * per_layer;
    d->blocks = calloc(d->nblocks, sizeof *d->blocks);
    size_t k = 0;
    for (size_t l = 0; l < layers; l++)
        for (size_t r = 0; r < layer_tokens; r += rows_per_block) {
            size_t rows = layer_tokens - r < rows_per_block ? layer_tokens - r : rows_per_block;
            size_t off = (l * layer_tokens + r) * d->row_bytes;
            block *b = &d->blocks[k++];
            b->raw = d->data + off;
            b->raw_len = rows * d->row_bytes;
            b->enc = xmalloc(b->raw_len);
            b->dec = d->out + off;
        }
    d->nblocks = k;
}

static void make_synth(dataset *d, const opts *o, size_t hidden)
{
    size_t es = df_dtype_size(o->dtype);
    size_t layer_tokens = (size_t)(o->mib * 1048576.0 / (double)o->layers / ((double)hidden * 2));
    if (!layer_tokens)
        layer_tokens = 1;
    d->dtype = o->dtype;
    d->hidden = hidden;
    d->tokens = layer_tokens * (size_t)o->layers;
    d->row_bytes = hidden * es;
    d->data = xmalloc(d->tokens * d->row_bytes);
    d->out = xmalloc(d->tokens * d->row_bytes);
    uint16_t *bf = xmalloc(layer_tokens * hidden * 2);
    for (int l = 0; l < o->layers; l++) {
        /* later layers: stronger massive activations, as in real LLMs */
        df_synth_opts so;
        df_synth_defaults(&so);
        so.massive_gain = 30.0f * (float)(l + 1);
        df_synth_bf16(bf, layer_tokens, hidden, o->seed + (uint64_t)l, &so);
        convert_rows(bf, layer_tokens * hidden, o->dtype,
                     d->data + (size_t)l * layer_tokens * d->row_bytes);
    }
    free(bf);
    snprintf(d->name, sizeof d->name, "synth %s hidden %zu, %d layers x %zu tokens",
             df_dtype_name(o->dtype), hidden, o->layers, layer_tokens);
    make_blocks(d, layer_tokens, o->block_mib);
}

static int load_file(dataset *d, const opts *o)
{
    df_err e = {0};
    uint16_t *bf;
    size_t tokens;
    int rc = df_synth_load_bf16(o->file, o->hidden[0], &bf, &tokens, &e);
    if (rc < 0) {
        fprintf(stderr, "bench_codec: %s\n", e.msg);
        return rc;
    }
    size_t es = df_dtype_size(o->dtype);
    d->dtype = o->dtype;
    d->hidden = o->hidden[0];
    d->tokens = tokens;
    d->row_bytes = d->hidden * es;
    d->data = xmalloc(tokens * d->row_bytes);
    d->out = xmalloc(tokens * d->row_bytes);
    convert_rows(bf, tokens * d->hidden, o->dtype, d->data);
    free(bf);
    const char *base = strrchr(o->file, '/');
    snprintf(d->name, sizeof d->name, "file %s (%s) hidden %zu, %zu tokens", base ? base + 1 : o->file,
             df_dtype_name(o->dtype), d->hidden, tokens);
    make_blocks(d, tokens, o->block_mib);
    return 0;
}

/* Every layer of a finished BF16 cache (decoded with its own codec; use a
 * lossless one), layer after layer, each layer's samples in id order: one
 * "layer" of the dataset per cache layer, so blocks never straddle layers. */
static int load_cache(dataset *d, const opts *o)
{
    df_err e = {0};
    df_cache *c = df_cache_open(o->cache, &e);
    if (!c) {
        fprintf(stderr, "bench_codec: %s\n", e.msg);
        return -1;
    }
    const df_cache_info *in = df_cache_get_info(c);
    const df_cache_params *cp = &in->params;
    if (cp->dtype != DF_DTYPE_BF16 || !in->tokens) {
        fprintf(stderr, "bench_codec: %s: want a non-empty BF16 cache (%s, %llu tokens)\n",
                o->cache, df_dtype_name(cp->dtype), (unsigned long long)in->tokens);
        df_cache_close(c);
        return -1;
    }
    size_t hid = cp->hidden_size, nl = cp->n_layers, toks = in->tokens, es = df_dtype_size(o->dtype);
    uint16_t *bf = xmalloc(nl * toks * hid * 2);
    size_t pos = 0;
    for (size_t k = 0; k < df_cache_count(c); k++) {
        const df_cache_entry *en = df_cache_entry_at(c, k);
        df_cache_out out = {0};
        for (size_t l = 0; l < nl; l++)
            out.layers[l] = bf + (l * toks + pos) * hid;
        if (df_cache_read(c, k, (nl < 64 ? (1ull << nl) : 0) - 1, &out, NULL, &e) < 0) {
            fprintf(stderr, "bench_codec: %s\n", e.msg);
            free(bf);
            df_cache_close(c);
            return -1;
        }
        pos += en->n_tokens;
    }
    d->dtype = o->dtype;
    d->hidden = hid;
    d->tokens = nl * toks;
    d->row_bytes = hid * es;
    d->data = xmalloc(d->tokens * d->row_bytes);
    d->out = xmalloc(d->tokens * d->row_bytes);
    convert_rows(bf, d->tokens * hid, o->dtype, d->data);
    free(bf);
    const char *base = strrchr(o->cache, '/');
    snprintf(d->name, sizeof d->name, "cache %s (%s, codec %s) hidden %zu, %zu layers x %zu tokens",
             base && base[1] ? base + 1 : o->cache, df_dtype_name(o->dtype), df_codec_name(cp->codec),
             hid, nl, toks);
    df_cache_close(c);
    make_blocks(d, toks, o->block_mib);
    return 0;
}

static void free_dataset(dataset *d)
{
    for (size_t i = 0; i < d->nblocks; i++)
        free(d->blocks[i].enc);
    free(d->blocks);
    free(d->data);
    free(d->out);
}

/* ---- codec runs ----------------------------------------------------------- */

static int cmp_flt(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* "Ordinary" elements of a row, for the error metrics: |x| at most 20 times
 * the row's median |x|; the rest are the massive activations, which would
 * dominate an RMS over the whole row. tmp: n floats of scratch. */
static double ordinary_limit(const float *x, size_t n, float *tmp)
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (isfinite(x[i]))
            tmp[m++] = fabsf(x[i]);
    if (!m)
        return 0;
    qsort(tmp, m, sizeof *tmp, cmp_flt);
    return 20.0 * tmp[m / 2];
}

typedef struct result {
    int id;
    double ratio, enc_gbs, dec_gbs, dec_mt_gbs;
    size_t stored_blocks;
    double rel_rms, ord_rel_rms, max_err_rel_absmax, max_err_rel_blk; /* lossy only */
    int ok;
} result;

/* one context per pool thread, registered so they can be freed */
#define MAX_THREADS 256
static df_codec_ctx *all_ctx[MAX_THREADS];
static atomic_int n_ctx;
static _Thread_local df_codec_ctx *tl_ctx;

static df_codec_ctx *thread_ctx(void)
{
    if (!tl_ctx) {
        tl_ctx = df_codec_ctx_new();
        int k = atomic_fetch_add(&n_ctx, 1);
        if (k < MAX_THREADS)
            all_ctx[k] = tl_ctx;
    }
    return tl_ctx;
}

typedef struct mt_job {
    dataset *d;
    int id;
    df_codec_params p;
} mt_job;

static int decode_one(void *arg, size_t i)
{
    mt_job *j = arg;
    block *b = &j->d->blocks[i];
    df_err e = {0};
    int rc = df_codec_decode(thread_ctx(), b->used_id, &j->p, b->enc, b->enc_len, b->dec,
                             b->raw_len, &e);
    if (rc < 0)
        fprintf(stderr, "decode: %s\n", e.msg);
    return rc;
}

static float elem_f32(const uint8_t *p, df_dtype t)
{
    return df_elem_to_f32(p, t);
}

static result run_codec(dataset *d, int id, const opts *o, df_pool *pool)
{
    result r = {.id = id, .ok = 1};
    df_codec_ctx *c = thread_ctx();
    df_codec_params p = {.dtype = d->dtype, .row_elems = (uint32_t)d->hidden, .level = o->level};
    size_t raw = 0, stored = 0;
    double *t = xmalloc(sizeof(double) * (size_t)o->repeats);
    df_err e = {0};

    for (int k = 0; k < o->repeats; k++) {
        double t0 = now();
        for (size_t i = 0; i < d->nblocks; i++) {
            block *b = &d->blocks[i];
            int rc = df_codec_encode(c, id, &p, b->raw, b->raw_len, b->enc, b->raw_len,
                                     &b->enc_len, &e);
            if (rc < 0) {
                fprintf(stderr, "encode %s: %s\n", df_codec_name(id), e.msg);
                r.ok = 0;
                free(t);
                return r;
            }
            b->used_id = rc;
        }
        t[k] = now() - t0;
    }
    for (size_t i = 0; i < d->nblocks; i++) {
        raw += d->blocks[i].raw_len;
        stored += d->blocks[i].enc_len;
        r.stored_blocks += d->blocks[i].used_id == DF_CODEC_STORED && id != DF_CODEC_STORED;
    }
    r.ratio = (double)stored / (double)raw;
    r.enc_gbs = (double)raw / median(t, o->repeats) / 1e9;

    for (int k = 0; k < o->repeats; k++) {
        double t0 = now();
        for (size_t i = 0; i < d->nblocks; i++) {
            block *b = &d->blocks[i];
            if (df_codec_decode(c, b->used_id, &p, b->enc, b->enc_len, b->dec, b->raw_len, &e) < 0) {
                fprintf(stderr, "decode %s: %s\n", df_codec_name(id), e.msg);
                r.ok = 0;
            }
        }
        t[k] = now() - t0;
    }
    r.dec_gbs = (double)raw / median(t, o->repeats) / 1e9;

    mt_job job = {d, id, p};
    for (int k = 0; k < o->repeats; k++) {
        double t0 = now();
        if (df_pool_for(pool, d->nblocks, decode_one, &job) < 0)
            r.ok = 0;
        t[k] = now() - t0;
    }
    r.dec_mt_gbs = (double)raw / median(t, o->repeats) / 1e9;
    free(t);

    size_t total = d->tokens * d->row_bytes;
    if (!df_codec_is_lossy(id)) {
        if (memcmp(d->data, d->out, total)) {
            fprintf(stderr, "bench_codec: %s did not round-trip!\n", df_codec_name(id));
            r.ok = 0;
        }
        return r;
    }
    /* lossy: RMS error relative to the data's RMS, over all elements and over
     * the ordinary ones (massive activations left out); worst error relative
     * to its row's absmax and to its 32-element block's absmax */
    size_t es = df_dtype_size(d->dtype);
    double se = 0, sx = 0, so_e = 0, so_x = 0, worst = 0, worst_b = 0;
    float *x = xmalloc(d->hidden * sizeof *x), *y = xmalloc(d->hidden * sizeof *y);
    float *tmp = xmalloc(d->hidden * sizeof *tmp);
    for (size_t row = 0; row < d->tokens; row++) {
        const uint8_t *a = d->data + row * d->row_bytes, *b = d->out + row * d->row_bytes;
        for (size_t i = 0; i < d->hidden; i++) {
            x[i] = elem_f32(a + i * es, d->dtype);
            y[i] = elem_f32(b + i * es, d->dtype);
        }
        double lim = ordinary_limit(x, d->hidden, tmp), amax = 0, emax = 0;
        for (size_t k0 = 0; k0 < d->hidden; k0 += 32) {
            size_t k1 = k0 + 32 < d->hidden ? k0 + 32 : d->hidden;
            double bmax = 0, bemax = 0;
            for (size_t i = k0; i < k1; i++) {
                if (!isfinite(x[i]))
                    continue;
                double err = fabs((double)x[i] - (double)y[i]), ax = fabs((double)x[i]);
                se += err * err;
                sx += ax * ax;
                if (ax <= lim) {
                    so_e += err * err;
                    so_x += ax * ax;
                }
                bmax = ax > bmax ? ax : bmax;
                bemax = err > bemax ? err : bemax;
            }
            if (bmax > 0 && bemax / bmax > worst_b)
                worst_b = bemax / bmax;
            amax = bmax > amax ? bmax : amax;
            emax = bemax > emax ? bemax : emax;
        }
        if (amax > 0 && emax / amax > worst)
            worst = emax / amax;
    }
    free(x);
    free(y);
    free(tmp);
    r.rel_rms = sx > 0 ? sqrt(se / sx) : 0;
    r.ord_rel_rms = so_x > 0 ? sqrt(so_e / so_x) : 0;
    r.max_err_rel_absmax = worst;
    r.max_err_rel_blk = worst_b;
    return r;
}

/* ---- --explore: entropy coders of the high plane ------------------------- */

typedef struct variant {
    const char *name;
    int kind;   /* 0 zstd, 1 lz4, 2 lz4hc */
    int level;
    int strategy, window_log, hash_log, min_match, search_log, lit_mode, target_cblock;
} variant;

static const variant variants[] = {
    /* name                              kind lvl strat wlog hlog mm slog lit tcb */
    {"zstd 1 (plain level 1)", 0, 1, 0, 0, 0, 0, 0, 0, 0},
    {"zstd 2", 0, 2, 0, 0, 0, 0, 0, 0, 0},
    {"zstd 3", 0, 3, 0, 0, 0, 0, 0, 0, 0},
    {"zstd 6", 0, 6, 0, 0, 0, 0, 0, 0, 0},
    {"zstd -1", 0, -1, 0, 0, 0, 0, 0, 0, 0},
    {"zstd -5", 0, -5, 0, 0, 0, 0, 0, 0, 0},
    {"zstd -1 + huff literals (exp.)", 0, -1, 0, 0, 0, 0, 0, 1, 0},
    {"zstd -5 + huff literals (exp.)", 0, -5, 0, 0, 0, 0, 0, 1, 0},
    {"zstd 1 minMatch 7", 0, 1, 0, 0, 0, 7, 0, 0, 0},
    {"zstd 1 window 2^12", 0, 1, 0, 12, 0, 0, 0, 0, 0},
    {"zstd dfast", 0, 1, 2, 0, 0, 0, 0, 0, 0},
    {"zstd 1 hashLog 12", 0, 1, 0, 0, 12, 0, 0, 0, 0},
    {"zstd 1 hashLog 10", 0, 1, 0, 0, 10, 0, 0, 0, 0},
    {"zstd 1 hashLog 8", 0, 1, 0, 0, 8, 0, 0, 0, 0},
    {"zstd 1 hashLog 6", 0, 1, 0, 0, 6, 0, 0, 0, 0},
    {"zstd 1 hashLog 8 minMatch 7", 0, 1, 0, 0, 8, 7, 0, 0, 0},
    {"zstd 1 hashLog 6 minMatch 7 (codec default)", 0, 1, 0, 0, 6, 7, 0, 0, 0},
    {"zstd 1 hashLog 6 window 2^10", 0, 1, 0, 10, 6, 0, 0, 0, 0},
    {"zstd 1 targetCBlock 16K (exp.)", 0, 1, 0, 0, 0, 0, 0, 0, 16384},
    {"lz4", 1, 1, 0, 0, 0, 0, 0, 0, 0},
    {"lz4hc 9", 2, 9, 0, 0, 0, 0, 0, 0, 0},
};
#define NVARIANTS (sizeof variants / sizeof variants[0])

static void zstd_apply(ZSTD_CCtx *zc, const variant *v)
{
    ZSTD_CCtx_reset(zc, ZSTD_reset_session_and_parameters);
    ZSTD_CCtx_setParameter(zc, ZSTD_c_compressionLevel, v->level);
    ZSTD_CCtx_setParameter(zc, ZSTD_c_checksumFlag, 0);
    ZSTD_CCtx_setParameter(zc, ZSTD_c_dictIDFlag, 0);
    if (v->strategy)
        ZSTD_CCtx_setParameter(zc, ZSTD_c_strategy, v->strategy);
    if (v->window_log)
        ZSTD_CCtx_setParameter(zc, ZSTD_c_windowLog, v->window_log);
    if (v->hash_log)
        ZSTD_CCtx_setParameter(zc, ZSTD_c_hashLog, v->hash_log);
    if (v->min_match)
        ZSTD_CCtx_setParameter(zc, ZSTD_c_minMatch, v->min_match);
    if (v->search_log)
        ZSTD_CCtx_setParameter(zc, ZSTD_c_searchLog, v->search_log);
    if (v->lit_mode)
        ZSTD_CCtx_setParameter(zc, ZSTD_c_literalCompressionMode, ZSTD_ps_enable);
    if (v->target_cblock)
        ZSTD_CCtx_setParameter(zc, ZSTD_c_targetCBlockSize, v->target_cblock);
}

static double entropy0(const uint8_t *p, size_t n)
{
    size_t h[256] = {0};
    for (size_t i = 0; i < n; i++)
        h[p[i]]++;
    double b = 0;
    for (int k = 0; k < 256; k++)
        if (h[k])
            b -= (double)h[k] * log2((double)h[k] / (double)n);
    return b; /* bits in total */
}

static void explore(dataset *d, const opts *o)
{
    size_t es = df_dtype_size(d->dtype), maxn = 0, raw = 0;
    for (size_t i = 0; i < d->nblocks; i++) {
        maxn = d->blocks[i].raw_len / es > maxn ? d->blocks[i].raw_len / es : maxn;
        raw += d->blocks[i].raw_len;
    }
    /* planes of every block, kept for all variants */
    uint8_t **pl = xmalloc(sizeof *pl * d->nblocks);
    for (size_t i = 0; i < d->nblocks; i++) {
        size_t n = d->blocks[i].raw_len / es;
        pl[i] = xmalloc(d->blocks[i].raw_len);
        uint8_t *planes[4] = {pl[i], pl[i] + n, pl[i] + 2 * n, pl[i] + 3 * n};
        df_codec_split_planes(d->blocks[i].raw, n, es, planes);
    }
    /* order-0 entropy of each plane (per block, summed) */
    printf("\n== explore: %s\n", d->name);
    for (size_t k = 0; k < es; k++) {
        double bits = 0;
        for (size_t i = 0; i < d->nblocks; i++) {
            size_t n = d->blocks[i].raw_len / es;
            bits += entropy0(pl[i] + k * n, n);
        }
        printf("plane %zu order-0 entropy: %.3f bits/byte\n", k, bits / (double)(raw / es));
    }
    {
        double bits = 0;
        for (size_t i = 0; i < d->nblocks; i++) {
            size_t n = d->blocks[i].raw_len / es;
            bits += entropy0(pl[i], n) + 8.0 * (double)(n * (es - 1));
        }
        printf("bound (plane 0 at order-0 entropy, rest raw): ratio %.4f\n", bits / 8 / (double)raw);
    }
    /* Exponent regrouping (not a codec here; measured for the record):
     * plane A = the full 8-bit exponent, plane B = sign + 7 mantissa bits. */
    if (d->dtype == DF_DTYPE_BF16) {
        double bits = 0;
        size_t zsz = 0;
        uint8_t *ex = xmalloc(maxn), *zb = xmalloc(ZSTD_compressBound(maxn));
        for (size_t i = 0; i < d->nblocks; i++) {
            size_t n = d->blocks[i].raw_len / 2;
            for (size_t j = 0; j < n; j++) {
                uint16_t v;
                memcpy(&v, d->blocks[i].raw + 2 * j, 2);
                ex[j] = (uint8_t)(v >> 7);
            }
            bits += entropy0(ex, n) + 8.0 * (double)n;
            size_t z = ZSTD_compress(zb, ZSTD_compressBound(n), ex, n, 1);
            zsz += (ZSTD_isError(z) ? n : z) + n;
        }
        printf("exponent-byte regrouping: order-0 bound %.4f, zstd-1 %.4f\n", bits / 8 / (double)raw,
               (double)zsz / (double)raw);
        free(ex);
        free(zb);
    }

    ZSTD_CCtx *zc = ZSTD_createCCtx();
    ZSTD_DCtx *zd = ZSTD_createDCtx();
    void *lz4hc = xmalloc((size_t)LZ4_sizeofStateHC());
    size_t cap = ZSTD_compressBound(maxn) + LZ4_compressBound((int)maxn);
    uint8_t **cbuf = xmalloc(sizeof *cbuf * d->nblocks);
    size_t *clen = xmalloc(sizeof *clen * d->nblocks);
    for (size_t i = 0; i < d->nblocks; i++)
        cbuf[i] = xmalloc(cap);
    uint8_t *hi = xmalloc(maxn);
    double *te = xmalloc(sizeof(double) * (size_t)o->repeats);
    double *td = xmalloc(sizeof(double) * (size_t)o->repeats);
    printf("%-44s %8s %9s %9s %11s  (plane 0 coded, other planes raw; GB/s of raw block bytes, 1 thread)\n",
           "high-plane coder", "ratio", "enc GB/s", "dec GB/s", "plane dec");
    for (size_t v = 0; v < NVARIANTS; v++) {
        const variant *va = &variants[v];
        size_t total = 0;
        int bad = 0;
        for (int k = 0; k < o->repeats; k++) {
            if (va->kind == 0)
                zstd_apply(zc, va);
            double t0 = now();
            total = 0;
            for (size_t i = 0; i < d->nblocks; i++) {
                size_t n = d->blocks[i].raw_len / es;
                size_t z;
                if (va->kind == 0) {
                    z = ZSTD_compress2(zc, cbuf[i], cap, pl[i], n);
                    if (ZSTD_isError(z))
                        bad = 1, z = n;
                } else if (va->kind == 1) {
                    z = (size_t)LZ4_compress_default((const char *)pl[i], (char *)cbuf[i], (int)n, (int)cap);
                } else {
                    z = (size_t)LZ4_compress_HC_extStateHC(lz4hc, (const char *)pl[i], (char *)cbuf[i],
                                                           (int)n, (int)cap, va->level);
                }
                clen[i] = z;
                total += (z < n ? z : n) + d->blocks[i].raw_len - n + 11;
            }
            te[k] = now() - t0;
        }
        /* decode: the high plane into scratch, then merge with the raw planes
         * (as the codec does); plane-only time is reported too */
        double tplane = 0;
        for (int k = 0; k < o->repeats; k++) {
            double t0 = now(), tp = 0;
            for (size_t i = 0; i < d->nblocks; i++) {
                size_t n = d->blocks[i].raw_len / es;
                double a = now();
                if (va->kind == 0) {
                    size_t r = ZSTD_decompressDCtx(zd, hi, n, cbuf[i], clen[i]);
                    bad |= ZSTD_isError(r) || r != n;
                } else {
                    int r = LZ4_decompress_safe((const char *)cbuf[i], (char *)hi, (int)clen[i], (int)n);
                    bad |= r != (int)n;
                }
                tp += now() - a;
                const uint8_t *planes[4] = {hi, pl[i] + n, pl[i] + 2 * n, pl[i] + 3 * n};
                df_codec_merge_planes(planes, n, es, d->blocks[i].dec);
            }
            td[k] = now() - t0;
            if (k == 0 || tp < tplane)
                tplane = tp;
        }
        printf("%-44s %8.4f %9.2f %9.2f %11.2f%s\n", va->name, (double)total / (double)raw,
               (double)raw / median(te, o->repeats) / 1e9, (double)raw / median(td, o->repeats) / 1e9,
               (double)raw / tplane / 1e9, bad ? "  (ERRORS)" : "");
        fflush(stdout);
    }
    /* Do the lower planes compress at all? (zstd-1 on each, as a fraction) */
    for (size_t k = 1; k < es; k++) {
        size_t z = 0, n_all = 0;
        for (size_t i = 0; i < d->nblocks; i++) {
            size_t n = d->blocks[i].raw_len / es;
            size_t r = ZSTD_compress(cbuf[i], cap, pl[i] + k * n, n, 1);
            z += ZSTD_isError(r) || r > n ? n : r;
            n_all += n;
        }
        printf("plane %zu alone with zstd-1: %.4f of its size\n", k, (double)z / (double)n_all);
    }

    /* plane split/merge kernels */
    uint8_t *tmp = xmalloc(maxn * es);
    const char *impl_name[4] = {"auto", "scalar", "sse2", "avx2"};
    for (int impl = 1; impl <= 3; impl++) {
        if (df_codec_set_plane_impl(impl) < 0)
            continue;
        double ts[64], tm[64];
        int reps = o->repeats < 64 ? o->repeats : 64;
        for (int k = 0; k < reps; k++) {
            double t0 = now();
            for (size_t i = 0; i < d->nblocks; i++) {
                size_t n = d->blocks[i].raw_len / es;
                uint8_t *planes[4] = {tmp, tmp + n, tmp + 2 * n, tmp + 3 * n};
                df_codec_split_planes(d->blocks[i].raw, n, es, planes);
            }
            ts[k] = now() - t0;
            t0 = now();
            for (size_t i = 0; i < d->nblocks; i++) {
                size_t n = d->blocks[i].raw_len / es;
                const uint8_t *planes[4] = {pl[i], pl[i] + n, pl[i] + 2 * n, pl[i] + 3 * n};
                df_codec_merge_planes(planes, n, es, d->blocks[i].dec);
            }
            tm[k] = now() - t0;
        }
        printf("planes %-6s split %6.2f GB/s  merge %6.2f GB/s\n", impl_name[impl],
               (double)raw / median(ts, reps) / 1e9, (double)raw / median(tm, reps) / 1e9);
    }
    df_codec_set_plane_impl(0);
    free(tmp);
    for (size_t i = 0; i < d->nblocks; i++) {
        free(cbuf[i]);
        free(pl[i]);
    }
    free(cbuf);
    free(clen);
    free(pl);
    free(hi);
    free(te);
    free(td);
    free(lz4hc);
    ZSTD_freeCCtx(zc);
    ZSTD_freeDCtx(zd);
}

/* ---- --explore-block: scale encodings and entropy coding of the block codecs
 *
 * A reference (scalar, double precision) model of the per-32-element block
 * quantizers, independent of the codec's kernels, run over the dataset for
 * each candidate design: fp8 e4m3 codes with an E8M0 power-of-two scale
 * (rounded up so that absmax/scale <= 448; or MX-style 2^(floor(log2 absmax)
 * - 8), which clips the largest values), or with a bf16 scale rounded up
 * (absmax maps to ~448); and b-bit symmetric integers (b = 4, 5, 6) with a
 * bf16 or an E8M0 scale. Reports, per design: bits per element before
 * entropy coding, the ratio with the code plane raw and zstd-coded (scale
 * planes zstd-coded where that shrinks them), the relative RMS error, the
 * worst element error relative to its block's absmax, and the one-thread
 * speed of zstd-decoding the code plane alone (the cost of coding it). */

enum { XS_E8M0 = 0, XS_E8M0_MX = 1, XS_BF16 = 2 };

typedef struct xvariant {
    const char *name;
    int bits;      /* 0 = fp8 e4m3 codes, else integer bits */
    int scale;     /* XS_* */
    double escape; /* > 0: the block's largest values are kept exactly (as the
                    * dtype's bytes) when they exceed escape x the rest (the
                    * codec's rule, with its factor 2 replaced by this) */
} xvariant;

static const xvariant xvariants[] = {
    {"fp8 e4m3, E8M0 scale (ceil)", 0, XS_E8M0, 0},
    {"fp8 e4m3, E8M0 scale (MX floor, clips)", 0, XS_E8M0_MX, 0},
    {"fp8 e4m3, bf16 scale (ceil)", 0, XS_BF16, 0},
    {"int4, bf16 scale", 4, XS_BF16, 0},
    {"int4, E8M0 scale", 4, XS_E8M0, 0},
    {"int4, bf16 scale, escape > 1.5x", 4, XS_BF16, 1.5},
    {"int4, bf16 scale, escape > 2x", 4, XS_BF16, 2},
    {"int4, bf16 scale, escape > 4x", 4, XS_BF16, 4},
    {"int5, bf16 scale", 5, XS_BF16, 0},
    {"int5, E8M0 scale", 5, XS_E8M0, 0},
    {"int5, bf16 scale, escape > 2x", 5, XS_BF16, 2},
    {"int6, bf16 scale", 6, XS_BF16, 0},
    {"int6, E8M0 scale", 6, XS_E8M0, 0},
    {"int6, bf16 scale, escape > 1.5x", 6, XS_BF16, 1.5},
    {"int6, bf16 scale, escape > 2x", 6, XS_BF16, 2},
    {"int6, bf16 scale, escape > 4x", 6, XS_BF16, 4},
};

/* e4m3 code of q >= 0 (not NaN): RNE, saturated at 448 */
static uint8_t ref_e4m3(double q)
{
    if (q >= 448)
        return 0x7e;
    if (q < 0x1p-6)
        return (uint8_t)nearbyint(q * 512); /* 8 = 2^-6 rounds into the normals */
    int e;
    double m = frexp(q, &e); /* q = m 2^e, m in [0.5, 1) */
    double mm = nearbyint((m * 2 - 1) * 8);
    e -= 1;
    if (mm == 8) {
        mm = 0;
        e++;
    }
    int code = ((e + 7) << 3) | (int)mm;
    return (uint8_t)(code > 0x7e ? 0x7e : code);
}

/* smallest bf16 >= v (v > 0, finite) */
static float bf16_ceil(double v)
{
    float f = (float)v;
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t t = u & 0xffff0000u;
    float g;
    memcpy(&g, &t, 4);
    while ((double)g < v) {
        t += 0x10000u;
        memcpy(&g, &t, 4);
    }
    return g;
}

static size_t zsize(ZSTD_CCtx *zc, const uint8_t *p, size_t n, uint8_t *tmp, size_t cap)
{
    if (!n)
        return 0;
    size_t z = ZSTD_compress2(zc, tmp, cap, p, n);
    return ZSTD_isError(z) || z >= n ? n : z;
}

static void explore_block(dataset *d, const opts *o)
{
    size_t es = df_dtype_size(d->dtype), re = d->hidden, nbr = (re + 31) / 32;
    size_t maxrows = 0, raw = 0;
    for (size_t i = 0; i < d->nblocks; i++) {
        size_t r = d->blocks[i].raw_len / d->row_bytes;
        maxrows = r > maxrows ? r : maxrows;
        raw += d->blocks[i].raw_len;
    }
    size_t maxn = maxrows * re, maxnb = maxrows * nbr;
    uint8_t *codes = xmalloc(maxn), *s0 = xmalloc(maxnb), *s1 = xmalloc(maxnb);
    size_t zcap = ZSTD_compressBound(maxn);
    uint8_t *ztmp = xmalloc(zcap);
    uint8_t **zc_codes = xmalloc(sizeof *zc_codes * d->nblocks);
    size_t *zc_len = xmalloc(sizeof *zc_len * d->nblocks), *cp_len = xmalloc(sizeof *cp_len * d->nblocks);
    for (size_t i = 0; i < d->nblocks; i++)
        zc_codes[i] = xmalloc(zcap);
    ZSTD_CCtx *zc = ZSTD_createCCtx();
    ZSTD_DCtx *zd = ZSTD_createDCtx();
    variant def = {"", 0, 1, 0, 0, 6, 7, 0, 0, 0}; /* the codecs' default zstd */
    zstd_apply(zc, &def);
    double *td = xmalloc(sizeof(double) * (size_t)o->repeats);
    float *x = xmalloc(re * sizeof *x), *med = xmalloc(re * sizeof *med);

    printf("\n== explore-block: %s\n", d->name);
    printf("%-40s %6s %8s %8s %8s %8s %8s %9s %9s\n", "design (32-element blocks)", "bits/el",
           "ratio", "ratio", "scale B", "rel RMS", "ordinary", "max err", "code-plane");
    printf("%-40s %6s %8s %8s %8s %8s %8s %9s %9s\n", "", "raw", "codes raw", "codes zstd",
           "per blk", "error", "rel RMS", "/blk amax", "zstd dec GB/s");
    for (size_t v = 0; v < sizeof xvariants / sizeof xvariants[0]; v++) {
        const xvariant *xv = &xvariants[v];
        int b = xv->bits, qmax = b ? (1 << (b - 1)) - 1 : 0;
        double se = 0, sx = 0, worst = 0, so_e = 0, so_x = 0;
        size_t code_raw = 0, code_z = 0, scale_z = 0, nblk_all = 0, nesc = 0;
        for (size_t bi = 0; bi < d->nblocks; bi++) {
            block *bl = &d->blocks[bi];
            size_t rows = bl->raw_len / d->row_bytes, cpos = 0, nb = 0;
            for (size_t r = 0; r < rows; r++) {
                const uint8_t *row = bl->raw + r * d->row_bytes;
                for (size_t i = 0; i < re; i++)
                    x[i] = df_elem_to_f32(row + i * es, d->dtype);
                double ord_lim = ordinary_limit(x, re, med);
                for (size_t k0 = 0; k0 < re; k0 += 32, nb++) {
                    size_t k1 = k0 + 32 < re ? k0 + 32 : re;
                    /* the 5 largest finite |x|, descending */
                    double top[6] = {0};
                    for (size_t i = k0; i < k1; i++) {
                        double a = isfinite(x[i]) ? fabs(x[i]) : 0;
                        int j = 5;
                        while (j > 0 && a > top[j - 1]) {
                            top[j] = top[j - 1];
                            j--;
                        }
                        if (j < 5)
                            top[j] = a;
                    }
                    /* escape the top j: the largest j <= 4 (and < the block's
                     * size) with top[j-1] > escape x top[j] > 0 */
                    int nj = 0;
                    for (int j = 1; xv->escape > 0 && j <= 4 && (size_t)j < k1 - k0; j++)
                        if (top[j] > 0 && top[j - 1] > xv->escape * top[j])
                            nj = j;
                    double amax = top[nj], esc_t = nj ? top[nj - 1] : INFINITY;
                    double scale;
                    uint16_t sb = 0;
                    if (xv->scale == XS_BF16) {
                        float s = amax > 0 ? bf16_ceil(amax / (b ? qmax : 448)) : 0.0f;
                        uint32_t u;
                        memcpy(&u, &s, 4);
                        sb = (uint16_t)(u >> 16);
                        scale = s;
                    } else {
                        int k = -127;
                        if (amax > 0) {
                            double lim = b ? qmax : 448;
                            if (xv->scale == XS_E8M0_MX)
                                k = ilogb(amax) - (b ? ilogb((double)qmax) : 8);
                            else
                                for (k = ilogb(amax) - 12; ldexp(lim, k) < amax; k++)
                                    ;
                            k = k < -127 ? -127 : k > 127 ? 127 : k;
                        }
                        sb = (uint16_t)(k + 127);
                        scale = ldexp(1, k);
                    }
                    s0[nb] = (uint8_t)(xv->scale == XS_BF16 ? sb >> 8 : sb);
                    s1[nb] = (uint8_t)sb;
                    uint64_t acc = 0;
                    int nacc = 0;
                    double emax = 0;
                    for (size_t i = k0; i < k1; i++) {
                        double xi = x[i], y;
                        if (isfinite(xi) && fabs(xi) >= esc_t) {
                            nesc++;
                            y = xi; /* kept exactly; its code slot holds the escape */
                            acc |= (uint64_t)1 << (nacc + b - 1);
                            nacc += b;
                            while (nacc >= 8) {
                                codes[cpos++] = (uint8_t)acc;
                                acc >>= 8;
                                nacc -= 8;
                            }
                        } else if (b) {
                            double q = scale > 0 ? nearbyint(xi / scale) : 0;
                            q = q > qmax ? qmax : q < -qmax ? -qmax : q;
                            y = q * scale;
                            acc |= (uint64_t)((int)q & ((1 << b) - 1)) << nacc;
                            nacc += b;
                            while (nacc >= 8) {
                                codes[cpos++] = (uint8_t)acc;
                                acc >>= 8;
                                nacc -= 8;
                            }
                        } else {
                            uint8_t c = scale > 0 && isfinite(xi) ? ref_e4m3(fabs(xi) / scale) : 0;
                            y = df_e4m3_to_f32(c) * scale;
                            y = xi < 0 ? -y : y;
                            codes[cpos++] = (uint8_t)(c | (xi < 0 ? 0x80 : 0));
                        }
                        if (!isfinite(xi))
                            continue;
                        /* decoded to the dtype */
                        uint8_t tmp[4];
                        if (d->dtype == DF_DTYPE_F32) {
                            float f = (float)y;
                            memcpy(tmp, &f, 4);
                        } else {
                            uint16_t h = d->dtype == DF_DTYPE_BF16 ? df_f32_to_bf16((float)y)
                                                                   : df_f32_to_f16((float)y);
                            memcpy(tmp, &h, 2);
                        }
                        y = df_elem_to_f32(tmp, d->dtype);
                        se += (xi - y) * (xi - y);
                        sx += xi * xi;
                        if (fabs(xi) <= ord_lim) {
                            so_e += (xi - y) * (xi - y);
                            so_x += xi * xi;
                        }
                        emax = fabs(xi - y) > emax ? fabs(xi - y) : emax;
                    }
                    if (nacc)
                        codes[cpos++] = (uint8_t)acc;
                    if (amax > 0 && emax / amax > worst)
                        worst = emax / amax;
                }
            }
            cp_len[bi] = cpos;
            code_raw += cpos;
            size_t z = ZSTD_compress2(zc, zc_codes[bi], zcap, codes, cpos);
            zc_len[bi] = ZSTD_isError(z) ? 0 : z;
            code_z += ZSTD_isError(z) || z >= cpos ? cpos : z;
            scale_z += zsize(zc, s0, nb, ztmp, zcap);
            if (xv->scale == XS_BF16)
                scale_z += zsize(zc, s1, nb, ztmp, zcap);
            nblk_all += nb;
        }
        /* zstd decode of the code planes alone */
        for (int k = 0; k < o->repeats; k++) {
            double t0 = now();
            for (size_t bi = 0; bi < d->nblocks; bi++)
                if (zc_len[bi])
                    ZSTD_decompressDCtx(zd, codes, maxn, zc_codes[bi], zc_len[bi]);
            td[k] = now() - t0;
        }
        size_t sraw = nblk_all * (xv->scale == XS_BF16 ? 2 : 1) + nesc * es;
        scale_z += nesc * es; /* escaped values: counted raw */
        double n_el = (double)(raw / es);
        printf("%-40s %6.3f %8.4f %8.4f %8.3f %8.4f %8.4f %9.4f %9.2f\n", xv->name,
               8.0 * (double)(code_raw + sraw) / n_el,
               (double)(code_raw + scale_z) / (double)raw, (double)(code_z + scale_z) / (double)raw,
               (double)scale_z / (double)nblk_all, sx > 0 ? sqrt(se / sx) : 0,
               so_x > 0 ? sqrt(so_e / so_x) : 0, worst,
               (double)raw / median(td, o->repeats) / 1e9);
        fflush(stdout);
    }
    for (size_t i = 0; i < d->nblocks; i++)
        free(zc_codes[i]);
    free(zc_codes);
    free(zc_len);
    free(cp_len);
    free(codes);
    free(s0);
    free(s1);
    free(ztmp);
    free(td);
    free(x);
    free(med);
    ZSTD_freeCCtx(zc);
    ZSTD_freeDCtx(zd);
}

/* ---- main ------------------------------------------------------------------ */

static void usage(void)
{
    fprintf(stderr,
            "usage: bench_codec [--hidden N[,N..]] [--layers L] [--mib M] [--block-mib B]\n"
            "                   [--repeats R] [--threads T] [--dtype bf16|f16|f32] [--seed S]\n"
            "                   [--level L (codec level; 0 = default)]\n"
            "                   [--file raw.bf16 --hidden N | --cache DIR] [--codecs A,B,..]\n"
            "                   [--impl 0-3] [--explore] [--explore-block] [--json]\n"
            "  defaults: --hidden 5120,256 --layers 4 --mib 32 --block-mib 1 --repeats 5\n"
            "  --threads 0 (all CPUs); --file reads little-endian bf16 rows (real data);\n"
            "  --cache reads every layer of a finished BF16 cache (write it with a lossless\n"
            "  codec); --codecs runs only those codecs (default: all); --impl forces the\n"
            "  kernels' SIMD level (1 scalar, 2 SSE2, 3 AVX2; 0 = auto);\n"
            "  --dtype converts the bf16 data (f32 exactly, f16 rounded).\n");
}

static void print_result(const dataset *d, const result *r, int json, int first)
{
    if (json) {
        printf("%s    {\"codec\": \"%s\", \"dtype\": \"%s\", \"hidden\": %zu, \"ratio\": %.5f, "
               "\"enc_gbs\": %.3f, \"dec_gbs\": %.3f, \"dec_mt_gbs\": %.3f, \"stored_blocks\": %zu",
               first ? "" : ",\n", df_codec_name(r->id), df_dtype_name(d->dtype), d->hidden,
               r->ratio, r->enc_gbs, r->dec_gbs, r->dec_mt_gbs, r->stored_blocks);
        if (df_codec_is_lossy(r->id))
            printf(", \"rel_rms_err\": %.5f, \"ordinary_rel_rms_err\": %.5f, "
                   "\"max_err_rel_row_absmax\": %.5f, \"max_err_rel_block_absmax\": %.5f",
                   r->rel_rms, r->ord_rel_rms, r->max_err_rel_absmax, r->max_err_rel_blk);
        printf(", \"ok\": %s}", r->ok ? "true" : "false");
        return;
    }
    printf("%-11s %7.4f %9.2f %9.2f %11.2f", df_codec_name(r->id), r->ratio, r->enc_gbs, r->dec_gbs,
           r->dec_mt_gbs);
    if (r->stored_blocks)
        printf("  %zu blocks stored", r->stored_blocks);
    if (df_codec_is_lossy(r->id))
        printf("  rel RMS err %.4f (ordinary %.4f), max err %.4f of row / %.4f of block absmax",
               r->rel_rms, r->ord_rel_rms, r->max_err_rel_absmax, r->max_err_rel_blk);
    if (!r->ok)
        printf("  FAILED");
    printf("\n");
}

int main(int argc, char **argv)
{
    opts o = {.hidden = {5120, 256}, .nhidden = 2, .layers = 4, .mib = 32, .block_mib = 1,
              .repeats = 5, .threads = 0, .dtype = DF_DTYPE_BF16, .seed = 1};
    int hidden_given = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--json"))
            o.json = 1;
        else if (!strcmp(a, "--explore"))
            o.explore = 1;
        else if (!strcmp(a, "--explore-block"))
            o.explore_block = 1;
        else if (!v) {
            usage();
            return 2;
        } else if (!strcmp(a, "--hidden")) {
            o.nhidden = 0;
            hidden_given = 1;
            for (char *s = argv[++i]; *s && o.nhidden < 8;) {
                char *end;
                unsigned long h = strtoul(s, &end, 10);
                if (end == s || !h) {
                    usage();
                    return 2;
                }
                o.hidden[o.nhidden++] = h;
                s = *end == ',' ? end + 1 : end;
            }
        } else if (!strcmp(a, "--layers"))
            o.layers = atoi(argv[++i]);
        else if (!strcmp(a, "--mib"))
            o.mib = atof(argv[++i]);
        else if (!strcmp(a, "--block-mib"))
            o.block_mib = atof(argv[++i]);
        else if (!strcmp(a, "--repeats"))
            o.repeats = atoi(argv[++i]);
        else if (!strcmp(a, "--level"))
            o.level = atoi(argv[++i]);
        else if (!strcmp(a, "--threads"))
            o.threads = atoi(argv[++i]);
        else if (!strcmp(a, "--seed"))
            o.seed = strtoull(argv[++i], NULL, 0);
        else if (!strcmp(a, "--file"))
            o.file = argv[++i];
        else if (!strcmp(a, "--cache"))
            o.cache = argv[++i];
        else if (!strcmp(a, "--impl")) {
            if (df_codec_set_plane_impl(atoi(argv[++i])) < 0) {
                fprintf(stderr, "bench_codec: --impl %s not available here\n", argv[i]);
                return 2;
            }
        }
        else if (!strcmp(a, "--codecs")) {
            /* comma-separated names */
            char *list = argv[++i];
            for (char *t = strtok(list, ","); t; t = strtok(NULL, ",")) {
                int id = df_codec_from_name(t);
                if (id < 0) {
                    fprintf(stderr, "bench_codec: unknown codec %s\n", t);
                    return 2;
                }
                o.codec_mask |= 1u << id;
            }
        }
        else if (!strcmp(a, "--dtype")) {
            const char *t = argv[++i];
            o.dtype = !strcmp(t, "bf16") ? DF_DTYPE_BF16 : !strcmp(t, "f16") ? DF_DTYPE_F16
                    : !strcmp(t, "f32") ? DF_DTYPE_F32 : DF_DTYPE_INVALID;
            if (o.dtype == DF_DTYPE_INVALID) {
                usage();
                return 2;
            }
        } else {
            usage();
            return 2;
        }
    }
    if (o.layers < 1 || o.mib <= 0 || o.block_mib <= 0 || o.repeats < 1 || (o.file && !hidden_given)) {
        usage();
        return 2;
    }

    char cpu[256];
    cpu_model(cpu, sizeof cpu);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    df_pool *pool = df_pool_open(o.threads);
    int nthreads = df_pool_size(pool);
    if (o.json)
        printf("{\n  \"machine\": \"%s\", \"cpus\": %ld, \"threads\": %d, \"zstd\": \"%s\", "
               "\"lz4\": \"%s\", \"repeats\": %d,\n  \"results\": [\n",
               cpu, ncpu, nthreads, ZSTD_versionString(), LZ4_versionString(), o.repeats);
    else
        printf("machine: %s, %ld CPUs online; zstd %s, lz4 %s; median of %d runs; "
               "GB/s = raw bytes per second\n",
               cpu, ncpu, ZSTD_versionString(), LZ4_versionString(), o.repeats);

    int first = 1, failed = 0;
    int nsets = o.file || o.cache ? 1 : o.nhidden;
    for (int s = 0; s < nsets; s++) {
        dataset d = {0};
        if (o.file) {
            if (load_file(&d, &o) < 0)
                return 1;
        } else if (o.cache) {
            if (load_cache(&d, &o) < 0)
                return 1;
        } else {
            make_synth(&d, &o, o.hidden[s]);
        }
        if (!o.json) {
            printf("\n%s; %zu blocks of <= %zu bytes (%zu rows)\n", d.name, d.nblocks,
                   d.blocks[0].raw_len, d.blocks[0].raw_len / d.row_bytes);
            printf("%-11s %7s %9s %9s %11s\n", "codec", "ratio", "enc GB/s", "dec GB/s", "dec GB/s");
            printf("%-11s %7s %9s %9s %8s %2d\n", "", "", "1 thread", "1 thread", "threads", nthreads);
        }
        for (int id = 0; id < DF_CODEC_COUNT; id++) {
            if (o.codec_mask && !(o.codec_mask & (1u << id)))
                continue;
            result r = run_codec(&d, id, &o, pool);
            failed |= !r.ok;
            print_result(&d, &r, o.json, first);
            first = 0;
        }
        if (o.explore && !o.json)
            explore(&d, &o);
        if (o.explore_block && !o.json)
            explore_block(&d, &o);
        free_dataset(&d);
    }
    if (o.json)
        printf("\n  ]\n}\n");
    df_pool_close(pool);
    int nc = atomic_load(&n_ctx);
    for (int i = 0; i < nc && i < MAX_THREADS; i++)
        df_codec_ctx_free(all_ctx[i]);
    return failed ? 1 : 0;
}
