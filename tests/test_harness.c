/* test_harness - the GPU tests' harness (gpu_harness.h) itself, in every
 * build: views and their offsets, bf16 rounding, the random streams (the
 * same draws as test.h's), buffers and their device round trip, poison,
 * and that the comparisons pass what they should and fail (counted, with
 * the worst element) what they should. Without a GPU a second CPU backend
 * stands in for the device (gh_open's skip is checked first); with one,
 * the buffers live on it. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_harness.h"

/* Runs one comparison that must fail: it must count exactly one failure
 * (taken back so the test itself passes). */
#define EXPECT_FAIL(expr)                                                                   \
    do {                                                                                    \
        int before_ = df_test_failures;                                                     \
        int r_ = (expr);                                                                    \
        int counted_ = df_test_failures - before_;                                          \
        df_test_failures = before_;                                                         \
        CHECK(!r_);                                                                         \
        CHECK_EQ(counted_, 1);                                                              \
    } while (0)

static void test_views(void)
{
    gh_view v = gh_v2(3, 4, 5, 9);
    CHECK_EQ(gh_view_count(v), 20);
    CHECK_EQ(gh_view_len(v), 3 + 3 * 9 + 4 + 1);
    int64_t n, *o = gh_view_offsets(v, &n);
    CHECK_EQ(n, 20);
    CHECK_EQ(o[0], 3);
    CHECK_EQ(o[4], 7);
    CHECK_EQ(o[5], 12);
    CHECK_EQ(o[19], 3 + 27 + 4);
    free(o);
    gh_view w = gh_v3(8, 2, 3, 4, 20); /* [2, 3, 4] heads of 4 in rows of 20 */
    o = gh_view_offsets(w, &n);
    CHECK_EQ(n, 24);
    CHECK_EQ(o[4], 12);
    CHECK_EQ(o[12], 28);
    CHECK_EQ(gh_view_len(w), 8 + 20 + 8 + 3 + 1);
    free(o);
    int64_t sh[4] = {2, 2, 2, 2}, st[4] = {100, 30, 7, 1};
    gh_view x = gh_vnd(1, 4, sh, st);
    o = gh_view_offsets(x, &n);
    CHECK_EQ(n, 16);
    CHECK_EQ(o[15], 1 + 100 + 30 + 7 + 1);
    CHECK_EQ(gh_view_len(x), o[15] + 1);
    free(o);
    CHECK_EQ(gh_view_count(gh_v1(7)), 7);
}

static void test_bf16(void)
{
    CHECK_EQ(gh_f2bf(1.0f), 0x3f80);
    CHECK_EQ(gh_f2bf(-2.0f), 0xc000);
    CHECK_EQ(gh_f2bf(NAN), 0x7fc0);
    CHECK_EQ(gh_f2bf(-NAN), 0x7fc0);
    CHECK_EQ(gh_f2bf(INFINITY), 0x7f80);
    /* ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 */
    CHECK_EQ(gh_f2bf(1.0f + 0x1p-8f), 0x3f80);
    CHECK_EQ(gh_f2bf(1.0f + 3 * 0x1p-8f), 0x3f82);
    CHECK(gh_rb(1.0f + 0x1p-9f) == 1.0f);
    CHECK(gh_bf2f(0x4040) == 3.0f);
}

static void test_random(void)
{
    uint64_t a = 77, b = 77;
    for (int i = 0; i < 100; i++)
        CHECK(gh_draw(GH_N01, &a, 2.5f) == 2.5f * test_randn(&b));
    CHECK(a == b);
    int clamped = 0, small = 0;
    for (int i = 0; i < 20000; i++) {
        float v = gh_draw(GH_N01_NZ, &a, 3.0f), u = test_randn(&b);
        small += fabsf(v) < 0.15f;
        clamped += fabsf(v) == 0.15f;
        CHECK(fabsf(u) < 0.05f ? v == (u < 0 ? -0.15f : 0.15f) : v == 3.0f * u);
    }
    CHECK_EQ(small, 0);
    CHECK(clamped > 100);
    uint64_t c = 9, d = 9;
    float *p = gh_rand_bf16(GH_N01, &c, 50, 0.5f);
    for (int i = 0; i < 50; i++)
        CHECK(p[i] == gh_rb(0.5f * test_randn(&d)));
    free(p);
}

/* A perfect bf16 "kernel": the device copy of view v becomes the bf16 of the
 * host copy (which the reference filled), the rest stays as uploaded. */
static void fake_op(const gh_buf *b, gh_view v, void *img)
{
    int64_t n, *o = gh_view_offsets(v, &n);
    for (int64_t i = 0; i < n; i++) {
        if (b->f32)
            ((float *)img)[o[i]] = b->h[o[i]];
        else
            ((uint16_t *)img)[o[i]] = gh_f2bf(b->h[o[i]]);
    }
    free(o);
    CHECK_EQ(df_backend_upload(gh_gpu, b->d, img, (size_t)b->n * gh_esz(b)), 0);
}

static void test_buffers(void)
{
    uint64_t rng = 5, same = 5;
    gh_buf b = gh_buf_rand(100, 0, GH_N01, &rng, 2.0f);
    for (int i = 0; i < 100; i++) {
        float v = 2.0f * test_randn(&same);
        CHECK(b.h[i] == gh_rb(v));
        CHECK_EQ(((uint16_t *)b.img)[i], gh_f2bf(v));
    }
    gh_buf_upload(&b);
    void *got = gh_buf_download(&b);
    CHECK(memcmp(got, b.img, 200) == 0);
    free(got);
    gh_view v = gh_v2(2, 9, 10, 11);
    gh_poison(&b, v);
    CHECK_EQ(((uint16_t *)b.img)[2], 0x7fc0);
    CHECK_EQ(((uint16_t *)b.img)[11], 0x7fc0);
    CHECK_EQ(((uint16_t *)b.img)[12], gh_f2bf(b.h[12])); /* outside v */
    CHECK_EQ(((uint16_t *)b.img)[13], 0x7fc0);
    df_tensor tg = gh_tens(&b, v, 1), tc = gh_tens(&b, v, 0);
    CHECK(tg.data == (char *)b.d + 4 && tg.dtype == DF_DTYPE_BF16 && tg.ndim == 2);
    CHECK(tg.shape[0] == 9 && tg.shape[1] == 10 && tg.stride[0] == 11 && tg.stride[1] == 1);
    CHECK(tc.data == b.h + 2 && tc.dtype == DF_DTYPE_F32);
    gh_buf_free(&b);
    CHECK(b.d == NULL && b.h == NULL);

    /* one logical tensor in two layouts */
    uint64_t r1 = 1, r2 = 2;
    gh_buf x = gh_buf_rand_view(gh_v2(0, 3, 8, 8), GH_N01_NZ, &r1, 42, 1.5f);
    gh_buf y = gh_buf_rand_view(gh_v2(5, 3, 8, 13), GH_N01_NZ, &r2, 42, 1.5f);
    for (int r = 0; r < 3; r++)
        for (int c = 0; c < 8; c++)
            CHECK(x.h[r * 8 + c] == y.h[5 + r * 13 + c]);
    gh_buf_free(&x);
    gh_buf_free(&y);

    gh_buf f = gh_buf_rand(10, 1, GH_N01, &rng, 1.0f);
    gh_poison(&f, gh_v1(10));
    uint32_t bits;
    memcpy(&bits, (float *)f.img + 3, 4);
    CHECK_EQ(bits, 0x7fc00000u);
    CHECK(gh_tens(&f, gh_v1(10), 1).dtype == DF_DTYPE_F32);
    gh_buf_free(&f);
}

static void test_check_view(void)
{
    uint64_t rng = 11;
    gh_view v = gh_v2(3, 20, 30, 40), also = gh_v2(35, 20, 2, 40);
    gh_buf y = gh_buf_rand(gh_view_len(v) + 5, 0, GH_N01, &rng, 1.0f);
    gh_poison(&y, v);
    gh_buf_upload(&y);
    /* the reference: any values; here a rounding's worth off bf16 */
    for (int64_t r = 0; r < 20; r++)
        for (int64_t c = 0; c < 30; c++)
            y.h[3 + r * 40 + c] = gh_rb(y.h[3 + r * 40 + c]) * (1.0f + 0x1p-10f);
    uint16_t *img = gh_xmalloc((size_t)y.n * 2);
    memcpy(img, y.img, (size_t)y.n * 2);
    EXPECT_FAIL(gh_check_view("harness: not written, poison (expected FAIL)", &y, v, NULL));
    fake_op(&y, v, img);
    CHECK(gh_check_view("harness: a perfect bf16 op", &y, v, NULL));

    gh_diff d;
    int64_t touched = -1;
    CHECK_EQ(gh_view_diff(&y, v, NULL, NULL, &d, &touched), 0);
    CHECK_EQ(touched, 0);
    CHECK_EQ(d.n, 600);
    CHECK(d.err <= gh_naive_bound(&d) && d.err > 0 && d.nan == 0 && d.bad == 0);

    /* one element far off: the worst, named */
    int64_t at = 3 + 7 * 40 + 11;
    uint16_t keep = img[at];
    img[at] = gh_f2bf(y.h[at] + 1.0f + 8.0f * (float)d.naive);
    CHECK_EQ(df_backend_upload(gh_gpu, y.d, img, (size_t)y.n * 2), 0);
    EXPECT_FAIL(gh_check_view("harness: one element off (expected FAIL)", &y, v, NULL));
    CHECK_EQ(gh_view_diff(&y, v, NULL, NULL, &d, &touched), 0);
    CHECK_EQ(d.worst, at);
    CHECK(d.worst_ref == y.h[at]);
    img[at] = keep;

    /* written outside the view: fails, unless inside `also` */
    img[36] ^= 1;
    CHECK_EQ(df_backend_upload(gh_gpu, y.d, img, (size_t)y.n * 2), 0);
    EXPECT_FAIL(gh_check_view("harness: write outside (expected FAIL)", &y, v, NULL));
    CHECK(gh_check_view("harness: write inside `also`", &y, v, &also));
    img[36] ^= 1;
    img[y.n - 1] ^= 1; /* past both views */
    CHECK_EQ(df_backend_upload(gh_gpu, y.d, img, (size_t)y.n * 2), 0);
    EXPECT_FAIL(gh_check_view("harness: write past the end (expected FAIL)", &y, v, &also));
    img[y.n - 1] ^= 1;

    /* NaN and infinity in the output */
    img[3] = 0x7fc0;
    CHECK_EQ(df_backend_upload(gh_gpu, y.d, img, (size_t)y.n * 2), 0);
    EXPECT_FAIL(gh_check_view("harness: NaN (expected FAIL)", &y, v, NULL));
    img[3] = 0x7f80;
    CHECK_EQ(df_backend_upload(gh_gpu, y.d, img, (size_t)y.n * 2), 0);
    EXPECT_FAIL(gh_check_view("harness: inf (expected FAIL)", &y, v, NULL));
    free(img);
    gh_buf_free(&y);
}

static void test_diff(void)
{
    float ref[6] = {1, 2, 0, 0, -INFINITY, 4}, got[6] = {1.01f, 2, 0, 0, -INFINITY, 4};
    gh_diff d;
    gh_diff_f32(&d, got, ref, 6, NULL);
    CHECK_EQ(d.bad, 1); /* the infinity: not allowed by default */
    CHECK_EQ(d.worst, 0);
    CHECK(fabs(d.err - 0.01) < 1e-6);
    uint8_t zr[3] = {0, 1, 0};
    gh_cmp_opts o = {zr, 2, 1};
    gh_diff_f32(&d, got, ref, 6, &o);
    CHECK_EQ(d.bad, 0);
    CHECK(gh_diff_ok(&d, 0.02) && !gh_diff_ok(&d, 0.001));
    got[3] = 1e-30f; /* a structural zero that is not */
    gh_diff_f32(&d, got, ref, 6, &o);
    CHECK_EQ(d.bad, 1);
    EXPECT_FAIL(gh_expect("harness: structural zero (expected FAIL)", &d, 1.0));
    got[3] = 0, got[5] = NAN;
    gh_diff_f32(&d, got, ref, 6, &o);
    CHECK_EQ(d.nan, 1);
    CHECK(!gh_diff_ok(&d, 1.0));
    got[5] = 4, got[4] = INFINITY;
    gh_diff_f32(&d, got, ref, 6, &o);
    CHECK_EQ(d.bad, 1); /* +inf vs -inf */
    CHECK(gh_expect("harness: nothing wrong", &(gh_diff){.err = 1, .worst = -1}, 1.0));

    /* the bf16 gradient rule */
    int64_t cancel = 0;
    CHECK(gh_bf16_close(0x3f80, 0x3f81, 1e-6, &cancel));
    CHECK(!gh_bf16_close(0x3f80, 0x3f82, 1e-6, &cancel));
    CHECK_EQ(cancel, 0);
    CHECK(gh_bf16_close(0x3f80, 0x3f84, 0.03, &cancel)); /* 1 vs 1.03125: within tol + ulps */
    CHECK(!gh_bf16_close(0x3f80, 0x3f90, 0.03, &cancel));
    CHECK_EQ(cancel, 2);
    CHECK(!gh_bf16_close(0x7fc0, 0x7fc0, 1.0, &cancel));

    float a[2] = {3, 4};
    CHECK(gh_l2(a, NULL, 2) == 5.0);
    CHECK(gh_l2(a, a, 2) == 0.0);
    float m[5] = {5, 1, 4, 2, 3};
    CHECK(gh_median_f(m, 5) == 3.0f);
    double md[4] = {4, 1, 3, 2};
    CHECK(gh_median(md, 4) == 3.0);
}

int main(void)
{
    df_err e;
    memset(&e, 0, sizeof e);
    int rc = gh_open(1);
    if (df_backend_cuda_device_count() <= 0) {
        CHECK_EQ(rc, 77);
        CHECK(gh_gpu == NULL && gh_cpu == NULL);
        CHECK_EQ(gh_skip_without_gpu(), 77);
        gh_gpu = df_backend_cpu_open(1, &e); /* the stand-in */
        gh_cpu = df_backend_cpu_open(1, &e);
    } else {
        CHECK_EQ(rc, 0);
    }
    CHECK(gh_gpu && gh_cpu);
    if (!gh_gpu || !gh_cpu)
        return test_main_end();
    test_views();
    test_bf16();
    test_random();
    test_buffers();
    test_check_view();
    test_diff();
    gh_close();
    CHECK(gh_gpu == NULL);
    return test_main_end();
}
