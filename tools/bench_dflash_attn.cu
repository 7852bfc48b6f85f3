// bench_dflash_attn - the CUDA DFlash drafter attention at the 27B drafter's
// shape: S = 4096 context, 512 anchors x block 16, 32 query / 8 kv heads,
// head_dim 128, full (W = 0) and sliding (W = 2048) layers, in two anchor
// layouts: "3docs" (3 packed documents; the original rows) and "1doc" (one
// 4096-token document, the layout the trainer sees: 2-3x more visible
// context per anchor). Anchors are sampled like the trainer: candidates p
// with loss_mask[p] & loss_mask[p+1] inside a document, up to 512 uniformly
// without replacement, sorted. Times forward and backward with CUDA events
// (median of 20 after 3 warm-ups). TFLOP/s counts only visible (query, key)
// pairs: forward 4 * D per pair per head (QK^T and PV), backward 2.5x the
// forward (FlashAttention convention: 5 matmuls vs 2). Also checks that two
// backward runs give bitwise-equal gradients (determinism). The defaults are
// also timed back to back (20 calls between two events, per call, median
// of 5; last in each row, then a 0.3 s rest): without the host's time before
// each call's first kernel, but at the clocks a sustained load gets (the
// H200's power cap), which a training loop sees; the per-call figures get
// the idle GPU's clocks, as flex's per-call figures do.
// Forward and backward are timed for the defaults (wg2 / wg3 on compute
// capability 9.0, mma4 elsewhere), the CUDA-core (simt) kernels (3docs
// layout only) and the mma4 backward (also checked for determinism). The
// default's and mma4's backward are also timed pass by pass
// (args.pass_events: CUDA events between the kernel launches, medians): Di,
// dQ (with its lists), context tile lists, context dK/dV, block-key dK/dV,
// split reduction. wg2 (mma4 with its forward, dQ and context dK/dV on
// Hopper wgmma; mma4's kernels on devices other than sm_90) is timed on
// both layouts: backward (total, passes, determinism, max relative
// difference of its gradients from the default's) and forward (after the
// backward rows, on its own out/lse; out's and lse's max relative
// difference from the default forward's). wg2f (wg2 with Di and the
// block-key dK/dV folded into its wgmma dQ pass; its forward is wg2's) is
// timed next to wg2 (backward: total, passes - di and blk_dkv ~0, dq a
// little longer -, determinism, max relative difference from the default's
// gradients, and whether its dq / dkc / dvc / dkb / dvb are bitwise wg2's:
// expected yes for the first three, no for the block-key dkb / dvb). wg3
// (wg2f whose context dK/dV pass stores dS, from which its dQ is computed
// without S and dP again) likewise: total, passes (dq: its block pass;
// blk_dkv: its dQ), determinism, max relative difference from the default's
// gradients; the one workspace is sized for it (the largest). The
// retired implementations (mma, mma2, mma3, mma5, wg) are not
// timed. The last line is JSON (also
// --json-out F): "layers" holds the 3docs rows (the keys
// scripts/bench_flex_dflash.py reads), "layers_1doc" the 1doc rows.
// --anchors-out F writes the 3docs shape and anchors as JSON for
// scripts/bench_flex_dflash.py (the same mask under torch flex_attention);
// --anchors-1doc-out F the same for the 1doc layout.
// --ds-range-mib N: WG3's stored dS in block ranges of at most N MiB (the
// trainer's, with the memory the drafter lends it; default one range).
// Usage: bench_dflash_attn [repeats] [--anchors-out F.json]
//        [--anchors-1doc-out F.json] [--json-out F.json] [--ds-range-mib N]
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/dflash_attn.h"
#include "cuda_check.h"

static uint64_t rs = 12345;
static uint64_t rnd()
{
    uint64_t z = (rs += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint16_t *dev_rand(size_t n)
{
    std::vector<uint16_t> h(n);
    for (size_t i = 0; i < n; i++) {
        float f = ((rnd() >> 40) / 16777216.0f - 0.5f) * 3.0f;
        uint32_t u;
        memcpy(&u, &f, 4);
        h[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    uint16_t *d;
    CUDA_CK(cudaMalloc(&d, n * 2));
    CUDA_CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
    return d;
}

// Pass names of args.pass_events (DF_CUDA_DFLASH_BWD_EVENTS - 1 passes).
static const char *const pass_nm[DF_CUDA_DFLASH_BWD_EVENTS - 1] = {"di",      "dq",      "ctx_lists",
                                                                   "ctx_dkv", "blk_dkv", "reduce"};

static const char *impl_nm(int impl) { return impl ? df_cuda_dflash_impl_name(impl) : "0"; }

// An anchor layout: per block anchor / doc_start / valid.
struct Layout {
    const char *name;
    int nv, ncand;
    std::vector<int32_t> anc, dst;
    std::vector<uint8_t> val;
};

// Anchors over documents ending at doc_end (the last one at S), sampled like
// the trainer (see the top comment).
static Layout make_layout(const char *name, const std::vector<int> &doc_end, int S, int NB)
{
    // loss mask: per document a 15% prompt (0), then assistant turns (1) with
    // a short user turn (0) every ~600 tokens
    std::vector<int> lm(S), doc(S);
    for (size_t d = 0, s0 = 0; d < doc_end.size(); s0 = doc_end[d++])
        for (int p = (int)s0; p < doc_end[d]; p++) {
            int rel = p - (int)s0, len = doc_end[d] - (int)s0;
            doc[p] = (int)d;
            lm[p] = rel >= len * 15 / 100 && (rel % 600) >= 60;
        }
    std::vector<int> cand;
    for (int p = 0; p + 1 < S; p++)
        if (lm[p] && lm[p + 1] && doc[p + 1] == doc[p])
            cand.push_back(p);
    for (size_t i = 0; i < cand.size(); i++) // Fisher-Yates: uniform without replacement
        std::swap(cand[i], cand[i + rnd() % (cand.size() - i)]);
    Layout L;
    L.name = name;
    L.ncand = (int)cand.size();
    L.nv = (int)std::min<size_t>(NB, cand.size());
    std::vector<int> an(cand.begin(), cand.begin() + L.nv);
    std::sort(an.begin(), an.end());
    L.anc.assign(NB, 0), L.dst.assign(NB, 0), L.val.assign(NB, 0);
    for (int b = 0; b < L.nv; b++) {
        L.anc[b] = an[b], L.val[b] = 1;
        L.dst[b] = doc[an[b]] ? doc_end[doc[an[b]] - 1] : 0;
    }
    return L;
}

static int write_anchors(const char *path, const Layout &L, int S, int NB, int BS, int NQ, int NKV,
                         int D)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return fprintf(stderr, "cannot write %s\n", path), 1;
    fprintf(f, "{\"S\": %d, \"n_blocks\": %d, \"block_size\": %d, \"nq\": %d, \"nkv\": %d, "
               "\"head_dim\": %d, \"windows\": [0, 2048]",
            S, NB, BS, NQ, NKV, D);
    const char *nm[3] = {"anchor", "doc_start", "valid"};
    for (int k = 0; k < 3; k++) {
        fprintf(f, ", \"%s\": [", nm[k]);
        for (int b = 0; b < NB; b++)
            fprintf(f, "%s%d", b ? ", " : "", k == 0 ? L.anc[b] : k == 1 ? L.dst[b] : (int)L.val[b]);
        fprintf(f, "]");
    }
    if (fprintf(f, "}\n") < 0 || fclose(f))
        return fprintf(stderr, "cannot write %s\n", path), 1;
    return 0;
}

int main(int argc, char **argv)
{
    int reps = 20;
    int ds_range_mib = 0;
    const char *anchors_out = NULL, *anchors1_out = NULL, *json_out = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--anchors-out") && i + 1 < argc)
            anchors_out = argv[++i];
        else if (!strcmp(argv[i], "--anchors-1doc-out") && i + 1 < argc)
            anchors1_out = argv[++i];
        else if (!strcmp(argv[i], "--json-out") && i + 1 < argc)
            json_out = argv[++i];
        else if (!strcmp(argv[i], "--ds-range-mib") && i + 1 < argc)
            ds_range_mib = atoi(argv[++i]);
        else if (atoi(argv[i]) > 0)
            reps = atoi(argv[i]);
        else
            return fprintf(stderr, "usage: bench_dflash_attn [repeats] [--anchors-out F.json] "
                                   "[--anchors-1doc-out F.json] [--json-out F.json] [--ds-range-mib N]\n"), 2;
    }
    const int S = 4096, NB = 512, BS = 16, NQ = 32, NKV = 8, D = 128, ROWS = NB * BS;
    // the 3docs anchors and the tensors draw from the generator as before the
    // 1doc layout was added (same anchors and data); the 1doc anchors after
    Layout lays[2];
    lays[0] = make_layout("3docs", {1500, 2800, 4096}, S, NB);
    size_t nQ = (size_t)ROWS * NQ * D, nC = (size_t)S * NKV * D, nB = (size_t)ROWS * NKV * D;
    size_t free0, total;
    CUDA_CK(cudaMemGetInfo(&free0, &total));
    uint16_t *q = dev_rand(nQ), *kc = dev_rand(nC), *vc = dev_rand(nC), *kb = dev_rand(nB),
             *vb = dev_rand(nB), *dout = dev_rand(nQ);
    lays[1] = make_layout("1doc", {4096}, S, NB);
    for (int k = 0; k < 2; k++)
        printf("27B drafter shape, %s: S=%d, %d blocks x %d (%d valid of %d candidates), %d/%d "
               "heads, D=%d\n",
               lays[k].name, S, NB, BS, lays[k].nv, lays[k].ncand, NQ, NKV, D);
    if (anchors_out && write_anchors(anchors_out, lays[0], S, NB, BS, NQ, NKV, D))
        return 1;
    if (anchors1_out && write_anchors(anchors1_out, lays[1], S, NB, BS, NQ, NKV, D))
        return 1;
    uint16_t *out, *dq, *dkc, *dvc, *dkb, *dvb;
    float *lse;
    int32_t *danc, *ddst;
    uint8_t *dval;
    CUDA_CK(cudaMalloc(&out, nQ * 2));
    CUDA_CK(cudaMalloc(&dq, nQ * 2));
    CUDA_CK(cudaMalloc(&dkc, nC * 2));
    CUDA_CK(cudaMalloc(&dvc, nC * 2));
    CUDA_CK(cudaMalloc(&dkb, nB * 2));
    CUDA_CK(cudaMalloc(&dvb, nB * 2));
    CUDA_CK(cudaMalloc(&lse, (size_t)ROWS * NQ * 4));
    CUDA_CK(cudaMalloc(&danc, NB * 4));
    CUDA_CK(cudaMalloc(&ddst, NB * 4));
    CUDA_CK(cudaMalloc(&dval, NB));
    int32_t *doff;
    CUDA_CK(cudaMalloc(&doff, NB * 4 + 4));
    df_cuda_dflash_args a;
    memset(&a, 0, sizeof a);
    a.S = S, a.n_blocks = NB, a.block_size = BS, a.nq = NQ, a.nkv = NKV, a.head_dim = D;
    a.scale = 1.0f / sqrtf((float)D);
    a.anchor = danc, a.doc_start = ddst, a.valid = dval;
    a.q = q, a.kc = kc, a.vc = vc, a.kb = kb, a.vb = vb, a.out = out, a.lse = lse, a.dout = dout;
    a.dq = dq, a.dkc = dkc, a.dvc = dvc, a.dkb = dkb, a.dvb = dvb;
    // one workspace for every backward below: the default's size, or wg3's
    // (its stored dS: every span at its widest) where larger
    size_t wsb_def = df_cuda_dflash_bwd_workspace_bytes(&a);
    a.impl = DF_CUDA_DFLASH_IMPL_WG3;
    size_t wsb3 = df_cuda_dflash_bwd_workspace_bytes(&a), wsb = wsb3 > wsb_def ? wsb3 : wsb_def;
    a.impl = 0;
    CUDA_CK(cudaMalloc(&a.workspace, wsb));
    size_t free1;
    CUDA_CK(cudaMemGetInfo(&free1, &total));
    cudaEvent_t e0, e1, pev[DF_CUDA_DFLASH_BWD_EVENTS];
    CUDA_CK(cudaEventCreate(&e0));
    CUDA_CK(cudaEventCreate(&e1));
    for (int i = 0; i < DF_CUDA_DFLASH_BWD_EVENTS; i++)
        CUDA_CK(cudaEventCreate(&pev[i]));
    const int Ws[2] = {0, 2048};
    const int dflt = df_cuda_dflash_bwd_impl();
    int rc_all = 0;
    std::string json = std::string("{\"bench\": \"dflash_attn\", \"impl\": \"default (fwd ") +
                       impl_nm(df_cuda_dflash_fwd_impl()) + ", bwd " + impl_nm(dflt) +
                       ")\", \"layers\": [";
    printf("default backward: %s (DFLASH_ATTN_BWD / df_cuda_dflash_set_bwd_impl)\n", impl_nm(dflt));
    for (int lk = 0; lk < 2; lk++) {
        const Layout &L = lays[lk];
        // the slow / old versions on the 3docs layout only; not under DFLASH_PORTABLE=1, whose
        // 99 KiB of shared memory the CUDA-core backward at D 128 exceeds
        bool all_impls = lk == 0 && !df_cuda_portable_forced();
        CUDA_CK(cudaMemcpy(danc, L.anc.data(), NB * 4, cudaMemcpyHostToDevice));
        CUDA_CK(cudaMemcpy(ddst, L.dst.data(), NB * 4, cudaMemcpyHostToDevice));
        CUDA_CK(cudaMemcpy(dval, L.val.data(), NB, cudaMemcpyHostToDevice));
        if (lk == 1)
            json += "], \"layers_1doc\": [";
        for (int li = 0; li < 2; li++) {
            a.window = Ws[li];
            // WG3's stored dS at the spans as they are, in block ranges of at most
            // --ds-range-mib (0: one range; the trainer's range at the 27B shape: ~460)
            std::vector<int32_t> off(NB);
            int32_t bnd[DF_CUDA_DFLASH_DS_MAX_RANGES + 1];
            a.ds_tiles = df_cuda_dflash_ds_offsets(L.anc.data(), L.dst.data(), L.val.data(), NB, a.window,
                                                   off.data());
            a.ds_ranges = ds_range_mib > 0 ? df_cuda_dflash_ds_ranges(off.data(), NB, a.ds_tiles, NKV,
                                                                      (size_t)ds_range_mib << 20, bnd,
                                                                      &a.ds_range_tiles)
                                           : 1;
            if (ds_range_mib <= 0)
                a.ds_range_tiles = a.ds_tiles;
            a.ds_bounds = bnd;
            CUDA_CK(cudaMemcpy(doff, off.data(), NB * 4, cudaMemcpyHostToDevice));
            a.ds_off = doff;
            printf("  wg3 stored dS: %lld tiles (%.0f MiB), %d block range(s) of at most %lld tiles\n",
                   (long long)a.ds_tiles, (double)a.ds_tiles * NKV * 16 / 1024, a.ds_ranges,
                   (long long)a.ds_range_tiles);
            double pairs = 0;
            for (int b = 0; b < NB; b++) {
                if (!L.val[b])
                    continue;
                for (int qo = 0; qo < BS; qo++) {
                    int lo = L.dst[b];
                    if (a.window > 0 && L.anc[b] + qo - (a.window - 1) > lo)
                        lo = L.anc[b] + qo - (a.window - 1);
                    pairs += (lo < L.anc[b] ? L.anc[b] - lo : 0) + (a.window > 0 ? qo + 1 : BS);
                }
            }
            pairs *= NQ;
            double ffl = 4.0 * D * pairs, bfl = 2.5 * ffl;
            // calls calls between two events, per call: medians of reps after 3
            // warm-ups (calls 1: a call on an idle GPU, what flex's figures are),
            // or of 5 after 1 (calls > 1, back to back: without the host's time
            // before each call's first launch, but at the clocks a sustained
            // load gets, which a training loop sees)
            auto time_ms = [&](bool bwd, int impl, float *mn, int calls = 1) -> double {
                std::vector<float> tm;
                a.impl = impl;
                const int warm = calls > 1 ? 1 : 3, n = calls > 1 ? 5 : reps;
                for (int it = 0; it < warm + n; it++) {
                    CUDA_CK(cudaEventRecord(e0));
                    for (int c = 0; c < calls; c++)
                        if (bwd ? df_cuda_dflash_bwd(&a, 0) : df_cuda_dflash_fwd(&a, 0))
                            exit(1);
                    CUDA_CK(cudaEventRecord(e1));
                    CUDA_CK(cudaEventSynchronize(e1));
                    float ms;
                    CUDA_CK(cudaEventElapsedTime(&ms, e0, e1));
                    if (it >= warm)
                        tm.push_back(ms / calls);
                }
                std::sort(tm.begin(), tm.end());
                if (mn)
                    *mn = tm[0];
                return tm[tm.size() / 2];
            };
            // the backward pass by pass (events between its launches), medians
            auto pass_ms = [&](int impl, double *pm) {
                std::vector<float> tm[DF_CUDA_DFLASH_BWD_EVENTS - 1];
                a.impl = impl;
                a.pass_events = pev;
                for (int it = 0; it < 3 + reps; it++) {
                    if (df_cuda_dflash_bwd(&a, 0))
                        exit(1);
                    CUDA_CK(cudaEventSynchronize(pev[DF_CUDA_DFLASH_BWD_EVENTS - 1]));
                    for (int k = 0; k + 1 < DF_CUDA_DFLASH_BWD_EVENTS && it >= 3; k++) {
                        float ms;
                        CUDA_CK(cudaEventElapsedTime(&ms, pev[k], pev[k + 1]));
                        tm[k].push_back(ms);
                    }
                }
                a.pass_events = NULL;
                for (int k = 0; k + 1 < DF_CUDA_DFLASH_BWD_EVENTS; k++) {
                    std::sort(tm[k].begin(), tm[k].end());
                    pm[k] = tm[k][tm[k].size() / 2];
                }
            };
            // determinism of impl (two runs, bitwise equal: every gradient); the
            // gradients of the second run stay in gr (dq, dkc, dvc, dkb, dvb)
            std::vector<uint16_t> gr[5], g2[5];
            uint16_t *gdev[5] = {dq, dkc, dvc, dkb, dvb};
            size_t gn[5] = {nQ, nC, nC, nB, nB};
            auto grads = [&](std::vector<uint16_t> *h) {
                for (int k = 0; k < 5; k++) {
                    h[k].resize(gn[k]);
                    CUDA_CK(cudaMemcpy(h[k].data(), gdev[k], gn[k] * 2, cudaMemcpyDeviceToHost));
                }
            };
            // (workspace NaN-poisoned first: no pass can reuse another run's scratch)
            auto deterministic = [&](int impl) -> int {
                a.impl = impl;
                CUDA_CK(cudaMemset(a.workspace, 0xff, wsb));
                if (df_cuda_dflash_bwd(&a, 0))
                    exit(1);
                CUDA_CK(cudaDeviceSynchronize());
                grads(g2);
                CUDA_CK(cudaMemset(a.workspace, 0xff, wsb));
                if (df_cuda_dflash_bwd(&a, 0))
                    exit(1);
                CUDA_CK(cudaDeviceSynchronize());
                grads(gr);
                int same = 1;
                for (int k = 0; k < 5; k++)
                    same &= gr[k] == g2[k];
                return same;
            };
            float fmin, bmin;
            double fs = 0, bs_ = 0;
            if (all_impls) {
                fs = time_ms(false, DF_CUDA_DFLASH_IMPL_SIMT, NULL);
                bs_ = time_ms(true, DF_CUDA_DFLASH_IMPL_SIMT, NULL); // on the simt forward's out/lse
            }
            double mf = time_ms(false, 0, &fmin); // the defaults
            double mb = time_ms(true, 0, &bmin);
            double pd[DF_CUDA_DFLASH_BWD_EVENTS - 1];
            pass_ms(0, pd);
            int det = deterministic(0);
            rc_all |= !det;
            std::vector<uint16_t> gd[5]; // the default's gradients, for the comparisons below
            for (int k = 0; k < 5; k++)
                gd[k] = gr[k];
            // impl MMA4, on the default forward's out/lse
            float b4min;
            double b4 = time_ms(true, DF_CUDA_DFLASH_IMPL_MMA4, &b4min);
            int det4 = deterministic(DF_CUDA_DFLASH_IMPL_MMA4);
            rc_all |= !det4;
            // max |impl - default| / max |default| per gradient, impl's in gr
            auto rel_diff = [&](double *rd) {
                for (int k = 0; k < 5; k++) {
                    double dm = 0, am = 0;
                    for (size_t i = 0; i < gn[k]; i++) {
                        uint32_t u1 = (uint32_t)gd[k][i] << 16, u2 = (uint32_t)gr[k][i] << 16;
                        float x1, x2;
                        memcpy(&x1, &u1, 4), memcpy(&x2, &u2, 4);
                        double d = fabs((double)x1 - x2);
                        dm = d > dm || d != d ? d : dm;
                        am = fabs(x1) > am ? fabs(x1) : am;
                    }
                    rd[k] = am > 0 ? dm / am : dm;
                }
            };
            // mma4 pass by pass (the default's rows are mma4's only while it is the default)
            double p4[DF_CUDA_DFLASH_BWD_EVENTS - 1];
            pass_ms(DF_CUDA_DFLASH_IMPL_MMA4, p4);
            // one wgmma backward: time, passes, determinism, vs the default (its
            // gradients stay in gr)
            struct BwdRow {
                double ms, pm[DF_CUDA_DFLASH_BWD_EVENTS - 1], rd[5];
                float min;
                int det;
            };
            auto bwd_row = [&](int impl, BwdRow &r) {
                r.ms = time_ms(true, impl, &r.min);
                pass_ms(impl, r.pm);
                r.det = deterministic(impl);
                rc_all |= !r.det;
                rel_diff(r.rd);
            };
            // impl WG2 (dQ on wgmma too)
            BwdRow w2, w2f, w3;
            bwd_row(DF_CUDA_DFLASH_IMPL_WG2, w2);
            std::vector<uint16_t> gw2[5]; // wg2's gradients, for wg2f's comparison
            for (int k = 0; k < 5; k++)
                gw2[k] = gr[k];
            // impl WG2F (Di and block-key dK/dV inside WG2's dQ pass), and
            // bitwise vs wg2 per gradient
            bwd_row(DF_CUDA_DFLASH_IMPL_WG2F, w2f);
            bool f_eq[5]; // dq, dkc, dvc, dkb, dvb bitwise wg2's
            for (int k = 0; k < 5; k++)
                f_eq[k] = gr[k] == gw2[k];
            // impl WG3 (dQ from the context dK/dV pass's stored dS)
            bwd_row(DF_CUDA_DFLASH_IMPL_WG3, w3);
            // WG2's forward, last (the backwards above ran on the default
            // forward's out/lse): time, and out / lse vs the default's
            std::vector<uint16_t> od(nQ), ow(nQ);
            std::vector<float> ld((size_t)ROWS * NQ), lw((size_t)ROWS * NQ);
            CUDA_CK(cudaMemcpy(od.data(), out, nQ * 2, cudaMemcpyDeviceToHost));
            CUDA_CK(cudaMemcpy(ld.data(), lse, ld.size() * 4, cudaMemcpyDeviceToHost));
            { // FNV-1a of the default forward's bits: runs with and without an
              // environment switch or a changed source (scripts/ab.sh) compare them
                uint64_t ho = 1469598103934665603ull, hl = ho;
                const uint8_t *bo = (const uint8_t *)od.data(), *bl = (const uint8_t *)ld.data();
                for (size_t i = 0; i < nQ * 2; i++)
                    ho = (ho ^ bo[i]) * 1099511628211ull;
                for (size_t i = 0; i < ld.size() * 4; i++)
                    hl = (hl ^ bl[i]) * 1099511628211ull;
                printf("%s %s: default forward bits: out %016llx lse %016llx\n", L.name,
                       a.window ? "sliding" : "full", (unsigned long long)ho,
                       (unsigned long long)hl);
                // and of the default backward's five gradients (dq dkc dvc dkb dvb),
                // for A/B builds of a backward kernel (scripts/ab.sh AB_SRC)
                uint64_t hg = 1469598103934665603ull;
                for (int k = 0; k < 5; k++) {
                    const uint8_t *bg = (const uint8_t *)gd[k].data();
                    for (size_t i = 0; i < gn[k] * 2; i++)
                        hg = (hg ^ bg[i]) * 1099511628211ull;
                }
                printf("%s %s: default backward bits: %016llx\n", L.name,
                       a.window ? "sliding" : "full", (unsigned long long)hg);
            }
            float fw2min;
            double fw2 = time_ms(false, DF_CUDA_DFLASH_IMPL_WG2, &fw2min);
            CUDA_CK(cudaMemcpy(ow.data(), out, nQ * 2, cudaMemcpyDeviceToHost));
            CUDA_CK(cudaMemcpy(lw.data(), lse, lw.size() * 4, cudaMemcpyDeviceToHost));
            // (last: a sustained load lowers the clocks for what follows it)
            double mfq = time_ms(false, 0, NULL, 20), mbq = time_ms(true, 0, NULL, 20);
            usleep(300000); // (and some rest before the next row's runs)
            double fdo = 0, fao = 0, fdl = 0, fal = 0; // max |diff|, max |default|: out, lse
            for (size_t i = 0; i < nQ; i++) {
                uint32_t u1 = (uint32_t)od[i] << 16, u2 = (uint32_t)ow[i] << 16;
                float x1, x2;
                memcpy(&x1, &u1, 4), memcpy(&x2, &u2, 4);
                double d = fabs((double)x1 - x2);
                fdo = d > fdo || d != d ? d : fdo;
                fao = fabs(x1) > fao ? fabs(x1) : fao;
            }
            for (size_t i = 0; i < ld.size(); i++) {
                if (isinf(ld[i]) && ld[i] == lw[i])
                    continue; // padding rows: -inf in both
                double d = fabs((double)ld[i] - lw[i]);
                fdl = d > fdl || d != d ? d : fdl;
                fal = fabs(ld[i]) > fal ? fabs(ld[i]) : fal;
            }
            double rfo = fao > 0 ? fdo / fao : fdo, rfl = fal > 0 ? fdl / fal : fdl;
            const char *nm = a.window ? "sliding" : "full";
            printf("%-5s %-8s visible pairs %.3g: default fwd %.3f ms %.1f TFLOP/s (min %.3f), bwd "
                   "%.3f ms %.1f TFLOP/s (min %.3f), deterministic %s",
                   L.name, nm, pairs, mf, ffl / mf * 1e-9, fmin, mb, bfl / mb * 1e-9, bmin,
                   det ? "yes" : "NO");
            printf("; back to back: fwd %.3f ms %.1f TFLOP/s, bwd %.3f ms %.1f TFLOP/s", mfq, ffl / mfq * 1e-9, mbq,
                   bfl / mbq * 1e-9);
            if (all_impls)
                printf("; simt fwd %.3f ms, simt bwd %.3f ms", fs, bs_);
            printf("; mma4 bwd %.3f ms %.1f TFLOP/s (min %.3f), deterministic %s\n", b4,
                   bfl / b4 * 1e-9, b4min, det4 ? "yes" : "NO");
            printf("      %-8s wg2 bwd %.3f ms %.1f TFLOP/s (min %.3f), deterministic %s; wg2 fwd "
                   "%.3f ms %.1f TFLOP/s (min %.3f) vs default fwd %.3f ms\n",
                   "", w2.ms, bfl / w2.ms * 1e-9, w2.min, w2.det ? "yes" : "NO", fw2, ffl / fw2 * 1e-9,
                   fw2min, mf);
            printf("      %-8s wg2f bwd %.3f ms %.1f TFLOP/s (min %.3f), deterministic %s; bitwise "
                   "wg2's: dq %s dkc %s dvc %s (expected yes) dkb %s dvb %s (expected no)\n",
                   "", w2f.ms, bfl / w2f.ms * 1e-9, w2f.min, w2f.det ? "yes" : "NO",
                   f_eq[0] ? "yes" : "no", f_eq[1] ? "yes" : "no", f_eq[2] ? "yes" : "no",
                   f_eq[3] ? "yes" : "no", f_eq[4] ? "yes" : "no");
            printf("      %-8s wg3 bwd %.3f ms %.1f TFLOP/s (min %.3f), deterministic %s (passes: dq = its "
                   "block pass, blk_dkv = its dQ from the stored dS)\n",
                   "", w3.ms, bfl / w3.ms * 1e-9, w3.min, w3.det ? "yes" : "NO");
            printf("      %-8s bwd passes ms  %-8s", "", "");
            for (int k = 0; k + 1 < DF_CUDA_DFLASH_BWD_EVENTS; k++)
                printf(" %9s", pass_nm[k]);
            printf(" %9s\n", "sum");
            const double *pp[5] = {pd, p4, w2.pm, w2f.pm, w3.pm};
            static const char *const pvn[5] = {"default", "mma4", "wg2", "wg2f", "wg3"};
            for (int v = 0; v < 5; v++) {
                double sum = 0;
                printf("      %-8s %-14s %-8s", "", pvn[v], v ? "" : impl_nm(dflt));
                for (int k = 0; k + 1 < DF_CUDA_DFLASH_BWD_EVENTS; k++)
                    printf(" %9.4f", pp[v][k]), sum += pp[v][k];
                printf(" %9.4f\n", sum);
            }
            printf("      %-8s wg2  vs default max|diff|/max|default|: dq %.2e dkc %.2e dvc %.2e "
                   "dkb %.2e dvb %.2e; fwd out %.2e lse %.2e\n",
                   "", w2.rd[0], w2.rd[1], w2.rd[2], w2.rd[3], w2.rd[4], rfo, rfl);
            printf("      %-8s wg2f vs default max|diff|/max|default|: dq %.2e dkc %.2e dvc %.2e "
                   "dkb %.2e dvb %.2e\n",
                   "", w2f.rd[0], w2f.rd[1], w2f.rd[2], w2f.rd[3], w2f.rd[4]);
            printf("      %-8s wg3  vs default max|diff|/max|default|: dq %.2e dkc %.2e dvc %.2e "
                   "dkb %.2e dvb %.2e\n",
                   "", w3.rd[0], w3.rd[1], w3.rd[2], w3.rd[3], w3.rd[4]);
            char buf[4096];
            int o = 0;
            bool first = json.back() == '[';
            if (all_impls)
                o += snprintf(buf + o, sizeof buf - o,
                              "%s{\"layer\": \"%s\", \"window\": %d, \"pairs\": %.0f, \"fwd_ms\": %.4f, "
                              "\"bwd_ms\": %.4f, \"fwd_tflops\": %.2f, \"bwd_tflops\": %.2f, "
                              "\"simt_fwd_ms\": %.4f, \"simt_bwd_ms\": %.4f, \"deterministic\": %s, "
                              "\"mma4_bwd_ms\": %.4f, \"mma4_bwd_tflops\": %.2f, \"mma4_deterministic\": %s",
                              first ? "" : ", ", nm, a.window, pairs, mf, mb, ffl / mf * 1e-9,
                              bfl / mb * 1e-9, fs, bs_, det ? "true" : "false", b4,
                              bfl / b4 * 1e-9, det4 ? "true" : "false");
            else
                o += snprintf(buf + o, sizeof buf - o,
                              "%s{\"layer\": \"%s\", \"window\": %d, \"pairs\": %.0f, \"fwd_ms\": %.4f, "
                              "\"bwd_ms\": %.4f, \"fwd_tflops\": %.2f, \"bwd_tflops\": %.2f, "
                              "\"deterministic\": %s, \"mma4_bwd_ms\": %.4f, \"mma4_bwd_tflops\": %.2f, "
                              "\"mma4_deterministic\": %s",
                              first ? "" : ", ", nm, a.window, pairs, mf, mb, ffl / mf * 1e-9,
                              bfl / mb * 1e-9, det ? "true" : "false", b4, bfl / b4 * 1e-9,
                              det4 ? "true" : "false");
            o += snprintf(buf + o, sizeof buf - o, ", \"b2b_fwd_ms\": %.4f, \"b2b_bwd_ms\": %.4f", mfq, mbq);
            o += snprintf(buf + o, sizeof buf - o,
                          ", \"wg2_bwd_ms\": %.4f, \"wg2_bwd_tflops\": %.2f, \"wg2_deterministic\": %s, "
                          "\"wg2_vs_default_maxrel\": %.3e, \"wg2_fwd_ms\": %.4f, \"wg2_fwd_tflops\": %.2f, "
                          "\"wg2_fwd_vs_default_maxrel\": %.3e",
                          w2.ms, bfl / w2.ms * 1e-9, w2.det ? "true" : "false",
                          *std::max_element(w2.rd, w2.rd + 5), fw2, ffl / fw2 * 1e-9,
                          rfo > rfl ? rfo : rfl);
            o += snprintf(buf + o, sizeof buf - o,
                          ", \"wg2f_bwd_ms\": %.4f, \"wg2f_bwd_tflops\": %.2f, \"wg2f_deterministic\": %s, "
                          "\"wg2f_vs_default_maxrel\": %.3e, \"wg2f_blk_vs_default_maxrel\": %.3e, "
                          "\"wg2f_dq_dkc_dvc_bitwise_wg2\": %s, \"wg2f_dkb_dvb_bitwise_wg2\": %s",
                          w2f.ms, bfl / w2f.ms * 1e-9, w2f.det ? "true" : "false",
                          *std::max_element(w2f.rd, w2f.rd + 5),
                          std::max(w2f.rd[3], w2f.rd[4]),
                          f_eq[0] && f_eq[1] && f_eq[2] ? "true" : "false",
                          f_eq[3] && f_eq[4] ? "true" : "false");
            o += snprintf(buf + o, sizeof buf - o,
                          ", \"wg3_bwd_ms\": %.4f, \"wg3_bwd_tflops\": %.2f, \"wg3_deterministic\": %s, "
                          "\"wg3_vs_default_maxrel\": %.3e",
                          w3.ms, bfl / w3.ms * 1e-9, w3.det ? "true" : "false",
                          *std::max_element(w3.rd, w3.rd + 5));
            static const char *const pjn[5] = {"bwd_pass_ms", "mma4_bwd_pass_ms", "wg2_bwd_pass_ms",
                                               "wg2f_bwd_pass_ms", "wg3_bwd_pass_ms"};
            for (int v = 0; v < 5; v++) {
                o += snprintf(buf + o, sizeof buf - o, ", \"%s\": {", pjn[v]);
                for (int k = 0; k + 1 < DF_CUDA_DFLASH_BWD_EVENTS; k++)
                    o += snprintf(buf + o, sizeof buf - o, "%s\"%s\": %.4f", k ? ", " : "", pass_nm[k],
                                  pp[v][k]);
                o += snprintf(buf + o, sizeof buf - o, "}");
            }
            snprintf(buf + o, sizeof buf - o, "}");
            json += buf;
        }
    }
    { // memory: every tensor and the workspace, all allocated up front (scripts/bench_flex_dflash.py's
      // table): the default backward's workspace (the one allocated here may be wg3's, larger)
        char mb[160];
        snprintf(mb, sizeof mb, "], \"mem_tensors_workspace_mib\": %.1f, \"workspace_mib\": %.2f}",
                 ((double)(free0 - free1) - (double)wsb + (double)wsb_def) / 1048576.0, wsb_def / 1048576.0);
        json += mb;
    }
    printf("%s\n", json.c_str());
    if (json_out) {
        FILE *f = fopen(json_out, "w");
        if (!f || fprintf(f, "%s\n", json.c_str()) < 0 || fclose(f))
            return fprintf(stderr, "cannot write %s\n", json_out), 1;
    }
    size_t free2;
    CUDA_CK(cudaMemGetInfo(&free2, &total));
    printf("memory: tensors + workspace %.1f MiB (workspace %.2f MiB: the default backward's %.2f, "
           "wg3's %.2f); device use grew %.1f MiB by the end (cudaMemGetInfo)\n",
           (free0 - free1) / 1048576.0, wsb / 1048576.0, wsb_def / 1048576.0, wsb3 / 1048576.0,
           (free0 - free2) / 1048576.0);
    return rc_all;
}
