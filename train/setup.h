/* setup.h - the pieces of a training run that train.c's df_train_run puts
 * together (internal to train/): setup.c (the run lock, the drafter config,
 * the rows' memory, the frozen embedding and head, the start, the
 * gradients' wiring, the log, the data) and best.c (RUN/best). Each returns
 * 0 or a negative errno-style code with a message in e. */
#ifndef DF_TRAIN_SETUP_H
#define DF_TRAIN_SETUP_H

#include <stdint.h>
#include <stdio.h>

#include "batch.h"
#include "best.h"
#include "cache.h"
#include "ckpt.h"
#include "drafter.h"
#include "feed.h"
#include "hfconfig.h"
#include "params.h"
#include "projected.h"
#include "safetensors.h"
#include "train.h"
#include "zero.h"

/* RUN/best/ (best.h): rank 0 keeps the export of the step whose evaluation
 * scored highest. */
typedef struct best_state {
    int on;          /* rank 0, an evaluation cache, not --no-best */
    int have;        /* best: RUN/best's record (from best.json or written by this run) */
    df_best best;
} best_state;

/* RUN/.lock, flock()ed for the whole run by its lead rank, holding that process's
 * pid: a second `train` into the same RUN (which would interleave checkpoints and
 * log lines with the first) is refused naming the holder. The lock goes with the
 * process (a killed run leaves none behind). Returns the descriptor (>= 0) to keep
 * open, or a negative code: -EBUSY when another process holds it. */
int train_run_lock(const char *run_dir, df_err *e);

/* The target's frozen embedding and head. The head is lm_head.weight; the embedding
 * stands in for it only where config.json says they are tied: without that, a missing
 * lm_head.weight is an error (a head silently replaced by the embedding trains a
 * drafter against the wrong logits). */
int train_load_target_head(df_st **st, const char *dir, int64_t V, int H, int tied,
                           df_tensor *embed, df_tensor *head, df_err *e);

/* The drafter config: docs/DRAFTER.md shapes; what is not given comes from
 * --init-from's config (icp, may be NULL), else from the target (tc; the
 * feature layers: the cache's, n_src ids src_ids, or the cache's projection).
 * *from_init: the feature layer ids came from icp. Not yet validated. */
int train_resolve_config(const df_train_opts *o, const df_drafter_config *icp,
                         const df_model_config *tc, const df_cache_params *cp, uint32_t n_src,
                         const int32_t *src_ids, df_drafter_config *c, int *from_init, df_err *e);

/* The feeder's rows (FEED_SLOTS steps of nrows rows, allocated lazily, so too
 * many would only fail mid-run) must fit in this machine's memory: -ENOMEM
 * naming the option to lower, checked before anything is written. */
int train_check_row_memory(const df_train_opts *o, const df_drafter_config *c, int n_feat,
                           const df_cache_params *cp, int nrows, df_err *e);

/* The run's start: the latest checkpoint in RUN (settings and shape checked
 * against this command's, this rank's RNG state and data position), or a
 * fresh one (weights from --init-from or drawn; the run's settings). */
int train_start_state(const df_train_opts *o, const df_drafter_config *c,
                      const df_drafter_config *icp, const df_cache_params *cp, const df_params *ps,
                      int64_t total, df_basis *basis, int world, int rank, int lead,
                      df_ckpt_state *ck, df_rng *rng, data_pos *dp, int64_t *step0, df_err *e);

/* The frozen embedding and head where the backend computes: random ones for
 * benchmarks (--random-target), else the target's as bf16 on a device
 * (dev_embed, dev_head: backend memory to free), else as loaded. */
int train_frozen_on_backend(const df_train_opts *o, df_backend *be, const df_model_config *tc,
                            df_tensor *embed, df_tensor *head, void **dev_embed, void **dev_head,
                            df_err *e);

/* How the gradients meet the drafter: the optimizer overlapping the next
 * forward (--overlap-optimizer; by default where the buckets fit the
 * backend's marks), their dtype, and with one row per step the layers'
 * activations living in them until their backward (ds's alias ranges). */
int train_wire_grads(const df_train_opts *o, df_drafter *d, const df_params *ps, int nl, int nrows,
                     dev_state *ds, df_err *e);

/* RUN/log.jsonl for appending (its lines past step0 dropped, a resume's),
 * with the run line of this start (runlog.h). */
int train_open_log(const df_train_opts *o, const char *logpath, int64_t step0, const char *backend,
                   int world, const char *settings_json, FILE **logf, df_err *e);

/* This rank's samples of the cache from data position dp (its share of each
 * epoch's order), and the feeder thread that builds each step's rows from
 * them ahead of the step, until --stop-after or --steps. */
int train_open_data(const df_train_opts *o, df_backend *be, df_cache *cache, uint64_t layer_mask,
                    int rank, int world, const data_pos *dp, df_rng *rng, const df_drafter_config *c,
                    int n_feat, const int *cache_index, int nrows, const df_batch_config *bc,
                    int64_t step0, source *src, feeder *fd, df_err *e);

/* The best so far: RUN/best/best.json when there is one (a resumed run, or one
 * stopped before its first checkpoint); a damaged one is an error. */
int best_open(best_state *bs, const char *run_dir, df_err *e);

/* After an evaluation whose figures are r (at step r->step): RUN/best is
 * replaced when r scores strictly higher than the best so far, or when that
 * best was of another evaluation (metric, cache, rows, blocks), which cannot
 * be compared.
 *
 * The weights written are ds->w, the ones just evaluated. They are the same on
 * every rank: ZeRO-1 shards only the fp32 master and the moments, the weights
 * the drafter reads (bf16 on a GPU, f32 on CPU ranks) are all-gathered after
 * every step; so rank 0 writes it alone, with no collective the other ranks
 * would have to join. bf16 weights are the master rounded to nearest even, as
 * the export rounds it: the files are bit for bit what RUN/export would hold
 * at that step. Sharded, the weights come to the host through ck_master (the
 * host copy of the fp32 master, which a sharded run reads only when placing
 * the state, and fetches again before every checkpoint and the export). */
int best_update(best_state *bs, df_best *r, const df_train_opts *o, df_backend *be,
                const dev_state *ds, const df_drafter_config *c, const df_params *ps,
                float *ck_master, const df_basis *basis, df_err *e);

#endif
