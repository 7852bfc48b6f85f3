/* codec_block.c - the block-scaled lossy codecs: fp8-b32 (id 5) and
 * int4-b32, int5-b32, int6-b32, int3-b32, int2-b32 (ids 6-10; the code
 * width N is the only difference). Rules and error bounds: codec.h;
 * payload layout and measurements: docs/FORMAT-codecs.md.
 *
 * A row is cut into blocks of 32 consecutive elements (the last one shorter
 * when the row is not a multiple of 32; blocks never span rows). Each block
 * has a bf16 scale, the smallest bf16 >= absmax / Q (Q = 448 for e4m3,
 * 2^(b-1)-1 for b-bit integers), so the block's largest value maps to just
 * under Q and nothing clips; one massive activation then only coarsens its
 * own block instead of the whole row. The integer codecs keep the few values
 * of a block that stand far above the rest (and NaN/Inf) exactly, as
 * "escapes", so that a massive activation does not crush its 31 neighbours.
 *
 * Planes: the scales' high bytes, their low bytes, the codes (and for the
 * integer codecs the escaped values), each stored raw or as one zstd frame.
 * Decoding checks every size against the sub-header and the payload first,
 * then every scale, and counts escapes against the declared number.
 */
#include <string.h>

#include "codec_internal.h"
#include "le.h"

#define BLK 32        /* elements per block */
#define ESC_MAX 4     /* at most this many escaped finite values per block */
#define ESC_GAP 2.0   /* ... and only when they exceed ESC_GAP x the rest */
_Static_assert(ESC_MAX == 4, "int_block_scale keeps the 5 largest values");

typedef struct geom {
    int bits;        /* 0: one e4m3 byte per element; 2 .. 6: packed integers */
    int P;           /* planes */
    size_t fields;   /* offset of plane 0's (mode, size) in the sub-header */
    size_t hdr;      /* sub-header bytes */
    size_t rows, re, es, n;
    size_t nbr, nb;  /* blocks per row, blocks in all */
    size_t cb;       /* code bytes per row */
    size_t code_len; /* code plane bytes */
} geom;

static const char *const plane_names[4] = {"scale high bytes", "scale low bytes", "codes",
                                           "escaped values"};

static size_t bit_bytes(size_t k, int bits)
{
    return (k * (size_t)bits + 7) / 8;
}

/* The code width of an integer codec, 0 for fp8-b32. */
static int int_bits(int id)
{
    switch (id) {
    case DF_CODEC_INT4_B32: return 4;
    case DF_CODEC_INT5_B32: return 5;
    case DF_CODEC_INT6_B32: return 6;
    case DF_CODEC_INT3_B32: return 3;
    case DF_CODEC_INT2_B32: return 2;
    default: return 0;
    }
}

/* Returns -1 when a plane could not be described by a u32 size. */
static int make_geom(int id, const df_codec_params *p, size_t raw_len, size_t rb, geom *g)
{
    g->bits = int_bits(id);
    g->P = g->bits ? 4 : 3;
    g->fields = g->bits ? 5 : 1;
    g->hdr = g->fields + 5 * (size_t)g->P;
    g->es = df_dtype_size(p->dtype);
    g->re = p->row_elems;
    g->rows = raw_len / rb;
    g->n = g->rows * g->re;
    g->nbr = (g->re + BLK - 1) / BLK;
    g->nb = g->rows * g->nbr;
    g->cb = g->bits ? g->re / BLK * 4 * (size_t)g->bits + bit_bytes(g->re % BLK, g->bits) : g->re;
    g->code_len = g->rows * g->cb;
    return g->n > UINT32_MAX ? -1 : 0;
}

static inline float bf16_val(uint32_t h) { return df_bf16_to_f32((uint16_t)h); }

static inline float f32_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The smallest bf16 >= t (t >= 0, finite), as bits; the largest finite
 * bf16 (0x7f7f) for t above it, which only int2 (t = A / 1) meets, on F32
 * data. (float)t is within an f32 ulp of t, so the loop runs at most twice. */
static uint16_t bf16_ceil(double t)
{
    float f = (float)t;
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t h = u >> 16;
    while (h < 0x7f7f && (double)bf16_val(h) < t)
        h++;
    return (uint16_t)h;
}

/* ---- encoding ------------------------------------------------------------ */

/* One fp8-b32 row: per block the scale, then the e4m3 codes (codec 4's kernel). */
static void enc_row_fp8(const uint32_t *xb, const geom *g, uint8_t *shi, uint8_t *slo, uint8_t *codes)
{
    for (size_t j = 0, k0 = 0; k0 < g->re; j++, k0 += BLK) {
        size_t k = g->re - k0 < BLK ? g->re - k0 : BLK;
        uint32_t mb = 0; /* absmax of the finite values, as bits (they order like values) */
        for (size_t i = 0; i < k; i++) {
            uint32_t a = xb[k0 + i] & 0x7fffffffu;
            a = a < 0x7f800000u ? a : 0;
            mb = a > mb ? a : mb;
        }
        uint16_t sb = bf16_ceil((double)f32_of(mb) / 448.0);
        shi[j] = (uint8_t)(sb >> 8);
        slo[j] = (uint8_t)sb;
        df_codec_quant_e4m3(xb + k0, k, bf16_val(sb), codes + k0);
    }
}

/* The escapes and scale of one integer block of k elements (f32 bits xb).
 * Escaped: the top nj finite |x| for the largest nj <= ESC_MAX (and < k)
 * with top[nj-1] > ESC_GAP * top[nj] > 0 (a clear gap between them and the
 * rest), and every non-finite value. Sets *thr: finite |x| bits >= *thr are
 * escaped (exactly the top nj, since the next is below half of top[nj-1];
 * 0x7fffffff when none). Returns the bf16 scale bits, from the largest value
 * not escaped. */
static uint16_t int_block_scale(const uint32_t *xb, size_t k, int b, uint32_t *thr)
{
    /* fast path: 5 or more values above half the absmax leave no gap */
    uint32_t m1 = 0;
    for (size_t i = 0; i < k; i++) {
        uint32_t a = xb[i] & 0x7fffffffu;
        a = a < 0x7f800000u ? a : 0;
        m1 = a > m1 ? a : m1;
    }
    /* exact but for a subnormal m1, where rounding can only make cnt smaller
     * (the exact path below then decides) */
    const float half = f32_of(m1) * 0.5f;
    int cnt = 0;
    for (size_t i = 0; i < k; i++) {
        uint32_t a = xb[i] & 0x7fffffffu;
        cnt += a < 0x7f800000u && f32_of(a) > half;
    }
    uint32_t top[ESC_MAX + 1] = {m1};
    int nj = 0;
    if (cnt <= ESC_MAX) {
        /* the ESC_MAX+1 largest, by a branch-free insertion (max/min chain) */
        uint32_t t0 = 0, t1 = 0, t2 = 0, t3 = 0, t4 = 0;
        for (size_t i = 0; i < k; i++) {
            uint32_t a = xb[i] & 0x7fffffffu, u;
            a = a < 0x7f800000u ? a : 0;
            u = t0 > a ? t0 : a, a = t0 > a ? a : t0, t0 = u;
            u = t1 > a ? t1 : a, a = t1 > a ? a : t1, t1 = u;
            u = t2 > a ? t2 : a, a = t2 > a ? a : t2, t2 = u;
            u = t3 > a ? t3 : a, a = t3 > a ? a : t3, t3 = u;
            t4 = t4 > a ? t4 : a;
        }
        top[0] = t0, top[1] = t1, top[2] = t2, top[3] = t3, top[4] = t4;
        for (int q = 1; q <= ESC_MAX && (size_t)q < k; q++)
            if (top[q] && (double)f32_of(top[q - 1]) > ESC_GAP * (double)f32_of(top[q]))
                nj = q;
    }
    *thr = nj ? top[nj - 1] : 0x7fffffffu;
    return bf16_ceil((double)f32_of(top[nj]) / (double)((1 << (b - 1)) - 1));
}

/* Codes of one block, scalar: q = RNE(x / scale) of the exact quotient
 * (double is exact enough: see codec 4's quantizer), two's complement b-bit,
 * packed little-endian (code i at bits [i*b, i*b + b)); an escape is the
 * code -2^(b-1), and its element's raw bytes are appended to esc. Returns
 * the escapes written. */
static size_t enc_int_scalar(const uint32_t *xb, const uint8_t *raw, size_t k, int b, float s,
                             uint32_t thr, size_t es, uint8_t *out, uint8_t *esc)
{
    const uint32_t mask = (1u << b) - 1, escape = 1u << (b - 1);
    const double qmax = (double)((1 << (b - 1)) - 1), ds = s;
    size_t ne = 0;
    uint64_t acc = 0;
    int nacc = 0;
    for (size_t i = 0; i < k; i++) {
        uint32_t x = xb[i], a = x & 0x7fffffffu, code;
        if (a >= 0x7f800000u || a >= thr) {
            code = escape;
            memcpy(esc + ne * es, raw + i * es, es);
            ne++;
        } else {
            double q = ds > 0 ? (double)f32_of(x) / ds : 0.0;
            q = (q + 0x1.8p52) - 0x1.8p52; /* RNE to an integer (|q| <= qmax) */
            q = q > qmax ? qmax : q < -qmax ? -qmax : q;
            code = (uint32_t)(int32_t)q & mask;
        }
        acc |= (uint64_t)code << nacc;
        nacc += b;
        if (nacc >= 8) {
            *out++ = (uint8_t)acc;
            acc >>= 8;
            nacc -= 8;
        }
    }
    if (nacc)
        *out = (uint8_t)acc;
    return ne;
}

#ifdef DF_CODEC_X86
/* enc_int_scalar for a full block of 32, same bytes. Writes 8 bytes per 8
 * codes (b of them valid): the caller leaves 8 bytes of room past the plane. */
__attribute__((target("avx2"))) static size_t enc_int_block_avx2(const uint32_t *xb,
                                                                 const uint8_t *raw, int b, float s,
                                                                 uint32_t thr, size_t es,
                                                                 uint8_t *out, uint8_t *esc)
{
    const double qmax = (double)((1 << (b - 1)) - 1);
    const __m256d vs = _mm256_set1_pd(s), vhi = _mm256_set1_pd(qmax), vlo = _mm256_set1_pd(-qmax);
    const __m256i mask = _mm256_set1_epi32((1 << b) - 1), escape = _mm256_set1_epi32(1 << (b - 1));
    const __m256i vthr = _mm256_set1_epi32((int)thr - 1), inf = _mm256_set1_epi32(0x7f7fffff);
    const __m256i lanes = _mm256_setr_epi64x(0, 2 * b, 4 * b, 6 * b);
    const __m128i vb = _mm_cvtsi32_si128(b);
    unsigned escmask = 0;
    for (int g = 0; g < 4; g++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(xb + 8 * g));
        __m256i a = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
        __m256i q32 = _mm256_setzero_si256();
        if (s > 0) {
            __m256 xf = _mm256_castsi256_ps(x);
            __m256d q0 = _mm256_div_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(xf)), vs);
            __m256d q1 = _mm256_div_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(xf, 1)), vs);
            q0 = _mm256_round_pd(q0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q1 = _mm256_round_pd(q1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q0 = _mm256_max_pd(_mm256_min_pd(q0, vhi), vlo);
            q1 = _mm256_max_pd(_mm256_min_pd(q1, vhi), vlo);
            q32 = _mm256_set_m128i(_mm256_cvtpd_epi32(q1), _mm256_cvtpd_epi32(q0));
        }
        __m256i e = _mm256_or_si256(_mm256_cmpgt_epi32(a, inf), _mm256_cmpgt_epi32(a, vthr));
        __m256i code = _mm256_blendv_epi8(_mm256_and_si256(q32, mask), escape, e);
        escmask |= (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(e)) << (8 * g);
        /* 8 codes -> 8b bits: pairs in 64-bit lanes, then lanes shifted into place */
        __m256i odd = _mm256_srli_epi64(code, 32);
        __m256i even = _mm256_and_si256(code, _mm256_set1_epi64x(0xffffffff));
        __m256i pr = _mm256_sllv_epi64(_mm256_or_si256(even, _mm256_sll_epi64(odd, vb)), lanes);
        __m128i o = _mm_or_si128(_mm256_castsi256_si128(pr), _mm256_extracti128_si256(pr, 1));
        o = _mm_or_si128(o, _mm_unpackhi_epi64(o, o));
        uint64_t w = (uint64_t)_mm_cvtsi128_si64(o);
        memcpy(out + (size_t)g * b, &w, 8);
    }
    size_t ne = 0;
    while (escmask) {
        int i = __builtin_ctz(escmask);
        escmask &= escmask - 1;
        memcpy(esc + ne * es, raw + (size_t)i * es, es);
        ne++;
    }
    return ne;
}
#endif

/* One integer row: per block the escapes and scale, then the codes.
 * Returns the escapes written to esc. */
static size_t enc_row_int(const uint32_t *xb, const uint8_t *raw, const geom *g, uint8_t *shi,
                          uint8_t *slo, uint8_t *codes, uint8_t *esc)
{
    const int b = g->bits;
#ifdef DF_CODEC_X86
    const int avx2 = df_codec_impl() == 3;
#endif
    size_t ne = 0;
    for (size_t j = 0, k0 = 0; k0 < g->re; j++, k0 += BLK) {
        size_t k = g->re - k0 < BLK ? g->re - k0 : BLK;
        uint32_t thr;
        uint16_t sb = int_block_scale(xb + k0, k, b, &thr);
        shi[j] = (uint8_t)(sb >> 8);
        slo[j] = (uint8_t)sb;
        uint8_t *out = codes + j * 4 * (size_t)b;
#ifdef DF_CODEC_X86
        if (avx2 && k == BLK) {
            ne += enc_int_block_avx2(xb + k0, raw + k0 * g->es, b, bf16_val(sb), thr, g->es, out,
                                     esc + ne * g->es);
            continue;
        }
#endif
        ne += enc_int_scalar(xb + k0, raw + k0 * g->es, k, b, bf16_val(sb), thr, g->es, out,
                             esc + ne * g->es);
    }
    return ne;
}

/* Writes the planes after the sub-header, each zstd-coded when try_code[k]
 * and that is smaller, else raw, with their (mode, size) fields. Returns the
 * payload size (< raw_len), 0 for "store it", or a negative code. */
static long long emit_planes(df_codec_ctx *c, int level, const geom *g, uint8_t *const pl[],
                             const size_t len[], const int try_code[], uint8_t *dst,
                             size_t raw_len, df_err *e)
{
    const size_t limit = raw_len - 1;
    size_t pos = g->hdr;
    dst[0] = (uint8_t)g->P;
    for (int k = 0; k < g->P; k++) {
        if (pos > limit || len[k] > UINT32_MAX)
            return 0;
        size_t room = limit - pos;
        long long sz = 0;
        if (try_code[k] && len[k] > 1) {
            size_t cap = len[k] - 1 < room ? len[k] - 1 : room; /* must beat raw */
            sz = df_codec_code_plane(c, PLANE_ZSTD, level, pl[k], len[k], dst + pos, cap, e);
            if (sz < 0)
                return sz;
        }
        uint8_t *f = dst + g->fields + 5 * (size_t)k;
        if (sz > 0) {
            f[0] = PLANE_ZSTD;
            df_put32(f + 1, (uint32_t)sz);
            pos += (size_t)sz;
        } else {
            if (len[k] > room)
                return 0;
            f[0] = PLANE_RAW;
            df_put32(f + 1, (uint32_t)len[k]);
            if (len[k])
                memcpy(dst + pos, pl[k], len[k]);
            pos += len[k];
        }
    }
    return pos < raw_len ? (long long)pos : 0;
}

long long df_codec_block_encode(df_codec_ctx *c, int id, const df_codec_params *p,
                                const uint8_t *src, size_t raw_len, size_t rb, uint8_t *dst,
                                df_err *e)
{
    geom g;
    if (make_geom(id, p, raw_len, rb, &g) < 0 || g.hdr >= raw_len)
        return 0;
    /* scratch: scale planes, codes (+ 8 bytes the SIMD packer may spill),
     * escaped values (at most every element) */
    size_t esc_cap = g.bits ? raw_len : 0;
    uint8_t *buf = df_codec_scratch(c, 2 * g.nb + g.code_len + 8 + esc_cap, e);
    uint32_t *xb = df_codec_row_buf(c, g.re, e);
    if (!buf || !xb)
        return -ENOMEM;
    uint8_t *shi = buf, *slo = buf + g.nb, *codes = slo + g.nb, *esc = codes + g.code_len + 8;
    size_t ne = 0;
    for (size_t r = 0; r < g.rows; r++) {
        const uint8_t *row = src + r * rb;
        df_codec_row_to_f32_bits(row, g.re, p->dtype, xb);
        if (g.bits)
            ne += enc_row_int(xb, row, &g, shi + r * g.nbr, slo + r * g.nbr, codes + r * g.cb,
                              esc + ne * g.es);
        else
            enc_row_fp8(xb, &g, shi + r * g.nbr, slo + r * g.nbr, codes + r * g.cb);
    }
    if (g.bits)
        df_put32(dst + 1, (uint32_t)ne); /* ne <= n <= UINT32_MAX */
    uint8_t *const pl[4] = {shi, slo, codes, esc};
    const size_t len[4] = {g.nb, g.nb, g.code_len, ne * g.es};
    /* The low scale bytes are near-random: zstd only when a sample says so. */
    const int try_code[4] = {1, df_codec_plane_looks_compressible(slo, g.nb), 1, 1};
    return emit_planes(c, p->level, &g, pl, len, try_code, dst, raw_len, e);
}

/* ---- decoding ------------------------------------------------------------ */

/* fp8-b32 rows, scalar: v = e4m3(code) * scale in f32 (exact: 4 x 8
 * significant bits), then RNE to the dtype. */
static void dec_fp8_scalar(const uint8_t *in, size_t k, float s, df_dtype t, uint8_t *out)
{
    for (size_t i = 0; i < k; i++) {
        uint32_t b = df_e4m3_dequant_bits(in[i], s);
        if (t == DF_DTYPE_F32) {
            memcpy(out + 4 * i, &b, 4);
        } else {
            uint16_t h = t == DF_DTYPE_BF16 ? df_bits_to_bf16(b) : df_f32_to_f16(f32_of(b));
            memcpy(out + 2 * i, &h, 2);
        }
    }
}

#ifdef DF_CODEC_X86
/* one full block of 32 codes, BF16 or F32 out */
__attribute__((target("avx2"))) static void dec_fp8_block_avx2(const uint8_t *in, float s,
                                                               df_dtype t, uint8_t *out)
{
    const __m256 vs = _mm256_set1_ps(s);
    for (int h = 0; h < 2; h++) {
        __m128i c16 = _mm_loadu_si128((const __m128i *)(in + 16 * h));
        __m256i b0 = df_e4m3_dequant8_avx2(_mm256_cvtepu8_epi32(c16), vs);
        __m256i b1 = df_e4m3_dequant8_avx2(_mm256_cvtepu8_epi32(_mm_srli_si128(c16, 8)), vs);
        if (t == DF_DTYPE_F32) {
            _mm256_storeu_si256((__m256i *)(out + 64 * h), b0);
            _mm256_storeu_si256((__m256i *)(out + 64 * h + 32), b1);
        } else {
            _mm256_storeu_si256((__m256i *)(out + 32 * h), df_bf16_pack16_avx2(b0, b1));
        }
    }
}
#endif

static void dec_rows_fp8(const geom *g, const uint8_t *shi, const uint8_t *slo,
                         const uint8_t *codes, df_dtype t, uint8_t *dst, size_t rb)
{
#ifdef DF_CODEC_X86
    const int avx2 = t != DF_DTYPE_F16 && df_codec_impl() == 3;
#endif
    for (size_t r = 0; r < g->rows; r++) {
        const uint8_t *in = codes + r * g->cb;
        uint8_t *out = dst + r * rb;
        for (size_t j = r * g->nbr, k0 = 0; k0 < g->re; j++, k0 += BLK) {
            size_t k = g->re - k0 < BLK ? g->re - k0 : BLK;
            float s = bf16_val((uint32_t)shi[j] << 8 | slo[j]);
#ifdef DF_CODEC_X86
            if (avx2 && k == BLK) {
                dec_fp8_block_avx2(in + k0, s, t, out + k0 * g->es);
                continue;
            }
#endif
            dec_fp8_scalar(in + k0, k, s, t, out + k0 * g->es);
        }
    }
}

/* Writes v (f32 bits) as element i of dtype t at out. */
static inline void put_elem(uint8_t *out, size_t i, uint32_t b, df_dtype t)
{
    if (t == DF_DTYPE_F32) {
        memcpy(out + 4 * i, &b, 4);
    } else {
        uint16_t h = t == DF_DTYPE_BF16 ? df_bits_to_bf16(b) : df_f32_to_f16(f32_of(b));
        memcpy(out + 2 * i, &h, 2);
    }
}

typedef struct esc_src {
    const uint8_t *p; /* the escaped values */
    size_t n, used;   /* declared, consumed */
} esc_src;

/* One block of k integer codes at in (bit_bytes(k, b) bytes), scalar:
 * v = q * scale in f32 (exact: 6 x 8 significant bits), RNE to the dtype;
 * an escape copies the next escaped value. Returns -1 when the escapes run out. */
static int dec_int_scalar(const uint8_t *in, size_t k, int b, float s, df_dtype t, size_t es,
                          esc_src *x, uint8_t *out)
{
    const uint32_t mask = (1u << b) - 1, escape = 1u << (b - 1);
    uint64_t acc = 0;
    int nacc = 0;
    for (size_t i = 0; i < k; i++) {
        if (nacc < b) {
            acc |= (uint64_t)*in++ << nacc;
            nacc += 8;
        }
        uint32_t code = (uint32_t)acc & mask;
        acc >>= b;
        nacc -= b;
        if (code == escape) {
            if (x->used >= x->n)
                return -1;
            memcpy(out + i * es, x->p + x->used * es, es);
            x->used++;
            continue;
        }
        float f = (float)((int32_t)(code ^ escape) - (int32_t)escape) * s;
        uint32_t bits;
        memcpy(&bits, &f, 4);
        put_elem(out, i, bits, t);
    }
    return 0;
}

#ifdef DF_CODEC_X86
typedef struct int_avx2_tab {
    __m256i shuf, shift, escape;
    __m128i up, down; /* shift counts that sign-extend the low b bits */
} int_avx2_tab;

__attribute__((target("avx2"))) static void int_avx2_setup(int b, int_avx2_tab *tb)
{
    /* lane i (0-7) of a group of 8 codes (b bytes) gets the two bytes that
     * hold bits [i*b, i*b + b), then is shifted right by (i*b) % 8: any b
     * from 2 to 9 (a code never spans more than two bytes), so int3's codes
     * that cross a byte boundary and int2's take the same path */
    uint8_t sh[32];
    uint32_t sv[8];
    for (int i = 0; i < 8; i++) {
        int lo = i * b / 8, o = (i & 3) * 4 + (i >> 2) * 16;
        sh[o] = (uint8_t)lo;
        sh[o + 1] = (uint8_t)(lo + 1);
        sh[o + 2] = sh[o + 3] = 0x80;
        sv[i] = (uint32_t)(i * b % 8);
    }
    tb->shuf = _mm256_loadu_si256((const __m256i *)sh);
    tb->shift = _mm256_loadu_si256((const __m256i *)sv);
    tb->escape = _mm256_set1_epi32(-(1 << (b - 1)));
    tb->up = _mm_cvtsi32_si128(32 - b);
    tb->down = tb->up;
}

/* 8 codes from the b bytes at p (8 bytes are read), sign-extended */
__attribute__((target("avx2"))) static inline __m256i int_codes8_avx2(const uint8_t *p,
                                                                     const int_avx2_tab *tb)
{
    long long w;
    memcpy(&w, p, 8);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi64x(w), tb->shuf);
    v = _mm256_srlv_epi32(v, tb->shift);
    return _mm256_sra_epi32(_mm256_sll_epi32(v, tb->up), tb->down);
}

/* One full block (32 codes, 4b bytes; 8 readable bytes past the last group),
 * BF16 or F32 out; escapes are patched in afterwards, in element order. */
__attribute__((target("avx2"))) static int dec_int_block_avx2(const uint8_t *in, int b, float s,
                                                              df_dtype t, size_t es, esc_src *x,
                                                              const int_avx2_tab *tb, uint8_t *out)
{
    const __m256 vs = _mm256_set1_ps(s);
    unsigned escmask = 0;
    for (int h = 0; h < 2; h++) {
        __m256i c0 = int_codes8_avx2(in + (2 * h) * b, tb);
        __m256i c1 = int_codes8_avx2(in + (2 * h + 1) * b, tb);
        escmask |= (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(c0, tb->escape)))
                   << (16 * h);
        escmask |= (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(c1, tb->escape)))
                   << (16 * h + 8);
        __m256i b0 = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(c0), vs));
        __m256i b1 = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(c1), vs));
        if (t == DF_DTYPE_F32) {
            _mm256_storeu_si256((__m256i *)(out + 64 * h), b0);
            _mm256_storeu_si256((__m256i *)(out + 64 * h + 32), b1);
        } else {
            _mm256_storeu_si256((__m256i *)(out + 32 * h), df_bf16_pack16_avx2(b0, b1));
        }
    }
    while (escmask) {
        int i = __builtin_ctz(escmask);
        escmask &= escmask - 1;
        if (x->used >= x->n)
            return -1;
        memcpy(out + (size_t)i * es, x->p + x->used * es, es);
        x->used++;
    }
    return 0;
}
#endif

static int dec_rows_int(const geom *g, const uint8_t *shi, const uint8_t *slo,
                        const uint8_t *codes, esc_src *x, df_dtype t, uint8_t *dst, size_t rb)
{
    const int b = g->bits;
    const uint8_t *end = codes + g->code_len;
#ifdef DF_CODEC_X86
    const int avx2 = t != DF_DTYPE_F16 && df_codec_impl() == 3;
    int_avx2_tab tb;
    if (avx2)
        int_avx2_setup(b, &tb);
#endif
    for (size_t r = 0; r < g->rows; r++) {
        const uint8_t *in = codes + r * g->cb;
        uint8_t *out = dst + r * rb;
        for (size_t j = r * g->nbr, k0 = 0; k0 < g->re; j++, k0 += BLK) {
            size_t k = g->re - k0 < BLK ? g->re - k0 : BLK;
            float s = bf16_val((uint32_t)shi[j] << 8 | slo[j]);
            int rc;
#ifdef DF_CODEC_X86
            if (avx2 && k == BLK && (size_t)(end - in) >= 4 * (size_t)b + 8)
                rc = dec_int_block_avx2(in, b, s, t, g->es, x, &tb, out + k0 * g->es);
            else
#endif
                rc = dec_int_scalar(in, k, b, s, t, g->es, x, out + k0 * g->es);
            if (rc < 0)
                return -1;
            in += bit_bytes(k, b);
        }
    }
    (void)end;
    return 0;
}

int df_codec_block_decode(df_codec_ctx *c, int id, const df_codec_params *p, const uint8_t *src,
                          size_t src_len, uint8_t *dst, size_t raw_len, size_t rb, df_err *e)
{
    const char *name = df_codec_name(id);
    geom g;
    if (make_geom(id, p, raw_len, rb, &g) < 0)
        return df_errf(e, -DF_ECORRUPT, "%s: a block of %zu bytes is too large for this codec",
                       name, raw_len);
    if (src_len < g.hdr)
        return df_errf(e, -DF_ECORRUPT, "%s: payload of %zu bytes is shorter than its %zu-byte header",
                       name, src_len, g.hdr);
    if (src[0] != g.P)
        return df_errf(e, -DF_ECORRUPT, "%s: %u planes, expected %d", name, src[0], g.P);
    size_t ne = g.bits ? df_le32(src + 1) : 0;
    if (ne > g.n)
        return df_errf(e, -DF_ECORRUPT, "%s: %zu escaped values for %zu elements", name, ne, g.n);
    const size_t want[4] = {g.nb, g.nb, g.code_len, ne * g.es};
    size_t off[4], len[4], pos = g.hdr, coded = 0;
    int mode[4];
    for (int k = 0; k < g.P; k++) {
        const uint8_t *f = src + g.fields + 5 * (size_t)k;
        mode[k] = f[0];
        len[k] = df_le32(f + 1);
        if (mode[k] != PLANE_RAW && mode[k] != PLANE_ZSTD)
            return df_errf(e, -DF_ECORRUPT, "%s: plane %d (%s) has mode %d", name, k, plane_names[k],
                           mode[k]);
        if (mode[k] == PLANE_RAW ? len[k] != want[k] : len[k] == 0 || want[k] == 0)
            return df_errf(e, -DF_ECORRUPT, "%s: plane %d (%s): stored size %zu does not fit %zu bytes",
                           name, k, plane_names[k], len[k], want[k]);
        if (len[k] > src_len - pos)
            return df_errf(e, -DF_ECORRUPT,
                           "%s: plane %d (%s, %zu bytes at %zu) overruns the %zu-byte payload", name,
                           k, plane_names[k], len[k], pos, src_len);
        off[k] = pos;
        pos += len[k];
        coded += mode[k] == PLANE_ZSTD ? want[k] : 0;
    }
    if (pos != src_len)
        return df_errf(e, -DF_ECORRUPT, "%s: planes end at %zu, payload has %zu bytes", name, pos,
                       src_len);
    /* raw planes are read in place, coded ones decoded into scratch */
    uint8_t *buf = NULL;
    if (coded && !(buf = df_codec_scratch(c, coded, e)))
        return -ENOMEM;
    const uint8_t *pl[4] = {NULL, NULL, NULL, NULL};
    for (int k = 0; k < g.P; k++) {
        if (mode[k] == PLANE_RAW) {
            pl[k] = src + off[k];
            continue;
        }
        int rc = df_codec_decode_plane(c, id, k, mode[k], src + off[k], len[k], buf, want[k], e);
        if (rc < 0)
            return rc;
        pl[k] = buf;
        buf += want[k];
    }
    /* scales: finite and not negative (bf16 bits below 0x7f80) */
    for (size_t j = 0; j < g.nb; j++) {
        if (pl[0][j] >= 0x80 || (pl[0][j] == 0x7f && pl[1][j] >= 0x80))
            return df_errf(e, -DF_ECORRUPT, "%s: plane 0/1 (scales): block %zu (row %zu) has scale bits 0x%04x",
                           name, j, j / g.nbr, (unsigned)(pl[0][j] << 8 | pl[1][j]));
    }
    if (!g.bits) {
        dec_rows_fp8(&g, pl[0], pl[1], pl[2], p->dtype, dst, rb);
        return 0;
    }
    esc_src x = {pl[3], ne, 0};
    if (dec_rows_int(&g, pl[0], pl[1], pl[2], &x, p->dtype, dst, rb) < 0 || x.used != ne)
        return df_errf(e, -DF_ECORRUPT,
                       "%s: plane 3 (escaped values): the codes hold %s escapes than the %zu values",
                       name, x.used == ne ? "more" : "fewer", ne);
    return 0;
}
