/* gemm.cu - df_op_matmul and the backward matmuls on the GPU through
 * cuBLASLt: bf16 in, fp32 accumulate, bf16 out (weight gradients: F32 or
 * BF16), y = x @ w^T (+ y).
 *
 * Row-major y [M, N] = x [M, K] @ w [N, K]^T is, in cuBLAS's column-major
 * terms, Y^T (N x M, ld = y's row stride) = op_T(W) (W stored K x N, ld =
 * w's row stride) x X^T (stored K x M, ld = x's row stride): no copies, and
 * column views (a q or gate half of a fused projection) are just lds.
 * accumulate is beta = 1: the sum is formed in fp32 and rounded once.
 *
 * The epilogue. cuBLASLt computes D = alpha * (A B) + beta * C with the
 * product accumulated in the compute type (CUBLAS_COMPUTE_32F), alpha and
 * beta in the scale type (CUDA_R_32F), and C read in its own type (bf16 C:
 * widened, exactly). The documentation states that formula and those
 * types, not the rounding mode of the final conversion to a bf16 D. What
 * we rely on, as CUTLASS's LinearCombination epilogue does it: alpha * acc
 * + beta * C in fp32 (one fma), then one conversion to D's type, to
 * nearest even.
 * With alpha = beta = 1 both products are exact, so a bf16 D would then be
 * RNE(fp32(acc + C)), the CPU reference's "fp32 sum, plus the old value
 * widened, rounded once". Measured on the H200 (tests/test_gpu_train_ops.c:
 * inputs whose fp32 sums are exact in any order, so only the epilogue can
 * round): without C, and with C for M = 4096, exactly that; with C for
 * M = 37 some elements are RNE(RNE(acc) + C), the new sum rounded to bf16
 * first (PyTorch's bf16 .grad accumulation), bit for bit; random inputs at
 * M = 1024 also broke the one-rounding bound and stay within the
 * two-rounding one. train_ops.h allows both; the test requires one of the
 * two, bit for bit, on exact sums.
 * The one documented way to round a bf16 D more than once is split-K: the
 * INPLACE and OUTPUT_TYPE reduction schemes add the K slices' partial
 * results in the output type. Every plan with a bf16 C (matmul, bwd_x and
 * a BF16 bwd_w alike) therefore allows only the COMPUTE_TYPE scheme
 * (partials in fp32 in the workspace, one conversion at the end) besides
 * no split at all (algorithms without split-K, scheme NONE = 0, pass any
 * reduction-scheme mask). Plans with an F32 C are built as before (the
 * same algorithm choice, so F32 weight gradients keep their bits).
 *
 * A plan (descriptors + the algorithm cuBLASLt's heuristic picked) is
 * cached per (shape, strides, pointer alignment, accumulate, C's type):
 * heuristics run once per shape, never per call.
 *
 * The timed choice (DFLASH_GEMM_TUNE=1, read once; df_cuda_gemm_set_tune
 * for tests; off by default, and then nothing here changes: one heuristic
 * answer, its first algorithm). On, plan_tune runs when a plan is built
 * for a GEMM of at least 2^30 multiply-adds (smaller ones cannot pay the
 * trials back): it asks the heuristic, under the same preference (so the
 * reduction-scheme restriction above holds for every candidate), for up
 * to 8 candidates, whose first must be the algorithm the plan already
 * holds (else no tuning). Only candidates with the first's
 * CUBLASLT_ALGO_CONFIG_ID and split-K number are tried: one kernel family
 * without split-K (measured on the H200: algo 66 for every big shape)
 * accumulates each output element over k in the same order whatever its
 * tile, stages or cluster shape, so they can give the first one's bits.
 * Each is timed on the call's own A and B (one warm-up, 3 runs back to
 * back between CUDA events on the backend's stream, the median) with
 * beta = 0 into C itself (not accumulating: the real call afterwards
 * overwrites it) or, accumulating, into a temporary buffer of C's layout
 * (C, an input then, is never touched; the trials check the product, and
 * the beta = 1 epilogue is the same for every candidate of the one
 * algorithm id). The first candidate's output is copied aside and every
 * candidate's last output (the first's too: it must reproduce itself) is
 * compared with it bit for bit on the device; only equal ones are
 * eligible, and the fastest of them wins (ties: the heuristic's order).
 * One line per tuned shape at DFLASH_LOG=info. Any CUDA or cuBLASLt
 * failure while tuning (the temporaries are stream-ordered allocations)
 * logs a warning and keeps the first candidate; the GEMM itself never
 * fails because of tuning.
 * Determinism: the choice depends on timing, so two runs (or two ranks) may
 * pick different candidates. What keeps results reproducible is the
 * bitwise check on the first call's real operands, together with the
 * argument above (same algorithm id, no split-K: the same k order per
 * element). Should that argument fail for some other input, results could
 * differ between runs in the last bit: hence opt-in. It also pays only when
 * shapes repeat: each new shape costs its trials and a stream sync, and the
 * trainer's GEMMs follow each row's context length and block count, so on a
 * corpus of varied lengths most steps would bring new shapes (its gain is
 * ~1% of the 27B step, whose rows are all full: docs/log/). */
#include <errno.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cublasLt.h>

#include "cuda_internal.h"
#include "cuda_state.h"
#include "fp8_cuda.h"
#include "knobs.h"

extern "C" {
#include "log.h"
}

#define GEMM_WS_BYTES ((size_t)64 << 20)

static int lt_fail(cublasStatus_t st, const char *what)
{
    if (st == CUBLAS_STATUS_SUCCESS)
        return 0;
    df_log(DF_LOG_ERROR, "cuda: cublasLt %s: status %d", what, (int)st);
    return -EIO;
}

int df_cuda_gemm_open(df_cuda_state *s, df_err *e)
{
    cublasLtHandle_t h;
    cublasStatus_t st = cublasLtCreate(&h);
    if (st != CUBLAS_STATUS_SUCCESS)
        return df_errf(e, -EIO, "cuda backend: cublasLtCreate failed (status %d)", (int)st);
    s->lt = h;
    cudaError_t err = cudaMalloc(&s->gemm_ws, GEMM_WS_BYTES);
    if (err != cudaSuccess) {
        s->gemm_ws = NULL;
        return df_errf(e, -ENOMEM, "cuda backend: GEMM workspace: %s", cudaGetErrorString(err));
    }
    s->gemm_ws_bytes = GEMM_WS_BYTES;
    return 0;
}

static void plan_free(df_cuda_gemm_plan *p)
{
    if (p->op)
        cublasLtMatmulDescDestroy((cublasLtMatmulDesc_t)p->op);
    if (p->a)
        cublasLtMatrixLayoutDestroy((cublasLtMatrixLayout_t)p->a);
    if (p->b)
        cublasLtMatrixLayoutDestroy((cublasLtMatrixLayout_t)p->b);
    if (p->c)
        cublasLtMatrixLayoutDestroy((cublasLtMatrixLayout_t)p->c);
    memset(p, 0, sizeof *p);
}

/* Drops every cached plan (the next GEMM of each shape builds its plan,
 * and tunes it if tuning is on, again). Plans hold host objects only, so
 * work already enqueued with them is unaffected. */
void df_cuda_gemm_forget_plans(df_backend *be)
{
    df_cuda_state *s = (df_cuda_state *)be->impl;
    for (int i = 0; i < s->n_plans; i++)
        plan_free(&s->plans[i]);
    s->n_plans = 0;
    s->next_evict = 0;
}

void df_cuda_gemm_close(df_cuda_state *s)
{
    df_cuda_fp8_gemm_close(s);
    df_cuda_fp8_wcodes_close(s);
    for (int i = 0; i < s->n_plans; i++)
        plan_free(&s->plans[i]);
    s->n_plans = 0;
    if (s->gemm_ws)
        (void)cudaFree(s->gemm_ws);
    s->gemm_ws = NULL;
    if (s->lt)
        cublasLtDestroy((cublasLtHandle_t)s->lt);
    s->lt = NULL;
}

/* Largest power of two (<= 256) dividing every address. */
static unsigned align_of(const void *a, const void *b, const void *c)
{
    uintptr_t v = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c | 256;
    return (unsigned)(v & (~v + 1));
}

/* ---- the timed choice (DFLASH_GEMM_TUNE, the header) ---- */

#define TUNE_CAND 8 /* candidates asked of the heuristic */
#define TUNE_REPS 3 /* timed runs per candidate (after one warm-up) */
#define TUNE_MIN_WORK ((double)(1 << 30)) /* m n k below this: not tuned */

static int g_tune = -1;    /* -1: DFLASH_GEMM_TUNE not read yet */
static int64_t g_n_tuned;  /* plans whose algorithm was chosen by time */

static int tune_on(void)
{
    if (g_tune < 0)
        g_tune = df_knob_int(DF_KNOB_GEMM_TUNE);
    return g_tune;
}

int df_cuda_gemm_set_tune(int on)
{
    int prev = tune_on();
    g_tune = on ? 1 : 0;
    return prev;
}

int64_t df_cuda_gemm_tuned_count(void)
{
    return g_n_tuned;
}

/* The call's operands, for plan_tune (NULL: build without tuning). */
typedef struct gemm_io {
    const void *A, *B;
    void *C;
} gemm_io;

/* flag[0] = 1 if the m x n column-major out (ld ldc) differs in any bit
 * from ref (m x n, ld m). */
template <typename T>
__global__ void tune_cmp(const T *__restrict__ out, int64_t ldc, const T *__restrict__ ref,
                         int64_t m, int64_t n, int *flag)
{
    int64_t total = m * n, stride = (int64_t)gridDim.x * blockDim.x;
    int bad = 0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        int64_t col = i / m, row = i - col * m;
        bad |= out[col * ldc + row] != ref[i];
    }
    if (bad)
        *flag = 1; /* every writer writes 1 */
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* Replaces p->algo (the heuristic's first choice, p's descriptors built)
 * by the fastest candidate whose output is bitwise the first's, when
 * tuning is on and can pay (the header). Never fails: on any error p->algo
 * stays the first choice. pref is the plan's heuristic preference. */
static void plan_tune(df_cuda_state *s, df_cuda_gemm_plan *p, cublasLtMatmulPreference_t pref,
                      const gemm_io *io)
{
    if (!io || !tune_on())
        return;
    if ((double)p->m * (double)p->n * (double)p->k < TUNE_MIN_WORK)
        return;
    cudaStream_t st = s->stream;
    cublasLtHandle_t lt = (cublasLtHandle_t)s->lt;
    cublasLtMatmulDesc_t op = (cublasLtMatmulDesc_t)p->op;
    cublasLtMatrixLayout_t la = (cublasLtMatrixLayout_t)p->a, lb = (cublasLtMatrixLayout_t)p->b,
                           lc = (cublasLtMatrixLayout_t)p->c;
    /* a pending error is its caller's to report; a capture cannot be timed */
    cudaStreamCaptureStatus capst = cudaStreamCaptureStatusNone;
    if (cudaPeekAtLastError() != cudaSuccess)
        return;
    if (cudaStreamIsCapturing(st, &capst) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    if (capst != cudaStreamCaptureStatusNone)
        return;

    cublasLtMatmulHeuristicResult_t res[TUNE_CAND];
    int found = 0, idx[TUNE_CAND], nc = 0, flags[TUNE_CAND], best = 0, chosen = 0;
    float ms[TUNE_CAND];
    char *buf = NULL;
    cudaEvent_t ev[TUNE_REPS + 1];
    int n_ev = 0;
    const char *fail = NULL; /* what failed, for the warning */
    cudaError_t ce = cudaSuccess;
    cublasStatus_t ls = CUBLAS_STATUS_SUCCESS;
    size_t es = p->c_f32 ? 4 : 2, w = 0;
    size_t ref_bytes = ((size_t)p->m * (size_t)p->n * es + 255) & ~(size_t)255;
    size_t tmp_bytes = p->accumulate ? (((size_t)p->ldc * (size_t)p->n * es + 255) & ~(size_t)255)
                                     : 0;
    void *ref, *out;
    int *dflag;
    float alpha = 1.0f, beta = 0.0f; /* trials never read C */
    int id0 = -1, sk0 = -1, eligible = 0;

    ls = cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, TUNE_CAND, res, &found);
    if (ls != CUBLAS_STATUS_SUCCESS || found < 1) {
        fail = "heuristic";
        goto done;
    }
    if (memcmp(&res[0].algo, p->algo, sizeof res[0].algo)) {
        df_log(DF_LOG_INFO, "cuda: gemm tune m=%lld n=%lld k=%lld: the heuristic's first of %d "
               "is not its only one: not tuned", (long long)p->m, (long long)p->n,
               (long long)p->k, found);
        goto done;
    }
    for (int a = 0; a < found && a < TUNE_CAND; a++) {
        int id = -2, sk = -2;
        if (res[a].state != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulAlgoConfigGetAttribute(&res[a].algo, CUBLASLT_ALGO_CONFIG_ID, &id,
                                                 sizeof id, &w) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulAlgoConfigGetAttribute(&res[a].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                 &sk, sizeof sk, &w) != CUBLAS_STATUS_SUCCESS) {
            if (a == 0)
                goto done; /* nothing to compare with: keep the first */
            continue;
        }
        if (a == 0)
            id0 = id, sk0 = sk;
        if (id == id0 && sk == sk0)
            idx[nc++] = a;
    }
    if (nc < 2)
        goto done;

    /* ref: the first candidate's output (m x n, tight); out: where trials
     * write (C, or accumulating a temporary of C's layout); dflag: one
     * mismatch flag per candidate */
    ce = cudaMallocAsync((void **)&buf, ref_bytes + tmp_bytes + 256, st);
    if (ce != cudaSuccess) {
        buf = NULL;
        fail = "temporary buffer";
        goto done;
    }
    ref = buf;
    out = p->accumulate ? (void *)(buf + ref_bytes) : io->C;
    dflag = (int *)(buf + ref_bytes + tmp_bytes);
    if ((ce = cudaMemsetAsync(dflag, 0, TUNE_CAND * sizeof(int), st)) != cudaSuccess) {
        fail = "memset";
        goto done;
    }
    for (; n_ev < TUNE_REPS + 1; n_ev++)
        if ((ce = cudaEventCreate(&ev[n_ev])) != cudaSuccess) {
            fail = "event";
            goto done;
        }
    for (int c = 0; c < nc; c++) {
        const cublasLtMatmulAlgo_t *algo = &res[idx[c]].algo;
        ls = cublasLtMatmul(lt, op, &alpha, io->A, la, io->B, lb, &beta, out, lc, out, lc, algo,
                            s->gemm_ws, s->gemm_ws_bytes, st);
        if (ls != CUBLAS_STATUS_SUCCESS) {
            fail = "trial";
            goto done;
        }
        if (c == 0 && (ce = cudaMemcpy2DAsync(ref, (size_t)p->m * es, out, (size_t)p->ldc * es,
                                              (size_t)p->m * es, (size_t)p->n,
                                              cudaMemcpyDeviceToDevice, st)) != cudaSuccess) {
            fail = "copy";
            goto done;
        }
        if ((ce = cudaEventRecord(ev[0], st)) != cudaSuccess) {
            fail = "event record";
            goto done;
        }
        for (int r = 0; r < TUNE_REPS; r++) {
            ls = cublasLtMatmul(lt, op, &alpha, io->A, la, io->B, lb, &beta, out, lc, out, lc,
                                algo, s->gemm_ws, s->gemm_ws_bytes, st);
            if (ls != CUBLAS_STATUS_SUCCESS) {
                fail = "trial";
                goto done;
            }
            if ((ce = cudaEventRecord(ev[r + 1], st)) != cudaSuccess) {
                fail = "event record";
                goto done;
            }
        }
        /* the last run's bits against the first candidate's warm-up */
        {
            int64_t total = p->m * p->n;
            int blocks = (int)((total + 255) / 256 < 4096 ? (total + 255) / 256 : 4096);
            if (p->c_f32)
                tune_cmp<uint32_t><<<blocks, 256, 0, st>>>((const uint32_t *)out, p->ldc,
                                                           (const uint32_t *)ref, p->m, p->n,
                                                           dflag + c);
            else
                tune_cmp<uint16_t><<<blocks, 256, 0, st>>>((const uint16_t *)out, p->ldc,
                                                           (const uint16_t *)ref, p->m, p->n,
                                                           dflag + c);
            if ((ce = cudaGetLastError()) != cudaSuccess) {
                fail = "compare launch";
                goto done;
            }
        }
        if ((ce = cudaEventSynchronize(ev[TUNE_REPS])) != cudaSuccess) {
            fail = "event sync";
            goto done;
        }
        float t[TUNE_REPS];
        for (int r = 0; r < TUNE_REPS; r++)
            if ((ce = cudaEventElapsedTime(&t[r], ev[r], ev[r + 1])) != cudaSuccess) {
                fail = "elapsed time";
                goto done;
            }
        qsort(t, TUNE_REPS, sizeof t[0], cmp_float);
        ms[c] = t[TUNE_REPS / 2];
    }
    if ((ce = cudaMemcpyAsync(flags, dflag, (size_t)nc * sizeof(int), cudaMemcpyDeviceToHost,
                              st)) != cudaSuccess ||
        (ce = cudaStreamSynchronize(st)) != cudaSuccess) {
        fail = "flags";
        goto done;
    }
    if (flags[0]) {
        fail = "the first candidate did not reproduce its own bits";
        goto done;
    }
    chosen = 1;
    for (int c = 1; c < nc; c++) {
        eligible += !flags[c];
        if (!flags[c] && ms[c] < ms[best])
            best = c;
    }
done:
    for (int i = 0; i < n_ev; i++)
        (void)cudaEventDestroy(ev[i]);
    if (buf && (ce = cudaFreeAsync(buf, st)) != cudaSuccess && !fail)
        fail = "free";
    if (fail) { /* p->algo is still the first choice */
        (void)cudaGetLastError(); /* our error, not the next launch check's */
        df_log(DF_LOG_WARN, "cuda: gemm tune m=%lld n=%lld k=%lld ta=%d tb=%d: not tuned: %s "
               "(cuda: %s; cublasLt status %d); keeping the heuristic's first choice",
               (long long)p->m, (long long)p->n, (long long)p->k, p->ta, p->tb, fail,
               cudaGetErrorString(ce), (int)ls);
        return;
    }
    if (!chosen)
        return; /* skipped (fewer than 2 candidates): the first choice */
    memcpy(p->algo, &res[idx[best]].algo, sizeof res[0].algo);
    g_n_tuned++;
    df_log(DF_LOG_INFO, "cuda: gemm tune m=%lld n=%lld k=%lld ta=%d tb=%d %s%s: candidate %d of "
           "%d (%d with algo %d splitk %d, %d of them bitwise the first): first %.3f ms, chosen "
           "%.3f ms", (long long)p->m, (long long)p->n, (long long)p->k, p->ta, p->tb,
           p->c_f32 ? "f32 C" : "bf16 C", p->accumulate ? " acc" : "", idx[best], found, nc,
           id0, sk0, eligible + 1, ms[0], ms[best]);
}

static int plan_build(df_cuda_state *s, df_cuda_gemm_plan *p, unsigned align, const gemm_io *io)
{
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t a = NULL, b = NULL, c = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    cublasOperation_t ta = p->ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = p->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    /* Stored shapes (column-major): op(A) is m x k, op(B) is k x n. */
    uint64_t ar = p->ta ? p->k : p->m, ac = p->ta ? p->m : p->k;
    uint64_t br = p->tb ? p->n : p->k, bc = p->tb ? p->k : p->n;
    int rc = lt_fail(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
    p->op = op;
    if (!rc)
        rc = lt_fail(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta),
                     "transa");
    if (!rc)
        rc = lt_fail(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb),
                     "transb");
    if (!rc)
        rc = lt_fail(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, ar, ac, p->lda), "layout a");
    p->a = a;
    if (!rc)
        rc = lt_fail(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, br, bc, p->ldb), "layout b");
    p->b = b;
    if (!rc)
        rc = lt_fail(cublasLtMatrixLayoutCreate(&c, p->c_f32 ? CUDA_R_32F : CUDA_R_16BF,
                                                (uint64_t)p->m, (uint64_t)p->n, p->ldc),
                     "layout c");
    p->c = c;
    if (!rc)
        rc = lt_fail(cublasLtMatmulPreferenceCreate(&pref), "preference");
    if (!rc) {
        uint64_t ws = s->gemm_ws_bytes;
        uint32_t al = align;
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                             sizeof ws);
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al,
                                             sizeof al);
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al,
                                             sizeof al);
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al,
                                             sizeof al);
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al,
                                             sizeof al);
        if (!p->c_f32) { /* one rounding of a bf16 D: no split-K partials in bf16 (above) */
            uint32_t mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
            rc = lt_fail(cublasLtMatmulPreferenceSetAttribute(
                             pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof mask),
                         "reduction scheme");
        }
        cublasLtMatmulHeuristicResult_t res;
        int found = 0;
        if (!rc)
            rc = lt_fail(cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t)s->lt, op, a, b, c, c,
                                                        pref, 1, &res, &found),
                         "heuristic");
        if (!rc && found < 1)
            rc = lt_fail(CUBLAS_STATUS_NOT_SUPPORTED, "no algorithm for this shape");
        if (!rc) {
            memcpy(p->algo, &res.algo, sizeof res.algo);
            p->valid = 1;
            plan_tune(s, p, pref, io);
        }
    }
    if (pref)
        cublasLtMatmulPreferenceDestroy(pref);
    if (rc)
        plan_free(p);
    return rc;
}

static int same_key(const df_cuda_gemm_plan *p, const df_cuda_gemm_plan *k)
{
    return p->m == k->m && p->n == k->n && p->k == k->k && p->lda == k->lda &&
           p->ldb == k->ldb && p->ldc == k->ldc && p->ta == k->ta && p->tb == k->tb &&
           p->c_f32 == k->c_f32 && p->accumulate == k->accumulate && p->align == k->align;
}

static df_cuda_gemm_plan *plan_get(df_cuda_state *s, const df_cuda_gemm_plan *key,
                                   const gemm_io *io, int *rc)
{
    for (int i = 0; i < s->n_plans; i++)
        if (s->plans[i].valid && same_key(&s->plans[i], key))
            return &s->plans[i];
    df_cuda_gemm_plan *p;
    if (s->n_plans < DF_CUDA_GEMM_CACHE) {
        p = &s->plans[s->n_plans++];
    } else {
        p = &s->plans[s->next_evict];
        s->next_evict = (s->next_evict + 1) % DF_CUDA_GEMM_CACHE;
        plan_free(p);
    }
    *p = *key;
    p->op = p->a = p->b = p->c = NULL;
    p->valid = 0;
    *rc = plan_build(s, p, key->align, io);
    return *rc ? NULL : p;
}

/* C (m x n, column-major, ld ldc) = op(A) op(B) (+ C): A, B bf16, C bf16 or
 * F32, fp32 accumulation, one rounding of C (the epilogue, above). */
static int gemm(df_backend *be, int ta, int tb, int64_t m, int64_t n, int64_t k, const void *A,
                int64_t lda, const void *B, int64_t ldb, void *C, int64_t ldc, int c_f32,
                int accumulate)
{
    df_cuda_state *s = (df_cuda_state *)be->impl;
    if (m == 0 || n == 0)
        return 0;
    size_t ces = c_f32 ? 4 : 2;
    if (k == 0) { /* an empty sum: C = 0, or C unchanged */
        if (accumulate)
            return 0;
        return df_cuda_fail(cudaMemset2DAsync(C, (size_t)ldc * ces, 0, (size_t)m * ces, (size_t)n,
                                              s->stream),
                            "matmul zero");
    }
    df_cuda_gemm_plan key;
    memset(&key, 0, sizeof key);
    key.m = m;
    key.n = n;
    key.k = k;
    key.lda = lda;
    key.ldb = ldb;
    key.ldc = ldc;
    key.ta = ta;
    key.tb = tb;
    key.c_f32 = c_f32;
    key.accumulate = accumulate != 0;
    key.align = align_of(A, B, C);
    int rc = 0;
    gemm_io io = {A, B, C};
    df_cuda_gemm_plan *p = plan_get(s, &key, &io, &rc);
    if (!p)
        return rc;
    float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    return lt_fail(cublasLtMatmul((cublasLtHandle_t)s->lt, (cublasLtMatmulDesc_t)p->op, &alpha, A,
                                  (cublasLtMatrixLayout_t)p->a, B, (cublasLtMatrixLayout_t)p->b,
                                  &beta, C, (cublasLtMatrixLayout_t)p->c, C,
                                  (cublasLtMatrixLayout_t)p->c,
                                  (const cublasLtMatmulAlgo_t *)p->algo, s->gemm_ws,
                                  s->gemm_ws_bytes, s->stream),
                   "matmul");
}

/* y [M, N] = x [M, K] @ w [N, K]^T: Y^T = op_T(W) X^T. y is BF16 through the
 * op (an activation); F32 for internal callers (the FP8 path's check of the
 * LM head's logits). */
int df_cuda_matmul(df_backend *be, const df_tensor *x, const df_tensor *w, df_tensor *y,
                   int accumulate)
{
    if (df_cuda_fp8_wcodes_fresh_t(be, w)) /* a kept weight's values AdamW left out */
        return -EIO;
    return gemm(be, 1, 0, w->shape[0], x->shape[0], x->shape[1], w->data, w->stride[0], x->data,
                x->stride[0], y->data, y->stride[0], y->dtype == DF_DTYPE_F32, accumulate);
}

/* dx [M, K] = dy [M, N] @ w [N, K]: dX^T = W^T dY^T, both stored as they are.
 * dx BF16 (F32 for internal callers, as df_cuda_matmul's y). */
int df_cuda_matmul_bwd_x(df_backend *be, const df_tensor *dy, const df_tensor *w, df_tensor *dx,
                         int accumulate)
{
    if (df_cuda_fp8_wcodes_fresh_t(be, w))
        return -EIO;
    return gemm(be, 0, 0, w->shape[1], dy->shape[0], w->shape[0], w->data, w->stride[0],
                dy->data, dy->stride[0], dx->data, dx->stride[0], dx->dtype == DF_DTYPE_F32,
                accumulate);
}

/* dw [N, K] (F32 or BF16) = dy^T [N, M] @ x [M, K]: dW^T = X^T op_T(dY^T).
 * A BF16 dw is C = D in bf16 with beta = 1 when accumulating: RNE of the
 * fp32 sum plus the old value (the epilogue, above). */
int df_cuda_matmul_bwd_w(df_backend *be, const df_tensor *dy, const df_tensor *x, df_tensor *dw,
                         int accumulate)
{
    return gemm(be, 0, 1, x->shape[1], dy->shape[1], x->shape[0], x->data, x->stride[0],
                dy->data, dy->stride[0], dw->data, dw->stride[0], dw->dtype == DF_DTYPE_F32,
                accumulate);
}
