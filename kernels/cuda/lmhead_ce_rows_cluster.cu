/* lmhead_ce_rows_cluster.cu - the CE rows on thread-block clusters
 * (contract in lmhead_ce_rows.cuh; compute capability 9.0 and later).
 *
 * The block variant reads each fp32 row twice: at the Qwen3.6-27B shape
 * that is 7.6 GB per step read twice, which made the rows a memory pass of
 * ~7.7 ms between the head's two GEMMs. Here one cluster of CC blocks takes
 * a row: block k holds logits [k S, (k + 1) S), S = J * CT * 8, in its
 * threads' registers (J groups of 8 consecutive logits per thread), so the
 * row is read once:
 *   1. load the slice; each thread's max (first index on ties) and its sum
 *      of exp(z - max) in double; fixed shuffle and shared-memory trees give
 *      the block's triple (max, argmax, sum);
 *   2. cluster barrier; every block merges the CC triples in rank order
 *      through distributed shared memory, so all of them hold the row's
 *      bits; rank 0 writes argmax, CE and w * CE;
 *   3. with dh, each block turns its slice into G (bf16 in place, or E4M3
 *      codes: a 128-block is 16 consecutive threads' 8 logits, its amax
 *      four shuffles away).
 * In place is safe without more care: block k's bf16 writes land in the
 * first half of the row, other blocks' fp32 slices, but every block's loads
 * were consumed before it arrived at the barrier of step 2. A second
 * barrier (arrive after step 2's reads, wait before exit) keeps each
 * block's shared memory alive while the others read it.
 *
 * CC x J: the variant that fits V with the fewest registers per thread;
 * CT = 512 threads at most 128 registers, one block per SM. */
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>

#include "bf16.cuh"
#include "cuda_internal.h"
#include "e4m3.cuh"
#include "lmhead_ce_rows.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int CC = 8;       /* blocks per cluster (the portable largest) */
constexpr int CT = 512;     /* threads per block */
constexpr int CW = CT / 32; /* warps per block */

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
/* The row's triple merged along a fixed tree of shuffles (within warps),
 * then warp 0 over the warps' (sh_*). The result is thread 0's. */
__device__ __forceinline__ void block_triple(float &m, int &am, double &s, float *sh_m, int *sh_i,
                                             double *sh_s)
{
    const int t = threadIdx.x;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_down_sync(0xffffffffu, m, o);
        int i2 = __shfl_down_sync(0xffffffffu, am, o);
        double s2 = __shfl_down_sync(0xffffffffu, s, o);
        merge(m, am, s, m2, i2, s2);
    }
    if ((t & 31) == 0) {
        sh_m[t >> 5] = m;
        sh_i[t >> 5] = am;
        sh_s[t >> 5] = s;
    }
    __syncthreads();
    if (t < 32) {
        m = t < CW ? sh_m[t] : -INFINITY;
        am = t < CW ? sh_i[t] : INT_MAX;
        s = t < CW ? sh_s[t] : 0.0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float m2 = __shfl_down_sync(0xffffffffu, m, o);
            int i2 = __shfl_down_sync(0xffffffffu, am, o);
            double s2 = __shfl_down_sync(0xffffffffu, s, o);
            merge(m, am, s, m2, i2, s2);
        }
    }
}
#endif

template <int J>
__global__ void __launch_bounds__(CT, 1) ce_rows_cluster_kernel(const ce_rows_args a)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cg::cluster_group cl = cg::this_cluster();
    __shared__ float sh_m[CW];
    __shared__ int sh_i[CW];
    __shared__ double sh_s[CW];
    __shared__ float part_m; /* this block's triple, read by the whole cluster */
    __shared__ int part_i;
    __shared__ double part_s;
    __shared__ float sh_mx, sh_scf;
    __shared__ double sh_sc, sh_c;
    __shared__ int sh_act, sh_lab;

    const int t = threadIdx.x, k = (int)cl.block_rank();
    const int64_t r = blockIdx.x / CC, gi = a.row0 + r, V = a.V;
    const bool real = !a.codes || r < a.nrows; /* else a padding row of GEMM 2's operand */
    const float *zr = a.z + r * a.ldz;
    const int64_t base = (int64_t)k * (J * CT * 8);

    /* 1. the slice: all loads issued before any is used */
    float x[J][8];
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int64_t v0 = base + ((int64_t)j * CT + t) * 8;
        if (real && v0 + 8 <= V) { /* 32-byte aligned: ldz is a multiple of 8 */
            float4 p0 = __ldcs(reinterpret_cast<const float4 *>(zr + v0));
            float4 p1 = __ldcs(reinterpret_cast<const float4 *>(zr + v0 + 4));
            x[j][0] = p0.x, x[j][1] = p0.y, x[j][2] = p0.z, x[j][3] = p0.w;
            x[j][4] = p1.x, x[j][5] = p1.y, x[j][6] = p1.z, x[j][7] = p1.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++)
                x[j][i] = real && v0 + i < V ? zr[v0 + i] : -INFINITY;
        }
    }
    /* the label's logit and the row's inputs, read before any block of the
     * cluster can write over the row (after the barrier below) */
    float zl = 0.0f;
    int32_t lab = -1;
    float w = 1.0f;
    if (t == 0 && real) {
        lab = a.label[gi];
        w = a.weight ? a.weight[gi] : 1.0f;
        if (k == 0 && row_active(lab, w, V))
            zl = zr[lab];
    }
    float m = -INFINITY;
    int am = INT_MAX;
#pragma unroll
    for (int j = 0; j < J; j++)
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (x[j][i] > m) { /* strict: the first index of the max */
                m = x[j][i];
                am = (int)(base + ((int64_t)j * CT + t) * 8 + i);
            }
    double s = 0.0;
    if (m > -INFINITY) {
#pragma unroll
        for (int j = 0; j < J; j++)
#pragma unroll
            for (int i = 0; i < 8; i++) /* the max itself adds exp(0) = 1 exactly */
                s += x[j][i] == m ? 1.0 : (double)expf(x[j][i] - m);
    }
    block_triple(m, am, s, sh_m, sh_i, sh_s);
    if (t == 0) {
        part_m = m;
        part_i = am;
        part_s = s;
    }

    /* 2. the row's triple from the cluster's, in rank order */
    cl.sync();
    if (t == 0) {
        float M = -INFINITY;
        int I = INT_MAX;
        double S = 0.0;
        for (int q = 0; q < CC; q++)
            merge(M, I, S, *cl.map_shared_rank(&part_m, q), *cl.map_shared_rank(&part_i, q),
                  *cl.map_shared_rank(&part_s, q));
        const int act = real && row_active(lab, w, V);
        double cev = 0.0;
        if (act) {
            cev = ((double)M + log(S)) - (double)zl;
            double c = (double)w / a.denom, sc = c / S;
            sh_c = c;
            sh_sc = sc;
            sh_scf = (float)sc;
        }
        if (k == 0 && real) {
            if (a.argmax)
                a.argmax[gi] = I == INT_MAX ? 0 : I; /* all -inf/NaN: index 0 as the CPU */
            if (a.ce)
                a.ce[gi] = act ? (float)cev : 0.0f;
            a.row_loss[gi] = act ? (double)w * cev : 0.0;
        }
        sh_act = act;
        sh_lab = act ? lab : -1;
        sh_mx = M;
    }
    cl.barrier_arrive(); /* this block is done with the others' shared memory */
    __syncthreads();
    if (a.want_dh) {
        const int act = sh_act;
        const float mx = sh_mx, scf = sh_scf;
        const double sc = sh_sc, c = sh_c;
        const int64_t labv = sh_lab;
        /* 3. G from the registers */
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int64_t v0 = base + ((int64_t)j * CT + t) * 8;
            uint32_t wv[4];
#pragma unroll
            for (int i = 0; i < 8; i += 2) {
                uint16_t g2[2];
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const int64_t v = v0 + i + q;
                    g2[q] = act && v < V ? f2bf(ce_grad(x[j][i + q], mx, scf, sc, c, v == labv))
                                         : (uint16_t)0;
                }
                wv[i / 2] = (uint32_t)g2[0] | (uint32_t)g2[1] << 16;
            }
            const uint4 u = make_uint4(wv[0], wv[1], wv[2], wv[3]);
            if (a.codes) {
                uint32_t mb = amax8_bits(u);
#pragma unroll
                for (int d = 8; d > 0; d >>= 1)
                    mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, d));
                if (v0 >= a.kp)
                    continue;
                float f[8], mf = bits_f(mb);
                unpack8(u, f);
                const int e = scale_exp(mf);
                *reinterpret_cast<uint2 *>(a.codes + r * a.kp + v0) =
                    codes8(f, ldexpf(1.0f, -e), isfinite(mf));
                if ((t & 15) == 0)
                    a.csc[(v0 / 128) * a.n_out + r] = ldexpf(1.0f, e);
                continue;
            }
            uint16_t *hi = (uint16_t *)(a.z + r * a.ldz);
            uint16_t *lor = a.lo ? a.lo + r * a.ldlo : NULL;
            if (v0 + 8 <= V) { /* 16-byte aligned */
                *reinterpret_cast<uint4 *>(hi + v0) = u;
                if (lor) {
                    uint16_t l8[8];
#pragma unroll
                    for (int i = 0; i < 8; i++) /* g - hi is exact in fp32 */
                        l8[i] = act ? f2bf(ce_grad(x[j][i], mx, scf, sc, c, v0 + i == labv) -
                                           bf2f(i & 1 ? (uint16_t)(wv[i / 2] >> 16)
                                                      : (uint16_t)wv[i / 2]))
                                    : (uint16_t)0;
                    *reinterpret_cast<uint4 *>(lor + v0) =
                        make_uint4((uint32_t)l8[0] | (uint32_t)l8[1] << 16,
                                   (uint32_t)l8[2] | (uint32_t)l8[3] << 16,
                                   (uint32_t)l8[4] | (uint32_t)l8[5] << 16,
                                   (uint32_t)l8[6] | (uint32_t)l8[7] << 16);
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const int64_t v = v0 + i;
                    if (v >= V)
                        break;
                    const uint16_t h = i & 1 ? (uint16_t)(wv[i / 2] >> 16) : (uint16_t)wv[i / 2];
                    hi[v] = h;
                    if (lor)
                        lor[v] = act ? f2bf(ce_grad(x[j][i], mx, scf, sc, c, v == labv) - bf2f(h))
                                     : (uint16_t)0;
                }
            }
        }
    }
    cl.barrier_wait();
#else
    __trap(); /* never launched: usable() refuses code built below 9.0 */
#endif
}

template <int J> cudaLaunchConfig_t config(int64_t rows, cudaStream_t st, cudaLaunchAttribute *at)
{
    cudaLaunchConfig_t cfg = {};
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = CC;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3((unsigned)(rows * CC));
    cfg.blockDim = dim3(CT);
    cfg.stream = st;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    return cfg;
}

/* Whether variant J runs on the current device: its code built for 9.0 or
 * later (a build's compute_80 PTX JIT-compiled on a newer GPU has an empty
 * body) and one cluster fits (not under some MIG or MPS limits). Asked once
 * per device and J. */
template <int J> bool usable(int dev)
{
    constexpr int MAX_DEV = 64;
    static int ok[MAX_DEV]; /* 0 not asked, 1 yes, 2 no */
    if (dev < 0 || dev >= MAX_DEV)
        return false;
    if (!ok[dev]) {
        cudaFuncAttributes fa;
        cudaLaunchAttribute at[1];
        cudaLaunchConfig_t cfg = config<J>(1, 0, at);
        int n = 0;
        bool yes = cudaFuncGetAttributes(&fa, ce_rows_cluster_kernel<J>) == cudaSuccess &&
                   fa.ptxVersion >= 90 && fa.binaryVersion >= 90 &&
                   cudaOccupancyMaxActiveClusters(&n, ce_rows_cluster_kernel<J>, &cfg) ==
                       cudaSuccess &&
                   n >= 1;
        (void)cudaGetLastError();
        ok[dev] = yes ? 1 : 2;
    }
    return ok[dev] == 1;
}

template <int J> int launch(const ce_rows_args *a, int64_t rows, int dev, cudaStream_t st)
{
    if (!usable<J>(dev))
        return 0;
    cudaLaunchAttribute at[1];
    cudaLaunchConfig_t cfg = config<J>(rows, st, at);
    return df_cuda_fail(cudaLaunchKernelEx(&cfg, ce_rows_cluster_kernel<J>, *a),
                        "lmhead_ce rows (cluster)")
               ? -EIO
               : 1;
}

} // namespace

int ce_rows_cluster(const ce_rows_args *a, cudaStream_t st)
{
    static_assert((int64_t)CC * CT * 8 * 8 == CE_CLUSTER_MAX_V, "J = 8 covers the largest V");
    const int64_t per_j = (int64_t)CC * CT * 8, J = (a->V + per_j - 1) / per_j;
    int dev = 0;
    if (a->V < 1 || J > 8 || cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    const int64_t rows = a->codes ? a->n_out : a->nrows;
    if (rows < 1)
        return 1;
    switch (J) {
    case 1: return launch<1>(a, rows, dev, st);
    case 2: return launch<2>(a, rows, dev, st);
    case 3: return launch<3>(a, rows, dev, st);
    case 4: return launch<4>(a, rows, dev, st);
    case 5: return launch<5>(a, rows, dev, st);
    case 6: return launch<6>(a, rows, dev, st);
    case 7: return launch<7>(a, rows, dev, st);
    default: return launch<8>(a, rows, dev, st);
    }
}
