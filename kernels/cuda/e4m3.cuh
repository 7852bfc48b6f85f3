/* e4m3.cuh - common/e4m3.h's rounding rule on the device, for the FP8
 * files: fp8.cu (values rounded in place: df_op_fp8_qdq), fp8_codes.cu
 * (E4M3 codes for the tensor cores) and lmhead_ce.cu (the softmax
 * gradient's codes, written where it is computed). One rule, so the codes' values are
 * exactly the rounded values. Bit-exact with the CPU: the amax is exact, the
 * scale a power of two (x / scale exact), and the rounding is done on the
 * float's bits (normals) or by rintf (the subnormal steps of 2^-9), both
 * round-to-nearest-even, on every architecture. Internal (anonymous
 * namespace). */
#ifndef DF_CUDA_E4M3_CUH
#define DF_CUDA_E4M3_CUH

#include <stdint.h>

#include "bf16.cuh"

namespace {

/* max of |values| where a NaN, once seen, stays */
__device__ __forceinline__ float amax_step(float m, float v)
{
    float a = fabsf(v);
    return (a > m || a != a) ? a : m;
}

__device__ __forceinline__ float warp_amax(float m)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        m = amax_step(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

/* The amax of a CTA of NT threads (each holding its own), in every thread;
 * wm: NT / 32 floats of shared memory. */
template <int NT> __device__ __forceinline__ float block_amax(float m, float *wm)
{
    m = warp_amax(m);
    if ((threadIdx.x & 31) == 0)
        wm[threadIdx.x / 32] = m;
    __syncthreads();
    m = 0.0f;
#pragma unroll
    for (int j = 0; j < NT / 32; j++)
        m = amax_step(m, wm[j]);
    return m;
}

/* common/e4m3.c's df_fp8_pow2_scale as its exponent: k = ceil(log2(amax /
 * 448)) in [-100, 127]; 0 (scale 1) for amax 0 or non-finite. */
__device__ __forceinline__ int scale_exp(float amax)
{
    if (!(amax > 0.0f) || !isfinite(amax))
        return 0;
    int e;
    float m = frexpf(amax, &e);
    int k = e - 9 + (m > 0.875f);
    return k < -100 ? -100 : k > 127 ? 127 : k;
}

/* The E4M3 value nearest |v| * inv (inv = 2^-k), saturating at 448: RNE to
 * 3 mantissa bits on the bits from 2^-6 up, steps of 2^-9 below. */
__device__ __forceinline__ float e4m3_mag(float v, float inv)
{
    float a = fminf(fabsf(v) * inv, 448.0f);
    uint32_t u = __float_as_uint(a);
    float rn = __uint_as_float((u + 0x7ffffu + ((u >> 20) & 1u)) & 0xfff00000u);
    float rs = rintf(a * 512.0f) * 0x1p-9f;
    return a < 0x1p-6f ? rs : rn;
}

/* v rounded to E4M3 at scale s = 2^k (inv = 2^-k), times s, with v's sign */
__device__ __forceinline__ float qdq1(float v, float inv, float s)
{
    return copysignf(e4m3_mag(v, inv) * s, v);
}

/* v's E4M3 code at inverse scale inv (e4m3_mag's value as exponent and
 * mantissa bits). NaN and +-Inf give the NaN code, so a non-finite input
 * still makes a product non-finite (fp8.cu leaves such a block as it is). */
__device__ __forceinline__ uint8_t e4m3_code(float v, float inv)
{
    float r = e4m3_mag(v, inv);
    uint32_t c = r < 0x1p-6f ? (uint32_t)(r * 512.0f) : (__float_as_uint(r) >> 20) - (120u << 3);
    c = isfinite(v) ? c : 0x7fu;
    return (uint8_t)(c | (__float_as_uint(v) >> 24 & 0x80u));
}

/* The value of an E4M3 code (common/e4m3.h's df_e4m3_to_f32: a NaN for
 * 0x7f / 0xff) */
__device__ __forceinline__ float e4m3_value(uint8_t c)
{
    uint32_t e = (c >> 3) & 15u, m = c & 7u;
    float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0x1p-9f;
    v = (c & 0x7fu) == 0x7fu ? __uint_as_float(0x7fc00000u) : v;
    return (c & 0x80u) ? -v : v;
}

/* The codes of whole blocks, for the kernels that write the FP8 GEMMs'
 * operands (fp8_codes.cu, and lmhead_ce.cu's softmax gradient): */

/* Two codes (lo in bits 0-7, hi in 8-15) of finite values already divided
 * by their block's scale (exact: a power of two): on sm_89 and later the
 * hardware's conversion (round to nearest even, saturating at 448: the
 * e4m3.cuh rule for finite values, the same bits), elsewhere that rule. */
__device__ __forceinline__ uint32_t codes2(float lo, float hi)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (uint32_t)e4m3_code(lo, 1.0f) | (uint32_t)e4m3_code(hi, 1.0f) << 8;
#endif
}

/* 8 codes of v at inverse scale inv, little-endian in one word pair. A
 * block whose amax is not finite (NaN or Inf in it) takes e4m3_code, which
 * codes every non-finite value as NaN; the conversion above would saturate
 * an Inf. */
__device__ __forceinline__ uint2 codes8(const float v[8], float inv, bool finite)
{
    uint2 w = {0u, 0u};
    if (finite) {
        w.x = codes2(v[0] * inv, v[1] * inv) | codes2(v[2] * inv, v[3] * inv) << 16;
        w.y = codes2(v[4] * inv, v[5] * inv) | codes2(v[6] * inv, v[7] * inv) << 16;
        return w;
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        w.x |= (uint32_t)e4m3_code(v[j], inv) << (8 * j);
        w.y |= (uint32_t)e4m3_code(v[j + 4], inv) << (8 * j);
    }
    return w;
}

/* 4 codes of v (the same rules) in one word */
__device__ __forceinline__ uint32_t codes4(const float v[4], float inv, bool finite)
{
    if (finite)
        return codes2(v[0] * inv, v[1] * inv) | codes2(v[2] * inv, v[3] * inv) << 16;
    uint32_t w = 0;
#pragma unroll
    for (int q = 0; q < 4; q++)
        w |= (uint32_t)e4m3_code(v[q], inv) << (8 * q);
    return w;
}

/* The largest magnitude of 8 packed bf16, as a float: on the bits, two
 * halves per instruction (a NaN's magnitude bits are above +Inf's, +Inf's
 * above every finite value's, so a block with a NaN gets a NaN amax and one
 * with an Inf and no NaN gets +Inf, as amax_step gives) */
__device__ __forceinline__ uint32_t amax8_bits(uint4 u)
{
    uint32_t m = __vmaxu2(__vmaxu2(u.x & 0x7fff7fffu, u.y & 0x7fff7fffu),
                          __vmaxu2(u.z & 0x7fff7fffu, u.w & 0x7fff7fffu));
    return max(m & 0xffffu, m >> 16);
}
__device__ __forceinline__ float bits_f(uint32_t b) { return __uint_as_float(b << 16); }
/* The amax bits of a 1 x 128 block held by 16 consecutive lanes, 8 packed bf16 each (u), in
 * every lane of the 16. The whole warp calls it (shuffles). */
__device__ __forceinline__ uint32_t amax16_bits(uint4 u)
{
    uint32_t mb = amax8_bits(u);
#pragma unroll
    for (int d = 8; d > 0; d >>= 1)
        mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, d));
    return mb;
}
/* The codes of 8 packed bf16 (u) of a block whose amax bits are mb, stored at out (8-byte
 * aligned); returns the block's scale. */
__device__ __forceinline__ float codes8_store(uint4 u, uint32_t mb, uint8_t *out)
{
    float v[8], m = bits_f(mb);
    unpack8(u, v);
    int e = scale_exp(m);
    *reinterpret_cast<uint2 *>(out) = codes8(v, ldexpf(1.0f, -e), isfinite(m));
    return ldexpf(1.0f, e);
}

} // namespace

#endif
