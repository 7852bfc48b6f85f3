// dflash_attn/wg_dq.cu - the dQ pass of impls DF_CUDA_DFLASH_IMPL_WG2 /
// WG2F's backward (dflash_attn.h) on Hopper warpgroup MMA (wgmma.mma_async,
// sm_90a), in place of MMA4's dq_mma2_kernel. (WG3, the default, computes
// dQ from the stored dS instead: wg_dqs.cu; WG2F is its fallback where a
// block's rows of a kv head are more than one row chunk.)
//
// Work split: one item per (block b, kv head g, row chunk), handed to a
// persistent grid (see the kernel). The 64 rows of a chunk are the 16
// queries x `group` heads of one block and kv head, sharing one anchor and
// one context span [lo0, anchor) (lo0: the widest row's bound), so every
// key tile of the span is a dense 64 rows x QTK keys problem:
//   S  = Q K^T,  dP = dO V^T                          (k-dim D)
//   P  = exp2(S scale log2e - lse log2e)   (fp32; masked on partial tiles)
//   dS = P (dP - Di)
//   dQ += dS K                     (dS rounded to bf16; fp32 accumulator)
// then the block's own keys (kb / vb; in-block causality on sliding
// layers), masked per element past bs. block_size <= 16: the block tile is
// 16 keys wide (wgmma m64n16k16; one k16 step for dQ) rather than a 64-key
// tile three quarters zeros. dQ is scaled once at the end and written as
// bf16 by the thread that summed it, in tile order: deterministic, no
// atomics.
//
// CTA: one warpgroup (wgmma M = 64 = the chunk's rows); warp w holds rows
// 16 w .. + 15 of every accumulator. Per tile:
//   1. S, dP: D/16 wgmma m64n64k16 each, A = Q / dO (resident, K-major),
//      B = K / V (the tile's stage, K-major); two commit groups, so P is
//      computed while dP is still running.
//   2. P, dS in the accumulator registers: the fp32 accumulator layout of a
//      16-key column pair is the bf16 A-fragment layout of a k16 step, so
//      dS is the register A operand of step 3 without shuffles.
//   3. dQ += dS K: QTK/16 wgmma m64nDk16, B = the same K stage, MN-major
//      through the descriptor (no transposed copy).
// K / V tiles stream through QST = 2 stages by TMA (the forward's tensor
// maps, common.cuh's KvMaps), one tile ahead; thread 0 issues a tile's
// copies after the barrier at the top of the tile before, which every
// thread passes only once that tile's wgmmas retired. Keys past the anchor
// arrive and are masked; keys past S arrive as zeros. Q, dO: by TMA (the
// maps' 3-D boxes) where a block's rows of a kv head are one whole chunk
// (bs x group == 64), else by every thread's cp.async. Tiles use the
// 128-byte swizzle of wg.cuh. Per-(row, key) masks only on tiles that not
// every row sees whole. Rows past bs x group: Q, dO zero, lse -inf (P = 0),
// not written. Padding blocks: dq 0.
//
// Resources (ptxas, sm_90a, D 128): ~190 registers (~250 with FOLD), no
// spills, 105 KiB of dynamic shared memory: 2 CTAs per SM. The pass is
// latency-bound (ncu: 2 active warps per scheduler); warp specialization is
// the known next lever. docs/log/ has the measurements behind each choice.
//
// Impl WG2F: the FOLD instantiation (launched only with p.nch == 1) also
// computes its rows' Di (chunk_di: di_kernel's sum order, so dQ and the
// context dK/dV equal WG2's bitwise) and its block's dK / dV for kv head g
// from the block tile's P and dS: the backward then runs neither di_kernel
// nor the block tiles of dkv_mma2_kernel. FOLD = false compiles to the same
// code as a kernel without the fold.
// Portability: the kernel body exists only in sm_90a code; elsewhere
// dq_wg_usable() is false and the backward runs dq_mma2_kernel in the same
// order. The non-sm_90a body traps, so a launch there fails loudly.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "knobs.h"
#include "wg_bwd.cuh" // QNT, the shared device helpers; common.cuh, wg.cuh

namespace df_dflash {
namespace {

constexpr int QTK = 64;  // keys per tile (S, dP: n 64; dQ: 4 k steps of 16)
[[maybe_unused]] constexpr int QST = 2; // K / V stages (tile t + 1 loads during tile t)

// Shared memory, bytes from a 1024-aligned base: NPR = 3 page pairs of 2 x
// QS bytes (a chunk's Q and dO, or a tile's K and V: QS == KV), pair q at q
// PR, then one mbarrier (8 bytes) per pair. Their roles rotate from item to
// item (see the kernel). D 128: 3 x 32 KiB.
constexpr int NPR = 3;
template <int D> struct DqLayout {
    static constexpr int NH = D / 64;                // 128-byte column blocks per row
    static constexpr int QS = NH * CHUNK_ROWS * 128; // Q (or dO) of the chunk
    static constexpr int KV = NH * QTK * 128;        // one K (or V) tile
    static constexpr int PR = 2 * QS;                // a page pair
    static_assert(QS == KV, "a pair holds Q, dO or K, V");
    // block_size <= 16: the block tile's own area after the pairs: its K (16
    // rows of each column block) at 0, V at BK; once the tile's dQ wgmma
    // retired, FOLD's P^T / dS^T (16 rows of 128 bytes each) at BK and BK + 2
    // KiB (over V: its last reader, the dP wgmma, retired before the dQ wgmma
    // was issued by every warp): BK + 4 KiB (D 128: 8 KiB)
    static constexpr int BK = NH * 16 * 128;
    static constexpr int BLK_OFF = NPR * PR;
    static constexpr int BLK = BK + 2 * 2048;
    static constexpr int BAR_OFF = BLK_OFF + BLK; // mbarriers: pairs 0 .. NPR - 1, then the block area
    // ints: the CTA's next item, its anchor and document start (prefetched)
    static constexpr int NX_OFF = BAR_OFF + (NPR + 1) * 8;
    static constexpr size_t SMEM = (size_t)NX_OFF + 16 + 1024; // + alignment slack
};
static_assert(QTK == WG_KV_BOX, "the tensor maps' box is one key tile");

#if DF_WG_BODY
constexpr int PTB = QTK * CHUNK_ROWS * 2; // WG2F: one bf16 [key][row] tile (P^T or dS^T), 8 KiB
#endif

// Items (block, kv head, row chunk), item i = (nb - 1 - b) nkv nch + g nch
// + ch: blocks last to first (the forward's order: a document's longest
// context spans first, neighbouring anchors side by side).
// Persistent: the host launches as many CTAs as fit at once (2 per SM at D
// 128, shared-memory bound); CTA c's first item is c, each next one is
// taken from the counter *ctr (zeroed by the host; atomicAdd plus gridDim.x)
// at the start of the item before, so items go to CTAs as they free up, in
// item order. The mapping changes nothing in the results: each item is
// computed whole by one CTA, in tile order. A static stride of items, one
// CTA per item (DFLASH_ATTN_DQ_PERSIST=0) and issuing the next item's first
// two tiles early were each tried and were slower (docs/log/).
// Where a block's rows of a kv head are one TMA box (maps.qd_on) and the
// block tile is 16 keys (bs <= 16), the next item's loads run under this
// item's block tile and epilogue: its Q / dO and its first context tile by
// TMA, and (FOLD) its O rows and lse, so its Di is computed (chunk_di_smem:
// chunk_di's bits) before this item's fold; its anchor and document start
// come by cp.async into shared memory. Shared memory is three page pairs
// (Q + dO, or one context tile's K + V: 2 x 16 KiB at D 128) whose roles
// rotate, plus, bs <= 16, the block area (the block tile's 16 keys, then
// FOLD's P^T / dS^T: DqLayout): item i holds Q / dO in pair pq and its
// context tiles alternate in pk0 / pk1; its block tile lands in the block
// area, issued at the item's start. From the block tile's barrier on (the
// last context tile's wgmmas retired) pk0 and pk1 are free: item i + 1's Q
// / dO go to pk1, its first context tile to pk0; item i + 1 then holds Q /
// dO in pk1 and its tiles in pk0 and the old pq (free once the fold's
// wgmmas retired: the item's last barrier). One mbarrier per pair and one
// for the block area, each phase counted apart.
// FOLD (impl WG2F; launched only with p.nch == 1, so the CTA holds every
// row that sees its block's keys for kv head g, and bs <= QTK: one block
// tile, the last of the loop): the CTA also computes its rows' Di
// (chunk_di; writes p.Di) and its block's dK / dV for kv head g:
//   dV_b = P^T dO,  dK_b = scale dS^T Q      (bs block keys x D)
// from the block tile's P and dS (bf16, as the dQ GEMM used them) summed
// over the chunk's 64 rows. P^T and dS^T are stored as bf16 [key][row]
// tiles (128-byte rows, the Q tile's swizzle: K-major operands): with the
// 16-key block tile in the block area over its V once the tile's dQ wgmma
// retired, else into the free stage pair. After the loop and dQ's write-out
// (its accumulators dead): with the 16-key block tile the transposed
// products dV_b^T = dO^T P, dK_b^T = Q^T dS (fold16: M = head dims, N = 16
// keys; a quarter of the tensor work of m64 over 64 keys), else 2 x 4 wgmma
// m64nDk16 with A = P^T / dS^T and B = dO / Q, MN-major. Block dK / dV need
// not be bitwise MMA4's (wgmma's sum order within a k step may differ).
template <int D, bool FOLD>
__global__ void __launch_bounds__(QNT, 2)
    dq_wg_kernel(Params p, const __grid_constant__ KvMaps maps, int nitems, int *ctr)
{
#if DF_WG_BODY
    using L = DqLayout<D>;
    constexpr int V8 = D / 8, KS = D / 16, NA = D / 2; // NA: dQ accumulators per thread
    constexpr uint32_t KM_LBO = 16, SBO = 1024;
    extern __shared__ __align__(1024) uint8_t wq_smem[];
    const uint32_t s0 = smem_u32(wq_smem), sb = (s0 + 1023u) & ~1023u;
    const int tid = threadIdx.x, lane = tid & 31, gid = lane >> 2, t4 = lane & 3;
    // warp index broadcast from lane 0: warp-uniform for the compiler
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const long long ldq = (long long)p.nq * D, ldk = (long long)p.nkv * D;
    // one mbarrier per page pair, initialised before any copy; ph: bit q is
    // the parity of pair q's next fill (every thread waits on every fill)
    const uint32_t bar0 = sb + L::BAR_OFF;
    if (tid == 0) {
        for (int i = 0; i <= NPR; i++)
            mbar_init(bar0 + 8 * i, 1);
        mbar_fence_init();
    }
    __syncthreads(); // the mbarriers' inits
    uint32_t ph = 0;
    auto pair_wait = [&](int q) {
        mbar_wait(bar0 + 8 * q, (ph >> q) & 1u);
        ph ^= 1u << q;
    };
    // the pairs' roles: Q / dO of the current item in pair pq, its tiles
    // t even / odd in pairs pk[0] / pk[1]; qnext: the item's Q / dO were
    // issued by the previous item (into pq)
    int pq = 0, pk0 = 1, pk1 = 2;
    // qnext: also its Di (FOLD) and lse, computed by the previous item
    bool qnext = false;
    float nxDr[2], nxL[2];
    const int kbox = p.bs <= 16 ? 16 : QTK; // the block maps' box rows
    // block_size <= 16: one block tile, of 16 keys
    const bool b16 = p.bs <= 16;
    volatile int *s_nx = reinterpret_cast<volatile int *>(wq_smem + (sb - s0) + L::NX_OFF);
    for (int item = blockIdx.x, nx; item < nitems; item = nx) {
        // the CTA's next item (dynamic: items go to CTAs as they free up, as the
        // hardware hands out CTAs); thread 0 takes it now, publishes it before
        // the item's first barrier (its latency under the item's loads)
        int taken = 0;
        if (tid == 0)
            taken = (int)gridDim.x + atomicAdd(ctr, 1);
        const int ch = item % p.nch, g = (item / p.nch) % p.nkv, b = p.nb - 1 - item / (p.nch * p.nkv);
        if (!qnext && !p.valid[b]) { // (qnext: known valid)
            for (int e = tid; e < CHUNK_ROWS * V8; e += QNT) {
                RowId id = row_id(p, b, g, ch, e / V8);
                if (id.ok)
                    *reinterpret_cast<uint4 *>(p.dq + id.grow * ldq + (long long)id.h * D + (e % V8) * 8) =
                        make_uint4(0u, 0u, 0u, 0u);
            }
            if constexpr (FOLD) {
                // dkv_mma2_kernel's block tiles write a padding block's dkb /
                // dvb as 0; its rows' Di as di_kernel would (nothing reads them:
                // padding blocks are in no tile list; kept so that p.Di equals
                // di_kernel's)
                for (int e = tid; e < p.bs * V8; e += QNT) {
                    long long off = ((long long)b * p.bs + e / V8) * ldk + (long long)g * D + (e % V8) * 8;
                    *reinterpret_cast<uint4 *>(p.dkb + off) = make_uint4(0u, 0u, 0u, 0u);
                    *reinterpret_cast<uint4 *>(p.dvb + off) = make_uint4(0u, 0u, 0u, 0u);
                }
                RowId rid[2] = {row_id(p, b, g, ch, 16 * warp + gid),
                                row_id(p, b, g, ch, 16 * warp + gid + 8)};
                float Dr[2];
                chunk_di<D>(p, rid, t4, Dr);
#pragma unroll
                for (int ri = 0; ri < 2; ri++)
                    if (rid[ri].ok && t4 == 0)
                        p.Di[(long long)rid[ri].grow * p.nq + rid[ri].h] = Dr[ri];
            }
            if (tid == 0)
                *s_nx = taken;
            __syncthreads();
            nx = *s_nx;
            __syncthreads(); // everyone read it before thread 0 writes the next
            continue; // (no early issue from a padding block: qnext is false)
        }
        // (qnext: prefetched by the previous item)
        const int anc = qnext ? s_nx[1] : p.anchor[b], ds = qnext ? s_nx[2] : p.doc_start[b];
        const int lo0 = ctx_lo(anc, ds, p.W, 0), lohi = ctx_lo(anc, ds, p.W, p.bs - 1);
        const int ntc = (anc - lo0 + QTK - 1) / QTK, ntb = (p.bs + QTK - 1) / QTK, nt = ntc + ntb;
        // Q, dO of the chunk into pair pq, waited for before the first tile: by
        // TMA where the block's rows of kv head g are one whole chunk
        // (maps.qd_on; thread 0, pair pq's mbarrier), else by cp.async
        // (zero-filled past its rows). Already issued by the previous item: qnext.
        const uint32_t qsm = sb + pq * L::PR;
        if (maps.qd_on) {
            if (tid == 0 && !qnext) {
                const uint32_t qb = bar0 + 8 * pq;
                mbar_expect_tx(qb, (uint32_t)(2 * L::QS));
#pragma unroll
                for (int cb = 0; cb < L::NH; cb++) {
                    tma_load_3d(qsm + cb * (CHUNK_ROWS * 128), &maps.q, 64 * cb, g * p.group, b * p.bs, qb);
                    tma_load_3d(qsm + L::QS + cb * (CHUNK_ROWS * 128), &maps.dout, 64 * cb, g * p.group,
                                b * p.bs, qb);
                }
            }
        } else {
            for (int e = tid; e < CHUNK_ROWS * V8; e += QNT) {
                int r = e / V8, c = e % V8;
                RowId id = row_id(p, b, g, ch, r);
                long long off = id.ok ? id.grow * ldq + (long long)id.h * D + c * 8 : 0;
                uint32_t so = (uint32_t)sw_off(r, c, CHUNK_ROWS);
                cp16(qsm + so, p.q + off, id.ok);
                cp16(qsm + L::QS + so, p.dout + off, id.ok);
            }
            cp_commit();
        }
        // K and V of tile t into page pair pr by TMA, issued by thread 0 (the
        // forward's loads: context keys past anc arrive as they are and are
        // masked, keys past S as zeros; block tile t - ntc from the block maps)
        auto issue = [&](int t, int pr) {
            if (tid != 0)
                return;
            const bool isctx = t < ntc;
            const int row = isctx ? lo0 + t * QTK : b * p.bs + (t - ntc) * QTK;
            const uint32_t dst = sb + pr * L::PR, bar = bar0 + 8 * pr;
            mbar_expect_tx(bar, (uint32_t)(2 * L::NH * (isctx ? QTK : kbox) * 128));
#pragma unroll
            for (int cb = 0; cb < L::NH; cb++) {
                tma_load_2d(dst + cb * (QTK * 128), isctx ? &maps.kc : &maps.kb, g * D + 64 * cb, row, bar);
                tma_load_2d(dst + L::KV + cb * (QTK * 128), isctx ? &maps.vc : &maps.vb, g * D + 64 * cb, row,
                            bar);
            }
        };
        // b16: the block tile into its own area (free: the previous item's fold
        // retired before its last barrier)
        auto issue_blk = [&]() {
            if (tid != 0)
                return;
            const uint32_t dst = sb + L::BLK_OFF, bar = bar0 + 8 * NPR;
            mbar_expect_tx(bar, (uint32_t)(2 * L::BK));
#pragma unroll
            for (int cb = 0; cb < L::NH; cb++) {
                tma_load_2d(dst + cb * (16 * 128), &maps.kb, g * D + 64 * cb, b * p.bs, bar);
                tma_load_2d(dst + L::BK + cb * (16 * 128), &maps.vb, g * D + 64 * cb, b * p.bs, bar);
            }
        };
        static_assert(QST == 2, "tile t is in pair pk0 (t even) or pk1 (t odd)");
        if (b16) {
            issue_blk();
            if (!qnext && ntc > 0) // (qnext: the previous item issued tile 0)
                issue(0, pk0);
        } else {
            issue(0, pk0);
        }
        // this thread's rows: r0 = 16 warp + gid (accumulator elements 4 j + 0, 1)
        // and r0 + 8 (4 j + 2, 3); their lse (log2 domain), Di, context bound
        RowId rid[2] = {row_id(p, b, g, ch, 16 * warp + gid), row_id(p, b, g, ch, 16 * warp + gid + 8)};
        float nL[2], Dr[2];
        int rlo[2];
        bool rok[2];
        if constexpr (FOLD) { // Di here (di_kernel's bits), for this CTA and the later passes
            if (qnext)
                Dr[0] = nxDr[0], Dr[1] = nxDr[1];
            else
                chunk_di<D>(p, rid, t4, Dr);
        }
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            long long li = (long long)rid[ri].grow * p.nq + rid[ri].h;
            float l2 = rid[ri].ok ? (FOLD && qnext ? nxL[ri] : p.lse_in[li]) * WLOG2E : -INFINITY;
            nL[ri] = -l2;
            if constexpr (FOLD) {
                if (rid[ri].ok && t4 == 0)
                    p.Di[li] = Dr[ri];
            } else {
                Dr[ri] = rid[ri].ok ? p.Di[li] : 0.0f;
            }
            rok[ri] = rid[ri].ok && l2 != -INFINITY;
            rlo[ri] = ctx_lo(anc, ds, p.W, rid[ri].qo);
        }
        if (tid == 0)
            *s_nx = taken;
        const bool allok = __syncthreads_and(rok[0] && rok[1]);
        nx = *s_nx; // (thread 0 writes the next one after the item's last barrier)
        // the next item: its Q / dO (and FOLD: Di, lse) are loaded during this
        // item's block tile where they come by TMA and the block tile leaves a
        // pair free
        const int bnx = p.nb - 1 - nx / (p.nch * p.nkv), gnx = (nx / p.nch) % p.nkv;
        const bool early = nx < nitems && maps.qd_on && b16 && p.valid[bnx];
        // the next item's anchor and document start, for its start (thread 0:
        // cp.async, waited for before the item's last barrier; no registers held)
        if (early && tid == 0) {
            const uint32_t nxs = sb + L::NX_OFF;
            cp4(nxs + 4, p.anchor + bnx, true);
            cp4(nxs + 8, p.doc_start + bnx, true);
            cp_commit();
        }
        float acc[NA];
        acc_zero(acc); // pinned before the loop
        const float sl = p.scale * WLOG2E;
        const uint64_t dQ = wg_desc(qsm, KM_LBO, SBO), dO = dQ + (L::QS >> 4);
        // !b16: the block tile's pair (the last tile's) and the other stage pair
        // (free during the block tile: tile nt - 2's, or no tile of this item's).
        // b16: during the block tile (in the block area) both stage pairs are
        // free: the next item's Q / dO go to pk1, its first context tile to pk0
        const int pfree = b16 ? pk1 : (nt - 1) & 1 ? pk0 : pk1;
        // FOLD: the block tile's P^T and dS^T (bf16 [key][row] tiles) at pt,
        // pt + pstep: with a 16-key block tile, in the block area over its V
        // (see DqLayout; the rows the wgmmas read past their 16 feed only dK /
        // dV rows that are not written); else in the free pair
        const uint32_t pt = b16 ? sb + L::BLK_OFF + L::BK : sb + pfree * L::PR;
        const uint32_t pstep = b16 ? 2048 : PTB;
        // Key tile t: NS = 32 accumulators per thread (64 keys, m64n64: the
        // context tiles, and the block tile when block_size > 16) or 8 (the
        // 16-key block tile, m64n16, when block_size <= 16).
        auto step = [&](int t, auto nsc) {
            constexpr int NS = decltype(nsc)::value, NJ = NS / 4, NKK = NS / 8;
            const int pr = NS == 8 ? NPR : t & 1 ? pk1 : pk0; // (NS 8: the block area's barrier)
            if (t == 0) { // Q, dO landed (TMA; or this thread's copies, made visible to the tensor cores)
                if (maps.qd_on) {
                    if (!(FOLD && qnext)) // (else waited for by the previous item, for Di)
                        pair_wait(pq);
                } else {
                    cp_wait<0>();
                    fence_proxy_async();
                }
            }
            pair_wait(pr); // tile t landed
            __syncthreads(); // Q, dO (everyone's copies); tile t - 1's wgmmas retired (its end)
            if (t + 1 < (b16 ? ntc : nt)) // tile t + 1 into the pair tile t - 1 used
                issue(t + 1, t & 1 ? pk0 : pk1);
            else if (NS == 8 && early && tid == 0) {
                // the block tile: the next item's Q / dO into the free pair and its
                // first context tile into the other, so their latency runs under
                // this tile and the epilogue
                cp_wait<0>(); // its anchor / document start (this thread's cp.async)
                const int ancn = s_nx[1], lon = ctx_lo(ancn, s_nx[2], p.W, 0);
                if (ancn > lon) {
                    const uint32_t dst = sb + pk0 * L::PR, bar = bar0 + 8 * pk0;
                    mbar_expect_tx(bar, (uint32_t)(2 * L::NH * QTK * 128));
#pragma unroll
                    for (int cb = 0; cb < L::NH; cb++) {
                        tma_load_2d(dst + cb * (QTK * 128), &maps.kc, gnx * D + 64 * cb, lon, bar);
                        tma_load_2d(dst + L::KV + cb * (QTK * 128), &maps.vc, gnx * D + 64 * cb, lon, bar);
                    }
                }
                const uint32_t qb = bar0 + 8 * pfree, qn = sb + pfree * L::PR;
                mbar_expect_tx(qb, (uint32_t)(2 * L::QS));
#pragma unroll
                for (int cb = 0; cb < L::NH; cb++) {
                    tma_load_3d(qn + cb * (CHUNK_ROWS * 128), &maps.q, 64 * cb, gnx * p.group, bnx * p.bs,
                                qb);
                    tma_load_3d(qn + L::QS + cb * (CHUNK_ROWS * 128), &maps.dout, 64 * cb, gnx * p.group,
                                bnx * p.bs, qb);
                }
            }
            // NS 8: the block area, 16 rows per column block
            constexpr int BR = NS == 8 ? 16 : QTK;
            const uint32_t kd = NS == 8 ? sb + L::BLK_OFF : sb + pr * L::PR;
            const uint64_t dK = wg_desc(kd, KM_LBO, SBO), dV = dK + ((NS == 8 ? L::BK : L::KV) >> 4);
            float s[NS], dp[NS];
            wg_fence();
            wg_tile_ab<NS, KS, CHUNK_ROWS, BR>(s, dQ, dK);
            wg_commit();
            wg_tile_ab<NS, KS, CHUNK_ROWS, BR>(dp, dO, dV);
            wg_commit();
            const bool isctx = t < ntc;
            const int base = isctx ? lo0 + t * QTK : (t - ntc) * QTK;
            // every row of the chunk sees the whole tile: no per-element mask
            const bool full = NS == 32 && allok && isctx && base >= lohi && base + QTK <= anc;
            wg_wait<1>(); // S; dP still running
            reg_fence(s);
            // P: element 4 j + e is row r0 + 8 (e >> 1), key base + 8 j + 2 t4 +
            // (e & 1). Branch-free: masked elements get 2^-inf = 0.
            if (full) {
#pragma unroll
                for (int j = 0; j < NJ; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        s[4 * j + e] = ex2(fmaf(s[4 * j + e], sl, nL[e >> 1]));
            } else {
                // visible keys of each row in this tile: [klo, khi)
                int klo[2], khi[2];
#pragma unroll
                for (int ri = 0; ri < 2; ri++)
                    row_key_range(p, rid[ri], rlo[ri], rok[ri], isctx, anc, klo[ri], khi[ri]);
#pragma unroll
                for (int j = 0; j < NJ; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int ri = e >> 1, key = base + 8 * j + 2 * t4 + (e & 1);
                        bool vis = key >= klo[ri] && key < khi[ri];
                        float x = fmaf(s[4 * j + e], sl, nL[ri]);
                        s[4 * j + e] = ex2(vis ? x : -INFINITY);
                    }
            }
            wg_wait<0>(); // dP
            reg_fence(dp);
            // dS as the A fragments of dQ's k steps: k step kk (keys 16 kk .. + 15)
            // = accumulator columns 2 kk, 2 kk + 1
            uint32_t sa[NKK][4];
#pragma unroll
            for (int kk = 0; kk < NKK; kk++)
#pragma unroll
                for (int h = 0; h < 4; h++) {
                    int i = 8 * kk + 2 * h; // elements i, i + 1: row r0 + 8 (h & 1)
                    float d0 = Dr[h & 1];
                    sa[kk][h] = pack_bf2(s[i] * (dp[i] - d0), s[i + 1] * (dp[i + 1] - d0));
                }
            // FOLD, the block tile (the last tile: bs <= QTK): P^T, dS^T (bf16, the
            // values of this tile's dQ) as [key][row] tiles of 128-byte rows in
            // the 128-byte swizzle (row r of key k: chunk r / 8 at chunk position
            // (r / 8) ^ (k % 8), element r % 8 = gid in it), at pt (see there).
            // Only the 8-key groups below bs: the other A rows (keys) feed only
            // dK / dV rows that are not written. Read by the fold's wgmmas after
            // the loop (fenced and synced there). NS 8: stored once this tile's
            // dQ wgmma retired (pt is over the block tile's V); else before it
            // (pt is in the free pair).
            auto store_pt = [&]() {
                if constexpr (FOLD) {
                    if (t != nt - 1)
                        return;
                    store_pt_ds<NJ>(wq_smem + (pt - s0), pstep, s, sa, p.bs, warp, gid, t4);
                }
            };
            if constexpr (NS != 8)
                store_pt();
            // B of k step kk: keys 16 kk .. + 15 of the K tile, MN-major (LBO: one
            // column block of the tile)
            const uint64_t mK = wg_desc(kd, BR * 128, SBO);
            wg_fence(); // the A fragments were written by ordinary instructions
#pragma unroll
            for (int kk = 0; kk < NKK; kk++)
                wg_rs(acc, sa[kk], mK + kk * (16 * 128 >> 4));
            wg_commit();
            // retired before the next tile: frees the dS fragments, and the K
            // stage is refilled right after the next barrier
            wg_wait<0>();
            if constexpr (NS == 8)
                store_pt();
        };
        for (int t = 0, ntl = b16 ? ntc : nt; t < ntl; t++)
            step(t, IntC<32>());
        // FOLD, early: the next item's O rows (for its Di) and lse, loaded under
        // the block tile and this item's epilogue
        uint4 onx[2][FOLD ? D / 32 : 1];
        if constexpr (FOLD) {
            if (early) {
                const int chnx = nx % p.nch;
                RowId nid[2] = {row_id(p, bnx, gnx, chnx, 16 * warp + gid),
                                row_id(p, bnx, gnx, chnx, 16 * warp + gid + 8)};
                chunk_o_load<D>(p, nid, t4, onx);
#pragma unroll
                for (int ri = 0; ri < 2; ri++)
                    nxL[ri] = nid[ri].ok ? p.lse_in[(long long)nid[ri].grow * p.nq + nid[ri].h] : 0.0f;
            }
        }
        if (b16)
            step(nt - 1, IntC<8>());
        reg_fence(acc);
        // element 4 j + 2 ri + e: row r0 + 8 ri, head dim 8 j + 2 t4 + e
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            const RowId &id = rid[ri];
            if (!id.ok)
                continue;
            uint16_t *qrow = p.dq + id.grow * ldq + (long long)id.h * D + 2 * t4;
#pragma unroll
            for (int j = 0; j < D / 8; j++)
                *reinterpret_cast<uint32_t *>(qrow + 8 * j) =
                    pack_bf2(acc[4 * j + 2 * ri] * p.scale, acc[4 * j + 2 * ri + 1] * p.scale);
        }
        if constexpr (FOLD) {
            // the next item's Di, once its dO landed (issued in the block tile)
            if (early) {
                pair_wait(pfree);
                chunk_di_smem<D>(onx, wq_smem + (sb + pfree * L::PR + L::QS - s0), 16 * warp + gid, t4, nxDr);
            }
            // the block's dK / dV for kv head g (see the kernel's comment) from
            // P^T at pt, dS^T at pt + pstep, where the block tile stored them
            static_assert(2 * PTB <= L::PR, "P^T and dS^T fit one page pair");
            fence_proxy_async(); // this thread's P^T / dS^T stores -> the tensor cores ...
            __syncthreads();     // ... everyone's (every wgmma of the loop retired in its tile)
            if (b16) {
                fold16<D>(p, b, g, qsm, pt, pstep, ldk, warp, gid, t4);
            } else {
                float dv[NA], dk[NA];
                acc_zero(dv);
                acc_zero(dk);
                // A (P^T, dS^T: 64 keys x 64 rows, K-major): k step kk = rows 16 kk ..
                // + 15, 32 bytes into the 128-byte rows (as the S GEMM's A = Q). B (dO,
                // Q: 64 rows x D, MN-major): k step kk = rows 16 kk .. + 15 = 2048
                // bytes, LBO one column block of the chunk (dkv_wg_kernel's mO, mQ).
                const uint64_t aP = wg_desc(pt, KM_LBO, SBO), aS = aP + (pstep >> 4);
                const uint64_t mQ = wg_desc(qsm, CHUNK_ROWS * 128, SBO), mO = mQ + (L::QS >> 4);
                wg_fence();
    #pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    wg_ss_tb(dv, aP + kk * (32 >> 4), mO + kk * (16 * 128 >> 4));
    #pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    wg_ss_tb(dk, aS + kk * (32 >> 4), mQ + kk * (16 * 128 >> 4));
                wg_commit();
                wg_wait<0>();
                reg_fence(dv);
                reg_fence(dk);
                // element 4 j + 2 h + e: key 16 warp + gid + 8 h, head dim 8 j + 2 t4 + e;
                // dK scaled in fp32 before the rounding (dkv_mma2_kernel's order)
    #pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int key = 16 * warp + gid + 8 * h;
                    if (key >= p.bs)
                        continue;
                    const long long off = ((long long)b * p.bs + key) * ldk + (long long)g * D + 2 * t4;
    #pragma unroll
                    for (int j = 0; j < D / 8; j++) {
                        *reinterpret_cast<uint32_t *>(p.dkb + off + 8 * j) =
                            pack_bf2(dk[4 * j + 2 * h] * p.scale, dk[4 * j + 2 * h + 1] * p.scale);
                        *reinterpret_cast<uint32_t *>(p.dvb + off + 8 * j) =
                            pack_bf2(dv[4 * j + 2 * h], dv[4 * j + 2 * h + 1]);
                    }
                }
            }
        }
        if (early && tid == 0)
            cp_wait<0>(); // the next item's anchor / start landed (visible after the barrier)
        // every thread's wgmmas of this item retired (at its last tile / the
        // fold): the next item's copies may refill the pairs
        __syncthreads();
        if (early) { // the next item: Q / dO in the free pair, tiles in the others
            const int opq = pq;
            pq = pfree, pk1 = opq; // (pk0: the next item's tile 0, if any)
        }
        qnext = early;
    }
#else
    __trap(); // built without sm_90a: dq_wg_usable() keeps launches away
#endif
}

} // namespace

bool dq_wg_usable(int D, bool fold)
{
    static signed char known[2][2][64]; // [fold][D == 128][device]
    const void *fn = D == 128 ? (fold ? (const void *)dq_wg_kernel<128, true>
                                      : (const void *)dq_wg_kernel<128, false>)
                              : (fold ? (const void *)dq_wg_kernel<64, true>
                                      : (const void *)dq_wg_kernel<64, false>);
    return wg_kernel_runs(fn, D == 128 ? DqLayout<128>::SMEM : DqLayout<64>::SMEM,
                          known[fold][D == 128]);
}

namespace {
template <int D, bool FOLD>
cudaError_t dq_wg_run(const Params &p, unsigned n, cudaStream_t st, const KvMaps &maps, int *ctr)
{
    cudaError_t e = cudaFuncSetAttribute(dq_wg_kernel<D, FOLD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)DqLayout<D>::SMEM);
    if (e != cudaSuccess)
        return e;
    // persistent: as many CTAs as fit at once (2 per SM at D 128), CTA c
    // taking item c first, then items from the counter ctr (see the kernel);
    // DFLASH_ATTN_DQ_PERSIST=0: one CTA per item (the order as before). The
    // resident count per device is asked once (racing first calls store the
    // same value; 0: unknown or not persistent).
    const int persist = df_knob_int(DF_KNOB_ATTN_DQ_PERSIST);
    static int resident[64];
    unsigned grid = n;
    int dev = 0;
    if (persist && cudaGetDevice(&dev) == cudaSuccess && dev >= 0 && dev < 64) {
        if (!resident[dev]) {
            int nsm = 0, per = 0;
            if (cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess &&
                cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, dq_wg_kernel<D, FOLD>, QNT,
                                                              DqLayout<D>::SMEM) == cudaSuccess)
                resident[dev] = per * nsm > 0 ? per * nsm : 0;
        }
        if (resident[dev] > 0 && (unsigned)resident[dev] < n)
            grid = (unsigned)resident[dev];
    }
    e = cudaMemsetAsync(ctr, 0, sizeof(int), st);
    if (e != cudaSuccess)
        return e;
    dq_wg_kernel<D, FOLD><<<grid, QNT, DqLayout<D>::SMEM, st>>>(p, maps, (int)n, ctr);
    return cudaGetLastError();
}
} // namespace

int dq_wg_launch(const Params &p, int D, cudaStream_t st, bool fold, const KvMaps &maps, int *ctr)
{
    long long n = (long long)p.nb * p.nkv * p.nch;
    if (n <= 0)
        return 0;
    if (fold && p.nch != 1) { // the fold needs every row of a block's kv head in one CTA
        fprintf(stderr, "dflash_attn: dq_wg_kernel fold with %d row chunks (%s:%d)\n", p.nch,
                __FILE__, __LINE__);
        return -EINVAL;
    }
    cudaError_t e = D == 128 ? (fold ? dq_wg_run<128, true>(p, (unsigned)n, st, maps, ctr)
                                     : dq_wg_run<128, false>(p, (unsigned)n, st, maps, ctr))
                             : (fold ? dq_wg_run<64, true>(p, (unsigned)n, st, maps, ctr)
                                     : dq_wg_run<64, false>(p, (unsigned)n, st, maps, ctr));
    if (e != cudaSuccess) {
        fprintf(stderr, "dflash_attn: dq_wg_kernel<%d%s>: %s (%s:%d)\n", D, fold ? ", fold" : "",
                cudaGetErrorString(e), __FILE__, __LINE__);
        return -EIO;
    }
    return 0;
}

} // namespace df_dflash
