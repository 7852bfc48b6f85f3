/* cache_writer_internal.h - the writer's state, shared by the two files of
 * the background cache writer; not part of the public API (cache_writer.h).
 *
 *   cache_writer.c         open/put/flush/close, the encoder threads and the
 *                          I/O thread that appends records and finishes shards
 *   cache_writer_resume.c  what open() finds already on disk: finished shards,
 *                          the partial shard scanned and cut, the done ids
 *
 * Contract: every function here runs on the I/O side's state (fd, cur_*,
 * ents, part, done_ids) without taking w->mu: either on the I/O thread, or in
 * open()/close() while no writer thread runs. df_cw_resume runs in open(),
 * before the threads start, and leaves w as if the run had never stopped: the
 * partial shard open for appending at cur_size, ents/cur_* its records so far.
 */
#ifndef DF_CACHE_WRITER_INTERNAL_H
#define DF_CACHE_WRITER_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "cache_internal.h"
#include "cache_writer.h"
#include "io.h"

enum { JOB_QUEUED, JOB_ENCODED };

typedef struct job {
    uint64_t seq;
    df_cache_sample s;
    const void *layer_ptrs[DF_CACHE_MAX_LAYERS];
    void *raw;                  /* the copy of the caller's sample */
    size_t raw_bytes, reserved; /* reserved: what put() counted against the bound */
    uint8_t *rec;               /* encoded record (aligned) */
    size_t rec_cap, rec_len;
    uint64_t layer_raw[DF_CACHE_MAX_LAYERS], layer_stored[DF_CACHE_MAX_LAYERS];
    uint32_t n_loss;
    int state, failed;
    int chunks_pending;
    struct job *next;
} job;

struct df_cache_writer {
    char dir[4096];
    df_cache_params p;
    df_cache_writer_opts o;

    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_ready, cv_space;
    job *q_head, *q_tail;       /* waiting for an encoder */
    job **ring;                 /* by seq % ring_cap: waiting for the I/O thread */
    size_t ring_cap;
    uint64_t put_seq, write_seq;
    uint64_t unfinished;        /* jobs put and not yet released */
    size_t inflight, max_inflight;
    int closing, abandon;
    int err;
    df_err errmsg;
    pthread_t *workers;
    int nworkers;
    pthread_t io_thread;
    int io_started;

    /* I/O thread state */
    df_io *io;
    int fd;
    int cur_open;
    int fault_drain; /* test hook: the error drain() records as a failed write, or 0 */
    int lock_fd; /* flock'd .lock-rRRRR: one writer per rank and cache */
    uint32_t cur_seq;
    uint64_t cur_size;
    df_cache_entry *ents;
    size_t n_ents, cap_ents;
    uint64_t cur_tokens, cur_loss;
    uint64_t cur_raw[DF_CACHE_MAX_LAYERS], cur_stored[DF_CACHE_MAX_LAYERS];
    df_cache_part part;         /* finished shards and their totals */
    size_t cap_shards;

    /* resume */
    uint64_t *done_ids;
    size_t n_done;
    uint64_t last_id;
    int have_last;

    df_cache_writer_stats st;
};

/* <dir>/shard-rRRRR-SSSSS<suffix> of this writer's rank into out. */
void df_cw_shard_path(const df_cache_writer *w, uint32_t seq, const char *suffix, char *out,
                      size_t n);
/* Appends an entry to the current shard's index. 0, or -ENOMEM. */
int df_cw_add_entry(df_cache_writer *w, const df_cache_entry *t);
/* Adds a finished shard and its totals to w->part. 0, or -ENOMEM. */
int df_cw_part_add_shard(df_cache_writer *w, const df_cache_shard_info *si, const uint64_t *raw,
                         const uint64_t *stored, uint64_t loss);
/* Finds this rank's shards in w->dir and takes up where they end
 * (cache_writer_resume.c). 0, or a negative code with e set. */
int df_cw_resume(df_cache_writer *w, df_err *e);

#endif
