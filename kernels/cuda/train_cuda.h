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

#include "train_ops.h"

int df_cuda_rmsnorm_bwd(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                        int plus_one, const df_tensor *dy, df_tensor *dx, int accumulate_dx,
                        df_tensor *dw);
/* RMSNorm backward's paths (the same bits; see train_dense.cu): ONEPASS
 * reads x and dy once (16-byte aligned rows, D <= 512 or 1025..6144;
 * elsewhere the
 * two-pass one runs), TWOPASS twice. The default: ONEPASS, unless the
 * environment says DFLASH_RMSNORM_BWD=twopass (read once).
 * df_cuda_rmsnorm_bwd_set_impl(impl) overrides that for later calls
 * (0: back to the default; -EINVAL past TWOPASS): the tests' and benches'
 * hook. df_cuda_rmsnorm_bwd_last_impl(): the path the last call took (0
 * before any). Not thread-safe: process-wide settings. */
enum { DF_CUDA_RMSNORM_BWD_ONEPASS = 1, DF_CUDA_RMSNORM_BWD_TWOPASS = 2 };
int df_cuda_rmsnorm_bwd_set_impl(int impl);
int df_cuda_rmsnorm_bwd_last_impl(void);
int df_cuda_rope_bwd(df_backend *be, df_tensor *dx, const int32_t *pos, int heads, int head_dim,
                     int rot_dim, double theta);
int df_cuda_swiglu_bwd(df_backend *be, const df_tensor *gate, const df_tensor *up,
                       const df_tensor *dout, df_tensor *dgate, df_tensor *dup);
int df_cuda_adamw(df_backend *be, float *master, const void *grad, df_dtype grad_dtype, float *m,
                  float *v, int64_t n, float lr, float beta1, float beta2, float eps, float wd,
                  int64_t step, float grad_scale, uint16_t *out_bf16);
double df_cuda_sumsq(df_backend *be, const void *x, df_dtype dtype, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
