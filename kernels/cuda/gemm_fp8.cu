/* gemm_fp8.cu - df_op_matmul_fp8 on E4M3 tensor cores (sm_90: cuBLASLt's
 * block-scaled FP8 GEMM), behind the rounding kernels' numerics (fp8.cu): the plans, their check, the workspace.
 *
 * The operands are written (fp8_codes.cu) as E4M3 codes with FP32 scales, both K-major (the
 * "TN" layout FP8 GEMMs take), the reduction padded with zero codes to a
 * multiple of 128:
 *   y = x w^T      A = w [N, K]   (128 x 128 blocks)   B = x [M, K]    (1 x 128)
 *   dx = dy w      A = w^T [K, N] (128 x 128)          B = dy [M, N]   (1 x 128)
 *   dw = dy^T x    A = x^T [K, M] (1 x 128 along M)    B = dy^T [N, M] (1 x 128 along M,
 *                                                      or 128 x 128 under DF_FP8_DY_BLOCKS)
 * in cuBLAS's column-major terms D (m x n) = op_T(A) B with m the output's
 * columns, n its rows, as gemm.cu does for BF16. The codes and scales are
 * those of df_op_fp8_qdq's rounding (code x scale is the rounded value), so
 * the product is the one the BF16 GEMM computes on the rounded operands, up
 * to the order of the sums.
 * Scale layouts (as PyTorch's _scaled_mm passes them to cuBLASLt): a 1 x 128
 * operand of r rows has scale[kb * r + i] (rows contiguous per K block); a
 * 128 x 128 operand of r rows has scale[rb * L4 + kb], L4 = the K blocks
 * rounded up to 4.
 *
 * Trust but verify: the layouts above come from reading, not from a run on
 * this code's first GPU. So the first plan of each class (kind, C's dtype,
 * accumulate, m and n multiples of 128 or not) is checked on its call's
 * operands: the FP8 product and the BF16 GEMM on the rounded operands
 * (fp8.cu's path) go to temporaries, and only if every element agrees
 * within 2^-7 of the largest is the class used; else (or where cuBLASLt
 * refuses a shape) the BF16 path, said once in the log. A call whose BF16
 * product holds Inf or NaN decides nothing: it runs on the BF16 path and the
 * class's next call is checked. Plans are per shape
 * (the heuristic's choice); rows of varied lengths bring new shapes, not new
 * checks. DFLASH_FP8_GEMM=0 keeps every shape on the BF16 path.
 *
 * Compute capability 10 and later (B200, RTX PRO 6000 Blackwell) take the
 * same codes as MXFP8: each 128-block's power-of-two scale becomes the E8M0
 * byte of its four 32-blocks (fp8_codes.cu's mx_scales, fp8_mx.h's
 * layout), so the product is the same one; the same first-call check
 * decides, and a device whose cuBLASLt has no such plan stays on the BF16
 * path. */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cublasLt.h>

#include "bf16.cuh"
#include "cuda_internal.h"
#include "cuda_state.h"
#include "fp8_cuda.h"
#include "knobs.h"

extern "C" {
#include "log.h"
}

namespace {


/* an element of C as a float: F32, BF16 (its bits) or F16 */
__device__ __forceinline__ float c_at(const float *p) { return *p; }
__device__ __forceinline__ float c_at(const uint16_t *p) { return bf2f(*p); }
__device__ __forceinline__ float c_at(const __half *p) { return __half2float(*p); }

/* max |a - b| and max |b| over an m x n column-major pair (ld lda, ldb) into
 * r[0], r[1] (as float bits: non-negative floats order as integers) */
template <typename TA, typename TB>
__global__ void cmp_kernel(const TA *a, int64_t lda, const TB *b, int64_t ldb, int64_t m,
                           int64_t n, unsigned *r)
{
    float e = 0.0f, mx = 0.0f;
    int64_t total = m * n, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        int64_t col = i / m, row = i - col * m;
        float x = c_at(a + col * lda + row), y = c_at(b + col * ldb + row);
        float d = fabsf(x - y);
        e = d > e || d != d ? d : e;
        mx = fmaxf(mx, fabsf(y));
    }
    if (e != e)
        e = INFINITY;
    atomicMax(&r[0], __float_as_uint(e));
    atomicMax(&r[1], __float_as_uint(mx));
}

/* one plan: the key, the descriptors, the algorithm and the check's verdict */
typedef struct fp8_plan {
    int kind, cdt, accumulate, mx; /* cdt: C in BF16 (0), F32 (1), F16 (2); mx: MXFP8 scales */
    int dyblk;                       /* BWD_W's B (dy^T) per 128 x 128 (DF_FP8_DY_BLOCKS) */
    int64_t m, n, kp, ldc;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
    int state; /* 1: its class passed the check; -1: refused, or its class failed; 0: not known */
} fp8_plan;

constexpr int NPLANS = 64;

/* the backend's plans (df_cuda_state.fp8, made at first use), and the
 * check's verdict per class of plans: kind, C's dtype,
 * accumulate, and whether m and n are multiples of 128 (what a layout
 * mistake could depend on); 0 unknown, 1 agreed, -1 not */
/* x's codes kept under DF_FP8_HOLD_X, or an operand's written by the op that
 * computes it (df_cuda_fp8_made_claim): whose they are (kind, the operand (a
 * or b), the tensor's memory and view, the code matrix's rows and padded
 * reduction, dy's block shape) and the region */
typedef struct fp8_held {
    const void *x;
    int64_t rows, cols, ld, n, kp;
    int kind, mx, blk, op, ready;
    int only;   /* ready, and the tensor's values were not written (DF_FP8_ONLY_CODES) */
    int uses;   /* made: the calls it serves yet (ready until they have taken it) */
    int took_all; /* made: every call so far that took it ran on the tensor cores */
    int took;   /* the calls that took the codes ran on the tensor cores (made: all of them) */
    int proven; /* this claim's geometry is the last one's, and that one's codes were taken */
    void *buf;
    size_t bytes;
} fp8_held;

typedef struct fp8_cache {
    fp8_plan p[NPLANS];
    int n;
    signed char verdict[3][3][2][2][2][2];
    df_cuda_fp8_kept kept[DF_CUDA_FP8_KEPT];
    fp8_held held;
    fp8_held made[DF_CUDA_FP8_MADE];
} fp8_cache;

signed char *verdict_of(fp8_cache *fc, const fp8_plan *p)
{
    return &fc->verdict[p->kind][p->cdt][p->accumulate][p->m % 128 == 0][p->n % 128 == 0][p->dyblk];
}

int64_t g_fast, g_fallback;
int64_t g_x_reused;  /* calls that used x's kept codes */
int64_t g_made_reused; /* operands whose codes came from their producer */

int64_t rup(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

/* the device's compute capability major (0 where it cannot be asked: the
 * error is cleared) */
int cc_major(int device)
{
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return major;
}

/* 1 where cuBLASLt takes the scales as MXFP8: compute capability 10 and later */
int mx_of(int device) { return cc_major(device) >= 10; }

int lt_ok(cublasStatus_t st, const char *what, const fp8_plan *p)
{
    if (st == CUBLAS_STATUS_SUCCESS)
        return 1;
    df_log(DF_LOG_INFO, "cuda: fp8 gemm kind %d m=%lld n=%lld k=%lld: cublasLt %s: status %d", p->kind,
           (long long)p->m, (long long)p->n, (long long)p->kp, what, (int)st);
    return 0;
}

void plan_drop(fp8_plan *p)
{
    if (p->op)
        cublasLtMatmulDescDestroy(p->op);
    if (p->a)
        cublasLtMatrixLayoutDestroy(p->a);
    if (p->b)
        cublasLtMatrixLayoutDestroy(p->b);
    if (p->c)
        cublasLtMatrixLayoutDestroy(p->c);
    p->op = NULL, p->a = p->b = p->c = NULL;
}

/* descriptors and the heuristic's algorithm; 0 when cuBLASLt refuses */
int plan_build(df_cuda_state *s, fp8_plan *p)
{
    cublasLtHandle_t lt = (cublasLtHandle_t)s->lt;
    cudaDataType_t ct = p->cdt == 1 ? CUDA_R_32F : p->cdt == 2 ? CUDA_R_16F : CUDA_R_16BF;
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    int32_t mode_a = p->mx                     ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0
                     : p->kind == DF_GEMM_BWD_W ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                                : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    int32_t mode_b = p->mx      ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0
                     : p->dyblk ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    int8_t fast = 0;
    int ok = lt_ok(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc", p) &&
             lt_ok(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta),
                   "transa", p) &&
             lt_ok(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb),
                   "transb", p) &&
             lt_ok(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a,
                                                  sizeof mode_a), "A scale mode", p) &&
             lt_ok(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b,
                                                  sizeof mode_b), "B scale mode", p) &&
             lt_ok(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                                  sizeof fast), "fast accum", p) &&
             lt_ok(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_8F_E4M3, (uint64_t)p->kp,
                                              (uint64_t)p->m, p->kp), "A layout", p) &&
             lt_ok(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_8F_E4M3, (uint64_t)p->kp,
                                              (uint64_t)p->n, p->kp), "B layout", p) &&
             lt_ok(cublasLtMatrixLayoutCreate(&p->c, ct, (uint64_t)p->m, (uint64_t)p->n, p->ldc),
                   "C layout", p);
    /* the scale pointers must be set for the heuristic to see block scaling:
     * placeholders, replaced per call */
    const void *dummy = s->gemm_ws;
    ok = ok &&
         lt_ok(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &dummy,
                                              sizeof dummy), "A scale", p) &&
         lt_ok(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &dummy,
                                              sizeof dummy), "B scale", p);
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    size_t ws = s->gemm_ws_bytes;
    ok = ok && lt_ok(cublasLtMatmulPreferenceCreate(&pref), "preference", p) &&
         lt_ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &ws, sizeof ws), "workspace", p) &&
         lt_ok(cublasLtMatmulAlgoGetHeuristic(lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &res,
                                              &found), "heuristic", p) &&
         found > 0;
    if (pref)
        cublasLtMatmulPreferenceDestroy(pref);
    if (ok)
        p->algo = res.algo;
    return ok;
}

/* Where the operands' codes and scales go, and the workspace's size: A's
 * codes and scales (at base_a when given: a kept weight's, or x^T of
 * DF_GEMM_BWD_W held; else first in the workspace), then B's (at base_b
 * when given: x of DF_GEMM_FWD held). Each part's size depends on its own
 * rows and kp only. mx: each operand's MXFP8 scales after its FP32 ones
 * (rows rounded up to 128, kp / 32 bytes each). */
typedef struct fp8_ws {
    uint8_t *qa, *qb, *mxa, *mxb; /* mxa, mxb: NULL without mx */
    float *sa, *sb;
    size_t nsa, nsb, bytes, bytes_a, bytes_b; /* bytes: the workspace's; bytes_a, _b: each part's */
} fp8_ws;

fp8_ws ws_layout(df_gemm_kind kind, int64_t m, int64_t n, int64_t kp, char *base, char *base_a,
                 char *base_b, int mx)
{
    /* A: m rows, B: n rows, kp codes each; scales: A per its mode, B per 1 x 128 */
    int64_t kb = kp / 128, l4 = rup(kb, 4);
    size_t na = (size_t)rup(m * kp, 256), nb = (size_t)rup(n * kp, 256);
    size_t nsa = (size_t)(kind == DF_GEMM_BWD_W ? kb * m : rup(m, 128) / 128 * l4) * 4;
    /* (BWD_W: room for either of B's layouts, 1 x 128 or 128 x 128) */
    size_t nsb = (size_t)(kb * n), nsb2 = (size_t)(rup(n, 128) / 128 * l4);
    nsb = (kind == DF_GEMM_BWD_W && nsb2 > nsb ? nsb2 : nsb) * 4;
    size_t nsa_r = (size_t)rup((int64_t)nsa, 256), nsb_r = (size_t)rup((int64_t)nsb, 256);
    size_t nxa = mx ? (size_t)rup(rup(m, 128) * (kp / 32), 256) : 0;
    size_t nxb = mx ? (size_t)rup(rup(n, 128) * (kp / 32), 256) : 0;
    fp8_ws w;
    uintptr_t at = (uintptr_t)base; /* base NULL: the sizes (and the parts apart) only */
    w.bytes_a = na + nsa_r + nxa, w.bytes_b = nb + nsb_r + nxb;
    w.qa = base_a ? (uint8_t *)base_a : (uint8_t *)at;
    at += base_a ? 0 : w.bytes_a;
    w.qb = base_b ? (uint8_t *)base_b : (uint8_t *)at;
    at += base_b ? 0 : w.bytes_b;
    w.bytes = (size_t)(at - (uintptr_t)base);
    w.sa = (float *)(w.qa + na);
    w.mxa = mx ? w.qa + na + nsa_r : NULL;
    w.sb = (float *)(w.qb + nb);
    w.mxb = mx ? w.qb + nb + nsb_r : NULL;
    w.nsa = nsa;
    w.nsb = nsb;
    return w;
}

/* the operands' codes and scales into w; a_ready, b_ready: A's (the weight
 * of DF_GEMM_FWD / _BWD_X, x^T of DF_GEMM_BWD_W) or B's (x of DF_GEMM_FWD)
 * are there already, from an earlier call */
int quantize(df_backend *be, df_gemm_kind kind, const df_tensor *a, const df_tensor *b,
             int64_t m, int64_t n, int64_t kp, const fp8_ws *w, int a_ready, int b_ready, int dyblk)
{
    cudaStream_t st = df_cuda_stream(be);
    /* (DFLASH_PROFILE: each operand's rounding a part of its own; MXFP8's scale bytes, below,
     * count with the last) */
    static const char *const part[3][2] = {{"fp8 round fwd w", "fp8 round fwd x"},
                                           {"fp8 round bwd_x w", "fp8 round bwd_x dy"},
                                           {"fp8 round bwd_w x", "fp8 round bwd_w dy"}};
    if (!a_ready)
        df_cuda_prof_split(be, part[kind][0]);
    if (!a_ready && cudaMemsetAsync(w->sa, 0, w->nsa, st) != cudaSuccess)
        return df_cuda_check_launch("fp8 gemm scales");
    const uint16_t *A = (const uint16_t *)a->data, *B = (const uint16_t *)b->data;
    int64_t lda = a->stride[0], ldb = b->stride[0];
    /* 16-byte loads where the rows start 16-byte aligned */
    int va = lda % 8 == 0 && ((uintptr_t)A & 15) == 0, vb = ldb % 8 == 0 && ((uintptr_t)B & 15) == 0;
    int rc = 0;
    if (kind == DF_GEMM_BWD_W) { /* A = x^T [K, M], B = dy^T [N, M]: a = dy [M, N], b = x [M, K] */
        int64_t M = a->shape[0];
        if (!a_ready)
            rc = df_cuda_fp8_codes_run(st, 1, B, ldb, M, m, w->qa, kp, w->sa, m, vb);
        if (!rc && !b_ready) { /* dy^T: 128 x 1 blocks of dy (mode 1), or 128 x 128 (mode 3) */
            df_cuda_prof_split(be, part[kind][1]);
            if (dyblk && cudaMemsetAsync(w->sb, 0, w->nsb, st) != cudaSuccess)
                return df_cuda_check_launch("fp8 gemm scales");
            rc = df_cuda_fp8_codes_run(st, dyblk ? 3 : 1, A, lda, M, n, w->qb, kp, w->sb, n, va);
        }
    } else { /* FWD: A = w [N, K] (mode 2), B = x; BWD_X: A = w^T [K, N] (mode 3), B = dy */
        if (!a_ready) /* (the weight's values, where AdamW left them out: fp8_wcodes.cu) */
            rc = df_cuda_fp8_wcodes_fresh_t(be, b);
        if (!rc && !a_ready)
            rc = df_cuda_fp8_codes_run(st, kind == DF_GEMM_BWD_X ? 3 : 2, B, ldb, b->shape[0], b->shape[1],
                                       w->qa, kp, w->sa, m, vb);
        if (!rc && !b_ready) {
            df_cuda_prof_split(be, part[kind][1]);
            rc = df_cuda_fp8_codes_run(st, 0, A, lda, a->shape[0], a->shape[1], w->qb, kp, w->sb, n, va);
        }
    }
    if (!rc && w->mxa && !a_ready) /* A: 128 x 128 scales, or 1 x 128 (BWD_W) */
        rc = df_cuda_fp8_mx_run(st, w->sa, kind != DF_GEMM_BWD_W, m, m, kp, w->mxa);
    if (!rc && w->mxb && !b_ready)
        rc = df_cuda_fp8_mx_run(st, w->sb, dyblk, n, n, kp, w->mxb);
    return rc;
}

int run_plan(df_backend *be, df_cuda_state *s, fp8_plan *p, const fp8_ws *w, void *c, int beta1)
{
    float alpha = 1.0f, beta = beta1 ? 1.0f : 0.0f;
    const void *sa = p->mx ? (const void *)w->mxa : w->sa, *sb = p->mx ? (const void *)w->mxb : w->sb;
    if (!lt_ok(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa,
                                              sizeof sa), "A scale", p) ||
        !lt_ok(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb,
                                              sizeof sb), "B scale", p))
        return -EIO;
    cublasStatus_t st = cublasLtMatmul((cublasLtHandle_t)s->lt, p->op, &alpha, w->qa, p->a, w->qb,
                                       p->b, &beta, c, p->c, c, p->c, &p->algo, s->gemm_ws,
                                       s->gemm_ws_bytes, df_cuda_stream(be));
    return lt_ok(st, "matmul", p) ? 0 : -EIO;
}

/* The check of a new plan, on the call's operands (codes already in w): the
 * FP8 product and the BF16 GEMM on the rounded operands (its own BF16
 * copies: the scratch may be the caller's), both with beta 0 into
 * temporaries in c's layout, compared. 1: they agree; 0: not (or the check
 * could not run); -1: not decided, the BF16 product has a non-finite value
 * (operands with Inf or NaN say nothing of the layouts). Temporaries are
 * stream-ordered allocations, freed here. */
int check_plan(df_backend *be, df_cuda_state *s, fp8_plan *p, df_gemm_kind kind,
               const df_tensor *a, const df_tensor *b, const df_tensor *c, const fp8_ws *w)
{
    cudaStream_t st = df_cuda_stream(be);
    int bw = kind == DF_GEMM_BWD_W;
    /* the reference in C's dtype, F32 for an F16 C (the BF16 GEMM writes no F16) */
    size_t es = p->cdt == 1 ? 4 : 2, ee = p->cdt == 0 ? 2 : 4;
    size_t bytes = (size_t)rup((p->ldc * (p->n - 1) + p->m) * (int64_t)es, 256);
    size_t bytes_e = (size_t)rup((p->ldc * (p->n - 1) + p->m) * (int64_t)ee, 256);
    size_t ba = (size_t)rup(a->shape[0] * a->shape[1] * 2, 256);
    size_t bb = (size_t)rup(b->shape[0] * b->shape[1] * 2, 256);
    char *buf = NULL;
    unsigned r[2] = {0, 0};
    int agree = 0;
    if (cudaMallocAsync((void **)&buf, bytes_e + bytes + ba + bb + 256, st) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    void *t_emu = buf, *t_fp8 = buf + bytes_e;
    unsigned *dr = (unsigned *)(buf + bytes_e + bytes + ba + bb);
    df_tensor ra = df_tensor_2d(buf + bytes_e + bytes, DF_DTYPE_BF16, a->shape[0], a->shape[1]);
    df_tensor rb = df_tensor_2d(buf + bytes_e + bytes + ba, DF_DTYPE_BF16, b->shape[0], b->shape[1]);
    /* the rows a has (c may have up to 3 more: zero rows for cuBLASLt) */
    int64_t nr = bw ? p->n : a->shape[0];
    df_tensor te = df_tensor_2d(t_emu, p->cdt == 0 ? DF_DTYPE_BF16 : DF_DTYPE_F32, nr, c->shape[1]);
    te.stride[0] = p->ldc;
    int64_t abr, abc, bbr, bbc;
    df_fp8_operand_blocks(kind, 0, p->dyblk ? DF_FP8_DY_BLOCKS : 0, &abr, &abc);
    df_fp8_operand_blocks(kind, 1, 0, &bbr, &bbc);
    int rc = df_cuda_fp8_qdq(be, a, &ra, abr, abc);
    if (!rc)
        rc = df_cuda_fp8_qdq(be, b, &rb, bbr, bbc);
    if (!rc)
        rc = kind == DF_GEMM_FWD     ? df_cuda_matmul(be, &ra, &rb, &te, 0)
             : kind == DF_GEMM_BWD_X ? df_cuda_matmul_bwd_x(be, &ra, &rb, &te, 0)
                                     : df_cuda_matmul_bwd_w(be, &ra, &rb, &te, 0);
    if (!rc)
        rc = run_plan(be, s, p, w, t_fp8, 0);
    if (!rc && cudaMemsetAsync(dr, 0, 8, st) == cudaSuccess) {
        int64_t total = p->m * nr;
        int blocks = (int)((total + 255) / 256 < 2048 ? (total + 255) / 256 : 2048);
        if (p->cdt == 1)
            cmp_kernel<float, float><<<blocks, 256, 0, st>>>((const float *)t_fp8, p->ldc,
                                                              (const float *)t_emu, p->ldc, p->m,
                                                              nr, dr);
        else if (p->cdt == 2)
            cmp_kernel<__half, float><<<blocks, 256, 0, st>>>((const __half *)t_fp8, p->ldc,
                                                               (const float *)t_emu, p->ldc, p->m,
                                                               nr, dr);
        else
            cmp_kernel<uint16_t, uint16_t><<<blocks, 256, 0, st>>>(
                (const uint16_t *)t_fp8, p->ldc, (const uint16_t *)t_emu, p->ldc, p->m, nr, dr);
        if (cudaMemcpyAsync(r, dr, 8, cudaMemcpyDeviceToHost, st) == cudaSuccess &&
            cudaStreamSynchronize(st) == cudaSuccess) {
            float err, mx;
            memcpy(&err, &r[0], 4);
            memcpy(&mx, &r[1], 4);
            agree = !isfinite(mx) ? -1 : err <= ldexpf(mx, -7);
            df_log(agree ? DF_LOG_INFO : DF_LOG_WARN,
                   "cuda: fp8 gemm kind %d m=%lld n=%lld k=%lld: E4M3 tensor cores vs the BF16 GEMM "
                   "on the rounded operands: max diff %.3g of max %.3g: %s", (int)kind,
                   (long long)p->m, (long long)p->n, (long long)p->kp, err, mx,
                   agree > 0   ? "using them"
                   : agree < 0 ? "not decided (non-finite values): this call on the BF16 GEMM, "
                                 "the check again at the next"
                               : "this shape stays on the BF16 GEMM");
        }
    }
    (void)cudaFreeAsync(buf, st);
    (void)cudaGetLastError();
    return agree;
}

/* The plan of a call (built and checked at its first call), or NULL: not
 * this path (device, dtypes, alignment, or a plan that was refused). */
fp8_plan *plan_of(df_backend *be, df_gemm_kind kind, const df_tensor *a, const df_tensor *b,
                  const df_tensor *c, int accumulate, int dyblk, int *fresh)
{
    df_cuda_state *s = (df_cuda_state *)be->impl;
    *fresh = 0;
    if (!df_cuda_fp8_gemm_possible(be) || a->dtype != DF_DTYPE_BF16 ||
        b->dtype != DF_DTYPE_BF16 ||
        (c->dtype != DF_DTYPE_BF16 && c->dtype != DF_DTYPE_F32 && c->dtype != DF_DTYPE_F16))
        return NULL;
    /* cuBLAS terms: m = c's columns, n = c's rows, kp = the reduction padded */
    int64_t red = kind == DF_GEMM_BWD_W ? a->shape[0] : a->shape[1];
    fp8_plan key;
    memset(&key, 0, sizeof key);
    key.kind = (int)kind;
    key.cdt = c->dtype == DF_DTYPE_F32 ? 1 : c->dtype == DF_DTYPE_F16 ? 2 : 0;
    key.accumulate = accumulate != 0;
    key.m = c->shape[1];
    key.n = c->shape[0];
    key.kp = rup(red, 128);
    key.ldc = c->stride[0];
    key.mx = mx_of(s->device);
    key.dyblk = kind == DF_GEMM_BWD_W && dyblk;
    if (key.m < 1 || key.n < 1 || red < 1 || key.ldc % 8 || ((uintptr_t)c->data & 15))
        return NULL;
    /* the rounding kernels' grids: 32-bit block indices, y dimensions below 2^16 */
    if (key.m > 65535 * 64 || key.n > 65535 * 64 || key.kp > (int64_t)65535 * 128 ||
        key.n * (key.kp / 128) >= ((int64_t)1 << 31))
        return NULL;
    if (kind != DF_GEMM_BWD_W && (a->shape[0] > key.n || key.n - a->shape[0] > 3))
        return NULL; /* c's rows: a's, or a's rounded up to 4 */
    if (!s->fp8 && !(s->fp8 = calloc(1, sizeof(fp8_cache))))
        return NULL;
    fp8_cache *fc = (fp8_cache *)s->fp8;
    fp8_plan *p = NULL;
    for (int i = 0; i < fc->n && !p; i++) {
        fp8_plan *q = &fc->p[i];
        if (q->kind == key.kind && q->cdt == key.cdt && q->accumulate == key.accumulate &&
            q->m == key.m && q->n == key.n && q->kp == key.kp && q->ldc == key.ldc &&
            q->dyblk == key.dyblk)
            p = q;
    }
    if (p)
        goto verdict;
    if (fc->n == NPLANS) { /* full: the oldest goes */
        plan_drop(&fc->p[0]);
        memmove(&fc->p[0], &fc->p[1], (NPLANS - 1) * sizeof fc->p[0]);
        fc->n--;
    }
    p = &fc->p[fc->n++];
    *p = key;
    if (!plan_build(s, p)) {
        plan_drop(p);
        p->state = -1;
        df_log(DF_LOG_INFO, "cuda: fp8 gemm kind %d m=%lld n=%lld k=%lld: cuBLASLt has no "
               "block-scaled E4M3 plan; the BF16 GEMM on the rounded operands", (int)kind,
               (long long)p->m, (long long)p->n, (long long)p->kp);
        return NULL;
    }
verdict:
    /* rows and context lengths vary from row to row: a shape of a class that
     * has passed its check is trusted, one of a class that failed is not;
     * a plan whose class is unknown yet is checked at this call */
    if (p->state == 0) {
        p->state = *verdict_of(fc, p);
        *fresh = p->state == 0;
    }
    return p->state < 0 ? NULL : p;
}

} // namespace

extern "C" int64_t df_cuda_fp8_x_reused(void) { return g_x_reused; }

extern "C" int64_t df_cuda_fp8_made_reused(void) { return g_made_reused; }

extern "C" void df_cuda_fp8_gemm_counts(int64_t *fast, int64_t *fallback)
{
    *fast = g_fast, *fallback = g_fallback;
}

extern "C" void df_cuda_fp8_gemm_close(df_cuda_state *s)
{
    fp8_cache *fc = (fp8_cache *)s->fp8;
    if (!fc)
        return;
    for (int i = 0; i < fc->n; i++)
        plan_drop(&fc->p[i]);
    for (int i = 0; i < DF_CUDA_FP8_KEPT; i++)
        if (fc->kept[i].buf)
            (void)cudaFree(fc->kept[i].buf);
    if (fc->held.buf)
        (void)cudaFree(fc->held.buf);
    for (int i = 0; i < DF_CUDA_FP8_MADE; i++)
        if (fc->made[i].buf)
            (void)cudaFree(fc->made[i].buf);
    free(fc);
    s->fp8 = NULL;
}

extern "C" int df_cuda_fp8_gemm_possible(df_backend *be)
{
    return df_knob_int(DF_KNOB_FP8_GEMM) && cc_major(((df_cuda_state *)be->impl)->device) >= 9;
}

/* (compute capability 10+ takes MXFP8, which has never run on such a GPU: not verified) */
extern "C" int df_backend_fp8_tensor_cores(df_backend *be)
{
    return be && be->kind == DF_BACKEND_CUDA && df_knob_int(DF_KNOB_FP8_GEMM) &&
           cc_major(((df_cuda_state *)be->impl)->device) == 9;
}

extern "C" size_t df_cuda_matmul_fp8_ws_bytes(df_gemm_kind kind, const df_tensor *a,
                                              const df_tensor *c, int without_a)
{
    int64_t red = kind == DF_GEMM_BWD_W ? a->shape[0] : a->shape[1];
    int dev = 0; /* (the backend's device is the current one in its ops) */
    if (cudaGetDevice(&dev) != cudaSuccess)
        (void)cudaGetLastError();
    fp8_ws w = ws_layout(kind, c->shape[1], c->shape[0], rup(red, 128), NULL, NULL, NULL, mx_of(dev));
    return without_a ? w.bytes - w.bytes_a : w.bytes;
}

extern "C" size_t df_cuda_fp8_weight_region(df_gemm_kind kind, int64_t m, int64_t kp,
                                           size_t *scales_at)
{
    fp8_ws w = ws_layout(kind, m, 1, kp, NULL, NULL, NULL, 0);
    *scales_at = (size_t)((uint8_t *)w.sa - w.qa);
    return w.bytes_a;
}

extern "C" void df_cuda_fp8_kept_forget(df_backend *be)
{
    fp8_cache *fc = (fp8_cache *)((df_cuda_state *)be->impl)->fp8;
    for (int i = 0; fc && i < DF_CUDA_FP8_KEPT; i++)
        fc->kept[i].w = NULL, fc->kept[i].ready = 0;
    if (fc)
        fc->held.x = NULL, fc->held.ready = 0;
    for (int i = 0; fc && i < DF_CUDA_FP8_MADE; i++)
        fc->made[i].x = NULL, fc->made[i].ready = 0, fc->made[i].only = 0, fc->made[i].took = 0;
}

/* a device region of at least bytes: *buf kept when it is large enough,
 * else replaced (cudaFree, cudaMalloc: sizes converge, so this is rare). 0,
 * or -1 with *buf NULL (no memory; no CUDA error left behind). */
static int region_fit(void **buf, size_t *have, size_t bytes)
{
    if (*buf && *have >= bytes)
        return 0;
    if (*buf)
        (void)cudaFree(*buf);
    *buf = NULL, *have = 0;
    if (cudaMalloc(buf, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        *buf = NULL;
        return -1;
    }
    *have = bytes;
    return 0;
}

extern "C" df_cuda_fp8_kept *df_cuda_fp8_kept_get(df_backend *be, int slot, df_gemm_kind kind,
                                                  const df_tensor *w)
{
    df_cuda_state *s = (df_cuda_state *)be->impl;
    if (slot < 0 || slot >= DF_CUDA_FP8_KEPT || kind == DF_GEMM_BWD_W)
        return NULL;
    if (!s->fp8 && !(s->fp8 = calloc(1, sizeof(fp8_cache))))
        return NULL;
    df_cuda_fp8_kept *k = &((fp8_cache *)s->fp8)->kept[slot];
    if (k->w == w->data && k->kind == (int)kind && k->rows == w->shape[0] &&
        k->cols == w->shape[1] && k->ld == w->stride[0] && k->buf)
        return k;
    /* A of FWD: w [N, K], m = N, reduction K; of BWD_X: w^T, m = K, reduction N */
    int64_t m = kind == DF_GEMM_FWD ? w->shape[0] : w->shape[1];
    int64_t red = kind == DF_GEMM_FWD ? w->shape[1] : w->shape[0];
    size_t bytes = ws_layout(kind, m, 1, rup(red, 128), NULL, NULL, NULL, mx_of(s->device)).bytes_a;
    if (region_fit(&k->buf, &k->bytes, bytes)) {
        k->w = NULL;
        return NULL;
    }
    k->w = w->data, k->kind = (int)kind, k->rows = w->shape[0], k->cols = w->shape[1];
    k->ld = w->stride[0], k->ready = 0;
    return k;
}

/* one call on the tensor cores: wa / a_ready, wb / b_ready as ws_layout's
 * base_a / base_b and quantize's (NULL: in ws) */
static int fast_call(df_backend *be, df_gemm_kind kind, const df_tensor *a, const df_tensor *b,
                     df_tensor *c, int accumulate, int dyblk, void *ws, size_t ws_bytes, void *wa,
                     int a_ready, void *wb, int b_ready)
{
    int fresh = 0;
    fp8_plan *p = plan_of(be, kind, a, b, c, accumulate, dyblk, &fresh);
    if (!p) {
        g_fallback++;
        return 0;
    }
    fp8_ws w = ws_layout(kind, p->m, p->n, p->kp, (char *)ws, (char *)wa, (char *)wb, p->mx);
    if (!ws || w.bytes > ws_bytes) {
        g_fallback++;
        return 0;
    }
    static const char *const part[3] = {"fp8 gemm fwd", "fp8 gemm bwd_x", "fp8 gemm bwd_w"};
    int rc = quantize(be, kind, a, b, p->m, p->n, p->kp, &w, a_ready, b_ready, p->dyblk);
    if (!rc && fresh) { /* its class's first call: checked against the BF16 path on these operands */
        df_cuda_prof_split(be, "fp8 check");
        int v = check_plan(be, (df_cuda_state *)be->impl, p, kind, a, b, c, &w);
        p->state = v > 0 ? 1 : v == 0 ? -1 : 0; /* (not decided: its class stays unknown) */
        *verdict_of((fp8_cache *)((df_cuda_state *)be->impl)->fp8, p) = (signed char)p->state;
    }
    if (!rc && p->state > 0) {
        df_cuda_prof_split(be, part[kind]);
        rc = run_plan(be, (df_cuda_state *)be->impl, p, &w, c->data, accumulate);
    }
    df_cuda_prof_split(be, NULL);
    if (rc)
        return rc;
    if (p->state <= 0) {
        g_fallback++;
        return 0;
    }
    g_fast++;
    return 1;
}

extern "C" int df_cuda_matmul_fp8_fast_ws(df_backend *be, df_gemm_kind kind, const df_tensor *a,
                                          const df_tensor *b, df_tensor *c, int accumulate,
                                          void *ws, size_t ws_bytes, void *wa, int weight_ready,
                                          int rows_ready)
{
    if (kind == DF_GEMM_BWD_W)
        wa = NULL, weight_ready = 0, rows_ready = 0;
    return fast_call(be, kind, a, b, c, accumulate, 0, ws, ws_bytes, wa, weight_ready, NULL,
                     rows_ready);
}

extern "C" int df_cuda_fp8_rows_slot(df_backend *be, df_gemm_kind kind, const df_tensor *a,
                                     const df_tensor *b, const df_tensor *c, int accumulate,
                                     void *ws, size_t ws_bytes, void *wa, df_cuda_fp8_rows *out)
{
    memset(out, 0, sizeof *out);
    if (kind == DF_GEMM_BWD_W || !ws)
        return 0;
    int fresh = 0;
    fp8_plan *p = plan_of(be, kind, a, b, c, accumulate, 0, &fresh);
    /* only a plan whose class has passed its check (fast_call then takes the
     * call: nothing falls back to a BF16 operand that was never written),
     * and FP32 scales (MXFP8's E8M0 bytes are made from them in quantize) */
    if (!p || fresh || p->state <= 0 || p->mx)
        return 0;
    fp8_ws w = ws_layout(kind, p->m, p->n, p->kp, (char *)ws, (char *)wa, NULL, 0);
    if (w.bytes > ws_bytes)
        return 0;
    out->codes = w.qb, out->scales = w.sb, out->kp = p->kp, out->n = p->n;
    return 1;
}

/* The held region for x of this call (DF_FP8_HOLD_X / _SAME_X): *ready when
 * it holds x's codes already (SAME_X, everything matching); else it is
 * claimed for x (grown as needed; *ready 0). NULL: no memory (the call
 * rounds x in the scratch). */
static fp8_held *held_for(df_backend *be, df_gemm_kind kind, const df_tensor *x, const df_tensor *c,
                          unsigned flags, int *ready)
{
    df_cuda_state *s = (df_cuda_state *)be->impl;
    *ready = 0;
    if (!s->fp8 && !(s->fp8 = calloc(1, sizeof(fp8_cache))))
        return NULL;
    fp8_held *h = &((fp8_cache *)s->fp8)->held;
    int bw = kind == DF_GEMM_BWD_W, mx = mx_of(s->device);
    /* x's part: B of FWD (c's rows, x's columns padded), A of BWD_W (c's columns, x's rows padded) */
    int64_t n = bw ? c->shape[1] : c->shape[0], kp = rup(bw ? x->shape[0] : x->shape[1], 128);
    if ((flags & DF_FP8_SAME_X) && h->ready && h->kind == (int)kind && h->x == x->data &&
        h->rows == x->shape[0] && h->cols == x->shape[1] && h->ld == x->stride[0] && h->n == n &&
        h->kp == kp && h->mx == mx) {
        *ready = 1;
        return h;
    }
    fp8_ws w = ws_layout(kind, bw ? n : 1, bw ? 1 : n, kp, NULL, NULL, NULL, mx);
    size_t bytes = bw ? w.bytes_a : w.bytes_b;
    h->ready = 0;
    if (region_fit(&h->buf, &h->bytes, bytes)) {
        h->x = NULL;
        return NULL;
    }
    h->x = x->data, h->kind = (int)kind, h->rows = x->shape[0], h->cols = x->shape[1];
    h->ld = x->stride[0], h->n = n, h->kp = kp, h->mx = mx;
    return h;
}

/* t [R, C] as operand op of kind (0: a, the dy of the backward kinds or FWD's x, the
 * GEMM's B; 1: b, BWD_W's x, its A): the code matrix's rows (B: the GEMM's n, c's rows when
 * it has t's; A: its m) and padded reduction */
static void made_geometry(df_gemm_kind kind, int op, const df_tensor *t, int64_t *n, int64_t *kp)
{
    int bw = kind == DF_GEMM_BWD_W;
    *n = bw ? t->shape[1] : t->shape[0];
    *kp = rup(bw ? t->shape[0] : t->shape[1], 128);
    (void)op;
}

extern "C" int df_cuda_fp8_made_claim(df_backend *be, int slot, df_gemm_kind kind, int op,
                                      const df_tensor *t, int dyblk, df_cuda_fp8_rows *out)
{
    return df_cuda_fp8_made_claim_n(be, slot, kind, op, t, dyblk, 1, out);
}

extern "C" int df_cuda_fp8_made_claim_n(df_backend *be, int slot, df_gemm_kind kind, int op,
                                        const df_tensor *t, int dyblk, int uses,
                                        df_cuda_fp8_rows *out)
{
    df_cuda_state *s = (df_cuda_state *)be->impl;
    memset(out, 0, sizeof *out);
    int bw = kind == DF_GEMM_BWD_W;
    if (slot < 0 || slot >= DF_CUDA_FP8_MADE || op < 0 || op > 1 || (op == 1 && !bw) || uses < 1 ||
        (bw && op == 0 && !dyblk) || !df_cuda_fp8_gemm_possible(be) || mx_of(s->device) ||
        t->dtype != DF_DTYPE_BF16 || t->ndim != 2 || t->shape[0] < 1 || t->shape[1] < 1)
        return 0;
    if (!s->fp8 && !(s->fp8 = calloc(1, sizeof(fp8_cache))))
        return 0;
    fp8_held *h = &((fp8_cache *)s->fp8)->made[slot];
    int64_t n, kp;
    made_geometry(kind, op, t, &n, &kp);
    fp8_ws w = ws_layout(kind, op ? n : 1, op ? 1 : n, kp, NULL, NULL, NULL, 0);
    h->proven = h->took && h->x && h->kind == (int)kind && h->rows == t->shape[0] &&
                h->cols == t->shape[1] && h->ld == t->stride[0] && h->blk == (bw && op == 0) &&
                h->op == op && h->mx == 0;
    h->ready = 0, h->only = 0, h->took = 0, h->x = NULL;
    if (region_fit(&h->buf, &h->bytes, op ? w.bytes_a : w.bytes_b))
        return 0;
    h->x = t->data, h->kind = (int)kind, h->rows = t->shape[0], h->cols = t->shape[1];
    h->ld = t->stride[0], h->n = n, h->kp = kp, h->mx = 0, h->blk = bw && op == 0, h->op = op;
    h->uses = uses, h->took_all = 1;
    w = ws_layout(kind, op ? n : 1, op ? 1 : n, kp, op ? (char *)h->buf : NULL,
                  op ? (char *)h->buf : NULL, op ? NULL : (char *)h->buf, 0);
    out->codes = op ? w.qa : w.qb, out->scales = op ? w.sa : w.sb, out->kp = kp, out->n = n;
    return 1;
}

extern "C" int df_cuda_fp8_made_proven(df_backend *be, int slot)
{
    fp8_cache *fc = (fp8_cache *)((df_cuda_state *)be->impl)->fp8;
    return fc && slot >= 0 && slot < DF_CUDA_FP8_MADE && fc->made[slot].x && fc->made[slot].proven;
}

extern "C" void df_cuda_fp8_made_ready(df_backend *be, int slot, int ok)
{
    fp8_cache *fc = (fp8_cache *)((df_cuda_state *)be->impl)->fp8;
    if (fc && slot >= 0 && slot < DF_CUDA_FP8_MADE && fc->made[slot].x)
        fc->made[slot].ready = ok != 0, fc->made[slot].only = ok == 2;
}

static int only_codes_error(const char *what)
{
    df_log(DF_LOG_ERROR, "cuda: fp8 gemm: %s (DF_FP8_ONLY_CODES: its BF16 values were not written)",
           what);
    return -EIO;
}

/* Whether a ready region holds the only copy of t's values (DF_FP8_ONLY_CODES): a call that
 * does not take its codes from a region would read values that were never written. */
static int only_codes_of(const fp8_cache *fc, const df_tensor *t)
{
    for (int i = 0; fc && i < DF_CUDA_FP8_MADE; i++)
        if (fc->made[i].ready && fc->made[i].only && fc->made[i].x == t->data)
            return 1;
    return 0;
}

/* One of a made region's calls took it (took: on the tensor cores): the last one leaves it
 * unready, its took set for the next claim's proof */
static void made_used(fp8_held *h, int took)
{
    h->took_all &= took;
    if (--h->uses > 0)
        return;
    h->ready = 0, h->only = 0, h->took = h->took_all;
}

/* The ready region holding operand op's codes (t) for this call (DF_FP8_MADE), or NULL. */
static fp8_held *made_held_of(df_backend *be, df_gemm_kind kind, int op, const df_tensor *t,
                              const df_tensor *c, int dyblk)
{
    df_cuda_state *s = (df_cuda_state *)be->impl;
    fp8_cache *fc = (fp8_cache *)s->fp8;
    int64_t n, kp;
    made_geometry(kind, op, t, &n, &kp);
    int blk = kind == DF_GEMM_BWD_W && op == 0 && dyblk;
    int64_t cn = op ? c->shape[1] : c->shape[0]; /* A's rows are c's columns, B's its rows */
    for (int i = 0; fc && i < DF_CUDA_FP8_MADE; i++) {
        fp8_held *h = &fc->made[i];
        if (h->ready && h->kind == (int)kind && h->op == op && h->x == t->data &&
            h->rows == t->shape[0] && h->cols == t->shape[1] && h->ld == t->stride[0] &&
            h->n == n && h->kp == kp && h->blk == blk && h->mx == mx_of(s->device) && cn == n)
            return h;
    }
    return NULL;
}

/* 1 when the tensor cores took the call (c written), 0 when the caller runs
 * the BF16 path, or a negative error. The codes go to the backend scratch,
 * x's to the held region under DF_FP8_HOLD_X / _SAME_X; under DF_FP8_MADE an
 * operand's come from its producer's region where it wrote them (that x then
 * leaves the held region as it was). */
extern "C" int df_cuda_matmul_fp8_fast(df_backend *be, df_gemm_kind kind, const df_tensor *a,
                                       const df_tensor *b, df_tensor *c, unsigned flags)
{
    if (!df_cuda_fp8_gemm_possible(be))
        return 0; /* (before the scratch: it would grow for nothing) */
    int acc = (flags & DF_FP8_ACCUMULATE) != 0, bw = kind == DF_GEMM_BWD_W, x_ready = 0;
    int dyblk = (flags & DF_FP8_DY_BLOCKS) != 0, made = (flags & DF_FP8_MADE) != 0;
    /* a: dy of the backward kinds, FWD's x (B); b: BWD_W's x (A) */
    fp8_held *ma = made ? made_held_of(be, kind, 0, a, c, dyblk) : NULL;
    fp8_held *mb = made && bw ? made_held_of(be, kind, 1, b, c, dyblk) : NULL;
    fp8_held *mx = bw ? mb : ma; /* x's, if its producer made them */
    const fp8_cache *fc = (const fp8_cache *)((df_cuda_state *)be->impl)->fp8;
    if ((!ma && only_codes_of(fc, a)) || (!mb && only_codes_of(fc, b)))
        return only_codes_error("an operand whose producer wrote only its codes for other calls");
    fp8_held *h = !mx && kind != DF_GEMM_BWD_X && (flags & (DF_FP8_HOLD_X | DF_FP8_SAME_X))
                      ? held_for(be, kind, bw ? b : a, c, flags, &x_ready)
                      : NULL;
    size_t bytes = df_cuda_matmul_fp8_ws_bytes(kind, a, c, 0);
    void *ws = df_cuda_scratch(be, bytes);
    if (!ws)
        return -ENOMEM;
    void *wx = mx ? mx->buf : h ? h->buf : NULL;
    x_ready = mx ? 1 : x_ready;
    /* A: BWD_W's x (made or held), the weight's codes AdamW wrote (FWD, BWD_X); B: FWD's x
     * (made or held), dy (made) */
    const df_cuda_fp8_wcodes *kw = bw ? NULL : df_cuda_fp8_wcodes_of(be, b);
    void *wa = bw ? wx : kw ? (kind == DF_GEMM_FWD ? kw->fwd : kw->bwx) : NULL;
    void *wb = bw ? (ma ? ma->buf : NULL) : wx;
    int b_ready = bw ? ma != NULL : x_ready;
    int rc = fast_call(be, kind, a, b, c, acc, dyblk, ws, bytes, wa, bw ? x_ready : kw != NULL, wb,
                       b_ready);
    if (rc == 1 && kw)
        df_cuda_fp8_wcodes_took();
    if (h) /* x's codes are there only when the call rounded (or used) them */
        h->ready = rc == 1;
    g_x_reused += rc == 1 && x_ready && !mx;
    g_made_reused += rc == 1 ? (ma != NULL) + (mb != NULL) : 0;
    int only = (ma && ma->only) || (mb && mb->only);
    if (ma) /* a producer's codes serve the calls it claimed them for */
        made_used(ma, rc == 1);
    if (mb)
        made_used(mb, rc == 1);
    if (rc == 0 && only) /* the BF16 path would read values that were never written */
        return only_codes_error("the tensor cores refused a call whose operand only its "
                                "producer's codes hold");
    return rc;
}
