/* cache_writer.h - writes a hidden-state cache in the background.
 *
 * put() copies a sample and returns; worker threads encode records
 * (compression), one I/O thread appends them in put() order to the rank's
 * shard through the io engine (io_uring, O_DIRECT), rotates shards past
 * params.shard_bytes, and finishes each shard with fsync, its index, an
 * atomic rename and an fsync of the directory. Memory is bounded: put()
 * blocks while more than opts.max_inflight_bytes are queued.
 *
 * Resume: opening a directory that holds an unfinished cache with the same
 * parameters continues it. Finished shards are kept as they are; the shard
 * being written is scanned record by record, every CRC checked, and cut after
 * the last complete, verified sample. df_cache_writer_has() then says which
 * samples are already there. Sample ids must increase from put to put within
 * a rank: the samples found on resume are then exactly a prefix of the run,
 * and putting the rest gives the same cache as an uninterrupted run.
 *
 * close() drains everything, writes rank-RRRR.json and, if every rank is
 * then done (always, for world_size 1), manifest.json: the last rank to
 * finish completes the cache.
 */
#ifndef DF_CACHE_WRITER_H
#define DF_CACHE_WRITER_H

#include "cache.h"
#include "err.h"

typedef struct df_cache_writer df_cache_writer;

typedef struct df_cache_writer_opts {
    uint32_t rank;             /* this writer's rank (< params.world_size) */
    int threads;               /* compression workers; 0 = online CPUs */
    size_t max_inflight_bytes; /* bound on queued raw + encoded bytes; 0 = 1 GiB */
    unsigned queue_depth;      /* I/O requests in flight; 0 = 16 */
    int force_fallback_io;     /* use the pread/pwrite pool, not io_uring */
    int buffered;              /* no O_DIRECT (page cache) */
} df_cache_writer_opts;

typedef struct df_cache_writer_stats {
    uint64_t samples, tokens;          /* written this session */
    uint64_t resumed_samples, resumed_tokens;
    uint64_t raw_bytes, stored_bytes;  /* hidden-state blocks, this session */
    uint64_t file_bytes;               /* appended to shards, this session */
    uint64_t inflight_bytes;
    double put_wait_s;                 /* time put() blocked on the memory bound */
    double io_wait_s;                  /* time the I/O thread waited on the disk */
    const char *io_backend;
} df_cache_writer_stats;

/* Creates or resumes the cache in dir. p is completed (defaults) and, on
 * resume, must be compatible with meta.json (meta.json's parameters, uuid
 * included, are adopted into p). A finished cache (manifest.json) is refused
 * with -EEXIST; a new cache goes only into a missing or empty directory
 * (see df_cache_writer_check_dir). */
/* 0 when dir may take a cache: missing, holding meta.json (a cache to
 * resume; its parameters are checked when it opens), or empty but for writer
 * lock files (and basis.dfb when projected). Else -EEXIST naming an entry.
 * For callers that put files into dir before opening the writer (extract
 * --basis), so a refused directory is left as it was. */
int df_cache_writer_check_dir(const char *dir, int projected, df_err *e);

df_cache_writer *df_cache_writer_open(const char *dir, df_cache_params *p,
                                      const df_cache_writer_opts *opts, df_err *e);

/* 1 when sample id is already in the cache (found on resume). */
int df_cache_writer_has(const df_cache_writer *w, uint64_t id);

/* Queues a sample (copied; the caller's buffers are free on return).
 * Returns 0, or the first error of the background work. */
int df_cache_writer_put(df_cache_writer *w, const df_cache_sample *s, df_err *e);

/* Waits until every sample put so far is on disk (written, not yet fsynced:
 * that happens when a shard is finished). Returns 0 or the first error. */
int df_cache_writer_flush(df_cache_writer *w, df_err *e);

void df_cache_writer_get_stats(df_cache_writer *w, df_cache_writer_stats *st);

/* Finishes and frees the writer. Returns 0 or the first error. */
int df_cache_writer_close(df_cache_writer *w, df_err *e);

/* Stops without finishing (shards stay partial, as after a crash) and frees. */
void df_cache_writer_abandon(df_cache_writer *w);

#endif
