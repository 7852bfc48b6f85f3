/* test_train_ops.c - the training ops of the CPU reference backend
 * (train_ops.h, all but the drafter attention): backward passes, the fused
 * LM-head CE (the optimizer's ops: test_optim.c).
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
 * ulp of the double reference rounded once (expect_bf16_grad says when more
 * than that can be right).
 *
 * DFLASH_TRAIN_BENCH=1 also times matmul_bwd_x / _w (M=512, K=N=1024) and
 * the LM-head CE on 1 and 2 threads. */
#include "knobs.h"
#include "train_ops.h"
#include "test.h"
#include "train_test_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const uint32_t POISON = 0x7fc0dead;

static void poison(float *p, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        memcpy(&p[i], &POISON, 4);
}

static int is_poison(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u == POISON;
}

static int all_poison(const float *p, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!is_poison(p[i]))
            return 0;
    return 1;
}

/* An f32 matrix [rows, cols] stored with row stride ld >= cols. */
typedef struct mat {
    float *p;
    int64_t rows, cols, ld;
    df_tensor t;
} mat;

static mat mat_new(int64_t rows, int64_t cols, int64_t ld)
{
    mat m = {fbuf(rows * ld), rows, cols, ld, {0}};
    df_tensor full = df_tensor_2d(m.p, DF_DTYPE_F32, rows, ld);
    m.t = df_tensor_cols(&full, 0, cols);
    return m;
}

static mat mat_rand(int64_t rows, int64_t cols, int64_t ld, float scale)
{
    mat m = mat_new(rows, cols, ld);
    fill(m.p, rows * ld, scale);
    return m;
}

static float *mat_at(const mat *m, int64_t r, int64_t c)
{
    return &m->p[r * m->ld + c];
}

static int pad_intact(const mat *m)
{
    for (int64_t r = 0; r < m->rows; r++)
        for (int64_t c = m->cols; c < m->ld; c++)
            if (!is_poison(m->p[r * m->ld + c]))
                return 0;
    return 1;
}

/* out = poison everywhere, then in's values in the live columns. */
static void mat_set_from(mat *out, const mat *in)
{
    poison(out->p, out->rows * out->ld);
    for (int64_t r = 0; r < out->rows; r++)
        memcpy(mat_at(out, r, 0), mat_at(in, r, 0), (size_t)out->cols * sizeof(float));
}

/* A weight matrix in dtype t, with its exact values as doubles. */
typedef struct wmat {
    void *p;
    double *val; /* [rows * cols] */
    int64_t rows, cols, ld;
    df_tensor t;
} wmat;

static void wput(void *p, df_dtype t, int64_t i, float f, double *exact)
{
    size_t es = df_dtype_size(t);
    uint8_t *dst = (uint8_t *)p + i * (int64_t)es;
    if (t == DF_DTYPE_F32) {
        memcpy(dst, &f, 4);
    } else {
        uint16_t h = t == DF_DTYPE_BF16 ? df_f32_to_bf16(f) : df_f32_to_f16(f);
        memcpy(dst, &h, 2);
        f = t == DF_DTYPE_BF16 ? df_bf16_to_f32(h) : df_f16_to_f32(h);
    }
    if (exact)
        *exact = f;
}

static wmat wmat_new(df_dtype t, int64_t rows, int64_t cols, int64_t ld, float scale)
{
    wmat w = {NULL, dbuf(rows * cols), rows, cols, ld, {0}};
    w.p = xmalloc((size_t)(rows * ld) * df_dtype_size(t));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < ld; c++)
            wput(w.p, t, r * ld + c, test_randn(&rng) * scale,
                 c < cols ? &w.val[r * cols + c] : NULL);
    df_tensor full = df_tensor_2d(w.p, t, rows, ld);
    w.t = df_tensor_cols(&full, 0, cols);
    return w;
}

static wmat wvec_new(df_dtype t, int64_t n, float scale, float offset)
{
    wmat w = {NULL, dbuf(n), 1, n, n, {0}};
    w.p = xmalloc((size_t)n * df_dtype_size(t));
    for (int64_t i = 0; i < n; i++)
        wput(w.p, t, i, offset + test_randn(&rng) * scale, &w.val[i]);
    w.t = df_tensor_1d(w.p, t, n);
    return w;
}

static void wmat_free(wmat *w)
{
    free(w->p);
    free(w->val);
}

static const df_dtype DTS[3] = {DF_DTYPE_BF16, DF_DTYPE_F16, DF_DTYPE_F32};

/* ---- bf16 weight gradients ---- */

static const uint16_t BF_POISON = 0x7fc1; /* a NaN no op computes */

/* The bf16 nearest to d, ties to even (d finite, 0 or of bf16's normal
 * range): |d| in [2^(e-1), 2^e) scaled to [128, 256) is exact in double,
 * nearbyint rounds it to an integer (to nearest even in the default
 * rounding mode), the scale back is exact and so is the f32 of 8 bits. */
static uint16_t bf16_of_double(double d)
{
    if (d == 0)
        return signbit(d) ? 0x8000 : 0;
    int e;
    frexp(d, &e);
    float f = (float)ldexp(nearbyint(ldexp(d, 8 - e)), e - 8);
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

/* The spacing of bf16 numbers at |d| (d != 0): 2^(e-8) for |d| in
 * [2^(e-1), 2^e). */
static double bf16_ulp(double d)
{
    int e;
    frexp(d, &e);
    return d != 0 ? ldexp(1.0, e - 8) : 0;
}

/* How many bf16 numbers apart a and b are (finite, either sign). */
static int bf16_dist(uint16_t a, uint16_t b)
{
    int ia = (a & 0x8000) ? -(int)(a & 0x7fff) : (int)a;
    int ib = (b & 0x8000) ? -(int)(b & 0x7fff) : (int)b;
    return ia > ib ? ia - ib : ib - ia;
}

/* A BF16 weight-gradient element against ref, the exact (double) value of
 * what the op computes in fp32; tol bounds that fp32 computation's error
 * (the F32 tests' bound), so the op rounds once some f with |f - ref| <=
 * tol. Where tol < half a bf16 ulp of ref, RNE(f) is at most 1 bf16 ulp
 * from RNE(ref) (both within half an ulp of values less than half an ulp
 * apart; a binade edge between them costs nothing more): the fp32
 * summation order may flip one rounding, never more, so that is the rule.
 * Where the sum cancels so much that tol reaches half an ulp of ref, f can
 * be several bf16 steps of ref away before it is rounded: there, only
 * |got - ref| <= tol + half an ulp of got holds (the F32 bound plus the one
 * rounding); those elements are counted (n_cancel). NaN never passes. */
static int64_t n_cancel, n_bf16_checked;
static void expect_bf16_grad(const char *what, uint16_t got, double ref, double tol, int64_t idx)
{
    float g = bf_val(got);
    n_bf16_checked++;
    if (isfinite(g)) {
        if (tol < 0.5 * bf16_ulp(ref)) {
            if (bf16_dist(got, bf16_of_double(ref)) <= 1)
                return;
        } else {
            n_cancel++;
            if (fabs((double)g - ref) <= tol + 0.5 * bf16_ulp(g))
                return;
        }
    }
    if (n_miss++ < 12)
        fprintf(stderr, "%s: element %lld: got bf16 %04x (%.9g), want %.9g -> %04x (tol %.3g)\n",
                what, (long long)idx, got, g, ref, bf16_of_double(ref), tol);
    df_test_failures++;
}

/* Largest |analytic - numeric| / max|numeric| seen per op, for the log. */
static double fd_worst[8];
enum { FD_MM_X, FD_MM_W, FD_NORM_X, FD_NORM_W, FD_ROPE, FD_SWIGLU, FD_CE, FD_N };
static const char *fd_name[FD_N] = {"matmul dx", "matmul dw", "rmsnorm dx", "rmsnorm dw",
                                    "rope dx",   "swiglu",    "lmhead_ce dh"};

/* Compare an analytic gradient (f32) with numeric ones (double): each
 * element within tol_rel * max|numeric| (a global scale: a gradient element
 * that happens to be near 0 still has the rounding of the terms it sums). */
static void fd_compare(int which, const char *what, const float *an, const double *num,
                       int64_t n, double tol_rel)
{
    double mx = 0, worst = 0;
    for (int64_t i = 0; i < n; i++)
        if (fabs(num[i]) > mx)
            mx = fabs(num[i]);
    for (int64_t i = 0; i < n; i++) {
        double e = fabs(an[i] - num[i]) / (mx > 0 ? mx : 1);
        if (!(e <= worst))
            worst = e;
        expect_close(what, an[i], num[i], tol_rel * (mx > 0 ? mx : 1), i);
    }
    if (!(worst <= fd_worst[which]))
        fd_worst[which] = worst;
}

static const double FD_H = 1e-6;

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
static uint16_t *bf_mat(int64_t rows, int64_t cols, int64_t ld, const uint16_t *vals)
{
    uint16_t *p = xmalloc((size_t)(rows * ld + 1) * 2);
    for (int64_t i = 0; i < rows * ld; i++)
        p[i] = BF_POISON;
    for (int64_t r = 0; vals && r < rows; r++)
        memcpy(p + r * ld, vals + r * cols, (size_t)cols * 2);
    return p;
}

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
    mat dgu[2] = {mat_new(T, 2 * F, 2 * F + 1), mat_new(T, 2 * F, 2 * F + 1)};
    for (int b = 0; b < 2; b++) {
        df_tensor g = df_tensor_cols(&gu.t, 0, F), u = df_tensor_cols(&gu.t, F, F);
        if (in_place)
            mat_set_from(&dgu[b], &gu);
        else
            poison(dgu[b].p, T * dgu[b].ld);
        df_tensor dg = df_tensor_cols(&dgu[b].t, 0, F), du = df_tensor_cols(&dgu[b].t, F, F);
        if (in_place) /* dgate = gate's view, dup = up's view */
            CHECK_EQ(df_op_swiglu_bwd(bes[b], &dg, &du, &dout.t, &dg, &du), 0);
        else
            CHECK_EQ(df_op_swiglu_bwd(bes[b], &g, &u, &dout.t, &dg, &du), 0);
        CHECK(pad_intact(&dgu[b]));
    }
    CHECK(bitwise_equal(dgu[0].p, dgu[1].p, T * dgu[0].ld * 4));
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < F; i++) {
            double g = *mat_at(&gu, t, i), u = *mat_at(&gu, t, F + i), d = *mat_at(&dout, t, i);
            double s = 1.0 / (1.0 + exp(-g));
            double rg = d * u * s * (1.0 + g * (1.0 - s)), ru = d * silu_d(g);
            double tg = 1e-5 * fabs(d * u) * (s + fabs(g) * s * (1.0 - s)) + 1e-30;
            expect_close(what, *mat_at(&dgu[0], t, i), rg, tg, t * F + i);
            expect_close(what, *mat_at(&dgu[0], t, F + i), ru, 1e-5 * fabs(ru) + 1e-30, t * F + i);
        }
    free(gu.p), free(dout.p), free(dgu[0].p), free(dgu[1].p);
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

/* ---- LM head + CE ---- */

/* Naive double reference: logits from the exact head values, stable LSE,
 * CE, argmax (lowest index of the max), and dh = sum_v (p_v - 1[v = label])
 * head_v * w / denom. Also sum|h_k head_vk| (the logits' fp32 error scale). */
typedef struct ce_ref {
    double loss, *ce, *dh, *dh_mag;
    int32_t *am;
} ce_ref;

static void ce_reference(const mat *h, const wmat *head, const int32_t *label, const float *weight,
                         double denom, ce_ref *r)
{
    int64_t N = h->rows, H = h->cols, V = head->rows;
    double *z = dbuf(V), *za = dbuf(V);
    r->loss = 0;
    r->ce = dbuf(N), r->dh = dbuf(N * H), r->dh_mag = dbuf(N * H);
    r->am = xmalloc((size_t)(N ? N : 1) * sizeof(int32_t));
    for (int64_t i = 0; i < N; i++) {
        double mx = -INFINITY;
        int32_t am = 0;
        for (int64_t v = 0; v < V; v++) {
            double s = 0, a = 0;
            for (int64_t k = 0; k < H; k++) {
                double p = (double)*mat_at(h, i, k) * head->val[v * H + k];
                s += p, a += fabs(p);
            }
            z[v] = s, za[v] = a;
            if (s > mx)
                mx = s, am = (int32_t)v;
        }
        r->am[i] = am;
        double w = weight ? weight[i] : 1.0;
        if (label[i] < 0 || w <= 0)
            continue;
        double se = 0;
        for (int64_t v = 0; v < V; v++)
            se += exp(z[v] - mx);
        double lse = mx + log(se);
        r->ce[i] = lse - z[label[i]];
        r->loss += w * r->ce[i];
        for (int64_t v = 0; v < V; v++) {
            double gv = (exp(z[v] - lse) - (v == label[i])) * w / denom;
            for (int64_t k = 0; k < H; k++) {
                r->dh[i * H + k] += gv * head->val[v * H + k];
                r->dh_mag[i * H + k] += fabs(gv * head->val[v * H + k]);
            }
        }
    }
    free(z), free(za);
}

static void ce_ref_free(ce_ref *r)
{
    free(r->ce), free(r->dh), free(r->dh_mag), free(r->am);
}

/* FD of L(h) = sum_i w_i CE_i / denom in double. dh is an fp32 GEMM over V
 * of softmax probabilities (relative error ~u each) times head rows, plus the
 * fp32 logits' error (~u sum|h head|, here O(u) since |h head| ~ 1) moving p
 * by ~u p: a few u of max|dh|; 1e-5 is a wide margin. */
static void fd_lmhead(df_dtype wt)
{
    const int64_t N = 5, H = 7, V = 11;
    mat h = mat_rand(N, H, H, 1.0f);
    wmat head = wmat_new(wt, V, H, H, 0.7f);
    int32_t label[5] = {3, -1, 0, 10, 4};
    float weight[5] = {1.0f, 1.0f, 0.5f, 0.25f, 0.0f};
    const double denom = 1.75;
    double *hv = dbuf(N * H), *num = dbuf(N * H), *z = dbuf(V);
    for (int64_t i = 0; i < N * H; i++)
        hv[i] = h.p[i];
    for (int64_t e = 0; e < N * H; e++) {
        double save = hv[e], L[2];
        for (int s = 0; s < 2; s++) {
            hv[e] = save + (s ? -FD_H : FD_H);
            double acc = 0;
            for (int64_t i = 0; i < N; i++) {
                if (label[i] < 0 || weight[i] <= 0)
                    continue;
                double mx = -INFINITY, se = 0;
                for (int64_t v = 0; v < V; v++) {
                    z[v] = 0;
                    for (int64_t k = 0; k < H; k++)
                        z[v] += hv[i * H + k] * head.val[v * H + k];
                    mx = z[v] > mx ? z[v] : mx;
                }
                for (int64_t v = 0; v < V; v++)
                    se += exp(z[v] - mx);
                acc += weight[i] * (mx + log(se) - z[label[i]]) / denom;
            }
            L[s] = acc;
        }
        hv[e] = save;
        num[e] = (L[0] - L[1]) / (2 * FD_H);
    }
    float *dh = fbuf(N * H);
    df_tensor tdh = df_tensor_2d(dh, DF_DTYPE_F32, N, H);
    poison(dh, N * H);
    double loss = 0;
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, (float)denom, &loss, &tdh, NULL,
                             NULL, 0),
             0);
    fd_compare(FD_CE, "fd lmhead_ce dh", dh, num, N * H, 1e-5);
    for (int64_t k = 0; k < H; k++) /* ignored rows: exactly zero */
        CHECK(dh[1 * H + k] == 0.0f && dh[4 * H + k] == 0.0f);
    free(h.p), free(hv), free(num), free(z), free(dh);
    wmat_free(&head);
}

/* One configuration against the double reference. Rows: random labels, some
 * ignored by label -1 or weight 0, row 0 with huge logits (~1e4: exp would
 * overflow without the max subtracted), row 1 tied (two identical head rows
 * give equal logits: argmax must pick the lower index). Tolerances:
 *   CE: lse - z_label, each off by the fp32 logits' error ~u sum|h head|
 *       (plus ~u |lse| for the f32 max): 1e-5 * (mag + |mx|) per row;
 *   loss: the sum of those, weighted;
 *   dh: 1e-5 * (sum_v |g_v head_vk| + max|dh| 1e-2) — the GEMM's fp32
 *       rounding relative to its terms, plus the probabilities' error from
 *       the logits' (~u * (scale of z) relative; rows of huge logits get it
 *       through the second term);
 *   argmax: exact where the top two reference logits differ by more than
 *       their fp32 error (else either index is right). */
static void check_lmhead(int64_t N, int64_t H, int64_t V, df_dtype wt, int use_weight, int want_dh,
                         int want_am)
{
    char what[128];
    snprintf(what, sizeof what, "lmhead_ce N=%lld H=%lld V=%lld %s w=%d dh=%d am=%d", (long long)N,
             (long long)H, (long long)V, df_dtype_name(wt), use_weight, want_dh, want_am);
    mat h = mat_rand(N, H, H + 3, 1.0f);
    wmat head = wmat_new(wt, V, H, H + 1, 0.3f);
    int32_t *label = xmalloc((size_t)N * sizeof(int32_t));
    float *weight = fbuf(N);
    for (int64_t i = 0; i < N; i++) {
        label[i] = (int32_t)(test_rand(&rng) % (uint64_t)V);
        weight[i] = (float)(test_rand(&rng) % 1000) / 999.0f + 0.1f;
        if (i % 7 == 3)
            label[i] = -1;
        if (i % 11 == 5)
            weight[i] = 0.0f;
    }
    if (N > 0) { /* huge logits in row 0 */
        for (int64_t k = 0; k < H; k++)
            *mat_at(&h, 0, k) = (float)(test_randn(&rng) * 3000.0 / sqrt((double)H));
        label[0] = (int32_t)(V / 2);
    }
    if (N > 1 && V > 3) { /* a tie in row 1: head rows 1 and 3 equal, the max */
        size_t es = df_dtype_size(wt);
        memcpy((uint8_t *)head.p + 3 * head.ld * es, (uint8_t *)head.p + 1 * head.ld * es,
               (size_t)head.ld * es);
        memcpy(&head.val[3 * H], &head.val[1 * H], (size_t)H * sizeof(double));
        for (int64_t k = 0; k < H; k++)
            *mat_at(&h, 1, k) = (float)(head.val[1 * H + k] * 40.0);
    }
    const float denom = 3.5f;
    const float *wp = use_weight ? weight : NULL;
    ce_ref ref;
    ce_reference(&h, &head, label, wp, denom, &ref);

    mat dh[2] = {mat_new(N, H, H + 2), mat_new(N, H, H + 2)};
    int32_t *am[2] = {xmalloc((size_t)(N + 1) * 4), xmalloc((size_t)(N + 1) * 4)};
    float *ce[2] = {fbuf(N + 1), fbuf(N + 1)};
    double loss[2];
    for (int b = 0; b < 2; b++) {
        poison(dh[b].p, N * dh[b].ld);
        poison(ce[b], N + 1);
        memset(am[b], 0xa5, (size_t)(N + 1) * 4);
        loss[b] = 1.5; /* added to */
        CHECK_EQ(df_op_lmhead_ce(bes[b], &h.t, &head.t, label, wp, denom, &loss[b],
                                 want_dh ? &dh[b].t : NULL, want_am ? am[b] : NULL, ce[b], 0),
                 0);
        CHECK(is_poison(ce[b][N]));
        if (want_dh)
            CHECK(pad_intact(&dh[b]));
        else
            CHECK(all_poison(dh[b].p, N * dh[b].ld));
    }
    if (!bitwise_equal(dh[0].p, dh[1].p, N * dh[0].ld * 4) || !bitwise_equal(ce[0], ce[1], N * 4) ||
        !bitwise_equal(&loss[0], &loss[1], 8) || (want_am && !bitwise_equal(am[0], am[1], N * 4))) {
        fprintf(stderr, "%s: 1 and 3 threads differ\n", what);
        df_test_failures++;
    }
    double loss_tol = 0, dh_max = 0;
    for (int64_t i = 0; i < N * H; i++)
        dh_max = fabs(ref.dh[i]) > dh_max ? fabs(ref.dh[i]) : dh_max;
    for (int64_t i = 0; i < N; i++) {
        double mag = 0, mx = -INFINITY, second = -INFINITY;
        for (int64_t v = 0; v < V; v++) {
            double s = 0, a = 0;
            for (int64_t k = 0; k < H; k++) {
                double p = (double)*mat_at(&h, i, k) * head.val[v * H + k];
                s += p, a += fabs(p);
            }
            mag = a > mag ? a : mag;
            if (s > mx)
                second = mx, mx = s;
            else if (s > second)
                second = s;
        }
        int active = label[i] >= 0 && (!wp || wp[i] > 0);
        double tol = 1e-5 * (mag + fabs(mx));
        expect_close(what, ce[0][i], active ? ref.ce[i] : 0.0, active ? tol : 0.0, i);
        if (active)
            loss_tol += (wp ? wp[i] : 1.0) * tol;
        if (want_am) {
            if (mx - second > 4 * U * mag || i == 1)
                CHECK_EQ(am[0][i], ref.am[i]);
            if (i == 1 && V > 3)
                CHECK_EQ(am[0][1], 1); /* the tie: the lower index */
        }
        if (want_dh)
            for (int64_t k = 0; k < H; k++)
                expect_close(what, *mat_at(&dh[0], i, k), active ? ref.dh[i * H + k] : 0.0,
                             active ? 1e-5 * (ref.dh_mag[i * H + k] + 1e-2 * dh_max) : 0.0,
                             i * H + k);
    }
    expect_close(what, loss[0], 1.5 + ref.loss, loss_tol, -1);
    for (int64_t i = 0; i < N; i++) /* the huge row did not overflow */
        CHECK(isfinite(ce[0][i]));
    free(h.p), free(label), free(weight);
    for (int b = 0; b < 2; b++)
        free(dh[b].p), free(am[b]), free(ce[b]);
    ce_ref_free(&ref);
    wmat_free(&head);
}

static void test_lmhead_ce(void)
{
    for (int d = 0; d < 3; d++)
        fd_lmhead(DTS[d]);
    /* chunks of up to 64 rows (fewer with more threads): 130 rows is 64 + 64
     * + 2 on one thread and 44 x 3 - 2 on three; V odd; H across KC = 256. */
    check_lmhead(130, 40, 1001, DF_DTYPE_BF16, 1, 1, 1);
    check_lmhead(130, 300, 77, DF_DTYPE_F32, 1, 1, 1);
    check_lmhead(9, 16, 5, DF_DTYPE_F16, 0, 1, 1);
    check_lmhead(70, 24, 301, DF_DTYPE_BF16, 1, 1, 0); /* argmax off: ignored rows skip GEMM 1 */
    check_lmhead(70, 24, 301, DF_DTYPE_BF16, 1, 0, 1); /* no dh */
    check_lmhead(1, 8, 1, DF_DTYPE_F32, 1, 1, 1);      /* V = 1: CE 0, dh 0 */
    check_lmhead(0, 8, 10, DF_DTYPE_F32, 1, 1, 1);

    /* A vocabulary past the 64 MiB chunk buffer: fewer rows per chunk. */
    {
        const int64_t N = 70, H = 4, V = 270001;
        mat h = mat_rand(N, H, H, 1.0f);
        wmat head = wmat_new(DF_DTYPE_BF16, V, H, H, 1.0f);
        int32_t label[70];
        for (int i = 0; i < N; i++)
            label[i] = (int32_t)(test_rand(&rng) % (uint64_t)V);
        label[5] = -1;
        mat dh[2] = {mat_new(N, H, H), mat_new(N, H, H)};
        float ce[2][70];
        double loss[2] = {0, 0};
        for (int b = 0; b < 2; b++) {
            poison(dh[b].p, N * H);
            CHECK_EQ(df_op_lmhead_ce(bes[b], &h.t, &head.t, label, NULL, 70.0f, &loss[b], &dh[b].t,
                                     NULL, ce[b], 0),
                     0);
        }
        CHECK(bitwise_equal(dh[0].p, dh[1].p, N * H * 4) && bitwise_equal(loss, loss + 1, 8));
        /* spot-check three rows against the reference */
        mat h3 = mat_new(3, H, H);
        int32_t l3[3] = {label[0], label[5], label[69]};
        memcpy(h3.p, h.p, H * sizeof(float));
        memcpy(h3.p + H, h.p + 5 * H, H * sizeof(float));
        memcpy(h3.p + 2 * H, h.p + 69 * H, H * sizeof(float));
        ce_ref ref;
        ce_reference(&h3, &head, l3, NULL, 70.0, &ref);
        const int64_t rows[3] = {0, 5, 69};
        for (int j = 0; j < 3; j++) {
            expect_close("lmhead_ce V=270001 ce", ce[0][rows[j]], ref.ce[j], 1e-4, rows[j]);
            for (int64_t k = 0; k < H; k++)
                expect_close("lmhead_ce V=270001 dh", dh[0].p[rows[j] * H + k], ref.dh[j * H + k],
                             1e-5 * ref.dh_mag[j * H + k] + 1e-9, rows[j] * H + k);
        }
        ce_ref_free(&ref);
        free(h.p), free(h3.p), free(dh[0].p), free(dh[1].p);
        wmat_free(&head);
    }

    /* Bad arguments. */
    const int64_t N = 4, H = 8, V = 6;
    mat h = mat_rand(N, H, H, 1.0f), dh = mat_new(N, H, H);
    wmat head = wmat_new(DF_DTYPE_BF16, V, H, H, 1.0f), head7 = wmat_new(DF_DTYPE_BF16, V, 7, 7, 1.0f);
    int32_t label[4] = {0, 5, -1, 2}, bad_label[4] = {0, 6, -1, 2}, am[4] = {-7, -7, -7, -7};
    float weight[4] = {1, 1, 1, 1}, bad_w[4] = {1, NAN, 1, 1}, neg_w[4] = {1, -1, 1, 1}, ce[4];
    double loss = 0;
    poison(dh.p, N * H), poison(ce, 4);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head7.t, label, weight, 1.0f, &loss, &dh.t, am, ce, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, bad_label, weight, 1.0f, &loss, &dh.t, am,
                             ce, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, bad_w, 1.0f, &loss, &dh.t, am, ce, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, neg_w, 1.0f, &loss, &dh.t, am, ce, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, NULL, weight, 1.0f, &loss, &dh.t, am, ce, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, 0.0f, &loss, &dh.t, am, ce, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, INFINITY, &loss, &dh.t, am,
                             ce, 0),
             -EINVAL);
    df_tensor t = dh.t;
    t.shape[0] = 3;
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, 1.0f, &loss, &t, am, ce, 0),
                             -EINVAL);
    t = head.t, t.shape[0] = 0;
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &t, label, weight, 1.0f, &loss, &dh.t, am, ce, 0),
                             -EINVAL);
    /* dh over h; ce inside dh; argmax over label */
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, 1.0f, &loss, &h.t, am, ce, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, 1.0f, &loss, &dh.t, am,
                             dh.p + 3, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, 1.0f, &loss, &dh.t, label, ce,
                             0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(NULL, &h.t, &head.t, label, weight, 1.0f, &loss, &dh.t, am, ce, 0),
             -EINVAL);
    CHECK(all_poison(dh.p, N * H) && all_poison(ce, 4) && loss == 0.0);
    for (int i = 0; i < 4; i++)
        CHECK_EQ(am[i], -7);
    /* without dh the denominator is not used */
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, 0.0f, &loss, NULL, am, ce, 0),
                             0);
    CHECK(loss > 0.0);
    free(h.p), free(dh.p);
    wmat_free(&head), wmat_free(&head7);
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
    /* LM head CE: N rows x V vocab x H, fwd + dh = 4 N V H flops. */
    {
        const int64_t Nr = 256, H = 512, V = 32000;
        mat h = mat_rand(Nr, H, H, 1.0f), dh = mat_new(Nr, H, H);
        wmat head = wmat_new(DF_DTYPE_BF16, V, H, H, 0.05f);
        int32_t *label = xmalloc((size_t)Nr * 4), *am = xmalloc((size_t)Nr * 4);
        for (int64_t i = 0; i < Nr; i++)
            label[i] = (int32_t)(test_rand(&rng) % (uint64_t)V);
        for (int nt = 1; nt <= 2; nt++) {
            df_backend *be = df_backend_cpu_open(nt, NULL);
            double best = 1e30, loss = 0;
            for (int rep = 0; rep < 3; rep++) {
                double t0 = now_s();
                CHECK_EQ(df_op_lmhead_ce(be, &h.t, &head.t, label, NULL, (float)Nr, &loss, &dh.t,
                                         am, NULL, 0),
                         0);
                double dt = now_s() - t0;
                best = dt < best ? dt : best;
            }
            printf("lmhead_ce N=%lld H=%lld V=%lld bf16 threads=%d: %.1f ms, %.1f GFLOP/s\n",
                   (long long)Nr, (long long)H, (long long)V, nt, best * 1e3,
                   4.0 * Nr * V * H / best * 1e-9);
            df_backend_close(be);
        }
        free(h.p), free(dh.p), free(label), free(am);
        wmat_free(&head);
    }
    free(dy.p), free(x.p), free(dx.p), free(dw.p);
}

int main(void)
{
    if (open_backends())
        return 1;
    test_matmul_bwd();
    test_rmsnorm_bwd();
    test_rope_bwd();
    test_swiglu_bwd();
    test_lmhead_ce();
    for (int i = 0; i < FD_N; i++)
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
