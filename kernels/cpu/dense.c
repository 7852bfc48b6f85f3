/* dense.c - the CPU reference for the dense ops: embed, matmul, add, the two
 * RMSNorms, RoPE, SwiGLU, sigmoid/SiLU and causal attention.
 *
 * fp32 math throughout, in the order HF's modeling code does it, so GPU ops
 * and the HF reference can both be compared against it. Work is split over
 * be->pool in pieces whose boundaries depend only on the shapes, and every
 * output element is computed by one piece in a fixed order: results are
 * bitwise identical for any thread count. Arguments were validated by
 * kernels/ops.c. */
#include "cpu_internal.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- row-parallel helper ---- */

typedef int (*rows_fn)(void *ctx, int64_t r0, int64_t r1);

typedef struct rows_job {
    rows_fn fn;
    void *ctx;
    int64_t n, chunk;
} rows_job;

static int rows_task(void *arg, size_t i)
{
    const rows_job *j = arg;
    int64_t r0 = (int64_t)i * j->chunk;
    int64_t r1 = r0 + j->chunk < j->n ? r0 + j->chunk : j->n;
    return j->fn(j->ctx, r0, r1);
}

/* fn over [0, n) rows in chunks of about 64K elements of work (cost = work
 * per row): big enough that the pool's hand-off is noise, small enough to
 * balance. Each row's result does not depend on the chunking. */
static int par_rows(df_backend *be, int64_t n, int64_t cost, rows_fn fn, void *ctx)
{
    if (n <= 0)
        return 0;
    int64_t chunk = cost > 0 ? ((int64_t)1 << 16) / cost : n;
    if (chunk < 1)
        chunk = 1;
    rows_job j = {fn, ctx, n, chunk};
    return df_pool_for(be->pool, (size_t)((n + chunk - 1) / chunk), rows_task, &j);
}

static inline float sigmoidf_(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

/* x * sigmoid(x) written as x / (1 + e^-x), as torch's SiLU; for x -> -inf
 * e^-x overflows to inf and the result is -0, never NaN. */
static inline float siluf_(float x)
{
    return x / (1.0f + expf(-x));
}

/* ---- embed ---- */

typedef struct embed_ctx {
    const df_tensor *table;
    const uint32_t *ids;
    df_tensor *out;
} embed_ctx;

static int embed_rows(void *vp, int64_t r0, int64_t r1)
{
    const embed_ctx *c = vp;
    size_t es = df_dtype_size(c->table->dtype);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *src =
            (const uint8_t *)c->table->data + (int64_t)c->ids[r] * c->table->stride[0] * (int64_t)es;
        weight_to_f32(src, c->table->dtype, c->out->shape[1], row_ptr(c->out, r));
    }
    return 0;
}

int df_cpu_embed(df_backend *be, const df_tensor *table, const uint32_t *ids, int64_t n,
                 df_tensor *out)
{
    embed_ctx c = {table, ids, out};
    return par_rows(be, n, out->shape[1], embed_rows, &c);
}

/* ---- matmul: y[M, N] (+)= x[M, K] @ w[N, K]^T ----
 *
 * The shared blocked GEMM (kernels/cpu/gemm.c) with A = x as is and B = w
 * transposed (B[k][j] = w[j][k], converted to f32 panel by panel): each y
 * element is one fp32 sum over k in increasing order, added to the old y
 * last (as the residual add after a projection), whatever the thread count. */
int df_cpu_matmul(df_backend *be, const df_tensor *x, const df_tensor *w, df_tensor *y,
                  int accumulate)
{
    df_gemm g;
    memset(&g, 0, sizeof g);
    g.a.data = x->data;
    g.a.ld = x->stride[0];
    g.b.data = w->data;
    g.b.dtype = w->dtype;
    g.b.ld = w->stride[0];
    g.b.trans = 1;
    g.c.data = y->data;
    g.c.ld = y->stride[0];
    g.c.accumulate = accumulate;
    g.K = x->shape[1];
    g.kern = df_gemm_pick_kernel();
    return df_gemm_par(be, &g, x->shape[0], w->shape[0]);
}

/* ---- elementwise ---- */

typedef struct ew_ctx {
    const df_tensor *a, *b;
    df_tensor *out;
    int op;
} ew_ctx;

enum { EW_ADD, EW_SWIGLU, EW_SIGMOID, EW_SILU };

static int ew_rows(void *vp, int64_t r0, int64_t r1)
{
    const ew_ctx *c = vp;
    int64_t n = row_len(c->out);
    for (int64_t r = r0; r < r1; r++) {
        const float *a = row_ptr(c->a, r), *b = c->b ? row_ptr(c->b, r) : NULL;
        float *o = row_ptr(c->out, r);
        switch (c->op) {
        case EW_ADD:
            for (int64_t i = 0; i < n; i++)
                o[i] = a[i] + b[i];
            break;
        case EW_SWIGLU:
            for (int64_t i = 0; i < n; i++)
                o[i] = siluf_(a[i]) * b[i];
            break;
        case EW_SIGMOID:
            for (int64_t i = 0; i < n; i++)
                o[i] = sigmoidf_(a[i]);
            break;
        default:
            for (int64_t i = 0; i < n; i++)
                o[i] = siluf_(a[i]);
            break;
        }
    }
    return 0;
}

static int ew_run(df_backend *be, const df_tensor *a, const df_tensor *b, df_tensor *out, int op)
{
    ew_ctx c = {a, b, out, op};
    int64_t cost = row_len(out) * (op == EW_ADD ? 1 : 8);
    return par_rows(be, row_len(out) ? n_rows(out) : 0, cost, ew_rows, &c);
}

int df_cpu_add(df_backend *be, const df_tensor *x, df_tensor *y)
{
    return ew_run(be, x, y, y, EW_ADD);
}

int df_cpu_swiglu(df_backend *be, const df_tensor *gate, const df_tensor *up, df_tensor *out)
{
    return ew_run(be, gate, up, out, EW_SWIGLU);
}

int df_cpu_sigmoid(df_backend *be, const df_tensor *x, df_tensor *out)
{
    return ew_run(be, x, NULL, out, EW_SIGMOID);
}

int df_cpu_silu(df_backend *be, const df_tensor *x, df_tensor *out)
{
    return ew_run(be, x, NULL, out, EW_SILU);
}

/* ---- RMSNorm ---- */

typedef struct norm_ctx {
    const df_tensor *x, *z, *w;
    df_tensor *y;
    float eps;
    int plus_one;
} norm_ctx;

static int norm_rows(void *vp, int64_t r0, int64_t r1)
{
    const norm_ctx *c = vp;
    int64_t D = row_len(c->x);
    float *g = malloc((size_t)D * sizeof(float));
    if (!g)
        return -ENOMEM;
    weight_to_f32(c->w->data, c->w->dtype, D, g);
    if (c->plus_one)
        for (int64_t i = 0; i < D; i++)
            g[i] = 1.0f + g[i];
    for (int64_t r = r0; r < r1; r++) {
        const float *x = row_ptr(c->x, r);
        float *y = row_ptr(c->y, r);
        /* HF: x * rsqrt(mean(x^2) + eps), then times the weight. */
        float inv = 1.0f / sqrtf(df_sumsq_f32(x, D) / (float)D + c->eps);
        if (c->z) {
            const float *z = row_ptr(c->z, r);
            for (int64_t i = 0; i < D; i++)
                y[i] = g[i] * (x[i] * inv) * siluf_(z[i]);
        } else {
            for (int64_t i = 0; i < D; i++)
                y[i] = g[i] * (x[i] * inv);
        }
    }
    free(g);
    return 0;
}

int df_cpu_rmsnorm(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                   int plus_one, df_tensor *y)
{
    norm_ctx c = {x, NULL, w, y, eps, plus_one != 0};
    int64_t D = row_len(x);
    return par_rows(be, D ? n_rows(x) : 0, D * 3, norm_rows, &c);
}

int df_cpu_rmsnorm_gated(df_backend *be, const df_tensor *x, const df_tensor *z,
                         const df_tensor *w, float eps, df_tensor *y)
{
    norm_ctx c = {x, z, w, y, eps, 0};
    int64_t D = row_len(x);
    return par_rows(be, D ? n_rows(x) : 0, D * 10, norm_rows, &c);
}

/* ---- RoPE ---- */

typedef struct rope_ctx {
    df_tensor *x;
    const int32_t *pos;
    const float *inv_freq;
    int heads, head_dim, half;
    float sign; /* +1: the rotation; -1: its transpose (the backward pass) */
} rope_ctx;

static int rope_rows(void *vp, int64_t r0, int64_t r1)
{
    const rope_ctx *c = vp;
    float *cs = malloc((size_t)c->half * 2 * sizeof(float));
    if (!cs)
        return -ENOMEM;
    float *sn = cs + c->half;
    for (int64_t t = r0; t < r1; t++) {
        /* HF: freqs = pos (as f32) * inv_freq, one fp32 product; cos/sin in fp32. */
        float p = (float)c->pos[t];
        for (int d = 0; d < c->half; d++) {
            float ang = p * c->inv_freq[d];
            cs[d] = cosf(ang);
            sn[d] = c->sign * sinf(ang); /* negation is exact: the transpose is bitwise */
        }
        float *row = (float *)c->x->data + t * c->x->stride[0];
        for (int h = 0; h < c->heads; h++) {
            float *v = row + (int64_t)h * c->head_dim;
            /* x*cos + rotate_half(x)*sin, rotate_half(x) = (-x2, x1). */
            for (int d = 0; d < c->half; d++) {
                float x1 = v[d], x2 = v[d + c->half];
                v[d] = x1 * cs[d] - x2 * sn[d];
                v[d + c->half] = x2 * cs[d] + x1 * sn[d];
            }
        }
    }
    free(cs);
    return 0;
}

/* The rotation (sign +1) or its transpose (sign -1, RoPE's backward). */
int df_cpu_rope_apply(df_backend *be, df_tensor *x, const int32_t *pos, int heads, int head_dim,
                      int rot_dim, double theta, float sign)
{
    int half = rot_dim / 2;
    float *inv_freq = malloc((size_t)half * sizeof(float));
    if (!inv_freq)
        return -ENOMEM;
    /* HF: inv_freq = 1 / theta ** (arange(0, rot, 2).float() / rot), all fp32. */
    float base = (float)theta;
    for (int d = 0; d < half; d++)
        inv_freq[d] = 1.0f / powf(base, (float)(2 * d) / (float)rot_dim);
    rope_ctx c = {x, pos, inv_freq, heads, head_dim, half, sign};
    int rc = par_rows(be, x->shape[0], (int64_t)heads * rot_dim * 2 + half * 40, rope_rows, &c);
    free(inv_freq);
    return rc;
}

int df_cpu_rope(df_backend *be, df_tensor *x, const int32_t *pos, int heads, int head_dim,
                int rot_dim, double theta)
{
    return df_cpu_rope_apply(be, x, pos, heads, head_dim, rot_dim, theta, 1.0f);
}

/* ---- attention ---- */

enum { ATT_RB = 16 }; /* query rows per task */

typedef struct att_block {
    int64_t r0, r1, start; /* query rows [r0, r1) of the sequence starting at start */
} att_block;

typedef struct att_ctx {
    const df_tensor *q, *k, *v, *gate;
    df_tensor *out;
    const att_block *blocks;
    int nkv, group, D;
    float scale;
    int64_t max_len;
} att_ctx;

/* One task: a block of query rows x one kv head (and its group of query heads).
 * Two passes per (row, head), as HF's eager path: scores = (q.k) * scale,
 * p = softmax in fp32 (max subtracted), out = sum_j p_j v_j. */
static int att_task(void *vp, size_t task)
{
    const att_ctx *c = vp;
    const att_block *b = &c->blocks[task / (size_t)c->nkv];
    int g = (int)(task % (size_t)c->nkv);
    int D = c->D;
    float *s = malloc((size_t)(c->max_len + D) * sizeof(float));
    if (!s)
        return -ENOMEM;
    float *acc = s + c->max_len;
    for (int64_t i = b->r0; i < b->r1; i++) {
        int64_t n = i - b->start + 1; /* keys start .. i */
        for (int hh = 0; hh < c->group; hh++) {
            int h = g * c->group + hh;
            const float *qi = (const float *)c->q->data + i * c->q->stride[0] + (int64_t)h * D;
            float mx = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                const float *kj = (const float *)c->k->data +
                                  (b->start + j) * c->k->stride[0] + (int64_t)g * D;
                s[j] = dot_f32(qi, kj, D) * c->scale;
                if (s[j] > mx)
                    mx = s[j];
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                s[j] = expf(s[j] - mx);
                sum += s[j];
            }
            for (int d = 0; d < D; d++)
                acc[d] = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                float p = s[j] / sum;
                const float *vj = (const float *)c->v->data +
                                  (b->start + j) * c->v->stride[0] + (int64_t)g * D;
                for (int d = 0; d < D; d++)
                    acc[d] += p * vj[d];
            }
            float *o = (float *)c->out->data + i * c->out->stride[0] + (int64_t)h * D;
            if (c->gate) {
                const float *gt =
                    (const float *)c->gate->data + i * c->gate->stride[0] + (int64_t)h * D;
                for (int d = 0; d < D; d++)
                    o[d] = acc[d] * sigmoidf_(gt[d]);
            } else {
                memcpy(o, acc, (size_t)D * sizeof(float));
            }
        }
    }
    free(s);
    return 0;
}

int df_cpu_attention(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
                     const int32_t *cu_seqlens, int n_seq, int nq, int nkv, int head_dim,
                     float scale, const df_tensor *gate, df_tensor *out)
{
    int64_t nblk = 0, max_len = 0;
    for (int s = 0; s < n_seq; s++) {
        int64_t len = cu_seqlens[s + 1] - cu_seqlens[s];
        nblk += (len + ATT_RB - 1) / ATT_RB;
        if (len > max_len)
            max_len = len;
    }
    if (nblk == 0)
        return 0;
    att_block *blocks = malloc((size_t)nblk * sizeof *blocks);
    if (!blocks)
        return -ENOMEM;
    int64_t bi = 0;
    for (int s = 0; s < n_seq; s++)
        for (int64_t r = cu_seqlens[s]; r < cu_seqlens[s + 1]; r += ATT_RB) {
            blocks[bi].r0 = r;
            blocks[bi].r1 = r + ATT_RB < cu_seqlens[s + 1] ? r + ATT_RB : cu_seqlens[s + 1];
            blocks[bi].start = cu_seqlens[s];
            bi++;
        }
    att_ctx c = {q, k, v, gate, out, blocks, nkv, nq / nkv, head_dim, scale, max_len};
    int rc = df_pool_for(be->pool, (size_t)(nblk * nkv), att_task, &c);
    free(blocks);
    return rc;
}
