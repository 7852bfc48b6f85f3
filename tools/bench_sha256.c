/* bench_sha256 - SHA-256's rate with each compression this CPU has (the
 * portable code and the x86 SHA extensions), on the same buffer in one run:
 * median of REPEATS hashes of MIB MiB of pseudo-random bytes. The corpus
 * importer hashes every input byte twice (docs/log/2026-11-30-session-01.md), so this rate bounds
 * it. Never run by tests.
 * Usage: bench_sha256 [MIB (256)] [REPEATS (5)] */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sha256.h"

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    long mib = argc > 1 ? atol(argv[1]) : 256, reps = argc > 2 ? atol(argv[2]) : 5;
    if (mib < 1 || reps < 1 || reps > 99) {
        fprintf(stderr, "usage: bench_sha256 [MIB (256)] [REPEATS (1..99, 5)]\n");
        return 2;
    }
    size_t n = (size_t)mib << 20;
    uint8_t *buf = malloc(n);
    if (!buf) {
        fprintf(stderr, "bench_sha256: cannot allocate %ld MiB\n", mib);
        return 1;
    }
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        buf[i] = (uint8_t)(x >> 24);
    }
    const int hw = df_sha256_hw();
    char hex[2][DF_SHA256_HEX];
    for (int impl = 0; impl <= hw; impl++) {
        df_sha256_use_hw(impl);
        double t[99];
        for (long r = 0; r < reps; r++) {
            double t0 = now_s();
            df_sha256_hex_of(buf, n, hex[impl]);
            t[r] = now_s() - t0;
        }
        qsort(t, (size_t)reps, sizeof t[0], cmp_d);
        printf("%-9s %8.1f MB/s (median of %ld, %ld MiB; best %.1f)  %s\n", impl ? "SHA-NI" : "portable",
               (double)n / t[reps / 2] / 1e6, reps, mib, (double)n / t[0] / 1e6, hex[impl]);
    }
    if (!hw)
        printf("SHA-NI    not on this CPU\n");
    else if (strcmp(hex[0], hex[1]))
        return fprintf(stderr, "bench_sha256: the two digests differ\n"), 1;
    free(buf);
    return 0;
}
