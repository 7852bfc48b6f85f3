/* test_basis - projected features (formats/basis.h).
 *
 * On synthetic features with a known low-rank structure (x = A s + noise,
 * layers of different scales) and odd shapes (D not a multiple of the 6 x 16
 * tiles, more than one 256-row chunk and 256-column slice), checked against
 * brute force in double in this file: the second moment (f32 and BF16
 * inputs, with and without threads), the eigenvalues (a Jacobi solver here),
 * eigenvectors, orthonormality, the sign convention, the energy rule, the
 * per-layer kept fractions (against the reconstruction of the data), the
 * evaluation of any basis, bases from a matrix's row space and their
 * extension by the energy outside it, projection (f32
 * and BF16 rounding), unprojection, the exact merge fc = fc_r P, and the
 * file: bit-exact round trip, every truncation and byte flip rejected,
 * content checks behind a valid CRC.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "basis.h"
#include "basis_ref.h"
#include "crc32c.h"
#include "dtype.h"
#include "le.h"
#include "test.h"

static uint64_t rng = 2027;

/* ---- brute force helpers ---- */

/* Per layer, over the data: explained = 1 - sum|x_k - xh_k|^2 / sum|x_k|^2
 * and norm = sum|xh_k|^2 / sum|x_k|^2, xh = P^T P x in double; overall kept. */
static void brute_layer_kept(const df_basis *b, const float *x, int64_t n, double *explained,
                             double *norm, double *kept)
{
    int64_t D = b->D, R = b->R, H = b->H;
    double *xt = malloc(sizeof(double) * (size_t)D), *z = malloc(sizeof(double) * (size_t)R);
    double res[DF_BASIS_MAX_LAYERS] = {0}, en[DF_BASIS_MAX_LAYERS] = {0}, hn[DF_BASIS_MAX_LAYERS] = {0};
    double tot = 0, kz = 0;
    for (int64_t t = 0; t < n; t++) {
        for (int64_t d = 0; d < D; d++)
            xt[d] = basis_ref_x(x, n, (int)H, t, d);
        for (int64_t r = 0; r < R; r++) {
            z[r] = 0;
            for (int64_t d = 0; d < D; d++)
                z[r] += b->P[r * D + d] * xt[d];
            kz += z[r] * z[r];
        }
        for (int64_t d = 0; d < D; d++) {
            double xh = 0;
            for (int64_t r = 0; r < R; r++)
                xh += b->P[r * D + d] * z[r];
            res[d / H] += (xt[d] - xh) * (xt[d] - xh);
            en[d / H] += xt[d] * xt[d];
            hn[d / H] += xh * xh;
            tot += xt[d] * xt[d];
        }
    }
    for (int k = 0; k < b->K; k++) {
        explained[k] = 1 - res[k] / en[k];
        norm[k] = hn[k] / en[k];
    }
    *kept = kz / tot;
    free(xt);
    free(z);
}

/* ---- the second moment ---- */

static void test_moment(df_pool *pool)
{
    const int K = 3, H = 17, D = K * H;
    const int64_t n = 700; /* chunks of 256, 256, 188 */
    float *x = basis_ref_features(&rng, n, K, H, 5, 0.05);
    double *Mb = basis_ref_moment(x, n, K, H, 0, n);
    const float *lay[3] = {x, x + n * H, x + 2 * n * H};
    df_err e;
    df_moment m, mp;
    int32_t ids[3] = {4, 9, 13};
    CHECK_OK(df_moment_init(&m, K, H, ids, &e), &e);
    CHECK_OK(df_moment_init(&mp, K, H, ids, &e), &e);
    CHECK(m.m == NULL); /* allocated lazily */
    /* in two adds of odd sizes; on the calling thread vs the pool */
    const float *lay2[3] = {lay[0] + 300 * H, lay[1] + 300 * H, lay[2] + 300 * H};
    CHECK_OK(df_moment_add_f32(&m, lay, K, H, 300, NULL, &e), &e);
    CHECK_OK(df_moment_add_f32(&m, lay2, K, H, n - 300, NULL, &e), &e);
    CHECK_OK(df_moment_add_f32(&mp, lay, K, H, 300, pool, &e), &e);
    CHECK_OK(df_moment_add_f32(&mp, lay2, K, H, n - 300, pool, &e), &e);
    CHECK_EQ(m.n_rows, n);
    int same = 1;
    double worst = 0, trace = 0;
    for (int i = 0; i < D; i++) {
        trace += Mb[i * D + i];
        for (int j = i; j < D; j++) {
            same &= m.m[i * D + j] == mp.m[i * D + j];
            /* relative to sqrt(M_ii M_jj) >= |M_ij| */
            double scale = sqrt(Mb[i * D + i] * Mb[j * D + j]);
            worst = fmax(worst, fabs(m.m[i * D + j] - Mb[i * D + j]) / scale);
        }
    }
    CHECK(same); /* threads do not change a bit */
    CHECK(worst < 1e-6);
    CHECK(fabs(m.trace - trace) <= 1e-6 * trace);
    CHECK(trace > 0);

    /* BF16: the same against brute force on the rounded values */
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(n * D));
    float *xr = malloc(sizeof(float) * (size_t)(n * D));
    for (int64_t i = 0; i < n * D; i++) {
        xb[i] = df_f32_to_bf16(x[i]);
        xr[i] = df_bf16_to_f32(xb[i]);
    }
    double *Mr = basis_ref_moment(xr, n, K, H, 0, n);
    df_moment mb;
    CHECK_OK(df_moment_init(&mb, K, H, ids, &e), &e);
    const uint16_t *layb[3] = {xb, xb + n * H, xb + 2 * n * H};
    CHECK_OK(df_moment_add_bf16(&mb, layb, K, H, n, pool, &e), &e);
    worst = 0;
    for (int i = 0; i < D; i++)
        for (int j = i; j < D; j++)
            worst = fmax(worst, fabs(mb.m[i * D + j] - Mr[i * D + j]) /
                                    sqrt(Mr[i * D + i] * Mr[j * D + j]));
    CHECK(worst < 1e-6);
    CHECK_EQ(mb.n_rows, n);

    /* merge: first part + second part == all (up to the chunking's rounding) */
    df_moment m1, m2;
    CHECK_OK(df_moment_init(&m1, K, H, ids, &e), &e);
    CHECK_OK(df_moment_init(&m2, K, H, ids, &e), &e);
    CHECK_OK(df_moment_add_f32(&m1, lay, K, H, 300, pool, &e), &e);
    CHECK_OK(df_moment_add_f32(&m2, lay2, K, H, n - 300, pool, &e), &e);
    CHECK_OK(df_moment_merge(&m1, &m2, &e), &e);
    CHECK_EQ(m1.n_rows, n);
    worst = 0;
    for (int i = 0; i < D; i++)
        for (int j = i; j < D; j++)
            worst = fmax(worst, fabs(m1.m[i * D + j] - m.m[i * D + j]) /
                                    sqrt(m.m[i * D + i] * m.m[j * D + j]));
    CHECK(worst < 1e-12); /* same chunks; only the order of the double sums differs */
    df_moment other;
    CHECK_OK(df_moment_init(&other, K, H, NULL, &e), &e); /* other layer ids */
    CHECK_ERR(df_moment_merge(&m1, &other, &e), -DF_EMISMATCH, &e, "layer ids");

    /* a NaN is refused with its position, and nothing is added */
    double before = m.m[5];
    float saved = x[1 * n * H + 5 * H + 3];
    x[1 * n * H + 5 * H + 3] = NAN;
    CHECK_ERR(df_moment_add_f32(&m, lay, K, H, n, pool, &e), -EINVAL, &e,
              "row 5, layer 1, column 3");
    x[1 * n * H + 5 * H + 3] = saved;
    CHECK_EQ(m.n_rows, n);
    CHECK(m.m[5] == before);
    uint16_t sb = xb[2 * n * H + 7 * H];
    xb[2 * n * H + 7 * H] = 0x7f80; /* +inf */
    CHECK_ERR(df_moment_add_bf16(&mb, layb, K, H, n, pool, &e), -EINVAL, &e,
              "row 7, layer 2, column 0");
    /* the same scan, exported for backends (basis.h) */
    CHECK_ERR(df_moment_check_finite_bf16(layb, K, H, n, pool, "scan", &e), -EINVAL, &e,
              "scan: row 7, layer 2, column 0");
    CHECK_OK(df_moment_check_finite_bf16(layb, K, H, 7, pool, "scan", &e), &e);
    xb[2 * n * H + 7 * H] = sb;
    /* shapes */
    CHECK_ERR(df_moment_add_f32(&m, lay, K, H + 1, 10, pool, &e), -DF_EMISMATCH, &e, "layers of");
    CHECK_ERR(df_moment_add_f32(&m, lay, K, H, -1, pool, &e), -EINVAL, &e, "n_rows");
    CHECK_OK(df_moment_add_f32(&m, lay, K, H, 0, pool, &e), &e); /* no-op */
    CHECK_ERR(df_moment_init(&other, 0, 4, NULL, &e), -EINVAL, &e, "[1, 64]");
    CHECK_ERR(df_moment_init(&other, 2, 20000, NULL, &e), -EINVAL, &e, "32768");

    /* a large D (M of 72 MB: the huge-page allocation path), 3 rows */
    {
        const int HL = 3000;
        float *xl = malloc(sizeof(float) * 3 * HL);
        for (int i = 0; i < 3 * HL; i++)
            xl[i] = test_randn(&rng);
        const float *ll[1] = {xl};
        df_moment big;
        CHECK_OK(df_moment_init(&big, 1, HL, NULL, &e), &e);
        CHECK_OK(df_moment_add_f32(&big, ll, 1, HL, 3, pool, &e), &e);
        int bad = 0;
        for (int q = 0; q < 200; q++) {
            int i = (int)(test_rand(&rng) % HL), j = (int)(test_rand(&rng) % HL);
            if (i > j) {
                int t = i;
                i = j, j = t;
            }
            double want = 0;
            for (int t = 0; t < 3; t++)
                want += (double)xl[t * HL + i] * xl[t * HL + j];
            bad += fabs(big.m[(int64_t)i * HL + j] - want) > 1e-6 * (1 + fabs(want));
        }
        CHECK_EQ(bad, 0);
        CHECK_EQ(big.n_rows, 3);
        df_moment_free(&big);
        free(xl);
    }

    df_moment_free(&m);
    df_moment_free(&mp);
    df_moment_free(&mb);
    df_moment_free(&m1);
    df_moment_free(&m2);
    df_moment_free(&other);
    free(x);
    free(xb);
    free(xr);
    free(Mb);
    free(Mr);
}

/* ---- the fit ---- */

static void test_fit(df_pool *pool)
{
    const int K = 3, H = 17, D = K * H, r = 6;
    const int64_t n = 900;
    const double noise = 0.02;
    float *x = basis_ref_features(&rng, n, K, H, r, noise);
    const float *lay[3] = {x, x + n * H, x + 2 * n * H};
    df_err e;
    df_moment m;
    CHECK_OK(df_moment_init(&m, K, H, NULL, &e), &e);
    CHECK_OK(df_moment_add_f32(&m, lay, K, H, n, pool, &e), &e);
    double *Mb = basis_ref_moment(x, n, K, H, 0, n), *Mj = malloc(sizeof(double) * D * D);
    memcpy(Mj, Mb, sizeof(double) * D * D);
    double w[64], trace = 0;
    basis_ref_eigvals(Mj, D, w);
    for (int i = 0; i < D; i++)
        trace += Mb[i * D + i];
    double *upper = malloc(sizeof(double) * D * D);
    memcpy(upper, m.m, sizeof(double) * D * D);

    df_basis b;
    CHECK_OK(df_basis_fit(&m, r, 0, &b, &e), &e);
    CHECK_EQ(b.R, r);
    CHECK_EQ(b.D, D);
    CHECK_EQ(b.kind, DF_BASIS_KIND_MOMENT);
    CHECK_EQ(b.n_rows, n);
    CHECK(basis_ref_ortho_err(&b) < 1e-6);
    /* the moment is as before (upper triangle and diagonal) */
    int kept_m = 1;
    for (int i = 0; i < D; i++)
        for (int j = i; j < D; j++)
            kept_m &= m.m[i * D + j] == upper[i * D + j];
    CHECK(kept_m);
    /* eigenvalues: Jacobi on the brute-force moment; eigenvectors: M p = lambda p */
    for (int i = 0; i < r; i++) {
        CHECK(fabs(b.eigval[i] - w[i]) <= 1e-6 * w[0]);
        if (i)
            CHECK(b.eigval[i] <= b.eigval[i - 1]);
        double res = 0;
        for (int a = 0; a < D; a++) {
            double v = 0;
            for (int c = 0; c < D; c++)
                v += Mb[a * D + c] * b.P[(int64_t)i * D + c];
            v -= w[i] * b.P[(int64_t)i * D + a];
            res += v * v;
        }
        CHECK(sqrt(res) <= 1e-5 * w[0]);
        /* sign convention: the largest component is positive */
        int best = 0;
        for (int a = 1; a < D; a++)
            if (fabsf(b.P[(int64_t)i * D + a]) > fabsf(b.P[(int64_t)i * D + best]))
                best = a;
        CHECK(b.P[(int64_t)i * D + best] > 0);
    }
    /* captured energy: the low-rank part's; the noise is 0.02^2 per coordinate */
    double cum = 0;
    for (int i = 0; i < r; i++)
        cum += w[i];
    CHECK(fabs(b.kept - cum / trace) < 1e-6);
    CHECK(fabs(b.total_energy - trace) <= 1e-6 * trace);
    double noise_frac = noise * noise * 14.0 / 3 * D * n / trace; /* E|eps|^2 (scales 1,4,9) */
    CHECK(b.kept >= 1 - 2 * noise_frac);
    CHECK(b.kept < 1);
    /* per-layer kept vs the data's reconstruction */
    double ex[3], nm[3], kb;
    brute_layer_kept(&b, x, n, ex, nm, &kb);
    CHECK(fabs(kb - b.kept) < 1e-5);
    for (int k = 0; k < K; k++) {
        CHECK(fabs(b.layer_kept[k] - ex[k]) < 1e-5);
        CHECK(fabs(b.layer_kept[k] - nm[k]) < 1e-5); /* equal for an eigenbasis */
        CHECK(b.layer_kept[k] > 0.5 && b.layer_kept[k] <= 1);
        double le = 0;
        for (int i = k * H; i < (k + 1) * H; i++)
            le += Mb[i * D + i];
        CHECK(fabs(b.layer_energy[k] - le) <= 1e-6 * le);
    }
    /* eval of the fitted basis agrees with the fit's numbers */
    double ek, el[3];
    CHECK_OK(df_basis_eval(&b, &m, &ek, el, pool, &e), &e);
    CHECK(fabs(ek - b.kept) < 1e-5);
    for (int k = 0; k < K; k++)
        CHECK(fabs(el[k] - b.layer_kept[k]) < 1e-5);

    /* determinism: a second fit gives the same bits */
    df_basis b2;
    CHECK_OK(df_basis_fit(&m, r, 0, &b2, &e), &e);
    CHECK(!memcmp(b.P, b2.P, sizeof(float) * (size_t)r * D));
    df_basis_free(&b2);

    /* the energy rule: R = the smallest rank reaching the fraction */
    double fr[] = {0.3, 0.5, 0.9, cum / trace - 1e-7, cum / trace + 1e-7, 0.9999, 1.0};
    for (size_t q = 0; q < sizeof fr / sizeof fr[0]; q++) {
        int want = D;
        double c = 0;
        for (int i = 0; i < D; i++) {
            c += w[i];
            if (c >= (fr[q] - 1e-10) * trace) {
                want = i + 1;
                break;
            }
        }
        df_basis be;
        CHECK_OK(df_basis_fit(&m, 0, fr[q], &be, &e), &e);
        CHECK_EQ(be.R, want);
        CHECK(be.kept >= fr[q] - 1e-9);
        if (want == r) /* same vectors as the fixed-R fit */
            CHECK(!memcmp(be.P, b.P, sizeof(float) * (size_t)r * D));
        df_basis_free(&be);
    }
    {
        df_basis be;
        CHECK_OK(df_basis_fit(&m, 0, cum / trace - 1e-7, &be, &e), &e);
        CHECK_EQ(be.R, r);
        df_basis_free(&be);
        CHECK_OK(df_basis_fit(&m, D, 0, &be, &e), &e); /* the full basis keeps everything */
        CHECK(fabs(be.kept - 1) < 1e-9);
        CHECK(basis_ref_ortho_err(&be) < 1e-6);
        df_basis_free(&be);
    }
    /* arguments */
    df_basis bad;
    CHECK_ERR(df_basis_fit(&m, D + 1, 0, &bad, &e), -EINVAL, &e, "[1, 51]");
    CHECK_ERR(df_basis_fit(&m, -1, 0, &bad, &e), -EINVAL, &e, "[1, 51]");
    CHECK_ERR(df_basis_fit(&m, 0, 0, &bad, &e), -EINVAL, &e, "(0, 1]");
    CHECK_ERR(df_basis_fit(&m, 0, 1.5, &bad, &e), -EINVAL, &e, "(0, 1]");
    CHECK_ERR(df_basis_fit(&m, 3, 0.5, &bad, &e), -EINVAL, &e, "energy");
    df_moment empty;
    CHECK_OK(df_moment_init(&empty, K, H, NULL, &e), &e);
    CHECK_ERR(df_basis_fit(&empty, 3, 0, &bad, &e), -EINVAL, &e, "no rows");

    df_basis_free(&b);
    df_moment_free(&m);
    free(x);
    free(Mb);
    free(Mj);
    free(upper);
}

/* ---- evaluation of a basis that is not an eigenbasis ---- */

static void test_eval(df_pool *pool)
{
    const int K = 2, H = 23, D = K * H;
    const int64_t n = 400;
    float *x = basis_ref_features(&rng, n, K, H, 8, 0.1);
    const float *lay[2] = {x, x + n * H};
    df_err e;
    df_moment m;
    CHECK_OK(df_moment_init(&m, K, H, NULL, &e), &e);
    CHECK_OK(df_moment_add_f32(&m, lay, K, H, n, pool, &e), &e);
    /* a random 7-dimensional subspace */
    float *A = malloc(sizeof(float) * 7 * D);
    for (int i = 0; i < 7 * D; i++)
        A[i] = test_randn(&rng);
    df_basis b;
    CHECK_OK(df_basis_from_rows(A, 7, K, H, NULL, 7, 0, pool, &b, &e), &e);
    double kept, lk[2], ex[2], nm[2], kb;
    CHECK_OK(df_basis_eval(&b, &m, &kept, lk, pool, &e), &e);
    brute_layer_kept(&b, x, n, ex, nm, &kb);
    CHECK(fabs(kept - kb) < 1e-5);
    for (int k = 0; k < K; k++) {
        CHECK(fabs(lk[k] - ex[k]) < 1e-5);
        CHECK(fabs(ex[k] - nm[k]) > 1e-4); /* the two definitions differ here */
    }
    CHECK(kept > 0.01 && kept < 0.9);
    CHECK_OK(df_basis_eval(&b, &m, &kept, NULL, pool, &e), &e);
    CHECK(fabs(kept - kb) < 1e-5);
    df_moment other;
    CHECK_OK(df_moment_init(&other, 1, D, NULL, &e), &e);
    CHECK_ERR(df_basis_eval(&b, &other, &kept, lk, pool, &e), -DF_EMISMATCH, &e, "layers of");
    df_basis_free(&b);
    df_moment_free(&m);
    df_moment_free(&other);
    free(A);
    free(x);
}

/* ---- projection, unprojection, merge ---- */

/* RNE of a double to bf16, independent of the library: 8 significant bits. */
static uint16_t bf16_rne(double v)
{
    if (v == 0)
        return signbit(v) ? 0x8000 : 0;
    int ex;
    frexp(fabs(v), &ex);
    double q = ldexp(nearbyint(ldexp(fabs(v), 8 - ex)), ex - 8);
    float f = (float)(v < 0 ? -q : q); /* exact: q has 8 bits */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static void test_apply(df_pool *pool)
{
    /* D = 400 (> one 256 slice, not a multiple of 6 or 16), R = 37, n = 250 */
    const int K = 2, H = 200, D = K * H, R = 37;
    const int64_t n = 250;
    float *x = basis_ref_features(&rng, n, K, H, 40, 0.1);
    const float *lay[2] = {x, x + n * H};
    df_err e;
    df_moment m;
    CHECK_OK(df_moment_init(&m, K, H, NULL, &e), &e);
    CHECK_OK(df_moment_add_f32(&m, lay, K, H, n, pool, &e), &e);
    df_basis b;
    CHECK_OK(df_basis_fit(&m, R, 0, &b, &e), &e);
    CHECK(basis_ref_ortho_err(&b) < 1e-6);

    /* f32 projection vs double brute force */
    float *z = malloc(sizeof(float) * n * R), *z2 = malloc(sizeof(float) * n * R);
    double *zx = malloc(sizeof(double) * n * R);
    CHECK_OK(df_basis_project_f32(&b, lay, K, H, n, z, pool, &e), &e);
    double worst = 0, zmax = 0;
    for (int64_t t = 0; t < n; t++)
        for (int r = 0; r < R; r++) {
            double v = 0, av = 0;
            for (int d = 0; d < D; d++) {
                v += (double)b.P[(int64_t)r * D + d] * basis_ref_x(x, n, H, t, d);
                av += fabs((double)b.P[(int64_t)r * D + d] * basis_ref_x(x, n, H, t, d));
            }
            zx[t * R + r] = v;
            zmax = fmax(zmax, fabs(v));
            worst = fmax(worst, fabs(z[t * R + r] - v) / av);
        }
    CHECK(worst < 1e-6);
    CHECK(zmax > 1);
    /* the calling thread alone gives the same bits */
    CHECK_OK(df_basis_project_f32(&b, lay, K, H, n, z2, NULL, &e), &e);
    CHECK(!memcmp(z, z2, sizeof(float) * n * R));

    /* BF16 in and out: RNE of the exact value, within the f32 sums' error */
    uint16_t *xb = malloc(sizeof(uint16_t) * n * D), *zb = malloc(sizeof(uint16_t) * n * R);
    for (int64_t i = 0; i < n * D; i++)
        xb[i] = df_f32_to_bf16(x[i]);
    const uint16_t *layb[2] = {xb, xb + n * H};
    CHECK_OK(df_basis_project_bf16(&b, layb, K, H, n, zb, pool, &e), &e);
    int far = 0, exact = 0;
    for (int64_t t = 0; t < n; t++)
        for (int r = 0; r < R; r++) {
            double v = 0;
            for (int d = 0; d < D; d++)
                v += (double)b.P[(int64_t)r * D + d] * df_bf16_to_f32(xb[(d / H) * n * H + t * H + d % H]);
            uint16_t want = bf16_rne(v);
            int dist = test_bf16_dist(zb[t * R + r], want);
            far += dist > 1;
            exact += dist == 0;
        }
    CHECK_EQ(far, 0);
    CHECK(exact >= n * R * 99 / 100);
    /* the bf16 and f32 paths agree (f32 projection of the bf16 inputs, rounded) */
    float *xr = malloc(sizeof(float) * n * D);
    for (int64_t i = 0; i < n * D; i++)
        xr[i] = df_bf16_to_f32(xb[i]);
    const float *layr[2] = {xr, xr + n * H};
    CHECK_OK(df_basis_project_f32(&b, layr, K, H, n, z2, pool, &e), &e);
    int disagree = 0;
    for (int64_t i = 0; i < n * R; i++)
        disagree += test_bf16_dist(zb[i], df_f32_to_bf16(z2[i])) > 1;
    CHECK_EQ(disagree, 0);

    /* unproject: P^T z; vectors in the span come back */
    float *xh = malloc(sizeof(float) * n * D);
    float *c = malloc(sizeof(float) * n * R), *xs = malloc(sizeof(float) * n * D);
    for (int64_t i = 0; i < n * R; i++)
        c[i] = test_randn(&rng);
    CHECK_OK(df_basis_unproject(&b, c, n, xs, pool, &e), &e); /* xs = P^T c, rows in the span */
    worst = 0;
    for (int64_t t = 0; t < n; t++)
        for (int d = 0; d < D; d++) {
            double v = 0;
            for (int r = 0; r < R; r++)
                v += (double)c[t * R + r] * b.P[(int64_t)r * D + d];
            worst = fmax(worst, fabs(xs[t * D + d] - v));
        }
    CHECK(worst < 1e-6);
    float *xsl = malloc(sizeof(float) * n * D); /* as K layers */
    for (int64_t t = 0; t < n; t++)
        for (int d = 0; d < D; d++)
            xsl[(d / H) * n * H + t * H + d % H] = xs[t * D + d];
    const float *lays[2] = {xsl, xsl + n * H};
    CHECK_OK(df_basis_project_f32(&b, lays, K, H, n, z2, pool, &e), &e);
    worst = 0;
    for (int64_t i = 0; i < n * R; i++)
        worst = fmax(worst, fabs(z2[i] - c[i]));
    CHECK(worst < 1e-4); /* P P^T = I */
    CHECK_OK(df_basis_unproject(&b, z2, n, xh, pool, &e), &e);
    worst = 0;
    for (int64_t i = 0; i < n * D; i++)
        worst = fmax(worst, fabs(xh[i] - xs[i]));
    CHECK(worst < 1e-4);

    /* merge: fc_r (P x) == (fc_r P) x */
    const int HO = 30;
    float *fcr = malloc(sizeof(float) * HO * R), *fc = malloc(sizeof(float) * HO * D);
    for (int i = 0; i < HO * R; i++)
        fcr[i] = test_randn(&rng) * 0.1f;
    CHECK_OK(df_basis_merge(&b, fcr, HO, fc, pool, &e), &e);
    worst = 0;
    for (int h = 0; h < HO; h++)
        for (int d = 0; d < D; d++) {
            double v = 0;
            for (int r = 0; r < R; r++)
                v += (double)fcr[h * R + r] * b.P[(int64_t)r * D + d];
            /* rounded once to f32 from a double sum: exact RNE in practice */
            worst = fmax(worst, fabs(fc[h * D + d] - v) / fmax(fabs(v), 1e-30));
        }
    CHECK(worst <= 0x1p-24 * 1.0001);
    double wmerge = 0, ymax = 0;
    for (int64_t t = 0; t < n; t++)
        for (int h = 0; h < HO; h++) {
            double y1 = 0, y2 = 0, scale = 0;
            for (int r = 0; r < R; r++) {
                y1 += (double)fcr[h * R + r] * z[t * R + r];
                scale += fabs((double)fcr[h * R + r] * z[t * R + r]);
            }
            for (int d = 0; d < D; d++)
                y2 += (double)fc[h * D + d] * basis_ref_x(x, n, H, t, d);
            wmerge = fmax(wmerge, fabs(y1 - y2) / scale);
            ymax = fmax(ymax, fabs(y1));
        }
    CHECK(wmerge < 1e-5);
    CHECK(ymax > 0.1);

    /* rows holding the K layers side by side (an fc's rows, --init-from): the bits of the
     * same values given as K layers; and fc P^T of a merged fc = fc_r P gives fc_r back */
    float *z3 = malloc(sizeof(float) * n * R), *fcr2 = malloc(sizeof(float) * HO * R);
    CHECK_OK(df_basis_project_rows_f32(&b, xs, n, z3, pool, &e), &e);
    CHECK(!memcmp(z2, z3, sizeof(float) * n * R));
    CHECK_OK(df_basis_project_rows_f32(&b, fc, HO, fcr2, pool, &e), &e);
    worst = 0;
    for (int i = 0; i < HO * R; i++)
        worst = fmax(worst, fabs(fcr2[i] - fcr[i]));
    CHECK(worst < 1e-5);
    CHECK_ERR(df_basis_project_rows_f32(&b, NULL, n, z3, pool, &e), -EINVAL, &e, "no input");
    free(z3);
    free(fcr2);

    /* arguments */
    CHECK_ERR(df_basis_project_f32(&b, lay, K + 1, H, n, z, pool, &e), -DF_EMISMATCH, &e,
              "layers of");
    CHECK_OK(df_basis_project_f32(&b, lay, K, H, 0, z, pool, &e), &e);

    df_basis_free(&b);
    df_moment_free(&m);
    free(x);
    free(z);
    free(z2);
    free(zx);
    free(xb);
    free(zb);
    free(xr);
    free(xh);
    free(c);
    free(xs);
    free(xsl);
    free(fcr);
    free(fc);
}

/* ---- bases from a matrix's row space ---- */

static void test_from_rows(df_pool *pool)
{
    const int K = 3, H = 17, D = K * H, rows = 12;
    df_err e;
    float *A = malloc(sizeof(float) * rows * D);
    for (int i = 0; i < rows * D; i++)
        A[i] = test_randn(&rng);
    df_basis b;
    CHECK_OK(df_basis_from_rows(A, rows, K, H, NULL, 0, 1.0, pool, &b, &e), &e);
    CHECK_EQ(b.R, rows);
    CHECK_EQ(b.kind, DF_BASIS_KIND_ROWS);
    CHECK(basis_ref_ortho_err(&b) < 1e-6);
    CHECK(fabs(b.kept - 1) < 1e-6);
    /* every row of A lies in the span; eigval = squared singular values */
    double worst = 0;
    for (int i = 0; i < rows; i++) {
        double res = 0, nn = 0, z[64];
        for (int r = 0; r < b.R; r++) {
            z[r] = 0;
            for (int d = 0; d < D; d++)
                z[r] += (double)b.P[r * D + d] * A[i * D + d];
        }
        for (int d = 0; d < D; d++) {
            double v = 0;
            for (int r = 0; r < b.R; r++)
                v += z[r] * b.P[r * D + d];
            res += (v - A[i * D + d]) * (v - A[i * D + d]);
            nn += (double)A[i * D + d] * A[i * D + d];
        }
        worst = fmax(worst, sqrt(res / nn));
    }
    CHECK(worst < 1e-5);
    double G[12 * 12], w[12];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < rows; j++) {
            G[i * rows + j] = 0;
            for (int d = 0; d < D; d++)
                G[i * rows + j] += (double)A[i * D + d] * A[j * D + d];
        }
    basis_ref_eigvals(G, rows, w);
    for (int r = 0; r < rows; r++)
        CHECK(fabs(b.eigval[r] - w[r]) <= 1e-9 * w[0]);

    /* the exact export for bases aligned to fc: fc_r = fc P^T, then fc_r P = fc */
    float *fcr = malloc(sizeof(float) * rows * rows), *fc = malloc(sizeof(float) * rows * D);
    for (int i = 0; i < rows; i++)
        for (int r = 0; r < b.R; r++) {
            double v = 0;
            for (int d = 0; d < D; d++)
                v += (double)A[i * D + d] * b.P[r * D + d];
            fcr[i * b.R + r] = (float)v;
        }
    CHECK_OK(df_basis_merge(&b, fcr, rows, fc, pool, &e), &e);
    worst = 0;
    for (int i = 0; i < rows * D; i++)
        worst = fmax(worst, fabs(fc[i] - A[i]));
    CHECK(worst < 1e-5);
    df_basis_free(&b);

    /* rank 5: energy 1 finds it, a larger R is refused naming it */
    float *B = malloc(sizeof(float) * rows * D), *C = malloc(sizeof(float) * rows * 5);
    float *F = malloc(sizeof(float) * 5 * D);
    for (int i = 0; i < rows * 5; i++)
        C[i] = test_randn(&rng);
    for (int i = 0; i < 5 * D; i++)
        F[i] = test_randn(&rng);
    for (int i = 0; i < rows; i++)
        for (int d = 0; d < D; d++) {
            double v = 0;
            for (int q = 0; q < 5; q++)
                v += (double)C[i * 5 + q] * F[q * D + d];
            B[i * D + d] = (float)v;
        }
    CHECK_OK(df_basis_from_rows(B, rows, K, H, NULL, 0, 1.0, pool, &b, &e), &e);
    CHECK_EQ(b.R, 5);
    CHECK(basis_ref_ortho_err(&b) < 1e-6);
    df_basis_free(&b);
    CHECK_ERR(df_basis_from_rows(B, rows, K, H, NULL, 8, 0, pool, &b, &e), -EINVAL, &e,
              "numerical rank 5");

    /* top 3 of the row space == the fit of the moment of the rows (rows > D
     * takes that path itself: compare it to the Gram path on the same span) */
    df_basis b3, bm;
    CHECK_OK(df_basis_from_rows(A, rows, K, H, NULL, 3, 0, pool, &b3, &e), &e);
    df_moment m;
    const float *lay[3];
    float *Al = malloc(sizeof(float) * rows * D);
    for (int i = 0; i < rows; i++)
        for (int d = 0; d < D; d++)
            Al[(d / H) * rows * H + i * H + d % H] = A[i * D + d];
    for (int k = 0; k < K; k++)
        lay[k] = Al + k * rows * H;
    CHECK_OK(df_moment_init(&m, K, H, NULL, &e), &e);
    CHECK_OK(df_moment_add_f32(&m, lay, K, H, rows, pool, &e), &e);
    CHECK_OK(df_basis_fit(&m, 3, 0, &bm, &e), &e);
    worst = 0;
    for (int i = 0; i < 3 * D; i++)
        worst = fmax(worst, fabs(b3.P[i] - bm.P[i]));
    CHECK(worst < 1e-4);
    for (int k = 0; k < K; k++)
        CHECK(fabs(b3.layer_kept[k] - bm.layer_kept[k]) < 1e-5);
    CHECK(fabs(b3.kept - bm.kept) < 1e-6);
    df_basis_free(&b3);
    df_basis_free(&bm);

    /* rows > D: the moment path */
    const int tall = 80;
    float *T = malloc(sizeof(float) * tall * D);
    for (int i = 0; i < tall * D; i++)
        T[i] = test_randn(&rng);
    CHECK_OK(df_basis_from_rows(T, tall, K, H, NULL, 10, 0, pool, &b, &e), &e);
    CHECK_EQ(b.kind, DF_BASIS_KIND_ROWS);
    CHECK_EQ(b.R, 10);
    CHECK_EQ(b.n_rows, tall);
    CHECK(basis_ref_ortho_err(&b) < 1e-6);
    df_basis_free(&b);
    float nanrow = A[3 * D + 4];
    A[3 * D + 4] = NAN;
    CHECK_ERR(df_basis_from_rows(A, rows, K, H, NULL, 3, 0, pool, &b, &e), -EINVAL, &e,
              "row 3, layer 0, column 4");
    A[3 * D + 4] = nanrow;
    memset(C, 0, sizeof(float) * rows * 5);
    memset(B, 0, sizeof(float) * rows * D);
    CHECK_ERR(df_basis_from_rows(B, rows, K, H, NULL, 3, 0, pool, &b, &e), -EINVAL, &e, "zero");

    df_moment_free(&m);
    free(A);
    free(B);
    free(C);
    free(F);
    free(Al);
    free(T);
    free(fcr);
    free(fc);
}

/* ---- the file ---- */

static void recrc(uint8_t *buf, size_t len)
{
    df_put32(buf + len - 4, df_crc32c(0, buf, len - 4));
}

static void test_file(df_pool *pool)
{
    const int K = 3, H = 17, D = K * H, R = 5;
    const int64_t n = 300;
    float *x = basis_ref_features(&rng, n, K, H, 6, 0.05);
    const float *lay[3] = {x, x + n * H, x + 2 * n * H};
    int32_t ids[3] = {1, 16, 31};
    df_err e;
    df_moment m;
    CHECK_OK(df_moment_init(&m, K, H, ids, &e), &e);
    CHECK_OK(df_moment_add_f32(&m, lay, K, H, n, pool, &e), &e);
    df_basis b, r;
    CHECK_OK(df_basis_fit(&m, R, 0, &b, &e), &e);
    CHECK_EQ(b.layer_ids[1], 16);
    const char *dir = test_tmpdir("basis");
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/basis.dfb", dir);
    CHECK_OK(df_basis_write(&b, path, &e), &e);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    CHECK(access(tmp, F_OK) != 0);
    CHECK_OK(df_basis_read(path, &r, &e), &e);
    CHECK(r.D == b.D && r.R == b.R && r.K == b.K && r.H == b.H && r.kind == b.kind);
    CHECK(r.n_rows == b.n_rows && r.total_energy == b.total_energy && r.kept == b.kept);
    CHECK(!memcmp(r.layer_ids, b.layer_ids, sizeof(int32_t) * K));
    CHECK(!memcmp(r.layer_energy, b.layer_energy, sizeof(double) * K));
    CHECK(!memcmp(r.layer_kept, b.layer_kept, sizeof(double) * K));
    CHECK(!memcmp(r.eigval, b.eigval, sizeof(double) * R));
    CHECK(!memcmp(r.P, b.P, sizeof(float) * R * D));
    df_basis_free(&r);

    uint8_t *buf;
    size_t len;
    CHECK_OK(df_basis_serialize(&b, &buf, &len, &e), &e);
    CHECK_EQ(len, df_basis_file_bytes(K, R, D));
    CHECK_EQ(len, 64 + 8 * 2 + 16 * K + 8 * R + 4 * R * D + 4);
    char hex[DF_SHA256_HEX], hex2[DF_SHA256_HEX];
    CHECK_OK(df_basis_sha256(path, hex, &e), &e);
    df_sha256_hex_of(buf, len, hex2);
    CHECK(!strcmp(hex, hex2));
    CHECK(!memcmp(buf, "DFBASIS", 8));
    CHECK_EQ(df_le32(buf + 20), D);

    /* every truncation, and every byte flipped two ways, is refused */
    int bad = 0;
    for (size_t l = 0; l < len; l++) {
        int rc = df_basis_parse(buf, l, "t.dfb", &r, &e);
        bad += rc != -DF_ECORRUPT || r.P != NULL;
    }
    CHECK_EQ(bad, 0);
    uint8_t *cp = malloc(len);
    for (size_t i = 0; i < len; i++)
        for (int f = 0; f < 2; f++) {
            memcpy(cp, buf, len);
            cp[i] ^= f ? 0x80 : 0x01;
            int rc = df_basis_parse(cp, len, "t.dfb", &r, &e);
            bad += rc >= 0 || r.P != NULL;
            if (rc >= 0)
                df_basis_free(&r);
        }
    CHECK_EQ(bad, 0);
    CHECK_OK(df_basis_parse(buf, len, "t.dfb", &r, &e), &e);
    df_basis_free(&r);
    /* named errors */
    memcpy(cp, buf, len);
    cp[200] ^= 4;
    CHECK_ERR(df_basis_parse(cp, len, "t.dfb", &r, &e), -DF_ECORRUPT, &e, "CRC32C mismatch");
    CHECK_ERR(df_basis_parse(buf, len - 1, "t.dfb", &r, &e), -DF_ECORRUPT, &e, "its header");
    CHECK_ERR(df_basis_parse(buf, 10, "t.dfb", &r, &e), -DF_ECORRUPT, &e, "64-byte header");
    /* behind a valid CRC: the content checks */
    memcpy(cp, buf, len);
    df_put32(cp + 8, 2);
    recrc(cp, len);
    CHECK_ERR(df_basis_parse(cp, len, "t.dfb", &r, &e), -DF_EVERSION, &e, "version 2");
    uint64_t p_off = len - 4 - 4 * (uint64_t)R * D, eig_off = p_off - 8 * R;
    memcpy(cp, buf, len); /* row 2 scaled: its norm */
    for (int i = 0; i < D; i++) {
        float f;
        memcpy(&f, cp + p_off + 4 * (2 * D + i), 4);
        f *= 1.01f;
        memcpy(cp + p_off + 4 * (2 * D + i), &f, 4);
    }
    recrc(cp, len);
    CHECK_ERR(df_basis_parse(cp, len, "t.dfb", &r, &e), -DF_ECORRUPT, &e, "P row 2");
    memcpy(cp, buf, len); /* row 1 := (row 0 + row 1) / sqrt 2: unit, not orthogonal */
    for (int i = 0; i < D; i++) {
        float a, c;
        memcpy(&a, cp + p_off + 4 * i, 4);
        memcpy(&c, cp + p_off + 4 * (D + i), 4);
        c = (a + c) / sqrtf(2);
        memcpy(cp + p_off + 4 * (D + i), &c, 4);
    }
    recrc(cp, len);
    CHECK_ERR(df_basis_parse(cp, len, "t.dfb", &r, &e), -DF_ECORRUPT, &e, "not orthonormal");
    memcpy(cp, buf, len);
    float nanf_ = NAN;
    memcpy(cp + p_off + 4 * 7, &nanf_, 4);
    recrc(cp, len);
    CHECK_ERR(df_basis_parse(cp, len, "t.dfb", &r, &e), -DF_ECORRUPT, &e, "P[0][7]");
    memcpy(cp, buf, len); /* eigenvalues out of order */
    memcpy(cp + eig_off, buf + eig_off + 8, 8);
    memcpy(cp + eig_off + 8, buf + eig_off, 8);
    recrc(cp, len);
    CHECK_ERR(df_basis_parse(cp, len, "t.dfb", &r, &e), -DF_ECORRUPT, &e, "eigenvalue 1");
    memcpy(cp, buf, len); /* a repeated layer id */
    df_put32(cp + 64 + 8, 1);
    recrc(cp, len);
    CHECK_ERR(df_basis_parse(cp, len, "t.dfb", &r, &e), -DF_ECORRUPT, &e, "repeated");
    memcpy(cp, buf, len); /* R too large for the size */
    df_put32(cp + 24, R + 1);
    recrc(cp, len);
    CHECK_ERR(df_basis_parse(cp, len, "t.dfb", &r, &e), -DF_ECORRUPT, &e, "says");
    memcpy(cp, buf, len);
    df_put32(cp + 28, 65);
    recrc(cp, len);
    CHECK_ERR(df_basis_parse(cp, len, "t.dfb", &r, &e), -DF_ECORRUPT, &e, "K = 65");
    memcpy(cp, buf, len); /* kept fraction out of range */
    double big = 1.5;
    memcpy(cp + 56, &big, 8);
    recrc(cp, len);
    CHECK_ERR(df_basis_parse(cp, len, "t.dfb", &r, &e), -DF_ECORRUPT, &e, "offset 56");

    /* files on disk: truncated, missing */
    FILE *f = fopen(path, "wb");
    fwrite(buf, 1, len / 2, f);
    fclose(f);
    CHECK_ERR(df_basis_read(path, &r, &e), -DF_ECORRUPT, &e, "basis.dfb");
    f = fopen(path, "wb");
    fwrite(buf, 1, 20, f);
    fclose(f);
    CHECK_ERR(df_basis_read(path, &r, &e), -DF_ECORRUPT, &e, "shorter than");
    char missing[4200];
    snprintf(missing, sizeof missing, "%s/none.dfb", dir);
    CHECK_ERR(df_basis_read(missing, &r, &e), -ENOENT, &e, "none.dfb");
    /* an invalid basis is not written */
    b.P[3] *= 2;
    CHECK_ERR(df_basis_write(&b, path, &e), -EINVAL, &e, "P row 0");
    b.P[3] /= 2;
    b.layer_ids[2] = -1;
    uint8_t *buf2;
    size_t len2;
    CHECK_ERR(df_basis_serialize(&b, &buf2, &len2, &e), -EINVAL, &e, "negative");
    CHECK(buf2 == NULL);

    free(buf);
    free(cp);
    df_basis_free(&b);
    df_moment_free(&m);
    free(x);
}

/* ---- a basis extended past fc-like rows ---- */

static void test_extend(df_pool *pool)
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
    df_basis q, b;
    CHECK_OK(df_basis_from_rows(A, R0, K, H, ids, 0, 1.0, pool, &q, &e), &e);
    CHECK_EQ(q.R, R0);
    CHECK_OK(df_basis_extend(&q, &m, R, pool, &b, &e), &e);
    CHECK(b.R == R && b.kind == DF_BASIS_KIND_ROWS_EXT && b.rows_part == R0);
    CHECK(!memcmp(b.P, q.P, sizeof(float) * R0 * D)); /* kept whole, first */
    CHECK(!memcmp(b.eigval, q.eigval, sizeof(double) * R0));
    CHECK(basis_ref_ortho_err(&b) < 1e-5);
    CHECK(b.layer_ids[2] == 9 && b.n_rows == n);

    /* brute force: M' of the data's components outside span(q), its top R - R0 eigenvalues;
     * the extension rows hold exactly that much of M' (Ky Fan: the top subspace) */
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
        const float *p = b.P + (int64_t)r * D;
        for (int i = 0; i < D; i++)
            for (int j = 0; j < D; j++)
                held += (double)p[i] * Mp[i * D + j] * p[j];
    }
    basis_ref_eigvals(Mc, D, w);
    for (int r = 0; r < R - R0; r++) {
        top += w[r];
        CHECK(fabs(b.eigval[R0 + r] - w[r]) <= 1e-5 * w[0]);
    }
    CHECK(fabs(held - top) <= 1e-5 * top);
    /* kept fractions: against the reconstruction of the data; more than q keeps */
    double ex[3], nm[3], kept, kq, exq[3], nmq[3];
    brute_layer_kept(&b, x, n, ex, nm, &kept);
    brute_layer_kept(&q, x, n, exq, nmq, &kq);
    CHECK(fabs(b.kept - kept) < 1e-5);
    for (int k = 0; k < K; k++)
        CHECK(fabs(b.layer_kept[k] - ex[k]) < 1e-5);
    CHECK(kept > kq + 0.05);

    /* the file keeps kind 3 and its split; eigenvalues may rise where the parts meet */
    uint8_t *buf, *cp;
    size_t len;
    df_basis r;
    CHECK(b.eigval[R0] > b.eigval[R0 - 1]); /* this data's energy against fc's scale */
    CHECK_OK(df_basis_serialize(&b, &buf, &len, &e), &e);
    CHECK_OK(df_basis_parse(buf, len, "x.dfb", &r, &e), &e);
    CHECK(r.kind == 3 && r.rows_part == R0 && !memcmp(r.P, b.P, sizeof(float) * R * D));
    df_basis_free(&r);
    cp = malloc(len);
    const uint32_t bad36[][2] = {{3, 0}, {3, R}, {1, 5}, {2, 1}, {3, R + 1}};
    for (int i = 0; i < 5; i++) {
        memcpy(cp, buf, len);
        df_put32(cp + 16, bad36[i][0]);
        df_put32(cp + 36, bad36[i][1]);
        recrc(cp, len);
        CHECK_ERR(df_basis_parse(cp, len, "x.dfb", &r, &e), -DF_ECORRUPT, &e, "offset 36");
    }
    memcpy(cp, buf, len); /* out of order inside the second part */
    uint64_t eig_off = len - 4 - 4 * (uint64_t)R * D - 8 * (uint64_t)R;
    memcpy(cp + eig_off + 8 * (R0 + 1), buf + eig_off + 8 * R0, 8);
    memcpy(cp + eig_off + 8 * R0, buf + eig_off + 8 * (R0 + 1), 8);
    recrc(cp, len);
    CHECK_ERR(df_basis_parse(cp, len, "x.dfb", &r, &e), -DF_ECORRUPT, &e, "eigenvalue 18");

    /* bad arguments */
    CHECK_ERR(df_basis_extend(&q, &m, R0, pool, &r, &e), -EINVAL, &e, "R = 17");
    CHECK_ERR(df_basis_extend(&q, &m, D + 1, pool, &r, &e), -EINVAL, &e, "at most D");
    df_moment m2;
    int32_t ids2[3] = {2, 5, 10};
    CHECK_OK(df_moment_init(&m2, K, H, ids2, &e), &e);
    CHECK_OK(df_moment_add_f32(&m2, lay, K, H, n, pool, &e), &e);
    CHECK_ERR(df_basis_extend(&q, &m2, R, pool, &r, &e), -DF_EMISMATCH, &e, "other target");
    df_moment_free(&m2);

    free(buf);
    free(cp);
    free(Mp);
    free(Mc);
    free(xt);
    free(w);
    free(A);
    df_basis_free(&q);
    df_basis_free(&b);
    df_moment_free(&m);
    free(x);
}

int main(void)
{
    df_pool *pool = df_pool_open(3); /* more threads than this machine's 2 cores is fine */
    test_moment(pool);
    test_fit(pool);
    test_eval(pool);
    test_apply(pool);
    test_from_rows(pool);
    test_file(pool);
    test_extend(pool);
    df_pool_close(pool);
    return test_main_end();
}
