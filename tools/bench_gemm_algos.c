/* bench_gemm_algos - how far cuBLASLt's first heuristic choice is from the
 * fastest of its candidates, for every GEMM shape of one training step of
 * the Qwen3.6-27B drafter (5 layers, hidden 5120, 32/8 heads x 128, MLP
 * 17408, 8192 query tokens, 4096 context tokens) and the LM head's two
 * GEMMs. A measurement only (never run by tests): it tells whether picking
 * among the candidates by time is worth building into gemm.cu (it now is,
 * opt-in: DFLASH_GEMM_TUNE=1, among the candidates of the first one's algo
 * id and split-K whose output is bitwise the first's).
 *
 * Each shape is set up as kernels/cuda/gemm.cu sets it up (column-major
 * terms, bf16 A/B, fp32 compute, bf16 or fp32 C, the same reduction-scheme
 * restriction for a bf16 C), on random data. For each of up to 16
 * candidates: the median of 9 timed runs (CUDA events) after a warm-up, and
 * whether its output is bitwise the first candidate's (a candidate that is
 * could replace it without changing any result). Prints one line per shape
 * and the step's total at the first choice vs the fastest bitwise-equal
 * choice vs the fastest of all.
 *
 * Then the same under sustained load (the H200 holds its 700 W limit by
 * lowering the clock, which short timed runs with idle gaps do not show):
 * the MLP's gate GEMM back to back for ~4 s, and the step's whole GEMM mix
 * (every shape x its count, first choices) back to back 20 times.
 *
 * --sustained: also each of the first 8 candidates of the biggest shapes
 * back to back for ~0.6 s (after ~0.4 s of the same to reach the clock the
 * power limit holds): does some candidate sustain more TFLOP/s at 700 W than the
 * first choice (fewer bytes through shared memory and L2 per FLOP can mean
 * less power per FLOP), and is it bitwise the first choice? Prints the
 * candidate's tile, stages, cluster shape and split-K.
 *
 * --fp8: the same shapes as `dflash train --fp8` runs them (gemm_fp8.cu):
 * E4M3 codes, both operands K-major ("TN"), cuBLASLt's block scales (the
 * weight per 128 x 128 and the other operand per 1 x 128; both per 1 x 128
 * for bwd_w), FP32 accumulation without fast accumulation. Is the first
 * heuristic choice the fastest FP8 kernel, above all for bwd_w, whose FP8
 * rate trails the forward's?
 * --bwdw-blk a|b: bwd_w with 128 x 128 blocks on A (x^T) or B (dy^T) instead of 1 x 128 on
 * both (another numerics: what cuBLASLt's 1D x 1D kernel costs against its 2D x 1D one). */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_check.h"
#include "lt_check.h"

#define NALGO 16
#define REPS 9

typedef struct shape {
    const char *name;
    int ta, tb;          /* as gemm.cu: matmul 1,0; bwd_x 0,0; bwd_w 0,1 */
    int64_t m, n, k;
    int c_f32, accumulate;
    int count;           /* how many times one step runs it */
} shape;

static int cmp_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* bf16 bit patterns of uniform values in [-1, 1) from a fixed LCG (cheap, host) */
static void fill_bf16(uint16_t *p, size_t n, uint64_t seed)
{
    uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        float f = (float)((s >> 40) & 0xffffff) / (float)(1 << 23) - 1.0f;
        uint32_t u;
        memcpy(&u, &f, 4);
        p[i] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
}

/* one line of cuBLASLt's configuration of an algorithm, for the log */
static void algo_desc(const cublasLtMatmulAlgo_t *a, char *buf, size_t n)
{
    int id = 0, tile = 0, stages = 0, splitk = 0, cluster = 0;
    size_t w;
    cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &w);
    cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &w);
    cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &w);
    cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &w);
    cublasLtMatmulAlgoConfigGetAttribute(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster,
                                         sizeof cluster, &w);
    snprintf(buf, n, "algo %d tile %d stages %d cluster %d splitk %d", id, tile, stages, cluster,
             splitk);
}

int main(int argc, char **argv)
{
    int sustained = 0, fp8 = 0, bwdw_blk = 0; /* 'a' or 'b': that bwd_w operand per 128 x 128 */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--sustained"))
            sustained = 1;
        else if (!strcmp(argv[i], "--fp8"))
            fp8 = 1;
        else if (!strcmp(argv[i], "--bwdw-blk") && i + 1 < argc &&
                 (!strcmp(argv[i + 1], "a") || !strcmp(argv[i + 1], "b")))
            bwdw_blk = argv[++i][0];
        else {
            fprintf(stderr, "usage: bench_gemm_algos [--sustained] [--fp8 [--bwdw-blk a|b]]\n");
            return 2;
        }
    }
    const int64_t H = 5120, QD = 4096, KD = 1024, F = 17408, N = 8192, S = 4096, KH = 5 * 5120,
                  V = 248320, R = fp8 ? 700 : 854;
    const int L = 5;
    shape sh[] = {
        /* forward: y = x w^T, m = out, n = tokens, k = in */
        {"fwd fc", 1, 0, H, S, KH, 0, 0, 1},
        {"fwd q", 1, 0, QD, N, H, 0, 0, L},
        {"fwd k/v block", 1, 0, KD, N, H, 0, 0, 2 * L},
        {"fwd k/v ctx", 1, 0, KD, S, H, 0, 0, 2 * L},
        {"fwd o", 1, 0, H, N, QD, 0, 0, L},
        {"fwd gate/up", 1, 0, F, N, H, 0, 0, 2 * L},
        {"fwd down", 1, 0, H, N, F, 0, 0, L},
        /* bwd_x: dx = dy w, m = in, n = tokens, k = out */
        {"bwd_x q", 0, 0, H, N, QD, 0, 0, L},
        {"bwd_x k/v block", 0, 0, H, N, KD, 0, 1, 2 * L},
        {"bwd_x k/v ctx", 0, 0, H, S, KD, 0, 1, 2 * L},
        {"bwd_x o", 0, 0, QD, N, H, 0, 0, L},
        {"bwd_x gate/up", 0, 0, H, N, F, 0, 1, 2 * L},
        {"bwd_x down", 0, 0, F, N, H, 0, 0, L},
        /* bwd_w: dw = dy^T x (bf16, accumulate), m = in, n = out, k = tokens */
        {"bwd_w fc", 0, 1, KH, H, S, 0, 1, 1},
        {"bwd_w q", 0, 1, H, QD, N, 0, 1, L},
        {"bwd_w k/v block", 0, 1, H, KD, N, 0, 1, 2 * L},
        {"bwd_w k/v ctx", 0, 1, H, KD, S, 0, 1, 2 * L},
        {"bwd_w o", 0, 1, QD, H, N, 0, 1, L},
        {"bwd_w gate/up", 0, 1, H, F, N, 0, 1, 2 * L},
        {"bwd_w down", 0, 1, F, H, N, 0, 1, L},
        /* the LM head per chunk of R rows (9 chunks of 854 at 7680 scored rows; with --fp8
         * the codes take memory too: 11 of 700) */
        {"lmhead logits", 1, 0, V, R, H, 1, 0, fp8 ? 11 : 9},
        {"lmhead dh", 0, 0, H, R, V, 1, 0, fp8 ? 11 : 9},
        /* the same in chunks whose rows are a multiple of 128 or 256 (not in the step's
         * total): what padding each chunk to the tiles costs */
        {"lmhead logits/128", 1, 0, V, R / 128 * 128, H, 1, 0, 0},
        {"lmhead dh/128", 0, 0, H, R / 128 * 128, V, 1, 0, 0},
        {"lmhead logits/256", 1, 0, V, R / 256 * 256, H, 1, 0, 0},
        {"lmhead dh/256", 0, 0, H, R / 256 * 256, V, 1, 0, 0},
    };
    const int ns = (int)(sizeof sh / sizeof sh[0]);
    cublasLtHandle_t lt;
    LK(cublasLtCreate(&lt));
    size_t ws_bytes = (size_t)64 << 20, maxa = 0, maxb = 0, maxc = 0;
    for (int i = 0; i < ns; i++) {
        size_t a = (size_t)(sh[i].m * sh[i].k), b = (size_t)(sh[i].k * sh[i].n),
               c = (size_t)(sh[i].m * sh[i].n) * (sh[i].c_f32 ? 2 : 1);
        maxa = a > maxa ? a : maxa, maxb = b > maxb ? b : maxb, maxc = c > maxc ? c : maxc;
    }
    void *A, *B, *C, *ws;
    CUDA_CK(cudaMalloc(&A, maxa * 2));
    CUDA_CK(cudaMalloc(&B, maxb * 2));
    CUDA_CK(cudaMalloc(&C, maxc * 2));
    CUDA_CK(cudaMalloc(&ws, ws_bytes));
    uint16_t *h = malloc((maxa > maxb ? maxa : maxb) * 2);
    fill_bf16(h, maxa, 1);
    CUDA_CK(cudaMemcpy(A, h, maxa * 2, cudaMemcpyHostToDevice));
    fill_bf16(h, maxb, 2);
    CUDA_CK(cudaMemcpy(B, h, maxb * 2, cudaMemcpyHostToDevice));
    free(h);
    float *SA = NULL, *SB = NULL; /* --fp8: every block's scale 1 (codes from the bf16 bits) */
    if (fp8) {
        size_t ns_max = 0;
        for (int i = 0; i < ns; i++) {
            size_t kb = (size_t)(sh[i].k + 127) / 128, l4 = (kb + 3) / 4 * 4;
            size_t a = kb * (size_t)sh[i].m, a2 = (size_t)(sh[i].m + 127) / 128 * l4,
                   b = kb * (size_t)sh[i].n;
            size_t b2 = (size_t)(sh[i].n + 127) / 128 * l4;
            a = a > a2 ? a : a2;
            b = b > b2 ? b : b2;
            ns_max = a > ns_max ? a : ns_max;
            ns_max = b > ns_max ? b : ns_max;
        }
        float *one = malloc(ns_max * 4);
        for (size_t i = 0; i < ns_max; i++)
            one[i] = 1.0f / 64;
        CUDA_CK(cudaMalloc((void **)&SA, ns_max * 4));
        CUDA_CK(cudaMalloc((void **)&SB, ns_max * 4));
        CUDA_CK(cudaMemcpy(SA, one, ns_max * 4, cudaMemcpyHostToDevice));
        CUDA_CK(cudaMemcpy(SB, one, ns_max * 4, cudaMemcpyHostToDevice));
        free(one);
        /* the codes: the bf16 buffers' bytes with the NaN codes (x111 1111) cleared */
        uint8_t *cb = malloc(maxa > maxb ? maxa * 2 : maxb * 2);
        for (int w = 0; w < 2; w++) {
            size_t n = (w ? maxb : maxa) * 2;
            CUDA_CK(cudaMemcpy(cb, w ? B : A, n, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < n; i++)
                cb[i] = (cb[i] & 0x7f) == 0x7f ? (uint8_t)(cb[i] & 0xf0) : cb[i];
            CUDA_CK(cudaMemcpy(w ? B : A, cb, n, cudaMemcpyHostToDevice));
        }
        free(cb);
    }
    uint8_t *out0 = malloc(maxc * 2), *out1 = malloc(maxc * 2);
    cudaStream_t st;
    CUDA_CK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    CUDA_CK(cudaEventCreate(&e0));
    CUDA_CK(cudaEventCreate(&e1));
    struct cudaDeviceProp prop;
    CUDA_CK(cudaGetDeviceProperties(&prop, 0));
    if (bwdw_blk)
        printf("bwd_w: %s per 128 x 128, the other per 1 x 128\n", bwdw_blk == 'a' ? "A (x^T)" : "B (dy^T)");
    printf("bench_gemm_algos on %s%s: per shape, cuBLASLt's first heuristic choice vs the fastest "
           "of up to %d candidates (median of %d runs each)\n", prop.name,
           fp8 ? ", E4M3 with block scales" : "", NALGO, REPS);
    printf("%-16s %6s %6s %6s %3s  %9s %7s  %9s %7s %3s  %9s %3s\n", "shape", "m", "n", "k", "x",
           "first ms", "TF/s", "best= ms", "TF/s", "#", "best ms", "#");
    double t_first = 0, t_eq = 0, t_best = 0;
    cublasLtMatmulDesc_t ops[32];
    cublasLtMatrixLayout_t las[32], lbs[32], lcs[32];
    cublasLtMatmulAlgo_t algo[32];
    int have[32] = {0};
    static cublasLtMatmulHeuristicResult_t cand[32][NALGO];
    int ncand[32] = {0}, same_as_first[32][NALGO];
    float iso_ms[32][NALGO];
    for (int i = 0; i < ns; i++) {
        const shape *p = &sh[i];
        cublasLtMatmulDesc_t op;
        cublasLtMatrixLayout_t la, lb, lc;
        cublasOperation_t ta = p->ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = p->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
        uint64_t ar = p->ta ? p->k : p->m, ac = p->ta ? p->m : p->k;
        uint64_t br = p->tb ? p->n : p->k, bc = p->tb ? p->k : p->n;
        LK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        if (fp8) { /* TN, K-major codes, the reduction padded to 128 (gemm_fp8.cu's plan) */
            uint64_t kp = (uint64_t)(p->k + 127) / 128 * 128;
            int bw = p->ta == 0 && p->tb == 1;
            int32_t ma = bw && bwdw_blk != 'a' ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                               : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                    mb = bw && bwdw_blk == 'b' ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                               : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
            int8_t fast = 0;
            const void *sa = SA, *sb = SB;
            ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
            LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof ma));
            LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof mb));
            LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
            LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa));
            LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb));
            LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, kp, (uint64_t)p->m, (int64_t)kp));
            LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, kp, (uint64_t)p->n, (int64_t)kp));
        } else {
            LK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, ar, ac, (int64_t)ar));
            LK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, br, bc, (int64_t)br));
        }
        LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
        LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
        LK(cublasLtMatrixLayoutCreate(&lc, p->c_f32 ? CUDA_R_32F : CUDA_R_16BF, (uint64_t)p->m,
                                      (uint64_t)p->n, p->m));
        cublasLtMatmulPreference_t pref;
        LK(cublasLtMatmulPreferenceCreate(&pref));
        uint64_t wsb = ws_bytes;
        LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &wsb, sizeof wsb));
        if (!p->c_f32 && !fp8) {
            uint32_t mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
            LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                    &mask, sizeof mask));
        }
        cublasLtMatmulHeuristicResult_t res[NALGO];
        int found = 0;
        LK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, NALGO, res, &found));
        ops[i] = op, las[i] = la, lbs[i] = lb, lcs[i] = lc; /* destroyed at the end */
        if (found > 0) {
            algo[i] = res[0].algo;
            have[i] = 1;
        }
        memcpy(cand[i], res, sizeof res);
        ncand[i] = found;
        for (int a = 0; a < NALGO; a++)
            same_as_first[i][a] = 0, iso_ms[i][a] = -1;
        size_t cbytes = (size_t)(p->m * p->n) * (p->c_f32 ? 4 : 2);
        float alpha = 1.0f, beta = p->accumulate ? 1.0f : 0.0f;
        double flop = 2.0 * (double)p->m * (double)p->n * (double)p->k;
        float ms_first = 0, ms_eq = 1e30f, ms_best = 1e30f;
        int i_eq = -1, i_best = -1;
        for (int a = 0; a < found; a++) {
            /* the bits: C from the same start (a 0.19-ish pattern) for each candidate */
            CUDA_CK(cudaMemsetAsync(C, 0x3e, cbytes, st));
            cublasStatus_t s1 = cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, C, lc, C, lc,
                                               &res[a].algo, ws, ws_bytes, st);
            if (s1 != CUBLAS_STATUS_SUCCESS)
                continue;
            CUDA_CK(cudaStreamSynchronize(st));
            CUDA_CK(cudaMemcpy(a == 0 ? out0 : out1, C, cbytes, cudaMemcpyDeviceToHost));
            int same = a == 0 || !memcmp(out0, out1, cbytes);
            float t[REPS];
            for (int r = 0; r < REPS; r++) {
                CUDA_CK(cudaEventRecord(e0, st));
                LK(cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, C, lc, C, lc, &res[a].algo,
                                  ws, ws_bytes, st));
                CUDA_CK(cudaEventRecord(e1, st));
                CUDA_CK(cudaEventSynchronize(e1));
                CUDA_CK(cudaEventElapsedTime(&t[r], e0, e1));
            }
            qsort(t, REPS, sizeof t[0], cmp_f);
            float ms = t[REPS / 2];
            same_as_first[i][a] = same;
            iso_ms[i][a] = ms;
            if (a == 0)
                ms_first = ms;
            if (same && ms < ms_eq)
                ms_eq = ms, i_eq = a;
            if (ms < ms_best)
                ms_best = ms, i_best = a;
        }
        if (found < 1 || i_best < 0) {
            printf("%-16s no algorithm\n", p->name);
            cublasLtMatmulPreferenceDestroy(pref);
            continue;
        }
        printf("%-16s %6lld %6lld %6lld %3d  %9.3f %7.0f  %9.3f %7.0f %3d  %9.3f %3d  (%d candidates)\n",
               p->name, (long long)p->m, (long long)p->n, (long long)p->k, p->count, ms_first,
               flop / ms_first / 1e9, ms_eq, flop / ms_eq / 1e9, i_eq, ms_best, i_best, found);
        t_first += p->count * ms_first;
        t_eq += p->count * ms_eq;
        t_best += p->count * ms_best;
        cublasLtMatmulPreferenceDestroy(pref);
    }
    printf("one step's GEMMs (x counts): first choice %.1f ms, fastest bitwise-equal %.1f ms, "
           "fastest %.1f ms\n", t_first, t_eq, t_best);
    /* sustained: no host gaps; events around the whole run */
    float alpha = 1.0f;
    int gi = 5; /* fwd gate/up */
    if (have[gi]) {
        float beta = 0.0f, ms;
        const int reps = 2000;
        CUDA_CK(cudaEventRecord(e0, st));
        for (int r = 0; r < reps; r++)
            LK(cublasLtMatmul(lt, ops[gi], &alpha, A, las[gi], B, lbs[gi], &beta, C, lcs[gi], C,
                              lcs[gi], &algo[gi], ws, ws_bytes, st));
        CUDA_CK(cudaEventRecord(e1, st));
        CUDA_CK(cudaEventSynchronize(e1));
        CUDA_CK(cudaEventElapsedTime(&ms, e0, e1));
        double flop = 2.0 * (double)sh[gi].m * (double)sh[gi].n * (double)sh[gi].k * reps;
        printf("sustained: %s x %d back to back: %.3f ms each, %.0f TFLOP/s (%.1f s)\n",
               sh[gi].name, reps, ms / reps, flop / ms / 1e9, ms / 1e3);
    }
    {
        const int iters = 20;
        double flop = 0;
        float ms;
        CUDA_CK(cudaEventRecord(e0, st));
        for (int it = 0; it < iters; it++)
            for (int i = 0; i < ns; i++) {
                if (!have[i])
                    continue;
                float beta = sh[i].accumulate ? 1.0f : 0.0f;
                for (int c = 0; c < sh[i].count; c++) {
                    LK(cublasLtMatmul(lt, ops[i], &alpha, A, las[i], B, lbs[i], &beta, C, lcs[i], C,
                                      lcs[i], &algo[i], ws, ws_bytes, st));
                    if (it == 0)
                        flop += 2.0 * (double)sh[i].m * (double)sh[i].n * (double)sh[i].k;
                }
            }
        CUDA_CK(cudaEventRecord(e1, st));
        CUDA_CK(cudaEventSynchronize(e1));
        CUDA_CK(cudaEventElapsedTime(&ms, e0, e1));
        printf("sustained: the step's GEMM mix (%.1f TFLOP) x %d back to back: %.1f ms per step, "
               "%.0f TFLOP/s\n", flop / 1e12, iters, ms / iters, flop * iters / ms / 1e9);
    }
    if (sustained) {
        /* the shapes with most of the step's FLOPs: MLP, q / o, the LM head */
        static const char *const big[] = {"fwd gate/up", "bwd_x gate/up", "bwd_w gate/up",
                                          "fwd down", "lmhead logits", "lmhead dh"};
        printf("sustained, per candidate (the first 8; ~0.6 s back to back after ~0.4 s of "
               "warm-up at the same load; isolated ms from above):\n");
        for (size_t b = 0; b < sizeof big / sizeof big[0]; b++) {
            int i = 0;
            while (i < ns && strcmp(sh[i].name, big[b]))
                i++;
            if (i == ns)
                continue;
            float beta = sh[i].accumulate ? 1.0f : 0.0f;
            double flop = 2.0 * (double)sh[i].m * (double)sh[i].n * (double)sh[i].k;
            float first_tf = 0;
            for (int a = 0; a < ncand[i] && a < 8; a++) {
                if (iso_ms[i][a] <= 0)
                    continue;
                float ms = 0;
                for (int pass = 0; pass < 2; pass++) { /* 0: warm-up to the held clock */
                    int reps = (int)((pass ? 600.0f : 400.0f) / iso_ms[i][a]) + 1;
                    CUDA_CK(cudaEventRecord(e0, st));
                    for (int r = 0; r < reps; r++)
                        LK(cublasLtMatmul(lt, ops[i], &alpha, A, las[i], B, lbs[i], &beta, C,
                                          lcs[i], C, lcs[i], &cand[i][a].algo, ws, ws_bytes, st));
                    CUDA_CK(cudaEventRecord(e1, st));
                    CUDA_CK(cudaEventSynchronize(e1));
                    CUDA_CK(cudaEventElapsedTime(&ms, e0, e1));
                }
                int reps = (int)(600.0f / iso_ms[i][a]) + 1;
                double tf = flop * reps / ms / 1e9;
                if (a == 0)
                    first_tf = (float)tf;
                char d[128];
                algo_desc(&cand[i][a].algo, d, sizeof d);
                printf("  %-14s #%-2d %s: isolated %.3f ms, sustained %.3f ms = %.0f TFLOP/s "
                       "(%+.1f%% vs first)%s\n", sh[i].name, a, d, iso_ms[i][a], ms / reps, tf,
                       a == 0 ? 0.0 : 100.0 * (tf / first_tf - 1.0),
                       same_as_first[i][a] ? ", bitwise the first" : "");
            }
        }
    }
    for (int i = 0; i < ns; i++) {
        cublasLtMatrixLayoutDestroy(las[i]);
        cublasLtMatrixLayoutDestroy(lbs[i]);
        cublasLtMatrixLayoutDestroy(lcs[i]);
        cublasLtMatmulDescDestroy(ops[i]);
    }
    cudaFree(A), cudaFree(B), cudaFree(C), cudaFree(ws), cudaFree(SA), cudaFree(SB);
    free(out0), free(out1);
    return 0;
}
