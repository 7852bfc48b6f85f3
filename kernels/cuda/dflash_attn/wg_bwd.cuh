// dflash_attn/wg_bwd.cuh - what the Hopper backward's dQ pass (wg_dq.cu)
// and block pass (wg_blk.cu) share: Di of a chunk's rows with di_kernel's
// bits (chunk_di, chunk_di_smem), the block tile's P^T / dS^T stores, the
// block keys' dK / dV from them (fold16), the block tile's dS^T for WG3's
// dQ (dsb_store). Device code exists in sm_90a builds only (DF_WG_BODY).
// Internal.
#ifndef DF_DFLASH_ATTN_WG_BWD_CUH
#define DF_DFLASH_ATTN_WG_BWD_CUH

#include "common.cuh"
#include "wg.cuh" // DF_WG_BODY (sm_90a code), the wgmma / TMA / swizzle helpers

namespace df_dflash {
namespace {

constexpr int QNT = 128; // threads of the dQ and block passes: one warpgroup

#if DF_WG_BODY


// WG2F: Di = dO . O of this thread's two rows (rid[0], rid[1]; 0 for rows
// past the chunk's), computed as di_kernel (dflash_attn/mma_bwd.cu) computes it, bit
// for bit: there lane l of a warp sums its D / 32 products o[l + 32 i] d[l +
// 32 i] in i order (fma, from 0), then a butterfly (shfl xor 16, 8, 4, 2, 1;
// fp32 adds commute, so every lane ends with lane 0's bits). Here the quad
// of a row (t4 = 0..3) plays its 32 lanes: thread t4 plays lanes 8 t4 ..
// 8 t4 + 7 (their elements are 16-byte vectors: one uint4 of O and of dO
// per i), lane xor 16 / 8 is thread t4 xor 2 / 1, lane xor 4, 2, 1 stay
// inside the thread. So the Di the later passes read equals di_kernel's and
// WG2F's dQ and context dK / dV equal WG2's bitwise (same inputs, same sums).
// v[j] += the products of one 16-byte vector of O and of dO (element 2 k:
// the low half of word k, bf2f: bits << 16), chunk_di's order
__device__ __forceinline__ void di_acc(float (&v)[8], uint4 uo, uint4 ud)
{
    uint32_t wo[4] = {uo.x, uo.y, uo.z, uo.w}, wd[4] = {ud.x, ud.y, ud.z, ud.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        v[2 * k] += __uint_as_float(wo[k] << 16) * __uint_as_float(wd[k] << 16);
        v[2 * k + 1] += __uint_as_float(wo[k] & 0xffff0000u) * __uint_as_float(wd[k] & 0xffff0000u);
    }
}

// the quad's butterfly of chunk_di (every thread of the warp takes part)
__device__ __forceinline__ float di_quad_sum(float (&v)[8])
{
#pragma unroll
    for (int j = 0; j < 8; j++)
        v[j] += __shfl_xor_sync(0xffffffffu, v[j], 2); // lanes l, l ^ 16
#pragma unroll
    for (int j = 0; j < 8; j++)
        v[j] += __shfl_xor_sync(0xffffffffu, v[j], 1); // l ^ 8
#pragma unroll
    for (int j = 0; j < 4; j++)
        v[j] += v[j + 4]; // l ^ 4
#pragma unroll
    for (int j = 0; j < 2; j++)
        v[j] += v[j + 2]; // l ^ 2
    return v[0] + v[1];   // l ^ 1
}

template <int D>
__device__ __forceinline__ void chunk_di(const Params &p, const RowId (&rid)[2], int t4, float (&Dr)[2])
{
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            v[j] = 0.0f;
        if (rid[ri].ok) {
            long long w = (long long)rid[ri].grow * p.nq + rid[ri].h; // di_kernel's warp index
            const uint16_t *o = p.out + w * D + 8 * t4, *d = p.dout + w * D + 8 * t4;
#pragma unroll
            for (int i = 0; i < D / 32; i++)
                di_acc(v, *reinterpret_cast<const uint4 *>(o + 32 * i),
                       *reinterpret_cast<const uint4 *>(d + 32 * i));
        }
        Dr[ri] = di_quad_sum(v);
    }
}

// chunk_di in two halves, for an item whose dO is loaded into shared memory
// ahead: this thread's 16-byte vectors of O (vector i of row ri: columns 8
// t4 + 32 i; zeros for rows past the chunk) into registers ...
template <int D>
__device__ __forceinline__ void chunk_o_load(const Params &p, const RowId (&rid)[2], int t4,
                                             uint4 (&o)[2][D / 32])
{
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        const uint16_t *src = p.out + ((long long)rid[ri].grow * p.nq + rid[ri].h) * D + 8 * t4;
#pragma unroll
        for (int i = 0; i < D / 32; i++)
            o[ri][i] = rid[ri].ok ? *reinterpret_cast<const uint4 *>(src + 32 * i)
                                  : make_uint4(0u, 0u, 0u, 0u);
    }
}
// ... then Di from them and the chunk's dO at dos (generic address; rows
// r0, r0 + 8 of the 128-byte swizzle): chunk_di's products and sums, so
// chunk_di's bits (rows past the chunk: O zeros, so 0, as chunk_di)
template <int D>
__device__ __forceinline__ void chunk_di_smem(const uint4 (&o)[2][D / 32], const uint8_t *dos, int r0, int t4,
                                              float (&Dr)[2])
{
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        const int r = r0 + 8 * ri;
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            v[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < D / 32; i++) {
            const int c = t4 + 4 * i; // 16-byte chunk of the row: column block c / 8, chunk c % 8
            const uint4 ud = *reinterpret_cast<const uint4 *>(dos + (c >> 3) * (CHUNK_ROWS * 128) + r * 128 +
                                                              (((c & 7) ^ (r & 7)) << 4));
            di_acc(v, o[ri][i], ud);
        }
        Dr[ri] = di_quad_sum(v);
    }
}
// The 16-key block tile's P^T, dS^T (bf16 [key][row] tiles of 128-byte rows
// in the 128-byte swizzle: row r of key k in chunk r / 8 at chunk position
// (r / 8) ^ (k % 8), element r % 8) at ptp, ptp + pstep, from this thread's
// P (s: NJ x 4 accumulators) and dS fragments (sa), the 8-key groups below bs
template <int NJ>
__device__ __forceinline__ void store_pt_ds(uint8_t *ptp, int pstep, const float *s, const uint32_t (*sa)[4], int bs,
                                            int warp, int gid, int t4)
{
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        if (8 * j >= bs)
            break;
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            // elements 4 j + 2 ri + e: row 16 warp + gid + 8 ri, key 8 j + 2 t4 + e
            const int rc = 2 * warp + ri, k0 = 8 * j + 2 * t4;
            const uint32_t pv = pack_bf2(s[4 * j + 2 * ri], s[4 * j + 2 * ri + 1]);
            const uint32_t sv = sa[j >> 1][2 * (j & 1) + ri]; // same elements
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int k = k0 + e, off = k * 128 + ((rc ^ (k & 7)) << 4) + 2 * gid;
                *reinterpret_cast<uint16_t *>(ptp + off) = (uint16_t)(pv >> (16 * e));
                *reinterpret_cast<uint16_t *>(ptp + pstep + off) = (uint16_t)(sv >> (16 * e));
            }
        }
    }
}

// The block keys' dK / dV for kv head g, transposed, N = the 16 block keys:
// dV_b^T = dO^T P, dK_b^T = Q^T dS (M = head dims, one m64 per column block
// of the chunk; 4 x less tensor work than m64 over 64 keys, 48 of them not
// written). A (dO^T, Q^T: D x 64 rows, MN-major): column block h at h x 8
// KiB of the chunk's Q at qsm (dO one QS later), k step kk = rows 16 kk ..
// + 15 = 2048 bytes; B (P, dS: 64 rows x 16 keys, K-major = the [key][row]
// tiles at pt, pt + pstep (2048)): k step kk = 32 bytes into their 128-byte
// rows. (pstep and ldk = nkv D as arguments: so dq_wg_kernel compiles to the
// same code as with this inline.)
// Every warp stores: element 4 j + 2 r + e of column block h is head dim
// 64 h + 16 warp + gid + 8 r, key 8 j + 2 t4 + e; dK scaled in fp32 before
// the rounding. P^T / dS^T must be fenced (async proxy) and synced.
template <int D>
__device__ __forceinline__ void fold16(const Params &p, int b, int g, uint32_t qsm, uint32_t pt, uint32_t pstep,
                                       long long ldk, int warp, int gid, int t4)
{
    constexpr int NH = D / 64, QS = NH * CHUNK_ROWS * 128;
    constexpr uint32_t KM_LBO = 16, SBO = 1024;
    float dvt[NH][8], dkt[NH][8];
    const uint64_t bP = wg_desc(pt, KM_LBO, SBO), bS = bP + (pstep >> 4);
    const uint64_t tQ = wg_desc(qsm, CHUNK_ROWS * 128, SBO), tO = tQ + (QS >> 4);
    wg_fence();
#pragma unroll
    for (int h = 0; h < NH; h++) {
        const uint32_t ho = h * (CHUNK_ROWS * 128) >> 4;
        wg_ss16<false, 1>(dvt[h], tO + ho, bP);
#pragma unroll
        for (int kk = 1; kk < 4; kk++)
            wg_ss16<true, 1>(dvt[h], tO + ho + kk * (16 * 128 >> 4), bP + kk * (32 >> 4));
        wg_ss16<false, 1>(dkt[h], tQ + ho, bS);
#pragma unroll
        for (int kk = 1; kk < 4; kk++)
            wg_ss16<true, 1>(dkt[h], tQ + ho + kk * (16 * 128 >> 4), bS + kk * (32 >> 4));
    }
    wg_commit();
    wg_wait<0>();
#pragma unroll
    for (int h = 0; h < NH; h++) {
        reg_fence(dvt[h]);
        reg_fence(dkt[h]);
    }
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int key = 8 * j + 2 * t4 + e;
            if (key >= p.bs)
                continue;
            const long long off = ((long long)b * p.bs + key) * ldk + (long long)g * D + 16 * warp + gid;
#pragma unroll
            for (int h = 0; h < NH; h++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const float vk = dkt[h][4 * j + 2 * r + e] * p.scale;
                    const float vv = dvt[h][4 * j + 2 * r + e];
                    p.dkb[off + 64 * h + 8 * r] = __bfloat16_as_ushort(__float2bfloat16_rn(vk));
                    p.dvb[off + 64 * h + 8 * r] = __bfloat16_as_ushort(__float2bfloat16_rn(vv));
                }
        }
}

// WG3: the block tile's dS^T (16 keys of 128 bytes at generic address dst_s)
// into its slot of dsbo, keys past bs as 0 (thread tid of 128: 16 bytes)
__device__ __forceinline__ void dsb_store(const Params &p, int b, int g, int tid, const uint8_t *dst_s, uint16_t *dsbo)
{
    const int key = tid >> 3;
    const uint4 v = key < p.bs ? *reinterpret_cast<const uint4 *>(dst_s + 16 * tid) : make_uint4(0u, 0u, 0u, 0u);
    *reinterpret_cast<uint4 *>(reinterpret_cast<uint8_t *>(dsbo) + ((size_t)b * p.nkv + g) * DS_BLK_BYTES + 16 * tid) = v;
}
#endif // DF_WG_BODY

} // namespace
} // namespace df_dflash

#endif
