/* zero.c - the optimizer state, its buckets and hooks, AdamW (zero.h). */
#include "zero.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_sr.h"
#include "uf16.h"
#include "log.h"
#include "train_ops.h"


void dev_state_free(df_backend *be, dev_state *s)
{
    if (s->sharded) {
        if (s->w) /* (the codes ds_keep_weight_codes asked the backend to keep) */
            df_backend_fp8_drop_weight_codes(be, s->w, (size_t)s->np * df_dtype_size(s->wdt));
        df_backend_free(be, s->master);
        df_backend_free(be, s->m);
        df_backend_free(be, s->v);
        df_backend_free(be, s->m16);
        df_backend_free(be, s->v16);
        df_backend_free(be, s->grad);
        df_backend_free(be, s->w);
    }
    memset(s, 0, sizeof *s);
}

/* Buckets from the parameter table (see above). */
static int ds_buckets(dev_state *s, const df_params *ps, int L, df_err *e)
{
    int64_t q = (int64_t)s->world * DS_ALIGN;
    int nb = 0;
    s->b[nb++] = 0;
    for (int l = 1; l < L; l++) {
        char name[64];
        snprintf(name, sizeof name, "layers.%d.input_layernorm.weight", l);
        int i = df_params_find(ps, name);
        if (i < 0)
            return df_errf(e, -EINVAL, "parameter %s missing", name);
        int64_t at = (ps->p[i].offset + q - 1) / q * q;
        if (at > s->b[nb - 1])
            s->b[nb++] = at;
    }
    s->np = (s->n + q - 1) / q * q;
    s->b[nb] = s->np;
    s->nb = nb;
    int64_t off = 0;
    for (int k = 0; k < nb; k++) {
        s->cnt[k] = (s->b[k + 1] - s->b[k]) / s->world;
        s->soff[k] = off;
        off += s->cnt[k];
    }
    s->nshard = off;
    return 0;
}

/* This rank's slice of bucket k in the gradient array: after the bucket's
 * reduce-scatter, its reduced gradients (cnt[k] of them). */
void *ds_gslice(const dev_state *s, int k)
{
    return (uint8_t *)s->grad + (size_t)(s->b[k] + (int64_t)s->rank * s->cnt[k]) * s->ges;
}

/* This rank's shard of a host [n] array (zeros past n) into dst [nshard]. */
static void ds_take_shard(const dev_state *s, const float *full, float *dst)
{
    for (int k = 0; k < s->nb; k++) {
        int64_t g = s->b[k] + (int64_t)s->rank * s->cnt[k];
        for (int64_t i = 0; i < s->cnt[k]; i++)
            dst[s->soff[k] + i] = g + i < s->n ? full[g + i] : 0.0f;
    }
}

/* Places the checkpoint state (fresh or loaded): this rank's shards, and the
 * full weights the drafter reads. grad: the host gradient array of one CPU
 * rank. */
int dev_state_open(df_backend *be, df_comm *comm, df_ckpt_state *ck, float *grad,
                   int64_t n, const df_params *ps, int L, int grad_f32, int moments16,
                   uint64_t seed, dev_state *s, df_err *e)
{
    memset(s, 0, sizeof *s);
    s->comm = comm;
    s->be = be;
    s->world = comm ? df_comm_world(comm) : 1;
    s->rank = comm ? df_comm_rank(comm) : 0;
    s->n = n;
    int rc = ds_buckets(s, ps, L, e);
    if (rc)
        return rc;
    s->sr_seed = seed;
    s->vdt = moments16 == 3 ? DF_DTYPE_UF16 : moments16 == 2 ? DF_DTYPE_BF16 : DF_DTYPE_F32;
    if (df_backend_host_addressable(be) && s->world == 1 && !moments16) {
        s->master = ck->master;
        s->m = ck->adam_m;
        s->v = ck->adam_v;
        s->grad = grad;
        s->gdt = DF_DTYPE_F32;
        s->ges = 4;
        s->w = ck->master;
        s->wdt = DF_DTYPE_F32;
        s->np = n; /* no padding used: the buckets end at n, grad is [n] */
        s->b[s->nb] = n;
        s->cnt[s->nb - 1] = n - s->b[s->nb - 1];
        return 0;
    }
    s->sharded = 1;
    s->wdt = df_backend_act_dtype(be);
    s->gdt = s->wdt == DF_DTYPE_BF16 && !grad_f32 ? DF_DTYPE_BF16 : DF_DTYPE_F32;
    s->ges = df_dtype_size(s->gdt);
    /* each array's element size: master F32, m BF16 with moments16, v 16-bit from 2 on */
    const size_t es[3] = {4, moments16 ? 2 : 4, moments16 >= 2 ? 2 : 4};
    size_t sb = (size_t)s->nshard * 4;
    s->master = df_backend_alloc(be, sb);
    void *mom[2] = {df_backend_alloc(be, (size_t)s->nshard * es[1]),
                    df_backend_alloc(be, (size_t)s->nshard * es[2])};
    if (moments16)
        s->m16 = mom[0];
    else
        s->m = mom[0];
    if (moments16 >= 2)
        s->v16 = mom[1];
    else
        s->v = mom[1];
    s->grad = df_backend_alloc(be, (size_t)s->np * s->ges);
    s->w = df_backend_alloc(be, (size_t)s->np * df_dtype_size(s->wdt));
    float *tmp = malloc(sb ? sb : 4);
    if (!s->master || !mom[0] || !mom[1] || !s->grad || !s->w || !tmp) {
        free(tmp);
        return df_errf(e, -ENOMEM, "out of memory on %s for %lld parameters' optimizer state",
                       df_backend_name(be), (long long)n);
    }
    float *src[3] = {ck->master, ck->adam_m, ck->adam_v};
    void *dst[3] = {s->master, mom[0], mom[1]};
    for (int i = 0; i < 3 && !rc; i++) {
        ds_take_shard(s, src[i], tmp);
        if (es[i] == 2) /* a 16-bit moment in place (exact for a 16-bit run's) */
            for (int64_t j = 0; j < s->nshard; j++)
                ((uint16_t *)tmp)[j] = i == 2 && s->vdt == DF_DTYPE_UF16 ? df_f32_to_uf16(tmp[j])
                                                                         : df_f32_to_bf16(tmp[j]);
        rc = df_backend_upload(be, dst[i], tmp, (size_t)s->nshard * es[i]);
    }
    free(tmp);
    /* the full weights: the master through the gradient buffer (F32 pieces of
     * its size), cast; the padding past n zero */
    size_t wes = df_dtype_size(s->wdt);
    int64_t piece = (int64_t)((size_t)s->np * s->ges / 4);
    for (int64_t off = 0; off < n && !rc; off += piece) {
        int64_t len = n - off < piece ? n - off : piece;
        rc = df_backend_upload(be, s->grad, ck->master + off, (size_t)len * 4);
        if (!rc)
            rc = df_backend_cast(be, (uint8_t *)s->w + (size_t)off * wes, s->wdt, s->grad,
                                 DF_DTYPE_F32, len);
    }
    if (!rc && s->np > n)
        rc = df_backend_zero(be, (uint8_t *)s->w + (size_t)n * wes, (size_t)(s->np - n) * wes);
    if (!rc)
        rc = df_backend_sync(be);
    return rc ? df_errf(e, rc, "placing the optimizer state on %s failed", df_backend_name(be))
              : 0;
}

/* The drafter's grad hook: after layer l's backward, buckets k >= max(l, 1)
 * are final (bucket k holds layer k from its rounded start on, and the head
 * of layer k + 1, done earlier); bucket 0 holds fc and hidden_norm, final
 * only after the whole backward (layer -1). Reduce-scatters each as soon as
 * it is final. */
int ds_grad_hook(void *ctx, int layer)
{
    dev_state *s = ctx;
    int k = layer < 0 ? 0 : layer > 1 ? layer : 1;
    for (; s->next_bucket >= k && s->next_bucket >= 0; s->next_bucket--) {
        int j = s->next_bucket;
        int rc = df_comm_reduce_scatter(s->comm, (uint8_t *)s->grad + (size_t)s->b[j] * s->ges,
                                        ds_gslice(s, j), (size_t)s->cnt[j], s->gdt,
                                        s->hook_err);
        if (rc)
            return rc;
    }
    return 0;
}

/* Which mark each part of the forward waits for (see dev_state). */
void ds_part_marks(dev_state *s, const df_params *ps, int L)
{
    int64_t end[DF_MAX_LAYERS + 2] = {0}; /* one past the part's last element */
    for (int i = 0; i < ps->n; i++) {
        const df_param *p = &ps->p[i];
        int l = -1, part;
        if (sscanf(p->name, "layers.%d.", &l) == 1 && l >= 0 && l < L)
            part = l + 1;
        else
            part = strcmp(p->name, "norm.weight") ? 0 : L + 1;
        if (p->offset + p->numel > end[part])
            end[part] = p->offset + p->numel;
    }
    for (int part = 0; part < L + 2; part++) {
        int k = 0;
        while (k + 1 < s->nb && s->b[k + 1] < end[part])
            k++;
        s->part_mark[part] = k;
    }
}

int ds_fwd_hook(void *ctx, int part)
{
    dev_state *s = ctx;
    return df_backend_wait_mark(s->be, s->part_mark[part + 1]);
}

int ds_keep_weight_codes(df_backend *be, dev_state *s, const df_params *ps, int *kept,
                         double *gib, df_err *e)
{
    *kept = 0, *gib = 0;
    if (s->world != 1 || !s->sharded || s->wdt != DF_DTYPE_BF16)
        return 0;
    for (int i = 0; i < ps->n; i++) {
        const df_param *p = &ps->p[i];
        if (p->ndim != 2)
            continue;
        df_tensor w = df_tensor_2d((uint16_t *)s->w + p->offset, DF_DTYPE_BF16, p->shape[0],
                                   p->shape[1]);
        int rc = df_backend_fp8_keep_weight_codes(be, &w);
        if (rc < 0)
            return df_errf(e, rc, "keeping %s's FP8 codes on %s (%.1f MiB)", p->name,
                           df_backend_name(be), 2.0 * (double)p->numel / (1 << 20));
        *kept += rc;
        *gib += rc ? 2.0 * (double)p->numel / (1 << 30) : 0;
    }
    return 0;
}

/* AdamW on this rank's slice of bucket k (cnt[k] > 0): the bf16 weights the drafter reads
 * written by the optimizer (GPU), or the fp32 master copied there (ranks on the CPU). BF16
 * moments round with bits keyed by (seed, step) and the elements' global index: their
 * rounding does not depend on how the parameters are split into buckets and shards. */
static int ds_adam_bucket(df_backend *be, dev_state *s, int k, float lr, int64_t t, float gscale)
{
    size_t es = df_dtype_size(s->wdt);
    int64_t g = s->b[k] + (int64_t)s->rank * s->cnt[k], o = s->soff[k];
    void *w16 = s->sharded && s->wdt == DF_DTYPE_BF16 ? (uint8_t *)s->w + g * es : NULL;
    void *v = s->v16 ? (void *)(s->v16 + o) : (void *)(s->v + o);
    int rc = s->m16 ? df_op_adamw_m16(be, s->master + o, ds_gslice(s, k), s->gdt, s->m16 + o, v,
                                      s->vdt, s->cnt[k], lr, 0.9f,
                                      0.999f, 1e-8f, 0.0f, t, gscale,
                                      df_sr_bits(s->sr_seed, (uint64_t)t), g, w16)
                    : df_op_adamw(be, s->master + o, ds_gslice(s, k), s->gdt, s->m + o,
                                  s->v + o, s->cnt[k], lr, 0.9f, 0.999f, 1e-8f, 0.0f, t, gscale,
                                  w16);
    if (!rc && s->sharded && s->wdt == DF_DTYPE_F32)
        rc = df_backend_copy(be, (float *)s->w + g, s->master + o, (size_t)s->cnt[k] * 4);
    return rc;
}

/* AdamW on this rank's shard, bucket by bucket, then the full weights
 * completed by an all-gather per bucket. With overlap, on the side stream:
 * per bucket AdamW, its all-gather (joined into the side stream), mark k.
 * (The gradients need no clearing: the next step's first row writes them.) */
int dev_state_adamw(df_backend *be, dev_state *s, float lr, int64_t t, float gscale,
                    df_err *e)
{
    size_t es = df_dtype_size(s->wdt);
    if (s->overlap) {
        int rc = df_backend_side_begin(be);
        if (rc)
            return df_errf(e, rc, "the optimizer's side stream on %s", df_backend_name(be));
        for (int k = 0; k < s->nb && !rc; k++) {
            if (s->cnt[k])
                rc = ds_adam_bucket(be, s, k, lr, t, gscale);
            if (rc) {
                df_errf(e, rc, "the optimizer failed on %s", df_backend_name(be));
                break;
            }
            if (s->world > 1) {
                uint8_t *base = (uint8_t *)s->w + s->b[k] * es;
                if ((rc = df_comm_all_gather(s->comm, base + (size_t)s->rank * s->cnt[k] * es,
                                             base, (size_t)s->cnt[k] * es, e)) ||
                    (rc = df_comm_wait(s->comm, e)))
                    break;
            }
            if ((rc = df_backend_side_mark(be, k)))
                df_errf(e, rc, "the optimizer's side stream on %s", df_backend_name(be));
        }
        int rc2 = df_backend_side_end(be);
        return rc ? rc : rc2 ? df_errf(e, rc2, "ending the optimizer's side stream") : 0;
    }
    for (int k = 0; k < s->nb; k++) {
        if (!s->cnt[k])
            continue;
        int rc = ds_adam_bucket(be, s, k, lr, t, gscale);
        if (rc)
            return df_errf(e, rc, "the optimizer failed on %s", df_backend_name(be));
    }
    if (s->world > 1) {
        for (int k = 0; k < s->nb; k++) {
            uint8_t *base = (uint8_t *)s->w + s->b[k] * es;
            int rc = df_comm_all_gather(s->comm, base + (size_t)s->rank * s->cnt[k] * es, base,
                                        (size_t)s->cnt[k] * es, e);
            if (rc)
                return rc;
        }
        return df_comm_wait(s->comm, e);
    }
    return 0;
}

/* n 16-bit values (UF16 with uf, else BF16) at the start of x's memory widened in place into
 * x[0..n): from the last element down, as df_bf16_widen_inplace */
static void widen_inplace(float *x, int64_t n, int uf)
{
    if (!uf) {
        df_bf16_widen_inplace(x, n);
        return;
    }
    for (int64_t j = n - 1; j >= 0; j--) {
        uint16_t h;
        memcpy(&h, (const uint8_t *)x + 2 * j, 2);
        x[j] = df_uf16_to_f32(h);
    }
}

/* Brings master and moments back into the checkpoint's [n] host arrays on
 * every rank (a collective: all ranks call it at the same steps). With one
 * rank the shard is the whole array; else each bucket's slices are gathered
 * into the (free again) gradient buffer, or into a buffer made for it when a
 * bucket's F32 is larger than the gradients (BF16 gradients, few buckets). */
int dev_state_fetch(df_backend *be, dev_state *s, df_ckpt_state *ck, df_err *e)
{
    if (!s->sharded)
        return 0;
    void *src[3] = {s->master, s->m16 ? (void *)s->m16 : s->m, s->v16 ? (void *)s->v16 : s->v};
    float *dst[3] = {ck->master, ck->adam_m, ck->adam_v};
    int64_t big = 0;
    for (int k = 0; k < s->nb; k++)
        if (s->b[k + 1] - s->b[k] > big)
            big = s->b[k + 1] - s->b[k];
    float *tmp = s->grad, *own = NULL;
    if (s->world > 1 && (size_t)big * 4 > (size_t)s->np * s->ges) {
        if (!(own = df_backend_alloc(be, (size_t)big * 4)))
            return df_errf(e, -ENOMEM, "out of memory on %s gathering a checkpoint",
                           df_backend_name(be));
        tmp = own;
    }
    int rc = 0;
    for (int i = 0; i < 3 && !rc; i++) {
        /* 16-bit moments: downloaded, then widened in place */
        size_t es = (i == 1 && s->m16) || (i == 2 && s->v16) ? 2 : 4;
        const int uf = i == 2 && s->vdt == DF_DTYPE_UF16;
        if (s->world == 1) {
            rc = df_backend_download(be, dst[i], src[i], (size_t)s->n * es);
            if (!rc && es == 2)
                widen_inplace(dst[i], s->n, uf);
            continue;
        }
        for (int k = 0; k < s->nb && !rc; k++) {
            int64_t keep = (s->b[k + 1] < s->n ? s->b[k + 1] : s->n) - s->b[k];
            rc = df_comm_all_gather(s->comm, (uint8_t *)src[i] + (size_t)s->soff[k] * es, tmp,
                                    (size_t)s->cnt[k] * es, e);
            if (!rc)
                rc = df_comm_wait(s->comm, e);
            if (!rc && keep > 0)
                rc = df_backend_download(be, dst[i] + s->b[k], tmp, (size_t)keep * es);
            if (!rc && keep > 0 && es == 2)
                widen_inplace(dst[i] + s->b[k], keep, uf);
        }
    }
    df_backend_free(be, own);
    /* the buckets' padding past the parameters stays zero between steps (no
     * row writes it, the reduce-scatter adds zeros there): so it is again
     * after the buffer served as scratch */
    if (!rc && tmp == s->grad && s->world > 1)
        rc = df_backend_zero(be, s->grad, (size_t)s->np * s->ges);
    return rc ? df_errf(e, rc, "copying the optimizer state from %s failed", df_backend_name(be))
              : 0;
}
