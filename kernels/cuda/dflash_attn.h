/* dflash_attn.h - the DFlash drafter attention on the GPU, forward and
 * backward: the same contract as df_op_dflash_attn / _bwd (train_ops.h),
 * on device pointers, bf16 activations. Every matrix is contiguous
 * row-major: q, out, dout, dq [n_blocks*bs, nq*D]; kc, vc, dkc, dvc
 * [S, nkv*D]; kb, vb, dkb, dvb [n_blocks*bs, nkv*D]; lse [n_blocks*bs, nq]
 * fp32. anchor, doc_start (int32) and valid (uint8) [n_blocks] are device
 * arrays. bf16 values are raw uint16_t bits. Softmax, accumulation and lse
 * are fp32; gradients are summed in fp32 and rounded to bf16 once.
 * Deterministic (no atomics). head_dim: 64 or 128. Returns 0, -EINVAL on bad
 * arguments (nothing launched), -EIO on a CUDA error. Asynchronous on stream.
 * Inputs must be finite in every row of kc / vc [0, S) and of kb / vb, the
 * rows no block sees included (padding blocks' keys, context keys past the
 * last anchor): the tensor-core kernels load whole tiles of keys (64
 * context keys, 16 or 64 block rows) and mask the scores, and a masked
 * score's P = 0 times a NaN / Inf value is NaN (FlashAttention's contract for
 * the keys of a tile past a causal bound is the same). The trainer's rows
 * are all real tokens' (padding blocks hold mask tokens). Zeroing those rows
 * in shared memory instead was tried and was slower
 * (docs/log/2026-12-01-session-12.md). */
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
    float scale; /* finite and > 0 (-EINVAL otherwise) */
    const int32_t *anchor, *doc_start;
    const uint8_t *valid;
    const uint16_t *q, *kc, *vc, *kb, *vb; /* inputs (bf16) */
    uint16_t *out;                         /* forward output (bf16); backward input */
    float *lse;                            /* forward output; backward input */
    const uint16_t *dout;                  /* backward input */
    uint16_t *dq, *dkc, *dvc, *dkb, *dvb;  /* backward outputs */
    /* backward scratch, df_cuda_dflash_bwd_workspace_bytes() bytes (asked
     * with the same args, impl included: with impl 0, under the same
     * df_cuda_dflash_set_bwd_impl choice); NULL: allocated stream-ordered
     * inside (cudaMallocAsync). */
    void *workspace;
    /* implementation of the forward and the backward: 0 = the defaults, or
     * DF_CUDA_DFLASH_IMPL_SIMT (CUDA cores, fp32 FMA: the plain reference on
     * the GPU) or DF_CUDA_DFLASH_IMPL_MMA4 (tensor cores, mma.sync bf16, P
     * and dS rounded to bf16 before their products, sm_80+: a cp.async-
     * pipelined, ldmatrix-fed forward (fwd_r32_kernel), Di, dQ and
     * block-key dK/dV; the context dK/dV with 128-key tiles, 8 warps, P and
     * dS through shared memory, per-tile block lists, heaviest tiles first)
     * or DF_CUDA_DFLASH_IMPL_WG2 (Hopper warpgroup MMA, wgmma, in each pass
     * where it exists: the forward (kernels/cuda/dflash_attn/wg_fwd.cu, MMA4's
     * work split), the dQ pass (kernels/cuda/dflash_attn/wg_dq.cu, its CTAs
     * longest span first) and the context dK/dV pass
     * (kernels/cuda/dflash_attn/wg_dkv.cu); Di, the tile lists, the block-key
     * dK/dV and the split reduction are MMA4's. Each wgmma kernel falls back
     * to MMA4's forward / dQ (in the same longest-first order) / context
     * dK/dV where the device is not compute capability 9.0 or the build has
     * no sm_90a target; the forward and dQ, whose K / V tiles come by TMA,
     * also where the tensor maps cannot be made: no driver entry point for
     * cuTensorMapEncodeTiled, or kc, vc, kb, vb not 16-byte aligned) or DF_CUDA_DFLASH_IMPL_WG2F (WG2 with Di and the
     * block-key dK/dV computed inside its wgmma dQ pass where a block's rows
     * of a kv head fit one 64-row chunk, block_size x nq / nkv <= 64, no
     * separate Di and block-tile kernels; dq, dkc, dvc expected bitwise
     * WG2's, as its Di sums in di_kernel's order; dkb, dvb not promised, but
     * bitwise WG2's on the H200 in every bench configuration; WG2 exactly
     * elsewhere; its forward is WG2's) or DF_CUDA_DFLASH_IMPL_WG3 (WG2F whose
     * context dK/dV pass also stores dS, from which a dQ kernel computes dQ
     * without computing S and dP again (kernels/cuda/dflash_attn/wg_dqs.cu),
     * where a block's rows of a kv head are one 64-row chunk, block_size
     * <= 16, the group a power of two >= 4 and the device is Hopper; WG2F
     * exactly elsewhere. Its workspace holds the dS of every block's widest
     * span: 16 KiB per (block, kv head, 128 context keys), ~2 GiB at the 27B
     * shape's full layers; with ds_off (below), the spans as they are (~1.3
     * GiB there at one document per row). dq is not bitwise WG2F's (its dS comes from the
     * dK/dV pass's S^T); dkc, dvc, dkb, dvb were, on the H200, in every
     * bench configuration. Its forward is WG2's). The other values (2, 3, 4, 6, 7: the
     * retired mma, mma2, mma3, mma5 and wg) are rejected with -EINVAL. Like
     * every value, impl selects the forward in df_cuda_dflash_fwd and
     * the backward in df_cuda_dflash_bwd independently: a caller may run
     * WG2's forward and another backward, or the reverse. With impl 0 the
     * forward is df_cuda_dflash_fwd_impl()'s (WG2 on a compute capability 9.0
     * device, MMA4 elsewhere), and the backward is
     * df_cuda_dflash_set_bwd_impl()'s choice, else the environment's
     * DFLASH_ATTN_BWD (simt, mma4, wg2, wg2f, wg3; read once; another name: a
     * warning on stderr, then the default), else the built-in default: WG3
     * on a compute capability 9.0 device (Hopper), MMA4 elsewhere. */
    int impl;
    /* backward only, for timing (tools/bench_dflash_attn); NULL: none.
     * DF_CUDA_DFLASH_BWD_EVENTS events (created by the caller) recorded on
     * the stream by the MMA4, WG2 and WG2F backwards: [0] first, then one
     * after each pass: [1] Di, [2] dQ (with WG2's order), [3] context tile
     * lists, [4] context dK/dV, [5] block-key dK/dV, [6] the split
     * reduction. A pass an implementation does not have (or does inside
     * another) records its event right after the previous one. SIMT records
     * none. */
    cudaEvent_t *pass_events;
    /* backward, WG3 only (others ignore them): where each block's stored dS
     * begins, in 128-key tiles (device int32 [n_blocks], from
     * df_cuda_dflash_ds_offsets on the host copies of anchor, doc_start and
     * valid), and ds_tiles, its return value. The workspace then holds each
     * block's span as it is rather than every span at its widest (~half at
     * one document per row). NULL: the widest. */
    const int32_t *ds_off;
    int64_t ds_tiles;
    /* With ds_off, WG3's context dK/dV and dQ passes may run once per range
     * of blocks, so that the store holds one range's tiles at a time:
     * ds_ranges ranges, ds_bounds (host memory, ds_ranges + 1 block indices,
     * read during df_cuda_dflash_bwd) and ds_range_tiles (the most tiles of a
     * range), from df_cuda_dflash_ds_ranges. dQ the same bits as one range; dK, dV
     * summed per range (within fp32 rounding of one range).
     * 0: one range. */
    int ds_ranges;
    const int32_t *ds_bounds;
    int64_t ds_range_tiles;
} df_cuda_dflash_args;

/* The values never change (logs and bench results print them); the gaps are
 * the retired implementations' (docs/log/ has their history). */
enum { DF_CUDA_DFLASH_IMPL_SIMT = 1, DF_CUDA_DFLASH_IMPL_MMA4 = 5, DF_CUDA_DFLASH_IMPL_WG2 = 8,
       DF_CUDA_DFLASH_IMPL_WG2F = 9, DF_CUDA_DFLASH_IMPL_WG3 = 10 };
enum { DF_CUDA_DFLASH_BWD_EVENTS = 7 };

int df_cuda_dflash_fwd(const df_cuda_dflash_args *a, cudaStream_t stream);
int df_cuda_dflash_bwd(const df_cuda_dflash_args *a, cudaStream_t stream);
size_t df_cuda_dflash_bwd_workspace_bytes(const df_cuda_dflash_args *a);
/* df_cuda_dflash_args.ds_off from host arrays: off[b] = the 128-key
 * context tiles that the spans of the blocks before b meet (a valid block
 * b's span is [doc_start, anchor) on a full layer, its widest row's on a
 * sliding one: window > 0), for n_blocks blocks; returns the total. */
int64_t df_cuda_dflash_ds_offsets(const int32_t *anchor, const int32_t *doc_start,
                                  const uint8_t *valid, int n_blocks, int window, int32_t *off);
/* The block ranges of args.ds_ranges: consecutive blocks whose stored dS
 * (nkv x 16 KiB per tile) fits range_bytes (0: DF_CUDA_DFLASH_DS_RANGE_BYTES;
 * a block larger than that alone), at most DF_CUDA_DFLASH_DS_MAX_RANGES
 * (the ranges grow to stay within it). off, total: df_cuda_dflash_ds_offsets'.
 * bounds: DF_CUDA_DFLASH_DS_MAX_RANGES + 1 ints; *max_tiles: the most tiles
 * of a range. Returns the number of ranges (1: the store as one). */
enum { DF_CUDA_DFLASH_DS_MAX_RANGES = 64 };
#define DF_CUDA_DFLASH_DS_RANGE_BYTES ((size_t)320 << 20)
int df_cuda_dflash_ds_ranges(const int32_t *off, int n_blocks, int64_t total, int nkv,
                             size_t range_bytes, int32_t *bounds, int64_t *max_tiles);
/* The backward that args.impl == 0 runs, process-wide (tests, benchmarks):
 * one of the DF_CUDA_DFLASH_IMPL_* values, or 0 for the environment's
 * DFLASH_ATTN_BWD / the built-in default again. Returns 0, or -EINVAL for
 * any other value (a retired implementation's included). Not
 * synchronised with backwards running on other host threads. */
int df_cuda_dflash_set_bwd_impl(int impl);
/* The backward that args.impl == 0 runs now (never 0; the built-in default
 * depends on the current device). */
int df_cuda_dflash_bwd_impl(void);
/* The forward that args.impl == 0 runs on the current device (never 0). */
int df_cuda_dflash_fwd_impl(void);
/* An implementation's name (simt, mma4, wg2, wg2f, wg3; "?" for another value). */
const char *df_cuda_dflash_impl_name(int impl);

#ifdef __cplusplus
}
#endif
#endif
