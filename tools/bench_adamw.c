/* bench_adamw - the GPU AdamW kernels (optim.cu) at the trainer's configuration (BF16
 * gradients, the BF16 weights written) and a bucket of the Qwen3.6-27B drafter (one layer:
 * 320M parameters), against the device-to-device copy: how far each moments layout is from the
 * memory's rate, and what a step's 1.73G parameters take at that rate. A measurement only
 * (never run by tests).
 *
 * Per layout: the median of 11 timed calls (CUDA events on the backend's stream) after a
 * warm-up; GB/s counts every byte read and written (master 4 + 4, grad 2, m and v 2 + 2 or
 * 4 + 4 each, weights 2); "copy" is cudaMemcpyAsync of as many bytes (half read, half
 * written). */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_check.h"
#include "err.h"
#include "ops.h"
#include "train_ops.h"

#define REPS 11

static int cmp_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    const int64_t n = argc > 1 ? atoll(argv[1]) : 320LL << 20, step_params = 1730213120LL;
    if (n < 1024) {
        fprintf(stderr, "usage: bench_adamw [N >= 1024 parameters]\n");
        return 2;
    }
    df_err e = {0};
    df_backend *be = df_backend_cuda_open(0, &e);
    if (!be) {
        fprintf(stderr, "bench_adamw: no CUDA backend: %s\n", e.msg);
        return 1;
    }
    cudaStream_t st = (cudaStream_t)df_backend_cuda_stream(be);
    float *p = df_backend_alloc(be, (size_t)n * 4), *m = df_backend_alloc(be, (size_t)n * 4),
          *v = df_backend_alloc(be, (size_t)n * 4);
    uint16_t *g = df_backend_alloc(be, (size_t)n * 2), *w = df_backend_alloc(be, (size_t)n * 2);
    void *cp = df_backend_alloc(be, (size_t)n * 28); /* the largest layout's bytes */
    if (!p || !m || !v || !g || !w || !cp) {
        fprintf(stderr, "bench_adamw: out of GPU memory for %lld parameters\n", (long long)n);
        return 1;
    }
    /* p 0.02, the gradient bf16 1e-3, the moments small and positive: ordinary values */
    float *hp = malloc((size_t)n * 4);
    uint16_t *hg = malloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++)
        hp[i] = 0.02f * (float)((i * 2654435761u) % 1000) / 1000.0f, hg[i] = 0x3a83; /* 1e-3 */
    CUDA_CK(cudaMemcpy(p, hp, (size_t)n * 4, cudaMemcpyHostToDevice));
    CUDA_CK(cudaMemcpy(g, hg, (size_t)n * 2, cudaMemcpyHostToDevice));
    CUDA_CK(cudaMemset(m, 0, (size_t)n * 4));
    CUDA_CK(cudaMemset(v, 0, (size_t)n * 4));
    free(hp), free(hg);
    cudaEvent_t e0, e1;
    CUDA_CK(cudaEventCreate(&e0));
    CUDA_CK(cudaEventCreate(&e1));
    struct cudaDeviceProp prop;
    CUDA_CK(cudaGetDeviceProperties(&prop, 0));
    printf("bench_adamw on %s: %lld parameters, BF16 gradients, BF16 weights out; median of %d\n",
           prop.name, (long long)n, REPS);
    printf("%-22s %6s %9s %7s %9s %7s %6s %12s\n", "moments", "B/par", "ms", "GB/s", "copy ms",
           "GB/s", "x copy", "1.73G par ms");
    static const char *const names[3] = {"m, v F32", "m BF16, v F32", "m, v BF16"};
    static const int bpp[3] = {28, 24, 20}; /* bytes moved per parameter */
    for (int k = 0; k < 3; k++) {
        float t[REPS], tc[REPS];
        size_t bytes = (size_t)n * (size_t)bpp[k];
        for (int r = -1; r < REPS; r++) {
            CUDA_CK(cudaEventRecord(e0, st));
            int rc = k == 0 ? df_op_adamw(be, p, g, DF_DTYPE_BF16, m, v, n, 1e-4f, 0.9f, 0.999f,
                                          1e-8f, 0.0f, 10 + r, 1.0f, w)
                            : df_op_adamw_m16(be, p, g, DF_DTYPE_BF16, (uint16_t *)m, v,
                                              k == 1 ? DF_DTYPE_F32 : DF_DTYPE_BF16, n, 1e-4f,
                                              0.9f, 0.999f, 1e-8f, 0.0f, 10 + r, 1.0f, 77, 0, w);
            if (rc) {
                fprintf(stderr, "bench_adamw: %s failed: %d\n", names[k], rc);
                return 1;
            }
            CUDA_CK(cudaEventRecord(e1, st));
            CUDA_CK(cudaEventSynchronize(e1));
            if (r >= 0)
                CUDA_CK(cudaEventElapsedTime(&t[r], e0, e1));
            CUDA_CK(cudaEventRecord(e0, st));
            CUDA_CK(cudaMemcpyAsync((char *)cp + bytes / 2, cp, bytes / 2, cudaMemcpyDeviceToDevice, st));
            CUDA_CK(cudaEventRecord(e1, st));
            CUDA_CK(cudaEventSynchronize(e1));
            if (r >= 0)
                CUDA_CK(cudaEventElapsedTime(&tc[r], e0, e1));
        }
        qsort(t, REPS, sizeof t[0], cmp_f);
        qsort(tc, REPS, sizeof tc[0], cmp_f);
        float ms = t[REPS / 2], cms = tc[REPS / 2];
        printf("%-22s %6d %9.3f %7.0f %9.3f %7.0f %6.2f %12.2f\n", names[k], bpp[k], ms,
               (double)bytes / ms / 1e6, cms, (double)bytes / cms / 1e6, ms / cms,
               ms * (double)step_params / (double)n);
    }
    /* FP8 training's kept weight codes (df_backend_fp8_keep_weight_codes): one bucket laid out
     * as a layer of the Qwen3.6-27B drafter (the norms between the matrices), m BF16, the
     * weights' codes written in both layouts by AdamW, against the same call with nothing kept
     * (its weights elsewhere) and the step's figure at that rate */
    {
        static const int64_t shp[][2] = {{5120, 1}, {4096, 5120}, {1024, 5120}, {1024, 5120},
                                         {5120, 4096}, {256, 1}, {256, 1}, {5120, 1},
                                         {17408, 5120}, {17408, 5120}, {5120, 17408}};
        const int ns = (int)(sizeof shp / sizeof shp[0]);
        int64_t at = 0;
        for (int i = 0; i < ns; i++)
            at += shp[i][0] * shp[i][1];
        uint16_t *w2 = at <= n ? df_backend_alloc(be, (size_t)at * 2) : NULL;
        if (!w2 || !df_backend_fp8_tensor_cores(be)) {
            printf("kept codes: not measured (%s)\n", w2 ? "no E4M3 tensor cores" : "N below a layer");
        } else {
            int kept = 0;
            for (int64_t i = 0, o = 0; i < ns; o += shp[i][0] * shp[i][1], i++) {
                df_tensor t = df_tensor_2d(w2 + o, DF_DTYPE_BF16, shp[i][0], shp[i][1]);
                kept += shp[i][1] > 1 && df_backend_fp8_keep_weight_codes(be, &t) == 1;
            }
            float t[2][REPS];
            for (int r = -1; r < REPS; r++)
                for (int k = 0; k < 2; k++) {
                    CUDA_CK(cudaEventRecord(e0, st));
                    int rc = df_op_adamw_m16(be, p, g, DF_DTYPE_BF16, (uint16_t *)m, v, DF_DTYPE_F32,
                                             at, 1e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, 10 + r, 1.0f, 77,
                                             0, k ? w2 : w);
                    if (rc) {
                        fprintf(stderr, "bench_adamw: kept codes failed: %d\n", rc);
                        return 1;
                    }
                    CUDA_CK(cudaEventRecord(e1, st));
                    CUDA_CK(cudaEventSynchronize(e1));
                    if (r >= 0)
                        CUDA_CK(cudaEventElapsedTime(&t[k][r], e0, e1));
                }
            for (int k = 0; k < 2; k++) {
                qsort(t[k], REPS, sizeof t[k][0], cmp_f);
                float ms = t[k][REPS / 2];
                printf("%-22s %6d %9.3f %7.0f %9s %7s %6s %12.2f\n",
                       k ? "m BF16, codes kept" : "m BF16, a layer", k ? 26 : 24, ms,
                       (double)at * (k ? 26 : 24) / ms / 1e6, "-", "-", "-",
                       ms * (double)step_params / (double)at);
            }
            printf("(a layer: %lld parameters, %d matrices kept)\n", (long long)at, kept);
            df_backend_free(be, w2);
        }
    }
    df_backend_free(be, p), df_backend_free(be, m), df_backend_free(be, v);
    df_backend_free(be, g), df_backend_free(be, w), df_backend_free(be, cp);
    df_backend_close(be);
    return 0;
}
