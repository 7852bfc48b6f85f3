// dflash_attn/mma.cuh - what the mma.sync kernels of mma_fwd.cu (the forward,
// the dQ pass), mma_bwd.cu (the dK/dV passes) and mma_dqs.cu (dQ from the
// stored dS^T) share: fragment loads, the m16n8k16 products over shared
// tiles, the K / V tile loads, the tile sizes, the dS^T store's slots.
// Internal.
#ifndef DF_DFLASH_ATTN_MMA_CUH
#define DF_DFLASH_ATTN_MMA_CUH

#include "attn_internal.cuh"

namespace df_dflash {

// ---- tensor-core kernels (mma.sync m16n8k16 bf16 -> fp32, sm_80+) ----
// MMA4's forward, dQ and block-key dK/dV (and WG2's kernels where sm_90a is
// not there). The CUDA-core kernels' work split and determinism (every output
// element summed in a fixed order by one thread, written once, no atomics),
// 16 rows per warp, 4 warps per 64-row chunk (the forward: 32 rows per warp,
// two blocks' chunks per CTA sharing the context tiles). Operands are bf16 (P and dS rounded to
// bf16 before their products, as the naive bf16 math does); fp32 accumulate.
// K/V (and in dK/dV the Q/dO rows) staged by cp.async in two buffers (the
// next tile's load overlaps this tile's math); every mma operand fetched by
// ldmatrix (V, K and dO as the k-major B operand through .trans: no
// transposed stores); forward tiles of 32 keys; per-element masks skipped on
// tiles every row sees whole; softmax in the exp2 domain. dK/dV
// (dkv_mma2_kernel): 8 warps per 64-key tile, 4 key groups x 2 row halves,
// the halves added at the end. The valid blocks that see a context tile
// (its list) are dealt round-robin (in ascending order) to NSPL CTAs; each
// sums its share in a fixed order into fp32 partials, and a last kernel adds
// the NSPL partials in split order (deterministic; balances the late tiles
// seen by many blocks).
__device__ __forceinline__ uint32_t ld32(const uint16_t *p)
{
    return *reinterpret_cast<const uint32_t *>(p);
}
__device__ __forceinline__ uint32_t pack_bf2(float lo, float hi)
{
    return (uint32_t)f2bf(lo) | ((uint32_t)f2bf(hi) << 16);
}

constexpr int MW = 4;        // warps per CTA
constexpr int TKM = MW * 16; // keys per dK/dV tile of dkv_mma2_kernel (16 per key group)

// Two B fragments of a row-major [n rows][k] shared matrix (pitch KP), ldmatrix: rows n .. n + 7
// (r[0], r[1]) and n + 8 .. n + 15 (r[2], r[3]), k columns k0 .. k0 + 15.
template <int KP>
__device__ __forceinline__ void ldsm_b_rows(uint32_t r[4], const uint16_t *X, int n, int k0, int lane)
{
    // matrices: (n, k lo), (n, k hi), (n + 8, k lo), (n + 8, k hi)
    ldsm4(r, X + (n + (lane & 7) + (lane >> 4) * 8) * KP + k0 + ((lane >> 3) & 1) * 8);
}
// Two B fragments of a row-major [k rows][n] shared matrix (pitch KP), ldmatrix .trans: k rows
// k0 .. k0 + 15, n8 tiles nd (r[0], r[1]) and nd + 1 (r[2], r[3]).
template <int KP>
__device__ __forceinline__ void ldsm_b_cols(uint32_t r[4], const uint16_t *X, int k0, int nd, int lane)
{
    // matrices: (k lo, nd), (k hi, nd), (k lo, nd + 1), (k hi, nd + 1)
    ldsm4t(r, X + (k0 + ((lane >> 3) & 1) * 8 + (lane & 7)) * KP + (nd + (lane >> 4)) * 8);
}

// acc[n][*] += A (16 x 16 k) * X^T where X is row-major [n rows][k] in shared
// memory (ld KP): rows n0 .. n0 + 8 NT - 1, k columns k0 .. k0 + 15.
// (B fragment of "col" layout = rows of X: ldmatrix without .trans.)
// Used with X = K (S = Q K^T), V (dP = dO V^T), Q / dO (S^T = K Q^T ...).
template <int NTL, int KP>
__device__ __forceinline__ void mma_rows(float (*acc)[4], const uint32_t a[4], const uint16_t *X,
                                         int n0, int k0, int lane)
{
#pragma unroll
    for (int nt = 0; nt < NTL; nt += 2) {
        uint32_t r[4];
        ldsm_b_rows<KP>(r, X, n0 + nt * 8, k0, lane);
        mma16816(acc[nt], a, r[0], r[1]);
        mma16816(acc[nt + 1], a, r[2], r[3]);
    }
}
// acc[nd][*] += A (16 x 16 k) * X where X is row-major [k rows][n] in shared
// memory: k rows k0 .. k0 + 15, n columns 0 .. 8 NTD - 1 (ldmatrix .trans).
template <int NTD, int KP>
__device__ __forceinline__ void mma_cols(float (*acc)[4], const uint32_t a[4], const uint16_t *X,
                                         int k0, int lane)
{
#pragma unroll
    for (int nd = 0; nd < NTD; nd += 2) {
        uint32_t r[4];
        ldsm_b_cols<KP>(r, X, k0, nd, lane);
        mma16816(acc[nd], a, r[0], r[1]);
        mma16816(acc[nd + 1], a, r[2], r[3]);
    }
}

// mma_rows and mma_cols for two 16-row A operands (a warp's 32 rows): each B fragment
// loaded from shared memory feeds both (0.25 ldmatrix.x4 per mma, not 0.5).
template <int NTL, int KP>
__device__ __forceinline__ void mma_rows2(float (*acc0)[4], float (*acc1)[4], const uint32_t a0[4],
                                          const uint32_t a1[4], const uint16_t *X, int n0, int k0, int lane)
{
#pragma unroll
    for (int nt = 0; nt < NTL; nt += 2) {
        uint32_t r[4];
        ldsm_b_rows<KP>(r, X, n0 + nt * 8, k0, lane);
        mma16816(acc0[nt], a0, r[0], r[1]);
        mma16816(acc1[nt], a1, r[0], r[1]);
        mma16816(acc0[nt + 1], a0, r[2], r[3]);
        mma16816(acc1[nt + 1], a1, r[2], r[3]);
    }
}
template <int NTD, int KP>
__device__ __forceinline__ void mma_cols2(float (*acc0)[4], float (*acc1)[4], const uint32_t a0[4],
                                          const uint32_t a1[4], const uint16_t *X, int k0, int lane)
{
#pragma unroll
    for (int nd = 0; nd < NTD; nd += 2) {
        uint32_t r[4];
        ldsm_b_cols<KP>(r, X, k0, nd, lane);
        mma16816(acc0[nd], a0, r[0], r[1]);
        mma16816(acc1[nd], a1, r[0], r[1]);
        mma16816(acc0[nd + 1], a0, r[2], r[3]);
        mma16816(acc1[nd + 1], a1, r[2], r[3]);
    }
}

// The A fragments (16 rows x D, as D / 16 k steps) of a warp's rows rid[0] (this thread's gid)
// and rid[1] (gid + 8), read straight from global memory: src (and with TWO, src2 into a2 at
// the same offsets) rows of nq D values, head id.h; zero where ok is false or the row is not
// there.
template <int D, bool TWO>
__device__ __forceinline__ void ld_a_rows(uint32_t (*a)[4], const uint16_t *src, uint32_t (*a2)[4],
                                          const uint16_t *src2, const RowId *rid, bool ok, long long ldq,
                                          int t4)
{
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const RowId &id = rid[e & 1];
            int col = ks * 16 + 2 * t4 + (e >> 1) * 8;
            long long off = id.grow * ldq + id.h * D + col;
            a[ks][e] = ok && id.ok ? ld32(src + off) : 0u;
            if (TWO)
                a2[ks][e] = ok && id.ok ? ld32(src2 + off) : 0u;
        }
}

// A fragment (16 rows x 16 k) of a row-major [rows][k] shared matrix.
template <int KP>
__device__ __forceinline__ void ldsm_a(uint32_t a[4], const uint16_t *X, int r0, int k0, int lane)
{
    ldsm4(a, X + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * KP + k0 + (lane >> 4) * 8);
}

// P = 2^(S sl - lse) and dS = P (dP - Di), in place in S^T / dP^T, for a warp's 16 keys
// (key0 + gid, + 8) x 32 rows (r0 + 8 nt + 2 t4, + 1; r0 even): with every key visible to
// every row (full: no masks; each n tile's two rows' statistics as one 8-byte load), or masked
// per element (visible(isctx, key, kend, Lo[r], Qo[r], W); a row without lse sees nothing).
// Two straight-line copies: one branch per call, not one per element.
__device__ __forceinline__ void p_ds_tile(float (*s)[4], float (*dp)[4], bool full, const float *Ls,
                                          const float *Ds, const int *Lo, const int *Qo, int r0, int key0,
                                          bool isctx, int kend, int W, float sl, int lane)
{
    const int gid = lane >> 2, t4 = lane & 3;
    if (full) {
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            const int r = r0 + nt * 8 + 2 * t4;
            const float2 L2 = *reinterpret_cast<const float2 *>(Ls + r);
            const float2 D2 = *reinterpret_cast<const float2 *>(Ds + r);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float P = ex2(s[nt][e] * sl - (e & 1 ? L2.y : L2.x));
                dp[nt][e] = P * (dp[nt][e] - (e & 1 ? D2.y : D2.x));
                s[nt][e] = P;
            }
        }
    } else {
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = r0 + nt * 8 + 2 * t4 + (e & 1), key = key0 + gid + (e >> 1) * 8;
                float Lr = Ls[r];
                bool vis = Lr != -INFINITY && visible(isctx, key, kend, Lo[r], Qo[r], W);
                float P = vis ? ex2(s[nt][e] * sl - Lr) : 0.0f;
                dp[nt][e] = vis ? P * (dp[nt][e] - Ds[r]) : 0.0f;
                s[nt][e] = P;
            }
    }
}

// K/V tile t of a (block, head) key loop into stage buffers (cp.async, zero
// fill past the end).
template <int D, int TKX>
__device__ __forceinline__ void issue_kv(const Params &p, int b, int g, int anc, int lo0, int ntc,
                                         int t, uint16_t *Kd, uint16_t *Vd, int nthr)
{
    constexpr int KP = D + 8, V8 = D / 8;
    bool isctx = t < ntc;
    int base = isctx ? lo0 + t * TKX : (t - ntc) * TKX;
    int end = isctx ? anc : p.bs;
    const uint16_t *ksrc = isctx ? p.kc : p.kb, *vsrc = isctx ? p.vc : p.vb;
    long long rbase = isctx ? base : (long long)b * p.bs + base;
    long long ldk = (long long)p.nkv * D;
    for (int e = threadIdx.x; e < TKX * V8; e += nthr) {
        int key = e / V8, c = (e % V8) * 8;
        bool ok = base + key < end;
        long long off = ok ? (rbase + key) * ldk + (long long)g * D + c : 0;
        cp16(Kd + key * KP + c, ksrc + off, ok);
        cp16(Vd + key * KP + c, vsrc + off, ok);
    }
}

// The Q rows (and with dout, the dO rows) of item (b, ch) of kv head g into RQ-row staging
// buffers (cp.async, zero fill for the padding rows), as the backward's row passes stage
// them: each thread a 16-byte column c of rows r0 + RS j, one division for the first row
// and steps after it where RS is a multiple of the group (a row's head repeats every
// group rows).
template <int D, int RQ, int NTHR>
__device__ __forceinline__ void issue_rows(const Params &p, int b, int g, int ch,
                                           const uint16_t *src, uint16_t *dst,
                                           const uint16_t *src2, uint16_t *dst2)
{
    constexpr int KP = D + 8, V8 = D / 8, RS = NTHR / V8;
    static_assert(RQ % RS == 0, "whole row steps");
    const long long ldq = (long long)p.nq * D;
    const int rows_ok = p.bs * p.group;
    const int c = (threadIdx.x % V8) * 8, r0 = threadIdx.x / V8;
    const int rr0 = ch * RQ + r0, q0 = rr0 / p.group, h = g * p.group + rr0 % p.group;
    const bool stepq = RS % p.group == 0;
#pragma unroll
    for (int j = 0; j < RQ / RS; j++) {
        int r = r0 + RS * j;
        RowId id;
        if (stepq)
            id.ok = rr0 + RS * j < rows_ok, id.grow = b * p.bs + q0 + j * (RS / p.group), id.h = h;
        else
            id = row_id(p, b, g, ch, r);
        long long off = id.ok ? id.grow * ldq + id.h * D + c : 0;
        cp16(dst + r * KP + c, src + off, id.ok);
        if (src2)
            cp16(dst2 + r * KP + c, src2 + off, id.ok);
    }
}

// issue_rows with the row arithmetic done once per thread, where RQ is a multiple of the group
// (every chunk then starts at a head-0 row): row r of chunk ch is query ch RQ / group + r / group,
// head g group + r % group, so each of a thread's rows r0 + RS j sits at a fixed offset from the
// chunk's first (query, head) of kv head g. init: 0 where the group does not divide RQ (then
// issue_rows). off[j]: that offset plus the column.
template <int D, int RQ, int NTHR> struct RowPieces {
    static constexpr int V8 = D / 8, RS = NTHR / V8, NJ = RQ / RS;
    static_assert(NTHR % V8 == 0 && RQ % RS == 0, "whole row steps");
    int off[NJ];
    __device__ __forceinline__ bool init(const Params &p)
    {
        if (RQ % p.group)
            return false;
        const long long ldq = (long long)p.nq * D;
        const int c = (threadIdx.x % V8) * 8, r0 = threadIdx.x / V8;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            int r = r0 + RS * j;
            off[j] = (int)((r / p.group) * ldq + (r % p.group) * D + c);
        }
        return true;
    }
    // item (b, ch)'s rows of src into dst (and of src2 into dst2), as issue_rows
    __device__ __forceinline__ void issue(const Params &p, int b, int g, int ch, const uint16_t *src,
                                          uint16_t *dst, const uint16_t *src2, uint16_t *dst2) const
    {
        constexpr int KP = D + 8;
        const long long at = (long long)(b * p.bs + ch * (RQ / p.group)) * p.nq * D + (long long)g * p.group * D;
        const int c = (threadIdx.x % V8) * 8, r0 = threadIdx.x / V8, left = p.bs * p.group - ch * RQ;
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            int r = r0 + RS * j;
            bool ok = r < left;
            cp16(dst + r * KP + c, ok ? src + at + off[j] : src, ok);
            cp16(dst2 + r * KP + c, ok ? src2 + at + off[j] : src2, ok);
        }
    }
};

// An item's rows at block size 16 and group 4 with one chunk per block (the Qwen3 drafters'
// shape: RQ = 64 rows, every one valid). Query q's 4 heads of kv head g are 4 D contiguous
// elements; thread t copies its 16-byte pieces (t % TPQ) + TPQ j of query t / TPQ: one 64-bit
// address per item, the pieces at compile-time offsets, no zero-fill. row(r): row r's index into
// the lse / Di arrays ([token][head]), no division.
template <int D, int NTHR> struct Q16Rows {
    static constexpr int TPQ = NTHR / 16, W = TPQ * 8, NJ = 4 * D / W; // threads a query, elements a pass
    static_assert(NTHR % 16 == 0 && (D % W == 0 || W % D == 0), "whole passes");
    int so; // this thread's first piece in a [RQ][D + 8] buffer
    __device__ __forceinline__ static bool on(const Params &p) { return p.bs == 16 && p.group == 4 && p.nch == 1; }
    __device__ __forceinline__ void init()
    {
        const int e0 = (threadIdx.x % TPQ) * 8;
        so = (4 * (int)(threadIdx.x / TPQ) + e0 / D) * (D + 8) + e0 % D;
    }
    __device__ __forceinline__ void issue(const Params &p, int b, int g, const uint16_t *src, uint16_t *dst,
                                          const uint16_t *src2, uint16_t *dst2) const
    {
        const long long at = ((long long)(b * 16 + (int)(threadIdx.x / TPQ)) * p.nq + g * 4) * D + (threadIdx.x % TPQ) * 8;
        const uint16_t *s1 = src + at, *s2 = src2 + at;
        const uint32_t d1 = smem_u32(dst + so), d2 = smem_u32(dst2 + so);
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const int o = 2 * ((W * j / D) * (D + 8) + W * j % D); // bytes (e0 + W j stays in one head row)
            cp16(d1 + o, s1 + W * j);
            cp16(d2 + o, s2 + W * j);
        }
    }
    __device__ __forceinline__ static long long row(const Params &p, int b, int g, int r)
    {
        return (long long)(b * 16 + (r >> 2)) * p.nq + g * 4 + (r & 3);
    }
};

// The statistics of item (b, ch)'s rows into slot s of RQ-entry arrays: lse * log2e (-inf for a
// padding row), Di (0), query offsets and context lows. In two halves: the global loads (thread
// r < RQ: row r) into registers, then the slots, so a pass can issue the loads before a stretch
// of math and write the slots after it (stage_row_stats: both at once). store also writes the
// item's block, anchor, document start and chunk to Ib[4 s ..] (thread 0; Ib NULL: not).
struct RowStats {
    float lse, di;
    int qo, anc, ds, b, ch;
    bool ok;
};
template <int RQ, int NTHR>
__device__ __forceinline__ RowStats load_row_stats(const Params &p, int b, int g, int ch)
{
    static_assert(NTHR >= RQ, "one row per thread");
    RowStats s;
    s.b = b, s.ch = ch, s.anc = p.anchor[b], s.ds = p.doc_start[b];
    RowId id = row_id(p, b, g, ch, threadIdx.x < RQ ? threadIdx.x : 0);
    long long li = (long long)id.grow * p.nq + id.h;
    s.ok = id.ok && threadIdx.x < RQ, s.qo = id.qo;
    s.lse = s.ok ? p.lse_in[li] : 0.0f;
    s.di = s.ok ? p.Di[li] : 0.0f;
    return s;
}
template <int RQ>
__device__ __forceinline__ void store_row_stats(const Params &p, const RowStats &s, int sl, float *Lb,
                                                float *Db, int *Qob, int *Lob, int *Ib)
{
    const int r = threadIdx.x;
    if (r < RQ) {
        Lb[sl * RQ + r] = s.ok ? s.lse * LOG2E : -INFINITY;
        Db[sl * RQ + r] = s.ok ? s.di : 0.0f;
        Qob[sl * RQ + r] = s.qo;
        Lob[sl * RQ + r] = ctx_lo(s.anc, s.ds, p.W, s.qo);
    }
    if (r == 0 && Ib)
        Ib[4 * sl] = s.b, Ib[4 * sl + 1] = s.anc, Ib[4 * sl + 2] = s.ds, Ib[4 * sl + 3] = s.ch;
}
template <int RQ, int NTHR>
__device__ __forceinline__ void stage_row_stats(const Params &p, int b, int g, int ch, int s,
                                                float *Lb, float *Db, int *Qob, int *Lob)
{
    store_row_stats<RQ>(p, load_row_stats<RQ, NTHR>(p, b, g, ch), s, Lb, Db, Qob, Lob, NULL);
}

constexpr int TKQ = 32, NSPL = 2; // NSPL: dflash_attn/common.cuh's WG_NSPL says why 2
constexpr int TK4 = 128; // keys per context tile of dkv4_kernel (and of the wgmma pass's lists)
constexpr int TKR = 32; // keys per tile of the forward with 32 rows per warp (fwd_r32_kernel)
template <int D> constexpr size_t fwdr_smem() { return (size_t)2 * 2 * TKR * (D + 8) * 2 + 2 * CHUNK_ROWS * 8; }
template <int D> constexpr size_t dq3_smem() { return (size_t)2 * 2 * TKQ * (D + 8) * 2; }

// ---- mma_bwd.cu, mma_dqs.cu ----
// The one-stage backward's dS^T store (dsd): per (block, kv head, row chunk)
// maxt + 1 slots of [TKM keys][RQ rows] bf16: the context tiles of the
// block's span (slot t: key tile lo0 / TKM + t), then its block-key tile
// (slot maxt; block_size <= TKM; unused where dq_dsd_kernel computes the block
// keys itself, FOLD). Keys a slot's CTA does not reach (past S, past the
// block's keys) are left unwritten; dq_dsd_kernel zero-fills them.
__host__ __device__ inline int dsd_maxt(int S, int W)
{
    int m = (S + TKM - 1) / TKM; // a span [lo0, anc) within [0, S)
    if (W > 0) {                 // at most W - 1 keys
        int w = (W + TKM - 1) / TKM + 1;
        m = w < m ? w : m;
    }
    return m > 0 ? m : 0;
}
__host__ __device__ inline size_t dsd_slot(const Params &p, int b, int g, int ch, int t)
{
    return (((size_t)b * p.nch + ch) * p.nkv + g) * (size_t)(dsd_maxt(p.S, p.W) + 1) + t;
}
// dQ from the stored dS^T (dq_dsd_kernel; fold: with the block keys' dK / dV,
// one row chunk per block). 0, -ENOTSUP (shared memory) or -EIO.
int dq_dsd_launch(const Params &p, int D, cudaStream_t st, const uint16_t *dsd, bool fold);

// ---- mma_fwd.cu ----
// The dQ pass on dq_mma2_kernel, its CTAs in order's order (LPT) where given.
int dq_mma2_run(const Params &p, int D, cudaStream_t st, const int *order);
// order: the dQ items longest-first (dq_order_kernel; one CTA).
int dq_order_run(const Params &p, cudaStream_t st, int *order);

// ---- mma_dkvr.cu ----
// The context dK/dV pass of the 99 KiB parts on dkvr_kernel (64-key tiles of
// tile_lists_launch's lists at TKM, their LPT order; the NSPL fp32 partials;
// dsd: the dS^T store, or NULL). 0, -ENOTSUP (shared memory) or -EIO.
int dkvr_launch(const Params &p, int D, cudaStream_t st, float *part, uint16_t *dsd, const int *cnt,
                const int *lst, const int *order, int nct);

// ---- mma_dkv4.cu ----
// dkv4_kernel's dynamic shared memory at head dim D (64 or 128).
size_t dkv4_smem_bytes(int D);
// The per-tile lists of the valid blocks whose context span meets each of
// the nct tiles of tk keys (cnt[t], lst[t * nb ..], ascending) and the
// tiles by descending count (order); pdl: as programmatic dependents. 0 or -EIO.
int tile_lists_launch(const Params &p, cudaStream_t st, int nct, int tk, int *cnt, int *lst, int *order, bool pdl);
// The context dK/dV pass on dkv4_kernel into the NSPL fp32 partials. 0, -ENOTSUP (shared memory) or -EIO.
int dkv4_launch(const Params &p, int D, cudaStream_t st, float *part, const int *cnt, const int *lst,
                const int *order, int nct);

} // namespace df_dflash

#endif
