/* batch.c - packed training rows for the DFlash drafter (see batch.h). */
#include "batch.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "le.h"

/* ---- RNG: xoshiro256** (Blackman & Vigna), seeded by splitmix64 ---- */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

void df_rng_seed(df_rng *r, uint64_t seed, uint64_t stream)
{
    uint64_t x = seed;
    uint64_t mix = splitmix64(&x);
    x = mix ^ (stream * 0xd1b54a32d192ed03ull + 0x8cb92ba72f3d8dd7ull);
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&x);
    if (!(r->s[0] | r->s[1] | r->s[2] | r->s[3]))
        r->s[0] = 1;
}

uint64_t df_rng_next(df_rng *r)
{
    uint64_t *s = r->s;
    uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

uint64_t df_rng_below(df_rng *r, uint64_t n)
{
    if (n <= 1)
        return 0;
    /* Rejection on the top of the range: unbiased, deterministic. */
    uint64_t lim = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do
        x = df_rng_next(r);
    while (x >= lim);
    return x % n;
}

float df_rng_float(df_rng *r) { return (float)(df_rng_next(r) >> 40) * 0x1p-24f; }

void df_rng_save(const df_rng *r, uint8_t out[32])
{
    for (int i = 0; i < 4; i++)
        df_put64(out + 8 * i, r->s[i]);
}

int df_rng_load(df_rng *r, const uint8_t in[32], df_err *e)
{
    df_rng t;
    for (int i = 0; i < 4; i++)
        t.s[i] = df_le64(in + 8 * i);
    if (!(t.s[0] | t.s[1] | t.s[2] | t.s[3]))
        return df_errf(e, -EINVAL, "rng state is all zeros (not a saved state)");
    *r = t;
    return 0;
}

/* ---- builder ---- */

struct df_batch {
    df_batch_config c;
    df_batch_row row;
    size_t width;              /* K * H */
    int finished;
    int dirty;                 /* feature rows [0, dirty) may be non-zero */
    float *own_features;
    uint16_t *own_features_bf16;
    float *conv;               /* [H] scratch: one feature row widened (BF16 output with noise) */
    int32_t *cand;             /* [max_tokens] candidate context indices */
    uint8_t *chosen;           /* [max_tokens] scratch for the sorted sweep */
    float *kw;                 /* [bs] exp(-(k-1)/gamma), kw[0] = 0 */
};

static void row_clear_context(df_batch *b)
{
    df_batch_row *r = &b->row;
    r->n_tokens = r->n_docs = 0;
    r->truncated = 0;
    r->n_loss_tokens = r->n_candidates = 0;
    r->doc_offset[0] = 0;
    r->n_valid = 0;
    r->weight_sum = 0;
    r->n_weighted = 0;
    b->finished = 0;
}

void df_batch_free(df_batch *b)
{
    if (!b)
        return;
    df_batch_row *r = &b->row;
    free(b->own_features);
    free(b->own_features_bf16);
    free(b->conv);
    free(r->ids);
    free(r->loss_mask);
    free(r->pos);
    free(r->ctx_doc_start);
    free(r->doc_offset);
    free(r->doc_id);
    free(r->anchor);
    free(r->doc_start);
    free(r->valid);
    free(r->block_ids);
    free(r->block_pos);
    free(r->labels);
    free(r->weights);
    free(b->cand);
    free(b->chosen);
    free(b->kw);
    free(b);
}

df_batch *df_batch_create(const df_batch_config *c, df_err *e)
{
    if (c->max_tokens < 1 || c->max_anchors < 1 || c->block_size < 2 || c->hidden_size < 1 ||
        c->n_features < 1 || c->n_features > DF_BATCH_MAX_FEATURES) {
        df_errf(e, -EINVAL,
                "batch config: need max_tokens, max_anchors >= 1, block_size >= 2, "
                "hidden_size >= 1, 1 <= n_features <= %d (got %d, %d, %d, %d, %d)",
                DF_BATCH_MAX_FEATURES, c->max_tokens, c->max_anchors, c->block_size,
                c->hidden_size, c->n_features);
        return NULL;
    }
    if (c->mask_token_id < 0 || c->mask_token_id > INT32_MAX ||
        (c->vocab_size > 0 && c->mask_token_id >= c->vocab_size)) {
        df_errf(e, -EINVAL, "batch config: mask_token_id %" PRId64 " out of range (vocab %" PRId64 ")",
                c->mask_token_id, c->vocab_size);
        return NULL;
    }
    if (c->dtype != DF_DTYPE_BF16 && c->dtype != DF_DTYPE_F16 && c->dtype != DF_DTYPE_F32) {
        df_errf(e, -EINVAL, "batch config: feature dtype %s not BF16/F16/F32",
                df_dtype_name(c->dtype));
        return NULL;
    }
    if (c->out_dtype != DF_DTYPE_INVALID && c->out_dtype != DF_DTYPE_F32 &&
        c->out_dtype != DF_DTYPE_BF16) {
        df_errf(e, -EINVAL, "batch config: row features can be F32 or BF16, not %s",
                df_dtype_name(c->out_dtype));
        return NULL;
    }
    if (!(c->noise >= 0) || !isfinite(c->noise)) {
        df_errf(e, -EINVAL, "batch config: noise %g must be finite and >= 0", (double)c->noise);
        return NULL;
    }
    if ((int64_t)c->max_anchors * c->block_size > INT32_MAX) {
        df_errf(e, -EINVAL, "batch config: max_anchors x block_size too large");
        return NULL;
    }
    df_batch *b = calloc(1, sizeof *b);
    if (!b) {
        df_errf(e, -ENOMEM, "out of memory");
        return NULL;
    }
    b->c = *c;
    if (!(b->c.gamma > 0))
        b->c.gamma = 7.0;
    b->width = (size_t)c->n_features * (size_t)c->hidden_size;
    size_t S = (size_t)c->max_tokens, NB = (size_t)c->max_anchors,
           NT = NB * (size_t)c->block_size;
    df_batch_row *r = &b->row;
    int bf16 = c->out_dtype == DF_DTYPE_BF16;
    if (b->width > SIZE_MAX / sizeof(float) / S)
        goto oom;
    if (bf16) {
        r->features_bf16 = c->features_bf16 ? c->features_bf16
                                            : (b->own_features_bf16 = calloc(S * b->width, 2));
        b->conv = malloc((size_t)c->hidden_size * sizeof(float));
        if (!b->conv)
            goto oom;
    } else if (c->features) {
        r->features = c->features;
    } else {
        r->features = b->own_features = calloc(S * b->width, sizeof(float));
    }
    r->ids = calloc(S, sizeof *r->ids);
    r->loss_mask = calloc(S, 1);
    r->pos = calloc(S, sizeof *r->pos);
    r->ctx_doc_start = calloc(S, sizeof *r->ctx_doc_start);
    r->doc_offset = calloc(S + 1, sizeof *r->doc_offset);
    r->doc_id = calloc(S, sizeof *r->doc_id);
    r->anchor = calloc(NB, sizeof *r->anchor);
    r->doc_start = calloc(NB, sizeof *r->doc_start);
    r->valid = calloc(NB, 1);
    r->block_ids = calloc(NT, sizeof *r->block_ids);
    r->block_pos = calloc(NT, sizeof *r->block_pos);
    r->labels = calloc(NT, sizeof *r->labels);
    r->weights = calloc(NT, sizeof *r->weights);
    b->cand = calloc(S, sizeof *b->cand);
    b->chosen = calloc(S, 1);
    b->kw = calloc((size_t)c->block_size, sizeof *b->kw);
    if ((bf16 ? !r->features_bf16 : !r->features) || !r->ids || !r->loss_mask || !r->pos || !r->ctx_doc_start ||
        !r->doc_offset || !r->doc_id || !r->anchor || !r->doc_start || !r->valid ||
        !r->block_ids || !r->block_pos || !r->labels || !r->weights || !b->cand || !b->chosen ||
        !b->kw)
        goto oom;
    /* The caller's buffer has unknown contents: all of it is dirty. */
    b->dirty = (bf16 ? c->features_bf16 != NULL : c->features != NULL) ? c->max_tokens : 0;
    b->kw[0] = 0.0f;
    for (int k = 1; k < c->block_size; k++)
        b->kw[k] = (float)exp(-(double)(k - 1) / b->c.gamma);
    r->n_blocks = c->max_anchors;
    r->block_size = c->block_size;
    r->blocks = (df_dflash_blocks){.n_blocks = c->max_anchors,
                                   .block_size = c->block_size,
                                   .anchor = r->anchor,
                                   .doc_start = r->doc_start,
                                   .valid = r->valid,
                                   .window = 0};
    row_clear_context(b);
    return b;
oom:
    df_batch_free(b);
    df_errf(e, -ENOMEM, "batch: out of memory (max_tokens %d x %zu features)", c->max_tokens,
            (size_t)c->n_features * (size_t)c->hidden_size);
    return NULL;
}

void df_batch_reset(df_batch *b) { row_clear_context(b); }

const df_batch_row *df_batch_get_row(const df_batch *b) { return &b->row; }
const df_batch_config *df_batch_get_config(const df_batch *b) { return &b->c; }

/* dst[0..H) = src row (type t) + noise. */
static void convert_row(float *dst, const void *src, size_t H, df_dtype t, float noise,
                        df_rng *rng)
{
    if (t == DF_DTYPE_BF16) {
        const uint8_t *s = src;
        for (size_t i = 0; i < H; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = df_bf16_to_f32(h);
        }
    } else if (t == DF_DTYPE_F32) {
        memcpy(dst, src, H * sizeof(float));
    } else {
        const uint8_t *s = src;
        for (size_t i = 0; i < H; i++)
            dst[i] = df_elem_to_f32(s + 2 * i, t);
    }
    if (noise > 0) {
        /* Two 24-bit uniforms per 64-bit draw; d in [-noise, noise). */
        size_t i = 0;
        for (; i + 1 < H; i += 2) {
            uint64_t x = df_rng_next(rng);
            float u0 = (float)(x >> 40) * 0x1p-24f, u1 = (float)((x >> 16) & 0xffffff) * 0x1p-24f;
            dst[i] += noise * (2.0f * u0 - 1.0f);
            dst[i + 1] += noise * (2.0f * u1 - 1.0f);
        }
        if (i < H)
            dst[i] += noise * (2.0f * df_rng_float(rng) - 1.0f);
    }
}

/* An anchor candidate: p and p + 1 in the row's context, in one document and
 * in the loss (the one rule: df_batch_add collects them, the evaluation
 * lists them again after the sampling has permuted b->cand). */
static int is_candidate(const df_batch_row *r, int p)
{
    return p >= 0 && p + 1 < r->n_tokens && r->loss_mask[p] && r->loss_mask[p + 1] &&
           r->ctx_doc_start[p + 1] == r->ctx_doc_start[p];
}

int df_batch_add(df_batch *b, const df_batch_doc *d, df_rng *rng, df_err *e)
{
    const df_batch_config *c = &b->c;
    df_batch_row *r = &b->row;
    if (b->finished)
        return df_errf(e, -EINVAL, "batch: add to a finished row (call df_batch_reset first)");
    if (d->n_tokens == 0)
        return 1;
    if (!d->ids)
        return df_errf(e, -EINVAL, "batch: document %" PRIu64 " has no ids", d->id);
    for (int k = 0; k < c->n_features; k++)
        if (!d->layers[k])
            return df_errf(e, -EINVAL, "batch: document %" PRIu64 " lacks feature %d", d->id, k);
    if (c->noise > 0 && !rng)
        return df_errf(e, -EINVAL, "batch: noise needs an rng");
    int room = c->max_tokens - r->n_tokens;
    uint32_t n = d->n_tokens;
    if (n > (uint32_t)room) {
        if (r->n_tokens > 0)
            return 0;
        n = (uint32_t)c->max_tokens;  /* a row of its own, truncated */
    }
    for (uint32_t i = 0; i < n; i++)
        if (d->ids[i] > INT32_MAX || (c->vocab_size > 0 && d->ids[i] >= (uint64_t)c->vocab_size))
            return df_errf(e, -EINVAL,
                           "batch: document %" PRIu64 " token %u: id %u out of range (vocab %" PRId64
                           ")",
                           d->id, i, d->ids[i], c->vocab_size);

    int s0 = r->n_tokens;
    size_t H = (size_t)c->hidden_size;
    size_t esz = df_dtype_size(c->dtype);
    for (uint32_t i = 0; i < n; i++) {
        int t = s0 + (int)i;
        r->ids[t] = (int32_t)d->ids[i];
        r->loss_mask[t] = d->loss_mask ? (d->loss_mask[i] != 0) : 1;
        r->pos[t] = (int32_t)i;
        r->ctx_doc_start[t] = s0;
        r->n_loss_tokens += r->loss_mask[t];
        for (int k = 0; k < c->n_features; k++) {
            const uint8_t *src = (const uint8_t *)d->layers[k] + (size_t)i * H * esz;
            if (!r->features_bf16) {
                convert_row(r->features + (size_t)t * b->width + (size_t)k * H, src, H, c->dtype,
                            c->noise, rng);
                continue;
            }
            uint16_t *dst = r->features_bf16 + (size_t)t * b->width + (size_t)k * H;
            if (c->dtype == DF_DTYPE_BF16 && c->noise == 0) {
                memcpy(dst, src, H * 2); /* the cache's bits, untouched */
            } else {
                convert_row(b->conv, src, H, c->dtype, c->noise, rng);
                for (size_t j = 0; j < H; j++)
                    dst[j] = df_f32_to_bf16(b->conv[j]);
            }
        }
    }
    r->truncated += (int64_t)d->n_tokens - n;
    r->doc_id[r->n_docs] = d->id;
    r->n_tokens = s0 + (int)n;
    /* this document's candidates (within the truncated document) */
    for (int p = s0; p < r->n_tokens; p++)
        if (is_candidate(r, p))
            b->cand[r->n_candidates++] = p;
    r->doc_offset[++r->n_docs] = r->n_tokens;
    return 1;
}

/* The blocks of anchors r->anchor[0 .. m) (ascending candidates; the rest
 * padding): ids, positions, labels, weights, and their sums. */
static void build_blocks(df_batch *b, int m)
{
    const df_batch_config *c = &b->c;
    df_batch_row *r = &b->row;
    int bs = c->block_size;
    int32_t mask_id = (int32_t)c->mask_token_id;
    double wsum = 0;
    int nw = 0;
    for (int blk = 0; blk < c->max_anchors; blk++) {
        int32_t *bid = r->block_ids + (size_t)blk * bs, *bpos = r->block_pos + (size_t)blk * bs,
                *lab = r->labels + (size_t)blk * bs;
        float *wt = r->weights + (size_t)blk * bs;
        if (blk >= m) {
            r->anchor[blk] = 0;
            r->doc_start[blk] = 0;
            r->valid[blk] = 0;
            for (int k = 0; k < bs; k++) {
                bid[k] = mask_id;
                bpos[k] = k;
                lab[k] = -1;
                wt[k] = 0.0f;
            }
            continue;
        }
        int p = r->anchor[blk], d0 = r->ctx_doc_start[p];
        int d1 = d0;  /* document end: the next doc_offset past p */
        {
            int lo = 0, hi = r->n_docs;  /* doc_offset[lo] <= p < doc_offset[hi] */
            while (hi - lo > 1) {
                int mid = (lo + hi) / 2;
                if (r->doc_offset[mid] <= p)
                    lo = mid;
                else
                    hi = mid;
            }
            d1 = r->doc_offset[hi];
        }
        r->doc_start[blk] = d0;
        r->valid[blk] = 1;
        bid[0] = r->ids[p];
        bpos[0] = r->pos[p];
        lab[0] = -1;
        wt[0] = 0.0f;
        for (int k = 1; k < bs; k++) {
            bid[k] = mask_id;
            bpos[k] = r->pos[p] + k;
            if (p + k < d1) {
                lab[k] = r->ids[p + k];
                wt[k] = r->loss_mask[p + k] ? b->kw[k] : 0.0f;
            } else {
                lab[k] = -1;
                wt[k] = 0.0f;
            }
            if (wt[k] > 0) {
                wsum += wt[k];
                nw++;
            }
        }
    }
    r->n_valid = m;
    r->weight_sum = wsum;
    r->n_weighted = nw;
}

int df_batch_finish(df_batch *b, df_rng *rng, df_err *e)
{
    const df_batch_config *c = &b->c;
    df_batch_row *r = &b->row;
    if (b->finished)
        return df_errf(e, -EINVAL, "batch: row already finished");
    int S = r->n_tokens;

    /* Padding of the context. */
    if (b->dirty > S) {
        size_t n = (size_t)(b->dirty - S) * b->width;
        if (r->features_bf16)
            memset(r->features_bf16 + (size_t)S * b->width, 0, n * 2);
        else
            memset(r->features + (size_t)S * b->width, 0, n * sizeof(float));
    }
    b->dirty = S;
    for (int t = S; t < c->max_tokens; t++) {
        r->ids[t] = 0;
        r->loss_mask[t] = 0;
        r->pos[t] = 0;
        r->ctx_doc_start[t] = S;
    }

    /* Anchors: partial Fisher-Yates over the row's candidates, then an
     * ascending sweep. */
    int nc = r->n_candidates, m = nc < c->max_anchors ? nc : c->max_anchors;
    if (m > 0 && m < nc && !rng)
        return df_errf(e, -EINVAL, "batch: anchor sampling needs an rng");
    if (m < nc) {
        for (int i = 0; i < m; i++) {
            int j = i + (int)df_rng_below(rng, (uint64_t)(nc - i));
            int32_t t = b->cand[i];
            b->cand[i] = b->cand[j];
            b->cand[j] = t;
        }
        for (int i = 0; i < m; i++)
            b->chosen[b->cand[i]] = 1;
        int w = 0;
        for (int t = 0; t < S && w < m; t++)
            if (b->chosen[t]) {
                b->chosen[t] = 0;
                r->anchor[w++] = t;
            }
    } else {
        /* Every candidate is taken: already ascending. */
        memcpy(r->anchor, b->cand, (size_t)m * sizeof *r->anchor);
    }

    build_blocks(b, m);
    b->finished = 1;
    return 0;
}

int df_batch_candidates(const df_batch *b, int32_t *out, int cap)
{
    const df_batch_row *r = &b->row;
    if (!b->finished)
        return -EINVAL;
    int n = 0;
    for (int p = 0; p + 1 < r->n_tokens; p++)
        if (is_candidate(r, p)) {
            if (n < cap)
                out[n] = p;
            n++;
        }
    return n;
}

int df_batch_set_anchors(df_batch *b, const int32_t *anchors, int n, df_err *e)
{
    df_batch_row *r = &b->row;
    if (!b->finished)
        return df_errf(e, -EINVAL, "batch: set_anchors needs a finished row");
    if (n < 0 || n > b->c.max_anchors)
        return df_errf(e, -EINVAL, "batch: %d anchors (0..%d)", n, b->c.max_anchors);
    for (int i = 0; i < n; i++) {
        if (!is_candidate(r, anchors[i]))
            return df_errf(e, -EINVAL, "batch: anchor %d (position %d) is not a candidate", i,
                           anchors[i]);
        if (i > 0 && anchors[i] <= anchors[i - 1])
            return df_errf(e, -EINVAL, "batch: anchors not strictly ascending at %d", i);
    }
    if (n > 0) /* anchors may be NULL when n is 0 */
        memmove(r->anchor, anchors, (size_t)n * sizeof *anchors);
    build_blocks(b, n);
    return 0;
}

/* ---- cache glue ---- */

int df_batch_map_layers(const df_cache_params *p, const int *target_layer_ids, int K,
                        int *cache_index, uint64_t *layer_mask, df_err *e)
{
    if (K < 1 || K > DF_BATCH_MAX_FEATURES)
        return df_errf(e, -EINVAL, "batch: %d target layers (1..%d)", K, DF_BATCH_MAX_FEATURES);
    uint64_t mask = 0;
    if (p->proj_rank) { /* one stored feature, z, made from exactly these layers in this order */
        if ((uint32_t)K != p->src_n_layers ||
            memcmp(target_layer_ids, p->src_layer_ids, (size_t)K * sizeof *target_layer_ids))
            return df_errf(e, -DF_EMISMATCH, "the cache is projected from %u layers (first %d); "
                           "the drafter wants %d (first %d): a projection reads all its layers",
                           p->src_n_layers, p->src_layer_ids[0], K, target_layer_ids[0]);
        cache_index[0] = 0;
        if (layer_mask)
            *layer_mask = 1;
        return 0;
    }
    for (int k = 0; k < K; k++) {
        int found = -1;
        for (uint32_t i = 0; i < p->n_layers && i < DF_CACHE_MAX_LAYERS; i++)
            if (p->layer_ids[i] == target_layer_ids[k]) {
                found = (int)i;
                break;
            }
        if (found < 0)
            return df_errf(e, -DF_EMISMATCH,
                           "drafter target layer %d (target_layer_ids[%d]) is not in the cache",
                           target_layer_ids[k], k);
        cache_index[k] = found;
        mask |= 1ull << found;
    }
    if (layer_mask)
        *layer_mask = mask;
    return 0;
}

void df_batch_doc_from_item(const df_cache_item *it, const int *cache_index, int K,
                            df_batch_doc *d)
{
    memset(d, 0, sizeof *d);
    d->id = it->id;
    d->n_tokens = it->n_tokens;
    d->ids = it->ids;
    d->loss_mask = it->loss_mask;
    for (int k = 0; k < K && k < DF_BATCH_MAX_FEATURES; k++)
        d->layers[k] = it->layers[cache_index[k]];
}
