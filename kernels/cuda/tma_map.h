/* tma_map.h - TMA tensor maps (cuTensorMapEncodeTiled, looked up in the
 * driver through the runtime: no libcuda link) for the Hopper kernels that
 * load their tiles by TMA: the drafter attention's wgmma kernels and the FP8
 * GEMM. Host code, C++ (CUtensorMap is a driver-API type). */
#ifndef DF_CUDA_TMA_MAP_H
#define DF_CUDA_TMA_MAP_H

#include <cuda.h> /* CUtensorMap and its enums (types only) */
#include <stdint.h>

/* A tensor of rank (1..5) dimensions at base (16-byte aligned) as a TMA map:
 * dims innermost first, strides in bytes between consecutive indices of dims
 * 1 .. rank - 1, box the tile one copy brings (box[0] x the element size <=
 * the swizzle's width where swz swizzles), reads past the tensor's ends
 * giving zeros, L2 promotion 128 B. 0, or -EOPNOTSUPP: the driver has no
 * cuTensorMapEncodeTiled, base is not 16-byte aligned, or the encoder
 * refused (the caller then takes a path without TMA). */
int df_cuda_tma_map(CUtensorMap *m, CUtensorMapDataType type, CUtensorMapSwizzle swz, const void *base,
                    int rank, const uint64_t *dims, const uint64_t *strides, const uint32_t *box);

#endif
