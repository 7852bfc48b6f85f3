/* fp8.c - the CPU reference of df_op_fp8_qdq (contract in train_ops.h):
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
        df_fp8_qdq_f32(y, n, cols, ly, c->br, c->bc);
        return 0;
    }
    float *t = malloc((size_t)(n * cols) * sizeof(float));
    if (!t)
        return -ENOMEM;
    const uint16_t *x = (const uint16_t *)c->x->data + r0 * lx;
    uint16_t *y = (uint16_t *)c->y->data + r0 * ly;
    for (int64_t r = 0; r < n; r++)
        for (int64_t k = 0; k < cols; k++)
            t[r * cols + k] = df_bf16_to_f32(x[r * lx + k]);
    df_fp8_qdq_f32(t, n, cols, cols, c->br, c->bc);
    for (int64_t r = 0; r < n; r++)
        for (int64_t k = 0; k < cols; k++)
            y[r * ly + k] = df_f32_to_bf16(t[r * cols + k]);
    free(t);
    return 0;
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
