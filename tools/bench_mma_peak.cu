// bench_mma_peak - the ceiling of the portable kernels' instruction: mma.sync
// on this GPU, for bf16 -> f32 (m16n8k16: what the portable attention runs),
// f16 -> f16 (consumer GPUs may run f32 accumulation at half that rate: the
// two side by side show it) and e4m3 -> f32 (m16n8k32, sm_89 and later).
// Every warp issues independent mma.syncs on register operands (no memory
// traffic), 8 accumulators per warp so no mma waits on the previous one;
// grid: CTAS_PER_SM x SMs CTAs of WARPS warps. Also the same with one
// ldmatrix.x4 per two mmas from shared memory (the portable kernels' ratio
// in their inner products): how much of the ceiling is left once operands
// come from shared memory. Prints TFLOP/s (median of 9) per configuration
// and FLOP per SM per clock at the device's max clock (nvidia-smi next to
// it tells the power cap's effect). Never run by tests.
// Usage: bench_mma_peak [iterations]
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#include "cuda_check.h"

// The mma of kind K on accumulator set j: 0 bf16 -> f32 (m16n8k16), 1 f16 ->
// f16 (m16n8k16: consumer GPUs may run f32 accumulation at half this rate),
// 2 e4m3 -> f32 (m16n8k32, sm_89 and later). Accumulators: 4 floats (kinds
// 0, 2) or 2 words of f16 pairs (kind 1), in acc[j][0..3].
template <int K>
__device__ __forceinline__ void mma(uint32_t (*acc)[4], int j, const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    uint32_t *c = acc[j];
    if (K == 0)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};\n"
                     : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else if (K == 1)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3,%4,%5}, "
                     "{%6,%7}, {%0,%1};\n"
                     : "+r"(c[0]), "+r"(c[1])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                     "{%8,%9}, {%0,%1,%2,%3};\n"
                     : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
    }
}

// LDSM: 0 = register operands only; 1 = one ldmatrix.x4 (B operands of two
// mmas) per two mmas, from a 16 KiB shared tile, conflict-free addresses.
// Operand values stay small (the sums neither overflow nor go subnormal).
template <int K, int LDSM>
__global__ void mma_kernel(int iters, float *sink)
{
    __shared__ __align__(16) uint16_t tile[64 * 128];
    int lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i < 64 * 128; i += blockDim.x)
        tile[i] = (uint16_t)(K == 2 ? 0x2020 : 0x3c00 + (i & 7)); // 2^-7 as bf16, ~1 as f16, 2^-3 pairs as e4m3
    __syncthreads();
    const uint32_t v = K == 0 ? 0x3c003c00u : K == 1 ? 0x20002000u : 0x20202020u; // 2^-7 (bf16, f16), 2^-3 (e4m3)
    uint32_t a[4] = {v, v, v, v}, b[8][2];
    for (int j = 0; j < 8; j++)
        b[j][0] = b[j][1] = v;
    uint32_t c[8][4] = {};
    // lane's row of the 8 x 8 matrices: 16-byte rows, pitch 272 bytes (conflict-free)
    uint32_t base = (uint32_t)__cvta_generic_to_shared(tile) + (uint32_t)((lane & 15) * 272 + (lane >> 4) * 16);
    for (int it = 0; it < iters; it++) {
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            if (LDSM) {
                uint32_t r[4];
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                             : "r"(base + (uint32_t)(((it + j) & 3) * 32)));
                mma<K>(c, j, a, r[0], r[1]);
                mma<K>(c, j + 1, a, r[2], r[3]);
            } else {
                mma<K>(c, j, a, b[j][0], b[j][1]);
                mma<K>(c, j + 1, a, b[j + 1][0], b[j + 1][1]);
            }
        }
    }
    uint32_t s = 0;
    for (int j = 0; j < 8; j++)
        s ^= c[j][0] ^ c[j][1] ^ c[j][2] ^ c[j][3];
    if (s == 0x12345u) // (practically) never: keeps the products live
        sink[threadIdx.x] = (float)s;
}

template <int K, int LDSM> void launch(dim3 g, dim3 b, int iters, float *sink)
{
    mma_kernel<K, LDSM><<<g, b>>>(iters, sink);
}

int main(int argc, char **argv)
{
    int iters = argc > 1 ? atoi(argv[1]) : 4096;
    if (iters <= 0) {
        fprintf(stderr, "usage: bench_mma_peak [iterations > 0]\n");
        return 2;
    }
    int dev = 0, sms = 0, major = 0, minor = 0, clk_khz = 0;
    CUDA_CK(cudaGetDevice(&dev));
    CUDA_CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    CUDA_CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    CUDA_CK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    CUDA_CK(cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, dev));
    cudaDeviceProp prop;
    CUDA_CK(cudaGetDeviceProperties(&prop, dev));
    printf("bench_mma_peak: %s (sm_%d%d, %d SMs, max clock %d MHz), %d iterations\n", prop.name, major, minor,
           sms, clk_khz / 1000, iters);
    float *sink;
    CUDA_CK(cudaMalloc(&sink, 1024 * sizeof(float)));
    cudaEvent_t e0, e1;
    CUDA_CK(cudaEventCreate(&e0));
    CUDA_CK(cudaEventCreate(&e1));
    const int warps_list[] = {4, 8, 16};
    const int ctas_list[] = {1, 2};
    static const char *const kinds[3] = {"bf16 -> f32", "f16 -> f16", "e4m3 -> f32"};
    void (*const fns[3][2])(dim3, dim3, int, float *) = {
        {launch<0, 0>, launch<0, 1>}, {launch<1, 0>, launch<1, 1>}, {launch<2, 0>, launch<2, 1>}};
    printf("%-12s %-24s %6s %6s %10s %10s\n", "kind", "operands", "warps", "CTA/SM", "TFLOP/s", "per SM clk");
    for (int kind = 0; kind < 3; kind++) {
        if (kind == 2 && major * 10 + minor < 89) {
            printf("%-12s (needs sm_89 or later)\n", kinds[kind]);
            continue;
        }
        for (int ldsm = 0; ldsm < 2; ldsm++)
            for (int wi = 0; wi < 3; wi++)
                for (int ci = 0; ci < 2; ci++) {
                    int warps = warps_list[wi], cps = ctas_list[ci];
                    dim3 grid((unsigned)(sms * cps)), block((unsigned)(warps * 32));
                    std::vector<float> ms;
                    for (int r = 0; r < 10; r++) {
                        CUDA_CK(cudaEventRecord(e0));
                        fns[kind][ldsm](grid, block, iters, sink);
                        CUDA_CK(cudaEventRecord(e1));
                        CUDA_CK(cudaEventSynchronize(e1));
                        CUDA_CK(cudaGetLastError());
                        float t;
                        CUDA_CK(cudaEventElapsedTime(&t, e0, e1));
                        if (r > 0) // the first: warm-up
                            ms.push_back(t);
                    }
                    std::sort(ms.begin(), ms.end());
                    double med = ms[ms.size() / 2];
                    double flop = 2.0 * 16 * 8 * (kind == 2 ? 32 : 16) * 8 * (double)iters * warps * grid.x;
                    // FLOP per SM per clock at the max clock (the ceiling in the unit ncu reports)
                    double fpc = flop / sms / (med * 1e-3) / (clk_khz * 1e3);
                    printf("%-12s %-24s %6d %6d %10.1f %10.0f\n", kinds[kind],
                           ldsm ? "ldmatrix.x4 per 2 mma" : "registers", warps, cps, flop / (med * 1e-3) / 1e12, fpc);
                }
    }
    cudaFree(sink);
    return 0;
}
