/* gdn.cu - (stub: to be written) */
#include <errno.h>

#include "cuda_internal.h"

int df_cuda_gdn(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
                const df_tensor *g, const df_tensor *beta, const int32_t *cu_seqlens, int n_seq,
                int hk, int hv, int dk, int dv, df_gdn_mode mode, df_tensor *out)
{
    return -ENOTSUP;
}

