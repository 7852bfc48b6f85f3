/* dtype.h - element types shared by safetensors, the cache and the kernels. */
#ifndef DF_DTYPE_H
#define DF_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef enum df_dtype {
    DF_DTYPE_INVALID = 0,
    DF_DTYPE_BF16 = 1,
    DF_DTYPE_F16 = 2,
    DF_DTYPE_F32 = 3,
    DF_DTYPE_I32 = 4,
    DF_DTYPE_I64 = 5,
    DF_DTYPE_U8 = 6,
    DF_DTYPE_F8_E4M3 = 7,
    DF_DTYPE_UF16 = 8, /* AdamW's second moment only (common/uf16.h); no file holds it */
} df_dtype;

static inline size_t df_dtype_size(df_dtype t)
{
    switch (t) {
    case DF_DTYPE_BF16: case DF_DTYPE_F16: case DF_DTYPE_UF16: return 2;
    case DF_DTYPE_F32: case DF_DTYPE_I32: return 4;
    case DF_DTYPE_I64: return 8;
    case DF_DTYPE_U8: case DF_DTYPE_F8_E4M3: return 1;
    default: return 0;
    }
}

/* Names as safetensors spells them ("BF16", "F32", ...). */
static inline const char *df_dtype_name(df_dtype t)
{
    switch (t) {
    case DF_DTYPE_BF16: return "BF16";
    case DF_DTYPE_F16: return "F16";
    case DF_DTYPE_F32: return "F32";
    case DF_DTYPE_I32: return "I32";
    case DF_DTYPE_I64: return "I64";
    case DF_DTYPE_U8: return "U8";
    case DF_DTYPE_F8_E4M3: return "F8_E4M3";
    case DF_DTYPE_UF16: return "UF16";
    default: return "invalid";
    }
}

static inline df_dtype df_dtype_from_name(const char *s)
{
    static const df_dtype all[] = {DF_DTYPE_BF16, DF_DTYPE_F16, DF_DTYPE_F32, DF_DTYPE_I32,
                                   DF_DTYPE_I64, DF_DTYPE_U8, DF_DTYPE_F8_E4M3};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (!strcmp(s, df_dtype_name(all[i])))
            return all[i];
    return DF_DTYPE_INVALID;
}

/* bf16 <-> f32, round to nearest even; NaN stays NaN. */
static inline float df_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t df_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* n BF16 values stored at the start of x's memory widened in place into
 * x[0..n): from the last element down, so each BF16 (at bytes [2j, 2j+2),
 * inside or below its own F32) is read before anything overwrites it. */
static inline void df_bf16_widen_inplace(float *x, int64_t n)
{
    for (int64_t j = n - 1; j >= 0; j--) {
        uint16_t h;
        memcpy(&h, (const unsigned char *)x + 2 * j, 2);
        x[j] = df_bf16_to_f32(h);
    }
}

/* f16 bits <-> f32 (exact one way; RNE the other), without F16C. */
static inline float df_f16_to_f32(uint16_t h)
{
    uint32_t s = (uint32_t)(h >> 15) << 31, ex = (h >> 10) & 31, m = h & 0x3ff, u;
    if (ex == 31)
        u = s | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0);
    else if (ex == 0) {
        float f = (float)m * 0x1p-24f;
        memcpy(&u, &f, 4);
        u |= s;
    } else
        u = s | ((ex - 15 + 127) << 23) | (m << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t df_f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t s = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return s | 0x7e00;           /* NaN */
    if (a >= 0x477ff000u)            /* >= 65520 rounds to inf */
        return s | 0x7c00;
    if (a < 0x38800000u) {           /* below 2^-14: f16 subnormal or zero */
        float af;
        memcpy(&af, &a, 4);
        float m = af * 0x1p24f;      /* exact scaling; RNE to integer below */
        m = (m + 0x1p23f) - 0x1p23f;
        return s | (uint16_t)m;      /* m == 1024 gives the smallest normal */
    }
    a += 0xfffu + ((a >> 13) & 1);
    return s | (uint16_t)((a - 0x38000000u) >> 13);
}

/* One element of type t (BF16, F16 or F32) at p, as f32. */
static inline float df_elem_to_f32(const void *p, df_dtype t)
{
    if (t == DF_DTYPE_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    return t == DF_DTYPE_BF16 ? df_bf16_to_f32(h) : df_f16_to_f32(h);
}

#endif
