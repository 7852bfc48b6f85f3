/* op_checks.c - the argument checks shared by the op dispatch files
 * (contracts in op_checks.h). */
#include "op_checks.h"

#include <math.h>

int df_is_weight_dtype(df_dtype t)
{
    return t == DF_DTYPE_BF16 || t == DF_DTYPE_F16 || t == DF_DTYPE_F32;
}

int df_check_tensor(const df_tensor *t, int ndim_min, int ndim_max, int weight, int out,
                    int64_t max_span)
{
    if (!t || t->ndim < ndim_min || t->ndim > ndim_max)
        return 0;
    int dtype_ok;
    if (weight == DF_CHK_WEIGHT)
        dtype_ok = df_is_weight_dtype(t->dtype);
    else if (weight == DF_CHK_GRAD)
        dtype_ok = t->dtype == DF_DTYPE_F32 || t->dtype == DF_DTYPE_BF16;
    else
        dtype_ok = t->dtype == (weight == DF_CHK_BF16 ? DF_DTYPE_BF16 : DF_DTYPE_F32);
    if (!dtype_ok)
        return 0;
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] < 0 || t->stride[d] < 0)
            return 0;
    if (t->stride[t->ndim - 1] != 1)
        return 0;
    if (max_span > 0) {
        int64_t n = 1, span = 1, step;
        for (int d = 0; d < t->ndim; d++) {
            if (t->shape[d] == 0)
                return 1; /* empty: nothing is ever addressed */
            if (__builtin_mul_overflow(n, t->shape[d], &n) ||
                __builtin_mul_overflow(t->shape[d] - 1, t->stride[d], &step) ||
                __builtin_add_overflow(span, step, &span) || span > max_span)
                return 0;
        }
    } else if (df_tensor_numel(t) <= 0) {
        return 1; /* empty (or, as ops.c always had it, a count that wrapped) */
    }
    if (!t->data)
        return 0;
    if (out) { /* each outer stride steps over everything inside it */
        int64_t ext = 1; /* elements spanned by the dims inside d */
        for (int d = t->ndim - 1; d >= 0; d--)
            if (t->shape[d] > 1) {
                if (t->stride[d] < ext)
                    return 0;
                ext = t->stride[d] * (t->shape[d] - 1) + ext;
            }
    }
    return 1;
}

int df_same_shape(const df_tensor *a, const df_tensor *b)
{
    if (a->ndim != b->ndim)
        return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d])
            return 0;
    return 1;
}

int df_same_view(const df_tensor *a, const df_tensor *b)
{
    if (a->data != b->data || a->dtype != b->dtype || !df_same_shape(a, b))
        return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] > 1 && a->stride[d] != b->stride[d])
            return 0;
    return 1;
}

df_rowspan df_span_of(const df_tensor *t)
{
    int64_t es = (int64_t)df_dtype_size(t->dtype);
    df_rowspan s = {(intptr_t)t->data, 1, 0, 0};
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

df_rowspan df_span_raw(const void *p, int64_t n, size_t es)
{
    df_rowspan s = {(intptr_t)p, 1, 0, p ? n * (int64_t)es : 0};
    return s;
}

static int64_t floor_div(int64_t a, int64_t b) /* b > 0 */
{
    int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

int df_spans_overlap(df_rowspan a, df_rowspan b)
{
    if (a.width == 0 || b.width == 0)
        return 0;
    /* A single row has no stride of its own: adopt the other's. */
    if (a.rows == 1)
        a.stride = b.stride;
    if (b.rows == 1)
        b.stride = a.stride;
    if (a.stride == b.stride && a.stride >= a.width && a.stride >= b.width) {
        int64_t S = a.stride;
        if (S == 0) /* both single rows */
            return b.base < a.base + a.width && a.base < b.base + b.width;
        /* Row rb of B starts d + k*S bytes after row ra of A (k = rb - ra);
         * they overlap iff that offset lies in (-b.width, a.width). */
        int64_t d = (int64_t)(b.base - a.base);
        int64_t kmin = -(a.rows - 1), kmax = b.rows - 1;
        int64_t k0 = floor_div(-b.width - d, S) + 1; /* first k with offset > -b.width */
        for (int64_t k = k0; k <= k0 + 1; k++)
            if (k >= kmin && k <= kmax && d + k * S < a.width)
                return 1;
        return 0;
    }
    intptr_t alo = a.base, ahi = a.base + (intptr_t)((a.rows - 1) * a.stride + a.width);
    intptr_t blo = b.base, bhi = b.base + (intptr_t)((b.rows - 1) * b.stride + b.width);
    return blo < ahi && alo < bhi;
}

int df_overlaps(const df_tensor *a, const df_tensor *b)
{
    return df_spans_overlap(df_span_of(a), df_span_of(b));
}

int df_alias_ok(const df_tensor *out, const df_tensor *in, int may_alias)
{
    if (may_alias && df_same_view(out, in))
        return 1;
    return !df_overlaps(out, in);
}

int64_t df_extent(const df_tensor *t)
{
    int64_t ext = 1, step;
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] == 0)
            return 0;
    for (int d = 0; d < t->ndim; d++)
        if (__builtin_mul_overflow(t->shape[d] - 1, t->stride[d], &step) ||
            __builtin_add_overflow(ext, step, &ext) || ext > DF_MAX_EXTENT)
            return -1;
    return ext;
}

int df_disjoint(const df_tensor *a, const df_tensor *b)
{
    int64_t ea = df_extent(a), eb = df_extent(b);
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

int df_rope_args_ok(const df_tensor *x, const int32_t *pos, int heads, int head_dim, int rot_dim,
                    double theta)
{
    if (heads <= 0 || head_dim <= 0 || (int64_t)heads * head_dim != x->shape[1])
        return 0;
    if (rot_dim <= 0 || rot_dim % 2 || rot_dim > head_dim)
        return 0;
    /* theta^(e) for e in [0, 1) must be a finite positive fp32 number. */
    if (!(theta > 0) || !((float)theta < INFINITY))
        return 0;
    return x->shape[0] == 0 || pos != NULL;
}

int df_gemm_args_ok(int kind, const df_tensor *a, const df_tensor *b, const df_tensor *c, int act,
                    int wt, int64_t max_span)
{
    int bw = kind == DF_GEMM_BWD_W;
    if (kind < DF_GEMM_FWD || kind > DF_GEMM_BWD_W ||
        !df_check_tensor(a, 2, 2, act, 0, max_span) ||
        !df_check_tensor(b, 2, 2, bw ? act : wt, 0, max_span) ||
        !df_check_tensor(c, 2, 2, bw ? DF_CHK_GRAD : act, 1, max_span))
        return 0;
    const int64_t *A = a->shape, *B = b->shape, *C = c->shape;
    int shapes = kind == DF_GEMM_FWD ? A[1] == B[1] && C[0] == A[0] && C[1] == B[0]  /* x w^T */
                 : kind == DF_GEMM_BWD_X ? A[1] == B[0] && C[0] == A[0] && C[1] == B[1] /* dy w */
                                         : A[0] == B[0] && C[0] == A[1] && C[1] == B[1]; /* dy^T x */
    /* c is written tile by tile while a and b are still being read */
    return shapes && df_alias_ok(c, a, 0) && df_alias_ok(c, b, 0);
}
