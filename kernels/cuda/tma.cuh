/* tma.cuh - the Hopper (sm_90a) mbarrier and bulk-copy wrappers that the
 * TMA-fed kernels share: the drafter attention's wgmma kernels
 * (dflash_attn/wg.cuh's includers). The tensor maps come from tma_map.h. Internal (anonymous namespace: each
 * includer gets its own copies); the bodies exist only where the target is
 * sm_90a, and their callers are built there alone. */
#ifndef DF_CUDA_TMA_CUH
#define DF_CUDA_TMA_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "device.h" // df_cuda_hopper_kernels

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace {

// An mbarrier of one arrival: the thread that issues a tile's TMA copies
// arrives with the byte count (expect_tx), the copies complete the
// transaction, and each reader waits for the phase's parity: the n-th fill
// of a barrier completes phase n, so its readers wait for parity n % 2.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// one arrival (release: this thread's earlier reads and writes of what the
// barrier guards happen before the phase completes)
__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// the inits visible to the async proxy (TMA) before any copy uses them
__device__ __forceinline__ void mbar_fence_init()
{
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity)
{
    uint32_t done;
    do
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    while (!done);
}
// box of the 2-D tensor map at generic address map, coordinates (c0 innermost,
// c1), into shared memory at dst; completes bytes on mbarrier bar. Rows past
// the tensor's end arrive as zeros.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void *map, int c0, int c1, uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void *map, int c0, int c1, int c2,
                                            uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}

// bytes (a multiple of 16) from global src to shared dst (both 16-byte
// aligned), a plain bulk copy (no tensor map); completes bytes on mbarrier bar
__device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(bar)
                 : "memory");
}

} // namespace
#endif

namespace {
// Host: whether the current device runs `fn`, an sm_90a kernel, with
// smem bytes of dynamic shared memory: compute capability 9.0, the kernel
// taken from the 90a target (not from another target's PTX compiled at load
// time, whose body is a trap), enough opt-in shared memory, and not
// DFLASH_PORTABLE (df_cuda_hopper_kernels). Cached per device
// in known[64] (0 unknown, 1 no, 2 yes; racing first calls store the same
// value). Leaves no CUDA error behind.
__host__ inline bool wg_kernel_runs(const void *fn, size_t smem, signed char *known)
{
    int dev;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64)
        return false;
    if (known[dev])
        return known[dev] == 2;
    int smax = 0;
    bool r = df_cuda_hopper_kernels() &&
             cudaDeviceGetAttribute(&smax, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess;
    if (!r)
        cudaGetLastError(); // not sticky
    if (r) {
        cudaFuncAttributes fa;
        cudaError_t e = cudaFuncGetAttributes(&fa, fn);
        if (e != cudaSuccess)
            cudaGetLastError(); // not sticky: clear it for the caller's checks
        r = e == cudaSuccess && fa.ptxVersion >= 90 && (size_t)smax >= smem;
    }
    known[dev] = r ? 2 : 1;
    return r;
}

} // namespace

#endif
