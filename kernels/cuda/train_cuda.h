/* train_cuda.h - the CUDA versions of the dense training ops of
 * train_ops.h (kernels/cuda/train_dense.cu): RMSNorm, RoPE and SwiGLU
 * backward, AdamW, the sum of squares. Same signatures and meaning as the
 * df_cpu_* ones in train_internal.h, arguments already validated by the
 * dispatch (kernels/train_ops.c), with cuda_internal.h's conventions:
 * activations and their gradients BF16 device memory, weights BF16, weight
 * gradients (rmsnorm's dw; adamw's grad; sumsq's x) F32 or BF16 device
 * memory, the optimizer arrays F32 device memory (adamw's out_bf16 a
 * device array), host int arrays (pos) staged here. Work is enqueued on
 * df_cuda_stream(be); 0 or -EIO. df_cuda_sumsq synchronizes the stream to
 * return its value (or a negative errno as a double).
 *
 * Deterministic: dw (rmsnorm) and sumsq are summed in an order fixed by the
 * shapes alone (not by the GPU, the launch or the pointers' alignment), so
 * repeated calls give the same bits. */
#ifndef DF_TRAIN_CUDA_H
#define DF_TRAIN_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "backend_internal.h" /* df_cuda_<op> of op_list.h */
#include "train_ops.h"

/* RMSNorm backward's paths (the same bits; see train_dense.cu): ONEPASS
 * reads x and dy once (16-byte aligned rows, D <= 512 or 1025..6144;
 * elsewhere the
 * two-pass one runs), TWOPASS twice. The default: ONEPASS, unless the
 * environment says DFLASH_RMSNORM_BWD=twopass (read once).
 * df_cuda_rmsnorm_bwd_set_impl(impl) overrides that for later calls
 * (0: back to the default; -EINVAL past TWOPASS): the tests' and benches'
 * hook. df_cuda_rmsnorm_bwd_last_impl(): the path the last call took (0
 * before any). Not thread-safe: process-wide settings. */
/* RMSNorm (plain) of x [R, D] (2-D, D a multiple of 128, rows 16-byte aligned, w too) for
 * df_op_rmsnorm_fp8 (dense.cu): y where not NULL (df_cuda_rmsnorm's bits), the E4M3 codes of y's
 * 1 x 128 blocks where codes is not NULL (fp8_codes.cu's mode 0 with n_out = R and kp = D: codes
 * [R, D], sc[kb * R + r]; the bytes it writes from y), the rows' 1 / rms into inv [R] where not
 * NULL (device memory). 1 when enqueued, 0 for a shape it does not take, -EIO. */
int df_cuda_rmsnorm_q8_rows(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                            df_tensor *y, float *inv, uint8_t *codes, float *sc);
enum { DF_CUDA_RMSNORM_BWD_ONEPASS = 1, DF_CUDA_RMSNORM_BWD_TWOPASS = 2 };
int df_cuda_rmsnorm_bwd_set_impl(int impl);
int df_cuda_rmsnorm_bwd_last_impl(void);

#ifdef __cplusplus
}
#endif
#endif
