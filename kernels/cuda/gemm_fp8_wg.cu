/* gemm_fp8_wg.cu - the FP8 GEMM of df_op_matmul_fp8 on Hopper's E4M3 wgmma
 * (sm_90a), from the codes and scales fp8_codes.cu writes:
 *   C [n, m] (+)= X W^T     X [n, kp] codes, sx[kb * n + row] (1 x 128)
 *                           W [m, kp] codes, scaled per 128 x 128 block
 *                           (the weight of DF_GEMM_FWD / _BWD_X) or per
 *                           1 x 128 (x^T of DF_GEMM_BWD_W: COLS)
 * C row-major (ldc), bf16 or fp32, m a multiple of 128.
 *
 * Why our own: cuBLASLt's block-scaled E4M3 GEMM ran these shapes at
 * 0.65-1.27k TFLOP/s on an H100, its dw GEMMs at or below BF16's rate
 * (docs/FP8.md). The scheme is the DeepSeek-V3 recipe's: the tensor cores
 * sum each 128-long k block of code products, and the CUDA cores add that
 * partial sum, times its row's and its column's scales (powers of two:
 * exact), into fp32 accumulators. So the products are those of the BF16
 * GEMM on the rounded operands up to the order of the sums, what
 * gemm_fp8.cu's first-call check verifies.
 *
 * A CTA computes a 128 x 128 tile of C: warpgroup 0's first thread issues
 * the TMA copies (X's and W's 128 x 128-code blocks, 16 KiB each, in the
 * 128-byte swizzle; COLS: W's 128 scales too) into STAGES slots; warpgroups
 * 1 and 2 take 64 rows each (m64n128k32 wgmmas, four per k block), and each
 * releases a slot as soon as it is done with it, so the copies run up to
 * STAGES - 1 blocks ahead. Tiles go in groups of GR row tiles, column tiles
 * outer within a group: the CTAs of a wave share their W tiles and a band
 * of X (L2 reuse). */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <stdint.h>

#include "fp8_cuda.h"
#include "ptx_async.cuh"
#include "tma.cuh"
#include "tma_map.h"
#include "wgmma.cuh"

namespace {

constexpr int BM = 128, BN = 128, BK = 128; /* tile rows, columns; codes per k block */
constexpr int STAGES = 6;
constexpr int THREADS = 384;      /* the producer's warpgroup + two consumers */
constexpr int TILE = BM * BK;     /* bytes of one operand's block (BM == BN) */
constexpr int SC_OFF = STAGES * 2 * TILE;   /* per stage: W's BN column scales (COLS) */
constexpr int BAR_OFF = SC_OFF + STAGES * BN * 4;
constexpr int SMEM = BAR_OFF + STAGES * 2 * 8 + 1024; /* + the 1024-byte alignment's slack */

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <typename CT> __device__ __forceinline__ void store2(CT *p, float a, float b, int beta1);
template <> __device__ __forceinline__ void store2<float>(float *p, float a, float b, int beta1)
{
    float2 v = make_float2(a, b);
    if (beta1) {
        float2 o = *reinterpret_cast<const float2 *>(p);
        v.x += o.x, v.y += o.y;
    }
    *reinterpret_cast<float2 *>(p) = v;
}
template <> __device__ __forceinline__ void store2<uint16_t>(uint16_t *p, float a, float b, int beta1)
{
    if (beta1) {
        __nv_bfloat162 o = *reinterpret_cast<const __nv_bfloat162 *>(p);
        a += __low2float(o), b += __high2float(o);
    }
    *reinterpret_cast<__nv_bfloat162 *>(p) = __floats2bfloat162_rn(a, b);
}

/* a consumer warp done with a slot: its release, by lane 0 once every lane
 * is (MC 2: on both CTAs' barriers, since both producers write the slot) */
template <int MC> __device__ __forceinline__ void release(uint32_t empty, uint32_t rank, int lane)
{
    __syncwarp();
    if (lane == 0) {
        mbar_arrive(empty);
        if (MC == 2)
            mbar_arrive_cluster(empty, rank ^ 1);
    }
}

/* A consumer warpgroup's part of the tile: rows cw * 64 .. + 63 (cw: its
 * index among the two) */
template <typename CT, bool COLS, int MC>
__device__ __forceinline__ void consume(const uint8_t *sm, uint32_t s0, uint32_t full0, uint32_t empty0,
                                        uint32_t rank, int rt, int ct, const float *__restrict__ sx,
                                        const float *__restrict__ sw, int64_t lds, CT *__restrict__ c,
                                        int64_t ldc, int n, int nkb, int beta1)
{
    /* the m64n128 accumulator layout: element j * 4 + e of thread (warp, lane) is row warp * 16 +
     * lane / 4 + 8 * (e / 2), column j * 8 + (lane % 4) * 2 + e % 2 */
    const int cw = (int)threadIdx.x / 128 - 1, t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
    const int r_lo = rt * BM + cw * 64 + warp * 16 + lane / 4, r_hi = r_lo + 8;
    const float *swt = sw + (int64_t)ct * lds; /* (COLS 0) */
    const float *scs = (const float *)(sm + SC_OFF) + (lane % 4) * 2; /* (COLS 1) */
    float acc[64], part[64];
#pragma unroll
    for (int i = 0; i < 64; i++)
        acc[i] = 0.0f, part[i] = 0.0f;
    reg_fence(part); /* (wgmma's registers defined once, before the loop) */
    for (int kb = 0; kb < nkb; kb++) {
        const int s = kb % STAGES;
        /* the scales first: their loads land while the wgmmas run */
        const float f_w = COLS ? 1.0f : __ldg(swt + kb);
        const float f_lo = r_lo < n ? __ldg(sx + (int64_t)kb * n + r_lo) : 0.0f;
        const float f_hi = r_hi < n ? __ldg(sx + (int64_t)kb * n + r_hi) : 0.0f;
        mbar_wait(full0 + 8 * s, (uint32_t)((kb / STAGES) & 1));
        const uint32_t xa = s0 + s * 2 * TILE + cw * 64 * BK, wa = s0 + s * 2 * TILE + TILE;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 32; kk++) /* 32 codes = 32 bytes along the swizzled rows */
            wgmma_e4m3_n128(part, wg_desc(xa + kk * 32, 16, 1024), wg_desc(wa + kk * 32, 16, 1024), kk);
        wg_commit();
        wg_wait<0>();
        reg_fence(part);
        if (COLS) { /* each column's scale from the slot, before the slot goes back */
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const float2 w2 = *reinterpret_cast<const float2 *>(scs + s * BN + j * 8);
                acc[j * 4 + 0] = fmaf(part[j * 4 + 0], f_lo * w2.x, acc[j * 4 + 0]);
                acc[j * 4 + 1] = fmaf(part[j * 4 + 1], f_lo * w2.y, acc[j * 4 + 1]);
                acc[j * 4 + 2] = fmaf(part[j * 4 + 2], f_hi * w2.x, acc[j * 4 + 2]);
                acc[j * 4 + 3] = fmaf(part[j * 4 + 3], f_hi * w2.y, acc[j * 4 + 3]);
            }
            release<MC>(empty0 + 8 * s, rank, lane);
        } else {
            release<MC>(empty0 + 8 * s, rank, lane);
            const float g_lo = f_lo * f_w, g_hi = f_hi * f_w;
#pragma unroll
            for (int j = 0; j < 16; j++) {
                acc[j * 4 + 0] = fmaf(part[j * 4 + 0], g_lo, acc[j * 4 + 0]);
                acc[j * 4 + 1] = fmaf(part[j * 4 + 1], g_lo, acc[j * 4 + 1]);
                acc[j * 4 + 2] = fmaf(part[j * 4 + 2], g_hi, acc[j * 4 + 2]);
                acc[j * 4 + 3] = fmaf(part[j * 4 + 3], g_hi, acc[j * 4 + 3]);
            }
        }
    }
    /* rows up to n (X's rows past a's are zero codes: products of zero rows,
     * as cuBLASLt writes them) */
    const int64_t col = (int64_t)ct * BN + (lane % 4) * 2;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        if (r_lo < n)
            store2<CT>(c + (int64_t)r_lo * ldc + col + j * 8, acc[j * 4 + 0], acc[j * 4 + 1], beta1);
        if (r_hi < n)
            store2<CT>(c + (int64_t)r_hi * ldc + col + j * 8, acc[j * 4 + 2], acc[j * 4 + 3], beta1);
    }
}

#endif

/* COLS 0: W's scales per 128 x 128 block, sw[(row / 128) * lds + kb]; COLS 1:
 * per row and k block (1 x 128, the dw GEMMs' x^T), sw[kb * lds + row], staged
 * through shared memory with the codes. MC 2: CTAs in clusters of two row
 * tiles of one column tile, each loading half of the W tile for both
 * (TMA multicast; map_w's box then 64 rows): 24 KiB from L2 per CTA and k
 * block instead of 32. */
template <typename CT, bool COLS, int MC>
__global__ void __launch_bounds__(THREADS, 1)
    fp8_wg_kernel(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                  const float *__restrict__ sx, const float *__restrict__ sw, int64_t lds, CT *__restrict__ c,
                  int64_t ldc, int n, int col_tiles, int nkb, int beta1)
{
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem_raw[];
    uint8_t *sm = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    const uint32_t s0 = smem_u32(sm), full0 = s0 + BAR_OFF, empty0 = full0 + STAGES * 8;

    /* the tile: groups of GR row tiles, within a group column tiles outer (MC
     * 2: the row tiles rounded up to even, so a cluster's two CTAs, adjacent
     * in x, share their column tile; a row tile past n computes zeros and
     * stores nothing) */
    constexpr int GR = 16;
    const int row_tiles = ((n + BM - 1) / BM + MC - 1) / MC * MC;
    const int per_group = GR * col_tiles;
    const int g = (int)blockIdx.x / per_group, within = (int)blockIdx.x - g * per_group;
    const int rows_g = min(GR, row_tiles - g * GR);
    const int rt = g * GR + within % rows_g, ct = within / rows_g;

    const uint32_t rank = MC == 2 ? cluster_rank() : 0;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, 8 * MC); /* each consumer warp of the cluster's CTAs */
        }
        mbar_fence_init();
    }
    if (MC == 2)
        cluster_sync(); /* the inits, before any copy or arrival from either CTA */
    else
        __syncthreads(); /* the inits, before anyone waits */

    const int wg = threadIdx.x / 128;
    if (wg == 0) { /* the producer: one thread */
        if (threadIdx.x == 0)
            for (int kb = 0; kb < nkb; kb++) {
                const int s = kb % STAGES;
                if (kb >= STAGES) /* the slot's previous block released (fill kb / STAGES - 1) */
                    mbar_wait(empty0 + 8 * s, (uint32_t)((kb / STAGES - 1) & 1));
                mbar_expect_tx(full0 + 8 * s, 2 * TILE + (COLS ? BN * 4 : 0));
                tma_load_2d(s0 + s * 2 * TILE, &map_x, kb * BK, rt * BM, full0 + 8 * s);
                if (MC == 2) /* this CTA's half of the W tile, into both CTAs */
                    tma_load_2d_mc(s0 + s * 2 * TILE + TILE + rank * (BN / 2) * BK, &map_w, kb * BK,
                                   ct * BN + (int)rank * (BN / 2), full0 + 8 * s, 3);
                else
                    tma_load_2d(s0 + s * 2 * TILE + TILE, &map_w, kb * BK, ct * BN, full0 + 8 * s);
                if (COLS)
                    bulk_load(s0 + SC_OFF + s * BN * 4, sw + kb * lds + (int64_t)ct * BN, BN * 4, full0 + 8 * s);
            }
    } else {
        consume<CT, COLS, MC>(sm, s0, full0, empty0, rank, rt, ct, sx, sw, lds, c, ldc, n, nkb, beta1);
    }
    if (MC == 2)
        cluster_sync(); /* neither CTA leaves while the other may still write to it */
#endif
}


/* a [rows, kp] code matrix as a map of 128-code x box_rows boxes in the 128-byte swizzle */
int codes_map(CUtensorMap *map, const uint8_t *q, int64_t rows, int64_t kp, uint32_t box_rows)
{
    const uint64_t dims[2] = {(uint64_t)kp, (uint64_t)rows}, strides[1] = {(uint64_t)kp};
    const uint32_t box[2] = {BK, box_rows};
    return df_cuda_tma_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, CU_TENSOR_MAP_SWIZZLE_128B, q, 2, dims,
                           strides, box);
}

} // namespace

/* the instantiation for C's dtype, W's scales and the cluster size */
template <typename CT> static const void *kernel_ct(int cols, int mc)
{
    return cols ? (mc == 2 ? (const void *)fp8_wg_kernel<CT, true, 2> : (const void *)fp8_wg_kernel<CT, true, 1>)
                : (mc == 2 ? (const void *)fp8_wg_kernel<CT, false, 2> : (const void *)fp8_wg_kernel<CT, false, 1>);
}
/* the instantiation's index, 0 .. 7 (the per-device caches below) */
static int variant_of(int c_f32, int cols, int mc) { return (c_f32 != 0) * 4 + (cols != 0) * 2 + (mc == 2); }
static const void *kernel_of(int c_f32, int cols, int mc)
{
    return c_f32 ? kernel_ct<float>(cols, mc) : kernel_ct<uint16_t>(cols, mc);
}

extern "C" int df_cuda_fp8_wg_usable(int64_t m, int64_t ldc, int c_f32, int cols, int mc)
{
    static signed char known[8][64];
    return (mc == 1 || mc == 2) && m % BN == 0 && ldc % 2 == 0 &&
           wg_kernel_runs(kernel_of(c_f32, cols, mc), SMEM,
                          known[variant_of(c_f32, cols, mc)]);
}

extern "C" int df_cuda_fp8_wg_run(cudaStream_t st, const uint8_t *qx, const float *sx, int64_t n,
                                  const uint8_t *qw, const float *sw, int cols, int64_t m, int64_t kp,
                                  void *c, int c_f32, int64_t ldc, int beta1, int mc)
{
    if (n < 1 || m < 1 || m % BN || kp < BK || kp % BK || kp > INT32_MAX || n > INT32_MAX ||
        (mc != 1 && mc != 2))
        return -EINVAL;
    const int64_t col_tiles = m / BN, row_tiles = ((n + BM - 1) / BM + mc - 1) / mc * mc;
    const int64_t tiles = col_tiles * row_tiles;
    if (tiles >= ((int64_t)1 << 31))
        return -EINVAL;
    CUtensorMap mx, mw;
    int rc = codes_map(&mx, qx, n, kp, BM);
    if (!rc)
        rc = codes_map(&mw, qw, m, kp, BN / mc);
    if (rc)
        return rc;
    const int nkb = (int)(kp / BK);
    const int64_t lds = cols ? m : (nkb + 3) / 4 * 4; /* 128 x 128: the k blocks rounded up to 4 */
    const void *fn = kernel_of(c_f32, cols, mc);
    static signed char smem_set[8][64]; /* per instantiation and device: set once */
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        (void)cudaGetLastError();
        return -EIO;
    }
    signed char *set = &smem_set[variant_of(c_f32, cols, mc)][dev];
    if (!*set) {
        if (cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM) != cudaSuccess) {
            (void)cudaGetLastError();
            return -EIO;
        }
        *set = 1;
    }
    int ni = (int)n, nct = (int)col_tiles;
    void *args[] = {&mx, &mw, &sx, &sw, (void *)&lds, &c, &ldc, &ni, &nct, (void *)&nkb, &beta1};
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    cfg.gridDim = dim3((unsigned)tiles), cfg.blockDim = dim3(THREADS), cfg.dynamicSmemBytes = SMEM;
    cfg.stream = st;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = (unsigned)mc, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr, cfg.numAttrs = mc == 2 ? 1 : 0; /* (no cluster launch for one CTA) */
    if (cudaLaunchKernelExC(&cfg, fn, args) != cudaSuccess) {
        (void)cudaGetLastError();
        return -EIO;
    }
    return 0;
}
