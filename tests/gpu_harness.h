/* gpu_harness.h - what the GPU tests share, so that each op test is its
 * cases: the two backends (or exit 77 without a GPU), bf16 conversions,
 * random data, buffers with a host and a device copy, strided views into
 * them, NaN poisoning, and comparisons against the fp32 CPU reference that
 * name the worst element and count failures through test.h.
 *
 * The usual shape of a case: draw inputs into gh_bufs (each value rounded
 * to bf16 in the device image, its f32 value in the host copy), poison the
 * outputs' device images, upload, run the op on gh_cpu with
 * gh_tens(..., 0) (F32, the host copies) and on gh_gpu with gh_tens(..., 1)
 * (BF16 or F32, the device copies), then gh_check_view: KERNELS.md's rule,
 * and nothing written outside the output view.
 *
 * Nothing here knows an op. Host allocations that fail exit(2) (test code:
 * nothing to recover). The CHECKs these functions run count as the
 * caller's. Builds without CUDA compile this too (tests/test_harness.c
 * runs it with a CPU backend standing in for the GPU). */
#ifndef DF_TEST_GPU_HARNESS_H
#define DF_TEST_GPU_HARNESS_H

#include <stddef.h>
#include <stdint.h>

#include "ops.h"
#include "test.h"

/* ---- backends ---- */

/* The device under test and the reference: set by gh_open (a test may set
 * them itself). The gh_buf functions allocate and copy on gh_gpu. */
extern df_backend *gh_gpu, *gh_cpu;

/* 77 after printing "no CUDA device: skipped" when no CUDA device is
 * visible (or the build has none), else 0. For tests that open what they
 * need themselves. */
int gh_skip_without_gpu(void);

/* Opens gh_gpu (the CUDA backend on device 0) and gh_cpu (the CPU backend,
 * cpu_threads threads, 0 = every online CPU). Returns 0, or the code main
 * returns: 77 (skip line printed) without a device (-ENODEV / -ENOTSUP
 * from the open), 1 when a backend fails otherwise (message on stderr,
 * nothing left open). */
int gh_open(int cpu_threads);
/* Closes both (either may be NULL) and clears them. */
void gh_close(void);

/* ---- bf16, host memory ---- */

/* f32 -> bf16 bits, round to nearest even; any NaN gives 0x7fc0. */
uint16_t gh_f2bf(float f);
float gh_bf2f(uint16_t h);
/* x rounded to bf16. */
float gh_rb(float x);
/* n zeroed bytes (at least 1); exit(2) when out of memory. */
void *gh_xmalloc(size_t n);

/* ---- random data (test.h's splitmix64 streams) ---- */

typedef enum gh_dist {
    GH_N01,    /* scale * test_randn(rng) */
    GH_N01_NZ, /* the same one draw, |x| raised to 0.05 first: never zero */
} gh_dist;

/* One value: exactly one test_randn draw from *rng. */
float gh_draw(gh_dist dist, uint64_t *rng, float scale);
/* n values gh_draw'n in order, each rounded to bf16 (gh_xmalloc'd, n + 1). */
float *gh_rand_bf16(gh_dist dist, uint64_t *rng, int64_t n, float scale);

/* ---- views: strided layouts inside a buffer, in elements ---- */

typedef struct gh_view {
    int64_t off;
    int ndim; /* 1..4 */
    int64_t shape[4], stride[4];
} gh_view;

gh_view gh_vnd(int64_t off, int ndim, const int64_t *shape, const int64_t *stride);
gh_view gh_v1(int64_t n);
/* Columns [col0, col0 + cols) of a [rows, ld] matrix. */
gh_view gh_v2(int64_t col0, int64_t rows, int64_t cols, int64_t ld);
/* [T, heads, D] per-head view of rows of ld elements, starting at off. */
gh_view gh_v3(int64_t off, int64_t T, int64_t heads, int64_t D, int64_t ld);
/* Elements a buffer needs to hold v (its last element + 1). */
int64_t gh_view_len(gh_view v);
/* Elements in v (the product of its shape). */
int64_t gh_view_count(gh_view v);
/* v's element offsets in row-major order (gh_xmalloc'd; *n their count). */
int64_t *gh_view_offsets(gh_view v, int64_t *n);

/* ---- buffers: a host f32 copy (the CPU's side), a device copy (the GPU's) ---- */

typedef struct gh_buf {
    int64_t n; /* elements */
    int f32;   /* the device copy is F32, else BF16 */
    float *h;  /* host copy: the values (bf16-exact for a BF16 buffer) */
    void *img; /* host image of the device copy: what gh_buf_upload sends */
    void *d;   /* device copy on gh_gpu: n elements and `slack` bytes more */
} gh_buf;

/* Element size of the device copy: 4 or 2. */
size_t gh_esz(const gh_buf *b);
/* n zero elements; the device allocation has slack bytes past them (room
 * for a kernel's vector over-read, never compared). exit(2) if gh_gpu
 * cannot allocate. */
gh_buf gh_buf_new(int64_t n, int f32, size_t slack);
/* n elements gh_draw'n from *rng in order (no slack). */
gh_buf gh_buf_rand(int64_t n, int f32, gh_dist dist, uint64_t *rng, float scale);
/* A BF16 buffer holding v: gh_buf_rand(gh_view_len(v), ...) from *rng, then
 * v's elements (row-major) drawn again from their own stream seeded by
 * seed, so two layouts of one seed hold the same logical tensor. */
gh_buf gh_buf_rand_view(gh_view v, gh_dist dist, uint64_t *rng, uint64_t seed, float scale);
/* Element i: host copy v (rounded to bf16 for a BF16 buffer), image its bits. */
void gh_buf_set(gh_buf *b, int64_t i, float v);
/* The image to the device (a CHECK). */
void gh_buf_upload(const gh_buf *b);
/* The device copy's n elements, raw (gh_xmalloc'd; the download a CHECK). */
void *gh_buf_download(const gh_buf *b);
/* Frees all three and zeroes *b. */
void gh_buf_free(gh_buf *b);
/* v of b: on_gpu 0 the host copy as F32; 1 the device copy (BF16 / F32). */
df_tensor gh_tens(const gh_buf *b, gh_view v, int on_gpu);
/* NaN into the image of v (bf16 0x7fc0, f32 0x7fc00000); the host copy
 * keeps its values (the reference computes into them). */
void gh_poison(gh_buf *b, gh_view v);

/* ---- flat device arrays (tests that keep their own host data) ---- */

/* Poison of an I32 output. */
#define GH_POISON_I32 (-7777)

/* A BF16 device copy of n floats on be (n * 2 + 2 bytes). The allocation
 * and upload are a CHECK; NULL when either failed. */
void *gh_dev_bf16(df_backend *be, const float *x, int64_t n);
/* A device copy of bytes bytes (bytes + 4 allocated); a CHECK; NULL on failure. */
void *gh_dev_copy(df_backend *be, const void *x, size_t bytes);
/* n elements of type t (BF16: 0x7fc0, F32: NaN, I32: GH_POISON_I32) into
 * device memory d; the upload a CHECK. */
void gh_dev_poison(df_backend *be, void *d, int64_t n, df_dtype t);
/* A new device array of n poisoned elements of type t (n * size bytes);
 * allocation and upload one CHECK. */
void *gh_dev_poisoned(df_backend *be, int64_t n, df_dtype t);
/* n BF16 device elements downloaded, as floats (gh_xmalloc'd; a CHECK). */
float *gh_download_bf16(df_backend *be, const void *d, int64_t n);

/* ---- comparisons ---- */

/* What a comparison of got against ref found. Pairs with a NaN go to nan,
 * pairs with an infinity to bad (unless both are the same infinity and the
 * options allow it), structural zeros that are not exactly 0 in both to
 * bad; err is over the other (finite) pairs. ref_max and naive, the
 * bound's terms, are the reference's alone: over every finite ref. Any
 * NaN or bad pair fails, so which pairs the terms cover cannot change a
 * verdict. */
typedef struct gh_diff {
    double err;      /* max |got - ref| */
    double ref_max;  /* max |ref| */
    double naive;    /* max |round_bf16(ref) - ref|: naive bf16 math's error */
    int64_t n;       /* elements compared */
    int64_t nan, bad;
    int64_t worst;   /* the index of err (gh_view_diff: the buffer offset), -1: none */
    float worst_got, worst_ref;
} gh_diff;

typedef struct gh_cmp_opts {
    const uint8_t *zero_rows; /* per row of cols elements, 1 = must be exactly 0 in both */
    int64_t cols;
    int inf_equal; /* an infinity equal in both passes (lse of an empty row) */
} gh_cmp_opts;

/* got vs ref, n elements; opts NULL: no structural zeros, infinities bad. */
void gh_diff_f32(gh_diff *d, const float *got, const float *ref, int64_t n,
                 const gh_cmp_opts *opts);
/* Downloads b and compares view v of the download with the host copy
 * (b->h at the same offsets); *touched (if not NULL) counts the elements
 * outside v and outside `also` (another view the op wrote, or NULL) whose
 * bits differ from the image. Returns the download's code (a CHECK). */
int gh_view_diff(const gh_buf *b, gh_view v, const gh_view *also, const gh_cmp_opts *opts,
                 gh_diff *d, int64_t *touched);
/* KERNELS.md's bound: 2 max|round_bf16(ref) - ref| + 1e-6 max|ref|. */
double gh_naive_bound(const gh_diff *d);
/* No NaN, nothing bad, err <= tol. */
int gh_diff_ok(const gh_diff *d, double tol);
/* Prints d's worst element (index, got, want, tol) and its counts to stderr. */
void gh_diff_report(const char *name, const gh_diff *d, double tol);
/* gh_diff_ok, else gh_diff_report and one failure counted. Returns ok. */
int gh_expect(const char *name, const gh_diff *d, double tol);
/* KERNELS.md's rule for output view v of b, after the op ran on both
 * backends (the CPU's result in b->h): no non-finite value, nothing
 * outside v and `also` written, max|gpu - ref| <= gh_naive_bound. Prints
 * one line (err, naive, bound); a failure is counted, with the worst
 * element. Returns ok. */
int gh_check_view(const char *name, const gh_buf *b, gh_view v, const gh_view *also);

/* Two bf16 values, each one rounding of an fp32 value, the fp32 values
 * within tol of each other: where tol is under half a bf16 ulp of b they
 * are at most 1 ulp apart, else (*cancel counted) |a - b| <= tol + half an
 * ulp of each. Non-finite: not close. */
int gh_bf16_close(uint16_t a, uint16_t b, double tol, int64_t *cancel);

/* sqrt(sum (a - b)^2); b NULL: ||a||. */
double gh_l2(const float *a, const float *b, int64_t n);

/* ---- timing (the tests' --bench modes) ---- */

double gh_now_ms(void);
/* Sorts x and returns x[n / 2]. */
float gh_median_f(float *x, int n);
double gh_median(double *x, int n);

#endif
