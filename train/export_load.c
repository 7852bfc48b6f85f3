/* export_load.c - reading a drafter export back (ckpt.h, df_export_load): ours,
 * or a released DFlash drafter with the same tensor names (SpecForge / z-lab). */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "dtype.h"
#include "safetensors.h"

int df_export_load(const char *dir, df_drafter_config *c, df_params *ps, float **master,
                   df_err *e)
{
    df_st *st = NULL;
    float *w = NULL;
    char shp[2][64];
    *master = NULL;
    memset(ps, 0, sizeof *ps);
    int rc = df_drafter_config_load(dir, c, e);
    if (rc < 0)
        return rc;
    if ((rc = df_params_build(c, ps, e)) < 0) {
        df_err_wrap(e, "%s/config.json", dir);
        return rc;
    }
    if ((rc = df_st_open(dir, &st, e)) < 0)
        goto out;
    if (!(w = malloc((size_t)ps->total * sizeof *w))) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory for %" PRId64 " weights", dir, ps->total);
        goto out;
    }
    /* Every tensor the config implies, with exactly its shape: a missing one
     * is named first (the usual symptom of a config of another shape). */
    for (int i = 0; i < ps->n; i++) {
        const df_param *q = &ps->p[i];
        const df_st_tensor *t = df_st_find(st, q->name);
        if (!t) {
            rc = df_errf(e, -DF_EMISMATCH, "%s: tensor %s is missing (its config.json implies "
                         "%d drafter layers, %d tensors)", df_st_path(st), q->name,
                         c->num_hidden_layers, ps->n);
            goto out;
        }
        if (t->dtype != DF_DTYPE_BF16 && t->dtype != DF_DTYPE_F16 && t->dtype != DF_DTYPE_F32) {
            rc = df_errf(e, -ENOTSUP, "%s: tensor %s is %s; want BF16, F16 or F32", t->file,
                         q->name, df_dtype_name(t->dtype));
            goto out;
        }
        if (t->ndim != q->ndim || t->shape[0] != q->shape[0] ||
            (q->ndim == 2 && t->shape[1] != q->shape[1])) {
            rc = df_errf(e, -DF_EMISMATCH, "%s: tensor %s has shape %s; its config.json implies "
                         "%s", t->file, q->name, df_st_shape_str(shp[0], sizeof shp[0], t->ndim,
                                                                 t->shape),
                         df_st_shape_str(shp[1], sizeof shp[1], q->ndim, q->shape));
            goto out;
        }
        /* the reader checked nbytes = numel x element size, inside the file */
        size_t es = df_dtype_size(t->dtype);
        const uint8_t *src = t->data;
        float *dst = w + q->offset;
        for (int64_t k = 0; k < q->numel; k++) {
            dst[k] = df_elem_to_f32(src + (size_t)k * es, t->dtype);
            if (!isfinite(dst[k])) {
                rc = df_errf(e, -EINVAL, "%s: tensor %s[%" PRId64 "] is %g: not finite", t->file,
                             q->name, k, (double)dst[k]);
                goto out;
            }
        }
    }
    /* Nothing else: an extra tensor is a network we would silently not train
     * (an embedding or head of the drafter's own, more layers than the config
     * says, other names). */
    if ((size_t)ps->n != df_st_count(st)) {
        for (size_t i = 0; i < df_st_count(st); i++) {
            const df_st_tensor *t = df_st_at(st, i);
            if (df_params_find(ps, t->name) >= 0)
                continue;
            const char *why = strstr(t->name, "embed_tokens") || strstr(t->name, "lm_head")
                                  ? ": this drafter uses the target's frozen embedding and head, "
                                    "not weights of its own"
                                  : "";
            rc = df_errf(e, -DF_EMISMATCH, "%s: extra tensor %s (not a parameter of the drafter "
                         "its config.json describes%s)", t->file, t->name, why);
            goto out;
        }
    }
    *master = w;
    w = NULL;
out:
    free(w);
    df_st_close(st);
    if (rc < 0)
        df_params_free(ps);
    return rc;
}
