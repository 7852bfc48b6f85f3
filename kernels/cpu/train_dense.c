/* train_dense.c - the CPU reference for the backward passes of the dense ops,
 * AdamW and the sum of squares (contracts in train_ops.h), and the blocked
 * GEMM they share with the fused LM-head CE (kernels/cpu/lmhead_ce.c).
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

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DF_X86_SIMD 1
#endif

/* ---- helpers ---- */

/* n consecutive weight elements (BF16/F16/F32) at p, as f32. */
static void weight_to_f32(const void *p, df_dtype t, int64_t n, float *out)
{
    if (t == DF_DTYPE_F32) {
        memcpy(out, p, (size_t)n * 4);
    } else if (t == DF_DTYPE_BF16) {
        const uint16_t *h = p;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)h[i] << 16;
            memcpy(&out[i], &u, 4);
        }
    } else {
        const uint16_t *h = p;
        for (int64_t i = 0; i < n; i++)
            out[i] = df_f16_to_f32(h[i]);
    }
}

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

/* Rows of an N-D tensor: every index of the outer dims, the last dim contiguous. */
static int64_t n_rows(const df_tensor *t)
{
    int64_t n = 1;
    for (int d = 0; d < t->ndim - 1; d++)
        n *= t->shape[d];
    return n;
}

static float *row_ptr(const df_tensor *t, int64_t r)
{
    int64_t off = 0;
    for (int d = t->ndim - 2; d >= 0; d--) {
        off += (r % t->shape[d]) * t->stride[d];
        r /= t->shape[d];
    }
    return (float *)t->data + off;
}

static int64_t row_len(const df_tensor *t)
{
    return t->shape[t->ndim - 1];
}

/* ---- GEMM: C[M, N] (+)= A[M, K] @ B[K, N] ----
 *
 * The forward matmul's scheme (kernels/cpu/dense.c) generalized to the
 * operand layouts the backward passes need. A block is up to GM rows x GN
 * columns of C; it walks K in slices of KC: A's slice is used in place (or
 * packed, when A is transposed), B's slice is converted to f32 once per NT
 * columns into NT/NR column panels [KC][NR], and an MR x NR register-tile
 * kernel accumulates the block's f32 tile. The finished tile is stored, or
 * added to C last. */
enum { MR = 6, NR = 16, NT = 64, KC = 256, GM = 32 * MR, GN = 8 * NT };

static void kern_c(int64_t kc, const float *const *a, const float *b, float *c, int64_t ldc,
                   int zero)
{
    float acc[MR][NR];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++)
            acc[r][j] = zero ? 0.0f : c[r * ldc + j];
    for (int64_t k = 0; k < kc; k++) {
        const float *bk = b + k * NR;
        for (int r = 0; r < MR; r++) {
            float av = a[r][k];
            for (int j = 0; j < NR; j++)
                acc[r][j] += av * bk[j];
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++)
            c[r * ldc + j] = acc[r][j];
}

#ifdef DF_X86_SIMD
/* AVX2 + FMA: 12 accumulators of 8 lanes, two panel loads and six
 * broadcasts per k (the forward matmul's kernel with a C row stride). */
__attribute__((target("avx2,fma"))) static void kern_avx2(int64_t kc, const float *const *a,
                                                           const float *b, float *c,
                                                           int64_t ldc, int zero)
{
    __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
    if (zero) {
        c00 = c01 = c10 = c11 = c20 = c21 = _mm256_setzero_ps();
        c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
    } else {
        c00 = _mm256_loadu_ps(c + 0 * ldc), c01 = _mm256_loadu_ps(c + 0 * ldc + 8);
        c10 = _mm256_loadu_ps(c + 1 * ldc), c11 = _mm256_loadu_ps(c + 1 * ldc + 8);
        c20 = _mm256_loadu_ps(c + 2 * ldc), c21 = _mm256_loadu_ps(c + 2 * ldc + 8);
        c30 = _mm256_loadu_ps(c + 3 * ldc), c31 = _mm256_loadu_ps(c + 3 * ldc + 8);
        c40 = _mm256_loadu_ps(c + 4 * ldc), c41 = _mm256_loadu_ps(c + 4 * ldc + 8);
        c50 = _mm256_loadu_ps(c + 5 * ldc), c51 = _mm256_loadu_ps(c + 5 * ldc + 8);
    }
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];
    for (int64_t k = 0; k < kc; k++) {
        __m256 b0 = _mm256_load_ps(b + k * NR), b1 = _mm256_load_ps(b + k * NR + 8);
        __m256 av = _mm256_broadcast_ss(a0 + k);
        c00 = _mm256_fmadd_ps(av, b0, c00), c01 = _mm256_fmadd_ps(av, b1, c01);
        av = _mm256_broadcast_ss(a1 + k);
        c10 = _mm256_fmadd_ps(av, b0, c10), c11 = _mm256_fmadd_ps(av, b1, c11);
        av = _mm256_broadcast_ss(a2 + k);
        c20 = _mm256_fmadd_ps(av, b0, c20), c21 = _mm256_fmadd_ps(av, b1, c21);
        av = _mm256_broadcast_ss(a3 + k);
        c30 = _mm256_fmadd_ps(av, b0, c30), c31 = _mm256_fmadd_ps(av, b1, c31);
        av = _mm256_broadcast_ss(a4 + k);
        c40 = _mm256_fmadd_ps(av, b0, c40), c41 = _mm256_fmadd_ps(av, b1, c41);
        av = _mm256_broadcast_ss(a5 + k);
        c50 = _mm256_fmadd_ps(av, b0, c50), c51 = _mm256_fmadd_ps(av, b1, c51);
    }
    _mm256_storeu_ps(c + 0 * ldc, c00), _mm256_storeu_ps(c + 0 * ldc + 8, c01);
    _mm256_storeu_ps(c + 1 * ldc, c10), _mm256_storeu_ps(c + 1 * ldc + 8, c11);
    _mm256_storeu_ps(c + 2 * ldc, c20), _mm256_storeu_ps(c + 2 * ldc + 8, c21);
    _mm256_storeu_ps(c + 3 * ldc, c30), _mm256_storeu_ps(c + 3 * ldc + 8, c31);
    _mm256_storeu_ps(c + 4 * ldc, c40), _mm256_storeu_ps(c + 4 * ldc + 8, c41);
    _mm256_storeu_ps(c + 5 * ldc, c50), _mm256_storeu_ps(c + 5 * ldc + 8, c51);
}
#endif

df_gemm_kern df_gemm_pick_kernel(void)
{
    const char *env = getenv("DFLASH_CPU_SIMD");
    if (env && env[0] == '0')
        return kern_c;
#ifdef DF_X86_SIMD
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return kern_avx2;
#endif
    return kern_c;
}

/* Scratch for blocks of up to GM x GN: the f32 tile, B's panels, A's packed
 * slice (transposed A only) and a conversion row. 64-byte aligned: the
 * kernel's panel loads are aligned. */
typedef struct gemm_ws {
    float *tile, *panel, *apack, *row;
} gemm_ws;

static void ws_free(gemm_ws *w)
{
    free(w->tile);
    free(w->panel);
    free(w->apack);
    free(w->row);
}

static int ws_alloc(gemm_ws *w, int64_t mt, int64_t nc, int trans_a)
{
    int64_t mt_pad = (mt + MR - 1) / MR * MR, nc_pad = (nc + NR - 1) / NR * NR;
    memset(w, 0, sizeof *w);
    w->tile = aligned_alloc(64, (size_t)(mt_pad * nc_pad + 16) * sizeof(float));
    w->panel = aligned_alloc(64, (size_t)KC * NT * sizeof(float));
    w->apack = trans_a ? aligned_alloc(64, (size_t)(mt_pad * KC) * sizeof(float)) : NULL;
    w->row = malloc((size_t)KC * sizeof(float));
    if (!w->tile || !w->panel || (trans_a && !w->apack) || !w->row) {
        ws_free(w);
        return -ENOMEM;
    }
    return 0;
}

/* Panels [nt/NR][KC][NR] of B rows k0 .. k0+kc, columns j0 .. j0+nt as f32;
 * columns past nt up to the panel edge are zero. */
static void pack_b(const df_gemm_b *b, int64_t k0, int64_t kc, int64_t j0, int64_t nt,
                   float *panel, float *row)
{
    size_t es = df_dtype_size(b->dtype);
    int64_t nt_pad = (nt + NR - 1) / NR * NR;
    if (b->trans) { /* column j of B is a row of data: read it along k */
        for (int64_t j = 0; j < nt_pad; j++) {
            float *dst = panel + (j / NR) * KC * NR + j % NR;
            if (j < nt) {
                weight_to_f32((const uint8_t *)b->data + ((j0 + j) * b->ld + k0) * (int64_t)es,
                              b->dtype, kc, row);
                for (int64_t k = 0; k < kc; k++)
                    dst[k * NR] = row[k];
            } else {
                for (int64_t k = 0; k < kc; k++)
                    dst[k * NR] = 0.0f;
            }
        }
    } else { /* row k of B is a row of data */
        for (int64_t k = 0; k < kc; k++) {
            weight_to_f32((const uint8_t *)b->data + ((k0 + k) * b->ld + j0) * (int64_t)es,
                          b->dtype, nt, row);
            for (int64_t j = nt; j < nt_pad; j++)
                row[j] = 0.0f;
            for (int64_t jp = 0; jp < nt_pad / NR; jp++)
                memcpy(panel + jp * KC * NR + k * NR, row + jp * NR, NR * sizeof(float));
        }
    }
}

/* C rows i0 .. i0+mt (mt <= GM), columns j0 .. j0+nc (nc <= GN). */
static void gemm_block(const df_gemm *g, int64_t i0, int64_t mt, int64_t j0, int64_t nc,
                       gemm_ws *w)
{
    const float *ap[GM];
    int64_t mt_pad = (mt + MR - 1) / MR * MR, ldt = (nc + NR - 1) / NR * NR;
    if (g->K == 0)
        memset(w->tile, 0, (size_t)(mt_pad * ldt) * sizeof(float));
    for (int64_t k0 = 0; k0 < g->K; k0 += KC) {
        int64_t kc = g->K - k0 < KC ? g->K - k0 : KC;
        /* A's slice: row pointers; rows past mt repeat the last one (their
         * sums land in the tile's padding and are never stored). */
        if (g->a.rows) {
            for (int64_t i = 0; i < mt; i++)
                ap[i] = g->a.rows[i0 + i] + k0;
        } else if (!g->a.trans) {
            for (int64_t i = 0; i < mt; i++)
                ap[i] = g->a.data + (i0 + i) * g->a.ld + k0;
        } else {
            /* 8 source rows at a time: each packed row gets 32 contiguous bytes */
            for (int64_t k = 0; k < kc; k += 8) {
                int64_t kn = kc - k < 8 ? kc - k : 8;
                const float *src = g->a.data + (k0 + k) * g->a.ld + i0;
                for (int64_t i = 0; i < mt; i++)
                    for (int64_t kk = 0; kk < kn; kk++)
                        w->apack[i * KC + k + kk] = src[kk * g->a.ld + i];
            }
            for (int64_t i = 0; i < mt; i++)
                ap[i] = w->apack + i * KC;
        }
        for (int64_t i = mt; i < mt_pad; i++)
            ap[i] = ap[mt - 1];
        for (int64_t jt = 0; jt < nc; jt += NT) {
            int64_t nt = nc - jt < NT ? nc - jt : NT;
            pack_b(&g->b, k0, kc, j0 + jt, nt, w->panel, w->row);
            for (int64_t i = 0; i < mt; i += MR)
                for (int64_t jp = 0; jp < (nt + NR - 1) / NR; jp++)
                    g->kern(kc, ap + i, w->panel + jp * KC * NR, w->tile + i * ldt + jt + jp * NR,
                            ldt, k0 == 0);
        }
    }
    for (int64_t i = 0; i < mt; i++) {
        float *cr = (g->c.rows ? g->c.rows[i0 + i] : g->c.data + (i0 + i) * g->c.ld) + j0;
        const float *tr = w->tile + i * ldt;
        if (g->c.accumulate)
            for (int64_t j = 0; j < nc; j++)
                cr[j] = tr[j] + cr[j];
        else
            memcpy(cr, tr, (size_t)nc * sizeof(float));
    }
}

int df_gemm_rows(const df_gemm *g, int64_t i0, int64_t m, int64_t N)
{
    if (m <= 0 || N <= 0)
        return 0;
    gemm_ws w;
    int64_t mt = m < GM ? m : GM, nc = N < GN ? N : GN;
    if (ws_alloc(&w, mt, nc, g->a.trans && !g->a.rows) < 0)
        return -ENOMEM;
    for (int64_t i = 0; i < m; i += GM)
        for (int64_t j = 0; j < N; j += GN)
            gemm_block(g, i0 + i, m - i < GM ? m - i : GM, j, N - j < GN ? N - j : GN, &w);
    ws_free(&w);
    return 0;
}

typedef struct gemm_job {
    const df_gemm *g;
    int64_t M, N, nc, n_cblocks;
} gemm_job;

static int gemm_task(void *vp, size_t task)
{
    const gemm_job *j = vp;
    int64_t i0 = (int64_t)task / j->n_cblocks * GM, j0 = (int64_t)task % j->n_cblocks * j->nc;
    int64_t mt = j->M - i0 < GM ? j->M - i0 : GM, nc = j->N - j0 < j->nc ? j->N - j0 : j->nc;
    gemm_ws w;
    if (ws_alloc(&w, mt, nc, j->g->a.trans && !j->g->a.rows) < 0)
        return -ENOMEM;
    gemm_block(j->g, i0, mt, j0, nc, &w);
    ws_free(&w);
    return 0;
}

int df_gemm_par(df_backend *be, const df_gemm *g, int64_t M, int64_t N)
{
    if (M <= 0 || N <= 0)
        return 0;
    /* Wide blocks reuse A's slice (and its packing) over more columns;
     * narrow ones when that leaves too few tasks to keep the threads busy.
     * Either way the same bits (see train_internal.h). */
    int64_t m_blocks = (M + GM - 1) / GM, n_tiles = (N + NT - 1) / NT, sub = GN / NT;
    while (sub > 1 && m_blocks * ((n_tiles + sub - 1) / sub) < 4 * (int64_t)be->nthreads)
        sub /= 2;
    gemm_job j = {g, M, N, sub * NT, (N + sub * NT - 1) / (sub * NT)};
    return df_pool_for(be->pool, (size_t)(m_blocks * j.n_cblocks), gemm_task, &j);
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

/* dw[N, K] (+)= dy^T[N, M] @ x[M, K]: A = dy transposed (packed per slice),
 * B = x as is. Each dw element is one fp32 sum over the M rows in order. */
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
    g.c.data = dw->data;
    g.c.ld = dw->stride[0];
    g.c.accumulate = accumulate;
    g.K = dy->shape[0];
    g.kern = df_gemm_pick_kernel();
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
 * added in piece order, and the total is added to dw. */

static float sumsq_f32(const float *x, int64_t n)
{
    float p[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++)
            p[j] += x[i + j] * x[i + j];
    for (; i < n; i++)
        p[i & 7] += x[i] * x[i];
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

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
        float inv = 1.0f / sqrtf(sumsq_f32(x, D) / (float)D + c->eps);
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
        float *out = dw->data;
        for (int64_t i = 0; i < D; i++) {
            float s = partial[i];
            for (int64_t p = 1; p < np; p++)
                s += partial[p * D + i];
            out[i * dw->stride[0]] = s + out[i * dw->stride[0]];
        }
    }
    free(partial);
    return rc;
}

/* ---- RoPE backward ----
 * The forward rotates (x1, x2) -> (x1 c - x2 s, x2 c + x1 s); its transpose
 * maps (d1, d2) -> (d1 c + d2 s, d2 c - d1 s). Angles exactly as the forward
 * (fp32 inv_freq, one fp32 product, cosf/sinf). */

typedef struct rope_ctx {
    df_tensor *x;
    const int32_t *pos;
    const float *inv_freq;
    int heads, head_dim, half;
} rope_ctx;

static int rope_bwd_rows(void *vp, int64_t piece, int64_t r0, int64_t r1)
{
    const rope_ctx *c = vp;
    float *cs = malloc((size_t)c->half * 2 * sizeof(float));
    if (!cs)
        return -ENOMEM;
    float *sn = cs + c->half;
    for (int64_t t = r0; t < r1; t++) {
        float p = (float)c->pos[t];
        for (int d = 0; d < c->half; d++) {
            float ang = p * c->inv_freq[d];
            cs[d] = cosf(ang);
            sn[d] = sinf(ang);
        }
        float *row = (float *)c->x->data + t * c->x->stride[0];
        for (int h = 0; h < c->heads; h++) {
            float *v = row + (int64_t)h * c->head_dim;
            for (int d = 0; d < c->half; d++) {
                float d1 = v[d], d2 = v[d + c->half];
                v[d] = d1 * cs[d] + d2 * sn[d];
                v[d + c->half] = d2 * cs[d] - d1 * sn[d];
            }
        }
    }
    free(cs);
    return 0;
}

int df_cpu_rope_bwd(df_backend *be, df_tensor *dx, const int32_t *pos, int heads, int head_dim,
                    int rot_dim, double theta)
{
    int half = rot_dim / 2;
    float *inv_freq = malloc((size_t)half * sizeof(float));
    if (!inv_freq)
        return -ENOMEM;
    float base = (float)theta;
    for (int d = 0; d < half; d++)
        inv_freq[d] = 1.0f / powf(base, (float)(2 * d) / (float)rot_dim);
    rope_ctx c = {dx, pos, inv_freq, heads, head_dim, half};
    int64_t cost = (int64_t)heads * rot_dim * 2 + half * 40;
    int rc = par_range(be, dx->shape[0], ((int64_t)1 << 16) / cost, rope_bwd_rows, &c);
    free(inv_freq);
    return rc;
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

/* ---- AdamW ----
 * Per element in fp32, as a fused GPU kernel would:
 *   g = grad * grad_scale
 *   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
 *   p = p - lr * (m / bc1 / (sqrt(v / bc2) + eps) + wd p)
 * bc1 = 1 - b1^t, bc2 = 1 - b2^t and 1 - b1, 1 - b2 computed in double, then
 * rounded to f32 once. out_bf16 = RNE(p). */

typedef struct adam_ctx {
    float *p, *m, *v;
    const float *g;
    uint16_t *out;
    float b1, b2, omb1, omb2, bc1, bc2, lr, eps, wd, gs;
} adam_ctx;

static int adam_piece(void *vp, int64_t piece, int64_t i0, int64_t i1)
{
    const adam_ctx *c = vp;
    for (int64_t i = i0; i < i1; i++) {
        float g = c->g[i] * c->gs;
        float m = c->b1 * c->m[i] + c->omb1 * g;
        float v = c->b2 * c->v[i] + c->omb2 * (g * g);
        float p = c->p[i];
        float upd = (m / c->bc1) / (sqrtf(v / c->bc2) + c->eps) + c->wd * p;
        p = p - c->lr * upd;
        c->m[i] = m;
        c->v[i] = v;
        c->p[i] = p;
        if (c->out)
            c->out[i] = df_f32_to_bf16(p);
    }
    return 0;
}

int df_cpu_adamw(df_backend *be, float *master, const float *grad, float *m, float *v, int64_t n,
                 float lr, float beta1, float beta2, float eps, float wd, int64_t step,
                 float grad_scale, uint16_t *out_bf16)
{
    adam_ctx c = {master, m, v, grad, out_bf16, beta1, beta2,
                  (float)(1.0 - (double)beta1), (float)(1.0 - (double)beta2),
                  (float)(1.0 - pow((double)beta1, (double)step)),
                  (float)(1.0 - pow((double)beta2, (double)step)), lr, eps, wd, grad_scale};
    return par_range(be, n, (int64_t)1 << 15, adam_piece, &c);
}

/* ---- sum of squares ----
 * Pieces of 64K elements, each summed in double with 4 interleaved partials
 * (combined (p0 + p2) + (p1 + p3)), the piece sums added in piece order. */

enum { SUMSQ_CHUNK = 1 << 16 };

typedef struct ssq_ctx {
    const float *x;
    double *piece_sum;
} ssq_ctx;

static int ssq_piece(void *vp, int64_t piece, int64_t i0, int64_t i1)
{
    const ssq_ctx *c = vp;
    double p[4] = {0, 0, 0, 0};
    int64_t i = i0;
    for (; i + 4 <= i1; i += 4)
        for (int j = 0; j < 4; j++)
            p[j] += (double)c->x[i + j] * (double)c->x[i + j];
    for (; i < i1; i++)
        p[i & 3] += (double)c->x[i] * (double)c->x[i];
    c->piece_sum[piece] = (p[0] + p[2]) + (p[1] + p[3]);
    return 0;
}

double df_cpu_sumsq(df_backend *be, const float *x, int64_t n)
{
    int64_t np = n_pieces(n, SUMSQ_CHUNK);
    if (np == 0)
        return 0.0;
    double *ps = malloc((size_t)np * sizeof(double));
    if (!ps)
        return (double)-ENOMEM;
    ssq_ctx c = {x, ps};
    int rc = par_range(be, n, SUMSQ_CHUNK, ssq_piece, &c);
    double s = 0.0;
    for (int64_t i = 0; i < np; i++)
        s += ps[i];
    free(ps);
    return rc < 0 ? (double)rc : s;
}
