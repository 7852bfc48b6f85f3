/* train_test_util.h - what the CPU training-op tests (test_train_ops.c, test_optim.c) share:
 * the two CPU backends every op runs on (1 and 3 threads: outputs must be bitwise equal), the
 * random draws, buffers, and the checks of a value against its reference. Each test file has
 * its own copy of this state (static). */
#ifndef DF_TRAIN_TEST_UTIL_H
#define DF_TRAIN_TEST_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"
#include "train_ops.h"

static uint64_t rng = 7;
static df_backend *bes[2]; /* 1 and 3 threads */
static const double U = 5.9604644775390625e-08; /* 2^-24, fp32's unit roundoff */

/* Opens bes[]; 0, or 1 with a message. */
static inline int open_backends(void)
{
    df_err e = {0};
    bes[0] = df_backend_cpu_open(1, &e);
    bes[1] = df_backend_cpu_open(3, &e);
    if (!bes[0] || !bes[1]) {
        fprintf(stderr, "cannot open the cpu backend: %s\n", e.msg);
        return 1;
    }
    return 0;
}

static inline void close_backends(void)
{
    df_backend_close(bes[0]);
    df_backend_close(bes[1]);
}

static inline void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

static inline float *fbuf(int64_t n)
{
    return xmalloc((size_t)(n > 0 ? n : 1) * sizeof(float));
}

static inline double *dbuf(int64_t n)
{
    double *p = xmalloc((size_t)(n > 0 ? n : 1) * sizeof(double));
    memset(p, 0, (size_t)(n > 0 ? n : 1) * sizeof(double));
    return p;
}

static inline void fill(float *p, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++)
        p[i] = test_randn(&rng) * scale;
}

static inline int bitwise_equal(const void *a, const void *b, int64_t bytes)
{
    return memcmp(a, b, (size_t)bytes) == 0;
}

/* |got - ref| <= tol, NaN never passes; the first few misses are printed. */
static int n_miss;
static inline void expect_close(const char *what, double got, double ref, double tol, int64_t idx)
{
    if (fabs(got - ref) <= tol)
        return;
    if (n_miss++ < 12)
        fprintf(stderr, "%s: element %lld: got %.9g, want %.9g (tol %.3g)\n", what,
                (long long)idx, got, ref, tol);
    df_test_failures++;
}

/* RNE to bf16, independently of dtype.h: the nearer of the two bf16
 * neighbours (truncation and the next one up in magnitude), ties to even. */
static inline int is_bf16_rne(float f, uint16_t h)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
    float flo, fhi;
    memcpy(&flo, &lo, 4);
    memcpy(&fhi, &hi, 4);
    double dlo = fabs((double)f - flo), dhi = fabs((double)fhi - f);
    uint16_t want = dlo < dhi ? (uint16_t)(lo >> 16)
                    : dhi < dlo ? (uint16_t)(hi >> 16)
                                : (uint16_t)(((lo >> 16) & 1) ? hi >> 16 : lo >> 16);
    return h == want;
}

static inline float bf_val(uint16_t h) /* exact, by the bit layout */
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}


#endif
