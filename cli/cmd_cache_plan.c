/* cmd_cache_plan.c - `dflash cache plan`: a cache's size before anything runs.
 * Bytes per token = feature values per token (layers x hidden, or a
 * projection's rank) x 2 (BF16) x the codec's ratio, plus the token ids,
 * loss mask and record padding. The ratio is measured on an existing cache
 * (--from: its blocks encoded again with the chosen codec) or taken from the
 * typical ratios measured on real hidden states (docs/FORMAT-codecs.md). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>

#include "cache.h"
#include "cmds.h"
#include "codec.h"
#include "corpus.h"
#include "hfconfig.h"
#include "opt.h"

/* Stored / raw on real BF16 hidden states (qwen3-code-8m layers 1-4, 103k tokens,
 * docs/FORMAT-codecs.md; split-zstd over corpus30k's 9.5M tokens). Late layers of
 * large targets, with massive activations, may compress differently: --from measures. */
static double typical_ratio(int codec)
{
    switch (codec) {
    case DF_CODEC_STORED: case DF_CODEC_LZ4: return 1.0;
    case DF_CODEC_SPLIT_LZ4: return 0.84;
    case DF_CODEC_SPLIT_ZSTD: return 0.656;
    case DF_CODEC_FP8_E4M3: return 0.4195;
    case DF_CODEC_FP8_B32: return 0.4222;
    case DF_CODEC_INT4_B32: return 0.2325;
    case DF_CODEC_INT5_B32: return 0.3173;
    case DF_CODEC_INT6_B32: return 0.3864;
    case DF_CODEC_INT3_B32: return 0.1697;
    case DF_CODEC_INT2_B32: return 0.0695;
    default: return 1.0;
    }
}

/* Per-token overhead beyond the hidden states: id (4 B) + loss mask (1 B); records are
 * padded to 4 KiB, about 2 KiB per document (counted when the corpus is known). */
#define TOKEN_BYTES 5.0
#define PAD_PER_DOC 2048.0

static void plan_usage(FILE *f)
{
    fprintf(f,
            "usage: dflash cache plan (--model DIR | --hidden H) [--layers K] (--tokens N |\n"
            "                         --corpus FILE) [--codec C] [--rank R | --rank-frac F]\n"
            "                         [--from CACHE] [--disk DIR]\n"
            "The size of a cache before it is made: bytes per token and the total.\n"
            "  --model DIR     the target (hidden size and layer count from its config.json)\n"
            "  --hidden H      or its hidden size alone\n"
            "  --layers K      feature layers (default: the DFlash rule, min(5, layers - 3);\n"
            "                  5 with --hidden)\n"
            "  --tokens N      corpus tokens (1.3e9 is fine), or --corpus FILE (.dtok or JSONL)\n"
            "  --codec C       default split-zstd (lossless); fp8-b32, int6-b32, int5-b32,\n"
            "                  int4-b32, int3-b32, int2-b32, fp8-e4m3 are lossy\n"
            "                  (docs/FORMAT-codecs.md)\n"
            "  --rank R        a projected cache of rank R (dflash cache project); --rank-frac F:\n"
            "                  R = F x layers x hidden\n"
            "  --from CACHE    measure the codec's ratio on up to 64 samples of this cache\n"
            "                  (same kind of states, any codec) instead of the typical ratio\n"
            "  --disk DIR      say whether it fits in the free space of DIR's file system\n"
            "Exit status: 0, 1 bad data or I/O, 2 bad usage.\n");
}

/* Stored / raw of codec on the first samples of an existing cache, every layer. */
static int measure(const char *dir, int codec, double *ratio, uint64_t *tokens_seen, df_err *e)
{
    df_cache *c = df_cache_open(dir, e);
    if (!c)
        return e->code ? e->code : -EIO;
    const df_cache_params *p = &df_cache_get_info(c)->params;
    size_t n = df_cache_count(c), take = n < 64 ? n : 64, row = (size_t)p->hidden_size * 2;
    int rc = 0;
    double raw = 0, stored = 0;
    df_codec_ctx *ctx = df_codec_ctx_new();
    df_cache_out out = {0};
    uint8_t *dst = NULL;
    *tokens_seen = 0;
    if (!ctx)
        rc = df_errf(e, -ENOMEM, "out of memory");
    if (!rc && p->dtype != DF_DTYPE_BF16)
        rc = df_errf(e, -ENOTSUP, "%s: %s states; plan measures BF16 caches", dir,
                     df_dtype_name(p->dtype));
    for (size_t k = 0; !rc && k < take; k++) {
        uint32_t nt = df_cache_entry_at(c, k)->n_tokens;
        if (!nt)
            continue;
        out.ids = malloc((size_t)nt * 4);
        out.loss_mask = malloc(nt);
        dst = malloc((size_t)nt * row);
        int ok = out.ids && out.loss_mask && dst;
        for (uint32_t l = 0; ok && l < p->n_layers; l++)
            ok = (out.layers[l] = malloc((size_t)nt * row)) != NULL;
        rc = ok ? df_cache_read(c, k, ~0ull, &out, NULL, e) : df_errf(e, -ENOMEM, "out of memory");
        df_codec_params cp = {DF_DTYPE_BF16, p->hidden_size, 0};
        for (uint32_t l = 0; !rc && l < p->n_layers; l++) {
            size_t len = 0;
            int id = df_codec_encode(ctx, codec, &cp, out.layers[l], (size_t)nt * row, dst,
                                     (size_t)nt * row, &len, e);
            if (id < 0)
                rc = id;
            raw += (double)nt * (double)row;
            stored += (double)len;
        }
        *tokens_seen += nt;
        free(out.ids);
        free(out.loss_mask);
        free(dst);
        dst = NULL;
        for (uint32_t l = 0; l < p->n_layers; l++)
            free(out.layers[l]);
        memset(&out, 0, sizeof out);
    }
    if (!rc && raw <= 0)
        rc = df_errf(e, -ENODATA, "%s: no tokens to measure", dir);
    if (!rc)
        *ratio = stored / raw;
    df_codec_ctx_free(ctx);
    df_cache_close(c);
    return rc;
}

static const char *human(char *b, size_t n, double x)
{
    const char *u[] = {"B", "KB", "MB", "GB", "TB", "PB"};
    int i = 0;
    while (x >= 1000 && i < 5) {
        x /= 1000;
        i++;
    }
    snprintf(b, n, i ? "%.2f %s" : "%.0f %s", x, u[i]);
    return b;
}

int cmd_cache_plan(int argc, char **argv)
{
    const char *model = NULL, *corpus = NULL, *from = NULL, *disk = NULL, *codec_name = "split-zstd";
    double hidden = 0, layers = 0, tokens = 0, rank = 0, frac = 0;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            plan_usage(stdout);
            return 0;
        }
        const char *v = i + 1 < argc ? argv[++i] : NULL;
        int bad = !v;
        df_err pe = {0};
        if (bad)
            ;
        else if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--corpus")) corpus = v;
        else if (!strcmp(a, "--from")) from = v;
        else if (!strcmp(a, "--disk")) disk = v;
        else if (!strcmp(a, "--codec")) codec_name = v;
        else if (!strcmp(a, "--hidden")) bad = df_opt_number(a, v, 1, DF_CACHE_MAX_HIDDEN, 1, &hidden, &pe) != 0;
        else if (!strcmp(a, "--layers")) bad = df_opt_number(a, v, 1, DF_CACHE_MAX_LAYERS, 1, &layers, &pe) != 0;
        else if (!strcmp(a, "--tokens")) bad = df_opt_number(a, v, 1, 1e15, 0, &tokens, &pe) != 0;
        else if (!strcmp(a, "--rank")) bad = df_opt_number(a, v, 1, 1e9, 1, &rank, &pe) != 0;
        else if (!strcmp(a, "--rank-frac")) bad = df_opt_number(a, v, 1e-9, 1, 0, &frac, &pe) != 0;
        else {
            fprintf(stderr, "dflash cache plan: unknown option '%s'\n", a);
            plan_usage(stderr);
            return 2;
        }
        if (bad && pe.code) {
            fprintf(stderr, "dflash cache plan: bad or missing value: %s\n", pe.msg);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "dflash cache plan: %s: bad or missing value%s%s\n", a, v ? " " : "",
                    v ? v : "");
            return 2;
        }
    }
    int codec = df_codec_from_name(codec_name);
    if ((!model) == (hidden == 0) || (!corpus) == (tokens == 0) || (rank > 0 && frac > 0) ||
        codec < 0) {
        fprintf(stderr, "dflash cache plan: want one of --model, --hidden; one of --tokens, "
                        "--corpus; at most one of --rank, --rank-frac; a known --codec\n");
        plan_usage(stderr);
        return 2;
    }
    df_err e = {0};
    int rc = 0;
    double docs = 0;
    if (model) {
        df_model_config mc;
        if ((rc = df_model_config_load(model, &mc, &e)))
            goto fail;
        hidden = mc.hidden_size;
        if (layers == 0) {
            int k = mc.num_hidden_layers - 3;
            layers = k < 1 ? 1 : k > 5 ? 5 : k;
        }
    } else if (layers == 0)
        layers = 5;
    if (corpus) {
        df_corpus *cp = NULL;
        if ((rc = df_corpus_open(corpus, NULL, &cp, &e)))
            goto fail;
        tokens = (double)df_corpus_n_tokens(cp);
        docs = (double)df_corpus_n_docs(cp);
        df_corpus_close(cp);
    }
    double values = layers * hidden;
    if (frac > 0)
        rank = (double)(int64_t)(frac * values + 0.5);
    if (rank > values) {
        fprintf(stderr, "dflash cache plan: --rank %.0f exceeds the %.0f feature values per "
                        "token\n", rank, values);
        return 2;
    }
    double ratio = typical_ratio(codec);
    uint64_t seen = 0;
    if (from && (rc = measure(from, codec, &ratio, &seen, &e)))
        goto fail;
    double per_values = rank > 0 ? rank : values;
    double hs = per_values * 2 * ratio, over = TOKEN_BYTES + (docs > 0 ? PAD_PER_DOC * docs / tokens : 0);
    double total = (hs + over) * tokens;
    char b1[32], b2[32], b3[32];
    printf("shape        %.0f layers x %.0f, BF16: %s/token raw\n", layers, hidden,
           human(b1, sizeof b1, values * 2));
    if (rank > 0)
        printf("projection   rank %.0f of %.0f (%.4f of the values; dflash cache project)\n", rank,
               values, rank / values);
    if (from)
        printf("codec        %s: ratio %.4f measured on %" PRIu64 " tokens of %s%s\n",
               df_codec_name(codec), ratio, seen, from,
               rank > 0 ? " (raw features; z's ratio is close to it)" : "");
    else
        printf("codec        %s: ratio %.4f, typical of real BF16 states (--from CACHE measures "
               "it on yours)\n", df_codec_name(codec), ratio);
    printf("per token    %s hidden states (%.4f of raw) + %.1f B ids, mask, padding\n",
           human(b1, sizeof b1, hs), hs / (values * 2), over);
    printf("tokens       %.0f%s\n", tokens, docs > 0 ? " (the corpus)" : "");
    printf("total        %s (raw BF16 would be %s)\n", human(b2, sizeof b2, total),
           human(b3, sizeof b3, values * 2 * tokens));
    if (disk) {
        struct statvfs sv;
        if (statvfs(disk, &sv) != 0) {
            rc = df_errf(&e, -errno, "%s: %s", disk, strerror(errno));
            goto fail;
        }
        double freeb = (double)sv.f_bavail * (double)sv.f_frsize;
        printf("disk         %s free on %s: %s\n", human(b1, sizeof b1, freeb), disk,
               total <= freeb ? "fits" : "does NOT fit");
    }
    if (df_codec_is_lossy(codec) || rank > 0)
        printf("quality      lossy: see the README's \"Smaller caches\" for what each choice "
               "costs the drafter\n");
    return 0;
fail:
    fprintf(stderr, "dflash cache plan: %s\n", e.msg[0] ? e.msg : strerror(-rc));
    return 1;
}
