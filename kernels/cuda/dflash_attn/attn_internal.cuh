// dflash_attn/attn_internal.cuh - what the drafter attention's dispatcher
// (dispatch.cu), its CUDA-core reference (simt.cu) and its mma.sync kernels
// (mma_fwd.cu, mma_bwd.cu, mma_dqs.cu) share: the launch macros, small device helpers, the workspace's
// parts and each file's entry points. Internal: not part of the
// dflash_attn.h contract.
#ifndef DF_DFLASH_ATTN_INTERNAL_CUH
#define DF_DFLASH_ATTN_INTERNAL_CUH

#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../bf16.cuh"
#include "../device.h"
#include "../dflash_attn.h"
#include "../ptx_async.cuh"
#include "common.cuh"

namespace df_dflash {

// Threads and warps of the CUDA-core kernels and of the small ones (Di, the
// tile lists, the split reduction); rows of a row chunk.
constexpr int NT = 256, NW = 8, RQ = CHUNK_ROWS;
constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;

__device__ __forceinline__ float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Is key (context index j, or block offset j) visible to a row?
__device__ __forceinline__ bool visible(bool isctx, int j, int nk_end, int lo, int qo, int W)
{
    if (j >= nk_end)
        return false;
    return isctx ? j >= lo : (W == 0 || j <= qo);
}

inline Params make_params(const df_cuda_dflash_args *a)
{
    Params p;
    p.S = a->S, p.nb = a->n_blocks, p.bs = a->block_size, p.W = a->window;
    p.nq = a->nq, p.nkv = a->nkv, p.group = a->nq / a->nkv;
    p.nch = (p.bs * p.group + RQ - 1) / RQ;
    p.scale = a->scale;
    p.anchor = a->anchor, p.doc_start = a->doc_start, p.valid = a->valid;
    p.q = a->q, p.kc = a->kc, p.vc = a->vc, p.kb = a->kb, p.vb = a->vb;
    p.out = a->out, p.dout = a->dout, p.o = a->out;
    p.dq = a->dq, p.dkc = a->dkc, p.dvc = a->dvc, p.dkb = a->dkb, p.dvb = a->dvb;
    p.lse = a->lse, p.lse_in = a->lse, p.Di = NULL;
    return p;
}

#define CU(x)                                                                            \
    do {                                                                                 \
        cudaError_t e_ = (x);                                                            \
        if (e_ != cudaSuccess) {                                                         \
            fprintf(stderr, "dflash_attn: %s: %s (%s:%d)\n", #x, cudaGetErrorString(e_), \
                    __FILE__, __LINE__);                                                 \
            return -EIO;                                                                 \
        }                                                                                \
    } while (0)
// fn's dynamic shared memory opt-in, within what the device (or
// DFLASH_PORTABLE=1) allows: returns -ENOTSUP / -EIO from the caller otherwise
#define SMEM(fn, bytes)                                                  \
    do {                                                                 \
        int smem_rc_ = df_cuda_func_smem((const void *)(fn), (bytes));   \
        if (smem_rc_)                                                    \
            return smem_rc_;                                             \
    } while (0)

// Records pass event i (args.pass_events) on the stream, if asked for.
#define REC(ev, i, st)                                   \
    do {                                                 \
        if (ev)                                          \
            CU(cudaEventRecord((ev)[i], st));            \
    } while (0)

// ---- simt.cu (impl SIMT) ----
int simt_fwd_launch(const Params &p, int D, cudaStream_t st);
int simt_bwd_launch(const Params &p, int D, cudaStream_t st); // needs p.Di

// ---- mma_fwd.cu, mma_bwd.cu (impl MMA4; WG2 / WG2F / WG3 call it for the passes they share) ----
// Di = dO . O per (row, head) into p.Di.
int di_launch(const Params &p, int D, cudaStream_t st);
int mma_fwd_launch(const Params &p, int D, cudaStream_t st);
// The backward of MMA4 (wg2 false) and of WG2 / WG2F (wg2; fold) / WG3 (dsb):
// mma_bwd.cu's bwd_mma4_launch says which passes run where. part, lists,
// dq_order, dsd: the workspace's parts below.
int mma_bwd_launch(const Params &p, int D, cudaStream_t st, float *part, int *lists, int *dq_order, bool wg2,
                   bool fold, cudaEvent_t *ev, const DsBuf *dsb, uint16_t *dsd);
// The backward workspace, in this order: Di, the context dK/dV partials, the
// tile lists, the dQ item order, WG3's stored dS (wg3_bytes, dsb_bytes of it
// the block tiles'), the one-stage backward's dS^T (dsd_bytes); each part's
// bytes for args a (0 where the implementation a selects has none).
size_t di_bytes(const df_cuda_dflash_args *a);
size_t part_bytes(const df_cuda_dflash_args *a);
size_t list_bytes(const df_cuda_dflash_args *a);
size_t order_bytes(const df_cuda_dflash_args *a);
size_t dsb_bytes(const df_cuda_dflash_args *a);
size_t wg3_bytes(const df_cuda_dflash_args *a);
size_t dsd_bytes(const df_cuda_dflash_args *a);
// whether WG3's stored dS runs in block ranges (args.ds_ranges with ds_off and ds_bounds)
inline bool ds_ranged(const df_cuda_dflash_args *a)
{
    return a->ds_off && a->ds_ranges > 1 && a->ds_bounds;
}

} // namespace df_dflash

#endif
