/* drafter_fp8.c - FP8 training of the drafter (df_drafter_set_fp8): every
 * GEMM of a training step through df_op_matmul_fp8, whose operands are
 * rounded to E4M3 with power-of-two block scales (docs/FP8.md; the recipe of
 * DeepSeek-V3's FP8 training: activations and gradients along the
 * reduction, 1 x 128 or 128 x 1, weights 128 x 128), and the LM head's
 * (h per 1 x 128, the frozen head per 128 x 128 - rounded once here, or by
 * the op itself where the backend has E4M3 tensor cores - the softmax
 * gradient per 1 x 128: DF_CE_FP8_GRAD). FP32 accumulation, BF16 results;
 * attention, norms, the optimizer and the master weights as in BF16
 * training. */
#include "drafter_internal.h"

#include <errno.h>

int drafter_mm(df_drafter *d, const df_tensor *x, const df_tensor *w, df_tensor *y, unsigned flags)
{
    return d->q8 ? df_op_matmul_fp8(d->be, DF_GEMM_FWD, x, w, y, flags)
                 : df_op_matmul(d->be, x, w, y, flags & DF_FP8_ACCUMULATE);
}

int drafter_mm_bx(df_drafter *d, const df_tensor *dy, const df_tensor *w, df_tensor *dx, unsigned flags)
{
    return d->q8 ? df_op_matmul_fp8(d->be, DF_GEMM_BWD_X, dy, w, dx, flags)
                 : df_op_matmul_bwd_x(d->be, dy, w, dx, flags & DF_FP8_ACCUMULATE);
}

int drafter_mm_bw(df_drafter *d, const df_tensor *dy, const df_tensor *x, df_tensor *dw, unsigned flags)
{
    if (d->fp8_dy_blocks)
        flags |= DF_FP8_DY_BLOCKS;
    return d->q8 ? df_op_matmul_fp8(d->be, DF_GEMM_BWD_W, dy, x, dw, flags)
                 : df_op_matmul_bwd_w(d->be, dy, x, dw, flags & DF_FP8_ACCUMULATE);
}

int drafter_swiglu(df_drafter *d, const df_tensor *g, const df_tensor *u, df_tensor *out, unsigned flags)
{
    return d->q8 ? df_op_swiglu_fp8(d->be, g, u, out, flags) : df_op_swiglu(d->be, g, u, out);
}

int drafter_dy_codes(df_drafter *d, const df_tensor *dy)
{
    return d->q8 && d->fp8_dy_blocks ? df_op_fp8_dy_codes(d->be, dy, DF_FP8_DY_BLOCKS) : 0;
}

int drafter_rmsnorm(df_drafter *d, const df_tensor *x, const df_tensor *w, float eps, df_tensor *y,
                    int uses, unsigned flags)
{
    return d->q8 ? df_op_rmsnorm_fp8(d->be, x, w, eps, y, uses, flags)
                 : df_op_rmsnorm(d->be, x, w, eps, 0, y);
}

int drafter_swiglu_bwd(df_drafter *d, const df_tensor *g, const df_tensor *u, const df_tensor *dout,
                       df_tensor *dg, df_tensor *du)
{
    return d->q8 ? df_op_swiglu_bwd_fp8(d->be, g, u, dout, dg, du,
                                        DF_FP8_ONLY_CODES | (d->fp8_dy_blocks ? DF_FP8_DY_BLOCKS : 0))
                 : df_op_swiglu_bwd(d->be, g, u, dout, dg, du);
}

void df_drafter_set_fp8_dy_blocks(df_drafter *d, int on) { d->fp8_dy_blocks = on != 0; }

void df_drafter_set_fp8_ce_onepass(df_drafter *d, int on) { d->fp8_ce_onepass = on != 0; }

void df_drafter_set_bf16_logits(df_drafter *d, int on) { d->bf16_logits = on != 0; }

void df_drafter_set_f16_logits(df_drafter *d, int on) { d->f16_logits = on != 0; }

void drafter_fp8_free(df_drafter *d)
{
    df_backend_free(d->be, d->head8.data);
    d->head8.data = NULL;
}

int df_drafter_set_fp8(df_drafter *d, int on, df_err *e)
{
    if (!on) {
        drafter_fp8_free(d);
        d->fp8 = 0;
        return 0;
    }
    if (d->fp8)
        return 0;
    /* With E4M3 tensor cores the LM head + CE makes the head's codes from the
     * head itself (DF_CE_FP8_ROUND_HEAD): no rounded copy kept (2.5 GB at the
     * Qwen3.6-27B shape). Elsewhere its BF16 GEMMs take the copy every step. */
    if (df_backend_fp8_tensor_cores(d->be)) {
        d->fp8 = 1;
        return 0;
    }
    /* the head, rounded once: BF16 stays BF16, other dtypes go to F32 */
    const df_tensor *h = &d->head;
    df_dtype hdt = h->dtype == DF_DTYPE_BF16 ? DF_DTYPE_BF16 : DF_DTYPE_F32;
    int64_t V = h->shape[0], H = h->shape[1];
    size_t es = df_dtype_size(hdt), hes = df_dtype_size(h->dtype);
    void *h8 = df_backend_alloc(d->be, (size_t)(V * H) * es);
    if (!h8)
        return df_errf(e, -ENOMEM, "out of memory on %s for FP8 training's rounded LM head "
                       "(%.1f MiB)", df_backend_name(d->be), (double)(V * H) * es / (1 << 20));
    d->head8 = df_tensor_2d(h8, hdt, V, H);
    int rc = 0;
    if (h->stride[0] == H)
        rc = df_backend_cast(d->be, h8, hdt, h->data, h->dtype, V * H);
    for (int64_t r = 0; r < V && !rc && h->stride[0] != H; r++) /* a strided view: by rows */
        rc = df_backend_cast(d->be, (uint8_t *)h8 + (size_t)(r * H) * es, hdt,
                             (const uint8_t *)h->data + (size_t)(r * h->stride[0]) * hes,
                             h->dtype, H);
    if (!rc)
        rc = df_op_fp8_qdq(d->be, &d->head8, &d->head8, 128, 128);
    if (rc) {
        drafter_fp8_free(d);
        return df_errf(e, rc, "FP8 training: rounding the LM head failed (%s)", df_strerror(rc));
    }
    d->fp8 = 1;
    return 0;
}
