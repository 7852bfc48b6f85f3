/* rmsnorm_fp8.cu - df_op_rmsnorm_fp8 on CUDA: the RMSNorm before projections that also writes
 * the E4M3 codes of the GEMM operand it computes, for the calls that then pass DF_FP8_MADE
 * (gemm_fp8.cu's "made" slots 6 and 7, each serving all the projections that share the norm's
 * output).
 *
 * Unfused, the norm writes y in BF16 and the first projection's GEMM reads it back to round it
 * (the others reuse that under DF_FP8_HOLD_X / _SAME_X):
 *  - DF_GEMM_FWD (the forward's q / k / v or gate / up): 1 x 128 blocks along y's rows. The
 *    norm's row kernel (dense.cu, the FP8 variant) holds each row in registers: it writes the
 *    codes from there (df_cuda_rmsnorm_q8_rows);
 *  - DF_GEMM_BWD_W (their weight gradients, y recomputed in the backward): 1 x 128 blocks along
 *    y's columns, a transposed tile. The row kernel writes only each row's 1 / rms (into the
 *    scratch), and the column-codes kernel (fp8_codes.cu) makes y's values from x, that and the
 *    weight as it loads its tile.
 * Both make y's BF16 values with the norm kernels' formula (norm.cuh) and round them with
 * fp8_codes.cu's rule: the bytes the GEMMs' own rounding writes from y, so the products are the
 * same bits. Under DF_FP8_ONLY_CODES, once every region's calls have taken codes of this
 * geometry (df_cuda_fp8_made_proven), y's values are left out.
 *
 * Where the codes would not be used (no E4M3 tensor cores, MXFP8, DFLASH_FP8_RMSNORM=0, a shape
 * the kernels do not take: not 2-D, rows not 16-byte aligned, D not a multiple of 128, no
 * memory) it is df_cuda_rmsnorm. */
#include <cuda_runtime.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "cuda_internal.h"
#include "fp8_cuda.h"
#include "knobs.h"
#include "train_cuda.h"

extern "C" int df_cuda_rmsnorm_fp8(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                                   df_tensor *y, int uses, unsigned flags)
{
    const int want_rows = (flags & DF_FP8_X_FWD) != 0, want_cols = (flags & DF_FP8_X_BWD_W) != 0;
    int rows = want_rows, cols = want_cols;
    int ok = df_knob_int(DF_KNOB_FP8_RMSNORM) && x->ndim == 2 && y->ndim == 2 &&
             df_tensor_numel(y) > 0 && x->dtype == DF_DTYPE_BF16 && y->dtype == DF_DTYPE_BF16 &&
             w->dtype == DF_DTYPE_BF16 && x->stride[1] == 1 && y->stride[1] == 1 &&
             x->shape[1] % 128 == 0 && x->stride[0] % 8 == 0 && ((uintptr_t)x->data & 15) == 0;
    const int64_t R = ok ? x->shape[0] : 0, C = ok ? x->shape[1] : 0;
    ok = ok && (C + 63) / 64 <= 65535;
    /* slots 6 (FWD's x), 7 (BWD_W's x) */
    df_cuda_fp8_rows xr, wr;
    memset(&xr, 0, sizeof xr), memset(&wr, 0, sizeof wr);
    if (ok && rows)
        rows = df_cuda_fp8_made_claim_n(be, 6, DF_GEMM_FWD, 0, y, 0, uses, &xr);
    if (ok && cols)
        cols = df_cuda_fp8_made_claim_n(be, 7, DF_GEMM_BWD_W, 1, y, 0, uses, &wr);
    float *inv = ok && cols ? (float *)df_cuda_scratch(be, (size_t)R * sizeof(float)) : NULL;
    cols = cols && inv;
    /* y's values only where every call that reads it takes codes from here */
    const bool vals = !((flags & DF_FP8_ONLY_CODES) && df_knob_int(DF_KNOB_FP8_ONLY_CODES) &&
                        rows == want_rows && cols == want_cols &&
                        (!rows || df_cuda_fp8_made_proven(be, 6)) &&
                        (!cols || df_cuda_fp8_made_proven(be, 7)));
    int rc = ok && (rows || cols)
                 ? df_cuda_rmsnorm_q8_rows(be, x, w, eps, vals ? y : NULL, cols ? inv : NULL,
                                           rows ? xr.codes : NULL, rows ? xr.scales : NULL)
                 : 0;
    if (rc == 0) { /* not this path: the plain norm, the GEMMs round y */
        df_cuda_fp8_made_ready(be, 6, 0);
        df_cuda_fp8_made_ready(be, 7, 0);
        return df_cuda_rmsnorm(be, x, w, eps, 0, y);
    }
    if (rc == 1 && cols)
        rc = df_cuda_fp8_codes_norm_run(df_cuda_stream(be), (const uint16_t *)x->data, x->stride[0], R,
                                        C, inv, (const uint16_t *)w->data, wr.codes, wr.kp, wr.scales,
                                        1);
    const int made = rc < 0 ? 0 : vals ? 1 : 2;
    df_cuda_fp8_made_ready(be, 6, rows ? made : 0);
    df_cuda_fp8_made_ready(be, 7, cols ? made : 0);
    return rc < 0 ? rc : 0;
}
