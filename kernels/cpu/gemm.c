/* gemm.c - the one blocked fp32 GEMM of the CPU backend (contract in
 * cpu/cpu_internal.h): the forward matmul, the backward matmuls and the fused
 * LM-head CE all run on it. */
#include "cpu_internal.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "knobs.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DF_X86_SIMD 1
#endif

/* ---- GEMM: C[M, N] (+)= A[M, K] @ B[K, N] ----
 *
 * Used by the forward matmul (kernels/cpu/dense.c), the backward matmuls
 * (kernels/cpu/train_dense.c) and the fused LM-head CE (lmhead_ce.c). A block is up to GM rows x GN
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
 * broadcasts per k. Chosen at run time (df_gemm_pick_kernel()), so the
 * library still runs on x86-64 without AVX2. FMA rounds once where the
 * portable kernel rounds twice: both are fp32 accumulation. */
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
    if (!df_knob_int(DF_KNOB_CPU_SIMD))
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
