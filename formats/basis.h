/* basis.h - projected features with an exact export (issue 27, item 2).
 *
 * The drafter reads the target's K feature layers (each of hidden size H,
 * concatenated per token into x of D = K*H) only through fc, a bias-free
 * linear map H x D. A basis P (R x D, orthonormal rows) lets the cache store
 * z = P x (R values per token) instead of x; the trainer trains fc_r (H x R)
 * on z, and the export writes fc = fc_r P (H x D), which on raw features is
 * exactly what was trained: fc x = fc_r (P x).
 *
 * This module has four parts:
 *  - df_moment: the uncentred second moment M = sum_t x_t x_t^T over a
 *    sample of tokens, accumulated in double on the CPU (blocked, pthreads);
 *  - the fit: P = the top-R eigenvectors of M (LAPACK dsyevr), R fixed or
 *    the smallest rank keeping a given energy fraction; or P = an
 *    orthonormal basis of a matrix's row space (df_basis_from_rows, e.g. of
 *    an fc trained on lossless data), optionally extended by the top
 *    eigenvectors of the energy outside it (df_basis_extend);
 *  - apply: z = P x (df_basis_project_*), fc = fc_r P (df_basis_merge), fc_r = fc P^T
 *    (df_basis_project_rows_f32),
 *    x_hat = P^T z (df_basis_unproject), and df_basis_eval (what fraction of
 *    a moment's energy any basis keeps, overall and per layer);
 *  - the file basis.dfb (docs/FORMAT-basis.md): df_basis_write/read.
 *
 * Energy conventions. The total energy of a moment is trace(M) = sum_t
 * ||x_t||^2; a layer's energy is the trace of its H x H diagonal block. The
 * kept fraction of a basis is sum_t ||P x_t||^2 / trace(M). The kept
 * fraction of layer k is the share of that layer's energy the reconstruction
 * x_hat = P^T P x explains: 1 - sum_t ||x_t,k - x_hat_t,k||^2 / sum_t
 * ||x_t,k||^2. For a basis of M's eigenvectors (every fit) this equals
 * sum_t ||x_hat_t,k||^2 / sum_t ||x_t,k||^2 = sum_r lambda_r ||P_r,k||^2 /
 * trace(M_kk), computed from the eigenpairs without data; the layer
 * fractions weighted by layer energy sum to the overall kept fraction.
 *
 * GPU backends: df_moment and df_basis are plain structs with documented
 * fields, so a backend (cuBLAS syrk, cuSOLVER syevd) can fill M, or the
 * eigenpairs, itself and use df_basis_init / df_basis_canonicalize /
 * df_basis_stats_from_eigen and the checks under "for backends" (the end of
 * this file) for the rest. The CUDA one is kernels/cuda/basis_gpu.h.
 *
 * Threads: functions taking a df_pool split their work over it (NULL: the
 * calling thread only). None may run concurrently on the same df_moment;
 * df_basis functions taking a const df_basis may run concurrently with each
 * other (not with df_basis_free on the same basis).
 *
 * Errors: negative codes with a message in e (err.h): -EINVAL (bad
 * arguments; the message names the argument and its range), -ENOMEM (the
 * message names the allocation and its size), -DF_EMISMATCH (a basis and a
 * moment or data of different shapes), -EDOM (LAPACK failed to converge, or a
 * result is not orthonormal), -DF_ECORRUPT / -DF_EVERSION (a bad file: the
 * message names the file and the byte offset), or the errno of a failed
 * open/read/write.
 */
#ifndef DF_BASIS_H
#define DF_BASIS_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"
#include "pool.h"
#include "sha256.h"

#define DF_BASIS_MAX_DIM 32768  /* largest D = K*H (the 27B shape is 5 x 5120 = 25600) */
#define DF_BASIS_MAX_LAYERS 64  /* largest K (as the cache, DF_CACHE_MAX_LAYERS) */

/* ---- second moment ---- */

/* M = sum_t x_t x_t^T over the rows added so far.
 *
 * Storage: m is D x D doubles, row-major, allocated (zeroed) on the first
 * add: 8 D^2 bytes, e.g. 4.7 MB at D = 768, 210 MB at D = 5120, 5.24 GB at
 * the 27B shape D = 25600, 8.6 GB at DF_BASIS_MAX_DIM. Only the upper
 * triangle and diagonal (m[i*D + j], i <= j) hold the moment; the strictly
 * lower triangle is unspecified and is used as scratch by df_basis_fit and
 * df_basis_eval (which leave the upper triangle and diagonal as they were).
 *
 * Precision: products are f32 (exact for BF16 inputs, whose products fit
 * f32's mantissa), summed in f32 over slices of at most 256 rows, each
 * slice's sums then added in double (into M once per 1024 rows): the
 * relative error of an entry is about 1e-6 of sum_t |x_ti x_tj|.
 *
 * A GPU backend may fill m itself (malloc-family memory, as df_moment_free
 * frees it; the upper triangle at least), then set n_rows and trace (= the
 * sum of m's diagonal) to what it accumulated. */
typedef struct df_moment {
    int K, H, D;                               /* layers, hidden size, D = K*H */
    int32_t layer_ids[DF_BASIS_MAX_LAYERS];    /* target layer ids, copied into fitted bases */
    int64_t n_rows;                            /* tokens accumulated */
    double trace;                              /* sum_t ||x_t||^2 = sum of m's diagonal */
    double *m;                                 /* D x D (see above); NULL before the first add */
    float *scratch_;                           /* private: packing scratch of the adds */
} df_moment;

/* Sets up an empty moment for K layers of H (1 <= K <= DF_BASIS_MAX_LAYERS,
 * K*H <= DF_BASIS_MAX_DIM). layer_ids: K target layer ids, or NULL for
 * 0..K-1. Allocates nothing (M is allocated by the first add). Returns 0 or
 * -EINVAL. */
int df_moment_init(df_moment *m, int K, int H, const int32_t *layer_ids, df_err *e);

/* Frees M; m is left zeroed. m may be zeroed memory or already freed. */
void df_moment_free(df_moment *m);

/* Adds n_rows tokens: layers[k] points to layer k's rows, [n_rows x H]
 * row-major (BF16 bits, or f32); K and H must equal m's (-DF_EMISMATCH).
 * n_rows == 0 is a no-op. The input is scanned first: a NaN or infinity is
 * refused with -EINVAL naming the row, layer and column, and then nothing is
 * added. -ENOMEM when M (8 D^2 bytes) or the packing scratch (kept in m
 * until df_moment_free: about 8 KiB * D, 210 MB at D = 25600) cannot be
 * allocated; M is then left as it was. Work: D^2 flops per row (the upper
 * triangle), split over pool, plus one pass over M (reading and writing its
 * upper triangle) per 1024 rows or part of it: at large D add >= 1024 rows
 * per call (at D = 25600 a 64-row call costs ~1.4 s here, a 1024-row one
 * ~4.5 s). The first add allocates M (2 MiB aligned, advised to huge pages). */
int df_moment_add_bf16(df_moment *m, const uint16_t *const *layers, int K, int H,
                       int64_t n_rows, df_pool *pool, df_err *e);
int df_moment_add_f32(df_moment *m, const float *const *layers, int K, int H,
                      int64_t n_rows, df_pool *pool, df_err *e);

/* dst += src (moments of other ranks, threads or files). Same K, H and layer
 * ids, else -DF_EMISMATCH. src may be empty (no-op); -ENOMEM as above. */
int df_moment_merge(df_moment *dst, const df_moment *src, df_err *e);

/* ---- basis ---- */

enum {
    DF_BASIS_KIND_MOMENT = 1, /* top eigenvectors of a second moment (df_basis_fit) */
    DF_BASIS_KIND_ROWS = 2,   /* a matrix's row space (df_basis_from_rows) */
    DF_BASIS_KIND_ROWS_EXT = 3 /* rows_part rows of a basis kept whole, then the top
                                * eigenvectors of the moment outside them (df_basis_extend) */
};

typedef struct df_basis {
    int D, R, K, H;                             /* P is R x D; D = K*H */
    int kind;                                   /* DF_BASIS_KIND_* */
    int rows_part;                              /* kind 3: the rows kept whole (first); else 0 */
    int32_t layer_ids[DF_BASIS_MAX_LAYERS];     /* K target layer ids */
    int64_t n_rows;                             /* tokens (or matrix rows) fitted on */
    double total_energy;                        /* trace of the fitted moment */
    double layer_energy[DF_BASIS_MAX_LAYERS];   /* its K diagonal blocks' traces */
    double kept;                                /* kept energy fraction (header comment) */
    double layer_kept[DF_BASIS_MAX_LAYERS];     /* per layer (header comment) */
    double *eigval;                             /* R eigenvalues, descending (kind 3: within
                                                 * each part) */
    float *P;                                   /* R x D row-major, orthonormal rows */
} df_basis;

/* Allocates b's arrays for a basis of R rows over K layers of H and sets the
 * shape fields; everything else is zero. For backends that fill P and
 * eigval themselves. Returns 0, -EINVAL (R outside [1, D], K or D out of
 * range) or -ENOMEM. */
int df_basis_init(df_basis *b, int K, int H, int R, const int32_t *layer_ids, df_err *e);

/* Frees the arrays; b is left zeroed. b may be zeroed memory. */
void df_basis_free(df_basis *b);

/* Fixes each row's sign so that its largest-magnitude component (the first
 * one, on a tie) is positive: eigenvectors are defined up to sign, this makes
 * fits reproducible. (Vectors of a repeated eigenvalue are not unique beyond
 * sign; they are what LAPACK returns, the same for the same input.) */
void df_basis_canonicalize(df_basis *b);

/* Sets kept and layer_kept from eigval, P, total_energy and layer_energy,
 * for a basis whose rows are eigenvectors of the moment (the header
 * comment's formula; a layer with no energy keeps 1 by convention). */
void df_basis_stats_from_eigen(df_basis *b);

/* Fits P to the top eigenvectors of m. Either R in [1, D] with energy == 0,
 * or R == 0 with energy in (0, 1]: then R is the smallest rank whose kept
 * fraction reaches energy (less 1e-10 for rounding, so energy = 1 gives the
 * numerical rank). Anything else is -EINVAL naming the ranges; an empty
 * moment or one with no energy is -EINVAL. *out (overwritten; free with
 * df_basis_free) gets kind MOMENT, m's layer ids, n_rows and energies, the R
 * eigenvalues (descending), P (canonical signs) and the kept fractions.
 *
 * Uses LAPACK dsyevr on m->m in place: the upper triangle is mirrored into
 * the strictly lower one, which dsyevr works on (the diagonal is saved and
 * restored), so the only large allocation is the eigenvectors, 8 D R bytes.
 * The energy rule runs dsyevr twice (all eigenvalues first, then the top R
 * vectors): about twice the time of a fixed R. Cost: the tridiagonal
 * reduction, 4/3 D^3 flops, in LAPACK's own threads (reference LAPACK: one). */
int df_basis_fit(const df_moment *m, int R, double energy, df_basis *out, df_err *e);

/* Fits P to an orthonormal basis of the row space of A (rows x D, D = K*H,
 * row-major f32, finite), ordered by singular value: P's rows are A's top
 * right singular vectors, eigval their squared singular values. R and energy
 * as in df_basis_fit, over A's energy ||A||_F^2; R is capped by A's
 * numerical rank (singular values above 1e-3 of the largest: this bounds the
 * rows' loss of orthogonality to about 1e-8), a larger fixed R is -EINVAL
 * naming the rank. n_rows = rows; energies and kept fractions are those of
 * A's rows taken as samples; kind ROWS. Method: rows <= D: the Gram matrix
 * A A^T in double (exact f32 products), dsyevr, P = S^-1/2 U^T A; rows > D:
 * df_moment of A's rows + df_basis_fit. layer_ids: K ids or NULL (0..K-1). */
int df_basis_from_rows(const float *A, int rows, int K, int H, const int32_t *layer_ids,
                       int R, double energy, df_pool *pool, df_basis *out, df_err *e);

/* Extends q (R0 rows, kept whole and first) to R > R0 rows with the top
 * R - R0 eigenvectors of the moment of the tokens' components outside
 * span(q): M' = (I - q^T q) M (I - q^T q), computed from m without a pass
 * over tokens (formats/basis_extend.c), fitted as df_basis_fit, and made
 * orthogonal to q's rows explicitly. *out (overwritten; free with
 * df_basis_free): kind ROWS_EXT, rows_part R0, q's eigenvalues then M''s,
 * n_rows and energies of m, kept fractions from df_basis_eval against m.
 * Shapes and layer ids must match (-DF_EMISMATCH); R in [R0 + 1, D] else
 * -EINVAL. Uses m's lower triangle as scratch (as df_basis_eval). Memory:
 * 8 D^2 (M') + 8 R0 D (Q M) + 8 (R - R0) D bytes plus df_basis_fit's; work:
 * about 4 R0 D^2 flops over pool plus the eigensolve of M'. */
int df_basis_extend(const df_basis *q, const df_moment *m, int R, df_pool *pool, df_basis *out,
                    df_err *e);

/* What b keeps of the moment m's energy: *kept (overall) and, when
 * layer_kept is not NULL, layer_kept[0..K) (the header comment's
 * definitions, evaluated for any orthonormal P, not only eigenvectors).
 * Shapes must match (-DF_EMISMATCH); m must hold rows with energy (-EINVAL).
 * Work: 2 R D^2 + 4 R^2 D flops in f32 products summed in double per 256
 * terms (relative error about 1e-6), plus 8 R D bytes; uses m's lower
 * triangle as scratch like df_basis_fit. */
int df_basis_eval(const df_basis *b, const df_moment *m, double *kept, double *layer_kept,
                  df_pool *pool, df_err *e);

/* ---- apply ---- */

/* z = P x for n_rows tokens: layers[k] is layer k's [n_rows x H] rows (BF16
 * bits or f32), z is n_rows x R row-major, BF16 rounded to nearest even from
 * the double sums (no double rounding), or f32. Products f32, summed in f32
 * per 256 terms and in double across them. K, H must be b's
 * (-DF_EMISMATCH). Non-finite inputs give non-finite outputs (not checked).
 * Work: 2 R D flops per token over pool, plus one pass over P per call
 * (calls of a few tokens are bound by reading P: 4 R D bytes); scratch
 * 4 D * min(n_rows, 512) bytes. 0, -DF_EMISMATCH or -ENOMEM. */
int df_basis_project_bf16(const df_basis *b, const uint16_t *const *layers, int K, int H,
                          int64_t n_rows, uint16_t *z, df_pool *pool, df_err *e);
int df_basis_project_f32(const df_basis *b, const float *const *layers, int K, int H,
                         int64_t n_rows, float *z, df_pool *pool, df_err *e);

/* The same for rows that hold the K layers side by side: x is n_rows x D
 * row-major (a token's features, or a row of an fc), z = x P^T is n_rows x R
 * f32. Restricting a raw drafter's fc to the basis, fc_r = fc P^T, is this
 * with fc's H rows: for features in P's span fc_r (P x) = fc x exactly, and
 * fc_r P is the map nearest fc (least squares, Frobenius) among those that
 * read only z. 0, -EINVAL or -ENOMEM. */
int df_basis_project_rows_f32(const df_basis *b, const float *x, int64_t n_rows, float *z,
                              df_pool *pool, df_err *e);

/* fc = fc_r P: fc_r is rows x R, fc is rows x D (both row-major f32);
 * products and sums in double, rounded to f32 once. The export's map: on a
 * raw feature vector x, fc x equals fc_r (P x) up to float rounding.
 * Work: 2 rows R D flops over pool; 0, -EINVAL or -ENOMEM. */
int df_basis_merge(const df_basis *b, const float *fc_r, int rows, float *fc,
                   df_pool *pool, df_err *e);

/* x_hat = P^T z for n_rows tokens: z is n_rows x R, x_hat n_rows x D (the K
 * layers concatenated per token), f32, double sums. For tests and
 * diagnostics. 0, -EINVAL or -ENOMEM. */
int df_basis_unproject(const df_basis *b, const float *z, int64_t n_rows, float *x_hat,
                       df_pool *pool, df_err *e);

/* ---- for backends: the CPU path's checks and rules, shared so that a
 * backend refuses, and chooses, exactly as it does (defined in basis.c
 * unless said) ---- */

/* The input scan of df_moment_add_bf16: -EINVAL "<what>: row t, layer k,
 * column i is not finite" for the first NaN or infinity of the n_rows token
 * rows (layers[k]: [n_rows x H] BF16 bits), else 0. Split over pool. */
int df_moment_check_finite_bf16(const uint16_t *const *layers, int K, int H, int64_t n_rows,
                                df_pool *pool, const char *what, df_err *e);

/* The argument checks of df_moment_add_bf16 / _f32 (m initialised, K and H
 * m's, n_rows >= 0 with layers when > 0): 0, or the error naming what. */
int df_moment_check_add(const df_moment *m, int K, int H, int64_t n_rows, const void *layers,
                        const char *what, df_err *e);

/* The argument checks of df_basis_extend (q and m of the same layers and
 * shape, m holding rows, q->R < R <= D): 0, or the error naming what. In
 * basis_extend.c. */
int df_basis_check_extend(const df_basis *q, const df_moment *m, int R, const char *what,
                          df_err *e);

/* df_basis_fit's rule for its R and energy arguments: 0, or -EINVAL naming
 * what and the ranges. */
int df_basis_check_rank_rule(int R, double energy, int D, const char *what, df_err *e);

/* The energy rule: the smallest r whose top r eigenvalues (lam_desc, n of
 * them, descending) sum to at least (energy - 1e-10) * total; n when none. */
int df_basis_rank_for_energy(const double *lam_desc, int n, double total, double energy);

/* code with a message naming name when P (R x D, row-major; at file offset
 * p_off in messages) is not finite with orthonormal rows: the content check
 * of df_basis_parse (its 1e-4 and 1e-3 tolerances). 4 R D flops. */
int df_basis_check_orthonormal(const float *P, int64_t R, int64_t D, const char *name,
                               uint64_t p_off, int code, df_err *e);

/* ---- file: basis.dfb (docs/FORMAT-basis.md) ---- */

#define DF_BASIS_MAGIC "DFBASIS\0"
#define DF_BASIS_VERSION 1
#define DF_BASIS_HEADER_BYTES 64u

/* Exact size in bytes of the file of a basis with these dimensions. */
uint64_t df_basis_file_bytes(int K, int R, int D);

/* The file image of b in a malloc'd buffer (*buf, *len). The basis must be
 * valid (shape in range, finite, orthonormal rows, as df_basis_parse checks),
 * else -EINVAL; -ENOMEM. */
int df_basis_serialize(const df_basis *b, uint8_t **buf, size_t *len, df_err *e);

/* Writes b to path atomically (path.tmp, fsync, rename, fsync of the
 * directory). Errors as df_basis_serialize, or the errno of the write. */
int df_basis_write(const df_basis *b, const char *path, df_err *e);

/* Parses a file image (name is used in messages). Every size is checked
 * against len before use, the CRC over everything but the last 4 bytes is
 * verified, and the content is checked: dimensions in range, layer ids >= 0
 * and distinct, energies and eigenvalues finite, eigenvalues non-increasing,
 * P finite with every row's squared norm within 1e-4 of 1 and P P^T u = u
 * within 1e-3 |u| for two fixed pseudo-random +-1 vectors u (4 R D flops; a
 * P whose rows are further than that from orthonormal fails it with
 * overwhelming probability; the full P P^T would be R^2 D). On failure
 * -DF_ECORRUPT (or -DF_EVERSION) naming name and the byte offset, and *out
 * is left empty. On success *out owns copies of the arrays. */
int df_basis_parse(const uint8_t *buf, size_t len, const char *name, df_basis *out, df_err *e);

/* Reads and parses path (the header is checked against the file size before
 * the rest is read, so a lying header cannot make it allocate). */
int df_basis_read(const char *path, df_basis *out, df_err *e);

/* SHA-256 of the file at path, lower-case hex (for the cache manifest). */
int df_basis_sha256(const char *path, char hex[DF_SHA256_HEX], df_err *e);

#endif
