/* drafter_act.c - where the drafter's activations live: the set each layer keeps for its
 * backward at the recompute level, carved from one workspace (and, with gradient aliasing, from
 * the gradient array's not-yet-written ranges), and the MLP activations the attention backward
 * may borrow. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "drafter_internal.h"
#include "log.h"

/* The activations layer A keeps for its backward at the drafter's
 * recompute level, as (where the pointer goes, elements); returns how many. */
static int layer_saved(const df_drafter *d, layer_act *A, int64_t N, int64_t S, void ***ptr,
                       int64_t *n)
{
    const df_drafter_config *c = &d->c;
    int64_t H = c->hidden_size, QD = (int64_t)c->num_attention_heads * c->head_dim,
            KD = (int64_t)c->num_key_value_heads * c->head_dim, F = c->intermediate_size;
    int k = 0;
#define ADD(f, cnt) (ptr[k] = &A->f, n[k] = (cnt), k++)
    ADD(xin, N * H);
    ADD(xmid, N * H);
    ADD(qraw, N * QD);
    ADD(o, N * QD);
    ADD(kbraw, N * KD);
    ADD(vb, N * KD);
    ADD(kcraw, S * KD);
    ADD(vc, S * KD);
    if (d->recompute < 2) {
        ADD(g, N * F);
        ADD(u, N * F);
    }
    if (!d->recompute) {
        ADD(a, N * H);
        ADD(b, N * H);
        ADD(q, N * QD);
        ADD(kb, N * KD);
        ADD(kc, S * KD);
        ADD(m, N * F);
    }
#undef ADD
    return k;
}

/* The longest contiguous run of a layer's MLP activations g, u, m (n
 * elements each; adjacent where carve put them one after the other, 256-byte
 * padding between hosted ones included). From the MLP's input gradients on
 * they are dead until the layer's next forward (a hosting gradient range is
 * cleared before its layer's backward writes it): the attention backward
 * borrows them for its workspace (df_backend_lend_scratch). */
void *drafter_mlp_dead(const df_drafter *d, const layer_act *A, int64_t n, size_t *bytes)
{
    uint8_t *r[3] = {(uint8_t *)A->g, (uint8_t *)A->u, (uint8_t *)A->m};
    const size_t each = (size_t)n * d->aes;
    for (int i = 0; i < 3; i++) /* by address */
        for (int j = i + 1; j < 3; j++)
            if ((uintptr_t)r[j] < (uintptr_t)r[i]) {
                uint8_t *t = r[i];
                r[i] = r[j], r[j] = t;
            }
    uint8_t *best = NULL, *lo = NULL;
    size_t most = 0, len = 0;
    for (int i = 0; i < 3; i++) {
        if (!r[i])
            continue;
        uintptr_t end = (uintptr_t)lo + len;
        if (lo && (uintptr_t)r[i] < end) /* in the run already (a buffer shared twice) */
            continue;
        if (lo && (uintptr_t)r[i] - end < 256)
            len = (size_t)((uintptr_t)r[i] - (uintptr_t)lo) + each;
        else
            lo = r[i], len = each;
        if (len > most)
            best = lo, most = len;
    }
    *bytes = most;
    return best;
}

/* Lays the workspace out for N queries and S context tokens from base (the
 * arena; NULL: only counts) and returns the arena elements it takes. Layer
 * l >= 1's saved activations go, largest first, into the gradient range of
 * layer l-1 (df_drafter_set_grad_alias) while they fit, the rest into the
 * arena. The recomputed set shared by all layers comes first in the arena. */
static int64_t carve(df_drafter *d, int64_t N, int64_t S, uint8_t *base)
{
    const df_drafter_config *c = &d->c;
    int64_t H = c->hidden_size, QD = (int64_t)c->num_attention_heads * c->head_dim,
            KD = (int64_t)c->num_key_value_heads * c->head_dim, F = c->intermediate_size,
            nq = c->num_attention_heads;
    int L = c->num_hidden_layers;
    int64_t used = 0;
    size_t hosted = 0; /* bytes placed in the gradient array */
#define TAKE(ptr, n)                                                       \
    do {                                                                   \
        ptr = base ? (void *)(base + (size_t)used * d->aes) : NULL;        \
        used += (n);                                                       \
    } while (0)
    float *p32 = d->arena32;
    layer_act cs; /* the shared set of the recomputed activations */
    memset(&cs, 0, sizeof cs);
    if (d->recompute) {
        TAKE(cs.a, N * H);
        TAKE(cs.b, N * H);
        TAKE(cs.q, N * QD);
        TAKE(cs.kb, N * KD);
        TAKE(cs.kc, S * KD);
        TAKE(cs.m, N * F);
    }
    if (d->recompute > 1) {
        TAKE(cs.g, N * F);
        TAKE(cs.u, N * F);
    }
    /* the backward's buffers the LM head does not use: with the set above,
     * lent to the LM head's chunk buffers (df_backend_lend_scratch) */
    TAKE(d->db, N * H);
    TAKE(d->dq, N * QD);
    TAKE(d->dout, N * QD);
    TAKE(d->dkb, N * KD);
    TAKE(d->dvb, N * KD);
    TAKE(d->dkc, S * KD);
    TAKE(d->dvc, S * KD);
    TAKE(d->dcn, S * H);
    TAKE(d->dc, S * H);
    TAKE(d->dkb2, N * KD);
    TAKE(d->dkc2, S * KD);
    d->lend_n = used;
    size_t ges = df_dtype_size(d->gdt);
    for (int l = 0; l < L; l++) {
        layer_act *A = &d->act[l];
        void **ptr[16];
        int64_t n[16];
        int k = layer_saved(d, A, N, S, ptr, n);
        /* the hosting gradient range, 256-byte aligned */
        uint8_t *slot = NULL;
        size_t room = 0;
        if (d->galias && l > 0 && d->ahi[l] > d->alo[l]) {
            uintptr_t lo = (uintptr_t)d->galias + (size_t)d->alo[l] * ges,
                      hi = (uintptr_t)d->galias + (size_t)d->ahi[l] * ges;
            lo = (lo + 255) & ~(uintptr_t)255;
            slot = (uint8_t *)lo;
            room = hi > lo ? hi - lo : 0;
        }
        int done[16] = {0};
        for (int t = 0; t < k; t++) { /* largest first; ties in list order */
            int j = -1;
            for (int i = 0; i < k; i++)
                if (!done[i] && (j < 0 || n[i] > n[j]))
                    j = i;
            done[j] = 1;
            size_t bytes = ((size_t)n[j] * d->aes + 255) & ~(size_t)255;
            if (bytes <= room) {
                *ptr[j] = slot;
                slot += bytes;
                room -= bytes;
                hosted += bytes;
            } else {
                TAKE(*ptr[j], n[j]);
            }
        }
        A->lse = p32;
        if (p32)
            p32 += N * nq;
        if (d->recompute > 1)
            A->g = cs.g, A->u = cs.u;
        if (d->recompute)
            A->a = cs.a, A->b = cs.b, A->q = cs.q, A->kb = cs.kb, A->kc = cs.kc, A->m = cs.m;
    }
    if (p32) {
        d->wts = p32;
        d->labels = (int32_t *)(p32 + N);
        d->argmax = (int32_t *)(p32 + 2 * N);
    }
    TAKE(d->craw, S * H);
    TAKE(d->cn, S * H);
    TAKE(d->xfin, N * H);
    TAKE(d->h, N * H);
    TAKE(d->dx, N * H);
    TAKE(d->dh, N * H);
    TAKE(d->da, N * H);
#undef TAKE
    if (base)
        df_log(DF_LOG_INFO, "drafter: activations for %lld queries, %lld context tokens: %.3f MiB "
               "in the workspace, %.3f MiB more in the gradient array", (long long)N,
               (long long)S, (double)used * d->aes / (1 << 20), (double)hosted / (1 << 20));
    return used;
}

/* Allocates and carves the workspace for N queries and S context tokens. */
int drafter_reserve(df_drafter *d, int64_t N, int64_t S, df_err *e)
{
    if (N <= d->cap_N && S <= d->cap_S)
        return 0;
    d->pf_feat = NULL; /* feat is about to move: a prefetch into it is void */
    if (N < d->cap_N)
        N = d->cap_N;
    if (S < d->cap_S)
        S = d->cap_S;
    const df_drafter_config *c = &d->c;
    int64_t nq = c->num_attention_heads;
    int L = c->num_hidden_layers;
    int64_t total32 = (int64_t)L * N * nq + 3 * N; /* lse; weights, labels, argmax */
    df_backend_free(d->be, d->arena);
    df_backend_free(d->be, d->arena32);
    df_backend_free(d->be, d->feat);
    df_backend_free(d->be, d->feat32);
    d->arena = d->arena32 = d->feat = d->feat32 = NULL;
    free(d->act);
    free(d->argmax_host);
    free(d->act_i);
    free(d->inv);
    df_backend_host_free(d->be, d->lab_c);
    df_backend_host_free(d->be, d->wts_c);
    d->act = calloc((size_t)L, sizeof *d->act);
    int64_t total = d->act ? carve(d, N, S, NULL) : 0;
    d->arena = df_backend_alloc(d->be, (size_t)(total > 0 ? total : 1) * d->aes);
    d->arena32 = df_backend_alloc(d->be, (size_t)total32 * 4);
    d->argmax_host = malloc((size_t)N * sizeof *d->argmax_host);
    d->act_i = malloc((size_t)N * sizeof *d->act_i);
    d->inv = malloc((size_t)N * sizeof *d->inv);
    d->lab_c = df_backend_host_alloc(d->be, (size_t)N * sizeof *d->lab_c);
    d->wts_c = df_backend_host_alloc(d->be, (size_t)N * sizeof *d->wts_c);
    int ok = d->arena && d->arena32 && d->act && d->argmax_host && d->act_i && d->inv &&
             d->lab_c && d->wts_c;
    if (ok && !d->host) { /* the row's features, uploaded (F32 rows: staged at first use) */
        int64_t KH = df_drafter_fc_in(c);
        d->feat = df_backend_alloc(d->be, (size_t)(S * KH) * d->aes);
        ok = d->feat != NULL;
    }
    if (!ok) {
        d->cap_N = d->cap_S = 0;
        int64_t used = df_backend_mem_used(d->be);
        return df_errf(e, -ENOMEM, "out of memory on %s for a row of %lld queries, %lld context "
                       "tokens (%.1f GiB in use): pass a smaller --max-anchors or --max-tokens",
                       df_backend_name(d->be), (long long)N, (long long)S,
                       used >= 0 ? (double)used / (1 << 30) : 0.0);
    }
    carve(d, N, S, d->arena);
    d->cap_N = N;
    d->cap_S = S;
    return 0;
}
