/* basis_internal.h - what the basis module's files share: the blocked
 * products (basis_gemm.c) used by the moment, projection, from_rows and
 * eval (basis.c), and the checks basis.c shares with the file format
 * (basis_file.c). Not part of the public API (formats/basis.h). */
#ifndef DF_BASIS_INTERNAL_H
#define DF_BASIS_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "basis.h"

static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

static inline void *alloc64(size_t bytes)
{
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* ---- the f32 register-tile kernel ----
 * c[r][j] (double, rows ldc apart) += the f32 sum over k < kc of
 * a[k][r] * b[k][j], r < MR, j < NR: a is packed [kc][MR], b [kc][NR]
 * (64-byte aligned rows of 16). f32 products and sums, one rounding to
 * double per call: callers keep kc <= 256. */
enum { MR = 6, NR = 16 };
typedef void (*kern_fn)(int64_t kc, const float *a, const float *b, double *c, int64_t ldc);

/* The f32 kernel for this CPU: AVX2+FMA when it has them, else portable C. */
kern_fn df_basis_pick_kern(void);

/* ---- the double kernel: c[MD rows, ldc][ND] += sum_k w[k][:] (x) b[k*ldb .. +ND] ---- */
enum { MD = 4, ND = 8 };
typedef void (*dkern_fn)(int64_t kc, const double *w, const double *b, int64_t ldb, double *c,
                         int64_t ldc);

/* ---- "mul": Y (n x D) = W (n x m) B (m x D) in double ----
 * W f32 or double, B f32 (ldb), Y f32 or double (ldy). The caller fills the
 * matrices and their sizes (one of w32/w64, one of y32/y64); ndb and kern
 * are set by df_basis_mul_run. */
typedef struct mul_job {
    int64_t n, m, D;
    const float *w32;
    const double *w64;
    int64_t ldw;
    const float *B;
    int64_t ldb;
    float *y32;
    double *y64;
    int64_t ldy, ndb;
    dkern_fn kern;
} mul_job;

/* Runs j split over pool. 0, or -ENOMEM naming `what` when a task could not
 * allocate its tiles. */
int df_basis_mul_run(mul_job *j, df_pool *pool, const char *what, df_err *e);

/* ---- "NT": C (n x m) = A (n x kd) B^T, A's rows through a callback, B packed ----
 * B panels: panel p (B's rows 16p .. 16p+15) at bp + p*bld*NR, its row k at
 * + (boff + k)*NR, lanes past B's last row zero. A task is MC rows x NC
 * columns of C; kd is walked in slices of KC; the finished double tile goes
 * to put(). */
enum { MC = 96, NC = 256, KC = 256 };
typedef void (*get_fn)(const void *ctx, int64_t row, int64_t k0, int64_t kc, float *dst);
typedef void (*put_fn)(void *ctx, int64_t i0, int64_t ni, int64_t j0, int64_t nj,
                       const double *acc /* [MC][NC] */);

typedef struct nt_job {
    int64_t n, m, kd;
    get_fn get;
    const void *gctx;
    const float *bp;
    int64_t bld, boff;
    put_fn put;
    void *pctx;
    kern_fn kern;
    int64_t njb;
} nt_job;

/* Runs j split over pool (njb and kern are set here). 0, or -ENOMEM naming
 * `what` when a task could not allocate its tiles. */
int df_basis_nt_run(nt_job *j, df_pool *pool, const char *what, df_err *e);

/* put_fn storing an NT job's tiles into a double matrix c (rows ld apart),
 * transposed (C^T) when trans is set. */
typedef struct df_basis_store_out {
    double *c;
    int64_t ld;
    int trans;
} df_basis_store_out;
void df_basis_store_put(void *ctx, int64_t i0, int64_t ni, int64_t j0, int64_t nj,
                        const double *acc);

typedef struct dmat_src { /* rows of a row-major double matrix, as f32 */
    const double *a;
    int64_t ld, off;
} dmat_src;

/* get_fn over a dmat_src. */
void df_basis_dmat_get(const void *ctx, int64_t row, int64_t k0, int64_t kc, float *dst);

typedef struct fmat_src { /* rows of a row-major f32 matrix */
    const float *a;
    int64_t ld, off;
} fmat_src;

/* get_fn over a fmat_src. */
void df_basis_fmat_get(const void *ctx, int64_t row, int64_t k0, int64_t kc, float *dst);

/* Fills dst (cdiv(m,16)*16*kd floats, 64-byte aligned) with the panels of
 * the rows of a matrix given by a getter (m x kd): [cdiv(m,16)][kd][16],
 * lanes past m zero. */
void df_basis_pack_panels(get_fn get, const void *gctx, int64_t m, int64_t kd, float *dst,
                          df_pool *pool);

/* Copies M's upper triangle (D x D, row-major) into its strictly lower one. */
void df_basis_mirror_upper(double *M, int64_t D);

/* ---- checks shared by basis.c, basis_extend.c and basis_file.c (which holds them) ---- */

/* 0, or -EINVAL naming `what` unless 1 <= K <= DF_BASIS_MAX_LAYERS, H >= 1
 * and K*H <= DF_BASIS_MAX_DIM. */
int df_basis_check_shape(int K, int H, const char *what, df_err *e);

/* df_basis_check_orthonormal (defined in basis_file.c) is public: basis.h,
 * "for backends". */

#endif
