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
#include "basis_gpu_internal.cuh"

/* ---- the second moment's kernels ---- */

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

/* y[i] = the BF16 bits x[i], widened (exact). */
__global__ void bf16_to_f64_kernel(const uint16_t *x, double *y, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = (double)__uint_as_float((uint32_t)x[i] << 16);
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
