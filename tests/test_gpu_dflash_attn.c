/* test_gpu_dflash_attn - the CUDA DFlash drafter attention (kernels/cuda/
 * dflash_attn.h), forward and backward, against the CPU reference
 * (df_op_dflash_attn / _bwd) run in fp32 on the same bf16 values.
 * Skips (77) without a GPU.
 *
 * Tolerance (KERNELS.md): for every output, the GPU's max abs error vs the
 * fp32 reference must be at most 2x that of the same math done naively in
 * bf16 (computed here: every GEMM-shaped product takes bf16 inputs, sums in
 * fp32 and rounds its result to bf16 - scores, P, O, dP, dS, dq, dk, dv -
 * as an unfused bf16 implementation would), plus 1e-6 of the reference's
 * magnitude. Structural zeros are exact: padding rows (out 0, lse -inf,
 * dq 0), padding blocks' dkb/dvb, context keys nobody sees (dkc = dvc = 0).
 * Outputs and the backward's workspace are NaN-poisoned first; a NaN
 * anywhere fails.
 * The GPU backward runs on the GPU's own out/lse (as training does), the
 * CPU backward on the reference's. First pass: the default forward and
 * backward (impl 0); then each backward (simt: CUDA cores; mma4: tensor
 * cores; wg2, wg2f, wg3: wgmma) on the default forward's out/lse; then the
 * backward that impl 0 selects, once as built in (wg3 on a compute
 * capability 9.0 device, mma4 elsewhere) and once each switched to mma4,
 * wg2, wg2f and wg3 by df_cuda_dflash_set_bwd_impl (the hook behind
 * DFLASH_ATTN_BWD), each run twice and required bitwise equal
 * (determinism); wg2's and wg2f's "==mma4" are reported, not required; so
 * are wg2f's "dq/dkc/dvc==wg2", expected yes, and "dkb/dvb==wg2"; the
 * retired implementations' values are rejected (-EINVAL) by the hook and
 * by both passes; then each forward, twice, required bitwise equal.
 * wg2 (mma4 with its forward, dQ and context dK/dV on Hopper wgmma) runs
 * its own kernels only on a compute capability 9.0 device, and mma4's
 * elsewhere (its dQ in the same longest-first order); wg2f (wg2 with Di and
 * the block-key dK/dV inside its wgmma dQ pass) folds only where
 * block_size x nq / nkv <= 64 (the bs40 configs with group 2 and 4 run
 * wg2's kernels: the fallback) and is wg2 elsewhere. The bs64 group-1
 * configs fill the whole 64-key block tile. wg3 (wg2f whose context dK/dV
 * pass stores dS, from which its dQ is computed) runs its own passes where
 * block_size x group == 64, the group a power of two >= 4 and block_size
 * <= 16 (the 8/2 and 32/8 bs16 configs and the 16/2 bs8 ones, whose block
 * tiles have keys past block_size), and is wg2f elsewhere. The workspace is
 * sized for wg3, the largest. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "cuda/device.h"
#include "cuda/dflash_attn.h"
#include "gpu_harness.h"
#include "ops.h"
#include "train_ops.h"

/* every implementation (args.impl), and the retired values (-EINVAL) */
static const int impls[] = {DF_CUDA_DFLASH_IMPL_SIMT, DF_CUDA_DFLASH_IMPL_MMA4, DF_CUDA_DFLASH_IMPL_WG2,
                            DF_CUDA_DFLASH_IMPL_WG2F, DF_CUDA_DFLASH_IMPL_WG3};
static const int retired[] = {2, 3, 4, 6, 7}; /* mma, mma2, mma3, mma5, wg */

/* name of an implementation (args.impl) in the output */
static const char *impl_name(int impl)
{
    return impl == DF_CUDA_DFLASH_IMPL_WG3    ? "wg3"
           : impl == DF_CUDA_DFLASH_IMPL_WG2F ? "wg2f"
           : impl == DF_CUDA_DFLASH_IMPL_WG2  ? "wg2"
           : impl == DF_CUDA_DFLASH_IMPL_MMA4 ? "mma4"
                                              : "simt";
}

static uint64_t rng = 4242;

#define CUDA_OK(x)                                                                     \
    do {                                                                               \
        cudaError_t e_ = (x);                                                          \
        if (e_ != cudaSuccess) {                                                       \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x,                 \
                    cudaGetErrorString(e_));                                           \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

typedef struct cfg {
    const char *name;
    int S, nb, bs, W, nq, nkv, D;
    int ndocs;
    int doc_end[8];
} cfg;

/* Visible context range of row qo of block b: [lo, hi). */
static void ctx_range(int anc, int ds, int W, int qo, int *lo, int *hi)
{
    int l = ds;
    if (W > 0 && anc + qo - (W - 1) > l)
        l = anc + qo - (W - 1);
    *lo = l < anc ? l : anc;
    *hi = anc;
}

/* got vs ref (gh_diff_f32): infinities must match (lse of padding rows is
 * -inf); zrow (may be NULL): per row of cols elements, 1 = structurally
 * zero (must be exactly 0 in both). Zeros that are only numerical (a row
 * seeing one key has dS = P (dP - Di) = 0 in exact arithmetic) are
 * compared by tolerance. */
static void cmp(gh_diff *e, const float *ref, const float *got, int64_t n, const uint8_t *zrow,
                int64_t cols)
{
    gh_cmp_opts o = {zrow, cols, 1};
    gh_diff_f32(e, got, ref, n, &o);
}

/* One output of the GPU (g) against the reference: error within 2x that of
 * naive bf16 (nv) + 1e-6 max|ref|, no NaN, structural zeros (z) exact.
 * Prints " nm err" (" nm err/naive" with show_naive) and what failed. */
static int out_ok(const char *nm, const float *ref, const float *g, const float *nv, int64_t n,
                  const uint8_t *z, int64_t cols, int show_naive)
{
    gh_diff eg, en;
    cmp(&eg, ref, g, n, z, cols);
    cmp(&en, ref, nv, n, NULL, 1);
    double tol = 2 * en.err + 1e-6 * eg.ref_max;
    if (show_naive)
        printf(" %s %.1e/%.1e", nm, eg.err, en.err);
    else
        printf(" %s %.1e", nm, eg.err);
    if (eg.nan || eg.bad || eg.err > tol) {
        printf("(FAIL nan=%lld nonzero=%lld)", (long long)eg.nan, (long long)eg.bad);
        return 0;
    }
    return 1;
}

/* One output of the attention: name, device bf16, host fp32 copy, the CPU
 * reference, the naive reference, elements, zero-row mask, columns. */
typedef struct grad_out {
    const char *nm;
    uint16_t *dev;
    float *g, *ref, *nv;
    int64_t n;
    const uint8_t *z;
    int64_t cols;
} grad_out;

/* The backward of a with every gradient (outs[1..5]) and the workspace
 * poisoned first; the gradients' bf16 bits into dst, one after the other. */
static void bwd_into(const df_cuda_dflash_args *a, const grad_out *outs, void *ws, size_t ws_bytes,
                     uint16_t *dst)
{
    for (int t = 1; t < 6; t++)
        CUDA_OK(cudaMemset(outs[t].dev, 0xff, outs[t].n * 2));
    CUDA_OK(cudaMemset(ws, 0xff, ws_bytes));
    CHECK_EQ(df_cuda_dflash_bwd(a, 0), 0);
    CUDA_OK(cudaDeviceSynchronize());
    for (int t = 1; t < 6; t++) {
        CUDA_OK(cudaMemcpy(dst, outs[t].dev, outs[t].n * 2, cudaMemcpyDeviceToHost));
        dst += outs[t].n;
    }
}

/* The gradients in src (bwd_into's order) against the CPU reference. */
static int grads_ok(grad_out *outs, const uint16_t *src)
{
    int ok = 1;
    for (int t = 1; t < 6; t++) {
        for (int64_t i = 0; i < outs[t].n; i++)
            outs[t].g[i] = gh_bf2f(src[i]);
        src += outs[t].n;
        ok = out_ok(outs[t].nm, outs[t].ref, outs[t].g, outs[t].nv, outs[t].n, outs[t].z,
                    outs[t].cols, 0) && ok;
    }
    return ok;
}

static void run_cfg(const cfg *c, df_backend *be)
{
    int S = c->S, nb = c->nb, bs = c->bs, W = c->W, nq = c->nq, nkv = c->nkv, D = c->D;
    int rows = nb * bs, grp = nq / nkv;
    int64_t nQ = (int64_t)rows * nq * D, nC = (int64_t)S * nkv * D, nB = (int64_t)rows * nkv * D;
    float scale = 1.0f / sqrtf((float)D);
    int32_t *anc = gh_xmalloc(nb * 4), *dst = gh_xmalloc(nb * 4);
    uint8_t *val = gh_xmalloc(nb);
    /* anchors: document edges first, then random, padding blocks last */
    int k = 0;
    for (int d = 0; d < c->ndocs && k < nb; d++) {
        int s0 = d ? c->doc_end[d - 1] : 0, e0 = c->doc_end[d];
        int cand[3] = {s0, s0 + 1, e0 - 1};
        for (int t = 0; t < 3 && k < nb - 2; t++, k++)
            anc[k] = cand[t], dst[k] = s0, val[k] = 1;
    }
    for (; k < nb - 2; k++) {
        int p = (int)(test_rand(&rng) % (uint64_t)S), d = 0;
        while (c->doc_end[d] <= p)
            d++;
        anc[k] = p, dst[k] = d ? c->doc_end[d - 1] : 0, val[k] = 1;
    }
    for (; k < nb; k++) /* padding: garbage that must never be read */
        anc[k] = -7, dst[k] = 123456, val[k] = 0;
    /* swap a padding block into the middle */
    {
        int m = nb / 2;
        int32_t ta = anc[m], td = dst[m];
        uint8_t tv = val[m];
        anc[m] = anc[nb - 1], dst[m] = dst[nb - 1], val[m] = val[nb - 1];
        anc[nb - 1] = ta, dst[nb - 1] = td, val[nb - 1] = tv;
    }

    /* inputs: random bf16, never zero */
    uint16_t *hq = gh_xmalloc(nQ * 2), *hkc = gh_xmalloc(nC * 2), *hvc = gh_xmalloc(nC * 2),
             *hkb = gh_xmalloc(nB * 2), *hvb = gh_xmalloc(nB * 2), *hdo = gh_xmalloc(nQ * 2);
    float *fq = gh_xmalloc(nQ * 4), *fkc = gh_xmalloc(nC * 4), *fvc = gh_xmalloc(nC * 4),
          *fkb = gh_xmalloc(nB * 4), *fvb = gh_xmalloc(nB * 4), *fdo = gh_xmalloc(nQ * 4);
    struct {
        uint16_t *h;
        float *f;
        int64_t n;
        float amp;
    } in[6] = {{hq, fq, nQ, 2.0f}, {hkc, fkc, nC, 1.0f}, {hvc, fvc, nC, 1.0f},
               {hkb, fkb, nB, 1.0f}, {hvb, fvb, nB, 1.0f}, {hdo, fdo, nQ, 1.0f}};
    for (int t = 0; t < 6; t++)
        for (int64_t i = 0; i < in[t].n; i++) {
            float x = test_randn(&rng) * in[t].amp;
            if (x == 0.0f)
                x = 0.01f;
            in[t].h[i] = gh_f2bf(x);
            in[t].f[i] = gh_bf2f(in[t].h[i]);
        }

    /* CPU fp32 reference */
    float *ro = gh_xmalloc(nQ * 4), *rl = gh_xmalloc((int64_t)rows * nq * 4);
    float *rdq = gh_xmalloc(nQ * 4), *rdkc = gh_xmalloc(nC * 4), *rdvc = gh_xmalloc(nC * 4),
          *rdkb = gh_xmalloc(nB * 4), *rdvb = gh_xmalloc(nB * 4);
    df_tensor tq = df_tensor_2d(fq, DF_DTYPE_F32, rows, nq * D),
              tkc = df_tensor_2d(fkc, DF_DTYPE_F32, S, nkv * D),
              tvc = df_tensor_2d(fvc, DF_DTYPE_F32, S, nkv * D),
              tkb = df_tensor_2d(fkb, DF_DTYPE_F32, rows, nkv * D),
              tvb = df_tensor_2d(fvb, DF_DTYPE_F32, rows, nkv * D),
              tdo = df_tensor_2d(fdo, DF_DTYPE_F32, rows, nq * D),
              to = df_tensor_2d(ro, DF_DTYPE_F32, rows, nq * D),
              tl = df_tensor_2d(rl, DF_DTYPE_F32, rows, nq),
              tdq = df_tensor_2d(rdq, DF_DTYPE_F32, rows, nq * D),
              tdkc = df_tensor_2d(rdkc, DF_DTYPE_F32, S, nkv * D),
              tdvc = df_tensor_2d(rdvc, DF_DTYPE_F32, S, nkv * D),
              tdkb = df_tensor_2d(rdkb, DF_DTYPE_F32, rows, nkv * D),
              tdvb = df_tensor_2d(rdvb, DF_DTYPE_F32, rows, nkv * D);
    df_dflash_blocks blk = {nb, bs, anc, dst, val, W};
    CHECK_EQ(df_op_dflash_attn(be, &tq, &tkc, &tvc, &tkb, &tvb, &blk, nq, nkv, D, scale, &to, &tl),
             0);
    CHECK_EQ(df_op_dflash_attn_bwd(be, &tq, &tkc, &tvc, &tkb, &tvb, &blk, nq, nkv, D, scale, &to,
                                   &tl, &tdo, &tdq, &tdkc, &tdvc, &tdkb, &tdvb),
             0);

    /* naive bf16 baseline */
    float *no = gh_xmalloc(nQ * 4), *nl = gh_xmalloc((int64_t)rows * nq * 4);
    float *ndq = gh_xmalloc(nQ * 4), *ndkc = gh_xmalloc(nC * 4), *ndvc = gh_xmalloc(nC * 4),
          *ndkb = gh_xmalloc(nB * 4), *ndvb = gh_xmalloc(nB * 4);
    int maxk = S + bs;
    float *sc = gh_xmalloc(maxk * 4), *pp = gh_xmalloc(maxk * 4), *acc = gh_xmalloc(D * 4);
    const float **kp = gh_xmalloc(maxk * sizeof(float *));
    const float **vp = gh_xmalloc(maxk * sizeof(float *));
    float **dkp = gh_xmalloc(maxk * sizeof(float *)), **dvp = gh_xmalloc(maxk * sizeof(float *));
    for (int b = 0; b < nb; b++)
        for (int qo = 0; qo < bs; qo++)
            for (int h = 0; h < nq; h++) {
                int r = b * bs + qo, g = h / grp;
                float *o = no + ((int64_t)r * nq + h) * D, *dq = ndq + ((int64_t)r * nq + h) * D;
                if (!val[b]) {
                    nl[(int64_t)r * nq + h] = -INFINITY;
                    continue;
                }
                int lo, hi, n = 0;
                ctx_range(anc[b], dst[b], W, qo, &lo, &hi);
                for (int j = lo; j < hi; j++, n++) {
                    int64_t off = ((int64_t)j * nkv + g) * D;
                    kp[n] = fkc + off, vp[n] = fvc + off, dkp[n] = ndkc + off, dvp[n] = ndvc + off;
                }
                int kend = W > 0 ? qo + 1 : bs;
                for (int j = 0; j < kend; j++, n++) {
                    int64_t off = ((int64_t)(b * bs + j) * nkv + g) * D;
                    kp[n] = fkb + off, vp[n] = fvb + off, dkp[n] = ndkb + off, dvp[n] = ndvb + off;
                }
                const float *qi = fq + ((int64_t)r * nq + h) * D, *doi = fdo + ((int64_t)r * nq + h) * D;
                float mx = -INFINITY;
                for (int j = 0; j < n; j++) {
                    float s = 0;
                    for (int d = 0; d < D; d++)
                        s += qi[d] * kp[j][d];
                    sc[j] = gh_rb(gh_rb(s) * scale);
                    mx = sc[j] > mx ? sc[j] : mx;
                }
                float sum = 0;
                for (int j = 0; j < n; j++)
                    sum += (pp[j] = expf(sc[j] - mx));
                nl[(int64_t)r * nq + h] = mx + logf(sum);
                memset(acc, 0, D * 4);
                for (int j = 0; j < n; j++) {
                    pp[j] = gh_rb(pp[j] / sum);
                    for (int d = 0; d < D; d++)
                        acc[d] += pp[j] * vp[j][d];
                }
                float Di = 0;
                for (int d = 0; d < D; d++) {
                    o[d] = gh_rb(acc[d]);
                    Di += o[d] * doi[d];
                }
                Di = gh_rb(Di);
                memset(acc, 0, D * 4);
                for (int j = 0; j < n; j++) {
                    float dp = 0;
                    for (int d = 0; d < D; d++)
                        dp += doi[d] * vp[j][d];
                    float ds = gh_rb(pp[j] * (gh_rb(dp) - Di));
                    for (int d = 0; d < D; d++) {
                        acc[d] += ds * kp[j][d];
                        dkp[j][d] += ds * qi[d];
                        dvp[j][d] += pp[j] * doi[d];
                    }
                }
                for (int d = 0; d < D; d++)
                    dq[d] = gh_rb(acc[d] * scale);
            }
    for (int64_t i = 0; i < nC; i++)
        ndkc[i] = gh_rb(ndkc[i] * scale), ndvc[i] = gh_rb(ndvc[i]);
    for (int64_t i = 0; i < nB; i++)
        ndkb[i] = gh_rb(ndkb[i] * scale), ndvb[i] = gh_rb(ndvb[i]);

    /* GPU */
    uint16_t *dq_, *dkc_, *dvc_, *dkb_, *dvb_, *ddo_, *dout_, *dgq, *dgkc, *dgvc, *dgkb, *dgvb;
    float *dlse;
    int32_t *danc, *ddst;
    uint8_t *dval;
    CUDA_OK(cudaMalloc((void **)&dq_, nQ * 2));
    CUDA_OK(cudaMalloc((void **)&dkc_, nC * 2));
    CUDA_OK(cudaMalloc((void **)&dvc_, nC * 2));
    CUDA_OK(cudaMalloc((void **)&dkb_, nB * 2));
    CUDA_OK(cudaMalloc((void **)&dvb_, nB * 2));
    CUDA_OK(cudaMalloc((void **)&ddo_, nQ * 2));
    CUDA_OK(cudaMalloc((void **)&dout_, nQ * 2));
    CUDA_OK(cudaMalloc((void **)&dgq, nQ * 2));
    CUDA_OK(cudaMalloc((void **)&dgkc, nC * 2));
    CUDA_OK(cudaMalloc((void **)&dgvc, nC * 2));
    CUDA_OK(cudaMalloc((void **)&dgkb, nB * 2));
    CUDA_OK(cudaMalloc((void **)&dgvb, nB * 2));
    CUDA_OK(cudaMalloc((void **)&dlse, (size_t)rows * nq * 4));
    CUDA_OK(cudaMalloc((void **)&danc, nb * 4));
    CUDA_OK(cudaMalloc((void **)&ddst, nb * 4));
    CUDA_OK(cudaMalloc((void **)&dval, nb));
    CUDA_OK(cudaMemcpy(dq_, hq, nQ * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dkc_, hkc, nC * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dvc_, hvc, nC * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dkb_, hkb, nB * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dvb_, hvb, nB * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(ddo_, hdo, nQ * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(danc, anc, nb * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(ddst, dst, nb * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dval, val, nb, cudaMemcpyHostToDevice));
    /* poison every output (0xffff: bf16 NaN; 0xffffffff: f32 NaN) */
    CUDA_OK(cudaMemset(dout_, 0xff, nQ * 2));
    CUDA_OK(cudaMemset(dlse, 0xff, (size_t)rows * nq * 4));
    CUDA_OK(cudaMemset(dgq, 0xff, nQ * 2));
    CUDA_OK(cudaMemset(dgkc, 0xff, nC * 2));
    CUDA_OK(cudaMemset(dgvc, 0xff, nC * 2));
    CUDA_OK(cudaMemset(dgkb, 0xff, nB * 2));
    CUDA_OK(cudaMemset(dgvb, 0xff, nB * 2));
    df_cuda_dflash_args a;
    memset(&a, 0, sizeof a);
    a.S = S, a.n_blocks = nb, a.block_size = bs, a.window = W, a.nq = nq, a.nkv = nkv;
    a.head_dim = D, a.scale = scale;
    a.anchor = danc, a.doc_start = ddst, a.valid = dval;
    a.q = dq_, a.kc = dkc_, a.vc = dvc_, a.kb = dkb_, a.vb = dvb_;
    a.out = dout_, a.lse = dlse, a.dout = ddo_;
    a.dq = dgq, a.dkc = dgkc, a.dvc = dgvc, a.dkb = dgkb, a.dvb = dgvb;
    /* an explicit workspace, NaN-poisoned before each backward below: a pass
     * that leaves its part of the scratch unwritten (the context dK/dV
     * partials) cannot pass on an earlier run's values */
    /* sized for WG3 (the largest: every other backward's plus its stored dS) */
    a.impl = DF_CUDA_DFLASH_IMPL_WG3;
    size_t wsb = df_cuda_dflash_bwd_workspace_bytes(&a);
    a.impl = 0;
    void *dws;
    CUDA_OK(cudaMalloc(&dws, wsb));
    CUDA_OK(cudaMemset(dws, 0xff, wsb));
    a.workspace = dws;
    CHECK_EQ(df_cuda_dflash_fwd(&a, 0), 0);
    CHECK_EQ(df_cuda_dflash_bwd(&a, 0), 0);
    CUDA_OK(cudaDeviceSynchronize());

    /* structural zeros: rows of padding blocks; context keys nobody sees */
    uint8_t *zq = gh_xmalloc(rows), *zc = gh_xmalloc(S);
    for (int r = 0; r < rows; r++)
        zq[r] = !val[r / bs];
    for (int j = 0; j < S; j++) {
        zc[j] = 1;
        for (int b = 0; b < nb; b++) {
            int lo, hi;
            if (val[b] && (ctx_range(anc[b], dst[b], W, 0, &lo, &hi), lo <= j && j < hi))
                zc[j] = 0;
        }
    }
    uint16_t *hb = gh_xmalloc((nQ > nC ? (nQ > nB ? nQ : nB) : (nC > nB ? nC : nB)) * 2);
    float *go = gh_xmalloc(nQ * 4), *gl = gh_xmalloc((int64_t)rows * nq * 4);
    float *gdq = gh_xmalloc(nQ * 4), *gdkc = gh_xmalloc(nC * 4), *gdvc = gh_xmalloc(nC * 4),
          *gdkb = gh_xmalloc(nB * 4), *gdvb = gh_xmalloc(nB * 4);
    grad_out outs[6] = {{"out", dout_, go, ro, no, nQ, zq, (int64_t)nq * D},
                 {"dq", dgq, gdq, rdq, ndq, nQ, zq, (int64_t)nq * D},
                 {"dkc", dgkc, gdkc, rdkc, ndkc, nC, zc, (int64_t)nkv * D},
                 {"dvc", dgvc, gdvc, rdvc, ndvc, nC, zc, (int64_t)nkv * D},
                 {"dkb", dgkb, gdkb, rdkb, ndkb, nB, zq, (int64_t)nkv * D},
                 {"dvb", dgvb, gdvb, rdvb, ndvb, nB, zq, (int64_t)nkv * D}};
    CUDA_OK(cudaMemcpy(gl, dlse, (size_t)rows * nq * 4, cudaMemcpyDeviceToHost));
    printf("%-26s", c->name);
    int ok = 1;
    {
        gh_diff eg, en;
        cmp(&eg, rl, gl, (int64_t)rows * nq, NULL, 1);
        cmp(&en, rl, nl, (int64_t)rows * nq, NULL, 1);
        double tol = 2 * en.err + 1e-6 * eg.ref_max;
        printf(" lse %.1e/%.1e", eg.err, en.err);
        if (eg.nan || eg.bad || eg.err > tol)
            ok = 0, printf("(FAIL nan=%lld inf-mismatch=%lld)", (long long)eg.nan,
                           (long long)eg.bad);
    }
    for (int t = 0; t < 6; t++) {
        CUDA_OK(cudaMemcpy(hb, outs[t].dev, outs[t].n * 2, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < outs[t].n; i++)
            outs[t].g[i] = gh_bf2f(hb[i]);
        ok = out_ok(outs[t].nm, outs[t].ref, outs[t].g, outs[t].nv, outs[t].n, outs[t].z,
                    outs[t].cols, 1) && ok;
    }
    /* each backward explicitly (CUDA cores, tensor cores, wgmma), on the
     * default forward's out/lse (still in dout_/dlse); every gradient
     * poisoned first */
    for (size_t ii = 0; ii < sizeof impls / sizeof impls[0]; ii++) {
        int impl = impls[ii];
        for (int t = 1; t < 6; t++)
            CUDA_OK(cudaMemset(outs[t].dev, 0xff, outs[t].n * 2));
        CUDA_OK(cudaMemset(dws, 0xff, wsb));
        a.impl = impl;
        int brc = df_cuda_dflash_bwd(&a, 0);
        if (brc == -ENOTSUP && impl == DF_CUDA_DFLASH_IMPL_SIMT) {
            /* the CUDA-core reference's dQ / dK-dV tiles (fp32) need more than the
             * 99 KiB of sm_86 / sm_89 / sm_120 (or DFLASH_PORTABLE=1) at D 128 */
            printf(" | simt bwd: n/a (shared memory)");
            continue;
        }
        CHECK_EQ(brc, 0);
        CUDA_OK(cudaDeviceSynchronize());
        printf(" | %s bwd:", impl_name(impl));
        for (int t = 1; t < 6; t++) {
            CUDA_OK(cudaMemcpy(hb, outs[t].dev, outs[t].n * 2, cudaMemcpyDeviceToHost));
            for (int64_t i = 0; i < outs[t].n; i++)
                outs[t].g[i] = gh_bf2f(hb[i]);
            ok = out_ok(outs[t].nm, outs[t].ref, outs[t].g, outs[t].nv, outs[t].n, outs[t].z,
                        outs[t].cols, 0) && ok;
        }
    }
    /* impl 0 through the selection hook: the built-in default, then mma4,
     * wg2 and wg2f; each backward twice, the gradients bitwise equal
     * (deterministic); wg2 and wg2f vs mma4, wg2f vs wg2 reported */
    {
        int64_t ng = nQ + 2 * nC + 2 * nB;
        uint16_t *run1 = gh_xmalloc(ng * 2), *run2 = gh_xmalloc(ng * 2), *run0 = gh_xmalloc(ng * 2),
                 *runw2 = gh_xmalloc(ng * 2);
        static const int hook[5] = {0, DF_CUDA_DFLASH_IMPL_MMA4, DF_CUDA_DFLASH_IMPL_WG2,
                                    DF_CUDA_DFLASH_IMPL_WG2F, DF_CUDA_DFLASH_IMPL_WG3};
        for (int hv = 0; hv < 5; hv++) {
            int want = hook[hv];
            CHECK_EQ(df_cuda_dflash_set_bwd_impl(want), 0);
            if (want)
                CHECK_EQ(df_cuda_dflash_bwd_impl(), want);
            a.impl = 0;
            printf(" | impl0=%s:", impl_name(df_cuda_dflash_bwd_impl()));
            for (int rep = 0; rep < 2; rep++)
                bwd_into(&a, outs, dws, wsb, rep ? run2 : run1);
            int det = !memcmp(run1, run2, ng * 2);
            printf(" det %s", det ? "yes" : "NO(FAIL)");
            ok = ok && det;
            if (hv == 1) {
                memcpy(run0, run1, ng * 2); /* mma4's */
            } else if (hv >= 2) {
                printf(" ==mma4 %s", !memcmp(run0, run1, ng * 2) ? "yes" : "no");
            }
            if (hv == 2) {
                memcpy(runw2, run1, ng * 2); /* wg2's */
            } else if (hv == 3) {
                /* dq, dkc, dvc (the first nQ + 2 nC), then dkb, dvb */
                int64_t n1 = nQ + 2 * nC;
                printf(" dq/dkc/dvc==wg2 %s dkb/dvb==wg2 %s",
                       !memcmp(runw2, run1, n1 * 2) ? "yes" : "no",
                       !memcmp(runw2 + n1, run1 + n1, (ng - n1) * 2) ? "yes" : "no");
            }
            ok = grads_ok(outs, run1) && ok;
        }
        /* WG3 (run1 holds its gradients) with its stored dS at the spans as they are
         * (args.ds_off): a smaller workspace, the same bits; then in block ranges of
         * about a third of the tiles each (args.ds_ranges) */
        {
            int32_t *off = gh_xmalloc((size_t)nb * 4 + 4);
            int32_t *doff, bounds[DF_CUDA_DFLASH_DS_MAX_RANGES + 1];
            a.ds_tiles = df_cuda_dflash_ds_offsets(anc, dst, val, nb, W, off);
            CUDA_OK(cudaMalloc((void **)&doff, (size_t)nb * 4 + 4));
            CUDA_OK(cudaMemcpy(doff, off, (size_t)nb * 4, cudaMemcpyHostToDevice));
            a.ds_off = doff;
            a.impl = DF_CUDA_DFLASH_IMPL_WG3;
            for (int ranged = 0; ranged < 2; ranged++) {
                if (ranged) {
                    size_t rb = (size_t)(a.ds_tiles + 2) / 3 * (size_t)nkv * (16 << 10);
                    a.ds_ranges = df_cuda_dflash_ds_ranges(off, nb, a.ds_tiles, nkv, rb, bounds,
                                                           &a.ds_range_tiles);
                    a.ds_bounds = bounds;
                }
                size_t wsc = df_cuda_dflash_bwd_workspace_bytes(&a);
                CHECK(wsc <= wsb);
                bwd_into(&a, outs, dws, wsb, run2);
                if (!ranged) {
                    int same = !memcmp(run1, run2, ng * 2);
                    printf(" | wg3 spans as they are: workspace %.2f of the widest's, ==wg3 %s",
                           (double)wsc / (double)wsb, same ? "yes" : "NO(FAIL)");
                    ok = ok && same;
                    continue;
                }
                /* in ranges: dQ (whole per block) the same bits; dK, dV summed per range
                 * (fp32 rounding apart from one pass): against the CPU reference, and
                 * deterministic */
                int same_dq = !memcmp(run1, run2, nQ * 2);
                printf(" | wg3 in %d block ranges: workspace %.2f, dq==wg3 %s, dk/dv==wg3 %s",
                       a.ds_ranges, (double)wsc / (double)wsb, same_dq ? "yes" : "NO(FAIL)",
                       !memcmp(run1 + nQ, run2 + nQ, (ng - nQ) * 2) ? "yes" : "no");
                ok = grads_ok(outs, run2) && ok && same_dq;
                bwd_into(&a, outs, dws, wsb, run0); /* (mma4's bits there are done with) */
                int det = !memcmp(run0, run2, ng * 2);
                printf(" det %s", det ? "yes" : "NO(FAIL)");
                ok = ok && det;
            }
            a.ds_off = NULL, a.ds_tiles = 0, a.impl = 0;
            a.ds_ranges = 0, a.ds_bounds = NULL, a.ds_range_tiles = 0;
            CUDA_OK(cudaFree(doff));
            free(off);
        }
        CHECK_EQ(df_cuda_dflash_set_bwd_impl(0), 0);
        CHECK_EQ(df_cuda_dflash_set_bwd_impl(-1), -22);
        CHECK_EQ(df_cuda_dflash_set_bwd_impl(DF_CUDA_DFLASH_IMPL_WG3 + 1), -22);
        for (size_t i = 0; i < sizeof retired / sizeof retired[0]; i++) {
            CHECK_EQ(df_cuda_dflash_set_bwd_impl(retired[i]), -22);
            a.impl = retired[i]; /* rejected before anything is launched */
            CHECK_EQ(df_cuda_dflash_fwd(&a, 0), -22);
            CHECK_EQ(df_cuda_dflash_bwd(&a, 0), -22);
        }
        free(run1), free(run2), free(run0), free(runw2);
    }
    /* each forward (the pass above ran the default), twice: the second
     * run's out/lse bitwise the first's (deterministic) */
    uint16_t *fo1 = gh_xmalloc(nQ * 2);
    float *fl1 = gh_xmalloc((int64_t)rows * nq * 4);
    for (size_t ii = 0; ii < sizeof impls / sizeof impls[0]; ii++) {
        int impl = impls[ii];
        a.impl = impl;
        for (int rep = 0; rep < 2; rep++) {
            if (rep) {
                memcpy(fo1, hb, nQ * 2);
                memcpy(fl1, gl, (size_t)rows * nq * 4);
            }
            CUDA_OK(cudaMemset(dout_, 0xff, nQ * 2));
            CUDA_OK(cudaMemset(dlse, 0xff, (size_t)rows * nq * 4));
            CHECK_EQ(df_cuda_dflash_fwd(&a, 0), 0);
            CUDA_OK(cudaDeviceSynchronize());
            CUDA_OK(cudaMemcpy(gl, dlse, (size_t)rows * nq * 4, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(hb, dout_, nQ * 2, cudaMemcpyDeviceToHost));
        }
        int fdet = !memcmp(fo1, hb, nQ * 2) && !memcmp(fl1, gl, (size_t)rows * nq * 4);
        for (int64_t i = 0; i < nQ; i++)
            go[i] = gh_bf2f(hb[i]);
        gh_diff eg, en, lg, ln;
        cmp(&eg, ro, go, nQ, zq, (int64_t)nq * D);
        cmp(&en, ro, no, nQ, NULL, 1);
        cmp(&lg, rl, gl, (int64_t)rows * nq, NULL, 1);
        cmp(&ln, rl, nl, (int64_t)rows * nq, NULL, 1);
        int ok2 = !(eg.nan || eg.bad || eg.err > 2 * en.err + 1e-6 * eg.ref_max ||
                    lg.nan || lg.bad || lg.err > 2 * ln.err + 1e-6 * lg.ref_max);
        printf(" | %s fwd: out %.1e lse %.1e%s%s", impl_name(impl), eg.err, lg.err,
               ok2 ? "" : " FAIL", fdet ? "" : " NONDETERMINISTIC(FAIL)");
        ok = ok && ok2 && fdet;
    }
    free(fo1), free(fl1);
    printf("  %s\n", ok ? "ok" : "FAILED");
    CHECK(ok);

    cudaFree(dq_), cudaFree(dkc_), cudaFree(dvc_), cudaFree(dkb_), cudaFree(dvb_);
    cudaFree(ddo_), cudaFree(dout_), cudaFree(dgq), cudaFree(dgkc), cudaFree(dgvc);
    cudaFree(dgkb), cudaFree(dgvb), cudaFree(dlse), cudaFree(danc), cudaFree(ddst), cudaFree(dval);
    cudaFree(dws);
    free(zq), free(zc);
    free(hb), free(go), free(gl), free(gdq), free(gdkc), free(gdvc), free(gdkb), free(gdvb);
    free(sc), free(pp), free(acc), free(kp), free(vp), free(dkp), free(dvp);
    free(no), free(nl), free(ndq), free(ndkc), free(ndvc), free(ndkb), free(ndvb);
    free(ro), free(rl), free(rdq), free(rdkc), free(rdvc), free(rdkb), free(rdvb);
    free(hq), free(hkc), free(hvc), free(hkb), free(hvb), free(hdo);
    free(fq), free(fkc), free(fvc), free(fkb), free(fvb), free(fdo);
    free(anc), free(dst), free(val);
}

/* df_cuda_dflash_ds_offsets (host code: runs without a GPU too) against a
 * count of the 128-key tiles each valid block's widest row's span meets, on
 * random blocks (padding, windows, empty spans). Returns the mismatches. */
static int check_ds_offsets(void)
{
    uint64_t r = 29;
    int bad = 0;
    for (int it = 0; it < 2000; it++) {
        int nb = 1 + (int)(test_rand(&r) % 300), S = 1 + (int)(test_rand(&r) % 5000);
        int W = test_rand(&r) % 3 ? 0 : 1 + (int)(test_rand(&r) % 2000);
        int32_t *anc = gh_xmalloc((size_t)nb * 4), *ds = gh_xmalloc((size_t)nb * 4),
                *off = gh_xmalloc((size_t)nb * 4);
        uint8_t *val = gh_xmalloc((size_t)nb);
        for (int b = 0; b < nb; b++) {
            anc[b] = (int)(test_rand(&r) % (uint64_t)(S + 1));
            ds[b] = (int)(test_rand(&r) % (uint64_t)(anc[b] + 1));
            val[b] = test_rand(&r) % 7 != 0;
        }
        int64_t total = df_cuda_dflash_ds_offsets(anc, ds, val, nb, W, off), t = 0;
        for (int b = 0; b < nb; b++) {
            bad += off[b] != t;
            int lo, hi;
            if (val[b] && (ctx_range(anc[b], ds[b], W, 0, &lo, &hi), lo < hi))
                for (int k = 0; k < S; k += 128)
                    t += k < hi && k + 128 > lo;
        }
        bad += total != t;
        /* the block ranges of these offsets: consecutive, covering, max_tiles
         * their largest, and within the budget unless one block alone exceeds
         * it, where the greedy cut needs no more than the ranges allowed (two
         * consecutive ranges hold more than the budget) */
        int nkv = 1 + (int)(test_rand(&r) % 8);
        size_t rb = (size_t)(1 + test_rand(&r) % 64) * (size_t)nkv * (16 << 10);
        int32_t bnd[DF_CUDA_DFLASH_DS_MAX_RANGES + 1];
        int64_t most = -1;
        int nr = df_cuda_dflash_ds_ranges(off, nb, total, nkv, rb, bnd, &most);
        int64_t cap = (int64_t)(rb / ((size_t)nkv * (16 << 10))), seen = 0;
        bad += nr < 1 || nr > DF_CUDA_DFLASH_DS_MAX_RANGES || bnd[0] != 0 || bnd[nr] != nb;
        const int fits = cap > 0 && 2 * total / cap + 2 <= DF_CUDA_DFLASH_DS_MAX_RANGES;
        for (int k = 0; k < nr && !(nr < 1 || nr > DF_CUDA_DFLASH_DS_MAX_RANGES); k++) {
            bad += bnd[k + 1] <= bnd[k] && nb > 0;
            int64_t t0 = off[bnd[k]], t1 = bnd[k + 1] < nb ? off[bnd[k + 1]] : total;
            int nonempty = 0;
            for (int b = bnd[k]; b < bnd[k + 1]; b++)
                nonempty += (b + 1 < nb ? off[b + 1] : total) > off[b];
            bad += fits && t1 - t0 > cap && nonempty > 1;
            seen = t1 - t0 > seen ? t1 - t0 : seen;
        }
        bad += most != seen;
        free(anc), free(ds), free(off), free(val);
    }
    printf("df_cuda_dflash_ds_offsets and _ds_ranges: %d mismatches in 2000 random block sets\n",
           bad);
    return bad;
}

int main(void)
{
    if (check_ds_offsets())
        return 1;
    if (gh_skip_without_gpu())
        return 77;
    df_err e;
    df_backend *be = df_backend_cpu_open(8, &e);
    if (!be) {
        fprintf(stderr, "cpu backend: %s\n", e.msg);
        return 1;
    }
    {   /* bad arguments: -EINVAL, nothing launched */
        df_cuda_dflash_args bad;
        memset(&bad, 0, sizeof bad);
        bad.block_size = 16, bad.nq = 4, bad.nkv = 2, bad.head_dim = 96;
        CHECK_EQ(df_cuda_dflash_fwd(&bad, 0), -22);
        CHECK_EQ(df_cuda_dflash_fwd(NULL, 0), -22);
        bad.head_dim = 64, bad.nkv = 3;
        CHECK_EQ(df_cuda_dflash_bwd(&bad, 0), -22);
    }
    printf("max abs error: GPU vs fp32 reference / naive bf16 vs fp32 reference\n");
    static const cfg cfgs[] = {
        {"full 4/2 D64 bs16", 300, 14, 16, 0, 4, 2, 64, 3, {100, 180, 300}},
        {"slide40 4/2 D64 bs16", 300, 14, 16, 40, 4, 2, 64, 3, {100, 180, 300}},
        {"full 8/2 D64 bs16", 300, 14, 16, 0, 8, 2, 64, 3, {100, 180, 300}},
        {"slide40 8/2 D64 bs16", 300, 14, 16, 40, 8, 2, 64, 3, {100, 180, 300}},
        {"full 8/2 D64 bs40 (3ch)", 257, 9, 40, 0, 8, 2, 64, 2, {130, 257}},
        {"slide7 8/2 D64 bs40", 257, 9, 40, 7, 8, 2, 64, 2, {130, 257}},
        {"full 4/2 D64 bs5", 97, 11, 5, 0, 4, 2, 64, 2, {33, 97}},
        {"slide3 4/2 D64 bs5", 97, 11, 5, 3, 4, 2, 64, 2, {33, 97}},
        {"full 32/8 D128 bs16", 1024, 40, 16, 0, 32, 8, 128, 3, {300, 700, 1024}},
        {"slide256 32/8 D128 bs16", 1024, 40, 16, 256, 32, 8, 128, 3, {300, 700, 1024}},
        {"full 8/2 D128 bs16", 700, 20, 16, 0, 8, 2, 128, 2, {450, 700}},
        /* D 128 with partial row chunks (wg2's per-row masking): group 2 x bs
         * 40 = 64 + 16 rows, group 4 x bs 40 = 64 + 64 + 32, group 2 x bs 5 */
        {"full 4/2 D128 bs40 (2ch)", 257, 9, 40, 0, 4, 2, 128, 2, {130, 257}},
        {"slide7 8/2 D128 bs40 (3ch)", 257, 9, 40, 7, 8, 2, 128, 2, {130, 257}},
        {"slide3 4/2 D128 bs5", 97, 11, 5, 3, 4, 2, 128, 2, {33, 97}},
        /* one document, many anchors (the trainer's layout): long spans of
         * very different lengths (what wg2's longest-first dQ order is for) */
        {"1doc full 8/2 D128 bs16", 1024, 48, 16, 0, 8, 2, 128, 1, {1024}},
        {"1doc slide300 8/2 D128", 1024, 48, 16, 300, 8, 2, 128, 1, {1024}},
        /* group 1 x bs 64 = 64 rows: one chunk whose block tile has 64 keys
         * (wg2f's fold with every warp's keys and all 8 key groups) */
        {"full 2/2 D64 bs64", 300, 8, 64, 0, 2, 2, 64, 2, {150, 300}},
        {"slide20 2/2 D128 bs64", 300, 8, 64, 20, 2, 2, 128, 2, {150, 300}},
        /* group 8 x bs 8 = 64 rows: wg3's block tiles with keys past bs */
        {"full 16/2 D128 bs8", 300, 20, 8, 0, 16, 2, 128, 3, {100, 180, 300}},
        {"slide30 16/2 D64 bs8", 300, 20, 8, 30, 16, 2, 64, 3, {100, 180, 300}},
    };
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++)
        run_cfg(&cfgs[i], be);
    df_backend_close(be);
    return test_main_end();
}
