/* test_lmhead_ce.c - the fused LM-head CE of the CPU reference backend
 * (df_op_lmhead_ce): the loss, argmax and dh against a naive double reference
 * and by central finite differences, on a 1-thread and a 3-thread backend
 * (bitwise equal), with the same poisoning and bad-argument checks as
 * test_train_ops.c.
 *
 * DFLASH_TRAIN_BENCH=1 also times it on 1 and 2 threads. */
#include "grad_test_util.h"
#include "test.h"
#include "train_ops.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- LM head + CE ---- */

/* Naive double reference: logits from the exact head values, stable LSE,
 * CE, argmax (lowest index of the max), and dh = sum_v (p_v - 1[v = label])
 * head_v * w / denom. Also dh_mag = sum_v |g_v head_vk| (the GEMM's fp32 error
 * scale) and dz_dh = 2 max_v(sum_k |h_k head_vk|) sum_v p_v |head_vk| w / denom: an error of at
 * most e max_v sum_k |h_k head_vk| in every logit moves g_v by at most 2 e p_v w / denom (p_v's
 * own shift plus the softmax's sum), so dh by at most e dz_dh. */
typedef struct ce_ref {
    double loss, *ce, *dh, *dh_mag, *dz_dh;
    int32_t *am;
} ce_ref;

static void ce_reference(const mat *h, const wmat *head, const int32_t *label, const float *weight,
                         double denom, ce_ref *r)
{
    int64_t N = h->rows, H = h->cols, V = head->rows;
    double *z = dbuf(V), *za = dbuf(V);
    r->loss = 0;
    r->ce = dbuf(N), r->dh = dbuf(N * H), r->dh_mag = dbuf(N * H), r->dz_dh = dbuf(N * H);
    r->am = xmalloc((size_t)(N ? N : 1) * sizeof(int32_t));
    for (int64_t i = 0; i < N; i++) {
        double mx = -INFINITY, mag = 0;
        int32_t am = 0;
        for (int64_t v = 0; v < V; v++) {
            double s = 0, a = 0;
            for (int64_t k = 0; k < H; k++) {
                double p = (double)*mat_at(h, i, k) * head->val[v * H + k];
                s += p, a += fabs(p);
            }
            z[v] = s, za[v] = a;
            mag = a > mag ? a : mag;
            if (s > mx)
                mx = s, am = (int32_t)v;
        }
        r->am[i] = am;
        double w = weight ? weight[i] : 1.0;
        if (label[i] < 0 || w <= 0)
            continue;
        double se = 0;
        for (int64_t v = 0; v < V; v++)
            se += exp(z[v] - mx);
        double lse = mx + log(se);
        r->ce[i] = lse - z[label[i]];
        r->loss += w * r->ce[i];
        for (int64_t v = 0; v < V; v++) {
            double pv = exp(z[v] - lse), gv = (pv - (v == label[i])) * w / denom;
            for (int64_t k = 0; k < H; k++) {
                r->dh[i * H + k] += gv * head->val[v * H + k];
                r->dh_mag[i * H + k] += fabs(gv * head->val[v * H + k]);
                r->dz_dh[i * H + k] += 2 * mag * pv * fabs(head->val[v * H + k]) * w / denom;
            }
        }
    }
    free(z), free(za);
}

static void ce_ref_free(ce_ref *r)
{
    free(r->ce), free(r->dh), free(r->dh_mag), free(r->dz_dh), free(r->am);
}

/* FD of L(h) = sum_i w_i CE_i / denom in double. dh is an fp32 GEMM over V
 * of softmax probabilities (relative error ~u each) times head rows, plus the
 * fp32 logits' error (~u sum|h head|, here O(u) since |h head| ~ 1) moving p
 * by ~u p: a few u of max|dh|; 1e-5 is a wide margin. */
static void fd_lmhead(df_dtype wt)
{
    const int64_t N = 5, H = 7, V = 11;
    mat h = mat_rand(N, H, H, 1.0f);
    wmat head = wmat_new(wt, V, H, H, 0.7f);
    int32_t label[5] = {3, -1, 0, 10, 4};
    float weight[5] = {1.0f, 1.0f, 0.5f, 0.25f, 0.0f};
    const double denom = 1.75;
    double *hv = dbuf(N * H), *num = dbuf(N * H), *z = dbuf(V);
    for (int64_t i = 0; i < N * H; i++)
        hv[i] = h.p[i];
    for (int64_t e = 0; e < N * H; e++) {
        double save = hv[e], L[2];
        for (int s = 0; s < 2; s++) {
            hv[e] = save + (s ? -FD_H : FD_H);
            double acc = 0;
            for (int64_t i = 0; i < N; i++) {
                if (label[i] < 0 || weight[i] <= 0)
                    continue;
                double mx = -INFINITY, se = 0;
                for (int64_t v = 0; v < V; v++) {
                    z[v] = 0;
                    for (int64_t k = 0; k < H; k++)
                        z[v] += hv[i * H + k] * head.val[v * H + k];
                    mx = z[v] > mx ? z[v] : mx;
                }
                for (int64_t v = 0; v < V; v++)
                    se += exp(z[v] - mx);
                acc += weight[i] * (mx + log(se) - z[label[i]]) / denom;
            }
            L[s] = acc;
        }
        hv[e] = save;
        num[e] = (L[0] - L[1]) / (2 * FD_H);
    }
    float *dh = fbuf(N * H);
    df_tensor tdh = df_tensor_2d(dh, DF_DTYPE_F32, N, H);
    poison(dh, N * H);
    double loss = 0;
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, (float)denom, &loss, &tdh, NULL,
                             NULL, 0),
             0);
    fd_compare(FD_CE, "fd lmhead_ce dh", dh, num, N * H, 1e-5);
    for (int64_t k = 0; k < H; k++) /* ignored rows: exactly zero */
        CHECK(dh[1 * H + k] == 0.0f && dh[4 * H + k] == 0.0f);
    free(h.p), free(hv), free(num), free(z), free(dh);
    wmat_free(&head);
}

/* One configuration against the double reference. Rows: random labels, some
 * ignored by label -1 or weight 0, row 0 with huge logits (~1e4: exp would
 * overflow without the max subtracted), row 1 tied (two identical head rows
 * give equal logits: argmax must pick the lower index). Tolerances:
 *   CE: lse - z_label, each off by the fp32 logits' error ~u sum|h head|
 *       (plus ~u |lse| for the f32 max): 1e-5 * (mag + |mx|) per row;
 *   loss: the sum of those, weighted;
 *   dh: 1e-5 sum_v |g_v head_vk| (the GEMM's fp32 rounding relative to its
 *       terms) plus e dz_dh (ce_ref): what a logit error of e mag moves
 *       through the probabilities, e = 2 sqrt(H) u, the probabilistic bound
 *       of an H-term fp32 dot product (Higham) with a margin of 2 (the
 *       worst case, H u, would pass errors of 1e-3 of dh; a fixed
 *       1e-2 max|dh| failed 15 of 200 seeds of the test's rng);
 *   argmax: exact where the top two reference logits differ by more than
 *       their fp32 error (else either index is right). */
static void check_lmhead(int64_t N, int64_t H, int64_t V, df_dtype wt, int use_weight, int want_dh,
                         int want_am)
{
    char what[128];
    snprintf(what, sizeof what, "lmhead_ce N=%lld H=%lld V=%lld %s w=%d dh=%d am=%d", (long long)N,
             (long long)H, (long long)V, df_dtype_name(wt), use_weight, want_dh, want_am);
    mat h = mat_rand(N, H, H + 3, 1.0f);
    wmat head = wmat_new(wt, V, H, H + 1, 0.3f);
    int32_t *label = xmalloc((size_t)N * sizeof(int32_t));
    float *weight = fbuf(N);
    for (int64_t i = 0; i < N; i++) {
        label[i] = (int32_t)(test_rand(&rng) % (uint64_t)V);
        weight[i] = (float)(test_rand(&rng) % 1000) / 999.0f + 0.1f;
        if (i % 7 == 3)
            label[i] = -1;
        if (i % 11 == 5)
            weight[i] = 0.0f;
    }
    if (N > 0) { /* huge logits in row 0 */
        for (int64_t k = 0; k < H; k++)
            *mat_at(&h, 0, k) = (float)(test_randn(&rng) * 3000.0 / sqrt((double)H));
        label[0] = (int32_t)(V / 2);
    }
    if (N > 1 && V > 3) { /* a tie in row 1: head rows 1 and 3 equal, the max */
        /* row 1 times 4 (exact): its logit 16 |r|^2 against 4 r.r_v for another row v, so no
         * draw of the others (|r.r_v| ~ |r|^2 / sqrt(H)) can pass it */
        for (int64_t k = 0; k < H; k++)
            wput(head.p, wt, 1 * head.ld + k, (float)(4.0 * head.val[1 * H + k]), &head.val[1 * H + k]);
        size_t es = df_dtype_size(wt);
        memcpy((uint8_t *)head.p + 3 * head.ld * es, (uint8_t *)head.p + 1 * head.ld * es,
               (size_t)head.ld * es);
        memcpy(&head.val[3 * H], &head.val[1 * H], (size_t)H * sizeof(double));
        for (int64_t k = 0; k < H; k++)
            *mat_at(&h, 1, k) = (float)(head.val[1 * H + k] * 40.0);
    }
    const float denom = 3.5f;
    const float *wp = use_weight ? weight : NULL;
    ce_ref ref;
    ce_reference(&h, &head, label, wp, denom, &ref);

    mat dh[2] = {mat_new(N, H, H + 2), mat_new(N, H, H + 2)};
    int32_t *am[2] = {xmalloc((size_t)(N + 1) * 4), xmalloc((size_t)(N + 1) * 4)};
    float *ce[2] = {fbuf(N + 1), fbuf(N + 1)};
    double loss[2];
    for (int b = 0; b < 2; b++) {
        poison(dh[b].p, N * dh[b].ld);
        poison(ce[b], N + 1);
        memset(am[b], 0xa5, (size_t)(N + 1) * 4);
        loss[b] = 1.5; /* added to */
        CHECK_EQ(df_op_lmhead_ce(bes[b], &h.t, &head.t, label, wp, denom, &loss[b],
                                 want_dh ? &dh[b].t : NULL, want_am ? am[b] : NULL, ce[b], 0),
                 0);
        CHECK(is_poison(ce[b][N]));
        if (want_dh)
            CHECK(pad_intact(&dh[b]));
        else
            CHECK(all_poison(dh[b].p, N * dh[b].ld));
    }
    if (!bitwise_equal(dh[0].p, dh[1].p, N * dh[0].ld * 4) || !bitwise_equal(ce[0], ce[1], N * 4) ||
        !bitwise_equal(&loss[0], &loss[1], 8) || (want_am && !bitwise_equal(am[0], am[1], N * 4))) {
        fprintf(stderr, "%s: 1 and 3 threads differ\n", what);
        df_test_failures++;
    }
    double loss_tol = 0;
    for (int64_t i = 0; i < N; i++) {
        double mag = 0, mx = -INFINITY, second = -INFINITY;
        for (int64_t v = 0; v < V; v++) {
            double s = 0, a = 0;
            for (int64_t k = 0; k < H; k++) {
                double p = (double)*mat_at(&h, i, k) * head.val[v * H + k];
                s += p, a += fabs(p);
            }
            mag = a > mag ? a : mag;
            if (s > mx)
                second = mx, mx = s;
            else if (s > second)
                second = s;
        }
        int active = label[i] >= 0 && (!wp || wp[i] > 0);
        double tol = 1e-5 * (mag + fabs(mx));
        expect_close(what, ce[0][i], active ? ref.ce[i] : 0.0, active ? tol : 0.0, i);
        if (active)
            loss_tol += (wp ? wp[i] : 1.0) * tol;
        if (want_am) {
            if (mx - second > 4 * U * mag || i == 1)
                CHECK_EQ(am[0][i], ref.am[i]);
            if (i == 1 && V > 3)
                CHECK_EQ(am[0][1], 1); /* the tie: the lower index */
        }
        if (want_dh)
            for (int64_t k = 0; k < H; k++)
                expect_close(what, *mat_at(&dh[0], i, k), active ? ref.dh[i * H + k] : 0.0,
                             active ? 1e-5 * ref.dh_mag[i * H + k] +
                                          2 * sqrt((double)H) * U * ref.dz_dh[i * H + k]
                                    : 0.0,
                             i * H + k);
    }
    expect_close(what, loss[0], 1.5 + ref.loss, loss_tol, -1);
    for (int64_t i = 0; i < N; i++) /* the huge row did not overflow */
        CHECK(isfinite(ce[0][i]));
    free(h.p), free(label), free(weight);
    for (int b = 0; b < 2; b++)
        free(dh[b].p), free(am[b]), free(ce[b]);
    ce_ref_free(&ref);
    wmat_free(&head);
}

/* DF_CE_BF16_LOGITS (f16 0) or DF_CE_F16_LOGITS (f16 1): on data whose fp32 logits are
 * exact (h integers / 2^8 or / 2^12, head integers, H = 16: multiples of 2^-8 below 2^5, or
 * of 2^-12 below 2^5), the results are the double reference's on those logits rounded to
 * bf16 (8 significant bits) or fp16 (11), which moves most of them; the flag matters (flags
 * 0 gives another loss); with DF_CE_FP8_GRAD too; 1 and 3 threads bitwise. */
static void check_half_logits(int f16)
{
    const int64_t N = 40, H = 16, V = 300;
    const char *what = f16 ? "lmhead_ce DF_CE_F16_LOGITS" : "lmhead_ce DF_CE_BF16_LOGITS";
    const unsigned flag = f16 ? DF_CE_F16_LOGITS : DF_CE_BF16_LOGITS;
    mat h = mat_new(N, H, H);
    wmat head = wmat_new(DF_DTYPE_BF16, V, H, H, 1.0f);
    for (int64_t i = 0; i < N * H; i++)
        h.p[i] = f16 ? ldexpf((float)((int)(test_rand(&rng) % 2049) - 1024), -12)
                     : ldexpf((float)((int)(test_rand(&rng) % 129) - 64), -8);
    for (int64_t i = 0; i < V * H; i++) {
        float f = (float)((int)(test_rand(&rng) % 17) - 8);
        wput(head.p, DF_DTYPE_BF16, i, f, &head.val[i]);
    }
    int32_t label[40];
    for (int64_t i = 0; i < N; i++)
        label[i] = i % 9 == 2 ? -1 : (int32_t)(test_rand(&rng) % (uint64_t)V);
    const double denom = 6.0;
    /* the reference: exact logits, rounded to bf16, then as ce_reference in double */
    double loss_ref = 0, *dh_ref = dbuf(N * H), *z = dbuf(V);
    double *ce_want = dbuf(N);
    int64_t moved = 0;
    for (int64_t i = 0; i < N; i++) {
        double mx = -INFINITY;
        for (int64_t v = 0; v < V; v++) {
            double s = 0;
            for (int64_t k = 0; k < H; k++)
                s += (double)*mat_at(&h, i, k) * head.val[v * H + k];
            z[v] = f16 ? df_f16_to_f32(df_f32_to_f16((float)s))
                       : df_bf16_to_f32(df_f32_to_bf16((float)s));
            moved += z[v] != s;
            mx = z[v] > mx ? z[v] : mx;
        }
        if (label[i] < 0)
            continue;
        double se = 0;
        for (int64_t v = 0; v < V; v++)
            se += exp(z[v] - mx);
        double lse = mx + log(se);
        ce_want[i] = lse - z[label[i]];
        loss_ref += ce_want[i];
        for (int64_t v = 0; v < V; v++) {
            double g = (exp(z[v] - lse) - (v == label[i])) / denom;
            for (int64_t k = 0; k < H; k++)
                dh_ref[i * H + k] += g * head.val[v * H + k];
        }
    }
    CHECK(moved > N * V / 4);
    for (int fp8 = 0; fp8 < 2; fp8++) {
        unsigned flags = flag | (fp8 ? DF_CE_FP8_GRAD : 0);
        mat dh[2] = {mat_new(N, H, H), mat_new(N, H, H)};
        float ce[2][40], ce0[40];
        double loss[2] = {0, 0}, loss0 = 0;
        for (int b = 0; b < 2; b++)
            CHECK_EQ(df_op_lmhead_ce(bes[b], &h.t, &head.t, label, NULL, (float)denom, &loss[b],
                                     &dh[b].t, NULL, ce[b], flags),
                     0);
        CHECK(bitwise_equal(dh[0].p, dh[1].p, N * H * 4) && bitwise_equal(ce[0], ce[1], N * 4) &&
              bitwise_equal(loss, loss + 1, 8));
        CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, NULL, (float)denom, &loss0, NULL,
                                 NULL, ce0, flags & ~flag),
                 0);
        double ce_moved = 0; /* the flag's effect, per row: ~2^-7 (bf16) or 2^-10 of the logits */
        for (int64_t i = 0; i < N; i++)
            ce_moved = fmax(ce_moved, fabs(ce0[i] - (label[i] < 0 ? 0.0 : ce_want[i])));
        printf("%s%s: loss %.9g (reference %.9g; without the flag %.9g, a row's CE by up to "
               "%.2e)\n", what, fp8 ? " | DF_CE_FP8_GRAD" : "", loss[0], loss_ref, loss0, ce_moved);
        CHECK(ce_moved > (f16 ? 1e-4 : 1e-3));
        expect_close(what, loss[0], loss_ref, 1e-5 * fabs(loss_ref), -1);
        double dmax = 0, e2 = 0, r2 = 0;
        for (int64_t i = 0; i < N * H; i++) {
            dmax = fabs(dh_ref[i]) > dmax ? fabs(dh_ref[i]) : dmax;
            e2 += (dh[0].p[i] - dh_ref[i]) * (dh[0].p[i] - dh_ref[i]);
            r2 += dh_ref[i] * dh_ref[i];
        }
        for (int64_t i = 0; i < N; i++)
            expect_close(what, ce[0][i], label[i] < 0 ? 0.0 : ce_want[i], 1e-5 * (1 + ce_want[i]), i);
        if (!fp8) /* fp32 sums over V: relative ~1e-6 */
            for (int64_t i = 0; i < N * H; i++)
                expect_close(what, dh[0].p[i], dh_ref[i], 1e-5 * dmax, i);
        printf("  dh rel L2 vs the reference %.3e\n", sqrt(e2 / r2));
        if (fp8) /* G in E4M3: its ~2^-5 rms relative rounding */
            CHECK(sqrt(e2 / r2) < 5e-2 && sqrt(e2 / r2) > 1e-3);
        free(dh[0].p), free(dh[1].p);
    }
    free(h.p), free(dh_ref), free(z), free(ce_want);
    wmat_free(&head);
}

static void test_lmhead_ce(void)
{
    check_half_logits(0);
    for (int d = 0; d < 3; d++)
        fd_lmhead(DTS[d]);
    /* chunks of up to 64 rows (fewer with more threads): 130 rows is 64 + 64
     * + 2 on one thread and 44 x 3 - 2 on three; V odd; H across KC = 256. */
    check_lmhead(130, 40, 1001, DF_DTYPE_BF16, 1, 1, 1);
    check_lmhead(130, 300, 77, DF_DTYPE_F32, 1, 1, 1);
    check_lmhead(9, 16, 5, DF_DTYPE_F16, 0, 1, 1);
    check_lmhead(70, 24, 301, DF_DTYPE_BF16, 1, 1, 0); /* argmax off: ignored rows skip GEMM 1 */
    check_lmhead(70, 24, 301, DF_DTYPE_BF16, 1, 0, 1); /* no dh */
    check_lmhead(1, 8, 1, DF_DTYPE_F32, 1, 1, 1);      /* V = 1: CE 0, dh 0 */
    check_lmhead(0, 8, 10, DF_DTYPE_F32, 1, 1, 1);

    /* A vocabulary past the 64 MiB chunk buffer: fewer rows per chunk. */
    {
        const int64_t N = 70, H = 4, V = 270001;
        mat h = mat_rand(N, H, H, 1.0f);
        wmat head = wmat_new(DF_DTYPE_BF16, V, H, H, 1.0f);
        int32_t label[70];
        for (int i = 0; i < N; i++)
            label[i] = (int32_t)(test_rand(&rng) % (uint64_t)V);
        label[5] = -1;
        mat dh[2] = {mat_new(N, H, H), mat_new(N, H, H)};
        float ce[2][70];
        double loss[2] = {0, 0};
        for (int b = 0; b < 2; b++) {
            poison(dh[b].p, N * H);
            CHECK_EQ(df_op_lmhead_ce(bes[b], &h.t, &head.t, label, NULL, 70.0f, &loss[b], &dh[b].t,
                                     NULL, ce[b], 0),
                     0);
        }
        CHECK(bitwise_equal(dh[0].p, dh[1].p, N * H * 4) && bitwise_equal(loss, loss + 1, 8));
        /* spot-check three rows against the reference */
        mat h3 = mat_new(3, H, H);
        int32_t l3[3] = {label[0], label[5], label[69]};
        memcpy(h3.p, h.p, H * sizeof(float));
        memcpy(h3.p + H, h.p + 5 * H, H * sizeof(float));
        memcpy(h3.p + 2 * H, h.p + 69 * H, H * sizeof(float));
        ce_ref ref;
        ce_reference(&h3, &head, l3, NULL, 70.0, &ref);
        const int64_t rows[3] = {0, 5, 69};
        for (int j = 0; j < 3; j++) {
            expect_close("lmhead_ce V=270001 ce", ce[0][rows[j]], ref.ce[j], 1e-4, rows[j]);
            for (int64_t k = 0; k < H; k++)
                expect_close("lmhead_ce V=270001 dh", dh[0].p[rows[j] * H + k], ref.dh[j * H + k],
                             1e-5 * ref.dh_mag[j * H + k] + 1e-9, rows[j] * H + k);
        }
        ce_ref_free(&ref);
        free(h.p), free(h3.p), free(dh[0].p), free(dh[1].p);
        wmat_free(&head);
    }

    /* Bad arguments. */
    const int64_t N = 4, H = 8, V = 6;
    mat h = mat_rand(N, H, H, 1.0f), dh = mat_new(N, H, H);
    wmat head = wmat_new(DF_DTYPE_BF16, V, H, H, 1.0f), head7 = wmat_new(DF_DTYPE_BF16, V, 7, 7, 1.0f);
    int32_t label[4] = {0, 5, -1, 2}, bad_label[4] = {0, 6, -1, 2}, am[4] = {-7, -7, -7, -7};
    float weight[4] = {1, 1, 1, 1}, bad_w[4] = {1, NAN, 1, 1}, neg_w[4] = {1, -1, 1, 1}, ce[4];
    double loss = 0;
    poison(dh.p, N * H), poison(ce, 4);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head7.t, label, weight, 1.0f, &loss, &dh.t, am, ce, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, bad_label, weight, 1.0f, &loss, &dh.t, am,
                             ce, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, bad_w, 1.0f, &loss, &dh.t, am, ce, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, neg_w, 1.0f, &loss, &dh.t, am, ce, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, NULL, weight, 1.0f, &loss, &dh.t, am, ce, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, 0.0f, &loss, &dh.t, am, ce, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, 1.0f, &loss, &dh.t, am, ce,
                             DF_CE_BF16_LOGITS | DF_CE_F16_LOGITS),
             -EINVAL); /* logits in one format */
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, INFINITY, &loss, &dh.t, am,
                             ce, 0),
             -EINVAL);
    df_tensor t = dh.t;
    t.shape[0] = 3;
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, 1.0f, &loss, &t, am, ce, 0),
                             -EINVAL);
    t = head.t, t.shape[0] = 0;
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &t, label, weight, 1.0f, &loss, &dh.t, am, ce, 0),
                             -EINVAL);
    /* dh over h; ce inside dh; argmax over label */
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, 1.0f, &loss, &h.t, am, ce, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, 1.0f, &loss, &dh.t, am,
                             dh.p + 3, 0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, 1.0f, &loss, &dh.t, label, ce,
                             0),
             -EINVAL);
    CHECK_EQ(df_op_lmhead_ce(NULL, &h.t, &head.t, label, weight, 1.0f, &loss, &dh.t, am, ce, 0),
             -EINVAL);
    CHECK(all_poison(dh.p, N * H) && all_poison(ce, 4) && loss == 0.0);
    for (int i = 0; i < 4; i++)
        CHECK_EQ(am[i], -7);
    /* without dh the denominator is not used */
    CHECK_EQ(df_op_lmhead_ce(bes[0], &h.t, &head.t, label, weight, 0.0f, &loss, NULL, am, ce, 0),
                             0);
    CHECK(loss > 0.0);
    free(h.p), free(dh.p);
    wmat_free(&head), wmat_free(&head7);
    check_half_logits(1); /* (last: the draws before it stay as they were) */
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void bench(void)
{
    /* LM head CE: N rows x V vocab x H, fwd + dh = 4 N V H flops. */
    {
        const int64_t Nr = 256, H = 512, V = 32000;
        mat h = mat_rand(Nr, H, H, 1.0f), dh = mat_new(Nr, H, H);
        wmat head = wmat_new(DF_DTYPE_BF16, V, H, H, 0.05f);
        int32_t *label = xmalloc((size_t)Nr * 4), *am = xmalloc((size_t)Nr * 4);
        for (int64_t i = 0; i < Nr; i++)
            label[i] = (int32_t)(test_rand(&rng) % (uint64_t)V);
        for (int nt = 1; nt <= 2; nt++) {
            df_backend *be = df_backend_cpu_open(nt, NULL);
            double best = 1e30, loss = 0;
            for (int rep = 0; rep < 3; rep++) {
                double t0 = now_s();
                CHECK_EQ(df_op_lmhead_ce(be, &h.t, &head.t, label, NULL, (float)Nr, &loss, &dh.t,
                                         am, NULL, 0),
                         0);
                double dt = now_s() - t0;
                best = dt < best ? dt : best;
            }
            printf("lmhead_ce N=%lld H=%lld V=%lld bf16 threads=%d: %.1f ms, %.1f GFLOP/s\n",
                   (long long)Nr, (long long)H, (long long)V, nt, best * 1e3,
                   4.0 * Nr * V * H / best * 1e-9);
            df_backend_close(be);
        }
        free(h.p), free(dh.p), free(label), free(am);
        wmat_free(&head);
    }
}

int main(void)
{
    if (open_backends())
        return 1;
    test_lmhead_ce();
    printf("finite differences, %-13s max |analytic - numeric| / max|grad| = %.2e\n",
           fd_name[FD_CE], fd_worst[FD_CE]);
    if (getenv("DFLASH_TRAIN_BENCH"))
        bench();
    close_backends();
    return test_main_end();
}
