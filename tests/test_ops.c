/* test_ops.c - the dense ops of the CPU reference backend against naive
 * double-precision references written here (independent of kernels/cpu).
 *
 * Every op runs on a 1-thread and a 3-thread backend; the two outputs must be
 * bitwise equal (the row split is deterministic) and close to the reference.
 * Outputs are poisoned with a NaN pattern first, so an element the op forgets
 * to write fails, and views carry padding columns that must stay poisoned.
 * Bad arguments must return -EINVAL and leave the output bytes untouched.
 *
 * Tolerances are relative to the magnitude of the reference (what fp32 can
 * resolve), not to the result, which may cancel; each says why it is safe.
 * u = 2^-24 = 6e-8 is fp32's unit roundoff.
 *
 * DFLASH_OPS_BENCH=1 also times matmul (M=512, K=N=1024) on 1 and 2 threads. */
#include "knobs.h"
#include "ops.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t rng = 42;
static df_backend *bes[2]; /* 1 and 3 threads */

/* A NaN no op computes, so "still poisoned" is a bitwise test. */
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

static float *fbuf(int64_t n)
{
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

static double *dbuf(int64_t n)
{
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* randn * scale everywhere, padding included (it must never be read as data
 * for the result to match the reference). */
static void fill(float *p, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++)
        p[i] = test_randn(&rng) * scale;
}

/* An f32 activation matrix [rows, cols] stored with row stride ld >= cols. */
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

static float mat_get(const mat *m, int64_t r, int64_t c)
{
    return m->p[r * m->ld + c];
}

/* Padding columns (cols..ld) of every row still hold the poison pattern. */
static int pad_intact(const mat *m)
{
    for (int64_t r = 0; r < m->rows; r++)
        for (int64_t c = m->cols; c < m->ld; c++)
            if (!is_poison(m->p[r * m->ld + c]))
                return 0;
    return 1;
}

/* A weight matrix in dtype t, with its exact values as doubles. */
typedef struct wmat {
    void *p;
    double *val; /* [rows * cols] */
    int64_t rows, cols, ld;
    df_tensor t;
} wmat;

static wmat wmat_new(df_dtype t, int64_t rows, int64_t cols, int64_t ld, float scale)
{
    wmat w = {NULL, dbuf(rows * cols), rows, cols, ld, {0}};
    size_t es = df_dtype_size(t);
    w.p = malloc((size_t)(rows * ld > 0 ? rows * ld : 1) * es);
    if (!w.p)
        exit(2);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < ld; c++) {
            float f = test_randn(&rng) * scale;
            uint8_t *dst = (uint8_t *)w.p + (r * ld + c) * (int64_t)es;
            if (t == DF_DTYPE_F32) {
                memcpy(dst, &f, 4);
            } else {
                uint16_t h = t == DF_DTYPE_BF16 ? df_f32_to_bf16(f) : df_f32_to_f16(f);
                memcpy(dst, &h, 2);
                f = t == DF_DTYPE_BF16 ? df_bf16_to_f32(h) : df_f16_to_f32(h);
            }
            if (c < cols)
                w.val[r * cols + c] = f;
        }
    df_tensor full = df_tensor_2d(w.p, t, rows, ld);
    w.t = df_tensor_cols(&full, 0, cols);
    return w;
}

/* A weight vector [n] (norm weights). */
static wmat wvec_new(df_dtype t, int64_t n, float scale)
{
    wmat w = wmat_new(t, 1, n, n, scale);
    w.t = df_tensor_1d(w.p, t, n);
    return w;
}

static void wmat_free(wmat *w)
{
    free(w->p);
    free(w->val);
}

/* |got - ref| <= tol, NaN never passes; reports the first few misses per check. */
static int n_miss;
static void expect_close(const char *what, double got, double ref, double tol, int64_t idx)
{
    if (fabs(got - ref) <= tol)
        return;
    if (n_miss++ < 12)
        fprintf(stderr, "%s: element %lld: got %.9g, want %.9g (tol %.3g)\n", what,
                (long long)idx, got, ref, tol);
    df_test_failures++;
}

static int bitwise_equal(const float *a, const float *b, int64_t n)
{
    return memcmp(a, b, (size_t)n * sizeof(float)) == 0;
}

static const char *dtname(df_dtype t)
{
    return df_dtype_name(t);
}

/* ---- helpers, backend ---- */

static void test_helpers(void)
{
    float buf[6 * 10];
    df_tensor m = df_tensor_2d(buf, DF_DTYPE_F32, 6, 10);
    CHECK_EQ(m.ndim, 2);
    CHECK_EQ(m.stride[0], 10);
    CHECK_EQ(m.stride[1], 1);
    CHECK_EQ(df_tensor_numel(&m), 60);
    df_tensor c = df_tensor_cols(&m, 3, 4);
    CHECK(c.data == (void *)&buf[3]);
    CHECK_EQ(c.shape[0], 6);
    CHECK_EQ(c.shape[1], 4);
    CHECK_EQ(c.stride[0], 10);
    CHECK(df_tensor_at(&c, 2, 1) == (void *)&buf[2 * 10 + 4]);
    df_tensor c2 = df_tensor_cols(&c, 1, 3); /* a view of a view */
    CHECK(df_tensor_at(&c2, 5, 2) == (void *)&buf[5 * 10 + 6]);
    df_tensor bad = df_tensor_cols(&m, 8, 3);
    CHECK(bad.ndim == 0 && bad.data == NULL);
    CHECK_EQ(df_tensor_numel(&bad), 0);
    uint16_t hb[5];
    df_tensor v = df_tensor_1d(hb, DF_DTYPE_BF16, 5);
    CHECK_EQ(df_tensor_numel(&v), 5);
    CHECK(df_tensor_at(&v, 0, 0) == NULL); /* 2-D only */

    /* An op given the invalid view refuses it. */
    float y[6 * 3];
    df_tensor yt = df_tensor_2d(y, DF_DTYPE_F32, 6, 3);
    CHECK_EQ(df_op_silu(bes[0], &bad, &yt), -EINVAL);
}

static void test_backend(void)
{
    df_err e = {0};
    CHECK(df_backend_cpu_open(-1, &e) == NULL);
    CHECK_EQ(e.code, -EINVAL);
    df_backend *be = df_backend_cpu_open(0, &e);
    CHECK(be != NULL);
    if (!be)
        return;
    CHECK(strcmp(df_backend_name(be), "cpu") == 0);
    CHECK_EQ(df_backend_sync(be), 0);
    char *p = df_backend_alloc(be, 100);
    char *z = df_backend_alloc(be, 0);
    CHECK(p && ((uintptr_t)p & 63) == 0);
    CHECK(z && ((uintptr_t)z & 63) == 0);
    char src[100], back[100];
    for (int i = 0; i < 100; i++)
        src[i] = (char)(i * 7);
    CHECK_EQ(df_backend_upload(be, p, src, 100), 0);
    CHECK_EQ(df_backend_download(be, back, p, 100), 0);
    CHECK(memcmp(src, back, 100) == 0);
    CHECK_EQ(df_backend_upload(be, NULL, src, 1), -EINVAL);
    df_backend_free(be, p);
    df_backend_free(be, z);
    df_backend_close(be);
    df_backend_close(NULL);
}

/* ---- embed ---- */

static void test_embed(void)
{
    const df_dtype dts[] = {DF_DTYPE_BF16, DF_DTYPE_F16, DF_DTYPE_F32};
    const int64_t V = 37, H = 19, n = 11;
    uint32_t ids[11];
    for (int i = 0; i < n; i++)
        ids[i] = (uint32_t)(test_rand(&rng) % V);
    ids[0] = 0;
    ids[1] = V - 1;
    ids[2] = ids[3]; /* a repeated token */
    for (int di = 0; di < 3; di++) {
        wmat tab = wmat_new(dts[di], V, H, H + 2, 1.0f); /* table rows padded: a view */
        mat out[2] = {mat_new(n, H, H + 3), mat_new(n, H, H + 3)};
        for (int b = 0; b < 2; b++) {
            poison(out[b].p, n * out[b].ld);
            CHECK_EQ(df_op_embed(bes[b], &tab.t, ids, n, &out[b].t), 0);
            CHECK(pad_intact(&out[b]));
        }
        CHECK(bitwise_equal(out[0].p, out[1].p, n * out[0].ld));
        /* Conversion to f32 is exact: equality. */
        for (int64_t i = 0; i < n; i++)
            for (int64_t c = 0; c < H; c++)
                expect_close(dtname(dts[di]), mat_get(&out[0], i, c), tab.val[ids[i] * H + c],
                             0.0, i * H + c);

        /* id == V, wrong row count, wrong width, non-weight table: -EINVAL, untouched. */
        poison(out[0].p, n * out[0].ld);
        uint32_t bad_ids[11];
        memcpy(bad_ids, ids, sizeof ids);
        bad_ids[7] = (uint32_t)V;
        CHECK_EQ(df_op_embed(bes[0], &tab.t, bad_ids, n, &out[0].t), -EINVAL);
        CHECK_EQ(df_op_embed(bes[0], &tab.t, ids, n - 1, &out[0].t), -EINVAL);
        CHECK_EQ(df_op_embed(bes[0], &tab.t, NULL, n, &out[0].t), -EINVAL);
        df_tensor narrow = df_tensor_cols(&out[0].t, 0, H - 1);
        CHECK_EQ(df_op_embed(bes[0], &tab.t, ids, n, &narrow), -EINVAL);
        df_tensor ti = tab.t;
        ti.dtype = DF_DTYPE_I32;
        CHECK_EQ(df_op_embed(bes[0], &ti, ids, n, &out[0].t), -EINVAL);
        CHECK_EQ(df_op_embed(NULL, &tab.t, ids, n, &out[0].t), -EINVAL);
        for (int64_t i = 0; i < n * out[0].ld; i++)
            CHECK(is_poison(out[0].p[i]));
        for (int b = 0; b < 2; b++)
            free(out[b].p);
        wmat_free(&tab);
    }
}

/* ---- matmul ---- */

/* Reference sum and sum of magnitudes, in double. A fp32 sum of K products
 * has error ~ u * |partial sums| per step, random in sign on random data:
 * about u * sum|x w| / 2 overall, whatever K. 2e-6 * sum|x w| (plus the old
 * y when accumulating) leaves a 30x margin and still catches one dropped
 * term (~ sum|x w| / K >= 1e-3 of it for K <= 1024). */
static void check_matmul(int64_t M, int64_t N, int64_t K, df_dtype wt, int accumulate)
{
    char what[96];
    snprintf(what, sizeof what, "matmul M=%lld N=%lld K=%lld %s acc=%d", (long long)M,
             (long long)N, (long long)K, dtname(wt), accumulate);
    mat x = mat_new(M, K, K + 3);
    fill(x.p, M * x.ld, 1.0f);
    wmat w = wmat_new(wt, N, K, K + (K % 2 ? 1 : 0), 0.5f);
    mat y[2] = {mat_new(M, N, N + 5), mat_new(M, N, N + 5)};
    float *y0 = fbuf(M * (N + 5));
    fill(y0, M * (N + 5), 2.0f);
    for (int b = 0; b < 2; b++) {
        poison(y[b].p, M * y[b].ld);
        if (accumulate)
            for (int64_t i = 0; i < M; i++)
                memcpy(&y[b].p[i * y[b].ld], &y0[i * y[b].ld], (size_t)N * sizeof(float));
        int rc = df_op_matmul(bes[b], &x.t, &w.t, &y[b].t, accumulate);
        CHECK_EQ(rc, 0);
        CHECK(pad_intact(&y[b]));
    }
    if (!bitwise_equal(y[0].p, y[1].p, M * y[0].ld)) {
        fprintf(stderr, "%s: 1 and 3 threads differ\n", what);
        df_test_failures++;
    }
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0, a = 0;
            for (int64_t k = 0; k < K; k++) {
                double p = (double)mat_get(&x, i, k) * w.val[j * K + k];
                s += p;
                a += fabs(p);
            }
            if (accumulate) {
                s += y0[i * y[0].ld + j];
                a += fabs(y0[i * y[0].ld + j]);
            }
            expect_close(what, mat_get(&y[0], i, j), s, 2e-6 * a, i * N + j);
        }
    free(x.p);
    free(y[0].p);
    free(y[1].p);
    free(y0);
    wmat_free(&w);
}

static void test_matmul(void)
{
    /* Odd sizes, single rows and columns, exact register tiles (6 x 16), K
     * across the 256-wide blocks, M across the 192-row tiles, N across the
     * 64-column tiles. */
    static const int64_t shapes[][3] = {{1, 1, 1},    {1, 7, 5},     {7, 13, 33},
                                        {6, 16, 256}, {13, 67, 300}, {200, 130, 520},
                                        {3, 64, 1},   {37, 1, 700},  {1, 129, 257}};
    const df_dtype dts[] = {DF_DTYPE_BF16, DF_DTYPE_F16, DF_DTYPE_F32};
    /* Both kernels: the AVX2 one (where the CPU has it) and the portable one. */
    for (int simd = 1; simd >= 0; simd--) {
        df_knob_set(DF_KNOB_CPU_SIMD, simd ? "1" : "0");
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (int d = 0; d < 3; d++)
                for (int acc = 0; acc < 2; acc++)
                    if (!(d == 1 && acc == 1)) /* F16 once per shape is enough */
                        check_matmul(shapes[s][0], shapes[s][1], shapes[s][2], dts[d], acc);
    }
    df_knob_set(DF_KNOB_CPU_SIMD, NULL);

    /* Bad arguments: -EINVAL and y untouched. */
    mat x = mat_new(4, 8, 8), y = mat_new(4, 5, 5);
    fill(x.p, 32, 1.0f);
    wmat w = wmat_new(DF_DTYPE_BF16, 5, 8, 8, 1.0f);
    wmat w7 = wmat_new(DF_DTYPE_BF16, 5, 7, 7, 1.0f);
    poison(y.p, 20);
    CHECK_EQ(df_op_matmul(bes[0], &x.t, &w7.t, &y.t, 0), -EINVAL); /* K differs */
    df_tensor t = w.t;
    t.dtype = DF_DTYPE_I32;
    CHECK_EQ(df_op_matmul(bes[0], &x.t, &t, &y.t, 0), -EINVAL);
    t = x.t;
    t.dtype = DF_DTYPE_BF16; /* activations are f32 */
    CHECK_EQ(df_op_matmul(bes[0], &t, &w.t, &y.t, 0), -EINVAL);
    t = y.t;
    t.shape[0] = 3;
    CHECK_EQ(df_op_matmul(bes[0], &x.t, &w.t, &t, 0), -EINVAL);
    t = x.t;
    t.stride[1] = 2;
    t.shape[1] = 4;
    CHECK_EQ(df_op_matmul(bes[0], &t, &w.t, &y.t, 0), -EINVAL); /* inner stride */
    t = y.t;
    t.stride[0] = 4; /* rows of y would overlap */
    CHECK_EQ(df_op_matmul(bes[0], &x.t, &w.t, &t, 0), -EINVAL);
    t = y.t;
    t.ndim = 3;
    t.shape[2] = 1;
    t.stride[2] = 1;
    CHECK_EQ(df_op_matmul(bes[0], &x.t, &w.t, &t, 0), -EINVAL);
    for (int i = 0; i < 20; i++)
        CHECK(is_poison(y.p[i]));
    /* y overlapping x: refused, x untouched. */
    float *xc = fbuf(32);
    memcpy(xc, x.p, 32 * sizeof(float));
    df_tensor xy = df_tensor_2d(x.p, DF_DTYPE_F32, 4, 5);
    xy.stride[0] = 8;
    CHECK_EQ(df_op_matmul(bes[0], &x.t, &w.t, &xy, 0), -EINVAL);
    CHECK(bitwise_equal(x.p, xc, 32));
    /* ...but two disjoint column views of one buffer are fine: y = cols 8..13
     * of a [4, 16] buffer whose cols 0..7 are x. */
    float *fused = fbuf(4 * 16);
    for (int i = 0; i < 4; i++)
        memcpy(&fused[i * 16], &x.p[i * 8], 8 * sizeof(float));
    df_tensor fb = df_tensor_2d(fused, DF_DTYPE_F32, 4, 16);
    df_tensor fx = df_tensor_cols(&fb, 0, 8), fy = df_tensor_cols(&fb, 8, 5);
    CHECK_EQ(df_op_matmul(bes[0], &fx, &w.t, &fy, 0), 0);
    CHECK_EQ(df_op_matmul(bes[0], &x.t, &w.t, &y.t, 0), 0);
    for (int i = 0; i < 4; i++)
        CHECK(bitwise_equal(&fused[i * 16 + 8], &y.p[i * 5], 5));
    /* a view shifted by one column does overlap */
    df_tensor fy2 = df_tensor_cols(&fb, 7, 5);
    CHECK_EQ(df_op_matmul(bes[0], &fx, &w.t, &fy2, 0), -EINVAL);
    free(fused);
    free(xc);
    free(x.p);
    free(y.p);
    wmat_free(&w);
    wmat_free(&w7);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void bench_matmul(void)
{
    const int64_t M = 512, K = 1024, N = 1024;
    mat x = mat_new(M, K, K), y = mat_new(M, N, N);
    fill(x.p, M * K, 1.0f);
    const df_dtype dts[] = {DF_DTYPE_BF16, DF_DTYPE_F32};
    for (int d = 0; d < 2; d++) {
        wmat w = wmat_new(dts[d], N, K, K, 0.05f);
        for (int nt = 1; nt <= 2; nt++) {
            df_backend *be = df_backend_cpu_open(nt, NULL);
            double best = 1e30;
            for (int rep = 0; rep < 5; rep++) {
                double t0 = now_s();
                CHECK_EQ(df_op_matmul(be, &x.t, &w.t, &y.t, 0), 0);
                double dt = now_s() - t0;
                if (dt < best)
                    best = dt;
            }
            printf("matmul M=%lld K=%lld N=%lld w=%s threads=%d: %.2f ms, %.1f GFLOP/s\n",
                   (long long)M, (long long)K, (long long)N, dtname(dts[d]), nt, best * 1e3,
                   2.0 * M * N * K / best * 1e-9);
            df_backend_close(be);
        }
        wmat_free(&w);
    }
    free(x.p);
    free(y.p);
}

/* ---- add, swiglu, sigmoid, silu ---- */

static double ref_sigmoid(double x)
{
    return 1.0 / (1.0 + exp(-x));
}

enum { OP_ADD, OP_SWIGLU, OP_SIGMOID, OP_SILU };

static int run_ew(int op, df_backend *be, const df_tensor *a, const df_tensor *b, df_tensor *out)
{
    switch (op) {
    case OP_ADD: return df_op_add(be, a, out);
    case OP_SWIGLU: return df_op_swiglu(be, a, b, out);
    case OP_SIGMOID: return df_op_sigmoid(be, a, out);
    default: return df_op_silu(be, a, out);
    }
}

/* add: the fp32 sum of two floats is their exact sum rounded once, which is
 * what (float)(double a + double b) gives: equality. The others are a few
 * correctly rounded steps plus expf (< 1 ulp): within ~4u of the result, so
 * 2e-6 relative (plus 1e-30 for results that underflow) has a 8x margin. */
static void test_elementwise(void)
{
    const char *names[] = {"add", "swiglu", "sigmoid", "silu"};
    static const int64_t shapes[][2] = {{1, 1}, {5, 9}, {33, 257}, {1, 1000}};
    for (int op = 0; op < 4; op++)
        for (size_t s = 0; s < 4; s++) {
            int64_t R = shapes[s][0], C = shapes[s][1], ld = C + 2;
            mat a = mat_new(R, C, ld), b = mat_new(R, C, ld + 1);
            fill(a.p, R * ld, 4.0f);
            fill(b.p, R * (ld + 1), 4.0f);
            if (C >= 9) { /* saturating inputs: sigmoid -> 0/1, silu -> -0/x, no NaN */
                a.p[3] = 200.0f;
                a.p[4] = -200.0f;
                a.p[5] = 1e30f;
                a.p[6] = -1e30f;
                a.p[7] = 0.0f;
            }
            mat out[2] = {mat_new(R, C, ld + 3), mat_new(R, C, ld + 3)};
            float *y0 = fbuf(R * out[0].ld);
            fill(y0, R * out[0].ld, 4.0f);
            for (int bi = 0; bi < 2; bi++) {
                poison(out[bi].p, R * out[bi].ld);
                if (op == OP_ADD) /* y = x + y: y starts as y0 */
                    for (int64_t r = 0; r < R; r++)
                        memcpy(&out[bi].p[r * out[bi].ld], &y0[r * out[bi].ld],
                               (size_t)C * sizeof(float));
                CHECK_EQ(run_ew(op, bes[bi], &a.t, &b.t, &out[bi].t), 0);
                CHECK(pad_intact(&out[bi]));
            }
            CHECK(bitwise_equal(out[0].p, out[1].p, R * out[0].ld));
            for (int64_t r = 0; r < R; r++)
                for (int64_t c = 0; c < C; c++) {
                    double x = mat_get(&a, r, c), ref;
                    switch (op) {
                    case OP_ADD: ref = (float)(x + (double)y0[r * out[0].ld + c]); break;
                    case OP_SWIGLU: ref = x * ref_sigmoid(x) * mat_get(&b, r, c); break;
                    case OP_SIGMOID: ref = ref_sigmoid(x); break;
                    default: ref = x * ref_sigmoid(x); break;
                    }
                    double tol = op == OP_ADD ? 0.0 : 2e-6 * fabs(ref) + 1e-30;
                    expect_close(names[op], mat_get(&out[0], r, c), ref, tol, r * C + c);
                }

            /* The same view as output is allowed (in place), and gives the same bits. */
            if (op != OP_ADD) {
                mat in = mat_new(R, C, ld);
                for (int64_t i = 0; i < R * ld; i++)
                    in.p[i] = a.p[i];
                CHECK_EQ(run_ew(op, bes[1], &in.t, &b.t, &in.t), 0);
                for (int64_t r = 0; r < R; r++)
                    CHECK(bitwise_equal(&in.p[r * ld], &out[0].p[r * out[0].ld], C));
                if (op == OP_SWIGLU) { /* out aliasing up */
                    mat up = mat_new(R, C, ld + 1);
                    memcpy(up.p, b.p, (size_t)(R * (ld + 1)) * sizeof(float));
                    CHECK_EQ(df_op_swiglu(bes[1], &a.t, &up.t, &up.t), 0);
                    for (int64_t r = 0; r < R; r++)
                        CHECK(bitwise_equal(&up.p[r * up.ld], &out[0].p[r * out[0].ld], C));
                    free(up.p);
                }
                free(in.p);
            } else {
                mat in = mat_new(R, C, ld);
                memcpy(in.p, a.p, (size_t)(R * ld) * sizeof(float));
                CHECK_EQ(df_op_add(bes[1], &in.t, &in.t), 0); /* y = 2y: exact */
                for (int64_t r = 0; r < R; r++)
                    for (int64_t c = 0; c < C; c++)
                        CHECK(in.p[r * ld + c] == 2 * a.p[r * ld + c]);
                free(in.p);
            }

            /* Bad: shapes differ, wrong dtype, output partly overlapping an input. */
            poison(out[0].p, R * out[0].ld);
            df_tensor t = a.t;
            t.shape[1] = C + 1;
            CHECK_EQ(run_ew(op, bes[0], &t, &b.t, &out[0].t), -EINVAL);
            t = a.t;
            t.dtype = DF_DTYPE_BF16;
            CHECK_EQ(run_ew(op, bes[0], &t, &b.t, &out[0].t), -EINVAL);
            if (op == OP_SWIGLU || op == OP_ADD) {
                t = b.t;
                t.shape[0] = R + 1;
                CHECK_EQ(run_ew(op, bes[0], &a.t, op == OP_ADD ? &b.t : &t,
                                op == OP_ADD ? &t : &out[0].t),
                         -EINVAL);
            }
            for (int64_t i = 0; i < R * out[0].ld; i++)
                CHECK(is_poison(out[0].p[i]));
            if (C > 1) {
                /* out = a's view shifted by one element: refused, a untouched. */
                float *keep = fbuf(R * ld);
                memcpy(keep, a.p, (size_t)(R * ld) * sizeof(float));
                df_tensor sh = a.t;
                sh.data = a.p + 1;
                CHECK_EQ(run_ew(op, bes[0], &a.t, &b.t, &sh), -EINVAL);
                CHECK(bitwise_equal(keep, a.p, R * ld));
                free(keep);
            }
            free(a.p);
            free(b.p);
            free(out[0].p);
            free(out[1].p);
            free(y0);
        }

    /* N-D tensors: a [2, 3, 5] view inside a [2, 4, 7] buffer. */
    float *xa = fbuf(56), *ya = fbuf(56);
    fill(xa, 56, 1.0f);
    poison(ya, 56);
    df_tensor x3 = {xa, DF_DTYPE_F32, 3, {2, 3, 5, 0}, {28, 7, 1, 0}};
    df_tensor y3 = {ya, DF_DTYPE_F32, 3, {2, 3, 5, 0}, {28, 7, 1, 0}};
    CHECK_EQ(df_op_sigmoid(bes[1], &x3, &y3), 0);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++)
            for (int c = 0; c < 7; c++) {
                int64_t o = i * 28 + j * 7 + c;
                if (j < 3 && c < 5)
                    expect_close("sigmoid 3-D", ya[o], ref_sigmoid(xa[o]),
                                 2e-6 * ref_sigmoid(xa[o]), o);
                else
                    CHECK(is_poison(ya[o]));
            }
    free(xa);
    free(ya);
}

/* ---- RMSNorm, plain / plus_one / gated ---- */

/* The fp32 sum of D squares is within ~u*sqrt(D) relative (positive terms,
 * 8 partial sums), the rsqrt and the 2-3 products add a few u: every output
 * is within ~1e-6 of its own magnitude. 1e-5 relative leaves 10x. */
static void check_rmsnorm(int64_t R, int64_t D, df_dtype wt, int plus_one, int gated)
{
    char what[96];
    snprintf(what, sizeof what, "rmsnorm%s R=%lld D=%lld %s plus_one=%d", gated ? "_gated" : "",
             (long long)R, (long long)D, dtname(wt), plus_one);
    const float eps = 1e-6f;
    mat x = mat_new(R, D, D + 1), z = mat_new(R, D, D + 2);
    fill(x.p, R * x.ld, 1.0f);
    fill(z.p, R * z.ld, 3.0f);
    /* Rows of very different scale: the norm must not care. */
    for (int64_t r = 0; r < R; r++) {
        float sc = powf(10.0f, (float)(test_rand(&rng) % 5) - 2.0f);
        for (int64_t c = 0; c < D; c++)
            x.p[r * x.ld + c] *= sc;
    }
    /* Plus-one weights are small around 0 as in the zero-centred checkpoints. */
    wmat w = wvec_new(wt, D, plus_one ? 0.1f : 1.0f);
    mat y[2] = {mat_new(R, D, D + 3), mat_new(R, D, D + 3)};
    for (int b = 0; b < 2; b++) {
        poison(y[b].p, R * y[b].ld);
        int rc = gated ? df_op_rmsnorm_gated(bes[b], &x.t, &z.t, &w.t, eps, &y[b].t)
                       : df_op_rmsnorm(bes[b], &x.t, &w.t, eps, plus_one, &y[b].t);
        CHECK_EQ(rc, 0);
        CHECK(pad_intact(&y[b]));
    }
    CHECK(bitwise_equal(y[0].p, y[1].p, R * y[0].ld));
    for (int64_t r = 0; r < R; r++) {
        double ss = 0;
        for (int64_t c = 0; c < D; c++)
            ss += (double)mat_get(&x, r, c) * mat_get(&x, r, c);
        double inv = 1.0 / sqrt(ss / (double)D + (double)eps);
        for (int64_t c = 0; c < D; c++) {
            double g = plus_one ? 1.0 + w.val[c] : w.val[c];
            double ref = mat_get(&x, r, c) * inv * g;
            if (gated) {
                double zz = mat_get(&z, r, c);
                ref *= zz * ref_sigmoid(zz);
            }
            expect_close(what, mat_get(&y[0], r, c), ref, 1e-5 * fabs(ref) + 1e-30, r * D + c);
        }
    }
    /* In place (y = x, the same view): the same bits. */
    mat xi = mat_new(R, D, D + 1);
    memcpy(xi.p, x.p, (size_t)(R * x.ld) * sizeof(float));
    int rc = gated ? df_op_rmsnorm_gated(bes[1], &xi.t, &z.t, &w.t, eps, &xi.t)
                   : df_op_rmsnorm(bes[1], &xi.t, &w.t, eps, plus_one, &xi.t);
    CHECK_EQ(rc, 0);
    for (int64_t r = 0; r < R; r++)
        CHECK(bitwise_equal(&xi.p[r * xi.ld], &y[0].p[r * y[0].ld], D));
    free(xi.p);
    free(x.p);
    free(z.p);
    free(y[0].p);
    free(y[1].p);
    wmat_free(&w);
}

static void test_rmsnorm(void)
{
    static const int64_t shapes[][2] = {{1, 1}, {3, 7}, {17, 128}, {5, 257}, {40, 256}};
    for (size_t s = 0; s < 5; s++)
        for (int wt = 0; wt < 2; wt++) {
            df_dtype t = wt ? DF_DTYPE_F32 : DF_DTYPE_BF16;
            check_rmsnorm(shapes[s][0], shapes[s][1], t, 0, 0);
            check_rmsnorm(shapes[s][0], shapes[s][1], t, 1, 0);
            check_rmsnorm(shapes[s][0], shapes[s][1], t, 0, 1);
        }

    /* Per-head view: [T, heads*D] seen as [T*heads, D] (Qwen3's q_norm). */
    check_rmsnorm(6 * 4, 32, DF_DTYPE_BF16, 1, 0);

    /* Bad: weight length, weight 2-D, eps NaN/negative, z shape, y shifted onto x. */
    mat x = mat_new(4, 8, 8), y = mat_new(4, 8, 8), z = mat_new(4, 8, 8);
    fill(x.p, 32, 1.0f);
    fill(z.p, 32, 1.0f);
    wmat w7 = wvec_new(DF_DTYPE_BF16, 7, 1.0f), w = wvec_new(DF_DTYPE_BF16, 8, 1.0f);
    wmat w2 = wmat_new(DF_DTYPE_BF16, 2, 8, 8, 1.0f);
    poison(y.p, 32);
    CHECK_EQ(df_op_rmsnorm(bes[0], &x.t, &w7.t, 1e-6f, 0, &y.t), -EINVAL);
    CHECK_EQ(df_op_rmsnorm(bes[0], &x.t, &w2.t, 1e-6f, 0, &y.t), -EINVAL);
    CHECK_EQ(df_op_rmsnorm(bes[0], &x.t, &w.t, NAN, 0, &y.t), -EINVAL);
    CHECK_EQ(df_op_rmsnorm(bes[0], &x.t, &w.t, -1.0f, 0, &y.t), -EINVAL);
    df_tensor t = z.t;
    t.shape[0] = 3;
    CHECK_EQ(df_op_rmsnorm_gated(bes[0], &x.t, &t, &w.t, 1e-6f, &y.t), -EINVAL);
    CHECK_EQ(df_op_rmsnorm_gated(bes[0], &x.t, &z.t, &w7.t, 1e-6f, &y.t), -EINVAL);
    CHECK_EQ(df_op_rmsnorm_gated(bes[0], &x.t, &z.t, &w.t, 1e-6f, &z.t), -EINVAL); /* y = z */
    for (int i = 0; i < 32; i++)
        CHECK(is_poison(y.p[i]));
    df_tensor xs = df_tensor_2d(x.p + 8, DF_DTYPE_F32, 3, 8); /* rows 1..3 of x */
    df_tensor x3 = df_tensor_2d(x.p, DF_DTYPE_F32, 3, 8);
    CHECK_EQ(df_op_rmsnorm(bes[0], &x3, &w.t, 1e-6f, 0, &xs), -EINVAL);
    free(x.p);
    free(y.p);
    free(z.p);
    wmat_free(&w);
    wmat_free(&w7);
    wmat_free(&w2);
}

/* ---- RoPE ---- */

/* The contract fixes the angle's fp32 roundings (HF's): inv_freq = 1 /
 * theta^(2d/rot) and angle = pos * inv_freq, each rounded to fp32. The
 * reference reproduces those two steps (they are the definition, not an
 * implementation detail: at pos 5000 the fp32 angle differs from the exact
 * one by up to 2e-4 rad), then rotates in double. cosf/sinf of the same
 * angle are within 1 ulp of the double ones and the rotation adds ~2u, so
 * each output is within ~4u of the pair's norm: 1e-6 of it leaves 4x. */
static void check_rope(int64_t T, int heads, int hd, int rot, double theta, int64_t pos_max)
{
    char what[96];
    snprintf(what, sizeof what, "rope T=%lld heads=%d hd=%d rot=%d theta=%g", (long long)T, heads,
             hd, rot, theta);
    int64_t C = (int64_t)heads * hd;
    mat x = mat_new(T, C, C + 3);
    fill(x.p, T * x.ld, 1.0f);
    for (int64_t r = 0; r < T; r++)
        for (int64_t c = C; c < x.ld; c++)
            memcpy(&x.p[r * x.ld + c], &POISON, 4);
    int32_t *pos = malloc((size_t)T * sizeof *pos);
    for (int64_t t = 0; t < T; t++)
        pos[t] = (int32_t)(test_rand(&rng) % (uint64_t)(pos_max + 1));
    pos[0] = 0;
    mat out[2] = {mat_new(T, C, C + 3), mat_new(T, C, C + 3)};
    for (int b = 0; b < 2; b++) {
        memcpy(out[b].p, x.p, (size_t)(T * x.ld) * sizeof(float));
        CHECK_EQ(df_op_rope(bes[b], &out[b].t, pos, heads, hd, rot, theta), 0);
        CHECK(pad_intact(&out[b]));
    }
    CHECK(bitwise_equal(out[0].p, out[1].p, T * out[0].ld));
    int half = rot / 2;
    for (int64_t t = 0; t < T; t++)
        for (int h = 0; h < heads; h++) {
            int64_t o = t * x.ld + (int64_t)h * hd;
            for (int d = 0; d < half; d++) {
                float inv = 1.0f / powf((float)theta, (float)(2 * d) / (float)rot);
                float ang = (float)pos[t] * inv;
                double x1 = x.p[o + d], x2 = x.p[o + d + half];
                double c = cos((double)ang), s = sin((double)ang);
                double tol = 1e-6 * sqrt(x1 * x1 + x2 * x2);
                expect_close(what, out[0].p[o + d], x1 * c - x2 * s, tol, o + d);
                expect_close(what, out[0].p[o + d + half], x2 * c + x1 * s, tol, o + d + half);
            }
            /* dims rot.. are untouched, bit for bit */
            CHECK(bitwise_equal(&out[0].p[o + rot], &x.p[o + rot], hd - rot));
        }
    free(pos);
    free(x.p);
    free(out[0].p);
    free(out[1].p);
}

static void test_rope(void)
{
    check_rope(1, 1, 2, 2, 10000.0, 0);
    check_rope(9, 3, 8, 8, 10000.0, 50);         /* full NeoX (Qwen3-like) */
    check_rope(13, 2, 128, 128, 1e6, 5000);      /* Qwen3 head_dim, theta */
    check_rope(11, 4, 64, 16, 1e7, 5000);        /* partial: Qwen3.5's 1/4 */
    check_rope(7, 3, 10, 6, 500.0, 300);         /* odd half */
    check_rope(70, 2, 256, 64, 1e7, 100000);     /* Qwen3.5 shape, large positions */

    /* Bad: odd rot_dim, rot > head_dim, heads*hd != cols, bf16 x, theta <= 0. */
    mat x = mat_new(3, 16, 16);
    poison(x.p, 48);
    int32_t pos[3] = {0, 1, 2};
    CHECK_EQ(df_op_rope(bes[0], &x.t, pos, 2, 8, 5, 1e4), -EINVAL);
    CHECK_EQ(df_op_rope(bes[0], &x.t, pos, 2, 8, 10, 1e4), -EINVAL);
    CHECK_EQ(df_op_rope(bes[0], &x.t, pos, 2, 8, 0, 1e4), -EINVAL);
    CHECK_EQ(df_op_rope(bes[0], &x.t, pos, 3, 8, 8, 1e4), -EINVAL);
    CHECK_EQ(df_op_rope(bes[0], &x.t, pos, 2, 8, 8, 0.0), -EINVAL);
    CHECK_EQ(df_op_rope(bes[0], &x.t, NULL, 2, 8, 8, 1e4), -EINVAL);
    df_tensor t = x.t;
    t.dtype = DF_DTYPE_BF16;
    CHECK_EQ(df_op_rope(bes[0], &t, pos, 2, 8, 8, 1e4), -EINVAL);
    for (int i = 0; i < 48; i++)
        CHECK(is_poison(x.p[i]));
    free(x.p);
}

/* ---- attention ---- */

/* Reference: per (row, head) scores s_j = (q.k_j) * scale, softmax and
 * sum_j p_j v_j, all in double. Errors: each fp32 score is off by ~u * scale
 * * sum|q k| (call its max over j smax), which moves p_j by that relatively;
 * the weighted sum adds ~u relative to sum p_j |v_j| (absref). So tol =
 * absref * (1e-5 + 1e-6 * smax): >= 10x the expected error, and still far
 * below what a wrong key range (one key more or less) changes. */
static void check_attention(const int32_t *lens, int n_seq, int nq, int nkv, int D, int gated,
                            float qscale)
{
    char what[128];
    snprintf(what, sizeof what, "attention n_seq=%d nq=%d nkv=%d D=%d gate=%d qscale=%g", n_seq,
             nq, nkv, D, gated, qscale);
    int32_t cu[16];
    cu[0] = 0;
    for (int s = 0; s < n_seq; s++)
        cu[s + 1] = cu[s] + lens[s];
    int64_t T = cu[n_seq];
    /* q, k, v as column views of one fused projection output; gate too. */
    int64_t W = (int64_t)(2 * nq + 2 * nkv) * D + 1;
    mat qkv = mat_new(T, W, W);
    fill(qkv.p, T * W, 1.0f);
    for (int64_t i = 0; i < T * W; i++)
        qkv.p[i] *= qscale; /* q, k alike: sharper softmax */
    df_tensor q = df_tensor_cols(&qkv.t, 0, (int64_t)nq * D);
    df_tensor g = df_tensor_cols(&qkv.t, (int64_t)nq * D, (int64_t)nq * D);
    df_tensor k = df_tensor_cols(&qkv.t, (int64_t)2 * nq * D, (int64_t)nkv * D);
    df_tensor v = df_tensor_cols(&qkv.t, (int64_t)(2 * nq + nkv) * D, (int64_t)nkv * D);
    float scale = 1.0f / sqrtf((float)D);
    int64_t C = (int64_t)nq * D;
    mat out[2] = {mat_new(T, C, C + 2), mat_new(T, C, C + 2)};
    for (int b = 0; b < 2; b++) {
        poison(out[b].p, T * out[b].ld);
        CHECK_EQ(df_op_attention(bes[b], &q, &k, &v, cu, n_seq, nq, nkv, D, scale,
                                 gated ? &g : NULL, &out[b].t),
                 0);
        CHECK(pad_intact(&out[b]));
    }
    if (!bitwise_equal(out[0].p, out[1].p, T * out[0].ld)) {
        fprintf(stderr, "%s: 1 and 3 threads differ\n", what);
        df_test_failures++;
    }
    double *s = dbuf(T), *acc = dbuf(D), *aref = dbuf(D);
    for (int sq = 0; sq < n_seq; sq++)
        for (int64_t i = cu[sq]; i < cu[sq + 1]; i++)
            for (int h = 0; h < nq; h++) {
                int kh = h / (nq / nkv);
                const float *qi = (const float *)df_tensor_at(&q, i, (int64_t)h * D);
                double mx = -INFINITY, smax = 0, sum = 0;
                for (int64_t j = cu[sq]; j <= i; j++) {
                    const float *kj = (const float *)df_tensor_at(&k, j, (int64_t)kh * D);
                    double d = 0, a = 0;
                    for (int e = 0; e < D; e++) {
                        d += (double)qi[e] * kj[e];
                        a += fabs((double)qi[e] * kj[e]);
                    }
                    s[j - cu[sq]] = d * scale;
                    mx = fmax(mx, d * scale);
                    smax = fmax(smax, a * scale);
                }
                for (int64_t j = cu[sq]; j <= i; j++)
                    sum += exp(s[j - cu[sq]] - mx);
                for (int e = 0; e < D; e++)
                    acc[e] = aref[e] = 0;
                for (int64_t j = cu[sq]; j <= i; j++) {
                    double p = exp(s[j - cu[sq]] - mx) / sum;
                    const float *vj = (const float *)df_tensor_at(&v, j, (int64_t)kh * D);
                    for (int e = 0; e < D; e++) {
                        acc[e] += p * vj[e];
                        aref[e] += p * fabs(vj[e]);
                    }
                }
                for (int e = 0; e < D; e++) {
                    double ref = acc[e], mag = aref[e];
                    if (gated) {
                        double gs = ref_sigmoid(*(const float *)df_tensor_at(&g, i, (int64_t)h * D + e));
                        ref *= gs;
                        mag *= gs;
                    }
                    expect_close(what, mat_get(&out[0], i, (int64_t)h * D + e), ref,
                                 mag * (1e-5 + 1e-6 * smax) + 1e-30, i * C + h * D + e);
                }
            }
    free(s);
    free(acc);
    free(aref);
    free(qkv.p);
    free(out[0].p);
    free(out[1].p);
}

static void test_attention(void)
{
    static const int32_t lens4[] = {1, 7, 64, 130};
    static const int32_t one[] = {1}, with_empty[] = {5, 0, 3};
    static const int ratios[][2] = {{2, 2}, {4, 2}, {8, 2}}; /* GQA 1, 2, 4 */
    for (int r = 0; r < 3; r++)
        for (int gated = 0; gated < 2; gated++)
            check_attention(lens4, 4, ratios[r][0], ratios[r][1], 16, gated, 1.0f);
    check_attention(lens4, 4, 4, 1, 64, 1, 1.0f);     /* GQA 4, bigger heads */
    check_attention(lens4 + 2, 1, 2, 1, 24, 0, 4.0f); /* sharp softmax: scores ~ +-100 */
    check_attention(one, 1, 3, 3, 5, 1, 1.0f);        /* a single one-key row, odd D */
    check_attention(with_empty, 3, 2, 1, 8, 0, 1.0f); /* an empty document in the pack */

    /* Bad arguments: out untouched. */
    const int T = 6, D = 4;
    mat q = mat_new(T, 4 * D, 4 * D), kv = mat_new(T, 2 * D, 2 * D), o = mat_new(T, 4 * D, 4 * D);
    fill(q.p, T * 4 * D, 1.0f);
    fill(kv.p, T * 2 * D, 1.0f);
    poison(o.p, T * 4 * D);
    int32_t cu[] = {0, 2, 6}, cu_short[] = {0, 2, 5}, cu_dec[] = {0, 4, 3, 6}, cu_off[] = {1, 6};
    CHECK_EQ(df_op_attention(bes[0], &q.t, &kv.t, &kv.t, cu, 2, 4, 3, D, 0.5f, NULL, &o.t),
             -EINVAL); /* 4 % 3 */
    CHECK_EQ(df_op_attention(bes[0], &q.t, &kv.t, &kv.t, cu, 2, 4, 2, D + 1, 0.5f, NULL, &o.t),
             -EINVAL);
    CHECK_EQ(df_op_attention(bes[0], &q.t, &kv.t, &kv.t, cu_short, 2, 4, 2, D, 0.5f, NULL, &o.t),
             -EINVAL);
    CHECK_EQ(df_op_attention(bes[0], &q.t, &kv.t, &kv.t, cu_dec, 3, 4, 2, D, 0.5f, NULL, &o.t),
             -EINVAL);
    CHECK_EQ(df_op_attention(bes[0], &q.t, &kv.t, &kv.t, cu_off, 1, 4, 2, D, 0.5f, NULL, &o.t),
             -EINVAL);
    CHECK_EQ(df_op_attention(bes[0], &q.t, &kv.t, &kv.t, cu, -1, 4, 2, D, 0.5f, NULL, &o.t),
             -EINVAL);
    CHECK_EQ(df_op_attention(bes[0], &q.t, &kv.t, &kv.t, NULL, 2, 4, 2, D, 0.5f, NULL, &o.t),
             -EINVAL);
    CHECK_EQ(df_op_attention(bes[0], &q.t, &kv.t, &kv.t, cu, 2, 4, 2, D, NAN, NULL, &o.t),
             -EINVAL);
    df_tensor gbad = df_tensor_cols(&q.t, 0, 4 * D - 1);
    CHECK_EQ(df_op_attention(bes[0], &q.t, &kv.t, &kv.t, cu, 2, 4, 2, D, 0.5f, &gbad, &o.t),
             -EINVAL);
    df_tensor kshort = kv.t;
    kshort.shape[0] = T - 1;
    CHECK_EQ(df_op_attention(bes[0], &q.t, &kshort, &kv.t, cu, 2, 4, 2, D, 0.5f, NULL, &o.t),
             -EINVAL);
    for (int i = 0; i < T * 4 * D; i++)
        CHECK(is_poison(o.p[i]));
    /* out on top of q (or the gate): refused, q untouched. */
    float *keep = fbuf(T * 4 * D);
    memcpy(keep, q.p, (size_t)(T * 4 * D) * sizeof(float));
    CHECK_EQ(df_op_attention(bes[0], &q.t, &kv.t, &kv.t, cu, 2, 4, 2, D, 0.5f, NULL, &q.t),
             -EINVAL);
    CHECK_EQ(df_op_attention(bes[0], &o.t, &kv.t, &kv.t, cu, 2, 4, 2, D, 0.5f, &q.t, &q.t),
             -EINVAL);
    CHECK(bitwise_equal(keep, q.p, T * 4 * D));
    free(keep);
    free(q.p);
    free(kv.p);
    free(o.p);
}

int main(void)
{
    df_err e = {0};
    bes[0] = df_backend_cpu_open(1, &e);
    bes[1] = df_backend_cpu_open(3, &e);
    if (!bes[0] || !bes[1]) {
        fprintf(stderr, "cannot open the cpu backend: %s\n", e.msg);
        return 1;
    }
    test_helpers();
    test_backend();
    test_embed();
    test_matmul();
    test_elementwise();
    test_rmsnorm();
    test_rope();
    test_attention();
    if (getenv("DFLASH_OPS_BENCH"))
        bench_matmul();
    df_backend_close(bes[0]);
    df_backend_close(bes[1]);
    return test_main_end();
}
