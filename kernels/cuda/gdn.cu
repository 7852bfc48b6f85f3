/* gdn.cu - the gated delta rule prefill (df_op_gdn) on the GPU: the chunked
 * algorithm of TARGETS.md, chunk C = 64, chunks never cross a sequence bound
 * (the last chunk of a sequence may be short).
 *
 * Both df_gdn_mode values run this chunked algorithm: the mode only selects
 * between two CPU reference formulations (token-recurrent oracle, chunked),
 * which are the same math up to rounding. The GPU result is checked against
 * the CPU recurrent oracle (tests/test_gpu_gdn.c).
 *
 * Per chunk (Gamma = in-chunk cumsum of g, D_x = diag(x)):
 *   A_ij = beta_i (k_i.k_j) e^{Gamma_i - Gamma_j} (i > j),  T = (I + A)^-1
 *   V_new = T D_beta (V - D_{e^Gamma} K S)          (= U - W S of TARGETS.md)
 *   O     = D_{e^Gamma} Q S + M V_new,  M = (Q K^T) o e^{Gamma_i - Gamma_j} (i >= j)
 *   S     = e^{Gamma_last} S + K^T D_{e^{Gamma_last - Gamma}} V_new
 * W = T D_{beta e^Gamma} K and U = T D_beta V are never formed: the state pass
 * multiplies by T itself (a 64x64 triangular product), so kernel 1 writes
 * only T, M (packed lower-triangular 8x8 tiles) and four per-token
 * coefficients: 19 KB per (chunk, head) instead of 80 KB.
 *
 * Two kernels, both on the backend's stream:
 *
 * 1. gdn_chunk_prep, grid (chunk, value head), 256 threads, fully parallel:
 *    K K^T and Q K^T on tensor cores (TF32, exact for bf16 inputs), A, T by
 *    block forward substitution (16x16 blocks, fp32 FMA), M; writes T, M
 *    rounded to TF32 and the coefficients e^Gamma, beta, e^{Gamma_L - Gamma},
 *    e^{Gamma_L}.
 * 2. gdn_state_pass, one CTA per (sequence, value head, 64 value columns),
 *    4 warps. Each warp owns 16 value columns for the whole sequence and
 *    keeps S^T [16 x dk] (fp32) in mma accumulators; it never exchanges
 *    data with another warp, so a chunk has one CTA barrier (the shared
 *    input ring). Everything is computed transposed (value columns = mma
 *    rows), which lets an accumulator fragment be the A operand of the next
 *    product without a shared-memory round trip:
 *      Y^T  = S^T K^T, P^T = S^T Q^T      bf16 m16n8k16, S split hi + lo
 *      X^T  = (V^T - Y^T D_eG) D_beta     registers
 *      Vn^T = X^T T^T                     TF32 m16n8k8 (triangular, 36 mma)
 *      O^T  = P^T D_eG + Vn^T M^T         TF32 m16n8k8 (triangular)
 *      S^T  = e^{G_L} S^T + (Vn^T D_L) K  bf16 m16n8k16, Vn D_L split hi + lo
 *    K, Q, V are bf16 in shared memory as read from the input (ldmatrix,
 *    .trans for the K of the update and for V), T and M fp32. The inputs of
 *    chunk c+2 (3-stage ring, 2 where the shared-memory opt-in is < 200 KB)
 *    are fetched with cp.async while chunk c runs; with one stage (opt-in
 *    < 136 KB: sm_86 / sm_89 / sm_120) after it.
 *    Per warp and chunk (dk = 128): 256 + 128 bf16 mma + 72 TF32 mma, no
 *    barrier other than the ring's; Qwen3.5-27B (hv = 48, dv = 128): 96 CTAs
 *    of 4 warps, one warp per SM sub-partition.
 *
 * Precision: the state is fp32 and only enters products split into two
 * bf16 halves (hi = bf16(x), lo = bf16(x - hi): ~16 mantissa bits, better
 * than TF32), against K and Q, which are exact in bf16. V_new D_L enters the
 * state update the same way. X and V_new enter the triangular products
 * rounded to TF32 (cvt.rna) against T, M stored as TF32 - the precision of
 * the former W = T (..K) and U = T (beta V) products. The output is rounded
 * to bf16 once.
 *
 * Scratch (df_cuda_scratch), per (chunk c, value head h), ch = c * hv + h,
 * fp32: T [ch][36][8][8], M [ch][36][8][8] (tile (i, j), j <= i, at
 * i (i + 1) / 2 + j), C [ch][4][64] (e^Gamma, beta (0 beyond the chunk's
 * length), e^{Gamma_L - Gamma}, e^{Gamma_L}); padding rows have beta = 0,
 * so their T rows are unit rows and their V_new is zero. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "device.h"

#define GC 64     /* chunk length */
#define NTHR 256  /* threads per CTA of kernel 1 (8 warps) */
#define PTHR 128  /* threads per CTA of the state pass (4 warps) */
#define PC 64     /* value columns per state-pass CTA (16 per warp) */
#define TRI (36 * 64) /* floats of a packed lower-triangular [64][64] (36 tiles of 8x8) */
#define LDA 68    /* row stride (floats) of the [64][64] shared matrices: 68 = 4 mod 32, conflict-free fragments */

/* ---- small device helpers ---- */

__device__ __forceinline__ float bf2f(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

/* Round to nearest even, NaN kept NaN. */
__device__ __forceinline__ uint16_t f2bf(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* fp32 -> TF32 (round to nearest, ties away), as the 32-bit pattern mma reads. */
__device__ __forceinline__ uint32_t tf32(float f)
{
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
    return r;
}
__device__ __forceinline__ float tf32f(float f) { return __uint_as_float(tf32(f)); }
/* A float already holding a TF32 value (or a bf16 value), as mma reads it. */
__device__ __forceinline__ uint32_t fbits(float f) { return __float_as_uint(f); }

/* c += a * b, m16n8k8, a row-major [16 x 8], b col-major [8 x 8], TF32 in, fp32 accumulate.
 * Fragments (g = lane / 4, t = lane % 4): a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4);
 * b0 (k=t, n=g), b1 (k=t+4, n=g); c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1). */
__device__ __forceinline__ void mma_tf32(float c[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* 16-byte async copy global -> shared; src_bytes 0 zero-fills (src must still be a valid address). */
__device__ __forceinline__ void cp16(void *smem, const void *gmem, int src_bytes)
{
    uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_wait()
{
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

/* c += a * b, m16n8k16, bf16 in, fp32 accumulate. a[0] (g, 2t..2t+1), a[1] (g+8, 2t..),
 * a[2] (g, 2t+8..), a[3] (g+8, 2t+8..); b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g); the lower
 * half of a register holds the lower column / k index. c as in mma_tf32. */
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Four 8x8 bf16 matrices from shared memory; lane l gives the address of row l % 8 of
 * matrix l / 8 (16 bytes, 16-byte aligned). r[m]: lane (g, t) gets matrix m's row g,
 * columns 2t, 2t+1 (low half = column 2t); .trans: column g, rows 2t, 2t+1. */
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const uint16_t *p)
{
    uint32_t s = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], const uint16_t *p)
{
    uint32_t s = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

/* (x0, x1) -> bf16x2 hi = (bf16(x0), bf16(x1)) and lo = the bf16 rounding of the
 * remainders; x0 in the lower half. hi + lo carries ~16 mantissa bits. */
__device__ __forceinline__ void split2(float x0, float x1, uint32_t &hi, uint32_t &lo)
{
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(x1), "f"(x0));
    const float r0 = x0 - __uint_as_float(hi << 16), r1 = x1 - __uint_as_float(hi & 0xffff0000u);
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(r1), "f"(r0));
}
__device__ __forceinline__ float bf_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

/* ---- kernel 1: per (chunk, value head) ---- */

struct prep_args {
    const uint16_t *q, *k; /* bf16 activations, row strides below (elements) */
    int64_t ldq, ldk;
    const float *g, *beta; /* [T, hv] f32 */
    int64_t ldg, ldb;
    const int32_t *chunks; /* [2 * n_chunks]: token start, length (1..64) */
    float *T, *M, *C;      /* scratch, layout at the top of the file */
    int hv, group;         /* group = hv / hk */
    int vec;               /* q, k rows 8-byte aligned: load 4 bf16 at a time */
};

template <int D> struct prep_dims {
    static constexpr int LD = D + 4; /* = 4 mod 32: conflict-free A-fragment and row-major B reads */
};

/* dst[r][0..D) = src row r (bf16 -> f32) for r < L, zeros for r in [L, 64). src points at
 * row 0's first column. */
template <int D>
__device__ __forceinline__ void load_rows(float *dst, int ldd, const uint16_t *src, int64_t lds,
                                          int L, int vec)
{
    constexpr int Q4 = D / 4;
    for (int idx = threadIdx.x; idx < GC * Q4; idx += NTHR) {
        int row = idx / Q4, c4 = (idx % Q4) * 4;
        float x0 = 0.f, x1 = 0.f, x2 = 0.f, x3 = 0.f;
        if (row < L) {
            const uint16_t *p = src + (int64_t)row * lds + c4;
            if (vec) {
                uint2 u = *(const uint2 *)p;
                x0 = __uint_as_float(u.x << 16), x1 = __uint_as_float(u.x & 0xffff0000u);
                x2 = __uint_as_float(u.y << 16), x3 = __uint_as_float(u.y & 0xffff0000u);
            } else {
                x0 = bf2f(p[0]), x1 = bf2f(p[1]), x2 = bf2f(p[2]), x3 = bf2f(p[3]);
            }
        }
        *(float4 *)&dst[row * ldd + c4] = make_float4(x0, x1, x2, x3);
    }
}

__device__ __forceinline__ int tri_idx(int i8, int j8) { return i8 * (i8 + 1) / 2 + j8; }

template <int DK>
__global__ void __launch_bounds__(NTHR, 2) gdn_chunk_prep(prep_args a)
{
    constexpr int KP = prep_dims<DK>::LD;
    extern __shared__ float4 smem_f4[];
    /* T and the inversion's block products take K's and Q's place once the
     * products of step 3 have read them (84 KB in all for dk = 128: the ~99 KB
     * parts, sm_86 / sm_89 / sm_120, run it too) */
    static_assert(GC * LDA <= GC * KP && 3 * 16 * 17 <= GC * KP, "T, Y in K's, Q's place");
    float *sK = (float *)smem_f4;  /* [64][KP]: K */
    float *sQ = sK + GC * KP;      /* [64][KP]: Q */
    float *sA = sQ + GC * KP;      /* [64][LDA]: A (strictly lower) */
    float *sT = sK;                /* [64][LDA]: (I + A)^-1, from step 4 on */
    float *sY = sQ;                /* [3][16][17]: block products of the inversion, step 5 */
    float *sG = sA + GC * LDA;     /* [64] Gamma */
    float *sE = sG + GC;           /* [64] e^Gamma */
    float *sB = sE + GC;           /* [64] beta (0 beyond L) */

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int c = blockIdx.x, h = blockIdx.y, kh = h / a.group;
    const int t0 = a.chunks[2 * c], L = a.chunks[2 * c + 1];
    const int64_t ch = (int64_t)c * a.hv + h;

    /* 1. Gamma (inclusive scan of g over the chunk; padding rows add 0 so they
     *    repeat Gamma_last), e^Gamma, beta. */
    if (warp == 0) {
        float x0 = lane < L ? a.g[(int64_t)(t0 + lane) * a.ldg + h] : 0.f;
        float x1 = lane + 32 < L ? a.g[(int64_t)(t0 + lane + 32) * a.ldg + h] : 0.f;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            float y0 = __shfl_up_sync(0xffffffffu, x0, o), y1 = __shfl_up_sync(0xffffffffu, x1, o);
            if (lane >= o)
                x0 += y0, x1 += y1;
        }
        x1 += __shfl_sync(0xffffffffu, x0, 31);
        sG[lane] = x0, sG[lane + 32] = x1;
        sE[lane] = expf(x0), sE[lane + 32] = expf(x1);
        sB[lane] = lane < L ? a.beta[(int64_t)(t0 + lane) * a.ldb + h] : 0.f;
        sB[lane + 32] = lane + 32 < L ? a.beta[(int64_t)(t0 + lane + 32) * a.ldb + h] : 0.f;
    }
    /* 2. K and Q rows of the chunk (zeros beyond L). */
    load_rows<DK>(sK, KP, a.k + (int64_t)t0 * a.ldk + (int64_t)kh * DK, a.ldk, L, a.vec);
    load_rows<DK>(sQ, KP, a.q + (int64_t)t0 * a.ldq + (int64_t)kh * DK, a.ldq, L, a.vec);
    __syncthreads();

    /* 3. K K^T (warps 0-3) -> A in shared memory, Q K^T (warps 4-7) -> M in scratch.
     *    Only tiles touching i >= j are computed; warp q4 takes n-tiles q4 and 7 - q4
     *    (5 needed tiles each, balanced). M keeps its 8x8 tiles (i8, j8 <= i8), packed. */
    {
        const int p = warp >> 2, q4 = warp & 3;
        const float *As = p ? sQ : sK;
        const int nt[2] = {q4, 7 - q4};
        float acc[4][2][4];
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int jj = 0; jj < 2; jj++)
                acc[r][jj][0] = acc[r][jj][1] = acc[r][jj][2] = acc[r][jj][3] = 0.f;
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const bool need0 = 8 * nt[0] <= 16 * r + 15, need1 = 8 * nt[1] <= 16 * r + 15;
            if (!need0) /* need1 implies need0 (nt[0] < nt[1]) */
                continue;
#pragma unroll 4
            for (int ks = 0; ks < DK / 8; ks++) {
                const int k0 = 8 * ks;
                const float *pa = As + (16 * r + g) * KP + k0 + t;
                uint32_t a0 = fbits(pa[0]), a1 = fbits(pa[8 * KP]);
                uint32_t a2 = fbits(pa[4]), a3 = fbits(pa[8 * KP + 4]);
#pragma unroll
                for (int jj = 0; jj < 2; jj++) {
                    if (jj == 1 && !need1)
                        continue;
                    const float *pb = sK + (8 * nt[jj] + g) * KP + k0 + t;
                    mma_tf32(acc[r][jj], a0, a1, a2, a3, fbits(pb[0]), fbits(pb[4]));
                }
            }
        }
        float *Mg = a.M + ch * TRI;
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int jj = 0; jj < 2; jj++) {
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int i = 16 * r + g + 8 * hh, j = 8 * nt[jj] + 2 * t;
                    const int i8 = 2 * r + hh, j8 = nt[jj];
                    float v0 = acc[r][jj][2 * hh], v1 = acc[r][jj][2 * hh + 1];
                    float o0, o1;
                    if (p == 0) { /* A: strictly lower; exp only of masked-in (<= 0) exponents */
                        o0 = i > j ? sB[i] * v0 * expf(sG[i] - sG[j]) : 0.f;
                        o1 = i > j + 1 ? sB[i] * v1 * expf(sG[i] - sG[j + 1]) : 0.f;
                        *(float2 *)&sA[i * LDA + j] = make_float2(o0, o1);
                    } else if (j8 <= i8) { /* M: lower incl. the diagonal, TF32 (an mma operand) */
                        o0 = i >= j ? tf32f(v0 * expf(sG[i] - sG[j])) : 0.f;
                        o1 = i >= j + 1 ? tf32f(v1 * expf(sG[i] - sG[j + 1])) : 0.f;
                        *(float2 *)&Mg[tri_idx(i8, j8) * 64 + g * 8 + 2 * t] = make_float2(o0, o1);
                    }
                }
            }
    }
    __syncthreads();

    /* 4. Diagonal 16x16 blocks of T = (I + A)^-1: lane j < 16 of warp I solves
     *    column j of block I by forward substitution, in registers (columns are
     *    independent: x_i = -sum_{j <= m < i} A_im x_m, x_j = 1). Meanwhile the
     *    other warps write the per-token coefficients. */
    if (warp < 4 && lane < 16) {
        const int I = warp, j = lane;
        const float *Ab = sA + (16 * I) * LDA + 16 * I;
        float x[16];
#pragma unroll
        for (int i = 0; i < 16; i++) {
            float s = 0.f;
#pragma unroll
            for (int m = 0; m < i; m++)
                s += Ab[i * LDA + m] * x[m];
            x[i] = i == j ? 1.f : (i > j ? -s : 0.f);
        }
#pragma unroll
        for (int i = 0; i < 16; i++)
            sT[(16 * I + i) * LDA + 16 * I + j] = x[i];
    } else if (warp >= 4 && tid - 128 < GC) {
        const int i = tid - 128;
        float *Cg = a.C + ch * (4 * GC);
        const float gl = sG[GC - 1]; /* Gamma_last (padding rows repeat it) */
        Cg[i] = sE[i];
        Cg[GC + i] = sB[i];
        Cg[2 * GC + i] = expf(gl - sG[i]);
        Cg[3 * GC + i] = expf(gl);
    }
    __syncthreads();

    /* 5. Off-diagonal blocks, by distance d = I - J: from (I + A) T = I,
     *    T_IJ = -T_II sum_{J <= K < I} A_IK T_KJ; blocks at distance < d are done. */
    for (int d = 1; d < 4; d++) {
        const int nb = 4 - d, r = tid >> 4, cc = tid & 15;
        for (int b = 0; b < nb; b++) {
            const int I = d + b, J = b;
            const float *ar = sA + (16 * I + r) * LDA;
            float s = 0.f;
            for (int kk = 16 * J; kk < 16 * I; kk++)
                s += ar[kk] * sT[kk * LDA + 16 * J + cc];
            sY[(b * 16 + r) * 17 + cc] = s;
        }
        __syncthreads();
        for (int b = 0; b < nb; b++) {
            const int I = d + b, J = b;
            const float *tr = sT + (16 * I + r) * LDA + 16 * I;
            float s = 0.f;
            for (int m = 0; m <= r; m++)
                s += tr[m] * sY[(b * 16 + m) * 17 + cc];
            sT[(16 * I + r) * LDA + 16 * J + cc] = -s;
        }
        __syncthreads();
    }

    /* 6. T, packed lower-triangular 8x8 tiles, rounded to TF32. */
    float *Tg = a.T + ch * TRI;
    for (int idx = tid; idx < TRI; idx += NTHR) {
        const int tile = idx >> 6, e = idx & 63;
        int i8 = 0;
        while (tri_idx(i8 + 1, 0) <= tile)
            i8++;
        const int j8 = tile - tri_idx(i8, 0);
        Tg[idx] = tf32f(sT[(8 * i8 + (e >> 3)) * LDA + 8 * j8 + (e & 7)]);
    }
}

template <int DK> constexpr size_t prep_smem_bytes()
{
    return sizeof(float) * ((size_t)2 * GC * prep_dims<DK>::LD + GC * LDA + 3 * GC);
}

/* ---- kernel 2: the sequential state pass ---- */

struct pass_args {
    const uint16_t *q, *k, *v;
    int64_t ldq, ldk, ldv;
    uint16_t *out;
    int64_t ldo;
    const float *T, *M, *C;     /* scratch from kernel 1 */
    const int32_t *chunks;      /* [2 * n_chunks]: token start, length */
    const int32_t *seqs;        /* [2 * n_items]: first chunk, chunk count (longest first) */
    int hv, group, nslices;     /* nslices = dv / PC */
    int nst;                    /* input ring stages: 1, 2 or 3 */
    int async16;                /* q, k, v rows 16-byte aligned: cp.async, else plain loads */
    int ovec;                   /* out rows 16-byte aligned: 16-byte stores */
};

/* One ring stage (bytes): K, Q [64][HP] bf16, V [64][VP] bf16 (the CTA's PC columns),
 * T, M [TRI] f32, C [4][64] f32. Then the per-warp output staging [4][64][OP] bf16. */
template <int DK> struct pass_dims {
    static constexpr int HP = DK + 8; /* bf16: 16-byte rows, HP / 2 = 4 mod 32 words (ldmatrix conflict-free) */
    static constexpr int VP = PC + 8; /* likewise */
    static constexpr int OP = 24;     /* output staging row (bf16): 16 columns + pad */
    static constexpr size_t oK = 0, oQ = oK + 2 * (size_t)GC * HP, oV = oQ + 2 * (size_t)GC * HP,
                            oT = oV + 2 * (size_t)GC * VP, oM = oT + 4 * (size_t)TRI,
                            oC = oM + 4 * (size_t)TRI, stage = oC + 4 * 4 * (size_t)GC;
    static constexpr size_t ostage = 2 * (size_t)(PTHR / 32) * GC * OP;
    static constexpr size_t bytes(int nst) { return (size_t)nst * stage + ostage; }
};

/* Rows 0..63 of a bf16 [., NCOL] slice into sh (row stride LD elements), zeros beyond L. */
template <int NCOL, int LD>
__device__ __forceinline__ void fetch_rows(uint16_t *sh, const uint16_t *src, int64_t lds, int L,
                                           int async16)
{
    constexpr int C8 = NCOL / 8;
    for (int idx = threadIdx.x; idx < GC * C8; idx += PTHR) {
        int row = idx / C8, c8 = (idx % C8) * 8;
        uint16_t *dst = sh + row * LD + c8;
        if (async16) {
            /* rows beyond L: zero-fill, reading nothing (src row 0 is a valid address) */
            cp16(dst, src + (row < L ? (int64_t)row * lds : 0) + c8, row < L ? 16 : 0);
        } else if (row < L) {
            const uint16_t *p = src + (int64_t)row * lds + c8;
#pragma unroll
            for (int e = 0; e < 8; e++)
                dst[e] = p[e];
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++)
                dst[e] = 0;
        }
    }
}

__device__ __forceinline__ void fetch_f32(float *dst, const float *src, int n)
{
    for (int idx = threadIdx.x; idx < n / 4; idx += PTHR)
        cp16(dst + 4 * idx, src + 4 * idx, 16);
}

template <int DK, int DV>
__global__ void __launch_bounds__(PTHR, 1) gdn_state_pass(pass_args a)
{
    typedef pass_dims<DK> PD;
    constexpr int HP = PD::HP, VP = PD::VP, OP = PD::OP;
    constexpr int NDT = DK / 8; /* d tiles of the state (8 columns of S^T each) */
    extern __shared__ float4 smem_f4[];
    unsigned char *smem = (unsigned char *)smem_f4;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int per = a.hv * a.nslices;
    const int item = blockIdx.x / per, rem = blockIdx.x % per;
    const int h = rem / a.nslices, col0 = (rem % a.nslices) * PC, kh = h / a.group;
    const int c0 = a.seqs[2 * item], nc = a.seqs[2 * item + 1];
    const int n0 = 16 * warp; /* this warp's value columns: col0 + n0 .. + 16 */
    const uint16_t *qh = a.q + (int64_t)kh * DK, *kh_ = a.k + (int64_t)kh * DK;
    const uint16_t *vh = a.v + (int64_t)h * DV + col0;
    uint16_t *sO = (uint16_t *)(smem + (size_t)a.nst * PD::stage) + warp * (GC * OP);

    /* ldmatrix lane offsets (q = matrix, r = row): "A" order - matrices (rows +0, cols +0),
     * (+0, +8), (+8, +0), (+8, +8); "B" order - (+0, +0), (+8, +0), (+0, +8), (+8, +8). */
    const int lq = lane >> 3, lr = lane & 7;
    const int rowA = 8 * (lq >> 1) + lr, colA = 8 * (lq & 1);
    const int rowB = 8 * (lq & 1) + lr, colB = 8 * (lq >> 1);

    auto issue = [&](int ci) {
        unsigned char *st = smem + (size_t)(ci % a.nst) * PD::stage;
        const int c = c0 + ci;
        const int64_t ch = (int64_t)c * a.hv + h;
        const int tc = a.chunks[2 * c], L = a.chunks[2 * c + 1];
        fetch_rows<DK, HP>((uint16_t *)(st + PD::oK), kh_ + (int64_t)tc * a.ldk, a.ldk, L,
                           a.async16);
        fetch_rows<DK, HP>((uint16_t *)(st + PD::oQ), qh + (int64_t)tc * a.ldq, a.ldq, L,
                           a.async16);
        fetch_rows<PC, VP>((uint16_t *)(st + PD::oV), vh + (int64_t)tc * a.ldv, a.ldv, L,
                           a.async16);
        fetch_f32((float *)(st + PD::oT), a.T + ch * TRI, TRI);
        fetch_f32((float *)(st + PD::oM), a.M + ch * TRI, TRI);
        fetch_f32((float *)(st + PD::oC), a.C + ch * (4 * GC), 4 * GC);
        cp_commit();
    };

    float S[NDT][4]; /* S^T: rows n0 + g (+8), columns 8 j + 2t (+1) */
#pragma unroll
    for (int j = 0; j < NDT; j++)
        S[j][0] = S[j][1] = S[j][2] = S[j][3] = 0.f;

    issue(0);
    if (a.nst == 3) {
        if (nc > 1)
            issue(1);
        else
            cp_commit();
    }

    for (int ci = 0; ci < nc; ci++) {
        const int c = c0 + ci;
        const int tc = a.chunks[2 * c], L = a.chunks[2 * c + 1];
        if (a.nst == 3)
            cp_wait<1>(); /* this thread's copies of chunk ci landed (ci + 1 may be in flight) */
        else
            cp_wait<0>();
        __syncthreads(); /* chunk ci visible to all; everyone is done with chunk ci - 1's stage */
        if (a.nst > 1) {
            if (ci + a.nst - 1 < nc)
                issue(ci + a.nst - 1); /* into chunk ci - 1's stage */
            else
                cp_commit(); /* an empty group keeps the wait counts uniform */
        }

        const unsigned char *st = smem + (size_t)(ci % a.nst) * PD::stage;
        const uint16_t *sK = (const uint16_t *)(st + PD::oK), *sQ = (const uint16_t *)(st + PD::oQ);
        const uint16_t *sV = (const uint16_t *)(st + PD::oV);
        const float *sT = (const float *)(st + PD::oT), *sM = (const float *)(st + PD::oM);
        const float *sC = (const float *)(st + PD::oC);

        /* 1. Y^T = S^T K^T and P^T = S^T Q^T: [16 x 64] each, k = dk, S split hi + lo.
         *    Token tiles jp*2, jp*2+1 per ldmatrix.x4 (rows = tokens, columns = d). */
        float Y[8][4], O[8][4];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            Y[j][0] = Y[j][1] = Y[j][2] = Y[j][3] = 0.f;
            O[j][0] = O[j][1] = O[j][2] = O[j][3] = 0.f;
        }
#pragma unroll
        for (int m = 0; m < DK / 16; m++) {
            uint32_t ah[4], al[4];
            split2(S[2 * m][0], S[2 * m][1], ah[0], al[0]);
            split2(S[2 * m][2], S[2 * m][3], ah[1], al[1]);
            split2(S[2 * m + 1][0], S[2 * m + 1][1], ah[2], al[2]);
            split2(S[2 * m + 1][2], S[2 * m + 1][3], ah[3], al[3]);
#pragma unroll
            for (int jp = 0; jp < 4; jp++) {
                uint32_t bk[4], bq[4];
                ldsm_x4(bk, sK + (16 * jp + rowA) * HP + 16 * m + colA);
                ldsm_x4(bq, sQ + (16 * jp + rowA) * HP + 16 * m + colA);
                mma_bf16(Y[2 * jp], ah, bk[0], bk[1]);
                mma_bf16(Y[2 * jp + 1], ah, bk[2], bk[3]);
                mma_bf16(O[2 * jp], ah, bq[0], bq[1]);
                mma_bf16(O[2 * jp + 1], ah, bq[2], bq[3]);
                mma_bf16(Y[2 * jp], al, bk[0], bk[1]);
                mma_bf16(Y[2 * jp + 1], al, bk[2], bk[3]);
                mma_bf16(O[2 * jp], al, bq[0], bq[1]);
                mma_bf16(O[2 * jp + 1], al, bq[2], bq[3]);
            }
        }

        /* 2. X^T = (V^T - Y^T D_eG) D_beta (V^T by ldmatrix.trans: rows = tokens,
         *    columns = value columns), O^T = P^T D_eG; X to TF32 A fragments
         *    (k order within a tile: slot t = token 2t, slot t + 4 = token 2t + 1). */
        uint32_t xa[8][4];
#pragma unroll
        for (int p = 0; p < 4; p++) {
            uint32_t vv[4];
            ldsm_x4_t(vv, sV + (16 * p + rowA) * VP + n0 + colA);
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int j = 2 * p + e;
                const float2 eg = *(const float2 *)(sC + 8 * j + 2 * t);
                const float2 bt = *(const float2 *)(sC + GC + 8 * j + 2 * t);
                const uint32_t vlo = vv[2 * e], vhi = vv[2 * e + 1];
                xa[j][0] = tf32(bt.x * (bf_lo(vlo) - eg.x * Y[j][0]));
                xa[j][2] = tf32(bt.y * (bf_hi(vlo) - eg.y * Y[j][1]));
                xa[j][1] = tf32(bt.x * (bf_lo(vhi) - eg.x * Y[j][2]));
                xa[j][3] = tf32(bt.y * (bf_hi(vhi) - eg.y * Y[j][3]));
                O[j][0] *= eg.x, O[j][1] *= eg.y, O[j][2] *= eg.x, O[j][3] *= eg.y;
            }
        }

        /* 3. Vn^T = X^T T^T (T lower triangular: output token tile i takes k tiles j <= i);
         *    B fragment (k slot t, n g) = T[8 i + g][8 j + 2t (+1)], one float2. */
        float Vn[8][4];
#pragma unroll
        for (int i = 0; i < 8; i++)
            Vn[i][0] = Vn[i][1] = Vn[i][2] = Vn[i][3] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int i = j; i < 8; i++) {
                const float2 b = *(const float2 *)(sT + tri_idx(i, j) * 64 + g * 8 + 2 * t);
                mma_tf32(Vn[i], xa[j][0], xa[j][1], xa[j][2], xa[j][3], fbits(b.x), fbits(b.y));
            }

        /* 4. O^T += Vn^T M^T (M lower triangular incl. the diagonal). */
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const uint32_t a0 = tf32(Vn[j][0]), a1 = tf32(Vn[j][2]);
            const uint32_t a2 = tf32(Vn[j][1]), a3 = tf32(Vn[j][3]);
#pragma unroll
            for (int i = j; i < 8; i++) {
                const float2 b = *(const float2 *)(sM + tri_idx(i, j) * 64 + g * 8 + 2 * t);
                mma_tf32(O[i], a0, a1, a2, a3, fbits(b.x), fbits(b.y));
            }
        }

        /* 5. O (bf16, rounded once) through this warp's staging rows to 16-byte stores. */
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int r0 = 8 * j + 2 * t;
            sO[r0 * OP + g] = f2bf(O[j][0]);
            sO[(r0 + 1) * OP + g] = f2bf(O[j][1]);
            sO[r0 * OP + g + 8] = f2bf(O[j][2]);
            sO[(r0 + 1) * OP + g + 8] = f2bf(O[j][3]);
        }
        __syncwarp();
#pragma unroll
        for (int k4 = 0; k4 < 4; k4++) {
            const int idx = lane + 32 * k4, row = idx >> 1, hf = idx & 1;
            if (row < L) {
                uint16_t *dst = a.out + (int64_t)(tc + row) * a.ldo + (int64_t)h * DV + col0 + n0 +
                                8 * hf;
                const uint16_t *src = sO + row * OP + 8 * hf;
                if (a.ovec) {
                    *(uint4 *)dst = *(const uint4 *)src;
                } else {
#pragma unroll
                    for (int e = 0; e < 8; e++)
                        dst[e] = src[e];
                }
            }
        }

        /* 6. S^T = e^{G_L} S^T + (Vn^T D_L) K: k = tokens (16 per step), n = d; K B
         *    fragments by ldmatrix.trans (rows = tokens), d tiles 2 jp, 2 jp + 1. */
        const float eL = sC[3 * GC];
#pragma unroll
        for (int j = 0; j < NDT; j++)
            S[j][0] *= eL, S[j][1] *= eL, S[j][2] *= eL, S[j][3] *= eL;
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const float2 d0 = *(const float2 *)(sC + 2 * GC + 16 * m + 2 * t);
            const float2 d1 = *(const float2 *)(sC + 2 * GC + 16 * m + 8 + 2 * t);
            uint32_t ah[4], al[4];
            split2(Vn[2 * m][0] * d0.x, Vn[2 * m][1] * d0.y, ah[0], al[0]);
            split2(Vn[2 * m][2] * d0.x, Vn[2 * m][3] * d0.y, ah[1], al[1]);
            split2(Vn[2 * m + 1][0] * d1.x, Vn[2 * m + 1][1] * d1.y, ah[2], al[2]);
            split2(Vn[2 * m + 1][2] * d1.x, Vn[2 * m + 1][3] * d1.y, ah[3], al[3]);
#pragma unroll
            for (int jp = 0; jp < NDT / 2; jp++) {
                uint32_t b[4];
                ldsm_x4_t(b, sK + (16 * m + rowB) * HP + 16 * jp + colB);
                mma_bf16(S[2 * jp], ah, b[0], b[1]);
                mma_bf16(S[2 * jp + 1], ah, b[2], b[3]);
                mma_bf16(S[2 * jp], al, b[0], b[1]);
                mma_bf16(S[2 * jp + 1], al, b[2], b[3]);
            }
        }
        if (a.nst == 1) { /* one stage: the next chunk's inputs once everyone is done with it */
            __syncthreads();
            if (ci + 1 < nc)
                issue(ci + 1);
            else
                cp_commit();
        }
    }
    cp_wait<0>();
}

/* ---- host side ---- */

struct seq_item {
    int32_t c0, n;
};

static int cmp_items(const void *x, const void *y)
{
    const struct seq_item *a = (const struct seq_item *)x, *b = (const struct seq_item *)y;
    if (a->n != b->n)
        return a->n > b->n ? -1 : 1; /* longest first: the critical path starts first */
    return a->c0 < b->c0 ? -1 : a->c0 > b->c0;
}

template <int DK, int DV>
static int launch(cudaStream_t st, const prep_args &pa, pass_args sa, int n_chunks, int n_items)
{
    const size_t s1 = prep_smem_bytes<DK>();
    /* The state pass takes a 3-stage input ring where it fits (sm_90: ~198 KB for
     * dk = 128), else 2 stages (sm_80: ~136 KB), else one (~74 KB: the ~99 KB parts,
     * sm_86 / sm_89 / sm_120, whose loads then do not overlap the math). */
    int dev = 0, optin = 0;
    if (df_cuda_fail(cudaGetDevice(&dev), "gdn get device"))
        return -EIO;
    if ((optin = df_cuda_smem_optin(dev)) <= 0) {
        df_cuda_fail(cudaErrorInvalidValue, "gdn smem limit");
        return -EIO;
    }
    sa.nst = (size_t)optin >= pass_dims<DK>::bytes(3) ? 3 : (size_t)optin >= pass_dims<DK>::bytes(2) ? 2 : 1;
    const size_t s2 = pass_dims<DK>::bytes(sa.nst);
    if ((size_t)optin < s1 || (size_t)optin < s2)
        return -ENOTSUP;
    if (df_cuda_func_smem((const void *)gdn_chunk_prep<DK>, s1) ||
        df_cuda_func_smem((const void *)gdn_state_pass<DK, DV>, s2)) {
        df_cuda_fail(cudaErrorInvalidValue, "gdn smem opt-in");
        return -EIO;
    }
    gdn_chunk_prep<DK><<<dim3((unsigned)n_chunks, (unsigned)pa.hv), NTHR, s1, st>>>(pa);
    if (df_cuda_check_launch("gdn chunk prep"))
        return -EIO;
    gdn_state_pass<DK, DV>
        <<<(unsigned)((int64_t)n_items * sa.hv * sa.nslices), PTHR, s2, st>>>(sa);
    if (df_cuda_check_launch("gdn state pass"))
        return -EIO;
    return 0;
}

int df_cuda_gdn_chunked(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
                const df_tensor *g, const df_tensor *beta, const int32_t *cu_seqlens, int n_seq,
                int hk, int hv, int dk, int dv, df_gdn_mode mode, df_tensor *out)
{
    (void)mode; /* both modes run the chunked algorithm (see the top of the file) */
    if ((dk != 64 && dk != 128) || (dv != 64 && dv != 128))
        return -ENOTSUP;
    int64_t n_chunks = 0;
    int n_items = 0;
    for (int s = 0; s < n_seq; s++) {
        int64_t len = (int64_t)cu_seqlens[s + 1] - cu_seqlens[s];
        n_chunks += (len + GC - 1) / GC;
        n_items += len > 0;
    }
    if (n_chunks == 0)
        return 0;
    if (n_chunks > INT32_MAX / 2 ||
        (int64_t)n_items * hv * (dv / PC) > INT32_MAX)
        return -ENOTSUP;

    /* Chunk list [t0, L] per chunk, then [first chunk, count] per non-empty
     * sequence, longest first; one staged array. */
    int32_t *host = (int32_t *)malloc(sizeof(int32_t) * (size_t)(2 * n_chunks + 2 * n_items));
    if (!host)
        return -ENOMEM;
    struct seq_item *items = (struct seq_item *)(host + 2 * n_chunks);
    {
        int64_t c = 0;
        int it = 0;
        for (int s = 0; s < n_seq; s++) {
            int32_t t0 = cu_seqlens[s], t1 = cu_seqlens[s + 1];
            if (t1 <= t0)
                continue;
            items[it].c0 = (int32_t)c;
            for (int32_t t = t0; t < t1; t += GC, c++) {
                host[2 * c] = t;
                host[2 * c + 1] = t1 - t < GC ? t1 - t : GC;
            }
            items[it].n = (int32_t)(c - items[it].c0);
            it++;
        }
    }
    qsort(items, (size_t)n_items, sizeof *items, cmp_items);
    const int32_t *dev = df_cuda_stage_i32(be, host, 2 * n_chunks + 2 * n_items);
    free(host);
    if (!dev)
        return -EIO;

    const size_t per_ch = 2 * (size_t)TRI + 4 * (size_t)GC; /* T, M, C floats */
    const size_t n_ch = (size_t)n_chunks * (size_t)hv;
    float *scr = (float *)df_cuda_scratch(be, sizeof(float) * per_ch * n_ch);
    if (!scr)
        return -ENOMEM;

    prep_args pa;
    memset(&pa, 0, sizeof pa);
    pa.q = (const uint16_t *)q->data, pa.k = (const uint16_t *)k->data;
    pa.ldq = q->stride[0], pa.ldk = k->stride[0];
    pa.g = (const float *)g->data, pa.beta = (const float *)beta->data;
    pa.ldg = g->stride[0], pa.ldb = beta->stride[0];
    pa.chunks = dev;
    pa.T = scr;
    pa.M = pa.T + n_ch * TRI;
    pa.C = pa.M + n_ch * TRI;
    pa.hv = hv, pa.group = hv / hk;
    /* 8-byte vector loads of 4 bf16 need every row start 8-byte aligned */
    pa.vec = ((uintptr_t)pa.q % 8 == 0) && ((uintptr_t)pa.k % 8 == 0) && pa.ldq % 4 == 0 &&
             pa.ldk % 4 == 0;

    pass_args sa;
    memset(&sa, 0, sizeof sa);
    sa.q = pa.q, sa.k = pa.k, sa.v = (const uint16_t *)v->data;
    sa.ldq = pa.ldq, sa.ldk = pa.ldk, sa.ldv = v->stride[0];
    sa.out = (uint16_t *)out->data, sa.ldo = out->stride[0];
    sa.T = pa.T, sa.M = pa.M, sa.C = pa.C;
    sa.chunks = dev, sa.seqs = dev + 2 * n_chunks;
    sa.hv = hv, sa.group = hv / hk, sa.nslices = dv / PC;
    sa.async16 = ((uintptr_t)sa.q % 16 == 0) && ((uintptr_t)sa.k % 16 == 0) &&
                 ((uintptr_t)sa.v % 16 == 0) && sa.ldq % 8 == 0 && sa.ldk % 8 == 0 &&
                 sa.ldv % 8 == 0;
    sa.ovec = ((uintptr_t)sa.out % 16 == 0) && sa.ldo % 8 == 0;

    cudaStream_t st = df_cuda_stream(be);
    int nc = (int)n_chunks;
    if (dk == 128 && dv == 128)
        return launch<128, 128>(st, pa, sa, nc, n_items);
    if (dk == 128 && dv == 64)
        return launch<128, 64>(st, pa, sa, nc, n_items);
    if (dk == 64 && dv == 128)
        return launch<64, 128>(st, pa, sa, nc, n_items);
    return launch<64, 64>(st, pa, sa, nc, n_items);
}
