/* basis.c - second moment, eigenbasis fit, projection, merge and the basis
 * file (contracts in basis.h, byte layout in docs/FORMAT-basis.md).
 *
 * Three compute engines, all split over a df_pool in independent tasks:
 *  - the moment: M += X^T X for chunks of <= 256 rows, upper-triangle tiles
 *    of 6 x 16, f32 register tiles (AVX2+FMA when the CPU has it) added into
 *    the double M once per chunk;
 *  - "NT": C = A B^T with A's rows fetched (and converted) by a callback and
 *    B pre-packed in 16-row panels, the same 6 x 16 f32 kernel, f32 sums per
 *    256 terms added into a double tile: the projection and df_basis_eval;
 *  - "mul": Y = W B in double (4 x 8 AVX2 double tiles): merge, unproject,
 *    the Gram matrix and the rows of df_basis_from_rows, where the brief is
 *    exactness rather than speed.
 * Eigendecompositions are LAPACK's dsyevr. */
#include "basis.h"

#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32c.h"
#include "dtype.h"
#include "fsutil.h"
#include "le.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DF_X86_SIMD 1
#endif

/* LAPACK, Fortran calling convention (LP64: 32-bit integers), declared here
 * (no lapacke header); the trailing size_t are the hidden lengths of the
 * character arguments that gfortran-built libraries expect. */
extern void dsyevr_(const char *jobz, const char *range, const char *uplo, const int *n,
                    double *a, const int *lda, const double *vl, const double *vu,
                    const int *il, const int *iu, const double *abstol, int *m, double *w,
                    double *z, const int *ldz, int *isuppz, double *work, const int *lwork,
                    int *iwork, const int *liwork, int *info, size_t jobz_len,
                    size_t range_len, size_t uplo_len);

static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

static void *alloc64(size_t bytes)
{
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* ---- the f32 register-tile kernel ----
 * c[r][j] (double, rows ldc apart) += the f32 sum over k < kc of
 * a[k][r] * b[k][j], r < MR, j < NR: a is packed [kc][MR], b [kc][NR]
 * (64-byte aligned rows of 16). f32 products and sums, one rounding to
 * double per call: callers keep kc <= 256. */
enum { MR = 6, NR = 16 };
typedef void (*kern_fn)(int64_t kc, const float *a, const float *b, double *c, int64_t ldc);

static void kern_c(int64_t kc, const float *a, const float *b, double *c, int64_t ldc)
{
    float acc[MR * NR];
    memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < kc; k++)
        for (int r = 0; r < MR; r++) {
            float av = a[k * MR + r];
            for (int j = 0; j < NR; j++)
                acc[r * NR + j] += av * b[k * NR + j];
        }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++)
            c[r * ldc + j] += acc[r * NR + j];
}

#ifdef DF_X86_SIMD
/* c[0..8) += the 8 f32 lanes of v, widened. */
__attribute__((target("avx2,fma"))) static inline void add_f32x8(double *c, __m256 v)
{
    _mm256_storeu_pd(c, _mm256_add_pd(_mm256_loadu_pd(c),
                                      _mm256_cvtps_pd(_mm256_castps256_ps128(v))));
    _mm256_storeu_pd(c + 4, _mm256_add_pd(_mm256_loadu_pd(c + 4),
                                          _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))));
}

/* 12 accumulators of 8 lanes; per k two panel loads, six broadcasts, twelve
 * FMAs (the shape of kernels/cpu/gemm.c's kernel). */
__attribute__((target("avx2,fma"))) static void kern_avx2(int64_t kc, const float *a,
                                                           const float *b, double *c,
                                                           int64_t ldc)
{
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < kc; k++) {
        const float *ak = a + k * MR;
        __m256 b0 = _mm256_load_ps(b + k * NR), b1 = _mm256_load_ps(b + k * NR + 8);
        __m256 av = _mm256_broadcast_ss(ak + 0);
        c00 = _mm256_fmadd_ps(av, b0, c00), c01 = _mm256_fmadd_ps(av, b1, c01);
        av = _mm256_broadcast_ss(ak + 1);
        c10 = _mm256_fmadd_ps(av, b0, c10), c11 = _mm256_fmadd_ps(av, b1, c11);
        av = _mm256_broadcast_ss(ak + 2);
        c20 = _mm256_fmadd_ps(av, b0, c20), c21 = _mm256_fmadd_ps(av, b1, c21);
        av = _mm256_broadcast_ss(ak + 3);
        c30 = _mm256_fmadd_ps(av, b0, c30), c31 = _mm256_fmadd_ps(av, b1, c31);
        av = _mm256_broadcast_ss(ak + 4);
        c40 = _mm256_fmadd_ps(av, b0, c40), c41 = _mm256_fmadd_ps(av, b1, c41);
        av = _mm256_broadcast_ss(ak + 5);
        c50 = _mm256_fmadd_ps(av, b0, c50), c51 = _mm256_fmadd_ps(av, b1, c51);
    }
    add_f32x8(c + 0 * ldc, c00), add_f32x8(c + 0 * ldc + 8, c01);
    add_f32x8(c + 1 * ldc, c10), add_f32x8(c + 1 * ldc + 8, c11);
    add_f32x8(c + 2 * ldc, c20), add_f32x8(c + 2 * ldc + 8, c21);
    add_f32x8(c + 3 * ldc, c30), add_f32x8(c + 3 * ldc + 8, c31);
    add_f32x8(c + 4 * ldc, c40), add_f32x8(c + 4 * ldc + 8, c41);
    add_f32x8(c + 5 * ldc, c50), add_f32x8(c + 5 * ldc + 8, c51);
}
#endif

static kern_fn pick_kern(void)
{
#ifdef DF_X86_SIMD
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return kern_avx2;
#endif
    return kern_c;
}

/* ---- the double kernel: c[MD rows, ldc][ND] += sum_k w[k][:] (x) b[k*ldb .. +ND] ---- */
enum { MD = 4, ND = 8 };
typedef void (*dkern_fn)(int64_t kc, const double *w, const double *b, int64_t ldb, double *c,
                         int64_t ldc);

static void dkern_c(int64_t kc, const double *w, const double *b, int64_t ldb, double *c,
                    int64_t ldc)
{
    for (int64_t k = 0; k < kc; k++)
        for (int r = 0; r < MD; r++) {
            double wv = w[k * MD + r];
            for (int j = 0; j < ND; j++)
                c[r * ldc + j] += wv * b[k * ldb + j];
        }
}

#ifdef DF_X86_SIMD
__attribute__((target("avx2,fma"))) static void dkern_avx2(int64_t kc, const double *w,
                                                            const double *b, int64_t ldb,
                                                            double *c, int64_t ldc)
{
    __m256d c00 = _mm256_loadu_pd(c), c01 = _mm256_loadu_pd(c + 4);
    __m256d c10 = _mm256_loadu_pd(c + ldc), c11 = _mm256_loadu_pd(c + ldc + 4);
    __m256d c20 = _mm256_loadu_pd(c + 2 * ldc), c21 = _mm256_loadu_pd(c + 2 * ldc + 4);
    __m256d c30 = _mm256_loadu_pd(c + 3 * ldc), c31 = _mm256_loadu_pd(c + 3 * ldc + 4);
    for (int64_t k = 0; k < kc; k++) {
        __m256d b0 = _mm256_loadu_pd(b + k * ldb), b1 = _mm256_loadu_pd(b + k * ldb + 4);
        const double *wk = w + k * MD;
        __m256d wv = _mm256_broadcast_sd(wk + 0);
        c00 = _mm256_fmadd_pd(wv, b0, c00), c01 = _mm256_fmadd_pd(wv, b1, c01);
        wv = _mm256_broadcast_sd(wk + 1);
        c10 = _mm256_fmadd_pd(wv, b0, c10), c11 = _mm256_fmadd_pd(wv, b1, c11);
        wv = _mm256_broadcast_sd(wk + 2);
        c20 = _mm256_fmadd_pd(wv, b0, c20), c21 = _mm256_fmadd_pd(wv, b1, c21);
        wv = _mm256_broadcast_sd(wk + 3);
        c30 = _mm256_fmadd_pd(wv, b0, c30), c31 = _mm256_fmadd_pd(wv, b1, c31);
    }
    _mm256_storeu_pd(c, c00), _mm256_storeu_pd(c + 4, c01);
    _mm256_storeu_pd(c + ldc, c10), _mm256_storeu_pd(c + ldc + 4, c11);
    _mm256_storeu_pd(c + 2 * ldc, c20), _mm256_storeu_pd(c + 2 * ldc + 4, c21);
    _mm256_storeu_pd(c + 3 * ldc, c30), _mm256_storeu_pd(c + 3 * ldc + 4, c31);
}
#endif

static dkern_fn pick_dkern(void)
{
#ifdef DF_X86_SIMD
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return dkern_avx2;
#endif
    return dkern_c;
}

/* ---- token rows: K layers of [n x H] (ld elements between rows) ---- */
typedef struct rows_src {
    const void *const *layers;
    int bf16; /* 1: BF16 bits, 0: f32 */
    int K, H;
    int64_t ld;
} rows_src;

/* dst[0 .. kc) = x_t[k0 .. k0+kc) as f32, x_t being the layers concatenated. */
static void src_get(const void *ctx, int64_t t, int64_t k0, int64_t kc, float *dst)
{
    const rows_src *s = ctx;
    while (kc > 0) {
        int64_t l = k0 / s->H, off = k0 % s->H, nn = imin(s->H - off, kc);
        if (s->bf16) {
            const uint16_t *p = (const uint16_t *)s->layers[l] + t * s->ld + off;
            uint32_t *d = (uint32_t *)(void *)dst; /* f32 bits */
            int64_t i = 0;
            for (; i + 8 <= nn; i += 8) /* fixed count: vectorized at -O2 */
                for (int q = 0; q < 8; q++)
                    d[i + q] = (uint32_t)p[i + q] << 16;
            for (; i < nn; i++)
                d[i] = (uint32_t)p[i] << 16;
        } else {
            memcpy(dst, (const float *)s->layers[l] + t * s->ld + off, (size_t)nn * 4);
        }
        dst += nn, k0 += nn, kc -= nn;
    }
}

/* The first non-finite element of rows [t0, t1): 1 with its position, else 0. */
/* Whether a layer row has an all-ones exponent (inf or NaN): a branch-free
 * OR over blocks of 8 that the compiler vectorizes; the position is then
 * found by the caller's second, scalar look. */
static int row_nonfinite(const rows_src *s, const void *row)
{
    uint32_t bad = 0;
    int64_t i = 0, H = s->H;
    if (s->bf16) {
        const uint16_t *p = row;
        for (; i + 8 <= H; i += 8)
            for (int q = 0; q < 8; q++)
                bad |= (uint32_t)((p[i + q] & 0x7f80) == 0x7f80);
        for (; i < H; i++)
            bad |= (uint32_t)((p[i] & 0x7f80) == 0x7f80);
    } else {
        const uint32_t *p = row;
        for (; i + 8 <= H; i += 8)
            for (int q = 0; q < 8; q++)
                bad |= (uint32_t)((p[i + q] & 0x7f800000u) == 0x7f800000u);
        for (; i < H; i++)
            bad |= (uint32_t)((p[i] & 0x7f800000u) == 0x7f800000u);
    }
    return bad != 0;
}

static int src_find_nonfinite(const rows_src *s, int64_t t0, int64_t t1, int64_t *row,
                              int *layer, int64_t *col)
{
    size_t es = s->bf16 ? 2 : 4;
    for (int64_t t = t0; t < t1; t++)
        for (int l = 0; l < s->K; l++) {
            const uint8_t *p = (const uint8_t *)s->layers[l] + (size_t)(t * s->ld) * es;
            if (!row_nonfinite(s, p))
                continue;
            for (int64_t i = 0;; i++) {
                float f = s->bf16 ? df_bf16_to_f32(((const uint16_t *)(const void *)p)[i])
                                  : ((const float *)(const void *)p)[i];
                if (!isfinite(f)) {
                    *row = t, *layer = l, *col = i;
                    return 1;
                }
            }
        }
    return 0;
}

enum { SCAN_ROWS = 64 };
typedef struct scan_job {
    const rows_src *src;
    int64_t n;
    int64_t *bad; /* per task: first bad row, or -1; then layer and column */
} scan_job;

static int scan_task(void *arg, size_t i)
{
    scan_job *j = arg;
    int64_t t0 = (int64_t)i * SCAN_ROWS, row, col;
    int layer;
    j->bad[3 * i] = -1;
    if (src_find_nonfinite(j->src, t0, imin(t0 + SCAN_ROWS, j->n), &row, &layer, &col)) {
        j->bad[3 * i] = row, j->bad[3 * i + 1] = layer, j->bad[3 * i + 2] = col;
    }
    return 0;
}

/* -EINVAL naming the first non-finite value of rows [0, n), else 0. */
static int src_check_finite(const rows_src *s, int64_t n, const char *what, df_pool *pool,
                            df_err *e)
{
    size_t ntask = (size_t)cdiv(n, SCAN_ROWS);
    scan_job j = {s, n, malloc(ntask * 3 * sizeof(int64_t))};
    if (!j.bad)
        return df_errf(e, -ENOMEM, "%s: out of memory for the input scan", what);
    df_pool_for(pool, ntask, scan_task, &j);
    int rc = 0;
    for (size_t i = 0; i < ntask && !rc; i++)
        if (j.bad[3 * i] >= 0)
            rc = df_errf(e, -EINVAL, "%s: row %lld, layer %lld, column %lld is not finite", what,
                         (long long)j.bad[3 * i], (long long)j.bad[3 * i + 1],
                         (long long)j.bad[3 * i + 2]);
    free(j.bad);
    return rc;
}

/* ---- second moment ---- */

static int check_shape(int K, int H, const char *what, df_err *e)
{
    if (K < 1 || K > DF_BASIS_MAX_LAYERS)
        return df_errf(e, -EINVAL, "%s: K = %d layers, must be in [1, %d]", what, K,
                       DF_BASIS_MAX_LAYERS);
    if (H < 1 || (int64_t)K * H > DF_BASIS_MAX_DIM)
        return df_errf(e, -EINVAL, "%s: H = %d with K = %d: D = K*H must be in [1, %d]", what, H,
                       K, DF_BASIS_MAX_DIM);
    return 0;
}

int df_moment_init(df_moment *m, int K, int H, const int32_t *layer_ids, df_err *e)
{
    memset(m, 0, sizeof *m);
    int rc = check_shape(K, H, "df_moment_init", e);
    if (rc)
        return rc;
    m->K = K, m->H = H, m->D = K * H;
    for (int k = 0; k < K; k++)
        m->layer_ids[k] = layer_ids ? layer_ids[k] : k;
    return 0;
}

void df_moment_free(df_moment *m)
{
    free(m->m);
    free(m->scratch_);
    memset(m, 0, sizeof *m);
}

static int moment_alloc(df_moment *m, df_err *e)
{
    if (m->m)
        return 0;
    size_t n = (size_t)m->D * (size_t)m->D, bytes = n * sizeof(double);
    if (bytes < (64u << 20)) {
        m->m = calloc(n, sizeof(double));
    } else {
        /* Large: 2 MiB aligned and advised to transparent huge pages, so the
         * first touch is a few thousand faults rather than a million (11 s of
         * 4 KiB faults at D = 25600 here); best effort, zeroed by hand. */
        size_t huge = 2u << 20;
        m->m = aligned_alloc(huge, (bytes + huge - 1) / huge * huge);
        if (m->m) {
            madvise(m->m, (bytes + huge - 1) / huge * huge, MADV_HUGEPAGE);
            memset(m->m, 0, bytes);
        }
    }
    if (!m->m)
        return df_errf(e, -ENOMEM, "second moment: out of memory for %d x %d doubles (%.2f GB)",
                       m->D, m->D, (double)bytes / 1e9);
    return 0;
}

static double moment_diag_sum(const df_moment *m)
{
    double s = 0;
    for (int64_t i = 0; i < m->D; i++)
        s += m->m[i * m->D + i];
    return s;
}

/* The add walks the rows in chunks of NCH. A chunk is packed (pa: column
 * groups of MR, pb: column panels of NR, both [NCH rows][lanes]), then each
 * task takes a block of GB groups x PB panels of M (48 x 256): per slice of
 * KS rows, 6 x 16 f32 register tiles are summed into a double block in
 * cache, which is added into M once per chunk. So f32 sums are over at most
 * KS = 256 products, and M (which at large D lives in DRAM) is read and
 * written once per 1024 rows. */
enum { NCH = 1024, KS = 256, GB = 8, PB = 16, PACK_ROWS = 16, PACK_COLS = 192 };

typedef struct mom_job {
    const rows_src *src;
    int64_t t0, nch, D, ngrp, npan, ncb; /* ncb: column blocks of PACK_COLS */
    float *pa, *pb;                      /* [ngrp][NCH][MR], [npan][NCH][NR] */
    double *M;
    kern_fn kern;
    int32_t (*tasks)[2];
} mom_job;

/* Rows of block i / ncb (PACK_ROWS of them), columns of block i % ncb
 * (PACK_COLS, a multiple of MR and NR): converted into a small buffer, then
 * copied group by group and panel by panel (contiguous destinations). */
static int mom_pack_task(void *arg, size_t i)
{
    mom_job *j = arg;
    float rows[PACK_ROWS][PACK_COLS];
    int64_t t0 = (int64_t)i / j->ncb * PACK_ROWS, nt = imin(PACK_ROWS, j->nch - t0);
    int64_t c0 = (int64_t)i % j->ncb * PACK_COLS, nc = imin(PACK_COLS, j->D - c0);
    for (int64_t t = 0; t < nt; t++) {
        src_get(j->src, j->t0 + t0 + t, c0, nc, rows[t]);
        for (int64_t c = nc; c < PACK_COLS; c++) /* columns past D: zero */
            rows[t][c] = 0;
    }
    for (int64_t g = c0 / MR; g < imin((c0 + PACK_COLS) / MR, j->ngrp); g++) {
        float *dst = j->pa + (g * NCH + t0) * MR;
        for (int64_t t = 0; t < nt; t++)
            for (int c = 0; c < MR; c++)
                dst[t * MR + c] = rows[t][g * MR - c0 + c];
    }
    for (int64_t p = c0 / NR; p < imin((c0 + PACK_COLS) / NR, j->npan); p++) {
        float *dst = j->pb + (p * NCH + t0) * NR;
        for (int64_t t = 0; t < nt; t++)
            for (int c = 0; c < NR; c++)
                dst[t * NR + c] = rows[t][p * NR - c0 + c];
    }
    return 0;
}

static int mom_task(void *arg, size_t i)
{
    mom_job *j = arg;
    enum { BR = GB * MR, BC = PB * NR }; /* the block: 48 x 256 */
    int64_t g0 = (int64_t)j->tasks[i][0] * GB, g1 = imin(g0 + GB, j->ngrp);
    int64_t p0 = (int64_t)j->tasks[i][1] * PB, p1 = imin(p0 + PB, j->npan);
    /* on the stack (96 KiB; threads have megabytes): an add cannot fail half way */
    double acc[BR * BC];
    memset(acc, 0, sizeof acc);
    for (int64_t k0 = 0; k0 < j->nch; k0 += KS) {
        int64_t kc = imin(KS, j->nch - k0);
        for (int64_t p = p0; p < p1; p++) {
            const float *b = j->pb + (p * NCH + k0) * NR;
            for (int64_t g = g0; g < g1; g++) {
                if (p * NR + NR - 1 < g * MR) /* the tile lies below the diagonal */
                    continue;
                j->kern(kc, j->pa + (g * NCH + k0) * MR, b,
                        acc + (g - g0) * MR * BC + (p - p0) * NR, BC);
            }
        }
    }
    /* into M: rows and columns inside D (tiles below the diagonal added 0) */
    int64_t r1 = imin(g1 * MR, j->D), cb = p0 * NR, nc = imin(p1 * NR, j->D) - cb;
    for (int64_t r = g0 * MR; r < r1; r++) {
        double *dst = j->M + r * j->D + cb;
        const double *src = acc + (r - g0 * MR) * BC;
        for (int64_t c = 0; c < nc; c++)
            dst[c] += src[c];
    }
    return 0;
}

static int moment_add_src(df_moment *m, const rows_src *src, int64_t n, df_pool *pool,
                          const char *what, df_err *e)
{
    if (n == 0)
        return 0;
    int rc = src_check_finite(src, n, what, pool, e);
    if (rc)
        return rc;
    int64_t D = m->D, ngrp = cdiv(D, MR), npan = cdiv(D, NR);
    int64_t nrb = cdiv(ngrp, GB), ncc = cdiv(npan, PB);
    mom_job j = {.src = src, .D = D, .ngrp = ngrp, .npan = npan, .ncb = cdiv(D, PACK_COLS),
                 .kern = pick_kern()};
    /* Scratch, kept in m between adds (a fresh one per call would be page
     * faults every call): the A and B packs and the task list. */
    size_t na = (size_t)(ngrp * NCH * MR), nb = (size_t)(npan * NCH * NR);
    size_t nt = (size_t)(nrb * ncc) * 2;
    size_t need = (na + nb + nt) * sizeof(float);
    if (!m->scratch_) {
        if (!(m->scratch_ = alloc64(need)))
            return df_errf(e, -ENOMEM, "%s: out of memory for the packing scratch (%.1f MB)",
                           what, (double)need / 1e6);
        memset(m->scratch_, 0, need);
    }
    if ((rc = moment_alloc(m, e)) < 0)
        return rc;
    j.pa = m->scratch_, j.pb = j.pa + na;
    j.tasks = (int32_t(*)[2])(void *)(j.pb + nb);
    j.M = m->m;
    size_t ntask = 0;
    for (int64_t rb = 0; rb < nrb; rb++)
        for (int64_t cc = 0; cc < ncc; cc++)
            if ((cc + 1) * PB * NR - 1 >= rb * GB * MR) /* not wholly below the diagonal */
                j.tasks[ntask][0] = (int32_t)rb, j.tasks[ntask++][1] = (int32_t)cc;
    for (int64_t t0 = 0; t0 < n; t0 += NCH) { /* nothing below can fail */
        j.t0 = t0, j.nch = imin(NCH, n - t0);
        df_pool_for(pool, (size_t)(cdiv(j.nch, PACK_ROWS) * j.ncb), mom_pack_task, &j);
        df_pool_for(pool, ntask, mom_task, &j);
    }
    m->n_rows += n;
    m->trace = moment_diag_sum(m);
    return 0;
}

static int moment_args(const df_moment *m, int K, int H, int64_t n, const void *layers,
                       const char *what, df_err *e)
{
    if (!m->D)
        return df_errf(e, -EINVAL, "%s: moment not initialised (df_moment_init)", what);
    if (K != m->K || H != m->H)
        return df_errf(e, -DF_EMISMATCH, "%s: %d layers of %d, the moment is of %d layers of %d",
                       what, K, H, m->K, m->H);
    if (n < 0 || (n > 0 && !layers))
        return df_errf(e, -EINVAL, "%s: n_rows = %lld%s", what, (long long)n,
                       n < 0 ? ", must be >= 0" : " with no layers");
    return 0;
}

int df_moment_add_bf16(df_moment *m, const uint16_t *const *layers, int K, int H,
                       int64_t n_rows, df_pool *pool, df_err *e)
{
    int rc = moment_args(m, K, H, n_rows, layers, "df_moment_add_bf16", e);
    if (rc)
        return rc;
    rows_src s = {(const void *const *)layers, 1, K, H, H};
    return moment_add_src(m, &s, n_rows, pool, "df_moment_add_bf16", e);
}

int df_moment_add_f32(df_moment *m, const float *const *layers, int K, int H, int64_t n_rows,
                      df_pool *pool, df_err *e)
{
    int rc = moment_args(m, K, H, n_rows, layers, "df_moment_add_f32", e);
    if (rc)
        return rc;
    rows_src s = {(const void *const *)layers, 0, K, H, H};
    return moment_add_src(m, &s, n_rows, pool, "df_moment_add_f32", e);
}

int df_moment_merge(df_moment *dst, const df_moment *src, df_err *e)
{
    if (dst->K != src->K || dst->H != src->H ||
        memcmp(dst->layer_ids, src->layer_ids, sizeof(int32_t) * (size_t)dst->K))
        return df_errf(e, -DF_EMISMATCH, "df_moment_merge: moments of %d x %d and %d x %d "
                       "(or other layer ids)", dst->K, dst->H, src->K, src->H);
    if (!src->m || src->n_rows == 0)
        return 0;
    int rc = moment_alloc(dst, e);
    if (rc)
        return rc;
    int64_t D = dst->D;
    for (int64_t i = 0; i < D; i++)
        for (int64_t j = i; j < D; j++)
            dst->m[i * D + j] += src->m[i * D + j];
    dst->n_rows += src->n_rows;
    dst->trace = moment_diag_sum(dst);
    return 0;
}

/* Copies M's upper triangle into its strictly lower one (blocked transpose),
 * making the array the whole symmetric matrix. */
static void mirror_upper(double *M, int64_t D)
{
    enum { TB = 64 };
    for (int64_t ib = 0; ib < D; ib += TB)
        for (int64_t jb = ib; jb < D; jb += TB)
            for (int64_t i = ib; i < imin(ib + TB, D); i++)
                for (int64_t j = jb > i + 1 ? jb : i + 1; j < imin(jb + TB, D); j++)
                    M[j * D + i] = M[i * D + j];
}

/* ---- LAPACK ---- */

/* Eigenvalues (ascending, into w) and, when z != NULL, eigenvectors (columns
 * of z, n x count, column-major = row-major rows) of the symmetric n x n a,
 * read from and destroying its column-major upper triangle = row-major lower
 * triangle, and the diagonal. il == 0: all; else indices il .. iu (1-based,
 * ascending order). */
static int lapack_eig(double *a, int n, int il, int iu, double *w, double *z, df_err *e)
{
    char jobz = z ? 'V' : 'N', range = il ? 'I' : 'A', uplo = 'U';
    int lda = n, ldz = z ? n : 1, found = 0, info = 0, lwork = -1, liwork = -1, iwq = 0;
    double vl = 0, vu = 0, abstol = 0, wq = 0, zdummy = 0;
    int want = il ? iu - il + 1 : n;
    int *isuppz = malloc(sizeof(int) * 2 * (size_t)(want > 0 ? want : 1));
    if (!isuppz)
        return df_errf(e, -ENOMEM, "dsyevr: out of memory");
    dsyevr_(&jobz, &range, &uplo, &n, a, &lda, &vl, &vu, &il, &iu, &abstol, &found, w,
            z ? z : &zdummy, &ldz, isuppz, &wq, &lwork, &iwq, &liwork, &info, 1, 1, 1);
    if (info != 0) {
        free(isuppz);
        return df_errf(e, -EDOM, "dsyevr workspace query failed (info %d)", info);
    }
    lwork = (int)wq + 1, liwork = iwq;
    double *work = malloc(sizeof(double) * (size_t)lwork);
    int *iwork = malloc(sizeof(int) * (size_t)liwork);
    int rc = 0;
    if (!work || !iwork) {
        rc = df_errf(e, -ENOMEM, "dsyevr: out of memory for %d doubles of workspace", lwork);
    } else {
        dsyevr_(&jobz, &range, &uplo, &n, a, &lda, &vl, &vu, &il, &iu, &abstol, &found, w,
                z ? z : &zdummy, &ldz, isuppz, work, &lwork, iwork, &liwork, &info, 1, 1, 1);
        if (info != 0)
            rc = df_errf(e, -EDOM, "dsyevr failed on a %d x %d matrix (info %d)", n, n, info);
        else if (found != want)
            rc = df_errf(e, -EDOM, "dsyevr found %d eigenvalues, %d wanted", found, want);
    }
    free(work);
    free(iwork);
    free(isuppz);
    return rc;
}

/* ---- basis ---- */

int df_basis_init(df_basis *b, int K, int H, int R, const int32_t *layer_ids, df_err *e)
{
    memset(b, 0, sizeof *b);
    int rc = check_shape(K, H, "df_basis_init", e);
    if (rc)
        return rc;
    int D = K * H;
    if (R < 1 || R > D)
        return df_errf(e, -EINVAL, "df_basis_init: R = %d, must be in [1, %d]", R, D);
    b->eigval = calloc((size_t)R, sizeof(double));
    b->P = calloc((size_t)R * (size_t)D, sizeof(float));
    if (!b->eigval || !b->P) {
        df_basis_free(b);
        return df_errf(e, -ENOMEM, "basis: out of memory for %d x %d floats", R, D);
    }
    b->D = D, b->R = R, b->K = K, b->H = H;
    for (int k = 0; k < K; k++)
        b->layer_ids[k] = layer_ids ? layer_ids[k] : k;
    return 0;
}

void df_basis_free(df_basis *b)
{
    free(b->eigval);
    free(b->P);
    memset(b, 0, sizeof *b);
}

void df_basis_canonicalize(df_basis *b)
{
    for (int64_t r = 0; r < b->R; r++) {
        float *p = b->P + r * b->D;
        int64_t best = 0;
        for (int64_t i = 1; i < b->D; i++)
            if (fabsf(p[i]) > fabsf(p[best]))
                best = i;
        if (p[best] < 0)
            for (int64_t i = 0; i < b->D; i++)
                p[i] = -p[i];
    }
}

void df_basis_stats_from_eigen(df_basis *b)
{
    double tot = 0;
    for (int r = 0; r < b->R; r++)
        tot += b->eigval[r];
    b->kept = b->total_energy > 0 ? tot / b->total_energy : 1.0;
    for (int k = 0; k < b->K; k++) {
        double num = 0;
        for (int64_t r = 0; r < b->R; r++) {
            const float *p = b->P + r * b->D + (int64_t)k * b->H;
            double s = 0;
            for (int64_t i = 0; i < b->H; i++)
                s += (double)p[i] * p[i];
            num += b->eigval[r] * s;
        }
        b->layer_kept[k] = b->layer_energy[k] > 0 ? num / b->layer_energy[k] : 1.0;
    }
}

/* R fixed in [1, D] with energy 0, or R 0 with energy in (0, 1]. */
static int check_rank_rule(int R, double energy, int D, const char *what, df_err *e)
{
    if (R > 0 && R <= D && energy == 0)
        return 0;
    if (R == 0 && energy > 0 && energy <= 1)
        return 0;
    return df_errf(e, -EINVAL, "%s: R = %d, energy = %g: give R in [1, %d] (energy 0), or R 0 "
                   "and an energy fraction in (0, 1]", what, R, energy, D);
}

/* Smallest r with sum of the top r of lam (descending, n of them) >=
 * (energy - 1e-10) * total; n when none. */
static int rank_for_energy(const double *lam_desc, int n, double total, double energy)
{
    double cum = 0;
    for (int r = 0; r < n; r++) {
        cum += lam_desc[r];
        if (cum >= (energy - 1e-10) * total)
            return r + 1;
    }
    return n;
}

int df_basis_fit(const df_moment *m, int R, double energy, df_basis *out, df_err *e)
{
    memset(out, 0, sizeof *out);
    if (!m->m || m->n_rows <= 0)
        return df_errf(e, -EINVAL, "df_basis_fit: the moment holds no rows");
    int rc = check_rank_rule(R, energy, m->D, "df_basis_fit", e);
    if (rc)
        return rc;
    int D = m->D;
    double *A = m->m, *diag = malloc(sizeof(double) * (size_t)D);
    double *w = malloc(sizeof(double) * (size_t)D), *Z = NULL;
    if (!diag || !w) {
        rc = df_errf(e, -ENOMEM, "df_basis_fit: out of memory");
        goto out;
    }
    double total = 0, lay[DF_BASIS_MAX_LAYERS] = {0};
    for (int64_t i = 0; i < D; i++) {
        diag[i] = A[i * D + i];
        total += diag[i];
        lay[i / m->H] += diag[i];
    }
    if (!(total > 0) || !isfinite(total)) {
        rc = df_errf(e, -EINVAL, "df_basis_fit: the moment has no energy (trace %g)", total);
        goto out;
    }
    if (R == 0) { /* all eigenvalues first, to find the rank */
        mirror_upper(A, D);
        rc = lapack_eig(A, D, 0, 0, w, NULL, e);
        for (int64_t i = 0; i < D; i++)
            A[i * D + i] = diag[i];
        if (rc)
            goto out;
        for (int i = 0; i < D / 2; i++) { /* descending */
            double t = w[i];
            w[i] = w[D - 1 - i], w[D - 1 - i] = t;
        }
        R = rank_for_energy(w, D, total, energy);
    }
    Z = malloc(sizeof(double) * (size_t)D * (size_t)R);
    if (!Z) {
        rc = df_errf(e, -ENOMEM, "df_basis_fit: out of memory for %d eigenvectors of %d doubles "
                     "(%.2f GB)", R, D, (double)D * R * 8 / 1e9);
        goto out;
    }
    mirror_upper(A, D);
    rc = lapack_eig(A, D, D - R + 1, D, w, Z, e);
    for (int64_t i = 0; i < D; i++)
        A[i * D + i] = diag[i];
    if (rc)
        goto out;
    if ((rc = df_basis_init(out, m->K, m->H, R, m->layer_ids, e)) < 0)
        goto out;
    for (int64_t r = 0; r < R; r++) { /* dsyevr's order is ascending */
        const double *zc = Z + (R - 1 - r) * (int64_t)D;
        out->eigval[r] = w[R - 1 - r];
        for (int64_t i = 0; i < D; i++)
            out->P[r * D + i] = (float)zc[i];
    }
    out->kind = DF_BASIS_KIND_MOMENT;
    out->n_rows = m->n_rows;
    out->total_energy = total;
    memcpy(out->layer_energy, lay, sizeof lay);
    df_basis_canonicalize(out);
    df_basis_stats_from_eigen(out);
out:
    free(diag);
    free(w);
    free(Z);
    return rc;
}

/* ---- "mul": Y (n x D) = W (n x m) B (m x D) in double ----
 * W f32 or double, B f32 (ldb), Y f32 or double (ldy). A task is HB rows of
 * Y x DB columns; m is walked in slices of RCH, B's slice packed as double
 * [RCH][DB], W's as [HB/MD][RCH][MD]. */
enum { HB = 64, DB = 256, RCH = 256 };

typedef struct mul_job {
    int64_t n, m, D;
    const float *w32;
    const double *w64;
    int64_t ldw;
    const float *B;
    int64_t ldb;
    float *y32;
    double *y64;
    int64_t ldy, ndb;
    dkern_fn kern;
} mul_job;

static int mul_task(void *arg, size_t t)
{
    mul_job *j = arg;
    int64_t h0 = (int64_t)t / j->ndb * HB, nh = imin(HB, j->n - h0);
    int64_t d0 = (int64_t)t % j->ndb * DB, nd = imin(DB, j->D - d0);
    int64_t ngq = cdiv(nh, MD), nd8 = cdiv(nd, ND);
    double *acc = calloc(HB * DB, sizeof(double));
    double *wp = alloc64(HB * RCH * sizeof(double)), *bp = alloc64(RCH * DB * sizeof(double));
    int rc = 0;
    if (!acc || !wp || !bp) {
        rc = -ENOMEM;
        goto out;
    }
    for (int64_t r0 = 0; r0 < j->m; r0 += RCH) {
        int64_t rc_ = imin(RCH, j->m - r0);
        for (int64_t k = 0; k < rc_; k++) {
            const float *src = j->B + (r0 + k) * j->ldb + d0;
            double *dst = bp + k * DB;
            for (int64_t c = 0; c < nd; c++)
                dst[c] = src[c];
            for (int64_t c = nd; c < nd8 * ND; c++)
                dst[c] = 0;
        }
        for (int64_t h = 0; h < ngq * MD; h++) {
            double *dst = wp + (h / MD) * RCH * MD + h % MD;
            if (h >= nh) {
                for (int64_t k = 0; k < rc_; k++)
                    dst[k * MD] = 0;
            } else if (j->w32) {
                const float *src = j->w32 + (h0 + h) * j->ldw + r0;
                for (int64_t k = 0; k < rc_; k++)
                    dst[k * MD] = src[k];
            } else {
                const double *src = j->w64 + (h0 + h) * j->ldw + r0;
                for (int64_t k = 0; k < rc_; k++)
                    dst[k * MD] = src[k];
            }
        }
        for (int64_t g = 0; g < ngq; g++)
            for (int64_t c8 = 0; c8 < nd8; c8++)
                j->kern(rc_, wp + g * RCH * MD, bp + c8 * ND, DB, acc + g * MD * DB + c8 * ND, DB);
    }
    for (int64_t h = 0; h < nh; h++)
        for (int64_t c = 0; c < nd; c++) {
            if (j->y32)
                j->y32[(h0 + h) * j->ldy + d0 + c] = (float)acc[h * DB + c];
            else
                j->y64[(h0 + h) * j->ldy + d0 + c] = acc[h * DB + c];
        }
out:
    free(acc);
    free(wp);
    free(bp);
    return rc;
}

static int mul_run(mul_job *j, df_pool *pool, const char *what, df_err *e)
{
    j->ndb = cdiv(j->D, DB);
    j->kern = pick_dkern();
    if (j->n == 0 || j->D == 0)
        return 0;
    int rc = df_pool_for(pool, (size_t)(cdiv(j->n, HB) * j->ndb), mul_task, j);
    return rc ? df_errf(e, rc, "%s: out of memory for a task's tiles", what) : 0;
}

/* ---- "NT": C (n x m) = A (n x kd) B^T, A's rows through a callback, B packed ----
 * B panels: panel p (B's rows 16p .. 16p+15) at bp + p*bld*NR, its row k at
 * + (boff + k)*NR, lanes past B's last row zero. A task is MC rows x NC
 * columns of C; kd is walked in slices of KC; the finished double tile goes
 * to put(). */
enum { MC = 96, NC = 256, KC = 256 };
typedef void (*get_fn)(const void *ctx, int64_t row, int64_t k0, int64_t kc, float *dst);
typedef void (*put_fn)(void *ctx, int64_t i0, int64_t ni, int64_t j0, int64_t nj,
                       const double *acc /* [MC][NC] */);

typedef struct nt_job {
    int64_t n, m, kd;
    get_fn get;
    const void *gctx;
    const float *bp;
    int64_t bld, boff;
    put_fn put;
    void *pctx;
    kern_fn kern;
    int64_t njb;
} nt_job;

static int nt_task(void *arg, size_t t)
{
    nt_job *j = arg;
    int64_t i0 = (int64_t)t / j->njb * MC, ni = imin(MC, j->n - i0);
    int64_t j0 = (int64_t)t % j->njb * NC, nj = imin(NC, j->m - j0);
    int64_t ng = cdiv(ni, MR), np = cdiv(nj, NR);
    float *ap = alloc64(MC * KC * sizeof(float)), *row = malloc(KC * sizeof(float));
    double *acc = calloc(MC * NC, sizeof(double));
    int rc = 0;
    if (!ap || !row || !acc) {
        rc = -ENOMEM;
        goto out;
    }
    memset(ap, 0, MC * KC * sizeof(float)); /* rows past ni stay zero */
    for (int64_t k0 = 0; k0 < j->kd; k0 += KC) {
        int64_t kc = imin(KC, j->kd - k0);
        for (int64_t r = 0; r < ni; r++) {
            j->get(j->gctx, i0 + r, k0, kc, row);
            float *dst = ap + (r / MR) * KC * MR + r % MR;
            for (int64_t k = 0; k < kc; k++)
                dst[k * MR] = row[k];
        }
        for (int64_t p = 0; p < np; p++) {
            const float *bpp = j->bp + ((j0 / NR + p) * j->bld + j->boff + k0) * NR;
            for (int64_t g = 0; g < ng; g++)
                j->kern(kc, ap + g * KC * MR, bpp, acc + g * MR * NC + p * NR, NC);
        }
    }
    j->put(j->pctx, i0, ni, j0, nj, acc);
out:
    free(ap);
    free(row);
    free(acc);
    return rc;
}

static int nt_run(nt_job *j, df_pool *pool, const char *what, df_err *e)
{
    j->njb = cdiv(j->m, NC);
    j->kern = pick_kern();
    if (j->n == 0 || j->m == 0)
        return 0;
    int rc = df_pool_for(pool, (size_t)(cdiv(j->n, MC) * j->njb), nt_task, j);
    return rc ? df_errf(e, rc, "%s: out of memory for a task's tiles", what) : 0;
}

typedef struct dmat_src { /* rows of a row-major double matrix, as f32 */
    const double *a;
    int64_t ld, off;
} dmat_src;

static void dmat_get(const void *ctx, int64_t row, int64_t k0, int64_t kc, float *dst)
{
    const dmat_src *s = ctx;
    const double *p = s->a + row * s->ld + s->off + k0;
    for (int64_t k = 0; k < kc; k++)
        dst[k] = (float)p[k];
}

typedef struct fmat_src { /* rows of a row-major f32 matrix */
    const float *a;
    int64_t ld, off;
} fmat_src;

static void fmat_get(const void *ctx, int64_t row, int64_t k0, int64_t kc, float *dst)
{
    const fmat_src *s = ctx;
    memcpy(dst, s->a + row * s->ld + s->off + k0, (size_t)kc * sizeof(float));
}

/* Panels of the rows of a matrix given by a getter (m x kd):
 * [cdiv(m,16)][kd][16], lanes past m zero. Blocks of 256 columns, so the
 * panel being written stays in L1. */
typedef struct panel_job {
    get_fn get;
    const void *gctx;
    int64_t m, kd;
    float *dst;
} panel_job;

static int panel_task(void *arg, size_t p)
{
    panel_job *j = arg;
    float *dst = j->dst + (int64_t)p * j->kd * NR, buf[256];
    for (int64_t k0 = 0; k0 < j->kd; k0 += 256) {
        int64_t kc = imin(256, j->kd - k0);
        for (int c = 0; c < NR; c++) {
            int64_t r = (int64_t)p * NR + c;
            if (r < j->m)
                j->get(j->gctx, r, k0, kc, buf);
            else
                memset(buf, 0, sizeof buf);
            for (int64_t k = 0; k < kc; k++)
                dst[(k0 + k) * NR + c] = buf[k];
        }
    }
    return 0;
}

/* Fills dst (cdiv(m,16)*16*kd floats, 64-byte aligned) with the panels. */
static void pack_panels(get_fn get, const void *gctx, int64_t m, int64_t kd, float *dst,
                        df_pool *pool)
{
    panel_job j = {get, gctx, m, kd, dst};
    df_pool_for(pool, (size_t)cdiv(m, NR), panel_task, &j);
}

/* ---- projection ---- */

/* double -> bf16, round to nearest even, without double rounding: the f32
 * intermediate is made round-to-odd (f32 has more than 8 + 2 bits). */
static uint16_t bf16_from_double(double v)
{
    float f = (float)v;
    if (isfinite(f) && (double)f != v) {
        uint32_t u;
        memcpy(&u, &f, 4);
        if (fabs((double)f) > fabs(v)) /* rounded away from zero: one step back */
            u -= 1;
        u |= 1;
        memcpy(&f, &u, 4);
    }
    return df_f32_to_bf16(f);
}

/* The projection runs as Z^T = P X^T: A = P's rows (packed per task, a
 * cost of 1/(2*NC) of the flops), B = the tokens, converted and packed in
 * panels once per chunk of PT tokens (a pass over the input it needs
 * anyway), so no persistent copy of P is needed and a call of a few tokens
 * costs about one read of P. */
enum { PT = 512 };

typedef struct proj_out {
    void *z; /* the chunk's first row */
    int bf16;
    int64_t R;
} proj_out;

static void proj_put(void *ctx, int64_t i0, int64_t ni, int64_t j0, int64_t nj, const double *acc)
{
    proj_out *o = ctx; /* acc[i][c] = z[token j0 + c][component i0 + i] */
    for (int64_t c = 0; c < nj; c++) {
        if (o->bf16) {
            uint16_t *z = (uint16_t *)o->z + (j0 + c) * o->R + i0;
            for (int64_t i = 0; i < ni; i++)
                z[i] = bf16_from_double(acc[i * NC + c]);
        } else {
            float *z = (float *)o->z + (j0 + c) * o->R + i0;
            for (int64_t i = 0; i < ni; i++)
                z[i] = (float)acc[i * NC + c];
        }
    }
}

typedef struct src_off { /* the token rows from t0 on */
    const rows_src *src;
    int64_t t0;
} src_off;

static void src_off_get(const void *ctx, int64_t t, int64_t k0, int64_t kc, float *dst)
{
    const src_off *s = ctx;
    src_get(s->src, s->t0 + t, k0, kc, dst);
}

static int project(const df_basis *b, const rows_src *src, int64_t n, void *z, int bf16,
                   df_pool *pool, const char *what, df_err *e)
{
    if (!b->P)
        return df_errf(e, -EINVAL, "%s: empty basis", what);
    if (src->K != b->K || src->H != b->H)
        return df_errf(e, -DF_EMISMATCH, "%s: %d layers of %d, the basis is of %d layers of %d",
                       what, src->K, src->H, b->K, b->H);
    if (n < 0 || (n > 0 && (!src->layers || !z)))
        return df_errf(e, -EINVAL, "%s: n_rows = %lld with no input or output", what,
                       (long long)n);
    if (n == 0)
        return 0;
    int64_t D = b->D, R = b->R;
    float *xp = alloc64((size_t)(cdiv(imin(n, PT), NR) * NR * D) * sizeof(float));
    if (!xp)
        return df_errf(e, -ENOMEM, "%s: out of memory for %d packed tokens of %lld", what, PT,
                       (long long)D);
    fmat_src ps = {b->P, D, 0};
    int rc = 0;
    for (int64_t t0 = 0; t0 < n && !rc; t0 += PT) {
        int64_t nt = imin(PT, n - t0);
        src_off so = {src, t0};
        pack_panels(src_off_get, &so, nt, D, xp, pool);
        proj_out o = {bf16 ? (void *)((uint16_t *)z + t0 * R) : (void *)((float *)z + t0 * R),
                      bf16, R};
        nt_job j = {.n = R, .m = nt, .kd = D, .get = fmat_get, .gctx = &ps, .bp = xp, .bld = D,
                    .put = proj_put, .pctx = &o};
        rc = nt_run(&j, pool, what, e);
    }
    free(xp);
    return rc;
}

int df_basis_project_bf16(const df_basis *b, const uint16_t *const *layers, int K, int H,
                          int64_t n_rows, uint16_t *z, df_pool *pool, df_err *e)
{
    rows_src s = {(const void *const *)layers, 1, K, H, H};
    return project(b, &s, n_rows, z, 1, pool, "df_basis_project_bf16", e);
}

int df_basis_project_f32(const df_basis *b, const float *const *layers, int K, int H,
                         int64_t n_rows, float *z, df_pool *pool, df_err *e)
{
    rows_src s = {(const void *const *)layers, 0, K, H, H};
    return project(b, &s, n_rows, z, 0, pool, "df_basis_project_f32", e);
}

int df_basis_merge(const df_basis *b, const float *fc_r, int rows, float *fc, df_pool *pool,
                   df_err *e)
{
    if (!b->P || rows < 0 || (rows > 0 && (!fc_r || !fc)))
        return df_errf(e, -EINVAL, "df_basis_merge: empty basis or no matrices (rows %d)", rows);
    mul_job j = {.n = rows, .m = b->R, .D = b->D, .w32 = fc_r, .ldw = b->R, .B = b->P,
                 .ldb = b->D, .y32 = fc, .ldy = b->D};
    return mul_run(&j, pool, "df_basis_merge", e);
}

int df_basis_unproject(const df_basis *b, const float *z, int64_t n_rows, float *x_hat,
                       df_pool *pool, df_err *e)
{
    if (!b->P || n_rows < 0 || (n_rows > 0 && (!z || !x_hat)))
        return df_errf(e, -EINVAL, "df_basis_unproject: empty basis or no matrices (n_rows %lld)",
                       (long long)n_rows);
    mul_job j = {.n = n_rows, .m = b->R, .D = b->D, .w32 = z, .ldw = b->R, .B = b->P,
                 .ldb = b->D, .y32 = x_hat, .ldy = b->D};
    return mul_run(&j, pool, "df_basis_unproject", e);
}

/* ---- orthonormality (file reader, serializer, from_rows) ---- */

/* code with a message when P (R x D at file offset p_off) is not finite with
 * orthonormal rows (basis.h, df_basis_parse). */
static int check_orthonormal(const float *P, int64_t R, int64_t D, const char *name,
                             uint64_t p_off, int code, df_err *e)
{
    for (int64_t r = 0; r < R; r++) {
        const float *p = P + r * D;
        double s = 0;
        for (int64_t i = 0; i < D; i++) {
            if (!isfinite(p[i]))
                return df_errf(e, code, "%s: P[%lld][%lld] (offset %llu) is not finite", name,
                               (long long)r, (long long)i,
                               (unsigned long long)(p_off + 4 * (uint64_t)(r * D + i)));
            s += (double)p[i] * p[i];
        }
        if (!(fabs(s - 1) <= 1e-4))
            return df_errf(e, code, "%s: P row %lld (offset %llu) has squared norm %.9g, not 1",
                           name, (long long)r, (unsigned long long)(p_off + 4 * (uint64_t)(r * D)),
                           s);
    }
    double *u = malloc(sizeof(double) * (size_t)R), *w = malloc(sizeof(double) * (size_t)D);
    int rc = 0;
    if (!u || !w) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory for the orthonormality check", name);
        goto out;
    }
    for (uint64_t probe = 1; probe <= 2 && !rc; probe++) {
        uint64_t s = probe * 0x9E3779B97F4A7C15ull;
        for (int64_t r = 0; r < R; r++) { /* splitmix64 signs */
            uint64_t z = (s += 0x9E3779B97F4A7C15ull);
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
            z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
            u[r] = ((z ^ (z >> 31)) & 1) ? 1.0 : -1.0;
        }
        memset(w, 0, sizeof(double) * (size_t)D);
        for (int64_t r = 0; r < R; r++) /* w = P^T u */
            for (int64_t i = 0; i < D; i++)
                w[i] += u[r] * P[r * D + i];
        double err = 0;
        for (int64_t r = 0; r < R; r++) { /* |P w - u|^2 */
            double v = 0;
            for (int64_t i = 0; i < D; i++)
                v += (double)P[r * D + i] * w[i];
            err += (v - u[r]) * (v - u[r]);
        }
        err = sqrt(err / (double)R);
        if (!(err <= 1e-3))
            rc = df_errf(e, code, "%s: P's rows (offset %llu) are not orthonormal: "
                         "|P P^T u - u| = %.3g |u| for probe %llu", name,
                         (unsigned long long)p_off, err, (unsigned long long)probe);
    }
out:
    free(u);
    free(w);
    return rc;
}

/* ---- bases from a matrix's row space ---- */

int df_basis_from_rows(const float *A, int rows, int K, int H, const int32_t *layer_ids,
                       int R, double energy, df_pool *pool, df_basis *out, df_err *e)
{
    const char *what = "df_basis_from_rows";
    memset(out, 0, sizeof *out);
    int rc = check_shape(K, H, what, e);
    if (rc)
        return rc;
    int D = K * H;
    if (rows < 1 || !A)
        return df_errf(e, -EINVAL, "%s: rows = %d, must be >= 1", what, rows);
    if ((rc = check_rank_rule(R, energy, D, what, e)) < 0)
        return rc;
    const void *lay[DF_BASIS_MAX_LAYERS];
    for (int k = 0; k < K; k++)
        lay[k] = A + (int64_t)k * H;
    rows_src src = {lay, 0, K, H, D};
    if ((rc = src_check_finite(&src, rows, what, pool, e)) < 0)
        return rc;
    if (rows > D) { /* the D x D moment of the rows is the smaller problem */
        df_moment mm;
        if ((rc = df_moment_init(&mm, K, H, layer_ids, e)) < 0)
            return rc;
        rc = moment_add_src(&mm, &src, rows, pool, what, e);
        if (!rc)
            rc = df_basis_fit(&mm, R, energy, out, e);
        df_moment_free(&mm);
        if (!rc)
            out->kind = DF_BASIS_KIND_ROWS;
        return rc;
    }
    /* Gram G = A A^T in double (f32 products are exact in double), its
     * eigenpairs U, lam, then P = lam^-1/2 U^T A: the right singular vectors. */
    int64_t n = rows;
    double *G = malloc(sizeof(double) * (size_t)(n * n)), *lam = malloc(sizeof(double) * (size_t)n);
    double *Z = malloc(sizeof(double) * (size_t)(n * n)), *W = NULL;
    float *AT = malloc(sizeof(float) * (size_t)(n * D));
    if (!G || !lam || !Z || !AT) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory for the %d x %d Gram matrix", what, rows, rows);
        goto out;
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t d = 0; d < D; d++)
            AT[d * n + i] = A[i * D + d];
    mul_job mj = {.n = n, .m = D, .D = n, .w32 = A, .ldw = D, .B = AT, .ldb = n, .y64 = G,
                  .ldy = n};
    if ((rc = mul_run(&mj, pool, what, e)) < 0)
        goto out;
    free(AT);
    AT = NULL;
    double total = 0, layer_energy[DF_BASIS_MAX_LAYERS] = {0};
    for (int64_t i = 0; i < n; i++)
        for (int64_t d = 0; d < D; d++) {
            double v = A[i * D + d];
            layer_energy[d / H] += v * v;
        }
    for (int k = 0; k < K; k++)
        total += layer_energy[k];
    if (!(total > 0)) {
        rc = df_errf(e, -EINVAL, "%s: the matrix is zero", what);
        goto out;
    }
    if ((rc = lapack_eig(G, rows, 0, 0, lam, Z, e)) < 0)
        goto out;
    /* descending: lam_d[r] = lam[n-1-r], vector = column n-1-r of Z */
    double top = lam[n - 1];
    int rank = 0;
    while (rank < rows && lam[n - 1 - rank] > 1e-6 * top)
        rank++;
    if (R > rank) {
        rc = df_errf(e, -EINVAL, "%s: R = %d exceeds the numerical rank %d of the %d x %d matrix "
                     "(singular values above 1e-3 of the largest)", what, R, rank, rows, D);
        goto out;
    }
    if (R == 0) {
        double *ld = malloc(sizeof(double) * (size_t)rank);
        if (!ld) {
            rc = df_errf(e, -ENOMEM, "%s: out of memory", what);
            goto out;
        }
        for (int r = 0; r < rank; r++)
            ld[r] = lam[n - 1 - r];
        R = rank_for_energy(ld, rank, total, energy);
        free(ld);
    }
    if (!(W = malloc(sizeof(double) * (size_t)R * (size_t)n))) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory", what);
        goto out;
    }
    for (int64_t r = 0; r < R; r++) {
        double l = lam[n - 1 - r], s = 1 / sqrt(l);
        const double *u = Z + (n - 1 - r) * n;
        for (int64_t i = 0; i < n; i++)
            W[r * n + i] = u[i] * s;
    }
    if ((rc = df_basis_init(out, K, H, R, layer_ids, e)) < 0)
        goto out;
    mul_job pj = {.n = R, .m = n, .D = D, .w64 = W, .ldw = n, .B = A, .ldb = D, .y32 = out->P,
                  .ldy = D};
    if ((rc = mul_run(&pj, pool, what, e)) < 0)
        goto out;
    for (int r = 0; r < R; r++)
        out->eigval[r] = lam[n - 1 - r];
    out->kind = DF_BASIS_KIND_ROWS;
    out->n_rows = rows;
    out->total_energy = total;
    memcpy(out->layer_energy, layer_energy, sizeof layer_energy);
    df_basis_canonicalize(out);
    df_basis_stats_from_eigen(out);
    rc = check_orthonormal(out->P, R, D, what, 0, -EDOM, e);
out:
    if (rc)
        df_basis_free(out);
    free(G);
    free(lam);
    free(Z);
    free(W);
    free(AT);
    return rc;
}

/* ---- evaluation of any basis against a moment ---- */

typedef struct store_out { /* acc -> double matrix, optionally transposed */
    double *c;
    int64_t ld;
    int trans;
} store_out;

static void store_put(void *ctx, int64_t i0, int64_t ni, int64_t j0, int64_t nj, const double *acc)
{
    store_out *o = ctx;
    for (int64_t i = 0; i < ni; i++)
        for (int64_t c = 0; c < nj; c++) {
            if (o->trans)
                o->c[(j0 + c) * o->ld + i0 + i] = acc[i * NC + c];
            else
                o->c[(i0 + i) * o->ld + j0 + c] = acc[i * NC + c];
        }
}

typedef struct dot_out { /* per task: sum_ij acc[i][j] G[j][i] */
    const double *G;
    int64_t ld, njb;
    double *part;
} dot_out;

static void dot_put(void *ctx, int64_t i0, int64_t ni, int64_t j0, int64_t nj, const double *acc)
{
    dot_out *o = ctx;
    double s = 0;
    for (int64_t i = 0; i < ni; i++)
        for (int64_t c = 0; c < nj; c++)
            s += acc[i * NC + c] * o->G[(j0 + c) * o->ld + i0 + i];
    o->part[(i0 / MC) * o->njb + j0 / NC] = s;
}

int df_basis_eval(const df_basis *b, const df_moment *m, double *kept, double *layer_kept,
                  df_pool *pool, df_err *e)
{
    const char *what = "df_basis_eval";
    if (!b->P || b->D != m->D || b->K != m->K || b->H != m->H)
        return df_errf(e, -DF_EMISMATCH, "%s: a basis of %d layers of %d, a moment of %d of %d",
                       what, b->K, b->H, m->K, m->H);
    if (!m->m || m->n_rows <= 0)
        return df_errf(e, -EINVAL, "%s: the moment holds no rows", what);
    int64_t D = b->D, R = b->R, H = b->H;
    double total = 0, lay_e[DF_BASIS_MAX_LAYERS] = {0}, a[DF_BASIS_MAX_LAYERS] = {0};
    for (int64_t i = 0; i < D; i++) {
        total += m->m[i * D + i];
        lay_e[i / H] += m->m[i * D + i];
    }
    if (!(total > 0))
        return df_errf(e, -EINVAL, "%s: the moment has no energy", what);
    float *pp = alloc64((size_t)(cdiv(R, NR) * NR * D) * sizeof(float));
    double *C = malloc(sizeof(double) * (size_t)(R * D)), *G = NULL, *part = NULL;
    int rc = 0;
    if (!C || !pp) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory for %lld x %lld doubles", what,
                     (long long)R, (long long)D);
        goto out;
    }
    fmat_src prow = {b->P, D, 0};
    pack_panels(fmat_get, &prow, R, D, pp, pool);
    /* C = P M (R x D), as C^T = M P^T over M's rows (mirrored: all of it) */
    mirror_upper(m->m, D);
    dmat_src ms = {m->m, D, 0};
    store_out co = {C, D, 1};
    nt_job j1 = {.n = D, .m = R, .kd = D, .get = dmat_get, .gctx = &ms, .bp = pp, .bld = D,
                 .put = store_put, .pctx = &co};
    if ((rc = nt_run(&j1, pool, what, e)) < 0)
        goto out;
    /* a_k = sum over layer k's columns i of (P^T P M)_ii = sum_r P[r][i] C[r][i] */
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < D; i++)
            a[i / H] += (double)b->P[r * D + i] * C[r * D + i];
    double sum = 0;
    for (int k = 0; k < b->K; k++)
        sum += a[k];
    *kept = sum / total;
    if (!layer_kept)
        goto out;
    /* G = P M P^T = C P^T (R x R); b_k = sum_i in layer k of (P^T G P)_ii
     * = sum_rs G[r][s] L_k[s][r] with L_k = P_k P_k^T over layer k's columns */
    G = malloc(sizeof(double) * (size_t)(R * R));
    part = malloc(sizeof(double) * (size_t)(cdiv(R, MC) * cdiv(R, NC)));
    if (!G || !part) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory", what);
        goto out;
    }
    dmat_src cs = {C, D, 0};
    store_out go = {G, R, 0};
    nt_job j2 = {.n = R, .m = R, .kd = D, .get = dmat_get, .gctx = &cs, .bp = pp, .bld = D,
                 .put = store_put, .pctx = &go};
    if ((rc = nt_run(&j2, pool, what, e)) < 0)
        goto out;
    for (int k = 0; k < b->K; k++) {
        fmat_src ps = {b->P, D, k * H};
        dot_out dout = {G, R, cdiv(R, NC), part};
        nt_job j3 = {.n = R, .m = R, .kd = H, .get = fmat_get, .gctx = &ps, .bp = pp, .bld = D,
                     .boff = k * H, .put = dot_put, .pctx = &dout};
        if ((rc = nt_run(&j3, pool, what, e)) < 0)
            goto out;
        double bk = 0;
        for (int64_t t = 0; t < cdiv(R, MC) * cdiv(R, NC); t++)
            bk += part[t];
        layer_kept[k] = lay_e[k] > 0 ? (2 * a[k] - bk) / lay_e[k] : 1.0;
    }
out:
    free(pp);
    free(C);
    free(G);
    free(part);
    return rc;
}

/* ---- file ---- */

/* Byte offsets of a file's sections (docs/FORMAT-basis.md). */
typedef struct layout {
    uint64_t ids, lenergy, lkept, eig, P, crc, total;
} layout;

static layout basis_layout(int K, int R, int D)
{
    layout l;
    l.ids = DF_BASIS_HEADER_BYTES;
    l.lenergy = l.ids + 8 * (uint64_t)((K + 1) / 2);
    l.lkept = l.lenergy + 8 * (uint64_t)K;
    l.eig = l.lkept + 8 * (uint64_t)K;
    l.P = l.eig + 8 * (uint64_t)R;
    l.crc = l.P + 4 * (uint64_t)R * (uint64_t)D;
    l.total = l.crc + 4;
    return l;
}

uint64_t df_basis_file_bytes(int K, int R, int D)
{
    return basis_layout(K, R, D).total;
}

static double get_f64(const uint8_t *p)
{
    uint64_t u = df_le64(p);
    double d;
    memcpy(&d, &u, 8);
    return d;
}

static void put_f64(uint8_t *p, double d)
{
    uint64_t u;
    memcpy(&u, &d, 8);
    df_put64(p, u);
}

/* Checks everything of a basis but P's orthonormality (code and offsets as
 * a parse of a file with layout l would report them). */
static int check_fields(const df_basis *b, const layout *l, const char *name, int code,
                        df_err *e)
{
    if (b->kind != DF_BASIS_KIND_MOMENT && b->kind != DF_BASIS_KIND_ROWS)
        return df_errf(e, code, "%s: kind %d (offset 16), must be 1 or 2", name, b->kind);
    if (b->n_rows < 1)
        return df_errf(e, code, "%s: n_rows %lld (offset 40), must be >= 1", name,
                       (long long)b->n_rows);
    if (!(b->total_energy > 0) || !isfinite(b->total_energy))
        return df_errf(e, code, "%s: total energy %g (offset 48), must be finite and > 0", name,
                       b->total_energy);
    if (!(b->kept >= -1e-6 && b->kept <= 1 + 1e-6))
        return df_errf(e, code, "%s: kept fraction %g (offset 56), must be in [0, 1]", name,
                       b->kept);
    for (int k = 0; k < b->K; k++) {
        if (b->layer_ids[k] < 0)
            return df_errf(e, code, "%s: layer id %d (offset %llu) is negative", name,
                           b->layer_ids[k], (unsigned long long)(l->ids + 4 * (uint64_t)k));
        for (int q = 0; q < k; q++)
            if (b->layer_ids[q] == b->layer_ids[k])
                return df_errf(e, code, "%s: layer id %d (offset %llu) is repeated", name,
                               b->layer_ids[k], (unsigned long long)(l->ids + 4 * (uint64_t)k));
        if (!(b->layer_energy[k] >= 0) || !isfinite(b->layer_energy[k]))
            return df_errf(e, code, "%s: layer %d's energy %g (offset %llu), must be finite and "
                           ">= 0", name, k, b->layer_energy[k],
                           (unsigned long long)(l->lenergy + 8 * (uint64_t)k));
        if (!(b->layer_kept[k] >= -1e-6 && b->layer_kept[k] <= 1 + 1e-6))
            return df_errf(e, code, "%s: layer %d's kept fraction %g (offset %llu), must be in "
                           "[0, 1]", name, k, b->layer_kept[k],
                           (unsigned long long)(l->lkept + 8 * (uint64_t)k));
    }
    for (int r = 0; r < b->R; r++)
        if (!isfinite(b->eigval[r]) || (r > 0 && b->eigval[r] > b->eigval[r - 1]))
            return df_errf(e, code, "%s: eigenvalue %d = %g (offset %llu) is %s", name, r,
                           b->eigval[r], (unsigned long long)(l->eig + 8 * (uint64_t)r),
                           isfinite(b->eigval[r]) ? "above the one before it" : "not finite");
    return 0;
}

int df_basis_serialize(const df_basis *b, uint8_t **buf, size_t *len, df_err *e)
{
    *buf = NULL, *len = 0;
    const char *what = "df_basis_serialize";
    int rc = check_shape(b->K, b->H, what, e);
    if (rc)
        return rc;
    if (b->D != b->K * b->H || b->R < 1 || b->R > b->D || !b->P || !b->eigval)
        return df_errf(e, -EINVAL, "%s: D %d, R %d, K %d, H %d: not a basis", what, b->D, b->R,
                       b->K, b->H);
    layout l = basis_layout(b->K, b->R, b->D);
    if ((rc = check_fields(b, &l, what, -EINVAL, e)) < 0 ||
        (rc = check_orthonormal(b->P, b->R, b->D, what, l.P, -EINVAL, e)) < 0)
        return rc;
    uint8_t *p = calloc(1, (size_t)l.total);
    if (!p)
        return df_errf(e, -ENOMEM, "%s: out of memory for %llu bytes", what,
                       (unsigned long long)l.total);
    memcpy(p, DF_BASIS_MAGIC, 8);
    df_put32(p + 8, DF_BASIS_VERSION);
    df_put32(p + 12, DF_BASIS_HEADER_BYTES);
    df_put32(p + 16, (uint32_t)b->kind);
    df_put32(p + 20, (uint32_t)b->D);
    df_put32(p + 24, (uint32_t)b->R);
    df_put32(p + 28, (uint32_t)b->K);
    df_put32(p + 32, (uint32_t)b->H);
    df_put64(p + 40, (uint64_t)b->n_rows);
    put_f64(p + 48, b->total_energy);
    put_f64(p + 56, b->kept);
    for (int k = 0; k < b->K; k++) {
        df_put32(p + l.ids + 4 * k, (uint32_t)b->layer_ids[k]);
        put_f64(p + l.lenergy + 8 * k, b->layer_energy[k]);
        put_f64(p + l.lkept + 8 * k, b->layer_kept[k]);
    }
    for (int r = 0; r < b->R; r++)
        put_f64(p + l.eig + 8 * (uint64_t)r, b->eigval[r]);
    const size_t np = (size_t)b->R * (size_t)b->D;
    for (size_t i = 0; i < np; i++) {
        uint32_t u;
        memcpy(&u, b->P + i, 4);
        df_put32(p + l.P + 4 * i, u);
    }
    df_put32(p + l.crc, df_crc32c(0, p, (size_t)l.crc));
    *buf = p, *len = (size_t)l.total;
    return 0;
}

int df_basis_write(const df_basis *b, const char *path, df_err *e)
{
    uint8_t *buf;
    size_t len;
    int rc = df_basis_serialize(b, &buf, &len, e);
    if (rc) {
        df_err_wrap(e, "%s", path);
        return rc;
    }
    rc = df_file_write_atomic(path, buf, len, e);
    free(buf);
    return rc;
}

/* The fixed header: magic, version, sizes, and the file length they imply
 * (== len). Fills the shape of *h. */
static int parse_header(const uint8_t *p, uint64_t len, const char *name, df_basis *h,
                        df_err *e)
{
    if (len < DF_BASIS_HEADER_BYTES)
        return df_errf(e, -DF_ECORRUPT, "%s: %llu bytes, shorter than the %u-byte header", name,
                       (unsigned long long)len, DF_BASIS_HEADER_BYTES);
    if (memcmp(p, DF_BASIS_MAGIC, 8))
        return df_errf(e, -DF_ECORRUPT, "%s: bad magic (offset 0): not a basis file", name);
    uint32_t ver = df_le32(p + 8), hb = df_le32(p + 12);
    if (ver != DF_BASIS_VERSION)
        return df_errf(e, -DF_EVERSION, "%s: version %u (offset 8), this reader knows %u", name,
                       ver, DF_BASIS_VERSION);
    if (hb != DF_BASIS_HEADER_BYTES)
        return df_errf(e, -DF_ECORRUPT, "%s: header size %u (offset 12), must be %u", name, hb,
                       DF_BASIS_HEADER_BYTES);
    uint32_t kind = df_le32(p + 16), D = df_le32(p + 20), R = df_le32(p + 24);
    uint32_t K = df_le32(p + 28), H = df_le32(p + 32), res = df_le32(p + 36);
    if (K < 1 || K > DF_BASIS_MAX_LAYERS)
        return df_errf(e, -DF_ECORRUPT, "%s: K = %u (offset 28), must be in [1, %d]", name, K,
                       DF_BASIS_MAX_LAYERS);
    if (H < 1 || (uint64_t)K * H > DF_BASIS_MAX_DIM || D != K * H)
        return df_errf(e, -DF_ECORRUPT, "%s: D = %u, H = %u (offsets 20, 32) with K = %u: need "
                       "D = K*H in [1, %d]", name, D, H, K, DF_BASIS_MAX_DIM);
    if (R < 1 || R > D)
        return df_errf(e, -DF_ECORRUPT, "%s: R = %u (offset 24), must be in [1, %u]", name, R, D);
    if (res != 0)
        return df_errf(e, -DF_ECORRUPT, "%s: reserved field %u (offset 36), must be 0", name, res);
    uint64_t want = df_basis_file_bytes((int)K, (int)R, (int)D);
    if (len != want)
        return df_errf(e, -DF_ECORRUPT, "%s: %llu bytes, its header (D %u, R %u, K %u) says %llu",
                       name, (unsigned long long)len, D, R, K, (unsigned long long)want);
    memset(h, 0, sizeof *h);
    h->kind = (int)kind, h->D = (int)D, h->R = (int)R, h->K = (int)K, h->H = (int)H;
    return 0;
}

int df_basis_parse(const uint8_t *buf, size_t len, const char *name, df_basis *out, df_err *e)
{
    df_basis h;
    memset(out, 0, sizeof *out);
    int rc = parse_header(buf, len, name, &h, e);
    if (rc)
        return rc;
    layout l = basis_layout(h.K, h.R, h.D);
    uint32_t want = df_le32(buf + l.crc), got = df_crc32c(0, buf, (size_t)l.crc);
    if (want != got)
        return df_errf(e, -DF_ECORRUPT, "%s: CRC32C mismatch (offset %llu): stored %08x, computed "
                       "%08x", name, (unsigned long long)l.crc, want, got);
    if (h.K % 2 && df_le32(buf + l.ids + 4 * (uint64_t)h.K))
        return df_errf(e, -DF_ECORRUPT, "%s: padding after the layer ids (offset %llu) is not 0",
                       name, (unsigned long long)(l.ids + 4 * (uint64_t)h.K));
    if ((rc = df_basis_init(out, h.K, h.H, h.R, NULL, e)) < 0)
        return rc;
    out->kind = h.kind;
    out->n_rows = (int64_t)df_le64(buf + 40);
    out->total_energy = get_f64(buf + 48);
    out->kept = get_f64(buf + 56);
    for (int k = 0; k < h.K; k++) {
        out->layer_ids[k] = (int32_t)df_le32(buf + l.ids + 4 * k);
        out->layer_energy[k] = get_f64(buf + l.lenergy + 8 * k);
        out->layer_kept[k] = get_f64(buf + l.lkept + 8 * k);
    }
    for (int r = 0; r < h.R; r++)
        out->eigval[r] = get_f64(buf + l.eig + 8 * (uint64_t)r);
    const size_t np = (size_t)h.R * (size_t)h.D;
    for (size_t i = 0; i < np; i++) {
        uint32_t u = df_le32(buf + l.P + 4 * i);
        memcpy(out->P + i, &u, 4);
    }
    if ((rc = check_fields(out, &l, name, -DF_ECORRUPT, e)) < 0 ||
        (rc = check_orthonormal(out->P, h.R, h.D, name, l.P, -DF_ECORRUPT, e)) < 0)
        df_basis_free(out);
    return rc;
}

static int read_at(int fd, void *buf, size_t n, uint64_t off, const char *path, df_err *e)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, (uint8_t *)buf + got, n - got, (off_t)(off + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return df_errf(e, r < 0 ? -errno : -DF_ECORRUPT, "%s: read failed at offset %llu%s",
                           path, (unsigned long long)(off + got), r < 0 ? "" : " (file shrank)");
        got += (size_t)r;
    }
    return 0;
}

int df_basis_read(const char *path, df_basis *out, df_err *e)
{
    memset(out, 0, sizeof *out);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return df_errf(e, -errno, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    uint8_t hdr[DF_BASIS_HEADER_BYTES] = {0}, *buf = NULL;
    int rc = 0;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        rc = df_errf(e, -EINVAL, "%s: not a regular file", path);
        goto out;
    }
    uint64_t len = (uint64_t)st.st_size;
    df_basis h;
    /* The header's sizes must match the file's before anything big is read
     * (a file shorter than the header is reported by parse_header). */
    if ((len >= DF_BASIS_HEADER_BYTES && (rc = read_at(fd, hdr, sizeof hdr, 0, path, e)) < 0) ||
        (rc = parse_header(hdr, len, path, &h, e)) < 0)
        goto out;
    if (!(buf = malloc((size_t)len))) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory for %llu bytes", path, (unsigned long long)len);
        goto out;
    }
    if ((rc = read_at(fd, buf, (size_t)len, 0, path, e)) < 0)
        goto out;
    rc = df_basis_parse(buf, (size_t)len, path, out, e);
out:
    free(buf);
    close(fd);
    return rc;
}

int df_basis_sha256(const char *path, char hex[DF_SHA256_HEX], df_err *e)
{
    return df_sha256_file(path, hex, e);
}
