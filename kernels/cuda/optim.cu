/* optim.cu - AdamW and the sum of squares (the gradient norm) on the GPU
 * (contracts in train_ops.h; the CPU reference is kernels/cpu/train_dense.c,
 * whose formulas are written here in its order, in fp32). The gradient
 * (adamw's grad, sumsq's x) is F32 or BF16: a BF16 one is widened exactly
 * where it is read, so the arithmetic (and the order of every sum) is the
 * F32 one's.
 *
 * Determinism. The sum of squares never uses atomics: every block writes its
 * own partial in a fixed order, and a second kernel adds the partials in a
 * fixed order, which depends only on n, not on the GPU, the grid cap or the
 * alignment. */
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>

#include "bf16.cuh"
#include "bf16_sr.h"
#include "cuda_internal.h"
#include "train_cuda.h"

namespace {

constexpr int NT = 256; /* threads per block */

__host__ __device__ __forceinline__ int64_t cdiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

/* ---- AdamW ---- */

/* G: the gradient's element type, float (F32) or uint16_t (BF16). */
template <typename G>
struct AdamArgs {
    float *p, *m, *v;     /* m, v: F32 moments (adamw; v of adamw_m16 with an F32 v) */
    uint16_t *m16, *v16;  /* BF16 moments (adamw_m16; v16 NULL with an F32 v) */
    const G *g;
    uint16_t *out;
    int64_t n;
    float b1, b2, omb1, omb2, bc1, bc2, lr, eps, wd, gs;
    uint64_t key; /* BF16 moments: element i's rounding bits are df_sr_bits(key, i0 + i) */
    int64_t i0;
};

/* One element, the CPU's formula in its order with every operation
 * rounded on its own (the _rn intrinsics forbid FMA contraction, which
 * would change the bits):
 *   g = grad * gs;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) (g g)
 *   p = p - lr * ((m / bc1) / (sqrt(v / bc2) + eps) + wd p) */
template <typename G>
__device__ __forceinline__ float adam_one(const AdamArgs<G> &a, float gi, float *m, float *v,
                                          float p)
{
    float g = __fmul_rn(gi, a.gs);
    float mm = __fadd_rn(__fmul_rn(a.b1, *m), __fmul_rn(a.omb1, g));
    float vv = __fadd_rn(__fmul_rn(a.b2, *v), __fmul_rn(a.omb2, __fmul_rn(g, g)));
    float den = __fadd_rn(__fsqrt_rn(__fdiv_rn(vv, a.bc2)), a.eps);
    float upd = __fadd_rn(__fdiv_rn(__fdiv_rn(mm, a.bc1), den), __fmul_rn(a.wd, p));
    *m = mm;
    *v = vv;
    return __fsub_rn(p, __fmul_rn(a.lr, upd));
}

/* Gradient element i, widened exactly to f32; and quad q (4 elements: a
 * float4 for F32, a uint2 of 4 bf16 for BF16). */
__device__ __forceinline__ float grad_at(const float *g, int64_t i) { return g[i]; }
__device__ __forceinline__ float grad_at(const uint16_t *g, int64_t i) { return bf2f(g[i]); }
__device__ __forceinline__ float4 grad_quad(const float *g, int64_t q)
{
    return reinterpret_cast<const float4 *>(g)[q];
}
__device__ __forceinline__ float4 grad_quad(const uint16_t *g, int64_t q)
{
    uint2 u = reinterpret_cast<const uint2 *>(g)[q];
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                       __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}

/* BF16 moments: element i's stored m (and v, V16) from their fp32 values,
 * rounded stochastically with df_sr_bits(key, i0 + i) (the CPU's rule) */
template <bool V16, typename G>
__device__ __forceinline__ void store_m16(const AdamArgs<G> &a, int64_t i, float m, float v,
                                          uint16_t *mo, uint16_t *vo)
{
    uint64_t r = df_sr_bits(a.key, (uint64_t)(a.i0 + i));
    *mo = df_bf16_sr(__float_as_uint(m), (uint32_t)r);
    if (V16)
        *vo = df_bf16_sr(__float_as_uint(v), (uint32_t)(r >> 16));
}

/* 4 moments from their storage: a float4, or 4 bf16 in a uint2 */
template <bool M16, typename G>
__device__ __forceinline__ float4 moment_quad(const AdamArgs<G> &a, const float *f,
                                              const uint16_t *h, int64_t q)
{
    if (!M16)
        return reinterpret_cast<const float4 *>(f)[q];
    uint2 u = reinterpret_cast<const uint2 *>(h)[q];
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                       __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}

/* VEC4: vectors over the n/4 leading quads (p and F32 m, v 16-byte aligned,
 * BF16 m, v and out 8-byte aligned, grad 4 elements' worth aligned), the
 * last n%4 elements by the first threads. The grad dtype changes only how g
 * is loaded: the arithmetic, hence the bits, are those of an F32 grad of the
 * same values. M16: m in BF16 (adamw_m16); V16: v too (M16 only). */
template <bool VEC4, bool M16, bool V16, typename G>
__global__ void __launch_bounds__(NT) adamw_kernel(AdamArgs<G> a)
{
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t nthr = (int64_t)gridDim.x * blockDim.x;
    int64_t done = 0;
    if (VEC4) {
        const int64_t nq = a.n / 4;
        for (int64_t q = tid; q < nq; q += nthr) {
            float4 p = reinterpret_cast<const float4 *>(a.p)[q];
            float4 g = grad_quad(a.g, q);
            float4 m = moment_quad<M16>(a, a.m, a.m16, q);
            float4 v = moment_quad<V16>(a, a.v, a.v16, q);
            p.x = adam_one(a, g.x, &m.x, &v.x, p.x);
            p.y = adam_one(a, g.y, &m.y, &v.y, p.y);
            p.z = adam_one(a, g.z, &m.z, &v.z, p.z);
            p.w = adam_one(a, g.w, &m.w, &v.w, p.w);
            reinterpret_cast<float4 *>(a.p)[q] = p;
            if (M16) {
                uint16_t mo[4], vo[4] = {0, 0, 0, 0};
                store_m16<V16>(a, 4 * q, m.x, v.x, &mo[0], &vo[0]);
                store_m16<V16>(a, 4 * q + 1, m.y, v.y, &mo[1], &vo[1]);
                store_m16<V16>(a, 4 * q + 2, m.z, v.z, &mo[2], &vo[2]);
                store_m16<V16>(a, 4 * q + 3, m.w, v.w, &mo[3], &vo[3]);
                reinterpret_cast<uint2 *>(a.m16)[q] =
                    make_uint2(mo[0] | (uint32_t)mo[1] << 16, mo[2] | (uint32_t)mo[3] << 16);
                if (V16)
                    reinterpret_cast<uint2 *>(a.v16)[q] =
                        make_uint2(vo[0] | (uint32_t)vo[1] << 16, vo[2] | (uint32_t)vo[3] << 16);
            } else {
                reinterpret_cast<float4 *>(a.m)[q] = m;
            }
            if (!V16)
                reinterpret_cast<float4 *>(a.v)[q] = v;
            if (a.out)
                reinterpret_cast<uint2 *>(a.out)[q] = make_uint2(pack2(p.x, p.y), pack2(p.z, p.w));
        }
        done = nq * 4;
    }
    for (int64_t i = done + tid; i < a.n; i += nthr) {
        float m = M16 ? bf2f(a.m16[i]) : a.m[i], v = V16 ? bf2f(a.v16[i]) : a.v[i];
        float p = adam_one(a, grad_at(a.g, i), &m, &v, a.p[i]);
        if (M16)
            store_m16<V16>(a, i, m, v, &a.m16[i], V16 ? &a.v16[i] : NULL);
        else
            a.m[i] = m;
        if (!V16)
            a.v[i] = v;
        a.p[i] = p;
        if (a.out)
            a.out[i] = f2bf(p);
    }
}

/* ---- sum of squares ----
 * Pieces of SQ_CHUNK elements, one block each: thread t takes the quads
 * t, t + NT, ... of its piece (16 of them), in double (a float's square is
 * exact in double, so only the additions round), with one accumulator per
 * quad lane combined (a0 + a2) + (a1 + a3); then a fixed shuffle tree and
 * the 8 warps in order. The piece sums are added by one block: thread t
 * sums pieces t, t + NT, ... in order, then the same tree. A quad is read
 * as one vector when x is aligned for it (a float4 / 4 bf16 in a uint2),
 * else element by element: same order. A BF16 x is widened exactly, so it
 * gives the bits an F32 x of the same values gives. */

constexpr int SQ_CHUNK = NT * 4 * 16; /* 16384 elements per piece */

__device__ __forceinline__ double block_sum_d(double v, double *red)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0)
        red[threadIdx.x / 32] = v;
    __syncthreads();
    double t = red[0];
#pragma unroll
    for (int i = 1; i < NT / 32; i++)
        t += red[i];
    __syncthreads();
    return t;
}

template <typename X>
__global__ void __launch_bounds__(NT)
    sumsq_piece_kernel(const X *x, int64_t n, int64_t n_pieces, int vec, double *piece_sum)
{
    __shared__ double red[NT / 32];
    for (int64_t pc = blockIdx.x; pc < n_pieces; pc += gridDim.x) {
        const int64_t i0 = pc * SQ_CHUNK;
        double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
#pragma unroll 4
        for (int k = 0; k < SQ_CHUNK / (4 * NT); k++) {
            const int64_t i = i0 + ((int64_t)k * NT + threadIdx.x) * 4;
            float f[4];
            if (vec && i + 4 <= n) {
                float4 q = grad_quad(x, i / 4);
                f[0] = q.x, f[1] = q.y, f[2] = q.z, f[3] = q.w;
            } else {
#pragma unroll
                for (int j = 0; j < 4; j++)
                    f[j] = i + j < n ? grad_at(x, i + j) : 0.0f;
            }
            a0 += (double)f[0] * (double)f[0];
            a1 += (double)f[1] * (double)f[1];
            a2 += (double)f[2] * (double)f[2];
            a3 += (double)f[3] * (double)f[3];
        }
        double t = block_sum_d((a0 + a2) + (a1 + a3), red);
        if (threadIdx.x == 0)
            piece_sum[pc] = t;
    }
}

__global__ void __launch_bounds__(NT)
    sumsq_final_kernel(const double *piece_sum, int64_t n_pieces, double *out)
{
    __shared__ double red[NT / 32];
    double s = 0.0;
    for (int64_t i = threadIdx.x; i < n_pieces; i += NT)
        s += piece_sum[i];
    double t = block_sum_d(s, red);
    if (threadIdx.x == 0)
        *out = t;
}

} /* namespace */

/* ---- host side ---- */

/* the kernel for the moments' dtypes, vectorised or not */
template <bool M16, bool V16, typename G>
static void adamw_start(const AdamArgs<G> &a, int vec, unsigned blocks, cudaStream_t st)
{
    if (vec)
        adamw_kernel<true, M16, V16, G><<<blocks, NT, 0, st>>>(a);
    else
        adamw_kernel<false, M16, V16, G><<<blocks, NT, 0, st>>>(a);
}

/* m, v: F32 moments, or m16 and v16 / v: BF16 ones (key, i0 their rounding's bits) */
template <typename G>
static int adamw_launch(df_backend *be, float *master, const G *grad, float *m, float *v,
                        uint16_t *m16, uint16_t *v16, int64_t n, float lr, float beta1,
                        float beta2, float eps, float wd, int64_t step, float grad_scale,
                        uint64_t key, int64_t i0, uint16_t *out_bf16)
{
    /* The scalars exactly as the CPU derives them (double, rounded once). */
    AdamArgs<G> a;
    a.p = master;
    a.m = m;
    a.v = v;
    a.m16 = m16;
    a.v16 = v16;
    a.key = key;
    a.i0 = i0;
    a.g = grad;
    a.out = out_bf16;
    a.n = n;
    a.b1 = beta1;
    a.b2 = beta2;
    a.omb1 = (float)(1.0 - (double)beta1);
    a.omb2 = (float)(1.0 - (double)beta2);
    a.bc1 = (float)(1.0 - pow((double)beta1, (double)step));
    a.bc2 = (float)(1.0 - pow((double)beta2, (double)step));
    a.lr = lr;
    a.eps = eps;
    a.wd = wd;
    a.gs = grad_scale;
    const uintptr_t quad = 4 * sizeof(G) - 1; /* a quad of grad: 16 (F32) or 8 (BF16) bytes */
    const int vec = !(((uintptr_t)master | (uintptr_t)m | (uintptr_t)v) & 15u) &&
                    !(((uintptr_t)m16 | (uintptr_t)v16) & 7u) && !((uintptr_t)grad & quad) &&
                    !((uintptr_t)out_bf16 & 7u);
    /* one thread per quad (or element), grid-stride past 2^20 blocks */
    int64_t work = vec ? (n / 4 > n % 4 ? n / 4 : n % 4) : n;
    int64_t blocks = cdiv(work, NT);
    if (blocks > ((int64_t)1 << 20))
        blocks = (int64_t)1 << 20;
    cudaStream_t st = df_cuda_stream(be);
    if (m16 && v16)
        adamw_start<true, true>(a, vec, (unsigned)blocks, st);
    else if (m16)
        adamw_start<true, false>(a, vec, (unsigned)blocks, st);
    else
        adamw_start<false, false>(a, vec, (unsigned)blocks, st);
    return df_cuda_check_launch("adamw kernel");
}

int df_cuda_adamw(df_backend *be, float *master, const void *grad, df_dtype grad_dtype, float *m,
                  float *v, int64_t n, float lr, float beta1, float beta2, float eps, float wd,
                  int64_t step, float grad_scale, uint16_t *out_bf16)
{
    if (n == 0)
        return 0;
    if (grad_dtype == DF_DTYPE_BF16)
        return adamw_launch(be, master, (const uint16_t *)grad, m, v, NULL, NULL, n, lr, beta1,
                            beta2, eps, wd, step, grad_scale, 0, 0, out_bf16);
    return adamw_launch(be, master, (const float *)grad, m, v, NULL, NULL, n, lr, beta1, beta2,
                        eps, wd, step, grad_scale, 0, 0, out_bf16);
}

int df_cuda_adamw_m16(df_backend *be, float *master, const void *grad, df_dtype grad_dtype,
                      uint16_t *m, void *v, df_dtype v_dtype, int64_t n, float lr, float beta1,
                      float beta2, float eps, float wd, int64_t step, float grad_scale,
                      uint64_t key, int64_t index0, uint16_t *out_bf16)
{
    if (n == 0)
        return 0;
    float *v32 = v_dtype == DF_DTYPE_F32 ? (float *)v : NULL;
    uint16_t *v16 = v32 ? NULL : (uint16_t *)v;
    if (grad_dtype == DF_DTYPE_BF16)
        return adamw_launch(be, master, (const uint16_t *)grad, NULL, v32, m, v16, n, lr, beta1,
                            beta2, eps, wd, step, grad_scale, key, index0, out_bf16);
    return adamw_launch(be, master, (const float *)grad, NULL, v32, m, v16, n, lr, beta1, beta2,
                        eps, wd, step, grad_scale, key, index0, out_bf16);
}

double df_cuda_sumsq(df_backend *be, const void *x, df_dtype dtype, int64_t n)
{
    if (n == 0)
        return 0.0;
    const int64_t np = cdiv(n, SQ_CHUNK);
    double *scr = (double *)df_cuda_scratch(be, (size_t)(np + 1) * sizeof(double));
    if (!scr)
        return (double)-ENOMEM;
    cudaStream_t st = df_cuda_stream(be);
    int64_t blocks = np < ((int64_t)1 << 20) ? np : ((int64_t)1 << 20);
    if (dtype == DF_DTYPE_BF16) /* a quad of bf16: one 8-byte load */
        sumsq_piece_kernel<uint16_t><<<(unsigned)blocks, NT, 0, st>>>(
            (const uint16_t *)x, n, np, !((uintptr_t)x & 7u), scr + 1);
    else
        sumsq_piece_kernel<float><<<(unsigned)blocks, NT, 0, st>>>(
            (const float *)x, n, np, !((uintptr_t)x & 15u), scr + 1);
    if (df_cuda_check_launch("sumsq kernel"))
        return (double)-EIO;
    sumsq_final_kernel<<<1, NT, 0, st>>>(scr + 1, np, scr);
    if (df_cuda_check_launch("sumsq final kernel"))
        return (double)-EIO;
    double s = 0.0;
    if (df_cuda_fail(cudaMemcpyAsync(&s, scr, sizeof s, cudaMemcpyDeviceToHost, st),
                     "sumsq download") ||
        df_cuda_fail(cudaStreamSynchronize(st), "sumsq sync"))
        return (double)-EIO;
    return s;
}
