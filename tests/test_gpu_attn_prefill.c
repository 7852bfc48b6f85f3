/* test_gpu_attn_prefill - the CUDA causal varlen attention (df_op_attention on
 * the CUDA backend, kernels/cuda/attn_prefill.cu) against the CPU fp32
 * reference (df_op_attention on the CPU backend) on the same bf16-rounded
 * values, through the public df_op_* API. Skips (77) without a GPU.
 *
 * Tolerance (KERNELS.md, FlashAttention's rule): per case, the GPU output's
 * max abs error vs the fp32 reference must be <= 2x the max abs error of the
 * same math done naively in bf16, plus 1e-6 * max|ref|. The naive bf16 math
 * (computed here): scores = q.k summed in fp32 from the bf16 q, k, times
 * scale; softmax in fp32; P rounded to bf16; O = sum P v in fp32, rounded to
 * bf16; with a gate, O * sigmoid(gate) rounded to bf16 again. NaN never
 * passes. Outputs are NaN-poisoned first (the whole backing buffer of the out
 * view), and every element outside the out view must still be poison
 * afterwards (nothing written out of bounds).
 *
 * Cases: head_dim 64 / 128 / 256; GQA 1/1, 4/1, 6/1 (Qwen3.5's 24/4), 8/1;
 * gate on / off; layouts: contiguous, fused (q and gate column views of one
 * [T, 2 nq D] buffer, k and v of one [T, 2 nkv D] buffer, out inside a wider
 * buffer), misaligned views (columns at odd offsets / odd strides: the
 * kernel's repack path); sequences of length 1, empty ones, lengths not
 * multiples of any tile, one of 1000+ tokens. Every case runs with the
 * automatic configuration and with each forced candidate configuration
 * (df_cuda_attention_set_variant), so the portable small-smem kernels are
 * tested on an H200 too, and v4, the sm_90a wgmma kernel (forced variants call df_cuda_attention_flash directly, so
 * the backend's CUDA-core fallback cannot stand in for them). The tuned
 * kernel must decline head_dim 96 with -ENOTSUP.
 *
 * Benchmark: `test_gpu_attn_prefill --bench` (CUDA events on the backend's
 * stream, median of 20 after 3 warm-ups) times the Qwen3.5-27B and Qwen3-32B
 * full-attention shapes for every configuration and prints ms and TFLOP/s
 * (causal FLOPs: 4 D nq sum_s L_s (L_s + 1) / 2). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "cuda/cuda_internal.h"
#include "gpu_harness.h"
#include "knobs.h"
#include "ops.h"

/* attn_prefill.cu's test hook: 0 automatic, v >= 1 forces candidate v - 1:
 * v1..v3 the mma.sync kernel's configurations, v4 the sm_90a wgmma kernel
 * (n/a on other GPUs and builds without the 90a target). */
void df_cuda_attention_set_variant(int v);
#define N_VARIANTS 4

static uint64_t rng = 20240917;

static float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

/* Variant 0: the public df_op_attention (what the model runs; the backend
 * falls back to its CUDA-core kernel only on -ENOTSUP). A forced variant
 * calls the tuned kernel's entry directly (same, already valid, arguments),
 * so a configuration this GPU cannot hold reports -ENOTSUP instead of being
 * silently replaced by the fallback. */
static int attn(df_backend *gpu, int var, const df_tensor *q, const df_tensor *k,
                const df_tensor *v, const int32_t *cu, int n_seq, int nq, int nkv, int D,
                float scale, const df_tensor *gate, df_tensor *out)
{
    if (var == 0)
        return df_op_attention(gpu, q, k, v, cu, n_seq, nq, nkv, D, scale, gate, out);
    df_cuda_attention_set_variant(var);
    int rc = df_cuda_attention_flash(gpu, q, k, v, cu, n_seq, nq, nkv, D, scale, gate, out);
    df_cuda_attention_set_variant(0);
    return rc;
}

enum { L_CONTIG = 0, L_FUSED = 1, L_MISALIGNED = 2 };

typedef struct acase {
    const char *name;
    int nq, nkv, D, gated, layout;
    int nseq;
    int lens[8];
} acase;

/* Which buffer and column each of q, k, v, gate, out uses. */
typedef struct place {
    int buf;
    int64_t col;
} place;

enum { TQ = 0, TK, TV, TG, TO, NT_ };

static void layout_of(const acase *c, int64_t *w, int *nbuf, place pl[NT_])
{
    int64_t cq = (int64_t)c->nq * c->D, ck = (int64_t)c->nkv * c->D;
    if (c->layout == L_FUSED) {
        /* qg [T, 2 cq]: q | gate; kv [T, 2 ck]: k | v; out in [T, cq + 64] */
        w[0] = 2 * cq, w[1] = 2 * ck, w[2] = cq + 64;
        *nbuf = 3;
        pl[TQ] = (place){0, 0}, pl[TG] = (place){0, cq};
        pl[TK] = (place){1, 0}, pl[TV] = (place){1, ck};
        pl[TO] = (place){2, 0};
    } else if (c->layout == L_MISALIGNED) {
        /* q 8-byte aligned rows; k odd stride; v fine; gate and out odd column */
        w[0] = cq + 8, w[1] = ck + 3, w[2] = ck + 16, w[3] = cq + 2, w[4] = cq + 1;
        *nbuf = 5;
        pl[TQ] = (place){0, 4}, pl[TK] = (place){1, 0}, pl[TV] = (place){2, 8};
        pl[TG] = (place){3, 1}, pl[TO] = (place){4, 1};
    } else {
        w[0] = cq, w[1] = ck, w[2] = ck, w[3] = cq, w[4] = cq;
        *nbuf = 5;
        for (int t = 0; t < NT_; t++)
            pl[t] = (place){t, 0};
    }
}

static void run_case(const acase *c, df_backend *cpu, df_backend *gpu)
{
    int nq = c->nq, nkv = c->nkv, D = c->D, grp = nq / nkv;
    int32_t cu[9];
    cu[0] = 0;
    for (int s = 0; s < c->nseq; s++)
        cu[s + 1] = cu[s] + c->lens[s];
    int64_t T = cu[c->nseq], cq = (int64_t)nq * D, ck = (int64_t)nkv * D;
    float scale = 1.0f / sqrtf((float)D);
    int64_t cols[NT_] = {cq, ck, ck, cq, cq};

    /* logical inputs, bf16 values (never zero) and their f32 copies */
    float *f[NT_];
    for (int t = 0; t < NT_; t++)
        f[t] = gh_xmalloc((size_t)(T * cols[t]) * 4);
    for (int t = TQ; t <= TG; t++) {
        float amp = t == TQ ? 1.5f : t == TG ? 2.0f : 1.0f;
        for (int64_t i = 0; i < T * cols[t]; i++) {
            float x = test_randn(&rng) * amp;
            if (x == 0.0f)
                x = 0.01f;
            f[t][i] = gh_rb(x);
        }
    }

    /* CPU fp32 reference on contiguous copies */
    df_tensor cten[NT_];
    for (int t = 0; t < NT_; t++)
        cten[t] = df_tensor_2d(f[t], DF_DTYPE_F32, T, cols[t]);
    float *ref = f[TO];
    CHECK_EQ(df_op_attention(cpu, &cten[TQ], &cten[TK], &cten[TV], cu, c->nseq, nq, nkv, D, scale,
                             c->gated ? &cten[TG] : NULL, &cten[TO]),
             0);

    /* naive bf16 */
    float *nv = gh_xmalloc((size_t)(T * cq) * 4), *sc = gh_xmalloc((size_t)(T + 1) * 4),
          *acc = gh_xmalloc((size_t)D * 4);
    for (int s = 0; s < c->nseq; s++)
        for (int64_t i = cu[s]; i < cu[s + 1]; i++)
            for (int h = 0; h < nq; h++) {
                int g = h / grp;
                const float *qi = f[TQ] + i * cq + (int64_t)h * D;
                int64_t n = i - cu[s] + 1;
                float mx = -INFINITY;
                for (int64_t j = 0; j < n; j++) {
                    const float *kj = f[TK] + (cu[s] + j) * ck + (int64_t)g * D;
                    float d = 0.0f;
                    for (int e = 0; e < D; e++)
                        d += qi[e] * kj[e];
                    sc[j] = d * scale;
                    mx = sc[j] > mx ? sc[j] : mx;
                }
                float sum = 0.0f;
                for (int64_t j = 0; j < n; j++)
                    sum += (sc[j] = expf(sc[j] - mx));
                memset(acc, 0, (size_t)D * 4);
                for (int64_t j = 0; j < n; j++) {
                    float p = gh_rb(sc[j] / sum);
                    const float *vj = f[TV] + (cu[s] + j) * ck + (int64_t)g * D;
                    for (int e = 0; e < D; e++)
                        acc[e] += p * vj[e];
                }
                float *o = nv + i * cq + (int64_t)h * D;
                const float *gt = f[TG] + i * cq + (int64_t)h * D;
                for (int e = 0; e < D; e++)
                    o[e] = c->gated ? gh_rb(gh_rb(acc[e]) * sigm(gt[e])) : gh_rb(acc[e]);
            }
    gh_diff dn;
    gh_diff_f32(&dn, nv, ref, T * cq, NULL);
    double nerr = dn.err, tol = 2 * nerr + 1e-6 * dn.ref_max;

    /* device buffers: junk around the views, the out buffer all poison */
    int64_t w[5];
    int nbuf;
    place pl[NT_];
    layout_of(c, w, &nbuf, pl);
    gh_buf b[5];
    for (int i = 0; i < nbuf; i++) {
        b[i] = gh_buf_new(T * w[i], 0, 64);
        for (int64_t e = 0; e < T * w[i]; e++) /* junk: would show if read */
            gh_buf_set(&b[i], e, gh_draw(GH_N01, &rng, 100.0f));
        CHECK(b[i].d != NULL);
    }
    gh_buf *out = &b[pl[TO].buf];
    for (int64_t e = 0; e < out->n; e++)
        ((uint16_t *)out->img)[e] = 0xffff; /* bf16 NaN */
    for (int t = TQ; t <= TG; t++)
        for (int64_t r = 0; r < T; r++)
            for (int64_t j = 0; j < cols[t]; j++)
                gh_buf_set(&b[pl[t].buf], r * w[pl[t].buf] + pl[t].col + j, f[t][r * cols[t] + j]);
    for (int i = 0; i < nbuf; i++)
        gh_buf_upload(&b[i]);
    df_tensor gten[NT_];
    for (int t = 0; t < NT_; t++)
        gten[t] = gh_tens(&b[pl[t].buf], gh_v2(pl[t].col, T, cols[t], w[pl[t].buf]), 1);
    /* the out view's reference, where gh_view_diff looks for it */
    gh_view vo = gh_v2(pl[TO].col, T, cq, w[pl[TO].buf]);
    for (int64_t r = 0; r < T; r++)
        for (int64_t j = 0; j < cq; j++)
            out->h[r * w[pl[TO].buf] + pl[TO].col + j] = ref[r * cq + j];
    const gh_cmp_opts inf_eq = {NULL, 0, 1};

    printf("%-34s T=%-5lld naive %.2e |", c->name, (long long)T, nerr);
    int ok = 1;
    for (int var = 0; var <= N_VARIANTS; var++) {
        gh_buf_upload(out); /* re-poison the out buffer for every run */
        int rc = attn(gpu, var, &gten[TQ], &gten[TK], &gten[TV], cu, c->nseq, nq, nkv, D, scale,
                      c->gated ? &gten[TG] : NULL, &gten[TO]);
        if (rc == -ENOTSUP && var > 0) { /* forced config larger than this GPU allows */
            printf(" v%d n/a", var);
            continue;
        }
        CHECK_EQ(rc, 0);
        CHECK_EQ(df_backend_sync(gpu), 0);
        gh_diff d;
        int64_t oob = 0; /* outside the out view: still poison */
        gh_view_diff(out, vo, NULL, &inf_eq, &d, &oob);
        int vok = gh_diff_ok(&d, tol) && !oob && rc == 0;
        printf(" v%d %.2e%s", var, d.err, vok ? "" : "(FAIL)");
        if (!vok) {
            printf("[nan=%lld inf=%lld oob=%lld tol=%.2e]", (long long)d.nan, (long long)d.bad,
                   (long long)oob, tol);
            gh_diff_report(c->name, &d, tol);
        }
        ok = ok && vok;
    }
    printf("  %s\n", ok ? "ok" : "FAILED");
    CHECK(ok);

    for (int i = 0; i < nbuf; i++)
        gh_buf_free(&b[i]);
    for (int t = 0; t < NT_; t++)
        free(f[t]);
    free(nv), free(sc), free(acc);
}

/* ---- benchmark ---- */

static void bench_one(df_backend *gpu, const char *name, int nq, int nkv, int D, int gated,
                      int nseq, const int *lens)
{
    int32_t cu[17];
    cu[0] = 0;
    double flops = 0;
    for (int s = 0; s < nseq; s++) {
        cu[s + 1] = cu[s] + lens[s];
        flops += 4.0 * D * nq * (double)lens[s] * (lens[s] + 1) / 2;
    }
    int64_t T = cu[nseq], cq = (int64_t)nq * D, ck = (int64_t)nkv * D;
    /* the model's layout: q | gate in one buffer (Qwen3.5), k | v in one */
    int64_t wq = gated ? 2 * cq : cq;
    uint16_t *qg = df_backend_alloc(gpu, (size_t)(T * wq) * 2),
             *kv = df_backend_alloc(gpu, (size_t)(T * 2 * ck) * 2),
             *out = df_backend_alloc(gpu, (size_t)(T * cq) * 2);
    if (!qg || !kv || !out) {
        fprintf(stderr, "bench %s: out of device memory\n", name);
        df_test_failures++;
        return;
    }
    CHECK_EQ(df_backend_fill_uniform(gpu, qg, DF_DTYPE_BF16, T * wq, 1, -2.0f, 2.0f), 0);
    CHECK_EQ(df_backend_fill_uniform(gpu, kv, DF_DTYPE_BF16, T * 2 * ck, 2, -2.0f, 2.0f), 0);
    df_tensor tqg = df_tensor_2d(qg, DF_DTYPE_BF16, T, wq), tkv = df_tensor_2d(kv, DF_DTYPE_BF16, T, 2 * ck),
              to = df_tensor_2d(out, DF_DTYPE_BF16, T, cq);
    df_tensor tq = df_tensor_cols(&tqg, 0, cq), tg = df_tensor_cols(&tqg, gated ? cq : 0, cq),
              tk = df_tensor_cols(&tkv, 0, ck), tv = df_tensor_cols(&tkv, ck, ck);
    cudaStream_t st = df_cuda_stream(gpu);
    cudaEvent_t ev[2];
    if (cudaEventCreate(&ev[0]) != cudaSuccess || cudaEventCreate(&ev[1]) != cudaSuccess) {
        fprintf(stderr, "bench: cudaEventCreate failed\n");
        df_test_failures++;
        return;
    }
    float scale = 1.0f / sqrtf((float)D);
    printf("%-40s T=%-6lld", name, (long long)T);
    for (int var = 0; var <= N_VARIANTS; var++) {
        enum { WARM = 3, RUNS = 20 };
        float ms[RUNS];
        int rc = 0;
        for (int i = 0; i < WARM + RUNS && rc == 0; i++) {
            if (i >= WARM && cudaEventRecord(ev[0], st) != cudaSuccess)
                rc = -EIO;
            if (!rc)
                rc = attn(gpu, var, &tq, &tk, &tv, cu, nseq, nq, nkv, D, scale,
                          gated ? &tg : NULL, &to);
            if (!rc && i >= WARM) {
                if (cudaEventRecord(ev[1], st) != cudaSuccess ||
                    cudaEventSynchronize(ev[1]) != cudaSuccess ||
                    cudaEventElapsedTime(&ms[i - WARM], ev[0], ev[1]) != cudaSuccess)
                    rc = -EIO;
            }
        }
        if (rc == -ENOTSUP && var > 0) {
            printf(" | v%d n/a", var);
            continue;
        }
        CHECK_EQ(rc, 0);
        if (rc)
            break;
        float med = gh_median_f(ms, RUNS);
        printf(" | v%d %.3f ms %.0f TFLOP/s", var, med, flops / (med * 1e-3) / 1e12);
    }
    printf("\n");
    cudaEventDestroy(ev[0]), cudaEventDestroy(ev[1]);
    CHECK_EQ(df_backend_sync(gpu), 0);
    df_backend_free(gpu, qg), df_backend_free(gpu, kv), df_backend_free(gpu, out);
}

static void bench(df_backend *gpu)
{
    printf("v0 = automatic choice; v1..v%d = forced candidates (attn_prefill.cu)\n", N_VARIANTS);
    static const int l8k[] = {8192}, l2x4k[] = {4096, 4096}, l16k[] = {8192, 8192},
                     lmix[] = {4096, 6144, 6144}, l4k[] = {4096};
    bench_one(gpu, "qwen3.5 24/4 D256 gate 1x4096", 24, 4, 256, 1, 1, l4k);
    bench_one(gpu, "qwen3.5 24/4 D256 gate 2x4096", 24, 4, 256, 1, 2, l2x4k);
    bench_one(gpu, "qwen3.5 24/4 D256 gate 1x8192", 24, 4, 256, 1, 1, l8k);
    bench_one(gpu, "qwen3.5 24/4 D256 gate 4k+6k+6k", 24, 4, 256, 1, 3, lmix);
    bench_one(gpu, "qwen3.5 24/4 D256 gate 2x8192", 24, 4, 256, 1, 2, l16k);
    bench_one(gpu, "qwen3 64/8 D128 2x4096", 64, 8, 128, 0, 2, l2x4k);
    bench_one(gpu, "qwen3 64/8 D128 1x8192", 64, 8, 128, 0, 1, l8k);
    bench_one(gpu, "qwen3 64/8 D128 2x8192", 64, 8, 128, 0, 2, l16k);
    bench_one(gpu, "D64 32/8 1x8192", 32, 8, 64, 0, 1, l8k);
}

int main(int argc, char **argv)
{
    int rc = gh_open(0);
    if (rc)
        return rc;
    df_backend *gpu = gh_gpu, *cpu = gh_cpu;
    if (argc > 1 && !strcmp(argv[1], "--bench")) {
        bench(gpu);
        gh_close();
        return test_main_end();
    }

    if (df_knob_int(DF_KNOB_CUDA_FALLBACK))
        printf("note: DFLASH_CUDA_FALLBACK=1: v0 runs the CUDA-core fallback, v1.. the tuned "
               "kernel\n");
    { /* head_dim 96: the tuned kernel declines (the backend then falls back) */
        int T = 4, nq = 2, nkv = 1, D = 96;
        uint16_t *q = df_backend_alloc(gpu, (size_t)T * nq * D * 2),
                 *kv = df_backend_alloc(gpu, (size_t)T * nkv * D * 2),
                 *o = df_backend_alloc(gpu, (size_t)T * nq * D * 2);
        CHECK(q && kv && o);
        df_tensor tq = df_tensor_2d(q, DF_DTYPE_BF16, T, nq * D),
                  tk = df_tensor_2d(kv, DF_DTYPE_BF16, T, nkv * D),
                  to = df_tensor_2d(o, DF_DTYPE_BF16, T, nq * D);
        int32_t cu[2] = {0, T};
        CHECK_EQ(df_cuda_attention_flash(gpu, &tq, &tk, &tk, cu, 1, nq, nkv, D, 0.1f, NULL, &to),
                 -ENOTSUP);
        df_backend_free(gpu, q), df_backend_free(gpu, kv), df_backend_free(gpu, o);
    }

    printf("max abs error vs the fp32 reference: naive bf16 | GPU per config (v0 auto)\n");
    static const acase cases[] = {
        {"D64 2/2 ragged", 2, 2, 64, 0, L_CONTIG, 6, {1, 0, 37, 200, 129, 0}},
        {"D64 8/1 gate fused", 8, 1, 64, 1, L_FUSED, 3, {300, 1, 65}},
        {"D64 4/2 misaligned", 4, 2, 64, 0, L_MISALIGNED, 3, {0, 90, 33}},
        {"D128 4/1 gate fused long", 4, 1, 128, 1, L_FUSED, 3, {1030, 0, 17}},
        {"D128 16/2 qwen3-like fused", 16, 2, 128, 0, L_FUSED, 4, {513, 255, 1, 128}},
        {"D128 2/2 contiguous", 2, 2, 128, 0, L_CONTIG, 3, {127, 128, 129}},
        {"D128 4/2 gate misaligned", 4, 2, 128, 1, L_MISALIGNED, 3, {70, 1, 200}},
        {"D256 24/4 qwen3.5 gate fused", 24, 4, 256, 1, L_FUSED, 5, {1, 0, 300, 129, 64}},
        {"D256 2/1 gate fused long", 2, 1, 256, 1, L_FUSED, 3, {1100, 7, 0}},
        {"D256 2/2 contiguous", 2, 2, 256, 0, L_CONTIG, 4, {127, 128, 129, 1}},
        {"D256 8/1 gate", 8, 1, 256, 1, L_CONTIG, 2, {65, 200}},
        {"D256 4/1 gate misaligned", 4, 1, 256, 1, L_MISALIGNED, 2, {150, 3}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i], cpu, gpu);
    gh_close();
    return test_main_end();
}
