// dflash_attn_wg_dqs.cu - impl DF_CUDA_DFLASH_IMPL_WG3's dQ: dQ from the dS
// the context dK/dV pass already computed, instead of a dQ pass that
// computes S, dP, P and dS again (dflash_attn_wg_dq.cu; two of its three
// GEMMs per tile are that recomputation).
//
// WG3's backward (dflash_attn.cu, bwd_mma4_launch):
//   1. the dQ pass in its block-only mode (dq_wg_kernel, FOLD, BM): Di,
//      the block-key dK / dV and the block tile's dS^T into DsBuf.dsb; no
//      context tiles, no dq;
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
// (b maxt + t - lo0 / 128) nkv + g (maxt = dqs_max_tiles: room for
// every block's widest span, so no prefix sum), DS_TILE_BYTES each: [key][row] bf16
// rows of 128 bytes (the 64 rows of the item) in the 128-byte swizzle, as
// the dK/dV pass's warpgroup h writes keys 64 h .. 64 h + 63. A warpgroup
// whose 64 keys no row of the item sees writes nothing: this kernel skips
// the same halves (the same test), so no half is read unwritten. Masked
// pairs are stored as 0 (P = 0 there).
//
// CTA (dqs_kernel, DFLASH_ATTN_WG3_DQ=single; dqs2_kernel below pairs
// blocks): one warpgroup, one item (block, kv head; its 64 rows = the wgmma M), 64-key halves through GST stages, GST - 1 ahead: K by TMA
// (the forward's kc map, one 64-key box per column block), dS^T by a plain
// bulk copy (8 KiB), the block tile's K_b (kb map, 16-key boxes) and dS^T
// (2 KiB) as the last. dQ += dS K: m64nDk16, A = dS MN-major (transposed
// through the descriptor), B = K MN-major, both in shared memory, fp32
// accumulators in registers.
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

// Shared memory from a 1024-aligned base: stage s at s ST: K (NH column
// blocks of 64 keys x 128 bytes; the block tile: of 16 keys) at 0, dS^T
// (64 or 16 keys x 128 bytes) at KT; then one mbarrier per stage.
template <int D> struct DqsLayout {
    static constexpr int NH = D / 64;
    static constexpr int KT = NH * HALF * 128;
    static constexpr int ST = KT + DS_TILE_BYTES / 2;
    static constexpr int BAR_OFF = GST * ST;
    static constexpr size_t SMEM = (size_t)BAR_OFF + GST * 8 + 1024; // + alignment slack
    static_assert(ST % 1024 == 0 && KT % 1024 == 0, "stages and their dS at 1024-byte multiples");
};

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

template <int D>
__global__ void __launch_bounds__(GNT, 3) dqs_kernel(Params p, const __grid_constant__ KvMaps maps, DsBuf dsb)
{
#if DF_WG_BODY
    using L = DqsLayout<D>;
    constexpr int NA = D / 2; // dQ accumulators per thread
    constexpr uint32_t SBO = 1024;
    extern __shared__ __align__(1024) uint8_t gs_smem[];
    const uint32_t s0 = smem_u32(gs_smem), sb = (s0 + 1023u) & ~1023u;
    const int tid = threadIdx.x, lane = tid & 31, gid = lane >> 2, t4 = lane & 3;
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    // items: blocks last to first (the longest spans of a document first)
    const int g = blockIdx.x % p.nkv, b = p.nb - 1 - blockIdx.x / p.nkv;
    const RowId rid[2] = {row_id(p, b, g, 0, 16 * warp + gid), row_id(p, b, g, 0, 16 * warp + gid + 8)};
    if (!p.valid[b]) { // padding block: dq 0
        float zero[NA] = {};
        store_dq<D>(p, rid, zero, t4, false);
        return;
    }
    const int anc = p.anchor[b], lo0 = ctx_lo(anc, p.doc_start[b], p.W, 0);
    // live 64-key halves: those the span [lo0, anc) meets, q0 .. q0 + nctx - 1
    const int q0 = lo0 / HALF, nctx = lo0 < anc ? (anc - 1) / HALF - q0 + 1 : 0, ntl = nctx + 1;
    const int slot0 = b * dsb.maxt - lo0 / WG_TILE_KEYS;
    const uint32_t bar0 = sb + L::BAR_OFF;
    if (tid == 0) {
        for (int i = 0; i < GST; i++)
            mbar_init(bar0 + 8 * i, 1);
        mbar_fence_init();
    }
    __syncthreads();
    // step t into stage s (thread 0): a context half, or (t == nctx) the block tile
    auto issue = [&](int t, int s) {
        const uint32_t dst = sb + s * L::ST, bar = bar0 + 8 * s;
        if (t < nctx) {
            const int q = q0 + t, tile = q / 2;
            const uint8_t *src = reinterpret_cast<const uint8_t *>(dsb.ds) +
                                 ((size_t)(slot0 + tile) * p.nkv + g) * DS_TILE_BYTES + (q & 1) * (DS_TILE_BYTES / 2);
            mbar_expect_tx(bar, (uint32_t)(L::KT + DS_TILE_BYTES / 2));
#pragma unroll
            for (int cb = 0; cb < L::NH; cb++)
                tma_load_2d(dst + cb * (HALF * 128), &maps.kc, g * D + 64 * cb, HALF * q, bar);
            bulk_load(dst + L::KT, src, DS_TILE_BYTES / 2, bar);
        } else {
            mbar_expect_tx(bar, (uint32_t)(L::NH * 16 * 128 + DS_BLK_BYTES));
#pragma unroll
            for (int cb = 0; cb < L::NH; cb++)
                tma_load_2d(dst + cb * (16 * 128), &maps.kb, g * D + 64 * cb, b * p.bs, bar);
            bulk_load(dst + L::KT,
                      reinterpret_cast<const uint8_t *>(dsb.dsb) + ((size_t)b * p.nkv + g) * DS_BLK_BYTES,
                      DS_BLK_BYTES, bar);
        }
    };
    if (tid == 0)
        for (int t = 0; t < GST - 1 && t < ntl; t++)
            issue(t, t);
    float acc[NA];
    acc_zero(acc);
    // step t: its stage landed (and step t + GST - 1 issued into the stage
    // step t - 1 used: every thread passed the barrier after step t - 1
    // only once its wgmmas of that step retired); returns the stage
    auto arrive = [&](int t) -> uint32_t {
        if (tid == 0 && t + GST - 1 < ntl)
            issue(t + GST - 1, (t + GST - 1) % GST);
        mbar_wait(bar0 + 8 * (t % GST), (uint32_t)(t / GST) & 1u);
        return sb + (t % GST) * L::ST;
    };
    // A: dS^T [key][row], MN-major: k step kk = keys 16 kk .. + 15 = 2048
    // bytes; B: K [column block][key][64 dims], MN-major, LBO one column
    // block (64 keys of 128 bytes; the block tile: 16). The context steps
    // and the block step in loops of their own (wgmmas under a branch made
    // ptxas inject warpgroup arrives)
    for (int t = 0; t < nctx; t++) {
        const uint32_t st = arrive(t);
        const uint64_t dA = wg_desc(st + L::KT, HALF * 128, SBO), dB = wg_desc(st, HALF * 128, SBO);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < HALF / 16; kk++)
            wg_ss_tb<1>(acc, dA + kk * (16 * 128 >> 4), dB + kk * (16 * 128 >> 4));
        wg_commit();
        wg_wait<0>();
        __syncthreads(); // everyone's wgmmas of step t retired: its stage may refill
    }
    {
        const uint32_t st = arrive(nctx);
        wg_fence();
        wg_ss_tb<1>(acc, wg_desc(st + L::KT, HALF * 128, SBO), wg_desc(st, 16 * 128, SBO));
        wg_commit();
        wg_wait<0>();
    }
    reg_fence(acc);
    store_dq<D>(p, rid, acc, t4, true);
#else
    __trap(); // built without sm_90a: dqs_usable() keeps launches away
#endif
}

// Pairs (dqs2_kernel, the default; DFLASH_ATTN_WG3_DQ=single: dqs_kernel):
// one CTA of two warpgroups per (two neighbouring blocks, kv head), warpgroup
// w summing block b_w's dQ as dqs_kernel does. Neighbouring anchors' spans
// mostly overlap, so one K half serves both (dqs_kernel reads each K half
// from L2 once per block: ~0.8 GB at 3docs full, twice the stored dS): the
// CTA steps over the union of its blocks' live halves, loading K once and
// each block's dS^T where the half is live for it (a half in a gap between
// two documents' spans is loaded and not used). Shared memory: GST stages of
// K + two dS^T halves (32 KiB at D 128), then both blocks' block tiles (K_b,
// dS^T) in one area of their own, loaded at the start: 2 CTAs per SM.
template <int D> struct Dqs2Layout {
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
__global__ void __launch_bounds__(2 * GNT, 2) dqs2_kernel(Params p, const __grid_constant__ KvMaps maps, DsBuf dsb)
{
#if DF_WG_BODY
    using L = Dqs2Layout<D>;
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

} // namespace

bool dqs_usable(int D)
{
    static signed char known[2][2][64]; // [pair][D == 128][device]
    const void *f1 = D == 128 ? (const void *)dqs_kernel<128> : (const void *)dqs_kernel<64>;
    const void *f2 = D == 128 ? (const void *)dqs2_kernel<128> : (const void *)dqs2_kernel<64>;
    return wg_kernel_runs(f1, D == 128 ? DqsLayout<128>::SMEM : DqsLayout<64>::SMEM, known[0][D == 128]) &&
           wg_kernel_runs(f2, D == 128 ? Dqs2Layout<128>::SMEM : Dqs2Layout<64>::SMEM, known[1][D == 128]);
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

namespace {
// one kernel's launch: its shared memory (the largest carveout: 3 dqs_kernel
// or 2 dqs2_kernel CTAs per SM), then grid x threads
cudaError_t dqs_run(const void *fn, size_t smem, unsigned grid, unsigned threads, cudaStream_t st, const Params &p,
                    const KvMaps &maps, const DsBuf &dsb)
{
    cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (e != cudaSuccess)
        return e;
    void *args[3] = {const_cast<Params *>(&p), const_cast<KvMaps *>(&maps), const_cast<DsBuf *>(&dsb)};
    return cudaLaunchKernel(fn, dim3(grid), dim3(threads), args, smem, st);
}
} // namespace

int dqs_launch(const Params &p, int D, cudaStream_t st, const KvMaps &maps, const DsBuf &dsb)
{
    const long long n = (long long)p.nb * p.nkv;
    if (n <= 0)
        return 0;
    // dqs2_kernel (pairs of blocks), or DFLASH_ATTN_WG3_DQ=single: dqs_kernel (read once)
    static int single = -1;
    if (single < 0) {
        const char *v = getenv("DFLASH_ATTN_WG3_DQ");
        single = v && !strcmp(v, "single");
    }
    cudaError_t e;
    if (single)
        e = D == 128 ? dqs_run((const void *)dqs_kernel<128>, DqsLayout<128>::SMEM, (unsigned)n, GNT, st, p, maps, dsb)
                     : dqs_run((const void *)dqs_kernel<64>, DqsLayout<64>::SMEM, (unsigned)n, GNT, st, p, maps, dsb);
    else {
        const unsigned n2 = (unsigned)((long long)(p.nb + 1) / 2 * p.nkv);
        e = D == 128 ? dqs_run((const void *)dqs2_kernel<128>, Dqs2Layout<128>::SMEM, n2, 2 * GNT, st, p, maps, dsb)
                     : dqs_run((const void *)dqs2_kernel<64>, Dqs2Layout<64>::SMEM, n2, 2 * GNT, st, p, maps, dsb);
    }
    if (e != cudaSuccess) {
        fprintf(stderr, "dflash_attn: dqs%s_kernel<%d>: %s (%s:%d)\n", single ? "" : "2", D, cudaGetErrorString(e),
                __FILE__, __LINE__);
        return -EIO;
    }
    return 0;
}

} // namespace df_dflash
