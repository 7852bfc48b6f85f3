/* cmd_dump.c - `dflash dump`: inspect a finished hidden-state cache.
 *
 *   dflash dump CACHE_DIR                                   summary
 *   dflash dump CACHE_DIR --samples [--offset K] [--limit N] sample listing
 *   dflash dump CACHE_DIR --sample ID [--layer L] [--rows A:B] [--cols C:D]
 *   dflash dump CACHE_DIR --verify [--threads N]
 *   any of them with --json (one JSON object on stdout, nothing else there)
 *
 * Exit codes: 0 ok, 1 data/IO error (or sample not found), 2 bad usage.
 * docs/DUMP.md describes the output and the JSON schema.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "basis.h"
#include "cache.h"
#include "cmds.h"
#include "codec.h"
#include "dtype.h"
#include "err.h"
#include "fsutil.h"
#include "opt.h"
#include "pool.h"

#define PROG "dflash dump"
#define DEFAULT_LIMIT 20u
#define DEFAULT_SLICE_ROWS 4u
#define DEFAULT_SLICE_COLS 8u
#define TOKENS_PER_LINE 16u
#define MAX_THREADS 4096u

enum { EXIT_OK = 0, EXIT_DATA = 1, EXIT_USAGE = 2 };
enum { MODE_SUMMARY, MODE_SAMPLES, MODE_SAMPLE, MODE_VERIFY };

/* A half-open range [lo, hi); has_lo/has_hi say which ends were written. */
typedef struct range {
    int given;
    int has_lo, has_hi;
    uint64_t lo, hi;
} range;

typedef struct opts {
    const char *dir;
    int mode;
    int json;
    uint64_t limit, offset;
    int has_limit, has_offset;
    uint64_t sample_id;
    int64_t layer;            /* target layer id, or -1 = every layer */
    range rows, cols;
    uint64_t threads;
    int has_threads;
} opts;

/* ------------------------------------------------------------------ */
/* messages                                                            */

static void help(FILE *f)
{
    fprintf(f,
            "usage: dflash dump CACHE_DIR [mode] [options]\n"
            "\n"
            "Inspect a finished hidden-state cache.\n"
            "\n"
            "modes (at most one; default: summary):\n"
            "  (none)             summary: target, layers, dtype, codec, shards, sizes,\n"
            "                     bytes per token, compression ratio per layer\n"
            "  --samples          list samples (sorted by id): tokens, loss tokens, shard,\n"
            "                     offset, record and stored bytes, ratio\n"
            "      --offset K     start at the K-th sample (default 0)\n"
            "      --limit N      show at most N samples (default %u; 0 = all)\n"
            "  --sample ID        one sample by its id (the corpus document index): its\n"
            "                     tokens (loss tokens marked '*'), a slice of each layer's\n"
            "                     hidden states and statistics over the whole layer\n"
            "      --layer L      only target layer L (one of the cache's layer ids;\n"
            "                     default: every layer)\n"
            "      --rows A:B     token rows [A, B) for the token list and the slice\n"
            "                     (default: all tokens; slice rows 0:%u)\n"
            "      --cols C:D     hidden channels [C, D) of the slice (default 0:%u)\n"
            "                     (A:, :B forms accepted; an end past the data is clipped)\n"
            "  --verify           read and check every checksum of every shard, record,\n"
            "                     token section and block; exit 1 on the first problem\n"
            "\n"
            "options:\n"
            "  --threads N        worker threads for --verify and --sample (default 0 =\n"
            "                     all online CPUs)\n"
            "  --json             machine-readable output: one JSON object on stdout\n"
            "  -h, --help         this help\n"
            "\n"
            "exit status: 0 ok, 1 data or I/O error (also: sample id not in the cache),\n"
            "             2 usage error (unknown option, missing or bad value, layer not\n"
            "             in the cache, rows/cols outside the sample)\n",
            DEFAULT_LIMIT, DEFAULT_SLICE_ROWS, DEFAULT_SLICE_COLS);
}

static int usage_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_err(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs(PROG ": ", stderr);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputs("\n(try 'dflash dump --help')\n", stderr);
    return EXIT_USAGE;
}

static int data_err(const df_err *e, int code)
{
    const char *msg = e && e->msg[0] ? e->msg : df_strerror(code);
    fprintf(stderr, PROG ": %s\n", msg);
    return EXIT_DATA;
}

/* ------------------------------------------------------------------ */
/* argument parsing                                                    */

/* Strict unsigned decimal: digits only, no sign, no spaces, no overflow. */
static int parse_u64(const char *s, uint64_t *out)
{
    if (!s || *s < '0' || *s > '9')
        return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end)
        return -1;
    *out = v;
    return 0;
}

/* "A:B", "A:", ":B" -> [A, B). Both ends given: A < B required. */
static int parse_range(const char *s, range *r)
{
    const char *colon = strchr(s, ':');
    if (!colon || strchr(colon + 1, ':'))
        return -1;
    char lo[32];
    size_t n = (size_t)(colon - s);
    if (n >= sizeof lo)
        return -1;
    memcpy(lo, s, n);
    lo[n] = 0;
    memset(r, 0, sizeof *r);
    r->given = 1;
    if (n) {
        if (parse_u64(lo, &r->lo))
            return -1;
        r->has_lo = 1;
    }
    if (colon[1]) {
        if (parse_u64(colon + 1, &r->hi))
            return -1;
        r->has_hi = 1;
    }
    if (!r->has_lo && !r->has_hi)
        return -1;
    if (r->has_lo && r->has_hi && r->lo >= r->hi)
        return -1;
    return 0;
}

/* Matches "--name" or "--name=VALUE". *val is set to the inline value, or to
 * the next argument (advancing *i) when the option takes one. */
static int match_opt(int argc, char **argv, int *i, const char *name, int takes_value,
                     const char **val, int *err)
{
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (strncmp(a, name, n) || (a[n] && a[n] != '='))
        return 0;
    if (!takes_value) {
        if (a[n] == '=') {
            *err = usage_err("option %s takes no value", name);
            return -1;
        }
        return 1;
    }
    if (a[n] == '=') {
        *val = a + n + 1;
    } else if (*i + 1 < argc) {
        *val = argv[++*i];
    } else {
        *err = usage_err("option %s needs a value", name);
        return -1;
    }
    return 1;
}

static int set_mode(opts *o, int mode, const char *name)
{
    if (o->mode != MODE_SUMMARY && o->mode != mode)
        return usage_err("%s cannot be combined with another mode (--samples, --sample, --verify)",
                         name);
    if (o->mode == mode)
        return usage_err("%s given twice", name);
    o->mode = mode;
    return 0;
}

/* Returns -1 to continue, or an exit code (0 after --help). */
static int parse_args(int argc, char **argv, opts *o)
{
    memset(o, 0, sizeof *o);
    o->mode = MODE_SUMMARY;
    o->limit = DEFAULT_LIMIT;
    o->layer = -1;
    int no_more_opts = 0, have_layer = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = NULL;
        df_err pe = {0}; /* a numeric option's message (common/opt.h) */
        int err = 0, m;
        if (no_more_opts || a[0] != '-' || !a[1]) {
            if (o->dir)
                return usage_err("unexpected argument '%s' (one CACHE_DIR only)", a);
            o->dir = a;
            continue;
        }
        if (!strcmp(a, "--")) {
            no_more_opts = 1;
            continue;
        }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            help(stdout);
            return EXIT_OK;
        }
        /* OPT: 0 no match, 1 match, else the usage exit code (error printed). */
#define OPT(name, tv) ((m = match_opt(argc, argv, &i, name, tv, &v, &err)) < 0 ? err : m)
        if ((m = OPT("--json", 0))) {
            if (m != 1)
                return m;
            o->json = 1;
        } else if ((m = OPT("--samples", 0))) {
            if (m != 1)
                return m;
            if ((err = set_mode(o, MODE_SAMPLES, "--samples")))
                return err;
        } else if ((m = OPT("--verify", 0))) {
            if (m != 1)
                return m;
            if ((err = set_mode(o, MODE_VERIFY, "--verify")))
                return err;
        } else if ((m = OPT("--sample", 1))) {
            if (m != 1)
                return m;
            if ((err = set_mode(o, MODE_SAMPLE, "--sample")))
                return err;
            if (df_opt_u64("--sample", v, 0, UINT64_MAX, &o->sample_id, &pe))
                return usage_err("%s (a sample id)", pe.msg);
        } else if ((m = OPT("--limit", 1))) {
            if (m != 1)
                return m;
            if (df_opt_u64("--limit", v, 0, UINT64_MAX, &o->limit, &pe))
                return usage_err("%s", pe.msg);
            o->has_limit = 1;
        } else if ((m = OPT("--offset", 1))) {
            if (m != 1)
                return m;
            if (df_opt_u64("--offset", v, 0, UINT64_MAX, &o->offset, &pe))
                return usage_err("%s", pe.msg);
            o->has_offset = 1;
        } else if ((m = OPT("--layer", 1))) {
            if (m != 1)
                return m;
            uint64_t l;
            if (df_opt_u64("--layer", v, 0, INT32_MAX, &l, &pe))
                return usage_err("%s (a target layer id)", pe.msg);
            if (have_layer)
                return usage_err("--layer given twice");
            o->layer = (int64_t)l;
            have_layer = 1;
        } else if ((m = OPT("--rows", 1))) {
            if (m != 1)
                return m;
            if (parse_range(v, &o->rows))
                return usage_err("--rows: '%s' is not a range A:B with A < B", v);
        } else if ((m = OPT("--cols", 1))) {
            if (m != 1)
                return m;
            if (parse_range(v, &o->cols))
                return usage_err("--cols: '%s' is not a range C:D with C < D", v);
        } else if ((m = OPT("--threads", 1))) {
            if (m != 1)
                return m;
            if (df_opt_u64("--threads", v, 0, MAX_THREADS, &o->threads, &pe))
                return usage_err("%s", pe.msg);
            o->has_threads = 1;
        } else {
            return usage_err("unknown option '%s'", a);
        }
#undef OPT
    }
    if (!o->dir)
        return usage_err("missing CACHE_DIR");
    if ((o->has_limit || o->has_offset) && o->mode != MODE_SAMPLES)
        return usage_err("--offset and --limit apply to --samples only");
    if ((have_layer || o->rows.given || o->cols.given) && o->mode != MODE_SAMPLE)
        return usage_err("--layer, --rows and --cols apply to --sample only");
    if (o->has_threads && o->mode != MODE_VERIFY && o->mode != MODE_SAMPLE)
        return usage_err("--threads applies to --verify and --sample only");
    return -1;
}

/* ------------------------------------------------------------------ */
/* formatting helpers                                                  */

static const char *human_bytes(char *buf, size_t n, double b)
{
    static const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    int u = 0;
    while (b >= 1024.0 && u < 6) {
        b /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, n, "%.0f B", b);
    else
        snprintf(buf, n, "%.*f %s", b < 10 ? 2 : b < 100 ? 1 : 0, b, unit[u]);
    return buf;
}

/* 12345678 -> "12,345,678" */
static const char *grouped(char *buf, size_t n, uint64_t v)
{
    char tmp[32];
    int len = snprintf(tmp, sizeof tmp, "%" PRIu64, v);
    size_t o = 0;
    for (int i = 0; i < len && o + 2 < n; i++) {
        if (i && (len - i) % 3 == 0)
            buf[o++] = ',';
        buf[o++] = tmp[i];
    }
    buf[o] = 0;
    return buf;
}

static const char *ratio_str(char *buf, size_t n, double num, double den)
{
    if (den > 0)
        snprintf(buf, n, "%.3f", num / den);
    else
        snprintf(buf, n, "-");
    return buf;
}

static void json_add_ratio(cJSON *o, const char *k, double num, double den)
{
    if (den > 0)
        cJSON_AddNumberToObject(o, k, num / den);
    else
        cJSON_AddNullToObject(o, k);
}

static void json_add_num(cJSON *o, const char *k, double v)
{
    if (isfinite(v))
        cJSON_AddNumberToObject(o, k, v);
    else
        cJSON_AddNullToObject(o, k);
}

static void hex(char *out, const uint8_t *b, size_t n)
{
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = d[b[i] >> 4];
        out[2 * i + 1] = d[b[i] & 15];
    }
    out[2 * n] = 0;
}

/* Prints a cJSON tree to stdout and frees it. 0, or EXIT_DATA when out of memory. */
static int json_emit(cJSON *root)
{
    if (!root) {
        fprintf(stderr, PROG ": out of memory building JSON\n");
        return EXIT_DATA;
    }
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    if (!s) {
        fprintf(stderr, PROG ": out of memory printing JSON\n");
        return EXIT_DATA;
    }
    fputs(s, stdout);
    fputc('\n', stdout);
    free(s);
    return 0;
}

/* Bytes of one token's hidden states over all stored layers. */
static uint64_t raw_bytes_per_token(const df_cache_params *p)
{
    return (uint64_t)p->n_layers * p->hidden_size * df_dtype_size(p->dtype);
}

static const char *shard_name(const df_cache_info *inf, uint32_t s)
{
    return s < inf->n_shards && inf->shards ? inf->shards[s].data : "?";
}

/* ------------------------------------------------------------------ */
/* summary                                                             */

/* What a projected cache's basis file says of itself (dump --verify checks it). */
typedef struct basis_facts {
    int K, kind;
    int32_t layer_ids[DF_BASIS_MAX_LAYERS];
    double kept, layer_kept[DF_BASIS_MAX_LAYERS];
} basis_facts;

static int read_basis_facts(const char *dir, basis_facts *f)
{
    char path[4200];
    df_basis b = {0};
    df_err e = {0};
    snprintf(path, sizeof path, "%s/%s", dir, DF_CACHE_BASIS_FILE);
    if (df_basis_read(path, &b, &e))
        return -1;
    f->K = b.K;
    f->kind = b.kind;
    f->kept = b.kept;
    memcpy(f->layer_ids, b.layer_ids, sizeof f->layer_ids);
    memcpy(f->layer_kept, b.layer_kept, sizeof f->layer_kept);
    df_basis_free(&b);
    return 0;
}

static int do_summary(df_cache *c, const opts *o)
{
    const df_cache_info *inf = df_cache_get_info(c);
    const df_cache_params *p = &inf->params;
    uint64_t rpt = raw_bytes_per_token(p);
    double tok = (double)inf->tokens;

    if (o->json) {
        cJSON *r = cJSON_CreateObject(), *t, *a, *cd, *sh, *bpt, *corp;
        char uuid[33];
        hex(uuid, p->uuid, 16);
        cJSON_AddStringToObject(r, "dir", df_cache_dir(c));
        cJSON_AddStringToObject(r, "created_by", inf->created_by);
        cJSON_AddNumberToObject(r, "format_version",
                                p->proj_rank ? DF_CACHE_VERSION_PROJECTED : DF_CACHE_VERSION);
        cJSON_AddStringToObject(r, "uuid", uuid);
        cJSON_AddItemToObject(r, "target", t = cJSON_CreateObject());
        cJSON_AddStringToObject(t, "model_type", p->model_type);
        cJSON_AddStringToObject(t, "target_name", p->target_name);
        cJSON_AddStringToObject(t, "config_sha256", p->config_sha256);
        cJSON_AddNumberToObject(t, "hidden_size", df_cache_target_hidden(p));
        cJSON_AddNumberToObject(t, "num_layers", p->num_target_layers);
        cJSON_AddNumberToObject(t, "vocab_size", (double)p->vocab_size);
        cJSON_AddItemToObject(r, "layer_ids", a = cJSON_CreateArray());
        for (uint32_t i = 0; i < p->n_layers && i < DF_CACHE_MAX_LAYERS; i++)
            cJSON_AddItemToArray(a, cJSON_CreateNumber(p->layer_ids[i]));
        cJSON_AddStringToObject(r, "dtype", df_dtype_name(p->dtype));
        cJSON_AddItemToObject(r, "codec", cd = cJSON_CreateObject());
        cJSON_AddNumberToObject(cd, "id", p->codec);
        cJSON_AddStringToObject(cd, "name", df_codec_name(p->codec));
        cJSON_AddNumberToObject(cd, "level", p->codec_level);
        cJSON_AddBoolToObject(cd, "lossy", df_codec_is_lossy(p->codec) ? 1 : 0);
        if (p->proj_rank) {
            cJSON *pj = cJSON_AddObjectToObject(r, "projection");
            cJSON_AddNumberToObject(pj, "rank", p->proj_rank);
            cJSON_AddItemToObject(pj, "source_layer_ids", a = cJSON_CreateArray());
            for (uint32_t i = 0; i < p->src_n_layers; i++)
                cJSON_AddItemToArray(a, cJSON_CreateNumber(p->src_layer_ids[i]));
            cJSON_AddNumberToObject(pj, "source_hidden_size", p->src_hidden);
            cJSON_AddStringToObject(pj, "basis_sha256", p->basis_sha256);
            double src_raw = (double)p->src_n_layers * p->src_hidden * df_dtype_size(p->dtype);
            json_add_ratio(pj, "ratio_of_source", (double)inf->stored_bytes, src_raw * tok);
            basis_facts bf;
            if (!read_basis_facts(df_cache_dir(c), &bf)) {
                cJSON_AddNumberToObject(pj, "kept_energy", bf.kept);
                cJSON_AddItemToObject(pj, "kept_energy_per_layer", a = cJSON_CreateArray());
                for (int k = 0; k < bf.K; k++)
                    cJSON_AddItemToArray(a, cJSON_CreateNumber(bf.layer_kept[k]));
                cJSON_AddStringToObject(pj, "basis_kind", bf.kind == DF_BASIS_KIND_ROWS
                                                              ? "rows" : "moment");
            }
        }
        cJSON_AddNumberToObject(r, "rows_per_block", p->rows_per_block);
        cJSON_AddNumberToObject(r, "world_size", p->world_size);
        cJSON_AddItemToObject(r, "shards", sh = cJSON_CreateObject());
        cJSON_AddNumberToObject(sh, "count", inf->n_shards);
        cJSON_AddNumberToObject(sh, "file_bytes", (double)inf->file_bytes);
        cJSON_AddItemToObject(sh, "list", a = cJSON_CreateArray());
        for (uint32_t s = 0; s < inf->n_shards && inf->shards; s++) {
            const df_cache_shard_info *si = &inf->shards[s];
            cJSON *x = cJSON_CreateObject();
            cJSON_AddStringToObject(x, "data", si->data);
            cJSON_AddStringToObject(x, "index", si->index);
            cJSON_AddNumberToObject(x, "rank", si->rank);
            cJSON_AddNumberToObject(x, "seq", si->seq);
            cJSON_AddNumberToObject(x, "samples", (double)si->samples);
            cJSON_AddNumberToObject(x, "tokens", (double)si->tokens);
            cJSON_AddNumberToObject(x, "bytes", (double)si->bytes);
            cJSON_AddItemToArray(a, x);
        }
        cJSON_AddNumberToObject(r, "samples", (double)inf->samples);
        cJSON_AddNumberToObject(r, "tokens", (double)inf->tokens);
        cJSON_AddNumberToObject(r, "loss_tokens", (double)inf->loss_tokens);
        cJSON_AddNumberToObject(r, "raw_bytes", (double)inf->raw_bytes);
        cJSON_AddNumberToObject(r, "stored_bytes", (double)inf->stored_bytes);
        cJSON_AddItemToObject(r, "bytes_per_token", bpt = cJSON_CreateObject());
        json_add_ratio(bpt, "stored", (double)inf->stored_bytes, tok);
        json_add_ratio(bpt, "file", (double)inf->file_bytes, tok);
        cJSON_AddNumberToObject(bpt, "raw", (double)rpt);
        json_add_ratio(r, "ratio", (double)inf->stored_bytes, (double)inf->raw_bytes);
        json_add_ratio(r, "file_ratio", (double)inf->file_bytes, (double)rpt * tok);
        cJSON_AddItemToObject(r, "layers", a = cJSON_CreateArray());
        for (uint32_t i = 0; i < p->n_layers && i < DF_CACHE_MAX_LAYERS; i++) {
            cJSON *x = cJSON_CreateObject();
            cJSON_AddNumberToObject(x, "layer", p->layer_ids[i]);
            cJSON_AddNumberToObject(x, "raw_bytes", (double)inf->layer_raw[i]);
            cJSON_AddNumberToObject(x, "stored_bytes", (double)inf->layer_stored[i]);
            json_add_ratio(x, "ratio", (double)inf->layer_stored[i], (double)inf->layer_raw[i]);
            cJSON_AddItemToArray(a, x);
        }
        cJSON_AddItemToObject(r, "corpus", corp = cJSON_CreateObject());
        cJSON_AddStringToObject(corp, "fingerprint", p->corpus_fingerprint);
        cJSON_AddNumberToObject(corp, "docs", (double)p->corpus_docs);
        return json_emit(r) ? EXIT_DATA : EXIT_OK;
    }

    char b1[32], b2[32], b3[32], b4[32];
    printf("cache        %s\n", df_cache_dir(c));
    printf("created by   %s\n", inf->created_by[0] ? inf->created_by : "?");
    printf("target       %s '%s'  config sha256 %.12s  hidden %" PRIu32 "  layers %" PRIu32
           "  vocab %" PRId64 "\n",
           p->model_type, p->target_name, p->config_sha256, df_cache_target_hidden(p),
           p->num_target_layers, p->vocab_size);
    if (p->proj_rank) {
        printf("features     PROJECTED: z = P x, rank %" PRIu32 " of %" PRIu32 " x %" PRIu32
               " (layers", p->proj_rank, p->src_n_layers, p->src_hidden);
        for (uint32_t i = 0; i < p->src_n_layers; i++)
            printf(" %" PRId32, p->src_layer_ids[i]);
        printf("), basis %s sha256 %.12s\n", DF_CACHE_BASIS_FILE, p->basis_sha256);
        basis_facts bf;
        if (read_basis_facts(df_cache_dir(c), &bf))
            printf("basis        unreadable (dflash dump --verify says why)\n");
        else {
            printf("basis        %s, keeps %.2f%% of the features' energy; per layer:",
                   bf.kind == DF_BASIS_KIND_ROWS ? "a drafter's fc rows" : "top eigenvectors",
                   100 * bf.kept);
            for (int k = 0; k < bf.K; k++)
                printf(" %d: %.2f%%", bf.layer_ids[k], 100 * bf.layer_kept[k]);
            printf("\n");
        }
        double src_raw = (double)p->src_n_layers * p->src_hidden * df_dtype_size(p->dtype);
        if (inf->tokens)
            printf("of source    stored %s of the raw features' %s per token (%s)\n",
                   human_bytes(b1, sizeof b1, (double)inf->stored_bytes / tok),
                   human_bytes(b2, sizeof b2, src_raw),
                   ratio_str(b3, sizeof b3, (double)inf->stored_bytes, src_raw * tok));
    } else {
        printf("features     %" PRIu32 " layer%s:", p->n_layers, p->n_layers == 1 ? "" : "s");
        for (uint32_t i = 0; i < p->n_layers && i < DF_CACHE_MAX_LAYERS; i++)
            printf(" %" PRId32, p->layer_ids[i]);
        printf("\n");
    }
    printf("dtype        %s\n", df_dtype_name(p->dtype));
    if (p->codec_level)
        snprintf(b1, sizeof b1, "level %d", p->codec_level);
    else
        snprintf(b1, sizeof b1, "default level");
    printf("codec        %s (%s), %s\n", df_codec_name(p->codec), b1,
           df_codec_is_lossy(p->codec) ? "LOSSY" : p->proj_rank ? "lossless (of z)" : "lossless");
    printf("block        %" PRIu32 " rows\n", p->rows_per_block);
    printf("shards       %" PRIu32 " (%" PRIu32 " writer rank%s), %s\n", inf->n_shards,
           p->world_size, p->world_size == 1 ? "" : "s",
           human_bytes(b1, sizeof b1, (double)inf->file_bytes));
    printf("samples      %s\n", grouped(b1, sizeof b1, inf->samples));
    printf("tokens       %s, loss tokens %s (%s%%)\n", grouped(b1, sizeof b1, inf->tokens),
           grouped(b2, sizeof b2, inf->loss_tokens),
           inf->tokens ? (snprintf(b3, sizeof b3, "%.1f",
                                   100.0 * (double)inf->loss_tokens / tok), b3) : "-");
    if (inf->tokens)
        printf("bytes/token  raw %s, stored %s (hidden states), file %s (with headers, "
               "tokens, padding)\n",
               human_bytes(b1, sizeof b1, (double)rpt),
               human_bytes(b2, sizeof b2, (double)inf->stored_bytes / tok),
               human_bytes(b3, sizeof b3, (double)inf->file_bytes / tok));
    else
        printf("bytes/token  raw %s, stored -, file -\n", human_bytes(b1, sizeof b1, (double)rpt));
    printf("ratio        %s stored/raw, %s file/raw (%s raw hidden states -> %s stored)\n",
           ratio_str(b1, sizeof b1, (double)inf->stored_bytes, (double)inf->raw_bytes),
           ratio_str(b2, sizeof b2, (double)inf->file_bytes, (double)rpt * tok),
           human_bytes(b3, sizeof b3, (double)inf->raw_bytes),
           human_bytes(b4, sizeof b4, (double)inf->stored_bytes));
    printf("  %-6s %12s %12s %7s\n", "layer", "raw", "stored", "ratio");
    for (uint32_t i = 0; i < p->n_layers && i < DF_CACHE_MAX_LAYERS; i++)
        printf("  %-6s %12s %12s %7s\n", p->proj_rank ? "z" : (snprintf(b4, sizeof b4, "%" PRId32,
                                                                       p->layer_ids[i]), b4),
               human_bytes(b1, sizeof b1, (double)inf->layer_raw[i]),
               human_bytes(b2, sizeof b2, (double)inf->layer_stored[i]),
               ratio_str(b3, sizeof b3, (double)inf->layer_stored[i], (double)inf->layer_raw[i]));
    printf("corpus       fingerprint %.16s  docs %s\n",
           p->corpus_fingerprint[0] ? p->corpus_fingerprint : "-",
           grouped(b1, sizeof b1, p->corpus_docs));
    return EXIT_OK;
}

/* ------------------------------------------------------------------ */
/* sample listing                                                      */

static int do_samples(df_cache *c, const opts *o)
{
    const df_cache_info *inf = df_cache_get_info(c);
    uint64_t rpt = raw_bytes_per_token(&inf->params);
    size_t total = df_cache_count(c);
    uint64_t first = o->offset < total ? o->offset : total;
    uint64_t last = o->limit == 0 || total - first < o->limit ? total : first + o->limit;

    if (o->json) {
        cJSON *r = cJSON_CreateObject(), *a;
        cJSON_AddNumberToObject(r, "total", (double)total);
        cJSON_AddNumberToObject(r, "offset", (double)o->offset);
        cJSON_AddNumberToObject(r, "limit", (double)o->limit);
        cJSON_AddItemToObject(r, "samples", a = cJSON_CreateArray());
        for (uint64_t k = first; k < last; k++) {
            const df_cache_entry *en = df_cache_entry_at(c, (size_t)k);
            cJSON *x = cJSON_CreateObject();
            cJSON_AddNumberToObject(x, "id", (double)en->id);
            cJSON_AddNumberToObject(x, "n_tokens", en->n_tokens);
            cJSON_AddNumberToObject(x, "n_loss", en->n_loss);
            cJSON_AddStringToObject(x, "shard", shard_name(inf, en->shard));
            cJSON_AddNumberToObject(x, "offset", (double)en->offset);
            cJSON_AddNumberToObject(x, "record_bytes", (double)en->record_bytes);
            cJSON_AddNumberToObject(x, "stored_bytes", (double)en->stored_bytes);
            json_add_ratio(x, "ratio", (double)en->stored_bytes, (double)rpt * en->n_tokens);
            cJSON_AddItemToArray(a, x);
        }
        return json_emit(r) ? EXIT_DATA : EXIT_OK;
    }

    char b1[32], b2[32], b3[32];
    if (first == last)
        printf("%s samples; none at --offset %" PRIu64 "\n", grouped(b1, sizeof b1, total),
               o->offset);
    else
        printf("%s samples; showing positions %" PRIu64 "..%" PRIu64 "%s\n",
               grouped(b1, sizeof b1, total), first, last - 1,
               last < total ? " (--offset/--limit for more)" : "");
    if (first == last)
        return EXIT_OK;
    printf("%12s %8s %8s  %-24s %14s %10s %10s %6s\n", "id", "tokens", "loss", "shard", "offset",
           "record", "stored", "ratio");
    for (uint64_t k = first; k < last; k++) {
        const df_cache_entry *en = df_cache_entry_at(c, (size_t)k);
        printf("%12" PRIu64 " %8" PRIu32 " %8" PRIu32 "  %-24s %14" PRIu64 " %10s %10s %6s\n",
               en->id, en->n_tokens, en->n_loss, shard_name(inf, en->shard), en->offset,
               human_bytes(b1, sizeof b1, (double)en->record_bytes),
               human_bytes(b2, sizeof b2, (double)en->stored_bytes),
               ratio_str(b3, sizeof b3, (double)en->stored_bytes, (double)rpt * en->n_tokens));
    }
    return EXIT_OK;
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

static int do_sample(df_cache *c, const opts *o, df_pool *pool)
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
        rc = data_err(&e, r);
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
        cJSON_AddStringToObject(root, "shard", shard_name(inf, en->shard));
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
               en->id, k, df_cache_count(c), nt, n_loss, shard_name(inf, en->shard), en->offset,
               human_bytes(b1, sizeof b1, (double)en->record_bytes),
               human_bytes((char[32]){0}, 32, (double)en->stored_bytes));
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
            rc = data_err(&e, r);
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
        int jr = json_emit(root);
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

static int do_verify(df_cache *c, const opts *o, df_pool *pool)
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
        if (json_emit(j))
            return EXIT_DATA;
        if (!ok)
            fprintf(stderr, PROG ": %s\n", e.msg[0] ? e.msg : df_strerror(r));
        return ok ? EXIT_OK : EXIT_DATA;
    }
    if (!ok) {
        data_err(&e, r);
        fprintf(stderr, PROG ": FAILED: %" PRIu64 " of %zu samples bad\n", bad ? bad : 1, n);
        return EXIT_DATA;
    }
    char b1[32];
    printf("OK: %zu samples, %" PRIu64 " blocks verified (%s in %.1f s)\n", n, blocks,
           human_bytes(b1, sizeof b1, (double)inf->file_bytes), secs);
    return EXIT_OK;
}

/* ------------------------------------------------------------------ */

int cmd_dump(int argc, char **argv)
{
    opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc >= 0)
        return rc;

    df_err e = {0};
    df_cache *c = df_cache_open(o.dir, &e);
    if (!c) {
        if (!e.msg[0])
            snprintf(e.msg, sizeof e.msg, "%s: cannot open cache", o.dir);
        if (o.mode == MODE_VERIFY && o.json) {
            cJSON *j = cJSON_CreateObject();
            cJSON_AddBoolToObject(j, "ok", 0);
            cJSON_AddStringToObject(j, "dir", o.dir);
            cJSON_AddNullToObject(j, "samples");
            cJSON_AddNullToObject(j, "blocks");
            cJSON_AddNullToObject(j, "bad_samples");
            cJSON_AddNullToObject(j, "file_bytes");
            cJSON_AddNullToObject(j, "seconds");
            cJSON_AddStringToObject(j, "error", e.msg);
            cJSON_AddNumberToObject(j, "error_code", e.code ? e.code : -EIO);
            json_emit(j);
        }
        return data_err(&e, e.code ? e.code : -EIO);
    }

    df_pool *pool = NULL;
    if (o.mode == MODE_VERIFY || o.mode == MODE_SAMPLE) {
        pool = df_pool_open((int)o.threads);
        if (!pool) {
            fprintf(stderr, PROG ": cannot start %" PRIu64 " worker threads\n", o.threads);
            df_cache_close(c);
            return EXIT_DATA;
        }
    }

    switch (o.mode) {
    case MODE_SAMPLES: rc = do_samples(c, &o); break;
    case MODE_SAMPLE: rc = do_sample(c, &o, pool); break;
    case MODE_VERIFY: rc = do_verify(c, &o, pool); break;
    default: rc = do_summary(c, &o); break;
    }
    if (fflush(stdout) != 0 && rc == EXIT_OK) {
        fprintf(stderr, PROG ": writing output: %s\n", strerror(errno));
        rc = EXIT_DATA;
    }
    df_pool_close(pool);
    df_cache_close(c);
    return rc;
}
