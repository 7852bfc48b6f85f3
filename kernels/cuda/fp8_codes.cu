/* fp8_codes.cu - the E4M3 codes and FP32 power-of-two scales that the FP8
 * GEMMs take (gemm_fp8.cu), written from BF16 operands with
 * the rounding rule of fp8.cu and the CPU reference (bitwise the same), and
 * their MXFP8 (E8M0) scales for compute capability 10+. fp8_cuda.h has the
 * modes and layouts. */
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>

#include "bf16.cuh"
#include "cuda_internal.h"
#include "e4m3.cuh"
#include "fp8_cuda.h"
#include "norm.cuh"

namespace {

int64_t rup(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

constexpr int QT = 256; /* threads of the rounding kernels */

/* Rounding kernels. They are bound by memory: each thread issues all its
 * loads (RU or more 16-byte pieces) before it uses any, and block indices
 * are 32-bit (the host keeps every grid's blocks below 2^31). */
constexpr int RU = 4; /* q8_row: blocks per 16-thread group */

/* 1 x 128 blocks along the rows of x [R, C] (bf16, ld ldx): out [n_out, kp]
 * codes, sc[kb * n_out + o]. Sixteen threads per block, eight values each
 * (one 16-byte load where x's rows are 16-byte aligned), the amax over the
 * sixteen by shuffles; a CTA takes RU x 16 consecutive blocks, a warp's
 * loads 512 contiguous bytes each. Rows from R up to n_out get zero codes
 * (cuBLASLt's row counts are multiples of 4); the reduction past C up to
 * kp too. */
__global__ void __launch_bounds__(QT) q8_row(const uint16_t *__restrict__ x, int64_t ldx,
                                             int64_t R, int64_t C, uint8_t *__restrict__ out,
                                             int64_t kp, float *__restrict__ sc, int64_t n_out,
                                             int vec)
{
    const unsigned kb = (unsigned)(kp / 128), nblk = (unsigned)(n_out * kb);
    const int sub = threadIdx.x & 15;
    uint4 raw[RU];
    unsigned o[RU], b[RU];
#pragma unroll
    for (int u = 0; u < RU; u++) {
        unsigned blk = (blockIdx.x * RU + u) * (QT / 16) + threadIdx.x / 16;
        bool live = blk < nblk;
        o[u] = live ? blk / kb : 0;
        b[u] = live ? blk - o[u] * kb : 0;
        int64_t k = (int64_t)b[u] * 128 + sub * 8;
        raw[u] = load8_raw(x + o[u] * ldx + k, vec, live && o[u] < R ? C - k : 0);
        o[u] = live ? o[u] : ~0u;
    }
#pragma unroll
    for (int u = 0; u < RU; u++) {
        uint32_t mb = amax16_bits(raw[u]);
        if (o[u] == ~0u)
            continue;
        float s = codes8_store(raw[u], mb, out + (int64_t)o[u] * kp + b[u] * 128 + sub * 8);
        if (sub == 0)
            sc[(int64_t)b[u] * n_out + o[u]] = s;
    }
}

/* 1 x 128 blocks along the columns of x [R, C]: out [C, kp] = x^T codes
 * (reduction R), sc[kb * C + o]. NORM: of y = rmsnorm(x) instead, each row's
 * 1 / rms in inv[R] and the weight w [C] (16-byte aligned), y's BF16 values
 * made as the norm kernels make them (norm.cuh) before anything else reads
 * them; rows past R stay zero. A CTA: 128 reduction steps x 64 out rows.
 * Each thread loads two pairs of reduction steps x 8 columns (4 x 16 bytes,
 * all issued first) and stores each column's pair as one word of the
 * transposed tile (a row of 64 words + 3: two-way bank conflicts at most);
 * then a warp finishes 8 out rows: 4 values per lane (two words: the rows
 * of 67 words are not 8-byte aligned),
 * the amax, the scale, 4 codes per lane in one store. */
constexpr int CT_W = 67; /* words per row of q8_col's tile */
template <bool NORM>
__global__ void __launch_bounds__(QT) q8_col(const uint16_t *__restrict__ x, int64_t ldx,
                                             int64_t R, int64_t C, uint8_t *__restrict__ out,
                                             int64_t kp, float *__restrict__ sc, int vec,
                                             const float *__restrict__ inv,
                                             const uint16_t *__restrict__ w)
{
    __shared__ __align__(16) uint32_t t[64 * CT_W + 1];
    const int64_t o0 = (int64_t)blockIdx.y * 64, k0 = (int64_t)blockIdx.x * 128;
    uint4 r[2][2];
#pragma unroll
    for (int it = 0; it < 2; it++) {
        int c = threadIdx.x + it * QT, pr = c / 8, oc = (c % 8) * 8;
        int64_t k = k0 + 2 * pr, o = o0 + oc;
#pragma unroll
        for (int h = 0; h < 2; h++)
            r[it][h] = load8_raw(x + (k + h) * ldx + o, vec, k + h < R ? C - o : 0);
    }
    if (NORM) {
#pragma unroll
        for (int it = 0; it < 2; it++) {
            int c = threadIdx.x + it * QT, pr = c / 8, oc = (c % 8) * 8;
            int64_t k = k0 + 2 * pr, o = o0 + oc;
            float wf[8];
            unpack8(load8_raw(w + o, vec, C - o), wf);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (k + h >= R)
                    continue;
                float f[8];
                const float iv = inv[k + h];
                unpack8(r[it][h], f);
#pragma unroll
                for (int e = 0; e < 8; e++)
                    f[e] = rms_out(f[e], iv, wf[e]);
                r[it][h] = make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]),
                                      pack2(f[6], f[7]));
            }
        }
    }
#pragma unroll
    for (int it = 0; it < 2; it++) {
        int c = threadIdx.x + it * QT, pr = c / 8, oc = (c % 8) * 8;
        uint32_t a[4] = {r[it][0].x, r[it][0].y, r[it][0].z, r[it][0].w};
        uint32_t bb[4] = {r[it][1].x, r[it][1].y, r[it][1].z, r[it][1].w};
#pragma unroll
        for (int j = 0; j < 4; j++) { /* columns 2j, 2j + 1: (step 2 pr, step 2 pr + 1) pairs */
            t[(oc + 2 * j) * CT_W + pr] = (a[j] & 0xffffu) | (bb[j] << 16);
            t[(oc + 2 * j + 1) * CT_W + pr] = (a[j] >> 16) | (bb[j] & 0xffff0000u);
        }
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int j = 0; j < 8; j++) {
        int oo = warp * 8 + j;
        int64_t o = o0 + oo;
        uint32_t w0 = t[oo * CT_W + 2 * lane], w1 = t[oo * CT_W + 2 * lane + 1];
        uint32_t mb = __vmaxu2(w0 & 0x7fff7fffu, w1 & 0x7fff7fffu);
        mb = max(mb & 0xffffu, mb >> 16);
#pragma unroll
        for (int d = 16; d > 0; d >>= 1)
            mb = max(mb, __shfl_xor_sync(0xffffffffu, mb, d));
        if (o >= C)
            continue;
        float m = bits_f(mb);
        float v[4] = {__uint_as_float(w0 << 16), __uint_as_float(w0 & 0xffff0000u),
                      __uint_as_float(w1 << 16), __uint_as_float(w1 & 0xffff0000u)};
        int e = scale_exp(m);
        *reinterpret_cast<uint32_t *>(out + o * kp + k0 + lane * 4) =
            codes4(v, ldexpf(1.0f, -e), isfinite(m));
        if (lane == 0)
            sc[(k0 / 128) * C + o] = ldexpf(1.0f, e);
    }
}

/* 128 x 128 blocks of w [N, K] (bf16, ld ldw): tr 0: out [N, kp] = w
 * (reduction K), tr 1: out [K, kp] = w^T (reduction N). A CTA per block;
 * each thread loads 8 of its 16-byte pieces (all issued first), the block's
 * amax; tr 0 writes the codes of its own pieces from registers; tr 1 goes
 * through the shared tile and writes 16 codes of one out row per store,
 * reading a column of the tile with consecutive threads on consecutive
 * columns (no bank conflicts). */
/* ROWS (tr 1): also the 1 x 128 row blocks' codes of the same w, as mode 0 writes them with
 * n_out = N (rout [N, rkp], rsc[kb * N + n]): a dy that feeds both backward GEMMs, read once
 * (df_op_fp8_dy_codes). They come from the shared tile after the barrier (the pieces held in
 * registers until then cost 99 registers, half the CTAs); a row's sixteen pieces are
 * consecutive lanes. */
template <bool tr, bool ROWS>
__global__ void __launch_bounds__(QT) q8_blk(const uint16_t *__restrict__ w, int64_t ldw,
                                             int64_t N, int64_t K, uint8_t *__restrict__ out,
                                             int64_t kp, float *__restrict__ sc, int64_t l4, int vec,
                                             uint8_t *__restrict__ rout, int64_t rkp,
                                             float *__restrict__ rsc)
{
    static_assert(!ROWS || tr, "row codes with the transpose's");
    __shared__ __align__(16) uint16_t t[128][136];
    __shared__ float wm[QT / 32];
    const int64_t n0 = (int64_t)blockIdx.y * 128, c0 = (int64_t)blockIdx.x * 128;
    constexpr int P = 128 * 16 / QT; /* pieces per thread */
    uint4 u[P];
#pragma unroll
    for (int j = 0; j < P; j++) {
        int i = threadIdx.x + j * QT, nn = i / 16, kc = (i % 16) * 8;
        int64_t n = n0 + nn, k = c0 + kc;
        u[j] = load8_raw(w + n * ldw + k, vec, n < N ? K - k : 0);
    }
    uint32_t mb = 0;
#pragma unroll
    for (int j = 0; j < P; j++) {
        mb = max(mb, amax8_bits(u[j]));
        if (tr) { /* (u[j] is dead after this: the registers go back) */
            int i = threadIdx.x + j * QT;
            *reinterpret_cast<uint4 *>(&t[i / 16][(i % 16) * 8]) = u[j];
        }
    }
    const float m = block_amax<QT>(bits_f(mb), wm); /* (its barrier also orders the tile's writes) */
    if (ROWS) /* the row codes from the tile, the pieces this thread loaded */
#pragma unroll 2
        for (int j = 0; j < P; j++) {
            int i = threadIdx.x + j * QT;
            int64_t n = n0 + i / 16;
            const uint4 v = *reinterpret_cast<const uint4 *>(&t[i / 16][(i % 16) * 8]);
            const uint32_t rb = amax16_bits(v);
            if (n < N) {
                float s = codes8_store(v, rb, rout + n * rkp + c0 + (i % 16) * 8);
                if ((threadIdx.x & 15) == 0)
                    rsc[(c0 / 128) * N + n] = s;
            }
        }
    const int ke = scale_exp(m);
    const float inv = ldexpf(1.0f, -ke);
    const bool fin = isfinite(m);
    if (!tr) {
#pragma unroll
        for (int j = 0; j < P; j++) { /* codes of the pieces this thread loaded */
            int i = threadIdx.x + j * QT, oo = i / 16, rr = (i % 16) * 8;
            int64_t o = n0 + oo;
            if (o >= N)
                continue;
            float v[8];
            unpack8(u[j], v);
            *reinterpret_cast<uint2 *>(out + o * kp + c0 + rr) = codes8(v, inv, fin); /* padding: 0 */
        }
    } else {
        for (int i = threadIdx.x; i < 128 * 8; i += QT) {
            int oo = i % 128, rr = (i / 128) * 16;
            int64_t o = c0 + oo;
            if (o >= K)
                continue;
            float v[8], x[8];
#pragma unroll
            for (int j = 0; j < 8; j++)
                v[j] = bf2f(t[rr + j][oo]), x[j] = bf2f(t[rr + 8 + j][oo]);
            uint2 a = codes8(v, inv, fin), b = codes8(x, inv, fin);
            *reinterpret_cast<uint4 *>(out + o * kp + n0 + rr) = make_uint4(a.x, a.y, b.x, b.y);
        }
    }
    if (threadIdx.x == 0) {
        int64_t ob = tr ? blockIdx.x : blockIdx.y, rb = tr ? blockIdx.y : blockIdx.x;
        sc[ob * l4 + rb] = ldexpf(1.0f, ke);
    }
}

/* The E8M0 bytes of an operand's power-of-two FP32 scales in fp8_mx.h's
 * MXFP8 layout (df_cuda_fp8_mx_scales says which scales): a thread per
 * (row, 128-block), rows fastest (the 1 x 128 scales' reads contiguous); the
 * four 32-blocks of a 128-block are adjacent there: one word. Rows from n_sc
 * on (up to the 128 the layout rounds to) get 1.0 (byte 127). */
__global__ void __launch_bounds__(QT) mx_scales(const float *__restrict__ sc, int blk, int64_t n_sc,
                                                int64_t l4, int64_t rows_pad, int64_t kb,
                                                uint8_t *__restrict__ out)
{
    int64_t i = (int64_t)blockIdx.x * QT + threadIdx.x;
    if (i >= rows_pad * kb)
        return;
    int64_t b = i / rows_pad, r = i - b * rows_pad;
    float v = blk ? sc[(r / 128) * l4 + b] : r < n_sc ? sc[b * n_sc + r] : 1.0f;
    uint32_t e = (__float_as_uint(v) >> 23) & 0xffu; /* 2^(e - 127): the scale, exactly */
    *reinterpret_cast<uint32_t *>(out + df_fp8_mx_offset(r, 4 * b, 4 * kb)) = e * 0x01010101u;
}

} // namespace

extern "C" int df_cuda_fp8_mx_run(cudaStream_t st, const float *sc, int blk, int64_t n_sc, int64_t rows, int64_t kp,
                  uint8_t *out)
{
    int64_t kb = kp / 128, rows_pad = rup(rows, 128), total = rows_pad * kb;
    if (total == 0)
        return 0;
    mx_scales<<<(unsigned)((total + QT - 1) / QT), QT, 0, st>>>(sc, blk, n_sc, rup(kb, 4), rows_pad, kb, out);
    return df_cuda_check_launch("fp8 mxfp8 scales");
}

extern "C" int df_cuda_fp8_codes_run(cudaStream_t st, int mode, const uint16_t *x, int64_t ld, int64_t R,
                                     int64_t C, uint8_t *codes, int64_t kp, float *sc, int64_t n_out, int vec)
{
    if (mode == 0) {
        int64_t per = RU * (QT / 16); /* blocks per CTA */
        q8_row<<<(unsigned)((n_out * (kp / 128) + per - 1) / per), QT, 0, st>>>(x, ld, R, C, codes, kp, sc,
                                                                                n_out, vec);
    } else if (mode == 1) {
        q8_col<false><<<dim3((unsigned)(kp / 128), (unsigned)((C + 63) / 64)), QT, 0, st>>>(
            x, ld, R, C, codes, kp, sc, vec, nullptr, nullptr);
    } else {
        dim3 g((unsigned)((C + 127) / 128), (unsigned)((R + 127) / 128));
        if (mode == 3)
            q8_blk<true, false><<<g, QT, 0, st>>>(x, ld, R, C, codes, kp, sc, rup(kp / 128, 4), vec,
                                                  nullptr, 0, nullptr);
        else
            q8_blk<false, false><<<g, QT, 0, st>>>(x, ld, R, C, codes, kp, sc, rup(kp / 128, 4), vec,
                                                   nullptr, 0, nullptr);
    }
    return df_cuda_check_launch("fp8 rounding codes");
}

extern "C" int df_cuda_fp8_codes_dy_run(cudaStream_t st, const uint16_t *x, int64_t ld, int64_t R,
                                        int64_t C, uint8_t *xcodes, int64_t kpx, float *xsc,
                                        uint8_t *wcodes, int64_t kpw, float *wsc, int vec)
{
    dim3 g((unsigned)((C + 127) / 128), (unsigned)((R + 127) / 128));
    q8_blk<true, true><<<g, QT, 0, st>>>(x, ld, R, C, wcodes, kpw, wsc, rup(kpw / 128, 4), vec, xcodes,
                                         kpx, xsc);
    return df_cuda_check_launch("fp8 dy codes");
}

extern "C" int df_cuda_fp8_codes_norm_run(cudaStream_t st, const uint16_t *x, int64_t ld, int64_t R,
                                          int64_t C, const float *inv, const uint16_t *w,
                                          uint8_t *codes, int64_t kp, float *sc, int vec)
{
    q8_col<true><<<dim3((unsigned)(kp / 128), (unsigned)((C + 63) / 64)), QT, 0, st>>>(
        x, ld, R, C, codes, kp, sc, vec && ((uintptr_t)w & 15) == 0, inv, w);
    return df_cuda_check_launch("fp8 rmsnorm column codes");
}

extern "C" int df_cuda_fp8_round_codes(df_backend *be, int mode, const df_tensor *x, uint8_t *codes,
                                       int64_t kp, float *sc, int64_t n_out)
{
    const int64_t R = x->shape[0], C = x->shape[1], ld = x->stride[0];
    const uint16_t *X = (const uint16_t *)x->data;
    if (x->dtype != DF_DTYPE_BF16 || R < 1 || C < 1 || kp % 128 || mode < 0 || mode > 3)
        return -EINVAL;
    int vec = ld % 8 == 0 && ((uintptr_t)X & 15) == 0;
    cudaStream_t st = df_cuda_stream(be);
    int64_t red = mode == 1 || mode == 3 ? R : C, rows = mode == 1 || mode == 3 ? C : R;
    if (df_cuda_fp8_wcodes_fresh_t(be, x))
        return -EIO;
    if (kp < red || (mode == 0 && n_out < R) || (mode != 0 && n_out != rows) ||
        rows > 65535 * 64 || kp > (int64_t)65535 * 128 || n_out * (kp / 128) >= ((int64_t)1 << 31))
        return -EINVAL;
    return df_cuda_fp8_codes_run(st, mode, X, ld, R, C, codes, kp, sc, n_out, vec);
}

extern "C" int df_cuda_fp8_mx_scales(df_backend *be, const float *sc, int blk, int64_t n_sc,
                                     int64_t rows, int64_t kp, uint8_t *out)
{
    if (!sc || !out || rows < 1 || kp < 128 || kp % 128 || (!blk && n_sc < 1) || (blk && n_sc != rows) ||
        rup(rows, 128) / QT * (kp / 128) >= ((int64_t)1 << 31))
        return -EINVAL;
    return df_cuda_fp8_mx_run(df_cuda_stream(be), sc, blk, n_sc, rows, kp, out);
}
