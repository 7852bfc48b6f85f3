/* fp8.c - the CPU references of df_op_fp8_qdq and df_op_matmul_fp8 (contracts
 * in train_ops.h). The rounding:
 * common/e4m3.h's df_fp8_qdq_f32 over bands of block_rows rows, the bands
 * split over the pool. BF16 rows go through an f32 copy; the results are
 * exactly BF16 values (the scales are powers of two), so the conversion
 * back is exact. Independent of the thread count: blocks never span two
 * bands. */
#include "train_internal.h"

#include <stdlib.h>
#include <string.h>

#include "e4m3.h"

typedef struct qdq_ctx {
    const df_tensor *x;
    df_tensor *y;
    int64_t br, bc, bands_per_task;
} qdq_ctx;

static int qdq_task(void *vp, size_t task)
{
    const qdq_ctx *c = vp;
    int64_t rows = c->x->shape[0], cols = c->x->shape[1];
    int64_t r0 = (int64_t)task * c->bands_per_task * c->br;
    int64_t r1 = r0 + c->bands_per_task * c->br;
    if (r1 > rows)
        r1 = rows;
    int64_t n = r1 - r0, lx = c->x->stride[0], ly = c->y->stride[0];
    if (c->x->dtype == DF_DTYPE_F32) {
        const float *x = (const float *)c->x->data + r0 * lx;
        float *y = (float *)c->y->data + r0 * ly;
        if (y != x)
            for (int64_t r = 0; r < n; r++)
                memcpy(y + r * ly, x + r * lx, (size_t)cols * sizeof(float));
        return df_fp8_qdq_f32(y, n, cols, ly, c->br, c->bc);
    }
    float *t = malloc((size_t)(n * cols) * sizeof(float));
    if (!t)
        return -ENOMEM;
    const uint16_t *x = (const uint16_t *)c->x->data + r0 * lx;
    uint16_t *y = (uint16_t *)c->y->data + r0 * ly;
    for (int64_t r = 0; r < n; r++)
        for (int64_t k = 0; k < cols; k++)
            t[r * cols + k] = df_bf16_to_f32(x[r * lx + k]);
    int rc = df_fp8_qdq_f32(t, n, cols, cols, c->br, c->bc);
    for (int64_t r = 0; r < n && !rc; r++)
        for (int64_t k = 0; k < cols; k++)
            y[r * ly + k] = df_f32_to_bf16(t[r * cols + k]);
    free(t);
    return rc;
}

int df_cpu_fp8_qdq(df_backend *be, const df_tensor *x, df_tensor *y, int64_t block_rows,
                   int64_t block_cols)
{
    int64_t rows = x->shape[0], cols = x->shape[1];
    if (rows == 0 || cols == 0)
        return 0;
    int64_t bands = (rows + block_rows - 1) / block_rows;
    /* ~64K elements per task, whole bands */
    int64_t per = ((int64_t)1 << 16) / (block_rows * cols);
    if (per < 1)
        per = 1;
    qdq_ctx c = {x, y, block_rows, block_cols, per};
    return df_pool_for(be->pool, (size_t)((bands + per - 1) / per), qdq_task, &c);
}

/* t (any float dtype, row-strided) as a contiguous F32 copy rounded in
 * br x bc blocks (malloc'd into *buf; NULL when out of memory) */
static int rounded_copy(df_backend *be, const df_tensor *t, int64_t br, int64_t bc, float **buf,
                        df_tensor *out)
{
    int64_t rows = t->shape[0], cols = t->shape[1];
    size_t es = df_dtype_size(t->dtype);
    float *p = malloc((size_t)(rows * cols > 0 ? rows * cols : 1) * sizeof(float));
    *buf = p;
    if (!p)
        return -ENOMEM;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = (const uint8_t *)t->data + (size_t)(r * t->stride[0]) * es;
        for (int64_t k = 0; k < cols; k++)
            p[r * cols + k] = df_elem_to_f32(row + (size_t)k * es, t->dtype);
    }
    *out = df_tensor_2d(p, DF_DTYPE_F32, rows, cols);
    return df_cpu_fp8_qdq(be, out, out, br, bc);
}

/* The BF16 op on operands rounded per the recipe (train_ops.h): the
 * reference of every backend's FP8 GEMM (the hint flags are not used;
 * DF_FP8_DY_BLOCKS is). */
int df_cpu_matmul_fp8(df_backend *be, df_gemm_kind kind, const df_tensor *a, const df_tensor *b,
                      df_tensor *c, unsigned flags)
{
    int accumulate = (flags & DF_FP8_ACCUMULATE) != 0;
    float *pa = NULL, *pb = NULL;
    df_tensor ra, rb;
    int64_t abr, abc, bbr, bbc;
    df_fp8_operand_blocks(kind, 0, flags, &abr, &abc);
    df_fp8_operand_blocks(kind, 1, flags, &bbr, &bbc);
    int rc = rounded_copy(be, a, abr, abc, &pa, &ra);
    if (!rc)
        rc = rounded_copy(be, b, bbr, bbc, &pb, &rb);
    if (!rc)
        rc = kind == DF_GEMM_FWD     ? df_cpu_matmul(be, &ra, &rb, c, accumulate)
             : kind == DF_GEMM_BWD_X ? df_cpu_matmul_bwd_x(be, &ra, &rb, c, accumulate)
                                     : df_cpu_matmul_bwd_w(be, &ra, &rb, c, accumulate);
    free(pa);
    free(pb);
    return rc;
}
