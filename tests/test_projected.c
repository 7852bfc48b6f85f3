/* test_projected - the export of a drafter trained on a projected cache.
 * Its fc_r (hidden x R) reads z = P x; the export must write fc = fc_r P
 * (hidden x K*hidden) so that on raw features fc x == fc_r (P x) up to the
 * export's BF16 rounding of fc, with every other tensor exported as the
 * plain export writes it, and config.json that of a drafter on raw features.
 * Also: a wrong basis or fc shape is refused by name. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basis.h"
#include "ckpt.h"
#include "dtype.h"
#include "hfconfig.h"
#include "params.h"
#include "projected.h"
#include "safetensors.h"
#include "test.h"

enum { H = 32, K = 3, D = K * H, R = 20, LAYERS = 1 };

static df_drafter_config cfg(int feature_dim)
{
    df_drafter_config c;
    memset(&c, 0, sizeof c);
    c.block_size = 4;
    c.mask_token_id = 1;
    c.num_target_features = K;
    c.target_layer_ids[0] = 1;
    c.target_layer_ids[1] = 2;
    c.target_layer_ids[2] = 4;
    c.num_target_layers = 6;
    c.num_hidden_layers = LAYERS;
    c.hidden_size = H;
    c.intermediate_size = 48;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 10000;
    c.max_position_embeddings = 512;
    c.layer_types[0] = DF_LAYER_FULL;
    c.vocab_size = 50;
    c.feature_dim = feature_dim;
    return c;
}

static uint64_t rs = 0x9E3779B97F4A7C15ull;
static double urand(void) /* uniform in [-1, 1) */
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (double)(rs >> 11) * 0x1.0p-52 - 1.0;
}

int main(void)
{
    df_err e = {0};
    df_drafter_config c = cfg(R), raw = cfg(0);
    df_params ps, full;
    CHECK_OK(df_params_build(&c, &ps, &e), &e);
    CHECK_OK(df_params_build(&raw, &full, &e), &e);
    int fi = df_params_find(&ps, "fc.weight");
    CHECK(fi >= 0 && ps.p[fi].shape[0] == H && ps.p[fi].shape[1] == R);
    CHECK(full.total - ps.total == (int64_t)H * (D - R));

    /* a basis: the row space of a random R x D matrix (not an eigenbasis of any data) */
    float *a = malloc(sizeof(float) * R * D), *w = malloc(sizeof(float) * (size_t)ps.total);
    for (int i = 0; i < R * D; i++)
        a[i] = (float)urand();
    for (int64_t i = 0; i < ps.total; i++)
        w[i] = (float)(0.5 * urand());
    df_basis b = {0};
    int32_t ids[K] = {1, 2, 4};
    CHECK_OK(df_basis_from_rows(a, R, K, H, ids, R, 0, NULL, &b, &e), &e);
    CHECK_EQ(b.R, R);

    const char *dir = test_tmpdir("projected");
    char out[4200];
    snprintf(out, sizeof out, "%s/export", dir);
    CHECK_OK(df_export_drafter_projected(out, &c, &ps, w, &b, &e), &e);

    /* the export: an ordinary drafter's config and tensors */
    df_drafter_config back;
    CHECK_OK(df_drafter_config_load(out, &back, &e), &e);
    CHECK_EQ(back.feature_dim, 0);
    CHECK_EQ(back.num_target_features, K);
    CHECK_EQ(back.target_layer_ids[2], 4);
    df_st *st = NULL;
    CHECK_OK(df_st_open(out, &st, &e), &e);
    const df_st_tensor *fc = st ? df_st_find(st, "fc.weight") : NULL;
    CHECK(fc && fc->dtype == DF_DTYPE_BF16 && fc->shape[0] == H && fc->shape[1] == D);
    for (int i = 0; st && i < ps.n; i++) { /* every other tensor: bf16 of its master */
        if (i == fi)
            continue;
        const df_st_tensor *t = df_st_find(st, ps.p[i].name);
        CHECK(t && (int64_t)t->numel == ps.p[i].numel);
        for (int64_t k = 0; t && k < ps.p[i].numel; k++)
            if (((const uint16_t *)t->data)[k] != df_f32_to_bf16(w[ps.p[i].offset + k])) {
                CHECK(!"a tensor other than fc changed in the export");
                break;
            }
    }
    /* fc x == fc_r (P x) for random raw features x, within the BF16 rounding of fc:
     * |sum_j (fc_ij - fc16_ij) x_j| <= 2^-8 sum_j |fc16_ij x_j| (plus f32 noise) */
    double worst = 0;
    for (int trial = 0; fc && trial < 16; trial++) {
        double x[D], z[R];
        for (int j = 0; j < D; j++)
            x[j] = 3.0 * urand();
        for (int r = 0; r < R; r++) {
            z[r] = 0;
            for (int j = 0; j < D; j++)
                z[r] += (double)b.P[r * D + j] * x[j];
        }
        for (int h = 0; h < H; h++) {
            double want = 0, got = 0, mag = 0;
            for (int r = 0; r < R; r++)
                want += (double)w[ps.p[fi].offset + h * R + r] * z[r];
            for (int j = 0; j < D; j++) {
                double f = df_bf16_to_f32(((const uint16_t *)fc->data)[h * D + j]);
                got += f * x[j];
                mag += fabs(f * x[j]);
            }
            double err = fabs(got - want) / (mag * 0x1.0p-8 + 1e-6 * (fabs(want) + 1));
            worst = err > worst ? err : worst;
        }
    }
    CHECK(worst <= 1.0);
    printf("merged fc on raw features vs fc_r on z: worst error %.3f of the BF16 bound\n", worst);
    df_st_close(st);

    /* refused: a basis of another rank, an fc of another width */
    df_basis b2 = {0};
    CHECK_OK(df_basis_from_rows(a, R, K, H, ids, R - 1, 0, NULL, &b2, &e), &e);
    snprintf(out, sizeof out, "%s/export2", dir);
    CHECK_ERR(df_export_drafter_projected(out, &c, &ps, w, &b2, &e), -DF_EMISMATCH, &e, "rank");
    df_basis_free(&b2);

    df_basis_free(&b);
    df_params_free(&ps);
    df_params_free(&full);
    free(a);
    free(w);
    return test_main_end();
}
