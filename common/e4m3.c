/* e4m3.c - E4M3 decoding, power-of-two block scales and the reference
 * quantize-dequantize (contract in e4m3.h). */
#include "e4m3.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>

float df_e4m3_to_f32(uint8_t c)
{
    uint32_t s = (uint32_t)(c >> 7) << 31, ex = (c >> 3) & 15, m = c & 7;
    uint32_t u;
    if (ex == 15 && m == 7) {
        u = s | 0x7fc00000u;
    } else if (ex == 0) {
        float f = (float)m * 0x1p-9f; /* exact */
        memcpy(&u, &f, 4);
        u |= s;
    } else {
        u = s | ((ex - 7 + 127) << 23) | (m << 20);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The exponent range of a scale: below 2^-100 every dequantized value would
 * still be a normal BF16 number, so a GPU's BF16 copy holds it exactly. */
enum { SCALE_EXP_MIN = -100, SCALE_EXP_MAX = 127 };

float df_fp8_pow2_scale(float amax)
{
    if (!(amax > 0.0f) || !isfinite(amax))
        return 1.0f;
    int e;
    float m = frexpf(amax, &e); /* amax = m 2^e, m in [0.5, 1) */
    /* amax / 2^(e-9) = 512 m in [256, 512): fits 448 when m <= 7/8 */
    int k = e - 9 + (m > 0.875f);
    k = k < SCALE_EXP_MIN ? SCALE_EXP_MIN : k > SCALE_EXP_MAX ? SCALE_EXP_MAX : k;
    return ldexpf(1.0f, k);
}

static inline uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* A row rounded in place, each element c at its block's inverse scale
 * inv[c] and scale s[c] (powers of two), or kept where keep[c] is all ones
 * (a block holding NaN or Inf): each value becomes the E4M3 value nearest to
 * |x| * inv, times s, with x's sign. |x| * inv is exact unless it falls
 * below 2^-126, where any rounding still ends at 0. Normal codes (>= 2^-6):
 * RNE to 3 mantissa bits on the bits; subnormal ones: adding 2^23 rounds
 * a * 512 to an integer, to even. The selections are on the bits
 * (non-negative floats order as integers), so the loop vectorizes without
 * relaxing float semantics. The same values as df_e4m3_mag's codes
 * (test_fp8 checks against brute force). */
static void qdq_row(float *restrict x, int64_t n, const float *restrict inv,
                    const float *restrict s, const uint32_t *restrict keep)
{
    for (int64_t c = 0; c < n; c++) {
        uint32_t b = f2u(x[c]);
        uint32_t u = f2u(u2f(b & 0x7fffffffu) * inv[c]);
        u = u < 0x43e00000u ? u : 0x43e00000u; /* min(a, 448) */
        uint32_t nb = (u + 0x7ffffu + ((u >> 20) & 1u)) & 0xfff00000u;
        uint32_t sb = f2u(((u2f(u) * 512.0f + 0x1p23f) - 0x1p23f) * 0x1p-9f);
        /* below 2^-6: the subnormal steps; a mask, not a ?:, which GCC would
         * turn into a branch around sb's float ops (not vectorizable) */
        uint32_t m = 0u - (uint32_t)(u < 0x3c800000u);
        uint32_t r = (sb & m) | (nb & ~m);
        r = f2u(u2f(r) * s[c]) | (b & 0x80000000u);
        x[c] = u2f((r & ~keep[c]) | (b & keep[c]));
    }
}

int df_fp8_qdq_f32(float *x, int64_t rows, int64_t cols, int64_t ld, int64_t br, int64_t bc)
{
    if (rows <= 0 || cols <= 0 || br < 1 || bc < 1)
        return 0;
    int64_t ncb = (cols + bc - 1) / bc;
    /* per block column: the band's amax (as bits: non-negative floats order as
     * integers, NaN above Inf above every finite value); per column: the
     * scale, its inverse, and whether to keep the values */
    uint32_t *amax = malloc((size_t)ncb * sizeof *amax), *keep = malloc((size_t)cols * 4);
    float *inv = malloc((size_t)cols * 4), *sc = malloc((size_t)cols * 4);
    if (!amax || !keep || !inv || !sc) {
        free(amax), free(keep), free(inv), free(sc);
        return -ENOMEM;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += br) {
        int64_t r1 = r0 + br < rows ? r0 + br : rows;
        for (int64_t j = 0; j < ncb; j++)
            amax[j] = 0;
        for (int64_t r = r0; r < r1; r++) {
            const float *row = x + r * ld;
            for (int64_t j = 0; j < ncb; j++) {
                int64_t c1 = (j + 1) * bc < cols ? (j + 1) * bc : cols;
                uint32_t m = amax[j];
                for (int64_t c = j * bc; c < c1; c++) {
                    uint32_t a = f2u(row[c]) & 0x7fffffffu;
                    m = a > m ? a : m;
                }
                amax[j] = m;
            }
        }
        for (int64_t j = 0; j < ncb; j++) {
            float s1 = df_fp8_pow2_scale(u2f(amax[j])), i1 = 1.0f / s1; /* exact */
            uint32_t k1 = amax[j] >= 0x7f800000u ? 0xffffffffu : 0;
            int64_t c1 = (j + 1) * bc < cols ? (j + 1) * bc : cols;
            for (int64_t c = j * bc; c < c1; c++)
                sc[c] = s1, inv[c] = i1, keep[c] = k1;
        }
        for (int64_t r = r0; r < r1; r++)
            qdq_row(x + r * ld, cols, inv, sc, keep);
    }
    free(amax), free(keep), free(inv), free(sc);
    return 0;
}
