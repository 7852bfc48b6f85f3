/* swiglu_fp8.cu - df_op_swiglu_fp8 and df_op_swiglu_bwd_fp8 on CUDA: SwiGLU's forward
 * and backward that also write the E4M3 codes of the GEMM operands they compute, where they
 * compute them, for the calls that then pass DF_FP8_MADE (gemm_fp8.cu's "made" slots: 0-3
 * the backward's, 4-5 the forward's).
 *
 * Unfused, such an operand is written in BF16 and read back by each GEMM's rounding:
 *  - backward: dgate and dup, the dy of the gate and up projections' DF_GEMM_BWD_X (1 x 128
 *    blocks along the columns) and DF_GEMM_BWD_W (128 x 128 blocks of the transpose);
 *  - forward: its output, the down projection's x in DF_GEMM_FWD (1 x 128 blocks along the
 *    columns) and, recomputed in the backward, in DF_GEMM_BWD_W (128 x 1 blocks, written
 *    as the transpose's rows).
 * Here a CTA computes a 128 x 128 tile, writes its BF16 values as df_cuda_swiglu /
 * df_cuda_swiglu_bwd do (the same formulas: swiglu.cuh) and, from those BF16 values, the
 * codes and scales with the rounding of fp8_codes.cu's kernels (e4m3.cuh): the same bytes
 * those write, so the GEMMs' products are the same bits. Rows past the tensor's (up to the
 * reduction padded to 128) are zero codes. Under DF_FP8_ONLY_CODES, once every region's call
 * has taken codes of this geometry (df_cuda_fp8_made_proven), the BF16 values are left out.
 *
 * Where the codes would not be used (no E4M3 tensor cores, MXFP8, not 2-D, 128 x 1 blocks
 * for the backward's BWD_W, DFLASH_FP8_SWIGLU=0, no memory for the regions) they are
 * df_cuda_swiglu / df_cuda_swiglu_bwd. */
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.cuh"
#include "cuda_internal.h"
#include "device.h"
#include "e4m3.cuh"
#include "fp8_cuda.h"
#include "knobs.h"
#include "swiglu.cuh"
#include "train_cuda.h"

namespace {

/* A CTA of ST threads computes a 128 x 128 tile in NCH chunks of CR rows (16 threads a row,
 * 8 columns each), the next chunk's loads issued before this one's math; two CTAs per SM, so
 * one's loads overlap the other's math and barriers. */
constexpr int ST = 512;
constexpr int CR = ST / 16;
constexpr int NCH = 128 / CR;
constexpr int TW = 136; /* the shared tile's row, in bf16 (16-byte aligned rows) */

struct SwqOut { /* one gradient's codes: BWD_X's rows, BWD_W's transpose */
    uint8_t *xc, *wc;
    float *xs, *ws;
};

struct SwqArgs {
    const uint16_t *g, *u, *d;
    uint16_t *dg, *du;
    int64_t ldg, ldu, ldd, lddg, lddu; /* row strides */
    int64_t R, C;                     /* dy's shape */
    int64_t kpx, kpw, l4;             /* BWD_X's padded reduction (C), BWD_W's (R), its scales' row */
    SwqOut o[2];                      /* dgate, dup */
    int vec;                          /* every row 16-byte aligned */
};

/* 8 bf16 of row r, columns c.. of an R x C tensor (r past R: zeros); the raw words */
template <typename A>
__device__ __forceinline__ uint4 ld_piece(const uint16_t *p, int64_t ld, int64_t r, int64_t c,
                                          const A &a)
{
    return load8_raw(p + r * ld + c, a.vec, r < a.R ? a.C - c : 0);
}

/* 8 bf16 (raw words) to row r, columns c.. (within R x C) */
template <typename A>
__device__ __forceinline__ void st_piece(uint16_t *p, int64_t ld, int64_t r, int64_t c, uint4 v,
                                         const A &a)
{
    if (r >= a.R)
        return;
    if (a.vec && c + 8 <= a.C) {
        *reinterpret_cast<uint4 *>(p + r * ld + c) = v;
        return;
    }
    uint32_t w[4] = {v.x, v.y, v.z, v.w};
    for (int j = 0; j < 8 && c + j < a.C; j++)
        p[r * ld + c + j] = (uint16_t)(w[j / 2] >> (16 * (j & 1)));
}

/* Row lr of the tile's BF16 values (this thread's 8 of them, v) into the shared tile t and as
 * 1 x 128 block codes of row r (16 threads a row), at codes + r * kp + c, scale sc[c0 / 128 *
 * R + r]; the whole warp calls it. */
__device__ __forceinline__ void row_codes(uint4 v, uint8_t *codes, float *sc, int64_t kp, int64_t R,
                                          int64_t r, int64_t c, int64_t c0)
{
    uint32_t mb = amax16_bits(v);
    if (r >= R)
        return;
    float s = codes8_store(v, mb, codes + r * kp + c);
    if ((threadIdx.x & 15) == 0)
        sc[(c0 / 128) * R + r] = s;
}

/* Rows rr .. rr + 31 of the tile's column oo (t) as 32 codes at inverse scale inv, to out */
__device__ __forceinline__ void col_codes32(const uint16_t (*t)[TW], int rr, int oo, float inv,
                                            bool fin, uint8_t *out)
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float x0[8], x1[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            x0[j] = bf2f(t[rr + 16 * h + j][oo]), x1[j] = bf2f(t[rr + 16 * h + 8 + j][oo]);
        uint2 p = codes8(x0, inv, fin), q = codes8(x1, inv, fin);
        *reinterpret_cast<uint4 *>(out + 16 * h) = make_uint4(p.x, p.y, q.x, q.y);
    }
}

constexpr size_t BWD_SMEM = 2 * 128 * TW * sizeof(uint16_t); /* dgate's and dup's tiles */

/* A CTA per 128 x 128 tile of dy (blockIdx.x: columns, .y: rows). Chunk by chunk, each thread
 * computes 8 elements of dgate and dup, writes them (in place is fine: the same thread read
 * those elements first), their BWD_X codes, and keeps them in the shared tiles; then the
 * tiles' amaxes, and each gradient's BWD_W codes from its tile's columns. */
template <bool VALS>
__global__ void __launch_bounds__(ST, 2) swiglu_bwd_q8_kernel(SwqArgs a)
{
    extern __shared__ __align__(16) uint16_t sm[];
    uint16_t(*tg)[TW] = reinterpret_cast<uint16_t(*)[TW]>(sm);
    uint16_t(*tu)[TW] = reinterpret_cast<uint16_t(*)[TW]>(sm + 128 * TW);
    __shared__ uint32_t wm[2][ST / 32];
    const int64_t r0 = (int64_t)blockIdx.y * 128, c0 = (int64_t)blockIdx.x * 128;
    const int lr0 = threadIdx.x / 16, sub = threadIdx.x & 15;
    const int64_t c = c0 + sub * 8;
    uint4 gv = ld_piece(a.g, a.ldg, r0 + lr0, c, a), uv = ld_piece(a.u, a.ldu, r0 + lr0, c, a),
          dv = ld_piece(a.d, a.ldd, r0 + lr0, c, a);
    uint32_t mg = 0, mu = 0;
#pragma unroll
    for (int k = 0; k < NCH; k++) {
        const int lr = k * CR + lr0;
        const int64_t r = r0 + lr;
        uint4 gn = gv, un = uv, dn = dv;
        if (k + 1 < NCH) {
            gn = ld_piece(a.g, a.ldg, r + CR, c, a);
            un = ld_piece(a.u, a.ldu, r + CR, c, a);
            dn = ld_piece(a.d, a.ldd, r + CR, c, a);
        }
        float g[8], u[8], d[8];
        unpack8(gv, g);
        unpack8(uv, u);
        unpack8(dv, d);
#pragma unroll
        for (int j = 0; j < 8; j++)
            swiglu_bwd_f(g[j], u[j], d[j], &g[j], &u[j]);
        /* outside R x C the inputs are zeros and so are these: the padding's codes */
        gv = make_uint4(pack2(g[0], g[1]), pack2(g[2], g[3]), pack2(g[4], g[5]), pack2(g[6], g[7]));
        uv = make_uint4(pack2(u[0], u[1]), pack2(u[2], u[3]), pack2(u[4], u[5]), pack2(u[6], u[7]));
        if (VALS) {
            st_piece(a.dg, a.lddg, r, c, gv, a);
            st_piece(a.du, a.lddu, r, c, uv, a);
        }
        *reinterpret_cast<uint4 *>(&tg[lr][sub * 8]) = gv;
        *reinterpret_cast<uint4 *>(&tu[lr][sub * 8]) = uv;
        mg = max(mg, amax8_bits(gv));
        mu = max(mu, amax8_bits(uv));
        row_codes(gv, a.o[0].xc, a.o[0].xs, a.kpx, a.R, r, c, c0);
        row_codes(uv, a.o[1].xc, a.o[1].xs, a.kpx, a.R, r, c, c0);
        gv = gn, uv = un, dv = dn;
    }
    /* both tiles' amaxes through one barrier (which also orders the tiles' writes) */
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        mg = max(mg, __shfl_xor_sync(0xffffffffu, mg, o));
        mu = max(mu, __shfl_xor_sync(0xffffffffu, mu, o));
    }
    if ((threadIdx.x & 31) == 0)
        wm[0][threadIdx.x / 32] = mg, wm[1][threadIdx.x / 32] = mu;
    __syncthreads();
    mg = 0, mu = 0;
#pragma unroll
    for (int j = 0; j < ST / 32; j++)
        mg = max(mg, wm[0][j]), mu = max(mu, wm[1][j]);
    /* dy^T's row c0 + oo: the tile's column oo, rows rr .. rr + 31 */
    const int oo = threadIdx.x % 128, rr = (threadIdx.x / 128) * 32;
    const int64_t oc = c0 + oo;
#pragma unroll
    for (int q = 0; q < 2; q++) {
        const float m = bits_f(q ? mu : mg);
        const int ke = scale_exp(m);
        const SwqOut &o = a.o[q];
        if (oc < a.C)
            col_codes32(q ? tu : tg, rr, oo, ldexpf(1.0f, -ke), isfinite(m), o.wc + oc * a.kpw + r0 + rr);
        if (threadIdx.x == 0)
            o.ws[(c0 / 128) * a.l4 + r0 / 128] = ldexpf(1.0f, ke);
    }
}

/* The forward: y = silu(gate) * up, and y's codes as the down projection's x: in 1 x 128 row
 * blocks for DF_GEMM_FWD (ROWS) and / or in 128 x 1 blocks of y^T for DF_GEMM_BWD_W (COLS: a
 * column's amax over the tile's 128 rows, through the shared tile). */
struct SwfArgs {
    const uint16_t *g, *u;
    uint16_t *y;
    int64_t ldg, ldu, ldy, R, C;
    int64_t kpx, kpw;  /* FWD's padded reduction (C), BWD_W's (R) */
    uint8_t *xc, *wc;  /* FWD's codes [R, kpx], BWD_W's [C, kpw] */
    float *xs, *ws;    /* sc[kb * R + r], sc[kb * C + c] */
    int vec;
};

template <bool ROWS, bool COLS, bool VALS>
__global__ void __launch_bounds__(ST, 2) swiglu_q8_kernel(SwfArgs a)
{
    __shared__ __align__(16) uint16_t t[COLS ? 128 : 1][TW];
    __shared__ uint32_t red[4][128];
    const int64_t r0 = (int64_t)blockIdx.y * 128, c0 = (int64_t)blockIdx.x * 128;
    const int lr0 = threadIdx.x / 16, sub = threadIdx.x & 15;
    const int64_t c = c0 + sub * 8;
    uint4 gv = ld_piece(a.g, a.ldg, r0 + lr0, c, a), uv = ld_piece(a.u, a.ldu, r0 + lr0, c, a);
#pragma unroll
    for (int k = 0; k < NCH; k++) {
        const int lr = k * CR + lr0;
        const int64_t r = r0 + lr;
        uint4 gn = gv, un = uv;
        if (k + 1 < NCH) {
            gn = ld_piece(a.g, a.ldg, r + CR, c, a);
            un = ld_piece(a.u, a.ldu, r + CR, c, a);
        }
        float g[8], u[8];
        unpack8(gv, g);
        unpack8(uv, u);
        uint4 y = make_uint4(pack2(silu_f(g[0]) * u[0], silu_f(g[1]) * u[1]),
                             pack2(silu_f(g[2]) * u[2], silu_f(g[3]) * u[3]),
                             pack2(silu_f(g[4]) * u[4], silu_f(g[5]) * u[5]),
                             pack2(silu_f(g[6]) * u[6], silu_f(g[7]) * u[7]));
        if (VALS)
            st_piece(a.y, a.ldy, r, c, y, a);
        if (COLS)
            *reinterpret_cast<uint4 *>(&t[lr][sub * 8]) = y;
        if (ROWS)
            row_codes(y, a.xc, a.xs, a.kpx, a.R, r, c, c0);
        gv = gn, uv = un;
    }
    if (!COLS)
        return;
    __syncthreads();
    /* y^T's row c0 + oo: rows rr .. rr + 31 of the tile's column oo, then the column's amax */
    const int oo = threadIdx.x % 128, rr = (threadIdx.x / 128) * 32;
    uint32_t mb = 0;
#pragma unroll
    for (int j = 0; j < 32; j++)
        mb = max(mb, (uint32_t)(t[rr + j][oo] & 0x7fff));
    red[rr / 32][oo] = mb;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 4; k++)
        mb = max(mb, red[k][oo]);
    const int64_t oc = c0 + oo;
    if (oc >= a.C)
        return;
    const float m = bits_f(mb);
    const int e = scale_exp(m);
    col_codes32(t, rr, oo, ldexpf(1.0f, -e), isfinite(m), a.wc + oc * a.kpw + r0 + rr);
    if (rr == 0)
        a.ws[(r0 / 128) * a.C + oc] = ldexpf(1.0f, e);
}

} // namespace

extern "C" int df_cuda_swiglu_fp8(df_backend *be, const df_tensor *gate, const df_tensor *up,
                                  df_tensor *out, unsigned flags)
{
    const df_tensor *t[3] = {gate, up, out};
    const int want_rows = (flags & DF_FP8_X_FWD) != 0, want_cols = (flags & DF_FP8_X_BWD_W) != 0;
    int rows = want_rows, cols = want_cols;
    int ok = df_knob_int(DF_KNOB_FP8_SWIGLU) && (rows || cols) && out->ndim == 2 &&
             df_tensor_numel(out) > 0;
    for (int i = 0; i < 3 && ok; i++)
        ok = t[i]->dtype == DF_DTYPE_BF16 && t[i]->stride[1] == 1;
    const int64_t R = ok ? out->shape[0] : 0, C = ok ? out->shape[1] : 0;
    ok = ok && (R + 127) / 128 <= 65535;
    /* slots 4 (FWD's x), 5 (BWD_W's x) */
    df_cuda_fp8_rows xr, wr;
    memset(&xr, 0, sizeof xr), memset(&wr, 0, sizeof wr);
    if (ok && rows)
        rows = df_cuda_fp8_made_claim(be, 4, DF_GEMM_FWD, 0, out, 0, &xr);
    if (ok && cols)
        cols = df_cuda_fp8_made_claim(be, 5, DF_GEMM_BWD_W, 1, out, 0, &wr);
    if (!ok || (!rows && !cols)) {
        df_cuda_fp8_made_ready(be, 4, 0);
        df_cuda_fp8_made_ready(be, 5, 0);
        return df_cuda_swiglu(be, gate, up, out);
    }
    /* out's values only where every call that reads it takes codes from here */
    const bool vals = !((flags & DF_FP8_ONLY_CODES) && df_knob_int(DF_KNOB_FP8_ONLY_CODES) &&
                        rows == want_rows && cols == want_cols &&
                        (!rows || df_cuda_fp8_made_proven(be, 4)) &&
                        (!cols || df_cuda_fp8_made_proven(be, 5)));
    SwfArgs a;
    a.g = (const uint16_t *)gate->data, a.u = (const uint16_t *)up->data, a.y = (uint16_t *)out->data;
    a.ldg = gate->stride[0], a.ldu = up->stride[0], a.ldy = out->stride[0];
    a.R = R, a.C = C;
    a.kpx = xr.kp, a.kpw = wr.kp, a.xc = xr.codes, a.wc = wr.codes, a.xs = xr.scales, a.ws = wr.scales;
    a.vec = 1;
    for (int i = 0; i < 3; i++)
        a.vec &= t[i]->stride[0] % 8 == 0 && ((uintptr_t)t[i]->data & 15) == 0;
    dim3 grid((unsigned)((C + 127) / 128), (unsigned)((R + 127) / 128));
    cudaStream_t st = df_cuda_stream(be);
    void (*const k[2][3])(SwfArgs) = {
        {swiglu_q8_kernel<true, true, false>, swiglu_q8_kernel<true, false, false>,
         swiglu_q8_kernel<false, true, false>},
        {swiglu_q8_kernel<true, true, true>, swiglu_q8_kernel<true, false, true>,
         swiglu_q8_kernel<false, true, true>}};
    k[vals][rows && cols ? 0 : rows ? 1 : 2]<<<grid, ST, 0, st>>>(a);
    int rc = df_cuda_check_launch("swiglu fp8 kernel");
    const int made = rc ? 0 : vals ? 1 : 2;
    df_cuda_fp8_made_ready(be, 4, rows ? made : 0);
    df_cuda_fp8_made_ready(be, 5, cols ? made : 0);
    return rc;
}

extern "C" int df_cuda_swiglu_bwd_fp8(df_backend *be, const df_tensor *gate, const df_tensor *up,
                                      const df_tensor *dout, df_tensor *dgate, df_tensor *dup,
                                      unsigned flags)
{
    const df_tensor *t[5] = {gate, up, dout, dgate, dup};
    int ok = df_knob_int(DF_KNOB_FP8_SWIGLU) && (flags & DF_FP8_DY_BLOCKS) && dgate->ndim == 2 &&
             dgate->dtype == DF_DTYPE_BF16 && df_tensor_numel(dgate) > 0;
    for (int i = 0; i < 5 && ok; i++)
        ok = t[i]->dtype == DF_DTYPE_BF16 && t[i]->stride[1] == 1;
    const int64_t R = ok ? dgate->shape[0] : 0, C = ok ? dgate->shape[1] : 0;
    /* the grid: columns in x, rows in y (below 2^16) */
    ok = ok && (R + 127) / 128 <= 65535 && (C + 127) / 128 <= ((int64_t)1 << 31) - 1;
    df_cuda_fp8_rows xr[2], wr[2];
    for (int k = 0; k < 2 && ok; k++) { /* slots 0-3: dgate BWD_X, BWD_W, then dup's */
        df_tensor *y = k ? dup : dgate;
        ok = df_cuda_fp8_made_claim(be, 2 * k, DF_GEMM_BWD_X, 0, y, 1, &xr[k]) &&
             df_cuda_fp8_made_claim(be, 2 * k + 1, DF_GEMM_BWD_W, 0, y, 1, &wr[k]);
    }
    /* the values only where all four calls are proven to take the codes */
    bool vals = !((flags & DF_FP8_ONLY_CODES) && df_knob_int(DF_KNOB_FP8_ONLY_CODES));
    for (int s = 0; s < 4 && ok && !vals; s++)
        vals = !df_cuda_fp8_made_proven(be, s);
    void (*const kern)(SwqArgs) = vals ? swiglu_bwd_q8_kernel<true> : swiglu_bwd_q8_kernel<false>;
    /* its tiles' shared memory (above the 48 KiB a launch gets unasked) */
    ok = ok && df_cuda_func_smem((const void *)kern, BWD_SMEM) == 0;
    if (!ok) {
        for (int s = 0; s < 4; s++)
            df_cuda_fp8_made_ready(be, s, 0);
        return df_cuda_swiglu_bwd(be, gate, up, dout, dgate, dup);
    }
    SwqArgs a;
    a.g = (const uint16_t *)gate->data, a.u = (const uint16_t *)up->data;
    a.d = (const uint16_t *)dout->data;
    a.dg = (uint16_t *)dgate->data, a.du = (uint16_t *)dup->data;
    a.ldg = gate->stride[0], a.ldu = up->stride[0], a.ldd = dout->stride[0];
    a.lddg = dgate->stride[0], a.lddu = dup->stride[0];
    a.R = R, a.C = C;
    a.kpx = xr[0].kp, a.kpw = wr[0].kp, a.l4 = (wr[0].kp / 128 + 3) / 4 * 4;
    a.vec = 1;
    for (int i = 0; i < 5; i++)
        a.vec &= t[i]->stride[0] % 8 == 0 && ((uintptr_t)t[i]->data & 15) == 0;
    cudaStream_t st = df_cuda_stream(be);
    int rc = 0;
    for (int k = 0; k < 2 && !rc; k++) {
        a.o[k].xc = xr[k].codes, a.o[k].xs = xr[k].scales;
        a.o[k].wc = wr[k].codes, a.o[k].ws = wr[k].scales;
        /* BWD_W's scales: zero where no tile writes (the rows of L4's padding) */
        if (cudaMemsetAsync(wr[k].scales, 0,
                            (size_t)((C + 127) / 128 * a.l4) * sizeof(float), st) != cudaSuccess)
            rc = df_cuda_check_launch("swiglu_bwd fp8 scales");
    }
    if (!rc) {
        kern<<<dim3((unsigned)((C + 127) / 128), (unsigned)((R + 127) / 128)), ST, BWD_SMEM, st>>>(a);
        rc = df_cuda_check_launch("swiglu_bwd fp8 kernel");
    }
    for (int s = 0; s < 4; s++)
        df_cuda_fp8_made_ready(be, s, rc ? 0 : vals ? 1 : 2);
    return rc;
}
