/* test_gpu_train_dense - the CUDA dense training ops (kernels/cuda/
 * train_dense.cu: RMSNorm / RoPE / SwiGLU backward, AdamW, sum of squares)
 * against the CPU reference. The dispatch table does not point at them yet,
 * so the GPU side calls df_cuda_* directly (cuda/train_cuda.h) on BF16 / F32
 * device tensors, with arguments the dispatch would accept; the CPU side
 * runs df_op_* on the CPU backend with F32 copies of the same bf16-rounded
 * values. Skips (77) without a GPU.
 *
 * Inputs are random, never zero (|x| >= 0.05), rounded to bf16; GPU outputs
 * that are not also inputs are NaN-poisoned first (bf16 0x7fc0); every
 * element outside an output view must come back bit for bit as uploaded.
 * Tolerances:
 *  - bf16 outputs (dx, dgate, dup, RoPE's dx), KERNELS.md's rule:
 *      max|gpu - ref| <= 2 max|round_bf16(ref) - ref| + 1e-6 max|ref|.
 *  - RMSNorm's dw (F32, accumulated): both sides sum the same products in
 *    fp32, in different orders (and the GPU's 1/rms may differ by a few
 *    ulps), so elementwise |gpu - ref| <= 1e-5 (|dw0| + sum_rows |dy xhat|).
 *  - AdamW (F32): the same operations in the same order, FMA forbidden on
 *    the GPU, so the bits should match; allowed: 1e-6 times the sum of the
 *    magnitudes of the terms of each update (printed: how many match
 *    exactly). out_bf16 must be exactly RNE(GPU master).
 *  - sumsq (double): squares of floats are exact in double, only the n - 1
 *    additions round in some order: |gpu - ref| <= 2 n 2^-53 ref; exact for
 *    n <= 1.
 * BF16 weight gradients (the trainer may keep its gradient array in bf16):
 *  - RMSNorm with a BF16 dw: the GPU run with an F32 dw holding the same
 *    (widened) old values computes the same partials in the same order, so
 *    dx must match it bit for bit and each bf16 dw element must be exactly
 *    RNE of the f32 one. Against the CPU's BF16 dw: each side rounds its
 *    fp32 value once; where the F32 rule's bound (1e-5 sum|terms|) is below
 *    half a bf16 ulp they are at most 1 bf16 ulp apart (the summation order
 *    can flip one rounding), elsewhere (sums that cancel) within that bound
 *    plus half an ulp of each.
 *  - AdamW and sumsq with BF16 gradients: bit for bit what the GPU gives
 *    for F32 gradients of the same values (a bf16 widens exactly; the
 *    arithmetic and the order are the same), for the vector and the scalar
 *    paths; against the CPU (run with the same BF16 gradients), the F32
 *    rules above.
 * Determinism: dw and sumsq run twice on the same inputs, bitwise equal;
 * and the same logical data laid out aligned (vector path) and misaligned
 * (scalar path) gives the same bits (the summation orders depend on the
 * shapes alone). RMSNorm's backward runs its one-pass path wherever it
 * fits (df_cuda_rmsnorm_bwd_set_impl: whatever DFLASH_RMSNORM_BWD says;
 * each case checks which path ran) and, on the same inputs, the two-pass
 * one: dx and dw bitwise equal. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_internal.h"
#include "cuda/device.h"
#include "cuda/train_cuda.h"
#include "gpu_harness.h"
#include "ops.h"
#include "train_ops.h"
#include "uf16.h"

static uint64_t rng = 0x7a11de45e5ull;

static int sync_ok(void) { return df_backend_sync(gh_gpu) == 0; }

/* ---- RMSNorm backward ---- */

enum { DX_NONE, DX_OWN, DX_IS_DY, DX_IS_X };

typedef struct nbwd_out {
    float *dw;      /* [D] the GPU's dw */
    uint16_t *dx;   /* the GPU's dx, the view's elements in row-major order (or NULL) */
} nbwd_out;

/* mag[i] += sum over the R rows of |dy xhat| at column i (xhat from a
 * double 1/rms): the magnitude RMSNorm's dw error bounds scale with. o: the
 * view's element offsets, row-major [R][D]. */
static void add_dw_terms(double *mag, const gh_buf *x, const gh_buf *dy, const int64_t *o,
                         int64_t R, int64_t D, float eps)
{
    for (int64_t r = 0; r < R; r++) {
        double ss = 0;
        for (int64_t i = 0; i < D; i++)
            ss += (double)x->h[o[r * D + i]] * x->h[o[r * D + i]];
        double inv = 1.0 / sqrt(ss / (double)D + eps);
        for (int64_t i = 0; i < D; i++)
            mag[i] += fabs((double)dy->h[o[r * D + i]] * x->h[o[r * D + i]] * inv);
    }
}

/* x, dy, dx share the view's shape; x and dy in v, dx in its own buffer at
 * v's layout (DX_OWN), or dy's / x's very view. seed fixes the logical data
 * (independent of the layout). Returns the GPU results for cross-layout
 * comparisons (caller frees). */
/* want: the path the call must take (test_rmsnorm_bwd asks for the
 * one-pass one where it fits; ONE or TWO). */
enum { ONE = DF_CUDA_RMSNORM_BWD_ONEPASS, TWO = DF_CUDA_RMSNORM_BWD_TWOPASS };

static nbwd_out nbwd_case(const char *name, gh_view v, int plus_one, int dxm, int acc,
                          uint64_t seed, int want)
{
    const int64_t D = v.shape[v.ndim - 1];
    const float eps = 1e-6f;
    gh_buf x = gh_buf_rand_view(v, GH_N01_NZ, &rng, seed, 1.5f);
    gh_buf dy = gh_buf_rand_view(v, GH_N01_NZ, &rng, seed + 1, 1.0f), dxb;
    memset(&dxb, 0, sizeof dxb);
    gh_buf w = gh_buf_rand(D, 0, GH_N01_NZ, &rng, 0.5f);
    gh_buf dw = gh_buf_rand(D, 1, GH_N01_NZ, &rng, 3.0f);
    uint64_t sw = seed + 3, sd = seed + 4; /* w and dw0 by the seed too */
    for (int64_t i = 0; i < D; i++) {
        gh_buf_set(&w, i, gh_draw(GH_N01_NZ, &sw, 0.5f));
        gh_buf_set(&dw, i, gh_draw(GH_N01_NZ, &sd, 3.0f));
    }
    if (dxm == DX_OWN) {
        dxb = gh_buf_rand_view(v, GH_N01_NZ, &rng, seed + 2, 1.0f);
        if (!acc)
            gh_poison(&dxb, v);
    }
    gh_buf *pdx = dxm == DX_OWN ? &dxb : dxm == DX_IS_DY ? &dy : dxm == DX_IS_X ? &x : NULL;

    /* dw's bound: |dw0| + sum_rows |dy xhat|, xhat from double 1/rms */
    int64_t n, *o = gh_view_offsets(v, &n);
    const int64_t R = n / D;
    double *mag = gh_xmalloc((size_t)D * sizeof *mag);
    for (int64_t i = 0; i < D; i++)
        mag[i] = fabs(dw.h[i]);
    add_dw_terms(mag, &x, &dy, o, R, D, eps);

    gh_buf_upload(&x);
    gh_buf_upload(&dy);
    gh_buf_upload(&w);
    gh_buf_upload(&dw);
    if (dxm == DX_OWN)
        gh_buf_upload(&dxb);
    df_tensor xg = gh_tens(&x, v, 1), dyg = gh_tens(&dy, v, 1);
    df_tensor wg = df_tensor_1d(w.d, DF_DTYPE_BF16, D), dwg = df_tensor_1d(dw.d, DF_DTYPE_F32, D);
    df_tensor dxg, dxc;
    memset(&dxg, 0, sizeof dxg);
    memset(&dxc, 0, sizeof dxc);
    if (pdx)
        dxg = gh_tens(pdx, v, 1);
    CHECK_EQ(df_cuda_rmsnorm_bwd(gh_gpu, &xg, &wg, eps, plus_one, &dyg, pdx ? &dxg : NULL, acc,
                                 &dwg),
             0);
    CHECK(sync_ok());
    const int took = df_cuda_rmsnorm_bwd_last_impl();
    CHECK_EQ(took, want);
    float *dw1 = gh_buf_download(&dw);
    uint16_t *dx1 = pdx ? gh_buf_download(pdx) : NULL;

    /* the two-pass path on the same inputs: the same bits (the one-pass
     * kernel keeps its row sums, streams and formulas); then the default
     * path again, whose dx is the one checked against the CPU below */
    gh_buf_upload(&x);
    gh_buf_upload(&dy);
    gh_buf_upload(&dw);
    if (dxm == DX_OWN)
        gh_buf_upload(&dxb);
    CHECK_EQ(df_cuda_rmsnorm_bwd_set_impl(TWO), 0);
    CHECK_EQ(df_cuda_rmsnorm_bwd(gh_gpu, &xg, &wg, eps, plus_one, &dyg, pdx ? &dxg : NULL, acc,
                                 &dwg),
             0);
    CHECK(sync_ok());
    CHECK_EQ(df_cuda_rmsnorm_bwd_last_impl(), TWO);
    CHECK_EQ(df_cuda_rmsnorm_bwd_set_impl(ONE), 0);
    float *dw3 = gh_buf_download(&dw);
    uint16_t *dx3 = pdx ? gh_buf_download(pdx) : NULL;
    int same2 = !memcmp(dw1, dw3, (size_t)D * 4) &&
                (!pdx || !memcmp(dx1, dx3, (size_t)pdx->n * 2));

    /* again, on the same inputs: the same bits */
    gh_buf_upload(&x);
    gh_buf_upload(&dy);
    gh_buf_upload(&dw);
    if (dxm == DX_OWN)
        gh_buf_upload(&dxb);
    CHECK_EQ(df_cuda_rmsnorm_bwd(gh_gpu, &xg, &wg, eps, plus_one, &dyg, pdx ? &dxg : NULL, acc,
                                 &dwg),
             0);
    CHECK(sync_ok());
    float *dw2 = gh_buf_download(&dw);
    uint16_t *dx2 = pdx ? gh_buf_download(pdx) : NULL;
    int same = !memcmp(dw1, dw2, (size_t)D * 4) &&
               (!pdx || !memcmp(dx1, dx2, (size_t)pdx->n * 2));

    /* the CPU reference, on the host copies (dx aliasing as on the GPU) */
    df_tensor xc = gh_tens(&x, v, 0), dyc = gh_tens(&dy, v, 0);
    df_tensor wc = df_tensor_1d(w.h, DF_DTYPE_F32, D), dwc = df_tensor_1d(dw.h, DF_DTYPE_F32, D);
    if (pdx)
        dxc = gh_tens(pdx, v, 0);
    CHECK_EQ(df_op_rmsnorm_bwd(gh_cpu, &xc, &wc, eps, plus_one, &dyc, pdx ? &dxc : NULL, acc, &dwc),
             0);

    char nm[160];
    if (pdx) {
        snprintf(nm, sizeof nm, "  %s dx", name);
        gh_check_view(nm, pdx, v, NULL);
    }
    int64_t bad = 0;
    double worst = 0;
    for (int64_t i = 0; i < D; i++) {
        double d = fabs((double)dw1[i] - dw.h[i]);
        bad += !(d <= 1e-5 * mag[i]);
        worst = fmax(worst, d / mag[i]);
    }
    printf("  %-50s err / sum|terms| %.2e (<= 1e-5)  rerun %s  %s-pass%s  %s\n", "  dw", worst,
           same ? "bitwise equal" : "DIFFERS", took == ONE ? "one" : "two",
           took == ONE ? (same2 ? " == two-pass" : " != two-pass") : "",
           bad || !same || !same2 || took != want ? "FAIL" : "ok");
    CHECK_EQ(bad, 0);
    CHECK(same);
    CHECK(same2);

    nbwd_out r = {dw1, NULL};
    if (pdx) {
        r.dx = gh_xmalloc((size_t)n * 2);
        for (int64_t i = 0; i < n; i++)
            r.dx[i] = dx1[o[i]];
    }
    free(dx1), free(dw2), free(dx2), free(dw3), free(dx3), free(mag), free(o);
    gh_buf_free(&x), gh_buf_free(&dy), gh_buf_free(&w), gh_buf_free(&dw);
    if (dxm == DX_OWN)
        gh_buf_free(&dxb);
    return r;
}

static void nbwd_run(const char *name, gh_view v, int plus_one, int dxm, int acc, int want)
{
    nbwd_out r = nbwd_case(name, v, plus_one, dxm, acc, test_rand(&rng), want);
    free(r.dw);
    free(r.dx);
}

/* One logical problem (one seed) in an aligned layout (16-byte vectors)
 * and a misaligned one (scalar loads): dw and dx must agree bit for bit. */
static void nbwd_layouts(const char *name, gh_view a, gh_view b, int plus_one, int dxm, int acc)
{
    uint64_t seed = test_rand(&rng);
    nbwd_out ra = nbwd_case(name, a, plus_one, dxm, acc, seed, ONE);
    nbwd_out rb_ = nbwd_case(name, b, plus_one, dxm, acc, seed, TWO);
    int64_t D = a.shape[a.ndim - 1], n = gh_view_count(a);
    int same = !memcmp(ra.dw, rb_.dw, (size_t)D * 4) &&
               (!ra.dx || !memcmp(ra.dx, rb_.dx, (size_t)n * 2));
    printf("  %-50s %s\n", "aligned vs misaligned layout: dw, dx",
           same ? "bitwise equal  ok" : "DIFFER  FAIL");
    CHECK(same);
    free(ra.dw), free(ra.dx), free(rb_.dw), free(rb_.dx);
}

/* ---- RMSNorm backward, BF16 dw ---- */

static void nbwd_bf16_case(const char *name, gh_view v, int plus_one, int dxm, int acc, int want)
{
    const uint64_t seed = test_rand(&rng);
    const int64_t D = v.shape[v.ndim - 1];
    const float eps = 1e-6f;
    gh_buf x = gh_buf_rand_view(v, GH_N01_NZ, &rng, seed, 1.5f);
    gh_buf dy = gh_buf_rand_view(v, GH_N01_NZ, &rng, seed + 1, 1.0f), dxb;
    memset(&dxb, 0, sizeof dxb);
    gh_buf w = gh_buf_rand(D, 0, GH_N01_NZ, &rng, 0.5f);
    /* BF16 dw; F32, the same values */
    gh_buf dwb = gh_buf_rand(D, 0, GH_N01_NZ, &rng, 3.0f);
    gh_buf dwf = gh_buf_rand(D, 1, GH_N01_NZ, &rng, 1.0f);
    for (int64_t i = 0; i < D; i++)
        gh_buf_set(&dwf, i, dwb.h[i]);
    if (dxm == DX_OWN) {
        dxb = gh_buf_rand_view(v, GH_N01_NZ, &rng, seed + 2, 1.0f);
        if (!acc)
            gh_poison(&dxb, v);
    }
    gh_buf *pdx = dxm == DX_OWN ? &dxb : dxm == DX_IS_DY ? &dy : dxm == DX_IS_X ? &x : NULL;

    /* the bound's magnitudes: |dw0| + sum_rows |dy xhat|, xhat from double 1/rms */
    int64_t n, *o = gh_view_offsets(v, &n);
    const int64_t R = n / D;
    double *mag = gh_xmalloc((size_t)D * sizeof *mag);
    for (int64_t i = 0; i < D; i++)
        mag[i] = fabs(dwb.h[i]);
    add_dw_terms(mag, &x, &dy, o, R, D, eps);

    /* the GPU with the BF16 dw, then (inputs uploaded again: dx may be one
     * of them) with the F32 dw */
    df_tensor xg = gh_tens(&x, v, 1), dyg = gh_tens(&dy, v, 1), dxg;
    memset(&dxg, 0, sizeof dxg);
    if (pdx)
        dxg = gh_tens(pdx, v, 1);
    df_tensor wg = df_tensor_1d(w.d, DF_DTYPE_BF16, D);
    df_tensor dwbg = df_tensor_1d(dwb.d, DF_DTYPE_BF16, D);
    df_tensor dwfg = df_tensor_1d(dwf.d, DF_DTYPE_F32, D);
    uint16_t *dxr[2] = {NULL, NULL};
    for (int run = 0; run < 2; run++) {
        gh_buf_upload(&x), gh_buf_upload(&dy), gh_buf_upload(&w);
        gh_buf_upload(run ? &dwf : &dwb);
        if (dxm == DX_OWN)
            gh_buf_upload(&dxb);
        CHECK_EQ(df_cuda_rmsnorm_bwd(gh_gpu, &xg, &wg, eps, plus_one, &dyg, pdx ? &dxg : NULL, acc,
                                     run ? &dwfg : &dwbg),
                 0);
        CHECK(sync_ok());
        CHECK_EQ(df_cuda_rmsnorm_bwd_last_impl(), want);
        if (pdx)
            dxr[run] = gh_buf_download(pdx);
    }
    uint16_t *gb = gh_buf_download(&dwb);
    float *gf = gh_buf_download(&dwf);
    int same_dx = !pdx || !memcmp(dxr[0], dxr[1], (size_t)pdx->n * 2);
    int64_t not_rne = 0;
    for (int64_t i = 0; i < D; i++)
        not_rne += gb[i] != gh_f2bf(gf[i]);

    /* the CPU with a BF16 dw holding the same old values */
    uint16_t *cb = gh_xmalloc((size_t)D * 2);
    memcpy(cb, dwb.img, (size_t)D * 2);
    df_tensor xc = gh_tens(&x, v, 0), dyc = gh_tens(&dy, v, 0), dxc;
    memset(&dxc, 0, sizeof dxc);
    if (pdx)
        dxc = gh_tens(pdx, v, 0);
    df_tensor wc = df_tensor_1d(w.h, DF_DTYPE_F32, D), cdw = df_tensor_1d(cb, DF_DTYPE_BF16, D);
    CHECK_EQ(df_op_rmsnorm_bwd(gh_cpu, &xc, &wc, eps, plus_one, &dyc, pdx ? &dxc : NULL, acc, &cdw),
             0);
    int64_t bad = 0, cancel = 0, differ = 0;
    for (int64_t i = 0; i < D; i++) {
        bad += !gh_bf16_close(gb[i], cb[i], 1e-5 * mag[i], &cancel);
        differ += gb[i] != cb[i];
    }
    int ok = bad == 0 && not_rne == 0 && same_dx;
    printf("  %-50s bf16 dw: == RNE(f32 dw run) %s, dx %s; vs CPU %lld/%lld differ (1 ulp), "
           "%lld cancelling, %lld bad  %s\n",
           name, not_rne ? "NO" : "yes", same_dx ? "bitwise equal" : "DIFFERS", (long long)differ,
           (long long)D, (long long)cancel, (long long)bad, ok ? "ok" : "FAIL");
    CHECK_EQ(bad, 0);
    CHECK_EQ(not_rne, 0);
    CHECK(same_dx);
    free(o), free(mag), free(gb), free(gf), free(cb), free(dxr[0]), free(dxr[1]);
    gh_buf_free(&x), gh_buf_free(&dy), gh_buf_free(&w), gh_buf_free(&dwb), gh_buf_free(&dwf);
    if (dxm == DX_OWN)
        gh_buf_free(&dxb);
}

static void test_rmsnorm_bwd(void)
{
    /* the one-pass path wherever it fits (whatever DFLASH_RMSNORM_BWD
     * says); each case also runs the two-pass one and compares the bits */
    CHECK_EQ(df_cuda_rmsnorm_bwd_set_impl(-1), -EINVAL);
    CHECK_EQ(df_cuda_rmsnorm_bwd_set_impl(TWO + 1), -EINVAL);
    CHECK_EQ(df_cuda_rmsnorm_bwd_set_impl(ONE), 0);
    printf("rmsnorm_bwd (bf16 dx: 2 naive + 1e-6 max|ref|; dw: 1e-5 sum|terms|; one-pass == "
           "two-pass bitwise)\n");
    nbwd_run("[37, 4, 64] ld 272, plain, dx own", gh_v3(0, 37, 4, 64, 272), 0, DX_OWN, 0, ONE);
    nbwd_run("[37, 4, 128] ld 528, plus_one, dx = dy, acc", gh_v3(8, 37, 4, 128, 528), 1, DX_IS_DY,
             1, ONE);
    nbwd_run("[37, 1, 5120] ld 5184, plain, dx = x", gh_v3(0, 37, 1, 5120, 5184), 0, DX_IS_X, 0,
             ONE);
    nbwd_run("[1, 16, 64] ld 1040, plus_one, dx own", gh_v3(0, 1, 16, 64, 1040), 1, DX_OWN, 0, ONE);
    nbwd_run("[1, 1, 5120] ld 5184, plain, no dx", gh_v3(0, 1, 1, 5120, 5184), 0, DX_NONE, 0, ONE);
    nbwd_run("[1, 2, 128] ld 264, plain, dx own, acc", gh_v3(8, 1, 2, 128, 264), 0, DX_OWN, 1, ONE);
    nbwd_run("[4096, 16, 64] ld 1032, plain, dx own", gh_v3(0, 4096, 16, 64, 1032), 0, DX_OWN, 0,
             ONE);
    nbwd_run("[4096, 8, 128] ld 1040, plus_one, dx = x", gh_v3(0, 4096, 8, 128, 1040), 1, DX_IS_X,
             0, ONE);
    nbwd_run("[4096, 1, 5120] ld 5184, plus_one, dx own, acc", gh_v3(0, 4096, 1, 5120, 5184), 1,
             DX_OWN, 1, ONE);
    nbwd_run("[4096, 1, 5120] ld 5184, plain, dx = dy", gh_v3(0, 4096, 1, 5120, 5184), 0, DX_IS_DY,
             0, ONE);
    /* rows not a multiple of the tile (5120: 16 rows; 128: 256 rows, two
     * tiles a block: the last block's second tile empty) */
    nbwd_run("[1003, 1, 5120] ld 5120, plus_one, dx = dy, acc", gh_v3(0, 1003, 1, 5120, 5120), 1,
             DX_IS_DY, 1, ONE);
    nbwd_run("[1003, 1, 5120] ld 5128 at 8, plain, dx = x, acc", gh_v3(8, 1003, 1, 5120, 5128), 0,
             DX_IS_X, 1, ONE);
    nbwd_run("[2049, 8, 128] ld 1024, plain, dx own, acc", gh_v3(0, 2049, 8, 128, 1024), 0, DX_OWN,
             1, ONE);
    nbwd_run("[2049, 8, 128] ld 1024, plus_one, dx = dy", gh_v3(0, 2049, 8, 128, 1024), 1, DX_IS_DY,
             0, ONE);
    /* every one-pass configuration: D 8 and 32 (a slice owns several
     * streams), 256 (slices of 16), 512 (of 32), 1536 / 3000 / 6144 (the
     * block, 1 / 2 / 3 units a thread) */
    nbwd_run("[1000, 8] ld 8, plus_one, dx own, acc", gh_v2(0, 1000, 8, 8), 1, DX_OWN, 1, ONE);
    nbwd_run("[300, 32] ld 40, plain, dx = x", gh_v2(0, 300, 32, 40), 0, DX_IS_X, 0, ONE);
    nbwd_run("[99, 256] ld 264, plain, dx = x, acc", gh_v2(8, 99, 256, 264), 0, DX_IS_X, 1, ONE);
    nbwd_run("[77, 512] ld 512, plus_one, dx own", gh_v2(0, 77, 512, 512), 1, DX_OWN, 0, ONE);
    nbwd_run("[50, 1536] ld 1536, plain, dx = dy, acc", gh_v2(0, 50, 1536, 1536), 0, DX_IS_DY, 1,
             ONE);
    nbwd_run("[67, 3000] ld 3000, plus_one, dx own, acc", gh_v2(0, 67, 3000, 3000), 1, DX_OWN, 1,
             ONE);
    nbwd_run("[21, 6144] ld 6144, plain, dx = x", gh_v2(0, 21, 6144, 6144), 0, DX_IS_X, 0, ONE);
    {
        int64_t sh[4] = {2, 37, 4, 128}, st[4] = {37 * 528 + 48, 528, 128, 1};
        nbwd_run("[2, 37, 4, 128] 4-D with gaps, plain, dx own", gh_vnd(0, 4, sh, st), 0, DX_OWN,
                 0, ONE);
    }
    nbwd_run("[37, 100] ld 104 (vector + tail), plus_one", gh_v2(0, 37, 100, 104), 1, DX_OWN, 0,
             ONE);
    /* the two-pass fallback: misaligned rows; D 513..1024 and > 6144 */
    nbwd_run("[37, 3, 64] ld 197 at 1 (scalar), plain", gh_v3(1, 37, 3, 64, 197), 0, DX_OWN, 1,
             TWO);
    nbwd_run("[45, 2, 1024] ld 2048, plain, dx own, acc", gh_v3(0, 45, 2, 1024, 2048), 0, DX_OWN, 1,
             TWO);
    nbwd_run("[20, 6152] ld 6152, plus_one, dx = dy", gh_v2(0, 20, 6152, 6152), 1, DX_IS_DY, 0,
             TWO);
    nbwd_layouts("[300, 2, 128] ld 264 at 0 | 265 at 1", gh_v3(0, 300, 2, 128, 264),
                 gh_v3(1, 300, 2, 128, 265), 1, DX_OWN, 0);
    printf("rmsnorm_bwd, BF16 dw (== RNE(F32 dw run); vs CPU: 1 bf16 ulp, or 1e-5 sum|terms| "
           "+ rounding where the sum cancels)\n");
    nbwd_bf16_case("[37, 4, 64] ld 272, plain, dx own", gh_v3(0, 37, 4, 64, 272), 0, DX_OWN, 0,
                   ONE);
    nbwd_bf16_case("[4096, 16, 64] ld 1032, plus_one, dx own, acc", gh_v3(0, 4096, 16, 64, 1032), 1,
                   DX_OWN, 1, ONE);
    nbwd_bf16_case("[4096, 1, 5120] ld 5184, plain, dx = dy", gh_v3(0, 4096, 1, 5120, 5184), 0,
                   DX_IS_DY, 0, ONE);
    nbwd_bf16_case("[1003, 1, 5120] ld 5120, plus_one, dx = x, acc", gh_v3(0, 1003, 1, 5120, 5120),
                   1, DX_IS_X, 1, ONE);
    nbwd_bf16_case("[4096, 8, 128] ld 1040, plus_one, dx = x", gh_v3(0, 4096, 8, 128, 1040), 1,
                   DX_IS_X, 0, ONE);
    nbwd_bf16_case("[2049, 8, 128] ld 1024, plain, dx = dy, acc", gh_v3(0, 2049, 8, 128, 1024), 0,
                   DX_IS_DY, 1, ONE);
    nbwd_bf16_case("[1, 1, 5120] ld 5184, plain, no dx", gh_v3(0, 1, 1, 5120, 5184), 0, DX_NONE, 0,
                   ONE);
    nbwd_bf16_case("[37, 3, 64] ld 197 at 1 (scalar), acc", gh_v3(1, 37, 3, 64, 197), 0, DX_OWN, 1,
                   TWO);
    CHECK_EQ(df_cuda_rmsnorm_bwd_set_impl(0), 0);
}

/* ---- RoPE backward ---- */

static void rope_case(const char *name, int64_t T, int heads, int hd, int rot, int64_t ld,
                      int64_t col0, double theta)
{
    gh_view v = gh_v2(col0, T, (int64_t)heads * hd, ld);
    gh_buf x = gh_buf_rand(gh_view_len(v), 0, GH_N01_NZ, &rng, 1.0f);
    int32_t *pos = gh_xmalloc((size_t)T * sizeof *pos);
    for (int64_t t = 0; t < T; t++) /* long-context positions, and 0 */
        pos[t] = t == 0 ? 0 : (int32_t)(test_rand(&rng) % 40000);
    gh_buf_upload(&x);
    df_tensor xc = gh_tens(&x, v, 0), xg = gh_tens(&x, v, 1);
    CHECK_EQ(df_cuda_rope_bwd(gh_gpu, &xg, pos, heads, hd, rot, theta), 0);
    CHECK(sync_ok());
    CHECK_EQ(df_op_rope_bwd(gh_cpu, &xc, pos, heads, hd, rot, theta), 0);
    char nm[160];
    snprintf(nm, sizeof nm, "  %s", name);
    gh_check_view(nm, &x, v, NULL);
    free(pos);
    gh_buf_free(&x);
}

static void test_rope_bwd(void)
{
    printf("rope_bwd (in place, bf16: 2 naive + 1e-6 max|ref|)\n");
    rope_case("T37 4x128 rot 128 ld 528", 37, 4, 128, 128, 528, 0, 1e6);
    rope_case("T4096 8x128 rot 64 ld 1040 (partial)", 4096, 8, 128, 64, 1040, 8, 1e7);
    rope_case("T1 2x64 rot 64 ld 136", 1, 2, 64, 64, 136, 0, 1e4);
    rope_case("T37 3x64 rot 32 ld 197 at 1 (scalar)", 37, 3, 64, 32, 197, 1, 1e6);
    rope_case("T37 2x128 rot 36 ld 264 (half 18: scalar)", 37, 2, 128, 36, 264, 0, 1e6);
    rope_case("T4096 32x64 rot 64 ld 2056", 4096, 32, 64, 64, 2056, 0, 5e5);
}

/* ---- SwiGLU backward ---- */

enum { SW_OWN, SW_INPLACE, SW_CROSS };

/* gate, up, dout in their own buffers (views of one layout v); dgate, dup
 * in their own (SW_OWN), or dgate = gate and dup = up (SW_INPLACE), or
 * dgate = dout and dup = gate (SW_CROSS). */
static void swiglu_case(const char *name, gh_view v, int mode)
{
    gh_buf g = gh_buf_rand(gh_view_len(v), 0, GH_N01_NZ, &rng, 2.5f);
    gh_buf u = gh_buf_rand(gh_view_len(v), 0, GH_N01_NZ, &rng, 1.0f);
    gh_buf d = gh_buf_rand(gh_view_len(v), 0, GH_N01_NZ, &rng, 1.0f), og, ou;
    memset(&og, 0, sizeof og);
    memset(&ou, 0, sizeof ou);
    /* saturating gates: exp overflow must give 0 / -0, never NaN */
    static const float ext[] = {100.0f, -100.0f, 88.5f, -88.5f, 16.0f, -16.0f};
    int64_t n, *o = gh_view_offsets(v, &n);
    for (int64_t i = 0; i < n; i += 97)
        gh_buf_set(&g, o[i], ext[(i / 97) % 6]);
    free(o);
    if (mode == SW_OWN) {
        og = gh_buf_rand(gh_view_len(v), 0, GH_N01_NZ, &rng, 1.0f);
        ou = gh_buf_rand(gh_view_len(v), 0, GH_N01_NZ, &rng, 1.0f);
        gh_poison(&og, v);
        gh_poison(&ou, v);
    }
    gh_buf *pg = mode == SW_OWN ? &og : mode == SW_INPLACE ? &g : &d;
    gh_buf *pu = mode == SW_OWN ? &ou : mode == SW_INPLACE ? &u : &g;
    gh_buf_upload(&g), gh_buf_upload(&u), gh_buf_upload(&d);
    if (mode == SW_OWN)
        gh_buf_upload(&og), gh_buf_upload(&ou);
    df_tensor gg = gh_tens(&g, v, 1), ug = gh_tens(&u, v, 1), dg = gh_tens(&d, v, 1);
    df_tensor dgg = gh_tens(pg, v, 1), dug = gh_tens(pu, v, 1);
    CHECK_EQ(df_cuda_swiglu_bwd(gh_gpu, &gg, &ug, &dg, &dgg, &dug), 0);
    CHECK(sync_ok());
    df_tensor gc = gh_tens(&g, v, 0), uc = gh_tens(&u, v, 0), dc = gh_tens(&d, v, 0);
    df_tensor dgc = gh_tens(pg, v, 0), duc = gh_tens(pu, v, 0);
    CHECK_EQ(df_op_swiglu_bwd(gh_cpu, &gc, &uc, &dc, &dgc, &duc), 0);
    char nm[160];
    snprintf(nm, sizeof nm, "  %s dgate", name);
    gh_check_view(nm, pg, v, NULL);
    snprintf(nm, sizeof nm, "  %s dup", name);
    gh_check_view(nm, pu, v, NULL);
    gh_buf_free(&g), gh_buf_free(&u), gh_buf_free(&d);
    if (mode == SW_OWN)
        gh_buf_free(&og), gh_buf_free(&ou);
}

static void test_swiglu_bwd(void)
{
    printf("swiglu_bwd (bf16: 2 naive + 1e-6 max|ref|)\n");
    swiglu_case("[37, 4, 128] ld 528", gh_v3(0, 37, 4, 128, 528), SW_OWN);
    swiglu_case("[4096, 1, 5120] ld 5184, in place", gh_v3(8, 4096, 1, 5120, 5184), SW_INPLACE);
    swiglu_case("[1, 8, 64] ld 520, dgate = dout, dup = gate", gh_v3(0, 1, 8, 64, 520), SW_CROSS);
    swiglu_case("[37, 3, 64] ld 197 at 1 (scalar)", gh_v3(1, 37, 3, 64, 197), SW_OWN);
    swiglu_case("[37, 77] ld 90 at 3 (odd width)", gh_v2(3, 37, 77, 90), SW_INPLACE);
    {
        int64_t sh[4] = {2, 5, 4, 64}, st[4] = {5 * 264 + 16, 264, 64, 1};
        swiglu_case("[2, 5, 4, 64] 4-D with gaps", gh_vnd(8, 4, sh, st), SW_OWN);
    }
}

/* ---- AdamW ---- */

/* Device arrays at element offset off (off 1: not 16-byte aligned, the
 * scalar path). gbf: the gradients are bf16 numbers, run on the GPU as an
 * F32 and then as a BF16 array (from the same p, m, v): the two must agree
 * bit for bit; the BF16 run is then held to the rules against the CPU run
 * on the same BF16 array. */
static void adamw_case(int64_t n, int with_out, int off, int64_t step, float gs, int gbf)
{
    const float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f;
    float *p = gh_xmalloc((size_t)n * 4), *g = gh_xmalloc((size_t)n * 4);
    float *m = gh_xmalloc((size_t)n * 4), *v = gh_xmalloc((size_t)n * 4);
    uint16_t *g16 = gh_xmalloc((size_t)n * 2); /* the bf16 gradients (gbf) */
    for (int64_t i = 0; i < n; i++) {
        p[i] = gh_draw(GH_N01_NZ, &rng, 0.05f);
        g[i] = gh_draw(GH_N01_NZ, &rng, 0.01f);
        m[i] = gh_draw(GH_N01_NZ, &rng, 0.003f);
        v[i] = fabsf(gh_draw(GH_N01_NZ, &rng, 1e-4f)) * 1e-2f;
        if (gbf) {
            g16[i] = gh_f2bf(g[i]);
            g[i] = gh_bf2f(g16[i]);
        }
    }
    size_t bytes = (size_t)(n + off) * 4;
    float *dp = df_backend_alloc(gh_gpu, bytes), *dg = df_backend_alloc(gh_gpu, bytes),
          *dm = df_backend_alloc(gh_gpu, bytes), *dv = df_backend_alloc(gh_gpu, bytes);
    uint16_t *dout = with_out ? df_backend_alloc(gh_gpu, (size_t)(n + off) * 2) : NULL;
    uint16_t *dg16 = gbf ? df_backend_alloc(gh_gpu, (size_t)(n + off) * 2) : NULL;
    CHECK(dp && dg && dm && dv && (!with_out || dout) && (!gbf || dg16));
    CHECK_EQ(df_backend_upload(gh_gpu, dg + off, g, (size_t)n * 4), 0);
    if (gbf)
        CHECK_EQ(df_backend_upload(gh_gpu, dg16 + off, g16, (size_t)n * 2), 0);
    float *gp = gh_xmalloc((size_t)n * 4), *gm = gh_xmalloc((size_t)n * 4);
    float *gv = gh_xmalloc((size_t)n * 4);
    uint16_t *go = with_out ? gh_xmalloc((size_t)n * 2) : NULL;
    int64_t differ32 = 0; /* BF16 run vs F32 run */
    for (int run = 0; run < (gbf ? 2 : 1); run++) {
        CHECK_EQ(df_backend_upload(gh_gpu, dp + off, p, (size_t)n * 4), 0);
        CHECK_EQ(df_backend_upload(gh_gpu, dm + off, m, (size_t)n * 4), 0);
        CHECK_EQ(df_backend_upload(gh_gpu, dv + off, v, (size_t)n * 4), 0);
        if (with_out) {
            uint16_t *nan = gh_xmalloc((size_t)n * 2);
            for (int64_t i = 0; i < n; i++)
                nan[i] = 0x7fc0;
            CHECK_EQ(df_backend_upload(gh_gpu, dout + off, nan, (size_t)n * 2), 0);
            free(nan);
        }
        CHECK_EQ(df_cuda_adamw(gh_gpu, dp + off, run ? (const void *)(dg16 + off) : dg + off,
                               run ? DF_DTYPE_BF16 : DF_DTYPE_F32, dm + off, dv + off, n, lr, b1,
                               b2, eps, wd, step, gs, with_out ? dout + off : NULL),
                 0);
        CHECK(sync_ok());
        float *np_ = gh_xmalloc((size_t)n * 4), *nm = gh_xmalloc((size_t)n * 4);
        float *nv = gh_xmalloc((size_t)n * 4);
        uint16_t *no = with_out ? gh_xmalloc((size_t)n * 2) : NULL;
        CHECK_EQ(df_backend_download(gh_gpu, np_, dp + off, (size_t)n * 4), 0);
        CHECK_EQ(df_backend_download(gh_gpu, nm, dm + off, (size_t)n * 4), 0);
        CHECK_EQ(df_backend_download(gh_gpu, nv, dv + off, (size_t)n * 4), 0);
        if (with_out)
            CHECK_EQ(df_backend_download(gh_gpu, no, dout + off, (size_t)n * 2), 0);
        for (int64_t i = 0; run && i < n; i++)
            differ32 += memcmp(&np_[i], &gp[i], 4) || memcmp(&nm[i], &gm[i], 4) ||
                        memcmp(&nv[i], &gv[i], 4) || (with_out && no[i] != go[i]);
        memcpy(gp, np_, (size_t)n * 4), memcpy(gm, nm, (size_t)n * 4);
        memcpy(gv, nv, (size_t)n * 4);
        if (with_out)
            memcpy(go, no, (size_t)n * 2);
        free(np_), free(nm), free(nv), free(no);
    }

    /* the reference on copies (p, m, v are updated in place) */
    float *rp = gh_xmalloc((size_t)n * 4), *rm = gh_xmalloc((size_t)n * 4);
    float *rv = gh_xmalloc((size_t)n * 4);
    uint16_t *ro = gh_xmalloc((size_t)n * 2);
    memcpy(rp, p, (size_t)n * 4), memcpy(rm, m, (size_t)n * 4), memcpy(rv, v, (size_t)n * 4);
    CHECK_EQ(df_op_adamw(gh_cpu, rp, gbf ? (const void *)g16 : g,
                         gbf ? DF_DTYPE_BF16 : DF_DTYPE_F32, rm, rv, n, lr, b1, b2, eps, wd, step,
                         gs, ro),
             0);

    /* bound: 1e-6 x the magnitudes of each update's terms (double) */
    const double bc1 = 1.0 - pow(b1, (double)step), bc2 = 1.0 - pow(b2, (double)step);
    int64_t bad = 0, exact = 0, outbad = 0;
    for (int64_t i = 0; i < n; i++) {
        double gg = (double)g[i] * gs;
        double mm = b1 * (double)m[i] + (1.0 - b1) * gg, vv = b2 * (double)v[i] + (1.0 - b2) * gg * gg;
        double upd = fabs(mm / bc1) / (sqrt(vv / bc2) + eps) + wd * fabs(p[i]);
        double sp = fabs(p[i]) + lr * upd;
        double sm = fabs(b1 * (double)m[i]) + fabs((1.0 - b1) * gg);
        double sv = fabs(b2 * (double)v[i]) + (1.0 - b2) * gg * gg;
        int ok = fabs((double)gp[i] - rp[i]) <= 1e-6 * sp && fabs((double)gm[i] - rm[i]) <= 1e-6 * sm &&
                 fabs((double)gv[i] - rv[i]) <= 1e-6 * sv;
        bad += !ok;
        exact += !memcmp(&gp[i], &rp[i], 4) && !memcmp(&gm[i], &rm[i], 4) && !memcmp(&gv[i], &rv[i], 4);
        if (with_out)
            outbad += go[i] != gh_f2bf(gp[i]);
    }
    int ok = bad == 0 && outbad == 0 && differ32 == 0;
    printf("  adamw n=%-8lld out_bf16 %d %-9s step %lld gs %.2f grad %s: %lld/%lld bit-exact, %lld "
           "out of bound, out_bf16 != RNE(master): %lld",
           (long long)n, with_out, off ? "unaligned" : "aligned", (long long)step, gs,
           gbf ? "BF16" : "F32", (long long)exact, (long long)n, (long long)bad, (long long)outbad);
    if (gbf)
        printf(", != the F32-grad run: %lld", (long long)differ32);
    printf("  %s\n", ok ? "ok" : "FAIL");
    CHECK_EQ(bad, 0);
    CHECK_EQ(outbad, 0);
    CHECK_EQ(differ32, 0);
    free(p), free(g), free(g16), free(m), free(v), free(gp), free(gm), free(gv), free(go);
    free(rp), free(rm), free(rv), free(ro);
    df_backend_free(gh_gpu, dp), df_backend_free(gh_gpu, dg), df_backend_free(gh_gpu, dm);
    df_backend_free(gh_gpu, dv);
    if (dout)
        df_backend_free(gh_gpu, dout);
    if (dg16)
        df_backend_free(gh_gpu, dg16);
}

/* BF16 m (adamw_m16; v in vdt: BF16, UF16 or F32): the GPU's p, m, v and out bitwise the
 * CPU's (the same fp32 arithmetic in the same order, the same stochastic rounding bits); off
 * 1: the scalar path. Two steps, so the second reads moments the first stored. */
static void adamw_m16_case(int64_t n, int off, int gbf, df_dtype vdt)
{
    const int v32 = vdt == DF_DTYPE_F32;
    const size_t ves = v32 ? 4 : 2;
    uint64_t r = 0xada16u + (uint64_t)n;
    const float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f, gs = 0.37f;
    const uint64_t key = 0xfeedf00dull;
    const int64_t i0 = 1000000007;
    float *p = gh_xmalloc((size_t)n * 4), *g = gh_xmalloc((size_t)n * 4);
    uint16_t *g16 = gh_xmalloc((size_t)n * 2), *m = gh_xmalloc((size_t)n * 2),
             *o = gh_xmalloc((size_t)n * 2);
    uint8_t *v = gh_xmalloc((size_t)n * ves);
    for (int64_t i = 0; i < n; i++) {
        p[i] = gh_draw(GH_N01_NZ, &r, 0.05f);
        g[i] = gh_draw(GH_N01_NZ, &r, 0.01f);
        g16[i] = gh_f2bf(g[i]);
        m[i] = gh_f2bf(gh_draw(GH_N01_NZ, &r, 0.003f));
        float vi = fabsf(gh_draw(GH_N01_NZ, &r, 1e-4f)) * 1e-2f;
        if (v32)
            memcpy(v + (size_t)i * 4, &vi, 4);
        else
            ((uint16_t *)v)[i] = vdt == DF_DTYPE_UF16 ? df_f32_to_uf16(vi) : gh_f2bf(vi);
    }
    float *dp = df_backend_alloc(gh_gpu, (size_t)(n + off) * 4),
          *dg = df_backend_alloc(gh_gpu, (size_t)(n + off) * 4);
    uint16_t *dm = df_backend_alloc(gh_gpu, (size_t)(n + off) * 2),
             *do_ = df_backend_alloc(gh_gpu, (size_t)(n + off) * 2),
             *dg16 = df_backend_alloc(gh_gpu, (size_t)(n + off) * 2);
    uint8_t *dv = df_backend_alloc(gh_gpu, (size_t)(n + off) * ves);
    CHECK(dp && dg && dm && dv && do_ && dg16);
    CHECK_EQ(df_backend_upload(gh_gpu, dp + off, p, (size_t)n * 4), 0);
    CHECK_EQ(df_backend_upload(gh_gpu, dg + off, g, (size_t)n * 4), 0);
    CHECK_EQ(df_backend_upload(gh_gpu, dg16 + off, g16, (size_t)n * 2), 0);
    CHECK_EQ(df_backend_upload(gh_gpu, dm + off, m, (size_t)n * 2), 0);
    CHECK_EQ(df_backend_upload(gh_gpu, dv + off * ves, v, (size_t)n * ves), 0);
    for (int s = 1; s <= 2; s++) {
        CHECK_EQ(df_cuda_adamw_m16(gh_gpu, dp + off, gbf ? (const void *)(dg16 + off) : dg + off,
                                   gbf ? DF_DTYPE_BF16 : DF_DTYPE_F32, dm + off, dv + off * ves,
                                   vdt, n, lr, b1, b2, eps, wd, s, gs, key + s, i0, do_ + off),
                 0);
        CHECK_EQ(df_op_adamw_m16(gh_cpu, p, gbf ? (const void *)g16 : g,
                                 gbf ? DF_DTYPE_BF16 : DF_DTYPE_F32, m, v, vdt, n, lr, b1, b2, eps,
                                 wd, s, gs, key + s, i0, o),
                 0);
    }
    CHECK(sync_ok());
    float *gp = gh_xmalloc((size_t)n * 4);
    uint16_t *gm = gh_xmalloc((size_t)n * 2), *go = gh_xmalloc((size_t)n * 2);
    uint8_t *gv = gh_xmalloc((size_t)n * ves);
    CHECK_EQ(df_backend_download(gh_gpu, gp, dp + off, (size_t)n * 4), 0);
    CHECK_EQ(df_backend_download(gh_gpu, gm, dm + off, (size_t)n * 2), 0);
    CHECK_EQ(df_backend_download(gh_gpu, gv, dv + off * ves, (size_t)n * ves), 0);
    CHECK_EQ(df_backend_download(gh_gpu, go, do_ + off, (size_t)n * 2), 0);
    int64_t dpn = 0, dmn = 0, don = 0, moved = 0;
    for (int64_t i = 0; i < n; i++) {
        dpn += memcmp(&gp[i], &p[i], 4) != 0;
        dmn += gm[i] != m[i] || memcmp(gv + i * ves, v + i * ves, ves) != 0;
        don += go[i] != o[i];
        moved += gm[i] != 0;
    }
    int ok = dpn == 0 && dmn == 0 && don == 0 && moved > n / 2;
    printf("  adamw_m16 n=%-8lld %-9s grad %s v %s, 2 steps: p differ %lld, m/v differ %lld, "
           "out differ %lld (of %lld)  %s\n",
           (long long)n, off ? "unaligned" : "aligned", gbf ? "BF16" : "F32", df_dtype_name(vdt),
           (long long)dpn,
           (long long)dmn, (long long)don, (long long)n, ok ? "ok" : "FAIL");
    CHECK(ok);
    df_backend_free(gh_gpu, dp), df_backend_free(gh_gpu, dg), df_backend_free(gh_gpu, dm);
    df_backend_free(gh_gpu, dv), df_backend_free(gh_gpu, do_), df_backend_free(gh_gpu, dg16);
    free(p), free(g), free(g16), free(m), free(v), free(o), free(gp), free(gm), free(gv), free(go);
}

static void test_adamw(void)
{
    printf("adamw_m16 (BF16 m, stochastically rounded, v BF16, UF16 or F32: bitwise the CPU's)\n");
    adamw_m16_case(1000003, 0, 1, DF_DTYPE_BF16);
    adamw_m16_case(1000003, 1, 0, DF_DTYPE_BF16);
    adamw_m16_case(7, 0, 1, DF_DTYPE_BF16);
    adamw_m16_case(1000003, 0, 1, DF_DTYPE_UF16);
    adamw_m16_case(1000003, 1, 0, DF_DTYPE_UF16);
    adamw_m16_case(7, 0, 1, DF_DTYPE_UF16);
    adamw_m16_case(1000003, 0, 1, DF_DTYPE_F32); /* m alone in BF16 */
    adamw_m16_case(1000003, 1, 0, DF_DTYPE_F32);
    adamw_m16_case(7, 0, 1, DF_DTYPE_F32);
    printf("adamw (F32 master/m/v: 1e-6 x sum|terms|; out_bf16 == RNE(master); BF16 grads: "
           "== the F32-grad run bitwise)\n");
    adamw_case(1, 0, 0, 1, 0.37f, 0);
    adamw_case(1, 1, 0, 3, 0.37f, 0);
    adamw_case(1000003, 0, 0, 7, 0.37f, 0);
    adamw_case(1000003, 1, 0, 7, 0.37f, 0);
    adamw_case(1000003, 1, 1, 1000, 2.5f, 0);
    adamw_case(7, 1, 1, 2, 1.0f, 0);
    adamw_case(1, 1, 0, 3, 0.37f, 1);
    adamw_case(1000003, 1, 0, 7, 0.37f, 1); /* vector path: 4 bf16 grads per 8-byte load */
    adamw_case(1000003, 0, 1, 1000, 2.5f, 1); /* scalar path */
    adamw_case(7, 1, 1, 2, 1.0f, 1);
}

/* ---- sum of squares ---- */

static void sumsq_case(int64_t n)
{
    float *x = gh_xmalloc((size_t)n * 4 + 4);
    for (int64_t i = 0; i < n; i++)
        x[i] = gh_draw(GH_N01_NZ, &rng, 1e-2f);
    /* aligned at a and misaligned (one float in) at b + 1: same data */
    float *a = df_backend_alloc(gh_gpu, (size_t)n * 4 + 4);
    float *b = df_backend_alloc(gh_gpu, (size_t)n * 4 + 8);
    CHECK(a && b);
    if (n) {
        CHECK_EQ(df_backend_upload(gh_gpu, a, x, (size_t)n * 4), 0);
        CHECK_EQ(df_backend_upload(gh_gpu, b + 1, x, (size_t)n * 4), 0);
    }
    double g1 = df_cuda_sumsq(gh_gpu, a, DF_DTYPE_F32, n);
    double g2 = df_cuda_sumsq(gh_gpu, a, DF_DTYPE_F32, n);
    double g3 = df_cuda_sumsq(gh_gpu, b + 1, DF_DTYPE_F32, n);
    double ref = df_op_sumsq(gh_cpu, x, DF_DTYPE_F32, n);
    double bound = 2.0 * (double)n * ldexp(1.0, -53) * ref;
    if (n <= 1)
        bound = 0; /* one square, exact in double */
    int same = !memcmp(&g1, &g2, 8) && !memcmp(&g1, &g3, 8);
    int ok = g1 >= 0 && fabs(g1 - ref) <= bound && same;
    printf("  sumsq n=%-9lld gpu %.17g ref %.17g |diff| %.2e bound %.2e rerun + misaligned %s  %s\n",
           (long long)n, g1, ref, fabs(g1 - ref), bound, same ? "bitwise equal" : "DIFFER",
           ok ? "ok" : "FAIL");
    CHECK(ok);
    free(x);
    df_backend_free(gh_gpu, a);
    df_backend_free(gh_gpu, b);
}

/* BF16 x (bf16 numbers): aligned (8-byte loads of 4) and misaligned by
 * one element (scalar loads) on the GPU, and the F32 array of the same
 * values: all three the same bits; against the CPU (on the BF16 array) the
 * F32 rule. */
static void sumsq_bf16_case(int64_t n)
{
    uint16_t *x16 = gh_xmalloc((size_t)n * 2 + 2);
    float *x = gh_xmalloc((size_t)n * 4 + 4);
    for (int64_t i = 0; i < n; i++) {
        x16[i] = gh_f2bf(gh_draw(GH_N01_NZ, &rng, 1e-2f));
        x[i] = gh_bf2f(x16[i]);
    }
    float *a = df_backend_alloc(gh_gpu, (size_t)n * 4 + 4);
    uint16_t *b = df_backend_alloc(gh_gpu, (size_t)n * 2 + 4);
    CHECK(a && b);
    if (n) {
        CHECK_EQ(df_backend_upload(gh_gpu, a, x, (size_t)n * 4), 0);
        CHECK_EQ(df_backend_upload(gh_gpu, b, x16, (size_t)n * 2), 0);
    }
    double f32 = df_cuda_sumsq(gh_gpu, a, DF_DTYPE_F32, n);
    double g1 = df_cuda_sumsq(gh_gpu, b, DF_DTYPE_BF16, n);
    if (n) /* the same values one element in */
        CHECK_EQ(df_backend_upload(gh_gpu, b + 1, x16, (size_t)n * 2), 0);
    double g2 = df_cuda_sumsq(gh_gpu, b + 1, DF_DTYPE_BF16, n);
    double ref = df_op_sumsq(gh_cpu, x16, DF_DTYPE_BF16, n);
    double bound = n <= 1 ? 0 : 2.0 * (double)n * ldexp(1.0, -53) * ref;
    int same = !memcmp(&f32, &g1, 8) && !memcmp(&f32, &g2, 8);
    int ok = g1 >= 0 && fabs(g1 - ref) <= bound && same;
    printf("  sumsq BF16 n=%-9lld gpu %.17g ref %.17g |diff| %.2e bound %.2e == F32 run, aligned "
           "and misaligned: %s  %s\n",
           (long long)n, g1, ref, fabs(g1 - ref), bound, same ? "bitwise" : "DIFFER",
           ok ? "ok" : "FAIL");
    CHECK(ok);
    free(x16), free(x);
    df_backend_free(gh_gpu, a);
    df_backend_free(gh_gpu, b);
}

static void test_sumsq(void)
{
    printf("sumsq (double: 2 n 2^-53 ref, exact for n <= 1; deterministic)\n");
    sumsq_case(0);
    sumsq_case(1);
    sumsq_case(16387);
    sumsq_case(10000000);
    sumsq_bf16_case(0);
    sumsq_bf16_case(1);
    sumsq_bf16_case(16387);
    sumsq_bf16_case(10000001);
}

int main(void)
{
    int rc = gh_open(0);
    if (rc)
        return rc;
    test_rmsnorm_bwd();
    test_rope_bwd();
    test_swiglu_bwd();
    test_adamw();
    test_sumsq();
    gh_close();
    return test_main_end();
}
