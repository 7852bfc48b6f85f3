/* codec_internal.h - what codec.c shares with the block-scaled codecs
 * (codec_block.c): scratch memory, the plane coders, the SIMD level (defined
 * in codec_planes.c, with the byte-plane kernels) and the e4m3 kernels. Not
 * part of the public API (formats/codec.h). */
#ifndef DF_CODEC_INTERNAL_H
#define DF_CODEC_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "codec.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DF_CODEC_X86 1
#endif

/* Plane modes in the sub-headers (docs/FORMAT-codecs.md). */
enum { PLANE_RAW = 0, PLANE_LZ4 = 1, PLANE_ZSTD = 2 };

/* The context's scratch buffer, at least n bytes, 64-byte aligned; its old
 * contents are lost. NULL (with a message) when out of memory. */
uint8_t *df_codec_scratch(df_codec_ctx *c, size_t n, df_err *e);

/* The context's row buffer: n f32 bit patterns, separate from scratch. */
uint32_t *df_codec_row_buf(df_codec_ctx *c, size_t n, df_err *e);

/* The kernel level in force: 1 scalar, 2 SSE2, 3 AVX2 (df_codec_set_plane_impl). */
int df_codec_impl(void);

/* 1 if a sampled entropy says a byte plane may shrink under zstd. */
int df_codec_plane_looks_compressible(const uint8_t *p, size_t n);

/* Codes n bytes with plane coder `mode` (PLANE_LZ4 / PLANE_ZSTD) at `level`
 * into dst (capacity cap). Returns the size (0 < size <= cap), 0 when it does
 * not fit (store the plane raw), or a negative code. */
long long df_codec_code_plane(df_codec_ctx *c, int mode, int level, const uint8_t *src, size_t n,
                              uint8_t *dst, size_t cap, df_err *e);

/* Decodes one coded plane: src[0..len) must be exactly one LZ4 block or one
 * zstd frame of exactly n bytes; errors name codec id and plane k. */
int df_codec_decode_plane(df_codec_ctx *c, int id, int k, int mode, const uint8_t *src, size_t len,
                          uint8_t *dst, size_t n, df_err *e);

/* n elements of dtype t (BF16, F16, F32) as f32 bit patterns (exact). */
void df_codec_row_to_f32_bits(const uint8_t *row, size_t n, df_dtype t, uint32_t *out);

/* e4m3 codes of n f32 bit patterns at `scale` (the rule of codec 4:
 * sign | RNE_e4m3(min(|x|/scale, 448)), non-finite -> signed NaN code,
 * scale 0 -> signed zeros); scalar or AVX2 by df_codec_impl(), same bytes. */
void df_codec_quant_e4m3(const uint32_t *xb, size_t n, float scale, uint8_t *out);

/* f32 bits of e4m3(c) * scale, the sign applied after the product (RNE is
 * symmetric, so that is the signed product). mag << 20 read as an f32 is the
 * e4m3 value times 2^-120 (exactly, subnormal codes included), so the first
 * multiply is exact; NaN codes give a quiet NaN of their sign. */
static inline uint32_t df_e4m3_dequant_bits(uint8_t c, float scale)
{
    uint32_t mag = c & 0x7fu, sign = (uint32_t)(c & 0x80) << 24, u = mag << 20, b;
    float f;
    memcpy(&f, &u, 4);
    f = f * 0x1p120f * scale;
    memcpy(&b, &f, 4);
    return mag == 0x7f ? sign | 0x7fc00000u : b | sign;
}

/* bf16 of f32 bits, RNE; only our quiet NaNs and finite/inf values occur */
static inline uint16_t df_bits_to_bf16(uint32_t b)
{
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
}

#ifdef DF_CODEC_X86
/* df_e4m3_dequant_bits of 8 codes (one per 32-bit lane) at scale vs */
__attribute__((target("avx2"))) static inline __m256i df_e4m3_dequant8_avx2(__m256i c, __m256 vs)
{
    __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7f));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
    __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(mag, 20));
    f = _mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(0x1p120f)), vs);
    __m256i b = _mm256_or_si256(_mm256_castps_si256(f), sign);
    __m256i nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f));
    return _mm256_blendv_epi8(b, _mm256_or_si256(sign, _mm256_set1_epi32(0x7fc00000)), nan);
}

/* 16 f32 bit patterns (b0 = elements 0-7, b1 = 8-15) -> 16 bf16, RNE, in order */
__attribute__((target("avx2"))) static inline __m256i df_bf16_pack16_avx2(__m256i b0, __m256i b1)
{
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    __m256i r0 = _mm256_srli_epi32(
        _mm256_add_epi32(b0, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(b0, 16), one))), 16);
    __m256i r1 = _mm256_srli_epi32(
        _mm256_add_epi32(b1, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(b1, 16), one))), 16);
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8);
}
#endif

/* The block-scaled codecs (ids 5-10), for df_codec_encode/decode after their
 * parameter checks; rb = bytes per row, raw_len > 0 a whole number of rows.
 * Encode returns the payload size (< raw_len), 0 for "store it", or a
 * negative code. Decode returns 0 or -DF_ECORRUPT / -ENOMEM. */
long long df_codec_block_encode(df_codec_ctx *c, int id, const df_codec_params *p,
                                const uint8_t *src, size_t raw_len, size_t rb, uint8_t *dst,
                                df_err *e);
int df_codec_block_decode(df_codec_ctx *c, int id, const df_codec_params *p, const uint8_t *src,
                          size_t src_len, uint8_t *dst, size_t raw_len, size_t rb, df_err *e);

#endif
