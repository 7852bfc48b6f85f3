/* device.h - CUDA device discovery (the first piece of the CUDA backend). */
#ifndef DF_CUDA_DEVICE_H
#define DF_CUDA_DEVICE_H

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

#ifdef __cplusplus
}
#endif
#endif
