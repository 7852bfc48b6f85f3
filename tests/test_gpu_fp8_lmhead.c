/* test_gpu_fp8_lmhead - the CUDA LM head + CE (df_op_lmhead_ce) under FP8 against the CPU
 * reference, through the public df_op_* API. Skips (77) without a GPU.
 *  - DF_CE_FP8_GRAD on rounded h and head (its contract): loss and ce those of flags 0 up to
 *    the order of the sums (the E4M3 tensor cores on sm_90); dh is within 2e-2 relative L2
 *    of the CPU's (the GPU rounds G to bf16 before E4M3, the CPU rounds the fp32 G: blocks
 *    may differ by a tie or a scale step) and moves away from the flags-0 dh by E4M3's
 *    ~1e-2; G's codes written by the row kernel (once GEMM 2's class has passed its check)
 *    are bitwise those rounded by GEMM 2, in one chunk and in several, padded rows included;
 *  - with DF_CE_BF16_LOGITS too (and without FP8): the CPU's with that flag; with
 *    DF_CE_F16_LOGITS likewise;
 *  - with DF_CE_FP8_ONEPASS: one pass on sm_90, within 1e-2 relative L2 of the CPU's one
 *    pass (also on fp16 logits), and on the unrounded head the same bits; with
 *    DFLASH_CE_ONEPASS_BSUM the default kernel's argmax, its loss and dh to their last bits;
 *    with DFLASH_CE_ROWS_OCC4 (the row kernels in 32 registers) both kernels' bits;
 *  - DFLASH_CE_CHUNK_ROWS's chunks;
 *  - DF_CE_F16_LOGITS's room at 2 bytes a logit on the E4M3 path (chunks of twice the rows),
 *    and half-size chunks where GEMM 1 takes the BF16 path (fp32 logits);
 *  - rows not a multiple of 4 (cuBLASLt's row counts) still on the tensor cores.
 * The FP8 GEMMs and rounding alone: test_gpu_fp8. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/device.h"
#include "cuda/fp8_cuda.h"
#include "cuda/lmhead_cuda.h"
#include "e4m3.h"
#include "gpu_harness.h"
#include "knobs.h"
#include "ops.h"
#include "train_ops.h"

static uint64_t rng = 77;

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
        /* DFLASH_CE_ROWS_OCC4: the row kernels held to 32 registers, the same code: the one
         * pass's and the two passes' loss, dh and argmax bitwise */
        {
            CHECK_EQ(df_knob_set(DF_KNOB_CE_ROWS_OCC4, "1"), 0);
            double lo = 0, lt = 0;
            void *gdo = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16), *gamo = gh_dev_poisoned(g, N, DF_DTYPE_I32);
            void *gdt = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16);
            df_tensor Gdo = df_tensor_2d(gdo, DF_DTYPE_BF16, N, H), Gdt = df_tensor_2d(gdt, DF_DTYPE_BF16, N, H);
            CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gw, glab, NULL, (float)N, &lo, &Gdo, gamo, NULL, fo), 0);
            CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gw, glab, NULL, (float)N, &lt, &Gdt, NULL, NULL,
                                     DF_CE_FP8_GRAD | DF_CE_FP8_HEAD_FROZEN), 0);
            CHECK_EQ(df_knob_set(DF_KNOB_CE_ROWS_OCC4, NULL), 0);
            float *dO = gh_download_bf16(g, gdo, N * H), *dT = gh_download_bf16(g, gdt, N * H);
            int32_t *amo = gh_xmalloc((size_t)N * 4);
            CHECK_EQ(df_backend_download(g, amo, gamo, (size_t)N * 4), 0);
            int same1 = lo == lg1 && !memcmp(dO, d1, (size_t)(N * H) * sizeof(float)) &&
                        !memcmp(amo, am1, (size_t)N * 4);
            int same2 = lt == l8 && !memcmp(dT, d8, (size_t)(N * H) * sizeof(float));
            printf("  DFLASH_CE_ROWS_OCC4=1: one pass loss %.9g (default %.9g), two passes %.9g "
                   "(default %.9g); loss, dh and argmax bitwise the default's: %s, %s\n", lo, lg1,
                   lt, l8, same1 ? "yes" : "no", same2 ? "yes" : "no");
            CHECK(same1);
            CHECK(same2);
            free(dO), free(dT), free(amo);
            df_backend_free(g, gdo), df_backend_free(g, gamo), df_backend_free(g, gdt);
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
    /* DF_CE_F16_LOGITS on the E4M3 tensor cores: the logits' room at 2 bytes a logit, so
     * bytes for N / 4 rows of it give 4 chunks; with GEMM 1 on the BF16 path (as where its
     * plan refuses a chunk) each chunk's fp32 logits take half the rows (8 chunks); both the
     * CPU's with the same flags up to the order of the sums */
    {
        const unsigned fl = DF_CE_F16_LOGITS | DF_CE_FP8_GRAD;
        const int64_t ldz = (V + 7) / 8 * 8, rq = (N + 3) / 4;
        df_cuda_lmhead_ce_set_chunk_bytes((size_t)rq * (size_t)(ldz * 2 + H * 4 +
                                                                (H + 127) / 128 * 128 +
                                                                (V + 127) / 128 * 128));
        float *dcb = gh_xmalloc((size_t)(N * H) * 4);
        df_tensor tdb = df_tensor_2d(dcb, DF_DTYPE_F32, N, H);
        double lcb = 0, lg[2] = {0, 0};
        int64_t nch[2];
        CHECK_EQ(df_op_lmhead_ce(c, &th, &tw, lab, NULL, (float)N, &lcb, &tdb, NULL, NULL, fl), 0);
        for (int b = 0; b < 2; b++) {
            df_cuda_lmhead_ce_set_gemm1_bf16(b);
            void *gdb = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16);
            df_tensor Gdb = df_tensor_2d(gdb, DF_DTYPE_BF16, N, H);
            CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gw, glab, NULL, (float)N, &lg[b], &Gdb, NULL, NULL,
                                     fl), 0);
            nch[b] = df_cuda_lmhead_ce_last_chunks();
            float *db = gh_download_bf16(g, gdb, N * H);
            double eb = 0, rb = 0;
            for (int64_t i = 0; i < N * H; i++) {
                eb += (db[i] - dcb[i]) * (double)(db[i] - dcb[i]);
                rb += (double)dcb[i] * dcb[i];
            }
            printf("  DF_CE_F16_LOGITS | DF_CE_FP8_GRAD, room for %lld fp16 rows%s: %lld chunks, "
                   "loss %.9g (cpu %.9g), dh rel L2 vs cpu %.3e\n", (long long)rq,
                   b ? ", GEMM 1 on the BF16 path" : "", (long long)nch[b], lg[b], lcb,
                   sqrt(eb / rb));
            CHECK(fabs(lg[b] - lcb) <= 1e-5 * fabs(lcb));
            CHECK(sqrt(eb / rb) < 2e-2);
            free(db);
            df_backend_free(g, gdb);
        }
        df_cuda_lmhead_ce_set_gemm1_bf16(0);
        df_cuda_lmhead_ce_set_chunk_bytes(0);
        if (sm90) {
            const int64_t rc4 = (rq + 3) / 4 * 4; /* the FP8 GEMMs' rows: whole fours */
            CHECK_EQ(nch[0], (N + rq - 1) / rq);
            CHECK_EQ(nch[1], (N + rc4 / 2 - 1) / (rc4 / 2));
        }
        free(dcb);
    }
    /* DFLASH_CE_CHUNK_ROWS: chunks of the rows asked for (rounded up to 4) on the E4M3 path,
     * the same within the sums' order */
    {
        df_knob_set(DF_KNOB_CE_CHUNK_ROWS, "73");
        void *gdr = gh_dev_poisoned(g, N * H, DF_DTYPE_BF16);
        df_tensor Gr = df_tensor_2d(gdr, DF_DTYPE_BF16, N, H);
        double lr = 0;
        CHECK_EQ(df_op_lmhead_ce(g, &Gh, &Gw, glab, NULL, (float)N, &lr, &Gr, NULL, NULL,
                                 DF_CE_FP8_GRAD), 0);
        const int64_t nchr = df_cuda_lmhead_ce_last_chunks();
        df_knob_set(DF_KNOB_CE_CHUNK_ROWS, "0");
        float *dr = gh_download_bf16(g, gdr, N * H);
        double er = 0;
        for (int64_t i = 0; i < N * H; i++)
            er += (dr[i] - d8[i]) * (double)(dr[i] - d8[i]);
        printf("  DFLASH_CE_CHUNK_ROWS=73: %lld chunks, loss %.9g, dh rel L2 vs one chunk %.3e\n",
               (long long)nchr, lr, sqrt(er / r2));
        if (sm90)
            CHECK_EQ(nchr, (N + 75) / 76);
        CHECK(fabs(lr - l8) <= 1e-5 * fabs(l8));
        CHECK(sqrt(er / r2) < 1e-2);
        free(dr);
        df_backend_free(g, gdr);
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

int main(void)
{
    int rc = gh_open(0);
    if (rc)
        return rc;
    df_cuda_device_info info;
    int sm90 = df_cuda_device_info_get(0, &info) == 0 && info.sm_major == 9;
    df_knob_set(DF_KNOB_FP8_GEMM, "1");
    check_lmhead(300, 5000, 256, sm90);
    /* rows not a multiple of 4 (cuBLASLt's row counts): the GEMMs' rows rounded up, on the
     * tensor cores still (chunks of 74 rows too) */
    int64_t nfast = 0, nslow = 0, nfast2 = 0, nslow2 = 0;
    df_cuda_fp8_gemm_counts(&nfast, &nslow);
    check_lmhead(299, 5000, 256, sm90);
    df_cuda_fp8_gemm_counts(&nfast2, &nslow2);
    printf("lmhead_ce with 299 rows: %lld calls on E4M3 tensor cores, %lld on the BF16 path\n",
           (long long)(nfast2 - nfast), (long long)(nslow2 - nslow));
    if (sm90)
        CHECK(nfast2 - nfast >= 4 && nslow2 == nslow);
    gh_close();
    return test_main_end();
}
