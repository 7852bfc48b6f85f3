/* device.h - CUDA device discovery (the first piece of the CUDA backend). */
#ifndef DF_CUDA_DEVICE_H
#define DF_CUDA_DEVICE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct df_cuda_device_info {
    int index;
    char name[256];
    int sm_major, sm_minor, sm_count;
    unsigned long long mem_bytes;
} df_cuda_device_info;

/* Number of usable CUDA devices: 0 when there is no GPU or no driver. */
int df_cuda_device_count(void);
/* Fills info for device i; 0 or a negative code. */
int df_cuda_device_info_get(int i, df_cuda_device_info *info);
/* Runs a small kernel on device i and checks its result: 0 when it works. */
int df_cuda_selftest(int i);
/* Whether DFLASH_PORTABLE=1 forces the portable kernels (mma.sync, sm_80+)
 * everywhere, Hopper included, with the shared memory of the smallest
 * portable parts (df_cuda_smem_optin): the drafter attention, the target's
 * prefill attention and the GDN prefill then choose what an sm_86 / sm_89 /
 * sm_120 GPU (RTX PRO 6000 Blackwell, L40S, RTX 4090) runs, so that path can
 * be benchmarked and tested on an H100 / H200. Read once per process (racing
 * first calls read the same value); unset or another value: the per-device
 * choice. */
int df_cuda_portable_forced(void);
/* The opt-in shared memory per block of device dev, in bytes, as the
 * kernels' choices see it: the device's, capped at 99 KiB (101376 bytes, the
 * sm_86 / sm_89 / sm_120 limit) under df_cuda_portable_forced(); 0 when the
 * device cannot be asked (the CUDA error is cleared). */
int df_cuda_smem_optin(int dev);
/* cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
 * bytes) on the current device, within df_cuda_smem_optin(): -ENOTSUP
 * (nothing set) where bytes exceed it, so that DFLASH_PORTABLE=1 refuses a
 * launch a 99 KiB part would refuse, and then also fn's shared-memory
 * carveout to those parts' 100 KiB per SM (their CTAs per SM); 0, or -EIO on
 * a CUDA error (cleared). */
int df_cuda_func_smem(const void *fn, size_t bytes);
/* Whether the Hopper kernels (wgmma, TMA; built for sm_90a) may be chosen on
 * the current device: compute capability 9.0 and not df_cuda_portable_forced().
 * Each Hopper kernel still checks that its sm_90a code is in the binary. */
int df_cuda_hopper_kernels(void);

#ifdef __cplusplus
}
#endif
#endif
