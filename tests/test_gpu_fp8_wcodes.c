/* test_gpu_fp8_wcodes - the weights' E4M3 codes kept by AdamW
 * (df_backend_fp8_keep_weight_codes) on the CUDA backend. Skips (77) without a GPU; on a GPU
 * without verified E4M3 tensor cores it checks that nothing is kept.
 *  - AdamW over a flat array holding kept weights, vectors between them and a kept weight it
 *    covers in part: master, moments and BF16 weights bitwise those of the same AdamW on a
 *    copy with nothing kept (F32 or BF16 moments, F32 or BF16 gradients, two steps);
 *  - the kept codes and scales, both layouts, bitwise the rounding kernels' on the weights;
 *    only the weights covered whole are ready;
 *  - the forward and input-gradient GEMMs on a ready weight take its codes, bitwise the
 *    GEMMs that round it;
 *  - an upload into a weight, an AdamW whose arrays are not 16-byte aligned and any free make
 *    its codes not ready (the GEMMs round again, the same bits);
 *  - what is not kept: a misaligned or strided view, another view of a kept weight;
 *  - dropping them (df_backend_fp8_drop_weight_codes) frees them, and they can be kept again;
 *  - DFLASH_FP8_LAZY_BF16: AdamW leaves the kept weights' BF16 values out (stale; the GEMMs
 *    take the codes and leave them so); a download, a copy, the BF16 GEMM or an upload into
 *    half the weight first writes them from the master: bitwise the eager AdamW's. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/fp8_cuda.h"
#include "gpu_harness.h"
#include "knobs.h"
#include "ops.h"
#include "train_ops.h"
#include "uf16.h"

static uint64_t rng = 31;

/* The flat array: vectors between matrices, as a drafter's parameters lie */
enum { NMAT = 3 };
static const int64_t mat_rows[NMAT] = {256, 128, 384}, mat_cols[NMAT] = {384, 512, 128};
static int64_t mat_off[NMAT], n_all, n_split;

static void layout(void)
{
    int64_t at = 64; /* a norm's 64 */
    for (int i = 0; i < NMAT; i++) {
        mat_off[i] = at;
        at += mat_rows[i] * mat_cols[i] + (i == 1 ? 96 : 128);
    }
    n_all = at + 100;
    /* the first AdamW call ends inside the last matrix: that one is covered in part twice */
    n_split = mat_off[2] + 20000;
}

static void *dl(const void *d, size_t bytes)
{
    void *h = gh_xmalloc(bytes);
    CHECK_EQ(df_backend_download(gh_gpu, h, d, bytes), 0);
    return h;
}

static int64_t bytes_differ(const void *da, const void *db, size_t bytes)
{
    uint8_t *a = dl(da, bytes), *b = dl(db, bytes);
    int64_t d = 0;
    for (size_t i = 0; i < bytes; i++)
        d += a[i] != b[i];
    free(a), free(b);
    return d;
}

/* One copy of the optimizer's arrays (F32-sized m and v: BF16 ones in their first half) */
typedef struct opt_arrays {
    float *p, *m, *v;
    void *g;
    uint16_t *w;
} opt_arrays;

static df_tensor wview(const opt_arrays *o, int i)
{
    return df_tensor_2d(o->w + mat_off[i], DF_DTYPE_BF16, mat_rows[i], mat_cols[i]);
}

static int ready(const opt_arrays *o, int i)
{
    df_tensor t = wview(o, i);
    return df_cuda_fp8_wcodes_of(gh_gpu, &t) != NULL;
}

/* Whether weight i of o is kept with its BF16 values left out (ready and stale) */
static int stale(const opt_arrays *o, int i)
{
    df_tensor t = wview(o, i);
    const df_cuda_fp8_wcodes *kw = df_cuda_fp8_wcodes_of(gh_gpu, &t);
    return kw && kw->stale;
}

/* AdamW over [lo, hi) of o's arrays with the variant's moments and gradient dtypes */
static int adam(const opt_arrays *o, int64_t lo, int64_t hi, int m16, int v16, int g32,
                int64_t step)
{
    size_t ge = g32 ? 4 : 2;
    void *g = (uint8_t *)o->g + lo * (int64_t)ge;
    df_dtype gdt = g32 ? DF_DTYPE_F32 : DF_DTYPE_BF16;
    if (!m16)
        return df_op_adamw(gh_gpu, o->p + lo, g, gdt, o->m + lo, o->v + lo, hi - lo, 1e-3f, 0.9f,
                           0.999f, 1e-8f, 0.01f, step, 0.5f, o->w + lo);
    void *v = v16 ? (void *)((uint16_t *)o->v + lo) : (void *)(o->v + lo);
    return df_op_adamw_m16(gh_gpu, o->p + lo, g, gdt, (uint16_t *)o->m + lo, v,
                           v16 == 2 ? DF_DTYPE_UF16 : v16 ? DF_DTYPE_BF16 : DF_DTYPE_F32, hi - lo, 1e-3f, 0.9f, 0.999f, 1e-8f,
                           0.01f, step, 0.5f, 0x1234567ull + (uint64_t)step, lo, o->w + lo);
}

/* The same initial state in both copies: master and weights (its BF16), moments, gradient */
static void fill(opt_arrays *a, opt_arrays *b, int m16, int v16, int g32)
{
    float *p = gh_xmalloc((size_t)n_all * 4), *m = gh_xmalloc((size_t)n_all * 4),
          *v = gh_xmalloc((size_t)n_all * 4), *g = gh_xmalloc((size_t)n_all * 4);
    uint16_t *w = gh_xmalloc((size_t)n_all * 2), *g16 = gh_xmalloc((size_t)n_all * 2);
    uint16_t *m_16 = gh_xmalloc((size_t)n_all * 2), *v_16 = gh_xmalloc((size_t)n_all * 2);
    for (int64_t i = 0; i < n_all; i++) {
        p[i] = gh_draw(GH_N01, &rng, 0.05f);
        m[i] = gh_draw(GH_N01, &rng, 1e-3f);
        v[i] = 1e-6f * (1.0f + fabsf(gh_draw(GH_N01, &rng, 1.0f)));
        g[i] = gh_rb(gh_draw(GH_N01, &rng, 1e-2f));
        w[i] = gh_f2bf(p[i]), g16[i] = gh_f2bf(g[i]), m_16[i] = gh_f2bf(m[i]);
        v_16[i] = v16 == 2 ? df_f32_to_uf16(v[i]) : gh_f2bf(v[i]);
    }
    /* a block of large weights, so that blocks' scales differ */
    for (int64_t i = mat_off[0]; i < mat_off[0] + 128 * 384; i += 7)
        p[i] *= 300.0f, w[i] = gh_f2bf(p[i]);
    opt_arrays *o[2] = {a, b};
    for (int k = 0; k < 2; k++) {
        CHECK_EQ(df_backend_upload(gh_gpu, o[k]->p, p, (size_t)n_all * 4), 0);
        CHECK_EQ(df_backend_upload(gh_gpu, o[k]->m, m16 ? (void *)m_16 : (void *)m,
                                   (size_t)n_all * (m16 ? 2 : 4)), 0);
        CHECK_EQ(df_backend_upload(gh_gpu, o[k]->v, v16 ? (void *)v_16 : (void *)v,
                                   (size_t)n_all * (v16 ? 2 : 4)), 0);
        CHECK_EQ(df_backend_upload(gh_gpu, o[k]->g, g32 ? (void *)g : (void *)g16,
                                   (size_t)n_all * (g32 ? 4 : 2)), 0);
        CHECK_EQ(df_backend_upload(gh_gpu, o[k]->w, w, (size_t)n_all * 2), 0);
    }
    free(p), free(m), free(v), free(g), free(w), free(g16), free(m_16), free(v_16);
}

/* Every array of a and b bitwise the same */
static void same_state(const opt_arrays *a, const opt_arrays *b, const char *what)
{
    int64_t d[4] = {bytes_differ(a->p, b->p, (size_t)n_all * 4),
                    bytes_differ(a->m, b->m, (size_t)n_all * 4),
                    bytes_differ(a->v, b->v, (size_t)n_all * 4),
                    bytes_differ(a->w, b->w, (size_t)n_all * 2)};
    if (d[0] || d[1] || d[2] || d[3])
        fprintf(stderr, "%s: bytes differ: master %lld, m %lld, v %lld, weights %lld\n", what,
                (long long)d[0], (long long)d[1], (long long)d[2], (long long)d[3]);
    CHECK(!d[0] && !d[1] && !d[2] && !d[3]);
}

/* Device memory freed at the end of a variant (a free makes every kept weight not ready) */
static void *to_free[1024];
static int n_free;

static void later(void **p, int n)
{
    for (int i = 0; i < n; i++)
        if (n_free < 1024)
            to_free[n_free++] = p[i];
}

/* Kept weight i's codes and scales, both layouts, against the rounding kernels' on its
 * current BF16 values */
static void check_codes(const opt_arrays *o, int i)
{
    df_tensor t = wview(o, i);
    const df_cuda_fp8_wcodes *kw = df_cuda_fp8_wcodes_of(gh_gpu, &t);
    CHECK(kw != NULL);
    if (!kw)
        return;
    int64_t R = mat_rows[i], C = mat_cols[i];
    for (int tr = 0; tr < 2; tr++) {
        int64_t rows = tr ? C : R, kp = tr ? R : C, nsc = rows / 128 * ((kp / 128 + 3) / 4 * 4);
        uint8_t *q = df_backend_alloc(gh_gpu, (size_t)(rows * kp));
        float *sc = df_backend_alloc(gh_gpu, (size_t)nsc * 4);
        CHECK(q && sc);
        CHECK_EQ(df_backend_zero(gh_gpu, sc, (size_t)nsc * 4), 0);
        CHECK_EQ(df_cuda_fp8_round_codes(gh_gpu, tr ? 3 : 2, &t, q, kp, sc, rows), 0);
        int64_t dc = bytes_differ(q, tr ? kw->bwx : kw->fwd, (size_t)(rows * kp));
        int64_t ds = bytes_differ(sc, tr ? kw->bwx_scales : kw->fwd_scales, (size_t)nsc * 4);
        if (dc || ds)
            fprintf(stderr, "weight %d layout %d: %lld code bytes, %lld scale bytes differ\n", i,
                    tr, (long long)dc, (long long)ds);
        CHECK(!dc && !ds);
        void *f[2] = {q, sc};
        later(f, 2);
    }
}

/* The forward and input-gradient GEMMs on weight i of a (kept: want_kept says whether its
 * codes are ready) and of b (not kept): bitwise the same; whether a's took the codes */
static void check_gemms(const opt_arrays *a, const opt_arrays *b, int i, int want_kept,
                        void **scratch)
{
    const int64_t M = 96, N = mat_rows[i], K = mat_cols[i];
    float *x = gh_rand_bf16(GH_N01, &rng, M * K, 1.0f), *dy = gh_rand_bf16(GH_N01, &rng, M * N, 1.0f);
    void *dx_ = gh_dev_bf16(gh_gpu, x, M * K), *ddy = gh_dev_bf16(gh_gpu, dy, M * N);
    void *o[4];
    for (int k = 0; k < 4; k++)
        o[k] = gh_dev_poisoned(gh_gpu, M * (k < 2 ? N : K), DF_DTYPE_BF16);
    df_tensor tx = df_tensor_2d(dx_, DF_DTYPE_BF16, M, K), tdy = df_tensor_2d(ddy, DF_DTYPE_BF16, M, N);
    df_tensor wa = wview(a, i), wb = wview(b, i);
    df_tensor y[2] = {df_tensor_2d(o[0], DF_DTYPE_BF16, M, N), df_tensor_2d(o[1], DF_DTYPE_BF16, M, N)};
    df_tensor d[2] = {df_tensor_2d(o[2], DF_DTYPE_BF16, M, K), df_tensor_2d(o[3], DF_DTYPE_BF16, M, K)};
    int64_t used0 = df_cuda_fp8_wcodes_used();
    CHECK_EQ(df_op_matmul_fp8(gh_gpu, DF_GEMM_FWD, &tx, &wa, &y[0], 0), 0);
    CHECK_EQ(df_op_matmul_fp8(gh_gpu, DF_GEMM_FWD, &tx, &wb, &y[1], 0), 0);
    CHECK_EQ(df_op_matmul_fp8(gh_gpu, DF_GEMM_BWD_X, &tdy, &wa, &d[0], 0), 0);
    CHECK_EQ(df_op_matmul_fp8(gh_gpu, DF_GEMM_BWD_X, &tdy, &wb, &d[1], 0), 0);
    int64_t took = df_cuda_fp8_wcodes_used() - used0;
    if (took != (want_kept ? 2 : 0))
        fprintf(stderr, "weight %d: %lld GEMMs took kept codes, want %d\n", i, (long long)took,
                want_kept ? 2 : 0);
    CHECK_EQ(took, want_kept ? 2 : 0);
    CHECK_EQ(bytes_differ(o[0], o[1], (size_t)(M * N) * 2), 0);
    CHECK_EQ(bytes_differ(o[2], o[3], (size_t)(M * K) * 2), 0);
    /* not zeros: the products are there */
    float *got = gh_download_bf16(gh_gpu, o[0], M * N);
    int nz = 0;
    for (int64_t j = 0; j < M * N; j++)
        nz += got[j] != 0.0f && isfinite(got[j]);
    CHECK(nz > M * N / 2);
    free(got), free(x), free(dy);
    scratch[0] = dx_, scratch[1] = ddy;
    for (int k = 0; k < 4; k++)
        scratch[2 + k] = o[k];
}

/* One variant: moments F32 (m16 0), m BF16 (1), m and v BF16 (m16 1, v16 1), m BF16 and v
 * UF16 (m16 1, v16 2); gradients BF16 or F32 */
static void check_variant(opt_arrays *a, opt_arrays *b, int m16, int v16, int g32)
{
    fill(a, b, m16, v16, g32);
    for (int i = 0; i < NMAT; i++)
        CHECK(!ready(a, i)); /* uploads: not ready */
    for (int64_t step = 1; step <= 2; step++) {
        CHECK_EQ(adam(a, 0, n_split, m16, v16, g32, step), 0);
        CHECK_EQ(adam(a, n_split, n_all, m16, v16, g32, step), 0);
        CHECK_EQ(adam(b, 0, n_split, m16, v16, g32, step), 0);
        CHECK_EQ(adam(b, n_split, n_all, m16, v16, g32, step), 0);
        char what[96];
        snprintf(what, sizeof what, "adamw m16 %d v16 %d grad %s step %lld", m16, v16,
                 g32 ? "F32" : "BF16", (long long)step);
        same_state(a, b, what);
        CHECK(ready(a, 0) && ready(a, 1) && !ready(a, 2) && !ready(b, 0));
        check_codes(a, 0);
        check_codes(a, 1);
        void *s[6];
        check_gemms(a, b, 0, 1, s);
        later(s, 6);
        check_gemms(a, b, 2, 0, s);
        later(s, 6);
    }
    /* an upload into weight 1: not ready, and the GEMMs round it (the same bits) */
    float *nw = gh_rand_bf16(GH_N01, &rng, mat_rows[1] * mat_cols[1], 0.1f);
    uint16_t *h = gh_xmalloc((size_t)(mat_rows[1] * mat_cols[1]) * 2);
    for (int64_t j = 0; j < mat_rows[1] * mat_cols[1]; j++)
        h[j] = gh_f2bf(nw[j]);
    CHECK_EQ(df_backend_upload(gh_gpu, a->w + mat_off[1], h, (size_t)(mat_rows[1] * mat_cols[1]) * 2), 0);
    CHECK_EQ(df_backend_upload(gh_gpu, b->w + mat_off[1], h, (size_t)(mat_rows[1] * mat_cols[1]) * 2), 0);
    CHECK(!ready(a, 1) && ready(a, 0));
    void *s[6];
    check_gemms(a, b, 1, 0, s);
    later(s, 6);
    free(nw), free(h);
    /* an AdamW whose arrays start 8 bytes past 16-byte alignment: the flat kernel, nothing ready */
    CHECK_EQ(adam(a, 4, n_all, m16, v16, g32, 3), 0);
    CHECK_EQ(adam(b, 4, n_all, m16, v16, g32, 3), 0);
    same_state(a, b, "adamw, arrays 8-byte aligned");
    CHECK(!ready(a, 0) && !ready(a, 1));
    /* and the next aligned one makes them ready again */
    CHECK_EQ(adam(a, 0, n_all, m16, v16, g32, 4), 0);
    CHECK_EQ(adam(b, 0, n_all, m16, v16, g32, 4), 0);
    same_state(a, b, "adamw, whole range");
    CHECK(ready(a, 0) && ready(a, 1) && ready(a, 2));
    check_codes(a, 2);
    check_gemms(a, b, 2, 1, s);
    later(s, 6);
    /* a free anywhere: nothing ready */
    for (int i = 0; i < n_free; i++)
        df_backend_free(gh_gpu, to_free[i]);
    n_free = 0;
    CHECK(!ready(a, 0) && !ready(a, 1) && !ready(a, 2));
}

/* DFLASH_FP8_LAZY_BF16 (m in BF16, BF16 gradients): a's kept weights stale after each
 * AdamW, b (nothing kept) written eagerly; every read of a's weights sees b's bits */
static void check_lazy(opt_arrays *a, opt_arrays *b)
{
    df_knob_set(DF_KNOB_FP8_LAZY_BF16, "1");
    fill(a, b, 1, 0, 0);
    void *s[6];
    for (int64_t step = 1; step <= 2; step++) {
        CHECK_EQ(adam(a, 0, n_split, 1, 0, 0, step), 0);
        CHECK_EQ(adam(a, n_split, n_all, 1, 0, 0, step), 0);
        CHECK_EQ(adam(b, 0, n_split, 1, 0, 0, step), 0);
        CHECK_EQ(adam(b, n_split, n_all, 1, 0, 0, step), 0);
        CHECK(stale(a, 0) && stale(a, 1) && !ready(a, 2)); /* weight 2: in part, written */
        check_gemms(a, b, 0, 1, s); /* on the codes: nothing read, still stale */
        later(s, 6);
        CHECK(stale(a, 0));
        same_state(a, b, step == 1 ? "lazy, step 1" : "lazy, step 2"); /* downloads */
        CHECK(ready(a, 0) && !stale(a, 0) && !stale(a, 1));
        check_codes(a, 0);
    }
    /* an upload into half of a stale weight: the other half the master's values */
    CHECK_EQ(adam(a, 0, n_all, 1, 0, 0, 3), 0);
    CHECK_EQ(adam(b, 0, n_all, 1, 0, 0, 3), 0);
    CHECK(stale(a, 0) && stale(a, 1) && stale(a, 2));
    const int64_t half = mat_rows[0] / 2 * mat_cols[0];
    float *nw = gh_rand_bf16(GH_N01, &rng, half, 0.1f);
    uint16_t *h = gh_xmalloc((size_t)half * 2);
    for (int64_t j = 0; j < half; j++)
        h[j] = gh_f2bf(nw[j]);
    CHECK_EQ(df_backend_upload(gh_gpu, a->w + mat_off[0], h, (size_t)half * 2), 0);
    CHECK_EQ(df_backend_upload(gh_gpu, b->w + mat_off[0], h, (size_t)half * 2), 0);
    CHECK(!ready(a, 0) && stale(a, 1));
    /* a copy out of a stale weight, and the BF16 GEMM on another */
    const size_t wb1 = (size_t)(mat_rows[1] * mat_cols[1]) * 2;
    void *c1 = df_backend_alloc(gh_gpu, wb1), *c2 = df_backend_alloc(gh_gpu, wb1);
    CHECK(c1 && c2);
    CHECK_EQ(df_backend_copy(gh_gpu, c1, a->w + mat_off[1], wb1), 0);
    CHECK_EQ(df_backend_copy(gh_gpu, c2, b->w + mat_off[1], wb1), 0);
    CHECK(!stale(a, 1) && ready(a, 1));
    CHECK_EQ(bytes_differ(c1, c2, wb1), 0);
    const int64_t M = 64, N = mat_rows[2], K = mat_cols[2];
    float *x = gh_rand_bf16(GH_N01, &rng, M * K, 1.0f);
    void *dx = gh_dev_bf16(gh_gpu, x, M * K);
    void *y[2] = {gh_dev_poisoned(gh_gpu, M * N, DF_DTYPE_BF16), gh_dev_poisoned(gh_gpu, M * N, DF_DTYPE_BF16)};
    df_tensor tx = df_tensor_2d(dx, DF_DTYPE_BF16, M, K), w2a = wview(a, 2), w2b = wview(b, 2);
    df_tensor ty[2] = {df_tensor_2d(y[0], DF_DTYPE_BF16, M, N), df_tensor_2d(y[1], DF_DTYPE_BF16, M, N)};
    CHECK(stale(a, 2));
    CHECK_EQ(df_op_matmul(gh_gpu, &tx, &w2a, &ty[0], 0), 0);
    CHECK(!stale(a, 2));
    CHECK_EQ(df_op_matmul(gh_gpu, &tx, &w2b, &ty[1], 0), 0);
    CHECK_EQ(bytes_differ(y[0], y[1], (size_t)(M * N) * 2), 0);
    same_state(a, b, "lazy: an upload into half a stale weight, a copy, a BF16 GEMM");
    free(nw), free(h), free(x);
    void *f[5] = {c1, c2, dx, y[0], y[1]};
    later(f, 5);
    /* a free with weights stale: their values written first */
    CHECK_EQ(adam(a, 0, n_all, 1, 0, 0, 4), 0);
    CHECK_EQ(adam(b, 0, n_all, 1, 0, 0, 4), 0);
    CHECK(stale(a, 1));
    for (int i = 0; i < n_free; i++)
        df_backend_free(gh_gpu, to_free[i]);
    n_free = 0;
    CHECK(!ready(a, 1));
    same_state(a, b, "lazy: a free");
    df_knob_set(DF_KNOB_FP8_LAZY_BF16, "0");
}

int main(void)
{
    int rc = gh_open(0);
    if (rc)
        return rc;
    layout();
    opt_arrays a, b;
    opt_arrays *o[2] = {&a, &b};
    for (int k = 0; k < 2; k++) {
        o[k]->p = df_backend_alloc(gh_gpu, (size_t)n_all * 4);
        o[k]->m = df_backend_alloc(gh_gpu, (size_t)n_all * 4);
        o[k]->v = df_backend_alloc(gh_gpu, (size_t)n_all * 4);
        o[k]->g = df_backend_alloc(gh_gpu, (size_t)n_all * 4);
        o[k]->w = df_backend_alloc(gh_gpu, (size_t)n_all * 2);
        CHECK(o[k]->p && o[k]->m && o[k]->v && o[k]->g && o[k]->w);
    }
    if (!df_backend_fp8_tensor_cores(gh_gpu)) {
        df_tensor t = wview(&a, 0);
        CHECK_EQ(df_backend_fp8_keep_weight_codes(gh_gpu, &t), 0);
        printf("no verified E4M3 tensor cores: nothing kept (checked)\n");
        gh_close();
        return test_main_end();
    }
    /* what is kept: the three matrices of a; not: a view 8 bytes off, a strided view, rows
     * that are not a multiple of 128, another view of kept memory; keeping again: 1 */
    df_tensor bad = df_tensor_2d(a.w + mat_off[0] + 4, DF_DTYPE_BF16, 128, 128);
    CHECK_EQ(df_backend_fp8_keep_weight_codes(gh_gpu, &bad), 0);
    bad = df_tensor_2d(a.w + mat_off[0], DF_DTYPE_BF16, 128, 128);
    bad.stride[0] = 384;
    CHECK_EQ(df_backend_fp8_keep_weight_codes(gh_gpu, &bad), 0);
    bad = df_tensor_2d(a.w + mat_off[1], DF_DTYPE_BF16, 100, 512);
    CHECK_EQ(df_backend_fp8_keep_weight_codes(gh_gpu, &bad), 0);
    for (int i = 0; i < NMAT; i++) {
        df_tensor t = wview(&a, i);
        CHECK_EQ(df_backend_fp8_keep_weight_codes(gh_gpu, &t), 1);
    }
    df_tensor part = df_tensor_2d(a.w + mat_off[0], DF_DTYPE_BF16, 128, 384);
    CHECK_EQ(df_backend_fp8_keep_weight_codes(gh_gpu, &part), 0);
    df_tensor again = wview(&a, 0);
    CHECK_EQ(df_backend_fp8_keep_weight_codes(gh_gpu, &again), 1);
    int kept;
    size_t kbytes;
    df_cuda_fp8_wcodes_count(gh_gpu, &kept, &kbytes);
    CHECK_EQ(kept, NMAT);
    check_variant(&a, &b, 1, 0, 0);
    check_variant(&a, &b, 1, 1, 0);
    check_variant(&a, &b, 1, 2, 0);
    check_variant(&a, &b, 0, 0, 0);
    check_variant(&a, &b, 1, 0, 1);
    check_lazy(&a, &b);
    /* DFLASH_FP8_WEIGHT_CODES=0: nothing more kept */
    df_knob_set(DF_KNOB_FP8_WEIGHT_CODES, "0");
    df_tensor t = wview(&b, 0);
    CHECK_EQ(df_backend_fp8_keep_weight_codes(gh_gpu, &t), 0);
    df_knob_set(DF_KNOB_FP8_WEIGHT_CODES, "1");
    /* dropped: nothing kept, and a's weights can be kept again */
    df_backend_fp8_drop_weight_codes(gh_gpu, a.w, (size_t)n_all * 2);
    df_cuda_fp8_wcodes_count(gh_gpu, &kept, &kbytes);
    CHECK_EQ(kept, 0);
    CHECK_EQ(kbytes, 0);
    t = wview(&a, 1);
    CHECK_EQ(df_backend_fp8_keep_weight_codes(gh_gpu, &t), 1);
    df_backend_fp8_drop_weight_codes(gh_gpu, a.w, (size_t)n_all * 2);
    for (int k = 0; k < 2; k++) {
        df_backend_free(gh_gpu, o[k]->p), df_backend_free(gh_gpu, o[k]->m);
        df_backend_free(gh_gpu, o[k]->v), df_backend_free(gh_gpu, o[k]->g);
        df_backend_free(gh_gpu, o[k]->w);
    }
    gh_close();
    return test_main_end();
}
