/* dense.cu - the dense ops on the GPU: embed, residual add, the RMSNorms
 * (plain, plus_one, gated) and the row-norm kernel l2norm shares with them,
 * SwiGLU, sigmoid, SiLU (RoPE: rope.cu). The CPU reference is kernels/cpu/dense.c;
 * every formula below is written in its order, in fp32, and each output is
 * rounded to bf16 once (round to nearest even).
 *
 * Layout (rows.cuh). Every op sees its tensors as rows of contiguous
 * elements (the last dim) addressed through up to three outer dims with
 * arbitrary strides. The host first simplifies that addressing (rows_of):
 * size-1 dims vanish, outer dims every operand steps over contiguously
 * merge, and for elementwise ops a fully contiguous tensor becomes one long
 * row, so the common case runs without per-row index math. Rows whose
 * starts are all 16-byte aligned use 16-byte vectors (8 bf16) and a scalar
 * tail; anything else (odd strides) takes the scalar path of the same
 * kernel.
 *
 * Launch shapes. The vector paths (aligned rows, widths a multiple of 8,
 * under 2^31 rows / vectors) are the fast ones: elementwise ops run over
 * the flat list of vectors, 4 per thread with all loads issued first, rows
 * found by a multiply-high division (ew_vec_kernel); norms give a row a
 * sub-warp group (D <= 1024: 4..32 lanes, several rows per warp, e.g. 8
 * lanes x 2 vectors for D = 128) or 128 threads (the hidden size), the row
 * held in registers so x is read once (normv_kernel). Everything else (odd widths or strides, unaligned
 * views) takes the general kernels: a 2-D grid of rows x units (a unit is
 * one vector or one element), short rows packed several to a block; norms
 * a warp or a block per row, grid-stride over rows. */
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.cuh"
#include "swiglu.cuh"
#include "cuda_internal.h"
#include "e4m3.cuh"
#include "norm.cuh"
#include "train_cuda.h"

/* Before rows.cuh, which is sized by them. */
constexpr int NT = 256; /* threads per block */
constexpr int MAXT = 3; /* operands sharing one row layout */
#include "rows.cuh"

namespace {

enum { NORM_RMS, NORM_RMS_P1, NORM_GATED, NORM_L2 };

__device__ __forceinline__ float sigmoid_f(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

/* ---- row layout (rows.cuh) ---- */

/* The offsets of operands 0..nt-1; nt is known only at run time (2, or 3
 * with b or z). train_dense.cu's row_offsets<N> takes a compile-time count. */
__device__ __forceinline__ void row_offsets(const Rows &L, int64_t r, int nt, int64_t *off)
{
    int64_t i0 = r, i1 = 0, i2 = 0;
    if (L.n1 != 1 || L.n2 != 1) { /* uniform branch: only true for 3-D/4-D strided views */
        i2 = r % L.n2;
        r /= L.n2;
        i1 = r % L.n1;
        i0 = r / L.n1;
    }
    for (int k = 0; k < nt; k++)
        off[k] = i0 * L.st[k][0] + i1 * L.st[k][1] + i2 * L.st[k][2];
}

/* 1 when every row start of every operand (and each extra pointer) is
 * 16-byte aligned, so rows can be read in 8-element vectors. Checks the nt
 * operands (train_dense.cu's checks every slot: the unused ones are 0). */
int rows_vec_ok(const Rows &L, const void *const *p, int np, int nt)
{
    for (int i = 0; i < np; i++)
        if (p[i] && ((uintptr_t)p[i] & 15u))
            return 0;
    for (int k = 0; k < nt; k++)
        for (int j = 0; j < 3; j++)
            if (L.st[k][j] % VEC)
                return 0;
    return 1;
}

/* n / d for 0 <= n < 2^31, 1 <= d < 2^31, by a multiply-high and a shift
 * (PyTorch's IntDivider): s = ceil(log2 d), m = 2^32 (2^s - d) / d + 1, so
 * n / d = (umulhi(n, m) + n) >> s (the sum stays below 2^32). The vector
 * kernels index rows with it instead of 64-bit division. */
struct FastDiv {
    uint32_t d, m, s;
};

FastDiv fast_div(int64_t d)
{
    FastDiv f;
    f.d = d < 1 ? 1u : (uint32_t)d;
    f.s = 0;
    while (f.s < 31 && (1u << f.s) < f.d)
        f.s++;
    f.m = (uint32_t)((((uint64_t)1 << 32) * (((uint64_t)1 << f.s) - f.d)) / f.d + 1);
    return f;
}

__device__ __forceinline__ uint32_t fdiv(uint32_t n, const FastDiv &f)
{
    return (__umulhi(n, f.m) + n) >> f.s;
}

constexpr int64_t IDX_LIMIT = (int64_t)1 << 31; /* fdiv's range */

/* row_offsets for r < 2^31 with the outer sizes as fast dividers (d1 = n1,
 * d2 = n2); every operand slot, unused ones (stride 0) give 0. */
__device__ __forceinline__ void row_offsets_fast(const Rows &L, const FastDiv &d1,
                                                 const FastDiv &d2, uint32_t r, int64_t *off)
{
    uint32_t i0 = r, i1 = 0, i2 = 0;
    if (L.n1 != 1 || L.n2 != 1) { /* uniform */
        const uint32_t q2 = fdiv(r, d2);
        i2 = r - q2 * d2.d;
        const uint32_t q1 = fdiv(q2, d1);
        i1 = q2 - q1 * d1.d;
        i0 = q1;
    }
#pragma unroll
    for (int k = 0; k < MAXT; k++)
        off[k] = (int64_t)i0 * L.st[k][0] + (int64_t)i1 * L.st[k][1] + (int64_t)i2 * L.st[k][2];
}

/* ---- embed ---- */

struct EmbedArgs {
    const uint16_t *table;
    const uint32_t *ids;
    uint16_t *out;
    int64_t n, H, ts, os;
    int vec;
};

/* A bit copy: table rows are already bf16. */
__global__ void embed_kernel(EmbedArgs p)
{
    const int64_t units = p.vec ? cdiv(p.H, VEC) : p.H;
    ROW_LOOP(i, p.n)
    {
        const uint16_t *src = p.table + (int64_t)p.ids[i] * p.ts;
        uint16_t *dst = p.out + i * p.os;
        UNIT_LOOP(u, units)
        {
            int64_t c = p.vec ? u * VEC : u;
            if (p.vec && c + VEC <= p.H) {
                *reinterpret_cast<uint4 *>(dst + c) = *reinterpret_cast<const uint4 *>(src + c);
                continue;
            }
            for (int64_t e = c; e < p.H && e < c + (p.vec ? VEC : 1); e++)
                dst[e] = src[e];
        }
    }
}

/* ---- elementwise ---- */

enum { EW_ADD, EW_SWIGLU, EW_SIGMOID, EW_SILU };

/* Operand slots of the layout: 0 = a, 1 = out, 2 = b (binary ops). */
struct EwArgs {
    Rows L;
    const uint16_t *a, *b;
    uint16_t *out;
    int op, vec;
};

__device__ __forceinline__ float ew_math(int op, float a, float b)
{
    switch (op) {
    case EW_ADD:
        return a + b;
    case EW_SWIGLU:
        return silu_f(a) * b;
    case EW_SIGMOID:
        return sigmoid_f(a);
    default:
        return silu_f(a);
    }
}

/* out may be exactly a or b: each element is read and written by one
 * thread, reads first. */
__global__ void ew_kernel(EwArgs p)
{
    const int64_t cols = p.L.cols, units = p.vec ? cdiv(cols, VEC) : cols;
    const int nt = p.b ? 3 : 2;
    ROW_LOOP(r, p.L.rows)
    {
        int64_t off[MAXT];
        row_offsets(p.L, r, nt, off);
        const uint16_t *a = p.a + off[0], *b = p.b ? p.b + off[2] : nullptr;
        uint16_t *o = p.out + off[1];
        UNIT_LOOP(u, units)
        {
            int64_t c = p.vec ? u * VEC : u;
            if (p.vec && c + VEC <= cols) {
                float fa[VEC], fb[VEC];
                load8(a + c, fa);
                if (b)
                    load8(b + c, fb);
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    fa[j] = ew_math(p.op, fa[j], b ? fb[j] : 0.0f);
                store8(o + c, fa);
                continue;
            }
            for (int64_t e = c; e < cols && e < c + (p.vec ? VEC : 1); e++)
                o[e] = f2bf(ew_math(p.op, bf2f(a[e]), b ? bf2f(b[e]) : 0.0f));
        }
    }
}

/* The vector path (every row start 16-byte aligned, cols % 8 == 0, fewer
 * than 2^31 vectors): the tensor is a flat list of rows * cols / 8 vectors,
 * consecutive threads on consecutive vectors (a row change mid-warp just
 * starts a new segment). A thread takes EW_U vectors NT apart and issues all
 * their loads before any math or store, so each has 2 * EW_U 16-byte loads
 * in flight; row and column come from one fast division per vector.
 * Aliasing as ew_kernel: out may be exactly a or b, and each element is
 * loaded and stored by the same thread, the load first. */
constexpr int EW_U = 4;

struct EwVecArgs {
    Rows L;
    FastDiv d1, d2, dv; /* n1, n2, vectors per row */
    const uint16_t *a, *b;
    uint16_t *out;
    uint32_t n; /* vectors in all */
};

template <int OP>
__global__ void __launch_bounds__(NT) ew_vec_kernel(EwVecArgs p)
{
    constexpr bool BIN = OP == EW_ADD || OP == EW_SWIGLU;
    const uint32_t base = blockIdx.x * (uint32_t)(NT * EW_U) + threadIdx.x;
    uint4 ra[EW_U], rb[EW_U];
    int64_t oo[EW_U];
#pragma unroll
    for (int i = 0; i < EW_U; i++) {
        ra[i] = rb[i] = make_uint4(0, 0, 0, 0);
        oo[i] = 0;
        const uint32_t idx = base + (uint32_t)(i * NT);
        if (idx >= p.n)
            continue;
        const uint32_t r = fdiv(idx, p.dv);
        const int64_t c = (int64_t)(idx - r * p.dv.d) * VEC;
        int64_t off[MAXT];
        row_offsets_fast(p.L, p.d1, p.d2, r, off);
        ra[i] = ld16(p.a + off[0] + c);
        if (BIN)
            rb[i] = ld16(p.b + off[2] + c);
        oo[i] = off[1] + c;
    }
#pragma unroll
    for (int i = 0; i < EW_U; i++) {
        if (base + (uint32_t)(i * NT) >= p.n)
            continue;
        float fa[VEC], fb[VEC];
        unpack8(ra[i], fa);
        if (BIN)
            unpack8(rb[i], fb);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            fa[j] = ew_math(OP, fa[j], BIN ? fb[j] : 0.0f);
        store8(p.out + oo[i], fa);
    }
}

/* ---- row norms ---- */

/* Operand slots: 0 = x, 1 = y, 2 = z (gated). w is a contiguous [D] weight
 * (NULL for l2norm). */
struct NormArgs {
    Rows L;
    const uint16_t *x, *z, *w;
    uint16_t *y;
    float eps, scale;
    int mode, vec;
};

/* The sum over a row's TPR threads, in every one of them. */
template <int TPR>
__device__ __forceinline__ float row_sum(float v, float *red)
{
    static_assert(TPR % 32 == 0 && TPR <= NT, "a row is whole warps of one block");
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    if (TPR == 32)
        return v;
    if (threadIdx.x % 32 == 0)
        red[threadIdx.x / 32] = v;
    __syncthreads();
    float t = 0.0f;
#pragma unroll
    for (int i = 0; i < TPR / 32; i++)
        t += red[i];
    __syncthreads(); /* red is rewritten for the next row */
    return t;
}

/* The CPU's per-element formulas, same order. */
__device__ __forceinline__ float norm_out(int mode, float x, float inv, float w, float z,
                                          float scale)
{
    switch (mode) {
    case NORM_RMS:
        return rms_out(x, inv, w);
    case NORM_RMS_P1:
        return (1.0f + w) * (x * inv);
    case NORM_GATED:
        return w * (x * inv) * silu_f(z);
    default:
        return (x * inv) * scale;
    }
}

__device__ float norm_sumsq(const NormArgs &p, const uint16_t *x, int lane, int tpr)
{
    const int64_t D = p.L.cols, nv = p.vec ? D / VEC : 0;
    float ss = 0.0f;
    for (int64_t v = lane; v < nv; v += tpr) {
        float f[VEC];
        load8(x + v * VEC, f);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            ss += f[j] * f[j];
    }
    for (int64_t i = nv * VEC + lane; i < D; i += tpr) {
        float f = bf2f(x[i]);
        ss += f * f;
    }
    return ss;
}

/* y may be x: every element is read before it is written, by one thread,
 * and the row sum (a warp/block barrier) separates the two passes. */
__device__ void norm_write(const NormArgs &p, const uint16_t *x, const uint16_t *z, uint16_t *y,
                           float inv, int lane, int tpr)
{
    const int64_t D = p.L.cols, nv = p.vec ? D / VEC : 0;
    for (int64_t v = lane; v < nv; v += tpr) {
        float f[VEC], w[VEC], g[VEC];
        load8(x + v * VEC, f);
        if (p.w)
            load8(p.w + v * VEC, w);
        if (z)
            load8(z + v * VEC, g);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            f[j] = norm_out(p.mode, f[j], inv, p.w ? w[j] : 0.0f, z ? g[j] : 0.0f, p.scale);
        store8(y + v * VEC, f);
    }
    for (int64_t i = nv * VEC + lane; i < D; i += tpr)
        y[i] = f2bf(norm_out(p.mode, bf2f(x[i]), inv, p.w ? bf2f(p.w[i]) : 0.0f,
                             z ? bf2f(z[i]) : 0.0f, p.scale));
}

/* TPR threads per row (32: a warp; NT: the block), NT / TPR rows per block. */
template <int TPR>
__global__ void __launch_bounds__(NT) norm_kernel(NormArgs p)
{
    constexpr int RPB = NT / TPR;
    __shared__ float red[NT / 32];
    const int lane = (int)threadIdx.x % TPR, sub = (int)threadIdx.x / TPR;
    /* r is uniform over a row's threads, so the barriers in row_sum are too. */
    for (int64_t r = (int64_t)blockIdx.x * RPB + sub; r < p.L.rows;
         r += (int64_t)gridDim.x * RPB) {
        int64_t off[MAXT];
        row_offsets(p.L, r, p.z ? 3 : 2, off);
        const uint16_t *x = p.x + off[0], *z = p.z ? p.z + off[2] : nullptr;
        float ss = row_sum<TPR>(norm_sumsq(p, x, lane, TPR), red);
        /* HF: rsqrt(mean(x^2) + eps) for RMSNorm, rsqrt(sum(x^2) + eps) for
         * l2norm, both as 1 / sqrt() like the CPU. */
        float inv = p.mode == NORM_L2 ? 1.0f / sqrtf(ss + p.eps)
                                         : 1.0f / sqrtf(ss / (float)p.L.cols + p.eps);
        norm_write(p, x, z, p.y + off[1], inv, lane, TPR);
    }
}

/* The vector path of the norms (every row start and w 16-byte aligned,
 * D % 8 == 0, D <= 8192, fewer than 2^31 rows). A row is TPR threads: a
 * sub-warp group (TPR <= 32, several rows per warp, reduced by xor
 * shuffles inside the group) or TPR / 32 whole warps (reduced through
 * shared memory); lane l holds the row's vectors l, l + TPR, ... (NV of
 * them, coalesced across the group). Each group takes RPT rows. All loads
 * (x, z, w) are issued first and x stays in registers, so every element is
 * read once; the stores follow the row sum, so y may be exactly x. One
 * block is NT / TPR * RPT whole rows: no grid-stride loop, and every thread
 * reaches the shuffles and the barrier (rows past the end compute on zeros
 * and store nothing). */
#ifndef NORMV_MINB
#define NORMV_MINB 4 /* sub-warp rows: 4 blocks of NT per SM (<= 64 registers), gated 3 */
#endif

struct NormVArgs {
    Rows L;
    FastDiv d1, d2;
    const uint16_t *x, *z, *w;
    uint16_t *y;
    float eps, scale;
    int mode, nvec;
    uint32_t rows;
    /* the FP8 variant (normv_kernel's Q8; 2-D, plain RMSNorm): y where not NULL; the E4M3
     * codes of y's 1 x 128 blocks (fp8_codes.cu's mode 0 with n_out = rows, kp = the row's
     * length: codes [rows, kp], sc[kb * rows + r]) where codes is not NULL; the rows' 1 / rms
     * into inv where not NULL */
    uint8_t *codes;
    float *sc, *inv;
    int64_t kp;
};

template <int MODE, int NV, int RPT>
__device__ __forceinline__ void normv_write(const NormVArgs &p, const uint4 (&xr)[RPT][NV],
                                            const uint4 (&zr)[RPT][NV], const uint4 (&wr)[NV],
                                            const int64_t (&yo)[RPT], const bool (&ok)[RPT],
                                            const float (&inv)[RPT], int lane, int tpr)
{
#pragma unroll
    for (int j = 0; j < RPT; j++) {
        if (!ok[j])
            continue;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int v = lane + i * tpr;
            if (v >= p.nvec)
                continue;
            float f[VEC], w[VEC], g[VEC];
            unpack8(xr[j][i], f);
            unpack8(wr[i], w);
            unpack8(zr[j][i], g);
#pragma unroll
            for (int e = 0; e < VEC; e++)
                f[e] = norm_out(MODE, f[e], inv[j], w[e], g[e], p.scale);
            store8(p.y + yo[j] + (int64_t)v * VEC, f);
        }
    }
}

/* normv_write for the FP8 variant: y's BF16 values as normv_write rounds them, stored where
 * p.y is set; from those values the codes of each 1 x 128 block (16 lanes of one vector index
 * i: TPR a multiple of 16, nvec of 16) with fp8_codes.cu's rounding (e4m3.cuh), so they are the
 * bytes its mode 0 writes from y. Every lane reaches the shuffles (rows past the end and
 * vectors past nvec compute on zeros and store nothing). */
template <int NV, int RPT>
__device__ __forceinline__ void normv_write_q8(const NormVArgs &p, const uint4 (&xr)[RPT][NV],
                                               const uint4 (&wr)[NV], const int64_t (&yo)[RPT],
                                               const uint32_t (&rr)[RPT], const bool (&ok)[RPT],
                                               const float (&inv)[RPT], int lane, int tpr)
{
#pragma unroll
    for (int j = 0; j < RPT; j++) {
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int v = lane + i * tpr;
            const bool live = ok[j] && v < p.nvec;
            float f[VEC], w[VEC];
            unpack8(xr[j][i], f);
            unpack8(wr[i], w);
#pragma unroll
            for (int e = 0; e < VEC; e++)
                f[e] = norm_out(NORM_RMS, f[e], inv[j], w[e], 0.0f, p.scale);
            const uint4 u = make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]),
                                       pack2(f[6], f[7]));
            if (live && p.y)
                *reinterpret_cast<uint4 *>(p.y + yo[j] + (int64_t)v * VEC) = u;
            if (p.codes) {
                const uint32_t mb = amax16_bits(u);
                if (live) {
                    float sc = codes8_store(u, mb, p.codes + (int64_t)rr[j] * p.kp + (int64_t)v * VEC);
                    if ((lane & 15) == 0)
                        p.sc[(int64_t)(v / 16) * p.rows + rr[j]] = sc;
                }
            }
        }
        if (p.inv && lane == 0 && ok[j])
            p.inv[rr[j]] = inv[j];
    }
}

template <int MODE, int TPR, int NV, int RPT, bool Q8 = false>
__global__ void __launch_bounds__(NT, TPR > 32 ? 1 : MODE == NORM_GATED ? NORMV_MINB - 1 : NORMV_MINB)
    normv_kernel(NormVArgs p)
{
    static_assert(!Q8 || (MODE == NORM_RMS && TPR % 16 == 0), "the FP8 variant: RMSNorm, 16-lane blocks");
    static_assert(NT % TPR == 0 && (TPR <= 32 || TPR % 32 == 0), "rows of whole groups");
    static_assert(TPR <= 32 || RPT == 1, "block rows: one row per group");
    constexpr int G = NT / TPR; /* row groups per block */
    __shared__ float red[TPR > 32 ? NT / 32 : 1];
    const int lane = (int)threadIdx.x % TPR, grp = (int)threadIdx.x / TPR;
    constexpr bool gated = MODE == NORM_GATED, has_w = MODE != NORM_L2;
    uint4 xr[RPT][NV], zr[RPT][NV], wr[NV];
    int64_t yo[RPT];
    uint32_t rr[RPT];
    bool ok[RPT];
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int v = lane + i * TPR;
        wr[i] = make_uint4(0, 0, 0, 0);
        if (has_w && v < p.nvec)
            wr[i] = ld16(p.w + (int64_t)v * VEC);
    }
#pragma unroll
    for (int j = 0; j < RPT; j++) {
        const uint32_t r = blockIdx.x * (uint32_t)(G * RPT) + (uint32_t)(j * G + grp);
        ok[j] = r < p.rows;
        rr[j] = r;
        int64_t off[MAXT] = {0, 0, 0};
        if (ok[j])
            row_offsets_fast(p.L, p.d1, p.d2, r, off);
        yo[j] = off[1];
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int v = lane + i * TPR;
            xr[j][i] = zr[j][i] = make_uint4(0, 0, 0, 0);
            if (!ok[j] || v >= p.nvec)
                continue;
            xr[j][i] = ld16(p.x + off[0] + (int64_t)v * VEC);
            if (gated)
                zr[j][i] = ld16(p.z + off[2] + (int64_t)v * VEC);
        }
    }
    float ss[RPT];
#pragma unroll
    for (int j = 0; j < RPT; j++) {
        ss[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            float f[VEC];
            unpack8(xr[j][i], f); /* zeros where nothing was loaded */
#pragma unroll
            for (int e = 0; e < VEC; e++)
                ss[j] += f[e] * f[e];
        }
    }
    if (TPR <= 32) {
#pragma unroll
        for (int j = 0; j < RPT; j++)
#pragma unroll
            for (int o = TPR / 2; o > 0; o >>= 1)
                ss[j] += __shfl_xor_sync(0xffffffffu, ss[j], o);
    } else {
        const int warp = (int)threadIdx.x / 32;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            ss[0] += __shfl_xor_sync(0xffffffffu, ss[0], o);
        if (threadIdx.x % 32 == 0)
            red[warp] = ss[0];
        __syncthreads();
        float t = 0.0f;
#pragma unroll
        for (int w = 0; w < (TPR > 32 ? TPR / 32 : 1); w++)
            t += red[grp * (TPR / 32) + w];
        ss[0] = t;
    }
    float inv[RPT];
#pragma unroll
    for (int j = 0; j < RPT; j++)
        /* as norm_kernel: 1 / sqrt(), mean for RMSNorm, sum for l2norm */
        inv[j] = MODE == NORM_L2 ? 1.0f / sqrtf(ss[j] + p.eps)
                                 : 1.0f / sqrtf(ss[j] / (float)p.L.cols + p.eps);
    if constexpr (Q8)
        normv_write_q8<NV, RPT>(p, xr, wr, yo, rr, ok, inv, lane, TPR);
    else
        normv_write<MODE, NV, RPT>(p, xr, zr, wr, yo, ok, inv, lane, TPR);
}

/* ---- host side ---- */

int ew_run(df_backend *be, const df_tensor *a, const df_tensor *b, df_tensor *out, int op)
{
    if (df_tensor_numel(out) == 0)
        return 0;
    const df_tensor *t[MAXT] = {a, out, b};
    EwArgs p;
    p.L = rows_of(t, b ? 3 : 2, 1);
    p.a = (const uint16_t *)a->data;
    p.b = b ? (const uint16_t *)b->data : nullptr;
    p.out = (uint16_t *)out->data;
    p.op = op;
    const void *ptrs[3] = {p.a, p.b, p.out};
    p.vec = rows_vec_ok(p.L, ptrs, 3, b ? 3 : 2);
    cudaStream_t st = df_cuda_stream(be);
    const int64_t vpr = p.L.cols / VEC;
    if (p.vec && p.L.cols % VEC == 0 && p.L.rows * vpr < IDX_LIMIT) {
        EwVecArgs q;
        q.L = p.L;
        q.d1 = fast_div(p.L.n1);
        q.d2 = fast_div(p.L.n2);
        q.dv = fast_div(vpr);
        q.a = p.a;
        q.b = p.b;
        q.out = p.out;
        q.n = (uint32_t)(p.L.rows * vpr);
        const unsigned blocks = (unsigned)cdiv(q.n, NT * EW_U);
        switch (op) {
        case EW_ADD:
            ew_vec_kernel<EW_ADD><<<blocks, NT, 0, st>>>(q);
            break;
        case EW_SWIGLU:
            ew_vec_kernel<EW_SWIGLU><<<blocks, NT, 0, st>>>(q);
            break;
        case EW_SIGMOID:
            ew_vec_kernel<EW_SIGMOID><<<blocks, NT, 0, st>>>(q);
            break;
        default:
            ew_vec_kernel<EW_SILU><<<blocks, NT, 0, st>>>(q);
            break;
        }
        return df_cuda_check_launch("elementwise kernel");
    }
    Launch l = rows_launch(p.L.rows, p.vec ? cdiv(p.L.cols, VEC) : p.L.cols);
    ew_kernel<<<l.grid, l.block, 0, st>>>(p);
    return df_cuda_check_launch("elementwise kernel");
}

/* Q8: the FP8 variant (plain RMSNorm), for shapes whose lanes per row are a multiple of 16
 * (normv_run_q8 says which) */
template <int TPR, int NV, int RPT, bool Q8>
void normv_launch(const NormVArgs &q, cudaStream_t st)
{
    const unsigned blocks = (unsigned)cdiv(q.rows, NT / TPR * RPT);
    if constexpr (Q8) {
        if constexpr (TPR % 16 == 0)
            normv_kernel<NORM_RMS, TPR, NV, RPT, true><<<blocks, NT, 0, st>>>(q);
        return;
    }
    switch (q.mode) {
    case NORM_RMS:
        normv_kernel<NORM_RMS, TPR, NV, RPT><<<blocks, NT, 0, st>>>(q);
        break;
    case NORM_RMS_P1:
        normv_kernel<NORM_RMS_P1, TPR, NV, RPT><<<blocks, NT, 0, st>>>(q);
        break;
    case NORM_GATED:
        normv_kernel<NORM_GATED, TPR, NV, RPT><<<blocks, NT, 0, st>>>(q);
        break;
    default:
        normv_kernel<NORM_L2, TPR, NV, RPT><<<blocks, NT, 0, st>>>(q);
        break;
    }
}

/* The vector norm kernel's shape for rows of nvec 16-byte vectors (<= 1024):
 * lanes per row x vectors per lane >= nvec, ~2-4 vectors of x per thread. */
template <bool Q8 = false> void normv_run(const NormVArgs &q, cudaStream_t st)
{
    const int nv = q.nvec;
    if (nv <= 4)
        normv_launch<4, 1, 4, Q8>(q, st);
    else if (nv <= 8)
        normv_launch<8, 1, 4, Q8>(q, st);
    else if (nv <= 16) /* D = 128: 8 lanes x 2 vectors, 8 rows per warp */
        normv_launch<8, 2, 2, Q8>(q, st);
    else if (nv <= 32) /* D = 256 */
        normv_launch<16, 2, 2, Q8>(q, st);
    else if (nv <= 64)
        normv_launch<32, 2, 2, Q8>(q, st);
    else if (nv <= 128)
        normv_launch<32, 4, 1, Q8>(q, st);
    else /* 128 threads per row, two rows per block; D = 5120: 5 vectors each */
        switch ((nv + 127) / 128) {
        case 2:
            normv_launch<128, 2, 1, Q8>(q, st);
            break;
        case 3:
            normv_launch<128, 3, 1, Q8>(q, st);
            break;
        case 4:
            normv_launch<128, 4, 1, Q8>(q, st);
            break;
        case 5:
            normv_launch<128, 5, 1, Q8>(q, st);
            break;
        case 6:
            normv_launch<128, 6, 1, Q8>(q, st);
            break;
        case 7:
            normv_launch<128, 7, 1, Q8>(q, st);
            break;
        default:
            normv_launch<128, 8, 1, Q8>(q, st);
            break;
        }
}

/* normv_run's FP8 variant, for the shapes whose lanes per row are a multiple of 16 (nvec 32 and
 * up, a multiple of 16): 1, or 0 for a shape it does not take */
int normv_run_q8(const NormVArgs &q, cudaStream_t st)
{
    if (q.nvec <= 16 || q.nvec % 16)
        return 0;
    normv_run<true>(q, st);
    return 1;
}

} /* namespace */

int df_cuda_rmsnorm_q8_rows(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                            df_tensor *y, float *inv, uint8_t *codes, float *sc)
{
    const int64_t R = x->shape[0], D = x->shape[1];
    const df_tensor *t[MAXT] = {x, y ? y : x};
    NormVArgs q;
    memset(&q, 0, sizeof q);
    q.L = rows_of(t, 2, 0);
    q.x = (const uint16_t *)x->data;
    q.w = (const uint16_t *)w->data;
    q.y = y ? (uint16_t *)y->data : nullptr;
    const void *ptrs[3] = {q.x, q.y ? (const void *)q.y : (const void *)q.x, q.w};
    /* 2-D rows of whole 128-blocks, 16-byte aligned, as normv_run takes them */
    if (x->ndim != 2 || (y && y->ndim != 2) || D % 128 || D / VEC > 1024 || R >= IDX_LIMIT ||
        q.L.rows != R || q.L.cols != D || !rows_vec_ok(q.L, ptrs, 3, 2) ||
        x->dtype != DF_DTYPE_BF16 || w->dtype != DF_DTYPE_BF16)
        return 0;
    q.d1 = fast_div(q.L.n1);
    q.d2 = fast_div(q.L.n2);
    q.eps = eps;
    q.scale = 1.0f;
    q.mode = NORM_RMS;
    q.nvec = (int)(D / VEC);
    q.rows = (uint32_t)R;
    q.codes = codes, q.sc = sc, q.inv = inv, q.kp = D;
    if (!normv_run_q8(q, df_cuda_stream(be)))
        return 0;
    return df_cuda_check_launch("rmsnorm fp8 rows kernel") ? -EIO : 1;
}

static int norm_rows(df_backend *be, int mode, const df_tensor *x, const df_tensor *z,
                     const df_tensor *w, float eps, float scale, df_tensor *y)
{
    if (df_tensor_numel(x) == 0)
        return 0;
    const df_tensor *t[MAXT] = {x, y, z};
    const int nt = z ? 3 : 2;
    NormArgs p;
    p.L = rows_of(t, nt, 0);
    p.x = (const uint16_t *)x->data;
    p.y = (uint16_t *)y->data;
    p.z = z ? (const uint16_t *)z->data : nullptr;
    p.w = w ? (const uint16_t *)w->data : nullptr;
    p.eps = eps;
    p.scale = scale;
    p.mode = mode;
    const void *ptrs[4] = {p.x, p.y, p.z, p.w};
    p.vec = rows_vec_ok(p.L, ptrs, 4, nt);
    cudaStream_t st = df_cuda_stream(be);
    if (p.vec && p.L.cols % VEC == 0 && p.L.cols / VEC <= 1024 && p.L.rows < IDX_LIMIT) {
        NormVArgs q;
        q.L = p.L;
        q.d1 = fast_div(p.L.n1);
        q.d2 = fast_div(p.L.n2);
        q.x = p.x;
        q.z = p.z;
        q.w = p.w;
        q.y = p.y;
        q.eps = eps;
        q.scale = scale;
        q.mode = mode;
        q.nvec = (int)(p.L.cols / VEC);
        q.rows = (uint32_t)p.L.rows;
        normv_run(q, st);
        return df_cuda_check_launch("norm kernel");
    }
    if (p.L.cols <= 1024) {
        norm_kernel<32><<<capped(cdiv(p.L.rows, NT / 32)), NT, 0, st>>>(p);
    } else {
        norm_kernel<NT><<<capped(p.L.rows), NT, 0, st>>>(p);
    }
    return df_cuda_check_launch("norm kernel");
}

int df_cuda_embed(df_backend *be, const df_tensor *table, const uint32_t *ids, int64_t n,
                  df_tensor *out)
{
    if (n == 0 || out->shape[1] == 0)
        return 0;
    /* ids < V <= INT64 were checked; the bits are staged as int32 and read
     * back as uint32. */
    const int32_t *dids = df_cuda_stage_i32(be, (const int32_t *)ids, n);
    if (!dids)
        return -EIO;
    EmbedArgs p;
    p.table = (const uint16_t *)table->data;
    p.ids = (const uint32_t *)dids;
    p.out = (uint16_t *)out->data;
    p.n = n;
    p.H = out->shape[1];
    p.ts = table->stride[0];
    p.os = out->stride[0];
    p.vec = !((uintptr_t)p.table & 15u) && !((uintptr_t)p.out & 15u) && p.ts % VEC == 0 &&
            p.os % VEC == 0;
    Launch l = rows_launch(n, p.vec ? cdiv(p.H, VEC) : p.H);
    embed_kernel<<<l.grid, l.block, 0, df_cuda_stream(be)>>>(p);
    return df_cuda_check_launch("embed kernel");
}

int df_cuda_l2norm_rows(df_backend *be, df_tensor *x, float eps, float scale)
{
    return norm_rows(be, NORM_L2, x, NULL, NULL, eps, scale, x);
}

int df_cuda_add(df_backend *be, const df_tensor *x, df_tensor *y)
{
    return ew_run(be, x, y, y, EW_ADD);
}

int df_cuda_rmsnorm(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                    int plus_one, df_tensor *y)
{
    return norm_rows(be, plus_one ? NORM_RMS_P1 : NORM_RMS, x, NULL, w, eps, 1.0f,
                             y);
}

int df_cuda_rmsnorm_gated(df_backend *be, const df_tensor *x, const df_tensor *z,
                          const df_tensor *w, float eps, df_tensor *y)
{
    return norm_rows(be, NORM_GATED, x, z, w, eps, 1.0f, y);
}


int df_cuda_swiglu(df_backend *be, const df_tensor *gate, const df_tensor *up, df_tensor *out)
{
    return ew_run(be, gate, up, out, EW_SWIGLU);
}

int df_cuda_sigmoid(df_backend *be, const df_tensor *x, df_tensor *out)
{
    return ew_run(be, x, NULL, out, EW_SIGMOID);
}

int df_cuda_silu(df_backend *be, const df_tensor *x, df_tensor *out)
{
    return ew_run(be, x, NULL, out, EW_SILU);
}
