/* codec.h - compression of hidden-state blocks.
 *
 * A block is the raw bytes of some whole rows (tokens) of one layer's hidden
 * states, row-major, elements of params->dtype. Codec ids are stored on disk
 * (docs/FORMAT.md) and never change meaning:
 *
 *   0 stored      the raw bytes
 *   1 lz4         LZ4 of the raw bytes (~1.00x on bf16: kept for reference)
 *   2 split-lz4   byte planes (all high bytes, then all low bytes), each LZ4
 *   3 split-zstd  byte planes; the high (sign+exponent) plane zstd-1, the rest raw
 *   4 fp8-e4m3    LOSSY, opt-in: per-row f32 scale (absmax/448) + e4m3 bytes,
 *                 the e4m3 plane zstd-1 coded
 *
 * Encoding never grows a block: when a codec's output is not smaller than the
 * raw bytes, df_codec_encode() stores it and returns DF_CODEC_STORED. The id it
 * returns is the one to write next to the block.
 *
 * Contexts own compression state and scratch memory; one per thread. Decoding
 * is bounds-checked: any input, however corrupt, gives either the exact raw
 * length or -DF_ECORRUPT, never a read or write out of bounds.
 */
#ifndef DF_CODEC_H
#define DF_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "err.h"

typedef enum df_codec_id {
    DF_CODEC_STORED = 0,
    DF_CODEC_LZ4 = 1,
    DF_CODEC_SPLIT_LZ4 = 2,
    DF_CODEC_SPLIT_ZSTD = 3,
    DF_CODEC_FP8_E4M3 = 4,
    DF_CODEC_COUNT = 5
} df_codec_id;

typedef struct df_codec_params {
    df_dtype dtype;     /* element type of the raw block: BF16, F16 or F32 */
    uint32_t row_elems; /* elements per row (the hidden size); fp8 scales per row */
    int level;          /* entropy coder level; 0 = the codec's default (zstd 1) */
} df_codec_params;

typedef struct df_codec_ctx df_codec_ctx;

df_codec_ctx *df_codec_ctx_new(void);
void df_codec_ctx_free(df_codec_ctx *c);

const char *df_codec_name(int id);          /* "split-zstd", or "?" */
int df_codec_from_name(const char *name);   /* id, or -EINVAL */
int df_codec_is_lossy(int id);

/* Output capacity that df_codec_encode() needs for raw_len bytes. */
size_t df_codec_bound(int id, size_t raw_len, const df_codec_params *p);

/* Encodes src[0..raw_len) with codec id into dst (capacity cap >=
 * df_codec_bound()). Returns the codec id actually used (id, or
 * DF_CODEC_STORED when that is not smaller) and sets *out_len; or a negative
 * code (bad params: raw_len not a whole number of rows, unknown id). */
int df_codec_encode(df_codec_ctx *c, int id, const df_codec_params *p, const void *src,
                    size_t raw_len, void *dst, size_t cap, size_t *out_len, df_err *e);

/* Decodes src[0..src_len) of codec id into exactly raw_len bytes at dst.
 * Returns 0, or -DF_ECORRUPT (with a message) if the data do not decode to
 * exactly raw_len bytes. */
int df_codec_decode(df_codec_ctx *c, int id, const df_codec_params *p, const void *src,
                    size_t src_len, void *dst, size_t raw_len, df_err *e);

#endif
