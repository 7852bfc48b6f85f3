/* backend.cu - the CUDA backend handle: one device, one stream, stream-
 * ordered memory, host int-array staging, shared scratch, and the dispatch
 * table pointing at the kernels in this folder.
 *
 * Why one stream: ops are issued by one host thread in model order, so a
 * single in-order stream gives every dependency for free; the extractor
 * overlaps its device-to-host copies on a second stream of its own. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "cuda_state.h"
#include "device.h"
#include "dflash_attn.h"
#include "fp8_cuda.h"
#include "lmhead_cuda.h"
#include "train_cuda.h"
#include "knobs.h"
extern "C" {
#include "log.h"
}

int df_cuda_fail(cudaError_t err, const char *what)
{
    if (err == cudaSuccess)
        return 0;
    df_log(DF_LOG_ERROR, "cuda: %s: %s", what, cudaGetErrorString(err));
    return -EIO;
}

int df_cuda_check_launch(const char *what)
{
    return df_cuda_fail(cudaGetLastError(), what);
}

static df_cuda_state *st_of(df_backend *be)
{
    return (df_cuda_state *)be->impl;
}

cudaStream_t df_cuda_stream(df_backend *be)
{
    return st_of(be)->stream;
}

/* ---- staging of host int arrays ---- */

const int32_t *df_cuda_stage_i32(df_backend *be, const int32_t *host, int64_t n)
{
    df_cuda_state *s = st_of(be);
    size_t bytes = (size_t)(n > 0 ? n : 1) * sizeof(int32_t);
    s->stage_clock++;
    for (int i = 0; i < DF_CUDA_STAGE_SLOTS; i++) {
        df_cuda_stage *sl = &s->stage[i];
        if (sl->n == n && sl->dev && (n == 0 || !memcmp(sl->shadow, host, bytes))) {
            sl->used = s->stage_clock;
            return sl->dev;
        }
    }
    /* Miss: refill the least recently used slot. Its old device copy may
     * still be read by enqueued kernels; the copy below is ordered after
     * them on the same stream, and a free is stream-ordered too. */
    df_cuda_stage *v = &s->stage[0];
    for (int i = 1; i < DF_CUDA_STAGE_SLOTS; i++)
        if (s->stage[i].used < v->used)
            v = &s->stage[i];
    /* The slot's previous copy may still be pending: shadow is its source */
    if (v->done && df_cuda_fail(cudaEventSynchronize(v->done), "staging copy"))
        return NULL;
    if (v->cap < bytes) {
        size_t cap = bytes < 4096 ? 4096 : bytes + bytes / 4;
        if (v->dev && df_cuda_fail(cudaFreeAsync(v->dev, s->stream), "free staging"))
            return NULL;
        v->dev = NULL;
        v->n = -1;
        if (v->shadow)
            (void)cudaFreeHost(v->shadow);
        v->shadow = NULL;
        v->cap = 0;
        if (df_cuda_fail(cudaHostAlloc((void **)&v->shadow, cap, cudaHostAllocDefault),
                         "alloc pinned staging") ||
            df_cuda_fail(cudaMallocAsync((void **)&v->dev, cap, s->stream), "alloc staging")) {
            if (v->shadow)
                (void)cudaFreeHost(v->shadow);
            v->shadow = NULL;
            v->dev = NULL;
            return NULL;
        }
        v->cap = cap;
    }
    if (!v->done && df_cuda_fail(cudaEventCreateWithFlags(&v->done, cudaEventDisableTiming),
                                 "staging event"))
        return NULL;
    if (n > 0)
        memcpy(v->shadow, host, bytes);
    /* From the shadow (stable until this slot is refilled, which waits for
     * this copy first) so the caller's array may be reused at once. */
    if (n > 0 && (df_cuda_fail(cudaMemcpyAsync(v->dev, v->shadow, bytes, cudaMemcpyHostToDevice,
                                               s->stream),
                               "stage int array") ||
                  df_cuda_fail(cudaEventRecord(v->done, s->stream), "staging event"))) {
        v->n = -1;
        return NULL;
    }
    v->n = n;
    v->used = s->stage_clock;
    return v->dev;
}

size_t df_cuda_scratch_lent(df_backend *be)
{
    return be->lent ? be->lent_bytes : 0;
}

void *df_cuda_scratch(df_backend *be, size_t bytes)
{
    df_cuda_state *s = st_of(be);
    if (be->lent && bytes <= be->lent_bytes) /* df_backend_lend_scratch */
        return be->lent;
    if (bytes <= s->scratch_cap)
        return s->scratch;
    /* some slack against regrowing for slightly larger calls, bounded: the
     * LM head's chunks make this a GiB */
    size_t slack = bytes / 4 < ((size_t)64 << 20) ? bytes / 4 : ((size_t)64 << 20);
    size_t cap = bytes + slack;
    if (s->scratch && df_cuda_fail(cudaFreeAsync(s->scratch, s->stream), "free scratch"))
        return NULL;
    s->scratch = NULL;
    s->scratch_cap = 0;
    if (df_cuda_fail(cudaMallocAsync(&s->scratch, cap, s->stream), "alloc scratch")) {
        s->scratch = NULL;
        return NULL;
    }
    s->scratch_cap = cap;
    df_log(DF_LOG_DEBUG, "cuda: scratch grows to %.1f MiB", (double)cap / (1 << 20));
    return s->scratch;
}

/* ---- memory and copies ---- */

static int cu_set(df_backend *be)
{
    return df_cuda_fail(cudaSetDevice(st_of(be)->device), "set device");
}

static int cu_sync(df_backend *be)
{
    df_cuda_state *s = st_of(be);
    if (cu_set(be))
        return -EIO;
    int rc = df_cuda_fail(cudaStreamSynchronize(s->stream), "stream synchronize");
    if (!rc && s->copy) /* uploads ahead too: their sources may be reused after a sync */
        rc = df_cuda_fail(cudaStreamSynchronize(s->copy), "copy stream synchronize");
    if (!rc && s->side) /* and the side stream (whichever of the two is current) */
        rc = df_cuda_fail(cudaStreamSynchronize(s->side_on ? s->main : s->side),
                          "side stream synchronize");
    df_cuda_prof_flush(be);
    return rc;
}

static void *cu_alloc(df_backend *be, size_t bytes)
{
    void *p = NULL;
    if (cu_set(be))
        return NULL;
    /* 256-byte aligned; 0 bytes still gives a unique pointer. */
    if (cudaMalloc(&p, bytes ? bytes : 256) != cudaSuccess) {
        (void)cudaGetLastError();
        size_t fr = 0, tot = 0;
        if (cudaMemGetInfo(&fr, &tot) != cudaSuccess)
            (void)cudaGetLastError();
        df_log(DF_LOG_ERROR,
               "cuda: cannot allocate %.2f GiB on device %d (%.2f of %.2f GiB free): less work per "
               "step needs less (extract: a smaller --batch-tokens; train: smaller --max-tokens)",
               bytes / 1073741824.0, st_of(be)->device, fr / 1073741824.0, tot / 1073741824.0);
        return NULL;
    }
    return p;
}

static void cu_free(df_backend *be, void *p)
{
    /* cudaFree synchronises the device: frees happen at teardown or when a
     * workspace grows, never inside a step. */
    (void)cu_set(be);
    df_cuda_fp8_kept_forget(be); /* codes kept of a weight that may have lived there */
    df_cuda_fp8_wcodes_forget(be);
    (void)cudaFree(p);
}

static void *cu_host_alloc(df_backend *be, size_t bytes)
{
    void *p = NULL;
    if (cu_set(be))
        return NULL;
    if (cudaHostAlloc(&p, bytes ? bytes : 64, cudaHostAllocPortable) != cudaSuccess) {
        df_log(DF_LOG_ERROR, "cuda: cannot allocate %zu bytes of pinned host memory", bytes);
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

static void cu_host_free(df_backend *be, void *p)
{
    (void)be;
    (void)cudaFreeHost(p);
}

static int cu_upload(df_backend *be, void *dst, const void *src, size_t bytes)
{
    df_cuda_state *s = st_of(be);
    if (cu_set(be))
        return -EIO;
    if (df_cuda_fp8_wcodes_touch(be, dst, bytes))
        return -EIO;
    /* Ordered on the stream; from pageable memory the call returns once the
     * source has been staged, from pinned memory we wait for the copy so the
     * caller may reuse src at once either way. */
    int rc = df_cuda_fail(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s->stream),
                          "upload");
    return rc ? rc : df_cuda_fail(cudaStreamSynchronize(s->stream), "upload sync");
}

static int cu_download(df_backend *be, void *dst, const void *src, size_t bytes)
{
    df_cuda_state *s = st_of(be);
    if (cu_set(be) || df_cuda_fp8_wcodes_fresh(be, src, bytes))
        return -EIO;
    int rc = df_cuda_fail(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s->stream),
                          "download");
    return rc ? rc : df_cuda_fail(cudaStreamSynchronize(s->stream), "download sync");
}

__global__ void fill_kernel(void *p, int is_f32, int64_t n, uint64_t seed, float lo, float hi)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float v = df_fill_value(seed, (uint64_t)i, lo, hi);
        if (is_f32)
            ((float *)p)[i] = v;
        else /* round to nearest even, as df_f32_to_bf16 (v is finite) */
            ((uint16_t *)p)[i] = (uint16_t)((__float_as_uint(v) + 0x7fffu +
                                             ((__float_as_uint(v) >> 16) & 1u)) >> 16);
    }
}

static int cu_fill_uniform(df_backend *be, void *p, df_dtype dt, int64_t n, uint64_t seed,
                           float lo, float hi)
{
    if (cu_set(be))
        return -EIO;
    if (df_cuda_fp8_wcodes_touch(be, p, (size_t)n * df_dtype_size(dt)))
        return -EIO;
    int64_t blocks = (n + 255) / 256;
    fill_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), 256, 0, st_of(be)->stream>>>(
        p, dt == DF_DTYPE_F32, n, seed, lo, hi);
    return df_cuda_check_launch("fill_uniform");
}

static int cu_copy(df_backend *be, void *dst, const void *src, size_t bytes)
{
    if (cu_set(be))
        return -EIO;
    if (df_cuda_fp8_wcodes_fresh(be, src, bytes) || df_cuda_fp8_wcodes_touch(be, dst, bytes))
        return -EIO;
    return df_cuda_fail(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                        st_of(be)->stream),
                        "copy");
}

static int cu_zero(df_backend *be, void *dst, size_t bytes)
{
    if (cu_set(be))
        return -EIO;
    if (df_cuda_fp8_wcodes_touch(be, dst, bytes))
        return -EIO;
    return df_cuda_fail(cudaMemsetAsync(dst, 0, bytes, st_of(be)->stream), "zero");
}

__global__ void cast_kernel(void *dst, int to_bf16, const void *src, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        if (to_bf16) {
            uint32_t u = __float_as_uint(((const float *)src)[i]);
            uint16_t h = (u & 0x7fffffffu) > 0x7f800000u
                             ? (uint16_t)((u >> 16) | 0x40)
                             : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
            ((uint16_t *)dst)[i] = h;
        } else {
            ((float *)dst)[i] = __uint_as_float((uint32_t)((const uint16_t *)src)[i] << 16);
        }
    }
}

static int cu_cast(df_backend *be, void *dst, df_dtype dt, const void *src, df_dtype st, int64_t n)
{
    if (cu_set(be))
        return -EIO;
    if (dt == st) /* (cu_copy marks dst) */
        return cu_copy(be, dst, src, (size_t)n * df_dtype_size(dt));
    if (df_cuda_fp8_wcodes_fresh(be, src, (size_t)n * df_dtype_size(st)) ||
        df_cuda_fp8_wcodes_touch(be, dst, (size_t)n * df_dtype_size(dt)))
        return -EIO;
    int64_t blocks = (n + 255) / 256;
    cast_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), 256, 0, st_of(be)->stream>>>(
        dst, dt == DF_DTYPE_BF16, src, n);
    return df_cuda_check_launch("cast");
}

static int cu_upload_async(df_backend *be, void *dst, const void *src, size_t bytes)
{
    if (cu_set(be))
        return -EIO;
    if (df_cuda_fp8_wcodes_touch(be, dst, bytes))
        return -EIO;
    return df_cuda_fail(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, st_of(be)->stream),
                        "upload (async)");
}

/* On the copy stream, after the work enqueued so far on the compute stream
 * (dst may still be read by it); the compute stream waits at upload_join. */
static int cu_upload_ahead(df_backend *be, void *dst, const void *src, size_t bytes)
{
    df_cuda_state *s = st_of(be);
    if (cu_set(be))
        return -EIO;
    if (df_cuda_fp8_wcodes_touch(be, dst, bytes))
        return -EIO;
    if (!s->copy) {
        if (df_cuda_fail(cudaStreamCreateWithFlags(&s->copy, cudaStreamNonBlocking), "copy stream"))
            return -EIO;
        if (df_cuda_fail(cudaEventCreateWithFlags(&s->ev_fork, cudaEventDisableTiming), "event") ||
            df_cuda_fail(cudaEventCreateWithFlags(&s->ev_done, cudaEventDisableTiming), "event")) {
            (void)cudaStreamDestroy(s->copy);
            s->copy = NULL;
            return -EIO;
        }
    }
    if (df_cuda_fail(cudaEventRecord(s->ev_fork, s->stream), "record fork") ||
        df_cuda_fail(cudaStreamWaitEvent(s->copy, s->ev_fork, 0), "copy waits") ||
        df_cuda_fail(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s->copy),
                     "upload ahead") ||
        df_cuda_fail(cudaEventRecord(s->ev_done, s->copy), "record done"))
        return -EIO;
    s->ahead_pending = 1;
    return 0;
}

/* Side mode: `stream` (what every op enqueues on) becomes the side stream,
 * which first waits for the work enqueued so far on the main one. */
static int cu_side(df_backend *be, int on)
{
    df_cuda_state *s = st_of(be);
    if (cu_set(be))
        return -EIO;
    if (!on) {
        s->stream = s->main;
        s->side_on = 0;
        return 0;
    }
    if (!s->side) {
        if (df_cuda_fail(cudaStreamCreateWithFlags(&s->side, cudaStreamNonBlocking), "side stream") ||
            df_cuda_fail(cudaEventCreateWithFlags(&s->ev_side_fork, cudaEventDisableTiming),
                         "event"))
            return -EIO;
        for (int k = 0; k < DF_BACKEND_MARKS; k++)
            if (df_cuda_fail(cudaEventCreateWithFlags(&s->marks[k], cudaEventDisableTiming),
                             "event"))
                return -EIO;
    }
    if (df_cuda_fail(cudaEventRecord(s->ev_side_fork, s->stream), "record side fork") ||
        df_cuda_fail(cudaStreamWaitEvent(s->side, s->ev_side_fork, 0), "side waits"))
        return -EIO;
    s->main = s->stream;
    s->stream = s->side;
    s->side_on = 1;
    return 0;
}

static int cu_side_mark(df_backend *be, int k)
{
    df_cuda_state *s = st_of(be);
    if (cu_set(be) || df_cuda_fail(cudaEventRecord(s->marks[k], s->side), "record mark"))
        return -EIO;
    s->mark_pending[k] = 1;
    return 0;
}

static int cu_wait_mark(df_backend *be, int k)
{
    df_cuda_state *s = st_of(be);
    if (!s->mark_pending[k])
        return 0;
    if (cu_set(be) || df_cuda_fail(cudaStreamWaitEvent(s->stream, s->marks[k], 0), "wait mark"))
        return -EIO;
    s->mark_pending[k] = 0;
    return 0;
}

static int cu_upload_join(df_backend *be)
{
    df_cuda_state *s = st_of(be);
    if (!s->ahead_pending)
        return 0;
    if (cu_set(be) || df_cuda_fail(cudaStreamWaitEvent(s->stream, s->ev_done, 0), "join uploads"))
        return -EIO;
    s->ahead_pending = 0;
    return 0;
}

static int cu_download_async(df_backend *be, void *dst, const void *src, size_t bytes)
{
    df_cuda_state *s = st_of(be);
    if (cu_set(be) || df_cuda_fp8_wcodes_fresh(be, src, bytes))
        return -EIO;
    return df_cuda_fail(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s->stream),
                        "download (async)");
}

static int64_t cu_mem_used(df_backend *be)
{
    size_t free_b = 0, total = 0;
    if (cu_set(be) || cudaMemGetInfo(&free_b, &total) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    return (int64_t)(total - free_b);
}

static void cu_close(df_backend *be)
{
    df_cuda_state *s = st_of(be);
    if (s) {
        (void)cudaSetDevice(s->device);
        if (s->stream)
            (void)cudaStreamSynchronize(s->stream);
        if (s->side_on) {
            s->stream = s->main;
            (void)cudaStreamSynchronize(s->stream);
        }
        if (s->side) {
            (void)cudaStreamSynchronize(s->side);
            (void)cudaStreamDestroy(s->side);
            (void)cudaEventDestroy(s->ev_side_fork);
            for (int k = 0; k < DF_BACKEND_MARKS; k++)
                (void)cudaEventDestroy(s->marks[k]);
        }
        if (s->copy) {
            (void)cudaStreamSynchronize(s->copy);
            (void)cudaStreamDestroy(s->copy);
            (void)cudaEventDestroy(s->ev_fork);
            (void)cudaEventDestroy(s->ev_done);
        }
        df_cuda_prof_close(be);
        for (int i = 0; i < DF_CUDA_STAGE_SLOTS; i++) {
            (void)cudaFree(s->stage[i].dev);
            if (s->stage[i].shadow)
                (void)cudaFreeHost(s->stage[i].shadow);
            if (s->stage[i].done)
                (void)cudaEventDestroy(s->stage[i].done);
        }
        (void)cudaFree(s->scratch);
        df_cuda_gemm_close(s);
        if (s->stream)
            (void)cudaStreamDestroy(s->stream);
        free(s);
    }
    free(be);
}

/* DFLASH_CUDA_FALLBACK=1 runs the CUDA-core fallbacks everywhere (an
 * oracle for the tuned kernels); otherwise they take only the shapes the
 * tuned kernels decline with -ENOTSUP. */
static int force_fallback(void)
{
    return df_knob_int(DF_KNOB_CUDA_FALLBACK);
}

extern "C" int df_cuda_attention(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
                        const int32_t *cu_seqlens, int n_seq, int nq, int nkv, int head_dim,
                        float scale, const df_tensor *gate, df_tensor *out)
{
    int rc = force_fallback() ? -ENOTSUP
                              : df_cuda_attention_flash(be, q, k, v, cu_seqlens, n_seq, nq, nkv,
                                                  head_dim, scale, gate, out);
    if (rc == -ENOTSUP)
        rc = df_cuda_attention_simt(be, q, k, v, cu_seqlens, n_seq, nq, nkv, head_dim, scale,
                                    gate, out);
    return rc;
}

extern "C" int df_cuda_gdn(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
                  const df_tensor *g, const df_tensor *beta, const int32_t *cu_seqlens, int n_seq,
                  int hk, int hv, int dk, int dv, df_gdn_mode mode, df_tensor *out)
{
    int rc = force_fallback() ? -ENOTSUP
                              : df_cuda_gdn_chunked(be, q, k, v, g, beta, cu_seqlens, n_seq, hk, hv, dk,
                                            dv, mode, out);
    if (rc == -ENOTSUP)
        rc = df_cuda_gdn_recurrent(be, q, k, v, g, beta, cu_seqlens, n_seq, hk, hv, dk, dv, out);
    return rc;
}

/* The DFlash drafter attention (dflash_attn/) behind the op interface:
 * contiguous matrices, block arrays staged from the host. */
static int dflash_args(df_backend *be, const df_tensor *q, const df_tensor *kc,
                       const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,
                       const df_dflash_blocks *blk, int nq, int nkv, int head_dim, float scale,
                       df_cuda_dflash_args *a)
{
    const df_tensor *all[5] = {q, kc, vc, kb, vb};
    for (int i = 0; i < 5; i++)
        if (all[i]->shape[0] > 1 && all[i]->stride[0] != all[i]->shape[1])
            return -ENOTSUP; /* the kernels take contiguous rows */
    memset(a, 0, sizeof *a);
    a->S = (int)kc->shape[0];
    a->n_blocks = blk->n_blocks;
    a->block_size = blk->block_size;
    a->window = blk->window;
    a->nq = nq;
    a->nkv = nkv;
    a->head_dim = head_dim;
    a->scale = scale;
    int n = blk->n_blocks;
    a->anchor = df_cuda_stage_i32(be, blk->anchor, n);
    a->doc_start = a->anchor ? df_cuda_stage_i32(be, blk->doc_start, n) : NULL;
    /* valid[] is bytes: staged packed into int32 words (the stage cache keys
     * on content, so an unchanged batch costs a memcmp). */
    int32_t *words = (int32_t *)calloc((size_t)(n + 3) / 4 + 1, sizeof(int32_t));
    if (!words)
        return -ENOMEM;
    memcpy(words, blk->valid, (size_t)n);
    a->valid = (const uint8_t *)df_cuda_stage_i32(be, words, (n + 3) / 4 + 1);
    free(words);
    if (!a->anchor || !a->doc_start || !a->valid)
        return -EIO;
    a->q = (const uint16_t *)q->data;
    a->kc = (const uint16_t *)kc->data;
    a->vc = (const uint16_t *)vc->data;
    a->kb = (const uint16_t *)kb->data;
    a->vb = (const uint16_t *)vb->data;
    return 0;
}

extern "C" int df_cuda_dflash_attn(df_backend *be, const df_tensor *q, const df_tensor *kc,
                          const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,
                          const df_dflash_blocks *blk, int nq, int nkv, int head_dim, float scale,
                          df_tensor *out, df_tensor *lse)
{
    df_cuda_dflash_args a;
    int rc = dflash_args(be, q, kc, vc, kb, vb, blk, nq, nkv, head_dim, scale, &a);
    if (rc)
        return rc;
    if ((out->shape[0] > 1 && out->stride[0] != out->shape[1]) ||
        (lse->shape[0] > 1 && lse->stride[0] != lse->shape[1]))
        return -ENOTSUP;
    a.out = (uint16_t *)out->data;
    a.lse = (float *)lse->data;
    return df_cuda_dflash_fwd(&a, st_of(be)->stream);
}

extern "C" int df_cuda_dflash_attn_bwd(df_backend *be, const df_tensor *q, const df_tensor *kc,
                              const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,
                              const df_dflash_blocks *blk, int nq, int nkv, int head_dim,
                              float scale, const df_tensor *out, const df_tensor *lse,
                              const df_tensor *dout, df_tensor *dq, df_tensor *dkc,
                              df_tensor *dvc, df_tensor *dkb, df_tensor *dvb)
{
    df_cuda_dflash_args a;
    int rc = dflash_args(be, q, kc, vc, kb, vb, blk, nq, nkv, head_dim, scale, &a);
    if (rc)
        return rc;
    const df_tensor *more[7] = {out, lse, dout, dq, dkc, dvc, dkb};
    for (int i = 0; i < 7; i++)
        if (more[i]->shape[0] > 1 && more[i]->stride[0] != more[i]->shape[1])
            return -ENOTSUP;
    if (dvb->shape[0] > 1 && dvb->stride[0] != dvb->shape[1])
        return -ENOTSUP;
    a.out = (uint16_t *)out->data;
    a.lse = (float *)lse->data;
    a.dout = (const uint16_t *)dout->data;
    a.dq = (uint16_t *)dq->data;
    a.dkc = (uint16_t *)dkc->data;
    a.dvc = (uint16_t *)dvc->data;
    a.dkb = (uint16_t *)dkb->data;
    a.dvb = (uint16_t *)dvb->data;
    /* WG3's stored dS sized to the spans as they are (the host has the blocks),
     * in as few block ranges as fit memory lent for it (df_backend_lend_scratch:
     * the drafter lends its dead MLP activations), else ranges of at most
     * DF_CUDA_DFLASH_DS_RANGE_BYTES in the shared scratch */
    int32_t *off = (int32_t *)malloc((size_t)(blk->n_blocks > 0 ? blk->n_blocks : 1) * sizeof(int32_t));
    int32_t bounds[DF_CUDA_DFLASH_DS_MAX_RANGES + 1];
    if (!off)
        return -ENOMEM;
    const int64_t tiles = df_cuda_dflash_ds_offsets(blk->anchor, blk->doc_start, blk->valid,
                                                    blk->n_blocks, a.window, off);
    a.ds_off = blk->n_blocks > 0 ? df_cuda_stage_i32(be, off, blk->n_blocks) : NULL;
    if (blk->n_blocks > 0 && !a.ds_off) {
        free(off);
        return -EIO;
    }
    const size_t rest = df_cuda_dflash_bwd_workspace_bytes(&a); /* all but the store (no tiles yet) */
    const size_t lent = df_cuda_scratch_lent(be);
    const size_t min_range = (size_t)64 << 20; /* less lent than this: the scratch instead */
    const int in_lent = lent >= rest + min_range;
    a.ds_tiles = tiles;
    if (df_cuda_dflash_bwd_impl() == DF_CUDA_DFLASH_IMPL_WG3) { /* (the only one with ranges) */
        a.ds_ranges = df_cuda_dflash_ds_ranges(off, blk->n_blocks, tiles, nkv,
                                               in_lent ? lent - rest : 0, bounds, &a.ds_range_tiles);
        a.ds_bounds = bounds;
        static int most = 0; /* logged: the first call and each new largest count */
        if (a.ds_ranges > most) {
            most = a.ds_ranges;
            df_log(DF_LOG_DEBUG, "cuda: dflash bwd: stored dS %.1f MiB in %d block range(s), %s",
                   (double)tiles * nkv * (16 << 10) / (1 << 20), a.ds_ranges,
                   in_lent ? "in lent memory" : "in the scratch");
        }
    }
    free(off);
    /* The workspace from the lent bytes where it fits, else the shared scratch
     * (it only grows): planned memory, no allocation inside the step; the LM
     * head's chunks use the same bytes at another time of the step. */
    if (!(a.workspace = df_cuda_scratch(be, df_cuda_dflash_bwd_workspace_bytes(&a))))
        return -ENOMEM;
    return df_cuda_dflash_bwd(&a, st_of(be)->stream);
}


// The kernels this process runs, once (the first backend opened): which
// attention paths the device and DFLASH_PORTABLE chose, so a log says
// whether a GPU ran the Hopper kernels or the portable ones.
static void log_kernels_once(int device)
{
    static int done;
    if (done)
        return;
    done = 1;
    cudaDeviceProp pr;
    if (cudaGetDeviceProperties(&pr, device) != cudaSuccess) {
        cudaGetLastError();
        return;
    }
    df_log(DF_LOG_INFO, "cuda: %s (sm_%d%d, %d SMs, %.0f GiB); attention: drafter %s forward, %s backward, "
                        "target %s%s",
           pr.name, pr.major, pr.minor, pr.multiProcessorCount, pr.totalGlobalMem / 1073741824.0,
           df_cuda_dflash_impl_name(df_cuda_dflash_fwd_impl()), df_cuda_dflash_impl_name(df_cuda_dflash_bwd_impl()),
           df_cuda_attention_path(), df_cuda_portable_forced() ? " (DFLASH_PORTABLE=1)" : "");
}

static const df_backend_vt cuda_vt = {
    /* .close = */ cu_close,
    /* .sync = */ cu_sync,
    /* .alloc = */ cu_alloc,
    /* .free = */ cu_free,
    /* .upload = */ cu_upload,
    /* .download = */ cu_download,
    /* .copy = */ cu_copy,
    /* .zero = */ cu_zero,
    /* .cast = */ cu_cast,
    /* .download_async = */ cu_download_async,
    /* .host_alloc = */ cu_host_alloc,
    /* .host_free = */ cu_host_free,
    /* .fill_uniform = */ cu_fill_uniform,
    /* .mem_used = */ cu_mem_used,
    /* .prof_begin = */ df_cuda_prof_begin,
    /* .prof_end = */ df_cuda_prof_end,
    // the compute ops, in op_list.h's order
#define DF_CUDA_OP_ENTRY(ret, name, params) df_cuda_##name,
    DF_OPS(DF_CUDA_OP_ENTRY)
#undef DF_CUDA_OP_ENTRY
    /* .upload_async = */ cu_upload_async,
    /* .prof_reset = */ df_cuda_prof_reset,
    /* .upload_ahead = */ cu_upload_ahead,
    /* .upload_join = */ cu_upload_join,
    /* .side = */ cu_side,
    /* .side_mark = */ cu_side_mark,
    /* .wait_mark = */ cu_wait_mark,
};

extern "C" df_backend *df_backend_cuda_open(int device, df_err *e)
{
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        (void)cudaGetLastError();
        df_errf(e, -ENODEV, "cuda backend: no CUDA device (%s)",
                err == cudaSuccess ? "0 devices" : cudaGetErrorString(err));
        return NULL;
    }
    if (device < 0 || device >= count) {
        df_errf(e, -ENODEV, "cuda backend: device %d does not exist (%d visible)", device, count);
        return NULL;
    }
    df_backend *be = (df_backend *)calloc(1, sizeof *be);
    df_cuda_state *s = (df_cuda_state *)calloc(1, sizeof *s);
    if (!be || !s) {
        free(be);
        free(s);
        df_errf(e, -ENOMEM, "cuda backend: out of memory");
        return NULL;
    }
    be->kind = DF_BACKEND_CUDA;
    be->vt = &cuda_vt;
    be->act = DF_DTYPE_BF16;
    be->host_addressable = 0;
    be->impl = s;
    s->device = device;
    for (int i = 0; i < DF_CUDA_STAGE_SLOTS; i++)
        s->stage[i].n = -1;
    if ((err = cudaSetDevice(device)) != cudaSuccess ||
        (err = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        df_errf(e, -EIO, "cuda backend: device %d: %s", device, cudaGetErrorString(err));
        cu_close(be);
        return NULL;
    }
    int rc = df_cuda_gemm_open(s, e);
    if (rc) {
        cu_close(be);
        return NULL;
    }
    log_kernels_once(device);
    if (df_knob_int(DF_KNOB_PROFILE))
        df_cuda_prof_open(be);
    return be;
}

extern "C" int df_backend_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

extern "C" void *df_backend_cuda_stream(df_backend *be)
{
    if (!be || be->kind != DF_BACKEND_CUDA)
        return NULL;
    return (void *)((df_cuda_state *)be->impl)->stream;
}

extern "C" int df_backend_cuda_device(df_backend *be)
{
    if (!be || be->kind != DF_BACKEND_CUDA)
        return -1;
    return ((df_cuda_state *)be->impl)->device;
}
