/* test_fp8.c - FP8 (E4M3) rounding: common/e4m3.h's rule and scales, the
 * reference quantize-dequantize, df_op_fp8_qdq and df_op_matmul_fp8 on the
 * CPU backend, and the LM head's FP8 input gradient (DF_CE_FP8_GRAD).
 *
 * The rule is checked against brute force written here: the nearest of all
 * 253 finite E4M3 values (ties to the even code), and the block scale as the
 * smallest power of two that makes the block fit 448, found by a loop. */
#include "cuda/fp8_mx.h"
#include "e4m3.h"
#include "test.h"
#include "train_ops.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the E4M3 code nearest to x >= 0 (finite), ties to the even code, by
 * trying all of them; saturating at 448 */
static uint8_t brute_code(double x)
{
    int best = 0;
    double bd = INFINITY;
    for (int c = 0; c < 0x7f; c++) {
        double d = fabs(x - df_e4m3_to_f32((uint8_t)c));
        if (d < bd || (d == bd && !(c & 1))) {
            bd = d;
            best = c;
        }
    }
    return (uint8_t)best;
}

static float bits_f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* a random finite non-negative float, uniform over the bit patterns */
static float rand_finite(uint64_t *st)
{
    uint32_t u;
    do
        u = (uint32_t)test_rand(st) & 0x7fffffffu;
    while (u >= 0x7f800000u);
    return bits_f(u);
}

static void test_code(void)
{
    /* every E4M3 value round-trips; the values between two neighbours, their
     * midpoint and points next to it go to the brute-force code */
    for (int c = 0; c < 0x7f; c++) {
        float v = df_e4m3_to_f32((uint8_t)c);
        CHECK_EQ(df_e4m3_from_f32(v), c);
        CHECK_EQ(df_e4m3_from_f32(-v), c | 0x80);
        if (c + 1 < 0x7f) {
            double w = df_e4m3_to_f32((uint8_t)(c + 1)), mid = (v + w) / 2;
            float pts[] = {(float)mid, nextafterf((float)mid, 0), nextafterf((float)mid, 1e9f),
                           (float)(v + (w - v) / 4), (float)(v + 3 * (w - v) / 4)};
            for (int k = 0; k < 5; k++)
                CHECK_EQ(df_e4m3_from_f32(pts[k]), brute_code(pts[k]));
        }
    }
    /* random magnitudes over the whole float range */
    uint64_t st = 42;
    for (int i = 0; i < 200000; i++) {
        float x = rand_finite(&st);
        uint8_t want = x > 448.0f ? 0x7e : brute_code(x);
        uint8_t got = df_e4m3_from_f32(x);
        if (got != want) {
            fprintf(stderr, "e4m3 of %a: %#x, want %#x\n", x, got, want);
            CHECK(0);
            break;
        }
    }
    CHECK_EQ(df_e4m3_from_f32(1e30f), 0x7e);
    CHECK_EQ(df_e4m3_from_f32(-1e30f), 0xfe);
    CHECK_EQ(df_e4m3_from_f32(INFINITY), 0x7f);
    CHECK_EQ(df_e4m3_from_f32(-INFINITY), 0xff);
    CHECK_EQ(df_e4m3_from_f32(NAN) & 0x7f, 0x7f);
    CHECK_EQ(df_e4m3_from_f32(-0.0f), 0x80);
    CHECK_EQ(df_e4m3_from_f32(0x1p-10f), 0x00); /* the tie between 0 and 2^-9 */
    CHECK_EQ(df_e4m3_from_f32(432.0f), 0x7e);   /* the tie between 416 and 448 */
}

static double brute_scale(float amax)
{
    if (!(amax > 0) || !isfinite(amax))
        return 1.0;
    int k = -100;
    while (k < 127 && amax / ldexp(1.0, k) > 448.0)
        k++;
    return ldexp(1.0, k);
}

static void test_scale(void)
{
    uint64_t st = 7;
    for (int i = 0; i < 100000; i++) {
        float a = rand_finite(&st);
        CHECK(df_fp8_pow2_scale(a) == brute_scale(a));
    }
    float edge[] = {448.0f, nextafterf(448.0f, 1e9f), 896.0f, 1.0f, 0x1p-120f, 0x1p-149f, 3e38f,
                    0.0f};
    for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++)
        CHECK(df_fp8_pow2_scale(edge[i]) == brute_scale(edge[i]));
    CHECK(df_fp8_pow2_scale(448.0f) == 1.0f);
    CHECK(df_fp8_pow2_scale(449.0f) == 2.0f);
    CHECK(df_fp8_pow2_scale(INFINITY) == 1.0f && df_fp8_pow2_scale(NAN) == 1.0f);
}

/* x[rows, cols] (ld) quantize-dequantized by brute force, into y (ld cols) */
static void brute_qdq(const float *x, int64_t rows, int64_t cols, int64_t ld, int64_t br,
                      int64_t bc, float *y)
{
    for (int64_t r0 = 0; r0 < rows; r0 += br)
        for (int64_t c0 = 0; c0 < cols; c0 += bc) {
            int64_t r1 = r0 + br < rows ? r0 + br : rows, c1 = c0 + bc < cols ? c0 + bc : cols;
            float amax = 0;
            int bad = 0;
            for (int64_t r = r0; r < r1; r++)
                for (int64_t c = c0; c < c1; c++) {
                    float a = fabsf(x[r * ld + c]);
                    bad |= !isfinite(a);
                    amax = a > amax ? a : amax;
                }
            double s = brute_scale(amax);
            for (int64_t r = r0; r < r1; r++)
                for (int64_t c = c0; c < c1; c++) {
                    float v = x[r * ld + c];
                    y[r * cols + c] =
                        bad ? v : (float)copysign(df_e4m3_to_f32(brute_code(fabs(v) / s)) * s, v);
                }
        }
}

/* test data: N(0,1) scaled per row and column over many octaves, with some
 * exact zeros, negative zeros, tiny and huge values */
static void fill(float *x, int64_t n, int64_t cols, uint64_t seed)
{
    uint64_t st = seed;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = i / cols, c = i % cols;
        float v = test_randn(&st) * ldexpf(1.0f, (int)((r * 7 + c / 5) % 40) - 20);
        uint64_t k = test_rand(&st) % 200;
        x[i] = k == 0 ? 0.0f : k == 1 ? -0.0f : k == 2 ? v * 0x1p-60f : k == 3 ? v * 0x1p50f : v;
    }
}

static int same_bits(const float *a, const float *b, int64_t n, const char *what)
{
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4)) {
            fprintf(stderr, "%s: element %lld: %a vs %a\n", what, (long long)i, a[i], b[i]);
            return 0;
        }
    return 1;
}

static const int64_t shapes[][4] = {
    /* rows, cols, br, bc */
    {37, 300, 1, 128}, {300, 37, 128, 1}, {260, 300, 128, 128}, {5, 7, 3, 2},
    {1, 1000, 1, 1000}, {129, 129, 128, 128}, {64, 256, 1, 32},
};

static void test_qdq_ref(void)
{
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t R = shapes[s][0], C = shapes[s][1], br = shapes[s][2], bc = shapes[s][3];
        int64_t ld = C + 3;
        float *x = malloc((size_t)(R * ld) * 4), *y = malloc((size_t)(R * C) * 4),
              *z = malloc((size_t)(R * ld) * 4);
        fill(x, R * ld, ld, 100 + s);
        if (s == 3)
            x[2 * ld + 1] = NAN; /* its block is left alone */
        if (s == 5)
            x[130 * 0 + 128] = INFINITY;
        memcpy(z, x, (size_t)(R * ld) * 4);
        brute_qdq(x, R, C, ld, br, bc, y);
        CHECK_EQ(df_fp8_qdq_f32(z, R, C, ld, br, bc), 0);
        int ok = 1;
        for (int64_t r = 0; r < R && ok; r++) {
            char what[64];
            snprintf(what, sizeof what, "qdq %lldx%lld block %lldx%lld row %lld", (long long)R,
                     (long long)C, (long long)br, (long long)bc, (long long)r);
            ok = same_bits(z + r * ld, y + r * C, C, what);
            /* the padding columns untouched */
            ok &= !memcmp(z + r * ld + C, x + r * ld + C, 3 * 4);
        }
        CHECK(ok);
        /* idempotent */
        float *w = malloc((size_t)(R * ld) * 4);
        memcpy(w, z, (size_t)(R * ld) * 4);
        CHECK_EQ(df_fp8_qdq_f32(w, R, C, ld, br, bc), 0);
        CHECK(same_bits(w, z, R * ld, "qdq twice"));
        free(w);
        free(x);
        free(y);
        free(z);
    }
    /* the error bound of a finite block: |x - q| <= 2^-4 |x| (normal codes)
     * or <= 2^-10 scale (subnormal codes) */
    enum { N = 4096 };
    float x[N], q[N];
    fill(x, N, 128, 9);
    memcpy(q, x, sizeof q);
    CHECK_EQ(df_fp8_qdq_f32(q, 32, 128, 128, 1, 128), 0);
    int bad = 0;
    for (int r = 0; r < 32; r++) {
        float amax = 0;
        for (int c = 0; c < 128; c++)
            amax = fmaxf(amax, fabsf(x[r * 128 + c]));
        double s = brute_scale(amax);
        for (int c = 0; c < 128; c++) {
            double a = fabs((double)x[r * 128 + c]), d = fabs(a - fabs((double)q[r * 128 + c]));
            bad += !(d <= ldexp(a, -4) || d <= ldexp(s, -10));
            bad += signbit(x[r * 128 + c]) != signbit(q[r * 128 + c]);
        }
    }
    CHECK_EQ(bad, 0);
}

/* the op on the CPU backend: F32 and BF16, in place and out of place, views
 * with padding, 1 and 3 threads: the reference's bits */
static void test_op(void)
{
    df_err e = {0};
    df_backend *b1 = df_backend_cpu_open(1, &e), *b3 = df_backend_cpu_open(3, &e);
    CHECK(b1 && b3);
    if (!b1 || !b3)
        return;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t R = shapes[s][0], C = shapes[s][1], br = shapes[s][2], bc = shapes[s][3];
        int64_t ld = C + 5;
        float *x = malloc((size_t)(R * ld) * 4), *ref = malloc((size_t)(R * ld) * 4);
        float *y = malloc((size_t)(R * ld) * 4);
        uint16_t *xb = malloc((size_t)(R * ld) * 2), *yb = malloc((size_t)(R * ld) * 2);
        fill(x, R * ld, ld, 300 + s);
        for (int64_t i = 0; i < R * ld; i++) {
            xb[i] = df_f32_to_bf16(x[i]);
            x[i] = df_bf16_to_f32(xb[i]); /* the same values in both dtypes */
        }
        memcpy(ref, x, (size_t)(R * ld) * 4);
        CHECK_EQ(df_fp8_qdq_f32(ref, R, C, ld, br, bc), 0);
        for (int t = 0; t < 2; t++) {
            df_backend *be = t ? b3 : b1;
            /* F32, out of place: the padding of y stays poisoned */
            for (int64_t i = 0; i < R * ld; i++)
                y[i] = NAN;
            df_tensor tx = df_tensor_2d(x, DF_DTYPE_F32, R, C), ty = df_tensor_2d(y, DF_DTYPE_F32, R, C);
            tx.stride[0] = ty.stride[0] = ld;
            CHECK_EQ(df_op_fp8_qdq(be, &tx, &ty, br, bc), 0);
            int ok = 1;
            for (int64_t r = 0; r < R; r++) {
                ok &= same_bits(y + r * ld, ref + r * ld, C, "fp8_qdq f32");
                for (int64_t c = C; c < ld; c++)
                    ok &= isnan(y[r * ld + c]);
            }
            CHECK(ok);
            /* BF16, in place */
            memcpy(yb, xb, (size_t)(R * ld) * 2);
            df_tensor tb = df_tensor_2d(yb, DF_DTYPE_BF16, R, C);
            tb.stride[0] = ld;
            CHECK_EQ(df_op_fp8_qdq(be, &tb, &tb, br, bc), 0);
            int bad = 0;
            for (int64_t r = 0; r < R; r++)
                for (int64_t c = 0; c < ld; c++) {
                    float want = c < C ? ref[r * ld + c] : x[r * ld + c];
                    uint16_t wb = df_f32_to_bf16(want);
                    bad += yb[r * ld + c] != wb;
                    /* exact: every result is a BF16 value */
                    bad += c < C && isfinite(want) && df_bf16_to_f32(wb) != want;
                }
            CHECK_EQ(bad, 0);
        }
        free(x);
        free(ref);
        free(y);
        free(xb);
        free(yb);
    }
    /* bad arguments: -EINVAL, nothing written */
    float a[64], b[64];
    for (int i = 0; i < 64; i++)
        a[i] = (float)i, b[i] = -1.0f;
    df_tensor ta = df_tensor_2d(a, DF_DTYPE_F32, 8, 8), tb = df_tensor_2d(b, DF_DTYPE_F32, 8, 8);
    df_tensor t47 = df_tensor_2d(b, DF_DTYPE_F32, 4, 7), tbf = df_tensor_2d(b, DF_DTYPE_BF16, 8, 8);
    df_tensor tov = df_tensor_2d(a + 1, DF_DTYPE_F32, 8, 7);
    CHECK_EQ(df_op_fp8_qdq(b1, &ta, &tb, 0, 128), -EINVAL);
    CHECK_EQ(df_op_fp8_qdq(b1, &ta, &tb, 1, 0), -EINVAL);
    CHECK_EQ(df_op_fp8_qdq(b1, &ta, &t47, 1, 128), -EINVAL);
    CHECK_EQ(df_op_fp8_qdq(b1, &ta, &tbf, 1, 128), -EINVAL);
    tov.stride[0] = 8;
    CHECK_EQ(df_op_fp8_qdq(b1, &ta, &tov, 1, 128), -EINVAL); /* overlaps, not the same view */
    CHECK_EQ(df_op_fp8_qdq(NULL, &ta, &tb, 1, 128), -EINVAL);
    int same = 1;
    for (int i = 0; i < 64; i++)
        same &= b[i] == -1.0f && a[i] == (float)i;
    CHECK(same);
    df_backend_close(b1);
    df_backend_close(b3);
}

/* df_op_matmul_fp8 against brute force: operands rounded by brute_qdq in
 * the recipe's blocks, products summed in double; the op sums in fp32
 * (|err| <= 1e-5 sum |a b| is far above fp32's order effects at K <= 300
 * and far below one E4M3 step), accumulating into C as the BF16 ops do;
 * strided views; every kind. */
static void test_matmul(void)
{
    df_err e = {0};
    df_backend *be = df_backend_cpu_open(2, &e);
    CHECK(be != NULL);
    if (!be)
        return;
    enum { M = 37, N = 150, K = 300, PAD = 3 };
    for (int t = 0; t < 4; t++) /* the three kinds, then BWD_W with DF_FP8_DY_BLOCKS */
        for (int acc = 0; acc < 2; acc++) {
            const int kind = t < 3 ? t : DF_GEMM_BWD_W, dyb = t == 3;
            /* shapes: FWD a [M,K] b [N,K] c [M,N]; BWD_X a [M,N] b [N,K] c [M,K];
             * BWD_W a [M,N] b [M,K] c [N,K] */
            int64_t ar = M, ac = kind == DF_GEMM_FWD ? K : N;
            int64_t br = kind == DF_GEMM_BWD_W ? M : N, bc = K;
            int64_t cr = kind == DF_GEMM_BWD_W ? N : M, cc = kind == DF_GEMM_BWD_X ? K : kind == DF_GEMM_FWD ? N : K;
            int64_t la = ac + PAD, lb = bc + PAD, lc = cc + PAD;
            float *a = malloc((size_t)(ar * la) * 4), *b = malloc((size_t)(br * lb) * 4);
            float *c = malloc((size_t)(cr * lc) * 4), *c0 = malloc((size_t)(cr * lc) * 4);
            float *qa = malloc((size_t)(ar * ac) * 4), *qb = malloc((size_t)(br * bc) * 4);
            /* values over 16 octaves (fill's 2^+-50 outliers would overflow fp32 sums) */
            uint64_t st = 3;
            for (int64_t i = 0; i < ar * la; i++)
                a[i] = test_randn(&st) * ldexpf(1.0f, (int)((i % la) / 9 % 16) - 8);
            for (int64_t i = 0; i < br * lb; i++)
                b[i] = test_rand(&st) % 50 == 0 ? 0.0f : test_randn(&st) * ldexpf(1.0f, (int)(i / lb % 16) - 8);
            for (int64_t i = 0; i < cr * lc; i++)
                c[i] = c0[i] = test_randn(&st);
            int bw = kind == DF_GEMM_BWD_W;
            brute_qdq(a, ar, ac, la, bw ? 128 : 1, !bw ? 128 : dyb ? 128 : 1, qa);
            brute_qdq(b, br, bc, lb, 128, bw ? 1 : 128, qb);
            df_tensor ta = df_tensor_2d(a, DF_DTYPE_F32, ar, ac), tb = df_tensor_2d(b, DF_DTYPE_F32, br, bc);
            df_tensor tc = df_tensor_2d(c, DF_DTYPE_F32, cr, cc);
            ta.stride[0] = la, tb.stride[0] = lb, tc.stride[0] = lc;
            /* the hints change nothing (here: the same x is never held; the CPU ignores them) */
            unsigned hint = (kind + acc) % 3 == 0 ? 0 : (kind + acc) % 3 == 1 ? DF_FP8_HOLD_X : DF_FP8_SAME_X;
            hint |= acc ? DF_FP8_MADE : 0;
            CHECK_EQ(df_op_matmul_fp8(be, (df_gemm_kind)kind, &ta, &tb, &tc,
                                      (acc ? DF_FP8_ACCUMULATE : 0) | hint | (dyb ? DF_FP8_DY_BLOCKS : 0)), 0);
            int64_t bad = 0;
            for (int64_t i = 0; i < cr; i++)
                for (int64_t j = 0; j < lc; j++) {
                    if (j >= cc) { /* padding untouched */
                        bad += c[i * lc + j] != c0[i * lc + j];
                        continue;
                    }
                    double sum = 0, mag = 0;
                    int64_t n = kind == DF_GEMM_FWD ? K : kind == DF_GEMM_BWD_X ? N : M;
                    for (int64_t k = 0; k < n; k++) {
                        double x = kind == DF_GEMM_BWD_W ? qa[k * ac + i] : qa[i * ac + k];
                        double y = kind == DF_GEMM_FWD ? qb[j * bc + k] : qb[k * bc + j];
                        sum += x * y;
                        mag += fabs(x * y);
                    }
                    if (acc)
                        sum += c0[i * lc + j], mag += fabs(c0[i * lc + j]);
                    bad += !(fabs(c[i * lc + j] - sum) <= 1e-5 * mag + 1e-30);
                }
            if (bad)
                fprintf(stderr, "matmul_fp8 kind %d acc %d dy blocks %d: %lld bad\n", kind, acc, dyb,
                        (long long)bad);
            CHECK_EQ(bad, 0);
            free(a), free(b), free(c), free(c0), free(qa), free(qb);
        }
    /* bad arguments */
    float x[64], w[64], y[64];
    for (int i = 0; i < 64; i++)
        x[i] = w[i] = 1.0f, y[i] = -2.0f;
    df_tensor tx = df_tensor_2d(x, DF_DTYPE_F32, 8, 8), tw = df_tensor_2d(w, DF_DTYPE_F32, 8, 8);
    df_tensor ty = df_tensor_2d(y, DF_DTYPE_F32, 8, 8), t47 = df_tensor_2d(y, DF_DTYPE_F32, 4, 7);
    CHECK_EQ(df_op_matmul_fp8(be, (df_gemm_kind)3, &tx, &tw, &ty, 0), -EINVAL);
    CHECK_EQ(df_op_matmul_fp8(be, DF_GEMM_FWD, &tx, &tw, &t47, 0), -EINVAL);
    CHECK_EQ(df_op_matmul_fp8(be, DF_GEMM_BWD_W, &tx, &tw, &tx, 0), -EINVAL); /* c is a */
    CHECK_EQ(df_op_matmul_fp8(be, DF_GEMM_FWD, &tx, &tw, &ty, 32), -EINVAL);  /* an unknown flag */
    CHECK_EQ(df_op_matmul_fp8(be, DF_GEMM_FWD, &tx, &tw, &ty, DF_FP8_DY_BLOCKS), -EINVAL); /* BWD_W's only */
    CHECK_EQ(df_op_matmul_fp8(be, DF_GEMM_BWD_X, &tx, &tw, &ty, DF_FP8_DY_BLOCKS), -EINVAL);
    int same = 1;
    for (int i = 0; i < 64; i++)
        same &= y[i] == -2.0f && x[i] == 1.0f;
    CHECK(same);
    df_backend_close(be);
}

/* The LM head with DF_CE_FP8_GRAD: the forward's outputs are those of
 * flags 0; dh is G rounded per 1 x 128 block times head, G from the
 * documented formulas (double here), within the rounding's bound, and it
 * differs from the unrounded dh by about that much. */
/* Row h_i's logits against head [V, H] in double into z, their max; *s: the sum of
 * exp(z - max) */
static double exact_logits(const float *hi, const float *head, int V, int H, double *z, double *s)
{
    double mx = -INFINITY;
    for (int v = 0; v < V; v++) {
        z[v] = 0;
        for (int k = 0; k < H; k++)
            z[v] += (double)hi[k] * head[v * H + k];
        mx = z[v] > mx ? z[v] : mx;
    }
    *s = 0;
    for (int v = 0; v < V; v++)
        *s += exp(z[v] - mx);
    return mx;
}

static void test_lmhead_fp8(void)
{
    enum { N = 6, H = 40, V = 700 };
    df_err e = {0};
    df_backend *be = df_backend_cpu_open(2, &e);
    CHECK(be != NULL);
    if (!be)
        return;
    static float h[N * H], head[V * H], dh0[N * H], dh8[N * H], ce0[N], ce8[N];
    int32_t label[N] = {3, 699, -1, 128, 127, 0}, am0[N], am8[N];
    float w[N] = {1, 0.5f, 1, 2, 1, 0.25f};
    uint64_t st = 5;
    for (int i = 0; i < N * H; i++)
        h[i] = test_randn(&st);
    for (int i = 0; i < V * H; i++)
        head[i] = 0.3f * test_randn(&st);
    df_tensor th = df_tensor_2d(h, DF_DTYPE_F32, N, H), tw = df_tensor_2d(head, DF_DTYPE_F32, V, H);
    df_tensor t0 = df_tensor_2d(dh0, DF_DTYPE_F32, N, H), t8 = df_tensor_2d(dh8, DF_DTYPE_F32, N, H);
    double l0 = 0, l8 = 0;
    CHECK_EQ(df_op_lmhead_ce(be, &th, &tw, label, w, 7.0f, &l0, &t0, am0, ce0, 0), 0);
    CHECK_EQ(df_op_lmhead_ce(be, &th, &tw, label, w, 7.0f, &l8, &t8, am8, ce8, DF_CE_FP8_GRAD), 0);
    CHECK(l0 == l8 && !memcmp(am0, am8, sizeof am0) && !memcmp(ce0, ce8, sizeof ce0));
    /* DF_CE_FP8_HEAD_FROZEN only with DF_CE_FP8_GRAD; unknown bits refused */
    CHECK_EQ(df_op_lmhead_ce(be, &th, &tw, label, w, 7.0f, &l8, &t8, am8, ce8,
                             DF_CE_FP8_HEAD_FROZEN), -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(be, &th, &tw, label, w, 7.0f, &l8, &t8, am8, ce8,
                             DF_CE_FP8_ROUND_HEAD), -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(be, &th, &tw, label, w, 7.0f, &l8, &t8, am8, ce8, 64), -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(be, &th, &tw, label, w, 7.0f, &l8, &t8, am8, ce8,
                             DF_CE_FP8_ONEPASS), -EINVAL);
    {   /* DF_CE_FP8_ROUND_HEAD on the head as it is: the results of its rounded copy */
        static float hr[V * H], dha[N * H], dhb[N * H], cea[N], ceb[N];
        int32_t ama[N], amb[N];
        memcpy(hr, head, sizeof hr);
        CHECK_EQ(df_fp8_qdq_f32(hr, V, H, H, 128, 128), 0);
        CHECK(memcmp(hr, head, sizeof hr) != 0);
        df_tensor tr = df_tensor_2d(hr, DF_DTYPE_F32, V, H);
        df_tensor ta = df_tensor_2d(dha, DF_DTYPE_F32, N, H), tb = df_tensor_2d(dhb, DF_DTYPE_F32, N, H);
        double la = 0, lb = 0;
        CHECK_EQ(df_op_lmhead_ce(be, &th, &tr, label, w, 7.0f, &la, &ta, ama, cea, DF_CE_FP8_GRAD), 0);
        CHECK_EQ(df_op_lmhead_ce(be, &th, &tw, label, w, 7.0f, &lb, &tb, amb, ceb,
                                 DF_CE_FP8_GRAD | DF_CE_FP8_ROUND_HEAD | DF_CE_FP8_HEAD_FROZEN), 0);
        CHECK(la == lb && !memcmp(dha, dhb, sizeof dha) && !memcmp(ama, amb, sizeof ama) &&
              !memcmp(cea, ceb, sizeof cea));
    }
    {   /* with it: the same results (the CPU makes no codes to keep) */
        static float dhf[N * H];
        df_tensor tf = df_tensor_2d(dhf, DF_DTYPE_F32, N, H);
        double lf = 0, l8b = 0;
        CHECK_EQ(df_op_lmhead_ce(be, &th, &tw, label, w, 7.0f, &l8b, &t8, NULL, NULL,
                                 DF_CE_FP8_GRAD), 0);
        CHECK_EQ(df_op_lmhead_ce(be, &th, &tw, label, w, 7.0f, &lf, &tf, NULL, NULL,
                                 DF_CE_FP8_GRAD | DF_CE_FP8_HEAD_FROZEN), 0);
        CHECK(lf == l8b && !memcmp(dhf, dh8, sizeof dhf));
    }
    int bad = 0;
    double moved = 0, scale = 0;
    for (int i = 0; i < N; i++) {
        double z[V], g[V], s, mx = exact_logits(h + i * H, head, V, H, z, &s);
        for (int v = 0; v < V; v++)
            g[v] = label[i] < 0 ? 0 : (exp(z[v] - mx) / s - (v == label[i])) * w[i] / 7.0;
        /* bound per dh element: each G entry moves by <= 2^-4 |G| or the
         * block's 2^-10 scale, plus fp32 sums */
        double gmax[(V + 127) / 128] = {0};
        for (int v = 0; v < V; v++)
            gmax[v / 128] = fmax(gmax[v / 128], fabs(g[v]));
        for (int k = 0; k < H; k++) {
            double exact = 0, bound = 0;
            for (int v = 0; v < V; v++) {
                double a = fabs(head[v * H + k]);
                exact += g[v] * head[v * H + k];
                bound += a * (ldexp(fabs(g[v]), -4) + ldexp(brute_scale((float)gmax[v / 128]), -10));
            }
            bound = bound * 1.01 + 1e-6 * fabs(exact) + 1e-9;
            bad += !(fabs(dh8[i * H + k] - exact) <= bound);
            moved += fabs(dh8[i * H + k] - dh0[i * H + k]);
            scale += fabs(exact);
        }
    }
    CHECK_EQ(bad, 0);
    /* the rounding happened: E4M3's 2^-4 relative per entry shows in dh */
    printf("lmhead fp8 grad: mean |dh8 - dh0| / mean |dh| = %.3g\n", moved / scale);
    CHECK(moved / scale > 1e-3 && moved / scale < 0.1);
    df_backend_close(be);
}

/* DF_CE_FP8_ONEPASS: loss, ce and argmax are FP8's; dh within the rounding
 * of Gp (2^-4 of each entry, or its block's subnormal step) of the exact
 * dh; the one-hot term on the head the GEMMs take (DF_CE_FP8_ROUND_HEAD:
 * the bits of the pre-rounded head); closer to the exact dh than the
 * default FP8 gradient, whose label entry is rounded too. */
static void test_lmhead_fp8_onepass(void)
{
    enum { N = 7, H = 40, V = 700 };
    df_err e = {0};
    df_backend *be = df_backend_cpu_open(2, &e);
    CHECK(be != NULL);
    if (!be)
        return;
    static float h[N * H], head[V * H], hr[V * H], dh8[N * H], dh1[N * H], dha[N * H], dhb[N * H];
    float ce8[N], ce1[N];
    int32_t label[N] = {3, 699, -1, 128, 127, 0, 650}, am8[N], am1[N];
    float w[N] = {1, 0.5f, 1, 2, 1, 0.25f, 1};
    uint64_t st = 9;
    for (int i = 0; i < N * H; i++)
        h[i] = test_randn(&st);
    for (int i = 0; i < V * H; i++)
        head[i] = 0.3f * test_randn(&st);
    /* a row whose logits spread widely: blocks far below the max */
    for (int k = 0; k < H; k++)
        h[6 * H + k] *= 4.0f;
    df_tensor th = df_tensor_2d(h, DF_DTYPE_F32, N, H), tw = df_tensor_2d(head, DF_DTYPE_F32, V, H);
    df_tensor t8 = df_tensor_2d(dh8, DF_DTYPE_F32, N, H), t1 = df_tensor_2d(dh1, DF_DTYPE_F32, N, H);
    const unsigned op = DF_CE_FP8_GRAD | DF_CE_FP8_ONEPASS;
    double l8 = 0, l1 = 0;
    CHECK_EQ(df_op_lmhead_ce(be, &th, &tw, label, w, 7.0f, &l8, &t8, am8, ce8, DF_CE_FP8_GRAD), 0);
    CHECK_EQ(df_op_lmhead_ce(be, &th, &tw, label, w, 7.0f, &l1, &t1, am1, ce1, op), 0);
    CHECK(l8 == l1 && !memcmp(am8, am1, sizeof am8) && !memcmp(ce8, ce1, sizeof ce8));
    {   /* DF_CE_FP8_ROUND_HEAD: the one-hot term too takes the rounded head */
        memcpy(hr, head, sizeof hr);
        CHECK_EQ(df_fp8_qdq_f32(hr, V, H, H, 128, 128), 0);
        df_tensor tr = df_tensor_2d(hr, DF_DTYPE_F32, V, H);
        df_tensor ta = df_tensor_2d(dha, DF_DTYPE_F32, N, H), tb = df_tensor_2d(dhb, DF_DTYPE_F32, N, H);
        double la = 0, lb = 0;
        CHECK_EQ(df_op_lmhead_ce(be, &th, &tr, label, w, 7.0f, &la, &ta, NULL, NULL, op), 0);
        CHECK_EQ(df_op_lmhead_ce(be, &th, &tw, label, w, 7.0f, &lb, &tb, NULL, NULL,
                                 op | DF_CE_FP8_ROUND_HEAD | DF_CE_FP8_HEAD_FROZEN), 0);
        CHECK(la == lb && !memcmp(dha, dhb, sizeof dha));
    }
    int bad = 0;
    double err1 = 0, err8 = 0, scale = 0;
    for (int i = 0; i < N; i++) {
        double z[V], g[V], s, mx = exact_logits(h + i * H, head, V, H, z, &s);
        double c = label[i] < 0 ? 0 : w[i] / 7.0;
        for (int v = 0; v < V; v++)
            g[v] = c * exp(z[v] - mx) / s; /* Gp: the one-hot term is exact */
        for (int k = 0; k < H; k++) {
            double exact = label[i] < 0 ? 0 : -c * head[label[i] * H + k], bound = 0;
            for (int v = 0; v < V; v++) {
                double mb = -INFINITY;
                for (int u = v / 128 * 128; u < V && u < v / 128 * 128 + 128; u++)
                    mb = z[u] > mb ? z[u] : mb;
                double step = c / s * exp(mb - mx) * 0x1p-8 * 0x1p-10; /* half the subnormal step */
                exact += g[v] * head[v * H + k];
                bound += fabs(head[v * H + k]) * (ldexp(g[v], -4) + step);
            }
            bound = bound * 1.01 + 1e-6 * fabs(exact) + 1e-9;
            bad += !(fabs(dh1[i * H + k] - exact) <= bound);
            err1 += fabs(dh1[i * H + k] - exact);
            err8 += fabs(dh8[i * H + k] - exact);
            scale += fabs(exact);
        }
    }
    CHECK_EQ(bad, 0);
    printf("lmhead fp8 one pass: mean |dh - exact| / mean |dh| = %.3g (two passes: %.3g)\n",
           err1 / scale, err8 / scale);
    CHECK(err1 > 0 && err1 < 0.5 * err8);
    df_backend_close(be);
}

/* The MXFP8 scale layout (cuda/fp8_mx.h) as its contract states it: tiles of
 * 128 rows x 4 blocks, 512 bytes each, in row order, K tiles first; row r % 32
 * at 16 bytes, (r % 128) / 32 at 4, the block at 1 (so a 128-block's four
 * 32-blocks are one aligned word); and a bijection onto the padded tensor. */
static void test_mx_layout(void)
{
    static const int64_t mx_shapes[][2] = {{128, 4}, {256, 8}, {384, 160}, {128, 544}};
    for (size_t s = 0; s < sizeof mx_shapes / sizeof mx_shapes[0]; s++) {
        int64_t rp = mx_shapes[s][0], nj = mx_shapes[s][1], n = rp * nj;
        unsigned char *seen = calloc((size_t)n, 1);
        CHECK(seen != NULL);
        int64_t bad = 0;
        for (int64_t r = 0; r < rp; r++)
            for (int64_t j = 0; j < nj; j++) {
                int64_t o = df_fp8_mx_offset(r, j, nj);
                if (o < 0 || o >= n || seen[o]++)
                    bad++;
                int64_t want = ((r / 128) * (nj / 4) + j / 4) * 512;
                if (o - want != (r % 32) * 16 + ((r % 128) / 32) * 4 + j % 4)
                    bad++;
                if (j % 4 == 0 && o % 4)
                    bad++;
            }
        CHECK_EQ(bad, 0);
        free(seen);
    }
    CHECK_EQ(df_fp8_mx_offset(31, 0, 8), 31 * 16);
    CHECK_EQ(df_fp8_mx_offset(32, 0, 8), 4);
    CHECK_EQ(df_fp8_mx_offset(0, 4, 8), 512);
    CHECK_EQ(df_fp8_mx_offset(128, 0, 8), 1024);
    CHECK_EQ(df_fp8_mx_offset(127, 3, 8), 31 * 16 + 12 + 3);
}

int main(void)
{
    test_mx_layout();
    test_code();
    test_scale();
    test_qdq_ref();
    test_op();
    test_matmul();
    test_lmhead_fp8();
    test_lmhead_fp8_onepass();
    return test_main_end();
}
