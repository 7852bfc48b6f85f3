// dflash_attn/mma_bwd.cu - impl MMA4's backward on mma.sync tensor cores
// (sm_80+): Di, the dK/dV pass of every key tile (dkv_mma2_kernel), the split
// reduction, and the launch of the whole backward (dQ from the stored dS^T:
// mma_dqs.cu)
// for MMA4 and the Hopper implementations, which share these passes and fall
// back to them where their wgmma kernels do not run (dispatch.cu's header
// describes the structure; mma_fwd.cu has the forward and the dQ pass,
// mma_dkv4.cu the context dK/dV pass of the GPUs with 174 KiB per CTA).
#include "mma.cuh"

namespace {
using namespace df_dflash;

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

// dK/dV, pipelined: CTA (split s, kv head g, key tile of TKM keys); context
// tiles first (NSPL CTAs each, the tiles with the most items first: order),
// then block tiles (one CTA each; none where dq_dsd_kernel's FOLD has them).
// Work items = (visible block, row chunk) in ascending order: a context
// tile's from its list (cnt, lst: tile_list_kernel at TKM keys), item k =
// (lst[k / nch], k % nch); split s takes the items k with k % NSPL == s. Q/dO rows and their lse/Di/qo/lo of
// the next item are loaded (cp.async) while this item is computed.
// The dS^T store it writes (dsd): mma.cuh.

// dK/dV smem: K, V of the tile; three row-tile buffers that Q and dO take in
// turn (item i: Q in buffer 2i % 3, dO in (2i + 1) % 3); per item parity the
// rows' lse * log2e, Di, query offsets and lows. After the item loop the
// first 64 KiB hold the upper row half's dK / dV partial sums.
constexpr int DKV_BUF = 3;
template <int D>
constexpr size_t dkv3_smem()
{
    return (size_t)(2 * TKM + DKV_BUF * RQ) * (D + 8) * 2 + (size_t)2 * RQ * 16;
}
static_assert(dkv3_smem<128>() <= 99 * 1024, "the 99 KiB parts (sm_86 / sm_89 / sm_120)");
static_assert((size_t)2 * TKM * 128 * 4 <= dkv3_smem<128>(), "room for the upper half's partial sums");

// An item: (block b, row chunk ch); b >= nb: none.
struct ItemIter {
    int b, ch;
};

// 8 warps: warp w the keys 16 (w % 4) .. + 15 of the tile and the item rows
// 32 (w / 4) .. + 31, so a 99 KiB part (one such CTA per SM) runs 8 warps.
// The row halves' dK / dV are added at the end (upper half through shared
// memory into the lower, a fixed order). Loads overlap the math: Q of item
// i + 1 is issued at the start of item i, its dO once item i's dK product no
// longer reads Q of item i (its buffer), so dO loads under item i's dV product
// and item i + 1's S^T product.
// dsd (may be NULL): the dS^T store of the one-stage backward (dsd_bytes):
// each item's bf16 dS^T tile, as the dK products use it, into its slot for
// dq_dsd_kernel.
constexpr int DKV_W = 2 * MW; // warps per dK/dV CTA
template <int D>
__global__ void __launch_bounds__(DKV_W * 32, 1) dkv_mma2_kernel(Params p, float *part, int bid0, uint16_t *dsd,
                                                                  const int *cnt, const int *lst, const int *order)
{
    static_assert(RQ == 64 && TKM == 64, "4 key groups x 2 row halves of 32");
    constexpr int NTHR = DKV_W * 32, KP = D + 8, KS = D / 16, NTD = D / 8, V8 = D / 8;
    extern __shared__ float4 smem4[];
    uint16_t *Ks = reinterpret_cast<uint16_t *>(smem4), *Vs = Ks + TKM * KP, *Bf = Vs + TKM * KP;
    float *Lb = reinterpret_cast<float *>(Bf + DKV_BUF * RQ * KP); // [2][RQ] lse*log2e, then [2][RQ] Di
    float *Db = Lb + 2 * RQ;
    int *Qob = reinterpret_cast<int *>(Db + 2 * RQ), *Lob = Qob + 2 * RQ;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, t4 = lane & 3;
    int kg = warp % MW, rh = warp / MW; // key group, row half
    long long ldk = (long long)p.nkv * D;
    int nct = (p.S + TKM - 1) / TKM, ntb = (p.bs + TKM - 1) / TKM;
    int bid = blockIdx.x + bid0; // bid0 > 0: only the block tiles (MMA4's block-key pass)
    bool isctx = bid < nct * p.nkv * NSPL;
    int split, g, tile;
    if (isctx) {
        split = bid % NSPL, g = (bid / NSPL) % p.nkv, tile = order[bid / (NSPL * p.nkv)];
    } else {
        int r = bid - nct * p.nkv * NSPL;
        split = 0, g = r % p.nkv, tile = nct + r / p.nkv;
    }
    int bb = isctx ? -1 : (tile - nct) / ntb;
    int base = isctx ? tile * TKM : ((tile - nct) % ntb) * TKM;
    int end = isctx ? p.S : p.bs;
    long long rbase = isctx ? base : (long long)bb * p.bs + base;
    int kw = kg * 16, rw = rh * 32;
    int rows_ok = p.bs * p.group; // rows of a block's kv head (chunk ch: RQ ch ..)
    float ak[NTD][4], av[NTD][4];
#pragma unroll
    for (int nd = 0; nd < NTD; nd++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            ak[nd][e] = 0.0f, av[nd][e] = 0.0f;
    bool any = isctx || p.valid[bb];
    if (any) {
        const uint16_t *ksrc = isctx ? p.kc : p.kb, *vsrc = isctx ? p.vc : p.vb;
        for (int e = threadIdx.x; e < TKM * V8; e += NTHR) {
            int key = e / V8, c = (e % V8) * 8;
            bool ok = base + key < end;
            long long off = ok ? (rbase + key) * ldk + (long long)g * D + c : 0;
            cp16(Ks + key * KP + c, ksrc + off, ok);
            cp16(Vs + key * KP + c, vsrc + off, ok);
        }
        // this CTA's items: k = split, split + NSPL, .. < nit
        const int nit = isctx ? cnt[tile] * p.nch : p.nch, kstep = isctx ? NSPL : 1;
        const int *tl = isctx ? lst + (size_t)tile * p.nb : nullptr;
        auto item = [&](int k) -> ItemIter {
            if (k >= nit)
                return ItemIter{p.nb, 0};
            return isctx ? ItemIter{tl[k / p.nch], k % p.nch} : ItemIter{bb, k};
        };
        // an item's Q (is_do 0) or dO (is_do 1) rows into buffer buf; with Q, its
        // rows' lse, Di, query offsets and lows into parity slot par
        auto issue = [&](ItemIter it, int is_do, int buf, int par) {
            issue_rows<D, RQ, NTHR>(p, it.b, g, it.ch, is_do ? p.dout : p.q, Bf + buf * RQ * KP,
                                    NULL, NULL);
            if (!is_do)
                stage_row_stats<RQ, NTHR>(p, it.b, g, it.ch, par, Lb, Db, Qob, Lob);
        };
        int k = isctx ? split : 0;
        ItemIter cur = item(k);
        if (cur.b < p.nb) {
            issue(cur, 0, 0, 0);
            cp_commit(); // K / V and Q of item 0
            issue(cur, 1, 1, 0);
        }
        cp_commit();
        const float sl = p.scale * LOG2E;
        for (int i = 0; cur.b < p.nb; i++) {
            k += kstep;
            ItemIter nx = item(k);
            int par = i & 1, bq = (2 * i) % DKV_BUF, bo = (2 * i + 1) % DKV_BUF;
            cp_wait<1>(); // Q of item i (dO of item i may still be in flight)
            __syncthreads(); // ... visible to all; item i - 1 done: its dO buffer is free
            if (nx.b < p.nb)
                issue(nx, 0, (2 * i + 2) % DKV_BUF, par ^ 1);
            cp_commit();
            const uint16_t *Qs = Bf + bq * RQ * KP, *dOs = Bf + bo * RQ * KP;
            const float *Ls = Lb + par * RQ, *Ds = Db + par * RQ;
            const int *Qo = Qob + par * RQ, *Lo = Lob + par * RQ;
            int anc = p.anchor[cur.b];
            int kend_b = isctx ? anc : end;
            int lohi = ctx_lo(anc, p.doc_start[cur.b], p.W, p.bs - 1);
            bool full = isctx && (cur.ch + 1) * RQ <= rows_ok && base >= lohi && base + TKM <= anc;
            bool mine = base + kw < kend_b && cur.ch * RQ + rw < rows_ok; // keys and rows to do
            float s[4][4], dp[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[nt][e] = 0.0f, dp[nt][e] = 0.0f;
            if (mine) {
#pragma unroll
                for (int ks = 0; ks < KS; ks++) {
                    uint32_t ka[4];
                    ldsm_a<KP>(ka, Ks, kw, ks * 16, lane);
                    mma_rows<4, KP>(s, ka, Qs, rw, ks * 16, lane);
                }
            }
            cp_wait<1>(); // dO of item i (Q of item i + 1 may still be in flight)
            __syncthreads();
            uint32_t pa[2][4], sa[2][4];
            if (mine) {
#pragma unroll
                for (int ks = 0; ks < KS; ks++) {
                    uint32_t va[4];
                    ldsm_a<KP>(va, Vs, kw, ks * 16, lane);
                    mma_rows<4, KP>(dp, va, dOs, rw, ks * 16, lane);
                }
                p_ds_tile(s, dp, full, Ls, Ds, Lo, Qo, rw, base + kw, isctx, kend_b, p.W, sl, lane);
                uint16_t *dslot = NULL; // this item's dS^T tile (dsd), [64 keys][64 rows]
                if (dsd) {
                    int t = isctx ? tile - ctx_lo(anc, p.doc_start[cur.b], p.W, 0) / TKM : dsd_maxt(p.S, p.W);
                    dslot = dsd + dsd_slot(p, cur.b, g, cur.ch, t) * (size_t)(TKM * RQ);
                }
#pragma unroll
                for (int kk = 0; kk < 2; kk++) {
                    pa[kk][0] = pack_bf2(s[2 * kk][0], s[2 * kk][1]);
                    pa[kk][1] = pack_bf2(s[2 * kk][2], s[2 * kk][3]);
                    pa[kk][2] = pack_bf2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                    pa[kk][3] = pack_bf2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
                    sa[kk][0] = pack_bf2(dp[2 * kk][0], dp[2 * kk][1]);
                    sa[kk][1] = pack_bf2(dp[2 * kk][2], dp[2 * kk][3]);
                    sa[kk][2] = pack_bf2(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
                    sa[kk][3] = pack_bf2(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
                    int r0 = rw + kk * 16;
                    if (dslot) { // sa[kk][j]: key kw + gid (+ 8 for j odd), rows r0 + 8 (j / 2) + 2 t4 (+ 1)
                        uint16_t *d0 = dslot + (size_t)(kw + gid) * RQ + r0 + 2 * t4;
                        *reinterpret_cast<uint32_t *>(d0) = sa[kk][0];
                        *reinterpret_cast<uint32_t *>(d0 + 8 * RQ) = sa[kk][1];
                        *reinterpret_cast<uint32_t *>(d0 + 8) = sa[kk][2];
                        *reinterpret_cast<uint32_t *>(d0 + 8 * RQ + 8) = sa[kk][3];
                    }
                    mma_cols<NTD, KP>(ak, sa[kk], Qs, r0, lane);
                }
            }
            __syncthreads(); // Q of item i read by all: its buffer takes dO of item i + 1
            if (nx.b < p.nb)
                issue(nx, 1, (2 * i + 3) % DKV_BUF, 0);
            cp_commit();
            if (mine) {
#pragma unroll
                for (int kk = 0; kk < 2; kk++)
                    mma_cols<NTD, KP>(av, pa[kk], dOs, rw + kk * 16, lane);
            }
            cur = nx;
        }
        cp_wait<0>();
        __syncthreads(); // every buffer read
        // the upper row half's sums to the lower: [kg][nd][e][lane] fp32, dK then dV
        float *red = reinterpret_cast<float *>(smem4);
        if (rh == 1) {
#pragma unroll
            for (int nd = 0; nd < NTD; nd++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    red[((kg * NTD + nd) * 4 + e) * 32 + lane] = ak[nd][e];
                    red[((MW + kg) * NTD * 4 + nd * 4 + e) * 32 + lane] = av[nd][e];
                }
        }
        __syncthreads();
        if (rh == 0) {
#pragma unroll
            for (int nd = 0; nd < NTD; nd++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    ak[nd][e] += red[((kg * NTD + nd) * 4 + e) * 32 + lane];
                    av[nd][e] += red[((MW + kg) * NTD * 4 + nd * 4 + e) * 32 + lane];
                }
        }
    }
    if (rh == 1)
        return;
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

// MMA4's backward where dkv4_kernel does not fit the device's shared memory
// (sm_80's 163 KiB, sm_86/89/120's 99 KiB): Di, the per-tile item lists of
// the 64-key context tiles, then dkv_mma2_kernel for the context and the
// block keys alike, the split reduction; the dQ either from the dS^T that
// pass stores (dsd, block_size <= TKM: dq_dsd_kernel, one product instead of
// three; with one row chunk per block it also computes the block keys' dK /
// dV, which dkv_mma2_kernel then leaves out) or, where dsd is NULL,
// dq_mma2_kernel before it.
template <int D>
int bwd_mma2_launch(const Params &p, cudaStream_t st, float *part, int *lists, uint16_t *dsd, cudaEvent_t *ev)
{
    REC(ev, 0, st);
    long long rows = (long long)p.nb * p.bs;
    if (rows > 0) {
        long long w = rows * p.nq;
        di_kernel<D><<<(unsigned)((w * 32 + NT - 1) / NT), NT, 0, st>>>(p);
        CU(cudaGetLastError());
        REC(ev, 1, st);
        if (!dsd) {
            int rc = dq_mma2_run(p, D, st, nullptr);
            if (rc)
                return rc;
        }
    } else {
        REC(ev, 1, st);
    }
    REC(ev, 2, st);
    // FOLD: one row chunk per block: the block keys' dK / dV in the dQ kernel
    const bool fold = dsd && p.nch == 1;
    long long nct = (p.S + TKM - 1) / TKM, ctas = nct * p.nkv * NSPL +
                                              (fold ? 0 : (long long)p.nb * ((p.bs + TKM - 1) / TKM) * p.nkv);
    int *cnt = lists, *order = cnt + nct, *lst = order + nct;
    if (nct > 0) {
        int rc = tile_lists_launch(p, st, (int)nct, TKM, cnt, lst, order, false);
        if (rc)
            return rc;
    }
    REC(ev, 3, st);
    // the context tiles on dkvr_kernel (mma_dkvr.cu), the block tiles (without FOLD) on
    // dkv_mma2_kernel, its CTA ids offset past the context CTAs
    const long long cctas = nct * p.nkv * NSPL;
    if (cctas > 0) {
        int rc = dkvr_launch(p, D, st, part, dsd, cnt, lst, order, (int)nct);
        if (rc)
            return rc;
    }
    if (ctas > cctas) {
        SMEM(dkv_mma2_kernel<D>, dkv3_smem<D>());
        dkv_mma2_kernel<D><<<(unsigned)(ctas - cctas), DKV_W * 32, dkv3_smem<D>(), st>>>(p, part, (int)cctas, dsd,
                                                                                      cnt, lst, order);
        CU(cudaGetLastError());
    }
    REC(ev, 4, st); // context (and without FOLD block) keys
    if (dsd && rows > 0) { // (its pass event: [5], as WG3's dQ from its stored dS)
        int rc = dq_dsd_launch(p, D, st, dsd, fold);
        if (rc)
            return rc;
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

// WG3's stored dS for block range r of s's (s.bounds; NULL: one range)
inline df_dflash::DsBuf ds_range(const df_dflash::DsBuf &s, int r, int nb)
{
    df_dflash::DsBuf d = s;
    d.b0 = s.bounds ? s.bounds[r] : 0;
    d.b1 = s.bounds ? s.bounds[r + 1] : nb;
    d.first = r == 0;
    d.last = r == s.nranges - 1;
    d.ctr = s.ctr + r;
    return d;
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
// after the previous ones); elsewhere WG2's launches. WG3 with block ranges
// runs the context dK/dV and dQ passes in turn per range (pass events [4]
// and [5] then both after the last).
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
    if ((size_t)smax < dkv4_smem_bytes(D))
        return bwd_mma2_launch<D>(p, st, part, lists, dsd, ev);
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
    const int nr = wg3_on ? dsb->nranges : 1; // WG3's block ranges (DsBuf)
    bool dqs_done = false;
    if (rows > 0) {
        if (!fold_on) { // (fold_on: the dQ pass computes Di)
            long long w = rows * p.nq;
            di_kernel<D><<<(unsigned)((w * 32 + NT - 1) / NT), NT, 0, st>>>(p);
            CU(cudaGetLastError());
        }
        REC(ev, 1, st);
        if (wg2 && !wgdq_on) { // (the wgmma dQ runs its blocks last to first)
            int rc = dq_order_run(p, st, dq_order);
            if (rc)
                return rc;
        }
        // (the wgmma dQ pass takes dq_order[0] as its items' counter)
        // (WG3: its block pass, blk_wg_kernel, in place of the dQ pass)
        int rc = wg3_on    ? df_dflash::blk_wg_launch(p, D, st, maps, *dsb)
                 : wgdq_on ? df_dflash::dq_wg_launch(p, D, st, fold_on, maps, dq_order)
                           : dq_mma2_run(p, D, st, wg2 ? dq_order : nullptr);
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
        int rc = tile_lists_launch(p, st, nct, TK4, cnt, lst, order, dsb && dsb->pdl);
        if (rc)
            return rc;
        REC(ev, 3, st);
        if (wg3_on && nr > 1) { // WG3's block ranges: the dK/dV and dQ passes per range
            for (int r = 0; r < nr && !rc; r++) {
                df_dflash::DsBuf d = ds_range(*dsb, r, p.nb);
                rc = df_dflash::dkv_wg_launch(p, D, st, part, cnt, lst, order, nct, &maps, &d);
                d.part = d.last ? part : NULL; // the split reduction once every range's partials are in
                if (!rc)
                    rc = df_dflash::dqs_launch(p, D, st, maps, d);
            }
            if (rc)
                return rc;
            dqs_done = true;
        } else if (wg2 && df_dflash::dkv_wg_usable(p, D)) {
            rc = df_dflash::dkv_wg_launch(p, D, st, part, cnt, lst, order, nct,
                                              wgdq_on ? &maps : nullptr, dsb);
            if (rc)
                return rc;
        } else if ((rc = dkv4_launch(p, D, st, part, cnt, lst, order, nct))) {
            return rc;
        }
    } else {
        REC(ev, 3, st);
    }
    REC(ev, 4, st);
    // WG3's dQ (its pass event: [5]; with block ranges, done above); its kernel
    // also does the split reduction
    for (int r = 0; wg3_on && !dqs_done && r < nr; r++) {
        df_dflash::DsBuf d = ds_range(*dsb, r, p.nb);
        d.part = d.last ? part : NULL;
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
        dkv_mma2_kernel<D><<<(unsigned)nbt, DKV_W * 32, dkv3_smem<D>(), st>>>(p, part, (int)ctx2, nullptr, nullptr,
                                                                             nullptr, nullptr);
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

template <int D>
int di_run(const Params &p, cudaStream_t st)
{
    long long w = (long long)p.nb * p.bs * p.nq;
    if (w == 0)
        return 0;
    di_kernel<D><<<(unsigned)((w * 32 + NT - 1) / NT), NT, 0, st>>>(p);
    CU(cudaGetLastError());
    return 0;
}
} // namespace

namespace df_dflash {

// Bytes of the backward workspace before the dK/dV partials (Di), rounded up.
size_t di_bytes(const df_cuda_dflash_args *a)
{
    size_t n = (size_t)a->n_blocks * (size_t)a->block_size * (size_t)a->nq * sizeof(float);
    return (n + 255) / 256 * 256;
}

// Bytes of the fp32 context dK/dV partials, rounded up.
size_t part_bytes(const df_cuda_dflash_args *a)
{
    size_t n = (size_t)NSPL * 2 * (size_t)a->S * (size_t)a->nkv * (size_t)a->head_dim * sizeof(float);
    return (n + 255) / 256 * 256;
}

// Bytes of the context tile lists (cnt, order, lst: ints), after the partials:
// for tiles of TKM keys (bwd_mma2_launch's), room for TK4's too.
size_t list_bytes(const df_cuda_dflash_args *a)
{
    static_assert(TKM <= TK4, "the lists sized for the smaller tiles");
    size_t nct = ((size_t)a->S + TKM - 1) / TKM;
    return (nct * (2 + (size_t)a->n_blocks) * sizeof(int) + 255) / 256 * 256;
}

// WG3's dQ item counter (256 bytes) and stored dS (dflash_attn/wg_dqs.cu), after the dQ item order: the
// block tiles' dS^T, the context tiles' (room for every span at its widest,
// or for the spans as they are: args.ds_off);
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
    int64_t t = ds_ranged(a) ? a->ds_range_tiles : a->ds_tiles;
    size_t tiles = a->ds_off ? (size_t)(t > 0 ? t : 0)
                             : (size_t)(a->n_blocks > 0 ? a->n_blocks : 0) *
                                   (size_t)df_dflash::dqs_max_tiles(a->S, a->window);
    return 256 + dsb_bytes(a) + (size_t)(a->nkv > 0 ? a->nkv : 0) * tiles * df_dflash::DS_TILE_BYTES;
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
    size_t need = a->head_dim == 64 ? dkv4_smem_bytes(64) : dkv4_smem_bytes(128);
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

int di_launch(const Params &p, int D, cudaStream_t st)
{
    return D == 64 ? di_run<64>(p, st) : di_run<128>(p, st);
}

int mma_bwd_launch(const Params &p, int D, cudaStream_t st, float *part, int *lists, int *dq_order, bool wg2,
                   bool fold, cudaEvent_t *ev, const DsBuf *dsb, uint16_t *dsd)
{
    return D == 64 ? bwd_mma4_launch<64>(p, st, part, lists, dq_order, wg2, fold, ev, dsb, dsd)
                   : bwd_mma4_launch<128>(p, st, part, lists, dq_order, wg2, fold, ev, dsb, dsd);
}

} // namespace df_dflash
