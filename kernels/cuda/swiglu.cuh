/* swiglu.cuh - SwiGLU's forward and backward per element, for the kernels that compute
 * them (dense.cu's df_cuda_swiglu, train_dense.cu's df_cuda_swiglu_bwd, and swiglu_fp8.cu's
 * variants that also write the FP8 GEMMs' codes): one formula, so they give the same bits.
 * Internal (anonymous namespace). */
#ifndef DF_CUDA_SWIGLU_CUH
#define DF_CUDA_SWIGLU_CUH

namespace {

/* As the CPU: x / (1 + e^-x), so x -> -inf gives -0, never NaN. SwiGLU's forward is
 * silu_f(gate) * up (dense.cu's df_cuda_swiglu, swiglu_fp8.cu's variant). */
__device__ __forceinline__ float silu_f(float x)
{
    return x / (1.0f + expf(-x));
}

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
