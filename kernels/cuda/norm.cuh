/* norm.cuh - RMSNorm's per-element formula, for the kernels that apply it: dense.cu's norms
 * and fp8_codes.cu's codes of a norm's output (df_op_rmsnorm_fp8). One formula, in the CPU's
 * order (kernels/cpu/dense.c), so every path rounds the same float to BF16. */
#ifndef DF_CUDA_NORM_CUH
#define DF_CUDA_NORM_CUH

namespace {

/* y = w * (x * inv), inv = 1 / sqrt(mean(x^2) + eps) of x's row */
__device__ __forceinline__ float rms_out(float x, float inv, float w) { return w * (x * inv); }

} // namespace

#endif
