/* tma_map.cu - TMA tensor maps (tma_map.h). */
#include <cuda_runtime.h>
#include <errno.h>

#include "tma_map.h"

namespace {
/* cuTensorMapEncodeTiled, from the driver through the runtime; null where
 * the driver has none. Looked up once. */
typedef CUresult (*EncodeTiledFn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                  const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                  const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiledFn encode_tiled()
{
    static EncodeTiledFn fn;
    static bool tried; /* racing first calls look up the same pointer */
    if (!tried) {
        void *f = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) ==
                cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (EncodeTiledFn)f;
        else
            cudaGetLastError(); /* not sticky: leave no error for the caller's checks */
        tried = true;
    }
    return fn;
}
} // namespace

int df_cuda_tma_map(CUtensorMap *m, CUtensorMapDataType type, CUtensorMapSwizzle swz, const void *base,
                    int rank, const uint64_t *dims, const uint64_t *strides, const uint32_t *box)
{
    EncodeTiledFn enc = encode_tiled();
    if (!enc || ((uintptr_t)base & 15) || rank < 1 || rank > 5)
        return -EOPNOTSUPP;
    cuuint64_t d[5], st[4];
    cuuint32_t bx[5], es[5];
    for (int i = 0; i < rank; i++) {
        d[i] = dims[i] > 0 ? dims[i] : 1; /* (an empty tensor is never read) */
        bx[i] = box[i], es[i] = 1;
        if (i + 1 < rank)
            st[i] = strides[i];
    }
    return enc(m, type, (cuuint32_t)rank, const_cast<void *>(base), d, st, bx, es,
               CU_TENSOR_MAP_INTERLEAVE_NONE, swz, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS
               ? 0
               : -EOPNOTSUPP;
}
