// dflash_attn/mma_dqs.cu - impl MMA4's one-stage backward's dQ pass on
// mma.sync tensor cores (sm_80+): dQ from the dS^T that the dK/dV pass
// (mma_bwd.cu's dkv_mma2_kernel) stores, and, with one row chunk per block,
// the block keys' S, dP, dS and dK / dV as well (FOLD).
#include "mma.cuh"

namespace {
using namespace df_dflash;

// dQ from the stored dS^T (the one-stage backward): CTA = item (block b, kv
// head g, row chunk ch), MW = 4 warps in 2 x 2: warp w the chunk's rows
// 32 (w & 1) .. + 31 x head-dim columns (D / 2) (w >> 1) .. (each B fragment
// of K feeds two m-tiles, each A fragment of dS half the columns: 192 bytes
// of shared memory per mma instead of 288 with 16-row warps over all D).
// dq = scale (sum over the span's context keys of dS K + the block keys'),
// in key order in 32-key steps (deterministic). A stage: 32 keys of the
// dS^T slot [32][RQ + 8] and their K rows [32][D + 8], cp.async, three
// stages (40 KiB at D 128: two CTAs per SM on the 100 KiB parts).
// FOLD (one row chunk per block, p.nch == 1): the block keys' part is
// computed here, first, instead of by dkv_mma2_kernel's block-tile CTAs
// (one 8-warp CTA per (block, kv head) with a 64-key tile for 16 keys):
// the item's Q, dO, lse, Di and the block's K / V rows (bs rounded up to
// 16: nkb) into shared memory, S and dP per warp on rows 16 w .. + 15,
// P^T and dS^T (bf16) into [key][row] tiles, then dQ's block part from
// dS^T and K_b, and dK_b = scale dS^T Q, dV_b = P^T dO over the chunk's 64
// rows (warp w: head-dim columns (D / 4) w ..), written once; then the
// context steps reuse the same shared memory (fold_smem).
constexpr int DQS_KEYS = 32, DQS_ST = 3;
template <int D> constexpr size_t dq_dsd_smem() { return (size_t)DQS_ST * DQS_KEYS * ((RQ + 8) + (D + 8)) * 2; }
// FOLD's block part: Q, dO [RQ][D + 8]; K_b, V_b [nkb][D + 8]; P^T, dS^T
// [nkb][RQ + 8]; lse * log2e and Di [RQ] (fp32)
__host__ __device__ constexpr size_t fold_blk_smem(int D, int nkb)
{
    return ((size_t)2 * RQ * (D + 8) + (size_t)2 * nkb * (D + 8) + (size_t)2 * nkb * (RQ + 8)) * 2 +
           (size_t)2 * RQ * 4;
}
template <int D> size_t fold_smem(int bs)
{
    size_t a = dq_dsd_smem<D>(), b = fold_blk_smem(D, (bs + 15) / 16 * 16);
    return a > b ? a : b;
}
template <int D, bool FOLD>
__global__ void __launch_bounds__(MW * 32) dq_dsd_kernel(Params p, const uint16_t *dsd)
{
    static_assert(MW == 4 && RQ == 64, "2 x 2 warps over 64 rows");
    constexpr int KP = D + 8, TP = RQ + 8, NTH = D / 16, V8 = D / 8, R8 = RQ / 8, NTHR = MW * 32;
    constexpr int STG = DQS_KEYS * (TP + KP);
    extern __shared__ float4 smem4[];
    uint16_t *sm = reinterpret_cast<uint16_t *>(smem4); // stage st: dS^T at st * STG, K after it
    int ch = blockIdx.x % p.nch, g = (blockIdx.x / p.nch) % p.nkv, b = blockIdx.x / (p.nch * p.nkv);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t4 = lane & 3, gid = lane >> 2;
    int wr = (warp & 1) * 32, wc = (warp >> 1) * (D / 2);
    long long ldq = (long long)p.nq * D, ldk = (long long)p.nkv * D;
    float acc[2][NTH][4];
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int nd = 0; nd < NTH; nd++)
            acc[mi][nd][0] = acc[mi][nd][1] = acc[mi][nd][2] = acc[mi][nd][3] = 0.0f;
    // acc += dS (this warp's rows, nkk x 16 keys) K (those keys, this warp's columns)
    // from dS^T [key][row] (pitch TP) and K [key][col] (pitch KP) in shared memory
    auto dq_steps = [&](const uint16_t *Ts, const uint16_t *Ks, int nkk) {
        for (int kk = 0; kk < nkk; kk++) {
            // A = dS (rows wr + 16 mi.., keys 16 kk..) from dS^T [key][row]: ldmatrix .trans;
            // matrices (rows lo, keys lo), (rows hi, keys lo), (rows lo, keys hi), (rows hi, keys hi)
            uint32_t a[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
                ldsm4t(a[mi], Ts + (kk * 16 + (lane >> 4) * 8 + (lane & 7)) * TP + wr + mi * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int nd = 0; nd < NTH; nd += 2) { // B = K (keys 16 kk.., columns wc + 8 nd..)
                uint32_t r[4];
                ldsm4t(r, Ks + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * KP + wc + (nd + (lane >> 4)) * 8);
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    mma16816(acc[mi][nd], a[mi], r[0], r[1]);
                    mma16816(acc[mi][nd + 1], a[mi], r[2], r[3]);
                }
            }
        }
    };
    if (FOLD && !p.valid[b]) { // the block keys' dK / dV of a padding block: 0
        for (int e = threadIdx.x; e < p.bs * V8; e += NTHR) {
            long long off = ((long long)b * p.bs + e / V8) * ldk + (long long)g * D + (e % V8) * 8;
            *reinterpret_cast<uint4 *>(p.dkb + off) = make_uint4(0, 0, 0, 0);
            *reinterpret_cast<uint4 *>(p.dvb + off) = make_uint4(0, 0, 0, 0);
        }
    }
    if (p.valid[b]) {
        int anc = p.anchor[b], lo0 = ctx_lo(anc, p.doc_start[b], p.W, 0);
        int t0 = lo0 / TKM, maxt = dsd_maxt(p.S, p.W);
        if (FOLD) {
            const int nkb = (p.bs + 15) / 16 * 16;
            uint16_t *Qs = sm, *dOs = Qs + RQ * KP, *Kb = dOs + RQ * KP, *Vb = Kb + nkb * KP;
            uint16_t *Pt = Vb + nkb * KP, *St = Pt + nkb * TP;
            float *Ls = reinterpret_cast<float *>(St + nkb * TP), *Ds = Ls + RQ;
            const bool q16 = Q16Rows<D, NTHR>::on(p); // (block size 16, group 4: no divisions)
            if (q16) {
                Q16Rows<D, NTHR> qr;
                qr.init();
                qr.issue(p, b, g, p.q, Qs, p.dout, dOs);
            } else {
                issue_rows<D, RQ, NTHR>(p, b, g, 0, p.q, Qs, p.dout, dOs);
            }
            for (int e = threadIdx.x; e < nkb * V8; e += NTHR) {
                int key = e / V8, c = (e % V8) * 8;
                bool ok = key < p.bs;
                long long off = ok ? ((long long)b * p.bs + key) * ldk + (long long)g * D + c : 0;
                cp16(Kb + key * KP + c, p.kb + off, ok);
                cp16(Vb + key * KP + c, p.vb + off, ok);
            }
            cp_commit();
            for (int r = threadIdx.x; r < RQ; r += NTHR) {
                RowId id;
                long long li;
                if (q16) {
                    id.ok = true, li = Q16Rows<D, NTHR>::row(p, b, g, r);
                } else {
                    id = row_id(p, b, g, 0, r);
                    li = (long long)id.grow * p.nq + id.h;
                }
                Ls[r] = id.ok ? p.lse_in[li] * LOG2E : -INFINITY;
                Ds[r] = id.ok ? p.Di[li] : 0.0f;
            }
            cp_wait<0>();
            __syncthreads();
            // S, dP on rows 16 warp .. + 15, 16 keys at a time; P^T, dS^T to shared memory
            const float sl = p.scale * LOG2E;
            const int r0 = warp * 16;
            const int qo2[2] = {(r0 + gid) / p.group, (r0 + gid + 8) / p.group}; // this thread's rows' queries
            for (int kt = 0; kt < nkb / 16; kt++) {
                float s[2][4], dp[2][4];
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        s[nt][e] = 0.0f, dp[nt][e] = 0.0f;
#pragma unroll
                for (int ks = 0; ks < D / 16; ks++) {
                    uint32_t a[4];
                    ldsm_a<KP>(a, Qs, r0, ks * 16, lane);
                    mma_rows<2, KP>(s, a, Kb, kt * 16, ks * 16, lane);
                    ldsm_a<KP>(a, dOs, r0, ks * 16, lane);
                    mma_rows<2, KP>(dp, a, Vb, kt * 16, ks * 16, lane);
                }
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int r = r0 + gid + 8 * (e >> 1), key = kt * 16 + nt * 8 + 2 * t4 + (e & 1);
                        float Lr = Ls[r];
                        // (rows past the chunk's: lse -inf; their qo is 0)
                        bool vis = Lr != -INFINITY && visible(false, key, p.bs, 0, qo2[e >> 1], p.W);
                        float P = vis ? ex2(s[nt][e] * sl - Lr) : 0.0f;
                        float dS = vis ? P * (dp[nt][e] - Ds[r]) : 0.0f;
                        Pt[key * TP + r] = f2bf(P);
                        St[key * TP + r] = f2bf(dS);
                    }
            }
            __syncthreads();
            dq_steps(St, Kb, nkb / 16);
            // dK_b, dV_b: keys 16 mt .. + 15 x columns (D / 4) warp .., over the 64 rows
            constexpr int NTQ = D / 32;
            const int cq = warp * (D / 4);
            for (int mt = 0; mt < nkb / 16; mt++) {
                float dk[NTQ][4], dv[NTQ][4];
#pragma unroll
                for (int nd = 0; nd < NTQ; nd++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        dk[nd][e] = 0.0f, dv[nd][e] = 0.0f;
#pragma unroll
                for (int kr = 0; kr < RQ / 16; kr++) {
                    uint32_t a[4];
                    ldsm_a<TP>(a, St, mt * 16, kr * 16, lane);
                    mma_cols<NTQ, KP>(dk, a, Qs + cq, kr * 16, lane);
                    ldsm_a<TP>(a, Pt, mt * 16, kr * 16, lane);
                    mma_cols<NTQ, KP>(dv, a, dOs + cq, kr * 16, lane);
                }
#pragma unroll
                for (int ri = 0; ri < 2; ri++) {
                    int key = mt * 16 + gid + 8 * ri;
                    if (key >= p.bs)
                        continue;
                    long long off = ((long long)b * p.bs + key) * ldk + (long long)g * D + cq;
#pragma unroll
                    for (int nd = 0; nd < NTQ; nd++) {
                        *reinterpret_cast<uint32_t *>(p.dkb + off + nd * 8 + 2 * t4) =
                            pack_bf2(dk[nd][2 * ri] * p.scale, dk[nd][2 * ri + 1] * p.scale);
                        *reinterpret_cast<uint32_t *>(p.dvb + off + nd * 8 + 2 * t4) =
                            pack_bf2(dv[nd][2 * ri], dv[nd][2 * ri + 1]);
                    }
                }
            }
            __syncthreads(); // the block part's shared memory is the context steps' stages
        }
        // 32-key steps: the context tiles' up to the anchor, then (without FOLD) the block tile's up to bs
        int nhc = anc > lo0 ? (anc - t0 * TKM + DQS_KEYS - 1) / DQS_KEYS : 0;
        int nh = nhc + (FOLD ? 0 : (p.bs + DQS_KEYS - 1) / DQS_KEYS);
        // Each thread's 16-byte pieces of a step are the same in every step (only the step's
        // base moves): dS^T rows (keys) kd + DR i at column cd, K rows kq + KR i at column cq.
        constexpr int DR = NTHR / R8, KR = NTHR / V8; // rows per pass of the pieces
        static_assert(NTHR % R8 == 0 && NTHR % V8 == 0 && DQS_KEYS % DR == 0 && DQS_KEYS % KR == 0,
                      "whole passes of pieces");
        const int kd = threadIdx.x / R8, cd = (threadIdx.x % R8) * 8;
        const int kq = threadIdx.x / V8, cq = (threadIdx.x % V8) * 8;
        const size_t slot0 = dsd_slot(p, b, g, ch, 0);
        auto issue = [&](int h, int st) {
            uint16_t *Ts = sm + st * STG, *Ks = Ts + DQS_KEYS * TP;
            const bool isctx = h < nhc;
            const int t = isctx ? h / (TKM / DQS_KEYS) : maxt;
            const int k0 = isctx ? (h % (TKM / DQS_KEYS)) * DQS_KEYS : (h - nhc) * DQS_KEYS; // in the slot
            const int base = (isctx ? (t0 + t) * TKM : 0) + k0, end = isctx ? anc : p.bs;
            const uint16_t *dsrc = dsd + (slot0 + t) * (size_t)(TKM * RQ) + (size_t)(k0 + kd) * RQ + cd;
            const uint16_t *ksrc = (isctx ? p.kc + (long long)base * ldk : p.kb + ((long long)b * p.bs + base) * ldk) +
                                   (long long)kq * ldk + (long long)g * D + cq;
#pragma unroll
            for (int i = 0; i < DQS_KEYS / DR; i++) {
                bool ok = base + kd + DR * i < end;
                cp16(Ts + (kd + DR * i) * TP + cd, ok ? dsrc + DR * i * RQ : dsd, ok);
            }
#pragma unroll
            for (int i = 0; i < DQS_KEYS / KR; i++) {
                bool ok = base + kq + KR * i < end;
                cp16(Ks + (kq + KR * i) * KP + cq, ok ? ksrc + KR * i * ldk : p.kc, ok);
            }
        };
#pragma unroll
        for (int s = 0; s < DQS_ST - 1; s++) {
            if (s < nh)
                issue(s, s);
            cp_commit();
        }
        for (int h = 0; h < nh; h++) {
            cp_wait<DQS_ST - 2>();
            __syncthreads(); // step h landed for all; step h - 1's stage is free
            if (h + DQS_ST - 1 < nh)
                issue(h + DQS_ST - 1, (h + DQS_ST - 1) % DQS_ST);
            cp_commit();
            const uint16_t *Ts = sm + (h % DQS_ST) * STG, *Ks = Ts + DQS_KEYS * TP;
            dq_steps(Ts, Ks, DQS_KEYS / 16);
        }
        cp_wait<0>();
    }
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            RowId id = row_id(p, b, g, ch, wr + mi * 16 + gid + 8 * ri);
            if (!id.ok)
                continue;
            uint16_t *qrow = p.dq + id.grow * ldq + id.h * D + wc;
#pragma unroll
            for (int nd = 0; nd < NTH; nd++)
                *reinterpret_cast<uint32_t *>(qrow + nd * 8 + 2 * t4) =
                    pack_bf2(acc[mi][nd][2 * ri] * p.scale, acc[mi][nd][2 * ri + 1] * p.scale);
        }
}

} // namespace

namespace df_dflash {

int dq_dsd_launch(const Params &p, int D, cudaStream_t st, const uint16_t *dsd, bool fold)
{
    unsigned grid = (unsigned)((long long)p.nb * p.nkv * p.nch);
    if (D == 64) {
        if (fold) {
            size_t sm = fold_smem<64>(p.bs);
            SMEM((dq_dsd_kernel<64, true>), sm);
            dq_dsd_kernel<64, true><<<grid, MW * 32, sm, st>>>(p, dsd);
        } else {
            SMEM((dq_dsd_kernel<64, false>), dq_dsd_smem<64>());
            dq_dsd_kernel<64, false><<<grid, MW * 32, dq_dsd_smem<64>(), st>>>(p, dsd);
        }
    } else {
        if (fold) {
            size_t sm = fold_smem<128>(p.bs);
            SMEM((dq_dsd_kernel<128, true>), sm);
            dq_dsd_kernel<128, true><<<grid, MW * 32, sm, st>>>(p, dsd);
        } else {
            SMEM((dq_dsd_kernel<128, false>), dq_dsd_smem<128>());
            dq_dsd_kernel<128, false><<<grid, MW * 32, dq_dsd_smem<128>(), st>>>(p, dsd);
        }
    }
    CU(cudaGetLastError());
    return 0;
}

} // namespace df_dflash
