/* test_dflash_attn.c - the DFlash drafter attention (train_ops.h), forward
 * and backward, on the CPU reference backend, against references in double
 * precision (dflash_ref.c, independent of kernels/cpu):
 *   - a naive forward that builds the whole boolean mask [rows x (S + rows)]
 *     from the rules in docs/DRAFTER.md and does a dense softmax;
 *   - an analytic backward on the same mask;
 *   - central finite differences of L = sum(out * R) through the naive
 *     forward (tiny shapes), which also validate the analytic reference.
 * Every op runs on a 1-thread and a 3-thread backend: bitwise equal results.
 * Outputs are NaN-poisoned first and carry padding columns that must stay
 * poisoned; inputs are random (never zeros). Structural zeros (padding
 * blocks, keys nobody sees) must be exactly 0: their tolerance is 0.
 * Named tests for the public bugs (docs/DRAFTER.md): j <= anchor, a causal mask on
 * full layers, cross-document leakage.
 *
 * Tolerances (u = 2^-24): an fp32 score s = scale * (q . k) is off by at
 * most ~ D u scale sum|q k| (smax bounds it; sqrt(D) u typically), which
 * moves exp(s - lse) by that relatively; lse adds ~ n u (n keys summed).
 * So every result is compared with tol = M * (1e-5 + 1e-6 * smax), M the
 * same sum with every term replaced by its absolute value (for gradients:
 * dS -> P (|dO||v| + |dO||O|), the dot products taken term-wise in |.|).
 * That is >= 20x the worst error seen (the worst ratio err/tol is printed)
 * and still far below what one key too many or too few changes (~ 1/n of
 * the magnitude).
 *
 * DFLASH_ATTN_BENCH=1 also times forward and backward at S=1024, 32 blocks
 * x 16, nq=8, nkv=2, D=64 on 1 thread. */
#include "dflash_ref.h"
#include "ops.h"
#include "test.h"
#include "train_ops.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static df_backend *bes[2]; /* 1 and 3 threads */

static const uint32_t POISON = 0x7fc0dead;

static void poison(float *p, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        memcpy(&p[i], &POISON, 4);
}

static int is_poison(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u == POISON;
}

/* ---- comparisons ---- */

typedef struct cmp {
    const char *what;
    double worst; /* max err / tol over elements with tol > 0 */
    int bad;
} cmp;

static void cmp_one(cmp *c, const char *name, int64_t idx, double got, double ref, double tol)
{
    double err = fabs(got - ref);
    if (got == ref) /* also -inf == -inf */
        err = 0;
    if (!(err <= tol)) {
        if (c->bad < 6)
            fprintf(stderr, "%s: %s[%lld] = %.9g, want %.9g (err %.3g, tol %.3g)\n", c->what,
                    name, (long long)idx, got, ref, err, tol);
        c->bad++;
        df_test_failures++;
        return;
    }
    if (tol > 0 && err / tol > c->worst)
        c->worst = err / tol;
}

static int bitwise_equal(const float *a, const float *b, int64_t n)
{
    return memcmp(a, b, (size_t)n * sizeof(float)) == 0;
}

/* Columns [c0 + cols, ld) and [0, c0) of every row still poisoned. */
static int pad_intact(const mat *m, int64_t c0, int64_t cols)
{
    for (int64_t r = 0; r < m->rows; r++)
        for (int64_t c = 0; c < m->ld; c++)
            if ((c < c0 || c >= c0 + cols) && !is_poison(m->p[r * m->ld + c]))
                return 0;
    return 1;
}

static double tolf(const prob *P, const fref *F)
{
    (void)P;
    return 1e-5 + 1e-6 * F->smax;
}

/* Outputs of one run of forward + backward. */
typedef struct run {
    mat out, lse, dq, dkcv, dkbv;
    df_tensor o, l, gq, gkc, gvc, gkb, gvb;
} run;

static void run_alloc(run *U, const prob *P)
{
    int64_t qc = (int64_t)P->nq * P->D, kvc = (int64_t)P->nkv * P->D;
    U->out = dref_mat(P->rows, qc + 1);
    U->lse = dref_mat(P->rows, P->nq + 2);
    U->dq = dref_mat(P->rows, qc + 3);
    U->dkcv = dref_mat(P->S, 2 * kvc); /* dkc | dvc: adjacent column views */
    U->dkbv = dref_mat(P->rows, 2 * kvc + 2);
    U->o = dref_view(&U->out, 0, qc);
    U->l = dref_view(&U->lse, 1, P->nq);
    U->gq = dref_view(&U->dq, 0, qc);
    U->gkc = dref_view(&U->dkcv, 0, kvc);
    U->gvc = dref_view(&U->dkcv, kvc, kvc);
    U->gkb = dref_view(&U->dkbv, 2, kvc);
    U->gvb = dref_view(&U->dkbv, 2 + kvc, kvc);
    mat *all[5] = {&U->out, &U->lse, &U->dq, &U->dkcv, &U->dkbv};
    for (int i = 0; i < 5; i++)
        poison(all[i]->p, all[i]->rows * all[i]->ld);
}

static void run_free(run *U)
{
    free(U->out.p);
    free(U->lse.p);
    free(U->dq.p);
    free(U->dkcv.p);
    free(U->dkbv.p);
}

static int fwd(df_backend *be, const prob *P, run *U)
{
    return df_op_dflash_attn(be, &P->q, &P->kc, &P->vc, &P->kb, &P->vb, &P->blk, P->nq, P->nkv,
                             P->D, P->scale, &U->o, &U->l);
}

static int bwd(df_backend *be, const prob *P, run *U, const df_tensor *dout)
{
    return df_op_dflash_attn_bwd(be, &P->q, &P->kc, &P->vc, &P->kb, &P->vb, &P->blk, P->nq,
                                 P->nkv, P->D, P->scale, &U->o, &U->l, dout, &U->gq, &U->gkc,
                                 &U->gvc, &U->gkb, &U->gvb);
}

/* Forward + backward on both backends: 0 returned, paddings intact, the two
 * bitwise equal. U[0] is the 1-thread run. */
static void run_both(const prob *P, const df_tensor *dout, run U[2], const char *what)
{
    for (int t = 0; t < 2; t++) {
        run_alloc(&U[t], P);
        CHECK_EQ(fwd(bes[t], P, &U[t]), 0);
        CHECK_EQ(bwd(bes[t], P, &U[t], dout), 0);
        int64_t qc = (int64_t)P->nq * P->D, kvc = (int64_t)P->nkv * P->D;
        CHECK(pad_intact(&U[t].out, 0, qc));
        CHECK(pad_intact(&U[t].lse, 1, P->nq));
        CHECK(pad_intact(&U[t].dq, 0, qc));
        CHECK(pad_intact(&U[t].dkbv, 2, 2 * kvc));
    }
    mat *a[5] = {&U[0].out, &U[0].lse, &U[0].dq, &U[0].dkcv, &U[0].dkbv};
    mat *b[5] = {&U[1].out, &U[1].lse, &U[1].dq, &U[1].dkcv, &U[1].dkbv};
    for (int i = 0; i < 5; i++)
        if (!bitwise_equal(a[i]->p, b[i]->p, a[i]->rows * a[i]->ld)) {
            fprintf(stderr, "%s: output %d differs between 1 and 3 threads\n", what, i);
            df_test_failures++;
        }
}

static void check_forward(const prob *P, const run *U, const fref *F, cmp *c)
{
    double t = tolf(P, F);
    int64_t qc = (int64_t)P->nq * P->D;
    for (int64_t i = 0; i < P->rows; i++)
        for (int h = 0; h < P->nq; h++) {
            for (int e = 0; e < P->D; e++) {
                int64_t k = i * qc + (int64_t)h * P->D + e;
                cmp_one(c, "out", k, dref_get(&U->o, i, (int64_t)h * P->D + e), F->out[k],
                        F->mag[k] * t);
            }
            double L = F->lse[i * P->nq + h];
            double tl = L == -INFINITY ? 0 : t + 4 * 6e-8 * F->nvis[i * P->nq + h];
            cmp_one(c, "lse", i * P->nq + h, dref_get(&U->l, i, h), L, tl);
        }
}

static const char *const gname[5] = {"dq", "dkc", "dvc", "dkb", "dvb"};

static const df_tensor *grad_view(const run *U, int i)
{
    const df_tensor *g[5] = {&U->gq, &U->gkc, &U->gvc, &U->gkb, &U->gvb};
    return g[i];
}

/* The op's gradients vs want (analytic or FD), tolerance from magnitudes M
 * (structural zeros: M = 0, so exactly 0), plus extra absolute slack. */
static void check_grads(const prob *P, const run *U, const dinp *X, double *const want[5],
                        const gref *G, double t, double slack, cmp *c)
{
    for (int i = 0; i < 5; i++)
        for (int64_t r = 0; r < X->rows[i]; r++)
            for (int64_t col = 0; col < X->cols[i]; col++) {
                int64_t k = r * X->cols[i] + col;
                double m = G->m[i][k];
                cmp_one(c, gname[i], k, dref_get(grad_view(U, i), r, col), want[i][k],
                        m > 0 ? m * t + slack : 0);
            }
    (void)P;
}

/* One configuration: forward vs the naive reference, backward vs the
 * analytic reference, and (fd) both vs finite differences. */
static void check_config(const prob *P, int fd, const char *what)
{
    int64_t qc = (int64_t)P->nq * P->D;
    mat Rm = dref_mat(P->rows, qc + 1);
    dref_fill(&Rm, 1.0f);
    df_tensor R = dref_view(&Rm, 1, qc);
    double *Rd = dref_dbuf(P->rows * qc);
    for (int64_t i = 0; i < P->rows; i++)
        for (int64_t c = 0; c < qc; c++)
            Rd[i * qc + c] = dref_get(&R, i, c);

    run U[2];
    run_both(P, &R, U, what);
    dinp X;
    dref_dinp_init(&X, P);
    fref F;
    dref_fref_alloc(&F, P);
    dref_forward(P, &X, &F);
    cmp cf = {what, 0, 0};
    check_forward(P, &U[0], &F, &cf);
    /* Padding blocks: exactly 0 and -inf (the tolerance there is 0 already;
     * spelled out so the intent is plain). */
    for (int b = 0; b < P->nb; b++)
        if (!P->valid[b])
            for (int qo = 0; qo < P->bs; qo++) {
                int64_t r = (int64_t)b * P->bs + qo;
                for (int h = 0; h < P->nq; h++)
                    CHECK(dref_get(&U[0].l, r, h) == -INFINITY);
                for (int64_t c = 0; c < qc; c++) {
                    CHECK(dref_get(&U[0].o, r, c) == 0.0f);
                    CHECK(dref_get(&U[0].gq, r, c) == 0.0f);
                }
                for (int64_t c = 0; c < (int64_t)P->nkv * P->D; c++)
                    CHECK(dref_get(&U[0].gkb, r, c) == 0.0f && dref_get(&U[0].gvb, r, c) == 0.0f);
            }

    gref G;
    dref_gref_alloc(&G, &X);
    dref_backward(P, &X, Rd, &G);
    cmp cb = {what, 0, 0};
    double t = tolf(P, &F);
    check_grads(P, &U[0], &X, G.g, &G, t, 0, &cb);

    double worst_fd = 0, worst_ref_fd = 0;
    if (fd) {
        /* Central differences of L through the naive double forward:
         * truncation ~ h^2 |L'''| ~ 1e-10, rounding ~ 1e-16 |L| / h ~ 1e-10;
         * slack 1e-7 covers both with room. The analytic reference must match
         * them to 1e-7 * (M + 1): it is exact up to double rounding. */
        double *fdg[5];
        fref Ft;
        dref_fref_alloc(&Ft, P);
        const double h = 1e-5;
        for (int i = 0; i < 5; i++) {
            int64_t n = X.rows[i] * X.cols[i];
            fdg[i] = dref_dbuf(n);
            for (int64_t k = 0; k < n; k++) {
                double keep = X.x[i][k];
                X.x[i][k] = keep + h;
                double Lp = dref_loss(P, &X, Rd, &Ft);
                X.x[i][k] = keep - h;
                double Lm = dref_loss(P, &X, Rd, &Ft);
                X.x[i][k] = keep;
                fdg[i][k] = (Lp - Lm) / (2 * h);
                double dev = fabs(G.g[i][k] - fdg[i][k]);
                if (!(dev <= 1e-7 * (G.m[i][k] + 1))) {
                    fprintf(stderr, "%s: analytic reference %s[%lld] = %.12g, fd %.12g\n", what,
                            gname[i], (long long)k, G.g[i][k], fdg[i][k]);
                    df_test_failures++;
                }
                worst_ref_fd = fmax(worst_ref_fd, dev);
            }
        }
        cmp cd = {what, 0, 0};
        for (int i = 0; i < 5; i++) /* structural zeros: fd is ~1e-12, not 0 */
            for (int64_t k = 0; k < X.rows[i] * X.cols[i]; k++)
                if (G.m[i][k] == 0 && fabs(fdg[i][k]) > 1e-9) {
                    fprintf(stderr, "%s: fd sees a gradient the mask forbids: %s[%lld] = %g\n",
                            what, gname[i], (long long)k, fdg[i][k]);
                    df_test_failures++;
                }
        /* op vs fd: where the mask allows a gradient */
        for (int i = 0; i < 5; i++)
            for (int64_t r = 0; r < X.rows[i]; r++)
                for (int64_t col = 0; col < X.cols[i]; col++) {
                    int64_t k = r * X.cols[i] + col;
                    if (G.m[i][k] > 0)
                        cmp_one(&cd, gname[i], k, dref_get(grad_view(&U[0], i), r, col), fdg[i][k],
                                G.m[i][k] * t + 1e-7);
                }
        worst_fd = cd.worst;
        for (int i = 0; i < 5; i++)
            free(fdg[i]);
        dref_fref_free(&Ft);
    }
    printf("%-44s fwd err/tol %.3f  bwd err/tol %.3f", what, cf.worst, cb.worst);
    if (fd)
        printf("  vs fd %.3f (ref-fd max %.1e)", worst_fd, worst_ref_fd);
    printf("\n");
    dref_gref_free(&G);
    dref_fref_free(&F);
    dref_dinp_free(&X);
    run_free(&U[0]);
    run_free(&U[1]);
    free(Rm.p);
    free(Rd);
}

/* ---- configurations ---- */

/* Tiny, for finite differences. Documents [0,5) and [5,12). */
static const blkdef tiny_blocks[] = {
    {2, 0, 1},  /* inside doc 0 */
    {0, 0, 1},  /* anchor == doc start: only block keys */
    {4, 0, 1},  /* anchor at doc 0's last token */
    {11, 5, 1}, /* last token of doc 1 (and of the context) */
    {-3, 99, 0} /* padding with junk anchor/doc: never read */
};

/* Medium: documents [0,40), [40,41), [41,120), [120,200). */
static const blkdef med_blocks[] = {
    {0, 0, 1},    {39, 0, 1},   {17, 0, 1},  {40, 40, 1}, {41, 41, 1},   {119, 41, 1},
    {90, 41, 1},  {0, 0, 0},    {150, 120, 1}, {199, 120, 1}, {123, 120, 1}, {7, 0, 0},
};

static void test_configs(void)
{
    static const int gqa[][2] = {{4, 2}, {4, 1}, {2, 2}};
    char what[128];
    prob P;
    for (int gi = 0; gi < 3; gi++)
        for (int wi = 0; wi < 3; wi++) {
            int W = (int[]){0, 2, 3}[wi];
            dref_prob_init(&P, 12, 3, gqa[gi][0], gqa[gi][1], 4, W, tiny_blocks, 5, 1.0f);
            snprintf(what, sizeof what, "tiny nq=%d nkv=%d D=4 bs=3 W=%d", P.nq, P.nkv, W);
            check_config(&P, 1, what);
            dref_prob_free(&P);
        }
    int nmed = (int)(sizeof med_blocks / sizeof med_blocks[0]);
    for (int gi = 0; gi < 3; gi++)
        for (int wi = 0; wi < 4; wi++) {
            int W = (int[]){0, 5, 30, 1}[wi];
            dref_prob_init(&P, 200, 8, gqa[gi][0], gqa[gi][1], 16, W, med_blocks, nmed, 1.0f);
            snprintf(what, sizeof what, "medium nq=%d nkv=%d D=16 bs=8 W=%d", P.nq, P.nkv, W);
            check_config(&P, 0, what);
            dref_prob_free(&P);
        }
    /* Bigger heads, GQA 4, sharp softmax (scores ~ +-30), a window wider than S. */
    for (int wi = 0; wi < 2; wi++) {
        int W = (int[]){0, 2048}[wi];
        dref_prob_init(&P, 200, 16, 8, 2, 64, W, med_blocks, nmed, 2.0f);
        snprintf(what, sizeof what, "sharp nq=8 nkv=2 D=64 bs=16 W=%d", W);
        check_config(&P, 0, what);
        dref_prob_free(&P);
    }
    /* A few FD checks at a medium-ish size with odd D and bs 1. */
    static const blkdef small[] = {{3, 0, 1}, {6, 4, 1}, {6, 6, 1}, {1, 0, 1}};
    dref_prob_init(&P, 8, 1, 3, 1, 5, 0, small, 4, 1.0f);
    check_config(&P, 1, "small nq=3 nkv=1 D=5 bs=1 W=0");
    dref_prob_free(&P);
    dref_prob_init(&P, 8, 4, 2, 1, 3, 2, small, 4, 1.5f);
    check_config(&P, 1, "small nq=2 nkv=1 D=3 bs=4 W=2");
    dref_prob_free(&P);
}

/* ---- the public bugs, named ---- */

/* out of block b (all rows, all heads) from a fresh forward on bes[1]. */
static float *block_out(const prob *P, int b)
{
    run U;
    run_alloc(&U, P);
    CHECK_EQ(fwd(bes[1], P, &U), 0);
    int64_t qc = (int64_t)P->nq * P->D;
    float *o = dref_xmalloc((size_t)(P->bs * qc) * sizeof(float));
    for (int qo = 0; qo < P->bs; qo++)
        for (int64_t c = 0; c < qc; c++)
            o[qo * qc + c] = dref_get(&U.o, (int64_t)b * P->bs + qo, c);
    run_free(&U);
    return o;
}

static void perturb_row(const df_tensor *t, int64_t r)
{
    for (int64_t c = 0; c < t->shape[1]; c++)
        *(float *)df_tensor_at(t, r, c) += 3.0f;
}

/* Row qo of block b (all heads) equal in a and b (bitwise)? */
static int rows_equal(const prob *P, const float *a, const float *b, int qo)
{
    int64_t qc = (int64_t)P->nq * P->D;
    return memcmp(a + qo * qc, b + qo * qc, (size_t)qc * sizeof(float)) == 0;
}

/* Bug 1: context visibility is j < anchor, not j <= anchor. */
static void test_bug_anchor_strict(void)
{
    int nmed = (int)(sizeof med_blocks / sizeof med_blocks[0]);
    for (int W = 0; W <= 5; W += 5) {
        prob P;
        dref_prob_init(&P, 200, 8, 4, 2, 16, W, med_blocks, nmed, 1.0f);
        const int b = 2; /* anchor 17 in doc [0, 40) */
        int64_t p = P.anchor[b];
        float *base = block_out(&P, b);
        perturb_row(&P.kc, p);
        perturb_row(&P.vc, p);
        float *after = block_out(&P, b);
        for (int qo = 0; qo < P.bs; qo++)
            CHECK(rows_equal(&P, base, after, qo)); /* the anchor key is invisible */
        free(after);
        /* Power: the key just before the anchor is seen by row 0. */
        perturb_row(&P.kc, p - 1);
        perturb_row(&P.vc, p - 1);
        after = block_out(&P, b);
        CHECK(!rows_equal(&P, base, after, 0));
        free(after);
        free(base);
        dref_prob_free(&P);
    }
}

/* Bug 2: full layers bidirectional in the block, sliding layers causal. */
static void test_bug_block_mask(void)
{
    int nmed = (int)(sizeof med_blocks / sizeof med_blocks[0]);
    for (int W = 0; W <= 5; W += 5) {
        prob P;
        dref_prob_init(&P, 200, 8, 4, 2, 16, W, med_blocks, nmed, 1.0f);
        const int b = 5;
        float *base = block_out(&P, b);
        int64_t last = (int64_t)b * P.bs + P.bs - 1;
        perturb_row(&P.kb, last);
        perturb_row(&P.vb, last);
        float *after = block_out(&P, b);
        if (W == 0) {
            for (int qo = 0; qo < P.bs; qo++)
                CHECK(!rows_equal(&P, base, after, qo)); /* q_off 0 sees key bs-1 */
        } else {
            for (int qo = 0; qo < P.bs - 1; qo++)
                CHECK(rows_equal(&P, base, after, qo)); /* causal: only row bs-1 sees it */
            CHECK(!rows_equal(&P, base, after, P.bs - 1));
        }
        free(after);
        /* Other blocks never see this block's keys. */
        float *o4 = block_out(&P, 4);
        perturb_row(&P.kb, last);
        float *o4b = block_out(&P, 4);
        for (int qo = 0; qo < P.bs; qo++)
            CHECK(rows_equal(&P, o4, o4b, qo));
        free(o4);
        free(o4b);
        free(base);
        dref_prob_free(&P);
    }
}

/* Bug 3: no cross-document leakage (and padding blocks see nothing). */
static void test_bug_cross_document(void)
{
    int nmed = (int)(sizeof med_blocks / sizeof med_blocks[0]);
    for (int W = 0; W <= 30; W += 30) {
        prob P;
        dref_prob_init(&P, 200, 8, 4, 2, 16, W, med_blocks, nmed, 1.0f);
        /* blocks 4, 5, 6 live in doc [41, 120); 0, 1, 2 in [0, 40); 3 in [40, 41) */
        int in_doc[] = {5, 6}, other[] = {0, 1, 2, 3, 8, 9, 10, 4};
        float *base[8], *after;
        for (int i = 0; i < 8; i++)
            base[i] = block_out(&P, other[i]);
        float *own[2] = {block_out(&P, in_doc[0]), block_out(&P, in_doc[1])};
        /* Every context key of doc [41, 120) but its first (block 4's anchor
         * 41 sees none of them either way). */
        for (int64_t j = 41; j < 120; j++) {
            perturb_row(&P.kc, j);
            perturb_row(&P.vc, j);
        }
        for (int i = 0; i < 8; i++) {
            after = block_out(&P, other[i]);
            for (int qo = 0; qo < P.bs; qo++)
                CHECK(rows_equal(&P, base[i], after, qo));
            free(after);
            free(base[i]);
        }
        /* Power: the document's own blocks with context do change. */
        for (int i = 0; i < 2; i++) {
            after = block_out(&P, in_doc[i]);
            CHECK(!rows_equal(&P, own[i], after, 0));
            free(after);
            free(own[i]);
        }
        dref_prob_free(&P);
    }
}

/* ---- bad arguments ---- */

static int all_poison(const mat *m)
{
    for (int64_t i = 0; i < m->rows * m->ld; i++)
        if (!is_poison(m->p[i]))
            return 0;
    return 1;
}

static int all_untouched(const run *U)
{
    return all_poison(&U->out) && all_poison(&U->lse) && all_poison(&U->dq) &&
           all_poison(&U->dkcv) && all_poison(&U->dkbv);
}

static void test_bad_args(void)
{
    prob P;
    dref_prob_init(&P, 12, 3, 4, 2, 4, 0, tiny_blocks, 5, 1.0f);
    run U, V; /* V: a valid forward's out/lse, the backward's inputs */
    run_alloc(&V, &P);
    CHECK_EQ(fwd(bes[0], &P, &V), 0);
    df_tensor dout = V.o; /* any valid [rows, nq*D] input */
    run_alloc(&U, &P);
    df_backend *be = bes[0];
    const df_tensor *q = &P.q, *kc = &P.kc, *vc = &P.vc, *kb = &P.kb, *vb = &P.vb;
    int nq = 4, nkv = 2, D = 4;
    float sc = P.scale;
#define FWD(BLK, NQ, NKV, HD, SC, O, L) \
    df_op_dflash_attn(be, q, kc, vc, kb, vb, (BLK), (NQ), (NKV), (HD), (SC), (O), (L))
#define BWD(BLK, DQ, DKC, DVC, DKB, DVB)                                                        \
    df_op_dflash_attn_bwd(be, q, kc, vc, kb, vb, (BLK), nq, nkv, D, sc, &V.o, &V.l, &dout, (DQ), \
                          (DKC), (DVC), (DKB), (DVB))
    df_dflash_blocks bk;
    int32_t anc[5], doc[5];
    uint8_t val[5];
#define RESET()                                 \
    do {                                        \
        bk = P.blk;                             \
        memcpy(anc, P.anchor, sizeof anc);      \
        memcpy(doc, P.doc, sizeof doc);         \
        memcpy(val, P.valid, sizeof val);       \
        bk.anchor = anc;                        \
        bk.doc_start = doc;                     \
        bk.valid = val;                         \
    } while (0)
#define BOTH_EINVAL()                                                                  \
    do {                                                                               \
        CHECK_EQ(FWD(&bk, nq, nkv, D, sc, &U.o, &U.l), -EINVAL);                        \
        CHECK_EQ(BWD(&bk, &U.gq, &U.gkc, &U.gvc, &U.gkb, &U.gvb), -EINVAL);             \
        CHECK(all_untouched(&U));                                                      \
    } while (0)

    RESET();
    CHECK_EQ(FWD(&bk, nq, nkv, D, sc, &U.o, &U.l), 0); /* sanity: valid as is */
    poison(U.out.p, U.out.rows * U.out.ld);
    poison(U.lse.p, U.lse.rows * U.lse.ld);
    CHECK(all_untouched(&U));

    RESET();
    anc[0] = 12; /* anchor == S */
    BOTH_EINVAL();
    RESET();
    anc[0] = -1, doc[0] = -1; /* negative */
    BOTH_EINVAL();
    RESET();
    doc[3] = 12; /* doc_start > anchor */
    BOTH_EINVAL();
    RESET();
    val[4] = 1; /* the junk block, made valid */
    BOTH_EINVAL();
    RESET();
    bk.block_size = 0;
    BOTH_EINVAL();
    RESET();
    bk.window = -1;
    BOTH_EINVAL();
    RESET();
    bk.n_blocks = 4; /* q rows != n_blocks * bs */
    BOTH_EINVAL();
    RESET();
    bk.n_blocks = -1;
    BOTH_EINVAL();
    RESET();
    bk.anchor = NULL;
    BOTH_EINVAL();
    RESET();
    bk.valid = NULL;
    BOTH_EINVAL();
    RESET();
    CHECK_EQ(FWD(NULL, nq, nkv, D, sc, &U.o, &U.l), -EINVAL);
    CHECK_EQ(FWD(&bk, 4, 3, D, sc, &U.o, &U.l), -EINVAL);     /* 4 % 3 */
    CHECK_EQ(FWD(&bk, 2, 2, 8, sc, &U.o, &U.l), -EINVAL);     /* nq*D right, nkv*D wrong */
    CHECK_EQ(FWD(&bk, nq, nkv, D + 1, sc, &U.o, &U.l), -EINVAL);
    CHECK_EQ(FWD(&bk, nq, nkv, 0, sc, &U.o, &U.l), -EINVAL);
    CHECK_EQ(FWD(&bk, 0, 0, D, sc, &U.o, &U.l), -EINVAL);
    CHECK_EQ(FWD(&bk, nq, nkv, D, NAN, &U.o, &U.l), -EINVAL);
    CHECK_EQ(FWD(&bk, nq, nkv, D, INFINITY, &U.o, &U.l), -EINVAL);
    CHECK_EQ(FWD(&bk, nq, nkv, D, 0.0f, &U.o, &U.l), -EINVAL); /* scale > 0 */
    CHECK_EQ(FWD(&bk, nq, nkv, D, -sc, &U.o, &U.l), -EINVAL);
    CHECK_EQ(df_op_dflash_attn(NULL, q, kc, vc, kb, vb, &bk, nq, nkv, D, sc, &U.o, &U.l),
             -EINVAL);
    df_tensor lbad = dref_view(&U.lse, 0, nq + 1); /* lse [rows, nq + 1] */
    CHECK_EQ(FWD(&bk, nq, nkv, D, sc, &U.o, &lbad), -EINVAL);
    df_tensor obad = U.o;
    obad.dtype = DF_DTYPE_BF16;
    CHECK_EQ(FWD(&bk, nq, nkv, D, sc, &obad, &U.l), -EINVAL);
    obad = U.o;
    obad.stride[1] = 2;
    CHECK_EQ(FWD(&bk, nq, nkv, D, sc, &obad, &U.l), -EINVAL);
    obad = U.o;
    obad.stride[0] = 3; /* rows interleave */
    CHECK_EQ(FWD(&bk, nq, nkv, D, sc, &obad, &U.l), -EINVAL);
    CHECK_EQ(df_op_dflash_attn(be, q, kc, &P.kb, kb, vb, &bk, nq, nkv, D, sc, &U.o, &U.l),
             -EINVAL); /* vc with the wrong number of rows */
    CHECK(all_untouched(&U));
    /* Outputs overlapping inputs or each other: refused, inputs untouched. */
    float *keepq = dref_xmalloc((size_t)(P.qm.rows * P.qm.ld) * sizeof(float));
    memcpy(keepq, P.qm.p, (size_t)(P.qm.rows * P.qm.ld) * sizeof(float));
    CHECK_EQ(FWD(&bk, nq, nkv, D, sc, (df_tensor *)q, &U.l), -EINVAL);
    df_tensor l_in_o = dref_view(&U.out, 0, nq); /* lse inside out */
    CHECK_EQ(FWD(&bk, nq, nkv, D, sc, &U.o, &l_in_o), -EINVAL);
    CHECK(all_untouched(&U));
    CHECK_EQ(BWD(&bk, (df_tensor *)q, &U.gkc, &U.gvc, &U.gkb, &U.gvb), -EINVAL); /* dq = q */
    CHECK_EQ(df_op_dflash_attn_bwd(be, q, kc, vc, kb, vb, &bk, nq, nkv, D, sc, &V.o, &V.l,
                                   &U.o, &U.o, &U.gkc, &U.gvc, &U.gkb, &U.gvb),
             -EINVAL); /* dq = dout */
    CHECK_EQ(BWD(&bk, &U.gq, &U.gkc, &U.gkc, &U.gkb, &U.gvb), -EINVAL); /* dkc = dvc */
    df_tensor half = dref_view(&U.dkcv, 2, 8);                               /* dvc over dkc */
    CHECK_EQ(BWD(&bk, &U.gq, &U.gkc, &half, &U.gkb, &U.gvb), -EINVAL);
    df_tensor dkb_on_dq = dref_view(&U.dq, 0, 8);
    CHECK_EQ(BWD(&bk, &U.gq, &U.gkc, &U.gvc, &dkb_on_dq, &U.gvb), -EINVAL);
    df_tensor dlse_bad = dref_view(&V.lse, 1, nq - 1);
    CHECK_EQ(df_op_dflash_attn_bwd(be, q, kc, vc, kb, vb, &bk, nq, nkv, D, sc, &V.o, &dlse_bad,
                                   &dout, &U.gq, &U.gkc, &U.gvc, &U.gkb, &U.gvb),
             -EINVAL);
    CHECK_EQ(df_op_dflash_attn_bwd(be, q, kc, vc, kb, vb, &bk, nq, nkv, D, sc, &V.o, &V.l, NULL,
                                   &U.gq, &U.gkc, &U.gvc, &U.gkb, &U.gvb),
             -EINVAL);
    CHECK_EQ(BWD(&bk, &U.gq, &U.gkc, &U.gvc, &U.gkb, NULL), -EINVAL);
    df_tensor dkc_short = U.gkc;
    dkc_short.shape[0] = P.S - 1;
    CHECK_EQ(BWD(&bk, &U.gq, &dkc_short, &U.gvc, &U.gkb, &U.gvb), -EINVAL);
    CHECK(all_untouched(&U));
    CHECK(bitwise_equal(keepq, P.qm.p, P.qm.rows * P.qm.ld));
    free(keepq);

    /* Edge cases that are valid: no blocks at all; an empty context with only
     * padding blocks; a padding block's junk anchor (above). */
    df_dflash_blocks none = bk;
    none.n_blocks = 0;
    df_tensor q0 = *q, kb0 = *kb, vb0 = *vb, o0 = U.o, l0 = U.l;
    q0.shape[0] = kb0.shape[0] = vb0.shape[0] = o0.shape[0] = l0.shape[0] = 0;
    CHECK_EQ(df_op_dflash_attn(be, &q0, kc, vc, &kb0, &vb0, &none, nq, nkv, D, sc, &o0, &l0), 0);
    CHECK(all_untouched(&U));
    df_tensor kc0 = *kc, vc0 = *vc, gkc0 = U.gkc, gvc0 = U.gvc;
    kc0.shape[0] = vc0.shape[0] = gkc0.shape[0] = gvc0.shape[0] = 0;
    RESET();
    memset(val, 0, sizeof val);
    CHECK_EQ(df_op_dflash_attn(be, q, &kc0, &vc0, kb, vb, &bk, nq, nkv, D, sc, &U.o, &U.l), 0);
    CHECK(dref_get(&U.o, 0, 0) == 0.0f && dref_get(&U.l, P.rows - 1, nq - 1) == -INFINITY);
    CHECK_EQ(df_op_dflash_attn_bwd(be, q, &kc0, &vc0, kb, vb, &bk, nq, nkv, D, sc, &U.o, &U.l,
                                   &dout, &U.gq, &gkc0, &gvc0, &U.gkb, &U.gvb),
             0);
    CHECK(dref_get(&U.gq, P.rows - 1, nq * D - 1) == 0.0f && dref_get(&U.gvb, 0, 0) == 0.0f);
#undef FWD
#undef BWD
#undef RESET
#undef BOTH_EINVAL
    run_free(&U);
    run_free(&V);
    dref_prob_free(&P);
}

/* ---- timing ---- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_dbl(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void bench(void)
{
    enum { NB = 32, BS = 16 };
    blkdef bd[NB];
    /* Documents [0, 300), [300, 700), [700, 1024); anchors spread in each. */
    static const int ds[] = {0, 300, 700, 1024};
    for (int b = 0; b < NB; b++) {
        int d = b * 3 / NB;
        int len = ds[d + 1] - ds[d];
        bd[b].doc = ds[d];
        bd[b].anchor = ds[d] + (int)(test_rand(&dref_rng) % (uint64_t)len);
        bd[b].valid = 1;
    }
    df_backend *be1 = bes[0];
    for (int wi = 0; wi < 2; wi++) {
        int W = wi ? 256 : 0;
        prob P;
        dref_prob_init(&P, 1024, BS, 8, 2, 64, W, bd, NB, 1.0f);
        run U;
        run_alloc(&U, &P);
        mat Rm = dref_mat(P.rows, 8 * 64);
        dref_fill(&Rm, 1.0f);
        df_tensor R = dref_view(&Rm, 0, 8 * 64);
        enum { REP = 7 };
        double tf[REP], tb[REP];
        for (int r = 0; r < REP; r++) {
            double t0 = now_s();
            CHECK_EQ(fwd(be1, &P, &U), 0);
            double t1 = now_s();
            CHECK_EQ(bwd(be1, &P, &U, &R), 0);
            tf[r] = t1 - t0;
            tb[r] = now_s() - t1;
        }
        qsort(tf, REP, sizeof(double), cmp_dbl);
        qsort(tb, REP, sizeof(double), cmp_dbl);
        /* Visible (query, key) pairs x heads: 4*D flops each forward (QK, PV). */
        double pairs = 0;
        for (int b = 0; b < NB; b++)
            for (int qo = 0; qo < BS; qo++) {
                int64_t lo = P.doc[b];
                if (W && P.anchor[b] + qo - (W - 1) > lo)
                    lo = P.anchor[b] + qo - (W - 1);
                pairs += (lo < P.anchor[b] ? P.anchor[b] - lo : 0) + (W ? qo + 1 : BS);
            }
        double fl = pairs * 8 * 4.0 * 64;
        printf("bench S=1024 32x16 nq=8 nkv=2 D=64 W=%d, 1 thread: fwd %.2f ms (%.2f GFLOP/s), "
               "bwd %.2f ms\n",
               W, tf[REP / 2] * 1e3, fl / tf[REP / 2] * 1e-9, tb[REP / 2] * 1e3);
        free(Rm.p);
        run_free(&U);
        dref_prob_free(&P);
    }
}

int main(void)
{
    df_err e = {0};
    bes[0] = df_backend_cpu_open(1, &e);
    bes[1] = df_backend_cpu_open(3, &e);
    if (!bes[0] || !bes[1]) {
        fprintf(stderr, "cannot open the cpu backend: %s\n", e.msg);
        return 1;
    }
    test_configs();
    test_bug_anchor_strict();
    test_bug_block_mask();
    test_bug_cross_document();
    test_bad_args();
    if (getenv("DFLASH_ATTN_BENCH"))
        bench();
    df_backend_close(bes[0]);
    df_backend_close(bes[1]);
    return test_main_end();
}
