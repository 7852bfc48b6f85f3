/* cache.h - the hidden-state cache: on-disk format and synchronous access.
 *
 * docs/FORMAT.md specifies every byte; this header is the library view.
 *
 * A cache is a directory:
 *   meta.json                 parameters fixed at creation (written first)
 *   shard-rRRRR-SSSSS.dfc     sample records of writer rank R, shard S
 *   shard-rRRRR-SSSSS.dfi     that shard's index (48-byte entries + per-layer byte totals)
 *   shard-...dfc.partial      the shard a writer is appending to (no index yet)
 *   rank-RRRR.json            a rank's list of finished shards (written at its close)
 *   manifest.json             everything, written last: a cache without it is unfinished
 *
 * A sample record = header + block table + tokens (u32 ids, u8 loss mask) +
 * per-layer blocks (whole rows each, codec id + sizes + CRC32C each), padded
 * to 4 KiB so records can be read and written with O_DIRECT.
 *
 * This header is pure format + synchronous pread-based reading; the threaded
 * writer (cache_writer.h) and streaming reader (cache_stream.h) beside it do
 * their I/O through the engine in storage/io.h.
 */
#ifndef DF_CACHE_H
#define DF_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "codec.h"
#include "dtype.h"
#include "err.h"
#include "pool.h"

#define DF_CACHE_VERSION 1
/* meta.json / manifest.json of a projected cache (below): a reader that does not know
 * projections refuses it by this version instead of reading z as features. Shards and
 * indexes keep version 1: their layout is the same. */
#define DF_CACHE_VERSION_PROJECTED 2
#define DF_CACHE_PROJECTED_LAYER (-1) /* layer_ids[0] of a projected cache */
#define DF_CACHE_BASIS_FILE "basis.dfb"
#define DF_CACHE_ALIGN 4096u
#define DF_CACHE_MAX_LAYERS 64
#define DF_CACHE_SHARD_HEADER 4096u
#define DF_CACHE_RECORD_HEADER 64u
#define DF_CACHE_BLOCK_ENTRY 32u
#define DF_CACHE_INDEX_HEADER 64u
#define DF_CACHE_INDEX_ENTRY 48u
/* Bounds that make corrupt headers fail fast instead of allocating wildly. */
#define DF_CACHE_MAX_TOKENS (1u << 24)
#define DF_CACHE_MAX_HIDDEN (1u << 20)

/* What a cache holds; fixed when it is created, checked when it is resumed. */
typedef struct df_cache_params {
    char model_type[32];      /* "qwen3", "qwen3_5", ... */
    char target_name[128];    /* informative: the model folder's name */
    char config_sha256[65];   /* hex SHA-256 of the target's config.json */
    uint32_t hidden_size;
    uint32_t num_target_layers;
    int64_t vocab_size;
    uint32_t n_layers;        /* feature layers stored */
    int32_t layer_ids[DF_CACHE_MAX_LAYERS]; /* 0-based target layer ids (HF hidden_states[l+1]) */
    df_dtype dtype;           /* BF16 (F16, F32 accepted) */
    int codec;                /* df_codec_id */
    int codec_level;          /* 0 = codec default */
    uint32_t rows_per_block;  /* 0 at creation = auto (about 1 MiB raw per block) */
    uint64_t shard_bytes;     /* start a new shard past this size; 0 = 4 GiB */
    char corpus_fingerprint[65];
    uint64_t corpus_docs;
    uint32_t world_size;      /* writer ranks; each writes its own shards */
    uint8_t uuid[16];         /* set at creation; shards carry it */
    /* A projected cache stores, per token, z = P x (proj_rank values): x is the concatenation
     * of the residual streams of src_layer_ids (src_n_layers x src_hidden), P the basis
     * (proj_rank x src_n_layers*src_hidden, orthonormal rows) in DF_CACHE_BASIS_FILE, whose
     * SHA-256 is basis_sha256. The record layout then sees one stored layer of proj_rank
     * values: hidden_size = proj_rank, n_layers = 1, layer_ids[0] = DF_CACHE_PROJECTED_LAYER.
     * In meta.json the target's hidden size and the source layers are stored as for any
     * cache, plus a "projection" object (docs/FORMAT.md). proj_rank 0: not projected. */
    uint32_t proj_rank;
    uint32_t src_hidden, src_n_layers;
    int32_t src_layer_ids[DF_CACHE_MAX_LAYERS];
    char basis_sha256[65];
} df_cache_params;

/* The target's hidden size and feature layers behind a cache, projected or not. */
static inline uint32_t df_cache_target_hidden(const df_cache_params *p)
{
    return p->proj_rank ? p->src_hidden : p->hidden_size;
}
static inline uint32_t df_cache_target_layers(const df_cache_params *p, const int32_t **ids)
{
    *ids = p->proj_rank ? p->src_layer_ids : p->layer_ids;
    return p->proj_rank ? p->src_n_layers : p->n_layers;
}

/* One sample as a writer receives it. layers[i] points to n_tokens x
 * hidden_size elements of params.dtype, row-major, for layer_ids[i]. */
typedef struct df_cache_sample {
    uint64_t id;              /* the corpus document index */
    uint32_t n_tokens;
    const uint32_t *ids;
    const uint8_t *loss_mask; /* NULL = all ones */
    const void *const *layers;
} df_cache_sample;

/* A sample's place on disk, as the index records it. */
typedef struct df_cache_entry {
    uint64_t id;
    uint64_t offset;          /* of the record in its shard file */
    uint64_t record_bytes;    /* multiple of DF_CACHE_ALIGN */
    uint64_t stored_bytes;    /* sum of the blocks' stored sizes */
    uint32_t n_tokens;
    uint32_t n_loss;          /* tokens with loss_mask 1 */
    uint32_t header_crc;      /* the record header's CRC, cross-checked on read */
    uint32_t shard;           /* index into the cache's shard list */
} df_cache_entry;

/* One block as parsed from a record's table. */
typedef struct df_cache_block {
    uint64_t offset;          /* from the record start */
    uint32_t stored_size, raw_size, crc;
    uint32_t first_row, n_rows;
    uint16_t layer;           /* index into params.layer_ids */
    uint8_t codec;
} df_cache_block;

/* A parsed, header-verified view of a record in memory (no copies). */
typedef struct df_cache_record {
    const uint8_t *base;
    size_t len;               /* bytes available at base */
    uint64_t id;
    uint64_t record_bytes;
    uint32_t n_tokens, n_layers, n_blocks, rows_per_block;
    uint32_t header_crc;
    uint32_t tokens_offset, tokens_crc;
    int has_mask;
    const uint8_t *table;     /* n_blocks entries of DF_CACHE_BLOCK_ENTRY bytes */
} df_cache_record;

/* ---- parameters ---- */

/* Fills defaults (rows_per_block, shard_bytes) and checks consistency. */
int df_cache_params_finish(df_cache_params *p, df_err *e);
/* 0 when b can extend a cache created with a (same target, layers, codec,
 * dtype, block rows); else -DF_EMISMATCH naming the first difference. */
int df_cache_params_compatible(const df_cache_params *a, const df_cache_params *b, df_err *e);

/* ---- records (pure functions; thread-safe) ---- */

/* Upper bound of a record's size for n_tokens (before compression). */
size_t df_cache_record_bound(const df_cache_params *p, uint32_t n_tokens);

/* Encodes one sample into dst (capacity cap >= df_cache_record_bound()),
 * padded with zeros to a multiple of DF_CACHE_ALIGN. *len = record bytes.
 * raw/stored per layer are added to layer_raw/layer_stored when not NULL. */
int df_cache_record_encode(const df_cache_params *p, const df_cache_sample *s,
                           df_codec_ctx *ctx, uint8_t *dst, size_t cap, size_t *len,
                           uint64_t *layer_raw, uint64_t *layer_stored, df_err *e);

/* Parses and verifies the header + block table + token section of a record
 * whose first len bytes are at buf. Every size and offset is checked against
 * len and the params. Block payloads are not touched (see _decode_block). */
int df_cache_record_parse(const df_cache_params *p, const uint8_t *buf, size_t len,
                          df_cache_record *r, df_err *e);

/* Token ids and loss mask of a parsed record (pointers into the record). */
void df_cache_record_tokens(const df_cache_record *r, const uint32_t **ids, const uint8_t **mask);
void df_cache_record_block(const df_cache_record *r, uint32_t i, df_cache_block *b);

/* Verifies block i's CRC and decodes it to dst + first_row * row_bytes of a
 * [n_tokens x hidden] layer buffer. */
int df_cache_record_decode_block(const df_cache_params *p, const df_cache_record *r, uint32_t i,
                                 df_codec_ctx *ctx, void *layer_dst, df_err *e);

/* Decodes the layers selected by layer_mask (bit i = params.layer_ids[i])
 * into dst[i] (only selected entries are used), blocks in parallel on pool
 * (may be NULL). */
int df_cache_record_decode(const df_cache_params *p, const df_cache_record *r,
                           uint64_t layer_mask, void *const *dst, df_pool *pool, df_err *e);

/* Checks every token id of a parsed record against params.vocab_size (when
 * known, > 0): an id past the vocabulary would index past the embedding in
 * training. The error names the sample, the position and the id. */
int df_cache_record_check_ids(const df_cache_params *p, const df_cache_record *r, df_err *e);

/* Verifies every block CRC of a parsed record without decoding. */
int df_cache_record_verify(const df_cache_params *p, const df_cache_record *r, df_err *e);

/* A per-thread codec context, created on first use, freed at thread exit. */
df_codec_ctx *df_codec_ctx_tls(void);

/* ---- shard headers and index files ---- */

void df_cache_shard_header_encode(const df_cache_params *p, uint32_t rank, uint32_t seq,
                                  uint8_t out[DF_CACHE_SHARD_HEADER]);
int df_cache_shard_header_check(const df_cache_params *p, const uint8_t *buf, size_t len,
                                uint32_t rank, uint32_t seq, const char *path, df_err *e);

/* Serializes entries (+ the shard's per-layer raw/stored byte sums) into a
 * malloc'd index file image. */
int df_cache_index_encode(const df_cache_params *p, uint32_t rank, uint32_t seq,
                          const df_cache_entry *ents, size_t n, const uint64_t *layer_raw,
                          const uint64_t *layer_stored, uint8_t **out, size_t *len, df_err *e);
/* Parses an index file image; *ents malloc'd, entries' shard set to shard_no.
 * The per-layer sums are added to layer_raw/layer_stored (may be NULL). */
int df_cache_index_parse(const df_cache_params *p, const uint8_t *buf, size_t len,
                         uint32_t shard_no, const char *path, df_cache_entry **ents, size_t *n,
                         uint64_t *layer_raw, uint64_t *layer_stored, df_err *e);

/* Canonical file names. */
void df_cache_shard_name(char *out, size_t n, uint32_t rank, uint32_t seq, const char *suffix);

/* ---- meta.json / manifest.json ---- */

/* JSON text (malloc'd) of the params: the content of meta.json. */
char *df_cache_params_to_json(const df_cache_params *p);
int df_cache_params_from_json(const char *json, size_t len, const char *path, df_cache_params *p,
                              df_err *e);

/* ---- the finished cache: synchronous reader ---- */

typedef struct df_cache df_cache;

typedef struct df_cache_shard_info {
    char data[64], index[64];
    uint32_t rank, seq;
    uint64_t samples, tokens, bytes;
} df_cache_shard_info;

typedef struct df_cache_info {
    df_cache_params params;
    uint64_t samples, tokens, loss_tokens;
    uint64_t raw_bytes, stored_bytes;   /* hidden-state blocks only */
    uint64_t file_bytes;                /* shard files, incl. headers and padding */
    uint64_t layer_raw[DF_CACHE_MAX_LAYERS], layer_stored[DF_CACHE_MAX_LAYERS];
    uint32_t n_shards;
    const df_cache_shard_info *shards;
    char created_by[64];
} df_cache_info;

/* Opens a finished cache: reads manifest.json and every index, checks that
 * shard files exist with the sizes the manifest says. Fails on an unfinished
 * cache with a message saying so. */
df_cache *df_cache_open(const char *dir, df_err *e);
void df_cache_close(df_cache *c);

const df_cache_info *df_cache_get_info(const df_cache *c);
const char *df_cache_dir(const df_cache *c);

/* Samples, sorted by id. */
size_t df_cache_count(const df_cache *c);
const df_cache_entry *df_cache_entry_at(const df_cache *c, size_t k);
/* Position of sample id, or -ENOENT. */
int64_t df_cache_find(const df_cache *c, uint64_t id);
/* The open fd of shard s (for the streaming reader). */
int df_cache_shard_fd(const df_cache *c, uint32_t s);
const char *df_cache_shard_path(const df_cache *c, uint32_t s);

/* Caller-owned destination of df_cache_read(). */
typedef struct df_cache_out {
    uint32_t *ids;        /* capacity for entry->n_tokens, or NULL */
    uint8_t *loss_mask;   /* capacity for entry->n_tokens, or NULL */
    void *layers[DF_CACHE_MAX_LAYERS]; /* [n_tokens x hidden] per selected layer */
} df_cache_out;

/* Reads sample k (position, not id) with pread: tokens, mask and the layers
 * in layer_mask (bit i = layer_ids[i]; only their blocks are read). Every
 * byte is CRC-checked; errors name the shard file, offset and sample id. */
int df_cache_read(df_cache *c, size_t k, uint64_t layer_mask, df_cache_out *out, df_pool *pool,
                  df_err *e);

/* Reads and checks everything: every record header against its index entry,
 * every block CRC, every token CRC, the shard headers. progress(arg, done,
 * total) counts samples; it is called now and then from the pool's threads,
 * one call at a time (may be NULL). Returns 0 or the first error;
 * *n_bad (may be NULL) counts bad samples (verification goes on past them). */
int df_cache_verify(df_cache *c, df_pool *pool, void (*progress)(void *, uint64_t, uint64_t),
                    void *arg, uint64_t *n_bad, df_err *e);

/* A projected cache's basis file: present, the SHA-256 the manifest names,
 * a valid basis (formats/basis.h) of the cache's rank, layers and hidden
 * size; the parsed basis goes to *out (free with df_basis_free) when out is
 * not NULL. 0 for a cache that is not projected (*out untouched); else
 * -DF_ECORRUPT (or the reader's error) naming the file. df_cache_verify
 * runs it first. */
struct df_basis;
int df_cache_load_basis(const char *dir, const df_cache_params *p, struct df_basis *out,
                        df_err *e);

/* Merges rank-*.json into manifest.json once all world_size ranks are done
 * (-EAGAIN while some are not). Ranks finishing together may all call it:
 * they take turns on an flock of dir, and once the manifest exists it returns 0. */
int df_cache_finalize(const char *dir, df_err *e);

#endif
