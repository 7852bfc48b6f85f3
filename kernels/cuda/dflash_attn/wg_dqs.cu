// dflash_attn/wg_dqs.cu - impl DF_CUDA_DFLASH_IMPL_WG3's dQ: dQ from the dS
// the context dK/dV pass already computed, instead of a dQ pass that
// computes S, dP, P and dS again (dflash_attn/wg_dq.cu; two of its three
// GEMMs per tile are that recomputation).
//
// WG3's backward (mma_bwd.cu, bwd_mma4_launch):
//   1. the block pass (blk_wg_kernel, dflash_attn/wg_blk.cu): Di, the
//      block-key dK / dV and the block tile's dS^T into DsBuf.dsb;
//   2. the tile lists and the context dK/dV pass (dkv_wg_kernel, TQ), which
//      also stores each (128-key tile, item)'s dS^T, bf16 (the values its dK
//      GEMM uses), into DsBuf.ds;
//   3. dqs_kernel (here): per (block, kv head), dQ = sum over its context
//      span's 64-key halves of dS K, then the block tile's dS K_b, in key
//      order, times scale, rounded to bf16 once: deterministic, no atomics;
//      its reducer warps meanwhile sum the context dK/dV pass's split
//      partials into dkc / dvc (dkv_reduce_kernel's sums, in place of it).
// Every kernel after the block pass is a programmatic dependent (launch_pdl).
// The recomputing dQ pass did three GEMMs per 64-key tile (S, dP, dQ); this
// one does one, and reads the tile's dS (8 KiB) from memory: it trades 2 of
// the backward's 7 GEMMs for writing and reading dS once (2 bytes per
// visible (row, key) pair, rounded up to tiles: ~0.4 GB at the 27B shape,
// 3 documents; the workspace holds the worst case: dqs_max_tiles per block).
//
// Stored tiles (dflash_attn/common.cuh, DsBuf): one per (valid block b,
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

#include "common.cuh"
#include "wg.cuh"

namespace df_dflash {
namespace {

constexpr int GNT = 128; // threads: one warpgroup
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

// CTA: one per SM, persistent; an item is (four neighbouring blocks, kv
// head), items taken until none is left (the first gridDim.x by index, then
// from the counter DsBuf.ctr, which the block pass zeroes). Neighbouring
// anchors' spans mostly overlap, so one K half serves all four blocks. A
// producer warp (lane 0) walks the items' steps - each live 64-key half of
// their union (K once, by TMA: the forward's kc map; each block's dS^T half,
// 8 KiB by a plain bulk copy, where live for it; a half in a gap between two
// documents' spans is skipped), then one block step (each valid block's K_b
// by the kb map's 16-key boxes and its block tile's dS^T) - into QST
// stages, QST - 1 ahead across item boundaries, with a record per stage
// (item, half or block step, which blocks). Warpgroup w (of four) sums block
// pb - w's dQ += dS K from the stages whose record has its bit (m64nDk16, A
// = dS MN-major, transposed through the descriptor, B = K MN-major, both in
// shared memory, fp32 accumulators in registers), stores it at the block
// step and starts over. Each warp releases a stage (an "empty" mbarrier of
// 16 arrivals) once its wgmmas retired. RW reducer warps do the split
// reduction (DsBuf.part) alongside. Shared memory: QST stages of K + four
// dS^T halves, 194 KiB at D 128. Four blocks per persistent CTA, not two
// per CTA at 2 CTAs per SM: each K half is read once for four blocks (25%
// fewer bytes), the same bits, faster (docs/log/). The reducer warps add
// less time to this kernel than the dkv_reduce_kernel pass they replace.
constexpr int QB = 4, QST = 4, RW = 3; // RW: reducer warps (DsBuf.part; 20 warps in all: 96 registers each)
template <int D> struct DqsLayout {
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
__global__ void __launch_bounds__(DqsLayout<D>::NT, 1) dqs_kernel(Params p, const __grid_constant__ KvMaps maps, DsBuf dsb)
{
#if DF_WG_BODY
    using L = DqsLayout<D>;
    constexpr int NA = D / 2;
    constexpr uint32_t SBO = 1024;
    extern __shared__ __align__(1024) uint8_t gs_smem[];
    const uint32_t s0 = smem_u32(gs_smem), sb = (s0 + 1023u) & ~1023u;
    int *meta = reinterpret_cast<int *>(gs_smem + (sb - s0) + L::META);
    const int tid = threadIdx.x, lane = tid & 31;
    const uint32_t full0 = sb + L::BAR_OFF, empty0 = full0 + 8 * QST;
    const int nitems = (dsb.b1 - dsb.b0 + QB - 1) / QB * p.nkv; // (this block range's)
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
        const int off0 = dsb.off ? dsb.off[dsb.b0] : 0; // the block range's first slot
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
            const int g = item % p.nkv, pb = dsb.b1 - 1 - QB * (item / p.nkv);
            int q0[QB], q1[QB], slot0[QB], vm = 0, qa = INT_MAX, qb = -1;
#pragma unroll
            for (int w = 0; w < QB; w++) {
                const int b = pb - w;
                const bool v = b >= dsb.b0 && p.valid[b];
                int anc = 0, lo0 = 0;
                if (v)
                    anc = p.anchor[b], lo0 = ctx_lo(anc, p.doc_start[b], p.W, 0);
                vm |= v << w;
                const bool has = v && lo0 < anc;
                q0[w] = has ? lo0 / HALF : INT_MAX, q1[w] = has ? (anc - 1) / HALF : -1;
                slot0[w] = (v ? (dsb.off ? dsb.off[b] - off0 : b * dsb.maxt) : 0) - lo0 / WG_TILE_KEYS;
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
            const int g = item % p.nkv, b = dsb.b1 - 1 - QB * (item / p.nkv) - wg;
            if (b >= dsb.b0) {
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

bool dqs_usable(int D)
{
    static signed char known[2][64]; // [D == 128][device]
    const void *fn = D == 128 ? (const void *)dqs_kernel<128> : (const void *)dqs_kernel<64>;
    return wg_kernel_runs(fn, D == 128 ? DqsLayout<128>::SMEM : DqsLayout<64>::SMEM, known[D == 128]);
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
    // one CTA per SM (the SM count asked once per device), at most one per item
    const unsigned nitems = (unsigned)((long long)(dsb.b1 - dsb.b0 + QB - 1) / QB * p.nkv);
    if (nitems == 0)
        return 0;
    static int nsm[64];
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess && dev >= 0 && dev < 64 && !nsm[dev])
        e = cudaDeviceGetAttribute(&nsm[dev], cudaDevAttrMultiProcessorCount, dev);
    const unsigned grid =
        e == cudaSuccess && dev >= 0 && dev < 64 && nsm[dev] > 0 && (unsigned)nsm[dev] < nitems ? (unsigned)nsm[dev]
                                                                                                : nitems;
    const void *fn = D == 128 ? (const void *)dqs_kernel<128> : (const void *)dqs_kernel<64>;
    const size_t smem = D == 128 ? DqsLayout<128>::SMEM : DqsLayout<64>::SMEM;
    static signed char set[2][64]; // [D == 128][device]
    if (e == cudaSuccess)
        e = func_smem_once(fn, smem, false, set[D == 128]);
    if (e == cudaSuccess) {
        void *args[3] = {const_cast<Params *>(&p), const_cast<KvMaps *>(&maps), const_cast<DsBuf *>(&dsb)};
        e = launch_pdl(fn, dim3(grid), dim3(DqsLayout<128>::NT), smem, st, dsb.pdl != 0, args);
    }
    if (e != cudaSuccess) {
        fprintf(stderr, "dflash_attn: dqs_kernel<%d>: %s (%s:%d)\n", D, cudaGetErrorString(e), __FILE__, __LINE__);
        return -EIO;
    }
    return 0;
}

} // namespace df_dflash
