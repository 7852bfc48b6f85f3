/* test_drafter_ref - our CPU drafter against an independent PyTorch
 * implementation of docs/DRAFTER.md (scripts/dflash_reference.py, float64
 * autograd; fixture tests/fixtures/drafter_ref.safetensors): the same packed
 * row (two documents, anchors at a document start, near document ends, one
 * padding block; a sliding layer with window 3 and a full layer; GQA 4/2),
 * the same weights; and config b: 3 layers (full, sliding W=6, full), GQA 8/2,
 * block 5, 3 documents incl. a one-token one, anchors at a document.s last
 * token and deep in a long document. Loss and every gradient must agree.
 *
 * Tolerances: we compute in fp32, the reference in fp64, from identical
 * fp32 inputs. fp32 rounding through two layers, attention and a 61-way CE
 * gives relative errors of order 1e-6; we allow 1e-5 on the loss and 1e-4
 * (relative L2) per gradient tensor: a wrong mask, label or weight moves them
 * by orders of magnitude more. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "drafter.h"
#include "onestep.h"
#include "safetensors.h"
#include "test.h"

static const df_st_tensor *get(df_st *st, const char *name)
{
    const df_st_tensor *t = df_st_find(st, name);
    if (!t) {
        fprintf(stderr, "fixture lacks %s\n", name);
        df_test_failures++;
    }
    return t;
}

static void check(const char *file)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", DFLASH_FIXTURES, file);
    printf("%s:\n", file);
    df_err e = {0};
    df_st *st = NULL;
    CHECK_OK(df_st_open(path, &st, &e), &e);
    if (!st)
        return;
    const char *meta = df_st_metadata(st, "config");
    cJSON *j = meta ? cJSON_Parse(meta) : NULL;
    CHECK(j != NULL);
    if (!j)
        return;
#define NUM(k) cJSON_GetObjectItem(j, k)->valuedouble
    df_drafter_config c;
    memset(&c, 0, sizeof c);
    c.hidden_size = (int)NUM("hidden_size");
    c.num_target_features = (int)NUM("num_target_features");
    for (int i = 0; i < c.num_target_features; i++)
        c.target_layer_ids[i] = 1 + 2 * i;
    c.num_target_layers = 2 * c.num_target_features + 2;
    c.vocab_size = (int64_t)NUM("vocab_size");
    c.block_size = (int)NUM("block_size");
    c.num_attention_heads = (int)NUM("num_attention_heads");
    c.num_key_value_heads = (int)NUM("num_key_value_heads");
    c.head_dim = (int)NUM("head_dim");
    c.intermediate_size = (int)NUM("intermediate_size");
    c.num_hidden_layers = (int)NUM("num_hidden_layers");
    c.sliding_window = (int)NUM("sliding_window");
    c.use_sliding_window = true;
    c.rms_norm_eps = NUM("rms_norm_eps");
    c.rope_theta = NUM("rope_theta");
    c.mask_token_id = (int64_t)NUM("mask_token_id");
    c.max_position_embeddings = 512;
    cJSON *lt = cJSON_GetObjectItem(j, "layer_types");
    for (int i = 0; i < c.num_hidden_layers; i++)
        c.layer_types[i] = !strcmp(cJSON_GetArrayItem(lt, i)->valuestring, "sliding_attention")
                               ? DF_LAYER_SLIDING
                               : DF_LAYER_FULL;
#undef NUM
    cJSON_Delete(j);

    const df_st_tensor *feat = get(st, "feat"), *ctx_pos = get(st, "ctx_pos"),
                       *anchor = get(st, "anchor"), *doc_start = get(st, "doc_start"),
                       *valid = get(st, "valid"), *block_ids = get(st, "block_ids"),
                       *block_pos = get(st, "block_pos"), *labels = get(st, "labels"),
                       *weights = get(st, "weights"), *embed = get(st, "embed"),
                       *head = get(st, "head"), *loss = get(st, "loss");
    if (df_test_failures)
        return;
    int nb = (int)anchor->shape[0], bs = c.block_size, N = nb * bs;
    uint8_t *vb = malloc((size_t)nb);
    for (int b = 0; b < nb; b++)
        vb[b] = (uint8_t)((const int32_t *)valid->data)[b];
    df_drafter_row r = {.S = feat->shape[0], .feat = feat->data, .ctx_pos = ctx_pos->data,
                        .blocks = {.n_blocks = nb, .block_size = bs, .anchor = anchor->data,
                                   .doc_start = doc_start->data, .valid = vb},
                        .block_ids = block_ids->data, .block_pos = block_pos->data,
                        .labels = labels->data, .weights = weights->data};
    double dsum = 0; /* summed as the one-step command sums it, so both are bitwise equal */
    for (int i = 0; i < N; i++)
        if (((const int32_t *)labels->data)[i] >= 0)
            dsum += ((const float *)weights->data)[i];
    float denom = (float)dsum;

    df_backend *be = df_backend_cpu_open(2, &e);
    df_tensor te = df_tensor_2d((void *)embed->data, DF_DTYPE_F32, embed->shape[0], embed->shape[1]);
    df_tensor th = df_tensor_2d((void *)head->data, DF_DTYPE_F32, head->shape[0], head->shape[1]);
    df_drafter *d = NULL;
    CHECK_OK(df_drafter_open(&c, be, &te, &th, &d, &e), &e);
    if (!d)
        return;
    const df_params *ps = df_drafter_params(d);
    float *w = malloc((size_t)ps->total * 4), *g = calloc((size_t)ps->total, 4);
    for (int i = 0; i < ps->n; i++) {
        char n[128];
        snprintf(n, sizeof n, "param.%s", ps->p[i].name);
        const df_st_tensor *t = get(st, n);
        if (t && (int64_t)t->numel == ps->p[i].numel)
            memcpy(w + ps->p[i].offset, t->data, (size_t)t->numel * 4);
        else
            df_test_failures++;
    }
    df_drafter_metrics m = {0};
    CHECK_OK(df_drafter_row_step(d, w, &r, denom, g, &m, &e), &e);
    double ours = m.loss_sum / denom, ref = ((const float *)loss->data)[0];
    printf("loss: ours %.7f, PyTorch %.7f (rel %.2e)\n", ours, ref, fabs(ours - ref) / ref);
    CHECK(fabs(ours - ref) <= 1e-5 * fabs(ref));
    double worst = 0;
    for (int i = 0; i < ps->n; i++) {
        char n[128];
        snprintf(n, sizeof n, "grad.%s", ps->p[i].name);
        const df_st_tensor *t = get(st, n);
        if (!t)
            continue;
        const float *rg = t->data, *og = g + ps->p[i].offset;
        double num = 0, den = 0;
        for (int64_t k = 0; k < ps->p[i].numel; k++) {
            num += ((double)og[k] - rg[k]) * ((double)og[k] - rg[k]);
            den += (double)rg[k] * rg[k];
        }
        double rel = sqrt(num) / (sqrt(den) + 1e-30);
        if (rel > worst)
            worst = rel;
        if (!(rel <= 1e-4)) {
            fprintf(stderr, "%s: gradient rel err %.3e\n", ps->p[i].name, rel);
            df_test_failures++;
        }
    }
    printf("worst gradient rel L2 error over %d tensors: %.2e\n", ps->n, worst);

    /* The one-step command's library path gives the same loss and writes
     * every gradient, equal to what the model computed above. */
    char outp[4200];
    snprintf(outp, sizeof outp, "%s/grads.safetensors", test_tmpdir(file));
    df_onestep_result res;
    CHECK_OK(df_train_onestep(path, outp, &res, &e), &e);
    CHECK(fabs(res.loss - ours) <= 1e-6 * fabs(ours));
    df_st *go = NULL;
    CHECK_OK(df_st_open(outp, &go, &e), &e);
    for (int i = 0; go && i < ps->n; i++) {
        char n[128];
        snprintf(n, sizeof n, "grad.%s", ps->p[i].name);
        const df_st_tensor *t = df_st_find(go, n);
        CHECK(t && (int64_t)t->numel == ps->p[i].numel &&
              !memcmp(t->data, g + ps->p[i].offset, (size_t)t->numel * 4));
    }
    df_st_close(go);
    /* bad input: a missing tensor is named */
    CHECK_ERR(df_train_onestep(outp, NULL, &res, &e), -EINVAL, &e, "config");
    free(w);
    free(g);
    free(vb);
    df_drafter_close(d);
    df_backend_close(be);
    df_st_close(st);
}

int main(void)
{
    check("drafter_ref.safetensors");
    check("drafter_ref_b.safetensors");
    return test_main_end();
}
