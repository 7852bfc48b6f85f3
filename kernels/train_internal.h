/* train_internal.h - the CPU implementations of the training ops of
 * train_ops.h (kernels/cpu/train_dense.c, kernels/cpu/lmhead_ce.c,
 * kernels/cpu/fp8.c), called by
 * their dispatch (kernels/train_ops.c) once every argument has been checked:
 * shapes, dtypes, strides, no overlap between an output and anything it may
 * not alias (the GEMM they share is declared in cpu/cpu_internal.h). Every
 * function here is deterministic: results are bitwise
 * independent of the thread count. */
#ifndef DF_TRAIN_INTERNAL_H
#define DF_TRAIN_INTERNAL_H

#include "backend_internal.h"
#include "cpu/cpu_internal.h"
#include "train_ops.h"

/* df_cpu_matmul_bwd_x, _matmul_bwd_w, _rmsnorm_bwd, _rope_bwd, _swiglu_bwd,
 * _lmhead_ce, _adamw, _sumsq, _fp8_qdq: declared from op_list.h (backend_internal.h). */

#endif
