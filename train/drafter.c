/* drafter.c - DFlash drafter forward/backward over one row (drafter.h). */
#include "drafter.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "drafter_internal.h"
#include "log.h"

void df_drafter_set_recompute(df_drafter *d, int level)
{
    level = level < 0 ? 0 : level > 2 ? 2 : level;
    if (d->recompute != level) {
        d->recompute = level;
        d->cap_N = d->cap_S = 0; /* the workspace layout changes: carve it again */
    }
}

int df_drafter_set_grad_dtype(df_drafter *d, df_dtype dt)
{
    if (dt != DF_DTYPE_F32 && dt != DF_DTYPE_BF16)
        return -EINVAL;
    if (d->gdt != dt && d->galias)
        d->cap_N = d->cap_S = 0; /* the hosted bytes change: carve again */
    d->gdt = dt;
    return 0;
}

/* Which layer parameter i belongs to, or -1 (fc, the norms outside layers). */
static int param_layer(const df_drafter *d, int i)
{
    for (int l = 0; l < d->c.num_hidden_layers; l++) {
        const layer_idx *I = &d->li[l];
        int ix[] = {I->in_norm, I->wq, I->wk, I->wv, I->wo, I->q_norm, I->k_norm,
                    I->post_norm, I->gate, I->up, I->down};
        for (size_t k = 0; k < sizeof ix / sizeof ix[0]; k++)
            if (ix[k] == i)
                return l;
    }
    return -1;
}

/* The gradient range that may host layer l's activations (l >= 1): the
 * gradients of layer l-1, which its backward writes only after layer l's
 * backward, the last reader of layer l's activations, is done; below layer
 * 1 also fc's and hidden_norm's (written after layer 0's backward). Every
 * other parameter must lie outside it (the final norm's gradient is written
 * first of all). Returns 1 with [lo, hi) in elements, or 0: none. */
static int alias_range(const df_drafter *d, int l, int64_t *lo, int64_t *hi)
{
    const df_params *ps = &d->ps;
    int64_t first[2] = {INT64_MAX, INT64_MAX}; /* of layers l-1 and l */
    for (int i = 0; i < ps->n; i++) {
        int k = param_layer(d, i) - (l - 1);
        if ((k == 0 || k == 1) && ps->p[i].offset < first[k])
            first[k] = ps->p[i].offset;
    }
    *lo = l == 1 ? 0 : first[0];
    *hi = first[1];
    if (*hi <= *lo || first[0] == INT64_MAX || first[1] == INT64_MAX)
        return 0;
    for (int i = 0; i < ps->n; i++) {
        int pl = param_layer(d, i);
        int ok = pl == l - 1 || (l == 1 && (i == d->fc || i == d->hidden_norm));
        const df_param *p = &ps->p[i];
        if (!ok && p->offset < *hi && p->offset + p->numel > *lo)
            return 0;
    }
    return 1;
}

int df_drafter_grad_alias_range(const df_drafter *d, int l, int64_t *lo, int64_t *hi)
{
    if (!d->galias || l < 1 || l >= d->c.num_hidden_layers || d->ahi[l] <= d->alo[l])
        return 0;
    *lo = d->alo[l];
    *hi = d->ahi[l];
    return 1;
}

int df_drafter_set_grad_alias(df_drafter *d, void *grad)
{
    int L = d->c.num_hidden_layers;
    if (grad && !d->alo) {
        d->alo = calloc((size_t)L, sizeof *d->alo);
        d->ahi = calloc((size_t)L, sizeof *d->ahi);
        if (!d->alo || !d->ahi)
            return -ENOMEM;
    }
    if (grad)
        for (int l = 1; l < L; l++)
            if (!alias_range(d, l, &d->alo[l], &d->ahi[l]))
                d->alo[l] = d->ahi[l] = 0;
    if (grad != d->galias)
        d->cap_N = d->cap_S = 0; /* carve again */
    d->galias = grad;
    return 0;
}

df_dtype df_drafter_grad_dtype(const df_drafter *d)
{
    return d->gdt;
}

void df_drafter_set_fwd_hook(df_drafter *d, df_drafter_fwd_hook fn, void *ctx)
{
    d->fhook = fn;
    d->fhook_ctx = ctx;
}

void df_drafter_set_grad_hook(df_drafter *d, df_drafter_grad_hook fn, void *ctx)
{
    d->hook = fn;
    d->hook_ctx = ctx;
}

const df_params *df_drafter_params(const df_drafter *d)
{
    return &d->ps;
}

void df_drafter_close(df_drafter *d)
{
    if (!d)
        return;
    df_backend_free(d->be, d->arena);
    df_backend_free(d->be, d->arena32);
    df_backend_free(d->be, d->feat);
    df_backend_free(d->be, d->feat32);
    drafter_fp8_free(d);
    free(d->act);
    free(d->li);
    free(d->alo);
    free(d->ahi);
    free(d->argmax_host);
    free(d->act_i);
    free(d->inv);
    df_backend_host_free(d->be, d->lab_c);
    df_backend_host_free(d->be, d->wts_c);
    df_params_free(&d->ps);
    free(d);
}

static int idx(df_drafter *d, int layer, const char *suffix, df_err *e)
{
    char n[96];
    if (layer >= 0)
        snprintf(n, sizeof n, "layers.%d.%s", layer, suffix);
    else
        snprintf(n, sizeof n, "%s", suffix);
    int i = df_params_find(&d->ps, n);
    if (i < 0)
        df_errf(e, -EINVAL, "drafter parameter %s missing from the table", n);
    return i;
}

int df_drafter_open(const df_drafter_config *c, df_backend *be, const df_tensor *embed,
                    const df_tensor *head, df_drafter **out, df_err *e)
{
    *out = NULL;
    if (c->block_size < 2 || c->block_size > DF_DRAFTER_MAX_BLOCK)
        return df_errf(e, -EINVAL, "block_size %d: 2..%d supported", c->block_size,
                       DF_DRAFTER_MAX_BLOCK);
    if (embed->ndim != 2 || head->ndim != 2 || embed->shape[1] != c->hidden_size ||
        head->shape[1] != c->hidden_size || embed->shape[0] != c->vocab_size ||
        head->shape[0] != c->vocab_size)
        return df_errf(e, -DF_EMISMATCH,
                       "target embedding/lm_head [%lld x %lld] / [%lld x %lld] do not match the "
                       "drafter (vocab %lld, hidden %d)",
                       (long long)embed->shape[0], (long long)embed->shape[1],
                       (long long)head->shape[0], (long long)head->shape[1],
                       (long long)c->vocab_size, c->hidden_size);
    if (c->mask_token_id < 0 || c->mask_token_id >= c->vocab_size)
        return df_errf(e, -EINVAL, "mask_token_id %lld outside the vocabulary",
                       (long long)c->mask_token_id);
    df_drafter *d = calloc(1, sizeof *d);
    if (!d)
        return df_errf(e, -ENOMEM, "out of memory");
    d->c = *c;
    d->be = be;
    d->adt = df_backend_act_dtype(be);
    d->wdt = d->adt; /* weights: F32 master on the CPU, BF16 copies on CUDA */
    d->aes = df_dtype_size(d->adt);
    d->wes = df_dtype_size(d->wdt);
    d->gdt = DF_DTYPE_F32;
    d->host = df_backend_host_addressable(be);
    d->embed = *embed;
    d->head = *head;
    int rc = df_params_build(c, &d->ps, e);
    if (rc) {
        free(d);
        return rc;
    }
    d->li = calloc((size_t)c->num_hidden_layers, sizeof *d->li);
    if (!d->li) {
        df_drafter_close(d);
        return df_errf(e, -ENOMEM, "out of memory");
    }
    d->fc = idx(d, -1, "fc.weight", e);
    d->hidden_norm = idx(d, -1, "hidden_norm.weight", e);
    d->norm = idx(d, -1, "norm.weight", e);
    int bad = d->fc < 0 || d->hidden_norm < 0 || d->norm < 0;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        layer_idx *L = &d->li[l];
        L->in_norm = idx(d, l, "input_layernorm.weight", e);
        L->wq = idx(d, l, "self_attn.q_proj.weight", e);
        L->wk = idx(d, l, "self_attn.k_proj.weight", e);
        L->wv = idx(d, l, "self_attn.v_proj.weight", e);
        L->wo = idx(d, l, "self_attn.o_proj.weight", e);
        L->q_norm = idx(d, l, "self_attn.q_norm.weight", e);
        L->k_norm = idx(d, l, "self_attn.k_norm.weight", e);
        L->post_norm = idx(d, l, "post_attention_layernorm.weight", e);
        L->gate = idx(d, l, "mlp.gate_proj.weight", e);
        L->up = idx(d, l, "mlp.up_proj.weight", e);
        L->down = idx(d, l, "mlp.down_proj.weight", e);
        L->window = c->layer_types[l] == DF_LAYER_SLIDING ? c->sliding_window : 0;
        bad |= L->in_norm < 0 || L->wq < 0 || L->wk < 0 || L->wv < 0 || L->wo < 0 ||
               L->q_norm < 0 || L->k_norm < 0 || L->post_norm < 0 || L->gate < 0 || L->up < 0 ||
               L->down < 0;
    }
    if (bad) {
        df_drafter_close(d);
        return -EINVAL;
    }
    *out = d;
    return 0;
}

/* A norm's dw, zeroed (on) before its first sum: the step's first row writes the gradients */
static int grad_clear(df_drafter *d, const df_tensor *dw, int on)
{
    return on ? df_backend_zero(d->be, dw->data, (size_t)df_tensor_numel(dw) * df_dtype_size(dw->dtype))
              : 0;
}

#define CK(call)                                                                          \
    do {                                                                                  \
        int rc_ = (call);                                                                 \
        if (rc_)                                                                          \
            return df_errf(e, rc_, "drafter: %s failed (%s)", #call, df_strerror(rc_));   \
    } while (0)

void df_drafter_row_metrics(const df_drafter *d, const df_drafter_row *r, const int32_t *argmax,
                            df_drafter_metrics *m)
{
    int bs = d->c.block_size;
    int64_t j = 0; /* argmax is packed: the next scored position's entry */
    for (int b = 0; b < r->blocks.n_blocks; b++) {
        if (!r->blocks.valid[b]) {
            if (m->block_accepted)
                m->block_accepted[b] = -1;
            for (int k = 0; k < bs; k++)
                j += r->labels[(int64_t)b * bs + k] >= 0 && r->weights[(int64_t)b * bs + k] > 0;
            continue;
        }
        m->blocks++;
        int run = 1, nacc = 0;
        j += r->labels[(int64_t)b * bs] >= 0 && r->weights[(int64_t)b * bs] > 0;
        for (int k = 1; k < bs; k++) {
            int64_t i = (int64_t)b * bs + k;
            int has = r->labels[i] >= 0 && r->weights[i] > 0;
            int ok = has && argmax[j] == r->labels[i];
            j += has;
            if (has) {
                m->counted[k]++;
                m->correct[k] += (uint64_t)ok;
            }
            if (run && ok)
                nacc++;
            else
                run = 0;
        }
        m->accepted += (uint64_t)nacc;
        if (m->block_accepted)
            m->block_accepted[b] = nacc;
    }
}

/* q, kb, kc from their raw projections: per-head RMSNorm, then RoPE (the
 * forward, and the backward's recompute: one code for the same bits). */
static int qk_norm_rope(df_drafter *d, const void *W, const layer_idx *I, layer_act *A,
                        const df_drafter_row *r, int64_t N, int64_t S, df_err *e)
{
    const df_drafter_config *c = &d->c;
    df_backend *be = d->be;
    int64_t D = c->head_dim, nq = c->num_attention_heads, nkv = c->num_key_value_heads;
    float eps = (float)c->rms_norm_eps;
    df_tensor wqn = PW(d, W, I->q_norm), wkn = PW(d, W, I->k_norm);
    df_tensor qr_h = M(A->qraw, N * nq, D), q_h = M(A->q, N * nq, D);
    df_tensor kbr_h = M(A->kbraw, N * nkv, D), kb_h = M(A->kb, N * nkv, D);
    df_tensor kcr_h = M(A->kcraw, S * nkv, D), kc_h = M(A->kc, S * nkv, D);
    df_tensor q = M(A->q, N, nq * D), kb = M(A->kb, N, nkv * D), kc = M(A->kc, S, nkv * D);
    CK(df_op_rmsnorm(be, &qr_h, &wqn, eps, 0, &q_h));
    CK(df_op_rmsnorm(be, &kbr_h, &wkn, eps, 0, &kb_h));
    CK(df_op_rmsnorm(be, &kcr_h, &wkn, eps, 0, &kc_h));
    CK(df_op_rope(be, &q, r->block_pos, (int)nq, (int)D, (int)D, c->rope_theta));
    CK(df_op_rope(be, &kb, r->block_pos, (int)nkv, (int)D, (int)D, c->rope_theta));
    CK(df_op_rope(be, &kc, r->ctx_pos, (int)nkv, (int)D, (int)D, c->rope_theta));
    return 0;
}

int df_drafter_prefetch_row(df_drafter *d, const df_drafter_row *r)
{
    d->pf_feat = NULL;
    df_dtype fdt = r->feat_dtype ? r->feat_dtype : DF_DTYPE_F32;
    if (d->host || !r->pinned || fdt != d->adt || r->S > d->cap_S || !d->feat)
        return 0; /* row_step uploads them as usual */
    size_t nf = (size_t)(r->S * df_drafter_fc_in(&d->c));
    int rc = df_backend_upload_ahead(d->be, d->feat, r->feat, nf * d->aes);
    if (rc)
        return rc;
    d->pf_feat = r->feat;
    d->pf_S = r->S;
    return 1;
}

int df_drafter_row_step(df_drafter *d, const void *W, const df_drafter_row *r, float denom,
                        void *G, df_drafter_metrics *m, df_err *e)
{
    const df_drafter_config *c = &d->c;
    df_backend *be = d->be;
    int bs = c->block_size, L = c->num_hidden_layers;
    int64_t S = r->S, N = (int64_t)r->blocks.n_blocks * bs;
    int64_t H = c->hidden_size, D = c->head_dim, nq = c->num_attention_heads,
            nkv = c->num_key_value_heads, QD = nq * D, KD = nkv * D, F = c->intermediate_size,
            KH = df_drafter_fc_in(c);
    float eps = (float)c->rms_norm_eps, scale = (float)(1.0 / sqrt((double)D));
    if (r->blocks.block_size != bs)
        return df_errf(e, -EINVAL, "row block size %d, drafter %d", r->blocks.block_size, bs);
    if (N == 0 || S == 0)
        return df_errf(e, -EINVAL, "empty row (%lld context tokens, %d blocks)", (long long)S,
                       r->blocks.n_blocks);
    int rc = drafter_reserve(d, N, S, e);
    if (rc)
        return rc;

    /* ---- inputs on the backend ---- */
    df_dtype fdt = r->feat_dtype ? r->feat_dtype : DF_DTYPE_F32;
    const void *fsrc = r->feat;
    const int32_t *labels = r->labels;
    const float *wts = r->weights;
    if (!d->host) { /* upload: features (cast to bf16 there), labels, weights */
        size_t nf = (size_t)(S * KH);
        /* pinned inputs: enqueued without waiting for the stream */
        int (*up)(df_backend *, void *, const void *, size_t) =
            r->pinned ? df_backend_upload_async : df_backend_upload;
        /* a prefetch (df_drafter_prefetch_row) is joined in any case: feat is
         * neither read nor written again before its copy is done */
        int hit = d->pf_feat && d->pf_feat == r->feat && d->pf_S == S && fdt == d->adt;
        if (d->pf_feat)
            CK(df_backend_upload_join(be));
        if (hit) {
            /* the features are there */
        } else if (fdt == d->adt) {
            CK(up(be, d->feat, r->feat, nf * d->aes));
        } else {
            if (!d->feat32 && !(d->feat32 = df_backend_alloc(be, (size_t)(d->cap_S * KH) * 4)))
                return df_errf(e, -ENOMEM, "out of memory on %s staging F32 features",
                               df_backend_name(be));
            CK(up(be, d->feat32, r->feat, nf * df_dtype_size(fdt)));
            CK(df_backend_cast(be, d->feat, d->adt, d->feat32, fdt, (int64_t)nf));
        }
        CK(up(be, d->labels, r->labels, (size_t)N * sizeof(int32_t)));
        CK(up(be, d->wts, r->weights, (size_t)N * sizeof(float)));
        fsrc = d->feat;
        fdt = d->adt;
        labels = d->labels;
        wts = d->wts;
    } else if (fdt != d->adt) {
        return df_errf(e, -EINVAL, "row features are %s; the %s backend computes in %s",
                       df_dtype_name(fdt), df_backend_name(be), df_dtype_name(d->adt));
    }

    d->pf_feat = NULL;
    /* FP8 in steps with gradients only: a forward-only row (evaluation)
     * computes what serving the BF16 export computes */
    d->q8 = d->fp8 && G;

    /* ---- forward ---- */
    df_tensor feat = df_tensor_2d((void *)fsrc, fdt, S, KH);
    df_tensor craw = M(d->craw, S, H), cn = M(d->cn, S, H);
    df_tensor wfc = PW(d, W, d->fc), whn = PW(d, W, d->hidden_norm);
    if (d->fhook)
        CK(d->fhook(d->fhook_ctx, -1));
    CK(drafter_mm(d, &feat, &wfc, &craw, 0));
    CK(df_op_rmsnorm(be, &craw, &whn, eps, 0, &cn));
    df_tensor x = M(d->act[0].xin, N, H);
    CK(df_op_embed(be, &d->embed, r->block_ids, N, &x));
    for (int l = 0; l < L; l++) {
        const layer_idx *I = &d->li[l];
        layer_act *A = &d->act[l];
        if (d->fhook)
            CK(d->fhook(d->fhook_ctx, l));
        df_tensor xin = M(A->xin, N, H), a = M(A->a, N, H), xmid = M(A->xmid, N, H);
        df_tensor qraw = M(A->qraw, N, QD), q = M(A->q, N, QD), o = M(A->o, N, QD);
        df_tensor kbraw = M(A->kbraw, N, KD), kb = M(A->kb, N, KD), vb = M(A->vb, N, KD);
        df_tensor kcraw = M(A->kcraw, S, KD), kc = M(A->kc, S, KD), vc = M(A->vc, S, KD);
        df_tensor lse = df_tensor_2d(A->lse, DF_DTYPE_F32, N, nq);
        df_tensor win = PW(d, W, I->in_norm), wq = PW(d, W, I->wq), wk = PW(d, W, I->wk),
                  wv = PW(d, W, I->wv), wo = PW(d, W, I->wo);
        /* (FP8: a's codes once for q, k and v, where the norm makes them; read by nothing else
         * where the backward recomputes it. cn's rounding once for k and v) */
        const unsigned fwd_only = d->recompute ? DF_FP8_ONLY_CODES : 0;
        CK(drafter_rmsnorm(d, &xin, &win, eps, &a, 3, DF_FP8_X_FWD | fwd_only));
        CK(drafter_mm(d, &a, &wq, &qraw, DF_FP8_HOLD_X | DF_FP8_MADE));
        CK(drafter_mm(d, &a, &wk, &kbraw, DF_FP8_SAME_X | DF_FP8_MADE));
        CK(drafter_mm(d, &a, &wv, &vb, DF_FP8_SAME_X | DF_FP8_MADE));
        CK(drafter_mm(d, &cn, &wk, &kcraw, DF_FP8_HOLD_X));
        CK(drafter_mm(d, &cn, &wv, &vc, DF_FP8_SAME_X));
        if ((rc = qk_norm_rope(d, W, I, A, r, N, S, e)))
            return rc; /* its message names the op */
        df_dflash_blocks blk = r->blocks;
        blk.window = I->window;
        CK(df_op_dflash_attn(be, &q, &kc, &vc, &kb, &vb, &blk, (int)nq, (int)nkv, (int)D, scale,
                             &o, &lse));
        /* xmid = xin + o Wo^T */
        CK(df_backend_copy(be, A->xmid, A->xin, (size_t)(N * H) * d->aes));
        CK(drafter_mm(d, &o, &wo, &xmid, 1));
        df_tensor b = M(A->b, N, H), g = M(A->g, N, F), u = M(A->u, N, F), mm = M(A->m, N, F);
        df_tensor wpn = PW(d, W, I->post_norm), wg = PW(d, W, I->gate), wu = PW(d, W, I->up),
                  wd = PW(d, W, I->down);
        CK(drafter_rmsnorm(d, &xmid, &wpn, eps, &b, 2, DF_FP8_X_FWD | fwd_only));
        CK(drafter_mm(d, &b, &wg, &g, DF_FP8_HOLD_X | DF_FP8_MADE));
        CK(drafter_mm(d, &b, &wu, &u, DF_FP8_SAME_X | DF_FP8_MADE));
        /* with FP8, also Wd's x codes; m itself is read again only without recompute */
        CK(drafter_swiglu(d, &g, &u, &mm, DF_FP8_X_FWD | (d->recompute ? DF_FP8_ONLY_CODES : 0)));
        /* the layer output: xmid + m Wd^T, into the next layer's xin (or xfin) */
        void *next = l + 1 < L ? d->act[l + 1].xin : d->xfin;
        CK(df_backend_copy(be, next, A->xmid, (size_t)(N * H) * d->aes));
        df_tensor xo = M(next, N, H);
        CK(drafter_mm(d, &mm, &wd, &xo, DF_FP8_ACCUMULATE | DF_FP8_MADE));
    }
    df_tensor xfin = M(d->xfin, N, H), h = M(d->h, N, H), wn = PW(d, W, d->norm);
    if (d->fhook)
        CK(d->fhook(d->fhook_ctx, L));
    CK(df_op_rmsnorm(be, &xfin, &wn, eps, 0, &h));
    df_tensor dh = M(d->dh, N, H);
    double loss = 0;
    int32_t *am_host = r->argmax_out ? r->argmax_out : d->argmax_host;
    /* The LM head (the step's largest GEMMs) over the scored positions only:
     * a block's anchor position and invalid blocks have no loss. Their rows
     * are gathered (into da, free here), their dh (into dx, free until the
     * norm's backward) is spread back by a gather from [dh_c ; 0]. */
    int64_t na = 0;
    for (int64_t i = 0; i < N; i++) {
        int a = r->labels[i] >= 0 && r->weights[i] > 0;
        d->inv[i] = a ? (uint32_t)na : 0xffffffffu;
        if (a) {
            d->act_i[na] = (uint32_t)i;
            d->lab_c[na] = r->labels[i];
            d->wts_c[na] = r->weights[i];
            na++;
        }
    }
    for (int64_t i = 0; i < N; i++)
        if (d->inv[i] == 0xffffffffu)
            d->inv[i] = (uint32_t)na; /* the zero row */
    int32_t *am_dev = d->host ? am_host : d->argmax;
    /* the LM head's chunk buffers in the arena's front, dead here (carve) */
    size_t lend = (size_t)d->lend_n * d->aes;
    /* FP8: h rounded in place (nothing reads it after the head), the head's
     * rounded copy (or the op rounds it: no copy), the softmax gradient rounded */
    const int q8_copy = d->q8 && d->head8.data;
    const df_tensor *head = q8_copy ? &d->head8 : &d->head;
    unsigned ce_flags = !d->q8   ? 0
                        : q8_copy ? DF_CE_FP8_GRAD | DF_CE_FP8_HEAD_FROZEN
                                  : DF_CE_FP8_GRAD | DF_CE_FP8_HEAD_FROZEN | DF_CE_FP8_ROUND_HEAD;
    if (d->bf16_logits && G)
        ce_flags |= DF_CE_BF16_LOGITS;
    else if (d->f16_logits && G)
        ce_flags |= DF_CE_F16_LOGITS;
    if (d->q8 && d->fp8_ce_onepass)
        ce_flags |= DF_CE_FP8_ONEPASS;
    if (na == N) {
        if (d->q8)
            CK(df_op_fp8_qdq(be, &h, &h, 1, 128));
        df_backend_lend_scratch(be, d->arena, lend);
        rc = df_op_lmhead_ce(be, &h, head, labels, wts, denom, &loss, G ? &dh : NULL, am_dev,
                             NULL, ce_flags);
        df_backend_lend_scratch(be, NULL, 0);
        CK(rc);
    } else if (na > 0) {
        df_tensor hc = M(d->da, na, H), dhc = M(d->dx, na, H);
        CK(df_op_embed(be, &h, d->act_i, na, &hc));
        const int32_t *lab_c = d->lab_c;
        const float *wts_c = d->wts_c;
        if (!d->host) { /* packed into the workspace (labels, weights are free after this) */
            CK(df_backend_upload_async(be, d->labels, d->lab_c, (size_t)na * sizeof(int32_t)));
            CK(df_backend_upload_async(be, d->wts, d->wts_c, (size_t)na * sizeof(float)));
            lab_c = d->labels;
            wts_c = d->wts;
        }
        if (d->q8)
            CK(df_op_fp8_qdq(be, &hc, &hc, 1, 128));
        df_backend_lend_scratch(be, d->arena, lend);
        rc = df_op_lmhead_ce(be, &hc, head, lab_c, wts_c, denom, &loss, G ? &dhc : NULL,
                             am_dev, NULL, ce_flags);
        df_backend_lend_scratch(be, NULL, 0);
        CK(rc);
        if (G) {
            df_tensor dhz = M(d->dx, na + 1, H);
            CK(df_backend_zero(be, (uint8_t *)d->dx + (size_t)(na * H) * d->aes,
                               (size_t)H * d->aes));
            CK(df_op_embed(be, &dhz, d->inv, N, &dh));
        }
    } else if (G) {
        CK(df_backend_zero(be, d->dh, (size_t)(N * H) * d->aes));
    }
    if (!d->host && r->argmax_out && na > 0) /* by the caller's sync; the counts are the caller's */
        CK(df_backend_download_async(be, r->argmax_out, d->argmax, (size_t)na * sizeof(int32_t)));
    if (m) {
        if (!d->host && !r->argmax_out && na > 0)
            CK(df_backend_download(be, d->argmax_host, d->argmax, (size_t)na * sizeof(int32_t)));
        m->loss_sum += loss;
        for (int64_t i = 0; i < N; i++)
            if (r->labels[i] >= 0)
                m->weight_sum += r->weights[i];
        if (!r->argmax_out)
            df_drafter_row_metrics(d, r, d->argmax_host, m);
    }
    if (!G)
        return 0;

    /* ---- backward ---- */
    if (d->galias && G != d->galias)
        return df_errf(e, -EINVAL, "drafter: the gradients go to another array than the one "
                                   "hosting activations (df_drafter_set_grad_alias)");
    /* the step's first row writes the gradients (r->grad_write): each weight's first GEMM
     * without accumulation, each norm's dw cleared before its first sum; the rest add */
    const int gw = r->grad_write != 0;
    const unsigned acc1 = gw ? 0 : DF_FP8_ACCUMULATE;
    df_tensor dx = M(d->dx, N, H), gwn = PG(d, G, d->norm);
    CK(grad_clear(d, &gwn, gw));
    CK(df_op_rmsnorm_bwd(be, &xfin, &wn, eps, 0, &dh, &dx, 0, &gwn));
    df_tensor dcn = M(d->dcn, S, H);
    CK(df_backend_zero(be, d->dcn, (size_t)(S * H) * d->aes));
    for (int l = L - 1; l >= 0; l--) {
        const layer_idx *I = &d->li[l];
        layer_act *A = &d->act[l];
        df_tensor xin = M(A->xin, N, H), a = M(A->a, N, H), xmid = M(A->xmid, N, H);
        df_tensor q = M(A->q, N, QD), o = M(A->o, N, QD);
        df_tensor kb = M(A->kb, N, KD), vb = M(A->vb, N, KD);
        df_tensor kc = M(A->kc, S, KD), vc = M(A->vc, S, KD);
        df_tensor lse = df_tensor_2d(A->lse, DF_DTYPE_F32, N, nq);
        df_tensor b = M(A->b, N, H), g = M(A->g, N, F), u = M(A->u, N, F), mm = M(A->m, N, F);
        /* layer l+1's activations, dead now, lay in layer l's gradients: clear them for the
         * sums (written, not summed, under grad_write) */
        if (!gw && d->galias && l + 1 < L && d->ahi[l + 1] > d->alo[l + 1]) {
            size_t ges = df_dtype_size(d->gdt);
            CK(df_backend_zero(be, (uint8_t *)G + (size_t)d->alo[l + 1] * ges,
                               (size_t)(d->ahi[l + 1] - d->alo[l + 1]) * ges));
        }
        if (d->recompute) { /* the forward's ops again, on the layer's saved inputs: same bits
                             * (a's norm where its weight gradients read it, below) */
            df_tensor wpn = PW(d, W, I->post_norm);
            if ((rc = qk_norm_rope(d, W, I, A, r, N, S, e)))
                return rc; /* its message names the op */
            /* (FP8: b's codes for the gate / up weight gradients, and the forward's again) */
            const unsigned bx = d->recompute > 1 ? DF_FP8_X_FWD : 0;
            CK(drafter_rmsnorm(d, &xmid, &wpn, eps, &b, 2, DF_FP8_X_BWD_W | bx | DF_FP8_ONLY_CODES));
            if (d->recompute > 1) { /* the MLP's input projections again */
                df_tensor wg = PW(d, W, I->gate), wu = PW(d, W, I->up);
                CK(drafter_mm(d, &b, &wg, &g, DF_FP8_HOLD_X | DF_FP8_MADE));
                CK(drafter_mm(d, &b, &wu, &u, DF_FP8_SAME_X | DF_FP8_MADE));
            }
            /* Wd's gradient's x codes, which are all that reads m */
            CK(drafter_swiglu(d, &g, &u, &mm, DF_FP8_X_BWD_W | DF_FP8_ONLY_CODES));
        }
        /* MLP: x_out = xmid + m Wd^T */
        /* In place, to need no [N, F] scratch: dm overwrites m once Wd's
         * gradient has read it, dg/du overwrite g/u (swiglu_bwd allows it;
         * the forward of the next step writes all of them again). */
        df_tensor dm = mm, dg = g, du = u, db = M(d->db, N, H);
        df_tensor wd = PW(d, W, I->down), gwd = PG(d, G, I->down);
        df_tensor wg = PW(d, W, I->gate), gwg = PG(d, G, I->gate);
        df_tensor wu = PW(d, W, I->up), gwu = PG(d, G, I->up);
        df_tensor wpn = PW(d, W, I->post_norm), gwpn = PG(d, G, I->post_norm);
        /* (FP8: dx rounded once for both of Wd's GEMMs; m's codes from SwiGLU) */
        CK(drafter_dy_codes(d, &dx));
        CK(drafter_mm_bw(d, &dx, &mm, &gwd, acc1 | DF_FP8_MADE));
        CK(drafter_mm_bx(d, &dx, &wd, &dm, DF_FP8_MADE));
        /* with FP8, dg and du are only the dy of the four GEMMs below: their codes may be
         * written where they are computed (DF_FP8_MADE) */
        CK(drafter_swiglu_bwd(d, &g, &u, &dm, &dg, &du));
        CK(drafter_mm_bx(d, &dg, &wg, &db, DF_FP8_MADE));
        CK(drafter_mm_bx(d, &du, &wu, &db, DF_FP8_ACCUMULATE | DF_FP8_MADE));
        CK(drafter_mm_bw(d, &dg, &b, &gwg, acc1 | DF_FP8_HOLD_X | DF_FP8_MADE));
        CK(drafter_mm_bw(d, &du, &b, &gwu, acc1 | DF_FP8_SAME_X | DF_FP8_MADE));
        /* dx now holds d(xmid) through the residual; add the norm's path */
        CK(grad_clear(d, &gwpn, gw));
        CK(df_op_rmsnorm_bwd(be, &xmid, &wpn, eps, 0, &db, &dx, 1, &gwpn));
        /* attention: xmid = xin + o Wo^T */
        df_tensor dout = M(d->dout, N, QD), dq = M(d->dq, N, QD);
        df_tensor dkb = M(d->dkb, N, KD), dvb = M(d->dvb, N, KD);
        df_tensor dkc = M(d->dkc, S, KD), dvc = M(d->dvc, S, KD);
        df_tensor wo = PW(d, W, I->wo), gwo = PG(d, G, I->wo);
        CK(drafter_dy_codes(d, &dx));
        CK(drafter_mm_bx(d, &dx, &wo, &dout, DF_FP8_MADE));
        CK(drafter_mm_bw(d, &dx, &o, &gwo, acc1 | DF_FP8_MADE));
        df_dflash_blocks blk = r->blocks;
        blk.window = I->window;
        size_t dead_bytes = 0;
        void *dead = drafter_mlp_dead(d, A, N * F, &dead_bytes);
        df_backend_lend_scratch(be, dead, dead_bytes);
        rc = df_op_dflash_attn_bwd(be, &q, &kc, &vc, &kb, &vb, &blk, (int)nq, (int)nkv, (int)D,
                                   scale, &o, &lse, &dout, &dq, &dkc, &dvc, &dkb, &dvb);
        df_backend_lend_scratch(be, NULL, 0);
        CK(rc);
        CK(df_op_rope_bwd(be, &dq, r->block_pos, (int)nq, (int)D, (int)D, c->rope_theta));
        CK(df_op_rope_bwd(be, &dkb, r->block_pos, (int)nkv, (int)D, (int)D, c->rope_theta));
        CK(df_op_rope_bwd(be, &dkc, r->ctx_pos, (int)nkv, (int)D, (int)D, c->rope_theta));
        df_tensor wqn = PW(d, W, I->q_norm), gwqn = PG(d, G, I->q_norm);
        df_tensor wkn = PW(d, W, I->k_norm), gwkn = PG(d, G, I->k_norm);
        /* q/k norms, per head ([rows*heads, D] views): the gradients of the raw
         * projections go to other buffers (dout is free again after the
         * attention backward). */
        df_tensor qr_h = M(A->qraw, N * nq, D), dq_h = M(d->dq, N * nq, D), dqr_h = M(d->dout, N * nq, D);
        df_tensor kbr_h = M(A->kbraw, N * nkv, D), dkb_h = M(d->dkb, N * nkv, D),
                  dkbr_h = M(d->dkb2, N * nkv, D);
        df_tensor kcr_h = M(A->kcraw, S * nkv, D), dkc_h = M(d->dkc, S * nkv, D),
                  dkcr_h = M(d->dkc2, S * nkv, D);
        CK(grad_clear(d, &gwqn, gw));
        CK(grad_clear(d, &gwkn, gw));
        CK(df_op_rmsnorm_bwd(be, &qr_h, &wqn, eps, 0, &dq_h, &dqr_h, 0, &gwqn));
        CK(df_op_rmsnorm_bwd(be, &kbr_h, &wkn, eps, 0, &dkb_h, &dkbr_h, 0, &gwkn));
        CK(df_op_rmsnorm_bwd(be, &kcr_h, &wkn, eps, 0, &dkc_h, &dkcr_h, 0, &gwkn));
        df_tensor dqr = M(d->dout, N, QD), dkbr = M(d->dkb2, N, KD), dkcr = M(d->dkc2, S, KD);
        df_tensor wq = PW(d, W, I->wq), gwq = PG(d, G, I->wq);
        df_tensor wk = PW(d, W, I->wk), gwk = PG(d, G, I->wk);
        df_tensor wv = PW(d, W, I->wv), gwv = PG(d, G, I->wv);
        df_tensor da = M(d->da, N, H);
        if (d->recompute) { /* a again, read by the three weight gradients alone (FP8: their x codes) */
            df_tensor win = PW(d, W, I->in_norm);
            CK(drafter_rmsnorm(d, &xin, &win, eps, &a, 3, DF_FP8_X_BWD_W | DF_FP8_ONLY_CODES));
        }
        /* each projection's two GEMMs together (FP8: its dy rounded once for both); da sums
         * in the order q, k, v */
        const unsigned acc = DF_FP8_ACCUMULATE, md = DF_FP8_MADE;
        CK(drafter_dy_codes(d, &dqr));
        CK(drafter_mm_bx(d, &dqr, &wq, &da, md));
        CK(drafter_mm_bw(d, &dqr, &a, &gwq, acc1 | DF_FP8_HOLD_X | md));
        CK(drafter_dy_codes(d, &dkbr));
        CK(drafter_mm_bx(d, &dkbr, &wk, &da, acc | md));
        CK(drafter_mm_bw(d, &dkbr, &a, &gwk, acc1 | DF_FP8_SAME_X | md));
        CK(drafter_dy_codes(d, &dvb));
        CK(drafter_mm_bx(d, &dvb, &wv, &da, acc | md));
        CK(drafter_mm_bw(d, &dvb, &a, &gwv, acc1 | DF_FP8_SAME_X | md));
        CK(drafter_dy_codes(d, &dkcr));
        CK(drafter_mm_bx(d, &dkcr, &wk, &dcn, acc | md));
        CK(drafter_mm_bw(d, &dkcr, &cn, &gwk, acc | DF_FP8_HOLD_X | md));
        CK(drafter_dy_codes(d, &dvc));
        CK(drafter_mm_bx(d, &dvc, &wv, &dcn, acc | md));
        CK(drafter_mm_bw(d, &dvc, &cn, &gwv, acc | DF_FP8_SAME_X | md));
        df_tensor win = PW(d, W, I->in_norm), gwin = PG(d, G, I->in_norm);
        /* dx: d(xmid) flows to d(xin) through the residual, plus the norm's path */
        CK(grad_clear(d, &gwin, gw));
        CK(df_op_rmsnorm_bwd(be, &xin, &win, eps, 0, &da, &dx, 1, &gwin));
        if (d->hook)
            CK(d->hook(d->hook_ctx, l));
    }
    /* context: C = rmsnorm(F fc^T) */
    df_tensor dc = M(d->dc, S, H), gwhn = PG(d, G, d->hidden_norm), gwfc = PG(d, G, d->fc);
    CK(grad_clear(d, &gwhn, gw));
    CK(df_op_rmsnorm_bwd(be, &craw, &whn, eps, 0, &dcn, &dc, 0, &gwhn));
    CK(drafter_mm_bw(d, &dc, &feat, &gwfc, acc1));
    if (d->hook)
        CK(d->hook(d->hook_ctx, -1));
    return 0;
}
