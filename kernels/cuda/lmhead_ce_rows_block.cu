/* lmhead_ce_rows_block.cu - the CE rows, one 512-thread block per row
 * (contract in lmhead_ce_rows.cuh): pass 1 reads the row for its max,
 * argmax and sum (online: each thread's logits in increasing index order,
 * its sum rescaled on each new max), fixed shuffle and shared-memory trees
 * merge the threads; pass 2 reads the row again for the gradient. Any GPU,
 * any V.
 *
 * In place: a row's G (hi, bf16) is written over the first half of the
 * row's own fp32 logits. The block walks the row in tiles in increasing
 * order; every thread reads its tile's logits and computes from them before
 * a __syncthreads, then writes hi for that tile. Writes of tile t land in
 * logits [t*TILE/2, (t+1)*TILE/2), all read before that barrier; later
 * tiles read only beyond (t+1)*TILE. Rows never share memory. */
#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>

#include "bf16.cuh"
#include "cuda_internal.h"
#include "e4m3.cuh"
#include "lmhead_ce_rows.cuh"

namespace {

constexpr int RT = 512;       /* threads per row block */
constexpr int RU = 8;         /* logits per thread per tile (loads in flight) */
constexpr int TILE = RT * RU; /* logits per tile */
constexpr int NW = RT / 32;   /* warps per row block */

/* Pass 2 to E4M3 codes: row r's G as ce_row_kernel's pass 2 computes it,
 * rounded to bf16, then per 1 x 128 block to codes at the block's
 * power-of-two scale, the bits fp8_codes.cu's mode 0 writes from that bf16
 * G: codes[r * kp + v] (zero past V up to kp), sc[kb * n_out + r]. Each
 * thread takes 8 consecutive logits per tile, so a block's 128 are 16
 * threads' and its amax three shuffles away. act 0: G = 0 (zero codes,
 * scale 1). */
__device__ void ce_codes_pass(const float *__restrict__ zr, int64_t V, int act, float mx,
                              float scf, double sc, double c, int64_t lab,
                              uint8_t *__restrict__ codes, float *__restrict__ csc, int64_t kp,
                              int64_t n_out, int64_t r)
{
    const int t = threadIdx.x;
    for (int64_t b = 0; b < kp; b += (int64_t)RT * 8) {
        const int64_t v0 = b + (int64_t)t * 8;
        float x[8];
        if (act && v0 + 8 <= V) { /* 32-byte aligned: ldz is a multiple of 8 */
            float4 p0 = *reinterpret_cast<const float4 *>(zr + v0);
            float4 p1 = *reinterpret_cast<const float4 *>(zr + v0 + 4);
            x[0] = p0.x, x[1] = p0.y, x[2] = p0.z, x[3] = p0.w;
            x[4] = p1.x, x[5] = p1.y, x[6] = p1.z, x[7] = p1.w;
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++)
                x[j] = act && v0 + j < V ? zr[v0 + j] : 0.0f;
        }
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            uint16_t g2[2];
#pragma unroll
            for (int q = 0; q < 2; q++) {
                int64_t v = v0 + j + q;
                float g = ce_grad(x[j + q], mx, scf, sc, c, v == lab);
                g2[q] = act && v < V ? f2bf(g) : (uint16_t)0;
            }
            w[j / 2] = (uint32_t)g2[0] | (uint32_t)g2[1] << 16;
        }
        uint4 u = make_uint4(w[0], w[1], w[2], w[3]);
        uint32_t mb = amax8_bits(u);
#pragma unroll
        for (int d = 8; d > 0; d >>= 1)
            mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, d));
        if (v0 >= kp)
            continue;
        float v[8], m = bits_f(mb);
        unpack8(u, v);
        int e = scale_exp(m);
        *reinterpret_cast<uint2 *>(codes + r * kp + v0) = codes8(v, ldexpf(1.0f, -e), isfinite(m));
        if ((t & 15) == 0)
            csc[(v0 / 128) * n_out + r] = ldexpf(1.0f, e);
    }
}

/* One block per row of the chunk. z: the chunk's logits [rows, ldz] fp32;
 * global row = row0 + blockIdx.x for label/weight/argmax/ce/row_loss. With
 * want_dh, z's row becomes hi (bf16, first V entries of the row seen as
 * uint16_t) and, unless lo is NULL, lo[blockIdx.x * ldlo + v] gets the low
 * halves. With codes (want_dh, FP8 on the tensor cores): G's E4M3 codes
 * instead (ce_codes_pass), and blocks from nrows up to n_out (the GEMM's
 * rows, a multiple of 4) give zero rows. */
__global__ void __launch_bounds__(RT) ce_row_kernel(float *__restrict__ z, int64_t ldz, int64_t V,
                                                    int64_t row0,
                                                    const int32_t *__restrict__ label,
                                                    const float *__restrict__ weight,
                                                    double denom, int want_dh,
                                                    uint16_t *__restrict__ lo, int64_t ldlo,
                                                    int32_t *__restrict__ argmax,
                                                    float *__restrict__ ce,
                                                    double *__restrict__ row_loss,
                                                    int64_t nrows, uint8_t *__restrict__ codes,
                                                    float *__restrict__ csc, int64_t kp,
                                                    int64_t n_out)
{
    if (codes && (int64_t)blockIdx.x >= nrows) { /* a padding row of GEMM 2's operand */
        ce_codes_pass(NULL, V, 0, 0.0f, 0.0f, 0.0, 0.0, -1, codes, csc, kp, n_out, blockIdx.x);
        return;
    }
    __shared__ float sh_m[NW];
    __shared__ int sh_i[NW];
    __shared__ double sh_s[NW];
    __shared__ float sh_mx, sh_scf;
    __shared__ double sh_sc, sh_c;
    __shared__ int sh_act, sh_lab;

    const int t = threadIdx.x;
    const int64_t r = blockIdx.x, gi = row0 + r;
    float *zr = z + r * ldz;

    /* Pass 1: this thread's logits in increasing index order (so a strict
     * > keeps its first max), an online sum rescaled on each new max. */
    float m = -INFINITY;
    int am = INT_MAX;
    double s = 0.0;
    for (int64_t b = 0; b < V; b += TILE) {
        float x[RU];
#pragma unroll
        for (int k = 0; k < RU; k++) {
            int64_t v = b + t + (int64_t)k * RT;
            x[k] = v < V ? zr[v] : -INFINITY;
        }
#pragma unroll
        for (int k = 0; k < RU; k++) {
            int64_t v = b + t + (int64_t)k * RT;
            if (v >= V)
                break;
            if (x[k] > m) {
                /* new max: p of the max itself is exp(0) = 1 exactly */
                s = s * exp((double)m - (double)x[k]) + 1.0;
                m = x[k];
                am = (int)v;
            } else if (m > -INFINITY) {
                s += (double)expf(x[k] - m);
            }
        }
    }
    /* Fixed trees: shuffles within each warp, then warp 0 over the warps. */
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
        m = t < NW ? sh_m[t] : -INFINITY;
        am = t < NW ? sh_i[t] : INT_MAX;
        s = t < NW ? sh_s[t] : 0.0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float m2 = __shfl_down_sync(0xffffffffu, m, o);
            int i2 = __shfl_down_sync(0xffffffffu, am, o);
            double s2 = __shfl_down_sync(0xffffffffu, s, o);
            merge(m, am, s, m2, i2, s2);
        }
    }
    if (t == 0) {
        int32_t lab = label[gi];
        float w = weight ? weight[gi] : 1.0f;
        int act = row_active(lab, w, V);
        if (argmax)
            argmax[gi] = am == INT_MAX ? 0 : am; /* all -inf/NaN: index 0 as the CPU */
        double cev = 0.0;
        if (act) {
            float zl = zr[lab]; /* read before pass 2 overwrites the row */
            cev = ((double)m + log(s)) - (double)zl;
            double c = (double)w / denom, sc = c / s;
            sh_c = c;
            sh_sc = sc;
            sh_scf = (float)sc;
        }
        if (ce)
            ce[gi] = act ? (float)cev : 0.0f;
        row_loss[gi] = act ? (double)w * cev : 0.0;
        sh_act = act;
        sh_lab = act ? lab : -1;
        sh_mx = m;
    }
    __syncthreads(); /* also: every pass-1 read of the row is done */
    if (!want_dh)
        return;
    if (codes) {
        ce_codes_pass(zr, V, sh_act, sh_mx, sh_scf, sh_sc, sh_c, sh_lab, codes, csc, kp, n_out, r);
        return;
    }

    uint16_t *hi = (uint16_t *)zr;
    uint16_t *lor = lo ? lo + r * ldlo : NULL; /* NULL: plain bf16 G, no low halves */
    if (!sh_act) { /* ignored row: G = 0 (nothing is read any more) */
        for (int64_t v = t; v < V; v += RT) {
            hi[v] = 0;
            if (lor)
                lor[v] = 0;
        }
        return;
    }
    const float mx = sh_mx, scf = sh_scf;
    const double sc = sh_sc, c = sh_c;
    const int64_t lab = sh_lab;
    /* Pass 2 (see the file comment for why the tile order makes in place
     * safe): G by ce_grad. */
    for (int64_t b = 0; b < V; b += TILE) {
        float x[RU];
        uint16_t gh[RU];
#pragma unroll
        for (int k = 0; k < RU; k++) {
            int64_t v = b + t + (int64_t)k * RT;
            x[k] = v < V ? zr[v] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < RU; k++) {
            int64_t v = b + t + (int64_t)k * RT;
            float g = ce_grad(x[k], mx, scf, sc, c, v == lab);
            gh[k] = f2bf(g);
            /* g - hi is exact in fp32; its bf16 rounding leaves ~2^-17 |g| */
            if (lo && v < V)
                lor[v] = f2bf(g - bf2f(gh[k]));
        }
        __syncthreads(); /* the tile's reads (consumed above) precede any write */
#pragma unroll
        for (int k = 0; k < RU; k++) {
            int64_t v = b + t + (int64_t)k * RT;
            if (v < V)
                hi[v] = gh[k];
        }
    }
}

} // namespace

int ce_rows_block(const ce_rows_args *a, cudaStream_t st)
{
    const int64_t n = a->codes ? a->n_out : a->nrows;
    ce_row_kernel<<<(unsigned)n, RT, 0, st>>>(a->z, a->ldz, a->V, a->row0, a->label, a->weight,
                                              a->denom, a->want_dh, a->lo, a->ldlo, a->argmax,
                                              a->ce, a->row_loss, a->nrows, a->codes, a->csc,
                                              a->kp, a->n_out);
    return df_cuda_check_launch("lmhead_ce rows");
}
