// device.cu - device discovery and a self-test kernel (checks launch + copy).
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "knobs.h"

extern "C" int df_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); // clear the sticky "no device" error
        return 0;
    }
    return n;
}

extern "C" int df_cuda_device_info_get(int i, df_cuda_device_info *info)
{
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess)
        return -19; // -ENODEV
    memset(info, 0, sizeof *info);
    info->index = i;
    snprintf(info->name, sizeof info->name, "%s", p.name);
    info->sm_major = p.major;
    info->sm_minor = p.minor;
    info->sm_count = p.multiProcessorCount;
    info->mem_bytes = p.totalGlobalMem;
    return 0;
}

extern "C" int df_cuda_portable_forced(void)
{
    return df_knob_int(DF_KNOB_PORTABLE);
}

extern "C" int df_cuda_smem_optin(int dev)
{
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    const int small = 99 * 1024; // sm_86, sm_89, sm_120
    return df_cuda_portable_forced() && v > small ? small : v;
}

extern "C" int df_cuda_func_smem(const void *fn, size_t bytes)
{
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        cudaGetLastError();
        return -EIO;
    }
    if (bytes > (size_t)df_cuda_smem_optin(dev))
        return -ENOTSUP;
    if (cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes) != cudaSuccess) {
        cudaGetLastError();
        return -EIO;
    }
    // Forced portable: the 100 KiB of shared memory per SM of those parts too
    // (the carveout in percent of the SM's, rounded down: the driver rounds a
    // carveout up to the next configuration it has), so that CTAs per SM, not
    // only per-CTA limits, are theirs.
    int per_sm = 0;
    if (df_cuda_portable_forced() &&
        cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) == cudaSuccess &&
        per_sm > 100 * 1024) {
        int pct = (int)(100LL * 100 * 1024 / per_sm);
        if (cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, pct) != cudaSuccess) {
            cudaGetLastError();
            return -EIO;
        }
    }
    cudaGetLastError();
    return 0;
}

extern "C" int df_cuda_hopper_kernels(void)
{
    int dev, major = 0, minor = 0;
    if (df_cuda_portable_forced())
        return 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
        cudaGetLastError(); // not sticky: leave no error for the caller's checks
        return 0;
    }
    return major == 9 && minor == 0;
}

__global__ void saxpy_kernel(int n, float a, const float *x, float *y)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = a * x[i] + y[i];
}

extern "C" int df_cuda_selftest(int dev)
{
    const int n = 1 << 16;
    static float hx[1 << 16], hy[1 << 16];
    for (int i = 0; i < n; i++) {
        hx[i] = (float)(i % 97) - 48.0f;
        hy[i] = (float)(i % 13);
    }
    float *x = NULL, *y = NULL;
    int rc = -5; // -EIO
    if (cudaSetDevice(dev) != cudaSuccess || cudaMalloc(&x, n * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&y, n * sizeof(float)) != cudaSuccess)
        goto out;
    cudaMemcpy(x, hx, n * sizeof(float), cudaMemcpyHostToDevice);
    cudaMemcpy(y, hy, n * sizeof(float), cudaMemcpyHostToDevice);
    saxpy_kernel<<<(n + 255) / 256, 256>>>(n, 2.0f, x, y);
    if (cudaGetLastError() != cudaSuccess)
        goto out;
    if (cudaMemcpy(hy, y, n * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess)
        goto out;
    rc = 0;
    for (int i = 0; i < n; i++)
        if (hy[i] != 2.0f * ((float)(i % 97) - 48.0f) + (float)(i % 13))
            rc = -5;
out:
    cudaFree(x);
    cudaFree(y);
    return rc;
}
