/* lmhead_onepass.cu - DF_CE_FP8_ONEPASS on the E4M3 tensor cores (contract
 * in train_ops.h; CPU reference kernels/cpu/lmhead_ce.c): the softmax part
 * Gp of a chunk's rows written as GEMM 2's codes in one read of the logits,
 * and dh with the one-hot term.
 *
 * Why one read: the two-pass rows (lmhead_ce.cu) read a row once for its
 * statistics and again for G, because G's block scale needs the row's max
 * and sum first. Against the block's own max mb, exp(z - mb) 256 lies in
 * [0, 256] whatever the row does, so its codes can be written at once; the
 * row's factor c / s exp(mb - mx) goes into the block's FP32 scale once the
 * statistics are known (a few floats per row). The label's -c is kept out
 * of the codes and subtracted from dh in fp32, on the head's own codes (the
 * ones GEMM 1 took, kept by lmhead_ce.cu: the values GEMM 2 multiplies).
 *
 * One block of RT threads per row; each thread takes 8 consecutive logits
 * a step, so the 16 lanes of a 128-block hold it whole (its max four
 * shuffles away) and write its 128 codes as 16 8-byte stores. The row
 * statistics are merged over the block by lmhead_rows.cuh's trees: the
 * loss and argmax rules are the two-pass kernel's; the sums' order is not
 * (a thread's logits are consecutive here, strided there).
 *
 * DFLASH_CE_ROWS_OCC4 (MINB 4): 32 registers instead of 40, so 4 blocks of RT threads share an
 * SM instead of 3 and a 512-row chunk is one wave on 132 SMs instead of 1.3 (a few registers
 * spill; the same arithmetic, so the same bits).
 *
 * DFLASH_CE_ONEPASS_BSUM (BS): the row's sum from the codes' own exps
 * instead, exp(z - mb) summed per 128-block in fp32 and the blocks'
 * sums scaled by exp(mb - mx) in fp64 at the end: one expf a logit and no
 * fp64 per logit (the default takes a second expf and an fp64 add for
 * the running sum). Same codes; the sum rounds otherwise (fp32 within a
 * block), so the loss and the blocks' scales move in their last bits. */
#include <cuda_runtime.h>
#include <errno.h>
#include <stdint.h>

#include "cuda_internal.h"
#include "knobs.h"
#include "e4m3.cuh"
#include "lmhead_onepass.h"
#include "lmhead_rows.cuh"

namespace {

constexpr int OP_STEP = RT * 8;                    /* logits per step of the block */
constexpr int OP_MAXB = DF_CUDA_CE_ONEPASS_MAXV / 128; /* block maxima kept per row */

/* A thread's 8 logits from v0 (-inf past V) */
template <typename T>
__device__ __forceinline__ void load_step(const T *__restrict__ zr, int64_t v0, int64_t V, float *x)
{
    if (v0 + 8 <= V) { /* aligned: ldz is a multiple of 8 */
        load8(zr + v0, x);
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++)
            x[j] = v0 + j < V ? zld(zr + v0 + j) : -INFINITY;
    }
}

/* Row r of the chunk (logits z, row stride ldz; T one of lmhead_rows.cuh's storages): loss,
 * ce, argmax as the two-pass kernel; Gp's codes into codes[r * kp + v]
 * and block scales into sc[kb * n_out + r]. Rows from nrows up to n_out
 * (GEMM 2's rows, a multiple of 4) and ignored rows get zero codes and
 * scale 1. kp (V rounded up to 128) <= DF_CUDA_CE_ONEPASS_MAXV. */
#define ONEPASS_PARAMS                                                                             \
    const T *__restrict__ z, int64_t ldz, int64_t V, int64_t row0,                                 \
        const int32_t *__restrict__ label, const float *__restrict__ weight, double denom,         \
        int32_t *__restrict__ argmax, float *__restrict__ ce, double *__restrict__ row_loss,       \
        int64_t nrows, uint8_t *__restrict__ codes, float *__restrict__ sc, int64_t kp, int64_t n_out
#define ONEPASS_ARGS z, ldz, V, row0, label, weight, denom, argmax, ce, row_loss, nrows, codes, sc, kp, n_out
template <typename T, bool BS>
__device__ __forceinline__ void ce_row_onepass(ONEPASS_PARAMS)
{
    __shared__ float sh_mb[OP_MAXB];
    __shared__ float sh_sb[BS ? OP_MAXB : 1]; /* BS: the blocks' sums of exp(z - mb) 256 */
    __shared__ float sh_m[NW];
    __shared__ int sh_i[NW];
    __shared__ double sh_s[NW];
    __shared__ float sh_mx;
    __shared__ double sh_sc;

    const int t = threadIdx.x;
    const int64_t r = blockIdx.x, nb = kp / 128;
    uint8_t *crow = codes + r * kp;
    if (r >= nrows) { /* a padding row of GEMM 2's operand */
        for (int64_t v0 = (int64_t)t * 8; v0 < kp; v0 += OP_STEP)
            *reinterpret_cast<uint2 *>(crow + v0) = make_uint2(0u, 0u);
        for (int64_t kb = t; kb < nb; kb += RT)
            sc[kb * n_out + r] = 1.0f;
        return;
    }
    const int64_t gi = row0 + r;
    const int32_t lab = label[gi];
    const float w = weight ? weight[gi] : 1.0f;
    const int act = row_active(lab, w, V);
    const T *zr = z + r * ldz;

    float m = -INFINITY;
    int am = INT_MAX;
    double s = 0.0;
    /* the next step's 8 logits are loaded before this step's math: twice the bytes in
     * flight (the rows are bound by the loads in flight, not by the math) */
    float xn[8];
    load_step(zr, (int64_t)t * 8, V, xn);
    for (int64_t b = 0; b < kp; b += OP_STEP) { /* every thread the same steps: shuffles */
        const int64_t v0 = b + (int64_t)t * 8;
        float x[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            x[j] = xn[j];
        if (b + OP_STEP < kp)
            load_step(zr, v0 + OP_STEP, V, xn);
        /* the row's statistics, in increasing index order (the two-pass rule) */
        if (!BS) {
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (v0 + j >= V)
                    break;
                if (x[j] > m) {
                    s = s * exp((double)m - (double)x[j]) + 1.0;
                    m = x[j];
                    am = (int)(v0 + j);
                } else if (m > -INFINITY) {
                    s += (double)expf(x[j] - m);
                }
            }
        }
        /* the 128-block's max over its 16 lanes */
        float mb = x[0];
#pragma unroll
        for (int j = 1; j < 8; j++)
            mb = x[j] > mb ? x[j] : mb;
#pragma unroll
        for (int d = 1; d < 16; d <<= 1)
            mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, d));
        uint2 cw = make_uint2(0u, 0u);
        float qs = 0.0f; /* BS: this lane's part of the block's sum (NaN left out) */
        if (act && mb > -INFINITY) {
            float q[8];
#pragma unroll
            for (int j = 0; j < 8; j++)
                q[j] = expf(x[j] - mb) * 256.0f; /* -inf past V: 0 */
            cw = codes8(q, 1.0f, true);
            if (BS)
#pragma unroll
                for (int j = 0; j < 8; j++)
                    qs += q[j] == q[j] ? q[j] : 0.0f;
        }
        if (BS) { /* the block's sum and its first max over its 16 lanes (every lane: shuffles) */
            int ib = INT_MAX;
#pragma unroll
            for (int j = 7; j >= 0; j--)
                ib = x[j] == mb ? (int)(v0 + j) : ib;
#pragma unroll
            for (int d = 1; d < 16; d <<= 1) {
                qs += __shfl_xor_sync(0xffffffffu, qs, d);
                ib = min(ib, __shfl_xor_sync(0xffffffffu, ib, d));
            }
            if (mb > m) /* the lanes' blocks in increasing order: the first max stays */
                m = mb, am = ib;
        }
        if (v0 >= kp)
            continue;
        *reinterpret_cast<uint2 *>(crow + v0) = cw;
        if ((t & 15) == 0) {
            sh_mb[v0 / 128] = mb;
            if (BS)
                sh_sb[v0 / 128] = qs;
        }
    }
    row_stats_reduce(m, am, s, sh_m, sh_i, sh_s);
    if (BS) { /* s = sum over the blocks of their sums exp(mb - mx) 2^-8, in a fixed order */
        if (t == 0)
            sh_mx = m;
        __syncthreads();
        const float mx = sh_mx;
        double part = 0.0;
        for (int64_t kb = t; kb < nb; kb += RT)
            part += sh_sb[kb] != 0.0f ? (double)sh_sb[kb] * exp((double)sh_mb[kb] - (double)mx) : 0.0;
        float mm = mx;
        int ai = INT_MAX;
        row_stats_reduce(mm, ai, part, sh_m, sh_i, sh_s); /* (equal maxima: the sums added) */
        s = part * 0x1p-8;
    }
    if (t == 0) {
        if (argmax)
            argmax[gi] = am == INT_MAX ? 0 : am; /* all -inf/NaN: index 0 as the CPU */
        double cev = 0.0;
        if (act) {
            cev = ((double)m + log(s)) - (double)zld(zr + lab);
            sh_sc = (double)w / denom / s;
        }
        if (ce)
            ce[gi] = act ? (float)cev : 0.0f;
        row_loss[gi] = act ? (double)w * cev : 0.0;
        sh_mx = m;
    }
    __syncthreads();
    for (int64_t kb = t; kb < nb; kb += RT) {
        const float mb = sh_mb[kb];
        sc[kb * n_out + r] = act && mb > -INFINITY
                                 ? (float)(sh_sc * exp((double)mb - (double)sh_mx) * 0x1p-8)
                                 : 1.0f;
    }
}

/* The kernel as the compiler allocates its registers (40: 3 blocks of RT per SM), and held to 32
 * (DFLASH_CE_ROWS_OCC4: 4 blocks per SM, a few spilled): the same code either way */
template <typename T, bool BS>
__global__ void __launch_bounds__(RT) ce_row_onepass_kernel(ONEPASS_PARAMS)
{
    ce_row_onepass<T, BS>(ONEPASS_ARGS);
}
template <typename T, bool BS>
__global__ void __launch_bounds__(RT, CE_ROWS_MINB4) ce_row_onepass_kernel4(ONEPASS_PARAMS)
{
    ce_row_onepass<T, BS>(ONEPASS_ARGS);
}

/* dh[row0 + r] = bf16(d32[r] - (f32)c head'[label]) for active rows (the
 * product and the difference each rounded: no contraction), 0 for ignored
 * ones; head' from its E4M3 codes hq [V, hkp] and 128 x 128 scales hs[rb *
 * hl4 + cb]. */
__global__ void __launch_bounds__(256)
    dh_onehot_kernel(const float *__restrict__ d32, int64_t H, int64_t V, int64_t row0,
                     const int32_t *__restrict__ label, const float *__restrict__ weight,
                     double denom, const uint8_t *__restrict__ hq, int64_t hkp,
                     const float *__restrict__ hs, int64_t hl4, uint16_t *__restrict__ dh,
                     int64_t lddh)
{
    const int64_t r = blockIdx.x, gi = row0 + r;
    const int32_t lab = label[gi];
    const float w = weight ? weight[gi] : 1.0f;
    const int act = row_active(lab, w, V);
    const float *src = d32 + r * H;
    uint16_t *dst = dh + gi * lddh;
    if (!act) {
        for (int64_t k = threadIdx.x; k < H; k += blockDim.x)
            dst[k] = 0;
        return;
    }
    const float cf = (float)((double)w / denom);
    const uint8_t *wq = hq + (int64_t)lab * hkp;
    const float *ws = hs + (int64_t)(lab / 128) * hl4;
    for (int64_t k = threadIdx.x; k < H; k += blockDim.x)
        dst[k] = f2bf(__fsub_rn(src[k], __fmul_rn(cf, e4m3_value(wq[k]) * ws[k / 128])));
}

/* the row kernel for the logits' storage zt, with or without BS, at 3 (MINB 1) or 4 blocks per SM */
template <bool BS, int MINB>
void launch_rows(cudaStream_t st, int zt, unsigned nb, const void *z, int64_t ldz, int64_t V,
                 int64_t row0, const int32_t *label, const float *weight, double denom,
                 int32_t *argmax, float *ce, double *row_loss, int64_t nrows,
                 const df_cuda_fp8_rows *g8)
{
    if (zt == Z_BF16)
        (MINB == 4 ? ce_row_onepass_kernel4<uint16_t, BS> : ce_row_onepass_kernel<uint16_t, BS>)<<<nb, RT, 0, st>>>(
            (const uint16_t *)z, ldz, V, row0, label, weight, denom, argmax, ce, row_loss, nrows,
            g8->codes, g8->scales, g8->kp, g8->n);
    else if (zt == Z_F16)
        (MINB == 4 ? ce_row_onepass_kernel4<__half, BS> : ce_row_onepass_kernel<__half, BS>)<<<nb, RT, 0, st>>>(
            (const __half *)z, ldz, V, row0, label, weight, denom, argmax, ce, row_loss, nrows,
            g8->codes, g8->scales, g8->kp, g8->n);
    else if (zt == Z_F32R16)
        (MINB == 4 ? ce_row_onepass_kernel4<f32r16, BS> : ce_row_onepass_kernel<f32r16, BS>)<<<nb, RT, 0, st>>>(
            (const f32r16 *)z, ldz, V, row0, label, weight, denom, argmax, ce, row_loss, nrows,
            g8->codes, g8->scales, g8->kp, g8->n);
    else
        (MINB == 4 ? ce_row_onepass_kernel4<float, BS> : ce_row_onepass_kernel<float, BS>)<<<nb, RT, 0, st>>>(
            (const float *)z, ldz, V, row0, label, weight, denom, argmax, ce, row_loss, nrows,
            g8->codes, g8->scales, g8->kp, g8->n);
}

} // namespace

int df_cuda_ce_onepass_rows(cudaStream_t st, int zt, const void *z, int64_t ldz,
                            int64_t V, int64_t row0, const int32_t *label, const float *weight,
                            double denom, int32_t *argmax, float *ce, double *row_loss,
                            int64_t nrows, const df_cuda_fp8_rows *g8)
{
    if (g8->kp < V || g8->kp % 128 || g8->kp > DF_CUDA_CE_ONEPASS_MAXV || g8->n < nrows ||
        ldz % 8)
        return -EINVAL;
    const unsigned nb = (unsigned)g8->n;
    void (*const k[2][2])(cudaStream_t, int, unsigned, const void *, int64_t, int64_t, int64_t,
                          const int32_t *, const float *, double, int32_t *, float *, double *,
                          int64_t, const df_cuda_fp8_rows *) = {
        {launch_rows<false, 1>, launch_rows<false, 4>}, {launch_rows<true, 1>, launch_rows<true, 4>}};
    k[df_knob_int(DF_KNOB_CE_ONEPASS_BSUM)][df_knob_int(DF_KNOB_CE_ROWS_OCC4)](
        st, zt, nb, z, ldz, V, row0, label, weight, denom, argmax, ce, row_loss, nrows, g8);
    return df_cuda_check_launch("lmhead_ce one-pass rows");
}

int df_cuda_ce_onepass_dh(cudaStream_t st, const float *d32, int64_t H, int64_t V, int64_t row0,
                          int64_t nr, const int32_t *label, const float *weight, double denom,
                          const void *head_codes, uint16_t *dh, int64_t lddh)
{
    if (nr <= 0 || H <= 0)
        return 0;
    const int64_t hkp = (H + 127) / 128 * 128, hl4 = (hkp / 128 + 3) / 4 * 4;
    size_t scales_at = 0;
    (void)df_cuda_fp8_weight_region(DF_GEMM_FWD, V, hkp, &scales_at);
    const uint8_t *hq = (const uint8_t *)head_codes;
    dh_onehot_kernel<<<(unsigned)nr, 256, 0, st>>>(d32, H, V, row0, label, weight, denom, hq, hkp,
                                                   (const float *)(hq + scales_at), hl4, dh, lddh);
    return df_cuda_check_launch("lmhead_ce one-hot dh");
}
