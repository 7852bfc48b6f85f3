/* cuda_internal.h - what the CUDA backend's files share: the backend's
 * private state, staging of host int arrays, error mapping, and the op
 * implementations the dispatch table points at.
 *
 * Contract for every df_cuda_<op>(): the same arguments and meaning as the
 * CPU reference df_cpu_<op>() (ops.h), already validated by the dispatch
 * layer, except that activation tensors are BF16 (raw uint16_t bits) in
 * device memory, weights are BF16 device memory, and tensors documented
 * "f32" are F32 device memory. Int arrays (ids, pos, cu_seqlens) arrive as
 * the caller's HOST pointers: get a device copy with df_cuda_stage_i32().
 * Work is enqueued on df_cuda_stream(be) and may still run when the function
 * returns; it returns 0, or -EIO when a launch or CUDA call failed (after
 * logging the CUDA error string with df_cuda_fail()). Math is fp32 inside;
 * each output element is rounded to bf16 once. */
#ifndef DF_CUDA_INTERNAL_H
#define DF_CUDA_INTERNAL_H

#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "backend_internal.h"

cudaStream_t df_cuda_stream(df_backend *be);

/* A device copy of host[0..n), enqueued on the backend's stream. The copy
 * is cached by content (a later call with equal values returns the same
 * device pointer without copying), so per-layer calls with the same
 * positions or bounds cost a memcmp. The pointer stays valid for work
 * enqueued on the stream before the next df_cuda_stage_i32 call that
 * misses the cache 8 times. NULL on failure (out of memory, CUDA error). */
const int32_t *df_cuda_stage_i32(df_backend *be, const int32_t *host, int64_t n);

/* Device scratch of at least bytes, owned by the backend and reused by
 * every op: valid until the next df_cuda_scratch call (ops on one stream
 * run in order, so an op may use it for its own launches). NULL on failure
 * (the op then returns -ENOMEM). */
void *df_cuda_scratch(df_backend *be, size_t bytes);
/* Op profiling (prof.cu; DFLASH_PROFILE=1, nothing otherwise): open (at the
 * backend's open: sets be->prof), an op's bracket (the backend table's
 * prof_begin / prof_end), the sums taken at a sync (flush), cleared (reset:
 * after the warm-up step), logged and freed at close (a no-op without a
 * profile). split ends the current op's bracket and opens one named
 * "<op>: <part>" (part NULL: the op's own name again), so the profile splits
 * an op's time into its parts. */
void df_cuda_prof_open(df_backend *be);
void df_cuda_prof_begin(df_backend *be, const char *name);
void df_cuda_prof_end(df_backend *be);
void df_cuda_prof_flush(df_backend *be);
void df_cuda_prof_reset(df_backend *be);
void df_cuda_prof_close(df_backend *be);
void df_cuda_prof_split(df_backend *be, const char *part);
/* The bytes df_backend_lend_scratch lends now (0: none). */
size_t df_cuda_scratch_lent(df_backend *be);

/* Logs "cuda: <what>: <error string>" once and returns -EIO when err is not
 * cudaSuccess; 0 otherwise. */
int df_cuda_fail(cudaError_t err, const char *what);
/* df_cuda_fail(cudaGetLastError(), what): call after kernel launches. */
int df_cuda_check_launch(const char *what);

/* The op implementations, df_cuda_<op> (the .cu files beside this header):
 * declared from op_list.h (backend_internal.h). The kernels some of them
 * choose between: */
/* The target's prefill attention kernel the current device runs: "wgmma"
 * (Hopper, sm_90a code) or "mma.sync" (every other GPU, or DFLASH_PORTABLE=1). */
const char *df_cuda_attention_path(void);
/* Flash attention (attn_prefill.cu): -ENOTSUP for shapes it does not take
 * (df_cuda_attention then runs df_cuda_attention_simt). */
int df_cuda_attention_flash(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
                            const int32_t *cu_seqlens, int n_seq, int nq, int nkv, int head_dim,
                            float scale, const df_tensor *gate, df_tensor *out);
/* The chunked GDN prefill (gdn.cu): -ENOTSUP for head dims it does not take
 * (df_cuda_gdn then runs df_cuda_gdn_recurrent). */
int df_cuda_gdn_chunked(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
                        const df_tensor *g, const df_tensor *beta, const int32_t *cu_seqlens, int n_seq,
                        int hk, int hv, int dk, int dv, df_gdn_mode mode, df_tensor *out);

/* cuBLASLt plans (gemm.cu). The timed choice among the heuristic's
 * bitwise-equal candidates (DFLASH_GEMM_TUNE=1, gemm.cu's header):
 * set_tune overrides the variable for plans built from now on and returns
 * the previous setting; tuned_count is how many plans (all backends) got
 * their algorithm by timing; forget_plans drops a backend's cached plans,
 * so the next GEMMs build (and maybe tune) theirs again. */
int df_cuda_gemm_set_tune(int on);
int64_t df_cuda_gemm_tuned_count(void);
void df_cuda_gemm_forget_plans(df_backend *be);

/* l2norm's row launcher in dense.cu, whose row-norm kernel (warp or block
 * per row, any outer strides, 16-byte vectors) serves the RMSNorms and
 * l2norm alike; df_cuda_l2norm (gdn_prep.cu) calls it. */
int df_cuda_l2norm_rows(df_backend *be, df_tensor *x, float eps, float scale);

/* CUDA-core fallbacks (fallback.cu) for shapes the tuned kernels return
 * -ENOTSUP for: attention with any head_dim <= 256, the delta rule token by
 * token for any dk, dv whose state fits in shared memory. */
int df_cuda_attention_simt(df_backend *be, const df_tensor *q, const df_tensor *k,
                           const df_tensor *v, const int32_t *cu_seqlens, int n_seq, int nq,
                           int nkv, int head_dim, float scale, const df_tensor *gate,
                           df_tensor *out);
int df_cuda_gdn_recurrent(df_backend *be, const df_tensor *q, const df_tensor *k,
                          const df_tensor *v, const df_tensor *g, const df_tensor *beta,
                          const int32_t *cu_seqlens, int n_seq, int hk, int hv, int dk, int dv,
                          df_tensor *out);

#ifdef __cplusplus
}
#endif
#endif
