/* test_train_ops.c - the elementwise training ops' backward passes of the
 * CPU reference backend: RMSNorm, RoPE, SwiGLU. The rest of train_ops.h
 * (all but the drafter attention) has its own files, checked the same way:
 * test_matmul_bwd.c, test_lmhead_ce.c, test_optim.c (the optimizer's ops).
 *
 * Each backward is checked two ways:
 *   - by central finite differences of a forward written here in double
 *     (tiny shapes, step 1e-6): the op's output must be the gradient of the
 *     function the forward op computes, whatever convention it uses inside;
 *   - against a naive double reference of the gradient formula on larger,
 *     odd shapes that cross every blocking boundary of the implementation.
 * Every op runs on a 1-thread and a 3-thread backend: the outputs must be
 * bitwise equal. Outputs are NaN-poisoned first, views carry padding columns
 * that must stay poisoned, and bad arguments must return -EINVAL with the
 * outputs untouched.
 *
 * Tolerances: u = 2^-24 = 6e-8 is fp32's unit roundoff. Finite differences
 * in double have truncation error ~h^2 |f'''| ~ 1e-12 and rounding error
 * ~1e-16 |L| / h ~ 1e-10 here, far below the fp32 error of the analytic
 * side, so the FD tolerance is the fp32 one: each says why it holds.
 *
 * BF16 weight gradients (matmul_bwd_w's and rmsnorm_bwd's dw): a BF16 dw
 * must be exactly RNE of what the same call gives with an F32 dw holding the
 * widened old values (the same fp32 sum, one rounding), and within 1 bf16
 * ulp of the double reference rounded once (grad_test_util.h's
 * expect_bf16_grad says when more than that can be right). */
#include "train_ops.h"
#include "test.h"
#include "grad_test_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- RMSNorm backward ---- */

/* y = g * x / sqrt(mean(x^2) + eps), in double. */
static void rms_fwd_d(const double *x, const double *g, int64_t D, double eps, double *y)
{
    double ss = 0;
    for (int64_t i = 0; i < D; i++)
        ss += x[i] * x[i];
    double r = 1.0 / sqrt(ss / (double)D + eps);
    for (int64_t i = 0; i < D; i++)
        y[i] = g[i] * x[i] * r;
}

/* FD of L = sum R .* rmsnorm(x) over x and w. The analytic dx is
 * r (g dy - xhat c): fp32 errors of a few u relative to its terms, which
 * are O(max|grad|) on these inputs; 2e-5 is a 100x margin over that, and a
 * missing mean term or a 1 + w slip is an O(1) error. */
static void fd_rmsnorm(int plus_one, df_dtype wt)
{
    const int64_t R = 3, D = 7;
    const float eps = 1e-3f; /* large enough that it matters */
    mat x = mat_rand(R, D, D, 1.0f), dy = mat_rand(R, D, D, 1.0f);
    wmat w = wvec_new(wt, D, 0.5f, plus_one ? 0.0f : 1.0f);
    double *xv = dbuf(R * D), *wv = dbuf(D), *g = dbuf(D), *y = dbuf(D);
    for (int64_t i = 0; i < R * D; i++)
        xv[i] = x.p[i];
    memcpy(wv, w.val, (size_t)D * sizeof(double));
    double *num_x = dbuf(R * D), *num_w = dbuf(D);
    for (int pass = 0; pass < 2; pass++) {
        double *v = pass ? wv : xv, *num = pass ? num_w : num_x;
        int64_t n = pass ? D : R * D;
        for (int64_t e = 0; e < n; e++) {
            double save = v[e], L[2];
            for (int s = 0; s < 2; s++) {
                v[e] = save + (s ? -FD_H : FD_H);
                for (int64_t i = 0; i < D; i++)
                    g[i] = plus_one ? 1.0 + wv[i] : wv[i];
                double acc = 0;
                for (int64_t r = 0; r < R; r++) {
                    rms_fwd_d(xv + r * D, g, D, eps, y);
                    for (int64_t i = 0; i < D; i++)
                        acc += dy.p[r * D + i] * y[i];
                }
                L[s] = acc;
            }
            v[e] = save;
            num[e] = (L[0] - L[1]) / (2 * FD_H);
        }
    }
    float *dx = fbuf(R * D), dwv[7];
    df_tensor tdx = df_tensor_2d(dx, DF_DTYPE_F32, R, D), tdw = df_tensor_1d(dwv, DF_DTYPE_F32, D);
    poison(dx, R * D);
    memset(dwv, 0, sizeof dwv);
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w.t, eps, plus_one, &dy.t, &tdx, 0, &tdw), 0);
    fd_compare(FD_NORM_X, "fd rmsnorm dx", dx, num_x, R * D, 2e-5);
    fd_compare(FD_NORM_W, "fd rmsnorm dw", dwv, num_w, D, 2e-5);
    free(x.p), free(dy.p), free(xv), free(wv), free(g), free(y), free(num_x), free(num_w), free(dx);
    wmat_free(&w);
}

/* Against the formula in double on bigger shapes. rows x D given as a 2-D
 * [rows, D] or (heads > 1) as a 3-D [rows/heads, heads, D] view of padded
 * rows (the per-head q/k norm). dx tolerance: r (fp32, from a sum of D
 * squares in 8 lanes: <= ~D/8 u relative, typically far less) times the
 * magnitude of its terms, 1e-5 relative; dw: an fp32 sum over the rows,
 * 2e-5 of the sum of magnitudes (random-sign rounding grows like sqrt(rows)
 * u, ~5e-6 at 5000 rows; a dropped row is >= 1/rows of it). */
static void check_rmsnorm_bwd(int64_t rows, int64_t D, int heads, df_dtype wt, int plus_one,
                              int with_dx, int acc_dx, int in_place)
{
    char what[128];
    snprintf(what, sizeof what, "rmsnorm_bwd rows=%lld D=%lld heads=%d %s +1=%d dx=%d acc=%d ip=%d",
             (long long)rows, (long long)D, heads, df_dtype_name(wt), plus_one, with_dx, acc_dx,
             in_place);
    const float eps = 1e-6f;
    int64_t ld = heads * D + 3, T = rows / heads;
    mat x = mat_rand(T, heads * D, ld, 1.0f), dy = mat_rand(T, heads * D, ld, 1.0f);
    for (int64_t t = 0; t < T; t++) /* rows of very different scales */
        for (int64_t c = 0; c < heads * D; c++)
            *mat_at(&x, t, c) *= (float)(1 + (t * heads + c / D) % 5) * 0.7f;
    mat dx0 = mat_rand(T, heads * D, ld, 1.0f);
    wmat w = wvec_new(wt, D, 0.3f, plus_one ? 0.0f : 1.0f);
    float *dw0 = fbuf(D);
    fill(dw0, D, 1.0f);
    mat dx[2] = {mat_new(T, heads * D, ld), mat_new(T, heads * D, ld)};
    float *dw[2] = {fbuf(D + 2), fbuf(D + 2)};
    /* the 3-D (or 2-D) views */
    df_tensor vx = x.t, vdy = dy.t, vdx[2] = {dx[0].t, dx[1].t};
    if (heads > 1) {
        df_tensor *vs[4] = {&vx, &vdy, &vdx[0], &vdx[1]};
        for (int i = 0; i < 4; i++) {
            vs[i]->ndim = 3;
            vs[i]->shape[0] = T, vs[i]->shape[1] = heads, vs[i]->shape[2] = D;
            vs[i]->stride[0] = ld, vs[i]->stride[1] = D, vs[i]->stride[2] = 1;
        }
    }
    for (int b = 0; b < 2; b++) {
        if (acc_dx)
            mat_set_from(&dx[b], &dx0);
        else
            poison(dx[b].p, T * ld);
        if (in_place) /* dx is dy's very view */
            for (int64_t t = 0; t < T; t++)
                memcpy(mat_at(&dx[b], t, 0), mat_at(&dy, t, 0), (size_t)(heads * D) * 4);
        poison(dw[b], D + 2);
        memcpy(dw[b], dw0, (size_t)D * 4);
        df_tensor tdw = df_tensor_1d(dw[b], DF_DTYPE_F32, D);
        CHECK_EQ(df_op_rmsnorm_bwd(bes[b], &vx, &w.t, eps, plus_one, in_place ? &vdx[b] : &vdy,
                                   with_dx ? &vdx[b] : NULL, acc_dx, &tdw),
                 0);
        CHECK(is_poison(dw[b][D]) && is_poison(dw[b][D + 1]));
        if (with_dx && !in_place)
            CHECK(pad_intact(&dx[b]));
    }
    if ((with_dx && !bitwise_equal(dx[0].p, dx[1].p, T * ld * 4)) ||
        !bitwise_equal(dw[0], dw[1], D * 4)) {
        fprintf(stderr, "%s: 1 and 3 threads differ\n", what);
        df_test_failures++;
    }
    double *xh = dbuf(D), *dws = dbuf(D), *dwa = dbuf(D);
    for (int64_t i = 0; i < D; i++)
        dws[i] = dw0[i], dwa[i] = fabs(dw0[i]);
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = r / heads, c0 = (r % heads) * D;
        double ss = 0, cs = 0, ca = 0;
        for (int64_t i = 0; i < D; i++)
            ss += (double)*mat_at(&x, t, c0 + i) * *mat_at(&x, t, c0 + i);
        double rr = 1.0 / sqrt(ss / (double)D + eps);
        for (int64_t i = 0; i < D; i++) {
            double gi = plus_one ? 1.0 + w.val[i] : w.val[i], dyi = *mat_at(&dy, t, c0 + i);
            xh[i] = *mat_at(&x, t, c0 + i) * rr;
            cs += gi * dyi * xh[i];
            ca += fabs(gi * dyi * xh[i]);
            dws[i] += dyi * xh[i];
            dwa[i] += fabs(dyi * xh[i]);
        }
        cs /= (double)D, ca /= (double)D;
        if (!with_dx)
            continue;
        for (int64_t i = 0; i < D; i++) {
            double gi = plus_one ? 1.0 + w.val[i] : w.val[i], dyi = *mat_at(&dy, t, c0 + i);
            double ref = rr * (gi * dyi - xh[i] * cs);
            double mag = rr * (fabs(gi * dyi) + fabs(xh[i]) * ca);
            if (acc_dx) { /* the old dx: dx0, or dy itself when dx is dy's view */
                double old = in_place ? dyi : *mat_at(&dx0, t, c0 + i);
                ref += old, mag += fabs(old);
            }
            expect_close(what, *mat_at(&dx[0], t, c0 + i), ref, 1e-5 * mag + 1e-30, r * D + i);
        }
    }
    for (int64_t i = 0; i < D; i++)
        expect_close(what, dw[0][i], dws[i], 2e-5 * dwa[i], i);
    free(x.p), free(dy.p), free(dx0.p), free(dw0), free(xh), free(dws), free(dwa);
    for (int b = 0; b < 2; b++)
        free(dx[b].p), free(dw[b]);
    wmat_free(&w);
}

/* BF16 dw of rmsnorm_bwd ([rows, D] x and dy, padded rows; dx own or
 * none): the same call with an F32 dw holding the widened old values must
 * give the same dx bit for bit, and each bf16 dw element must be exactly
 * RNE of that f32 dw element (the fixed-order fp32 sum plus the old value,
 * rounded once); against the sum in double, expect_bf16_grad's rule with
 * the F32 test's 2e-5 sum|terms|. 1 and 3 threads: bitwise equal. */
static void check_rmsnorm_bwd_bf16(int64_t rows, int64_t D, df_dtype wt, int plus_one,
                                   int with_dx)
{
    char what[128];
    snprintf(what, sizeof what, "rmsnorm_bwd bf16 dw rows=%lld D=%lld %s +1=%d dx=%d",
             (long long)rows, (long long)D, df_dtype_name(wt), plus_one, with_dx);
    const float eps = 1e-6f;
    const int64_t ld = D + 3;
    mat x = mat_rand(rows, D, ld, 1.0f), dy = mat_rand(rows, D, ld, 1.0f);
    for (int64_t r = 0; r < rows; r++) /* rows of very different scales */
        for (int64_t c = 0; c < D; c++)
            *mat_at(&x, r, c) *= (float)(1 + r % 5) * 0.7f;
    wmat w = wvec_new(wt, D, 0.3f, plus_one ? 0.0f : 1.0f);
    uint16_t *old = xmalloc((size_t)D * 2);
    for (int64_t i = 0; i < D; i++) {
        float v = test_randn(&rng);
        old[i] = df_f32_to_bf16(fabsf(v) < 0.05f ? 0.05f : v);
    }
    uint16_t *dw[2];
    float *dwf = fbuf(D + 2);
    mat dx[3] = {mat_new(rows, D, ld), mat_new(rows, D, ld), mat_new(rows, D, ld)};
    for (int b = 0; b < 3; b++)
        poison(dx[b].p, rows * ld);
    for (int b = 0; b < 2; b++) {
        dw[b] = bf_mat(1, D, D + 2, old);
        df_tensor tdw = df_tensor_1d(dw[b], DF_DTYPE_BF16, D);
        CHECK_EQ(df_op_rmsnorm_bwd(bes[b], &x.t, &w.t, eps, plus_one, &dy.t,
                                   with_dx ? &dx[b].t : NULL, 0, &tdw),
                 0);
        CHECK(dw[b][D] == BF_POISON && dw[b][D + 1] == BF_POISON);
    }
    poison(dwf, D + 2);
    for (int64_t i = 0; i < D; i++)
        dwf[i] = bf_val(old[i]);
    df_tensor tdwf = df_tensor_1d(dwf, DF_DTYPE_F32, D);
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w.t, eps, plus_one, &dy.t,
                               with_dx ? &dx[2].t : NULL, 0, &tdwf),
             0);
    if (!bitwise_equal(dw[0], dw[1], D * 2) ||
        (with_dx && !bitwise_equal(dx[0].p, dx[1].p, rows * ld * 4))) {
        fprintf(stderr, "%s: 1 and 3 threads differ\n", what);
        df_test_failures++;
    }
    if (with_dx && !bitwise_equal(dx[0].p, dx[2].p, rows * ld * 4)) {
        fprintf(stderr, "%s: dx differs between a BF16 and an F32 dw\n", what);
        df_test_failures++;
    }
    double *dws = dbuf(D), *dwa = dbuf(D);
    for (int64_t i = 0; i < D; i++)
        dws[i] = bf_val(old[i]), dwa[i] = fabs(bf_val(old[i]));
    for (int64_t r = 0; r < rows; r++) {
        double ss = 0;
        for (int64_t i = 0; i < D; i++)
            ss += (double)*mat_at(&x, r, i) * *mat_at(&x, r, i);
        double rr = 1.0 / sqrt(ss / (double)D + eps);
        for (int64_t i = 0; i < D; i++) {
            double t = *mat_at(&dy, r, i) * (*mat_at(&x, r, i) * rr);
            dws[i] += t, dwa[i] += fabs(t);
        }
    }
    int64_t not_rne = 0;
    for (int64_t i = 0; i < D; i++) {
        not_rne += !is_bf16_rne(dwf[i], dw[0][i]);
        expect_bf16_grad(what, dw[0][i], dws[i], 2e-5 * dwa[i], i);
    }
    if (not_rne) {
        fprintf(stderr, "%s: %lld elements not RNE(the F32 path's)\n", what, (long long)not_rne);
        df_test_failures++;
    }
    free(x.p), free(dy.p), free(old), free(dw[0]), free(dw[1]), free(dwf), free(dws), free(dwa);
    for (int b = 0; b < 3; b++)
        free(dx[b].p);
    wmat_free(&w);
}

static void test_rmsnorm_bwd(void)
{
    for (int p1 = 0; p1 < 2; p1++)
        for (int d = 0; d < 3; d++)
            fd_rmsnorm(p1, DTS[d]);
    /* rows pieces are max(64, 65536/D) rows: 5000 x 16 and 200 x 1000 cross them. */
    check_rmsnorm_bwd(5000, 16, 1, DF_DTYPE_F32, 0, 1, 0, 0);
    check_rmsnorm_bwd(200, 1000, 1, DF_DTYPE_BF16, 0, 1, 1, 0);
    check_rmsnorm_bwd(200, 1000, 1, DF_DTYPE_BF16, 1, 1, 0, 0);
    check_rmsnorm_bwd(7, 33, 1, DF_DTYPE_F16, 1, 1, 1, 0);
    check_rmsnorm_bwd(1, 1, 1, DF_DTYPE_F32, 0, 1, 0, 0);
    check_rmsnorm_bwd(300, 24, 4, DF_DTYPE_BF16, 0, 1, 0, 0); /* per-head 3-D view */
    check_rmsnorm_bwd(90, 40, 3, DF_DTYPE_F32, 0, 1, 1, 1);   /* dx = dy's view, accumulate */
    check_rmsnorm_bwd(90, 40, 1, DF_DTYPE_F32, 0, 1, 0, 1);   /* dx = dy's view */
    check_rmsnorm_bwd(129, 40, 1, DF_DTYPE_F32, 1, 0, 0, 0);  /* dw only */
    /* BF16 dw: several row pieces (5000 x 16: pieces of 4096 rows), big D. */
    check_rmsnorm_bwd_bf16(5000, 16, DF_DTYPE_F32, 0, 1);
    check_rmsnorm_bwd_bf16(200, 1000, DF_DTYPE_BF16, 1, 1);
    check_rmsnorm_bwd_bf16(7, 33, DF_DTYPE_F16, 1, 1);
    check_rmsnorm_bwd_bf16(1, 1, DF_DTYPE_F32, 0, 1);
    check_rmsnorm_bwd_bf16(129, 40, DF_DTYPE_BF16, 0, 0);

    /* Bad arguments. */
    mat x = mat_rand(4, 8, 8, 1.0f), dy = mat_rand(4, 8, 8, 1.0f), dx = mat_new(4, 8, 8);
    wmat w = wvec_new(DF_DTYPE_BF16, 8, 0.3f, 1.0f), w7 = wvec_new(DF_DTYPE_BF16, 7, 0.3f, 1.0f);
    float dwv[9];
    df_tensor dw = df_tensor_1d(dwv, DF_DTYPE_F32, 8), t;
    poison(dx.p, 32), poison(dwv, 9);
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w7.t, 1e-6f, 0, &dy.t, &dx.t, 0, &dw), -EINVAL);
    t = dw, t.shape[0] = 7;
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w.t, 1e-6f, 0, &dy.t, &dx.t, 0, &t), -EINVAL);
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w.t, 1e-6f, 0, &dy.t, &dx.t, 0, NULL), -EINVAL);
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w.t, -1.0f, 0, &dy.t, &dx.t, 0, &dw), -EINVAL);
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w.t, NAN, 0, &dy.t, &dx.t, 0, &dw), -EINVAL);
    t = dy.t, t.shape[0] = 3;
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w.t, 1e-6f, 0, &t, &dx.t, 0, &dw), -EINVAL);
    t = dx.t, t.shape[0] = 3;
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w.t, 1e-6f, 0, &dy.t, &t, 0, &dw), -EINVAL);
    t = dw, t.dtype = DF_DTYPE_F16; /* weight gradients are F32 or BF16 */
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w.t, 1e-6f, 0, &dy.t, &dx.t, 0, &t), -EINVAL);
    t = dw, t.dtype = DF_DTYPE_INVALID;
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w.t, 1e-6f, 0, &dy.t, &dx.t, 0, &t), -EINVAL);
    /* dx partly overlapping dy (shifted by a column), dw inside dx */
    df_tensor shifted = df_tensor_2d(dy.p + 1, DF_DTYPE_F32, 4, 7);
    df_tensor x7 = df_tensor_cols(&x.t, 0, 7), dy7 = df_tensor_cols(&dy.t, 0, 7);
    wmat wv7 = wvec_new(DF_DTYPE_F32, 7, 0.3f, 1.0f);
    float dwv7[7];
    df_tensor dw7 = df_tensor_1d(dwv7, DF_DTYPE_F32, 7);
    shifted.stride[0] = 8;
    float dyc[32];
    memcpy(dyc, dy.p, sizeof dyc);
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x7, &wv7.t, 1e-6f, 0, &dy7, &shifted, 0, &dw7), -EINVAL);
    CHECK(bitwise_equal(dyc, dy.p, sizeof dyc));
    df_tensor dw_in_dx = df_tensor_1d(dx.p + 8, DF_DTYPE_F32, 8);
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w.t, 1e-6f, 0, &dy.t, &dx.t, 0, &dw_in_dx), -EINVAL);
    df_tensor dw_in_dy = df_tensor_1d(dy.p, DF_DTYPE_F32, 8);
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w.t, 1e-6f, 0, &dy.t, &dx.t, 0, &dw_in_dy), -EINVAL);
    df_tensor dwb_in_dy = df_tensor_1d(dy.p + 31, DF_DTYPE_BF16, 8); /* dy's last float */
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w.t, 1e-6f, 0, &dy.t, &dx.t, 0, &dwb_in_dy),
             -EINVAL);
    df_tensor dwb_in_dx = df_tensor_1d(dx.p + 4, DF_DTYPE_BF16, 8);
    CHECK_EQ(df_op_rmsnorm_bwd(bes[0], &x.t, &w.t, 1e-6f, 0, &dy.t, &dx.t, 0, &dwb_in_dx),
             -EINVAL);
    CHECK(bitwise_equal(dyc, dy.p, sizeof dyc));
    CHECK(all_poison(dx.p, 32) && all_poison(dwv, 9));
    free(x.p), free(dy.p), free(dx.p);
    wmat_free(&w), wmat_free(&w7), wmat_free(&wv7);
}

/* ---- RoPE backward ---- */

/* The forward's angles (fp32 inv_freq, one fp32 product), cos/sin in double. */
static void rope_angles(int32_t pos, int rot, double theta, double *c, double *s)
{
    float base = (float)theta;
    for (int d = 0; d < rot / 2; d++) {
        float invf = 1.0f / powf(base, (float)(2 * d) / (float)rot);
        float ang = (float)pos * invf;
        c[d] = cos((double)ang);
        s[d] = sin((double)ang);
    }
}

/* FD of L = sum R .* rope(x). The gradient is linear in R, each element two
 * fp32 products and a sum, and cosf/sinf within an ulp: a few u of
 * max|grad|; 1e-5 is a wide margin, a wrong sign of the angle is O(1). */
static void fd_rope(void)
{
    const int T = 3, heads = 2, hd = 6, rot = 4;
    const double theta = 10000.0;
    int32_t pos[3] = {0, 5, 1234};
    mat x = mat_rand(T, heads * hd, heads * hd, 1.0f), R = mat_rand(T, heads * hd, heads * hd, 1.0f);
    double *xv = dbuf(T * heads * hd), *num = dbuf(T * heads * hd), c[8], s[8];
    for (int i = 0; i < T * heads * hd; i++)
        xv[i] = x.p[i];
    for (int e = 0; e < T * heads * hd; e++) {
        double save = xv[e], L[2];
        for (int sg = 0; sg < 2; sg++) {
            xv[e] = save + (sg ? -FD_H : FD_H);
            double acc = 0;
            for (int t = 0; t < T; t++) {
                rope_angles(pos[t], rot, theta, c, s);
                for (int h = 0; h < heads; h++) {
                    const double *v = xv + t * heads * hd + h * hd;
                    const float *r = R.p + t * heads * hd + h * hd;
                    for (int d = 0; d < rot / 2; d++) {
                        acc += r[d] * (v[d] * c[d] - v[d + rot / 2] * s[d]);
                        acc += r[d + rot / 2] * (v[d + rot / 2] * c[d] + v[d] * s[d]);
                    }
                    for (int d = rot; d < hd; d++)
                        acc += r[d] * v[d];
                }
            }
            L[sg] = acc;
        }
        xv[e] = save;
        num[e] = (L[0] - L[1]) / (2 * FD_H);
    }
    CHECK_EQ(df_op_rope_bwd(bes[0], &R.t, pos, heads, hd, rot, theta), 0);
    fd_compare(FD_ROPE, "fd rope dx", R.p, num, T * heads * hd, 1e-5);
    free(x.p), free(R.p), free(xv), free(num);
}

/* Against the transposed rotation in double (tolerance: two fp32 products
 * and a sum plus cosf/sinf within an ulp, 1e-6 of |d1| + |d2|), and
 * rope_bwd(rope(x)) == x to the same accuracy (the rotation is orthogonal). */
static void check_rope_bwd(int64_t T, int heads, int hd, int rot, double theta)
{
    char what[96];
    snprintf(what, sizeof what, "rope_bwd T=%lld heads=%d hd=%d rot=%d", (long long)T, heads, hd,
             rot);
    int64_t W = (int64_t)heads * hd, ld = W + 3;
    int32_t *pos = xmalloc((size_t)(T ? T : 1) * sizeof(int32_t));
    for (int64_t t = 0; t < T; t++)
        pos[t] = (int32_t)(test_rand(&rng) % 6000);
    mat d0 = mat_rand(T, W, ld, 1.0f), d[2] = {mat_new(T, W, ld), mat_new(T, W, ld)};
    for (int b = 0; b < 2; b++) {
        mat_set_from(&d[b], &d0);
        CHECK_EQ(df_op_rope_bwd(bes[b], &d[b].t, pos, heads, hd, rot, theta), 0);
        CHECK(pad_intact(&d[b]));
    }
    CHECK(bitwise_equal(d[0].p, d[1].p, T * ld * 4));
    double *c = dbuf(rot / 2), *s = dbuf(rot / 2);
    for (int64_t t = 0; t < T; t++) {
        rope_angles(pos[t], rot, theta, c, s);
        for (int h = 0; h < heads; h++) {
            const float *in = mat_at(&d0, t, (int64_t)h * hd), *out = mat_at(&d[0], t, (int64_t)h * hd);
            for (int k = 0; k < rot / 2; k++) {
                double d1 = in[k], d2 = in[k + rot / 2], tol = 1e-6 * (fabs(d1) + fabs(d2));
                expect_close(what, out[k], d1 * c[k] + d2 * s[k], tol, t * W + h * hd + k);
                expect_close(what, out[k + rot / 2], d2 * c[k] - d1 * s[k], tol,
                             t * W + h * hd + k + rot / 2);
            }
            for (int k = rot; k < hd; k++)
                expect_close(what, out[k], in[k], 0.0, t * W + h * hd + k);
        }
    }
    /* round trip */
    mat_set_from(&d[1], &d0);
    CHECK_EQ(df_op_rope(bes[0], &d[1].t, pos, heads, hd, rot, theta), 0);
    CHECK_EQ(df_op_rope_bwd(bes[0], &d[1].t, pos, heads, hd, rot, theta), 0);
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < W; k++)
            expect_close(what, *mat_at(&d[1], t, k), *mat_at(&d0, t, k), 4e-6, t * W + k);
    free(pos), free(d0.p), free(d[0].p), free(d[1].p), free(c), free(s);
}

static void test_rope_bwd(void)
{
    fd_rope();
    check_rope_bwd(37, 4, 128, 128, 1e7);
    check_rope_bwd(300, 2, 64, 32, 10000.0); /* partial rotation (Qwen3.5 style) */
    check_rope_bwd(1, 1, 2, 2, 1e6);
    check_rope_bwd(0, 2, 8, 8, 1e4);

    mat d = mat_new(3, 16, 16);
    int32_t pos[3] = {0, 1, 2};
    poison(d.p, 48);
    CHECK_EQ(df_op_rope_bwd(bes[0], &d.t, pos, 3, 5, 4, 1e4), -EINVAL);   /* 3*5 != 16 */
    CHECK_EQ(df_op_rope_bwd(bes[0], &d.t, pos, 2, 8, 9, 1e4), -EINVAL);   /* rot > hd */
    CHECK_EQ(df_op_rope_bwd(bes[0], &d.t, pos, 2, 8, 3, 1e4), -EINVAL);   /* odd rot */
    CHECK_EQ(df_op_rope_bwd(bes[0], &d.t, pos, 2, 8, 8, 0.0), -EINVAL);   /* theta */
    CHECK_EQ(df_op_rope_bwd(bes[0], &d.t, pos, 2, 8, 8, 1e300), -EINVAL); /* inf in fp32 */
    CHECK_EQ(df_op_rope_bwd(bes[0], &d.t, NULL, 2, 8, 8, 1e4), -EINVAL);
    CHECK_EQ(df_op_rope_bwd(NULL, &d.t, pos, 2, 8, 8, 1e4), -EINVAL);
    CHECK(all_poison(d.p, 48));
    free(d.p);
}

/* ---- SwiGLU backward ---- */

static double silu_d(double g)
{
    return g / (1.0 + exp(-g));
}

/* FD of L = sum R .* silu(g) u over g and u. The analytic values are a
 * handful of fp32 operations (expf within an ulp): ~5u relative to the
 * terms, O(max|grad|) here; 1e-5 is a wide margin. */
static void fd_swiglu(void)
{
    const int64_t n = 12;
    mat g = mat_rand(1, n, n, 2.0f), u = mat_rand(1, n, n, 1.0f), R = mat_rand(1, n, n, 1.0f);
    g.p[0] = -1.2784645f; /* near silu's minimum, where silu' crosses 0 */
    g.p[1] = 6.0f;
    g.p[2] = -7.0f;
    double *num_g = dbuf(n), *num_u = dbuf(n);
    for (int64_t e = 0; e < n; e++) {
        double gg = g.p[e], uu = u.p[e], r = R.p[e];
        num_g[e] = (r * silu_d(gg + FD_H) * uu - r * silu_d(gg - FD_H) * uu) / (2 * FD_H);
        num_u[e] = (r * silu_d(gg) * (uu + FD_H) - r * silu_d(gg) * (uu - FD_H)) / (2 * FD_H);
    }
    mat dg = mat_new(1, n, n), du = mat_new(1, n, n);
    poison(dg.p, n), poison(du.p, n);
    CHECK_EQ(df_op_swiglu_bwd(bes[0], &g.t, &u.t, &R.t, &dg.t, &du.t), 0);
    fd_compare(FD_SWIGLU, "fd swiglu dgate", dg.p, num_g, n, 1e-5);
    fd_compare(FD_SWIGLU, "fd swiglu dup", du.p, num_u, n, 1e-5);
    free(g.p), free(u.p), free(R.p), free(dg.p), free(du.p), free(num_g), free(num_u);
}

/* Against the formula in double; tolerance 1e-5 of the magnitude of the
 * terms (|dout up| (s + |g| s (1 - s)) for dgate: the bracket 1 + g(1-s)
 * cancels near g = -1.28, which costs u of the terms, not of the result;
 * 1e-30 absolute: for g < -88.7 expf overflows, s = 0, and fp32 gives 0
 * where the double reference has ~1e-36). */
static void check_swiglu_bwd(int64_t T, int64_t F, int in_place)
{
    char what[64];
    snprintf(what, sizeof what, "swiglu_bwd T=%lld F=%lld ip=%d", (long long)T, (long long)F,
             in_place);
    /* gate and up as the column halves of one [T, 2F] GEMM output, and the
     * gradients likewise: the fused layout. */
    mat gu = mat_rand(T, 2 * F, 2 * F + 1, 3.0f), dout = mat_rand(T, F, F + 2, 1.0f);
    if (T > 0 && F >= 6) { /* extremes: no NaN, limits exact */
        float ext[6] = {-100.0f, -30.0f, 30.0f, 100.0f, -88.8f, 89.0f};
        for (int i = 0; i < 6; i++)
            *mat_at(&gu, 0, i) = ext[i];
    }
    /* [2]: df_op_swiglu_bwd_fp8, whose hint changes no bit */
    mat dgu[3] = {mat_new(T, 2 * F, 2 * F + 1), mat_new(T, 2 * F, 2 * F + 1),
                  mat_new(T, 2 * F, 2 * F + 1)};
    for (int b = 0; b < 3; b++) {
        df_tensor g = df_tensor_cols(&gu.t, 0, F), u = df_tensor_cols(&gu.t, F, F);
        if (in_place)
            mat_set_from(&dgu[b], &gu);
        else
            poison(dgu[b].p, T * dgu[b].ld);
        df_tensor dg = df_tensor_cols(&dgu[b].t, 0, F), du = df_tensor_cols(&dgu[b].t, F, F);
        const df_tensor *gi = in_place ? &dg : &g, *ui = in_place ? &du : &u; /* in place: dgate = gate's view */
        if (b < 2)
            CHECK_EQ(df_op_swiglu_bwd(bes[b], gi, ui, &dout.t, &dg, &du), 0);
        else
            CHECK_EQ(df_op_swiglu_bwd_fp8(bes[1], gi, ui, &dout.t, &dg, &du,
                                          DF_FP8_DY_BLOCKS | DF_FP8_ONLY_CODES), 0);
        CHECK(pad_intact(&dgu[b]));
    }
    CHECK(bitwise_equal(dgu[0].p, dgu[1].p, T * dgu[0].ld * 4));
    CHECK(bitwise_equal(dgu[0].p, dgu[2].p, T * dgu[0].ld * 4));
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < F; i++) {
            double g = *mat_at(&gu, t, i), u = *mat_at(&gu, t, F + i), d = *mat_at(&dout, t, i);
            double s = 1.0 / (1.0 + exp(-g));
            double rg = d * u * s * (1.0 + g * (1.0 - s)), ru = d * silu_d(g);
            double tg = 1e-5 * fabs(d * u) * (s + fabs(g) * s * (1.0 - s)) + 1e-30;
            expect_close(what, *mat_at(&dgu[0], t, i), rg, tg, t * F + i);
            expect_close(what, *mat_at(&dgu[0], t, F + i), ru, 1e-5 * fabs(ru) + 1e-30, t * F + i);
        }
    free(gu.p), free(dout.p), free(dgu[0].p), free(dgu[1].p), free(dgu[2].p);
}

static void test_swiglu_bwd(void)
{
    fd_swiglu();
    check_swiglu_bwd(33, 70, 0);
    check_swiglu_bwd(33, 70, 1);
    check_swiglu_bwd(1000, 200, 0);
    check_swiglu_bwd(0, 8, 0);

    mat a = mat_rand(4, 8, 8, 1.0f), b = mat_rand(4, 8, 8, 1.0f), d = mat_rand(4, 8, 8, 1.0f);
    mat o = mat_new(4, 16, 16);
    poison(o.p, 64);
    df_tensor o1 = df_tensor_cols(&o.t, 0, 8), o2 = df_tensor_cols(&o.t, 8, 8),
              o3 = df_tensor_cols(&o.t, 4, 8), t;
    CHECK_EQ(df_op_swiglu_bwd(bes[0], &a.t, &b.t, &d.t, &o1, &o1), -EINVAL); /* dgate == dup */
    CHECK_EQ(df_op_swiglu_bwd(bes[0], &a.t, &b.t, &d.t, &o1, &o3), -EINVAL); /* overlap */
    t = b.t, t.shape[0] = 3;
    CHECK_EQ(df_op_swiglu_bwd(bes[0], &a.t, &t, &d.t, &o1, &o2), -EINVAL);
    t = d.t, t.dtype = DF_DTYPE_BF16;
    CHECK_EQ(df_op_swiglu_bwd(bes[0], &a.t, &b.t, &t, &o1, &o2), -EINVAL);
    CHECK_EQ(df_op_swiglu_bwd(bes[0], &a.t, &b.t, NULL, &o1, &o2), -EINVAL);
    /* df_op_swiglu_fp8: df_op_swiglu's bits (its hint is for E4M3 tensor cores); flags checked */
    {
        mat y0 = mat_new(4, 8, 8), y1 = mat_new(4, 8, 8);
        CHECK_EQ(df_op_swiglu(bes[0], &a.t, &b.t, &y0.t), 0);
        CHECK_EQ(df_op_swiglu_fp8(bes[1], &a.t, &b.t, &y1.t, DF_FP8_X_FWD | DF_FP8_X_BWD_W), 0);
        CHECK(bitwise_equal(y0.p, y1.p, 32 * 4));
        CHECK_EQ(df_op_swiglu_fp8(bes[0], &a.t, &b.t, &y1.t, 0), -EINVAL);
        CHECK_EQ(df_op_swiglu_fp8(bes[0], &a.t, &b.t, &y1.t, DF_FP8_MADE), -EINVAL);
        CHECK_EQ(df_op_swiglu_fp8(bes[0], &a.t, &b.t, &y1.t, DF_FP8_ONLY_CODES), -EINVAL);
        /* DF_FP8_ONLY_CODES lets a backend leave out the values; the CPU writes them */
        memset(y1.p, 0, 32 * 4);
        CHECK_EQ(df_op_swiglu_fp8(bes[1], &a.t, &b.t, &y1.t, DF_FP8_X_BWD_W | DF_FP8_ONLY_CODES), 0);
        CHECK(bitwise_equal(y0.p, y1.p, 32 * 4));
        CHECK_EQ(df_op_swiglu_fp8(NULL, &a.t, &b.t, &y1.t, DF_FP8_X_FWD), -EINVAL);
        free(y0.p), free(y1.p);
    }
    CHECK_EQ(df_op_swiglu_bwd_fp8(bes[0], &a.t, &b.t, &d.t, &o1, &o1, DF_FP8_DY_BLOCKS), -EINVAL);
    CHECK_EQ(df_op_swiglu_bwd_fp8(bes[0], &a.t, &b.t, &d.t, &o1, &o2, DF_FP8_MADE), -EINVAL);
    CHECK_EQ(df_op_swiglu_bwd_fp8(bes[0], &a.t, &b.t, &d.t, &o1, &o2, 256u), -EINVAL);
    CHECK_EQ(df_op_swiglu_bwd_fp8(NULL, &a.t, &b.t, &d.t, &o1, &o2, 0), -EINVAL);
    CHECK(all_poison(o.p, 64));
    /* an output partly over an input */
    float ac[32];
    memcpy(ac, a.p, sizeof ac);
    df_tensor half = df_tensor_2d(a.p + 4, DF_DTYPE_F32, 4, 4);
    half.stride[0] = 8;
    df_tensor a4 = df_tensor_cols(&a.t, 0, 4), b4 = df_tensor_cols(&b.t, 0, 4),
              d4 = df_tensor_cols(&d.t, 0, 4), o4 = df_tensor_cols(&o.t, 0, 4);
    CHECK_EQ(df_op_swiglu_bwd(bes[0], &a4, &b4, &d4, &o4, &half), 0); /* disjoint columns: fine */
    memcpy(a.p, ac, sizeof ac);
    poison(o.p, 64);
    df_tensor sh = df_tensor_2d(a.p + 1, DF_DTYPE_F32, 4, 4);
    sh.stride[0] = 8;
    CHECK_EQ(df_op_swiglu_bwd(bes[0], &a4, &b4, &d4, &o4, &sh), -EINVAL);
    CHECK(bitwise_equal(a.p, ac, sizeof ac) && all_poison(o.p, 64));
    free(a.p), free(b.p), free(d.p), free(o.p);
}

int main(void)
{
    if (open_backends())
        return 1;
    test_rmsnorm_bwd();
    test_rope_bwd();
    test_swiglu_bwd();
    for (int i = FD_NORM_X; i <= FD_SWIGLU; i++)
        printf("finite differences, %-13s max |analytic - numeric| / max|grad| = %.2e\n",
               fd_name[i], fd_worst[i]);
    printf("bf16 weight gradients: %lld elements checked, %lld where the sum cancels below the\n"
           "  fp32 bound's resolution (checked against that bound plus one rounding)\n",
           (long long)n_bf16_checked, (long long)n_cancel);
    close_backends();
    return test_main_end();
}
