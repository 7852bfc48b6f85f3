/* cpu/gdn.c - CPU reference of the Gated DeltaNet ops: causal depthwise
 * conv1d + SiLU, l2norm, the gates (beta, g) and the gated delta rule in
 * two modes (token-recurrent, the oracle; chunked, the GPU algorithm).
 *
 * All math in fp32. Work is split with be->pool into units whose results
 * do not depend on which thread runs them or how many threads there are
 * (every output element is computed by exactly one unit, with a fixed
 * summation order), so results are bitwise identical for any thread count.
 * Arguments were validated by kernels/ops_gdn.c. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend_internal.h"

#define ROW_BLOCK 32 /* rows per unit of work for the row-wise ops */
#define GDN_CHUNK 64 /* chunk length of DF_GDN_CHUNKED */

static inline float *row_ptr(const df_tensor *t, int64_t r)
{
    return (float *)t->data + r * t->stride[0];
}

static inline float silu_f(float x) { return x / (1.0f + expf(-x)); }

/* Dot product with 8 independent partial sums (vectorizable, fixed order). */
static inline float dot_f(const float *restrict a, const float *restrict b, int n)
{
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++)
            s[j] += a[i + j] * b[i + j];
    float r = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    for (; i < n; i++)
        r += a[i] * b[i];
    return r;
}

/* y += a * x */
static inline void axpy_f(float *restrict y, float a, const float *restrict x, int n)
{
    for (int i = 0; i < n; i++)
        y[i] += a * x[i];
}

/* Y[m][:N] += alpha * sum_{k < K} A(m, k) * B[k][:N] for m < M, with
 * A(m, k) = A[m * sam + k * sak] (so A may be a transposed view). With tri,
 * A is lower triangular (entries above the diagonal must read as zero) and
 * k stops at the diagonal block. Four rows
 * of Y at a time: each B row is loaded once per four outputs. The sum runs
 * over k in order for every element, whatever M: a fixed rounding. */
static void gemm_acc(float *Y, int64_t ldy, const float *A, int64_t sam, int64_t sak,
                     const float *B, int64_t ldb, int M, int K, int N, float alpha, int tri)
{
    int m = 0;
    for (; m + 4 <= M; m += 4) {
        int Kb = tri && m + 4 < K ? m + 4 : K;
        float *restrict y0 = Y + m * ldy, *restrict y1 = y0 + ldy;
        float *restrict y2 = y1 + ldy, *restrict y3 = y2 + ldy;
        for (int k = 0; k < Kb; k++) {
            const float *restrict b = B + k * ldb;
            float a0 = alpha * A[m * sam + k * sak], a1 = alpha * A[(m + 1) * sam + k * sak];
            float a2 = alpha * A[(m + 2) * sam + k * sak], a3 = alpha * A[(m + 3) * sam + k * sak];
            for (int n = 0; n < N; n++) {
                float bn = b[n];
                y0[n] += a0 * bn;
                y1[n] += a1 * bn;
                y2[n] += a2 * bn;
                y3[n] += a3 * bn;
            }
        }
    }
    for (; m < M; m++)
        for (int k = 0; k < (tri && m + 1 < K ? m + 1 : K); k++)
            axpy_f(Y + m * ldy, alpha * A[m * sam + k * sak], B + k * ldb, N);
}

/* Start of the packed sequence holding token t: cu[s] <= t < cu[s + 1]. */
static int64_t seq_start(const int32_t *cu, int n_seq, int64_t t)
{
    int lo = 0, hi = n_seq; /* cu[lo] <= t < cu[hi] */
    while (hi - lo > 1) {
        int mid = lo + (hi - lo) / 2;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    return cu[lo];
}

/* ---- conv1d + SiLU ---- */

struct conv_ctx {
    const df_tensor *x, *out;
    const float *wt; /* [K][C]: the weight transposed, as f32 */
    int64_t T, C;
    int K;
    const int32_t *cu;
    int n_seq;
};

static int conv_rows(void *arg, size_t blk)
{
    const struct conv_ctx *c = arg;
    int64_t C = c->C, t1 = (int64_t)(blk + 1) * ROW_BLOCK;
    if (t1 > c->T)
        t1 = c->T;
    for (int64_t t = (int64_t)blk * ROW_BLOCK; t < t1; t++) {
        int64_t s0 = seq_start(c->cu, c->n_seq, t);
        float *restrict o = row_ptr(c->out, t);
        for (int64_t ch = 0; ch < C; ch++)
            o[ch] = 0.0f;
        for (int k = 0; k < c->K; k++) {
            int64_t src = t - (c->K - 1) + k;
            if (src < s0) /* zero left padding at the sequence start */
                continue;
            const float *restrict xr = row_ptr(c->x, src);
            const float *restrict wk = c->wt + (int64_t)k * C;
            for (int64_t ch = 0; ch < C; ch++)
                o[ch] += wk[ch] * xr[ch];
        }
        for (int64_t ch = 0; ch < C; ch++)
            o[ch] = silu_f(o[ch]);
    }
    return 0;
}

int df_cpu_conv1d_silu(df_backend *be, const df_tensor *x, const df_tensor *w,
                       const int32_t *cu_seqlens, int n_seq, df_tensor *out)
{
    int64_t T = x->shape[0], C = x->shape[1];
    int K = (int)w->shape[1];
    if (T == 0 || C == 0)
        return 0;
    float *wt = malloc((size_t)(K * C) * sizeof(float));
    if (!wt)
        return -ENOMEM;
    for (int64_t ch = 0; ch < C; ch++)
        for (int k = 0; k < K; k++)
            wt[(int64_t)k * C + ch] = df_weight_at(w, ch * w->stride[0] + k);
    struct conv_ctx c = {x, out, wt, T, C, K, cu_seqlens, n_seq};
    int rc = df_pool_for(be->pool, (size_t)((T + ROW_BLOCK - 1) / ROW_BLOCK), conv_rows, &c);
    free(wt);
    return rc;
}

/* ---- l2norm ---- */

struct l2_ctx {
    const df_tensor *x;
    int64_t R, D;
    float eps, scale;
};

/* Row r of the outer dims of an N-d tensor (any outer strides). */
static float *nd_row(const df_tensor *t, int64_t r)
{
    int64_t off = 0;
    for (int d = t->ndim - 2; d >= 0; d--) {
        off += (r % t->shape[d]) * t->stride[d];
        r /= t->shape[d];
    }
    return (float *)t->data + off;
}

static int l2_rows(void *arg, size_t blk)
{
    const struct l2_ctx *c = arg;
    int64_t r1 = (int64_t)(blk + 1) * ROW_BLOCK;
    if (r1 > c->R)
        r1 = c->R;
    for (int64_t r = (int64_t)blk * ROW_BLOCK; r < r1; r++) {
        float *xr = nd_row(c->x, r);
        float inv = 1.0f / sqrtf(dot_f(xr, xr, (int)c->D) + c->eps);
        for (int64_t i = 0; i < c->D; i++)
            xr[i] = (xr[i] * inv) * c->scale; /* HF's order: l2norm, then * scale */
    }
    return 0;
}

int df_cpu_l2norm(df_backend *be, df_tensor *x, float eps, float scale)
{
    int64_t D = x->shape[x->ndim - 1], R = 1;
    for (int d = 0; d < x->ndim - 1; d++)
        R *= x->shape[d];
    if (R == 0 || D == 0)
        return 0;
    struct l2_ctx c = {x, R, D, eps, scale};
    return df_pool_for(be->pool, (size_t)((R + ROW_BLOCK - 1) / ROW_BLOCK), l2_rows, &c);
}

/* ---- gates ---- */

struct gates_ctx {
    const df_tensor *a, *b, *g, *beta;
    const float *neg_A, *dtb; /* -exp(A_log), dt_bias as f32 */
    int64_t T, H;
};

static inline float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static int gates_rows(void *arg, size_t blk)
{
    const struct gates_ctx *c = arg;
    int64_t t1 = (int64_t)(blk + 1) * ROW_BLOCK;
    if (t1 > c->T)
        t1 = c->T;
    for (int64_t t = (int64_t)blk * ROW_BLOCK; t < t1; t++) {
        const float *ar = row_ptr(c->a, t), *br = row_ptr(c->b, t);
        float *gr = row_ptr(c->g, t), *betar = row_ptr(c->beta, t);
        for (int64_t h = 0; h < c->H; h++) {
            float av = ar[h], bv = br[h]; /* both read before writing: g/beta may be a/b */
            betar[h] = 1.0f / (1.0f + expf(-bv));
            gr[h] = c->neg_A[h] * softplus_f(av + c->dtb[h]);
        }
    }
    return 0;
}

int df_cpu_gdn_gates(df_backend *be, const df_tensor *a, const df_tensor *b,
                     const df_tensor *A_log, const df_tensor *dt_bias, df_tensor *g,
                     df_tensor *beta)
{
    int64_t T = a->shape[0], H = a->shape[1];
    if (T == 0 || H == 0)
        return 0;
    float *p = malloc((size_t)(2 * H) * sizeof(float));
    if (!p)
        return -ENOMEM;
    for (int64_t h = 0; h < H; h++) {
        p[h] = -expf(df_weight_at(A_log, h));
        p[H + h] = df_weight_at(dt_bias, h);
    }
    struct gates_ctx c = {a, b, g, beta, p, p + H, T, H};
    int rc = df_pool_for(be->pool, (size_t)((T + ROW_BLOCK - 1) / ROW_BLOCK), gates_rows, &c);
    free(p);
    return rc;
}

/* ---- the gated delta rule ---- */

struct gdn_ctx {
    const df_tensor *q, *k, *v, *g, *beta, *out;
    const int32_t *cu;
    int hv, dk, dv, group; /* group = hv / hk */
};

/* Token by token, per (sequence, value head): the oracle.
 *   S = S * exp(g_t); kv = S^T k_t; delta = (v_t - kv) * beta_t;
 *   S += k_t delta^T; o_t = S^T q_t
 * S is [dk][dv] row-major, so every inner loop runs over dv contiguously. */
static int gdn_recurrent_unit(void *arg, size_t unit)
{
    const struct gdn_ctx *c = arg;
    int s = (int)(unit / (size_t)c->hv), h = (int)(unit % (size_t)c->hv);
    int kh = h / c->group, dk = c->dk, dv = c->dv;
    int64_t t0 = c->cu[s], t1 = c->cu[s + 1];
    if (t0 == t1)
        return 0;
    float *S = calloc((size_t)dk * dv + 2 * (size_t)dv, sizeof(float));
    if (!S)
        return -ENOMEM;
    float *kv = S + (size_t)dk * dv, *delta = kv + dv;
    for (int64_t t = t0; t < t1; t++) {
        const float *q = row_ptr(c->q, t) + (int64_t)kh * dk;
        const float *k = row_ptr(c->k, t) + (int64_t)kh * dk;
        const float *v = row_ptr(c->v, t) + (int64_t)h * dv;
        float eg = expf(row_ptr(c->g, t)[h]), b = row_ptr(c->beta, t)[h];
        float *o = row_ptr(c->out, t) + (int64_t)h * dv;
        for (int j = 0; j < dv; j++)
            kv[j] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *restrict Si = S + (size_t)i * dv;
            for (int j = 0; j < dv; j++)
                Si[j] *= eg;
            axpy_f(kv, k[i], Si, dv);
        }
        for (int j = 0; j < dv; j++)
            delta[j] = (v[j] - kv[j]) * b;
        for (int j = 0; j < dv; j++)
            o[j] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *restrict Si = S + (size_t)i * dv;
            axpy_f(Si, k[i], delta, dv);
            axpy_f(o, q[i], Si, dv);
        }
    }
    free(S);
    return 0;
}

/* Chunks of C = 64 tokens within each sequence (the last one may be
 * shorter), per (sequence, value head). With Gamma = in-chunk cumsum of g
 * (all exponents below are <= 0: pairs i < j are never exponentiated):
 *   A_ij = beta_i (k_i.k_j) e^{Gamma_i - Gamma_j} (i > j), T = (I + A)^-1
 *   W = T diag(beta e^Gamma) K,  U = T diag(beta) V
 *   P_ij = (q_i.k_j) e^{Gamma_i - Gamma_j} (i >= j)
 * then the sequential state pass:
 *   V_new = U - W S;  O = diag(e^Gamma) Q S + P V_new
 *   S = e^{Gamma_last} S + (diag(e^{Gamma_last - Gamma}) K)^T V_new
 * The chunk-local part (A, T, W, U, P) does not depend on S; it is done
 * chunk by chunk just before that chunk's state step (same math as doing all
 * chunks first, less scratch memory). */
struct gdn_scratch {
    float *Qc, *Kc;  /* [C][dk] the chunk's q, k rows, contiguous */
    float *A, *Tm, *P; /* [C][C] */
    float *W;        /* [C][dk] */
    float *U;        /* [C][dv]: U, then V_new in place */
    float *X;        /* [C][max(dk, dv)]: diag(.) K, diag(.) V */
    float *S;        /* [dk][dv] */
    float *G, *eG, *bet; /* [C] */
};

static void gdn_chunk(const struct gdn_ctx *c, struct gdn_scratch *w, int h, int64_t t0, int L)
{
    const int kh = h / c->group, dk = c->dk, dv = c->dv, C = GDN_CHUNK;
    float *Qc = w->Qc, *Kc = w->Kc, *A = w->A, *Tm = w->Tm, *P = w->P;
    float *W = w->W, *U = w->U, *X = w->X, *S = w->S, *G = w->G, *eG = w->eG, *bet = w->bet;

    /* Gamma, beta, and the chunk's q and k rows. */
    float acc = 0.0f;
    for (int i = 0; i < L; i++) {
        acc += row_ptr(c->g, t0 + i)[h];
        G[i] = acc;
        eG[i] = expf(acc);
        bet[i] = row_ptr(c->beta, t0 + i)[h];
        memcpy(Qc + (size_t)i * dk, row_ptr(c->q, t0 + i) + (int64_t)kh * dk, (size_t)dk * sizeof(float));
        memcpy(Kc + (size_t)i * dk, row_ptr(c->k, t0 + i) + (int64_t)kh * dk, (size_t)dk * sizeof(float));
    }

    /* A (strictly lower) and P (lower incl. the diagonal); masked entries
     * are never computed (so no exp of a positive exponent) and read as 0. */
    for (int i = 0; i < L; i++) {
        const float *ki = Kc + (size_t)i * dk, *qi = Qc + (size_t)i * dk;
        float *Ai = A + (size_t)i * C, *Pi = P + (size_t)i * C;
        for (int j = 0; j < i; j++) {
            float d = expf(G[i] - G[j]);
            const float *kj = Kc + (size_t)j * dk;
            Ai[j] = bet[i] * dot_f(ki, kj, dk) * d;
            Pi[j] = dot_f(qi, kj, dk) * d;
        }
        Pi[i] = dot_f(qi, ki, dk);
        for (int j = i + 1; j < L; j++)
            Pi[j] = 0.0f;
    }

    /* T = (I + A)^-1 by forward substitution, row by row:
     * T[i, :] = e_i - sum_{m < i} A[i, m] T[m, :] (T[m, j] = 0 for j > m). */
    for (int i = 0; i < L; i++) {
        float *Ti = Tm + (size_t)i * C;
        for (int j = 0; j < L; j++)
            Ti[j] = 0.0f;
        for (int m = 0; m < i; m++)
            axpy_f(Ti, -A[(size_t)i * C + m], Tm + (size_t)m * C, m + 1);
        Ti[i] = 1.0f;
    }

    /* W = T diag(beta e^Gamma) K */
    for (int j = 0; j < L; j++) {
        float sc = bet[j] * eG[j];
        for (int e = 0; e < dk; e++)
            X[(size_t)j * dk + e] = Kc[(size_t)j * dk + e] * sc;
    }
    memset(W, 0, (size_t)L * dk * sizeof(float));
    gemm_acc(W, dk, Tm, C, 1, X, dk, L, L, dk, 1.0f, 1);
    /* U = T diag(beta) V */
    for (int j = 0; j < L; j++) {
        const float *vj = row_ptr(c->v, t0 + j) + (int64_t)h * dv;
        for (int e = 0; e < dv; e++)
            X[(size_t)j * dv + e] = vj[e] * bet[j];
    }
    memset(U, 0, (size_t)L * dv * sizeof(float));
    gemm_acc(U, dv, Tm, C, 1, X, dv, L, L, dv, 1.0f, 1);

    /* The state pass. V_new = U - W S (in place in U). */
    gemm_acc(U, dv, W, dk, 1, S, dv, L, dk, dv, -1.0f, 0);
    /* O = diag(e^Gamma) Q S + P V_new, written straight into out */
    float *O = row_ptr(c->out, t0) + (int64_t)h * dv;
    int64_t ldo = c->out->stride[0];
    for (int i = 0; i < L; i++) {
        for (int e = 0; e < dk; e++)
            Qc[(size_t)i * dk + e] *= eG[i];
        for (int e = 0; e < dv; e++)
            O[i * ldo + e] = 0.0f;
    }
    gemm_acc(O, ldo, Qc, dk, 1, S, dv, L, dk, dv, 1.0f, 0);
    gemm_acc(O, ldo, P, C, 1, U, dv, L, L, dv, 1.0f, 1);
    /* S = e^{Gamma_last} S + (diag(e^{Gamma_last - Gamma}) K)^T V_new */
    float eL = eG[L - 1];
    for (int j = 0; j < L; j++) {
        float sc = expf(G[L - 1] - G[j]);
        for (int e = 0; e < dk; e++)
            X[(size_t)j * dk + e] = Kc[(size_t)j * dk + e] * sc;
    }
    for (size_t e = 0; e < (size_t)dk * dv; e++)
        S[e] *= eL;
    gemm_acc(S, dv, X, 1, dk, U, dv, dk, L, dv, 1.0f, 0);
}

static int gdn_chunked_unit(void *arg, size_t unit)
{
    const struct gdn_ctx *c = arg;
    int s = (int)(unit / (size_t)c->hv), h = (int)(unit % (size_t)c->hv);
    int64_t t0 = c->cu[s], t1 = c->cu[s + 1];
    if (t0 == t1)
        return 0;
    size_t C = GDN_CHUNK, dk = (size_t)c->dk, dv = (size_t)c->dv, dm = dk > dv ? dk : dv;
    size_t n = 2 * C * dk + 3 * C * C + C * dk + C * dv + C * dm + dk * dv + 3 * C;
    float *buf = calloc(n, sizeof(float));
    if (!buf)
        return -ENOMEM;
    struct gdn_scratch w;
    float *p = buf;
    w.Qc = p, p += C * dk;
    w.Kc = p, p += C * dk;
    w.A = p, p += C * C;
    w.Tm = p, p += C * C;
    w.P = p, p += C * C;
    w.W = p, p += C * dk;
    w.U = p, p += C * dv;
    w.X = p, p += C * dm;
    w.S = p, p += dk * dv; /* zero: calloc */
    w.G = p, p += C;
    w.eG = p, p += C;
    w.bet = p;
    for (int64_t t = t0; t < t1; t += GDN_CHUNK) {
        int L = (int)(t1 - t < GDN_CHUNK ? t1 - t : GDN_CHUNK);
        gdn_chunk(c, &w, h, t, L);
    }
    free(buf);
    return 0;
}

int df_cpu_gdn(df_backend *be, const df_tensor *q, const df_tensor *k, const df_tensor *v,
               const df_tensor *g, const df_tensor *beta, const int32_t *cu_seqlens, int n_seq,
               int hk, int hv, int dk, int dv, df_gdn_mode mode, df_tensor *out)
{
    struct gdn_ctx c = {q, k, v, g, beta, out, cu_seqlens, hv, dk, dv, hv / hk};
    size_t units = (size_t)n_seq * (size_t)hv;
    if (units == 0)
        return 0;
    return df_pool_for(be->pool, units,
                       mode == DF_GDN_CHUNKED ? gdn_chunked_unit : gdn_recurrent_unit, &c);
}
