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
} df_dtype;

static inline size_t df_dtype_size(df_dtype t)
{
    switch (t) {
    case DF_DTYPE_BF16: case DF_DTYPE_F16: return 2;
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

#endif
