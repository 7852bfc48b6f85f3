/* fp8_dy.cu - df_op_fp8_dy_codes on CUDA: a projection's output gradient rounded once for both
 * of its backward GEMMs, into gemm_fp8.cu's "made" slots 8 (DF_GEMM_BWD_X: 1 x 128 blocks along
 * the rows) and 9 (DF_GEMM_BWD_W: 128 x 128 blocks of the transpose), which the calls then take
 * under DF_FP8_MADE.
 *
 * Unfused, each GEMM reads dy to round it in its own layout. Here a CTA per 128 x 128 tile
 * (fp8_codes.cu's q8_blk with its row codes) reads it once and writes both, with the rounding
 * kernels' rule: the same bytes, so the GEMMs' products are the same bits. dy's values stay
 * (another op wrote them; nothing is left out).
 *
 * Where the codes would not be used (no E4M3 tensor cores, MXFP8, dy in 128 x 1 blocks (no
 * DF_FP8_DY_BLOCKS), DFLASH_FP8_DY_CODES=0, no memory) it does nothing: the GEMMs round dy. */
#include <cuda_runtime.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "cuda_internal.h"
#include "fp8_cuda.h"
#include "knobs.h"
#include "train_cuda.h"

extern "C" int df_cuda_fp8_dy_codes(df_backend *be, const df_tensor *dy, unsigned flags)
{
    int ok = df_knob_int(DF_KNOB_FP8_DY_CODES) && (flags & DF_FP8_DY_BLOCKS) && dy->ndim == 2 &&
             dy->dtype == DF_DTYPE_BF16 && dy->stride[1] == 1 && df_tensor_numel(dy) > 0;
    const int64_t R = ok ? dy->shape[0] : 0, C = ok ? dy->shape[1] : 0;
    ok = ok && (R + 127) / 128 <= 65535 && (C + 127) / 128 <= ((int64_t)1 << 31) - 1;
    df_cuda_fp8_rows xr, wr;
    memset(&xr, 0, sizeof xr), memset(&wr, 0, sizeof wr);
    ok = ok && df_cuda_fp8_made_claim(be, 8, DF_GEMM_BWD_X, 0, dy, 1, &xr) &&
         df_cuda_fp8_made_claim(be, 9, DF_GEMM_BWD_W, 0, dy, 1, &wr);
    int rc = 0;
    if (ok) {
        cudaStream_t st = df_cuda_stream(be);
        const int64_t l4 = (wr.kp / 128 + 3) / 4 * 4;
        const int vec = dy->stride[0] % 8 == 0 && ((uintptr_t)dy->data & 15) == 0;
        /* BWD_W's scales: zero where no tile writes (the rows of L4's padding) */
        if (cudaMemsetAsync(wr.scales, 0, (size_t)((C + 127) / 128 * l4) * sizeof(float), st) != cudaSuccess)
            rc = df_cuda_check_launch("fp8 dy codes' scales");
        if (!rc)
            rc = df_cuda_fp8_codes_dy_run(st, (const uint16_t *)dy->data, dy->stride[0], R, C, xr.codes,
                                          xr.kp, xr.scales, wr.codes, wr.kp, wr.scales, vec);
    }
    df_cuda_fp8_made_ready(be, 8, ok && !rc);
    df_cuda_fp8_made_ready(be, 9, ok && !rc);
    return rc;
}
