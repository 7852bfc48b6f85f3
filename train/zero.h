/* zero.h - the optimizer state of a rank (internal to train/): ZeRO-1 shards,
 * gradient buckets and their hooks, AdamW. */
#ifndef DF_TRAIN_ZERO_H
#define DF_TRAIN_ZERO_H

#include <stdint.h>

#include "ckpt.h"
#include "comm.h"
#include "drafter.h"
#include "err.h"
#include "ops.h"
#include "params.h"

/* The optimizer's arrays where the backend computes, sharded over the ranks
 * (ZeRO-1).
 *
 * The flat parameter array is cut into buckets at layer boundaries, in
 * memory order: [fc, hidden_norm, layer 0 ...), [layer 1 ...), ...,
 * [layer L-1 ..., norm), each boundary rounded up to a multiple of
 * world * DS_ALIGN (the last one is the padded total np). The backward
 * finishes the buckets from the last to the first (layer L-1's gradients,
 * with the final norm's, first; fc's last), and a rounded-up boundary only
 * moves a few elements of layer k into bucket k-1, which finishes later: so
 * bucket k+1 can be reduce-scattered as soon as layer k's backward is done.
 * Rank r owns slice r of every bucket; its shard (master, moments) is the
 * concatenation of its slices, and AdamW runs per bucket on the shard,
 * writing the weights the drafter reads at their place in the full array,
 * which an all-gather per bucket then completes. The reduce-scatter is in
 * place: rank r's reduced gradients land in slice r of the bucket in its own
 * gradient array (ds_gslice), where AdamW reads them; a separate shard of
 * reduced gradients would cost np / world more (1.6 GiB at 2 ranks, 27B).
 *
 * One rank on the CPU with F32 moments: no copies, master/m/v are the
 * checkpoint's host arrays and the drafter reads the fp32 master. BF16
 * moments (df_op_adamw_m16) live on the backend on every rank and widen
 * exactly into the checkpoint's F32 arrays (a checkpoint holds F32 moments
 * either way). Otherwise every array is
 * backend memory: the gradient full size (np) and the shards np/world; the
 * weights the drafter reads are bf16 on a GPU (the optimizer's output), F32
 * on the CPU (ranks > 1: the all-gathered master). Gradients are BF16 on a
 * GPU (unless --grad-f32) and F32 on the CPU: the backward rounds each
 * op's fp32 sum into them, the reduce-scatter adds in that dtype, AdamW
 * widens them. */
#define DS_ALIGN 64
#define DS_MAX_BUCKETS (DF_MAX_LAYERS + 2)

typedef struct dev_state {
    int sharded;               /* 0: one CPU rank, the checkpoint's arrays in place */
    int world, rank;
    df_comm *comm;
    int64_t n, np, nshard;     /* parameters, padded, per rank */
    int nb;                    /* buckets */
    int64_t b[DS_MAX_BUCKETS + 1], cnt[DS_MAX_BUCKETS], soff[DS_MAX_BUCKETS];
    float *master, *m, *v;     /* [nshard] (or the checkpoint's [n]); m NULL with m16, v with v16 */
    uint16_t *m16, *v16;       /* [nshard] m in BF16 (--adam-m-bf16, --adam-bf16, --adam-v16),
                                  v in BF16 (--adam-bf16) or UF16 (--adam-v16); else NULL */
    df_dtype vdt;              /* v's: F32, BF16 or UF16 */
    uint64_t sr_seed;          /* m16: the run's seed, for the moments' stochastic rounding */
    void *grad;                /* [np] this rank's gradients (gdt), its slices reduced in
                                  place; scratch for checkpoints */
    df_dtype gdt;
    size_t ges;                /* its element size */
    void *w;                   /* [np] the weights the drafter reads */
    df_dtype wdt;
    int next_bucket;           /* the grad hook's next bucket to reduce (counting down) */
    /* overlap: AdamW (+ all-gather, + zeroing the bucket's gradients) runs on
     * the backend's side stream bucket by bucket, each bucket ending with
     * mark k; the next forward waits for mark part_mark[p + 1] before part p
     * (-1 context, layers, L final norm): the last bucket holding any of its
     * weights (marks complete in order) */
    int overlap;
    int part_mark[DF_MAX_LAYERS + 2];
    df_backend *be;
    df_err *hook_err;
} dev_state;

void dev_state_free(df_backend *be, dev_state *s);
/* moments16: 0 AdamW's moments F32, 1 m in BF16, 2 m and v in BF16, 3 m in BF16 and v in
 * UF16 */
int dev_state_open(df_backend *be, df_comm *comm, df_ckpt_state *ck, float *grad,
                   int64_t n, const df_params *ps, int L, int grad_f32, int moments16,
                   uint64_t seed, dev_state *s, df_err *e);
int ds_grad_hook(void *ctx, int layer);
void ds_part_marks(dev_state *s, const df_params *ps, int L);
int ds_fwd_hook(void *ctx, int part);
void *ds_gslice(const dev_state *s, int k);
int dev_state_adamw(df_backend *be, dev_state *s, float lr, int64_t t, float gscale,
                    df_err *e);
/* FP8 training with one rank: asks the backend to keep each weight matrix's E4M3 codes,
 * written by AdamW with the weights (df_backend_fp8_keep_weight_codes; nothing else writes
 * s->w between steps); *kept of them, *gib of memory. Other worlds keep none (a rank's AdamW
 * writes part of a matrix, the all-gather the rest). 0 or a negative error. */
int ds_keep_weight_codes(df_backend *be, dev_state *s, const df_params *ps, int *kept,
                         double *gib, df_err *e);
int dev_state_fetch(df_backend *be, dev_state *s, df_ckpt_state *ck, df_err *e);

#endif
