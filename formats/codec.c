/* codec.c - hidden-state block codecs (see codec.h; payload layouts in
 * docs/FORMAT-codecs.md); the block-scaled lossy ones (ids 5-10) are in
 * codec_block.c, on the helpers that codec_internal.h exports from here;
 * the byte-plane transposes and the SIMD level are codec_planes.c.
 *
 * Shape of every codec: validate params, transform into ctx scratch (byte
 * planes, or e4m3 codes), entropy-code straight into dst with a capacity one
 * byte under raw_len (so "not smaller" shows up as a failed compression, never
 * as a grown block), and fall back per plane to raw and per block to STORED.
 * Decoding checks every length against the sub-header and src_len before it
 * touches memory; the entropy decoders are asked for exactly the expected
 * size and must produce exactly that.
 */
#include "codec.h"

#include <lz4.h>
#include <lz4hc.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <zstd.h>
#include <zstd_errors.h>

#include "codec_internal.h"
#include "e4m3.h"
#include "le.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "codec.c reads element values in host order; raw blocks are little-endian"
#endif

/* A plane other than the top one is only tried with zstd when a sampled
 * entropy says it could shrink by a few percent: the bf16 low byte
 * (7.87 bits/byte on real data) would waste compression time for nothing,
 * while an all-zero f32 tail (data upcast from bf16) shrinks to ~0. */
#define DF_PLANE_TRY_P2 0.0051543 /* 2^-7.6: try below ~7.6 bits/byte */

struct df_codec_ctx {
    ZSTD_CCtx *zc;
    ZSTD_DCtx *zd;
    int zc_level;        /* level currently applied to zc; INT_MIN = none */
    void *lz4_state;     /* LZ4_sizeofState() bytes */
    void *lz4hc_state;   /* LZ4_sizeofStateHC() bytes, made on first HC use */
    uint8_t *scratch;    /* planes / e4m3 codes; 64-byte aligned */
    size_t scratch_cap;
    uint32_t *row;       /* fp8 encoder: one row as f32 bits */
    size_t row_cap;
};

/* ---- names ------------------------------------------------------------ */

static const char *const codec_names[DF_CODEC_COUNT] = {
    "stored", "lz4", "split-lz4", "split-zstd", "fp8-e4m3",
    "fp8-b32", "int4-b32", "int5-b32", "int6-b32", "int3-b32", "int2-b32"};

const char *df_codec_name(int id)
{
    return id >= 0 && id < DF_CODEC_COUNT ? codec_names[id] : "?";
}

int df_codec_from_name(const char *name)
{
    for (int i = 0; name && i < DF_CODEC_COUNT; i++)
        if (!strcmp(name, codec_names[i]))
            return i;
    return -EINVAL;
}

int df_codec_is_lossy(int id)
{
    return id >= DF_CODEC_FP8_E4M3 && id < DF_CODEC_COUNT;
}

size_t df_codec_bound(int id, size_t raw_len, const df_codec_params *p)
{
    (void)id;
    (void)p;
    return raw_len; /* never grows: anything not smaller is STORED */
}

/* ---- context ------------------------------------------------------------ */

df_codec_ctx *df_codec_ctx_new(void)
{
    df_codec_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->zc = ZSTD_createCCtx();
    c->zd = ZSTD_createDCtx();
    c->lz4_state = malloc((size_t)LZ4_sizeofState());
    c->zc_level = -1000000;
    if (!c->zc || !c->zd || !c->lz4_state) {
        df_codec_ctx_free(c);
        return NULL;
    }
    return c;
}

void df_codec_ctx_free(df_codec_ctx *c)
{
    if (!c)
        return;
    ZSTD_freeCCtx(c->zc);
    ZSTD_freeDCtx(c->zd);
    free(c->lz4_state);
    free(c->lz4hc_state);
    free(c->scratch);
    free(c->row);
    free(c);
}

static uint8_t *scratch(df_codec_ctx *c, size_t n, df_err *e)
{
    if (!n)
        n = 1; /* empty planes still get a valid pointer */
    if (n <= c->scratch_cap)
        return c->scratch;
    /* Old contents are never needed across calls: free, then allocate. Grow
     * by 1/4 extra so slowly growing blocks do not reallocate every call. */
    size_t want = n + n / 4;
    if (want < n)
        want = n;
    want = (want + 63) & ~(size_t)63;
    if (want < n) {
        df_errf(e, -ENOMEM, "codec: scratch of %zu bytes", n);
        return NULL;
    }
    free(c->scratch);
    c->scratch_cap = 0;
    c->scratch = aligned_alloc(64, want);
    if (!c->scratch) {
        df_errf(e, -ENOMEM, "codec: cannot allocate %zu bytes of scratch", want);
        return NULL;
    }
    c->scratch_cap = want;
    return c->scratch;
}

/* ---- entropy coders ------------------------------------------------------ */

/* Sampled collision entropy (Renyi order 2, -log2 sum p^2) in bits per byte,
 * from at most ~16K samples; a lower bound of the order-0 entropy, so it
 * errs towards trying the coder. Compared as sum p^2 against 2^-bits to stay
 * out of libm. Returns 1 if the plane looks worth coding. */
static int plane_looks_compressible(const uint8_t *p, size_t n)
{
    if (!n)
        return 0;
    uint32_t h[256] = {0};
    size_t step = n > 16384 ? n / 16384 : 1, cnt = 0;
    for (size_t i = 0; i < n; i += step, cnt++)
        h[p[i]]++;
    double sum = 0;
    for (int k = 0; k < 256; k++)
        sum += (double)h[k] * (double)h[k];
    sum /= (double)cnt * (double)cnt;
    return sum > DF_PLANE_TRY_P2;
}

/* Applies a zstd level to the context (0 = the measured default). */
static int zstd_setup(df_codec_ctx *c, int level, df_err *e)
{
    if (c->zc_level == level)
        return 0;
    ZSTD_CCtx_reset(c->zc, ZSTD_reset_session_and_parameters);
    size_t r = ZSTD_CCtx_setParameter(c->zc, ZSTD_c_compressionLevel, level ? level : 1);
    /* The default (level 0) is zstd 1 with the smallest hash table and the
     * longest minimum match: that leaves almost only Huffman-coded literals.
     * On the sign+exponent plane, which has no long repeats, zstd-1's short
     * matches cost more bits than they save; without them the ratio is
     * better (within ~0.4% of the order-0 bound), encoding 2.3-3x and
     * decoding 1.4-1.9x faster than plain zstd-1 (measured: bench_codec
     * --explore, docs/FORMAT-codecs.md). Decoding is the same either way. */
    if (!level && !ZSTD_isError(r))
        r = ZSTD_CCtx_setParameter(c->zc, ZSTD_c_hashLog, 6);
    if (!level && !ZSTD_isError(r))
        r = ZSTD_CCtx_setParameter(c->zc, ZSTD_c_minMatch, 7);
    /* Blocks carry their own CRC32C and sizes: no frame checksum, no dict id. */
    if (!ZSTD_isError(r))
        r = ZSTD_CCtx_setParameter(c->zc, ZSTD_c_checksumFlag, 0);
    if (!ZSTD_isError(r))
        r = ZSTD_CCtx_setParameter(c->zc, ZSTD_c_dictIDFlag, 0);
    if (ZSTD_isError(r)) {
        c->zc_level = -1000000;
        return df_errf(e, -EINVAL, "zstd level %d: %s", level, ZSTD_getErrorName(r));
    }
    c->zc_level = level;
    return 0;
}

/* Compresses n bytes at src into dst (capacity cap) with the plane coder
 * `mode`. Returns the size (0 < size <= cap), 0 when it does not fit (the
 * caller stores the plane raw), or a negative code. */
static long long code_plane(df_codec_ctx *c, int mode, int level, const uint8_t *src, size_t n,
                            uint8_t *dst, size_t cap, df_err *e)
{
    if (!n || !cap)
        return 0;
    if (mode == PLANE_LZ4) {
        if (n > LZ4_MAX_INPUT_SIZE)
            return 0;
        int icap = cap > (size_t)INT32_MAX ? INT32_MAX : (int)cap;
        int r;
        if (level >= 2) {
            if (!c->lz4hc_state && !(c->lz4hc_state = malloc((size_t)LZ4_sizeofStateHC())))
                return df_errf(e, -ENOMEM, "lz4hc: cannot allocate state");
            r = LZ4_compress_HC_extStateHC(c->lz4hc_state, (const char *)src, (char *)dst, (int)n,
                                           icap, level);
        } else {
            r = LZ4_compress_fast_extState(c->lz4_state, (const char *)src, (char *)dst, (int)n,
                                           icap, level < 0 ? -level : 1);
        }
        return r > 0 ? r : 0;
    }
    int rc = zstd_setup(c, level, e);
    if (rc < 0)
        return rc;
    size_t r = ZSTD_compress2(c->zc, dst, cap, src, n);
    if (ZSTD_isError(r)) {
        if (ZSTD_getErrorCode(r) == ZSTD_error_dstSize_tooSmall)
            return 0;
        if (ZSTD_getErrorCode(r) == ZSTD_error_memory_allocation)
            return df_errf(e, -ENOMEM, "zstd: %s", ZSTD_getErrorName(r));
        return df_errf(e, -EIO, "zstd: %s", ZSTD_getErrorName(r));
    }
    return (long long)r;
}

/* Decodes one coded plane: src[0..len) must be exactly one LZ4 block or one
 * zstd frame of exactly n bytes. */
static int decode_plane(df_codec_ctx *c, int id, int k, int mode, const uint8_t *src, size_t len,
                        uint8_t *dst, size_t n, df_err *e)
{
    const char *name = df_codec_name(id);
    if (mode == PLANE_LZ4) {
        if (len > (size_t)INT32_MAX || n > (size_t)INT32_MAX)
            return df_errf(e, -DF_ECORRUPT, "%s: plane %d: lz4 sizes %zu/%zu out of range", name,
                           k, len, n);
        int r = LZ4_decompress_safe((const char *)src, (char *)dst, (int)len, (int)n);
        if (r < 0 || (size_t)r != n)
            return df_errf(e, -DF_ECORRUPT, "%s: plane %d: lz4 data %s (%d of %zu bytes)", name,
                           k, r < 0 ? "corrupt" : "short", r, n);
        return 0;
    }
    /* Exactly one frame, no trailing bytes, declared size (if any) right. */
    size_t fl = ZSTD_findFrameCompressedSize(src, len);
    if (ZSTD_isError(fl) || fl != len)
        return df_errf(e, -DF_ECORRUPT, "%s: plane %d: not one zstd frame of %zu bytes (%s)",
                       name, k, len, ZSTD_isError(fl) ? ZSTD_getErrorName(fl) : "trailing data");
    unsigned long long cs = ZSTD_getFrameContentSize(src, len);
    if (cs != ZSTD_CONTENTSIZE_UNKNOWN && cs != (unsigned long long)n)
        return df_errf(e, -DF_ECORRUPT, "%s: plane %d: zstd frame holds %llu bytes, expected %zu",
                       name, k, cs, n);
    size_t r = ZSTD_decompressDCtx(c->zd, dst, n, src, len);
    if (ZSTD_isError(r) || r != n)
        return df_errf(e, -DF_ECORRUPT, "%s: plane %d: zstd %s (%zu of %zu bytes)", name, k,
                       ZSTD_isError(r) ? ZSTD_getErrorName(r) : "frame short",
                       ZSTD_isError(r) ? (size_t)0 : r, n);
    return 0;
}

/* ---- parameter checks ---------------------------------------------------- */

static int check_params(int id, const df_codec_params *p, size_t raw_len, const char *what,
                        size_t *esize_out, size_t *row_bytes_out, df_err *e)
{
    if (id < 0 || id >= DF_CODEC_COUNT)
        return df_errf(e, -EINVAL, "%s: unknown codec id %d", what, id);
    if (!p)
        return df_errf(e, -EINVAL, "%s: no params", what);
    if (p->dtype != DF_DTYPE_BF16 && p->dtype != DF_DTYPE_F16 && p->dtype != DF_DTYPE_F32)
        return df_errf(e, -EINVAL, "%s %s: dtype %s not supported (BF16, F16, F32)", what,
                       df_codec_name(id), df_dtype_name(p->dtype));
    if (!p->row_elems)
        return df_errf(e, -EINVAL, "%s %s: row_elems is 0", what, df_codec_name(id));
    size_t es = df_dtype_size(p->dtype), rb = (size_t)p->row_elems * es;
    if (raw_len % rb)
        return df_errf(e, -EINVAL, "%s %s: %zu bytes is not a whole number of %zu-byte rows",
                       what, df_codec_name(id), raw_len, rb);
    *esize_out = es;
    *row_bytes_out = rb;
    return 0;
}

/* ---- split codecs (2, 3) ------------------------------------------------- */

static size_t split_hdr(size_t planes)
{
    return 1 + 5 * planes;
}

/* Returns the payload size (< raw_len), 0 for "store it", or a negative code. */
static long long encode_split(df_codec_ctx *c, int id, const df_codec_params *p, const uint8_t *src,
                              size_t raw_len, size_t es, uint8_t *dst, df_err *e)
{
    const size_t n = raw_len / es, P = es, H = split_hdr(P);
    const size_t limit = raw_len - 1; /* largest payload worth keeping */
    if (n > UINT32_MAX || H > limit)
        return 0;
    uint8_t *buf = scratch(c, raw_len, e);
    if (!buf)
        return -ENOMEM;
    uint8_t *planes[4] = {0};
    for (size_t k = 0; k < P; k++)
        planes[k] = buf + k * n;
    df_codec_split_planes(src, n, es, planes);

    const int coder = id == DF_CODEC_SPLIT_LZ4 ? PLANE_LZ4 : PLANE_ZSTD;
    size_t pos = H;
    dst[0] = (uint8_t)P;
    for (size_t k = 0; k < P; k++) {
        if (pos >= limit)
            return 0;
        size_t room = limit - pos;
        long long sz = 0;
        /* The top plane is always coded; for zstd the others only when a
         * sample says they may shrink (LZ4 is cheap enough to just try). */
        int try_code = coder == PLANE_LZ4 || k == 0 ||
                       plane_looks_compressible(planes[k], n);
        if (try_code) {
            size_t cap = n - 1 < room ? n - 1 : room; /* must beat raw */
            sz = code_plane(c, coder, p->level, planes[k], n, dst + pos, cap, e);
            if (sz < 0)
                return sz;
        }
        if (sz > 0) {
            dst[1 + 5 * k] = (uint8_t)coder;
            df_put32(dst + 2 + 5 * k, (uint32_t)sz);
            pos += (size_t)sz;
        } else {
            if (n > room)
                return 0;
            dst[1 + 5 * k] = PLANE_RAW;
            df_put32(dst + 2 + 5 * k, (uint32_t)n);
            memcpy(dst + pos, planes[k], n);
            pos += n;
        }
    }
    return pos < raw_len ? (long long)pos : 0;
}

static int decode_split(df_codec_ctx *c, int id, const uint8_t *src, size_t src_len, uint8_t *dst,
                        size_t raw_len, size_t es, df_err *e)
{
    const char *name = df_codec_name(id);
    const size_t n = raw_len / es, P = es, H = split_hdr(P);
    const int coder = id == DF_CODEC_SPLIT_LZ4 ? PLANE_LZ4 : PLANE_ZSTD;
    if (src_len < H)
        return df_errf(e, -DF_ECORRUPT, "%s: payload of %zu bytes is shorter than its %zu-byte header",
                       name, src_len, H);
    if (src[0] != P)
        return df_errf(e, -DF_ECORRUPT, "%s: %u planes, expected %zu for %zu-byte elements", name,
                       src[0], P, es);
    size_t off[4], len[4], ncoded = 0, pos = H;
    int mode[4];
    for (size_t k = 0; k < P; k++) {
        mode[k] = src[1 + 5 * k];
        len[k] = df_le32(src + 2 + 5 * k);
        if (mode[k] != PLANE_RAW && mode[k] != coder)
            return df_errf(e, -DF_ECORRUPT, "%s: plane %zu has mode %d", name, k, mode[k]);
        if (mode[k] == PLANE_RAW ? len[k] != n : len[k] == 0)
            return df_errf(e, -DF_ECORRUPT, "%s: plane %zu: size %zu does not fit %zu elements",
                           name, k, len[k], n);
        if (len[k] > src_len - pos)
            return df_errf(e, -DF_ECORRUPT, "%s: plane %zu (%zu bytes at %zu) overruns the %zu-byte payload",
                           name, k, len[k], pos, src_len);
        off[k] = pos;
        pos += len[k];
        ncoded += mode[k] != PLANE_RAW;
    }
    if (pos != src_len)
        return df_errf(e, -DF_ECORRUPT, "%s: planes end at %zu, payload has %zu bytes", name, pos,
                       src_len);
    /* Raw planes are read straight from src; coded ones go to scratch. */
    uint8_t *buf = NULL;
    if (ncoded && !(buf = scratch(c, ncoded * n, e)))
        return -ENOMEM;
    const uint8_t *planes[4];
    for (size_t k = 0, j = 0; k < P; k++) {
        if (mode[k] == PLANE_RAW) {
            planes[k] = src + off[k];
            continue;
        }
        uint8_t *out = buf + (j++) * n;
        int rc = decode_plane(c, id, (int)k, mode[k], src + off[k], len[k], out, n, e);
        if (rc < 0)
            return rc;
        planes[k] = out;
    }
    df_codec_merge_planes(planes, n, es, dst);
    return 0;
}

/* ---- fp8 e4m3 (4) -------------------------------------------------------- */

#define FP8_HDR 5

/* The fp8 encoder's per-row f32 buffer (bits), separate from scratch. */
static uint32_t *row_buf(df_codec_ctx *c, size_t n, df_err *e)
{
    if (n > c->row_cap) {
        free(c->row);
        c->row_cap = 0;
        if (!(c->row = malloc(n * sizeof *c->row))) {
            df_errf(e, -ENOMEM, "codec: cannot allocate a %zu-element row buffer", n);
            return NULL;
        }
        c->row_cap = n;
    }
    return c->row;
}

/* A row as f32 bit patterns (exact for all three dtypes). */
static void row_to_f32_bits(const uint8_t *row, size_t n, df_dtype t, uint32_t *out)
{
    if (t == DF_DTYPE_F32) {
        memcpy(out, row, n * 4);
    } else if (t == DF_DTYPE_BF16) {
        for (size_t i = 0; i < n; i++)
            out[i] = (uint32_t)df_le16(row + 2 * i) << 16;
    } else {
        for (size_t i = 0; i < n; i++) {
            float f = df_f16_to_f32(df_le16(row + 2 * i));
            memcpy(&out[i], &f, 4);
        }
    }
}

/* Quantizes one row: code = sign | RNE_e4m3(min(|x|/scale, 448)); NaN and
 * +-Inf give the e4m3 NaN of their sign (common/e4m3.h's rule). x/scale in
 * double is exact enough for one correct rounding to e4m3 (e4m3.h). */
static void quant_scalar(const uint32_t *xb, size_t n, double ds, uint8_t *out)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t a = xb[i] & 0x7fffffffu;
        float af;
        memcpy(&af, &a, 4);
        uint32_t code = df_e4m3_mag((double)af / ds);
        code = a >= 0x7f800000u ? 0x7f : code;
        out[i] = (uint8_t)(((xb[i] >> 24) & 0x80) | code);
    }
}

#ifdef DF_CODEC_X86
/* quant_scalar, 8 elements at a time (same arithmetic, same bits) */
__attribute__((target("avx2"))) static __m256i quant4_avx2(__m256d q)
{
    const __m256d c448 = _mm256_set1_pd(448.0), c512 = _mm256_set1_pd(512.0);
    const __m256d c52 = _mm256_set1_pd(0x1p52), cmin = _mm256_set1_pd(0x1p-6);
    q = _mm256_min_pd(q, c448); /* NaN gives 448 (second operand) */
    __m256i u = _mm256_castpd_si256(q);
    __m256i rnd = _mm256_add_epi64(_mm256_set1_epi64x(((int64_t)1 << 48) - 1),
                                   _mm256_and_si256(_mm256_srli_epi64(u, 49), _mm256_set1_epi64x(1)));
    __m256i cn = _mm256_sub_epi64(_mm256_srli_epi64(_mm256_add_epi64(u, rnd), 49),
                                  _mm256_set1_epi64x((1023 - 7) << 3));
    __m256i cs = _mm256_and_si256(_mm256_castpd_si256(_mm256_add_pd(_mm256_mul_pd(q, c512), c52)),
                                  _mm256_set1_epi64x(0xff));
    __m256i sub = _mm256_castpd_si256(_mm256_cmp_pd(q, cmin, _CMP_LT_OQ));
    return _mm256_blendv_epi8(cn, cs, sub);
}

__attribute__((target("avx2"))) static void quant_avx2(const uint32_t *xb, size_t n, double ds,
                                                       uint8_t *out)
{
    const __m256d vds = _mm256_set1_pd(ds);
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    const __m256i gather = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(xb + i));
        __m256i a = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
        __m256i nonfinite = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f7fffff));
        __m256 af = _mm256_castsi256_ps(a);
        __m256d q0 = _mm256_div_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(af)), vds);
        __m256d q1 = _mm256_div_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(af, 1)), vds);
        /* 2 x 4 64-bit codes -> 8 32-bit codes */
        __m256i c0 = _mm256_permutevar8x32_epi32(quant4_avx2(q0), even);
        __m256i c1 = _mm256_permutevar8x32_epi32(quant4_avx2(q1), even);
        __m256i code = _mm256_permute2x128_si256(c0, c1, 0x20);
        code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), nonfinite);
        code = _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(x, 24), _mm256_set1_epi32(0x80)));
        /* 8 32-bit codes (< 256) -> 8 bytes */
        __m256i w = _mm256_packus_epi32(code, code); /* per lane: c0..3 c0..3 | c4..7 c4..7 */
        __m256i b = _mm256_packus_epi16(w, w);       /* per lane: dword 0 = 4 codes */
        b = _mm256_permutevar8x32_epi32(b, gather);
        _mm_storel_epi64((__m128i *)(out + i), _mm256_castsi256_si128(b));
    }
    quant_scalar(xb + i, n - i, ds, out + i);
}
#endif

static void quant_row(const uint32_t *xb, size_t n, float scale, uint8_t *out)
{
    if (scale == 0) {
        /* all finite values are +-0 */
        for (size_t i = 0; i < n; i++) {
            uint32_t a = xb[i] & 0x7fffffffu;
            out[i] = (uint8_t)(((xb[i] >> 24) & 0x80) | (a >= 0x7f800000u ? 0x7f : 0));
        }
        return;
    }
#ifdef DF_CODEC_X86
    if (df_codec_impl() == 3) {
        quant_avx2(xb, n, scale, out);
        return;
    }
#endif
    quant_scalar(xb, n, scale, out);
}

static long long encode_fp8(df_codec_ctx *c, const df_codec_params *p, const uint8_t *src,
                            size_t raw_len, size_t rb, uint8_t *dst, df_err *e)
{
    const size_t rows = raw_len / rb, re = p->row_elems, n = rows * re;
    const size_t limit = raw_len - 1, base = FP8_HDR + 4 * rows;
    if (base >= limit || n > UINT32_MAX)
        return 0;
    uint8_t *codes = scratch(c, n, e);
    uint32_t *xb = row_buf(c, re, e);
    if (!codes || !xb)
        return -ENOMEM;
    for (size_t r = 0; r < rows; r++) {
        row_to_f32_bits(src + r * rb, re, p->dtype, xb);
        /* absmax over finite values, as integers: for non-negative floats
         * the bit patterns order like the values (and this vectorizes) */
        uint32_t mb = 0;
        for (size_t i = 0; i < re; i++) {
            uint32_t a = xb[i] & 0x7fffffffu;
            a = a < 0x7f800000u ? a : 0;
            mb = a > mb ? a : mb;
        }
        float amax, scale;
        memcpy(&amax, &mb, 4);
        scale = amax / 448.0f;
        uint32_t sbits;
        memcpy(&sbits, &scale, 4);
        df_put32(dst + FP8_HDR + 4 * r, sbits);
        quant_row(xb, re, scale, codes + r * re);
    }
    size_t room = limit - base;
    long long sz = code_plane(c, PLANE_ZSTD, p->level, codes, n, dst + base, n - 1 < room ? n - 1 : room, e);
    if (sz < 0)
        return sz;
    if (sz > 0) {
        dst[0] = PLANE_ZSTD;
        df_put32(dst + 1, (uint32_t)sz);
        return (long long)(base + (size_t)sz);
    }
    if (n > room)
        return 0;
    dst[0] = PLANE_RAW;
    df_put32(dst + 1, (uint32_t)n);
    memcpy(dst + base, codes, n);
    return (long long)(base + n);
}

static void dequant_scalar(const uint8_t *in, size_t n, float scale, df_dtype t, uint8_t *out)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t b = df_e4m3_dequant_bits(in[i], scale);
        if (t == DF_DTYPE_F32) {
            memcpy(out + 4 * i, &b, 4);
        } else {
            float f;
            memcpy(&f, &b, 4);
            uint16_t h = t == DF_DTYPE_BF16 ? df_bits_to_bf16(b) : df_f32_to_f16(f);
            memcpy(out + 2 * i, &h, 2);
        }
    }
}

#ifdef DF_CODEC_X86
__attribute__((target("avx2"))) static void dequant_avx2(const uint8_t *in, size_t n, float scale,
                                                         df_dtype t, uint8_t *out)
{
    const __m256 vs = _mm256_set1_ps(scale);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m128i c16 = _mm_loadu_si128((const __m128i *)(in + i));
        __m256i b0 = df_e4m3_dequant8_avx2(_mm256_cvtepu8_epi32(c16), vs);
        __m256i b1 = df_e4m3_dequant8_avx2(_mm256_cvtepu8_epi32(_mm_srli_si128(c16, 8)), vs);
        if (t == DF_DTYPE_F32) {
            _mm256_storeu_si256((__m256i *)(out + 4 * i), b0);
            _mm256_storeu_si256((__m256i *)(out + 4 * i + 32), b1);
            continue;
        }
        _mm256_storeu_si256((__m256i *)(out + 2 * i), df_bf16_pack16_avx2(b0, b1));
    }
    dequant_scalar(in + i, n - i, scale, t, out + (t == DF_DTYPE_F32 ? 4 : 2) * i);
}
#endif

static void dequant_row(const uint8_t *in, size_t n, float scale, df_dtype t, uint8_t *out)
{
#ifdef DF_CODEC_X86
    if (t != DF_DTYPE_F16 && df_codec_impl() == 3) {
        dequant_avx2(in, n, scale, t, out);
        return;
    }
#endif
    dequant_scalar(in, n, scale, t, out);
}

static int decode_fp8(df_codec_ctx *c, const df_codec_params *p, const uint8_t *src,
                      size_t src_len, uint8_t *dst, size_t raw_len, size_t rb, df_err *e)
{
    const char *name = df_codec_name(DF_CODEC_FP8_E4M3);
    const size_t rows = raw_len / rb, re = p->row_elems, n = rows * re;
    if (src_len < FP8_HDR || (src_len - FP8_HDR) / 4 < rows)
        return df_errf(e, -DF_ECORRUPT, "%s: payload of %zu bytes cannot hold %zu row scales",
                       name, src_len, rows);
    const size_t base = FP8_HDR + 4 * rows;
    int mode = src[0];
    size_t len = df_le32(src + 1);
    if (mode != PLANE_RAW && mode != PLANE_ZSTD)
        return df_errf(e, -DF_ECORRUPT, "%s: code plane has mode %d", name, mode);
    if (mode == PLANE_RAW ? len != n : len == 0)
        return df_errf(e, -DF_ECORRUPT, "%s: code plane size %zu does not fit %zu elements", name,
                       len, n);
    if (len != src_len - base)
        return df_errf(e, -DF_ECORRUPT, "%s: code plane of %zu bytes at %zu, payload has %zu",
                       name, len, base, src_len);
    const uint8_t *codes = src + base;
    if (mode == PLANE_ZSTD) {
        uint8_t *buf = scratch(c, n, e);
        if (!buf)
            return -ENOMEM;
        int rc = decode_plane(c, DF_CODEC_FP8_E4M3, 0, mode, codes, len, buf, n, e);
        if (rc < 0)
            return rc;
        codes = buf;
    }
    for (size_t r = 0; r < rows; r++) {
        uint32_t sb = df_le32(src + FP8_HDR + 4 * r);
        if (sb >= 0x7f800000u) /* negative, -0, Inf or NaN: never written */
            return df_errf(e, -DF_ECORRUPT, "%s: row %zu has scale bits 0x%08x", name, r, sb);
        float scale;
        memcpy(&scale, &sb, 4);
        dequant_row(codes + r * re, re, scale, p->dtype, dst + r * rb);
    }
    return 0;
}

/* ---- entry points -------------------------------------------------------- */

int df_codec_encode(df_codec_ctx *c, int id, const df_codec_params *p, const void *src,
                    size_t raw_len, void *dst, size_t cap, size_t *out_len, df_err *e)
{
    size_t es = 1, rb = 1;
    int rc = check_params(id, p, raw_len, "encode", &es, &rb, e);
    if (rc < 0)
        return rc;
    if (!c || !out_len || (raw_len && (!src || !dst)))
        return df_errf(e, -EINVAL, "encode %s: NULL argument", df_codec_name(id));
    if (cap < raw_len)
        return df_errf(e, -EINVAL, "encode %s: capacity %zu < bound %zu", df_codec_name(id), cap,
                       raw_len);
    long long sz = 0;
    if (raw_len > 0) {
        switch (id) {
        case DF_CODEC_LZ4:
            if (raw_len <= LZ4_MAX_INPUT_SIZE)
                sz = code_plane(c, PLANE_LZ4, p->level, src, raw_len, dst, raw_len - 1, e);
            break;
        case DF_CODEC_SPLIT_LZ4:
        case DF_CODEC_SPLIT_ZSTD:
            sz = encode_split(c, id, p, src, raw_len, es, dst, e);
            break;
        case DF_CODEC_FP8_E4M3:
            sz = encode_fp8(c, p, src, raw_len, rb, dst, e);
            break;
        case DF_CODEC_FP8_B32:
        case DF_CODEC_INT4_B32:
        case DF_CODEC_INT5_B32:
        case DF_CODEC_INT6_B32:
        case DF_CODEC_INT3_B32:
        case DF_CODEC_INT2_B32:
            sz = df_codec_block_encode(c, id, p, src, raw_len, rb, dst, e);
            break;
        default:
            break;
        }
    }
    if (sz < 0)
        return (int)sz;
    if (sz > 0 && (size_t)sz < raw_len) {
        *out_len = (size_t)sz;
        return id;
    }
    if (raw_len)
        memcpy(dst, src, raw_len);
    *out_len = raw_len;
    return DF_CODEC_STORED;
}

int df_codec_decode(df_codec_ctx *c, int id, const df_codec_params *p, const void *src,
                    size_t src_len, void *dst, size_t raw_len, df_err *e)
{
    size_t es = 1, rb = 1;
    int rc = check_params(id, p, raw_len, "decode", &es, &rb, e);
    if (rc < 0)
        return rc;
    if (!c || (src_len && !src) || (raw_len && !dst))
        return df_errf(e, -EINVAL, "decode %s: NULL argument", df_codec_name(id));
    uint8_t dummy[8];
    if (!raw_len)
        dst = dummy; /* decoders never get a NULL output, even for 0 bytes */
    if (!src_len)
        src = dummy;
    switch (id) {
    case DF_CODEC_STORED:
        if (src_len != raw_len)
            return df_errf(e, -DF_ECORRUPT, "stored: payload of %zu bytes, expected %zu", src_len,
                           raw_len);
        if (raw_len)
            memcpy(dst, src, raw_len);
        return 0;
    case DF_CODEC_LZ4:
        if (raw_len == 0 && src_len == 0)
            return 0;
        return decode_plane(c, id, 0, PLANE_LZ4, src, src_len, dst, raw_len, e);
    case DF_CODEC_SPLIT_LZ4:
    case DF_CODEC_SPLIT_ZSTD:
        return decode_split(c, id, src, src_len, dst, raw_len, es, e);
    case DF_CODEC_FP8_E4M3:
        return decode_fp8(c, p, src, src_len, dst, raw_len, rb, e);
    default:
        return df_codec_block_decode(c, id, p, src, src_len, dst, raw_len, rb, e);
    }
}

/* ---- for codec_block.c (codec_internal.h) -------------------------------- */

uint8_t *df_codec_scratch(df_codec_ctx *c, size_t n, df_err *e)
{
    return scratch(c, n, e);
}

uint32_t *df_codec_row_buf(df_codec_ctx *c, size_t n, df_err *e)
{
    return row_buf(c, n, e);
}


int df_codec_plane_looks_compressible(const uint8_t *p, size_t n)
{
    return plane_looks_compressible(p, n);
}

long long df_codec_code_plane(df_codec_ctx *c, int mode, int level, const uint8_t *src, size_t n,
                              uint8_t *dst, size_t cap, df_err *e)
{
    return code_plane(c, mode, level, src, n, dst, cap, e);
}

int df_codec_decode_plane(df_codec_ctx *c, int id, int k, int mode, const uint8_t *src, size_t len,
                          uint8_t *dst, size_t n, df_err *e)
{
    return decode_plane(c, id, k, mode, src, len, dst, n, e);
}

void df_codec_row_to_f32_bits(const uint8_t *row, size_t n, df_dtype t, uint32_t *out)
{
    row_to_f32_bits(row, n, t, out);
}

void df_codec_quant_e4m3(const uint32_t *xb, size_t n, float scale, uint8_t *out)
{
    quant_row(xb, n, scale, out);
}
