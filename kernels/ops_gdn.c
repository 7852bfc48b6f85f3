/* ops_gdn.c - dispatch and argument checks of the Gated DeltaNet ops
 * (conv1d + SiLU, l2norm, gates, the delta rule). Every check runs before
 * anything is written: a rejected call returns -EINVAL and leaves all
 * outputs untouched. */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include "backend_internal.h"
#include "op_checks.h"

static int backend_ok(const df_backend *be)
{
    return be && (be->kind == DF_BACKEND_CPU || be->kind == DF_BACKEND_CUDA);
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
    if (t->stride[t->ndim - 1] != 1 || df_extent(t) < 0)
        return 0;
    int64_t inner = 1; /* extent of dims d+1.. (no overflow: df_extent(t) passed) */
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

/* A [rows, cols] tensor of dtype dt. */
static int mat_2d(const df_tensor *t, df_dtype dt, int64_t rows, int64_t cols)
{
    return layout_ok(t) && t->dtype == dt && t->ndim == 2 && t->shape[0] == rows &&
           t->shape[1] == cols;
}

/* A weight's dtype: any weight dtype on the CPU, BF16 on CUDA. */
static int weight_dtype_ok(const df_backend *be, df_dtype t)
{
    return be->act == DF_DTYPE_BF16 ? t == DF_DTYPE_BF16 : df_is_weight_dtype(t);
}

/* A weight vector [n] (1-D, contiguous). */
static int weight_1d(const df_backend *be, const df_tensor *t, int64_t n)
{
    return layout_ok(t) && weight_dtype_ok(be, t->dtype) && t->ndim == 1 && t->shape[0] == n;
}

#define DISPATCH DF_DISPATCH

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

int df_op_conv1d_silu(df_backend *be, const df_tensor *x, const df_tensor *w,
                      const int32_t *cu_seqlens, int n_seq, df_tensor *out)
{
    if (!backend_ok(be) || !x || !w || !out || !layout_ok(x))
        return -EINVAL;
    int64_t T = x->shape[0], C = x->ndim == 2 ? x->shape[1] : -1;
    if (!mat_2d(x, be->act, T, C) || !mat_2d(out, be->act, T, C) || !layout_ok(w) ||
        w->ndim != 2 || !weight_dtype_ok(be, w->dtype) || w->shape[0] != C || w->shape[1] < 1 ||
        w->shape[1] > 1024 || !cu_ok(cu_seqlens, n_seq, T) || !df_disjoint(x, out))
        return -EINVAL;
    return DISPATCH(be, conv1d_silu, x, w, cu_seqlens, n_seq, out);
}

int df_op_l2norm(df_backend *be, df_tensor *x, float eps, float scale)
{
    if (!backend_ok(be) || !layout_ok(x) || x->dtype != be->act ||
        x->shape[x->ndim - 1] > INT32_MAX || !(eps >= 0.0f))
        return -EINVAL;
    return DISPATCH(be, l2norm, x, eps, scale);
}

int df_op_gdn_gates(df_backend *be, const df_tensor *a, const df_tensor *b,
                    const df_tensor *A_log, const df_tensor *dt_bias, df_tensor *g,
                    df_tensor *beta)
{
    if (!backend_ok(be) || !a || !b || !A_log || !dt_bias || !g || !beta || !layout_ok(a) ||
        a->ndim != 2)
        return -EINVAL;
    int64_t T = a->shape[0], H = a->shape[1];
    if (!mat_2d(a, be->act, T, H) || !mat_2d(b, be->act, T, H) ||
        !mat_2d(g, DF_DTYPE_F32, T, H) || !mat_2d(beta, DF_DTYPE_F32, T, H) ||
        !weight_1d(be, A_log, H) || !weight_1d(be, dt_bias, H) || !df_disjoint(g, beta))
        return -EINVAL;
    /* Each output may be exactly a or b (every element reads a and b before
     * writing g and beta), or must not overlap them. */
    const df_tensor *in[2] = {a, b}, *o[2] = {g, beta};
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            if (!df_same_view(o[i], in[j]) && !df_disjoint(o[i], in[j]))
                return -EINVAL;
    return DISPATCH(be, gdn_gates, a, b, A_log, dt_bias, g, beta);
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
    df_dtype at = be->act;
    if (!mat_2d(q, at, T, (int64_t)hk * dk) || !mat_2d(k, at, T, (int64_t)hk * dk) ||
        !mat_2d(v, at, T, (int64_t)hv * dv) || !mat_2d(g, DF_DTYPE_F32, T, hv) ||
        !mat_2d(beta, DF_DTYPE_F32, T, hv) || !mat_2d(out, at, T, (int64_t)hv * dv) ||
        !cu_ok(cu_seqlens, n_seq, T))
        return -EINVAL;
    /* out is written while q, k, v, g, beta are still being read. */
    const df_tensor *in[5] = {q, k, v, g, beta};
    for (int i = 0; i < 5; i++)
        if (!df_disjoint(out, in[i]))
            return -EINVAL;
    return DISPATCH(be, gdn, q, k, v, g, beta, cu_seqlens, n_seq, hk, hv, dk, dv, mode, out);
}
