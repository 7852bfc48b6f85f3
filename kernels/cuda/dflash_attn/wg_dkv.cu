// dflash_attn/wg_dkv.cu - the context dK/dV pass of the DFlash attention backward
// of impls DF_CUDA_DFLASH_IMPL_WG2 and _WG2F (dflash_attn.h) on Hopper
// warpgroup MMA (wgmma.mma_async, sm_90a), in place of MMA4's dkv4_kernel.
// The per-tile block lists and their LPT order, the partials and the split
// reduction are MMA4's, in mma_bwd.cu; the dQ pass is
// dflash_attn/wg_dq.cu.
//
// Work split (MMA4's): one CTA per (key tile of 128 context keys, kv head g,
// split s of WG_NSPL); its items are (valid block whose span meets the tile,
// row chunk) in tile_list_kernel's ascending order, item k belonging to split
// k % WG_NSPL. An item is a row chunk: the 16 queries x `group` heads of one
// block and kv head (64 rows sharing one anchor and one context span), so a
// (tile, item) pair is a dense 128 keys x 64 rows problem:
//   S^T  = K Q^T          (keys x rows, k-dim D)
//   dP^T = V dO^T
//   P^T  = exp2(S^T scale log2e - lse log2e)       (fp32, masked on partial tiles)
//   dS^T = P^T (dP^T - Di)
//   dV  += P^T dO,  dK += dS^T Q                    (P^T, dS^T rounded to bf16)
// and dK is scaled once at the end. Each split writes fp32 partials that
// MMA4's dkv_reduce_kernel sums in split order (deterministic, no atomics:
// each output element is accumulated by one thread in item order). WG3 in
// block ranges (DsBuf): the pass runs once per range, each CTA taking the
// items of its list in the range (the same item indices, hence splits) and
// adding its sums to the partials the previous range stored (dK unscaled
// until the last range): one pass's products, summed per range (dK, dV within
// fp32 rounding of one pass; dQ, per block, the same bits).
//
// CTA: 2 warpgroups (256 threads), warpgroup w owns keys 64 w .. 64 w + 63 of
// the tile (wgmma M = 64) and keeps dV, dK for them in registers (2 x 64 x D
// fp32 over 128 threads). Per item, per warpgroup:
//   1. S^T, dP^T: D/16 wgmma m64n64k16 each, A = K / V (the tile, shared),
//      B = Q / dO (the item's stage, shared), both K-major; S and dP are two
//      commit groups so that P is computed while dP^T is still running.
//   2. P^T, dS^T in the accumulator registers; the m64n64 fp32 accumulator
//      layout of 16 rows (item rows) is the bf16 A-fragment layout of a k16
//      step, so P^T / dS^T become the register A operand without shuffles
//      (FlashAttention-3's dV = P^T dO).
//   3. dV += P^T dO, dK += dS^T Q: 64/16 wgmma m64nDk16 each, A from
//      registers, B = dO / Q MN-major (transposed) from the same shared tiles.
// Step 3 is waited for at the end of the item, after the loads of item
// i + 2 are issued: keeping the P^T / dS^T fragments in flight into the next
// item would take more than 255 registers.
// Shared memory: K, V of the tile (loaded once, by every thread's cp.async)
// and WG_ST = 3 stages of the items' Q, dO, lse, Di and bounds, filled two
// items ahead: stage (i + 2) % 3 is refilled during item i, once item i - 1
// (its last reader) is done. Two ways (kernel parameter TQ):
//  - TQ (a block's rows of a kv head are one whole 64-row chunk, bs x group
//    == 64, group a power of two >= 4: the 27B shape): every load by TMA,
//    issued by thread 0 (Q, dO through a 3-D map [query][head][dim] whose
//    box is the chunk; lse, Di through 2-D fp32 maps [query][head], box bs x
//    group), which also stores the item's anchor, span bounds and document
//    start; per stage an mbarrier "full" (thread 0's arrival, its stores
//    released by it, and the copies' bytes) and one "empty" (every thread
//    arrives when done with the item: its wgmmas retired, its reads done);
//    thread 0 waits on "empty" before refilling. No CTA barrier in the item
//    loop: the two warpgroups run apart (up to about an item), so one's P /
//    dS math overlaps the other's wgmmas instead of both meeting at every
//    item's barrier. Each row's window bound is computed in registers (row r
//    is query r >> log2 group).
//  - else: every thread's cp.async (Q, dO zero-filled past a partial chunk;
//    lse, Di), the bounds by plain stores, and a CTA barrier at the top of
//    each item, which both warpgroups pass only once done with item i - 1
//    (its wgmmas retired at its end). Shapes with bs x group == 64 and
//    group 1 or 2 take this way too.
// Tiles are
// stored in 128-byte-swizzled rows ([D/64 column blocks][rows][64 bf16],
// 16-byte chunk c of row r at chunk position c ^ (r % 8)), the canonical
// layout of the wgmma descriptors: K-major for A and for B of step 1 (LBO
// unused, SBO 1024 B = 8 rows), MN-major for B of step 3 (LBO = one column
// block, SBO = 8 rows).
// Masking per (key, row) only where a warpgroup's 64 keys are not seen whole
// by every row of the item (window bound, end of span, partial chunk); a
// warpgroup whose 64 keys no row of the item sees skips the item.
//
// Resources (ptxas, sm_90a): D 128: ~242 registers (TQ and not), no
// spills, 164 KiB of dynamic shared memory (1 CTA, 8 warps per SM); D 64:
// ~199 (TQ) / ~188, 84 KiB.
// About 2.5x faster than MMA4's dkv4_kernel at the 27B drafter shape
// (docs/log/). ncu: warp stalls mostly on the wgmma waits and shared-memory
// latency (short scoreboard); integer address work is the largest
// instruction class (the item loads: a producer warpgroup with TMA would
// take it off the consumers). The rows' lse are read from shared memory
// before the S^T wait, not after it (there they were the top stall site in
// ncu's samples).
// Its gradients came out bitwise equal to MMA4's on every test and bench
// case (same bf16 operands, same k-step order of fp32 accumulation); that is
// observed, not promised.
//
// Portability: the kernel body exists only in sm_90a code (wgmma); on other
// devices, or in builds without a 90a target, dkv_wg_usable() is false and
// the backward runs MMA4's context dK/dV kernel instead. The non-sm_90a body
// traps, so a launch there fails loudly.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common.cuh"
#include "wg.cuh" // DF_WG_BODY (sm_90a code), the wgmma / cp.async / swizzle helpers

namespace df_dflash {
namespace {

constexpr int WNT = 256; // threads: two warpgroups
constexpr int WST = 3;   // Q / dO stages

// Shared memory, bytes from a 1024-aligned base (the 128-byte swizzle repeats
// every 1024 bytes and the hardware applies it to absolute address bits).
template <int D> struct WgLayout {
    static constexpr int NH = D / 64;                  // 128-byte column blocks per row
    static constexpr int KV = NH * WG_TILE_KEYS * 128; // the K (or V) tile: K at 0, V at KV
    static constexpr int QS = NH * CHUNK_ROWS * 128;   // one stage's Q (or dO): stage s at
                                                       // 2 KV + 2 s QS, its dO QS later
    static constexpr int META_OFF = 2 * KV + WST * 2 * QS;
    // per stage: float lse[64], float Di[64], int lo[64], int info[4] (+ pad:
    // each stage's lse / Di 128-byte aligned, TMA destinations)
    static constexpr int META = 3 * CHUNK_ROWS * 4 + 128;
    // per stage an mbarrier "full" (its loads landed) and, TQ, one "empty"
    // (every thread done with it): full s at BAR + 8 s, empty s at BAR + 8 (WST + s)
    static constexpr int BAR = META_OFF + WST * META;
    static_assert(BAR % 8 == 0 && META % 128 == 0 && META_OFF % 128 == 0, "alignment");
    static constexpr size_t SMEM = (size_t)BAR + 2 * WST * 8 + 1024; // + alignment slack
    // DS (WG3): each warpgroup's dS^T staging half (8 KiB), stored by one bulk copy
    static constexpr int DS_OFF = (BAR + 2 * WST * 8 + 1023) / 1024 * 1024;
    static constexpr size_t SMEM_DS = (size_t)DS_OFF + 2 * 8192 + 1024;
};

// The items' loads by TMA (the kernel's TQ instantiation: a block's rows of
// a kv head are exactly one 64-row chunk, bs x group == 64, and group is a
// power of two >= 4): q, dout as 3-D tensors [nb bs queries][nq heads][D],
// boxes of bs queries x group heads x 64 dims, which land as the chunk's
// rows (query-major, head-minor: row qo group + hh) in the 128-byte
// swizzle; lse_in, Di as 2-D fp32 tensors [nb bs][nq], boxes of bs x group
// (the chunk's rows in the same order; a box row of group x 4 bytes, a
// multiple of 16). on 0: the per-thread cp.async loads (TQ false).
struct QdMaps {
    CUtensorMap q, dout, lse, di;
    int on;
};

#if DF_WG_BODY
constexpr int WKEYS = 64; // keys per warpgroup (wgmma M)
#endif // DF_WG_BODY

// One CTA per (LPT rank, kv head, split): context keys only (see the top).
// TQ: every item load by TMA (qm) and no CTA barrier in the item loop (see
// the top); else the cp.async loads and a barrier per item.
#if DF_WG_BODY // (helpers of the sm_90a bodies only)
// WG3's dS^T staging: 4 bytes v at shared address base + ro + ((c ^ x) << 4),
// the 128-byte swizzle's chunk c of a row with row & 7 == x. The offset is
// computed in the asm, at the store: computed by the compiler, the 16
// stores' offsets (item-invariant) were hoisted out of the item loop, 16
// more registers held across it (255 registers and a 16-byte spill).
__device__ __forceinline__ void sts_sw(uint32_t base, uint32_t ro, int c, int x, uint32_t v)
{
    asm volatile("{\n.reg .u32 t;\n"
                 "xor.b32 t, %2, %3;\nshl.b32 t, t, 4;\nadd.u32 t, t, %1;\nadd.u32 t, t, %0;\n"
                 "st.shared.b32 [t], %4;\n}\n" ::"r"(base),
                 "r"(ro), "r"(c), "r"(x), "r"(v)
                 : "memory");
}
// one warpgroup's named barrier (ids 1, 2; 128 threads)
__device__ __forceinline__ void wg_bar(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }
// bytes from shared src to global dst by one bulk copy (commit group of its own)
__device__ __forceinline__ void bulk_store(void *dst, uint32_t src, uint32_t bytes)
{
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                 "cp.async.bulk.commit_group;\n" ::"l"(reinterpret_cast<uint64_t>(dst)),
                 "r"(src), "r"(bytes)
                 : "memory");
}
// this thread's bulk copies have read their shared sources / are complete
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// The first index in [lo, hi) of the ascending list l whose entry is >= key (hi if none).
__device__ __forceinline__ int first_at_least(const int *l, int lo, int hi, int key)
{
    for (int n = hi - lo; n > 0;) {
        int h = n / 2;
        if (l[lo + h] < key)
            lo += h + 1, n -= h + 1;
        else
            n = h;
    }
    return lo;
}
#endif // DF_WG_BODY

// DS (impl WG3, TQ only): also store each item's dS^T (dsb.ds), staged in
// 16 KiB more shared memory (WgLayout::SMEM_DS) and written by one bulk copy
// per warpgroup and item; its own instantiation, so that WG2 / WG2F's code
// does not carry it (DS: ~253 registers at D 128, no spill). Direct 4-byte
// stores from the fragments, instead of the staging, were tried and were
// slower (docs/log/).

template <int D, bool TQ, bool DS = false>
__global__ void __launch_bounds__(WNT, 1)
    dkv_wg_kernel(Params p, float *part, const int *cnt, const int *lst, const int *order,
                  const __grid_constant__ QdMaps qm, DsBuf dsb)
{
#if DF_WG_BODY
    using L = WgLayout<D>;
    constexpr int V8 = D / 8, KS = D / 16, NA = D / 2; // NA: dV / dK accumulators per thread
    constexpr uint32_t KM_LBO = 16, SBO = 1024, MN_LBO = CHUNK_ROWS * 128;
    extern __shared__ __align__(1024) uint8_t wg_smem[];
    const uint32_t s0 = smem_u32(wg_smem), sb = (s0 + 1023u) & ~1023u;
    uint8_t *sm = wg_smem + (sb - s0);
    const int tid = threadIdx.x, lane = tid & 31, gid = lane >> 2, t4 = lane & 3;
    if constexpr (DS) { // WG3: a programmatic dependent (see pdl_wait)
        pdl_trigger();
        pdl_wait(); // the tile lists, their order, Di
    }
    // warpgroup / warp index broadcast from lane 0: warp-uniform for the
    // compiler, so the wgmma descriptors built from them stay uniform
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0), warp = __shfl_sync(0xffffffffu, (tid >> 5) & 3, 0);
    const long long ldq = (long long)p.nq * D, ldk = (long long)p.nkv * D;
    const int bid = blockIdx.x;
    const int split = bid % WG_NSPL, g = (bid / WG_NSPL) % p.nkv, tile = order[bid / (WG_NSPL * p.nkv)];
    const int base = tile * WG_TILE_KEYS, kend = base + WG_TILE_KEYS < p.S ? base + WG_TILE_KEYS : p.S;
    const int *tl = lst + (size_t)tile * p.nb;
    // this CTA's items: k = k1st, k1st + WG_NSPL, .. < kn (k % WG_NSPL == split); WG3's block range
    // [b0, b1) (DsBuf): the items of the tile's list (ascending blocks) whose block is in it
    int k1st = split, kn = cnt[tile] * p.nch;
    bool from0 = true, scaled = true; // the partials start at 0; dK scaled when stored
    int off0 = 0;                     // the block range's first slot of the stored dS
    if constexpr (DS) {
        if (dsb.b0 > 0 || dsb.b1 < p.nb) {
            const int lo = first_at_least(tl, 0, cnt[tile], dsb.b0);
            const int lo1 = first_at_least(tl, lo, cnt[tile], dsb.b1);
            const int klo = lo * p.nch;
            kn = lo1 * p.nch;
            k1st = klo + ((split - klo % WG_NSPL) % WG_NSPL + WG_NSPL) % WG_NSPL;
        }
        off0 = dsb.off ? dsb.off[dsb.b0] : 0;
        from0 = dsb.first != 0;
        scaled = dsb.last != 0;
        if (!from0 && !scaled && k1st >= kn)
            return; // nothing of this range: the partials stay as the previous range left them
                    // (the last range still scales dK)
    }
    const int k0 = base + WKEYS * wg;    // this warpgroup's first key
    const int kw = k0 + 16 * warp + gid; // this thread's keys: kw, kw + 8
    for (int e = tid; e < WG_TILE_KEYS * V8; e += WNT) {
        int key = e / V8, c = e % V8;
        bool ok = base + key < kend;
        long long off = ok ? (long long)(base + key) * ldk + (long long)g * D + c * 8 : 0;
        int so = sw_off(key, c, WG_TILE_KEYS);
        cp16(sb + so, p.kc + off, ok);
        cp16(sb + L::KV + so, p.vc + off, ok);
    }
    cp_commit();
    // TQ: the stages' mbarriers: full (one arrival, the issuing thread's,
    // plus the TMA bytes) and empty (every thread, done with the stage)
    const uint32_t bar0 = sb + L::BAR, ebar0 = bar0 + 8 * WST;
    if constexpr (TQ) {
        if (tid == 0) {
            for (int i = 0; i < WST; i++) {
                mbar_init(bar0 + 8 * i, 1);
                mbar_init(ebar0 + 8 * i, WNT);
            }
            mbar_fence_init();
        }
        __syncthreads(); // the inits, before anyone waits on them
    }
    const int nitems = kn;
    // Item loads. Thread tid copies 16-byte chunk c = tid % V8 of rows
    // r0 + RSTEP it of Q and dO; row r of chunk ch is (query qo, head hh) with
    // ch 64 + r = qo group + hh: one division per item, then steps of RSTEP rows.
    constexpr int RPT = CHUNK_ROWS * V8 / WNT, RSTEP = WNT / V8; // rows per thread, row step
    const int cch = tid % V8, r0 = tid / V8;
    const int so0 = sw_off(r0, cch, CHUNK_ROWS); // + it * RSTEP * 128: same swizzle phase
    const int qstep = RSTEP / p.group, hstep = RSTEP % p.group, nrows = p.bs * p.group;
    // item k (block b, anchor anc, doc start ds) into stage st. TQ: thread
    // 0, once every thread released the stage's previous item (empty
    // barrier, phase parity ep; ep < 0: the stage's first fill), stores the
    // item's anchor, span bounds and document start, then arrives on the full
    // barrier (release: those stores) with the bytes of its TMA copies (Q,
    // dO, lse, Di; one chunk per block: ch 0). Else every thread: Q, dO by
    // cp.async (zero-filled past the chunk), lse, Di by cp.async, each row's
    // first visible context key (INT_MAX past the chunk: never visible) and
    // the item's anchor / span bounds by plain stores.
    auto issue = [&](int k, int st, int b, int anc, int ds, int ep) {
        if constexpr (TQ) {
            if (tid == 0) {
                if (ep >= 0)
                    mbar_wait(ebar0 + 8 * st, (uint32_t)ep);
                const uint32_t qd = sb + 2 * L::KV + st * 2 * L::QS, bar = bar0 + 8 * st,
                               ms = sb + L::META_OFF + st * L::META;
                int *info = reinterpret_cast<int *>(sm + L::META_OFF + st * L::META + 3 * CHUNK_ROWS * 4);
                info[0] = anc;
                info[1] = ctx_lo(anc, ds, p.W, 0);        // widest row's bound
                info[2] = ctx_lo(anc, ds, p.W, p.bs - 1); // narrowest row's
                info[3] = ds;
                if constexpr (DS) // WG3: the item's stored dS^T slot for this tile (see DsBuf)
                    info[4] = ((dsb.off ? dsb.off[b] - off0 : b * dsb.maxt) + tile - info[1] / WG_TILE_KEYS) * p.nkv + g;
                mbar_expect_tx(bar, 2 * L::QS + 2 * CHUNK_ROWS * 4);
#pragma unroll
                for (int cb = 0; cb < L::NH; cb++) {
                    tma_load_3d(qd + cb * (CHUNK_ROWS * 128), &qm.q, 64 * cb, g * p.group, b * p.bs, bar);
                    tma_load_3d(qd + L::QS + cb * (CHUNK_ROWS * 128), &qm.dout, 64 * cb, g * p.group,
                                b * p.bs, bar);
                }
                tma_load_2d(ms, &qm.lse, g * p.group, b * p.bs, bar);
                tma_load_2d(ms + CHUNK_ROWS * 4, &qm.di, g * p.group, b * p.bs, bar);
            }
        } else {
            const int ch = k % p.nch;
            int rr = ch * CHUNK_ROWS + r0;
            int qo = rr / p.group, hh = rr - qo * p.group;
            uint32_t qd = sb + 2 * L::KV + st * 2 * L::QS + so0;
            const uint16_t *qsrc = p.q + ((long long)b * p.bs * ldq + (long long)g * p.group * D + cch * 8);
            const uint16_t *dsrc = p.dout + (qsrc - p.q);
#pragma unroll
            for (int it = 0; it < RPT; it++) {
                bool ok = rr < nrows;
                int off = ok ? qo * (int)ldq + hh * D : 0; // within the block's rows
                cp16(qd + it * RSTEP * 128, qsrc + off, ok);
                cp16(qd + L::QS + it * RSTEP * 128, dsrc + off, ok);
                rr += RSTEP, qo += qstep, hh += hstep;
                bool wrap = hh >= p.group;
                qo += wrap, hh -= wrap ? p.group : 0;
            }
            if (tid < CHUNK_ROWS) {
                RowId id = row_id(p, b, g, ch, tid);
                long long li = id.ok ? (long long)id.grow * p.nq + id.h : 0;
                uint32_t ms = sb + L::META_OFF + st * L::META;
                cp4(ms + tid * 4, p.lse_in + li, id.ok);
                cp4(ms + CHUNK_ROWS * 4 + tid * 4, p.Di + li, id.ok);
                int *meta = reinterpret_cast<int *>(sm + L::META_OFF + st * L::META);
                meta[2 * CHUNK_ROWS + tid] = id.ok ? ctx_lo(anc, ds, p.W, id.qo) : INT_MAX;
                if (tid == 0) {
                    meta[3 * CHUNK_ROWS] = anc;
                    meta[3 * CHUNK_ROWS + 1] = ctx_lo(anc, ds, p.W, 0);        // widest row's bound
                    meta[3 * CHUNK_ROWS + 2] = ctx_lo(anc, ds, p.W, p.bs - 1); // narrowest row's
                    meta[3 * CHUNK_ROWS + 3] = (ch + 1) * CHUNK_ROWS <= nrows;
                }
            }
        }
    };
    // block of the i-th item of this split (0 past the end: a valid index)
    auto blk = [&](int i) -> int {
        int k = k1st + WG_NSPL * i;
        return k < nitems ? tl[k / p.nch] : 0;
    };
    float dv[NA], dk[NA];
    acc_zero(dv); // pinned before the loop
    acc_zero(dk);
    // items 0, 1 into stages 0, 1; then item i + 2 during item i. Their block
    // index, anchor and document start are loaded ahead (b of item i + 3 and
    // the anchor of item i + 2 during item i - 1...): no dependent global load
    // in the item loop waits.
    {
        int b = blk(0);
        if (k1st < nitems)
            issue(k1st, 0, b, p.anchor[b], p.doc_start[b], -1);
        cp_commit();
        b = blk(1);
        if (k1st + WG_NSPL < nitems)
            issue(k1st + WG_NSPL, 1, b, p.anchor[b], p.doc_start[b], -1);
        cp_commit();
    }
    if constexpr (TQ) { // the K / V tile (everyone's cp.async), before the loop
        cp_wait<0>();
        fence_proxy_async();
        __syncthreads();
    }
    // TQ: row r of the item is query r >> lg (group = 2^lg)
    const int lg = __ffs(p.group) - 1;
    int b2 = blk(2), b3 = blk(3);
    int anc2 = p.anchor[b2], ds2 = p.doc_start[b2];
    const float sl = p.scale * WLOG2E;
    const uint64_t dK0 = wg_desc(sb + wg * (WKEYS * 128), KM_LBO, SBO), dV0 = dK0 + (L::KV >> 4);
    int st = 0, st2 = 2; // stages of item i and of item i + 2
    for (int i = 0, k = k1st; k < nitems; i++, k += WG_NSPL) {
        if constexpr (TQ) {
            // item i landed (the n-th fill of stage i % 3 is item 3 n + i % 3)
            mbar_wait(bar0 + 8 * st, (uint32_t)(i / WST) & 1u);
        } else {
            cp_wait<1>();        // K / V and item i landed (this thread's copies) ...
            fence_proxy_async(); // ... visible to the tensor cores ...
            __syncthreads();     // ... everyone's; both warpgroups are done with item i - 1
        }
        const uint32_t qs = sb + 2 * L::KV + st * 2 * L::QS, dos = qs + L::QS;
        const int *meta = reinterpret_cast<const int *>(sm + L::META_OFF + st * L::META);
        const float *Ls = reinterpret_cast<const float *>(meta), *Ds = Ls + CHUNK_ROWS;
        const int *Lo = meta + 2 * CHUNK_ROWS;
        const int anc = meta[3 * CHUNK_ROWS], lo0 = meta[3 * CHUNK_ROWS + 1],
                  lohi = meta[3 * CHUNK_ROWS + 2];
        // warpgroup-uniform: no row of the item sees these 64 keys (skip it) /
        // every row sees all of them (no per-element mask; TQ: the chunk is whole)
        const bool dead = k0 >= anc || k0 + WKEYS <= lo0;
        const bool full = (TQ || meta[3 * CHUNK_ROWS + 3]) && k0 >= lohi && k0 + WKEYS <= anc;
        // (one structured branch: a 'continue' around the wgmmas also makes
        // ptxas serialize them)
        if (!dead) {
            float s[32], dp[32];
            const uint64_t dQ = wg_desc(qs, KM_LBO, SBO), dO = dQ + (L::QS >> 4);
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                // k step ks: column block ks / 4, 32 bytes (16 bf16) apart within it
                uint32_t ko = ((ks >> 2) * (WG_TILE_KEYS * 128) + (ks & 3) * 32) >> 4;
                uint32_t qo = ((ks >> 2) * (CHUNK_ROWS * 128) + (ks & 3) * 32) >> 4;
                if (ks == 0)
                    wg_ss64_first(s, dK0 + ko, dQ + qo);
                else
                    wg_ss64(s, dK0 + ko, dQ + qo);
            }
            wg_commit();
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                uint32_t ko = ((ks >> 2) * (WG_TILE_KEYS * 128) + (ks & 3) * 32) >> 4;
                uint32_t qo = ((ks >> 2) * (CHUNK_ROWS * 128) + (ks & 3) * 32) >> 4;
                if (ks == 0)
                    wg_ss64_first(dp, dV0 + ko, dO + qo);
                else
                    wg_ss64(dp, dV0 + ko, dO + qo);
            }
            wg_commit();
            // the rows' lse from shared memory while the wgmmas run (read after
            // the wait, they were the top stall site in ncu's samples)
            float nl[16];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float2 l2 = *reinterpret_cast<const float2 *>(Ls + 8 * j + 2 * t4);
                nl[2 * j] = -l2.x * WLOG2E, nl[2 * j + 1] = -l2.y * WLOG2E;
            }
            wg_wait<1>(); // S^T; dP^T still running
            reg_fence(s);
            // P^T: thread element 4 j + e is key kw + 8 (e >> 1), row
            // 8 j + 2 t4 + (e & 1). Branch-free: masked elements get 2^-inf.
            if (full) {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    float n0 = nl[2 * j], n1 = nl[2 * j + 1];
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        s[4 * j + e] = ex2(fmaf(s[4 * j + e], sl, (e & 1) ? n1 : n0));
                }
            } else if constexpr (TQ) {
                // key kw + 8 h is visible to row r (query qo = r >> lg) iff
                // ds <= key < anc and, sliding, key >= anc + qo - (W - 1)
                // (ctx_lo's bound; its clamp to anc changes nothing here)
                const int ds = meta[3 * CHUNK_ROWS + 3];
                bool kok[2];
                int kq[2]; // key - anc + W - 1: the largest qo that sees the key
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int key = kw + 8 * h;
                    kok[h] = key < anc && key >= ds;
                    kq[h] = p.W > 0 ? key - anc + p.W - 1 : INT_MAX;
                }
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    float n0 = nl[2 * j], n1 = nl[2 * j + 1];
                    // rows 8 j + 2 t4 (+ 1) of the item; lse -inf (n +inf): sees nothing
                    const int q0 = (8 * j + 2 * t4) >> lg, q1 = (8 * j + 2 * t4 + 1) >> lg;
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int h = e >> 1;
                        bool vis = kok[h] && kq[h] >= ((e & 1) ? q1 : q0) &&
                                   ((e & 1) ? n1 : n0) != INFINITY;
                        float x = fmaf(s[4 * j + e], sl, (e & 1) ? n1 : n0);
                        s[4 * j + e] = ex2(vis ? x : -INFINITY);
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    int2 lo2 = *reinterpret_cast<const int2 *>(Lo + 8 * j + 2 * t4);
                    float n0 = nl[2 * j], n1 = nl[2 * j + 1];
                    // rows with lse -inf (n +inf) see nothing (never in a valid block)
                    int lo0r = n0 == INFINITY ? INT_MAX : lo2.x;
                    int lo1r = n1 == INFINITY ? INT_MAX : lo2.y;
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int key = kw + 8 * (e >> 1);
                        bool vis = key < anc && key >= ((e & 1) ? lo1r : lo0r);
                        float x = fmaf(s[4 * j + e], sl, (e & 1) ? n1 : n0);
                        s[4 * j + e] = ex2(vis ? x : -INFINITY);
                    }
                }
            }
            // A fragment of k step kk (item rows 16 kk .. + 15) = n tiles 2 kk, 2 kk + 1
            uint32_t pa[4][4], sa[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                pa[kk][0] = pack_bf2(s[8 * kk + 0], s[8 * kk + 1]);
                pa[kk][1] = pack_bf2(s[8 * kk + 2], s[8 * kk + 3]);
                pa[kk][2] = pack_bf2(s[8 * kk + 4], s[8 * kk + 5]);
                pa[kk][3] = pack_bf2(s[8 * kk + 6], s[8 * kk + 7]);
            }
            wg_wait<0>(); // dP^T
            reg_fence(dp);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float2 d2 = *reinterpret_cast<const float2 *>(Ds + 8 * j + 2 * t4);
#pragma unroll
                for (int e = 0; e < 4; e++)
                    dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - ((e & 1) ? d2.y : d2.x));
            }
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                sa[kk][0] = pack_bf2(dp[8 * kk + 0], dp[8 * kk + 1]);
                sa[kk][1] = pack_bf2(dp[8 * kk + 2], dp[8 * kk + 3]);
                sa[kk][2] = pack_bf2(dp[8 * kk + 4], dp[8 * kk + 5]);
                sa[kk][3] = pack_bf2(dp[8 * kk + 6], dp[8 * kk + 7]);
            }
            if constexpr (TQ && DS) {
                // WG3: dS^T of this warpgroup's 64 keys into its stored tile's
                // half (see DsBuf: [key][row] in the 128-byte swizzle): sa[kk][h]
                // is key kw + 8 (h & 1), rows 16 kk + 8 (h >> 1) + 2 t4 (+ 1),
                // so 16-byte chunk 2 kk + (h >> 1) of the key's row, bytes 4 t4.
                // Staged in shared memory, then one bulk copy of 8 KiB (full
                // 128-byte lines; direct 4-byte stores make 8 partial-line
                // requests per warp store)
                const uint32_t stg = sb + L::DS_OFF + wg * 8192;
                const int lead = tid == 128 * wg; // the warpgroup's issuing thread
                if (lead)
                    bulk_wait_read(); // its previous bulk copy has read the staging half
                wg_bar(1 + wg);
                // key 16 warp + gid (+ 8): key & 7 == gid
                const uint32_t ro = (16 * warp + gid) * 128 + 4 * t4;
#pragma unroll
                for (int kk = 0; kk < 4; kk++)
#pragma unroll
                    for (int h = 0; h < 4; h++)
                        sts_sw(stg, ro + 1024 * (h & 1), 2 * kk + (h >> 1), gid, sa[kk][h]);
                fence_proxy_async(); // these stores -> the bulk copy (async proxy)
                wg_bar(1 + wg);
                if (lead)
                    bulk_store(reinterpret_cast<uint8_t *>(dsb.ds) + (size_t)meta[3 * CHUNK_ROWS + 4] * DS_TILE_BYTES +
                                   wg * (DS_TILE_BYTES / 2),
                               stg, 8192);
            }
            // B of k step kk: item rows 16 kk .. + 15 (2 x 8-row groups, SBO)
            const uint64_t mQ = wg_desc(qs, MN_LBO, SBO), mO = mQ + (L::QS >> 4);
            wg_fence(); // the A fragments were written by ordinary instructions
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
                wg_rs(dv, pa[kk], mO + kk * (16 * 128 >> 4));
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
                wg_rs(dk, sa[kk], mQ + kk * (16 * 128 >> 4));
            wg_commit();
        }
        // item i + 2 into the stage item i - 1 used (both warpgroups left it:
        // before the barrier above, or TQ, the empty barrier's phase of item
        // i - 1, the (i - 1) / 3-th release of that stage; item 2 is stage 2's
        // first fill); the copies overlap this item's dV / dK
        if (k + 2 * WG_NSPL < nitems)
            issue(k + 2 * WG_NSPL, st2, b2, anc2, ds2, i >= 1 ? ((i - 1) / WST) & 1 : -1);
        if constexpr (!TQ)
            cp_commit();
        // index loads for the next items (used one item later)
        b2 = b3, anc2 = p.anchor[b3], ds2 = p.doc_start[b3];
        b3 = blk(i + 4);
        // dV / dK retired before the next item: frees the P^T / dS^T fragments
        // (kept in flight across the next item's S^T, they push the kernel
        // past 255 registers) and this stage for the refill two items on
        wg_wait<0>();
        if constexpr (TQ) // this thread is done with stage st (its wgmmas retired, its reads done)
            mbar_arrive(ebar0 + 8 * st);
        st = st == WST - 1 ? 0 : st + 1;
        st2 = st2 == WST - 1 ? 0 : st2 + 1;
    }
    wg_wait<0>();
    if constexpr (TQ && DS) // the last bulk copies done before the CTA's shared memory goes
        if (tid == 0 || tid == 128)
            bulk_wait_all();
    reg_fence(dv);
    reg_fence(dk);
    cp_wait<0>();
    // fp32 partials of this split: thread element 4 j + 2 h + e is key kw + 8 h,
    // head dim 8 j + 2 t4 + e. A later block range (WG3, DsBuf) adds the partials the
    // previous range stored here (loaded now, not into the accumulators before the loop:
    // registers defined there by loads make ptxas serialize every wgmma); dK is scaled
    // once, by the last range
    const size_t n = (size_t)p.S * ldk;
    float *pk = part + (size_t)split * 2 * n, *pv = pk + n;
    const float dks = scaled ? p.scale : 1.0f;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int key = kw + 8 * h;
        if (key >= kend)
            continue;
        size_t off = (size_t)key * ldk + (size_t)g * D + 2 * t4;
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            float2 vk = make_float2(dk[4 * j + 2 * h], dk[4 * j + 2 * h + 1]);
            float2 vv = make_float2(dv[4 * j + 2 * h], dv[4 * j + 2 * h + 1]);
            if (!from0) {
                const float2 ok = *reinterpret_cast<const float2 *>(pk + off + 8 * j);
                const float2 ov = *reinterpret_cast<const float2 *>(pv + off + 8 * j);
                vk = make_float2(ok.x + vk.x, ok.y + vk.y), vv = make_float2(ov.x + vv.x, ov.y + vv.y);
            }
            *reinterpret_cast<float2 *>(pk + off + 8 * j) = make_float2(vk.x * dks, vk.y * dks);
            *reinterpret_cast<float2 *>(pv + off + 8 * j) = vv;
        }
    }
#else
    __trap(); // built without sm_90a: dkv_wg_usable() keeps launches away
#endif
}

} // namespace

bool dkv_wg_usable(const Params &p, int D)
{
    if ((long long)p.bs * p.nq * D >= INT_MAX) // the item loads' in-block offsets are int
        return false;
    // per (head dim, device): 0 unknown, 1 no, 2 yes (racing first calls
    // compute and store the same value)
    static signed char known[2][64];
    int dev;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64)
        return false;
    int di = D == 128 ? 1 : 0;
    if (known[di][dev])
        return known[di][dev] == 2;
    int major = 0, minor = 0, smax = 0;
    bool r = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
             cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
             cudaDeviceGetAttribute(&smax, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) ==
                 cudaSuccess &&
             major == 9 && minor == 0 && !df_cuda_portable_forced();
    if (r) {
        // the kernel must come from Hopper code (the 90a target), not from
        // another target's PTX compiled at load time (whose body is a trap)
        cudaFuncAttributes fa, fb;
        cudaError_t e = D == 128 ? cudaFuncGetAttributes(&fa, dkv_wg_kernel<128, false>)
                                 : cudaFuncGetAttributes(&fa, dkv_wg_kernel<64, false>);
        if (e == cudaSuccess)
            e = D == 128 ? cudaFuncGetAttributes(&fb, dkv_wg_kernel<128, true>)
                         : cudaFuncGetAttributes(&fb, dkv_wg_kernel<64, true>);
        if (e != cudaSuccess)
            cudaGetLastError(); // not sticky: clear it for the caller's checks
        r = e == cudaSuccess && fa.ptxVersion >= 90 && fb.ptxVersion >= 90 &&
            (size_t)smax >= (D == 128 ? WgLayout<128>::SMEM : WgLayout<64>::SMEM);
    }
    known[di][dev] = r ? 2 : 1;
    return r;
}

namespace {
// The TQ instantiation's maps (qm->on 1) where a block's rows of a kv head
// are one whole chunk (bs group == 64: no rows past it to zero), group is a
// power of two >= 4 (the lse / Di box rows: 16-byte multiples) and the maps
// can be made; else qm->on 0
void qd_maps(const Params &p, int D, const KvMaps *km, QdMaps *qm)
{
    memset(qm, 0, sizeof *qm);
    if (p.bs * p.group == CHUNK_ROWS && p.group >= 4 && (p.group & (p.group - 1)) == 0) {
        const uint64_t ldims[2] = {(uint64_t)p.nq, (uint64_t)p.nb * p.bs}, lstr[1] = {(uint64_t)p.nq * 4};
        const uint32_t lbox[2] = {(uint32_t)p.group, (uint32_t)p.bs};
        if (km && km->qd_on) { // the dQ pass's maps of the same tensors
            qm->q = km->q, qm->dout = km->dout;
            qm->on = 1;
        } else {
            qm->on = !chunk_map_bf16(&qm->q, p.q, p, D) && !chunk_map_bf16(&qm->dout, p.dout, p, D);
        }
        qm->on = qm->on && !tma_map_f32(&qm->lse, p.lse_in, 2, ldims, lstr, lbox) &&
                 !tma_map_f32(&qm->di, p.Di, 2, ldims, lstr, lbox);
    }
}
} // namespace

bool dkv_wg_tq(const Params &p, int D, const KvMaps *km)
{
    QdMaps qm;
    qd_maps(p, D, km, &qm);
    return qm.on != 0;
}

int dkv_wg_launch(const Params &p, int D, cudaStream_t st, float *part, const int *cnt,
                  const int *lst, const int *order, int nct, const KvMaps *km, const DsBuf *dsb)
{
    unsigned grid = (unsigned)((long long)nct * p.nkv * WG_NSPL);
    // every item load by TMA (the TQ instantiation) where qd_maps makes its maps
    QdMaps qm;
    qd_maps(p, D, km, &qm);
    DsBuf none = {};
    none.b1 = p.nb, none.first = none.last = 1;
    const DsBuf ds = dsb ? *dsb : none;
    if (dsb && !qm.on) { // WG3's stored dS^T exists only in TQ (the caller checks dkv_wg_tq)
        fprintf(stderr, "dflash_attn: dkv_wg_kernel<%d>: stored dS without TMA item loads (%s:%d)\n", D,
                __FILE__, __LINE__);
        return -EINVAL;
    }
    // the instantiation: 0 cp.async item loads, 1 TQ, 2 TQ storing dS (WG3)
    const int v = qm.on ? (dsb ? 2 : 1) : 0;
    const void *fn = D == 128 ? (v == 2   ? (const void *)dkv_wg_kernel<128, true, true>
                                 : v == 1 ? (const void *)dkv_wg_kernel<128, true>
                                          : (const void *)dkv_wg_kernel<128, false>)
                              : (v == 2   ? (const void *)dkv_wg_kernel<64, true, true>
                                 : v == 1 ? (const void *)dkv_wg_kernel<64, true>
                                          : (const void *)dkv_wg_kernel<64, false>);
    const size_t sm = D == 128 ? (dsb ? WgLayout<128>::SMEM_DS : WgLayout<128>::SMEM)
                               : (dsb ? WgLayout<64>::SMEM_DS : WgLayout<64>::SMEM);
    static signed char set[2][3][64]; // [D == 128][instantiation][device]
    cudaError_t e = func_smem_once(fn, sm, false, set[D == 128][v]);
    if (e == cudaSuccess) { // (WG3: a programmatic dependent where ds.pdl)
        Params pa = p;
        float *pp = part;
        const int *c = cnt, *l = lst, *o = order;
        void *args[7] = {&pa, &pp, &c, &l, &o, &qm, const_cast<DsBuf *>(&ds)};
        e = launch_pdl(fn, dim3(grid), dim3(WNT), sm, st, ds.pdl != 0, args);
    }
    if (e != cudaSuccess) {
        fprintf(stderr, "dflash_attn: dkv_wg_kernel<%d>: %s (%s:%d)\n", D, cudaGetErrorString(e),
                __FILE__, __LINE__);
        return -EIO;
    }
    return 0;
}

} // namespace df_dflash
