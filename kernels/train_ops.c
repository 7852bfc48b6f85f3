/* train_ops.c - dispatch and argument checks of the training ops of
 * train_ops.h (all but the drafter attention, which dispatches from
 * train_attn.c).
 *
 * As in ops.c: every df_op_*() checks its arguments completely before
 * anything is written, so a bad call returns -EINVAL with every output
 * untouched, and the CPU implementations (kernels/cpu/train_dense.c,
 * kernels/cpu/lmhead_ce.c) may assume valid arguments. The checking helpers
 * are shared with ops.c (op_checks.c); the rules here:
 *   - a tensor: 1..4 dims (as the op says), the backend's activation dtype
 *     (activations and their gradients), BF16/F16/F32 (weights; BF16 on
 *     CUDA) or F32/BF16 (weight gradients), shapes and strides >= 0,
 *     innermost stride 1,
 *     data present when non-empty, the elements it spans addressable
 *     without int64 overflow; an output also must not overlap itself;
 *   - an output shares no byte with any input or other output, except where
 *     train_ops.h says it may be the very same view as an input. */
#include "op_checks.h"
#include "train_internal.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* ---- argument checks ---- */

#define MAX_SPAN ((int64_t)1 << 56) /* elements a tensor may span */

/* train_ops.c's tensor rule (op_checks.h): spans bounded by MAX_SPAN. */
static int check_tensor(const df_tensor *t, int ndim_min, int ndim_max, int weight, int out)
{
    return df_check_tensor(t, ndim_min, ndim_max, weight, out, MAX_SPAN);
}

/* Activations and their gradients: the backend's activation dtype; weights:
 * any weight dtype on the CPU, BF16 on CUDA; weight gradients: F32 or BF16
 * on every backend. */
#define ACT(be) ((be)->act == DF_DTYPE_BF16 ? DF_CHK_BF16 : DF_CHK_F32)
#define WT(be) ((be)->act == DF_DTYPE_BF16 ? DF_CHK_BF16 : DF_CHK_WEIGHT)
#define GRAD DF_CHK_GRAD

/* ---- matmul backward ---- */

int df_op_matmul_bwd_x(df_backend *be, const df_tensor *dy, const df_tensor *w, df_tensor *dx,
                       int accumulate)
{
    if (!be || !df_gemm_args_ok(DF_GEMM_BWD_X, dy, w, dx, ACT(be), WT(be), MAX_SPAN))
        return -EINVAL;
    return DF_DISPATCH(be, matmul_bwd_x, dy, w, dx, accumulate);
}

int df_op_matmul_bwd_w(df_backend *be, const df_tensor *dy, const df_tensor *x, df_tensor *dw,
                       int accumulate)
{
    if (!be || !df_gemm_args_ok(DF_GEMM_BWD_W, dy, x, dw, ACT(be), WT(be), MAX_SPAN))
        return -EINVAL;
    return DF_DISPATCH(be, matmul_bwd_w, dy, x, dw, accumulate);
}

/* ---- RMSNorm, RoPE, SwiGLU backward ---- */

int df_op_rmsnorm_bwd(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                      int plus_one, const df_tensor *dy, df_tensor *dx, int accumulate_dx,
                      df_tensor *dw)
{
    if (!be || !check_tensor(x, 1, 4, ACT(be), 0) || !check_tensor(dy, 1, 4, ACT(be), 0) ||
        !df_same_shape(x, dy) || !check_tensor(dw, 1, 1, GRAD, 1))
        return -EINVAL;
    int64_t D = x->shape[x->ndim - 1];
    if (!check_tensor(w, 1, 1, WT(be), 0) || w->shape[0] != D || dw->shape[0] != D)
        return -EINVAL;
    if (!(eps >= 0) || !isfinite(eps))
        return -EINVAL;
    if (!df_alias_ok(dw, x, 0) || !df_alias_ok(dw, w, 0) || !df_alias_ok(dw, dy, 0))
        return -EINVAL;
    if (dx) {
        if (!check_tensor(dx, 1, 4, ACT(be), 1) || !df_same_shape(dx, x))
            return -EINVAL;
        /* Row by row, each row read whole before it is written. */
        if (!df_alias_ok(dx, x, 1) || !df_alias_ok(dx, dy, 1) || !df_alias_ok(dx, w, 0) ||
            df_overlaps(dx, dw))
            return -EINVAL;
    }
    return DF_DISPATCH(be, rmsnorm_bwd, x, w, eps, plus_one, dy, dx, accumulate_dx, dw);
}

int df_op_rope_bwd(df_backend *be, df_tensor *dx, const int32_t *pos, int heads, int head_dim,
                   int rot_dim, double theta)
{
    if (!be || !check_tensor(dx, 2, 2, ACT(be), 1) ||
        !df_rope_args_ok(dx, pos, heads, head_dim, rot_dim, theta))
        return -EINVAL;
    return DF_DISPATCH(be, rope_bwd, dx, pos, heads, head_dim, rot_dim, theta);
}

static int swiglu_bwd_args_ok(const df_tensor *gate, const df_tensor *up, const df_tensor *dout,
                              const df_tensor *dgate, const df_tensor *dup, unsigned act)
{
    const df_tensor *in[3] = {gate, up, dout};
    if (!check_tensor(dgate, 1, 4, act, 1) || !check_tensor(dup, 1, 4, act, 1) ||
        !df_same_shape(dgate, dup) || df_overlaps(dgate, dup))
        return 0;
    for (int i = 0; i < 3; i++)
        if (!check_tensor(in[i], 1, 4, act, 0) || !df_same_shape(in[i], dgate) ||
            !df_alias_ok(dgate, in[i], 1) || !df_alias_ok(dup, in[i], 1))
            return 0;
    return 1;
}

int df_op_swiglu_bwd(df_backend *be, const df_tensor *gate, const df_tensor *up,
                     const df_tensor *dout, df_tensor *dgate, df_tensor *dup)
{
    if (!be || !swiglu_bwd_args_ok(gate, up, dout, dgate, dup, ACT(be)))
        return -EINVAL;
    return DF_DISPATCH(be, swiglu_bwd, gate, up, dout, dgate, dup);
}

int df_op_swiglu_bwd_fp8(df_backend *be, const df_tensor *gate, const df_tensor *up,
                         const df_tensor *dout, df_tensor *dgate, df_tensor *dup, unsigned flags)
{
    if (!be || (flags & ~(DF_FP8_DY_BLOCKS | DF_FP8_ONLY_CODES)) ||
        !swiglu_bwd_args_ok(gate, up, dout, dgate, dup, ACT(be)))
        return -EINVAL;
    return DF_DISPATCH(be, swiglu_bwd_fp8, gate, up, dout, dgate, dup, flags);
}

/* ---- LM head + CE ---- */

int df_op_lmhead_ce(df_backend *be, const df_tensor *h, const df_tensor *head,
                    const int32_t *label, const float *weight, float denom, double *loss_sum,
                    df_tensor *dh, int32_t *argmax, float *ce, unsigned flags)
{
    if (!be || !check_tensor(h, 2, 2, ACT(be), 0) || !check_tensor(head, 2, 2, WT(be), 0))
        return -EINVAL;
    const unsigned ce_flags =
        DF_CE_FP8_GRAD | DF_CE_FP8_HEAD_FROZEN | DF_CE_FP8_ROUND_HEAD | DF_CE_BF16_LOGITS |
        DF_CE_FP8_ONEPASS | DF_CE_F16_LOGITS;
    if ((flags & ~ce_flags) ||
        ((flags & DF_CE_BF16_LOGITS) && (flags & DF_CE_F16_LOGITS)) ||
        ((flags & (DF_CE_FP8_HEAD_FROZEN | DF_CE_FP8_ROUND_HEAD | DF_CE_FP8_ONEPASS)) &&
         !(flags & DF_CE_FP8_GRAD)))
        return -EINVAL;
    int64_t N = h->shape[0], V = head->shape[0];
    if (head->shape[1] != h->shape[1] || V < 1 || V > INT32_MAX)
        return -EINVAL;
    if (N > 0 && !label)
        return -EINVAL;
    /* Labels and weights live in backend memory: checked here where that is
     * host memory; a device backend ignores rows whose label is >= V. */
    for (int64_t i = 0; be->host_addressable && i < N; i++)
        if (label[i] >= V || (weight && !(weight[i] >= 0.0f && weight[i] < INFINITY)))
            return -EINVAL;
    df_rowspan in[4] = {df_span_of(h), df_span_of(head), df_span_raw(label, N, sizeof(int32_t)),
                     df_span_raw(weight, N, sizeof(float))};
    df_rowspan out[4] = {df_span_raw(loss_sum, 1, sizeof(double)), df_span_raw(argmax, N, sizeof(int32_t)),
                      df_span_raw(ce, N, sizeof(float)), {0, 1, 0, 0}};
    if (dh) {
        if (!check_tensor(dh, 2, 2, ACT(be), 1) || !df_same_shape(dh, h))
            return -EINVAL;
        if (!(denom > 0.0f) || !isfinite(denom))
            return -EINVAL;
        out[3] = df_span_of(dh);
    }
    for (int i = 0; i < 4; i++) {
        for (int j = 0; j < 4; j++)
            if (df_spans_overlap(out[i], in[j]))
                return -EINVAL;
        for (int j = i + 1; j < 4; j++)
            if (df_spans_overlap(out[i], out[j]))
                return -EINVAL;
    }
    return DF_DISPATCH(be, lmhead_ce, h, head, label, weight, denom, loss_sum, dh, argmax, ce,
                       flags);
}

/* ---- optimizer ---- */

/* df_op_adamw's checks; m of mes bytes each, v of ves */
static int adamw_check(df_backend *be, const float *master, const void *grad, df_dtype grad_dtype,
                       const void *m, const void *v, size_t mes, size_t ves, int64_t n, float lr,
                       float beta1, float beta2, float eps, float wd, int64_t step,
                       float grad_scale, const uint16_t *out_bf16)
{
    if (!be || n < 0 || n > ((int64_t)1 << 56) || step < 1)
        return -EINVAL;
    if (grad_dtype != DF_DTYPE_F32 && grad_dtype != DF_DTYPE_BF16)
        return -EINVAL;
    if (n > 0 && (!master || !grad || !m || !v))
        return -EINVAL;
    if (!(lr >= 0) || !isfinite(lr) || !(wd >= 0) || !isfinite(wd) || !(eps > 0) ||
        !isfinite(eps) || !(grad_scale >= 0) || !isfinite(grad_scale))
        return -EINVAL;
    if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
        return -EINVAL;
    /* No two arrays may share memory (not even the same pointer: grad
     * aliasing m or master would change the arithmetic). grad spans n
     * elements of its own dtype. */
    df_rowspan s[5] = {df_span_raw(master, n, 4), df_span_raw(m, n, mes),
                       df_span_raw(v, n, ves), df_span_raw(out_bf16, n, 2),
                       df_span_raw(grad, n, df_dtype_size(grad_dtype))};
    for (int i = 0; i < 4; i++)
        for (int j = i + 1; j < 5; j++)
            if (df_spans_overlap(s[i], s[j]))
                return -EINVAL;
    return 0;
}

int df_op_adamw(df_backend *be, float *master, const void *grad, df_dtype grad_dtype, float *m,
                float *v, int64_t n, float lr, float beta1, float beta2, float eps, float wd,
                int64_t step, float grad_scale, uint16_t *out_bf16)
{
    int rc = adamw_check(be, master, grad, grad_dtype, m, v, 4, 4, n, lr, beta1, beta2, eps, wd,
                         step, grad_scale, out_bf16);
    return rc ? rc
              : DF_DISPATCH(be, adamw, master, grad, grad_dtype, m, v, n, lr, beta1, beta2, eps,
                            wd, step, grad_scale, out_bf16);
}

int df_op_adamw_m16(df_backend *be, float *master, const void *grad, df_dtype grad_dtype,
                    uint16_t *m, void *v, df_dtype v_dtype, int64_t n, float lr, float beta1,
                    float beta2, float eps, float wd, int64_t step, float grad_scale,
                    uint64_t key, int64_t index0, uint16_t *out_bf16)
{
    if (v_dtype != DF_DTYPE_BF16 && v_dtype != DF_DTYPE_UF16 && v_dtype != DF_DTYPE_F32)
        return -EINVAL;
    int rc = adamw_check(be, master, grad, grad_dtype, m, v, 2, df_dtype_size(v_dtype), n, lr,
                         beta1, beta2, eps, wd, step, grad_scale, out_bf16);
    if (!rc && (index0 < 0 || index0 > ((int64_t)1 << 62) - n))
        rc = -EINVAL;
    return rc ? rc
              : DF_DISPATCH(be, adamw_m16, master, grad, grad_dtype, m, v, v_dtype, n, lr, beta1,
                            beta2, eps, wd, step, grad_scale, key, index0, out_bf16);
}

double df_op_sumsq(df_backend *be, const void *x, df_dtype dtype, int64_t n)
{
    if (!be || n < 0 || (n > 0 && !x))
        return (double)-EINVAL;
    if (dtype != DF_DTYPE_F32 && dtype != DF_DTYPE_BF16)
        return (double)-EINVAL;
    if (!be->vt->sumsq)
        return (double)-ENOTSUP;
    /* profiled as the int ops are (DF_DISPATCH), though it returns the sum */
    df_prof_begin(be, "sumsq");
    double s = be->vt->sumsq(be, x, dtype, n);
    df_prof_end(be, 0);
    return s;
}

/* ---- FP8 rounding ---- */

int df_op_fp8_qdq(df_backend *be, const df_tensor *x, df_tensor *y, int64_t block_rows,
                  int64_t block_cols)
{
    if (!be || !check_tensor(x, 2, 2, DF_CHK_GRAD, 0) || !check_tensor(y, 2, 2, DF_CHK_GRAD, 1))
        return -EINVAL;
    if (x->dtype != y->dtype || !df_same_shape(x, y))
        return -EINVAL;
    if (block_rows < 1 || block_cols < 1 || block_rows > INT32_MAX || block_cols > INT32_MAX)
        return -EINVAL;
    if (!df_alias_ok(y, x, 1))
        return -EINVAL;
    return DF_DISPATCH(be, fp8_qdq, x, y, block_rows, block_cols);
}

int df_op_matmul_fp8(df_backend *be, df_gemm_kind kind, const df_tensor *a, const df_tensor *b,
                     df_tensor *c, unsigned flags)
{
    if (!be ||
        (flags & ~(DF_FP8_ACCUMULATE | DF_FP8_HOLD_X | DF_FP8_SAME_X | DF_FP8_DY_BLOCKS |
                   DF_FP8_MADE)) ||
        ((flags & DF_FP8_DY_BLOCKS) && kind != DF_GEMM_BWD_W) ||
        !df_gemm_args_ok((int)kind, a, b, c, ACT(be), WT(be), MAX_SPAN))
        return -EINVAL;
    return DF_DISPATCH(be, matmul_fp8, kind, a, b, c, flags);
}
