/* gdn_prep.cu - (stub: to be written) */
#include <errno.h>

#include "cuda_internal.h"

int df_cuda_conv1d_silu(df_backend *be, const df_tensor *x, const df_tensor *w,
                        const int32_t *cu_seqlens, int n_seq, df_tensor *out)
{
    return -ENOTSUP;
}

int df_cuda_l2norm(df_backend *be, df_tensor *x, float eps, float scale)
{
    return -ENOTSUP;
}

int df_cuda_gdn_gates(df_backend *be, const df_tensor *a, const df_tensor *b,
                      const df_tensor *A_log, const df_tensor *dt_bias, df_tensor *g,
                      df_tensor *beta)
{
    return -ENOTSUP;
}

