// dflash_attn/dispatch.cu - the DFlash drafter attention on the GPU (contract in
// dflash_attn.h and train_ops.h; the CPU reference is kernels/cpu/dflash_attn.c).
//
// FlashAttention-2 structure. Five implementations (args.impl; the table in
// kernels/README.md): simt, the CUDA cores (fp32 FMA from shared memory, 256
// threads = 8 warps: the plain reference on the GPU, simt.cu); mma4, tensor
// cores (mma.sync m16n8k16 bf16, sm_80+; the default on devices other than
// compute capability 9.0, mma_fwd.cu / mma_bwd.cu); wg2, wg2f and wg3, Hopper warpgroup MMA
// (wgmma, sm_90a; wg2's forward and wg3's backward the defaults on compute
// capability 9.0, wg_*.cu). The tensor-core kernels follow the CUDA-core
// kernels' work split and determinism. The retired ids (2, 3, 4, 6, 7) are
// refused; docs/log/ has their history.
//
// Rows. A "row chunk" is up to RQ = 64 query rows of ONE block b and ONE kv
// head g: the block's bs x group (query offset qo, head of the group hh)
// rows, row r = qo * group + hh. They share the anchor and document start, so
// the block-sparse structure is by construction: a chunk visits only the
// context keys [lo0, anchor) (lo0 = max(doc_start, anchor - (W-1)), the span
// of its widest row qo = 0) in tiles of TK = 32 keys, then its own block's
// keys. Per-key masking inside a tile is one compare per (row, key) (the
// window's per-row lower bound, the end of the range, in-block causality).
// Warp w owns rows w + 8 i (i < 8); in the score phase lane = key of the tile,
// so the online softmax of a row is a warp reduction held in registers; in
// the accumulate phase lane = head dim (d = lane + 32 k).
//
// Forward: one CTA per (block, kv head, row chunk): S = Q K^T, online softmax
// (fp32 m, l per row), O += P V; out = O / l (bf16), lse = m + log l.
// Backward (recompute P from lse, no atomics, deterministic):
//   1. Di = dO . O per (row, head), fp32 workspace.
//   2. dQ: one CTA per (block, kv head, row chunk), the forward's key loop:
//      dS = P (dO V^T - Di), dq = scale dS K.
//   3. dK/dV: one CTA per (kv head, key tile). Context tiles: every valid
//      block (ascending) whose span meets the tile, all its row chunks (the
//      transposed visibility). Block tiles: the block's own rows. dv = P^T dO,
//      dk = scale dS^T Q, summed in fp32 in a fixed order, written once.
// Padding blocks: out 0, lse -inf, dq/dkb/dvb 0; rows with nothing visible
// likewise (never NaN).
// mma4 (described before its kernels in mma.cuh): the forward (fwd_r32_kernel),
// Di, dQ (dq_mma2_kernel) and the block-key dK/dV (dkv_mma2_kernel) in
// cp.async-pipelined mma.sync kernels; the context dK/dV with 128-key tiles
// over per-tile block lists (dkv4_kernel); the split reduction. wg2 (its
// forward the default on compute capability 9.0) is mma4 with its forward
// (dflash_attn/wg_fwd.cu), its dQ pass (dflash_attn/wg_dq.cu, blocks last to
// first) and its context dK/dV pass (dflash_attn/wg_dkv.cu) on wgmma; where
// sm_90a is not there, fwd_r32_kernel, dq_mma2_kernel in longest-first order
// (dq_order_kernel) and dkv4_kernel. wg2f (the
// backward's default on compute capability 9.0) is wg2 with Di and the
// block-key dK/dV computed inside the wgmma dQ pass where one row chunk holds
// a block's rows per kv head (nch == 1): no di_kernel, no block-tile
// dkv_mma2_kernel; elsewhere wg2 exactly. wg3 is wg2f whose context dK/dV
// pass also stores dS, from which dQ is computed (wg_dqs.cu). Where dkv4_kernel
// does not fit the shared memory (sm_80, sm_86 / 89 / 120), mma4's backward
// is dkv_mma2_kernel for every key tile storing dS^T, then dQ from it
// (mma_bwd.cu, bwd_mma2_launch).
// The files: this one (the choice, the workspace, the knobs, the entry
// points), simt.cu, mma_fwd.cu / mma_bwd.cu / mma_dqs.cu, wg_fwd.cu / wg_dq.cu / wg_dkv.cu / wg_blk.cu / wg_dqs.cu
// (Hopper); what they share: attn_internal.cuh, common.cuh.
#include "attn_internal.cuh"
#include "knobs.h"

namespace {
using namespace df_dflash;

// Which forward runs when args.impl == 0: WG2's on compute capability 9.0,
// MMA4's (fwd_r32_kernel) elsewhere.
#define DF_CUDA_DFLASH_IMPL_DEFAULT_FWD DF_CUDA_DFLASH_IMPL_MMA4
#define DF_CUDA_DFLASH_IMPL_DEFAULT_FWD_SM90 DF_CUDA_DFLASH_IMPL_WG2
// Which backward runs when args.impl == 0: WG3 on compute capability 9.0
// (the fastest measured at the 27B drafter shape: DESIGN.md; WG2F exactly
// where WG3's shapes do not fit), MMA4 elsewhere.
#define DF_CUDA_DFLASH_IMPL_DEFAULT_BWD DF_CUDA_DFLASH_IMPL_MMA4
#define DF_CUDA_DFLASH_IMPL_DEFAULT_BWD_SM90 DF_CUDA_DFLASH_IMPL_WG3

// Whether impl is 0 (the defaults) or an implementation this file has. The
// retired values (DF_CUDA_DFLASH_IMPL_* 2, 3, 4, 6, 7) are not.
bool impl_known(int impl)
{
    return impl == 0 || impl == DF_CUDA_DFLASH_IMPL_SIMT || impl == DF_CUDA_DFLASH_IMPL_MMA4 ||
           impl == DF_CUDA_DFLASH_IMPL_WG2 || impl == DF_CUDA_DFLASH_IMPL_WG2F || impl == DF_CUDA_DFLASH_IMPL_WG3;
}

int check_args(const df_cuda_dflash_args *a, bool bwd)
{
    if (!a || a->S < 0 || a->n_blocks < 0 || a->block_size < 1 || a->window < 0 || a->nq < 1 ||
        a->nkv < 1 || a->nq % a->nkv || (a->head_dim != 64 && a->head_dim != 128) ||
        !(a->scale > 0.0f) || isinf(a->scale) || !impl_known(a->impl))
        return -EINVAL;
    if (!a->anchor || !a->doc_start || !a->valid || !a->q || !a->kc || !a->vc || !a->kb ||
        !a->vb || !a->out || !a->lse)
        return -EINVAL;
    if (bwd && (!a->dout || !a->dq || !a->dkc || !a->dvc || !a->dkb || !a->dvb))
        return -EINVAL;
    return 0;
}

// The forward of impl: SIMT's, the wgmma one (WG2, WG2F, WG3) where the
// device runs it and its tensor maps can be made, else MMA4's.
int fwd_launch(const Params &p, int D, cudaStream_t st, int impl)
{
    if (impl == DF_CUDA_DFLASH_IMPL_SIMT)
        return simt_fwd_launch(p, D, st);
    if ((impl == DF_CUDA_DFLASH_IMPL_WG2 || impl == DF_CUDA_DFLASH_IMPL_WG2F || impl == DF_CUDA_DFLASH_IMPL_WG3) &&
        (long long)p.nb * p.nkv * p.nch > 0 && fwd_wg_usable(D)) {
        int rc = fwd_wg_launch(p, D, st);
        if (rc != -EOPNOTSUPP) // (no tensor maps for these tensors: MMA4's below)
            return rc;
    }
    return mma_fwd_launch(p, D, st);
}

} // namespace

extern "C" size_t df_cuda_dflash_bwd_workspace_bytes(const df_cuda_dflash_args *a)
{
    if (!a)
        return 0;
    size_t n = di_bytes(a) + part_bytes(a) + list_bytes(a) + order_bytes(a) + wg3_bytes(a) + dsd_bytes(a);
    return n ? n : 4;
}

extern "C" int64_t df_cuda_dflash_ds_offsets(const int32_t *anchor, const int32_t *doc_start,
                                             const uint8_t *valid, int n_blocks, int window, int32_t *off)
{
    // the tiles t of a span [lo0, anchor) (lo0 = ctx_lo(.., 0), the widest row's bound) that
    // WG3's stores use: lo0 / 128 .. (anchor - 1) / 128
    constexpr int T = df_dflash::WG_TILE_KEYS;
    int64_t t = 0;
    for (int b = 0; b < n_blocks; b++) {
        off[b] = (int32_t)t;
        if (!valid[b])
            continue;
        int anc = anchor[b], lo = doc_start[b];
        if (window > 0 && anc - (window - 1) > lo)
            lo = anc - (window - 1);
        if (lo < anc)
            t += (anc - 1) / T - lo / T + 1;
    }
    return t;
}

extern "C" int df_cuda_dflash_ds_ranges(const int32_t *off, int n_blocks, int64_t total, int nkv,
                                        size_t range_bytes, int32_t *bounds, int64_t *max_tiles)
{
    static_assert(DF_CUDA_DFLASH_DS_MAX_RANGES == df_dflash::DS_MAX_RANGES, "one counter per range");
    const size_t rb = range_bytes ? range_bytes : DF_CUDA_DFLASH_DS_RANGE_BYTES;
    int64_t cap = (int64_t)(rb / ((size_t)(nkv > 0 ? nkv : 1) * df_dflash::DS_TILE_BYTES));
    if (cap * DF_CUDA_DFLASH_DS_MAX_RANGES < total) // at most the counters' ranges
        cap = (total + DF_CUDA_DFLASH_DS_MAX_RANGES - 1) / DF_CUDA_DFLASH_DS_MAX_RANGES;
    for (;;) {
        int nr = 0;
        int64_t cur = 0, most = 0;
        bounds[0] = 0;
        for (int b = 0; b < n_blocks; b++) {
            int64_t t = (b + 1 < n_blocks ? off[b + 1] : total) - off[b];
            if (cur > 0 && cur + t > cap) {
                if (++nr == DF_CUDA_DFLASH_DS_MAX_RANGES)
                    break;
                bounds[nr] = b;
                cur = 0;
            }
            cur += t;
            most = cur > most ? cur : most;
        }
        if (nr < DF_CUDA_DFLASH_DS_MAX_RANGES) {
            bounds[++nr] = n_blocks;
            *max_tiles = most;
            return nr;
        }
        cap += cap / 8 + 1; // (a greedy cut can need a few more ranges than total / cap)
    }
}

namespace {
int g_bwd_impl; // df_cuda_dflash_set_bwd_impl; 0: none

// DFLASH_ATTN_BWD (0: unset, or a bad value, which the knob warns of: the
// retired names mma, mma2, mma3, mma5, wg among them). The implementations
// in the order of the knob's words (knobs.h).
int env_bwd_impl()
{
    static const int impl[] = {DF_CUDA_DFLASH_IMPL_SIMT, DF_CUDA_DFLASH_IMPL_MMA4, DF_CUDA_DFLASH_IMPL_WG2,
                               DF_CUDA_DFLASH_IMPL_WG2F, DF_CUDA_DFLASH_IMPL_WG3};
    const int i = df_knob_int(DF_KNOB_ATTN_BWD);
    return i >= 0 && i < (int)(sizeof impl / sizeof impl[0]) ? impl[i] : 0;
}
} // namespace

extern "C" int df_cuda_dflash_set_bwd_impl(int impl)
{
    if (!impl_known(impl))
        return -EINVAL;
    g_bwd_impl = impl;
    return 0;
}

extern "C" int df_cuda_dflash_bwd_impl(void)
{
    if (g_bwd_impl)
        return g_bwd_impl;
    int e = env_bwd_impl();
    if (e)
        return e;
    // the built-in default of the current device
    return df_cuda_hopper_kernels() ? DF_CUDA_DFLASH_IMPL_DEFAULT_BWD_SM90 : DF_CUDA_DFLASH_IMPL_DEFAULT_BWD;
}

extern "C" int df_cuda_dflash_fwd_impl(void)
{
    return df_cuda_hopper_kernels() ? DF_CUDA_DFLASH_IMPL_DEFAULT_FWD_SM90 : DF_CUDA_DFLASH_IMPL_DEFAULT_FWD;
}

extern "C" const char *df_cuda_dflash_impl_name(int impl)
{
    switch (impl) {
    case DF_CUDA_DFLASH_IMPL_SIMT:
        return "simt";
    case DF_CUDA_DFLASH_IMPL_MMA4:
        return "mma4";
    case DF_CUDA_DFLASH_IMPL_WG2:
        return "wg2";
    case DF_CUDA_DFLASH_IMPL_WG2F:
        return "wg2f";
    case DF_CUDA_DFLASH_IMPL_WG3:
        return "wg3";
    }
    return "?";
}

extern "C" int df_cuda_dflash_fwd(const df_cuda_dflash_args *a, cudaStream_t st)
{
    int rc = check_args(a, false);
    if (rc)
        return rc;
    Params p = make_params(a);
    int impl = a->impl ? a->impl : df_cuda_dflash_fwd_impl();
    return fwd_launch(p, a->head_dim, st, impl);
}

extern "C" int df_cuda_dflash_bwd(const df_cuda_dflash_args *a, cudaStream_t st)
{
    int rc = check_args(a, true);
    if (rc)
        return rc;
    Params p = make_params(a);
    void *ws = a->workspace;
    if (!ws)
        CU(cudaMallocAsync(&ws, df_cuda_dflash_bwd_workspace_bytes(a), st));
    p.Di = (float *)ws;
    int impl = a->impl ? a->impl : df_cuda_dflash_bwd_impl();
    if (impl == DF_CUDA_DFLASH_IMPL_SIMT) {
        rc = simt_bwd_launch(p, a->head_dim, st);
    } else { // MMA4, WG2, WG2F
        float *part = (float *)((char *)ws + di_bytes(a));
        int *lists = (int *)((char *)part + part_bytes(a));
        int *dq_order = (int *)((char *)lists + list_bytes(a));
        bool wg3 = impl == DF_CUDA_DFLASH_IMPL_WG3;
        bool fold = impl == DF_CUDA_DFLASH_IMPL_WG2F || wg3; // WG2 with the fold
        bool wg2 = impl == DF_CUDA_DFLASH_IMPL_WG2 || fold;
        df_dflash::DsBuf dsb; // WG3's stored dS (used where the shapes allow: bwd_mma4_launch)
        dsb.ctr = (int *)((char *)dq_order + order_bytes(a)); // (256 bytes)
        dsb.dsb = (uint16_t *)((char *)dsb.ctr + 256);
        dsb.ds = (uint16_t *)((char *)dsb.dsb + dsb_bytes(a));
        dsb.maxt = df_dflash::dqs_max_tiles(a->S, a->window);
        dsb.off = a->ds_off;
        dsb.b0 = 0, dsb.b1 = a->n_blocks, dsb.first = dsb.last = 1;
        dsb.bounds = ds_ranged(a) ? a->ds_bounds : NULL;
        dsb.nranges = ds_ranged(a) ? a->ds_ranges : 1;
        dsb.part = NULL; // (bwd_mma4_launch sets it)
        dsb.pdl = df_knob_int(DF_KNOB_ATTN_PDL) != 0; // WG3's later kernels as programmatic dependents
        cudaEvent_t *ev = a->pass_events;
        const df_dflash::DsBuf *dp = wg3 ? &dsb : NULL;
        // the one-stage backward's dS^T store, last (NULL where it does not run)
        uint16_t *dsd = dsd_bytes(a) ? (uint16_t *)((char *)dsb.ctr + wg3_bytes(a)) : NULL;
        rc = mma_bwd_launch(p, a->head_dim, st, part, lists, dq_order, wg2, fold, ev, dp, dsd);
    }
    if (!a->workspace)
        CU(cudaFreeAsync(ws, st));
    return rc;
}
