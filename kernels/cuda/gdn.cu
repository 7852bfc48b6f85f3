/* gdn.cu - the gated delta rule prefill (df_op_gdn) on the GPU: the chunked
 * algorithm of TARGETS.md, chunk C = 64, chunks never cross a sequence bound
 * (the last chunk of a sequence may be short).
 *
 * Both df_gdn_mode values run this chunked algorithm: the mode only selects
 * between two CPU reference formulations (token-recurrent oracle, chunked),
 * which are the same math up to rounding. The GPU result is checked against
 * the CPU recurrent oracle (tests/test_gpu_gdn.c).
 *
 * Two kernels, both on the backend's stream:
 *
 * 1. gdn_chunk_prep, grid (chunk, value head), 256 threads, fully parallel.
 *    Per chunk and value head h (q/k head h / (hv/hk)): Gamma = in-chunk
 *    cumsum of g; A_ij = beta_i (k_i.k_j) e^{Gamma_i - Gamma_j} (i > j, the
 *    mask applied BEFORE exp, so no positive exponent is ever taken);
 *    T = (I + A)^-1 (block forward substitution, 16x16 blocks, fp32 FMA);
 *    W = T diag(beta e^Gamma) K, U = T diag(beta) V; M = (Q K^T) o
 *    e^{Gamma_i - Gamma_j} (i >= j). The products K K^T, Q K^T, T X run on
 *    tensor cores (mma.sync m16n8k8 TF32, fp32 accumulate): K and Q are bf16
 *    values, exact in TF32, so K K^T and Q K^T are as exact as fp32 FMA.
 * 2. gdn_state_pass, one CTA per (sequence, value head, slice of 32 value
 *    columns), 256 threads, sequential over the sequence's chunks with the
 *    state slice S [dk x 32] fp32 in the mma accumulators:
 *      V_new = U - W S;  O = diag(e^Gamma) Q S + M V_new  (bf16, rounded once)
 *      S = e^{Gamma_last} S + (diag(e^{Gamma_last - Gamma}) K)^T V_new
 *    Tensor cores (TF32) for all four products. The next chunk's W, Q, Gamma
 *    are fetched with cp.async while the current chunk's M V_new and state
 *    update run, and the next M, K while the next W S runs (the two halves
 *    never share buffers). 32 columns keep the CTA at ~110 KB of shared
 *    memory and <= 128 registers, so two CTAs share an SM: Qwen3.5-27B's 48
 *    heads x 4 slices = 192 CTAs all resident on 132 SMs for one document.
 *
 * Scratch (df_cuda_scratch), per (chunk c, value head h), index
 * ch = c * hv + h, all fp32, each block 64 rows (rows >= the chunk's length
 * are written as zeros, Gamma rows repeat Gamma_last):
 *   W [ch][64][dk], U [ch][64][dv], M [ch][64][64], Gamma [ch][64].
 * Precision: fp32 intermediates, not bf16 - a bf16 W or U would add an error
 * of the same size as rounding the state to bf16 (the naive-bf16 bound the
 * test allows only twice of). W and M are stored already rounded to TF32
 * (they only feed mma); U stays full fp32 (it is subtracted, not multiplied).
 * TF32 operands (10-bit mantissa) are rounded with cvt.rna: the per-product
 * error is ~4x below a bf16 rounding, the state itself is accumulated in
 * fp32 and never rounded except as an mma operand (S is re-read from fp32
 * accumulators every chunk, so the rounding does not compound).
 *
 * Cost (T = 8192, hv = 48, dk = dv = 128): ~0.5 GB of fp32 scratch written
 * once and read by the 4 slice CTAs of each head (mostly L2 hits: they run
 * in step). */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

#define GC 64     /* chunk length */
#define NTHR 256  /* threads per CTA in both kernels (8 warps) */
#define NSL 32    /* value columns per state-pass CTA */
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

/* ---- kernel 1: per (chunk, value head) ---- */

struct prep_args {
    const uint16_t *q, *k, *v; /* bf16 activations, row strides below (elements) */
    int64_t ldq, ldk, ldv;
    const float *g, *beta; /* [T, hv] f32 */
    int64_t ldg, ldb;
    const int32_t *chunks; /* [2 * n_chunks]: token start, length (1..64) */
    float *W, *U, *M, *G;  /* scratch, layout at the top of the file */
    int hv, group;         /* group = hv / hk */
    int vec;               /* q, k, v rows 8-byte aligned: load 4 bf16 at a time */
};

template <int D> struct prep_dims {
    static constexpr int LD = D + 4; /* = 4 mod 32: conflict-free A-fragment and row-major B reads */
};

/* dst[r][0..D) = src row r (bf16 -> f32) * (scale ? scale[r] : 1) for r < L, zeros for
 * r in [L, 64). src points at row 0's first column. */
template <int D>
__device__ __forceinline__ void load_rows(float *dst, int ldd, const uint16_t *src, int64_t lds,
                                          int L, int vec, const float *scale)
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
            if (scale) {
                float s = scale[row];
                x0 *= s, x1 *= s, x2 *= s, x3 *= s;
            }
        }
        *(float4 *)&dst[row * ldd + c4] = make_float4(x0, x1, x2, x3);
    }
}

/* out[64][D] (global, row stride D) = T X with T [64][64] lower triangular (sT, stride LDA)
 * and X [64][D] (stride ldx), by one warp: columns [q4 * D/4, (q4+1) * D/4) of all rows.
 * Row block r (16 rows) only needs k < 16 (r + 1): T is zero above its diagonal. */
template <int D>
__device__ __forceinline__ void tx_product(float *out, const float *sT, const float *X, int ldx,
                                           int q4, int round_tf32)
{
    constexpr int NT = D / 32; /* n-tiles of 8 per warp */
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nbase = q4 * (D / 4);
#pragma unroll
    for (int r = 0; r < 4; r++) {
        float acc[NT][4];
#pragma unroll
        for (int j = 0; j < NT; j++)
            acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        for (int ks = 0; ks < 2 * (r + 1); ks++) {
            const int k0 = 8 * ks;
            const float *ta = sT + (16 * r + g) * LDA + k0 + t;
            uint32_t a0 = tf32(ta[0]), a1 = tf32(ta[8 * LDA]);
            uint32_t a2 = tf32(ta[4]), a3 = tf32(ta[8 * LDA + 4]);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const float *xb = X + (k0 + t) * ldx + nbase + 8 * j + g;
                mma_tf32(acc[j], a0, a1, a2, a3, tf32(xb[0]), tf32(xb[4 * ldx]));
            }
        }
#pragma unroll
        for (int j = 0; j < NT; j++) {
            float c0 = acc[j][0], c1 = acc[j][1], c2 = acc[j][2], c3 = acc[j][3];
            if (round_tf32)
                c0 = tf32f(c0), c1 = tf32f(c1), c2 = tf32f(c2), c3 = tf32f(c3);
            float *o = out + (16 * r + g) * D + nbase + 8 * j + 2 * t;
            *(float2 *)o = make_float2(c0, c1);
            *(float2 *)(o + 8 * D) = make_float2(c2, c3);
        }
    }
}

template <int DK, int DV>
__global__ void __launch_bounds__(NTHR, 2) gdn_chunk_prep(prep_args a)
{
    constexpr int KP = prep_dims<DK>::LD;
    constexpr int VP = prep_dims<(DK > DV ? DK : DV)>::LD;
    extern __shared__ float4 smem_f4[];
    float *sK = (float *)smem_f4;  /* [64][KP]: K, later diag(beta e^Gamma) K */
    float *sQV = sK + GC * KP;     /* [64][VP]: Q, later diag(beta) V */
    float *sA = sQV + GC * VP;     /* [64][LDA]: A (strictly lower) */
    float *sT = sA + GC * LDA;     /* [64][LDA]: (I + A)^-1 */
    float *sY = sT + GC * LDA;     /* [3][16][17]: block products of the inversion */
    float *sG = sY + 3 * 16 * 17;  /* [64] Gamma */
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
    load_rows<DK>(sK, KP, a.k + (int64_t)t0 * a.ldk + (int64_t)kh * DK, a.ldk, L, a.vec, NULL);
    load_rows<DK>(sQV, VP, a.q + (int64_t)t0 * a.ldq + (int64_t)kh * DK, a.ldq, L, a.vec, NULL);
    __syncthreads();

    /* 3. K K^T (warps 0-3) -> A in shared memory, Q K^T (warps 4-7) -> M in scratch.
     *    Only tiles touching i >= j are computed; warp q4 takes n-tiles q4 and 7 - q4
     *    (5 needed tiles each, balanced). Unneeded tiles are written as zeros. */
    {
        const int p = warp >> 2, q4 = warp & 3;
        const float *As = p ? sQV : sK;
        const int lda = p ? VP : KP;
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
                const float *pa = As + (16 * r + g) * lda + k0 + t;
                uint32_t a0 = fbits(pa[0]), a1 = fbits(pa[8 * lda]);
                uint32_t a2 = fbits(pa[4]), a3 = fbits(pa[8 * lda + 4]);
#pragma unroll
                for (int jj = 0; jj < 2; jj++) {
                    if (jj == 1 && !need1)
                        continue;
                    const float *pb = sK + (8 * nt[jj] + g) * KP + k0 + t;
                    mma_tf32(acc[r][jj], a0, a1, a2, a3, fbits(pb[0]), fbits(pb[4]));
                }
            }
        }
        float *Mg = a.M + ch * (GC * GC);
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int jj = 0; jj < 2; jj++) {
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int i = 16 * r + g + 8 * hh, j = 8 * nt[jj] + 2 * t;
                    float v0 = acc[r][jj][2 * hh], v1 = acc[r][jj][2 * hh + 1];
                    float o0, o1;
                    if (p == 0) { /* A: strictly lower; exp only of masked-in (<= 0) exponents */
                        o0 = i > j ? sB[i] * v0 * expf(sG[i] - sG[j]) : 0.f;
                        o1 = i > j + 1 ? sB[i] * v1 * expf(sG[i] - sG[j + 1]) : 0.f;
                        *(float2 *)&sA[i * LDA + j] = make_float2(o0, o1);
                    } else { /* M: lower incl. the diagonal, stored as TF32 (an mma operand) */
                        o0 = i >= j ? tf32f(v0 * expf(sG[i] - sG[j])) : 0.f;
                        o1 = i >= j + 1 ? tf32f(v1 * expf(sG[i] - sG[j + 1])) : 0.f;
                        *(float2 *)&Mg[i * GC + j] = make_float2(o0, o1);
                    }
                }
            }
    }
    __syncthreads();

    /* 4. Diagonal 16x16 blocks of T = (I + A)^-1: lane j < 16 of warp I solves
     *    column j of block I by forward substitution, in registers (columns are
     *    independent: x_i = -sum_{j <= m < i} A_im x_m, x_j = 1).
     *    Meanwhile every thread scales K by beta e^Gamma in place and loads
     *    diag(beta) V over Q (Q is no longer needed). */
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
    }
    for (int idx = tid; idx < GC * DK; idx += NTHR) {
        int row = idx / DK, col = idx % DK;
        sK[row * KP + col] *= sB[row] * sE[row];
    }
    load_rows<DV>(sQV, VP, a.v + (int64_t)t0 * a.ldv + (int64_t)h * DV, a.ldv, L, a.vec, sB);
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

    /* 6. W = T diag(beta e^Gamma) K (warps 0-3), U = T diag(beta) V (warps 4-7). */
    if (warp < 4)
        tx_product<DK>(a.W + ch * (GC * DK), sT, sK, KP, warp & 3, 1);
    else
        tx_product<DV>(a.U + ch * (GC * DV), sT, sQV, VP, warp & 3, 0);
    if (tid < GC)
        a.G[ch * GC + tid] = sG[tid];
}

template <int DK, int DV> constexpr size_t prep_smem_bytes()
{
    return sizeof(float) * ((size_t)GC * prep_dims<DK>::LD +
                            (size_t)GC * prep_dims<(DK > DV ? DK : DV)>::LD + 2 * GC * LDA +
                            3 * 16 * 17 + 3 * GC);
}

/* ---- kernel 2: the sequential state pass ---- */

struct pass_args {
    const uint16_t *q, *k;
    int64_t ldq, ldk;
    uint16_t *out;
    int64_t ldo;
    const float *W, *U, *M, *G; /* scratch from kernel 1 */
    const int32_t *chunks;      /* [2 * n_chunks]: token start, length */
    const int32_t *seqs;        /* [2 * n_items]: first chunk, chunk count (longest first) */
    int hv, group, nslices;
    int async16; /* q, k rows 16-byte aligned: cp.async, else plain loads */
};

template <int DK> struct pass_dims {
    static constexpr int WP = DK + 4;  /* sW, sSt row stride (floats), = 4 mod 32 */
    static constexpr int HP = DK + 8;  /* sQ, sK row stride (bf16): 16-byte rows, (HP/2) = 4 mod 32 */
    static constexpr int VTP = GC + 4; /* sVt row stride (floats) */
    static constexpr size_t bytes =
        sizeof(float) * ((size_t)GC * WP + (size_t)GC * LDA + (size_t)NSL * WP +
                         (size_t)NSL * VTP + 2 * GC) +
        sizeof(uint16_t) * 2 * (size_t)GC * HP;
};

/* Rows 0..63 of a bf16 [., DK] head slice into sh (stride HP), zeros beyond L. */
template <int DK>
__device__ __forceinline__ void fetch_bf16_rows(uint16_t *sh, const uint16_t *src, int64_t lds,
                                                int L, int async16)
{
    constexpr int HP = pass_dims<DK>::HP, C8 = DK / 8;
    for (int idx = threadIdx.x; idx < GC * C8; idx += NTHR) {
        int row = idx / C8, c8 = (idx % C8) * 8;
        uint16_t *dst = sh + row * HP + c8;
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

template <int DK, int DV>
__global__ void __launch_bounds__(NTHR, 2) gdn_state_pass(pass_args a)
{
    constexpr int WP = pass_dims<DK>::WP, HP = pass_dims<DK>::HP, VTP = pass_dims<DK>::VTP;
    constexpr int MT3 = DK / 16;          /* state row tiles (16 rows of dk) */
    constexpr int NG3 = 8 / MT3;          /* warps sharing one state row tile */
    constexpr int NT3 = (NSL / 8) / NG3;  /* state n-tiles per warp */
    constexpr int NTS = NSL / 8;          /* n-tiles of a slice */
    extern __shared__ float4 smem_f4[];
    float *sW = (float *)smem_f4;          /* [64][WP] W (TF32) */
    float *sM = sW + GC * WP;              /* [64][LDA] M (TF32) */
    float *sSt = sM + GC * LDA;            /* [NSL][WP] S^T (TF32): column n of the slice, row d */
    float *sVt = sSt + NSL * WP;           /* [NSL][VTP] V_new^T (TF32) */
    float *sG = sVt + NSL * VTP;           /* [64] Gamma */
    float *sD = sG + GC;                   /* [64] e^{Gamma_last - Gamma} */
    uint16_t *sQ = (uint16_t *)(sD + GC);  /* [64][HP] Q (bf16) */
    uint16_t *sK = sQ + GC * HP;           /* [64][HP] K (bf16) */

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int per = a.hv * a.nslices;
    const int item = blockIdx.x / per, rem = blockIdx.x % per;
    const int h = rem / a.nslices, col0 = (rem % a.nslices) * NSL, kh = h / a.group;
    const int c0 = a.seqs[2 * item], nc = a.seqs[2 * item + 1];
    const uint16_t *qh = a.q + (int64_t)kh * DK, *kh_ = a.k + (int64_t)kh * DK;

    /* Group A of chunk c: W, Q, Gamma (used by the W S / Q S step). */
    auto issue_a = [&](int c) {
        const int64_t ch = (int64_t)c * a.hv + h;
        const int tc = a.chunks[2 * c], L = a.chunks[2 * c + 1];
        const float *Wg = a.W + ch * (GC * DK);
        for (int idx = tid; idx < GC * (DK / 4); idx += NTHR) {
            int row = idx / (DK / 4), c4 = (idx % (DK / 4)) * 4;
            cp16(sW + row * WP + c4, Wg + row * DK + c4, 16);
        }
        if (tid < GC / 4)
            cp16(sG + 4 * tid, a.G + ch * GC + 4 * tid, 16);
        fetch_bf16_rows<DK>(sQ, qh + (int64_t)tc * a.ldq, a.ldq, L, a.async16);
        cp_commit();
    };
    /* Group B of chunk c: M, K (used by M V_new and the state update). */
    auto issue_b = [&](int c) {
        const int64_t ch = (int64_t)c * a.hv + h;
        const int tc = a.chunks[2 * c], L = a.chunks[2 * c + 1];
        const float *Mg = a.M + ch * (GC * GC);
        for (int idx = tid; idx < GC * (GC / 4); idx += NTHR) {
            int row = idx / (GC / 4), c4 = (idx % (GC / 4)) * 4;
            cp16(sM + row * LDA + c4, Mg + row * GC + c4, 16);
        }
        fetch_bf16_rows<DK>(sK, kh_ + (int64_t)tc * a.ldk, a.ldk, L, a.async16);
        cp_commit();
    };

    for (int idx = tid; idx < NSL * WP; idx += NTHR)
        sSt[idx] = 0.f; /* S = 0 at the sequence start */
    float S[NT3][4];    /* this warp's state tile: rows 16 (warp % MT3).., n-tiles NT3 */
#pragma unroll
    for (int j = 0; j < NT3; j++)
        S[j][0] = S[j][1] = S[j][2] = S[j][3] = 0.f;
    issue_a(c0);
    issue_b(c0);

    for (int ci = 0; ci < nc; ci++) {
        const int c = c0 + ci;
        const int64_t ch = (int64_t)c * a.hv + h;
        const int tc = a.chunks[2 * c], L = a.chunks[2 * c + 1];
        cp_wait<1>(); /* group A(c) landed (B(c) may still be in flight) */
        __syncthreads();

        /* P1: rows 0..63 = W S -> V_new = U - W S (warps 0-3), rows 64..127 =
         *     Q S -> O = e^Gamma (Q S) (warps 4-7, kept in registers for P2). */
        const int r0 = 16 * (warp & 3);
        float acc[NTS][4];
#pragma unroll
        for (int j = 0; j < NTS; j++)
            acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        if (warp < 4) {
            float2 u[NTS][2]; /* U at this thread's accumulator positions, fetched early */
            const float *Ug = a.U + ch * (GC * DV) + (int64_t)(r0 + g) * DV + col0 + 2 * t;
#pragma unroll
            for (int j = 0; j < NTS; j++) {
                u[j][0] = *(const float2 *)(Ug + 8 * j);
                u[j][1] = *(const float2 *)(Ug + 8 * DV + 8 * j);
            }
#pragma unroll 4
            for (int ks = 0; ks < DK / 8; ks++) {
                const int k0 = 8 * ks;
                const float *pa = sW + (r0 + g) * WP + k0 + t;
                uint32_t a0 = fbits(pa[0]), a1 = fbits(pa[8 * WP]);
                uint32_t a2 = fbits(pa[4]), a3 = fbits(pa[8 * WP + 4]);
#pragma unroll
                for (int j = 0; j < NTS; j++) {
                    const float *pb = sSt + (8 * j + g) * WP + k0 + t;
                    mma_tf32(acc[j], a0, a1, a2, a3, fbits(pb[0]), fbits(pb[4]));
                }
            }
#pragma unroll
            for (int j = 0; j < NTS; j++) {
                const int n = 8 * j + 2 * t, row = r0 + g;
                sVt[n * VTP + row] = tf32f(u[j][0].x - acc[j][0]);
                sVt[(n + 1) * VTP + row] = tf32f(u[j][0].y - acc[j][1]);
                sVt[n * VTP + row + 8] = tf32f(u[j][1].x - acc[j][2]);
                sVt[(n + 1) * VTP + row + 8] = tf32f(u[j][1].y - acc[j][3]);
            }
        } else {
#pragma unroll 4
            for (int ks = 0; ks < DK / 8; ks++) {
                const int k0 = 8 * ks;
                const uint16_t *pa = sQ + (r0 + g) * HP + k0 + t;
                uint32_t a0 = (uint32_t)pa[0] << 16, a1 = (uint32_t)pa[8 * HP] << 16;
                uint32_t a2 = (uint32_t)pa[4] << 16, a3 = (uint32_t)pa[8 * HP + 4] << 16;
#pragma unroll
                for (int j = 0; j < NTS; j++) {
                    const float *pb = sSt + (8 * j + g) * WP + k0 + t;
                    mma_tf32(acc[j], a0, a1, a2, a3, fbits(pb[0]), fbits(pb[4]));
                }
            }
            const float e0 = expf(sG[r0 + g]), e1 = expf(sG[r0 + g + 8]);
#pragma unroll
            for (int j = 0; j < NTS; j++)
                acc[j][0] *= e0, acc[j][1] *= e0, acc[j][2] *= e1, acc[j][3] *= e1;
        }
        if (tid < GC)
            sD[tid] = expf(sG[GC - 1] - sG[tid]); /* sG[63] = Gamma_last (padding repeats it) */
        const float eL = expf(sG[GC - 1]);
        cp_wait<0>(); /* group B(c): M, K */
        __syncthreads(); /* V_new, sD visible; sW, sQ, sG, sSt free */
        if (ci + 1 < nc)
            issue_a(c + 1);

        /* P2 (warps 4-7): O += M V_new, row block r; M is zero above the diagonal. */
        if (warp >= 4) {
            const int r = warp - 4;
            for (int ks = 0; ks < 2 * (r + 1); ks++) {
                const int k0 = 8 * ks;
                const float *pa = sM + (16 * r + g) * LDA + k0 + t;
                uint32_t a0 = fbits(pa[0]), a1 = fbits(pa[8 * LDA]);
                uint32_t a2 = fbits(pa[4]), a3 = fbits(pa[8 * LDA + 4]);
#pragma unroll
                for (int j = 0; j < NTS; j++) {
                    const float *pb = sVt + (8 * j + g) * VTP + k0 + t;
                    mma_tf32(acc[j], a0, a1, a2, a3, fbits(pb[0]), fbits(pb[4]));
                }
            }
            const int i0 = 16 * r + g, i1 = i0 + 8;
            uint16_t *o0 = a.out + (int64_t)(tc + i0) * a.ldo + (int64_t)h * DV + col0 + 2 * t;
            uint16_t *o1 = o0 + 8 * a.ldo;
#pragma unroll
            for (int j = 0; j < NTS; j++) {
                if (i0 < L)
                    o0[8 * j] = f2bf(acc[j][0]), o0[8 * j + 1] = f2bf(acc[j][1]);
                if (i1 < L)
                    o1[8 * j] = f2bf(acc[j][2]), o1[8 * j + 1] = f2bf(acc[j][3]);
            }
        }

        /* P3 (all warps): S = e^{Gamma_last} S + (diag(e^{Gamma_last - Gamma}) K)^T V_new. */
        {
            const int d0 = 16 * (warp % MT3), nb = (warp / MT3) * NT3;
#pragma unroll
            for (int j = 0; j < NT3; j++)
                S[j][0] *= eL, S[j][1] *= eL, S[j][2] *= eL, S[j][3] *= eL;
#pragma unroll 2
            for (int ks = 0; ks < GC / 8; ks++) {
                const int k0 = 8 * ks;
                const float dl = sD[k0 + t], dh = sD[k0 + t + 4];
                const uint16_t *pk = sK + (k0 + t) * HP + d0 + g;
                uint32_t a0 = tf32(bf2f(pk[0]) * dl), a1 = tf32(bf2f(pk[8]) * dl);
                uint32_t a2 = tf32(bf2f(pk[4 * HP]) * dh), a3 = tf32(bf2f(pk[4 * HP + 8]) * dh);
#pragma unroll
                for (int j = 0; j < NT3; j++) {
                    const float *pb = sVt + (8 * (nb + j) + g) * VTP + k0 + t;
                    mma_tf32(S[j], a0, a1, a2, a3, fbits(pb[0]), fbits(pb[4]));
                }
            }
#pragma unroll
            for (int j = 0; j < NT3; j++) {
                const int n = 8 * (nb + j) + 2 * t, d = d0 + g;
                sSt[n * WP + d] = tf32f(S[j][0]);
                sSt[(n + 1) * WP + d] = tf32f(S[j][1]);
                sSt[n * WP + d + 8] = tf32f(S[j][2]);
                sSt[(n + 1) * WP + d + 8] = tf32f(S[j][3]);
            }
        }
        __syncthreads(); /* new S^T visible; sM, sK, sVt, sD free */
        if (ci + 1 < nc)
            issue_b(c + 1);
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
static int launch(cudaStream_t st, const prep_args &pa, const pass_args &sa, int n_chunks,
                  int n_items)
{
    const size_t s1 = prep_smem_bytes<DK, DV>(), s2 = pass_dims<DK>::bytes;
    /* Up to ~110 KB per CTA: fine on sm_80/sm_90 (163/227 KB opt-in), too much
     * for the ~99 KB parts (sm_86/89/120): say so instead of failing a launch. */
    int dev = 0, optin = 0;
    if (df_cuda_fail(cudaGetDevice(&dev), "gdn get device") ||
        df_cuda_fail(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
                     "gdn smem limit"))
        return -EIO;
    if ((size_t)optin < s1 || (size_t)optin < s2)
        return -ENOTSUP;
    if (df_cuda_fail(cudaFuncSetAttribute(gdn_chunk_prep<DK, DV>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s1),
                     "gdn prep smem") ||
        df_cuda_fail(cudaFuncSetAttribute(gdn_state_pass<DK, DV>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s2),
                     "gdn pass smem"))
        return -EIO;
    gdn_chunk_prep<DK, DV><<<dim3((unsigned)n_chunks, (unsigned)pa.hv), NTHR, s1, st>>>(pa);
    if (df_cuda_check_launch("gdn chunk prep"))
        return -EIO;
    gdn_state_pass<DK, DV>
        <<<(unsigned)((int64_t)n_items * sa.hv * sa.nslices), NTHR, s2, st>>>(sa);
    if (df_cuda_check_launch("gdn state pass"))
        return -EIO;
    return 0;
}

int df_cuda_gdn(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
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
    if (n_chunks > INT32_MAX / 2 || (int64_t)n_items * hv * (dv / NSL) > INT32_MAX)
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

    const size_t per_ch = (size_t)GC * ((size_t)dk + (size_t)dv + GC + 1);
    const size_t n_ch = (size_t)n_chunks * (size_t)hv;
    float *scr = (float *)df_cuda_scratch(be, sizeof(float) * per_ch * n_ch);
    if (!scr)
        return -EIO;

    prep_args pa;
    memset(&pa, 0, sizeof pa);
    pa.q = (const uint16_t *)q->data, pa.k = (const uint16_t *)k->data;
    pa.v = (const uint16_t *)v->data;
    pa.ldq = q->stride[0], pa.ldk = k->stride[0], pa.ldv = v->stride[0];
    pa.g = (const float *)g->data, pa.beta = (const float *)beta->data;
    pa.ldg = g->stride[0], pa.ldb = beta->stride[0];
    pa.chunks = dev;
    pa.W = scr;
    pa.U = pa.W + n_ch * GC * (size_t)dk;
    pa.M = pa.U + n_ch * GC * (size_t)dv;
    pa.G = pa.M + n_ch * GC * GC;
    pa.hv = hv, pa.group = hv / hk;
    /* 8-byte vector loads of 4 bf16 need every row start 8-byte aligned */
    pa.vec = ((uintptr_t)pa.q % 8 == 0) && ((uintptr_t)pa.k % 8 == 0) &&
             ((uintptr_t)pa.v % 8 == 0) && pa.ldq % 4 == 0 && pa.ldk % 4 == 0 && pa.ldv % 4 == 0;

    pass_args sa;
    memset(&sa, 0, sizeof sa);
    sa.q = pa.q, sa.k = pa.k, sa.ldq = pa.ldq, sa.ldk = pa.ldk;
    sa.out = (uint16_t *)out->data, sa.ldo = out->stride[0];
    sa.W = pa.W, sa.U = pa.U, sa.M = pa.M, sa.G = pa.G;
    sa.chunks = dev, sa.seqs = dev + 2 * n_chunks;
    sa.hv = hv, sa.group = hv / hk, sa.nslices = dv / NSL;
    sa.async16 = ((uintptr_t)sa.q % 16 == 0) && ((uintptr_t)sa.k % 16 == 0) && sa.ldq % 8 == 0 &&
                 sa.ldk % 8 == 0;

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
