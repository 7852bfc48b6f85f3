/* drafter.c - DFlash drafter forward/backward over one row (drafter.h). */
#include "drafter.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Parameter indices of one layer, resolved once. */
typedef struct layer_idx {
    int in_norm, wq, wk, wv, wo, q_norm, k_norm, post_norm, gate, up, down;
    int window;
} layer_idx;

/* Activations one layer saves for its backward pass. */
typedef struct layer_act {
    float *xin, *a, *qraw, *q, *kbraw, *kb, *vb, *kcraw, *kc, *vc, *o, *lse, *xmid, *b, *g, *u,
        *m;
} layer_act;

struct df_drafter {
    df_drafter_config c;
    df_backend *be;
    df_tensor embed, head;
    df_params ps;
    int fc, hidden_norm, norm;
    layer_idx *li;
    /* workspace sized for cap_N queries and cap_S context tokens */
    int64_t cap_N, cap_S;
    float *arena;
    layer_act *act;
    float *craw, *cn, *xfin, *h;
    /* backward scratch */
    float *dx, *dh, *da, *db, *dq, *dkb, *dvb, *dkc, *dvc, *dout, *dm, *dg, *du, *dcn, *dc;
    float *dkb2, *dkc2; /* the norms' input gradients (no in-place backward) */
    int32_t *argmax;
};

const df_params *df_drafter_params(const df_drafter *d)
{
    return &d->ps;
}

void df_drafter_close(df_drafter *d)
{
    if (!d)
        return;
    free(d->arena);
    free(d->act);
    free(d->li);
    free(d->argmax);
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

/* Carves the workspace for N queries and S context tokens. */
static int reserve(df_drafter *d, int64_t N, int64_t S, df_err *e)
{
    if (N <= d->cap_N && S <= d->cap_S)
        return 0;
    if (N < d->cap_N)
        N = d->cap_N;
    if (S < d->cap_S)
        S = d->cap_S;
    const df_drafter_config *c = &d->c;
    int64_t H = c->hidden_size, QD = (int64_t)c->num_attention_heads * c->head_dim,
            KD = (int64_t)c->num_key_value_heads * c->head_dim, F = c->intermediate_size,
            nq = c->num_attention_heads;
    int L = c->num_hidden_layers;
    int64_t per_layer = 4 * N * H + 3 * N * QD + 3 * N * KD + 3 * S * KD + N * nq + 3 * N * F;
    int64_t shared = 2 * S * H + 2 * N * H;
    int64_t scratch = 4 * N * H + 2 * N * QD + 3 * N * KD + 3 * S * KD + 3 * N * F + 2 * S * H;
    int64_t total = (int64_t)L * per_layer + shared + scratch;
    free(d->arena);
    free(d->act);
    free(d->argmax);
    d->arena = malloc((size_t)total * sizeof(float));
    d->act = calloc((size_t)L, sizeof *d->act);
    d->argmax = malloc((size_t)N * sizeof *d->argmax);
    if (!d->arena || !d->act || !d->argmax) {
        d->cap_N = d->cap_S = 0;
        return df_errf(e, -ENOMEM, "out of memory for a row of %lld queries, %lld context tokens",
                       (long long)N, (long long)S);
    }
    float *p = d->arena;
#define TAKE(ptr, n) \
    do {             \
        ptr = p;     \
        p += (n);    \
    } while (0)
    for (int l = 0; l < L; l++) {
        layer_act *A = &d->act[l];
        TAKE(A->xin, N * H);
        TAKE(A->a, N * H);
        TAKE(A->xmid, N * H);
        TAKE(A->b, N * H);
        TAKE(A->qraw, N * QD);
        TAKE(A->q, N * QD);
        TAKE(A->o, N * QD);
        TAKE(A->kbraw, N * KD);
        TAKE(A->kb, N * KD);
        TAKE(A->vb, N * KD);
        TAKE(A->kcraw, S * KD);
        TAKE(A->kc, S * KD);
        TAKE(A->vc, S * KD);
        TAKE(A->lse, N * nq);
        TAKE(A->g, N * F);
        TAKE(A->u, N * F);
        TAKE(A->m, N * F);
    }
    TAKE(d->craw, S * H);
    TAKE(d->cn, S * H);
    TAKE(d->xfin, N * H);
    TAKE(d->h, N * H);
    TAKE(d->dx, N * H);
    TAKE(d->dh, N * H);
    TAKE(d->da, N * H);
    TAKE(d->db, N * H);
    TAKE(d->dq, N * QD);
    TAKE(d->dout, N * QD);
    TAKE(d->dkb, N * KD);
    TAKE(d->dvb, N * KD);
    TAKE(d->dkc, S * KD);
    TAKE(d->dvc, S * KD);
    TAKE(d->dm, N * F);
    TAKE(d->dg, N * F);
    TAKE(d->du, N * F);
    TAKE(d->dcn, S * H);
    TAKE(d->dc, S * H);
    TAKE(d->dkb2, N * KD);
    TAKE(d->dkc2, S * KD);
#undef TAKE
    d->cap_N = N;
    d->cap_S = S;
    return 0;
}

static df_tensor M(float *p, int64_t r, int64_t c)
{
    return df_tensor_2d(p, DF_DTYPE_F32, r, c);
}

/* A parameter (or its gradient) as an F32 tensor of its own shape. */
static df_tensor P(const df_drafter *d, const float *flat, int i)
{
    const df_param *p = &d->ps.p[i];
    float *x = (float *)flat + p->offset;
    return p->ndim == 1 ? df_tensor_1d(x, DF_DTYPE_F32, p->shape[0])
                        : df_tensor_2d(x, DF_DTYPE_F32, p->shape[0], p->shape[1]);
}

#define CK(call)                                                                          \
    do {                                                                                  \
        int rc_ = (call);                                                                 \
        if (rc_)                                                                          \
            return df_errf(e, rc_, "drafter: %s failed (%s)", #call, df_strerror(rc_));   \
    } while (0)

static void metrics_add(const df_drafter *d, const df_drafter_row *r, df_drafter_metrics *m)
{
    int bs = d->c.block_size;
    for (int b = 0; b < r->blocks.n_blocks; b++) {
        if (!r->blocks.valid[b])
            continue;
        m->blocks++;
        int run = 1;
        for (int k = 1; k < bs; k++) {
            int64_t i = (int64_t)b * bs + k;
            int has = r->labels[i] >= 0 && r->weights[i] > 0;
            int ok = has && d->argmax[i] == r->labels[i];
            if (has) {
                m->counted[k]++;
                m->correct[k] += (uint64_t)ok;
            }
            if (run && ok)
                m->accepted++;
            else
                run = 0;
        }
    }
}

int df_drafter_row_step(df_drafter *d, const float *W, const df_drafter_row *r, float denom,
                        float *G, df_drafter_metrics *m, df_err *e)
{
    const df_drafter_config *c = &d->c;
    df_backend *be = d->be;
    int bs = c->block_size, L = c->num_hidden_layers;
    int64_t S = r->S, N = (int64_t)r->blocks.n_blocks * bs;
    int64_t H = c->hidden_size, D = c->head_dim, nq = c->num_attention_heads,
            nkv = c->num_key_value_heads, QD = nq * D, KD = nkv * D, F = c->intermediate_size,
            KH = (int64_t)c->num_target_features * H;
    float eps = (float)c->rms_norm_eps, scale = (float)(1.0 / sqrt((double)D));
    if (r->blocks.block_size != bs)
        return df_errf(e, -EINVAL, "row block size %d, drafter %d", r->blocks.block_size, bs);
    if (N == 0 || S == 0)
        return df_errf(e, -EINVAL, "empty row (%lld context tokens, %d blocks)", (long long)S,
                       r->blocks.n_blocks);
    int rc = reserve(d, N, S, e);
    if (rc)
        return rc;

    /* ---- forward ---- */
    df_tensor feat = df_tensor_2d((void *)r->feat, DF_DTYPE_F32, S, KH);
    df_tensor craw = M(d->craw, S, H), cn = M(d->cn, S, H);
    df_tensor wfc = P(d, W, d->fc), whn = P(d, W, d->hidden_norm);
    CK(df_op_matmul(be, &feat, &wfc, &craw, 0));
    CK(df_op_rmsnorm(be, &craw, &whn, eps, 0, &cn));
    df_tensor x = M(d->act[0].xin, N, H);
    CK(df_op_embed(be, &d->embed, r->block_ids, N, &x));
    for (int l = 0; l < L; l++) {
        const layer_idx *I = &d->li[l];
        layer_act *A = &d->act[l];
        df_tensor xin = M(A->xin, N, H), a = M(A->a, N, H), xmid = M(A->xmid, N, H);
        df_tensor qraw = M(A->qraw, N, QD), q = M(A->q, N, QD), o = M(A->o, N, QD);
        df_tensor kbraw = M(A->kbraw, N, KD), kb = M(A->kb, N, KD), vb = M(A->vb, N, KD);
        df_tensor kcraw = M(A->kcraw, S, KD), kc = M(A->kc, S, KD), vc = M(A->vc, S, KD);
        df_tensor lse = M(A->lse, N, nq);
        df_tensor win = P(d, W, I->in_norm), wq = P(d, W, I->wq), wk = P(d, W, I->wk),
                  wv = P(d, W, I->wv), wo = P(d, W, I->wo), wqn = P(d, W, I->q_norm),
                  wkn = P(d, W, I->k_norm);
        CK(df_op_rmsnorm(be, &xin, &win, eps, 0, &a));
        CK(df_op_matmul(be, &a, &wq, &qraw, 0));
        CK(df_op_matmul(be, &a, &wk, &kbraw, 0));
        CK(df_op_matmul(be, &a, &wv, &vb, 0));
        CK(df_op_matmul(be, &cn, &wk, &kcraw, 0));
        CK(df_op_matmul(be, &cn, &wv, &vc, 0));
        df_tensor qr_h = M(A->qraw, N * nq, D), q_h = M(A->q, N * nq, D);
        df_tensor kbr_h = M(A->kbraw, N * nkv, D), kb_h = M(A->kb, N * nkv, D);
        df_tensor kcr_h = M(A->kcraw, S * nkv, D), kc_h = M(A->kc, S * nkv, D);
        CK(df_op_rmsnorm(be, &qr_h, &wqn, eps, 0, &q_h));
        CK(df_op_rmsnorm(be, &kbr_h, &wkn, eps, 0, &kb_h));
        CK(df_op_rmsnorm(be, &kcr_h, &wkn, eps, 0, &kc_h));
        CK(df_op_rope(be, &q, r->block_pos, (int)nq, (int)D, (int)D, c->rope_theta));
        CK(df_op_rope(be, &kb, r->block_pos, (int)nkv, (int)D, (int)D, c->rope_theta));
        CK(df_op_rope(be, &kc, r->ctx_pos, (int)nkv, (int)D, (int)D, c->rope_theta));
        df_dflash_blocks blk = r->blocks;
        blk.window = I->window;
        CK(df_op_dflash_attn(be, &q, &kc, &vc, &kb, &vb, &blk, (int)nq, (int)nkv, (int)D, scale,
                             &o, &lse));
        /* xmid = xin + o Wo^T */
        memcpy(A->xmid, A->xin, (size_t)(N * H) * sizeof(float));
        CK(df_op_matmul(be, &o, &wo, &xmid, 1));
        df_tensor b = M(A->b, N, H), g = M(A->g, N, F), u = M(A->u, N, F), mm = M(A->m, N, F);
        df_tensor wpn = P(d, W, I->post_norm), wg = P(d, W, I->gate), wu = P(d, W, I->up),
                  wd = P(d, W, I->down);
        CK(df_op_rmsnorm(be, &xmid, &wpn, eps, 0, &b));
        CK(df_op_matmul(be, &b, &wg, &g, 0));
        CK(df_op_matmul(be, &b, &wu, &u, 0));
        CK(df_op_swiglu(be, &g, &u, &mm));
        /* the layer output: xmid + m Wd^T, into the next layer's xin (or xfin) */
        float *next = l + 1 < L ? d->act[l + 1].xin : d->xfin;
        memcpy(next, A->xmid, (size_t)(N * H) * sizeof(float));
        df_tensor xo = M(next, N, H);
        CK(df_op_matmul(be, &mm, &wd, &xo, 1));
    }
    df_tensor xfin = M(d->xfin, N, H), h = M(d->h, N, H), wn = P(d, W, d->norm);
    CK(df_op_rmsnorm(be, &xfin, &wn, eps, 0, &h));
    df_tensor dh = M(d->dh, N, H);
    double loss = 0;
    CK(df_op_lmhead_ce(be, &h, &d->head, r->labels, r->weights, denom, &loss, G ? &dh : NULL,
                       d->argmax, NULL));
    if (m) {
        m->loss_sum += loss;
        for (int64_t i = 0; i < N; i++)
            if (r->labels[i] >= 0)
                m->weight_sum += r->weights[i];
        metrics_add(d, r, m);
    }
    if (!G)
        return 0;

    /* ---- backward ---- */
    df_tensor dx = M(d->dx, N, H), gwn = P(d, G, d->norm);
    CK(df_op_rmsnorm_bwd(be, &xfin, &wn, eps, 0, &dh, &dx, 0, &gwn));
    df_tensor dcn = M(d->dcn, S, H);
    memset(d->dcn, 0, (size_t)(S * H) * sizeof(float));
    for (int l = L - 1; l >= 0; l--) {
        const layer_idx *I = &d->li[l];
        layer_act *A = &d->act[l];
        df_tensor xin = M(A->xin, N, H), a = M(A->a, N, H), xmid = M(A->xmid, N, H);
        df_tensor q = M(A->q, N, QD), o = M(A->o, N, QD);
        df_tensor kb = M(A->kb, N, KD), vb = M(A->vb, N, KD);
        df_tensor kc = M(A->kc, S, KD), vc = M(A->vc, S, KD), lse = M(A->lse, N, nq);
        df_tensor b = M(A->b, N, H), g = M(A->g, N, F), u = M(A->u, N, F), mm = M(A->m, N, F);
        /* MLP: x_out = xmid + m Wd^T */
        df_tensor dm = M(d->dm, N, F), dg = M(d->dg, N, F), du = M(d->du, N, F), db = M(d->db, N, H);
        df_tensor wd = P(d, W, I->down), gwd = P(d, G, I->down);
        df_tensor wg = P(d, W, I->gate), gwg = P(d, G, I->gate);
        df_tensor wu = P(d, W, I->up), gwu = P(d, G, I->up);
        df_tensor wpn = P(d, W, I->post_norm), gwpn = P(d, G, I->post_norm);
        CK(df_op_matmul_bwd_x(be, &dx, &wd, &dm, 0));
        CK(df_op_matmul_bwd_w(be, &dx, &mm, &gwd, 1));
        CK(df_op_swiglu_bwd(be, &g, &u, &dm, &dg, &du));
        CK(df_op_matmul_bwd_x(be, &dg, &wg, &db, 0));
        CK(df_op_matmul_bwd_x(be, &du, &wu, &db, 1));
        CK(df_op_matmul_bwd_w(be, &dg, &b, &gwg, 1));
        CK(df_op_matmul_bwd_w(be, &du, &b, &gwu, 1));
        /* dx now holds d(xmid) through the residual; add the norm's path */
        CK(df_op_rmsnorm_bwd(be, &xmid, &wpn, eps, 0, &db, &dx, 1, &gwpn));
        /* attention: xmid = xin + o Wo^T */
        df_tensor dout = M(d->dout, N, QD), dq = M(d->dq, N, QD);
        df_tensor dkb = M(d->dkb, N, KD), dvb = M(d->dvb, N, KD);
        df_tensor dkc = M(d->dkc, S, KD), dvc = M(d->dvc, S, KD);
        df_tensor wo = P(d, W, I->wo), gwo = P(d, G, I->wo);
        CK(df_op_matmul_bwd_x(be, &dx, &wo, &dout, 0));
        CK(df_op_matmul_bwd_w(be, &dx, &o, &gwo, 1));
        df_dflash_blocks blk = r->blocks;
        blk.window = I->window;
        CK(df_op_dflash_attn_bwd(be, &q, &kc, &vc, &kb, &vb, &blk, (int)nq, (int)nkv, (int)D,
                                 scale, &o, &lse, &dout, &dq, &dkc, &dvc, &dkb, &dvb));
        CK(df_op_rope_bwd(be, &dq, r->block_pos, (int)nq, (int)D, (int)D, c->rope_theta));
        CK(df_op_rope_bwd(be, &dkb, r->block_pos, (int)nkv, (int)D, (int)D, c->rope_theta));
        CK(df_op_rope_bwd(be, &dkc, r->ctx_pos, (int)nkv, (int)D, (int)D, c->rope_theta));
        df_tensor wqn = P(d, W, I->q_norm), gwqn = P(d, G, I->q_norm);
        df_tensor wkn = P(d, W, I->k_norm), gwkn = P(d, G, I->k_norm);
        /* q/k norms, per head ([rows*heads, D] views): the gradients of the raw
         * projections go to other buffers (dout is free again after the
         * attention backward). */
        df_tensor qr_h = M(A->qraw, N * nq, D), dq_h = M(d->dq, N * nq, D), dqr_h = M(d->dout, N * nq, D);
        df_tensor kbr_h = M(A->kbraw, N * nkv, D), dkb_h = M(d->dkb, N * nkv, D),
                  dkbr_h = M(d->dkb2, N * nkv, D);
        df_tensor kcr_h = M(A->kcraw, S * nkv, D), dkc_h = M(d->dkc, S * nkv, D),
                  dkcr_h = M(d->dkc2, S * nkv, D);
        CK(df_op_rmsnorm_bwd(be, &qr_h, &wqn, eps, 0, &dq_h, &dqr_h, 0, &gwqn));
        CK(df_op_rmsnorm_bwd(be, &kbr_h, &wkn, eps, 0, &dkb_h, &dkbr_h, 0, &gwkn));
        CK(df_op_rmsnorm_bwd(be, &kcr_h, &wkn, eps, 0, &dkc_h, &dkcr_h, 0, &gwkn));
        df_tensor dqr = M(d->dout, N, QD), dkbr = M(d->dkb2, N, KD), dkcr = M(d->dkc2, S, KD);
        df_tensor wq = P(d, W, I->wq), gwq = P(d, G, I->wq);
        df_tensor wk = P(d, W, I->wk), gwk = P(d, G, I->wk);
        df_tensor wv = P(d, W, I->wv), gwv = P(d, G, I->wv);
        df_tensor da = M(d->da, N, H);
        CK(df_op_matmul_bwd_x(be, &dqr, &wq, &da, 0));
        CK(df_op_matmul_bwd_x(be, &dkbr, &wk, &da, 1));
        CK(df_op_matmul_bwd_x(be, &dvb, &wv, &da, 1));
        CK(df_op_matmul_bwd_w(be, &dqr, &a, &gwq, 1));
        CK(df_op_matmul_bwd_w(be, &dkbr, &a, &gwk, 1));
        CK(df_op_matmul_bwd_w(be, &dvb, &a, &gwv, 1));
        CK(df_op_matmul_bwd_x(be, &dkcr, &wk, &dcn, 1));
        CK(df_op_matmul_bwd_x(be, &dvc, &wv, &dcn, 1));
        CK(df_op_matmul_bwd_w(be, &dkcr, &cn, &gwk, 1));
        CK(df_op_matmul_bwd_w(be, &dvc, &cn, &gwv, 1));
        df_tensor win = P(d, W, I->in_norm), gwin = P(d, G, I->in_norm);
        /* dx: d(xmid) flows to d(xin) through the residual, plus the norm's path */
        CK(df_op_rmsnorm_bwd(be, &xin, &win, eps, 0, &da, &dx, 1, &gwin));
    }
    /* context: C = rmsnorm(F fc^T) */
    df_tensor dc = M(d->dc, S, H), gwhn = P(d, G, d->hidden_norm), gwfc = P(d, G, d->fc);
    CK(df_op_rmsnorm_bwd(be, &craw, &whn, eps, 0, &dcn, &dc, 0, &gwhn));
    CK(df_op_matmul_bwd_w(be, &dc, &feat, &gwfc, 1));
    return 0;
}
