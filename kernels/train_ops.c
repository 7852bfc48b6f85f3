/* train_ops.c - dispatch and argument checks of the training ops of
 * train_ops.h (all but the drafter attention, which dispatches from
 * train_attn.c).
 *
 * As in ops.c: every df_op_*() checks its arguments completely before
 * anything is written, so a bad call returns -EINVAL with every output
 * untouched, and the CPU implementations (kernels/cpu/train_dense.c,
 * kernels/cpu/lmhead_ce.c) may assume valid arguments. ops.c's checking
 * helpers are static there; the same rules are restated here:
 *   - a tensor: 1..4 dims (as the op says), F32 (activations, gradients) or
 *     BF16/F16/F32 (weights), shapes and strides >= 0, innermost stride 1,
 *     data present when non-empty, the elements it spans addressable
 *     without int64 overflow; an output also must not overlap itself;
 *   - an output shares no byte with any input or other output, except where
 *     train_ops.h says it may be the very same view as an input. */
#include "train_internal.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* ---- argument checks ---- */

static int is_weight_dtype(df_dtype t)
{
    return t == DF_DTYPE_BF16 || t == DF_DTYPE_F16 || t == DF_DTYPE_F32;
}

#define MAX_SPAN ((int64_t)1 << 56) /* elements a tensor may span */

static int check_tensor(const df_tensor *t, int ndim_min, int ndim_max, int weight, int out)
{
    if (!t || t->ndim < ndim_min || t->ndim > ndim_max)
        return 0;
    if (weight ? !is_weight_dtype(t->dtype) : t->dtype != DF_DTYPE_F32)
        return 0;
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] < 0 || t->stride[d] < 0)
            return 0;
    if (t->stride[t->ndim - 1] != 1)
        return 0;
    int64_t n = 1, span = 1, step;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] == 0)
            return 1; /* empty: nothing is ever addressed */
        if (__builtin_mul_overflow(n, t->shape[d], &n) ||
            __builtin_mul_overflow(t->shape[d] - 1, t->stride[d], &step) ||
            __builtin_add_overflow(span, step, &span) || span > MAX_SPAN)
            return 0;
    }
    if (!t->data)
        return 0;
    if (out) { /* each outer stride steps over everything inside it */
        int64_t extent = 1;
        for (int d = t->ndim - 1; d >= 0; d--)
            if (t->shape[d] > 1) {
                if (t->stride[d] < extent)
                    return 0;
                extent = t->stride[d] * (t->shape[d] - 1) + extent;
            }
    }
    return 1;
}

static int same_shape(const df_tensor *a, const df_tensor *b)
{
    if (a->ndim != b->ndim)
        return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d])
            return 0;
    return 1;
}

static int same_view(const df_tensor *a, const df_tensor *b)
{
    if (a->data != b->data || a->dtype != b->dtype || !same_shape(a, b))
        return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] > 1 && a->stride[d] != b->stride[d])
            return 0;
    return 1;
}

/* A tensor as rows of contiguous bytes (1-D and 2-D exactly; more dims by
 * their bounding range as one row). */
typedef struct rowspan {
    intptr_t base;
    int64_t rows, stride, width; /* bytes */
} rowspan;

static rowspan span_of(const df_tensor *t)
{
    int64_t es = (int64_t)df_dtype_size(t->dtype);
    rowspan s = {(intptr_t)t->data, 1, 0, 0};
    if (df_tensor_numel(t) == 0)
        return s;
    if (t->ndim == 1) {
        s.width = t->shape[0] * es;
    } else if (t->ndim == 2) {
        s.rows = t->shape[0];
        s.stride = t->shape[0] > 1 ? t->stride[0] * es : 0;
        s.width = t->shape[1] * es;
    } else {
        int64_t last = 0;
        for (int d = 0; d < t->ndim; d++)
            last += (t->shape[d] - 1) * t->stride[d];
        s.width = (last + 1) * es;
    }
    return s;
}

/* Raw memory: n elements of size es at p. */
static rowspan span_raw(const void *p, int64_t n, size_t es)
{
    rowspan s = {(intptr_t)p, 1, 0, p ? n * (int64_t)es : 0};
    return s;
}

static int64_t floor_div(int64_t a, int64_t b) /* b > 0 */
{
    int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

/* Whether two spans may share a byte: exact for rows of one stride (column
 * views of one buffer), else by bounding ranges (errs towards "overlap"). */
static int spans_overlap(rowspan a, rowspan b)
{
    if (a.width == 0 || b.width == 0)
        return 0;
    if (a.rows == 1)
        a.stride = b.stride;
    if (b.rows == 1)
        b.stride = a.stride;
    if (a.stride == b.stride && a.stride >= a.width && a.stride >= b.width) {
        int64_t S = a.stride;
        if (S == 0)
            return b.base < a.base + a.width && a.base < b.base + b.width;
        int64_t d = (int64_t)(b.base - a.base);
        int64_t kmin = -(a.rows - 1), kmax = b.rows - 1;
        int64_t k0 = floor_div(-b.width - d, S) + 1;
        for (int64_t k = k0; k <= k0 + 1; k++)
            if (k >= kmin && k <= kmax && d + k * S < a.width)
                return 1;
        return 0;
    }
    intptr_t alo = a.base, ahi = a.base + (intptr_t)((a.rows - 1) * a.stride + a.width);
    intptr_t blo = b.base, bhi = b.base + (intptr_t)((b.rows - 1) * b.stride + b.width);
    return blo < ahi && alo < bhi;
}

static int overlaps(const df_tensor *a, const df_tensor *b)
{
    return spans_overlap(span_of(a), span_of(b));
}

/* out is the very same view as in (where allowed) or shares no byte with it. */
static int alias_ok(const df_tensor *out, const df_tensor *in, int may_alias)
{
    if (may_alias && same_view(out, in))
        return 1;
    return !overlaps(out, in);
}

#define BE_CHECK(be)                      \
    do {                                  \
        if (!(be))                        \
            return -EINVAL;               \
        if ((be)->kind != DF_BACKEND_CPU) \
            return -ENOSYS;               \
    } while (0)

/* ---- matmul backward ---- */

int df_op_matmul_bwd_x(df_backend *be, const df_tensor *dy, const df_tensor *w, df_tensor *dx,
                       int accumulate)
{
    if (!be || !check_tensor(dy, 2, 2, 0, 0) || !check_tensor(w, 2, 2, 1, 0) ||
        !check_tensor(dx, 2, 2, 0, 1))
        return -EINVAL;
    /* dy [M, N], w [N, K], dx [M, K] */
    if (dy->shape[1] != w->shape[0] || dx->shape[0] != dy->shape[0] ||
        dx->shape[1] != w->shape[1])
        return -EINVAL;
    if (!alias_ok(dx, dy, 0) || !alias_ok(dx, w, 0))
        return -EINVAL;
    BE_CHECK(be);
    return df_cpu_matmul_bwd_x(be, dy, w, dx, accumulate);
}

int df_op_matmul_bwd_w(df_backend *be, const df_tensor *dy, const df_tensor *x, df_tensor *dw,
                       int accumulate)
{
    if (!be || !check_tensor(dy, 2, 2, 0, 0) || !check_tensor(x, 2, 2, 0, 0) ||
        !check_tensor(dw, 2, 2, 0, 1))
        return -EINVAL;
    /* dy [M, N], x [M, K], dw [N, K] */
    if (dy->shape[0] != x->shape[0] || dw->shape[0] != dy->shape[1] ||
        dw->shape[1] != x->shape[1])
        return -EINVAL;
    if (!alias_ok(dw, dy, 0) || !alias_ok(dw, x, 0))
        return -EINVAL;
    BE_CHECK(be);
    return df_cpu_matmul_bwd_w(be, dy, x, dw, accumulate);
}

/* ---- RMSNorm, RoPE, SwiGLU backward ---- */

int df_op_rmsnorm_bwd(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                      int plus_one, const df_tensor *dy, df_tensor *dx, int accumulate_dx,
                      df_tensor *dw)
{
    if (!be || !check_tensor(x, 1, 4, 0, 0) || !check_tensor(dy, 1, 4, 0, 0) ||
        !same_shape(x, dy) || !check_tensor(dw, 1, 1, 0, 1))
        return -EINVAL;
    int64_t D = x->shape[x->ndim - 1];
    if (!check_tensor(w, 1, 1, 1, 0) || w->shape[0] != D || dw->shape[0] != D)
        return -EINVAL;
    if (!(eps >= 0) || !isfinite(eps))
        return -EINVAL;
    if (!alias_ok(dw, x, 0) || !alias_ok(dw, w, 0) || !alias_ok(dw, dy, 0))
        return -EINVAL;
    if (dx) {
        if (!check_tensor(dx, 1, 4, 0, 1) || !same_shape(dx, x))
            return -EINVAL;
        /* Row by row, each row read whole before it is written. */
        if (!alias_ok(dx, x, 1) || !alias_ok(dx, dy, 1) || !alias_ok(dx, w, 0) ||
            overlaps(dx, dw))
            return -EINVAL;
    }
    BE_CHECK(be);
    return df_cpu_rmsnorm_bwd(be, x, w, eps, plus_one, dy, dx, accumulate_dx, dw);
}

int df_op_rope_bwd(df_backend *be, df_tensor *dx, const int32_t *pos, int heads, int head_dim,
                   int rot_dim, double theta)
{
    if (!be || !check_tensor(dx, 2, 2, 0, 1) || heads <= 0 || head_dim <= 0)
        return -EINVAL;
    if ((int64_t)heads * head_dim != dx->shape[1])
        return -EINVAL;
    if (rot_dim <= 0 || rot_dim % 2 || rot_dim > head_dim)
        return -EINVAL;
    if (!(theta > 0) || !((float)theta < INFINITY))
        return -EINVAL;
    if (dx->shape[0] > 0 && !pos)
        return -EINVAL;
    BE_CHECK(be);
    return df_cpu_rope_bwd(be, dx, pos, heads, head_dim, rot_dim, theta);
}

int df_op_swiglu_bwd(df_backend *be, const df_tensor *gate, const df_tensor *up,
                     const df_tensor *dout, df_tensor *dgate, df_tensor *dup)
{
    const df_tensor *in[3] = {gate, up, dout};
    if (!be || !check_tensor(dgate, 1, 4, 0, 1) || !check_tensor(dup, 1, 4, 0, 1) ||
        !same_shape(dgate, dup) || overlaps(dgate, dup))
        return -EINVAL;
    for (int i = 0; i < 3; i++)
        if (!check_tensor(in[i], 1, 4, 0, 0) || !same_shape(in[i], dgate) ||
            !alias_ok(dgate, in[i], 1) || !alias_ok(dup, in[i], 1))
            return -EINVAL;
    BE_CHECK(be);
    return df_cpu_swiglu_bwd(be, gate, up, dout, dgate, dup);
}

/* ---- LM head + CE ---- */

int df_op_lmhead_ce(df_backend *be, const df_tensor *h, const df_tensor *head,
                    const int32_t *label, const float *weight, float denom, double *loss_sum,
                    df_tensor *dh, int32_t *argmax, float *ce)
{
    if (!be || !check_tensor(h, 2, 2, 0, 0) || !check_tensor(head, 2, 2, 1, 0))
        return -EINVAL;
    int64_t N = h->shape[0], V = head->shape[0];
    if (head->shape[1] != h->shape[1] || V < 1 || V > INT32_MAX)
        return -EINVAL;
    if (N > 0 && !label)
        return -EINVAL;
    for (int64_t i = 0; i < N; i++)
        if (label[i] >= V || (weight && !(weight[i] >= 0.0f && weight[i] < INFINITY)))
            return -EINVAL;
    rowspan in[4] = {span_of(h), span_of(head), span_raw(label, N, sizeof(int32_t)),
                     span_raw(weight, N, sizeof(float))};
    rowspan out[4] = {span_raw(loss_sum, 1, sizeof(double)), span_raw(argmax, N, sizeof(int32_t)),
                      span_raw(ce, N, sizeof(float)), {0, 1, 0, 0}};
    if (dh) {
        if (!check_tensor(dh, 2, 2, 0, 1) || !same_shape(dh, h))
            return -EINVAL;
        if (!(denom > 0.0f) || !isfinite(denom))
            return -EINVAL;
        out[3] = span_of(dh);
    }
    for (int i = 0; i < 4; i++) {
        for (int j = 0; j < 4; j++)
            if (spans_overlap(out[i], in[j]))
                return -EINVAL;
        for (int j = i + 1; j < 4; j++)
            if (spans_overlap(out[i], out[j]))
                return -EINVAL;
    }
    BE_CHECK(be);
    return df_cpu_lmhead_ce(be, h, head, label, weight, denom, loss_sum, dh, argmax, ce);
}

/* ---- optimizer ---- */

int df_op_adamw(df_backend *be, float *master, const float *grad, float *m, float *v, int64_t n,
                float lr, float beta1, float beta2, float eps, float wd, int64_t step,
                float grad_scale, uint16_t *out_bf16)
{
    if (!be || n < 0 || n > ((int64_t)1 << 56) || step < 1)
        return -EINVAL;
    if (n > 0 && (!master || !grad || !m || !v))
        return -EINVAL;
    if (!(lr >= 0) || !isfinite(lr) || !(wd >= 0) || !isfinite(wd) || !(eps > 0) ||
        !isfinite(eps) || !(grad_scale >= 0) || !isfinite(grad_scale))
        return -EINVAL;
    if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
        return -EINVAL;
    /* No two arrays may share memory (not even the same pointer: grad
     * aliasing m or master would change the arithmetic). */
    rowspan s[5] = {span_raw(master, n, 4), span_raw(m, n, 4), span_raw(v, n, 4),
                    span_raw(out_bf16, n, 2), span_raw(grad, n, 4)};
    for (int i = 0; i < 4; i++)
        for (int j = i + 1; j < 5; j++)
            if (spans_overlap(s[i], s[j]))
                return -EINVAL;
    BE_CHECK(be);
    return df_cpu_adamw(be, master, grad, m, v, n, lr, beta1, beta2, eps, wd, step, grad_scale,
                        out_bf16);
}

double df_op_sumsq(df_backend *be, const float *x, int64_t n)
{
    if (!be || n < 0 || (n > 0 && !x))
        return (double)-EINVAL;
    if (be->kind != DF_BACKEND_CPU)
        return (double)-ENOSYS;
    return df_cpu_sumsq(be, x, n);
}
