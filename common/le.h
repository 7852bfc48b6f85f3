/* le.h - little-endian fixed-width field access for on-disk structures.
 * Every file format of the project is little-endian; these helpers make the
 * byte order explicit and never do unaligned loads through casts. */
#ifndef DF_LE_H
#define DF_LE_H

#include <stdint.h>
#include <string.h>

static inline uint16_t df_le16(const void *p)
{
    const uint8_t *b = p;
    return (uint16_t)(b[0] | (b[1] << 8));
}
static inline uint32_t df_le32(const void *p)
{
    const uint8_t *b = p;
    return (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16) | ((uint32_t)b[3] << 24);
}
static inline uint64_t df_le64(const void *p)
{
    const uint8_t *b = p;
    return (uint64_t)df_le32(b) | ((uint64_t)df_le32(b + 4) << 32);
}
static inline void df_put16(void *p, uint16_t v)
{
    uint8_t *b = p;
    b[0] = (uint8_t)v;
    b[1] = (uint8_t)(v >> 8);
}
static inline void df_put32(void *p, uint32_t v)
{
    uint8_t *b = p;
    for (int i = 0; i < 4; i++)
        b[i] = (uint8_t)(v >> (8 * i));
}
static inline void df_put64(void *p, uint64_t v)
{
    df_put32(p, (uint32_t)v);
    df_put32((uint8_t *)p + 4, (uint32_t)(v >> 32));
}

#endif
