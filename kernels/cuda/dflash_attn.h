/* dflash_attn.h - the DFlash drafter attention on the GPU, forward and
 * backward: the same contract as df_op_dflash_attn / _bwd (train_ops.h),
 * on device pointers, bf16 activations. Every matrix is contiguous
 * row-major: q, out, dout, dq [n_blocks*bs, nq*D]; kc, vc, dkc, dvc
 * [S, nkv*D]; kb, vb, dkb, dvb [n_blocks*bs, nkv*D]; lse [n_blocks*bs, nq]
 * fp32. anchor, doc_start (int32) and valid (uint8) [n_blocks] are device
 * arrays. bf16 values are raw uint16_t bits. Softmax, accumulation and lse
 * are fp32; gradients are summed in fp32 and rounded to bf16 once.
 * Deterministic (no atomics). head_dim: 64 or 128. Returns 0, -EINVAL on bad
 * arguments (nothing launched), -EIO on a CUDA error. Asynchronous on stream. */
#ifndef DF_CUDA_DFLASH_ATTN_H
#define DF_CUDA_DFLASH_ATTN_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct df_cuda_dflash_args {
    int S, n_blocks, block_size, window; /* window 0: full layer */
    int nq, nkv, head_dim;
    float scale;
    const int32_t *anchor, *doc_start;
    const uint8_t *valid;
    const uint16_t *q, *kc, *vc, *kb, *vb; /* inputs (bf16) */
    uint16_t *out;                         /* forward output (bf16); backward input */
    float *lse;                            /* forward output; backward input */
    const uint16_t *dout;                  /* backward input */
    uint16_t *dq, *dkc, *dvc, *dkb, *dvb;  /* backward outputs */
    /* backward scratch, df_cuda_dflash_bwd_workspace_bytes() bytes; NULL:
     * allocated stream-ordered inside (cudaMallocAsync). */
    void *workspace;
    /* implementation of the forward and the backward: 0 = the defaults
     * (tensor cores: mma.sync bf16, P and dS rounded to bf16 before their
     * products), DF_CUDA_DFLASH_IMPL_SIMT (CUDA cores, fp32 FMA) or
     * DF_CUDA_DFLASH_IMPL_MMA (tensor cores, the first version) or
     * DF_CUDA_DFLASH_IMPL_MMA2 (tensor cores, cp.async-pipelined, ldmatrix,
     * split dK/dV, 64-key dK/dV tiles; the default) or
     * DF_CUDA_DFLASH_IMPL_MMA3 (MMA2 with 128-key dK/dV tiles, 8 warps:
     * correct but 8% slower at the 27B shape; its forward is MMA2's) or
     * DF_CUDA_DFLASH_IMPL_MMA4 (MMA2's forward, dQ and block-key dK/dV; the
     * context dK/dV with 128-key tiles, 8 warps, P and dS through shared
     * memory, per-tile block lists in longest-first order) or
     * DF_CUDA_DFLASH_IMPL_MMA5 (MMA4's backward with its dQ CTAs launched
     * longest span first, from an order built on the device; gradients
     * bitwise MMA4's; its forward is MMA2's) or DF_CUDA_DFLASH_IMPL_WG
     * (MMA4's backward with its context dK/dV pass on Hopper warpgroup MMA,
     * wgmma, kernels/cuda/dflash_attn_wg.cu; on a device other than
     * compute capability 9.0, or a build without the sm_90a target, it falls
     * back to MMA4's kernel, gradients then bitwise MMA4's; its forward is
     * MMA2's) or DF_CUDA_DFLASH_IMPL_WG2 (wgmma in both passes
     * where it exists. Forward: kernels/cuda/dflash_attn_wg_fwd.cu, MMA2's
     * work split on wgmma. Backward: WG's with its dQ pass on wgmma too,
     * kernels/cuda/dflash_attn_wg_dq.cu, its CTAs in MMA5's longest-first
     * order. Each wgmma kernel falls back to MMA2's forward / MMA5's dQ /
     * MMA4's context dK/dV where the device is not compute capability 9.0 or
     * the build has no sm_90a target; its dQ need not be bitwise WG's, as
     * its 64-key dQ tiles may sum in another order, yet on the H200 at the
     * 27B drafter shape forward and gradients were bitwise WG's) or
     * DF_CUDA_DFLASH_IMPL_WG2F (WG2 with Di and the block-key dK/dV
     * computed inside its wgmma dQ pass where a block's rows of a kv head
     * fit one 64-row chunk, block_size x nq / nkv <= 64, no separate Di and
     * block-tile kernels; dq, dkc, dvc expected bitwise WG2's, as its Di
     * sums in di_kernel's order; dkb, dvb not promised, but bitwise WG2's on
     * the H200 in every bench configuration; WG2 exactly elsewhere; its
     * forward is WG2's). Like every value, impl selects
     * the forward in df_cuda_dflash_attn_fwd and the backward in
     * df_cuda_dflash_attn_bwd independently: a caller may run WG2's forward
     * and another backward, or the reverse. With impl 0 the forward is
     * df_cuda_dflash_fwd_impl()'s (WG2 on a compute capability 9.0 device,
     * MMA2 elsewhere), and the backward is df_cuda_dflash_set_bwd_impl()'s
     * choice, else the environment's DFLASH_ATTN_BWD (simt, mma, mma2, mma3,
     * mma4, mma5, wg, wg2, wg2f; read once), else the built-in default: WG2F on a
     * compute capability 9.0 device (Hopper), MMA4 elsewhere. */
    int impl;
    /* backward only, for timing (tools/bench_dflash_attn); NULL: none.
     * DF_CUDA_DFLASH_BWD_EVENTS events (created by the caller) recorded on
     * the stream by the MMA2/3/4/5, WG, WG2 and WG2F backwards: [0] first, then
     * one after each pass: [1] Di, [2] dQ (with MMA5's / WG2's order), [3]
     * context tile lists, [4] context dK/dV, [5] block-key dK/dV, [6] the
     * split reduction. A pass
     * an implementation does not have (or does inside another) records its
     * event right after the previous one. Other implementations record none. */
    cudaEvent_t *pass_events;
} df_cuda_dflash_args;

enum { DF_CUDA_DFLASH_IMPL_SIMT = 1, DF_CUDA_DFLASH_IMPL_MMA = 2, DF_CUDA_DFLASH_IMPL_MMA2 = 3,
       DF_CUDA_DFLASH_IMPL_MMA3 = 4, DF_CUDA_DFLASH_IMPL_MMA4 = 5, DF_CUDA_DFLASH_IMPL_MMA5 = 6,
       DF_CUDA_DFLASH_IMPL_WG = 7, DF_CUDA_DFLASH_IMPL_WG2 = 8, DF_CUDA_DFLASH_IMPL_WG2F = 9 };
enum { DF_CUDA_DFLASH_BWD_EVENTS = 7 };

int df_cuda_dflash_attn_fwd(const df_cuda_dflash_args *a, cudaStream_t stream);
int df_cuda_dflash_attn_bwd(const df_cuda_dflash_args *a, cudaStream_t stream);
size_t df_cuda_dflash_bwd_workspace_bytes(const df_cuda_dflash_args *a);
/* The backward that args.impl == 0 runs, process-wide (tests, benchmarks):
 * one of the DF_CUDA_DFLASH_IMPL_* values, or 0 for the environment's
 * DFLASH_ATTN_BWD / the built-in default again. Returns 0 or -EINVAL. Not
 * synchronised with backwards running on other host threads. */
int df_cuda_dflash_set_bwd_impl(int impl);
/* The backward that args.impl == 0 runs now (never 0; the built-in default
 * depends on the current device). */
int df_cuda_dflash_bwd_impl(void);
/* The forward that args.impl == 0 runs on the current device (never 0). */
int df_cuda_dflash_fwd_impl(void);

#ifdef __cplusplus
}
#endif
#endif
