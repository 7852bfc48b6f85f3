/* drafter.h - the DFlash drafter (docs/DRAFTER.md) forward, loss and backward over
 * one packed row, on a backend, written once against the op interface.
 *
 *   C   = RMSNorm_hidden(F @ fc^T)                   context, shared by all layers
 *   x   = E_target[block_ids]                        frozen target embedding
 *   per layer: a = RMSNorm_in(x); q = RoPE(q_norm(a Wq)); k/v of [C ; a] (same Wk, Wv;
 *              k_norm + RoPE on k; context positions restart per document);
 *              x += DFlashAttn(q, k, v) Wo; x += down(silu(gate b) * up b), b = RMSNorm_post(x)
 *   logits = lm_head_target(RMSNorm_final(x))       frozen target head; CE never materialised
 *
 * Parameters are a flat array in the layout of params.h, in backend memory:
 * F32 on the CPU backend (the fp32 master itself), BF16 on CUDA (the bf16
 * copy the optimizer writes). Gradients accumulate (F32 by default, or BF16:
 * df_drafter_set_grad_dtype; backend memory) into a flat array of the same
 * layout, so several rows (and accumulation steps) sum up before one
 * optimizer step. Row inputs are host memory; a
 * device backend uploads them. The loss of a row is sum(w * CE) / denom, with denom
 * the global sum of weights of the whole step (docs/DRAFTER.md).
 */
#ifndef DF_DRAFTER_H
#define DF_DRAFTER_H

#include <stdint.h>

#include "hfconfig.h"
#include "ops.h"
#include "params.h"
#include "train_ops.h"

#define DF_DRAFTER_MAX_BLOCK 64

/* One packed row, as the batch builder makes it. */
typedef struct df_drafter_row {
    int64_t S;                 /* context tokens */
    const void *feat;          /* [S, K*H] target features, host memory */
    df_dtype feat_dtype;       /* F32 (0 = F32) or BF16; the CPU backend takes F32 */
    const int32_t *ctx_pos;    /* [S] positions, restarting per document */
    df_dflash_blocks blocks;   /* n_blocks anchors (window set per layer by the drafter) */
    const uint32_t *block_ids; /* [n_blocks * bs]: anchor token, then mask tokens */
    const int32_t *block_pos;  /* [n_blocks * bs] */
    const int32_t *labels;     /* [n_blocks * bs], -1 = none */
    const float *weights;      /* [n_blocks * bs] loss weights */
    /* Device backends: 1 when feat, labels and weights are df_backend_host_alloc
     * memory left unchanged until the caller's next df_backend_sync: they are
     * then uploaded without waiting (the GPU keeps running the previous row). */
    int pinned;
    /* NULL: acc[k] / tau counts are added to the metrics at once (a device
     * backend waits for the row's argmax). Else [n_blocks * bs] host memory
     * (pinned on a device) that gets, by the caller's next df_backend_sync,
     * the argmax of the row's scored positions (label >= 0 and weight > 0)
     * in order, packed at the front; the caller then adds the counts with
     * df_drafter_row_metrics. */
    int32_t *argmax_out;
    /* 1: a row step with gradients writes them instead of adding them: every element of the
     * parameters' ranges of grad is set (the GEMMs' weight gradients without accumulation,
     * the norms' zeroed before their sums), so grad needs no clearing first, whatever it
     * held (a step's first row). 0: added (the rows after it). The same results. */
    int grad_write;
} df_drafter_row;

/* What one row contributes to the step's metrics (summed over rows). */
typedef struct df_drafter_metrics {
    double loss_sum;           /* sum w * CE (divide by the step's denominator) */
    double weight_sum;
    uint64_t correct[DF_DRAFTER_MAX_BLOCK], counted[DF_DRAFTER_MAX_BLOCK]; /* acc[k] */
    uint64_t blocks;           /* valid blocks */
    uint64_t accepted;         /* sum over valid blocks of leading correct positions */
    /* optional, the caller's [n_blocks] (not accumulated: each row step
     * overwrites it): each valid block's leading correct positions, -1 for
     * padding blocks. The evaluation's walk (train.c) reads it. */
    int32_t *block_accepted;
} df_drafter_metrics;

typedef struct df_drafter df_drafter;

/* embed, head: the target's frozen [V, H] embedding and lm_head (any float
 * dtype; the caller keeps them alive). */
int df_drafter_open(const df_drafter_config *c, df_backend *be, const df_tensor *embed,
                    const df_tensor *head, df_drafter **out, df_err *e);
void df_drafter_close(df_drafter *d);
const df_params *df_drafter_params(const df_drafter *d);

/* Forward + loss (+ backward when grad is not NULL: gradients of
 * sum(w*CE)/denom are ADDED to grad, or written there under row->grad_write,
 * in df_drafter_grad_dtype). params: the
 * flat weights (F32 on the CPU, BF16 on CUDA). */
int df_drafter_row_step(df_drafter *d, const void *params, const df_drafter_row *row,
                        float denom, void *grad, df_drafter_metrics *m, df_err *e);

/* The features of the row the next df_drafter_row_step will take (same
 * feat pointer and S), sent now on the backend's copy stream so the upload
 * overlaps what is enqueued after this call (the optimizer step); it
 * starts once the work enqueued so far (the current row's backward, the
 * last reader of the features) has run. Device backends, pinned rows of
 * the activation dtype that fit the workspace; otherwise (and on the CPU)
 * nothing is done and row_step uploads as usual. row->feat must stay
 * unchanged until the sync after that row_step. Returns 1 when sent, 0 when
 * not, or a negative error code. */
int df_drafter_prefetch_row(df_drafter *d, const df_drafter_row *row);

/* The gradient array's dtype: F32 (the default) or BF16 (half the memory:
 * every weight gradient is its fp32 sum plus the old value, rounded to bf16
 * once per op that adds to it, as bf16 training in PyTorch keeps them).
 * Returns 0 or -EINVAL (another dtype). */
int df_drafter_set_grad_dtype(df_drafter *d, df_dtype dt);
df_dtype df_drafter_grad_dtype(const df_drafter *d);

/* Called by the backward of df_drafter_row_step as gradients become final
 * for that row: after layer l's backward with l (l = L-1 down to 0; the
 * final norm's gradient is done by then too), and with -1 after the last
 * (fc, hidden_norm). A non-zero return fails the step with that code. The
 * trainer starts the reduce-scatter of a gradient bucket from here on the
 * step's last row, so communication overlaps the rest of the backward.
 * fn NULL: none. */
typedef int (*df_drafter_grad_hook)(void *ctx, int layer);
void df_drafter_set_grad_hook(df_drafter *d, df_drafter_grad_hook fn, void *ctx);

/* Called by the forward of df_drafter_row_step before it first reads
 * weights of a part: -1 before fc and hidden_norm (the context), l before
 * layer l, L before the final norm. The trainer makes the backend wait there
 * for the optimizer's update of those weights (df_backend_wait_mark), so the
 * optimizer of one step overlaps the forward of the next. A non-zero return
 * fails the step with that code. fn NULL: none. */
typedef int (*df_drafter_fwd_hook)(void *ctx, int part);
void df_drafter_set_fwd_hook(df_drafter *d, df_drafter_fwd_hook fn, void *ctx);

/* Memory for time. Level 1: the cheap activations (the input and post
 * norms' outputs, q/k after their norms and RoPE, the SwiGLU product) are
 * not kept per layer but recomputed in the backward from the saved inputs,
 * with the same ops, so results are bitwise the same (N = 8192, the 27B
 * drafter shape: ~0.5 GB per layer less, ~0.2% slower). Level 2: also the
 * MLP's gate and up projections (two GEMMs per layer again: ~0.57 GB per
 * layer less at that shape, ~8% more model FLOPs), the same bits too.
 * Default 0. */
void df_drafter_set_recompute(df_drafter *d, int level);

/* FP8 training (docs/FP8.md): every GEMM of a row step with gradients takes
 * its operands rounded to E4M3 with power-of-two block scales (activations
 * 1 x 128 along the reduction, weights and the frozen LM head 128 x 128,
 * the weight gradients' operands 128 x 1), FP32 accumulation; attention,
 * norms and the optimizer as in BF16 training. Forward-only row steps
 * (evaluation) keep the BF16 GEMMs: what serving the export computes. On
 * costs a copy of the weights and of the LM head and two activation-sized
 * scratch buffers. Returns 0, or -ENOMEM / another error with e set. */
int df_drafter_set_fp8(df_drafter *d, int on, df_err *e);
/* With FP8 on: the weight gradients' GEMMs round dy per 128 x 128 block instead of 128 x 1
 * (DF_FP8_DY_BLOCKS: cuBLASLt's faster kernel on sm_90; other numerics). Off for a drafter
 * as opened; the trainer turns it on (df_train_opts.fp8_dy_blocks, docs/FP8.md). */
void df_drafter_set_fp8_dy_blocks(df_drafter *d, int on);

/* With FP8: the LM head's softmax gradient split as the softmax part, rounded
 * per 1 x 128 block against the block's own max in one read of the logits,
 * and the label's term, exact (DF_CE_FP8_ONEPASS, train_ops.h). Off as
 * opened; the trainer's --fp8-ce-onepass turns it on (docs/FP8.md). */
void df_drafter_set_fp8_ce_onepass(df_drafter *d, int on);
/* Row steps with gradients round the LM head's logits to BF16 (DF_CE_BF16_LOGITS: as a BF16
 * LM head in PyTorch leaves them; the CUDA backend stores them so, half the bytes); other
 * numerics. Steps without gradients (evaluation) keep F32 logits. Off for a drafter as
 * opened; the trainer sets it (df_train_opts.bf16_logits). */
void df_drafter_set_bf16_logits(df_drafter *d, int on);
/* The same in FP16 (DF_CE_F16_LOGITS: 11 significant bits against BF16's 8, the same bytes
 * where the GEMM writes FP16: the CUDA backend's E4M3 tensor cores). Off as opened; the
 * trainer sets it (df_train_opts.f16_logits). Not with df_drafter_set_bf16_logits: BF16 wins. */
void df_drafter_set_f16_logits(df_drafter *d, int on);

/* Memory for nothing: the gradient array grad (the one every
 * df_drafter_row_step with gradients then gets, in df_drafter_grad_dtype)
 * hosts activations. Layer l's saved activations (l >= 1), largest first
 * while they fit, go into layer l-1's gradients (below layer 1 also fc's
 * and hidden_norm's): the backward clears that range once layer l's
 * backward, their last reader, is done, before layer l-1's writes its
 * gradients there (under row->grad_write it writes them without clearing). The caller's contract: the gradients are consumed (norm,
 * optimizer, reduce-scatter) before the next row_step starts, so one row
 * per optimizer step, no accumulation over rows; and a forward-only
 * row_step (evaluation) also writes there. Results are bitwise the same.
 * At the 27B drafter shape with recompute level 1 this is ~2.6 GiB.
 * grad NULL: off (the default). Returns 0 or -ENOMEM. */
int df_drafter_set_grad_alias(df_drafter *d, void *grad);
/* The element range [lo, hi) of that gradient array that hosts layer l's
 * activations, which row_step's backward clears itself before any gradient
 * goes there (so its owner need not clear it between steps): 1, or 0 when
 * layer l hosts nothing there (or aliasing is off). */
int df_drafter_grad_alias_range(const df_drafter *d, int l, int64_t *lo, int64_t *hi);

/* The acc[k] / tau counts of a row from its packed argmax (row->argmax_out
 * after the sync: one entry per scored position, in order), added to m. */
void df_drafter_row_metrics(const df_drafter *d, const df_drafter_row *row, const int32_t *argmax,
                            df_drafter_metrics *m);

#endif
