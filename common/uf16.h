/* uf16.h - UF16, an unsigned 16-bit float for AdamW's second moment (v >= 0), and FP32 <-> UF16
 * with stochastic rounding: the same bits from C on the CPU and from CUDA on the GPU (this header
 * is both's, like bf16_sr.h).
 *
 * Why: v in BF16 (8 significant bits) carries ~2.5% of noise in steady state from its stochastic
 * rounding (each step's rounding error, std ~0.3 ulp, summed with weights beta2^k: ~22x); v has
 * no sign, and with the gradient clipped its range is bounded above, so 16 bits hold 11
 * significant bits and a 6-bit exponent instead: 8x less noise at BF16's size.
 *
 * Format: code c = e << 10 | f (e 6 bits, f 10 bits):
 *   e >= 1: 2^(e - 58) (1 + f / 1024)     (2^-57 .. 2^5 (2 - 2^-10) = 63.97)
 *   e == 0: f 2^-67                        (below 2^-57 in steps of 2^-67; 0 is code 0)
 * Every UF16 value is an FP32 value (FP32's exponent field e + 69).
 *
 * Contract:
 *   df_uf16_to_f32(c): the value of c, exactly.
 *   df_uf16_sr(u, r): the UF16 of the FP32 whose bits are u, rounded stochastically with the 13
 *     random bits r & 0x1fff: the 13 bits a normal UF16 drops (of u, or of v 2^67 below 2^-57),
 *     plus r, carried into the kept ones, then truncated; unbiased to 2^-13 of a step (exactly
 *     unbiased for v >= 2^-57). Exact UF16 values stay as they are. Negative values (and -0)
 *     give 0; values at or past 64 (and +Inf, NaN) give the largest code, 0xffff: a trainer
 *     that clips the gradient at C <= 4 never gets there (v <= C^2).
 *   df_f32_to_uf16(f): round to nearest even, with the same edges (a checkpoint's F32 v, which
 *     a UF16 run wrote, comes back exactly). */
#ifndef DF_UF16_H
#define DF_UF16_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define DF_UF16_FN __host__ __device__ static inline
#else
#define DF_UF16_FN static inline
#endif

#define DF_UF16_MAX 0xffffu
#define DF_UF16_BIAS 69u /* FP32 exponent field = e + 69 */

DF_UF16_FN float df_uf16_bits_f(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

DF_UF16_FN float df_uf16_to_f32(uint16_t c)
{
    return c >= 1024u ? df_uf16_bits_f(((uint32_t)c + (DF_UF16_BIAS << 10)) << 13)
                      : (float)c * 0x1p-67f;
}

/* r13: the 13 bits added below the kept ones (random for _sr, half a step for RNE) */
DF_UF16_FN uint16_t df_uf16_round(uint32_t u, uint32_t r13)
{
    if (u >> 31)
        return 0;
    if (u >= 0x43000000u) /* >= 2^7 (past the largest code), +Inf, NaN */
        return (uint16_t)DF_UF16_MAX;
    if (u >= (DF_UF16_BIAS + 1u) << 23) { /* >= 2^-57: a normal code */
        uint32_t c = ((u + r13) >> 13) - (DF_UF16_BIAS << 10);
        return (uint16_t)(c > DF_UF16_MAX ? DF_UF16_MAX : c);
    }
    /* below 2^-57: v 2^67 < 1024 with 13 fractional bits (v 2^80 < 2^23, truncated: what
     * lies below 2^-13 of a step is dropped) */
    uint32_t x = (uint32_t)(df_uf16_bits_f(u) * 0x1p80f);
    return (uint16_t)((x + r13) >> 13);
}

DF_UF16_FN uint16_t df_uf16_sr(uint32_t u, uint32_t r)
{
    return df_uf16_round(u, r & 0x1fffu);
}

DF_UF16_FN uint16_t df_f32_to_uf16(float f)
{
    uint32_t u;
#ifdef __CUDA_ARCH__
    u = __float_as_uint(f);
#else
    memcpy(&u, &f, 4);
#endif
    /* ties to even: half a step, less one where the kept bits are even (below 2^-57 the same
     * rule on v 2^80's bits) */
    uint32_t kept = u >= (DF_UF16_BIAS + 1u) << 23 ? u >> 13
                    : u >> 31                      ? 0
                                                   : (uint32_t)(df_uf16_bits_f(u) * 0x1p80f) >> 13;
    return df_uf16_round(u, 0xfffu + (kept & 1u));
}

#endif
