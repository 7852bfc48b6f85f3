/* train_internal.h - the CPU implementations of the training ops of
 * train_ops.h (kernels/cpu/train_dense.c, kernels/cpu/lmhead_ce.c), called by
 * their dispatch (kernels/train_ops.c) once every argument has been checked:
 * shapes, dtypes, strides, no overlap between an output and anything it may
 * not alias. Also the blocked GEMM the backward matmuls and the fused LM-head
 * CE share. Every function here is deterministic: results are bitwise
 * independent of the thread count. */
#ifndef DF_TRAIN_INTERNAL_H
#define DF_TRAIN_INTERNAL_H

#include "backend_internal.h"
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
int df_cpu_adamw(df_backend *be, float *master, const float *grad, float *m, float *v, int64_t n,
                 float lr, float beta1, float beta2, float eps, float wd, int64_t step,
                 float grad_scale, uint16_t *out_bf16);
double df_cpu_sumsq(df_backend *be, const float *x, int64_t n);

/* ---- the shared GEMM: C[M, N] (+)= A[M, K] @ B[K, N], fp32 ----
 *
 * Each C element is one fp32 accumulator running over k = 0 .. K-1 in
 * increasing order (FMA with the AVX2 kernel, multiply + add with the
 * portable one), then stored, or added to the old C last (accumulate). The
 * blocking (which rows and columns share a tile) never changes that chain,
 * so any tiling, and any thread count, gives the same bits. */
typedef struct df_gemm_a {
    const float *data; /* A[i][k] = trans ? data[k*ld + i] : data[i*ld + k] */
    int64_t ld;
    int trans;
    const float *const *rows; /* if not NULL instead: A[i][k] = rows[i][k] (gathered rows) */
} df_gemm_a;

typedef struct df_gemm_b {
    const void *data; /* BF16/F16/F32: B[k][j] = trans ? data[j*ld + k] : data[k*ld + j] */
    df_dtype dtype;
    int64_t ld;
    int trans;
} df_gemm_b;

typedef struct df_gemm_c {
    float *data; /* C[i][j] = data[i*ld + j], or rows[i][j] if rows is not NULL */
    int64_t ld;
    float *const *rows;
    int accumulate;
} df_gemm_c;

typedef void (*df_gemm_kern)(int64_t kc, const float *const *a, const float *b, float *c,
                             int64_t ldc, int zero);

typedef struct df_gemm {
    df_gemm_a a;
    df_gemm_b b;
    df_gemm_c c;
    int64_t K;
    df_gemm_kern kern; /* from df_gemm_pick_kernel() */
} df_gemm;

/* The AVX2 + FMA micro-kernel when the CPU has it, unless DFLASH_CPU_SIMD=0
 * (as the forward matmul): the portable one. Call once per op, before any
 * worker runs. */
df_gemm_kern df_gemm_pick_kernel(void);

/* Rows [i0, i0 + m) of C, all N columns, on the calling thread. */
int df_gemm_rows(const df_gemm *g, int64_t i0, int64_t m, int64_t N);

/* All of C [M, N], split over be->pool in tiles. */
int df_gemm_par(df_backend *be, const df_gemm *g, int64_t M, int64_t N);

#endif
