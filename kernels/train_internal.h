/* train_internal.h - the CPU implementations of the training ops of
 * train_ops.h (kernels/cpu/train_dense.c, kernels/cpu/lmhead_ce.c), called by
 * their dispatch (kernels/train_ops.c) once every argument has been checked:
 * shapes, dtypes, strides, no overlap between an output and anything it may
 * not alias (the GEMM they share is declared in cpu/cpu_internal.h). Every
 * function here is deterministic: results are bitwise
 * independent of the thread count. */
#ifndef DF_TRAIN_INTERNAL_H
#define DF_TRAIN_INTERNAL_H

#include "backend_internal.h"
#include "cpu/cpu_internal.h"
#include "train_ops.h"

int df_cpu_matmul_bwd_x(df_backend *be, const df_tensor *dy, const df_tensor *w, df_tensor *dx,
                        int accumulate);
int df_cpu_matmul_bwd_w(df_backend *be, const df_tensor *dy, const df_tensor *x, df_tensor *dw,
                        int accumulate);
int df_cpu_rmsnorm_bwd(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                       int plus_one, const df_tensor *dy, df_tensor *dx, int accumulate_dx,
                       df_tensor *dw);
int df_cpu_rope_bwd(df_backend *be, df_tensor *dx, const int32_t *pos, int heads, int head_dim,
                    int rot_dim, double theta);
int df_cpu_swiglu_bwd(df_backend *be, const df_tensor *gate, const df_tensor *up,
                      const df_tensor *dout, df_tensor *dgate, df_tensor *dup);
int df_cpu_lmhead_ce(df_backend *be, const df_tensor *h, const df_tensor *head,
                     const int32_t *label, const float *weight, float denom, double *loss_sum,
                     df_tensor *dh, int32_t *argmax, float *ce);
int df_cpu_adamw(df_backend *be, float *master, const void *grad, df_dtype grad_dtype, float *m,
                 float *v, int64_t n, float lr, float beta1, float beta2, float eps, float wd,
                 int64_t step, float grad_scale, uint16_t *out_bf16);
double df_cpu_sumsq(df_backend *be, const void *x, df_dtype dtype, int64_t n);

#endif
