/* ops_gdn.c - dispatch and argument checks of the Gated DeltaNet ops
 * (conv1d + SiLU, l2norm, gates, the delta rule). Every check runs before
 * anything is written: a rejected call returns -EINVAL and leaves all
 * outputs untouched. */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include "backend_internal.h"

#define MAX_EXTENT ((int64_t)1 << 60) /* elements a tensor may span */

static int backend_ok(const df_backend *be)
{
    return be && (be->kind == DF_BACKEND_CPU || be->kind == DF_BACKEND_CUDA);
}

/* Elements spanned by t: 0 if empty, -1 on overflow or beyond MAX_EXTENT. */
static int64_t extent(const df_tensor *t)
{
    int64_t ext = 1, step;
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] == 0)
            return 0;
    for (int d = 0; d < t->ndim; d++)
        if (__builtin_mul_overflow(t->shape[d] - 1, t->stride[d], &step) ||
            __builtin_add_overflow(ext, step, &ext) || ext > MAX_EXTENT)
            return -1;
    return ext;
}

/* The layout every op needs: 1..4 dims, non-negative shapes and strides,
 * the innermost dim contiguous, each outer dim (of size > 1) stepping over
 * the whole extent of the dims inside it (so no two elements share memory,
 * and rows never interleave), data present unless empty. */
static int layout_ok(const df_tensor *t)
{
    if (!t || t->ndim < 1 || t->ndim > DF_TENSOR_MAX_DIMS)
        return 0;
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] < 0 || t->stride[d] < 0)
            return 0;
    if (t->stride[t->ndim - 1] != 1 || extent(t) < 0)
        return 0;
    int64_t inner = 1; /* extent of dims d+1.. (no overflow: extent(t) passed) */
    for (int d = t->ndim - 1; d >= 0; d--) {
        int64_t n = t->shape[d], s = t->stride[d];
        if (n == 0)
            return 1; /* empty: nothing is ever addressed */
        if (n > 1 && d < t->ndim - 1 && s < inner)
            return 0;
        inner += (n - 1) * s;
    }
    return t->data != NULL;
}

static int f32_2d(const df_tensor *t, int64_t rows, int64_t cols)
{
    return layout_ok(t) && t->dtype == DF_DTYPE_F32 && t->ndim == 2 && t->shape[0] == rows &&
           t->shape[1] == cols;
}

static int is_weight_dtype(df_dtype d)
{
    return d == DF_DTYPE_BF16 || d == DF_DTYPE_F16 || d == DF_DTYPE_F32;
}

/* A weight vector [n] (1-D, contiguous). */
static int weight_1d(const df_tensor *t, int64_t n)
{
    return layout_ok(t) && is_weight_dtype(t->dtype) && t->ndim == 1 && t->shape[0] == n;
}

/* cu_seqlens[0] = 0, non-decreasing, cu_seqlens[n_seq] = T. */
static int cu_ok(const int32_t *cu, int n_seq, int64_t T)
{
    if (!cu || n_seq < 0 || cu[0] != 0)
        return 0;
    for (int i = 0; i < n_seq; i++)
        if (cu[i + 1] < cu[i])
            return 0;
    return cu[n_seq] == T;
}

static int same_view(const df_tensor *a, const df_tensor *b)
{
    if (a->data != b->data || a->dtype != b->dtype || a->ndim != b->ndim)
        return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d] || (a->shape[d] > 1 && a->stride[d] != b->stride[d]))
            return 0;
    return 1;
}

/* 1 if no element of a shares memory with an element of b. Exact for
 * disjoint byte ranges and for 2-D views with one row stride (column
 * slices of one matrix, e.g. g and beta halves of a [T, 2H] buffer);
 * conservative (0) otherwise. */
static int disjoint(const df_tensor *a, const df_tensor *b)
{
    int64_t ea = extent(a), eb = extent(b);
    if (ea == 0 || eb == 0)
        return 1;
    uintptr_t pa = (uintptr_t)a->data, pb = (uintptr_t)b->data;
    uintptr_t za = df_dtype_size(a->dtype), zb = df_dtype_size(b->dtype);
    if (pa + (uintptr_t)ea * za <= pb || pb + (uintptr_t)eb * zb <= pa)
        return 1;
    if (a->ndim != 2 || b->ndim != 2 || za != zb || a->stride[0] != b->stride[0] ||
        a->stride[0] == 0)
        return 0;
    const df_tensor *lo = pa <= pb ? a : b, *hi = pa <= pb ? b : a;
    uintptr_t gap = (pa <= pb ? pb - pa : pa - pb);
    if (gap % za)
        return 0;
    int64_t ld = a->stride[0];
    int64_t off = (int64_t)(gap / za) % ld; /* hi's first column, in lo's rows */
    return off >= lo->shape[1] && off + hi->shape[1] <= ld;
}

int df_op_conv1d_silu(df_backend *be, const df_tensor *x, const df_tensor *w,
                      const int32_t *cu_seqlens, int n_seq, df_tensor *out)
{
    if (!backend_ok(be) || !x || !w || !out || !layout_ok(x))
        return -EINVAL;
    int64_t T = x->shape[0], C = x->ndim == 2 ? x->shape[1] : -1;
    if (!f32_2d(x, T, C) || !f32_2d(out, T, C) || !layout_ok(w) || w->ndim != 2 ||
        !is_weight_dtype(w->dtype) || w->shape[0] != C || w->shape[1] < 1 ||
        w->shape[1] > 1024 || !cu_ok(cu_seqlens, n_seq, T) || !disjoint(x, out))
        return -EINVAL;
    if (be->kind != DF_BACKEND_CPU)
        return -ENOTSUP;
    return df_cpu_conv1d_silu(be, x, w, cu_seqlens, n_seq, out);
}

int df_op_l2norm(df_backend *be, df_tensor *x, float eps, float scale)
{
    if (!backend_ok(be) || !layout_ok(x) || x->dtype != DF_DTYPE_F32 ||
        x->shape[x->ndim - 1] > INT32_MAX || !(eps >= 0.0f))
        return -EINVAL;
    if (be->kind != DF_BACKEND_CPU)
        return -ENOTSUP;
    return df_cpu_l2norm(be, x, eps, scale);
}

int df_op_gdn_gates(df_backend *be, const df_tensor *a, const df_tensor *b,
                    const df_tensor *A_log, const df_tensor *dt_bias, df_tensor *g,
                    df_tensor *beta)
{
    if (!backend_ok(be) || !a || !b || !A_log || !dt_bias || !g || !beta || !layout_ok(a) ||
        a->ndim != 2)
        return -EINVAL;
    int64_t T = a->shape[0], H = a->shape[1];
    if (!f32_2d(a, T, H) || !f32_2d(b, T, H) || !f32_2d(g, T, H) || !f32_2d(beta, T, H) ||
        !weight_1d(A_log, H) || !weight_1d(dt_bias, H) || !disjoint(g, beta))
        return -EINVAL;
    /* Each output may be exactly a or b (every element reads a and b before
     * writing g and beta), or must not overlap them. */
    const df_tensor *in[2] = {a, b}, *o[2] = {g, beta};
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            if (!same_view(o[i], in[j]) && !disjoint(o[i], in[j]))
                return -EINVAL;
    if (be->kind != DF_BACKEND_CPU)
        return -ENOTSUP;
    return df_cpu_gdn_gates(be, a, b, A_log, dt_bias, g, beta);
}

int df_op_gdn(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
              const df_tensor *g, const df_tensor *beta, const int32_t *cu_seqlens, int n_seq,
              int hk, int hv, int dk, int dv, df_gdn_mode mode, df_tensor *out)
{
    if (!backend_ok(be) || !q || !k || !v || !g || !beta || !out || !layout_ok(q) ||
        q->ndim != 2)
        return -EINVAL;
    if (hk < 1 || hv < 1 || dk < 1 || dv < 1 || hv % hk || dk > 4096 || dv > 4096 ||
        (mode != DF_GDN_RECURRENT && mode != DF_GDN_CHUNKED))
        return -EINVAL;
    int64_t T = q->shape[0];
    if (!f32_2d(q, T, (int64_t)hk * dk) || !f32_2d(k, T, (int64_t)hk * dk) ||
        !f32_2d(v, T, (int64_t)hv * dv) || !f32_2d(g, T, hv) || !f32_2d(beta, T, hv) ||
        !f32_2d(out, T, (int64_t)hv * dv) || !cu_ok(cu_seqlens, n_seq, T))
        return -EINVAL;
    /* out is written while q, k, v, g, beta are still being read. */
    const df_tensor *in[5] = {q, k, v, g, beta};
    for (int i = 0; i < 5; i++)
        if (!disjoint(out, in[i]))
            return -EINVAL;
    if (be->kind != DF_BACKEND_CPU)
        return -ENOTSUP;
    return df_cpu_gdn(be, q, k, v, g, beta, cu_seqlens, n_seq, hk, hv, dk, dv, mode, out);
}
