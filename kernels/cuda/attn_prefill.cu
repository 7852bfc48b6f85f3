// attn_prefill.cu - the target model's causal attention over packed sequences
// (df_op_attention, ops.h; CPU reference df_cpu_attention in cpu/dense.c):
// GQA, head_dim 64 / 128 / 256, optional sigmoid output gate (Qwen3.5).
//
// FlashAttention-2 forward on tensor cores (mma.sync m16n8k16 bf16 -> fp32,
// sm_80+), the machinery of dflash_attn/mma_fwd.cu's fwd_r32_kernel:
//  - one CTA per (work item, query head); a work item is BM query rows of ONE
//    sequence (tiles never cross a bound). The list is built on the host from
//    cu_seqlens (which is a host pointer), sorted heaviest first (the longest
//    key range: LPT order, so the short diagonal-start tiles fill the tail),
//    and staged as int32 (the stage cache makes the per-layer repeat a memcmp).
//    Heads vary fastest in blockIdx.x: the CTAs resident together share
//    their q tile's K/V prefix (6 query heads per kv head for 24/4), which
//    then comes from L2.
//  - Q tile [BM][D] and double-buffered K/V tiles [BN][D] in bf16 shared
//    memory (rows padded by 8 elements: ldmatrix conflict-free), filled by
//    cp.async: the next tile's load overlaps this tile's math.
//  - warp w owns WM m-tiles of 16 rows. S = Q K^T from ldmatrix fragments
//    (Q fragments are re-read from shared memory each k-step: keeping them in
//    registers would cost 64 more registers at D = 256, above the file);
//    online softmax in fp32 in the exp2 domain (the scale folded with log2 e);
//    P rounded to bf16 is the A operand of O += P V (V through ldmatrix.trans).
//  - the causal mask is evaluated only on tiles that reach the warp's
//    diagonal; tiles wholly below it are mask-free, and tiles wholly above
//    the warp's rows are skipped by that warp (it still joins the barriers).
//    Every row sees at least itself, so no row is ever empty.
//  - epilogue: O / l, times sigmoid(gate) when given, rounded to bf16 once.
// On sm_90a builds running on a 9.x GPU a second kernel, attn_wgmma_kernel
// (warpgroup MMA, described above it), is the automatic choice (variant 4).
// mma.sync configurations (registers: O is WM * D / 2 floats per thread):
//   D 256: 8 warps x 16 rows (BM 128), BN 64, 198 KiB smem, 1 CTA / SM
//   D 128: 4 warps x 32 rows (BM 128), BN 64, 102 KiB smem, 2 CTAs / SM
//   D  64: 4 warps x 32 rows (BM 128), BN 64,  54 KiB smem
// and, where the device cannot opt in to that much shared memory per block
// (sm_86 / sm_89 / sm_120 allow 99 KiB, A100 163 KiB), a portable one:
// 4 warps x 16 rows (BM 64), BN 32: 384 (D + 8) bytes, 99 KiB at D = 256.
//
// Alignment: cp.async moves 16 bytes, so q, k, v need 16-byte aligned rows
// (data and row stride); gate and out are accessed as bf16 pairs (4 bytes).
// A view that does not qualify (a column view at an odd offset) is copied
// to contiguous scratch first (out: written there, then copied out).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cuda_internal.h"
#include "device.h"
#include "ptx_async.cuh"
#include "wgmma.cuh"

namespace {

struct Params {
    const uint16_t *q, *k, *v, *gate;
    uint16_t *o;
    long long lq, lk, lv, lg, lo; // row strides, elements
    const int32_t *items;         // [n_items][3]: sequence start, first row, sequence end
    int nq, group;
    float sl; // scale * log2(e): scores in the exp2 domain
};

// 2^x (MUFU, ~2 ulp): P is rounded to bf16 right after, l sums it in fp32.
// ex2.approx.ftz(-inf) = +0, which masked scores rely on.
__device__ __forceinline__ float ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// Two floats to a bf16 pair (round to nearest even), lo in the low half.
__device__ __forceinline__ uint32_t pack_bf2(float lo, float hi)
{
    __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&b);
}
__device__ __forceinline__ float bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
// As the CPU reference's sigmoidf_ (expf, not the MUFU approximation).
__device__ __forceinline__ float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

constexpr float LOG2E = 1.4426950408889634f;

template <int D, int NW, int WM, int BN> constexpr size_t smem_bytes()
{
    return (size_t)(NW * WM * 16 + 4 * BN) * (D + 8) * sizeof(uint16_t);
}

// One CTA: work item blockIdx.x / nq, query head blockIdx.x % nq.
template <int D, int NW, int WM, int BN, int MINB>
__global__ void __launch_bounds__(NW * 32, MINB) attn_fwd_kernel(Params p)
{
    constexpr int BM = NW * WM * 16, NT = NW * 32, KP = D + 8, KS = D / 16, NTD = D / 8,
                  NTK = BN / 8, V8 = D / 8;
    static_assert(NTK % 2 == 0 && NTD % 2 == 0 && BN % 16 == 0, "tile shape");
    extern __shared__ float4 smem4[];
    uint16_t *Qs = reinterpret_cast<uint16_t *>(smem4), *KV = Qs + BM * KP;
    const int h = blockIdx.x % p.nq, it = blockIdx.x / p.nq, g = h / p.group;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, t4 = lane & 3;
    const int s0 = p.items[3 * it], q0 = p.items[3 * it + 1], e0 = p.items[3 * it + 2];
    const int q1 = e0 - q0 < BM ? e0 : q0 + BM; // rows [q0, q1), keys [s0, q1)
    const int nt = (q1 - s0 + BN - 1) / BN;
    const uint16_t *qb = p.q + (long long)h * D, *kb = p.k + (long long)g * D,
                   *vb = p.v + (long long)g * D;

    // K/V tile t into stage st; keys past q1 zero-filled (never visible, and
    // zeros keep the masked products finite). Thread tid always moves the same
    // 16-byte column c of keys key0 + i * KR: offsets computed once here.
    static_assert(NT % V8 == 0 && (BN * V8) % NT == 0, "K/V load split");
    constexpr int KR = NT / V8, KI = BN / KR;
    const int key0 = threadIdx.x / V8, c0 = (threadIdx.x % V8) * 8;
    const uint16_t *kt = kb + (long long)(s0 + key0) * p.lk + c0,
                   *vt = vb + (long long)(s0 + key0) * p.lv + c0;
    const int soff = key0 * KP + c0;
    auto issue_kv = [&](int t, int st) {
        uint16_t *Kd = KV + st * 2 * BN * KP + soff, *Vd = Kd + BN * KP;
        const int kbase = t * BN; // relative to s0
#pragma unroll
        for (int i = 0; i < KI; i++) {
            const int key = kbase + i * KR; // this thread's key - key0, relative to s0
            const bool ok = s0 + key0 + key < q1;
            const long long r = ok ? key : -key0; // row s0: in bounds, not read
            cp16(Kd + i * KR * KP, kt + r * p.lk, ok);
            cp16(Vd + i * KR * KP, vt + r * p.lv, ok);
        }
    };
    for (int e = threadIdx.x; e < BM * V8; e += NT) {
        const int r = e / V8, c = (e % V8) * 8;
        const bool ok = q0 + r < q1;
        cp16(Qs + r * KP + c, qb + (ok ? (long long)(q0 + r) * p.lq : 0) + c, ok);
    }
    issue_kv(0, 0);
    cp_commit(); // group 0: Q and the first K/V tile

    const int wrow0 = q0 + warp * WM * 16;                // the warp's first row
    const int wlast = min(wrow0 + WM * 16 - 1, q1 - 1); // its last valid row
    float o[WM][NTD][4], m[WM][2], l[WM][2];
#pragma unroll
    for (int mt = 0; mt < WM; mt++) {
#pragma unroll
        for (int nd = 0; nd < NTD; nd++)
            o[mt][nd][0] = o[mt][nd][1] = o[mt][nd][2] = o[mt][nd][3] = 0.0f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
    }

    for (int t = 0; t < nt; t++) {
        if (t + 1 < nt)
            issue_kv(t + 1, (t + 1) & 1);
        cp_commit(); // possibly empty: keeps the wait count uniform
        cp_wait<1>(); // tile t (and Q) landed for this thread ...
        __syncthreads(); // ... and for every thread
        const uint16_t *Ks = KV + (t & 1) * 2 * BN * KP, *Vs = Ks + BN * KP;
        const int kbase = s0 + t * BN;
        // Warp-uniform: skip warps with no valid row, or whose rows all
        // precede the tile's first key (nothing visible).
        if (wrow0 < q1 && kbase <= wlast) {
            float s[WM][NTK][4];
#pragma unroll
            for (int mt = 0; mt < WM; mt++)
#pragma unroll
                for (int n = 0; n < NTK; n++)
                    s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                uint32_t qa[WM][4];
#pragma unroll
                for (int mt = 0; mt < WM; mt++)
                    ldsm4(qa[mt], Qs + ((warp * WM + mt) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * KP +
                                      ks * 16 + (lane >> 4) * 8);
#pragma unroll
                for (int n = 0; n < NTK; n += 2) {
                    uint32_t r[4]; // K rows n*8.. (k lo, k hi), (n+1)*8.. (k lo, k hi)
                    ldsm4(r, Ks + (n * 8 + (lane & 7) + (lane >> 4) * 8) * KP + ks * 16 +
                                 ((lane >> 3) & 1) * 8);
#pragma unroll
                    for (int mt = 0; mt < WM; mt++) {
                        mma16816(s[mt][n], qa[mt], r[0], r[1]);
                        mma16816(s[mt][n + 1], qa[mt], r[2], r[3]);
                    }
                }
            }
            // Mask-free when the tile's last key precedes the warp's first
            // row (then it is < q1 too); else key <= row (rows past q1,
            // never stored, are clamped to q1 - 1 to stay finite).
            const bool full = kbase + BN - 1 <= wrow0;
#pragma unroll
            for (int mt = 0; mt < WM; mt++) {
                float mx[2] = {-INFINITY, -INFINITY};
                if (full) {
#pragma unroll
                    for (int n = 0; n < NTK; n++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            s[mt][n][e] *= p.sl;
                            mx[e >> 1] = fmaxf(mx[e >> 1], s[mt][n][e]);
                        }
                } else {
                    const int r0 = wrow0 + mt * 16 + gid;
                    const int lim[2] = {min(r0, q1 - 1), min(r0 + 8, q1 - 1)};
#pragma unroll
                    for (int n = 0; n < NTK; n++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int key = kbase + n * 8 + 2 * t4 + (e & 1);
                            s[mt][n][e] = key <= lim[e >> 1] ? s[mt][n][e] * p.sl : -INFINITY;
                            mx[e >> 1] = fmaxf(mx[e >> 1], s[mt][n][e]);
                        }
                }
                float al[2], mb[2];
#pragma unroll
                for (int ri = 0; ri < 2; ri++) {
                    // the row's max over the quad holding its 64 (BN) scores
                    mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 1));
                    mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 2));
                    const float mn = fmaxf(m[mt][ri], mx[ri]);
                    // a row with nothing seen yet (cannot happen: key s0 is in
                    // tile 0 and visible to every row) would keep 0 / 0 out
                    mb[ri] = mn == -INFINITY ? 0.0f : mn;
                    al[ri] = ex2(m[mt][ri] - mb[ri]); // first tile: 2^-inf = 0
                    m[mt][ri] = mn;
                }
                float ps[2] = {0.0f, 0.0f};
#pragma unroll
                for (int n = 0; n < NTK; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const float pr = ex2(s[mt][n][e] - mb[e >> 1]);
                        s[mt][n][e] = pr;
                        ps[e >> 1] += pr;
                    }
                // l is summed per thread (its quad's partial); reduced once at the end
                l[mt][0] = l[mt][0] * al[0] + ps[0];
                l[mt][1] = l[mt][1] * al[1] + ps[1];
#pragma unroll
                for (int nd = 0; nd < NTD; nd++) {
                    o[mt][nd][0] *= al[0], o[mt][nd][1] *= al[0];
                    o[mt][nd][2] *= al[1], o[mt][nd][3] *= al[1];
                }
            }
            // O += P V: the C fragments of S (keys 16 kk .. 16 kk + 15) are
            // exactly the A fragment layout of the next mma. All of P is
            // packed to bf16 first, so the fp32 scores are dead during PV.
            uint32_t pk[WM][BN / 16][4];
#pragma unroll
            for (int mt = 0; mt < WM; mt++)
#pragma unroll
                for (int kk = 0; kk < BN / 16; kk++) {
                    pk[mt][kk][0] = pack_bf2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                    pk[mt][kk][1] = pack_bf2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                    pk[mt][kk][2] = pack_bf2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                    pk[mt][kk][3] = pack_bf2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
                }
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
#pragma unroll
                for (int nd = 0; nd < NTD; nd += 2) {
                    uint32_t r[4]; // V rows (keys) k lo / k hi x dims nd*8.., (nd+1)*8..
                    ldsm4t(r, Vs + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * KP +
                                  (nd + (lane >> 4)) * 8);
#pragma unroll
                    for (int mt = 0; mt < WM; mt++) {
                        mma16816(o[mt][nd], pk[mt][kk], r[0], r[1]);
                        mma16816(o[mt][nd + 1], pk[mt][kk], r[2], r[3]);
                    }
                }
            }
        }
        __syncthreads(); // stage t & 1 is refilled by the next iteration's issue
    }
    cp_wait<0>();

    // Epilogue: each thread owns rows r0, r0 + 8 of each m-tile, dims nd*8 + 2 t4, +1.
#pragma unroll
    for (int mt = 0; mt < WM; mt++)
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            float ls = l[mt][ri];
            ls += __shfl_xor_sync(0xffffffffu, ls, 1);
            ls += __shfl_xor_sync(0xffffffffu, ls, 2);
            const int r = wrow0 + mt * 16 + gid + ri * 8;
            if (r >= q1)
                continue;
            const float inv = ls > 0.0f ? 1.0f / ls : 0.0f;
            uint16_t *orow = p.o + (long long)r * p.lo + (long long)h * D + 2 * t4;
            if (p.gate) {
                const uint16_t *grow = p.gate + (long long)r * p.lg + (long long)h * D + 2 * t4;
#pragma unroll
                for (int nd = 0; nd < NTD; nd++) {
                    const uint32_t gw = *reinterpret_cast<const uint32_t *>(grow + nd * 8);
                    *reinterpret_cast<uint32_t *>(orow + nd * 8) =
                        pack_bf2(o[mt][nd][2 * ri] * inv * sigm(bf_lo(gw)),
                                 o[mt][nd][2 * ri + 1] * inv * sigm(bf_hi(gw)));
                }
            } else {
#pragma unroll
                for (int nd = 0; nd < NTD; nd++)
                    *reinterpret_cast<uint32_t *>(orow + nd * 8) =
                        pack_bf2(o[mt][nd][2 * ri] * inv, o[mt][nd][2 * ri + 1] * inv);
            }
        }
}

// ---------------------------------------------------------------------------
// Hopper (sm_90a) path: warpgroup MMA (wgmma), FA3's math without its
// producer warp / TMA (cp.async by every thread instead; one barrier per kv
// tile).
//  - CTA = 2 warpgroups (256 threads), BM 128: warpgroup w owns rows
//    q0 + 64 w .. + 63. Q, K, V tiles live in shared memory in the canonical
//    128-byte-swizzle layout: a [rows][D] tile is stored as D / 64 column
//    blocks of [rows][64] bf16 (128-byte rows), 16-byte chunk c of row r at
//    chunk c ^ (r % 8); every tile base is 1024-byte aligned.
//  - S = Q K^T: wgmma m64nBNk16, A = Q and B = K both K-major from shared
//    memory (descriptor: 128B swizzle, SBO 1024 = 8 rows; the k-step inside a
//    64-column block advances the start address by 32 bytes).
//  - O += P V: wgmma m64nDk16, A = P from registers (the S accumulator
//    fragment packed to bf16 IS the A fragment layout, as with mma.sync), B =
//    V N-major ("transposed", imm-trans-b 1): LBO = the column-block stride
//    (BN * 128 bytes), SBO = 1024 (8 keys), the k-step advances 16 keys.
//  - intra-warpgroup overlap: in iteration t the warpgroup issues S_{t+1} =
//    Q K_{t+1}^T and then O += P_t V_t; the softmax of S_{t+1} runs while
//    PV_t is still on the tensor cores; O is rescaled once PV_t retired.
//  - loads: group t (issued at the top of iteration t, right after the
//    barrier) brings V_{t+1} and K_{t+2}; K and V have 2 stages each. At the
//    top of iteration t + 1 it has had a whole iteration to land. cp.async
//    writes through the generic proxy and wgmma reads through the async one:
//    every thread fences (fence.proxy.async) after its wait, then the barrier.
//  - numerics as the mma.sync kernel: fp32 scores in the exp2 domain, P
//    rounded to bf16 for PV, l summed from the unrounded fp32 P, output
//    rounded once (gate in the epilogue).
// D 128: BN 128 (S 64 + O 64 + P 2 x 32 registers), 161 KiB smem;
// D 256: BN  64 (S 32 + O 128 + P 2 x 16), 193 KiB; D 64: BN 128, 81 KiB.
// 1 CTA / SM (the two warpgroups and the PV / softmax overlap keep the
// tensor cores busy). Built only for the 'a' target (__CUDA_ARCH_FEAT_SM90_ALL);
// elsewhere the kernel traps, and the host picks it only when the loaded
// binary is sm_90 machine code (wgmma_usable).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DF_WGMMA 1
#else
#define DF_WGMMA 0
#endif

template <int D, int BN> constexpr size_t wg_smem_bytes()
{
    return (size_t)128 * D * 2 + (size_t)4 * BN * D * 2 + 1024; // Q, 2 x (K, V), alignment
}

template <int D, int BN> __global__ void __launch_bounds__(256, 1) attn_wgmma_kernel(Params p)
{
#if DF_WGMMA
    constexpr int BM = 128, NT = 256, V8 = D / 8, RS = NT / V8, NS = BN / 2, NO = D / 2,
                  NP = BN / 4;
    constexpr uint32_t QB = BM * D * 2, KB = BN * D * 2;
    static_assert(D % 64 == 0 && BN % 16 == 0 && RS % 8 == 0 && BN % RS == 0 && BM % RS == 0,
                  "tile shape");
    extern __shared__ float4 smem4[];
    const uint32_t sraw = smem_u32(smem4);
    const uint32_t sQ = (sraw + 1023) & ~1023u, sK = sQ + QB, sV = sK + 2 * KB;
    const int h = blockIdx.x % p.nq, it = blockIdx.x / p.nq, g = h / p.group;
    const int tid = threadIdx.x, wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32,
              gid = lane >> 2, t4 = lane & 3;
    const int s0 = p.items[3 * it], q0 = p.items[3 * it + 1], e0 = p.items[3 * it + 2];
    const int q1 = e0 - q0 < BM ? e0 : q0 + BM; // rows [q0, q1), keys [s0, q1)
    const int nt = (q1 - s0 + BN - 1) / BN;

    // Loads: thread tid moves 16-byte column lc of rows lr + i * RS (RS a
    // multiple of 8, so the swizzle phase lr % 8 is fixed per thread).
    const int lc = tid % V8, lr = tid / V8;
    const uint32_t swz = (uint32_t)(((lc % 8) ^ (lr % 8)) * 16) + lr * 128; // in a column block
    const uint32_t offK = (uint32_t)(lc / 8) * (BN * 128) + swz,
                   offQ = (uint32_t)(lc / 8) * (BM * 128) + swz;
    const uint16_t *qt = p.q + (long long)h * D + lc * 8,
                   *kt = p.k + (long long)g * D + (long long)(s0 + lr) * p.lk + lc * 8,
                   *vt = p.v + (long long)g * D + (long long)(s0 + lr) * p.lv + lc * 8;
    // keys past q1 are zero-filled (never visible; zeros keep 0 * V finite)
    auto load_k = [&](int j, int st) {
#pragma unroll
        for (int i = 0; i < BN / RS; i++) {
            const int key = j * BN + i * RS; // this thread's key - lr, relative to s0
            const bool ok = s0 + lr + key < q1;
            cp16(sK + st * KB + offK + i * RS * 128, kt + (long long)(ok ? key : -lr) * p.lk, ok);
        }
    };
    auto load_v = [&](int j, int st) {
#pragma unroll
        for (int i = 0; i < BN / RS; i++) {
            const int key = j * BN + i * RS;
            const bool ok = s0 + lr + key < q1;
            cp16(sV + st * KB + offK + i * RS * 128, vt + (long long)(ok ? key : -lr) * p.lv, ok);
        }
    };
#pragma unroll
    for (int i = 0; i < BM / RS; i++) {
        const int r = q0 + lr + i * RS;
        const bool ok = r < q1;
        cp16(sQ + offQ + i * RS * 128, qt + (ok ? (long long)r * p.lq : 0), ok);
    }
    load_k(0, 0);
    cp_commit(); // Q, K_0
    load_v(0, 0);
    if (nt > 1)
        load_k(1, 1);
    cp_commit(); // V_0, K_1

    const int wr0 = q0 + wg * 64 + warp * 16; // the warp's first row
    float o[NO], s[NS], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    uint32_t pk[NP];
#pragma unroll
    for (int i = 0; i < NO; i++)
        o[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < NS; i++)
        s[i] = 0.0f;

    auto issue_qk = [&](int st) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            const uint64_t da = wg_desc(sQ + (ks / 4) * (BM * 128) + wg * (64 * 128) + (ks % 4) * 32,
                                      16, 1024);
            const uint64_t db = wg_desc(sK + st * KB + (ks / 4) * (BN * 128) + (ks % 4) * 32, 16, 1024);
            wgmma_ss<BN>(s, da, db, ks > 0);
        }
    };
    auto issue_pv = [&](int st) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++)
            wgmma_rs<D>(o, pk + 4 * kk, wg_desc(sV + st * KB + kk * 2048, BN * 128, 1024));
    };
    // Online softmax of s (tile j) -> P (fp32, in place), m, l, and
    // the factor al for O. Accumulator element 4 n + e: row wr0 + gid + 8 (e >> 1),
    // key 8 n + 2 t4 + (e & 1) of the tile.
    auto softmax = [&](int j, float al[2]) {
        const int kbase = s0 + j * BN;
        float mx[2] = {-INFINITY, -INFINITY};
        if (kbase + BN - 1 <= wr0) { // mask-free (warp-uniform)
#pragma unroll
            for (int i = 0; i < NS; i++) {
                s[i] *= p.sl;
                mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
            }
        } else {
            const int r0 = wr0 + gid;
            const int lim[2] = {min(r0, q1 - 1), min(r0 + 8, q1 - 1)};
#pragma unroll
            for (int i = 0; i < NS; i++) {
                const int key = kbase + (i >> 2) * 8 + 2 * t4 + (i & 1);
                s[i] = key <= lim[(i >> 1) & 1] ? s[i] * p.sl : -INFINITY;
                mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
            }
        }
        float mb[2];
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 1));
            mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 2));
            const float mn = fmaxf(m[ri], mx[ri]);
            mb[ri] = mn == -INFINITY ? 0.0f : mn; // cannot happen (key s0 is visible)
            al[ri] = ex2(m[ri] - mb[ri]);           // first tile: 2^-inf = 0
            m[ri] = mn;
        }
        float ps[2] = {0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < NS; i++) {
            s[i] = ex2(s[i] - mb[(i >> 1) & 1]);
            ps[(i >> 1) & 1] += s[i];
        }
        l[0] = l[0] * al[0] + ps[0];
        l[1] = l[1] * al[1] + ps[1];
    };
    // P (fp32, in s) to the bf16 A fragments of PV. Done only once the
    // previous PV retired: written while it runs, these registers would make
    // ptxas serialize the wgmmas (C7513).
    auto pack_p = [&](uint32_t *pn) {
        // keys 16 kk .. +15: n-blocks 2 kk (k lo) and 2 kk + 1 (k hi)
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            pn[4 * kk + 0] = pack_bf2(s[8 * kk + 0], s[8 * kk + 1]);
            pn[4 * kk + 1] = pack_bf2(s[8 * kk + 2], s[8 * kk + 3]);
            pn[4 * kk + 2] = pack_bf2(s[8 * kk + 4], s[8 * kk + 5]);
            pn[4 * kk + 3] = pack_bf2(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };

    cp_wait<1>(); // Q, K_0
    fence_proxy_async();
    __syncthreads();
    wg_fence();
    issue_qk(0);
    wg_commit();
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < NS; i++)
        reg_fence(s[i]);
    {
        float al[2];
        softmax(0, al); // O is still 0: nothing to rescale
        pack_p(pk);
    }
    // Iterations t < nt - 1 overlap S_{t+1} with PV_t; the last one is PV only
    // (peeled: a conditional QK inside the loop makes ptxas serialize).
    auto top = [&](int t) {
        cp_wait<0>(); // V_t, K_{t+1} (this thread's part) ...
        fence_proxy_async();
        __syncthreads(); // ... everyone's; and every warpgroup is done with K_t, V_{t-1}
        if (t + 1 < nt)
            load_v(t + 1, (t + 1) & 1);
        if (t + 2 < nt)
            load_k(t + 2, t & 1);
        cp_commit();
#pragma unroll
        for (int i = 0; i < NO; i++)
            reg_fence(o[i]);
#pragma unroll
        for (int i = 0; i < NP; i++)
            reg_fence(pk[i]);
        wg_fence();
    };
    for (int t = 0; t < nt - 1; t++) {
        top(t);
        issue_qk((t + 1) & 1);
        wg_commit();
        issue_pv(t & 1);
        wg_commit();
        wg_wait<1>(); // S_{t+1}
#pragma unroll
        for (int i = 0; i < NS; i++)
            reg_fence(s[i]);
        float al[2];
        softmax(t + 1, al);
        wg_wait<0>(); // PV_t
#pragma unroll
        for (int i = 0; i < NO; i++)
            reg_fence(o[i]);
#pragma unroll
        for (int i = 0; i < NP; i++)
            reg_fence(pk[i]);
#pragma unroll
        for (int i = 0; i < NO; i++)
            o[i] *= al[(i >> 1) & 1];
        pack_p(pk);
    }
    top(nt - 1);
    issue_pv((nt - 1) & 1);
    wg_commit();
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < NO; i++)
        reg_fence(o[i]);
#pragma unroll
    for (int i = 0; i < NP; i++)
        reg_fence(pk[i]);
    cp_wait<0>();

    // Epilogue: rows wr0 + gid (+ 8), dims 8 nd + 2 t4, +1.
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        float ls = l[ri];
        ls += __shfl_xor_sync(0xffffffffu, ls, 1);
        ls += __shfl_xor_sync(0xffffffffu, ls, 2);
        const int r = wr0 + gid + ri * 8;
        if (r >= q1)
            continue;
        const float inv = ls > 0.0f ? 1.0f / ls : 0.0f;
        uint16_t *orow = p.o + (long long)r * p.lo + (long long)h * D + 2 * t4;
        if (p.gate) {
            const uint16_t *grow = p.gate + (long long)r * p.lg + (long long)h * D + 2 * t4;
#pragma unroll
            for (int nd = 0; nd < D / 8; nd++) {
                const uint32_t gw = *reinterpret_cast<const uint32_t *>(grow + nd * 8);
                *reinterpret_cast<uint32_t *>(orow + nd * 8) =
                    pack_bf2(o[4 * nd + 2 * ri] * inv * sigm(bf_lo(gw)),
                             o[4 * nd + 2 * ri + 1] * inv * sigm(bf_hi(gw)));
            }
        } else {
#pragma unroll
            for (int nd = 0; nd < D / 8; nd++)
                *reinterpret_cast<uint32_t *>(orow + nd * 8) =
                    pack_bf2(o[4 * nd + 2 * ri] * inv, o[4 * nd + 2 * ri + 1] * inv);
        }
    }
#else
    __trap(); // not built for sm_90a: the host never launches this (wgmma_usable)
#endif
}

// dst[r][c] = src[r][c] for r < rows, c < cols (bf16, any row strides).
__global__ void copy2d_kernel(uint16_t *dst, long long ldd, const uint16_t *src, long long lds,
                              long long rows, long long cols)
{
    long long n = rows * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / cols, c = i % cols;
        dst[r * ldd + c] = src[r * lds + c];
    }
}

int copy2d(uint16_t *dst, long long ldd, const uint16_t *src, long long lds, long long rows,
           long long cols, cudaStream_t st)
{
    long long n = rows * cols;
    if (n == 0)
        return 0;
    long long blocks = (n + 255) / 256;
    copy2d_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), 256, 0, st>>>(dst, ldd, src, lds,
                                                                              rows, cols);
    return df_cuda_check_launch("attention: strided copy");
}

// Test / benchmark hook (declared by tests/test_gpu_attn_prefill.c, not in a
// header): 0 takes the first candidate below that fits the device's opt-in
// shared memory; v >= 1 forces candidate v - 1 (-ENOTSUP if it does not fit),
// so every configuration can be tested and timed on one GPU.
int g_variant = 0;

struct Kern {
    void (*fn)(Params);
    int bm, bn, threads;
    size_t smem;
};

template <int D, int NW, int WM, int BN, int MINB> Kern kern()
{
    Kern k;
    k.fn = attn_fwd_kernel<D, NW, WM, BN, MINB>;
    k.bm = NW * WM * 16, k.bn = BN, k.threads = NW * 32;
    k.smem = smem_bytes<D, NW, WM, BN>();
    return k;
}

template <int D, int BN> Kern kern_wg()
{
    Kern k;
    k.fn = attn_wgmma_kernel<D, BN>;
    k.bm = 128, k.bn = BN, k.threads = 256;
    k.smem = wg_smem_bytes<D, BN>();
    return k;
}

constexpr int NCAND = 4;

// Candidates per head dim (ptxas, sm_90a: registers / spills are reported in
// the file header). c[0..2]: the mma.sync kernel, preferred first; the last
// one of D 256 (99 KiB) fits every sm_80+ part; D 128 / 64's first ones
// already do. c[3]: the wgmma kernel (sm_90a only, see wgmma_usable); the
// automatic choice takes it first wherever it is usable.
void candidates(int D, Kern c[NCAND])
{
    if (D == 256) {
        c[0] = kern<256, 8, 1, 64, 1>(); // 198 KiB: H100 / H200
        c[1] = kern<256, 8, 1, 32, 1>(); // 132 KiB: A100
        c[2] = kern<256, 4, 1, 32, 1>(); //  99 KiB: sm_86 / 89 / 120
        c[3] = kern_wg<256, 64>();       // 193 KiB, sm_90a
    } else if (D == 128) {
        c[0] = kern<128, 4, 2, 32, 2>(); //  68 KiB, no spill
        c[1] = kern<128, 4, 2, 64, 2>(); // 102 KiB, FA2's shape, spills a little
        c[2] = kern<128, 8, 1, 64, 1>(); // 102 KiB, 16 rows per warp
        c[3] = kern_wg<128, 128>();      // 161 KiB, sm_90a
    } else {
        c[0] = kern<64, 4, 2, 64, 2>(); // 54 KiB
        c[1] = kern<64, 4, 2, 32, 2>(); // 36 KiB
        c[2] = kern<64, 4, 1, 32, 1>(); // 27 KiB
        c[3] = kern_wg<64, 128>();      // 81 KiB, sm_90a
    }
}

// Whether the wgmma kernel runs here: a compute capability 9.x device whose
// loaded code for it is sm_90 machine code from sm_90a-level PTX (a build
// without the 90a target leaves a trapping stub; a JIT of compute_80 PTX
// reports ptxVersion 80). Cached per device.
int wgmma_usable(bool *out)
{
    static signed char cache[64]; // 0 unknown, 1 yes, 2 no
    int dev = 0, major = 0;
    if (df_cuda_fail(cudaGetDevice(&dev), "attention: get device"))
        return -EIO;
    if (dev >= 0 && dev < 64 && cache[dev]) {
        *out = cache[dev] == 1;
        return 0;
    }
    if (df_cuda_fail(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev),
                     "attention: compute capability"))
        return -EIO;
    bool ok = false;
    if (major == 9 && !df_cuda_portable_forced()) {
        cudaFuncAttributes fa;
        if (df_cuda_fail(cudaFuncGetAttributes(&fa, attn_wgmma_kernel<128, 128>),
                         "attention: kernel attributes"))
            return -EIO;
        ok = fa.binaryVersion == 90 && fa.ptxVersion >= 90;
    }
    if (dev >= 0 && dev < 64)
        cache[dev] = ok ? 1 : 2;
    *out = ok;
    return 0;
}

// -ENOTSUP: no candidate fits (or the forced one does not); -EIO: CUDA error.
int pick(int D, int optin, Kern *out)
{
    Kern c[NCAND];
    candidates(D, c);
    bool wg = false;
    if (wgmma_usable(&wg))
        return -EIO;
    if (g_variant >= 1 && g_variant <= NCAND) {
        *out = c[g_variant - 1];
        if (g_variant - 1 == 3 && !wg)
            return -ENOTSUP;
        return out->smem <= (size_t)optin ? 0 : -ENOTSUP;
    }
    if (wg && c[3].smem <= (size_t)optin) {
        *out = c[3];
        return 0;
    }
    for (int i = 0; i < 3; i++)
        if (c[i].smem <= (size_t)optin) {
            *out = c[i];
            return 0;
        }
    return -ENOTSUP;
}

// The device's opt-in shared memory per block, cached per device.
int optin_smem(int *out)
{
    static int cache[64];
    int dev = 0, v = 0;
    if (df_cuda_fail(cudaGetDevice(&dev), "attention: get device"))
        return -EIO;
    if (dev >= 0 && dev < 64 && cache[dev] > 0) {
        *out = cache[dev];
        return 0;
    }
    if ((v = df_cuda_smem_optin(dev)) <= 0) {
        df_cuda_fail(cudaErrorInvalidValue, "attention: shared memory attribute");
        return -EIO;
    }
    if (dev >= 0 && dev < 64)
        cache[dev] = v;
    *out = v;
    return 0;
}

struct Item {
    int s0, q0, e0, cost;
};

int item_cmp(const void *a, const void *b)
{
    const Item *x = (const Item *)a, *y = (const Item *)b;
    if (x->cost != y->cost)
        return x->cost > y->cost ? -1 : 1; // heavy first
    return x->q0 < y->q0 ? -1 : x->q0 > y->q0; // deterministic order
}

bool aligned(const df_tensor *t, unsigned bytes)
{
    return (uintptr_t)t->data % bytes == 0 && (t->stride[0] * 2) % bytes == 0;
}

size_t up256(size_t n) { return (n + 255) / 256 * 256; }

} // namespace

extern "C" void df_cuda_attention_set_variant(int v) { g_variant = v; }

extern "C" const char *df_cuda_attention_path(void)
{
    bool wg = false;
    if (wgmma_usable(&wg))
        return "?";
    return wg ? "wgmma" : "mma.sync";
}

extern "C" int df_cuda_attention_flash(df_backend *be, const df_tensor *q, const df_tensor *k,
                                 const df_tensor *v, const int32_t *cu_seqlens, int n_seq, int nq,
                                 int nkv, int head_dim, float scale, const df_tensor *gate,
                                 df_tensor *out)
{
    const int D = head_dim;
    if (D != 64 && D != 128 && D != 256)
        return -ENOTSUP;
    const long long T = q->shape[0];
    if (T == 0)
        return 0;
    // bf16 elements must at least be 2-byte aligned (a misaligned pointer is a caller bug)
    if ((uintptr_t)q->data % 2 || (uintptr_t)k->data % 2 || (uintptr_t)v->data % 2 ||
        (uintptr_t)out->data % 2 || (gate && (uintptr_t)gate->data % 2))
        return -EINVAL;
    cudaStream_t st = df_cuda_stream(be);
    int optin = 0;
    if (optin_smem(&optin))
        return -EIO;
    Kern kn;
    int rc = pick(D, optin, &kn);
    if (rc)
        return rc;

    // Work list: BM-row tiles of each sequence, heaviest (most keys) first.
    long long n_items = 0;
    for (int s = 0; s < n_seq; s++)
        n_items += (cu_seqlens[s + 1] - cu_seqlens[s] + kn.bm - 1) / kn.bm;
    if (n_items == 0)
        return 0;
    if (n_items * nq > INT_MAX || n_items * 3 > INT_MAX)
        return -EINVAL;
    Item *items = (Item *)malloc((size_t)n_items * sizeof(Item));
    int32_t *flat = (int32_t *)malloc((size_t)n_items * 3 * sizeof(int32_t));
    if (!items || !flat) {
        free(items);
        free(flat);
        return -ENOMEM;
    }
    long long ni = 0;
    for (int s = 0; s < n_seq; s++) {
        const int s0 = cu_seqlens[s], e0 = cu_seqlens[s + 1];
        for (int q0 = s0; q0 < e0; q0 = e0 - q0 <= kn.bm ? e0 : q0 + kn.bm) {
            const int q1 = e0 - q0 < kn.bm ? e0 : q0 + kn.bm;
            items[ni].s0 = s0, items[ni].q0 = q0, items[ni].e0 = e0;
            items[ni].cost = (q1 - s0 + kn.bn - 1) / kn.bn;
            ni++;
        }
    }
    qsort(items, (size_t)n_items, sizeof(Item), item_cmp);
    for (long long i = 0; i < n_items; i++)
        flat[3 * i] = items[i].s0, flat[3 * i + 1] = items[i].q0, flat[3 * i + 2] = items[i].e0;
    const int32_t *ditems = df_cuda_stage_i32(be, flat, n_items * 3);
    free(items);
    free(flat);
    if (!ditems)
        return -EIO;

    Params p;
    p.q = (const uint16_t *)q->data, p.k = (const uint16_t *)k->data;
    p.v = (const uint16_t *)v->data, p.gate = gate ? (const uint16_t *)gate->data : NULL;
    p.o = (uint16_t *)out->data;
    p.lq = q->stride[0], p.lk = k->stride[0], p.lv = v->stride[0];
    p.lg = gate ? gate->stride[0] : 0, p.lo = out->stride[0];
    p.items = ditems;
    p.nq = nq, p.group = nq / nkv;
    p.sl = scale * LOG2E;

    // Views the kernel cannot address directly go through contiguous scratch.
    const long long cq = (long long)nq * D, ck = (long long)nkv * D;
    const bool rq = !aligned(q, 16), rk = !aligned(k, 16), rv = !aligned(v, 16),
               rg = gate && !aligned(gate, 4), ro = !aligned(out, 4);
    size_t need = (rq ? up256(T * cq * 2) : 0) + (rk ? up256(T * ck * 2) : 0) +
                  (rv ? up256(T * ck * 2) : 0) + (rg ? up256(T * cq * 2) : 0) +
                  (ro ? up256(T * cq * 2) : 0);
    if (need) {
        char *sc = (char *)df_cuda_scratch(be, need);
        if (!sc)
            return -ENOMEM;
        struct {
            bool on;
            const df_tensor *t;
            long long cols;
            const uint16_t **dp;
            long long *ld;
        } rp[4] = {{rq, q, cq, &p.q, &p.lq},
                   {rk, k, ck, &p.k, &p.lk},
                   {rv, v, ck, &p.v, &p.lv},
                   {rg, gate, cq, &p.gate, &p.lg}};
        for (int i = 0; i < 4; i++) {
            if (!rp[i].on)
                continue;
            uint16_t *d = (uint16_t *)sc;
            if (copy2d(d, rp[i].cols, (const uint16_t *)rp[i].t->data, rp[i].t->stride[0], T,
                       rp[i].cols, st))
                return -EIO;
            *rp[i].dp = d, *rp[i].ld = rp[i].cols;
            sc += up256(T * rp[i].cols * 2);
        }
        if (ro)
            p.o = (uint16_t *)sc, p.lo = cq;
    }

    if (df_cuda_func_smem((const void *)kn.fn, kn.smem)) {
        df_cuda_fail(cudaErrorInvalidValue, "attention: shared memory opt-in");
        return -EIO;
    }
    kn.fn<<<(unsigned)(n_items * nq), kn.threads, kn.smem, st>>>(p);
    if (df_cuda_check_launch("attention"))
        return -EIO;
    if (ro)
        return copy2d((uint16_t *)out->data, out->stride[0], p.o, cq, T, cq, st);
    return 0;
}
