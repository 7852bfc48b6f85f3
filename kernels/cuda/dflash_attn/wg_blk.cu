// dflash_attn/wg_blk.cu - impl DF_CUDA_DFLASH_IMPL_WG3's block pass
// (wg_dqs.cu's step 1) on Hopper warpgroup MMA (sm_90a): per (block, kv
// head), Di, the block tile's S, dP, P, dS, the block-key dK / dV and the
// block tile's dS^T for dqs_kernel. Elsewhere blk_wg_usable() is false.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>

#include "wg_bwd.cuh"

namespace df_dflash {
namespace {

// Impl WG3's block pass (dflash_attn/wg_dqs.cu's step 1), lean: one CTA
// (one warpgroup) per (block b, kv head g), no persistence, no context
// tiles, no dQ: Di (chunk_di: di_kernel's bits), the block tile's S, dP,
// P, dS (16 keys, the fold's code), the block-key dK / dV (the transposed
// fold) and the block tile's dS^T into dsbo. 44 KiB of shared memory (Q,
// dO, K_b, V_b by TMA, P^T / dS^T), so several CTAs per SM overlap their
// loads. Launched only with bs <= 16 and
// maps.qd_on.
template <int D> struct BlkLayout {
    static constexpr int NH = D / 64, QS = NH * CHUNK_ROWS * 128, BK = NH * 16 * 128;
    static constexpr int PT = 2 * QS + 2 * BK; // P^T (2 KiB), dS^T (2 KiB)
    static constexpr int BAR = PT + 4096;
    static constexpr size_t SMEM = (size_t)BAR + 8 + 1024;
};

template <int D>
__global__ void __launch_bounds__(QNT, 4)
    blk_wg_kernel(Params p, const __grid_constant__ KvMaps maps, uint16_t *dsbo, int *ctr)
{
#if DF_WG_BODY
    using L = BlkLayout<D>;
    constexpr int V8 = D / 8, KS = D / 16;
    constexpr uint32_t KM_LBO = 16, SBO = 1024;
    extern __shared__ __align__(1024) uint8_t bl_smem[];
    const uint32_t s0 = smem_u32(bl_smem), sb = (s0 + 1023u) & ~1023u;
    const int tid = threadIdx.x, lane = tid & 31, gid = lane >> 2, t4 = lane & 3;
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
    const long long ldk = (long long)p.nkv * D;
    const int g = blockIdx.x % p.nkv, b = p.nb - 1 - blockIdx.x / p.nkv;
    const RowId rid[2] = {row_id(p, b, g, 0, 16 * warp + gid), row_id(p, b, g, 0, 16 * warp + gid + 8)};
    const bool valid = p.valid[b];
    const uint32_t bar = sb + L::BAR;
    pdl_trigger(); // WG3's next kernels may launch (they wait for this one's end)
    if (blockIdx.x == 0 && tid < DS_MAX_RANGES)
        ctr[tid] = 0; // the dQ kernel's item counters (DsBuf.ctr, one per block range)
    if (valid && tid == 0) {
        mbar_init(bar, 1);
        mbar_fence_init();
        mbar_expect_tx(bar, (uint32_t)(2 * L::QS + 2 * L::BK));
#pragma unroll
        for (int cb = 0; cb < L::NH; cb++) {
            tma_load_3d(sb + cb * (CHUNK_ROWS * 128), &maps.q, 64 * cb, g * p.group, b * p.bs, bar);
            tma_load_3d(sb + L::QS + cb * (CHUNK_ROWS * 128), &maps.dout, 64 * cb, g * p.group, b * p.bs, bar);
            tma_load_2d(sb + 2 * L::QS + cb * (16 * 128), &maps.kb, g * D + 64 * cb, b * p.bs, bar);
            tma_load_2d(sb + 2 * L::QS + L::BK + cb * (16 * 128), &maps.vb, g * D + 64 * cb, b * p.bs, bar);
        }
    }
    // lse, and (valid) this thread's O for Di, while the copies land
    float Dr[2], nL[2];
    bool rok[2];
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        const long long li = (long long)rid[ri].grow * p.nq + rid[ri].h;
        const float l2 = rid[ri].ok && valid ? p.lse_in[li] * WLOG2E : -INFINITY;
        nL[ri] = -l2;
        rok[ri] = rid[ri].ok && l2 != -INFINITY;
    }
    // Di (di_kernel's bits, for the context dK/dV pass) of this thread's rows
    auto di_store = [&]() {
#pragma unroll
        for (int ri = 0; ri < 2; ri++)
            if (rid[ri].ok && t4 == 0)
                p.Di[(long long)rid[ri].grow * p.nq + rid[ri].h] = Dr[ri];
    };
    if (!valid) { // padding block: Di as di_kernel's, dkb / dvb 0 (dkv_mma2_kernel's block tiles); no dS^T (dqs_kernel writes its dq 0)
        chunk_di<D>(p, rid, t4, Dr);
        di_store();
        for (int e = tid; e < p.bs * V8; e += QNT) {
            long long off = ((long long)b * p.bs + e / V8) * ldk + (long long)g * D + (e % V8) * 8;
            *reinterpret_cast<uint4 *>(p.dkb + off) = make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4 *>(p.dvb + off) = make_uint4(0u, 0u, 0u, 0u);
        }
        return;
    }
    uint4 o[2][D / 32];
    chunk_o_load<D>(p, rid, t4, o);
    __syncthreads(); // the mbarrier's init, before anyone waits on it
    mbar_wait(bar, 0);
    // S, dP of the 16 block keys (m64n16), P, dS as in dq_wg_kernel's block tile
    const uint64_t dQ = wg_desc(sb, KM_LBO, SBO), dO = dQ + (L::QS >> 4);
    const uint64_t dK = wg_desc(sb + 2 * L::QS, KM_LBO, SBO), dV = dK + (L::BK >> 4);
    float s[8], dp[8];
    wg_fence();
    wg_tile_ab<8, KS, CHUNK_ROWS, 16>(s, dQ, dK);
    wg_commit();
    wg_tile_ab<8, KS, CHUNK_ROWS, 16>(dp, dO, dV);
    wg_commit();
    // Di from O and the landed dO (chunk_di_smem: chunk_di's bits) while the wgmmas run
    chunk_di_smem<D>(o, bl_smem + (sb + L::QS - s0), 16 * warp + gid, t4, Dr);
    di_store();
    const float sl = p.scale * WLOG2E;
    wg_wait<1>();
    reg_fence(s);
    {
        int klo[2], khi[2];
#pragma unroll
        for (int ri = 0; ri < 2; ri++)
            row_key_range(p, rid[ri], 0, rok[ri], false, 0, klo[ri], khi[ri]);
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int ri = e >> 1, key = 8 * j + 2 * t4 + (e & 1);
                const bool vis = key >= klo[ri] && key < khi[ri];
                const float x = fmaf(s[4 * j + e], sl, nL[ri]);
                s[4 * j + e] = ex2(vis ? x : -INFINITY);
            }
    }
    wg_wait<0>();
    reg_fence(dp);
    uint32_t sa[1][4]; // dS as one k step's A fragments (dq_wg_kernel's layout)
#pragma unroll
    for (int h = 0; h < 4; h++) {
        const int i = 2 * h;
        const float d0 = Dr[h & 1];
        sa[0][h] = pack_bf2(s[i] * (dp[i] - d0), s[i + 1] * (dp[i + 1] - d0));
    }
    // P^T, dS^T as [key][row] tiles, the 8-key groups below bs
    uint8_t *ptp = bl_smem + (sb + L::PT - s0);
    store_pt_ds<2>(ptp, 2048, s, sa, p.bs, warp, gid, t4);
    fence_proxy_async(); // this thread's P^T / dS^T stores -> the tensor cores ...
    __syncthreads();     // ... everyone's
    // the block tile's dS^T for dqs_kernel (generic reads: ordered by the barrier)
    dsb_store(p, b, g, tid, ptp + 2048, dsbo);
    fold16<D>(p, b, g, sb, sb + L::PT, 2048, ldk, warp, gid, t4);
#else
    __trap(); // built without sm_90a: blk_wg_usable() keeps launches away
#endif
}

} // namespace

bool blk_wg_usable(int D)
{
    static signed char known[2][64]; // [D == 128][device]
    const void *fn = D == 128 ? (const void *)blk_wg_kernel<128> : (const void *)blk_wg_kernel<64>;
    return wg_kernel_runs(fn, D == 128 ? BlkLayout<128>::SMEM : BlkLayout<64>::SMEM, known[D == 128]);
}

int blk_wg_launch(const Params &p, int D, cudaStream_t st, const KvMaps &maps, const DsBuf &dsb)
{
    const long long n = (long long)p.nb * p.nkv;
    if (n <= 0)
        return 0;
    const void *fn = D == 128 ? (const void *)blk_wg_kernel<128> : (const void *)blk_wg_kernel<64>;
    const size_t smem = D == 128 ? BlkLayout<128>::SMEM : BlkLayout<64>::SMEM;
    static signed char set[2][64]; // [D == 128][device]
    // (the largest carveout: several CTAs per SM)
    cudaError_t e = func_smem_once(fn, smem, true, set[D == 128]);
    if (e == cudaSuccess) {
        if (D == 128)
            blk_wg_kernel<128><<<(unsigned)n, QNT, smem, st>>>(p, maps, dsb.dsb, dsb.ctr);
        else
            blk_wg_kernel<64><<<(unsigned)n, QNT, smem, st>>>(p, maps, dsb.dsb, dsb.ctr);
        e = cudaGetLastError();
    }
    if (e != cudaSuccess) {
        fprintf(stderr, "dflash_attn: blk_wg_kernel<%d>: %s (%s:%d)\n", D, cudaGetErrorString(e), __FILE__, __LINE__);
        return -EIO;
    }
    return 0;
}

} // namespace df_dflash
