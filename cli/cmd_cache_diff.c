/* cmd_cache_diff.c - `dflash cache diff A B`: do two finished caches hold the
 * same samples? Same ids, tokens and loss masks, and the same hidden states
 * (bit for bit, or within --tol relative L2 per sample and layer). Used to
 * show that a resumed extraction equals an uninterrupted one, and that the
 * GPU path matches the CPU path. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache.h"
#include "cmds.h"
#include "dtype.h"
#include "opt.h"

static void diff_usage(FILE *f)
{
    fprintf(f, "usage: dflash cache diff A B [--tol X]\n"
               "Compares two finished caches sample by sample: ids, tokens, loss masks and every\n"
               "layer's hidden states. Exit 0 when equal (bit for bit; with --tol X, relative L2\n"
               "distance <= X per sample and layer), 1 when not, 2 on bad usage.\n");
}

/* Relative L2 distance of two decoded layers (as float). */
static double rel_l2(const void *a, const void *b, size_t n, df_dtype dt)
{
    double num = 0, den = 0;
    size_t es = df_dtype_size(dt);
    for (size_t i = 0; i < n; i++) {
        double x = df_elem_to_f32((const uint8_t *)a + i * es, dt);
        double y = df_elem_to_f32((const uint8_t *)b + i * es, dt);
        num += (x - y) * (x - y);
        den += y * y;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

int cmd_cache_diff(int argc, char **argv)
{
    const char *pa = NULL, *pb = NULL;
    double tol = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            diff_usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--tol") && i + 1 < argc) {
            df_err pe = {0};
            if (df_opt_double("--tol", argv[++i], 0, 1e30, &tol, &pe)) {
                fprintf(stderr, "dflash cache diff: %s\n", pe.msg);
                diff_usage(stderr);
                return 2;
            }
        } else if (!pa) {
            pa = argv[i];
        } else if (!pb) {
            pb = argv[i];
        } else {
            diff_usage(stderr);
            return 2;
        }
    }
    if (!pa || !pb) {
        diff_usage(stderr);
        return 2;
    }
    df_err e = {0};
    df_cache *a = df_cache_open(pa, &e), *b = a ? df_cache_open(pb, &e) : NULL;
    if (!a || !b) {
        fprintf(stderr, "dflash cache diff: %s\n", e.msg);
        df_cache_close(a);
        return 1;
    }
    const df_cache_params *p = &df_cache_get_info(a)->params, *q = &df_cache_get_info(b)->params;
    int bad = 0;
    if (p->n_layers != q->n_layers || p->hidden_size != q->hidden_size || p->dtype != q->dtype ||
        memcmp(p->layer_ids, q->layer_ids, sizeof p->layer_ids)) {
        printf("differ: layers, hidden size or dtype\n");
        bad = 1;
    }
    size_t na = df_cache_count(a), nb = df_cache_count(b);
    if (na != nb) {
        printf("differ: %zu vs %zu samples\n", na, nb);
        bad = 1;
    }
    uint64_t n_diff = 0, n_cmp = 0;
    double worst = 0;
    size_t rb = (size_t)p->hidden_size * df_dtype_size(p->dtype);
    for (size_t k = 0; !bad && k < na; k++) {
        const df_cache_entry *ea = df_cache_entry_at(a, k), *eb = df_cache_entry_at(b, k);
        if (ea->id != eb->id || ea->n_tokens != eb->n_tokens) {
            printf("differ: sample %zu: id %" PRIu64 " (%u tokens) vs %" PRIu64 " (%u tokens)\n",
                   k, ea->id, ea->n_tokens, eb->id, eb->n_tokens);
            bad = 1;
            break;
        }
        size_t n = ea->n_tokens;
        df_cache_out oa, ob;
        memset(&oa, 0, sizeof oa);
        memset(&ob, 0, sizeof ob);
        oa.ids = malloc(n * 4 + 4);
        ob.ids = malloc(n * 4 + 4);
        oa.loss_mask = malloc(n + 1);
        ob.loss_mask = malloc(n + 1);
        int ok = oa.ids && ob.ids && oa.loss_mask && ob.loss_mask;
        for (uint32_t l = 0; l < p->n_layers && ok; l++)
            ok = (oa.layers[l] = malloc(n * rb + 1)) && (ob.layers[l] = malloc(n * rb + 1));
        int rc = ok ? df_cache_read(a, k, ~0ull, &oa, NULL, &e) : -ENOMEM;
        if (!rc)
            rc = df_cache_read(b, k, ~0ull, &ob, NULL, &e);
        if (rc) {
            fprintf(stderr, "dflash cache diff: %s\n", ok ? e.msg : "out of memory");
            bad = 2;
        } else if (memcmp(oa.ids, ob.ids, n * 4) || memcmp(oa.loss_mask, ob.loss_mask, n)) {
            printf("differ: sample id %" PRIu64 ": tokens or loss mask\n", ea->id);
            bad = 1;
        } else {
            int sample_diff = 0;
            for (uint32_t l = 0; l < p->n_layers; l++) {
                n_cmp++;
                if (!memcmp(oa.layers[l], ob.layers[l], n * rb))
                    continue;
                double r = rel_l2(oa.layers[l], ob.layers[l], n * p->hidden_size, p->dtype);
                worst = r > worst ? r : worst;
                sample_diff = 1;
                if (!(r <= tol)) {
                    printf("differ: sample id %" PRIu64 " layer %d: rel L2 %.3e\n", ea->id,
                           p->layer_ids[l], r);
                    bad = 1;
                }
            }
            n_diff += sample_diff;
        }
        free(oa.ids);
        free(ob.ids);
        free(oa.loss_mask);
        free(ob.loss_mask);
        for (uint32_t l = 0; l < p->n_layers; l++) {
            free(oa.layers[l]);
            free(ob.layers[l]);
        }
    }
    if (!bad)
        printf("%s: %zu samples, %" PRIu64 " (sample, layer) blocks; %" PRIu64
               " samples not bit-identical (worst rel L2 %.3e%s)\n",
               n_diff ? "equal within tolerance" : "identical", na, n_cmp, n_diff, worst,
               tol > 0 ? ", tol given" : "");
    df_cache_close(a);
    df_cache_close(b);
    return bad ? 1 : 0;
}
