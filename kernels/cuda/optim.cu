/* optim.cu - AdamW and the sum of squares (the gradient norm) on the GPU
 * (contracts in train_ops.h; the CPU reference is kernels/cpu/train_dense.c,
 * whose formulas are written here in its order, in fp32). The gradient
 * (adamw's grad, sumsq's x) is F32 or BF16: a BF16 one is widened exactly
 * where it is read, so the arithmetic (and the order of every sum) is the
 * F32 one's.
 *
 * Kept weights' codes (fp8_wcodes.cu). Where AdamW writes the BF16 weights
 * (out_bf16) over the whole of a weight whose E4M3 codes the FP8 GEMMs keep,
 * that weight is updated by adamw_tiles instead: a CTA per 128 x 128 block,
 * each element with adam_one and its own rounding bits as the flat kernel
 * (the same bits of master, moments and weight), the block's BF16 weights
 * then in shared memory, whose amax gives the block's scale and which are
 * written as codes in both layouts (fp8_codes.cu's q8_blk rule: the same
 * codes as rounding the weights). The rest of the range takes the flat
 * kernel.
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
#include "uf16.h"
#include "cuda_internal.h"
#include "e4m3.cuh"
#include "fp8_cuda.h"
#include "train_cuda.h"

namespace {

constexpr int NT = 256; /* threads per block */
constexpr int DF_ADAMW_KEPT_MAX = 256; /* kept weights one AdamW call may update */

__host__ __device__ __forceinline__ int64_t cdiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

/* ---- AdamW ---- */

/* G: the gradient's element type, float (F32) or uint16_t (BF16). */
template <typename G>
struct AdamArgs {
    float *p, *m, *v;     /* m, v: F32 moments (adamw; v of adamw_m16 with an F32 v) */
    uint16_t *m16, *v16;  /* 16-bit moments (adamw_m16; v16 NULL with an F32 v) */
    int vuf;              /* v16 holds UF16 (else BF16) */
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

/* A moment's storage: F32, BF16 or UF16 (v only) */
enum { MF_F32 = 0, MF_BF16 = 1, MF_UF16 = 2 };

/* 16-bit moments: element i's stored m (and v, VF != MF_F32) from their fp32 values,
 * rounded stochastically with df_sr_bits(key, i0 + i) (the CPU's rule) */
template <int VF, typename G>
__device__ __forceinline__ void store_m16(const AdamArgs<G> &a, int64_t i, float m, float v,
                                          uint16_t *mo, uint16_t *vo)
{
    uint64_t r = df_sr_bits(a.key, (uint64_t)(a.i0 + i));
    *mo = df_bf16_sr(__float_as_uint(m), (uint32_t)r);
    if (VF == MF_BF16)
        *vo = df_bf16_sr(__float_as_uint(v), (uint32_t)(r >> 16));
    else if (VF == MF_UF16)
        *vo = df_uf16_sr(__float_as_uint(v), (uint32_t)(r >> 16));
}

/* one stored moment of format F, widened exactly */
template <int F>
__device__ __forceinline__ float moment_at(const float *f, const uint16_t *h, int64_t i)
{
    return F == MF_F32 ? f[i] : F == MF_BF16 ? bf2f(h[i]) : df_uf16_to_f32(h[i]);
}

/* 4 moments from their storage: a float4, or 4 16-bit values in a uint2 */
template <int F, typename G>
__device__ __forceinline__ float4 moment_quad(const AdamArgs<G> &a, const float *f,
                                              const uint16_t *h, int64_t q)
{
    if (F == MF_F32)
        return reinterpret_cast<const float4 *>(f)[q];
    uint2 u = reinterpret_cast<const uint2 *>(h)[q];
    if (F == MF_UF16)
        return make_float4(df_uf16_to_f32((uint16_t)u.x), df_uf16_to_f32((uint16_t)(u.x >> 16)),
                           df_uf16_to_f32((uint16_t)u.y), df_uf16_to_f32((uint16_t)(u.y >> 16)));
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                       __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}

/* Quad q (elements 4q .. 4q + 3; p, g, m, v as loaded): adam_one on each, the new master and
 * moments stored (16-bit moments rounded with the elements' own bits); returns the new master. */
template <bool M16, int VF, typename G>
__device__ __forceinline__ float4 adam_quad(const AdamArgs<G> &a, int64_t q, float4 p, float4 g,
                                            float4 m, float4 v)
{
    p.x = adam_one(a, g.x, &m.x, &v.x, p.x);
    p.y = adam_one(a, g.y, &m.y, &v.y, p.y);
    p.z = adam_one(a, g.z, &m.z, &v.z, p.z);
    p.w = adam_one(a, g.w, &m.w, &v.w, p.w);
    reinterpret_cast<float4 *>(a.p)[q] = p;
    if (M16) {
        uint16_t mo[4], vo[4] = {0, 0, 0, 0};
        store_m16<VF>(a, 4 * q, m.x, v.x, &mo[0], &vo[0]);
        store_m16<VF>(a, 4 * q + 1, m.y, v.y, &mo[1], &vo[1]);
        store_m16<VF>(a, 4 * q + 2, m.z, v.z, &mo[2], &vo[2]);
        store_m16<VF>(a, 4 * q + 3, m.w, v.w, &mo[3], &vo[3]);
        reinterpret_cast<uint2 *>(a.m16)[q] =
            make_uint2(mo[0] | (uint32_t)mo[1] << 16, mo[2] | (uint32_t)mo[3] << 16);
        if (VF != MF_F32)
            reinterpret_cast<uint2 *>(a.v16)[q] =
                make_uint2(vo[0] | (uint32_t)vo[1] << 16, vo[2] | (uint32_t)vo[3] << 16);
    } else {
        reinterpret_cast<float4 *>(a.m)[q] = m;
    }
    if (VF == MF_F32)
        reinterpret_cast<float4 *>(a.v)[q] = v;
    return p;
}

/* VEC4: vectors over the n/4 leading quads (p and F32 m, v 16-byte aligned,
 * BF16 m, v and out 8-byte aligned, grad 4 elements' worth aligned), the
 * last n%4 elements by the first threads. The grad dtype changes only how g
 * is loaded: the arithmetic, hence the bits, are those of an F32 grad of the
 * same values. M16: m in BF16 (adamw_m16); VF: v's format (16-bit with M16 only). */
template <bool VEC4, bool M16, int VF, typename G>
__global__ void __launch_bounds__(NT) adamw_kernel(AdamArgs<G> a)
{
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t nthr = (int64_t)gridDim.x * blockDim.x;
    int64_t done = 0;
    if (VEC4) {
        const int64_t nq = a.n / 4;
        for (int64_t q = tid; q < nq; q += nthr) {
            const float4 p = adam_quad<M16, VF>(
                a, q, reinterpret_cast<const float4 *>(a.p)[q], grad_quad(a.g, q),
                moment_quad<M16 ? MF_BF16 : MF_F32>(a, a.m, a.m16, q),
                moment_quad<VF>(a, a.v, a.v16, q));
            if (a.out)
                reinterpret_cast<uint2 *>(a.out)[q] = make_uint2(pack2(p.x, p.y), pack2(p.z, p.w));
        }
        done = nq * 4;
    }
    for (int64_t i = done + tid; i < a.n; i += nthr) {
        float m = moment_at<M16 ? MF_BF16 : MF_F32>(a.m, a.m16, i);
        float v = moment_at<VF>(a.v, a.v16, i);
        float p = adam_one(a, grad_at(a.g, i), &m, &v, a.p[i]);
        if (M16)
            store_m16<VF>(a, i, m, v, &a.m16[i], VF != MF_F32 ? &a.v16[i] : NULL);
        else
            a.m[i] = m;
        if (VF == MF_F32)
            a.v[i] = v;
        a.p[i] = p;
        if (a.out)
            a.out[i] = f2bf(p);
    }
}

/* The kept weights one adamw_tiles launch updates: weight j is [N, K] at element off of a's
 * arrays (off and K multiples of 8, the arrays 16-byte aligned), its 128 x 128 blocks CTAs
 * tile0 .. tile0 + (N / 128) (K / 128) - 1 (rows of blocks in order, so that consecutive
 * CTAs read neighbouring parts of the same rows); cf [N, K] and sf[rb * lf + cb] the codes
 * and scales of w, cb [K, N] and sb[cb * lb + rb] those of w^T. */
constexpr int TSEG = 16;
struct TileSeg {
    int64_t off;
    uint8_t *cf, *cb;
    float *sf, *sb;
    int32_t rt, kt, lf, lb, tile0;
};
struct TileSegs {
    TileSeg s[TSEG];
    int n;
    int lazy; /* DFLASH_FP8_LAZY_BF16: the BF16 weights not written (fp8_wcodes.cu) */
};

/* One 128 x 128 block per CTA: AdamW on its elements (adam_one, store_m16: the flat kernel's
 * bits), the BF16 weights to a.out and to the tile, then the codes and scales of both
 * layouts as q8_blk writes them. 64 registers: four CTAs per SM. */
constexpr int TT = 256; /* threads of adamw_tiles */
template <bool M16, int VF, typename G>
__global__ void __launch_bounds__(TT, 4) adamw_tiles(AdamArgs<G> a, const __grid_constant__ TileSegs ts)
{
    __shared__ __align__(16) uint16_t t[128][136];
    __shared__ float wm[TT / 32];
    int j0 = 0;
    while (j0 + 1 < ts.n && (int)blockIdx.x >= ts.s[j0 + 1].tile0)
        j0++;
    const TileSeg &sg = ts.s[j0];
    const int tile = (int)blockIdx.x - sg.tile0, rbk = tile / sg.kt, cbk = tile - rbk * sg.kt;
    const int64_t N = (int64_t)sg.rt * 128, K = (int64_t)sg.kt * 128, off = sg.off;
    const int64_t r0 = (int64_t)rbk * 128, c0 = (int64_t)cbk * 128;
    /* AdamW: warp w takes rows w, w + 8, ... of the block, a quad per lane (each load and
     * store of a warp one contiguous row piece), two rows' loads out before their math */
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    uint32_t mb = 0;
#pragma unroll 1
    for (int it = 0; it < 128 / 16; it++) {
        int64_t e[2];
        float4 p[2], g[2], m[2], v[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            e[u] = off + (r0 + it * 16 + u * 8 + warp) * K + c0 + lane * 4;
            p[u] = reinterpret_cast<const float4 *>(a.p)[e[u] / 4];
            g[u] = grad_quad(a.g, e[u] / 4);
            m[u] = moment_quad<M16 ? MF_BF16 : MF_F32>(a, a.m, a.m16, e[u] / 4);
            v[u] = moment_quad<VF>(a, a.v, a.v16, e[u] / 4);
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int64_t q = e[u] / 4;
            const float4 pp = adam_quad<M16, VF>(a, q, p[u], g[u], m[u], v[u]);
            const uint2 w = make_uint2(pack2(pp.x, pp.y), pack2(pp.z, pp.w));
            if (!ts.lazy)
                reinterpret_cast<uint2 *>(a.out)[q] = w;
            *reinterpret_cast<uint2 *>(&t[it * 16 + u * 8 + warp][lane * 4]) = w;
            const uint32_t h = __vmaxu2(w.x & 0x7fff7fffu, w.y & 0x7fff7fffu);
            mb = max(mb, max(h & 0xffffu, h >> 16));
        }
    }
    constexpr int P = 128 * 16 / TT; /* 8-code pieces per thread */
    const float am = block_amax<TT>(bits_f(mb), wm); /* (its barrier also orders the tile) */
    const int ke = scale_exp(am);
    const float inv = ldexpf(1.0f, -ke);
    const bool fin = isfinite(am);
#pragma unroll 2
    for (int j = 0; j < P; j++) { /* w's codes: 8 of one row per thread */
        const int i = threadIdx.x + j * TT, rr = i / 16, kc = (i % 16) * 8;
        float v[8];
        unpack8(*reinterpret_cast<const uint4 *>(&t[rr][kc]), v);
        *reinterpret_cast<uint2 *>(sg.cf + (r0 + rr) * K + c0 + kc) = codes8(v, inv, fin);
    }
    for (int i = threadIdx.x; i < 128 * 4; i += TT) { /* w^T's: 32 of one column per thread */
        const int oo = i % 128, rr = (i / 128) * 32;
        uint2 c[4];
#pragma unroll
        for (int h = 0; h < 4; h++) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; j++)
                v[j] = bf2f(t[rr + 8 * h + j][oo]);
            c[h] = codes8(v, inv, fin);
        }
        uint4 *o = reinterpret_cast<uint4 *>(sg.cb + (c0 + oo) * N + r0 + rr);
        o[0] = make_uint4(c[0].x, c[0].y, c[1].x, c[1].y);
        o[1] = make_uint4(c[2].x, c[2].y, c[3].x, c[3].y);
    }
    if (threadIdx.x == 0) {
        const float sc = ldexpf(1.0f, ke);
        sg.sf[rbk * sg.lf + cbk] = sc;
        sg.sb[cbk * sg.lb + rbk] = sc;
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
template <bool M16, int VF, typename G>
static void adamw_start(const AdamArgs<G> &a, int vec, unsigned blocks, cudaStream_t st)
{
    if (vec)
        adamw_kernel<true, M16, VF, G><<<blocks, NT, 0, st>>>(a);
    else
        adamw_kernel<false, M16, VF, G><<<blocks, NT, 0, st>>>(a);
}

/* the flat kernel's grid for n elements: one thread per quad (vec) or element, grid-stride
 * past 2^20 blocks */
static unsigned flat_blocks(int64_t n, int vec)
{
    int64_t work = vec ? (n / 4 > n % 4 ? n / 4 : n % 4) : n;
    int64_t blocks = cdiv(work, NT);
    return (unsigned)(blocks > ((int64_t)1 << 20) ? ((int64_t)1 << 20) : blocks);
}

/* the flat kernel on a's elements */
template <typename G>
static int adamw_flat(const AdamArgs<G> &a, int vec, unsigned blocks, cudaStream_t st)
{
    if (a.m16 && a.v16 && a.vuf)
        adamw_start<true, MF_UF16>(a, vec, blocks, st);
    else if (a.m16 && a.v16)
        adamw_start<true, MF_BF16>(a, vec, blocks, st);
    else if (a.m16)
        adamw_start<true, MF_F32>(a, vec, blocks, st);
    else
        adamw_start<false, MF_F32>(a, vec, blocks, st);
    return df_cuda_check_launch("adamw kernel");
}

/* a's elements [lo, hi) alone: the pointers moved, i0 with them (the same rounding bits) */
template <typename G>
static AdamArgs<G> adamw_part(const AdamArgs<G> &a, int64_t lo, int64_t hi)
{
    AdamArgs<G> b = a;
    b.p += lo;
    b.m = a.m ? a.m + lo : NULL;
    b.v = a.v ? a.v + lo : NULL;
    b.m16 = a.m16 ? a.m16 + lo : NULL;
    b.v16 = a.v16 ? a.v16 + lo : NULL;
    b.g = a.g + lo;
    b.out = a.out + lo;
    b.i0 = a.i0 + lo;
    b.n = hi - lo;
    return b;
}

/* the tile kernel on the segments of ts */
template <typename G>
static int adamw_tiles_start(const AdamArgs<G> &a, const TileSegs &ts, cudaStream_t st)
{
    const TileSeg &l = ts.s[ts.n - 1];
    const unsigned blocks = (unsigned)(l.tile0 + l.rt * l.kt);
    if (a.m16 && a.v16 && a.vuf)
        adamw_tiles<true, MF_UF16><<<blocks, TT, 0, st>>>(a, ts);
    else if (a.m16 && a.v16)
        adamw_tiles<true, MF_BF16><<<blocks, TT, 0, st>>>(a, ts);
    else if (a.m16)
        adamw_tiles<true, MF_F32><<<blocks, TT, 0, st>>>(a, ts);
    else
        adamw_tiles<false, MF_F32><<<blocks, TT, 0, st>>>(a, ts);
    return df_cuda_check_launch("adamw tiles kernel");
}

/* AdamW over a's range holding the kept weights kw (by address, each marked not ready):
 * each one inside the range whole (and 8-element aligned: the tile kernel's 16-byte
 * pieces) by the tile kernel, TSEG weights a launch, then ready (and stale where lazy: its
 * BF16 values left out, bf16 of its master); the elements between them by the flat kernel.
 * a's arrays are 16-byte aligned. A weight left stale by an earlier step and written here
 * by the flat kernel (in part, or misaligned) stays marked: the master stays current, so
 * making it fresh from there is right whatever was written since. */
template <typename G>
static int adamw_with_codes(const AdamArgs<G> &a, df_cuda_fp8_wcodes *const *kw, int nk,
                            cudaStream_t st)
{
    int64_t done = 0;
    TileSegs ts;
    df_cuda_fp8_wcodes *in[TSEG];
    ts.n = 0;
    ts.lazy = df_cuda_fp8_wcodes_lazy();
    for (int i = 0; i <= nk; i++) {
        const uintptr_t at = i < nk ? (uintptr_t)kw[i]->w : 0, base = (uintptr_t)a.out;
        const int64_t numel = i < nk ? kw[i]->rows * kw[i]->cols : 0;
        const int64_t off = i < nk ? (int64_t)((at - base) / 2) : a.n;
        if (i < nk && (at < base || (at - base) % 16 || off < done || off + numel > a.n))
            continue; /* in part, or misaligned: the flat kernel's (and not ready) */
        int rc = 0;
        if (off > done) {
            AdamArgs<G> b = adamw_part(a, done, off);
            rc = adamw_flat(b, 1, flat_blocks(b.n, 1), st);
        }
        if (!rc && ts.n && (i == nk || ts.n == TSEG)) {
            rc = adamw_tiles_start(a, ts, st);
            for (int j = 0; j < ts.n && !rc; j++) {
                in[j]->ready = 1;
                in[j]->stale = ts.lazy; /* (else the values written whole) */
                in[j]->master = a.p + ts.s[j].off;
            }
            ts.n = 0;
        }
        if (rc)
            return rc;
        if (i == nk)
            break;
        const TileSeg *l = ts.n ? &ts.s[ts.n - 1] : NULL;
        TileSeg &sg = ts.s[ts.n];
        sg.off = off;
        sg.cf = (uint8_t *)kw[i]->fwd, sg.cb = (uint8_t *)kw[i]->bwx;
        sg.sf = kw[i]->fwd_scales, sg.sb = kw[i]->bwx_scales;
        sg.rt = (int32_t)(kw[i]->rows / 128), sg.kt = (int32_t)(kw[i]->cols / 128);
        sg.lf = (sg.kt + 3) / 4 * 4, sg.lb = (sg.rt + 3) / 4 * 4;
        sg.tile0 = l ? l->tile0 + l->rt * l->kt : 0;
        in[ts.n++] = kw[i];
        done = off + numel;
    }
    return 0;
}

/* m, v: F32 moments, or m16 and v16 / v: 16-bit ones (v16 UF16 with vuf; key, i0 their
 * rounding's bits) */
template <typename G>
static int adamw_launch(df_backend *be, float *master, const G *grad, float *m, float *v,
                        uint16_t *m16, uint16_t *v16, int vuf, int64_t n, float lr, float beta1,
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
    a.vuf = vuf;
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
    cudaStream_t st = df_cuda_stream(be);
    if (out_bf16) { /* kept weights' codes in the range (now not ready): the tile kernel there */
        df_cuda_fp8_wcodes *kw[DF_ADAMW_KEPT_MAX];
        int nk = df_cuda_fp8_wcodes_in(be, out_bf16, (size_t)n * 2, kw, DF_ADAMW_KEPT_MAX);
        const int al16 = !(((uintptr_t)master | (uintptr_t)m | (uintptr_t)v | (uintptr_t)m16 |
                            (uintptr_t)v16 | (uintptr_t)grad | (uintptr_t)out_bf16) & 15u);
        if (nk > 0 && al16)
            return adamw_with_codes(a, kw, nk < DF_ADAMW_KEPT_MAX ? nk : DF_ADAMW_KEPT_MAX, st);
    }
    return adamw_flat(a, vec, flat_blocks(n, vec), st);
}

int df_cuda_adamw(df_backend *be, float *master, const void *grad, df_dtype grad_dtype, float *m,
                  float *v, int64_t n, float lr, float beta1, float beta2, float eps, float wd,
                  int64_t step, float grad_scale, uint16_t *out_bf16)
{
    if (n == 0)
        return 0;
    if (grad_dtype == DF_DTYPE_BF16)
        return adamw_launch(be, master, (const uint16_t *)grad, m, v, NULL, NULL, 0, n, lr,
                            beta1, beta2, eps, wd, step, grad_scale, 0, 0, out_bf16);
    return adamw_launch(be, master, (const float *)grad, m, v, NULL, NULL, 0, n, lr, beta1,
                        beta2, eps, wd, step, grad_scale, 0, 0, out_bf16);
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
    const int vuf = v_dtype == DF_DTYPE_UF16;
    if (grad_dtype == DF_DTYPE_BF16)
        return adamw_launch(be, master, (const uint16_t *)grad, NULL, v32, m, v16, vuf, n, lr,
                            beta1, beta2, eps, wd, step, grad_scale, key, index0, out_bf16);
    return adamw_launch(be, master, (const float *)grad, NULL, v32, m, v16, vuf, n, lr, beta1,
                        beta2, eps, wd, step, grad_scale, key, index0, out_bf16);
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
