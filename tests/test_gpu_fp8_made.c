/* test_gpu_fp8_made - ops writing the E4M3 codes of the GEMM operands they compute
 * (df_op_swiglu_fp8, df_op_swiglu_bwd_fp8, df_op_rmsnorm_fp8, df_op_fp8_dy_codes, DF_FP8_MADE,
 * DF_FP8_ONLY_CODES)
 * on the CUDA backend. Skips (77) without a GPU.
 *  - backward (check_swiglu_dy): dgate / dup bitwise df_op_swiglu_bwd's, in place or not, and
 *    the four GEMMs that take them bitwise those without the hints; the codes it kept bitwise
 *    the rounding kernels' (padding and scales included);
 *  - forward (check_swiglu_x): m bitwise df_op_swiglu's, the down projection's forward and
 *    weight-gradient GEMMs bitwise those without the hint, the kept codes the rounding
 *    kernels', each region used once;
 *  - DF_FP8_ONLY_CODES: the same GEMM bits with the values left out where every call is
 *    proven to take the codes, and a call that would read them fails with -EIO;
 *  - RMSNorm (check_rmsnorm_x): y bitwise df_op_rmsnorm's, three forward and three weight
 *    gradient GEMMs bitwise those without the hint, the kept codes the rounding kernels', each
 *    region used by its three calls; DF_FP8_ONLY_CODES as above;
 *  - a projection's dy rounded once for both backward GEMMs (check_dy_codes): both bitwise those
 *    without the hint, the kept codes the rounding kernels', each region used once;
 *  - with the E4M3 GEMMs off (DFLASH_FP8_GEMM=0) nothing is kept and the values are written.
 * The codes are kept on sm_90 only (MXFP8 on 10+ rounds in the GEMMs). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/device.h"
#include "cuda/fp8_cuda.h"
#include "gpu_harness.h"
#include "knobs.h"
#include "ops.h"
#include "train_ops.h"

static uint64_t rng = 77;

/* bytes of a device region, downloaded */
static void *dl(df_backend *g, const void *d, size_t bytes)
{
    void *h = gh_xmalloc(bytes);
    CHECK_EQ(df_backend_download(g, h, d, bytes), 0);
    return h;
}

/* t [R, C]'s codes and scales as operand op of kind (FWD / BWD_X: mode 0 with n_out = R; BWD_W's
 * dy: mode 3, its x: mode 1) as the rounding kernels write them, against those at codes / scales
 * (the kept region): the number of bytes that differ */
static int64_t cmp_made_codes(df_gemm_kind kind, int op, const df_tensor *dy, const df_cuda_fp8_rows *kept)
{
    df_backend *g = gh_gpu;
    int bw = kind == DF_GEMM_BWD_W, mode = !bw ? 0 : op ? 1 : 3;
    int64_t R = dy->shape[0], C = dy->shape[1], rows = bw ? C : R, kp = ((bw ? R : C) + 127) / 128 * 128;
    int64_t nsc = mode == 3 ? (C + 127) / 128 * ((kp / 128 + 3) / 4 * 4) : kp / 128 * rows;
    uint8_t *q = df_backend_alloc(g, (size_t)(rows * kp));
    float *sc = df_backend_alloc(g, (size_t)nsc * 4);
    CHECK(q && sc && kept->kp == kp && kept->n == rows);
    CHECK_EQ(df_backend_zero(g, sc, (size_t)nsc * 4), 0);
    CHECK_EQ(df_cuda_fp8_round_codes(g, mode, dy, q, kp, sc, rows), 0);
    uint8_t *a = dl(g, q, (size_t)(rows * kp)), *b = dl(g, kept->codes, (size_t)(rows * kp));
    uint8_t *as = dl(g, sc, (size_t)nsc * 4), *bs = dl(g, kept->scales, (size_t)nsc * 4);
    int64_t bad = 0;
    for (int64_t i = 0; i < rows * kp; i++)
        bad += a[i] != b[i];
    for (int64_t i = 0; i < nsc * 4; i++)
        bad += as[i] != bs[i];
    free(a), free(b), free(as), free(bs);
    df_backend_free(g, q), df_backend_free(g, sc);
    return bad;
}

/* The k outputs o (n[i] elements) downloaded into got, and freed */
static void take_outputs(void **o, const int64_t *n, int k, float **got)
{
    for (int i = 0; i < k; i++) {
        got[i] = gh_download_bf16(gh_gpu, o[i], n[i]);
        df_backend_free(gh_gpu, o[i]);
    }
}

/* Elements whose bits differ */
static int64_t bits_differ(const float *a, const float *b, int64_t n)
{
    int64_t d = 0;
    for (int64_t j = 0; j < n; j++)
        d += memcmp(&a[j], &b[j], 4) != 0;
    return d;
}

/* DF_FP8_ONLY_CODES: an output's values were left out (left: elements unlike the plain run's)
 * exactly where a call that would read them failed (stale): never without sm_90, always on it
 * for aligned shapes */
static void check_left_out(int64_t left, int stale, int sm90, int aligned)
{
    CHECK((left > 0) == (stale == -EIO));
    CHECK(stale == 0 || stale == -EIO);
    if (!sm90)
        CHECK_EQ(stale, 0);
    else if (aligned)
        CHECK_EQ(stale, -EIO);
}

/* df_op_swiglu_bwd_fp8 + DF_FP8_MADE, the MLP's backward as the drafter runs it (gate and up
 * [R, F], their weights [F, H], x [R, H]): dgate / dup bitwise df_op_swiglu_bwd's (in place or
 * not), and the four GEMMs (dx = dg wg + du wu; dwg = dg^T x, dwu = du^T x with dy in 128 x 128
 * blocks and x held) bitwise those without the hints. Where the codes were kept (sm_90), they
 * are bitwise those the rounding kernels make from dgate / dup, padding and scales included,
 * and (aligned shapes) the four calls used them. */
static void check_swiglu_dy(int64_t R, int64_t F, int64_t H, int inplace, int sm90)
{
    df_backend *g = gh_gpu;
    float *gf = gh_rand_bf16(GH_N01, &rng, R * F, 2.0f), *uf = gh_rand_bf16(GH_N01, &rng, R * F, 1.0f);
    float *df = gh_rand_bf16(GH_N01, &rng, R * F, 0.05f), *xf = gh_rand_bf16(GH_N01, &rng, R * H, 1.0f);
    float *wgf = gh_rand_bf16(GH_N01, &rng, F * H, 0.05f), *wuf = gh_rand_bf16(GH_N01, &rng, F * H, 0.05f);
    void *gg = gh_dev_bf16(g, gf, R * F), *gu = gh_dev_bf16(g, uf, R * F), *gd = gh_dev_bf16(g, df, R * F);
    void *gx = gh_dev_bf16(g, xf, R * H), *gwg = gh_dev_bf16(g, wgf, F * H), *gwu = gh_dev_bf16(g, wuf, F * H);
    df_tensor Gg = df_tensor_2d(gg, DF_DTYPE_BF16, R, F), Gu = df_tensor_2d(gu, DF_DTYPE_BF16, R, F);
    df_tensor Gd = df_tensor_2d(gd, DF_DTYPE_BF16, R, F), X = df_tensor_2d(gx, DF_DTYPE_BF16, R, H);
    df_tensor Wg = df_tensor_2d(gwg, DF_DTYPE_BF16, F, H), Wu = df_tensor_2d(gwu, DF_DTYPE_BF16, F, H);
    const int64_t n[5] = {R * F, R * F, R * H, F * H, F * H}; /* dg, du, dx, dwg, dwu */
    float *got[3][5];
    int64_t reused0 = df_cuda_fp8_made_reused(), bad_codes = 0, kept = 0, stale = -1;
    for (int h = 0; h < 3; h++) { /* plain, hinted, hinted with DF_FP8_ONLY_CODES */
        void *o[5];
        for (int i = 0; i < 5; i++)
            o[i] = i < 2 && inplace ? gh_dev_bf16(g, i ? uf : gf, R * F) : gh_dev_poisoned(g, n[i], DF_DTYPE_BF16);
        df_tensor DG = df_tensor_2d(o[0], DF_DTYPE_BF16, R, F), DU = df_tensor_2d(o[1], DF_DTYPE_BF16, R, F);
        df_tensor DX = df_tensor_2d(o[2], DF_DTYPE_BF16, R, H);
        df_tensor DWG = df_tensor_2d(o[3], DF_DTYPE_BF16, F, H), DWU = df_tensor_2d(o[4], DF_DTYPE_BF16, F, H);
        const df_tensor *gi = inplace ? &DG : &Gg, *ui = inplace ? &DU : &Gu;
        unsigned sd = h ? DF_FP8_MADE : 0, only = h == 2 ? DF_FP8_ONLY_CODES : 0;
        /* DF_FP8_ONLY_CODES twice on the same tensors: the values are left out once every
         * region's call has taken codes of that geometry on the tensor cores */
        for (int rep = 0; rep < (only ? 2 : 1); rep++) {
            for (int i = 0; rep && i < 5; i++)
                if (i < 2 && inplace)
                    CHECK_EQ(df_backend_copy(g, o[i], i ? gu : gg, (size_t)(R * F) * 2), 0);
                else
                    gh_dev_poison(g, o[i], n[i], DF_DTYPE_BF16);
            if (h)
                CHECK_EQ(df_op_swiglu_bwd_fp8(g, gi, ui, &Gd, &DG, &DU, DF_FP8_DY_BLOCKS | only), 0);
            else
                CHECK_EQ(df_op_swiglu_bwd(g, gi, ui, &Gd, &DG, &DU), 0);
            if (rep) { /* a GEMM that would read dgate's values while its codes wait */
                df_tensor T = df_tensor_2d(o[2], DF_DTYPE_BF16, R, H);
                stale = df_op_matmul_fp8(g, DF_GEMM_BWD_X, &DG, &Wg, &T, 0);
            }
            CHECK_EQ(df_op_matmul_fp8(g, DF_GEMM_BWD_X, &DG, &Wg, &DX, sd), 0);
            CHECK_EQ(df_op_matmul_fp8(g, DF_GEMM_BWD_X, &DU, &Wu, &DX, DF_FP8_ACCUMULATE | sd), 0);
            CHECK_EQ(df_op_matmul_fp8(g, DF_GEMM_BWD_W, &DG, &X, &DWG, DF_FP8_DY_BLOCKS | DF_FP8_HOLD_X | sd), 0);
            CHECK_EQ(df_op_matmul_fp8(g, DF_GEMM_BWD_W, &DU, &X, &DWU, DF_FP8_DY_BLOCKS | DF_FP8_SAME_X | sd), 0);
        }
        for (int k = 0; h == 1 && k < 2; k++) /* the kept regions as written (a claim keeps the bytes) */
            for (int bw = 0; bw < 2; bw++) {
                df_cuda_fp8_rows r;
                df_gemm_kind kind = bw ? DF_GEMM_BWD_W : DF_GEMM_BWD_X;
                if (df_cuda_fp8_made_claim(g, 2 * k + bw, kind, 0, k ? &DU : &DG, 1, &r)) {
                    bad_codes += cmp_made_codes(kind, 0, k ? &DU : &DG, &r);
                    kept++;
                }
                df_cuda_fp8_made_ready(g, 2 * k + bw, 0);
            }
        take_outputs(o, n, 5, got[h]);
    }
    int64_t diff[5], diff_only[5];
    for (int i = 0; i < 5; i++)
        diff[i] = bits_differ(got[0][i], got[1][i], n[i]), diff_only[i] = bits_differ(got[0][i], got[2][i], n[i]);
    int64_t reused = df_cuda_fp8_made_reused() - reused0;
    printf("swiglu_bwd_fp8 %lldx%lld (H %lld)%s: differ from the unhinted dg %lld, du %lld, dx %lld, "
           "dwg %lld, dwu %lld; kept codes %lld of 4 regions, %lld bytes differ from the rounding "
           "kernels'; dy's codes reused by %lld calls; only codes: dx %lld, dwg %lld, dwu %lld differ, "
           "dg %lld unwritten, a GEMM on dg %d\n", (long long)R, (long long)F, (long long)H,
           inplace ? " in place" : "", (long long)diff[0], (long long)diff[1], (long long)diff[2],
           (long long)diff[3], (long long)diff[4], (long long)kept, (long long)bad_codes, (long long)reused,
           (long long)diff_only[2], (long long)diff_only[3], (long long)diff_only[4],
           (long long)diff_only[0], (int)stale);
    for (int i = 0; i < 5; i++)
        CHECK_EQ(diff[i], 0);
    for (int i = 2; i < 5; i++)
        CHECK_EQ(diff_only[i], 0);
    CHECK_EQ(bad_codes, 0);
    CHECK_EQ(kept, sm90 ? 4 : 0);
    if (sm90 && R % 128 == 0 && F % 128 == 0)
        CHECK_EQ(reused, 3 * 4);
    /* dgate's values left out: its poison, or gate's values in place, stay */
    check_left_out(diff_only[0], (int)stale, sm90, R % 128 == 0 && F % 128 == 0);
    for (int h = 0; h < 3; h++)
        for (int i = 0; i < 5; i++)
            free(got[h][i]);
    free(gf), free(uf), free(df), free(xf), free(wgf), free(wuf);
    df_backend_free(g, gg), df_backend_free(g, gu), df_backend_free(g, gd), df_backend_free(g, gx);
    df_backend_free(g, gwg), df_backend_free(g, gwu);
}

/* df_op_swiglu_fp8 + DF_FP8_MADE, the down projection as the drafter runs it (gate and up
 * [R, F], its weight [H, F], dy [R, H]): y bitwise df_op_swiglu's; y = m wd^T (FWD) and
 * dwd = dy^T m (BWD_W, dy in 128 x 128 blocks) bitwise those without the hint. Where the codes
 * were kept (sm_90) they are bitwise the rounding kernels' (modes 0 and 1), and (aligned
 * shapes) the calls used them, once: a second call with the hint rounds m itself. */
static void check_swiglu_x(int64_t R, int64_t F, int64_t H, int sm90)
{
    df_backend *g = gh_gpu;
    float *gf = gh_rand_bf16(GH_N01, &rng, R * F, 2.0f), *uf = gh_rand_bf16(GH_N01, &rng, R * F, 1.0f);
    float *wf = gh_rand_bf16(GH_N01, &rng, H * F, 0.05f), *dyf = gh_rand_bf16(GH_N01, &rng, R * H, 0.1f);
    void *gg = gh_dev_bf16(g, gf, R * F), *gu = gh_dev_bf16(g, uf, R * F);
    void *gw = gh_dev_bf16(g, wf, H * F), *gdy = gh_dev_bf16(g, dyf, R * H);
    df_tensor Gg = df_tensor_2d(gg, DF_DTYPE_BF16, R, F), Gu = df_tensor_2d(gu, DF_DTYPE_BF16, R, F);
    df_tensor Wd = df_tensor_2d(gw, DF_DTYPE_BF16, H, F), DY = df_tensor_2d(gdy, DF_DTYPE_BF16, R, H);
    const int64_t n[4] = {R * F, R * H, H * F, R * H}; /* m, y, dwd, y again (the hint used up) */
    float *got[3][4];
    int64_t reused0 = df_cuda_fp8_made_reused(), bad_codes = 0, kept = 0, stale = -1;
    for (int h = 0; h < 3; h++) { /* plain, hinted, hinted with DF_FP8_ONLY_CODES */
        void *o[4];
        for (int i = 0; i < 4; i++)
            o[i] = gh_dev_poisoned(g, n[i], DF_DTYPE_BF16);
        df_tensor Mt = df_tensor_2d(o[0], DF_DTYPE_BF16, R, F), Y = df_tensor_2d(o[1], DF_DTYPE_BF16, R, H);
        df_tensor DW = df_tensor_2d(o[2], DF_DTYPE_BF16, H, F), Y2 = df_tensor_2d(o[3], DF_DTYPE_BF16, R, H);
        unsigned md = h ? DF_FP8_MADE : 0, only = h == 2 ? DF_FP8_ONLY_CODES : 0;
        if (h)
            CHECK_EQ(df_op_swiglu_fp8(g, &Gg, &Gu, &Mt, DF_FP8_X_FWD | DF_FP8_X_BWD_W | only), 0);
        else
            CHECK_EQ(df_op_swiglu(g, &Gg, &Gu, &Mt), 0);
        for (int k = 0; h == 1 && k < 2; k++) { /* the kept regions as written (a claim keeps the bytes) */
            df_cuda_fp8_rows r;
            df_gemm_kind kind = k ? DF_GEMM_BWD_W : DF_GEMM_FWD;
            if (df_cuda_fp8_made_claim(g, 4 + k, kind, k, &Mt, 0, &r)) {
                bad_codes += cmp_made_codes(kind, k, &Mt, &r);
                kept++;
            }
        }
        if (h == 1) /* the claims above left the slots unready: made again for the GEMMs */
            CHECK_EQ(df_op_swiglu_fp8(g, &Gg, &Gu, &Mt, DF_FP8_X_FWD | DF_FP8_X_BWD_W), 0);
        /* DF_FP8_ONLY_CODES twice on the same tensors (the first run proves the regions) */
        for (int rep = 0; rep < (only ? 2 : 1); rep++) {
            if (rep) {
                for (int i = 0; i < 4; i++)
                    gh_dev_poison(g, o[i], n[i], DF_DTYPE_BF16);
                CHECK_EQ(df_op_swiglu_fp8(g, &Gg, &Gu, &Mt, DF_FP8_X_FWD | DF_FP8_X_BWD_W | only), 0);
            }
            CHECK_EQ(df_op_matmul_fp8(g, DF_GEMM_FWD, &Mt, &Wd, &Y, md), 0);
            if (rep) /* a second FWD while BWD_W's codes wait: it would read m's values */
                stale = df_op_matmul_fp8(g, DF_GEMM_FWD, &Mt, &Wd, &Y2, md);
            CHECK_EQ(df_op_matmul_fp8(g, DF_GEMM_BWD_W, &DY, &Mt, &DW, DF_FP8_DY_BLOCKS | md), 0);
            if (!only)
                CHECK_EQ(df_op_matmul_fp8(g, DF_GEMM_FWD, &Mt, &Wd, &Y2, md), 0);
        }
        take_outputs(o, n, 4, got[h]);
    }
    int64_t diff[4], diff_only[4];
    for (int i = 0; i < 4; i++)
        diff[i] = bits_differ(got[0][i], got[1][i], n[i]), diff_only[i] = bits_differ(got[0][i], got[2][i], n[i]);
    int64_t reused = df_cuda_fp8_made_reused() - reused0;
    printf("swiglu_fp8 %lldx%lld (H %lld): differ from the unhinted m %lld, y %lld, dwd %lld, y again %lld; "
           "kept codes %lld of 2 regions, %lld bytes differ from the rounding kernels'; m's codes "
           "reused by %lld calls; only codes: y %lld, dwd %lld differ, m %lld unwritten, a second "
           "FWD %d\n", (long long)R, (long long)F, (long long)H, (long long)diff[0],
           (long long)diff[1], (long long)diff[2], (long long)diff[3], (long long)kept,
           (long long)bad_codes, (long long)reused, (long long)diff_only[1], (long long)diff_only[2],
           (long long)diff_only[0], (int)stale);
    for (int i = 0; i < 4; i++)
        CHECK_EQ(diff[i], 0);
    CHECK_EQ(diff_only[1], 0);
    CHECK_EQ(diff_only[2], 0);
    CHECK_EQ(bad_codes, 0);
    CHECK_EQ(kept, sm90 ? 2 : 0);
    if (sm90 && R % 128 == 0 && F % 128 == 0)
        CHECK_EQ(reused, 3 * 2);
    check_left_out(diff_only[0], (int)stale, sm90, R % 128 == 0 && F % 128 == 0);
    for (int h = 0; h < 3; h++)
        for (int i = 0; i < 4; i++)
            free(got[h][i]);
    free(gf), free(uf), free(wf), free(dyf);
    df_backend_free(g, gg), df_backend_free(g, gu), df_backend_free(g, gw), df_backend_free(g, gdy);
}

/* df_op_rmsnorm_fp8 + DF_FP8_MADE, a norm before three projections as the drafter runs it (x
 * [R, H], weights wi [Oi, H], dyi [R, Oi]; sm90: the codes are to be kept, 0 where they are
 * not: another GPU, DFLASH_FP8_RMSNORM=0): y bitwise df_op_rmsnorm's; the forward GEMMs
 * (y wi^T, x held) and the weight gradients (dyi^T y, dy in 128 x 128 blocks) bitwise those
 * without the hint. Where the codes were kept (sm_90, H a multiple of 128) they are bitwise the
 * rounding kernels' (modes 0 and 1), and (aligned shapes) the six calls used them. Under
 * DF_FP8_ONLY_CODES: the same GEMM bits with y left out once proven, and a GEMM that would read
 * y while its codes wait fails with -EIO. */
static void check_rmsnorm_x(int64_t R, int64_t H, int sm90)
{
    df_backend *g = gh_gpu;
    const int64_t O[3] = {256, 128, 384};
    float *xf = gh_rand_bf16(GH_N01, &rng, R * H, 3.0f), *wf = gh_rand_bf16(GH_N01, &rng, H, 1.0f);
    void *gx = gh_dev_bf16(g, xf, R * H), *gw = gh_dev_bf16(g, wf, H);
    df_tensor X = df_tensor_2d(gx, DF_DTYPE_BF16, R, H), Wn = df_tensor_1d(gw, DF_DTYPE_BF16, H);
    df_tensor Wp[3], DY[3];
    void *gwp[3], *gdy[3];
    float *hw[3], *hdy[3];
    for (int i = 0; i < 3; i++) {
        hw[i] = gh_rand_bf16(GH_N01, &rng, O[i] * H, 0.05f), hdy[i] = gh_rand_bf16(GH_N01, &rng, R * O[i], 0.1f);
        gwp[i] = gh_dev_bf16(g, hw[i], O[i] * H), gdy[i] = gh_dev_bf16(g, hdy[i], R * O[i]);
        Wp[i] = df_tensor_2d(gwp[i], DF_DTYPE_BF16, O[i], H), DY[i] = df_tensor_2d(gdy[i], DF_DTYPE_BF16, R, O[i]);
    }
    /* outputs: y, the three forwards, the three weight gradients */
    int64_t n[7] = {R * H};
    for (int i = 0; i < 3; i++)
        n[1 + i] = R * O[i], n[4 + i] = O[i] * H;
    float *got[3][7];
    const int aligned = sm90 && H % 128 == 0 && R % 128 == 0;
    int64_t reused0 = df_cuda_fp8_made_reused(), bad_codes = 0, kept = 0, stale = -1;
    for (int h = 0; h < 3; h++) { /* plain, hinted, hinted with DF_FP8_ONLY_CODES */
        void *o[7];
        for (int i = 0; i < 7; i++)
            o[i] = gh_dev_poisoned(g, n[i], DF_DTYPE_BF16);
        df_tensor Y = df_tensor_2d(o[0], DF_DTYPE_BF16, R, H), C[3], DW[3];
        for (int i = 0; i < 3; i++)
            C[i] = df_tensor_2d(o[1 + i], DF_DTYPE_BF16, R, O[i]),
            DW[i] = df_tensor_2d(o[4 + i], DF_DTYPE_BF16, O[i], H);
        unsigned md = h ? DF_FP8_MADE : 0, only = h == 2 ? DF_FP8_ONLY_CODES : 0;
        if (h == 1 && sm90) { /* the kept regions as written (a claim keeps the bytes) */
            CHECK_EQ(df_op_rmsnorm_fp8(g, &X, &Wn, 1e-6f, &Y, 3, DF_FP8_X_FWD | DF_FP8_X_BWD_W), 0);
            for (int k = 0; k < 2; k++) {
                df_cuda_fp8_rows r;
                df_gemm_kind kind = k ? DF_GEMM_BWD_W : DF_GEMM_FWD;
                if (df_cuda_fp8_made_claim(g, 6 + k, kind, k, &Y, 0, &r)) {
                    bad_codes += cmp_made_codes(kind, k, &Y, &r);
                    kept++;
                }
                df_cuda_fp8_made_ready(g, 6 + k, 0);
            }
        }
        /* DF_FP8_ONLY_CODES twice (the first run proves the regions); the forward's uses and
         * the weight gradients' in two calls, as the trainer makes them */
        for (int rep = 0; rep < (only ? 2 : 1); rep++) {
            if (rep)
                for (int i = 0; i < 7; i++)
                    gh_dev_poison(g, o[i], n[i], DF_DTYPE_BF16);
            if (h)
                CHECK_EQ(df_op_rmsnorm_fp8(g, &X, &Wn, 1e-6f, &Y, 3, DF_FP8_X_FWD | only), 0);
            else
                CHECK_EQ(df_op_rmsnorm(g, &X, &Wn, 1e-6f, 0, &Y), 0);
            if (rep) { /* a GEMM that would read y's values while its codes wait */
                df_tensor T = df_tensor_2d(o[1], DF_DTYPE_BF16, R, O[0]);
                stale = df_op_matmul_fp8(g, DF_GEMM_FWD, &Y, &Wp[0], &T, 0);
            }
            for (int i = 0; i < 3; i++)
                CHECK_EQ(df_op_matmul_fp8(g, DF_GEMM_FWD, &Y, &Wp[i], &C[i],
                                          (i ? DF_FP8_SAME_X : DF_FP8_HOLD_X) | md), 0);
            if (h)
                CHECK_EQ(df_op_rmsnorm_fp8(g, &X, &Wn, 1e-6f, &Y, 3, DF_FP8_X_BWD_W | only), 0);
            for (int i = 0; i < 3; i++)
                CHECK_EQ(df_op_matmul_fp8(g, DF_GEMM_BWD_W, &DY[i], &Y, &DW[i],
                                          DF_FP8_DY_BLOCKS | (i ? DF_FP8_SAME_X : DF_FP8_HOLD_X) | md), 0);
        }
        take_outputs(o, n, 7, got[h]);
    }
    int64_t diff[7], diff_only[7];
    for (int i = 0; i < 7; i++)
        diff[i] = bits_differ(got[0][i], got[1][i], n[i]), diff_only[i] = bits_differ(got[0][i], got[2][i], n[i]);
    int64_t reused = df_cuda_fp8_made_reused() - reused0;
    printf("rmsnorm_fp8 %lldx%lld: differ from the unhinted y %lld, forwards %lld %lld %lld, dw %lld %lld %lld; "
           "kept codes %lld of 2 regions, %lld bytes differ from the rounding kernels'; y's codes reused "
           "by %lld calls; only codes: forwards %lld %lld %lld, dw %lld %lld %lld differ, y %lld unwritten, "
           "a GEMM on y %d\n", (long long)R, (long long)H, (long long)diff[0], (long long)diff[1],
           (long long)diff[2], (long long)diff[3], (long long)diff[4], (long long)diff[5], (long long)diff[6],
           (long long)kept, (long long)bad_codes, (long long)reused, (long long)diff_only[1],
           (long long)diff_only[2], (long long)diff_only[3], (long long)diff_only[4], (long long)diff_only[5],
           (long long)diff_only[6], (long long)diff_only[0], (int)stale);
    for (int i = 0; i < 7; i++)
        CHECK_EQ(diff[i], 0);
    for (int i = 1; i < 7; i++)
        CHECK_EQ(diff_only[i], 0);
    CHECK_EQ(bad_codes, 0);
    CHECK_EQ(kept, sm90 && H % 128 == 0 ? 2 : 0);
    /* hinted: 6 calls; only codes: 6 + 6 (the stale call takes nothing) */
    if (aligned)
        CHECK_EQ(reused, 6 * 3);
    if (!sm90 || H % 128) /* (sm90 0: not sm_90, or the knob off) */
        CHECK_EQ(reused, 0);
    check_left_out(diff_only[0], (int)stale, sm90 && H % 128 == 0, aligned);
    for (int h = 0; h < 3; h++)
        for (int i = 0; i < 7; i++)
            free(got[h][i]);
    for (int i = 0; i < 3; i++) {
        free(hw[i]), free(hdy[i]);
        df_backend_free(g, gwp[i]), df_backend_free(g, gdy[i]);
    }
    free(xf), free(wf);
    df_backend_free(g, gx), df_backend_free(g, gw);
}

/* df_op_fp8_dy_codes + DF_FP8_MADE, a projection's backward as the drafter runs it (dy [R, C],
 * its weight w [C, H], its input x [R, H]): dx = dy w and dw = dy^T x (dy in 128 x 128 blocks)
 * bitwise those without the hint, in either order; where the codes were kept (sm_90) they are
 * bitwise the rounding kernels' (modes 0 and 3, padding and scales included) and (rows of 4)
 * both calls used them; sm90 0 (another GPU, DFLASH_FP8_DY_CODES=0): nothing is kept. */
static void check_dy_codes(int64_t R, int64_t C, int64_t H, int sm90)
{
    df_backend *g = gh_gpu;
    float *dyf = gh_rand_bf16(GH_N01, &rng, R * C, 0.1f), *wf = gh_rand_bf16(GH_N01, &rng, C * H, 0.05f);
    float *xf = gh_rand_bf16(GH_N01, &rng, R * H, 1.0f);
    void *gdy = gh_dev_bf16(g, dyf, R * C), *gw = gh_dev_bf16(g, wf, C * H), *gx = gh_dev_bf16(g, xf, R * H);
    df_tensor DY = df_tensor_2d(gdy, DF_DTYPE_BF16, R, C), Wt = df_tensor_2d(gw, DF_DTYPE_BF16, C, H);
    df_tensor X = df_tensor_2d(gx, DF_DTYPE_BF16, R, H);
    const int64_t n[2] = {R * H, C * H}; /* dx, dw */
    float *got[3][2];
    int64_t reused0 = df_cuda_fp8_made_reused(), bad_codes = 0, kept = 0;
    for (int h = 0; h < 3; h++) { /* plain; hinted, dx first; hinted, dw first */
        void *o[2] = {gh_dev_poisoned(g, n[0], DF_DTYPE_BF16), gh_dev_poisoned(g, n[1], DF_DTYPE_BF16)};
        df_tensor DX = df_tensor_2d(o[0], DF_DTYPE_BF16, R, H), DW = df_tensor_2d(o[1], DF_DTYPE_BF16, C, H);
        unsigned md = h ? DF_FP8_MADE : 0;
        if (h == 1 && sm90) { /* the kept regions as written (a claim keeps the bytes) */
            CHECK_EQ(df_op_fp8_dy_codes(g, &DY, DF_FP8_DY_BLOCKS), 0);
            for (int k = 0; k < 2; k++) {
                df_cuda_fp8_rows r;
                df_gemm_kind kind = k ? DF_GEMM_BWD_W : DF_GEMM_BWD_X;
                if (df_cuda_fp8_made_claim(g, 8 + k, kind, 0, &DY, 1, &r)) {
                    bad_codes += cmp_made_codes(kind, 0, &DY, &r);
                    kept++;
                }
                df_cuda_fp8_made_ready(g, 8 + k, 0);
            }
        }
        if (h)
            CHECK_EQ(df_op_fp8_dy_codes(g, &DY, DF_FP8_DY_BLOCKS), 0);
        for (int k = 0; k < 2; k++)
            if ((k == 0) == (h != 2))
                CHECK_EQ(df_op_matmul_fp8(g, DF_GEMM_BWD_X, &DY, &Wt, &DX, md), 0);
            else
                CHECK_EQ(df_op_matmul_fp8(g, DF_GEMM_BWD_W, &DY, &X, &DW, DF_FP8_DY_BLOCKS | md), 0);
        take_outputs(o, n, 2, got[h]);
    }
    int64_t reused = df_cuda_fp8_made_reused() - reused0;
    int64_t diff[2][2];
    for (int h = 1; h < 3; h++)
        for (int i = 0; i < 2; i++)
            diff[h - 1][i] = bits_differ(got[0][i], got[h][i], n[i]);
    printf("fp8_dy_codes %lldx%lld (H %lld): differ from the unhinted dx %lld, dw %lld (dw first: %lld, %lld); "
           "kept codes %lld of 2 regions, %lld bytes differ from the rounding kernels'; dy's codes reused "
           "by %lld calls\n", (long long)R, (long long)C, (long long)H, (long long)diff[0][0],
           (long long)diff[0][1], (long long)diff[1][0], (long long)diff[1][1], (long long)kept,
           (long long)bad_codes, (long long)reused);
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 2; i++)
            CHECK_EQ(diff[h][i], 0);
    CHECK_EQ(bad_codes, 0);
    CHECK_EQ(kept, sm90 ? 2 : 0);
    if (sm90 && R % 4 == 0)
        CHECK_EQ(reused, 2 * 2);
    if (!sm90)
        CHECK_EQ(reused, 0);
    for (int h = 0; h < 3; h++)
        for (int i = 0; i < 2; i++)
            free(got[h][i]);
    free(dyf), free(wf), free(xf);
    df_backend_free(g, gdy), df_backend_free(g, gw), df_backend_free(g, gx);
}

int main(void)
{
    int rc = gh_open(0);
    if (rc)
        return rc;
    df_cuda_device_info info;
    int sm90 = df_cuda_device_info_get(0, &info) == 0 && info.sm_major == 9;
    /* SwiGLU's backward writing the gate / up GEMMs' dy codes: edges (rows and columns not
     * multiples of 128, rows not of 4: those GEMMs round dy), in place, and aligned; the BF16
     * path keeps nothing */
    check_swiglu_dy(300, 333, 256, 0, sm90);
    check_swiglu_dy(37, 200, 128, 1, sm90);
    check_swiglu_dy(1024, 1280, 512, 1, sm90);
    df_knob_set(DF_KNOB_FP8_GEMM, "0");
    check_swiglu_dy(256, 384, 128, 0, 0);
    check_swiglu_x(256, 384, 128, 0);
    df_knob_set(DF_KNOB_FP8_GEMM, "1");
    check_swiglu_x(300, 333, 256, sm90);
    check_swiglu_x(1024, 1280, 512, sm90);
    /* RMSNorm writing its projections' x codes: aligned, rows not of 128 (nor of 4: the forward
     * GEMMs round y themselves), a width the row kernel does not take (the plain norm) */
    df_knob_set(DF_KNOB_FP8_RMSNORM, "1");
    check_rmsnorm_x(1024, 640, sm90);
    check_rmsnorm_x(1024, 5120, sm90);
    check_rmsnorm_x(300, 384, sm90);
    check_rmsnorm_x(37, 256, sm90);
    check_rmsnorm_x(256, 200, 0);
    df_knob_set(DF_KNOB_FP8_RMSNORM, "0");
    check_rmsnorm_x(256, 384, 0);
    /* a projection's dy rounded once for its two backward GEMMs: aligned, edges (rows and
     * columns not multiples of 128, rows not of 4), off */
    df_knob_set(DF_KNOB_FP8_DY_CODES, "1");
    check_dy_codes(1024, 640, 512, sm90);
    check_dy_codes(8192, 1024, 5120, sm90);
    check_dy_codes(300, 200, 256, sm90);
    check_dy_codes(37, 384, 128, sm90);
    df_knob_set(DF_KNOB_FP8_DY_CODES, "0");
    check_dy_codes(256, 384, 128, 0);
    gh_close();
    return test_main_end();
}
