/* cuda_state.h - the CUDA backend's private state (be->impl), shared by
 * backend.cu and gemm.cu only; kernels see it through cuda_internal.h. */
#ifndef DF_CUDA_STATE_H
#define DF_CUDA_STATE_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "err.h"
#include "ops.h" /* DF_BACKEND_MARKS */

#define DF_CUDA_STAGE_SLOTS 8
#define DF_CUDA_GEMM_CACHE 64

typedef struct df_cuda_stage {
    int32_t *dev;    /* device copy */
    int32_t *shadow; /* pinned host copy of what dev holds: the cache key and
                      * the copy's source (pinned, so the copy never makes the
                      * host wait for the stream, as a pageable one may) */
    cudaEvent_t done; /* after the copy out of shadow; NULL before the first */
    int64_t n;       /* elements held; -1 empty */
    size_t cap;      /* bytes of dev and shadow */
    uint64_t used;   /* LRU clock */
} df_cuda_stage;

/* One cached cuBLASLt plan: the descriptors and the algorithm chosen once
 * for a GEMM shape (heuristics are never queried again for it). */
typedef struct df_cuda_gemm_plan {
    int64_t m, n, k, lda, ldb, ldc;
    int ta, tb;     /* A, B transposed (column-major terms) */
    int c_f32;      /* C is F32 (F32 weight gradients), else BF16 */
    int accumulate;
    unsigned align; /* pointer alignment the algorithm was chosen for */
    void *op, *a, *b, *c; /* cublasLtMatmulDesc_t, cublasLtMatrixLayout_t x3 */
    unsigned char algo[64]; /* cublasLtMatmulAlgo_t (64 bytes) */
    int valid;
} df_cuda_gemm_plan;

#define DF_CUDA_PROF_EVENTS 4096 /* op brackets pending before a flush */
#define DF_CUDA_PROF_NAMES 64

typedef struct df_cuda_prof {
    const char *name[DF_CUDA_PROF_EVENTS]; /* pending brackets: name, start, end */
    cudaEvent_t ev[2 * DF_CUDA_PROF_EVENTS];
    int n;
    const char *names[DF_CUDA_PROF_NAMES]; /* totals per op name */
    double ms[DF_CUDA_PROF_NAMES];
    uint64_t calls[DF_CUDA_PROF_NAMES];
    int n_names;
    const char *op; /* the op now bracketed (df_cuda_prof_split's parts are named after it) */
    char *parts[DF_CUDA_PROF_NAMES]; /* "op: part" names made by df_cuda_prof_split, owned */
    int n_parts;
    /* The gaps: the time from the end of a stream's previous bracket to the start of the
     * next (the stream waiting for the host, for another stream, or busy outside the ops),
     * summed per name of the op after it. Per stream (the compute and the side stream):
     * its last bracket's end, carried across flushes in an event of its own. */
    cudaStream_t strm[DF_CUDA_PROF_EVENTS]; /* each pending bracket's stream */
    cudaStream_t last_strm[2];
    cudaEvent_t last_end[2];
    int slot_used[2], has_last[2];
    double gap_ms[DF_CUDA_PROF_NAMES];
    uint64_t gap_n[DF_CUDA_PROF_NAMES];
    float gap_max;             /* the largest single gap, and the op after it */
    const char *gap_max_name;
} df_cuda_prof;

typedef struct df_cuda_state {
    int device;
    cudaStream_t stream;
    /* df_backend_upload_ahead: a copy stream, made at first use; fork orders
     * it after the compute stream, done is what upload_join waits for */
    cudaStream_t copy;
    cudaEvent_t ev_fork, ev_done;
    int ahead_pending;
    /* df_backend_side_begin..end: `stream` is the side stream meanwhile (every
     * op enqueues there) and `main` the compute stream; marks are events on
     * the side stream the main one waits for (df_backend_wait_mark) */
    cudaStream_t main, side;
    cudaEvent_t ev_side_fork, marks[DF_BACKEND_MARKS];
    unsigned char mark_pending[DF_BACKEND_MARKS];
    int side_on;
    df_cuda_stage stage[DF_CUDA_STAGE_SLOTS];
    uint64_t stage_clock;
    void *scratch;
    size_t scratch_cap;
    /* cuBLASLt */
    void *lt; /* cublasLtHandle_t */
    void *gemm_ws;
    size_t gemm_ws_bytes;
    df_cuda_gemm_plan plans[DF_CUDA_GEMM_CACHE];
    int n_plans, next_evict;
    void *fp8; /* gemm_fp8.cu's plans, made at first use */
    void *wcodes; /* fp8_wcodes.cu's kept weights' codes */
    df_cuda_prof *prof; /* DFLASH_PROFILE=1 */
} df_cuda_state;

int df_cuda_gemm_open(df_cuda_state *s, df_err *e);
void df_cuda_gemm_close(df_cuda_state *s);

#endif
