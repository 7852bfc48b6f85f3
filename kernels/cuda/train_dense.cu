/* train_dense.cu - the dense training ops on the GPU: RMSNorm backward
 * (plain and plus_one) and SwiGLU backward; the RoPE backward is in rope.cu, AdamW and the
 * sum of squares in optim.cu (contracts in train_ops.h; the CPU reference is
 * kernels/cpu/train_dense.c, whose formulas are written here in its order,
 * in fp32; each bf16 output is rounded once, to nearest even). Weight
 * gradients (rmsnorm_bwd's dw) are F32 or BF16:
 * a BF16 one is widened exactly where it is read, so the arithmetic (and
 * the order of every sum) is the F32 one's.
 *
 * Layout. dense.cu's (rows.cuh): tensors are rows of contiguous elements
 * (the last dim) addressed through up to three outer dims with arbitrary
 * strides, simplified on the host (rows_of: size-1 dims vanish, dims every
 * operand steps over contiguously merge). Rows whose starts are all
 * 16-byte aligned use 16-byte vectors (8 bf16); otherwise the same kernel
 * loads scalars.
 *
 * Determinism. The reduction whose sums cross threads (RMSNorm's dw over
 * rows) never uses atomics: every block writes its own partial in a fixed
 * order, and a second kernel adds the partials in a fixed order. The order
 * depends only on the shapes (D, rows), not on the GPU, the grid caps or the
 * alignment: the vector and scalar paths give each thread the same elements
 * in the same order. */
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.cuh"
#include "swiglu.cuh"
#include "cuda_internal.h"
#include "knobs.h"
#include "train_cuda.h"

/* Before rows.cuh, which is sized by them. */
constexpr int NT = 256; /* threads per block */
constexpr int MAXT = 5; /* operands sharing one row layout (swiglu_bwd: 5) */
#include "rows.cuh"

namespace {

/* Elements [c, c + 8) of a row of n: one vector when allowed and whole,
 * else scalars, 0 past the end. Both paths give the same values, so a
 * reduction over them does not depend on which one ran. */
__device__ __forceinline__ void load_unit(const uint16_t *row, int64_t c, int64_t n, int vec,
                                          float *f)
{
    if (vec && c + VEC <= n) {
        load8(row + c, f);
        return;
    }
#pragma unroll
    for (int j = 0; j < VEC; j++)
        f[j] = c + j < n ? bf2f(row[c + j]) : 0.0f;
}

__device__ __forceinline__ void store_unit(uint16_t *row, int64_t c, int64_t n, int vec,
                                           const float *f)
{
    if (vec && c + VEC <= n) {
        store8(row + c, f);
        return;
    }
#pragma unroll
    for (int j = 0; j < VEC; j++)
        if (c + j < n)
            row[c + j] = f2bf(f[j]);
}

/* load_unit's elements as 8 packed bf16 (0 past the end), for rows kept in
 * registers; vector loads only (the caller checked the alignment). */
__device__ __forceinline__ uint4 load_unit_raw(const uint16_t *row, int64_t c, int64_t n)
{
    if (c + VEC <= n)
        return *reinterpret_cast<const uint4 *>(row + c);
    uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int j = 0; j < VEC; j++)
        if (c + j < n)
            w[j / 2] |= (uint32_t)row[c + j] << (16 * (j % 2));
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* ---- row layout (rows.cuh) ---- */

/* The offsets of operands 0..N-1: a compile-time count keeps off[] in
 * registers (a loop to a runtime count would put it on the stack). */
template <int N>
__device__ __forceinline__ void row_offsets(const Rows &L, int64_t r, int64_t *off)
{
    int64_t i0 = r, i1 = 0, i2 = 0;
    if (L.n1 != 1 || L.n2 != 1) { /* uniform branch: only true for 3-D/4-D strided views */
        i2 = r % L.n2;
        r /= L.n2;
        i1 = r % L.n1;
        i0 = r / L.n1;
    }
#pragma unroll
    for (int k = 0; k < N; k++)
        off[k] = i0 * L.st[k][0] + i1 * L.st[k][1] + i2 * L.st[k][2];
}

/* 1 when every row start of every operand (and each extra pointer) is
 * 16-byte aligned. Checks every slot: rows_of leaves the unused ones 0
 * (dense.cu's takes the operand count instead). */
int rows_vec_ok(const Rows &L, const void *const *p, int np)
{
    for (int i = 0; i < np; i++)
        if (p[i] && ((uintptr_t)p[i] & 15u))
            return 0;
    for (int k = 0; k < MAXT; k++)
        for (int j = 0; j < 3; j++)
            if (L.st[k][j] % VEC)
                return 0;
    return 1;
}

/* ---- RMSNorm backward ----
 *
 * y = g * xhat, xhat = x * inv, inv = 1/sqrt(mean(x^2) + eps), g = w or 1 + w:
 *   dx (+)= inv * (g*dy - xhat * cm),  cm = mean(g*dy * xhat)
 *   dw   += sum over rows of dy * xhat
 * cm = inv * sum(g*dy*x) / D (the CPU sums g*dy*xhat in double: same value
 * up to fp32 rounding of one scalar per row). A row's two sums: thread lane
 * of the row's TPR threads (a warp slice of 8 / 16 / 32, or the block: by D
 * alone) sums its units lane, lane + TPR, ... in order, then row_sum2.
 *
 * The dw order, by D alone: rows go in tiles of rb rows; a tile's rows form
 * ty interleaved streams (stream y: the tile's rows y, y + ty, ...), each
 * summed in row order from 0; a tile's partial row is its streams' sums
 * added in y order; the dw kernel adds the tiles' partials in a fixed
 * order (8 strided groups, then the groups in order) and the old dw last,
 * as the CPU does.
 *
 * Two paths, the same bits (dx and dw): the same row sums, streams and
 * per-element formulas (nbwd_stat_elem, nbwd_row_stats, nbwd_elem, written
 * with _rn intrinsics so that no contraction is left to the compiler: any
 * kernel using them rounds alike).
 *  Two-pass (any layout; DFLASH_RMSNORM_BWD=twopass): three kernels, so
 *  that dx may be dy's or x's very view:
 *   1. stats: a row per warp slice or per block computes (inv, cm) into
 *      scratch; it reads x and dy whole before anything is written.
 *   2. apply: a 2-D grid of column blocks x row tiles; each thread owns one
 *      8-column unit for all rows of a tile's stream, writes dx for them
 *      (reads of x, dy, old dx before the write, in the same thread) and
 *      keeps the stream's 8 dw sums in registers; the ty threads of a
 *      column then combine in y order and the tile's partial row goes to
 *      scratch.
 *   3. dw (below).
 *  One-pass (16-byte aligned rows, D <= 512 or 1025..6144: the default there):
 *   nbwd_fused_kernel reads each row of x and dy (and the old dx) once, into
 *   registers as packed bf16, a row per slice as in the stats kernel; the
 *   row sums, then dx (written after the row's reads, by the threads that
 *   read it: aliasing as above), and the dw terms summed per stream in
 *   registers: a slice owns whole streams; the streams' sums go to shared
 *   memory and are added in y order there (a row per block: the block owns
 *   the tile's streams, added in y order in registers); then kernel 3. */

/* Operand slots: 0 = x, 1 = dy, 2 = dx. */
struct NbArgs {
    Rows L;
    const uint16_t *x, *dy, *w;
    uint16_t *dx;
    float2 *stats;   /* [rows] (inv, cm): two-pass */
    float *partial;  /* [n_tiles][D] */
    float eps;
    int plus_one, acc, vec;
    int64_t rb, n_tiles, ncb; /* rows per tile, tiles, column blocks (two-pass) */
    int ty;                   /* streams per tile */
    int tpp, sps;             /* one-pass: tiles per block pass, streams per slice */
};

/* A row's sums: sum x^2 and sum (g*dy)*x, one element. */
__device__ __forceinline__ void nbwd_stat_elem(float x, float dy, float g, float &ss, float &sd)
{
    ss = __fmaf_rn(x, x, ss);
    sd = __fmaf_rn(__fmul_rn(g, dy), x, sd);
}

/* (inv, cm) from the row's (sum x^2, sum g*dy*x): the forward's
 * normaliser, 1 / sqrt() as the CPU. */
__device__ __forceinline__ float2 nbwd_row_stats(float2 t, int64_t D, float eps)
{
    const float fd = (float)D;
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(t.x, fd), eps)));
    return make_float2(inv, __fdiv_rn(__fmul_rn(inv, t.y), fd));
}

/* One element: dx's new term (returned) and the dw term added to pw.
 * s = (inv, cm). */
__device__ __forceinline__ float nbwd_elem(float x, float dy, float g, float2 s, float &pw)
{
    const float xh = __fmul_rn(x, s.x);
    pw = __fmaf_rn(dy, xh, pw);
    return __fmul_rn(s.x, __fsub_rn(__fmul_rn(g, dy), __fmul_rn(xh, s.y)));
}

/* The sums of (a, b) over a row's TPR threads, in every thread of the row.
 * The callers' loops are uniform over the block, so every lane reaches the
 * shuffles and barriers. */
template <int TPR>
__device__ __forceinline__ float2 row_sum2(float a, float b, float2 *red)
{
    static_assert((TPR <= 32 && 32 % TPR == 0) || TPR == NT, "a row: a warp slice or the block");
#pragma unroll
    for (int o = (TPR < 32 ? TPR : 32) / 2; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    if (TPR <= 32)
        return make_float2(a, b);
    if (threadIdx.x % 32 == 0)
        red[threadIdx.x / 32] = make_float2(a, b);
    __syncthreads();
    float2 t = red[0];
#pragma unroll
    for (int i = 1; i < NT / 32; i++) {
        t.x += red[i].x;
        t.y += red[i].y;
    }
    __syncthreads(); /* red is rewritten for the next row */
    return t;
}

template <int TPR>
__global__ void __launch_bounds__(NT) nbwd_stats_kernel(NbArgs p)
{
    constexpr int RPB = NT / TPR;
    __shared__ float2 red[NT / 32];
    const int lane = (int)threadIdx.x % TPR, sub = (int)threadIdx.x / TPR;
    const int64_t D = p.L.cols, units = cdiv(D, VEC);
    /* base is uniform over the block: the row sum's barriers are reached by all. */
    for (int64_t base = (int64_t)blockIdx.x * RPB; base < p.L.rows;
         base += (int64_t)gridDim.x * RPB) {
        const int64_t r = base + sub;
        float ss = 0.0f, sd = 0.0f;
        if (r < p.L.rows) {
            int64_t off[2];
            row_offsets<2>(p.L, r, off);
            const uint16_t *x = p.x + off[0], *dy = p.dy + off[1];
            for (int64_t u = lane; u < units; u += TPR) {
                float fx[VEC], fd[VEC], fw[VEC];
                load_unit(x, u * VEC, D, p.vec, fx);
                load_unit(dy, u * VEC, D, p.vec, fd);
                load_unit(p.w, u * VEC, D, p.vec, fw);
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    nbwd_stat_elem(fx[j], fd[j], p.plus_one ? 1.0f + fw[j] : fw[j], ss, sd);
            }
        }
        float2 t = row_sum2<TPR>(ss, sd, red);
        if (r < p.L.rows && lane == 0)
            p.stats[r] = nbwd_row_stats(t, D, p.eps);
    }
}

/* Block (tx, ty): x over 8-column units, y over a tile's streams. 4 blocks
 * (32 warps) per SM: the registers capped at 64, no spills (ptxas -v). */
__global__ void __launch_bounds__(NT, 4) nbwd_apply_kernel(NbArgs p)
{
    __shared__ float red[NT * VEC];
    const int tx = (int)blockDim.x, ty = (int)blockDim.y;
    const int64_t D = p.L.cols, units = cdiv(D, VEC);
    for (int64_t cb = blockIdx.x; cb < p.ncb; cb += gridDim.x) {
        const int64_t u = cb * tx + threadIdx.x, c = u * VEC;
        const bool active = u < units;
        float g[VEC];
        load_unit(p.w, active ? c : 0, D, p.vec, g);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            g[j] = p.plus_one ? 1.0f + g[j] : g[j];
        for (int64_t tile = blockIdx.y; tile < p.n_tiles; tile += gridDim.y) {
            float pw[VEC];
#pragma unroll
            for (int j = 0; j < VEC; j++)
                pw[j] = 0.0f;
            const int64_t r1 = (tile + 1) * p.rb < p.L.rows ? (tile + 1) * p.rb : p.L.rows;
            for (int64_t r = tile * p.rb + threadIdx.y; active && r < r1; r += ty) {
                int64_t off[3];
                row_offsets<3>(p.L, r, off);
                const float2 s = p.stats[r];
                float fx[VEC], fd[VEC], fo[VEC];
                load_unit(p.x + off[0], c, D, p.vec, fx);
                load_unit(p.dy + off[1], c, D, p.vec, fd);
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    fo[j] = nbwd_elem(fx[j], fd[j], g[j], s, pw[j]);
                if (p.dx) {
                    uint16_t *dx = p.dx + off[2]; /* may be x's or dy's row: read above */
                    if (p.acc) {
                        float old[VEC];
                        load_unit(dx, c, D, p.vec, old);
#pragma unroll
                        for (int j = 0; j < VEC; j++)
                            fo[j] = __fadd_rn(fo[j], old[j]);
                    }
                    store_unit(dx, c, D, p.vec, fo);
                }
            }
            /* the ty stream sums of a column, added in y order */
            float *mine = red + ((int)threadIdx.y * tx + (int)threadIdx.x) * VEC;
#pragma unroll
            for (int j = 0; j < VEC; j++)
                mine[j] = pw[j];
            __syncthreads();
            if (threadIdx.y == 0 && active) {
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    if (c + j >= D)
                        break;
                    float t = red[threadIdx.x * VEC + j];
                    for (int y = 1; y < ty; y++)
                        t += red[(y * tx + (int)threadIdx.x) * VEC + j];
                    p.partial[tile * D + c + j] = t;
                }
            }
            __syncthreads(); /* red is rewritten for the next tile */
        }
    }
}

/* An opaque copy: the compiler cannot tell it equals u, so what is
 * computed from it is neither shared with the same computation from u
 * (kept live across a phase) nor hoisted out of a loop. The one-pass kernel
 * keeps its rows packed (4 registers per 8 elements) and unpacks them
 * again in each phase: otherwise the unpacked floats stay live, twice the
 * registers. */
__device__ __forceinline__ uint4 opaque(uint4 u)
{
    asm volatile("" : "+r"(u.x), "+r"(u.y), "+r"(u.z), "+r"(u.w));
    return u;
}

/* g (w or 1 + w) of a packed unit of w. */
__device__ __forceinline__ void weight8(uint4 w, int plus_one, float *g)
{
    unpack8(w, g);
#pragma unroll
    for (int j = 0; j < VEC; j++)
        g[j] = plus_one ? 1.0f + g[j] : g[j];
}

/* One-pass. A block of NT threads: RPB = NT / TPR slices of TPR threads, a
 * row per slice (TPR and the thread -> units map as nbwd_stats_kernel's:
 * lane owns units lane + i * TPR, i < UPT). A block pass takes tpp tiles
 * (tpp * ty streams); slice sl owns streams sl, sl + RPB, ... (sps of
 * them), and goes down each stream RU rows at a time (loaded together: the
 * memory parallelism). Every loop's trip count is uniform over the block
 * (rows past the end are masked), so the row sums' shuffles and barriers
 * are reached by all. The stream sums (dynamic shared memory): TPR < NT
 * to [tpp][ty][Dp], added in y order after a barrier; TPR == NT (tpp 1,
 * sps = ty: the slice is the block and owns the tile's streams in y order)
 * added in y order into the thread's own slots of [Dp] (no barrier).
 * MINB: blocks per SM the registers are capped for (ptxas -v, sm_90a: no
 * spills); sm_80 spills at 3 (80 registers): 2 there. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define NBWD_MINB(m) ((m) > 2 ? 2 : (m))
#else
#define NBWD_MINB(m) (m)
#endif
template <int TPR, int UPT, int RU, int MINB>
__global__ void __launch_bounds__(NT, NBWD_MINB(MINB)) nbwd_fused_kernel(NbArgs p)
{
    constexpr int RPB = NT / TPR;
    constexpr bool SMEM = TPR < NT;
    __shared__ float2 rsum[NT / 32];
    extern __shared__ float4 red4[];
    float *red = reinterpret_cast<float *>(red4);
    const int lane = (int)threadIdx.x % TPR, sl = (int)threadIdx.x / TPR;
    const int64_t D = p.L.cols, units = cdiv(D, VEC), Dp = units * VEC, R = p.L.rows;
    const int ty = p.ty, rps = (int)(p.rb / ty);
    const bool dx_acc = p.dx && p.acc;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

    bool own[UPT];
    uint4 wr[UPT];
#pragma unroll
    for (int i = 0; i < UPT; i++) {
        const int64_t u = lane + (int64_t)i * TPR;
        own[i] = u < units;
        wr[i] = own[i] ? load_unit_raw(p.w, u * VEC, D) : zero;
    }

    for (int64_t pass = blockIdx.x; pass * p.tpp < p.n_tiles; pass += gridDim.x) {
        for (int qi = 0; qi < p.sps; qi++) {
            const int q = sl + qi * RPB, tl = q / ty, y = q % ty;
            const int64_t r0 = (pass * p.tpp + tl) * p.rb + y; /* the stream's first row */
            float cur[UPT * VEC];
#pragma unroll
            for (int j = 0; j < UPT * VEC; j++)
                cur[j] = 0.0f;
            for (int k = 0; k < rps; k += RU) {
                /* RU rows of the stream: every read before any write */
                bool v[RU];
                int64_t off[RU][3];
                uint4 rx[RU][UPT], rd[RU][UPT], ro[RU][UPT];
#pragma unroll
                for (int e = 0; e < RU; e++) {
                    const int64_t r = r0 + (int64_t)(k + e) * ty;
                    v[e] = k + e < rps && r < R;
                    off[e][0] = off[e][1] = off[e][2] = 0;
                    if (v[e])
                        row_offsets<3>(p.L, r, off[e]);
#pragma unroll
                    for (int i = 0; i < UPT; i++) {
                        const int64_t c = (lane + (int64_t)i * TPR) * VEC;
                        const bool ld = v[e] && own[i];
                        rx[e][i] = ld ? load_unit_raw(p.x + off[e][0], c, D) : zero;
                        rd[e][i] = ld ? load_unit_raw(p.dy + off[e][1], c, D) : zero;
                        ro[e][i] = ld && dx_acc ? load_unit_raw(p.dx + off[e][2], c, D) : zero;
                    }
                }
                /* the row sums, in the stats kernel's order */
                float2 st[RU];
#pragma unroll
                for (int e = 0; e < RU; e++) {
                    float ss = 0.0f, sd = 0.0f;
#pragma unroll
                    for (int i = 0; i < UPT; i++) {
                        if (!own[i])
                            continue;
                        float fx[VEC], fd[VEC], g[VEC];
                        unpack8(opaque(rx[e][i]), fx);
                        unpack8(opaque(rd[e][i]), fd);
                        weight8(opaque(wr[i]), p.plus_one, g);
#pragma unroll
                        for (int j = 0; j < VEC; j++)
                            nbwd_stat_elem(fx[j], fd[j], g[j], ss, sd);
                    }
                    st[e] = nbwd_row_stats(row_sum2<TPR>(ss, sd, rsum), D, p.eps);
                }
                /* dx, and the dw terms in row order */
#pragma unroll
                for (int e = 0; e < RU; e++) {
                    if (!v[e])
                        continue;
#pragma unroll
                    for (int i = 0; i < UPT; i++) {
                        if (!own[i])
                            continue;
                        const int64_t c = (lane + (int64_t)i * TPR) * VEC;
                        float fx[VEC], fd[VEC], g[VEC], fo[VEC];
                        unpack8(opaque(rx[e][i]), fx);
                        unpack8(opaque(rd[e][i]), fd);
                        weight8(opaque(wr[i]), p.plus_one, g);
#pragma unroll
                        for (int j = 0; j < VEC; j++)
                            fo[j] = nbwd_elem(fx[j], fd[j], g[j], st[e], cur[i * VEC + j]);
                        if (p.dx) {
                            if (p.acc) {
                                float old[VEC];
                                unpack8(ro[e][i], old);
#pragma unroll
                                for (int j = 0; j < VEC; j++)
                                    fo[j] = __fadd_rn(fo[j], old[j]);
                            }
                            /* may be x's or dy's row: read above, by this thread */
                            store_unit(p.dx + off[e][2], c, D, 1, fo);
                        }
                    }
                }
            }
            /* the stream's sums: TPR < NT to the block's [tpp][ty][Dp]; the
             * block's row (RPB 1: stream qi is y = qi) added in y order to
             * this thread's own slots of [Dp] */
            float *dst = red + (SMEM ? ((int64_t)tl * ty + y) * Dp : 0);
#pragma unroll
            for (int i = 0; i < UPT; i++) {
                if (!own[i])
                    continue;
                float4 *d4 = reinterpret_cast<float4 *>(dst + (lane + (int64_t)i * TPR) * VEC);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const float *cu = cur + i * VEC + 4 * h;
                    float4 a = make_float4(cu[0], cu[1], cu[2], cu[3]);
                    if (!SMEM && qi > 0) {
                        const float4 b = d4[h];
                        a = make_float4(b.x + a.x, b.y + a.y, b.z + a.z, b.w + a.w);
                    }
                    d4[h] = a;
                }
            }
        }
        /* the tiles' partial rows */
        if (SMEM) {
            __syncthreads();
            for (int64_t e = threadIdx.x; e < (int64_t)p.tpp * D; e += NT) {
                const int64_t tl = e / D, c = e - tl * D, tile = pass * p.tpp + tl;
                if (tile < p.n_tiles) {
                    const float *col = red + tl * ty * Dp + c;
                    float t = col[0];
                    for (int y = 1; y < ty; y++)
                        t += col[y * Dp];
                    p.partial[tile * D + c] = t;
                }
            }
            __syncthreads(); /* red is rewritten in the next pass */
        } else {
            /* this thread's own slots: no barrier */
            float *out = p.partial + pass * D;
#pragma unroll
            for (int i = 0; i < UPT; i++) {
                if (!own[i])
                    continue;
                const int64_t c = (lane + (int64_t)i * TPR) * VEC;
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    if (c + j < D)
                        out[c + j] = red[c + j];
            }
        }
    }
}

constexpr int DW_GROUPS = 8; /* tile groups of the dw reduction (block 32 x 8) */

/* dw element as f32, and back: F32 as is; BF16 widened exactly, and the
 * f32 result rounded once (RNE). */
__device__ __forceinline__ float dw_load(const float *p) { return *p; }
__device__ __forceinline__ float dw_load(const uint16_t *p) { return bf2f(*p); }
__device__ __forceinline__ void dw_store(float *p, float f) { *p = f; }
__device__ __forceinline__ void dw_store(uint16_t *p, float f) { *p = f2bf(f); }

/* dw[c] = (sum over tiles of partial[t][c]) + dw[c]: group y sums tiles
 * y, y + 8, ... in order, then the 8 groups are added in order; the old dw
 * (widened) is added last in fp32, as the CPU does. DW: float or uint16_t
 * (bf16). */
template <typename DW>
__global__ void __launch_bounds__(32 * DW_GROUPS)
    nbwd_dw_kernel(const float *partial, int64_t n_tiles, int64_t D, DW *dw)
{
    __shared__ float red[DW_GROUPS][32];
    for (int64_t cb = blockIdx.x; cb < cdiv(D, 32); cb += gridDim.x) {
        const int64_t c = cb * 32 + threadIdx.x;
        float s = 0.0f;
        if (c < D)
            for (int64_t t = threadIdx.y; t < n_tiles; t += DW_GROUPS)
                s += partial[t * D + c];
        red[threadIdx.y][threadIdx.x] = s;
        __syncthreads();
        if (threadIdx.y == 0 && c < D) {
            float t = red[0][threadIdx.x];
#pragma unroll
            for (int y = 1; y < DW_GROUPS; y++)
                t += red[y][threadIdx.x];
            dw_store(&dw[c], t + dw_load(&dw[c]));
        }
        __syncthreads();
    }
}

/* ---- SwiGLU backward ---- */

/* Operand slots: 0 = gate, 1 = up, 2 = dout, 3 = dgate, 4 = dup. */
struct SwArgs {
    Rows L;
    const uint16_t *g, *u, *d;
    uint16_t *dg, *du;
    int vec;
};

/* dgate / dup may be exactly an input's view: each element's three inputs
 * are read by the thread that writes its two outputs, before it writes. */
__global__ void swiglu_bwd_kernel(SwArgs p)
{
    const int64_t cols = p.L.cols, units = p.vec ? cdiv(cols, VEC) : cols;
    ROW_LOOP(r, p.L.rows)
    {
        int64_t off[MAXT];
        row_offsets<MAXT>(p.L, r, off);
        const uint16_t *g = p.g + off[0], *u = p.u + off[1], *d = p.d + off[2];
        uint16_t *dg = p.dg + off[3], *du = p.du + off[4];
        UNIT_LOOP(k, units)
        {
            int64_t c = p.vec ? k * VEC : k;
            if (p.vec && c + VEC <= cols) {
                float fg[VEC], fu[VEC], fd[VEC];
                load8(g + c, fg);
                load8(u + c, fu);
                load8(d + c, fd);
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    swiglu_bwd_f(fg[j], fu[j], fd[j], &fg[j], &fu[j]);
                store8(dg + c, fg);
                store8(du + c, fu);
                continue;
            }
            for (int64_t e = c; e < cols && e < c + (p.vec ? VEC : 1); e++) {
                float a, b;
                swiglu_bwd_f(bf2f(g[e]), bf2f(u[e]), bf2f(d[e]), &a, &b);
                dg[e] = f2bf(a);
                du[e] = f2bf(b);
            }
        }
    }
}

} /* namespace */

/* ---- host side ---- */

namespace {
int g_nbwd_impl;     /* df_cuda_rmsnorm_bwd_set_impl; 0: none */
int g_nbwd_last = 0; /* the path the last call took */

/* DFLASH_RMSNORM_BWD: onepass (the default) or twopass, knobs.h's order. */
int env_nbwd_impl()
{
    return df_knob_int(DF_KNOB_RMSNORM_BWD) == 1 ? DF_CUDA_RMSNORM_BWD_TWOPASS
                                                 : DF_CUDA_RMSNORM_BWD_ONEPASS;
}

template <int TPR, int UPT, int RU, int MINB>
void nbwd_fused_launch(const NbArgs &p, unsigned grid, cudaStream_t st)
{
    const size_t smem = (size_t)(TPR < NT ? p.tpp * p.ty : 1) * cdiv(p.L.cols, VEC) * VEC *
                        sizeof(float);
    nbwd_fused_kernel<TPR, UPT, RU, MINB><<<grid, NT, smem, st>>>(p);
}
} /* namespace */

extern "C" int df_cuda_rmsnorm_bwd_set_impl(int impl)
{
    if (impl < 0 || impl > DF_CUDA_RMSNORM_BWD_TWOPASS)
        return -EINVAL;
    g_nbwd_impl = impl;
    return 0;
}

extern "C" int df_cuda_rmsnorm_bwd_last_impl(void)
{
    return g_nbwd_last;
}

int df_cuda_rmsnorm_bwd(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                        int plus_one, const df_tensor *dy, df_tensor *dx, int accumulate_dx,
                        df_tensor *dw)
{
    if (df_tensor_numel(x) == 0)
        return 0; /* no rows (or D == 0): dw += nothing */
    const df_tensor *t[3] = {x, dy, dx};
    NbArgs p;
    memset(&p, 0, sizeof p);
    p.L = rows_of(t, dx ? 3 : 2, 0);
    p.x = (const uint16_t *)x->data;
    p.dy = (const uint16_t *)dy->data;
    p.w = (const uint16_t *)w->data;
    p.dx = dx ? (uint16_t *)dx->data : nullptr;
    p.eps = eps;
    p.plus_one = plus_one != 0;
    p.acc = accumulate_dx != 0;
    const void *ptrs[4] = {p.x, p.dy, p.dx, p.w};
    p.vec = rows_vec_ok(p.L, ptrs, 4);

    const int64_t R = p.L.rows, D = p.L.cols, units = cdiv(D, VEC);
    /* Tile shape by D alone (the dw summation order): up to 64 units
     * (1 KiB of a row) across, ty rows down; >= 16 rows and ~32K elements
     * per tile, so the partials are <= 1/16 of the input and small D still
     * gets many tiles. */
    int tx = 1;
    while (tx < units && tx < 64)
        tx <<= 1;
    const int ty = NT / tx;
    int64_t rb = cdiv((int64_t)1 << 15, D);
    if (rb < 16)
        rb = 16;
    p.ty = ty;
    p.rb = cdiv(rb, ty) * ty;
    p.n_tiles = cdiv(R, p.rb);
    p.ncb = cdiv(units, tx);
    /* a row's threads (the row sums' order): a warp slice of 8 / 16 with
     * <= 2 units (16 bf16) per thread, a warp up to D = 1024 (per-head
     * norms), else the block (the hidden size) */
    const int tpr = units <= 16 ? 8 : units <= 32 ? 16 : units <= 128 ? 32 : NT;

    int impl = g_nbwd_impl ? g_nbwd_impl : env_nbwd_impl();
    /* the one-pass kernel's rows fit in registers (ptxas -v: no spills,
     * 2 blocks per SM or more) up to 2 units per thread with a slice of 8 /
     * 16 / 32 threads a row, 3 with the block (D <= 512, 1025..6144) */
    const int onepass = impl != DF_CUDA_RMSNORM_BWD_TWOPASS && p.vec &&
                        (units <= 64 || (units > 128 && units <= 3 * NT));
    g_nbwd_last = onepass ? DF_CUDA_RMSNORM_BWD_ONEPASS : DF_CUDA_RMSNORM_BWD_TWOPASS;

    /* scratch: the partials [n_tiles][D] f32, then (two-pass) the row stats */
    size_t part_bytes = ((size_t)(p.n_tiles * D) * sizeof(float) + 255) & ~(size_t)255;
    const size_t stats_bytes = onepass ? 0 : (size_t)R * sizeof(float2);
    char *scr = (char *)df_cuda_scratch(be, part_bytes + stats_bytes);
    if (!scr)
        return -ENOMEM;
    p.partial = (float *)scr;
    p.stats = onepass ? nullptr : (float2 *)(scr + part_bytes);

    cudaStream_t st = df_cuda_stream(be);
    int rc;
    if (onepass) {
        /* tpp tiles per block pass, sps streams per slice: the block's
         * RPB slices own all the pass's streams, one or more each */
        const int rpb = NT / tpr;
        p.tpp = rpb > ty ? rpb / ty : 1;
        p.sps = ty > rpb ? ty / rpb : 1;
        const unsigned grid = capped(cdiv(p.n_tiles, p.tpp));
        if (tpr == 8)
            nbwd_fused_launch<8, 2, 2, 2>(p, grid, st);
        else if (tpr == 16)
            nbwd_fused_launch<16, 2, 2, 2>(p, grid, st);
        else if (tpr == 32)
            nbwd_fused_launch<32, 2, 2, 2>(p, grid, st);
        else if (units <= NT)
            nbwd_fused_launch<NT, 1, 1, 4>(p, grid, st);
        else if (units <= 2 * NT)
            nbwd_fused_launch<NT, 2, 1, 3>(p, grid, st);
        else
            nbwd_fused_launch<NT, 3, 1, 2>(p, grid, st);
        rc = df_cuda_check_launch("rmsnorm_bwd one-pass kernel");
        if (rc)
            return rc;
    } else {
        if (tpr == 8)
            nbwd_stats_kernel<8><<<capped(cdiv(R, NT / 8)), NT, 0, st>>>(p);
        else if (tpr == 16)
            nbwd_stats_kernel<16><<<capped(cdiv(R, NT / 16)), NT, 0, st>>>(p);
        else if (tpr == 32)
            nbwd_stats_kernel<32><<<capped(cdiv(R, NT / 32)), NT, 0, st>>>(p);
        else
            nbwd_stats_kernel<NT><<<capped(R), NT, 0, st>>>(p);
        rc = df_cuda_check_launch("rmsnorm_bwd stats kernel");
        if (rc)
            return rc;
        nbwd_apply_kernel<<<dim3(capped(p.ncb), capped(p.n_tiles), 1),
                            dim3((unsigned)tx, (unsigned)ty, 1), 0, st>>>(p);
        rc = df_cuda_check_launch("rmsnorm_bwd apply kernel");
        if (rc)
            return rc;
    }
    const dim3 dwg(capped(cdiv(D, 32))), dwb(32, DW_GROUPS, 1);
    if (dw->dtype == DF_DTYPE_BF16)
        nbwd_dw_kernel<uint16_t><<<dwg, dwb, 0, st>>>(p.partial, p.n_tiles, D,
                                                      (uint16_t *)dw->data);
    else
        nbwd_dw_kernel<float><<<dwg, dwb, 0, st>>>(p.partial, p.n_tiles, D, (float *)dw->data);
    return df_cuda_check_launch("rmsnorm_bwd dw kernel");
}


int df_cuda_swiglu_bwd(df_backend *be, const df_tensor *gate, const df_tensor *up,
                       const df_tensor *dout, df_tensor *dgate, df_tensor *dup)
{
    if (df_tensor_numel(dgate) == 0)
        return 0;
    const df_tensor *t[MAXT] = {gate, up, dout, dgate, dup};
    SwArgs p;
    p.L = rows_of(t, MAXT, 1);
    p.g = (const uint16_t *)gate->data;
    p.u = (const uint16_t *)up->data;
    p.d = (const uint16_t *)dout->data;
    p.dg = (uint16_t *)dgate->data;
    p.du = (uint16_t *)dup->data;
    const void *ptrs[5] = {p.g, p.u, p.d, p.dg, p.du};
    p.vec = rows_vec_ok(p.L, ptrs, 5);
    Launch l = rows_launch(p.L.rows, p.vec ? cdiv(p.L.cols, VEC) : p.L.cols);
    swiglu_bwd_kernel<<<l.grid, l.block, 0, df_cuda_stream(be)>>>(p);
    return df_cuda_check_launch("swiglu_bwd kernel");
}
