/* backend_internal.h - what the op dispatch layer (kernels/ops*.c) and the
 * backends share. df_op_*() validate shapes once, here, then call the
 * backend's implementation; implementations may assume valid arguments. */
#ifndef DF_BACKEND_INTERNAL_H
#define DF_BACKEND_INTERNAL_H

#include "op_list.h"
#include "ops.h"
#include "train_ops.h"
#include "pool.h"

#ifdef __cplusplus
extern "C" {
#endif

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

    /* the compute ops (op_list.h), in its order */
    DF_OPS(DF_OP_MEMBER)
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

/* Each backend's implementation of every op (op_list.h): df_cpu_<op>
 * (kernels/cpu/), df_cuda_<op> (kernels/cuda/; CUDA builds only). Arguments
 * are already validated. */
#define DF_CPU_OP_DECL(ret, name, params) ret df_cpu_##name params;
#define DF_CUDA_OP_DECL(ret, name, params) ret df_cuda_##name params;
DF_OPS(DF_CPU_OP_DECL)
DF_OPS(DF_CUDA_OP_DECL)

/* Weight element i of a BF16/F16/F32 vector, as f32. */
static inline float df_weight_at(const df_tensor *w, int64_t i)
{
    return df_elem_to_f32((const uint8_t *)w->data + i * (int64_t)df_dtype_size(w->dtype),
                          w->dtype);
}

#ifdef __cplusplus
}
#endif
#endif
