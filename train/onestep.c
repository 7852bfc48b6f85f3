/* onestep.c - loss + every gradient of one row from a safetensors file. */
#include "onestep.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "drafter.h"
#include "safetensors.h"

static const df_st_tensor *need(df_st *st, const char *name, df_dtype t, int ndim, df_err *e)
{
    const df_st_tensor *x = df_st_find(st, name);
    if (!x) {
        df_errf(e, -ENOENT, "%s: tensor \"%s\" missing", df_st_path(st), name);
        return NULL;
    }
    if (x->dtype != t || x->ndim != ndim) {
        df_errf(e, -DF_EMISMATCH, "%s: \"%s\" must be %s with %d dims", df_st_path(st), name,
                df_dtype_name(t), ndim);
        return NULL;
    }
    return x;
}

static int config_from_json(const char *js, const char *path, df_drafter_config *c, df_err *e)
{
    cJSON *j = js ? cJSON_Parse(js) : NULL;
    if (!j)
        return df_errf(e, -EINVAL, "%s: metadata \"config\" missing or not JSON", path);
    memset(c, 0, sizeof *c);
    static const char *keys[] = {"hidden_size", "num_target_features", "vocab_size", "block_size",
                                 "num_attention_heads", "num_key_value_heads", "head_dim",
                                 "intermediate_size", "num_hidden_layers", "sliding_window",
                                 "rms_norm_eps", "rope_theta", "mask_token_id"};
    double v[13];
    for (int i = 0; i < 13; i++) {
        cJSON *x = cJSON_GetObjectItemCaseSensitive(j, keys[i]);
        if (!cJSON_IsNumber(x)) {
            cJSON_Delete(j);
            return df_errf(e, -EINVAL, "%s: config key \"%s\" missing", path, keys[i]);
        }
        v[i] = x->valuedouble;
    }
    c->hidden_size = (int)v[0];
    c->num_target_features = (int)v[1];
    c->vocab_size = (int64_t)v[2];
    c->block_size = (int)v[3];
    c->num_attention_heads = (int)v[4];
    c->num_key_value_heads = (int)v[5];
    c->head_dim = (int)v[6];
    c->intermediate_size = (int)v[7];
    c->num_hidden_layers = (int)v[8];
    c->sliding_window = (int)v[9];
    c->rms_norm_eps = v[10];
    c->rope_theta = v[11];
    c->mask_token_id = (int64_t)v[12];
    c->max_position_embeddings = 1 << 20;
    c->num_target_layers = 2 * c->num_target_features + 2;
    for (int i = 0; i < c->num_target_features && i < DF_MAX_TARGET_FEATURES; i++)
        c->target_layer_ids[i] = 1 + 2 * i; /* informative only here */
    cJSON *lt = cJSON_GetObjectItemCaseSensitive(j, "layer_types");
    int rc = 0;
    if (!cJSON_IsArray(lt) || cJSON_GetArraySize(lt) != c->num_hidden_layers ||
        c->num_hidden_layers > DF_MAX_LAYERS)
        rc = df_errf(e, -EINVAL, "%s: config \"layer_types\" must list %d layers", path,
                     c->num_hidden_layers);
    for (int i = 0; !rc && i < c->num_hidden_layers; i++) {
        cJSON *x = cJSON_GetArrayItem(lt, i);
        if (!cJSON_IsString(x))
            rc = df_errf(e, -EINVAL, "%s: layer_types[%d] is not a string", path, i);
        else if (!strcmp(x->valuestring, "sliding_attention")) {
            c->layer_types[i] = DF_LAYER_SLIDING;
            c->use_sliding_window = true;
        } else if (!strcmp(x->valuestring, "full_attention"))
            c->layer_types[i] = DF_LAYER_FULL;
        else
            rc = df_errf(e, -EINVAL, "%s: layer_types[%d] \"%s\"", path, i, x->valuestring);
    }
    cJSON_Delete(j);
    return rc ? rc : df_drafter_config_validate(c, path, e);
}

int df_train_onestep(const char *in_path, const char *out_path, df_onestep_result *res, df_err *e)
{
    df_st *st = NULL;
    df_backend *be = NULL;
    df_drafter *d = NULL;
    float *w = NULL, *g = NULL, *acc = NULL;
    uint8_t *valid = NULL;
    df_st_writer *wr = NULL;
    char (*names)[104] = NULL;
    int rc = df_st_open(in_path, &st, e);
    if (rc)
        return rc;
    df_drafter_config c;
    if ((rc = config_from_json(df_st_metadata(st, "config"), in_path, &c, e)))
        goto out;
    const df_st_tensor *feat, *ctx_pos, *anchor, *doc_start, *vt, *bids, *bpos, *labels, *wts,
        *embed, *head;
    if (!(feat = need(st, "feat", DF_DTYPE_F32, 2, e)) ||
        !(ctx_pos = need(st, "ctx_pos", DF_DTYPE_I32, 1, e)) ||
        !(anchor = need(st, "anchor", DF_DTYPE_I32, 1, e)) ||
        !(doc_start = need(st, "doc_start", DF_DTYPE_I32, 1, e)) ||
        !(vt = need(st, "valid", DF_DTYPE_I32, 1, e)) ||
        !(bids = need(st, "block_ids", DF_DTYPE_I32, 1, e)) ||
        !(bpos = need(st, "block_pos", DF_DTYPE_I32, 1, e)) ||
        !(labels = need(st, "labels", DF_DTYPE_I32, 1, e)) ||
        !(wts = need(st, "weights", DF_DTYPE_F32, 1, e)) ||
        !(embed = need(st, "embed", DF_DTYPE_F32, 2, e)) ||
        !(head = need(st, "head", DF_DTYPE_F32, 2, e))) {
        rc = e ? e->code : -EINVAL;
        goto out;
    }
    int64_t S = feat->shape[0];
    int nb = (int)anchor->shape[0], bs = c.block_size;
    int64_t N = (int64_t)nb * bs;
    if (feat->shape[1] != (int64_t)c.num_target_features * c.hidden_size ||
        ctx_pos->shape[0] != S || doc_start->shape[0] != nb || vt->shape[0] != nb ||
        bids->shape[0] != N || bpos->shape[0] != N || labels->shape[0] != N || wts->shape[0] != N) {
        rc = df_errf(e, -DF_EMISMATCH, "%s: row tensors disagree in size (S %lld, %d blocks x %d)",
                     in_path, (long long)S, nb, bs);
        goto out;
    }
    valid = malloc((size_t)nb + 1);
    if (!valid) {
        rc = df_errf(e, -ENOMEM, "out of memory");
        goto out;
    }
    for (int b = 0; b < nb; b++)
        valid[b] = ((const int32_t *)vt->data)[b] != 0;
    double denom = 0;
    for (int64_t i = 0; i < N; i++)
        if (((const int32_t *)labels->data)[i] >= 0)
            denom += ((const float *)wts->data)[i];
    if (!(be = df_backend_cpu_open(0, e))) {
        rc = e ? e->code : -ENOMEM;
        goto out;
    }
    df_tensor te = df_tensor_2d((void *)embed->data, DF_DTYPE_F32, embed->shape[0], embed->shape[1]);
    df_tensor th = df_tensor_2d((void *)head->data, DF_DTYPE_F32, head->shape[0], head->shape[1]);
    if ((rc = df_drafter_open(&c, be, &te, &th, &d, e)))
        goto out;
    const df_params *ps = df_drafter_params(d);
    w = malloc((size_t)ps->total * 4);
    g = calloc((size_t)ps->total, 4);
    acc = calloc((size_t)bs, 4);
    if (!w || !g || !acc) {
        rc = df_errf(e, -ENOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < ps->n; i++) {
        char n[128];
        snprintf(n, sizeof n, "param.%s", ps->p[i].name);
        const df_st_tensor *t = need(st, n, DF_DTYPE_F32, ps->p[i].ndim, e);
        if (!t || (int64_t)t->numel != ps->p[i].numel) {
            rc = t ? df_errf(e, -DF_EMISMATCH, "%s: %s has %llu elements, expected %lld", in_path,
                             n, (unsigned long long)t->numel, (long long)ps->p[i].numel)
                   : (e ? e->code : -ENOENT);
            goto out;
        }
        memcpy(w + ps->p[i].offset, t->data, (size_t)t->numel * 4);
    }
    df_drafter_row r = {.S = S, .feat = feat->data, .ctx_pos = ctx_pos->data,
                        .blocks = {.n_blocks = nb, .block_size = bs, .anchor = anchor->data,
                                   .doc_start = doc_start->data, .valid = valid},
                        .block_ids = bids->data, .block_pos = bpos->data,
                        .labels = labels->data, .weights = wts->data};
    df_drafter_metrics m = {0};
    if (denom > 0 && (rc = df_drafter_row_step(d, w, &r, (float)denom, g, &m, e)))
        goto out;
    res->loss = denom > 0 ? m.loss_sum / denom : 0;
    res->tau_hat = m.blocks ? 1.0 + (double)m.accepted / (double)m.blocks : 1.0;
    res->n_params = ps->n;
    for (int k = 1; k < bs && k < DF_DRAFTER_MAX_BLOCK; k++)
        acc[k] = m.counted[k] ? (float)m.correct[k] / (float)m.counted[k] : 0.0f;
    if (out_path) {
        float lossf = (float)res->loss, tauf = (float)res->tau_hat;
        int64_t one = 1, nbs = bs;
        if ((rc = df_st_writer_open(out_path, &wr, e)) ||
            (rc = df_st_writer_add(wr, "loss", DF_DTYPE_F32, 1, &one, &lossf, e)) ||
            (rc = df_st_writer_add(wr, "tau_hat", DF_DTYPE_F32, 1, &one, &tauf, e)) ||
            (rc = df_st_writer_add(wr, "acc", DF_DTYPE_F32, 1, &nbs, acc, e)))
            goto out;
        /* names stay alive until finish: the writer keeps pointers */
        names = calloc((size_t)ps->n, 104);
        if (!names) {
            rc = df_errf(e, -ENOMEM, "out of memory");
            goto out;
        }
        for (int i = 0; i < ps->n && !rc; i++) {
            snprintf(names[i], 104, "grad.%s", ps->p[i].name);
            rc = df_st_writer_add(wr, names[i], DF_DTYPE_F32, ps->p[i].ndim, ps->p[i].shape,
                                  g + ps->p[i].offset, e);
        }
        if (!rc)
            rc = df_st_writer_finish(wr, e);
    }
out:
    df_st_writer_free(wr);
    free(names);
    free(w);
    free(g);
    free(acc);
    free(valid);
    df_drafter_close(d);
    df_backend_close(be);
    df_st_close(st);
    return rc;
}
