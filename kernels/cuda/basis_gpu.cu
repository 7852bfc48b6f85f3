/* basis_gpu.cu - the projection basis' heavy parts on a CUDA GPU (contracts
 * in basis_gpu.h; the CPU reference is formats/basis.c (moment, fit),
 * basis_extend.c and basis_eval.c).
 *
 * Layouts. Host matrices are row-major; cuBLAS and cuSOLVER are
 * column-major. A row-major R x D matrix (P, Q, C = P M) is, unchanged in
 * memory, a column-major D x R one whose column r is row r: "Pc" below. The
 * moment m->m holds its upper triangle row-major, which read column-major is
 * the lower triangle: every symmetric call here says CUBLAS_FILL_MODE_LOWER,
 * and a device copy is made whole by mirroring that triangle (mirror_kernel).
 *
 * The moment. Rows are packed token-major (the K layers concatenated) into
 * one of two pinned host buffers (the host fills one while the device reads
 * the other), copied to the device a chunk at a time, and there X^T X of the
 * chunk (X: rows x D, BF16; column-major D x rows) is either
 *  - cublasGemmEx (BF16 in, f32 out, f32 compute) into an f32 D x D scratch,
 *    only its blocks on and below the column-major diagonal (= row-major
 *    upper), then acc_upper_kernel adds the row-major upper triangle into
 *    the double accumulator; or
 *  - (DF_BASIS_GPU_MOMENT_F64) the chunk widened to double and cublasDsyrk
 *    (lower, beta = 1) straight into the accumulator.
 * Either way the accumulator's row-major upper triangle is M's, the layout
 * of df_moment's m; the sync copies it out.
 *
 * Reductions (column norms, per-layer dots) are fixed-shape block sums
 * written per block and summed on the host in a fixed order: the results do
 * not depend on scheduling. */
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

static int cuda_fail(df_err *e, cudaError_t st, const char *what, const char *call)
{
    cudaGetLastError(); /* clear a non-sticky error */
    return df_errf(e, st == cudaErrorMemoryAllocation ? -ENOMEM : -EIO, "%s: %s: %s", what, call,
                   cudaGetErrorString(st));
}

static int blas_fail(df_err *e, cublasStatus_t st, const char *what, const char *call)
{
    return df_errf(e, st == CUBLAS_STATUS_ALLOC_FAILED ? -ENOMEM : -EIO, "%s: %s: %s", what, call,
                   cublasGetStatusString(st));
}

static int solver_fail(df_err *e, cusolverStatus_t st, const char *what, const char *call)
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
static int dev_room(const df_basis_gpu *g, size_t need, const char *what, const char *for_what,
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

static int dev_alloc(void *p, size_t bytes, const char *what, const char *name, df_err *e)
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

static int set_device(const df_basis_gpu *g, const char *what, df_err *e)
{
    cudaError_t st = cudaSetDevice(g->device);
    return st == cudaSuccess ? 0 : cuda_fail(e, st, what, "cudaSetDevice");
}

/* Every copy goes on g's stream (a non-blocking one: the legacy default
 * stream of a plain cudaMemcpy would not wait for its kernels), then waits
 * for it and all before it: the host may read dst and reuse src after. */
static cudaError_t copy_wait(const df_basis_gpu *g, void *dst, const void *src, size_t bytes,
                             cudaMemcpyKind kind)
{
    cudaError_t st = cudaMemcpyAsync(dst, src, bytes, kind, g->stream);
    return st == cudaSuccess ? cudaStreamSynchronize(g->stream) : st;
}

static int64_t cdiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---- kernels ---- */

/* M[r][c] += S[r][c] (double += f32) for r <= c < D: the row-major upper
 * triangle. Block (32 x 8) = a 32 x 32 tile, tiles wholly below the
 * diagonal return at once. */
__global__ void acc_upper_kernel(double *M, const float *S, int64_t D)
{
    int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x, r0 = (int64_t)blockIdx.y * 32;
    if (r0 > (int64_t)blockIdx.x * 32 + 31 || c >= D)
        return;
    for (int k = threadIdx.y; k < 32; k += 8) {
        int64_t r = r0 + k;
        if (r < D && r <= c)
            M[r * D + c] += (double)S[r * D + c];
    }
}

/* A (column-major D x D): its strictly upper triangle from its lower one,
 * A(r, c) = A(c, r) for r < c, through a 32 x 32 shared tile (coalesced
 * both ways). Tile (bx, by) writes rows by*32.., columns bx*32.. of the
 * upper triangle and reads the mirrored tile of the lower one, which no
 * block writes (a diagonal tile reads before it writes: __syncthreads). */
__global__ void mirror_kernel(double *A, int64_t D)
{
    __shared__ double t[32][33];
    if (blockIdx.y > blockIdx.x)
        return;
    int64_t r0 = (int64_t)blockIdx.y * 32, c0 = (int64_t)blockIdx.x * 32;
    for (int k = threadIdx.y; k < 32; k += 8) { /* t[rl][cl] = A(c0 + cl, r0 + rl) */
        int64_t r = r0 + k, c = c0 + threadIdx.x;
        if (r < D && c < D)
            t[k][threadIdx.x] = A[r * D + c];
    }
    __syncthreads();
    for (int k = threadIdx.y; k < 32; k += 8) { /* A(r0 + tx, c0 + k) = t[tx][k] */
        int64_t r = r0 + threadIdx.x, c = c0 + k;
        if (r < c && c < D)
            A[c * D + r] = t[threadIdx.x][k];
    }
}

/* y[i] = the BF16 bits x[i], widened (exact). */
__global__ void bf16_to_f64_kernel(const uint16_t *x, double *y, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = (double)__uint_as_float((uint32_t)x[i] << 16);
}

/* y[i] = x[i], widened (exact). */
__global__ void f32_to_f64_kernel(const float *x, double *y, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = (double)x[i];
}

/* d[i] = A[i][i]. */
__global__ void diag_kernel(const double *A, int64_t D, double *d)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < D)
        d[i] = A[i * D + i];
}

/* P (row-major R x D, f32) row r = column ctop - r of A (column-major, ld D),
 * rounded to nearest: the eigenvectors in descending order. */
__global__ void vec_to_rows_kernel(const double *A, int64_t D, int64_t ctop, float *P)
{
    int64_t r = blockIdx.y, i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < D)
        P[r * D + i] = (float)A[(ctop - r) * D + i];
}

/* The sum of v over the block (NT threads), valid in thread 0. */
__device__ double block_sum(double v)
{
    __shared__ double w[NT / 32];
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_down_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0)
        w[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < NT / 32 ? w[threadIdx.x] : 0.0;
        for (int o = 16; o > 0; o >>= 1)
            v += __shfl_down_sync(0xffffffffu, v, o);
    }
    return v;
}

/* out[c] = sum_i A[c*D + i]^2: the squared norm of column c (one block each). */
__global__ void __launch_bounds__(NT) col_sumsq_kernel(const double *A, int64_t D, double *out)
{
    const double *a = A + (int64_t)blockIdx.x * D;
    double s = 0;
    for (int64_t i = threadIdx.x; i < D; i += NT)
        s += a[i] * a[i];
    s = block_sum(s);
    if (threadIdx.x == 0)
        out[blockIdx.x] = s;
}

/* A[c*D + i] *= f[c] (columns of A, one block row each). */
__global__ void col_scale_kernel(double *A, int64_t D, const double *f)
{
    int64_t c = blockIdx.y, i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < D)
        A[c * D + i] *= f[c];
}

/* part[r*K + k] = sum over layer k's columns i of P[r][i] C[r][i] (row-major
 * R x D both; block (r, k)). */
__global__ void __launch_bounds__(NT) layer_dot_kernel(const double *P, const double *C, int64_t D,
                                                       int64_t H, double *part)
{
    int64_t r = blockIdx.x, k = blockIdx.y, off = r * D + k * H;
    double s = 0;
    for (int64_t i = threadIdx.x; i < H; i += NT)
        s += P[off + i] * C[off + i];
    s = block_sum(s);
    if (threadIdx.x == 0)
        part[r * gridDim.y + k] = s;
}

static unsigned grid1d(int64_t n)
{
    int64_t b = cdiv64(n, 256);
    return (unsigned)(b < 65536 ? (b > 0 ? b : 1) : 65536);
}

/* A (column-major D x D double) whole symmetric from its lower triangle. */
static cudaError_t mirror(double *A, int64_t D, cudaStream_t s)
{
    dim3 grid((unsigned)cdiv64(D, 32), (unsigned)cdiv64(D, 32)), block(32, 8);
    mirror_kernel<<<grid, block, 0, s>>>(A, D);
    return cudaGetLastError();
}

/* ---- open / close ---- */

extern "C" int df_basis_gpu_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* the sticky "no device" error */
        return 0;
    }
    return n;
}

extern "C" void df_basis_gpu_close(df_basis_gpu *g);

extern "C" int df_basis_gpu_open(int device, int flags, df_basis_gpu **out, df_err *e)
{
    const char *what = "df_basis_gpu_open";
    *out = NULL;
    int n = df_basis_gpu_device_count(), rc = 0;
    if (device < 0 || device >= n)
        return df_errf(e, -ENODEV, "%s: CUDA device %d: %s", what, device,
                       n ? "no such device" : "no CUDA device (or no driver) on this machine");
    if (flags & ~(int)DF_BASIS_GPU_MOMENT_F64)
        return df_errf(e, -EINVAL, "%s: unknown flags 0x%x", what, (unsigned)flags);
    df_basis_gpu *g = (df_basis_gpu *)calloc(1, sizeof *g);
    if (!g)
        return df_errf(e, -ENOMEM, "%s: out of memory", what);
    g->device = device, g->flags = flags, g->chunk_rows = CHUNK_MAX;
    cudaDeviceProp p;
    CK_CUDA(cudaSetDevice(device), "cudaSetDevice");
    CK_CUDA(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties");
    snprintf(g->name, sizeof g->name, "%s (device %d, %.1f GiB)", p.name, device,
             (double)p.totalGlobalMem / 1073741824.0);
    CK_CUDA(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking), "cudaStreamCreate");
    for (int i = 0; i < 2; i++)
        CK_CUDA(cudaEventCreateWithFlags(&g->done[i], cudaEventDisableTiming), "cudaEventCreate");
    CK_BLAS(cublasCreate(&g->blas), "cublasCreate");
    CK_BLAS(cublasSetStream(g->blas, g->stream), "cublasSetStream");
    CK_SOLVER(cusolverDnCreate(&g->solver), "cusolverDnCreate");
    CK_SOLVER(cusolverDnSetStream(g->solver, g->stream), "cusolverDnSetStream");
    CK_SOLVER(cusolverDnCreateParams(&g->params), "cusolverDnCreateParams");
    *out = g;
    return 0;
out:
    df_basis_gpu_close(g);
    return rc;
}

/* Frees the device moment and the staging buffers; g accumulates nothing after. */
static void moment_end(df_basis_gpu *g)
{
    if (g->stream)
        cudaStreamSynchronize(g->stream); /* nothing may still read what is freed */
    cudaFree(g->dM);
    cudaFree(g->dS);
    cudaFree(g->dXd);
    cudaFree(g->dX);
    for (int i = 0; i < 2; i++)
        cudaFreeHost(g->hX[i]);
    cudaGetLastError();
    g->dM = NULL, g->dS = NULL, g->dXd = NULL, g->dX = NULL, g->hX[0] = g->hX[1] = NULL;
    g->mom = NULL, g->base_rows = 0, g->D = 0, g->err = 0, g->cur = 0, g->fill = 0;
}

extern "C" void df_basis_gpu_close(df_basis_gpu *g)
{
    if (!g)
        return;
    cudaSetDevice(g->device);
    moment_end(g);
    if (g->params)
        cusolverDnDestroyParams(g->params);
    if (g->solver)
        cusolverDnDestroy(g->solver);
    if (g->blas)
        cublasDestroy(g->blas);
    for (int i = 0; i < 2; i++)
        if (g->done[i])
            cudaEventDestroy(g->done[i]);
    if (g->stream)
        cudaStreamDestroy(g->stream);
    cudaGetLastError();
    free(g);
}

extern "C" const char *df_basis_gpu_name(const df_basis_gpu *g)
{
    return g ? g->name : "(none)";
}

/* ---- second moment ---- */

/* The device moment for m: accumulator (zeroed), chunk buffers, staging. */
static int moment_begin(df_basis_gpu *g, df_moment *m, const char *what, df_err *e)
{
    int rc = 0;
    int64_t D = m->D;
    int f64 = g->flags & DF_BASIS_GPU_MOMENT_F64;
    size_t acc = (size_t)(D * D) * 8, scr = f64 ? (size_t)(CHUNK_MAX * D) * 8 : (size_t)(D * D) * 4;
    size_t xb = (size_t)(CHUNK_MAX * D) * 2;
    char for_what[160];
    snprintf(for_what, sizeof for_what, "the second moment of D = %lld (a %.2f GB double "
             "accumulator, a %.2f GB %s)", (long long)D, (double)acc / 1e9, (double)scr / 1e9,
             f64 ? "double chunk" : "f32 chunk product");
    CK(dev_room(g, acc + scr + xb, what, for_what, e));
    CK(dev_alloc(&g->dM, acc, what, "the moment's accumulator", e));
    CK(dev_alloc(f64 ? (void *)&g->dXd : (void *)&g->dS, scr, what, "the moment's chunk scratch",
                 e));
    CK(dev_alloc(&g->dX, xb, what, "the moment's rows", e));
    for (int i = 0; i < 2; i++) {
        cudaError_t st = cudaHostAlloc((void **)&g->hX[i], xb, cudaHostAllocDefault);
        if (st != cudaSuccess) {
            g->hX[i] = NULL;
            cudaGetLastError();
            rc = df_errf(e, -ENOMEM, "%s: cudaHostAlloc of %.1f MB of pinned staging: %s", what,
                         (double)xb / 1e6, cudaGetErrorString(st));
            goto out;
        }
    }
    CK_CUDA(cudaMemsetAsync(g->dM, 0, acc, g->stream), "cudaMemsetAsync");
    g->mom = m, g->base_rows = m->n_rows, g->D = D, g->err = 0, g->cur = 0, g->fill = 0;
    return 0;
out:
    moment_end(g);
    return rc;
}

/* Runs the staged rows hX[cur][0 .. fill) on the device, then switches to
 * the other staging buffer once the device has finished copying from it. */
static int run_chunk(df_basis_gpu *g, const char *what, df_err *e)
{
    int rc = 0, b = g->cur;
    int64_t D = g->D, n = g->fill;
    if (n == 0)
        return 0;
    CK_CUDA(cudaMemcpyAsync(g->dX, g->hX[b], (size_t)(n * D) * 2, cudaMemcpyHostToDevice,
                            g->stream), "cudaMemcpyAsync (rows)");
    CK_CUDA(cudaEventRecord(g->done[b], g->stream), "cudaEventRecord");
    if (g->flags & DF_BASIS_GPU_MOMENT_F64) {
        const double one = 1;
        bf16_to_f64_kernel<<<grid1d(n * D), 256, 0, g->stream>>>(g->dX, g->dXd, n * D);
        CK_LAUNCH("bf16_to_f64_kernel");
        CK_BLAS(cublasDsyrk(g->blas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, (int)D, (int)n, &one,
                            g->dXd, (int)D, &one, g->dM, (int)D), "cublasDsyrk");
    } else {
        /* column-major lower blocks (row block bi >= column block bj):
         * S(i, j) = sum_t X[t][i] X[t][j] at dS[j*D + i] */
        const float one = 1, zero = 0;
        for (int64_t bj = 0; bj < D; bj += GEMM_BLOCK)
            for (int64_t bi = bj; bi < D; bi += GEMM_BLOCK)
                CK_BLAS(cublasGemmEx(g->blas, CUBLAS_OP_N, CUBLAS_OP_T, (int)min64(GEMM_BLOCK, D - bi),
                                     (int)min64(GEMM_BLOCK, D - bj), (int)n, &one, g->dX + bi,
                                     CUDA_R_16BF, (int)D, g->dX + bj, CUDA_R_16BF, (int)D, &zero,
                                     g->dS + bj * D + bi, CUDA_R_32F, (int)D, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT), "cublasGemmEx");
        dim3 grid((unsigned)cdiv64(D, 32), (unsigned)cdiv64(D, 32)), block(32, 8);
        acc_upper_kernel<<<grid, block, 0, g->stream>>>(g->dM, g->dS, D);
        CK_LAUNCH("acc_upper_kernel");
    }
    g->cur ^= 1, g->fill = 0;
    /* the buffer filled next was last read by the copy of the chunk before this one */
    CK_CUDA(cudaEventSynchronize(g->done[g->cur]), "cudaEventSynchronize");
    return 0;
out:
    g->err = rc;
    return rc;
}

typedef struct pack_job {
    const uint16_t *const *layers;
    int64_t K, H, D, t0, n; /* source rows [t0, t0 + n) */
    uint16_t *dst;          /* n rows of D */
} pack_job;

static int pack_task(void *arg, size_t i)
{
    const pack_job *j = (const pack_job *)arg;
    int64_t r1 = min64((int64_t)(i + 1) * PACK_ROWS, j->n);
    for (int64_t r = (int64_t)i * PACK_ROWS; r < r1; r++)
        for (int64_t k = 0; k < j->K; k++)
            memcpy(j->dst + r * j->D + k * j->H, j->layers[k] + (j->t0 + r) * j->H,
                   (size_t)j->H * 2);
    return 0;
}

extern "C" int df_basis_gpu_moment_add_bf16(df_basis_gpu *g, df_moment *m,
                                            const uint16_t *const *layers, int K, int H,
                                            int64_t n_rows, df_pool *pool, df_err *e)
{
    const char *what = "df_basis_gpu_moment_add_bf16";
    int rc = 0;
    if ((rc = df_moment_check_add(m, K, H, n_rows, layers, what, e)))
        return rc;
    if (g->mom && g->mom != m)
        return df_errf(e, -EBUSY, "%s: this GPU context accumulates another moment; "
                       "df_basis_gpu_moment_sync that one first", what);
    if (n_rows == 0)
        return 0;
    if ((rc = df_moment_check_finite_bf16(layers, K, H, n_rows, pool, what, e)))
        return rc;
    if ((rc = set_device(g, what, e)))
        return rc;
    if (!g->mom && (rc = moment_begin(g, m, what, e)))
        return rc;
    if (g->err)
        return df_errf(e, -EIO, "%s: a CUDA error earlier lost the GPU moment (the sync "
                       "reports it and resets)", what);
    for (int64_t t = 0; t < n_rows;) {
        int64_t take = min64(g->chunk_rows - g->fill, n_rows - t);
        pack_job j = {layers, K, H, g->D, t, take, g->hX[g->cur] + g->fill * g->D};
        df_pool_for(pool, (size_t)cdiv64(take, PACK_ROWS), pack_task, &j);
        g->fill += take, t += take;
        if (g->fill >= g->chunk_rows && (rc = run_chunk(g, what, e)))
            return rc;
    }
    m->n_rows += n_rows;
    return 0;
}

extern "C" int df_basis_gpu_set_chunk_rows(df_basis_gpu *g, int rows, df_err *e)
{
    const char *what = "df_basis_gpu_set_chunk_rows";
    if (rows < 1 || rows > CHUNK_MAX)
        return df_errf(e, -EINVAL, "%s: %d rows, must be in [1, %d]", what, rows, CHUNK_MAX);
    int rc = 0;
    if (g->mom && !g->err && g->fill && (!(rc = set_device(g, what, e))))
        rc = run_chunk(g, what, e);
    g->chunk_rows = rows;
    return rc;
}

extern "C" int df_basis_gpu_moment_sync(df_basis_gpu *g, df_moment *m, df_err *e)
{
    const char *what = "df_basis_gpu_moment_sync";
    if (g->mom != m || !m)
        return 0;
    int rc = g->err;
    int64_t D = g->D;
    size_t bytes = (size_t)(D * D) * 8;
    if (rc) {
        df_errf(e, rc, "%s: a CUDA error lost the GPU moment (%lld rows); the moment keeps its "
                "%lld earlier rows", what, (long long)(m->n_rows - g->base_rows),
                (long long)g->base_rows);
        goto out;
    }
    CK(set_device(g, what, e));
    CK(run_chunk(g, what, e));
    CK_CUDA(cudaStreamSynchronize(g->stream), "cudaStreamSynchronize");
    if (!m->m) {
        /* a fresh moment: M is the device's, copied whole (its strictly lower
         * triangle is the accumulator's zeros). Large: 2 MiB aligned and
         * advised to huge pages, as formats/basis.c's moment_alloc. */
        size_t huge = (size_t)2 << 20, cap = (bytes + huge - 1) / huge * huge;
        void *p = NULL;
        if (posix_memalign(&p, huge, cap)) {
            rc = df_errf(e, -ENOMEM, "%s: out of memory for %lld x %lld doubles (%.2f GB)", what,
                         (long long)D, (long long)D, (double)bytes / 1e9);
            goto out;
        }
        madvise(p, cap, MADV_HUGEPAGE);
        cudaError_t st = copy_wait(g, p, g->dM, bytes, cudaMemcpyDeviceToHost);
        if (st != cudaSuccess) {
            free(p);
            rc = cuda_fail(e, st, what, "cudaMemcpyAsync (moment)");
            goto out;
        }
        m->m = (double *)p;
    } else {
        /* rows m->m already holds: add the device's upper triangle, a band of
         * rows at a time through the pinned staging (CHUNK_MAX * D * 2 bytes
         * = CHUNK_MAX / 4 rows of D doubles) */
        int64_t band = CHUNK_MAX / 4;
        double *buf = (double *)(void *)g->hX[0];
        for (int64_t r0 = 0; r0 < D; r0 += band) {
            int64_t nr = min64(band, D - r0);
            CK_CUDA(copy_wait(g, buf, g->dM + r0 * D, (size_t)(nr * D) * 8, cudaMemcpyDeviceToHost),
                    "cudaMemcpyAsync (moment)");
            for (int64_t r = r0; r < r0 + nr; r++)
                for (int64_t c = r; c < D; c++)
                    m->m[r * D + c] += buf[(r - r0) * D + c];
        }
    }
    m->trace = 0;
    for (int64_t i = 0; i < D; i++)
        m->trace += m->m[i * D + i];
out:
    if (rc)
        m->n_rows = g->base_rows;
    moment_end(g);
    return rc;
}

/* ---- the eigensolve ---- */

/* The moment's checks shared by fit, extend and eval: no GPU rows pending,
 * rows held, and its diagonal's sums (total, per layer). */
static int moment_diag(const df_basis_gpu *g, const df_moment *m, const char *what, double *total,
                       double *lay, df_err *e)
{
    if (g->mom == m)
        return df_errf(e, -EINVAL, "%s: the moment has rows on the GPU not yet synced "
                       "(df_basis_gpu_moment_sync)", what);
    if (!m->m || m->n_rows <= 0)
        return df_errf(e, -EINVAL, "%s: the moment holds no rows", what);
    int64_t D = m->D;
    *total = 0;
    memset(lay, 0, sizeof(double) * DF_BASIS_MAX_LAYERS);
    for (int64_t i = 0; i < D; i++) {
        double d = m->m[i * D + i];
        *total += d;
        lay[i / m->H] += d;
    }
    return 0;
}

/* dA (device, D x D) = m's moment, whole and symmetric. */
static int upload_moment(df_basis_gpu *g, const df_moment *m, double *dA, const char *what,
                         df_err *e)
{
    int rc = 0;
    int64_t D = m->D;
    CK_CUDA(copy_wait(g, dA, m->m, (size_t)(D * D) * 8, cudaMemcpyHostToDevice), "cudaMemcpyAsync (moment)");
    CK_CUDA(mirror(dA, D, g->stream), "mirror_kernel");
out:
    return rc;
}

/* dY (device, n doubles) = the host floats x, through tmp (device, >= 4 n bytes). */
static int upload_widen(df_basis_gpu *g, const float *x, int64_t n, void *tmp, double *dY,
                        const char *what, df_err *e)
{
    int rc = 0;
    CK_CUDA(copy_wait(g, tmp, x, (size_t)n * 4, cudaMemcpyHostToDevice), "cudaMemcpyAsync (rows)");
    f32_to_f64_kernel<<<grid1d(n), 256, 0, g->stream>>>((const float *)tmp, dY, n);
    CK_LAUNCH("f32_to_f64_kernel");
out:
    return rc;
}

/* The top eigenpairs of the symmetric D x D matrix dA (its lower triangle is
 * read; dA is overwritten by eigenvectors, column c the c-th in ascending
 * order). R > 0: the top R (cusolverDnXsyevdx, range 'I': columns 0..R-1);
 * R == 0: all (cusolverDnXsyevd: columns 0..D-1). w (host, R or D doubles)
 * gets the eigenvalues of those columns, ascending. */
static int solve_top(df_basis_gpu *g, double *dA, int64_t D, int64_t R, double *w,
                     const char *what, df_err *e)
{
    int rc = 0, info = 0;
    int64_t nw = R ? R : D, meig = 0;
    double *dW = NULL, vl = 0, vu = 0;
    int *dInfo = NULL;
    void *dWork = NULL, *hWork = NULL;
    size_t dws = 0, hws = 0;
    CK(dev_alloc(&dW, (size_t)D * 8, what, "eigenvalues", e));
    CK(dev_alloc(&dInfo, sizeof(int), what, "cuSOLVER's info", e));
    if (R)
        CK_SOLVER(cusolverDnXsyevdx_bufferSize(g->solver, g->params, CUSOLVER_EIG_MODE_VECTOR,
                                               CUSOLVER_EIG_RANGE_I, CUBLAS_FILL_MODE_LOWER, D,
                                               CUDA_R_64F, dA, D, &vl, &vu, D - R + 1, D, &meig,
                                               CUDA_R_64F, dW, CUDA_R_64F, &dws, &hws),
                  "cusolverDnXsyevdx_bufferSize");
    else
        CK_SOLVER(cusolverDnXsyevd_bufferSize(g->solver, g->params, CUSOLVER_EIG_MODE_VECTOR,
                                              CUBLAS_FILL_MODE_LOWER, D, CUDA_R_64F, dA, D,
                                              CUDA_R_64F, dW, CUDA_R_64F, &dws, &hws),
                  "cusolverDnXsyevd_bufferSize");
    {
        char for_what[96];
        snprintf(for_what, sizeof for_what, "cuSOLVER's workspace for a %lld x %lld eigensolve",
                 (long long)D, (long long)D);
        CK(dev_room(g, dws, what, for_what, e));
    }
    CK(dev_alloc(&dWork, dws, what, "cuSOLVER's workspace", e));
    if (hws && !(hWork = malloc(hws))) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory for cuSOLVER's host workspace (%zu bytes)",
                     what, hws);
        goto out;
    }
    if (R)
        CK_SOLVER(cusolverDnXsyevdx(g->solver, g->params, CUSOLVER_EIG_MODE_VECTOR,
                                    CUSOLVER_EIG_RANGE_I, CUBLAS_FILL_MODE_LOWER, D, CUDA_R_64F, dA,
                                    D, &vl, &vu, D - R + 1, D, &meig, CUDA_R_64F, dW, CUDA_R_64F,
                                    dWork, dws, hWork, hws, dInfo),
                  "cusolverDnXsyevdx");
    else
        CK_SOLVER(cusolverDnXsyevd(g->solver, g->params, CUSOLVER_EIG_MODE_VECTOR,
                                   CUBLAS_FILL_MODE_LOWER, D, CUDA_R_64F, dA, D, CUDA_R_64F, dW,
                                   CUDA_R_64F, dWork, dws, hWork, hws, dInfo),
                  "cusolverDnXsyevd");
    CK_CUDA(copy_wait(g, &info, dInfo, sizeof info, cudaMemcpyDeviceToHost), "cudaMemcpyAsync (info)");
    if (info) {
        rc = df_errf(e, info > 0 ? -EDOM : -EIO, "%s: %s %s on a %lld x %lld matrix (info %d)",
                     what, R ? "cusolverDnXsyevdx" : "cusolverDnXsyevd",
                     info > 0 ? "did not converge" : "refused an argument", (long long)D,
                     (long long)D, info);
        goto out;
    }
    if (R && meig != R) {
        rc = df_errf(e, -EDOM, "%s: cusolverDnXsyevdx found %lld eigenvalues, %lld wanted", what,
                     (long long)meig, (long long)R);
        goto out;
    }
    CK_CUDA(copy_wait(g, w, dW, (size_t)nw * 8, cudaMemcpyDeviceToHost), "cudaMemcpyAsync (eigenvalues)");
out:
    cudaFree(dW);
    cudaFree(dInfo);
    cudaFree(dWork);
    free(hWork);
    return rc;
}

/* P (host, R x D f32) = columns ctop, ctop - 1, ... of dA (column-major,
 * ld D), through a device buffer of 4 R D bytes. */
static int vectors_out(df_basis_gpu *g, const double *dA, int64_t D, int64_t ctop, int64_t R,
                       float *P, const char *what, df_err *e)
{
    int rc = 0;
    float *dP = NULL;
    CK(dev_alloc(&dP, (size_t)(R * D) * 4, what, "the basis", e));
    {
        dim3 grid((unsigned)cdiv64(D, 256), (unsigned)R);
        vec_to_rows_kernel<<<grid, 256, 0, g->stream>>>(dA, D, ctop, dP);
        CK_LAUNCH("vec_to_rows_kernel");
    }
    CK_CUDA(copy_wait(g, P, dP, (size_t)(R * D) * 4, cudaMemcpyDeviceToHost), "cudaMemcpyAsync (basis)");
out:
    cudaFree(dP);
    return rc;
}

extern "C" int df_basis_gpu_fit(df_basis_gpu *g, const df_moment *m, int R, double energy,
                                df_basis *out, df_err *e)
{
    const char *what = "df_basis_gpu_fit";
    memset(out, 0, sizeof *out);
    double total = 0, lay[DF_BASIS_MAX_LAYERS], *w = NULL, *lam = NULL;
    double *dA = NULL;
    int rc = moment_diag(g, m, what, &total, lay, e);
    if (rc || (rc = df_basis_check_rank_rule(R, energy, m->D, what, e)))
        return rc;
    if (!(total > 0) || !isfinite(total))
        return df_errf(e, -EINVAL, "%s: the moment has no energy (trace %g)", what, total);
    int64_t D = m->D, ctop;
    char for_what[96];
    snprintf(for_what, sizeof for_what, "a %lld x %lld double matrix", (long long)D, (long long)D);
    if ((rc = set_device(g, what, e)) || (rc = dev_room(g, (size_t)(D * D) * 8, what, for_what, e)))
        return rc;
    if (!(w = (double *)malloc(sizeof(double) * (size_t)D)) ||
        !(lam = (double *)malloc(sizeof(double) * (size_t)D))) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory", what);
        goto out;
    }
    CK(dev_alloc(&dA, (size_t)(D * D) * 8, what, "the moment", e));
    CK(upload_moment(g, m, dA, what, e));
    CK(solve_top(g, dA, D, R, w, what, e));
    if (R == 0) { /* the energy rule over all eigenvalues, descending */
        for (int64_t i = 0; i < D; i++)
            lam[i] = w[D - 1 - i];
        R = df_basis_rank_for_energy(lam, (int)D, total, energy);
        ctop = D - 1;
    } else {
        ctop = R - 1;
    }
    CK(df_basis_init(out, m->K, m->H, R, m->layer_ids, e));
    CK(vectors_out(g, dA, D, ctop, R, out->P, what, e));
    for (int64_t r = 0; r < R; r++)
        out->eigval[r] = w[ctop - r];
    out->kind = DF_BASIS_KIND_MOMENT;
    out->n_rows = m->n_rows;
    out->total_energy = total;
    memcpy(out->layer_energy, lay, sizeof lay);
    df_basis_canonicalize(out);
    df_basis_stats_from_eigen(out);
out:
    if (rc)
        df_basis_free(out);
    cudaFree(dA);
    free(w);
    free(lam);
    return rc;
}

/* ---- evaluation ---- */

extern "C" int df_basis_gpu_eval(df_basis_gpu *g, const df_basis *b, const df_moment *m,
                                 double *kept, double *layer_kept, df_err *e)
{
    const char *what = "df_basis_gpu_eval";
    if (!b->P || b->D != m->D || b->K != m->K || b->H != m->H)
        return df_errf(e, -DF_EMISMATCH, "%s: a basis of %d layers of %d, a moment of %d of %d",
                       what, b->K, b->H, m->K, m->H);
    double total = 0, lay[DF_BASIS_MAX_LAYERS], a[DF_BASIS_MAX_LAYERS] = {0};
    int rc = moment_diag(g, m, what, &total, lay, e);
    if (rc)
        return rc;
    if (!(total > 0))
        return df_errf(e, -EINVAL, "%s: the moment has no energy", what);
    int64_t D = b->D, R = b->R, H = b->H, K = b->K;
    double *dA = NULL, *dP = NULL, *dC = NULL, *dG = NULL, *dL = NULL, *dpart = NULL;
    double *part = (double *)malloc(sizeof(double) * (size_t)(R * K));
    const double one = 1, zero = 0;
    size_t need = (size_t)(D * D + 2 * R * D + R * K) * 8 + (layer_kept ? (size_t)(R * R) * 16 : 0);
    if (!part)
        return df_errf(e, -ENOMEM, "%s: out of memory", what);
    CK(set_device(g, what, e));
    CK(dev_room(g, need, what, "the evaluation (the moment, P and P M in double)", e));
    CK(dev_alloc(&dA, (size_t)(D * D) * 8, what, "the moment", e));
    CK(dev_alloc(&dP, (size_t)(R * D) * 8, what, "the basis", e));
    CK(dev_alloc(&dC, (size_t)(R * D) * 8, what, "P M", e));
    CK(dev_alloc(&dpart, (size_t)(R * K) * 8, what, "partial sums", e));
    CK(upload_moment(g, m, dA, what, e));
    CK(upload_widen(g, b->P, R * D, dC, dP, what, e));
    /* C = P M (row-major R x D) = column-major D x R: M Pc */
    CK_BLAS(cublasDgemm(g->blas, CUBLAS_OP_N, CUBLAS_OP_N, (int)D, (int)R, (int)D, &one, dA,
                        (int)D, dP, (int)D, &zero, dC, (int)D), "cublasDgemm (P M)");
    /* a_k = sum_r sum over layer k's columns i of P[r][i] C[r][i] */
    {
        dim3 grid((unsigned)R, (unsigned)K);
        layer_dot_kernel<<<grid, NT, 0, g->stream>>>(dP, dC, D, H, dpart);
        CK_LAUNCH("layer_dot_kernel");
    }
    CK_CUDA(copy_wait(g, part, dpart, (size_t)(R * K) * 8, cudaMemcpyDeviceToHost),
            "cudaMemcpyAsync (partial sums)");
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < K; k++)
            a[k] += part[r * K + k];
    {
        double sum = 0;
        for (int64_t k = 0; k < K; k++)
            sum += a[k];
        *kept = sum / total;
    }
    if (layer_kept) {
        /* G = P M P^T = C P^T; L_k = P_k P_k^T over layer k's columns;
         * b_k = sum_rs G[r][s] L_k[r][s]; layer k keeps (2 a_k - b_k) / E_k */
        cudaFree(dA); /* room for G and L */
        dA = NULL;
        CK(dev_alloc(&dG, (size_t)(R * R) * 8, what, "P M P^T", e));
        CK(dev_alloc(&dL, (size_t)(R * R) * 8, what, "P_k P_k^T", e));
        CK_BLAS(cublasDgemm(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)R, (int)R, (int)D, &one, dC,
                            (int)D, dP, (int)D, &zero, dG, (int)R), "cublasDgemm (P M P^T)");
        for (int64_t k = 0; k < K; k++) {
            double bk = 0;
            CK_BLAS(cublasDgemm(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)R, (int)R, (int)H, &one,
                                dP + k * H, (int)D, dP + k * H, (int)D, &zero, dL, (int)R),
                    "cublasDgemm (P_k P_k^T)");
            CK_BLAS(cublasDdot(g->blas, (int)(R * R), dG, 1, dL, 1, &bk), "cublasDdot");
            layer_kept[k] = lay[k] > 0 ? (2 * a[k] - bk) / lay[k] : 1.0;
        }
    }
    CK_CUDA(cudaStreamSynchronize(g->stream), "cudaStreamSynchronize");
out:
    cudaFree(dA);
    cudaFree(dP);
    cudaFree(dC);
    cudaFree(dG);
    cudaFree(dL);
    cudaFree(dpart);
    free(part);
    return rc;
}

/* ---- extension ---- */

extern "C" int df_basis_gpu_extend(df_basis_gpu *g, const df_basis *q, const df_moment *m, int R,
                                   df_basis *out, df_err *e)
{
    const char *what = "df_basis_gpu_extend";
    memset(out, 0, sizeof *out);
    int rc = df_basis_check_extend(q, m, R, what, e);
    if (rc)
        return rc;
    double total = 0, lay[DF_BASIS_MAX_LAYERS];
    if ((rc = moment_diag(g, m, what, &total, lay, e)))
        return rc;
    int64_t D = q->D, Rq = q->R, Re = (int64_t)R - Rq;
    double *dA = NULL, *dQ = NULL, *dC = NULL, *dG = NULL, *dS = NULL, *dn = NULL;
    double *w = (double *)malloc(sizeof(double) * (size_t)Re);
    double *nrm = (double *)malloc(sizeof(double) * (size_t)Re);
    const double one = 1, zero = 0, mone = -1, mhalf = -0.5;
    size_t need = (size_t)(D * D + 2 * Rq * D + Rq * Rq + Rq * Re + Re) * 8;
    if (!w || !nrm) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory", what);
        goto out;
    }
    CK(set_device(g, what, e));
    CK(dev_room(g, need, what, "the extension (the moment, Q and Q M in double)", e));
    CK(dev_alloc(&dA, (size_t)(D * D) * 8, what, "the moment", e));
    CK(dev_alloc(&dQ, (size_t)(Rq * D) * 8, what, "the kept rows", e));
    CK(dev_alloc(&dC, (size_t)(Rq * D) * 8, what, "Q M", e));
    CK(dev_alloc(&dG, (size_t)(Rq * Rq) * 8, what, "Q M Q^T", e));
    CK(dev_alloc(&dS, (size_t)(Rq * Re) * 8, what, "E Q^T", e));
    CK(dev_alloc(&dn, (size_t)Re * 8, what, "norms", e));
    CK(upload_moment(g, m, dA, what, e));
    CK(upload_widen(g, q->P, Rq * D, dC, dQ, what, e));
    /* C = Q M (column-major D x Rq: M Qc); G = C Q^T (Rq x Rq: G(r, s) = sum_i C[r][i] Q[s][i]);
     * W = C - G Q / 2, in place in dC (W(i, r) -= 1/2 sum_s Q[s][i] G(r, s)) */
    CK_BLAS(cublasDgemm(g->blas, CUBLAS_OP_N, CUBLAS_OP_N, (int)D, (int)Rq, (int)D, &one, dA,
                        (int)D, dQ, (int)D, &zero, dC, (int)D), "cublasDgemm (Q M)");
    CK_BLAS(cublasDgemm(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)Rq, (int)Rq, (int)D, &one, dC,
                        (int)D, dQ, (int)D, &zero, dG, (int)Rq), "cublasDgemm (Q M Q^T)");
    CK_BLAS(cublasDgemm(g->blas, CUBLAS_OP_N, CUBLAS_OP_T, (int)D, (int)Rq, (int)Rq, &mhalf, dQ,
                        (int)D, dG, (int)Rq, &one, dC, (int)D), "cublasDgemm (G Q)");
    /* M' = M - Q^T W - W^T Q into dA's lower triangle, then whole again */
    CK_BLAS(cublasDsyr2k(g->blas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, (int)D, (int)Rq, &mone, dQ,
                         (int)D, dC, (int)D, &one, dA, (int)D), "cublasDsyr2k");
    CK_CUDA(mirror(dA, D, g->stream), "mirror_kernel");
    {
        /* M' must hold energy, as df_basis_fit requires of any moment (reuse dC for its diagonal) */
        double tr = 0, *diag = (double *)malloc(sizeof(double) * (size_t)D);
        if (!diag) {
            rc = df_errf(e, -ENOMEM, "%s: out of memory", what);
            goto out;
        }
        diag_kernel<<<(unsigned)cdiv64(D, 256), 256, 0, g->stream>>>(dA, D, dC);
        cudaError_t st = cudaGetLastError();
        if (st == cudaSuccess)
            st = copy_wait(g, diag, dC, (size_t)D * 8, cudaMemcpyDeviceToHost);
        for (int64_t i = 0; i < D && st == cudaSuccess; i++)
            tr += diag[i];
        free(diag);
        CK_CUDA(st, "diag_kernel");
        if (!(tr > 0) || !isfinite(tr)) {
            rc = df_errf(e, -EINVAL, "%s: the moment outside the kept rows has no energy "
                         "(trace %g)", what, tr);
            goto out;
        }
    }
    cudaFree(dC); /* room for the eigensolve */
    cudaFree(dG);
    dC = dG = NULL;
    CK(solve_top(g, dA, D, Re, w, what, e));
    /* E = dA's first Re columns (ascending): two passes of E -= Q^T (Q E), unit norms.
     * Extension row r (descending) is column Re - 1 - r. */
    for (int pass = 0; pass < 2; pass++) {
        CK_BLAS(cublasDgemm(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)Rq, (int)Re, (int)D, &one, dQ,
                            (int)D, dA, (int)D, &zero, dS, (int)Rq), "cublasDgemm (Q E)");
        CK_BLAS(cublasDgemm(g->blas, CUBLAS_OP_N, CUBLAS_OP_N, (int)D, (int)Re, (int)Rq, &mone, dQ,
                            (int)D, dS, (int)Rq, &one, dA, (int)D), "cublasDgemm (Q^T Q E)");
        col_sumsq_kernel<<<(unsigned)Re, NT, 0, g->stream>>>(dA, D, dn);
        CK_LAUNCH("col_sumsq_kernel");
        CK_CUDA(copy_wait(g, nrm, dn, (size_t)Re * 8, cudaMemcpyDeviceToHost), "cudaMemcpyAsync (norms)");
        for (int64_t c = 0; c < Re; c++) {
            if (!(nrm[c] > 1e-6)) { /* an eigenvector of M' with energy is never inside span(Q) */
                rc = df_errf(e, -EDOM, "%s: extension row %lld lies in the kept subspace "
                             "(norm %.3g outside it)", what, (long long)(Re - 1 - c),
                             sqrt(nrm[c]));
                goto out;
            }
            nrm[c] = 1 / sqrt(nrm[c]);
        }
        CK_CUDA(copy_wait(g, dn, nrm, (size_t)Re * 8, cudaMemcpyHostToDevice), "cudaMemcpyAsync (norms)");
        {
            dim3 grid((unsigned)cdiv64(D, 256), (unsigned)Re);
            col_scale_kernel<<<grid, 256, 0, g->stream>>>(dA, D, dn);
            CK_LAUNCH("col_scale_kernel");
        }
    }
    CK(df_basis_init(out, q->K, q->H, R, q->layer_ids, e));
    CK(vectors_out(g, dA, D, Re - 1, Re, out->P + Rq * D, what, e));
    memcpy(out->P, q->P, sizeof(float) * (size_t)(Rq * D));
    memcpy(out->eigval, q->eigval, sizeof(double) * (size_t)Rq);
    for (int64_t r = 0; r < Re; r++)
        out->eigval[Rq + r] = w[Re - 1 - r];
    df_basis_canonicalize(out);
    out->kind = DF_BASIS_KIND_ROWS_EXT;
    out->rows_part = (int)Rq;
    out->n_rows = m->n_rows;
    out->total_energy = total;
    memcpy(out->layer_energy, lay, sizeof lay);
    /* the device's buffers go before the evaluation takes its own */
    cudaFree(dA);
    cudaFree(dQ);
    cudaFree(dS);
    cudaFree(dn);
    dA = dQ = dS = dn = NULL;
    CK(df_basis_check_orthonormal(out->P, R, D, what, 0, -EDOM, e));
    CK(df_basis_gpu_eval(g, out, m, &out->kept, out->layer_kept, e));
out:
    if (rc)
        df_basis_free(out);
    cudaFree(dA);
    cudaFree(dQ);
    cudaFree(dC);
    cudaFree(dG);
    cudaFree(dS);
    cudaFree(dn);
    free(w);
    free(nrm);
    return rc;
}
