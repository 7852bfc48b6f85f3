/* op_checks.h - the argument checks the op dispatch files (ops.c,
 * ops_gdn.c, train_ops.c, train_attn.c) share: tensor well-formedness, shape
 * and view equality, and whether an output may share memory with another
 * tensor. Pure functions of their arguments; nothing is written. */
#ifndef DF_OP_CHECKS_H
#define DF_OP_CHECKS_H

#include <stddef.h>
#include <stdint.h>

#include "ops.h"
#include "train_ops.h"

/* BF16, F16 or F32: the dtypes a weight may have. */
int df_is_weight_dtype(df_dtype t);

/* The dtype rule of df_check_tensor's `weight` argument. */
enum { DF_CHK_F32 = 0, DF_CHK_WEIGHT = 1, DF_CHK_BF16 = 2, DF_CHK_GRAD = 3 };

/* A well-formed tensor: ndim_min..ndim_max dims, dtype F32 (weight ==
 * DF_CHK_F32), BF16 (DF_CHK_BF16), a weight dtype (DF_CHK_WEIGHT) or a
 * weight-gradient dtype, F32 or BF16 (DF_CHK_GRAD), non-negative shapes
 * and strides, innermost stride 1, data present when non-empty. An output
 * (out != 0) must also not overlap itself: each outer stride of a dim of
 * size > 1 covers the extent of the dims inside it. max_span > 0 also
 * requires the elements a non-empty tensor spans (and its element count)
 * to be computable without int64 overflow and at most max_span
 * (train_ops.c's rule); max_span == 0 checks neither (ops.c's rule). */
int df_check_tensor(const df_tensor *t, int ndim_min, int ndim_max, int weight, int out,
                    int64_t max_span);

int df_same_shape(const df_tensor *a, const df_tensor *b);

/* The GEMMs' arguments, c (+)= f(a, b) with f by kind (df_gemm_kind): a, b, c
 * 2-D and well-formed (df_check_tensor with max_span), a of dtype rule act,
 * b of act for DF_GEMM_BWD_W else wt, c of act (DF_CHK_GRAD for
 * DF_GEMM_BWD_W), shapes as ops.h / train_ops.h say, c sharing no memory
 * with a or b. 1 when valid. */
int df_gemm_args_ok(int kind, const df_tensor *a, const df_tensor *b, const df_tensor *c, int act,
                    int wt, int64_t max_span);

/* The same view of the same memory: data, dtype and shape equal, and the
 * stride of every dim of size > 1. */
int df_same_view(const df_tensor *a, const df_tensor *b);

/* A tensor as rows of contiguous bytes: base, count, stride, width. 1-D and
 * 2-D tensors exactly (inner stride 1); more dims by their bounding range as
 * one "row". */
typedef struct df_rowspan {
    intptr_t base;
    int64_t rows, stride, width; /* bytes */
} df_rowspan;

df_rowspan df_span_of(const df_tensor *t);

/* Raw memory: n elements of size es at p (empty if p is NULL). */
df_rowspan df_span_raw(const void *p, int64_t n, size_t es);

/* Whether two spans may share a byte. Exact for rows of one stride (column
 * views of one buffer, e.g. the q and gate halves of one GEMM output);
 * otherwise by bounding ranges, which can only err towards "overlap". */
int df_spans_overlap(df_rowspan a, df_rowspan b);

int df_overlaps(const df_tensor *a, const df_tensor *b);

/* out is the very same view as in (when may_alias) or shares no byte with it. */
int df_alias_ok(const df_tensor *out, const df_tensor *in, int may_alias);

#define DF_MAX_EXTENT ((int64_t)1 << 60) /* elements a tensor may span (df_extent) */

/* Elements spanned by t: 0 if empty, -1 on overflow or beyond DF_MAX_EXTENT. */
int64_t df_extent(const df_tensor *t);

/* 1 if no element of a shares memory with an element of b. Exact for
 * disjoint byte ranges and for 2-D views with one row stride (column slices
 * of one matrix); conservative (0) otherwise. */
int df_disjoint(const df_tensor *a, const df_tensor *b);

/* RoPE's non-tensor arguments against x [T, heads*head_dim]: heads and
 * head_dim positive and matching, rot_dim even in (0, head_dim], theta a
 * finite positive fp32 number, pos present when T > 0. */
int df_rope_args_ok(const df_tensor *x, const int32_t *pos, int heads, int head_dim, int rot_dim,
                    double theta);

#endif
