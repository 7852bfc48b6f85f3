/* ops.h - the op interface the model code is written against once.
 *
 * A backend (the CPU reference or CUDA) implements every op below; model code
 * calls df_op_*() with a backend handle and never knows which one runs.
 * The CPU backend is the reference: plain C, fp32 math, threads via
 * common/pool.h; GPU ops are tested against it.
 *
 * Tensors: df_tensor views memory the backend can address (host memory for
 * the CPU backend, device memory for CUDA). Up to 4 dims, row-major, strides
 * in elements; every op requires the innermost dim to be contiguous
 * (stride[ndim-1] == 1) and accepts any outer stride (views into fused
 * projections, e.g. q and gate halves of one GEMM output). 2-D tensors are
 * [rows, cols].
 *
 * Dtypes: activations have the backend's activation dtype (F32 on the CPU
 * reference, which computes and stores fp32; BF16 on CUDA, which computes
 * in fp32 and rounds once per op output); where an op says "f32" the tensor
 * is F32 on every backend. Weights may be BF16, F16 or F32 on the CPU (read
 * straight from the mmapped safetensors), BF16 on CUDA. Where an op takes a
 * weight it says so.
 *
 * Packed sequences: several documents are concatenated along the token
 * axis; cu_seqlens[0..n_seq] (int32, cu_seqlens[0] = 0, increasing,
 * cu_seqlens[n_seq] = total tokens) marks their bounds. Causal ops never
 * look across a bound; recurrent state starts at zero in each sequence.
 *
 * Every op returns 0 or a negative errno (-EINVAL on inconsistent shapes,
 * with nothing written).
 *
 * Aliasing: where an op says "y may alias x", y may be exactly the same view
 * as x (same data, shape and strides); an output that partly overlaps any
 * input is -EINVAL. Disjoint column views of one buffer never overlap.
 *
 * Ops may run asynchronously on a GPU backend: df_backend_sync() waits.
 */
#ifndef DF_OPS_H
#define DF_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "err.h"

#define DF_TENSOR_MAX_DIMS 4

typedef struct df_tensor {
    void *data;
    df_dtype dtype;
    int ndim;
    int64_t shape[DF_TENSOR_MAX_DIMS];
    int64_t stride[DF_TENSOR_MAX_DIMS]; /* elements */
} df_tensor;

/* Contiguous views. */
df_tensor df_tensor_1d(void *data, df_dtype t, int64_t n);
df_tensor df_tensor_2d(void *data, df_dtype t, int64_t rows, int64_t cols);
/* A 2-D view of columns [col0, col0 + cols) of every row of a [rows, ld] matrix.
 * Out of range (or m not 2-D): an invalid tensor (data NULL, ndim 0) that
 * every op rejects with -EINVAL. */
df_tensor df_tensor_cols(const df_tensor *m, int64_t col0, int64_t cols);
/* Pointer to element (r, c) of a 2-D tensor (NULL if not 2-D). */
void *df_tensor_at(const df_tensor *m, int64_t r, int64_t c);
/* Product of the shape; 0 for an invalid tensor (ndim outside 1..4). */
int64_t df_tensor_numel(const df_tensor *t);

typedef struct df_backend df_backend;

/* The CPU backend; nthreads 0 = online CPUs. */
df_backend *df_backend_cpu_open(int nthreads, df_err *e);
void df_backend_close(df_backend *be);
const char *df_backend_name(const df_backend *be);
int df_backend_sync(df_backend *be);
/* Memory the backend's ops can use (64-byte aligned); free with _free. */
void *df_backend_alloc(df_backend *be, size_t bytes);
void df_backend_free(df_backend *be, void *p);
/* Copies between host memory and backend memory (plain memcpy on the CPU).
 * On CUDA both are ordered with the backend's stream and return once the
 * host side is done with (upload) or holds (download) the bytes. */
int df_backend_upload(df_backend *be, void *dst, const void *src, size_t bytes);
int df_backend_download(df_backend *be, void *dst, const void *src, size_t bytes);
/* Copies / zeroes bytes of backend memory, ordered with the ops (dst and
 * src must not overlap). */
int df_backend_copy(df_backend *be, void *dst, const void *src, size_t bytes);
int df_backend_zero(df_backend *be, void *dst, size_t bytes);
/* n elements of backend memory from dtype st to dt (F32 and BF16; RNE). */
int df_backend_cast(df_backend *be, void *dst, df_dtype dt, const void *src, df_dtype st,
                    int64_t n);
/* A download ordered after the ops enqueued so far, finished by the next
 * df_backend_sync(): dst must stay valid until then (pinned memory from
 * df_backend_host_alloc lets it run asynchronously on CUDA). */
int df_backend_download_async(df_backend *be, void *dst, const void *src, size_t bytes);
/* An upload enqueued in op order that does not wait: src must stay unchanged
 * until the next df_backend_sync() (from df_backend_host_alloc memory it runs
 * asynchronously on CUDA; plain memcpy on the CPU). */
int df_backend_upload_async(df_backend *be, void *dst, const void *src, size_t bytes);
/* An upload that overlaps the compute (CUDA: on a copy stream): it starts
 * once the work enqueued so far has run, so dst may be memory that work
 * still reads, and work enqueued after it does not wait for it until
 * df_backend_upload_join(), which makes all work enqueued from then on wait
 * for every upload ahead so far. src (df_backend_host_alloc memory) must
 * stay unchanged until the next df_backend_sync(), which also waits for
 * these uploads. The CPU backend copies at once (join: nothing). */
int df_backend_upload_ahead(df_backend *be, void *dst, const void *src, size_t bytes);
int df_backend_upload_join(df_backend *be);

/* A side stream for work that may overlap the compute (the optimizer of one
 * step with the next step's forward). Between df_backend_side_begin and
 * df_backend_side_end every op is enqueued on the side stream, which starts
 * after the work enqueued so far; df_backend_side_mark(be, k) (in side mode)
 * records point k of it, and df_backend_wait_mark(be, k) (outside) makes the
 * work enqueued from then on wait for that point (once: a mark not recorded
 * again is not waited for twice). df_backend_sync waits for both streams.
 * 0 <= k < DF_BACKEND_MARKS. The CPU backend runs everything in order at
 * once: these do nothing there. Not nested; -EINVAL on misuse. Only
 * elementwise work belongs on the side stream (AdamW, zeroing): GEMMs, the
 * LM head, the norms' backward, sumsq and the attention backward share the
 * backend's workspaces with the main stream's ops. */
#define DF_BACKEND_MARKS 64
/* Caller memory lent to the ops' workspaces until the next call (p NULL:
 * the loan ends): a workspace that fits is taken from [p, p + bytes)
 * instead of the backend's own, which then need not grow to the LM head's
 * chunk buffers (CUDA: df_op_lmhead_ce sizes its chunks to a loan of at
 * least 512 MiB). The memory must be free from the first op enqueued
 * during the loan until the ops enqueued during it have run (stream order:
 * the caller's own later ops are fine). Side-stream ops must not run
 * during a loan. The CPU backend ignores loans. */
void df_backend_lend_scratch(df_backend *be, void *p, size_t bytes);
int df_backend_side_begin(df_backend *be);
int df_backend_side_end(df_backend *be);
int df_backend_side_mark(df_backend *be, int k);
int df_backend_wait_mark(df_backend *be, int k);
/* Host memory the backend copies from/to fastest (pinned on CUDA, plain
 * aligned memory on the CPU); free with _host_free. */
void *df_backend_host_alloc(df_backend *be, size_t bytes);
void df_backend_host_free(df_backend *be, void *p);
/* The dtype every activation tensor of the ops below must have: F32 on the
 * CPU backend (the fp32 reference), BF16 on CUDA. Weights may be any weight
 * dtype on the CPU; the CUDA backend's ops take BF16 weights (model code
 * converts at upload). */
df_dtype df_backend_act_dtype(const df_backend *be);
/* 1 when backend memory is plain host memory (the CPU backend): weights can
 * then be used straight from a mapping. */
int df_backend_host_addressable(const df_backend *be);

/* Fills n elements (dtype F32 or BF16) of backend memory p with values in
 * [lo, hi) from a hash of (seed, index): the same numbers on every backend
 * (random-weight models for benchmarks and CPU/GPU comparisons). */
int df_backend_fill_uniform(df_backend *be, void *p, df_dtype dt, int64_t n, uint64_t seed,
                            float lo, float hi);

/* Bytes of device memory in use on the backend's device (all processes), or
 * -1 where that is not known (the CPU backend). */
int64_t df_backend_mem_used(df_backend *be);
/* With DFLASH_PROFILE=1 (per-op GPU times, logged at close): forget the
 * times so far, e.g. a warm-up step's (plan choice, allocation). */
void df_backend_profile_reset(df_backend *be);

/* The CUDA backend on device `device` (ops on one stream, cuBLASLt GEMMs).
 * NULL with e set when there is no such device or the build has no CUDA. */
df_backend *df_backend_cuda_open(int device, df_err *e);
/* Visible CUDA devices: 0 with none, -1 in a build without CUDA. */
int df_backend_cuda_device_count(void);
/* The CUDA backend's stream (a cudaStream_t) and device, for code that
 * orders its own work with the ops (collectives); NULL / -1 for any other
 * backend. */
void *df_backend_cuda_stream(df_backend *be);
int df_backend_cuda_device(df_backend *be);
/* 1 where df_op_matmul_fp8 runs on FP8 tensor cores of a kind of GPU it has been verified on
 * (compute capability 9.0: cuBLASLt's block-scaled E4M3 GEMM; DFLASH_FP8_GEMM on), 0 elsewhere
 * (other backends and GPUs take the BF16 GEMM on rounded operands: FP8's numerics, not its
 * speed). What `dflash train`'s --fp8 auto decides on. */
int df_backend_fp8_tensor_cores(df_backend *be);
/* Asks the backend to keep weight w's E4M3 codes for df_op_matmul_fp8 (as DF_GEMM_FWD's and
 * _BWD_X's w), written by df_op_adamw / df_op_adamw_m16 where their out_bf16 covers w whole,
 * so that no GEMM rounds w (the same codes: the same bits), until
 * df_backend_fp8_drop_weight_codes or the backend closes. Costs 2 bytes per element. Every
 * other write into w that the backend does (uploads, copies, casts, fills, zeroing, any free)
 * makes the GEMMs round w again until the next such AdamW; a write it does not see (a
 * collective, a kernel of one's own) must not happen to a kept weight. 1: kept; 0: not (a
 * backend or GPU without E4M3 tensor cores, DFLASH_FP8_WEIGHT_CODES=0, a shape not of
 * 128-multiples, a strided view); -ENOMEM. */
int df_backend_fp8_keep_weight_codes(df_backend *be, const df_tensor *w);
/* Stops keeping the codes of the weights in [p, p + bytes) and frees them (before that memory
 * is freed or used for something else; nothing kept there: nothing happens). */
void df_backend_fp8_drop_weight_codes(df_backend *be, const void *p, size_t bytes);

/* ---- dense ops ---- */

/* out[i, :] = table[ids[i], :] (activation dtype). table [V, H] (BF16/F16/F32 weight),
 * out [n, H]; an id >= V is -EINVAL. */
int df_op_embed(df_backend *be, const df_tensor *table, const uint32_t *ids, int64_t n,
                df_tensor *out);

/* y = x @ w^T (+ y if accumulate): x [M, K], w [N, K] weight, y [M, N].
 * fp32 accumulation over k; with accumulate the finished sum is added to y
 * last (residual + projection). y must not overlap x or w. */
int df_op_matmul(df_backend *be, const df_tensor *x, const df_tensor *w, df_tensor *y,
                 int accumulate);

/* y = x + y, elementwise, same shapes (the residual add); y may alias x.
 * Like the other elementwise ops (and the norms, over their last dim), it
 * takes any 1..4-D shape, each row of the last dim contiguous. */
int df_op_add(df_backend *be, const df_tensor *x, df_tensor *y);

/* RMSNorm over the last dim of x [R, D]: y = x * rsqrt(mean(x^2) + eps) * g,
 * g = w (plain, Qwen3) or 1 + w (plus_one, Qwen3.5's zero-centred norms).
 * w [D] weight. Per-head norms (q_norm/k_norm) view [T, heads*D] as
 * [T*heads, D]. y may alias x. */
int df_op_rmsnorm(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                  int plus_one, df_tensor *y);

/* Gated RMSNorm (the GDN output norm): y = rmsnorm_plain(x) * w * silu(z),
 * x, z, y [R, D], w [D] weight. y may alias x. */
int df_op_rmsnorm_gated(df_backend *be, const df_tensor *x, const df_tensor *z,
                        const df_tensor *w, float eps, df_tensor *y);

/* NeoX RoPE in place on x [T, heads*head_dim]: for each head, the first
 * rot_dim dims rotate in pairs (d, d + rot_dim/2) by angle
 * pos[t] * theta^(-2d/rot_dim); dims rot_dim.. are unchanged. Angles are
 * computed in fp32 (inv_freq in fp32, as HF does), then cos/sin in f32.
 * pos [T] int32. */
int df_op_rope(df_backend *be, df_tensor *x, const int32_t *pos, int heads, int head_dim,
               int rot_dim, double theta);

/* out = silu(gate) * up; all [T, F]. out may alias gate or up. */
int df_op_swiglu(df_backend *be, const df_tensor *gate, const df_tensor *up, df_tensor *out);

/* out = sigmoid(x) elementwise, and silu likewise; out may alias x. */
int df_op_sigmoid(df_backend *be, const df_tensor *x, df_tensor *out);
int df_op_silu(df_backend *be, const df_tensor *x, df_tensor *out);

/* Causal attention over packed sequences with GQA:
 * q [T, nq*D], k [T, nkv*D], v [T, nkv*D] (any row strides), out [T, nq*D];
 * query head h uses kv head h / (nq/nkv); softmax(q.k * scale) in fp32 over
 * keys j <= i of the same sequence. If gate (same shape as out) is given,
 * out *= sigmoid(gate) (Qwen3.5's output gate). out must not overlap q, k,
 * v or gate. Empty sequences (equal bounds) are allowed. */
int df_op_attention(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
                    const int32_t *cu_seqlens, int n_seq, int nq, int nkv, int head_dim,
                    float scale, const df_tensor *gate, df_tensor *out);

/* ---- Gated DeltaNet ops (Qwen3.5 linear-attention layers) ---- */

/* Causal depthwise conv1d + SiLU per channel over packed sequences, zero
 * left padding at each sequence start: out[t, c] = silu(sum_k w[c, k] *
 * x[t - (K-1) + k, c]). x, out [T, C] (out must not alias x); w [C, K] weight
 * (the checkpoint's [C, 1, K] viewed 2-D). */
int df_op_conv1d_silu(df_backend *be, const df_tensor *x, const df_tensor *w,
                      const int32_t *cu_seqlens, int n_seq, df_tensor *out);

/* In place: each row of x [R, D] becomes (x * rsqrt(sum x^2 + eps)) * scale.
 * x may also be [T, heads, D] (up to 4-D; the last dim is normalised, any
 * outer strides): per-head q/k inside the fused conv output. */
int df_op_l2norm(df_backend *be, df_tensor *x, float eps, float scale);

/* beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias), all fp32:
 * a, b [T, H] activations; A_log, dt_bias [H] weights; g, beta [T, H] f32
 * out (F32 on every backend; in place over a or b only where dtypes agree).
 * softplus as torch: x > 20 ? x : log1p(exp(x)). g and beta must not
 * overlap each other (column halves of one buffer are fine); each may be
 * exactly a or b (in place) or must not overlap them. */
int df_op_gdn_gates(df_backend *be, const df_tensor *a, const df_tensor *b,
                    const df_tensor *A_log, const df_tensor *dt_bias, df_tensor *g,
                    df_tensor *beta);

typedef enum df_gdn_mode {
    DF_GDN_RECURRENT = 0, /* token by token: the oracle */
    DF_GDN_CHUNKED = 1    /* chunks of 64: GEMM-shaped work + a sequential state pass */
} df_gdn_mode;

/* The gated delta rule over packed sequences. q, k [T, hk*Dk] (already
 * l2-normalised, q scaled), v [T, hv*Dv], g, beta [T, hv] (g <= 0, not
 * checked), out [T, hv*Dv], which must not overlap any input. Value head h
 * uses q/k head h / (hv/hk). Per (sequence, value head) the state
 * S [Dk, Dv] starts at zero:
 *   S = S * exp(g_t); delta = (v_t - S^T k_t) * beta_t; S += k_t delta^T; o_t = S^T q_t
 * State in fp32. Both modes give the same result up to rounding. */
int df_op_gdn(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
              const df_tensor *g, const df_tensor *beta, const int32_t *cu_seqlens, int n_seq,
              int hk, int hv, int dk, int dv, df_gdn_mode mode, df_tensor *out);

#endif
