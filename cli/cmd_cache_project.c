/* cmd_cache_project.c - `dflash cache project IN OUT`: a projected cache made
 * from a finished one, without the target. Each token's features x (the cache's
 * K layers, concatenated) become z = P x, P the top-R eigenvectors of the
 * features' uncentred second moment over a sample of tokens (formats/basis.h),
 * or the basis of another projected cache (an eval cache takes its train
 * cache's). OUT holds basis.dfb and a cache whose manifest names it
 * (docs/FORMAT.md, "Projected caches"). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "basis.h"
#include "cache.h"
#include "cache_writer.h"
#include "cmds.h"
#include "cuda/basis_gpu.h"
#include "fsutil.h"
#include "hfconfig.h"
#include "opt.h"
#include "safetensors.h"
#include "pool.h"

static void project_usage(FILE *f)
{
    fprintf(f,
            "usage: dflash cache project IN OUT (--rank R | --energy F | --basis FILE |\n"
            "                                    --fc-basis DRAFTER [--rank R]) [options]\n"
            "Derives a projected cache OUT from the finished BF16 cache IN, without the target:\n"
            "each token's features x (IN's layers, concatenated: D = layers x hidden values)\n"
            "are stored as z = P x (R BF16 values), P the top-R eigenvectors of the features'\n"
            "uncentred second moment over a sample of IN's tokens. A drafter trained on OUT\n"
            "reads z through fc (hidden x R); its export merges fc with P, so serving engines\n"
            "feed it raw features as usual. OUT gets basis.dfb (P, its eigenvalues and the\n"
            "energy it keeps, overall and per layer). Rerunning an interrupted command resumes it.\n"
            "  --rank R            keep R directions (1 <= R <= D)\n"
            "  --energy F          keep the fewest directions holding fraction F (0 < F <= 1)\n"
            "                      of the features' energy\n"
            "  --basis FILE        use this basis (another projected cache's basis.dfb: an eval\n"
            "                      cache must be projected with its train cache's basis)\n"
            "  --fc-basis DRAFTER  P = the row space of fc of a drafter export (config.json +\n"
            "                      model.safetensors of a run on IN's layers): R = its hidden\n"
            "                      size, the subspace that fc reads. With --rank R: its top R\n"
            "                      singular directions (R below the hidden size), or all of them\n"
            "                      then the R - hidden directions holding the most of the\n"
            "                      features' energy outside them (R above)\n"
            "  --sample-tokens N   tokens the second moment is taken over, from documents spread\n"
            "                      over IN (default 2000000; all of IN when it holds fewer)\n"
            "  --codec C           OUT's codec (default split-zstd); --level N its level\n"
            "  --device D          where the second moment and the fit (and --fc-basis's\n"
            "                      extension) run: cpu, cuda (GPU 0) or auto (default: cuda when\n"
            "                      this build has CUDA and a GPU is present, else cpu). The\n"
            "                      projection of IN itself runs on the CPU either way\n"
            "  --threads N         projection and compression threads (default: all CPUs)\n"
            "Exit status: 0 done, 1 bad data or I/O, 2 bad usage.\n");
}

typedef struct reader {
    df_cache *c;
    const df_cache_params *p;
    df_cache_out out;
    uint32_t cap;
} reader;

static void reader_free(reader *r)
{
    free(r->out.ids);
    free(r->out.loss_mask);
    for (uint32_t l = 0; l < r->p->n_layers; l++)
        free(r->out.layers[l]);
    memset(&r->out, 0, sizeof r->out);
    r->cap = 0;
}

/* Reads sample k with every layer into r->out (buffers grown as needed). */
static int reader_get(reader *r, size_t k, df_pool *pool, df_err *e)
{
    uint32_t n = df_cache_entry_at(r->c, k)->n_tokens;
    if (n > r->cap) {
        size_t row = (size_t)r->p->hidden_size * 2;
        reader_free(r);
        int ok = (r->out.ids = malloc((size_t)n * 4)) && (r->out.loss_mask = malloc(n));
        for (uint32_t l = 0; ok && l < r->p->n_layers; l++)
            ok = (r->out.layers[l] = malloc((size_t)n * row)) != NULL;
        if (!ok)
            return df_errf(e, -ENOMEM, "out of memory for a sample of %u tokens", n);
        r->cap = n;
    }
    return df_cache_read(r->c, k, ~0ull, &r->out, pool, e);
}

/* The second moment over documents spread evenly over the cache, until
 * `want` tokens are in; on the GPU g when not NULL. */
static int fit_moment(reader *r, uint64_t want, df_moment *m, df_basis_gpu *g, df_pool *pool,
                      df_err *e)
{
    size_t n = df_cache_count(r->c);
    uint64_t total = df_cache_get_info(r->c)->tokens;
    size_t stride = want >= total ? 1 : (size_t)(total / (want ? want : 1));
    if (stride < 1)
        stride = 1;
    double t0 = df_now();
    for (size_t k = 0; k < n && (uint64_t)m->n_rows < want; k += stride) {
        int rc = reader_get(r, k, pool, e);
        uint32_t nt = df_cache_entry_at(r->c, k)->n_tokens;
        const uint16_t *const *lay = (const uint16_t *const *)r->out.layers;
        int K = (int)r->p->n_layers, H = (int)r->p->hidden_size;
        if (!rc && nt)
            rc = g ? df_basis_gpu_moment_add_bf16(g, m, lay, K, H, nt, pool, e)
                   : df_moment_add_bf16(m, lay, K, H, nt, pool, e);
        if (rc)
            return rc;
    }
    int rc = g ? df_basis_gpu_moment_sync(g, m, e) : 0;
    if (rc)
        return rc;
    fprintf(stderr, "second moment: %" PRId64 " tokens (%d x %d features) in %.1f s on %s\n",
            m->n_rows, m->K, m->H, df_now() - t0, g ? df_basis_gpu_name(g) : "the CPU");
    return m->n_rows > 0 ? 0 : df_errf(e, -ENODATA, "%s: no tokens to fit a basis on",
                                       df_cache_dir(r->c));
}

/* The row space of fc.weight (hidden x K*hidden) of the drafter export in
 * dir, whose target layers must be the cache's, in order: all of it (R 0) or
 * its top R singular directions. */
static int fc_row_basis(const char *dir, const df_cache_params *ip, int R, df_pool *pool,
                        df_basis *b, df_err *e)
{
    df_drafter_config dc;
    int rc = df_drafter_config_load(dir, &dc, e);
    if (rc)
        return rc;
    int K = (int)ip->n_layers, H = (int)ip->hidden_size;
    int same = dc.num_target_features == K && dc.hidden_size == H;
    for (int k = 0; same && k < K; k++)
        same = dc.target_layer_ids[k] == ip->layer_ids[k];
    if (!same)
        return df_errf(e, -DF_EMISMATCH, "%s: a drafter of %d target layers (first %d) x %d; the "
                       "cache holds %d (first %d) x %d", dir, dc.num_target_features,
                       dc.target_layer_ids[0], dc.hidden_size, K, ip->layer_ids[0], H);
    df_st *st = NULL;
    if ((rc = df_st_open(dir, &st, e)))
        return rc;
    const df_st_tensor *t = df_st_find(st, "fc.weight");
    float *a = NULL;
    int64_t D = (int64_t)K * H;
    if (!t || t->ndim != 2 || t->shape[0] != H || t->shape[1] != D ||
        (t->dtype != DF_DTYPE_BF16 && t->dtype != DF_DTYPE_F32)) {
        rc = df_errf(e, -DF_EMISMATCH, "%s: fc.weight missing or not %d x %" PRId64
                     " BF16/F32", dir, H, D);
        goto out;
    }
    if (!(a = malloc((size_t)(H * D) * sizeof *a))) {
        rc = df_errf(e, -ENOMEM, "out of memory for fc.weight");
        goto out;
    }
    size_t es = df_dtype_size(t->dtype);
    for (int64_t i = 0; i < H * D; i++)
        a[i] = df_elem_to_f32((const uint8_t *)t->data + (size_t)i * es, t->dtype);
    rc = df_basis_from_rows(a, H, K, H, ip->layer_ids, R, R ? 0 : 1.0, pool, b, e);
out:
    free(a);
    df_st_close(st);
    return rc;
}

/* The GPU the fit runs on (*g) for --device cuda or auto, or none (*g NULL:
 * the CPU) for cpu, and for auto when this build has no CUDA or there is no
 * GPU. cuda without one is an error naming why. */
static int open_device(const char *device, df_basis_gpu **g, df_err *e)
{
    *g = NULL;
    if (!strcmp(device, "cpu") || (!strcmp(device, "auto") && df_basis_gpu_device_count() <= 0))
        return 0;
    int rc = df_basis_gpu_open(0, 0, g, e);
    if (rc && !strcmp(device, "auto")) {
        fprintf(stderr, "warning: --device auto: %s; the fit runs on the CPU\n", e->msg);
        return 0;
    }
    return rc ? df_err_wrap(e, "--device %s", device) : 0;
}

int cmd_cache_project(int argc, char **argv)
{
    const char *in = NULL, *outd = NULL, *basis_path = NULL, *fc_dir = NULL,
               *codec_name = "split-zstd", *device = "auto";
    double rank = 0, energy = 0, sample = 2e6, level = 0, threads = 0;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            project_usage(stdout);
            return 0;
        }
        if (a[0] != '-') {
            if (!in)
                in = a;
            else if (!outd)
                outd = a;
            else {
                fprintf(stderr, "dflash cache project: unexpected argument '%s'\n", a);
                return 2;
            }
            continue;
        }
        const char *v = i + 1 < argc ? argv[++i] : NULL;
        int bad = !v;
        df_err pe = {0};
        if (bad)
            ;
        else if (!strcmp(a, "--rank"))
            bad = df_opt_number(a, v, 1, DF_CACHE_MAX_HIDDEN, 1, &rank, &pe) != 0;
        else if (!strcmp(a, "--energy"))
            bad = df_opt_number(a, v, 1e-9, 1, 0, &energy, &pe) != 0;
        else if (!strcmp(a, "--basis"))
            basis_path = v;
        else if (!strcmp(a, "--fc-basis"))
            fc_dir = v;
        else if (!strcmp(a, "--sample-tokens"))
            bad = df_opt_number(a, v, 1, 1e15, 1, &sample, &pe) != 0;
        else if (!strcmp(a, "--codec"))
            codec_name = v;
        else if (!strcmp(a, "--device"))
            bad = strcmp(v, "cpu") && strcmp(v, "cuda") && strcmp(v, "auto");
        else if (!strcmp(a, "--level"))
            bad = df_opt_number(a, v, -1000, 1000, 1, &level, &pe) != 0;
        else if (!strcmp(a, "--threads"))
            bad = df_opt_number(a, v, 0, 4096, 1, &threads, &pe) != 0;
        else {
            fprintf(stderr, "dflash cache project: unknown option '%s'\n", a);
            project_usage(stderr);
            return 2;
        }
        if (bad && pe.code) {
            fprintf(stderr, "dflash cache project: bad or missing value: %s\n", pe.msg);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "dflash cache project: %s: bad or missing value%s%s%s\n", a,
                    v ? " " : "", v ? v : "",
                    !strcmp(a, "--device") ? " (want cpu, cuda or auto)" : "");
            return 2;
        }
        if (!strcmp(a, "--device"))
            device = v;
    }
    int n_choice = (rank > 0 && !fc_dir) + (energy > 0) + (basis_path != NULL) + (fc_dir != NULL);
    if (!in || !outd || n_choice != 1) {
        fprintf(stderr, "dflash cache project: want IN, OUT and exactly one of --rank, --energy, "
                        "--basis, --fc-basis (which takes a --rank too)\n");
        project_usage(stderr);
        return 2;
    }
    int codec = df_codec_from_name(codec_name);
    if (codec < 0) {
        fprintf(stderr, "dflash cache project: unknown codec '%s'\n", codec_name);
        return 2;
    }

    df_err e = {0};
    int rc = 0;
    df_pool *pool = df_pool_open((int)threads);
    reader r = {0};
    df_basis b = {0};
    df_moment m = {0};
    df_basis_gpu *g = NULL;
    df_cache_writer *w = NULL;
    uint16_t *z = NULL;
    size_t zcap = 0;
    char bpath[4200];
    if (!pool) {
        fprintf(stderr, "dflash cache project: cannot start threads\n");
        return 1;
    }
    if (!(r.c = df_cache_open(in, &e))) {
        rc = e.code ? e.code : -EIO;
        goto out;
    }
    r.p = &df_cache_get_info(r.c)->params;
    const df_cache_params *ip = r.p;
    if (ip->proj_rank) {
        rc = df_errf(&e, -DF_EMISMATCH, "%s is projected already (rank %u); project its source cache",
                     in, ip->proj_rank);
        goto out;
    }
    if (ip->dtype != DF_DTYPE_BF16) {
        rc = df_errf(&e, -ENOTSUP, "%s holds %s features; projection reads BF16 caches", in,
                     df_dtype_name(ip->dtype));
        goto out;
    }
    int K = (int)ip->n_layers, H = (int)ip->hidden_size;
    int64_t D = (int64_t)K * H;
    double kept_data = -1; /* --fc-basis: what it keeps of the features' energy */
    if (rank > (double)D) {
        rc = df_errf(&e, -EINVAL, "--rank %.0f out of range: %s holds %d layers x %d = %" PRId64
                     " values per token", rank, in, K, H, D);
        goto out;
    }
    if (snprintf(bpath, sizeof bpath, "%s/%s", outd, DF_CACHE_BASIS_FILE) >= (int)sizeof bpath) {
        rc = df_errf(&e, -ENAMETOOLONG, "%s: path too long", outd);
        goto out;
    }
    /* The basis: given, left by an interrupted run of this command, or fitted (then on the
     * --device, opened before OUT is made: a refusal leaves nothing behind). */
    /* basis.dfb goes into OUT before the writer opens: a folder that may not
     * hold a cache (not empty, no meta.json) is refused before anything is put there */
    if ((rc = df_cache_writer_check_dir(outd, 1, &e)))
        goto out;
    struct stat st;
    const char *from = basis_path ? basis_path : stat(bpath, &st) == 0 ? bpath : NULL;
    if ((!from && (rc = open_device(device, &g, &e))) || (rc = df_mkdirs(outd, &e)))
        goto out;
    if (from) {
        if ((rc = df_basis_read(from, &b, &e)))
            goto out;
        if (b.K != K || b.H != H || memcmp(b.layer_ids, ip->layer_ids, (size_t)K * 4)) {
            rc = df_errf(&e, -DF_EMISMATCH, "%s: a basis of %d layers x %d (first layer %d); %s "
                         "holds %d x %d (first %d)", from, b.K, b.H, b.layer_ids[0], in, K, H,
                         ip->layer_ids[0]);
            goto out;
        }
        /* an earlier run's basis stands (its --energy or --fc-basis choice of R too), but not
         * against an explicit other rank */
        if (from == bpath && rank > 0 && b.R != (int)rank) {
            rc = df_errf(&e, -EEXIST, "%s holds a rank-%d basis from an earlier run; remove %s to "
                         "fit another", outd, b.R, outd);
            goto out;
        }
        if (from != bpath && (rc = df_basis_write(&b, bpath, &e)))
            goto out;
    } else if (fc_dir) {
        /* the kept fractions stored are what it keeps of the features' energy (measured on
         * a sample), not of fc's rows, which it keeps whole */
        double kept, lk[DF_BASIS_MAX_LAYERS];
        if ((rc = fc_row_basis(fc_dir, ip, rank < H ? (int)rank : 0, pool, &b, &e)) ||
            (rc = df_moment_init(&m, K, H, ip->layer_ids, &e)) ||
            (rc = fit_moment(&r, (uint64_t)(sample < 5e5 ? sample : 5e5), &m, g, pool, &e)))
            goto out;
        double t0 = df_now();
        int extended = rank > b.R;
        if (extended) { /* fc's rows, then the most energy outside them */
            df_basis x;
            if ((rc = g ? df_basis_gpu_extend(g, &b, &m, (int)rank, &x, &e)
                        : df_basis_extend(&b, &m, (int)rank, pool, &x, &e)))
                goto out;
            df_basis_free(&b);
            b = x;
        }
        if ((rc = g ? df_basis_gpu_eval(g, &b, &m, &kept, lk, &e)
                    : df_basis_eval(&b, &m, &kept, lk, pool, &e)))
            goto out;
        fprintf(stderr, "fc basis: %sevaluation in %.1f s on %s\n",
                extended ? "extension and " : "", df_now() - t0,
                g ? df_basis_gpu_name(g) : "the CPU");
        b.kept = kept;
        memcpy(b.layer_kept, lk, sizeof lk);
        if ((rc = df_basis_write(&b, bpath, &e)))
            goto out;
        kept_data = kept;
        fprintf(stderr, "fc basis: keeps %.3f%% of the features' energy (per layer:", 100 * kept);
        for (int k = 0; k < K; k++)
            fprintf(stderr, " %d: %.2f%%", b.layer_ids[k], 100 * lk[k]);
        fprintf(stderr, ")\n");
    } else {
        double t0 = 0;
        if ((rc = df_moment_init(&m, K, H, ip->layer_ids, &e)) ||
            (rc = fit_moment(&r, (uint64_t)sample, &m, g, pool, &e)) ||
            (t0 = df_now(), rc = g ? df_basis_gpu_fit(g, &m, (int)rank, energy, &b, &e)
                                   : df_basis_fit(&m, (int)rank, energy, &b, &e)) ||
            (rc = df_basis_write(&b, bpath, &e)))
            goto out;
        fprintf(stderr, "eigenbasis (fit and write): %.1f s on %s\n", df_now() - t0,
                g ? df_basis_gpu_name(g) : "the CPU (LAPACK)");
    }
    df_basis_gpu_close(g); /* its device memory, before the projection */
    g = NULL;
    fprintf(stderr, "basis: rank %d of %" PRId64 " (%.2f%% of the values), keeps %.3f%% of the "
            "features' energy (per layer:", b.R, D, 100.0 * b.R / (double)D, 100 * b.kept);
    for (int k = 0; k < K; k++)
        fprintf(stderr, " %d: %.2f%%", b.layer_ids[k], 100 * b.layer_kept[k]);
    fprintf(stderr, ")\n");

    df_cache_params op = *ip;
    memset(op.uuid, 0, sizeof op.uuid);
    memset(op.layer_ids, 0, sizeof op.layer_ids);
    op.proj_rank = (uint32_t)b.R;
    op.src_hidden = (uint32_t)H;
    op.src_n_layers = (uint32_t)K;
    memcpy(op.src_layer_ids, ip->layer_ids, sizeof op.src_layer_ids);
    op.hidden_size = (uint32_t)b.R;
    op.n_layers = 1;
    op.layer_ids[0] = DF_CACHE_PROJECTED_LAYER;
    op.codec = codec;
    op.codec_level = (int)level;
    op.rows_per_block = 0;
    op.world_size = 1;
    char hex[DF_SHA256_HEX];
    if ((rc = df_basis_sha256(bpath, hex, &e)))
        goto out;
    memcpy(op.basis_sha256, hex, sizeof op.basis_sha256);
    df_cache_writer_opts wo = {.threads = (int)threads};
    if (!(w = df_cache_writer_open(outd, &op, &wo, &e))) {
        rc = e.code ? e.code : -EIO;
        goto out;
    }
    size_t n = df_cache_count(r.c);
    uint64_t done_tok = 0, all_tok = df_cache_get_info(r.c)->tokens;
    double t0 = df_now(), last = t0;
    for (size_t k = 0; k < n; k++) {
        const df_cache_entry *ent = df_cache_entry_at(r.c, k);
        done_tok += ent->n_tokens;
        if (df_cache_writer_has(w, ent->id))
            continue;
        if ((rc = reader_get(&r, k, pool, &e)))
            goto out;
        if ((size_t)ent->n_tokens * (size_t)b.R > zcap) {
            free(z);
            zcap = (size_t)ent->n_tokens * (size_t)b.R;
            if (!(z = malloc(zcap * 2))) {
                rc = df_errf(&e, -ENOMEM, "out of memory for %u projected tokens", ent->n_tokens);
                goto out;
            }
        }
        if (ent->n_tokens &&
            (rc = df_basis_project_bf16(&b, (const uint16_t *const *)r.out.layers, K, H,
                                        ent->n_tokens, z, pool, &e)))
            goto out;
        const void *zl[1] = {z};
        df_cache_sample s = {.id = ent->id, .n_tokens = ent->n_tokens, .ids = r.out.ids,
                             .loss_mask = r.out.loss_mask, .layers = zl};
        if ((rc = df_cache_writer_put(w, &s, &e)))
            goto out;
        double now = df_now();
        if (now - last >= 2.0 || k + 1 == n) {
            double rate = (double)done_tok / (now - t0 > 1e-9 ? now - t0 : 1e-9);
            fprintf(stderr, "\rprojected %zu / %zu samples, %.0f tok/s, ETA %.0f s   ", k + 1, n,
                    rate, rate > 0 ? (double)(all_tok - done_tok) / rate : 0.0);
            last = now;
        }
    }
    fprintf(stderr, "\n");
    rc = df_cache_writer_close(w, &e);
    w = NULL;
    if (!rc)
        printf("%s: %zu samples, %" PRIu64 " tokens, rank %d of %" PRId64 ", %.3f%% of the "
               "features' energy kept%s\n", outd, n, all_tok, b.R, D,
               100 * (kept_data >= 0 ? kept_data : b.kept), kept_data >= 0 || !from ? ""
               : " (on the sample the basis was fitted on)");
out:
    if (w)
        df_cache_writer_abandon(w);
    if (rc)
        fprintf(stderr, "dflash cache project: %s\n", e.msg[0] ? e.msg : strerror(-rc));
    free(z);
    if (r.p)
        reader_free(&r);
    df_cache_close(r.c);
    df_basis_free(&b);
    df_moment_free(&m);
    df_basis_gpu_close(g);
    df_pool_close(pool);
    return rc ? (rc == -EINVAL ? 2 : 1) : 0;
}
