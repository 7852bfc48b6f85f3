/* test_gpu_train_dense - the CUDA dense training ops (kernels/cuda/
 * train_dense.cu: RMSNorm / RoPE / SwiGLU backward, AdamW, sum of squares)
 * against the CPU reference. The dispatch table does not point at them yet,
 * so the GPU side calls df_cuda_* directly (cuda/train_cuda.h) on BF16 / F32
 * device tensors, with arguments the dispatch would accept; the CPU side
 * runs df_op_* on the CPU backend with F32 copies of the same bf16-rounded
 * values. Skips (77) without a GPU.
 *
 * Inputs are random, never zero (|x| >= 0.05), rounded to bf16; GPU outputs
 * that are not also inputs are NaN-poisoned first (bf16 0x7fc0); every
 * element outside an output view must come back bit for bit as uploaded.
 * Tolerances:
 *  - bf16 outputs (dx, dgate, dup, RoPE's dx), KERNELS.md's rule:
 *      max|gpu - ref| <= 2 max|round_bf16(ref) - ref| + 1e-6 max|ref|.
 *  - RMSNorm's dw (F32, accumulated): both sides sum the same products in
 *    fp32, in different orders (and the GPU's 1/rms may differ by a few
 *    ulps), so elementwise |gpu - ref| <= 1e-5 (|dw0| + sum_rows |dy xhat|).
 *  - AdamW (F32): the same operations in the same order, FMA forbidden on
 *    the GPU, so the bits should match; allowed: 1e-6 times the sum of the
 *    magnitudes of the terms of each update (printed: how many match
 *    exactly). out_bf16 must be exactly RNE(GPU master).
 *  - sumsq (double): squares of floats are exact in double, only the n - 1
 *    additions round in some order: |gpu - ref| <= 2 n 2^-53 ref; exact for
 *    n <= 1.
 * BF16 weight gradients (the trainer may keep its gradient array in bf16):
 *  - RMSNorm with a BF16 dw: the GPU run with an F32 dw holding the same
 *    (widened) old values computes the same partials in the same order, so
 *    dx must match it bit for bit and each bf16 dw element must be exactly
 *    RNE of the f32 one. Against the CPU's BF16 dw: each side rounds its
 *    fp32 value once; where the F32 rule's bound (1e-5 sum|terms|) is below
 *    half a bf16 ulp they are at most 1 bf16 ulp apart (the summation order
 *    can flip one rounding), elsewhere (sums that cancel) within that bound
 *    plus half an ulp of each.
 *  - AdamW and sumsq with BF16 gradients: bit for bit what the GPU gives
 *    for F32 gradients of the same values (a bf16 widens exactly; the
 *    arithmetic and the order are the same), for the vector and the scalar
 *    paths; against the CPU (run with the same BF16 gradients), the F32
 *    rules above.
 * Determinism: dw and sumsq run twice on the same inputs, bitwise equal;
 * and the same logical data laid out aligned (vector path) and misaligned
 * (scalar path) gives the same bits (the summation orders depend on the
 * shapes alone). RMSNorm's backward runs its one-pass path wherever it
 * fits (df_cuda_rmsnorm_bwd_set_impl: whatever DFLASH_RMSNORM_BWD says;
 * each case checks which path ran) and, on the same inputs, the two-pass
 * one: dx and dw bitwise equal. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_internal.h"
#include "cuda/device.h"
#include "cuda/train_cuda.h"
#include "ops.h"
#include "test.h"
#include "train_ops.h"

static uint64_t rng = 0x7a11de45e5ull;
static df_backend *cpu, *gpu;

/* ---- bf16 ---- */

static uint16_t f2bf(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float bf2f(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float rb(float x) { return bf2f(f2bf(x)); }

static void *xmalloc(size_t n)
{
    void *p = calloc(n ? n : 1, 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* scale * N(0,1) from *s, |x| >= 0.05 scale: never zero. */
static float rnd_from(uint64_t *s, float scale)
{
    float v = test_randn(s);
    if (fabsf(v) < 0.05f)
        v = v < 0 ? -0.05f : 0.05f;
    return scale * v;
}

/* ---- buffers: one host f32 copy (CPU side), one device copy (GPU side) ---- */

typedef struct buf {
    int64_t n;
    int f32;   /* the device copy is F32, else BF16 */
    float *h;  /* CPU copy: the values (bf16-exact for a BF16 buffer) */
    void *img; /* host image of what is uploaded (uint16_t or float) */
    void *d;   /* device copy */
} buf;

static size_t esz(const buf *b) { return b->f32 ? 4 : 2; }

static void buf_set(buf *b, int64_t i, float v)
{
    if (b->f32) {
        b->h[i] = v;
        ((float *)b->img)[i] = v;
    } else {
        b->h[i] = rb(v);
        ((uint16_t *)b->img)[i] = f2bf(v);
    }
}

static buf buf_new(int64_t n, int f32, float scale)
{
    buf b = {n, f32, xmalloc((size_t)n * 4), xmalloc((size_t)n * (f32 ? 4 : 2)), NULL};
    for (int64_t i = 0; i < n; i++)
        buf_set(&b, i, rnd_from(&rng, scale));
    b.d = df_backend_alloc(gpu, (size_t)n * esz(&b));
    if (!b.d) {
        fprintf(stderr, "device allocation of %lld elements failed\n", (long long)n);
        exit(2);
    }
    return b;
}

static void buf_upload(const buf *b)
{
    CHECK_EQ(df_backend_upload(gpu, b->d, b->img, (size_t)b->n * esz(b)), 0);
}

/* The device copy, raw (n * esz bytes). */
static void *buf_download(const buf *b)
{
    void *h = xmalloc((size_t)b->n * esz(b));
    CHECK_EQ(df_backend_download(gpu, h, b->d, (size_t)b->n * esz(b)), 0);
    return h;
}

static void buf_free(buf *b)
{
    free(b->h);
    free(b->img);
    df_backend_free(gpu, b->d);
    memset(b, 0, sizeof *b);
}

/* ---- views ---- */

typedef struct view {
    int64_t off;
    int ndim;
    int64_t shape[4], stride[4];
} view;

static view vnd(int64_t off, int ndim, const int64_t *shape, const int64_t *stride)
{
    view v;
    memset(&v, 0, sizeof v);
    v.off = off;
    v.ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        v.shape[d] = shape[d];
        v.stride[d] = stride[d];
    }
    return v;
}

/* Columns [col0, col0 + cols) of a [rows, ld] matrix. */
static view v2(int64_t col0, int64_t rows, int64_t cols, int64_t ld)
{
    int64_t sh[2] = {rows, cols}, st[2] = {ld, 1};
    return vnd(col0, 2, sh, st);
}

/* [T, heads, D] per-head view of rows of ld elements, starting at off. */
static view v3(int64_t off, int64_t T, int64_t heads, int64_t D, int64_t ld)
{
    int64_t sh[3] = {T, heads, D}, st[3] = {ld, D, 1};
    return vnd(off, 3, sh, st);
}

static int64_t view_len(view v)
{
    int64_t e = v.off + 1;
    for (int d = 0; d < v.ndim; d++)
        e += (v.shape[d] - 1) * v.stride[d];
    return e;
}

/* Element offsets of v in row-major order into offs (if not NULL); the count. */
static int64_t view_offsets(view v, int64_t *offs)
{
    int64_t n = 1;
    for (int d = 0; d < v.ndim; d++)
        n *= v.shape[d];
    for (int64_t i = 0; offs && i < n; i++) {
        int64_t r = i, off = v.off;
        for (int d = v.ndim - 1; d >= 0; d--) {
            off += (r % v.shape[d]) * v.stride[d];
            r /= v.shape[d];
        }
        offs[i] = off;
    }
    return n;
}

static int64_t *offsets_of(view v, int64_t *n)
{
    *n = view_offsets(v, NULL);
    int64_t *o = xmalloc((size_t)*n * sizeof *o);
    view_offsets(v, o);
    return o;
}

/* A buffer holding v, random outside it; the view's elements (in row-major
 * order) come from their own stream seeded by seed, so two layouts of one
 * seed hold the same logical tensor. */
static buf buf_view(view v, uint64_t seed, float scale)
{
    buf b = buf_new(view_len(v), 0, scale);
    int64_t n, *o = offsets_of(v, &n);
    uint64_t s = seed;
    for (int64_t i = 0; i < n; i++)
        buf_set(&b, o[i], rnd_from(&s, scale));
    free(o);
    return b;
}

static df_tensor tens(const buf *b, view v, int on_gpu)
{
    df_tensor t;
    memset(&t, 0, sizeof t);
    t.ndim = v.ndim;
    for (int d = 0; d < v.ndim; d++) {
        t.shape[d] = v.shape[d];
        t.stride[d] = v.stride[d];
    }
    if (on_gpu) {
        t.dtype = b->f32 ? DF_DTYPE_F32 : DF_DTYPE_BF16;
        t.data = (char *)b->d + v.off * (int64_t)esz(b);
    } else {
        t.dtype = DF_DTYPE_F32;
        t.data = b->h + v.off;
    }
    return t;
}

/* NaN into the device image of v (the CPU copy keeps its values). */
static void poison(buf *b, view v)
{
    int64_t n, *o = offsets_of(v, &n);
    for (int64_t i = 0; i < n; i++) {
        if (b->f32) {
            uint32_t nan = 0x7fc00000u;
            memcpy((float *)b->img + o[i], &nan, 4);
        } else {
            ((uint16_t *)b->img)[o[i]] = 0x7fc0;
        }
    }
    free(o);
}

/* Downloads b (BF16) and compares view v with the CPU copy (the bf16 rule
 * at the top); elements outside v and outside `also` (another view the op
 * wrote, or NULL) must equal the uploaded image. Returns the download
 * (caller frees) when keep, else NULL. */
static uint16_t *check_view(const char *name, const buf *b, view v, const view *also, int keep)
{
    uint16_t *got = buf_download(b);
    uint8_t *in = xmalloc((size_t)b->n);
    if (also) {
        int64_t na, *oa = offsets_of(*also, &na);
        for (int64_t i = 0; i < na; i++)
            in[oa[i]] = 1;
        free(oa);
    }
    int64_t n, *o = offsets_of(v, &n);
    double err = 0, naive = 0, refmax = 0;
    int64_t bad = 0, touched = 0;
    for (int64_t i = 0; i < n; i++) {
        in[o[i]] = 1;
        float ref = b->h[o[i]], g = bf2f(got[o[i]]);
        if (!isfinite(g) || !isfinite(ref)) {
            bad++;
            continue;
        }
        double d = fabs((double)g - ref), r = fabs((double)rb(ref) - ref);
        err = d > err ? d : err;
        naive = r > naive ? r : naive;
        refmax = fabs(ref) > refmax ? fabs(ref) : refmax;
    }
    for (int64_t i = 0; i < b->n; i++)
        if (!in[i] && got[i] != ((uint16_t *)b->img)[i])
            touched++;
    double bound = 2.0 * naive + 1e-6 * refmax;
    int ok = bad == 0 && touched == 0 && err <= bound;
    printf("  %-50s err %.3e  naive %.3e  bound %.3e  %s\n", name, err, naive, bound,
           ok ? "ok" : "FAIL");
    if (!ok) {
        fprintf(stderr, "%s: %lld non-finite, %lld written outside the view\n", name,
                (long long)bad, (long long)touched);
        df_test_failures++;
    }
    free(o);
    free(in);
    if (keep)
        return got;
    free(got);
    return NULL;
}

static int sync_ok(void) { return df_backend_sync(gpu) == 0; }

/* ---- RMSNorm backward ---- */

enum { DX_NONE, DX_OWN, DX_IS_DY, DX_IS_X };

typedef struct nbwd_out {
    float *dw;      /* [D] the GPU's dw */
    uint16_t *dx;   /* the GPU's dx, the view's elements in row-major order (or NULL) */
} nbwd_out;

/* mag[i] += sum over the R rows of |dy xhat| at column i (xhat from a
 * double 1/rms): the magnitude RMSNorm's dw error bounds scale with. o: the
 * view's element offsets, row-major [R][D]. */
static void add_dw_terms(double *mag, const buf *x, const buf *dy, const int64_t *o, int64_t R,
                         int64_t D, float eps)
{
    for (int64_t r = 0; r < R; r++) {
        double ss = 0;
        for (int64_t i = 0; i < D; i++)
            ss += (double)x->h[o[r * D + i]] * x->h[o[r * D + i]];
        double inv = 1.0 / sqrt(ss / (double)D + eps);
        for (int64_t i = 0; i < D; i++)
            mag[i] += fabs((double)dy->h[o[r * D + i]] * x->h[o[r * D + i]] * inv);
    }
}

/* x, dy, dx share the view's shape; x and dy in v, dx in its own buffer at
 * v's layout (DX_OWN), or dy's / x's very view. seed fixes the logical data
 * (independent of the layout). Returns the GPU results for cross-layout
 * comparisons (caller frees). */
/* want: the path the call must take (test_rmsnorm_bwd asks for the
 * one-pass one where it fits; ONE or TWO). */
enum { ONE = DF_CUDA_RMSNORM_BWD_ONEPASS, TWO = DF_CUDA_RMSNORM_BWD_TWOPASS };

static nbwd_out nbwd_case(const char *name, view v, int plus_one, int dxm, int acc, uint64_t seed,
                          int want)
{
    const int64_t D = v.shape[v.ndim - 1];
    const float eps = 1e-6f;
    buf x = buf_view(v, seed, 1.5f), dy = buf_view(v, seed + 1, 1.0f), dxb;
    memset(&dxb, 0, sizeof dxb);
    buf w = buf_new(D, 0, 0.5f), dw = buf_new(D, 1, 3.0f);
    uint64_t sw = seed + 3, sd = seed + 4; /* w and dw0 by the seed too */
    for (int64_t i = 0; i < D; i++) {
        buf_set(&w, i, rnd_from(&sw, 0.5f));
        buf_set(&dw, i, rnd_from(&sd, 3.0f));
    }
    if (dxm == DX_OWN) {
        dxb = buf_view(v, seed + 2, 1.0f);
        if (!acc)
            poison(&dxb, v);
    }
    buf *pdx = dxm == DX_OWN ? &dxb : dxm == DX_IS_DY ? &dy : dxm == DX_IS_X ? &x : NULL;

    /* dw's bound: |dw0| + sum_rows |dy xhat|, xhat from double 1/rms */
    int64_t n, *o = offsets_of(v, &n);
    const int64_t R = n / D;
    double *mag = xmalloc((size_t)D * sizeof *mag);
    for (int64_t i = 0; i < D; i++)
        mag[i] = fabs(dw.h[i]);
    add_dw_terms(mag, &x, &dy, o, R, D, eps);

    buf_upload(&x);
    buf_upload(&dy);
    buf_upload(&w);
    buf_upload(&dw);
    if (dxm == DX_OWN)
        buf_upload(&dxb);
    df_tensor xg = tens(&x, v, 1), dyg = tens(&dy, v, 1);
    df_tensor wg = df_tensor_1d(w.d, DF_DTYPE_BF16, D), dwg = df_tensor_1d(dw.d, DF_DTYPE_F32, D);
    df_tensor dxg, dxc;
    memset(&dxg, 0, sizeof dxg);
    memset(&dxc, 0, sizeof dxc);
    if (pdx)
        dxg = tens(pdx, v, 1);
    CHECK_EQ(df_cuda_rmsnorm_bwd(gpu, &xg, &wg, eps, plus_one, &dyg, pdx ? &dxg : NULL, acc, &dwg),
             0);
    CHECK(sync_ok());
    const int took = df_cuda_rmsnorm_bwd_last_impl();
    CHECK_EQ(took, want);
    float *dw1 = buf_download(&dw);
    uint16_t *dx1 = pdx ? buf_download(pdx) : NULL;

    /* the two-pass path on the same inputs: the same bits (the one-pass
     * kernel keeps its row sums, streams and formulas); then the default
     * path again, whose dx is the one checked against the CPU below */
    buf_upload(&x);
    buf_upload(&dy);
    buf_upload(&dw);
    if (dxm == DX_OWN)
        buf_upload(&dxb);
    CHECK_EQ(df_cuda_rmsnorm_bwd_set_impl(TWO), 0);
    CHECK_EQ(df_cuda_rmsnorm_bwd(gpu, &xg, &wg, eps, plus_one, &dyg, pdx ? &dxg : NULL, acc, &dwg),
             0);
    CHECK(sync_ok());
    CHECK_EQ(df_cuda_rmsnorm_bwd_last_impl(), TWO);
    CHECK_EQ(df_cuda_rmsnorm_bwd_set_impl(ONE), 0);
    float *dw3 = buf_download(&dw);
    uint16_t *dx3 = pdx ? buf_download(pdx) : NULL;
    int same2 = !memcmp(dw1, dw3, (size_t)D * 4) &&
                (!pdx || !memcmp(dx1, dx3, (size_t)pdx->n * 2));

    /* again, on the same inputs: the same bits */
    buf_upload(&x);
    buf_upload(&dy);
    buf_upload(&dw);
    if (dxm == DX_OWN)
        buf_upload(&dxb);
    CHECK_EQ(df_cuda_rmsnorm_bwd(gpu, &xg, &wg, eps, plus_one, &dyg, pdx ? &dxg : NULL, acc, &dwg),
             0);
    CHECK(sync_ok());
    float *dw2 = buf_download(&dw);
    uint16_t *dx2 = pdx ? buf_download(pdx) : NULL;
    int same = !memcmp(dw1, dw2, (size_t)D * 4) &&
               (!pdx || !memcmp(dx1, dx2, (size_t)pdx->n * 2));

    /* the CPU reference, on the host copies (dx aliasing as on the GPU) */
    df_tensor xc = tens(&x, v, 0), dyc = tens(&dy, v, 0);
    df_tensor wc = df_tensor_1d(w.h, DF_DTYPE_F32, D), dwc = df_tensor_1d(dw.h, DF_DTYPE_F32, D);
    if (pdx)
        dxc = tens(pdx, v, 0);
    CHECK_EQ(df_op_rmsnorm_bwd(cpu, &xc, &wc, eps, plus_one, &dyc, pdx ? &dxc : NULL, acc, &dwc), 0);

    char nm[160];
    if (pdx) {
        snprintf(nm, sizeof nm, "%s dx", name);
        free(check_view(nm, pdx, v, NULL, 0));
    }
    int64_t bad = 0;
    double worst = 0;
    for (int64_t i = 0; i < D; i++) {
        double d = fabs((double)dw1[i] - dw.h[i]);
        bad += !(d <= 1e-5 * mag[i]);
        worst = fmax(worst, d / mag[i]);
    }
    printf("  %-50s err / sum|terms| %.2e (<= 1e-5)  rerun %s  %s-pass%s  %s\n", "  dw", worst,
           same ? "bitwise equal" : "DIFFERS", took == ONE ? "one" : "two",
           took == ONE ? (same2 ? " == two-pass" : " != two-pass") : "",
           bad || !same || !same2 || took != want ? "FAIL" : "ok");
    CHECK_EQ(bad, 0);
    CHECK(same);
    CHECK(same2);

    nbwd_out r = {dw1, NULL};
    if (pdx) {
        r.dx = xmalloc((size_t)n * 2);
        for (int64_t i = 0; i < n; i++)
            r.dx[i] = dx1[o[i]];
    }
    free(dx1), free(dw2), free(dx2), free(dw3), free(dx3), free(mag), free(o);
    buf_free(&x), buf_free(&dy), buf_free(&w), buf_free(&dw);
    if (dxm == DX_OWN)
        buf_free(&dxb);
    return r;
}

static void nbwd_run(const char *name, view v, int plus_one, int dxm, int acc, int want)
{
    nbwd_out r = nbwd_case(name, v, plus_one, dxm, acc, test_rand(&rng), want);
    free(r.dw);
    free(r.dx);
}

/* One logical problem (one seed) in an aligned layout (16-byte vectors)
 * and a misaligned one (scalar loads): dw and dx must agree bit for bit. */
static void nbwd_layouts(const char *name, view a, view b, int plus_one, int dxm, int acc)
{
    uint64_t seed = test_rand(&rng);
    nbwd_out ra = nbwd_case(name, a, plus_one, dxm, acc, seed, ONE);
    nbwd_out rb_ = nbwd_case(name, b, plus_one, dxm, acc, seed, TWO);
    int64_t D = a.shape[a.ndim - 1], n = view_offsets(a, NULL);
    int same = !memcmp(ra.dw, rb_.dw, (size_t)D * 4) &&
               (!ra.dx || !memcmp(ra.dx, rb_.dx, (size_t)n * 2));
    printf("  %-50s %s\n", "aligned vs misaligned layout: dw, dx",
           same ? "bitwise equal  ok" : "DIFFER  FAIL");
    CHECK(same);
    free(ra.dw), free(ra.dx), free(rb_.dw), free(rb_.dx);
}

/* ---- RMSNorm backward, BF16 dw ---- */

/* The rule at the top: the GPU's and the CPU's bf16 dw, each the one
 * rounding of an fp32 value, those within tol of each other. */
static int bf16_grad_close(uint16_t a, uint16_t b, double tol, int64_t *cancel)
{
    float fa = bf2f(a), fb = bf2f(b);
    if (!isfinite(fa) || !isfinite(fb))
        return 0;
    if (tol < 0.5 * test_bf16_ulp(fb))
        return test_bf16_dist(a, b) <= 1;
    (*cancel)++;
    return fabs((double)fa - fb) <= tol + 0.5 * (test_bf16_ulp(fa) + test_bf16_ulp(fb));
}

static void nbwd_bf16_case(const char *name, view v, int plus_one, int dxm, int acc, int want)
{
    const uint64_t seed = test_rand(&rng);
    const int64_t D = v.shape[v.ndim - 1];
    const float eps = 1e-6f;
    buf x = buf_view(v, seed, 1.5f), dy = buf_view(v, seed + 1, 1.0f), dxb;
    memset(&dxb, 0, sizeof dxb);
    buf w = buf_new(D, 0, 0.5f);
    buf dwb = buf_new(D, 0, 3.0f), dwf = buf_new(D, 1, 1.0f); /* BF16 dw; F32, same values */
    for (int64_t i = 0; i < D; i++)
        buf_set(&dwf, i, dwb.h[i]);
    if (dxm == DX_OWN) {
        dxb = buf_view(v, seed + 2, 1.0f);
        if (!acc)
            poison(&dxb, v);
    }
    buf *pdx = dxm == DX_OWN ? &dxb : dxm == DX_IS_DY ? &dy : dxm == DX_IS_X ? &x : NULL;

    /* the bound's magnitudes: |dw0| + sum_rows |dy xhat|, xhat from double 1/rms */
    int64_t n, *o = offsets_of(v, &n);
    const int64_t R = n / D;
    double *mag = xmalloc((size_t)D * sizeof *mag);
    for (int64_t i = 0; i < D; i++)
        mag[i] = fabs(dwb.h[i]);
    add_dw_terms(mag, &x, &dy, o, R, D, eps);

    /* the GPU with the BF16 dw, then (inputs uploaded again: dx may be one
     * of them) with the F32 dw */
    df_tensor xg = tens(&x, v, 1), dyg = tens(&dy, v, 1), dxg;
    memset(&dxg, 0, sizeof dxg);
    if (pdx)
        dxg = tens(pdx, v, 1);
    df_tensor wg = df_tensor_1d(w.d, DF_DTYPE_BF16, D);
    df_tensor dwbg = df_tensor_1d(dwb.d, DF_DTYPE_BF16, D);
    df_tensor dwfg = df_tensor_1d(dwf.d, DF_DTYPE_F32, D);
    uint16_t *dxr[2] = {NULL, NULL};
    for (int run = 0; run < 2; run++) {
        buf_upload(&x), buf_upload(&dy), buf_upload(&w);
        buf_upload(run ? &dwf : &dwb);
        if (dxm == DX_OWN)
            buf_upload(&dxb);
        CHECK_EQ(df_cuda_rmsnorm_bwd(gpu, &xg, &wg, eps, plus_one, &dyg, pdx ? &dxg : NULL, acc,
                                     run ? &dwfg : &dwbg),
                 0);
        CHECK(sync_ok());
        CHECK_EQ(df_cuda_rmsnorm_bwd_last_impl(), want);
        if (pdx)
            dxr[run] = buf_download(pdx);
    }
    uint16_t *gb = buf_download(&dwb);
    float *gf = buf_download(&dwf);
    int same_dx = !pdx || !memcmp(dxr[0], dxr[1], (size_t)pdx->n * 2);
    int64_t not_rne = 0;
    for (int64_t i = 0; i < D; i++)
        not_rne += gb[i] != f2bf(gf[i]);

    /* the CPU with a BF16 dw holding the same old values */
    uint16_t *cb = xmalloc((size_t)D * 2);
    memcpy(cb, dwb.img, (size_t)D * 2);
    df_tensor xc = tens(&x, v, 0), dyc = tens(&dy, v, 0), dxc;
    memset(&dxc, 0, sizeof dxc);
    if (pdx)
        dxc = tens(pdx, v, 0);
    df_tensor wc = df_tensor_1d(w.h, DF_DTYPE_F32, D), cdw = df_tensor_1d(cb, DF_DTYPE_BF16, D);
    CHECK_EQ(df_op_rmsnorm_bwd(cpu, &xc, &wc, eps, plus_one, &dyc, pdx ? &dxc : NULL, acc, &cdw),
             0);
    int64_t bad = 0, cancel = 0, differ = 0;
    for (int64_t i = 0; i < D; i++) {
        bad += !bf16_grad_close(gb[i], cb[i], 1e-5 * mag[i], &cancel);
        differ += gb[i] != cb[i];
    }
    int ok = bad == 0 && not_rne == 0 && same_dx;
    printf("  %-50s bf16 dw: == RNE(f32 dw run) %s, dx %s; vs CPU %lld/%lld differ (1 ulp), "
           "%lld cancelling, %lld bad  %s\n",
           name, not_rne ? "NO" : "yes", same_dx ? "bitwise equal" : "DIFFERS", (long long)differ,
           (long long)D, (long long)cancel, (long long)bad, ok ? "ok" : "FAIL");
    CHECK_EQ(bad, 0);
    CHECK_EQ(not_rne, 0);
    CHECK(same_dx);
    free(o), free(mag), free(gb), free(gf), free(cb), free(dxr[0]), free(dxr[1]);
    buf_free(&x), buf_free(&dy), buf_free(&w), buf_free(&dwb), buf_free(&dwf);
    if (dxm == DX_OWN)
        buf_free(&dxb);
}

static void test_rmsnorm_bwd(void)
{
    /* the one-pass path wherever it fits (whatever DFLASH_RMSNORM_BWD
     * says); each case also runs the two-pass one and compares the bits */
    CHECK_EQ(df_cuda_rmsnorm_bwd_set_impl(-1), -EINVAL);
    CHECK_EQ(df_cuda_rmsnorm_bwd_set_impl(TWO + 1), -EINVAL);
    CHECK_EQ(df_cuda_rmsnorm_bwd_set_impl(ONE), 0);
    printf("rmsnorm_bwd (bf16 dx: 2 naive + 1e-6 max|ref|; dw: 1e-5 sum|terms|; one-pass == "
           "two-pass bitwise)\n");
    nbwd_run("[37, 4, 64] ld 272, plain, dx own", v3(0, 37, 4, 64, 272), 0, DX_OWN, 0, ONE);
    nbwd_run("[37, 4, 128] ld 528, plus_one, dx = dy, acc", v3(8, 37, 4, 128, 528), 1, DX_IS_DY,
             1, ONE);
    nbwd_run("[37, 1, 5120] ld 5184, plain, dx = x", v3(0, 37, 1, 5120, 5184), 0, DX_IS_X, 0, ONE);
    nbwd_run("[1, 16, 64] ld 1040, plus_one, dx own", v3(0, 1, 16, 64, 1040), 1, DX_OWN, 0, ONE);
    nbwd_run("[1, 1, 5120] ld 5184, plain, no dx", v3(0, 1, 1, 5120, 5184), 0, DX_NONE, 0, ONE);
    nbwd_run("[1, 2, 128] ld 264, plain, dx own, acc", v3(8, 1, 2, 128, 264), 0, DX_OWN, 1, ONE);
    nbwd_run("[4096, 16, 64] ld 1032, plain, dx own", v3(0, 4096, 16, 64, 1032), 0, DX_OWN, 0,
             ONE);
    nbwd_run("[4096, 8, 128] ld 1040, plus_one, dx = x", v3(0, 4096, 8, 128, 1040), 1, DX_IS_X,
             0, ONE);
    nbwd_run("[4096, 1, 5120] ld 5184, plus_one, dx own, acc", v3(0, 4096, 1, 5120, 5184), 1,
             DX_OWN, 1, ONE);
    nbwd_run("[4096, 1, 5120] ld 5184, plain, dx = dy", v3(0, 4096, 1, 5120, 5184), 0, DX_IS_DY,
             0, ONE);
    /* rows not a multiple of the tile (5120: 16 rows; 128: 256 rows, two
     * tiles a block: the last block's second tile empty) */
    nbwd_run("[1003, 1, 5120] ld 5120, plus_one, dx = dy, acc", v3(0, 1003, 1, 5120, 5120), 1,
             DX_IS_DY, 1, ONE);
    nbwd_run("[1003, 1, 5120] ld 5128 at 8, plain, dx = x, acc", v3(8, 1003, 1, 5120, 5128), 0,
             DX_IS_X, 1, ONE);
    nbwd_run("[2049, 8, 128] ld 1024, plain, dx own, acc", v3(0, 2049, 8, 128, 1024), 0, DX_OWN,
             1, ONE);
    nbwd_run("[2049, 8, 128] ld 1024, plus_one, dx = dy", v3(0, 2049, 8, 128, 1024), 1, DX_IS_DY,
             0, ONE);
    /* every one-pass configuration: D 8 and 32 (a slice owns several
     * streams), 256 (slices of 16), 512 (of 32), 1536 / 3000 / 6144 (the
     * block, 1 / 2 / 3 units a thread) */
    nbwd_run("[1000, 8] ld 8, plus_one, dx own, acc", v2(0, 1000, 8, 8), 1, DX_OWN, 1, ONE);
    nbwd_run("[300, 32] ld 40, plain, dx = x", v2(0, 300, 32, 40), 0, DX_IS_X, 0, ONE);
    nbwd_run("[99, 256] ld 264, plain, dx = x, acc", v2(8, 99, 256, 264), 0, DX_IS_X, 1, ONE);
    nbwd_run("[77, 512] ld 512, plus_one, dx own", v2(0, 77, 512, 512), 1, DX_OWN, 0, ONE);
    nbwd_run("[50, 1536] ld 1536, plain, dx = dy, acc", v2(0, 50, 1536, 1536), 0, DX_IS_DY, 1,
             ONE);
    nbwd_run("[67, 3000] ld 3000, plus_one, dx own, acc", v2(0, 67, 3000, 3000), 1, DX_OWN, 1,
             ONE);
    nbwd_run("[21, 6144] ld 6144, plain, dx = x", v2(0, 21, 6144, 6144), 0, DX_IS_X, 0, ONE);
    {
        int64_t sh[4] = {2, 37, 4, 128}, st[4] = {37 * 528 + 48, 528, 128, 1};
        nbwd_run("[2, 37, 4, 128] 4-D with gaps, plain, dx own", vnd(0, 4, sh, st), 0, DX_OWN,
                 0, ONE);
    }
    nbwd_run("[37, 100] ld 104 (vector + tail), plus_one", v2(0, 37, 100, 104), 1, DX_OWN, 0, ONE);
    /* the two-pass fallback: misaligned rows; D 513..1024 and > 6144 */
    nbwd_run("[37, 3, 64] ld 197 at 1 (scalar), plain", v3(1, 37, 3, 64, 197), 0, DX_OWN, 1, TWO);
    nbwd_run("[45, 2, 1024] ld 2048, plain, dx own, acc", v3(0, 45, 2, 1024, 2048), 0, DX_OWN, 1,
             TWO);
    nbwd_run("[20, 6152] ld 6152, plus_one, dx = dy", v2(0, 20, 6152, 6152), 1, DX_IS_DY, 0, TWO);
    nbwd_layouts("[300, 2, 128] ld 264 at 0 | 265 at 1", v3(0, 300, 2, 128, 264),
                 v3(1, 300, 2, 128, 265), 1, DX_OWN, 0);
    printf("rmsnorm_bwd, BF16 dw (== RNE(F32 dw run); vs CPU: 1 bf16 ulp, or 1e-5 sum|terms| "
           "+ rounding where the sum cancels)\n");
    nbwd_bf16_case("[37, 4, 64] ld 272, plain, dx own", v3(0, 37, 4, 64, 272), 0, DX_OWN, 0, ONE);
    nbwd_bf16_case("[4096, 16, 64] ld 1032, plus_one, dx own, acc", v3(0, 4096, 16, 64, 1032), 1,
                   DX_OWN, 1, ONE);
    nbwd_bf16_case("[4096, 1, 5120] ld 5184, plain, dx = dy", v3(0, 4096, 1, 5120, 5184), 0,
                   DX_IS_DY, 0, ONE);
    nbwd_bf16_case("[1003, 1, 5120] ld 5120, plus_one, dx = x, acc", v3(0, 1003, 1, 5120, 5120),
                   1, DX_IS_X, 1, ONE);
    nbwd_bf16_case("[4096, 8, 128] ld 1040, plus_one, dx = x", v3(0, 4096, 8, 128, 1040), 1,
                   DX_IS_X, 0, ONE);
    nbwd_bf16_case("[2049, 8, 128] ld 1024, plain, dx = dy, acc", v3(0, 2049, 8, 128, 1024), 0,
                   DX_IS_DY, 1, ONE);
    nbwd_bf16_case("[1, 1, 5120] ld 5184, plain, no dx", v3(0, 1, 1, 5120, 5184), 0, DX_NONE, 0,
                   ONE);
    nbwd_bf16_case("[37, 3, 64] ld 197 at 1 (scalar), acc", v3(1, 37, 3, 64, 197), 0, DX_OWN, 1,
                   TWO);
    CHECK_EQ(df_cuda_rmsnorm_bwd_set_impl(0), 0);
}

/* ---- RoPE backward ---- */

static void rope_case(const char *name, int64_t T, int heads, int hd, int rot, int64_t ld,
                      int64_t col0, double theta)
{
    view v = v2(col0, T, (int64_t)heads * hd, ld);
    buf x = buf_new(view_len(v), 0, 1.0f);
    int32_t *pos = xmalloc((size_t)T * sizeof *pos);
    for (int64_t t = 0; t < T; t++) /* long-context positions, and 0 */
        pos[t] = t == 0 ? 0 : (int32_t)(test_rand(&rng) % 40000);
    buf_upload(&x);
    df_tensor xc = tens(&x, v, 0), xg = tens(&x, v, 1);
    CHECK_EQ(df_cuda_rope_bwd(gpu, &xg, pos, heads, hd, rot, theta), 0);
    CHECK(sync_ok());
    CHECK_EQ(df_op_rope_bwd(cpu, &xc, pos, heads, hd, rot, theta), 0);
    check_view(name, &x, v, NULL, 0);
    free(pos);
    buf_free(&x);
}

static void test_rope_bwd(void)
{
    printf("rope_bwd (in place, bf16: 2 naive + 1e-6 max|ref|)\n");
    rope_case("T37 4x128 rot 128 ld 528", 37, 4, 128, 128, 528, 0, 1e6);
    rope_case("T4096 8x128 rot 64 ld 1040 (partial)", 4096, 8, 128, 64, 1040, 8, 1e7);
    rope_case("T1 2x64 rot 64 ld 136", 1, 2, 64, 64, 136, 0, 1e4);
    rope_case("T37 3x64 rot 32 ld 197 at 1 (scalar)", 37, 3, 64, 32, 197, 1, 1e6);
    rope_case("T37 2x128 rot 36 ld 264 (half 18: scalar)", 37, 2, 128, 36, 264, 0, 1e6);
    rope_case("T4096 32x64 rot 64 ld 2056", 4096, 32, 64, 64, 2056, 0, 5e5);
}

/* ---- SwiGLU backward ---- */

enum { SW_OWN, SW_INPLACE, SW_CROSS };

/* gate, up, dout in their own buffers (views of one layout v); dgate, dup
 * in their own (SW_OWN), or dgate = gate and dup = up (SW_INPLACE), or
 * dgate = dout and dup = gate (SW_CROSS). */
static void swiglu_case(const char *name, view v, int mode)
{
    buf g = buf_new(view_len(v), 0, 2.5f), u = buf_new(view_len(v), 0, 1.0f),
        d = buf_new(view_len(v), 0, 1.0f), og, ou;
    memset(&og, 0, sizeof og);
    memset(&ou, 0, sizeof ou);
    /* saturating gates: exp overflow must give 0 / -0, never NaN */
    static const float ext[] = {100.0f, -100.0f, 88.5f, -88.5f, 16.0f, -16.0f};
    int64_t n, *o = offsets_of(v, &n);
    for (int64_t i = 0; i < n; i += 97)
        buf_set(&g, o[i], ext[(i / 97) % 6]);
    free(o);
    if (mode == SW_OWN) {
        og = buf_new(view_len(v), 0, 1.0f);
        ou = buf_new(view_len(v), 0, 1.0f);
        poison(&og, v);
        poison(&ou, v);
    }
    buf *pg = mode == SW_OWN ? &og : mode == SW_INPLACE ? &g : &d;
    buf *pu = mode == SW_OWN ? &ou : mode == SW_INPLACE ? &u : &g;
    buf_upload(&g), buf_upload(&u), buf_upload(&d);
    if (mode == SW_OWN)
        buf_upload(&og), buf_upload(&ou);
    df_tensor gg = tens(&g, v, 1), ug = tens(&u, v, 1), dg = tens(&d, v, 1);
    df_tensor dgg = tens(pg, v, 1), dug = tens(pu, v, 1);
    CHECK_EQ(df_cuda_swiglu_bwd(gpu, &gg, &ug, &dg, &dgg, &dug), 0);
    CHECK(sync_ok());
    df_tensor gc = tens(&g, v, 0), uc = tens(&u, v, 0), dc = tens(&d, v, 0);
    df_tensor dgc = tens(pg, v, 0), duc = tens(pu, v, 0);
    CHECK_EQ(df_op_swiglu_bwd(cpu, &gc, &uc, &dc, &dgc, &duc), 0);
    char nm[160];
    snprintf(nm, sizeof nm, "%s dgate", name);
    check_view(nm, pg, v, NULL, 0);
    snprintf(nm, sizeof nm, "%s dup", name);
    check_view(nm, pu, v, NULL, 0);
    buf_free(&g), buf_free(&u), buf_free(&d);
    if (mode == SW_OWN)
        buf_free(&og), buf_free(&ou);
}

static void test_swiglu_bwd(void)
{
    printf("swiglu_bwd (bf16: 2 naive + 1e-6 max|ref|)\n");
    swiglu_case("[37, 4, 128] ld 528", v3(0, 37, 4, 128, 528), SW_OWN);
    swiglu_case("[4096, 1, 5120] ld 5184, in place", v3(8, 4096, 1, 5120, 5184), SW_INPLACE);
    swiglu_case("[1, 8, 64] ld 520, dgate = dout, dup = gate", v3(0, 1, 8, 64, 520), SW_CROSS);
    swiglu_case("[37, 3, 64] ld 197 at 1 (scalar)", v3(1, 37, 3, 64, 197), SW_OWN);
    swiglu_case("[37, 77] ld 90 at 3 (odd width)", v2(3, 37, 77, 90), SW_INPLACE);
    {
        int64_t sh[4] = {2, 5, 4, 64}, st[4] = {5 * 264 + 16, 264, 64, 1};
        swiglu_case("[2, 5, 4, 64] 4-D with gaps", vnd(8, 4, sh, st), SW_OWN);
    }
}

/* ---- AdamW ---- */

/* Device arrays at element offset off (off 1: not 16-byte aligned, the
 * scalar path). gbf: the gradients are bf16 numbers, run on the GPU as an
 * F32 and then as a BF16 array (from the same p, m, v): the two must agree
 * bit for bit; the BF16 run is then held to the rules against the CPU run
 * on the same BF16 array. */
static void adamw_case(int64_t n, int with_out, int off, int64_t step, float gs, int gbf)
{
    const float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f;
    float *p = xmalloc((size_t)n * 4), *g = xmalloc((size_t)n * 4), *m = xmalloc((size_t)n * 4),
          *v = xmalloc((size_t)n * 4);
    uint16_t *g16 = xmalloc((size_t)n * 2); /* the bf16 gradients (gbf) */
    for (int64_t i = 0; i < n; i++) {
        p[i] = rnd_from(&rng, 0.05f);
        g[i] = rnd_from(&rng, 0.01f);
        m[i] = rnd_from(&rng, 0.003f);
        v[i] = fabsf(rnd_from(&rng, 1e-4f)) * 1e-2f;
        if (gbf) {
            g16[i] = f2bf(g[i]);
            g[i] = bf2f(g16[i]);
        }
    }
    size_t bytes = (size_t)(n + off) * 4;
    float *dp = df_backend_alloc(gpu, bytes), *dg = df_backend_alloc(gpu, bytes),
          *dm = df_backend_alloc(gpu, bytes), *dv = df_backend_alloc(gpu, bytes);
    uint16_t *dout = with_out ? df_backend_alloc(gpu, (size_t)(n + off) * 2) : NULL;
    uint16_t *dg16 = gbf ? df_backend_alloc(gpu, (size_t)(n + off) * 2) : NULL;
    CHECK(dp && dg && dm && dv && (!with_out || dout) && (!gbf || dg16));
    CHECK_EQ(df_backend_upload(gpu, dg + off, g, (size_t)n * 4), 0);
    if (gbf)
        CHECK_EQ(df_backend_upload(gpu, dg16 + off, g16, (size_t)n * 2), 0);
    float *gp = xmalloc((size_t)n * 4), *gm = xmalloc((size_t)n * 4), *gv = xmalloc((size_t)n * 4);
    uint16_t *go = with_out ? xmalloc((size_t)n * 2) : NULL;
    int64_t differ32 = 0; /* BF16 run vs F32 run */
    for (int run = 0; run < (gbf ? 2 : 1); run++) {
        CHECK_EQ(df_backend_upload(gpu, dp + off, p, (size_t)n * 4), 0);
        CHECK_EQ(df_backend_upload(gpu, dm + off, m, (size_t)n * 4), 0);
        CHECK_EQ(df_backend_upload(gpu, dv + off, v, (size_t)n * 4), 0);
        if (with_out) {
            uint16_t *nan = xmalloc((size_t)n * 2);
            for (int64_t i = 0; i < n; i++)
                nan[i] = 0x7fc0;
            CHECK_EQ(df_backend_upload(gpu, dout + off, nan, (size_t)n * 2), 0);
            free(nan);
        }
        CHECK_EQ(df_cuda_adamw(gpu, dp + off, run ? (const void *)(dg16 + off) : dg + off,
                               run ? DF_DTYPE_BF16 : DF_DTYPE_F32, dm + off, dv + off, n, lr, b1,
                               b2, eps, wd, step, gs, with_out ? dout + off : NULL),
                 0);
        CHECK(sync_ok());
        float *np_ = xmalloc((size_t)n * 4), *nm = xmalloc((size_t)n * 4);
        float *nv = xmalloc((size_t)n * 4);
        uint16_t *no = with_out ? xmalloc((size_t)n * 2) : NULL;
        CHECK_EQ(df_backend_download(gpu, np_, dp + off, (size_t)n * 4), 0);
        CHECK_EQ(df_backend_download(gpu, nm, dm + off, (size_t)n * 4), 0);
        CHECK_EQ(df_backend_download(gpu, nv, dv + off, (size_t)n * 4), 0);
        if (with_out)
            CHECK_EQ(df_backend_download(gpu, no, dout + off, (size_t)n * 2), 0);
        for (int64_t i = 0; run && i < n; i++)
            differ32 += memcmp(&np_[i], &gp[i], 4) || memcmp(&nm[i], &gm[i], 4) ||
                        memcmp(&nv[i], &gv[i], 4) || (with_out && no[i] != go[i]);
        memcpy(gp, np_, (size_t)n * 4), memcpy(gm, nm, (size_t)n * 4);
        memcpy(gv, nv, (size_t)n * 4);
        if (with_out)
            memcpy(go, no, (size_t)n * 2);
        free(np_), free(nm), free(nv), free(no);
    }

    /* the reference on copies (p, m, v are updated in place) */
    float *rp = xmalloc((size_t)n * 4), *rm = xmalloc((size_t)n * 4), *rv = xmalloc((size_t)n * 4);
    uint16_t *ro = xmalloc((size_t)n * 2);
    memcpy(rp, p, (size_t)n * 4), memcpy(rm, m, (size_t)n * 4), memcpy(rv, v, (size_t)n * 4);
    CHECK_EQ(df_op_adamw(cpu, rp, gbf ? (const void *)g16 : g, gbf ? DF_DTYPE_BF16 : DF_DTYPE_F32,
                         rm, rv, n, lr, b1, b2, eps, wd, step, gs, ro),
             0);

    /* bound: 1e-6 x the magnitudes of each update's terms (double) */
    const double bc1 = 1.0 - pow(b1, (double)step), bc2 = 1.0 - pow(b2, (double)step);
    int64_t bad = 0, exact = 0, outbad = 0;
    for (int64_t i = 0; i < n; i++) {
        double gg = (double)g[i] * gs;
        double mm = b1 * (double)m[i] + (1.0 - b1) * gg, vv = b2 * (double)v[i] + (1.0 - b2) * gg * gg;
        double upd = fabs(mm / bc1) / (sqrt(vv / bc2) + eps) + wd * fabs(p[i]);
        double sp = fabs(p[i]) + lr * upd;
        double sm = fabs(b1 * (double)m[i]) + fabs((1.0 - b1) * gg);
        double sv = fabs(b2 * (double)v[i]) + (1.0 - b2) * gg * gg;
        int ok = fabs((double)gp[i] - rp[i]) <= 1e-6 * sp && fabs((double)gm[i] - rm[i]) <= 1e-6 * sm &&
                 fabs((double)gv[i] - rv[i]) <= 1e-6 * sv;
        bad += !ok;
        exact += !memcmp(&gp[i], &rp[i], 4) && !memcmp(&gm[i], &rm[i], 4) && !memcmp(&gv[i], &rv[i], 4);
        if (with_out)
            outbad += go[i] != f2bf(gp[i]);
    }
    int ok = bad == 0 && outbad == 0 && differ32 == 0;
    printf("  adamw n=%-8lld out_bf16 %d %-9s step %lld gs %.2f grad %s: %lld/%lld bit-exact, %lld "
           "out of bound, out_bf16 != RNE(master): %lld",
           (long long)n, with_out, off ? "unaligned" : "aligned", (long long)step, gs,
           gbf ? "BF16" : "F32", (long long)exact, (long long)n, (long long)bad, (long long)outbad);
    if (gbf)
        printf(", != the F32-grad run: %lld", (long long)differ32);
    printf("  %s\n", ok ? "ok" : "FAIL");
    CHECK_EQ(bad, 0);
    CHECK_EQ(outbad, 0);
    CHECK_EQ(differ32, 0);
    free(p), free(g), free(g16), free(m), free(v), free(gp), free(gm), free(gv), free(go);
    free(rp), free(rm), free(rv), free(ro);
    df_backend_free(gpu, dp), df_backend_free(gpu, dg), df_backend_free(gpu, dm);
    df_backend_free(gpu, dv);
    if (dout)
        df_backend_free(gpu, dout);
    if (dg16)
        df_backend_free(gpu, dg16);
}

static void test_adamw(void)
{
    printf("adamw (F32 master/m/v: 1e-6 x sum|terms|; out_bf16 == RNE(master); BF16 grads: "
           "== the F32-grad run bitwise)\n");
    adamw_case(1, 0, 0, 1, 0.37f, 0);
    adamw_case(1, 1, 0, 3, 0.37f, 0);
    adamw_case(1000003, 0, 0, 7, 0.37f, 0);
    adamw_case(1000003, 1, 0, 7, 0.37f, 0);
    adamw_case(1000003, 1, 1, 1000, 2.5f, 0);
    adamw_case(7, 1, 1, 2, 1.0f, 0);
    adamw_case(1, 1, 0, 3, 0.37f, 1);
    adamw_case(1000003, 1, 0, 7, 0.37f, 1); /* vector path: 4 bf16 grads per 8-byte load */
    adamw_case(1000003, 0, 1, 1000, 2.5f, 1); /* scalar path */
    adamw_case(7, 1, 1, 2, 1.0f, 1);
}

/* ---- sum of squares ---- */

static void sumsq_case(int64_t n)
{
    float *x = xmalloc((size_t)n * 4 + 4);
    for (int64_t i = 0; i < n; i++)
        x[i] = rnd_from(&rng, 1e-2f);
    /* aligned at a and misaligned (one float in) at b + 1: same data */
    float *a = df_backend_alloc(gpu, (size_t)n * 4 + 4), *b = df_backend_alloc(gpu, (size_t)n * 4 + 8);
    CHECK(a && b);
    if (n) {
        CHECK_EQ(df_backend_upload(gpu, a, x, (size_t)n * 4), 0);
        CHECK_EQ(df_backend_upload(gpu, b + 1, x, (size_t)n * 4), 0);
    }
    double g1 = df_cuda_sumsq(gpu, a, DF_DTYPE_F32, n);
    double g2 = df_cuda_sumsq(gpu, a, DF_DTYPE_F32, n);
    double g3 = df_cuda_sumsq(gpu, b + 1, DF_DTYPE_F32, n);
    double ref = df_op_sumsq(cpu, x, DF_DTYPE_F32, n);
    double bound = 2.0 * (double)n * ldexp(1.0, -53) * ref;
    if (n <= 1)
        bound = 0; /* one square, exact in double */
    int same = !memcmp(&g1, &g2, 8) && !memcmp(&g1, &g3, 8);
    int ok = g1 >= 0 && fabs(g1 - ref) <= bound && same;
    printf("  sumsq n=%-9lld gpu %.17g ref %.17g |diff| %.2e bound %.2e rerun + misaligned %s  %s\n",
           (long long)n, g1, ref, fabs(g1 - ref), bound, same ? "bitwise equal" : "DIFFER",
           ok ? "ok" : "FAIL");
    CHECK(ok);
    free(x);
    df_backend_free(gpu, a);
    df_backend_free(gpu, b);
}

/* BF16 x (bf16 numbers): aligned (8-byte loads of 4) and misaligned by
 * one element (scalar loads) on the GPU, and the F32 array of the same
 * values: all three the same bits; against the CPU (on the BF16 array) the
 * F32 rule. */
static void sumsq_bf16_case(int64_t n)
{
    uint16_t *x16 = xmalloc((size_t)n * 2 + 2);
    float *x = xmalloc((size_t)n * 4 + 4);
    for (int64_t i = 0; i < n; i++) {
        x16[i] = f2bf(rnd_from(&rng, 1e-2f));
        x[i] = bf2f(x16[i]);
    }
    float *a = df_backend_alloc(gpu, (size_t)n * 4 + 4);
    uint16_t *b = df_backend_alloc(gpu, (size_t)n * 2 + 4);
    CHECK(a && b);
    if (n) {
        CHECK_EQ(df_backend_upload(gpu, a, x, (size_t)n * 4), 0);
        CHECK_EQ(df_backend_upload(gpu, b, x16, (size_t)n * 2), 0);
    }
    double f32 = df_cuda_sumsq(gpu, a, DF_DTYPE_F32, n);
    double g1 = df_cuda_sumsq(gpu, b, DF_DTYPE_BF16, n);
    if (n) /* the same values one element in */
        CHECK_EQ(df_backend_upload(gpu, b + 1, x16, (size_t)n * 2), 0);
    double g2 = df_cuda_sumsq(gpu, b + 1, DF_DTYPE_BF16, n);
    double ref = df_op_sumsq(cpu, x16, DF_DTYPE_BF16, n);
    double bound = n <= 1 ? 0 : 2.0 * (double)n * ldexp(1.0, -53) * ref;
    int same = !memcmp(&f32, &g1, 8) && !memcmp(&f32, &g2, 8);
    int ok = g1 >= 0 && fabs(g1 - ref) <= bound && same;
    printf("  sumsq BF16 n=%-9lld gpu %.17g ref %.17g |diff| %.2e bound %.2e == F32 run, aligned "
           "and misaligned: %s  %s\n",
           (long long)n, g1, ref, fabs(g1 - ref), bound, same ? "bitwise" : "DIFFER",
           ok ? "ok" : "FAIL");
    CHECK(ok);
    free(x16), free(x);
    df_backend_free(gpu, a);
    df_backend_free(gpu, b);
}

static void test_sumsq(void)
{
    printf("sumsq (double: 2 n 2^-53 ref, exact for n <= 1; deterministic)\n");
    sumsq_case(0);
    sumsq_case(1);
    sumsq_case(16387);
    sumsq_case(10000000);
    sumsq_bf16_case(0);
    sumsq_bf16_case(1);
    sumsq_bf16_case(16387);
    sumsq_bf16_case(10000001);
}

int main(void)
{
    if (df_cuda_device_count() <= 0) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    df_err e;
    memset(&e, 0, sizeof e);
    gpu = df_backend_cuda_open(0, &e);
    if (!gpu) {
        if (e.code == -ENODEV) {
            printf("no CUDA device: skipped\n");
            return 77;
        }
        fprintf(stderr, "cuda backend: %s\n", e.msg);
        return 1;
    }
    cpu = df_backend_cpu_open(0, &e);
    if (!cpu) {
        fprintf(stderr, "cpu backend: %s\n", e.msg);
        df_backend_close(gpu);
        return 1;
    }
    test_rmsnorm_bwd();
    test_rope_bwd();
    test_swiglu_bwd();
    test_adamw();
    test_sumsq();
    df_backend_close(gpu);
    df_backend_close(cpu);
    return test_main_end();
}
