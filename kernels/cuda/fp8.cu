/* fp8.cu - df_op_fp8_qdq on the GPU (contract in train_ops.h; CPU reference
 * kernels/cpu/fp8.c over common/e4m3.h), bit-identical to the reference
 * (the rule: e4m3.cuh; no FP8 conversion instruction is needed).
 *
 * Three kernels by block shape, each reading its block twice (amax, then the
 * values), coalesced:
 *   1 x bc (activations along the reduction): a warp per block;
 *   br x 1 (operands reduced over rows): a thread per column of a band;
 *   br x bc otherwise (weights, 128 x 128): a CTA per block. */
#include <cuda_runtime.h>
#include <errno.h>
#include <stdint.h>

#include "bf16.cuh"
#include "cuda_internal.h"
#include "e4m3.cuh"
#include "fp8_cuda.h"

namespace {

constexpr int NT = 256;

template <typename T> __device__ __forceinline__ float ld(const T *p);
template <> __device__ __forceinline__ float ld<float>(const float *p) { return *p; }
template <> __device__ __forceinline__ float ld<uint16_t>(const uint16_t *p) { return bf2f(*p); }
template <typename T> __device__ __forceinline__ void st(T *p, float v);
template <> __device__ __forceinline__ void st<float>(float *p, float v) { *p = v; }
/* exact: v is code * 2^k, at most 4 significant bits, a normal BF16 number */
template <> __device__ __forceinline__ void st<uint16_t>(uint16_t *p, float v) { *p = f2bf(v); }

template <typename T>
__global__ void __launch_bounds__(NT) qdq_row_kernel(const T *x, int64_t ldx, T *y, int64_t ldy,
                                                     int64_t rows, int64_t cols, int64_t bc,
                                                     int64_t ncb)
{
    int64_t w = (int64_t)blockIdx.x * (NT / 32) + threadIdx.x / 32;
    if (w >= rows * ncb)
        return;
    int lane = threadIdx.x & 31;
    int64_t r = w / ncb, c0 = (w % ncb) * bc, c1 = c0 + bc < cols ? c0 + bc : cols;
    const T *xr = x + r * ldx;
    T *yr = y + r * ldy;
    float m = 0.0f;
    for (int64_t c = c0 + lane; c < c1; c += 32)
        m = amax_step(m, ld(xr + c));
    m = warp_amax(m);
    if (!isfinite(m)) {
        if ((const void *)yr != (const void *)xr)
            for (int64_t c = c0 + lane; c < c1; c += 32)
                yr[c] = xr[c];
        return;
    }
    int k = scale_exp(m);
    float s = ldexpf(1.0f, k), inv = ldexpf(1.0f, -k);
    for (int64_t c = c0 + lane; c < c1; c += 32)
        st(yr + c, qdq1(ld(xr + c), inv, s));
}

template <typename T>
__global__ void __launch_bounds__(NT) qdq_col_kernel(const T *x, int64_t ldx, T *y, int64_t ldy,
                                                     int64_t rows, int64_t cols, int64_t br)
{
    int64_t c = (int64_t)blockIdx.x * NT + threadIdx.x;
    if (c >= cols)
        return;
    int64_t r0 = (int64_t)blockIdx.y * br, r1 = r0 + br < rows ? r0 + br : rows;
    float m = 0.0f;
    for (int64_t r = r0; r < r1; r++)
        m = amax_step(m, ld(x + r * ldx + c));
    if (!isfinite(m)) {
        if ((const void *)y != (const void *)x)
            for (int64_t r = r0; r < r1; r++)
                y[r * ldy + c] = x[r * ldx + c];
        return;
    }
    int k = scale_exp(m);
    float s = ldexpf(1.0f, k), inv = ldexpf(1.0f, -k);
    for (int64_t r = r0; r < r1; r++)
        st(y + r * ldy + c, qdq1(ld(x + r * ldx + c), inv, s));
}

template <typename T>
__global__ void __launch_bounds__(NT) qdq_tile_kernel(const T *x, int64_t ldx, T *y, int64_t ldy,
                                                      int64_t rows, int64_t cols, int64_t br,
                                                      int64_t bc)
{
    __shared__ float wm[NT / 32];
    int64_t r0 = (int64_t)blockIdx.y * br, r1 = r0 + br < rows ? r0 + br : rows;
    int64_t c0 = (int64_t)blockIdx.x * bc, c1 = c0 + bc < cols ? c0 + bc : cols;
    int64_t w = c1 - c0, n = (r1 - r0) * w;
    float m = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += NT)
        m = amax_step(m, ld(x + (r0 + i / w) * ldx + c0 + i % w));
    m = block_amax<NT>(m, wm);
    if (!isfinite(m)) {
        if ((const void *)y != (const void *)x)
            for (int64_t i = threadIdx.x; i < n; i += NT)
                y[(r0 + i / w) * ldy + c0 + i % w] = x[(r0 + i / w) * ldx + c0 + i % w];
        return;
    }
    int k = scale_exp(m);
    float s = ldexpf(1.0f, k), inv = ldexpf(1.0f, -k);
    for (int64_t i = threadIdx.x; i < n; i += NT) {
        int64_t r = r0 + i / w, c = c0 + i % w;
        st(y + r * ldy + c, qdq1(ld(x + r * ldx + c), inv, s));
    }
}

template <typename T>
int launch(cudaStream_t st, const T *x, int64_t ldx, T *y, int64_t ldy, int64_t rows,
           int64_t cols, int64_t br, int64_t bc)
{
    int64_t nrb = (rows + br - 1) / br, ncb = (cols + bc - 1) / bc;
    if (nrb > 65535 && br > 1)
        return -ENOTSUP; /* grid.y; 2^16 bands of >= 2 rows: > 131k rows */
    if (br == 1) {
        int64_t ctas = (rows * ncb + NT / 32 - 1) / (NT / 32);
        if (ctas > INT32_MAX)
            return -ENOTSUP;
        qdq_row_kernel<T><<<(unsigned)ctas, NT, 0, st>>>(x, ldx, y, ldy, rows, cols, bc, ncb);
    } else if (bc == 1) {
        dim3 grid((unsigned)((cols + NT - 1) / NT), (unsigned)nrb);
        qdq_col_kernel<T><<<grid, NT, 0, st>>>(x, ldx, y, ldy, rows, cols, br);
    } else {
        if (ncb > INT32_MAX)
            return -ENOTSUP;
        dim3 grid((unsigned)ncb, (unsigned)nrb);
        qdq_tile_kernel<T><<<grid, NT, 0, st>>>(x, ldx, y, ldy, rows, cols, br, bc);
    }
    return df_cuda_check_launch("fp8_qdq");
}

} // namespace

extern "C" int df_cuda_fp8_qdq(df_backend *be, const df_tensor *x, df_tensor *y,
                               int64_t block_rows, int64_t block_cols)
{
    int64_t rows = x->shape[0], cols = x->shape[1];
    if (rows == 0 || cols == 0)
        return 0;
    if (df_cuda_fp8_wcodes_fresh_t(be, x)) /* a kept weight's values AdamW left out */
        return -EIO;
    cudaStream_t st = df_cuda_stream(be);
    if (x->dtype == DF_DTYPE_BF16)
        return launch(st, (const uint16_t *)x->data, x->stride[0], (uint16_t *)y->data,
                      y->stride[0], rows, cols, block_rows, block_cols);
    return launch(st, (const float *)x->data, x->stride[0], (float *)y->data, y->stride[0], rows,
                  cols, block_rows, block_cols);
}

/* The BF16 path of df_op_matmul_fp8: both operands rounded (df_cuda_fp8_qdq)
 * into BF16 copies in the backend scratch, then the BF16 GEMM on them: FP8's
 * numerics exactly (the rounded values are BF16 numbers), at BF16 speed plus
 * two passes over the operands. */
extern "C" int df_cuda_matmul_fp8_bf16(df_backend *be, df_gemm_kind kind, const df_tensor *a,
                                       const df_tensor *b, df_tensor *c, unsigned flags)
{
    int accumulate = (flags & DF_FP8_ACCUMULATE) != 0;
    int64_t abr, abc, bbr, bbc;
    df_fp8_operand_blocks(kind, 0, flags, &abr, &abc);
    df_fp8_operand_blocks(kind, 1, flags, &bbr, &bbc);
    int64_t na = a->shape[0] * a->shape[1], nb = b->shape[0] * b->shape[1];
    size_t ob = ((size_t)na * 2 + 255) & ~(size_t)255;
    char *s = (char *)df_cuda_scratch(be, ob + (size_t)nb * 2 + 2);
    if (!s)
        return -ENOMEM;
    df_tensor ra = df_tensor_2d(s, DF_DTYPE_BF16, a->shape[0], a->shape[1]);
    df_tensor rb = df_tensor_2d(s + ob, DF_DTYPE_BF16, b->shape[0], b->shape[1]);
    df_cuda_prof_split(be, "bf16 path round");
    int rc = df_cuda_fp8_qdq(be, a, &ra, abr, abc);
    if (!rc)
        rc = df_cuda_fp8_qdq(be, b, &rb, bbr, bbc);
    df_cuda_prof_split(be, "bf16 path gemm");
    if (!rc)
        rc = kind == DF_GEMM_FWD     ? df_cuda_matmul(be, &ra, &rb, c, accumulate)
             : kind == DF_GEMM_BWD_X ? df_cuda_matmul_bwd_x(be, &ra, &rb, c, accumulate)
                                     : df_cuda_matmul_bwd_w(be, &ra, &rb, c, accumulate);
    df_cuda_prof_split(be, NULL);
    return rc;
}

/* df_op_matmul_fp8: the E4M3 tensor cores where they are there and agreed
 * with the BF16 path on the shape (gemm_fp8.cu), else the BF16 path. */
extern "C" int df_cuda_matmul_fp8(df_backend *be, df_gemm_kind kind, const df_tensor *a,
                                  const df_tensor *b, df_tensor *c, unsigned flags)
{
    int rc = df_cuda_matmul_fp8_fast(be, kind, a, b, c, flags);
    return rc ? (rc < 0 ? rc : 0)
              : df_cuda_matmul_fp8_bf16(be, kind, a, b, c, flags);
}
