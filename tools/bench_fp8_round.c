/* bench_fp8_round - the FP8 rounding kernels (fp8_codes.cu) at the tensors one training step
 * of the Qwen3.6-27B drafter rounds (5 layers, hidden 5120, 32/8 heads x 128, MLP 17408, 8192
 * query tokens, 4096 context tokens), against the device-to-device copy of the same BF16
 * bytes: how far each mode is from the memory's rate. A measurement only (never run by
 * tests).
 *
 * Per (mode, tensor): the median of 15 timed launches (CUDA events) after a warm-up; GB/s
 * counts the BF16 read, the codes and the scales written; "copy" is cudaMemcpyAsync of the
 * BF16 bytes (read + write counted). The step's total weighs each tensor by how often a step
 * rounds it in that mode (drafter.c's calls). */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda/fp8_cuda.h"
#include "cuda_check.h"

#define REPS 15


typedef struct tensor {
    const char *name;
    int64_t r, c; /* x [r, c] */
    int per_step[4]; /* calls per step in modes 0..3 */
} tensor;

static int cmp_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static int64_t rup(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

int main(void)
{
    const int64_t H = 5120, QD = 4096, KD = 1024, F = 17408, N = 8192, S = 4096, KH = 5 * 5120;
    /* mode 0: x of a forward (1 x 128 along the features) and dy of a bwd_x; mode 1: x and dy
     * of a bwd_w (1 x 128 along the tokens); mode 2 / 3: a weight of a forward / bwd_x */
    const tensor ts[] = {
        {"x [N, H] (a, b)", N, H, {10, 10, 0, 0}},
        {"x [S, H] (cn)", S, H, {5, 5, 0, 0}},
        {"x [N, QD] (o)", N, QD, {5, 5, 0, 0}},
        {"x [N, F] (m)", N, F, {5, 5, 0, 0}},
        {"x [S, KH] (feat)", S, KH, {1, 1, 0, 0}},
        {"dy [N, H]", N, H, {10, 10, 0, 0}},
        {"dy [N, F]", N, F, {10, 10, 0, 0}},
        {"dy [N, QD]", N, QD, {5, 5, 0, 0}},
        {"dy [N, KD]", N, KD, {10, 10, 0, 0}},
        {"dy [S, KD]", S, KD, {10, 10, 0, 0}},
        {"dy [S, H] (dc)", S, H, {0, 1, 0, 0}},
        {"w [F, H] (gate/up)", F, H, {0, 0, 10, 10}},
        {"w [H, F] (down)", H, F, {0, 0, 5, 5}},
        {"w [QD, H] (q)", QD, H, {0, 0, 5, 5}},
        {"w [H, QD] (o)", H, QD, {0, 0, 5, 5}},
        {"w [KD, H] (k/v)", KD, H, {0, 0, 20, 20}},
        {"w [H, KH] (fc)", H, KH, {0, 0, 1, 0}},
    };
    const int nt = (int)(sizeof ts / sizeof ts[0]);
    size_t maxe = 0;
    for (int i = 0; i < nt; i++)
        maxe = (size_t)(ts[i].r * ts[i].c) > maxe ? (size_t)(ts[i].r * ts[i].c) : maxe;
    uint16_t *x, *y, *h = malloc(maxe * 2);
    uint8_t *codes;
    float *sc;
    size_t sc_max = maxe / 64 + 4096;
    CUDA_CK(cudaMalloc((void **)&x, maxe * 2));
    CUDA_CK(cudaMalloc((void **)&y, maxe * 2));
    CUDA_CK(cudaMalloc((void **)&codes, maxe + (1 << 20)));
    CUDA_CK(cudaMalloc((void **)&sc, sc_max * 4));
    uint64_t s = 88172645463325252ull;
    for (size_t i = 0; i < maxe; i++) { /* bf16 of magnitudes 2^-8 .. 2^8, both signs */
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        h[i] = (uint16_t)(((s >> 20) & 0x8000u) | (0x3b80u + (uint16_t)((s >> 32) % 0x800u)) | (s & 0x7fu));
    }
    CUDA_CK(cudaMemcpy(x, h, maxe * 2, cudaMemcpyHostToDevice));
    free(h);
    cudaStream_t st;
    CUDA_CK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    CUDA_CK(cudaEventCreate(&e0));
    CUDA_CK(cudaEventCreate(&e1));
    struct cudaDeviceProp prop;
    CUDA_CK(cudaGetDeviceProperties(&prop, 0));
    printf("bench_fp8_round on %s: median of %d launches per (mode, tensor)\n", prop.name, REPS);
    printf("%-20s %4s  %9s %7s  %9s %7s  %5s\n", "tensor", "mode", "us", "GB/s", "copy us", "GB/s",
           "x copy");
    double step_us[4] = {0}, step_copy_us[4] = {0};
    for (int i = 0; i < nt; i++) {
        const tensor *t = &ts[i];
        size_t bytes = (size_t)(t->r * t->c) * 2;
        float tc[REPS];
        for (int r = -1; r < REPS; r++) {
            CUDA_CK(cudaEventRecord(e0, st));
            CUDA_CK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice, st));
            CUDA_CK(cudaEventRecord(e1, st));
            CUDA_CK(cudaEventSynchronize(e1));
            if (r >= 0)
                CUDA_CK(cudaEventElapsedTime(&tc[r], e0, e1));
        }
        qsort(tc, REPS, sizeof tc[0], cmp_f);
        float copy_ms = tc[REPS / 2];
        for (int mode = 0; mode < 4; mode++) {
            if (!t->per_step[mode])
                continue;
            int tr = mode == 1 || mode == 3;
            int64_t red = tr ? t->r : t->c, rows = tr ? t->c : t->r, kp = rup(red, 128);
            int64_t n_out = mode == 0 ? rup(rows, 4) : rows;
            size_t nsc = mode >= 2 ? (size_t)(rup(rows, 128) / 128 * rup(kp / 128, 4)) : (size_t)(kp / 128 * n_out);
            size_t wbytes = (size_t)(n_out * kp) + nsc * 4;
            float tk[REPS];
            for (int r = -1; r < REPS; r++) {
                CUDA_CK(cudaEventRecord(e0, st));
                if (df_cuda_fp8_codes_run(st, mode, x, t->c, t->r, t->c, codes, kp, sc, n_out, 1)) {
                    fprintf(stderr, "launch failed: %s mode %d\n", t->name, mode);
                    return 1;
                }
                CUDA_CK(cudaEventRecord(e1, st));
                CUDA_CK(cudaEventSynchronize(e1));
                if (r >= 0)
                    CUDA_CK(cudaEventElapsedTime(&tk[r], e0, e1));
            }
            qsort(tk, REPS, sizeof tk[0], cmp_f);
            float ms = tk[REPS / 2];
            printf("%-20s %4d  %9.1f %7.0f  %9.1f %7.0f  %5.2f\n", t->name, mode, 1e3 * ms,
                   (double)(bytes + wbytes) / ms / 1e6, 1e3 * copy_ms, 2.0 * (double)bytes / copy_ms / 1e6,
                   ms / copy_ms);
            step_us[mode] += t->per_step[mode] * 1e3 * ms;
            /* the copy's rate at this mode's bytes: the floor for a pass that reads and writes them */
            step_copy_us[mode] += t->per_step[mode] * 1e3 * copy_ms * (double)(bytes + wbytes) / (2.0 * (double)bytes);
        }
    }
    static const char *const what[4] = {"rows (fwd x, bwd_x dy)", "columns (bwd_w x, dy)",
                                        "128x128 (fwd w)", "128x128^T (bwd_x w)"};
    double tot = 0, tot_c = 0;
    for (int m = 0; m < 4; m++) {
        printf("one step, mode %d %-24s %8.2f ms (at the copy's rate %.2f ms)\n", m, what[m],
               step_us[m] / 1e3, step_copy_us[m] / 1e3);
        tot += step_us[m], tot_c += step_copy_us[m];
    }
    printf("one step, all modes: %.2f ms (at the copy's rate %.2f ms)\n", tot / 1e3, tot_c / 1e3);
    cudaFree(x), cudaFree(y), cudaFree(codes), cudaFree(sc);
    return 0;
}
