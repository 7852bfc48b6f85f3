/* train_ops.h - what training the DFlash drafter needs beyond ops.h:
 * backward passes, the drafter attention (forward + backward), the fused
 * LM-head cross-entropy and AdamW. Same conventions as ops.h (df_tensor
 * views, activations in the backend's activation dtype, weights BF16/F16/F32
 * on the CPU and BF16 on CUDA, -EINVAL on inconsistent arguments with
 * nothing written). The CPU versions are the
 * reference the CUDA kernels will be tested against.
 *
 * Activation gradients have the activation dtype (F32 on the CPU, BF16 on
 * CUDA). Weight gradients (matmul_bwd_w's and rmsnorm_bwd's dw) are F32 or
 * BF16 on any backend, whatever the activation dtype: BF16 halves the
 * memory and traffic of the gradient array, as PyTorch's bf16 training
 * does. A BF16 dw element is computed exactly as the F32 one (the same fp32
 * sum, plus - when accumulating - the old value widened to fp32), then
 * rounded once to bf16, to nearest even (accumulating on CUDA, matmul_bwd_w
 * may round twice: see there). The optimizer (df_op_adamw) and
 * the gradient norm (df_op_sumsq) read F32 or BF16 gradients, widened
 * exactly to fp32.
 *
 * "accumulate" = add into the destination instead of overwriting it
 * (weight gradients are summed over the rows of a batch and over
 * accumulation steps).
 */
#ifndef DF_TRAIN_OPS_H
#define DF_TRAIN_OPS_H

#include "ops.h"

/* ---- backward of the dense ops (forward in ops.h) ---- */

/* y = x @ w^T:  dx (+)= dy @ w   ([M,N] x [N,K] -> [M,K])
 *               dw (+)= dy^T @ x ([N,M] x [M,K] -> [N,K], F32 or BF16)
 * dy, x, dx activations; w a weight. As df_op_matmul: each element is one
 * fp32 sum (over n, resp. over the rows m in order); with accumulate the
 * finished sum is added to the old value (widened to fp32) last, in fp32;
 * a BF16 dw then rounds that once (RNE) on the CPU. CUDA (cuBLASLt, bf16 C
 * with beta 1) may round the new sum to bf16 before adding the old value:
 * seen on the H200 for some shapes (not for others), never documented
 * either way; that is what PyTorch's bf16 gradient accumulation always does
 * (a bf16 GEMM output added to the bf16 .grad). So an accumulating BF16 dw
 * is RN(sum + old) or RN(RN(sum) + old). dx/dw must not overlap any input. */
int df_op_matmul_bwd_x(df_backend *be, const df_tensor *dy, const df_tensor *w, df_tensor *dx,
                       int accumulate);
int df_op_matmul_bwd_w(df_backend *be, const df_tensor *dy, const df_tensor *x, df_tensor *dw,
                       int accumulate);

/* RMSNorm backward (plain w or 1 + w): from x, w and dy, dx (+)= ... and
 * dw += sum over rows (dw [D] F32 or BF16, always accumulated: the fp32 sum
 * over the rows, in a fixed order, plus the old value widened to fp32; a
 * BF16 dw rounds that once, RNE). dx may be NULL.
 * x, dy, dx: the same 1..4-D shape (last dim D, as df_op_rmsnorm); w [D]
 * weight. dx may be exactly dy's (or x's) view; dw overlaps nothing. */
int df_op_rmsnorm_bwd(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                      int plus_one, const df_tensor *dy, df_tensor *dx, int accumulate_dx,
                      df_tensor *dw);

/* RoPE backward: the transpose of the rotation (angle -theta), in place on
 * the gradient dx [T, heads*head_dim]; same arguments as df_op_rope. */
int df_op_rope_bwd(df_backend *be, df_tensor *dx, const int32_t *pos, int heads, int head_dim,
                   int rot_dim, double theta);

/* out = silu(gate) * up:  dgate = dout * up * silu'(gate), dup = dout * silu(gate).
 * All the same 1..4-D shape. dgate and dup must not overlap each other; each
 * may be exactly the view of an input (in place) or overlap none. */
int df_op_swiglu_bwd(df_backend *be, const df_tensor *gate, const df_tensor *up,
                     const df_tensor *dout, df_tensor *dgate, df_tensor *dup);

/* ---- the DFlash drafter attention ----
 *
 * One packed row: S context positions (several documents) and n_blocks
 * blocks of block_size tokens. Queries are the block tokens: q
 * [n_blocks*bs, nq*D]. Keys/values: the context kc, vc [S, nkv*D] and the
 * block tokens kb, vb [n_blocks*bs, nkv*D]. For the query at offset
 * q_off of block b (anchor position p = anchor[b], its document starting at
 * doc_start[b]):
 *   context key j is visible iff doc_start[b] <= j < p (strictly before the
 *     anchor, same document), and for a sliding layer (window W > 0) also
 *     j >= p + q_off - (W - 1);
 *   block key (b', k_off) is visible iff b' == b, and for a sliding layer
 *     k_off <= q_off (causal in the block); full layers see the whole block.
 * Padding blocks (valid[b] == 0) and rows with nothing visible output 0,
 * lse = -inf, and get zero gradients — never NaN. GQA: query head h uses kv
 * head h / (nq/nkv). Softmax in fp32; lse [n_blocks*bs, nq] F32 (natural
 * log of sum_j exp(scale * q.k_j)) is saved for the backward pass.
 * Checked (-EINVAL, nothing written): scale finite and > 0 (the kernels take
 * the max of q.k before scaling), block_size >= 1, window >= 0, and for
 * every valid block (valid[b] != 0) 0 <= doc_start <= anchor < S; a padding
 * block's anchor and doc_start are never read. Outputs (out, lse; dq, dkc,
 * dvc, dkb, dvb) must not overlap any input or each other. */
typedef struct df_dflash_blocks {
    int n_blocks, block_size;
    const int32_t *anchor;    /* [n_blocks] context index of the anchor token */
    const int32_t *doc_start; /* [n_blocks] context index where its document starts */
    const uint8_t *valid;     /* [n_blocks] 0 = padding block */
    int window;               /* sliding window W; 0 = full-attention layer */
} df_dflash_blocks;

int df_op_dflash_attn(df_backend *be, const df_tensor *q, const df_tensor *kc,
                      const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,
                      const df_dflash_blocks *blk, int nq, int nkv, int head_dim, float scale,
                      df_tensor *out, df_tensor *lse);

/* Gradients of the above from dout; dq, dkb, dvb are overwritten; dkc, dvc
 * are overwritten too (context keys are seen by several blocks: their
 * gradients are summed inside). Deterministic. */
int df_op_dflash_attn_bwd(df_backend *be, const df_tensor *q, const df_tensor *kc,
                          const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,
                          const df_dflash_blocks *blk, int nq, int nkv, int head_dim, float scale,
                          const df_tensor *out, const df_tensor *lse, const df_tensor *dout,
                          df_tensor *dq, df_tensor *dkc, df_tensor *dvc, df_tensor *dkb,
                          df_tensor *dvb);

/* ---- fused frozen LM head + weighted cross-entropy ----
 *
 * logits = h @ head^T (h [N, H] F32, head [V, H] weight, never stored whole:
 * rows are processed in chunks). Row i with label[i] >= 0 and weight[i] > 0
 * contributes weight[i] * CE_i; *loss_sum (+)= sum_i weight[i] * CE_i
 * (the caller divides by the global denominator). If dh is not NULL it gets
 * d(sum_i weight[i] * CE_i / denom)/dh (the head is frozen: no gradient for
 * it). argmax [N] (may be NULL) gets each row's argmax (for acc[k]).
 * ce [N] (may be NULL) gets each row's CE (0 for ignored rows).
 * Precisely: a negative label ignores the row, label >= V is -EINVAL;
 * weight NULL means 1 for every row, else each weight must be finite and
 * >= 0; *loss_sum is added to (loss_sum may be NULL); denom must be finite
 * and > 0 when dh is given (unused otherwise); ignored rows get dh = 0.
 * Outputs overlap no input and no other output.
 * flags: 0, or DF_CE_FP8_GRAD (FP8 training, docs/FP8.md): the softmax
 * gradient G (per row, [V]) is rounded to E4M3 before dh = G @ head, with a
 * power-of-two scale per 128 consecutive entries (df_op_fp8_qdq's 1 x 128
 * blocks). The caller passes h and head already rounded (df_op_fp8_qdq:
 * h in 1 x 128 blocks, head in 128 x 128), so both GEMMs have E4M3
 * operands and a backend may run them on E4M3 tensor cores (the sums in
 * another order). DF_CE_FP8_HEAD_FROZEN (with DF_CE_FP8_GRAD): head is the
 * same tensor, unchanged, at every call with this flag (the drafter's frozen
 * LM head): a backend may make its E4M3 codes once and keep them (the CUDA
 * backend: one byte per element and GEMM, until it closes).
 * DF_CE_FP8_ROUND_HEAD (with DF_CE_FP8_GRAD): head is passed as it is, not
 * rounded; the results are those of this call with head rounded first
 * (df_op_fp8_qdq, 128 x 128) and without this flag. The backend rounds it
 * for the call only: the CUDA backend makes its E4M3 codes straight from it
 * (with DF_CE_FP8_HEAD_FROZEN, kept as above), and a rounded BF16 copy only
 * where its BF16 GEMMs take a chunk over (a class the E4M3 plan refused),
 * freed at the call's end. So a caller with E4M3 tensor cores keeps no
 * rounded copy of a large head.
 * DF_CE_BF16_LOGITS (with or without the others): each logit is rounded to
 * BF16 (to nearest even) before anything reads it, as a BF16 LM head in
 * PyTorch leaves them (SpecForge's training): loss, ce, argmax and G are
 * those of the rounded logits. A backend may then store the logits as BF16
 * (the CUDA backend: half the bytes of F32 logits written and read twice).
 * DF_CE_F16_LOGITS (with or without the others; not with DF_CE_BF16_LOGITS):
 * each logit is rounded to FP16 (to nearest even; past 65504 to +-Inf)
 * instead: 11 significant bits against BF16's 8, at the same 2 bytes. A
 * backend may store them so where its GEMM writes FP16 (the CUDA backend:
 * on the E4M3 tensor cores) and elsewhere round them where they are read.
 * DF_CE_FP8_ONEPASS (with DF_CE_FP8_GRAD): G is split as Gp - c onehot(label)
 * (c = weight / denom) and only Gp is rounded to E4M3: per 1 x 128 block
 * of the row, with mb the block's largest logit, mx the row's and s the
 * row's sum of expf(z - mx) (the loss's), Gp_v = e4m3(expf(z_v - mb) 256)
 * times the block scale (f32)(c / s exp(mb - mx) 2^-8) (a block of -inf
 * logits: 0). Its codes then fill E4M3's range from the top, and need no
 * row statistics before they are written, so a backend can make them in
 * one read of the logits. dh = Gp @ head', then per element dh -= (f32)c
 * head'[label] (each operation rounded in fp32), head' the head the GEMMs
 * take (rounded, with DF_CE_FP8_ROUND_HEAD). Loss, ce and argmax are
 * unchanged. A backend that does not write Gp's codes itself for a chunk
 * of rows may compute that chunk as without this flag (the CUDA backend:
 * without kept E4M3 codes of the head, i.e. DF_CE_FP8_HEAD_FROZEN on
 * sm_90's E4M3 tensor cores, at a GEMM class's first call, and for V past
 * 2^18).
 * Other bits: -EINVAL. */
#define DF_CE_FP8_GRAD 1u
#define DF_CE_FP8_HEAD_FROZEN 2u
#define DF_CE_FP8_ROUND_HEAD 4u
#define DF_CE_BF16_LOGITS 8u
#define DF_CE_FP8_ONEPASS 16u
#define DF_CE_F16_LOGITS 32u
int df_op_lmhead_ce(df_backend *be, const df_tensor *h, const df_tensor *head,
                    const int32_t *label, const float *weight, float denom, double *loss_sum,
                    df_tensor *dh, int32_t *argmax, float *ce, unsigned flags);

/* ---- optimizer ----
 * AdamW over fp32 master weights (n elements): m = b1 m + (1-b1) g;
 * v = b2 v + (1-b2) g^2; p -= lr * (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd p);
 * grad is scaled by grad_scale first (global-norm clipping). If out_bf16 is
 * not NULL, the updated weights are also written there as bf16 (RNE).
 * grad holds n elements of grad_dtype, DF_DTYPE_F32 or DF_DTYPE_BF16 (else
 * -EINVAL): each is widened to fp32 exactly, so BF16 gradients give the
 * very bits F32 gradients of the same values give.
 * step >= 1; 0 <= beta < 1; eps > 0; lr, wd, grad_scale finite and >= 0;
 * the arrays share no memory. fp32 math per element. */
int df_op_adamw(df_backend *be, float *master, const void *grad, df_dtype grad_dtype, float *m,
                float *v, int64_t n, float lr, float beta1, float beta2, float eps, float wd,
                int64_t step, float grad_scale, uint16_t *out_bf16);

/* AdamW as df_op_adamw, with the first moment m stored in BF16, and the
 * second v in BF16 too (v_dtype DF_DTYPE_BF16), in UF16 (DF_DTYPE_UF16:
 * common/uf16.h, 11 significant bits for a v >= 0 below 64) or in F32
 * (DF_DTYPE_F32, as df_op_adamw keeps it): half their memory and traffic. A
 * 16-bit moment is computed in fp32 as there, from its stored value widened
 * exactly, and stored stochastically rounded (common/bf16_sr.h, uf16.h) so
 * that small steps (v moves by 1 - beta2 of itself per step) survive on
 * average where round-to-nearest would drop them; the update uses the fp32
 * moments before that rounding. Element i's random bits: df_sr_bits(key,
 * index0 + i), the low 16 for m, the next 16 for a 16-bit v (UF16 takes
 * their low 13): the same bits on every backend and
 * however the parameters are split into calls (index0: element 0's index in
 * the whole array), and m's bits do not depend on v_dtype. The same checks as
 * df_op_adamw (m spans n bf16, v n of v_dtype; another v_dtype: -EINVAL),
 * index0 >= 0. */
int df_op_adamw_m16(df_backend *be, float *master, const void *grad, df_dtype grad_dtype,
                    uint16_t *m, void *v, df_dtype v_dtype, int64_t n, float lr, float beta1,
                    float beta2, float eps, float wd, int64_t step, float grad_scale,
                    uint64_t key, int64_t index0, uint16_t *out_bf16);

/* Sum of squares of n elements of x (for the global gradient norm), in
 * double: dtype DF_DTYPE_F32 or DF_DTYPE_BF16, each element widened exactly
 * (a BF16 array gives the very bits the F32 array of the same values
 * gives). Bad arguments (a NULL x with n > 0, n < 0, another dtype) return
 * -EINVAL as a double (a sum of squares is never < 0). */
double df_op_sumsq(df_backend *be, const void *x, df_dtype dtype, int64_t n);

/* ---- FP8 (E4M3), for FP8 training (docs/FP8.md) ---- */

/* The three GEMMs of a linear layer: y = x w^T (df_op_matmul), dx = dy w
 * (df_op_matmul_bwd_x), dw = dy^T x (df_op_matmul_bwd_w). */
typedef enum df_gemm_kind { DF_GEMM_FWD = 0, DF_GEMM_BWD_X = 1, DF_GEMM_BWD_W = 2 } df_gemm_kind;

/* c (+)= the product the BF16 op of kind computes (a, b, c as its x/dy,
 * w/x, y/dx/dw; the same checks), with both operands
 * first rounded to E4M3 as df_op_fp8_qdq does, in the blocks of the recipe:
 * along each GEMM's reduction, so an activation or gradient takes 1 x 128
 * blocks (x of DF_GEMM_FWD, dy of DF_GEMM_BWD_X) or 128 x 1 blocks (both
 * operands of DF_GEMM_BWD_W, which reduces over rows), a weight 128 x 128.
 * A backend computes the BF16 op on the rounded operands (they are exact
 * BF16 values; FP32 accumulation), or FP8 tensor-core GEMMs that give the
 * same products up to the order of the sums.
 * flags: DF_FP8_ACCUMULATE (c +=; else c =), and hints that change no bit of
 * the result (a backend may ignore them; DF_GEMM_BWD_X ignores the first two): x is
 * the operand a of DF_GEMM_FWD, b of DF_GEMM_BWD_W, the one that several
 * projections of one input share (q, k and v of one x).
 *   DF_FP8_HOLD_X: keep x's rounding for the calls that follow;
 *   DF_FP8_SAME_X: x is the tensor of the last DF_FP8_HOLD_X call (same
 *     memory, same view), unchanged since, in a call of the same kind: its
 *     kept rounding may be used instead of rounding x again. A call whose x
 *     does not match what was kept rounds x (and keeps that).
 *   DF_FP8_MADE: an operand was written by an op that may have kept its
 *     codes for this call: dy (DF_GEMM_BWD_X / _BWD_W, df_op_swiglu_bwd_fp8;
 *     and this DF_FP8_DY_BLOCKS) or x (DF_GEMM_FWD / _BWD_W,
 *     df_op_swiglu_fp8), unchanged since (same memory, same view): those
 *     codes may be used instead of rounding it;
 * and one that changes the numerics:
 *   DF_FP8_DY_BLOCKS (DF_GEMM_BWD_W only, else -EINVAL): dy rounded in
 *     128 x 128 blocks instead of 128 x 1 (one scale per 128 rows x 128
 *     columns; on sm_90 cuBLASLt's 2D x 1D kernel, ~1.25x its 1D x 1D one).
 * Other bits: -EINVAL. */
#define DF_FP8_ACCUMULATE 1u
#define DF_FP8_HOLD_X 2u
#define DF_FP8_SAME_X 4u
#define DF_FP8_DY_BLOCKS 8u
#define DF_FP8_MADE 16u
int df_op_matmul_fp8(df_backend *be, df_gemm_kind kind, const df_tensor *a, const df_tensor *b,
                     df_tensor *c, unsigned flags);

/* df_op_swiglu (ops.h: the same arguments, checks and bits), with a hint
 * that changes no bit: out is about to be x of df_op_matmul_fp8 calls with
 * DF_FP8_MADE, of kind DF_GEMM_FWD (flags DF_FP8_X_FWD) and / or
 * DF_GEMM_BWD_W (DF_FP8_X_BWD_W; the down projection's x, its forward and,
 * recomputed, its weight gradient). A backend with E4M3 tensor cores may
 * write out's codes in those calls' layouts here and spare them their
 * rounding (the CUDA backend on sm_90, for a 2-D out; DFLASH_FP8_SWIGLU).
 * Other flags bits (but DF_FP8_ONLY_CODES, below), or none of the two: -EINVAL. */
#define DF_FP8_X_FWD 32u
#define DF_FP8_X_BWD_W 64u
/* With either op's hint, DF_FP8_ONLY_CODES: the caller reads the output(s) through nothing but
 * the hinted calls (no other op, no second call of a kind). Where the backend wrote the codes
 * of every hinted call, it may then leave the BF16 values unwritten (the CUDA backend does,
 * DFLASH_FP8_ONLY_CODES); a hinted call that cannot take those codes, or another FP8 GEMM
 * given the tensor while they wait, fails with -EIO instead of reading them. */
#define DF_FP8_ONLY_CODES 128u
int df_op_swiglu_fp8(df_backend *be, const df_tensor *gate, const df_tensor *up, df_tensor *out,
                     unsigned flags);

/* df_op_swiglu_bwd (the same arguments, checks and bits), with a hint that
 * changes no bit: dgate and dup are about to be dy of df_op_matmul_fp8
 * calls of kind DF_GEMM_BWD_X and DF_GEMM_BWD_W with DF_FP8_MADE, the
 * latter with flags' DF_FP8_DY_BLOCKS as they pass it. A backend with E4M3
 * tensor cores may write the two gradients' codes in those calls' layouts
 * here, where it computes them, and spare the calls their rounding (the
 * CUDA backend on sm_90 does so for 2-D dgate / dup under DF_FP8_DY_BLOCKS;
 * DF_CUDA_FP8_MADE: docs/FP8.md). DF_FP8_ONLY_CODES as for df_op_swiglu_fp8. Other flags
 * bits: -EINVAL. */
int df_op_swiglu_bwd_fp8(df_backend *be, const df_tensor *gate, const df_tensor *up,
                         const df_tensor *dout, df_tensor *dgate, df_tensor *dup, unsigned flags);
/* A hint that changes no bit: dy [R, C] (2-D) is about to be dy of one df_op_matmul_fp8 call of
 * kind DF_GEMM_BWD_X and one of kind DF_GEMM_BWD_W with flags' DF_FP8_DY_BLOCKS as they pass it,
 * both with DF_FP8_MADE (a projection's backward; either order), unchanged until then. A backend
 * with E4M3 tensor cores may round it here once for both instead of once in each (the CUDA
 * backend on sm_90 under DF_FP8_DY_BLOCKS, DFLASH_FP8_DY_CODES); others do nothing. Other flags
 * bits: -EINVAL. */
int df_op_fp8_dy_codes(df_backend *be, const df_tensor *dy, unsigned flags);
/* df_op_rmsnorm without plus_one (ops.h: the same checks and bits), with a hint that changes
 * no bit: y [R, D] (2-D) is about to be x of `uses` df_op_matmul_fp8 calls (>= 1: the
 * projections that share it) of kind DF_GEMM_FWD (flags DF_FP8_X_FWD) and / or as many of kind
 * DF_GEMM_BWD_W (DF_FP8_X_BWD_W: y recomputed for the weight gradients), each with DF_FP8_MADE.
 * A backend with E4M3 tensor cores may write y's codes in those calls' layouts here and spare
 * them their rounding (the CUDA backend on sm_90, DFLASH_FP8_RMSNORM). DF_FP8_ONLY_CODES as for
 * df_op_swiglu_fp8. Other flags bits, none of the two, or uses < 1: -EINVAL. */
int df_op_rmsnorm_fp8(df_backend *be, const df_tensor *x, const df_tensor *w, float eps, df_tensor *y,
                      int uses, unsigned flags);
/* The recipe above as block rows x block columns of the operand as passed: operand 0 (a: x of
 * DF_GEMM_FWD, dy of the backward kinds) or 1 (b: the weight, x of DF_GEMM_BWD_W); flags as
 * df_op_matmul_fp8's (DF_FP8_DY_BLOCKS counts). Every backend's rounding takes it from here. */
static inline void df_fp8_operand_blocks(df_gemm_kind kind, int operand, unsigned flags, int64_t *br,
                                         int64_t *bc)
{
    int bw = kind == DF_GEMM_BWD_W;
    *br = operand == 0 && !bw ? 1 : 128;
    *bc = operand == 0 ? (!bw || (flags & DF_FP8_DY_BLOCKS) ? 128 : 1) : (bw ? 1 : 128);
}

/* ---- FP8 (E4M3) rounding ----
 * y = x rounded to E4M3 in blocks of block_rows x block_cols elements (edge
 * blocks smaller), each with its power-of-two scale: the smallest 2^k >=
 * amax / 448 (k in [-100, 127]); y = code * 2^k exactly (common/e4m3.h's
 * df_fp8_qdq_f32 is the rule). x and y: 2-D, the same shape and dtype (F32
 * or BF16); y may be exactly x's view (in place) or overlap nothing. A block
 * holding NaN or +-Inf is copied as it is. Activations take 1 x 128 blocks
 * (along the GEMM's reduction), weights 128 x 128, an operand whose
 * reduction runs over rows 128 x 1. Deterministic: the same bits on every
 * backend. */
int df_op_fp8_qdq(df_backend *be, const df_tensor *x, df_tensor *y, int64_t block_rows,
                  int64_t block_cols);

#endif
