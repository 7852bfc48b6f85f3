/* drafter_fp8.c - FP8 training of the drafter (df_drafter_set_fp8): every
 * GEMM of a training step takes its operands on the E4M3 grid with
 * power-of-two block scales (df_op_fp8_qdq; docs/FP8.md), the recipe of
 * DeepSeek-V3's FP8 training:
 *   forward y = x w^T        x in 1 x 128 blocks (along the reduction), w 128 x 128
 *   input gradient dx = dy w  dy in 1 x 128 blocks, w 128 x 128
 *   weight gradient dw = dy^T x   dy and x in 128 x 1 blocks (the reduction runs over rows)
 *   LM head                  h in 1 x 128, the frozen head 128 x 128 (rounded once),
 *                            the softmax gradient in 1 x 128 (DF_CE_FP8_GRAD)
 * with FP32 accumulation and BF16 results; everything else (attention,
 * norms, the optimizer, master weights) unchanged. The rounded values are
 * exactly BF16 numbers, so these GEMMs run as the BF16 ones on the rounded
 * copies and give what an FP8 GEMM with FP32 accumulation gives, up to the
 * order of the sums: the numerics of FP8 training on any backend, the CPU
 * included, before an FP8 GEMM exists to make it fast. */
#include "drafter_internal.h"

#include <errno.h>
#include <stdlib.h>

/* the E4M3 block sides */
enum { QB = 128 };

/* x rounded into slot (rows x cols contiguous, x's dtype) */
static int round_into(df_drafter *d, const df_tensor *x, void *slot, int64_t br, int64_t bc,
                      df_tensor *out)
{
    int64_t rows = x->shape[0], cols = x->shape[1];
    if (rows * cols > d->q8_cap)
        return -ENOSPC;
    *out = df_tensor_2d(slot, x->dtype, rows, cols);
    return df_op_fp8_qdq(d->be, x, out, br, bc);
}

int drafter_mm(df_drafter *d, const df_tensor *x, const df_tensor *w, df_tensor *y, int acc)
{
    if (!d->q8)
        return df_op_matmul(d->be, x, w, y, acc);
    df_tensor x8;
    int rc = round_into(d, x, d->q8a, 1, QB, &x8);
    return rc ? rc : df_op_matmul(d->be, &x8, w, y, acc);
}

int drafter_mm_bx(df_drafter *d, const df_tensor *dy, const df_tensor *w, df_tensor *dx, int acc)
{
    if (!d->q8)
        return df_op_matmul_bwd_x(d->be, dy, w, dx, acc);
    df_tensor dy8;
    int rc = round_into(d, dy, d->q8a, 1, QB, &dy8);
    return rc ? rc : df_op_matmul_bwd_x(d->be, &dy8, w, dx, acc);
}

int drafter_mm_bw(df_drafter *d, const df_tensor *dy, const df_tensor *x, df_tensor *dw, int acc)
{
    if (!d->q8)
        return df_op_matmul_bwd_w(d->be, dy, x, dw, acc);
    df_tensor dy8, x8;
    int rc = round_into(d, dy, d->q8a, QB, 1, &dy8);
    if (!rc)
        rc = round_into(d, x, d->q8b, QB, 1, &x8);
    return rc ? rc : df_op_matmul_bwd_w(d->be, &dy8, &x8, dw, acc);
}

int drafter_fp8_part(df_drafter *d, const void *W, int part)
{
    int ix[7], n = 0;
    if (part < 0) {
        ix[n++] = d->fc;
    } else {
        const layer_idx *I = &d->li[part];
        int m[7] = {I->wq, I->wk, I->wv, I->wo, I->gate, I->up, I->down};
        for (int k = 0; k < 7; k++)
            ix[n++] = m[k];
    }
    for (int k = 0; k < n; k++) {
        df_tensor w = PW(d, W, ix[k]), w8 = PW(d, d->w8, ix[k]);
        int rc = df_op_fp8_qdq(d->be, &w, &w8, QB, QB);
        if (rc)
            return rc;
    }
    return 0;
}

int drafter_fp8_reserve(df_drafter *d, int64_t N, int64_t S)
{
    df_backend_free(d->be, d->q8a);
    df_backend_free(d->be, d->q8b);
    d->q8a = d->q8b = NULL;
    d->q8_cap = 0;
    if (!d->fp8)
        return 0;
    const df_drafter_config *c = &d->c;
    int64_t H = c->hidden_size, QD = (int64_t)c->num_attention_heads * c->head_dim,
            F = c->intermediate_size, KH = df_drafter_fc_in(c);
    /* the largest operand: the fc's features [S, KH] or an [N, F | QD | H] activation */
    int64_t KD = (int64_t)c->num_key_value_heads * c->head_dim;
    int64_t wide = F > QD ? F : QD;
    wide = wide > H ? wide : H;
    wide = wide > KD ? wide : KD;
    int64_t cap = S * KH > N * wide ? S * KH : N * wide;
    d->q8a = df_backend_alloc(d->be, (size_t)cap * d->aes);
    d->q8b = df_backend_alloc(d->be, (size_t)cap * d->aes);
    if (!d->q8a || !d->q8b) {
        drafter_fp8_free(d);
        return -ENOMEM;
    }
    d->q8_cap = cap;
    return 0;
}

void drafter_fp8_free(df_drafter *d)
{
    df_backend_free(d->be, d->q8a);
    df_backend_free(d->be, d->q8b);
    df_backend_free(d->be, d->w8);
    df_backend_free(d->be, d->head8.data);
    d->q8a = d->q8b = d->w8 = d->head8.data = NULL;
    d->q8_cap = 0;
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
    /* the weights' copy (whole layout: a part's matrices at their offsets) */
    size_t wbytes = (size_t)d->ps.total * d->wes;
    /* the head, rounded once: BF16 stays BF16, other dtypes go to F32 */
    const df_tensor *h = &d->head;
    df_dtype hdt = h->dtype == DF_DTYPE_BF16 ? DF_DTYPE_BF16 : DF_DTYPE_F32;
    int64_t V = h->shape[0], H = h->shape[1];
    void *h8 = df_backend_alloc(d->be, (size_t)(V * H) * df_dtype_size(hdt));
    d->w8 = df_backend_alloc(d->be, wbytes > 0 ? wbytes : 1);
    if (!h8 || !d->w8) {
        df_backend_free(d->be, h8);
        drafter_fp8_free(d);
        return df_errf(e, -ENOMEM, "out of memory on %s for FP8 training's copies of the weights "
                       "(%.1f MiB) and the LM head (%.1f MiB)", df_backend_name(d->be),
                       (double)wbytes / (1 << 20),
                       (double)(V * H) * df_dtype_size(hdt) / (1 << 20));
    }
    d->head8 = df_tensor_2d(h8, hdt, V, H);
    int rc = 0;
    if (h->stride[0] == H)
        rc = df_backend_cast(d->be, h8, hdt, h->data, h->dtype, V * H);
    for (int64_t r = 0; r < V && !rc && h->stride[0] != H; r++) /* a strided view: by rows */
        rc = df_backend_cast(d->be, (uint8_t *)h8 + (size_t)(r * H) * df_dtype_size(hdt), hdt,
                             (const uint8_t *)h->data +
                                 (size_t)(r * h->stride[0]) * df_dtype_size(h->dtype),
                             h->dtype, H);
    if (!rc)
        rc = df_op_fp8_qdq(d->be, &d->head8, &d->head8, QB, QB);
    if (rc) {
        drafter_fp8_free(d);
        return df_errf(e, rc, "FP8 training: rounding the LM head failed (%s)", df_strerror(rc));
    }
    d->fp8 = 1;
    d->cap_N = d->cap_S = 0; /* reserve() again: the scratch slots */
    return 0;
}
