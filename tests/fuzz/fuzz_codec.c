/* fuzz_codec - df_codec_decode on arbitrary payloads, and encode->decode
 * round trips on arbitrary data.
 *
 * Input: byte 0 selects the codec id (byte 0 % DF_CODEC_COUNT: a new codec
 * leaves the others' seeds alone), byte 1 the dtype (byte 1 % 3) and row
 * size (byte 1 / 3 % 8 into a table); the rest is the payload. It is decoded with a
 * few raw lengths: 0, one row, the size its sub-header implies (so that valid
 * payloads get decoded all the way), and that size +- one row. A decode must
 * return 0 or -DF_ECORRUPT (-EINVAL only for a length that is not whole rows)
 * and never touch memory outside its buffers (exact-size heap copies, so
 * ASan sees over-reads and over-writes). Then the same bytes, as raw data,
 * must survive encode -> decode (bit-exact for lossless codecs).
 */
#include <lz4.h>
#include <stdlib.h>
#include <string.h>
#include <zstd.h>

#include "codec.h"
#include "le.h"

#define MAX_RAW (1u << 20)

static const df_dtype dtypes[3] = {DF_DTYPE_BF16, DF_DTYPE_F16, DF_DTYPE_F32};
static const uint32_t row_sizes[8] = {1, 3, 16, 37, 64, 128, 256, 1000};

static void check(int cond)
{
    if (!cond)
        __builtin_trap();
}

static void decode_with(df_codec_ctx *c, int id, const df_codec_params *p, const uint8_t *src,
                        size_t len, size_t raw_len, size_t row_bytes)
{
    if (raw_len > MAX_RAW)
        return;
    uint8_t *dst = malloc(raw_len ? raw_len : 1);
    df_err e = {0};
    int rc = df_codec_decode(c, id, p, src, len, dst, raw_len, &e);
    if (raw_len % row_bytes)
        check(rc == -EINVAL);
    else
        check(rc == 0 || (rc == -DF_ECORRUPT && e.msg[0]));
    free(dst);
}

/* The raw length a payload's own header implies, or 0 if none. */
static size_t implied_len(int id, size_t es, size_t row_bytes, const uint8_t *s, size_t len)
{
    switch (id) {
    case DF_CODEC_STORED:
        return len;
    case DF_CODEC_LZ4: {
        if (!len || len > MAX_RAW)
            return 0;
        char *tmp = malloc(MAX_RAW);
        int r = LZ4_decompress_safe((const char *)s, tmp, (int)len, (int)MAX_RAW);
        free(tmp);
        return r > 0 ? (size_t)r : 0;
    }
    case DF_CODEC_SPLIT_LZ4:
    case DF_CODEC_SPLIT_ZSTD: {
        size_t h = 1 + 5 * es;
        if (len < h)
            return 0;
        for (size_t k = 0; k < es; k++) {
            uint32_t sz = df_le32(s + 2 + 5 * k);
            if (s[1 + 5 * k] == 0)
                return (size_t)sz * es;
            if (k == 0 && s[1] == 2) {
                unsigned long long cs = ZSTD_getFrameContentSize(s + h, len - h);
                if (cs < MAX_RAW)
                    return (size_t)cs * es;
            }
        }
        return 0;
    }
    case DF_CODEC_FP8_E4M3: {
        if (len < 5)
            return 0;
        size_t sz = df_le32(s + 1);
        if (sz > len - 5)
            return 0;
        return (len - 5 - sz) / 4 * row_bytes;
    }
    default: {
        /* block codecs: from the code plane's size (plane 2; raw, or a zstd
         * frame's content size): fp8-b32 has row_elems bytes per row,
         * intN-b32 ceil(row_elems * N / 8) when the row is whole blocks
         * (else: a guess) */
        static const size_t width[DF_CODEC_COUNT] = {
            [DF_CODEC_FP8_B32] = 8, [DF_CODEC_INT4_B32] = 4, [DF_CODEC_INT5_B32] = 5,
            [DF_CODEC_INT6_B32] = 6, [DF_CODEC_INT3_B32] = 3, [DF_CODEC_INT2_B32] = 2};
        size_t f = id == DF_CODEC_FP8_B32 ? 1 : 5, bits = width[id];
        size_t hdr = f + 5 * (id == DF_CODEC_FP8_B32 ? 3 : 4);
        if (len < hdr)
            return 0;
        size_t code_len = df_le32(s + f + 11), per_row = (row_bytes / es * bits + 7) / 8;
        if (s[f + 10] == 2) {
            size_t off = hdr + (size_t)df_le32(s + f + 1) + df_le32(s + f + 6);
            if (off > len || code_len > len - off)
                return 0;
            unsigned long long cs = ZSTD_getFrameContentSize(s + off, code_len);
            if (cs >= MAX_RAW)
                return 0;
            code_len = (size_t)cs;
        } else if (s[f + 10] != 0) {
            return 0;
        }
        return per_row ? code_len / per_row * row_bytes : 0;
    }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n)
{
    static df_codec_ctx *c; /* one per process, as a thread would keep it */
    if (!c && !(c = df_codec_ctx_new()))
        return 0;
    if (n < 2)
        return 0;
    int id = d[0] % DF_CODEC_COUNT;
    df_dtype dt = dtypes[d[1] % 3];
    uint32_t re = row_sizes[d[1] / 3 % 8];
    size_t es = df_dtype_size(dt), rb = re * es;
    df_codec_params p = {dt, re, 0};

    size_t len = n - 2;
    uint8_t *src = malloc(len ? len : 1);
    memcpy(src, d + 2, len);

    /* decode the payload with a few raw lengths */
    size_t guess = implied_len(id, es, rb, src, len);
    size_t lens[6] = {0, rb, guess, guess + rb, guess >= rb ? guess - rb : 0, guess + 1};
    for (int k = 0; k < 6; k++)
        decode_with(c, id, &p, src, len, lens[k], rb);

    /* round trip of the payload bytes as data (whole rows of it) */
    size_t raw_len = len / rb * rb;
    if (raw_len <= MAX_RAW) {
        uint8_t *enc = malloc(raw_len ? raw_len : 1), *dec = malloc(raw_len ? raw_len : 1);
        size_t out = 0;
        df_err e = {0};
        int used = df_codec_encode(c, id, &p, src, raw_len, enc, raw_len, &out, &e);
        check(used == id || used == DF_CODEC_STORED);
        check(out <= raw_len && (used == DF_CODEC_STORED ? out == raw_len : out < raw_len));
        int rc = df_codec_decode(c, used, &p, enc, out, dec, raw_len, &e);
        check(rc == 0);
        if (!df_codec_is_lossy(used))
            check(!raw_len || !memcmp(dec, src, raw_len));
        free(enc);
        free(dec);
    }
    free(src);
    return 0;
}
