/* Fuzzes the safetensors parser through df_st_open_mem: any bytes must give
 * either an error or a df_st whose every view lies inside the input. The
 * views are read end to end so ASan catches a view that escapes. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n)
{
    /* A private copy of exactly n bytes: a read past the end is an ASan error. */
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf)
        return 0;
    memcpy(buf, d, n);
    df_err e;
    df_st *st;
    if (df_st_open_mem(buf, n, "fuzz", &st, &e) == 0) {
        unsigned acc = 0;
        for (size_t i = 0; i < df_st_count(st); i++) {
            const df_st_tensor *t = df_st_at(st, i);
            const uint8_t *p = t->data;
            if (t->nbytes > n || (const uint8_t *)t->data < buf ||
                p + t->nbytes > buf + n || t->ndim < 0 || t->ndim > DF_ST_MAX_DIMS)
                abort();
            for (uint64_t k = 0; k < t->nbytes; k++)
                acc += p[k];
            if (df_st_find(st, t->name) != t)
                abort();
            df_st_check(t, t->dtype, t->ndim, t->shape, &e);
        }
        const char *k, *v;
        for (size_t i = 0; i < df_st_metadata_count(st); i++)
            if (df_st_metadata_at(st, i, &k, &v) == 0)
                acc += (unsigned)strlen(k) + (unsigned)strlen(v);
        (void)acc;
        df_st_close(st);
    } else if (e.code >= 0 || !memchr(e.msg, 0, sizeof e.msg)) {
        abort();
    }
    free(buf);
    return 0;
}
