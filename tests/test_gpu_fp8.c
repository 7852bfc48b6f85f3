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
 *  - df_op_lmhead_ce with DF_CE_FP8_GRAD on rounded h and head (its
 *    contract): loss and ce those of flags 0 up to the order of the sums
 *    (the E4M3 tensor cores on sm_90); dh is within 2e-2
 *    relative L2 of the CPU's (the GPU rounds G to bf16 before E4M3, the CPU
 *    rounds the fp32 G: blocks may differ by a tie or a scale step) and
 *    moves away from the flags-0 dh by E4M3's ~1e-2; G's codes written by the
 *    row kernel (once GEMM 2's class has passed its check) are bitwise those
 *    rounded by GEMM 2, in one chunk and in several, padded rows included;
 *    with DF_CE_BF16_LOGITS too (and without FP8): the CPU's with that flag;
 *    with DF_CE_F16_LOGITS likewise; with DF_CE_FP8_ONEPASS: one pass on sm_90,
 *    within 1e-2 relative L2 of the CPU's one pass (also on fp16 logits), and on
 *    the unrounded head the same bits.
 * `--bench`: the GEMMs of the Qwen3.6-27B drafter step, each kind: the BF16
 *  GEMM, the FP8 op, the BF16 path's rounding of the activations (df_op_fp8_qdq),
 *  and the tensor cores' whole call with the weight's codes made or kept; medians of 9
 *  host-timed calls (a sync each).
 * SwiGLU writing its GEMM operands' codes (DF_FP8_MADE): test_gpu_fp8_swiglu. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/device.h"
#include "e4m3.h"
#include "cuda/fp8_cuda.h"
#include "cuda/lmhead_cuda.h"
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

static void check_lmhead(int64_t N, int64_t V, int64_t H, int sm90)
{
    df_backend *g = gh_gpu, *c = gh_cpu;
    float *h = gh_rand_bf16(GH_N01, &rng, N * H, 1.0f), *w = gh_rand_bf16(GH_N01, &rng, V * H, 0.05f);
    float *wu = gh_xmalloc((size_t)(V * H) * 4); /* the head as it was (DF_CE_FP8_ROUND_HEAD) */
    memcpy(wu, w, (size_t)(V * H) * 4);
    /* on the E4M3 grid, as DF_CE_FP8_GRAD's caller passes them */
    CHECK_EQ(df_fp8_qdq_f32(h, N, H, H, 1, 128), 0);
    CHECK_EQ(df_fp8_qdq_f32(w, V, H, H, 128, 128), 0);
    int32_t *lab = gh_xmalloc((size_t)N * 4);
    for (int64_t i = 0; i < N; i++)
        lab[i] = i % 5 == 4 ? -1 : (int32_t)(test_rand(&rng) % (uint64_t)V);
    float *dh_ref = gh_xmalloc((size_t)(N * H) * 4);
    df_tensor th = df_tensor_2d(h, DF_DTYPE_F32, N, H), tw = df_tensor_2d(w, DF_DTYPE_F32, V, H);
    df_tensor tdr = df_tensor_2d(dh_ref, DF_DTYPE_F32, N, H);
    double lref = 0;
    CHECK_EQ(df_op_lmhead_ce(c, &th, &tw, lab, NULL, (float)N, &lref, &tdr, NULL, NULL,
                             DF_CE_FP8_GRAD), 0);
    void *gh = gh_dev_bf16(g, h, N * H), *gw = gh_dev_bf16(g, w, V * H);
    void *glab = gh_dev_copy(g, lab, (size_t)N * 4);
    void *gd0 = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16), *gd8 = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16);
    void *gce0 = gh_dev_poisoned(g, N, DF_DTYPE_F32), *gce8 = gh_dev_poisoned(g, N, DF_DTYPE_F32);
    void *gam0 = gh_dev_poisoned(g, N, DF_DTYPE_I32), *gam8 = gh_dev_poisoned(g, N, DF_DTYPE_I32);
    df_tensor Gh = df_tensor_2d(gh, DF_DTYPE_BF16, N, H), Gw = df_tensor_2d(gw, DF_DTYPE_BF16, V, H);
    df_tensor G0 = df_tensor_2d(gd0, DF_DTYPE_BF16, N, H), G8 = df_tensor_2d(gd8, DF_DTYPE_BF16, N, H);
    double l0 = 0, l8 = 0;
    CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gw, glab, NULL, (float)N, &l0, &G0, gam0, gce0, 0), 0);
    CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gw, glab, NULL, (float)N, &l8, &G8, gam8, gce8,
                             DF_CE_FP8_GRAD), 0);
    /* the same logits up to the order of the sums (E4M3 tensor cores or not) */
    CHECK(fabs(l8 - l0) <= 1e-5 * fabs(l0));
    float *ce0 = gh_xmalloc((size_t)N * 4), *ce8 = gh_xmalloc((size_t)N * 4);
    int32_t *am0 = gh_xmalloc((size_t)N * 4), *am8 = gh_xmalloc((size_t)N * 4);
    CHECK_EQ(df_backend_download(g, ce0, gce0, (size_t)N * 4), 0);
    CHECK_EQ(df_backend_download(g, ce8, gce8, (size_t)N * 4), 0);
    CHECK_EQ(df_backend_download(g, am0, gam0, (size_t)N * 4), 0);
    CHECK_EQ(df_backend_download(g, am8, gam8, (size_t)N * 4), 0);
    int64_t ce_bad = 0, am_diff = 0;
    for (int64_t i = 0; i < N; i++) {
        ce_bad += !(fabsf(ce8[i] - ce0[i]) <= 1e-4f * (1.0f + fabsf(ce0[i])));
        am_diff += am0[i] != am8[i];
    }
    CHECK_EQ(ce_bad, 0);
    CHECK(am_diff <= N / 100); /* near-ties may flip */
    float *d0 = gh_download_bf16(g, gd0, N * H), *d8 = gh_download_bf16(g, gd8, N * H);
    double e2 = 0, r2 = 0, m2 = 0;
    for (int64_t i = 0; i < N * H; i++) {
        e2 += (d8[i] - dh_ref[i]) * (double)(d8[i] - dh_ref[i]);
        r2 += (double)dh_ref[i] * dh_ref[i];
        m2 += (d8[i] - d0[i]) * (double)(d8[i] - d0[i]);
    }
    double rel = sqrt(e2 / r2), moved = sqrt(m2 / r2);
    /* a frozen head (DF_CE_FP8_HEAD_FROZEN): its codes made at the first call and kept for the
     * second, the same bits as made per call; kept again after a free (forgotten, remade).
     * From the second call on (GEMM 2's class checked at the first), the row kernel writes
     * G's codes itself: the same bits as G rounded by GEMM 2 at the first. */
    int64_t fused0 = df_cuda_lmhead_ce_fp8_fused();
    for (int call = 0; call < 3; call++) {
        if (call == 2)
            df_backend_free(g, df_backend_alloc(g, 256));
        void *gdf = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16);
        df_tensor Gf = df_tensor_2d(gdf, DF_DTYPE_BF16, N, H);
        double lf = 0;
        CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gw, glab, NULL, (float)N, &lf, &Gf, NULL, NULL,
                                 DF_CE_FP8_GRAD | DF_CE_FP8_HEAD_FROZEN), 0);
        float *df = gh_download_bf16(g, gdf, N * H);
        CHECK(lf == l8);
        CHECK(memcmp(df, d8, (size_t)(N * H) * sizeof(float)) == 0);
        free(df);
        df_backend_free(g, gdf);
    }
    int64_t fused = df_cuda_lmhead_ce_fp8_fused() - fused0;
    printf("  G's codes from the row kernel: %lld of 3 calls\n", (long long)fused);
    if (sm90)
        CHECK_EQ(fused, 3);
    /* DF_CE_FP8_ONEPASS (the head's codes kept, GEMM 2's class checked above): one pass on
     * the E4M3 tensor cores, the CPU's one pass up to the sums' order, loss and argmax
     * FP8's; on the head as it was (DF_CE_FP8_ROUND_HEAD) the same bits, so the one-hot
     * term takes the codes the GEMMs take */
    {
        const unsigned fo = DF_CE_FP8_GRAD | DF_CE_FP8_HEAD_FROZEN | DF_CE_FP8_ONEPASS;
        float *dc1 = gh_xmalloc((size_t)(N * H) * 4);
        df_tensor tc1 = df_tensor_2d(dc1, DF_DTYPE_F32, N, H);
        double lc1 = 0, lg1 = 0, lu1 = 0;
        CHECK_EQ(df_op_lmhead_ce(c, &th, &tw, lab, NULL, (float)N, &lc1, &tc1, NULL, NULL, fo), 0);
        int64_t one0 = df_cuda_lmhead_ce_onepass_chunks();
        void *gd1 = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16), *gam1 = gh_dev_poisoned(g, N, DF_DTYPE_I32);
        df_tensor Gd1 = df_tensor_2d(gd1, DF_DTYPE_BF16, N, H);
        CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gw, glab, NULL, (float)N, &lg1, &Gd1, gam1, NULL, fo), 0);
        int64_t one = df_cuda_lmhead_ce_onepass_chunks() - one0;
        float *d1 = gh_download_bf16(g, gd1, N * H);
        int32_t *am1 = gh_xmalloc((size_t)N * 4);
        CHECK_EQ(df_backend_download(g, am1, gam1, (size_t)N * 4), 0);
        double e1 = 0, r1 = 0, ex = 0;
        int64_t am_d1 = 0;
        for (int64_t i = 0; i < N * H; i++) {
            e1 += (d1[i] - dc1[i]) * (double)(d1[i] - dc1[i]);
            r1 += (double)dc1[i] * dc1[i];
            ex += (d1[i] - d8[i]) * (double)(d1[i] - d8[i]);
        }
        for (int64_t i = 0; i < N; i++)
            am_d1 += am1[i] != am8[i];
        void *gwu1 = gh_dev_bf16(g, wu, V * H), *gdu1 = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16);
        df_tensor Gwu1 = df_tensor_2d(gwu1, DF_DTYPE_BF16, V, H), Gdu1 = df_tensor_2d(gdu1, DF_DTYPE_BF16, N, H);
        for (int call = 0; call < 2; call++) { /* the first makes the codes of the other head */
            lu1 = 0; /* (the op adds to it) */
            CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gwu1, glab, NULL, (float)N, &lu1, &Gdu1, NULL, NULL,
                                     fo | DF_CE_FP8_ROUND_HEAD), 0);
        }
        float *du1 = gh_download_bf16(g, gdu1, N * H);
        printf("  DF_CE_FP8_ONEPASS: %lld chunk(s) in one pass; loss %.9g (cpu %.9g, two passes "
               "%.9g), dh rel L2 vs cpu %.3e, vs two passes %.3e\n", (long long)one, lg1, lc1, l8,
               sqrt(e1 / r1), sqrt(ex / r2));
        if (sm90)
            CHECK(one >= 1);
        CHECK(fabs(lg1 - lc1) <= 1e-5 * fabs(lc1));
        CHECK(fabs(lg1 - l8) <= 1e-5 * fabs(l8));
        CHECK(am_d1 <= N / 100);
        if (one)
            CHECK(sqrt(e1 / r1) < 1e-2);
        CHECK(lu1 == lg1);
        CHECK(memcmp(du1, d1, (size_t)(N * H) * sizeof(float)) == 0);
        /* DFLASH_CE_ONEPASS_BSUM: the row sums from the codes' exps; the same argmax, the loss
         * and dh within their last bits' rounding of the default kernel's, the CPU's bound */
        {
            CHECK_EQ(df_knob_set(DF_KNOB_CE_ONEPASS_BSUM, "1"), 0);
            double lb = 0;
            void *gdb = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16), *gamb = gh_dev_poisoned(g, N, DF_DTYPE_I32);
            df_tensor Gdb = df_tensor_2d(gdb, DF_DTYPE_BF16, N, H);
            CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gw, glab, NULL, (float)N, &lb, &Gdb, gamb, NULL, fo), 0);
            CHECK_EQ(df_knob_set(DF_KNOB_CE_ONEPASS_BSUM, NULL), 0);
            float *db = gh_download_bf16(g, gdb, N * H);
            int32_t *amb = gh_xmalloc((size_t)N * 4);
            CHECK_EQ(df_backend_download(g, amb, gamb, (size_t)N * 4), 0);
            double eb = 0, ebc = 0;
            for (int64_t i = 0; i < N * H; i++) {
                eb += (db[i] - d1[i]) * (double)(db[i] - d1[i]);
                ebc += (db[i] - dc1[i]) * (double)(db[i] - dc1[i]);
            }
            printf("  DF_CE_FP8_ONEPASS, DFLASH_CE_ONEPASS_BSUM=1: loss %.9g (default kernel %.9g), "
                   "dh rel L2 vs the default kernel %.3e, vs cpu %.3e\n", lb, lg1,
                   sqrt(eb / r1), sqrt(ebc / r1));
            CHECK(fabs(lb - lg1) <= 1e-6 * fabs(lg1));
            CHECK(memcmp(amb, am1, (size_t)N * 4) == 0);
            CHECK(sqrt(eb / r1) < 1e-3);
            if (one)
                CHECK(sqrt(ebc / r1) < 1e-2);
            free(db), free(amb);
            df_backend_free(g, gdb), df_backend_free(g, gamb);
        }
        /* with DF_CE_F16_LOGITS: the one pass on fp16 logits, the CPU's with the same flags */
        double lch = 0, lgh = 0, eh = 0, rh = 0;
        CHECK_EQ(df_op_lmhead_ce(c, &th, &tw, lab, NULL, (float)N, &lch, &tc1, NULL, NULL,
                                 fo | DF_CE_F16_LOGITS), 0);
        one0 = df_cuda_lmhead_ce_onepass_chunks();
        for (int call = 0; call < 2; call++) { /* the first checks GEMM 1's fp16 class */
            lgh = 0; /* (the op adds to it) */
            CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gw, glab, NULL, (float)N, &lgh, &Gd1, NULL, NULL,
                                     fo | DF_CE_F16_LOGITS), 0);
        }
        int64_t oneh = df_cuda_lmhead_ce_onepass_chunks() - one0;
        float *dh1 = gh_download_bf16(g, gd1, N * H);
        for (int64_t i = 0; i < N * H; i++) {
            eh += (dh1[i] - dc1[i]) * (double)(dh1[i] - dc1[i]);
            rh += (double)dc1[i] * dc1[i];
        }
        printf("  DF_CE_FP8_ONEPASS | DF_CE_F16_LOGITS: %lld chunk(s) in one pass; loss %.9g (cpu "
               "%.9g), dh rel L2 vs cpu %.3e\n", (long long)oneh, lgh, lch, sqrt(eh / rh));
        if (sm90)
            CHECK(oneh >= 1);
        CHECK(fabs(lgh - lch) <= 1e-5 * fabs(lch));
        CHECK(sqrt(eh / rh) < 1e-2);
        free(dh1);
        free(dc1), free(d1), free(am1), free(du1);
        df_backend_free(g, gd1), df_backend_free(g, gam1), df_backend_free(g, gwu1),
            df_backend_free(g, gdu1);
    }
    /* DF_CE_FP8_ROUND_HEAD on the head as it was: its codes made from it, kept or not, the same
     * bits as the rounded head's; with the E4M3 GEMMs off, the BF16 GEMMs on the call's rounded
     * copy: the same bits as on the rounded head */
    void *gwu = gh_dev_bf16(g, wu, V * H);
    df_tensor Gwu = df_tensor_2d(gwu, DF_DTYPE_BF16, V, H);
    for (int v = 0; v < 3; v++) {
        unsigned f = DF_CE_FP8_GRAD | DF_CE_FP8_ROUND_HEAD | (v == 1 ? DF_CE_FP8_HEAD_FROZEN : 0);
        double lw = l8, lu = 0;
        float *dw = d8;
        if (v == 2) { /* the reference: the rounded head on the BF16 path */
            df_knob_set(DF_KNOB_FP8_GEMM, "0");
            void *gdw = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16);
            df_tensor Gdw = df_tensor_2d(gdw, DF_DTYPE_BF16, N, H);
            lw = 0;
            CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gw, glab, NULL, (float)N, &lw, &Gdw, NULL, NULL,
                                     DF_CE_FP8_GRAD), 0);
            dw = gh_download_bf16(g, gdw, N * H);
            df_backend_free(g, gdw);
        }
        void *gdu = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16);
        df_tensor Gdu = df_tensor_2d(gdu, DF_DTYPE_BF16, N, H);
        CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gwu, glab, NULL, (float)N, &lu, &Gdu, NULL, NULL, f), 0);
        float *du = gh_download_bf16(g, gdu, N * H);
        printf("  DF_CE_FP8_ROUND_HEAD%s: loss %.9g vs %.9g on the rounded head\n",
               v == 1 ? " | DF_CE_FP8_HEAD_FROZEN" : v == 2 ? " (E4M3 GEMMs off)" : "", lu, lw);
        CHECK(lu == lw);
        CHECK(memcmp(du, dw, (size_t)(N * H) * sizeof(float)) == 0);
        if (v == 2) {
            df_knob_set(DF_KNOB_FP8_GEMM, "1");
            free(dw);
        }
        free(du);
        df_backend_free(g, gdu);
    }
    df_backend_free(g, gwu);
    free(wu);
    /* in chunks of ~N/4 rows (the head's codes made at the first, kept for the others):
     * the same within the sums' order */
    df_cuda_lmhead_ce_set_chunk_bytes((size_t)(N / 4) * (size_t)((V + 8) * 4 + H * 4 + 2 * (V + H)));
    void *gdc = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16);
    df_tensor Gc = df_tensor_2d(gdc, DF_DTYPE_BF16, N, H);
    double lc = 0;
    CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gw, glab, NULL, (float)N, &lc, &Gc, NULL, NULL,
                             DF_CE_FP8_GRAD), 0);
    /* the same chunks with G written as bf16 and rounded by GEMM 2: the same bits */
    void *gdo = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16);
    df_tensor Go = df_tensor_2d(gdo, DF_DTYPE_BF16, N, H);
    double lo = 0;
    df_cuda_lmhead_ce_set_fp8_codes(0);
    fused0 = df_cuda_lmhead_ce_fp8_fused();
    CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gw, glab, NULL, (float)N, &lo, &Go, NULL, NULL,
                             DF_CE_FP8_GRAD), 0);
    CHECK_EQ(df_cuda_lmhead_ce_fp8_fused(), fused0);
    df_cuda_lmhead_ce_set_fp8_codes(1);
    df_cuda_lmhead_ce_set_chunk_bytes(0);
    float *dc = gh_download_bf16(g, gdc, N * H), *dco = gh_download_bf16(g, gdo, N * H);
    CHECK(lo == lc);
    CHECK(memcmp(dc, dco, (size_t)(N * H) * sizeof(float)) == 0);
    free(dco);
    df_backend_free(g, gdo);
    double ec = 0;
    for (int64_t i = 0; i < N * H; i++)
        ec += (dc[i] - d8[i]) * (double)(dc[i] - d8[i]);
    printf("  in chunks: loss %.9g, dh rel L2 vs one chunk %.3e\n", lc, sqrt(ec / r2));
    CHECK(fabs(lc - l8) <= 1e-5 * fabs(l8));
    CHECK(sqrt(ec / r2) < 1e-2);
    free(dc);
    df_backend_free(g, gdc);
    /* DF_CE_BF16_LOGITS (GEMM 1 writes bf16 logits) and DF_CE_F16_LOGITS (fp16 on the E4M3
     * tensor cores, else fp32 read as fp16), with FP8's G and alone: the CPU's with the same
     * flags up to the order of the sums; the row kernel's codes bitwise G written in place
     * over the logits and rounded by GEMM 2 */
    for (int hf = 0; hf < 4; hf++) {
        const int f8 = !(hf & 1), half16 = hf >= 2;
        unsigned fl = (half16 ? DF_CE_F16_LOGITS : DF_CE_BF16_LOGITS) | (f8 ? DF_CE_FP8_GRAD : 0);
        float *dcb = gh_xmalloc((size_t)(N * H) * 4);
        df_tensor tdb = df_tensor_2d(dcb, DF_DTYPE_F32, N, H);
        double lcb = 0, lg[2] = {0, 0};
        CHECK_EQ(df_op_lmhead_ce(c, &th, &tw, lab, NULL, (float)N, &lcb, &tdb, NULL, NULL, fl), 0);
        float *dg[2];
        for (int codes = 1; codes >= 0; codes--) {
            df_cuda_lmhead_ce_set_fp8_codes(codes);
            void *gdb = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16);
            df_tensor Gdb = df_tensor_2d(gdb, DF_DTYPE_BF16, N, H);
            CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gw, glab, NULL, (float)N, &lg[codes], &Gdb, NULL,
                                     NULL, fl), 0);
            dg[codes] = gh_download_bf16(g, gdb, N * H);
            df_backend_free(g, gdb);
        }
        df_cuda_lmhead_ce_set_fp8_codes(1);
        double eb = 0, rb = 0;
        for (int64_t i = 0; i < N * H; i++) {
            eb += (dg[1][i] - dcb[i]) * (double)(dg[1][i] - dcb[i]);
            rb += (double)dcb[i] * dcb[i];
        }
        printf("  %s%s: loss %.9g (cpu %.9g, fp32 logits %.9g), dh rel L2 vs cpu %.3e\n",
               half16 ? "DF_CE_F16_LOGITS" : "DF_CE_BF16_LOGITS", f8 ? " | DF_CE_FP8_GRAD" : "",
               lg[1], lcb, f8 ? l8 : l0, sqrt(eb / rb));
        CHECK(fabs(lg[1] - lcb) <= 1e-5 * fabs(lcb));
        CHECK(lg[1] != (f8 ? l8 : l0));
        CHECK(sqrt(eb / rb) < (f8 ? 2e-2 : 1e-2));
        CHECK(lg[0] == lg[1]);
        CHECK(memcmp(dg[0], dg[1], (size_t)(N * H) * sizeof(float)) == 0);
        free(dg[0]), free(dg[1]), free(dcb);
    }
    printf("lmhead_ce fp8 grad N=%lld V=%lld H=%lld: loss %.9g (flags 0: %.9g, cpu %.9g), dh rel L2 "
           "vs cpu %.3e, moved from flags 0 %.3e\n",
           (long long)N, (long long)V, (long long)H, l8, l0, lref, rel, moved);
    CHECK(rel < 2e-2);
    CHECK(moved > 1e-3 && moved < 0.1);
    free(h), free(w), free(lab), free(dh_ref), free(ce0), free(ce8), free(am0), free(am8), free(d0),
        free(d8);
    void *bufs[] = {gh, gw, glab, gd0, gd8, gce0, gce8, gam0, gam8};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        df_backend_free(g, bufs[i]);
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
    check_lmhead(300, 5000, 256, sm90);
    /* rows not a multiple of 4 (cuBLASLt's row counts): the GEMMs' rows rounded up, on the
     * tensor cores still (chunks of 74 rows too) */
    df_cuda_fp8_gemm_counts(&nfast, &nslow);
    check_lmhead(299, 5000, 256, sm90);
    int64_t nfast2 = 0, nslow2 = 0;
    df_cuda_fp8_gemm_counts(&nfast2, &nslow2);
    printf("lmhead_ce with 299 rows: %lld calls on E4M3 tensor cores, %lld on the BF16 path\n",
           (long long)(nfast2 - nfast), (long long)(nslow2 - nslow));
    if (sm90)
        CHECK(nfast2 - nfast >= 4 && nslow2 == nslow);
    if (sm90)
        check_undecided();
    gh_close();
    return test_main_end();
}
