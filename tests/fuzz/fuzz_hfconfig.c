/* Fuzzes both config parsers on the same bytes. A drafter config that parses
 * must survive to_json -> parse unchanged (the export path). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hfconfig.h"

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n)
{
    char *buf = malloc(n ? n : 1); /* exactly n bytes: no NUL terminator to lean on */
    if (!buf)
        return 0;
    memcpy(buf, d, n);
    df_err e;
    df_model_config *m = malloc(sizeof *m);
    df_drafter_config *a = malloc(sizeof *a), *b = malloc(sizeof *b);
    if (!m || !a || !b)
        abort();
    if (df_model_config_parse(buf, n, "fuzz", m, &e) == 0) {
        if (m->num_hidden_layers < 1 || m->num_hidden_layers > DF_MAX_LAYERS ||
            m->num_attention_heads % m->num_key_value_heads || m->rotary_dim < 2)
            abort();
    }
    if (df_drafter_config_parse(buf, n, "fuzz", a, &e) == 0) {
        char *js = df_drafter_config_to_json(a, &e);
        if (!js || df_drafter_config_parse(js, strlen(js), "rt", b, &e) != 0)
            abort();
        if (a->block_size != b->block_size || a->mask_token_id != b->mask_token_id ||
            a->num_target_features != b->num_target_features ||
            memcmp(a->target_layer_ids, b->target_layer_ids, sizeof a->target_layer_ids) ||
            memcmp(a->layer_types, b->layer_types, (size_t)a->num_hidden_layers) ||
            a->rms_norm_eps != b->rms_norm_eps || a->rope_theta != b->rope_theta ||
            a->vocab_size != b->vocab_size || a->sliding_window != b->sliding_window)
            abort();
        free(js);
    }
    free(m);
    free(a);
    free(b);
    free(buf);
    return 0;
}
