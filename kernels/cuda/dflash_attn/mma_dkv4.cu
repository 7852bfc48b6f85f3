// dflash_attn/mma_dkv4.cu - impl MMA4's context dK/dV pass where the device
// gives it 174 KiB of shared memory (D 128; sm_90): dkv4_kernel over the
// per-tile block lists (tile_list_kernel) in their LPT order
// (tile_order_kernel), which WG2 / WG3's wgmma pass (wg_dkv.cu) shares.
// mma_bwd.cu launches it (bwd_mma4_launch); on smaller parts its
// bwd_mma2_launch runs instead.
#include "mma.cuh"

namespace {
using namespace df_dflash;

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
constexpr int NW4 = 8, PTP = RQ + 8; // PTP: [key][row] bf16 pitch (conflict-free)
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
    long long ldk = (long long)p.nkv * D;
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
        issue_rows<D, RQ, NTHR>(p, b, g, ch, p.q, Qd, p.dout, Dd);
        stage_row_stats<RQ, NTHR>(p, b, g, ch, st, Lb, Db, Qob, Lob);
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
                            P = ex2(s[m][nt][e] * sl - Lr);
                            dp[m][nt][e] = P * (dp[m][nt][e] - Ds[r]);
                        } else {
                            int key = k0 + 16 * m + gid + (e >> 1) * 8;
                            bool vis = Lr != -INFINITY && visible(true, key, anc, Lo[r], Qo[r], p.W);
                            P = vis ? ex2(s[m][nt][e] * sl - Lr) : 0.0f;
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

} // namespace

namespace df_dflash {

size_t dkv4_smem_bytes(int D) { return D == 64 ? dkv4_smem<64>() : dkv4_smem<128>(); }

int tile_lists_launch(const Params &p, cudaStream_t st, int nct, int tk, int *cnt, int *lst, int *order, bool pdl)
{
    Params pa = p;
    void *la[4] = {&pa, &tk, &cnt, &lst};
    CU(launch_pdl((const void *)tile_list_kernel, dim3((unsigned)nct), dim3(NT), 0, st, pdl, la));
    void *oa[3] = {&cnt, &nct, &order};
    CU(launch_pdl((const void *)tile_order_kernel, dim3(1), dim3(1024), 0, st, pdl, oa));
    return 0;
}

int dkv4_launch(const Params &p, int D, cudaStream_t st, float *part, const int *cnt, const int *lst,
                const int *order, int nct)
{
    unsigned grid = (unsigned)((long long)nct * p.nkv * NSPL);
    if (D == 64) {
        SMEM(dkv4_kernel<64>, dkv4_smem<64>());
        dkv4_kernel<64><<<grid, NW4 * 32, dkv4_smem<64>(), st>>>(p, part, cnt, lst, order);
    } else {
        SMEM(dkv4_kernel<128>, dkv4_smem<128>());
        dkv4_kernel<128><<<grid, NW4 * 32, dkv4_smem<128>(), st>>>(p, part, cnt, lst, order);
    }
    CU(cudaGetLastError());
    return 0;
}

} // namespace df_dflash
