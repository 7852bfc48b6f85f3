// ptx_async.cuh - the PTX wrappers the tensor-core attention kernels share
// (attn_prefill.cu, dflash_attn/*.cu): shared-memory
// addresses, cp.async with zero-fill, its commit / wait, ldmatrix x4 and
// mma.sync m16n8k16 (bf16 in, fp32 accumulate). sm_80+ instructions; an
// unused wrapper emits nothing, so including this in code also built for
// older targets is harmless.
//
// cp_wait has a "memory" clobber: the compiler must not move a shared-memory
// read of the landed data above the wait. (Every caller also has a barrier
// right after it, which orders the reads anyway; the clobber keeps that from
// being load-bearing.)
#ifndef DF_PTX_ASYNC_CUH
#define DF_PTX_ASYNC_CUH

#include <stdint.h>

namespace {

__device__ __forceinline__ uint32_t smem_u32(const void *ptr)
{
    return (uint32_t)__cvta_generic_to_shared(ptr);
}
// 16-byte async copy global -> shared (generic or shared address); ok ==
// false zero-fills (src is not read, but must be a valid address).
__device__ __forceinline__ void cp16(uint32_t dst, const void *src, bool ok)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp16(void *dst, const void *src, bool ok)
{
    cp16(smem_u32(dst), src, ok);
}
// the same without zero-fill (every byte of src read)
__device__ __forceinline__ void cp16(uint32_t dst, const void *src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
// 4-byte async copy (through L1: .ca; .cg takes 16 bytes only)
__device__ __forceinline__ void cp4(uint32_t dst, const void *src, bool ok)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
                 "r"(ok ? 4 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Four 8x8 bf16 matrices; lane l gives row l % 8 of matrix l / 8 (16 bytes,
// 16-byte aligned); .trans delivers them transposed.
__device__ __forceinline__ void ldsm4(uint32_t r[4], const void *ptr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(ptr)));
}
__device__ __forceinline__ void ldsm4t(uint32_t r[4], const void *ptr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(ptr)));
}
// c += a b: m16n8k16, a row-major (4 registers), b column-major (2), fp32 c
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

} // namespace

#endif
