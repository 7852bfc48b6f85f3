/* lmhead_ce.cu - the fused frozen LM head + weighted cross-entropy on the
 * GPU (contract in lmhead_cuda.h / train_ops.h; CPU reference
 * kernels/cpu/lmhead_ce.c, whose per-row formulas are followed below).
 *
 * Liger-style (KERNELS.md, "Cross-entropy over a 248K vocabulary"): rows go
 * in chunks sized so the chunk's buffers stay under a bound (1 GiB); per
 * chunk
 *   1. Z = h_chunk @ head^T, fp32 out of cuBLASLt (bf16 in, fp32 accumulate)
 *   2. one block per row: max, argmax (lowest index of the max), sum of
 *      exp(z - max) in double (online: one read of the row), CE, w * CE into
 *      a per-row double; with dh, a second read of the row turns it into
 *      G = (softmax - onehot) * w / denom with the CPU's formulas, split as
 *      G = hi + lo (two bf16: hi written in place over Z, lo to a buffer)
 *   3. dh32 = hi @ head, dh32 += lo @ head (fp32 out), then dh = bf16(dh32)
 *      (0 for ignored rows).
 * Why hi + lo: cuBLASLt has no fp32 x bf16 GEMM, and G rounded to one bf16
 * (2^-9 relative per entry) adds an error as large as dh's own bf16
 * rounding; hi + lo carries G to ~2^-17, so dh's only sizeable error is its
 * final rounding, as on the CPU. The price is one more GEMM of GEMM 1's size
 * (a third of the head's time), so it is opt-in (precise mode:
 * DFLASH_CE_PRECISE=1 or df_cuda_lmhead_ce_set_precise): by default G is
 * one bf16, the error naive bf16 autograd (PyTorch, SpecForge) has, and
 * GEMM 2 is the only backward GEMM.
 * Why fp32 dh32 in between: a bf16 accumulate of the lo product would round
 * dh twice.
 * FP8 training (DF_CE_FP8_GRAD): hi is rounded to E4M3 (df_cuda_fp8_qdq,
 * 1 x 128 blocks) before GEMM 2; the reference rounds the fp32 G instead, so
 * a block may differ where bf16 rounding moved a value across a tie or the
 * block's largest value across a power of two. On the E4M3 tensor cores,
 * once GEMM 2's class has passed its check, step 2 writes hi's codes and
 * block scales straight into GEMM 2's operand (ce_codes_pass; the same bits
 * as rounding hi afterwards): no bf16 G is written, nor read back to round.
 *
 * DF_CE_BF16_LOGITS: GEMM 1 writes bf16 logits (the GEMM rounds them once,
 * as the CPU rounds its fp32 ones), so the rows read half the bytes; pass 1
 * reads two per 4-byte load. Everything after reads them as floats.
 *
 * In place: a row's G (hi, bf16) is written over the first half of the
 * row's own fp32 logits (over the logits themselves where they are bf16).
 * The block walks the row in tiles in increasing order; every thread reads
 * its tile's logits and computes from them before a __syncthreads, then
 * writes hi for that tile. Writes of tile t land in logits [t*TILE/2,
 * (t+1)*TILE/2) (bf16: [t*TILE, (t+1)*TILE)), all read before that barrier;
 * later tiles read only beyond (t+1)*TILE. Rows never share memory.
 *
 * Determinism: each row is one block with a fixed thread-to-element map and
 * fixed shuffle/shared reduction trees; the loss is summed over rows by one
 * block in a fixed order, independent of the chunking; cuBLASLt is bitwise
 * reproducible for a fixed algorithm on one GPU model, and the algorithm
 * for a shape is picked once (cached) and reused.
 *
 * cuBLASLt: gemm.cu's plans are private to it, so this file keeps its own
 * per-device handle and a small cache of (shape -> algorithm); descriptors
 * are cheap host objects made per call, only the heuristic query is cached.
 * The workspace is carved out of the backend scratch. */
#include <cuda_runtime.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include <cublasLt.h>

#include "bf16.cuh"
#include "cuda_internal.h"
#include "e4m3.cuh"
#include "knobs.h"
#include "fp8_cuda.h"
#include "lmhead_cuda.h"
#include "lmhead_onepass.h"
#include "lmhead_rows.cuh"

extern "C" {
#include "log.h"
}

namespace {

constexpr int LT = 1024;             /* threads of the loss-sum block */
constexpr size_t WS_BYTES = (size_t)32 << 20;           /* cuBLASLt workspace */
constexpr int PLAN_CAP = 32;
constexpr int MAX_DEV = 64;

size_t g_chunk_bytes = 0; /* test hook; 0 = DFLASH_CE_CHUNK_MIB's */
int g_fp8_codes = 1;      /* test hook: G's codes written by the row kernel */
int64_t g_fp8_fused = 0;  /* chunks whose G went to GEMM 2 as codes only, process-wide */
int64_t g_onepass = 0;    /* of those, chunks of DF_CE_FP8_ONEPASS's one pass */
int g_gemm1_bf16 = 0;     /* test hook: GEMM 1 on the BF16 path, as where the E4M3 plan refuses */
int64_t g_chunks = 0;     /* the chunks of the last call */
int g_precise = -1;       /* hi + lo gradient; -1 = not yet read from DFLASH_CE_PRECISE */

/* Pass 1's unit: the logits v, v + 1, ... a thread loads at once, one
 * 4-byte word (one fp32, two bf16; v even there), -inf past V */
__device__ __forceinline__ void zld_word(const float *zr, int64_t v, int64_t V, float *x)
{
    x[0] = v < V ? zr[v] : -INFINITY;
}
__device__ __forceinline__ void zld_word(const f32r16 *zr, int64_t v, int64_t V, float *x)
{
    x[0] = v < V ? zld(zr + v) : -INFINITY;
}
__device__ __forceinline__ void zld_word(const __half *zr, int64_t v, int64_t V, float *x)
{
    if (v + 2 <= V) { /* 4-byte aligned: rows start 16-byte aligned */
        float2 f = __half22float2(*reinterpret_cast<const __half2 *>(zr + v));
        x[0] = f.x, x[1] = f.y;
    } else {
        x[0] = v < V ? zld(zr + v) : -INFINITY;
        x[1] = -INFINITY;
    }
}
__device__ __forceinline__ void zld_word(const uint16_t *zr, int64_t v, int64_t V, float *x)
{
    if (v + 2 <= V) { /* 4-byte aligned: rows start 16-byte aligned */
        uint32_t u = *reinterpret_cast<const uint32_t *>(zr + v);
        x[0] = __uint_as_float(u << 16);
        x[1] = __uint_as_float(u & 0xffff0000u);
    } else {
        x[0] = v < V ? bf2f(zr[v]) : -INFINITY;
        x[1] = -INFINITY;
    }
}

/* A row's softmax gradient at logit v, as the CPU computes it: p = expf(z -
 * mx); G = p * (float)(c/s) (scf); the label's entry in double,
 * (float)(p * c/s - c). */
__device__ __forceinline__ float ce_grad(float z, float mx, float scf, double sc, double c,
                                         bool is_label)
{
    float p = expf(z - mx);
    return is_label ? (float)((double)p * sc - c) : p * scf;
}

/* Pass 2 to E4M3 codes: row r's G as ce_row_kernel's pass 2 computes it,
 * rounded to bf16, then per 1 x 128 block to codes at the block's
 * power-of-two scale, the bits fp8_codes.cu's mode 0 writes from that bf16
 * G: codes[r * kp + v] (zero past V up to kp), sc[kb * n_out + r]. Each
 * thread takes 8 consecutive logits per tile, so a block's 128 are 16
 * threads' and its amax three shuffles away. act 0: G = 0 (zero codes,
 * scale 1). */
template <typename T>
__device__ void ce_codes_pass(const T *__restrict__ zr, int64_t V, int act, float mx,
                              float scf, double sc, double c, int64_t lab,
                              uint8_t *__restrict__ codes, float *__restrict__ csc, int64_t kp,
                              int64_t n_out, int64_t r)
{
    const int t = threadIdx.x;
    for (int64_t b = 0; b < kp; b += (int64_t)RT * 8) {
        const int64_t v0 = b + (int64_t)t * 8;
        float x[8];
        if (act && v0 + 8 <= V) { /* aligned: ldz is a multiple of 8 */
            load8(zr + v0, x);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++)
                x[j] = act && v0 + j < V ? zld(zr + v0 + j) : 0.0f;
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
        uint32_t mb = amax16_bits(u);
        if (v0 >= kp)
            continue;
        float s = codes8_store(u, mb, codes + r * kp + v0);
        if ((t & 15) == 0)
            csc[(v0 / 128) * n_out + r] = s;
    }
}

/* One block per row of the chunk. z: the chunk's logits [rows, ldz] (T: fp32, or bf16);
 * global row = row0 + blockIdx.x for label/weight/argmax/ce/row_loss. With
 * want_dh, z's row becomes hi (bf16, first V entries of the row seen as
 * uint16_t) and, unless lo is NULL, lo[blockIdx.x * ldlo + v] gets the low
 * halves. With codes (want_dh, FP8 on the tensor cores): G's E4M3 codes
 * instead (ce_codes_pass), and blocks from nrows up to n_out (the GEMM's
 * rows, a multiple of 4) give zero rows. */
#define ROW_PARAMS                                                                                 \
    T *__restrict__ z, int64_t ldz, int64_t V, int64_t row0, const int32_t *__restrict__ label,    \
        const float *__restrict__ weight, double denom, int want_dh, uint16_t *__restrict__ lo,    \
        int64_t ldlo, int32_t *__restrict__ argmax, float *__restrict__ ce,                        \
        double *__restrict__ row_loss, int64_t nrows, uint8_t *__restrict__ codes,                 \
        float *__restrict__ csc, int64_t kp, int64_t n_out
#define ROW_ARGS                                                                                   \
    z, ldz, V, row0, label, weight, denom, want_dh, lo, ldlo, argmax, ce, row_loss, nrows, codes,  \
        csc, kp, n_out
template <typename T>
__device__ __forceinline__ void ce_row(ROW_PARAMS)
{
    if (codes && (int64_t)blockIdx.x >= nrows) { /* a padding row of GEMM 2's operand */
        ce_codes_pass((const T *)NULL, V, 0, 0.0f, 0.0f, 0.0, 0.0, -1, codes, csc, kp, n_out,
                      blockIdx.x);
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
    T *zr = z + r * ldz;

    /* Pass 1: this thread's logits in increasing index order (so a strict
     * > keeps its first max), an online sum rescaled on each new max; E
     * consecutive logits per load (a 4-byte word). */
    constexpr int E = 4 / (int)sizeof(T);
    float m = -INFINITY;
    int am = INT_MAX;
    double s = 0.0;
    for (int64_t b = 0; b < V; b += (int64_t)TILE * E) {
        float x[RU * E];
#pragma unroll
        for (int k = 0; k < RU; k++)
            zld_word(zr, b + ((int64_t)t + (int64_t)k * RT) * E, V, x + E * k);
#pragma unroll
        for (int k = 0; k < RU * E; k++) {
            int64_t v = b + ((int64_t)t + (int64_t)(k / E) * RT) * E + k % E;
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
    row_stats_reduce(m, am, s, sh_m, sh_i, sh_s);
    if (t == 0) {
        int32_t lab = label[gi];
        float w = weight ? weight[gi] : 1.0f;
        int act = row_active(lab, w, V);
        if (argmax)
            argmax[gi] = am == INT_MAX ? 0 : am; /* all -inf/NaN: index 0 as the CPU */
        double cev = 0.0;
        if (act) {
            float zl = zld(zr + lab); /* read before pass 2 overwrites the row */
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
            x[k] = v < V ? zld(zr + v) : 0.0f;
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

/* The kernel as the compiler allocates its registers (40: 3 blocks of RT per SM), and held to 32
 * (DFLASH_CE_ROWS_OCC4: 4 blocks per SM, a few spilled): the same code either way */
template <typename T> __global__ void __launch_bounds__(RT) ce_row_kernel(ROW_PARAMS)
{
    ce_row<T>(ROW_ARGS);
}
template <typename T> __global__ void __launch_bounds__(RT, CE_ROWS_MINB4) ce_row_kernel4(ROW_PARAMS)
{
    ce_row<T>(ROW_ARGS);
}

/* dh[row0 + r] = bf16(d32[r]) for active rows, 0 for ignored ones. */
__global__ void __launch_bounds__(256) dh_store_kernel(const float *__restrict__ d32, int64_t H,
                                                       int64_t V, int64_t row0,
                                                       const int32_t *__restrict__ label,
                                                       const float *__restrict__ weight,
                                                       uint16_t *__restrict__ dh, int64_t lddh)
{
    const int64_t r = blockIdx.x, gi = row0 + r;
    int act = row_active(label[gi], weight ? weight[gi] : 1.0f, V);
    const float *src = d32 + r * H;
    uint16_t *dst = dh + gi * lddh;
    for (int64_t k = threadIdx.x; k < H; k += blockDim.x)
        dst[k] = act ? f2bf(src[k]) : (uint16_t)0;
}

/* ce_row_kernel on a chunk whose logits are stored as zt says (lmhead_onepass.h's Z_*), MINB
 * blocks per SM (DFLASH_CE_ROWS_OCC4: 4, in 32 registers; else 40 registers, 3) */
template <int MINB>
void rows_launch_b(int zt, unsigned nb, cudaStream_t st, void *z, int64_t ldz, int64_t V,
                   int64_t row0, const int32_t *label, const float *weight, double denom,
                   int want_dh, uint16_t *lo, int64_t ldlo, int32_t *argmax, float *ce,
                   double *row_loss, int64_t nrows, const df_cuda_fp8_rows *g8)
{
    if (zt == Z_BF16)
        (MINB == 4 ? ce_row_kernel4<uint16_t> : ce_row_kernel<uint16_t>)<<<nb, RT, 0, st>>>((uint16_t *)z, ldz, V, row0, label, weight,
                                                         denom, want_dh, lo, ldlo, argmax, ce,
                                                         row_loss, nrows, g8->codes, g8->scales,
                                                         g8->kp, g8->n);
    else if (zt == Z_F16)
        (MINB == 4 ? ce_row_kernel4<__half> : ce_row_kernel<__half>)<<<nb, RT, 0, st>>>((__half *)z, ldz, V, row0, label, weight, denom,
                                                       want_dh, lo, ldlo, argmax, ce, row_loss, nrows,
                                                       g8->codes, g8->scales, g8->kp, g8->n);
    else if (zt == Z_F32R16)
        (MINB == 4 ? ce_row_kernel4<f32r16> : ce_row_kernel<f32r16>)<<<nb, RT, 0, st>>>((f32r16 *)z, ldz, V, row0, label, weight, denom,
                                                       want_dh, lo, ldlo, argmax, ce, row_loss, nrows,
                                                       g8->codes, g8->scales, g8->kp, g8->n);
    else
        (MINB == 4 ? ce_row_kernel4<float> : ce_row_kernel<float>)<<<nb, RT, 0, st>>>((float *)z, ldz, V, row0, label, weight, denom,
                                                      want_dh, lo, ldlo, argmax, ce, row_loss, nrows,
                                                      g8->codes, g8->scales, g8->kp, g8->n);
}

void rows_launch(int zt, unsigned nb, cudaStream_t st, void *z, int64_t ldz, int64_t V,
                 int64_t row0, const int32_t *label, const float *weight, double denom,
                 int want_dh, uint16_t *lo, int64_t ldlo, int32_t *argmax, float *ce,
                 double *row_loss, int64_t nrows, const df_cuda_fp8_rows *g8)
{
    (df_knob_int(DF_KNOB_CE_ROWS_OCC4) ? rows_launch_b<4> : rows_launch_b<1>)(
        zt, nb, st, z, ldz, V, row0, label, weight, denom, want_dh, lo, ldlo, argmax, ce, row_loss,
        nrows, g8);
}

/* out[0] = sum of x[0..n): thread t sums x[t], x[t + LT], ... in order,
 * then a fixed tree. One block: the same result for any chunking. */
__global__ void __launch_bounds__(LT) loss_sum_kernel(const double *__restrict__ x, int64_t n,
                                                      double *__restrict__ out)
{
    __shared__ double sh[LT];
    double s = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += LT)
        s += x[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = LT / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w)
            sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        out[0] = sh[0];
}

/* ---- cuBLASLt: own handle per device, cached algorithm per shape ---- */

typedef struct plan_key {
    int dev, ta, tb, c_f32;
    int64_t m, n, k, lda, ldb, ldc;
    unsigned align;
} plan_key;

typedef struct plan {
    plan_key key;
    cublasLtMatmulAlgo_t algo;
    int valid;
} plan;

pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* guards the handles and the cache */
cublasLtHandle_t g_lt[MAX_DEV];                   /* never destroyed: process lifetime */
plan g_plans[PLAN_CAP];
int g_next_plan;

int lt_fail(cublasStatus_t st, const char *what)
{
    if (st == CUBLAS_STATUS_SUCCESS)
        return 0;
    df_log(DF_LOG_ERROR, "cuda: lmhead_ce: cublasLt %s: status %d", what, (int)st);
    return -EIO;
}

unsigned align_of(const void *a, const void *b, const void *c)
{
    uintptr_t v = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c | 256;
    return (unsigned)(v & (~v + 1));
}

/* C (m x n column-major, ld ldc; bf16, or F32 if c_f32) = op(A) op(B)
 * (+ C if accumulate): A, B bf16, fp32 accumulation, C rounded once. */
int lt_gemm(cudaStream_t st, void *ws, int ta, int tb, int64_t m, int64_t n, int64_t k,
            const void *A, int64_t lda, const void *B, int64_t ldb, void *C, int64_t ldc,
            int c_f32, int accumulate)
{
    if (m == 0 || n == 0)
        return 0;
    size_t ces = c_f32 ? 4 : 2;
    if (k == 0) /* an empty sum */
        return accumulate ? 0
                          : df_cuda_fail(cudaMemset2DAsync(C, (size_t)ldc * ces, 0,
                                                           (size_t)m * ces, (size_t)n, st),
                                         "lmhead_ce zero");
    int dev = 0;
    if (df_cuda_fail(cudaGetDevice(&dev), "lmhead_ce get device"))
        return -EIO;
    if (dev < 0 || dev >= MAX_DEV) {
        df_log(DF_LOG_ERROR, "cuda: lmhead_ce: device %d out of range", dev);
        return -EIO;
    }
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t a = NULL, b = NULL, c = NULL;
    cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    uint64_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
    int rc = lt_fail(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
    if (!rc)
        rc = lt_fail(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opa,
                                                    sizeof opa),
                     "transa");
    if (!rc)
        rc = lt_fail(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &opb,
                                                    sizeof opb),
                     "transb");
    if (!rc)
        rc = lt_fail(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, ar, ac, lda), "layout a");
    if (!rc)
        rc = lt_fail(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, br, bc, ldb), "layout b");
    if (!rc)
        rc = lt_fail(cublasLtMatrixLayoutCreate(&c, c_f32 ? CUDA_R_32F : CUDA_R_16BF,
                                                (uint64_t)m, (uint64_t)n, ldc),
                     "layout c");

    plan_key key;
    memset(&key, 0, sizeof key); /* compared with memcmp: no stray padding bytes */
    key.dev = dev;
    key.ta = ta;
    key.tb = tb;
    key.c_f32 = c_f32;
    key.m = m;
    key.n = n;
    key.k = k;
    key.lda = lda;
    key.ldb = ldb;
    key.ldc = ldc;
    key.align = align_of(A, B, C);
    cublasLtMatmulAlgo_t algo;
    memset(&algo, 0, sizeof algo);
    cublasLtHandle_t lt = NULL;
    if (!rc) {
        pthread_mutex_lock(&g_mu);
        if (!g_lt[dev])
            rc = lt_fail(cublasLtCreate(&g_lt[dev]), "create");
        lt = g_lt[dev];
        int hit = -1;
        for (int i = 0; !rc && i < PLAN_CAP; i++)
            if (g_plans[i].valid && !memcmp(&g_plans[i].key, &key, sizeof key)) {
                hit = i;
                break;
            }
        if (!rc && hit >= 0) {
            algo = g_plans[hit].algo;
        } else if (!rc) {
            /* first time for this shape: ask the heuristic once */
            cublasLtMatmulPreference_t pref = NULL;
            rc = lt_fail(cublasLtMatmulPreferenceCreate(&pref), "preference");
            if (!rc) {
                uint64_t wsb = WS_BYTES;
                uint32_t al = key.align;
                cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                     &wsb, sizeof wsb);
                cublasLtMatmulPreferenceSetAttribute(
                    pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al, sizeof al);
                cublasLtMatmulPreferenceSetAttribute(
                    pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al, sizeof al);
                cublasLtMatmulPreferenceSetAttribute(
                    pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al, sizeof al);
                cublasLtMatmulPreferenceSetAttribute(
                    pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al, sizeof al);
                cublasLtMatmulHeuristicResult_t res;
                int found = 0;
                rc = lt_fail(cublasLtMatmulAlgoGetHeuristic(lt, op, a, b, c, c, pref, 1, &res,
                                                            &found),
                             "heuristic");
                if (!rc && found < 1)
                    rc = lt_fail(CUBLAS_STATUS_NOT_SUPPORTED, "no algorithm for this shape");
                if (!rc) {
                    algo = res.algo;
                    plan *p = &g_plans[g_next_plan];
                    g_next_plan = (g_next_plan + 1) % PLAN_CAP; /* round-robin eviction */
                    memcpy(&p->key, &key, sizeof key); /* padding included: memcmp'd */
                    p->algo = res.algo;
                    p->valid = 1;
                }
            }
            if (pref)
                cublasLtMatmulPreferenceDestroy(pref);
        }
        pthread_mutex_unlock(&g_mu);
    }
    if (!rc) {
        float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
        rc = lt_fail(cublasLtMatmul(lt, op, &alpha, A, a, B, b, &beta, C, c, C, c, &algo, ws,
                                    WS_BYTES, st),
                     "matmul");
    }
    /* Host-side objects: cublasLtMatmul has taken what it needs at enqueue. */
    if (c)
        cublasLtMatrixLayoutDestroy(c);
    if (b)
        cublasLtMatrixLayoutDestroy(b);
    if (a)
        cublasLtMatrixLayoutDestroy(a);
    if (op)
        cublasLtMatmulDescDestroy(op);
    return rc;
}

size_t round_up(size_t x, size_t a)
{
    return (x + a - 1) / a * a;
}

/* A matrix row stride cuBLASLt accepts (>= the row length), or -1: a row
 * stride below the length only makes sense for a single row. */
int64_t ld_of(const df_tensor *t)
{
    int64_t cols = t->shape[1];
    if (t->stride[0] >= cols && t->stride[0] >= 1)
        return t->stride[0];
    return t->shape[0] <= 1 ? (cols > 0 ? cols : 1) : -1;
}

} /* namespace */

extern "C" void df_cuda_lmhead_ce_set_fp8_codes(int on) { g_fp8_codes = on; }

extern "C" void df_cuda_lmhead_ce_set_gemm1_bf16(int on) { g_gemm1_bf16 = on; }

extern "C" int64_t df_cuda_lmhead_ce_last_chunks(void) { return g_chunks; }

extern "C" int64_t df_cuda_lmhead_ce_fp8_fused(void) { return g_fp8_fused; }

extern "C" int64_t df_cuda_lmhead_ce_onepass_chunks(void) { return g_onepass; }

extern "C" void df_cuda_lmhead_ce_set_chunk_bytes(size_t bytes)
{
    g_chunk_bytes = bytes;
}

extern "C" void df_cuda_lmhead_ce_set_precise(int on)
{
    g_precise = on ? 1 : 0;
}

/* DFLASH_CE_CHUNK_MIB (64..65536, default 1024): larger chunks give the dh
 * GEMM (H x rows, K = V) more output tiles per wave, at that much more
 * memory. */
static size_t chunk_bytes_default(void)
{
    return (size_t)df_knob_int(DF_KNOB_CE_CHUNK_MIB) << 20;
}

/* whether the chunks' bound was asked for (the test hook, or DFLASH_CE_CHUNK_MIB set to a
 * good value): it then holds even past the memory lent */
static int chunk_bytes_asked(void)
{
    return g_chunk_bytes || (df_knob_raw(DF_KNOB_CE_CHUNK_MIB) && !df_knob_bad(DF_KNOB_CE_CHUNK_MIB));
}

static int precise_mode(void)
{
    if (g_precise < 0)
        g_precise = df_knob_int(DF_KNOB_CE_PRECISE);
    return g_precise;
}

/* DF_CE_FP8_ROUND_HEAD where a BF16 GEMM must take a chunk: unless the BF16
 * GEMMs' head wb is there already, the head rounded (128 x 128) into a
 * stream-ordered copy *out (the caller frees it), which becomes wb (row
 * stride ldb) for the rest of the call */
static int head_rounded(df_backend *be, const df_tensor *head, const uint16_t **wb, int64_t *ldb,
                        uint16_t **out)
{
    if (*wb)
        return 0;
    const int64_t V = head->shape[0], H = head->shape[1];
    const size_t bytes = (size_t)(V * H) * 2;
    if (cudaMallocAsync((void **)out, bytes, df_cuda_stream(be)) != cudaSuccess) {
        (void)cudaGetLastError();
        *out = NULL;
        df_log(DF_LOG_ERROR, "cuda: lmhead_ce: no memory for the LM head's rounded copy "
               "(%.1f MiB), which the BF16 GEMMs need where the E4M3 ones refuse a chunk",
               (double)bytes / (1 << 20));
        return -ENOMEM;
    }
    df_log(DF_LOG_INFO, "cuda: lmhead_ce: the BF16 GEMMs take a chunk over: the head rounded "
           "for this call (%.1f MiB)", (double)bytes / (1 << 20));
    df_tensor r = df_tensor_2d(*out, DF_DTYPE_BF16, V, H);
    int rc = df_cuda_fp8_qdq(be, head, &r, 128, 128);
    if (!rc)
        *wb = *out, *ldb = H;
    return rc;
}

extern "C" int df_cuda_lmhead_ce(df_backend *be, const df_tensor *h, const df_tensor *head,
                                 const int32_t *label, const float *weight, float denom,
                                 double *loss_sum, df_tensor *dh, int32_t *argmax, float *ce,
                                 unsigned flags)
{
    const int64_t N = h->shape[0], H = h->shape[1], V = head->shape[0];
    if (N == 0)
        return 0;
    const int64_t ldh = ld_of(h), ldw = ld_of(head);
    if (ldh < 0 || ldw < 0) {
        df_log(DF_LOG_ERROR, "cuda: lmhead_ce: row stride below the row length");
        return -ENOTSUP;
    }
    cudaStream_t st = df_cuda_stream(be);
    /* FP8 (DF_CE_FP8_GRAD): G is rounded to E4M3 in place (hi), so no lo */
    const int fp8 = (flags & DF_CE_FP8_GRAD) != 0;
    /* FP8 on E4M3 tensor cores (gemm_fp8.cu): both GEMMs' codes in a region
     * of their own at the end of the scratch layout: the head's (V x H, for
     * either GEMM) and a chunk's rows' */
    const int fast8 = fp8 && df_cuda_fp8_gemm_possible(be);
    /* DF_CE_BF16_LOGITS: GEMM 1 writes them as bf16 (zes bytes a logit); DF_CE_F16_LOGITS:
     * as fp16 where the E4M3 tensor cores take GEMM 1, else as fp32 read as their fp16
     * rounding. Room for fp16 where the tensor cores may take GEMM 1 (twice the rows in
     * the same bytes): a chunk whose GEMM 1 they refuse then runs half as many rows */
    const int bl = (flags & DF_CE_BF16_LOGITS) != 0, f16 = (flags & DF_CE_F16_LOGITS) != 0;
    const int z16 = bl || (f16 && fast8);
    const size_t zes = z16 ? 2 : 4;
    const int want_dh = dh != NULL, want_lo = want_dh && !fp8 && precise_mode();
    const size_t hp8 = round_up((size_t)H, 128), vp8 = round_up((size_t)V, 128);
    const uint16_t *hd = (const uint16_t *)h->data, *wd = (const uint16_t *)head->data;
    df_tensor head_v = df_tensor_2d((void *)wd, DF_DTYPE_BF16, V, H);
    head_v.stride[0] = ldw;
    /* the head the BF16 GEMMs take (on the E4M3 path, chunks of a class the
     * FP8 plan refused): DF_CE_FP8_ROUND_HEAD's rounded copy is made at the
     * first such chunk (head_rounded), freed at the end */
    const uint16_t *wb = (flags & DF_CE_FP8_ROUND_HEAD) ? NULL : wd;
    int64_t ldb = ldw;
    uint16_t *w_tmp = NULL;
    /* a frozen head's codes kept across calls (DF_CE_FP8_HEAD_FROZEN), else
     * made at each call's first chunk in the scratch */
    df_cuda_fp8_kept *k1 = NULL, *k2 = NULL;
    if (fast8 && (flags & DF_CE_FP8_HEAD_FROZEN)) {
        k1 = df_cuda_fp8_kept_get(be, 0, DF_GEMM_FWD, &head_v);
        k2 = want_dh ? df_cuda_fp8_kept_get(be, 1, DF_GEMM_BWD_X, &head_v) : NULL;
    }
    const int kept = k1 && (k2 || !want_dh);
    /* DF_CE_FP8_ONEPASS where this backend can: the one-hot term reads the head's kept
     * codes; chunks whose G does not go to GEMM 2 as codes run as without it */
    const int onepass = (flags & DF_CE_FP8_ONEPASS) && kept && want_dh &&
                        (int64_t)vp8 <= DF_CUDA_CE_ONEPASS_MAXV;

    /* Row strides padded to 8 logits (32 bytes fp32, 16 bf16) and 16 bytes (lo)
     * so every row start keeps cuBLASLt's fast aligned paths whatever V is. */
    const int64_t ldz = (int64_t)round_up((size_t)V, 8);
    const int64_t ldlo = ldz;
    size_t per_row = (size_t)ldz * zes + (want_lo ? (size_t)ldlo * 2 : 0) +
                     (want_dh ? (size_t)H * 4 : 0) + (fast8 ? hp8 + vp8 : 0);
    size_t cap = g_chunk_bytes ? g_chunk_bytes : chunk_bytes_default();
    /* lent memory (df_backend_lend_scratch) of at least 512 MiB of chunk
     * buffers: chunks sized to it, so the backend's scratch need not grow (unless a bound
     * was asked for) */
    size_t fixed = round_up(WS_BYTES + (size_t)(N + 1) * 8, 256) + 1024 +
                   (fast8 && !kept ? 2 * hp8 * vp8 + ((size_t)2 << 20) : 0),
           lent = df_cuda_scratch_lent(be);
    if (!chunk_bytes_asked() && lent >= fixed + ((size_t)512 << 20) && lent - fixed < cap)
        cap = lent - fixed;
    int64_t rows = (int64_t)(cap / per_row);
    if (rows < 1)
        rows = 1;
    if (rows > N)
        rows = N;
    /* Several chunks on the E4M3 tensor cores: each a multiple of 256 rows where one holds
     * that many, the last one what is left (cuBLASLt's FP8 GEMMs pay for whole tiles of
     * rows; docs/FP8.md). Elsewhere chunks of equal size (the BF16 GEMMs gained nothing). */
    if (fast8 && rows < N && rows >= 256)
        rows = rows / 256 * 256;
    else
        rows = (N + (N + rows - 1) / rows - 1) / ((N + rows - 1) / rows);
    /* DFLASH_CE_CHUNK_ROWS: the rows asked for, whatever the memory (a measurement's knob) */
    const int64_t rows_asked = fast8 ? (int64_t)df_knob_int(DF_KNOB_CE_CHUNK_ROWS) : 0;
    if (rows_asked > 0)
        rows = (rows_asked + 3) / 4 * 4 < N ? (rows_asked + 3) / 4 * 4 : N;
    /* the FP8 GEMMs write rows rounded up to 4 (cuBLASLt's row counts) */
    const int64_t rows_c = fast8 ? (rows + 3) / 4 * 4 : rows;

    /* Scratch: [ws][row_loss N + 1 doubles][logits rows x ldz][lo][dh32]. */
    size_t o_loss = WS_BYTES;
    size_t o_z = round_up(o_loss + (size_t)(N + 1) * 8, 256);
    size_t o_lo = round_up(o_z + (size_t)rows_c * ldz * zes, 256);
    size_t o_d32 = round_up(o_lo + (want_lo ? (size_t)rows * ldlo * 2 : 0), 256);
    /* the logits' dtype GEMM 1 writes on the E4M3 tensor cores */
    const df_dtype zdt = bl ? DF_DTYPE_BF16 : f16 ? DF_DTYPE_F16 : DF_DTYPE_F32;
    /* FP8: GEMM 1's workspace (the head's codes, a chunk's h), then GEMM 2's
     * (the head^T's codes, a chunk's G): the head's codes are made at the
     * first chunk and kept for the others */
    size_t o_q8 = round_up(o_d32 + (want_dh ? (size_t)rows_c * H * 4 : 0), 256), n_q8 = 0, n_q8a = 0;
    /* the views the FP8 GEMMs see, at the largest chunk */
    if (fast8) {
        df_tensor hv = df_tensor_2d((void *)hd, DF_DTYPE_BF16, rows, H);
        df_tensor zv = df_tensor_2d(NULL, zdt, rows_c, V);
        df_tensor gv = df_tensor_2d(NULL, DF_DTYPE_BF16, rows, V), dv = df_tensor_2d(NULL, DF_DTYPE_F32, rows_c, H);
        n_q8a = round_up(df_cuda_matmul_fp8_ws_bytes(DF_GEMM_FWD, &hv, &zv, kept), 256);
        n_q8 = n_q8a + (want_dh ? df_cuda_matmul_fp8_ws_bytes(DF_GEMM_BWD_X, &gv, &dv, kept) : 0);
    }
    size_t total = o_q8 + n_q8;
    char *sc = (char *)df_cuda_scratch(be, total);
    if (!sc)
        return -ENOMEM;
    void *ws = sc;
    double *row_loss = (double *)(sc + o_loss);
    void *z = sc + o_z;
    uint16_t *lo = (uint16_t *)(sc + o_lo);
    float *d32 = (float *)(sc + o_d32);
    void *q8 = n_q8 ? sc + o_q8 : NULL, *q8b = n_q8 ? sc + o_q8 + n_q8a : NULL;
    int head8_1 = 0, head8_2 = 0; /* the head's codes in GEMM 1's / GEMM 2's workspace */

    int rc = 0;
    g_chunks = 0;
    for (int64_t r0 = 0, nr = 0; r0 < N && !rc; r0 += nr) {
        nr = N - r0 < rows ? N - r0 : rows;
        g_chunks++;
        /* GEMM 1, Z^T (V x nr, ld ldz) = op_T(head) h_chunk^T: as df_cuda_matmul, fp32 out
         * (bf16: DF_CE_BF16_LOGITS) (FP8: on E4M3 tensor cores where they are there, else as
         * in BF16) */
        int done = 0;
        if (q8 && !g_gemm1_bf16) {
            df_tensor hv = df_tensor_2d((void *)(hd + r0 * ldh), DF_DTYPE_BF16, nr, H);
            df_tensor zv = df_tensor_2d(z, zdt, (nr + 3) / 4 * 4, V);
            hv.stride[0] = ldh, zv.stride[0] = ldz;
            done = df_cuda_matmul_fp8_fast_ws(be, DF_GEMM_FWD, &hv, &head_v, &zv, 0, q8, n_q8a,
                                              kept ? k1->buf : NULL, kept ? k1->ready : head8_1, 0);
            head8_1 = done == 1;
            if (kept)
                k1->ready = done == 1;
        }
        df_cuda_prof_split(be, "gemm 1");
        if (!done)
            rc = head_rounded(be, &head_v, &wb, &ldb, &w_tmp);
        /* fp16 room, fp32 logits: the rows it holds (rows_c / 2: whole, even); the
         * chunk's others go to the next */
        if (!done && z16 && !bl && nr > rows_c / 2)
            nr = rows_c / 2;
        rc = rc        ? rc
             : done < 0 ? done
             : done     ? 0
                        : lt_gemm(st, ws, 1, 0, V, nr, H, wb, ldb, hd + r0 * ldh, ldh, z, ldz,
                                  !bl, 0);
        if (rc)
            break;
        /* how this chunk's logits are stored; G (bf16) in place over them: its row stride, in
         * bf16 */
        const int zt = bl ? Z_BF16 : !f16 ? Z_F32 : done ? Z_F16 : Z_F32R16;
        const int64_t ldg = zt == Z_BF16 || zt == Z_F16 ? ldz : 2 * ldz;
        /* FP8 on the tensor cores, GEMM 2's class checked: G goes to it as codes only */
        df_tensor gv = df_tensor_2d(z, DF_DTYPE_BF16, nr, V);
        df_tensor dv = df_tensor_2d(d32, DF_DTYPE_F32, (nr + 3) / 4 * 4, H);
        gv.stride[0] = ldg;
        df_cuda_fp8_rows g8 = {NULL, NULL, 0, 0};
        const int fused = q8 && want_dh && g_fp8_codes &&
                          df_cuda_fp8_rows_slot(be, DF_GEMM_BWD_X, &gv, &head_v, &dv, 0, q8b,
                                                n_q8 - n_q8a, kept ? k2->buf : NULL, &g8) == 1;
        df_cuda_prof_split(be, "rows");
        const unsigned nb = (unsigned)(fused ? g8.n : nr);
        /* one pass: GEMM 1 took the head's kept codes, which the one-hot term reads */
        const int one = onepass && fused && k1->ready;
        if (one)
            rc = df_cuda_ce_onepass_rows(st, zt, z, ldz, V, r0, label, weight, (double)denom,
                                         argmax, ce, row_loss, nr, &g8);
        else
            rows_launch(zt, nb, st, z, ldz, V, r0, label, weight, (double)denom, want_dh,
                        want_lo ? lo : NULL, ldlo, argmax, ce, row_loss, nr, &g8);
        if (rc || (rc = df_cuda_check_launch("lmhead_ce rows")))
            break;
        if (!want_dh)
            continue;
        /* GEMM 2, dh32^T (H x nr) = head^T G^T, hi (ld ldg bf16) then (precise) + lo,
         * as df_cuda_matmul_bwd_x with fp32 out. FP8: the tensor cores' codes are G
         * rounded (hi: [nr, V] bf16, row stride ldg); the BF16 path rounds it first. */
        done = 0;
        if (q8) {
            done = df_cuda_matmul_fp8_fast_ws(be, DF_GEMM_BWD_X, &gv, &head_v, &dv, 0, q8b,
                                              n_q8 - n_q8a, kept ? k2->buf : NULL,
                                              kept ? k2->ready : head8_2, fused);
            head8_2 = done == 1;
            if (kept)
                k2->ready = done == 1;
        }
        if (fused && done != 1) { /* G exists as codes only: nothing else can take it */
            df_log(DF_LOG_ERROR, "cuda: lmhead_ce: the FP8 GEMM refused the gradient's codes "
                   "it had accepted");
            rc = done < 0 ? done : -EIO;
            break;
        }
        g_fp8_fused += fused;
        g_onepass += one;
        if (fp8 && !done) {
            df_cuda_prof_split(be, "round");
            df_tensor g = df_tensor_2d(z, DF_DTYPE_BF16, nr, V);
            g.stride[0] = ldg;
            if ((rc = df_cuda_fp8_qdq(be, &g, &g, 1, 128)))
                break;
        }
        df_cuda_prof_split(be, "gemm 2");
        if (!done)
            rc = head_rounded(be, &head_v, &wb, &ldb, &w_tmp);
        rc = rc        ? rc
             : done < 0 ? done
             : done     ? 0
                        : lt_gemm(st, ws, 0, 0, H, nr, V, wb, ldb, z, ldg, d32, H, 1, 0);
        if (!rc && want_lo)
            rc = lt_gemm(st, ws, 0, 0, H, nr, V, wd, ldw, lo, ldlo, d32, H, 1, 1);
        if (rc)
            break;
        if (H > 0) {
            df_cuda_prof_split(be, "dh");
            if (one) {
                rc = df_cuda_ce_onepass_dh(st, d32, H, V, r0, nr, label, weight, (double)denom,
                                           k1->buf, (uint16_t *)dh->data, dh->stride[0]);
            } else {
                dh_store_kernel<<<(unsigned)nr, 256, 0, st>>>(d32, H, V, r0, label, weight,
                                                              (uint16_t *)dh->data, dh->stride[0]);
                rc = df_cuda_check_launch("lmhead_ce dh");
            }
        }
    }
    df_cuda_prof_split(be, NULL);
    if (w_tmp)
        (void)cudaFreeAsync(w_tmp, st);
    if (!rc && loss_sum) {
        double *dsum = row_loss + N;
        double hsum = 0.0;
        loss_sum_kernel<<<1, LT, 0, st>>>(row_loss, N, dsum);
        rc = df_cuda_check_launch("lmhead_ce loss sum");
        if (!rc)
            rc = df_cuda_fail(cudaMemcpyAsync(&hsum, dsum, sizeof hsum, cudaMemcpyDeviceToHost, st),
                              "lmhead_ce loss download");
        if (!rc)
            rc = df_cuda_fail(cudaStreamSynchronize(st), "lmhead_ce loss sync");
        if (!rc)
            *loss_sum += hsum;
    }
    return rc;
}
