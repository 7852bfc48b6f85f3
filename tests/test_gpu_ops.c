/* test_gpu_ops - the CUDA backend's dense and GDN-preprocessing ops (embed,
 * add, RMSNorm plain / plus_one / gated, RoPE, SwiGLU, sigmoid, SiLU,
 * conv1d + SiLU, l2norm, GDN gates) and matmul (cuBLASLt), against the CPU
 * reference. Both run through the public df_op_* dispatch. Skips (77)
 * without a GPU.
 *
 * Every case draws random inputs (never zeros) and rounds them to bf16; the
 * CPU backend runs on F32 copies of those values (the fp32 reference), the
 * CUDA backend on BF16 device copies laid out identically: column views with
 * row strides > cols, 3-D/4-D per-head views with gaps, in-place aliasing.
 * Non-aliased GPU outputs are poisoned first with NaN bits (0x7fc0; F32
 * outputs 0x7fc00000), and every element outside an output view must come
 * back bit for bit as uploaded.
 *
 * Tolerance (KERNELS.md, FlashAttention's rule): the GPU's max abs error vs
 * the fp32 reference must be at most twice that of naive bf16 math. Naive
 * bf16 math at least rounds its fp32 result to bf16 (for matmul: bf16
 * inputs, an fp32 sum, a bf16 output, which is exactly that), so per output
 * view:   max|gpu - ref| <= 2 * max|round_bf16(ref) - ref| + 1e-6 * max|ref|.
 * NaN (or inf) never passes. One line per case; any failure exits 1.
 *
 * Benchmark: `test_gpu_ops --bench` (no checks, no timing otherwise) times
 * each op at the Qwen3.5-27B / Qwen3-32B extraction shapes and views,
 * T = 4096: CUDA events on the backend's stream around one call, median of
 * 20 after 3 warm-ups, ms and TB/s (bytes of the op's views read + written;
 * weights left out). Before every call its input buffer is refilled on the
 * GPU (fresh values, as after the producing GEMM, and the GPU is busy while
 * the host enqueues the call, so launch latency is not timed). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "cuda/cuda_internal.h"
#include "gpu_harness.h"
#include "ops.h"

static uint64_t rng = 0x5eed0f0b5ull;

static const float EPS = 1e-6f;

/* ---- embed ---- */

static void embed_case(const char *name, int64_t V, int64_t H, int64_t n, int64_t ld,
                       int64_t col0)
{
    gh_view vt = gh_v2(0, V, H, H), vo = gh_v2(col0, n, H, ld);
    gh_buf tab = gh_buf_rand(gh_view_len(vt), 0, GH_N01, &rng, 1.0f);
    gh_buf out = gh_buf_rand(gh_view_len(vo), 0, GH_N01, &rng, 1.0f);
    uint32_t *ids = gh_xmalloc((size_t)n * sizeof *ids);
    for (int64_t i = 0; i < n; i++)
        ids[i] = i == 0 ? 0 : i == 1 ? (uint32_t)(V - 1) : (uint32_t)(test_rand(&rng) % V);
    gh_poison(&out, vo);
    gh_buf_upload(&tab);
    gh_buf_upload(&out);
    df_tensor tc = gh_tens(&tab, vt, 0), tg = gh_tens(&tab, vt, 1);
    df_tensor oc = gh_tens(&out, vo, 0), og = gh_tens(&out, vo, 1);
    CHECK_EQ(df_op_embed(gh_cpu, &tc, ids, n, &oc), 0);
    CHECK_EQ(df_op_embed(gh_gpu, &tg, ids, n, &og), 0);
    gh_check_view(name, &out, vo, NULL);
    free(ids);
    gh_buf_free(&tab);
    gh_buf_free(&out);
}

/* ---- matmul ---- */

/* x and y are column views (col0 8 / 16 of wider rows) when xpad / ypad. */
static void matmul_case(const char *name, int64_t M, int64_t N, int64_t K, int64_t xpad,
                        int64_t ypad, int acc)
{
    gh_view vx = gh_v2(xpad ? 8 : 0, M, K, K + xpad), vw = gh_v2(0, N, K, K);
    gh_view vy = gh_v2(ypad ? 16 : 0, M, N, N + ypad);
    gh_buf x = gh_buf_rand(gh_view_len(vx), 0, GH_N01, &rng, 1.0f);
    gh_buf w = gh_buf_rand(gh_view_len(vw), 0, GH_N01, &rng, 1.0f);
    gh_buf y = gh_buf_rand(gh_view_len(vy), 0, GH_N01, &rng, 4.0f);
    if (!acc)
        gh_poison(&y, vy);
    gh_buf_upload(&x);
    gh_buf_upload(&w);
    gh_buf_upload(&y);
    df_tensor xc = gh_tens(&x, vx, 0), xg = gh_tens(&x, vx, 1), wc = gh_tens(&w, vw, 0);
    df_tensor wg = gh_tens(&w, vw, 1), yc = gh_tens(&y, vy, 0), yg = gh_tens(&y, vy, 1);
    CHECK_EQ(df_op_matmul(gh_cpu, &xc, &wc, &yc, acc), 0);
    CHECK_EQ(df_op_matmul(gh_gpu, &xg, &wg, &yg, acc), 0);
    gh_check_view(name, &y, vy, NULL);
    gh_buf_free(&x);
    gh_buf_free(&w);
    gh_buf_free(&y);
}

/* ---- elementwise ---- */

enum { OP_ADD, OP_SWIGLU, OP_SIGMOID, OP_SILU };

/* add: y = a + b with y = b (a == b for the aliased case). */
static int run_ew(df_backend *be, int op, const df_tensor *a, df_tensor *b, df_tensor *o)
{
    switch (op) {
    case OP_ADD:
        return df_op_add(be, a, b);
    case OP_SWIGLU:
        return df_op_swiglu(be, a, b, o);
    case OP_SIGMOID:
        return df_op_sigmoid(be, a, o);
    default:
        return df_op_silu(be, a, o);
    }
}

/* alias: 0 = out in its own buffer (add: y is b's buffer), 'a' = out is a
 * (same view), 'b' = out is b, 'x' = add with x and y one view. */
static void ew_case(const char *name, int op, gh_view va, gh_view vb, gh_view vo, int alias)
{
    int binary = op == OP_ADD || op == OP_SWIGLU;
    if (op == OP_ADD && alias == 0)
        alias = 'b';
    if (alias == 'a' || alias == 'x')
        vo = va;
    if (alias == 'b')
        vo = vb;
    if (alias == 'x')
        vb = va;
    gh_buf A = gh_buf_rand(gh_view_len(va), 0, GH_N01, &rng, 2.0f), B, O;
    memset(&B, 0, sizeof B);
    memset(&O, 0, sizeof O);
    /* saturating inputs: exp overflow must give 0 / -0 / x, never NaN */
    static const float ext[] = {200.0f, -200.0f, 88.5f, -88.5f, 16.0f, -16.0f};
    if (op != OP_ADD)
        for (int64_t i = 0; i < A.n; i += 17)
            gh_buf_set(&A, i, ext[(i / 17) % 6]);
    if (binary && alias != 'x')
        B = gh_buf_rand(gh_view_len(vb), 0, GH_N01, &rng, 2.0f);
    if (alias == 0)
        O = gh_buf_rand(gh_view_len(vo), 0, GH_N01, &rng, 1.0f);
    gh_buf *pb = binary ? (alias == 'x' ? &A : &B) : NULL;
    gh_buf *po = alias == 0 ? &O : alias == 'b' ? &B : &A;
    if (alias == 0)
        gh_poison(&O, vo);
    gh_buf_upload(&A);
    if (B.d)
        gh_buf_upload(&B);
    if (O.d)
        gh_buf_upload(&O);
    df_tensor ac = gh_tens(&A, va, 0), ag = gh_tens(&A, va, 1), bc, bg, oc, og;
    memset(&bc, 0, sizeof bc);
    memset(&bg, 0, sizeof bg);
    if (pb) {
        bc = gh_tens(pb, vb, 0);
        bg = gh_tens(pb, vb, 1);
    }
    oc = gh_tens(po, vo, 0);
    og = gh_tens(po, vo, 1);
    CHECK_EQ(run_ew(gh_cpu, op, &ac, pb ? &bc : NULL, &oc), 0);
    CHECK_EQ(run_ew(gh_gpu, op, &ag, pb ? &bg : NULL, &og), 0);
    gh_check_view(name, po, vo, NULL);
    gh_buf_free(&A);
    if (B.d)
        gh_buf_free(&B);
    if (O.d)
        gh_buf_free(&O);
}

static void test_elementwise(void)
{
    static const int ops[4] = {OP_ADD, OP_SWIGLU, OP_SIGMOID, OP_SILU};
    static const char *names[4] = {"add", "swiglu", "sigmoid", "silu"};
    char nm[128];
    for (int k = 0; k < 4; k++) {
        int op = ops[k];
        /* contiguous: one long row */
        snprintf(nm, sizeof nm, "%s [64, 5120] contiguous", names[k]);
        ew_case(nm, op, gh_v2(0, 64, 5120, 5120), gh_v2(0, 64, 5120, 5120),
                gh_v2(0, 64, 5120, 5120), 0);
        snprintf(nm, sizeof nm, "%s [1001] 1-D", names[k]);
        ew_case(nm, op, gh_v1(1001), gh_v1(1001), gh_v1(1001), 0);
        /* odd width, column views at unaligned and aligned offsets */
        snprintf(nm, sizeof nm, "%s [37, 77] column views", names[k]);
        ew_case(nm, op, gh_v2(3, 37, 77, 90), gh_v2(77, 37, 77, 160), gh_v2(5, 37, 77, 83), 0);
        /* halves of a fused [T, 2F] projection (SwiGLU's gate | up) */
        snprintf(nm, sizeof nm, "%s [45, 96] halves of [45, 192]", names[k]);
        ew_case(nm, op, gh_v2(0, 45, 96, 192), gh_v2(96, 45, 96, 192), gh_v2(8, 45, 96, 112), 0);
        {
            int64_t sh[3] = {10, 6, 40}, sa[3] = {6 * 48 + 8, 48, 1}, sb[3] = {240, 40, 1},
                    so[3] = {6 * 56, 56, 1};
            snprintf(nm, sizeof nm, "%s [10, 6, 40] 3-D views with gaps", names[k]);
            ew_case(nm, op, gh_vnd(8, 3, sh, sa), gh_vnd(0, 3, sh, sb), gh_vnd(16, 3, sh, so), 0);
        }
        {
            int64_t sh[4] = {2, 3, 4, 16}, st[4] = {3 * 4 * 24, 4 * 24, 24, 1};
            snprintf(nm, sizeof nm, "%s [2, 3, 4, 16] 4-D, in place", names[k]);
            ew_case(nm, op, gh_vnd(8, 4, sh, st), gh_vnd(0, 4, sh, st), gh_vnd(0, 4, sh, st),
                    op == OP_ADD ? 'x' : 'a');
        }
        snprintf(nm, sizeof nm, "%s [33, 130] in place (out = %s)", names[k],
                 op == OP_ADD ? "x = y" : op == OP_SWIGLU ? "up" : "x");
        ew_case(nm, op, gh_v2(0, 33, 130, 130), gh_v2(0, 33, 130, 136), gh_v2(0, 33, 130, 130),
                op == OP_ADD ? 'x' : op == OP_SWIGLU ? 'b' : 'a');
    }
}

/* ---- norms ---- */

enum { N_PLAIN, N_PLUS1, N_GATED, N_L2 };

static int run_norm(df_backend *be, int kind, df_tensor *x, const df_tensor *z,
                    const df_tensor *w, df_tensor *y)
{
    switch (kind) {
    case N_PLAIN:
    case N_PLUS1:
        return df_op_rmsnorm(be, x, w, EPS, kind == N_PLUS1, y);
    case N_GATED:
        return df_op_rmsnorm_gated(be, x, z, w, EPS, y);
    default:
        return df_op_l2norm(be, x, EPS, 0.08838834764831845f);
    }
}

/* vz is used by the gated norm only; inplace: y is x (always for l2norm). */
static void norm_case(const char *name, int kind, gh_view vx, gh_view vz, gh_view vy, int inplace)
{
    int64_t D = vx.shape[vx.ndim - 1];
    if (kind == N_L2)
        inplace = 1;
    if (inplace)
        vy = vx;
    gh_buf x = gh_buf_rand(gh_view_len(vx), 0, GH_N01, &rng, 1.5f), z, y, w;
    memset(&z, 0, sizeof z);
    memset(&y, 0, sizeof y);
    w = gh_buf_rand(D, 0, GH_N01, &rng, kind == N_PLUS1 ? 0.1f : 1.0f);
    if (kind == N_GATED)
        z = gh_buf_rand(gh_view_len(vz), 0, GH_N01, &rng, 2.0f);
    if (!inplace) {
        y = gh_buf_rand(gh_view_len(vy), 0, GH_N01, &rng, 1.0f);
        gh_poison(&y, vy);
    }
    gh_buf *py = inplace ? &x : &y;
    gh_buf_upload(&x);
    gh_buf_upload(&w);
    if (z.d)
        gh_buf_upload(&z);
    if (y.d)
        gh_buf_upload(&y);
    df_tensor xc = gh_tens(&x, vx, 0), xg = gh_tens(&x, vx, 1), wc = gh_tens(&w, gh_v1(D), 0);
    df_tensor wg = gh_tens(&w, gh_v1(D), 1), zc, zg;
    memset(&zc, 0, sizeof zc);
    memset(&zg, 0, sizeof zg);
    if (z.d) {
        zc = gh_tens(&z, vz, 0);
        zg = gh_tens(&z, vz, 1);
    }
    df_tensor yc = gh_tens(py, vy, 0), yg = gh_tens(py, vy, 1);
    CHECK_EQ(run_norm(gh_cpu, kind, &xc, &zc, &wc, &yc), 0);
    CHECK_EQ(run_norm(gh_gpu, kind, &xg, &zg, &wg, &yg), 0);
    gh_check_view(name, py, vy, NULL);
    gh_buf_free(&x);
    gh_buf_free(&w);
    if (z.d)
        gh_buf_free(&z);
    if (y.d)
        gh_buf_free(&y);
}

static void test_norms(void)
{
    gh_view none;
    memset(&none, 0, sizeof none);
    /* the hidden size: a block per row, 16-byte vectors */
    norm_case("rmsnorm [33, 5120]", N_PLAIN, gh_v2(0, 33, 5120, 5120), none,
              gh_v2(0, 33, 5120, 5120), 0);
    norm_case("rmsnorm plus_one [33, 5120] in place", N_PLUS1, gh_v2(0, 33, 5120, 5120), none,
              none, 1);
    norm_case("rmsnorm plus_one [17, 4096] -> column view", N_PLUS1, gh_v2(0, 17, 4096, 4096),
              none, gh_v2(8, 17, 4096, 4104), 0);
    /* > 1024 with a scalar tail (stride 1104), and unaligned (stride 1101) */
    norm_case("rmsnorm [20, 1101] of [20, 1104] (vector + tail)", N_PLAIN,
              gh_v2(0, 20, 1101, 1104), none, gh_v2(8, 20, 1101, 1112), 0);
    norm_case("rmsnorm plus_one [20, 1101] unaligned, in place", N_PLUS1,
              gh_v2(3, 20, 1101, 1107), none, none, 1);
    /* warp per row: odd width, unaligned */
    norm_case("rmsnorm [30, 100] of [30, 104] (vector + tail)", N_PLAIN, gh_v2(0, 30, 100, 104),
              none, gh_v2(16, 30, 100, 128), 0);
    norm_case("rmsnorm [50, 77]", N_PLAIN, gh_v2(0, 50, 77, 77), none, gh_v2(0, 50, 77, 77), 0);
    norm_case("rmsnorm plus_one [50, 77] in place", N_PLUS1, gh_v2(0, 50, 77, 77), none, none, 1);
    {   /* q_norm on q inside per-head [q | gate] rows: [T, nq, 256], row stride 2*nq*256 */
        int64_t sh[3] = {40, 4, 256}, sx[3] = {2 * 4 * 256, 512, 1}, sy[3] = {1024, 256, 1};
        norm_case("q_norm [40, 4, 256] of per-head q|gate", N_PLAIN, gh_vnd(0, 3, sh, sx), none,
                  gh_vnd(0, 3, sh, sy), 0);
        norm_case("q_norm plus_one [40, 4, 256] q|gate in place", N_PLUS1,
                  gh_vnd(256, 3, sh, sx), none, none, 1);
        /* q columns of a [T, 2*nq*D] buffer: [T, nq, D] with row stride 2*nq*D */
        int64_t sq[3] = {2 * 4 * 256, 256, 1};
        norm_case("k_norm plus_one [40, 4, 256] column slice", N_PLUS1, gh_vnd(1024, 3, sh, sq),
                  none, gh_vnd(0, 3, sh, sy), 0);
    }
    norm_case("k_norm plus_one [64, 128] (Qwen3 per-head)", N_PLUS1, gh_v2(0, 64, 128, 128), none,
              none, 1);
    {
        int64_t sh[4] = {2, 3, 5, 24}, st[4] = {3 * 5 * 32 + 8, 5 * 32, 32, 1};
        norm_case("rmsnorm plus_one [2, 3, 5, 24] 4-D with gaps", N_PLUS1, gh_vnd(0, 4, sh, st),
                  none, none, 1);
    }
    {   /* the GDN output norm: per value head over 128, gate z a column view */
        int64_t sh[3] = {30, 6, 128}, sx[3] = {768, 128, 1}, sz[3] = {768 + 64, 128, 1};
        norm_case("rmsnorm_gated [30, 6, 128]", N_GATED, gh_vnd(0, 3, sh, sx),
                  gh_vnd(32, 3, sh, sz), gh_vnd(0, 3, sh, sx), 0);
        norm_case("rmsnorm_gated [30, 6, 128] in place", N_GATED, gh_vnd(0, 3, sh, sx),
                  gh_vnd(8, 3, sh, sz), none, 1);
    }
    norm_case("rmsnorm_gated [41, 45] odd", N_GATED, gh_v2(0, 41, 45, 45), gh_v2(1, 41, 45, 50),
              gh_v2(2, 41, 45, 47), 0);
    norm_case("rmsnorm_gated [9, 2048] block per row", N_GATED, gh_v2(0, 9, 2048, 2048),
              gh_v2(0, 9, 2048, 2048), gh_v2(0, 9, 2048, 2048), 0);
    {   /* l2norm: q/k heads inside the fused conv output [T, 2*hk*D + hv*Dv] */
        int64_t ld = 2 * 4 * 128 + 8 * 128;
        int64_t sh[3] = {50, 4, 128}, st[3] = {ld, 128, 1};
        norm_case("l2norm q [50, 4, 128] of conv output", N_L2, gh_vnd(0, 3, sh, st), none,
                  none, 1);
        norm_case("l2norm k [50, 4, 128] of conv output", N_L2, gh_vnd(512, 3, sh, st), none,
                  none, 1);
        int64_t sg[3] = {ld, 256, 1}; /* every other head: gaps between rows */
        norm_case("l2norm [50, 2, 128] strided heads", N_L2, gh_vnd(0, 3, sh, sg), none, none, 1);
    }
    norm_case("l2norm [50, 77]", N_L2, gh_v2(0, 50, 77, 77), none, none, 1);
    norm_case("l2norm [9, 2048] block per row", N_L2, gh_v2(8, 9, 2048, 2064), none, none, 1);
    {
        int64_t sh[4] = {3, 2, 4, 64}, st[4] = {2 * 4 * 72 + 16, 4 * 72, 72, 1};
        norm_case("l2norm [3, 2, 4, 64] 4-D with gaps", N_L2, gh_vnd(0, 4, sh, st), none, none, 1);
    }
}

/* ---- RoPE ---- */

static void rope_case(const char *name, int64_t T, int heads, int hd, int rot, double theta,
                      int64_t ld, int64_t col0)
{
    gh_view vx = gh_v2(col0, T, (int64_t)heads * hd, ld);
    gh_buf x = gh_buf_rand(gh_view_len(vx), 0, GH_N01, &rng, 1.5f);
    int32_t *pos = gh_xmalloc((size_t)T * sizeof *pos);
    static const int32_t fixed[] = {0, 1, 4095, 4096, 4097, 32768, 100000, 262143, 1000000};
    for (int64_t t = 0; t < T; t++)
        pos[t] = t < 9 ? fixed[t] : (int32_t)(test_rand(&rng) % 40000);
    gh_buf_upload(&x);
    df_tensor xc = gh_tens(&x, vx, 0), xg = gh_tens(&x, vx, 1);
    CHECK_EQ(df_op_rope(gh_cpu, &xc, pos, heads, hd, rot, theta), 0);
    CHECK_EQ(df_op_rope(gh_gpu, &xg, pos, heads, hd, rot, theta), 0);
    gh_check_view(name, &x, vx, NULL);
    free(pos);
    gh_buf_free(&x);
}

static void test_rope(void)
{
    /* Qwen3.5: partial rotary (64 of 256), theta 1e7; q inside a wider row */
    rope_case("rope q 24x256 rot 64 theta 1e7", 100, 24, 256, 64, 1e7, 24 * 256 * 2, 0);
    rope_case("rope k 4x256 rot 64, column view", 100, 4, 256, 64, 1e7, 6 * 256, 1024);
    /* Qwen3: full rotary 128, theta 1e6 */
    rope_case("rope 8x128 rot 128 theta 1e6", 77, 8, 128, 128, 1e6, 8 * 128, 0);
    rope_case("rope 3x128 rot 128, column view col0 8", 77, 3, 128, 128, 1e6, 3 * 128 + 24, 8);
    /* scalar paths: unaligned view; half not a multiple of 8 */
    rope_case("rope 4x256 rot 64, unaligned col0 4", 40, 4, 256, 64, 1e7, 4 * 256 + 4, 4);
    rope_case("rope 2x40 rot 24 odd sizes", 40, 2, 40, 24, 1e4, 85, 3);
    rope_case("rope 5x64 rot 64 theta 1e4", 200, 5, 64, 64, 1e4, 320, 0);
}

/* ---- conv1d + SiLU ---- */

static void conv_case(const char *name, int64_t C, int K, const int32_t *cu, int n_seq,
                      int64_t xld, int64_t x0, int64_t wld)
{
    int64_t T = cu[n_seq];
    /* out rows padded to a multiple of 8: the vector path with a partial group */
    gh_view vx = gh_v2(x0, T, C, xld), vw = gh_v2(0, C, K, wld);
    gh_view vo = gh_v2(0, T, C, (C + 7) / 8 * 8);
    gh_buf x = gh_buf_rand(gh_view_len(vx), 0, GH_N01, &rng, 1.5f);
    gh_buf w = gh_buf_rand(gh_view_len(vw), 0, GH_N01, &rng, 0.6f);
    gh_buf o = gh_buf_rand(gh_view_len(vo), 0, GH_N01, &rng, 1.0f);
    gh_poison(&o, vo);
    gh_buf_upload(&x);
    gh_buf_upload(&w);
    gh_buf_upload(&o);
    df_tensor xc = gh_tens(&x, vx, 0), xg = gh_tens(&x, vx, 1), wc = gh_tens(&w, vw, 0);
    df_tensor wg = gh_tens(&w, vw, 1), oc = gh_tens(&o, vo, 0), og = gh_tens(&o, vo, 1);
    CHECK_EQ(df_op_conv1d_silu(gh_cpu, &xc, &wc, cu, n_seq, &oc), 0);
    CHECK_EQ(df_op_conv1d_silu(gh_gpu, &xg, &wg, cu, n_seq, &og), 0);
    gh_check_view(name, &o, vo, NULL);
    gh_buf_free(&x);
    gh_buf_free(&w);
    gh_buf_free(&o);
}

static void test_conv(void)
{
    /* lengths 2 (< K), 0, 48, 1, 69: bounds inside 16-token tiles */
    static const int32_t cu[] = {0, 2, 2, 50, 51, 120};
    static const int32_t cu_long[] = {0, 700, 701, 1000, 1003, 2000};
    static const int32_t cu_one[] = {0, 33};
    conv_case("conv1d K4 C64 5 seqs", 64, 4, cu, 5, 64, 0, 4);
    conv_case("conv1d K4 C37 (partial group), column view", 37, 4, cu, 5, 48, 8, 4);
    conv_case("conv1d K4 C40 unaligned column view", 40, 4, cu, 5, 45, 1, 4);
    conv_case("conv1d K4 C1024 of qkv [T, 1536], long seqs", 1024, 4, cu_long, 5, 1536, 256, 4);
    conv_case("conv1d K3 C48 (runtime K), w view", 48, 3, cu, 5, 48, 0, 5);
    conv_case("conv1d K1 C16", 16, 1, cu, 5, 16, 0, 1);
    conv_case("conv1d K7 C24 one seq", 24, 7, cu_one, 1, 24, 0, 7);
}

/* ---- GDN gates ---- */

static void gates_case(const char *name, int64_t T, int64_t H)
{
    gh_view va = gh_v2(0, T, H, 2 * H + 8), vb = gh_v2(H + 8, T, H, 2 * H + 8);
    gh_view vg = gh_v2(0, T, H, 2 * H), vbeta = gh_v2(H, T, H, 2 * H);
    gh_buf ab = gh_buf_rand(gh_view_len(vb), 0, GH_N01, &rng, 2.0f);
    gh_buf gb = gh_buf_rand(gh_view_len(vbeta), 1, GH_N01, &rng, 1.0f);
    gh_buf alog = gh_buf_rand(H, 0, GH_N01, &rng, 0.7f);
    gh_buf dtb = gh_buf_rand(H, 0, GH_N01, &rng, 1.0f);
    /* a + dt_bias beyond the softplus threshold, around it, and far below */
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            int64_t i = t * (2 * H + 8) + h;
            int k = (int)((t + h) % 6);
            if (k == 0)
                gh_buf_set(&ab, i, 24.0f + (float)(h % 7));
            else if (k == 1)
                gh_buf_set(&ab, i, 20.0f - dtb.h[h] + 0.25f * (float)((t % 5) - 2));
            else if (k == 2)
                gh_buf_set(&ab, i, -30.0f);
        }
    gh_poison(&gb, vg);
    gh_poison(&gb, vbeta);
    gh_buf_upload(&ab);
    gh_buf_upload(&gb);
    gh_buf_upload(&alog);
    gh_buf_upload(&dtb);
    df_tensor ac = gh_tens(&ab, va, 0), ag = gh_tens(&ab, va, 1), bc = gh_tens(&ab, vb, 0);
    df_tensor bg = gh_tens(&ab, vb, 1), lc = gh_tens(&alog, gh_v1(H), 0);
    df_tensor lg = gh_tens(&alog, gh_v1(H), 1);
    df_tensor dc = gh_tens(&dtb, gh_v1(H), 0), dg = gh_tens(&dtb, gh_v1(H), 1);
    df_tensor gc = gh_tens(&gb, vg, 0), gg = gh_tens(&gb, vg, 1);
    df_tensor ec = gh_tens(&gb, vbeta, 0), eg = gh_tens(&gb, vbeta, 1);
    CHECK_EQ(df_op_gdn_gates(gh_cpu, &ac, &bc, &lc, &dc, &gc, &ec), 0);
    CHECK_EQ(df_op_gdn_gates(gh_gpu, &ag, &bg, &lg, &dg, &gg, &eg), 0);
    char nm[128];
    snprintf(nm, sizeof nm, "%s: g", name);
    gh_check_view(nm, &gb, vg, &vbeta);
    snprintf(nm, sizeof nm, "%s: beta", name);
    gh_check_view(nm, &gb, vbeta, &vg);
    gh_buf_free(&ab);
    gh_buf_free(&gb);
    gh_buf_free(&alog);
    gh_buf_free(&dtb);
}

/* ---- benchmark ---- */

enum { B_SWIGLU, B_RMS, B_GATED, B_CONV, B_L2, B_ROPE };

typedef struct bench_op {
    const char *name;
    int kind;
    df_tensor x, y, z, w; /* swiglu: x gate, z up, y out; conv: x in, y out */
    int plus_one, heads, hd, rot;
    float scale;
    double theta, bytes;
    void *refill; /* BF16 input buffer rewritten before each call */
    int64_t refill_n;
} bench_op;

static df_tensor bt2(void *base, int64_t off, int64_t rows, int64_t cols, int64_t ld)
{
    df_tensor t;
    memset(&t, 0, sizeof t);
    t.data = (uint16_t *)base + off;
    t.dtype = DF_DTYPE_BF16;
    t.ndim = 2;
    t.shape[0] = rows, t.shape[1] = cols;
    t.stride[0] = ld, t.stride[1] = 1;
    return t;
}

/* [rows, heads, D] per-head view of a [rows, ld] buffer from column off. */
static df_tensor bt3(void *base, int64_t off, int64_t rows, int64_t heads, int64_t D, int64_t ld)
{
    df_tensor t = bt2(base, off, rows, heads * D, ld);
    t.ndim = 3;
    t.shape[1] = heads, t.shape[2] = D;
    t.stride[1] = D, t.stride[2] = 1;
    return t;
}

static int bench_call(bench_op *o, const int32_t *cu, const int32_t *pos)
{
    switch (o->kind) {
    case B_SWIGLU:
        return df_op_swiglu(gh_gpu, &o->x, &o->z, &o->y);
    case B_RMS:
        return df_op_rmsnorm(gh_gpu, &o->x, &o->w, EPS, o->plus_one, &o->y);
    case B_GATED:
        return df_op_rmsnorm_gated(gh_gpu, &o->x, &o->z, &o->w, EPS, &o->y);
    case B_CONV:
        return df_op_conv1d_silu(gh_gpu, &o->x, &o->w, cu, 1, &o->y);
    case B_L2:
        return df_op_l2norm(gh_gpu, &o->x, EPS, o->scale);
    default:
        return df_op_rope(gh_gpu, &o->x, pos, o->heads, o->hd, o->rot, o->theta);
    }
}

static void bench_one(bench_op *o, const int32_t *cu, const int32_t *pos, cudaEvent_t *ev)
{
    enum { WARM = 3, RUNS = 20 };
    cudaStream_t st = df_cuda_stream(gh_gpu);
    float ms[RUNS];
    int rc = 0;
    for (int i = 0; i < WARM + RUNS && rc == 0; i++) {
        rc = df_backend_fill_uniform(gh_gpu, o->refill, DF_DTYPE_BF16, o->refill_n,
                                     100 + (uint64_t)i, -2.0f, 2.0f);
        if (!rc && cudaEventRecord(ev[0], st) != cudaSuccess)
            rc = -EIO;
        if (!rc)
            rc = bench_call(o, cu, pos);
        if (!rc && (cudaEventRecord(ev[1], st) != cudaSuccess ||
                    cudaEventSynchronize(ev[1]) != cudaSuccess))
            rc = -EIO;
        if (!rc && i >= WARM && cudaEventElapsedTime(&ms[i - WARM], ev[0], ev[1]) != cudaSuccess)
            rc = -EIO;
    }
    CHECK_EQ(rc, 0);
    if (rc) {
        printf("%-56s failed (%d)\n", o->name, rc);
        return;
    }
    float med = gh_median_f(ms, RUNS);
    printf("%-56s %8.4f ms  %5.2f TB/s\n", o->name, med, o->bytes / (med * 1e-3) / 1e12);
}

static void bench(void)
{
    enum { T = 4096 };
    const double e2 = 2.0; /* bytes per bf16 */
    /* A: the widest fused projection output (Qwen3-32B gate|up [T, 51200]),
     * reused for every op's [T, ld] input; B: [T, 10240] outputs; C: the
     * hidden state [T, 5120]; W: weights. */
    void *A = df_backend_alloc(gh_gpu, (size_t)T * 51200 * 2);
    void *B = df_backend_alloc(gh_gpu, (size_t)T * 10240 * 2);
    void *C = df_backend_alloc(gh_gpu, (size_t)T * 5120 * 2);
    void *W = df_backend_alloc(gh_gpu, (size_t)10240 * 4 * 2);
    int32_t *pos = gh_xmalloc(T * sizeof *pos), cu[2] = {0, T};
    for (int t = 0; t < T; t++)
        pos[t] = t;
    cudaEvent_t ev[2];
    if (!A || !B || !C || !W || cudaEventCreate(&ev[0]) != cudaSuccess ||
        cudaEventCreate(&ev[1]) != cudaSuccess) {
        fprintf(stderr, "bench: out of device memory / events\n");
        df_test_failures++;
        return;
    }
    CHECK_EQ(df_backend_fill_uniform(gh_gpu, W, DF_DTYPE_BF16, 10240 * 4, 1, -0.5f, 0.5f), 0);
    bench_op ops[32];
    int n = 0;
    memset(ops, 0, sizeof ops);
#define OP(nm, k) (ops[n].name = (nm), ops[n].kind = (k), &ops[n++])
    bench_op *o;
    /* ---- Qwen3.5-27B ---- */
    o = OP("qwen3.5 swiglu [T,17408] halves of [T,34816], out=gate", B_SWIGLU);
    o->x = o->y = bt2(A, 0, T, 17408, 34816), o->z = bt2(A, 17408, T, 17408, 34816);
    o->bytes = 3.0 * T * 17408 * e2, o->refill = A, o->refill_n = (int64_t)T * 34816;
    o = OP("qwen3.5 rmsnorm_gated o [T,48,128], z ld 16480, y=o", B_GATED);
    o->x = o->y = bt3(B, 0, T, 48, 128, 6144), o->z = bt3(A, 10240, T, 48, 128, 16480);
    o->w = bt2(W, 0, 1, 128, 128);
    o->w.ndim = 1, o->w.shape[0] = 128, o->w.stride[0] = 1;
    o->bytes = 3.0 * T * 6144 * e2, o->refill = B, o->refill_n = (int64_t)T * 6144;
    o = OP("qwen3.5 conv1d_silu K4 [T,10240] ld 16480 -> [T,10240]", B_CONV);
    o->x = bt2(A, 0, T, 10240, 16480), o->y = bt2(B, 0, T, 10240, 10240);
    o->w = bt2(W, 0, 10240, 4, 4);
    o->bytes = 2.0 * T * 10240 * e2, o->refill = A, o->refill_n = (int64_t)T * 16480;
    o = OP("qwen3.5 l2norm q [T,16,128] ld 10240", B_L2);
    o->x = bt3(B, 0, T, 16, 128, 10240), o->scale = 0.08838834764831845f;
    o->bytes = 2.0 * T * 2048 * e2, o->refill = B, o->refill_n = (int64_t)T * 10240;
    o = OP("qwen3.5 l2norm k [T,16,128] ld 10240", B_L2);
    o->x = bt3(B, 2048, T, 16, 128, 10240), o->scale = 1.0f;
    o->bytes = 2.0 * T * 2048 * e2, o->refill = B, o->refill_n = (int64_t)T * 10240;
    o = OP("qwen3.5 rmsnorm plus_one [T,5120] -> h", B_RMS);
    o->x = bt2(C, 0, T, 5120, 5120), o->y = bt2(B, 0, T, 5120, 5120), o->plus_one = 1;
    o->bytes = 2.0 * T * 5120 * e2, o->refill = C, o->refill_n = (int64_t)T * 5120;
    o = OP("qwen3.5 q_norm plus_one [T,24,256] ld 14336, in place", B_RMS);
    o->x = o->y = bt3(A, 0, T, 24, 256, 14336), o->plus_one = 1;
    o->bytes = 2.0 * T * 6144 * e2, o->refill = A, o->refill_n = (int64_t)T * 14336;
    o = OP("qwen3.5 k_norm plus_one [T,4,256] ld 14336, in place", B_RMS);
    o->x = o->y = bt3(A, 12288, T, 4, 256, 14336), o->plus_one = 1;
    o->bytes = 2.0 * T * 1024 * e2, o->refill = A, o->refill_n = (int64_t)T * 14336;
    o = OP("qwen3.5 rope q 24x256 rot 64 [T,6144] ld 14336", B_ROPE);
    o->x = bt2(A, 0, T, 6144, 14336), o->heads = 24, o->hd = 256, o->rot = 64, o->theta = 1e7;
    o->bytes = 2.0 * T * 24 * 64 * e2, o->refill = A, o->refill_n = (int64_t)T * 14336;
    o = OP("qwen3.5 rope k 4x256 rot 64 [T,1024] ld 14336", B_ROPE);
    o->x = bt2(A, 12288, T, 1024, 14336), o->heads = 4, o->hd = 256, o->rot = 64, o->theta = 1e7;
    o->bytes = 2.0 * T * 4 * 64 * e2, o->refill = A, o->refill_n = (int64_t)T * 14336;
    /* ---- Qwen3-32B ---- */
    o = OP("qwen3 rmsnorm [T,5120] -> h", B_RMS);
    o->x = bt2(C, 0, T, 5120, 5120), o->y = bt2(B, 0, T, 5120, 5120);
    o->bytes = 2.0 * T * 5120 * e2, o->refill = C, o->refill_n = (int64_t)T * 5120;
    o = OP("qwen3 q_norm [T,64,128] ld 10240, in place", B_RMS);
    o->x = o->y = bt3(A, 0, T, 64, 128, 10240);
    o->bytes = 2.0 * T * 8192 * e2, o->refill = A, o->refill_n = (int64_t)T * 10240;
    o = OP("qwen3 k_norm [T,8,128] ld 10240, in place", B_RMS);
    o->x = o->y = bt3(A, 8192, T, 8, 128, 10240);
    o->bytes = 2.0 * T * 1024 * e2, o->refill = A, o->refill_n = (int64_t)T * 10240;
    o = OP("qwen3 rope q 64x128 rot 128 [T,8192] ld 10240", B_ROPE);
    o->x = bt2(A, 0, T, 8192, 10240), o->heads = 64, o->hd = 128, o->rot = 128, o->theta = 1e6;
    o->bytes = 2.0 * T * 8192 * e2, o->refill = A, o->refill_n = (int64_t)T * 10240;
    o = OP("qwen3 rope k 8x128 rot 128 [T,1024] ld 10240", B_ROPE);
    o->x = bt2(A, 8192, T, 1024, 10240), o->heads = 8, o->hd = 128, o->rot = 128, o->theta = 1e6;
    o->bytes = 2.0 * T * 1024 * e2, o->refill = A, o->refill_n = (int64_t)T * 10240;
    o = OP("qwen3 swiglu [T,25600] halves of [T,51200], out=gate", B_SWIGLU);
    o->x = o->y = bt2(A, 0, T, 25600, 51200), o->z = bt2(A, 25600, T, 25600, 51200);
    o->bytes = 3.0 * T * 25600 * e2, o->refill = A, o->refill_n = (int64_t)T * 51200;
#undef OP
    for (int i = 0; i < n; i++) {
        if (ops[i].kind == B_RMS) { /* the norm weight: [D] from W */
            int64_t D = ops[i].x.shape[ops[i].x.ndim - 1];
            ops[i].w = bt2(W, 0, 1, D, D);
            ops[i].w.ndim = 1, ops[i].w.shape[0] = D, ops[i].w.stride[0] = 1;
        }
        bench_one(&ops[i], cu, pos, ev);
    }
    CHECK_EQ(df_backend_sync(gh_gpu), 0);
    cudaEventDestroy(ev[0]), cudaEventDestroy(ev[1]);
    free(pos);
    df_backend_free(gh_gpu, A), df_backend_free(gh_gpu, B);
    df_backend_free(gh_gpu, C), df_backend_free(gh_gpu, W);
}

/* df_backend_upload_ahead / _join: the upload starts after the work enqueued
 * before it (a copy that reads the old contents sees them), the work after
 * the join sees the new contents, and a sync waits for an unjoined one. */
static void test_upload_ahead(void)
{
    const size_t n = (size_t)16 << 20; /* 64 MiB of u32: long enough to overlap */
    uint32_t *ha = df_backend_host_alloc(gh_gpu, n * 4), *hb = df_backend_host_alloc(gh_gpu, n * 4);
    uint32_t *got = malloc(n * 4);
    void *dst = df_backend_alloc(gh_gpu, n * 4), *snap = df_backend_alloc(gh_gpu, n * 4),
         *after = df_backend_alloc(gh_gpu, n * 4);
    CHECK(ha && hb && got && dst && snap && after);
    if (!ha || !hb || !got || !dst || !snap || !after)
        return;
    for (size_t i = 0; i < n; i++) {
        ha[i] = (uint32_t)(i * 2654435761u);
        hb[i] = ~(uint32_t)(i * 40503u);
    }
    CHECK_EQ(df_backend_upload(gh_gpu, dst, ha, n * 4), 0);
    for (int round = 0; round < 3; round++) {
        const uint32_t *old = round % 2 ? hb : ha, *nu = round % 2 ? ha : hb;
        CHECK_EQ(df_backend_copy(gh_gpu, snap, dst, n * 4), 0); /* reads the old contents */
        CHECK_EQ(df_backend_upload_ahead(gh_gpu, dst, nu, n * 4), 0);
        CHECK_EQ(df_backend_upload_join(gh_gpu), 0);
        CHECK_EQ(df_backend_copy(gh_gpu, after, dst, n * 4), 0); /* after the join: the new */
        CHECK_EQ(df_backend_sync(gh_gpu), 0);
        CHECK_EQ(df_backend_download(gh_gpu, got, snap, n * 4), 0);
        CHECK(memcmp(got, old, n * 4) == 0);
        CHECK_EQ(df_backend_download(gh_gpu, got, after, n * 4), 0);
        CHECK(memcmp(got, nu, n * 4) == 0);
    }
    /* not joined: the sync still waits for it */
    CHECK_EQ(df_backend_upload_ahead(gh_gpu, dst, hb, n * 4), 0);
    CHECK_EQ(df_backend_sync(gh_gpu), 0);
    CHECK_EQ(df_backend_download(gh_gpu, got, dst, n * 4), 0);
    CHECK(memcmp(got, hb, n * 4) == 0);
    CHECK_EQ(df_backend_upload_join(gh_gpu), 0);
    CHECK_EQ(df_backend_upload_ahead(gh_gpu, NULL, hb, 4), -EINVAL);
    printf("upload_ahead / join: ordered against the compute stream\n");
    df_backend_free(gh_gpu, dst);
    df_backend_free(gh_gpu, snap);
    df_backend_free(gh_gpu, after);
    df_backend_host_free(gh_gpu, ha);
    df_backend_host_free(gh_gpu, hb);
    free(got);
}

int main(int argc, char **argv)
{
    int rc = gh_open(0);
    if (rc)
        return rc;
    if (argc > 1 && !strcmp(argv[1], "--bench")) {
        printf("T = 4096; median of 20 calls (CUDA events), TB/s = view bytes read + "
               "written / time\n");
        bench();
        gh_close();
        return test_main_end();
    }
    printf("max abs error vs the fp32 CPU reference; naive = max|bf16(ref) - ref|; "
           "bound = 2 naive + 1e-6 max|ref|\n");

    embed_case("embed V1000 H256", 1000, 256, 50, 256, 0);
    embed_case("embed V1000 H77 (scalar)", 1000, 77, 50, 77, 0);
    embed_case("embed V300 H256 -> column view", 300, 256, 41, 264, 8);
    embed_case("embed V300 H200 -> unaligned column view", 300, 200, 41, 203, 3);

    matmul_case("matmul 37x80x72", 37, 80, 72, 0, 0, 0);
    matmul_case("matmul 37x80x72 accumulate", 37, 80, 72, 0, 0, 1);
    matmul_case("matmul 37x80x72 column views x, y", 37, 80, 72, 24, 16, 0);
    matmul_case("matmul 37x80x72 column views, accumulate", 37, 80, 72, 24, 16, 1);
    matmul_case("matmul 512x1024x2048", 512, 1024, 2048, 0, 0, 0);
    matmul_case("matmul 512x1024x2048 accumulate, column views", 512, 1024, 2048, 24, 16, 1);

    test_upload_ahead();
    test_elementwise();
    test_norms();
    test_rope();
    test_conv();
    gates_case("gdn_gates T100 H48", 100, 48);
    gates_case("gdn_gates T301 H5", 301, 5);

    CHECK_EQ(df_backend_sync(gh_gpu), 0);
    gh_close();
    return test_main_end();
}
