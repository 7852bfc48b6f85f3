/* e4m3.c - E4M3 decoding, power-of-two block scales and the reference
 * quantize-dequantize (contract in e4m3.h). */
#include "e4m3.h"

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

/* One value at inverse scale inv (a power of two: the product is exact in
 * double) and scale s: code * s, with x's sign. */
static inline float qdq1(float x, double inv, float s)
{
    uint32_t b;
    memcpy(&b, &x, 4);
    uint32_t a = b & 0x7fffffffu;
    float af;
    memcpy(&af, &a, 4);
    uint32_t mag = df_e4m3_mag((double)af * inv);
    float v = df_e4m3_to_f32((uint8_t)mag) * s; /* exact (the scale's range) */
    uint32_t vb;
    memcpy(&vb, &v, 4);
    vb |= b & 0x80000000u;
    memcpy(&v, &vb, 4);
    return v;
}

void df_fp8_qdq_f32(float *x, int64_t rows, int64_t cols, int64_t ld, int64_t br, int64_t bc)
{
    if (rows <= 0 || cols <= 0 || br < 1 || bc < 1)
        return;
    int64_t ncb = (cols + bc - 1) / bc;
    float stackbuf[64];
    float *amax = ncb <= 64 ? stackbuf : malloc((size_t)ncb * sizeof *amax);
    if (!amax) { /* one block column at a time: same result, no buffer */
        for (int64_t c0 = 0; c0 < cols; c0 += bc)
            df_fp8_qdq_f32(x + c0, rows, cols - c0 < bc ? cols - c0 : bc, ld, br, bc);
        return;
    }
    /* per band of br rows: each block's amax (rows read in order), then the
     * values; a block with a non-finite value keeps its values */
    for (int64_t r0 = 0; r0 < rows; r0 += br) {
        int64_t r1 = r0 + br < rows ? r0 + br : rows;
        for (int64_t j = 0; j < ncb; j++)
            amax[j] = 0.0f;
        for (int64_t r = r0; r < r1; r++) {
            const float *row = x + r * ld;
            for (int64_t j = 0; j < ncb; j++) {
                int64_t c1 = (j + 1) * bc < cols ? (j + 1) * bc : cols;
                float m = amax[j];
                for (int64_t c = j * bc; c < c1; c++) {
                    float a = fabsf(row[c]);
                    m = a > m || a != a ? a : m; /* NaN sticks */
                }
                amax[j] = m;
            }
        }
        for (int64_t r = r0; r < r1; r++) {
            float *row = x + r * ld;
            for (int64_t j = 0; j < ncb; j++) {
                if (!isfinite(amax[j]))
                    continue;
                float s = df_fp8_pow2_scale(amax[j]);
                double inv = 1.0 / (double)s;
                int64_t c1 = (j + 1) * bc < cols ? (j + 1) * bc : cols;
                for (int64_t c = j * bc; c < c1; c++)
                    row[c] = qdq1(row[c], inv, s);
            }
        }
    }
    if (amax != stackbuf)
        free(amax);
}
