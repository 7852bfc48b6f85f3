/* train_dense.c - the CPU reference for the backward passes of the dense ops,
 * AdamW and the sum of squares (contracts in train_ops.h). The blocked GEMM
 * the backward matmuls use is kernels/cpu/gemm.c.
 *
 * fp32 math (reductions that feed one scalar per row in double where noted).
 * Work is split over be->pool in pieces whose boundaries depend only on the
 * shapes, or (the GEMM, whose per-element order does not depend on the
 * tiling) on anything at all; every output element is computed by one piece
 * in a fixed order. Sums over rows (weight gradients, sumsq) go through
 * per-piece partials of fixed extent, combined in piece order. Results are
 * bitwise identical for any thread count. Arguments were validated by
 * kernels/train_ops.c. */
#include "train_internal.h"

#include "bf16_sr.h"
#include "uf16.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ---- */

typedef int (*range_fn)(void *ctx, int64_t i, int64_t r0, int64_t r1);

typedef struct range_job {
    range_fn fn;
    void *ctx;
    int64_t n, chunk;
} range_job;

static int range_task(void *arg, size_t i)
{
    const range_job *j = arg;
    int64_t r0 = (int64_t)i * j->chunk;
    int64_t r1 = r0 + j->chunk < j->n ? r0 + j->chunk : j->n;
    return j->fn(j->ctx, (int64_t)i, r0, r1);
}

/* fn(ctx, piece, r0, r1) over [0, n) in pieces of chunk items: piece i is
 * [i*chunk, (i+1)*chunk), whatever the thread count. */
static int par_range(df_backend *be, int64_t n, int64_t chunk, range_fn fn, void *ctx)
{
    if (n <= 0)
        return 0;
    if (chunk < 1)
        chunk = 1;
    range_job j = {fn, ctx, n, chunk};
    return df_pool_for(be->pool, (size_t)((n + chunk - 1) / chunk), range_task, &j);
}

static int64_t n_pieces(int64_t n, int64_t chunk)
{
    return n > 0 ? (n + chunk - 1) / chunk : 0;
}

/* ---- matmul backward ---- */

/* dx[M, K] (+)= dy[M, N] @ w[N, K]: A = dy as is, B = w as is (rows of w are
 * rows of B: no transposition anywhere). */
int df_cpu_matmul_bwd_x(df_backend *be, const df_tensor *dy, const df_tensor *w, df_tensor *dx,
                        int accumulate)
{
    df_gemm g;
    memset(&g, 0, sizeof g);
    g.a.data = dy->data;
    g.a.ld = dy->stride[0];
    g.b.data = w->data;
    g.b.dtype = w->dtype;
    g.b.ld = w->stride[0];
    g.c.data = dx->data;
    g.c.ld = dx->stride[0];
    g.c.accumulate = accumulate;
    g.K = dy->shape[1];
    g.kern = df_gemm_pick_kernel();
    return df_gemm_par(be, &g, dx->shape[0], dx->shape[1]);
}

/* A BF16 dw: the GEMM below (the F32 path's, so each element is the very
 * same fp32 sum) writes a slab of dw's rows as f32 into a buffer, then each
 * element becomes RNE(sum) or RNE(sum + widened old) (the fp32 add the
 * F32 path does last): one rounding to bf16. The GEMM's per-element order
 * does not depend on which rows share a call, so the slabs (which only
 * bound the buffer, ~4 MiB) change no bit. */
static int mm_bwd_w_bf16(df_backend *be, const df_gemm *g0, const df_tensor *dw, int accumulate)
{
    const int64_t N = dw->shape[0], K = dw->shape[1];
    if (N == 0 || K == 0)
        return 0;
    int64_t slab = ((int64_t)1 << 20) / K;
    if (slab < 1)
        slab = 1;
    if (slab > N)
        slab = N;
    float *tmp = malloc((size_t)(slab * K) * sizeof(float));
    if (!tmp)
        return -ENOMEM;
    int rc = 0;
    for (int64_t n0 = 0; n0 < N && rc == 0; n0 += slab) {
        const int64_t rows = N - n0 < slab ? N - n0 : slab;
        df_gemm g = *g0;
        g.a.data = g0->a.data + n0; /* A = dy^T: its row n is dy's column n */
        g.c.data = tmp;
        g.c.ld = K;
        g.c.accumulate = 0;
        rc = df_gemm_par(be, &g, rows, K);
        for (int64_t r = 0; rc == 0 && r < rows; r++) {
            uint16_t *o = (uint16_t *)dw->data + (n0 + r) * dw->stride[0];
            const float *t = tmp + r * K;
            if (accumulate)
                for (int64_t k = 0; k < K; k++)
                    o[k] = df_f32_to_bf16(t[k] + df_bf16_to_f32(o[k]));
            else
                for (int64_t k = 0; k < K; k++)
                    o[k] = df_f32_to_bf16(t[k]);
        }
    }
    free(tmp);
    return rc;
}

/* dw[N, K] (+)= dy^T[N, M] @ x[M, K]: A = dy transposed (packed per slice),
 * B = x as is. Each dw element is one fp32 sum over the M rows in order
 * (then, for a BF16 dw, rounded once: mm_bwd_w_bf16). */
int df_cpu_matmul_bwd_w(df_backend *be, const df_tensor *dy, const df_tensor *x, df_tensor *dw,
                        int accumulate)
{
    df_gemm g;
    memset(&g, 0, sizeof g);
    g.a.data = dy->data;
    g.a.ld = dy->stride[0];
    g.a.trans = 1;
    g.b.data = x->data;
    g.b.dtype = DF_DTYPE_F32;
    g.b.ld = x->stride[0];
    g.K = dy->shape[0];
    g.kern = df_gemm_pick_kernel();
    if (dw->dtype == DF_DTYPE_BF16)
        return mm_bwd_w_bf16(be, &g, dw, accumulate);
    g.c.data = dw->data;
    g.c.ld = dw->stride[0];
    g.c.accumulate = accumulate;
    return df_gemm_par(be, &g, dw->shape[0], dw->shape[1]);
}

/* ---- RMSNorm backward ----
 *
 * y = g * xhat, xhat = x * r, r = 1/sqrt(mean(x^2) + eps), g = w or 1 + w:
 *   dx = r * (g*dy - xhat * c),  c = mean(g*dy * xhat)
 *   dw += sum over rows of dy * xhat
 * r exactly as the forward computes it (fp32, 8 interleaved partial sums);
 * c in double. dw: rows go in pieces of a fixed size (by D alone); each
 * piece sums its rows in order into its own f32 partial, the partials are
 * added in piece order, and the total is added to dw (in fp32; a BF16 dw
 * is widened, and the f32 result rounded once to bf16). */

typedef struct nbwd_ctx {
    const df_tensor *x, *w, *dy;
    df_tensor *dx;
    float eps;
    int plus_one, accumulate_dx;
    float *partial; /* [pieces][D] */
} nbwd_ctx;

static int nbwd_piece(void *vp, int64_t piece, int64_t r0, int64_t r1)
{
    const nbwd_ctx *c = vp;
    int64_t D = row_len(c->x);
    float *g = malloc((size_t)D * 2 * sizeof(float));
    if (!g)
        return -ENOMEM;
    float *xh = g + D;
    weight_to_f32(c->w->data, c->w->dtype, D, g);
    if (c->plus_one)
        for (int64_t i = 0; i < D; i++)
            g[i] = 1.0f + g[i];
    float *pw = c->partial + piece * D;
    for (int64_t i = 0; i < D; i++)
        pw[i] = 0.0f;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = row_ptr(c->x, r), *dy = row_ptr(c->dy, r);
        float inv = 1.0f / sqrtf(df_sumsq_f32(x, D) / (float)D + c->eps);
        double s = 0.0;
        for (int64_t i = 0; i < D; i++) {
            xh[i] = x[i] * inv;
            s += (double)(g[i] * dy[i]) * xh[i];
        }
        float cm = (float)(s / (double)D);
        for (int64_t i = 0; i < D; i++)
            pw[i] += dy[i] * xh[i];
        if (c->dx) {
            float *dx = row_ptr(c->dx, r); /* may be dy's or x's very view: read first */
            if (c->accumulate_dx)
                for (int64_t i = 0; i < D; i++)
                    dx[i] = inv * (g[i] * dy[i] - xh[i] * cm) + dx[i];
            else
                for (int64_t i = 0; i < D; i++)
                    dx[i] = inv * (g[i] * dy[i] - xh[i] * cm);
        }
    }
    free(g);
    return 0;
}

int df_cpu_rmsnorm_bwd(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                       int plus_one, const df_tensor *dy, df_tensor *dx, int accumulate_dx,
                       df_tensor *dw)
{
    int64_t D = row_len(x), R = D ? n_rows(x) : 0;
    if (R == 0)
        return 0;
    /* about 64K elements per piece, at least 64 rows: the partials stay a
     * small fraction of x. */
    int64_t chunk = ((int64_t)1 << 16) / D;
    if (chunk < 64)
        chunk = 64;
    int64_t np = n_pieces(R, chunk);
    float *partial = malloc((size_t)(np * D) * sizeof(float));
    if (!partial)
        return -ENOMEM;
    nbwd_ctx c = {x, w, dy, dx, eps, plus_one != 0, accumulate_dx != 0, partial};
    int rc = par_range(be, R, chunk, nbwd_piece, &c);
    if (rc == 0) {
        float *out = dw->data; /* dw is 1-D: innermost stride 1 */
        uint16_t *out_bf = dw->data;
        for (int64_t i = 0; i < D; i++) {
            float s = partial[i];
            for (int64_t p = 1; p < np; p++)
                s += partial[p * D + i];
            if (dw->dtype == DF_DTYPE_BF16)
                out_bf[i] = df_f32_to_bf16(s + df_bf16_to_f32(out_bf[i]));
            else
                out[i] = s + out[i];
        }
    }
    free(partial);
    return rc;
}

/* ---- RoPE backward: the transposed rotation, by the forward's code ---- */

int df_cpu_rope_bwd(df_backend *be, df_tensor *dx, const int32_t *pos, int heads, int head_dim,
                    int rot_dim, double theta)
{
    return df_cpu_rope_apply(be, dx, pos, heads, head_dim, rot_dim, theta, -1.0f);
}

/* ---- SwiGLU backward ----
 * s = sigmoid(g): dup = dout * silu(g) (silu exactly as the forward),
 * dgate = dout * up * s * (1 + g * (1 - s)). For g -> -inf, s = 0 and the
 * bracket stays finite: 0, never NaN; for g -> +inf, s = 1: the bracket is 1. */

typedef struct sw_ctx {
    const df_tensor *gate, *up, *dout;
    df_tensor *dgate, *dup;
} sw_ctx;

static int sw_rows(void *vp, int64_t piece, int64_t r0, int64_t r1)
{
    const sw_ctx *c = vp;
    int64_t n = row_len(c->dgate);
    for (int64_t r = r0; r < r1; r++) {
        const float *g = row_ptr(c->gate, r), *u = row_ptr(c->up, r), *d = row_ptr(c->dout, r);
        float *dg = row_ptr(c->dgate, r), *du = row_ptr(c->dup, r);
        for (int64_t i = 0; i < n; i++) {
            /* all three read before either write: in place is fine */
            float gi = g[i], ui = u[i], di = d[i];
            float e = expf(-gi);
            float s = 1.0f / (1.0f + e), silu = gi / (1.0f + e);
            dg[i] = di * ui * (s * (1.0f + gi * (1.0f - s)));
            du[i] = di * silu;
        }
    }
    return 0;
}

int df_cpu_swiglu_bwd(df_backend *be, const df_tensor *gate, const df_tensor *up,
                      const df_tensor *dout, df_tensor *dgate, df_tensor *dup)
{
    sw_ctx c = {gate, up, dout, dgate, dup};
    int64_t n = row_len(dgate);
    if (n == 0)
        return 0;
    int64_t chunk = ((int64_t)1 << 16) / (n * 12);
    return par_range(be, n_rows(dgate), chunk, sw_rows, &c);
}

/* The hints (codes kept for FP8 GEMMs) are for backends with E4M3 tensor cores: none here. */
int df_cpu_swiglu_fp8(df_backend *be, const df_tensor *gate, const df_tensor *up, df_tensor *out,
                      unsigned flags)
{
    (void)flags;
    return df_cpu_swiglu(be, gate, up, out);
}

/* The hint's codes are for backends with E4M3 tensor cores: none here. */
int df_cpu_fp8_dy_codes(df_backend *be, const df_tensor *dy, unsigned flags)
{
    (void)be, (void)dy, (void)flags;
    return 0;
}

int df_cpu_rmsnorm_fp8(df_backend *be, const df_tensor *x, const df_tensor *w, float eps, df_tensor *y,
                       int uses, unsigned flags)
{
    (void)uses, (void)flags;
    return df_cpu_rmsnorm(be, x, w, eps, 0, y);
}

int df_cpu_swiglu_bwd_fp8(df_backend *be, const df_tensor *gate, const df_tensor *up,
                          const df_tensor *dout, df_tensor *dgate, df_tensor *dup, unsigned flags)
{
    (void)flags;
    return df_cpu_swiglu_bwd(be, gate, up, dout, dgate, dup);
}

/* ---- AdamW ----
 * Per element in fp32, as a fused GPU kernel would:
 *   g = grad * grad_scale   (a BF16 grad widened exactly first)
 *   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
 *   p = p - lr * (m / bc1 / (sqrt(v / bc2) + eps) + wd p)
 * bc1 = 1 - b1^t, bc2 = 1 - b2^t and 1 - b1, 1 - b2 computed in double, then
 * rounded to f32 once. out_bf16 = RNE(p). 16-bit moments (adamw_m16: m in
 * BF16, v in BF16 or UF16 unless it is F32): read widened exactly, stored
 * rounded stochastically (bf16_sr.h, uf16.h) with the bits of
 * df_sr_bits(key, index0 + i): m with the low 16, v with the next 16. */

typedef struct adam_ctx {
    float *p, *m, *v;       /* m, v: F32 moments, or NULL */
    uint16_t *m16, *v16;    /* 16-bit moments, or NULL */
    int vuf;                /* v16 holds UF16 (else BF16) */
    const float *g;     /* F32 grad, or NULL */
    const uint16_t *gb; /* BF16 grad, or NULL */
    uint16_t *out;
    float b1, b2, omb1, omb2, bc1, bc2, lr, eps, wd, gs;
    uint64_t key;
    int64_t i0;
} adam_ctx;

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static int adam_piece(void *vp, int64_t piece, int64_t i0, int64_t i1)
{
    const adam_ctx *c = vp;
    for (int64_t i = i0; i < i1; i++) {
        float g = (c->gb ? df_bf16_to_f32(c->gb[i]) : c->g[i]) * c->gs;
        float m0 = c->m16 ? df_bf16_to_f32(c->m16[i]) : c->m[i];
        float v0 = !c->v16 ? c->v[i] : c->vuf ? df_uf16_to_f32(c->v16[i]) : df_bf16_to_f32(c->v16[i]);
        float m = c->b1 * m0 + c->omb1 * g;
        float v = c->b2 * v0 + c->omb2 * (g * g);
        float p = c->p[i];
        float upd = (m / c->bc1) / (sqrtf(v / c->bc2) + c->eps) + c->wd * p;
        p = p - c->lr * upd;
        uint64_t r = c->m16 ? df_sr_bits(c->key, (uint64_t)(c->i0 + i)) : 0;
        if (c->m16)
            c->m16[i] = df_bf16_sr(f32_bits(m), (uint32_t)r);
        else
            c->m[i] = m;
        if (c->v16)
            c->v16[i] = c->vuf ? df_uf16_sr(f32_bits(v), (uint32_t)(r >> 16))
                               : df_bf16_sr(f32_bits(v), (uint32_t)(r >> 16));
        else
            c->v[i] = v;
        c->p[i] = p;
        if (c->out)
            c->out[i] = df_f32_to_bf16(p);
    }
    return 0;
}

int df_cpu_adamw(df_backend *be, float *master, const void *grad, df_dtype grad_dtype, float *m,
                 float *v, int64_t n, float lr, float beta1, float beta2, float eps, float wd,
                 int64_t step, float grad_scale, uint16_t *out_bf16)
{
    const int bf = grad_dtype == DF_DTYPE_BF16;
    adam_ctx c = {master, m, v, NULL, NULL, 0, bf ? NULL : (const float *)grad,
                  bf ? (const uint16_t *)grad : NULL, out_bf16, beta1, beta2,
                  (float)(1.0 - (double)beta1), (float)(1.0 - (double)beta2),
                  (float)(1.0 - pow((double)beta1, (double)step)),
                  (float)(1.0 - pow((double)beta2, (double)step)), lr, eps, wd, grad_scale, 0, 0};
    return par_range(be, n, (int64_t)1 << 15, adam_piece, &c);
}

int df_cpu_adamw_m16(df_backend *be, float *master, const void *grad, df_dtype grad_dtype,
                     uint16_t *m, void *v, df_dtype v_dtype, int64_t n, float lr, float beta1,
                     float beta2, float eps, float wd, int64_t step, float grad_scale,
                     uint64_t key, int64_t index0, uint16_t *out_bf16)
{
    const int bf = grad_dtype == DF_DTYPE_BF16, v16 = v_dtype != DF_DTYPE_F32;
    adam_ctx c = {master, NULL, v16 ? NULL : (float *)v, m, v16 ? (uint16_t *)v : NULL,
                  v_dtype == DF_DTYPE_UF16,
                  bf ? NULL : (const float *)grad,
                  bf ? (const uint16_t *)grad : NULL, out_bf16, beta1, beta2,
                  (float)(1.0 - (double)beta1), (float)(1.0 - (double)beta2),
                  (float)(1.0 - pow((double)beta1, (double)step)),
                  (float)(1.0 - pow((double)beta2, (double)step)), lr, eps, wd, grad_scale, key,
                  index0};
    return par_range(be, n, (int64_t)1 << 15, adam_piece, &c);
}

/* ---- sum of squares ----
 * Pieces of 64K elements, each summed in double with 4 interleaved partials
 * (combined (p0 + p2) + (p1 + p3)), the piece sums added in piece order.
 * A BF16 array is widened exactly, element by element, in that same order:
 * the same bits as the F32 array of its values. */

enum { SUMSQ_CHUNK = 1 << 16 };

typedef struct ssq_ctx {
    const float *x;     /* F32, or NULL */
    const uint16_t *xb; /* BF16, or NULL */
    double *piece_sum;
} ssq_ctx;

static inline double ssq_at(const ssq_ctx *c, int64_t i)
{
    return c->xb ? (double)df_bf16_to_f32(c->xb[i]) : (double)c->x[i];
}

static int ssq_piece(void *vp, int64_t piece, int64_t i0, int64_t i1)
{
    const ssq_ctx *c = vp;
    double p[4] = {0, 0, 0, 0};
    int64_t i = i0;
    for (; i + 4 <= i1; i += 4)
        for (int j = 0; j < 4; j++) {
            double e = ssq_at(c, i + j);
            p[j] += e * e;
        }
    for (; i < i1; i++) {
        double e = ssq_at(c, i);
        p[i & 3] += e * e;
    }
    c->piece_sum[piece] = (p[0] + p[2]) + (p[1] + p[3]);
    return 0;
}

double df_cpu_sumsq(df_backend *be, const void *x, df_dtype dtype, int64_t n)
{
    int64_t np = n_pieces(n, SUMSQ_CHUNK);
    if (np == 0)
        return 0.0;
    double *ps = malloc((size_t)np * sizeof(double));
    if (!ps)
        return (double)-ENOMEM;
    const int bf = dtype == DF_DTYPE_BF16;
    ssq_ctx c = {bf ? NULL : (const float *)x, bf ? (const uint16_t *)x : NULL, ps};
    int rc = par_range(be, n, SUMSQ_CHUNK, ssq_piece, &c);
    double s = 0.0;
    for (int64_t i = 0; i < np; i++)
        s += ps[i];
    free(ps);
    return rc < 0 ? (double)rc : s;
}
