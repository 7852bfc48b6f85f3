/* dflash_ref.c - the DFlash drafter attention's double-precision
 * references for test_dflash_attn.c (dflash_ref.h). */
#include "dflash_ref.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

uint64_t dref_rng = 1234;

void *dref_xmalloc(size_t n)
{
    void *p = calloc(n ? n : 1, 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

double *dref_dbuf(int64_t n)
{
    return dref_xmalloc((size_t)n * sizeof(double));
}

mat dref_mat(int64_t rows, int64_t ld)
{
    mat m = {dref_xmalloc((size_t)(rows * ld) * sizeof(float)), rows, ld};
    return m;
}

df_tensor dref_view(const mat *m, int64_t c0, int64_t cols)
{
    df_tensor full = df_tensor_2d(m->p, DF_DTYPE_F32, m->rows, m->ld);
    return df_tensor_cols(&full, c0, cols);
}

void dref_fill(mat *m, float scale)
{
    for (int64_t i = 0; i < m->rows * m->ld; i++)
        m->p[i] = test_randn(&dref_rng) * scale;
}

float dref_get(const df_tensor *t, int64_t r, int64_t c)
{
    return *(const float *)df_tensor_at(t, r, c);
}

void dref_prob_init(prob *P, int S, int bs, int nq, int nkv, int D, int W, const blkdef *bd,
                      int nb, float qscale)
{
    memset(P, 0, sizeof *P);
    P->S = S, P->nb = nb, P->bs = bs, P->nq = nq, P->nkv = nkv, P->D = D, P->W = W;
    P->rows = (int64_t)nb * bs;
    for (int b = 0; b < nb; b++) {
        P->anchor[b] = bd[b].anchor;
        P->doc[b] = bd[b].doc;
        P->valid[b] = (uint8_t)bd[b].valid;
    }
    P->blk.n_blocks = nb;
    P->blk.block_size = bs;
    P->blk.anchor = P->anchor;
    P->blk.doc_start = P->doc;
    P->blk.valid = P->valid;
    P->blk.window = W;
    P->scale = 1.0f / sqrtf((float)D);
    int64_t kvc = (int64_t)nkv * D;
    P->qm = dref_mat(P->rows, (int64_t)nq * D + 2);
    P->kcv = dref_mat(S, 2 * kvc + 1);
    P->kbv = dref_mat(P->rows, 2 * kvc + 3);
    dref_fill(&P->qm, qscale);
    dref_fill(&P->kcv, qscale);
    dref_fill(&P->kbv, qscale);
    P->q = dref_view(&P->qm, 0, (int64_t)nq * D);
    P->kc = dref_view(&P->kcv, 0, kvc);
    P->vc = dref_view(&P->kcv, kvc, kvc);
    P->kb = dref_view(&P->kbv, 1, kvc);
    P->vb = dref_view(&P->kbv, 1 + kvc, kvc);
}

void dref_prob_free(prob *P)
{
    free(P->qm.p);
    free(P->kcv.p);
    free(P->kbv.p);
}

int dref_visible(const prob *P, int64_t row, int64_t key)
{
    int b = (int)(row / P->bs), qo = (int)(row % P->bs);
    if (!P->valid[b])
        return 0;
    int64_t p = P->anchor[b];
    if (key < P->S) {
        int64_t j = key;
        if (j < P->doc[b] || j >= p)
            return 0;
        return P->W == 0 || j >= p + qo - (P->W - 1);
    }
    int64_t r = key - P->S;
    int b2 = (int)(r / P->bs), ko = (int)(r % P->bs);
    return b2 == b && (P->W == 0 || ko <= qo);
}

void dref_dinp_init(dinp *X, const prob *P)
{
    const df_tensor *t[5] = {&P->q, &P->kc, &P->vc, &P->kb, &P->vb};
    for (int i = 0; i < 5; i++) {
        X->rows[i] = t[i]->shape[0];
        X->cols[i] = t[i]->shape[1];
        X->x[i] = dref_dbuf(X->rows[i] * X->cols[i]);
        for (int64_t r = 0; r < X->rows[i]; r++)
            for (int64_t c = 0; c < X->cols[i]; c++)
                X->x[i][r * X->cols[i] + c] = dref_get(t[i], r, c);
    }
}

void dref_dinp_free(dinp *X)
{
    for (int i = 0; i < 5; i++)
        free(X->x[i]);
}

/* Key row `key` (context or block) of kv head g: k or v (which = 0 / 1). */
static const double *key_row(const prob *P, const dinp *X, int64_t key, int g, int which)
{
    int64_t kvc = (int64_t)P->nkv * P->D;
    if (key < P->S)
        return X->x[1 + which] + key * kvc + (int64_t)g * P->D;
    return X->x[3 + which] + (key - P->S) * kvc + (int64_t)g * P->D;
}

void dref_forward(const prob *P, const dinp *X, fref *F)
{
    int D = P->D, group = P->nq / P->nkv;
    int64_t K = P->S + P->rows, qc = (int64_t)P->nq * D;
    double *s = dref_dbuf(K);
    F->smax = 0;
    for (int64_t i = 0; i < P->rows; i++)
        for (int h = 0; h < P->nq; h++) {
            int g = h / group;
            const double *qi = X->x[0] + i * qc + (int64_t)h * D;
            double mx = -INFINITY;
            int n = 0;
            for (int64_t j = 0; j < K; j++) {
                if (!dref_visible(P, i, j))
                    continue;
                const double *kj = key_row(P, X, j, g, 0);
                double d = 0, a = 0;
                for (int e = 0; e < D; e++) {
                    d += qi[e] * kj[e];
                    a += fabs(qi[e] * kj[e]);
                }
                s[j] = d * P->scale;
                mx = fmax(mx, s[j]);
                F->smax = fmax(F->smax, a * P->scale);
                n++;
            }
            double *o = F->out + i * qc + (int64_t)h * D, *m = F->mag + i * qc + (int64_t)h * D;
            for (int e = 0; e < D; e++)
                o[e] = m[e] = 0;
            F->nvis[i * P->nq + h] = n;
            if (n == 0) {
                F->lse[i * P->nq + h] = -INFINITY;
                continue;
            }
            double sum = 0;
            for (int64_t j = 0; j < K; j++)
                if (dref_visible(P, i, j))
                    sum += exp(s[j] - mx);
            for (int64_t j = 0; j < K; j++) {
                if (!dref_visible(P, i, j))
                    continue;
                double p = exp(s[j] - mx) / sum;
                const double *vj = key_row(P, X, j, g, 1);
                for (int e = 0; e < D; e++) {
                    o[e] += p * vj[e];
                    m[e] += p * fabs(vj[e]);
                }
            }
            F->lse[i * P->nq + h] = mx + log(sum);
        }
    free(s);
}

void dref_fref_alloc(fref *F, const prob *P)
{
    F->out = dref_dbuf(P->rows * P->nq * P->D);
    F->mag = dref_dbuf(P->rows * P->nq * P->D);
    F->lse = dref_dbuf(P->rows * P->nq);
    F->nvis = dref_xmalloc((size_t)(P->rows * P->nq) * sizeof(int));
}

void dref_fref_free(fref *F)
{
    free(F->out);
    free(F->mag);
    free(F->lse);
    free(F->nvis);
}

void dref_gref_alloc(gref *G, const dinp *X)
{
    for (int i = 0; i < 5; i++) {
        G->g[i] = dref_dbuf(X->rows[i] * X->cols[i]);
        G->m[i] = dref_dbuf(X->rows[i] * X->cols[i]);
    }
}

void dref_gref_free(gref *G)
{
    for (int i = 0; i < 5; i++) {
        free(G->g[i]);
        free(G->m[i]);
    }
}

void dref_backward(const prob *P, const dinp *X, const double *R, gref *G)
{
    int D = P->D, group = P->nq / P->nkv;
    int64_t K = P->S + P->rows, qc = (int64_t)P->nq * D, kvc = (int64_t)P->nkv * D;
    fref F;
    dref_fref_alloc(&F, P);
    dref_forward(P, X, &F);
    for (int i = 0; i < 5; i++) {
        memset(G->g[i], 0, (size_t)(X->rows[i] * X->cols[i]) * sizeof(double));
        memset(G->m[i], 0, (size_t)(X->rows[i] * X->cols[i]) * sizeof(double));
    }
    for (int64_t i = 0; i < P->rows; i++)
        for (int h = 0; h < P->nq; h++) {
            int g = h / group;
            double L = F.lse[i * P->nq + h];
            if (L == -INFINITY)
                continue;
            const double *qi = X->x[0] + i * qc + (int64_t)h * D, *dO = R + i * qc + (int64_t)h * D;
            const double *O = F.out + i * qc + (int64_t)h * D;
            double Di = 0, Dabs = 0;
            for (int e = 0; e < D; e++) {
                Di += dO[e] * O[e];
                Dabs += fabs(dO[e] * O[e]);
            }
            for (int64_t j = 0; j < K; j++) {
                if (!dref_visible(P, i, j))
                    continue;
                const double *kj = key_row(P, X, j, g, 0), *vj = key_row(P, X, j, g, 1);
                double s = 0, dP = 0, dPabs = 0;
                for (int e = 0; e < D; e++) {
                    s += qi[e] * kj[e];
                    dP += dO[e] * vj[e];
                    dPabs += fabs(dO[e] * vj[e]);
                }
                double Pij = exp(s * P->scale - L), dS = Pij * (dP - Di);
                double mS = Pij * (dPabs + Dabs);
                int ki = j < P->S ? 1 : 3;
                int64_t kr = j < P->S ? j : j - P->S, ko = kr * kvc + (int64_t)g * D;
                int64_t qo = i * qc + (int64_t)h * D;
                for (int e = 0; e < D; e++) {
                    G->g[0][qo + e] += P->scale * dS * kj[e];
                    G->m[0][qo + e] += P->scale * mS * fabs(kj[e]);
                    G->g[ki][ko + e] += P->scale * dS * qi[e];
                    G->m[ki][ko + e] += P->scale * mS * fabs(qi[e]);
                    G->g[ki + 1][ko + e] += Pij * dO[e];
                    G->m[ki + 1][ko + e] += Pij * fabs(dO[e]);
                }
            }
        }
    dref_fref_free(&F);
}

double dref_loss(const prob *P, const dinp *X, const double *R, fref *F)
{
    dref_forward(P, X, F);
    double L = 0;
    for (int64_t i = 0; i < P->rows * P->nq * P->D; i++)
        L += F->out[i] * R[i];
    return L;
}

