// dflash_attn/simt.cu - impl SIMT: the drafter attention on the CUDA cores
// (fp32 FMA, 256 threads = 8 warps), the plain reference on the GPU
// (dispatch.cu's header describes the structure every implementation shares).
#include "attn_internal.cuh"

namespace {
using namespace df_dflash;

constexpr int RPW = 8, TK = 32, PP = TK + 4; // rows per warp; keys per tile; score row pitch
static_assert(RQ == NW * RPW, "row chunk size");

// n rows of D bf16 (row i at src + row_off(i)) into dst [n][D+4] floats;
// rows with row_off < 0 (and rows >= n up to nmax) are zero-filled.
template <int D, typename F>
__device__ __forceinline__ void load_rows(float *dst, int nmax, const uint16_t *src, F row_off)
{
    constexpr int DP = D + 4, V = D / 8;
    for (int e = threadIdx.x; e < nmax * V; e += NT) {
        int i = e / V, c = (e % V) * 8;
        long long off = row_off(i);
        float *d = dst + i * DP + c;
        if (off < 0) {
            for (int t = 0; t < 8; t++)
                d[t] = 0.0f;
            continue;
        }
        uint4 u = *reinterpret_cast<const uint4 *>(src + off + c);
        uint32_t w[4] = {u.x, u.y, u.z, u.w};
        for (int t = 0; t < 4; t++) {
            d[2 * t] = __uint_as_float(w[t] << 16);
            d[2 * t + 1] = __uint_as_float(w[t] & 0xffff0000u);
        }
    }
}

// Scores (and optionally dO.V^T) of the warp's rows x the tile's keys (lane).
template <int D, bool DP_TOO>
__device__ __forceinline__ void tile_scores(const float *Qs, const float *Ks, const float *dOs,
                                            const float *Vs, int warp, int lane, float s[RPW],
                                            float dp[RPW])
{
    constexpr int DP = D + 4;
#pragma unroll
    for (int i = 0; i < RPW; i++)
        s[i] = 0.0f, dp[i] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < D; d += 4) {
        float4 k4 = *reinterpret_cast<const float4 *>(Ks + lane * DP + d);
        float4 v4;
        if (DP_TOO)
            v4 = *reinterpret_cast<const float4 *>(Vs + lane * DP + d);
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            float4 q4 = *reinterpret_cast<const float4 *>(Qs + (warp + NW * i) * DP + d);
            s[i] += q4.x * k4.x + q4.y * k4.y + q4.z * k4.z + q4.w * k4.w;
            if (DP_TOO) {
                float4 o4 = *reinterpret_cast<const float4 *>(dOs + (warp + NW * i) * DP + d);
                dp[i] += o4.x * v4.x + o4.y * v4.y + o4.z * v4.z + o4.w * v4.w;
            }
        }
    }
}

// acc[i][k] += sum_c Ps[row_i][c] * Xs[c][lane + 32 k]
template <int D>
__device__ __forceinline__ void tile_accum(const float *Ps, const float *Xs, int warp, int lane,
                                           float acc[RPW][D / 32])
{
    constexpr int DP = D + 4, KD = D / 32;
#pragma unroll 2
    for (int c = 0; c < TK; c += 4) {
        float x[4][KD];
#pragma unroll
        for (int t = 0; t < 4; t++)
#pragma unroll
            for (int k = 0; k < KD; k++)
                x[t][k] = Xs[(c + t) * DP + lane + 32 * k];
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            float4 p4 = *reinterpret_cast<const float4 *>(Ps + (warp + NW * i) * PP + c);
#pragma unroll
            for (int k = 0; k < KD; k++)
                acc[i][k] += p4.x * x[0][k] + p4.y * x[1][k] + p4.z * x[2][k] + p4.w * x[3][k];
        }
    }
}

// ---- forward ----
template <int D>
__global__ void __launch_bounds__(NT) fwd_kernel(Params p)
{
    constexpr int DP = D + 4, KD = D / 32;
    extern __shared__ float4 smem4[];
    float *Qs = reinterpret_cast<float *>(smem4), *Ks = Qs + RQ * DP, *Vs = Ks + TK * DP,
          *Ps = Vs + TK * DP;
    int ch = blockIdx.x % p.nch, g = (blockIdx.x / p.nch) % p.nkv,
        b = blockIdx.x / (p.nch * p.nkv);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long ldq = (long long)p.nq * D, ldk = (long long)p.nkv * D;
    if (!p.valid[b]) {
        for (int i = 0; i < RPW; i++) {
            RowId id = row_id(p, b, g, ch, warp + NW * i);
            if (!id.ok)
                continue;
            for (int k = 0; k < KD; k++)
                p.o[id.grow * ldq + id.h * D + lane + 32 * k] = 0;
            if (lane == 0)
                p.lse[(long long)id.grow * p.nq + id.h] = -INFINITY;
        }
        return;
    }
    int anc = p.anchor[b], ds = p.doc_start[b];
    int lo0 = ctx_lo(anc, ds, p.W, 0);
    load_rows<D>(Qs, RQ, p.q, [&](int i) -> long long {
        RowId id = row_id(p, b, g, ch, i);
        return id.ok ? id.grow * ldq + id.h * D : -1;
    });
    int qo[RPW], lo[RPW];
    bool rok[RPW];
    float m[RPW], l[RPW], acc[RPW][KD];
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        RowId id = row_id(p, b, g, ch, warp + NW * i);
        rok[i] = id.ok, qo[i] = id.qo, lo[i] = ctx_lo(anc, ds, p.W, id.qo);
        m[i] = -INFINITY, l[i] = 0.0f;
#pragma unroll
        for (int k = 0; k < KD; k++)
            acc[i][k] = 0.0f;
    }
    int ntc = (anc - lo0 + TK - 1) / TK, ntb = (p.bs + TK - 1) / TK;
    for (int t = 0; t < ntc + ntb; t++) {
        bool isctx = t < ntc;
        int base = isctx ? lo0 + t * TK : (t - ntc) * TK;
        int end = isctx ? anc : p.bs;
        __syncthreads();
        const uint16_t *ksrc = isctx ? p.kc : p.kb, *vsrc = isctx ? p.vc : p.vb;
        long long rbase = isctx ? base : (long long)b * p.bs + base;
        auto roff = [&](int i) -> long long {
            return base + i < end ? (rbase + i) * ldk + (long long)g * D : -1;
        };
        load_rows<D>(Ks, TK, ksrc, roff);
        load_rows<D>(Vs, TK, vsrc, roff);
        __syncthreads();
        float s[RPW], dummy[RPW];
        tile_scores<D, false>(Qs, Ks, nullptr, nullptr, warp, lane, s, dummy);
        float al[RPW];
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            bool vis = rok[i] && visible(isctx, base + lane, end, lo[i], qo[i], p.W);
            float sv = vis ? s[i] * p.scale : -INFINITY;
            float mn = fmaxf(m[i], warp_max(sv));
            float pr, a;
            if (mn == -INFINITY) {
                pr = 0.0f, a = 1.0f;
            } else {
                pr = vis ? expf(sv - mn) : 0.0f;
                a = expf(m[i] - mn);
            }
            l[i] = l[i] * a + warp_sum(pr);
            m[i] = mn, al[i] = a;
            Ps[(warp + NW * i) * PP + lane] = pr;
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < RPW; i++)
#pragma unroll
            for (int k = 0; k < KD; k++)
                acc[i][k] *= al[i];
        tile_accum<D>(Ps, Vs, warp, lane, acc);
    }
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        RowId id = row_id(p, b, g, ch, warp + NW * i);
        if (!id.ok)
            continue;
        bool any = l[i] > 0.0f;
        float inv = any ? 1.0f / l[i] : 0.0f;
#pragma unroll
        for (int k = 0; k < KD; k++)
            p.o[id.grow * ldq + id.h * D + lane + 32 * k] = f2bf(any ? acc[i][k] * inv : 0.0f);
        if (lane == 0)
            p.lse[(long long)id.grow * p.nq + id.h] = any ? m[i] + logf(l[i]) : -INFINITY;
    }
}

template <int D>
__global__ void __launch_bounds__(NT) dq_kernel(Params p)
{
    constexpr int DP = D + 4, KD = D / 32;
    extern __shared__ float4 smem4[];
    float *Qs = reinterpret_cast<float *>(smem4), *dOs = Qs + RQ * DP, *Ks = dOs + RQ * DP,
          *Vs = Ks + TK * DP, *Ps = Vs + TK * DP;
    int ch = blockIdx.x % p.nch, g = (blockIdx.x / p.nch) % p.nkv,
        b = blockIdx.x / (p.nch * p.nkv);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long ldq = (long long)p.nq * D, ldk = (long long)p.nkv * D;
    if (!p.valid[b]) {
        for (int i = 0; i < RPW; i++) {
            RowId id = row_id(p, b, g, ch, warp + NW * i);
            if (id.ok)
                for (int k = 0; k < KD; k++)
                    p.dq[id.grow * ldq + id.h * D + lane + 32 * k] = 0;
        }
        return;
    }
    int anc = p.anchor[b], ds = p.doc_start[b];
    int lo0 = ctx_lo(anc, ds, p.W, 0);
    auto qoff = [&](int i) -> long long {
        RowId id = row_id(p, b, g, ch, i);
        return id.ok ? id.grow * ldq + id.h * D : -1;
    };
    load_rows<D>(Qs, RQ, p.q, qoff);
    load_rows<D>(dOs, RQ, p.dout, qoff);
    int qo[RPW], lo[RPW];
    bool rok[RPW];
    float L[RPW], Dr[RPW], acc[RPW][KD];
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        RowId id = row_id(p, b, g, ch, warp + NW * i);
        rok[i] = id.ok, qo[i] = id.qo, lo[i] = ctx_lo(anc, ds, p.W, id.qo);
        long long li = (long long)id.grow * p.nq + id.h;
        L[i] = id.ok ? p.lse_in[li] : -INFINITY;
        Dr[i] = id.ok ? p.Di[li] : 0.0f;
        rok[i] = rok[i] && L[i] != -INFINITY;
#pragma unroll
        for (int k = 0; k < KD; k++)
            acc[i][k] = 0.0f;
    }
    int ntc = (anc - lo0 + TK - 1) / TK, ntb = (p.bs + TK - 1) / TK;
    for (int t = 0; t < ntc + ntb; t++) {
        bool isctx = t < ntc;
        int base = isctx ? lo0 + t * TK : (t - ntc) * TK;
        int end = isctx ? anc : p.bs;
        __syncthreads();
        const uint16_t *ksrc = isctx ? p.kc : p.kb, *vsrc = isctx ? p.vc : p.vb;
        long long rbase = isctx ? base : (long long)b * p.bs + base;
        auto roff = [&](int i) -> long long {
            return base + i < end ? (rbase + i) * ldk + (long long)g * D : -1;
        };
        load_rows<D>(Ks, TK, ksrc, roff);
        load_rows<D>(Vs, TK, vsrc, roff);
        __syncthreads();
        float s[RPW], dp[RPW];
        tile_scores<D, true>(Qs, Ks, dOs, Vs, warp, lane, s, dp);
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            bool vis = rok[i] && visible(isctx, base + lane, end, lo[i], qo[i], p.W);
            float P = vis ? expf(s[i] * p.scale - L[i]) : 0.0f;
            Ps[(warp + NW * i) * PP + lane] = vis ? P * (dp[i] - Dr[i]) : 0.0f;
        }
        __syncwarp();
        tile_accum<D>(Ps, Ks, warp, lane, acc);
    }
#pragma unroll
    for (int i = 0; i < RPW; i++) {
        RowId id = row_id(p, b, g, ch, warp + NW * i);
        if (!id.ok)
            continue;
#pragma unroll
        for (int k = 0; k < KD; k++)
            p.dq[id.grow * ldq + id.h * D + lane + 32 * k] = f2bf(acc[i][k] * p.scale);
    }
}

template <int D>
__global__ void __launch_bounds__(NT) dkv_kernel(Params p)
{
    constexpr int DP = D + 4, KD = D / 32, KPW = TK / NW; // keys per warp in the accumulate
    extern __shared__ float4 smem4[];
    float *Qs = reinterpret_cast<float *>(smem4), *dOs = Qs + RQ * DP, *Ks = dOs + RQ * DP,
          *Vs = Ks + TK * DP, *Ps = Vs + TK * DP, *dSs = Ps + RQ * PP;
    int g = blockIdx.x % p.nkv, tile = blockIdx.x / p.nkv;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long ldq = (long long)p.nq * D, ldk = (long long)p.nkv * D;
    int nct = (p.S + TK - 1) / TK, ntb = (p.bs + TK - 1) / TK;
    bool isctx = tile < nct;
    int bb = isctx ? -1 : (tile - nct) / ntb;
    int base = isctx ? tile * TK : ((tile - nct) % ntb) * TK;
    int end = isctx ? p.S : p.bs;
    uint16_t *dk = isctx ? p.dkc : p.dkb, *dv = isctx ? p.dvc : p.dvb;
    long long rbase = isctx ? base : (long long)bb * p.bs + base;
    float ak[KPW][KD], av[KPW][KD];
#pragma unroll
    for (int j = 0; j < KPW; j++)
#pragma unroll
        for (int k = 0; k < KD; k++)
            ak[j][k] = 0.0f, av[j][k] = 0.0f;
    if (isctx || p.valid[bb]) {
        const uint16_t *ksrc = isctx ? p.kc : p.kb, *vsrc = isctx ? p.vc : p.vb;
        auto roff = [&](int i) -> long long {
            return base + i < end ? (rbase + i) * ldk + (long long)g * D : -1;
        };
        load_rows<D>(Ks, TK, ksrc, roff);
        load_rows<D>(Vs, TK, vsrc, roff);
        int b0 = isctx ? 0 : bb, b1 = isctx ? p.nb : bb + 1;
        int kend = base + TK < end ? base + TK : end;
        for (int b = b0; b < b1; b++) {
            if (!p.valid[b])
                continue;
            int anc = p.anchor[b], ds = p.doc_start[b];
            if (isctx) {
                int lo0 = ctx_lo(anc, ds, p.W, 0);
                if (anc <= base || lo0 >= kend || lo0 >= anc)
                    continue;
            }
            for (int ch = 0; ch < p.nch; ch++) {
                __syncthreads(); // previous users of Qs/dOs/Ps/dSs are done
                auto qoff = [&](int i) -> long long {
                    RowId id = row_id(p, b, g, ch, i);
                    return id.ok ? id.grow * ldq + id.h * D : -1;
                };
                load_rows<D>(Qs, RQ, p.q, qoff);
                load_rows<D>(dOs, RQ, p.dout, qoff);
                __syncthreads();
                float s[RPW], dp[RPW];
                tile_scores<D, true>(Qs, Ks, dOs, Vs, warp, lane, s, dp);
#pragma unroll
                for (int i = 0; i < RPW; i++) {
                    RowId id = row_id(p, b, g, ch, warp + NW * i);
                    long long li = (long long)id.grow * p.nq + id.h;
                    float L = id.ok ? p.lse_in[li] : -INFINITY;
                    float Dr = id.ok ? p.Di[li] : 0.0f;
                    bool vis = id.ok && L != -INFINITY &&
                               (isctx ? (base + lane < anc &&
                                         base + lane >= ctx_lo(anc, ds, p.W, id.qo))
                                      : visible(false, base + lane, end, 0, id.qo, p.W));
                    vis = vis && base + lane < end;
                    float P = vis ? expf(s[i] * p.scale - L) : 0.0f;
                    Ps[(warp + NW * i) * PP + lane] = P;
                    dSs[(warp + NW * i) * PP + lane] = vis ? P * (dp[i] - Dr) : 0.0f;
                }
                __syncthreads();
                int nr = p.bs * p.group - ch * RQ;
                nr = nr < RQ ? nr : RQ;
                for (int r = 0; r < nr; r++) {
                    float o[KD], qq[KD];
#pragma unroll
                    for (int k = 0; k < KD; k++)
                        o[k] = dOs[r * DP + lane + 32 * k], qq[k] = Qs[r * DP + lane + 32 * k];
#pragma unroll
                    for (int j = 0; j < KPW; j++) {
                        float pv = Ps[r * PP + warp + NW * j], sv = dSs[r * PP + warp + NW * j];
#pragma unroll
                        for (int k = 0; k < KD; k++)
                            av[j][k] += pv * o[k], ak[j][k] += sv * qq[k];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < KPW; j++) {
        int c = warp + NW * j;
        if (base + c >= end)
            continue;
        long long off = (rbase + c) * ldk + (long long)g * D;
#pragma unroll
        for (int k = 0; k < KD; k++) {
            dk[off + lane + 32 * k] = f2bf(ak[j][k] * p.scale);
            dv[off + lane + 32 * k] = f2bf(av[j][k]);
        }
    }
}

constexpr size_t fwd_smem(int D) { return ((size_t)(RQ + 2 * TK) * (D + 4) + RQ * PP) * 4; }
constexpr size_t dq_smem(int D) { return ((size_t)(2 * RQ + 2 * TK) * (D + 4) + RQ * PP) * 4; }
constexpr size_t dkv_smem(int D) { return ((size_t)(2 * RQ + 2 * TK) * (D + 4) + 2 * RQ * PP) * 4; }

template <int D>
int fwd_simt_launch(const Params &p, cudaStream_t st)
{
    long long n = (long long)p.nb * p.nkv * p.nch;
    if (n == 0)
        return 0;
    SMEM(fwd_kernel<D>, fwd_smem(D));
    fwd_kernel<D><<<(unsigned)n, NT, fwd_smem(D), st>>>(p);
    CU(cudaGetLastError());
    return 0;
}

// SIMT: Di, dQ, then the context and block keys' dK/dV in one kernel.
template <int D>
int bwd_simt_launch(const Params &p, cudaStream_t st)
{
    long long rows = (long long)p.nb * p.bs;
    if (rows > 0) {
        int rc = di_launch(p, D, st);
        if (rc)
            return rc;
        unsigned n = (unsigned)((long long)p.nb * p.nkv * p.nch);
        SMEM(dq_kernel<D>, dq_smem(D));
        dq_kernel<D><<<n, NT, dq_smem(D), st>>>(p);
        CU(cudaGetLastError());
    }
    long long tiles = (p.S + TK - 1) / TK + (long long)p.nb * ((p.bs + TK - 1) / TK);
    if (tiles > 0) {
        SMEM(dkv_kernel<D>, dkv_smem(D));
        dkv_kernel<D><<<(unsigned)(tiles * p.nkv), NT, dkv_smem(D), st>>>(p);
        CU(cudaGetLastError());
    }
    return 0;
}

} // namespace

namespace df_dflash {
int simt_fwd_launch(const Params &p, int D, cudaStream_t st)
{
    return D == 64 ? fwd_simt_launch<64>(p, st) : fwd_simt_launch<128>(p, st);
}
int simt_bwd_launch(const Params &p, int D, cudaStream_t st)
{
    return D == 64 ? bwd_simt_launch<64>(p, st) : bwd_simt_launch<128>(p, st);
}
} // namespace df_dflash
