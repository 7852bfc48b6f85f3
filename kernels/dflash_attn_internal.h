/* dflash_attn_internal.h - the CPU implementation of the DFlash drafter
 * attention (kernels/cpu/dflash_attn.c), called by its dispatch
 * (kernels/train_attn.c) once every argument has been checked: shapes,
 * strides, GQA, no overlaps between outputs and anything else, and for
 * every valid block 0 <= doc_start <= anchor < S. Padding blocks' anchor and
 * doc_start are never read. */
#ifndef DF_DFLASH_ATTN_INTERNAL_H
#define DF_DFLASH_ATTN_INTERNAL_H

#include "backend_internal.h"
#include "train_ops.h"

int df_cpu_dflash_attn(df_backend *be, const df_tensor *q, const df_tensor *kc,
                       const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,
                       const df_dflash_blocks *blk, int nq, int nkv, int head_dim, float scale,
                       df_tensor *out, df_tensor *lse);

int df_cpu_dflash_attn_bwd(df_backend *be, const df_tensor *q, const df_tensor *kc,
                           const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,
                           const df_dflash_blocks *blk, int nq, int nkv, int head_dim,
                           float scale, const df_tensor *out, const df_tensor *lse,
                           const df_tensor *dout, df_tensor *dq, df_tensor *dkc, df_tensor *dvc,
                           df_tensor *dkb, df_tensor *dvb);

#endif
