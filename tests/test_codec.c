/* test_codec - the hidden-state block codecs (formats/codec.h).
 *
 * Round trips of every codec x dtype on random, structured (tools/synth.h),
 * constant, special-valued and oddly sized data; "never grows"; the fp8
 * error bound; and corrupt payloads (truncated, bit-flipped, lying headers,
 * garbage) giving -DF_ECORRUPT, never a crash (run it under ASan too).
 */
#include <math.h>
#include <string.h>

#include "codec.h"
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
        if (!check_fp8(raw, b->dec, raw_len, t, re, what)) {
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
        CHECK_EQ(df_codec_is_lossy(id), id == DF_CODEC_FP8_E4M3);
    }
    CHECK(!strcmp(df_codec_name(3), "split-zstd"));
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
            if (id != DF_CODEC_FP8_E4M3)
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
        roundtrip(c, DF_CODEC_FP8_E4M3, dt, re, raw, 2 * re * es, b, "fp8 non-finite/subnormal rows");
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
    CHECK_ERR(df_codec_encode(c, 9, &p, raw, 32, out, 64, &len, &e), -EINVAL, &e, "unknown codec");
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
            size_t step = len > 4000 ? 7 : 1;
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
                       : id == DF_CODEC_FP8_E4M3 ? 5 + 4 * rows : 0;
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

/* The SIMD kernels (plane split/merge, fp8 quantize/dequantize) give the
 * same bytes as the scalar ones, tails included. */
static void test_impls_agree(df_codec_ctx *c)
{
    static const uint32_t res[] = {37, 1001, 256};
    for (size_t t = 0; t < 3; t++)
        for (size_t k = 0; k < 3; k++) {
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
                    if (df_codec_set_plane_impl(v ? 0 : 1) < 0)
                        continue;
                    df_err e = {0};
                    CHECK_OK(df_codec_encode(c, id, &p, raw, n, enc[v], n, &len[v], &e), &e);
                    CHECK_OK(df_codec_decode(c, id == DF_CODEC_FP8_E4M3 || len[v] < n ? id : 0, &p,
                                             enc[v], len[v], dec[v], n, &e), &e);
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
