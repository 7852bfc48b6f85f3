/* grad_test_util.h - what the CPU backward-op tests (test_train_ops.c,
 * test_lmhead_ce.c) share: NaN-poisoned f32 matrices with padding columns
 * that must stay poisoned, weight matrices in any dtype with their exact
 * values, and the finite-difference comparison with its per-op log. */
#ifndef DF_GRAD_TEST_UTIL_H
#define DF_GRAD_TEST_UTIL_H

#include "train_test_util.h"

static const uint32_t POISON = 0x7fc0dead;

static inline void poison(float *p, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        memcpy(&p[i], &POISON, 4);
}

static inline int is_poison(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u == POISON;
}

static inline int all_poison(const float *p, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!is_poison(p[i]))
            return 0;
    return 1;
}

/* An f32 matrix [rows, cols] stored with row stride ld >= cols. */
typedef struct mat {
    float *p;
    int64_t rows, cols, ld;
    df_tensor t;
} mat;

static inline mat mat_new(int64_t rows, int64_t cols, int64_t ld)
{
    mat m = {fbuf(rows * ld), rows, cols, ld, {0}};
    df_tensor full = df_tensor_2d(m.p, DF_DTYPE_F32, rows, ld);
    m.t = df_tensor_cols(&full, 0, cols);
    return m;
}

static inline mat mat_rand(int64_t rows, int64_t cols, int64_t ld, float scale)
{
    mat m = mat_new(rows, cols, ld);
    fill(m.p, rows * ld, scale);
    return m;
}

static inline float *mat_at(const mat *m, int64_t r, int64_t c)
{
    return &m->p[r * m->ld + c];
}

static inline int pad_intact(const mat *m)
{
    for (int64_t r = 0; r < m->rows; r++)
        for (int64_t c = m->cols; c < m->ld; c++)
            if (!is_poison(m->p[r * m->ld + c]))
                return 0;
    return 1;
}

/* out = poison everywhere, then in's values in the live columns. */
static inline void mat_set_from(mat *out, const mat *in)
{
    poison(out->p, out->rows * out->ld);
    for (int64_t r = 0; r < out->rows; r++)
        memcpy(mat_at(out, r, 0), mat_at(in, r, 0), (size_t)out->cols * sizeof(float));
}

/* A weight matrix in dtype t, with its exact values as doubles. */
typedef struct wmat {
    void *p;
    double *val; /* [rows * cols] */
    int64_t rows, cols, ld;
    df_tensor t;
} wmat;

static inline void wput(void *p, df_dtype t, int64_t i, float f, double *exact)
{
    size_t es = df_dtype_size(t);
    uint8_t *dst = (uint8_t *)p + i * (int64_t)es;
    if (t == DF_DTYPE_F32) {
        memcpy(dst, &f, 4);
    } else {
        uint16_t h = t == DF_DTYPE_BF16 ? df_f32_to_bf16(f) : df_f32_to_f16(f);
        memcpy(dst, &h, 2);
        f = t == DF_DTYPE_BF16 ? df_bf16_to_f32(h) : df_f16_to_f32(h);
    }
    if (exact)
        *exact = f;
}

static inline wmat wmat_new(df_dtype t, int64_t rows, int64_t cols, int64_t ld, float scale)
{
    wmat w = {NULL, dbuf(rows * cols), rows, cols, ld, {0}};
    w.p = xmalloc((size_t)(rows * ld) * df_dtype_size(t));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < ld; c++)
            wput(w.p, t, r * ld + c, test_randn(&rng) * scale,
                 c < cols ? &w.val[r * cols + c] : NULL);
    df_tensor full = df_tensor_2d(w.p, t, rows, ld);
    w.t = df_tensor_cols(&full, 0, cols);
    return w;
}

static inline wmat wvec_new(df_dtype t, int64_t n, float scale, float offset)
{
    wmat w = {NULL, dbuf(n), 1, n, n, {0}};
    w.p = xmalloc((size_t)n * df_dtype_size(t));
    for (int64_t i = 0; i < n; i++)
        wput(w.p, t, i, offset + test_randn(&rng) * scale, &w.val[i]);
    w.t = df_tensor_1d(w.p, t, n);
    return w;
}

static inline void wmat_free(wmat *w)
{
    free(w->p);
    free(w->val);
}

static const df_dtype DTS[3] = {DF_DTYPE_BF16, DF_DTYPE_F16, DF_DTYPE_F32};

/* Largest |analytic - numeric| / max|numeric| seen per op, for the log. */
static double fd_worst[8];
enum { FD_MM_X, FD_MM_W, FD_NORM_X, FD_NORM_W, FD_ROPE, FD_SWIGLU, FD_CE, FD_N };
static const char *fd_name[FD_N] = {"matmul dx", "matmul dw", "rmsnorm dx", "rmsnorm dw",
                                    "rope dx",   "swiglu",    "lmhead_ce dh"};

/* Compare an analytic gradient (f32) with numeric ones (double): each
 * element within tol_rel * max|numeric| (a global scale: a gradient element
 * that happens to be near 0 still has the rounding of the terms it sums). */
static inline void fd_compare(int which, const char *what, const float *an,
                              const double *num, int64_t n, double tol_rel)
{
    double mx = 0, worst = 0;
    for (int64_t i = 0; i < n; i++)
        if (fabs(num[i]) > mx)
            mx = fabs(num[i]);
    for (int64_t i = 0; i < n; i++) {
        double e = fabs(an[i] - num[i]) / (mx > 0 ? mx : 1);
        if (!(e <= worst))
            worst = e;
        expect_close(what, an[i], num[i], tol_rel * (mx > 0 ? mx : 1), i);
    }
    if (!(worst <= fd_worst[which]))
        fd_worst[which] = worst;
}

static const double FD_H = 1e-6;

/* ---- bf16 weight gradients ---- */

static const uint16_t BF_POISON = 0x7fc1; /* a NaN no op computes */

/* The bf16 nearest to d, ties to even (d finite, 0 or of bf16's normal
 * range): |d| in [2^(e-1), 2^e) scaled to [128, 256) is exact in double,
 * nearbyint rounds it to an integer (to nearest even in the default
 * rounding mode), the scale back is exact and so is the f32 of 8 bits. */
static inline uint16_t bf16_of_double(double d)
{
    if (d == 0)
        return signbit(d) ? 0x8000 : 0;
    int e;
    frexp(d, &e);
    float f = (float)ldexp(nearbyint(ldexp(d, 8 - e)), e - 8);
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

/* The spacing of bf16 numbers at |d| (d != 0): 2^(e-8) for |d| in
 * [2^(e-1), 2^e). */
static inline double bf16_ulp(double d)
{
    int e;
    frexp(d, &e);
    return d != 0 ? ldexp(1.0, e - 8) : 0;
}

/* How many bf16 numbers apart a and b are (finite, either sign). */
static inline int bf16_dist(uint16_t a, uint16_t b)
{
    int ia = (a & 0x8000) ? -(int)(a & 0x7fff) : (int)a;
    int ib = (b & 0x8000) ? -(int)(b & 0x7fff) : (int)b;
    return ia > ib ? ia - ib : ib - ia;
}

/* A BF16 weight-gradient element against ref, the exact (double) value of
 * what the op computes in fp32; tol bounds that fp32 computation's error
 * (the F32 tests' bound), so the op rounds once some f with |f - ref| <=
 * tol. Where tol < half a bf16 ulp of ref, RNE(f) is at most 1 bf16 ulp
 * from RNE(ref) (both within half an ulp of values less than half an ulp
 * apart; a binade edge between them costs nothing more): the fp32
 * summation order may flip one rounding, never more, so that is the rule.
 * Where the sum cancels so much that tol reaches half an ulp of ref, f can
 * be several bf16 steps of ref away before it is rounded: there, only
 * |got - ref| <= tol + half an ulp of got holds (the F32 bound plus the one
 * rounding); those elements are counted (n_cancel). NaN never passes. */
static int64_t n_cancel, n_bf16_checked;
static inline void expect_bf16_grad(const char *what, uint16_t got, double ref, double tol, int64_t idx)
{
    float g = bf_val(got);
    n_bf16_checked++;
    if (isfinite(g)) {
        if (tol < 0.5 * bf16_ulp(ref)) {
            if (bf16_dist(got, bf16_of_double(ref)) <= 1)
                return;
        } else {
            n_cancel++;
            if (fabs((double)g - ref) <= tol + 0.5 * bf16_ulp(g))
                return;
        }
    }
    if (n_miss++ < 12)
        fprintf(stderr, "%s: element %lld: got bf16 %04x (%.9g), want %.9g -> %04x (tol %.3g)\n",
                what, (long long)idx, got, g, ref, bf16_of_double(ref), tol);
    df_test_failures++;
}

/* A BF16 matrix [rows, cols] with row stride ld, poisoned outside vals (NULL: all poisoned). */
static inline uint16_t *bf_mat(int64_t rows, int64_t cols, int64_t ld, const uint16_t *vals)
{
    uint16_t *p = xmalloc((size_t)(rows * ld + 1) * 2);
    for (int64_t i = 0; i < rows * ld; i++)
        p[i] = BF_POISON;
    for (int64_t r = 0; vals && r < rows; r++)
        memcpy(p + r * ld, vals + r * cols, (size_t)cols * 2);
    return p;
}

#endif
