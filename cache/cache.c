/* cache.c - the hidden-state cache format (docs/FORMAT.md) and its
 * synchronous reader. Every field read from disk is checked before use. */
#include "cache.h"
#include "cache_internal.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32c.h"
#include "fsutil.h"
#include "le.h"

#define RECORD_MAGIC 0x52534644u /* "DFSR" */
static const char SHARD_MAGIC[8] = {'D', 'F', 'C', 'S', 'H', 'A', 'R', 'D'};
static const char INDEX_MAGIC[8] = {'D', 'F', 'C', 'I', 'N', 'D', 'E', 'X'};
#define FLAG_HAS_MASK 1u
#define BLOCK_ALIGN 64u
#define DEFAULT_BLOCK_RAW (1u << 20)
#define MAX_BLOCK_RAW (64u << 20)

static inline uint64_t align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

static size_t row_bytes(const df_cache_params *p)
{
    return (size_t)p->hidden_size * df_dtype_size(p->dtype);
}

static uint32_t blocks_per_layer(const df_cache_params *p, uint32_t n_tokens)
{
    return (n_tokens + p->rows_per_block - 1) / p->rows_per_block;
}

/* ------------------------------------------------------------ params */

int df_cache_params_finish(df_cache_params *p, df_err *e)
{
    if (p->dtype != DF_DTYPE_BF16 && p->dtype != DF_DTYPE_F16 && p->dtype != DF_DTYPE_F32)
        return df_errf(e, -EINVAL, "cache dtype %s not supported (BF16, F16, F32)",
                       df_dtype_name(p->dtype));
    if (p->hidden_size == 0 || p->hidden_size > DF_CACHE_MAX_HIDDEN)
        return df_errf(e, -EINVAL, "cache hidden_size %u out of range", p->hidden_size);
    if (p->n_layers == 0 || p->n_layers > DF_CACHE_MAX_LAYERS)
        return df_errf(e, -EINVAL, "cache holds %u layers; 1..%d supported", p->n_layers,
                       DF_CACHE_MAX_LAYERS);
    const int32_t *ids;
    uint32_t nids = df_cache_target_layers(p, &ids);
    if (p->proj_rank) {
        if (p->n_layers != 1 || p->layer_ids[0] != DF_CACHE_PROJECTED_LAYER ||
            p->hidden_size != p->proj_rank)
            return df_errf(e, -EINVAL, "projected cache: want 1 stored layer of rank %u values",
                           p->proj_rank);
        if (p->src_hidden == 0 || p->src_hidden > DF_CACHE_MAX_HIDDEN || nids == 0 ||
            nids > DF_CACHE_MAX_LAYERS)
            return df_errf(e, -EINVAL, "projected cache: source of %u layers x %u out of range",
                           nids, p->src_hidden);
        if ((uint64_t)p->proj_rank > (uint64_t)nids * p->src_hidden)
            return df_errf(e, -EINVAL, "projection rank %u exceeds the %u source dimensions",
                           p->proj_rank, nids * p->src_hidden);
        if (strlen(p->basis_sha256) != 64 || strspn(p->basis_sha256, "0123456789abcdef") != 64)
            return df_errf(e, -EINVAL, "projected cache: basis sha256 \"%s\" is not 64 hex digits",
                           p->basis_sha256);
    }
    for (uint32_t i = 0; i < nids; i++) {
        if (ids[i] < 0 || (p->num_target_layers && (uint32_t)ids[i] >= p->num_target_layers))
            return df_errf(e, -EINVAL, "layer id %d out of range for a %u-layer target", ids[i],
                           p->num_target_layers);
        for (uint32_t j = 0; j < i; j++)
            if (ids[j] == ids[i])
                return df_errf(e, -EINVAL, "layer id %d listed twice", ids[i]);
    }
    if (p->codec < 0 || p->codec >= DF_CODEC_COUNT)
        return df_errf(e, -EINVAL, "unknown codec id %d", p->codec);
    size_t rb = row_bytes(p);
    if (p->rows_per_block == 0)
        p->rows_per_block = (uint32_t)(DEFAULT_BLOCK_RAW / rb > 0 ? DEFAULT_BLOCK_RAW / rb : 1);
    if ((uint64_t)p->rows_per_block * rb > MAX_BLOCK_RAW)
        return df_errf(e, -EINVAL, "rows_per_block %u x %zu bytes exceeds the %u MiB block limit",
                       p->rows_per_block, rb, MAX_BLOCK_RAW >> 20);
    if (p->shard_bytes == 0)
        p->shard_bytes = 4ull << 30;
    if (p->world_size == 0)
        p->world_size = 1;
    return 0;
}

int df_cache_params_compatible(const df_cache_params *a, const df_cache_params *b, df_err *e)
{
#define DIFF(cond, ...) \
    if (cond)           \
    return df_errf(e, -DF_EMISMATCH, __VA_ARGS__)
    DIFF(strcmp(a->model_type, b->model_type), "cache is for model_type %s, not %s",
         a->model_type, b->model_type);
    DIFF(strcmp(a->config_sha256, b->config_sha256),
         "cache is for another target config (sha256 %.12s..., not %.12s...)", a->config_sha256,
         b->config_sha256);
    DIFF(a->hidden_size != b->hidden_size, "cache hidden_size %u, not %u", a->hidden_size,
         b->hidden_size);
    DIFF(a->n_layers != b->n_layers || memcmp(a->layer_ids, b->layer_ids, a->n_layers * 4),
         "cache holds other layers (%u layers, first %d)", a->n_layers, a->layer_ids[0]);
    DIFF(a->dtype != b->dtype, "cache dtype %s, not %s", df_dtype_name(a->dtype),
         df_dtype_name(b->dtype));
    DIFF(a->codec != b->codec || a->codec_level != b->codec_level,
         "cache codec %s level %d, not %s level %d", df_codec_name(a->codec), a->codec_level,
         df_codec_name(b->codec), b->codec_level);
    DIFF(a->rows_per_block != b->rows_per_block, "cache rows_per_block %u, not %u",
         a->rows_per_block, b->rows_per_block);
    DIFF(a->shard_bytes != b->shard_bytes, "cache shard_bytes %" PRIu64 ", not %" PRIu64,
         a->shard_bytes, b->shard_bytes);
    DIFF(strcmp(a->corpus_fingerprint, b->corpus_fingerprint),
         "cache was made from another corpus (%.12s..., not %.12s...)", a->corpus_fingerprint,
         b->corpus_fingerprint);
    DIFF(a->world_size != b->world_size, "cache was written by %u ranks, not %u", a->world_size,
         b->world_size);
    DIFF(a->proj_rank != b->proj_rank, "cache projection rank %u, not %u", a->proj_rank,
         b->proj_rank);
    DIFF(a->proj_rank && (a->src_hidden != b->src_hidden || a->src_n_layers != b->src_n_layers ||
                          memcmp(a->src_layer_ids, b->src_layer_ids, a->src_n_layers * 4)),
         "projected cache of other source layers");
    DIFF(a->proj_rank && strcmp(a->basis_sha256, b->basis_sha256),
         "projected cache with another basis (sha256 %.12s..., not %.12s...)", a->basis_sha256,
         b->basis_sha256);
#undef DIFF
    return 0;
}

/* ------------------------------------------------------------ records */

size_t df_cache_record_bound(const df_cache_params *p, uint32_t n_tokens)
{
    uint32_t bpl = blocks_per_layer(p, n_tokens);
    size_t nb = (size_t)bpl * p->n_layers;
    size_t sz = align_up(DF_CACHE_RECORD_HEADER + nb * DF_CACHE_BLOCK_ENTRY, BLOCK_ALIGN);
    sz = align_up(sz + (size_t)n_tokens * 5, BLOCK_ALIGN);
    size_t rb = row_bytes(p);
    for (uint32_t b = 0; b < bpl; b++) {
        uint32_t rows = n_tokens - b * p->rows_per_block;
        if (rows > p->rows_per_block)
            rows = p->rows_per_block;
        df_codec_params cp = {p->dtype, p->hidden_size, p->codec_level};
        sz += p->n_layers * align_up(df_codec_bound(p->codec, rows * rb, &cp), BLOCK_ALIGN);
    }
    return align_up(sz, DF_CACHE_ALIGN);
}

int df_cache_record_encode(const df_cache_params *p, const df_cache_sample *s,
                           df_codec_ctx *ctx, uint8_t *dst, size_t cap, size_t *len,
                           uint64_t *layer_raw, uint64_t *layer_stored, df_err *e)
{
    if (s->n_tokens > DF_CACHE_MAX_TOKENS)
        return df_errf(e, -EINVAL, "sample %" PRIu64 ": %u tokens, more than the %u supported",
                       s->id, s->n_tokens, DF_CACHE_MAX_TOKENS);
    if (cap < df_cache_record_bound(p, s->n_tokens))
        return df_errf(e, -ENOSPC, "sample %" PRIu64 ": record buffer too small", s->id);
    const uint32_t n = s->n_tokens, bpl = blocks_per_layer(p, n);
    const uint32_t nb = bpl * p->n_layers;
    const size_t rb = row_bytes(p);
    const uint32_t has_mask = s->loss_mask != NULL;
    uint8_t *table = dst + DF_CACHE_RECORD_HEADER;
    uint64_t tok_off = align_up(DF_CACHE_RECORD_HEADER + (uint64_t)nb * DF_CACHE_BLOCK_ENTRY,
                                BLOCK_ALIGN);
    memset(dst, 0, tok_off);
    /* Token section: ids as u32 LE, then one byte of mask per token. */
    uint8_t *tp = dst + tok_off;
    for (uint32_t i = 0; i < n; i++)
        df_put32(tp + 4 * (size_t)i, s->ids[i]);
    size_t tok_len = (size_t)n * 4;
    if (has_mask) {
        for (uint32_t i = 0; i < n; i++)
            tp[tok_len + i] = s->loss_mask[i] ? 1 : 0;
        tok_len += n;
    }
    uint32_t tok_crc = df_crc32c(0, tp, tok_len);
    uint64_t off = align_up(tok_off + tok_len, BLOCK_ALIGN);
    memset(tp + tok_len, 0, off - tok_off - tok_len);

    df_codec_params cp = {p->dtype, p->hidden_size, p->codec_level};
    for (uint32_t l = 0; l < p->n_layers; l++) {
        const uint8_t *src = s->layers[l];
        for (uint32_t b = 0; b < bpl; b++) {
            uint32_t first = b * p->rows_per_block;
            uint32_t rows = n - first < p->rows_per_block ? n - first : p->rows_per_block;
            size_t raw = (size_t)rows * rb, out = 0;
            int used = df_codec_encode(ctx, p->codec, &cp, src + (size_t)first * rb, raw,
                                       dst + off, cap - off, &out, e);
            if (used < 0)
                return df_err_wrap(e, "sample %" PRIu64 " layer %d block %u", s->id,
                                   p->layer_ids[l], b);
            uint8_t *ent = table + (size_t)(l * bpl + b) * DF_CACHE_BLOCK_ENTRY;
            df_put64(ent + 0, off);
            df_put32(ent + 8, (uint32_t)out);
            df_put32(ent + 12, (uint32_t)raw);
            df_put32(ent + 16, df_crc32c(0, dst + off, out));
            df_put32(ent + 20, first);
            df_put32(ent + 24, rows);
            df_put16(ent + 28, (uint16_t)l);
            ent[30] = (uint8_t)used;
            ent[31] = 0;
            if (layer_raw)
                layer_raw[l] += raw;
            if (layer_stored)
                layer_stored[l] += out;
            uint64_t next = align_up(off + out, BLOCK_ALIGN);
            memset(dst + off + out, 0, next - off - out);
            off = next;
        }
    }
    uint64_t payload_end = off;
    uint64_t total = align_up(payload_end ? payload_end : 1, DF_CACHE_ALIGN);
    memset(dst + payload_end, 0, total - payload_end);

    uint8_t *h = dst;
    df_put32(h + 0, RECORD_MAGIC);
    df_put16(h + 4, DF_CACHE_VERSION);
    df_put16(h + 6, (uint16_t)(has_mask ? FLAG_HAS_MASK : 0));
    df_put64(h + 8, s->id);
    df_put64(h + 16, total);
    df_put32(h + 24, n);
    df_put32(h + 28, nb);
    df_put16(h + 32, (uint16_t)p->n_layers);
    df_put16(h + 34, 0);
    df_put32(h + 36, p->rows_per_block);
    df_put32(h + 40, (uint32_t)tok_off);
    df_put32(h + 44, tok_crc);
    df_put64(h + 48, payload_end);
    df_put32(h + 56, 0);
    uint32_t crc = df_crc32c(0, h, 60);
    crc = df_crc32c(crc, table, (size_t)nb * DF_CACHE_BLOCK_ENTRY);
    df_put32(h + 60, crc);
    *len = total;
    return 0;
}

int df_cache_record_parse(const df_cache_params *p, const uint8_t *buf, size_t len,
                          df_cache_record *r, df_err *e)
{
    memset(r, 0, sizeof *r);
    if (len < DF_CACHE_RECORD_HEADER)
        return df_errf(e, -DF_ECORRUPT, "record truncated: %zu bytes, header needs %u", len,
                       DF_CACHE_RECORD_HEADER);
    if (df_le32(buf) != RECORD_MAGIC)
        return df_errf(e, -DF_ECORRUPT, "bad record magic 0x%08x (not a sample record)",
                       df_le32(buf));
    if (df_le16(buf + 4) != DF_CACHE_VERSION)
        return df_errf(e, -DF_EVERSION, "record version %u; this build reads version %u",
                       df_le16(buf + 4), DF_CACHE_VERSION);
    r->base = buf;
    r->len = len;
    r->id = df_le64(buf + 8);
    r->record_bytes = df_le64(buf + 16);
    r->n_tokens = df_le32(buf + 24);
    r->n_blocks = df_le32(buf + 28);
    r->n_layers = df_le16(buf + 32);
    r->rows_per_block = df_le32(buf + 36);
    r->tokens_offset = df_le32(buf + 40);
    r->tokens_crc = df_le32(buf + 44);
    uint64_t payload_end = df_le64(buf + 48);
    r->has_mask = (df_le16(buf + 6) & FLAG_HAS_MASK) != 0;
    r->header_crc = df_le32(buf + 60);
    if (r->n_tokens > DF_CACHE_MAX_TOKENS)
        return df_errf(e, -DF_ECORRUPT, "sample %" PRIu64 ": token count %u out of range", r->id,
                       r->n_tokens);
    if (r->n_layers != p->n_layers || r->rows_per_block != p->rows_per_block)
        return df_errf(e, -DF_ECORRUPT,
                       "sample %" PRIu64 ": header says %u layers x %u rows/block, cache %u x %u",
                       r->id, r->n_layers, r->rows_per_block, p->n_layers, p->rows_per_block);
    /* The CRC first, so a flipped bit is reported as such; the table it
     * covers is bounded by len before it is touched. */
    uint64_t table_end = DF_CACHE_RECORD_HEADER + (uint64_t)r->n_blocks * DF_CACHE_BLOCK_ENTRY;
    if (table_end > len)
        return df_errf(e, -DF_ECORRUPT, "sample %" PRIu64 ": block table (%u blocks) truncated",
                       r->id, r->n_blocks);
    uint32_t crc = df_crc32c(0, buf, 60);
    crc = df_crc32c(crc, buf + DF_CACHE_RECORD_HEADER, table_end - DF_CACHE_RECORD_HEADER);
    if (crc != r->header_crc)
        return df_errf(e, -DF_ECORRUPT,
                       "sample %" PRIu64 " (as the damaged header says): record header CRC "
                       "mismatch (stored %08x, computed %08x)",
                       r->id, r->header_crc, crc);
    uint32_t bpl = blocks_per_layer(p, r->n_tokens);
    if ((uint64_t)r->n_blocks != (uint64_t)bpl * p->n_layers)
        return df_errf(e, -DF_ECORRUPT, "sample %" PRIu64 ": %u blocks, %u tokens need %u",
                       r->id, r->n_blocks, r->n_tokens, bpl * p->n_layers);
    /* The header is what the writer wrote; now check it is self-consistent. */
    uint64_t tok_len = (uint64_t)r->n_tokens * (r->has_mask ? 5 : 4);
    if (r->tokens_offset != align_up(table_end, BLOCK_ALIGN) ||
        r->tokens_offset + tok_len > len || payload_end > r->record_bytes ||
        r->record_bytes % DF_CACHE_ALIGN || r->record_bytes == 0 ||
        payload_end < align_up(r->tokens_offset + tok_len, BLOCK_ALIGN))
        return df_errf(e, -DF_ECORRUPT, "sample %" PRIu64 ": inconsistent record layout", r->id);
    if (df_crc32c(0, buf + r->tokens_offset, tok_len) != r->tokens_crc)
        return df_errf(e, -DF_ECORRUPT, "sample %" PRIu64 ": token/loss-mask CRC mismatch", r->id);
    r->table = buf + DF_CACHE_RECORD_HEADER;
    uint64_t prev_end = align_up(r->tokens_offset + tok_len, BLOCK_ALIGN);
    size_t rb = row_bytes(p);
    for (uint32_t i = 0; i < r->n_blocks; i++) {
        df_cache_block b;
        df_cache_record_block(r, i, &b);
        uint32_t l = i / (bpl ? bpl : 1), k = i % (bpl ? bpl : 1);
        uint32_t first = k * p->rows_per_block;
        uint32_t rows = r->n_tokens - first < p->rows_per_block ? r->n_tokens - first
                                                                : p->rows_per_block;
        if (b.layer != l || b.first_row != first || b.n_rows != rows ||
            b.raw_size != (uint64_t)rows * rb || b.codec >= DF_CODEC_COUNT ||
            b.offset < prev_end || b.offset % BLOCK_ALIGN ||
            b.offset + b.stored_size > payload_end ||
            (b.codec == DF_CODEC_STORED && b.stored_size != b.raw_size))
            return df_errf(e, -DF_ECORRUPT,
                           "sample %" PRIu64 ": block %u (layer %u) entry inconsistent", r->id, i,
                           l);
        prev_end = b.offset + b.stored_size;
    }
    return 0;
}

void df_cache_record_tokens(const df_cache_record *r, const uint32_t **ids, const uint8_t **mask)
{
    *ids = (const uint32_t *)(const void *)(r->base + r->tokens_offset); /* LE host, 64-aligned */
    *mask = r->has_mask ? r->base + r->tokens_offset + (size_t)r->n_tokens * 4 : NULL;
}

void df_cache_record_block(const df_cache_record *r, uint32_t i, df_cache_block *b)
{
    const uint8_t *ent = r->table + (size_t)i * DF_CACHE_BLOCK_ENTRY;
    b->offset = df_le64(ent);
    b->stored_size = df_le32(ent + 8);
    b->raw_size = df_le32(ent + 12);
    b->crc = df_le32(ent + 16);
    b->first_row = df_le32(ent + 20);
    b->n_rows = df_le32(ent + 24);
    b->layer = df_le16(ent + 28);
    b->codec = ent[30];
}

static int check_block_crc(const df_cache_params *p, const df_cache_record *r, uint32_t i,
                           const df_cache_block *b, df_err *e)
{
    if (b->offset + b->stored_size > r->len)
        return df_errf(e, -DF_ECORRUPT, "sample %" PRIu64 ": block %u beyond the bytes read",
                       r->id, i);
    uint32_t crc = df_crc32c(0, r->base + b->offset, b->stored_size);
    if (crc != b->crc)
        return df_errf(e, -DF_ECORRUPT,
                       "sample %" PRIu64 ": block %u (target layer %d, rows %u..%u) CRC mismatch "
                       "at record offset %" PRIu64,
                       r->id, i, b->layer < p->n_layers ? p->layer_ids[b->layer] : -1,
                       b->first_row, b->first_row + b->n_rows, b->offset);
    return 0;
}

int df_cache_record_decode_block(const df_cache_params *p, const df_cache_record *r, uint32_t i,
                                 df_codec_ctx *ctx, void *layer_dst, df_err *e)
{
    df_cache_block b;
    df_cache_record_block(r, i, &b);
    int rc = check_block_crc(p, r, i, &b, e);
    if (rc)
        return rc;
    df_codec_params cp = {p->dtype, p->hidden_size, p->codec_level};
    uint8_t *dst = (uint8_t *)layer_dst + (size_t)b.first_row * row_bytes(p);
    rc = df_codec_decode(ctx, b.codec, &cp, r->base + b.offset, b.stored_size, dst, b.raw_size, e);
    if (rc)
        return df_err_wrap(e, "sample %" PRIu64 " block %u", r->id, i);
    return 0;
}

int df_cache_record_check_ids(const df_cache_params *p, const df_cache_record *r, df_err *e)
{
    if (p->vocab_size <= 0)
        return 0; /* a cache that does not record its vocabulary */
    const uint32_t *ids;
    const uint8_t *mask;
    df_cache_record_tokens(r, &ids, &mask);
    for (uint32_t i = 0; i < r->n_tokens; i++)
        if ((int64_t)ids[i] >= p->vocab_size)
            return df_errf(e, -DF_ECORRUPT,
                           "sample %" PRIu64 " position %u: token id %u out of range (vocab %" PRId64
                           ")", r->id, i, ids[i], p->vocab_size);
    return 0;
}

int df_cache_record_verify(const df_cache_params *p, const df_cache_record *r, df_err *e)
{
    for (uint32_t i = 0; i < r->n_blocks; i++) {
        df_cache_block b;
        df_cache_record_block(r, i, &b);
        int rc = check_block_crc(p, r, i, &b, e);
        if (rc)
            return rc;
    }
    return 0;
}

static pthread_key_t tls_key;
static pthread_once_t tls_once = PTHREAD_ONCE_INIT;

static void tls_free(void *v)
{
    df_codec_ctx_free(v);
}

static void tls_init(void)
{
    pthread_key_create(&tls_key, tls_free);
}

df_codec_ctx *df_codec_ctx_tls(void)
{
    pthread_once(&tls_once, tls_init);
    df_codec_ctx *c = pthread_getspecific(tls_key);
    if (!c) {
        c = df_codec_ctx_new();
        if (c)
            pthread_setspecific(tls_key, c);
    }
    return c;
}

typedef struct decode_job {
    const df_cache_params *p;
    const df_cache_record *r;
    uint64_t mask;
    void *const *dst;
    uint32_t bpl;
    df_err errs; /* the first failing block's message (guarded by the pool's order) */
    pthread_mutex_t mu;
    int have_err;
} decode_job;

static int decode_one(void *arg, size_t i)
{
    decode_job *j = arg;
    uint32_t l = (uint32_t)(i / j->bpl);
    if (!(j->mask >> l & 1))
        return 0;
    df_codec_ctx *ctx = df_codec_ctx_tls();
    if (!ctx)
        return -ENOMEM;
    df_err e = {0};
    int rc = df_cache_record_decode_block(j->p, j->r, (uint32_t)i, ctx, j->dst[l], &e);
    if (rc) {
        pthread_mutex_lock(&j->mu);
        if (!j->have_err) {
            j->errs = e;
            j->have_err = 1;
        }
        pthread_mutex_unlock(&j->mu);
    }
    return rc;
}

int df_cache_record_decode(const df_cache_params *p, const df_cache_record *r,
                           uint64_t layer_mask, void *const *dst, df_pool *pool, df_err *e)
{
    if (r->n_blocks == 0)
        return 0;
    decode_job j = {.p = p, .r = r, .mask = layer_mask, .dst = dst,
                    .bpl = r->n_blocks / r->n_layers};
    pthread_mutex_init(&j.mu, NULL);
    int rc = df_pool_for(pool, r->n_blocks, decode_one, &j);
    pthread_mutex_destroy(&j.mu);
    if (rc && e) {
        if (j.have_err)
            *e = j.errs;
        else
            df_errf(e, rc, "sample %" PRIu64 ": decode failed: %s", r->id, df_strerror(rc));
    }
    return rc;
}

/* ------------------------------------------------------------ shards and indexes */

void df_cache_shard_name(char *out, size_t n, uint32_t rank, uint32_t seq, const char *suffix)
{
    snprintf(out, n, "shard-r%04u-%05u%s", rank, seq, suffix);
}

void df_cache_shard_header_encode(const df_cache_params *p, uint32_t rank, uint32_t seq,
                                  uint8_t out[DF_CACHE_SHARD_HEADER])
{
    memset(out, 0, DF_CACHE_SHARD_HEADER);
    memcpy(out, SHARD_MAGIC, 8);
    df_put32(out + 8, DF_CACHE_VERSION);
    df_put32(out + 12, DF_CACHE_SHARD_HEADER);
    df_put32(out + 16, rank);
    df_put32(out + 20, seq);
    memcpy(out + 24, p->uuid, 16);
    df_put32(out + 40, p->hidden_size);
    df_put32(out + 44, p->n_layers);
    df_put16(out + 48, (uint16_t)p->dtype);
    df_put16(out + 50, (uint16_t)p->codec);
    df_put32(out + 52, p->rows_per_block);
    df_put32(out + 60, df_crc32c(0, out, 60));
    /* Past the 64-byte prefix older readers compare (so they still read
     * these shards): the checksum of every meta.json parameter, and its CRC. */
    df_put32(out + 64, df_cache_params_crc(p));
    df_put32(out + 68, df_crc32c(0, out + 64, 4));
}

int df_cache_shard_header_check(const df_cache_params *p, const uint8_t *buf, size_t len,
                                uint32_t rank, uint32_t seq, const char *path, df_err *e)
{
    if (len < DF_CACHE_SHARD_HEADER)
        return df_errf(e, -DF_ECORRUPT, "%s: truncated shard header (%zu bytes)", path, len);
    if (memcmp(buf, SHARD_MAGIC, 8))
        return df_errf(e, -DF_ECORRUPT, "%s: offset 0: not a dflash cache shard (bad magic)",
                       path);
    if (df_le32(buf + 8) != DF_CACHE_VERSION)
        return df_errf(e, -DF_EVERSION, "%s: shard format version %u; this build reads %u", path,
                       df_le32(buf + 8), DF_CACHE_VERSION);
    if (df_le32(buf + 60) != df_crc32c(0, buf, 60))
        return df_errf(e, -DF_ECORRUPT, "%s: offset 0: shard header CRC mismatch", path);
    uint8_t want[DF_CACHE_SHARD_HEADER];
    df_cache_shard_header_encode(p, rank, seq, want);
    uint32_t have_pc = df_le32(buf + 64), want_pc = df_le32(want + 64);
    if (have_pc == 0 && df_le32(buf + 68) == 0) {
        /* written before the parameter checksum: the prefix is all there is */
    } else if (df_le32(buf + 68) != df_crc32c(0, buf + 64, 4)) {
        return df_errf(e, -DF_ECORRUPT, "%s: offset 64: parameter checksum CRC mismatch", path);
    } else if (have_pc != want_pc && !memcmp(buf, want, 64)) {
        return df_errf(e, -DF_EMISMATCH,
                       "%s: offset 64: the shard was written with parameters of checksum %08x; "
                       "the manifest's give %08x (a parameter in meta.json/manifest.json was "
                       "edited or corrupted: layers, vocab, codec, corpus...)",
                       path, have_pc, want_pc);
    }
    if (memcmp(buf, want, 64))
        return df_errf(e, -DF_EMISMATCH,
                       "%s: shard header does not match this cache (other cache, rank or layout)",
                       path);
    return 0;
}

int df_cache_index_encode(const df_cache_params *p, uint32_t rank, uint32_t seq,
                          const df_cache_entry *ents, size_t n, const uint64_t *layer_raw,
                          const uint64_t *layer_stored, uint8_t **out, size_t *len, df_err *e)
{
    size_t trailer = (size_t)p->n_layers * 16;
    size_t sz = DF_CACHE_INDEX_HEADER + n * DF_CACHE_INDEX_ENTRY + trailer;
    uint8_t *b = calloc(1, sz);
    if (!b)
        return df_errf(e, -ENOMEM, "out of memory for an index of %zu entries", n);
    uint8_t *q = b + DF_CACHE_INDEX_HEADER;
    for (size_t i = 0; i < n; i++, q += DF_CACHE_INDEX_ENTRY) {
        df_put64(q + 0, ents[i].id);
        df_put64(q + 8, ents[i].offset);
        df_put64(q + 16, ents[i].record_bytes);
        df_put64(q + 24, ents[i].stored_bytes);
        df_put32(q + 32, ents[i].n_tokens);
        df_put32(q + 36, ents[i].n_loss);
        df_put32(q + 40, ents[i].header_crc);
        df_put32(q + 44, df_crc32c(0, q, 44));
    }
    for (uint32_t l = 0; l < p->n_layers; l++, q += 16) {
        df_put64(q, layer_raw[l]);
        df_put64(q + 8, layer_stored[l]);
    }
    memcpy(b, INDEX_MAGIC, 8);
    df_put32(b + 8, DF_CACHE_VERSION);
    df_put32(b + 12, DF_CACHE_INDEX_ENTRY);
    df_put64(b + 16, n);
    df_put32(b + 24, rank);
    df_put32(b + 28, seq);
    memcpy(b + 32, p->uuid, 16);
    df_put32(b + 48, df_crc32c(0, b + DF_CACHE_INDEX_HEADER, n * DF_CACHE_INDEX_ENTRY));
    df_put32(b + 52, p->n_layers);
    df_put32(b + 56, df_crc32c(0, b + sz - trailer, trailer));
    df_put32(b + 60, df_crc32c(0, b, 60));
    *out = b;
    *len = sz;
    return 0;
}

int df_cache_index_parse(const df_cache_params *p, const uint8_t *buf, size_t len,
                         uint32_t shard_no, const char *path, df_cache_entry **ents, size_t *n,
                         uint64_t *layer_raw, uint64_t *layer_stored, df_err *e)
{
    *ents = NULL;
    *n = 0;
    if (len < DF_CACHE_INDEX_HEADER)
        return df_errf(e, -DF_ECORRUPT, "%s: truncated index header (%zu bytes)", path, len);
    if (memcmp(buf, INDEX_MAGIC, 8))
        return df_errf(e, -DF_ECORRUPT, "%s: offset 0: not a dflash cache index (bad magic)",
                       path);
    if (df_le32(buf + 8) != DF_CACHE_VERSION)
        return df_errf(e, -DF_EVERSION, "%s: index version %u; this build reads %u", path,
                       df_le32(buf + 8), DF_CACHE_VERSION);
    if (df_le32(buf + 60) != df_crc32c(0, buf, 60))
        return df_errf(e, -DF_ECORRUPT, "%s: offset 0: index header CRC mismatch", path);
    if (df_le32(buf + 12) != DF_CACHE_INDEX_ENTRY)
        return df_errf(e, -DF_ECORRUPT, "%s: index entry size %u, expected %u", path,
                       df_le32(buf + 12), DF_CACHE_INDEX_ENTRY);
    if (memcmp(buf + 32, p->uuid, 16))
        return df_errf(e, -DF_EMISMATCH, "%s: index belongs to another cache (uuid differs)",
                       path);
    uint64_t cnt = df_le64(buf + 16);
    if (df_le32(buf + 52) != p->n_layers)
        return df_errf(e, -DF_ECORRUPT, "%s: index has %u layers, the cache %u", path,
                       df_le32(buf + 52), p->n_layers);
    size_t trailer = (size_t)p->n_layers * 16;
    if (len < DF_CACHE_INDEX_HEADER + trailer ||
        cnt > (len - DF_CACHE_INDEX_HEADER - trailer) / DF_CACHE_INDEX_ENTRY ||
        DF_CACHE_INDEX_HEADER + cnt * DF_CACHE_INDEX_ENTRY + trailer != len)
        return df_errf(e, -DF_ECORRUPT, "%s: index says %" PRIu64 " entries; file has %zu bytes",
                       path, cnt, len);
    if (df_crc32c(0, buf + len - trailer, trailer) != df_le32(buf + 56))
        return df_errf(e, -DF_ECORRUPT, "%s: index layer totals CRC mismatch", path);
    if (df_crc32c(0, buf + DF_CACHE_INDEX_HEADER, cnt * DF_CACHE_INDEX_ENTRY) != df_le32(buf + 48))
        return df_errf(e, -DF_ECORRUPT, "%s: index entries CRC mismatch", path);
    df_cache_entry *out = malloc((cnt ? cnt : 1) * sizeof *out);
    if (!out)
        return df_errf(e, -ENOMEM, "%s: out of memory", path);
    uint64_t prev_end = DF_CACHE_SHARD_HEADER;
    const uint8_t *q = buf + DF_CACHE_INDEX_HEADER;
    for (uint64_t i = 0; i < cnt; i++, q += DF_CACHE_INDEX_ENTRY) {
        df_cache_entry *t = &out[i];
        t->id = df_le64(q);
        t->offset = df_le64(q + 8);
        t->record_bytes = df_le64(q + 16);
        t->stored_bytes = df_le64(q + 24);
        t->n_tokens = df_le32(q + 32);
        t->n_loss = df_le32(q + 36);
        t->header_crc = df_le32(q + 40);
        t->shard = shard_no;
        uint64_t off = DF_CACHE_INDEX_HEADER + i * DF_CACHE_INDEX_ENTRY;
        if (df_le32(q + 44) != df_crc32c(0, q, 44) || t->offset != prev_end ||
            t->record_bytes == 0 || t->record_bytes % DF_CACHE_ALIGN ||
            t->record_bytes > UINT64_MAX / 2 || t->n_loss > t->n_tokens ||
            t->n_tokens > DF_CACHE_MAX_TOKENS || t->stored_bytes > t->record_bytes) {
            uint64_t id = t->id;
            free(out);
            return df_errf(e, -DF_ECORRUPT, "%s: offset %" PRIu64 ": index entry %" PRIu64
                           " (sample %" PRIu64 ") is inconsistent",
                           path, off, i, id);
        }
        prev_end = t->offset + t->record_bytes;
    }
    for (uint32_t l = 0; l < p->n_layers; l++, q += 16) {
        if (layer_raw)
            layer_raw[l] += df_le64(q);
        if (layer_stored)
            layer_stored[l] += df_le64(q + 8);
    }
    *ents = out;
    *n = cnt;
    return 0;
}
