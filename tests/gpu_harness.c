/* gpu_harness.c - the GPU tests' shared harness (contracts in gpu_harness.h). */
#include "gpu_harness.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

df_backend *gh_gpu, *gh_cpu;

/* ---- backends ---- */

int gh_skip_without_gpu(void)
{
    if (df_backend_cuda_device_count() <= 0) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    return 0;
}

int gh_open(int cpu_threads)
{
    if (gh_skip_without_gpu())
        return 77;
    df_err e;
    memset(&e, 0, sizeof e);
    gh_gpu = df_backend_cuda_open(0, &e);
    if (!gh_gpu) {
        if (e.code == -ENODEV || e.code == -ENOTSUP) {
            printf("no CUDA device: skipped (%s)\n", e.msg);
            return 77;
        }
        fprintf(stderr, "cuda backend: %s\n", e.msg);
        return 1;
    }
    gh_cpu = df_backend_cpu_open(cpu_threads, &e);
    if (!gh_cpu) {
        fprintf(stderr, "cpu backend: %s\n", e.msg);
        df_backend_close(gh_gpu);
        gh_gpu = NULL;
        return 1;
    }
    return 0;
}

void gh_close(void)
{
    if (gh_cpu)
        df_backend_close(gh_cpu);
    if (gh_gpu)
        df_backend_close(gh_gpu);
    gh_cpu = gh_gpu = NULL;
}

/* ---- bf16, host memory ---- */

uint16_t gh_f2bf(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float gh_bf2f(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float gh_rb(float x) { return gh_bf2f(gh_f2bf(x)); }

void *gh_xmalloc(size_t n)
{
    void *p = calloc(n ? n : 1, 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* ---- random data ---- */

float gh_draw(gh_dist dist, uint64_t *rng, float scale)
{
    float v = test_randn(rng);
    if (dist == GH_N01_NZ && fabsf(v) < 0.05f)
        v = v < 0 ? -0.05f : 0.05f;
    return scale * v;
}

float *gh_rand_bf16(gh_dist dist, uint64_t *rng, int64_t n, float scale)
{
    float *p = gh_xmalloc((size_t)n * 4 + 4);
    for (int64_t i = 0; i < n; i++)
        p[i] = gh_rb(gh_draw(dist, rng, scale));
    return p;
}

/* ---- views ---- */

gh_view gh_vnd(int64_t off, int ndim, const int64_t *shape, const int64_t *stride)
{
    gh_view v;
    memset(&v, 0, sizeof v);
    v.off = off;
    v.ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        v.shape[d] = shape[d];
        v.stride[d] = stride[d];
    }
    return v;
}

gh_view gh_v1(int64_t n)
{
    int64_t sh[1] = {n}, st[1] = {1};
    return gh_vnd(0, 1, sh, st);
}

gh_view gh_v2(int64_t col0, int64_t rows, int64_t cols, int64_t ld)
{
    int64_t sh[2] = {rows, cols}, st[2] = {ld, 1};
    return gh_vnd(col0, 2, sh, st);
}

gh_view gh_v3(int64_t off, int64_t T, int64_t heads, int64_t D, int64_t ld)
{
    int64_t sh[3] = {T, heads, D}, st[3] = {ld, D, 1};
    return gh_vnd(off, 3, sh, st);
}

int64_t gh_view_len(gh_view v)
{
    int64_t e = v.off + 1;
    for (int d = 0; d < v.ndim; d++)
        e += (v.shape[d] - 1) * v.stride[d];
    return e;
}

int64_t gh_view_count(gh_view v)
{
    int64_t n = 1;
    for (int d = 0; d < v.ndim; d++)
        n *= v.shape[d];
    return n;
}

int64_t *gh_view_offsets(gh_view v, int64_t *n)
{
    *n = gh_view_count(v);
    int64_t *o = gh_xmalloc((size_t)*n * sizeof *o);
    for (int64_t i = 0; i < *n; i++) {
        int64_t r = i, off = v.off;
        for (int d = v.ndim - 1; d >= 0; d--) {
            off += (r % v.shape[d]) * v.stride[d];
            r /= v.shape[d];
        }
        o[i] = off;
    }
    return o;
}

/* ---- buffers ---- */

size_t gh_esz(const gh_buf *b) { return b->f32 ? 4 : 2; }

gh_buf gh_buf_new(int64_t n, int f32, size_t slack)
{
    gh_buf b = {n, f32, gh_xmalloc((size_t)n * 4), gh_xmalloc((size_t)n * (f32 ? 4 : 2)), NULL};
    b.d = df_backend_alloc(gh_gpu, (size_t)n * gh_esz(&b) + slack);
    if (!b.d) {
        fprintf(stderr, "device allocation of %lld elements failed\n", (long long)n);
        exit(2);
    }
    return b;
}

gh_buf gh_buf_rand(int64_t n, int f32, gh_dist dist, uint64_t *rng, float scale)
{
    gh_buf b = gh_buf_new(n, f32, 0);
    for (int64_t i = 0; i < n; i++)
        gh_buf_set(&b, i, gh_draw(dist, rng, scale));
    return b;
}

gh_buf gh_buf_rand_view(gh_view v, gh_dist dist, uint64_t *rng, uint64_t seed, float scale)
{
    gh_buf b = gh_buf_rand(gh_view_len(v), 0, dist, rng, scale);
    int64_t n, *o = gh_view_offsets(v, &n);
    uint64_t s = seed;
    for (int64_t i = 0; i < n; i++)
        gh_buf_set(&b, o[i], gh_draw(dist, &s, scale));
    free(o);
    return b;
}

void gh_buf_set(gh_buf *b, int64_t i, float v)
{
    if (b->f32) {
        b->h[i] = v;
        ((float *)b->img)[i] = v;
    } else {
        b->h[i] = gh_rb(v);
        ((uint16_t *)b->img)[i] = gh_f2bf(v);
    }
}

void gh_buf_upload(const gh_buf *b)
{
    CHECK_EQ(df_backend_upload(gh_gpu, b->d, b->img, (size_t)b->n * gh_esz(b)), 0);
}

void *gh_buf_download(const gh_buf *b)
{
    void *h = gh_xmalloc((size_t)b->n * gh_esz(b));
    CHECK_EQ(df_backend_download(gh_gpu, h, b->d, (size_t)b->n * gh_esz(b)), 0);
    return h;
}

void gh_buf_free(gh_buf *b)
{
    free(b->h);
    free(b->img);
    df_backend_free(gh_gpu, b->d);
    memset(b, 0, sizeof *b);
}

df_tensor gh_tens(const gh_buf *b, gh_view v, int on_gpu)
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
        t.data = (char *)b->d + v.off * (int64_t)gh_esz(b);
    } else {
        t.dtype = DF_DTYPE_F32;
        t.data = b->h + v.off;
    }
    return t;
}

void gh_poison(gh_buf *b, gh_view v)
{
    int64_t n, *o = gh_view_offsets(v, &n);
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

/* ---- flat device arrays ---- */

void *gh_dev_bf16(df_backend *be, const float *x, int64_t n)
{
    uint16_t *h = gh_xmalloc((size_t)n * 2 + 2);
    for (int64_t i = 0; i < n; i++)
        h[i] = gh_f2bf(x[i]);
    void *d = df_backend_alloc(be, (size_t)n * 2 + 2);
    int ok = d && df_backend_upload(be, d, h, (size_t)n * 2) == 0;
    CHECK(ok);
    free(h);
    if (d && !ok) {
        df_backend_free(be, d);
        d = NULL;
    }
    return d;
}

void *gh_dev_copy(df_backend *be, const void *x, size_t bytes)
{
    void *d = df_backend_alloc(be, bytes + 4);
    int ok = d && df_backend_upload(be, d, x, bytes) == 0;
    CHECK(ok);
    if (d && !ok) {
        df_backend_free(be, d);
        d = NULL;
    }
    return d;
}

/* The poison of n elements of t uploaded to d: the upload's code. */
static int poison_upload(df_backend *be, void *d, int64_t n, df_dtype t)
{
    size_t es = df_dtype_size(t);
    uint8_t *h = gh_xmalloc((size_t)n * es + 4);
    for (int64_t i = 0; i < n; i++) {
        if (t == DF_DTYPE_BF16) {
            ((uint16_t *)h)[i] = 0x7fc0;
        } else if (t == DF_DTYPE_I32) {
            ((int32_t *)h)[i] = GH_POISON_I32;
        } else {
            uint32_t nan = 0x7fc00000u;
            memcpy(h + (size_t)i * 4, &nan, 4);
        }
    }
    int rc = df_backend_upload(be, d, h, (size_t)n * es);
    free(h);
    return rc;
}

void gh_dev_poison(df_backend *be, void *d, int64_t n, df_dtype t)
{
    CHECK(poison_upload(be, d, n, t) == 0);
}

void *gh_dev_poisoned(df_backend *be, int64_t n, df_dtype t)
{
    void *d = df_backend_alloc(be, (size_t)n * df_dtype_size(t));
    CHECK(d && poison_upload(be, d, n, t) == 0);
    return d;
}

float *gh_download_bf16(df_backend *be, const void *d, int64_t n)
{
    uint16_t *h = gh_xmalloc((size_t)n * 2 + 2);
    float *f = gh_xmalloc((size_t)n * 4 + 4);
    CHECK(df_backend_download(be, h, d, (size_t)n * 2) == 0);
    for (int64_t i = 0; i < n; i++)
        f[i] = gh_bf2f(h[i]);
    free(h);
    return f;
}

/* ---- comparisons ---- */

static void diff_init(gh_diff *d)
{
    memset(d, 0, sizeof *d);
    d->worst = -1;
}

/* One pair into d; i is what d->worst reports, row the structural-zero row. */
static void diff_add(gh_diff *d, float got, float ref, int64_t i, int64_t row,
                     const gh_cmp_opts *o)
{
    d->n++;
    if (isfinite(ref)) { /* the bound's terms: the reference's alone */
        double r = fabs((double)gh_rb(ref) - ref);
        d->naive = r > d->naive ? r : d->naive;
        d->ref_max = fabs(ref) > d->ref_max ? fabs(ref) : d->ref_max;
    }
    if (o && o->zero_rows && o->zero_rows[row] && (got != 0.0f || ref != 0.0f)) {
        d->bad++;
        return;
    }
    if (isnan(got) || isnan(ref)) {
        d->nan++;
        return;
    }
    if (isinf(got) || isinf(ref)) {
        if (!(o && o->inf_equal && got == ref))
            d->bad++;
        return;
    }
    double e = fabs((double)got - ref);
    if (e > d->err || d->worst < 0) {
        if (e > d->err)
            d->err = e;
        d->worst = i, d->worst_got = got, d->worst_ref = ref;
    }
}

void gh_diff_f32(gh_diff *d, const float *got, const float *ref, int64_t n,
                 const gh_cmp_opts *opts)
{
    diff_init(d);
    int64_t cols = opts && opts->zero_rows && opts->cols > 0 ? opts->cols : 1;
    for (int64_t i = 0; i < n; i++)
        diff_add(d, got[i], ref[i], i, i / cols, opts);
}

int gh_view_diff(const gh_buf *b, gh_view v, const gh_view *also, const gh_cmp_opts *opts,
                 gh_diff *d, int64_t *touched)
{
    size_t es = gh_esz(b);
    char *got = gh_xmalloc((size_t)b->n * es);
    int rc = df_backend_download(gh_gpu, got, b->d, (size_t)b->n * es);
    CHECK_EQ(rc, 0);
    uint8_t *in = gh_xmalloc((size_t)b->n);
    if (also) {
        int64_t na, *oa = gh_view_offsets(*also, &na);
        for (int64_t i = 0; i < na; i++)
            in[oa[i]] = 1;
        free(oa);
    }
    int64_t n, *o = gh_view_offsets(v, &n);
    int64_t cols = opts && opts->zero_rows && opts->cols > 0 ? opts->cols : 1;
    diff_init(d);
    for (int64_t i = 0; i < n; i++) {
        int64_t off = o[i];
        in[off] = 1;
        float g = b->f32 ? ((float *)got)[off] : gh_bf2f(((uint16_t *)got)[off]);
        diff_add(d, g, b->h[off], off, i / cols, opts);
    }
    if (touched) {
        *touched = 0;
        for (int64_t i = 0; i < b->n; i++)
            if (!in[i] && memcmp(got + i * es, (char *)b->img + i * es, es))
                (*touched)++;
    }
    free(o);
    free(in);
    free(got);
    return rc;
}

double gh_naive_bound(const gh_diff *d) { return 2.0 * d->naive + 1e-6 * d->ref_max; }

int gh_diff_ok(const gh_diff *d, double tol)
{
    return d->nan == 0 && d->bad == 0 && d->err <= tol;
}

void gh_diff_report(const char *name, const gh_diff *d, double tol)
{
    fprintf(stderr, "%s: %lld compared, %lld with a NaN, %lld bad (an infinity, or not 0 "
            "where 0 is structural)",
            name, (long long)d->n, (long long)d->nan, (long long)d->bad);
    if (d->worst >= 0)
        fprintf(stderr, "; worst at [%lld]: got %.9g, want %.9g, |diff| %.3e, tolerance %.3e",
                (long long)d->worst, d->worst_got, d->worst_ref, d->err, tol);
    fprintf(stderr, "\n");
}

int gh_expect(const char *name, const gh_diff *d, double tol)
{
    int ok = gh_diff_ok(d, tol);
    if (!ok) {
        gh_diff_report(name, d, tol);
        df_test_failures++;
    }
    return ok;
}

int gh_check_view(const char *name, const gh_buf *b, gh_view v, const gh_view *also)
{
    gh_diff d;
    int64_t touched = 0;
    int rc = gh_view_diff(b, v, also, NULL, &d, &touched);
    double bound = gh_naive_bound(&d);
    int ok = rc == 0 && touched == 0 && gh_diff_ok(&d, bound);
    printf("%-52s err %.3e  naive %.3e  bound %.3e  %s\n", name, d.err, d.naive, bound,
           ok ? "ok" : "FAIL");
    if (!ok) {
        gh_diff_report(name, &d, bound);
        fprintf(stderr, "%s: download rc %d, %lld written outside the view\n", name, rc,
                (long long)touched);
        df_test_failures++;
    }
    return ok;
}

int gh_bf16_close(uint16_t a, uint16_t b, double tol, int64_t *cancel)
{
    float fa = gh_bf2f(a), fb = gh_bf2f(b);
    if (!isfinite(fa) || !isfinite(fb))
        return 0;
    if (tol < 0.5 * test_bf16_ulp(fb))
        return test_bf16_dist(a, b) <= 1;
    (*cancel)++;
    return fabs((double)fa - fb) <= tol + 0.5 * (test_bf16_ulp(fa) + test_bf16_ulp(fb));
}

double gh_l2(const float *a, const float *b, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - (b ? (double)b[i] : 0.0);
        s += d * d;
    }
    return sqrt(s);
}

/* ---- timing ---- */

double gh_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int cmp_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

float gh_median_f(float *x, int n)
{
    qsort(x, (size_t)n, sizeof *x, cmp_f);
    return x[n / 2];
}

double gh_median(double *x, int n)
{
    qsort(x, (size_t)n, sizeof *x, cmp_d);
    return x[n / 2];
}
