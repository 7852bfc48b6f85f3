/* codec_planes.c - the byte-plane transposes every lossless codec runs
 * before entropy coding (df_codec_split_planes / df_codec_merge_planes), in
 * scalar, SSE2 and AVX2 kernels, and the choice among them (auto, or forced
 * by df_codec_set_plane_impl for the benchmark; df_codec_impl says which is
 * in force, for the e4m3 kernels in codec.c and codec_block.c too). Apart
 * from codec.c because it is pure SIMD data movement with no format in it.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "codec.h"
#include "codec_internal.h"

/* ---- byte planes ---------------------------------------------------------
 * Plane k holds byte (esize-1-k) of every element: plane 0 is the most
 * significant byte (sign + top exponent bits) of the little-endian values.
 * SSE2 is x86-64's baseline; AVX2 is picked at run time. The 4-byte split is
 * two rounds of the 2-byte split (even/odd bytes, then even/odd again). */

static void split2_scalar(const uint8_t *s, size_t n, uint8_t *hi, uint8_t *lo)
{
    for (size_t i = 0; i < n; i++) {
        lo[i] = s[2 * i];
        hi[i] = s[2 * i + 1];
    }
}

static void merge2_scalar(const uint8_t *hi, const uint8_t *lo, size_t n, uint8_t *d)
{
    for (size_t i = 0; i < n; i++) {
        d[2 * i] = lo[i];
        d[2 * i + 1] = hi[i];
    }
}

static void split4_scalar(const uint8_t *s, size_t n, uint8_t *const pl[4])
{
    for (size_t i = 0; i < n; i++) {
        pl[3][i] = s[4 * i];
        pl[2][i] = s[4 * i + 1];
        pl[1][i] = s[4 * i + 2];
        pl[0][i] = s[4 * i + 3];
    }
}

static void merge4_scalar(const uint8_t *const pl[4], size_t n, uint8_t *d)
{
    for (size_t i = 0; i < n; i++) {
        d[4 * i] = pl[3][i];
        d[4 * i + 1] = pl[2][i];
        d[4 * i + 2] = pl[1][i];
        d[4 * i + 3] = pl[0][i];
    }
}

#ifdef DF_CODEC_X86
/* even/odd bytes of the 32 bytes a||b (16-bit lanes packed back to bytes) */
static inline void sse2_unzip(__m128i a, __m128i b, __m128i *even, __m128i *odd)
{
    const __m128i m = _mm_set1_epi16(0x00ff);
    *even = _mm_packus_epi16(_mm_and_si128(a, m), _mm_and_si128(b, m));
    *odd = _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8));
}

static void split2_sse2(const uint8_t *s, size_t n, uint8_t *hi, uint8_t *lo)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m128i ev, od;
        sse2_unzip(_mm_loadu_si128((const __m128i *)(s + 2 * i)),
                   _mm_loadu_si128((const __m128i *)(s + 2 * i + 16)), &ev, &od);
        _mm_storeu_si128((__m128i *)(lo + i), ev);
        _mm_storeu_si128((__m128i *)(hi + i), od);
    }
    split2_scalar(s + 2 * i, n - i, hi + i, lo + i);
}

static void merge2_sse2(const uint8_t *hi, const uint8_t *lo, size_t n, uint8_t *d)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m128i l = _mm_loadu_si128((const __m128i *)(lo + i));
        __m128i h = _mm_loadu_si128((const __m128i *)(hi + i));
        _mm_storeu_si128((__m128i *)(d + 2 * i), _mm_unpacklo_epi8(l, h));
        _mm_storeu_si128((__m128i *)(d + 2 * i + 16), _mm_unpackhi_epi8(l, h));
    }
    merge2_scalar(hi + i, lo + i, n - i, d + 2 * i);
}

static void split4_sse2(const uint8_t *s, size_t n, uint8_t *const pl[4])
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const uint8_t *p = s + 4 * i;
        __m128i e01, o01, e23, o23, b0, b2, b1, b3;
        sse2_unzip(_mm_loadu_si128((const __m128i *)p), _mm_loadu_si128((const __m128i *)(p + 16)),
                   &e01, &o01);
        sse2_unzip(_mm_loadu_si128((const __m128i *)(p + 32)),
                   _mm_loadu_si128((const __m128i *)(p + 48)), &e23, &o23);
        sse2_unzip(e01, e23, &b0, &b2);
        sse2_unzip(o01, o23, &b1, &b3);
        _mm_storeu_si128((__m128i *)(pl[3] + i), b0);
        _mm_storeu_si128((__m128i *)(pl[2] + i), b1);
        _mm_storeu_si128((__m128i *)(pl[1] + i), b2);
        _mm_storeu_si128((__m128i *)(pl[0] + i), b3);
    }
    uint8_t *const rest[4] = {pl[0] + i, pl[1] + i, pl[2] + i, pl[3] + i};
    split4_scalar(s + 4 * i, n - i, rest);
}

static void merge4_sse2(const uint8_t *const pl[4], size_t n, uint8_t *d)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m128i b0 = _mm_loadu_si128((const __m128i *)(pl[3] + i));
        __m128i b1 = _mm_loadu_si128((const __m128i *)(pl[2] + i));
        __m128i b2 = _mm_loadu_si128((const __m128i *)(pl[1] + i));
        __m128i b3 = _mm_loadu_si128((const __m128i *)(pl[0] + i));
        /* (b0,b2) and (b1,b3) pairs, then bytes of the pairs interleaved */
        __m128i a0 = _mm_unpacklo_epi8(b0, b2), a1 = _mm_unpackhi_epi8(b0, b2);
        __m128i c0 = _mm_unpacklo_epi8(b1, b3), c1 = _mm_unpackhi_epi8(b1, b3);
        uint8_t *o = d + 4 * i;
        _mm_storeu_si128((__m128i *)o, _mm_unpacklo_epi8(a0, c0));
        _mm_storeu_si128((__m128i *)(o + 16), _mm_unpackhi_epi8(a0, c0));
        _mm_storeu_si128((__m128i *)(o + 32), _mm_unpacklo_epi8(a1, c1));
        _mm_storeu_si128((__m128i *)(o + 48), _mm_unpackhi_epi8(a1, c1));
    }
    const uint8_t *const rest[4] = {pl[0] + i, pl[1] + i, pl[2] + i, pl[3] + i};
    merge4_scalar(rest, n - i, d + 4 * i);
}

/* AVX2 pack/unpack work within 128-bit lanes; a 64-bit permute restores order. */
__attribute__((target("avx2"))) static inline void avx2_unzip(__m256i a, __m256i b, __m256i *even,
                                                               __m256i *odd)
{
    const __m256i m = _mm256_set1_epi16(0x00ff);
    __m256i ev = _mm256_packus_epi16(_mm256_and_si256(a, m), _mm256_and_si256(b, m));
    __m256i od = _mm256_packus_epi16(_mm256_srli_epi16(a, 8), _mm256_srli_epi16(b, 8));
    *even = _mm256_permute4x64_epi64(ev, 0xD8);
    *odd = _mm256_permute4x64_epi64(od, 0xD8);
}

__attribute__((target("avx2"))) static inline void avx2_zip(__m256i l, __m256i h, __m256i *o0,
                                                             __m256i *o1)
{
    __m256i a = _mm256_unpacklo_epi8(l, h), b = _mm256_unpackhi_epi8(l, h);
    *o0 = _mm256_permute2x128_si256(a, b, 0x20);
    *o1 = _mm256_permute2x128_si256(a, b, 0x31);
}

__attribute__((target("avx2"))) static void split2_avx2(const uint8_t *s, size_t n, uint8_t *hi,
                                                        uint8_t *lo)
{
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i ev, od;
        avx2_unzip(_mm256_loadu_si256((const __m256i *)(s + 2 * i)),
                   _mm256_loadu_si256((const __m256i *)(s + 2 * i + 32)), &ev, &od);
        _mm256_storeu_si256((__m256i *)(lo + i), ev);
        _mm256_storeu_si256((__m256i *)(hi + i), od);
    }
    split2_sse2(s + 2 * i, n - i, hi + i, lo + i);
}

__attribute__((target("avx2"))) static void merge2_avx2(const uint8_t *hi, const uint8_t *lo,
                                                        size_t n, uint8_t *d)
{
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i o0, o1;
        avx2_zip(_mm256_loadu_si256((const __m256i *)(lo + i)),
                 _mm256_loadu_si256((const __m256i *)(hi + i)), &o0, &o1);
        _mm256_storeu_si256((__m256i *)(d + 2 * i), o0);
        _mm256_storeu_si256((__m256i *)(d + 2 * i + 32), o1);
    }
    merge2_sse2(hi + i, lo + i, n - i, d + 2 * i);
}

__attribute__((target("avx2"))) static void split4_avx2(const uint8_t *s, size_t n,
                                                        uint8_t *const pl[4])
{
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const uint8_t *p = s + 4 * i;
        __m256i e01, o01, e23, o23, b0, b1, b2, b3;
        avx2_unzip(_mm256_loadu_si256((const __m256i *)p),
                   _mm256_loadu_si256((const __m256i *)(p + 32)), &e01, &o01);
        avx2_unzip(_mm256_loadu_si256((const __m256i *)(p + 64)),
                   _mm256_loadu_si256((const __m256i *)(p + 96)), &e23, &o23);
        avx2_unzip(e01, e23, &b0, &b2);
        avx2_unzip(o01, o23, &b1, &b3);
        _mm256_storeu_si256((__m256i *)(pl[3] + i), b0);
        _mm256_storeu_si256((__m256i *)(pl[2] + i), b1);
        _mm256_storeu_si256((__m256i *)(pl[1] + i), b2);
        _mm256_storeu_si256((__m256i *)(pl[0] + i), b3);
    }
    uint8_t *const rest[4] = {pl[0] + i, pl[1] + i, pl[2] + i, pl[3] + i};
    split4_sse2(s + 4 * i, n - i, rest);
}

__attribute__((target("avx2"))) static void merge4_avx2(const uint8_t *const pl[4], size_t n,
                                                        uint8_t *d)
{
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i a0, a1, c0, c1, o0, o1, o2, o3;
        avx2_zip(_mm256_loadu_si256((const __m256i *)(pl[3] + i)),
                 _mm256_loadu_si256((const __m256i *)(pl[1] + i)), &a0, &a1); /* b0,b2 */
        avx2_zip(_mm256_loadu_si256((const __m256i *)(pl[2] + i)),
                 _mm256_loadu_si256((const __m256i *)(pl[0] + i)), &c0, &c1); /* b1,b3 */
        avx2_zip(a0, c0, &o0, &o1);
        avx2_zip(a1, c1, &o2, &o3);
        uint8_t *o = d + 4 * i;
        _mm256_storeu_si256((__m256i *)o, o0);
        _mm256_storeu_si256((__m256i *)(o + 32), o1);
        _mm256_storeu_si256((__m256i *)(o + 64), o2);
        _mm256_storeu_si256((__m256i *)(o + 96), o3);
    }
    const uint8_t *const rest[4] = {pl[0] + i, pl[1] + i, pl[2] + i, pl[3] + i};
    merge4_sse2(rest, n - i, d + 4 * i);
}

static int have_avx2(void)
{
    /* a load and a bit test of what libgcc/compiler-rt filled in at start-up:
     * cheap enough per call, and no shared cache to race on */
    return __builtin_cpu_supports("avx2") ? 1 : 0;
}
#endif

/* Which implementation df_codec_split/merge use: 0 = auto, 1 = scalar,
 * 2 = SSE2, 3 = AVX2 (for the benchmark; not thread-safe to change). */
static int plane_impl = 0;

int df_codec_set_plane_impl(int impl)
{
    if (impl < 0 || impl > 3)
        return -EINVAL;
#ifdef DF_CODEC_X86
    if (impl == 3 && !have_avx2())
        return -ENOTSUP;
#else
    if (impl >= 2)
        return -ENOTSUP;
#endif
    plane_impl = impl;
    return 0;
}

static int impl_now(void)
{
#ifdef DF_CODEC_X86
    if (plane_impl)
        return plane_impl;
    return have_avx2() ? 3 : 2;
#else
    return 1;
#endif
}

void df_codec_split_planes(const void *src, size_t n, size_t esize, uint8_t *const planes[])
{
    const uint8_t *s = src;
    int impl = impl_now();
    if (esize == 2) {
#ifdef DF_CODEC_X86
        if (impl == 3)
            split2_avx2(s, n, planes[0], planes[1]);
        else if (impl == 2)
            split2_sse2(s, n, planes[0], planes[1]);
        else
#endif
            split2_scalar(s, n, planes[0], planes[1]);
    } else if (esize == 4) {
#ifdef DF_CODEC_X86
        if (impl == 3)
            split4_avx2(s, n, planes);
        else if (impl == 2)
            split4_sse2(s, n, planes);
        else
#endif
            split4_scalar(s, n, planes);
    } else if (esize == 1) {
        memcpy(planes[0], s, n);
    }
}

void df_codec_merge_planes(const uint8_t *const planes[], size_t n, size_t esize, void *dst)
{
    uint8_t *d = dst;
    int impl = impl_now();
    if (esize == 2) {
#ifdef DF_CODEC_X86
        if (impl == 3)
            merge2_avx2(planes[0], planes[1], n, d);
        else if (impl == 2)
            merge2_sse2(planes[0], planes[1], n, d);
        else
#endif
            merge2_scalar(planes[0], planes[1], n, d);
    } else if (esize == 4) {
#ifdef DF_CODEC_X86
        if (impl == 3)
            merge4_avx2(planes, n, d);
        else if (impl == 2)
            merge4_sse2(planes, n, d);
        else
#endif
            merge4_scalar(planes, n, d);
    } else if (esize == 1) {
        memcpy(d, planes[0], n);
    }
}

int df_codec_impl(void)
{
    return impl_now();
}
