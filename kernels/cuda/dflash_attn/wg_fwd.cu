// dflash_attn/wg_fwd.cu - the forward of impls DF_CUDA_DFLASH_IMPL_WG2 and
// _WG2F (dflash_attn.h) on Hopper warpgroup MMA (wgmma.mma_async, sm_90a):
// out and lse, the contract of MMA4's fwd_r32_kernel (dflash_attn/mma_fwd.cu).
//
// One CTA per (block b, kv head g, row chunk): the chunk's 64 rows (16
// queries x `group` heads of one block and kv head) share one anchor and
// one context span [lo0, anchor), so each key tile of the span is a dense
// 64 rows x FTK keys problem; then the block's own keys (kb / vb) as tiles
// of the same loop, masked per element past bs (the rows there hold the
// next block's keys, zeros past the last block); with
// block_size <= 16 one tile of 16 keys (S by wgmma m64n16k16, P V one k16
// step) instead of a 64-key tile three quarters zeros. Per tile:
//   S = Q K^T                       (fp32 accumulators)
//   online softmax in the exp2 domain, fp32 m, l per row (FlashAttention-2)
//   O = O alpha + P V               (P rounded to bf16)
// out = O / l (bf16), lse = m ln 2 + log l; rows that see nothing (padding
// blocks; chunk rows past bs x group are never written): out 0, lse -inf.
//
// CTA: one warpgroup (128 threads, wgmma M = 64 = the chunk's rows); warp w
// holds rows 16 w .. 16 w + 15. Per tile:
//   1. S: D/16 wgmma m64n64k16, A = Q (resident in shared memory, K-major),
//      B = K (the tile's stage, K-major).
//   2. the row max of the raw S over the 4 threads of a quad (2 shuffles),
//      scaled once (sl > 0 keeps the order); P = 2^fma(S, sl, -m), alpha, l;
//      O's accumulators rescaled in registers between wgmma groups (after
//      the previous P V retired). The scale is folded into the exponent's
//      fma (FlashAttention-2's), not a multiply per score first. Rescaling O
//      only where a warp's rows got a new max was tried and was slower
//      (docs/log/).
//   3. O += P V: FTK/16 wgmma m64nDk16, A = P from registers (the fp32
//      accumulator layout of a 16-key column pair is the bf16 A-fragment
//      layout of a k16 step: FlashAttention-3's P in registers), B = the V
//      stage MN-major (transposed through the descriptor).
// K and V stream as half tiles (K of tile t, then its V) through FSL = 3
// slots by TMA (one thread issues each half tile's copies, a 64-dim x
// 64-key box per 128-byte column block, from tensor maps built at launch;
// each slot has an mbarrier the copies complete and the readers wait on),
// each issued one tile ahead: K(t + 1) into the slot V(t - 1) left once
// P V(t - 1) retired, V(t + 1) into K(t)'s once S(t) retired; two CTA
// barriers per tile make those slots' reuse safe. TMA rather than each
// thread's cp.async: the 128 threads do not compute and issue 2 x 8 16-byte
// copies per tile each. Context keys past the anchor arrive as they are
// (not zeros) and are masked like the others (P = 0; the inputs are
// finite); keys past S and block rows past the last block arrive as zeros
// (TMA's out-of-bounds fill).
// Where the maps cannot be made (no driver entry point, a base address not
// 16-byte aligned) fwd_wg_launch returns -EOPNOTSUPP and the caller runs
// MMA4's forward.
// Why half tiles: two stages of whole tiles take 81 KiB and fit 2 CTAs (8
// warps) per SM, and these kernels are latency-bound (ncu: most cycles
// issue nothing); 3 slots take 65 KiB, so 3 CTAs (12 warps) fit with the
// same prefetch distance.
// Q: by TMA (one thread, the maps' 3-D box of one row chunk) where a
// block's rows of a kv head are one whole chunk (bs x group == 64), else by
// every thread's cp.async (zero-filled past the chunk's rows).
// Storage, descriptors, fences: dflash_attn/wg.cuh's conventions.
// Masking per (row, key) only on tiles not every row sees whole.
// Resources (ptxas, sm_90a): D 128: ~140 registers, no spills, 65 KiB of
// dynamic shared memory (16 + 3 x 16 KiB, 4 mbarriers, 1 KiB alignment
// slack): 3 CTAs per SM (__launch_bounds__ caps registers at 170; the
// carveout asks for the most shared memory); D 64: ~103 registers, 33 KiB.
// No "wgmma serialization" warning.
// The grid runs the blocks last to first (see the kernel).
// Portability: body in sm_90a code only; fwd_wg_usable() false elsewhere
// (the forward then runs fwd_r32_kernel); the non-sm_90a body traps.
// Tried and slower than this kernel (docs/log/): S of tile t + 1 issued
// before the softmax of tile t (FlashAttention-3's intra-warpgroup overlap),
// a persistent grid, a producer warpgroup feeding two consumers that share
// K / V tiles between neighbouring anchors, three stages of whole tiles
// (113 KiB, still 2 CTAs per SM), and the block's keys appended to the
// context span (one key sequence lo0 .. anc + bs - 1).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>

#include "common.cuh"
#include "../tma_map.h"
#include "wg.cuh" // DF_WG_BODY (sm_90a code), the wgmma / cp.async / swizzle helpers

namespace df_dflash {
namespace {

constexpr int FNT = 128; // threads: one warpgroup
constexpr int FTK = 64;  // keys per tile (S: n 64; P V: 4 k steps of 16)
constexpr int FSL = 3;   // K / V half-tile slots: half h (K of tile h / 2, or V) in slot h % 3

// Shared memory, bytes from a 1024-aligned base: Q at 0, slot s at KV_OFF +
// s KV. D 128: 16 + 3 x 16 KiB.
template <int D> struct FwdLayout {
    static constexpr int NH = D / 64;
    static constexpr int QS = NH * CHUNK_ROWS * 128;
    static constexpr int KV = NH * FTK * 128;
    static constexpr int KV_OFF = QS;
    static constexpr int BAR_OFF = KV_OFF + FSL * KV; // one mbarrier (8 bytes) per slot
    // + the Q tile's mbarrier (TMA, maps.q_on) after the slots'
    static constexpr size_t SMEM = (size_t)BAR_OFF + (FSL + 1) * 8 + 1024; // + alignment slack
};

static_assert(FTK == WG_KV_BOX, "the tensor maps' box is one key tile");

template <int D>
__global__ void __launch_bounds__(FNT, 3) fwd_wg_kernel(Params p, const __grid_constant__ KvMaps maps)
{
#if DF_WG_BODY
    using L = FwdLayout<D>;
    constexpr int V8 = D / 8, KS = D / 16, NA = D / 2; // NA: O accumulators per thread
    constexpr uint32_t KM_LBO = 16, SBO = 1024, MN_LBO = FTK * 128;
    constexpr float LN2 = 0.6931471805599453f;
    extern __shared__ __align__(1024) uint8_t wf_smem[];
    const uint32_t s0 = smem_u32(wf_smem), sb = (s0 + 1023u) & ~1023u;
    const int tid = threadIdx.x, lane = tid & 31, gid = lane >> 2, t4 = lane & 3;
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    // Blocks last to first: a row's anchors ascend within each document, so
    // the CTAs with the longest context spans start first and the grid ends
    // on short ones (the wgmma dQ pass runs the same order). Same work per CTA, same
    // bits.
    const int ch = blockIdx.x % p.nch, g = (blockIdx.x / p.nch) % p.nkv,
              b = p.nb - 1 - (int)(blockIdx.x / (p.nch * p.nkv));
    const long long ldq = (long long)p.nq * D;
    if (!p.valid[b]) {
        for (int e = tid; e < CHUNK_ROWS * V8; e += FNT) {
            RowId id = row_id(p, b, g, ch, e / V8);
            if (!id.ok)
                continue;
            *reinterpret_cast<uint4 *>(p.o + id.grow * ldq + (long long)id.h * D + (e % V8) * 8) =
                make_uint4(0u, 0u, 0u, 0u);
            if (e % V8 == 0)
                p.lse[(long long)id.grow * p.nq + id.h] = -INFINITY;
        }
        return;
    }
    const int anc = p.anchor[b], ds = p.doc_start[b];
    const int lo0 = ctx_lo(anc, ds, p.W, 0), lohi = ctx_lo(anc, ds, p.W, p.bs - 1);
    const int ntc = (anc - lo0 + FTK - 1) / FTK, ntb = (p.bs + FTK - 1) / FTK, nt = ntc + ntb;
    // the slots' mbarriers, initialised before any copy
    const uint32_t bar0 = sb + L::BAR_OFF;
    if (tid == 0) {
        for (int i = 0; i < FSL + 1; i++)
            mbar_init(bar0 + 8 * i, 1);
        mbar_fence_init();
    }
    // Q of the chunk, waited for before the first tile: by TMA where the
    // block's rows of kv head g are one whole chunk (maps.q_on; thread 0,
    // mbarrier FSL), else by cp.async (zero-filled past its rows)
    if (maps.q_on) {
        if (tid == 0) {
            const uint32_t qb = bar0 + 8 * FSL;
            mbar_expect_tx(qb, (uint32_t)L::QS);
#pragma unroll
            for (int cb = 0; cb < L::NH; cb++)
                tma_load_3d(sb + cb * (CHUNK_ROWS * 128), &maps.q, 64 * cb, g * p.group, b * p.bs, qb);
        }
    } else {
        for (int e = tid; e < CHUNK_ROWS * V8; e += FNT) {
            int r = e / V8, c = e % V8;
            RowId id = row_id(p, b, g, ch, r);
            long long off = id.ok ? id.grow * ldq + (long long)id.h * D + c * 8 : 0;
            cp16(sb + (uint32_t)sw_off(r, c, CHUNK_ROWS), p.q + off, id.ok);
        }
        cp_commit();
    }
    __syncthreads(); // the mbarriers' inits
    // half h of the key loop (K of tile h / 2, or its V when h is odd) into
    // slot h % 3, by TMA, issued by thread 0: context tile t is keys lo0 +
    // FTK t .. (those past anc arrive as they are and are masked; past S as
    // zeros), block tile t - ntc the block's keys FTK (t - ntc) ..
    const int kbox = p.bs <= 16 ? 16 : FTK; // the block maps' box rows
    auto issue = [&](int h) {
        if (tid != 0)
            return;
        const int t = h >> 1, slot = h % FSL;
        const bool isctx = t < ntc;
        const CUtensorMap *m = isctx ? (h & 1 ? &maps.vc : &maps.kc) : (h & 1 ? &maps.vb : &maps.kb);
        const int row = isctx ? lo0 + t * FTK : b * p.bs + (t - ntc) * FTK;
        const uint32_t dst = sb + L::KV_OFF + slot * L::KV, bar = bar0 + 8 * slot;
        mbar_expect_tx(bar, (uint32_t)(L::NH * (isctx ? FTK : kbox) * 128));
#pragma unroll
        for (int cb = 0; cb < L::NH; cb++)
            tma_load_2d(dst + cb * (FTK * 128), m, g * D + 64 * cb, row, bar);
    };
    // the n-th fill of slot h % 3 (h = h % 3 + 3 n) completes its barrier's phase n
    auto landed = [&](int h) { mbar_wait(bar0 + 8 * (h % FSL), (uint32_t)(h / FSL) & 1u); };
    issue(0); // K of tile 0
    issue(1); // V of tile 0
    // this thread's rows: r0 = 16 warp + gid (elements 4 j + 0, 1), r0 + 8 (4 j + 2, 3)
    RowId rid[2] = {row_id(p, b, g, ch, 16 * warp + gid), row_id(p, b, g, ch, 16 * warp + gid + 8)};
    int rlo[2];
#pragma unroll
    for (int ri = 0; ri < 2; ri++)
        rlo[ri] = ctx_lo(anc, ds, p.W, rid[ri].qo);
    float o[NA];
    acc_zero(o); // pinned before the loop
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    const float sl = p.scale * WLOG2E;
    const uint64_t dQ = wg_desc(sb, KM_LBO, SBO);
    // K(t) and V(t) are waited for on their slots' mbarriers; the barriers
    // after them make the slots' reuse safe (see the loads' comment at the top).
    int sk = 0; // slot of K(t): (2 t) % 3
    // Key tile t: NS = 32 accumulators per thread (64 keys, m64n64: the
    // context tiles, and the block tile when block_size > 16) or 8 (the
    // 16-key block tile, m64n16, when block_size <= 16).
    auto step = [&](int t, auto nsc) {
        constexpr int NS = decltype(nsc)::value, NJ = NS / 4, NKK = NS / 8;
        const int sv = sk == FSL - 1 ? 0 : sk + 1, sn = sv == FSL - 1 ? 0 : sv + 1;
        if (t == 0) { // Q landed (TMA; or this thread's copies, made visible to the tensor cores)
            if (maps.q_on) {
                mbar_wait(bar0 + 8 * FSL, 0u);
            } else {
                cp_wait<0>();
                fence_proxy_async();
            }
        }
        landed(2 * t);
        __syncthreads(); // Q (everyone's copies); P V(t - 1) retired everywhere: slot sn is free
        const uint32_t kd = sb + L::KV_OFF + sk * L::KV;
        const uint64_t dK = wg_desc(kd, KM_LBO, SBO);
        float s[NS];
        wg_fence();
        wg_tile_ab<NS, KS, CHUNK_ROWS, FTK>(s, dQ, dK);
        wg_commit();
        if (t + 1 < nt) // under S(t): the loads' address work off the wgmma's path
            issue(2 * t + 2);
        const bool isctx = t < ntc;
        const int base = isctx ? lo0 + t * FTK : (t - ntc) * FTK;
        const bool full = NS == 32 && isctx && base >= lohi && base + FTK <= anc;
        // visible keys of each row in this tile: [klo, khi) (rows past the
        // chunk: none)
        int klo[2], khi[2];
#pragma unroll
        for (int ri = 0; ri < 2; ri++)
            row_key_range(p, rid[ri], rlo[ri], rid[ri].ok, isctx, anc, klo[ri], khi[ri]);
        wg_wait<0>();
        reg_fence(s);
        // element 4 j + e: row r0 + 8 (e >> 1), key base + 8 j + 2 t4 + (e & 1)
        float mx[2] = {-INFINITY, -INFINITY};
        if (full) {
#pragma unroll
            for (int j = 0; j < NJ; j++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * j + e]);
        } else {
#pragma unroll
            for (int j = 0; j < NJ; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int ri = e >> 1, key = base + 8 * j + 2 * t4 + (e & 1);
                    bool vis = key >= klo[ri] && key < khi[ri];
                    s[4 * j + e] = vis ? s[4 * j + e] : -INFINITY;
                    mx[ri] = fmaxf(mx[ri], s[4 * j + e]);
                }
        }
        float al[2], mb[2];
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 1));
            mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 2));
            float mn = fmaxf(m[ri], mx[ri] * sl); // sl > 0: the max of the scaled scores
            // nothing seen yet: alpha 1 (O, l are 0), P = 2^-inf = 0 (base 0, not -inf - -inf)
            al[ri] = mn == -INFINITY ? 1.0f : ex2(m[ri] - mn);
            mb[ri] = mn == -INFINITY ? 0.0f : mn;
            m[ri] = mn;
        }
        float ps[2] = {0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < NS; i++) {
            float pr = ex2(fmaf(s[i], sl, -mb[(i >> 1) & 1]));
            s[i] = pr;
            ps[(i >> 1) & 1] += pr;
        }
        l[0] = l[0] * al[0] + ps[0];
        l[1] = l[1] * al[1] + ps[1];
        // O's rows rescaled: the previous P V retired at the end of tile t - 1
#pragma unroll
        for (int i = 0; i < NA; i++)
            o[i] *= al[(i >> 1) & 1];
        // P as the A fragments of k step kk (keys 16 kk .. + 15)
        uint32_t pa[NKK][4];
#pragma unroll
        for (int kk = 0; kk < NKK; kk++)
#pragma unroll
            for (int h = 0; h < 4; h++)
                pa[kk][h] = pack_bf2(s[8 * kk + 2 * h], s[8 * kk + 2 * h + 1]);
        landed(2 * t + 1);
        __syncthreads(); // S(t) retired everywhere: K(t)'s slot is free
        const uint64_t mV = wg_desc(sb + L::KV_OFF + sv * L::KV, MN_LBO, SBO);
        wg_fence(); // A fragments and O written by ordinary instructions
#pragma unroll
        for (int kk = 0; kk < NKK; kk++)
            wg_rs(o, pa[kk], mV + kk * (16 * 128 >> 4));
        wg_commit();
        if (t + 1 < nt) // under P V(t)
            issue(2 * t + 3);
        wg_wait<0>(); // before the barrier that lets this V slot be refilled
        reg_fence(o);
        sk = sn; // 2 t + 2
    };
    // block_size <= 16: one block tile, of 16 keys
    const bool b16 = p.bs <= 16;
    for (int t = 0, ntl = b16 ? ntc : nt; t < ntl; t++)
        step(t, IntC<32>());
    if (b16)
        step(nt - 1, IntC<8>());
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        l[ri] += __shfl_xor_sync(0xffffffffu, l[ri], 1);
        l[ri] += __shfl_xor_sync(0xffffffffu, l[ri], 2);
    }
    // element 4 j + 2 ri + e: row r0 + 8 ri, head dim 8 j + 2 t4 + e
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        const RowId &id = rid[ri];
        if (!id.ok)
            continue;
        bool any = l[ri] > 0.0f;
        float inv = any ? 1.0f / l[ri] : 0.0f;
        uint16_t *orow = p.o + id.grow * ldq + (long long)id.h * D + 2 * t4;
#pragma unroll
        for (int j = 0; j < D / 8; j++)
            *reinterpret_cast<uint32_t *>(orow + 8 * j) =
                pack_bf2(o[4 * j + 2 * ri] * inv, o[4 * j + 2 * ri + 1] * inv);
        if (t4 == 0)
            p.lse[(long long)id.grow * p.nq + id.h] = any ? m[ri] * LN2 + logf(l[ri]) : -INFINITY;
    }
#else
    __trap(); // built without sm_90a: fwd_wg_usable() keeps launches away
#endif
}

} // namespace

bool fwd_wg_usable(int D)
{
    static signed char known[2][64];
    return D == 128 ? wg_kernel_runs((const void *)fwd_wg_kernel<128>, FwdLayout<128>::SMEM, known[1])
                    : wg_kernel_runs((const void *)fwd_wg_kernel<64>, FwdLayout<64>::SMEM, known[0]);
}

int tma_map_bf16(CUtensorMap *m, const void *base, int rank, const uint64_t *dims,
                 const uint64_t *strides, const uint32_t *box)
{
    return df_cuda_tma_map(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, CU_TENSOR_MAP_SWIZZLE_128B, base, rank, dims, strides,
                   box);
}

int tma_map_f32(CUtensorMap *m, const void *base, int rank, const uint64_t *dims, const uint64_t *strides,
                const uint32_t *box)
{
    return df_cuda_tma_map(m, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, CU_TENSOR_MAP_SWIZZLE_NONE, base, rank, dims, strides,
                   box);
}

int chunk_map_bf16(CUtensorMap *m, const void *base, const Params &p, int D)
{
    const uint64_t dims[3] = {(uint64_t)D, (uint64_t)p.nq, (uint64_t)p.nb * p.bs};
    const uint64_t strides[2] = {(uint64_t)D * 2, (uint64_t)p.nq * D * 2};
    const uint32_t box[3] = {64, (uint32_t)p.group, (uint32_t)p.bs};
    return tma_map_bf16(m, base, 3, dims, strides, box);
}

int kv_maps_make(const Params &p, int D, KvMaps *m)
{
    // [rows, nkv D] row-major: boxes of 64 columns x WG_KV_BOX (or kbox) rows
    const uint64_t cols = (uint64_t)p.nkv * D, st[1] = {cols * 2};
    const uint64_t dc[2] = {cols, (uint64_t)(p.S > 0 ? p.S : 0)}, db[2] = {cols, (uint64_t)p.nb * p.bs};
    const uint32_t bc[2] = {64, WG_KV_BOX}, bb[2] = {64, (uint32_t)(p.bs <= 16 ? 16 : WG_KV_BOX)};
    if (tma_map_bf16(&m->kc, p.kc, 2, dc, st, bc) || tma_map_bf16(&m->vc, p.vc, 2, dc, st, bc) ||
        tma_map_bf16(&m->kb, p.kb, 2, db, st, bb) || tma_map_bf16(&m->vb, p.vb, 2, db, st, bb))
        return -EOPNOTSUPP;
    // Q (and dO) of a chunk: one box when a block's rows of a kv head are
    // exactly one chunk (no rows past it to zero); else the kernels' cp.async
    m->q_on = m->qd_on = 0;
    if (p.bs * p.group == CHUNK_ROWS && p.q) {
        m->q_on = !chunk_map_bf16(&m->q, p.q, p, D);
        m->qd_on = m->q_on && p.dout && !chunk_map_bf16(&m->dout, p.dout, p, D);
    }
    return 0;
}

int fwd_wg_launch(const Params &p, int D, cudaStream_t st)
{
    long long n = (long long)p.nb * p.nkv * p.nch;
    if (n <= 0)
        return 0;
    // the tensor maps: -EOPNOTSUPP (nothing launched) where they cannot be
    // made; the caller then runs MMA4's forward
    KvMaps maps;
    if (kv_maps_make(p, D, &maps))
        return -EOPNOTSUPP;
    cudaError_t e;
    if (D == 128) {
        e = cudaFuncSetAttribute(fwd_wg_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)FwdLayout<128>::SMEM);
        if (e == cudaSuccess)
            e = cudaFuncSetAttribute(fwd_wg_kernel<128>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                     cudaSharedmemCarveoutMaxShared);
        if (e == cudaSuccess) {
            fwd_wg_kernel<128><<<(unsigned)n, FNT, FwdLayout<128>::SMEM, st>>>(p, maps);
            e = cudaGetLastError();
        }
    } else {
        e = cudaFuncSetAttribute(fwd_wg_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)FwdLayout<64>::SMEM);
        if (e == cudaSuccess) {
            fwd_wg_kernel<64><<<(unsigned)n, FNT, FwdLayout<64>::SMEM, st>>>(p, maps);
            e = cudaGetLastError();
        }
    }
    if (e != cudaSuccess) {
        fprintf(stderr, "dflash_attn: fwd_wg_kernel<%d>: %s (%s:%d)\n", D, cudaGetErrorString(e),
                __FILE__, __LINE__);
        return -EIO;
    }
    return 0;
}

} // namespace df_dflash
