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
// The forward is timed twice: the CUDA-core (simt) and the tensor-core (mma.sync)
// kernel; the backward is CUDA-core.
// Usage: bench_dflash_attn [repeats]
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
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
    int reps = argc > 1 ? atoi(argv[1]) : 20;
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
        float mma_ms = 0;
        {
            std::vector<float> tm;
            a.impl = DF_CUDA_DFLASH_IMPL_MMA;
            for (int it = 0; it < 3 + reps; it++) {
                CU(cudaEventRecord(e0));
                if (df_cuda_dflash_attn_fwd(&a, 0))
                    return 1;
                CU(cudaEventRecord(e1));
                CU(cudaEventSynchronize(e1));
                float ms;
                CU(cudaEventElapsedTime(&ms, e0, e1));
                if (it >= 3)
                    tm.push_back(ms);
            }
            std::sort(tm.begin(), tm.end());
            mma_ms = tm[tm.size() / 2];
            a.impl = DF_CUDA_DFLASH_IMPL_SIMT;
        }
        std::vector<float> tf, tb;
        for (int it = 0; it < 3 + reps; it++) {
            CU(cudaEventRecord(e0));
            if (df_cuda_dflash_attn_fwd(&a, 0))
                return 1;
            CU(cudaEventRecord(e1));
            CU(cudaEventSynchronize(e1));
            float ms;
            CU(cudaEventElapsedTime(&ms, e0, e1));
            if (it >= 3)
                tf.push_back(ms);
            CU(cudaEventRecord(e0));
            if (df_cuda_dflash_attn_bwd(&a, 0))
                return 1;
            CU(cudaEventRecord(e1));
            CU(cudaEventSynchronize(e1));
            CU(cudaEventElapsedTime(&ms, e0, e1));
            if (it >= 3)
                tb.push_back(ms);
        }
        std::sort(tf.begin(), tf.end());
        std::sort(tb.begin(), tb.end());
        double mf = tf[tf.size() / 2], mb = tb[tb.size() / 2];
        // determinism: two backward runs, bitwise equal
        std::vector<uint16_t> h1(nC), h2(nC), g1(nQ), g2(nQ);
        CU(cudaMemcpy(h1.data(), dkc, nC * 2, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(g1.data(), dq, nQ * 2, cudaMemcpyDeviceToHost));
        if (df_cuda_dflash_attn_bwd(&a, 0))
            return 1;
        CU(cudaDeviceSynchronize());
        CU(cudaMemcpy(h2.data(), dkc, nC * 2, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(g2.data(), dq, nQ * 2, cudaMemcpyDeviceToHost));
        int det = h1 == h2 && g1 == g2;
        rc_all |= !det;
        printf("%-14s visible pairs %.3g: fwd %.3f ms %.1f TFLOP/s (min %.3f), bwd %.3f ms %.1f "
               "TFLOP/s (min %.3f), deterministic %s\n",
               a.window ? "sliding W=2048" : "full", pairs, mf, ffl / mf * 1e-9, tf[0], mb,
               bfl / mb * 1e-9, tb[0], det ? "yes" : "NO");
        printf("%-14s mma.sync fwd %.3f ms %.1f TFLOP/s\n", "", mma_ms, ffl / mma_ms * 1e-9);
    }
    size_t free2;
    CU(cudaMemGetInfo(&free2, &total));
    printf("memory: tensors + workspace %.1f MiB (workspace %.2f MiB); device use grew %.1f MiB "
           "by the end (cudaMemGetInfo)\n",
           (free0 - free1) / 1048576.0, wsb / 1048576.0, (free0 - free2) / 1048576.0);
    return rc_all;
}
