/* test_matmul_bwd.c - the matmul backward ops of the CPU reference backend
 * (df_op_matmul_bwd_x / _w, weights in BF16, F16 or F32, BF16 or F32 dw),
 * checked as test_train_ops.c says (finite differences, a double reference
 * on odd shapes, 1 vs 3 threads bitwise, poisoning, bad arguments; the BF16
 * dw rule in grad_test_util.h).
 *
 * DFLASH_TRAIN_BENCH=1 also times matmul_bwd_x / _w (M=512, K=N=1024) on 1
 * and 2 threads. */
#include "grad_test_util.h"
#include "knobs.h"
#include "test.h"
#include "train_ops.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- matmul backward ---- */

/* Finite differences: L = sum R .* (x w^T) in double; dL/dx = R w, dL/dw = R^T x.
 * The sums are over <= 5 fp32 products: error a few u of max|grad|; 1e-5
 * leaves a wide margin and a transposed convention misses by O(1). */
static void fd_matmul(df_dtype wt)
{
    const int64_t M = 3, N = 4, K = 5;
    mat x = mat_rand(M, K, K, 1.0f), R = mat_rand(M, N, N, 1.0f);
    wmat w = wmat_new(wt, N, K, K, 1.0f);
    double *xv = dbuf(M * K), *wv = dbuf(N * K);
    for (int64_t i = 0; i < M * K; i++)
        xv[i] = x.p[i];
    memcpy(wv, w.val, (size_t)(N * K) * sizeof(double));
    double *num_x = dbuf(M * K), *num_w = dbuf(N * K);
    for (int pass = 0; pass < 2; pass++) {
        double *v = pass ? wv : xv, *num = pass ? num_w : num_x;
        int64_t n = pass ? N * K : M * K;
        for (int64_t e = 0; e < n; e++) {
            double save = v[e], L[2];
            for (int s = 0; s < 2; s++) {
                v[e] = save + (s ? -FD_H : FD_H);
                double acc = 0;
                for (int64_t i = 0; i < M; i++)
                    for (int64_t j = 0; j < N; j++) {
                        double y = 0;
                        for (int64_t k = 0; k < K; k++)
                            y += xv[i * K + k] * wv[j * K + k];
                        acc += R.p[i * N + j] * y;
                    }
                L[s] = acc;
            }
            v[e] = save;
            num[e] = (L[0] - L[1]) / (2 * FD_H);
        }
    }
    float *dx = fbuf(M * K), *dw = fbuf(N * K);
    df_tensor tdx = df_tensor_2d(dx, DF_DTYPE_F32, M, K), tdw = df_tensor_2d(dw, DF_DTYPE_F32, N, K);
    poison(dx, M * K);
    poison(dw, N * K);
    CHECK_EQ(df_op_matmul_bwd_x(bes[0], &R.t, &w.t, &tdx, 0), 0);
    CHECK_EQ(df_op_matmul_bwd_w(bes[0], &R.t, &x.t, &tdw, 0), 0);
    fd_compare(FD_MM_X, "fd matmul dx", dx, num_x, M * K, 1e-5);
    fd_compare(FD_MM_W, "fd matmul dw", dw, num_w, N * K, 1e-5);
    free(x.p), free(R.p), free(xv), free(wv), free(num_x), free(num_w), free(dx), free(dw);
    wmat_free(&w);
}

/* Reference sums in double with the sum of magnitudes: an fp32 sum of n
 * products errs by ~u * sum|terms| / 2 on random data whatever n; 2e-6 *
 * sum|terms| (old value included when accumulating) leaves ~30x margin and
 * still catches one dropped term (>= sum|terms| / n >= 1e-3 of it). */
static void check_matmul_bwd(int64_t M, int64_t N, int64_t K, df_dtype wt, int acc)
{
    char what[128];
    snprintf(what, sizeof what, "matmul_bwd M=%lld N=%lld K=%lld %s acc=%d", (long long)M,
             (long long)N, (long long)K, df_dtype_name(wt), acc);
    mat dy = mat_rand(M, N, N + 3, 1.0f), x = mat_rand(M, K, K + 2, 1.0f);
    wmat w = wmat_new(wt, N, K, K + (K % 2), 0.5f);
    mat dx0 = mat_rand(M, K, K + 5, 2.0f), dw0 = mat_rand(N, K, K + 1, 2.0f);
    mat dx[2] = {mat_new(M, K, K + 5), mat_new(M, K, K + 5)};
    mat dw[2] = {mat_new(N, K, K + 1), mat_new(N, K, K + 1)};
    for (int b = 0; b < 2; b++) {
        if (acc) {
            mat_set_from(&dx[b], &dx0);
            mat_set_from(&dw[b], &dw0);
        } else {
            poison(dx[b].p, M * dx[b].ld);
            poison(dw[b].p, N * dw[b].ld);
        }
        CHECK_EQ(df_op_matmul_bwd_x(bes[b], &dy.t, &w.t, &dx[b].t, acc), 0);
        CHECK_EQ(df_op_matmul_bwd_w(bes[b], &dy.t, &x.t, &dw[b].t, acc), 0);
        CHECK(pad_intact(&dx[b]));
        CHECK(pad_intact(&dw[b]));
    }
    if (!bitwise_equal(dx[0].p, dx[1].p, M * dx[0].ld * 4) ||
        !bitwise_equal(dw[0].p, dw[1].p, N * dw[0].ld * 4)) {
        fprintf(stderr, "%s: 1 and 3 threads differ\n", what);
        df_test_failures++;
    }
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k++) {
            double s = 0, a = 0;
            for (int64_t n = 0; n < N; n++) {
                double p = (double)*mat_at(&dy, i, n) * w.val[n * K + k];
                s += p, a += fabs(p);
            }
            if (acc)
                s += *mat_at(&dx0, i, k), a += fabs(*mat_at(&dx0, i, k));
            expect_close(what, *mat_at(&dx[0], i, k), s, 2e-6 * a, i * K + k);
        }
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) {
            double s = 0, a = 0;
            for (int64_t i = 0; i < M; i++) {
                double p = (double)*mat_at(&dy, i, n) * *mat_at(&x, i, k);
                s += p, a += fabs(p);
            }
            if (acc)
                s += *mat_at(&dw0, n, k), a += fabs(*mat_at(&dw0, n, k));
            expect_close(what, *mat_at(&dw[0], n, k), s, 2e-6 * a, n * K + k);
        }
    free(dy.p), free(x.p), free(dx0.p), free(dw0.p);
    for (int b = 0; b < 2; b++)
        free(dx[b].p), free(dw[b].p);
    wmat_free(&w);
}

/* A [rows, ld] bf16 matrix: poison everywhere, then (if vals) the values
 * of vals [rows, cols] (bf16 bits) in the live columns. */

static int bf_pad_intact(const uint16_t *p, int64_t rows, int64_t cols, int64_t ld)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = cols; c < ld; c++)
            if (p[r * ld + c] != BF_POISON)
                return 0;
    return 1;
}

/* A nonzero k / 8, |k| <= 16: products and sums of a few thousand of them
 * are exact in fp32 (multiples of 1/64 below 2^17), in any order. */
static float small_exact(void)
{
    int k = (int)(test_rand(&rng) % 32) - 16;
    return (float)(k >= 0 ? k + 1 : k) / 8.0f;
}

/* BF16 dw of matmul_bwd_w against three references:
 *   - the same call with an F32 dw holding the widened old values: each
 *     bf16 element must be exactly RNE of that f32 element (the same fp32
 *     sum, the old value added last in fp32, one rounding);
 *   - the sum in double (plus the old value), by expect_bf16_grad's rule
 *     (at most 1 bf16 ulp; the F32 test's 2e-6 sum|terms| before rounding
 *     where the sum cancels);
 *   - exact: dy, x small multiples of 1/8 and old values bf16 numbers >= 2
 *     (multiples of 1/64), so every fp32 sum is exact: each element must
 *     be RNE(exact value) bit for bit (ties included: sums of such values
 *     often fall halfway between two bf16 numbers).
 * 1 and 3 threads: bitwise equal. Padding columns stay poisoned. */
static void check_matmul_bwd_w_bf16(int64_t M, int64_t N, int64_t K, int acc, int exact)
{
    char what[128];
    snprintf(what, sizeof what, "matmul_bwd_w bf16 dw M=%lld N=%lld K=%lld acc=%d exact=%d",
             (long long)M, (long long)N, (long long)K, acc, exact);
    mat dy = mat_rand(M, N, N + 3, 1.0f), x = mat_rand(M, K, K + 2, 1.0f);
    if (exact) {
        for (int64_t i = 0; i < M * (N + 3); i++)
            dy.p[i] = small_exact();
        for (int64_t i = 0; i < M * (K + 2); i++)
            x.p[i] = small_exact();
    }
    const int64_t ld = K + 1;
    uint16_t *old = xmalloc((size_t)(N * K + 1) * 2);
    for (int64_t i = 0; i < N * K; i++) {
        float v = test_randn(&rng) * 2.0f;
        if (exact) /* a bf16 number >= 2 in magnitude: a multiple of 1/64 */
            v = (v < 0 ? -2.0f : 2.0f) + v * 64.0f;
        if (fabsf(v) < 0.05f)
            v = 0.05f;
        old[i] = df_f32_to_bf16(v);
    }
    uint16_t *dw[2] = {bf_mat(N, K, ld, acc ? old : NULL), bf_mat(N, K, ld, acc ? old : NULL)};
    mat dwf = mat_new(N, K, ld); /* the F32 path on the widened old values */
    poison(dwf.p, N * ld);
    for (int64_t n = 0; acc && n < N; n++)
        for (int64_t k = 0; k < K; k++)
            *mat_at(&dwf, n, k) = bf_val(old[n * K + k]);
    for (int b = 0; b < 2; b++) {
        df_tensor full = df_tensor_2d(dw[b], DF_DTYPE_BF16, N, ld);
        df_tensor t = df_tensor_cols(&full, 0, K);
        CHECK_EQ(df_op_matmul_bwd_w(bes[b], &dy.t, &x.t, &t, acc), 0);
        CHECK(bf_pad_intact(dw[b], N, K, ld));
    }
    CHECK_EQ(df_op_matmul_bwd_w(bes[0], &dy.t, &x.t, &dwf.t, acc), 0);
    if (!bitwise_equal(dw[0], dw[1], N * ld * 2)) {
        fprintf(stderr, "%s: 1 and 3 threads differ\n", what);
        df_test_failures++;
    }
    int64_t not_rne = 0, not_exact = 0;
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) {
            uint16_t got = dw[0][n * ld + k];
            not_rne += !is_bf16_rne(*mat_at(&dwf, n, k), got);
            double s = 0, a = 0;
            for (int64_t i = 0; i < M; i++) {
                double p = (double)*mat_at(&dy, i, n) * *mat_at(&x, i, k);
                s += p, a += fabs(p);
            }
            if (acc)
                s += bf_val(old[n * K + k]), a += fabs(bf_val(old[n * K + k]));
            if (exact)
                not_exact += got != bf16_of_double(s);
            else
                expect_bf16_grad(what, got, s, 2e-6 * a, n * K + k);
        }
    if (not_rne || not_exact) {
        fprintf(stderr, "%s: %lld elements not RNE(the F32 path's), %lld not RNE(exact sum)\n",
                what, (long long)not_rne, (long long)not_exact);
        df_test_failures++;
    }
    free(dy.p), free(x.p), free(old), free(dw[0]), free(dw[1]), free(dwf.p);
}

static void test_matmul_bwd(void)
{
    for (int d = 0; d < 3; d++)
        fd_matmul(DTS[d]);
    /* {M, N, K}. bwd_x: out [M, K] in 192-row x 64..512-column blocks, sum
     * over N in slices of 256; bwd_w: out [N, K], sum over M (transposed,
     * packed). Odd sizes, single rows/columns, exact register tiles, and
     * every boundary crossed. */
    static const int64_t shapes[][3] = {{1, 1, 1},     {1, 7, 5},    {7, 13, 33},
                                        {6, 16, 64},   {3, 1, 17},   {37, 300, 9},
                                        {300, 200, 530}, {193, 5, 70}, {0, 4, 5},
                                        {4, 0, 5},     {4, 5, 0}};
    for (int simd = 1; simd >= 0; simd--) {
        df_knob_set(DF_KNOB_CPU_SIMD, simd ? "1" : "0");
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (int d = 0; d < 3; d++)
                for (int acc = 0; acc < 2; acc++)
                    if (!(d == 1 && acc == 1) && !(shapes[s][0] == 300 && (d != 0 || !simd)))
                        check_matmul_bwd(shapes[s][0], shapes[s][1], shapes[s][2], DTS[d], acc);
    }
    df_knob_set(DF_KNOB_CPU_SIMD, NULL);

    /* BF16 dw. {M, N, K}: as above, plus N x K > 2^20 (the f32 buffer goes
     * in slabs of rows) and M = 0 (an empty sum: 0, or the old value). */
    CHECK(bf16_of_double(1.00390625) == 0x3f80 && bf16_of_double(1.01171875) == 0x3f82);
    CHECK(bf16_of_double(-1.00390625) == 0xbf80 && bf16_of_double(3.0) == 0x4040);
    CHECK(bf16_of_double(1.0039062500001) == 0x3f81 && bf16_dist(0x3f80, 0xbf80) == 0x7f00);
    static const int64_t bshapes[][3] = {{1, 1, 1},    {7, 13, 33}, {37, 300, 9},
                                         {193, 5, 70}, {3, 300, 4000}, {300, 200, 530},
                                         {0, 4, 5}};
    for (int simd = 1; simd >= 0; simd--) {
        df_knob_set(DF_KNOB_CPU_SIMD, simd ? "1" : "0");
        for (size_t s = 0; s < sizeof bshapes / sizeof bshapes[0]; s++)
            for (int acc = 0; acc < 2; acc++)
                if (simd || bshapes[s][0] * bshapes[s][1] * bshapes[s][2] < 1000000)
                    check_matmul_bwd_w_bf16(bshapes[s][0], bshapes[s][1], bshapes[s][2], acc, 0);
    }
    df_knob_set(DF_KNOB_CPU_SIMD, NULL);
    for (int acc = 0; acc < 2; acc++) {
        check_matmul_bwd_w_bf16(300, 40, 70, acc, 1);
        check_matmul_bwd_w_bf16(5, 300, 4000, acc, 1);
    }

    /* Bad arguments: -EINVAL, outputs untouched. */
    mat dy = mat_rand(4, 5, 5, 1.0f), x = mat_rand(4, 8, 8, 1.0f);
    wmat w = wmat_new(DF_DTYPE_BF16, 5, 8, 8, 1.0f);
    mat dx = mat_new(4, 8, 8), dw = mat_new(5, 8, 8);
    poison(dx.p, 32), poison(dw.p, 40);
    df_tensor t;
    t = dx.t, t.shape[1] = 7;
    CHECK_EQ(df_op_matmul_bwd_x(bes[0], &dy.t, &w.t, &t, 0), -EINVAL);
    t = dy.t, t.shape[0] = 3;
    CHECK_EQ(df_op_matmul_bwd_x(bes[0], &t, &w.t, &dx.t, 0), -EINVAL);
    CHECK_EQ(df_op_matmul_bwd_w(bes[0], &t, &x.t, &dw.t, 0), -EINVAL);
    t = w.t, t.dtype = DF_DTYPE_I32;
    CHECK_EQ(df_op_matmul_bwd_x(bes[0], &dy.t, &t, &dx.t, 0), -EINVAL);
    t = x.t, t.dtype = DF_DTYPE_BF16; /* activations are f32 */
    CHECK_EQ(df_op_matmul_bwd_w(bes[0], &dy.t, &t, &dw.t, 0), -EINVAL);
    t = dw.t, t.dtype = DF_DTYPE_F16; /* weight gradients are F32 or BF16 */
    CHECK_EQ(df_op_matmul_bwd_w(bes[0], &dy.t, &x.t, &t, 0), -EINVAL);
    t = dw.t, t.dtype = DF_DTYPE_I32;
    CHECK_EQ(df_op_matmul_bwd_w(bes[0], &dy.t, &x.t, &t, 1), -EINVAL);
    t = dw.t, t.shape[0] = 4;
    CHECK_EQ(df_op_matmul_bwd_w(bes[0], &dy.t, &x.t, &t, 0), -EINVAL);
    t = dx.t, t.stride[0] = 4; /* rows overlapping each other */
    CHECK_EQ(df_op_matmul_bwd_x(bes[0], &dy.t, &w.t, &t, 0), -EINVAL);
    t = dx.t, t.stride[1] = 2, t.shape[1] = 4, t.stride[0] = 8;
    CHECK_EQ(df_op_matmul_bwd_x(bes[0], &dy.t, &w.t, &t, 0), -EINVAL);
    CHECK_EQ(df_op_matmul_bwd_x(NULL, &dy.t, &w.t, &dx.t, 0), -EINVAL);
    CHECK_EQ(df_op_matmul_bwd_w(bes[0], &dy.t, &x.t, NULL, 0), -EINVAL);
    CHECK(all_poison(dx.p, 32) && all_poison(dw.p, 40));
    /* outputs on an input's memory: refused, the input untouched */
    float *xc = fbuf(32);
    memcpy(xc, x.p, 32 * 4);
    mat dy4 = mat_rand(4, 4, 4, 1.0f), dy8 = mat_rand(4, 8, 8, 1.0f);
    wmat w8 = wmat_new(DF_DTYPE_F32, 8, 8, 8, 1.0f);
    df_tensor on_x = df_tensor_2d(x.p, DF_DTYPE_F32, 4, 8);
    CHECK_EQ(df_op_matmul_bwd_x(bes[0], &x.t, &w8.t, &on_x, 0), -EINVAL); /* dx = dy */
    CHECK_EQ(df_op_matmul_bwd_w(bes[0], &dy4.t, &x.t, &on_x, 0), -EINVAL); /* dw = x */
    df_tensor on_w = df_tensor_2d(w8.p, DF_DTYPE_F32, 4, 8);
    CHECK_EQ(df_op_matmul_bwd_x(bes[0], &dy8.t, &w8.t, &on_w, 1), -EINVAL); /* dx in w */
    float *buf = fbuf(64);
    fill(buf, 64, 1.0f);
    df_tensor dyb = df_tensor_2d(buf, DF_DTYPE_F32, 4, 4), dwb = df_tensor_2d(buf + 8, DF_DTYPE_F32, 4, 8);
    CHECK_EQ(df_op_matmul_bwd_w(bes[0], &dyb, &x.t, &dwb, 0), -EINVAL); /* dw over dy's tail */
    dwb.data = buf + 16;
    CHECK_EQ(df_op_matmul_bwd_w(bes[0], &dyb, &x.t, &dwb, 0), 0); /* right after it: fine */
    /* a BF16 dw spans 2-byte elements: [4, 8] bf16 = 16 floats' bytes */
    float *bufc = fbuf(64);
    memcpy(bufc, buf, 64 * 4);
    df_tensor dwbf = df_tensor_2d(buf + 16 - 1, DF_DTYPE_BF16, 4, 8); /* over dy's last float */
    CHECK_EQ(df_op_matmul_bwd_w(bes[0], &dyb, &x.t, &dwbf, 0), -EINVAL);
    CHECK(bitwise_equal(buf, bufc, 64 * 4));
    dwbf.data = buf + 16;
    CHECK_EQ(df_op_matmul_bwd_w(bes[0], &dyb, &x.t, &dwbf, 1), 0);
    CHECK(bitwise_equal(buf + 32, bufc + 32, 32 * 4)); /* it wrote 16 floats' bytes, no more */
    free(bufc);
    free(buf);
    CHECK(bitwise_equal(x.p, xc, 32 * 4));
    free(dy4.p), free(dy8.p), free(xc), free(dy.p), free(x.p), free(dx.p), free(dw.p);
    wmat_free(&w);
    wmat_free(&w8);
}

/* ---- bench ---- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void bench(void)
{
    const int64_t M = 512, K = 1024, N = 1024;
    mat dy = mat_rand(M, N, N, 1.0f), x = mat_rand(M, K, K, 1.0f), dx = mat_new(M, K, K),
        dw = mat_new(N, K, K);
    const df_dtype dts[] = {DF_DTYPE_BF16, DF_DTYPE_F32};
    for (int d = 0; d < 2; d++) {
        wmat w = wmat_new(dts[d], N, K, K, 0.05f);
        for (int nt = 1; nt <= 2; nt++) {
            df_backend *be = df_backend_cpu_open(nt, NULL);
            for (int op = 0; op < (d == 0 ? 2 : 1); op++) {
                double best = 1e30;
                for (int rep = 0; rep < 5; rep++) {
                    double t0 = now_s();
                    if (op == 0)
                        CHECK_EQ(df_op_matmul_bwd_x(be, &dy.t, &w.t, &dx.t, 0), 0);
                    else
                        CHECK_EQ(df_op_matmul_bwd_w(be, &dy.t, &x.t, &dw.t, 1), 0);
                    double dt = now_s() - t0;
                    best = dt < best ? dt : best;
                }
                printf("matmul_bwd_%s M=%lld K=%lld N=%lld%s%s threads=%d: %.2f ms, %.1f GFLOP/s\n",
                       op ? "w" : "x", (long long)M, (long long)K, (long long)N,
                       op ? "" : " w=", op ? "" : df_dtype_name(dts[d]), nt, best * 1e3,
                       2.0 * M * N * K / best * 1e-9);
            }
            df_backend_close(be);
        }
        wmat_free(&w);
    }
    free(dy.p), free(x.p), free(dx.p), free(dw.p);
}

int main(void)
{
    if (open_backends())
        return 1;
    test_matmul_bwd();
    for (int i = FD_MM_X; i <= FD_MM_W; i++)
        printf("finite differences, %-13s max |analytic - numeric| / max|grad| = %.2e\n",
               fd_name[i], fd_worst[i]);
    printf("bf16 weight gradients: %lld elements checked, %lld where the sum cancels below the\n"
           "  fp32 bound's resolution (checked against that bound plus one rounding)\n",
           (long long)n_bf16_checked, (long long)n_cancel);
    if (getenv("DFLASH_TRAIN_BENCH"))
        bench();
    close_backends();
    return test_main_end();
}
