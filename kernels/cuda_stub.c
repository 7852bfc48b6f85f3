/* cuda_stub.c - df_backend_cuda_open in a build without CUDA. */
#include "ops.h"

df_backend *df_backend_cuda_open(int device, df_err *e)
{
    df_errf(e, -ENOTSUP, "cuda backend: device %d: this build has no CUDA support "
                         "(configure with nvcc present and DFLASH_CUDA=ON)", device);
    return NULL;
}

int df_backend_cuda_device_count(void)
{
    return -1;
}

void *df_backend_cuda_stream(df_backend *be)
{
    (void)be;
    return NULL;
}

int df_backend_cuda_device(df_backend *be)
{
    (void)be;
    return -1;
}

int df_backend_fp8_tensor_cores(df_backend *be)
{
    (void)be;
    return 0;
}

int df_backend_fp8_keep_weight_codes(df_backend *be, const df_tensor *w)
{
    (void)be;
    (void)w;
    return 0;
}

void df_backend_fp8_drop_weight_codes(df_backend *be, const void *p, size_t bytes)
{
    (void)be;
    (void)p;
    (void)bytes;
}
