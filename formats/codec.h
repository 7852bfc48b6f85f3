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
 *                 (lower planes zstd too where that shrinks them, e.g. F32 data)
 *   4 fp8-e4m3    LOSSY, opt-in: per-row f32 scale (absmax/448) + e4m3 bytes,
 *                 the e4m3 plane zstd-1 coded (raw if that does not shrink it)
 *   5 fp8-b32     LOSSY, opt-in: e4m3 bytes, one bf16 scale per block of 32
 *                 elements of a row (a massive activation only coarsens its block)
 *   6 int4-b32    LOSSY, opt-in: symmetric 4-, 5- or 6-bit integers, bit-packed,
 *   7 int5-b32    one bf16 scale per 32-element block; a block's few values far
 *   8 int6-b32    above the rest (massive activations) and NaN/Inf kept exactly
 *   9 int3-b32    LOSSY, opt-in: as 6-8 with 3- and 2-bit integers (coarse:
 *  10 int2-b32    errors up to ~17% / ~50% of a block's absmax)
 *
 * Encoding never grows a block: when a codec's output is not smaller than the
 * raw bytes, df_codec_encode() stores it and returns DF_CODEC_STORED. The id it
 * returns is the one to write next to the block.
 *
 * Contexts own compression state and scratch memory; one per thread. Decoding
 * is bounds-checked: any input, however corrupt, gives either the exact raw
 * length or -DF_ECORRUPT, never a read or write out of bounds.
 *
 * Payload layouts (the sub-headers that let each plane fall back to raw on
 * its own) are specified in docs/FORMAT-codecs.md. In short: planes are byte
 * planes of the little-endian elements, plane 0 = the most significant byte;
 * 2 planes for BF16/F16, 4 for F32 (for F32 the lower planes are zstd-coded
 * too when a sample says they would shrink, e.g. data upcast from bf16).
 *
 * fp8-e4m3 (OCP E4M3FN: bias 7, max 448, no Inf, S.1111.111 = NaN):
 *   scale = absmax/448 in f32 over the row's finite values (0 for a row with
 *   none, which then decodes to zeros). code = RNE(x/scale) saturated to
 *   +-448; NaN and +-Inf become the e4m3 NaN of their sign (e4m3 has no Inf,
 *   and a non-finite input must stay non-finite so a finiteness check on the
 *   decoded data still fires). Decoding: v = e4m3(code) * scale in f32, then
 *   RNE to the dtype (f32 arithmetic so a GPU decoder gets the same bits).
 *   Error per element: |x - v| <= scale * (half an e4m3 ulp at |x|/scale)
 *   plus half a dtype ulp at v (and tiny f32 rounding); a row whose absmax is
 *   below 448 * 2^-126 has a subnormal scale and lower precision.
 *
 * Block-scaled codecs (5-10): a row is cut into blocks of 32 consecutive
 * elements (the last block of a row is shorter when row_elems is not a
 * multiple of 32; blocks never span rows). Each block has a bf16 scale
 * S = the smallest bf16 >= A/Q, where A is the absmax of the values the block
 * quantizes and Q = 448 (e4m3) or qmax = 2^(N-1)-1 (7, 15, 31 for N = 4, 5,
 * 6; 3, 1 for N = 3, 2): the largest value maps to just under Q, nothing
 * clips (A = 0 gives S = 0). Only int2 (Q = 1) can meet an A/Q above the
 * largest finite bf16 (0x7f7f = 0x1.fep127: F32 data only); S is 0x7f7f then,
 * and those values map to within 2^-8 above Q (code 1). The planes
 * (scale high bytes, scale low bytes, codes, escaped values) are each stored
 * raw or as a zstd frame, whichever is smaller.
 *   fp8-b32: code = sign | RNE_e4m3(|x|/S), NaN and +-Inf -> the e4m3 NaN
 *   of their sign (as fp8-e4m3). Decoding: v = e4m3(code) * S in f32 (exact),
 *   then RNE to the dtype. Error per finite element:
 *     |x - v| <= S * (half an e4m3 ulp at |x|/S) + half a dtype ulp at v
 *            <= min(|x|/16 + S/1024, A/28 * (1 + 2^-7)) + half a dtype ulp,
 *   i.e. 2^-4 of the value and at most 3.6% of its block's absmax.
 *   intN-b32 (N = 2 .. 6): escaped, and kept bit-exact (the element's raw
 *   bytes): NaN and +-Inf, and the top j finite |x| of a block for the
 *   largest j <= 4 (j < the block's size) with top[j-1] > 2 * top[j] > 0.
 *   The others: q = RNE(x/S) of the exact quotient (ties to even), clamped
 *   to +-qmax, stored as N-bit two's complement; -2^(N-1) marks an escape
 *   (int3: codes -3 .. 3, escape -4; int2: codes -1, 0, 1, escape -2).
 *   Decoding: v = q * S in f32 (exact), then RNE to the dtype; -0 decodes
 *   as +0. Error per element not escaped:
 *     |x - v| <= S/2 + half a dtype ulp at v
 *            <= A/(2 qmax) * (1 + 2^-7) + half a dtype ulp,
 *   A the block's absmax: 7.2% (int4), 3.4% (int5), 1.6% (int6), 16.8%
 *   (int3), 50.4% (int2) of it. (int2 is a sign-and-threshold code: |x| <=
 *   S/2 decodes as 0, the rest as +-S.) Below A = Q * 2^-126 the scale is a
 *   subnormal bf16 and the bounds hold with S <= A/Q + 2^-133 instead;
 *   values within 2^-7 of the dtype's largest finite value may decode as
 *   +-Inf (not F32 under int2, whose S is capped at 0x7f7f).
 *
 * Levels (df_codec_params.level): for zstd codecs (3-10) 0 = the default, zstd 1
 * with hashLog 6 and minMatch 7 (nearly literals-only: the measured best in
 * both ratio and speed on sign+exponent planes; docs/FORMAT-codecs.md), any
 * other value = that plain zstd level (negative = zstd's fast levels). For lz4
 * codecs 0 or 1 = LZ4 default, < 0 = LZ4 acceleration -level, 2..12 = LZ4HC
 * at that level. Decoding does not depend on the level.
 *
 * Limits: a block whose plane exceeds 2^32-1 bytes (or, for lz4 codecs, LZ4's
 * ~2 GB input limit) is STORED.
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
    DF_CODEC_FP8_B32 = 5,
    DF_CODEC_INT4_B32 = 6,
    DF_CODEC_INT5_B32 = 7,
    DF_CODEC_INT6_B32 = 8,
    DF_CODEC_INT3_B32 = 9,
    DF_CODEC_INT2_B32 = 10,
    DF_CODEC_COUNT = 11
} df_codec_id;

typedef struct df_codec_params {
    df_dtype dtype;     /* element type of the raw block: BF16, F16 or F32 */
    uint32_t row_elems; /* elements per row (the hidden size); fp8-e4m3 scales per
                         * row, the block codecs per 32 elements of a row */
    int level;          /* entropy coder level; 0 = the codec's default (zstd 1) */
} df_codec_params;

typedef struct df_codec_ctx df_codec_ctx;

df_codec_ctx *df_codec_ctx_new(void);
void df_codec_ctx_free(df_codec_ctx *c);

const char *df_codec_name(int id);          /* "split-zstd", or "?" */
int df_codec_from_name(const char *name);   /* id, or -EINVAL */
int df_codec_is_lossy(int id);

/* Output capacity that df_codec_encode() needs for raw_len bytes: raw_len
 * itself, for every codec (encoding never grows a block). */
size_t df_codec_bound(int id, size_t raw_len, const df_codec_params *p);

/* Encodes src[0..raw_len) with codec id into dst (capacity cap >=
 * df_codec_bound()). Returns the codec id actually used (id, or
 * DF_CODEC_STORED when that is not smaller, always for raw_len 0) and sets
 * *out_len; or a negative code: -EINVAL for bad params (raw_len not a whole
 * number of rows, unknown id, dtype not BF16/F16/F32, row_elems 0, cap too
 * small), -ENOMEM. */
int df_codec_encode(df_codec_ctx *c, int id, const df_codec_params *p, const void *src,
                    size_t raw_len, void *dst, size_t cap, size_t *out_len, df_err *e);

/* Decodes src[0..src_len) of codec id into exactly raw_len bytes at dst.
 * Returns 0, or -DF_ECORRUPT (with a message) if the data do not decode to
 * exactly raw_len bytes; -EINVAL for bad params as for encoding; -ENOMEM.
 * On error dst's contents are unspecified (but nothing outside it is written). */
int df_codec_decode(df_codec_ctx *c, int id, const df_codec_params *p, const void *src,
                    size_t src_len, void *dst, size_t raw_len, df_err *e);

/* The byte-plane transform of the split codecs, exposed for benchmarks and a
 * future GPU decoder: planes[k][i] = byte (esize-1-k) of element i, for
 * esize 1, 2 or 4 (planes[0] = most significant byte). Vectorized (SSE2,
 * AVX2 when the CPU has it). */
void df_codec_split_planes(const void *src, size_t n_elems, size_t esize, uint8_t *const planes[]);
void df_codec_merge_planes(const uint8_t *const planes[], size_t n_elems, size_t esize, void *dst);

/* For tests and benchmarks only (not thread-safe): force the SIMD level of
 * the plane split/merge, fp8 and block-codec kernels, 0 = auto, 1 = scalar,
 * 2 = SSE2, 3 = AVX2 (fp8 and the block codecs have scalar and AVX2 only;
 * their AVX2 decoders write BF16 and F32, F16 goes scalar). Every level
 * gives the same bytes.
 * Returns 0, -EINVAL, or -ENOTSUP if the CPU lacks it. */
int df_codec_set_plane_impl(int impl);

#endif
