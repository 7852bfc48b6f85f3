/* test_gpu_probe - the CUDA toolchain works end to end on a GPU machine;
 * skips (77) where there is no GPU, as in CI. */
#include <stdio.h>

#include "cuda/device.h"
#include "test.h"

int main(void)
{
    int n = df_cuda_device_count();
    if (n == 0) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    for (int i = 0; i < n; i++) {
        df_cuda_device_info info;
        CHECK_OK(df_cuda_device_info_get(i, &info), NULL);
        printf("gpu %d: %s sm_%d%d, %d SMs, %.1f GiB\n", i, info.name, info.sm_major,
               info.sm_minor, info.sm_count, info.mem_bytes / 1073741824.0);
        CHECK_EQ(df_cuda_selftest(i), 0);
    }
    return test_main_end();
}
