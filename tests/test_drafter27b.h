/* test_drafter27b.h - the Qwen3.6-27B DFlash drafter's config (5 layers: 4 sliding
 * + 1 full, 5120 hidden, 5 target features of 64), for tests that need its shape.
 * Header-only: tests that include it link df_formats (df_default_target_layers). */
#ifndef DF_TEST_DRAFTER27B_H
#define DF_TEST_DRAFTER27B_H

#include <string.h>

#include "hfconfig.h"
#include "test.h"

static inline void test_drafter_27b(df_drafter_config *d)
{
    memset(d, 0, sizeof *d);
    d->block_size = 16;
    d->mask_token_id = 248070;
    d->num_target_layers = 64;
    d->num_target_features = 5;
    CHECK_OK(df_default_target_layers(64, 5, d->target_layer_ids), NULL);
    d->num_hidden_layers = 5;
    d->hidden_size = 5120;
    d->intermediate_size = 17408;
    d->num_attention_heads = 32;
    d->num_key_value_heads = 8;
    d->head_dim = 128;
    d->rms_norm_eps = 1e-6;
    d->rope_theta = 1e7;
    d->max_position_embeddings = 262144;
    for (int i = 0; i < 4; i++)
        d->layer_types[i] = DF_LAYER_SLIDING;
    d->layer_types[4] = DF_LAYER_FULL;
    d->sliding_window = 2048;
    d->use_sliding_window = true;
    d->vocab_size = 248320;
}

#endif
