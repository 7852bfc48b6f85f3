/* e4m3.h - OCP FP8 E4M3 ("fn"): bias 7, no infinities, S.1111.111 is NaN,
 * largest finite 448, subnormals m * 2^-9. The one rounding rule every FP8
 * user here shares: the lossy cache codecs (formats/codec*.c) and FP8
 * training (kernels' fp8_qdq op).
 *
 * Rounding is to nearest, ties to even, saturating at 448. */
#ifndef DF_E4M3_H
#define DF_E4M3_H

#include <stdint.h>
#include <string.h>

/* The 7-bit magnitude code of q >= 0 (q > 448 and NaN give 448's code 0x7e;
 * the caller maps non-finite inputs to 0x7f itself). Branch-free so that a
 * loop over it vectorizes. Exact when q is the exact quotient or a double
 * close enough to it: a quotient of two 24-bit values is either exactly a tie
 * of 5-bit values or at least 2^-29 (relative) away from one. */
static inline uint32_t df_e4m3_mag(double q)
{
    q = q < 448.0 ? q : 448.0;
    /* normal range: RNE to 3 mantissa bits on the double's bits; the code is
     * then (exponent, mantissa) rebased from bias 1023 to 7 */
    uint64_t u;
    memcpy(&u, &q, 8);
    u += ((uint64_t)1 << 48) - 1 + ((u >> 49) & 1);
    uint32_t cn = (uint32_t)(u >> 49) - ((1023u - 7u) << 3);
    /* subnormal range (< 2^-6): steps of 2^-9; adding 2^52 rounds q * 512 to
     * an integer (RNE) that lands in the low mantissa bits */
    double m = q * 512.0 + 0x1p52;
    uint64_t mb;
    memcpy(&mb, &m, 8);
    uint32_t cs = (uint32_t)(mb & 0xff);
    return q < 0x1p-6 ? cs : cn;
}

/* The E4M3 code of x (finite: RNE, saturated to +-448; NaN and +-Inf: the
 * NaN of their sign). */
static inline uint8_t df_e4m3_from_f32(float x)
{
    uint32_t b;
    memcpy(&b, &x, 4);
    uint32_t a = b & 0x7fffffffu;
    float af;
    memcpy(&af, &a, 4);
    uint32_t code = a >= 0x7f800000u ? 0x7f : df_e4m3_mag((double)af);
    return (uint8_t)(((b >> 24) & 0x80) | code);
}

/* The value of an E4M3 code (a quiet NaN of its sign for 0x7f / 0xff). */
float df_e4m3_to_f32(uint8_t code);

/* The power-of-two scale of a block whose largest magnitude is amax: the
 * smallest 2^k with amax / 2^k <= 448, so the block's values divided by it
 * fit E4M3 without saturating; 1 for amax 0 or non-finite. A power of two
 * keeps x / scale exact and makes code * scale exactly a BF16 value, so a
 * BF16 GEMM on dequantized operands computes what an FP8 GEMM with FP32
 * accumulation does (and the scale is an E8M0, as MXFP8 stores it). */
float df_fp8_pow2_scale(float amax);

/* Quantize-dequantize in place: x[rows, cols] (row stride ld, elements)
 * becomes code * scale, with one df_fp8_pow2_scale per block of br x bc
 * elements (edge blocks smaller). A block holding NaN or +-Inf is left as it
 * is, so the non-finite value still reaches the loss. br, bc >= 1 (else
 * nothing is done). Returns 0, or -ENOMEM (x untouched): it takes O(cols)
 * working memory. */
int df_fp8_qdq_f32(float *x, int64_t rows, int64_t cols, int64_t ld, int64_t br, int64_t bc);

#endif
