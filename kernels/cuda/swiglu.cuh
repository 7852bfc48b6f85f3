/* swiglu.cuh - SwiGLU's backward per element, for the kernels that compute it
 * (train_dense.cu's df_cuda_swiglu_bwd, swiglu_fp8.cu's variant that also writes the
 * FP8 GEMMs' codes): one formula, so both give the same bits. Internal
 * (anonymous namespace). */
#ifndef DF_CUDA_SWIGLU_CUH
#define DF_CUDA_SWIGLU_CUH

namespace {

/* The CPU's formulas and order: s = sigmoid(g), silu = g / (1 + e^-g);
 * g -> -inf gives s = 0 and a finite bracket, never NaN. */
__device__ __forceinline__ void swiglu_bwd_f(float g, float u, float d, float *dg, float *du)
{
    float e = expf(-g);
    float s = 1.0f / (1.0f + e), silu = g / (1.0f + e);
    *dg = d * u * (s * (1.0f + g * (1.0f - s)));
    *du = d * silu;
}

} /* namespace */

#endif
