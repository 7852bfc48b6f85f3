/* dense.cu - the dense ops on the GPU: embed, residual add, the RMSNorms
 * (plain, plus_one, gated) and the row-norm kernel l2norm shares with them,
 * NeoX RoPE, SwiGLU, sigmoid, SiLU. The CPU reference is kernels/cpu/dense.c;
 * every formula below is written in its order, in fp32, and each output is
 * rounded to bf16 once (round to nearest even).
 *
 * Layout. Every op sees its tensors as rows of contiguous elements (the
 * last dim) addressed through up to three outer dims with arbitrary
 * strides. The host first simplifies that addressing (rows_of): size-1 dims
 * vanish, outer dims every operand steps over contiguously merge, and for
 * elementwise ops a fully contiguous tensor becomes one long row, so the
 * common case runs without per-row index math. Rows whose starts are all
 * 16-byte aligned use 16-byte vectors (8 bf16) and a scalar tail; anything
 * else (odd strides) takes the scalar path of the same kernel.
 *
 * Launch shapes. Elementwise work is a 2-D grid of rows x units (a unit is
 * one vector or one element); short rows are packed several to a block so
 * narrow tensors (gates, per-head slices) still fill warps. Norms give a row
 * a warp (D <= 1024: per-head q/k norms, the GDN output norm) or a whole
 * block (the hidden size); both loop grid-stride over rows. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"


namespace {

constexpr int NT = 256;  /* threads per block */
constexpr int VEC = 8;   /* bf16 per 16-byte vector */
constexpr int MAXT = 3;  /* operands sharing one row layout */
constexpr unsigned GRID_CAP = 65535; /* grid dims stay within y/z limits; loops cover the rest */

enum { NORM_RMS, NORM_RMS_P1, NORM_GATED, NORM_L2 };

__host__ __device__ __forceinline__ int64_t cdiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

/* ---- bf16 <-> f32 ---- */

__device__ __forceinline__ float bf2f(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

__device__ __forceinline__ uint16_t f2bf(float f)
{
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

__device__ __forceinline__ void load8(const uint16_t *p, float *f)
{
    uint4 u = *reinterpret_cast<const uint4 *>(p);
    uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        f[2 * j] = __uint_as_float(w[j] << 16);
        f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi)
{
    return (uint32_t)f2bf(lo) | ((uint32_t)f2bf(hi) << 16);
}

__device__ __forceinline__ void store8(uint16_t *p, const float *f)
{
    uint4 u;
    u.x = pack2(f[0], f[1]);
    u.y = pack2(f[2], f[3]);
    u.z = pack2(f[4], f[5]);
    u.w = pack2(f[6], f[7]);
    *reinterpret_cast<uint4 *>(p) = u;
}

/* As the CPU: x / (1 + e^-x), so x -> -inf gives -0, never NaN. */
__device__ __forceinline__ float silu_f(float x)
{
    return x / (1.0f + expf(-x));
}

__device__ __forceinline__ float sigmoid_f(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

/* ---- row layout ---- */

/* rows x cols, row r = (i0, i1, i2) with i2 fastest; st[k] are operand k's
 * element strides of i0, i1, i2 (0 for an unused slot). */
struct Rows {
    int64_t rows, cols;
    int64_t n1, n2;
    int64_t st[MAXT][3];
};

__device__ __forceinline__ void row_offsets(const Rows &L, int64_t r, int nt, int64_t *off)
{
    int64_t i0 = r, i1 = 0, i2 = 0;
    if (L.n1 != 1 || L.n2 != 1) { /* uniform branch: only true for 3-D/4-D strided views */
        i2 = r % L.n2;
        r /= L.n2;
        i1 = r % L.n1;
        i0 = r / L.n1;
    }
    for (int k = 0; k < nt; k++)
        off[k] = i0 * L.st[k][0] + i1 * L.st[k][1] + i2 * L.st[k][2];
}

/* Fills sizes n[0..m) and strides s[k][0..m) of t[0]'s outer dims, size-1
 * dims dropped, then merges neighbours every operand steps over
 * contiguously (the merged dim keeps the inner stride). */
int outer_dims(const df_tensor *const *t, int nt, int64_t *n, int64_t s[MAXT][4])
{
    int m = 0;
    for (int d = 0; d < t[0]->ndim - 1; d++) {
        if (t[0]->shape[d] == 1)
            continue;
        n[m] = t[0]->shape[d];
        for (int k = 0; k < nt; k++)
            s[k][m] = t[k]->stride[d];
        m++;
    }
    for (int d = m - 2; d >= 0; d--) {
        int ok = 1;
        for (int k = 0; k < nt; k++)
            ok &= s[k][d] == n[d + 1] * s[k][d + 1];
        if (!ok)
            continue;
        n[d] *= n[d + 1];
        for (int k = 0; k < nt; k++)
            s[k][d] = s[k][d + 1];
        for (int e = d + 1; e + 1 < m; e++) {
            n[e] = n[e + 1];
            for (int k = 0; k < nt; k++)
                s[k][e] = s[k][e + 1];
        }
        m--;
    }
    return m;
}

/* The shared row layout of nt same-shaped tensors. With merge_cols, outer
 * dims that continue a row contiguously in every operand fold into cols
 * (elementwise ops; a norm's row is its last dim and never grows). */
Rows rows_of(const df_tensor *const *t, int nt, int merge_cols)
{
    Rows L;
    memset(&L, 0, sizeof L);
    int64_t n[4], s[MAXT][4];
    int m = outer_dims(t, nt, n, s);
    L.cols = t[0]->shape[t[0]->ndim - 1];
    while (merge_cols && m > 0) {
        int ok = 1;
        for (int k = 0; k < nt; k++)
            ok &= s[k][m - 1] == L.cols;
        if (!ok)
            break;
        L.cols *= n[m - 1];
        m--;
    }
    L.rows = 1;
    L.n1 = L.n2 = 1;
    for (int j = 0; j < m; j++) {
        L.rows *= n[j];
        for (int k = 0; k < nt; k++)
            L.st[k][j] = s[k][j];
    }
    if (m > 1)
        L.n1 = n[1];
    if (m > 2)
        L.n2 = n[2];
    return L;
}

/* 1 when every row start of every operand (and each extra pointer) is
 * 16-byte aligned, so rows can be read in 8-element vectors. */
int rows_vec_ok(const Rows &L, const void *const *p, int np, int nt)
{
    for (int i = 0; i < np; i++)
        if (p[i] && ((uintptr_t)p[i] & 15u))
            return 0;
    for (int k = 0; k < nt; k++)
        for (int j = 0; j < 3; j++)
            if (L.st[k][j] % VEC)
                return 0;
    return 1;
}

unsigned capped(int64_t n)
{
    return n < 1 ? 1u : n > GRID_CAP ? GRID_CAP : (unsigned)n;
}

struct Launch {
    dim3 grid, block;
};

/* rows x units in blocks of NT threads: x over a row's units, y over rows;
 * a row with fewer than NT units shares its block with other rows. */
Launch rows_launch(int64_t rows, int64_t units)
{
    int tx = 1;
    while (tx < units && tx < NT)
        tx <<= 1;
    int ty = NT / tx;
    Launch l;
    l.block = dim3((unsigned)tx, (unsigned)ty, 1);
    l.grid = dim3(capped(cdiv(units, tx)), capped(cdiv(rows, ty)), 1);
    return l;
}

#define ROW_LOOP(r, rows) \
    for (int64_t r = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; r < (rows); \
         r += (int64_t)gridDim.y * blockDim.y)
#define UNIT_LOOP(u, units) \
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < (units); \
         u += (int64_t)gridDim.x * blockDim.x)

/* ---- embed ---- */

struct EmbedArgs {
    const uint16_t *table;
    const uint32_t *ids;
    uint16_t *out;
    int64_t n, H, ts, os;
    int vec;
};

/* A bit copy: table rows are already bf16. */
__global__ void embed_kernel(EmbedArgs p)
{
    const int64_t units = p.vec ? cdiv(p.H, VEC) : p.H;
    ROW_LOOP(i, p.n)
    {
        const uint16_t *src = p.table + (int64_t)p.ids[i] * p.ts;
        uint16_t *dst = p.out + i * p.os;
        UNIT_LOOP(u, units)
        {
            int64_t c = p.vec ? u * VEC : u;
            if (p.vec && c + VEC <= p.H) {
                *reinterpret_cast<uint4 *>(dst + c) = *reinterpret_cast<const uint4 *>(src + c);
                continue;
            }
            for (int64_t e = c; e < p.H && e < c + (p.vec ? VEC : 1); e++)
                dst[e] = src[e];
        }
    }
}

/* ---- elementwise ---- */

enum { EW_ADD, EW_SWIGLU, EW_SIGMOID, EW_SILU };

/* Operand slots of the layout: 0 = a, 1 = out, 2 = b (binary ops). */
struct EwArgs {
    Rows L;
    const uint16_t *a, *b;
    uint16_t *out;
    int op, vec;
};

__device__ __forceinline__ float ew_math(int op, float a, float b)
{
    switch (op) {
    case EW_ADD:
        return a + b;
    case EW_SWIGLU:
        return silu_f(a) * b;
    case EW_SIGMOID:
        return sigmoid_f(a);
    default:
        return silu_f(a);
    }
}

/* out may be exactly a or b: each element is read and written by one
 * thread, reads first. */
__global__ void ew_kernel(EwArgs p)
{
    const int64_t cols = p.L.cols, units = p.vec ? cdiv(cols, VEC) : cols;
    const int nt = p.b ? 3 : 2;
    ROW_LOOP(r, p.L.rows)
    {
        int64_t off[MAXT];
        row_offsets(p.L, r, nt, off);
        const uint16_t *a = p.a + off[0], *b = p.b ? p.b + off[2] : nullptr;
        uint16_t *o = p.out + off[1];
        UNIT_LOOP(u, units)
        {
            int64_t c = p.vec ? u * VEC : u;
            if (p.vec && c + VEC <= cols) {
                float fa[VEC], fb[VEC];
                load8(a + c, fa);
                if (b)
                    load8(b + c, fb);
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    fa[j] = ew_math(p.op, fa[j], b ? fb[j] : 0.0f);
                store8(o + c, fa);
                continue;
            }
            for (int64_t e = c; e < cols && e < c + (p.vec ? VEC : 1); e++)
                o[e] = f2bf(ew_math(p.op, bf2f(a[e]), b ? bf2f(b[e]) : 0.0f));
        }
    }
}

/* ---- row norms ---- */

/* Operand slots: 0 = x, 1 = y, 2 = z (gated). w is a contiguous [D] weight
 * (NULL for l2norm). */
struct NormArgs {
    Rows L;
    const uint16_t *x, *z, *w;
    uint16_t *y;
    float eps, scale;
    int mode, vec;
};

/* The sum over a row's TPR threads, in every one of them. */
template <int TPR>
__device__ __forceinline__ float row_sum(float v, float *red)
{
    static_assert(TPR % 32 == 0 && TPR <= NT, "a row is whole warps of one block");
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    if (TPR == 32)
        return v;
    if (threadIdx.x % 32 == 0)
        red[threadIdx.x / 32] = v;
    __syncthreads();
    float t = 0.0f;
#pragma unroll
    for (int i = 0; i < TPR / 32; i++)
        t += red[i];
    __syncthreads(); /* red is rewritten for the next row */
    return t;
}

/* The CPU's per-element formulas, same order. */
__device__ __forceinline__ float norm_out(int mode, float x, float inv, float w, float z,
                                          float scale)
{
    switch (mode) {
    case NORM_RMS:
        return w * (x * inv);
    case NORM_RMS_P1:
        return (1.0f + w) * (x * inv);
    case NORM_GATED:
        return w * (x * inv) * silu_f(z);
    default:
        return (x * inv) * scale;
    }
}

__device__ float norm_sumsq(const NormArgs &p, const uint16_t *x, int lane, int tpr)
{
    const int64_t D = p.L.cols, nv = p.vec ? D / VEC : 0;
    float ss = 0.0f;
    for (int64_t v = lane; v < nv; v += tpr) {
        float f[VEC];
        load8(x + v * VEC, f);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            ss += f[j] * f[j];
    }
    for (int64_t i = nv * VEC + lane; i < D; i += tpr) {
        float f = bf2f(x[i]);
        ss += f * f;
    }
    return ss;
}

/* y may be x: every element is read before it is written, by one thread,
 * and the row sum (a warp/block barrier) separates the two passes. */
__device__ void norm_write(const NormArgs &p, const uint16_t *x, const uint16_t *z, uint16_t *y,
                           float inv, int lane, int tpr)
{
    const int64_t D = p.L.cols, nv = p.vec ? D / VEC : 0;
    for (int64_t v = lane; v < nv; v += tpr) {
        float f[VEC], w[VEC], g[VEC];
        load8(x + v * VEC, f);
        if (p.w)
            load8(p.w + v * VEC, w);
        if (z)
            load8(z + v * VEC, g);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            f[j] = norm_out(p.mode, f[j], inv, p.w ? w[j] : 0.0f, z ? g[j] : 0.0f, p.scale);
        store8(y + v * VEC, f);
    }
    for (int64_t i = nv * VEC + lane; i < D; i += tpr)
        y[i] = f2bf(norm_out(p.mode, bf2f(x[i]), inv, p.w ? bf2f(p.w[i]) : 0.0f,
                             z ? bf2f(z[i]) : 0.0f, p.scale));
}

/* TPR threads per row (32: a warp; NT: the block), NT / TPR rows per block. */
template <int TPR>
__global__ void __launch_bounds__(NT) norm_kernel(NormArgs p)
{
    constexpr int RPB = NT / TPR;
    __shared__ float red[NT / 32];
    const int lane = (int)threadIdx.x % TPR, sub = (int)threadIdx.x / TPR;
    /* r is uniform over a row's threads, so the barriers in row_sum are too. */
    for (int64_t r = (int64_t)blockIdx.x * RPB + sub; r < p.L.rows;
         r += (int64_t)gridDim.x * RPB) {
        int64_t off[MAXT];
        row_offsets(p.L, r, p.z ? 3 : 2, off);
        const uint16_t *x = p.x + off[0], *z = p.z ? p.z + off[2] : nullptr;
        float ss = row_sum<TPR>(norm_sumsq(p, x, lane, TPR), red);
        /* HF: rsqrt(mean(x^2) + eps) for RMSNorm, rsqrt(sum(x^2) + eps) for
         * l2norm, both as 1 / sqrt() like the CPU. */
        float inv = p.mode == NORM_L2 ? 1.0f / sqrtf(ss + p.eps)
                                         : 1.0f / sqrtf(ss / (float)p.L.cols + p.eps);
        norm_write(p, x, z, p.y + off[1], inv, lane, TPR);
    }
}

/* ---- RoPE ---- */

struct RopeArgs {
    uint16_t *x;
    const int32_t *pos;
    const float *inv_freq;
    int64_t T, stride;
    int heads, head_dim, half, nchunk;
};

/* One unit = V consecutive pairs (d, d + half) of one head of one row;
 * V == VEC when every such run is 16-byte aligned. Dims >= rot_dim are
 * never touched. */
template <int V>
__global__ void rope_kernel(RopeArgs p)
{
    const int64_t units = (int64_t)p.heads * p.nchunk;
    ROW_LOOP(t, p.T)
    {
        const float pf = (float)p.pos[t];
        UNIT_LOOP(u, units)
        {
            const int h = (int)(u / p.nchunk), d0 = (int)(u % p.nchunk) * V;
            uint16_t *v = p.x + t * p.stride + (int64_t)h * p.head_dim;
            float x1[V], x2[V];
            const int nd = p.half - d0 < V ? p.half - d0 : V;
            if (V == VEC) {
                load8(v + d0, x1);
                load8(v + d0 + p.half, x2);
            } else {
                for (int j = 0; j < nd; j++) {
                    x1[j] = bf2f(v[d0 + j]);
                    x2[j] = bf2f(v[d0 + p.half + j]);
                }
            }
#pragma unroll
            for (int j = 0; j < V; j++) {
                if (j >= nd)
                    break;
                /* HF: one fp32 product pos * inv_freq, cos/sin in fp32. */
                float s, c;
                sincosf(pf * p.inv_freq[d0 + j], &s, &c);
                float a = x1[j], b = x2[j];
                x1[j] = a * c - b * s;
                x2[j] = b * c + a * s;
            }
            if (V == VEC) {
                store8(v + d0, x1);
                store8(v + d0 + p.half, x2);
            } else {
                for (int j = 0; j < nd; j++) {
                    v[d0 + j] = f2bf(x1[j]);
                    v[d0 + p.half + j] = f2bf(x2[j]);
                }
            }
        }
    }
}

/* ---- host side ---- */

int ew_run(df_backend *be, const df_tensor *a, const df_tensor *b, df_tensor *out, int op)
{
    if (df_tensor_numel(out) == 0)
        return 0;
    const df_tensor *t[MAXT] = {a, out, b};
    EwArgs p;
    p.L = rows_of(t, b ? 3 : 2, 1);
    p.a = (const uint16_t *)a->data;
    p.b = b ? (const uint16_t *)b->data : nullptr;
    p.out = (uint16_t *)out->data;
    p.op = op;
    const void *ptrs[3] = {p.a, p.b, p.out};
    p.vec = rows_vec_ok(p.L, ptrs, 3, b ? 3 : 2);
    Launch l = rows_launch(p.L.rows, p.vec ? cdiv(p.L.cols, VEC) : p.L.cols);
    ew_kernel<<<l.grid, l.block, 0, df_cuda_stream(be)>>>(p);
    return df_cuda_check_launch("elementwise kernel");
}

} /* namespace */

static int norm_rows(df_backend *be, int mode, const df_tensor *x, const df_tensor *z,
                     const df_tensor *w, float eps, float scale, df_tensor *y)
{
    if (df_tensor_numel(x) == 0)
        return 0;
    const df_tensor *t[MAXT] = {x, y, z};
    const int nt = z ? 3 : 2;
    NormArgs p;
    p.L = rows_of(t, nt, 0);
    p.x = (const uint16_t *)x->data;
    p.y = (uint16_t *)y->data;
    p.z = z ? (const uint16_t *)z->data : nullptr;
    p.w = w ? (const uint16_t *)w->data : nullptr;
    p.eps = eps;
    p.scale = scale;
    p.mode = mode;
    const void *ptrs[4] = {p.x, p.y, p.z, p.w};
    p.vec = rows_vec_ok(p.L, ptrs, 4, nt);
    cudaStream_t st = df_cuda_stream(be);
    if (p.L.cols <= 1024) {
        norm_kernel<32><<<capped(cdiv(p.L.rows, NT / 32)), NT, 0, st>>>(p);
    } else {
        norm_kernel<NT><<<capped(p.L.rows), NT, 0, st>>>(p);
    }
    return df_cuda_check_launch("norm kernel");
}

int df_cuda_embed(df_backend *be, const df_tensor *table, const uint32_t *ids, int64_t n,
                  df_tensor *out)
{
    if (n == 0 || out->shape[1] == 0)
        return 0;
    /* ids < V <= INT64 were checked; the bits are staged as int32 and read
     * back as uint32. */
    const int32_t *dids = df_cuda_stage_i32(be, (const int32_t *)ids, n);
    if (!dids)
        return -EIO;
    EmbedArgs p;
    p.table = (const uint16_t *)table->data;
    p.ids = (const uint32_t *)dids;
    p.out = (uint16_t *)out->data;
    p.n = n;
    p.H = out->shape[1];
    p.ts = table->stride[0];
    p.os = out->stride[0];
    p.vec = !((uintptr_t)p.table & 15u) && !((uintptr_t)p.out & 15u) && p.ts % VEC == 0 &&
            p.os % VEC == 0;
    Launch l = rows_launch(n, p.vec ? cdiv(p.H, VEC) : p.H);
    embed_kernel<<<l.grid, l.block, 0, df_cuda_stream(be)>>>(p);
    return df_cuda_check_launch("embed kernel");
}

int df_cuda_l2norm_rows(df_backend *be, df_tensor *x, float eps, float scale)
{
    return norm_rows(be, NORM_L2, x, NULL, NULL, eps, scale, x);
}

int df_cuda_add(df_backend *be, const df_tensor *x, df_tensor *y)
{
    return ew_run(be, x, y, y, EW_ADD);
}

int df_cuda_rmsnorm(df_backend *be, const df_tensor *x, const df_tensor *w, float eps,
                    int plus_one, df_tensor *y)
{
    return norm_rows(be, plus_one ? NORM_RMS_P1 : NORM_RMS, x, NULL, w, eps, 1.0f,
                             y);
}

int df_cuda_rmsnorm_gated(df_backend *be, const df_tensor *x, const df_tensor *z,
                          const df_tensor *w, float eps, df_tensor *y)
{
    return norm_rows(be, NORM_GATED, x, z, w, eps, 1.0f, y);
}

/* inv_freq exactly as the CPU computes it (host powf, bit for bit), staged
 * through the int32 path as raw bits: a device powf may differ by an ulp,
 * which pos ~ 1e5 would turn into a visible angle error. */
static const float *rope_inv_freq(df_backend *be, int rot_dim, double theta)
{
    int nh = rot_dim / 2;
    int32_t *bits = (int32_t *)malloc((size_t)nh * sizeof(int32_t));
    if (!bits)
        return NULL;
    float base = (float)theta;
    for (int d = 0; d < nh; d++) {
        float f = 1.0f / powf(base, (float)(2 * d) / (float)rot_dim);
        memcpy(&bits[d], &f, sizeof f);
    }
    const int32_t *dev = df_cuda_stage_i32(be, bits, nh);
    free(bits);
    return (const float *)dev;
}

int df_cuda_rope(df_backend *be, df_tensor *x, const int32_t *pos, int heads, int head_dim,
                 int rot_dim, double theta)
{
    int64_t T = x->shape[0];
    if (T == 0)
        return 0;
    RopeArgs p;
    p.inv_freq = rope_inv_freq(be, rot_dim, theta);
    p.pos = df_cuda_stage_i32(be, pos, T);
    if (!p.inv_freq || !p.pos)
        return -EIO;
    p.x = (uint16_t *)x->data;
    p.T = T;
    p.stride = x->stride[0];
    p.heads = heads;
    p.head_dim = head_dim;
    p.half = rot_dim / 2;
    int vec = p.half % VEC == 0 && head_dim % VEC == 0 && p.stride % VEC == 0 &&
              !((uintptr_t)p.x & 15u);
    p.nchunk = vec ? p.half / VEC : p.half;
    Launch l = rows_launch(T, (int64_t)heads * p.nchunk);
    cudaStream_t st = df_cuda_stream(be);
    if (vec)
        rope_kernel<VEC><<<l.grid, l.block, 0, st>>>(p);
    else
        rope_kernel<1><<<l.grid, l.block, 0, st>>>(p);
    return df_cuda_check_launch("rope kernel");
}

int df_cuda_swiglu(df_backend *be, const df_tensor *gate, const df_tensor *up, df_tensor *out)
{
    return ew_run(be, gate, up, out, EW_SWIGLU);
}

int df_cuda_sigmoid(df_backend *be, const df_tensor *x, df_tensor *out)
{
    return ew_run(be, x, NULL, out, EW_SIGMOID);
}

int df_cuda_silu(df_backend *be, const df_tensor *x, df_tensor *out)
{
    return ew_run(be, x, NULL, out, EW_SILU);
}
