/* rope.cu - NeoX RoPE on the GPU, forward (df_cuda_rope, in place on the
 * rows of q or k) and backward (df_cuda_rope_bwd: the transposed rotation,
 * sin negated). The CPU references are kernels/cpu/dense.c and
 * kernels/cpu/train_dense.c; per pair the formula of the CPU's order in
 * fp32 (HF's: one fp32 product pos * inv_freq, cos / sin in fp32), each
 * output rounded to bf16 once. The forward's aligned rows take
 * rope_vec_kernel (a token's cos / sin once per 8 pairs, applied to ~4
 * heads per thread); everything else, and the backward, the general
 * rows x units kernel (rows.cuh). */
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.cuh"
#include "cuda_internal.h"
#include "train_cuda.h"

/* Before rows.cuh, which is sized by them. */
constexpr int NT = 256; /* threads per block */
constexpr int MAXT = 1; /* operands sharing one row layout */
#include "rows.cuh"

namespace {

constexpr int64_t IDX_LIMIT = (int64_t)1 << 31; /* the vector path's token index range */

struct RopeArgs {
    uint16_t *x;
    const int32_t *pos;
    const float *inv_freq;
    int64_t T, stride;
    int heads, head_dim, half, nchunk;
    float sign; /* the backward's sin factor, -1: a value the compiler does not see, so
                 * its products keep the order they have with any sign */
};

/* One unit = V consecutive pairs (d, d + half) of one head of one row;
 * V == VEC when every such run is 16-byte aligned. Dims >= rot_dim are
 * never touched. BWD: the backward, the transposed rotation (sin times
 * p.sign = -1: exact, as the CPU's). */
template <int V, bool BWD>
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
                if (BWD)
                    s = p.sign * s;
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

/* The vector path of RoPE (as rope_kernel<VEC>'s condition, and half / 8
 * <= NT). cos / sin depend on (token, pair) only, so a thread keeps the 8
 * of its chunk of pairs and applies them to several heads: per token, hs
 * head slots x nchunk chunks of threads, slot s taking heads s, s + hs, ...
 * (hs about heads / ROPE_H, so about ROPE_H heads each); tpb tokens share a
 * block. A thread's heads are loaded ROPE_H at a time, the first batch
 * before its sincosf so their latency overlaps. Same math per pair as
 * rope_kernel. */
constexpr int ROPE_H = 4;

struct RopeVArgs {
    uint16_t *x;
    const int32_t *pos;
    const float *inv_freq;
    int64_t stride;
    int T, heads, head_dim, half, nchunk, hs, tpt, tpb;
};

__global__ void __launch_bounds__(NT) rope_vec_kernel(RopeVArgs p)
{
    const int sub = (int)threadIdx.x / p.tpt, i = (int)threadIdx.x - sub * p.tpt;
    const int t = (int)blockIdx.x * p.tpb + sub;
    if (sub >= p.tpb || t >= p.T)
        return; /* no barriers below */
    const int hs = i / p.nchunk, d0 = (i - hs * p.nchunk) * VEC;
    uint16_t *row = p.x + (int64_t)t * p.stride + d0;
    const int step = ROPE_H * p.hs;
    uint4 a[ROPE_H], b[ROPE_H];
    int h0 = hs; /* < heads: hs <= heads */
#pragma unroll
    for (int k = 0; k < ROPE_H; k++) {
        const int h = h0 + k * p.hs;
        a[k] = b[k] = make_uint4(0, 0, 0, 0);
        if (h < p.heads) {
            a[k] = ld16(row + (int64_t)h * p.head_dim);
            b[k] = ld16(row + (int64_t)h * p.head_dim + p.half);
        }
    }
    /* HF: one fp32 product pos * inv_freq, cos/sin in fp32. */
    const float pf = (float)p.pos[t];
    float cs[VEC], sn[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j++)
        sincosf(pf * p.inv_freq[d0 + j], &sn[j], &cs[j]);
    for (;;) {
#pragma unroll
        for (int k = 0; k < ROPE_H; k++) {
            const int h = h0 + k * p.hs;
            if (h >= p.heads)
                continue;
            float x1[VEC], x2[VEC];
            unpack8(a[k], x1);
            unpack8(b[k], x2);
#pragma unroll
            for (int j = 0; j < VEC; j++) {
                float u = x1[j], w = x2[j];
                x1[j] = u * cs[j] - w * sn[j];
                x2[j] = w * cs[j] + u * sn[j];
            }
            store8(row + (int64_t)h * p.head_dim, x1);
            store8(row + (int64_t)h * p.head_dim + p.half, x2);
        }
        h0 += step;
        if (h0 >= p.heads)
            break;
#pragma unroll
        for (int k = 0; k < ROPE_H; k++) {
            const int h = h0 + k * p.hs;
            if (h < p.heads) {
                a[k] = ld16(row + (int64_t)h * p.head_dim);
                b[k] = ld16(row + (int64_t)h * p.head_dim + p.half);
            }
        }
    }
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

/* The arguments of a rotation of x (T rows of heads x head_dim, in place) by
 * pos; *vec: whether every pair run is 16-byte aligned (the vector paths).
 * -EIO when the staging fails. */
static int rope_args(df_backend *be, df_tensor *x, const int32_t *pos, int heads, int head_dim,
                     int rot_dim, double theta, RopeArgs *p, int *vec)
{
    int64_t T = x->shape[0];
    p->inv_freq = rope_inv_freq(be, rot_dim, theta);
    p->pos = df_cuda_stage_i32(be, pos, T);
    if (!p->inv_freq || !p->pos)
        return -EIO;
    p->x = (uint16_t *)x->data;
    p->T = T;
    p->stride = x->stride[0];
    p->heads = heads;
    p->head_dim = head_dim;
    p->half = rot_dim / 2;
    p->sign = 1.0f;
    *vec = p->half % VEC == 0 && head_dim % VEC == 0 && p->stride % VEC == 0 &&
           !((uintptr_t)p->x & 15u);
    p->nchunk = *vec ? p->half / VEC : p->half;
    return 0;
}

} /* namespace */

int df_cuda_rope(df_backend *be, df_tensor *x, const int32_t *pos, int heads, int head_dim,
                 int rot_dim, double theta)
{
    int64_t T = x->shape[0];
    if (T == 0)
        return 0;
    RopeArgs p;
    int vec, rc = rope_args(be, x, pos, heads, head_dim, rot_dim, theta, &p, &vec);
    if (rc)
        return rc;
    cudaStream_t st = df_cuda_stream(be);
    if (vec && heads >= 1 && p.nchunk >= 1 && p.nchunk <= NT && T < IDX_LIMIT) {
        RopeVArgs q;
        q.x = p.x;
        q.pos = p.pos;
        q.inv_freq = p.inv_freq;
        q.stride = p.stride;
        q.T = (int)T;
        q.heads = heads;
        q.head_dim = head_dim;
        q.half = p.half;
        q.nchunk = p.nchunk;
        int hs = (heads + ROPE_H - 1) / ROPE_H, hs_max = NT / p.nchunk;
        q.hs = hs < hs_max ? hs : hs_max;
        q.tpt = q.hs * p.nchunk;
        q.tpb = NT / q.tpt;
        rope_vec_kernel<<<(unsigned)cdiv(T, q.tpb), (unsigned)(q.tpb * q.tpt), 0, st>>>(q);
        return df_cuda_check_launch("rope kernel");
    }
    Launch l = rows_launch(T, (int64_t)heads * p.nchunk);
    if (vec)
        rope_kernel<VEC, false><<<l.grid, l.block, 0, st>>>(p);
    else
        rope_kernel<1, false><<<l.grid, l.block, 0, st>>>(p);
    return df_cuda_check_launch("rope kernel");
}

int df_cuda_rope_bwd(df_backend *be, df_tensor *dx, const int32_t *pos, int heads, int head_dim,
                     int rot_dim, double theta)
{
    int64_t T = dx->shape[0];
    if (T == 0)
        return 0;
    RopeArgs p;
    int vec, rc = rope_args(be, dx, pos, heads, head_dim, rot_dim, theta, &p, &vec);
    if (rc)
        return rc;
    p.sign = -1.0f; /* the transpose of the rotation */
    Launch l = rows_launch(T, (int64_t)heads * p.nchunk);
    cudaStream_t st = df_cuda_stream(be);
    if (vec)
        rope_kernel<VEC, true><<<l.grid, l.block, 0, st>>>(p);
    else
        rope_kernel<1, true><<<l.grid, l.block, 0, st>>>(p);
    return df_cuda_check_launch("rope_bwd kernel");
}
