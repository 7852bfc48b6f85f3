/* basis_eval.c - what fraction of a moment's energy any orthonormal basis
 * keeps, overall and per layer (df_basis_eval, formats/basis.h): two NT
 * products against the moment and one per layer, no pass over tokens. */
#include <errno.h>
#include <stdlib.h>

#include "basis_internal.h"

typedef struct dot_out { /* per task: sum_ij acc[i][j] G[j][i] */
    const double *G;
    int64_t ld, njb;
    double *part;
} dot_out;

static void dot_put(void *ctx, int64_t i0, int64_t ni, int64_t j0, int64_t nj, const double *acc)
{
    dot_out *o = ctx;
    double s = 0;
    for (int64_t i = 0; i < ni; i++)
        for (int64_t c = 0; c < nj; c++)
            s += acc[i * NC + c] * o->G[(j0 + c) * o->ld + i0 + i];
    o->part[(i0 / MC) * o->njb + j0 / NC] = s;
}

int df_basis_eval(const df_basis *b, const df_moment *m, double *kept, double *layer_kept,
                  df_pool *pool, df_err *e)
{
    const char *what = "df_basis_eval";
    if (!b->P || b->D != m->D || b->K != m->K || b->H != m->H)
        return df_errf(e, -DF_EMISMATCH, "%s: a basis of %d layers of %d, a moment of %d of %d",
                       what, b->K, b->H, m->K, m->H);
    if (!m->m || m->n_rows <= 0)
        return df_errf(e, -EINVAL, "%s: the moment holds no rows", what);
    int64_t D = b->D, R = b->R, H = b->H;
    double total = 0, lay_e[DF_BASIS_MAX_LAYERS] = {0}, a[DF_BASIS_MAX_LAYERS] = {0};
    for (int64_t i = 0; i < D; i++) {
        total += m->m[i * D + i];
        lay_e[i / H] += m->m[i * D + i];
    }
    if (!(total > 0))
        return df_errf(e, -EINVAL, "%s: the moment has no energy", what);
    float *pp = alloc64((size_t)(cdiv(R, NR) * NR * D) * sizeof(float));
    double *C = malloc(sizeof(double) * (size_t)(R * D)), *G = NULL, *part = NULL;
    int rc = 0;
    if (!C || !pp) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory for %lld x %lld doubles", what,
                     (long long)R, (long long)D);
        goto out;
    }
    fmat_src prow = {b->P, D, 0};
    df_basis_pack_panels(df_basis_fmat_get, &prow, R, D, pp, pool);
    /* C = P M (R x D), as C^T = M P^T over M's rows (mirrored: all of it) */
    df_basis_mirror_upper(m->m, D);
    dmat_src ms = {m->m, D, 0};
    df_basis_store_out co = {C, D, 1};
    nt_job j1 = {.n = D, .m = R, .kd = D, .get = df_basis_dmat_get, .gctx = &ms, .bp = pp, .bld = D,
                 .put = df_basis_store_put, .pctx = &co};
    if ((rc = df_basis_nt_run(&j1, pool, what, e)) < 0)
        goto out;
    /* a_k = sum over layer k's columns i of (P^T P M)_ii = sum_r P[r][i] C[r][i] */
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < D; i++)
            a[i / H] += (double)b->P[r * D + i] * C[r * D + i];
    double sum = 0;
    for (int k = 0; k < b->K; k++)
        sum += a[k];
    *kept = sum / total;
    if (!layer_kept)
        goto out;
    /* G = P M P^T = C P^T (R x R); b_k = sum_i in layer k of (P^T G P)_ii
     * = sum_rs G[r][s] L_k[s][r] with L_k = P_k P_k^T over layer k's columns */
    G = malloc(sizeof(double) * (size_t)(R * R));
    part = malloc(sizeof(double) * (size_t)(cdiv(R, MC) * cdiv(R, NC)));
    if (!G || !part) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory", what);
        goto out;
    }
    dmat_src cs = {C, D, 0};
    df_basis_store_out go = {G, R, 0};
    nt_job j2 = {.n = R, .m = R, .kd = D, .get = df_basis_dmat_get, .gctx = &cs, .bp = pp, .bld = D,
                 .put = df_basis_store_put, .pctx = &go};
    if ((rc = df_basis_nt_run(&j2, pool, what, e)) < 0)
        goto out;
    for (int k = 0; k < b->K; k++) {
        fmat_src ps = {b->P, D, k * H};
        dot_out dout = {G, R, cdiv(R, NC), part};
        nt_job j3 = {.n = R, .m = R, .kd = H, .get = df_basis_fmat_get, .gctx = &ps, .bp = pp,
                     .bld = D, .boff = k * H, .put = dot_put, .pctx = &dout};
        if ((rc = df_basis_nt_run(&j3, pool, what, e)) < 0)
            goto out;
        double bk = 0;
        for (int64_t t = 0; t < cdiv(R, MC) * cdiv(R, NC); t++)
            bk += part[t];
        layer_kept[k] = lay_e[k] > 0 ? (2 * a[k] - bk) / lay_e[k] : 1.0;
    }
out:
    free(pp);
    free(C);
    free(G);
    free(part);
    return rc;
}
