/* train.h - stage 2: train a DFlash drafter from a cache (CPU or one GPU).
 *
 * A step = rows_per_step packed rows (documents streamed from the cache in a
 * per-epoch shuffled order, anchors sampled per row); the loss is
 * sum(w * CE) over the step divided by the step's sum of weights; the
 * hand-written backward accumulates gradients; global-norm clipping; AdamW
 * over fp32 master weights; warmup + cosine LR. Everything random comes
 * from seeded generators whose state is checkpointed with the weights, the
 * optimizer and the data position, so a resumed run continues exactly (bit
 * for bit on the CPU) as an uninterrupted one. On a GPU the fp32 master,
 * Adam moments and gradients live on the device, the drafter computes with
 * a bf16 copy of the master that the optimizer rewrites each step, and the
 * host holds copies only to write checkpoints and the export.
 *
 * RUN/ holds the checkpoints (train/ckpt.h), log.jsonl (one JSON object per
 * logged step, evaluation and (re)start: train/runlog.h) and, at the end, export/ (config.json + model.safetensors
 * that serving engines load); with an evaluation cache also best/, the export
 * of the best evaluation (train/best.h).
 */
#ifndef DF_TRAIN_H
#define DF_TRAIN_H

#include <stdint.h>

#include "err.h"
#include "hfconfig.h"
#include "ops.h"

/* --fp8 auto's narrowest drafter: below it the rounding passes cost more than the FP8 GEMMs
 * save (docs/FP8.md, "When it pays") */
#define DF_FP8_AUTO_MIN_HIDDEN 2048

typedef struct df_train_opts {
    const char *cache_dir, *target_dir, *run_dir;
    const char *random_target;  /* benchmarks: a config.json whose embedding and head are drawn
                                   at random (no checkpoint; the cache's target is not checked) */
    /* A drafter export to start from (config.json + model.safetensors: ours, or a
     * released DFlash drafter of the same tensor names), NULL = none. Its weights
     * start the run with a fresh optimizer (step 0, the warmup as set); its config
     * gives the shape options below left at their defaults, and must agree with
     * those given (an error names the key and both values). On a projected cache
     * fc_r = fc P^T. Only a fresh run takes it: a run resumes from its checkpoints,
     * which record the config it started from (a mismatch is refused). */
    const char *init_from;
    /* drafter shape (0 = default: init_from's, else the target's sizes, docs/DRAFTER.md) */
    int layers;                 /* default 1 */
    const char *layer_types;    /* "full", "sliding", or a comma list per layer; default: all
                                   sliding but the last (full) */
    int sliding_window;         /* default 2048 */
    int intermediate, heads, kv_heads, head_dim;
    int block_size;             /* default 16 */
    int64_t mask_token_id;      /* required (>= 0) unless init_from; -1 = not given */
    const int *target_layers;   /* subset of the cache's layers, or NULL = all (init_from's) */
    int n_target_layers;
    /* evaluation on a held-out cache (same target and layers): forward only, the same rows
     * each time; logged as eval_loss / eval_tau_hat / eval_acc lines in log.jsonl */
    const char *eval_cache;     /* NULL: none */
    int eval_every;             /* steps between evaluations (0: only at the end) */
    int eval_rows;              /* rows per evaluation (0 = 64) */
    int no_eval_walk;           /* skip the evaluation's walk (tau_walk; train.c) */
    int no_best;                /* do not keep RUN/best/ (best.h: the export of the step whose
                                   evaluation scored highest, tau_walk or without the walk
                                   tau_hat); kept by default when evaluating */
    /* data */
    int max_tokens;             /* context tokens per row, default 4096 */
    int max_anchors;            /* blocks per row, default 512 */
    int rows_per_step;          /* default 1 */
    double gamma;               /* default 7 */
    float noise;                /* uniform feature noise, default 0 */
    int recompute;              /* 0: keep every activation; 1 (default): recompute the cheap
                                   ones in the backward (less memory, same results); 2: the
                                   MLP's gate/up GEMMs too */
    int fp8;                    /* FP8 training (drafter.h, df_drafter_set_fp8): 1 on, 0 off,
                                   -1 (default) auto: on where the backend has verified FP8
                                   tensor cores (df_backend_fp8_tensor_cores) and the drafter's
                                   hidden size is at least DF_FP8_AUTO_MIN_HIDDEN; the run
                                   records what it chose */
    int fp8_dy_blocks;          /* with fp8: the weight gradients' dy per 128 x 128
                                   (df_drafter_set_fp8_dy_blocks); default 1, 0: 128 x 1 */
    int fp8_ce_onepass;         /* with fp8: the LM head's softmax gradient in one pass
                                   (df_drafter_set_fp8_ce_onepass); default 0 */
    int adam_bf16;              /* AdamW's moments in BF16, stochastically rounded
                                   (df_op_adamw_m16): half their memory and traffic; default 0 */
    int adam_m_bf16;            /* the first moment alone in BF16 (v F32); default 1 (the
                                   quality gate: docs/DESIGN.md), 0: F32; implied by adam_bf16 */
    int adam_v16;               /* with m in BF16, v in UF16 (common/uf16.h: 11 significant
                                   bits, stochastically rounded); default 0; needs clip in
                                   (0, 4] (v stays below UF16's 64); not with adam_bf16 */
    int bf16_logits;            /* training steps' LM-head logits rounded to BF16
                                   (df_drafter_set_bf16_logits): half their bytes; default 0 */
    int f16_logits;             /* the same in FP16 (df_drafter_set_f16_logits): 11 significant
                                   bits against BF16's 8; default 0; not with bf16_logits */
    int grad_f32;               /* GPU: keep gradients in F32 (default BF16: half the memory
                                   and the reduce-scatter traffic); the CPU always uses F32 */
    int buffered_io;            /* read the cache through the page cache (no O_DIRECT): a cache
                                   that fits in RAM is then read from memory after one epoch */
    /* optimisation */
    int64_t steps;              /* required (> 0; 0 with init_from: no step, only the export
                                   and, with eval_cache, the evaluation at step 0) */
    double lr, min_lr, warmup_frac, clip, init_std;
    uint64_t seed;              /* data order, anchors, noise; and the init unless init_seed */
    uint64_t init_seed;         /* the weights' initial draw; 0 = seed */
    int fc_init_random;         /* fc drawn like the other linear weights; default (0): fc starts
                                   as the mean of the K feature layers (train.c, "fc_init_mean") */
    const char *init_seed_for;  /* "PREFIX=S[,PREFIX=S...]": parameters whose names start with
                                   PREFIX drawn with seed S (finding which draw matters); NULL */
    /* bookkeeping */
    int log_every, ckpt_every, keep_last;
    int no_ckpt;                /* write no checkpoint at all, not even at the end (benchmarks) */
    int no_grad_alias;          /* keep activations out of the gradient array (by default, with
                                   one row per step, layers' saved activations live in the
                                   gradients of the layer below until its backward) */
    int overlap_opt;            /* the optimizer of a step runs on a side stream, bucket by bucket,
                                   while the next step's forward starts (same results). 1: on
                                   (-ENOTSUP beyond DF_BACKEND_MARKS buckets), 0: off, -1 (the
                                   default): on where the buckets allow it */
    int threads;                /* backend threads; 0 = all CPUs */
    const char *device;         /* "cpu", "cuda" or "auto" (NULL = cpu) */
    int gpu;                    /* CUDA device index */
    int64_t stop_after;         /* testing: stop (as if killed) after this many steps; 0 = off */
    /* data parallel: this process is rank `rank` of `world` (one per GPU, or CPU ranks on
     * one machine); run_id names this launch's rendezvous files in run_dir (ranks > 1) */
    int rank, world;
    const char *run_id;
    const char *master_addr;    /* GPU ranks: with master_port, rank 0's MASTER_ADDR:MASTER_PORT,
                                   where the ranks meet over TCP (no shared disk needed; comm.h);
                                   NULL: through run_id's file in run_dir */
    int master_port;            /* 1..65535, or 0 */
    int replicate_data;         /* testing: every rank reads rank 0's rows, so N ranks must give
                                   one rank's weights (exact on the CPU) */
    int quiet;
} df_train_opts;

void df_train_opts_defaults(df_train_opts *o);

/* AdamW's moments the options ask for: 0 both F32, 1 m in BF16, 2 both BF16, 3 m in BF16
 * and v in UF16 */
static inline int df_train_moments16(const df_train_opts *o)
{
    return o->adam_v16 ? 3 : o->adam_bf16 ? 2 : o->adam_m_bf16 ? 1 : 0;
}

int df_train_run(const df_train_opts *o, df_err *e);

#endif
