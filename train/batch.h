/* batch.h - the training data path: packed rows of documents -> the tensors
 * one drafter step consumes (docs/DRAFTER.md "Rows, anchors and blocks"). Pure C, no I/O:
 * documents come from the caller (normally df_cache_stream items).
 *
 * RNG: df_rng is xoshiro256** seeded through splitmix64. Its state is the
 * plain struct (4 x u64); copying it, or df_rng_save/df_rng_load (32 bytes
 * little-endian, for checkpoints), resumes the exact sequence. The builder
 * draws from the caller's df_rng only: anchor sampling in df_batch_finish
 * and, when noise > 0, feature noise in df_batch_add. The same documents,
 * calls and RNG state give bit-identical rows.
 *
 * Row protocol:
 *   df_batch_reset(b)                      start an empty row
 *   df_batch_add(b, doc, rng) -> 1         copied into the row (the caller may
 *                                          release the document right away)
 *                             -> 0         does not fit in what is left: finish
 *                                          this row, reset, add the same doc again
 *   df_batch_finish(b, rng)                samples anchors, builds the blocks;
 *                                          the row stays readable until reset
 * Documents are packed in the order given. A document longer than
 * max_tokens is TRUNCATED to its first max_tokens tokens when it starts a
 * row (never reported as an error; row.truncated counts the dropped
 * tokens): the truncated tail is gone for this row (no context, no anchors,
 * no labels past the cut). Empty documents are accepted and ignored.
 *
 * Context (S = row.n_tokens <= max_tokens; arrays are sized max_tokens and
 * entries >= S are padding: features 0, pos 0, doc_start S, ids 0, mask 0,
 * so a caller may use S or the static max_tokens):
 *   features [max_tokens, K*H] F32: token t's row is the concatenation of
 *     doc.layers[0..K-1] at t (the drafter's target_layer_ids order), from
 *     BF16 (F16/F32 accepted), plus uniform noise in [-noise, noise) per
 *     element when noise > 0 (none at all when noise == 0);
 *   pos [S]: position inside the document (restarts at 0 per document);
 *   ctx_doc_start [S]: context index where the token's document starts;
 *   doc_offset [n_docs+1]: documents' context ranges.
 * Anchors: candidates are context indices p with loss_mask[p] and
 *   loss_mask[p+1], p+1 in the same (possibly truncated) document. Up to
 *   max_anchors are drawn uniformly WITHOUT replacement over the union of all
 *   candidates of the row (not per document), then sorted ascending (so in
 *   document order). Blocks [max_anchors] always: the first n_valid are the
 *   anchors (valid 1), the rest padding (valid 0, anchor 0, doc_start 0).
 *   row.blocks is the df_dflash_blocks view for the attention (window 0:
 *   set it per layer).
 * Block b, offset k (0..bs-1), anchor p, its document [d0, d1):
 *   block_ids  = ids[p] for k = 0, mask_token_id for k >= 1 (padding: all mask);
 *   block_pos  = pos[p] + k (padding: k);
 *   labels     = ids[p+k] for k >= 1 and p+k < d1, else -1 (k = 0, past the
 *                document end, padding). A label may exist with weight 0
 *                (loss_mask[p+k] == 0): a position counts (loss, acc[k],
 *                tau_hat) iff weight > 0;
 *   weights    = valid * (p+k < d1) * loss_mask[p+k] * exp(-(k-1)/gamma)
 *                for k >= 1, 0 for k = 0.
 * row.weight_sum is this row's sum of weights. The loss is
 * sum(w*CE) / D with D the sum of weight_sum over rows, accumulation steps
 * and ranks. D can be 0 (no row had a candidate): the caller must then use
 * loss 0 and zero gradients, never divide (0/0 = NaN).
 *
 * Memory: everything is allocated once by df_batch_create (features may be
 * the caller's buffer, e.g. pinned memory); add/finish never allocate.
 */
#ifndef DF_BATCH_H
#define DF_BATCH_H

#include <stddef.h>
#include <stdint.h>

#include "cache.h"
#include "cache_stream.h"
#include "dtype.h"
#include "err.h"
#include "train_ops.h"

/* ---- RNG ---- */

typedef struct df_rng {
    uint64_t s[4];
} df_rng;

/* Seeds from (seed, stream): distinct streams (rank, epoch, ...) give
 * unrelated sequences. */
void df_rng_seed(df_rng *r, uint64_t seed, uint64_t stream);
uint64_t df_rng_next(df_rng *r);
/* Uniform in [0, n), unbiased (n >= 1). */
uint64_t df_rng_below(df_rng *r, uint64_t n);
/* Uniform in [0, 1), 24 random bits. */
float df_rng_float(df_rng *r);
void df_rng_save(const df_rng *r, uint8_t out[32]);
/* -EINVAL if the saved state is all zeros (not a valid xoshiro state). */
int df_rng_load(df_rng *r, const uint8_t in[32], df_err *e);

/* ---- builder ---- */

#define DF_BATCH_MAX_FEATURES DF_CACHE_MAX_LAYERS

typedef struct df_batch_config {
    int max_tokens;          /* context capacity S of a row (>= 1) */
    int max_anchors;         /* blocks per row (static; >= 1) */
    int block_size;          /* bs >= 2 (drafter config) */
    int64_t mask_token_id;   /* drafter config; 0 <= id < 2^31 */
    int64_t vocab_size;      /* ids must be < this; 0 = unchecked */
    int hidden_size;         /* H */
    int n_features;          /* K */
    df_dtype dtype;          /* element type of doc.layers (cache params.dtype) */
    double gamma;            /* weight decay over k; <= 0 = 7 */
    float noise;             /* uniform feature noise amplitude; 0 = off */
    float *features;         /* caller's [max_tokens * K * H] buffer, or NULL */
    df_dtype out_dtype;      /* the row's features: F32 (0 = F32) or BF16 (a GPU trainer
                                uploads half the bytes; bf16 sources are copied bit for bit
                                when noise is 0, else widened, noised and rounded RNE) */
    uint16_t *features_bf16; /* caller's [max_tokens * K * H] buffer for BF16, or NULL */
} df_batch_config;

/* One document as the builder reads it (only during df_batch_add). */
typedef struct df_batch_doc {
    uint64_t id;                  /* informative (row.doc_id) */
    uint32_t n_tokens;
    const uint32_t *ids;
    const uint8_t *loss_mask;     /* NULL = all ones */
    const void *layers[DF_BATCH_MAX_FEATURES]; /* [n_tokens x H] each, drafter order */
} df_batch_doc;

typedef struct df_batch_row {
    /* context */
    int n_tokens, n_docs;
    int64_t truncated;            /* tokens dropped by truncation in this row */
    int n_loss_tokens;            /* context tokens with loss_mask 1 */
    int n_candidates;             /* anchor candidates in the row */
    float *features;              /* [max_tokens, K*H] (out_dtype F32; else NULL) */
    uint16_t *features_bf16;      /* [max_tokens, K*H] (out_dtype BF16; else NULL) */
    int32_t *ids;                 /* [max_tokens] context token ids */
    uint8_t *loss_mask;           /* [max_tokens] */
    int32_t *pos;                 /* [max_tokens] */
    int32_t *ctx_doc_start;       /* [max_tokens] */
    int32_t *doc_offset;          /* [max_tokens + 1], n_docs + 1 used */
    uint64_t *doc_id;             /* [max_tokens], n_docs used */
    /* blocks: n_blocks = max_anchors, block_size = bs */
    int n_blocks, block_size, n_valid;
    int32_t *anchor, *doc_start;  /* [n_blocks] context indices */
    uint8_t *valid;               /* [n_blocks] */
    int32_t *block_ids, *block_pos, *labels; /* [n_blocks * bs] */
    float *weights;               /* [n_blocks * bs] */
    double weight_sum;
    int n_weighted;               /* block positions with weight > 0 */
    df_dflash_blocks blocks;      /* view of the above, window 0 */
} df_batch_row;

typedef struct df_batch df_batch;

df_batch *df_batch_create(const df_batch_config *c, df_err *e);
void df_batch_free(df_batch *b);
void df_batch_reset(df_batch *b);
/* 1 added, 0 does not fit (row not empty; nothing changed, no RNG drawn),
 * <0 error (-EINVAL: bad document or the row is finished; nothing changed). */
int df_batch_add(df_batch *b, const df_batch_doc *d, df_rng *rng, df_err *e);
/* Samples anchors and fills the blocks; -EINVAL if already finished. */
int df_batch_finish(df_batch *b, df_rng *rng, df_err *e);
/* Of a finished row: every anchor candidate in ascending order. Writes the
 * first min(n, cap) into out; returns n (-EINVAL if the row is not finished). */
int df_batch_candidates(const df_batch *b, int32_t *out, int cap);
/* Of a finished row: the blocks rebuilt for these anchors instead of the
 * sampled ones (strictly ascending candidates, n <= max_anchors; the rest
 * padding), as df_batch_finish builds them; no RNG drawn. The evaluation
 * uses it to score every candidate of a row, max_anchors at a time.
 * -EINVAL (nothing changed) on a bad list or a row not finished. */
int df_batch_set_anchors(df_batch *b, const int32_t *anchors, int n, df_err *e);
/* The row (complete only after df_batch_finish). */
const df_batch_row *df_batch_get_row(const df_batch *b);
const df_batch_config *df_batch_get_config(const df_batch *b);

/* ---- cache glue ---- */

/* Maps the drafter's target_layer_ids[K] onto the cache's layers:
 * cache_index[k] = i with params.layer_ids[i] == target_layer_ids[k], and
 * *layer_mask (for df_cache_stream_opts) selects exactly those.
 * -DF_EMISMATCH naming the first id the cache lacks. A projected cache
 * (cache.h) stores one feature, z, made from its source layers jointly: the
 * ids must be exactly those, in order; then cache_index[0] = 0, mask 1, and
 * the rows hold one feature of proj_rank values per token. */
int df_batch_map_layers(const df_cache_params *p, const int *target_layer_ids, int K,
                        int *cache_index, uint64_t *layer_mask, df_err *e);
/* A stream item as a document, layers in drafter order. */
void df_batch_doc_from_item(const df_cache_item *it, const int *cache_index, int K,
                            df_batch_doc *d);

#endif
