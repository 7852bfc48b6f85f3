/* fp8_cuda.h - df_op_matmul_fp8's two CUDA paths (fp8.cu, gemm_fp8.cu), for
 * the op itself and for tests. */
#ifndef DF_CUDA_FP8_CUDA_H
#define DF_CUDA_FP8_CUDA_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "backend_internal.h"
#include "cuda_state.h"
#include "fp8_mx.h"

/* The BF16 GEMM on the rounded operands (BF16 copies): FP8's numerics on
 * any GPU. Same contract as df_op_matmul_fp8. */
int df_cuda_matmul_fp8_bf16(df_backend *be, df_gemm_kind kind, const df_tensor *a,
                            const df_tensor *b, df_tensor *c, unsigned flags);

/* The E4M3 tensor cores (sm_90: cuBLASLt's block-scaled GEMM; MXFP8 on compute capability 10 and later, below; BF16
 * operands, DFLASH_FP8_GEMM on): 1 when they computed c, 0 when the caller
 * is to run the BF16 path (an older GPU, a shape refused or whose first
 * call's check against the BF16 path failed, an unaligned c), or a negative
 * error. flags: df_op_matmul_fp8's; x's codes under DF_FP8_HOLD_X in a
 * region of their own until the backend closes (a GEMM that the tensor
 * cores did not take keeps nothing). */
int df_cuda_matmul_fp8_fast(df_backend *be, df_gemm_kind kind, const df_tensor *a,
                            const df_tensor *b, df_tensor *c, unsigned flags);

/* Whether df_cuda_matmul_fp8_fast may take calls here (DFLASH_FP8_GEMM on,
 * compute capability 9.0 or 10 and later): a caller sets a workspace aside only then. */
int df_cuda_fp8_gemm_possible(df_backend *be);

/* The same with the codes and scales in ws (ws_bytes, from
 * df_cuda_matmul_fp8_ws_bytes; less: 0), for callers whose scratch is in
 * use (the LM head's chunk buffers). wa (DF_GEMM_FWD / _BWD_X; NULL: in
 * ws): the weight b's codes and scales apart, in a df_cuda_fp8_kept
 * region, and ws holds the rest (df_cuda_matmul_fp8_ws_bytes without_a).
 * weight_ready: b's codes are there already, from a call with the same b,
 * the same region and a c of as many columns: only a is rounded. Pass 0
 * unless an earlier call on that region returned 1. rows_ready
 * (DF_GEMM_FWD / _BWD_X): a's codes and scales are there already, written
 * by the caller where df_cuda_fp8_rows_slot said (a's data is not read).
 * cuBLASLt takes only row counts that are multiples of 4: for DF_GEMM_FWD /
 * _BWD_X, c may have up to 3 rows more than a (a's rows rounded up to 4),
 * those rows written as products of zero rows; the BF16 path (return 0)
 * writes a's rows of c only. */
size_t df_cuda_matmul_fp8_ws_bytes(df_gemm_kind kind, const df_tensor *a, const df_tensor *c,
                                   int without_a);
int df_cuda_matmul_fp8_fast_ws(df_backend *be, df_gemm_kind kind, const df_tensor *a,
                               const df_tensor *b, df_tensor *c, int accumulate, void *ws,
                               size_t ws_bytes, void *wa, int weight_ready, int rows_ready);

/* For a caller that writes a's codes itself where it computes a (the LM
 * head's softmax gradient, dy of DF_GEMM_BWD_X): with the same arguments as
 * the df_cuda_matmul_fp8_fast_ws call to come, where a's codes and scales go
 * in ws, as df_cuda_fp8_round_codes' mode 0 writes them: codes [n, kp] (a's
 * rows, then zero rows up to n = c's rows; zero codes past a's columns up to
 * kp) and sc[kb * n + o], the scale of row o's block kb (1 for a zero
 * block). 1: the call will take them (rows_ready 1); 0: not known yet (its
 * class's first call checks against a's BF16 values), MXFP8, or not this
 * path: pass a as BF16 (rows_ready 0). */
typedef struct df_cuda_fp8_rows {
    uint8_t *codes;
    float *scales;
    int64_t kp, n;
} df_cuda_fp8_rows;
int df_cuda_fp8_rows_slot(df_backend *be, df_gemm_kind kind, const df_tensor *a,
                          const df_tensor *b, const df_tensor *c, int accumulate, void *ws,
                          size_t ws_bytes, void *wa, df_cuda_fp8_rows *out);

/* A frozen weight's E4M3 codes kept on the device across calls (the LM
 * head's: 1 byte per element and orientation, until the backend closes):
 * slot (0 .. DF_CUDA_FP8_KEPT - 1) for weight w as A of kind (FWD: w, BWD_X:
 * w^T). The slot is the region for df_cuda_matmul_fp8_fast_ws's wa; ready:
 * it holds w's codes (set by the caller after a call on it returned 1;
 * cleared here when w's pointer, shape or stride differ from the slot's).
 * NULL: no memory (the caller keeps the codes in its workspace). */
#define DF_CUDA_FP8_KEPT 4
typedef struct df_cuda_fp8_kept {
    const void *w;
    int64_t rows, cols, ld;
    int kind, ready;
    void *buf;
    size_t bytes;
} df_cuda_fp8_kept;
df_cuda_fp8_kept *df_cuda_fp8_kept_get(df_backend *be, int slot, df_gemm_kind kind,
                                       const df_tensor *w);
/* Operands' codes written by the op that computes them (df_op_swiglu_bwd_fp8: dy of the gate
 * and up projections; df_op_swiglu_fp8: x of the down projection; df_op_rmsnorm_fp8: x of the
 * projections that read a norm's output) for the df_op_matmul_fp8
 * calls that follow with DF_FP8_MADE: a region per slot (0 .. DF_CUDA_FP8_MADE - 1), grown as
 * needed, until the backend closes; each serves one call (the first that matches it; df_cuda_fp8_made_claim_n: several). Claim slot for t [R, C] (bf16, 2-D) as operand op of kind
 * (0: a, dy of BWD_X / BWD_W or x of FWD; 1: b, x of BWD_W): 1 with out filled, the region
 * now t's but not ready; 0 where the codes would not be used (no E4M3 tensor cores, MXFP8,
 * BWD_W's dy without dyblk (128 x 1 blocks), no memory). The layouts (df_cuda_fp8_round_codes'
 * modes, with x = t):
 *   op 0 of FWD / BWD_X: mode 0 with n_out = R: codes [R, kp = C rounded up to 128],
 *          sc[kb * R + o]; a GEMM whose c has more rows than t rounds t;
 *   op 0 of BWD_W: mode 3: codes [C, kp = R rounded up to 128] (t^T, zero codes past R),
 *          sc[cb * L4 + rb], the scales zeroed by the caller first (L4 = kp / 128 rounded
 *          up to 4);
 *   op 1 of BWD_W: mode 1: codes [C, kp = R rounded up to 128] (t^T, zero codes past R),
 *          sc[kb * C + o];
 * (out->n = the code matrix's rows: R, C, C). Then df_cuda_fp8_made_ready with ok 1 once the
 * kernel writing them is enqueued on the backend's stream, 2 if it also left t's values
 * unwritten (DF_FP8_ONLY_CODES: a call that cannot take the codes then fails), 0 if it failed
 * (the slot stays unused). */
#define DF_CUDA_FP8_MADE 10
int df_cuda_fp8_made_claim(df_backend *be, int slot, df_gemm_kind kind, int op, const df_tensor *t,
                           int dyblk, df_cuda_fp8_rows *out);
/* The same for uses calls (>= 1; projections sharing one input: df_op_rmsnorm_fp8's slots 6 (FWD)
 * and 7 (BWD_W); df_op_fp8_dy_codes' 8 (BWD_X) and 9 (BWD_W) serve one each): the region serves the first uses calls that match it, and counts as taken
 * (made_proven) when all of them ran on the tensor cores. */
int df_cuda_fp8_made_claim_n(df_backend *be, int slot, df_gemm_kind kind, int op, const df_tensor *t,
                             int dyblk, int uses, df_cuda_fp8_rows *out);
void df_cuda_fp8_made_ready(df_backend *be, int slot, int ok);
/* After a claim: whether the slot's last claim had the same geometry (shape, row stride,
 * kind, operand; not the memory: a model's layers take turns) and its call took the codes on
 * the tensor cores: a producer may then leave the values out (ok 2 above), the call being as
 * sure to take them as the last one was. */
int df_cuda_fp8_made_proven(df_backend *be, int slot);
/* Operands whose codes calls took from their producer (DF_FP8_MADE), process-wide. */
int64_t df_cuda_fp8_made_reused(void);

/* The weights' codes kept by AdamW (fp8_wcodes.cu; df_backend_fp8_keep_weight_codes): for
 * a kept weight w [rows, cols] (BF16, rows and cols multiples of 128, row stride cols), the
 * A regions of DF_GEMM_FWD (fwd: codes [rows, cols] of w, then fwd_scales, 128 x 128 blocks,
 * sc[rb * L4 + cb], L4 = cols / 128 rounded up to 4) and of DF_GEMM_BWD_X (bwx: codes
 * [cols, rows] of w^T, then bwx_scales, sc[cb * L4' + rb], L4' = rows / 128 rounded up to 4):
 * df_cuda_fp8_round_codes' modes 2 and 3 on w. ready: they are the codes of w's current
 * values. */
typedef struct df_cuda_fp8_wcodes {
    const void *w;
    int64_t rows, cols;
    void *fwd, *bwx;
    float *fwd_scales, *bwx_scales;
    size_t fwd_bytes, bwx_bytes;
    int ready;
    /* stale (DFLASH_FP8_LAZY_BF16; implies ready): the AdamW that wrote the codes left w's
     * BF16 values out; they are bf16(master[0 .. rows * cols)), written by
     * df_cuda_fp8_wcodes_fresh before anything reads or writes part of w */
    int stale;
    const float *master;
} df_cuda_fp8_wcodes;
/* The region of a weight's codes as A of kind (FWD / BWD_X, FP32 scales): m code rows of kp
 * (a multiple of 128), then the 128 x 128 scales at *scales_at; its bytes. The layout
 * df_cuda_matmul_fp8_fast_ws takes in wa. */
size_t df_cuda_fp8_weight_region(df_gemm_kind kind, int64_t m, int64_t kp, size_t *scales_at);
/* Keeps w's codes (not ready until an AdamW writes them): 1, or 0 where they would not be
 * used or w does not qualify (DFLASH_FP8_WEIGHT_CODES off, no verified E4M3 tensor cores,
 * a shape not of 128-multiples, another view of a kept weight's memory), -ENOMEM, -EIO. */
int df_cuda_fp8_wcodes_keep(df_backend *be, const df_tensor *w);
/* The kept weights overlapping [p, p + bytes), each marked not ready, into out (at most
 * max, by address); returns how many overlap. AdamW's writer (optim.cu) sets ready again on
 * those it rewrote whole (and stale where lazy). */
int df_cuda_fp8_wcodes_in(df_backend *be, const void *p, size_t bytes,
                          df_cuda_fp8_wcodes **out, int max);
/* The ready codes of w (the same memory, shape and stride), or NULL. */
const df_cuda_fp8_wcodes *df_cuda_fp8_wcodes_of(df_backend *be, const df_tensor *w);
/* A write into [p, p + bytes) other than AdamW's: the kept weights there are not ready
 * (made fresh first: the write may cover them in part). 0 or -EIO. */
int df_cuda_fp8_wcodes_touch(df_backend *be, const void *p, size_t bytes);
/* Before a read of [p, p + bytes): the stale kept weights there get their BF16 values,
 * written from their masters on the backend's stream (AdamW's rounding: the bits it would
 * have written). 0 or -EIO (a launch failed). */
int df_cuda_fp8_wcodes_fresh(df_backend *be, const void *p, size_t bytes);
/* The same for the memory of a 2-D tensor t (a GEMM's weight operand). */
int df_cuda_fp8_wcodes_fresh_t(df_backend *be, const df_tensor *t);
/* Whether AdamW may leave a kept weight's BF16 values out (DFLASH_FP8_LAZY_BF16). */
int df_cuda_fp8_wcodes_lazy(void);
/* The kept weights overlapping [p, p + bytes) no longer kept, their regions freed. */
void df_cuda_fp8_wcodes_drop(df_backend *be, const void *p, size_t bytes);
/* Every kept weight not ready (a free: the memory may be handed out again). */
void df_cuda_fp8_wcodes_forget(df_backend *be);
/* How many weights are kept and their regions' bytes. */
void df_cuda_fp8_wcodes_count(df_backend *be, int *n, size_t *bytes);
/* GEMM calls that took a kept weight's codes, process-wide (df_cuda_fp8_wcodes_took counts
 * one). */
void df_cuda_fp8_wcodes_took(void);
int64_t df_cuda_fp8_wcodes_used(void);
void df_cuda_fp8_wcodes_close(df_cuda_state *s);

/* Marks every slot, and the codes held under DF_FP8_HOLD_X, as not ready
 * (df_backend_free calls it: memory freed and handed out again must not find
 * its old codes; frees come at teardown or when a buffer grows, not inside a
 * step). */
void df_cuda_fp8_kept_forget(df_backend *be);

/* The rounding kernels of df_cuda_matmul_fp8_fast alone (for tests): the
 * E4M3 codes and FP32 power-of-two scales of x [R, C] (bf16, row stride
 * x->stride[0]), both in device memory, scales zeroed by the caller, by mode:
 *   0: 1 x 128 blocks along x's rows: codes [n_out >= R, kp >= C] (rows
 *      past R and columns past C zero), sc[kb * n_out + o], kb = kp / 128;
 *   1: 1 x 128 blocks along x's columns (x^T): codes [C, kp >= R],
 *      sc[kb * C + o]; n_out = C;
 *   2: 128 x 128 blocks of x: codes [R, kp >= C], sc[rb * L4 + cb];
 *      n_out = R;
 *   3: 128 x 128 blocks of x^T: codes [C, kp >= R], sc[cb * L4 + rb]; n_out = C;
 * (rb, cb: x's row and column block; L4 = kp / 128 rounded up to 4). kp a
 * multiple of 128. Returns 0, -EINVAL, or -EIO (a launch failed). */
int df_cuda_fp8_round_codes(df_backend *be, int mode, const df_tensor *x, uint8_t *codes,
                            int64_t kp, float *sc, int64_t n_out);

/* The launches behind the two above and the GEMMs' operands (fp8_codes.cu),
 * on stream st, arguments as df_cuda_fp8_round_codes / df_cuda_fp8_mx_scales
 * check them (x [R, C] bf16 with row stride ld; vec: 16-byte loads, where x
 * and ld allow). 0 or -EIO. */
int df_cuda_fp8_codes_run(cudaStream_t st, int mode, const uint16_t *x, int64_t ld, int64_t R, int64_t C,
                          uint8_t *codes, int64_t kp, float *sc, int64_t n_out, int vec);
/* Modes 3 (wcodes, kpw >= R, wsc: zeroed by the caller) and 0 (xcodes, kpx >= C, n_out = R) of
 * x from one read of it (df_op_fp8_dy_codes). */
int df_cuda_fp8_codes_dy_run(cudaStream_t st, const uint16_t *x, int64_t ld, int64_t R, int64_t C,
                             uint8_t *xcodes, int64_t kpx, float *xsc, uint8_t *wcodes, int64_t kpw,
                             float *wsc, int vec);
/* Mode 1's codes of y = rmsnorm(x) (plain, weight w [C], each row's 1 / rms in inv [R], device
 * memory), y's BF16 values made as the norm kernels make them: the bytes mode 1 writes from y.
 * x as above; vec also needs w 16-byte aligned (checked here). */
int df_cuda_fp8_codes_norm_run(cudaStream_t st, const uint16_t *x, int64_t ld, int64_t R, int64_t C,
                               const float *inv, const uint16_t *w, uint8_t *codes, int64_t kp, float *sc,
                               int vec);
int df_cuda_fp8_mx_run(cudaStream_t st, const float *sc, int blk, int64_t n_sc, int64_t rows, int64_t kp,
                       uint8_t *out);

/* The conversion alone (for tests): the FP32 power-of-two scales sc of an
 * operand of rows rows and kp / 128 blocks per row (device memory) to its
 * E8M0 bytes in out (device, df_fp8_mx_offset's layout, rows rounded up to
 * 128, kp / 32 per row). blk 0: 1 x 128 scales sc[kb * n_sc + r] (rows from
 * n_sc on get 1.0); blk 1: 128 x 128 scales sc[(r / 128) * L4 + kb], L4 =
 * kp / 128 rounded up to 4 (mode 2 / 3 of df_cuda_fp8_round_codes). 0,
 * -EINVAL or -EIO. */
int df_cuda_fp8_mx_scales(df_backend *be, const float *sc, int blk, int64_t n_sc, int64_t rows,
                          int64_t kp, uint8_t *out);
/* Calls df_cuda_matmul_fp8_fast took / left to the BF16 path, process-wide. */
void df_cuda_fp8_gemm_counts(int64_t *fast, int64_t *fallback);
/* Calls that used x's kept codes (DF_FP8_SAME_X) instead of rounding x, process-wide. */
int64_t df_cuda_fp8_x_reused(void);

/* Frees the backend's FP8 plans (df_cuda_gemm_close). */
void df_cuda_fp8_gemm_close(df_cuda_state *s);

#ifdef __cplusplus
}
#endif

#endif
