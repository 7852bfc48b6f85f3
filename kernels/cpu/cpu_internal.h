/* cpu_internal.h - what the CPU backend's files (kernels/cpu/) share: small
 * row and weight helpers, and the blocked GEMM (kernels/cpu/gemm.c). */
#ifndef DF_CPU_INTERNAL_H
#define DF_CPU_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "backend_internal.h"

/* n consecutive weight elements (BF16/F16/F32) at p, as f32. */
static inline void weight_to_f32(const void *p, df_dtype t, int64_t n, float *out)
{
    if (t == DF_DTYPE_F32) {
        memcpy(out, p, (size_t)n * 4);
    } else if (t == DF_DTYPE_BF16) {
        const uint16_t *h = p;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)h[i] << 16;
            memcpy(&out[i], &u, 4);
        }
    } else {
        const uint16_t *h = p;
        for (int64_t i = 0; i < n; i++)
            out[i] = df_f16_to_f32(h[i]);
    }
}

/* Rows of an N-D tensor: every index of the outer dims, the last dim contiguous. */
static inline int64_t n_rows(const df_tensor *t)
{
    int64_t n = 1;
    for (int d = 0; d < t->ndim - 1; d++)
        n *= t->shape[d];
    return n;
}

static inline float *row_ptr(const df_tensor *t, int64_t r)
{
    int64_t off = 0;
    for (int d = t->ndim - 2; d >= 0; d--) {
        off += (r % t->shape[d]) * t->stride[d];
        r /= t->shape[d];
    }
    return (float *)t->data + off;
}

static inline int64_t row_len(const df_tensor *t)
{
    return t->shape[t->ndim - 1];
}

/* fp32 dot product with 8 interleaved partial sums (vectorizes without
 * reassociation), combined in a fixed order. */
static inline float dot_f32(const float *a, const float *b, int64_t n)
{
    float p[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++)
            p[j] += a[i + j] * b[i + j];
    for (; i < n; i++)
        p[i & 7] += a[i] * b[i];
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

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

/* RoPE (dense.c): the rotation (sign +1) or its transpose (sign -1); the
 * backward pass is the transpose, bitwise, since only sin's sign changes. */
int df_cpu_rope_apply(df_backend *be, df_tensor *x, const int32_t *pos, int heads, int head_dim,
                      int rot_dim, double theta, float sign);

/* RMSNorm's sum of squares in fp32: 8 interleaved partial sums (as a
 * vectorized reduction does), combined pairwise in a fixed order. The
 * forward and the backward both use this one, so the backward recomputes
 * exactly the forward's normaliser. */
static inline float df_sumsq_f32(const float *x, int64_t n)
{
    float p[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++)
            p[j] += x[i + j] * x[i + j];
    for (; i < n; i++)
        p[i & 7] += x[i] * x[i];
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

#endif
