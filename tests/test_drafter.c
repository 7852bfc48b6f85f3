/* test_drafter - the whole drafter's hand-written backward against finite
 * differences of its own forward: for every parameter tensor, the
 * directional derivative along a random direction inside that tensor,
 * (L(w + h v) - L(w - h v)) / 2h, must equal grad . v. Forward and loss run
 * in fp32, so the central difference carries ~eps_f32 * L / h of rounding
 * noise (~1e-5 here, h = 1e-2) plus O(h^2) truncation; a 2% relative
 * tolerance (with a small absolute floor) leaves a wide margin, while any
 * missing or wrong backward term (a dropped residual, a transposed GEMM, a
 * wrong norm path) moves the derivative by far more than that.
 *
 * The row has two documents, a padding block, a sliding layer (window 3)
 * and a full layer, GQA 4/2, so every path of the backward runs. Also:
 * gradients accumulate (two calls = 2x), metrics are sane, FP8 training's
 * rounding (df_drafter_set_fp8) moves the loss and gradients by about
 * E4M3's precision and nothing else, and a row whose blocks are all padding
 * gives loss 0 and zero gradients, not NaN. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "drafter.h"
#include "dtype.h"
#include "test.h"

enum { H = 16, K = 2, V = 37, BS = 4, S = 20, NB = 4, N = NB * BS };

static df_drafter_config cfg(void)
{
    df_drafter_config c;
    memset(&c, 0, sizeof c);
    c.block_size = BS;
    c.mask_token_id = 1;
    c.num_target_features = K;
    c.target_layer_ids[0] = 1;
    c.target_layer_ids[1] = 3;
    c.num_target_layers = 6;
    c.num_hidden_layers = 2;
    c.hidden_size = H;
    c.intermediate_size = 24;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 4;
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 10000;
    c.max_position_embeddings = 512;
    c.layer_types[0] = DF_LAYER_SLIDING;
    c.layer_types[1] = DF_LAYER_FULL;
    c.sliding_window = 3;
    c.use_sliding_window = true;
    c.vocab_size = V;
    return c;
}

static float feat[S * K * H], embed[V * H], head[V * H];
static int32_t ctx_pos[S], anchor[NB] = {3, 9, 14, 0}, dstart[NB] = {0, 0, 12, 0};
static uint8_t valid[NB] = {1, 1, 1, 0};
static uint32_t ids[S], block_ids[N];
static int32_t block_pos[N], labels[N];
static float weights[N];

static void make_row(df_drafter_row *r)
{
    uint64_t s = 99;
    for (int i = 0; i < S * K * H; i++)
        feat[i] = test_randn(&s);
    for (int i = 0; i < V * H; i++) {
        embed[i] = 0.5f * test_randn(&s);
        head[i] = 0.5f * test_randn(&s);
    }
    for (int t = 0; t < S; t++) {
        ids[t] = 2 + (uint32_t)(test_rand(&s) % (V - 2));
        ctx_pos[t] = t < 12 ? t : t - 12;
    }
    for (int b = 0; b < NB; b++) {
        int doc_end = dstart[b] == 0 ? 12 : S;
        for (int k = 0; k < BS; k++) {
            int i = b * BS + k, p = anchor[b] + k;
            block_ids[i] = k == 0 ? ids[anchor[b]] : 1;
            block_pos[i] = ctx_pos[anchor[b]] + k;
            labels[i] = (valid[b] && k > 0 && p < doc_end) ? (int32_t)ids[p] : -1;
            weights[i] = labels[i] >= 0 ? expf(-(float)(k - 1) / 7.0f) : 0.0f;
        }
    }
    memset(r, 0, sizeof *r);
    r->S = S;
    r->feat = feat;
    r->ctx_pos = ctx_pos;
    r->blocks = (df_dflash_blocks){.n_blocks = NB, .block_size = BS, .anchor = anchor,
                                   .doc_start = dstart, .valid = valid};
    r->block_ids = block_ids;
    r->block_pos = block_pos;
    r->labels = labels;
    r->weights = weights;
}

static double loss_at(df_drafter *d, const float *w, const df_drafter_row *r, float denom)
{
    df_drafter_metrics m = {0};
    df_err e = {0};
    int rc = df_drafter_row_step(d, w, r, denom, NULL, &m, &e);
    CHECK_OK(rc, &e);
    return m.loss_sum / denom;
}

/* df_params_init in slices over threads gives the bits of one pass: the
 * one-pass formula here, on a table whose large tensors are sliced (> 1 M
 * elements each). */
static uint64_t ref_mix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void check_init_slices(void)
{
    df_drafter_config c = cfg();
    c.hidden_size = 512;
    c.intermediate_size = 4608; /* gate/up/down 2.4 M elements each; fc 1 M */
    c.num_attention_heads = 8;
    c.num_key_value_heads = 2;
    c.head_dim = 64;
    df_params ps;
    df_err e = {0};
    CHECK_OK(df_params_build(&c, &ps, &e), &e);
    float *a = malloc((size_t)ps.total * 4), *b = malloc((size_t)ps.total * 4);
    df_params_init(&ps, a, 0.02f, 99);
    int64_t big = 0;
    for (int i = 0; i < ps.n; i++) {
        const df_param *p = &ps.p[i];
        uint64_t st = 99 ^ (0xD1B54A32D192ED03ull * (uint64_t)(i + 1));
        big += p->numel > ((int64_t)1 << 20);
        for (int64_t k = 0; k < p->numel; k++) {
            if (p->is_norm) {
                b[p->offset + k] = 1.0f;
                continue;
            }
            double u1 = ((ref_mix(&st) >> 11) + 1) * 0x1.0p-53, u2 = (ref_mix(&st) >> 11) * 0x1.0p-53;
            b[p->offset + k] = (float)((double)0.02f * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
        }
    }
    CHECK(big >= 3);
    CHECK(memcmp(a, b, (size_t)ps.total * 4) == 0);
    free(a);
    free(b);
    df_params_free(&ps);
}

int main(void)
{
    check_init_slices();
    df_err e = {0};
    df_backend *be = df_backend_cpu_open(2, &e);
    df_drafter_config c = cfg();
    df_tensor te = df_tensor_2d(embed, DF_DTYPE_F32, V, H), th = df_tensor_2d(head, DF_DTYPE_F32, V, H);
    df_drafter_row r;
    make_row(&r);
    df_drafter *d = NULL;
    CHECK_OK(df_drafter_open(&c, be, &te, &th, &d, &e), &e);
    if (!d)
        return test_main_end();
    const df_params *ps = df_drafter_params(d);
    float *w = malloc((size_t)ps->total * 4), *g = calloc((size_t)ps->total, 4),
          *g2 = calloc((size_t)ps->total, 4), *v = malloc((size_t)ps->total * 4);
    df_params_init(ps, w, 0.2f, 7);
    /* norms at exactly 1 hide a w vs (1+w) mix-up: perturb them */
    uint64_t s = 5;
    for (int i = 0; i < ps->n; i++)
        if (ps->p[i].is_norm)
            for (int64_t k = 0; k < ps->p[i].numel; k++)
                w[ps->p[i].offset + k] = 1.0f + 0.2f * test_randn(&s);
    float denom = 0;
    for (int i = 0; i < N; i++)
        denom += weights[i];
    df_drafter_metrics m = {0};
    CHECK_OK(df_drafter_row_step(d, w, &r, denom, g, &m, &e), &e);
    double L0 = m.loss_sum / denom;
    printf("loss %.6f over %llu valid blocks\n", L0, (unsigned long long)m.blocks);
    CHECK(isfinite(L0) && L0 > 0);
    CHECK_EQ(m.blocks, 3);
    /* the metrics from a chosen argmax: block 0 right at all 3 positions, block 1
     * wrong at its first, block 2 right, wrong, right: accepted 3, 0, 1 */
    {
        int32_t am[N];
        int na = 0;
        const int want_ok[NB][BS] = {{0, 1, 1, 1}, {0, 0, 1, 1}, {0, 1, 0, 1}, {0}};
        for (int b = 0; b < NB; b++)
            for (int k = 0; k < BS; k++) {
                int i = b * BS + k;
                if (labels[i] >= 0 && weights[i] > 0)
                    am[na++] = want_ok[b][k] ? labels[i] : (labels[i] + 1) % V;
            }
        int32_t ba[NB] = {7, 7, 7, 7};
        df_drafter_metrics mm = {0};
        mm.block_accepted = ba;
        df_drafter_row_metrics(d, &r, am, &mm);
        CHECK_EQ(mm.blocks, 3);
        CHECK_EQ(mm.accepted, 4);
        CHECK_EQ(ba[0], 3);
        CHECK_EQ(ba[1], 0);
        CHECK_EQ(ba[2], 1);
        CHECK_EQ(ba[3], -1); /* padding */
        CHECK_EQ(mm.counted[1], 3);
        CHECK_EQ(mm.correct[1], 2);
        CHECK_EQ(mm.counted[2], 3); /* acc[k] counts every scored position, */
        CHECK_EQ(mm.correct[2], 2); /* after a miss too (block 1's position 2) */
        CHECK_EQ(mm.counted[3], 2); /* block 1 has no position 3 (its document ends) */
        CHECK_EQ(mm.correct[3], 2);
    }
    /* accumulation: a second call adds the same gradient */
    memcpy(g2, g, (size_t)ps->total * 4);
    CHECK_OK(df_drafter_row_step(d, w, &r, denom, g2, NULL, &e), &e);
    int acc_bad = 0;
    for (int64_t i = 0; i < ps->total; i++)
        acc_bad += fabsf(g2[i] - 2 * g[i]) > 1e-6f * (1 + fabsf(g[i]));
    CHECK_EQ(acc_bad, 0);
    /* grad_write (a step's first row): every gradient written over whatever the array held,
     * the same bits as added to zeros, for F32 and BF16 gradients; a row added after it
     * accumulates as before */
    for (int bf = 0; bf < 2; bf++) {
        CHECK_OK(df_drafter_set_grad_dtype(d, bf ? DF_DTYPE_BF16 : DF_DTYPE_F32), NULL);
        size_t es = bf ? 2 : 4, gb = (size_t)ps->total * es;
        uint8_t *ga = calloc(1, gb), *gw = malloc(gb), *ga2 = malloc(gb);
        CHECK(ga && gw && ga2);
        for (size_t i = 0; i < gb; i++)
            gw[i] = (uint8_t)(0x3f ^ (i * 37)); /* junk, NaN patterns included */
        df_drafter_row rw = r;
        rw.grad_write = 1;
        df_drafter_metrics ma = {0}, mw = {0};
        CHECK_OK(df_drafter_row_step(d, w, &r, denom, ga, &ma, &e), &e);
        CHECK_OK(df_drafter_row_step(d, w, &rw, denom, gw, &mw, &e), &e);
        CHECK(ma.loss_sum == mw.loss_sum);
        CHECK(memcmp(ga, gw, gb) == 0);
        memcpy(ga2, ga, gb);
        CHECK_OK(df_drafter_row_step(d, w, &r, denom, ga2, NULL, &e), &e);
        CHECK_OK(df_drafter_row_step(d, w, &r, denom, gw, NULL, &e), &e);
        CHECK(memcmp(ga2, gw, gb) == 0);
        free(ga), free(gw), free(ga2);
    }
    CHECK_OK(df_drafter_set_grad_dtype(d, DF_DTYPE_F32), NULL);
    /* recomputing in the backward (1: the cheap activations; 2: also the
     * MLP's gate/up projections): the same bits */
    for (int level = 1; level <= 2; level++) {
        df_drafter_set_recompute(d, level);
        memset(g2, 0, (size_t)ps->total * 4);
        df_drafter_metrics m2 = {0};
        CHECK_OK(df_drafter_row_step(d, w, &r, denom, g2, &m2, &e), &e);
        CHECK(m2.loss_sum == m.loss_sum);
        CHECK(memcmp(g, g2, (size_t)ps->total * 4) == 0);
    }
    df_drafter_set_recompute(d, 0);
    /* BF16 gradient storage: the same loss; every tensor within bf16
     * rounding of the F32 gradients (each op rounds its sum once; a tensor two
     * ops add to, twice), relative L2 <= 2^-7 */
    CHECK_EQ(df_drafter_set_grad_dtype(d, DF_DTYPE_F16), -EINVAL);
    CHECK_OK(df_drafter_set_grad_dtype(d, DF_DTYPE_BF16), NULL);
    CHECK_EQ(df_drafter_grad_dtype(d), DF_DTYPE_BF16);
    {
        uint16_t *g16 = calloc((size_t)ps->total, 2);
        df_drafter_metrics m3 = {0};
        CHECK_OK(df_drafter_row_step(d, w, &r, denom, g16, &m3, &e), &e);
        CHECK(m3.loss_sum == m.loss_sum);
        for (int i = 0; i < ps->n; i++) {
            const df_param *p = &ps->p[i];
            double dd = 0, nn = 0;
            for (int64_t k = 0; k < p->numel; k++) {
                double x = g[p->offset + k], y = df_bf16_to_f32(g16[p->offset + k]);
                dd += (x - y) * (x - y);
                nn += x * x;
            }
            if (!(nn > 0) || !(sqrt(dd / nn) <= 1.0 / 128)) {
                fprintf(stderr, "bf16 gradient of %s: rel L2 %.3g vs F32 (|g| %.3g)\n", p->name,
                        sqrt(dd / (nn > 0 ? nn : 1)), sqrt(nn));
                df_test_failures++;
            }
        }
        free(g16);
    }
    CHECK_OK(df_drafter_set_grad_dtype(d, DF_DTYPE_F32), NULL);

    const double h = 1e-2;
    for (int i = 0; i < ps->n; i++) {
        const df_param *p = &ps->p[i];
        memset(v, 0, (size_t)ps->total * 4);
        double vn = 0, dot = 0;
        for (int64_t k = 0; k < p->numel; k++) {
            float x = test_randn(&s);
            v[p->offset + k] = x;
            vn += (double)x * x;
        }
        vn = sqrt(vn);
        for (int64_t k = 0; k < p->numel; k++) {
            v[p->offset + k] /= (float)vn;
            dot += (double)v[p->offset + k] * g[p->offset + k];
        }
        for (int64_t k = 0; k < p->numel; k++)
            w[p->offset + k] += (float)(h * v[p->offset + k]);
        double lp = loss_at(d, w, &r, denom);
        for (int64_t k = 0; k < p->numel; k++)
            w[p->offset + k] -= (float)(2 * h * v[p->offset + k]);
        double lm = loss_at(d, w, &r, denom);
        for (int64_t k = 0; k < p->numel; k++)
            w[p->offset + k] += (float)(h * v[p->offset + k]);
        double fd = (lp - lm) / (2 * h);
        int ok = fabs(fd - dot) <= 2e-2 * fabs(dot) + 2e-4;
        printf("%-40s grad.v %+.6f  finite diff %+.6f %s\n", p->name, dot, fd, ok ? "" : "<-- MISMATCH");
        if (!ok)
            df_test_failures++;
    }

    /* FP8 training: forward-only steps keep the BF16 GEMMs (the same loss);
     * steps with gradients round the GEMM operands: the loss and every
     * gradient tensor move by E4M3's rounding (3 mantissa bits: up to 6%
     * per operand; at these sizes, sums of 16 or 37 terms that average
     * nothing, the gradients move by 8-30% relative L2), the same bits on a
     * rerun and with recomputation; off again, the old bits. */
    {
        /* the baseline at w as the finite differences left it */
        df_drafter_metrics mb = {0};
        memset(g, 0, (size_t)ps->total * 4);
        CHECK_OK(df_drafter_row_step(d, w, &r, denom, g, &mb, &e), &e);
        m = mb;
        L0 = mb.loss_sum / denom;
    }
    CHECK_OK(df_drafter_set_fp8(d, 1, &e), &e);
    CHECK(loss_at(d, w, &r, denom) == L0);
    {
        df_drafter_metrics m8 = {0};
        memset(g2, 0, (size_t)ps->total * 4);
        CHECK_OK(df_drafter_row_step(d, w, &r, denom, g2, &m8, &e), &e);
        double L8 = m8.loss_sum / denom;
        printf("fp8: loss %.6f (bf16 GEMMs %.6f)\n", L8, L0);
        CHECK(L8 != L0 && fabs(L8 - L0) < 0.05 * L0);
        for (int i = 0; i < ps->n; i++) {
            const df_param *p = &ps->p[i];
            double dd = 0, nn = 0;
            for (int64_t k = 0; k < p->numel; k++) {
                double x = g[p->offset + k], y = g2[p->offset + k];
                dd += (x - y) * (x - y);
                nn += x * x;
            }
            double rel = sqrt(dd / (nn > 0 ? nn : 1));
            if (!(nn > 0) || !(rel <= 0.4) || !(rel > 1e-3)) {
                fprintf(stderr, "fp8 gradient of %s: rel L2 %.3g vs the BF16 GEMMs'\n", p->name,
                        rel);
                df_test_failures++;
            }
        }
        float *g3 = calloc((size_t)ps->total, 4);
        for (int level = 0; level <= 2; level++) {
            df_drafter_set_recompute(d, level);
            df_drafter_metrics m9 = {0};
            memset(g3, 0, (size_t)ps->total * 4);
            CHECK_OK(df_drafter_row_step(d, w, &r, denom, g3, &m9, &e), &e);
            CHECK(m9.loss_sum == m8.loss_sum);
            CHECK(memcmp(g3, g2, (size_t)ps->total * 4) == 0);
        }
        df_drafter_set_recompute(d, 0);
        CHECK_OK(df_drafter_set_fp8(d, 0, &e), &e);
        memset(g3, 0, (size_t)ps->total * 4);
        df_drafter_metrics m10 = {0};
        CHECK_OK(df_drafter_row_step(d, w, &r, denom, g3, &m10, &e), &e);
        CHECK(m10.loss_sum == m.loss_sum);
        CHECK(memcmp(g3, g, (size_t)ps->total * 4) == 0);
        free(g3);
    }

    /* All padding: loss 0, gradients 0, no NaN. */
    uint8_t none[NB] = {0, 0, 0, 0};
    int32_t nl[N];
    float nw[N];
    for (int i = 0; i < N; i++) {
        nl[i] = -1;
        nw[i] = 0;
    }
    df_drafter_row r0 = r;
    r0.blocks.valid = none;
    r0.labels = nl;
    r0.weights = nw;
    memset(g, 0, (size_t)ps->total * 4);
    df_drafter_metrics m0 = {0};
    CHECK_OK(df_drafter_row_step(d, w, &r0, 1.0f, g, &m0, &e), &e);
    CHECK(m0.loss_sum == 0 && m0.blocks == 0);
    int nz = 0;
    for (int64_t i = 0; i < ps->total; i++)
        nz += g[i] != 0 || isnan(g[i]);
    CHECK_EQ(nz, 0);

    free(w);
    free(g);
    free(g2);
    free(v);
    df_drafter_close(d);
    df_backend_close(be);
    return test_main_end();
}
