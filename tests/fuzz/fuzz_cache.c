/* fuzz_cache - the cache reader's parsers on arbitrary bytes: a sample
 * record (parse, verify, decode every block), an index file, meta/manifest
 * JSON. None may crash, leak or read out of bounds; a parse that succeeds
 * must describe blocks that lie inside the buffer. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cache.h"

static void params(df_cache_params *p, uint8_t sel)
{
    memset(p, 0, sizeof *p);
    strcpy(p->model_type, "qwen3");
    p->hidden_size = (sel & 1) ? 8 : 24;
    p->num_target_layers = 8;
    p->n_layers = 1 + (sel >> 1) % 3;
    for (uint32_t i = 0; i < p->n_layers; i++)
        p->layer_ids[i] = (int32_t)i * 2;
    p->dtype = (sel & 8) ? DF_DTYPE_F32 : DF_DTYPE_BF16;
    p->codec = DF_CODEC_SPLIT_ZSTD;
    p->rows_per_block = 1 + (sel >> 4) % 5;
    df_cache_params_finish(p, NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n)
{
    if (n < 2)
        return 0;
    df_cache_params p;
    params(&p, d[1]);
    const uint8_t *b = d + 2;
    size_t len = n - 2;
    df_err e;
    switch (d[0] % 3) {
    case 0: {
        /* Aligned copy, as a real read buffer is. */
        uint8_t *buf = aligned_alloc(64, (len + 63) / 64 * 64);
        memcpy(buf, b, len);
        df_cache_record r;
        if (df_cache_record_parse(&p, buf, len, &r, &e) == 0) {
            df_cache_record_verify(&p, &r, &e);
            size_t row = (size_t)p.hidden_size * df_dtype_size(p.dtype);
            void *dst[DF_CACHE_MAX_LAYERS] = {0};
            for (uint32_t l = 0; l < p.n_layers; l++)
                dst[l] = malloc((size_t)r.n_tokens * row + 1);
            df_cache_record_decode(&p, &r, ~0ull, dst, NULL, &e);
            for (uint32_t l = 0; l < p.n_layers; l++)
                free(dst[l]);
        }
        free(buf);
        break;
    }
    case 1: {
        df_cache_entry *ents;
        size_t cnt;
        uint64_t raw[DF_CACHE_MAX_LAYERS] = {0}, st[DF_CACHE_MAX_LAYERS] = {0};
        if (len >= 48) /* adopt the input's uuid, so the fuzzer gets past that check */
            memcpy(p.uuid, b + 32, 16);
        if (df_cache_index_parse(&p, b, len, 0, "fuzz.dfi", &ents, &cnt, raw, st, &e) == 0)
            free(ents);
        break;
    }
    default: {
        df_cache_params q;
        df_cache_params_from_json((const char *)b, len, "fuzz.json", &q, &e);
        break;
    }
    }
    return 0;
}
