/* backend_internal.h - what the op dispatch layer (kernels/ops*.c) and the
 * backends share. df_op_*() validate shapes once, here, then call the
 * backend's implementation; implementations may assume valid arguments. */
#ifndef DF_BACKEND_INTERNAL_H
#define DF_BACKEND_INTERNAL_H

#include "ops.h"
#include "train_ops.h"
#include "pool.h"

typedef enum df_backend_kind { DF_BACKEND_CPU = 1, DF_BACKEND_CUDA = 2 } df_backend_kind;

/* What a backend implements. The dispatch layer (ops.c, ops_gdn.c) checks
 * every argument, then calls through this table; an entry left NULL makes
 * the op return -ENOTSUP on that backend. Host-side int arrays (ids, pos,
 * cu_seqlens) are passed as the caller's host pointers: a device backend
 * stages them itself. */
typedef struct df_backend_vt {
    void (*close)(df_backend *be);
    int (*sync)(df_backend *be);
    void *(*alloc)(df_backend *be, size_t bytes);
    void (*free)(df_backend *be, void *p);
    int (*upload)(df_backend *be, void *dst, const void *src, size_t bytes);
    int (*download)(df_backend *be, void *dst, const void *src, size_t bytes);
    /* Within backend memory, in op order (dst and src may not overlap). */
    int (*copy)(df_backend *be, void *dst, const void *src, size_t bytes);
    int (*zero)(df_backend *be, void *dst, size_t bytes);
    /* n elements F32 <-> BF16 (or the same dtype: a copy), backend memory. */
    int (*cast)(df_backend *be, void *dst, df_dtype dt, const void *src, df_dtype st, int64_t n);
    /* Enqueued in op order; done by the next sync (NULL: same as download). */
    int (*download_async)(df_backend *be, void *dst, const void *src, size_t bytes);
    void *(*host_alloc)(df_backend *be, size_t bytes);
    void (*host_free)(df_backend *be, void *p);
    int (*fill_uniform)(df_backend *be, void *p, df_dtype dt, int64_t n, uint64_t seed, float lo,
                        float hi);
    /* Op profiling (DFLASH_PROFILE=1; NULL: none): marks the start and end
     * of one op named name; the backend sums the device time per name. */
    /* Device memory in use (bytes; NULL: not known). */
    int64_t (*mem_used)(df_backend *be);
    void (*prof_begin)(df_backend *be, const char *name);
    void (*prof_end)(df_backend *be);

    int (*embed)(df_backend *be, const df_tensor *table, const uint32_t *ids, int64_t n,
                 df_tensor *out);
    int (*matmul)(df_backend *be, const df_tensor *x, const df_tensor *w, df_tensor *y,
                  int accumulate);
    int (*add)(df_backend *be, const df_tensor *x, df_tensor *y);
    int (*rmsnorm)(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                   int plus_one, df_tensor *y);
    int (*rmsnorm_gated)(df_backend *be, const df_tensor *x, const df_tensor *z,
                         const df_tensor *w, float eps, df_tensor *y);
    int (*rope)(df_backend *be, df_tensor *x, const int32_t *pos, int heads, int head_dim,
                int rot_dim, double theta);
    int (*swiglu)(df_backend *be, const df_tensor *gate, const df_tensor *up, df_tensor *out);
    int (*sigmoid)(df_backend *be, const df_tensor *x, df_tensor *out);
    int (*silu)(df_backend *be, const df_tensor *x, df_tensor *out);
    int (*attention)(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
                     const int32_t *cu_seqlens, int n_seq, int nq, int nkv, int head_dim,
                     float scale, const df_tensor *gate, df_tensor *out);
    int (*conv1d_silu)(df_backend *be, const df_tensor *x, const df_tensor *w,
                       const int32_t *cu_seqlens, int n_seq, df_tensor *out);
    int (*l2norm)(df_backend *be, df_tensor *x, float eps, float scale);
    int (*gdn_gates)(df_backend *be, const df_tensor *a, const df_tensor *b,
                     const df_tensor *A_log, const df_tensor *dt_bias, df_tensor *g,
                     df_tensor *beta);
    int (*gdn)(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
               const df_tensor *g, const df_tensor *beta, const int32_t *cu_seqlens, int n_seq,
               int hk, int hv, int dk, int dv, df_gdn_mode mode, df_tensor *out);

    /* training ops (train_ops.h) */
    int (*matmul_bwd_x)(df_backend *be, const df_tensor *dy, const df_tensor *w, df_tensor *dx,
                        int accumulate);
    int (*matmul_bwd_w)(df_backend *be, const df_tensor *dy, const df_tensor *x, df_tensor *dw,
                        int accumulate);
    int (*rmsnorm_bwd)(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                       int plus_one, const df_tensor *dy, df_tensor *dx, int accumulate_dx,
                       df_tensor *dw);
    int (*rope_bwd)(df_backend *be, df_tensor *dx, const int32_t *pos, int heads, int head_dim,
                    int rot_dim, double theta);
    int (*swiglu_bwd)(df_backend *be, const df_tensor *gate, const df_tensor *up,
                      const df_tensor *dout, df_tensor *dgate, df_tensor *dup);
    int (*lmhead_ce)(df_backend *be, const df_tensor *h, const df_tensor *head,
                     const int32_t *label, const float *weight, float denom, double *loss_sum,
                     df_tensor *dh, int32_t *argmax, float *ce);
    /* grad / x: grad_dtype / dtype elements, F32 or BF16 (checked). */
    int (*adamw)(df_backend *be, float *master, const void *grad, df_dtype grad_dtype, float *m,
                 float *v, int64_t n, float lr, float beta1, float beta2, float eps, float wd,
                 int64_t step, float grad_scale, uint16_t *out_bf16);
    double (*sumsq)(df_backend *be, const void *x, df_dtype dtype, int64_t n);
    int (*dflash_attn)(df_backend *be, const df_tensor *q, const df_tensor *kc,
                       const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,
                       const df_dflash_blocks *blk, int nq, int nkv, int head_dim,
                       float scale, df_tensor *out, df_tensor *lse);
    int (*dflash_attn_bwd)(df_backend *be, const df_tensor *q, const df_tensor *kc,
                           const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,
                           const df_dflash_blocks *blk, int nq, int nkv, int head_dim,
                           float scale, const df_tensor *out, const df_tensor *lse,
                           const df_tensor *dout, df_tensor *dq, df_tensor *dkc, df_tensor *dvc,
                           df_tensor *dkb, df_tensor *dvb);
    /* Host to backend, enqueued in op order, no wait: src must stay as it is
     * until the next sync (pinned memory: a real async copy). NULL: same as
     * upload. */
    int (*upload_async)(df_backend *be, void *dst, const void *src, size_t bytes);
    /* Profiling: forget what was measured so far (the warm-up). NULL: none. */
    void (*prof_reset)(df_backend *be);
    /* df_backend_upload_ahead / _join (ops.h). NULL: a plain upload, and
     * nothing to join. */
    int (*upload_ahead)(df_backend *be, void *dst, const void *src, size_t bytes);
    int (*upload_join)(df_backend *be);
    /* df_backend_side_* / wait_mark (ops.h): on = 1 begin, 0 end; NULL:
     * nothing to do (one in-order stream). */
    int (*side)(df_backend *be, int on);
    int (*side_mark)(df_backend *be, int k);
    int (*wait_mark)(df_backend *be, int k);
} df_backend_vt;

struct df_backend {
    df_backend_kind kind;
    const df_backend_vt *vt;
    df_dtype act;  /* activation dtype: F32 on the CPU, BF16 on CUDA */
    int host_addressable; /* backend memory is plain host memory */
    df_pool *pool; /* CPU: the worker threads ops split their rows over */
    int nthreads;
    void *impl;    /* backend-private state (CUDA: stream, cuBLASLt, staging) */
    int prof;      /* profiling on: dispatch brackets every op with prof_begin/end */
    int side_on;   /* between df_backend_side_begin and _end */
    void *lent;    /* df_backend_lend_scratch: caller memory for workspaces, or NULL */
    size_t lent_bytes;
};

/* The dispatch's profiling brackets (ops.c, ops_gdn.c). */
static inline void df_prof_begin(df_backend *be, const char *name)
{
    if (be->prof)
        be->vt->prof_begin(be, name);
}

static inline int df_prof_end(df_backend *be, int rc)
{
    if (be->prof)
        be->vt->prof_end(be);
    return rc;
}

/* Calls the backend's implementation of op (profiled when asked), or
 * returns -ENOTSUP where the backend has none. */
#define DF_DISPATCH(be, op, ...)                                                             \
    ((be)->vt->op ? (df_prof_begin(be, #op), df_prof_end(be, (be)->vt->op(be, __VA_ARGS__)))  \
                  : -ENOTSUP)

/* Element i of df_backend_fill_uniform's sequence: a value in [lo, hi)
 * from a hash of (seed, i), so every backend computes the same numbers. */
#ifdef __CUDACC__
#define DF_HOST_DEVICE __host__ __device__
#else
#define DF_HOST_DEVICE
#endif
DF_HOST_DEVICE static inline float df_fill_value(uint64_t seed, uint64_t i, float lo, float hi)
{
    uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull; /* splitmix64 */
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    float u = (float)(z >> 40) * (1.0f / 16777216.0f); /* 24 bits: [0, 1) */
    return lo + (hi - lo) * u;
}

/* 1 when t's dtype is the backend's activation dtype. */
static inline int df_is_act(const df_backend *be, const df_tensor *t)
{
    return t && t->dtype == be->act;
}

/* CPU implementations (kernels/cpu/). Arguments are already validated. */
int df_cpu_embed(df_backend *be, const df_tensor *table, const uint32_t *ids, int64_t n,
                 df_tensor *out);
int df_cpu_matmul(df_backend *be, const df_tensor *x, const df_tensor *w, df_tensor *y,
                  int accumulate);
int df_cpu_add(df_backend *be, const df_tensor *x, df_tensor *y);
int df_cpu_rmsnorm(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                   int plus_one, df_tensor *y);
int df_cpu_rmsnorm_gated(df_backend *be, const df_tensor *x, const df_tensor *z,
                         const df_tensor *w, float eps, df_tensor *y);
int df_cpu_rope(df_backend *be, df_tensor *x, const int32_t *pos, int heads, int head_dim,
                int rot_dim, double theta);
int df_cpu_swiglu(df_backend *be, const df_tensor *gate, const df_tensor *up, df_tensor *out);
int df_cpu_sigmoid(df_backend *be, const df_tensor *x, df_tensor *out);
int df_cpu_silu(df_backend *be, const df_tensor *x, df_tensor *out);
int df_cpu_attention(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
                     const int32_t *cu_seqlens, int n_seq, int nq, int nkv, int head_dim,
                     float scale, const df_tensor *gate, df_tensor *out);
int df_cpu_conv1d_silu(df_backend *be, const df_tensor *x, const df_tensor *w,
                       const int32_t *cu_seqlens, int n_seq, df_tensor *out);
int df_cpu_l2norm(df_backend *be, df_tensor *x, float eps, float scale);
int df_cpu_gdn_gates(df_backend *be, const df_tensor *a, const df_tensor *b,
                     const df_tensor *A_log, const df_tensor *dt_bias, df_tensor *g,
                     df_tensor *beta);
int df_cpu_gdn(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
               const df_tensor *g, const df_tensor *beta, const int32_t *cu_seqlens, int n_seq,
               int hk, int hv, int dk, int dv, df_gdn_mode mode, df_tensor *out);

/* Weight element i of a BF16/F16/F32 vector, as f32. */
static inline float df_weight_at(const df_tensor *w, int64_t i)
{
    return df_elem_to_f32((const uint8_t *)w->data + i * (int64_t)df_dtype_size(w->dtype),
                          w->dtype);
}

#endif
