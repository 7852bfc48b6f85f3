/* attn_prefill.cu - (stub: to be written) */
#include <errno.h>

#include "cuda_internal.h"

int df_cuda_attention(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
                      const int32_t *cu_seqlens, int n_seq, int nq, int nkv, int head_dim,
                      float scale, const df_tensor *gate, df_tensor *out)
{
    return -ENOTSUP;
}

