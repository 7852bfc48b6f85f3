// dflash_attn/attn.cu - the DFlash drafter attention on the GPU (contract in
// dflash_attn.h and train_ops.h; the CPU reference is kernels/cpu/dflash_attn.c).
//
// FlashAttention-2 structure. Four implementations (args.impl; the table in
// kernels/README.md): simt, the CUDA cores (fp32 FMA from shared memory, 256
// threads = 8 warps: the plain reference on the GPU, described first below);
// mma4, tensor cores (mma.sync m16n8k16 bf16, sm_80+; the default on devices
// other than compute capability 9.0); wg2 and wg2f, Hopper warpgroup MMA
// (wgmma, sm_90a; the defaults on compute capability 9.0). The tensor-core
// kernels follow the CUDA-core kernels' work split and determinism. The
// other versions (mma, mma2, mma3, mma5, wg) were removed in session 7;
// docs/log/ has their history.
//
// Rows. A "row chunk" is up to RQ = 64 query rows of ONE block b and ONE kv
// head g: the block's bs x group (query offset qo, head of the group hh)
// rows, row r = qo * group + hh. They share the anchor and document start, so
// the block-sparse structure is by construction: a chunk visits only the
// context keys [lo0, anchor) (lo0 = max(doc_start, anchor - (W-1)), the span
// of its widest row qo = 0) in tiles of TK = 32 keys, then its own block's
// keys. Per-key masking inside a tile is one compare per (row, key) (the
// window's per-row lower bound, the end of the range, in-block causality).
// Warp w owns rows w + 8 i (i < 8); in the score phase lane = key of the tile,
// so the online softmax of a row is a warp reduction held in registers; in
// the accumulate phase lane = head dim (d = lane + 32 k).
//
// Forward: one CTA per (block, kv head, row chunk): S = Q K^T, online softmax
// (fp32 m, l per row), O += P V; out = O / l (bf16), lse = m + log l.
// Backward (recompute P from lse, no atomics, deterministic):
//   1. Di = dO . O per (row, head), fp32 workspace.
//   2. dQ: one CTA per (block, kv head, row chunk), the forward's key loop:
//      dS = P (dO V^T - Di), dq = scale dS K.
//   3. dK/dV: one CTA per (kv head, key tile). Context tiles: every valid
//      block (ascending) whose span meets the tile, all its row chunks (the
//      transposed visibility). Block tiles: the block's own rows. dv = P^T dO,
//      dk = scale dS^T Q, summed in fp32 in a fixed order, written once.
// Padding blocks: out 0, lse -inf, dq/dkb/dvb 0; rows with nothing visible
// likewise (never NaN).
// mma4 (described before its kernels below): the forward (fwd_mma2_kernel),
// Di, dQ (dq_mma2_kernel) and the block-key dK/dV (dkv_mma2_kernel) in
// cp.async-pipelined mma.sync kernels; the context dK/dV with 128-key tiles
// over per-tile block lists (dkv4_kernel); the split reduction. wg2 (its
// forward the default on compute capability 9.0, 1.7-1.8x mma4's speed at
// the 27B shape on the H200) is mma4 with its forward
// (dflash_attn/wg_fwd.cu), its dQ pass (dflash_attn/wg_dq.cu, blocks last to
// first) and its context dK/dV pass (dflash_attn/wg_dkv.cu) on wgmma; where
// sm_90a is not there, fwd_mma2_kernel, dq_mma2_kernel in longest-first order
// (dq_order_kernel) and dkv4_kernel. wg2f (the
// backward's default on compute capability 9.0) is wg2 with Di and the
// block-key dK/dV computed inside the wgmma dQ pass where one row chunk holds
// a block's rows per kv head (nch == 1): no di_kernel, no block-tile
// dkv_mma2_kernel; elsewhere wg2 exactly. On the H200 (27B drafter shape)
// its five gradients were bitwise wg2's in all four bench configurations and
// its backward 1.134 -> 1.000 ms (3docs full), 2.410 -> 2.313 (1doc full):
// the dQ pass grows by ~0.07 ms, Di (0.05) and the block keys' pass (0.16)
// go.
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../bf16.cuh"
#include "../device.h"
#include "../dflash_attn.h"
#include "common.cuh"
#include "../ptx_async.cuh"

namespace {

// Which forward runs when args.impl == 0: WG2's on compute capability 9.0,
// MMA4's (fwd_mma2_kernel) elsewhere.
#define DF_CUDA_DFLASH_IMPL_DEFAULT_FWD DF_CUDA_DFLASH_IMPL_MMA4
#define DF_CUDA_DFLASH_IMPL_DEFAULT_FWD_SM90 DF_CUDA_DFLASH_IMPL_WG2
// Which backward runs when args.impl == 0: WG3 on compute capability 9.0
// (H200, 27B shape, session 15: 3docs full 0.710 ms vs WG2F's 0.773, 1doc
// full 1.60 vs 1.89; WG2F exactly where WG3's shapes do not fit), MMA4
// elsewhere.
#define DF_CUDA_DFLASH_IMPL_DEFAULT_BWD DF_CUDA_DFLASH_IMPL_MMA4
#define DF_CUDA_DFLASH_IMPL_DEFAULT_BWD_SM90 DF_CUDA_DFLASH_IMPL_WG3

constexpr int NT = 256, NW = 8, RPW = 8, RQ = NW * RPW, TK = 32, PP = TK + 4;

// Params, ctx_lo, RowId / row_id: dflash_attn/common.cuh (shared with
// dflash_attn/wg_dkv.cu)
using df_dflash::Params;
using df_dflash::ctx_lo;
using df_dflash::RowId;
using df_dflash::row_id;
using df_dflash::launch_pdl;
using df_dflash::pdl_trigger;
using df_dflash::pdl_wait;
static_assert(RQ == df_dflash::CHUNK_ROWS, "row chunk size");

__device__ __forceinline__ float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// n rows of D bf16 (row i at src + row_off(i)) into dst [n][D+4] floats;
// rows with row_off < 0 (and rows >= n up to nmax) are zero-filled.
template <int D, typename F>
__device__ __forceinline__ void load_rows(float *dst, int nmax, const uint16_t *src, F row_off)
{
    constexpr int DP = D + 4, V = D / 8;
    for (int e = threadIdx.x; e < nmax * V; e += NT) {
        int i = e / V, c = (e % V) * 8;
        long long off = row_off(i);
        float *d = dst + i * DP + c;
        if (off < 0) {
            for (int t = 0; t < 8; t++)
                d[t] = 0.0f;
            continue;
        }
        uint4 u = *reinterpret_cast<const uint4 *>(src + off + c);
        uint32_t w[4] = {u.x, u.y, u.z, u.w};
        for (int t = 0; t < 4; t++) {
            d[2 * t] = __uint_as_float(w[t] << 16);
            d[2 * t + 1] = __uint_as_float(w[t] & 0xffff0000u);
        }
    }
}

// Scores (and optionally dO.V^T) of the warp's rows x the tile's keys (lane).
template <int D, bool DP_TOO>
__device__ __forceinline__ void tile_scores(const float *Qs, const float *Ks, const float *dOs,
                                            const float *Vs, int warp, int lane, float s[RPW],
                                            float dp[RPW])
{
    constexpr int DP = D + 4;
#pragma unroll
    for (int i = 0; i < RPW; i++)
        s[i] = 0.0f, dp[i] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < D; d += 4) {
        float4 k4 = *reinterpret_cast<const float4 *>(Ks + lane * DP + d);
        float4 v4;
        if (DP_TOO)
            v4 = *reinterpret_cast<const float4 *>(Vs + lane * DP + d);
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            float4 q4 = *reinterpret_cast<const float4 *>(Qs + (warp + NW * i) * DP + d);
            s[i] += q4.x * k4.x + q4.y * k4.y + q4.z * k4.z + q4.w * k4.w;
            if (DP_TOO) {
                float4 o4 = *reinterpret_cast<const float4 *>(dOs + (warp + NW * i) * DP + d);
                dp[i] += o4.x * v4.x + o4.y * v4.y + o4.z * v4.z + o4.w * v4.w;
            }
        }
    }
}

// acc[i][k] += sum_c Ps[row_i][c] * Xs[c][lane + 32 k]
template <int D>
__device__ __forceinline__ void tile_accum(const float *Ps, const float *Xs, int warp, int lane,
                                           float acc[RPW][D / 32])
{
    constexpr int DP = D + 4, KD = D / 32;
#pragma unroll 2
    for (int c = 0; c < TK; c += 4) {
        float x[4][KD];
#pragma unroll
        for (int t = 0; t < 4; t++)
#pragma unroll
            for (int k = 0; k < KD; k++)
                x[t][k] = Xs[(c + t) * DP + lane + 32 * k];
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            float4 p4 = *reinterpret_cast<const float4 *>(Ps + (warp + NW * i) * PP + c);
#pragma unroll
            for (int k = 0; k < KD; k++)
                acc[i][k] += p4.x * x[0][k] + p4.y * x[1][k] + p4.z * x[2][k] + p4.w * x[3][k];
        }
    }
}

// Is key (context index j, or block offset j) visible to a row?
__device__ __forceinline__ bool visible(bool isctx, int j, int nk_end, int lo, int qo, int W)
{
    if (j >= nk_end)
        return false;
    return isctx ? j >= lo : (W == 0 || j <= qo);
}

// ---- forward ----
template <int D>
__global__ void __launch_bounds__(NT) fwd_kernel(Params p)
{
    constexpr int DP = D + 4, KD = D / 32;
    extern __shared__ float4 smem4[];
    float *Qs = reinterpret_cast<float *>(smem4), *Ks = Qs + RQ * DP, *Vs = Ks + TK * DP,
          *Ps = Vs + TK * DP;
    int ch = blockIdx.x % p.nch, g = (blockIdx.x / p.nch) % p.nkv,
        b = blockIdx.x / (p.nch * p.nkv);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long ldq = (long long)p.nq * D, ldk = (long long)p.nkv * D;
    if (!p.valid[b]) {
        for (int i = 0; i < RPW; i++) {
            RowId id = row_id(p, b, g, ch, warp + NW * i);
            if (!id.ok)
                continue;
            for (int k = 0; k < KD; k++)
                p.o[id.grow * ldq + id.h * D + lane + 32 * k] = 0;
            if (lane == 0)
                p.lse[(long long)id.grow * p.nq + id.h] = -INFINITY;
        }
        return;
    }
    int anc = p.anchor[b], ds = p.doc_start[b];
    int lo0 = ctx_lo(anc, ds, p.W, 0);
    load_rows<D>(Qs, RQ, p.q, [&](int i) -> long long {
        RowId id = row_id(p, b, g, ch, i);
        return id.ok ? id.grow * ldq + id.h * D : -1;
    });
    int qo[RPW], lo[RPW];
    bool rok[RPW];
    float m[RPW], l[RPW], acc[RPW][KD];
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        RowId id = row_id(p, b, g, ch, warp + NW * i);
        rok[i] = id.ok, qo[i] = id.qo, lo[i] = ctx_lo(anc, ds, p.W, id.qo);
        m[i] = -INFINITY, l[i] = 0.0f;
#pragma unroll
        for (int k = 0; k < KD; k++)
            acc[i][k] = 0.0f;
    }
    int ntc = (anc - lo0 + TK - 1) / TK, ntb = (p.bs + TK - 1) / TK;
    for (int t = 0; t < ntc + ntb; t++) {
        bool isctx = t < ntc;
        int base = isctx ? lo0 + t * TK : (t - ntc) * TK;
        int end = isctx ? anc : p.bs;
        __syncthreads();
        const uint16_t *ksrc = isctx ? p.kc : p.kb, *vsrc = isctx ? p.vc : p.vb;
        long long rbase = isctx ? base : (long long)b * p.bs + base;
        auto roff = [&](int i) -> long long {
            return base + i < end ? (rbase + i) * ldk + (long long)g * D : -1;
        };
        load_rows<D>(Ks, TK, ksrc, roff);
        load_rows<D>(Vs, TK, vsrc, roff);
        __syncthreads();
        float s[RPW], dummy[RPW];
        tile_scores<D, false>(Qs, Ks, nullptr, nullptr, warp, lane, s, dummy);
        float al[RPW];
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            bool vis = rok[i] && visible(isctx, base + lane, end, lo[i], qo[i], p.W);
            float sv = vis ? s[i] * p.scale : -INFINITY;
            float mn = fmaxf(m[i], warp_max(sv));
            float pr, a;
            if (mn == -INFINITY) {
                pr = 0.0f, a = 1.0f;
            } else {
                pr = vis ? expf(sv - mn) : 0.0f;
                a = expf(m[i] - mn);
            }
            l[i] = l[i] * a + warp_sum(pr);
            m[i] = mn, al[i] = a;
            Ps[(warp + NW * i) * PP + lane] = pr;
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < RPW; i++)
#pragma unroll
            for (int k = 0; k < KD; k++)
                acc[i][k] *= al[i];
        tile_accum<D>(Ps, Vs, warp, lane, acc);
    }
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        RowId id = row_id(p, b, g, ch, warp + NW * i);
        if (!id.ok)
            continue;
        bool any = l[i] > 0.0f;
        float inv = any ? 1.0f / l[i] : 0.0f;
#pragma unroll
        for (int k = 0; k < KD; k++)
            p.o[id.grow * ldq + id.h * D + lane + 32 * k] = f2bf(any ? acc[i][k] * inv : 0.0f);
        if (lane == 0)
            p.lse[(long long)id.grow * p.nq + id.h] = any ? m[i] + logf(l[i]) : -INFINITY;
    }
}

// ---- backward ----

// Di = dO . O per (row, head); one warp each.
template <int D>
__global__ void __launch_bounds__(NT) di_kernel(Params p)
{
    long long w = ((long long)blockIdx.x * NT + threadIdx.x) / 32, n = (long long)p.nb * p.bs * p.nq;
    int lane = threadIdx.x % 32;
    if (w >= n)
        return;
    const uint16_t *o = p.out + w * D, *d = p.dout + w * D; // [row, nq*D] == [row*nq + h, D]
    float s = 0.0f;
    for (int k = lane; k < D; k += 32)
        s += bf2f(o[k]) * bf2f(d[k]);
    s = warp_sum(s);
    if (lane == 0)
        p.Di[w] = s;
}

template <int D>
__global__ void __launch_bounds__(NT) dq_kernel(Params p)
{
    constexpr int DP = D + 4, KD = D / 32;
    extern __shared__ float4 smem4[];
    float *Qs = reinterpret_cast<float *>(smem4), *dOs = Qs + RQ * DP, *Ks = dOs + RQ * DP,
          *Vs = Ks + TK * DP, *Ps = Vs + TK * DP;
    int ch = blockIdx.x % p.nch, g = (blockIdx.x / p.nch) % p.nkv,
        b = blockIdx.x / (p.nch * p.nkv);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long ldq = (long long)p.nq * D, ldk = (long long)p.nkv * D;
    if (!p.valid[b]) {
        for (int i = 0; i < RPW; i++) {
            RowId id = row_id(p, b, g, ch, warp + NW * i);
            if (id.ok)
                for (int k = 0; k < KD; k++)
                    p.dq[id.grow * ldq + id.h * D + lane + 32 * k] = 0;
        }
        return;
    }
    int anc = p.anchor[b], ds = p.doc_start[b];
    int lo0 = ctx_lo(anc, ds, p.W, 0);
    auto qoff = [&](int i) -> long long {
        RowId id = row_id(p, b, g, ch, i);
        return id.ok ? id.grow * ldq + id.h * D : -1;
    };
    load_rows<D>(Qs, RQ, p.q, qoff);
    load_rows<D>(dOs, RQ, p.dout, qoff);
    int qo[RPW], lo[RPW];
    bool rok[RPW];
    float L[RPW], Dr[RPW], acc[RPW][KD];
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        RowId id = row_id(p, b, g, ch, warp + NW * i);
        rok[i] = id.ok, qo[i] = id.qo, lo[i] = ctx_lo(anc, ds, p.W, id.qo);
        long long li = (long long)id.grow * p.nq + id.h;
        L[i] = id.ok ? p.lse_in[li] : -INFINITY;
        Dr[i] = id.ok ? p.Di[li] : 0.0f;
        rok[i] = rok[i] && L[i] != -INFINITY;
#pragma unroll
        for (int k = 0; k < KD; k++)
            acc[i][k] = 0.0f;
    }
    int ntc = (anc - lo0 + TK - 1) / TK, ntb = (p.bs + TK - 1) / TK;
    for (int t = 0; t < ntc + ntb; t++) {
        bool isctx = t < ntc;
        int base = isctx ? lo0 + t * TK : (t - ntc) * TK;
        int end = isctx ? anc : p.bs;
        __syncthreads();
        const uint16_t *ksrc = isctx ? p.kc : p.kb, *vsrc = isctx ? p.vc : p.vb;
        long long rbase = isctx ? base : (long long)b * p.bs + base;
        auto roff = [&](int i) -> long long {
            return base + i < end ? (rbase + i) * ldk + (long long)g * D : -1;
        };
        load_rows<D>(Ks, TK, ksrc, roff);
        load_rows<D>(Vs, TK, vsrc, roff);
        __syncthreads();
        float s[RPW], dp[RPW];
        tile_scores<D, true>(Qs, Ks, dOs, Vs, warp, lane, s, dp);
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            bool vis = rok[i] && visible(isctx, base + lane, end, lo[i], qo[i], p.W);
            float P = vis ? expf(s[i] * p.scale - L[i]) : 0.0f;
            Ps[(warp + NW * i) * PP + lane] = vis ? P * (dp[i] - Dr[i]) : 0.0f;
        }
        __syncwarp();
        tile_accum<D>(Ps, Ks, warp, lane, acc);
    }
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        RowId id = row_id(p, b, g, ch, warp + NW * i);
        if (!id.ok)
            continue;
#pragma unroll
        for (int k = 0; k < KD; k++)
            p.dq[id.grow * ldq + id.h * D + lane + 32 * k] = f2bf(acc[i][k] * p.scale);
    }
}

template <int D>
__global__ void __launch_bounds__(NT) dkv_kernel(Params p)
{
    constexpr int DP = D + 4, KD = D / 32, KPW = TK / NW; // keys per warp in the accumulate
    extern __shared__ float4 smem4[];
    float *Qs = reinterpret_cast<float *>(smem4), *dOs = Qs + RQ * DP, *Ks = dOs + RQ * DP,
          *Vs = Ks + TK * DP, *Ps = Vs + TK * DP, *dSs = Ps + RQ * PP;
    int g = blockIdx.x % p.nkv, tile = blockIdx.x / p.nkv;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long ldq = (long long)p.nq * D, ldk = (long long)p.nkv * D;
    int nct = (p.S + TK - 1) / TK, ntb = (p.bs + TK - 1) / TK;
    bool isctx = tile < nct;
    int bb = isctx ? -1 : (tile - nct) / ntb;
    int base = isctx ? tile * TK : ((tile - nct) % ntb) * TK;
    int end = isctx ? p.S : p.bs;
    uint16_t *dk = isctx ? p.dkc : p.dkb, *dv = isctx ? p.dvc : p.dvb;
    long long rbase = isctx ? base : (long long)bb * p.bs + base;
    float ak[KPW][KD], av[KPW][KD];
#pragma unroll
    for (int j = 0; j < KPW; j++)
#pragma unroll
        for (int k = 0; k < KD; k++)
            ak[j][k] = 0.0f, av[j][k] = 0.0f;
    if (isctx || p.valid[bb]) {
        const uint16_t *ksrc = isctx ? p.kc : p.kb, *vsrc = isctx ? p.vc : p.vb;
        auto roff = [&](int i) -> long long {
            return base + i < end ? (rbase + i) * ldk + (long long)g * D : -1;
        };
        load_rows<D>(Ks, TK, ksrc, roff);
        load_rows<D>(Vs, TK, vsrc, roff);
        int b0 = isctx ? 0 : bb, b1 = isctx ? p.nb : bb + 1;
        int kend = base + TK < end ? base + TK : end;
        for (int b = b0; b < b1; b++) {
            if (!p.valid[b])
                continue;
            int anc = p.anchor[b], ds = p.doc_start[b];
            if (isctx) {
                int lo0 = ctx_lo(anc, ds, p.W, 0);
                if (anc <= base || lo0 >= kend || lo0 >= anc)
                    continue;
            }
            for (int ch = 0; ch < p.nch; ch++) {
                __syncthreads(); // previous users of Qs/dOs/Ps/dSs are done
                auto qoff = [&](int i) -> long long {
                    RowId id = row_id(p, b, g, ch, i);
                    return id.ok ? id.grow * ldq + id.h * D : -1;
                };
                load_rows<D>(Qs, RQ, p.q, qoff);
                load_rows<D>(dOs, RQ, p.dout, qoff);
                __syncthreads();
                float s[RPW], dp[RPW];
                tile_scores<D, true>(Qs, Ks, dOs, Vs, warp, lane, s, dp);
#pragma unroll
                for (int i = 0; i < RPW; i++) {
                    RowId id = row_id(p, b, g, ch, warp + NW * i);
                    long long li = (long long)id.grow * p.nq + id.h;
                    float L = id.ok ? p.lse_in[li] : -INFINITY;
                    float Dr = id.ok ? p.Di[li] : 0.0f;
                    bool vis = id.ok && L != -INFINITY &&
                               (isctx ? (base + lane < anc &&
                                         base + lane >= ctx_lo(anc, ds, p.W, id.qo))
                                      : visible(false, base + lane, end, 0, id.qo, p.W));
                    vis = vis && base + lane < end;
                    float P = vis ? expf(s[i] * p.scale - L) : 0.0f;
                    Ps[(warp + NW * i) * PP + lane] = P;
                    dSs[(warp + NW * i) * PP + lane] = vis ? P * (dp[i] - Dr) : 0.0f;
                }
                __syncthreads();
                int nr = p.bs * p.group - ch * RQ;
                nr = nr < RQ ? nr : RQ;
                for (int r = 0; r < nr; r++) {
                    float o[KD], qq[KD];
#pragma unroll
                    for (int k = 0; k < KD; k++)
                        o[k] = dOs[r * DP + lane + 32 * k], qq[k] = Qs[r * DP + lane + 32 * k];
#pragma unroll
                    for (int j = 0; j < KPW; j++) {
                        float pv = Ps[r * PP + warp + NW * j], sv = dSs[r * PP + warp + NW * j];
#pragma unroll
                        for (int k = 0; k < KD; k++)
                            av[j][k] += pv * o[k], ak[j][k] += sv * qq[k];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < KPW; j++) {
        int c = warp + NW * j;
        if (base + c >= end)
            continue;
        long long off = (rbase + c) * ldk + (long long)g * D;
#pragma unroll
        for (int k = 0; k < KD; k++) {
            dk[off + lane + 32 * k] = f2bf(ak[j][k] * p.scale);
            dv[off + lane + 32 * k] = f2bf(av[j][k]);
        }
    }
}

// ---- tensor-core kernels (mma.sync m16n8k16 bf16 -> fp32, sm_80+) ----
// MMA4's forward, dQ and block-key dK/dV (and WG2's kernels where sm_90a is
// not there). The CUDA-core kernels' work split and determinism (every output
// element summed in a fixed order by one thread, written once, no atomics),
// 4 warps x 16 rows per row chunk. Operands are bf16 (P and dS rounded to
// bf16 before their products, as the naive bf16 math does); fp32 accumulate.
// K/V (and in dK/dV the Q/dO rows) staged by cp.async in two buffers (the
// next tile's load overlaps this tile's math); every mma operand fetched by
// ldmatrix (V, K and dO as the k-major B operand through .trans: no
// transposed stores); forward tiles of 64 keys; per-element masks skipped on
// tiles every row sees whole; softmax in the exp2 domain. dK/dV: the valid
// blocks that see a context tile are dealt round-robin (in ascending order)
// to NSPL CTAs; each sums its share in a fixed order into fp32 partials, and
// a last kernel adds the NSPL partials in split order (deterministic;
// balances the late tiles seen by many blocks).
__device__ __forceinline__ uint32_t ld32(const uint16_t *p)
{
    return *reinterpret_cast<const uint32_t *>(p);
}
__device__ __forceinline__ uint32_t pack_bf2(float lo, float hi)
{
    return (uint32_t)f2bf(lo) | ((uint32_t)f2bf(hi) << 16);
}

constexpr int MW = 4;        // warps per CTA
constexpr int TKM = MW * 16; // keys per dK/dV tile of dkv_mma2_kernel (16 per warp)
constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;

// acc[n][*] += A (16 x 16 k) * X^T where X is row-major [n rows][k] in shared
// memory (ld KP): rows n0 .. n0 + 8 NT - 1, k columns k0 .. k0 + 15.
// (B fragment of "col" layout = rows of X: ldmatrix without .trans.)
// Used with X = K (S = Q K^T), V (dP = dO V^T), Q / dO (S^T = K Q^T ...).
template <int NTL, int KP>
__device__ __forceinline__ void mma_rows(float (*acc)[4], const uint32_t a[4], const uint16_t *X,
                                         int n0, int k0, int lane)
{
#pragma unroll
    for (int nt = 0; nt < NTL; nt += 2) {
        uint32_t r[4];
        // matrices: (nt, k lo), (nt, k hi), (nt + 1, k lo), (nt + 1, k hi)
        ldsm4(r, X + (n0 + nt * 8 + (lane & 7) + (lane >> 4) * 8) * KP + k0 + ((lane >> 3) & 1) * 8);
        mma16816(acc[nt], a, r[0], r[1]);
        mma16816(acc[nt + 1], a, r[2], r[3]);
    }
}
// acc[nd][*] += A (16 x 16 k) * X where X is row-major [k rows][n] in shared
// memory: k rows k0 .. k0 + 15, n columns 0 .. 8 NTD - 1 (ldmatrix .trans).
template <int NTD, int KP>
__device__ __forceinline__ void mma_cols(float (*acc)[4], const uint32_t a[4], const uint16_t *X,
                                         int k0, int lane)
{
#pragma unroll
    for (int nd = 0; nd < NTD; nd += 2) {
        uint32_t r[4];
        // matrices: (k lo, nd), (k hi, nd), (k lo, nd + 1), (k hi, nd + 1)
        ldsm4t(r, X + (k0 + ((lane >> 3) & 1) * 8 + (lane & 7)) * KP + (nd + (lane >> 4)) * 8);
        mma16816(acc[nd], a, r[0], r[1]);
        mma16816(acc[nd + 1], a, r[2], r[3]);
    }
}

// A fragment (16 rows x 16 k) of a row-major [rows][k] shared matrix.
template <int KP>
__device__ __forceinline__ void ldsm_a(uint32_t a[4], const uint16_t *X, int r0, int k0, int lane)
{
    ldsm4(a, X + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * KP + k0 + (lane >> 4) * 8);
}

// K/V tile t of a (block, head) key loop into stage buffers (cp.async, zero
// fill past the end).
template <int D, int TKX>
__device__ __forceinline__ void issue_kv(const Params &p, int b, int g, int anc, int lo0, int ntc,
                                         int t, uint16_t *Kd, uint16_t *Vd, int nthr)
{
    constexpr int KP = D + 8, V8 = D / 8;
    bool isctx = t < ntc;
    int base = isctx ? lo0 + t * TKX : (t - ntc) * TKX;
    int end = isctx ? anc : p.bs;
    const uint16_t *ksrc = isctx ? p.kc : p.kb, *vsrc = isctx ? p.vc : p.vb;
    long long rbase = isctx ? base : (long long)b * p.bs + base;
    long long ldk = (long long)p.nkv * D;
    for (int e = threadIdx.x; e < TKX * V8; e += nthr) {
        int key = e / V8, c = (e % V8) * 8;
        bool ok = base + key < end;
        long long off = ok ? (rbase + key) * ldk + (long long)g * D + c : 0;
        cp16(Kd + key * KP + c, ksrc + off, ok);
        cp16(Vd + key * KP + c, vsrc + off, ok);
    }
}

constexpr int TKF = 64, TKQ = 32, NSPL = 2; // NSPL: dflash_attn/common.cuh's WG_NSPL says why 2
template <int D> constexpr size_t fwd3_smem() { return (size_t)2 * 2 * TKF * (D + 8) * 2; }
template <int D> constexpr size_t dq3_smem() { return (size_t)2 * 2 * TKQ * (D + 8) * 2; }

template <int D>
__global__ void __launch_bounds__(MW * 32) fwd_mma2_kernel(Params p)
{
    constexpr int KP = D + 8, KS = D / 16, NTD = D / 8, NTK = TKF / 8;
    extern __shared__ float4 smem4[];
    uint16_t *sm = reinterpret_cast<uint16_t *>(smem4);
    int ch = blockIdx.x % p.nch, g = (blockIdx.x / p.nch) % p.nkv,
        b = blockIdx.x / (p.nch * p.nkv);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, t4 = lane & 3;
    long long ldq = (long long)p.nq * D;
    if (!p.valid[b]) {
        for (int i = 0; i < 16; i++) {
            RowId id = row_id(p, b, g, ch, warp * 16 + i);
            if (!id.ok)
                continue;
            for (int k = lane; k < D; k += 32)
                p.o[id.grow * ldq + id.h * D + k] = 0;
            if (lane == 0)
                p.lse[(long long)id.grow * p.nq + id.h] = -INFINITY;
        }
        return;
    }
    int anc = p.anchor[b], ds = p.doc_start[b];
    int lo0 = ctx_lo(anc, ds, p.W, 0), lohi = ctx_lo(anc, ds, p.W, p.bs - 1);
    int ntc = (anc - lo0 + TKF - 1) / TKF, ntb = (p.bs + TKF - 1) / TKF, nt = ntc + ntb;
    issue_kv<D, TKF>(p, b, g, anc, lo0, ntc, 0, sm, sm + TKF * KP, MW * 32);
    cp_commit();
    RowId rid[2] = {row_id(p, b, g, ch, warp * 16 + gid), row_id(p, b, g, ch, warp * 16 + gid + 8)};
    int rlo[2] = {ctx_lo(anc, ds, p.W, rid[0].qo), ctx_lo(anc, ds, p.W, rid[1].qo)};
    uint32_t qa[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const RowId &id = rid[e & 1];
            int col = ks * 16 + 2 * t4 + (e >> 1) * 8;
            qa[ks][e] = id.ok ? ld32(p.q + id.grow * ldq + id.h * D + col) : 0u;
        }
    float o[NTD][4];
#pragma unroll
    for (int nd = 0; nd < NTD; nd++)
        o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    const float sl = p.scale * LOG2E;
    for (int t = 0; t < nt; t++) {
        if (t + 1 < nt) {
            uint16_t *Kd = sm + ((t + 1) & 1) * 2 * TKF * KP;
            issue_kv<D, TKF>(p, b, g, anc, lo0, ntc, t + 1, Kd, Kd + TKF * KP, MW * 32);
        }
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        const uint16_t *Ks = sm + (t & 1) * 2 * TKF * KP, *Vs = Ks + TKF * KP;
        bool isctx = t < ntc;
        int base = isctx ? lo0 + t * TKF : (t - ntc) * TKF;
        int end = isctx ? anc : p.bs;
        bool full = isctx && base >= lohi && base + TKF <= anc;
        float s[NTK][4];
#pragma unroll
        for (int n = 0; n < NTK; n++)
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
            mma_rows<NTK, KP>(s, qa[ks], Ks, 0, ks * 16, lane);
        float mx[2] = {-INFINITY, -INFINITY};
        if (full) {
#pragma unroll
            for (int n = 0; n < NTK; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    s[n][e] *= sl;
                    mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
                }
        } else {
#pragma unroll
            for (int n = 0; n < NTK; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int ri = e >> 1, key = base + n * 8 + 2 * t4 + (e & 1);
                    bool vis = rid[ri].ok && visible(isctx, key, end, rlo[ri], rid[ri].qo, p.W);
                    s[n][e] = vis ? s[n][e] * sl : -INFINITY;
                    mx[ri] = fmaxf(mx[ri], s[n][e]);
                }
        }
        float al[2];
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 1));
            mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 2));
            float mn = fmaxf(m[ri], mx[ri]);
            al[ri] = mn == -INFINITY ? 1.0f : exp2f(m[ri] - mn);
            m[ri] = mn;
        }
        float ps[2] = {0.0f, 0.0f};
#pragma unroll
        for (int n = 0; n < NTK; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int ri = e >> 1;
                float pr = s[n][e] == -INFINITY ? 0.0f : exp2f(s[n][e] - m[ri]);
                s[n][e] = pr;
                ps[ri] += pr;
            }
        l[0] = l[0] * al[0] + ps[0];
        l[1] = l[1] * al[1] + ps[1];
#pragma unroll
        for (int nd = 0; nd < NTD; nd++)
            o[nd][0] *= al[0], o[nd][1] *= al[0], o[nd][2] *= al[1], o[nd][3] *= al[1];
#pragma unroll
        for (int kk = 0; kk < TKF / 16; kk++) {
            uint32_t pa[4] = {pack_bf2(s[2 * kk][0], s[2 * kk][1]), pack_bf2(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            mma_cols<NTD, KP>(o, pa, Vs, kk * 16, lane);
        }
        __syncthreads(); // this stage is refilled at t + 2
    }
    cp_wait<0>();
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        l[ri] += __shfl_xor_sync(0xffffffffu, l[ri], 1);
        l[ri] += __shfl_xor_sync(0xffffffffu, l[ri], 2);
    }
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        const RowId &id = rid[ri];
        if (!id.ok)
            continue;
        bool any = l[ri] > 0.0f;
        float inv = any ? 1.0f / l[ri] : 0.0f;
        uint16_t *orow = p.o + id.grow * ldq + id.h * D;
#pragma unroll
        for (int nd = 0; nd < NTD; nd++)
            *reinterpret_cast<uint32_t *>(orow + nd * 8 + 2 * t4) =
                pack_bf2(o[nd][2 * ri] * inv, o[nd][2 * ri + 1] * inv);
        if (t4 == 0)
            p.lse[(long long)id.grow * p.nq + id.h] = any ? m[ri] * LN2 + logf(l[ri]) : -INFINITY;
    }
}

// LPT (WG2's dQ where the wgmma one does not run): CTA blockIdx takes item
// order[blockIdx / nkv] (item = b nch + ch, dq_order_kernel's longest-first
// order), kv head blockIdx % nkv; else (block, kv head, chunk) in order.
template <int D, bool LPT>
__global__ void __launch_bounds__(MW * 32) dq_mma2_kernel(Params p, const int *order)
{
    constexpr int KP = D + 8, KS = D / 16, NTD = D / 8, NTK = TKQ / 8;
    extern __shared__ float4 smem4[];
    uint16_t *sm = reinterpret_cast<uint16_t *>(smem4);
    int ch = blockIdx.x % p.nch, g = (blockIdx.x / p.nch) % p.nkv,
        b = blockIdx.x / (p.nch * p.nkv);
    if (LPT) {
        int item = order[blockIdx.x / p.nkv];
        ch = item % p.nch, g = blockIdx.x % p.nkv, b = item / p.nch;
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, t4 = lane & 3;
    long long ldq = (long long)p.nq * D;
    if (!p.valid[b]) {
        for (int i = 0; i < 16; i++) {
            RowId id = row_id(p, b, g, ch, warp * 16 + i);
            if (!id.ok)
                continue;
            for (int k = lane; k < D; k += 32)
                p.dq[id.grow * ldq + id.h * D + k] = 0;
        }
        return;
    }
    int anc = p.anchor[b], ds = p.doc_start[b];
    int lo0 = ctx_lo(anc, ds, p.W, 0), lohi = ctx_lo(anc, ds, p.W, p.bs - 1);
    int ntc = (anc - lo0 + TKQ - 1) / TKQ, ntb = (p.bs + TKQ - 1) / TKQ, nt = ntc + ntb;
    issue_kv<D, TKQ>(p, b, g, anc, lo0, ntc, 0, sm, sm + TKQ * KP, MW * 32);
    cp_commit();
    RowId rid[2] = {row_id(p, b, g, ch, warp * 16 + gid), row_id(p, b, g, ch, warp * 16 + gid + 8)};
    int rlo[2];
    float L[2], Dr[2];
    bool rok[2];
    bool allok = true;
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        rlo[ri] = ctx_lo(anc, ds, p.W, rid[ri].qo);
        long long li = (long long)rid[ri].grow * p.nq + rid[ri].h;
        L[ri] = rid[ri].ok ? p.lse_in[li] * LOG2E : -INFINITY;
        Dr[ri] = rid[ri].ok ? p.Di[li] : 0.0f;
        rok[ri] = rid[ri].ok && L[ri] != -INFINITY;
    }
    allok = __syncthreads_and(rok[0] && rok[1]);
    uint32_t qa[KS][4], da[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const RowId &id = rid[e & 1];
            int col = ks * 16 + 2 * t4 + (e >> 1) * 8;
            long long off = id.grow * ldq + id.h * D + col;
            qa[ks][e] = id.ok ? ld32(p.q + off) : 0u;
            da[ks][e] = id.ok ? ld32(p.dout + off) : 0u;
        }
    float acc[NTD][4];
#pragma unroll
    for (int nd = 0; nd < NTD; nd++)
        acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.0f;
    const float sl = p.scale * LOG2E;
    for (int t = 0; t < nt; t++) {
        if (t + 1 < nt) {
            uint16_t *Kd = sm + ((t + 1) & 1) * 2 * TKQ * KP;
            issue_kv<D, TKQ>(p, b, g, anc, lo0, ntc, t + 1, Kd, Kd + TKQ * KP, MW * 32);
        }
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        const uint16_t *Ks = sm + (t & 1) * 2 * TKQ * KP, *Vs = Ks + TKQ * KP;
        bool isctx = t < ntc;
        int base = isctx ? lo0 + t * TKQ : (t - ntc) * TKQ;
        int end = isctx ? anc : p.bs;
        bool full = allok && isctx && base >= lohi && base + TKQ <= anc;
        float s[NTK][4], dp[NTK][4];
#pragma unroll
        for (int n = 0; n < NTK; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                s[n][e] = 0.0f, dp[n][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            mma_rows<NTK, KP>(s, qa[ks], Ks, 0, ks * 16, lane);
            mma_rows<NTK, KP>(dp, da[ks], Vs, 0, ks * 16, lane);
        }
        if (full) {
#pragma unroll
            for (int n = 0; n < NTK; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int ri = e >> 1;
                    float P = exp2f(s[n][e] * sl - L[ri]);
                    s[n][e] = P * (dp[n][e] - Dr[ri]);
                }
        } else {
#pragma unroll
            for (int n = 0; n < NTK; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int ri = e >> 1, key = base + n * 8 + 2 * t4 + (e & 1);
                    bool vis = rok[ri] && visible(isctx, key, end, rlo[ri], rid[ri].qo, p.W);
                    float P = vis ? exp2f(s[n][e] * sl - L[ri]) : 0.0f;
                    s[n][e] = vis ? P * (dp[n][e] - Dr[ri]) : 0.0f;
                }
        }
#pragma unroll
        for (int kk = 0; kk < TKQ / 16; kk++) {
            uint32_t sa[4] = {pack_bf2(s[2 * kk][0], s[2 * kk][1]), pack_bf2(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            mma_cols<NTD, KP>(acc, sa, Ks, kk * 16, lane);
        }
        __syncthreads();
    }
    cp_wait<0>();
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        const RowId &id = rid[ri];
        if (!id.ok)
            continue;
        uint16_t *qrow = p.dq + id.grow * ldq + id.h * D;
#pragma unroll
        for (int nd = 0; nd < NTD; nd++)
            *reinterpret_cast<uint32_t *>(qrow + nd * 8 + 2 * t4) =
                pack_bf2(acc[nd][2 * ri] * p.scale, acc[nd][2 * ri + 1] * p.scale);
    }
}

// dK/dV, pipelined: CTA (split s, kv head g, key tile of TKM keys); context
// tiles first (NSPL CTAs each), then block tiles (one CTA each). Work items =
// (visible block, row chunk) in ascending order; context split s takes items
// k with k % NSPL == s. Q/dO rows and their lse/Di/qo/lo of the next item are
// loaded (cp.async) while this item is computed.
// The one-stage backward's dS^T store (dsd): per (block, kv head, row chunk)
// maxt + 1 slots of [TKM keys][RQ rows] bf16: the context tiles of the
// block's span (slot t: key tile lo0 / TKM + t), then its block-key tile
// (slot maxt; block_size <= TKM). Keys a slot's CTA does not reach (past S,
// past the block's keys) are left unwritten; dq_dsd_kernel zero-fills them.
__host__ __device__ inline int dsd_maxt(int S, int W)
{
    int m = (S + TKM - 1) / TKM; // a span [lo0, anc) within [0, S)
    if (W > 0) {                 // at most W - 1 keys
        int w = (W + TKM - 1) / TKM + 1;
        m = w < m ? w : m;
    }
    return m > 0 ? m : 0;
}
__host__ __device__ inline size_t dsd_slot(const Params &p, int b, int g, int ch, int t)
{
    return (((size_t)b * p.nch + ch) * p.nkv + g) * (size_t)(dsd_maxt(p.S, p.W) + 1) + t;
}

template <int D, int NST = 2>
constexpr size_t dkv3_smem()
{
    return (size_t)(2 * TKM + 2 * NST * RQ) * (D + 8) * 2 + (size_t)NST * RQ * 16;
}

struct ItemIter {
    int b, ch, k;
};

// NST: the item stages (Q, dO, lse, Di of one row chunk). 2: the next item
// loads while this one is computed; 1 (D 128 on the 99 KiB parts, sm_86 /
// sm_89 / sm_120, where two need 104 KiB): after it.
// dsd (may be NULL): the dS^T store of the one-stage backward (dsd_bytes):
// each item's bf16 dS^T tile, as the dK products use it, into its slot for
// dq_dsd_kernel.
template <int D, int NST = 2>
__global__ void __launch_bounds__(MW * 32) dkv_mma2_kernel(Params p, float *part, int bid0, uint16_t *dsd)
{
    static_assert(NST == 1 || NST == 2, "item stages");
    constexpr int NTHR = MW * 32, KP = D + 8, KS = D / 16, NTD = D / 8, V8 = D / 8;
    extern __shared__ float4 smem4[];
    uint16_t *Ks = reinterpret_cast<uint16_t *>(smem4), *Vs = Ks + TKM * KP, *Qb = Vs + TKM * KP;
    // stage st: Q at Qb + st * 2 RQ KP, dO after it
    float *Lb = reinterpret_cast<float *>(Qb + 2 * NST * RQ * KP); // [NST][RQ] lse*log2e, then [NST][RQ] Di
    float *Db = Lb + NST * RQ;
    int *Qob = reinterpret_cast<int *>(Db + NST * RQ), *Lob = Qob + NST * RQ;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, t4 = lane & 3;
    long long ldq = (long long)p.nq * D, ldk = (long long)p.nkv * D;
    int nct = (p.S + TKM - 1) / TKM, ntb = (p.bs + TKM - 1) / TKM;
    int bid = blockIdx.x + bid0; // bid0 > 0: only the block tiles (MMA4's block-key pass)
    bool isctx = bid < nct * p.nkv * NSPL;
    int split, g, tile;
    if (isctx) {
        split = bid % NSPL, g = (bid / NSPL) % p.nkv, tile = bid / (NSPL * p.nkv);
    } else {
        int r = bid - nct * p.nkv * NSPL;
        split = 0, g = r % p.nkv, tile = nct + r / p.nkv;
    }
    int bb = isctx ? -1 : (tile - nct) / ntb;
    int base = isctx ? tile * TKM : ((tile - nct) % ntb) * TKM;
    int end = isctx ? p.S : p.bs;
    long long rbase = isctx ? base : (long long)bb * p.bs + base;
    int kw = warp * 16;
    float ak[NTD][4], av[NTD][4];
#pragma unroll
    for (int nd = 0; nd < NTD; nd++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            ak[nd][e] = 0.0f, av[nd][e] = 0.0f;
    if (isctx || p.valid[bb]) {
        const uint16_t *ksrc = isctx ? p.kc : p.kb, *vsrc = isctx ? p.vc : p.vb;
        for (int e = threadIdx.x; e < TKM * V8; e += NTHR) {
            int key = e / V8, c = (e % V8) * 8;
            bool ok = base + key < end;
            long long off = ok ? (rbase + key) * ldk + (long long)g * D + c : 0;
            cp16(Ks + key * KP + c, ksrc + off, ok);
            cp16(Vs + key * KP + c, vsrc + off, ok);
        }
        cp_commit();
        int b1 = isctx ? p.nb : bb + 1;
        int kend = base + TKM < end ? base + TKM : end;
        // next item at or after (b, ch) with item counter k (uniform across the CTA)
        auto next = [&](ItemIter it) -> ItemIter {
            for (;;) {
                if (it.b >= b1)
                    return it;
                bool vb = p.valid[it.b];
                if (vb && isctx) {
                    int anc = p.anchor[it.b], lo0 = ctx_lo(anc, p.doc_start[it.b], p.W, 0);
                    vb = !(anc <= base || lo0 >= kend || lo0 >= anc);
                }
                if (vb) {
                    bool mine = !isctx || it.k % NSPL == split;
                    it.k++;
                    if (mine)
                        return it;
                    if (++it.ch < p.nch)
                        continue;
                }
                it.b++, it.ch = 0;
            }
        };
        auto advance = [&](ItemIter it) -> ItemIter {
            if (++it.ch >= p.nch)
                it.b++, it.ch = 0;
            return next(it);
        };
        auto issue = [&](ItemIter it, int st) {
            uint16_t *Qd = Qb + st * 2 * RQ * KP, *Dd = Qd + RQ * KP;
            for (int e = threadIdx.x; e < RQ * V8; e += NTHR) {
                int r = e / V8, c = (e % V8) * 8;
                RowId id = row_id(p, it.b, g, it.ch, r);
                long long off = id.ok ? id.grow * ldq + id.h * D + c : 0;
                cp16(Qd + r * KP + c, p.q + off, id.ok);
                cp16(Dd + r * KP + c, p.dout + off, id.ok);
            }
            int anc = p.anchor[it.b], ds = p.doc_start[it.b];
            for (int r = threadIdx.x; r < RQ; r += NTHR) {
                RowId id = row_id(p, it.b, g, it.ch, r);
                long long li = (long long)id.grow * p.nq + id.h;
                Lb[st * RQ + r] = id.ok ? p.lse_in[li] * LOG2E : -INFINITY;
                Db[st * RQ + r] = id.ok ? p.Di[li] : 0.0f;
                Qob[st * RQ + r] = id.qo;
                Lob[st * RQ + r] = ctx_lo(anc, ds, p.W, id.qo);
            }
        };
        ItemIter cur = next(ItemIter{isctx ? 0 : bb, 0, 0});
        if (cur.b < b1)
            issue(cur, 0);
        cp_commit();
        const float sl = p.scale * LOG2E;
        int st = 0;
        while (cur.b < b1) {
            ItemIter nx = advance(cur);
            if (NST == 2) {
                if (nx.b < b1)
                    issue(nx, st ^ 1);
                cp_commit();
                cp_wait<1>();
            } else {
                cp_wait<0>();
            }
            __syncthreads();
            const uint16_t *Qs = Qb + st * 2 * RQ * KP, *dOs = Qs + RQ * KP;
            const float *Ls = Lb + st * RQ, *Ds = Db + st * RQ;
            const int *Qo = Qob + st * RQ, *Lo = Lob + st * RQ;
            int anc = p.anchor[cur.b];
            int kend_b = isctx ? anc : end;
            uint16_t *dslot = NULL; // this item's dS^T tile (dsd), [64 keys][64 rows]
            if (dsd) {
                int t = isctx ? tile - ctx_lo(anc, p.doc_start[cur.b], p.W, 0) / TKM : dsd_maxt(p.S, p.W);
                dslot = dsd + dsd_slot(p, cur.b, g, cur.ch, t) * (size_t)(TKM * RQ);
            }
            int lohi = ctx_lo(anc, p.doc_start[cur.b], p.W, p.bs - 1);
            bool full = isctx && (cur.ch + 1) * RQ <= p.bs * p.group && base >= lohi &&
                        base + TKM <= anc;
            for (int h2 = 0; h2 < (base + kw < kend ? RQ / 32 : 0); h2++) {
                float s[4][4], dp[4][4];
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        s[nt][e] = 0.0f, dp[nt][e] = 0.0f;
#pragma unroll
                for (int ks = 0; ks < KS; ks++) {
                    uint32_t ka[4], va[4];
                    ldsm_a<KP>(ka, Ks, kw, ks * 16, lane);
                    ldsm_a<KP>(va, Vs, kw, ks * 16, lane);
                    mma_rows<4, KP>(s, ka, Qs, h2 * 32, ks * 16, lane);
                    mma_rows<4, KP>(dp, va, dOs, h2 * 32, ks * 16, lane);
                }
                if (full) {
#pragma unroll
                    for (int nt = 0; nt < 4; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            int r = h2 * 32 + nt * 8 + 2 * t4 + (e & 1);
                            float P = exp2f(s[nt][e] * sl - Ls[r]);
                            dp[nt][e] = P * (dp[nt][e] - Ds[r]);
                            s[nt][e] = P;
                        }
                } else {
#pragma unroll
                    for (int nt = 0; nt < 4; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            int key = base + kw + gid + (e >> 1) * 8;
                            int r = h2 * 32 + nt * 8 + 2 * t4 + (e & 1);
                            float Lr = Ls[r];
                            bool vis = Lr != -INFINITY &&
                                       visible(isctx, key, kend_b, Lo[r], Qo[r], p.W);
                            float P = vis ? exp2f(s[nt][e] * sl - Lr) : 0.0f;
                            dp[nt][e] = vis ? P * (dp[nt][e] - Ds[r]) : 0.0f;
                            s[nt][e] = P;
                        }
                }
#pragma unroll
                for (int kk = 0; kk < 2; kk++) {
                    uint32_t pa[4] = {pack_bf2(s[2 * kk][0], s[2 * kk][1]),
                                      pack_bf2(s[2 * kk][2], s[2 * kk][3]),
                                      pack_bf2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                      pack_bf2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                    uint32_t sa[4] = {pack_bf2(dp[2 * kk][0], dp[2 * kk][1]),
                                      pack_bf2(dp[2 * kk][2], dp[2 * kk][3]),
                                      pack_bf2(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                      pack_bf2(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
                    int r0 = h2 * 32 + kk * 16;
                    if (dslot) { // sa[j]: key kw + gid (+ 8 for j odd), rows r0 + 8 (j / 2) + 2 t4 (+ 1)
                        uint16_t *d0 = dslot + (size_t)(kw + gid) * RQ + r0 + 2 * t4;
                        *reinterpret_cast<uint32_t *>(d0) = sa[0];
                        *reinterpret_cast<uint32_t *>(d0 + 8 * RQ) = sa[1];
                        *reinterpret_cast<uint32_t *>(d0 + 8) = sa[2];
                        *reinterpret_cast<uint32_t *>(d0 + 8 * RQ + 8) = sa[3];
                    }
                    mma_cols<NTD, KP>(av, pa, dOs, r0, lane);
                    mma_cols<NTD, KP>(ak, sa, Qs, r0, lane);
                }
            }
            __syncthreads(); // stage st is refilled by the next iteration's issue (NST 1: below)
            if (NST == 1) {
                if (nx.b < b1)
                    issue(nx, 0);
                cp_commit();
            }
            cur = nx, st ^= NST - 1;
        }
        cp_wait<0>();
    }
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        int key = kw + gid + 8 * ri;
        if (base + key >= end)
            continue;
        long long off = (rbase + key) * ldk + (long long)g * D;
        if (isctx) {
            size_t n = (size_t)p.S * ldk;
            float *pk = part + (size_t)split * 2 * n, *pv = pk + n;
#pragma unroll
            for (int nd = 0; nd < NTD; nd++) {
                *reinterpret_cast<float2 *>(pk + off + nd * 8 + 2 * t4) =
                    make_float2(ak[nd][2 * ri] * p.scale, ak[nd][2 * ri + 1] * p.scale);
                *reinterpret_cast<float2 *>(pv + off + nd * 8 + 2 * t4) =
                    make_float2(av[nd][2 * ri], av[nd][2 * ri + 1]);
            }
        } else {
#pragma unroll
            for (int nd = 0; nd < NTD; nd++) {
                *reinterpret_cast<uint32_t *>(p.dkb + off + nd * 8 + 2 * t4) =
                    pack_bf2(ak[nd][2 * ri] * p.scale, ak[nd][2 * ri + 1] * p.scale);
                *reinterpret_cast<uint32_t *>(p.dvb + off + nd * 8 + 2 * t4) =
                    pack_bf2(av[nd][2 * ri], av[nd][2 * ri + 1]);
            }
        }
    }
}

// dQ from the stored dS^T (the one-stage backward): CTA = item (block b, kv
// head g, row chunk ch), MW warps, warp w the chunk's rows 16 w .. + 15 x D.
// dq = scale (sum over the span's context tiles of dS K_t + the block tile's
// dS K_b), tile by tile in key order (deterministic). A stage: the dS^T tile
// [TKM][RQ + 8] and its K rows [TKM][D + 8], both cp.async, two stages.
template <int D> constexpr size_t dq_dsd_smem() { return (size_t)2 * TKM * ((RQ + 8) + (D + 8)) * 2; }
template <int D>
__global__ void __launch_bounds__(MW * 32) dq_dsd_kernel(Params p, const uint16_t *dsd)
{
    constexpr int KP = D + 8, TP = RQ + 8, NTD = D / 8, V8 = D / 8, R8 = RQ / 8, NTHR = MW * 32;
    extern __shared__ float4 smem4[];
    uint16_t *sm = reinterpret_cast<uint16_t *>(smem4); // stage st: dS^T at st * TKM (TP + KP), K after it
    int ch = blockIdx.x % p.nch, g = (blockIdx.x / p.nch) % p.nkv, b = blockIdx.x / (p.nch * p.nkv);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t4 = lane & 3, gid = lane >> 2;
    long long ldq = (long long)p.nq * D, ldk = (long long)p.nkv * D;
    float acc[NTD][4];
#pragma unroll
    for (int nd = 0; nd < NTD; nd++)
        acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.0f;
    if (p.valid[b]) {
        int anc = p.anchor[b], lo0 = ctx_lo(anc, p.doc_start[b], p.W, 0);
        int t0 = lo0 / TKM, ntc = anc > lo0 ? (anc - 1) / TKM - t0 + 1 : 0, nt = ntc + 1;
        int maxt = dsd_maxt(p.S, p.W);
        auto issue = [&](int t, int st) {
            uint16_t *Ts = sm + st * TKM * (TP + KP), *Ks = Ts + TKM * TP;
            bool isctx = t < ntc;
            int base = isctx ? (t0 + t) * TKM : 0, end = isctx ? anc : p.bs;
            const uint16_t *dsrc = dsd + dsd_slot(p, b, g, ch, isctx ? t : maxt) * (size_t)(TKM * RQ);
            const uint16_t *ksrc = isctx ? p.kc : p.kb;
            long long rbase = isctx ? base : (long long)b * p.bs;
            for (int e = threadIdx.x; e < TKM * (R8 + V8); e += NTHR) {
                int key = e / (R8 + V8), c = (e % (R8 + V8)) * 8;
                bool ok = base + key < end;
                if (c < RQ)
                    cp16(Ts + key * TP + c, dsrc + (ok ? key * RQ + c : 0), ok);
                else
                    cp16(Ks + key * KP + c - RQ, ksrc + (ok ? (rbase + key) * ldk + (long long)g * D + c - RQ : 0), ok);
            }
        };
        issue(0, 0);
        cp_commit();
        for (int t = 0; t < nt; t++) {
            if (t + 1 < nt)
                issue(t + 1, (t + 1) & 1);
            cp_commit();
            cp_wait<1>();
            __syncthreads();
            const uint16_t *Ts = sm + (t & 1) * TKM * (TP + KP), *Ks = Ts + TKM * TP;
#pragma unroll
            for (int kk = 0; kk < TKM / 16; kk++) {
                // A = dS (rows 16 warp.., keys 16 kk..) from dS^T [key][row]: ldmatrix .trans;
                // matrices (rows lo, keys lo), (rows hi, keys lo), (rows lo, keys hi), (rows hi, keys hi)
                uint32_t a[4];
                ldsm4t(a, Ts + (kk * 16 + (lane >> 4) * 8 + (lane & 7)) * TP + warp * 16 + ((lane >> 3) & 1) * 8);
                mma_cols<NTD, KP>(acc, a, Ks, kk * 16, lane);
            }
            __syncthreads(); // stage t & 1 is refilled by the next iteration's issue
        }
        cp_wait<0>();
    }
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        RowId id = row_id(p, b, g, ch, warp * 16 + gid + 8 * ri);
        if (!id.ok)
            continue;
        uint16_t *qrow = p.dq + id.grow * ldq + id.h * D;
#pragma unroll
        for (int nd = 0; nd < NTD; nd++)
            *reinterpret_cast<uint32_t *>(qrow + nd * 8 + 2 * t4) =
                pack_bf2(acc[nd][2 * ri] * p.scale, acc[nd][2 * ri + 1] * p.scale);
    }
}

// dkc / dvc = sum over splits 0 .. NSPL - 1 of the fp32 partials, in order.
__global__ void __launch_bounds__(NT) dkv_reduce_kernel(const float *part, size_t n, uint16_t *dk,
                                                        uint16_t *dv)
{
    pdl_wait(); // the partials (WG3 launches it as a programmatic dependent)
    size_t i = ((size_t)blockIdx.x * NT + threadIdx.x) * 4;
    if (i >= n)
        return;
    float4 sk = make_float4(0, 0, 0, 0), sv = sk;
    for (int s = 0; s < NSPL; s++) {
        float4 a = *reinterpret_cast<const float4 *>(part + (size_t)s * 2 * n + i);
        float4 c = *reinterpret_cast<const float4 *>(part + (size_t)s * 2 * n + n + i);
        sk.x += a.x, sk.y += a.y, sk.z += a.z, sk.w += a.w;
        sv.x += c.x, sv.y += c.y, sv.z += c.z, sv.w += c.w;
    }
    *reinterpret_cast<uint2 *>(dk + i) = make_uint2(pack_bf2(sk.x, sk.y), pack_bf2(sk.z, sk.w));
    *reinterpret_cast<uint2 *>(dv + i) = make_uint2(pack_bf2(sv.x, sv.y), pack_bf2(sv.z, sv.w));
}

// ---- backward, impl DF_CUDA_DFLASH_IMPL_MMA4: FlashAttention-2-shaped context dK/dV ----
// dQ and the block-key dK/dV are the kernels above (dq_mma2_kernel,
// dkv_mma2_kernel); the context dK/dV pass is dkv4_kernel. Why: in
// dkv_mma2_kernel a warp owns 16 keys x the whole head dim, so every warp
// streams every Q/dO row of every item through ldmatrix for only 16 keys of
// reuse (~350 shared bytes per mma: shared-memory bound), and each context
// CTA rescans all blocks (dependent global loads) to find its items.
// Here a CTA owns TK4 = 128 keys (8 warps), items are still (visible block,
// row chunk of RQ = 64 rows), and the warps tile the two phases squarely:
//   S phase: warp w = (kq = w / 2, rh = w % 2) computes S^T, dP^T for keys
//     32 kq .. + 31 x rows 32 rh .. + 31 (A = K/V, B = Q/dO from shared
//     memory: 2 m x 4 n tiles per k step, 256 B/mma instead of 384), rounds
//     P^T and dS^T to bf16 into shared [key][row] tiles;
//   A phase: warp w = (kq, dh = w % 2) accumulates dV += P^T dO, dK += dS^T Q
//     for keys 32 kq .. + 31 x head-dim half dh (A = P^T / dS^T by ldmatrix,
//     B = dO / Q by ldmatrix.trans: 192 B/mma instead of 256).
// The keys 32 kq .. + 31 are produced and consumed by the same warp pair
// (2 kq, 2 kq + 1), so the S -> A hand-off is a 64-thread named barrier.
// Items: per-tile lists of visible valid blocks (ascending) are built once by
// tile_list_kernel; tiles are launched heaviest first (tile_order_kernel,
// LPT; ties by index); split s of NSPL takes items k % NSPL == s, fp32
// partials summed in split order by dkv_reduce_kernel (deterministic).
// Padding: padding blocks are never in a list; keys past S are zero-filled
// and masked (key >= anchor); rows past the chunk have lse -inf (P = 0).
constexpr int TK4 = 128, NW4 = 8, PTP = RQ + 8; // PTP: [key][row] bf16 pitch (conflict-free)
// WG2's wgmma context dK/dV kernel (dflash_attn/wg_dkv.cu) shares the lists, order,
// partials and reduction
static_assert(TK4 == df_dflash::WG_TILE_KEYS && NSPL == df_dflash::WG_NSPL, "wg tile / splits");
template <int D>
constexpr size_t dkv4_smem()
{
    return (size_t)(2 * TK4 + 4 * RQ) * (D + 8) * 2 + (size_t)2 * TK4 * PTP * 2 + (size_t)2 * RQ * 16;
}

// cnt[t], lst[t * nb ..]: the valid blocks whose context span meets key tile
// t of tk keys, ascending (the same test as dkv_mma2_kernel's item iterator).
// A programmatic dependent (WG3): it touches nothing the kernel before it
// reads or writes, so it waits only before it ends (pdl_wait's contract).
__global__ void __launch_bounds__(NT) tile_list_kernel(Params p, int tk, int *cnt, int *lst)
{
    __shared__ int wsum[NW];
    __shared__ int running;
    int tile = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int base = tile * tk, kend = base + tk < p.S ? base + tk : p.S;
    pdl_trigger();
    if (threadIdx.x == 0)
        running = 0;
    __syncthreads();
    for (int b0 = 0; b0 < p.nb; b0 += NT) {
        int b = b0 + threadIdx.x;
        bool f = false;
        if (b < p.nb && p.valid[b]) {
            int anc = p.anchor[b], lo0 = ctx_lo(anc, p.doc_start[b], p.W, 0);
            f = !(anc <= base || lo0 >= kend || lo0 >= anc);
        }
        unsigned m = __ballot_sync(0xffffffffu, f);
        if (lane == 0)
            wsum[warp] = __popc(m);
        __syncthreads();
        int off = running;
        for (int w = 0; w < warp; w++)
            off += wsum[w];
        if (f)
            lst[(size_t)tile * p.nb + off + __popc(m & ((1u << lane) - 1u))] = b;
        __syncthreads(); // everyone has read running / wsum
        if (threadIdx.x == 0)
            for (int w = 0; w < NW; w++)
                running += wsum[w];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        cnt[tile] = running;
    pdl_wait();
}

// order[rank] = tile, by descending item count (ties: lower index first).
__global__ void __launch_bounds__(1024) tile_order_kernel(const int *cnt, int nct, int *order)
{
    pdl_trigger();
    pdl_wait(); // cnt
    for (int i = threadIdx.x; i < nct; i += 1024) {
        int c = cnt[i], r = 0;
        for (int j = 0; j < nct; j++) {
            int cj = cnt[j];
            r += cj > c || (cj == c && j < i);
        }
        order[r] = i;
    }
}

__device__ __forceinline__ void bar_pair(int id)
{
    asm volatile("bar.sync %0, 64;\n" ::"r"(id) : "memory");
}

// One CTA per (LPT rank, kv head, split): context keys only.
template <int D>
__global__ void __launch_bounds__(NW4 * 32, 1)
    dkv4_kernel(Params p, float *part, const int *cnt, const int *lst, const int *order)
{
    constexpr int NTHR = NW4 * 32, KP = D + 8, KS = D / 16, V8 = D / 8, NTH = D / 16;
    extern __shared__ float4 smem4[];
    uint16_t *Ks = reinterpret_cast<uint16_t *>(smem4), *Vs = Ks + TK4 * KP, *Qb = Vs + TK4 * KP;
    // stage st: Q at Qb + st * 2 RQ KP, dO after it
    uint16_t *Pt = Qb + 4 * RQ * KP, *dSt = Pt + TK4 * PTP; // [key][row] bf16
    float *Lb = reinterpret_cast<float *>(dSt + TK4 * PTP); // [2][RQ] lse*log2e
    float *Db = Lb + 2 * RQ;                                // [2][RQ] Di
    int *Qob = reinterpret_cast<int *>(Db + 2 * RQ), *Lob = Qob + 2 * RQ;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, t4 = lane & 3;
    int kq = warp >> 1, hw = warp & 1; // keys 32 kq..; S phase: rows 32 hw..; A phase: D half hw
    long long ldq = (long long)p.nq * D, ldk = (long long)p.nkv * D;
    int bid = blockIdx.x;
    int split = bid % NSPL, g = (bid / NSPL) % p.nkv, tile = order[bid / (NSPL * p.nkv)];
    int base = tile * TK4, kend = base + TK4 < p.S ? base + TK4 : p.S;
    int k0 = base + 32 * kq; // this warp's first key (context index)
    float ak[2][NTH][4], av[2][NTH][4];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int nd = 0; nd < NTH; nd++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                ak[m][nd][e] = 0.0f, av[m][nd][e] = 0.0f;
    for (int e = threadIdx.x; e < TK4 * V8; e += NTHR) {
        int key = e / V8, c = (e % V8) * 8;
        bool ok = base + key < kend;
        long long off = ok ? (long long)(base + key) * ldk + (long long)g * D + c : 0;
        cp16(Ks + key * KP + c, p.kc + off, ok);
        cp16(Vs + key * KP + c, p.vc + off, ok);
    }
    cp_commit();
    int nitems = cnt[tile] * p.nch;
    const int *tl = lst + (size_t)tile * p.nb;
    auto issue = [&](int k, int st) {
        int b = tl[k / p.nch], ch = k % p.nch;
        uint16_t *Qd = Qb + st * 2 * RQ * KP, *Dd = Qd + RQ * KP;
        for (int e = threadIdx.x; e < RQ * V8; e += NTHR) {
            int r = e / V8, c = (e % V8) * 8;
            RowId id = row_id(p, b, g, ch, r);
            long long off = id.ok ? id.grow * ldq + id.h * D + c : 0;
            cp16(Qd + r * KP + c, p.q + off, id.ok);
            cp16(Dd + r * KP + c, p.dout + off, id.ok);
        }
        int anc = p.anchor[b], ds = p.doc_start[b];
        for (int r = threadIdx.x; r < RQ; r += NTHR) {
            RowId id = row_id(p, b, g, ch, r);
            long long li = (long long)id.grow * p.nq + id.h;
            Lb[st * RQ + r] = id.ok ? p.lse_in[li] * LOG2E : -INFINITY;
            Db[st * RQ + r] = id.ok ? p.Di[li] : 0.0f;
            Qob[st * RQ + r] = id.qo;
            Lob[st * RQ + r] = ctx_lo(anc, ds, p.W, id.qo);
        }
    };
    if (split < nitems)
        issue(split, 0);
    cp_commit();
    const float sl = p.scale * LOG2E;
    int st = 0;
    for (int k = split; k < nitems; k += NSPL, st ^= 1) {
        cp_wait<0>(); // K/V and item k landed (this thread's copies)
        __syncthreads(); // ... everyone's; and every warp is done with item k - NSPL
        if (k + NSPL < nitems)
            issue(k + NSPL, st ^ 1); // overlaps this item's math
        cp_commit();
        const uint16_t *Qs = Qb + st * 2 * RQ * KP, *dOs = Qs + RQ * KP;
        const float *Ls = Lb + st * RQ, *Ds = Db + st * RQ;
        const int *Qo = Qob + st * RQ, *Lo = Lob + st * RQ;
        int b = tl[k / p.nch], ch = k % p.nch;
        int anc = p.anchor[b], ds = p.doc_start[b];
        int lo0 = ctx_lo(anc, ds, p.W, 0), lohi = ctx_lo(anc, ds, p.W, p.bs - 1);
        // the warp pair's 32 keys: invisible to every row of the item (skip
        // both phases: nobody else reads their P^T / dS^T rows), or visible
        // to every row (no per-element mask)
        bool dead = k0 >= anc || k0 + 32 <= lo0;
        if (dead)
            continue;
        bool full = (ch + 1) * RQ <= p.bs * p.group && k0 >= lohi && k0 + 32 <= anc;
        // S phase: keys k0 .. k0 + 31 (2 m tiles) x rows 32 hw .. + 31 (4 n tiles)
        {
            float s[2][4][4], dp[2][4][4];
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        s[m][nt][e] = 0.0f, dp[m][nt][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    uint32_t ka[4], va[4];
                    ldsm_a<KP>(ka, Ks, 32 * kq + 16 * m, ks * 16, lane);
                    ldsm_a<KP>(va, Vs, 32 * kq + 16 * m, ks * 16, lane);
                    mma_rows<4, KP>(s[m], ka, Qs, 32 * hw, ks * 16, lane);
                    mma_rows<4, KP>(dp[m], va, dOs, 32 * hw, ks * 16, lane);
                }
            }
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int r = 32 * hw + nt * 8 + 2 * t4 + (e & 1);
                        float Lr = Ls[r], P;
                        if (full) {
                            P = exp2f(s[m][nt][e] * sl - Lr);
                            dp[m][nt][e] = P * (dp[m][nt][e] - Ds[r]);
                        } else {
                            int key = k0 + 16 * m + gid + (e >> 1) * 8;
                            bool vis = Lr != -INFINITY && visible(true, key, anc, Lo[r], Qo[r], p.W);
                            P = vis ? exp2f(s[m][nt][e] * sl - Lr) : 0.0f;
                            dp[m][nt][e] = vis ? P * (dp[m][nt][e] - Ds[r]) : 0.0f;
                        }
                        s[m][nt][e] = P;
                    }
            // bf16 P^T, dS^T -> [key][row] (rows 2 t4, 2 t4 + 1 packed)
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int hi = 0; hi < 2; hi++) {
                        int o = (32 * kq + 16 * m + gid + 8 * hi) * PTP + 32 * hw + nt * 8 + 2 * t4;
                        *reinterpret_cast<uint32_t *>(Pt + o) =
                            pack_bf2(s[m][nt][2 * hi], s[m][nt][2 * hi + 1]);
                        *reinterpret_cast<uint32_t *>(dSt + o) =
                            pack_bf2(dp[m][nt][2 * hi], dp[m][nt][2 * hi + 1]);
                    }
        }
        bar_pair(1 + kq); // the pair's P^T / dS^T rows are complete
        // A phase: keys k0 .. k0 + 31 x head dims hw D/2 .. + D/2 - 1, over the RQ rows
        {
            const uint16_t *dOc = dOs + hw * (D / 2), *Qc = Qs + hw * (D / 2);
#pragma unroll
            for (int kk = 0; kk < RQ / 16; kk++) {
                uint32_t pa[2][4], sa[2][4];
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    ldsm_a<PTP>(pa[m], Pt, 32 * kq + 16 * m, kk * 16, lane);
                    ldsm_a<PTP>(sa[m], dSt, 32 * kq + 16 * m, kk * 16, lane);
                }
#pragma unroll
                for (int nd = 0; nd < NTH; nd += 2) {
                    uint32_t r[4], q[4];
                    int ro = (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * KP + (nd + (lane >> 4)) * 8;
                    ldsm4t(r, dOc + ro);
                    ldsm4t(q, Qc + ro);
#pragma unroll
                    for (int m = 0; m < 2; m++) {
                        mma16816(av[m][nd], pa[m], r[0], r[1]);
                        mma16816(av[m][nd + 1], pa[m], r[2], r[3]);
                        mma16816(ak[m][nd], sa[m], q[0], q[1]);
                        mma16816(ak[m][nd + 1], sa[m], q[2], q[3]);
                    }
                }
            }
        }
        // the next S phase rewrites these P^T rows: the __syncthreads at the
        // top of the loop orders it after this A phase
    }
    cp_wait<0>();
    size_t n = (size_t)p.S * ldk;
    float *pk = part + (size_t)split * 2 * n, *pv = pk + n;
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {
            int key = k0 + 16 * m + gid + 8 * hi;
            if (key >= kend)
                continue;
            size_t off = (size_t)key * ldk + (size_t)g * D + hw * (D / 2) + 2 * t4;
#pragma unroll
            for (int nd = 0; nd < NTH; nd++) {
                *reinterpret_cast<float2 *>(pk + off + nd * 8) =
                    make_float2(ak[m][nd][2 * hi] * p.scale, ak[m][nd][2 * hi + 1] * p.scale);
                *reinterpret_cast<float2 *>(pv + off + nd * 8) =
                    make_float2(av[m][nd][2 * hi], av[m][nd][2 * hi + 1]);
            }
        }
}

// ---- the dQ pass's longest-first CTA order (WG2, WG2F) ----
// A dQ grid in (block, kv head, chunk) order runs the trainer's blocks
// sorted by anchor, so the CTAs with the longest context spans start last
// and the pass ends in a tail of them (one 4096-token document: spans 0 ..
// ~4096 keys). dq_order_kernel builds an order of the items (block, chunk) on
// the device: descending key-tile count, ties by index (LPT), kv head
// fastest. Same math, same sum order per element: the order changes no bit.
// Gain with dq_mma2_kernel (H200, bench_dflash_attn): dQ 2.014 -> 1.964 ms,
// backward 5.53 -> 5.49 ms on the 1doc full layer, 4.29 -> 4.26 sliding;
// none on 3docs (within noise): the tail was small.
// Where MMA4's backward goes (ms, the bench's pass events; 3docs full / 1doc
// full): Di 0.048 / 0.048, dQ 0.745 / 2.014 (~215-235 TFLOP/s counting its 3
// products), context tile lists 0.008, context dK/dV 1.264 / 3.312 (~165-190
// TFLOP/s counting its 4 products), block-key dK/dV 0.160 / 0.161 (tiny work:
// ~25 TFLOP/s), reduction 0.038 / 0.038. The context dK/dV is the largest
// and least efficient pass (ncu: latency bound, 2 warps per scheduler, shared
// pipe the busiest at 26%, 7.4 cycles per issued instruction).
// Measured and dropped (H200, bench_dflash_attn, dQ pass 0.744 ms / 2.00 ms
// for dq_mma2_kernel at 3docs / 1doc full): CTAs of two items (2 x 64 rows
// of neighbouring anchors, 8 warps) sharing each K/V tile, with Q / dO
// fragments in registers (248 regs, 1 CTA/SM, 64-key tiles, 3-stage ring):
// 0.848 / 2.17 ms; with Q / dO in shared memory (128 regs, 2 CTAs/SM, 32-key
// tiles): 0.835 / 2.22 ms, shared-memory bound (L1/shared 68%, 12.4 cycles
// per issued instruction). dq_mma2_kernel itself (ncu): latency bound, 2
// warps per scheduler, 0.39 eligible, tensor pipe 34%, 6.05 cycles per issued
// instruction (35% waiting on fixed-latency dependencies).
constexpr int NL_ORDER = 1024; // threads of dq_order_kernel

// out[rank] = i for i < n, ranked by (key(i), i) ascending. Call from every
// thread of a CTA of NL_ORDER threads (the loops and barriers are CTA-uniform).
// O(n^2 / NL_ORDER) shared-memory compares: 512 items take a few microseconds.
template <typename K>
__device__ __forceinline__ void rank_sort(int n, K key, int *out, unsigned long long *sh)
{
    for (int i0 = 0; i0 < n; i0 += NL_ORDER) {
        int i = i0 + threadIdx.x, r = 0;
        unsigned long long ki = i < n ? key(i) : 0ull;
        for (int j0 = 0; j0 < n; j0 += NL_ORDER) {
            __syncthreads(); // the previous chunk of keys is read
            sh[threadIdx.x] = j0 + threadIdx.x < n ? key(j0 + threadIdx.x) : 0ull;
            __syncthreads();
            int m = n - j0 < NL_ORDER ? n - j0 : NL_ORDER;
            if (i < n)
                for (int jj = 0; jj < m; jj++) {
                    unsigned long long kj = sh[jj];
                    r += kj < ki || (kj == ki && j0 + jj < i);
                }
        }
        if (i < n)
            out[r] = i;
    }
}

// order[rank] = item (b nch + ch), by descending dq_mma2 tile count (padding
// blocks: 0), ties by index. Any permutation is correct; this one is LPT.
__global__ void __launch_bounds__(NL_ORDER) dq_order_kernel(Params p, int *order)
{
    __shared__ unsigned long long sh[NL_ORDER];
    rank_sort(p.nb * p.nch, [&](int it) -> unsigned long long {
        int b = it / p.nch, n = 0;
        if (p.valid[b]) {
            int anc = p.anchor[b], lo0 = ctx_lo(anc, p.doc_start[b], p.W, 0);
            n = (anc - lo0 + TKQ - 1) / TKQ + (p.bs + TKQ - 1) / TKQ;
        }
        return (unsigned long long)(0x7fffffff - n);
    }, order, sh);
}

constexpr size_t fwd_smem(int D) { return ((size_t)(RQ + 2 * TK) * (D + 4) + RQ * PP) * 4; }
constexpr size_t dq_smem(int D) { return ((size_t)(2 * RQ + 2 * TK) * (D + 4) + RQ * PP) * 4; }
constexpr size_t dkv_smem(int D) { return ((size_t)(2 * RQ + 2 * TK) * (D + 4) + 2 * RQ * PP) * 4; }

// Whether impl is 0 (the defaults) or an implementation this file has. The
// retired values (DF_CUDA_DFLASH_IMPL_* 2, 3, 4, 6, 7) are not.
bool impl_known(int impl)
{
    return impl == 0 || impl == DF_CUDA_DFLASH_IMPL_SIMT || impl == DF_CUDA_DFLASH_IMPL_MMA4 ||
           impl == DF_CUDA_DFLASH_IMPL_WG2 || impl == DF_CUDA_DFLASH_IMPL_WG2F || impl == DF_CUDA_DFLASH_IMPL_WG3;
}

int check_args(const df_cuda_dflash_args *a, bool bwd)
{
    if (!a || a->S < 0 || a->n_blocks < 0 || a->block_size < 1 || a->window < 0 || a->nq < 1 ||
        a->nkv < 1 || a->nq % a->nkv || (a->head_dim != 64 && a->head_dim != 128) ||
        !(a->scale == a->scale) || !impl_known(a->impl))
        return -EINVAL;
    if (!a->anchor || !a->doc_start || !a->valid || !a->q || !a->kc || !a->vc || !a->kb ||
        !a->vb || !a->out || !a->lse)
        return -EINVAL;
    if (bwd && (!a->dout || !a->dq || !a->dkc || !a->dvc || !a->dkb || !a->dvb))
        return -EINVAL;
    return 0;
}

Params make_params(const df_cuda_dflash_args *a)
{
    Params p;
    p.S = a->S, p.nb = a->n_blocks, p.bs = a->block_size, p.W = a->window;
    p.nq = a->nq, p.nkv = a->nkv, p.group = a->nq / a->nkv;
    p.nch = (p.bs * p.group + RQ - 1) / RQ;
    p.scale = a->scale;
    p.anchor = a->anchor, p.doc_start = a->doc_start, p.valid = a->valid;
    p.q = a->q, p.kc = a->kc, p.vc = a->vc, p.kb = a->kb, p.vb = a->vb;
    p.out = a->out, p.dout = a->dout, p.o = a->out;
    p.dq = a->dq, p.dkc = a->dkc, p.dvc = a->dvc, p.dkb = a->dkb, p.dvb = a->dvb;
    p.lse = a->lse, p.lse_in = a->lse, p.Di = NULL;
    return p;
}

#define CU(x)                                                                            \
    do {                                                                                 \
        cudaError_t e_ = (x);                                                            \
        if (e_ != cudaSuccess) {                                                         \
            fprintf(stderr, "dflash_attn: %s: %s (%s:%d)\n", #x, cudaGetErrorString(e_), \
                    __FILE__, __LINE__);                                                 \
            return -EIO;                                                                 \
        }                                                                                \
    } while (0)
// fn's dynamic shared memory opt-in, within what the device (or
// DFLASH_PORTABLE=1) allows: returns -ENOTSUP / -EIO from the caller otherwise
#define SMEM(fn, bytes)                                                  \
    do {                                                                 \
        int smem_rc_ = df_cuda_func_smem((const void *)(fn), (bytes));   \
        if (smem_rc_)                                                    \
            return smem_rc_;                                             \
    } while (0)

template <int D>
int fwd_launch(const Params &p, cudaStream_t st, int impl)
{
    long long n = (long long)p.nb * p.nkv * p.nch;
    if (n == 0)
        return 0;
    if (impl == DF_CUDA_DFLASH_IMPL_SIMT) {
        SMEM(fwd_kernel<D>, fwd_smem(D));
        fwd_kernel<D><<<(unsigned)n, NT, fwd_smem(D), st>>>(p);
        CU(cudaGetLastError());
        return 0;
    }
    // WG2, WG2F: the wgmma forward (dflash_attn/wg_fwd.cu) where the device runs it
    if ((impl == DF_CUDA_DFLASH_IMPL_WG2 || impl == DF_CUDA_DFLASH_IMPL_WG2F || impl == DF_CUDA_DFLASH_IMPL_WG3) &&
        df_dflash::fwd_wg_usable(D)) {
        int rc = df_dflash::fwd_wg_launch(p, D, st);
        if (rc != -EOPNOTSUPP) // (no tensor maps for these tensors: MMA4's below)
            return rc;
    }
    // MMA4, and WG2 / WG2F elsewhere
    SMEM(fwd_mma2_kernel<D>, fwd3_smem<D>());
    fwd_mma2_kernel<D><<<(unsigned)n, MW * 32, fwd3_smem<D>(), st>>>(p);
    CU(cudaGetLastError());
    return 0;
}

// Bytes of the backward workspace before the dK/dV partials (Di), rounded up.
size_t di_bytes(const df_cuda_dflash_args *a)
{
    size_t n = (size_t)a->n_blocks * (size_t)a->block_size * (size_t)a->nq * sizeof(float);
    return (n + 255) / 256 * 256;
}

// Records pass event i (args.pass_events) on the stream, if asked for.
#define REC(ev, i, st)                                   \
    do {                                                 \
        if (ev)                                          \
            CU(cudaEventRecord((ev)[i], st));            \
    } while (0)

// The dQ pass on dq_mma2_kernel: its CTAs in dq_order's order (LPT) where
// given, else in grid order.
template <int D>
int dq_mma2_launch(const Params &p, cudaStream_t st, const int *dq_order)
{
    unsigned n = (unsigned)((long long)p.nb * p.nkv * p.nch);
    if (dq_order) {
        SMEM((dq_mma2_kernel<D, true>), dq3_smem<D>());
        dq_mma2_kernel<D, true><<<n, MW * 32, dq3_smem<D>(), st>>>(p, dq_order);
    } else {
        SMEM((dq_mma2_kernel<D, false>), dq3_smem<D>());
        dq_mma2_kernel<D, false><<<n, MW * 32, dq3_smem<D>(), st>>>(p, nullptr);
    }
    CU(cudaGetLastError());
    return 0;
}

// MMA4's backward where dkv4_kernel does not fit the device's shared memory
// (sm_80's 163 KiB, sm_86/89/120's 99 KiB): Di, then dkv_mma2_kernel for the
// context and the block keys alike, the split reduction; the dQ either from
// the dS^T that pass stores (dsd, block_size <= TKM: dq_dsd_kernel, one
// product instead of three) or, where dsd is NULL, dq_mma2_kernel before it.
template <int D>
int bwd_mma2_launch(const Params &p, cudaStream_t st, float *part, uint16_t *dsd, cudaEvent_t *ev)
{
    REC(ev, 0, st);
    long long rows = (long long)p.nb * p.bs;
    if (rows > 0) {
        long long w = rows * p.nq;
        di_kernel<D><<<(unsigned)((w * 32 + NT - 1) / NT), NT, 0, st>>>(p);
        CU(cudaGetLastError());
        REC(ev, 1, st);
        if (!dsd) {
            int rc = dq_mma2_launch<D>(p, st, nullptr);
            if (rc)
                return rc;
        }
    } else {
        REC(ev, 1, st);
    }
    REC(ev, 2, st);
    REC(ev, 3, st);
    long long nct = (p.S + TKM - 1) / TKM, ctas = nct * p.nkv * NSPL +
                                              (long long)p.nb * ((p.bs + TKM - 1) / TKM) * p.nkv;
    if (ctas > 0) {
        int dev;
        CU(cudaGetDevice(&dev));
        if ((size_t)df_cuda_smem_optin(dev) >= dkv3_smem<D>()) {
            SMEM(dkv_mma2_kernel<D>, dkv3_smem<D>());
            dkv_mma2_kernel<D><<<(unsigned)ctas, MW * 32, dkv3_smem<D>(), st>>>(p, part, 0, dsd);
        } else {
            SMEM((dkv_mma2_kernel<D, 1>), (dkv3_smem<D, 1>()));
            dkv_mma2_kernel<D, 1><<<(unsigned)ctas, MW * 32, dkv3_smem<D, 1>(), st>>>(p, part, 0, dsd);
        }
        CU(cudaGetLastError());
    }
    REC(ev, 4, st); // context and block keys in one kernel
    if (dsd && rows > 0) { // (its pass event: [5], as WG3's dQ from its stored dS)
        SMEM(dq_dsd_kernel<D>, dq_dsd_smem<D>());
        dq_dsd_kernel<D><<<(unsigned)((long long)p.nb * p.nkv * p.nch), MW * 32, dq_dsd_smem<D>(), st>>>(p, dsd);
        CU(cudaGetLastError());
    }
    REC(ev, 5, st);
    size_t n = (size_t)p.S * p.nkv * D;
    if (n > 0) {
        dkv_reduce_kernel<<<(unsigned)((n / 4 + NT - 1) / NT), NT, 0, st>>>(part, n, p.dkc, p.dvc);
        CU(cudaGetLastError());
    }
    REC(ev, 6, st);
    return 0;
}

// Bytes of the fp32 context dK/dV partials, rounded up.
size_t part_bytes(const df_cuda_dflash_args *a)
{
    size_t n = (size_t)NSPL * 2 * (size_t)a->S * (size_t)a->nkv * (size_t)a->head_dim * sizeof(float);
    return (n + 255) / 256 * 256;
}

// Bytes of the context tile lists (cnt, order, lst: ints), after the partials.
size_t list_bytes(const df_cuda_dflash_args *a)
{
    size_t nct = ((size_t)a->S + TK4 - 1) / TK4;
    return (nct * (2 + (size_t)a->n_blocks) * sizeof(int) + 255) / 256 * 256;
}

// WG3's dQ item counter (256 bytes) and stored dS (dflash_attn/wg_dqs.cu), after the dQ item order: the
// block tiles' dS^T, the context tiles' (room for every span at its widest);
// 0 for the other implementations
size_t dsb_bytes(const df_cuda_dflash_args *a)
{
    return (size_t)(a->n_blocks > 0 ? a->n_blocks : 0) * (size_t)(a->nkv > 0 ? a->nkv : 0) * df_dflash::DS_BLK_BYTES;
}
size_t wg3_bytes(const df_cuda_dflash_args *a)
{
    int impl = a->impl ? a->impl : df_cuda_dflash_bwd_impl();
    if (impl != DF_CUDA_DFLASH_IMPL_WG3)
        return 0;
    return 256 + dsb_bytes(a) + (size_t)(a->n_blocks > 0 ? a->n_blocks : 0) * (size_t)(a->nkv > 0 ? a->nkv : 0) *
                              (size_t)df_dflash::dqs_max_tiles(a->S, a->window) * df_dflash::DS_TILE_BYTES;
}

// Bytes of the one-stage backward's dS^T store (bwd_mma2_launch's dsd), after
// everything else: where an implementation other than SIMT runs
// bwd_mma2_launch on the current device (dkv4_kernel does not fit its shared
// memory) and block_size <= TKM; else 0.
size_t dsd_bytes(const df_cuda_dflash_args *a)
{
    int impl = a->impl ? a->impl : df_cuda_dflash_bwd_impl();
    int dev = 0;
    if (impl == DF_CUDA_DFLASH_IMPL_SIMT || a->block_size > TKM || a->n_blocks <= 0 || a->nkv <= 0 ||
        cudaGetDevice(&dev) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    size_t need = a->head_dim == 64 ? dkv4_smem<64>() : dkv4_smem<128>();
    if ((size_t)df_cuda_smem_optin(dev) >= need)
        return 0;
    Params p = make_params(a);
    return dsd_slot(p, p.nb, 0, 0, 0) * (size_t)(TKM * RQ) * 2;
}

// Bytes of the dQ item order (WG2's: n_blocks * chunks ints), after the lists.
size_t order_bytes(const df_cuda_dflash_args *a)
{
    size_t group = a->nkv > 0 && a->nq >= a->nkv ? (size_t)(a->nq / a->nkv) : 1;
    size_t bs = a->block_size > 0 ? (size_t)a->block_size : 0, nb = a->n_blocks > 0 ? (size_t)a->n_blocks : 0;
    size_t nch = (bs * group + RQ - 1) / RQ;
    return (nb * nch * sizeof(int) + 255) / 256 * 256;
}

// MMA4 (wg2 false): Di, dQ (dq_mma2_kernel), the tile lists and their LPT
// order, the context dK/dV (dkv4_kernel), the block-key dK/dV
// (dkv_mma2_kernel, block tiles only), the split reduction. WG2 (wg2): the
// dQ on wgmma (df_dflash::dq_wg_launch, its blocks last to first) and the
// context dK/dV on wgmma (df_dflash::dkv_wg_launch), each where the device
// runs it, else dq_mma2_kernel with its CTAs longest first (dq_order_kernel
// into dq_order) / dkv4_kernel. WG2F (wg2 and fold): where
// the wgmma dQ runs and p.nch == 1 (a block's bs x group rows of a kv head in
// one chunk, so bs <= 64: one block tile), its fold instantiation also writes
// Di (for the context dK/dV pass, the only later reader; bitwise
// di_kernel's) and the block-key dK/dV, and di_kernel and the block tiles'
// dkv_mma2_kernel are not launched (their pass events are recorded right
// after the previous ones); elsewhere WG2's launches.
template <int D>
int bwd_mma4_launch(const Params &p, cudaStream_t st, float *part, int *lists, int *dq_order,
                    bool wg2, bool fold, cudaEvent_t *ev, const df_dflash::DsBuf *dsb0, uint16_t *dsd)
{
    // dkv4 needs 174 KiB (D 128) of shared memory per CTA: more than sm_80's
    // 163 KiB and the 99 KiB of sm_86/89/120 (and of DFLASH_PORTABLE=1). There,
    // bwd_mma2_launch runs instead.
    int dev, smax;
    CU(cudaGetDevice(&dev));
    smax = df_cuda_smem_optin(dev);
    if ((size_t)smax < dkv4_smem<D>())
        return bwd_mma2_launch<D>(p, st, part, dsd, ev);
    REC(ev, 0, st);
    long long rows = (long long)p.nb * p.bs;
    // the wgmma dQ pass's K / V tensor maps (TMA); none: dq_mma2_kernel
    df_dflash::KvMaps maps;
    const bool wgdq_on = wg2 && df_dflash::dq_wg_usable(D, false) && df_dflash::kv_maps_make(p, D, &maps) == 0;
    const bool fold_on = fold && wgdq_on && p.nch == 1 && df_dflash::dq_wg_usable(D, true);
    // WG3 (dsb0): a block pass (Di, the block keys' dK/dV, the block tiles'
    // dS^T), the context dK/dV pass storing dS^T, then dQ from both
    // (dflash_attn/wg_dqs.cu), where the fold would run with 16-key block
    // tiles and TMA-fed Q / dO, the context dK/dV pass takes its TMA-fed
    // instantiation and the device runs WG3's kernels; else WG2F's passes
    const bool wg3_on = dsb0 && fold_on && p.bs <= 16 && maps.qd_on && df_dflash::dkv_wg_usable(p, D) &&
                        df_dflash::dkv_wg_tq(p, D, &maps) && df_dflash::dqs_usable(D) &&
                        df_dflash::blk_wg_usable(D);
    const df_dflash::DsBuf *dsb = wg3_on ? dsb0 : NULL;
    if (rows > 0) {
        if (!fold_on) { // (fold_on: the dQ pass computes Di)
            long long w = rows * p.nq;
            di_kernel<D><<<(unsigned)((w * 32 + NT - 1) / NT), NT, 0, st>>>(p);
            CU(cudaGetLastError());
        }
        REC(ev, 1, st);
        if (wg2 && !wgdq_on) { // (the wgmma dQ runs its blocks last to first)
            dq_order_kernel<<<1, NL_ORDER, 0, st>>>(p, dq_order);
            CU(cudaGetLastError());
        }
        // (the wgmma dQ pass takes dq_order[0] as its items' counter)
        // (WG3: its block pass, blk_wg_kernel, in place of the dQ pass)
        int rc = wg3_on    ? df_dflash::blk_wg_launch(p, D, st, maps, *dsb)
                 : wgdq_on ? df_dflash::dq_wg_launch(p, D, st, fold_on, maps, dq_order)
                           : dq_mma2_launch<D>(p, st, wg2 ? dq_order : nullptr);
        if (rc)
            return rc;
    } else {
        REC(ev, 1, st);
    }
    REC(ev, 2, st);
    int nct = (p.S + TK4 - 1) / TK4;
    if (nct > 0) {
        int *cnt = lists, *order = cnt + nct, *lst = order + nct;
        // (WG3: programmatic dependents)
        const bool pdl = dsb && dsb->pdl;
        Params pa = p;
        int tk = TK4;
        void *la[4] = {&pa, &tk, &cnt, &lst};
        CU(launch_pdl((const void *)tile_list_kernel, dim3((unsigned)nct), dim3(NT), 0, st, pdl, la));
        void *oa[3] = {&cnt, &nct, &order};
        CU(launch_pdl((const void *)tile_order_kernel, dim3(1), dim3(1024), 0, st, pdl, oa));
        REC(ev, 3, st);
        if (wg2 && df_dflash::dkv_wg_usable(p, D)) {
            int rc = df_dflash::dkv_wg_launch(p, D, st, part, cnt, lst, order, nct,
                                              wgdq_on ? &maps : nullptr, dsb);
            if (rc)
                return rc;
        } else {
            SMEM(dkv4_kernel<D>, dkv4_smem<D>());
            dkv4_kernel<D><<<(unsigned)((long long)nct * p.nkv * NSPL), NW4 * 32, dkv4_smem<D>(),
                             st>>>(p, part, cnt, lst, order);
            CU(cudaGetLastError());
        }
    } else {
        REC(ev, 3, st);
    }
    REC(ev, 4, st);
    // WG3's dQ (its pass event: [5]); its kernel also does the split reduction
    if (wg3_on) {
        df_dflash::DsBuf d = *dsb;
        d.part = part;
        int rc = df_dflash::dqs_launch(p, D, st, maps, d);
        if (rc)
            return rc;
    }
    // block tiles: dkv_mma2_kernel, its CTA ids offset past its context CTAs
    // (fold_on: done in the dQ pass)
    long long nct2 = (p.S + TKM - 1) / TKM, ctx2 = nct2 * p.nkv * NSPL,
              nbt = (long long)p.nb * ((p.bs + TKM - 1) / TKM) * p.nkv;
    if (nbt > 0 && !fold_on) {
        SMEM(dkv_mma2_kernel<D>, dkv3_smem<D>());
        dkv_mma2_kernel<D><<<(unsigned)nbt, MW * 32, dkv3_smem<D>(), st>>>(p, part, (int)ctx2, nullptr);
        CU(cudaGetLastError());
    }
    REC(ev, 5, st);
    size_t n = (size_t)p.S * p.nkv * D;
    if (n > 0 && !wg3_on) { // (WG3: in its dQ kernel)
        uint16_t *dk = p.dkc, *dv = p.dvc;
        void *ra[4] = {&part, &n, &dk, &dv};
        CU(launch_pdl((const void *)dkv_reduce_kernel, dim3((unsigned)((n / 4 + NT - 1) / NT)), dim3(NT), 0, st,
                      dsb && dsb->pdl, ra));
    }
    REC(ev, 6, st);
    return 0;
}

// SIMT: Di, dQ, then the context and block keys' dK/dV in one kernel.
template <int D>
int bwd_simt_launch(const Params &p, cudaStream_t st)
{
    long long rows = (long long)p.nb * p.bs;
    if (rows > 0) {
        long long w = rows * p.nq;
        di_kernel<D><<<(unsigned)((w * 32 + NT - 1) / NT), NT, 0, st>>>(p);
        CU(cudaGetLastError());
        unsigned n = (unsigned)((long long)p.nb * p.nkv * p.nch);
        SMEM(dq_kernel<D>, dq_smem(D));
        dq_kernel<D><<<n, NT, dq_smem(D), st>>>(p);
        CU(cudaGetLastError());
    }
    long long tiles = (p.S + TK - 1) / TK + (long long)p.nb * ((p.bs + TK - 1) / TK);
    if (tiles > 0) {
        SMEM(dkv_kernel<D>, dkv_smem(D));
        dkv_kernel<D><<<(unsigned)(tiles * p.nkv), NT, dkv_smem(D), st>>>(p);
        CU(cudaGetLastError());
    }
    return 0;
}

} // namespace

extern "C" size_t df_cuda_dflash_bwd_workspace_bytes(const df_cuda_dflash_args *a)
{
    if (!a)
        return 0;
    size_t n = di_bytes(a) + part_bytes(a) + list_bytes(a) + order_bytes(a) + wg3_bytes(a) + dsd_bytes(a);
    return n ? n : 4;
}

namespace {
int g_bwd_impl; // df_cuda_dflash_set_bwd_impl; 0: none

// A switch, read once (racing first calls compute the same value): on
// unless the variable is set to 0. DFLASH_ATTN_PDL: WG3's kernels after the
// first launched as programmatic dependents (DsBuf.pdl).
int g_env_pdl = -1;
bool env_on(const char *name, int *v)
{
    if (*v < 0) {
        const char *e = getenv(name);
        *v = !(e && e[0] == '0');
    }
    return *v != 0;
}

// DFLASH_ATTN_BWD, read once (0: unset or unknown). The retired names (mma,
// mma2, mma3, mma5, wg) are unknown names: a warning, then the default.
int env_bwd_impl()
{
    static int v = -1; // racing first calls compute the same value
    if (v < 0) {
        static const struct {
            const char *nm;
            int impl;
        } tab[] = {{"simt", DF_CUDA_DFLASH_IMPL_SIMT},
                   {"mma4", DF_CUDA_DFLASH_IMPL_MMA4},
                   {"wg2", DF_CUDA_DFLASH_IMPL_WG2},
                   {"wg2f", DF_CUDA_DFLASH_IMPL_WG2F},
                   {"wg3", DF_CUDA_DFLASH_IMPL_WG3}};
        const char *e = getenv("DFLASH_ATTN_BWD");
        int r = 0;
        if (e && *e) {
            for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
                if (!strcmp(e, tab[i].nm))
                    r = tab[i].impl;
            if (!r)
                fprintf(stderr, "dflash_attn: DFLASH_ATTN_BWD=%s is none of simt, mma4, wg2, wg2f, wg3 "
                                "(mma, mma2, mma3, mma5 and wg were removed): the default "
                                "backward\n", e);
        }
        v = r;
    }
    return v;
}
} // namespace

extern "C" int df_cuda_dflash_set_bwd_impl(int impl)
{
    if (!impl_known(impl))
        return -EINVAL;
    g_bwd_impl = impl;
    return 0;
}

extern "C" int df_cuda_dflash_bwd_impl(void)
{
    if (g_bwd_impl)
        return g_bwd_impl;
    int e = env_bwd_impl();
    if (e)
        return e;
    // the built-in default of the current device
    return df_cuda_hopper_kernels() ? DF_CUDA_DFLASH_IMPL_DEFAULT_BWD_SM90 : DF_CUDA_DFLASH_IMPL_DEFAULT_BWD;
}

extern "C" int df_cuda_dflash_fwd_impl(void)
{
    return df_cuda_hopper_kernels() ? DF_CUDA_DFLASH_IMPL_DEFAULT_FWD_SM90 : DF_CUDA_DFLASH_IMPL_DEFAULT_FWD;
}

extern "C" const char *df_cuda_dflash_impl_name(int impl)
{
    switch (impl) {
    case DF_CUDA_DFLASH_IMPL_SIMT:
        return "simt";
    case DF_CUDA_DFLASH_IMPL_MMA4:
        return "mma4";
    case DF_CUDA_DFLASH_IMPL_WG2:
        return "wg2";
    case DF_CUDA_DFLASH_IMPL_WG2F:
        return "wg2f";
    case DF_CUDA_DFLASH_IMPL_WG3:
        return "wg3";
    }
    return "?";
}

extern "C" int df_cuda_dflash_fwd(const df_cuda_dflash_args *a, cudaStream_t st)
{
    int rc = check_args(a, false);
    if (rc)
        return rc;
    Params p = make_params(a);
    int impl = a->impl ? a->impl : df_cuda_dflash_fwd_impl();
    return a->head_dim == 64 ? fwd_launch<64>(p, st, impl) : fwd_launch<128>(p, st, impl);
}

extern "C" int df_cuda_dflash_bwd(const df_cuda_dflash_args *a, cudaStream_t st)
{
    int rc = check_args(a, true);
    if (rc)
        return rc;
    Params p = make_params(a);
    void *ws = a->workspace;
    if (!ws)
        CU(cudaMallocAsync(&ws, df_cuda_dflash_bwd_workspace_bytes(a), st));
    p.Di = (float *)ws;
    int impl = a->impl ? a->impl : df_cuda_dflash_bwd_impl();
    if (impl == DF_CUDA_DFLASH_IMPL_SIMT) {
        rc = a->head_dim == 64 ? bwd_simt_launch<64>(p, st) : bwd_simt_launch<128>(p, st);
    } else { // MMA4, WG2, WG2F
        float *part = (float *)((char *)ws + di_bytes(a));
        int *lists = (int *)((char *)part + part_bytes(a));
        int *dq_order = (int *)((char *)lists + list_bytes(a));
        bool wg3 = impl == DF_CUDA_DFLASH_IMPL_WG3;
        bool fold = impl == DF_CUDA_DFLASH_IMPL_WG2F || wg3; // WG2 with the fold
        bool wg2 = impl == DF_CUDA_DFLASH_IMPL_WG2 || fold;
        df_dflash::DsBuf dsb; // WG3's stored dS (used where the shapes allow: bwd_mma4_launch)
        dsb.ctr = (int *)((char *)dq_order + order_bytes(a)); // (256 bytes)
        dsb.dsb = (uint16_t *)((char *)dsb.ctr + 256);
        dsb.ds = (uint16_t *)((char *)dsb.dsb + dsb_bytes(a));
        dsb.maxt = df_dflash::dqs_max_tiles(a->S, a->window);
        dsb.part = NULL; // (bwd_mma4_launch sets it)
        dsb.pdl = env_on("DFLASH_ATTN_PDL", &g_env_pdl);
        cudaEvent_t *ev = a->pass_events;
        const df_dflash::DsBuf *dp = wg3 ? &dsb : NULL;
        // the one-stage backward's dS^T store, last (NULL where it does not run)
        uint16_t *dsd = dsd_bytes(a) ? (uint16_t *)((char *)dsb.ctr + wg3_bytes(a)) : NULL;
        rc = a->head_dim == 64 ? bwd_mma4_launch<64>(p, st, part, lists, dq_order, wg2, fold, ev, dp, dsd)
                               : bwd_mma4_launch<128>(p, st, part, lists, dq_order, wg2, fold, ev, dp, dsd);
    }
    if (!a->workspace)
        CU(cudaFreeAsync(ws, st));
    return rc;
}
