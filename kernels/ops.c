/* ops.c - tensor helpers, the backend handle, and the dense ops' dispatch.
 *
 * Every df_op_*() here checks its arguments completely before anything is
 * written, so a bad call returns -EINVAL with the outputs untouched, and the
 * backends (kernels/cpu/, later CUDA) may assume valid arguments. The Gated
 * DeltaNet ops dispatch from ops_gdn.c. */
#include "backend_internal.h"
#include "dflash_attn_internal.h"
#include "train_internal.h"
#include "op_checks.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- tensor helpers ---- */

df_tensor df_tensor_1d(void *data, df_dtype t, int64_t n)
{
    df_tensor r;
    memset(&r, 0, sizeof r);
    r.data = data;
    r.dtype = t;
    r.ndim = 1;
    r.shape[0] = n;
    r.stride[0] = 1;
    return r;
}

df_tensor df_tensor_2d(void *data, df_dtype t, int64_t rows, int64_t cols)
{
    df_tensor r;
    memset(&r, 0, sizeof r);
    r.data = data;
    r.dtype = t;
    r.ndim = 2;
    r.shape[0] = rows;
    r.shape[1] = cols;
    r.stride[0] = cols;
    r.stride[1] = 1;
    return r;
}

/* An out-of-range request yields an invalid tensor (no data, ndim 0) rather
 * than a view past the matrix: the helper cannot return an error, but every
 * op rejects such a tensor with -EINVAL. */
df_tensor df_tensor_cols(const df_tensor *m, int64_t col0, int64_t cols)
{
    df_tensor r;
    memset(&r, 0, sizeof r);
    if (!m || m->ndim != 2 || col0 < 0 || cols < 0 || col0 > m->shape[1] ||
        cols > m->shape[1] - col0 || df_dtype_size(m->dtype) == 0)
        return r;
    r = *m;
    r.data = (uint8_t *)m->data + col0 * m->stride[1] * (int64_t)df_dtype_size(m->dtype);
    r.shape[1] = cols;
    return r;
}

void *df_tensor_at(const df_tensor *m, int64_t r, int64_t c)
{
    if (!m || m->ndim != 2 || !m->data)
        return NULL;
    return (uint8_t *)m->data +
           (r * m->stride[0] + c * m->stride[1]) * (int64_t)df_dtype_size(m->dtype);
}

/* 0 for an invalid tensor (ndim outside 1..4). */
int64_t df_tensor_numel(const df_tensor *t)
{
    if (!t || t->ndim < 1 || t->ndim > DF_TENSOR_MAX_DIMS)
        return 0;
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++)
        n *= t->shape[d];
    return n;
}

/* ---- backend handle ---- */

static void cpu_close(df_backend *be)
{
    df_pool_close(be->pool);
    free(be);
}

/* CPU ops run synchronously: by the time df_op_*() returns, it is done. */
static int cpu_sync(df_backend *be)
{
    (void)be;
    return 0;
}

static void *cpu_alloc(df_backend *be, size_t bytes)
{
    (void)be;
    if (bytes > SIZE_MAX - 64)
        return NULL;
    /* aligned_alloc wants a multiple of the alignment; 0 bytes still gives a
     * unique pointer so callers need no special case. */
    size_t n = (bytes + 63) & ~(size_t)63;
    return aligned_alloc(64, n ? n : 64);
}

static void cpu_free(df_backend *be, void *p)
{
    (void)be;
    free(p);
}

static int cpu_copy(df_backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    memmove(dst, src, bytes);
    return 0;
}

static int cpu_fill_uniform(df_backend *be, void *p, df_dtype dt, int64_t n, uint64_t seed,
                            float lo, float hi)
{
    (void)be;
    for (int64_t i = 0; i < n; i++) {
        float v = df_fill_value(seed, (uint64_t)i, lo, hi);
        if (dt == DF_DTYPE_F32)
            ((float *)p)[i] = v;
        else
            ((uint16_t *)p)[i] = df_f32_to_bf16(v);
    }
    return 0;
}

static int cpu_zero(df_backend *be, void *dst, size_t bytes)
{
    (void)be;
    memset(dst, 0, bytes);
    return 0;
}

static int cpu_cast(df_backend *be, void *dst, df_dtype dt, const void *src, df_dtype st,
                    int64_t n)
{
    (void)be;
    if (dt == st) {
        memmove(dst, src, (size_t)n * df_dtype_size(dt));
    } else if (dt == DF_DTYPE_BF16) {
        for (int64_t i = 0; i < n; i++)
            ((uint16_t *)dst)[i] = df_f32_to_bf16(((const float *)src)[i]);
    } else {
        for (int64_t i = 0; i < n; i++)
            ((float *)dst)[i] = df_bf16_to_f32(((const uint16_t *)src)[i]);
    }
    return 0;
}

static const df_backend_vt cpu_vt = {
    .close = cpu_close,
    .sync = cpu_sync,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .copy = cpu_copy,
    .zero = cpu_zero,
    .cast = cpu_cast,
    .host_alloc = cpu_alloc,
    .host_free = cpu_free,
    .fill_uniform = cpu_fill_uniform,
#define DF_CPU_OP_ENTRY(ret, name, params) .name = df_cpu_##name,
    DF_OPS(DF_CPU_OP_ENTRY)
#undef DF_CPU_OP_ENTRY
};

df_backend *df_backend_cpu_open(int nthreads, df_err *e)
{
    if (nthreads < 0) {
        df_errf(e, -EINVAL, "cpu backend: nthreads %d < 0", nthreads);
        return NULL;
    }
    df_backend *be = calloc(1, sizeof *be);
    if (!be) {
        df_errf(e, -ENOMEM, "cpu backend: out of memory");
        return NULL;
    }
    be->kind = DF_BACKEND_CPU;
    be->vt = &cpu_vt;
    be->act = DF_DTYPE_F32;
    be->host_addressable = 1;
    be->pool = df_pool_open(nthreads);
    if (!be->pool) {
        free(be);
        df_errf(e, -ENOMEM, "cpu backend: cannot start a pool of %d threads", nthreads);
        return NULL;
    }
    be->nthreads = df_pool_size(be->pool);
    return be;
}

void df_backend_close(df_backend *be)
{
    if (be)
        be->vt->close(be);
}

const char *df_backend_name(const df_backend *be)
{
    if (!be)
        return "none";
    return be->kind == DF_BACKEND_CPU ? "cpu" : be->kind == DF_BACKEND_CUDA ? "cuda" : "unknown";
}

df_dtype df_backend_act_dtype(const df_backend *be)
{
    return be ? be->act : DF_DTYPE_INVALID;
}

int df_backend_host_addressable(const df_backend *be)
{
    return be ? be->host_addressable : 0;
}

int df_backend_sync(df_backend *be)
{
    return be ? be->vt->sync(be) : -EINVAL;
}

void *df_backend_alloc(df_backend *be, size_t bytes)
{
    return be ? be->vt->alloc(be, bytes) : NULL;
}

void df_backend_free(df_backend *be, void *p)
{
    if (be && p)
        be->vt->free(be, p);
}

void *df_backend_host_alloc(df_backend *be, size_t bytes)
{
    return be ? be->vt->host_alloc(be, bytes) : NULL;
}

void df_backend_host_free(df_backend *be, void *p)
{
    if (be && p)
        be->vt->host_free(be, p);
}

int df_backend_fill_uniform(df_backend *be, void *p, df_dtype dt, int64_t n, uint64_t seed,
                            float lo, float hi)
{
    if (!be || n < 0 || (n && !p) || (dt != DF_DTYPE_F32 && dt != DF_DTYPE_BF16) ||
        !isfinite(lo) || !isfinite(hi) || !(lo <= hi))
        return -EINVAL;
    return n ? be->vt->fill_uniform(be, p, dt, n, seed, lo, hi) : 0;
}

int df_backend_upload(df_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!be || (bytes && (!dst || !src)))
        return -EINVAL;
    return bytes ? be->vt->upload(be, dst, src, bytes) : 0;
}

int64_t df_backend_mem_used(df_backend *be)
{
    return be && be->vt->mem_used ? be->vt->mem_used(be) : -1;
}

int df_backend_copy(df_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!be || (bytes && (!dst || !src)))
        return -EINVAL;
    if (bytes && (const uint8_t *)dst < (const uint8_t *)src + bytes &&
        (const uint8_t *)src < (const uint8_t *)dst + bytes)
        return -EINVAL;
    return bytes ? be->vt->copy(be, dst, src, bytes) : 0;
}

int df_backend_zero(df_backend *be, void *dst, size_t bytes)
{
    if (!be || (bytes && !dst))
        return -EINVAL;
    return bytes ? be->vt->zero(be, dst, bytes) : 0;
}

int df_backend_cast(df_backend *be, void *dst, df_dtype dt, const void *src, df_dtype st,
                    int64_t n)
{
    int ok = (dt == DF_DTYPE_F32 || dt == DF_DTYPE_BF16) && (st == DF_DTYPE_F32 || st == DF_DTYPE_BF16);
    if (!be || !ok || n < 0 || (n && (!dst || !src)))
        return -EINVAL;
    if (dst != src) { /* in place only for the same dtype (a no-op) */
        size_t db = (size_t)n * df_dtype_size(dt), sb = (size_t)n * df_dtype_size(st);
        if ((const uint8_t *)dst < (const uint8_t *)src + sb &&
            (const uint8_t *)src < (const uint8_t *)dst + db)
            return -EINVAL;
    } else if (dt != st) {
        return -EINVAL;
    }
    return n && dst != src ? be->vt->cast(be, dst, dt, src, st, n) : 0;
}

void df_backend_profile_reset(df_backend *be)
{
    if (be && be->prof && be->vt->prof_reset)
        be->vt->prof_reset(be);
}

int df_backend_upload_async(df_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!be || (bytes && (!dst || !src)))
        return -EINVAL;
    if (!bytes)
        return 0;
    return be->vt->upload_async ? be->vt->upload_async(be, dst, src, bytes)
                                : be->vt->upload(be, dst, src, bytes);
}

int df_backend_upload_ahead(df_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!be || (bytes && (!dst || !src)))
        return -EINVAL;
    if (!bytes)
        return 0;
    return be->vt->upload_ahead ? be->vt->upload_ahead(be, dst, src, bytes)
                                : be->vt->upload(be, dst, src, bytes);
}

int df_backend_upload_join(df_backend *be)
{
    if (!be)
        return -EINVAL;
    return be->vt->upload_join ? be->vt->upload_join(be) : 0;
}

void df_backend_lend_scratch(df_backend *be, void *p, size_t bytes)
{
    if (!be)
        return;
    be->lent = bytes ? p : NULL;
    be->lent_bytes = be->lent ? bytes : 0;
}

int df_backend_side_begin(df_backend *be)
{
    if (!be || be->side_on)
        return -EINVAL;
    int rc = be->vt->side ? be->vt->side(be, 1) : 0;
    be->side_on = rc == 0;
    return rc;
}

int df_backend_side_end(df_backend *be)
{
    if (!be || !be->side_on)
        return -EINVAL;
    be->side_on = 0;
    return be->vt->side ? be->vt->side(be, 0) : 0;
}

int df_backend_side_mark(df_backend *be, int k)
{
    if (!be || !be->side_on || k < 0 || k >= DF_BACKEND_MARKS)
        return -EINVAL;
    return be->vt->side_mark ? be->vt->side_mark(be, k) : 0;
}

int df_backend_wait_mark(df_backend *be, int k)
{
    if (!be || be->side_on || k < 0 || k >= DF_BACKEND_MARKS)
        return -EINVAL;
    return be->vt->wait_mark ? be->vt->wait_mark(be, k) : 0;
}

int df_backend_download_async(df_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!be || (bytes && (!dst || !src)))
        return -EINVAL;
    if (!bytes)
        return 0;
    return be->vt->download_async ? be->vt->download_async(be, dst, src, bytes)
                                  : be->vt->download(be, dst, src, bytes);
}

int df_backend_download(df_backend *be, void *dst, const void *src, size_t bytes)
{
    if (!be || (bytes && (!dst || !src)))
        return -EINVAL;
    return bytes ? be->vt->download(be, dst, src, bytes) : 0;
}

/* ---- argument checks ---- */

/* ops.c's tensor rule (op_checks.h): no overflow / span limit. */
static int check_tensor(const df_tensor *t, int ndim_min, int ndim_max, int weight, int out)
{
    return df_check_tensor(t, ndim_min, ndim_max, weight, out, 0);
}

/* Activations have the backend's dtype (F32 on the CPU, BF16 on CUDA). */
#define ACT(be) ((be)->act == DF_DTYPE_BF16 ? DF_CHK_BF16 : DF_CHK_F32)

/* Weights: any weight dtype on the CPU, BF16 on CUDA. */
#define WT(be) ((be)->act == DF_DTYPE_BF16 ? DF_CHK_BF16 : DF_CHK_WEIGHT)

#define DISPATCH DF_DISPATCH

/* ---- dense ops ---- */

int df_op_embed(df_backend *be, const df_tensor *table, const uint32_t *ids, int64_t n,
                df_tensor *out)
{
    if (!be || !check_tensor(table, 2, 2, WT(be), 0) || !check_tensor(out, 2, 2, ACT(be), 1) || n < 0)
        return -EINVAL;
    if (out->shape[0] != n || out->shape[1] != table->shape[1] || (n > 0 && !ids))
        return -EINVAL;
    if (!df_alias_ok(out, table, 0))
        return -EINVAL;
    for (int64_t i = 0; i < n; i++)
        if ((int64_t)ids[i] >= table->shape[0])
            return -EINVAL;
    return DISPATCH(be, embed, table, ids, n, out);
}

int df_op_matmul(df_backend *be, const df_tensor *x, const df_tensor *w, df_tensor *y,
                 int accumulate)
{
    if (!be || !df_gemm_args_ok(DF_GEMM_FWD, x, w, y, ACT(be), WT(be), 0))
        return -EINVAL;
    return DISPATCH(be, matmul, x, w, y, accumulate);
}

int df_op_add(df_backend *be, const df_tensor *x, df_tensor *y)
{
    if (!be || !check_tensor(x, 1, 4, ACT(be), 0) || !check_tensor(y, 1, 4, ACT(be), 1) || !df_same_shape(x, y))
        return -EINVAL;
    /* Elementwise, so the same view (y = 2y) is well defined; a shifted one is not. */
    if (!df_alias_ok(y, x, 1))
        return -EINVAL;
    return DISPATCH(be, add, x, y);
}

static int check_norm_weight(const df_backend *be, const df_tensor *w, int64_t D)
{
    return check_tensor(w, 1, 1, WT(be), 0) && w->shape[0] == D;
}

/* df_op_rmsnorm's arguments (and df_op_rmsnorm_fp8's): 0 or -EINVAL */
static int df_op_rmsnorm_check(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                               const df_tensor *y)
{
    if (!be || !check_tensor(x, 1, 4, ACT(be), 0) || !check_tensor(y, 1, 4, ACT(be), 1) || !df_same_shape(x, y))
        return -EINVAL;
    if (!check_norm_weight(be, w, x->shape[x->ndim - 1]) || !(eps >= 0) || !isfinite(eps))
        return -EINVAL;
    if (!df_alias_ok(y, x, 1) || !df_alias_ok(y, w, 0))
        return -EINVAL;
    return 0;
}

int df_op_rmsnorm(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                  int plus_one, df_tensor *y)
{
    int rc = df_op_rmsnorm_check(be, x, w, eps, y);
    return rc ? rc : DISPATCH(be, rmsnorm, x, w, eps, plus_one, y);
}

int df_op_fp8_dy_codes(df_backend *be, const df_tensor *dy, unsigned flags)
{
    if (!be || (flags & ~DF_FP8_DY_BLOCKS) || !check_tensor(dy, 2, 2, ACT(be), 0))
        return -EINVAL;
    return DISPATCH(be, fp8_dy_codes, dy, flags);
}

int df_op_rmsnorm_fp8(df_backend *be, const df_tensor *x, const df_tensor *w, float eps, df_tensor *y,
                      int uses, unsigned flags)
{
    if (!be || !(flags & (DF_FP8_X_FWD | DF_FP8_X_BWD_W)) || uses < 1 ||
        (flags & ~(DF_FP8_X_FWD | DF_FP8_X_BWD_W | DF_FP8_ONLY_CODES)) || !x || x->ndim != 2)
        return -EINVAL;
    int rc = df_op_rmsnorm_check(be, x, w, eps, y);
    return rc ? rc : DISPATCH(be, rmsnorm_fp8, x, w, eps, y, uses, flags);
}

int df_op_rmsnorm_gated(df_backend *be, const df_tensor *x, const df_tensor *z,
                        const df_tensor *w, float eps, df_tensor *y)
{
    if (!be || !check_tensor(x, 1, 4, ACT(be), 0) || !check_tensor(z, 1, 4, ACT(be), 0) ||
        !check_tensor(y, 1, 4, ACT(be), 1) || !df_same_shape(x, y) || !df_same_shape(z, y))
        return -EINVAL;
    if (!check_norm_weight(be, w, x->shape[x->ndim - 1]) || !(eps >= 0) || !isfinite(eps))
        return -EINVAL;
    if (!df_alias_ok(y, x, 1) || !df_alias_ok(y, z, 0) || !df_alias_ok(y, w, 0))
        return -EINVAL;
    return DISPATCH(be, rmsnorm_gated, x, z, w, eps, y);
}

int df_op_rope(df_backend *be, df_tensor *x, const int32_t *pos, int heads, int head_dim,
               int rot_dim, double theta)
{
    if (!be || !check_tensor(x, 2, 2, ACT(be), 1) ||
        !df_rope_args_ok(x, pos, heads, head_dim, rot_dim, theta))
        return -EINVAL;
    return DISPATCH(be, rope, x, pos, heads, head_dim, rot_dim, theta);
}

/* Three same-shaped elementwise operands; out may be the same view as an input. */
static int check_elementwise(const df_backend *be, const df_tensor *a, const df_tensor *b, const df_tensor *out)
{
    if (!check_tensor(a, 1, 4, ACT(be), 0) || !check_tensor(out, 1, 4, ACT(be), 1) || !df_same_shape(a, out))
        return 0;
    if (!df_alias_ok(out, a, 1))
        return 0;
    if (b && (!check_tensor(b, 1, 4, ACT(be), 0) || !df_same_shape(b, out) || !df_alias_ok(out, b, 1)))
        return 0;
    return 1;
}

int df_op_swiglu(df_backend *be, const df_tensor *gate, const df_tensor *up, df_tensor *out)
{
    if (!be || !check_elementwise(be, gate, up, out))
        return -EINVAL;
    return DISPATCH(be, swiglu, gate, up, out);
}

int df_op_swiglu_fp8(df_backend *be, const df_tensor *gate, const df_tensor *up, df_tensor *out,
                     unsigned flags)
{
    if (!be || !(flags & (DF_FP8_X_FWD | DF_FP8_X_BWD_W)) ||
        (flags & ~(DF_FP8_X_FWD | DF_FP8_X_BWD_W | DF_FP8_ONLY_CODES)) ||
        !check_elementwise(be, gate, up, out))
        return -EINVAL;
    return DISPATCH(be, swiglu_fp8, gate, up, out, flags);
}

int df_op_sigmoid(df_backend *be, const df_tensor *x, df_tensor *out)
{
    if (!be || !check_elementwise(be, x, NULL, out))
        return -EINVAL;
    return DISPATCH(be, sigmoid, x, out);
}

int df_op_silu(df_backend *be, const df_tensor *x, df_tensor *out)
{
    if (!be || !check_elementwise(be, x, NULL, out))
        return -EINVAL;
    return DISPATCH(be, silu, x, out);
}

int df_op_attention(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
                    const int32_t *cu_seqlens, int n_seq, int nq, int nkv, int head_dim,
                    float scale, const df_tensor *gate, df_tensor *out)
{
    if (!be || !check_tensor(q, 2, 2, ACT(be), 0) || !check_tensor(k, 2, 2, ACT(be), 0) ||
        !check_tensor(v, 2, 2, ACT(be), 0) || !check_tensor(out, 2, 2, ACT(be), 1))
        return -EINVAL;
    if (nq <= 0 || nkv <= 0 || head_dim <= 0 || nq % nkv || !isfinite(scale))
        return -EINVAL;
    int64_t T = q->shape[0];
    if (q->shape[1] != (int64_t)nq * head_dim || !df_same_shape(q, out))
        return -EINVAL;
    if (k->shape[0] != T || v->shape[0] != T || k->shape[1] != (int64_t)nkv * head_dim ||
        !df_same_shape(k, v))
        return -EINVAL;
    if (gate && (!check_tensor(gate, 2, 2, ACT(be), 0) || !df_same_shape(gate, out)))
        return -EINVAL;
    /* out rows are written while later rows still read k/v (and q, gate):
     * no overlap at all, not even the same view. */
    if (!df_alias_ok(out, q, 0) || !df_alias_ok(out, k, 0) || !df_alias_ok(out, v, 0) ||
        (gate && !df_alias_ok(out, gate, 0)))
        return -EINVAL;
    /* Empty sequences are harmless and allowed (non-decreasing bounds). */
    if (n_seq < 0 || !cu_seqlens || cu_seqlens[0] != 0 || cu_seqlens[n_seq] != T)
        return -EINVAL;
    for (int s = 0; s < n_seq; s++)
        if (cu_seqlens[s + 1] < cu_seqlens[s])
            return -EINVAL;
    return DISPATCH(be, attention, q, k, v, cu_seqlens, n_seq, nq, nkv, head_dim, scale, gate, out);
}
