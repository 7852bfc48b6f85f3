/* basis_gpu_solve.cu - the projection basis on the GPU, its second half
 * (contracts in basis_gpu.h; the first half, open / close and the second
 * moment, is basis_gpu.cu): the eigensolve (cuSOLVER), the evaluation of a
 * basis and its extension, with their kernels. */
#include "basis_gpu_internal.cuh"

/* ---- kernels ---- */

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

/* A (column-major D x D double) whole symmetric from its lower triangle. */
static cudaError_t mirror(double *A, int64_t D, cudaStream_t s)
{
    dim3 grid((unsigned)cdiv64(D, 32), (unsigned)cdiv64(D, 32)), block(32, 8);
    mirror_kernel<<<grid, block, 0, s>>>(A, D);
    return cudaGetLastError();
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
