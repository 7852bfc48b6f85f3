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

/* df_cpu_dflash_attn, df_cpu_dflash_attn_bwd: declared from op_list.h
 * (backend_internal.h). */

#endif
