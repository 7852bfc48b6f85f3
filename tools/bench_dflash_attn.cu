// bench_dflash_attn - the CUDA DFlash drafter attention at the 27B drafter's
// shape: S = 4096 context (3 packed documents), 512 anchors x block 16,
// 32 query / 8 kv heads, head_dim 128, full (W = 0) and sliding (W = 2048)
// layers. Anchors are sampled like the trainer: candidates p with
// loss_mask[p] & loss_mask[p+1] inside a document, up to 512 uniformly
// without replacement, sorted. Times forward and backward with CUDA events
// (median of 20 after 3 warm-ups). TFLOP/s counts only visible (query, key)
// pairs: forward 4 * D per pair per head (QK^T and PV), backward 2.5x the
// forward (FlashAttention convention: 5 matmuls vs 2). Also checks that two
// backward runs give bitwise-equal gradients (determinism).
// Forward and backward are timed for the defaults (tensor cores, mma.sync),
// the CUDA-core (simt) kernels and the other tensor-core versions (mma1, the
// mma3 and mma4 backwards; mma4 also checked for determinism); the last line is JSON (also --json-out F).
// --anchors-out F writes the shape and anchors as JSON for
// scripts/bench_flex_dflash.py (the same mask under torch flex_attention).
// Usage: bench_dflash_attn [repeats] [--anchors-out F.json] [--json-out F.json]
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda/dflash_attn.h"

#define CU(x)                                                                                     \
    do {                                                                                          \
        cudaError_t e_ = (x);                                                                     \
        if (e_ != cudaSuccess) {                                                                  \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

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
    CU(cudaMalloc(&d, n * 2));
    CU(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
    return d;
}

int main(int argc, char **argv)
{
    int reps = 20;
    const char *anchors_out = NULL, *json_out = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--anchors-out") && i + 1 < argc)
            anchors_out = argv[++i];
        else if (!strcmp(argv[i], "--json-out") && i + 1 < argc)
            json_out = argv[++i];
        else if (atoi(argv[i]) > 0)
            reps = atoi(argv[i]);
        else
            return fprintf(stderr, "usage: bench_dflash_attn [repeats] [--anchors-out F.json] "
                                   "[--json-out F.json]\n"), 2;
    }
    const int S = 4096, NB = 512, BS = 16, NQ = 32, NKV = 8, D = 128, ROWS = NB * BS;
    const int doc_end[3] = {1500, 2800, 4096};
    // loss mask: per document a 15% prompt (0), then assistant turns (1) with
    // a short user turn (0) every ~600 tokens
    std::vector<int> lm(S), doc(S);
    for (int d = 0, s0 = 0; d < 3; s0 = doc_end[d++])
        for (int p = s0; p < doc_end[d]; p++) {
            int rel = p - s0, len = doc_end[d] - s0;
            doc[p] = d;
            lm[p] = rel >= len * 15 / 100 && (rel % 600) >= 60;
        }
    std::vector<int> cand;
    for (int p = 0; p + 1 < S; p++)
        if (lm[p] && lm[p + 1] && doc[p + 1] == doc[p])
            cand.push_back(p);
    for (size_t i = 0; i < cand.size(); i++) // Fisher-Yates: uniform without replacement
        std::swap(cand[i], cand[i + rnd() % (cand.size() - i)]);
    int nv = (int)std::min<size_t>(NB, cand.size());
    std::vector<int> an(cand.begin(), cand.begin() + nv);
    std::sort(an.begin(), an.end());
    std::vector<int32_t> anc(NB, 0), dst(NB, 0);
    std::vector<uint8_t> val(NB, 0);
    for (int b = 0; b < nv; b++) {
        anc[b] = an[b], val[b] = 1;
        dst[b] = doc[an[b]] ? doc_end[doc[an[b]] - 1] : 0;
    }
    printf("27B drafter shape: S=%d, %d blocks x %d (%d valid of %zu candidates), %d/%d heads, D=%d\n",
           S, NB, BS, nv, cand.size(), NQ, NKV, D);

    if (anchors_out) { // the shape and anchors, for scripts/bench_flex_dflash.py
        FILE *f = fopen(anchors_out, "w");
        if (!f)
            return fprintf(stderr, "cannot write %s\n", anchors_out), 1;
        fprintf(f, "{\"S\": %d, \"n_blocks\": %d, \"block_size\": %d, \"nq\": %d, \"nkv\": %d, "
                   "\"head_dim\": %d, \"windows\": [0, 2048]",
                S, NB, BS, NQ, NKV, D);
        const char *nm[3] = {"anchor", "doc_start", "valid"};
        for (int k = 0; k < 3; k++) {
            fprintf(f, ", \"%s\": [", nm[k]);
            for (int b = 0; b < NB; b++)
                fprintf(f, "%s%d", b ? ", " : "", k == 0 ? anc[b] : k == 1 ? dst[b] : (int)val[b]);
            fprintf(f, "]");
        }
        if (fprintf(f, "}\n") < 0 || fclose(f))
            return fprintf(stderr, "cannot write %s\n", anchors_out), 1;
    }
    size_t nQ = (size_t)ROWS * NQ * D, nC = (size_t)S * NKV * D, nB = (size_t)ROWS * NKV * D;
    size_t free0, total;
    CU(cudaMemGetInfo(&free0, &total));
    uint16_t *q = dev_rand(nQ), *kc = dev_rand(nC), *vc = dev_rand(nC), *kb = dev_rand(nB),
             *vb = dev_rand(nB), *dout = dev_rand(nQ);
    uint16_t *out, *dq, *dkc, *dvc, *dkb, *dvb;
    float *lse;
    int32_t *danc, *ddst;
    uint8_t *dval;
    CU(cudaMalloc(&out, nQ * 2));
    CU(cudaMalloc(&dq, nQ * 2));
    CU(cudaMalloc(&dkc, nC * 2));
    CU(cudaMalloc(&dvc, nC * 2));
    CU(cudaMalloc(&dkb, nB * 2));
    CU(cudaMalloc(&dvb, nB * 2));
    CU(cudaMalloc(&lse, (size_t)ROWS * NQ * 4));
    CU(cudaMalloc(&danc, NB * 4));
    CU(cudaMalloc(&ddst, NB * 4));
    CU(cudaMalloc(&dval, NB));
    CU(cudaMemcpy(danc, anc.data(), NB * 4, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(ddst, dst.data(), NB * 4, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dval, val.data(), NB, cudaMemcpyHostToDevice));
    df_cuda_dflash_args a;
    memset(&a, 0, sizeof a);
    a.S = S, a.n_blocks = NB, a.block_size = BS, a.nq = NQ, a.nkv = NKV, a.head_dim = D;
    a.scale = 1.0f / sqrtf((float)D);
    a.anchor = danc, a.doc_start = ddst, a.valid = dval;
    a.q = q, a.kc = kc, a.vc = vc, a.kb = kb, a.vb = vb, a.out = out, a.lse = lse, a.dout = dout;
    a.dq = dq, a.dkc = dkc, a.dvc = dvc, a.dkb = dkb, a.dvb = dvb;
    size_t wsb = df_cuda_dflash_bwd_workspace_bytes(&a);
    CU(cudaMalloc(&a.workspace, wsb));
    size_t free1;
    CU(cudaMemGetInfo(&free1, &total));
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    const int Ws[2] = {0, 2048};
    int rc_all = 0;
    std::string json = "{\"bench\": \"dflash_attn\", \"impl\": \"default (fwd mma2, bwd mma4)\", \"layers\": [";
    for (int li = 0; li < 2; li++) {
        a.window = Ws[li];
        double pairs = 0;
        for (int b = 0; b < NB; b++) {
            if (!val[b])
                continue;
            for (int qo = 0; qo < BS; qo++) {
                int lo = dst[b];
                if (a.window > 0 && anc[b] + qo - (a.window - 1) > lo)
                    lo = anc[b] + qo - (a.window - 1);
                pairs += (lo < anc[b] ? anc[b] - lo : 0) + (a.window > 0 ? qo + 1 : BS);
            }
        }
        pairs *= NQ;
        double ffl = 4.0 * D * pairs, bfl = 2.5 * ffl;
        auto time_ms = [&](bool bwd, int impl, float *mn) -> double {
            std::vector<float> tm;
            a.impl = impl;
            for (int it = 0; it < 3 + reps; it++) {
                CU(cudaEventRecord(e0));
                if (bwd ? df_cuda_dflash_attn_bwd(&a, 0) : df_cuda_dflash_attn_fwd(&a, 0))
                    exit(1);
                CU(cudaEventRecord(e1));
                CU(cudaEventSynchronize(e1));
                float ms;
                CU(cudaEventElapsedTime(&ms, e0, e1));
                if (it >= 3)
                    tm.push_back(ms);
            }
            std::sort(tm.begin(), tm.end());
            if (mn)
                *mn = tm[0];
            return tm[tm.size() / 2];
        };
        float fmin, bmin;
        double fs = time_ms(false, DF_CUDA_DFLASH_IMPL_SIMT, NULL);
        double bs_ = time_ms(true, DF_CUDA_DFLASH_IMPL_SIMT, NULL); // on the simt forward's out/lse
        double f1 = time_ms(false, DF_CUDA_DFLASH_IMPL_MMA, NULL); // the first mma version
        double b1 = time_ms(true, DF_CUDA_DFLASH_IMPL_MMA, NULL);
        double b2 = time_ms(true, DF_CUDA_DFLASH_IMPL_MMA3, NULL);  // 128-key dK/dV tiles
        double mf = time_ms(false, 0, &fmin);                      // the defaults
        double mb = time_ms(true, 0, &bmin);
        // determinism: two default backward runs, bitwise equal
        std::vector<uint16_t> h1(nC), h2(nC), g1(nQ), g2(nQ);
        CU(cudaMemcpy(h1.data(), dkc, nC * 2, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(g1.data(), dq, nQ * 2, cudaMemcpyDeviceToHost));
        a.impl = 0;
        if (df_cuda_dflash_attn_bwd(&a, 0))
            return 1;
        CU(cudaDeviceSynchronize());
        CU(cudaMemcpy(h2.data(), dkc, nC * 2, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(g2.data(), dq, nQ * 2, cudaMemcpyDeviceToHost));
        int det = h1 == h2 && g1 == g2;
        rc_all |= !det;
        // impl MMA4 (new context dK/dV), on the default forward's out/lse; its
        // own determinism check (two runs bitwise equal: dq, dkc, dvc)
        float b4min;
        double b4 = time_ms(true, DF_CUDA_DFLASH_IMPL_MMA4, &b4min);
        std::vector<uint16_t> v1(nC), v2(nC);
        CU(cudaMemcpy(h1.data(), dkc, nC * 2, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(v1.data(), dvc, nC * 2, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(g1.data(), dq, nQ * 2, cudaMemcpyDeviceToHost));
        a.impl = DF_CUDA_DFLASH_IMPL_MMA4;
        if (df_cuda_dflash_attn_bwd(&a, 0))
            return 1;
        CU(cudaDeviceSynchronize());
        CU(cudaMemcpy(h2.data(), dkc, nC * 2, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(v2.data(), dvc, nC * 2, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(g2.data(), dq, nQ * 2, cudaMemcpyDeviceToHost));
        int det4 = h1 == h2 && v1 == v2 && g1 == g2;
        rc_all |= !det4;
        const char *nm = a.window ? "sliding" : "full";
        printf("%-8s visible pairs %.3g: default fwd %.3f ms %.1f TFLOP/s (min %.3f), bwd %.3f ms "
               "%.1f TFLOP/s (min %.3f), deterministic %s; simt fwd %.3f ms, simt bwd %.3f ms; mma1 fwd %.3f ms, mma1 bwd %.3f ms; mma3 bwd %.3f ms; "
               "mma4 bwd %.3f ms %.1f TFLOP/s (min %.3f), deterministic %s\n",
               nm, pairs, mf, ffl / mf * 1e-9, fmin, mb, bfl / mb * 1e-9, bmin, det ? "yes" : "NO",
               fs, bs_, f1, b1, b2, b4, bfl / b4 * 1e-9, b4min, det4 ? "yes" : "NO");
        char buf[768];
        snprintf(buf, sizeof buf,
                 "%s{\"layer\": \"%s\", \"window\": %d, \"pairs\": %.0f, \"fwd_ms\": %.4f, "
                 "\"bwd_ms\": %.4f, \"fwd_tflops\": %.2f, \"bwd_tflops\": %.2f, "
                 "\"simt_fwd_ms\": %.4f, \"simt_bwd_ms\": %.4f, \"mma1_fwd_ms\": %.4f, "
                 "\"mma1_bwd_ms\": %.4f, \"mma3_bwd_ms\": %.4f, \"deterministic\": %s, "
                 "\"mma4_bwd_ms\": %.4f, \"mma4_bwd_tflops\": %.2f, \"mma4_deterministic\": %s}",
                 li ? ", " : "", nm, a.window, pairs, mf, mb, ffl / mf * 1e-9, bfl / mb * 1e-9, fs,
                 bs_, f1, b1, b2, det ? "true" : "false", b4, bfl / b4 * 1e-9,
                 det4 ? "true" : "false");
        json += buf;
    }
    json += "]}";
    printf("%s\n", json.c_str());
    if (json_out) {
        FILE *f = fopen(json_out, "w");
        if (!f || fprintf(f, "%s\n", json.c_str()) < 0 || fclose(f))
            return fprintf(stderr, "cannot write %s\n", json_out), 1;
    }
    size_t free2;
    CU(cudaMemGetInfo(&free2, &total));
    printf("memory: tensors + workspace %.1f MiB (workspace %.2f MiB); device use grew %.1f MiB "
           "by the end (cudaMemGetInfo)\n",
           (free0 - free1) / 1048576.0, wsb / 1048576.0, (free0 - free2) / 1048576.0);
    return rc_all;
}
