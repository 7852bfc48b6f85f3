/* lmhead_cuda.h - the fused frozen LM head + weighted cross-entropy on the
 * GPU (df_op_lmhead_ce's contract, train_ops.h; CPU reference
 * kernels/cpu/lmhead_ce.c), as the CUDA backend's implementation.
 *
 * h [N, H] and dh [N, H] are BF16 activations, head [V, H] a BF16 weight,
 * all device memory; label [N] (int32), weight [N] (F32, may be NULL),
 * argmax [N] and ce [N] (may be NULL) are DEVICE arrays; loss_sum is a HOST
 * double (may be NULL): it is added to after the stream is synchronized.
 * Labels are not range-checked by the dispatch on a device backend: a row
 * with label < 0 or label >= V (or weight not > 0) is ignored (ce 0, dh 0,
 * no loss), never read out of bounds. Its argmax is still computed.
 * Arguments are otherwise as validated by kernels/train_ops.c.
 *
 * Deterministic: fixed-shape reductions, no atomics; the cuBLASLt algorithm
 * for a shape is chosen once and reused. Returns 0, -ENOMEM (scratch),
 * -ENOTSUP (an h/head row stride below H with more than one row), or -EIO
 * (a CUDA / cuBLASLt error, logged). Enqueued on df_cuda_stream(be); only a
 * non-NULL loss_sum makes the call wait for the stream. */
#ifndef DF_CUDA_LMHEAD_CUDA_H
#define DF_CUDA_LMHEAD_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "backend_internal.h"

/* df_cuda_lmhead_ce: declared from op_list.h (backend_internal.h). */

/* Test hook: the bound on the per-chunk buffers (logits, and with dh the
 * low halves of the gradient and an fp32 dh chunk) in bytes; 0 restores the
 * default (1 GiB). Process-wide; meant for tests that force many chunks. */
void df_cuda_lmhead_ce_set_chunk_bytes(size_t bytes);

/* Test hooks of DF_CE_FP8_GRAD on the E4M3 tensor cores: 0 makes the row
 * kernel write G as bf16 and GEMM 2 round it (as at a class's first chunk);
 * 1 (default) lets the row kernel write G's codes straight into GEMM 2's
 * operand once that class has passed its check (the same bits).
 * df_cuda_lmhead_ce_fp8_fused: the chunks that did, process-wide. */
void df_cuda_lmhead_ce_set_fp8_codes(int on);
int64_t df_cuda_lmhead_ce_fp8_fused(void);
/* Chunks that DF_CE_FP8_ONEPASS computed in one pass (lmhead_onepass.cu),
 * process-wide; the others ran as without it (train_ops.h allows that). */
int64_t df_cuda_lmhead_ce_onepass_chunks(void);
/* Test hooks of the chunking: 1 puts GEMM 1 on the BF16 path (as where the E4M3
 * plan refuses a chunk: with DF_CE_F16_LOGITS such a chunk runs half the rows);
 * df_cuda_lmhead_ce_last_chunks: the chunks of the last call. */
void df_cuda_lmhead_ce_set_gemm1_bf16(int on);
int64_t df_cuda_lmhead_ce_last_chunks(void);

/* The gradient's precision, process-wide: 0 (default, unless the environment
 * has DFLASH_CE_PRECISE=1) rounds G = (softmax - onehot) w / denom to one
 * bf16 before the dh GEMM, as bf16 autograd does; 1 carries it as hi + lo
 * bf16 (~2^-17 relative) at the cost of one more [N x V x H] GEMM. */
void df_cuda_lmhead_ce_set_precise(int on);

#ifdef __cplusplus
}
#endif
#endif
