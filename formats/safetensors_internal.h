/* safetensors_internal.h - what the safetensors reader (safetensors.c) and
 * writer (safetensors_writer.c) share. Internal to formats/. */
#ifndef DF_SAFETENSORS_INTERNAL_H
#define DF_SAFETENSORS_INTERNAL_H

#include <errno.h>
#include <stdlib.h>

/* JSON numbers arrive as doubles: integers above 2^53 would be silently
 * rounded, so anything larger is refused (no real file comes close). */
#define JSON_INT_MAX 9007199254740992.0

/* *p grown (doubling, from 16) to hold need elements of elem bytes: 0 or -ENOMEM. */
static inline int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t nc = *cap ? *cap * 2 : 16;
    while (nc < need)
        nc *= 2;
    void *q = realloc(*p, nc * elem);
    if (!q)
        return -ENOMEM;
    *p = q;
    *cap = nc;
    return 0;
}

#endif

