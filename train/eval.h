/* eval.h - evaluation on a held-out cache (internal to train/). */
#ifndef DF_TRAIN_EVAL_H
#define DF_TRAIN_EVAL_H

#include <stdint.h>
#include <stdio.h>

#include "batch.h"
#include "best.h"
#include "cache.h"
#include "drafter.h"
#include "err.h"

/* Evaluation: acc[k], tau_hat and the loss on a held-out cache, forward
 * only: the same documents (the first `rows` rows of a fixed order) and the same anchors
 * (a fixed seed) at every evaluation, so the numbers compare across steps.
 *
 * tau_walk: tau_hat averages over anchors spread evenly, but decoding puts
 * each anchor where the last verification ended: it crosses an easy stretch
 * in a few verifications and spends most of them on hard positions, so its
 * tokens per verification are lower (docs/E2E.md: 2.34 evenly against 1.54
 * decoding on qwen3-code-8m). The walk scores every candidate of each row
 * (max_anchors at a time, interleaved, with df_batch_set_anchors; blocks do
 * not see each other, so each anchor's result is the same in any set), then
 * walks each document as greedy decoding would: from the first candidate,
 * p -> p + accepted(p) + 1, one verification per step; at a position that
 * is not a candidate (a completion's last token, a prompt) it goes on at
 * the next candidate. tau_walk = tokens / verifications: what decoding on
 * this text would give if the target's greedy output were the text (it is
 * for a corpus of the target's own greedy completions). Costs about
 * candidates / max_anchors forward passes per row. */
typedef struct eval_ctx {
    df_cache *cache;
    int cache_index[DF_BATCH_MAX_FEATURES];
    uint64_t layer_mask;
    df_batch *row;
    int rows;
    uint64_t seed;
    int walk;                 /* score every candidate and walk (tau_walk) */
    int32_t *cand, *acc_at;   /* [max_tokens]: the row's candidates; accepted per position */
    int32_t *anch, *blk_acc;  /* [max_anchors]: one pass's anchors; their accepted */
} eval_ctx;

/* Opens the held-out cache path for drafter config c trained on a cache of
 * params cp: the same target (config_sha256, NULL: not checked, a random
 * target; hidden size), the same projection, the drafter's layers mapped;
 * its row built like the training rows (bc) but without noise; rows rows per
 * evaluation (<= 0: 64), the walk when walk. train_cache names the training
 * cache in messages. On error ev holds what to free (eval_close). */
int eval_open(eval_ctx *ev, const char *path, const df_batch_config *bc, const df_drafter_config *c,
              const df_cache_params *cp, const char *config_sha256, int hidden, int rows, int walk,
              const char *train_cache, df_err *e);
/* Frees what eval_open made; a zeroed ev is fine. */
void eval_close(eval_ctx *ev);

/* One evaluation, logged to logf (logpath: its name in messages); *res gets
 * its figures (res->eval_cache is left to the caller). */
int run_eval(eval_ctx *ev, df_drafter *d, const void *w, int K, int64_t step, FILE *logf,
             const char *logpath, int quiet, int bs, df_best *res, df_err *e);


#endif
