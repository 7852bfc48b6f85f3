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
 * weight only in part).
 *
 * Lazy BF16 values (DFLASH_FP8_LAZY_BF16): where every use of a kept weight
 * in a step takes its codes, its BF16 values are read by nobody until an
 * evaluation, a download or a copy. AdamW's tile kernel then leaves them out
 * (2 of the ~26 bytes per parameter it moves) and marks the weight stale;
 * df_cuda_fp8_wcodes_fresh writes them from the master, as AdamW would have
 * (f2bf of the same float: the same bits), and the backend calls it before
 * each of its reads of weight memory (the BF16 GEMMs, the FP8 GEMM's BF16
 * path and first-call check, downloads, copies and casts from it) and
 * before writes into part of it (touch) or the end of its keeping (drop,
 * forget). */
#include <cuda_runtime.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.cuh"
#include "cuda_internal.h"
#include "cuda_state.h"
#include "fp8_cuda.h"
#include "knobs.h"

namespace {

/* w[i] = bf16(master[i]), 4 a thread-step (n a multiple of 4: rows and cols are of 128) */
__global__ void __launch_bounds__(256) fresh_kernel(const float4 *__restrict__ master,
                                                    uint2 *__restrict__ w, int64_t nq)
{
    for (int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; q < nq;
         q += (int64_t)gridDim.x * blockDim.x) {
        const float4 p = master[q];
        w[q] = make_uint2(pack2(p.x, p.y), pack2(p.z, p.w));
    }
}

/* e's BF16 values from its master, on the backend's stream; e no longer stale */
int make_fresh(df_backend *be, df_cuda_fp8_wcodes *e)
{
    if (!e->stale)
        return 0;
    const int64_t nq = e->rows * e->cols / 4;
    const int64_t blocks = (nq + 255) / 256 < 4096 ? (nq + 255) / 256 : 4096;
    fresh_kernel<<<(unsigned)blocks, 256, 0, df_cuda_stream(be)>>>(
        (const float4 *)e->master, (uint2 *)e->w, nq);
    e->stale = 0;
    return df_cuda_check_launch("fp8 weight values from the master");
}

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

extern "C" int df_cuda_fp8_wcodes_touch(df_backend *be, const void *p, size_t bytes)
{
    wcodes_set *ws = set_of(be);
    int rc = 0;
    for (int i = 0; ws && i < ws->n; i++)
        if (overlaps(&ws->e[i], p, bytes)) {
            int r = make_fresh(be, &ws->e[i]); /* the part not written keeps its values */
            rc = rc ? rc : r;
            ws->e[i].ready = 0;
        }
    return rc;
}

extern "C" int df_cuda_fp8_wcodes_fresh(df_backend *be, const void *p, size_t bytes)
{
    wcodes_set *ws = set_of(be);
    int rc = 0;
    for (int i = 0; ws && i < ws->n; i++)
        if (ws->e[i].stale && overlaps(&ws->e[i], p, bytes)) {
            int r = make_fresh(be, &ws->e[i]);
            rc = rc ? rc : r;
        }
    return rc;
}

extern "C" int df_cuda_fp8_wcodes_fresh_t(df_backend *be, const df_tensor *t)
{
    if (!set_of(be) || t->shape[0] < 1 || t->shape[1] < 1)
        return 0;
    size_t n = (size_t)((t->shape[0] - 1) * t->stride[0] + t->shape[1]);
    return df_cuda_fp8_wcodes_fresh(be, t->data, n * df_dtype_size(t->dtype));
}

extern "C" int df_cuda_fp8_wcodes_lazy(void) { return df_knob_int(DF_KNOB_FP8_LAZY_BF16); }

extern "C" void df_cuda_fp8_wcodes_forget(df_backend *be)
{
    wcodes_set *ws = set_of(be);
    for (int i = 0; ws && i < ws->n; i++) {
        (void)make_fresh(be, &ws->e[i]); /* (before the free that called this) */
        ws->e[i].ready = 0;
    }
}

extern "C" void df_cuda_fp8_wcodes_drop(df_backend *be, const void *p, size_t bytes)
{
    wcodes_set *ws = set_of(be);
    int k = 0;
    for (int i = 0; ws && i < ws->n; i++) {
        if (overlaps(&ws->e[i], p, bytes)) {
            (void)make_fresh(be, &ws->e[i]);
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
