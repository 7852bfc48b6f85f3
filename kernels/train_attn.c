/* train_attn.c - dispatch and argument checks of the DFlash drafter
 * attention, forward and backward (contract in train_ops.h).
 *
 * Every check runs before anything is written: a rejected call returns
 * -EINVAL with every output untouched, and the backend (kernels/cpu/
 * dflash_attn.c) may assume valid arguments:
 *   - all tensors F32, 2-D, innermost stride 1, any row stride, each row
 *     stepping over the whole previous one (no self-overlap);
 *   - q, out, dout, dq [n_blocks*bs, nq*D]; kc, vc, dkc, dvc [S, nkv*D];
 *     kb, vb, dkb, dvb [n_blocks*bs, nkv*D]; lse [n_blocks*bs, nq];
 *   - nq, nkv, head_dim >= 1, nq % nkv == 0, scale finite and > 0;
 *   - n_blocks >= 0, block_size >= 1, window >= 0, and for every valid block
 *     0 <= doc_start <= anchor < S (padding blocks' anchor/doc_start are not
 *     read: any value goes);
 *   - outputs share no memory with any input or with each other (inputs may
 *     overlap one another, e.g. kc and vc as column views of one buffer). */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "dflash_attn_internal.h"
#include "op_checks.h"

/* A [rows, cols] matrix of dtype dt: innermost stride 1, the row stride covering a
 * whole row (rows never interleave), data present unless empty. */
static int mat_2d(const df_tensor *t, df_dtype dt, int64_t rows, int64_t cols)
{
    if (!t || t->ndim != 2 || t->dtype != dt || t->shape[0] != rows ||
        t->shape[1] != cols || t->stride[0] < 0 || t->stride[1] != 1)
        return 0;
    if (rows == 0 || cols == 0)
        return 1; /* empty: nothing is ever addressed */
    if (df_extent(t) < 0 || (rows > 1 && t->stride[0] < cols))
        return 0;
    return t->data != NULL;
}

/* Outputs o[0..no) are pairwise disjoint and disjoint from inputs in[0..ni). */
static int outputs_apart(const df_tensor *const *o, int no, const df_tensor *const *in, int ni)
{
    for (int i = 0; i < no; i++) {
        for (int j = i + 1; j < no; j++)
            if (!df_disjoint(o[i], o[j]))
                return 0;
        for (int j = 0; j < ni; j++)
            if (!df_disjoint(o[i], in[j]))
                return 0;
    }
    return 1;
}

/* The block table and head counts against a context of S positions. */
static int blocks_ok(const df_dflash_blocks *blk, int nq, int nkv, int head_dim, float scale,
                     int64_t S)
{
    if (!blk || nq < 1 || nkv < 1 || head_dim < 1 || nq % nkv || !isfinite(scale) || !(scale > 0.0f))
        return 0;
    if (blk->n_blocks < 0 || blk->block_size < 1 || blk->window < 0)
        return 0;
    if (blk->n_blocks > 0 && (!blk->anchor || !blk->doc_start || !blk->valid))
        return 0;
    for (int b = 0; b < blk->n_blocks; b++) {
        if (!blk->valid[b])
            continue;
        int64_t p = blk->anchor[b], s0 = blk->doc_start[b];
        if (s0 < 0 || s0 > p || p >= S)
            return 0;
    }
    return 1;
}

/* The five inputs both calls take, and the block table (S = kc's rows). */
static int inputs_ok(df_dtype at, const df_tensor *q, const df_tensor *kc, const df_tensor *vc,
                     const df_tensor *kb, const df_tensor *vb, const df_dflash_blocks *blk,
                     int nq, int nkv, int head_dim, float scale)
{
    if (!q || !kc || !vc || !kb || !vb || !blk || kc->ndim != 2)
        return 0;
    if (blk->n_blocks < 0 || blk->block_size < 1 || nq < 1 || nkv < 1 || head_dim < 1)
        return 0;
    int64_t rows = (int64_t)blk->n_blocks * blk->block_size, S = kc->shape[0];
    int64_t qc = (int64_t)nq * head_dim, kvc = (int64_t)nkv * head_dim;
    return mat_2d(q, at, rows, qc) && mat_2d(kc, at, S, kvc) && mat_2d(vc, at, S, kvc) &&
           mat_2d(kb, at, rows, kvc) && mat_2d(vb, at, rows, kvc) &&
           blocks_ok(blk, nq, nkv, head_dim, scale, S);
}

static int backend_ok(const df_backend *be)
{
    return be && (be->kind == DF_BACKEND_CPU || be->kind == DF_BACKEND_CUDA);
}

int df_op_dflash_attn(df_backend *be, const df_tensor *q, const df_tensor *kc,
                      const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,
                      const df_dflash_blocks *blk, int nq, int nkv, int head_dim, float scale,
                      df_tensor *out, df_tensor *lse)
{
    if (!backend_ok(be) || !inputs_ok(be->act, q, kc, vc, kb, vb, blk, nq, nkv, head_dim, scale))
        return -EINVAL;
    int64_t rows = q->shape[0];
    if (!mat_2d(out, be->act, rows, q->shape[1]) || !mat_2d(lse, DF_DTYPE_F32, rows, nq))
        return -EINVAL;
    const df_tensor *o[2] = {out, lse}, *in[5] = {q, kc, vc, kb, vb};
    if (!outputs_apart(o, 2, in, 5))
        return -EINVAL;
    return DF_DISPATCH(be, dflash_attn, q, kc, vc, kb, vb, blk, nq, nkv, head_dim, scale, out,
                       lse);
}

int df_op_dflash_attn_bwd(df_backend *be, const df_tensor *q, const df_tensor *kc,
                          const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,
                          const df_dflash_blocks *blk, int nq, int nkv, int head_dim, float scale,
                          const df_tensor *out, const df_tensor *lse, const df_tensor *dout,
                          df_tensor *dq, df_tensor *dkc, df_tensor *dvc, df_tensor *dkb,
                          df_tensor *dvb)
{
    if (!backend_ok(be) || !inputs_ok(be->act, q, kc, vc, kb, vb, blk, nq, nkv, head_dim, scale))
        return -EINVAL;
    int64_t rows = q->shape[0], S = kc->shape[0];
    df_dtype at = be->act;
    if (!mat_2d(out, at, rows, q->shape[1]) || !mat_2d(lse, DF_DTYPE_F32, rows, nq) ||
        !mat_2d(dout, at, rows, q->shape[1]) || !mat_2d(dq, at, rows, q->shape[1]) ||
        !mat_2d(dkc, at, S, kc->shape[1]) || !mat_2d(dvc, at, S, kc->shape[1]) ||
        !mat_2d(dkb, at, rows, kc->shape[1]) || !mat_2d(dvb, at, rows, kc->shape[1]))
        return -EINVAL;
    const df_tensor *o[5] = {dq, dkc, dvc, dkb, dvb};
    const df_tensor *in[8] = {q, kc, vc, kb, vb, out, lse, dout};
    if (!outputs_apart(o, 5, in, 8))
        return -EINVAL;
    return DF_DISPATCH(be, dflash_attn_bwd, q, kc, vc, kb, vb, blk, nq, nkv, head_dim, scale, out,
                       lse, dout, dq, dkc, dvc, dkb, dvb);
}
