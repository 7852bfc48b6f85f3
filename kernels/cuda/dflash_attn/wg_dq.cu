// dflash_attn/wg_dq.cu - the dQ pass of impl DF_CUDA_DFLASH_IMPL_WG2's
// backward (dflash_attn.h) on Hopper warpgroup MMA (wgmma.mma_async,
// sm_90a). WG2's backward is MMA4's with its context dK/dV pass on wgmma
// (dflash_attn/wg_dkv.cu; Di, the tile lists, the block-key dK/dV and the split
// reduction are MMA4's) and this kernel in place of MMA4's dq_mma2_kernel,
// its items' blocks last to first (see the kernel).
//
// Work split (dq_mma2_kernel's): one item per (block b, kv head g, row
// chunk), items handed to a persistent grid (see the kernel): the 64 rows
// of a chunk are the 16 queries x `group` heads of one
// block and kv head, sharing one anchor and one context span [lo0, anchor)
// (lo0: the widest row's bound), so for every key tile of the span the
// problem is a dense 64 rows x QTK keys one:
//   S  = Q K^T                      (rows x keys, k-dim D)
//   dP = dO V^T
//   P  = exp2(S scale log2e - lse log2e)   (fp32; masked on partial tiles)
//   dS = P (dP - Di)
//   dQ += dS K                      (dS rounded to bf16; fp32 accumulator)
// then the block's own keys (kb / vb, bs of them, in-block causality on
// sliding layers) as one or more tiles of the same loop, masked per element
// past bs (the rows there hold the next block's keys, zeros past the last
// block; block tiles are never "full"). block_size <= 16:
// the block tile is 16 keys wide (S, dP by wgmma m64n16k16, dQ one k16
// step), not a 64-key tile three quarters zeros. H200, bench_dflash_attn,
// 64 -> 16-key block tile (session 11, with the forward's): this pass 3docs
// full 0.422 -> 0.405 ms, 1doc full 0.946 -> 0.921, 1doc sliding 0.740 ->
// 0.731; 203 registers instead of 180 (D 128; 209 with FOLD; still 2 CTAs
// per SM, shared-memory bound); other bits, within the tests' bounds.
// dQ is scaled once at the end and written as bf16 by the thread that summed
// it, in tile order: deterministic, no atomics.
//
// CTA: one warpgroup (128 threads, wgmma M = 64 = the chunk's rows); warp w
// holds rows 16 w .. 16 w + 15 of every accumulator. Per tile:
//   1. S, dP: D/16 wgmma m64n64k16 each, A = Q / dO (the chunk, resident in
//      shared memory, K-major), B = K / V (the tile's stage, K-major); two
//      commit groups, so P is computed while dP is still running.
//   2. P, dS in the accumulator registers; the fp32 accumulator layout of a
//      16-key column pair is the bf16 A-fragment layout of a k16 step, so dS
//      becomes the register A operand of step 3 without shuffles
//      (FlashAttention-3's P in registers).
//   3. dQ += dS K: QTK/16 wgmma m64nDk16, A = dS from registers, B = the
//      same K stage MN-major (transposed through the descriptor: no
//      transposed copy). Waited for at the end of the tile (its stage is
//      refilled after the next barrier).
// K / V tiles stream through QST = 2 stages by TMA, one tile ahead (tile t
// + 1 loads during tile t): thread 0 issues a tile's copies (the forward's
// tensor maps, dflash_attn/common.cuh's KvMaps) after the barrier at the
// top of tile t, which every thread passes only once tile t - 1's wgmmas
// retired; the copies complete the stage's mbarrier, which the readers wait
// on. (A stage and the Q / dO buffer are page pairs whose roles rotate from
// item to item: see the kernel.) Context keys past the anchor arrive as they are and are masked; keys
// past S arrive as zeros. TMA instead of each thread's cp.async (session
// 11): H200, bench_dflash_attn, this pass 3docs full 0.418 -> 0.375 ms,
// sliding 0.404 -> 0.373, 1doc full 0.946 -> 0.839, 1doc sliding 0.709 ->
// 0.676 (the backward 0.919 -> 0.880, 300.5 TFLOP/s, at 3docs full); every
// gradient bitwise the same; 184 registers instead of 203 (188 / 209 with
// FOLD). Where the maps cannot be made the backward runs dq_mma2_kernel.
// Q, dO: loaded once, waited for before the first tile: by TMA (one thread,
// the maps' 3-D boxes of one row chunk) where a block's rows of a kv head
// are one whole chunk (bs x group == 64), else by every thread's cp.async.
// TMA instead of cp.async (session 12; the cp.async loop's address work was
// ~1 us of the CTA's 2.2 us before its first barrier, by a clock64 trace):
// H200, bench_dflash_attn, this pass 3docs full 0.380 -> 0.373 ms, 1doc
// sliding 0.644 -> 0.637, 1doc full 0.818 -> 0.834 (within the calls'
// spread); the same bits.
// Tiles are stored in the 128-byte swizzle of dflash_attn/wg.cuh (K-major
// descriptors for steps 1, MN-major for the B of step 3).
// Masking per (row, key) only on tiles not every row of the chunk sees whole
// (window bound, end of span, block tiles, partial chunks, rows without lse).
// Rows of a chunk past bs x group: Q, dO zero, lse -inf (P = 0), not written.
// Padding blocks: dq 0.
//
// Resources (ptxas, sm_90a, CUDA 13.0, session 14, the block area): D 128:
// 191 registers (248 with FOLD), no spills, 105 KiB of dynamic shared memory
// (3 page pairs of 32 KiB, the 8 KiB block area, 1 KiB alignment slack): 2
// CTAs (8 warps) per SM (at most 113 KiB each); D 64: 168 (191 with FOLD),
// 55 KiB. (Session 13, without the block area: 199 / 251, 97 KiB; before
// the 16-key block tile: 180 / 146 registers.) No "wgmma serialization"
// warning. On the H200 (27B drafter shape, 3docs full):
// 0.378 ms, bitwise dq_mma2_kernel's dQ. ncu (FOLD, session 6): 2 active
// warps per scheduler, 0.40 eligible, the busiest pipe 45% busy:
// latency-bound.
// Keeping dQ(t)'s wgmmas in flight across S(t + 1) (branch wip/attn-wg3)
// was correct but 20-26% slower; the next lever is warp specialization (a
// producer warpgroup, two consumers ping-ponging).
// Impl DF_CUDA_DFLASH_IMPL_WG2F: the FOLD instantiation (launched only with
// one row chunk per block and kv head, p.nch == 1) also computes its rows'
// Di (chunk_di: di_kernel's sum order, so p.Di, and with it dQ and the
// context dK/dV, are expected bitwise WG2's) and its block's dK / dV for
// kv head g from the block tile's P and dS (see dq_wg_kernel): the
// backward then runs neither di_kernel (0.048 ms at the 27B shape) nor
// the block tiles of dkv_mma2_kernel (0.159 ms). Resources (ptxas, sm_90a,
// CUDA 13.0, session 6): D 128: 189 registers, no spills; D 64: 152; shared
// memory as WG2's (P^T / dS^T in free bytes of a K / V stage). FOLD = false compiles to the
// same code as before the fold existed (checked: identical .text bytes).
// On the H200 (session 6): all five gradients bitwise WG2's (dkb / dvb were
// not promised) in every bench configuration; the pass 0.378 -> 0.446 ms
// and the backward 1.134 -> 1.000 ms (3docs full).
// Portability: the kernel body exists only in sm_90a code; elsewhere (or in
// builds without a 90a target) dq_wg_usable() is false and the backward runs
// dq_mma2_kernel in the same order. The non-sm_90a body traps, so a launch
// there fails loudly.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "common.cuh"
#include "wg.cuh" // DF_WG_BODY (sm_90a code), the wgmma / cp.async / swizzle helpers

namespace df_dflash {
namespace {

constexpr int QNT = 128; // threads: one warpgroup
constexpr int QTK = 64;  // keys per tile (S, dP: n 64; dQ: 4 k steps of 16)
constexpr int QST = 2;   // K / V stages (tile t + 1 loads during tile t)

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

// WG2F: Di = dO . O of this thread's two rows (rid[0], rid[1]; 0 for rows
// past the chunk's), computed as di_kernel (dflash_attn/mma_bwd.cu) computes it, bit
// for bit: there lane l of a warp sums its D / 32 products o[l + 32 i] d[l +
// 32 i] in i order (fma, from 0), then a butterfly (shfl xor 16, 8, 4, 2, 1;
// fp32 adds commute, so every lane ends with lane 0's bits). Here the quad
// of a row (t4 = 0..3) plays its 32 lanes: thread t4 plays lanes 8 t4 ..
// 8 t4 + 7 (their elements are 16-byte vectors: one uint4 of O and of dO
// per i), lane xor 16 / 8 is thread t4 xor 2 / 1, lane xor 4, 2, 1 stay
// inside the thread. So the Di the later passes read equals di_kernel's and
// WG2F's dQ and context dK / dV equal WG2's bitwise (same inputs, same sums).
// v[j] += the products of one 16-byte vector of O and of dO (element 2 k:
// the low half of word k, bf2f: bits << 16), chunk_di's order
__device__ __forceinline__ void di_acc(float (&v)[8], uint4 uo, uint4 ud)
{
    uint32_t wo[4] = {uo.x, uo.y, uo.z, uo.w}, wd[4] = {ud.x, ud.y, ud.z, ud.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        v[2 * k] += __uint_as_float(wo[k] << 16) * __uint_as_float(wd[k] << 16);
        v[2 * k + 1] += __uint_as_float(wo[k] & 0xffff0000u) * __uint_as_float(wd[k] & 0xffff0000u);
    }
}

// the quad's butterfly of chunk_di (every thread of the warp takes part)
__device__ __forceinline__ float di_quad_sum(float (&v)[8])
{
#pragma unroll
    for (int j = 0; j < 8; j++)
        v[j] += __shfl_xor_sync(0xffffffffu, v[j], 2); // lanes l, l ^ 16
#pragma unroll
    for (int j = 0; j < 8; j++)
        v[j] += __shfl_xor_sync(0xffffffffu, v[j], 1); // l ^ 8
#pragma unroll
    for (int j = 0; j < 4; j++)
        v[j] += v[j + 4]; // l ^ 4
#pragma unroll
    for (int j = 0; j < 2; j++)
        v[j] += v[j + 2]; // l ^ 2
    return v[0] + v[1];   // l ^ 1
}

template <int D>
__device__ __forceinline__ void chunk_di(const Params &p, const RowId (&rid)[2], int t4, float (&Dr)[2])
{
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            v[j] = 0.0f;
        if (rid[ri].ok) {
            long long w = (long long)rid[ri].grow * p.nq + rid[ri].h; // di_kernel's warp index
            const uint16_t *o = p.out + w * D + 8 * t4, *d = p.dout + w * D + 8 * t4;
#pragma unroll
            for (int i = 0; i < D / 32; i++)
                di_acc(v, *reinterpret_cast<const uint4 *>(o + 32 * i),
                       *reinterpret_cast<const uint4 *>(d + 32 * i));
        }
        Dr[ri] = di_quad_sum(v);
    }
}

// chunk_di in two halves, for an item whose dO is loaded into shared memory
// ahead: this thread's 16-byte vectors of O (vector i of row ri: columns 8
// t4 + 32 i; zeros for rows past the chunk) into registers ...
template <int D>
__device__ __forceinline__ void chunk_o_load(const Params &p, const RowId (&rid)[2], int t4,
                                             uint4 (&o)[2][D / 32])
{
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        const uint16_t *src = p.out + ((long long)rid[ri].grow * p.nq + rid[ri].h) * D + 8 * t4;
#pragma unroll
        for (int i = 0; i < D / 32; i++)
            o[ri][i] = rid[ri].ok ? *reinterpret_cast<const uint4 *>(src + 32 * i)
                                  : make_uint4(0u, 0u, 0u, 0u);
    }
}
// ... then Di from them and the chunk's dO at dos (generic address; rows
// r0, r0 + 8 of the 128-byte swizzle): chunk_di's products and sums, so
// chunk_di's bits (rows past the chunk: O zeros, so 0, as chunk_di)
template <int D>
__device__ __forceinline__ void chunk_di_smem(const uint4 (&o)[2][D / 32], const uint8_t *dos, int r0, int t4,
                                              float (&Dr)[2])
{
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        const int r = r0 + 8 * ri;
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            v[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < D / 32; i++) {
            const int c = t4 + 4 * i; // 16-byte chunk of the row: column block c / 8, chunk c % 8
            const uint4 ud = *reinterpret_cast<const uint4 *>(dos + (c >> 3) * (CHUNK_ROWS * 128) + r * 128 +
                                                              (((c & 7) ^ (r & 7)) << 4));
            di_acc(v, o[ri][i], ud);
        }
        Dr[ri] = di_quad_sum(v);
    }
}
// The 16-key block tile's P^T, dS^T (bf16 [key][row] tiles of 128-byte rows
// in the 128-byte swizzle: row r of key k in chunk r / 8 at chunk position
// (r / 8) ^ (k % 8), element r % 8) at ptp, ptp + pstep, from this thread's
// P (s: NJ x 4 accumulators) and dS fragments (sa), the 8-key groups below bs
template <int NJ>
__device__ __forceinline__ void store_pt_ds(uint8_t *ptp, int pstep, const float *s, const uint32_t (*sa)[4], int bs,
                                            int warp, int gid, int t4)
{
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        if (8 * j >= bs)
            break;
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            // elements 4 j + 2 ri + e: row 16 warp + gid + 8 ri, key 8 j + 2 t4 + e
            const int rc = 2 * warp + ri, k0 = 8 * j + 2 * t4;
            const uint32_t pv = pack_bf2(s[4 * j + 2 * ri], s[4 * j + 2 * ri + 1]);
            const uint32_t sv = sa[j >> 1][2 * (j & 1) + ri]; // same elements
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int k = k0 + e, off = k * 128 + ((rc ^ (k & 7)) << 4) + 2 * gid;
                *reinterpret_cast<uint16_t *>(ptp + off) = (uint16_t)(pv >> (16 * e));
                *reinterpret_cast<uint16_t *>(ptp + pstep + off) = (uint16_t)(sv >> (16 * e));
            }
        }
    }
}

// The block keys' dK / dV for kv head g, transposed, N = the 16 block keys:
// dV_b^T = dO^T P, dK_b^T = Q^T dS (M = head dims, one m64 per column block
// of the chunk; 4 x less tensor work than m64 over 64 keys, 48 of them not
// written). A (dO^T, Q^T: D x 64 rows, MN-major): column block h at h x 8
// KiB of the chunk's Q at qsm (dO one QS later), k step kk = rows 16 kk ..
// + 15 = 2048 bytes; B (P, dS: 64 rows x 16 keys, K-major = the [key][row]
// tiles at pt, pt + pstep (2048)): k step kk = 32 bytes into their 128-byte
// rows. (pstep and ldk = nkv D as arguments: so dq_wg_kernel compiles to the
// same code as with this inline.)
// Every warp stores: element 4 j + 2 r + e of column block h is head dim
// 64 h + 16 warp + gid + 8 r, key 8 j + 2 t4 + e; dK scaled in fp32 before
// the rounding. P^T / dS^T must be fenced (async proxy) and synced.
template <int D>
__device__ __forceinline__ void fold16(const Params &p, int b, int g, uint32_t qsm, uint32_t pt, uint32_t pstep,
                                       long long ldk, int warp, int gid, int t4)
{
    constexpr int NH = D / 64, QS = NH * CHUNK_ROWS * 128;
    constexpr uint32_t KM_LBO = 16, SBO = 1024;
    float dvt[NH][8], dkt[NH][8];
    const uint64_t bP = wg_desc(pt, KM_LBO, SBO), bS = bP + (pstep >> 4);
    const uint64_t tQ = wg_desc(qsm, CHUNK_ROWS * 128, SBO), tO = tQ + (QS >> 4);
    wg_fence();
#pragma unroll
    for (int h = 0; h < NH; h++) {
        const uint32_t ho = h * (CHUNK_ROWS * 128) >> 4;
        wg_ss16<false, 1>(dvt[h], tO + ho, bP);
#pragma unroll
        for (int kk = 1; kk < 4; kk++)
            wg_ss16<true, 1>(dvt[h], tO + ho + kk * (16 * 128 >> 4), bP + kk * (32 >> 4));
        wg_ss16<false, 1>(dkt[h], tQ + ho, bS);
#pragma unroll
        for (int kk = 1; kk < 4; kk++)
            wg_ss16<true, 1>(dkt[h], tQ + ho + kk * (16 * 128 >> 4), bS + kk * (32 >> 4));
    }
    wg_commit();
    wg_wait<0>();
#pragma unroll
    for (int h = 0; h < NH; h++) {
        reg_fence(dvt[h]);
        reg_fence(dkt[h]);
    }
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int key = 8 * j + 2 * t4 + e;
            if (key >= p.bs)
                continue;
            const long long off = ((long long)b * p.bs + key) * ldk + (long long)g * D + 16 * warp + gid;
#pragma unroll
            for (int h = 0; h < NH; h++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const float vk = dkt[h][4 * j + 2 * r + e] * p.scale;
                    const float vv = dvt[h][4 * j + 2 * r + e];
                    p.dkb[off + 64 * h + 8 * r] = __bfloat16_as_ushort(__float2bfloat16_rn(vk));
                    p.dvb[off + 64 * h + 8 * r] = __bfloat16_as_ushort(__float2bfloat16_rn(vv));
                }
        }
}

// WG3: the block tile's dS^T (16 keys of 128 bytes at generic address dst_s)
// into its slot of dsbo, keys past bs as 0 (thread tid of 128: 16 bytes)
__device__ __forceinline__ void dsb_store(const Params &p, int b, int g, int tid, const uint8_t *dst_s, uint16_t *dsbo)
{
    const int key = tid >> 3;
    const uint4 v = key < p.bs ? *reinterpret_cast<const uint4 *>(dst_s + 16 * tid) : make_uint4(0u, 0u, 0u, 0u);
    *reinterpret_cast<uint4 *>(reinterpret_cast<uint8_t *>(dsbo) + ((size_t)b * p.nkv + g) * DS_BLK_BYTES + 16 * tid) = v;
}
#endif // DF_WG_BODY

// Items (block, kv head, row chunk), item i = (nb - 1 - b) nkv nch + g nch
// + ch: blocks last to first (the forward's order: a document's longest
// context spans first, neighbouring anchors side by side; it replaced
// dq_order_kernel's global LPT order, still used by dq_mma2_kernel: on the
// H200, bench_dflash_attn, session 9, the pass took 0.450 -> 0.434 ms, 3docs
// full, 0.449 -> 0.439 sliding; 1doc within +-1%).
// Persistent (session 13): the host launches as many CTAs as fit at once
// (2 per SM at D 128, __launch_bounds__(.., 2): shared memory bound); CTA
// c's first item is c, each next one is taken from the counter *ctr
// (zeroed by the host before the launch; atomicAdd, plus gridDim.x) at the
// start of the item before, so items go to CTAs as they free up, in item
// order, as the hardware hands out CTAs (a static stride, item c + j
// gridDim.x, was ~5% slower at 1doc sliding in session 13; uneven rounds are
// the likely reason, not measured). The item -> CTA mapping changes nothing
// in the results: each item is computed whole by one CTA, in tile order.
// Why: where a block's rows of a kv head are one TMA box (maps.qd_on) and
// the block tile is 16 keys (bs <= 16), the next item's loads run under
// this item's block tile and epilogue: its Q / dO and its first context
// tile by TMA into the two stage pairs, and (FOLD) its O rows into
// registers and its lse, so its Di is computed (chunk_di_smem: chunk_di's
// bits, dO from shared memory) before this item's fold; its anchor and
// document start come by cp.async into shared memory (no registers held
// across the item), and it is known valid (no load at its top). Shared
// memory is three page pairs (Q + dO, or one context tile's K + V: 2 x 16
// KiB at D 128) whose roles rotate, and, bs <= 16, the block area (the
// block tile's 16 keys, then FOLD's P^T / dS^T: DqLayout): item i holds Q /
// dO in pair pq and its context tiles alternate in pk0 / pk1; its block
// tile (the last) lands in the block area, issued at the item's start. From
// the block tile's barrier on (the last context tile's wgmmas retired) pk0
// and pk1 are free: item i + 1's Q / dO go to pk1, its first context tile
// to pk0; item i + 1 then holds Q / dO in pk1 and its tiles in pk0 and the
// old pq (free once the fold's wgmmas retired: the item's last barrier).
// One mbarrier per pair and one for the block area, each phase counted
// apart (every thread waits on every fill).
// Before the block area (session 13), the block tile took a stage pair, so
// item i + 1's first tile was issued only at its start. A clock64 trace of
// every item (session 14, H200, 3docs full) put ~2.9 us of a 21.3 us item
// in the loads of its start (the validity, then anchor / start, then the
// first tile: three round trips) and another ~6 us in the block tile, dQ
// store, fold and its stores; the other CTA of the SM covers much of
// that: moving the start's loads under the block tile (this code) took the
// pass only 2-3.5% (below).
// H200, bench_dflash_attn (session 13; medians of 5 runs of main's kernel
// and 4 of this one, two calls): this pass 3docs full 0.366 -> 0.354 ms,
// sliding 0.372 -> 0.351, 1doc full 0.828 -> 0.816, 1doc sliding 0.667 ->
// 0.652; the backward 3docs full 0.803 -> 0.789 ms (334 TFLOP/s), 3docs
// sliding 0.801 -> 0.785; every gradient bitwise the same. The block
// area with item i + 1's first tile, anchor and start early (session 14;
// H200, bench_dflash_attn, medians of 6 runs of each, interleaved in one
// call): this pass 3docs full 0.356 -> 0.343 ms, sliding 0.351 -> 0.344,
// 1doc full 0.814 -> 0.799, 1doc sliding 0.639 -> 0.624 (faster in 22 of
// the 24 run pairs); every gradient bitwise the same. Not kept:
// issuing item i + 1's first two tiles too, right after item i's last
// barrier (before the fold's stores), twice (branches wip/s13-early-tiles,
// -2): 255 registers and a 4-8 byte spill, the pass 8-12% slower. With one
// CTA per item instead (grid = items,
// DFLASH_ATTN_DQ_PERSIST=0) this code was ~4% slower than the
// non-persistent kernel it replaced.
// FOLD (impl WG2F; the host launches it only with p.nch == 1, so the CTA
// holds every row that sees its block's keys for kv head g, and bs <= QTK:
// one block tile, the last of the loop): the CTA also computes its rows' Di
// (chunk_di; writes p.Di for the later passes; di_kernel is not run) and
// its block's dK / dV for kv head g (dkb, dvb; dkv_mma2_kernel's block tiles
// are not run):
//   dV_b = P^T dO,  dK_b = scale dS^T Q      (64 block keys, bs valid, x D)
// from the block tile's P and dS (bf16, as the dQ GEMM used them) summed
// over the chunk's 64 rows. In the block tile, P^T and dS^T are stored as
// bf16 [key][row] tiles (128-byte rows, the swizzle of the Q tile: K-major A
// operands): with the 16-key block tile in the block area over its V, once
// the tile's dQ wgmma retired (see pt in the kernel), else into the free
// stage pair;
// after the loop and dQ's write-out (its accumulators dead), with the
// 16-key block tile the transposed products dV_b^T = dO^T P, dK_b^T = Q^T dS
// (M = head dims, N = 16 keys: 2 x D/64 x 4 wgmma m64n16k16, A = dO / Q of
// the chunk MN-major through the descriptor, B = P^T / dS^T K-major), else
// 2 x 4 wgmma m64nDk16 with A = P^T / dS^T (64 keys) and B = dO / Q,
// MN-major (dkv_wg_kernel's B of dV += P^T dO, dK += dS^T Q). The transposed
// form does a quarter of the tensor work (no 48 unwritten key rows) and
// spreads the stores over the 4 warps; H200, bench_dflash_attn (session 14,
// medians of 5 interleaved runs each): this pass 0.2-1.0% faster, the
// backward 3docs full 0.786 -> 0.777 ms, every gradient bitwise the same
// (the same k order per output element). Block dK / dV need not be bitwise
// MMA4's (wgmma's sum order within a k step may differ from mma.sync's, and
// P, dS come from this kernel's S, dP).
// FOLD = false compiles to WG2's kernel as before (every addition is under
// if constexpr (FOLD)).
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

// Impl WG3's block pass (dflash_attn/wg_dqs.cu's step 1), lean: one CTA
// (one warpgroup) per (block b, kv head g), no persistence, no context
// tiles, no dQ: Di (chunk_di: di_kernel's bits), the block tile's S, dP,
// P, dS (16 keys, the fold's code), the block-key dK / dV (the transposed
// fold) and the block tile's dS^T into dsbo. 44 KiB of shared memory (Q,
// dO, K_b, V_b by TMA, P^T / dS^T), so several CTAs per SM overlap their
// loads (a block-only instantiation of the persistent dQ kernel, two long
// chains per SM, was no faster: session 15). Launched only with bs <= 16 and
// maps.qd_on.
template <int D> struct BlkLayout {
    static constexpr int NH = D / 64, QS = NH * CHUNK_ROWS * 128, BK = NH * 16 * 128;
    static constexpr int PT = 2 * QS + 2 * BK; // P^T (2 KiB), dS^T (2 KiB)
    static constexpr int BAR = PT + 4096;
    static constexpr size_t SMEM = (size_t)BAR + 8 + 1024;
};

template <int D>
__global__ void __launch_bounds__(QNT, 4)
    blk_wg_kernel(Params p, const __grid_constant__ KvMaps maps, uint16_t *dsbo, int *ctr)
{
#if DF_WG_BODY
    using L = BlkLayout<D>;
    constexpr int V8 = D / 8, KS = D / 16;
    constexpr uint32_t KM_LBO = 16, SBO = 1024;
    extern __shared__ __align__(1024) uint8_t bl_smem[];
    const uint32_t s0 = smem_u32(bl_smem), sb = (s0 + 1023u) & ~1023u;
    const int tid = threadIdx.x, lane = tid & 31, gid = lane >> 2, t4 = lane & 3;
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const long long ldk = (long long)p.nkv * D;
    const int g = blockIdx.x % p.nkv, b = p.nb - 1 - blockIdx.x / p.nkv;
    const RowId rid[2] = {row_id(p, b, g, 0, 16 * warp + gid), row_id(p, b, g, 0, 16 * warp + gid + 8)};
    const bool valid = p.valid[b];
    const uint32_t bar = sb + L::BAR;
    pdl_trigger(); // WG3's next kernels may launch (they wait for this one's end)
    if (blockIdx.x == 0 && tid == 0)
        *ctr = 0; // the dQ kernel's item counter (DsBuf.ctr)
    if (valid && tid == 0) {
        mbar_init(bar, 1);
        mbar_fence_init();
        mbar_expect_tx(bar, (uint32_t)(2 * L::QS + 2 * L::BK));
#pragma unroll
        for (int cb = 0; cb < L::NH; cb++) {
            tma_load_3d(sb + cb * (CHUNK_ROWS * 128), &maps.q, 64 * cb, g * p.group, b * p.bs, bar);
            tma_load_3d(sb + L::QS + cb * (CHUNK_ROWS * 128), &maps.dout, 64 * cb, g * p.group, b * p.bs, bar);
            tma_load_2d(sb + 2 * L::QS + cb * (16 * 128), &maps.kb, g * D + 64 * cb, b * p.bs, bar);
            tma_load_2d(sb + 2 * L::QS + L::BK + cb * (16 * 128), &maps.vb, g * D + 64 * cb, b * p.bs, bar);
        }
    }
    // lse, and (valid) this thread's O for Di, while the copies land
    float Dr[2], nL[2];
    bool rok[2];
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        const long long li = (long long)rid[ri].grow * p.nq + rid[ri].h;
        const float l2 = rid[ri].ok && valid ? p.lse_in[li] * WLOG2E : -INFINITY;
        nL[ri] = -l2;
        rok[ri] = rid[ri].ok && l2 != -INFINITY;
    }
    // Di (di_kernel's bits, for the context dK/dV pass) of this thread's rows
    auto di_store = [&]() {
#pragma unroll
        for (int ri = 0; ri < 2; ri++)
            if (rid[ri].ok && t4 == 0)
                p.Di[(long long)rid[ri].grow * p.nq + rid[ri].h] = Dr[ri];
    };
    if (!valid) { // padding block: Di as di_kernel's, dkb / dvb 0 (dkv_mma2_kernel's block tiles); no dS^T (dqs_kernel writes its dq 0)
        chunk_di<D>(p, rid, t4, Dr);
        di_store();
        for (int e = tid; e < p.bs * V8; e += QNT) {
            long long off = ((long long)b * p.bs + e / V8) * ldk + (long long)g * D + (e % V8) * 8;
            *reinterpret_cast<uint4 *>(p.dkb + off) = make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4 *>(p.dvb + off) = make_uint4(0u, 0u, 0u, 0u);
        }
        return;
    }
    uint4 o[2][D / 32];
    chunk_o_load<D>(p, rid, t4, o);
    __syncthreads(); // the mbarrier's init, before anyone waits on it
    mbar_wait(bar, 0);
    // S, dP of the 16 block keys (m64n16), P, dS as in dq_wg_kernel's block tile
    const uint64_t dQ = wg_desc(sb, KM_LBO, SBO), dO = dQ + (L::QS >> 4);
    const uint64_t dK = wg_desc(sb + 2 * L::QS, KM_LBO, SBO), dV = dK + (L::BK >> 4);
    float s[8], dp[8];
    wg_fence();
    wg_tile_ab<8, KS, CHUNK_ROWS, 16>(s, dQ, dK);
    wg_commit();
    wg_tile_ab<8, KS, CHUNK_ROWS, 16>(dp, dO, dV);
    wg_commit();
    // Di from O and the landed dO (chunk_di_smem: chunk_di's bits) while the wgmmas run
    chunk_di_smem<D>(o, bl_smem + (sb + L::QS - s0), 16 * warp + gid, t4, Dr);
    di_store();
    const float sl = p.scale * WLOG2E;
    wg_wait<1>();
    reg_fence(s);
    {
        int klo[2], khi[2];
#pragma unroll
        for (int ri = 0; ri < 2; ri++)
            row_key_range(p, rid[ri], 0, rok[ri], false, 0, klo[ri], khi[ri]);
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int ri = e >> 1, key = 8 * j + 2 * t4 + (e & 1);
                const bool vis = key >= klo[ri] && key < khi[ri];
                const float x = fmaf(s[4 * j + e], sl, nL[ri]);
                s[4 * j + e] = ex2(vis ? x : -INFINITY);
            }
    }
    wg_wait<0>();
    reg_fence(dp);
    uint32_t sa[1][4]; // dS as one k step's A fragments (dq_wg_kernel's layout)
#pragma unroll
    for (int h = 0; h < 4; h++) {
        const int i = 2 * h;
        const float d0 = Dr[h & 1];
        sa[0][h] = pack_bf2(s[i] * (dp[i] - d0), s[i + 1] * (dp[i + 1] - d0));
    }
    // P^T, dS^T as [key][row] tiles, the 8-key groups below bs
    uint8_t *ptp = bl_smem + (sb + L::PT - s0);
    store_pt_ds<2>(ptp, 2048, s, sa, p.bs, warp, gid, t4);
    fence_proxy_async(); // this thread's P^T / dS^T stores -> the tensor cores ...
    __syncthreads();     // ... everyone's
    // the block tile's dS^T for dqs_kernel (generic reads: ordered by the barrier)
    dsb_store(p, b, g, tid, ptp + 2048, dsbo);
    fold16<D>(p, b, g, sb, sb + L::PT, 2048, ldk, warp, gid, t4);
#else
    __trap(); // built without sm_90a: blk_wg_usable() keeps launches away
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
    static int persist = -1;
    if (persist < 0) {
        const char *v = getenv("DFLASH_ATTN_DQ_PERSIST");
        persist = !(v && v[0] == '0');
    }
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

bool blk_wg_usable(int D)
{
    static signed char known[2][64]; // [D == 128][device]
    const void *fn = D == 128 ? (const void *)blk_wg_kernel<128> : (const void *)blk_wg_kernel<64>;
    return wg_kernel_runs(fn, D == 128 ? BlkLayout<128>::SMEM : BlkLayout<64>::SMEM, known[D == 128]);
}

int blk_wg_launch(const Params &p, int D, cudaStream_t st, const KvMaps &maps, const DsBuf &dsb)
{
    const long long n = (long long)p.nb * p.nkv;
    if (n <= 0)
        return 0;
    const void *fn = D == 128 ? (const void *)blk_wg_kernel<128> : (const void *)blk_wg_kernel<64>;
    const size_t smem = D == 128 ? BlkLayout<128>::SMEM : BlkLayout<64>::SMEM;
    static signed char set[2][64]; // [D == 128][device]
    // (the largest carveout: several CTAs per SM)
    cudaError_t e = func_smem_once(fn, smem, true, set[D == 128]);
    if (e == cudaSuccess) {
        if (D == 128)
            blk_wg_kernel<128><<<(unsigned)n, QNT, smem, st>>>(p, maps, dsb.dsb, dsb.ctr);
        else
            blk_wg_kernel<64><<<(unsigned)n, QNT, smem, st>>>(p, maps, dsb.dsb, dsb.ctr);
        e = cudaGetLastError();
    }
    if (e != cudaSuccess) {
        fprintf(stderr, "dflash_attn: blk_wg_kernel<%d>: %s (%s:%d)\n", D, cudaGetErrorString(e), __FILE__, __LINE__);
        return -EIO;
    }
    return 0;
}

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
