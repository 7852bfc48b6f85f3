/* bench_basis - the projection basis' heavy parts, GPU (kernels/cuda/basis_gpu.h)
 * against the CPU (formats/basis.h), at the shapes of the drafters' features:
 * D = 768 (3 x 256), 5120 (5 x 1024) and 25600 (5 x 5120: Qwen3.6-27B).
 * Run by scripts/bench-basis.sh; never by tests.
 *
 * Per D, each part printed as it finishes:
 *  - the second moment's rate in tokens/s: GPU BF16 path and F64 path, each
 *    as the difference of two runs (N and 2N tokens, each with its sync), so
 *    allocation and the final copy of M to the host cancel out; the CPU
 *    (df_moment_add_bf16 on --threads) timed on one add of a small sample
 *    (one call: its best case) after a warm-up add, so its figure is
 *    extrapolated from that sample (and labelled so). Rows: synthetic BF16, uniform with a decaying
 *    per-column scale, a pool of distinct rows replayed in calls of 512;
 *  - the eigensolve: df_basis_gpu_fit for R = 10%, 20%, 30% of D (2560,
 *    5120, 7680 at D = 25600) and the energy rule (0.99: the whole spectrum)
 *    on a full-rank synthetic moment (the rows' moment plus a decaying
 *    diagonal: distinct eigenvalues), timed with the upload of M and the
 *    copy of P back; LAPACK's dsyevr (df_basis_fit, R = 10%) measured where
 *    it is cheap (D <= --cpu-eig-max, default 1024) and extrapolated as D^3
 *    beyond (labelled);
 *  - the CPU projection z = P x of BF16 tokens (df_basis_project_bf16,
 *    R = 10% of D, --threads), the step `dflash cache project` keeps on the
 *    CPU: measured on a few hundred tokens.
 * Then both tables again, together. Without a GPU (or CUDA) the GPU columns
 * say so and the CPU parts still run. --budget S (default 420) skips the
 * eigensolves still to come once S seconds have passed, saying which.
 *
 * Usage: bench_basis [--dims 768,5120,25600] [--threads N] [--budget S]
 *                    [--gpu-tokens N (default 65536)] [--cpu-eig-max D] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "basis.h"
#include "cuda/basis_gpu.h"
#include "fsutil.h"
#include "pool.h"

enum { MAXD = 8, CALL_ROWS = 512 };

typedef struct rowset {
    int K, H;
    int64_t n;
    uint16_t *buf;                       /* layer k at buf + k*n*H */
    const uint16_t *lay[DF_BASIS_MAX_LAYERS];
} rowset;

static uint64_t mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static int gen_task(void *arg, size_t t)
{
    rowset *s = arg;
    int64_t D = (int64_t)s->K * s->H;
    for (int64_t d = 0; d < D; d++) {
        uint64_t r = mix(((uint64_t)t << 32) ^ (uint64_t)d ^ 0x51ed2701ull);
        float u = (float)((int64_t)(r >> 40) - (1 << 23)) / (float)(1 << 23); /* [-1, 1) */
        float scale = 1.0f / sqrtf(1.0f + (float)d / 64.0f);
        s->buf[(d / s->H) * s->n * s->H + (int64_t)t * s->H + d % s->H] = to_bf16(u * scale);
    }
    return 0;
}

static int rows_make(rowset *s, int K, int H, int64_t n, df_pool *pool)
{
    s->K = K, s->H = H, s->n = n;
    if (!(s->buf = malloc(sizeof(uint16_t) * (size_t)(n * K * H))))
        return -1;
    for (int k = 0; k < K; k++)
        s->lay[k] = s->buf + (int64_t)k * n * H;
    df_pool_for(pool, (size_t)n, gen_task, s);
    return 0;
}

/* `total` rows of s, replayed, in calls of `call` rows, into m (on g, or the CPU when g is NULL). */
static int add_rows(df_basis_gpu *g, df_moment *m, const rowset *s, int64_t total, int64_t call,
                    df_pool *pool, df_err *e)
{
    for (int64_t done = 0; done < total;) {
        int64_t t0 = done % s->n, nt = call;
        if (nt > s->n - t0)
            nt = s->n - t0;
        if (nt > total - done)
            nt = total - done;
        const uint16_t *l[DF_BASIS_MAX_LAYERS];
        for (int k = 0; k < s->K; k++)
            l[k] = s->lay[k] + t0 * s->H;
        int rc = g ? df_basis_gpu_moment_add_bf16(g, m, l, s->K, s->H, nt, pool, e)
                   : df_moment_add_bf16(m, l, s->K, s->H, nt, pool, e);
        if (rc)
            return rc;
        done += nt;
    }
    return g ? df_basis_gpu_moment_sync(g, m, e) : 0;
}

/* Seconds for `total` tokens into a fresh moment, on g; the moment is kept in *keep if not NULL. */
static double gpu_moment_time(df_basis_gpu *g, const rowset *s, int64_t total, df_pool *pool,
                              df_moment *keep, df_err *e)
{
    df_moment m;
    if (df_moment_init(&m, s->K, s->H, NULL, e))
        return -1;
    double t0 = df_now();
    int rc = add_rows(g, &m, s, total, CALL_ROWS, pool, e);
    double t = df_now() - t0;
    if (!rc && keep)
        *keep = m;
    else
        df_moment_free(&m);
    return rc ? -1 : t;
}

typedef struct result {
    int D, K, H;
    double gpu_bf16, gpu_f64, cpu;           /* tokens/s; 0: not run */
    int cpu_rows;
    double fit[3], energy_s, cpu_eig;        /* seconds; 0: not run, < 0: skipped */
    int fit_R[3], energy_R, cpu_eig_extrap;  /* cpu_eig measured (0) or extrapolated (1) */
    double proj;                             /* CPU projection tokens/s */
} result;

static double cpu_eig_ref_D = 0, cpu_eig_ref_s = 0; /* the measured dsyevr, for extrapolation */

static void print_tables(const result *res, int nres, const char *gpu, int threads)
{
    printf("\n== second moment, tokens/s (GPU: %s; CPU: %d threads) ==\n", gpu, threads);
    printf("%7s %10s %14s %14s %24s %22s\n", "D", "K x H", "GPU bf16", "GPU f64",
           "CPU (extrap. from)", "CPU projection R=10%");
    for (int i = 0; i < nres; i++) {
        const result *r = &res[i];
        char kh[32], g1[32], g2[32], c[48], p[32];
        snprintf(kh, sizeof kh, "%d x %d", r->K, r->H);
        snprintf(g1, sizeof g1, r->gpu_bf16 > 0 ? "%.0f" : "-", r->gpu_bf16);
        snprintf(g2, sizeof g2, r->gpu_f64 > 0 ? "%.0f" : "-", r->gpu_f64);
        snprintf(c, sizeof c, "%.0f (%d tok)", r->cpu, r->cpu_rows);
        snprintf(p, sizeof p, "%.0f tok/s", r->proj);
        printf("%7d %10s %14s %14s %24s %22s\n", r->D, kh, g1, g2, c, p);
    }
    printf("\n== eigensolve, seconds (GPU fit incl. upload of M and P back; CPU dsyevr R=10%%) ==\n");
    printf("%7s %14s %14s %14s %20s %22s\n", "D", "GPU R=10%", "GPU R=20%", "GPU R=30%",
           "GPU energy 0.99", "CPU dsyevr");
    for (int i = 0; i < nres; i++) {
        const result *r = &res[i];
        char f[3][40], en[40], c[48];
        for (int j = 0; j < 3; j++)
            snprintf(f[j], sizeof f[j], r->fit[j] > 0 ? "%.2f (R %d)" : r->fit[j] < 0 ? "skipped"
                                                                                        : "-",
                     r->fit[j], r->fit_R[j]);
        snprintf(en, sizeof en, r->energy_s > 0 ? "%.2f (R %d)" : r->energy_s < 0 ? "skipped" : "-",
                 r->energy_s, r->energy_R);
        snprintf(c, sizeof c, r->cpu_eig > 0 ? "%.1f%s" : "-", r->cpu_eig,
                 r->cpu_eig_extrap ? " (extrap. D^3)" : "");
        printf("%7d %14s %14s %14s %20s %22s\n", r->D, f[0], f[1], f[2], en, c);
    }
}

int main(int argc, char **argv)
{
    int dims[MAXD] = {768, 5120, 25600}, nd = 3, threads = 0, cpu_eig_max = 1024;
    double budget = 420;
    int64_t gpu_tokens = 65536;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "bench_basis: %s: missing value (see the header of tools/bench_basis.c)\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--dims")) {
            nd = 0;
            for (char *p = (char *)v; *p && nd < MAXD; p++) {
                dims[nd++] = (int)strtol(p, &p, 10);
                if (*p != ',')
                    break;
            }
        } else if (!strcmp(a, "--threads")) {
            threads = atoi(v);
        } else if (!strcmp(a, "--budget")) {
            budget = atof(v);
        } else if (!strcmp(a, "--gpu-tokens")) {
            gpu_tokens = atoll(v);
        } else if (!strcmp(a, "--cpu-eig-max")) {
            cpu_eig_max = atoi(v);
        } else {
            fprintf(stderr, "bench_basis: unknown option %s\n", a);
            return 2;
        }
    }
    double t_start = df_now();
    df_pool *pool = df_pool_open(threads);
    threads = df_pool_size(pool);
    df_err e = {0};
    df_basis_gpu *g = NULL, *g64 = NULL;
    char gpu[400] = "none";
    if (df_basis_gpu_device_count() > 0 && !df_basis_gpu_open(0, 0, &g, &e) &&
        !df_basis_gpu_open(0, DF_BASIS_GPU_MOMENT_F64, &g64, &e))
        snprintf(gpu, sizeof gpu, "%s", df_basis_gpu_name(g));
    else
        snprintf(gpu, sizeof gpu, "none (%s)", e.msg[0] ? e.msg : "no CUDA device");
    printf("bench_basis: GPU %s; CPU %d threads\n", gpu, threads);
    fflush(stdout);
    result res[MAXD];
    memset(res, 0, sizeof res);
    int status = 0;
    for (int di = 0; di < nd; di++) {
        int D = dims[di], K = D % 5 == 0 ? 5 : D % 3 == 0 ? 3 : 1, H = D / K;
        result *r = &res[di];
        r->D = D, r->K = K, r->H = H;
        printf("-- D = %d (%d x %d), %.0f s so far\n", D, K, H, df_now() - t_start);
        rowset s;
        int64_t nrows = D >= 16384 ? 8192 : 16384;
        double t0 = df_now();
        if (rows_make(&s, K, H, nrows, pool)) {
            fprintf(stderr, "out of memory for %lld rows\n", (long long)nrows);
            return 1;
        }
        printf("   rows: %lld synthetic BF16 rows in %.1f s\n", (long long)nrows, df_now() - t0);
        df_moment mh = {0}; /* the moment the eigensolves use */
        if (g) {
            int64_t n1 = gpu_tokens * (D <= 768 ? 4 : 1);
            for (int f = 0; f < 2; f++) {
                df_basis_gpu *gg = f ? g64 : g;
                double ta = gpu_moment_time(gg, &s, n1, pool, NULL, &e);
                double tb = gpu_moment_time(gg, &s, 2 * n1, pool, f ? NULL : &mh, &e);
                if (ta < 0 || tb < 0) {
                    printf("   GPU moment (%s): failed: %s\n", f ? "f64" : "bf16", e.msg);
                    status = 1;
                    break;
                }
                double rate = tb > ta ? (double)n1 / (tb - ta) : 0;
                *(f ? &r->gpu_f64 : &r->gpu_bf16) = rate;
                printf("   GPU moment (%s path): %.0f tokens/s (%lld tokens in %.2f s, %lld in "
                       "%.2f s, each with its sync)\n", f ? "f64" : "bf16", rate, (long long)n1, ta,
                       (long long)(2 * n1), tb);
                fflush(stdout);
            }
        }
        /* CPU: a warm-up add (allocates M), then one timed add */
        {
            int cr = D >= 16384 ? 1024 : D >= 4096 ? 2048 : 8192;
            df_moment mc;
            df_moment_init(&mc, K, H, NULL, &e);
            double tw0 = df_now();
            int rc = add_rows(NULL, &mc, &s, 256, 256, pool, &e);
            double tw = df_now() - tw0, tc0 = df_now();
            if (!rc) /* one call: the CPU's best case (a pass over M per call) */
                rc = add_rows(NULL, &mc, &s, cr, cr, pool, &e);
            double tc = df_now() - tc0;
            if (rc) {
                printf("   CPU moment: failed: %s\n", e.msg);
                status = 1;
            } else {
                r->cpu = cr / tc, r->cpu_rows = cr;
                printf("   CPU moment: %.0f tokens/s (extrapolated from one add of %d tokens: "
                       "%.2f s; the warm-up add of 256 with M's allocation: %.2f s)\n", r->cpu, cr,
                       tc, tw);
            }
            if (!mh.m && !rc) /* no GPU: the eigensolve (CPU only) uses this one */
                mh = mc;
            else
                df_moment_free(&mc);
            fflush(stdout);
        }
        /* a full-rank moment with distinct eigenvalues: + a decaying diagonal */
        if (mh.m) {
            for (int64_t i = 0; i < D; i++) {
                double d = 0.05 * (double)mh.n_rows / (1.0 + (double)i / 32.0);
                mh.m[i * D + i] += d;
                mh.trace += d;
            }
        }
        const double frac[3] = {0.1, 0.2, 0.3};
        for (int j = 0; j < 3 && g && mh.m; j++) {
            int R = (int)(frac[j] * D + 0.5);
            r->fit_R[j] = R;
            if (df_now() - t_start > budget) {
                r->fit[j] = -1;
                printf("   GPU fit R = %d: skipped (the %.0f s budget is spent)\n", R, budget);
                continue;
            }
            df_basis b;
            double tf = df_now();
            if (df_basis_gpu_fit(g, &mh, R, 0, &b, &e)) {
                printf("   GPU fit R = %d: failed: %s\n", R, e.msg);
                status = 1;
                continue;
            }
            r->fit[j] = df_now() - tf;
            printf("   GPU fit R = %d: %.2f s (keeps %.4f)\n", R, r->fit[j], b.kept);
            fflush(stdout);
            df_basis_free(&b);
        }
        if (g && mh.m) {
            df_basis b;
            if (df_now() - t_start > budget) {
                r->energy_s = -1;
                printf("   GPU fit energy 0.99: skipped (the %.0f s budget is spent)\n", budget);
            } else {
                double tf = df_now();
                if (df_basis_gpu_fit(g, &mh, 0, 0.99, &b, &e)) {
                    printf("   GPU fit energy 0.99: failed: %s\n", e.msg);
                    status = 1;
                } else {
                    r->energy_s = df_now() - tf, r->energy_R = b.R;
                    printf("   GPU fit energy 0.99 (the whole spectrum, vectors): %.2f s, R = %d\n",
                           r->energy_s, b.R);
                    df_basis_free(&b);
                }
            }
            fflush(stdout);
        }
        if (mh.m && D <= cpu_eig_max) {
            df_basis b;
            int R = (int)(0.1 * D + 0.5);
            double tf = df_now();
            if (df_basis_fit(&mh, R, 0, &b, &e)) {
                printf("   CPU dsyevr R = %d: failed: %s\n", R, e.msg);
                status = 1;
            } else {
                r->cpu_eig = df_now() - tf;
                cpu_eig_ref_D = D, cpu_eig_ref_s = r->cpu_eig;
                printf("   CPU dsyevr R = %d: %.2f s (measured)\n", R, r->cpu_eig);
                df_basis_free(&b);
            }
        } else if (cpu_eig_ref_D > 0) {
            r->cpu_eig = cpu_eig_ref_s * pow(D / cpu_eig_ref_D, 3), r->cpu_eig_extrap = 1;
            printf("   CPU dsyevr R = %d: ~%.0f s (extrapolated as D^3 from D = %.0f)\n",
                   (int)(0.1 * D + 0.5), r->cpu_eig, cpu_eig_ref_D);
        }
        df_moment_free(&mh);
        /* the CPU projection of tokens, R = 10% (a random P: the cost does not depend on it) */
        {
            int R = (int)(0.1 * D + 0.5), nt = D >= 16384 ? 256 : 2048;
            df_basis b;
            uint16_t *z = malloc(sizeof(uint16_t) * (size_t)nt * (size_t)R);
            if (z && !df_basis_init(&b, K, H, R, NULL, &e)) {
                for (int64_t i = 0; i < (int64_t)R * D; i++)
                    b.P[i] = (float)((int64_t)(mix((uint64_t)i) >> 40) - (1 << 23)) / (float)(1 << 23);
                df_basis_project_bf16(&b, s.lay, K, H, 64, z, pool, &e); /* warm-up */
                double tp = df_now();
                int rc = df_basis_project_bf16(&b, s.lay, K, H, nt, z, pool, &e);
                tp = df_now() - tp;
                if (!rc) {
                    r->proj = nt / tp;
                    printf("   CPU projection R = %d: %.0f tokens/s (%d tokens in %.2f s)\n", R,
                           r->proj, nt, tp);
                }
                df_basis_free(&b);
            }
            free(z);
            fflush(stdout);
        }
        free(s.buf);
    }
    print_tables(res, nd, gpu, threads);
    printf("\ntotal %.0f s\n", df_now() - t_start);
    df_basis_gpu_close(g);
    df_basis_gpu_close(g64);
    df_pool_close(pool);
    return status;
}
