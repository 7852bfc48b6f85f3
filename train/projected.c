/* projected.c - the basis of a projected cache, and the merged export (projected.h). */
#include "projected.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int df_export_drafter_projected(const char *out_dir, const df_drafter_config *c,
                                const df_params *ps, const float *master, const df_basis *b,
                                df_err *e)
{
    return df_export_drafter_projected_with(out_dir, c, ps, master, b, NULL, e);
}

int df_export_drafter_projected_with(const char *out_dir, const df_drafter_config *c,
                                     const df_params *ps, const float *master,
                                     const df_basis *b, const df_export_extra *extra, df_err *e)
{
    if (c->feature_dim != b->R || b->H != c->hidden_size || b->K != c->num_target_features)
        return df_errf(e, -DF_EMISMATCH, "%s: drafter reads %d features of %d x %d; the basis "
                       "is rank %d of %d x %d", out_dir, c->feature_dim, c->num_target_features,
                       c->hidden_size, b->R, b->K, b->H);
    df_drafter_config raw = *c;
    raw.feature_dim = 0;
    df_params full;
    int rc = df_params_build(&raw, &full, e);
    if (rc)
        return rc;
    float *w = malloc((size_t)full.total * sizeof *w);
    if (!w) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory for %" PRId64 " weights", out_dir, full.total);
        goto out;
    }
    for (int i = 0; i < full.n; i++) {
        const df_param *q = &full.p[i];
        int j = df_params_find(ps, q->name);
        if (j < 0) {
            rc = df_errf(e, -DF_EMISMATCH, "%s: %s missing from the trained parameters", out_dir,
                         q->name);
            goto out;
        }
        if (!strcmp(q->name, "fc.weight")) {
            if (ps->p[j].shape[0] != c->hidden_size || ps->p[j].shape[1] != b->R) {
                rc = df_errf(e, -DF_EMISMATCH, "%s: fc.weight is %" PRId64 " x %" PRId64
                             ", want %d x %d", out_dir, ps->p[j].shape[0], ps->p[j].shape[1],
                             c->hidden_size, b->R);
                goto out;
            }
            if ((rc = df_basis_merge(b, master + ps->p[j].offset, c->hidden_size,
                                     w + q->offset, NULL, e)))
                goto out;
        } else {
            if (ps->p[j].numel != q->numel) {
                rc = df_errf(e, -DF_EMISMATCH, "%s: %s has %" PRId64 " values, want %" PRId64,
                             out_dir, q->name, ps->p[j].numel, q->numel);
                goto out;
            }
            memcpy(w + q->offset, master + ps->p[j].offset, (size_t)q->numel * sizeof *w);
        }
    }
    rc = df_export_drafter_with(out_dir, &raw, &full, w, extra, e);
out:
    free(w);
    df_params_free(&full);
    return rc;
}
