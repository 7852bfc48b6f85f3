/* drafter_internal.h - the drafter's state, shared by drafter.c (the row
 * step, the workspace) and drafter_fp8.c (FP8 training's rounding). */
#ifndef DF_DRAFTER_INTERNAL_H
#define DF_DRAFTER_INTERNAL_H

#include <stdint.h>

#include "drafter.h"

/* Parameter indices of one layer, resolved once. */
typedef struct layer_idx {
    int in_norm, wq, wk, wv, wo, q_norm, k_norm, post_norm, gate, up, down;
    int window;
} layer_idx;

/* Activations one layer saves for its backward pass (backend memory, the
 * activation dtype; lse F32). */
typedef struct layer_act {
    void *xin, *a, *qraw, *q, *kbraw, *kb, *vb, *kcraw, *kc, *vc, *o, *xmid, *b, *g, *u, *m;
    float *lse;
} layer_act;

struct df_drafter {
    df_drafter_config c;
    df_backend *be;
    df_tensor embed, head;
    df_params ps;
    int fc, hidden_norm, norm;
    layer_idx *li;
    df_dtype adt, wdt;   /* activation and weight dtypes: F32 on the CPU, BF16 on CUDA */
    size_t aes, wes;
    int host;            /* backend memory is host memory */
    /* workspace sized for cap_N queries and cap_S context tokens (backend memory) */
    int64_t cap_N, cap_S;
    void *arena, *arena32; /* activations; F32 (lse, loss weights) and int32 (labels, argmax) */
    layer_act *act;
    void *feat, *feat32;   /* the row's features on the backend (device backends) */
    void *craw, *cn, *xfin, *h;
    /* backward scratch */
    void *dx, *dh, *da, *db, *dq, *dkb, *dvb, *dkc, *dvc, *dout, *dcn, *dc;
    void *dkb2, *dkc2; /* the norms' input gradients (no in-place backward) */
    float *wts;        /* [N] loss weights (backend) */
    int32_t *labels, *argmax; /* [N] (backend) */
    int32_t *argmax_host;     /* [N] host copy for the metrics */
    /* the LM head over scored positions only: their indices, each position's
     * index among them (n_act for the rest), packed labels and weights (host;
     * pinned on a device) */
    uint32_t *act_i, *inv;
    int32_t *lab_c;
    float *wts_c;
    df_drafter_grad_hook hook;
    void *hook_ctx;
    df_drafter_fwd_hook fhook;
    void *fhook_ctx;
    int recompute;     /* a, b, q, kb, kc, m: one shared set, recomputed in the backward;
                          2: g and u too (two GEMMs per layer again) */
    df_dtype gdt;      /* the gradient array's dtype (df_drafter_set_grad_dtype) */
    /* df_drafter_prefetch_row: the features already on their way into feat */
    const void *pf_feat;
    int64_t pf_S;
    /* df_drafter_set_grad_alias: the gradient array that hosts activations
     * of layers 1..L-1, and per layer l the element range [alo, ahi) of it
     * (the gradients of layer l-1) zeroed before layer l-1's backward; 0, 0:
     * layer l hosts nothing */
    void *galias;
    int64_t *alo, *ahi;
    int64_t lend_n;    /* arena elements from its start free during the LM head (lent to it) */
    /* FP8 training (df_drafter_set_fp8): on, and on for the current row step
     * (steps with gradients); the LM head rounded once (data NULL where the
     * backend has E4M3 tensor cores: the op rounds it, DF_CE_FP8_ROUND_HEAD) */
    int fp8, q8;
    int fp8_dy_blocks; /* FP8: the weight gradients' dy per 128 x 128 (DF_FP8_DY_BLOCKS) */
    int fp8_ce_onepass; /* FP8: the LM head's softmax gradient in one pass (DF_CE_FP8_ONEPASS) */
    int bf16_logits;   /* steps with gradients: DF_CE_BF16_LOGITS */
    int f16_logits;    /* steps with gradients: DF_CE_F16_LOGITS */
    df_tensor head8;
};

/* An activation matrix of the workspace. */
#define M(p, r, c) df_tensor_2d((p), d->adt, (r), (c))

/* A parameter (dtype d->wdt) or its gradient (F32) as a tensor of its own
 * shape, from the flat arrays. */
static inline df_tensor param_t(const df_drafter *d, const void *flat, df_dtype dt, int i)
{
    const df_param *p = &d->ps.p[i];
    uint8_t *x = (uint8_t *)flat + (size_t)p->offset * df_dtype_size(dt);
    return p->ndim == 1 ? df_tensor_1d(x, dt, p->shape[0])
                        : df_tensor_2d(x, dt, p->shape[0], p->shape[1]);
}
#define PW(d, W, i) param_t((d), (W), (d)->wdt, (i))
#define PG(d, G, i) param_t((d), (G), (d)->gdt, (i))

/* ---- drafter_fp8.c (df_drafter_set_fp8) ---- */

/* The workspace for N queries and S context tokens, allocated and carved (drafter_act.c): 0 or a
 * negative errno with e set. */
int drafter_reserve(df_drafter *d, int64_t N, int64_t S, df_err *e);
/* Layer A's MLP activations (n elements each), dead from its backward's start to its next
 * forward: the longest contiguous run of them (*bytes), or NULL (drafter_act.c). */
void *drafter_mlp_dead(const df_drafter *d, const layer_act *A, int64_t n, size_t *bytes);

/* The GEMMs of a row step: y (+)= x w^T, dx (+)= dy w, dw (+)= dy^T x, as
 * df_op_matmul / _bwd_x / _bwd_w, or df_op_matmul_fp8 when FP8 is on for
 * the step (d->q8). flags: df_op_matmul_fp8's (DF_FP8_ACCUMULATE, and the
 * DF_FP8_HOLD_X / _SAME_X hints of projections that share x, which BF16
 * steps drop). */
int drafter_mm(df_drafter *d, const df_tensor *x, const df_tensor *w, df_tensor *y, unsigned flags);
int drafter_mm_bx(df_drafter *d, const df_tensor *dy, const df_tensor *w, df_tensor *dx, unsigned flags);
int drafter_mm_bw(df_drafter *d, const df_tensor *dy, const df_tensor *x, df_tensor *dw, unsigned flags);
/* SwiGLU; with FP8 its hint that out is x of the down projection's GEMMs (df_op_swiglu_fp8:
 * flags DF_FP8_X_FWD / _BWD_W, and DF_FP8_ONLY_CODES where nothing else reads it), which then
 * pass DF_FP8_MADE */
int drafter_swiglu(df_drafter *d, const df_tensor *g, const df_tensor *u, df_tensor *out, unsigned flags);
/* With FP8 (in 128 x 128 blocks for the weight gradient), the hint that dy is about to be dy of
 * one projection's two backward GEMMs (df_op_fp8_dy_codes), which then pass DF_FP8_MADE */
int drafter_dy_codes(df_drafter *d, const df_tensor *dy);
/* RMSNorm (plain) before `uses` projections that share its output; with FP8 its hint that y is
 * their x in the GEMMs of flags' kinds (df_op_rmsnorm_fp8: DF_FP8_X_FWD / _BWD_W, and
 * DF_FP8_ONLY_CODES where nothing else reads it), which then pass DF_FP8_MADE */
int drafter_rmsnorm(df_drafter *d, const df_tensor *x, const df_tensor *w, float eps, df_tensor *y,
                    int uses, unsigned flags);
/* SwiGLU's backward; with FP8 its hint that dg and du are the dy of the gate and up projections'
 * backward GEMMs and nothing else's (df_op_swiglu_bwd_fp8, DF_FP8_ONLY_CODES), which then pass
 * DF_FP8_MADE */
int drafter_swiglu_bwd(df_drafter *d, const df_tensor *g, const df_tensor *u, const df_tensor *dout,
                       df_tensor *dg, df_tensor *du);

void drafter_fp8_free(df_drafter *d);

#endif
