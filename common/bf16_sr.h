/* bf16_sr.h - FP32 -> BF16 with stochastic rounding, and the random bits it takes: the same
 * bits from C on the CPU and from CUDA on the GPU (this header is both's).
 *
 * Contract:
 *   df_sr_bits(key, i): 64 random-looking bits for element i of the stream key (splitmix64's
 *     finaliser over key ^ i * 2^64 / phi): a pure function, so a given key and index give
 *     the same bits however the work is split across threads, ranks or calls.
 *   df_bf16_sr(u, r): the BF16 of the FP32 whose bits are u, rounded stochastically with the
 *     16 random bits r & 0xffff: the 16 bits that BF16 drops, plus r, carried into the kept
 *     ones, then truncated. A value between two BF16 neighbours goes to the upper one with
 *     probability (its distance from the lower) / (their gap): unbiased, so small updates
 *     that round-to-nearest would drop every time survive on average. Exact BF16 values stay
 *     as they are; +-Inf stays; NaN gives a quiet NaN (as df_f32_to_bf16); a finite value
 *     within one BF16 step of the largest finite may round to Inf. */
#ifndef DF_BF16_SR_H
#define DF_BF16_SR_H

#include <stdint.h>

#ifdef __CUDACC__
#define DF_SR_FN __host__ __device__ static inline
#else
#define DF_SR_FN static inline
#endif

DF_SR_FN uint64_t df_sr_bits(uint64_t key, uint64_t i)
{
    uint64_t z = key ^ (i * 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

DF_SR_FN uint16_t df_bf16_sr(uint32_t u, uint32_t r)
{
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    if ((u & 0x7fffffffu) == 0x7f800000u)
        return (uint16_t)(u >> 16);
    return (uint16_t)((u + (r & 0xffffu)) >> 16);
}

#endif
