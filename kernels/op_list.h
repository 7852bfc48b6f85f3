/* op_list.h - the compute ops a backend implements, each written once.
 *
 * DF_OPS(X) expands X(ret, name, params) for every op, in the order of the
 * backend table (df_backend_vt, backend_internal.h). From it come the table's
 * members, the CPU backend's declarations (df_cpu_<name>, backend_internal.h)
 * and table (ops.c), and the CUDA backend's declarations (df_cuda_<name>,
 * cuda/cuda_internal.h) and table (cuda/backend.cu). Adding an op: its line
 * here, its checked entry point df_op_<name> (ops.h / train_ops.h and the
 * dispatch in ops*.c / train_*.c), and one implementation per backend.
 * Arguments reach an implementation already checked (backend_internal.h). */
#ifndef DF_OP_LIST_H
#define DF_OP_LIST_H

#define DF_OPS(X)                                                                                   \
    /* the target's forward (ops.h) */                                                              \
    X(int, embed, (df_backend * be, const df_tensor *table, const uint32_t *ids, int64_t n,         \
                   df_tensor *out))                                                                 \
    X(int, matmul, (df_backend * be, const df_tensor *x, const df_tensor *w, df_tensor *y,          \
                    int accumulate))                                                                \
    X(int, add, (df_backend * be, const df_tensor *x, df_tensor *y))                                \
    X(int, rmsnorm, (df_backend * be, const df_tensor *x, const df_tensor *w, float eps,            \
                     int plus_one, df_tensor *y))                                                   \
    X(int, rmsnorm_gated, (df_backend * be, const df_tensor *x, const df_tensor *z,                 \
                           const df_tensor *w, float eps, df_tensor *y))                            \
    X(int, rope, (df_backend * be, df_tensor *x, const int32_t *pos, int heads, int head_dim,       \
                  int rot_dim, double theta))                                                       \
    X(int, swiglu, (df_backend * be, const df_tensor *gate, const df_tensor *up, df_tensor *out))   \
    X(int, sigmoid, (df_backend * be, const df_tensor *x, df_tensor *out))                          \
    X(int, silu, (df_backend * be, const df_tensor *x, df_tensor *out))                             \
    X(int, attention, (df_backend * be, const df_tensor *q, const df_tensor *k, const df_tensor *v, \
                       const int32_t *cu_seqlens, int n_seq, int nq, int nkv, int head_dim,         \
                       float scale, const df_tensor *gate, df_tensor *out))                         \
    X(int, conv1d_silu, (df_backend * be, const df_tensor *x, const df_tensor *w,                   \
                         const int32_t *cu_seqlens, int n_seq, df_tensor *out))                     \
    X(int, l2norm, (df_backend * be, df_tensor *x, float eps, float scale))                         \
    X(int, gdn_gates, (df_backend * be, const df_tensor *a, const df_tensor *b,                     \
                       const df_tensor *A_log, const df_tensor *dt_bias, df_tensor *g,              \
                       df_tensor *beta))                                                            \
    X(int, gdn, (df_backend * be, const df_tensor *q, const df_tensor *k, const df_tensor *v,       \
                 const df_tensor *g, const df_tensor *beta, const int32_t *cu_seqlens, int n_seq,   \
                 int hk, int hv, int dk, int dv, df_gdn_mode mode, df_tensor *out))                 \
    /* training (train_ops.h) */                                                                    \
    X(int, matmul_bwd_x, (df_backend * be, const df_tensor *dy, const df_tensor *w, df_tensor *dx,  \
                          int accumulate))                                                          \
    X(int, matmul_bwd_w, (df_backend * be, const df_tensor *dy, const df_tensor *x, df_tensor *dw,  \
                          int accumulate))                                                          \
    X(int, rmsnorm_bwd, (df_backend * be, const df_tensor *x, const df_tensor *w, float eps,        \
                         int plus_one, const df_tensor *dy, df_tensor *dx, int accumulate_dx,       \
                         df_tensor *dw))                                                            \
    X(int, rope_bwd, (df_backend * be, df_tensor *dx, const int32_t *pos, int heads, int head_dim,  \
                      int rot_dim, double theta))                                                   \
    X(int, swiglu_bwd, (df_backend * be, const df_tensor *gate, const df_tensor *up,                \
                        const df_tensor *dout, df_tensor *dgate, df_tensor *dup))                   \
    X(int, swiglu_fp8, (df_backend * be, const df_tensor *gate, const df_tensor *up,                \
                        df_tensor *out, unsigned flags))                                            \
    X(int, swiglu_bwd_fp8, (df_backend * be, const df_tensor *gate, const df_tensor *up,            \
                            const df_tensor *dout, df_tensor *dgate, df_tensor *dup,                \
                            unsigned flags))                                                        \
    X(int, fp8_dy_codes, (df_backend * be, const df_tensor *dy, unsigned flags))                    \
    X(int, rmsnorm_fp8, (df_backend * be, const df_tensor *x, const df_tensor *w, float eps,        \
                         df_tensor *y, int uses, unsigned flags))                                   \
    X(int, lmhead_ce, (df_backend * be, const df_tensor *h, const df_tensor *head,                  \
                       const int32_t *label, const float *weight, float denom, double *loss_sum,    \
                       df_tensor *dh, int32_t *argmax, float *ce, unsigned flags))                  \
    /* grad: grad_dtype elements, F32 or BF16 (checked) */                                          \
    X(int, adamw, (df_backend * be, float *master, const void *grad, df_dtype grad_dtype, float *m, \
                   float *v, int64_t n, float lr, float beta1, float beta2, float eps, float wd,    \
                   int64_t step, float grad_scale, uint16_t *out_bf16))                             \
    /* v: v_dtype elements, BF16 or F32 (checked) */                                               \
    X(int, adamw_m16, (df_backend * be, float *master, const void *grad, df_dtype grad_dtype,       \
                       uint16_t *m, void *v, df_dtype v_dtype, int64_t n, float lr, float beta1,    \
                       float beta2, float eps, float wd, int64_t step, float grad_scale,            \
                       uint64_t key, int64_t index0, uint16_t *out_bf16))                           \
    X(double, sumsq, (df_backend * be, const void *x, df_dtype dtype, int64_t n))                   \
    X(int, fp8_qdq, (df_backend * be, const df_tensor *x, df_tensor *y, int64_t block_rows,         \
                     int64_t block_cols))                                                           \
    X(int, matmul_fp8, (df_backend * be, df_gemm_kind kind, const df_tensor *a, const df_tensor *b, \
                        df_tensor *c, unsigned flags))                                              \
    X(int, dflash_attn, (df_backend * be, const df_tensor *q, const df_tensor *kc,                  \
                         const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,             \
                         const df_dflash_blocks *blk, int nq, int nkv, int head_dim, float scale,   \
                         df_tensor *out, df_tensor *lse))                                           \
    X(int, dflash_attn_bwd, (df_backend * be, const df_tensor *q, const df_tensor *kc,              \
                             const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,         \
                             const df_dflash_blocks *blk, int nq, int nkv, int head_dim,            \
                             float scale, const df_tensor *out, const df_tensor *lse,               \
                             const df_tensor *dout, df_tensor *dq, df_tensor *dkc, df_tensor *dvc,  \
                             df_tensor *dkb, df_tensor *dvb))

/* The backend table's member for an op (backend_internal.h). */
#define DF_OP_MEMBER(ret, name, params) ret(*name) params;

#endif
