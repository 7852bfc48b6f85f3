/* dense.cu - (stub: to be written) */
#include <errno.h>

#include "cuda_internal.h"

int df_cuda_embed(df_backend *be, const df_tensor *table, const uint32_t *ids, int64_t n,
                  df_tensor *out)
{
    return -ENOTSUP;
}

int df_cuda_add(df_backend *be, const df_tensor *x, df_tensor *y)
{
    return -ENOTSUP;
}

int df_cuda_rmsnorm(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                    int plus_one, df_tensor *y)
{
    return -ENOTSUP;
}

int df_cuda_rmsnorm_gated(df_backend *be, const df_tensor *x, const df_tensor *z,
                          const df_tensor *w, float eps, df_tensor *y)
{
    return -ENOTSUP;
}

int df_cuda_rope(df_backend *be, df_tensor *x, const int32_t *pos, int heads, int head_dim,
                 int rot_dim, double theta)
{
    return -ENOTSUP;
}

int df_cuda_swiglu(df_backend *be, const df_tensor *gate, const df_tensor *up, df_tensor *out)
{
    return -ENOTSUP;
}

int df_cuda_sigmoid(df_backend *be, const df_tensor *x, df_tensor *out)
{
    return -ENOTSUP;
}

int df_cuda_silu(df_backend *be, const df_tensor *x, df_tensor *out)
{
    return -ENOTSUP;
}

