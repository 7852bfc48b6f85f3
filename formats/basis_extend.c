/* basis_extend.c - a basis extended past a subspace it must keep whole
 * (df_basis_extend, formats/basis.h).
 *
 * The use: the rows of a drafter's fc span what that fc reads (R0 = its
 * hidden size). A later fc, or another seed's, reads a nearby subspace that
 * the first R0 rows do not quite hold; the extension adds the directions
 * that carry the most of the features' remaining energy. With Q the kept
 * rows, the remaining energy is the moment of the tokens' components outside
 * span(Q):
 *   M' = (I - Q^T Q) M (I - Q^T Q) = M - (Q^T W + W^T Q),  W = C - G Q / 2,
 * with C = Q M (R0 x D) and G = C Q^T = Q M Q^T (R0 x R0): three products of
 * D^2 R0-ish flops and no pass over tokens (at the 27B shape D = 25600,
 * R0 = 5120 that is ~7 TFLOP against the ~260 TFLOP of deflating a 5e5-token
 * sample). M' is fitted like any moment (df_basis_fit); its top R - R0
 * eigenvectors are orthogonal to Q up to rounding, then made so explicitly
 * (two passes of e -= Q^T (Q e), then unit norm). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "basis_internal.h"

/* Rows E (n x D, f32) made orthonormal to Q (Rq x D) and unit: two passes of
 * E -= (E Q^T) Q in double. QT is Q transposed (D x Rq). */
static int orth_against(float *E, int64_t n, const float *Q, const float *QT, int64_t Rq,
                        int64_t D, df_pool *pool, const char *what, df_err *e)
{
    double *S = malloc(sizeof(double) * (size_t)(n * Rq));
    double *SQ = malloc(sizeof(double) * (size_t)(n * D));
    int rc = 0;
    if (!S || !SQ) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory for %lld x %lld doubles", what,
                     (long long)n, (long long)D);
        goto out;
    }
    for (int pass = 0; pass < 2; pass++) {
        mul_job js = {.n = n, .m = D, .D = Rq, .w32 = E, .ldw = D, .B = QT, .ldb = Rq, .y64 = S,
                      .ldy = Rq};
        mul_job jq = {.n = n, .m = Rq, .D = D, .w64 = S, .ldw = Rq, .B = Q, .ldb = D, .y64 = SQ,
                      .ldy = D};
        if ((rc = df_basis_mul_run(&js, pool, what, e)) < 0 ||
            (rc = df_basis_mul_run(&jq, pool, what, e)) < 0)
            goto out;
        for (int64_t r = 0; r < n; r++) {
            double s = 0, *v = SQ + r * D;
            for (int64_t i = 0; i < D; i++) {
                v[i] = (double)E[r * D + i] - v[i];
                s += v[i] * v[i];
            }
            if (!(s > 1e-6)) /* an eigenvector of M' with energy is never inside span(Q) */
                rc = df_errf(e, -EDOM, "%s: extension row %lld lies in the kept subspace "
                             "(norm %.3g outside it)", what, (long long)r, sqrt(s));
            double inv = rc ? 0 : 1 / sqrt(s);
            for (int64_t i = 0; i < D; i++)
                E[r * D + i] = (float)(v[i] * inv);
        }
        if (rc)
            goto out;
    }
out:
    free(S);
    free(SQ);
    return rc;
}

int df_basis_check_extend(const df_basis *q, const df_moment *m, int R, const char *what,
                          df_err *e)
{
    if (!q->P || q->D != m->D || q->K != m->K || q->H != m->H)
        return df_errf(e, -DF_EMISMATCH, "%s: a basis of %d layers of %d, a moment of %d of %d",
                       what, q->K, q->H, m->K, m->H);
    if (memcmp(q->layer_ids, m->layer_ids, sizeof(int32_t) * (size_t)q->K))
        return df_errf(e, -DF_EMISMATCH, "%s: the basis and the moment are of other target "
                       "layers (first %d and %d)", what, q->layer_ids[0], m->layer_ids[0]);
    if (!m->m || m->n_rows <= 0)
        return df_errf(e, -EINVAL, "%s: the moment holds no rows", what);
    if (R <= q->R || R > q->D)
        return df_errf(e, -EINVAL, "%s: R = %d, must be in [%d, %lld] (above the kept basis' "
                       "%d rows, at most D)", what, R, q->R + 1, (long long)q->D, q->R);
    return 0;
}

int df_basis_extend(const df_basis *q, const df_moment *m, int R, df_pool *pool, df_basis *out,
                    df_err *e)
{
    const char *what = "df_basis_extend";
    memset(out, 0, sizeof *out);
    int rc = df_basis_check_extend(q, m, R, what, e);
    if (rc)
        return rc;
    int64_t D = q->D, Rq = q->R, Re = (int64_t)R - Rq;
    float *pq = alloc64((size_t)(cdiv(Rq, NR) * NR * D) * sizeof(float));
    float *QT = malloc(sizeof(float) * (size_t)(D * Rq)), *W = NULL;
    double *C = malloc(sizeof(double) * (size_t)(Rq * D)), *G = NULL, *GQ = NULL, *Y = NULL;
    df_basis E = {0};
    if (!pq || !QT || !C) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory for %lld x %lld doubles", what,
                     (long long)Rq, (long long)D);
        goto out;
    }
    for (int64_t r = 0; r < Rq; r++)
        for (int64_t i = 0; i < D; i++)
            QT[i * Rq + r] = q->P[r * D + i];
    fmat_src qs = {q->P, D, 0};
    df_basis_pack_panels(df_basis_fmat_get, &qs, Rq, D, pq, pool);
    /* C = Q M, as C^T = M Q^T over M's rows (mirrored: all of it) */
    df_basis_mirror_upper(m->m, D);
    dmat_src ms = {m->m, D, 0};
    df_basis_store_out co = {C, D, 1};
    nt_job j1 = {.n = D, .m = Rq, .kd = D, .get = df_basis_dmat_get, .gctx = &ms, .bp = pq,
                 .bld = D, .put = df_basis_store_put, .pctx = &co};
    if ((rc = df_basis_nt_run(&j1, pool, what, e)) < 0)
        goto out;
    /* G = C Q^T (R0 x R0), GQ = G Q, W = C - GQ / 2 (f32: the B side of the last product) */
    G = malloc(sizeof(double) * (size_t)(Rq * Rq));
    GQ = malloc(sizeof(double) * (size_t)(Rq * D));
    W = malloc(sizeof(float) * (size_t)(Rq * D));
    Y = malloc(sizeof(double) * (size_t)(D * D));
    if (!G || !GQ || !W || !Y) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory for a %lld x %lld double matrix", what,
                     (long long)D, (long long)D);
        goto out;
    }
    dmat_src cs = {C, D, 0};
    df_basis_store_out go = {G, Rq, 0};
    nt_job j2 = {.n = Rq, .m = Rq, .kd = D, .get = df_basis_dmat_get, .gctx = &cs, .bp = pq,
                 .bld = D, .put = df_basis_store_put, .pctx = &go};
    mul_job j3 = {.n = Rq, .m = Rq, .D = D, .w64 = G, .ldw = Rq, .B = q->P, .ldb = D, .y64 = GQ,
                  .ldy = D};
    if ((rc = df_basis_nt_run(&j2, pool, what, e)) < 0 ||
        (rc = df_basis_mul_run(&j3, pool, what, e)) < 0)
        goto out;
    for (int64_t i = 0; i < Rq * D; i++)
        W[i] = (float)(C[i] - 0.5 * GQ[i]);
    free(GQ);
    GQ = NULL;
    /* Y = Q^T W (D x D); M' = M - Y - Y^T into Y's upper triangle (Y[j][i], j > i, is read
     * before row j is written) */
    mul_job j4 = {.n = D, .m = Rq, .D = D, .w32 = QT, .ldw = Rq, .B = W, .ldb = D, .y64 = Y,
                  .ldy = D};
    if ((rc = df_basis_mul_run(&j4, pool, what, e)) < 0)
        goto out;
    double trace = 0;
    for (int64_t i = 0; i < D; i++) {
        for (int64_t j = i; j < D; j++)
            Y[i * D + j] = m->m[i * D + j] - Y[i * D + j] - Y[j * D + i];
        trace += Y[i * D + i];
    }
    df_moment mo = {.K = m->K, .H = m->H, .D = m->D, .n_rows = m->n_rows, .trace = trace, .m = Y};
    memcpy(mo.layer_ids, m->layer_ids, sizeof mo.layer_ids);
    if ((rc = df_basis_fit(&mo, (int)Re, 0, &E, e)) < 0)
        goto out;
    if ((rc = orth_against(E.P, Re, q->P, QT, Rq, D, pool, what, e)) < 0 ||
        (rc = df_basis_init(out, q->K, q->H, R, q->layer_ids, e)) < 0)
        goto out;
    memcpy(out->P, q->P, sizeof(float) * (size_t)(Rq * D));
    memcpy(out->P + Rq * D, E.P, sizeof(float) * (size_t)(Re * D));
    memcpy(out->eigval, q->eigval, sizeof(double) * (size_t)Rq);
    memcpy(out->eigval + Rq, E.eigval, sizeof(double) * (size_t)Re);
    df_basis_canonicalize(out);
    out->kind = DF_BASIS_KIND_ROWS_EXT;
    out->rows_part = (int)Rq;
    out->n_rows = m->n_rows;
    out->total_energy = 0;
    for (int64_t i = 0; i < D; i++) {
        out->total_energy += m->m[i * D + i];
        out->layer_energy[i / q->H] += m->m[i * D + i];
    }
    if ((rc = df_basis_check_orthonormal(out->P, R, D, what, 0, -EDOM, e)) < 0 ||
        (rc = df_basis_eval(out, m, &out->kept, out->layer_kept, pool, e)) < 0)
        goto out;
out:
    if (rc)
        df_basis_free(out);
    df_basis_free(&E);
    free(pq);
    free(QT);
    free(W);
    free(C);
    free(G);
    free(GQ);
    free(Y);
    return rc;
}
