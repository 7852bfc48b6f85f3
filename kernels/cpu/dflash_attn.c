/* dflash_attn.c - the CPU reference of the DFlash drafter attention,
 * forward and backward (contract in train_ops.h, checks in train_attn.c).
 *
 * Visibility, per query row (block b, offset qo; anchor p, document start
 * s0, window W): the context keys form ONE contiguous range
 *   [lo, p),  lo = s0 for a full layer, max(s0, p + qo - (W-1)) for W > 0
 * (empty when lo >= p), and the block keys the range [0, kend) of block b,
 * kend = bs (full, bidirectional) or qo + 1 (sliding, causal). So the mask
 * is never evaluated per key: every loop runs over exactly the visible keys
 * and nothing else of the row is touched (block-sparse; for a block the
 * context span is [max(s0, p - (W-1)), p), not all S).
 *
 * Numerics (fp32 throughout, as the GPU kernels will do):
 *   forward, per (row, head): s_j = (q . k_j) * scale over the visible keys,
 *   m = max s_j, e_j = exp(s_j - m), l = sum e_j, out = sum (e_j / l) v_j,
 *   lse = m + log(l). A row that sees nothing (only padding blocks: a valid
 *   row always sees its own block key 0) gets out 0 and lse -inf.
 *   backward (FlashAttention-2): P_ij = exp(s_ij - lse_i) recomputed with
 *   the same dot products as the forward, D_i = dO_i . O_i,
 *   dP_ij = dO_i . v_j, dS_ij = P_ij (dP_ij - D_i);
 *   dq_i = scale sum_j dS_ij k_j, dk_j = scale sum_i dS_ij q_i,
 *   dv_j = sum_i P_ij dO_i. Padding rows contribute nothing and get 0.
 *
 * Work split (deterministic: every output element is produced by one task,
 * its sums in a fixed order that does not depend on the thread count):
 *   forward: one task per (block, kv head): bs x group rows.
 *   backward pass 1: one task per (block, kv head): D_i, dq for its rows,
 *     and dkb/dvb of the block (only its own rows see those keys).
 *   backward pass 2: one task per (kv head, tile of CTX_TILE context keys):
 *     the transposed visibility. For each block b (ascending) whose context
 *     span meets the tile, each row qo, each query head of the group, it
 *     adds into dkc/dvc of the visible keys of the tile. A key's sum runs
 *     over (b, qo, head) in that order whatever the tiling. No atomics. */
#include "cpu_internal.h"
#include "dflash_attn_internal.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { CTX_TILE = 64 }; /* context keys per backward pass-2 task */

/* y += a * x */
static void axpy(float *restrict y, float a, const float *restrict x, int n)
{
    for (int i = 0; i < n; i++)
        y[i] += a * x[i];
}

typedef struct fa_ctx {
    const df_tensor *q, *kc, *vc, *kb, *vb;
    const df_tensor *out, *lse, *dout; /* backward inputs */
    df_tensor *o, *l;                  /* forward outputs */
    df_tensor *dq, *dkc, *dvc, *dkb, *dvb;
    const df_dflash_blocks *blk;
    int nq, nkv, group, D, bs;
    float scale;
    int64_t S, max_ctx; /* max_ctx: longest context span of a valid block */
    float *Di;          /* [rows * nq] dO . O (backward) */
} fa_ctx;

static inline float *at(const df_tensor *t, int64_t r, int64_t c)
{
    return (float *)t->data + r * t->stride[0] + c;
}

/* The context keys visible to row qo of valid block b: [*lo, *hi). */
static void ctx_range(const df_dflash_blocks *blk, int b, int qo, int64_t *lo, int64_t *hi)
{
    int64_t p = blk->anchor[b], l = blk->doc_start[b];
    if (blk->window > 0 && p + qo - (blk->window - 1) > l)
        l = p + qo - (blk->window - 1);
    *lo = l < p ? l : p;
    *hi = p;
}

/* Block keys visible to row qo: offsets [0, kend). */
static int blk_end(const df_dflash_blocks *blk, int qo)
{
    return blk->window > 0 ? qo + 1 : blk->block_size;
}

/* ---- forward ---- */

static int fwd_task(void *vp, size_t task)
{
    const fa_ctx *c = vp;
    int b = (int)(task / (size_t)c->nkv), g = (int)(task % (size_t)c->nkv);
    int D = c->D, bs = c->bs;
    int64_t r0 = (int64_t)b * bs;
    if (!c->blk->valid[b]) {
        for (int qo = 0; qo < bs; qo++)
            for (int hh = 0; hh < c->group; hh++) {
                int h = g * c->group + hh;
                memset(at(c->o, r0 + qo, (int64_t)h * D), 0, (size_t)D * sizeof(float));
                *at(c->l, r0 + qo, h) = -INFINITY;
            }
        return 0;
    }
    float *s = malloc((size_t)(c->max_ctx + bs + D) * sizeof(float));
    if (!s)
        return -ENOMEM;
    float *acc = s + c->max_ctx + bs;
    for (int qo = 0; qo < bs; qo++) {
        int64_t lo, hi;
        ctx_range(c->blk, b, qo, &lo, &hi);
        int nc = (int)(hi - lo), nb = blk_end(c->blk, qo), n = nc + nb;
        for (int hh = 0; hh < c->group; hh++) {
            int h = g * c->group + hh;
            const float *qi = at(c->q, r0 + qo, (int64_t)h * D);
            float mx = -INFINITY;
            for (int j = 0; j < nc; j++) {
                s[j] = dot_f32(qi, at(c->kc, lo + j, (int64_t)g * D), D) * c->scale;
                mx = s[j] > mx ? s[j] : mx;
            }
            for (int k = 0; k < nb; k++) {
                s[nc + k] = dot_f32(qi, at(c->kb, r0 + k, (int64_t)g * D), D) * c->scale;
                mx = s[nc + k] > mx ? s[nc + k] : mx;
            }
            float *o = at(c->o, r0 + qo, (int64_t)h * D);
            if (n == 0 || mx == -INFINITY) { /* nothing visible (not reachable today) */
                memset(o, 0, (size_t)D * sizeof(float));
                *at(c->l, r0 + qo, h) = -INFINITY;
                continue;
            }
            float sum = 0.0f;
            for (int j = 0; j < n; j++) {
                s[j] = expf(s[j] - mx);
                sum += s[j];
            }
            memset(acc, 0, (size_t)D * sizeof(float));
            for (int j = 0; j < nc; j++)
                axpy(acc, s[j] / sum, at(c->vc, lo + j, (int64_t)g * D), D);
            for (int k = 0; k < nb; k++)
                axpy(acc, s[nc + k] / sum, at(c->vb, r0 + k, (int64_t)g * D), D);
            memcpy(o, acc, (size_t)D * sizeof(float));
            *at(c->l, r0 + qo, h) = mx + logf(sum);
        }
    }
    free(s);
    return 0;
}

/* Longest context span [max(s0, p - (W-1)), p) over the valid blocks. */
static int64_t max_ctx_span(const df_dflash_blocks *blk)
{
    int64_t m = 0;
    for (int b = 0; b < blk->n_blocks; b++) {
        if (!blk->valid[b])
            continue;
        int64_t lo, hi;
        ctx_range(blk, b, 0, &lo, &hi);
        if (hi - lo > m)
            m = hi - lo;
    }
    return m;
}

int df_cpu_dflash_attn(df_backend *be, const df_tensor *q, const df_tensor *kc,
                       const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,
                       const df_dflash_blocks *blk, int nq, int nkv, int head_dim, float scale,
                       df_tensor *out, df_tensor *lse)
{
    fa_ctx c;
    memset(&c, 0, sizeof c);
    c.q = q, c.kc = kc, c.vc = vc, c.kb = kb, c.vb = vb, c.o = out, c.l = lse, c.blk = blk;
    c.nq = nq, c.nkv = nkv, c.group = nq / nkv, c.D = head_dim, c.bs = blk->block_size;
    c.scale = scale, c.S = kc->shape[0], c.max_ctx = max_ctx_span(blk);
    return df_pool_for(be->pool, (size_t)blk->n_blocks * (size_t)nkv, fwd_task, &c);
}

/* ---- backward ---- */

/* Pass 1, per (block, kv head): D_i, dq of the block's rows (group heads),
 * dkb/dvb of the block (kv head g). */
static int bwd_rows_task(void *vp, size_t task)
{
    const fa_ctx *c = vp;
    int b = (int)(task / (size_t)c->nkv), g = (int)(task % (size_t)c->nkv);
    int D = c->D, bs = c->bs;
    int64_t r0 = (int64_t)b * bs, gc = (int64_t)g * D;
    for (int k = 0; k < bs; k++) {
        memset(at(c->dkb, r0 + k, gc), 0, (size_t)D * sizeof(float));
        memset(at(c->dvb, r0 + k, gc), 0, (size_t)D * sizeof(float));
    }
    if (!c->blk->valid[b]) {
        for (int qo = 0; qo < bs; qo++)
            for (int hh = 0; hh < c->group; hh++) {
                int h = g * c->group + hh;
                memset(at(c->dq, r0 + qo, (int64_t)h * D), 0, (size_t)D * sizeof(float));
                c->Di[(r0 + qo) * c->nq + h] = 0.0f;
            }
        return 0;
    }
    float *acc = malloc((size_t)D * sizeof(float));
    if (!acc)
        return -ENOMEM;
    for (int qo = 0; qo < bs; qo++) {
        int64_t lo, hi, r = r0 + qo;
        ctx_range(c->blk, b, qo, &lo, &hi);
        int nb = blk_end(c->blk, qo);
        for (int hh = 0; hh < c->group; hh++) {
            int h = g * c->group + hh;
            int64_t hc = (int64_t)h * D;
            const float *qi = at(c->q, r, hc), *doi = at(c->dout, r, hc);
            float L = *at(c->lse, r, h);
            float Di = dot_f32(doi, at(c->out, r, hc), D);
            c->Di[r * c->nq + h] = Di;
            memset(acc, 0, (size_t)D * sizeof(float));
            if (L == -INFINITY) { /* nothing visible: no gradient */
                memcpy(at(c->dq, r, hc), acc, (size_t)D * sizeof(float));
                continue;
            }
            for (int64_t j = lo; j < hi; j++) {
                const float *kj = at(c->kc, j, gc);
                float P = expf(dot_f32(qi, kj, D) * c->scale - L);
                float dS = P * (dot_f32(doi, at(c->vc, j, gc), D) - Di);
                axpy(acc, dS, kj, D);
            }
            for (int k = 0; k < nb; k++) {
                const float *kk = at(c->kb, r0 + k, gc);
                float P = expf(dot_f32(qi, kk, D) * c->scale - L);
                float dS = P * (dot_f32(doi, at(c->vb, r0 + k, gc), D) - Di);
                axpy(acc, dS, kk, D);
                axpy(at(c->dkb, r0 + k, gc), dS * c->scale, qi, D);
                axpy(at(c->dvb, r0 + k, gc), P, doi, D);
            }
            float *dqi = at(c->dq, r, hc);
            for (int d = 0; d < D; d++)
                dqi[d] = acc[d] * c->scale;
        }
    }
    free(acc);
    return 0;
}

/* Pass 2, per (kv head, context tile): dkc/dvc of the tile's keys, summed
 * over blocks, rows and group heads in that order. */
static int bwd_ctx_task(void *vp, size_t task)
{
    const fa_ctx *c = vp;
    int64_t ntiles = (c->S + CTX_TILE - 1) / CTX_TILE;
    int g = (int)(task / (size_t)ntiles);
    int64_t j0 = (int64_t)(task % (size_t)ntiles) * CTX_TILE;
    int64_t j1 = j0 + CTX_TILE < c->S ? j0 + CTX_TILE : c->S;
    int D = c->D, bs = c->bs;
    int64_t gc = (int64_t)g * D;
    for (int64_t j = j0; j < j1; j++) {
        memset(at(c->dkc, j, gc), 0, (size_t)D * sizeof(float));
        memset(at(c->dvc, j, gc), 0, (size_t)D * sizeof(float));
    }
    const df_dflash_blocks *blk = c->blk;
    for (int b = 0; b < blk->n_blocks; b++) {
        if (!blk->valid[b])
            continue;
        int64_t lo, hi, r0 = (int64_t)b * bs;
        ctx_range(blk, b, 0, &lo, &hi); /* the block's widest span: row 0's */
        if (hi <= j0 || lo >= j1)
            continue;
        for (int qo = 0; qo < bs; qo++) {
            ctx_range(blk, b, qo, &lo, &hi);
            int64_t a = lo > j0 ? lo : j0, e = hi < j1 ? hi : j1;
            if (a >= e)
                continue;
            for (int hh = 0; hh < c->group; hh++) {
                int h = g * c->group + hh;
                int64_t r = r0 + qo, hc = (int64_t)h * D;
                const float *qi = at(c->q, r, hc), *doi = at(c->dout, r, hc);
                float L = *at(c->lse, r, h), Di = c->Di[r * c->nq + h];
                if (L == -INFINITY)
                    continue;
                for (int64_t j = a; j < e; j++) {
                    float P = expf(dot_f32(qi, at(c->kc, j, gc), D) * c->scale - L);
                    float dS = P * (dot_f32(doi, at(c->vc, j, gc), D) - Di);
                    axpy(at(c->dkc, j, gc), dS * c->scale, qi, D);
                    axpy(at(c->dvc, j, gc), P, doi, D);
                }
            }
        }
    }
    return 0;
}

int df_cpu_dflash_attn_bwd(df_backend *be, const df_tensor *q, const df_tensor *kc,
                           const df_tensor *vc, const df_tensor *kb, const df_tensor *vb,
                           const df_dflash_blocks *blk, int nq, int nkv, int head_dim,
                           float scale, const df_tensor *out, const df_tensor *lse,
                           const df_tensor *dout, df_tensor *dq, df_tensor *dkc, df_tensor *dvc,
                           df_tensor *dkb, df_tensor *dvb)
{
    fa_ctx c;
    memset(&c, 0, sizeof c);
    c.q = q, c.kc = kc, c.vc = vc, c.kb = kb, c.vb = vb, c.blk = blk;
    c.out = out, c.lse = lse, c.dout = dout;
    c.dq = dq, c.dkc = dkc, c.dvc = dvc, c.dkb = dkb, c.dvb = dvb;
    c.nq = nq, c.nkv = nkv, c.group = nq / nkv, c.D = head_dim, c.bs = blk->block_size;
    c.scale = scale, c.S = kc->shape[0];
    int64_t rows = (int64_t)blk->n_blocks * c.bs;
    c.Di = malloc((size_t)(rows > 0 ? rows * nq : 1) * sizeof(float));
    if (!c.Di)
        return -ENOMEM;
    int rc = df_pool_for(be->pool, (size_t)blk->n_blocks * (size_t)nkv, bwd_rows_task, &c);
    if (rc == 0) {
        size_t ntiles = (size_t)((c.S + CTX_TILE - 1) / CTX_TILE);
        rc = df_pool_for(be->pool, ntiles * (size_t)nkv, bwd_ctx_task, &c);
    }
    free(c.Di);
    return rc;
}
