/* cache_stream.h - streams a finished cache's samples in a given order.
 *
 * One I/O thread reads whole records ahead (io_uring, O_DIRECT, bounded by
 * max_prefetch_bytes of compressed data in memory); decoder threads check
 * every CRC and decode the selected layers into slots; next() hands out
 * samples strictly in the requested order. Slots are the decoded-memory
 * bound: there are n_slots of slot_bytes each, either the caller's (e.g.
 * pinned host memory for GPU copies) or allocated here. A sample stays valid
 * until it is released; at most n_slots are held at once.
 *
 * Errors are delivered in order: next() returns the error of the sample at
 * that position (naming shard, offset and sample), after every sample
 * before it.
 */
#ifndef DF_CACHE_STREAM_H
#define DF_CACHE_STREAM_H

#include "cache.h"
#include "err.h"

typedef struct df_cache_stream df_cache_stream;

typedef struct df_cache_stream_opts {
    const uint64_t *order;     /* positions (0..count-1) to deliver; NULL = all, in id order */
    size_t n;                  /* entries in order (ignored when order is NULL) */
    uint64_t layer_mask;       /* bit i = params.layer_ids[i]; 0 = all layers */
    int threads;               /* decoder threads; 0 = online CPUs */
    size_t max_prefetch_bytes; /* compressed bytes read ahead; 0 = the larger of 256 MiB and
                                  (threads + 1) x the order's largest record */
    unsigned queue_depth;      /* read requests in flight; 0 = 16 */
    int force_fallback_io;
    int buffered;              /* no O_DIRECT */
    unsigned n_slots;          /* 0 = 2 x threads + 2 */
    void **slots;              /* caller's slot buffers, or NULL to allocate */
    size_t slot_bytes;         /* size of each caller slot (0 with slots NULL: computed) */
} df_cache_stream_opts;

typedef struct df_cache_item {
    uint64_t id;               /* sample id */
    size_t pos;                /* position in the cache (df_cache_entry_at) */
    size_t seq;                /* index in the requested order */
    uint32_t n_tokens;
    const uint32_t *ids;
    const uint8_t *loss_mask;  /* always present (all ones when the record has none) */
    const void *layers[DF_CACHE_MAX_LAYERS]; /* selected layers; NULL otherwise */
    unsigned slot;
} df_cache_item;

typedef struct df_cache_stream_stats {
    uint64_t samples, tokens, bytes_read;
    double consumer_wait_s;    /* time next() waited: the data path was the bottleneck */
    double elapsed_s;
    size_t prefetch_budget;    /* the compressed read-ahead bound in effect */
    const char *io_backend;
} df_cache_stream_stats;

/* Bytes one slot needs for the largest sample with these layers. */
size_t df_cache_stream_slot_bytes(const df_cache *c, uint64_t layer_mask);

/* The read-ahead bound a stream gets when max_prefetch_bytes is 0: the larger
 * of 256 MiB and (threads + 1) x the largest record it will read, so that
 * every decoder thread can hold a record while the next one is read. */
size_t df_cache_stream_default_prefetch(size_t largest_record, int threads);
/* A deterministic per-epoch shuffle of 0..n-1 (same seed + epoch, same order). */
void df_cache_shuffle(uint64_t seed, uint64_t epoch, uint64_t *order, size_t n);

df_cache_stream *df_cache_stream_open(df_cache *c, const df_cache_stream_opts *o, df_err *e);

/* 1: *it holds the next sample; 0: the order is exhausted; <0: error. */
int df_cache_stream_next(df_cache_stream *s, df_cache_item *it, df_err *e);

/* Gives a sample's slot back. */
void df_cache_stream_release(df_cache_stream *s, const df_cache_item *it);

void df_cache_stream_get_stats(df_cache_stream *s, df_cache_stream_stats *st);

void df_cache_stream_close(df_cache_stream *s);

#endif
