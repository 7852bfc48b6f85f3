/* bf16.cuh - bf16 <-> fp32 on the device, one element or a 16-byte vector
 * of 8 at a time, for the kernel files that keep bf16 tensors as raw
 * uint16_t (dense.cu, train_dense.cu, gdn_prep.cu, lmhead_ce.cu,
 * dflash_attn/mma_*.cu): each had its own identical copy. Widening is exact (the
 * bits shifted up); narrowing rounds to nearest even. Files that round by
 * hand with NaN rules of their own (gdn.cu, fallback.cu, backend.cu) keep
 * their own. */
#ifndef DF_CUDA_BF16_CUH
#define DF_CUDA_BF16_CUH

#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int VEC = 8; /* bf16 per 16-byte vector */

__device__ __forceinline__ float bf2f(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

__device__ __forceinline__ uint16_t f2bf(float f)
{
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

/* 8 packed bf16 (element 2j in the low half of word j) as floats. */
__device__ __forceinline__ void unpack8(uint4 u, float *f)
{
    uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        f[2 * j] = __uint_as_float(w[j] << 16);
        f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}

/* p[0..8) as 16 bytes; p 16-byte aligned. */
__device__ __forceinline__ uint4 ld16(const uint16_t *p)
{
    return *reinterpret_cast<const uint4 *>(p);
}

/* p[0..8) as floats; p 16-byte aligned. */
__device__ __forceinline__ void load8(const uint16_t *p, float *f)
{
    unpack8(*reinterpret_cast<const uint4 *>(p), f);
}

/* 8 bf16 at p, raw: one 16-byte load where vec (p 16-byte aligned) and all
 * 8 are in range, else the ones below lim (the rest 0) */
__device__ __forceinline__ uint4 load8_raw(const uint16_t *__restrict__ p, int vec, int64_t lim)
{
    if (vec && lim >= 8)
        return *reinterpret_cast<const uint4 *>(p);
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; j++)
        w[j] = (2 * j < lim ? (uint32_t)p[2 * j] : 0u) |
               (2 * j + 1 < lim ? (uint32_t)p[2 * j + 1] << 16 : 0u);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* Two floats as bf16, lo in the low half. */
__device__ __forceinline__ uint32_t pack2(float lo, float hi)
{
    return (uint32_t)f2bf(lo) | ((uint32_t)f2bf(hi) << 16);
}

/* f[0..8) as bf16 to p; p 16-byte aligned. */
__device__ __forceinline__ void store8(uint16_t *p, const float *f)
{
    uint4 u;
    u.x = pack2(f[0], f[1]);
    u.y = pack2(f[2], f[3]);
    u.z = pack2(f[4], f[5]);
    u.w = pack2(f[6], f[7]);
    *reinterpret_cast<uint4 *>(p) = u;
}

} /* namespace */

#endif
