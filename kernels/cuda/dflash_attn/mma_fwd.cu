// dflash_attn/mma_fwd.cu - impl MMA4's row-chunk passes on mma.sync tensor
// cores (sm_80+): the forward (fwd_r32_kernel) and the dQ pass that
// recomputes S and dP (dq_mma2_kernel), with its longest-first order (also
// the Hopper implementations' fallback where their wgmma kernels do not run).
#include "mma.cuh"

namespace {
using namespace df_dflash;

// The forward: CTA = (pair of blocks 2 j, 2 j + 1, kv head g, row chunk ch),
// 4 warps: warps 2 i, 2 i + 1 the 64 rows of block 2 j + i, 32 rows each as
// two m16 tiles with Q in registers, so each K / V fragment loaded from
// shared memory feeds two mmas (0.25 ldmatrix.x4 per mma; 16 rows per warp
// take 0.5, which bounds the H100's mma.sync rate). Adjacent blocks (anchors
// ascending) see nearly the same context, so the pair shares every context
// K / V tile of the union of their spans, then each block's own block-key
// tile; a warp skips the tiles its block does not see. Tiles of TKR = 32
// keys, two stages (cp.async), one barrier per tile: 34.8 KiB at D 128, two
// CTAs (8 warps) per SM within 99 KiB. The rows' key ranges wait in shared
// memory for the tiles that need masks (registers hold Q, O and S).
constexpr int FWR = 4; // warps per forward CTA
constexpr float RESCALE_SLACK = 8.0f; // log2 of the largest P before a rescale (see below)
template <int D>
__global__ void __launch_bounds__(FWR * 32, 2) fwd_r32_kernel(Params p)
{
    constexpr int KP = D + 8, KS = D / 16, NTD = D / 8, NTK = TKR / 8, V8 = D / 8;
    extern __shared__ float4 smem4[];
    uint16_t *sm = reinterpret_cast<uint16_t *>(smem4);
    int2 *rinfo = reinterpret_cast<int2 *>(sm + 2 * 2 * TKR * KP); // per row: (ctx lo, qo), qo -1: no row
    // pairs in reverse: a row's anchors ascend, so its longest spans go first and the
    // launch's last CTAs are short ones (no long CTA left alone at the end)
    int ch = blockIdx.x % p.nch, g = (blockIdx.x / p.nch) % p.nkv,
        pb = (p.nb + 1) / 2 - 1 - (int)(blockIdx.x / (p.nch * p.nkv));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, t4 = lane & 3;
    int wi = warp >> 1, wr = (warp & 1) * 32; // this warp's block of the pair, its rows in the chunk
    int b = 2 * pb + wi;
    long long ldq = (long long)p.nq * D, ldk = (long long)p.nkv * D;
    // the pair: valid flags, anchors and the union of their context spans [ulo, uhi)
    int bq[2] = {2 * pb, 2 * pb + 1};
    bool vq[2];
    int ancq[2], loq[2];
    int ulo = INT_MAX, uhi = 0;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        vq[i] = bq[i] < p.nb && p.valid[bq[i]];
        ancq[i] = vq[i] ? p.anchor[bq[i]] : 0;
        loq[i] = vq[i] ? ctx_lo(ancq[i], p.doc_start[bq[i]], p.W, 0) : 0;
        if (vq[i] && ancq[i] > loq[i]) {
            ulo = min(ulo, loq[i]);
            uhi = max(uhi, ancq[i]);
        }
    }
    int ntc = uhi > ulo ? (uhi - ulo + TKR - 1) / TKR : 0, ntb = (p.bs + TKR - 1) / TKR;
    int nt = ntc + (vq[0] ? ntb : 0) + (vq[1] ? ntb : 0); // block tiles: the valid blocks', in pair order
    // tile t: a context tile of the union, or block tile (t - ntc) % ntb of the (t - ntc) / ntb-th valid block
    auto tile_of = [&](int t, int &base, int &end, int &tb) -> bool {
        if (t < ntc) {
            base = ulo + t * TKR, end = uhi, tb = -1;
            return true;
        }
        int k = (t - ntc) / ntb, j = vq[0] ? k : k + 1;
        base = ((t - ntc) % ntb) * TKR, end = p.bs, tb = 2 * pb + j;
        return false;
    };
    // each thread's 16-byte pieces of a tile: keys kr + KR i, columns kc (the same in every tile)
    constexpr int KR = FWR * 32 / V8;
    static_assert((FWR * 32) % V8 == 0 && TKR % KR == 0, "whole passes of pieces");
    const int kr = threadIdx.x / V8, kc = (threadIdx.x % V8) * 8;
    auto issue = [&](int t, uint16_t *Kd) {
        uint16_t *Vd = Kd + TKR * KP;
        int base, end, tb;
        bool isctx = tile_of(t, base, end, tb);
        long long off = ((isctx ? base : (long long)tb * p.bs + base) + kr) * ldk + (long long)g * D + kc;
        const uint16_t *ksrc = (isctx ? p.kc : p.kb) + off, *vsrc = (isctx ? p.vc : p.vb) + off;
#pragma unroll
        for (int i = 0; i < TKR / KR; i++) {
            bool ok = base + kr + KR * i < end;
            cp16(Kd + (kr + KR * i) * KP + kc, ok ? ksrc + KR * i * ldk : p.kc, ok);
            cp16(Vd + (kr + KR * i) * KP + kc, ok ? vsrc + KR * i * ldk : p.vc, ok);
        }
    };
    if (nt > 0)
        issue(0, sm);
    cp_commit();
    const bool mine = b < p.nb; // (the last pair of an odd count has one block)
    const bool val = mine && (wi ? vq[1] : vq[0]);
    int anc = wi ? ancq[1] : ancq[0], lo0 = wi ? loq[1] : loq[0], ds = val ? p.doc_start[b] : 0;
    int lohi = val ? ctx_lo(anc, ds, p.W, p.bs - 1) : 0;
    // this thread's rows: ri = 2 mt + h is row wr + 16 mt + 8 h + gid of the block's chunk
    int2 *ri4 = rinfo + wi * CHUNK_ROWS + wr + gid;
    if (t4 == 0)
#pragma unroll
        for (int ri = 0; ri < 4; ri++) {
            RowId id = row_id(p, mine ? b : 0, g, ch, wr + 8 * ri + gid);
            ri4[8 * ri] = make_int2(ctx_lo(anc, ds, p.W, id.qo), val && id.ok ? id.qo : -1);
        }
    uint32_t qa[2][KS][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        RowId rid[2] = {row_id(p, mine ? b : 0, g, ch, wr + 16 * mt + gid),
                        row_id(p, mine ? b : 0, g, ch, wr + 16 * mt + gid + 8)};
        ld_a_rows<D, false>(qa[mt], p.q, NULL, NULL, rid, val, ldq, t4);
    }
    float o[2][NTD][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nd = 0; nd < NTD; nd++)
            o[mt][nd][0] = o[mt][nd][1] = o[mt][nd][2] = o[mt][nd][3] = 0.0f;
    float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, l[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const float sl = p.scale * LOG2E;
    for (int t = 0; t < nt; t++) {
        cp_wait<0>();
        __syncthreads(); // tile t landed for all; every warp is done with tile t - 1, whose stage t + 1 takes
        if (t + 1 < nt)
            issue(t + 1, sm + ((t + 1) & 1) * 2 * TKR * KP);
        cp_commit();
        const uint16_t *Ks = sm + (t & 1) * 2 * TKR * KP, *Vs = Ks + TKR * KP;
        int base, end, tb;
        bool isctx = tile_of(t, base, end, tb);
        // this warp's tile: a context tile that meets its block's span, or its block's own tile
        bool use = val && (isctx ? base < anc && base + TKR > lo0 : tb == b);
        if (!use)
            continue;
        if (isctx)
            end = anc;
        bool full = isctx && base >= lohi && base + TKR <= anc;
        float s[2][NTK][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int n = 0; n < NTK; n++)
                s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
            mma_rows2<NTK, KP>(s[0], s[1], qa[0][ks], qa[1][ks], Ks, 0, ks * 16, lane);
        // s stays unscaled here: its max times sl is the max of s * sl (sl > 0, rounding
        // is monotone), and each exponent below is one FFMA, s * sl - max
        float mx[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
        if (full) {
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int n = 0; n < NTK; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        mx[2 * mt + (e >> 1)] = fmaxf(mx[2 * mt + (e >> 1)], s[mt][n][e]);
        } else {
#pragma unroll
            for (int ri = 0; ri < 4; ri++) {
                const int2 r = ri4[8 * ri];
#pragma unroll
                for (int n = 0; n < NTK; n++)
#pragma unroll
                    for (int e = 2 * (ri & 1); e < 2 * (ri & 1) + 2; e++) {
                        int key = base + n * 8 + 2 * t4 + (e & 1);
                        bool vis = r.y >= 0 && visible(isctx, key, end, r.x, r.y, p.W);
                        float &x = s[ri >> 1][n][e];
                        x = vis ? x : -INFINITY;
                        mx[ri] = fmaxf(mx[ri], x);
                    }
            }
        }
        // m: the row's exponent offset, moved only where the tile's max passes it by more than
        // RESCALE_SLACK (then to that max): P stays below 2^RESCALE_SLACK, and O and l are
        // rescaled only when some row of the warp moves (rarely after the first tiles; a rescale
        // is one FMUL per mma). mz: m, or 0 while the row sees no key (every s is -inf: exp2 gives 0)
        float al[4], mz[4];
#pragma unroll
        for (int ri = 0; ri < 4; ri++) {
            mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 1));
            mx[ri] = fmaxf(mx[ri], __shfl_xor_sync(0xffffffffu, mx[ri], 2));
            float mnew = mx[ri] * sl;
            bool up = mnew > m[ri] + RESCALE_SLACK; // (false for a row that sees no key here)
            al[ri] = up && m[ri] != -INFINITY ? ex2(m[ri] - mnew) : 1.0f;
            m[ri] = up ? mnew : m[ri];
            mz[ri] = m[ri] == -INFINITY ? 0.0f : m[ri];
        }
        float ps[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int n = 0; n < NTK; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int ri = 2 * mt + (e >> 1);
                    float pr = ex2(fmaf(s[mt][n][e], sl, -mz[ri]));
                    s[mt][n][e] = pr;
                    ps[ri] += pr;
                }
#pragma unroll
        for (int ri = 0; ri < 4; ri++)
            l[ri] = l[ri] * al[ri] + ps[ri];
        if (__any_sync(0xffffffffu, al[0] != 1.0f || al[1] != 1.0f || al[2] != 1.0f || al[3] != 1.0f))
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nd = 0; nd < NTD; nd++)
                    o[mt][nd][0] *= al[2 * mt], o[mt][nd][1] *= al[2 * mt], o[mt][nd][2] *= al[2 * mt + 1],
                        o[mt][nd][3] *= al[2 * mt + 1];
#pragma unroll
        for (int kk = 0; kk < TKR / 16; kk++) {
            uint32_t pa[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                pa[mt][0] = pack_bf2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][1] = pack_bf2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][2] = pack_bf2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][3] = pack_bf2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
            mma_cols2<NTD, KP>(o[0], o[1], pa[0], pa[1], Vs, kk * 16, lane);
        }
    }
    cp_wait<0>();
    if (!mine)
        return;
#pragma unroll
    for (int ri = 0; ri < 4; ri++) {
        l[ri] += __shfl_xor_sync(0xffffffffu, l[ri], 1);
        l[ri] += __shfl_xor_sync(0xffffffffu, l[ri], 2);
    }
#pragma unroll
    for (int ri = 0; ri < 4; ri++) {
        RowId id = row_id(p, b, g, ch, wr + 8 * ri + gid);
        if (!id.ok)
            continue;
        bool any = val && l[ri] > 0.0f; // (an invalid block's rows: 0 and lse -inf)
        float inv = any ? 1.0f / l[ri] : 0.0f;
        uint16_t *orow = p.o + id.grow * ldq + id.h * D;
        const int mt = ri >> 1, h = ri & 1;
#pragma unroll
        for (int nd = 0; nd < NTD; nd++)
            *reinterpret_cast<uint32_t *>(orow + nd * 8 + 2 * t4) =
                pack_bf2(o[mt][nd][2 * h] * inv, o[mt][nd][2 * h + 1] * inv);
        if (t4 == 0)
            p.lse[(long long)id.grow * p.nq + id.h] = any ? m[ri] * LN2 + logf(l[ri]) : -INFINITY;
    }
}

// LPT (WG2's dQ where the wgmma one does not run): CTA blockIdx takes item
// order[blockIdx / nkv] (item = b nch + ch, dq_order_kernel's longest-first
// order), kv head blockIdx % nkv; else (block, kv head, chunk) in order.
template <int D, bool LPT>
__global__ void __launch_bounds__(MW * 32) dq_mma2_kernel(Params p, const int *order)
{
    constexpr int KP = D + 8, KS = D / 16, NTD = D / 8, NTK = TKQ / 8;
    extern __shared__ float4 smem4[];
    uint16_t *sm = reinterpret_cast<uint16_t *>(smem4);
    int ch = blockIdx.x % p.nch, g = (blockIdx.x / p.nch) % p.nkv,
        b = blockIdx.x / (p.nch * p.nkv);
    if (LPT) {
        int item = order[blockIdx.x / p.nkv];
        ch = item % p.nch, g = blockIdx.x % p.nkv, b = item / p.nch;
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, t4 = lane & 3;
    long long ldq = (long long)p.nq * D;
    if (!p.valid[b]) {
        for (int i = 0; i < 16; i++) {
            RowId id = row_id(p, b, g, ch, warp * 16 + i);
            if (!id.ok)
                continue;
            for (int k = lane; k < D; k += 32)
                p.dq[id.grow * ldq + id.h * D + k] = 0;
        }
        return;
    }
    int anc = p.anchor[b], ds = p.doc_start[b];
    int lo0 = ctx_lo(anc, ds, p.W, 0), lohi = ctx_lo(anc, ds, p.W, p.bs - 1);
    int ntc = (anc - lo0 + TKQ - 1) / TKQ, ntb = (p.bs + TKQ - 1) / TKQ, nt = ntc + ntb;
    issue_kv<D, TKQ>(p, b, g, anc, lo0, ntc, 0, sm, sm + TKQ * KP, MW * 32);
    cp_commit();
    RowId rid[2] = {row_id(p, b, g, ch, warp * 16 + gid), row_id(p, b, g, ch, warp * 16 + gid + 8)};
    int rlo[2];
    float L[2], Dr[2];
    bool rok[2];
    bool allok = true;
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        rlo[ri] = ctx_lo(anc, ds, p.W, rid[ri].qo);
        long long li = (long long)rid[ri].grow * p.nq + rid[ri].h;
        L[ri] = rid[ri].ok ? p.lse_in[li] * LOG2E : -INFINITY;
        Dr[ri] = rid[ri].ok ? p.Di[li] : 0.0f;
        rok[ri] = rid[ri].ok && L[ri] != -INFINITY;
    }
    allok = __syncthreads_and(rok[0] && rok[1]);
    uint32_t qa[KS][4], da[KS][4];
    ld_a_rows<D, true>(qa, p.q, da, p.dout, rid, true, ldq, t4);
    float acc[NTD][4];
#pragma unroll
    for (int nd = 0; nd < NTD; nd++)
        acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.0f;
    const float sl = p.scale * LOG2E;
    for (int t = 0; t < nt; t++) {
        if (t + 1 < nt) {
            uint16_t *Kd = sm + ((t + 1) & 1) * 2 * TKQ * KP;
            issue_kv<D, TKQ>(p, b, g, anc, lo0, ntc, t + 1, Kd, Kd + TKQ * KP, MW * 32);
        }
        cp_commit();
        cp_wait<1>();
        __syncthreads();
        const uint16_t *Ks = sm + (t & 1) * 2 * TKQ * KP, *Vs = Ks + TKQ * KP;
        bool isctx = t < ntc;
        int base = isctx ? lo0 + t * TKQ : (t - ntc) * TKQ;
        int end = isctx ? anc : p.bs;
        bool full = allok && isctx && base >= lohi && base + TKQ <= anc;
        float s[NTK][4], dp[NTK][4];
#pragma unroll
        for (int n = 0; n < NTK; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                s[n][e] = 0.0f, dp[n][e] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            mma_rows<NTK, KP>(s, qa[ks], Ks, 0, ks * 16, lane);
            mma_rows<NTK, KP>(dp, da[ks], Vs, 0, ks * 16, lane);
        }
        if (full) {
#pragma unroll
            for (int n = 0; n < NTK; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int ri = e >> 1;
                    float P = ex2(s[n][e] * sl - L[ri]);
                    s[n][e] = P * (dp[n][e] - Dr[ri]);
                }
        } else {
#pragma unroll
            for (int n = 0; n < NTK; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int ri = e >> 1, key = base + n * 8 + 2 * t4 + (e & 1);
                    bool vis = rok[ri] && visible(isctx, key, end, rlo[ri], rid[ri].qo, p.W);
                    float P = vis ? ex2(s[n][e] * sl - L[ri]) : 0.0f;
                    s[n][e] = vis ? P * (dp[n][e] - Dr[ri]) : 0.0f;
                }
        }
#pragma unroll
        for (int kk = 0; kk < TKQ / 16; kk++) {
            uint32_t sa[4] = {pack_bf2(s[2 * kk][0], s[2 * kk][1]), pack_bf2(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            mma_cols<NTD, KP>(acc, sa, Ks, kk * 16, lane);
        }
        __syncthreads();
    }
    cp_wait<0>();
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        const RowId &id = rid[ri];
        if (!id.ok)
            continue;
        uint16_t *qrow = p.dq + id.grow * ldq + id.h * D;
#pragma unroll
        for (int nd = 0; nd < NTD; nd++)
            *reinterpret_cast<uint32_t *>(qrow + nd * 8 + 2 * t4) =
                pack_bf2(acc[nd][2 * ri] * p.scale, acc[nd][2 * ri + 1] * p.scale);
    }
}

// ---- the dQ pass's longest-first CTA order (WG2, WG2F) ----
// A dQ grid in (block, kv head, chunk) order runs the trainer's blocks
// sorted by anchor, so the CTAs with the longest context spans start last
// and the pass ends in a tail of them (one 4096-token document: spans 0 ..
// ~4096 keys). dq_order_kernel builds an order of the items (block, chunk) on
// the device: descending key-tile count, ties by index (LPT), kv head
// fastest. Same math, same sum order per element: the order changes no bit.
// (The measured gains, the pass-by-pass profile and the dQ designs tried and
// dropped: docs/log/2026-11-30-session-03.md and the later logs.)
constexpr int NL_ORDER = 1024; // threads of dq_order_kernel

// out[rank] = i for i < n, ranked by (key(i), i) ascending. Call from every
// thread of a CTA of NL_ORDER threads (the loops and barriers are CTA-uniform).
// O(n^2 / NL_ORDER) shared-memory compares: 512 items take a few microseconds.
template <typename K>
__device__ __forceinline__ void rank_sort(int n, K key, int *out, unsigned long long *sh)
{
    for (int i0 = 0; i0 < n; i0 += NL_ORDER) {
        int i = i0 + threadIdx.x, r = 0;
        unsigned long long ki = i < n ? key(i) : 0ull;
        for (int j0 = 0; j0 < n; j0 += NL_ORDER) {
            __syncthreads(); // the previous chunk of keys is read
            sh[threadIdx.x] = j0 + threadIdx.x < n ? key(j0 + threadIdx.x) : 0ull;
            __syncthreads();
            int m = n - j0 < NL_ORDER ? n - j0 : NL_ORDER;
            if (i < n)
                for (int jj = 0; jj < m; jj++) {
                    unsigned long long kj = sh[jj];
                    r += kj < ki || (kj == ki && j0 + jj < i);
                }
        }
        if (i < n)
            out[r] = i;
    }
}

// order[rank] = item (b nch + ch), by descending dq_mma2 tile count (padding
// blocks: 0), ties by index. Any permutation is correct; this one is LPT.
__global__ void __launch_bounds__(NL_ORDER) dq_order_kernel(Params p, int *order)
{
    __shared__ unsigned long long sh[NL_ORDER];
    rank_sort(p.nb * p.nch, [&](int it) -> unsigned long long {
        int b = it / p.nch, n = 0;
        if (p.valid[b]) {
            int anc = p.anchor[b], lo0 = ctx_lo(anc, p.doc_start[b], p.W, 0);
            n = (anc - lo0 + TKQ - 1) / TKQ + (p.bs + TKQ - 1) / TKQ;
        }
        return (unsigned long long)(0x7fffffff - n);
    }, order, sh);
}

// The dQ pass on dq_mma2_kernel: its CTAs in dq_order's order (LPT) where
// given, else in grid order.
template <int D>
int dq_mma2_launch(const Params &p, cudaStream_t st, const int *dq_order)
{
    unsigned n = (unsigned)((long long)p.nb * p.nkv * p.nch);
    if (dq_order) {
        SMEM((dq_mma2_kernel<D, true>), dq3_smem<D>());
        dq_mma2_kernel<D, true><<<n, MW * 32, dq3_smem<D>(), st>>>(p, dq_order);
    } else {
        SMEM((dq_mma2_kernel<D, false>), dq3_smem<D>());
        dq_mma2_kernel<D, false><<<n, MW * 32, dq3_smem<D>(), st>>>(p, nullptr);
    }
    CU(cudaGetLastError());
    return 0;
}

template <int D>
int fwd_mma_launch(const Params &p, cudaStream_t st)
{
    long long n = (long long)(p.nb + 1) / 2 * p.nkv * p.nch; // (pairs of blocks)
    if (n == 0)
        return 0;
    SMEM(fwd_r32_kernel<D>, fwdr_smem<D>());
    fwd_r32_kernel<D><<<(unsigned)n, FWR * 32, fwdr_smem<D>(), st>>>(p);
    CU(cudaGetLastError());
    return 0;
}

} // namespace

namespace df_dflash {

int mma_fwd_launch(const Params &p, int D, cudaStream_t st)
{
    return D == 64 ? fwd_mma_launch<64>(p, st) : fwd_mma_launch<128>(p, st);
}

int dq_mma2_run(const Params &p, int D, cudaStream_t st, const int *order)
{
    return D == 64 ? dq_mma2_launch<64>(p, st, order) : dq_mma2_launch<128>(p, st, order);
}

int dq_order_run(const Params &p, cudaStream_t st, int *order)
{
    dq_order_kernel<<<1, NL_ORDER, 0, st>>>(p, order);
    CU(cudaGetLastError());
    return 0;
}

} // namespace df_dflash
