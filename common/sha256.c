#include "sha256.h"

#include "fsutil.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define DF_SHA_X86 1
#endif

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static inline uint32_t ror(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

/* The portable compression of one 64-byte block (FIPS 180-4, 6.2.2). */
static void compress1(uint32_t h[8], const uint8_t *p)
{
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
               (uint32_t)p[4 * i + 2] << 8 | (uint32_t)p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ror(w[i - 15], 7) ^ ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ror(w[i - 2], 17) ^ ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = k + (ror(e, 6) ^ ror(e, 11) ^ ror(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
        uint32_t t2 = (ror(a, 2) ^ ror(a, 13) ^ ror(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d;
    h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

static void compress_sw(uint32_t h[8], const uint8_t *p, size_t nblk)
{
    for (; nblk; nblk--, p += 64)
        compress1(h, p);
}

#ifdef DF_SHA_X86
/* The same compression on the x86 SHA extensions (SHA-NI: sha256rnds2 does
 * two rounds, sha256msg1 / sha256msg2 the message schedule), ~4-8x the
 * portable code's rate: the corpus importer hashes every input byte twice
 * (the file and the content fingerprint), and the portable code was 64% of
 * its time (docs/log/2026-11-30-session-01.md). sha256rnds2 keeps the state as two registers,
 * ABEF and CDGH (A in the top lane), so h is permuted in and out. */
__attribute__((target("sha,sse4.1"))) static void compress_ni(uint32_t h[8], const uint8_t *p, size_t nblk)
{
    /* big-endian message words: reverse the bytes of each 32-bit lane */
    const __m128i bswap = _mm_set_epi8(12, 13, 14, 15, 8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3);
    __m128i t = _mm_loadu_si128((const __m128i *)(const void *)&h[0]); /* lanes A B C D */
    __m128i u = _mm_loadu_si128((const __m128i *)(const void *)&h[4]); /* lanes E F G H */
    t = _mm_shuffle_epi32(t, 0xB1);                                   /* B A D C */
    u = _mm_shuffle_epi32(u, 0x1B);                                   /* H G F E */
    __m128i abef = _mm_alignr_epi8(t, u, 8);                          /* F E B A */
    __m128i cdgh = _mm_blend_epi16(u, t, 0xF0);                       /* H G D C */
    for (; nblk; nblk--, p += 64) {
        const __m128i abef0 = abef, cdgh0 = cdgh;
        __m128i m[4]; /* message words 4i .. 4i + 3 of the last four groups, m[i % 4] */
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            __m128i w;
            if (i < 4) {
                w = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(const void *)(p + 16 * i)), bswap);
            } else { /* W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16], t = 4i .. 4i + 3 */
                w = _mm_sha256msg1_epu32(m[i & 3], m[(i + 1) & 3]);
                w = _mm_add_epi32(w, _mm_alignr_epi8(m[(i + 3) & 3], m[(i + 2) & 3], 4));
                w = _mm_sha256msg2_epu32(w, m[(i + 3) & 3]);
            }
            m[i & 3] = w;
            __m128i wk = _mm_add_epi32(w, _mm_loadu_si128((const __m128i *)(const void *)&K[4 * i]));
            cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk); /* two rounds: the new ABEF */
            wk = _mm_shuffle_epi32(wk, 0x0E);             /* the next two words */
            abef = _mm_sha256rnds2_epu32(abef, cdgh, wk); /* (the old ABEF is the new CDGH) */
        }
        abef = _mm_add_epi32(abef, abef0);
        cdgh = _mm_add_epi32(cdgh, cdgh0);
    }
    t = _mm_shuffle_epi32(abef, 0x1B); /* A B E F */
    u = _mm_shuffle_epi32(cdgh, 0xB1); /* G H C D */
    _mm_storeu_si128((__m128i *)(void *)&h[0], _mm_blend_epi16(t, u, 0xF0)); /* A B C D */
    _mm_storeu_si128((__m128i *)(void *)&h[4], _mm_alignr_epi8(u, t, 8));    /* E F G H */
}

static int cpu_has_sha_ni(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 9)) || !(c & (1u << 19))) /* SSSE3, SSE4.1 */
        return 0;
    if (__get_cpuid_max(0, NULL) < 7)
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 29) & 1; /* SHA */
}
#endif

/* -1: not chosen yet; 0 portable; 1 SHA-NI. Racing first calls choose the
 * same value (atomic: no torn or undefined reads while they do). */
static _Atomic int g_hw = -1;

int df_sha256_use_hw(int on)
{
    int prev = g_hw < 0 ? df_sha256_hw() : g_hw;
#ifdef DF_SHA_X86
    g_hw = on && cpu_has_sha_ni();
#else
    (void)on;
    g_hw = 0;
#endif
    return prev;
}

int df_sha256_hw(void)
{
    if (g_hw < 0)
#ifdef DF_SHA_X86
        g_hw = cpu_has_sha_ni();
#else
        g_hw = 0;
#endif
    return g_hw;
}

static void compress(uint32_t h[8], const uint8_t *p, size_t nblk)
{
#ifdef DF_SHA_X86
    if (df_sha256_hw()) {
        compress_ni(h, p, nblk);
        return;
    }
#endif
    compress_sw(h, p, nblk);
}

void df_sha256_init(df_sha256_ctx *s)
{
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, iv, sizeof iv);
    s->nbytes = 0;
    s->nbuf = 0;
}

void df_sha256_update(df_sha256_ctx *s, const void *data, size_t len)
{
    const uint8_t *p = data;
    s->nbytes += len;
    if (s->nbuf) {
        size_t take = 64 - s->nbuf < len ? 64 - s->nbuf : len;
        memcpy(s->buf + s->nbuf, p, take);
        s->nbuf += take;
        p += take;
        len -= take;
        if (s->nbuf < 64)
            return;
        compress(s->h, s->buf, 1);
        s->nbuf = 0;
    }
    if (len >= 64) {
        compress(s->h, p, len / 64);
        p += len / 64 * 64;
        len %= 64;
    }
    if (len) {
        memcpy(s->buf, p, len);
        s->nbuf = len;
    }
}

void df_sha256_final(df_sha256_ctx *s, uint8_t out[DF_SHA256_LEN])
{
    uint64_t bits = s->nbytes * 8;
    s->buf[s->nbuf++] = 0x80;
    if (s->nbuf > 56) {
        memset(s->buf + s->nbuf, 0, 64 - s->nbuf);
        compress(s->h, s->buf, 1);
        s->nbuf = 0;
    }
    memset(s->buf + s->nbuf, 0, 56 - s->nbuf);
    for (int i = 0; i < 8; i++)
        s->buf[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    compress(s->h, s->buf, 1);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s->h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s->h[i] >> 8);
        out[4 * i + 3] = (uint8_t)s->h[i];
    }
    s->nbuf = 0;
}

void df_sha256(const void *data, size_t len, uint8_t out[DF_SHA256_LEN])
{
    df_sha256_ctx s;
    df_sha256_init(&s);
    df_sha256_update(&s, data, len);
    df_sha256_final(&s, out);
}

void df_sha256_hex(const uint8_t digest[DF_SHA256_LEN], char out[DF_SHA256_HEX])
{
    static const char hx[] = "0123456789abcdef";
    for (int i = 0; i < DF_SHA256_LEN; i++) {
        out[2 * i] = hx[digest[i] >> 4];
        out[2 * i + 1] = hx[digest[i] & 15];
    }
    out[64] = 0;
}

void df_sha256_hex_of(const void *data, size_t len, char out[DF_SHA256_HEX])
{
    uint8_t d[DF_SHA256_LEN];
    df_sha256(data, len, d);
    df_sha256_hex(d, out);
}

int df_sha256_file(const char *path, char out_hex[DF_SHA256_HEX], df_err *e)
{
    out_hex[0] = 0;
    int fd = df_open_regular(path, O_RDONLY, 0, e); /* a FIFO would block the hash */
    if (fd < 0)
        return fd;
    df_sha256_ctx s;
    df_sha256_init(&s);
    uint8_t buf[1 << 16];
    for (;;) {
        ssize_t r = read(fd, buf, sizeof buf);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            int err = -errno;
            close(fd);
            return df_errf(e, err, "%s: read failed at offset %llu: %s", path,
                           (unsigned long long)s.nbytes, strerror(-err));
        }
        if (r == 0)
            break;
        df_sha256_update(&s, buf, (size_t)r);
    }
    close(fd);
    uint8_t d[DF_SHA256_LEN];
    df_sha256_final(&s, d);
    df_sha256_hex(d, out_hex);
    return 0;
}
