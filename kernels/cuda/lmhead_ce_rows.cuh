/* lmhead_ce_rows.cuh - step 2 of the CUDA LM head + cross-entropy
 * (lmhead_ce.cu): per row of a chunk's fp32 logits z, the max, the argmax
 * (lowest index of the max), the sum of exp(z - max) in double, the CE and
 * w * CE; with dh, the softmax gradient G with the CPU's formulas
 * (kernels/cpu/lmhead_ce.c, ce_grad below), either in place as bf16 (hi
 * over the row's first half, lo to its own buffer in precise mode) or, for
 * FP8 on E4M3 tensor cores, as GEMM 2's operand: G rounded to bf16, then
 * per 1 x 128 block to E4M3 codes at the block's power-of-two scale (the
 * bits fp8_codes.cu's mode 0 writes from that bf16 G).
 *
 * Two variants, the same formulas; the sums and merges run in other orders,
 * so the two agree to the last bits of a double sum, not bitwise (each is
 * deterministic on its own):
 *   - block (lmhead_ce_rows_block.cu): one block per row, which reads the
 *     row twice (pass 1 the max and sum, pass 2 the gradient). Any GPU, any V.
 *   - cluster (lmhead_ce_rows_cluster.cu): one thread-block cluster per row,
 *     the row held in the cluster's registers between the passes: read from
 *     memory once. Compute capability 9.0 and later, V <= CE_CLUSTER_MAX_V.
 * lmhead_ce.cu takes the cluster variant where it launches
 * (DFLASH_CE_ROWS=block forces the other).
 *
 * Arguments (one struct for both): z [rows, ldz] fp32 (ldz a multiple of 8),
 * global row row0 + r for label / weight / argmax / ce / row_loss; with
 * codes, GEMM 2's operand: codes[r * kp + v] (zero past V up to kp = V
 * rounded up to 128), scales csc[(v / 128) * n_out + r], and rows nrows ..
 * n_out - 1 zero (its padding rows). */
#ifndef DF_LMHEAD_CE_ROWS_CUH
#define DF_LMHEAD_CE_ROWS_CUH

#include <cuda_runtime.h>
#include <stdint.h>

typedef struct ce_rows_args {
    float *z;
    int64_t ldz, V, row0;
    const int32_t *label;
    const float *weight; /* NULL: every weight 1 */
    double denom;
    int want_dh;
    uint16_t *lo; /* precise mode's low halves [rows, ldlo], or NULL */
    int64_t ldlo;
    int32_t *argmax; /* or NULL */
    float *ce;       /* or NULL */
    double *row_loss;
    int64_t nrows;   /* the chunk's rows */
    uint8_t *codes;  /* FP8 GEMM 2's operand, or NULL: G in place as bf16 */
    float *csc;
    int64_t kp, n_out;
} ce_rows_args;

/* The largest vocabulary the cluster variant takes (its registers hold a row). */
#define CE_CLUSTER_MAX_V ((int64_t)1 << 18)

/* Launch on st over n_out rows (codes) or nrows. ce_rows_block: 0 or a
 * negative errno-style code. ce_rows_cluster: 1 launched, 0 where it does
 * not apply (the device, V), negative on a launch error. */
int ce_rows_block(const ce_rows_args *a, cudaStream_t st);
int ce_rows_cluster(const ce_rows_args *a, cudaStream_t st);

/* A row is active (contributes loss and gradient) as on the CPU, plus the
 * device-only rule: a label >= V is ignored, never read. !(w > 0) also
 * ignores a NaN weight, as the CPU's `weight > 0` test does. */
static __device__ __forceinline__ int row_active(int32_t lab, float w, int64_t V)
{
    return lab >= 0 && (int64_t)lab < V && w > 0.0f;
}

/* Merges (max m, argmax i, sum s of exp(z - m)) with another such triple.
 * Commutative; on equal maxima the lower index wins (the CPU's first max). */
static __device__ __forceinline__ void merge(float &m, int &i, double &s, float m2, int i2, double s2)
{
    float M = fmaxf(m, m2);
    double a = s != 0.0 ? s * exp((double)m - (double)M) : 0.0;
    double b = s2 != 0.0 ? s2 * exp((double)m2 - (double)M) : 0.0;
    i = m2 > m ? i2 : (m > m2 ? i : min(i, i2));
    m = M;
    s = a + b;
}

/* A row's softmax gradient at logit v, as the CPU computes it: p = expf(z -
 * mx); G = p * (float)(c/s) (scf); the label's entry in double,
 * (float)(p * c/s - c). */
static __device__ __forceinline__ float ce_grad(float z, float mx, float scf, double sc,
                                                double c, bool is_label)
{
    float p = expf(z - mx);
    return is_label ? (float)((double)p * sc - c) : p * scf;
}

#endif
