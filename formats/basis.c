/* basis.c - second moment, eigenbasis fit, projection, merge and bases from
 * a matrix's row space (contracts in basis.h). The blocked products are in
 * basis_gemm.c, the evaluation in basis_eval.c, the extension in
 * basis_extend.c, the file basis.dfb (and the orthonormality check) in
 * basis_file.c.
 *
 * Three compute engines, all split over a df_pool in independent tasks:
 *  - the moment (here): M += X^T X for chunks of <= 256 rows, upper-triangle
 *    tiles of 6 x 16, f32 register tiles (AVX2+FMA when the CPU has it)
 *    added into the double M once per chunk;
 *  - "NT" (basis_gemm.c): C = A B^T with A's rows fetched (and converted) by
 *    a callback and B pre-packed in 16-row panels, the same 6 x 16 f32
 *    kernel, f32 sums per 256 terms added into a double tile: the projection
 *    and df_basis_eval;
 *  - "mul" (basis_gemm.c): Y = W B in double (4 x 8 AVX2 double tiles):
 *    merge, unproject, the Gram matrix and the rows of df_basis_from_rows,
 *    where the brief is exactness rather than speed.
 * Eigendecompositions are LAPACK's dsyevr. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "basis_internal.h"
#include "dtype.h"

/* LAPACK, Fortran calling convention (LP64: 32-bit integers), declared here
 * (no lapacke header); the trailing size_t are the hidden lengths of the
 * character arguments that gfortran-built libraries expect. */
extern void dsyevr_(const char *jobz, const char *range, const char *uplo, const int *n,
                    double *a, const int *lda, const double *vl, const double *vu,
                    const int *il, const int *iu, const double *abstol, int *m, double *w,
                    double *z, const int *ldz, int *isuppz, double *work, const int *lwork,
                    int *iwork, const int *liwork, int *info, size_t jobz_len,
                    size_t range_len, size_t uplo_len);

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

int df_moment_check_finite_bf16(const uint16_t *const *layers, int K, int H, int64_t n_rows,
                                df_pool *pool, const char *what, df_err *e)
{
    if (n_rows <= 0)
        return 0;
    rows_src s = {(const void *const *)layers, 1, K, H, H};
    return src_check_finite(&s, n_rows, what, pool, e);
}

/* ---- second moment ---- */

int df_basis_check_shape(int K, int H, const char *what, df_err *e)
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
    int rc = df_basis_check_shape(K, H, "df_moment_init", e);
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
                 .kern = df_basis_pick_kern()};
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

int df_moment_check_add(const df_moment *m, int K, int H, int64_t n, const void *layers,
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
    int rc = df_moment_check_add(m, K, H, n_rows, layers, "df_moment_add_bf16", e);
    if (rc)
        return rc;
    rows_src s = {(const void *const *)layers, 1, K, H, H};
    return moment_add_src(m, &s, n_rows, pool, "df_moment_add_bf16", e);
}

int df_moment_add_f32(df_moment *m, const float *const *layers, int K, int H, int64_t n_rows,
                      df_pool *pool, df_err *e)
{
    int rc = df_moment_check_add(m, K, H, n_rows, layers, "df_moment_add_f32", e);
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
void df_basis_mirror_upper(double *M, int64_t D)
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
    int rc = df_basis_check_shape(K, H, "df_basis_init", e);
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

/* R fixed in [1, D] with energy 0, or R 0 with energy in (0, 1] (basis.h). */
int df_basis_check_rank_rule(int R, double energy, int D, const char *what, df_err *e)
{
    if (R > 0 && R <= D && energy == 0)
        return 0;
    if (R == 0 && energy > 0 && energy <= 1)
        return 0;
    return df_errf(e, -EINVAL, "%s: R = %d, energy = %g: give R in [1, %d] (energy 0), or R 0 "
                   "and an energy fraction in (0, 1]", what, R, energy, D);
}

/* Smallest r with sum of the top r of lam (descending, n of them) >=
 * (energy - 1e-10) * total; n when none (basis.h). */
int df_basis_rank_for_energy(const double *lam_desc, int n, double total, double energy)
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
    int rc = df_basis_check_rank_rule(R, energy, m->D, "df_basis_fit", e);
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
        df_basis_mirror_upper(A, D);
        rc = lapack_eig(A, D, 0, 0, w, NULL, e);
        for (int64_t i = 0; i < D; i++)
            A[i * D + i] = diag[i];
        if (rc)
            goto out;
        for (int i = 0; i < D / 2; i++) { /* descending */
            double t = w[i];
            w[i] = w[D - 1 - i], w[D - 1 - i] = t;
        }
        R = df_basis_rank_for_energy(w, D, total, energy);
    }
    Z = malloc(sizeof(double) * (size_t)D * (size_t)R);
    if (!Z) {
        rc = df_errf(e, -ENOMEM, "df_basis_fit: out of memory for %d eigenvectors of %d doubles "
                     "(%.2f GB)", R, D, (double)D * R * 8 / 1e9);
        goto out;
    }
    df_basis_mirror_upper(A, D);
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
        df_basis_pack_panels(src_off_get, &so, nt, D, xp, pool);
        proj_out o = {bf16 ? (void *)((uint16_t *)z + t0 * R) : (void *)((float *)z + t0 * R),
                      bf16, R};
        nt_job j = {.n = R, .m = nt, .kd = D, .get = df_basis_fmat_get, .gctx = &ps, .bp = xp,
                    .bld = D, .put = proj_put, .pctx = &o};
        rc = df_basis_nt_run(&j, pool, what, e);
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

int df_basis_project_rows_f32(const df_basis *b, const float *x, int64_t n_rows, float *z,
                              df_pool *pool, df_err *e)
{
    if (!b->P || b->K < 1 || b->K > DF_BASIS_MAX_LAYERS)
        return df_errf(e, -EINVAL, "df_basis_project_rows_f32: empty basis");
    if (n_rows > 0 && (!x || !z))
        return df_errf(e, -EINVAL, "df_basis_project_rows_f32: n_rows = %lld with no input or "
                       "output", (long long)n_rows);
    /* each row holds the K layers side by side: layer k starts at k H, rows D apart */
    const float *layers[DF_BASIS_MAX_LAYERS];
    for (int k = 0; k < b->K; k++)
        layers[k] = x ? x + (int64_t)k * b->H : NULL;
    rows_src s = {(const void *const *)layers, 0, b->K, b->H, b->D};
    return project(b, &s, n_rows, z, 0, pool, "df_basis_project_rows_f32", e);
}

int df_basis_merge(const df_basis *b, const float *fc_r, int rows, float *fc, df_pool *pool,
                   df_err *e)
{
    if (!b->P || rows < 0 || (rows > 0 && (!fc_r || !fc)))
        return df_errf(e, -EINVAL, "df_basis_merge: empty basis or no matrices (rows %d)", rows);
    mul_job j = {.n = rows, .m = b->R, .D = b->D, .w32 = fc_r, .ldw = b->R, .B = b->P,
                 .ldb = b->D, .y32 = fc, .ldy = b->D};
    return df_basis_mul_run(&j, pool, "df_basis_merge", e);
}

int df_basis_unproject(const df_basis *b, const float *z, int64_t n_rows, float *x_hat,
                       df_pool *pool, df_err *e)
{
    if (!b->P || n_rows < 0 || (n_rows > 0 && (!z || !x_hat)))
        return df_errf(e, -EINVAL, "df_basis_unproject: empty basis or no matrices (n_rows %lld)",
                       (long long)n_rows);
    mul_job j = {.n = n_rows, .m = b->R, .D = b->D, .w32 = z, .ldw = b->R, .B = b->P,
                 .ldb = b->D, .y32 = x_hat, .ldy = b->D};
    return df_basis_mul_run(&j, pool, "df_basis_unproject", e);
}

/* ---- bases from a matrix's row space ---- */

int df_basis_from_rows(const float *A, int rows, int K, int H, const int32_t *layer_ids,
                       int R, double energy, df_pool *pool, df_basis *out, df_err *e)
{
    const char *what = "df_basis_from_rows";
    memset(out, 0, sizeof *out);
    int rc = df_basis_check_shape(K, H, what, e);
    if (rc)
        return rc;
    int D = K * H;
    if (rows < 1 || !A)
        return df_errf(e, -EINVAL, "%s: rows = %d, must be >= 1", what, rows);
    if ((rc = df_basis_check_rank_rule(R, energy, D, what, e)) < 0)
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
    if ((rc = df_basis_mul_run(&mj, pool, what, e)) < 0)
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
        R = df_basis_rank_for_energy(ld, rank, total, energy);
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
    if ((rc = df_basis_mul_run(&pj, pool, what, e)) < 0)
        goto out;
    for (int r = 0; r < R; r++)
        out->eigval[r] = lam[n - 1 - r];
    out->kind = DF_BASIS_KIND_ROWS;
    out->n_rows = rows;
    out->total_energy = total;
    memcpy(out->layer_energy, layer_energy, sizeof layer_energy);
    df_basis_canonicalize(out);
    df_basis_stats_from_eigen(out);
    rc = df_basis_check_orthonormal(out->P, R, D, what, 0, -EDOM, e);
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
