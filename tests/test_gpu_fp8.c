/* test_gpu_fp8 - the CUDA backend's FP8 (E4M3) rounding against the CPU
 * reference, through the public df_op_* API. Skips (77) without a GPU.
 *  - df_op_fp8_qdq: bitwise the CPU's result (the rule is exact: amax,
 *    power-of-two scales, round to nearest even), for the three kernels
 *    (1 x bc, br x 1, br x bc blocks), BF16 and F32, in place and out of
 *    place, row-strided views whose padding must stay poisoned, blocks with
 *    a NaN or an Inf (copied as they are), and the drafter's shapes at the
 *    Qwen3.6-27B drafter size (8192 x 5120 activations, 5120 x 17408 weights,
 *    4096 x 5120 operands reduced over rows).
 *  - df_op_matmul_fp8, every kind (and bwd_w with DF_FP8_DY_BLOCKS), against
 *    the CPU's within the BF16 GEMMs' bound (the rounded operands are the same bits): the BF16 path
 *    (DFLASH_FP8_GEMM=0), then the E4M3 tensor cores (gemm_fp8.cu), which on
 *    sm_90 must take the aligned shapes (each checked against the BF16 path
 *    at its first call); and the DF_FP8_HOLD_X / _SAME_X hints, bitwise. A
 *    class's first call on an operand with an Inf decides nothing (the BF16
 *    path runs it, the next call is checked).
 *  - the MXFP8 scales of compute capability 10+ (df_cuda_fp8_mx_scales) bitwise
 *    against the layout function (fp8_mx.h), on any GPU.
 * `--bench`: the GEMMs of the Qwen3.6-27B drafter step, each kind: the BF16
 *  GEMM, the FP8 op, the BF16 path's rounding of the activations (df_op_fp8_qdq),
 *  and the tensor cores' whole call with the weight's codes made or kept; medians of 9
 *  host-timed calls (a sync each).
 * SwiGLU writing its GEMM operands' codes (DF_FP8_MADE): test_gpu_fp8_made; the
 * LM head + CE under FP8: test_gpu_fp8_lmhead. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/device.h"
#include "e4m3.h"
#include "cuda/fp8_cuda.h"
#include "gpu_harness.h"
#include "knobs.h"
#include "ops.h"
#include "train_ops.h"

static uint64_t rng = 77;

/* values over many octaves, some zeros and signed zeros */
static float draw(int64_t i, int64_t cols)
{
    float v = test_randn(&rng) * ldexpf(1.0f, (int)(((i / cols) * 3 + (i % cols) / 7) % 24) - 12);
    uint64_t k = test_rand(&rng) % 100;
    return k == 0 ? 0.0f : k == 1 ? -0.0f : v;
}

static void check_qdq(int64_t R, int64_t C, int64_t br, int64_t bc, int f32, int inplace,
                      int nonfinite)
{
    df_backend *g = gh_gpu, *c = gh_cpu;
    int64_t ld = C + 8, n = R * ld;
    size_t es = f32 ? 4 : 2;
    float *x = gh_xmalloc((size_t)n * 4), *ref = gh_xmalloc((size_t)n * 4);
    uint16_t *xb = gh_xmalloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++) {
        x[i] = draw(i, ld);
        if (!f32) {
            xb[i] = gh_f2bf(x[i]);
            x[i] = gh_bf2f(xb[i]);
        }
    }
    if (nonfinite) {
        x[(R / 2) * ld + C / 3] = NAN;
        x[(R - 1) * ld + C - 1] = -INFINITY;
        if (!f32)
            xb[(R / 2) * ld + C / 3] = 0x7fc0, xb[(R - 1) * ld + C - 1] = 0xff80;
    }
    memcpy(ref, x, (size_t)n * 4);
    df_tensor tr = df_tensor_2d(ref, DF_DTYPE_F32, R, C);
    tr.stride[0] = ld;
    CHECK_EQ(df_op_fp8_qdq(c, &tr, &tr, br, bc), 0);

    void *dx = gh_dev_copy(g, f32 ? (void *)x : (void *)xb, (size_t)n * es);
    void *dy = inplace ? dx : gh_dev_poisoned(g, n, f32 ? DF_DTYPE_F32 : DF_DTYPE_BF16);
    df_dtype dt = f32 ? DF_DTYPE_F32 : DF_DTYPE_BF16;
    df_tensor tx = df_tensor_2d(dx, dt, R, C), ty = df_tensor_2d(dy, dt, R, C);
    tx.stride[0] = ty.stride[0] = ld;
    CHECK_EQ(df_op_fp8_qdq(g, &tx, &ty, br, bc), 0);
    void *got = gh_xmalloc((size_t)n * es);
    CHECK_EQ(df_backend_download(g, got, dy, (size_t)n * es), 0);
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        int pad = i % ld >= C;
        int ok;
        if (f32) {
            float v = ((float *)got)[i];
            ok = pad ? (inplace ? !memcmp(&v, &x[i], 4) : isnan(v)) : !memcmp(&v, &ref[i], 4) ||
                                                                        (isnan(v) && isnan(ref[i]));
        } else {
            uint16_t v = ((uint16_t *)got)[i];
            ok = pad ? (inplace ? v == xb[i] : v == 0x7fc0)
                     : v == gh_f2bf(ref[i]) || (isnan(ref[i]) && v == xb[i]);
        }
        if (!ok && first < 0)
            first = i;
        bad += !ok;
    }
    printf("fp8_qdq %lldx%lld block %lldx%lld %s %s%s: %lld elements differ\n", (long long)R,
           (long long)C, (long long)br, (long long)bc, f32 ? "f32" : "bf16",
           inplace ? "in place" : "out of place", nonfinite ? " non-finite" : "", (long long)bad);
    if (bad)
        fprintf(stderr, "  first at %lld: ref %a\n", (long long)first, ref[first]);
    CHECK_EQ(bad, 0);
    free(x), free(ref), free(xb), free(got);
    df_backend_free(g, dx);
    if (!inplace)
        df_backend_free(g, dy);
}

/* The E4M3 codes and scales the tensor cores get (df_cuda_fp8_round_codes,
 * fp8_codes.cu's rounding kernels), bitwise against the CPU rule: per block
 * the scale df_fp8_pow2_scale(amax) and each value's df_e4m3_from_f32(v /
 * scale) (NaN and Inf: the NaN code); padding codes 0. x [R, C] bf16 with a
 * row stride of C + 8 (16-byte loads only where that is a multiple of 8). */
static void check_codes(int mode, int64_t R, int64_t C, int nonfinite)
{
    df_backend *g = gh_gpu;
    int64_t ld = C + 8, n = R * ld;
    uint16_t *xb = gh_xmalloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++)
        xb[i] = gh_f2bf(draw(i, ld));
    if (nonfinite) {
        xb[(R / 2) * ld + C / 3] = 0x7fc0;  /* NaN */
        xb[(R - 1) * ld + C - 1] = 0xff80;  /* -Inf */
        xb[(R - 1) * ld + C / 2] = 0x7f80;  /* +Inf */
    }
    int tr = mode == 1 || mode == 3;
    int64_t rows = tr ? C : R, red = tr ? R : C, kp = (red + 127) / 128 * 128, kb = kp / 128;
    int64_t n_out = mode == 0 ? (R + 3) / 4 * 4 : rows, l4 = (kb + 3) / 4 * 4;
    int64_t nsc = mode < 2 ? kb * n_out : ((rows + 127) / 128) * l4;
    void *dx = gh_dev_copy(g, xb, (size_t)n * 2);
    uint8_t *dq = df_backend_alloc(g, (size_t)(n_out * kp));
    float *ds = df_backend_alloc(g, (size_t)nsc * 4);
    CHECK(dq && ds);
    uint8_t *pq = gh_xmalloc((size_t)(n_out * kp));
    float *ps = gh_xmalloc((size_t)nsc * 4);
    memset(pq, 0xa5, (size_t)(n_out * kp)); /* every code must be written */
    memset(ps, 0, (size_t)nsc * 4);
    CHECK_EQ(df_backend_upload(g, dq, pq, (size_t)(n_out * kp)), 0);
    CHECK_EQ(df_backend_upload(g, ds, ps, (size_t)nsc * 4), 0);
    df_tensor tx = df_tensor_2d(dx, DF_DTYPE_BF16, R, C);
    tx.stride[0] = ld;
    CHECK_EQ(df_cuda_fp8_round_codes(g, mode, &tx, dq, kp, ds, n_out), 0);
    CHECK_EQ(df_backend_download(g, pq, dq, (size_t)(n_out * kp)), 0);
    CHECK_EQ(df_backend_download(g, ps, ds, (size_t)nsc * 4), 0);
    /* out element (o, k): x[o][k] (modes 0, 2) or x[k][o] (1, 3) */
#define XV(o, k) gh_bf2f(tr ? xb[(k) * ld + (o)] : xb[(o) * ld + (k)])
    int64_t bad = 0, bads = 0, first = -1;
    for (int64_t o = 0; o < n_out; o++)
        for (int64_t b = 0; b < kb; b++) {
            int64_t blo = mode < 2 ? o : o / 128 * 128, bhi = mode < 2 ? o + 1 : blo + 128;
            float amax = 0.0f;
            for (int64_t oo = blo; oo < bhi && oo < rows; oo++)
                for (int64_t k = b * 128; k < b * 128 + 128 && k < red; k++) {
                    float a = fabsf(XV(oo, k));
                    amax = a > amax || a != a ? a : amax;
                }
            float sc = df_fp8_pow2_scale(amax);
            float got_s = mode < 2 ? ps[b * n_out + o] : ps[(o / 128) * l4 + b];
            if (o < rows && memcmp(&got_s, &sc, 4))
                bads++;
            for (int64_t k = b * 128; k < b * 128 + 128; k++) {
                uint8_t want = 0;
                if (o < rows && k < red) {
                    float v = XV(o, k);
                    want = isfinite(v) ? df_e4m3_from_f32(v / sc) : (uint8_t)(signbit(v) ? 0xff : 0x7f);
                }
                if (pq[o * kp + k] != want) {
                    if (first < 0)
                        first = o * kp + k;
                    bad++;
                }
            }
        }
#undef XV
    printf("fp8 codes mode %d %lldx%lld%s: %lld codes, %lld scales differ\n", mode, (long long)R,
           (long long)C, nonfinite ? " non-finite" : "", (long long)bad, (long long)bads);
    if (bad)
        fprintf(stderr, "  first at out row %lld, k %lld: got 0x%02x\n", (long long)(first / kp),
                (long long)(first % kp), pq[first]);
    CHECK_EQ(bad, 0);
    CHECK_EQ(bads, 0);
    free(xb), free(pq), free(ps);
    df_backend_free(g, dx), df_backend_free(g, dq), df_backend_free(g, ds);
}

/* The MXFP8 scales of compute capability 10+ (df_cuda_fp8_mx_scales), bitwise
 * against the layout function on the host: each 128-block's FP32 power of two
 * (exponents over E8M0's whole range as the rule makes them, -100 .. 127) as
 * the E8M0 byte of its four 32-blocks; rows past the scales' (1 x 128: up to
 * the 128 the layout rounds to) 1.0. Runs on any GPU (the conversion only). */
static void check_mx(int blk, int64_t rows, int64_t n_sc, int64_t kp)
{
    df_backend *g = gh_gpu;
    int64_t kb = kp / 128, l4 = (kb + 3) / 4 * 4, rp = (rows + 127) / 128 * 128, nj = kp / 32;
    int64_t nsc = blk ? rp / 128 * l4 : kb * n_sc, nout = rp * nj;
    float *ps = gh_xmalloc((size_t)nsc * 4);
    for (int64_t i = 0; i < nsc; i++)
        ps[i] = ldexpf(1.0f, (int)(test_rand(&rng) % 228) - 100);
    uint8_t *po = gh_xmalloc((size_t)nout);
    memset(po, 0xa5, (size_t)nout); /* every byte must be written */
    void *ds = gh_dev_copy(g, ps, (size_t)nsc * 4), *dout = gh_dev_copy(g, po, (size_t)nout);
    CHECK_EQ(df_cuda_fp8_mx_scales(g, ds, blk, n_sc, rows, kp, dout), 0);
    CHECK_EQ(df_backend_download(g, po, dout, (size_t)nout), 0);
    int64_t bad = 0;
    for (int64_t r = 0; r < rp; r++)
        for (int64_t j = 0; j < nj; j++) {
            float v = blk ? ps[(r / 128) * l4 + j / 4] : r < n_sc ? ps[(j / 4) * n_sc + r] : 1.0f;
            int e;
            (void)frexpf(v, &e);
            bad += po[df_fp8_mx_offset(r, j, nj)] != (uint8_t)(e - 1 + 127); /* v = 2^(e - 1) */
        }
    printf("fp8 mxfp8 scales blk %d rows %lld (scales %lld) kp %lld: %lld bytes differ\n", blk,
           (long long)rows, (long long)n_sc, (long long)kp, (long long)bad);
    CHECK_EQ(bad, 0);
    CHECK_EQ(df_cuda_fp8_mx_scales(g, ds, blk, n_sc, rows, 100, dout), -EINVAL);
    free(ps), free(po);
    df_backend_free(g, ds), df_backend_free(g, dout);
}

/* df_op_matmul_fp8 on the GPU against the CPU's: the same rounded operands
 * (df_op_fp8_qdq is bit-exact), summed in another order and rounded to
 * BF16: within twice naive BF16's error + 1e-6 max|ref|, as the BF16 GEMMs
 * (test_gpu_train_ops); accumulating, plus half a bf16 ulp of the largest
 * new sum, the second rounding train_ops.h allows there (cuBLAS's epilogue
 * on the H200 rounds the sum before adding the old value at some shapes).
 * BWD_W into a BF16 dw. */
static void check_matmul(df_gemm_kind kind, int64_t M, int64_t N, int64_t K, unsigned flags)
{
    df_backend *g = gh_gpu, *c = gh_cpu;
    const int acc = (flags & DF_FP8_ACCUMULATE) != 0;
    int64_t ar = M, ac = kind == DF_GEMM_FWD ? K : N;
    int64_t br = kind == DF_GEMM_BWD_W ? M : N, bc = K;
    int64_t cr = kind == DF_GEMM_BWD_W ? N : M, cc = kind == DF_GEMM_FWD ? N : K;
    float *a = gh_rand_bf16(GH_N01, &rng, ar * ac, 1.0f), *b = gh_rand_bf16(GH_N01, &rng, br * bc, 0.05f);
    float *c0 = gh_rand_bf16(GH_N01, &rng, cr * cc, 1.0f);
    float *ref = gh_xmalloc((size_t)(cr * cc) * 4);
    memcpy(ref, c0, (size_t)(cr * cc) * 4);
    df_tensor ta = df_tensor_2d(a, DF_DTYPE_F32, ar, ac), tb = df_tensor_2d(b, DF_DTYPE_F32, br, bc);
    df_tensor tr = df_tensor_2d(ref, DF_DTYPE_F32, cr, cc);
    CHECK_EQ(df_op_matmul_fp8(c, kind, &ta, &tb, &tr, flags), 0);
    void *ga = gh_dev_bf16(g, a, ar * ac), *gb = gh_dev_bf16(g, b, br * bc);
    void *gc = acc ? gh_dev_bf16(g, c0, cr * cc) : gh_dev_poisoned(g, cr * cc, DF_DTYPE_BF16);
    df_tensor Ga = df_tensor_2d(ga, DF_DTYPE_BF16, ar, ac), Gb = df_tensor_2d(gb, DF_DTYPE_BF16, br, bc);
    df_tensor Gc = df_tensor_2d(gc, DF_DTYPE_BF16, cr, cc);
    CHECK_EQ(df_op_matmul_fp8(g, kind, &Ga, &Gb, &Gc, flags), 0);
    float *got = gh_download_bf16(g, gc, cr * cc);
    gh_diff d;
    gh_diff_f32(&d, got, ref, cr * cc, NULL);
    double sum_max = 0.0;
    for (int64_t i = 0; acc && i < cr * cc; i++)
        sum_max = fmax(sum_max, fabs((double)ref[i] - c0[i]));
    double tol = gh_naive_bound(&d) + (acc ? 0.5 * test_bf16_ulp(sum_max) : 0.0);
    int ok = gh_diff_ok(&d, tol);
    printf("matmul_fp8 kind %d M=%lld N=%lld K=%lld acc=%d%s: err %.3e naive %.3e %s\n", (int)kind,
           (long long)M, (long long)N, (long long)K, acc, flags & DF_FP8_DY_BLOCKS ? " dy blocks" : "",
           d.err, d.naive, ok ? "ok" : "FAIL");
    if (!ok)
        gh_diff_report("matmul_fp8", &d, tol);
    CHECK(ok);
    free(a), free(b), free(c0), free(ref), free(got);
    df_backend_free(g, ga), df_backend_free(g, gb), df_backend_free(g, gc);
}

/* DF_FP8_HOLD_X / _SAME_X: two projections of one x (FWD: x w1^T, x w2^T;
 * BWD_W: dy1^T x, dy2^T x) with the hints give the bits they give without,
 * and a SAME_X call on another x rounds that x (its own result). On the
 * tensor cores (sm_90) the second call used the kept codes. */
/* A class's first call on operands with an Inf decides nothing: it runs on the BF16 path (the
 * Inf's row non-finite, the others finite), and the class's next call, finite, is checked and
 * taken by the tensor cores. A backend of its own: its classes are all unknown. */
static void check_undecided(void)
{
    df_err e = {0};
    df_backend *g = df_backend_cuda_open(0, &e);
    CHECK(g != NULL);
    if (!g)
        return;
    const int64_t M = 64, N = 256, K = 384;
    float *x = gh_rand_bf16(GH_N01, &rng, M * K, 1.0f), *w = gh_rand_bf16(GH_N01, &rng, N * K, 0.1f);
    x[5 * K + 7] = INFINITY;
    void *dx = gh_dev_bf16(g, x, M * K), *dw = gh_dev_bf16(g, w, N * K);
    void *dy = gh_dev_poisoned(g, M * N, DF_DTYPE_BF16);
    df_tensor tx = df_tensor_2d(dx, DF_DTYPE_BF16, M, K), tw = df_tensor_2d(dw, DF_DTYPE_BF16, N, K);
    df_tensor ty = df_tensor_2d(dy, DF_DTYPE_BF16, M, N);
    int64_t f0, s0, f1, s1, f2, s2;
    df_cuda_fp8_gemm_counts(&f0, &s0);
    CHECK_EQ(df_op_matmul_fp8(g, DF_GEMM_FWD, &tx, &tw, &ty, 0), 0);
    df_cuda_fp8_gemm_counts(&f1, &s1);
    CHECK_EQ(f1 - f0, 0);
    CHECK_EQ(s1 - s0, 1);
    float *y = gh_download_bf16(g, dy, M * N);
    int64_t bad = 0, inf_row = 0;
    for (int64_t i = 0; i < M * N; i++)
        if (i / N == 5)
            inf_row += !isfinite(y[i]);
        else
            bad += !isfinite(y[i]);
    CHECK_EQ(bad, 0);
    CHECK_EQ(inf_row, N);
    free(y);
    x[5 * K + 7] = 1.0f;
    void *dx2 = gh_dev_bf16(g, x, M * K);
    tx.data = dx2;
    CHECK_EQ(df_op_matmul_fp8(g, DF_GEMM_FWD, &tx, &tw, &ty, 0), 0);
    df_cuda_fp8_gemm_counts(&f2, &s2);
    CHECK_EQ(f2 - f1, 1);
    CHECK_EQ(s2 - s1, 0);
    y = gh_download_bf16(g, dy, M * N);
    bad = 0;
    for (int64_t i = 0; i < M * N; i++)
        bad += !isfinite(y[i]) || y[i] == 0.0f;
    CHECK(bad < M * N / 100);
    free(y), free(x), free(w);
    df_backend_free(g, dx), df_backend_free(g, dx2), df_backend_free(g, dw), df_backend_free(g, dy);
    df_backend_close(g);
}

static int64_t check_hold(df_gemm_kind kind, int64_t rows, int64_t k, int64_t n1, int64_t n2)
{
    df_backend *g = gh_gpu;
    int bw = kind == DF_GEMM_BWD_W;
    /* FWD: x [rows, k], w_i [n_i, k], y_i [rows, n_i]; BWD_W: dy_i [rows, n_i], x [rows, k], dw_i [n_i, k] */
    float *x = gh_rand_bf16(GH_N01, &rng, rows * k, 1.0f), *x2 = gh_rand_bf16(GH_N01, &rng, rows * k, 2.0f);
    float *o1 = gh_rand_bf16(GH_N01, &rng, n1 * (bw ? rows : k), 0.05f);
    float *o2 = gh_rand_bf16(GH_N01, &rng, n2 * (bw ? rows : k), 0.05f);
    void *gx = gh_dev_bf16(g, x, rows * k), *gx2 = gh_dev_bf16(g, x2, rows * k);
    void *go1 = gh_dev_bf16(g, o1, n1 * (bw ? rows : k)), *go2 = gh_dev_bf16(g, o2, n2 * (bw ? rows : k));
    df_tensor X = df_tensor_2d(gx, DF_DTYPE_BF16, rows, k), X2 = df_tensor_2d(gx2, DF_DTYPE_BF16, rows, k);
    df_tensor O1 = bw ? df_tensor_2d(go1, DF_DTYPE_BF16, rows, n1) : df_tensor_2d(go1, DF_DTYPE_BF16, n1, k);
    df_tensor O2 = bw ? df_tensor_2d(go2, DF_DTYPE_BF16, rows, n2) : df_tensor_2d(go2, DF_DTYPE_BF16, n2, k);
    int64_t c1r = bw ? n1 : rows, c1c = bw ? k : n1, c2r = bw ? n2 : rows, c2c = bw ? k : n2;
    /* [0]: no hints, [1]: hints; C1 = op(x, o1), C2 = op(x, o2), C3 = op(x2, o2) */
    float *got[2][3];
    int64_t reused0 = df_cuda_fp8_x_reused();
    for (int h = 0; h < 2; h++) {
        void *gc[3] = {gh_dev_poisoned(g, c1r * c1c, DF_DTYPE_BF16), gh_dev_poisoned(g, c2r * c2c, DF_DTYPE_BF16),
                       gh_dev_poisoned(g, c2r * c2c, DF_DTYPE_BF16)};
        df_tensor C1 = df_tensor_2d(gc[0], DF_DTYPE_BF16, c1r, c1c), C2 = df_tensor_2d(gc[1], DF_DTYPE_BF16, c2r, c2c);
        df_tensor C3 = df_tensor_2d(gc[2], DF_DTYPE_BF16, c2r, c2c);
        const df_tensor *xs[3] = {&X, &X, &X2}, *os[3] = {&O1, &O2, &O2};
        df_tensor *cs[3] = {&C1, &C2, &C3};
        const unsigned hint[3] = {DF_FP8_HOLD_X, DF_FP8_SAME_X, DF_FP8_SAME_X};
        for (int i = 0; i < 3; i++)
            CHECK_EQ(df_op_matmul_fp8(g, kind, bw ? os[i] : xs[i], bw ? xs[i] : os[i], cs[i], h ? hint[i] : 0), 0);
        for (int i = 0; i < 3; i++) {
            got[h][i] = gh_download_bf16(g, gc[i], i ? c2r * c2c : c1r * c1c);
            df_backend_free(g, gc[i]);
        }
    }
    int64_t diff = 0;
    for (int i = 0; i < 3; i++)
        for (int64_t j = 0; j < (i ? c2r * c2c : c1r * c1c); j++)
            diff += memcmp(&got[0][i][j], &got[1][i][j], 4) != 0;
    int64_t reused = df_cuda_fp8_x_reused() - reused0;
    printf("matmul_fp8 kind %d hints HOLD_X / SAME_X (rows %lld, k %lld): %lld elements differ from "
           "the calls without; x's codes reused %lld times\n", (int)kind, (long long)rows, (long long)k,
           (long long)diff, (long long)reused);
    CHECK_EQ(diff, 0);
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 3; i++)
            free(got[h][i]);
    free(x), free(x2), free(o1), free(o2);
    df_backend_free(g, gx), df_backend_free(g, gx2), df_backend_free(g, go1), df_backend_free(g, go2);
    return reused;
}

static double time_ms(int (*f)(void *), void *arg)
{
    double t[9];
    CHECK_EQ(f(arg), 0); /* warm-up: plans, checks, scratch */
    CHECK_EQ(df_backend_sync(gh_gpu), 0);
    for (int i = 0; i < 9; i++) {
        double t0 = gh_now_ms();
        CHECK_EQ(f(arg), 0);
        CHECK_EQ(df_backend_sync(gh_gpu), 0);
        t[i] = gh_now_ms() - t0;
    }
    return gh_median(t, 9);
}

typedef struct bench_case {
    df_gemm_kind kind;
    df_tensor a, b, c, q;
    void *ws;
    size_t ws_bytes;
    int weight_ready;
} bench_case;

static int run_bf16(void *p)
{
    bench_case *k = p;
    return k->kind == DF_GEMM_FWD     ? df_op_matmul(gh_gpu, &k->a, &k->b, &k->c, 0)
           : k->kind == DF_GEMM_BWD_X ? df_op_matmul_bwd_x(gh_gpu, &k->a, &k->b, &k->c, 0)
                                      : df_op_matmul_bwd_w(gh_gpu, &k->a, &k->b, &k->c, 0);
}
static int run_op8(void *p)
{
    bench_case *k = p;
    return df_op_matmul_fp8(gh_gpu, k->kind, &k->a, &k->b, &k->c, 0);
}
static int run_fast(void *p)
{
    bench_case *k = p;
    int rc = df_cuda_matmul_fp8_fast_ws(gh_gpu, k->kind, &k->a, &k->b, &k->c, 0, k->ws,
                                        k->ws_bytes, NULL, k->weight_ready, 0);
    return rc == 1 ? 0 : rc == 0 ? -ENOTSUP : rc;
}
static int run_round_a(void *p)
{
    bench_case *k = p;
    return k->kind == DF_GEMM_BWD_W ? df_op_fp8_qdq(gh_gpu, &k->a, &k->q, 128, 1)
                                    : df_op_fp8_qdq(gh_gpu, &k->a, &k->q, 1, 128);
}

typedef struct codes_case {
    int mode;
    df_tensor x;
    uint8_t *q;
    float *sc;
    int64_t kp, n_out;
} codes_case;
static int run_codes(void *p)
{
    codes_case *k = p;
    return df_cuda_fp8_round_codes(gh_gpu, k->mode, &k->x, k->q, k->kp, k->sc, k->n_out);
}

/* a rounding kernel alone: x [R, C] (row stride ld) to codes and scales, and the rate of its
 * bytes (2 read + 1 written per value) */
static void bench_codes(const char *name, int mode, int64_t R, int64_t C, int64_t ld)
{
    df_backend *g = gh_gpu;
    int tr = mode == 1 || mode == 3;
    int64_t red = tr ? R : C, kp = (red + 127) / 128 * 128, rows = tr ? C : R;
    codes_case k = {.mode = mode, .kp = kp, .n_out = mode == 0 ? (R + 3) / 4 * 4 : rows};
    void *gx = df_backend_alloc(g, (size_t)(R * ld) * 2);
    k.q = df_backend_alloc(g, (size_t)(k.n_out * kp));
    k.sc = df_backend_alloc(g, (size_t)((k.n_out + 127) / 128 * 128 * (kp / 128 + 3)) * 4);
    CHECK(gx && k.q && k.sc);
    CHECK_EQ(df_backend_fill_uniform(g, gx, DF_DTYPE_BF16, R * ld, 3, -2.0f, 2.0f), 0);
    k.x = df_tensor_2d(gx, DF_DTYPE_BF16, R, C);
    k.x.stride[0] = ld;
    double t = time_ms(run_codes, &k);
    printf("bench rounding %-22s mode %d %lldx%lld (ld %lld): %.3f ms, %.0f GB/s\n", name, mode,
           (long long)R, (long long)C, (long long)ld, t, 3.0 * (double)R * (double)C / t * 1e-6);
    df_backend_free(g, gx), df_backend_free(g, k.q), df_backend_free(g, k.sc);
}

/* M rows of activations, the weight N x K (as check_matmul) */
static void bench_gemm(const char *name, df_gemm_kind kind, int64_t M, int64_t N, int64_t K)
{
    df_backend *g = gh_gpu;
    int64_t ar = M, ac = kind == DF_GEMM_FWD ? K : N;
    int64_t br = kind == DF_GEMM_BWD_W ? M : N, bc = K;
    int64_t cr = kind == DF_GEMM_BWD_W ? N : M, cc = kind == DF_GEMM_FWD ? N : K;
    bench_case k = {.kind = kind};
    void *ga = df_backend_alloc(g, (size_t)(ar * ac) * 2), *gb = df_backend_alloc(g, (size_t)(br * bc) * 2);
    void *gc = df_backend_alloc(g, (size_t)(cr * cc) * 2), *gq = df_backend_alloc(g, (size_t)(ar * ac) * 2);
    CHECK(ga && gb && gc && gq);
    CHECK_EQ(df_backend_fill_uniform(g, ga, DF_DTYPE_BF16, ar * ac, 1, -1.0f, 1.0f), 0);
    CHECK_EQ(df_backend_fill_uniform(g, gb, DF_DTYPE_BF16, br * bc, 2, -0.05f, 0.05f), 0);
    k.a = df_tensor_2d(ga, DF_DTYPE_BF16, ar, ac), k.b = df_tensor_2d(gb, DF_DTYPE_BF16, br, bc);
    k.c = df_tensor_2d(gc, DF_DTYPE_BF16, cr, cc), k.q = df_tensor_2d(gq, DF_DTYPE_BF16, ar, ac);
    double flop = 2.0 * (double)M * (double)N * (double)K;
    double t16 = time_ms(run_bf16, &k), t8 = time_ms(run_op8, &k), tr = time_ms(run_round_a, &k);
    printf("bench %-10s kind %d M=%lld N=%lld K=%lld: bf16 %.3f ms (%.0f TFLOP/s), fp8 op %.3f ms "
           "(%.0f), df_op_fp8_qdq of a %.3f ms",
           name, (int)kind, (long long)M, (long long)N, (long long)K, t16, flop / t16 * 1e-9, t8,
           flop / t8 * 1e-9, tr);
    k.ws_bytes = df_cuda_matmul_fp8_ws_bytes(kind, &k.a, &k.c, 0);
    k.ws = df_backend_alloc(g, k.ws_bytes);
    CHECK(k.ws != NULL);
    if (df_cuda_fp8_gemm_possible(g)) {
        k.weight_ready = 0;
        double tf = time_ms(run_fast, &k);
        printf(", tensor cores: whole call %.3f ms (%.0f)", tf, flop / tf * 1e-9);
        if (kind != DF_GEMM_BWD_W) {
            k.weight_ready = 1;
            double tw = time_ms(run_fast, &k);
            printf(", weight's codes kept %.3f ms (%.0f)", tw, flop / tw * 1e-9);
        }
    }
    printf("\n");
    void *bufs[] = {ga, gb, gc, gq, k.ws};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        df_backend_free(g, bufs[i]);
}

int main(int argc, char **argv)
{
    int rc = gh_open(0);
    if (rc)
        return rc;
    if (argc > 1 && !strcmp(argv[1], "--bench")) { /* the 27B drafter step's GEMMs */
        bench_codes("activations (mlp up)", 0, 8192, 5120, 5120);
        bench_codes("activations (mlp down)", 0, 8192, 17408, 17408);
        bench_codes("lm head gradient", 0, 768, 248320, 2 * 248320);
        bench_codes("dw operand (mlp down)", 1, 8192, 17408, 17408);
        bench_codes("dw operand (q proj)", 1, 8192, 5120, 5120);
        bench_codes("weight (mlp up)", 2, 17408, 5120, 5120);
        bench_codes("weight^T (mlp up)", 3, 17408, 5120, 5120);
        bench_codes("weight^T (mlp down)", 3, 5120, 17408, 17408);
        for (int kind = 0; kind < 3; kind++) {
            bench_gemm("mlp up", (df_gemm_kind)kind, 8192, 17408, 5120);
            bench_gemm("mlp down", (df_gemm_kind)kind, 8192, 5120, 17408);
            bench_gemm("q proj", (df_gemm_kind)kind, 8192, 4096, 5120);
            bench_gemm("fc", (df_gemm_kind)kind, 4096, 5120, 25600);
        }
        bench_gemm("lm head", DF_GEMM_FWD, 768, 248320, 5120);
        bench_gemm("lm head", DF_GEMM_BWD_X, 768, 248320, 5120);
        gh_close();
        return test_main_end();
    }
    static const int64_t sh[][4] = {
        {37, 300, 1, 128}, {300, 37, 128, 1}, {260, 300, 128, 128}, {5, 7, 3, 2}, {1, 1000, 1, 1000},
    };
    for (size_t s = 0; s < sizeof sh / sizeof sh[0]; s++)
        for (int f32 = 0; f32 < 2; f32++)
            for (int ip = 0; ip < 2; ip++)
                check_qdq(sh[s][0], sh[s][1], sh[s][2], sh[s][3], f32, ip, s == 2 && ip);
    check_qdq(8192, 5120, 1, 128, 0, 0, 0);   /* the drafter's activations */
    check_qdq(5120, 17408, 128, 128, 0, 0, 0); /* a weight */
    check_qdq(4096, 5120, 128, 1, 0, 1, 0);   /* an operand reduced over rows */
    /* the tensor cores' codes: each rounding kernel, edges and non-finite blocks */
    for (int mode = 0; mode < 4; mode++) {
        check_codes(mode, 37, 300, 0);
        check_codes(mode, 300, 37, 0);
        check_codes(mode, 259, 390, 1);
        check_codes(mode, 1024, 1536, 0);
    }
    /* MXFP8's scales (compute capability 10+): 1 x 128 and 128 x 128, rows not a multiple of 128 */
    check_mx(0, 300, 300, 640);
    check_mx(0, 260, 257, 128);
    check_mx(1, 300, 300, 640);
    check_mx(1, 5120, 5120, 17408);
    /* the BF16 path everywhere, then (sm_90) the E4M3 tensor cores where they agree. Shapes:
     * edges everywhere; C's columns a multiple of 128 with rows that are not, and not a
     * multiple of 4 (padded rows) */
    df_cuda_device_info info;
    int sm90 = df_cuda_device_info_get(0, &info) == 0 && info.sm_major == 9;
    for (int pass = 0; pass < 2; pass++) {
        df_knob_set(DF_KNOB_FP8_GEMM, pass ? "1" : "0");
        for (int kind = 0; kind < 3; kind++) {
            int64_t cols = kind == DF_GEMM_FWD ? 384 : 256; /* m: N of FWD, K of BWD_X */
            check_matmul((df_gemm_kind)kind, 37, 150, 300, 0);
            check_matmul((df_gemm_kind)kind, 37, 150, 300, 1);
            check_matmul((df_gemm_kind)kind, 299, kind == DF_GEMM_FWD ? cols : 640, cols, 0);
            check_matmul((df_gemm_kind)kind, 130, kind == DF_GEMM_FWD ? cols : 1280, cols, 1);
            check_matmul((df_gemm_kind)kind, 1024, 768, 512, kind == DF_GEMM_BWD_W);
            check_matmul((df_gemm_kind)kind, 4096, 1024, 5120, 1);
        }
        /* bwd_w with dy per 128 x 128 (DF_FP8_DY_BLOCKS): edges, dy's columns (B's rows) not a
         * multiple of 128, the 27B shapes' proportions */
        int64_t f0 = 0, s0 = 0, f1 = 0, s1 = 0;
        df_cuda_fp8_gemm_counts(&f0, &s0);
        check_matmul(DF_GEMM_BWD_W, 37, 150, 300, DF_FP8_DY_BLOCKS);
        check_matmul(DF_GEMM_BWD_W, 299, 640, 256, DF_FP8_DY_BLOCKS | DF_FP8_ACCUMULATE);
        check_matmul(DF_GEMM_BWD_W, 1024, 768, 512, DF_FP8_DY_BLOCKS | DF_FP8_ACCUMULATE);
        check_matmul(DF_GEMM_BWD_W, 4096, 1024, 5120, DF_FP8_DY_BLOCKS | DF_FP8_ACCUMULATE);
        df_cuda_fp8_gemm_counts(&f1, &s1);
        printf("bwd_w with dy blocks: %lld calls on E4M3 tensor cores\n", (long long)(f1 - f0));
        if (pass && sm90)
            CHECK(f1 - f0 >= 3);
    }
    /* the hints: on the BF16 path (ignored), then on the tensor cores (x rounded once) */
    df_knob_set(DF_KNOB_FP8_GEMM, "0");
    CHECK_EQ(check_hold(DF_GEMM_FWD, 300, 512, 384, 256), 0);
    df_knob_set(DF_KNOB_FP8_GEMM, "1");
    int64_t held_fwd = check_hold(DF_GEMM_FWD, 1024, 640, 384, 256);
    int64_t held_bw = check_hold(DF_GEMM_BWD_W, 1024, 640, 384, 256);
    int64_t nfast = 0, nslow = 0;
    df_cuda_fp8_gemm_counts(&nfast, &nslow);
    printf("fp8 gemm: %lld calls on E4M3 tensor cores, %lld on the BF16 path after a check%s\n",
           (long long)nfast, (long long)nslow,
           sm90 ? "" : info.sm_major >= 10 ? " (MXFP8: not asserted, never run on such a GPU here)"
                                          : " (before sm_90: none expected)");
    /* on sm_90 the aligned shapes must have passed their check (DFLASH_LOG=info says why not) */
    if (sm90)
        CHECK(nfast >= 18 && held_fwd == 1 && held_bw == 1);
    if (sm90)
        check_undecided();
    gh_close();
    return test_main_end();
}
