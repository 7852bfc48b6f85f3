/* feed.h - a rank's training rows (internal to train/): the documents of
 * the cache in each epoch's shuffled order, this rank's share (the source),
 * and the thread that builds the rows of the next steps ahead of the loop
 * (the feeder). Functions return 0 or a negative errno-style code with e set. */
#ifndef DF_TRAIN_FEED_H
#define DF_TRAIN_FEED_H

#include <pthread.h>
#include <stdint.h>

#include "batch.h"
#include "cache.h"
#include "cache_stream.h"
#include "drafter.h"
#include "err.h"
#include "ops.h"

/* The document source: documents in the shuffled order of epoch `epoch`,
 * from position `pos`; at the end of an epoch the next one starts with a new order. One document may be
 * held back ("pending") when it did not fit in a row. */
typedef struct source {
    df_cache *cache;
    uint64_t layer_mask;
    int threads;
    uint64_t seed;
    uint64_t *order;            /* [n_all]: the epoch's order, this rank's share first */
    size_t n_all;               /* documents in the cache */
    size_t n;                   /* this rank's documents: order[rank], order[rank + world], ... */
    int rank, world;
    int buffered;               /* page-cache reads instead of O_DIRECT */
    int ahead;                  /* open the next epoch's stream before this one ends */
    df_cache_stream *next_s;    /* that stream (epoch next_epoch), or NULL */
    uint64_t next_epoch;
    uint64_t epoch;
    size_t pos;                 /* position in order of the next document to hand out */
    df_cache_stream *s;
    df_cache_item pending;
    int have_pending;
} source;

/* Where a rank's data stands: epoch, position in its order, tokens so far. */
typedef struct data_pos {
    uint64_t epoch, pos, tokens;
} data_pos;

/* The feeder: a thread that builds the rows of upcoming steps while the backend computes
 * the current one: two slots, each one step's rows in host memory the
 * backend uploads from fastest (pinned on CUDA), filled strictly in step
 * order from one source and one RNG, so the rows are the same as built
 * inline. Each slot records the data position and the RNG state after its
 * rows: a checkpoint after step s saves slot s's, and a resumed run rebuilds
 * step s+1 exactly. */
#define FEED_SLOTS 2

typedef struct feed_slot {
    df_batch **rows;          /* [nrows] */
    uint16_t **feat_bf16;     /* [nrows] caller buffers of the rows (BF16 out) */
    int32_t **argmax;         /* [nrows] the rows' argmax, downloaded by the step's sync */
    double denom, flops;
    uint64_t tokens;
    data_pos after;           /* epoch / position after these rows */
    uint8_t rng_after[32];
    double build_s, read_s;   /* the build's wall time, and its wait for the source's items */
    int ready;                /* 1: built, not yet consumed */
    int rc;                   /* build error (with err) */
    df_err err;
} feed_slot;

typedef struct feeder {
    df_backend *be;
    source *src;
    df_rng *rng;
    const df_drafter_config *c;
    const int *cache_index;
    int n_feat;                  /* features per token as stored: K, or 1 (a projected cache) */
    const char *cache_dir;
    int nrows;
    int64_t next_step, end_step; /* steps [next_step, end_step) still to build */
    feed_slot slot[FEED_SLOTS];
    pthread_t th;
    int started, stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} feeder;

int source_open_at(source *src, uint64_t epoch, size_t pos, df_err *e);
int source_next(source *src, df_cache_item *it, df_err *e);
void source_push_back(source *src, const df_cache_item *it);
size_t source_position(const source *src);
/* Releases what the source holds (its streams, a held-back document, the order); src zeroed. */
void source_close(source *src);
int feeder_open(feeder *f, const df_batch_config *bc, int64_t step0, int64_t steps,
                df_err *e);
void feeder_close(feeder *f);
feed_slot *feeder_take(feeder *f, int64_t step, df_err *e, int *rc);
feed_slot *feeder_peek(feeder *f, int64_t step);
void feeder_release(feeder *f, feed_slot *sl);

#endif
