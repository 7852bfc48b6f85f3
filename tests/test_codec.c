/* test_codec - the hidden-state block codecs (formats/codec.h).
 *
 * Round trips of every codec x dtype on random, structured (cache/synth.h),
 * constant, special-valued and oddly sized data; "never grows"; the error
 * bound of every lossy codec, element by element (per row for fp8-e4m3, per
 * 32-element block for the block-scaled codecs, on states with massive
 * activations too); and corrupt payloads (truncated, bit-flipped, lying
 * headers, garbage) giving -DF_ECORRUPT, never a crash (run it under ASan too).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <zstd.h>

#include "codec.h"
#include "e4m3.h"
#include "le.h"
#include "test.h"

#include "synth.h"

static const df_dtype dtypes[] = {DF_DTYPE_BF16, DF_DTYPE_F16, DF_DTYPE_F32};
static uint64_t rng = 12345; /* test_rand state */

/* ---- value helpers (independent of the codec's own) ---- */

static double f16_val(uint16_t h)
{
    int ex = (h >> 10) & 31, m = h & 0x3ff;
    double v = ex == 0 ? ldexp(m, -24) : ex == 31 ? (m ? NAN : INFINITY) : ldexp(m | 0x400, ex - 25);
    return (h & 0x8000) ? -v : v;
}

static double elem(const uint8_t *p, df_dtype t)
{
    if (t == DF_DTYPE_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p, 2);
    return t == DF_DTYPE_BF16 ? df_bf16_to_f32(h) : f16_val(h);
}

/* f64 -> f16 bits, round to nearest even (for making test data only) */
static uint16_t f16_bits(double x)
{
    uint16_t s = signbit(x) ? 0x8000 : 0;
    double a = fabs(x);
    if (isnan(x))
        return s | 0x7e00;
    if (a >= 65520.0)
        return s | 0x7c00;
    int ex;
    frexp(a, &ex); /* a = f * 2^ex, f in [0.5, 1) */
    if (a < ldexp(1, -14))
        return s | (uint16_t)nearbyint(a * ldexp(1, 24));
    double m = nearbyint(ldexp(a, 11 - ex)); /* 11 significant bits */
    if (m >= 2048) {
        m /= 2;
        ex++;
    }
    if (ex - 1 + 15 >= 31)
        return s | 0x7c00;
    return s | (uint16_t)(((ex - 1 + 15) << 10) | ((int)m & 0x3ff));
}

static void put_elem(uint8_t *p, df_dtype t, double v)
{
    if (t == DF_DTYPE_F32) {
        float f = (float)v;
        memcpy(p, &f, 4);
    } else {
        uint16_t h = t == DF_DTYPE_BF16 ? df_f32_to_bf16((float)v) : f16_bits(v);
        memcpy(p, &h, 2);
    }
}

/* Half an ulp of |v| in a format with `mant` stored mantissa bits and
 * smallest normal exponent `emin` (below it: the subnormal spacing). */
static double half_ulp(double v, int mant, int emin)
{
    v = fabs(v);
    int e = v > 0 ? ilogb(v) : emin;
    if (e < emin)
        e = emin;
    return ldexp(1, e - mant - 1);
}

static double dtype_half_ulp(double v, df_dtype t)
{
    return t == DF_DTYPE_BF16 ? half_ulp(v, 7, -126)
         : t == DF_DTYPE_F16  ? half_ulp(v, 10, -14)
                              : half_ulp(v, 23, -126);
}

/* ---- round trips ---- */

typedef struct buf {
    uint8_t *enc, *dec;
    size_t cap;
} buf;

static void buf_need(buf *b, size_t n)
{
    if (n <= b->cap)
        return;
    free(b->enc);
    free(b->dec);
    b->cap = n;
    b->enc = malloc(n + 64);
    b->dec = malloc(n + 64);
}

/* fp8: every element within the documented bound of its original. */
static int check_fp8(const uint8_t *raw, const uint8_t *dec, size_t raw_len, df_dtype t,
                     uint32_t re, const char *what)
{
    size_t es = df_dtype_size(t), rb = (size_t)re * es, bad = 0;
    for (size_t r = 0; r < raw_len / rb; r++) {
        const uint8_t *a = raw + r * rb, *b = dec + r * rb;
        float amax = 0;
        for (size_t i = 0; i < re; i++) {
            double x = fabs(elem(a + i * es, t));
            if (isfinite(x) && x > amax)
                amax = (float)x;
        }
        float scale = amax / 448.0f;
        for (size_t i = 0; i < re; i++) {
            double x = elem(a + i * es, t), y = elem(b + i * es, t);
            if (!isfinite(x)) {
                if (!isnan(y) && bad++ < 5)
                    fprintf(stderr, "%s: row %zu elem %zu: %g decoded as %g, want NaN\n", what, r, i, x, y);
                continue;
            }
            if (scale == 0) {
                if (y != 0 && bad++ < 5)
                    fprintf(stderr, "%s: zero row %zu elem %zu decoded as %g\n", what, r, i, y);
                continue;
            }
            double q = fabs(x) / scale;
            double lim = scale * (q < 0x1p-6 ? 0x1p-10 : half_ulp(q > 448 ? 448 : q, 3, -6));
            if (q > 448)
                lim += (q - 448) * scale;
            lim += dtype_half_ulp(y, t) + fabs(y) * 0x1p-23 + 0x1p-149;
            if (!(fabs(x - y) <= lim) && bad++ < 5)
                fprintf(stderr, "%s: row %zu elem %zu: %.9g -> %.9g, error %.3g > bound %.3g (scale %g)\n",
                        what, r, i, x, y, fabs(x - y), lim, scale);
        }
    }
    return bad == 0;
}



/* ---- the block-scaled codecs (5-10): an independent model of their rules ---- */

static int block_bits(int id)
{
    static const int bits[DF_CODEC_COUNT] = {[DF_CODEC_INT4_B32] = 4, [DF_CODEC_INT5_B32] = 5,
                                             [DF_CODEC_INT6_B32] = 6, [DF_CODEC_INT3_B32] = 3,
                                             [DF_CODEC_INT2_B32] = 2};
    return id >= 0 && id < DF_CODEC_COUNT ? bits[id] : 0;
}

/* The integer codecs, widest first (the order of the checks below). */
static const int int_ids[] = {DF_CODEC_INT6_B32, DF_CODEC_INT5_B32, DF_CODEC_INT4_B32,
                              DF_CODEC_INT3_B32, DF_CODEC_INT2_B32};
#define N_INT (int)(sizeof int_ids / sizeof int_ids[0])

/* smallest bf16 >= v (v >= 0), as a double; the largest finite bf16 above it
 * (only int2 on F32 data gets there) */
static double bf16_ceil_val(double v)
{
    if (v == 0)
        return 0;
    if (v > 0x1.fep127)
        return 0x1.fep127;
    /* bf16 has 8 significant bits; below 2^-126 a fixed step of 2^-133 */
    int e = ilogb(v);
    double step = e < -126 ? 0x1p-133 : ldexp(1, e - 7);
    return ceil(v / step) * step;
}

static uint64_t elem_bits(const uint8_t *p, size_t es)
{
    return es == 4 ? df_le32(p) : df_le16(p);
}

/* The elements of a block of k (at x, finite or not) that an integer codec
 * escapes: the top nj finite |x| for the largest nj <= 4 (and < k) with
 * top[nj-1] > 2 top[nj] > 0, and every non-finite one. Sets esc[i] and
 * returns the absmax of the others (the one the scale comes from). */
static double int_escapes(const double *x, size_t k, int *esc)
{
    double top[6] = {0};
    for (size_t i = 0; i < k; i++) {
        double a = isfinite(x[i]) ? fabs(x[i]) : 0;
        int j = 5;
        while (j > 0 && a > top[j - 1]) {
            top[j] = top[j - 1];
            j--;
        }
        if (j < 5)
            top[j] = a;
    }
    int nj = 0;
    for (int j = 1; j <= 4 && (size_t)j < k; j++)
        if (top[j] > 0 && top[j - 1] > 2 * top[j])
            nj = j;
    for (size_t i = 0; i < k; i++)
        esc[i] = !isfinite(x[i]) || (nj && fabs(x[i]) >= top[nj - 1]);
    return top[nj];
}

/* Every element of a block codec's output within the documented bound:
 * fp8-b32: S = ceil_bf16(A/448) over the block's finite absmax A,
 *   |x - y| <= S * (half the e4m3 spacing at |x|/S) + half a dtype ulp at y,
 *   and so <= A/28 (1 + 2^-7) + half a dtype ulp; non-finite -> NaN of its sign.
 * int: escaped elements bit-exact; the others, with A' the absmax of the
 *   non-escaped ones and S = ceil_bf16(A'/qmax), |x - y| <= S/2 + half a
 *   dtype ulp at y, so <= A/(2 qmax) (1 + 2^-7) + half a dtype ulp.
 * (S <= A/Q (1 + 2^-7) needs a normal bf16 S; below, S <= A/Q + 2^-133.) */
static int check_block_codec(int id, const uint8_t *raw, const uint8_t *dec, size_t raw_len,
                             df_dtype t, uint32_t re, const char *what)
{
    const int bits = block_bits(id);
    const double qmax = bits ? (double)((1 << (bits - 1)) - 1) : 448.0;
    size_t es = df_dtype_size(t), rb = (size_t)re * es, bad = 0;
    double x[32];
    int esc[32];
    for (size_t r = 0; r < raw_len / rb; r++)
        for (size_t k0 = 0; k0 < re; k0 += 32) {
            size_t k = re - k0 < 32 ? re - k0 : 32;
            const uint8_t *a = raw + r * rb + k0 * es, *b = dec + r * rb + k0 * es;
            double amax = 0;
            for (size_t i = 0; i < k; i++) {
                x[i] = elem(a + i * es, t);
                if (isfinite(x[i]) && fabs(x[i]) > amax)
                    amax = fabs(x[i]);
                esc[i] = 0;
            }
            double amax_q = bits ? int_escapes(x, k, esc) : amax;
            double S = bf16_ceil_val(amax_q / qmax);
            for (size_t i = 0; i < k; i++) {
                double y = elem(b + i * es, t);
                if (esc[i]) {
                    if (elem_bits(a + i * es, es) != elem_bits(b + i * es, es) && bad++ < 5)
                        fprintf(stderr, "%s: %s row %zu elem %zu: escaped %g decoded as %g, not exact\n",
                                what, df_codec_name(id), r, k0 + i, x[i], y);
                    continue;
                }
                if (!isfinite(x[i])) { /* fp8-b32 only */
                    if ((!isnan(y) || signbit(y) != signbit(x[i])) && bad++ < 5)
                        fprintf(stderr, "%s: %s row %zu elem %zu: %g decoded as %g, want NaN of its sign\n",
                                what, df_codec_name(id), r, k0 + i, x[i], y);
                    continue;
                }
                double lim, lim_a, hu = dtype_half_ulp(y, t) + fabs(y) * 0x1p-23 + 0x1p-149;
                if (bits) {
                    lim = S / 2;
                    lim_a = (amax / qmax * (1 + 0x1p-7) + 0x1p-133) / 2;
                } else {
                    double q = S > 0 ? fabs(x[i]) / S : 0;
                    if (q > 448 && bad++ < 5)
                        fprintf(stderr, "%s: %s: |x|/scale = %g > 448\n", what, df_codec_name(id), q);
                    lim = S * (q < 0x1p-6 ? 0x1p-10 : half_ulp(q, 3, -6));
                    lim_a = 16 * (amax / 448 * (1 + 0x1p-7) + 0x1p-133);
                }
                double err = fabs(x[i] - y);
                if (!(err <= lim + hu && err <= lim_a + hu) && bad++ < 5)
                    fprintf(stderr,
                            "%s: %s %s row %zu elem %zu: %.9g -> %.9g, error %.3g > bound %.3g "
                            "(block absmax %g, scale %g)\n",
                            what, df_codec_name(id), df_dtype_name(t), r, k0 + i, x[i], y, err,
                            (lim < lim_a ? lim : lim_a) + hu, amax, S);
            }
        }
    return bad == 0;
}

/* Every element within the documented bound of its original. */
static int check_lossy(int id, const uint8_t *raw, const uint8_t *dec, size_t raw_len, df_dtype t,
                       uint32_t re, const char *what)
{
    if (id == DF_CODEC_FP8_E4M3)
        return check_fp8(raw, dec, raw_len, t, re, what);
    return check_block_codec(id, raw, dec, raw_len, t, re, what);
}

/* Encodes and decodes; returns the codec id used (or -1 on failure). */
static int roundtrip(df_codec_ctx *c, int id, df_dtype t, uint32_t re, const void *raw,
                     size_t raw_len, buf *b, const char *what)
{
    df_codec_params p = {t, re, 0};
    df_err e = {0};
    buf_need(b, raw_len);
    size_t bound = df_codec_bound(id, raw_len, &p), out = 12345;
    CHECK(bound >= raw_len);
    int used = df_codec_encode(c, id, &p, raw, raw_len, b->enc, bound, &out, &e);
    CHECK_OK(used, &e);
    if (used < 0)
        return -1;
    CHECK(used == id || used == DF_CODEC_STORED);
    CHECK(out <= raw_len);
    if (used != DF_CODEC_STORED)
        CHECK(out < raw_len);
    else
        CHECK(out == raw_len && (!raw_len || !memcmp(b->enc, raw, raw_len)));
    memset(b->dec, 0xA5, raw_len + 64);
    int rc = df_codec_decode(c, used, &p, b->enc, out, b->dec, raw_len, &e);
    CHECK_OK(rc, &e);
    for (int k = 0; k < 64; k++) /* nothing written past raw_len */
        CHECK(b->dec[raw_len + k] == 0xA5);
    if (df_codec_is_lossy(used)) {
        if (!check_lossy(used, raw, b->dec, raw_len, t, re, what)) {
            fprintf(stderr, "  (in %s, %s, %s)\n", what, df_codec_name(id), df_dtype_name(t));
            df_test_failures++;
        }
    } else if (raw_len && memcmp(raw, b->dec, raw_len)) {
        fprintf(stderr, "%s: %s %s not bit-exact\n", what, df_codec_name(id), df_dtype_name(t));
        df_test_failures++;
    }
    return used;
}

static void fill_random_bits(uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)test_rand(&rng);
}

/* Hidden-state-like values as dtype t: synth bf16, converted. */
static void fill_synth(uint8_t *p, size_t rows, uint32_t re, df_dtype t, uint64_t seed)
{
    uint16_t *bf = malloc(rows * re * 2 + 2);
    df_synth_bf16(bf, rows, re, seed, NULL);
    size_t es = df_dtype_size(t);
    for (size_t i = 0; i < rows * re; i++)
        put_elem(p + i * es, t, df_bf16_to_f32(bf[i]));
    free(bf);
}

static void test_names(void)
{
    for (int id = 0; id < DF_CODEC_COUNT; id++) {
        CHECK_EQ(df_codec_from_name(df_codec_name(id)), id);
        CHECK_EQ(df_codec_is_lossy(id), id >= DF_CODEC_FP8_E4M3);
    }
    CHECK(!strcmp(df_codec_name(3), "split-zstd"));
    CHECK(!strcmp(df_codec_name(5), "fp8-b32"));
    CHECK(!strcmp(df_codec_name(6), "int4-b32"));
    CHECK(!strcmp(df_codec_name(7), "int5-b32"));
    CHECK(!strcmp(df_codec_name(8), "int6-b32"));
    CHECK(!strcmp(df_codec_name(9), "int3-b32"));
    CHECK(!strcmp(df_codec_name(10), "int2-b32"));
    CHECK_EQ(DF_CODEC_COUNT, 11);
    CHECK(!strcmp(df_codec_name(11), "?"));
    CHECK_EQ(df_codec_from_name("int7-b32"), -EINVAL);
    CHECK_EQ(df_codec_from_name("int1-b32"), -EINVAL);
    CHECK(!strcmp(df_codec_name(99), "?"));
    CHECK(!strcmp(df_codec_name(-1), "?"));
    CHECK_EQ(df_codec_from_name("zip"), -EINVAL);
    CHECK_EQ(df_codec_from_name(NULL), -EINVAL);
}

static void test_planes(void)
{
    /* every implementation agrees with the scalar one, odd lengths included */
    static const size_t ns[] = {0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1000, 4099};
    for (size_t es = 1; es <= 4; es *= 2)
        for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++) {
            size_t n = ns[a];
            uint8_t *src = malloc(n * es + 1), *ref = malloc(n * es + 1), *pl = malloc(n * es + 1),
                    *out = malloc(n * es + 1);
            fill_random_bits(src, n * es);
            for (size_t i = 0; i < n; i++)
                for (size_t k = 0; k < es; k++)
                    ref[k * n + i] = src[i * es + (es - 1 - k)];
            for (int impl = 1; impl <= 3; impl++) {
                if (df_codec_set_plane_impl(impl) < 0)
                    continue;
                uint8_t *planes[4] = {pl, pl + n, pl + 2 * n, pl + 3 * n};
                memset(pl, 0, n * es + 1);
                df_codec_split_planes(src, n, es, planes);
                CHECK(!memcmp(pl, ref, n * es));
                const uint8_t *cp[4] = {pl, pl + n, pl + 2 * n, pl + 3 * n};
                memset(out, 0, n * es + 1);
                df_codec_merge_planes(cp, n, es, out);
                CHECK(!memcmp(out, src, n * es));
            }
            df_codec_set_plane_impl(0);
            free(src);
            free(ref);
            free(pl);
            free(out);
        }
    CHECK_EQ(df_codec_set_plane_impl(7), -EINVAL);
}

static void test_e4m3_values(void)
{
    CHECK(df_e4m3_to_f32(0x00) == 0.0f && !signbit(df_e4m3_to_f32(0x00)));
    CHECK(df_e4m3_to_f32(0x80) == 0.0f && signbit(df_e4m3_to_f32(0x80)));
    CHECK(df_e4m3_to_f32(0x01) == 0x1p-9f);
    CHECK(df_e4m3_to_f32(0x07) == 7 * 0x1p-9f);
    CHECK(df_e4m3_to_f32(0x08) == 0x1p-6f);
    CHECK(df_e4m3_to_f32(0x38) == 1.0f);
    CHECK(df_e4m3_to_f32(0x7e) == 448.0f);
    CHECK(df_e4m3_to_f32(0xfe) == -448.0f);
    CHECK(isnan(df_e4m3_to_f32(0x7f)) && isnan(df_e4m3_to_f32(0xff)));
    /* strictly increasing over the non-negative codes */
    for (int k = 1; k < 0x7f; k++)
        CHECK(df_e4m3_to_f32((uint8_t)k) > df_e4m3_to_f32((uint8_t)(k - 1)));
}

/* fp8 of exact e4m3 values (scale 1: the row holds 448) is exact; ties go
 * to the even code; subnormal ties too. */
static void test_fp8_rounding(df_codec_ctx *c, buf *b)
{
    enum { RE = 300 };
    static const struct { double in, out; } cases[] = {
        {1.0625, 1.0},      /* tie between 1.0 (m=0) and 1.125 (m=1): even */
        {1.1875, 1.25},     /* tie between 1.125 (m=1) and 1.25 (m=2) */
        {1.07, 1.125},      /* above the tie */
        {0x1p-10, 0.0},     /* subnormal tie between 0 and 2^-9: even (0) */
        {3 * 0x1p-10, 0x1p-8}, /* between 2^-9 (1) and 2^-8 (2): even */
        {15 * 0x1p-10, 0x1p-6}, /* 7.5 * 2^-9: rounds up into the normals */
        {-1.0625, -1.0},
        {440.0, 448.0},     /* between 416 and 448 (spacing 32), above the tie 432 */
        {432.0, 448.0},     /* the tie: 416 has m=5 (odd), 448 m=6 (even) */
        {-0.0, -0.0},
    };
    uint8_t raw[RE * 4];
    for (size_t t = 0; t < 3; t++) {
        df_dtype dt = dtypes[t];
        size_t es = df_dtype_size(dt);
        /* exact values: all 126 positive finite codes and their negatives */
        for (int i = 0; i < RE; i++) {
            int k = i % 254;
            uint8_t code = (uint8_t)(k < 127 ? k : 128 + (k - 127));
            double v = df_e4m3_to_f32(code);
            if (dt == DF_DTYPE_F16 && fabs(v) < 0x1p-14)
                v = 0; /* below f16's normals: keep the test about e4m3 */
            put_elem(raw + i * es, dt, i == 0 ? 448.0 : v);
        }
        df_codec_params p = {dt, RE, 0};
        df_err e = {0};
        size_t out;
        uint8_t enc[RE * 4], dec[RE * 4];
        uint8_t src4[RE * 4];
        memcpy(src4, raw, RE * es);
        int used = df_codec_encode(c, DF_CODEC_FP8_E4M3, &p, src4, RE * es, enc, sizeof enc, &out, &e);
        CHECK_EQ(used, DF_CODEC_FP8_E4M3);
        CHECK_OK(df_codec_decode(c, used, &p, enc, out, dec, RE * es, &e), &e);
        CHECK(!memcmp(dec, src4, RE * es));
        /* ties and rounding */
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
            if (dt == DF_DTYPE_F16 && fabs(cases[k].in) < 0x1p-14 && cases[k].in != 0)
                continue;
            for (int i = 0; i < RE; i++)
                put_elem(src4 + i * es, dt, i == 0 ? 448.0 : cases[k].in);
            used = df_codec_encode(c, DF_CODEC_FP8_E4M3, &p, src4, RE * es, enc, sizeof enc, &out, &e);
            CHECK_EQ(used, DF_CODEC_FP8_E4M3);
            CHECK_OK(df_codec_decode(c, used, &p, enc, out, dec, RE * es, &e), &e);
            double y = elem(dec + es, dt);
            if (y != cases[k].out || signbit(y) != signbit(cases[k].out)) {
                fprintf(stderr, "fp8 %s: %.9g decoded as %.9g, want %.9g\n", df_dtype_name(dt),
                        cases[k].in, y, cases[k].out);
                df_test_failures++;
            }
        }
    }
    (void)b;
}

static void test_roundtrips(df_codec_ctx *c, buf *b)
{
    for (size_t t = 0; t < 3; t++) {
        df_dtype dt = dtypes[t];
        size_t es = df_dtype_size(dt);
        for (int id = 0; id < DF_CODEC_COUNT; id++) {
            /* structured: must actually compress with the split/fp8 codecs */
            uint32_t re = 1024;
            size_t rows = 96, n = rows * re * es;
            uint8_t *raw = malloc(n);
            fill_synth(raw, rows, re, dt, 7 + t);
            int used = roundtrip(c, id, dt, re, raw, n, b, "synth");
            /* (the f16 high byte holds 2 mantissa bits: too random for LZ4) */
            int lz4_f16 = id == DF_CODEC_SPLIT_LZ4 && dt == DF_DTYPE_F16;
            if (id >= DF_CODEC_SPLIT_LZ4 && !lz4_f16)
                CHECK_EQ(used, id);
            if (id == DF_CODEC_SPLIT_ZSTD && dt == DF_DTYPE_BF16) {
                /* synthetic hidden states land near real ones (0.66-0.68) */
                df_codec_params p = {dt, re, 0};
                size_t out;
                df_err e;
                df_codec_encode(c, id, &p, raw, n, b->enc, n, &out, &e);
                CHECK((double)out / (double)n < 0.72);
            }
            if (id == DF_CODEC_SPLIT_ZSTD && dt == DF_DTYPE_F32) {
                /* f32 upcast from bf16: the zero low planes shrink too */
                df_codec_params p = {dt, re, 0};
                size_t out;
                df_err e;
                df_codec_encode(c, id, &p, raw, n, b->enc, n, &out, &e);
                CHECK((double)out / (double)n < 0.4);
            }

            /* random bit patterns (NaNs and Infs included) */
            fill_random_bits(raw, n);
            used = roundtrip(c, id, dt, re, raw, n, b, "random bits");
            if (!df_codec_is_lossy(id))
                CHECK_EQ(used, DF_CODEC_STORED); /* never grows */

            /* random finite gaussians */
            for (size_t i = 0; i < rows * re; i++)
                put_elem(raw + i * es, dt, 3.0 * test_randn(&rng));
            roundtrip(c, id, dt, re, raw, n, b, "gaussian");

            /* constant rows (each row its own value), one all-zero row */
            for (size_t r = 0; r < rows; r++)
                for (size_t i = 0; i < re; i++)
                    put_elem(raw + (r * re + i) * es, dt, r == 5 ? 0.0 : (double)r * 0.37 - 9.1);
            used = roundtrip(c, id, dt, re, raw, n, b, "constant rows");
            if (id != DF_CODEC_STORED)
                CHECK_EQ(used, id);
            free(raw);

            /* odd sizes: one element; one row; a row not a multiple of 16;
             * a row longer than the fp8 table threshold but odd */
            static const uint32_t res[] = {1, 3, 17, 37, 129, 1001};
            static const size_t rws[] = {1, 1, 3, 5, 2, 7};
            for (size_t k = 0; k < sizeof res / sizeof res[0]; k++) {
                size_t m = rws[k] * res[k] * es;
                uint8_t *x = malloc(m);
                fill_synth(x, rws[k], res[k], dt, 100 + k);
                roundtrip(c, id, dt, res[k], x, m, b, "odd size");
                free(x);
            }
            /* empty block */
            CHECK_EQ(roundtrip(c, id, dt, 8, "", 0, b, "empty"), DF_CODEC_STORED);
        }
    }
}

static void test_special_values(df_codec_ctx *c, buf *b)
{
    /* NaN (several payloads, both signs), Inf, -0, subnormals, among
     * ordinary values so that the codecs do compress */
    for (size_t t = 0; t < 3; t++) {
        df_dtype dt = dtypes[t];
        size_t es = df_dtype_size(dt);
        uint32_t re = 512;
        size_t rows = 64, n = rows * re * es;
        uint8_t *raw = malloc(n);
        fill_synth(raw, rows, re, dt, 55);
        for (size_t i = 0; i < rows * re; i += 7) {
            uint8_t *p = raw + i * es;
            switch ((i / 7) % 8) {
            case 0: /* NaN with payload */
                if (es == 4)
                    df_put32(p, 0x7fc00001u + (uint32_t)i);
                else
                    df_put16(p, dt == DF_DTYPE_BF16 ? 0x7fc1 : 0x7e01);
                break;
            case 1: /* -NaN, signalling pattern */
                if (es == 4)
                    df_put32(p, 0xff800001u);
                else
                    df_put16(p, dt == DF_DTYPE_BF16 ? 0xff81 : 0xfc01);
                break;
            case 2: put_elem(p, dt, INFINITY); break;
            case 3: put_elem(p, dt, -INFINITY); break;
            case 4: put_elem(p, dt, -0.0); break;
            case 5: /* smallest subnormal */
                if (es == 4)
                    df_put32(p, 1);
                else
                    df_put16(p, 1);
                break;
            case 6: /* largest subnormal, negative */
                if (es == 4)
                    df_put32(p, 0x807fffffu);
                else
                    df_put16(p, dt == DF_DTYPE_BF16 ? 0x807f : 0x83ff);
                break;
            default: break;
            }
        }
        for (int id = 0; id < DF_CODEC_COUNT; id++) {
            int used = roundtrip(c, id, dt, re, raw, n, b, "special values");
            if (id >= DF_CODEC_SPLIT_LZ4 && !(id == DF_CODEC_SPLIT_LZ4 && dt == DF_DTYPE_F16))
                CHECK_EQ(used, id);
        }
        /* fp8: a row of only NaN/Inf has scale 0 and stays non-finite;
         * a row of only subnormals still decodes within the bound */
        for (size_t i = 0; i < re; i++) {
            put_elem(raw + i * es, dt, i % 2 ? INFINITY : NAN);
            if (es == 4)
                df_put32(raw + (re + i) * es, (uint32_t)(1 + i * 1013));
            else
                df_put16(raw + (re + i) * es, (uint16_t)(1 + i % 0x3ff));
        }
        for (int id = DF_CODEC_FP8_E4M3; id < DF_CODEC_COUNT; id++)
            roundtrip(c, id, dt, re, raw, 2 * re * es, b, "lossy: non-finite/subnormal rows");
        free(raw);
    }
}

static void test_large(df_codec_ctx *c, buf *b)
{
    /* a large block (8 MiB f32, 6 MiB bf16): scratch growth, many zstd blocks */
    for (size_t t = 0; t < 3; t += 2) {
        df_dtype dt = dtypes[t];
        size_t es = df_dtype_size(dt);
        uint32_t re = 2048;
        size_t rows = dt == DF_DTYPE_F32 ? 1024 : 1536, n = rows * re * es;
        uint8_t *raw = malloc(n);
        fill_synth(raw, rows, re, dt, 77);
        for (int id = 1; id < DF_CODEC_COUNT; id++)
            roundtrip(c, id, dt, re, raw, n, b, "large");
        free(raw);
    }
}

static void test_bad_params(df_codec_ctx *c)
{
    uint8_t raw[64] = {1, 2, 3}, out[64];
    size_t len;
    df_err e = {0};
    df_codec_params p = {DF_DTYPE_BF16, 8, 0}; /* 16-byte rows */
    for (int id = 0; id < DF_CODEC_COUNT; id++) {
        CHECK_ERR(df_codec_encode(c, id, &p, raw, 30, out, 64, &len, &e), -EINVAL, &e, "rows");
        CHECK_ERR(df_codec_decode(c, id, &p, raw, 30, out, 30, &e), -EINVAL, &e, "rows");
        CHECK_ERR(df_codec_encode(c, id, &p, raw, 32, out, 31, &len, &e), -EINVAL, &e, "capacity");
    }
    CHECK_ERR(df_codec_encode(c, DF_CODEC_COUNT, &p, raw, 32, out, 64, &len, &e), -EINVAL, &e,
              "unknown codec");
    CHECK_ERR(df_codec_decode(c, DF_CODEC_COUNT, &p, raw, 32, out, 32, &e), -EINVAL, &e,
              "unknown codec");
    CHECK_ERR(df_codec_decode(c, -1, &p, raw, 32, out, 32, &e), -EINVAL, &e, "unknown codec");
    df_codec_params q = {DF_DTYPE_I32, 8, 0};
    CHECK_ERR(df_codec_encode(c, 3, &q, raw, 32, out, 64, &len, &e), -EINVAL, &e, "dtype");
    q = (df_codec_params){DF_DTYPE_BF16, 0, 0};
    CHECK_ERR(df_codec_decode(c, 3, &q, raw, 32, out, 32, &e), -EINVAL, &e, "row_elems");
    CHECK_ERR(df_codec_encode(c, 3, NULL, raw, 32, out, 64, &len, &e), -EINVAL, &e, "params");
}

/* Decoding must give 0 or -DF_ECORRUPT; returns the code. */
static int try_decode(df_codec_ctx *c, int id, const df_codec_params *p, const uint8_t *src,
                      size_t len, uint8_t *dst, size_t raw_len)
{
    df_err e = {0};
    /* copy to an exact-size heap buffer so ASan sees any over-read */
    uint8_t *s = malloc(len ? len : 1);
    if (len)
        memcpy(s, src, len);
    int rc = df_codec_decode(c, id, p, s, len, dst, raw_len, &e);
    free(s);
    if (rc != 0 && rc != -DF_ECORRUPT) {
        fprintf(stderr, "decode %s of corrupt data: rc %d (%s)\n", df_codec_name(id), rc, e.msg);
        df_test_failures++;
    }
    if (rc == -DF_ECORRUPT && !e.msg[0]) {
        fprintf(stderr, "decode %s: -DF_ECORRUPT without a message\n", df_codec_name(id));
        df_test_failures++;
    }
    return rc;
}

static void test_corrupt(df_codec_ctx *c)
{
    for (size_t t = 0; t < 3; t++) {
        df_dtype dt = dtypes[t];
        size_t es = df_dtype_size(dt);
        uint32_t re = 256;
        size_t rows = 24, n = rows * re * es;
        uint8_t *raw = malloc(n), *enc = malloc(n), *mut = malloc(n + 16), *dst = malloc(n + re * es);
        fill_synth(raw, rows, re, dt, 9);
        /* the second half repeats the first, so that plain lz4 compresses too */
        memcpy(raw + n / 2, raw, n / 2);
        df_codec_params p = {dt, re, 0};
        for (int id = 0; id < DF_CODEC_COUNT; id++) {
            df_err e = {0};
            size_t len;
            int used = df_codec_encode(c, id, &p, raw, n, enc, n, &len, &e);
            CHECK_EQ(used, id);
            /* every truncation fails (stored included: length must match) */
            size_t step = len > 4000 && id < DF_CODEC_FP8_B32 ? 7 : 1;
            for (size_t k = 0; k < len; k += step)
                CHECK_EQ(try_decode(c, used, &p, enc, k, dst, n), -DF_ECORRUPT);
            /* one byte too many */
            memcpy(mut, enc, len);
            mut[len] = 0;
            CHECK_EQ(try_decode(c, used, &p, mut, len + 1, dst, n), -DF_ECORRUPT);
            /* the wrong raw length (a whole number of rows, but not this one) */
            CHECK_EQ(try_decode(c, used, &p, enc, len, dst, n - re * es), -DF_ECORRUPT);
            CHECK_EQ(try_decode(c, used, &p, enc, len, dst, n + re * es), -DF_ECORRUPT);
            if (id != DF_CODEC_STORED)
                CHECK_EQ(try_decode(c, used, &p, enc, len, dst, 0), -DF_ECORRUPT);
            /* every bit of the sub-header flipped: always detected */
            size_t hdr = id == DF_CODEC_SPLIT_LZ4 || id == DF_CODEC_SPLIT_ZSTD ? 1 + 5 * es
                       : id == DF_CODEC_FP8_E4M3 ? 5 + 4 * rows
                       : id == DF_CODEC_FP8_B32 ? 1 + 5 * 3
                       : block_bits(id) ? 5 + 5 * 4 : 0;
            for (size_t bit = 0; bit < hdr * 8; bit++) {
                memcpy(mut, enc, len);
                mut[bit / 8] ^= (uint8_t)(1u << (bit % 8));
                int rc = try_decode(c, used, &p, mut, len, dst, n);
                /* fp8 scales: a flipped mantissa bit is a valid (wrong) scale */
                if (id != DF_CODEC_FP8_E4M3 || bit < 40)
                    CHECK_EQ(rc, -DF_ECORRUPT);
            }
            /* random bit flips anywhere: 0 or -DF_ECORRUPT, never a crash */
            for (int k = 0; k < 300; k++) {
                memcpy(mut, enc, len);
                int flips = 1 + (int)(test_rand(&rng) % 4);
                for (int f = 0; f < flips; f++) {
                    size_t bit = test_rand(&rng) % (len * 8);
                    mut[bit / 8] ^= (uint8_t)(1u << (bit % 8));
                }
                try_decode(c, used, &p, mut, len, dst, n);
            }
            /* garbage payloads of assorted sizes */
            for (int k = 0; k < 100; k++) {
                size_t m = test_rand(&rng) % (len + 1);
                fill_random_bits(mut, m);
                if (m && (id == DF_CODEC_SPLIT_LZ4 || id == DF_CODEC_SPLIT_ZSTD))
                    mut[0] = (uint8_t)es; /* get past the first check */
                if (m && id >= DF_CODEC_FP8_B32)
                    mut[0] = (uint8_t)(block_bits(id) ? 4 : 3);
                try_decode(c, used, &p, mut, m, dst, n);
            }
            /* lying headers */
            if (id == DF_CODEC_SPLIT_LZ4 || id == DF_CODEC_SPLIT_ZSTD) {
                CHECK(enc[1] == (id == DF_CODEC_SPLIT_LZ4 ? 1 : 2)); /* plane 0 coded */
                uint32_t s0 = df_le32(enc + 2), s1 = df_le32(enc + 7);
                /* sizes that still add up, moved between planes */
                memcpy(mut, enc, len);
                df_put32(mut + 2, s0 + 1);
                df_put32(mut + 7, s1 - 1);
                CHECK_EQ(try_decode(c, used, &p, mut, len, dst, n), -DF_ECORRUPT);
                memcpy(mut, enc, len);
                df_put32(mut + 2, s0 - 1);
                df_put32(mut + 7, s1 + 1);
                CHECK_EQ(try_decode(c, used, &p, mut, len, dst, n), -DF_ECORRUPT);
                /* a huge size */
                memcpy(mut, enc, len);
                df_put32(mut + 2, 0xffffffffu);
                CHECK_EQ(try_decode(c, used, &p, mut, len, dst, n), -DF_ECORRUPT);
                /* the other codec's plane mode */
                memcpy(mut, enc, len);
                mut[1] = id == DF_CODEC_SPLIT_LZ4 ? 2 : 1;
                CHECK_EQ(try_decode(c, used, &p, mut, len, dst, n), -DF_ECORRUPT);
                /* a payload of the other split codec */
                CHECK_EQ(try_decode(c, id == DF_CODEC_SPLIT_LZ4 ? 3 : 2, &p, enc, len, dst, n),
                         -DF_ECORRUPT);
                /* claims raw for the coded plane */
                memcpy(mut, enc, len);
                mut[1] = 0;
                CHECK_EQ(try_decode(c, used, &p, mut, len, dst, n), -DF_ECORRUPT);
            }
            if (id == DF_CODEC_FP8_E4M3) {
                static const uint32_t bad[] = {0x7fc00000u, 0x7f800000u, 0xbf800000u, 0x80000000u};
                for (size_t k = 0; k < 4; k++) {
                    memcpy(mut, enc, len);
                    df_put32(mut + 5 + 4 * 3, bad[k]);
                    CHECK_EQ(try_decode(c, used, &p, mut, len, dst, n), -DF_ECORRUPT);
                }
                memcpy(mut, enc, len);
                mut[0] = 1; /* lz4 mode is not an fp8 mode */
                CHECK_EQ(try_decode(c, used, &p, mut, len, dst, n), -DF_ECORRUPT);
                /* decoded as another dtype: wrong raw length, detected */
                df_codec_params q = p;
                q.dtype = dt == DF_DTYPE_F32 ? DF_DTYPE_BF16 : DF_DTYPE_F32;
                df_err e2;
                int rc = df_codec_decode(c, used, &q, enc, len, dst, n, &e2);
                CHECK(rc == -DF_ECORRUPT);
            }
            /* and the original still decodes after all that */
            CHECK_OK(df_codec_decode(c, used, &p, enc, len, dst, n, &e), &e);
        }
        free(raw);
        free(enc);
        free(mut);
        free(dst);
    }
}


/* ---- block-scaled codecs: massive activations, special values, corruption ---- */

/* Hidden states with massive activations: ordinary channels N(0,1) times a
 * per-channel scale (log-normal) and a per-token gain; a few fixed channels
 * at +-gain x the row's ordinary RMS (two of them in one 32-element block),
 * ten times more on every fifth token. Sets is_out[c] for those channels. */
static void fill_outliers(uint8_t *p, size_t rows, uint32_t re, df_dtype t, double gain,
                          uint64_t seed, int *is_out)
{
    uint64_t r = seed;
    double *cs = malloc(re * sizeof *cs), *x = malloc(re * sizeof *x);
    const uint32_t oc[4] = {3 % re, (re / 2 + 5) % re, (re / 2 + 9) % re, (re - 30) % re};
    for (uint32_t c = 0; c < re; c++) {
        cs[c] = exp(0.3 * test_randn(&r));
        is_out[c] = 0;
    }
    for (int k = 0; k < 4; k++)
        is_out[oc[k]] = 1;
    size_t es = df_dtype_size(t);
    for (size_t row = 0; row < rows; row++) {
        double g = exp(0.2 * test_randn(&r)), ss = 0;
        for (uint32_t c = 0; c < re; c++) {
            x[c] = cs[c] * g * test_randn(&r);
            ss += x[c] * x[c];
        }
        double rms = sqrt(ss / re);
        for (int k = 0; k < 4; k++)
            x[oc[k]] = (k & 1 ? -1 : 1) * gain * rms * (row % 5 == 0 ? 10 : 1) * (1 + 0.1 * k);
        for (uint32_t c = 0; c < re; c++)
            put_elem(p + (row * re + c) * es, t, x[c]);
    }
    free(cs);
    free(x);
}

typedef struct ord_err {
    double rms;     /* RMS error / RMS over the ordinary channels */
    double max_rel; /* worst |x - y| / |x| over ordinary |x| >= 1% of the row's ordinary RMS,
                     * in the 32-element blocks without a massive channel */
} ord_err;

static ord_err ordinary_error(const uint8_t *raw, const uint8_t *dec, size_t rows, uint32_t re,
                              df_dtype t, const int *is_out)
{
    size_t es = df_dtype_size(t);
    double se = 0, sx = 0, mr = 0;
    for (size_t r = 0; r < rows; r++) {
        double ss = 0;
        size_t no = 0;
        for (uint32_t c = 0; c < re; c++)
            if (!is_out[c]) {
                double v = elem(raw + (r * re + c) * es, t);
                ss += v * v;
                no++;
            }
        double rms = sqrt(ss / (double)no);
        for (uint32_t c = 0; c < re; c++) {
            if (is_out[c])
                continue;
            double v = elem(raw + (r * re + c) * es, t), y = elem(dec + (r * re + c) * es, t);
            se += (v - y) * (v - y);
            sx += v * v;
            int quiet = 1; /* no massive channel in c's block */
            for (uint32_t k = c / 32 * 32; k < c / 32 * 32 + 32 && k < re; k++)
                quiet &= !is_out[k];
            if (quiet && fabs(v) >= 0.01 * rms && fabs(v - y) / fabs(v) > mr)
                mr = fabs(v - y) / fabs(v);
        }
    }
    return (ord_err){sqrt(se / sx), mr};
}

/* A per-row symmetric b-bit integer quantizer (absmax / qmax, no blocks, no
 * escapes): what one scale per row does to ordinary channels. */
static void per_row_int(const uint8_t *raw, uint8_t *out, size_t rows, uint32_t re, df_dtype t, int b)
{
    size_t es = df_dtype_size(t);
    double qmax = (1 << (b - 1)) - 1;
    for (size_t r = 0; r < rows; r++) {
        double a = 0;
        for (uint32_t c = 0; c < re; c++)
            a = fmax(a, fabs(elem(raw + (r * re + c) * es, t)));
        double s = a / qmax;
        for (uint32_t c = 0; c < re; c++) {
            double v = elem(raw + (r * re + c) * es, t);
            put_elem(out + (r * re + c) * es, t, s > 0 ? nearbyint(v / s) * s : 0);
        }
    }
}

/* The block codecs on states with massive activations at 100x and 1000x the
 * row RMS: every element within its block's bound (roundtrip checks it,
 * escapes bit-exact), and ordinary channels keep a small error where one
 * scale per row does not: fp8-b32 against fp8-e4m3 (per-element relative
 * error of ordinary values, at 1000x), the integer codecs against a
 * per-row integer quantizer of the same width. */
static void test_block_outliers(df_codec_ctx *c, buf *b)
{
    static const uint32_t res[] = {256, 5120};
    static const size_t rws[] = {13, 7};
    static const double gains[] = {100, 1000};
    for (size_t h = 0; h < 2; h++)
        for (size_t t = 0; t < 3; t++)
            for (size_t gi = 0; gi < 2; gi++) {
                df_dtype dt = dtypes[t];
                uint32_t re = res[h];
                size_t rows = rws[h], es = df_dtype_size(dt), n = rows * re * es;
                uint8_t *raw = malloc(n), *ref = malloc(n);
                int *is_out = malloc(re * sizeof *is_out);
                fill_outliers(raw, rows, re, dt, gains[gi], 1000 + 10 * h + t, is_out);
                ord_err oe[DF_CODEC_COUNT] = {{0, 0}};
                char what[96];
                snprintf(what, sizeof what, "outliers %gx, hidden %u", gains[gi], re);
                for (int id = DF_CODEC_FP8_E4M3; id < DF_CODEC_COUNT; id++) {
                    CHECK_EQ(roundtrip(c, id, dt, re, raw, n, b, what), id);
                    oe[id] = ordinary_error(raw, b->dec, rows, re, dt, is_out);
                }
                /* fp8-b32: ordinary values above 1% of the RMS keep e4m3's
                 * relative precision (2^-4, plus the dtype's rounding) */
                CHECK(oe[DF_CODEC_FP8_B32].max_rel <= 0x1p-4 + 0x1p-8);
                CHECK(oe[DF_CODEC_FP8_B32].rms < oe[DF_CODEC_FP8_E4M3].rms);
                if (gains[gi] >= 1000)
                    CHECK(oe[DF_CODEC_FP8_E4M3].max_rel > 3 * oe[DF_CODEC_FP8_B32].max_rel);
                /* integers: the per-row quantizer loses the ordinary channels
                 * (int3 keeps ~76% of them, int2, a sign-and-threshold code on
                 * the block's absmax, only ~34%) */
                double pr_rms[DF_CODEC_COUNT] = {0};
                for (int k = 0; k < N_INT; k++) {
                    int id = int_ids[k], bits = block_bits(id);
                    per_row_int(raw, ref, rows, re, dt, bits);
                    ord_err pr = ordinary_error(raw, ref, rows, re, dt, is_out);
                    pr_rms[id] = pr.rms;
                    static const double want_rms[7] = {0, 0, 0.70, 0.26, 0.13, 0.065, 0.032};
                    double want = want_rms[bits], gap = bits == 2 ? 1.4 : bits == 3 ? 3 : 5;
                    if (!(oe[id].rms < want && gap * oe[id].rms < pr.rms)) {
                        fprintf(stderr, "%s %s %s: ordinary RMS error %.4f (want < %.3f), per-row int %.4f\n",
                                what, df_codec_name(id), df_dtype_name(dt), oe[id].rms, want, pr.rms);
                        df_test_failures++;
                    }
                    /* narrower codes, more error */
                    if (k > 0 && !(oe[id].rms > oe[int_ids[k - 1]].rms)) {
                        fprintf(stderr, "%s %s %s: ordinary RMS error %.4f, not above %s's %.4f\n",
                                what, df_codec_name(id), df_dtype_name(dt), oe[id].rms,
                                df_codec_name(int_ids[k - 1]), oe[int_ids[k - 1]].rms);
                        df_test_failures++;
                    }
                }
                if (getenv("DF_TEST_VERBOSE")) /* for docs/FORMAT-codecs.md */
                    printf("%-27s %-4s fp8-e4m3 %.4f/%.4f fp8-b32 %.4f/%.4f int2/3/4/5/6-b32 %.4f %.4f"
                           " %.4f %.4f %.4f per-row int2/3/4/5/6 %.4f %.4f %.4f %.4f %.4f\n",
                           what, df_dtype_name(dt), oe[4].rms, oe[4].max_rel, oe[5].rms, oe[5].max_rel,
                           oe[10].rms, oe[9].rms, oe[6].rms, oe[7].rms, oe[8].rms, pr_rms[10],
                           pr_rms[9], pr_rms[6], pr_rms[7], pr_rms[8]);
                free(raw);
                free(ref);
                free(is_out);
            }
}

/* NaN and Inf: fp8-b32 gives the e4m3 NaN of the value's sign (like
 * fp8-e4m3); the integer codecs keep them bit-exact (NaN payloads too);
 * neither touches the scale of the block's finite values. */
static void test_block_specials(df_codec_ctx *c, buf *b)
{
    enum { RE = 64, ROWS = 3 };
    for (size_t t = 0; t < 3; t++) {
        df_dtype dt = dtypes[t];
        size_t es = df_dtype_size(dt), n = RE * ROWS * es;
        uint8_t raw[RE * ROWS * 4];
        for (size_t i = 0; i < RE * ROWS; i++)
            put_elem(raw + i * es, dt, 0.25 * (double)((int)(i % 29) - 14));
        /* row 0: Inf, -Inf, a NaN with a payload, -NaN among values */
        put_elem(raw + 1 * es, dt, INFINITY);
        put_elem(raw + 2 * es, dt, -INFINITY);
        if (es == 4) {
            df_put32(raw + 3 * es, 0x7fc12345u);
            df_put32(raw + 40 * es, 0xffc00001u);
        } else {
            df_put16(raw + 3 * es, dt == DF_DTYPE_BF16 ? 0x7fc5 : 0x7e05);
            df_put16(raw + 40 * es, dt == DF_DTYPE_BF16 ? 0xffc1 : 0xfe01);
        }
        /* row 1: a block of only non-finite values */
        for (size_t i = RE; i < RE + 32; i++)
            put_elem(raw + i * es, dt, i % 2 ? -INFINITY : NAN);
        for (int id = DF_CODEC_FP8_B32; id < DF_CODEC_COUNT; id++) {
            CHECK_EQ(roundtrip(c, id, dt, RE, raw, n, b, "block specials"), id);
            for (size_t i = 0; i < RE * ROWS; i++) {
                double x = elem(raw + i * es, dt), y = elem(b->dec + i * es, dt);
                if (isfinite(x))
                    continue;
                int ok = block_bits(id) ? elem_bits(raw + i * es, es) == elem_bits(b->dec + i * es, es)
                                        : isnan(y) && signbit(y) == signbit(x);
                if (!ok) {
                    fprintf(stderr, "%s %s: element %zu (%g) decoded as %g\n", df_codec_name(id),
                            df_dtype_name(dt), i, x, y);
                    df_test_failures++;
                }
            }
            /* the finite values of row 0's first block: within 1/28 (fp8) or
             * 1/(2 qmax) of their block's finite absmax, 3.5 */
            double lim = block_bits(id) ? 3.5 / (2 * ((1 << (block_bits(id) - 1)) - 1)) : 3.5 / 28;
            for (size_t i = 4; i < 32; i++)
                if (!(fabs(elem(raw + i * es, dt) - elem(b->dec + i * es, dt)) <=
                      lim * (1 + 0x1p-7) + dtype_half_ulp(elem(b->dec + i * es, dt), dt))) {
                    fprintf(stderr, "%s %s: element %zu: %g decoded as %g\n", df_codec_name(id),
                            df_dtype_name(dt), i, elem(raw + i * es, dt), elem(b->dec + i * es, dt));
                    df_test_failures++;
                }
        }
    }
}

/* Rebuilds a block-codec payload with every plane raw (the decoder must
 * accept it and give the same bytes), so that tests can edit planes. */
static size_t block_raw_planes(int id, const uint8_t *enc, size_t len, uint8_t *out, size_t cap)
{
    size_t P = block_bits(id) ? 4 : 3, f = block_bits(id) ? 5 : 1, hdr = f + 5 * P, pos = hdr, o = hdr;
    memcpy(out, enc, f);
    for (size_t k = 0; k < P; k++) {
        int mode = enc[f + 5 * k];
        size_t sz = df_le32(enc + f + 5 * k + 1), n = sz;
        if (mode == 2) {
            unsigned long long cs = ZSTD_getFrameContentSize(enc + pos, sz);
            CHECK(cs < cap);
            n = ZSTD_decompress(out + o, cap - o, enc + pos, sz);
            CHECK(!ZSTD_isError(n) && n == cs);
        } else {
            memcpy(out + o, enc + pos, sz);
        }
        out[f + 5 * k] = 0;
        df_put32(out + f + 5 * k + 1, (uint32_t)n);
        pos += sz;
        o += n;
    }
    CHECK(pos == len);
    return o;
}

/* Payloads that lie: bad scales, escape counts that do not match the codes,
 * plane counts and modes; each is -DF_ECORRUPT with a message naming it. */
static void test_block_corrupt(df_codec_ctx *c)
{
    enum { RE = 96, ROWS = 5 };
    df_dtype dt = DF_DTYPE_BF16;
    size_t es = 2, n = RE * ROWS * es;
    uint8_t raw[RE * ROWS * 2], enc[RE * ROWS * 2], rp[4 * RE * ROWS * 2], mut[4 * RE * ROWS * 2];
    uint8_t dst[RE * ROWS * 2], dst2[RE * ROWS * 2];
    int is_out[RE];
    fill_outliers(raw, ROWS, RE, dt, 300, 77, is_out);
    df_codec_params p = {dt, RE, 0};
    for (int id = DF_CODEC_FP8_B32; id < DF_CODEC_COUNT; id++) {
        df_err e = {0};
        size_t len;
        CHECK_EQ(df_codec_encode(c, id, &p, raw, n, enc, n, &len, &e), id);
        size_t rl = block_raw_planes(id, enc, len, rp, sizeof rp);
        CHECK_OK(df_codec_decode(c, id, &p, enc, len, dst, n, &e), &e);
        CHECK_OK(df_codec_decode(c, id, &p, rp, rl, dst2, n, &e), &e);
        CHECK(!memcmp(dst, dst2, n));
        int bits = block_bits(id);
        size_t f = bits ? 5 : 1, hdr = f + 5 * (bits ? 4 : 3), nb = ROWS * 3;
        size_t ne = bits ? df_le32(rp + 1) : 0;
        if (bits)
            CHECK(ne >= ROWS * 4); /* the outliers (a block with two holds both) */
        /* scale bits that are never written: negative, -0, Inf, NaN */
        static const uint16_t bad[] = {0x8000, 0xbf80, 0x7f80, 0x7fc0, 0xff80};
        for (size_t k = 0; k < 5; k++) {
            memcpy(mut, rp, rl);
            mut[hdr + 7] = (uint8_t)(bad[k] >> 8);
            mut[hdr + nb + 7] = (uint8_t)bad[k];
            CHECK_EQ(try_decode(c, id, &p, mut, rl, dst, n), -DF_ECORRUPT);
            CHECK_ERR(df_codec_decode(c, id, &p, mut, rl, dst, n, &e), -DF_ECORRUPT, &e, "scale");
        }
        /* the largest valid scale decodes (to large values or Inf) */
        memcpy(mut, rp, rl);
        mut[hdr + 7] = 0x7f;
        mut[hdr + nb + 7] = 0x7f;
        CHECK_OK(df_codec_decode(c, id, &p, mut, rl, dst, n, &e), &e);
        /* wrong plane count; lz4 mode */
        memcpy(mut, rp, rl);
        mut[0] ^= 1;
        CHECK_ERR(df_codec_decode(c, id, &p, mut, rl, dst, n, &e), -DF_ECORRUPT, &e, "planes");
        memcpy(mut, rp, rl);
        mut[f + 5 * 2] = 1;
        CHECK_ERR(df_codec_decode(c, id, &p, mut, rl, dst, n, &e), -DF_ECORRUPT, &e, "mode");
        if (!bits)
            continue;
        /* one escaped value more than the codes use (plane grown to match) */
        memcpy(mut, rp, rl);
        df_put32(mut + 1, (uint32_t)(ne + 1));
        df_put32(mut + f + 5 * 3 + 1, (uint32_t)((ne + 1) * es));
        mut[rl] = 0x12;
        mut[rl + 1] = 0x34;
        CHECK_ERR(df_codec_decode(c, id, &p, mut, rl + es, dst, n, &e), -DF_ECORRUPT, &e, "fewer");
        /* one less */
        memcpy(mut, rp, rl);
        df_put32(mut + 1, (uint32_t)(ne - 1));
        df_put32(mut + f + 5 * 3 + 1, (uint32_t)((ne - 1) * es));
        CHECK_ERR(df_codec_decode(c, id, &p, mut, rl - es, dst, n, &e), -DF_ECORRUPT, &e, "more");
        /* an extra escape code (the first code of row 2 := -2^(b-1)) */
        memcpy(mut, rp, rl);
        size_t cb = RE / 32 * 4 * (size_t)bits, c0 = hdr + 2 * nb + 2 * cb;
        mut[c0] = (uint8_t)((mut[c0] & ~((1u << bits) - 1)) | (1u << (bits - 1)));
        CHECK_ERR(df_codec_decode(c, id, &p, mut, rl, dst, n, &e), -DF_ECORRUPT, &e, "more");
        /* more escapes than elements */
        memcpy(mut, rp, rl);
        df_put32(mut + 1, (uint32_t)(RE * ROWS + 1));
        CHECK_ERR(df_codec_decode(c, id, &p, mut, rl, dst, n, &e), -DF_ECORRUPT, &e, "escaped");
    }
}

/* int3-b32 and int2-b32, the codes that cross byte boundaries (3 bits) or
 * hold only -1, 0, 1 (2 bits): known values on a unit scale give known codes,
 * packed as docs/FORMAT-codecs.md says (code i of a block at bits
 * [i*N, i*N + N) of its bytes, little-endian; a short last block padded with
 * zero bits), with an escape (code -2^(N-1)) for a value 2x above the rest;
 * both kernels (scalar, AVX2 where the CPU has it) give the same bytes and
 * decode them exactly. */
static void test_int_lowbit_layout(df_codec_ctx *c)
{
    enum { RE = 101, ROWS = 3, NBR = 4 }; /* blocks of 32, 32, 32, 5 */
    static const int ids[] = {DF_CODEC_INT3_B32, DF_CODEC_INT2_B32};
    for (size_t m = 0; m < 2; m++) {
        int id = ids[m], bits = block_bits(id), qmax = (1 << (bits - 1)) - 1;
        uint16_t raw[RE * ROWS];
        int q[RE * ROWS], escaped[RE * ROWS];
        uint64_t r = 4242 + m;
        for (size_t i = 0; i < RE * ROWS; i++) {
            size_t in_blk = i % RE % 32;
            /* 5 values at +-qmax per block (no gap below the top), the rest random */
            q[i] = in_blk < 5 ? (in_blk & 1 ? -qmax : qmax)
                              : (int)(test_rand(&r) % (uint64_t)(2 * qmax + 1)) - qmax;
            escaped[i] = 0;
            raw[i] = df_f32_to_bf16((float)q[i]);
        }
        /* escapes: one 100 in row 0 block 0, a -Inf in row 1 block 3 (the short one) */
        raw[7] = df_f32_to_bf16(100.0f), escaped[7] = 1;
        raw[RE + 99] = 0xff80, escaped[RE + 99] = 1;
        /* expected code plane: per row NBR blocks, 4N bytes each but the last
         * ceil(5N/8) */
        size_t cb = 3 * 4 * (size_t)bits + ((size_t)5 * bits + 7) / 8;
        uint8_t want[ROWS * 64] = {0};
        for (size_t row = 0; row < ROWS; row++)
            for (size_t j = 0; j < NBR; j++) {
                size_t k = j < 3 ? 32 : 5;
                uint8_t *o = want + row * cb + j * 4 * (size_t)bits;
                for (size_t i = 0; i < k; i++) {
                    size_t x = row * RE + 32 * j + i;
                    unsigned code = escaped[x] ? 1u << (bits - 1) : (unsigned)q[x] & ((1u << bits) - 1);
                    for (int bt = 0; bt < bits; bt++)
                        if (code >> bt & 1)
                            o[(i * bits + bt) / 8] |= (uint8_t)(1u << ((i * bits + bt) % 8));
                }
            }
        df_codec_params p = {DF_DTYPE_BF16, RE, 0};
        uint8_t enc[2][sizeof raw], rp[4 * sizeof raw];
        uint16_t dec[RE * ROWS];
        size_t len[2] = {0, 0};
        for (int v = 0; v < 2; v++) {
            len[v] = 0;
            if (df_codec_set_plane_impl(v ? 3 : 1) < 0)
                continue; /* no AVX2 here */
            df_err e = {0};
            CHECK_EQ(df_codec_encode(c, id, &p, raw, sizeof raw, enc[v], sizeof raw, &len[v], &e), id);
            memset(dec, 0xA5, sizeof dec);
            CHECK_OK(df_codec_decode(c, id, &p, enc[v], len[v], dec, sizeof raw, &e), &e);
            CHECK(!memcmp(dec, raw, sizeof raw)); /* every value on the grid or escaped */
            if (v)
                CHECK(len[0] == len[1] && !memcmp(enc[0], enc[1], len[0]));
        }
        df_codec_set_plane_impl(0);
        size_t rl = block_raw_planes(id, enc[0], len[0], rp, sizeof rp);
        size_t hdr = 25, nb = ROWS * NBR;
        CHECK_EQ(df_le32(rp + 1), 2);                         /* E */
        CHECK_EQ(df_le32(rp + 5 + 5 * 2 + 1), ROWS * cb);     /* code plane size */
        CHECK_EQ(rl, hdr + 2 * nb + ROWS * cb + 2 * 2);
        for (size_t j = 0; j < nb; j++) /* every scale 1.0: qmax / qmax */
            CHECK(rp[hdr + j] == 0x3f && rp[hdr + nb + j] == 0x80);
        if (memcmp(rp + hdr + 2 * nb, want, ROWS * cb)) {
            fprintf(stderr, "%s: code plane differs from the specified packing\n", df_codec_name(id));
            df_test_failures++;
        }
        CHECK_EQ(df_le16(rp + rl - 4), raw[7]);
        CHECK_EQ(df_le16(rp + rl - 2), 0xff80);
    }
}

/* int2 is the one codec whose A / qmax can exceed the largest finite bf16:
 * F32 values in (0x1.fep127, FLT_MAX] get the scale 0x7f7f (not Inf, which
 * the decoder would reject as corrupt) and decode within 2^-8 of themselves;
 * int3 there is not capped (A/3 is far below) and stays in its bound. */
static void test_int2_f32_max(df_codec_ctx *c, buf *b)
{
    enum { RE = 64 };
    float x[2 * RE];
    uint64_t r = 99;
    for (size_t i = 0; i < 2 * RE; i++) {
        /* row 0: everything in [FLT_MAX/2.2, FLT_MAX], no 2x gaps; row 1 the
         * same scaled, and a block with only values above bf16's maximum */
        double u = (double)(test_rand(&r) % 1000000) / 1e6;
        x[i] = (float)(FLT_MAX * (0.46 + 0.54 * u));
        if (i >= RE + 32)
            x[i] = (float)(0x1.fep127 + (FLT_MAX - 0x1.fep127) * (0.01 + 0.99 * u));
        if (i % 3 == 1)
            x[i] = -x[i];
    }
    x[5] = FLT_MAX, x[6] = -FLT_MAX, x[40] = 0x1.fep127f;
    for (int id = DF_CODEC_INT3_B32; id <= DF_CODEC_INT2_B32; id++) {
        CHECK_EQ(roundtrip(c, id, DF_DTYPE_F32, RE, x, sizeof x, b, "F32 near FLT_MAX"), id);
        for (size_t i = 0; i < 2 * RE; i++) {
            float y;
            memcpy(&y, b->dec + 4 * i, 4);
            CHECK(isfinite(y) || id == DF_CODEC_INT3_B32);
        }
    }
    /* the scales of the int2 payload: 0x7f7f in the blocks with FLT_MAX, with
     * 0x1.fep127 (exact) and with only values above it (row 0's two, row 1's second) */
    df_codec_params p = {DF_DTYPE_F32, RE, 0};
    df_err e = {0};
    size_t len;
    uint8_t rp[4 * sizeof x];
    CHECK_EQ(df_codec_encode(c, DF_CODEC_INT2_B32, &p, x, sizeof x, b->enc, sizeof x, &len, &e),
             DF_CODEC_INT2_B32);
    block_raw_planes(DF_CODEC_INT2_B32, b->enc, len, rp, sizeof rp);
    CHECK_EQ(df_le32(rp + 1), 0); /* no escapes */
    for (size_t j = 0; j < 4; j++)
        if (j != 2)
            CHECK(rp[25 + j] == 0x7f && rp[25 + 4 + j] == 0x7f);
}

/* The SIMD kernels (plane split/merge, fp8 quantize/dequantize) give the
 * same bytes as the scalar ones, tails included. */
static void test_impls_agree(df_codec_ctx *c)
{
    static const uint32_t res[] = {37, 1001, 256, 5120};
    for (size_t t = 0; t < 3; t++)
        for (size_t k = 0; k < 4; k++) {
            df_dtype dt = dtypes[t];
            size_t es = df_dtype_size(dt), rows = 9, n = rows * res[k] * es;
            uint8_t *raw = malloc(n), *enc[2], *dec[2];
            size_t len[2];
            fill_synth(raw, rows, res[k], dt, 31 + k);
            /* row 1: random bits (NaN, Inf, subnormals); row 2: tiny values */
            fill_random_bits(raw + res[k] * es, res[k] * es);
            for (size_t i = 0; i < res[k]; i++)
                put_elem(raw + (2 * res[k] + i) * es, dt, ldexp((double)(i % 17) - 8, -20));
            df_codec_params p = {dt, res[k], 0};
            for (int id = 2; id < DF_CODEC_COUNT; id++) {
                for (int v = 0; v < 2; v++) {
                    enc[v] = malloc(n);
                    dec[v] = malloc(n);
                    len[v] = 0;
                    if (df_codec_set_plane_impl(v ? 0 : 1) < 0)
                        continue;
                    df_err e = {0};
                    int used = df_codec_encode(c, id, &p, raw, n, enc[v], n, &len[v], &e);
                    CHECK_OK(used, &e);
                    CHECK_OK(df_codec_decode(c, used, &p, enc[v], len[v], dec[v], n, &e), &e);
                }
                CHECK(len[0] == len[1] && !memcmp(enc[0], enc[1], len[0]));
                CHECK(!memcmp(dec[0], dec[1], n));
                for (int v = 0; v < 2; v++) {
                    free(enc[v]);
                    free(dec[v]);
                }
            }
            df_codec_set_plane_impl(0);
            free(raw);
        }
}

static void test_levels(df_codec_ctx *c, buf *b)
{
    /* non-default levels encode differently, decode the same way */
    uint32_t re = 1024;
    size_t rows = 32, n = rows * re * 2;
    uint8_t *raw = malloc(n);
    fill_synth(raw, rows, re, DF_DTYPE_BF16, 3);
    static const int levels[] = {1, 3, -5, 2, 9, -2};
    for (int id = 1; id < DF_CODEC_COUNT; id++)
        for (size_t k = 0; k < sizeof levels / sizeof levels[0]; k++) {
            df_codec_params p = {DF_DTYPE_BF16, re, levels[k]};
            df_err e = {0};
            size_t out;
            buf_need(b, n);
            int used = df_codec_encode(c, id, &p, raw, n, b->enc, n, &out, &e);
            CHECK_OK(used, &e);
            p.level = 0;
            CHECK_OK(df_codec_decode(c, used, &p, b->enc, out, b->dec, n, &e), &e);
            if (!df_codec_is_lossy(used))
                CHECK(!memcmp(b->dec, raw, n));
        }
    free(raw);
}

int main(void)
{
    df_codec_ctx *c = df_codec_ctx_new();
    CHECK(c != NULL);
    if (!c)
        return test_main_end();
    buf b = {0};
    test_names();
    test_planes();
    test_e4m3_values();
    test_fp8_rounding(c, &b);
    test_roundtrips(c, &b);
    test_special_values(c, &b);
    test_large(c, &b);
    test_bad_params(c);
    test_corrupt(c);
    test_impls_agree(c);
    test_levels(c, &b);
    test_block_outliers(c, &b);
    test_block_specials(c, &b);
    test_block_corrupt(c);
    test_int_lowbit_layout(c);
    test_int2_f32_max(c, &b);
    /* a second context works independently */
    df_codec_ctx *c2 = df_codec_ctx_new();
    test_fp8_rounding(c2, &b);
    df_codec_ctx_free(c2);
    df_codec_ctx_free(c);
    df_codec_ctx_free(NULL);
    free(b.enc);
    free(b.dec);
    return test_main_end();
}
