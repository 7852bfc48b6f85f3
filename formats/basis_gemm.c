/* basis_gemm.c - the basis module's blocked products (contracts in
 * basis_internal.h); the runners split their work over a df_pool in
 * independent tasks:
 *  - the 6 x 16 f32 register-tile kernel (AVX2+FMA when the CPU has it),
 *    shared by the moment's add (basis.c) and "NT";
 *  - "NT": C = A B^T with A's rows fetched (and converted) by a callback and
 *    B pre-packed in 16-row panels, the same 6 x 16 f32 kernel, f32 sums per
 *    256 terms added into a double tile: the projection and df_basis_eval;
 *  - "mul": Y = W B in double (4 x 8 AVX2 double tiles): merge, unproject,
 *    the Gram matrix and the rows of df_basis_from_rows, where the brief is
 *    exactness rather than speed;
 *  - the packing of NT's B operand into 16-row panels. */
#include <stdlib.h>
#include <string.h>

#include "basis_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DF_X86_SIMD 1
#endif

/* ---- the f32 register-tile kernel (contract in basis_internal.h) ---- */

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

kern_fn df_basis_pick_kern(void)
{
#ifdef DF_X86_SIMD
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return kern_avx2;
#endif
    return kern_c;
}

/* ---- the double kernel (contract in basis_internal.h) ---- */

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

/* ---- "mul" (contract in basis_internal.h) ----
 * A task is HB rows of Y x DB columns; m is walked in slices of RCH, B's
 * slice packed as double [RCH][DB], W's as [HB/MD][RCH][MD]. */
enum { HB = 64, DB = 256, RCH = 256 };

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

int df_basis_mul_run(mul_job *j, df_pool *pool, const char *what, df_err *e)
{
    j->ndb = cdiv(j->D, DB);
    j->kern = pick_dkern();
    if (j->n == 0 || j->D == 0)
        return 0;
    int rc = df_pool_for(pool, (size_t)(cdiv(j->n, HB) * j->ndb), mul_task, j);
    return rc ? df_errf(e, rc, "%s: out of memory for a task's tiles", what) : 0;
}

/* ---- "NT" (contract and tile sizes in basis_internal.h) ---- */

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

int df_basis_nt_run(nt_job *j, df_pool *pool, const char *what, df_err *e)
{
    j->njb = cdiv(j->m, NC);
    j->kern = df_basis_pick_kern();
    if (j->n == 0 || j->m == 0)
        return 0;
    int rc = df_pool_for(pool, (size_t)(cdiv(j->n, MC) * j->njb), nt_task, j);
    return rc ? df_errf(e, rc, "%s: out of memory for a task's tiles", what) : 0;
}

/* ---- NT's A sources and B panels ---- */

void df_basis_dmat_get(const void *ctx, int64_t row, int64_t k0, int64_t kc, float *dst)
{
    const dmat_src *s = ctx;
    const double *p = s->a + row * s->ld + s->off + k0;
    for (int64_t k = 0; k < kc; k++)
        dst[k] = (float)p[k];
}

void df_basis_fmat_get(const void *ctx, int64_t row, int64_t k0, int64_t kc, float *dst)
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
void df_basis_pack_panels(get_fn get, const void *gctx, int64_t m, int64_t kd, float *dst,
                          df_pool *pool)
{
    panel_job j = {get, gctx, m, kd, dst};
    df_pool_for(pool, (size_t)cdiv(m, NR), panel_task, &j);
}

void df_basis_store_put(void *ctx, int64_t i0, int64_t ni, int64_t j0, int64_t nj,
                        const double *acc)
{
    df_basis_store_out *o = ctx;
    for (int64_t i = 0; i < ni; i++)
        for (int64_t c = 0; c < nj; c++) {
            if (o->trans)
                o->c[(j0 + c) * o->ld + i0 + i] = acc[i * NC + c];
            else
                o->c[(i0 + i) * o->ld + j0 + c] = acc[i * NC + c];
        }
}
