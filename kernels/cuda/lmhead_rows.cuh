/* lmhead_rows.cuh - what the LM head's row kernels share (lmhead_ce.cu's
 * two-pass rows, lmhead_onepass.cu's one pass): the row block's shape, the
 * active-row rule, and the row statistics (max, argmax, sum of exp(z -
 * max)) merged over the block by fixed trees, so both give the same loss
 * from the same per-thread partials. Internal (anonymous namespace). */
#ifndef DF_CUDA_LMHEAD_ROWS_CUH
#define DF_CUDA_LMHEAD_ROWS_CUH

#include <cuda_fp16.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>

#include "bf16.cuh"

namespace {

constexpr int RT = 512;              /* threads per row block */
constexpr int RU = 8;                /* logits per thread per tile (loads in flight) */
constexpr int TILE = RT * RU;        /* logits per tile */
constexpr int NW = RT / 32;          /* warps per row block */
/* DFLASH_CE_ROWS_OCC4's blocks per SM: 4 where an SM holds 2048 threads, 3 where it holds
 * 1536 (sm_86, sm_87, sm_89, sm_120: 4 x RT is past their limit, which ptxas ignores) */
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || \
                               __CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
#define CE_ROWS_MINB4 3
#else
#define CE_ROWS_MINB4 4
#endif

/* A row is active (contributes loss and gradient) as on the CPU, plus the
 * device-only rule: a label >= V is ignored, never read. !(w > 0) also
 * ignores a NaN weight, as the CPU's `weight > 0` test does. */
__device__ __forceinline__ int row_active(int32_t lab, float w, int64_t V)
{
    return lab >= 0 && (int64_t)lab < V && w > 0.0f;
}

/* Merges (max m, argmax i, sum s of exp(z - m)) with another such triple.
 * Commutative; on equal maxima the lower index wins (the CPU's first max). */
__device__ __forceinline__ void merge(float &m, int &i, double &s, float m2, int i2, double s2)
{
    float M = fmaxf(m, m2);
    double a = s != 0.0 ? s * exp((double)m - (double)M) : 0.0;
    double b = s2 != 0.0 ? s2 * exp((double)m2 - (double)M) : 0.0;
    i = m2 > m ? i2 : (m > m2 ? i : min(i, i2));
    m = M;
    s = a + b;
}

/* The logits' storage: fp32 (float), bf16 (uint16_t, DF_CE_BF16_LOGITS), fp16 (__half,
 * DF_CE_F16_LOGITS where GEMM 1 wrote them so), or fp32 read as their fp16 rounding
 * (f32r16: DF_CE_F16_LOGITS where GEMM 1 wrote fp32) */
struct f32r16 {
    float v;
};
__device__ __forceinline__ float r16(float x) { return __half2float(__float2half_rn(x)); }

/* A logit, widened */
__device__ __forceinline__ float zld(const float *p) { return *p; }
__device__ __forceinline__ float zld(const uint16_t *p) { return bf2f(*p); }
__device__ __forceinline__ float zld(const __half *p) { return __half2float(*p); }
__device__ __forceinline__ float zld(const f32r16 *p) { return r16(p->v); }

/* 8 consecutive fp32 logits from a 32-byte aligned address (bf16.cuh's load8 reads bf16 ones) */
__device__ __forceinline__ void load8(const float *p, float *x)
{
    float4 p0 = *reinterpret_cast<const float4 *>(p);
    float4 p1 = *reinterpret_cast<const float4 *>(p + 4);
    x[0] = p0.x, x[1] = p0.y, x[2] = p0.z, x[3] = p0.w;
    x[4] = p1.x, x[5] = p1.y, x[6] = p1.z, x[7] = p1.w;
}
/* 8 consecutive fp16 logits from a 16-byte aligned address */
__device__ __forceinline__ void load8(const __half *p, float *x)
{
    uint4 u = *reinterpret_cast<const uint4 *>(p);
    const __half2 *h = reinterpret_cast<const __half2 *>(&u);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float2 f = __half22float2(h[j]);
        x[2 * j] = f.x, x[2 * j + 1] = f.y;
    }
}
/* 8 consecutive fp32 logits (32-byte aligned) as their fp16 rounding */
__device__ __forceinline__ void load8(const f32r16 *p, float *x)
{
    load8(reinterpret_cast<const float *>(p), x);
#pragma unroll
    for (int j = 0; j < 8; j++)
        x[j] = r16(x[j]);
}

/* A warp's (max, argmax, sum) merged into lane 0 by a fixed shuffle tree */
__device__ __forceinline__ void warp_stats(float &m, int &am, double &s)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_down_sync(0xffffffffu, m, o);
        int i2 = __shfl_down_sync(0xffffffffu, am, o);
        double s2 = __shfl_down_sync(0xffffffffu, s, o);
        merge(m, am, s, m2, i2, s2);
    }
}

/* The block's (max, argmax, sum) from each thread's: each warp's, then warp
 * 0 over the warps (fixed trees). The result is thread 0's; sh_*: NW
 * entries of shared memory each. The whole block calls it (a barrier
 * inside). */
__device__ __forceinline__ void row_stats_reduce(float &m, int &am, double &s, float *sh_m,
                                                 int *sh_i, double *sh_s)
{
    const int t = threadIdx.x;
    warp_stats(m, am, s);
    if ((t & 31) == 0) {
        sh_m[t >> 5] = m;
        sh_i[t >> 5] = am;
        sh_s[t >> 5] = s;
    }
    __syncthreads();
    if (t < 32) {
        m = t < NW ? sh_m[t] : -INFINITY;
        am = t < NW ? sh_i[t] : INT_MAX;
        s = t < NW ? sh_s[t] : 0.0;
        warp_stats(m, am, s);
    }
}

} // namespace

#endif
