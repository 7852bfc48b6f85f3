/* lmhead_ce.c - the CPU reference of the fused frozen LM head + weighted
 * cross-entropy (contract in train_ops.h). Arguments were validated by
 * kernels/train_ops.c.
 *
 * Rows are processed in chunks of at most CE_ROWS: one task computes its
 * chunk's logits [rows, V] in an f32 buffer of its own (GEMM 1, h @ head^T),
 * turns each row into its softmax gradient in place, and multiplies back
 * (GEMM 2, G @ head) into dh: [N, V] logits never exist whole and nothing is
 * recomputed. Per row, in this order:
 *   z = logits (fp32 dot products over H, in order, the forward matmul's way;
 *   DF_CE_BF16_LOGITS: each then rounded to bf16; DF_CE_F16_LOGITS: to fp16)
 *   argmax = the lowest index of the largest z
 *   mx = max z; p_v = expf(z_v - mx) (<= 1: no overflow whatever the scale);
 *   s = sum_v p_v in double, in order; lse = mx + log(s)   (double)
 *   CE = lse - z[label]  (double; ce[] gets it rounded to f32)
 *   G_v = p_v * (f32)(c / s), G[label] = p_label * (c / s) - c  (c = w / denom,
 *   the label entry in double: p_label near 1 must not cancel in f32)
 *   with DF_CE_FP8_GRAD, G rounded to E4M3 (df_fp8_qdq_f32, 1 x 128 blocks)
 *   (DF_CE_FP8_ROUND_HEAD: GEMMs 1 and 2 take a copy of head rounded first)
 *   with DF_CE_FP8_ONEPASS instead, per 1 x 128 block b of max mb:
 *   G_v = e4m3(expf(z_v - mb) * 256) * (f32)(c / s * exp(mb - mx) * 2^-8)
 *   (the label's entry too), and the one-hot term comes after GEMM 2
 *   dh = G @ head: fp32 sums over v in order within segments of CE_VSEG,
 *   the segment sums added in order; DF_CE_FP8_ONEPASS: then, per element,
 *   dh -= (f32)c * head[label] (a product and a difference, each rounded)
 * Ignored rows (label < 0 or weight 0) contribute nothing, get ce = 0 and
 * dh = 0, and skip both GEMMs unless argmax is wanted (GEMM 1 then).
 * loss_sum adds the rows' w * CE (kept per row in double) in row order, so
 * nothing depends on the chunking, which is why the chunk may follow the
 * thread count: the results are bitwise the same for any. */
#include "train_internal.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "e4m3.h"

enum { CE_ROWS = 64, CE_VSEG = 4096 };

typedef struct ce_ctx {
    const df_tensor *h, *head;
    const int32_t *label;
    const float *weight;
    double denom;
    df_tensor *dh;
    int32_t *argmax;
    float *ce;
    double *row_loss; /* [N] w * CE per row */
    int64_t chunk;
    df_gemm_kern kern;
    unsigned flags;
} ce_ctx;

static int row_active(const ce_ctx *c, int64_t i)
{
    return c->label[i] >= 0 && (!c->weight || c->weight[i] > 0.0f);
}

static float *h_row(const df_tensor *t, int64_t i)
{
    return (float *)t->data + i * t->stride[0];
}

/* head[v][k] as a float (an F32 or BF16 weight) */
static float head_at(const df_tensor *w, int64_t v, int64_t k)
{
    int64_t i = v * w->stride[0] + k;
    return w->dtype == DF_DTYPE_BF16 ? df_bf16_to_f32(((const uint16_t *)w->data)[i])
                                     : ((const float *)w->data)[i];
}

/* DF_CE_FP8_ONEPASS: row z (logits) becomes its softmax part G in place,
 * per 1 x 128 block against the block's own max mb (train_ops.h); sc = c / s.
 * A block of -inf logits only gives zeros. */
static void onepass_row(float *z, int64_t V, float mx, double sc)
{
    for (int64_t b0 = 0; b0 < V; b0 += 128) {
        int64_t b1 = V - b0 < 128 ? V : b0 + 128;
        float mb = z[b0];
        for (int64_t v = b0 + 1; v < b1; v++)
            mb = z[v] > mb ? z[v] : mb;
        if (mb == -INFINITY) {
            for (int64_t v = b0; v < b1; v++)
                z[v] = 0.0f;
            continue;
        }
        float scale = (float)(sc * exp((double)mb - (double)mx) * 0x1p-8);
        for (int64_t v = b0; v < b1; v++)
            z[v] = df_e4m3_to_f32(df_e4m3_from_f32(expf(z[v] - mb) * 256.0f)) * scale;
    }
}

static int ce_task(void *vp, size_t task)
{
    const ce_ctx *c = vp;
    int64_t N = c->h->shape[0], H = c->h->shape[1], V = c->head->shape[0];
    int64_t r0 = (int64_t)task * c->chunk, r1 = r0 + c->chunk < N ? r0 + c->chunk : N;

    /* The rows GEMM 1 runs over (all when argmax is wanted, else the active
     * ones) and, among them, the active ones. */
    int64_t idx[CE_ROWS], n_run = 0;
    for (int64_t i = r0; i < r1; i++) {
        c->row_loss[i] = 0.0;
        if (c->ce)
            c->ce[i] = 0.0f;
        if (c->argmax || row_active(c, i))
            idx[n_run++] = i;
        else if (c->dh)
            memset(h_row(c->dh, i), 0, (size_t)H * sizeof(float));
    }
    if (n_run == 0)
        return 0;

    float *buf = malloc((size_t)(n_run * V) * sizeof(float));
    if (!buf)
        return -ENOMEM;
    const float *arow[CE_ROWS];
    const float *grow[CE_ROWS], *gseg[CE_ROWS];
    float *drow[CE_ROWS], coefs[CE_ROWS];
    int64_t labs[CE_ROWS];
    const int onepass = (c->flags & DF_CE_FP8_ONEPASS) != 0;
    for (int64_t j = 0; j < n_run; j++)
        arow[j] = h_row(c->h, idx[j]);

    /* GEMM 1: buf[j][v] = h[idx[j]] . head[v] */
    df_gemm g;
    memset(&g, 0, sizeof g);
    g.a.rows = arow;
    g.b.data = c->head->data;
    g.b.dtype = c->head->dtype;
    g.b.ld = c->head->stride[0];
    g.b.trans = 1;
    g.c.data = buf;
    g.c.ld = V;
    g.K = H;
    g.kern = c->kern;
    int rc = df_gemm_rows(&g, 0, n_run, V);
    if (rc < 0) {
        free(buf);
        return rc;
    }

    if (c->flags & DF_CE_BF16_LOGITS)
        for (int64_t j = 0; j < n_run * V; j++)
            buf[j] = df_bf16_to_f32(df_f32_to_bf16(buf[j]));
    if (c->flags & DF_CE_F16_LOGITS)
        for (int64_t j = 0; j < n_run * V; j++)
            buf[j] = df_f16_to_f32(df_f32_to_f16(buf[j]));

    int64_t n_act = 0;
    for (int64_t j = 0; j < n_run; j++) {
        int64_t i = idx[j];
        float *z = buf + j * V;
        float mx = z[0];
        int64_t am = 0;
        for (int64_t v = 1; v < V; v++)
            if (z[v] > mx) {
                mx = z[v];
                am = v;
            }
        if (c->argmax)
            c->argmax[i] = (int32_t)am;
        if (!row_active(c, i)) {
            if (c->dh)
                memset(h_row(c->dh, i), 0, (size_t)H * sizeof(float));
            continue;
        }
        int64_t lab = c->label[i];
        double w = c->weight ? (double)c->weight[i] : 1.0;
        float zl = z[lab];
        double s = 0.0;
        if (onepass) /* z kept: the blocks' codes are taken from it */
            for (int64_t v = 0; v < V; v++)
                s += expf(z[v] - mx);
        else
            for (int64_t v = 0; v < V; v++) {
                float p = expf(z[v] - mx);
                z[v] = p;
                s += p;
            }
        double ce = ((double)mx + log(s)) - (double)zl;
        c->row_loss[i] = w * ce;
        if (c->ce)
            c->ce[i] = (float)ce;
        if (c->dh) {
            double coef = w / c->denom, sc = coef / s;
            if (onepass) {
                onepass_row(z, V, mx, sc);
            } else {
                float scf = (float)sc, pl = z[lab];
                for (int64_t v = 0; v < V; v++)
                    z[v] *= scf;
                z[lab] = (float)((double)pl * sc - coef);
                if ((c->flags & DF_CE_FP8_GRAD) && df_fp8_qdq_f32(z, 1, V, V, 1, 128)) {
                    free(buf);
                    return -ENOMEM;
                }
            }
            coefs[n_act] = (float)coef;
            labs[n_act] = lab;
            grow[n_act] = z;
            drow[n_act] = h_row(c->dh, i);
            n_act++;
        }
    }

    /* GEMM 2: dh[i] = sum_v G[i][v] head[v] over the active rows. */
    if (n_act > 0) {
        memset(&g, 0, sizeof g);
        g.b.data = c->head->data;
        g.b.dtype = c->head->dtype;
        g.b.ld = c->head->stride[0];
        g.c.rows = drow;
        g.kern = c->kern;
        /* V in segments: each an fp32 sum over its CE_VSEG entries, the
         * segments added in order. One chain over a 248K vocabulary would
         * err by ~u sqrt(V) = 3e-5 of the terms' magnitude; this, by about
         * u (sqrt(CE_VSEG) + sqrt(V / CE_VSEG)). */
        for (int64_t v0 = 0; v0 < V && rc == 0; v0 += CE_VSEG) {
            int64_t vn = V - v0 < CE_VSEG ? V - v0 : CE_VSEG;
            for (int64_t j = 0; j < n_act; j++)
                gseg[j] = grow[j] + v0;
            g.a.rows = gseg;
            g.b.data = (const uint8_t *)c->head->data +
                       v0 * c->head->stride[0] * (int64_t)df_dtype_size(c->head->dtype);
            g.c.accumulate = v0 > 0;
            g.K = vn;
            rc = df_gemm_rows(&g, 0, n_act, H);
        }
        /* DF_CE_FP8_ONEPASS: the one-hot term, on the head the GEMMs took */
        for (int64_t j = 0; onepass && rc == 0 && j < n_act; j++)
            for (int64_t k = 0; k < H; k++) {
                float t = coefs[j] * head_at(c->head, labs[j], k);
                drow[j][k] -= t;
            }
    }
    free(buf);
    return rc;
}

int df_cpu_lmhead_ce(df_backend *be, const df_tensor *h, const df_tensor *head,
                     const int32_t *label, const float *weight, float denom, double *loss_sum,
                     df_tensor *dh, int32_t *argmax, float *ce, unsigned flags)
{
    int64_t N = h->shape[0], V = head->shape[0];
    if (N == 0)
        return 0;
    /* Chunk: CE_ROWS rows, fewer when the buffer would pass 64 MiB (huge V)
     * or when that leaves a thread without work. */
    int64_t chunk = CE_ROWS, cap = ((int64_t)1 << 24) / V;
    if (chunk > cap)
        chunk = cap > 0 ? cap : 1;
    int64_t per_thread = (N + be->nthreads - 1) / be->nthreads;
    if (chunk > per_thread)
        chunk = per_thread;
    /* DF_CE_FP8_ROUND_HEAD: the head rounded (128 x 128) into a copy of this call's */
    df_tensor hr = *head;
    hr.data = NULL;
    if (flags & DF_CE_FP8_ROUND_HEAD) {
        hr.stride[0] = head->shape[1];
        if (!(hr.data = malloc((size_t)(V * head->shape[1]) * df_dtype_size(head->dtype))))
            return -ENOMEM;
        int rc = df_cpu_fp8_qdq(be, head, &hr, 128, 128);
        if (rc) {
            free(hr.data);
            return rc;
        }
        head = &hr;
    }
    double *row_loss = malloc((size_t)N * sizeof(double));
    if (!row_loss) {
        free(hr.data);
        return -ENOMEM;
    }
    ce_ctx c = {h, head, label, weight, (double)denom, dh, argmax, ce, row_loss, chunk,
                df_gemm_pick_kernel(), flags};
    int rc = df_pool_for(be->pool, (size_t)((N + chunk - 1) / chunk), ce_task, &c);
    if (rc == 0 && loss_sum) {
        double s = 0.0;
        for (int64_t i = 0; i < N; i++)
            s += row_loss[i];
        *loss_sum += s;
    }
    free(row_loss);
    free(hr.data);
    return rc;
}
