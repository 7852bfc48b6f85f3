/* basis_gpu.h - the projection basis' heavy parts on a CUDA GPU: the second
 * moment of BF16 token rows, the eigensolve of a fit, an extension's
 * products, and the evaluation of a basis against a moment. The results are
 * the df_moment / df_basis of formats/basis.h, filled as its CPU functions
 * fill them (that header's "GPU backends" paragraph); the CPU functions stay
 * the reference, and tests/test_gpu_basis.c compares the two.
 *
 * Why: at the Qwen3.6-27B shape (K = 5 layers of H = 5120, D = 25600) the
 * CPU moment runs at ~230 tokens/s on 2 cores and dsyevr takes ~1.5 h; on
 * an H200 the moment is GEMM work and the eigensolve cuSOLVER's.
 *
 * Built by the CUDA build (kernels/cuda/basis_gpu.cu, library df_basis_gpu,
 * linked with cuBLAS and cuSOLVER); a build without CUDA gets
 * kernels/basis_gpu_stub.c: df_basis_gpu_device_count() is 0 and
 * df_basis_gpu_open() is -ENOTSUP, with a message saying so.
 *
 * Memory (device; at D = 25600): the moment's accumulator, 8 D^2 bytes
 * (5.24 GB), plus its f32 chunk product, 4 D^2 (2.62 GB), or with
 * DF_BASIS_GPU_MOMENT_F64 a double chunk, 8 D chunk_rows (0.2 GB); a fit:
 * 8 D^2 (the matrix, overwritten by its eigenvectors) + cuSOLVER's workspace
 * (queried; of the order of 8 D^2 more) + 4 D R (P); an extension or an
 * evaluation: 8 D^2 + 24 D R + 16 R^2 or so. Each step asks cudaMemGetInfo
 * first and fails with -ENOMEM naming the bytes it needs and the bytes free
 * on the device; nothing is kept on the device between calls except a
 * moment being accumulated (freed by df_basis_gpu_moment_sync).
 *
 * Threads: a df_basis_gpu is used by one thread at a time (its calls make
 * its device current). The df_pool arguments only split host-side work
 * (the input scan and the packing of rows).
 *
 * Errors: negative codes with a message in e, as basis.h: -EINVAL and
 * -DF_EMISMATCH with the CPU functions' messages (what = the GPU function's
 * name), -ENOMEM (device or pinned host memory: the message names the sizes),
 * -EDOM (cuSOLVER did not converge, or a result is not orthonormal), -EIO (a
 * CUDA, cuBLAS or cuSOLVER call failed: the message names the call and the
 * error), -EBUSY (a moment is being accumulated for another df_moment),
 * -ENOTSUP (no CUDA in this build), -ENODEV (no such device). */
#ifndef DF_CUDA_BASIS_GPU_H
#define DF_CUDA_BASIS_GPU_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "basis.h"

typedef struct df_basis_gpu df_basis_gpu;

/* Flags of df_basis_gpu_open. */
enum {
    /* The moment's products and sums in double (the rows converted to
     * double, cublasDsyrk into the accumulator): relative error ~1e-15 per
     * entry, at FP64 tensor-core speed (an H200's datasheet: ~67 TFLOP/s,
     * against ~990 for BF16). Without it: BF16 tensor-core GEMM (below). */
    DF_BASIS_GPU_MOMENT_F64 = 1
};

/* Usable CUDA devices: 0 without a GPU or a driver, and in a build without CUDA. */
int df_basis_gpu_device_count(void);

/* Opens device `device` (0-based) for basis work: a stream, a cuBLAS and a
 * cuSOLVER handle; flags: DF_BASIS_GPU_*. *out is NULL on failure. Returns
 * 0, -ENODEV (no such device), -ENOTSUP (no CUDA in this build), -ENOMEM or
 * -EIO. */
int df_basis_gpu_open(int device, int flags, df_basis_gpu **out, df_err *e);

/* Frees everything, a moment still being accumulated included (its rows
 * are lost: the df_moment keeps the rows it held before). g may be NULL. */
void df_basis_gpu_close(df_basis_gpu *g);

/* "NVIDIA H200 (device 0, 139.8 GiB)": for logs. */
const char *df_basis_gpu_name(const df_basis_gpu *g);

/* ---- second moment ----
 *
 * df_basis_gpu_moment_add_bf16 is df_moment_add_bf16 on the GPU: the same
 * arguments, checks and messages (K, H against m's: -DF_EMISMATCH; n_rows <
 * 0: -EINVAL; a NaN or infinity anywhere in the call's rows: -EINVAL naming
 * its row, layer and column, and then nothing of the call is added). n_rows
 * == 0 is a no-op. The rows are copied before it returns (the caller may
 * reuse its buffers at once), packed token-major into pinned host memory
 * and run on the device in chunks of chunk_rows (default 1024): a call may
 * leave up to a chunk staged, to run with the next call's rows or at the
 * sync. Calls of any size are fine (one token to millions).
 *
 * The accumulator lives on the device, so between the first add and
 * df_basis_gpu_moment_sync, m->n_rows counts every row added but m->m and
 * m->trace are those of before the first add. The sync waits for the
 * device, adds its moment into m->m's upper triangle and diagonal (m->m is
 * allocated, malloc-family as df_moment_free expects, when it was NULL;
 * zero-initialised, so a fresh moment is a plain copy), sets m->trace, and
 * frees the device moment. CPU adds (df_moment_add_bf16) and merges of m
 * are fine before the first GPU add and after the sync, not in between.
 *
 * A df_basis_gpu accumulates for one df_moment at a time: an add for
 * another one before the sync is -EBUSY. After a failed CUDA call (-EIO)
 * the device moment is lost: the sync reports it, sets m->n_rows back to
 * the rows m->m holds, and frees the device moment.
 *
 * Precision (default, BF16 path): per chunk, X^T X by cublasGemmEx (BF16
 * inputs, f32 output, CUBLAS_COMPUTE_32F: the products of BF16 values are
 * exact in f32; the sums are f32 in the tensor cores' order and rounding),
 * only the blocks on and above the diagonal; then a kernel adds the chunk's
 * upper triangle into the double accumulator. An entry's relative error is
 * bounded by about (chunk_rows / 16) * 2^-22 of sum_t |x_ti x_tj| (each
 * 16-product tensor-core step may lose up to 2 ulps of the f32 running sum:
 * 1.5e-5 at 1024 rows), and is ~1e-6 in practice (as the CPU path, whose
 * f32 sums run over 256 rows). DF_BASIS_GPU_MOMENT_F64: exact products,
 * double sums (~1e-15).
 *
 * Work: per chunk, about (D^2 + D * 4096) * chunk_rows tensor-core flops
 * (the upper block triangle, blocks of 4096 columns) and one pass over the
 * upper triangle of the accumulator (20 bytes per entry); on the host, the
 * scan and the packing, split over pool. */
int df_basis_gpu_moment_add_bf16(df_basis_gpu *g, df_moment *m, const uint16_t *const *layers,
                                 int K, int H, int64_t n_rows, df_pool *pool, df_err *e);

/* See above. A no-op returning 0 when g accumulates nothing for m. */
int df_basis_gpu_moment_sync(df_basis_gpu *g, df_moment *m, df_err *e);

/* Test and benchmark hook: rows per device chunk, in [1, 1024] (default
 * 1024); the next add uses it (staged rows run first). -EINVAL otherwise. */
int df_basis_gpu_set_chunk_rows(df_basis_gpu *g, int rows, df_err *e);

/* ---- fit, extension, evaluation ----
 * Each reads the moment from m->m (host: the upper triangle and diagonal),
 * makes a whole symmetric double copy on the device, and leaves m as it
 * was (the CPU functions use m's lower triangle as scratch; these do not).
 * m must not have GPU rows pending (-EINVAL: sync first). */

/* df_basis_fit on the GPU: the same arguments, rules, checks and result
 * (kind MOMENT, m's layer ids, n_rows and energies, eigenvalues descending,
 * P = the eigenvectors rounded to f32 with canonical signs, kept fractions
 * from the eigenpairs). Fixed R: cusolverDnXsyevdx, range 'I' (the top R).
 * The energy rule (R == 0): one cusolverDnXsyevd of the whole spectrum, with
 * vectors (not two solves, as the CPU: the tridiagonal reduction is the
 * cost); R from all eigenvalues (df_basis_rank_for_energy), P its top R
 * vectors. Eigenvalues agree with dsyevr's to ~1e-12 of the largest; the
 * vectors of well separated eigenvalues to f32 rounding (those of a cluster
 * span the same subspace, not the same vectors). */
int df_basis_gpu_fit(df_basis_gpu *g, const df_moment *m, int R, double energy, df_basis *out,
                     df_err *e);

/* df_basis_extend on the GPU: the same arguments, checks and result (kind
 * ROWS_EXT, q's rows and eigenvalues first and unchanged, then the top
 * R - R0 eigenvectors of M' = (I - Q^T Q) M (I - Q^T Q), made orthogonal to
 * q's rows explicitly; kept fractions from df_basis_gpu_eval against m).
 * In double on the device, as formats/basis_extend.c but with W kept in
 * double: C = Q M, G = C Q^T, W = C - G Q / 2 (DGEMM), M' = M - Q^T W -
 * W^T Q (one DSYR2K), its top R - R0 vectors by cusolverDnXsyevdx, two
 * passes of E -= (E Q^T) Q (DGEMM) with unit norms. Work: ~4 R0 D^2 +
 * 2 R D^2 FP64 flops (the last for the evaluation) plus the eigensolve. */
int df_basis_gpu_extend(df_basis_gpu *g, const df_basis *q, const df_moment *m, int R,
                        df_basis *out, df_err *e);

/* df_basis_eval on the GPU: *kept and (when layer_kept is not NULL)
 * layer_kept[0..K), the same definitions, checks and messages; products and
 * sums in double (DGEMM: C = P M, G = C P^T, per layer P_k P_k^T), so the
 * result is the CPU's to its ~1e-6. Work: 2 R D^2 + 4 R^2 D FP64 flops. */
int df_basis_gpu_eval(df_basis_gpu *g, const df_basis *b, const df_moment *m, double *kept,
                      double *layer_kept, df_err *e);

#ifdef __cplusplus
}
#endif
#endif
