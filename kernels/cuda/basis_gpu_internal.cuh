/* basis_gpu_internal.cuh - what the two halves of the projection basis' GPU
 * code share (basis_gpu.cu: open, close and the second moment;
 * basis_gpu_solve.cu: the eigensolve, evaluation and extension): the state,
 * the error and memory helpers, the checking macros. Contracts in
 * basis_gpu.h. */
#ifndef DF_CUDA_BASIS_GPU_INTERNAL_CUH
#define DF_CUDA_BASIS_GPU_INTERNAL_CUH

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include "basis_gpu.h"

enum {
    CHUNK_MAX = 1024,  /* rows per device chunk, at most (the staging buffers' size) */
    GEMM_BLOCK = 4096, /* column blocks of the moment's block-triangular GEMMs */
    PACK_ROWS = 32,    /* rows per host packing task */
    NT = 256           /* threads of the reduction kernels */
};

/* Device bytes a step leaves free for cuBLAS's own workspace and fragmentation. */
static const size_t DEV_MARGIN = (size_t)512 << 20;

struct df_basis_gpu {
    int device, flags, chunk_rows;
    char name[320];
    cudaStream_t stream;
    cublasHandle_t blas;
    cusolverDnHandle_t solver;
    cusolverDnParams_t params;
    cudaEvent_t done[2]; /* staging buffer i's copy to the device has finished */
    /* the moment being accumulated: mom == NULL when none */
    df_moment *mom;
    int64_t base_rows; /* mom->n_rows at the first add: the rows mom->m holds */
    int64_t D;
    int err;           /* a CUDA call failed since the first add: the device moment is lost */
    double *dM;        /* D x D accumulator (row-major upper = column-major lower) */
    float *dS;         /* D x D f32 chunk product (BF16 path) */
    double *dXd;       /* CHUNK_MAX x D doubles (F64 path) */
    uint16_t *dX;      /* CHUNK_MAX x D BF16, token-major */
    uint16_t *hX[2];   /* pinned staging, CHUNK_MAX x D each */
    int cur;           /* the staging buffer being filled */
    int64_t fill;      /* rows in hX[cur] */
};

/* ---- errors and memory ---- */

static inline int cuda_fail(df_err *e, cudaError_t st, const char *what, const char *call)
{
    cudaGetLastError(); /* clear a non-sticky error */
    return df_errf(e, st == cudaErrorMemoryAllocation ? -ENOMEM : -EIO, "%s: %s: %s", what, call,
                   cudaGetErrorString(st));
}

static inline int blas_fail(df_err *e, cublasStatus_t st, const char *what, const char *call)
{
    return df_errf(e, st == CUBLAS_STATUS_ALLOC_FAILED ? -ENOMEM : -EIO, "%s: %s: %s", what, call,
                   cublasGetStatusString(st));
}

static inline int solver_fail(df_err *e, cusolverStatus_t st, const char *what, const char *call)
{
    return df_errf(e, st == CUSOLVER_STATUS_ALLOC_FAILED ? -ENOMEM : -EIO,
                   "%s: %s: cuSOLVER status %d", what, call, (int)st);
}

/* In functions with `int rc`, `const char *what`, `df_err *e` and an `out:` label. */
#define CK_CUDA(x, call)                             \
    do {                                             \
        cudaError_t st_ = (x);                       \
        if (st_ != cudaSuccess) {                    \
            rc = cuda_fail(e, st_, what, call);      \
            goto out;                                \
        }                                            \
    } while (0)
#define CK_BLAS(x, call)                             \
    do {                                             \
        cublasStatus_t st_ = (x);                    \
        if (st_ != CUBLAS_STATUS_SUCCESS) {          \
            rc = blas_fail(e, st_, what, call);      \
            goto out;                                \
        }                                            \
    } while (0)
#define CK_SOLVER(x, call)                           \
    do {                                             \
        cusolverStatus_t st_ = (x);                  \
        if (st_ != CUSOLVER_STATUS_SUCCESS) {        \
            rc = solver_fail(e, st_, what, call);    \
            goto out;                                \
        }                                            \
    } while (0)
#define CK_LAUNCH(kernel) CK_CUDA(cudaGetLastError(), kernel)
#define CK(x)             \
    do {                  \
        if ((rc = (x)))   \
            goto out;     \
    } while (0)

/* 0 when `need` bytes (plus DEV_MARGIN) are free on g's device, else -ENOMEM
 * saying what needs them and what is free. */
static inline int dev_room(const df_basis_gpu *g, size_t need, const char *what, const char *for_what,
                    df_err *e)
{
    size_t fr = 0, tot = 0;
    cudaError_t st = cudaMemGetInfo(&fr, &tot);
    if (st != cudaSuccess)
        return cuda_fail(e, st, what, "cudaMemGetInfo");
    if (need + DEV_MARGIN > fr)
        return df_errf(e, -ENOMEM, "%s: %s needs %.2f GB of GPU memory (+ %.2f GB margin); %s has "
                       "%.2f GB free of %.2f GB", what, for_what, (double)need / 1e9,
                       (double)DEV_MARGIN / 1e9, g->name, (double)fr / 1e9, (double)tot / 1e9);
    return 0;
}

static inline int dev_alloc(void *p, size_t bytes, const char *what, const char *name, df_err *e)
{
    void **pp = (void **)p;
    cudaError_t st = cudaMalloc(pp, bytes ? bytes : 1);
    if (st != cudaSuccess) {
        *pp = NULL;
        cudaGetLastError();
        return df_errf(e, st == cudaErrorMemoryAllocation ? -ENOMEM : -EIO,
                       "%s: cudaMalloc of %s (%.2f GB): %s", what, name, (double)bytes / 1e9,
                       cudaGetErrorString(st));
    }
    return 0;
}

static inline int set_device(const df_basis_gpu *g, const char *what, df_err *e)
{
    cudaError_t st = cudaSetDevice(g->device);
    return st == cudaSuccess ? 0 : cuda_fail(e, st, what, "cudaSetDevice");
}

/* Every copy goes on g's stream (a non-blocking one: the legacy default
 * stream of a plain cudaMemcpy would not wait for its kernels), then waits
 * for it and all before it: the host may read dst and reuse src after. */
static inline cudaError_t copy_wait(const df_basis_gpu *g, void *dst, const void *src, size_t bytes,
                             cudaMemcpyKind kind)
{
    cudaError_t st = cudaMemcpyAsync(dst, src, bytes, kind, g->stream);
    return st == cudaSuccess ? cudaStreamSynchronize(g->stream) : st;
}

static inline int64_t cdiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static inline unsigned grid1d(int64_t n)
{
    int64_t b = cdiv64(n, 256);
    return (unsigned)(b < 65536 ? (b > 0 ? b : 1) : 65536);
}

#endif
