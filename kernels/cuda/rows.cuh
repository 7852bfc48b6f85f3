/* rows.cuh - the row layout dense.cu and train_dense.cu share, one copy
 * for both: a tensor is rows of contiguous elements (its last dim)
 * addressed through up to three outer dims with arbitrary strides,
 * simplified on the host (rows_of); and the 2-D launch shape and loops of
 * the kernels that walk rows x units (rows_launch, ROW_LOOP, UNIT_LOOP).
 *
 * The includer declares MAXT (operands sharing one layout) and NT (threads
 * per block) first. Rows, a kernel argument, holds MAXT operands' strides:
 * dense.cu has 3, train_dense.cu 5, and one common maximum would grow
 * dense.cu's kernel arguments (and change its code). Everything here is in
 * the anonymous namespace, so each file has its own Rows. How a kernel
 * turns a row into offsets, and when vectors are allowed, stays in each
 * file (their versions differ). */
#ifndef DF_CUDA_ROWS_CUH
#define DF_CUDA_ROWS_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "cuda_internal.h"

namespace {

static_assert(MAXT >= 1 && NT >= 1, "declare MAXT and NT before including rows.cuh");

constexpr unsigned GRID_CAP = 65535; /* grid dims stay within y/z limits; loops cover the rest */

__host__ __device__ __forceinline__ int64_t cdiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

/* rows x cols, row r = (i0, i1, i2) with i2 fastest; st[k] are operand k's
 * element strides of i0, i1, i2 (0 for an unused slot). */
struct Rows {
    int64_t rows, cols;
    int64_t n1, n2;
    int64_t st[MAXT][3];
};

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
 * (elementwise ops; a norm's row is its last dim and never grows). The
 * unused slots (nt..MAXT) are zero. */
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

} /* namespace */

/* Grid-stride loops over rows_launch's grid: y over rows, x over units. */
#define ROW_LOOP(r, rows) \
    for (int64_t r = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; r < (rows); \
         r += (int64_t)gridDim.y * blockDim.y)
#define UNIT_LOOP(u, units) \
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < (units); \
         u += (int64_t)gridDim.x * blockDim.x)

#endif
