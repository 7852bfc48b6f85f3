/* bench_lmhead_chunks - the LM head's two E4M3 GEMMs of one 27B training step (7680 scored rows,
 * hidden 5120, vocab 248320) at each chunk size the fused LM head + CE could take: which row
 * count a chunk should have. A measurement only (never run by tests).
 *
 * Per chunk of R rows the step runs GEMM 1 (the logits, V x R, K = H: FP32 out, or FP16 with
 * --f16) and GEMM 2 (dh, H x R, K = V, FP32 out), as kernels/cuda/gemm_fp8.cu sets them up: TN,
 * K-major E4M3 codes, the head per 128 x 128 block and the rows per 1 x 128, FP32 accumulation
 * without fast accumulation, cuBLASLt's first heuristic choice. GEMM 2's output is H x R: 40
 * tiles of 128 along H times R / 128, so its waves over the SMs move with R; GEMM 1 reads the
 * head's codes once per chunk.
 *
 * For each R: ceil(7680 / R) chunks (the last one what is left, rounded up to 4 rows as the
 * trainer rounds them), logits then dh per chunk, the whole step's sequence back to back 10
 * times after a warm-up (no host gaps, the power limit's clock), events around it. Prints
 * ms per step, TFLOP/s, and the chunk buffers' bytes per row (the trainer's layout: logits at
 * 4 or 2 bytes, the fp32 dh chunk, the codes of h and G).
 *
 * usage: bench_lmhead_chunks [--f16] [R ...]   (default R: 128 256 384 512 640 768 1024 1280
 * 1536 2048 2560 3840) */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_check.h"
#include "lt_check.h"

enum { NROWS = 7680, H = 5120, V = 248320, MAXR = 16 };

typedef struct gemm {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
    int64_t m, n, k;
} gemm;

/* one E4M3 GEMM C (m x n, ctype) = A^T B over k (A: k x m codes, B: k x n codes, both
 * K-major), A per 128 x 128 block, B per 1 x 128; 0 when cuBLASLt has no algorithm */
static int gemm_make(cublasLtHandle_t lt, gemm *g, int64_t m, int64_t n, int64_t k,
                     cudaDataType_t ctype, const float *sa, const float *sb, size_t ws)
{
    memset(g, 0, sizeof *g);
    g->m = m, g->n = n, g->k = k;
    const uint64_t kp = (uint64_t)(k + 127) / 128 * 128;
    const int32_t ma = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                  mb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const int8_t fast = 0;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LK(cublasLtMatmulDescCreate(&g->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    LK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof ma));
    LK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof mb));
    LK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    LK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa));
    LK(cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb));
    LK(cublasLtMatrixLayoutCreate(&g->a, CUDA_R_8F_E4M3, kp, (uint64_t)m, (int64_t)kp));
    LK(cublasLtMatrixLayoutCreate(&g->b, CUDA_R_8F_E4M3, kp, (uint64_t)n, (int64_t)kp));
    LK(cublasLtMatrixLayoutCreate(&g->c, ctype, (uint64_t)m, (uint64_t)n, m));
    cublasLtMatmulPreference_t pref;
    LK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t wsb = ws;
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                            sizeof wsb));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt, g->op, g->a, g->b, g->c, g->c, pref, 1,
                                                      &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS || found < 1)
        return 0;
    g->algo = res.algo;
    return 1;
}

static void gemm_free(gemm *g)
{
    cublasLtMatrixLayoutDestroy(g->a);
    cublasLtMatrixLayoutDestroy(g->b);
    cublasLtMatrixLayoutDestroy(g->c);
    cublasLtMatmulDescDestroy(g->op);
}

static void gemm_run(cublasLtHandle_t lt, const gemm *g, const void *a, const void *b, void *c,
                     void *ws, size_t wsb, cudaStream_t st)
{
    const float alpha = 1.0f, beta = 0.0f;
    LK(cublasLtMatmul(lt, g->op, &alpha, a, g->a, b, g->b, &beta, c, g->c, c, g->c, &g->algo, ws,
                      wsb, st));
}

int main(int argc, char **argv)
{
    int f16 = 0, nr = 0;
    int64_t rs[MAXR];
    for (int i = 1; i < argc; i++) {
        char *end;
        long r = strtol(argv[i], &end, 10);
        if (!strcmp(argv[i], "--f16"))
            f16 = 1;
        else if (*end == 0 && r >= 4 && r <= NROWS && nr < MAXR)
            rs[nr++] = r;
        else {
            fprintf(stderr, "usage: bench_lmhead_chunks [--f16] [R ...] (4 <= R <= %d, at most "
                            "%d)\n", NROWS, MAXR);
            return 2;
        }
    }
    if (!nr) {
        static const int64_t def[] = {128, 256, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 2560, 3840};
        nr = (int)(sizeof def / sizeof def[0]);
        memcpy(rs, def, sizeof def);
    }
    int64_t rmax = 0;
    for (int i = 0; i < nr; i++)
        rmax = rs[i] > rmax ? rs[i] : rmax;
    rmax = (rmax + 3) / 4 * 4;
    /* the codes: a byte pattern without E4M3's NaN (x111 1111), every scale 2^-10 */
    const size_t head = (size_t)V * H, ws = (size_t)64 << 20;
    const size_t rowc = (size_t)rmax * (size_t)(V > H ? V : H);
    uint8_t *pat = malloc(head);
    if (!pat)
        return 1;
    uint64_t s = 7;
    for (size_t i = 0; i < head; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        uint8_t b = (uint8_t)(s >> 56);
        pat[i] = (b & 0x7f) == 0x7f ? (uint8_t)(b & 0xf0) : b;
    }
    void *hc, *rc, *c, *w;
    float *sc;
    const size_t nsc = (size_t)(V / 128 + 1) * (H / 128 + 4) + (size_t)rmax * (V / 128 + 1);
    CUDA_CK(cudaMalloc(&hc, head));
    CUDA_CK(cudaMalloc(&rc, rowc));
    CUDA_CK(cudaMalloc(&c, (size_t)rmax * V * 4));
    CUDA_CK(cudaMalloc(&w, ws));
    CUDA_CK(cudaMalloc((void **)&sc, nsc * 4));
    CUDA_CK(cudaMemcpy(hc, pat, head, cudaMemcpyHostToDevice));
    CUDA_CK(cudaMemcpy(rc, pat, rowc < head ? rowc : head, cudaMemcpyHostToDevice));
    free(pat);
    float *one = malloc(nsc * 4);
    for (size_t i = 0; i < nsc; i++)
        one[i] = 1.0f / 1024; /* FP16 logits stay finite: |sum| <= 5120 (448 / 1024)^2 */
    CUDA_CK(cudaMemcpy(sc, one, nsc * 4, cudaMemcpyHostToDevice));
    free(one);
    cublasLtHandle_t lt;
    LK(cublasLtCreate(&lt));
    cudaStream_t st;
    CUDA_CK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    CUDA_CK(cudaEventCreate(&e0));
    CUDA_CK(cudaEventCreate(&e1));
    struct cudaDeviceProp prop;
    CUDA_CK(cudaGetDeviceProperties(&prop, 0));
    const cudaDataType_t zt = f16 ? CUDA_R_16F : CUDA_R_32F;
    const size_t per_row = (size_t)(V + 7) / 8 * 8 * (f16 ? 2 : 4) + (size_t)H * 4 +
                           (size_t)(H + 127) / 128 * 128 + (size_t)(V + 127) / 128 * 128;
    printf("bench_lmhead_chunks on %s (%d SMs): the LM head's E4M3 GEMMs of one step, %d rows, "
           "H %d, V %d, logits %s; chunk buffers %zu bytes a row\n", prop.name,
           prop.multiProcessorCount, NROWS, H, V, f16 ? "FP16" : "FP32", per_row);
    printf("%6s %7s %12s %10s %9s %8s %10s\n", "rows", "chunks", "dh 128-tiles", "ms/step", "TFLOP/s",
           "vs 512", "buf MiB");
    double ms512 = 0;
    for (int pass = 0; pass < 2; pass++) /* pass 0 finds 512's time for the ratio */
        for (int i = 0; i < nr; i++) {
            const int64_t R = rs[i];
            if (pass == 0 && R != 512)
                continue;
            /* the chunks: R rows each, the last what is left, rounded up to 4 */
            const int nch = (int)((NROWS + R - 1) / R);
            const int64_t last = (NROWS - (int64_t)(nch - 1) * R + 3) / 4 * 4, full = (R + 3) / 4 * 4;
            gemm g1[2], g2[2];
            int ok = 1;
            for (int j = 0; j < 2 && ok; j++) {
                int64_t n = j ? last : full;
                ok = gemm_make(lt, &g1[j], V, n, H, zt, sc, sc, ws) &&
                     gemm_make(lt, &g2[j], H, n, V, CUDA_R_32F, sc, sc, ws);
            }
            if (!ok) {
                printf("%6lld no algorithm\n", (long long)R);
                continue;
            }
            const int iters = 10;
            float ms = 0;
            for (int t = 0; t < 2; t++) { /* 0: warm-up to the clock the power limit holds */
                CUDA_CK(cudaEventRecord(e0, st));
                for (int it = 0; it < (t ? iters : 4); it++)
                    for (int k = 0; k < nch; k++) {
                        const int j = k == nch - 1;
                        gemm_run(lt, &g1[j], hc, rc, c, w, ws, st);
                        gemm_run(lt, &g2[j], hc, rc, c, w, ws, st);
                    }
                CUDA_CK(cudaEventRecord(e1, st));
                CUDA_CK(cudaEventSynchronize(e1));
                CUDA_CK(cudaEventElapsedTime(&ms, e0, e1));
            }
            ms /= iters;
            if (R == 512)
                ms512 = ms;
            if (pass == 1) {
                const double flop = 2.0 * 2.0 * (double)NROWS * H * V;
                printf("%6lld %7d %12lld %10.3f %9.0f %+7.1f%% %10.1f\n", (long long)R, nch,
                       (long long)((H / 128) * ((full + 127) / 128)), ms, flop / ms / 1e9,
                       ms512 > 0 ? 100.0 * (ms / ms512 - 1.0) : 0.0,
                       (double)per_row * (double)full / (1 << 20));
            }
            for (int j = 0; j < 2; j++)
                gemm_free(&g1[j]), gemm_free(&g2[j]);
        }
    cudaFree(hc), cudaFree(rc), cudaFree(c), cudaFree(w), cudaFree(sc);
    cublasLtDestroy(lt);
    return 0;
}
