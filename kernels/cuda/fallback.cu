/* fallback.cu - plain CUDA-core kernels for shapes the tuned kernels do not
 * take: causal attention for any head_dim <= 256 and the gated delta rule
 * token by token for any dk, dv whose state fits in shared memory. They are
 * what tiny test models (head_dim 16/32) run on, and an independent GPU
 * oracle for the tuned kernels. Everything in fp32; outputs rounded to bf16
 * once. Simple on purpose: one warp per (token, head) for attention, one
 * block per (sequence, value head) for the recurrence. */
#include <errno.h>
#include <math.h>
#include <stdint.h>

#include "cuda_internal.h"
#include "device.h"

__device__ static inline float bf(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

__device__ static inline uint16_t to_bf(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Index of the sequence holding token t: the last s with cu[s] <= t. */
__device__ static inline int seq_of(const int32_t *cu, int n_seq, int t)
{
    int lo = 0, hi = n_seq - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

#define MAXR 8 /* head_dim <= 32 * MAXR */

/* One warp per (token i, q head h): online softmax over keys
 * [start of i's sequence, i]; lane l holds dims l, l+32, ... */
__global__ void attn_simt_kernel(const uint16_t *q, int64_t ldq, const uint16_t *k, int64_t ldk,
                                 const uint16_t *v, int64_t ldv, const uint16_t *gate,
                                 int64_t ldg, uint16_t *out, int64_t ldo, const int32_t *cu,
                                 int n_seq, int T, int nq, int nkv, int D, float scale)
{
    int warp = (int)((blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32), lane = threadIdx.x & 31;
    if (warp >= T * nq)
        return;
    int i = warp / nq, h = warp % nq, hk = h / (nq / nkv);
    int j0 = cu[seq_of(cu, n_seq, i)];
    float qr[MAXR], o[MAXR];
    for (int r = 0; r < MAXR; r++) {
        int d = lane + 32 * r;
        qr[r] = d < D ? bf(q[(int64_t)i * ldq + (int64_t)h * D + d]) * scale : 0.0f;
        o[r] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int j = j0; j <= i; j++) {
        float s = 0.0f;
        for (int r = 0; r < MAXR; r++) {
            int d = lane + 32 * r;
            if (d < D)
                s += qr[r] * bf(k[(int64_t)j * ldk + (int64_t)hk * D + d]);
        }
        for (int off = 16; off > 0; off >>= 1)
            s += __shfl_xor_sync(0xffffffffu, s, off);
        float mn = fmaxf(m, s), corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
        for (int r = 0; r < MAXR; r++) {
            int d = lane + 32 * r;
            if (d < D)
                o[r] = o[r] * corr + p * bf(v[(int64_t)j * ldv + (int64_t)hk * D + d]);
        }
        m = mn;
    }
    for (int r = 0; r < MAXR; r++) {
        int d = lane + 32 * r;
        if (d >= D)
            continue;
        float y = o[r] / l;
        if (gate) {
            float g = bf(gate[(int64_t)i * ldg + (int64_t)h * D + d]);
            y *= 1.0f / (1.0f + expf(-g));
        }
        out[(int64_t)i * ldo + (int64_t)h * D + d] = to_bf(y);
    }
}

int df_cuda_attention_simt(df_backend *be, const df_tensor *q, const df_tensor *k,
                           const df_tensor *v, const int32_t *cu_seqlens, int n_seq, int nq,
                           int nkv, int head_dim, float scale, const df_tensor *gate,
                           df_tensor *out)
{
    int64_t T = q->shape[0];
    if (head_dim > 32 * MAXR)
        return -ENOTSUP;
    if (T == 0 || n_seq == 0)
        return 0;
    const int32_t *cu = df_cuda_stage_i32(be, cu_seqlens, n_seq + 1);
    if (!cu)
        return -EIO;
    int64_t warps = T * nq, threads = 128;
    int64_t blocks = (warps * 32 + threads - 1) / threads;
    attn_simt_kernel<<<(unsigned)blocks, (unsigned)threads, 0, df_cuda_stream(be)>>>(
        (const uint16_t *)q->data, q->stride[0], (const uint16_t *)k->data, k->stride[0],
        (const uint16_t *)v->data, v->stride[0], gate ? (const uint16_t *)gate->data : NULL,
        gate ? gate->stride[0] : 0, (uint16_t *)out->data, out->stride[0], cu, n_seq, (int)T, nq,
        nkv, head_dim, scale);
    return df_cuda_check_launch("attention (simt)");
}

/* One block per (sequence, value head), thread c owns state column c:
 * S[:, c] lives in shared memory (dk x dv fp32), k_t and q_t are staged
 * per token. The recurrence of ops.h, token by token. */
__global__ void gdn_recurrent_kernel(const uint16_t *q, int64_t ldq, const uint16_t *k,
                                     int64_t ldk, const uint16_t *v, int64_t ldv, const float *g,
                                     int64_t ldg, const float *beta, int64_t ldb, uint16_t *out,
                                     int64_t ldo, const int32_t *cu, int hk, int hv, int dk,
                                     int dv)
{
    extern __shared__ float sm[];
    float *S = sm, *kt = sm + dk * dv, *qt = kt + dk;
    int s = blockIdx.x, h = blockIdx.y, hq = h / (hv / hk), c = threadIdx.x;
    for (int i = c; i < dk * dv; i += blockDim.x)
        S[i] = 0.0f;
    for (int t = cu[s]; t < cu[s + 1]; t++) {
        __syncthreads(); /* S reset / previous token's reads of kt, qt done */
        for (int i = c; i < dk; i += blockDim.x) {
            kt[i] = bf(k[(int64_t)t * ldk + (int64_t)hq * dk + i]);
            qt[i] = bf(q[(int64_t)t * ldq + (int64_t)hq * dk + i]);
        }
        __syncthreads();
        if (c < dv) {
            float decay = expf(g[(int64_t)t * ldg + h]), b = beta[(int64_t)t * ldb + h];
            float kv = 0.0f;
            for (int i = 0; i < dk; i++) {
                S[i * dv + c] *= decay;
                kv += S[i * dv + c] * kt[i];
            }
            float delta = (bf(v[(int64_t)t * ldv + (int64_t)h * dv + c]) - kv) * b, o = 0.0f;
            for (int i = 0; i < dk; i++) {
                S[i * dv + c] += kt[i] * delta;
                o += S[i * dv + c] * qt[i];
            }
            out[(int64_t)t * ldo + (int64_t)h * dv + c] = to_bf(o);
        }
    }
}

int df_cuda_gdn_recurrent(df_backend *be, const df_tensor *q, const df_tensor *k,
                          const df_tensor *v, const df_tensor *g, const df_tensor *beta,
                          const int32_t *cu_seqlens, int n_seq, int hk, int hv, int dk, int dv,
                          df_tensor *out)
{
    size_t smem = ((size_t)dk * dv + 2 * (size_t)dk) * sizeof(float);
    if (dv > 1024 || smem > 200 * 1024)
        return -ENOTSUP;
    if (n_seq == 0 || q->shape[0] == 0)
        return 0;
    const int32_t *cu = df_cuda_stage_i32(be, cu_seqlens, n_seq + 1);
    if (!cu)
        return -EIO;
    if (smem > 48 * 1024) {
        int rc = df_cuda_func_smem((const void *)gdn_recurrent_kernel, smem);
        if (rc) {
            df_cuda_fail(cudaErrorInvalidValue, "gdn recurrent smem");
            return rc;
        }
    }
    int threads = (dv + 31) / 32 * 32;
    gdn_recurrent_kernel<<<dim3((unsigned)n_seq, (unsigned)hv), (unsigned)threads, smem,
                           df_cuda_stream(be)>>>(
        (const uint16_t *)q->data, q->stride[0], (const uint16_t *)k->data, k->stride[0],
        (const uint16_t *)v->data, v->stride[0], (const float *)g->data, g->stride[0],
        (const float *)beta->data, beta->stride[0], (uint16_t *)out->data, out->stride[0], cu, hk,
        hv, dk, dv);
    return df_cuda_check_launch("gdn (recurrent)");
}
