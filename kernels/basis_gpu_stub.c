/* basis_gpu_stub.c - kernels/cuda/basis_gpu.h in a build without CUDA: no
 * devices, and every call is -ENOTSUP with a message saying so. */
#include <string.h>

#include "cuda/basis_gpu.h"

static int no_cuda(const char *what, df_err *e)
{
    return df_errf(e, -ENOTSUP, "%s: this build has no CUDA support (configure with nvcc present "
                   "and DFLASH_CUDA=ON)", what);
}

int df_basis_gpu_device_count(void)
{
    return 0;
}

int df_basis_gpu_open(int device, int flags, df_basis_gpu **out, df_err *e)
{
    (void)device, (void)flags;
    *out = NULL;
    return no_cuda("df_basis_gpu_open", e);
}

void df_basis_gpu_close(df_basis_gpu *g)
{
    (void)g;
}

const char *df_basis_gpu_name(const df_basis_gpu *g)
{
    (void)g;
    return "(no CUDA in this build)";
}

int df_basis_gpu_moment_add_bf16(df_basis_gpu *g, df_moment *m, const uint16_t *const *layers,
                                 int K, int H, int64_t n_rows, df_pool *pool, df_err *e)
{
    (void)g, (void)m, (void)layers, (void)K, (void)H, (void)n_rows, (void)pool;
    return no_cuda("df_basis_gpu_moment_add_bf16", e);
}

int df_basis_gpu_moment_sync(df_basis_gpu *g, df_moment *m, df_err *e)
{
    (void)g, (void)m, (void)e;
    return 0; /* nothing can have been accumulated */
}

int df_basis_gpu_set_chunk_rows(df_basis_gpu *g, int rows, df_err *e)
{
    (void)g, (void)rows;
    return no_cuda("df_basis_gpu_set_chunk_rows", e);
}

int df_basis_gpu_fit(df_basis_gpu *g, const df_moment *m, int R, double energy, df_basis *out,
                     df_err *e)
{
    (void)g, (void)m, (void)R, (void)energy;
    memset(out, 0, sizeof *out);
    return no_cuda("df_basis_gpu_fit", e);
}

int df_basis_gpu_extend(df_basis_gpu *g, const df_basis *q, const df_moment *m, int R,
                        df_basis *out, df_err *e)
{
    (void)g, (void)q, (void)m, (void)R;
    memset(out, 0, sizeof *out);
    return no_cuda("df_basis_gpu_extend", e);
}

int df_basis_gpu_eval(df_basis_gpu *g, const df_basis *b, const df_moment *m, double *kept,
                      double *layer_kept, df_err *e)
{
    (void)g, (void)b, (void)m, (void)kept, (void)layer_kept;
    return no_cuda("df_basis_gpu_eval", e);
}
