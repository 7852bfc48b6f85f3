/* fp8_mx.h - where cuBLASLt wants an MXFP8 operand's scales: the layout
 * alone, C and CUDA alike (gemm_fp8.cu's conversion, its tests). */
#ifndef DF_CUDA_FP8_MX_H
#define DF_CUDA_FP8_MX_H
#include <stdint.h>

/* MXFP8 (compute capability 10 and later: B200, RTX PRO 6000 Blackwell).
 * cuBLASLt there takes E4M3 with one E8M0 scale per 32 values along the
 * reduction (CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0), not the 1 x 128 /
 * 128 x 128 FP32 scales of sm_90. The recipe's scales are powers of two, so
 * each 128-block's scale is an E8M0 byte (its FP32 exponent bits) that its
 * four 32-blocks share: the same codes, the same products. The byte of row r,
 * 32-block j (of nj per row, nj a multiple of 4) in cuBLASLt's tiled layout:
 * tiles of 128 rows x 4 blocks (512 bytes), a row of tiles after another,
 * and in a tile row r % 32 at 16 bytes each, then (r % 128) / 32 at 4, then
 * j % 4. A scale tensor holds the rows rounded up to 128. */
#ifdef __CUDACC__
#define DF_FP8_HD __host__ __device__
#else
#define DF_FP8_HD
#endif
static inline DF_FP8_HD int64_t df_fp8_mx_offset(int64_t r, int64_t j, int64_t nj)
{
    return ((r / 128) * (nj / 4) + j / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + j % 4;
}

#endif
