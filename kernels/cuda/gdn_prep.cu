/* gdn_prep.cu - the Gated DeltaNet preprocessing ops on the GPU: causal
 * depthwise conv1d + SiLU over packed sequences, l2norm (dense.cu's row-norm
 * kernel) and the gates beta = sigmoid(b), g = -exp(A_log) softplus(a +
 * dt_bias). The CPU reference is kernels/cpu/gdn.c; formulas follow it in
 * fp32, bf16 outputs rounded once, the gates' outputs stay fp32. The conv
 * for K = 4 (Qwen3.5) keeps each thread's input window in registers
 * (conv_win_kernel); other widths take the general conv_kernel. */
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>

#include "bf16.cuh"
#include "cuda_internal.h"


namespace {

constexpr int CONV_NT = 128;         /* threads per conv block */
constexpr int CONV_TT = 16;          /* tokens per conv thread: window reloads hit L1 */
constexpr int GATES_NT = 256;
constexpr unsigned GRID_CAP = 65535; /* grid y limit; loops cover the rest */

__host__ __device__ __forceinline__ int64_t cdiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

unsigned capped(int64_t n)
{
    return n < 1 ? 1u : n > GRID_CAP ? GRID_CAP : (unsigned)n;
}

/* Threads x tx over units of a row, y over rows, tx * ty = nt: narrow rows
 * (48 gate heads, a few channel groups) share a block. */
void rows_launch(int64_t rows, int64_t units, int nt, dim3 *grid, dim3 *block)
{
    int tx = 1;
    while (tx < units && tx < nt)
        tx <<= 1;
    int ty = nt / tx;
    *block = dim3((unsigned)tx, (unsigned)ty, 1);
    *grid = dim3(capped(cdiv(units, tx)), capped(cdiv(rows, ty)), 1);
}

/* ---- conv1d + SiLU ---- */

struct ConvArgs {
    const uint16_t *x, *w;
    uint16_t *out;
    const int32_t *cu;
    int64_t T, C, xs, os, ws; /* row strides of x, out, w */
    int K, n_seq, vec;
};

/* The sequence holding token t: cu[s] <= t < cu[s + 1] (the CPU's search;
 * empty sequences are skipped). */
__device__ int seq_of(const int32_t *cu, int n_seq, int64_t t)
{
    int lo = 0, hi = n_seq;
    while (hi - lo > 1) {
        int mid = lo + (hi - lo) / 2;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* Up to VEC channels [c0, c0 + nc) of x's row src, as f32. */
__device__ __forceinline__ void conv_load(const ConvArgs &p, int64_t src, int64_t c0, int nc,
                                          float *f)
{
    const uint16_t *r = p.x + src * p.xs + c0;
    if (nc == VEC && p.vec) {
        uint4 u = *reinterpret_cast<const uint4 *>(r);
        uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            f[2 * j] = __uint_as_float(w[j] << 16);
            f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < VEC; j++)
        f[j] = j < nc ? bf2f(r[j]) : 0.0f;
}

__device__ __forceinline__ void conv_store(const ConvArgs &p, int64_t t, int64_t c0, int nc,
                                           const float *f)
{
    uint16_t *r = p.out + t * p.os + c0;
    if (nc == VEC && p.vec) {
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            w[j] = (uint32_t)f2bf(f[2 * j]) | ((uint32_t)f2bf(f[2 * j + 1]) << 16);
        *reinterpret_cast<uint4 *>(r) = make_uint4(w[0], w[1], w[2], w[3]);
        return;
    }
    for (int j = 0; j < nc; j++)
        r[j] = f2bf(f[j]);
}

/* One thread: VEC channels x CONV_TT consecutive tokens. KW > 0 is the
 * kernel width known at compile time, its weights held in registers;
 * KW == 0 (the only instance: K != 4, which conv_win_kernel below takes)
 * reads p.K and the weights from global (L1-cached).
 * out[t, c] = silu(sum_k w[c, k] x[t - (K-1) + k, c]), taps before the
 * token's sequence start read as zero (skipped), summed in k order. */
template <int KW>
__global__ void conv_kernel(ConvArgs p)
{
    const int K = KW > 0 ? KW : p.K;
    const int64_t groups = cdiv(p.C, VEC), tiles = cdiv(p.T, CONV_TT);
    for (int64_t cg = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; cg < groups;
         cg += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c0 = cg * VEC;
        const int nc = p.C - c0 < VEC ? (int)(p.C - c0) : VEC;
        float wr[KW > 0 ? KW : 1][VEC];
        if (KW > 0)
            for (int k = 0; k < K; k++)
                for (int j = 0; j < VEC; j++)
                    wr[KW > 0 ? k : 0][j] = j < nc ? bf2f(p.w[(c0 + j) * p.ws + k]) : 0.0f;
        for (int64_t tt = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; tt < tiles;
             tt += (int64_t)gridDim.y * blockDim.y) {
            const int64_t t0 = tt * CONV_TT, t1 = t0 + CONV_TT < p.T ? t0 + CONV_TT : p.T;
            int s = seq_of(p.cu, p.n_seq, t0);
            for (int64_t t = t0; t < t1; t++) {
                while (p.cu[s + 1] <= t)
                    s++;
                const int64_t start = p.cu[s];
                float acc[VEC];
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    acc[j] = 0.0f;
#pragma unroll
                for (int k = 0; k < K; k++) {
                    const int64_t src = t - (K - 1) + k;
                    if (src < start)
                        continue;
                    float xv[VEC];
                    conv_load(p, src, c0, nc, xv);
#pragma unroll
                    for (int j = 0; j < VEC; j++) {
                        float wv = KW > 0 ? wr[KW > 0 ? k : 0][j]
                                          : (j < nc ? bf2f(p.w[(c0 + j) * p.ws + k]) : 0.0f);
                        acc[j] += wv * xv[j];
                    }
                }
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    acc[j] = acc[j] / (1.0f + expf(-acc[j])); /* SiLU as torch */
                conv_store(p, t, c0, nc, acc);
            }
        }
    }
}

/* The kernel for a compile-time width KW (Qwen3.5: 4): one thread is VEC
 * channels x TT consecutive tokens. Its TT + KW - 1 input rows (the tile
 * and the KW - 1 before it; rows before 0 or past T read as zero and are
 * never used) are all loaded first into registers, raw bf16, so each
 * thread has that many independent loads in flight and every row is read
 * from memory once per tile; then each token is the same k-ordered sum as
 * conv_kernel, taps before its sequence start skipped. out must not alias
 * x (the op's contract), so the stores cannot disturb the window. */
constexpr int CONV_WT = 8; /* tokens per thread */

/* Channels [c0, c0 + nc) of x's row src as packed bf16 (zero past nc). */
__device__ __forceinline__ uint4 conv_load_raw(const ConvArgs &p, int64_t src, int64_t c0, int nc)
{
    const uint16_t *r = p.x + src * p.xs + c0;
    if (nc == VEC && p.vec)
        return *reinterpret_cast<const uint4 *>(r);
    uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < VEC; j++)
        if (j < nc)
            w[j / 2] |= (uint32_t)r[j] << (16 * (j & 1));
    return make_uint4(w[0], w[1], w[2], w[3]);
}

#ifndef CONV_MINB
#define CONV_MINB 4
#endif

template <int KW, int TT>
__global__ void __launch_bounds__(CONV_NT, CONV_MINB) conv_win_kernel(ConvArgs p)
{
    constexpr int NW = TT + KW - 1;
    const int64_t groups = cdiv(p.C, VEC), tiles = cdiv(p.T, TT);
    for (int64_t cg = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; cg < groups;
         cg += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c0 = cg * VEC;
        const int nc = p.C - c0 < VEC ? (int)(p.C - c0) : VEC;
        float wr[KW][VEC];
#pragma unroll
        for (int k = 0; k < KW; k++)
#pragma unroll
            for (int j = 0; j < VEC; j++)
                wr[k][j] = j < nc ? bf2f(p.w[(c0 + j) * p.ws + k]) : 0.0f;
        for (int64_t tt = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; tt < tiles;
             tt += (int64_t)gridDim.y * blockDim.y) {
            const int64_t t0 = tt * TT;
            uint4 win[NW]; /* win[i] = row t0 - (KW - 1) + i */
#pragma unroll
            for (int i = 0; i < NW; i++) {
                const int64_t src = t0 - (KW - 1) + i;
                win[i] = make_uint4(0, 0, 0, 0);
                if (src >= 0 && src < p.T)
                    win[i] = conv_load_raw(p, src, c0, nc);
            }
            int s = seq_of(p.cu, p.n_seq, t0);
            int64_t start = p.cu[s], next = p.cu[s + 1];
#pragma unroll
            for (int i = 0; i < TT; i++) {
                const int64_t t = t0 + i;
                if (t >= p.T)
                    break;
                while (next <= t) { /* t < T = cu[n_seq]: stops at s + 1 <= n_seq */
                    s++;
                    start = p.cu[s];
                    next = p.cu[s + 1];
                }
                float acc[VEC];
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    acc[j] = 0.0f;
#pragma unroll
                for (int k = 0; k < KW; k++) {
                    if (t - (KW - 1) + k < start)
                        continue;
                    float xv[VEC];
                    unpack8(win[i + k], xv);
#pragma unroll
                    for (int j = 0; j < VEC; j++)
                        acc[j] += wr[k][j] * xv[j];
                }
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    acc[j] = acc[j] / (1.0f + expf(-acc[j])); /* SiLU as torch */
                conv_store(p, t, c0, nc, acc);
            }
        }
    }
}

/* ---- gates ---- */

struct GatesArgs {
    const uint16_t *a, *b, *A_log, *dt_bias;
    float *g, *beta;
    int64_t T, H, as, bs, gs, betas; /* row strides */
};

/* softplus as torch (threshold 20), log1p(exp(x)) below it. */
__device__ __forceinline__ float softplus_f(float x)
{
    return x > 20.0f ? x : log1pf(expf(x));
}

__global__ void gates_kernel(GatesArgs p)
{
    for (int64_t t = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; t < p.T;
         t += (int64_t)gridDim.y * blockDim.y) {
        for (int64_t h = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; h < p.H;
             h += (int64_t)gridDim.x * blockDim.x) {
            const float av = bf2f(p.a[t * p.as + h]), bv = bf2f(p.b[t * p.bs + h]);
            const float neg_A = -expf(bf2f(p.A_log[h]));
            p.beta[t * p.betas + h] = 1.0f / (1.0f + expf(-bv));
            p.g[t * p.gs + h] = neg_A * softplus_f(av + bf2f(p.dt_bias[h]));
        }
    }
}

} /* namespace */

int df_cuda_conv1d_silu(df_backend *be, const df_tensor *x, const df_tensor *w,
                        const int32_t *cu_seqlens, int n_seq, df_tensor *out)
{
    ConvArgs p;
    p.T = x->shape[0];
    p.C = x->shape[1];
    if (p.T == 0 || p.C == 0)
        return 0;
    p.cu = df_cuda_stage_i32(be, cu_seqlens, (int64_t)n_seq + 1);
    if (!p.cu)
        return -EIO;
    p.x = (const uint16_t *)x->data;
    p.w = (const uint16_t *)w->data;
    p.out = (uint16_t *)out->data;
    p.xs = x->stride[0];
    p.os = out->stride[0];
    p.ws = w->stride[0];
    p.K = (int)w->shape[1];
    p.n_seq = n_seq;
    p.vec = !((uintptr_t)p.x & 15u) && !((uintptr_t)p.out & 15u) && p.xs % VEC == 0 &&
            p.os % VEC == 0;
    dim3 grid, block;
    cudaStream_t st = df_cuda_stream(be);
    if (p.K == 4) {
        rows_launch(cdiv(p.T, CONV_WT), cdiv(p.C, VEC), CONV_NT, &grid, &block);
        conv_win_kernel<4, CONV_WT><<<grid, block, 0, st>>>(p);
    } else {
        rows_launch(cdiv(p.T, CONV_TT), cdiv(p.C, VEC), CONV_NT, &grid, &block);
        conv_kernel<0><<<grid, block, 0, st>>>(p);
    }
    return df_cuda_check_launch("conv1d kernel");
}

int df_cuda_l2norm(df_backend *be, df_tensor *x, float eps, float scale)
{
    return df_cuda_l2norm_rows(be, x, eps, scale);
}

int df_cuda_gdn_gates(df_backend *be, const df_tensor *a, const df_tensor *b,
                      const df_tensor *A_log, const df_tensor *dt_bias, df_tensor *g,
                      df_tensor *beta)
{
    GatesArgs p;
    p.T = a->shape[0];
    p.H = a->shape[1];
    if (p.T == 0 || p.H == 0)
        return 0;
    p.a = (const uint16_t *)a->data;
    p.b = (const uint16_t *)b->data;
    p.A_log = (const uint16_t *)A_log->data;
    p.dt_bias = (const uint16_t *)dt_bias->data;
    p.g = (float *)g->data;
    p.beta = (float *)beta->data;
    p.as = a->stride[0];
    p.bs = b->stride[0];
    p.gs = g->stride[0];
    p.betas = beta->stride[0];
    dim3 grid, block;
    rows_launch(p.T, p.H, GATES_NT, &grid, &block);
    gates_kernel<<<grid, block, 0, df_cuda_stream(be)>>>(p);
    return df_cuda_check_launch("gdn gates kernel");
}
