/* cache_internal.h - pieces shared by the cache's format, reader and
 * writer; not part of the public API. */
#ifndef DF_CACHE_INTERNAL_H
#define DF_CACHE_INTERNAL_H

#include <cjson/cJSON.h>

#include "cache.h"

/* What one writer rank finished (rank-RRRR.json), or the whole cache. */
typedef struct df_cache_part {
    uint32_t rank;
    uint32_t n_layers;
    uint32_t n_shards;
    df_cache_shard_info *shards; /* malloc'd */
    uint64_t samples, tokens, loss_tokens, raw_bytes, stored_bytes;
    uint64_t layer_raw[DF_CACHE_MAX_LAYERS], layer_stored[DF_CACHE_MAX_LAYERS];
    int has_uuid;     /* rank parts: uuid is the cache's, written as "uuid" */
    uint8_t uuid[16];
} df_cache_part;

/* CRC-32C over the canonical text of every parameter in meta.json (never 0:
 * 0 in a shard header means "written before this field"). Shard headers carry
 * it at offset 56, so a manifest whose parameters were edited disagrees with
 * every shard (docs/FORMAT.md, "Checksums"). */
uint32_t df_cache_params_crc(const df_cache_params *p);
/* Adds the "checksums" of a manifest's shards, totals and layer_bytes to o
 * (which already holds df_cache_params_json's). */
void df_cache_part_checksums(cJSON *o, const df_cache_part *all);

cJSON *df_cache_params_json(const df_cache_params *p);
int df_cache_params_from_cjson(const cJSON *o, const char *path, df_cache_params *p, df_err *e);
cJSON *df_cache_part_json(const df_cache_part *part);
void df_cache_part_free(df_cache_part *part);
int df_cache_part_write(const char *dir, const df_cache_part *part, df_err *e);
/* Takes an exclusive flock on the cache directory (waiting for it): creating
 * meta.json and merging the ranks into manifest.json happen under it. Returns
 * the fd to close (which drops the lock), or a negative code. On a file
 * system without flock it returns the fd unlocked. */
int df_cache_dir_lock(const char *dir, df_err *e);
int df_cache_meta_read(const char *dir, df_cache_params *p, df_err *e);
int df_cache_manifest_read(const char *dir, df_cache_params *p, df_cache_part *all,
                           char *created_by, size_t cb_len, df_err *e);

#endif
