/* extract.h - stage 1: run the target over a corpus once, write the cache.
 *
 * Documents are packed into forward batches of about batch_tokens tokens
 * (a longer document runs alone); the feature layers' hidden states go to
 * the background cache writer (compression workers, io_uring). Rank r of
 * world_size takes documents i with i % world_size == r. Rerunning on an
 * unfinished cache resumes after its last complete, verified sample.
 */
#ifndef DF_EXTRACT_H
#define DF_EXTRACT_H

#include <stdint.h>

#include "err.h"
#include "ops.h"

typedef struct df_extract_opts {
    const char *model_dir, *data_path, *out_dir;
    const char *random_config; /* non-NULL: a random-weight model of this config (benchmarks) */
    uint64_t random_seed;
    int n_layers;            /* layers by the DFlash rule when layer_ids is NULL; 0 = min(5, L-3) */
    const int *layer_ids;    /* explicit 0-based target layer ids, or NULL */
    int n_layer_ids;
    int codec, codec_level;
    int64_t batch_tokens;    /* tokens per forward (0 = 8192) */
    int64_t max_len;         /* longest document accepted (0 = max_position_embeddings) */
    int threads;             /* compression threads (0 = all CPUs) */
    uint32_t rank, world_size;
    int force_fallback_io, buffered;
    int progress;            /* 1: a progress line on stderr */
    const char *basis_path;  /* a basis.dfb (formats/basis.h) of these layers: write a projected
                                cache, z = P x per token (projected on the CPU, over `threads`),
                                the basis copied into it; NULL: the features themselves */
} df_extract_opts;

typedef struct df_extract_stats {
    uint64_t docs, tokens;               /* written this run */
    uint64_t docs_skipped_resume, docs_empty;
    uint64_t raw_bytes, stored_bytes;
    double seconds, forward_seconds;
    double setup_seconds;                /* model load (or random init), corpus open */
    double writer_wait_seconds;          /* the forward waited on compression / the disk */
    int64_t mem_setup_bytes;             /* device memory in use after the model's load, and */
    int64_t mem_peak_bytes;              /* the most after any batch (all processes on the device:
                                            cudaMemGetInfo); -1: not known (CPU backend) */
    int layer_ids[64];
    int n_layers;
    const char *io_backend;
} df_extract_stats;

int df_extract_run(const df_extract_opts *o, df_backend *be, df_extract_stats *st, df_err *e);

#endif
