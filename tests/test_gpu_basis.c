/* test_gpu_basis - the projection basis on the GPU (kernels/cuda/basis_gpu.h)
 * against the CPU reference (formats/basis.h) and brute force in double.
 * Skips (77) without a GPU; in a build without CUDA it first checks that
 * the stub refuses with -ENOTSUP.
 *
 * On synthetic features with a known structure (x = A s + noise, layers of
 * different scales, as test_basis.c) and odd shapes (D = 111 and 4200: not
 * multiples of 32, the latter over two 4096-column GEMM blocks; adds that
 * straddle chunks; 7-row chunks), checked:
 *  - the moment, BF16 path: every upper entry within 3e-5 sqrt(M_ii M_jj)
 *    of brute force on the BF16 values (basis_gpu.h: worst case ~1.5e-5 at
 *    1024-row chunks, ~1e-6 typical; the measured worst is printed) and of
 *    df_moment_add_bf16; F64 path within 1e-12; n_rows, trace; GPU adds
 *    after CPU adds (the sync adds into m->m); a NaN / inf refused with
 *    its position and nothing of the call added; shape, n_rows, -EBUSY
 *    and unsynced-use errors;
 *  - the fit vs df_basis_fit on the same moment: eigenvalues within 1e-9 of
 *    the largest, rows of separated eigenvalues equal to f32 rounding
 *    (canonical signs), the projector difference, residuals M p - lambda p,
 *    orthonormality, energies, kept fractions; m left untouched (all of
 *    it); the energy rule gives the CPU's R; argument errors;
 *  - the extension (basis kind 3) vs df_basis_extend and brute force (Ky
 *    Fan: the rows hold the top R - R0 eigenvalues' worth of M'), and its
 *    basis.dfb image parses back as kind 3;
 *  - the evaluation of a non-eigen basis vs df_basis_eval and the data. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basis.h"
#include "basis_ref.h"
#include "cuda/basis_gpu.h"
#include "dtype.h"
#include "pool.h"
#include "test.h"

static uint64_t rng = 9090;

/* ---- data and brute force (beside basis_ref.h) ---- */

/* The BF16 bits of x (count values), and x rounded to them, in place. */
static uint16_t *to_bf16(float *x, int64_t count)
{
    uint16_t *b = malloc(sizeof(uint16_t) * (size_t)count);
    for (int64_t i = 0; i < count; i++) {
        b[i] = df_f32_to_bf16(x[i]);
        x[i] = df_bf16_to_f32(b[i]);
    }
    return b;
}

/* max over the upper triangle of |m - ref| / sqrt(ref_ii ref_jj) */
static double moment_err(const double *m, const double *ref, int64_t D)
{
    double worst = 0;
    for (int64_t i = 0; i < D; i++)
        for (int64_t j = i; j < D; j++)
            worst = fmax(worst, fabs(m[i * D + j] - ref[i * D + j]) /
                                    sqrt(ref[i * D + i] * ref[j * D + j]));
    return worst;
}

/* ||A^T A - B^T B||_F for the rows [a0, a0 + n) of a and [b0, b0 + n) of b:
 * the distance of the two subspaces' projectors, sqrt(2n - 2 ||A B^T||_F^2). */
/* || A^T A - B^T B ||_F for rows a0.. of a and b0.. of b (n each): the
 * distance of the two projectors, computed from the rows' Gram products so
 * that equal rows give 0 whatever their f32 rounding (2n - 2 sum (a.b)^2
 * would turn a 1e-8 norm error into 1e-4 through the square root). */
static double gram_dot(const df_basis *a, int a0, const df_basis *b, int b0, int n)
{
    double s = 0;
    int64_t D = a->D;
    for (int r = 0; r < n; r++)
        for (int q = 0; q < n; q++) {
            double d = 0;
            for (int64_t i = 0; i < D; i++)
                d += (double)a->P[(a0 + r) * D + i] * b->P[(b0 + q) * D + i];
            s += d * d;
        }
    return s;
}

static double proj_dist(const df_basis *a, int a0, const df_basis *b, int b0, int n)
{
    double d2 = gram_dot(a, a0, a, a0, n) + gram_dot(b, b0, b, b0, n) -
                2 * gram_dot(a, a0, b, b0, n);
    return sqrt(fmax(0, d2));
}

/* max_i |(M p_r)_i - lambda_r p_ri| over the rows of b, M full D x D */
static double residual(const df_basis *b, const double *M)
{
    double worst = 0;
    int64_t D = b->D;
    for (int r = 0; r < b->R; r++) {
        const float *p = b->P + r * D;
        for (int64_t a = 0; a < D; a++) {
            double v = 0;
            for (int64_t c = 0; c < D; c++)
                v += M[a * D + c] * p[c];
            worst = fmax(worst, fabs(v - b->eigval[r] * p[a]));
        }
    }
    return worst;
}

/* m's upper triangle mirrored: the whole matrix, for brute-force use */
static double *full_of(const df_moment *m)
{
    int64_t D = m->D;
    double *M = malloc(sizeof(double) * (size_t)(D * D));
    for (int64_t i = 0; i < D; i++)
        for (int64_t j = i; j < D; j++)
            M[i * D + j] = M[j * D + i] = m->m[i * D + j];
    return M;
}

/* ---- the moment ---- */

static void test_moment(df_basis_gpu *g, df_basis_gpu *g64, df_pool *pool)
{
    const int K = 3, H = 37, D = K * H;
    const int64_t n = 2500;
    float *x = basis_ref_features(&rng, n, K, H, 5, 0.05);
    uint16_t *xb = to_bf16(x, n * D); /* x now holds the BF16 values */
    double *Mb = basis_ref_moment(x, n, K, H, 0, n);
    const uint16_t *lay[3] = {xb, xb + n * H, xb + 2 * n * H};
    df_err e;
    int32_t ids[3] = {4, 9, 13};
    double trace = 0;
    for (int i = 0; i < D; i++)
        trace += Mb[i * D + i];

    /* the CPU reference */
    df_moment mc;
    CHECK_OK(df_moment_init(&mc, K, H, ids, &e), &e);
    CHECK_OK(df_moment_add_bf16(&mc, lay, K, H, n, pool, &e), &e);

    /* BF16 path, default 1024-row chunks, adds that straddle them:
     * 300 + 1 + 1000 + 1199 rows */
    df_moment m;
    CHECK_OK(df_moment_init(&m, K, H, ids, &e), &e);
    const int64_t cuts[] = {0, 300, 301, 1301, n};
    for (int c = 0; c < 4; c++) {
        const uint16_t *l[3];
        for (int k = 0; k < K; k++)
            l[k] = lay[k] + cuts[c] * H;
        CHECK_OK(df_basis_gpu_moment_add_bf16(g, &m, l, K, H, cuts[c + 1] - cuts[c], pool, &e),
                 &e);
    }
    CHECK_EQ(m.n_rows, n);  /* counted at once */
    CHECK(m.m == NULL);     /* filled by the sync */
    df_basis bad;           /* not before it */
    CHECK_ERR(df_basis_gpu_fit(g, &m, 3, 0, &bad, &e), -EINVAL, &e, "not yet synced");
    df_moment other;
    CHECK_OK(df_moment_init(&other, K, H, ids, &e), &e);
    CHECK_ERR(df_basis_gpu_moment_add_bf16(g, &other, lay, K, H, 5, pool, &e), -EBUSY, &e,
              "another moment");
    CHECK_OK(df_basis_gpu_moment_sync(g, &other, &e), &e); /* not its moment: a no-op */
    CHECK(other.m == NULL && other.n_rows == 0);
    CHECK_OK(df_basis_gpu_moment_sync(g, &m, &e), &e);
    CHECK(m.m != NULL);
    CHECK_EQ(m.n_rows, n);
    double err_b = moment_err(m.m, Mb, D), err_c = moment_err(m.m, mc.m, D);
    printf("moment (BF16 path, 1024-row chunks): max error %.3g of brute force, %.3g of the "
           "CPU's (relative to sqrt(M_ii M_jj))\n", err_b, err_c);
    CHECK(err_b < 3e-5);
    CHECK(err_c < 3e-5);
    CHECK(fabs(m.trace - trace) <= 3e-5 * trace);
    CHECK_OK(df_basis_gpu_moment_sync(g, &m, &e), &e); /* nothing more: a no-op */
    CHECK_EQ(m.n_rows, n);

    /* 7-row chunks (357 of them), F64 path */
    df_moment m7, m64;
    CHECK_OK(df_moment_init(&m7, K, H, ids, &e), &e);
    CHECK_OK(df_moment_init(&m64, K, H, ids, &e), &e);
    CHECK_OK(df_basis_gpu_set_chunk_rows(g, 7, &e), &e);
    CHECK_OK(df_basis_gpu_moment_add_bf16(g, &m7, lay, K, H, n, pool, &e), &e);
    CHECK_OK(df_basis_gpu_moment_sync(g, &m7, &e), &e);
    CHECK_OK(df_basis_gpu_set_chunk_rows(g, 1024, &e), &e);
    CHECK_ERR(df_basis_gpu_set_chunk_rows(g, 1025, &e), -EINVAL, &e, "[1, 1024]");
    double err7 = moment_err(m7.m, Mb, D);
    CHECK_OK(df_basis_gpu_moment_add_bf16(g64, &m64, lay, K, H, 1234, pool, &e), &e);
    const uint16_t *lay2[3] = {lay[0] + 1234 * H, lay[1] + 1234 * H, lay[2] + 1234 * H};
    CHECK_OK(df_basis_gpu_moment_add_bf16(g64, &m64, lay2, K, H, n - 1234, pool, &e), &e);
    CHECK_OK(df_basis_gpu_moment_sync(g64, &m64, &e), &e);
    double err64 = moment_err(m64.m, Mb, D);
    printf("moment: 7-row chunks %.3g, F64 path %.3g\n", err7, err64);
    CHECK(err7 < 3e-6);
    CHECK(err64 < 1e-12);
    CHECK_EQ(m64.n_rows, n);
    CHECK(fabs(m64.trace - trace) <= 1e-12 * trace);

    /* GPU adds after CPU adds: the sync adds into m->m */
    df_moment mx;
    CHECK_OK(df_moment_init(&mx, K, H, ids, &e), &e);
    CHECK_OK(df_moment_add_bf16(&mx, lay, K, H, 1234, pool, &e), &e);
    CHECK_OK(df_basis_gpu_moment_add_bf16(g, &mx, lay2, K, H, n - 1234, pool, &e), &e);
    CHECK_OK(df_basis_gpu_moment_sync(g, &mx, &e), &e);
    CHECK_EQ(mx.n_rows, n);
    CHECK(moment_err(mx.m, Mb, D) < 3e-5);
    CHECK(fabs(mx.trace - trace) <= 3e-5 * trace);

    /* a NaN is refused with its position and nothing of the call is added */
    df_moment mn;
    CHECK_OK(df_moment_init(&mn, K, H, ids, &e), &e);
    CHECK_OK(df_basis_gpu_moment_add_bf16(g, &mn, lay, K, H, 1234, pool, &e), &e);
    uint16_t saved = xb[1 * n * H + (1234 + 5) * H + 3];
    xb[1 * n * H + (1234 + 5) * H + 3] = 0x7fc0; /* NaN */
    CHECK_ERR(df_basis_gpu_moment_add_bf16(g, &mn, lay2, K, H, n - 1234, pool, &e), -EINVAL, &e,
              "row 5, layer 1, column 3");
    xb[1 * n * H + (1234 + 5) * H + 3] = saved;
    saved = xb[2 * n * H + 7 * H];
    xb[2 * n * H + 7 * H] = 0xff80; /* -inf */
    CHECK_ERR(df_basis_gpu_moment_add_bf16(g, &mn, lay, K, H, 10, pool, &e), -EINVAL, &e,
              "row 7, layer 2, column 0");
    xb[2 * n * H + 7 * H] = saved;
    CHECK_EQ(mn.n_rows, 1234);
    CHECK_OK(df_basis_gpu_moment_sync(g, &mn, &e), &e);
    double *M1 = basis_ref_moment(x, n, K, H, 0, 1234);
    CHECK(moment_err(mn.m, M1, D) < 3e-5);
    /* arguments, with df_moment_add_bf16's messages */
    CHECK_ERR(df_basis_gpu_moment_add_bf16(g, &mn, lay, K, H + 1, 10, pool, &e), -DF_EMISMATCH,
              &e, "layers of");
    CHECK_ERR(df_basis_gpu_moment_add_bf16(g, &mn, lay, K - 1, H, 10, pool, &e), -DF_EMISMATCH,
              &e, "layers of");
    CHECK_ERR(df_basis_gpu_moment_add_bf16(g, &mn, lay, K, H, -1, pool, &e), -EINVAL, &e,
              "n_rows");
    CHECK_OK(df_basis_gpu_moment_add_bf16(g, &mn, lay, K, H, 0, pool, &e), &e); /* no-op */
    df_moment blank = {0};
    CHECK_ERR(df_basis_gpu_moment_add_bf16(g, &blank, lay, K, H, 10, pool, &e), -EINVAL, &e,
              "not initialised");

    df_moment_free(&mc);
    df_moment_free(&m);
    df_moment_free(&m7);
    df_moment_free(&m64);
    df_moment_free(&mx);
    df_moment_free(&mn);
    df_moment_free(&other);
    free(M1);
    free(Mb);
    free(xb);
    free(x);
}

/* D = 4200: two 4096-column GEMM blocks, sampled entries against exact sums. */
static void test_moment_wide(df_basis_gpu *g, df_basis_gpu *g64, df_pool *pool)
{
    const int K = 2, H = 2100, D = K * H;
    const int64_t n = 1100; /* a full chunk and a partial one */
    float *x = malloc(sizeof(float) * (size_t)(n * D));
    for (int64_t i = 0; i < n * D; i++)
        x[i] = test_randn(&rng) * (1 + (float)(i % 7));
    uint16_t *xb = to_bf16(x, n * D);
    const uint16_t *lay[2] = {xb, xb + n * H};
    df_err e;
    df_moment m, m64;
    CHECK_OK(df_moment_init(&m, K, H, NULL, &e), &e);
    CHECK_OK(df_moment_init(&m64, K, H, NULL, &e), &e);
    CHECK_OK(df_basis_gpu_moment_add_bf16(g, &m, lay, K, H, n, pool, &e), &e);
    CHECK_OK(df_basis_gpu_moment_sync(g, &m, &e), &e);
    CHECK_OK(df_basis_gpu_moment_add_bf16(g64, &m64, lay, K, H, n, pool, &e), &e);
    CHECK_OK(df_basis_gpu_moment_sync(g64, &m64, &e), &e);
    double worst = 0, worst64 = 0;
    for (int q = 0; q < 3000; q++) {
        int64_t i = (int64_t)(test_rand(&rng) % D), j = (int64_t)(test_rand(&rng) % D);
        if (q < 8) /* corners of the blocks */
            i = (q & 1) ? D - 1 : 4095, j = (q & 2) ? 4096 : D - 1 - (q & 4);
        if (i > j) {
            int64_t t = i;
            i = j, j = t;
        }
        double want = 0, ni = 0, nj = 0;
        for (int64_t t = 0; t < n; t++) {
            double a = basis_ref_x(x, n, H, t, i), b = basis_ref_x(x, n, H, t, j);
            want += a * b, ni += a * a, nj += b * b;
        }
        worst = fmax(worst, fabs(m.m[i * D + j] - want) / sqrt(ni * nj));
        worst64 = fmax(worst64, fabs(m64.m[i * D + j] - want) / sqrt(ni * nj));
    }
    printf("moment at D = %d: max sampled error %.3g (BF16 path), %.3g (F64 path)\n", D, worst,
           worst64);
    CHECK(worst < 3e-5);
    CHECK(worst64 < 1e-12);
    df_moment_free(&m);
    df_moment_free(&m64);
    free(xb);
    free(x);
}

/* ---- the fit ---- */

static void check_same_fit(const df_basis *bg, const df_basis *bc, const double *M, int exact_rows)
{
    CHECK_EQ(bg->R, bc->R);
    CHECK_EQ(bg->kind, DF_BASIS_KIND_MOMENT);
    CHECK_EQ(bg->n_rows, bc->n_rows);
    CHECK(bg->total_energy == bc->total_energy);
    for (int k = 0; k < bc->K; k++) {
        CHECK(bg->layer_energy[k] == bc->layer_energy[k]);
        CHECK(bg->layer_ids[k] == bc->layer_ids[k]);
        CHECK(fabs(bg->layer_kept[k] - bc->layer_kept[k]) < 1e-6);
    }
    CHECK(fabs(bg->kept - bc->kept) < 1e-9);
    double top = bc->eigval[0], ev = 0, rows = 0;
    int R = bg->R < bc->R ? bg->R : bc->R;
    for (int r = 0; r < R; r++) {
        ev = fmax(ev, fabs(bg->eigval[r] - bc->eigval[r]) / top);
        if (r)
            CHECK(bg->eigval[r] <= bg->eigval[r - 1]);
    }
    for (int r = 0; r < exact_rows && r < R; r++)
        for (int64_t i = 0; i < bg->D; i++)
            rows = fmax(rows, fabs((double)bg->P[r * bg->D + i] - bc->P[r * bc->D + i]));
    double res = residual(bg, M) / top, orth = basis_ref_ortho_err(bg);
    double pd = exact_rows ? proj_dist(bg, 0, bc, 0, exact_rows) : 0;
    printf("fit R = %d: eigenvalues %.3g of the largest, rows %.3g, projector %.3g, residual "
           "%.3g, orthonormality %.3g\n", R, ev, rows, pd, res, orth);
    CHECK(ev < 1e-9);
    CHECK(rows < 1e-5);
    CHECK(pd < 1e-4);
    CHECK(res < 1e-6);
    CHECK(orth < 1e-6);
}

static void test_fit(df_basis_gpu *g, df_pool *pool)
{
    const int K = 3, H = 37, D = K * H, r = 6;
    const int64_t n = 1500;
    float *x = basis_ref_features(&rng, n, K, H, r, 0.02);
    const float *lay[3] = {x, x + n * H, x + 2 * n * H};
    int32_t ids[3] = {1, 2, 30};
    df_err e;
    df_moment m;
    CHECK_OK(df_moment_init(&m, K, H, ids, &e), &e);
    CHECK_OK(df_moment_add_f32(&m, lay, K, H, n, pool, &e), &e);
    double *M = full_of(&m);
    for (int64_t i = 0; i < D; i++) /* poison the unspecified lower triangle: must not matter */
        for (int64_t j = 0; j < i; j++)
            m.m[i * D + j] = NAN;
    double *before = malloc(sizeof(double) * D * D);
    memcpy(before, m.m, sizeof(double) * D * D);

    df_basis bg, bc;
    CHECK_OK(df_basis_gpu_fit(g, &m, r, 0, &bg, &e), &e);
    CHECK(!memcmp(before, m.m, sizeof(double) * D * D)); /* all of m untouched, NaNs too */
    CHECK_OK(df_basis_fit(&m, r, 0, &bc, &e), &e);
    check_same_fit(&bg, &bc, M, r);
    df_basis_free(&bg);
    df_basis_free(&bc);
    /* into the noise (a cluster: eigenvalues and residuals, not vectors) */
    memcpy(m.m, before, sizeof(double) * D * D);
    CHECK_OK(df_basis_gpu_fit(g, &m, 40, 0, &bg, &e), &e);
    CHECK_OK(df_basis_fit(&m, 40, 0, &bc, &e), &e);
    check_same_fit(&bg, &bc, M, r);
    df_basis_free(&bg);
    df_basis_free(&bc);
    CHECK_OK(df_basis_gpu_fit(g, &m, D, 0, &bg, &e), &e); /* all of it keeps everything */
    CHECK(fabs(bg.kept - 1) < 1e-9);
    CHECK(basis_ref_ortho_err(&bg) < 1e-6);
    df_basis_free(&bg);

    /* the energy rule: the CPU's R, eigenvalues and rows */
    const double fr[] = {0.3, 0.5, 0.9, 0.999, 1.0};
    for (size_t q = 0; q < sizeof fr / sizeof fr[0]; q++) {
        memcpy(m.m, before, sizeof(double) * D * D);
        CHECK_OK(df_basis_gpu_fit(g, &m, 0, fr[q], &bg, &e), &e);
        CHECK_OK(df_basis_fit(&m, 0, fr[q], &bc, &e), &e);
        CHECK(bg.kept >= fr[q] - 1e-9);
        printf("energy %g: R = %d (CPU %d)\n", fr[q], bg.R, bc.R);
        check_same_fit(&bg, &bc, M, bc.R < r ? bc.R : r);
        df_basis_free(&bg);
        df_basis_free(&bc);
    }

    /* arguments, with df_basis_fit's messages */
    CHECK_ERR(df_basis_gpu_fit(g, &m, D + 1, 0, &bg, &e), -EINVAL, &e, "[1, 111]");
    CHECK_ERR(df_basis_gpu_fit(g, &m, -1, 0, &bg, &e), -EINVAL, &e, "[1, 111]");
    CHECK_ERR(df_basis_gpu_fit(g, &m, 0, 0, &bg, &e), -EINVAL, &e, "(0, 1]");
    CHECK_ERR(df_basis_gpu_fit(g, &m, 0, 1.5, &bg, &e), -EINVAL, &e, "(0, 1]");
    CHECK_ERR(df_basis_gpu_fit(g, &m, 3, 0.5, &bg, &e), -EINVAL, &e, "energy");
    df_moment empty;
    CHECK_OK(df_moment_init(&empty, K, H, NULL, &e), &e);
    CHECK_ERR(df_basis_gpu_fit(g, &empty, 3, 0, &bg, &e), -EINVAL, &e, "no rows");
    CHECK(bg.P == NULL && bg.R == 0);

    /* a tiny shape: D = 6, the full basis */
    {
        float xs[40 * 6];
        for (int i = 0; i < 40 * 6; i++)
            xs[i] = test_randn(&rng);
        const float *ls[2] = {xs, xs + 40 * 3};
        df_moment ms;
        CHECK_OK(df_moment_init(&ms, 2, 3, NULL, &e), &e);
        CHECK_OK(df_moment_add_f32(&ms, ls, 2, 3, 40, pool, &e), &e);
        double *Ms = full_of(&ms);
        CHECK_OK(df_basis_gpu_fit(g, &ms, 6, 0, &bg, &e), &e);
        CHECK_OK(df_basis_fit(&ms, 6, 0, &bc, &e), &e);
        check_same_fit(&bg, &bc, Ms, 6);
        df_basis_free(&bg);
        df_basis_free(&bc);
        df_moment_free(&ms);
        free(Ms);
    }
    df_moment_free(&m);
    free(before);
    free(M);
    free(x);
}

/* ---- evaluation ---- */

static void test_eval(df_basis_gpu *g, df_pool *pool)
{
    const int K = 2, H = 23, D = K * H;
    const int64_t n = 400;
    float *x = basis_ref_features(&rng, n, K, H, 8, 0.1);
    const float *lay[2] = {x, x + n * H};
    df_err e;
    df_moment m;
    CHECK_OK(df_moment_init(&m, K, H, NULL, &e), &e);
    CHECK_OK(df_moment_add_f32(&m, lay, K, H, n, pool, &e), &e);
    float *A = malloc(sizeof(float) * 7 * D); /* a random 7-dimensional subspace */
    for (int i = 0; i < 7 * D; i++)
        A[i] = test_randn(&rng);
    df_basis b;
    CHECK_OK(df_basis_from_rows(A, 7, K, H, NULL, 7, 0, pool, &b, &e), &e);
    double kg, lg[2], kc, lc[2];
    CHECK_OK(df_basis_gpu_eval(g, &b, &m, &kg, lg, &e), &e);
    CHECK_OK(df_basis_eval(&b, &m, &kc, lc, pool, &e), &e);
    printf("eval: kept %.9f (CPU %.9f), layers %.9f %.9f (CPU %.9f %.9f)\n", kg, kc, lg[0], lg[1],
           lc[0], lc[1]);
    CHECK(fabs(kg - kc) < 1e-5);
    for (int k = 0; k < K; k++)
        CHECK(fabs(lg[k] - lc[k]) < 1e-5);
    CHECK(kg > 0.01 && kg < 0.9);
    double k2;
    CHECK_OK(df_basis_gpu_eval(g, &b, &m, &k2, NULL, &e), &e);
    CHECK(k2 == kg);
    df_moment other;
    CHECK_OK(df_moment_init(&other, 1, D, NULL, &e), &e);
    CHECK_ERR(df_basis_gpu_eval(g, &b, &other, &kg, lg, &e), -DF_EMISMATCH, &e, "layers of");
    df_moment empty;
    CHECK_OK(df_moment_init(&empty, K, H, NULL, &e), &e);
    CHECK_ERR(df_basis_gpu_eval(g, &b, &empty, &kg, lg, &e), -EINVAL, &e, "no rows");
    df_basis_free(&b);
    df_moment_free(&m);
    df_moment_free(&other);
    free(A);
    free(x);
}

/* ---- extension ---- */

static void test_extend(df_basis_gpu *g, df_pool *pool)
{
    const int K = 3, H = 40, D = K * H, R0 = 17, R = 30;
    const int64_t n = 700;
    float *x = basis_ref_features(&rng, n, K, H, 24, 0.1);
    const float *lay[3] = {x, x + n * H, x + 2 * n * H};
    int32_t ids[3] = {2, 5, 9};
    df_err e;
    df_moment m;
    CHECK_OK(df_moment_init(&m, K, H, ids, &e), &e);
    CHECK_OK(df_moment_add_f32(&m, lay, K, H, n, pool, &e), &e);
    float *A = malloc(sizeof(float) * R0 * D); /* an "fc": R0 random rows */
    for (int i = 0; i < R0 * D; i++)
        A[i] = test_randn(&rng);
    df_basis q, bg, bc;
    CHECK_OK(df_basis_from_rows(A, R0, K, H, ids, 0, 1.0, pool, &q, &e), &e);
    CHECK_OK(df_basis_gpu_extend(g, &q, &m, R, &bg, &e), &e);
    CHECK_OK(df_basis_extend(&q, &m, R, pool, &bc, &e), &e);
    CHECK(bg.R == R && bg.kind == DF_BASIS_KIND_ROWS_EXT && bg.rows_part == R0);
    CHECK(!memcmp(bg.P, q.P, sizeof(float) * R0 * D)); /* kept whole, first */
    CHECK(!memcmp(bg.eigval, q.eigval, sizeof(double) * R0));
    CHECK(bg.layer_ids[2] == 9 && bg.n_rows == n);
    CHECK(bg.total_energy == bc.total_energy);
    double orth = basis_ref_ortho_err(&bg), ev = 0;
    for (int r = R0; r < R; r++)
        ev = fmax(ev, fabs(bg.eigval[r] - bc.eigval[r]) / bc.eigval[R0]);
    double pd = proj_dist(&bg, R0, &bc, R0, R - R0);
    printf("extend: eigenvalues %.3g of the largest (CPU's W is f32), projector %.3g, "
           "orthonormality %.3g, kept %.9f (CPU %.9f)\n", ev, pd, orth, bg.kept, bc.kept);
    CHECK(orth < 1e-5);
    CHECK(ev < 1e-5);
    CHECK(fabs(bg.kept - bc.kept) < 1e-5);
    for (int k = 0; k < K; k++)
        CHECK(fabs(bg.layer_kept[k] - bc.layer_kept[k]) < 1e-5);
    /* what `cache project --fc-basis --rank R` writes from it: a valid kind-3 basis.dfb
     * (docs/FORMAT-basis.md: R0 in [1, R), eigenvalues non-increasing within each part, P
     * orthonormal), read back as written */
    uint8_t *buf = NULL;
    size_t len = 0;
    df_basis rb = {0};
    CHECK_OK(df_basis_serialize(&bg, &buf, &len, &e), &e);
    if (buf) {
        CHECK_OK(df_basis_parse(buf, len, "gpu extension", &rb, &e), &e);
        CHECK(rb.kind == DF_BASIS_KIND_ROWS_EXT && rb.rows_part == R0 && rb.R == R);
        CHECK(rb.P && !memcmp(rb.P, bg.P, sizeof(float) * R * D));
        CHECK(rb.kept == bg.kept);
    }
    free(buf);
    df_basis_free(&rb);

    /* brute force: M' of the data's components outside span(q); the extension
     * rows hold its top R - R0 eigenvalues' worth (Ky Fan) */
    double *Mp = calloc((size_t)D * D, sizeof(double)), *xt = malloc(sizeof(double) * D);
    for (int64_t t = 0; t < n; t++) {
        for (int d = 0; d < D; d++)
            xt[d] = basis_ref_x(x, n, H, t, d);
        for (int r = 0; r < R0; r++) {
            double z = 0;
            for (int d = 0; d < D; d++)
                z += (double)q.P[r * D + d] * xt[d];
            for (int d = 0; d < D; d++)
                xt[d] -= z * q.P[r * D + d];
        }
        for (int i = 0; i < D; i++)
            for (int j = 0; j < D; j++)
                Mp[i * D + j] += xt[i] * xt[j];
    }
    double held = 0, top = 0, *w = malloc(sizeof(double) * D), *Mc = malloc(sizeof(double) * D * D);
    memcpy(Mc, Mp, sizeof(double) * D * D);
    for (int r = R0; r < R; r++) {
        const float *p = bg.P + (int64_t)r * D;
        for (int i = 0; i < D; i++)
            for (int j = 0; j < D; j++)
                held += (double)p[i] * Mp[i * D + j] * p[j];
    }
    basis_ref_eigvals(Mc, D, w);
    for (int r = 0; r < R - R0; r++) {
        top += w[r];
        CHECK(fabs(bg.eigval[R0 + r] - w[r]) <= 1e-5 * w[0]); /* m's own error, ~1e-6 */
    }
    CHECK(fabs(held - top) <= 1e-5 * top);

    /* arguments, with df_basis_extend's messages */
    df_basis r2;
    CHECK_ERR(df_basis_gpu_extend(g, &q, &m, R0, &r2, &e), -EINVAL, &e, "R = 17");
    CHECK_ERR(df_basis_gpu_extend(g, &q, &m, D + 1, &r2, &e), -EINVAL, &e, "at most D");
    df_moment m2;
    int32_t ids2[3] = {2, 5, 10};
    CHECK_OK(df_moment_init(&m2, K, H, ids2, &e), &e);
    CHECK_OK(df_moment_add_f32(&m2, lay, K, H, n, pool, &e), &e);
    CHECK_ERR(df_basis_gpu_extend(g, &q, &m2, R, &r2, &e), -DF_EMISMATCH, &e, "other target");
    df_moment m3;
    CHECK_OK(df_moment_init(&m3, K, H + 1, ids, &e), &e);
    CHECK_ERR(df_basis_gpu_extend(g, &q, &m3, R, &r2, &e), -DF_EMISMATCH, &e, "layers of");
    df_moment_free(&m2);
    df_moment_free(&m3);

    free(Mp);
    free(Mc);
    free(xt);
    free(w);
    free(A);
    df_basis_free(&q);
    df_basis_free(&bg);
    df_basis_free(&bc);
    df_moment_free(&m);
    free(x);
}

int main(void)
{
    df_err e = {0};
    df_basis_gpu *g = NULL, *g64 = NULL;
    int n = df_basis_gpu_device_count();
    if (n <= 0) {
        /* the refusal names the reason: no CUDA in this build, or no device */
        int rc = df_basis_gpu_open(0, 0, &g, &e);
        CHECK(rc == -ENOTSUP || rc == -ENODEV);
        CHECK(g == NULL);
        CHECK(strstr(e.msg, "CUDA") != NULL);
        printf("no CUDA device (%s): skipped\n", e.msg);
        return df_test_failures ? 1 : 77;
    }
    CHECK_ERR(df_basis_gpu_open(n, 0, &g, &e), -ENODEV, &e, "no such device");
    CHECK_ERR(df_basis_gpu_open(0, 8, &g, &e), -EINVAL, &e, "flags");
    CHECK_OK(df_basis_gpu_open(0, 0, &g, &e), &e);
    CHECK_OK(df_basis_gpu_open(0, DF_BASIS_GPU_MOMENT_F64, &g64, &e), &e);
    if (!g || !g64)
        return test_main_end();
    printf("gpu: %s\n", df_basis_gpu_name(g));
    df_pool *pool = df_pool_open(3);
    test_moment(g, g64, pool);
    test_moment_wide(g, g64, pool);
    test_fit(g, pool);
    test_eval(g, pool);
    test_extend(g, pool);
    df_pool_close(pool);
    df_basis_gpu_close(g);
    df_basis_gpu_close(g64);
    return test_main_end();
}
