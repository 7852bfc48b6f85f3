/* test_gpu_lmhead_ce - df_cuda_lmhead_ce (kernels/cuda/lmhead_ce.cu), called
 * directly on device data, against df_op_lmhead_ce on the CPU backend run
 * on F32 copies of the same bf16 values. Skips (77) without a GPU.
 * `--bench` adds a timing run at the drafter's size (N=8192, V=248320,
 * H=5120): loss only, and loss + dh.
 *
 * Every GPU output is NaN-poisoned (ints: -7777) first. Tolerances:
 *  - logits: both backends sum the same H exact bf16 x bf16 products in
 *    fp32, in different orders (the CPU in order, cuBLASLt in tiles on
 *    tensor cores, whose fp32 accumulation need not round to nearest), so a
 *    logit may differ by dz_i <= 2 (H-1) u L_i, L_i = max_v sum_k |h_ik w_vk|,
 *    u = 2^-24 (2u allows the non-RN accumulation).
 *  - ce: lse(z) - z_label moves by at most 2 dz_i, and the rest (expf, the
 *    double sum) agrees to ~1e-7 relative: |gpu - cpu| <= 1e-4 |cpu| + 2 dz_i.
 *  - loss (w * ce summed in double): <= 1e-4 |cpu| + sum_i w_i 2 dz_i.
 *  - argmax: equal, except where the two candidates' exact (double) logits
 *    are within 1e-5 relative + 2 dz_i (a near-tie fp32 may flip; reported).
 *  - dh (bf16): max error <= 2x that of naive bf16 (the CPU's fp32 dh
 *    rounded) + 1e-6 max|ref| (KERNELS.md); the GPU carries G as bf16 hi +
 *    lo (~2^-17 relative), so its only sizeable error is dh's own rounding.
 *  - ignored rows (label -1, weight 0, label >= V): ce = 0 and dh = 0
 *    exactly; argmax is still every row's argmax.
 * A label >= V: the CPU backend rejects it (-EINVAL, checked here: it can
 * see host labels), a device backend cannot check device labels and must
 * ignore the row. The CPU reference therefore gets -1 for that row, and the
 * row is also checked on its own (ce 0, dh 0, no loss).
 * Also: a second GPU run is bitwise identical (determinism); a multi-chunk
 * case (V=50000, N=300, chunk buffers capped at 16 MiB: 55-row chunks, and
 * 83 rows without dh); V not a multiple of 8 (padded logit rows); weight
 * NULL; loss only (dh, argmax, ce NULL); vocabularies of 248320 and 2^18 - 1. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/device.h"
#include "cuda/lmhead_cuda.h"
#include "gpu_harness.h"
#include "ops.h"
#include "train_ops.h"

static uint64_t rng = 4242;

/* n bf16-representable values, N(0, scale^2)-ish. */
static float *rnd(int64_t n, float scale) { return gh_rand_bf16(GH_N01, &rng, n, scale); }

typedef struct gpu_out {
    float *ce;
    int32_t *am;
    uint16_t *dh;
    double loss;
} gpu_out;

/* One direct GPU call on poisoned outputs; results downloaded into o. */
static int run_gpu(df_backend *g, int64_t N, int64_t V, int64_t H, void *dh_, void *dhead,
                   void *dlab, void *dw, float denom, int want_dh, int want_am, int want_ce,
                   gpu_out *o)
{
    void *ddh = want_dh ? df_backend_alloc(g, (size_t)(N * H) * 2 + 2) : NULL;
    void *dam = want_am ? df_backend_alloc(g, (size_t)N * 4) : NULL;
    void *dce = want_ce ? df_backend_alloc(g, (size_t)N * 4) : NULL;
    if (ddh)
        gh_dev_poison(g, ddh, N * H, DF_DTYPE_BF16);
    if (dam)
        gh_dev_poison(g, dam, N, DF_DTYPE_I32);
    if (dce)
        gh_dev_poison(g, dce, N, DF_DTYPE_F32);
    df_tensor th = df_tensor_2d(dh_, DF_DTYPE_BF16, N, H);
    df_tensor tw = df_tensor_2d(dhead, DF_DTYPE_BF16, V, H);
    df_tensor tdh = df_tensor_2d(ddh, DF_DTYPE_BF16, N, H);
    o->loss = 0.5; /* loss_sum is added to */
    int rc = df_cuda_lmhead_ce(g, &th, &tw, dlab, dw, denom, &o->loss, ddh ? &tdh : NULL, dam,
                               dce, 0);
    CHECK_EQ(rc, 0);
    CHECK_EQ(df_backend_sync(g), 0);
    o->dh = NULL, o->am = NULL, o->ce = NULL;
    if (ddh) {
        o->dh = malloc((size_t)(N * H) * 2 + 2);
        CHECK_EQ(df_backend_download(g, o->dh, ddh, (size_t)(N * H) * 2), 0);
    }
    if (dam) {
        o->am = malloc((size_t)N * 4);
        CHECK_EQ(df_backend_download(g, o->am, dam, (size_t)N * 4), 0);
    }
    if (dce) {
        o->ce = malloc((size_t)N * 4);
        CHECK_EQ(df_backend_download(g, o->ce, dce, (size_t)N * 4), 0);
    }
    df_backend_free(g, ddh), df_backend_free(g, dam), df_backend_free(g, dce);
    return rc;
}

static void free_out(gpu_out *o)
{
    free(o->ce), free(o->am), free(o->dh);
}

/* h[i] . w[v] in double (exact: H bf16 products); *abs_sum gets sum |terms|. */
static double exact_logit(const float *h, const float *w, int64_t H, int64_t i, int64_t v,
                          double *abs_sum)
{
    double s = 0, a = 0;
    for (int64_t k = 0; k < H; k++) {
        double p = (double)h[i * H + k] * w[v * H + k];
        s += p;
        a += fabs(p);
    }
    *abs_sum = a;
    return s;
}

/* One comparison case. chunk_bytes: 0 = the default chunking. */
/* The naive bf16 gradient's worst error against dh_ref: G = (softmax -
 * onehot) w / denom from exact logits, rounded to bf16 (what bf16 autograd
 * feeds its dh GEMM, and the default mode's G), times the head in double,
 * the result rounded to bf16. */
static double naive_bf16_dh_err(const float *h, const float *w, const int32_t *lab,
                                const float *wt, float denom, int64_t N, int64_t V, int64_t H,
                                const float *dh_ref)
{
    double *z = malloc((size_t)V * 8), *acc = malloc((size_t)H * 8), worst = 0, a;
    for (int64_t i = 0; i < N; i++) {
        double wi = wt ? wt[i] : 1.0;
        if (lab[i] < 0 || !(wi > 0)) /* ignored rows: exactly 0 in every mode */
            continue;
        double mx = -INFINITY, sum = 0;
        for (int64_t v = 0; v < V; v++)
            mx = fmax(mx, z[v] = exact_logit(h, w, H, i, v, &a));
        for (int64_t v = 0; v < V; v++)
            sum += exp(z[v] - mx);
        memset(acc, 0, (size_t)H * 8);
        for (int64_t v = 0; v < V; v++) {
            double gv = (exp(z[v] - mx) / sum - (v == lab[i])) * wi / denom;
            double gb = gh_rb((float)gv);
            for (int64_t k = 0; k < H; k++)
                acc[k] += gb * w[v * H + k];
        }
        for (int64_t k = 0; k < H; k++)
            worst = fmax(worst, fabs(gh_rb((float)acc[k]) - dh_ref[i * H + k]));
    }
    free(z), free(acc);
    return worst;
}

/* precise: the hi + lo gradient mode (dh within 2x its final bf16 rounding);
 * otherwise the default one-bf16 G (within 2x naive bf16 autograd). */
static void check_case(df_backend *g, df_backend *c, int64_t N, int64_t V, int64_t H,
                       int use_weight, size_t chunk_bytes, int precise)
{
    float *h = rnd(N * H, 0.35f), *w = rnd(V * H, 0.5f);
    int32_t *lab = malloc((size_t)N * 4), *lab_cpu = malloc((size_t)N * 4);
    float *wt = malloc((size_t)N * 4);
    const int64_t big_row = N > 3 ? 3 : 0; /* the row with label >= V */
    for (int64_t i = 0; i < N; i++) {
        lab[i] = (int32_t)(test_rand(&rng) % (uint64_t)V);
        if (i % 7 == 5)
            lab[i] = -1;
        wt[i] = 0.25f + (float)(test_rand(&rng) % 1000) / 500.0f;
        if (i % 11 == 4)
            wt[i] = 0.0f;
    }
    lab[big_row] = (int32_t)V + 5;
    if (N > 1)
        lab[1] = (int32_t)V - 1; /* the last vocabulary entry */
    memcpy(lab_cpu, lab, (size_t)N * 4);
    lab_cpu[big_row] = -1;
    const float *wp = use_weight ? wt : NULL;
    const float denom = 3.5f;

    /* CPU reference (and: the CPU rejects a label >= V). */
    float *dh_ref = malloc((size_t)(N * H) * 4 + 4), *ce_ref = malloc((size_t)N * 4);
    int32_t *am_ref = malloc((size_t)N * 4);
    double loss_ref = 0.5, dummy = 0.0;
    df_tensor th = df_tensor_2d(h, DF_DTYPE_F32, N, H), tw = df_tensor_2d(w, DF_DTYPE_F32, V, H);
    df_tensor tdh = df_tensor_2d(dh_ref, DF_DTYPE_F32, N, H);
    CHECK_EQ(df_op_lmhead_ce(c, &th, &tw, lab, wp, denom, &dummy, &tdh, am_ref, ce_ref, 0),
                             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(c, &th, &tw, lab_cpu, wp, denom, &loss_ref, &tdh, am_ref, ce_ref, 0),
             0);

    /* Each row's logit bound dz and the gap a flipped argmax may have. */
    double *dz = malloc((size_t)N * 8), *gap_ok = malloc((size_t)N * 8);
    const double u = ldexp(1.0, -24);
    for (int64_t i = 0; i < N; i++) {
        double L = 0, zmax = 0;
        for (int64_t v = 0; v < V; v++) {
            double a = 0;
            zmax = fmax(zmax, fabs(exact_logit(h, w, H, i, v, &a)));
            L = fmax(L, a);
        }
        dz[i] = 2.0 * (double)(H > 1 ? H - 1 : 1) * u * L;
        gap_ok[i] = 1e-5 * zmax + 2.0 * dz[i];
    }

    void *dh_ = gh_dev_bf16(g, h, N * H), *dw_ = gh_dev_bf16(g, w, V * H);
    void *dlab = gh_dev_copy(g, lab, (size_t)N * 4);
    void *dwt = use_weight ? gh_dev_copy(g, wt, (size_t)N * 4) : NULL;
    df_cuda_lmhead_ce_set_chunk_bytes(chunk_bytes);
    df_cuda_lmhead_ce_set_precise(precise);

    gpu_out o1, o2, o3;
    run_gpu(g, N, V, H, dh_, dw_, dlab, dwt, denom, 1, 1, 1, &o1);
    run_gpu(g, N, V, H, dh_, dw_, dlab, dwt, denom, 1, 1, 1, &o2);
    run_gpu(g, N, V, H, dh_, dw_, dlab, dwt, denom, 0, 0, 0, &o3); /* loss only */

    /* ce, argmax, loss */
    int bad_ce = 0, bad_am = 0, flips = 0, nan = 0;
    double loss_tol = 0, worst_ce = 0;
    for (int64_t i = 0; i < N; i++) {
        double wi = use_weight ? wt[i] : 1.0;
        int act = lab_cpu[i] >= 0 && wi > 0;
        if (act)
            loss_tol += wi * 2.0 * dz[i];
        nan += isnan(o1.ce[i]);
        double d = fabs((double)o1.ce[i] - ce_ref[i]);
        if (!act ? o1.ce[i] != 0.0f : !(d <= 1e-4 * fabs(ce_ref[i]) + 2.0 * dz[i]))
            bad_ce++;
        if (act && ce_ref[i] != 0)
            worst_ce = fmax(worst_ce, d / fabs(ce_ref[i]));
        int32_t ga = o1.am[i], ca = am_ref[i];
        if (ga < 0 || ga >= V) {
            bad_am++;
        } else if (ga != ca) {
            double a, zg = exact_logit(h, w, H, i, ga, &a), zc = exact_logit(h, w, H, i, ca, &a);
            double gap = fabs(zg - zc);
            if (gap <= gap_ok[i]) {
                flips++;
                printf("  row %lld: argmax %d (gpu) vs %d (cpu), exact logits %.9g vs %.9g: "
                       "near-tie\n",
                       (long long)i, ga, ca, zg, zc);
            } else {
                bad_am++;
            }
        }
    }
    loss_tol += 1e-4 * fabs(loss_ref - 0.5);
    double dl = fabs(o1.loss - loss_ref), dl3 = fabs(o3.loss - loss_ref);

    /* the label >= V row: ignored on the GPU */
    int big_ok = o1.ce[big_row] == 0.0f;
    for (int64_t k = 0; k < H; k++)
        big_ok &= o1.dh[big_row * H + k] == 0;

    /* dh */
    float *dhg = gh_xmalloc((size_t)(N * H) * 4);
    int ign_nz = 0;
    for (int64_t i = 0; i < N; i++) {
        double wi = use_weight ? wt[i] : 1.0;
        int act = lab_cpu[i] >= 0 && wi > 0;
        for (int64_t k = 0; k < H; k++) {
            dhg[i * H + k] = gh_bf2f(o1.dh[i * H + k]);
            if (!act && dhg[i * H + k] != 0.0f)
                ign_nz++;
        }
    }
    gh_diff dd;
    gh_diff_f32(&dd, dhg, dh_ref, N * H, NULL);
    double err = dd.err, naive = dd.naive;
    if (!precise) /* the bound of the one-bf16 G: naive bf16 autograd's error */
        naive = fmax(naive, naive_bf16_dh_err(h, w, lab_cpu, wp, denom, N, V, H, dh_ref));
    double dh_tol = 2 * naive + 1e-6 * dd.ref_max;
    int dh_ok = !ign_nz && gh_diff_ok(&dd, dh_tol);
    if (!dh_ok)
        gh_diff_report("lmhead_ce dh", &dd, dh_tol);
    free(dhg);

    /* determinism: a second run is bitwise identical */
    int same = o1.loss == o2.loss && !memcmp(o1.ce, o2.ce, (size_t)N * 4) &&
               !memcmp(o1.am, o2.am, (size_t)N * 4) &&
               !memcmp(o1.dh, o2.dh, (size_t)(N * H) * 2);

    int ok = !nan && !bad_ce && !bad_am && dl <= loss_tol && dl3 <= loss_tol && big_ok &&
             dh_ok && same;
    printf("lmhead_ce N=%lld V=%lld H=%lld weight=%s chunk=%s G=%s: ce worst rel %.2e (bad %d), "
           "argmax bad %d near-tie flips %d, loss %.9g vs %.9g (loss-only %.9g, tol %.2e), "
           "dh err %.3e naive %.3e, label>=V row %s, repeat %s: %s\n",
           (long long)N, (long long)V, (long long)H, use_weight ? "yes" : "NULL",
           chunk_bytes ? "16MiB" : "default", precise ? "hi+lo" : "bf16", worst_ce, bad_ce, bad_am, flips, o1.loss, loss_ref,
           o3.loss, loss_tol, err, naive, big_ok ? "ignored" : "WRONG",
           same ? "bitwise" : "DIFFERS", ok ? "ok" : "FAIL");
    CHECK(!nan);
    CHECK_EQ(bad_ce, 0);
    CHECK_EQ(bad_am, 0);
    CHECK(dl <= loss_tol);
    CHECK(dl3 <= loss_tol);
    CHECK(big_ok);
    CHECK(dh_ok);
    CHECK(same);

    df_cuda_lmhead_ce_set_chunk_bytes(0);
    free_out(&o1), free_out(&o2), free_out(&o3);
    df_backend_free(g, dh_), df_backend_free(g, dw_), df_backend_free(g, dlab);
    df_backend_free(g, dwt);
    free(h), free(w), free(lab), free(lab_cpu), free(wt), free(dh_ref), free(ce_ref);
    free(am_ref), free(dz), free(gap_ok);
}

/* Lent memory (df_backend_lend_scratch, as the drafter lends its dead
 * activations): the chunk buffers come from it, sized to it, with the same
 * results as the same chunking from the backend's scratch, bit for bit. */
static void check_lend(df_backend *g)
{
    const int64_t N = 3000, V = 50000, H = 64; /* logits 600 MB: two chunks in 520 MiB */
    float *h = rnd(N * H, 0.35f), *w = rnd(V * H, 0.5f);
    int32_t *lab = malloc((size_t)N * 4);
    for (int64_t i = 0; i < N; i++)
        lab[i] = i % 9 == 2 ? -1 : (int32_t)(test_rand(&rng) % (uint64_t)V);
    void *dh_ = gh_dev_bf16(g, h, N * H), *dw_ = gh_dev_bf16(g, w, V * H);
    void *dlab = gh_dev_copy(g, lab, (size_t)N * 4);
    /* lmhead_ce.cu's fixed part: its cuBLASLt workspace (32 MiB), the row
     * losses, alignment */
    size_t fixed = ((((size_t)32 << 20) + (size_t)(N + 1) * 8 + 255) / 256) * 256 + 1024;
    size_t lent = fixed + ((size_t)520 << 20);
    void *buf = df_backend_alloc(g, lent);
    CHECK(buf != NULL);
    if (!buf)
        return;
    gh_dev_poison(g, buf, (int64_t)(lent / 4), DF_DTYPE_F32);
    gpu_out a, b;
    df_cuda_lmhead_ce_set_chunk_bytes(lent - fixed); /* the chunking a loan of that size gives */
    run_gpu(g, N, V, H, dh_, dw_, dlab, NULL, 7.0f, 1, 1, 1, &a);
    df_cuda_lmhead_ce_set_chunk_bytes(0);
    df_backend_lend_scratch(g, buf, lent);
    run_gpu(g, N, V, H, dh_, dw_, dlab, NULL, 7.0f, 1, 1, 1, &b);
    df_backend_lend_scratch(g, NULL, 0);
    /* the loan was used: the logits overwrote the poison */
    float probe[256];
    CHECK_EQ(df_backend_download(g, probe, (uint8_t *)buf + fixed + ((size_t)100 << 20),
                                 sizeof probe), 0);
    int used = 0;
    for (int i = 0; i < 256; i++)
        used += !isnan(probe[i]);
    int same = a.loss == b.loss && !memcmp(a.ce, b.ce, (size_t)N * 4) &&
               !memcmp(a.am, b.am, (size_t)N * 4) && !memcmp(a.dh, b.dh, (size_t)(N * H) * 2);
    printf("lmhead_ce N=%lld V=%lld H=%lld in 520 MiB lent: loss %.9g vs %.9g, loan used %s, "
           "results %s: %s\n", (long long)N, (long long)V, (long long)H, b.loss, a.loss,
           used ? "yes" : "NO", same ? "bitwise" : "DIFFER", used && same && isfinite(a.loss) ? "ok" : "FAIL");
    CHECK(used > 0);
    CHECK(same);
    CHECK(isfinite(a.loss));
    free_out(&a), free_out(&b);
    df_backend_free(g, buf), df_backend_free(g, dh_), df_backend_free(g, dw_);
    df_backend_free(g, dlab);
    free(h), free(w), free(lab);
}

/* The drafter's size: timing only (the CPU reference would take hours). */
static void bench(df_backend *g)
{
    const int64_t N = 8192, V = 248320, H = 5120;
    void *dh_ = df_backend_alloc(g, (size_t)(N * H) * 2), *dw_ = df_backend_alloc(g, (size_t)(V * H) * 2);
    void *ddh = df_backend_alloc(g, (size_t)(N * H) * 2), *dam = df_backend_alloc(g, (size_t)N * 4);
    void *dce = df_backend_alloc(g, (size_t)N * 4);
    int32_t *lab = malloc((size_t)N * 4);
    for (int64_t i = 0; i < N; i++)
        lab[i] = i % 50 == 0 ? -1 : (int32_t)(test_rand(&rng) % (uint64_t)V);
    void *dlab = gh_dev_copy(g, lab, (size_t)N * 4);
    CHECK(dh_ && dw_ && ddh && dam && dce && dlab);
    if (!(dh_ && dw_ && ddh && dam && dce && dlab))
        return;
    CHECK_EQ(df_backend_fill_uniform(g, dh_, DF_DTYPE_BF16, N * H, 1, -1.0f, 1.0f), 0);
    CHECK_EQ(df_backend_fill_uniform(g, dw_, DF_DTYPE_BF16, V * H, 2, -0.03f, 0.03f), 0);
    df_tensor th = df_tensor_2d(dh_, DF_DTYPE_BF16, N, H), tw = df_tensor_2d(dw_, DF_DTYPE_BF16, V, H);
    df_tensor tdh = df_tensor_2d(ddh, DF_DTYPE_BF16, N, H);
    for (int mode = 0; mode < 3; mode++) { /* loss only; + dh (bf16 G); + dh (hi + lo G) */
        df_cuda_lmhead_ce_set_precise(mode == 2);
        double loss = 0, best = 1e30;
        for (int it = 0; it < 4; it++) { /* the first is a warm-up (plans, scratch) */
            CHECK_EQ(df_backend_sync(g), 0);
            double t0 = gh_now_ms();
            CHECK_EQ(df_cuda_lmhead_ce(g, &th, &tw, dlab, NULL, (float)N, &loss,
                                       mode ? &tdh : NULL, dam, dce, 0),
                     0);
            CHECK_EQ(df_backend_sync(g), 0);
            double t = gh_now_ms() - t0;
            if (it > 0 && t < best)
                best = t;
        }
        printf("bench N=%lld V=%lld H=%lld %s: %.2f ms (best of 3; GEMM flops %.1f TFLOP)\n",
               (long long)N, (long long)V, (long long)H,
               mode == 0 ? "loss only" : mode == 1 ? "loss + dh, bf16 G" : "loss + dh, hi+lo G",
               best, (1.0 + mode) * 2.0 * N * V * H / 1e12);
    }
    df_cuda_lmhead_ce_set_precise(0);
    free(lab);
    df_backend_free(g, dh_), df_backend_free(g, dw_), df_backend_free(g, ddh);
    df_backend_free(g, dam), df_backend_free(g, dce), df_backend_free(g, dlab);
}

int main(int argc, char **argv)
{
    int do_bench = argc > 1 && !strcmp(argv[1], "--bench");
    int rc = gh_open(0);
    if (rc)
        return rc;
    df_backend *g = gh_gpu, *c = gh_cpu;
    for (int precise = 0; precise < 2; precise++) {
        check_case(g, c, 37, 1000, 64, 1, 0, precise);
        check_case(g, c, 37, 1000, 64, 0, 0, precise);
        check_case(g, c, 29, 1001, 72, 1, 0, precise); /* V % 8 != 0: padded logit rows */
        check_case(g, c, 300, 50000, 64, 1, (size_t)16 << 20, precise); /* chunks + a tail */
    }
    check_case(g, c, 9, 248320, 64, 1, 0, 0); /* Qwen3.6's vocabulary */
    check_case(g, c, 5, 262143, 48, 1, 0, 1); /* 2^18 - 1: V % 8 != 0 at that size */
    df_cuda_lmhead_ce_set_precise(0);
    check_lend(g);
    if (do_bench)
        bench(g);
    gh_close();
    return test_main_end();
}
