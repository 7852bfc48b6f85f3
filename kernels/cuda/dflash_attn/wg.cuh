// dflash_attn/wg.cuh - the Hopper warpgroup-MMA (wgmma, sm_90a) helpers that
// the DFlash attention's wgmma kernels (impls WG2 and WG2F) share:
// dflash_attn/wg_dkv.cu (context dK/dV), dflash_attn/wg_dq.cu (dQ),
// dflash_attn/wg_fwd.cu (forward). Internal (each includer gets its own
// copies: anonymous namespace). Conventions, as the kernels use them:
//  - shared tiles of bf16 rows in the 128-byte swizzle: [D/64 column blocks]
//    [nrows][128 B], 16-byte chunk c of row r at chunk position c ^ (r % 8)
//    (sw_off), from a 1024-byte-aligned base (the swizzle repeats every 1024
//    bytes and the hardware applies it to absolute address bits);
//  - descriptors (wg_desc): K-major operands LBO 16 (unused), SBO 1024 (8
//    rows); MN-major (transposed) B: LBO = one column block (nrows x 128 B),
//    SBO 1024; a k step of 16 moves 32 bytes within a column block (K-major)
//    or 16 rows = 2048 bytes (MN-major);
//  - cp.async writes reach the tensor cores only after fence_proxy_async()
//    in each writing thread and a barrier; TMA writes (async proxy, like
//    wgmma's reads) once the tile's mbarrier phase completed (mbar_wait);
//    TMA's 128-byte swizzle is this layout (a 64-element box row per 128 B);
//  - accumulators: zero them once before the loop and pin that with
//    reg_fence (zeroing sunk into the loop makes ptxas serialize every wgmma:
//    "wgmma serialization" in its output); reg_fence after each wait that
//    retires registers the code reads next; a 'continue' around wgmmas has
//    the same serializing effect as the sunk zeroing (use one structured if).
#ifndef DF_CUDA_DFLASH_ATTN_WG_CUH
#define DF_CUDA_DFLASH_ATTN_WG_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"
#include "../ptx_async.cuh"
#include "../tma.cuh"
#include "../wgmma.cuh"

// The kernel bodies and their helpers: sm_90a device code only.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DF_WG_BODY 1
#else
#define DF_WG_BODY 0
#endif

namespace df_dflash {
namespace {

// A compile-time int as a value (the tile-width argument of the kernels'
// generic tile-step lambdas).
template <int N> struct IntC {
    static constexpr int value = N;
};

#if DF_WG_BODY
constexpr float WLOG2E = 1.4426950408889634f;

// Byte offset of 16-byte chunk c (columns 8c .. 8c + 7) of row r in a tile of
// nrows rows stored as [D/64][nrows][128 B] with the 128-byte swizzle.
__device__ __forceinline__ int sw_off(int r, int c, int nrows)
{
    return (c >> 3) * nrows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// Zero wgmma accumulators and pin the zeroing where it is called: sunk into
// a loop's paths, it counts as "non-wgmma instructions defining
// accumulators" and ptxas serializes every wgmma.
template <int N> __device__ __forceinline__ void acc_zero(float (&r)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++)
        r[i] = 0.0f;
    reg_fence(r);
}

// The accumulator operands of an m64nNk16 wgmma: N/2 fp32 registers per
// thread, in the instruction's register list and in the asm operand list
// (k: the constraint, "+f" to accumulate, "=f" to overwrite).
#define WG_ACC32_REGS                                                                     \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_ACC64_REGS                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "  \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "   \
    "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "   \
    "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define WG_ACC8(k, d, i)                                                                   \
    k(d[i]), k(d[i + 1]), k(d[i + 2]), k(d[i + 3]), k(d[i + 4]), k(d[i + 5]), k(d[i + 6]),  \
        k(d[i + 7])
#define WG_ACC32(k, d) WG_ACC8(k, d, 0), WG_ACC8(k, d, 8), WG_ACC8(k, d, 16), WG_ACC8(k, d, 24)
#define WG_ACC64(k, d)                                                                     \
    WG_ACC32(k, d), WG_ACC8(k, d, 32), WG_ACC8(k, d, 40), WG_ACC8(k, d, 48), WG_ACC8(k, d, 56)

// D[64 x 64] (=|+=) A[64 x 16] B[16 x 64], A and B K-major in shared memory.
__device__ __forceinline__ void wg_ss64_first(float (&d)[32], uint64_t da, uint64_t db)
{
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 WG_ACC32_REGS ", "
                 "%32, %33, p, 1, 1, 0, 0;\n"
                 "}\n"
                 : WG_ACC32("=f", d)
                 : "l"(da), "l"(db), "r"(0));
}
__device__ __forceinline__ void wg_ss64(float (&d)[32], uint64_t da, uint64_t db)
{
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 WG_ACC32_REGS ", "
                 "%32, %33, p, 1, 1, 0, 0;\n"
                 "}\n"
                 : WG_ACC32("+f", d)
                 : "l"(da), "l"(db), "r"(1));
}
// D[64 x N] += A[64 x 16] B[16 x N], A from registers (bf16 pairs, the
// m16n8k16 A-fragment layout per warp), B MN-major in shared memory.
__device__ __forceinline__ void wg_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db)
{
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 WG_ACC32_REGS ", "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n"
                 "}\n"
                 : WG_ACC32("+f", d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void wg_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db)
{
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 WG_ACC64_REGS ", "
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
                 "}\n"
                 : WG_ACC64("+f", d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// D[64 x N] += A[64 x 16] B[16 x N], B MN-major (transposed through the
// descriptor, as wg_rs's B), A K-major (TA 0: dflash_attn/wg_dq.cu's
// block-key dK / dV, impl WG2F) or MN-major (TA 1: dflash_attn/wg_dqs.cu's
// dQ = dS K from stored dS^T tiles, impl WG3), both in shared memory:
// scale-d 1, trans-b 1.
template <int TA = 0> __device__ __forceinline__ void wg_ss_tb(float (&d)[32], uint64_t da, uint64_t db)
{
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 WG_ACC32_REGS ", "
                 "%32, %33, p, 1, 1, %35, 1;\n"
                 "}\n"
                 : WG_ACC32("+f", d)
                 : "l"(da), "l"(db), "r"(1), "n"(TA));
}
template <int TA = 0> __device__ __forceinline__ void wg_ss_tb(float (&d)[64], uint64_t da, uint64_t db)
{
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 WG_ACC64_REGS ", "
                 "%64, %65, p, 1, 1, %67, 1;\n"
                 "}\n"
                 : WG_ACC64("+f", d)
                 : "l"(da), "l"(db), "r"(1), "n"(TA));
}

// D[64 x 16] (ACC: += | first: =) A[64 x 16] B[16 x 16] in shared memory, B
// K-major, A K-major (TA 0: the 16-key block tiles (block_size <= 16) of the
// forward and the dQ pass, 4 x less tensor work than a zero-filled 64-key
// tile) or MN-major, transposed through the descriptor (TA 1:
// dflash_attn/wg_dq.cu's block-key dK^T / dV^T, impl WG2F).
#define WG_ACC8_REGS "{%0, %1, %2, %3, %4, %5, %6, %7}"
// (the scale-d flag, operand 10: 0 on the first k step, which writes d
// without reading it: "=f", no zeroing instructions; trans-a, operand 11)
#define WG_SS16_ASM                                                                        \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"                                          \
    "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 " WG_ACC8_REGS ", %8, %9, p, 1, 1, %11, 0;\n}\n"
template <bool ACC, int TA = 0> __device__ __forceinline__ void wg_ss16(float (&d)[8], uint64_t da, uint64_t db)
{
    if constexpr (ACC)
        asm volatile(WG_SS16_ASM : WG_ACC8("+f", d, 0) : "l"(da), "l"(db), "r"(1), "n"(TA));
    else
        asm volatile(WG_SS16_ASM : WG_ACC8("=f", d, 0) : "l"(da), "l"(db), "r"(0), "n"(TA));
}

// One key tile's S = Q K^T (or dP = dO V^T) of the forward and the dQ pass:
// d[64 x 2 NS] = A[64 x 16 KS] B[2 NS x 16 KS]^T over KS k steps, A and B
// K-major tiles of AR and BR rows ([column block][rows][128 B]): NS = 32
// (m64n64) or 8 (m64n16, the 16-key block tile).
template <int NS, int KS, int AR, int BR>
__device__ __forceinline__ void wg_tile_ab(float (&d)[NS], uint64_t da, uint64_t db)
{
    static_assert(NS == 32 || NS == 8, "wg_tile_ab: 64 or 16 keys");
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        // k step ks: column block ks / 4, 32 bytes (16 bf16) apart within it
        uint32_t ao = ((ks >> 2) * (AR * 128) + (ks & 3) * 32) >> 4;
        uint32_t bo = ((ks >> 2) * (BR * 128) + (ks & 3) * 32) >> 4;
        if constexpr (NS == 32) {
            if (ks == 0)
                wg_ss64_first(d, da + ao, db + bo);
            else
                wg_ss64(d, da + ao, db + bo);
        } else {
            if (ks == 0)
                wg_ss16<false>(d, da + ao, db + bo);
            else
                wg_ss16<true>(d, da + ao, db + bo);
        }
    }
}

__device__ __forceinline__ uint32_t pack_bf2(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); // .x (low half) = lo
    return *reinterpret_cast<uint32_t *>(&v);
}

#endif // DF_WG_BODY

} // namespace
} // namespace df_dflash

#endif
