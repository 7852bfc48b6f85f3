/* fp8_wcodes.cu - the weights' E4M3 codes kept by AdamW (fp8_cuda.h's
 * df_cuda_fp8_wcodes): the registry, its regions, and who may trust them.
 *
 * A kept weight's two code matrices (w for DF_GEMM_FWD, w^T for _BWD_X) are
 * written by the optimizer step that writes the weight (optim.cu's tile
 * kernel), so the forward and the backward take them instead of rounding the
 * weight at each call (twice a step per use). ready is the one invariant:
 * set only when the codes were written from the weight's current values;
 * cleared by every other write into the weight this backend sees (uploads,
 * copies, casts, fills, zeroing, a free anywhere, an AdamW that covers the
 * weight only in part). */
#include <cuda_runtime.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "cuda_state.h"
#include "fp8_cuda.h"
#include "knobs.h"

namespace {

typedef struct wcodes_set {
    df_cuda_fp8_wcodes *e;
    int n, cap;
} wcodes_set;

int64_t g_wcodes_used; /* GEMM calls that took a kept weight's codes */

wcodes_set *set_of(df_backend *be)
{
    return (wcodes_set *)((df_cuda_state *)be->impl)->wcodes;
}

int overlaps(const df_cuda_fp8_wcodes *e, const void *p, size_t bytes)
{
    uintptr_t a = (uintptr_t)e->w, b = a + (size_t)(e->rows * e->cols) * 2;
    uintptr_t x = (uintptr_t)p, y = x + bytes;
    return x < b && a < y;
}

} // namespace

extern "C" int df_cuda_fp8_wcodes_keep(df_backend *be, const df_tensor *w)
{
    df_cuda_state *s = (df_cuda_state *)be->impl;
    if (!df_knob_int(DF_KNOB_FP8_WEIGHT_CODES) || !df_backend_fp8_tensor_cores(be) ||
        w->dtype != DF_DTYPE_BF16 || w->ndim != 2 || w->shape[0] < 128 || w->shape[1] < 128 ||
        w->shape[0] % 128 || w->shape[1] % 128 || w->shape[0] / 128 > 65535 || w->stride[0] != w->shape[1] ||
        ((uintptr_t)w->data & 15))
        return 0;
    wcodes_set *ws = set_of(be);
    if (!ws && !(ws = (wcodes_set *)calloc(1, sizeof *ws)))
        return -ENOMEM;
    s->wcodes = ws;
    for (int i = 0; i < ws->n; i++)
        if (overlaps(&ws->e[i], w->data, (size_t)(w->shape[0] * w->shape[1]) * 2))
            return ws->e[i].w == w->data && ws->e[i].rows == w->shape[0] &&
                   ws->e[i].cols == w->shape[1]; /* kept already: 1; another view: 0 */
    if (ws->n == ws->cap) {
        int cap = ws->cap ? 2 * ws->cap : 64;
        df_cuda_fp8_wcodes *e = (df_cuda_fp8_wcodes *)realloc(ws->e, (size_t)cap * sizeof *e);
        if (!e)
            return -ENOMEM;
        ws->e = e, ws->cap = cap;
    }
    df_cuda_fp8_wcodes *e = &ws->e[ws->n];
    memset(e, 0, sizeof *e);
    int64_t N = w->shape[0], K = w->shape[1];
    size_t fsc, bsc; /* the scales' offsets in each region */
    e->fwd_bytes = df_cuda_fp8_weight_region(DF_GEMM_FWD, N, K, &fsc);
    e->bwx_bytes = df_cuda_fp8_weight_region(DF_GEMM_BWD_X, K, N, &bsc);
    void *buf = NULL;
    if (cudaSetDevice(s->device) != cudaSuccess) {
        (void)cudaGetLastError();
        return -EIO;
    }
    /* (zeroed: the scales' padding past the reduction's blocks is never written) */
    if (cudaMalloc(&buf, e->fwd_bytes + e->bwx_bytes) != cudaSuccess ||
        cudaMemset(buf, 0, e->fwd_bytes + e->bwx_bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        if (buf)
            (void)cudaFree(buf);
        return -ENOMEM;
    }
    e->w = w->data, e->rows = N, e->cols = K;
    e->fwd = buf, e->bwx = (uint8_t *)buf + e->fwd_bytes;
    e->fwd_scales = (float *)((uint8_t *)e->fwd + fsc);
    e->bwx_scales = (float *)((uint8_t *)e->bwx + bsc);
    e->ready = 0;
    ws->n++;
    return 1;
}

extern "C" int df_cuda_fp8_wcodes_in(df_backend *be, const void *p, size_t bytes,
                                     df_cuda_fp8_wcodes **out, int max)
{
    wcodes_set *ws = set_of(be);
    int n = 0;
    for (int i = 0; ws && i < ws->n; i++) {
        if (!overlaps(&ws->e[i], p, bytes))
            continue;
        ws->e[i].ready = 0;
        if (n < max) { /* insertion by address */
            int j = n++;
            for (; j > 0 && (uintptr_t)out[j - 1]->w > (uintptr_t)ws->e[i].w; j--)
                out[j] = out[j - 1];
            out[j] = &ws->e[i];
        }
    }
    return n;
}

extern "C" const df_cuda_fp8_wcodes *df_cuda_fp8_wcodes_of(df_backend *be, const df_tensor *w)
{
    wcodes_set *ws = set_of(be);
    for (int i = 0; ws && i < ws->n; i++) {
        const df_cuda_fp8_wcodes *e = &ws->e[i];
        if (e->ready && e->w == w->data && w->dtype == DF_DTYPE_BF16 && w->ndim == 2 &&
            e->rows == w->shape[0] && e->cols == w->shape[1] && w->stride[0] == e->cols)
            return e;
    }
    return NULL;
}

extern "C" void df_cuda_fp8_wcodes_touch(df_backend *be, const void *p, size_t bytes)
{
    wcodes_set *ws = set_of(be);
    for (int i = 0; ws && i < ws->n; i++)
        if (overlaps(&ws->e[i], p, bytes))
            ws->e[i].ready = 0;
}

extern "C" void df_cuda_fp8_wcodes_forget(df_backend *be)
{
    wcodes_set *ws = set_of(be);
    for (int i = 0; ws && i < ws->n; i++)
        ws->e[i].ready = 0;
}

extern "C" void df_cuda_fp8_wcodes_drop(df_backend *be, const void *p, size_t bytes)
{
    wcodes_set *ws = set_of(be);
    int k = 0;
    for (int i = 0; ws && i < ws->n; i++) {
        if (overlaps(&ws->e[i], p, bytes)) {
            (void)cudaFree(ws->e[i].fwd);
            continue;
        }
        ws->e[k++] = ws->e[i];
    }
    if (ws)
        ws->n = k;
}

extern "C" void df_cuda_fp8_wcodes_count(df_backend *be, int *n, size_t *bytes)
{
    wcodes_set *ws = set_of(be);
    *n = 0, *bytes = 0;
    for (int i = 0; ws && i < ws->n; i++)
        (*n)++, *bytes += ws->e[i].fwd_bytes + ws->e[i].bwx_bytes;
}

extern "C" void df_cuda_fp8_wcodes_took(void) { g_wcodes_used++; }

extern "C" int64_t df_cuda_fp8_wcodes_used(void) { return g_wcodes_used; }

extern "C" void df_cuda_fp8_wcodes_close(df_cuda_state *s)
{
    wcodes_set *ws = (wcodes_set *)s->wcodes;
    if (!ws)
        return;
    for (int i = 0; i < ws->n; i++)
        (void)cudaFree(ws->e[i].fwd);
    free(ws->e);
    free(ws);
    s->wcodes = NULL;
}

extern "C" int df_backend_fp8_keep_weight_codes(df_backend *be, const df_tensor *w)
{
    if (!be || be->kind != DF_BACKEND_CUDA)
        return 0;
    return df_cuda_fp8_wcodes_keep(be, w);
}

extern "C" void df_backend_fp8_drop_weight_codes(df_backend *be, const void *p, size_t bytes)
{
    if (be && be->kind == DF_BACKEND_CUDA)
        df_cuda_fp8_wcodes_drop(be, p, bytes);
}
