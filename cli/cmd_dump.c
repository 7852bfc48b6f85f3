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
 *
 * This file holds the command's frame: help, option parsing, opening the
 * cache, dispatch to the mode, and the output helpers the modes share. Each
 * mode is its own file (see dump_internal.h for which and their contract).
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache.h"
#include "cmds.h"
#include "dump_internal.h"
#include "err.h"
#include "opt.h"
#include "pool.h"

#define DEFAULT_LIMIT 20u
#define MAX_THREADS 4096u

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

int dump_data_err(const df_err *e, int code)
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
/* output helpers the mode files share (dump_internal.h)               */

const char *dump_human_bytes(char *buf, size_t n, double b)
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

/* Prints a cJSON tree to stdout and frees it. 0, or EXIT_DATA when out of memory. */
int dump_json_emit(cJSON *root)
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

const char *dump_shard_name(const df_cache_info *inf, uint32_t s)
{
    return s < inf->n_shards && inf->shards ? inf->shards[s].data : "?";
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
            dump_json_emit(j);
        }
        return dump_data_err(&e, e.code ? e.code : -EIO);
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
    case MODE_SAMPLES: rc = dump_samples(c, &o); break;
    case MODE_SAMPLE: rc = dump_sample(c, &o, pool); break;
    case MODE_VERIFY: rc = dump_verify(c, &o, pool); break;
    default: rc = dump_summary(c, &o); break;
    }
    if (fflush(stdout) != 0 && rc == EXIT_OK) {
        fprintf(stderr, PROG ": writing output: %s\n", strerror(errno));
        rc = EXIT_DATA;
    }
    df_pool_close(pool);
    df_cache_close(c);
    return rc;
}
