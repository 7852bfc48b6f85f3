// dflash_attn_wg_dqs.cu - impl DF_CUDA_DFLASH_IMPL_WG3's dQ: dQ from the dS
// the context dK/dV pass already computed, instead of a dQ pass that
// computes S, dP, P and dS again (dflash_attn_wg_dq.cu; two of its three
// GEMMs per tile are that recomputation).
//
// WG3's backward (dflash_attn.cu, bwd_mma4_launch):
//   1. the block pass (blk_wg_kernel, dflash_attn_wg_dq.cu): Di, the
//      block-key dK / dV and the block tile's dS^T into DsBuf.dsb;
//   2. the tile lists and the context dK/dV pass (dkv_wg_kernel, TQ), which
//      also stores each (128-key tile, item)'s dS^T, bf16 (the values its dK
//      GEMM uses), into DsBuf.ds;
//   3. dqs_kernel (here): per (block, kv head), dQ = sum over its context
//      span's 64-key halves of dS K, then the block tile's dS K_b, in key
//      order, times scale, rounded to bf16 once: deterministic, no atomics;
//   4. the split reduction of the context dK/dV.
// The recomputing dQ pass did three GEMMs per 64-key tile (S, dP, dQ); this
// one does one, and reads the tile's dS (8 KiB) from memory: it trades 2 of
// the backward's 7 GEMMs for writing and reading dS once (2 bytes per
// visible (row, key) pair, rounded up to tiles: ~0.4 GB at the 27B shape,
// 3 documents; the workspace holds the worst case: dqs_max_tiles per block).
//
// Stored tiles (dflash_attn_common.cuh, DsBuf): one per (valid block b,
// 128-key context tile t its span meets, kv head g), t from lo0 / 128
// (lo0: the widest row's bound, ctx_lo(.., 0)) to (anchor - 1) / 128, slot
// (b maxt + t - lo0 / 128) nkv + g (maxt = dqs_max_tiles: room for every
// block's widest span, so no prefix sum), DS_TILE_BYTES each: [key][row]
// bf16 rows of 128 bytes (the 64 rows of the item) in the 128-byte swizzle,
// as the dK/dV pass's warpgroup h writes keys 64 h .. 64 h + 63. A
// warpgroup whose 64 keys no row of the item sees writes nothing: this
// kernel skips the same halves (the same test), so no half is read
// unwritten. Masked pairs are stored as 0 (P = 0 there).
//
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dflash_attn_common.cuh"
#include "dflash_attn_wg.cuh"

namespace df_dflash {
namespace {

constexpr int GNT = 128; // threads: one warpgroup
constexpr int GST = 3;   // stages
constexpr int HALF = 64; // keys per context step


#if DF_WG_BODY
// dq of this thread's two rows from the accumulators (element 4 j + 2 ri +
// e: row r0 + 8 ri, head dim 8 j + 2 t4 + e) times scale, as bf16; 0 where
// !val (a padding block's rows)
template <int D>
__device__ __forceinline__ void store_dq(const Params &p, const RowId (&rid)[2], const float (&acc)[D / 2], int t4,
                                         bool val)
{
    const long long ldq = (long long)p.nq * D;
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        const RowId &id = rid[ri];
        if (!id.ok)
            continue;
        uint16_t *qrow = p.dq + id.grow * ldq + (long long)id.h * D + 2 * t4;
#pragma unroll
        for (int j = 0; j < D / 8; j++)
            *reinterpret_cast<uint32_t *>(qrow + 8 * j) =
                val ? pack_bf2(acc[4 * j + 2 * ri] * p.scale, acc[4 * j + 2 * ri + 1] * p.scale) : 0u;
    }
}
#endif

// CTA: two warpgroups per (two neighbouring blocks, kv head), warpgroup w
// summing block b_w's dQ. Neighbouring anchors' spans mostly overlap, so one
// K half serves both: the CTA steps over the union of its blocks' live
// 64-key halves through GST stages, GST - 1 ahead, loading K once (TMA: the
// forward's kc map, one 64-key box per column block) and each block's dS^T
// (a plain bulk copy, 8 KiB) where the half is live for it (a half in a gap
// between two documents' spans is loaded and not used); both blocks' block
// tiles (K_b by the kb map's 16-key boxes, dS^T 2 KiB) in an area of their
// own, loaded at the start. dQ += dS K: m64nDk16, A = dS MN-major
// (transposed through the descriptor), B = K MN-major, both in shared
// memory, fp32 accumulators in registers. Shared memory: GST stages of K +
// two dS^T halves (32 KiB at D 128), then the block area: 2 CTAs per SM.
// (One warpgroup per block, each reading its K halves itself, was no
// faster: session 15.)
template <int D> struct DqsLayout {
    static constexpr int NH = D / 64;
    static constexpr int KT = NH * HALF * 128, DH = DS_TILE_BYTES / 2;
    static constexpr int ST = KT + 2 * DH;
    static constexpr int KB = NH * 16 * 128; // a block tile's K
    // block area: block 0's K_b, its dS^T, block 1's dS^T, its K_b (1024-aligned pieces)
    static constexpr int BLK = GST * ST, KB0 = BLK, DB0 = BLK + KB, DB1 = DB0 + DS_BLK_BYTES,
                         KB1 = DB1 + DS_BLK_BYTES;
    static constexpr int BAR_OFF = KB1 + KB; // GST stage barriers, then the block area's
    static constexpr size_t SMEM = (size_t)BAR_OFF + (GST + 1) * 8 + 1024;
    static_assert(KB % 1024 == 0 && (DB1 + DS_BLK_BYTES) % 1024 == 0, "1024-aligned pieces");
};

template <int D>
__global__ void __launch_bounds__(2 * GNT, 2) dqs_kernel(Params p, const __grid_constant__ KvMaps maps, DsBuf dsb)
{
#if DF_WG_BODY
    using L = DqsLayout<D>;
    constexpr int NA = D / 2;
    constexpr uint32_t SBO = 1024;
    extern __shared__ __align__(1024) uint8_t gs_smem[];
    const uint32_t s0 = smem_u32(gs_smem), sb = (s0 + 1023u) & ~1023u;
    const int tid = threadIdx.x, lane = tid & 31, gid = lane >> 2, t4 = lane & 3;
    // warpgroup (this thread's block of the pair) and warp in it, warp-uniform
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0), warp = __shfl_sync(0xffffffffu, (tid >> 5) & 3, 0);
    const int g = blockIdx.x % p.nkv, pb = p.nb - 1 - 2 * (blockIdx.x / p.nkv); // blocks pb, pb - 1
    // both blocks' spans (every thread: the issuing thread needs both)
    int q0[2], q1[2], slot0[2];
    bool has[2], val[2];
#pragma unroll
    for (int w = 0; w < 2; w++) {
        const int b = pb - w;
        val[w] = b >= 0 && p.valid[b];
        int anc = 0, lo0 = 0;
        if (val[w])
            anc = p.anchor[b], lo0 = ctx_lo(anc, p.doc_start[b], p.W, 0);
        has[w] = val[w] && lo0 < anc; // a context span
        q0[w] = lo0 / HALF, q1[w] = has[w] ? (anc - 1) / HALF : -1;
        slot0[w] = b * dsb.maxt - lo0 / WG_TILE_KEYS;
    }
    const int b = pb - wg;
    const RowId rid[2] = {row_id(p, b < 0 ? 0 : b, g, 0, 16 * warp + gid),
                          row_id(p, b < 0 ? 0 : b, g, 0, 16 * warp + gid + 8)};
    // the union of the live halves: qa .. qa + nst - 1
    const int qa = has[0] && has[1] ? min(q0[0], q0[1]) : has[0] ? q0[0] : q0[1];
    const int qb = has[0] && has[1] ? max(q1[0], q1[1]) : has[0] ? q1[0] : q1[1];
    const int nst = has[0] || has[1] ? qb - qa + 1 : 0;
    auto live = [&](int w, int q) -> bool { return has[w] && q >= q0[w] && q <= q1[w]; };
    // this warpgroup's (selects, not a runtime index: the arrays stay in registers)
    const bool my_val = wg ? val[1] : val[0], my_has = wg ? has[1] : has[0];
    const int my_q0 = wg ? q0[1] : q0[0], my_q1 = wg ? q1[1] : q1[0];
    const uint32_t bar0 = sb + L::BAR_OFF, bblk = bar0 + 8 * GST;
    pdl_trigger();
    pdl_wait(); // the stored dS (the block pass's, the context dK/dV pass's)
    if (tid == 0) {
        for (int i = 0; i <= GST; i++)
            mbar_init(bar0 + 8 * i, 1);
        mbar_fence_init();
        // both block tiles (K_b by the kb map's 16-key boxes, dS^T by a bulk copy)
        if (val[0] || val[1]) {
            mbar_expect_tx(bblk, (uint32_t)((val[0] + val[1]) * (L::KB + DS_BLK_BYTES)));
#pragma unroll
            for (int w = 0; w < 2; w++) {
                if (!val[w])
                    continue;
                const uint32_t kb = sb + (w ? L::KB1 : L::KB0), db = sb + (w ? L::DB1 : L::DB0);
#pragma unroll
                for (int cb = 0; cb < L::NH; cb++)
                    tma_load_2d(kb + cb * (16 * 128), &maps.kb, g * D + 64 * cb, (pb - w) * p.bs, bblk);
                bulk_load(db, reinterpret_cast<const uint8_t *>(dsb.dsb) + ((size_t)(pb - w) * p.nkv + g) * DS_BLK_BYTES,
                          DS_BLK_BYTES, bblk);
            }
        }
    }
    // step t (half qa + t) into stage s (thread 0): K, and each block's dS^T where live
    auto issue = [&](int t, int s) {
        const int q = qa + t;
        const uint32_t dst = sb + s * L::ST, bar = bar0 + 8 * s;
        const bool l0 = live(0, q), l1 = live(1, q);
        mbar_expect_tx(bar, (uint32_t)(L::KT + (l0 + l1) * L::DH));
#pragma unroll
        for (int cb = 0; cb < L::NH; cb++)
            tma_load_2d(dst + cb * (HALF * 128), &maps.kc, g * D + 64 * cb, HALF * q, bar);
#pragma unroll
        for (int w = 0; w < 2; w++)
            if (w ? l1 : l0)
                bulk_load(dst + L::KT + w * L::DH,
                          reinterpret_cast<const uint8_t *>(dsb.ds) +
                              ((size_t)(slot0[w] + q / 2) * p.nkv + g) * DS_TILE_BYTES + (q & 1) * L::DH,
                          L::DH, bar);
    };
    __syncthreads(); // the mbarriers' inits
    if (tid == 0)
        for (int t = 0; t < GST - 1 && t < nst; t++)
            issue(t, t);
    float acc[NA];
    acc_zero(acc);
    for (int t = 0; t < nst; t++) {
        if (tid == 0 && t + GST - 1 < nst)
            issue(t + GST - 1, (t + GST - 1) % GST);
        mbar_wait(bar0 + 8 * (t % GST), (uint32_t)(t / GST) & 1u);
        if (my_has && qa + t >= my_q0 && qa + t <= my_q1) { // live for this warpgroup's block
            const uint32_t st = sb + (t % GST) * L::ST;
            const uint64_t dA = wg_desc(st + L::KT + wg * L::DH, HALF * 128, SBO), dB = wg_desc(st, HALF * 128, SBO);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < HALF / 16; kk++)
                wg_ss_tb<1>(acc, dA + kk * (16 * 128 >> 4), dB + kk * (16 * 128 >> 4));
            wg_commit();
            wg_wait<0>();
        }
        __syncthreads(); // both warpgroups' wgmmas of step t retired: its stage may refill
    }
    if (my_val) {
        mbar_wait(bblk, 0);
        wg_fence();
        wg_ss_tb<1>(acc, wg_desc(sb + (wg ? L::DB1 : L::DB0), HALF * 128, SBO),
                    wg_desc(sb + (wg ? L::KB1 : L::KB0), 16 * 128, SBO));
        wg_commit();
        wg_wait<0>();
    }
    reg_fence(acc);
    if (b < 0)
        return;
    store_dq<D>(p, rid, acc, t4, my_val); // (a padding block: 0)
#else
    __trap();
#endif
}

// Four neighbouring blocks per item, persistent (the default; the pairs
// above: DFLASH_ATTN_WG3_DQ=pair). The pair kernel read each K half once per
// two blocks (as many bytes of K as of dS, mostly from L2: ncu, H200, 3docs
// full: L2 throughput 84%, DRAM 66%), and each CTA's first loads waited a
// whole memory latency with nothing else of its own in flight. Here an item
// is (four neighbouring blocks, kv head) and one CTA per SM takes items
// until none is left (the first gridDim.x by index, then from the counter
// DsBuf.ctr, which the block pass zeroes): a producer warp (lane 0) walks
// the items' steps - each live 64-key half of their union (K once, each
// block's dS^T half where live), then one block step (each valid block's
// K_b and dS^T) - into QST stages, QST - 1 ahead across item boundaries,
// with a metadata record per stage (item, half or block step, which
// blocks); warpgroup w (of four) sums block pb - w's dQ from the stages
// where its bit is set, stores it at the block step and starts over. Each
// warp releases a stage (an "empty" mbarrier of 16 arrivals) once its
// wgmmas retired. Same sums in the same order as the pairs: the same bits.
constexpr int QB = 4, QST = 4, RW = 3; // RW: reducer warps (DsBuf.part; 20 warps in all: 96 registers each)
template <int D> struct DqqLayout {
    static constexpr int NH = D / 64;
    static constexpr int KT = NH * HALF * 128, DH = DS_TILE_BYTES / 2, KB = NH * 16 * 128;
    static constexpr int ST = KT + QB * DH; // a context step; a block step: QB K_b, then QB dS^T
    static constexpr int KBS = QB * KB;     // the block step's dS^T, after its K_b
    static_assert(KBS + QB * DS_BLK_BYTES <= ST && KB % 1024 == 0 && DS_BLK_BYTES % 1024 == 0, "block step");
    static constexpr int META = QST * ST;          // QST records of 4 ints
    static constexpr int BAR_OFF = META + QST * 16; // full[QST], then empty[QST]
    static constexpr size_t SMEM = (size_t)BAR_OFF + 2 * QST * 8 + 1024;
    static constexpr int NT = QB * GNT + 32 + RW * 32; // four warpgroups, the producer warp, the reducer warps
};

template <int D>
__global__ void __launch_bounds__(DqqLayout<D>::NT, 1) dqq_kernel(Params p, const __grid_constant__ KvMaps maps, DsBuf dsb)
{
#if DF_WG_BODY
    using L = DqqLayout<D>;
    constexpr int NA = D / 2;
    constexpr uint32_t SBO = 1024;
    extern __shared__ __align__(1024) uint8_t gs_smem[];
    const uint32_t s0 = smem_u32(gs_smem), sb = (s0 + 1023u) & ~1023u;
    int *meta = reinterpret_cast<int *>(gs_smem + (sb - s0) + L::META);
    const int tid = threadIdx.x, lane = tid & 31;
    const uint32_t full0 = sb + L::BAR_OFF, empty0 = full0 + 8 * QST;
    const int nitems = (p.nb + QB - 1) / QB * p.nkv;
    if (tid == 0) {
        for (int i = 0; i < QST; i++) {
            mbar_init(full0 + 8 * i, 1);
            mbar_init(empty0 + 8 * i, QB * 4);
        }
        mbar_fence_init();
    }
    pdl_trigger();
    pdl_wait(); // the stored dS (the block pass's, the context dK/dV pass's), the counter
    __syncthreads(); // the mbarriers' inits
    if (tid >= QB * GNT + 32) { // the reducer warps: dkc / dvc = the sum of the split partials, in split
                                // order (dkv_reduce_kernel's sums), while the dQ streams in
        if (!dsb.part)
            return;
        // (RU groups of 4 elements per thread per round, every load issued first: few
        // threads, so each keeps several in flight)
        constexpr int RU = 4;
        const size_t n = (size_t)p.S * p.nkv * D, step = (size_t)gridDim.x * RW * 32 * 4;
        for (size_t i0 = ((size_t)blockIdx.x * RW * 32 + (tid - QB * GNT - 32)) * 4; i0 < n; i0 += RU * step) {
            float4 a[RU][WG_NSPL], c[RU][WG_NSPL];
#pragma unroll
            for (int u = 0; u < RU; u++)
#pragma unroll
                for (int sp = 0; sp < WG_NSPL; sp++) {
                    const size_t i = i0 + u * step < n ? i0 + u * step : i0; // (past n: a repeat, not stored)
                    a[u][sp] = __ldcs(reinterpret_cast<const float4 *>(dsb.part + (size_t)sp * 2 * n + i));
                    c[u][sp] = __ldcs(reinterpret_cast<const float4 *>(dsb.part + (size_t)sp * 2 * n + n + i));
                }
#pragma unroll
            for (int u = 0; u < RU; u++) {
                const size_t i = i0 + u * step;
                if (i >= n)
                    break;
                float4 sk = make_float4(0, 0, 0, 0), sv = sk;
#pragma unroll
                for (int sp = 0; sp < WG_NSPL; sp++) {
                    sk.x += a[u][sp].x, sk.y += a[u][sp].y, sk.z += a[u][sp].z, sk.w += a[u][sp].w;
                    sv.x += c[u][sp].x, sv.y += c[u][sp].y, sv.z += c[u][sp].z, sv.w += c[u][sp].w;
                }
                *reinterpret_cast<uint2 *>(p.dkc + i) = make_uint2(pack_bf2(sk.x, sk.y), pack_bf2(sk.z, sk.w));
                *reinterpret_cast<uint2 *>(p.dvc + i) = make_uint2(pack_bf2(sv.x, sv.y), pack_bf2(sv.z, sv.w));
            }
        }
        return;
    }
    if (tid >= QB * GNT) { // the producer warp
        if (lane != 0)
            return;
        int j = 0; // steps issued
        // stage of step j, once its previous fill (step j - QST) is released
        auto take = [&]() -> int {
            const int s = j % QST;
            if (j >= QST)
                mbar_wait(empty0 + 8 * s, (uint32_t)(j / QST - 1) & 1u);
            return s;
        };
        for (int item = blockIdx.x;; item = gridDim.x + atomicAdd(dsb.ctr, 1)) {
            if (item >= nitems) { // the end: a record, no bytes
                const int s = take();
                meta[4 * s] = -1, meta[4 * s + 1] = -2, meta[4 * s + 2] = 0;
                mbar_arrive(full0 + 8 * s);
                return;
            }
            const int g = item % p.nkv, pb = p.nb - 1 - QB * (item / p.nkv);
            int q0[QB], q1[QB], slot0[QB], vm = 0, qa = INT_MAX, qb = -1;
#pragma unroll
            for (int w = 0; w < QB; w++) {
                const int b = pb - w;
                const bool v = b >= 0 && p.valid[b];
                int anc = 0, lo0 = 0;
                if (v)
                    anc = p.anchor[b], lo0 = ctx_lo(anc, p.doc_start[b], p.W, 0);
                vm |= v << w;
                const bool has = v && lo0 < anc;
                q0[w] = has ? lo0 / HALF : INT_MAX, q1[w] = has ? (anc - 1) / HALF : -1;
                slot0[w] = b * dsb.maxt - lo0 / WG_TILE_KEYS;
                qa = min(qa, q0[w]), qb = max(qb, q1[w]);
            }
            for (int q = qa; q <= qb; q++) { // the union's live halves
                int lm = 0;
#pragma unroll
                for (int w = 0; w < QB; w++)
                    lm |= (q >= q0[w] && q <= q1[w]) << w;
                if (!lm)
                    continue; // (a gap between two documents' spans)
                const int s = take();
                const uint32_t dst = sb + s * L::ST, bar = full0 + 8 * s;
                meta[4 * s] = item, meta[4 * s + 1] = q, meta[4 * s + 2] = lm;
                mbar_expect_tx(bar, (uint32_t)(L::KT + __popc(lm) * L::DH));
#pragma unroll
                for (int cb = 0; cb < L::NH; cb++)
                    tma_load_2d(dst + cb * (HALF * 128), &maps.kc, g * D + 64 * cb, HALF * q, bar);
#pragma unroll
                for (int w = 0; w < QB; w++)
                    if (lm >> w & 1)
                        bulk_load(dst + L::KT + w * L::DH,
                                  reinterpret_cast<const uint8_t *>(dsb.ds) +
                                      ((size_t)(slot0[w] + q / 2) * p.nkv + g) * DS_TILE_BYTES + (q & 1) * L::DH,
                                  L::DH, bar);
                j++;
            }
            { // the block step
                const int s = take();
                const uint32_t dst = sb + s * L::ST, bar = full0 + 8 * s;
                meta[4 * s] = item, meta[4 * s + 1] = -1, meta[4 * s + 2] = vm;
                mbar_expect_tx(bar, (uint32_t)(__popc(vm) * (L::KB + DS_BLK_BYTES)));
#pragma unroll
                for (int w = 0; w < QB; w++) {
                    if (!(vm >> w & 1))
                        continue;
#pragma unroll
                    for (int cb = 0; cb < L::NH; cb++)
                        tma_load_2d(dst + w * L::KB + cb * (16 * 128), &maps.kb, g * D + 64 * cb, (pb - w) * p.bs,
                                    bar);
                    bulk_load(dst + L::KBS + w * DS_BLK_BYTES,
                              reinterpret_cast<const uint8_t *>(dsb.dsb) + ((size_t)(pb - w) * p.nkv + g) * DS_BLK_BYTES,
                              DS_BLK_BYTES, bar);
                }
                j++;
            }
        }
    }
    // warpgroup wg: block pb - wg of each item
    const int gid = lane >> 2, t4 = lane & 3;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0), warp = __shfl_sync(0xffffffffu, (tid >> 5) & 3, 0);
    float acc[NA];
    acc_zero(acc);
    for (int j = 0;; j++) {
        const int s = j % QST;
        mbar_wait(full0 + 8 * s, (uint32_t)(j / QST) & 1u);
        const int item = meta[4 * s], q = meta[4 * s + 1], m = meta[4 * s + 2];
        if (q == -2)
            break;
        const uint32_t st = sb + s * L::ST;
        if ((m >> wg & 1) && q >= 0) { // a context half: dQ += dS K over its 64 keys
            const uint64_t dA = wg_desc(st + L::KT + wg * L::DH, HALF * 128, SBO), dB = wg_desc(st, HALF * 128, SBO);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < HALF / 16; kk++)
                wg_ss_tb<1>(acc, dA + kk * (16 * 128 >> 4), dB + kk * (16 * 128 >> 4));
            wg_commit();
            wg_wait<0>();
        }
        if ((m >> wg & 1) && q == -1) { // the block tile: dQ += dS_b K_b
            wg_fence();
            wg_ss_tb<1>(acc, wg_desc(st + L::KBS + wg * DS_BLK_BYTES, HALF * 128, SBO),
                        wg_desc(st + wg * L::KB, 16 * 128, SBO));
            wg_commit();
            wg_wait<0>();
        }
        __syncwarp();
        if (lane == 0) // this warp is done with the stage (its wgmmas retired, its reads of meta done)
            mbar_arrive(empty0 + 8 * s);
        if (q == -1) { // the item's end: block pb - wg's dQ
            reg_fence(acc);
            const int g = item % p.nkv, b = p.nb - 1 - QB * (item / p.nkv) - wg;
            if (b >= 0) {
                const RowId rid[2] = {row_id(p, b, g, 0, 16 * warp + gid), row_id(p, b, g, 0, 16 * warp + gid + 8)};
                store_dq<D>(p, rid, acc, t4, (m >> wg & 1) != 0); // (a padding block: 0)
            }
            acc_zero(acc);
        }
    }
#else
    __trap();
#endif
}

} // namespace

// DFLASH_ATTN_WG3_DQ=pair: dqs_kernel; else dqq_kernel (read once)
static bool dq_pairs()
{
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("DFLASH_ATTN_WG3_DQ");
        v = e && !strcmp(e, "pair");
    }
    return v != 0;
}

bool dqs_reduces()
{
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("DFLASH_ATTN_WG3_RED");
        v = !(e && !strcmp(e, "kernel"));
    }
    return v && !dq_pairs();
}

bool dqs_usable(int D)
{
    static signed char known[2][2][64]; // [pairs][D == 128][device]
    const bool pr = dq_pairs();
    const void *fn = pr ? (D == 128 ? (const void *)dqs_kernel<128> : (const void *)dqs_kernel<64>)
                        : (D == 128 ? (const void *)dqq_kernel<128> : (const void *)dqq_kernel<64>);
    const size_t smem = pr ? (D == 128 ? DqsLayout<128>::SMEM : DqsLayout<64>::SMEM)
                           : (D == 128 ? DqqLayout<128>::SMEM : DqqLayout<64>::SMEM);
    return wg_kernel_runs(fn, smem, known[pr][D == 128]);
}

int dqs_max_tiles(int S, int window)
{
    // a span [lo0, anc) within [0, S), and on a sliding layer at most window - 1 keys
    int maxt = (S + WG_TILE_KEYS - 1) / WG_TILE_KEYS;
    if (window > 0) {
        int wt = (window + WG_TILE_KEYS - 1) / WG_TILE_KEYS + 1;
        maxt = wt < maxt ? wt : maxt;
    }
    return maxt > 0 ? maxt : 0;
}

int dqs_launch(const Params &p, int D, cudaStream_t st, const KvMaps &maps, const DsBuf &dsb)
{
    if (!dq_pairs()) { // one CTA per SM (the SM count asked once per device), at most one per item
        const unsigned nitems = (unsigned)((long long)(p.nb + QB - 1) / QB * p.nkv);
        if (nitems == 0)
            return 0;
        static int nsm[64];
        int dev = 0;
        cudaError_t e = cudaGetDevice(&dev);
        if (e == cudaSuccess && dev >= 0 && dev < 64 && !nsm[dev])
            e = cudaDeviceGetAttribute(&nsm[dev], cudaDevAttrMultiProcessorCount, dev);
        const unsigned grid = e == cudaSuccess && dev >= 0 && dev < 64 && nsm[dev] > 0 && (unsigned)nsm[dev] < nitems
                                  ? (unsigned)nsm[dev]
                                  : nitems;
        const void *fn = D == 128 ? (const void *)dqq_kernel<128> : (const void *)dqq_kernel<64>;
        const size_t smem = D == 128 ? DqqLayout<128>::SMEM : DqqLayout<64>::SMEM;
        if (e == cudaSuccess)
            e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e == cudaSuccess) {
            void *args[3] = {const_cast<Params *>(&p), const_cast<KvMaps *>(&maps), const_cast<DsBuf *>(&dsb)};
            e = launch_pdl(fn, dim3(grid), dim3(DqqLayout<128>::NT), smem, st, dsb.pdl != 0, args);
        }
        if (e != cudaSuccess) {
            fprintf(stderr, "dflash_attn: dqq_kernel<%d>: %s (%s:%d)\n", D, cudaGetErrorString(e), __FILE__, __LINE__);
            return -EIO;
        }
        return 0;
    }
    // pairs of blocks per CTA; the largest shared-memory carveout (2 CTAs of ~109 KiB per SM)
    const unsigned n = (unsigned)((long long)(p.nb + 1) / 2 * p.nkv);
    if (n == 0)
        return 0;
    const void *fn = D == 128 ? (const void *)dqs_kernel<128> : (const void *)dqs_kernel<64>;
    const size_t smem = D == 128 ? DqsLayout<128>::SMEM : DqsLayout<64>::SMEM;
    cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (e == cudaSuccess) {
        void *args[3] = {const_cast<Params *>(&p), const_cast<KvMaps *>(&maps), const_cast<DsBuf *>(&dsb)};
        e = launch_pdl(fn, dim3(n), dim3(2 * GNT), smem, st, dsb.pdl != 0, args); // (a programmatic dependent)
    }
    if (e != cudaSuccess) {
        fprintf(stderr, "dflash_attn: dqs_kernel<%d>: %s (%s:%d)\n", D, cudaGetErrorString(e), __FILE__, __LINE__);
        return -EIO;
    }
    return 0;
}

} // namespace df_dflash
