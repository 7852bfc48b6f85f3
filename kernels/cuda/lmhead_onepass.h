/* lmhead_onepass.h - DF_CE_FP8_ONEPASS's two launches (lmhead_onepass.cu),
 * for lmhead_ce.cu: its chunk loop decides where the one pass runs. */
#ifndef DF_CUDA_LMHEAD_ONEPASS_H
#define DF_CUDA_LMHEAD_ONEPASS_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "fp8_cuda.h"

/* How a chunk's logits are stored (lmhead_rows.cuh's row types): fp32, bf16
 * (DF_CE_BF16_LOGITS), fp16 (DF_CE_F16_LOGITS on the E4M3 tensor cores), or
 * fp32 read as their fp16 rounding (DF_CE_F16_LOGITS elsewhere) */
enum { Z_F32 = 0, Z_BF16 = 1, Z_F16 = 2, Z_F32R16 = 3 };

/* The largest V (rounded up to 128) the one pass takes: its row block keeps
 * every 128-block's max in shared memory (8 KB). */
#define DF_CUDA_CE_ONEPASS_MAXV ((int64_t)1 << 18)

/* A chunk's rows (logits z stored as zt says, Z_*; row stride ldz elements,
 * a multiple of 8; chunk row r is global row row0 + r): row_loss, ce and
 * argmax (each may be NULL but row_loss) as the two-pass row kernel writes
 * them, and Gp's codes and block scales where g8 says (df_cuda_fp8_rows_slot
 * for GEMM 2; g8->n >= nrows rows, the rest zero). 0, -EINVAL, -EIO. */
int df_cuda_ce_onepass_rows(cudaStream_t st, int zt, const void *z, int64_t ldz,
                            int64_t V, int64_t row0, const int32_t *label, const float *weight,
                            double denom, int32_t *argmax, float *ce, double *row_loss,
                            int64_t nrows, const df_cuda_fp8_rows *g8);

/* dh rows row0 .. row0 + nr (bf16, row stride lddh) from GEMM 2's d32 [nr,
 * H] (fp32) minus c times the label's row of the head, read from its kept
 * E4M3 codes as GEMM 1 took them (head_codes: a df_cuda_fp8_kept region of
 * DF_GEMM_FWD, ready); ignored rows 0. 0 or -EIO. */
int df_cuda_ce_onepass_dh(cudaStream_t st, const float *d32, int64_t H, int64_t V, int64_t row0,
                          int64_t nr, const int32_t *label, const float *weight, double denom,
                          const void *head_codes, uint16_t *dh, int64_t lddh);

#endif
