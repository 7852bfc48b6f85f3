// dflash_attn/mma_dkvr.cu - the context dK/dV pass of the 99 KiB parts
// (sm_86 / sm_89 / sm_120, and DFLASH_PORTABLE=1) on mma.sync, with the
// tile's K / V in registers: dkvr_kernel. mma_bwd.cu's bwd_mma2_launch runs
// it for the context tiles (dkv_mma2_kernel keeps the block tiles).
//
// Why a second shape: dkv_mma2_kernel keeps P^T and dS^T in the registers
// that computed them, so each warp owns 16 keys x the whole head dim of dK
// and dV (128 fp32 accumulators per thread at D 128, 254 registers in all)
// and only half the item's rows (the halves added at the end), and it
// reloads K / V fragments from shared memory for every item.
// Here a CTA owns a 64-key tile as there (same lists, LPT order, splits,
// fp32 partials, dS^T store), but:
//  - each warp holds its 16 keys' K and V as mma A fragments in registers
//    for the whole pass (loaded once): the S^T / dP^T products read only
//    Q / dO from shared memory;
//  - S phase: warp w = (kg = w % 4: keys 16 kg .. + 15, hf = w / 4: rows
//    32 hf .. + 31) computes S^T, dP^T, P^T and dS^T and writes the bf16
//    P^T / dS^T to shared [key][row] tiles;
//  - A phase: the same warp accumulates dV += P^T dO and dK += dS^T Q for
//    its 16 keys x head-dim half hf over all 64 rows: 64 fp32 accumulators
//    per thread, no row halves to add at the end;
//  - the keys 16 kg .. + 15 are written and read by the warp pair (kg, 0),
//    (kg, 1) only: the S -> A hand-off is a 64-thread named barrier, after
//    which the pair copies its 16 dS^T rows to the store in 16-byte pieces;
//  - four row buffers (Q and dO of this item and of the next): one CTA
//    barrier per item, the next item's rows loading under this item's math,
//    its rows' statistics loaded into registers before the math and written
//    after it, the block after it read from the list an item ahead (no
//    global load waits between two items); each thread's row pieces from
//    one address per item at compile-time offsets at block size 16 and group
//    4 (Q16Rows), at fixed offsets (RowPieces) elsewhere where the group
//    divides the chunk;
//  - P and dS straight-line, full or masked chosen once per item (p_ds_tile).
// Shared memory: 4 x 64 x (D + 8) bf16 rows, 2 x 64 x 72 bf16 P^T / dS^T,
// 2 x 64 x 16 bytes of row data, each item's block data: 88 KiB at D 128.
#include "mma.cuh"

namespace {
using namespace df_dflash;

constexpr int NWR = 8, PTR = RQ + 8; // warps; P^T / dS^T pitch (bf16, conflict-free)
static_assert(TKM == 64 && RQ == 64, "4 key groups of 16 x 2 row / head-dim halves; K / V staged in a row buffer each");

template <int D>
constexpr size_t dkvr_smem()
{
    return (size_t)4 * RQ * (D + 8) * 2 + (size_t)2 * TKM * PTR * 2 + (size_t)2 * RQ * 16 + 2 * 4 * 4;
}
static_assert(dkvr_smem<128>() <= 99 * 1024, "the 99 KiB parts");

__device__ __forceinline__ void bar_pair_r(int id)
{
    asm volatile("bar.sync %0, 64;\n" ::"r"(id) : "memory");
}

// One CTA per (LPT rank of a 64-key context tile, kv head, split).
template <int D>
__global__ void __launch_bounds__(NWR * 32, 1)
    dkvr_kernel(Params p, float *part, uint16_t *dsd, const int *cnt, const int *lst, const int *order)
{
    constexpr int NTHR = NWR * 32, KP = D + 8, KS = D / 16, V8 = D / 8, NH = D / 16; // NH: n tiles per D half
    extern __shared__ float4 smem4[];
    uint16_t *Rb = reinterpret_cast<uint16_t *>(smem4);  // 4 row buffers: Q, dO of parity 0, then of parity 1
    uint16_t *Pt = Rb + 4 * RQ * KP, *dSt = Pt + TKM * PTR; // [key][row] bf16
    float *Lb = reinterpret_cast<float *>(dSt + TKM * PTR); // [2][RQ] lse * log2e
    float *Db = Lb + 2 * RQ;                                // [2][RQ] Di
    int *Qob = reinterpret_cast<int *>(Db + 2 * RQ), *Lob = Qob + 2 * RQ;
    int *Ib = Lob + 2 * RQ; // [2][4]: the item's block, anchor, document start, chunk
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, t4 = lane & 3;
    const int kg = warp & 3, hf = warp >> 2;
    const long long ldk = (long long)p.nkv * D;
    const int bid = blockIdx.x;
    const int split = bid % NSPL, g = (bid / NSPL) % p.nkv, tile = order[bid / (NSPL * p.nkv)];
    const int base = tile * TKM, kend = base + TKM < p.S ? base + TKM : p.S;
    const int k0 = base + 16 * kg; // this warp's first key (context index)
    const int rows_ok = p.bs * p.group;
    const int nit = cnt[tile] * p.nch;
    const int *tl = lst + (size_t)tile * p.nb;

    // an item's block: list entry k / nch (no division at one chunk per block, the 27B shape)
    auto blk = [&](int k) { return p.nch == 1 ? tl[k] : tl[k / p.nch]; };
    // item k (block b) into the buffers of parity par: its Q and dO rows (cp.async), its rows'
    // lse, Di, query offsets and lows into registers (store_row_stats writes them)
    RowPieces<D, RQ, NTHR> rp;
    const bool fast_rows = rp.init(p);
    // block size 16 and group 4: the rows from one address per item, the statistics without divisions
    const bool q16 = Q16Rows<D, NTHR>::on(p);
    Q16Rows<D, NTHR> qr;
    qr.init();
    auto issue = [&](int k, int b, int par) {
        uint16_t *Qd = Rb + 2 * par * RQ * KP, *Dd = Qd + RQ * KP;
        if (q16) {
            qr.issue(p, b, g, p.q, Qd, p.dout, Dd);
            RowStats s;
            const int r = threadIdx.x < RQ ? threadIdx.x : 0;
            const long long li = Q16Rows<D, NTHR>::row(p, b, g, r);
            s.b = b, s.ch = 0, s.anc = p.anchor[b], s.ds = p.doc_start[b];
            s.ok = threadIdx.x < RQ, s.qo = r >> 2;
            s.lse = s.ok ? p.lse_in[li] : 0.0f;
            s.di = s.ok ? p.Di[li] : 0.0f;
            return s;
        }
        const int ch = p.nch == 1 ? 0 : k % p.nch;
        if (fast_rows)
            rp.issue(p, b, g, ch, p.q, Qd, p.dout, Dd);
        else
            issue_rows<D, RQ, NTHR>(p, b, g, ch, p.q, Qd, p.dout, Dd);
        return load_row_stats<RQ, NTHR>(p, b, g, ch);
    };

    // K / V of the tile, staged in the parity-1 row buffers, into this warp's
    // A fragments (rows 16 kg .. + 15, every 16-column step)
    uint32_t ka[KS][4], va[KS][4];
    {
        uint16_t *Ks = Rb + 2 * RQ * KP, *Vs = Ks + RQ * KP;
        for (int e = threadIdx.x; e < TKM * V8; e += NTHR) {
            int key = e / V8, c = (e % V8) * 8;
            bool ok = base + key < kend;
            long long off = ok ? (long long)(base + key) * ldk + (long long)g * D + c : 0;
            cp16(Ks + key * KP + c, p.kc + off, ok);
            cp16(Vs + key * KP + c, p.vc + off, ok);
        }
        if (split < nit)
            store_row_stats<RQ>(p, issue(split, blk(split), 0), 0, Lb, Db, Qob, Lob, Ib);
        cp_commit();
        cp_wait<0>();
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            ldsm_a<KP>(ka[ks], Ks, 16 * kg, 16 * ks, lane);
            ldsm_a<KP>(va[ks], Vs, 16 * kg, 16 * ks, lane);
        }
        __syncthreads(); // every warp has its fragments: the parity-1 buffers take item split + NSPL
    }
    float ak[NH][4], av[NH][4];
#pragma unroll
    for (int nd = 0; nd < NH; nd++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            ak[nd][e] = 0.0f, av[nd][e] = 0.0f;
    const float sl = p.scale * LOG2E;
    // item k's math on the buffers of parity par
    auto item = [&](int par) {
        const uint16_t *Qs = Rb + 2 * par * RQ * KP, *dOs = Qs + RQ * KP;
        const float *Ls = Lb + par * RQ, *Ds = Db + par * RQ;
        const int *Qo = Qob + par * RQ, *Lo = Lob + par * RQ;
        const int b = Ib[4 * par], anc = Ib[4 * par + 1], dst = Ib[4 * par + 2], ch = Ib[4 * par + 3];
        const int lo0 = ctx_lo(anc, dst, p.W, 0), lohi = ctx_lo(anc, dst, p.W, p.bs - 1);
        // this item's dS^T slot of the store ([64 keys][64 rows])
        uint16_t *dslot = dsd ? dsd + dsd_slot(p, b, g, ch, tile - lo0 / TKM) * (size_t)(TKM * RQ) : NULL;
        // the pair's 16 keys: invisible to every row of the item (both
        // warps of the pair skip both phases: nobody else reads their rows
        // of P^T / dS^T; keys before the span in its first tile are zeros in
        // the store, which dq_dsd_kernel reads from the tile's start), or
        // visible to every row (no per-element mask)
        if (k0 >= anc)
            return;
        if (k0 + 16 <= lo0) {
            if (dslot)
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int hi = 0; hi < 2; hi++)
                        *reinterpret_cast<uint32_t *>(dslot + (size_t)(16 * kg + gid + 8 * hi) * RQ + 32 * hf +
                                                      nt * 8 + 2 * t4) = 0u;
            return;
        }
        const bool full = (ch + 1) * RQ <= rows_ok && k0 >= lohi && k0 + 16 <= anc;
        // S phase: keys k0 .. + 15 x rows 32 hf .. + 31 (4 n tiles)
        {
            float s[4][4], dp[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[nt][e] = 0.0f, dp[nt][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                mma_rows<4, KP>(s, ka[ks], Qs, 32 * hf, 16 * ks, lane);
                mma_rows<4, KP>(dp, va[ks], dOs, 32 * hf, 16 * ks, lane);
            }
            p_ds_tile(s, dp, full, Ls, Ds, Lo, Qo, 32 * hf, k0, true, anc, p.W, sl, lane);
            // bf16 P^T, dS^T -> [key][row] (rows 2 t4, 2 t4 + 1 packed)
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int hi = 0; hi < 2; hi++) {
                    int key = 16 * kg + gid + 8 * hi, row = 32 * hf + nt * 8 + 2 * t4;
                    uint32_t pv = pack_bf2(s[nt][2 * hi], s[nt][2 * hi + 1]);
                    uint32_t dv = pack_bf2(dp[nt][2 * hi], dp[nt][2 * hi + 1]);
                    *reinterpret_cast<uint32_t *>(Pt + key * PTR + row) = pv;
                    *reinterpret_cast<uint32_t *>(dSt + key * PTR + row) = dv;
                }
        }
        bar_pair_r(1 + kg); // the pair's P^T / dS^T rows are complete
        // the pair's 16 dS^T rows to the store in whole 16-byte pieces (each key's 64 rows are
        // 128 contiguous bytes there): two per thread of the pair
        if (dslot)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                int c = 32 * hf + lane + 64 * j, key = 16 * kg + c / (RQ / 8), col = (c % (RQ / 8)) * 8;
                *reinterpret_cast<uint4 *>(dslot + (size_t)key * RQ + col) =
                    *reinterpret_cast<const uint4 *>(dSt + key * PTR + col);
            }
        // A phase: keys k0 .. + 15 x head dims hf D/2 .. + D/2 - 1, over the RQ rows
        {
            const uint16_t *dOc = dOs + hf * (D / 2), *Qc = Qs + hf * (D / 2);
#pragma unroll
            for (int kk = 0; kk < RQ / 16; kk++) {
                uint32_t pa[4], sa[4];
                ldsm_a<PTR>(pa, Pt, 16 * kg, 16 * kk, lane);
                ldsm_a<PTR>(sa, dSt, 16 * kg, 16 * kk, lane);
                mma_cols<NH, KP>(av, pa, dOc, 16 * kk, lane);
                mma_cols<NH, KP>(ak, sa, Qc, 16 * kk, lane);
            }
        }
    };
    int par = 0, bn = split + NSPL < nit ? blk(split + NSPL) : 0; // bn: item k + NSPL's block
    for (int k = split; k < nit; k += NSPL, par ^= 1) {
        if (k != split) {
            cp_wait<0>();    // item k landed (this thread's copies)
            __syncthreads(); // ... everyone's; every warp is done with item k - NSPL (its buffers, P^T, dS^T)
        }
        const bool more = k + NSPL < nit;
        RowStats rs;
        if (more) // under this item's math: item k + NSPL's rows, its statistics' loads, the block after it
            rs = issue(k + NSPL, bn, par ^ 1);
        cp_commit();
        if (k + 2 * NSPL < nit)
            bn = blk(k + 2 * NSPL);
        item(par);
        if (more)
            store_row_stats<RQ>(p, rs, par ^ 1, Lb, Db, Qob, Lob, Ib);
    }
    cp_wait<0>();
    // the fp32 partials: keys k0 + gid (+ 8), dims hf D/2 + 8 nd + 2 t4 (+ 1)
    size_t n = (size_t)p.S * ldk;
    float *pk = part + (size_t)split * 2 * n, *pv = pk + n;
#pragma unroll
    for (int hi = 0; hi < 2; hi++) {
        int key = k0 + gid + 8 * hi;
        if (key >= kend)
            continue;
        size_t off = (size_t)key * ldk + (size_t)g * D + hf * (D / 2) + 2 * t4;
#pragma unroll
        for (int nd = 0; nd < NH; nd++) {
            *reinterpret_cast<float2 *>(pk + off + nd * 8) =
                make_float2(ak[nd][2 * hi] * p.scale, ak[nd][2 * hi + 1] * p.scale);
            *reinterpret_cast<float2 *>(pv + off + nd * 8) = make_float2(av[nd][2 * hi], av[nd][2 * hi + 1]);
        }
    }
}

} // namespace

namespace df_dflash {

int dkvr_launch(const Params &p, int D, cudaStream_t st, float *part, uint16_t *dsd, const int *cnt,
                const int *lst, const int *order, int nct)
{
    unsigned grid = (unsigned)((long long)nct * p.nkv * NSPL);
    if (grid == 0)
        return 0;
    if (D == 64) {
        SMEM(dkvr_kernel<64>, dkvr_smem<64>());
        dkvr_kernel<64><<<grid, NWR * 32, dkvr_smem<64>(), st>>>(p, part, dsd, cnt, lst, order);
    } else {
        SMEM(dkvr_kernel<128>, dkvr_smem<128>());
        dkvr_kernel<128><<<grid, NWR * 32, dkvr_smem<128>(), st>>>(p, part, dsd, cnt, lst, order);
    }
    CU(cudaGetLastError());
    return 0;
}

} // namespace df_dflash
