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
#include "device.h"
#include "lmhead_ce_rows.cuh"
#include "ptx_async.cuh"

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

/* Row r of the chunk (or a padding row: nothing) into this thread's shared
 * slots: group j's 8 logits as two 16-byte copies, slots j * 2 and j * 2 + 1
 * of pre[slot * CT + t]. Only this thread reads them back. */
template <int J>
__device__ __forceinline__ void prefetch(const ce_rows_args &a, int64_t r, int base, float4 *pre)
{
    if (a.codes && r >= a.nrows)
        return;
    const float *zr = a.z + r * a.ldz;
    const int t = threadIdx.x;
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int v0 = base + (j * CT + t) * 8;
        if (v0 < a.ldz) { /* a group starts below ldz (a multiple of 8): all of it is in the row */
            cp16(smem_u32(&pre[(2 * j) * CT + t]), zr + v0);
            cp16(smem_u32(&pre[(2 * j + 1) * CT + t]), zr + v0 + 4);
        }
    }
}

template <int J>
__global__ void __launch_bounds__(CT, 1) ce_rows_cluster_kernel(const ce_rows_args a, int64_t rows)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cg::cluster_group cl = cg::this_cluster();
    extern __shared__ float4 pre[]; /* [2 J][CT]: the next row's slice, per thread */
    __shared__ float sh_m[CW];
    __shared__ int sh_i[CW];
    __shared__ double sh_s[CW];
    __shared__ float part_m[2]; /* this block's triple, read by the whole cluster; by parity */
    __shared__ int part_i[2];
    __shared__ double part_s[2];
    __shared__ float sh_mx, sh_scf;
    __shared__ double sh_sc;
    /* the row's inputs, written before any barrier of the iteration: by parity */
    __shared__ float sh_zl[2], sh_w[2];
    __shared__ double sh_c[2];
    __shared__ int sh_act[2], sh_lab[2];

    const int t = threadIdx.x, k = (int)cl.block_rank();
    const int64_t ncl = gridDim.x / CC, V = a.V;
    const int base = k * (J * CT * 8); /* V <= 2^18: ints */
    const int Vi = (int)V;
    int64_t r = blockIdx.x / CC;
    prefetch<J>(a, r, base, pre);
    cp_commit();
    for (int par = 0; r < rows; r += ncl, par ^= 1) {
        const int64_t gi = a.row0 + r;
        const bool real = !a.codes || r < a.nrows; /* else a padding row of GEMM 2's operand */
        /* 1. the slice from this thread's slots (out of the row: -inf) */
        cp_wait<0>();
        float x[J][8];
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int v0 = base + (j * CT + t) * 8;
            const float4 p0 = pre[(2 * j) * CT + t], p1 = pre[(2 * j + 1) * CT + t];
            const float f[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
#pragma unroll
            for (int i = 0; i < 8; i++)
                x[j][i] = real && v0 + i < Vi ? f[i] : -INFINITY;
        }
        /* the row's inputs and the label's logit, read before any block of
         * the cluster can write over the row (after the barrier below) */
        if (t == 0) {
            int32_t lab = real ? a.label[gi] : -1;
            float w = real && a.weight ? a.weight[gi] : 1.0f;
            int act = real && row_active(lab, w, V);
            sh_act[par] = act;
            sh_lab[par] = act ? lab : -1;
            sh_zl[par] = act ? a.z[r * a.ldz + lab] : 0.0f;
            sh_w[par] = w;
            sh_c[par] = act ? (double)w / a.denom : 0.0;
        }
        float m = -INFINITY;
        int am = INT_MAX;
#pragma unroll
        for (int j = 0; j < J; j++)
#pragma unroll
            for (int i = 0; i < 8; i++)
                if (x[j][i] > m) { /* strict: the first index of the max */
                    m = x[j][i];
                    am = base + (j * CT + t) * 8 + i;
                }
        /* every value is in registers now: the slots take the next row */
        if (r + ncl < rows)
            prefetch<J>(a, r + ncl, base, pre);
        cp_commit();
        /* p = exp(z - m) over this thread's max, kept for the gradient; the
         * sum in fp32 per group of 8 (each p <= 1), in double across groups */
        const float mt = m; /* this thread's max: its p's reference */
        double s = 0.0;
#pragma unroll
        for (int j = 0; j < J; j++) {
            float g = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                /* the max itself: exp(0) = 1 exactly (also for +inf) */
                float p = m == -INFINITY ? 0.0f : x[j][i] == m ? 1.0f : expf(x[j][i] - m);
                x[j][i] = p;
                g += p;
            }
            s += (double)g;
        }
        block_triple(m, am, s, sh_m, sh_i, sh_s);
        if (t == 0) {
            part_m[par] = m;
            part_i[par] = am;
            part_s[par] = s;
        }

        /* 2. the row's triple from the cluster's, in rank order */
        cl.sync();
        if (t == 0) {
            float M = -INFINITY;
            int I = INT_MAX;
            double S = 0.0;
            for (int q = 0; q < CC; q++)
                merge(M, I, S, *cl.map_shared_rank(&part_m[par], q),
                      *cl.map_shared_rank(&part_i[par], q), *cl.map_shared_rank(&part_s[par], q));
            const int act = sh_act[par];
            if (act) {
                double sc = sh_c[par] / S;
                sh_sc = sc;
                sh_scf = (float)sc;
            }
            if (k == 0 && real) {
                double cev = act ? ((double)M + log(S)) - (double)sh_zl[par] : 0.0;
                if (a.argmax)
                    a.argmax[gi] = I == INT_MAX ? 0 : I; /* all -inf/NaN: index 0 as the CPU */
                if (a.ce)
                    a.ce[gi] = act ? (float)cev : 0.0f;
                a.row_loss[gi] = act ? (double)sh_w[par] * cev : 0.0;
            }
            sh_mx = M;
        }
        __syncthreads();
        if (!a.want_dh)
            continue;
        /* 3. G from the registers: p rescaled to the row's max (within a
         * few ulp of the CPU's expf(z - max) * c/s); the label's entry by the
         * CPU's formula */
        const int act = sh_act[par];
        const float mx = sh_mx, scf = sh_scf;
        const float f = act && mt > -INFINITY ? scf * expf(mt - mx) : 0.0f;
        const int labv = sh_lab[par];
        const float gl = act ? ce_grad(sh_zl[par], mx, scf, sh_sc, sh_c[par], true) : 0.0f;
        uint16_t *hi = (uint16_t *)(a.z + r * a.ldz);
        uint16_t *lor = a.lo ? a.lo + r * a.ldlo : NULL;
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int v0 = base + (j * CT + t) * 8;
            const int li = labv - v0; /* the label's place in this group, if in [0, 8) */
            float g[8];
            uint32_t wv[4];
#pragma unroll
            for (int i = 0; i < 8; i++)
                g[i] = !act || v0 + i >= Vi ? 0.0f : i == li ? gl : x[j][i] * f;
#pragma unroll
            for (int i = 0; i < 8; i += 2)
                wv[i / 2] = pack2(g[i], g[i + 1]);
            const uint4 u = make_uint4(wv[0], wv[1], wv[2], wv[3]);
            if (a.codes) {
                uint32_t mb = amax8_bits(u);
#pragma unroll
                for (int d = 8; d > 0; d >>= 1)
                    mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, d));
                if (v0 >= a.kp)
                    continue;
                float fb[8], mf = bits_f(mb);
                unpack8(u, fb);
                const int e = scale_exp(mf);
                *reinterpret_cast<uint2 *>(a.codes + r * a.kp + v0) =
                    codes8(fb, ldexpf(1.0f, -e), isfinite(mf));
                if ((t & 15) == 0)
                    a.csc[(v0 / 128) * a.n_out + r] = ldexpf(1.0f, e);
                continue;
            }
            if (v0 + 8 <= Vi) { /* 16-byte aligned */
                *reinterpret_cast<uint4 *>(hi + v0) = u;
                if (lor) { /* g - hi is exact in fp32 */
                    float l[8];
                    unpack8(u, l);
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        l[i] = g[i] - l[i];
                    store8(lor + v0, l);
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    if (v0 + i >= Vi)
                        break;
                    const uint16_t h = f2bf(g[i]);
                    hi[v0 + i] = h;
                    if (lor)
                        lor[v0 + i] = f2bf(g[i] - bf2f(h));
                }
            }
        }
    }
    cl.sync(); /* the others may still read this block's last triple */
#else
    __trap(); /* never launched: usable() refuses code built below 9.0 */
#endif
}

constexpr size_t smem_bytes(int j) { return (size_t)2 * j * CT * sizeof(float4); }

template <int J>
cudaLaunchConfig_t config(int64_t clusters, cudaStream_t st, cudaLaunchAttribute *at)
{
    cudaLaunchConfig_t cfg = {};
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = CC;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3((unsigned)(clusters * CC));
    cfg.blockDim = dim3(CT);
    cfg.dynamicSmemBytes = smem_bytes(J);
    cfg.stream = st;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    return cfg;
}

/* How many clusters of variant J run at once on the current device (the
 * grid: each loops over rows), 0 where it cannot run: its code built below
 * 9.0 (a build's compute_80 PTX JIT-compiled on a newer GPU has an empty
 * body), its shared memory refused (df_cuda_func_smem: DFLASH_PORTABLE's
 * 99 KiB), no cluster fits (some MIG or MPS limits). Asked once per device
 * and J. */
template <int J> int clusters_at_once(int dev)
{
    constexpr int MAX_DEV = 64;
    static int n_of[MAX_DEV]; /* 0 not asked, else 1 + the count */
    if (dev < 0 || dev >= MAX_DEV)
        return 0;
    if (!n_of[dev]) {
        cudaFuncAttributes fa;
        cudaLaunchAttribute at[1];
        cudaLaunchConfig_t cfg = config<J>(1, 0, at);
        int n = 0;
        bool ok = cudaFuncGetAttributes(&fa, ce_rows_cluster_kernel<J>) == cudaSuccess &&
                  fa.ptxVersion >= 90 && fa.binaryVersion >= 90 &&
                  df_cuda_func_smem((const void *)ce_rows_cluster_kernel<J>, smem_bytes(J)) == 0 &&
                  cudaOccupancyMaxActiveClusters(&n, ce_rows_cluster_kernel<J>, &cfg) ==
                      cudaSuccess;
        (void)cudaGetLastError();
        n_of[dev] = 1 + (ok && n > 0 ? n : 0);
    }
    return n_of[dev] - 1;
}

template <int J> int launch(const ce_rows_args *a, int64_t rows, int dev, cudaStream_t st)
{
    const int64_t n = clusters_at_once<J>(dev);
    if (n < 1)
        return 0;
    cudaLaunchAttribute at[1];
    cudaLaunchConfig_t cfg = config<J>(rows < n ? rows : n, st, at);
    return df_cuda_fail(cudaLaunchKernelEx(&cfg, ce_rows_cluster_kernel<J>, *a, rows),
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
